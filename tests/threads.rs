//! The `Cpu` device computes the same bits on any number of threads: every generated spec (in
//! its own element type, and a Winograd and a direct spec in each half type), without a norm,
//! with BatchNorm and with LayerNorm, through every operation (tests/common/operations.rs), on
//! 2, 3, 4, 7 and 16 threads (more than this machine's cores) against one thread. The devices
//! split every call however small, so the small specs take the parallel paths too.

#[macro_use]
mod common;

/// Thread counts checked against one thread.
const THREADS: [usize; 5] = [2, 3, 4, 7, 16];

/// `threads!(name, spec, { keys }, [dtype])` (a spec of `for_each_spec!(parsed ..)`): the spec
/// without a norm, with BatchNorm and with LayerNorm.
macro_rules! threads {
    ($name:ident, $spec:expr, { $($keys:tt)* }, [$($dtype:ident)?]) => {
        mod $name {
            threads!(@norm plain, { $($keys)* norm: None, $(dtype: $dtype,)? });
            threads!(@norm batch_norm, { $($keys)* norm: BatchNorm { momentum: 0.3, eps: 1e-3 }, $(dtype: $dtype,)? });
            threads!(@norm layer_norm, { $($keys)* norm: LayerNorm { eps: 1e-3 }, $(dtype: $dtype,)? });
        }
    };
    (@norm $module:ident, { $($keys:tt)* }) => {
        mod $module {
            conv_runtime::conv2d! {
                pub struct Layer { $($keys)* }
            }

            #[test]
            fn bit_identical_on_any_number_of_threads() {
                let one = every_operation!(Layer, LayerGrads, LayerState, conv_runtime::Cpu::default());
                for threads in crate::THREADS {
                    let cpu = conv_runtime::Cpu::with_threads(threads)
                        .expect("threads")
                        .__split_everything();
                    let many = every_operation!(Layer, LayerGrads, LayerState, cpu);
                    crate::common::operations::same_bits(&format!("{threads} threads"), &many, &one);
                }
            }
        }
    };
}

for_each_spec!(parsed threads);

mod half {
    threads!(wino_f16, (), { input: [10, 10, 16], out_channels: 16, kernel: 3, padding: 1,
        activation: Tanh, batch: 3, }, [f16]);
    threads!(direct_f16, (), { input: [9, 7, 3], out_channels: 5, kernel: 3, stride: 2,
        activation: Gelu, batch: 3, }, [f16]);
    threads!(wino_bf16, (), { input: [20, 20, 4], out_channels: 16, kernel: 4, stride: 2,
        activation: Relu, batch: 3, }, [bf16]);
    threads!(direct_bf16, (), { input: [8, 8, 3], out_channels: 6, kernel: 3, padding: 1,
        activation: Sigmoid, batch: 3, }, [bf16]);
}
