//! The conformance cases of tests/data/conformance every conformance suite runs:
//! `for_each_case!(m)` calls `m!(name, dtype, [norm parameters; running statistics], { spec })`
//! for each, `dtype` the case's (its values are representable in it) and `spec` the case's
//! `conv2d!` keys but `dtype`.

macro_rules! for_each_case {
    ($m:ident) => {
        $m!(p01_basic_3x3, f64, [;], {
            input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [0, 0],
            activation: Identity, norm: None, batch: 2,
        });
        $m!(p02_relu_pad, f64, [;], {
            input: [5, 7, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: Relu, norm: None, batch: 2,
        });
        $m!(p03_stride2_k5, f64, [;], {
            input: [11, 9, 2], out_channels: 4, kernel: [5, 5], stride: [2, 2], padding: [2, 2],
            activation: Tanh, norm: None, batch: 2,
        });
        $m!(p04_1x1_sigmoid, f64, [;], {
            input: [4, 4, 6], out_channels: 5, kernel: [1, 1], stride: [1, 1], padding: [0, 0],
            activation: Sigmoid, norm: None, batch: 3,
        });
        $m!(p05_gelu_nonsquare, f64, [;], {
            input: [7, 6, 3], out_channels: 4, kernel: [3, 5], stride: [1, 1], padding: [1, 2],
            activation: Gelu, norm: None, batch: 2,
        });
        $m!(p06_fast_tanh, f64, [;], {
            input: [6, 6, 2], out_channels: 3, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: FastTanh, norm: None, batch: 2,
        });
        $m!(p07_bn_train, f64, [gamma, beta; running_mean, running_var], {
            input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: Relu, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3,
        });
        $m!(p08_bn_eval, f64, [gamma, beta; running_mean, running_var], {
            input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: Relu, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3,
        });
        $m!(p09_ln, f64, [gamma, beta;], {
            input: [6, 6, 3], out_channels: 4, kernel: [3, 3], stride: [2, 2], padding: [1, 1],
            activation: Tanh, norm: LayerNorm { eps: 1e-5 }, batch: 2,
        });
        $m!(p10_f32, f32, [;], {
            input: [8, 8, 4], out_channels: 8, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: Relu, norm: None, batch: 2,
        });
        $m!(p11_bf16, bf16, [;], {
            input: [6, 6, 4], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: Relu, norm: None, batch: 2,
        });
        $m!(p12_f16_bn, f16, [gamma, beta; running_mean, running_var], {
            input: [6, 6, 4], out_channels: 4, kernel: [3, 3], stride: [1, 1], padding: [1, 1],
            activation: Identity, norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2,
        });
    };
}
