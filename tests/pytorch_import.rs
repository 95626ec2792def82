//! Import of PyTorch `Conv2d` / `BatchNorm2d` weights, and of whole networks, from safetensors
//! state dicts.
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

// -------------------------------------------------------------------------------------------
// A whole network: `scripts/make_pytorch_network_fixture.py` writes the state dict of the
// `nn.Sequential` mirroring `Mixed` (PyTorch 2.x, float32) and its float64 eval-mode output.

const SEQUENTIAL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pytorch/sequential.safetensors"
);
const SEQUENTIAL_RENAMED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pytorch/sequential_renamed.safetensors"
);
const SEQUENTIAL_IO: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/pytorch/sequential_io.safetensors"
);

/// The fixture's model (`$fc` features in its first dense layer: 10 fit the file).
macro_rules! mixed {
    ($(#[$doc:meta])* $name:ident, $fc:literal) => {
        conv_runtime::network! {
            $(#[$doc])*
            pub struct $name {
                input: [9, 7, 3],
                batch: 2,
                layers: [
                    conv1: Conv2d {
                        out_channels: 8, kernel: [3, 5], padding: [1, 2], activation: Relu,
                        norm: BatchNorm { momentum: 0.1, eps: 1e-3 },
                    },
                    pool: MaxPool2d { kernel: 2 },
                    res: Residual { layers: [
                        act: Activation(Relu),
                        conv: Conv2d { out_channels: 8, kernel: 3, padding: 1 },
                    ] },
                    avg: AvgPool2d { kernel: 3, stride: 1, padding: 1 },
                    flat: Flatten,
                    fc: Dense { out_features: $fc, activation: Tanh },
                    out: Dense { out_features: 3 },
                ],
            }
        }
    };
}

mixed!(
    /// Conv + BatchNorm + ReLU, max-pool, a residual block, avg-pool, flatten of a 4x3x8 map,
    /// dense + Tanh, dense: the fixture's model.
    Mixed,
    10
);
mixed!(
    /// `Mixed` with a wider first dense layer: does not fit the file.
    MixedWide,
    12
);

fn all_values<P: Parameters<Elem = f32>>(net: &mut P) -> Vec<f32> {
    let mut values = Vec::new();
    net.visit(&mut |_, v| values.extend_from_slice(v));
    net.visit_buffers_mut(&mut |_, t| values.extend_from_slice(t.values()));
    values
}

/// `net` evaluated on the fixture's input, against PyTorch's float64 output.
fn assert_matches_pytorch(net: &Mixed) {
    let io = Reader::open(SEQUENTIAL_IO).unwrap();
    let x = fixture_nhwc(&io, "input", [2, 3, 9, 7]);
    let x = MixedInput::<2>::from_fn(|i| x[i] as f32);
    let mut y = MixedOutput::<2>::zeros();
    net.evaluate(&mut Cpu::default(), &x, &mut y).unwrap();
    let (shape, expected) = io.tensor_f64("output").unwrap();
    assert_eq!(shape, [2, 3]);
    let got: Vec<f64> = y.as_slice().iter().map(|&v| v as f64).collect();
    assert_close("network output", &got, &expected, 1e-5);
}

#[test]
fn a_whole_sequential_imports_by_its_indices() {
    let mut net = Mixed::new(&mut Rng::seed_from_u64(0));
    Reader::open(SEQUENTIAL)
        .unwrap()
        .import_pytorch_network(&[], &mut net)
        .unwrap();
    assert_matches_pytorch(&net);
}

#[test]
fn module_names_map_entries_to_a_custom_model() {
    let bytes = std::fs::read(SEQUENTIAL_RENAMED).unwrap();
    let mut net = Mixed::new(&mut Rng::seed_from_u64(0));
    let names = [
        ("conv1", "torso.conv"),
        ("conv1.norm", "torso.bn"),
        ("res.conv", "torso.block.conv"),
        ("fc", "head.fc"),
        ("out", "head.out"),
    ];
    conv_runtime::safetensors::import_pytorch_network(&bytes, &names, &mut net).unwrap();
    assert_matches_pytorch(&net);
}

#[test]
fn the_dense_after_flatten_is_permuted_from_chw() {
    let reader = Reader::open(SEQUENTIAL).unwrap();
    let (shape, pt) = reader.tensor_f64("7.weight").unwrap();
    assert_eq!(shape, [10, 96]);
    let mut net = Mixed::new(&mut Rng::seed_from_u64(0));
    reader.import_pytorch_network(&[], &mut net).unwrap();
    let mut ours = Vec::new();
    net.visit(&mut |name, v| {
        if name == "fc.weights" {
            ours = v.to_vec();
        }
    });
    // ours[o][(h, w, c)] = PyTorch's [o][(c, h, w)] over the 4x3x8 map.
    let (o, h, w, c) = (6, 3, 1, 5);
    assert_eq!(
        ours[o * 96 + (h * 3 + w) * 8 + c] as f64,
        pt[o * 96 + (c * 4 + h) * 3 + w]
    );
    // The second dense layer's inputs were never a map: as they are.
    let (_, pt) = reader.tensor_f64("9.weight").unwrap();
    net.visit(&mut |name, v| {
        if name == "out.weights" {
            assert_eq!(v.iter().map(|&x| x as f64).collect::<Vec<_>>(), pt);
        }
    });
}

#[test]
fn network_mismatches_are_reported_together_and_change_nothing() {
    let bytes = std::fs::read(SEQUENTIAL).unwrap();
    let mut net = MixedWide::new(&mut Rng::seed_from_u64(0));
    let before = all_values(&mut net);
    let err = conv_runtime::safetensors::import_pytorch_network(
        &bytes,
        &[("head", "7"), ("res.conv", "4.1")],
        &mut net,
    )
    .unwrap_err();
    for part in [
        "tensor `7.weight` has shape [10, 96], expected [12, 96]",
        "tensor `9.weight` has shape [3, 10], expected [3, 12]",
        "`head` in the module names is no entry",
    ] {
        assert!(err.reason.contains(part), "{part}: {err}");
    }
    assert_eq!(
        all_values(&mut net),
        before,
        "a failed import changed the network"
    );

    // Names shifted by one module: missing and unexpected tensors are both named.
    let mut net = Mixed::new(&mut Rng::seed_from_u64(0));
    let err = conv_runtime::safetensors::import_pytorch_network(&bytes, &[("fc", "8")], &mut net)
        .unwrap_err();
    assert!(err.reason.contains("missing tensor `8.weight`"), "{err}");
    assert!(
        err.reason
            .contains("unexpected tensor `7.weight`: no entry of the network takes it"),
        "{err}"
    );
}
