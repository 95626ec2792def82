//! Many specs (sizes, strides, paddings, kernels, activations, channel counts, batches, dtypes),
//! each a layer from `Layer::new`: the shape constants, `evaluate` at two batch sizes, `evaluate`
//! with one `Cpu` across layers and parameter changes, `forward`, and (the conformance cases
//! being small) `backward_full`, against the float64 reference in tests/common on the same values.

#[macro_use]
mod common;

/// `[h, w]` from a spec size written `n` or `[h, w]`.
macro_rules! dims {
    ($n:literal) => {
        [$n, $n]
    };
    ([$h:literal, $w:literal]) => {
        [$h, $w]
    };
}

/// The value given for an optional spec key, else the default.
macro_rules! or_default {
    ($default:expr) => {
        $default
    };
    ($default:expr, $given:expr) => {
        $given
    };
}

/// `spec!(module, key: value, ..)`: the keys in the order below, written to `conv2d!` as given.
macro_rules! spec {
    (
        $name:ident,
        input: [$ih:literal, $iw:literal, $ic:literal],
        out_channels: $oc:literal,
        kernel: $kernel:tt
        $(, stride: $stride:tt)?
        $(, padding: $padding:tt)?
        $(, activation: $activation:ident)?
        $(, batch: $batch:literal)?
        $(, dtype: $dtype:ident)?
        $(,)?
    ) => {
        mod $name {
            use crate::common::{
                self, assert_close, convert, to_f64, Activation, Norm, Params, Spec, SplitMix64,
                Tolerance,
            };
            use conv_runtime::prelude::*;

            conv_runtime::conv2d! {
                pub struct Layer {
                    input: [$ih, $iw, $ic],
                    out_channels: $oc,
                    kernel: $kernel,
                    $(stride: $stride,)?
                    $(padding: $padding,)?
                    $(activation: $activation,)?
                    $(batch: $batch,)?
                    $(dtype: $dtype,)?
                }
            }

            const SPEC: Spec = Spec {
                input: [$ih, $iw, $ic],
                out_channels: $oc,
                kernel: dims!($kernel),
                stride: or_default!([1, 1] $(, dims!($stride))?),
                padding: or_default!([0, 0] $(, dims!($padding))?),
                activation: or_default!(Activation::Identity $(, Activation::$activation)?),
                norm: Norm::None,
                batch: or_default!(1 $(, $batch)?),
            };
            type T = dtype!($($dtype)?);
            const TOLERANCE: f64 = <T as Tolerance>::REFERENCE;
            // Distinct per spec.
            const SEED: u64 = line!() as u64;
            const SAMPLE: usize = $ih * $iw * $ic;
            const OTHER_BATCH: usize = if SPEC.batch == 3 { 1 } else { 3 };

            /// A freshly initialized layer and its parameters as f64.
            fn layer(seed: u64) -> (Layer, Params) {
                let layer = Layer::new(&mut Rng::seed_from_u64(seed));
                let params = Params {
                    weights: to_f64(layer.weights.as_slice()),
                    biases: to_f64(layer.biases.as_slice()),
                    ..Params::default()
                };
                (layer, params)
            }

            /// `evaluate` on a random batch of `B` against the reference.
            fn check_evaluate<const B: usize>(cpu: &mut Cpu, layer: &Layer, params: &Params) {
                let mut data = SplitMix64::new(SEED + B as u64);
                let x: Tensor<
                    T,
                    B,
                    { Layer::INPUT_HEIGHT },
                    { Layer::INPUT_WIDTH },
                    { Layer::INPUT_CHANNELS },
                > = Tensor::from_vec(convert(&data.values(B * SAMPLE))).unwrap();
                let mut y: Tensor<
                    T,
                    B,
                    { Layer::OUTPUT_HEIGHT },
                    { Layer::OUTPUT_WIDTH },
                    { Layer::OUTPUT_CHANNELS },
                > = Tensor::from_fn(|_| T::from_f64(f64::NAN)); // to be overwritten
                layer.evaluate(cpu, &x, &mut y).unwrap();
                let expected = common::forward(&SPEC, params, &to_f64(x.as_slice()), false).output;
                let what = format!("evaluate, batch {B}");
                assert_close(&what, &to_f64(y.as_slice()), &expected, TOLERANCE);
            }

            #[test]
            fn shape_constants() {
                assert_eq!(constants!(Layer), SPEC.constants());
            }

            #[test]
            fn evaluate() {
                let ((layer, params), mut cpu) = (layer(SEED), Cpu::default());
                check_evaluate::<{ Layer::BATCH_SIZE }>(&mut cpu, &layer, &params);
                check_evaluate::<OTHER_BATCH>(&mut cpu, &layer, &params);
            }

            /// One `Cpu` serving two layers, and a layer whose parameters change in place.
            #[test]
            fn cpu_caches_follow_the_parameters() {
                let mut cpu = Cpu::default();
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

            #[test]
            fn forward() {
                let ((mut layer, params), mut cpu) = (layer(SEED), Cpu::default());
                let (mut data, mut state) = (SplitMix64::new(SEED), LayerState::new());
                // The second pass reuses the state of the first.
                for pass in 0..2 {
                    let x = Tensor::from_vec(convert(&data.values(SPEC.batch * SAMPLE))).unwrap();
                    layer.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
                    let x = to_f64(x.as_slice());
                    let expected = common::forward(&SPEC, &params, &x, true).output;
                    let got = to_f64(state.output().as_slice());
                    assert_close(&format!("forward, pass {pass}"), &got, &expected, TOLERANCE);
                }
            }

            #[test]
            fn backward_full() {
                let ((mut layer, params), mut cpu) = (layer(SEED), Cpu::default());
                let mut data = SplitMix64::new(SEED);
                let x = Tensor::from_vec(convert(&data.values(SPEC.batch * SAMPLE))).unwrap();
                let [oh, ow] = SPEC.output();
                let outputs = SPEC.batch * oh * ow * SPEC.out_channels;
                let d_output = Tensor::from_vec(convert(&data.values(outputs))).unwrap();
                let mut state = LayerState::new();
                layer.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
                let (mut d_input, mut grads) = (Tensor::zeros(), LayerGrads::zeros());
                layer
                    .backward_full(
                        &mut cpu,
                        &state,
                        &x,
                        &d_output,
                        &mut d_input,
                        &mut grads,
                        Mode::Train,
                    )
                    .unwrap();

                let x = to_f64(x.as_slice());
                let forward = common::forward(&SPEC, &params, &x, true);
                let d_output = to_f64(d_output.as_slice());
                let expected = common::backward(&SPEC, &params, &x, &forward, &d_output, true);
                let got = [
                    ("d_input", to_f64(d_input.as_slice()), expected.d_input),
                    ("d_weights", to_f64(grads.weights.as_slice()), expected.d_weights),
                    ("d_biases", to_f64(grads.biases.as_slice()), expected.d_biases),
                ];
                for (name, got, expected) in got {
                    assert_close(name, &got, &expected, TOLERANCE);
                }
            }
        }
    };
}

// Every key at its default but the required ones.
spec!(defaults, input: [8, 8, 1], out_channels: 1, kernel: 3);
spec!(defaults_f64, input: [7, 5, 2], out_channels: 3, kernel: [2, 3], dtype: f64);
spec!(stride_only, input: [9, 7, 6], out_channels: 13, kernel: [3, 4], stride: [2, 3],
    activation: Tanh, batch: 2, dtype: f64);
spec!(padding_only, input: [5, 6, 7], out_channels: 9, kernel: 5, padding: [2, 1],
    activation: Relu, batch: 3);

// Each activation in both dtypes.
spec!(relu_pad1, input: [5, 7, 3], out_channels: 4, kernel: 3, stride: 1, padding: 1,
    activation: Relu, batch: 2, dtype: f64);
spec!(tanh_stride2, input: [9, 9, 2], out_channels: 5, kernel: 3, stride: 2, padding: 1,
    activation: Tanh, batch: 3, dtype: f32);
spec!(sigmoid_nonsquare, input: [7, 11, 4], out_channels: 7, kernel: [2, 3], stride: [1, 2],
    padding: 0, activation: Sigmoid, batch: 2, dtype: f64);
spec!(gelu_1x1, input: [6, 6, 8], out_channels: 9, kernel: 1, stride: 1, padding: 0,
    activation: Gelu, batch: 4, dtype: f32);
spec!(fast_tanh_k5, input: [10, 10, 3], out_channels: 13, kernel: 5, stride: 2, padding: 2,
    activation: FastTanh, batch: 2, dtype: f64);
spec!(relu_k3x1, input: [12, 9, 5], out_channels: 17, kernel: [3, 1], stride: [2, 1],
    padding: [1, 0], activation: Relu, batch: 1, dtype: f32);
spec!(identity_k4_s4, input: [16, 16, 3], out_channels: 33, kernel: 4, stride: 4, padding: 0,
    activation: Identity, batch: 2, dtype: f64);
spec!(sigmoid_k8_pad3, input: [3, 3, 2], out_channels: 4, kernel: 8, stride: 1, padding: 3,
    activation: Sigmoid, batch: 1, dtype: f32);
spec!(gelu_k8x4, input: [13, 7, 2], out_channels: 6, kernel: [8, 4], stride: [3, 2],
    padding: [2, 1], activation: Gelu, batch: 3, dtype: f64);
spec!(fast_tanh_f32, input: [16, 12, 8], out_channels: 32, kernel: 3, stride: 1, padding: 1,
    activation: FastTanh, batch: 2, dtype: f32);
spec!(identity_f32, input: [9, 8, 4], out_channels: 13, kernel: 7, stride: 1, padding: 3,
    activation: Identity, batch: 1, dtype: f32);

// Networks users build: an Atari DQN trunk and a ResNet stem.
spec!(atari_conv1, input: [84, 84, 4], out_channels: 16, kernel: 8, stride: 4, padding: 0,
    activation: Relu, batch: 1, dtype: f32);
spec!(atari_conv2, input: [20, 20, 16], out_channels: 32, kernel: 4, stride: 2, padding: 0,
    activation: Relu, batch: 2, dtype: f32);
spec!(atari_conv3, input: [9, 9, 32], out_channels: 64, kernel: 3, stride: 1, padding: 0,
    activation: Relu, batch: 1, dtype: f64);
spec!(resnet_stem, input: [32, 32, 3], out_channels: 16, kernel: 7, stride: 2, padding: 3,
    activation: Relu, batch: 1, dtype: f32);

// Output channels around the SIMD widths.
spec!(oc1, input: [10, 6, 7], out_channels: 1, kernel: [3, 2], stride: [2, 1], padding: 1,
    activation: FastTanh, batch: 5, dtype: f64);
spec!(oc1_s4, input: [13, 13, 9], out_channels: 1, kernel: 3, stride: 4, padding: 1,
    activation: FastTanh, batch: 4, dtype: f32);
spec!(oc3_ic65, input: [5, 5, 65], out_channels: 3, kernel: 3, stride: 1, padding: 1,
    activation: Gelu, batch: 2, dtype: f32);
spec!(oc5_ic17, input: [6, 9, 17], out_channels: 5, kernel: [5, 3], stride: [1, 3],
    padding: [2, 1], activation: Sigmoid, batch: 3, dtype: f64);
spec!(oc7_s4_p3, input: [11, 13, 3], out_channels: 7, kernel: 6, stride: 4, padding: 3,
    activation: Tanh, batch: 2, dtype: f32);
spec!(oc9_ic31, input: [7, 7, 31], out_channels: 9, kernel: 2, stride: 2, padding: 0,
    activation: Relu, batch: 4, dtype: f64);
spec!(oc17_ic33, input: [6, 5, 33], out_channels: 17, kernel: [1, 3], stride: 1,
    padding: [0, 1], activation: Gelu, batch: 2, dtype: f64);
spec!(oc33_s3, input: [12, 12, 5], out_channels: 33, kernel: 3, stride: 3, padding: 1,
    activation: FastTanh, batch: 3, dtype: f32);
spec!(oc33_ic67, input: [3, 4, 67], out_channels: 33, kernel: [3, 2], stride: 1,
    padding: [1, 0], activation: Sigmoid, batch: 5, dtype: f32);
spec!(oc64_ic64, input: [6, 6, 64], out_channels: 64, kernel: 3, stride: 2, padding: 1,
    activation: Relu, batch: 2, dtype: f64);
spec!(oc64_ic16, input: [8, 8, 16], out_channels: 64, kernel: 3, stride: 1, padding: 1,
    activation: Relu, batch: 2, dtype: f32);
spec!(oc2_ic2, input: [12, 12, 2], out_channels: 2, kernel: 5, stride: 1, padding: 2,
    activation: Gelu, batch: 5, dtype: f64);
spec!(oc31_ic15, input: [8, 8, 15], out_channels: 31, kernel: 3, stride: [2, 1],
    padding: [0, 1], activation: Relu, batch: 2, dtype: f32);
spec!(oc48_ic32, input: [10, 10, 32], out_channels: 48, kernel: 3, stride: 1, padding: 1,
    activation: Identity, batch: 1, dtype: f32);
spec!(oc8_ic63, input: [5, 6, 63], out_channels: 8, kernel: [2, 4], stride: [3, 1],
    padding: [1, 2], activation: Tanh, batch: 3, dtype: f64);
spec!(oc16_ic5_k6x4, input: [11, 7, 5], out_channels: 16, kernel: [6, 4], stride: [2, 3],
    padding: [3, 2], activation: Sigmoid, batch: 1, dtype: f64);
spec!(oc24_k1_s2, input: [9, 9, 16], out_channels: 24, kernel: 1, stride: 2, padding: 0,
    activation: Identity, batch: 2, dtype: f64);
spec!(oc1_ic1, input: [5, 5, 1], out_channels: 1, kernel: 2, stride: 1, padding: 0,
    activation: Sigmoid, batch: 2, dtype: f64);

// Kernels and paddings at the edges.
spec!(ic1_k8_output_1x1, input: [8, 8, 1], out_channels: 12, kernel: 8, stride: 1, padding: 0,
    activation: Tanh, batch: 3, dtype: f64);
spec!(input_1x1_ic67, input: [1, 1, 67], out_channels: 8, kernel: 1, activation: Tanh,
    batch: 5, dtype: f64);
spec!(k8x1, input: [10, 4, 6], out_channels: 8, kernel: [8, 1], stride: [1, 1],
    padding: [0, 0], activation: Sigmoid, batch: 2, dtype: f32);
spec!(k1x8, input: [4, 10, 6], out_channels: 15, kernel: [1, 8], stride: 1, padding: [1, 2],
    activation: Relu, batch: 1, dtype: f64);
spec!(k1_pad2, input: [4, 5, 3], out_channels: 6, kernel: 1, stride: 1, padding: 2,
    activation: Sigmoid, batch: 2, dtype: f32);
spec!(k3_pad3, input: [4, 4, 2], out_channels: 3, kernel: 3, stride: 1, padding: 3,
    activation: Relu, batch: 2, dtype: f32);
spec!(k2_s2_odd, input: [7, 9, 8], out_channels: 16, kernel: 2, stride: 2, padding: 1,
    activation: Gelu, batch: 3, dtype: f32);
spec!(kernel_fills_padded_input, input: [2, 3, 4], out_channels: 5, kernel: [4, 5], stride: 1,
    padding: 1, activation: Relu, batch: 3, dtype: f64);
spec!(k8_s4_p3, input: [20, 18, 3], out_channels: 9, kernel: 8, stride: 4, padding: 3,
    activation: Gelu, batch: 2, dtype: f64);

// Mixed strides and paddings per axis.
spec!(s3x1, input: [10, 10, 3], out_channels: 5, kernel: [4, 2], stride: [3, 1],
    padding: [1, 0], activation: Relu, batch: 4, dtype: f64);
spec!(s1x4, input: [6, 17, 2], out_channels: 9, kernel: [3, 5], stride: [1, 4],
    padding: [1, 2], activation: Tanh, batch: 2, dtype: f32);
spec!(s4x2_p2x3, input: [15, 11, 4], out_channels: 7, kernel: [5, 6], stride: [4, 2],
    padding: [2, 3], activation: FastTanh, batch: 1, dtype: f64);
