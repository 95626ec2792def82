//! Import of PyTorch `Conv2d` / `BatchNorm2d` weights from a safetensors state dict.
//!
//! The fixture in `tests/data/pytorch/` is written by `scripts/make_pytorch_fixture.py` (numpy
//! and the `safetensors` package; regenerate with `pip install numpy safetensors && python3
//! scripts/make_pytorch_fixture.py`): the state dict of
//! `Sequential(Conv2d(3, 8, (3, 5), stride (1, 2), padding (1, 2)), BatchNorm2d(8, eps=1e-3),
//! ReLU(), Conv2d(8, 4, 3, stride 2))` with PyTorch's names, float32 and OIHW layout, and an
//! input with the eval-mode outputs after the ReLU and after the last conv, computed in float64
//! by plain numpy. Tensors there are NCHW; ours are NHWC.

use conv_runtime::prelude::*;
use conv_runtime::safetensors::{import_pytorch_conv2d, Reader};

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pytorch/conv_bn_relu_conv.safetensors"
);
const IO: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pytorch/conv_bn_relu_conv_io.safetensors"
);

/// Batch of the fixture's input.
const N: usize = 2;

/// An NCHW buffer as NHWC.
fn nchw_to_nhwc(shape: &[usize], values: &[f64]) -> Vec<f64> {
    let &[n, c, h, w] = shape else {
        panic!("not 4-d: {shape:?}")
    };
    let mut out = vec![0.0; values.len()];
    for b in 0..n {
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    out[((b * h + y) * w + x) * c + ch] = values[((b * c + ch) * h + y) * w + x];
                }
            }
        }
    }
    out
}

/// Reads an NCHW tensor of the fixture as NHWC, checking its shape.
fn fixture_nhwc(io: &Reader, name: &str, nchw: [usize; 4]) -> Vec<f64> {
    let (shape, values) = io.tensor_f64(name).unwrap();
    assert_eq!(shape, nchw, "{name}");
    nchw_to_nhwc(&shape, &values)
}

/// `got` matches `expected` within `tol` (absolute + relative).
fn assert_close(what: &str, got: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let mut worst = (0.0, 0);
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let err = (g - e).abs() / (1.0 + e.abs());
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= tol,
        "{what}: element {i} is {} vs PyTorch/numpy {} (relative error {:.3e} > {tol:e})",
        got[i],
        expected[i],
        worst.0
    );
}

/// The fixture's network in element type `$t`, imported and evaluated against the expected
/// outputs with tolerance `$tol`.
macro_rules! case {
    ($module:ident, $t:ty, $tol:expr) => {
        mod $module {
            use super::*;

            conv_runtime::conv2d! {
                /// features.0 + features.1 + features.2.
                pub struct Block {
                    input: [7, 9, 3], out_channels: 8, kernel: [3, 5], stride: [1, 2],
                    padding: [1, 2], activation: Relu,
                    norm: BatchNorm { momentum: 0.1, eps: 1e-3 }, dtype: $t,
                }
            }
            conv_runtime::conv2d! {
                /// features.3.
                pub struct Head { input: [7, 5, 8], out_channels: 4, kernel: 3, stride: 2, dtype: $t }
            }

            #[test]
            fn evaluate_matches_pytorch_eval() {
                let bytes = std::fs::read(MODEL).unwrap();
                let mut rng = Rng::seed_from_u64(0);
                let (mut block, mut head) = (Block::new(&mut rng), Head::new(&mut rng));
                import_pytorch_conv2d(&bytes, "features.0", Some("features.1"), &mut block)
                    .unwrap();
                import_pytorch_conv2d(&bytes, "features.3", None, &mut head).unwrap();

                let io = Reader::open(IO).unwrap();
                let x = fixture_nhwc(&io, "input", [N, 3, 7, 9]);
                let x = Tensor::<$t, N, 7, 9, 3>::from_fn(|i| <$t>::from_f64(x[i]));
                let mut h = Tensor::<$t, N, 7, 5, 8>::zeros();
                let mut y = Tensor::<$t, N, 3, 2, 4>::zeros();
                let mut cpu = Cpu::default();
                block.evaluate(&mut cpu, &x, &mut h).unwrap();
                head.evaluate(&mut cpu, &h, &mut y).unwrap();

                let to_f64 = |s: &[$t]| s.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
                assert_close(
                    "after ReLU (features.2)",
                    &to_f64(h.as_slice()),
                    &fixture_nhwc(&io, "features.2", [N, 8, 7, 5]),
                    $tol,
                );
                assert_close(
                    "output (features.3)",
                    &to_f64(y.as_slice()),
                    &fixture_nhwc(&io, "features.3", [N, 4, 3, 2]),
                    $tol,
                );
            }
        }
    };
}

// The fixture's values are float32, and so exact in f64: an f64 layer reproduces the float64
// reference up to summation order; an f32 layer to f32 rounding.
case!(float32, f32, 1e-5);
case!(float64, f64, 1e-12);

conv_runtime::conv2d! {
    /// Like features.0 but with a 3x3 kernel: does not fit the file.
    pub struct WrongKernel {
        input: [7, 9, 3], out_channels: 8, kernel: 3, padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-3 },
    }
}
conv_runtime::conv2d! {
    /// features.0 without the BatchNorm.
    pub struct NoNorm { input: [7, 9, 3], out_channels: 8, kernel: [3, 5], stride: [1, 2], padding: [1, 2] }
}
conv_runtime::conv2d! {
    /// features.0 with LayerNorm: has gamma and beta but no running statistics.
    pub struct WithLayerNorm {
        input: [7, 9, 3], out_channels: 8, kernel: [3, 5], stride: [1, 2], padding: [1, 2],
        norm: LayerNorm { eps: 1e-5 },
    }
}

fn model() -> Vec<u8> {
    std::fs::read(MODEL).unwrap()
}

#[test]
fn weights_are_transposed_from_oihw() {
    let reader = Reader::open(MODEL).unwrap();
    let (shape, pt) = reader.tensor_f64("features.0.weight").unwrap();
    assert_eq!(shape, [8, 3, 3, 5]);
    let mut layer = NoNorm::new(&mut Rng::seed_from_u64(0));
    reader
        .import_pytorch_conv2d("features.0", None, &mut layer)
        .unwrap();
    // ours[o][kh][kw][i] = PyTorch's [o][i][kh][kw]
    let (o, i, y, x) = (5, 2, 1, 3);
    let ours = layer.weights.as_slice()[((o * 3 + y) * 5 + x) * 3 + i];
    assert_eq!(ours as f64, pt[((o * 3 + i) * 3 + y) * 5 + x]);
}

#[test]
fn wrong_kernel_is_reported_in_pytorch_layout() {
    let mut layer = WrongKernel::new(&mut Rng::seed_from_u64(0));
    let before = layer.clone();
    let err =
        import_pytorch_conv2d(&model(), "features.0", Some("features.1"), &mut layer).unwrap_err();
    assert!(
        err.reason
            .contains("tensor `features.0.weight` has shape [8, 3, 3, 5], expected [8, 3, 3, 3]"),
        "{err}"
    );
    assert_eq!(
        layer.abs_diff(&before),
        0.0,
        "a failed import changed the layer"
    );
}

#[test]
fn missing_tensors_and_prefixes_are_named() {
    let mut layer = WrongKernel::new(&mut Rng::seed_from_u64(0));
    let err =
        import_pytorch_conv2d(&model(), "features.9", Some("features.1"), &mut layer).unwrap_err();
    assert!(
        err.reason.contains("missing tensor `features.9.weight`"),
        "{err}"
    );

    let err =
        import_pytorch_conv2d(&model(), "features.0", Some("features.2"), &mut layer).unwrap_err();
    assert!(
        err.reason.contains("no tensor named `features.2.*`"),
        "{err}"
    );
}

#[test]
fn norm_prefix_must_match_the_spec() {
    let mut plain = NoNorm::new(&mut Rng::seed_from_u64(0));
    let err =
        import_pytorch_conv2d(&model(), "features.0", Some("features.1"), &mut plain).unwrap_err();
    assert!(
        err.reason.contains("the layer has no normalization"),
        "{err}"
    );

    let mut layer = WrongKernel::new(&mut Rng::seed_from_u64(0));
    let err = import_pytorch_conv2d(&model(), "features.0", None, &mut layer).unwrap_err();
    assert!(err.reason.contains("no norm prefix was given"), "{err}");

    let mut layer_norm = WithLayerNorm::new(&mut Rng::seed_from_u64(0));
    let err = import_pytorch_conv2d(&model(), "features.0", Some("features.1"), &mut layer_norm)
        .unwrap_err();
    assert!(
        err.reason.contains("is a BatchNorm") && err.reason.contains("no running statistics"),
        "{err}"
    );
}

#[test]
fn not_a_safetensors_file() {
    let mut layer = NoNorm::new(&mut Rng::seed_from_u64(0));
    let err = import_pytorch_conv2d(b"PK\x03\x04 a zip archive", "features.0", None, &mut layer)
        .unwrap_err();
    assert!(err.reason.contains("not a valid safetensors file"), "{err}");
}
