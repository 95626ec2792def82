//! The generated specs of tests/common/spec_list.rs (those of tests/specs_forward.rs, same
//! names, their dtype replaced), each as a float16 and a bfloat16 layer from `Layer::new`: the
//! shape constants, `evaluate` at two batch sizes, `forward` and `backward_full`, against the
//! float64 reference in tests/common on the same half-precision input, parameters and
//! `d_output`. Outputs are stored in the half type, so they carry its rounding (~3 significant
//! digits for bf16); sums are accumulated in f32 and gradients kept in f32.

#[macro_use]
mod common;

/// `spec!(module, key: value, ..)`: the keys in the order below, written to `conv2d!` as given
/// once per half type, in place of the spec's dtype.
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
            use crate::common::{Activation, Norm, Spec};

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
            // Distinct per spec, the same for both types.
            const SEED: u64 = crate::common::seed(stringify!($name));

            mod as_f16 {
                half_tests!(f16, {
                    input: [$ih, $iw, $ic],
                    out_channels: $oc,
                    kernel: $kernel,
                    $(stride: $stride,)?
                    $(padding: $padding,)?
                    $(activation: $activation,)?
                    $(batch: $batch,)?
                });
            }

            mod as_bf16 {
                half_tests!(bf16, {
                    input: [$ih, $iw, $ic],
                    out_channels: $oc,
                    kernel: $kernel,
                    $(stride: $stride,)?
                    $(padding: $padding,)?
                    $(activation: $activation,)?
                    $(batch: $batch,)?
                });
            }
        }
    };
}

/// The tests of one spec (`super::SPEC`, `super::SEED`) as a layer of element type `$t`.
macro_rules! half_tests {
    ($t:ident, { $($spec:tt)* }) => {
        use super::{SEED, SPEC};
        use crate::common::{self, assert_close, convert, to_f64, Params, SplitMix64, Tolerance};
        use conv_runtime::prelude::*;

        conv_runtime::conv2d! {
            pub struct Layer {
                $($spec)*
                dtype: $t,
            }
        }

        type T = dtype!($t);
        type A = <T as Element>::Acc;
        const TOLERANCE: f64 = <T as Tolerance>::REFERENCE;
        const SAMPLE: usize = SPEC.input[0] * SPEC.input[1] * SPEC.input[2];
        const OTHER_BATCH: usize = if SPEC.batch == 3 { 1 } else { 3 };

        /// A freshly initialized layer and its parameters as f64.
        fn layer() -> (Layer, Params) {
            let layer = Layer::new(&mut Rng::seed_from_u64(SEED));
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
            let ((layer, params), mut cpu) = (layer(), Cpu::default());
            check_evaluate::<{ Layer::BATCH_SIZE }>(&mut cpu, &layer, &params);
            check_evaluate::<OTHER_BATCH>(&mut cpu, &layer, &params);
        }

        #[test]
        fn forward() {
            let ((mut layer, params), mut cpu) = (layer(), Cpu::default());
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
            let ((mut layer, params), mut cpu) = (layer(), Cpu::default());
            let mut data = SplitMix64::new(SEED);
            let x = Tensor::from_vec(convert(&data.values(SPEC.batch * SAMPLE))).unwrap();
            let [oh, ow] = SPEC.output();
            let outputs = SPEC.batch * oh * ow * SPEC.out_channels;
            let d_output = Tensor::from_vec(convert(&data.values(outputs))).unwrap();
            let mut state = LayerState::new();
            layer.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
            let mut d_input = Tensor::from_fn(|_| T::from_f64(f64::NAN)); // to be overwritten
            let mut grads = LayerGrads::zeros();
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
            // Gradients are kept in the accumulator type.
            let (d_weights, d_biases): (&[A], &[A]) =
                (grads.weights.as_slice(), grads.biases.as_slice());
            let got = [
                ("d_input", to_f64(d_input.as_slice()), expected.d_input),
                ("d_weights", to_f64(d_weights), expected.d_weights),
                ("d_biases", to_f64(d_biases), expected.d_biases),
            ];
            for (name, got, expected) in got {
                assert_close(name, &got, &expected, TOLERANCE);
            }
        }
    };
}

for_each_spec!(spec);
