//! Every conformance case as a float16 and a bfloat16 layer, through the whole public API:
//! `evaluate`, `forward` (output and BatchNorm running statistics), `backward_full`,
//! `backward_input` + `backward`, gradient accumulation and `zero`.
//!
//! Rounding a case's values to a half type changes the problem, so every quantity is compared
//! with the float64 reference of tests/common computed from the same rounded input, parameters,
//! `d_output` and running statistics (the latter rounded to `<T as Element>::Acc`, the type the
//! layer keeps them in). A case in its own dtype (p11 as bf16, p12 as f16) loses nothing to the
//! rounding and is also compared with the case's expected values.

#[macro_use]
mod common;

/// A case of `for_each_case!` as a layer of each half type.
macro_rules! case {
    ($name:ident, $dtype:ident, $fields:tt, $spec:tt) => {
        conformance_case! { $name,
            mod as_f16 {
                conformance_tests!(training, Cpu = crate::common::cpu(), f16, Rounded, $fields, $spec);
            }

            mod as_bf16 {
                conformance_tests!(training, Cpu = crate::common::cpu(), bf16, Rounded, $fields, $spec);
            }
        }
    };
}

for_each_case!(case);
