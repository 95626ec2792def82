//! Every conformance case as a float16 and a bfloat16 layer, through the whole public API:
//! `evaluate`, `forward` (output and BatchNorm running statistics), `backward_full`,
//! `backward_input` + `backward`, gradient accumulation and `zero`.
//!
//! Rounding a case's values to a half type changes the problem, so every quantity is compared
//! with the float64 reference of tests/common computed from the same rounded input, parameters,
//! `d_output` and running statistics (the latter rounded to `<T as Element>::Acc`, the type the
//! layer keeps them in). A case in its own dtype (p11 as bf16, p12 as f16) loses nothing to the
//! rounding and is also compared with the case's expected values.

#[macro_use]
mod common;

use common::{Case, Params};
use conv_runtime::prelude::Element;

/// `values` rounded to `U` and back.
fn rounded<U: Element>(values: &[f64]) -> Vec<f64> {
    common::to_f64(&common::convert::<U>(values))
}

/// A case's values as a layer of element type `T` holds them: parameters in `T`, running
/// statistics in `T::Acc`.
fn rounded_params<T: Element>(case: &Case) -> Params {
    let params = case.params();
    Params {
        weights: rounded::<T>(&params.weights),
        biases: rounded::<T>(&params.biases),
        gamma: rounded::<T>(&params.gamma),
        beta: rounded::<T>(&params.beta),
        running_mean: rounded::<T::Acc>(&params.running_mean),
        running_var: rounded::<T::Acc>(&params.running_var),
    }
}

/// One source of expected values, by the case's field names.
struct Expected {
    source: &'static str,
    values: Vec<(&'static str, Vec<f64>)>,
}

impl Expected {
    fn get(&self, name: &str) -> &[f64] {
        let found = self.values.iter().find(|(n, _)| *n == name);
        &found.unwrap_or_else(|| panic!("no expected {name}")).1
    }
}

const QUANTITIES: [&str; 9] = [
    "evaluate_output",
    "output",
    "running_mean",
    "running_var",
    "d_input",
    "d_weights",
    "d_biases",
    "d_gamma",
    "d_beta",
];

/// The float64 reference on the case's values rounded as a layer of `T` holds them and, where
/// `against_case`, the case's own expected values.
fn expectations<T: Element>(case: &Case, against_case: bool) -> Vec<Expected> {
    let (spec, params, train) = (case.spec(), rounded_params::<T>(case), case.train());
    let x = rounded::<T>(&case.array("input"));
    let d_output = rounded::<T>(&case.array("d_output"));
    let evaluated = common::forward(&spec, &params, &x, false);
    let forward = common::forward(&spec, &params, &x, train);
    let grads = common::backward(&spec, &params, &x, &forward, &d_output, train);
    let mut sources = vec![Expected {
        source: "reference on the rounded values",
        values: vec![
            ("evaluate_output", evaluated.output),
            ("output", forward.output),
            ("running_mean", forward.running_mean),
            ("running_var", forward.running_var),
            ("d_input", grads.d_input),
            ("d_weights", grads.d_weights),
            ("d_biases", grads.d_biases),
            ("d_gamma", grads.d_gamma),
            ("d_beta", grads.d_beta),
        ],
    }];
    if against_case {
        // The case's values are representable in its dtype: nothing was rounded (but the
        // decimal of a JSON number may be an f64 ulp off a representable value).
        let original = case.params();
        let pairs = [
            ("input", case.array("input"), x),
            ("d_output", case.array("d_output"), d_output),
            ("weights", original.weights, params.weights),
            ("biases", original.biases, params.biases),
            ("gamma", original.gamma, params.gamma),
            ("beta", original.beta, params.beta),
            ("running_mean", original.running_mean, params.running_mean),
            ("running_var", original.running_var, params.running_var),
        ];
        for (name, original, rounded) in pairs {
            let mut values = original.iter().zip(&rounded);
            let exact = values.all(|(o, r)| (o - r).abs() <= 1e-15 * o.abs());
            assert!(exact, "{name} is not representable in the case's dtype");
        }
        sources.push(Expected {
            source: "case's expected values",
            values: QUANTITIES.map(|q| (q, case.expected(q))).into(),
        });
    }
    sources
}

/// `case!(name, [norm parameters; running statistics], [module: dtype (+ case)?, ..],
/// { spec without dtype })`: a module per case with a submodule of tests per element type;
/// `+ case` also compares with the case's expected values.
macro_rules! case {
    ($name:ident, $fields:tt, [$($module:ident: $t:ident $(+ $case:ident)?),+], $spec:tt) => {
        mod $name {
            use crate::common::Case;

            fn case() -> Case {
                Case::parse(include_str!(concat!(
                    "data/conformance/",
                    stringify!($name),
                    ".json"
                )))
            }

            $(mod $module {
                const AGAINST_CASE: bool = against_case!($($case)?);
                layer_tests!($t, $fields, $spec);
            })+
        }
    };
}

macro_rules! against_case {
    () => {
        false
    };
    (case) => {
        true
    };
}

macro_rules! layer_tests {
    ($t:ident, [$($param:ident),*; $($stat:ident),*], { $($spec:tt)* }) => {
        use super::case;
        use crate::common::{assert_close, convert, to_f64, Case, Tolerance};
        use crate::{expectations, Expected};
        use conv_runtime::prelude::*;

        conv_runtime::conv2d! {
            pub struct Layer {
                $($spec)*
                dtype: $t,
            }
        }

        type T = dtype!($t);
        type A = <T as Element>::Acc;
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

        fn expected(case: &Case) -> Vec<Expected> {
            expectations::<T>(case, AGAINST_CASE)
        }

        /// `got` against every source of expected values.
        #[track_caller]
        fn check(case: &Case, name: &str, got: &[f64], factor: f64) {
            for source in expected(case) {
                let expected: Vec<f64> = source.get(name).iter().map(|e| factor * e).collect();
                // A sum of `factor` passes carries `factor` times the rounding.
                let what = format!("{name} against the {}", source.source);
                assert_close(&what, got, &expected, factor * TOLERANCE);
            }
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
        fn forward(cpu: &mut Cpu, case: &Case) -> (Layer, LayerState, Input) {
            let (mut layer, x, mut state) = (layer(case), input(case), LayerState::new());
            layer.forward(cpu, &x, &mut state, case.mode()).unwrap();
            (layer, state, x)
        }

        /// The parameter gradients (kept in `A`), named as the case's expected fields.
        fn gradients(grads: &LayerGrads) -> Vec<(&'static str, Vec<f64>)> {
            let weights: &[A] = grads.weights.as_slice();
            vec![
                ("d_weights", to_f64(weights)),
                ("d_biases", to_f64(grads.biases.as_slice())),
                $((concat!("d_", stringify!($param)), to_f64(grads.$param.as_slice())),)*
            ]
        }

        fn check_gradients(case: &Case, grads: &LayerGrads, factor: f64) {
            for (name, got) in gradients(grads) {
                check(case, name, &got, factor);
            }
        }

        #[test]
        fn shape_constants() {
            assert_eq!(constants!(Layer), case().spec().constants());
        }

        #[test]
        fn evaluate() {
            let case = case();
            let mut y: Output = Tensor::from_fn(|_| T::from_f64(f64::NAN)); // to be overwritten
            layer(&case).evaluate(&mut Cpu::default(), &input(&case), &mut y).unwrap();
            check(&case, "evaluate_output", &to_f64(y.as_slice()), 1.0);
        }

        #[test]
        fn forward_output() {
            let case = case();
            let (_, state, _) = forward(&mut Cpu::default(), &case);
            check(&case, "output", &to_f64(state.output().as_slice()), 1.0);
        }

        $(
            #[test]
            fn $stat() {
                let case = case();
                let (layer, _, _) = forward(&mut Cpu::default(), &case);
                let got: &[A] = layer.$stat.as_slice();
                check(&case, stringify!($stat), &to_f64(got), 1.0);
            }
        )*

        #[test]
        fn backward_full() {
            let (case, mut cpu) = (case(), Cpu::default());
            let (layer, state, x) = forward(&mut cpu, &case);
            let (mut d_input, mut grads) = (Tensor::zeros(), LayerGrads::zeros());
            let (d_output, mode) = (d_output(&case), case.mode());
            layer
                .backward_full(&mut cpu, &state, &x, &d_output, &mut d_input, &mut grads, mode)
                .unwrap();
            check(&case, "d_input", &to_f64(d_input.as_slice()), 1.0);
            check_gradients(&case, &grads, 1.0);
        }

        #[test]
        fn backward_input_and_backward() {
            let (case, mut cpu) = (case(), Cpu::default());
            let (layer, state, x) = forward(&mut cpu, &case);
            let d_output = d_output(&case);
            let mut d_input: Input = Tensor::from_fn(|_| T::from_f64(f64::NAN)); // overwritten
            layer.backward_input(&mut cpu, &state, &d_output, &mut d_input, case.mode()).unwrap();
            check(&case, "d_input", &to_f64(d_input.as_slice()), 1.0);
            let mut grads = LayerGrads::zeros();
            layer.backward(&mut cpu, &state, &x, &d_output, &mut grads, case.mode()).unwrap();
            check_gradients(&case, &grads, 1.0);
        }

        #[test]
        fn gradients_accumulate_until_zeroed() {
            let (case, mut cpu) = (case(), Cpu::default());
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

case! { p01_basic_3x3, [;], [as_f16: f16, as_bf16: bf16], {
    input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [0, 0],
    activation: Identity, norm: None, batch: 2,
} }

case! { p02_relu_pad, [;], [as_f16: f16, as_bf16: bf16], {
    input: [5, 7, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: None, batch: 2,
} }

case! { p03_stride2_k5, [;], [as_f16: f16, as_bf16: bf16], {
    input: [11, 9, 2], out_channels: 4, kernel: [5, 5], stride: [2, 2], padding: [2, 2],
    activation: Tanh, norm: None, batch: 2,
} }

case! { p04_1x1_sigmoid, [;], [as_f16: f16, as_bf16: bf16], {
    input: [4, 4, 6], out_channels: 5, kernel: [1, 1], stride: [1, 1], padding: [0, 0],
    activation: Sigmoid, norm: None, batch: 3,
} }

case! { p05_gelu_nonsquare, [;], [as_f16: f16, as_bf16: bf16], {
    input: [7, 6, 3], out_channels: 4, kernel: [3, 5], stride: [1, 1], padding: [1, 2],
    activation: Gelu, norm: None, batch: 2,
} }

case! { p06_fast_tanh, [;], [as_f16: f16, as_bf16: bf16], {
    input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: FastTanh, norm: None, batch: 2,
} }

case! { p07_bn_train, [gamma, beta; running_mean, running_var], [as_f16: f16, as_bf16: bf16], {
    input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3,
} }

case! { p08_bn_eval, [gamma, beta; running_mean, running_var], [as_f16: f16, as_bf16: bf16], {
    input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3,
} }

case! { p09_ln, [gamma, beta;], [as_f16: f16, as_bf16: bf16], {
    input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [2, 2], padding: [1, 1],
    activation: Tanh, norm: LayerNorm { eps: 1e-5 }, batch: 2,
} }

case! { p10_f32, [;], [as_f16: f16, as_bf16: bf16], {
    input: [8, 8, 4], out_channels: 8, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: None, batch: 2,
} }

case! { p11_bf16, [;], [as_bf16: bf16 + case, as_f16: f16], {
    input: [6, 6, 4], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, norm: None, batch: 2,
} }

case! { p12_f16_bn, [gamma, beta; running_mean, running_var],
    [as_f16: f16 + case, as_bf16: bf16], {
    input: [6, 6, 4], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Identity, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2,
} }
