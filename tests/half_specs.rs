//! The generated specs of tests/common/spec_list.rs (those of tests/specs_forward.rs, same
//! names, their dtype replaced), each as a float16 and a bfloat16 layer from `Layer::new`: the
//! shape constants, `evaluate` at two batch sizes, `forward` and `backward_full`, against the
//! float64 reference in tests/common on the same half-precision input, parameters and
//! `d_output`. Outputs are stored in the half type, so they carry its rounding (~3 significant
//! digits for bf16); sums are accumulated in f32 and gradients kept in f32.

#[macro_use]
mod common;

/// The tests of `spec_tests!` for a spec of `for_each_spec!(parsed ..)`, once per half type in
/// place of the spec's dtype.
macro_rules! spec {
    ($name:ident, $spec:expr, { $($keys:tt)* }, $dtype:tt) => {
        mod $name {
            mod as_f16 {
                spec_tests!($name, $spec, { $($keys)* dtype: f16, });
            }

            mod as_bf16 {
                spec_tests!($name, $spec, { $($keys)* dtype: bf16, });
            }
        }
    };
}

for_each_spec!(parsed spec);
