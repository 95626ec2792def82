//! Shared by the integration tests: a naive float64 reference of the conv2d layer, written from
//! the semantics in API.md and independently of the project, plus test data, conversions and
//! comparisons.

// Each test binary uses a different subset of this module.
#![allow(dead_code, unused_macros)]

#[macro_use]
mod spec_list;
#[macro_use]
mod spec_tests;
#[macro_use]
mod case_list;
#[macro_use]
pub mod conformance;
#[macro_use]
pub mod operations;
pub mod quadrants;

/// `[h, w]` from a spec size written `n` or `[h, w]`.
macro_rules! dims {
    ($n:literal) => {
        [$n, $n]
    };
    ([$h:literal, $w:literal]) => {
        [$h, $w]
    };
}

/// The value given for an optional spec key, else the default.
macro_rules! or_default {
    ($default:expr) => {
        $default
    };
    ($default:expr, $given:expr) => {
        $given
    };
}

use conv_runtime::prelude::{Cpu, Element, Mode};

/// The CPU device of the numeric suites: one thread, or `CONV2D_TEST_THREADS` threads that
/// split every call however small (scripts/test.sh runs the suites both ways).
pub fn cpu() -> Cpu {
    let threads = std::env::var("CONV2D_TEST_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    Cpu::with_threads(threads)
        .expect("CONV2D_TEST_THREADS")
        .__split_everything()
}
use serde_json::Value;

/// The shape constants of a generated layer type, in the order of [`Spec::constants`].
macro_rules! constants {
    ($layer:ty) => {
        [
            <$layer>::INPUT_HEIGHT,
            <$layer>::INPUT_WIDTH,
            <$layer>::INPUT_CHANNELS,
            <$layer>::OUTPUT_HEIGHT,
            <$layer>::OUTPUT_WIDTH,
            <$layer>::OUTPUT_CHANNELS,
            <$layer>::KERNEL_HEIGHT,
            <$layer>::KERNEL_WIDTH,
            <$layer>::STRIDE_HEIGHT,
            <$layer>::STRIDE_WIDTH,
            <$layer>::PADDING_HEIGHT,
            <$layer>::PADDING_WIDTH,
            <$layer>::BATCH_SIZE,
        ]
    };
}

/// The Rust type of a spec's `dtype` (none given: the default, f32).
macro_rules! dtype {
    () => {
        f32
    };
    (f64) => {
        f64
    };
    (f32) => {
        f32
    };
    (f16) => {
        half::f16
    };
    (bf16) => {
        half::bf16
    };
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    Identity,
    Relu,
    Gelu,
    Tanh,
    FastTanh,
    Sigmoid,
}

impl Activation {
    /// The snake_case names of the conformance cases.
    pub fn named(name: &str) -> Self {
        match name {
            "identity" => Self::Identity,
            "relu" => Self::Relu,
            "gelu" => Self::Gelu,
            "tanh" => Self::Tanh,
            "fast_tanh" => Self::FastTanh,
            "sigmoid" => Self::Sigmoid,
            _ => panic!("unknown activation {name:?}"),
        }
    }

    pub fn apply(self, x: f64) -> f64 {
        match self {
            Self::Identity => x,
            Self::Relu => x.max(0.0),
            Self::Gelu => 0.5 * x * (1.0 + gelu_tanh(x)),
            Self::Tanh => x.tanh(),
            Self::FastTanh => {
                let x = x.clamp(-3.0, 3.0);
                x * (27.0 + x * x) / (27.0 + 9.0 * x * x)
            }
            Self::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        }
    }

    /// The derivative at the pre-activation `x`; FastTanh's is taken as `1 - fast_tanh(x)^2`.
    pub fn derivative(self, x: f64) -> f64 {
        match self {
            Self::Identity => 1.0,
            Self::Relu => f64::from(x > 0.0),
            Self::Gelu => {
                let t = gelu_tanh(x);
                0.5 * (1.0 + t)
                    + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * GELU_CUBIC * x * x)
            }
            Self::Tanh | Self::FastTanh => 1.0 - self.apply(x).powi(2),
            Self::Sigmoid => {
                let s = self.apply(x);
                s * (1.0 - s)
            }
        }
    }
}

const GELU_SCALE: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_CUBIC: f64 = 0.044_715;

fn gelu_tanh(x: f64) -> f64 {
    (GELU_SCALE * (x + GELU_CUBIC * x * x * x)).tanh()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Norm {
    None,
    Batch { momentum: f64, eps: f64 },
    Layer { eps: f64 },
}

/// A layer spec with every default filled in; sizes are `[height, width]`, `input` is
/// `[height, width, channels]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spec {
    pub input: [usize; 3],
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub activation: Activation,
    pub norm: Norm,
    pub batch: usize,
}

impl Spec {
    /// `[OH, OW]` = `(in + 2 * padding - kernel) / stride + 1` per axis.
    pub fn output(&self) -> [usize; 2] {
        [0, 1].map(|a| (self.input[a] + 2 * self.padding[a] - self.kernel[a]) / self.stride[a] + 1)
    }

    /// What the layer's associated constants must be, in the order of `constants!`.
    pub fn constants(&self) -> [usize; 13] {
        let [ih, iw, ic] = self.input;
        let [oh, ow] = self.output();
        let ([kh, kw], [sh, sw], [ph, pw]) = (self.kernel, self.stride, self.padding);
        let oc = self.out_channels;
        [ih, iw, ic, oh, ow, oc, kh, kw, sh, sw, ph, pw, self.batch]
    }

    /// Calls `f(output, weight, input)` with the flat indices (NHWC, OHWI, NHWC) of every product
    /// of the convolution of a batch of `batch` samples; taps in the zero padding are skipped.
    fn for_each_tap(&self, batch: usize, mut f: impl FnMut(usize, usize, usize)) {
        let [ih, iw, ic] = self.input;
        let [oh, ow] = self.output();
        let [kh, kw] = self.kernel;
        for b in 0..batch {
            for y in 0..oh {
                for x in 0..ow {
                    for o in 0..self.out_channels {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * self.stride[0] + ky).checked_sub(self.padding[0]);
                                let ix = (x * self.stride[1] + kx).checked_sub(self.padding[1]);
                                let (Some(iy), Some(ix)) = (iy, ix) else {
                                    continue;
                                };
                                if iy >= ih || ix >= iw {
                                    continue;
                                }
                                for c in 0..ic {
                                    f(
                                        ((b * oh + y) * ow + x) * self.out_channels + o,
                                        ((o * kh + ky) * kw + kx) * ic + c,
                                        ((b * ih + iy) * iw + ix) * ic + c,
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    fn batch_of(&self, input: &[f64]) -> usize {
        let sample: usize = self.input.iter().product();
        assert_eq!(input.len() % sample, 0, "input length is not a whole batch");
        input.len() / sample
    }

    fn eps(&self) -> f64 {
        match self.norm {
            Norm::None => panic!("no norm"),
            Norm::Batch { eps, .. } | Norm::Layer { eps } => eps,
        }
    }

    /// The normalization group of the flat output index `i` (per channel for BatchNorm, per
    /// sample for LayerNorm) and the number of groups.
    fn group(&self, i: usize, outputs: usize, batch: usize) -> usize {
        match self.norm {
            Norm::Layer { .. } => i / (outputs / batch),
            _ => i % self.out_channels,
        }
    }

    fn groups(&self, batch: usize) -> usize {
        match self.norm {
            Norm::Layer { .. } => batch,
            _ => self.out_channels,
        }
    }

    /// Whether the norm uses statistics of the current batch (and so differentiates through them).
    fn batch_statistics(&self, train: bool) -> bool {
        match self.norm {
            Norm::None => false,
            Norm::Batch { .. } => train,
            Norm::Layer { .. } => true,
        }
    }
}

/// Layer parameters as f64; `gamma`, `beta` and the running statistics are empty when unused.
#[derive(Clone, Debug, Default)]
pub struct Params {
    pub weights: Vec<f64>,
    pub biases: Vec<f64>,
    pub gamma: Vec<f64>,
    pub beta: Vec<f64>,
    pub running_mean: Vec<f64>,
    pub running_var: Vec<f64>,
}

/// Everything the reference forward pass computes, flat NHWC where per pixel.
#[derive(Clone, Debug)]
pub struct Forward {
    /// Convolution plus bias.
    pub conv: Vec<f64>,
    /// After the norm: the activation's input.
    pub normalized: Vec<f64>,
    pub output: Vec<f64>,
    /// The statistics the norm used, per group.
    pub mean: Vec<f64>,
    pub var: Vec<f64>,
    /// BatchNorm's running statistics after this pass.
    pub running_mean: Vec<f64>,
    pub running_var: Vec<f64>,
}

#[derive(Clone, Debug)]
pub struct Gradients {
    pub d_input: Vec<f64>,
    pub d_weights: Vec<f64>,
    pub d_biases: Vec<f64>,
    pub d_gamma: Vec<f64>,
    pub d_beta: Vec<f64>,
}

/// Forward pass of any batch (taken from `input.len()`); `train` is `Mode::Train`.
/// `evaluate` equals the forward pass with `train == false`.
pub fn forward(spec: &Spec, params: &Params, input: &[f64], train: bool) -> Forward {
    let batch = spec.batch_of(input);
    let [oh, ow] = spec.output();
    let outputs = batch * oh * ow * spec.out_channels;
    let mut conv: Vec<f64> = (0..outputs)
        .map(|i| params.biases[i % spec.out_channels])
        .collect();
    spec.for_each_tap(batch, |o, w, x| conv[o] += params.weights[w] * input[x]);

    let (mut mean, mut var) = (vec![], vec![]);
    let (mut running_mean, mut running_var) =
        (params.running_mean.clone(), params.running_var.clone());
    if spec.batch_statistics(train) {
        let groups = spec.groups(batch);
        let mut count = vec![0.0; groups];
        mean = vec![0.0; groups];
        var = vec![0.0; groups];
        for (i, &v) in conv.iter().enumerate() {
            let g = spec.group(i, outputs, batch);
            count[g] += 1.0;
            mean[g] += v;
        }
        mean.iter_mut().zip(&count).for_each(|(m, n)| *m /= n);
        for (i, &v) in conv.iter().enumerate() {
            let g = spec.group(i, outputs, batch);
            var[g] += (v - mean[g]).powi(2) / count[g];
        }
        if let Norm::Batch { momentum, .. } = spec.norm {
            for c in 0..spec.out_channels {
                running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mean[c];
                running_var[c] = (1.0 - momentum) * running_var[c] + momentum * var[c];
            }
        }
    } else if let Norm::Batch { .. } = spec.norm {
        mean = params.running_mean.clone();
        var = params.running_var.clone();
    }

    let normalized: Vec<f64> = match spec.norm {
        Norm::None => conv.clone(),
        _ => (conv.iter().enumerate())
            .map(|(i, &v)| {
                let (g, c) = (spec.group(i, outputs, batch), i % spec.out_channels);
                params.gamma[c] * (v - mean[g]) / (var[g] + spec.eps()).sqrt() + params.beta[c]
            })
            .collect(),
    };
    let output = normalized
        .iter()
        .map(|&z| spec.activation.apply(z))
        .collect();
    Forward {
        conv,
        normalized,
        output,
        mean,
        var,
        running_mean,
        running_var,
    }
}

/// Backward pass of `forward` (same `train`), gradients from zero.
pub fn backward(
    spec: &Spec,
    params: &Params,
    input: &[f64],
    forward: &Forward,
    d_output: &[f64],
    train: bool,
) -> Gradients {
    let batch = spec.batch_of(input);
    let outputs = d_output.len();
    let oc = spec.out_channels;
    let d_normalized: Vec<f64> = (d_output.iter().zip(&forward.normalized))
        .map(|(&d, &z)| d * spec.activation.derivative(z))
        .collect();

    let (mut d_gamma, mut d_beta) = (vec![], vec![]);
    let d_conv = if spec.norm == Norm::None {
        d_normalized
    } else {
        d_gamma = vec![0.0; oc];
        d_beta = vec![0.0; oc];
        let groups = spec.groups(batch);
        let inv_std: Vec<f64> = forward
            .var
            .iter()
            .map(|v| 1.0 / (v + spec.eps()).sqrt())
            .collect();
        let (mut count, mut sum, mut sum_x_hat) =
            (vec![0.0; groups], vec![0.0; groups], vec![0.0; groups]);
        let mut x_hat = vec![0.0; outputs];
        let mut d_x_hat = vec![0.0; outputs];
        for i in 0..outputs {
            let (g, c) = (spec.group(i, outputs, batch), i % oc);
            x_hat[i] = (forward.conv[i] - forward.mean[g]) * inv_std[g];
            d_x_hat[i] = d_normalized[i] * params.gamma[c];
            d_gamma[c] += d_normalized[i] * x_hat[i];
            d_beta[c] += d_normalized[i];
            count[g] += 1.0;
            sum[g] += d_x_hat[i];
            sum_x_hat[g] += d_x_hat[i] * x_hat[i];
        }
        (0..outputs)
            .map(|i| {
                let g = spec.group(i, outputs, batch);
                if spec.batch_statistics(train) {
                    // Through the mean and variance too: the standard normalization backward.
                    inv_std[g] * (d_x_hat[i] - (sum[g] + x_hat[i] * sum_x_hat[g]) / count[g])
                } else {
                    inv_std[g] * d_x_hat[i]
                }
            })
            .collect()
    };

    let mut d_biases = vec![0.0; oc];
    for (i, d) in d_conv.iter().enumerate() {
        d_biases[i % oc] += d;
    }
    let mut d_weights = vec![0.0; params.weights.len()];
    let mut d_input = vec![0.0; input.len()];
    spec.for_each_tap(batch, |o, w, x| {
        d_weights[w] += d_conv[o] * input[x];
        d_input[x] += d_conv[o] * params.weights[w];
    });
    Gradients {
        d_input,
        d_weights,
        d_biases,
        d_gamma,
        d_beta,
    }
}

/// splitmix64: a tiny deterministic generator for test data.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    pub fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.next_f64()).collect()
    }
}

/// Max-pooling's hard input, NHWC with `image` values per image and `channels` channels: values
/// from {0, 1, 2} so that windows tie, a few NaN, and channel 4 of the second image all -inf.
pub fn pooling_edge_values(xs: &mut [f32], image: usize, channels: usize) {
    let mut rng = SplitMix64::new(11);
    for (i, v) in xs.iter_mut().enumerate() {
        let r = rng.next_u64() % 64;
        *v = if i / image == 1 && i % channels == 4 {
            f32::NEG_INFINITY
        } else if r < 3 {
            f32::NAN
        } else {
            (r % 3) as f32
        };
    }
}

/// max|got - expected| / max(1, max|expected|).
pub fn rel_err(got: &[f64], expected: &[f64]) -> f64 {
    assert_eq!(got.len(), expected.len(), "lengths differ");
    let diff = got
        .iter()
        .zip(expected)
        .map(|(g, e)| (g - e).abs())
        .fold(0.0, f64::max);
    let scale = expected.iter().map(|e| e.abs()).fold(1.0, f64::max);
    diff / scale
}

/// Panics, naming `what`, where `rel_err(got, expected) > tolerance` (or is NaN).
#[track_caller]
pub fn assert_close(what: &str, got: &[f64], expected: &[f64], tolerance: f64) {
    let err = rel_err(got, expected);
    assert!(
        err <= tolerance,
        "{what}: relative error {err:e} > {tolerance:e}"
    );
}

pub fn convert<T: Element>(values: &[f64]) -> Vec<T> {
    values.iter().map(|&v| T::from_f64(v)).collect()
}

pub fn to_f64<T: Element + Copy>(values: &[T]) -> Vec<f64> {
    values.iter().map(|&v| v.to_f64()).collect()
}

/// Relative tolerances per element type.
pub trait Tolerance: Element {
    /// Against the float64 conformance cases (their README).
    const CONFORMANCE: f64;
    /// Against the float64 reference on the same (converted) values.
    const REFERENCE: f64;
}

impl Tolerance for f64 {
    const CONFORMANCE: f64 = 1e-9;
    const REFERENCE: f64 = 1e-10;
}

impl Tolerance for f32 {
    const CONFORMANCE: f64 = 1e-4;
    const REFERENCE: f64 = 1e-4;
}

impl Tolerance for half::f16 {
    const CONFORMANCE: f64 = 3e-2;
    const REFERENCE: f64 = 3e-2;
}

impl Tolerance for half::bf16 {
    const CONFORMANCE: f64 = 3e-2;
    const REFERENCE: f64 = 3e-2;
}

/// A conformance case (format in tests/data/conformance/README.md).
pub struct Case(Value);

impl Case {
    pub fn parse(json: &str) -> Self {
        Self(serde_json::from_str(json).expect("case JSON"))
    }

    /// A top-level array; empty where the case has no such field.
    pub fn array(&self, key: &str) -> Vec<f64> {
        floats(&self.0[key])
    }

    pub fn expected(&self, key: &str) -> Vec<f64> {
        floats(&self.0["expected"][key])
    }

    pub fn train(&self) -> bool {
        match self.0["mode"].as_str() {
            Some("train") => true,
            Some("eval") => false,
            mode => panic!("unknown mode {mode:?}"),
        }
    }

    /// The spec's `dtype`, as `conv2d!` writes it.
    pub fn dtype(&self) -> &str {
        self.0["spec"]["dtype"].as_str().expect("dtype")
    }

    pub fn mode(&self) -> Mode {
        if self.train() {
            Mode::Train
        } else {
            Mode::Eval
        }
    }

    pub fn spec(&self) -> Spec {
        let spec = &self.0["spec"];
        let size = |v: &Value| v.as_u64().expect("size") as usize;
        let pair = |key: &str| [0, 1].map(|a| size(&spec[key][a]));
        let norm = &spec["norm"];
        let number = |key: &str| norm[key].as_f64().expect("norm parameter");
        Spec {
            input: [0, 1, 2].map(|a| size(&spec["input"][a])),
            out_channels: size(&spec["out_channels"]),
            kernel: pair("kernel"),
            stride: pair("stride"),
            padding: pair("padding"),
            activation: Activation::named(spec["activation"].as_str().expect("activation")),
            norm: match norm["kind"].as_str() {
                Some("none") => Norm::None,
                Some("batch_norm") => Norm::Batch {
                    momentum: number("momentum"),
                    eps: number("eps"),
                },
                Some("layer_norm") => Norm::Layer { eps: number("eps") },
                kind => panic!("unknown norm {kind:?}"),
            },
            batch: size(&spec["batch"]),
        }
    }

    pub fn params(&self) -> Params {
        Params {
            weights: self.array("weights"),
            biases: self.array("biases"),
            gamma: self.array("gamma"),
            beta: self.array("beta"),
            running_mean: self.array("running_mean"),
            running_var: self.array("running_var"),
        }
    }
}

fn floats(value: &Value) -> Vec<f64> {
    match value {
        Value::Null => vec![],
        _ => (value.as_array().expect("array").iter())
            .map(|v| v.as_f64().expect("number"))
            .collect(),
    }
}

/// A seed from a spec's name (FNV-1a; `line!()` would be the line of `for_each_spec!`), with
/// room to add small offsets.
pub const fn seed(name: &str) -> u64 {
    let (bytes, mut hash, mut i) = (name.as_bytes(), 0xcbf2_9ce4_8422_2325_u64, 0);
    while i < bytes.len() {
        hash = (hash ^ bytes[i] as u64).wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash >> 16
}
