//! The conformance cases without a norm in f64 or f32, forward only: `evaluate` and `forward` in
//! the case's mode, each case as a float64 and a float32 layer (the case's values converted).

#[macro_use]
mod common;

/// A case of `for_each_case!`, if without a norm and in a full-precision dtype.
macro_rules! case {
    ($name:ident, f64, [;], $spec:tt) => {
        case!(@ $name, $spec);
    };
    ($name:ident, f32, [;], $spec:tt) => {
        case!(@ $name, $spec);
    };
    ($name:ident, $dtype:ident, $fields:tt, $spec:tt) => {};
    (@ $name:ident, $spec:tt) => {
        conformance_case! { $name,
            mod as_f64 {
                conformance_tests!(forward, Cpu = crate::common::cpu(), f64, Case, [;], $spec);
            }

            mod as_f32 {
                conformance_tests!(forward, Cpu = crate::common::cpu(), f32, Case, [;], $spec);
            }
        }
    };
}

for_each_case!(case);
