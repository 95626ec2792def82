//! The generated specs every suite runs (forward and backward against the reference, half
//! precision, oneDNN against the CPU device): `for_each_spec!(m)` calls `m!(name, key: value, ..)`
//! for each, keys in the order `input, out_channels, kernel, stride, padding, activation, batch,
//! dtype`.

#[allow(unused_macros)]
macro_rules! for_each_spec {
    ($m:ident) => {
        // Every key at its default but the required ones.
        $m!(defaults, input: [8, 8, 1], out_channels: 1, kernel: 3);
        $m!(defaults_f64, input: [7, 5, 2], out_channels: 3, kernel: [2, 3], dtype: f64);
        $m!(stride_only, input: [9, 7, 6], out_channels: 13, kernel: [3, 4], stride: [2, 3],
            activation: Tanh, batch: 2, dtype: f64);
        $m!(padding_only, input: [5, 6, 7], out_channels: 9, kernel: 5, padding: [2, 1],
            activation: Relu, batch: 3);

        // Each activation in both dtypes.
        $m!(relu_pad1, input: [5, 7, 3], out_channels: 4, kernel: 3, stride: 1, padding: 1,
            activation: Relu, batch: 2, dtype: f64);
        $m!(tanh_stride2, input: [9, 9, 2], out_channels: 5, kernel: 3, stride: 2, padding: 1,
            activation: Tanh, batch: 3, dtype: f32);
        $m!(sigmoid_nonsquare, input: [7, 11, 4], out_channels: 7, kernel: [2, 3], stride: [1, 2],
            padding: 0, activation: Sigmoid, batch: 2, dtype: f64);
        $m!(gelu_1x1, input: [6, 6, 8], out_channels: 9, kernel: 1, stride: 1, padding: 0,
            activation: Gelu, batch: 4, dtype: f32);
        $m!(fast_tanh_k5, input: [10, 10, 3], out_channels: 13, kernel: 5, stride: 2, padding: 2,
            activation: FastTanh, batch: 2, dtype: f64);
        $m!(relu_k3x1, input: [12, 9, 5], out_channels: 17, kernel: [3, 1], stride: [2, 1],
            padding: [1, 0], activation: Relu, batch: 1, dtype: f32);
        $m!(identity_k4_s4, input: [16, 16, 3], out_channels: 33, kernel: 4, stride: 4, padding: 0,
            activation: Identity, batch: 2, dtype: f64);
        $m!(sigmoid_k8_pad3, input: [3, 3, 2], out_channels: 4, kernel: 8, stride: 1, padding: 3,
            activation: Sigmoid, batch: 1, dtype: f32);
        $m!(gelu_k8x4, input: [13, 7, 2], out_channels: 6, kernel: [8, 4], stride: [3, 2],
            padding: [2, 1], activation: Gelu, batch: 3, dtype: f64);
        $m!(fast_tanh_f32, input: [16, 12, 8], out_channels: 32, kernel: 3, stride: 1, padding: 1,
            activation: FastTanh, batch: 2, dtype: f32);
        $m!(identity_f32, input: [9, 8, 4], out_channels: 13, kernel: 7, stride: 1, padding: 3,
            activation: Identity, batch: 1, dtype: f32);

        // Networks users build: an Atari DQN trunk and a ResNet stem.
        $m!(atari_conv1, input: [84, 84, 4], out_channels: 16, kernel: 8, stride: 4, padding: 0,
            activation: Relu, batch: 1, dtype: f32);
        $m!(atari_conv2, input: [20, 20, 16], out_channels: 32, kernel: 4, stride: 2, padding: 0,
            activation: Relu, batch: 2, dtype: f32);
        $m!(atari_conv3, input: [9, 9, 32], out_channels: 64, kernel: 3, stride: 1, padding: 0,
            activation: Relu, batch: 1, dtype: f64);
        $m!(resnet_stem, input: [32, 32, 3], out_channels: 16, kernel: 7, stride: 2, padding: 3,
            activation: Relu, batch: 1, dtype: f32);

        // Output channels around the SIMD widths.
        $m!(oc1, input: [10, 6, 7], out_channels: 1, kernel: [3, 2], stride: [2, 1], padding: 1,
            activation: FastTanh, batch: 5, dtype: f64);
        $m!(oc1_s4, input: [13, 13, 9], out_channels: 1, kernel: 3, stride: 4, padding: 1,
            activation: FastTanh, batch: 4, dtype: f32);
        $m!(oc3_ic65, input: [5, 5, 65], out_channels: 3, kernel: 3, stride: 1, padding: 1,
            activation: Gelu, batch: 2, dtype: f32);
        $m!(oc5_ic17, input: [6, 9, 17], out_channels: 5, kernel: [5, 3], stride: [1, 3],
            padding: [2, 1], activation: Sigmoid, batch: 3, dtype: f64);
        $m!(oc7_s4_p3, input: [11, 13, 3], out_channels: 7, kernel: 6, stride: 4, padding: 3,
            activation: Tanh, batch: 2, dtype: f32);
        $m!(oc9_ic31, input: [7, 7, 31], out_channels: 9, kernel: 2, stride: 2, padding: 0,
            activation: Relu, batch: 4, dtype: f64);
        $m!(oc17_ic33, input: [6, 5, 33], out_channels: 17, kernel: [1, 3], stride: 1,
            padding: [0, 1], activation: Gelu, batch: 2, dtype: f64);
        $m!(oc33_s3, input: [12, 12, 5], out_channels: 33, kernel: 3, stride: 3, padding: 1,
            activation: FastTanh, batch: 3, dtype: f32);
        $m!(oc33_ic67, input: [3, 4, 67], out_channels: 33, kernel: [3, 2], stride: 1,
            padding: [1, 0], activation: Sigmoid, batch: 5, dtype: f32);
        $m!(oc64_ic64, input: [6, 6, 64], out_channels: 64, kernel: 3, stride: 2, padding: 1,
            activation: Relu, batch: 2, dtype: f64);
        $m!(oc64_ic16, input: [8, 8, 16], out_channels: 64, kernel: 3, stride: 1, padding: 1,
            activation: Relu, batch: 2, dtype: f32);
        $m!(oc2_ic2, input: [12, 12, 2], out_channels: 2, kernel: 5, stride: 1, padding: 2,
            activation: Gelu, batch: 5, dtype: f64);
        $m!(oc31_ic15, input: [8, 8, 15], out_channels: 31, kernel: 3, stride: [2, 1],
            padding: [0, 1], activation: Relu, batch: 2, dtype: f32);
        $m!(oc48_ic32, input: [10, 10, 32], out_channels: 48, kernel: 3, stride: 1, padding: 1,
            activation: Identity, batch: 1, dtype: f32);
        $m!(oc8_ic63, input: [5, 6, 63], out_channels: 8, kernel: [2, 4], stride: [3, 1],
            padding: [1, 2], activation: Tanh, batch: 3, dtype: f64);
        $m!(oc16_ic5_k6x4, input: [11, 7, 5], out_channels: 16, kernel: [6, 4], stride: [2, 3],
            padding: [3, 2], activation: Sigmoid, batch: 1, dtype: f64);
        $m!(oc24_k1_s2, input: [9, 9, 16], out_channels: 24, kernel: 1, stride: 2, padding: 0,
            activation: Identity, batch: 2, dtype: f64);
        $m!(oc1_ic1, input: [5, 5, 1], out_channels: 1, kernel: 2, stride: 1, padding: 0,
            activation: Sigmoid, batch: 2, dtype: f64);

        // Kernels and paddings at the edges.
        $m!(ic1_k8_output_1x1, input: [8, 8, 1], out_channels: 12, kernel: 8, stride: 1, padding: 0,
            activation: Tanh, batch: 3, dtype: f64);
        $m!(input_1x1_ic67, input: [1, 1, 67], out_channels: 8, kernel: 1, activation: Tanh,
            batch: 5, dtype: f64);
        $m!(k8x1, input: [10, 4, 6], out_channels: 8, kernel: [8, 1], stride: [1, 1],
            padding: [0, 0], activation: Sigmoid, batch: 2, dtype: f32);
        $m!(k1x8, input: [4, 10, 6], out_channels: 15, kernel: [1, 8], stride: 1, padding: [1, 2],
            activation: Relu, batch: 1, dtype: f64);
        $m!(k1_pad2, input: [4, 5, 3], out_channels: 6, kernel: 1, stride: 1, padding: 2,
            activation: Sigmoid, batch: 2, dtype: f32);
        $m!(k3_pad3, input: [4, 4, 2], out_channels: 3, kernel: 3, stride: 1, padding: 3,
            activation: Relu, batch: 2, dtype: f32);
        $m!(k2_s2_odd, input: [7, 9, 8], out_channels: 16, kernel: 2, stride: 2, padding: 1,
            activation: Gelu, batch: 3, dtype: f32);
        $m!(kernel_fills_padded_input, input: [2, 3, 4], out_channels: 5, kernel: [4, 5], stride: 1,
            padding: 1, activation: Relu, batch: 3, dtype: f64);
        $m!(k8_s4_p3, input: [20, 18, 3], out_channels: 9, kernel: 8, stride: 4, padding: 3,
            activation: Gelu, batch: 2, dtype: f64);

        // Mixed strides and paddings per axis.
        $m!(s3x1, input: [10, 10, 3], out_channels: 5, kernel: [4, 2], stride: [3, 1],
            padding: [1, 0], activation: Relu, batch: 4, dtype: f64);
        $m!(s1x4, input: [6, 17, 2], out_channels: 9, kernel: [3, 5], stride: [1, 4],
            padding: [1, 2], activation: Tanh, batch: 2, dtype: f32);
        $m!(s4x2_p2x3, input: [15, 11, 4], out_channels: 7, kernel: [5, 6], stride: [4, 2],
            padding: [2, 3], activation: FastTanh, batch: 1, dtype: f64);
    };
}
