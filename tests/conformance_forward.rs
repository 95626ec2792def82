//! The conformance cases without a norm, forward only: `evaluate` and `forward` in the case's
//! mode, each case as a float64 and a float32 layer (the case's values converted).

#[macro_use]
mod common;

/// `case!(name, [module: dtype, ..], { spec without dtype })`: a module per case with a
/// submodule of tests per element type.
macro_rules! case {
    ($name:ident, [$($module:ident: $t:ident),+], $spec:tt) => {
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
                forward_tests!($t, $spec);
            })+
        }
    };
}

macro_rules! forward_tests {
    ($t:ident, { $($spec:tt)* }) => {
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
        const TOLERANCE: f64 = <T as Tolerance>::CONFORMANCE;

        fn layer(case: &Case) -> Layer {
            let mut layer = Layer::new(&mut Rng::seed_from_u64(0));
            layer.weights = Tensor::from_vec(convert(&case.array("weights"))).unwrap();
            layer.biases = Vector::from_vec(convert(&case.array("biases"))).unwrap();
            layer
        }

        fn input(case: &Case) -> Tensor<
            T,
            { Layer::BATCH_SIZE },
            { Layer::INPUT_HEIGHT },
            { Layer::INPUT_WIDTH },
            { Layer::INPUT_CHANNELS },
        > {
            Tensor::from_vec(convert(&case.array("input"))).unwrap()
        }

        #[test]
        fn shape_constants() {
            assert_eq!(constants!(Layer), case().spec().constants());
        }

        #[test]
        fn evaluate() {
            let case = case();
            let mut y: Tensor<
                T,
                { Layer::BATCH_SIZE },
                { Layer::OUTPUT_HEIGHT },
                { Layer::OUTPUT_WIDTH },
                { Layer::OUTPUT_CHANNELS },
            > = Tensor::zeros();
            layer(&case).evaluate(&mut Cpu::default(), &input(&case), &mut y).unwrap();
            let got = to_f64(y.as_slice());
            assert_close("evaluate", &got, &case.expected("evaluate_output"), TOLERANCE);
        }

        #[test]
        fn forward() {
            let case = case();
            let mut state = LayerState::new();
            let mut layer = layer(&case);
            layer.forward(&mut Cpu::default(), &input(&case), &mut state, case.mode()).unwrap();
            let got = to_f64(state.output().as_slice());
            assert_close("forward", &got, &case.expected("output"), TOLERANCE);
        }
    };
}

case! { p01_basic_3x3, [as_f64: f64, as_f32: f32], {
    input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [0, 0],
    activation: Identity, batch: 2,
} }

case! { p02_relu_pad, [as_f64: f64, as_f32: f32], {
    input: [5, 7, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, batch: 2,
} }

case! { p03_stride2_k5, [as_f64: f64, as_f32: f32], {
    input: [11, 9, 2], out_channels: 4, kernel: [5, 5], stride: [2, 2], padding: [2, 2],
    activation: Tanh, batch: 2,
} }

case! { p04_1x1_sigmoid, [as_f64: f64, as_f32: f32], {
    input: [4, 4, 6], out_channels: 5, kernel: [1, 1], stride: [1, 1], padding: [0, 0],
    activation: Sigmoid, batch: 3,
} }

case! { p05_gelu_nonsquare, [as_f64: f64, as_f32: f32], {
    input: [7, 6, 3], out_channels: 4, kernel: [3, 5], stride: [1, 1], padding: [1, 2],
    activation: Gelu, batch: 2,
} }

case! { p06_fast_tanh, [as_f64: f64, as_f32: f32], {
    input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: FastTanh, batch: 2,
} }

case! { p10_f32, [as_f32: f32, as_f64: f64], {
    input: [8, 8, 4], out_channels: 8, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
    activation: Relu, batch: 2,
} }
