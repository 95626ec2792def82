//! Every generated CUDA source compiles with NVRTC for sm_90 without a warning, and defines
//! exactly the kernels its layer lists: specs covering every activation, norm and element type, strides 1-4,
//! paddings 0-3, and both sides of the direct-kernels-or-cuDNN rule. No GPU is needed.
//!
//! Needs the `cuda` feature and NVRTC 13 (`pip install nvidia-cuda-nvrtc nvidia-cuda-runtime`
//! is enough, found through python3's site-packages; or NVRTC_LIB_DIR / LD_LIBRARY_PATH and
//! CUDA_INCLUDE_DIR, see `conv_runtime::cuda::nvrtc`):
//!
//! ```sh
//! cargo test --release --features cuda --test cuda_kernels
//! ```
#![cfg(feature = "cuda")]

use conv_runtime::cuda::{nvrtc, THREADS};

const ARCH: &str = "sm_90";

/// Compiles a layer's source (without a warning) and compares the kernels the CUBIN defines
/// with the layer's list.
fn check(source: &str, listed: &[&str], direct: bool, expect_direct: bool) {
    assert_eq!(direct, expect_direct, "the direct-or-cuDNN rule");
    let compiled = nvrtc::compile_with_log(source, ARCH).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(compiled.log, "", "NVRTC's warnings");
    let mut found = nvrtc::kernel_names(&compiled.cubin).unwrap();
    found.sort();
    let mut listed = listed.to_vec();
    listed.sort_unstable();
    assert_eq!(found, listed);
}

/// `layers! { name (direct | cudnn): { spec keys }, .. }`: a module per spec with the layer and
/// its test.
macro_rules! layers {
    ($($name:ident ($path:ident): { $($spec:tt)* })*) => {
        $(
            mod $name {
                #![allow(dead_code)]
                conv_runtime::conv2d! {
                    pub struct Layer { $($spec)* }
                }

                #[test]
                fn compiles_with_its_kernels() {
                    super::check(
                        Layer::__CUDA_SOURCE,
                        Layer::__CUDA_KERNELS,
                        Layer::__CUDA_DIRECT,
                        stringify!($path) == "direct",
                    );
                }
            }
        )*
    };
}

layers! {
    // Direct kernels: small work, or a narrow convolution.
    f32_identity (direct): {
        input: [8, 8, 3], out_channels: 4, kernel: 3, batch: 2, dtype: f32,
    }
    f32_relu_batch_norm (direct): {
        input: [9, 9, 5], out_channels: 6, kernel: 3, stride: 2, padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 3, dtype: f32,
    }
    f16_gelu_layer_norm (direct): {
        input: [11, 10, 4], out_channels: 5, kernel: [5, 3], stride: 3, padding: 2,
        activation: Gelu, norm: LayerNorm { eps: 1e-5 }, batch: 2, dtype: f16,
    }
    bf16_tanh_batch_norm (direct): {
        input: [13, 13, 3], out_channels: 7, kernel: 6, stride: 4, padding: 3, activation: Tanh,
        norm: BatchNorm { momentum: 0.01, eps: 1e-3 }, batch: 4, dtype: bf16,
    }
    f16_fast_tanh (direct): {
        input: [12, 9, 2], out_channels: 3, kernel: [3, 1], stride: [2, 1], padding: [1, 0],
        activation: FastTanh, batch: 5, dtype: f16,
    }
    bf16_sigmoid_1x1 (direct): {
        input: [6, 6, 8], out_channels: 9, kernel: 1, activation: Sigmoid, batch: 4, dtype: bf16,
    }
    f64_tanh_layer_norm (direct): {
        input: [7, 5, 2], out_channels: 3, kernel: [2, 3], stride: [1, 2], activation: Tanh,
        norm: LayerNorm { eps: 1e-6 }, batch: 2, dtype: f64,
    }
    f64_sigmoid_batch_norm (direct): {
        input: [5, 6, 7], out_channels: 9, kernel: 5, padding: [2, 1], activation: Sigmoid,
        norm: BatchNorm { momentum: 1.0, eps: 1e-5 }, batch: 3, dtype: f64,
    }
    atari_conv1_batch1 (direct): {
        input: [84, 84, 4], out_channels: 16, kernel: 8, stride: 4, activation: Relu, batch: 1,
    }
    value_head_narrow (direct): {
        input: [64, 64, 64], out_channels: 1, kernel: 3, batch: 8,
    }

    // cuDNN: more work than a call's overhead.
    atari_conv1_batch32 (cudnn): {
        input: [84, 84, 4], out_channels: 16, kernel: 8, stride: 4, activation: Relu, batch: 32,
    }
    f32_sigmoid_stride3 (cudnn): {
        input: [64, 64, 16], out_channels: 32, kernel: 5, stride: 3, padding: 2,
        activation: Sigmoid, batch: 16, dtype: f32,
    }
    f32_fast_tanh_layer_norm (cudnn): {
        input: [28, 28, 32], out_channels: 32, kernel: 3, padding: 1, activation: FastTanh,
        norm: LayerNorm { eps: 1e-5 }, batch: 32, dtype: f32,
    }
    f16_relu_batch_norm (cudnn): {
        input: [56, 56, 64], out_channels: 64, kernel: 3, padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 8, dtype: f16,
    }
    f16_identity_stride4_pad3 (cudnn): {
        input: [96, 96, 8], out_channels: 32, kernel: 8, stride: 4, padding: 3, batch: 32,
        dtype: f16,
    }
    bf16_gelu_layer_norm (cudnn): {
        input: [32, 32, 32], out_channels: 64, kernel: 3, stride: 2, padding: 1,
        activation: Gelu, norm: LayerNorm { eps: 1e-5 }, batch: 16, dtype: bf16,
    }
    bf16_tanh (cudnn): {
        input: [40, 40, 16], out_channels: 32, kernel: 3, stride: 2, activation: Tanh,
        batch: 32, dtype: bf16,
    }
    f64_gelu (cudnn): {
        input: [32, 32, 16], out_channels: 32, kernel: 3, activation: Gelu, batch: 16,
        dtype: f64,
    }
}

#[test]
fn syntax_error_carries_nvrtc_log() {
    let err = nvrtc::compile("extern \"C\" __global__ void broken(int x { }\n", ARCH).unwrap_err();
    assert!(err.operation.contains("NVRTC"), "{err}");
    // NVRTC's own message, at the program's name and line.
    let at = format!("{}(1): error", nvrtc::PROGRAM_NAME);
    assert!(err.reason.contains(&at), "{err}");
    assert!(err.reason.contains("NVRTC_ERROR_COMPILATION"), "{err}");
}

#[test]
fn errors_name_the_kernel_file() {
    let source = format!(
        "{}\n#error broken on purpose\n",
        f32_identity::Layer::__CUDA_SOURCE
    );
    let err = nvrtc::compile(&source, ARCH).unwrap_err();
    // The direct gradients are the last file of a direct layer's source.
    assert!(
        err.reason
            .contains("conv_macros/kernels/direct_backward.cu("),
        "{err}"
    );
    assert!(err.reason.contains("broken on purpose"), "{err}");
}

#[test]
fn only_real_architectures() {
    let err = nvrtc::compile(f32_identity::Layer::__CUDA_SOURCE, "compute_90").unwrap_err();
    assert!(err.reason.contains("compute_90"), "{err}");
}

#[test]
fn kernels_take_the_runtime_block_size() {
    let line = format!("constexpr int THREADS = {THREADS};");
    assert!(f32_identity::Layer::__CUDA_SOURCE.contains(&line));
}

#[test]
fn nvrtc_is_cuda_13() {
    let (major, minor) = nvrtc::version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    assert_eq!(major, 13);
}

/// The optimizers' kernels (`conv_runtime/src/cuda/optim.cu`, shared by every layer) compile and
/// define exactly the list the host launches from, one SGD, one Adam and one RMSprop kernel per
/// element type.
#[test]
fn optimizer_kernels_compile() {
    use conv_runtime::cuda::{OPTIMIZER_KERNELS, OPTIMIZER_SOURCE};
    check(OPTIMIZER_SOURCE, OPTIMIZER_KERNELS, false, false);
    for element in ["f64", "f32", "f16", "bf16"] {
        for optimizer in ["sgd", "adam", "rmsprop"] {
            let name = format!("{optimizer}_{element}");
            assert!(OPTIMIZER_KERNELS.contains(&name.as_str()), "{name}");
        }
    }
}

/// `network!`'s own kernels (pooling, standalone activations, residual sums), one source per
/// entry, in every element type: each compiles without a warning and defines exactly its list.
mod network_entries {
    #![allow(dead_code)]

    macro_rules! net {
        ($module:ident, $dtype:ident) => {
            mod $module {
                conv_runtime::network! {
                    pub struct Net {
                        input: [11, 9, 5],
                        batch: 3,
                        dtype: $dtype,
                        layers: [
                            max: MaxPool2d { kernel: [3, 2], stride: [2, 1], padding: [1, 1] },
                            res: Residual { layers: [
                                gelu: Activation(Gelu),
                                conv: Conv2d { out_channels: 5, kernel: 3, padding: 1 },
                            ] },
                            avg: AvgPool2d { kernel: 3, stride: 2, padding: 1 },
                            tanh: Activation(FastTanh),
                            flat: Flatten,
                            fc: Dense { out_features: 3 },
                        ],
                    }
                }

                #[test]
                fn entries_compile_with_their_kernels() {
                    let entries: Vec<&str> =
                        Net::__CUDA_SOURCES.iter().map(|(e, _, _)| *e).collect();
                    assert_eq!(entries, ["max", "res", "res.gelu", "avg", "tanh"]);
                    for (_, source, kernels) in Net::__CUDA_SOURCES {
                        super::super::check(source, kernels, false, false);
                    }
                }
            }
        };
    }

    net!(f32_net, f32);
    net!(f64_net, f64);
    net!(f16_net, f16);
    net!(bf16_net, bf16);
}
