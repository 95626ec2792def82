//! The conformance cases (tests/data/conformance, listed in case_list.rs) through a generated
//! layer, shared by tests/conformance_forward.rs, tests/conformance_training.rs and
//! tests/half_conformance.rs: a module per case, the tests of one layer, and the values they
//! are compared with.

use super::{assert_close, convert, to_f64, Case, Params};
use conv_runtime::prelude::Element;

/// Where a layer's expected values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Against {
    /// The case's expected values: the layer holds the case's values converted to its type,
    /// which its `Tolerance::CONFORMANCE` allows for.
    Case,
    /// The float64 reference on the case's values rounded as the layer holds them (rounding to
    /// a half type changes the problem) and, for a case in the layer's own dtype (nothing
    /// rounded), also the case's expected values.
    Rounded,
}

/// The fields of a case's `expected`.
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

/// The float64 reference of the case's spec and mode on the given values, named as the case's
/// expected fields.
fn reference(
    case: &Case,
    params: &Params,
    x: &[f64],
    d_output: &[f64],
) -> Vec<(&'static str, Vec<f64>)> {
    let (spec, train) = (case.spec(), case.train());
    let evaluated = super::forward(&spec, params, x, false);
    let forward = super::forward(&spec, params, x, train);
    let grads = super::backward(&spec, params, x, &forward, d_output, train);
    vec![
        ("evaluate_output", evaluated.output),
        ("output", forward.output),
        ("running_mean", forward.running_mean),
        ("running_var", forward.running_var),
        ("d_input", grads.d_input),
        ("d_weights", grads.d_weights),
        ("d_biases", grads.d_biases),
        ("d_gamma", grads.d_gamma),
        ("d_beta", grads.d_beta),
    ]
}

/// The reference in tests/common reproduces the case: it is trustworthy for the other tests.
pub fn check_reference(case: &Case) {
    let (params, x, d_output) = (case.params(), case.array("input"), case.array("d_output"));
    for (name, got) in reference(case, &params, &x, &d_output) {
        assert_close(name, &got, &case.expected(name), 1e-12);
    }
}

/// `values` rounded to `U` and back.
fn rounded<U: Element>(values: &[f64]) -> Vec<f64> {
    to_f64(&convert::<U>(values))
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
pub struct Expected {
    pub source: &'static str,
    values: Vec<(&'static str, Vec<f64>)>,
}

impl Expected {
    pub fn get(&self, name: &str) -> &[f64] {
        let found = self.values.iter().find(|(n, _)| *n == name);
        &found.unwrap_or_else(|| panic!("no expected {name}")).1
    }
}

/// The sources of expected values for a layer of element type `T`, named `dtype` as in a case's
/// spec.
pub fn expectations<T: Element>(case: &Case, dtype: &str, against: Against) -> Vec<Expected> {
    let from_case = || Expected {
        source: "case's expected values",
        values: QUANTITIES.map(|q| (q, case.expected(q))).into(),
    };
    if against == Against::Case {
        return vec![from_case()];
    }
    let params = rounded_params::<T>(case);
    let x = rounded::<T>(&case.array("input"));
    let d_output = rounded::<T>(&case.array("d_output"));
    let mut sources = vec![Expected {
        source: "reference on the rounded values",
        values: reference(case, &params, &x, &d_output),
    }];
    if case.dtype() == dtype {
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
        sources.push(from_case());
    }
    sources
}

/// `conformance_case!(name, items)`: a module for the case `name` holding `items` and `case()`,
/// which reads data/conformance/`name`.json next to the suite's file.
macro_rules! conformance_case {
    ($name:ident, $($item:item)*) => {
        mod $name {
            fn case() -> crate::common::Case {
                crate::common::Case::parse(include_str!(concat!(
                    "data/conformance/",
                    stringify!($name),
                    ".json"
                )))
            }

            $($item)*
        }
    };
}

/// `conformance_tests!(tests, Device = device, dtype, against, [norm parameters; running
/// statistics], { spec without dtype })`, in a module of `conformance_case!`: the case as a layer
/// of `dtype` on `Device` (the expression `device` makes one), every quantity checked against
/// each source of [`expectations`] within the type's `Tolerance::CONFORMANCE`. `tests` is
/// `forward` (`evaluate` and `forward`) or `training` (every operation: also the running
/// statistics, `backward_full`, `backward_input` + `backward`, gradient accumulation and `zero`).
macro_rules! conformance_tests {
    (
        $tests:ident,
        $device:ty = $make:expr,
        $t:ident,
        $against:ident,
        [$($param:ident),*; $($stat:ident),*],
        { $($spec:tt)* }
    ) => {
        use super::case;
        use crate::common::conformance::{expectations, Against};
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
        type Device = $device;
        const TOLERANCE: f64 = <T as Tolerance>::CONFORMANCE;

        fn device() -> Device {
            $make
        }

        /// `got` against `factor` times every source of expected values.
        #[track_caller]
        fn check(case: &Case, name: &str, got: &[f64], factor: f64) {
            for source in expectations::<T>(case, stringify!($t), Against::$against) {
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

        /// `forward` in the case's mode: the layer after it, its state and the input.
        fn run_forward(device: &mut Device, case: &Case) -> (Layer, LayerState, Input) {
            let (mut layer, x, mut state) = (layer(case), input(case), LayerState::new());
            layer.forward(device, &x, &mut state, case.mode()).unwrap();
            (layer, state, x)
        }

        fn check_output() {
            let case = case();
            let (_, state, _) = run_forward(&mut device(), &case);
            check(&case, "output", &to_f64(state.output().as_slice()), 1.0);
        }

        #[test]
        fn shape_constants() {
            assert_eq!(constants!(Layer), case().spec().constants());
        }

        #[test]
        fn evaluate() {
            let case = case();
            let mut y: Output = Tensor::from_fn(|_| T::from_f64(f64::NAN)); // to be overwritten
            layer(&case).evaluate(&mut device(), &input(&case), &mut y).unwrap();
            check(&case, "evaluate_output", &to_f64(y.as_slice()), 1.0);
        }

        conformance_tests!(@$tests [$($param),*; $($stat),*]);
    };
    (@forward $fields:tt) => {
        #[test]
        fn forward() {
            check_output();
        }
    };
    (@training [$($param:ident),*; $($stat:ident),*]) => {
        type A = <T as Element>::Acc;

        fn d_output(case: &Case) -> Output {
            Tensor::from_vec(convert(&case.array("d_output"))).unwrap()
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
        fn forward_output() {
            check_output();
        }

        $(
            #[test]
            fn $stat() {
                let case = case();
                let (layer, _, _) = run_forward(&mut device(), &case);
                let got: &[A] = layer.$stat.as_slice();
                check(&case, stringify!($stat), &to_f64(got), 1.0);
            }
        )*

        #[test]
        fn backward_full() {
            let (case, mut device) = (case(), device());
            let (layer, state, x) = run_forward(&mut device, &case);
            let (mut d_input, mut grads) = (Tensor::zeros(), LayerGrads::zeros());
            let (d_output, mode) = (d_output(&case), case.mode());
            layer
                .backward_full(&mut device, &state, &x, &d_output, &mut d_input, &mut grads, mode)
                .unwrap();
            check(&case, "d_input", &to_f64(d_input.as_slice()), 1.0);
            check_gradients(&case, &grads, 1.0);
        }

        #[test]
        fn backward_input_and_backward() {
            let (case, mut device) = (case(), device());
            let (layer, state, x) = run_forward(&mut device, &case);
            let (d_output, mode) = (d_output(&case), case.mode());
            let mut d_input: Input = Tensor::from_fn(|_| T::from_f64(f64::NAN)); // overwritten
            layer.backward_input(&mut device, &state, &d_output, &mut d_input, mode).unwrap();
            check(&case, "d_input", &to_f64(d_input.as_slice()), 1.0);
            let mut grads = LayerGrads::zeros();
            layer.backward(&mut device, &state, &x, &d_output, &mut grads, mode).unwrap();
            check_gradients(&case, &grads, 1.0);
        }

        #[test]
        fn gradients_accumulate_until_zeroed() {
            let (case, mut device) = (case(), device());
            let (layer, state, x) = run_forward(&mut device, &case);
            let (d_output, mode) = (d_output(&case), case.mode());
            let mut grads = LayerGrads::zeros();
            for _ in 0..2 {
                layer.backward(&mut device, &state, &x, &d_output, &mut grads, mode).unwrap();
            }
            check_gradients(&case, &grads, 2.0);
            grads.zero();
            for (name, got) in gradients(&grads) {
                assert!(got.iter().all(|&g| g == 0.0), "{name} not zeroed");
            }
            layer.backward(&mut device, &state, &x, &d_output, &mut grads, mode).unwrap();
            check_gradients(&case, &grads, 1.0);
        }
    };
}
