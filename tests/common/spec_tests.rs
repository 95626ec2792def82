//! The tests of one generated spec as one layer, shared by the suites that run the specs in
//! their own type (tests/specs_forward.rs) and in the half types (tests/half_specs.rs).

/// `spec_tests!(name, spec, { conv2d! keys })`, in the current module: a layer from
/// `Layer::new` with the keys (`dtype` included, or the default); its shape constants,
/// `evaluate` at two batch sizes, `forward` and `backward_full` against the float64 reference in
/// tests/common on the same values (as the layer holds them), within the type's
/// `Tolerance::REFERENCE`. Also defines `layer(seed)` and `check_evaluate::<B>` for a suite's
/// own tests.
macro_rules! spec_tests {
    ($name:ident, $spec:expr, { $($keys:tt)* }) => {
        use crate::common::{
            self, assert_close, convert, to_f64, Params, Spec, SplitMix64, Tolerance,
        };
        use conv_runtime::prelude::*;

        conv_runtime::conv2d! {
            pub struct Layer {
                $($keys)*
            }
        }

        const SPEC: Spec = $spec;
        type T = <Layer as Parameters>::Elem;
        type A = <T as Element>::Acc;
        const TOLERANCE: f64 = <T as Tolerance>::REFERENCE;
        // Distinct per spec, the same for every type of it.
        const SEED: u64 = common::seed(stringify!($name));
        const SAMPLE: usize = SPEC.input[0] * SPEC.input[1] * SPEC.input[2];
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
            let ((layer, params), mut cpu) = (layer(SEED), crate::common::cpu());
            check_evaluate::<{ Layer::BATCH_SIZE }>(&mut cpu, &layer, &params);
            check_evaluate::<OTHER_BATCH>(&mut cpu, &layer, &params);
        }

        #[test]
        fn forward() {
            let ((mut layer, params), mut cpu) = (layer(SEED), crate::common::cpu());
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
            let ((mut layer, params), mut cpu) = (layer(SEED), crate::common::cpu());
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
