//! Every conformance case through the whole public API: `evaluate`, `forward` (output and
//! BatchNorm running statistics), `backward_full`, `backward_input` + `backward`, gradient
//! accumulation and `zero`. Each case runs as a float64 and a float32 layer (the case's values
//! converted), the half-precision cases also in their own type, and as a float32 layer on the
//! oneDNN device.

#[macro_use]
mod common;

/// A case of `for_each_case!`: the reference's check and the case's layers.
macro_rules! case {
    ($name:ident, f16, $fields:tt, $spec:tt) => {
        case!(@ $name, [as_f16: f16], $fields, $spec);
    };
    ($name:ident, bf16, $fields:tt, $spec:tt) => {
        case!(@ $name, [as_bf16: bf16], $fields, $spec);
    };
    ($name:ident, $dtype:ident, $fields:tt, $spec:tt) => {
        case!(@ $name, [], $fields, $spec);
    };
    (@ $name:ident, [$($module:ident: $t:ident)?], $fields:tt, $spec:tt) => {
        conformance_case! { $name,
            #[test]
            fn reference_reproduces_the_case() {
                crate::common::conformance::check_reference(&case());
            }

            mod as_f64 {
                conformance_tests!(training, Cpu = crate::common::cpu(), f64, Case, $fields, $spec);
            }

            mod as_f32 {
                conformance_tests!(training, Cpu = crate::common::cpu(), f32, Case, $fields, $spec);
            }

            $(mod $module {
                conformance_tests!(training, Cpu = crate::common::cpu(), $t, Case, $fields, $spec);
            })?

            /// The same case on the oneDNN device, as an f32 layer.
            #[cfg(feature = "onednn")]
            mod onednn_f32 {
                conformance_tests!(
                    training, OneDnn = OneDnn::new().unwrap(), f32, Case, $fields, $spec
                );
            }
        }
    };
}

for_each_case!(case);
