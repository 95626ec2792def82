//! Many specs (sizes, strides, paddings, kernels, activations, channel counts, batches, dtypes),
//! each a layer from `Layer::new`: the shape constants, `evaluate` at two batch sizes, `evaluate`
//! with one `Cpu` across layers and parameter changes, `forward`, and (the conformance cases
//! being small) `backward_full`, against the float64 reference in tests/common on the same values.

#[macro_use]
mod common;

/// The tests of `spec_tests!` for a spec of `for_each_spec!(parsed ..)`, in its own dtype.
macro_rules! spec {
    ($name:ident, $spec:expr, { $($keys:tt)* }, [$($dtype:ident)?]) => {
        mod $name {
            spec_tests!($name, $spec, { $($keys)* $(dtype: $dtype,)? });

            /// One `Cpu` serving two layers, and a layer whose parameters change in place.
            #[test]
            fn cpu_caches_follow_the_parameters() {
                let mut cpu = crate::common::cpu();
                let ((mut a, mut params_a), (b, params_b)) = (layer(SEED), layer(SEED + 1));
                check_evaluate::<1>(&mut cpu, &a, &params_a);
                check_evaluate::<1>(&mut cpu, &b, &params_b);
                check_evaluate::<1>(&mut cpu, &a, &params_a);
                a.weights.as_mut_slice().reverse();
                a.biases.as_mut_slice().reverse();
                params_a.weights.reverse();
                params_a.biases.reverse();
                check_evaluate::<1>(&mut cpu, &a, &params_a);
            }
        }
    };
}

for_each_spec!(parsed spec);
