//! The generated specs every suite runs (forward and backward against the reference, half
//! precision, oneDNN and CUDA against the CPU device).
//!
//! `for_each_spec!(parsed m)` calls `m!(name, spec, { keys }, [dtype])` for each (see
//! `parse_spec!`), so that the keys are matched here, once, rather than in every suite. The specs
//! are written `name, key: value, ..`, keys in the order `input, out_channels, kernel, stride,
//! padding, activation, batch, dtype`, each optional key only where given.

#[allow(unused_macros)]
macro_rules! for_each_spec {
    (parsed $m:ident) => {
        for_each_spec!(@list parse_spec, $m;);
    };
    // `$pre`: tokens put before each spec's name.
    (@list $m:ident, $($pre:tt)*) => {
        // Every key at its default but the required ones.
        $m!($($pre)* defaults, input: [8, 8, 1], out_channels: 1, kernel: 3);
        $m!($($pre)* defaults_f64, input: [7, 5, 2], out_channels: 3, kernel: [2, 3], dtype: f64);
        $m!($($pre)* stride_only, input: [9, 7, 6], out_channels: 13, kernel: [3, 4],
            stride: [2, 3], activation: Tanh, batch: 2, dtype: f64);
        $m!($($pre)* padding_only, input: [5, 6, 7], out_channels: 9, kernel: 5, padding: [2, 1],
            activation: Relu, batch: 3);

        // Each activation in both dtypes.
        $m!($($pre)* relu_pad1, input: [5, 7, 3], out_channels: 4, kernel: 3, stride: 1, padding: 1,
            activation: Relu, batch: 2, dtype: f64);
        $m!($($pre)* tanh_stride2, input: [9, 9, 2], out_channels: 5, kernel: 3, stride: 2,
            padding: 1, activation: Tanh, batch: 3, dtype: f32);
        $m!($($pre)* sigmoid_nonsquare, input: [7, 11, 4], out_channels: 7, kernel: [2, 3],
            stride: [1, 2], padding: 0, activation: Sigmoid, batch: 2, dtype: f64);
        $m!($($pre)* gelu_1x1, input: [6, 6, 8], out_channels: 9, kernel: 1, stride: 1, padding: 0,
            activation: Gelu, batch: 4, dtype: f32);
        $m!($($pre)* fast_tanh_k5, input: [10, 10, 3], out_channels: 13, kernel: 5, stride: 2,
            padding: 2, activation: FastTanh, batch: 2, dtype: f64);
        $m!($($pre)* relu_k3x1, input: [12, 9, 5], out_channels: 17, kernel: [3, 1], stride: [2, 1],
            padding: [1, 0], activation: Relu, batch: 1, dtype: f32);
        $m!($($pre)* identity_k4_s4, input: [16, 16, 3], out_channels: 33, kernel: 4, stride: 4,
            padding: 0, activation: Identity, batch: 2, dtype: f64);
        $m!($($pre)* sigmoid_k8_pad3, input: [3, 3, 2], out_channels: 4, kernel: 8, stride: 1,
            padding: 3, activation: Sigmoid, batch: 1, dtype: f32);
        $m!($($pre)* gelu_k8x4, input: [13, 7, 2], out_channels: 6, kernel: [8, 4], stride: [3, 2],
            padding: [2, 1], activation: Gelu, batch: 3, dtype: f64);
        $m!($($pre)* fast_tanh_f32, input: [16, 12, 8], out_channels: 32, kernel: 3, stride: 1,
            padding: 1, activation: FastTanh, batch: 2, dtype: f32);
        $m!($($pre)* identity_f32, input: [9, 8, 4], out_channels: 13, kernel: 7, stride: 1,
            padding: 3, activation: Identity, batch: 1, dtype: f32);

        // Networks users build: an Atari DQN trunk and a ResNet stem.
        $m!($($pre)* atari_conv1, input: [84, 84, 4], out_channels: 16, kernel: 8, stride: 4,
            padding: 0, activation: Relu, batch: 1, dtype: f32);
        $m!($($pre)* atari_conv2, input: [20, 20, 16], out_channels: 32, kernel: 4, stride: 2,
            padding: 0, activation: Relu, batch: 2, dtype: f32);
        $m!($($pre)* atari_conv3, input: [9, 9, 32], out_channels: 64, kernel: 3, stride: 1,
            padding: 0, activation: Relu, batch: 1, dtype: f64);
        $m!($($pre)* resnet_stem, input: [32, 32, 3], out_channels: 16, kernel: 7, stride: 2,
            padding: 3, activation: Relu, batch: 1, dtype: f32);

        // Output channels around the SIMD widths.
        $m!($($pre)* oc1, input: [10, 6, 7], out_channels: 1, kernel: [3, 2], stride: [2, 1],
            padding: 1, activation: FastTanh, batch: 5, dtype: f64);
        $m!($($pre)* oc1_s4, input: [13, 13, 9], out_channels: 1, kernel: 3, stride: 4, padding: 1,
            activation: FastTanh, batch: 4, dtype: f32);
        $m!($($pre)* oc3_ic65, input: [5, 5, 65], out_channels: 3, kernel: 3, stride: 1, padding: 1,
            activation: Gelu, batch: 2, dtype: f32);
        $m!($($pre)* oc5_ic17, input: [6, 9, 17], out_channels: 5, kernel: [5, 3], stride: [1, 3],
            padding: [2, 1], activation: Sigmoid, batch: 3, dtype: f64);
        $m!($($pre)* oc7_s4_p3, input: [11, 13, 3], out_channels: 7, kernel: 6, stride: 4,
            padding: 3, activation: Tanh, batch: 2, dtype: f32);
        $m!($($pre)* oc9_ic31, input: [7, 7, 31], out_channels: 9, kernel: 2, stride: 2, padding: 0,
            activation: Relu, batch: 4, dtype: f64);
        $m!($($pre)* oc17_ic33, input: [6, 5, 33], out_channels: 17, kernel: [1, 3], stride: 1,
            padding: [0, 1], activation: Gelu, batch: 2, dtype: f64);
        $m!($($pre)* oc33_s3, input: [12, 12, 5], out_channels: 33, kernel: 3, stride: 3,
            padding: 1, activation: FastTanh, batch: 3, dtype: f32);
        $m!($($pre)* oc33_ic67, input: [3, 4, 67], out_channels: 33, kernel: [3, 2], stride: 1,
            padding: [1, 0], activation: Sigmoid, batch: 5, dtype: f32);
        $m!($($pre)* oc64_ic64, input: [6, 6, 64], out_channels: 64, kernel: 3, stride: 2,
            padding: 1, activation: Relu, batch: 2, dtype: f64);
        $m!($($pre)* oc64_ic16, input: [8, 8, 16], out_channels: 64, kernel: 3, stride: 1,
            padding: 1, activation: Relu, batch: 2, dtype: f32);
        $m!($($pre)* oc2_ic2, input: [12, 12, 2], out_channels: 2, kernel: 5, stride: 1, padding: 2,
            activation: Gelu, batch: 5, dtype: f64);
        $m!($($pre)* oc31_ic15, input: [8, 8, 15], out_channels: 31, kernel: 3, stride: [2, 1],
            padding: [0, 1], activation: Relu, batch: 2, dtype: f32);
        $m!($($pre)* oc48_ic32, input: [10, 10, 32], out_channels: 48, kernel: 3, stride: 1,
            padding: 1, activation: Identity, batch: 1, dtype: f32);
        $m!($($pre)* oc8_ic63, input: [5, 6, 63], out_channels: 8, kernel: [2, 4], stride: [3, 1],
            padding: [1, 2], activation: Tanh, batch: 3, dtype: f64);
        $m!($($pre)* oc16_ic5_k6x4, input: [11, 7, 5], out_channels: 16, kernel: [6, 4],
            stride: [2, 3], padding: [3, 2], activation: Sigmoid, batch: 1, dtype: f64);
        $m!($($pre)* oc24_k1_s2, input: [9, 9, 16], out_channels: 24, kernel: 1, stride: 2,
            padding: 0, activation: Identity, batch: 2, dtype: f64);
        $m!($($pre)* oc1_ic1, input: [5, 5, 1], out_channels: 1, kernel: 2, stride: 1, padding: 0,
            activation: Sigmoid, batch: 2, dtype: f64);

        // Layers the Winograd kernels run, every norm in the suites that add one. Stride-1 3x3:
        // ragged tiles (odd output sizes), channel blocks of one, two and three vectors.
        $m!($($pre)* wino_odd, input: [9, 9, 16], out_channels: 16, kernel: 3, stride: 1,
            padding: 0, activation: Tanh, batch: 3, dtype: f32);
        $m!($($pre)* wino_nonsquare, input: [6, 11, 24], out_channels: 40, kernel: 3, stride: 1,
            padding: [1, 0], activation: Gelu, batch: 2, dtype: f32);
        // Stride-2 4x4 (space-to-depth F(3x3, 2x2)): padding, ragged tiles on both axes, three
        // vectors of output channels. atari_conv2 is the unpadded case.
        $m!($($pre)* wino_s2_pad, input: [16, 14, 8], out_channels: 24, kernel: 4, stride: 2,
            padding: 1, activation: Sigmoid, batch: 2, dtype: f32);
        // Kernels twice their stride at strides 4 and 3 (space-to-depth by 4 and 3): padding,
        // ragged tiles, 32 and 72 staged channels.
        $m!($($pre)* wino_s4_pad, input: [23, 21, 2], out_channels: 24, kernel: 8, stride: 4,
            padding: 3, activation: Tanh, batch: 2, dtype: f32);
        $m!($($pre)* wino_s3_k6, input: [20, 19, 8], out_channels: 16, kernel: 6, stride: 3,
            padding: 1, activation: Relu, batch: 2, dtype: f32);
        // F(5x5, 2x2) on space-to-depth by 4: padded, 14x13 outputs in ragged 5x5 tiles.
        // atari_conv1 is the unpadded case (20x20 outputs in whole tiles).
        $m!($($pre)* wino_s4_f5x2, input: [58, 56, 4], out_channels: 16, kernel: 8, stride: 4,
            padding: 1, activation: Relu, batch: 2, dtype: f32);
        // Stride-2 3x3 (F(2x2, 3x3) at stride 2): padded, and unpadded with an input row no
        // output reads.
        $m!($($pre)* wino_s2_k3_pad, input: [16, 16, 16], out_channels: 32, kernel: 3, stride: 2,
            padding: 1, activation: Relu, batch: 2, dtype: f32);
        $m!($($pre)* wino_s2_k3_clip, input: [18, 17, 16], out_channels: 24, kernel: 3, stride: 2,
            padding: 0, activation: Tanh, batch: 3, dtype: f32);

        // Kernels and paddings at the edges.
        $m!($($pre)* ic1_k8_output_1x1, input: [8, 8, 1], out_channels: 12, kernel: 8, stride: 1,
            padding: 0, activation: Tanh, batch: 3, dtype: f64);
        $m!($($pre)* input_1x1_ic67, input: [1, 1, 67], out_channels: 8, kernel: 1,
            activation: Tanh, batch: 5, dtype: f64);
        $m!($($pre)* k8x1, input: [10, 4, 6], out_channels: 8, kernel: [8, 1], stride: [1, 1],
            padding: [0, 0], activation: Sigmoid, batch: 2, dtype: f32);
        $m!($($pre)* k1x8, input: [4, 10, 6], out_channels: 15, kernel: [1, 8], stride: 1,
            padding: [1, 2], activation: Relu, batch: 1, dtype: f64);
        $m!($($pre)* k1_pad2, input: [4, 5, 3], out_channels: 6, kernel: 1, stride: 1, padding: 2,
            activation: Sigmoid, batch: 2, dtype: f32);
        $m!($($pre)* k3_pad3, input: [4, 4, 2], out_channels: 3, kernel: 3, stride: 1, padding: 3,
            activation: Relu, batch: 2, dtype: f32);
        $m!($($pre)* k2_s2_odd, input: [7, 9, 8], out_channels: 16, kernel: 2, stride: 2,
            padding: 1, activation: Gelu, batch: 3, dtype: f32);
        $m!($($pre)* kernel_fills_padded_input, input: [2, 3, 4], out_channels: 5, kernel: [4, 5],
            stride: 1, padding: 1, activation: Relu, batch: 3, dtype: f64);
        $m!($($pre)* k8_s4_p3, input: [20, 18, 3], out_channels: 9, kernel: 8, stride: 4,
            padding: 3, activation: Gelu, batch: 2, dtype: f64);

        // Mixed strides and paddings per axis.
        $m!($($pre)* s3x1, input: [10, 10, 3], out_channels: 5, kernel: [4, 2], stride: [3, 1],
            padding: [1, 0], activation: Relu, batch: 4, dtype: f64);
        $m!($($pre)* s1x4, input: [6, 17, 2], out_channels: 9, kernel: [3, 5], stride: [1, 4],
            padding: [1, 2], activation: Tanh, batch: 2, dtype: f32);
        $m!($($pre)* s4x2_p2x3, input: [15, 11, 4], out_channels: 7, kernel: [5, 6], stride: [4, 2],
            padding: [2, 3], activation: FastTanh, batch: 1, dtype: f64);
    };
}

/// `parse_spec!(m; name, key: value, ..)` (a spec of `for_each_spec!`) calls
/// `m!(name, spec, { keys }, [dtype])`: `spec` a `Spec` expression with every
/// default filled in (no norm), `keys` the spec's `conv2d!` keys but `dtype`, each followed by a
/// comma, and `dtype` as given (or nothing), so that a suite can add a norm or choose the type.
macro_rules! parse_spec {
    (
        $m:ident;
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
        $m!(
            $name,
            crate::common::Spec {
                input: [$ih, $iw, $ic],
                out_channels: $oc,
                kernel: dims!($kernel),
                stride: or_default!([1, 1] $(, dims!($stride))?),
                padding: or_default!([0, 0] $(, dims!($padding))?),
                activation: or_default!(
                    crate::common::Activation::Identity
                    $(, crate::common::Activation::$activation)?
                ),
                norm: crate::common::Norm::None,
                batch: or_default!(1 $(, $batch)?),
            },
            {
                input: [$ih, $iw, $ic],
                out_channels: $oc,
                kernel: $kernel,
                $(stride: $stride,)?
                $(padding: $padding,)?
                $(activation: $activation,)?
                $(batch: $batch,)?
            },
            [$($dtype)?]
        );
    };
}
