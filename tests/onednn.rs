//! The oneDNN device against the generated CPU code: every generated spec (as an f32 layer),
//! through every operation, with and without a norm, must agree within f32 tolerance; layers
//! oneDNN cannot run exactly fall back to the generated code, counted.
//!
//! Needs the `onednn` feature and `ONEDNN_LIB_DIR` (see README).
#![cfg(feature = "onednn")]

#[macro_use]
mod common;

use common::{assert_close, to_f64};

/// f32 tolerance between two implementations of the same math with different summation orders.
const TOLERANCE: f64 = 1e-4;

/// Both devices' results of one operation, compared by name.
fn same(what: &str, cpu: &[f32], onednn: &[f32]) {
    assert_close(what, &to_f64(onednn), &to_f64(cpu), TOLERANCE);
}

/// `equivalence!(name, spec, { keys }, [dtype])` (a spec of `for_each_spec!(parsed ..)`): the
/// spec as an f32 layer without a norm, with BatchNorm and with LayerNorm, each on both devices.
macro_rules! equivalence {
    ($name:ident, $spec:expr, { $($keys:tt)* }, $dtype:tt) => {
        mod $name {
            equivalence!(@norm plain, { $($keys)* norm: None, });
            equivalence!(@norm batch_norm, { $($keys)* norm: BatchNorm { momentum: 0.3, eps: 1e-3 }, });
            equivalence!(@norm layer_norm, { $($keys)* norm: LayerNorm { eps: 1e-3 }, });
        }
    };
    (@norm $module:ident, { $($keys:tt)* }) => {
        mod $module {
            use super::super::same;
            use crate::common::SplitMix64;
            use conv_runtime::prelude::*;

            conv_runtime::conv2d! {
                pub struct Layer {
                    $($keys)*
                    dtype: f32,
                }
            }

            type Inputs<const B: usize> = Tensor<
                f32,
                B,
                { Layer::INPUT_HEIGHT },
                { Layer::INPUT_WIDTH },
                { Layer::INPUT_CHANNELS },
            >;
            type Outputs<const B: usize> = Tensor<
                f32,
                B,
                { Layer::OUTPUT_HEIGHT },
                { Layer::OUTPUT_WIDTH },
                { Layer::OUTPUT_CHANNELS },
            >;
            type Input = Inputs<{ Layer::BATCH_SIZE }>;
            type Output = Outputs<{ Layer::BATCH_SIZE }>;

            fn values(data: &mut SplitMix64, n: usize) -> Vec<f32> {
                data.values(n).into_iter().map(|v| v as f32).collect()
            }

            #[test]
            fn every_operation_matches_the_cpu() {
                let seed = Layer::INPUT_HEIGHT * 1000 + Layer::OUTPUT_CHANNELS;
                let mut data = SplitMix64::new(0x0d11_0000 + seed as u64);
                let layer = Layer::new(&mut Rng::seed_from_u64(5));
                let x = Input::from_vec(values(&mut data, Input::LEN)).unwrap();
                let d_output = Output::from_vec(values(&mut data, Output::LEN)).unwrap();
                let (mut cpu, mut onednn) = (Cpu::default(), OneDnn::new().unwrap());

                // Inference at the spec's batch and at batch 3 (its own primitive).
                let (mut y_cpu, mut y_dnn) = (Output::zeros(), Output::zeros());
                layer.evaluate(&mut cpu, &x, &mut y_cpu).unwrap();
                layer.evaluate(&mut onednn, &x, &mut y_dnn).unwrap();
                same("evaluate", y_cpu.as_slice(), y_dnn.as_slice());
                let x3 = Inputs::<3>::from_vec(values(&mut data, Inputs::<3>::LEN)).unwrap();
                let mut y3_cpu = Outputs::<3>::zeros();
                let mut y3_dnn = y3_cpu.clone();
                layer.evaluate(&mut cpu, &x3, &mut y3_cpu).unwrap();
                layer.evaluate(&mut onednn, &x3, &mut y3_dnn).unwrap();
                same("evaluate, batch 3", y3_cpu.as_slice(), y3_dnn.as_slice());

                for mode in [Mode::Train, Mode::Eval] {
                    let (mut l_cpu, mut l_dnn) = (layer.clone(), layer.clone());
                    let (mut s_cpu, mut s_dnn) = (LayerState::new(), LayerState::new());
                    l_cpu.forward(&mut cpu, &x, &mut s_cpu, mode).unwrap();
                    l_dnn.forward(&mut onednn, &x, &mut s_dnn, mode).unwrap();
                    same("forward", s_cpu.output().as_slice(), s_dnn.output().as_slice());
                    assert!(l_cpu.abs_diff(&l_dnn) < 1e-4, "running statistics differ");

                    let (mut dx_cpu, mut dx_dnn) = (Input::zeros(), Input::zeros());
                    let (mut g_cpu, mut g_dnn) = (LayerGrads::zeros(), LayerGrads::zeros());
                    l_cpu.backward_full(&mut cpu, &s_cpu, &x, &d_output, &mut dx_cpu, &mut g_cpu, mode).unwrap();
                    l_dnn.backward_full(&mut onednn, &s_dnn, &x, &d_output, &mut dx_dnn, &mut g_dnn, mode).unwrap();
                    same("backward_full d_input", dx_cpu.as_slice(), dx_dnn.as_slice());
                    same("backward_full d_weights", g_cpu.weights.as_slice(), g_dnn.weights.as_slice());
                    same("backward_full d_biases", g_cpu.biases.as_slice(), g_dnn.biases.as_slice());

                    // The split passes on oneDNN equal its fused pass; `backward` accumulates.
                    let mut dx_split = Input::from_fn(|_| f32::NAN);
                    l_dnn.backward_input(&mut onednn, &s_dnn, &d_output, &mut dx_split, mode).unwrap();
                    same("backward_input", dx_dnn.as_slice(), dx_split.as_slice());
                    l_dnn.backward(&mut onednn, &s_dnn, &x, &d_output, &mut g_dnn, mode).unwrap();
                    let twice: Vec<f32> = g_cpu.weights.as_slice().iter().map(|g| 2.0 * g).collect();
                    same("backward accumulates", &twice, g_dnn.weights.as_slice());
                }
                assert_eq!(onednn.fallbacks(), 0, "an f32 layer ran generated code instead of oneDNN");
            }
        }
    };
}

for_each_spec!(parsed equivalence);

mod fallback {
    use conv_runtime::prelude::*;

    conv_runtime::conv2d! {
        struct Double { input: [6, 6, 2], out_channels: 3, kernel: 3, activation: Tanh, batch: 2, dtype: f64 }
    }

    /// oneDNN has no f64 convolution: the layer runs the generated code, counted, and equals
    /// the CPU device exactly.
    #[test]
    fn f64_layers_run_the_generated_code() {
        let layer = Double::new(&mut Rng::seed_from_u64(1));
        let x = Tensor::<f64, 2, 6, 6, 2>::from_fn(|i| (i as f64 * 0.37).sin());
        let (mut y_cpu, mut y_dnn) = (Tensor::zeros(), Tensor::zeros());
        layer.evaluate(&mut Cpu::default(), &x, &mut y_cpu).unwrap();
        let mut onednn = OneDnn::new().unwrap();
        layer.evaluate(&mut onednn, &x, &mut y_dnn).unwrap();
        assert_eq!(y_cpu, y_dnn);
        assert_eq!(onednn.fallbacks(), 1);
    }
}
