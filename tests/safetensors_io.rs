//! Saving and loading parameters as safetensors (`conv_runtime::safetensors`): exact round
//! trips for every element type, the file's names, shapes and dtypes as another reader sees
//! them, every kind of mismatch reported as an error that names it, and the `train_digits`
//! example's trained network reloaded into a fresh one computing the same outputs.

use conv_runtime::prelude::*;
use conv_runtime::safetensors::{Reader, Writer};

/// The example itself, so that the test exercises its model, training and save/load code.
#[allow(dead_code)]
#[path = "../examples/train_digits.rs"]
mod train_digits;

conv_runtime::conv2d! {
    pub struct BnF32 {
        input: [6, 5, 3], out_channels: 4, kernel: [3, 2], padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2,
    }
}
conv_runtime::conv2d! {
    pub struct BnF64 {
        input: [6, 5, 3], out_channels: 4, kernel: [3, 2], padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2, dtype: f64,
    }
}
conv_runtime::conv2d! {
    pub struct BnF16 {
        input: [6, 5, 3], out_channels: 4, kernel: [3, 2], padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2, dtype: f16,
    }
}
conv_runtime::conv2d! {
    pub struct BnBf16 {
        input: [6, 5, 3], out_channels: 4, kernel: [3, 2], padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2, dtype: bf16,
    }
}
conv_runtime::conv2d! {
    pub struct LnF32 {
        input: [6, 5, 3], out_channels: 4, kernel: [3, 2], padding: 1, norm: LayerNorm { eps: 1e-5 },
    }
}
conv_runtime::conv2d! {
    /// BnF32 without a norm.
    pub struct PlainF32 { input: [6, 5, 3], out_channels: 4, kernel: [3, 2], padding: 1, activation: Relu }
}
conv_runtime::conv2d! {
    /// BnF32 with 5 output channels.
    pub struct Wider {
        input: [6, 5, 3], out_channels: 5, kernel: [3, 2], padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 },
    }
}

/// The header of a safetensors file, parsed with serde_json (not the crate's reader).
fn header(bytes: &[u8]) -> serde_json::Value {
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + len]).unwrap()
}

fn dtype_and_shape(header: &serde_json::Value, name: &str) -> (String, Vec<u64>) {
    let entry = &header[name];
    assert!(entry.is_object(), "no tensor `{name}` in {header}");
    let shape = entry["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap())
        .collect();
    (entry["dtype"].as_str().unwrap().to_string(), shape)
}

/// Sets every parameter and running statistic of a layer to distinct non-default values.
fn scramble<P: Parameters>(layer: &mut P, seed: u64) {
    let mut rng = Rng::seed_from_u64(seed);
    layer.visit_params_mut(&mut |_, t| {
        for v in t.values_mut() {
            *v = P::Elem::from_f64(rng.uniform(-1.0, 1.0));
        }
    });
    layer.visit_buffers_mut(&mut |_, t| {
        for v in t.values_mut() {
            *v = Element::from_f64(rng.uniform(0.1, 2.0));
        }
    });
}

/// Save, check the header, load into a differently initialized layer: bit-identical
/// parameters and evaluate outputs.
macro_rules! round_trip {
    ($name:ident, $layer:ident, $t:ty, $dtype:literal, $acc:literal) => {
        #[test]
        fn $name() {
            let mut layer = $layer::new(&mut Rng::seed_from_u64(1));
            scramble(&mut layer, 2);
            let bytes = Writer::new()
                .add("block.conv", &mut layer)
                .unwrap()
                .to_bytes()
                .unwrap();

            let h = header(&bytes);
            assert_eq!(
                dtype_and_shape(&h, "block.conv.weights"),
                ($dtype.to_string(), vec![4, 3, 2, 3]),
                "weights are OHWI [OC, KH, KW, IC]"
            );
            assert_eq!(
                dtype_and_shape(&h, "block.conv.biases"),
                ($dtype.to_string(), vec![4])
            );
            assert_eq!(
                dtype_and_shape(&h, "block.conv.gamma"),
                ($dtype.to_string(), vec![4])
            );
            assert_eq!(
                dtype_and_shape(&h, "block.conv.beta"),
                ($dtype.to_string(), vec![4])
            );
            assert_eq!(
                dtype_and_shape(&h, "block.conv.running_mean"),
                ($acc.to_string(), vec![4]),
                "running statistics are in the accumulator type"
            );
            assert_eq!(
                dtype_and_shape(&h, "block.conv.running_var"),
                ($acc.to_string(), vec![4])
            );

            let mut loaded = $layer::new(&mut Rng::seed_from_u64(3));
            assert!(loaded.abs_diff(&layer) > 0.0);
            Reader::from_bytes(bytes)
                .unwrap()
                .load("block.conv", &mut loaded)
                .unwrap();
            assert_eq!(loaded.abs_diff(&layer), 0.0);
            assert_eq!(loaded.running_var.as_slice(), layer.running_var.as_slice());

            let x = Tensor::<$t, 3, 6, 5, 3>::from_fn(|i| {
                <$t>::from_f64(((i * 7) % 11) as f64 / 5.0 - 1.0)
            });
            let (mut y1, mut y2) = (
                Tensor::<$t, 3, 6, 6, 4>::zeros(),
                Tensor::<$t, 3, 6, 6, 4>::zeros(),
            );
            let mut cpu = Cpu::default();
            layer.evaluate(&mut cpu, &x, &mut y1).unwrap();
            loaded.evaluate(&mut cpu, &x, &mut y2).unwrap();
            assert_eq!(y1, y2);
        }
    };
}

round_trip!(round_trip_f64, BnF64, f64, "F64", "F64");
round_trip!(round_trip_f32, BnF32, f32, "F32", "F32");
round_trip!(round_trip_f16, BnF16, f16, "F16", "F32");
round_trip!(round_trip_bf16, BnBf16, bf16, "BF16", "F32");

#[test]
fn layer_norm_and_files_with_several_layers() {
    let mut rng = Rng::seed_from_u64(4);
    let (mut ln, mut bn) = (LnF32::new(&mut rng), BnF32::new(&mut rng));
    scramble(&mut ln, 5);
    scramble(&mut bn, 6);
    let path = std::env::temp_dir().join(format!("conv2d_io_{}.safetensors", std::process::id()));
    Writer::new()
        .add("ln", &mut ln)
        .unwrap()
        .add("bn", &mut bn)
        .unwrap()
        .write_file(&path)
        .unwrap();
    let file = Reader::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        file.names().unwrap(),
        [
            "bn.beta",
            "bn.biases",
            "bn.gamma",
            "bn.running_mean",
            "bn.running_var",
            "bn.weights",
            "ln.beta",
            "ln.biases",
            "ln.gamma",
            "ln.weights"
        ]
    );
    let (mut ln2, mut bn2) = (LnF32::new(&mut rng), BnF32::new(&mut rng));
    file.load("ln", &mut ln2).unwrap();
    file.load("bn", &mut bn2).unwrap();
    assert_eq!(ln2.abs_diff(&ln), 0.0);
    assert_eq!(bn2.abs_diff(&bn), 0.0);
}

fn saved<P: Parameters>(prefix: &str, layer: &mut P) -> Reader {
    Reader::from_bytes(
        Writer::new()
            .add(prefix, layer)
            .unwrap()
            .to_bytes()
            .unwrap(),
    )
    .unwrap()
}

#[test]
fn missing_tensors_are_named_and_the_layer_is_unchanged() {
    let file = saved("conv", &mut PlainF32::new(&mut Rng::seed_from_u64(0)));
    let mut layer = BnF32::new(&mut Rng::seed_from_u64(1));
    let before = layer.clone();
    let err = file.load("conv", &mut layer).unwrap_err();
    for name in ["gamma", "beta", "running_mean", "running_var"] {
        assert!(
            err.reason
                .contains(&format!("missing tensor `conv.{name}`")),
            "{err}"
        );
    }
    assert!(err.operation.contains("loading `conv`"), "{err}");
    assert_eq!(
        layer.abs_diff(&before),
        0.0,
        "a failed load changed the layer"
    );

    let err = file.load("other", &mut layer).unwrap_err();
    assert!(
        err.reason.contains("missing tensor `other.weights`"),
        "{err}"
    );
}

#[test]
fn unexpected_tensors_are_reported() {
    let file = saved("conv", &mut BnF32::new(&mut Rng::seed_from_u64(0)));
    let err = file
        .load("conv", &mut PlainF32::new(&mut Rng::seed_from_u64(1)))
        .unwrap_err();
    assert!(
        err.reason
            .contains("unexpected tensor `conv.running_mean`: the layer has no such parameter")
            && err.reason.contains("unexpected tensor `conv.gamma`"),
        "{err}"
    );
}

#[test]
fn shape_mismatches_give_got_and_expected() {
    let file = saved("conv", &mut BnF32::new(&mut Rng::seed_from_u64(0)));
    let err = file
        .load("conv", &mut Wider::new(&mut Rng::seed_from_u64(1)))
        .unwrap_err();
    assert!(
        err.reason
            .contains("tensor `conv.weights` has shape [4, 3, 2, 3], expected [5, 3, 2, 3]"),
        "{err}"
    );
    assert!(
        err.reason
            .contains("tensor `conv.running_var` has shape [4], expected [5]"),
        "{err}"
    );
}

#[test]
fn dtype_mismatches_are_reported() {
    let file = saved("conv", &mut BnF16::new(&mut Rng::seed_from_u64(0)));
    let err = file
        .load("conv", &mut BnF32::new(&mut Rng::seed_from_u64(1)))
        .unwrap_err();
    assert!(
        err.reason
            .contains("tensor `conv.weights` has dtype F16, expected F32"),
        "{err}"
    );
    // The running statistics of f16 and f32 layers are both f32: no complaint there.
    assert!(!err.reason.contains("running_mean"), "{err}");

    let err = file
        .load("conv", &mut BnF64::new(&mut Rng::seed_from_u64(1)))
        .unwrap_err();
    assert!(
        err.reason
            .contains("tensor `conv.running_mean` has dtype F32, expected F64"),
        "{err}"
    );
}

#[test]
fn bad_files_and_names() {
    let err = Reader::from_bytes(b"not safetensors at all".to_vec())
        .err()
        .unwrap();
    assert!(err.reason.contains("not a valid safetensors file"), "{err}");

    let err = Reader::open("/nonexistent/model.safetensors")
        .err()
        .unwrap();
    assert!(
        err.operation.contains("/nonexistent/model.safetensors"),
        "{err}"
    );

    let mut layer = BnF32::new(&mut Rng::seed_from_u64(0));
    let mut writer = Writer::new();
    writer.add("conv", &mut layer).unwrap();
    let err = writer.add("conv", &mut layer).err().unwrap();
    assert!(
        err.reason.contains("`conv.weights` was already added"),
        "{err}"
    );

    let io = saved("conv", &mut layer);
    let err = io.tensor_f64("conv.nothing").unwrap_err();
    assert!(
        err.reason.contains("missing tensor `conv.nothing`"),
        "{err}"
    );
}

#[test]
fn saving_does_not_touch_the_layer() {
    // `add` takes `&mut` for the visitors only: the content stamps (which the CPU's packed
    // weight cache keys on) stay as they were.
    let mut layer = BnF32::new(&mut Rng::seed_from_u64(0));
    let stamp = layer.weights.stamp();
    Writer::new().add("conv", &mut layer).unwrap();
    assert_eq!(layer.weights.stamp(), stamp);
}

#[test]
fn train_digits_model_reloads_with_identical_outputs() {
    use train_digits::*;
    let all = load_digits(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/data/digits.csv.gz"
    )))
    .unwrap();
    let (train_set, test_set) = split(&all);
    let config = Config {
        epochs: 1,
        seed: 3,
        progress: false,
    };
    let mut cpu = Cpu::default();
    let mut trained = train(&mut cpu, &train_set, &test_set, &config).unwrap();
    // One epoch is enough to learn something, and to move BatchNorm's running statistics.
    assert!(
        trained.history[0].test_accuracy > 0.5,
        "{:?}",
        trained.history
    );
    assert!(trained
        .model
        .net
        .conv2
        .running_var
        .as_slice()
        .iter()
        .any(|&v| v != 1.0));

    let path =
        std::env::temp_dir().join(format!("train_digits_{}.safetensors", std::process::id()));
    trained.model.save(&path).unwrap();
    let mut reloaded = Model::new(&mut Rng::seed_from_u64(99));
    let fresh = reloaded.test_logits(&mut cpu, &test_set).unwrap();
    let result = reloaded.load(&path);
    std::fs::remove_file(&path).unwrap();
    result.unwrap();

    let expected = trained.model.test_logits(&mut cpu, &test_set).unwrap();
    let got = reloaded.test_logits(&mut cpu, &test_set).unwrap();
    assert_ne!(
        fresh, expected,
        "the fresh network already computed the trained outputs"
    );
    let bits = |v: &[[f32; 10]]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&expected));
}
