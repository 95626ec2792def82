//! Many specs (sizes, strides, paddings, kernels, activations, channel counts, batches, dtypes),
//! each a layer from `Layer::new`: the shape constants, `evaluate` at two batch sizes, `evaluate`
//! with one `Cpu` across layers and parameter changes, `forward`, and (the conformance cases
//! being small) `backward_full`, against the float64 reference in tests/common on the same values.

#[macro_use]
mod common;

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
            const SEED: u64 = crate::common::seed(stringify!($name));
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

for_each_spec!(spec);
