//! Every conformance case through the whole public API: `evaluate`, `forward` (output and
//! BatchNorm running statistics), `backward_full`, `backward_input` + `backward`, gradient
//! accumulation and `zero`. Each case runs as a float64 and a float32 layer (the case's values
//! converted), the half-precision cases also in their own type.

#[macro_use]
mod common;

use common::{assert_close, Case};

/// The reference in tests/common reproduces the case: it is trustworthy for the other tests.
fn check_reference(case: &Case) {
    let (spec, params, train) = (case.spec(), case.params(), case.train());
    let x = case.array("input");
    let evaluated = common::forward(&spec, &params, &x, false);
    let forward = common::forward(&spec, &params, &x, train);
    let grads = common::backward(&spec, &params, &x, &forward, &case.array("d_output"), train);
    let quantities = [
        ("evaluate_output", evaluated.output),
        ("output", forward.output),
        ("running_mean", forward.running_mean),
        ("running_var", forward.running_var),
        ("d_input", grads.d_input),
        ("d_weights", grads.d_weights),
        ("d_biases", grads.d_biases),
        ("d_gamma", grads.d_gamma),
        ("d_beta", grads.d_beta),
    ];
    for (name, got) in quantities {
        assert_close(name, &got, &case.expected(name), 1e-12);
    }
}

/// One module per case, `case!(name, [norm parameters; running statistics], [module: dtype, ..],
/// { spec without dtype })`, with one submodule of tests per element type.
macro_rules! case {
    ($name:ident, $fields:tt, [$($module:ident: $t:ident),+], $spec:tt) => {
        mod $name {
            use crate::common::Case;

            fn case() -> Case {
                Case::parse(include_str!(concat!(
                    "data/conformance/",
                    stringify!($name),
                    ".json"
                )))
            }

            #[test]
            fn reference_reproduces_the_case() {
                crate::check_reference(&case());
            }

            $(mod $module {
                layer_tests!(Cpu = Cpu::default(), $t, $fields, $spec);
            })+

            /// The same case on the oneDNN device, as an f32 layer.
            #[cfg(feature = "onednn")]
            mod onednn_f32 {
                layer_tests!(OneDnn = OneDnn::new().unwrap(), f32, $fields, $spec);
            }
        }
    };
}

macro_rules! layer_tests {
    ($device:ty = $make:expr, $t:ident, [$($param:ident),*; $($stat:ident),*], { $($spec:tt)* }) => {
        use super::case;
        use crate::common::{assert_close, convert, to_f64, Case, Tolerance};
        use conv_runtime::prelude::*;

        conv_runtime::conv2d! {
            pub struct Layer {
                $($spec)*
                dtype: $t,
            }
        }

        type T = dtype!($t);
        type Input = Tensor<
            T,
            { Layer::BATCH_SIZE },
            { Layer::INPUT_HEIGHT },
            { Layer::INPUT_WIDTH },
            { Layer::INPUT_CHANNELS },
        >;
        type Output = Tensor<
            T,
            { Layer::BATCH_SIZE },
            { Layer::OUTPUT_HEIGHT },
            { Layer::OUTPUT_WIDTH },
            { Layer::OUTPUT_CHANNELS },
        >;
        const TOLERANCE: f64 = <T as Tolerance>::CONFORMANCE;

        type Device = $device;

        fn device() -> Device {
            $make
        }

        /// A layer holding the case's parameters and initial running statistics.
        fn layer(case: &Case) -> Layer {
            let mut layer = Layer::new(&mut Rng::seed_from_u64(0));
            layer.weights = Tensor::from_vec(convert(&case.array("weights"))).unwrap();
            layer.biases = Vector::from_vec(convert(&case.array("biases"))).unwrap();
            $(layer.$param = Vector::from_vec(convert(&case.array(stringify!($param)))).unwrap();)*
            $(layer.$stat = Vector::from_vec(convert(&case.array(stringify!($stat)))).unwrap();)*
            layer
        }

        fn input(case: &Case) -> Input {
            Tensor::from_vec(convert(&case.array("input"))).unwrap()
        }

        fn d_output(case: &Case) -> Output {
            Tensor::from_vec(convert(&case.array("d_output"))).unwrap()
        }

        /// `forward` in the case's mode: the layer after it, its state and the input.
        fn forward(cpu: &mut Device, case: &Case) -> (Layer, LayerState, Input) {
            let (mut layer, x, mut state) = (layer(case), input(case), LayerState::new());
            layer.forward(cpu, &x, &mut state, case.mode()).unwrap();
            (layer, state, x)
        }

        /// The parameter gradients, named as the case's expected fields.
        fn gradients(grads: &LayerGrads) -> Vec<(&'static str, Vec<f64>)> {
            vec![
                ("d_weights", to_f64(grads.weights.as_slice())),
                ("d_biases", to_f64(grads.biases.as_slice())),
                $((concat!("d_", stringify!($param)), to_f64(grads.$param.as_slice())),)*
            ]
        }

        /// The gradients are `factor` times the case's.
        fn check_gradients(case: &Case, grads: &LayerGrads, factor: f64) {
            for (name, got) in gradients(grads) {
                let expected: Vec<f64> = case.expected(name).iter().map(|e| factor * e).collect();
                // A sum of two passes carries twice the rounding.
                assert_close(name, &got, &expected, factor * TOLERANCE);
            }
        }

        fn check_d_input(case: &Case, d_input: &Input) {
            let got = to_f64(d_input.as_slice());
            assert_close("d_input", &got, &case.expected("d_input"), TOLERANCE);
        }

        #[test]
        fn shape_constants() {
            assert_eq!(constants!(Layer), case().spec().constants());
        }

        #[test]
        fn evaluate() {
            let case = case();
            let mut y: Output = Tensor::zeros();
            layer(&case).evaluate(&mut device(), &input(&case), &mut y).unwrap();
            let got = to_f64(y.as_slice());
            assert_close("evaluate", &got, &case.expected("evaluate_output"), TOLERANCE);
        }

        #[test]
        fn forward_output() {
            let case = case();
            let (_, state, _) = forward(&mut device(), &case);
            let got = to_f64(state.output().as_slice());
            assert_close("output", &got, &case.expected("output"), TOLERANCE);
        }

        $(
            #[test]
            fn $stat() {
                let case = case();
                let (layer, _, _) = forward(&mut device(), &case);
                let got = to_f64(layer.$stat.as_slice());
                assert_close(stringify!($stat), &got, &case.expected(stringify!($stat)), TOLERANCE);
            }
        )*

        #[test]
        fn backward_full() {
            let (case, mut cpu) = (case(), device());
            let (layer, state, x) = forward(&mut cpu, &case);
            let (mut d_input, mut grads) = (Tensor::zeros(), LayerGrads::zeros());
            let (d_output, mode) = (d_output(&case), case.mode());
            layer
                .backward_full(&mut cpu, &state, &x, &d_output, &mut d_input, &mut grads, mode)
                .unwrap();
            check_d_input(&case, &d_input);
            check_gradients(&case, &grads, 1.0);
        }

        #[test]
        fn backward_input_and_backward() {
            let (case, mut cpu) = (case(), device());
            let (layer, state, x) = forward(&mut cpu, &case);
            let d_output = d_output(&case);
            let mut d_input = Tensor::zeros();
            layer.backward_input(&mut cpu, &state, &d_output, &mut d_input, case.mode()).unwrap();
            check_d_input(&case, &d_input);
            let mut grads = LayerGrads::zeros();
            layer.backward(&mut cpu, &state, &x, &d_output, &mut grads, case.mode()).unwrap();
            check_gradients(&case, &grads, 1.0);
        }

        #[test]
        fn gradients_accumulate_until_zeroed() {
            let (case, mut cpu) = (case(), device());
            let (layer, state, x) = forward(&mut cpu, &case);
            let d_output = d_output(&case);
            let mut grads = LayerGrads::zeros();
            for _ in 0..2 {
                layer.backward(&mut cpu, &state, &x, &d_output, &mut grads, case.mode()).unwrap();
            }
            check_gradients(&case, &grads, 2.0);
            grads.zero();
            for (name, got) in gradients(&grads) {
                assert!(got.iter().all(|&g| g == 0.0), "{name} not zeroed");
            }
            layer.backward(&mut cpu, &state, &x, &d_output, &mut grads, case.mode()).unwrap();
            check_gradients(&case, &grads, 1.0);
        }
    };
}

case! { p01_basic_3x3, [;], [as_f64: f64, as_f32: f32], {
    input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [0, 0],
    activation: Identity, norm: None, batch: 2,
} }

case! { p02_relu_pad, [;], [as_f64: f64, as_f32: f32], {
    input: [5, 7, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: None, batch: 2,
} }

case! { p03_stride2_k5, [;], [as_f64: f64, as_f32: f32], {
    input: [11, 9, 2], out_channels: 4, kernel: [5, 5], stride: [2, 2], padding: [2, 2],
    activation: Tanh, norm: None, batch: 2,
} }

case! { p04_1x1_sigmoid, [;], [as_f64: f64, as_f32: f32], {
    input: [4, 4, 6], out_channels: 5, kernel: [1, 1], stride: [1, 1], padding: [0, 0],
    activation: Sigmoid, norm: None, batch: 3,
} }

case! { p05_gelu_nonsquare, [;], [as_f64: f64, as_f32: f32], {
    input: [7, 6, 3], out_channels: 4, kernel: [3, 5], stride: [1, 1], padding: [1, 2],
    activation: Gelu, norm: None, batch: 2,
} }

case! { p06_fast_tanh, [;], [as_f64: f64, as_f32: f32], {
    input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: FastTanh, norm: None, batch: 2,
} }

case! { p07_bn_train, [gamma, beta; running_mean, running_var], [as_f64: f64, as_f32: f32], {
    input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3,
} }

case! { p08_bn_eval, [gamma, beta; running_mean, running_var], [as_f64: f64, as_f32: f32], {
    input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3,
} }

case! { p09_ln, [gamma, beta;], [as_f64: f64, as_f32: f32], {
    input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [2, 2], padding: [1, 1],
    activation: Tanh, norm: LayerNorm { eps: 1e-5 }, batch: 2,
} }

case! { p10_f32, [;], [as_f32: f32, as_f64: f64], {
    input: [8, 8, 4], out_channels: 8, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: None, batch: 2,
} }

case! { p11_bf16, [;], [as_bf16: bf16, as_f32: f32, as_f64: f64], {
    input: [6, 6, 4], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: None, batch: 2,
} }

case! { p12_f16_bn, [gamma, beta; running_mean, running_var],
    [as_f16: f16, as_f32: f32, as_f64: f64], {
    input: [6, 6, 4], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Identity, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2,
} }
