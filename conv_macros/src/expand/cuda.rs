//! CUDA kernel source specialized to the spec, for the `Cuda` device to compile with NVRTC.
//!
//! The kernels are CUDA files in `conv_macros/kernels/`, embedded here with `include_str!`. A
//! layer's source is a generated block of constants (the spec's sizes, its activation, norm,
//! eps, momentum and element type, and the reduction chunking chosen below) followed by the
//! files its spec needs, each behind a `#line` so NVRTC's messages name the file and line. The
//! layer type gets, as `#[doc(hidden)]` constants (plain data, present with or without the
//! runtime's `cuda` feature):
//!
//! - `__CUDA_SOURCE: &str`: that source;
//! - `__CUDA_KERNELS: &[&str]`: the `extern "C"` kernels in it, all of which the host launches
//!   for some operation of this spec (and no others are defined);
//! - `__CUDA_DIRECT: bool`: whether the convolutions run in the direct kernels (see below) or
//!   in cuDNN;
//! - `__CUDA_SCRATCH: usize`: accumulator-type elements of the scratch buffer the two-phase
//!   gradient reductions (`*_partial` then `*_finish`) need.
//!
//! Every kernel takes `THREADS` (256, `kernels/common.cu`) threads per block and any number of
//! blocks; its comment in the `.cu` file gives its arguments and work items.
//!
//! # Direct kernels or cuDNN
//!
//! Decided at expansion time from the forward FLOPs at the spec's training batch,
//! `2 * BATCH * OH * OW * OC * KH * KW * IC` (the two gradients cost the same):
//!
//! - up to `2^24` (16.8 MFLOP): direct. A cuDNN call has a fixed cost of roughly 10 µs
//!   (argument checks and algorithm dispatch on the host, one to three kernel launches); the
//!   direct kernels, one thread per output value, sustain on the order of 1-2 TFLOP/s, so this
//!   much work takes them about as long as cuDNN's overhead alone.
//! - up to `2^27` when a GEMM dimension of the convolution is narrow, fewer than 16 output
//!   channels or a window (`KH * KW * IC`) under 32 values: direct. cuDNN's implicit-GEMM tiles
//!   are at least that wide, so most of their work is padding.
//! - above: cuDNN.
//!
//! The bounds are estimates to be tuned by the benchmark on a GPU; the rule is a unit-tested
//! function of the spec ([`direct`]).
//!
//! # Operations
//!
//! The host's recipe, buffers named as in the forward state; `y` is the convolution output in
//! the accumulator type (for f32 and f64 layers it can be the destination buffer itself), `dz`
//! the gradient at the convolution output in the accumulator type. The convolution is
//! `conv_forward` / `conv_backward_data` / `conv_backward_weights_partial` + `_finish` when
//! direct, else cuDNN: for half-precision layers in f32 on `widen`ed copies of the input and
//! weights, so the arithmetic is the CPU's (its f32 input gradient is `narrow`ed into
//! `d_input`, its weight gradient accumulates into the f32 gradients with beta = 1); with
//! `CUDNN_FMA_MATH` (TF32 would round the operands, a change of the math) and deterministic
//! algorithms.
//!
//! - `evaluate`: convolution into `y`; then no norm: `activation_evaluate`; BatchNorm:
//!   `bn_evaluate`; LayerNorm: `y` rounded into the output (`narrow` for half types),
//!   `ln_stats` into a per-sample scratch, `norm_affine` in place without pre-activation.
//! - `forward`: convolution into `y`; then no norm: `activation_forward`; with a norm: `y`
//!   rounded into `conv` (`narrow` for half types), then BatchNorm `bn_stats_train` (Train) or
//!   `bn_stats_eval` (Eval), or LayerNorm `ln_stats`, then `norm_affine`.
//! - `backward*`: `activation_backward` into `dz`; BatchNorm: `bn_backward_train` or
//!   `bn_backward_eval` (by the mode of the forward pass); LayerNorm: `ln_param_grads` (when
//!   the gradients are wanted) then `ln_backward`; then, for the gradients,
//!   `bias_grad_partial` + `bias_grad_finish` and the weight gradient, and for `d_input` the
//!   data gradient.

use proc_macro2::TokenStream;
use quote::quote;

use super::lit;
use crate::spec::{Dtype, Norm, Spec};

/// Forward FLOPs up to which the direct kernels run the convolutions.
const DIRECT_MAX_FLOPS: u64 = 1 << 24;
/// The same, for a spec with a narrow GEMM dimension.
const DIRECT_MAX_FLOPS_NARROW: u64 = 1 << 27;
/// Output channels below this make the GEMM narrow.
const NARROW_OUT_CHANNELS: usize = 16;
/// A window (`KH * KW * IC`) below this makes the GEMM narrow.
const NARROW_WINDOW: usize = 32;

/// Work items a first reduction phase aims for: several waves of a large GPU's threads.
const TARGET_ITEMS: usize = 1 << 16;
/// Rows each first-phase item sums at least, so the second phase stays small.
const MIN_CHUNK_ROWS: usize = 32;
/// Chunks at most (the second phase sums them in one block per output).
const MAX_CHUNKS: usize = 1024;

/// One kernel file: its name (for `#line`), its text, and the kernels it defines.
struct File {
    name: &'static str,
    text: &'static str,
    kernels: &'static [&'static str],
}

const COMMON: File = File {
    name: "conv_macros/kernels/common.cu",
    text: include_str!("../../kernels/common.cu"),
    kernels: &[],
};
const ACTIVATION: File = File {
    name: "conv_macros/kernels/activation.cu",
    text: include_str!("../../kernels/activation.cu"),
    kernels: &["activation_forward", "activation_evaluate"],
};
const NORMALIZE: File = File {
    name: "conv_macros/kernels/normalize.cu",
    text: include_str!("../../kernels/normalize.cu"),
    kernels: &["norm_affine"],
};
const BATCH_NORM: File = File {
    name: "conv_macros/kernels/batch_norm.cu",
    text: include_str!("../../kernels/batch_norm.cu"),
    kernels: &[
        "bn_stats_train",
        "bn_stats_eval",
        "bn_evaluate",
        "bn_backward_train",
        "bn_backward_eval",
    ],
};
const LAYER_NORM: File = File {
    name: "conv_macros/kernels/layer_norm.cu",
    text: include_str!("../../kernels/layer_norm.cu"),
    kernels: &["ln_stats", "ln_param_grads", "ln_backward"],
};
const BACKWARD: File = File {
    name: "conv_macros/kernels/backward.cu",
    text: include_str!("../../kernels/backward.cu"),
    kernels: &[
        "activation_backward",
        "bias_grad_partial",
        "bias_grad_finish",
    ],
};
const NARROW: File = File {
    name: "conv_macros/kernels/narrow.cu",
    text: include_str!("../../kernels/narrow.cu"),
    kernels: &["narrow"],
};
const WIDEN: File = File {
    name: "conv_macros/kernels/widen.cu",
    text: include_str!("../../kernels/widen.cu"),
    kernels: &["widen"],
};
const DIRECT: File = File {
    name: "conv_macros/kernels/direct.cu",
    text: include_str!("../../kernels/direct.cu"),
    kernels: &[
        "conv_forward",
        "conv_backward_data",
        "conv_backward_weights_partial",
        "conv_backward_weights_finish",
    ],
};

pub fn expand(spec: &Spec) -> TokenStream {
    let layer = &spec.ident;
    let plan = Plan::of(spec);
    let source = plan.source(spec);
    let kernels = plan.files.iter().flat_map(|f| f.kernels);
    let direct = plan.direct;
    let scratch = lit(plan.scratch(spec));
    quote! {
        #[allow(dead_code)]
        impl #layer {
            /// CUDA source of this layer's kernels (see `conv_macros::expand::cuda`).
            #[doc(hidden)]
            pub const __CUDA_SOURCE: &'static str = #source;
            /// The kernels `__CUDA_SOURCE` defines, all used by this layer's operations.
            #[doc(hidden)]
            pub const __CUDA_KERNELS: &'static [&'static str] = &[#(#kernels),*];
            /// Whether the convolutions run in the direct kernels (else in cuDNN).
            #[doc(hidden)]
            pub const __CUDA_DIRECT: bool = #direct;
            /// Accumulator-type elements of the gradient reductions' scratch buffer.
            #[doc(hidden)]
            pub const __CUDA_SCRATCH: usize = #scratch;
        }
    }
}

/// Forward FLOPs at the spec's training batch: two per multiply-add.
fn forward_flops(spec: &Spec) -> u64 {
    let macs = [
        spec.batch,
        spec.out_h(),
        spec.out_w(),
        spec.out_channels,
        spec.kernel[0],
        spec.kernel[1],
        spec.in_c(),
    ]
    .iter()
    .fold(1u64, |p, &n| p.saturating_mul(n as u64));
    macs.saturating_mul(2)
}

/// The rule of the module docs: whether the direct kernels run the convolutions.
fn direct(spec: &Spec) -> bool {
    let narrow = spec.out_channels < NARROW_OUT_CHANNELS || spec.fan_in() < NARROW_WINDOW;
    let bound = if narrow {
        DIRECT_MAX_FLOPS_NARROW
    } else {
        DIRECT_MAX_FLOPS
    };
    forward_flops(spec) <= bound
}

/// How a sum over `rows` rows, for each of `len` outputs, is cut into chunks: the first phase
/// has `count * len` work items, each summing `rows` (the last one fewer) rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunks {
    count: usize,
    rows: usize,
}

impl Chunks {
    fn new(rows: usize, len: usize) -> Self {
        let wanted = TARGET_ITEMS.div_ceil(len).clamp(1, MAX_CHUNKS);
        let chunk_rows = rows.div_ceil(wanted).max(MIN_CHUNK_ROWS);
        Self {
            count: rows.div_ceil(chunk_rows),
            rows: chunk_rows,
        }
    }
}

/// What one spec's CUDA side consists of.
struct Plan {
    direct: bool,
    files: Vec<File>,
    bias: Chunks,
    /// The weight gradient's chunking, for the direct kernels.
    weights: Option<Chunks>,
}

impl Plan {
    fn of(spec: &Spec) -> Self {
        let direct = direct(spec);
        let half = matches!(spec.dtype, Dtype::F16 | Dtype::Bf16);
        let rows = spec.batch * spec.out_h() * spec.out_w();
        let mut files = vec![COMMON];
        match spec.norm {
            Norm::None => files.push(ACTIVATION),
            Norm::BatchNorm { .. } => files.extend([NORMALIZE, BATCH_NORM]),
            Norm::LayerNorm { .. } => files.extend([NORMALIZE, LAYER_NORM]),
        }
        files.push(BACKWARD);
        if half && (spec.norm != Norm::None || !direct) {
            files.push(NARROW);
        }
        if half && !direct {
            files.push(WIDEN);
        }
        if direct {
            files.push(DIRECT);
        }
        Self {
            direct,
            files,
            bias: Chunks::new(rows, spec.out_channels),
            weights: direct.then(|| Chunks::new(rows, spec.out_channels * spec.fan_in())),
        }
    }

    fn scratch(&self, spec: &Spec) -> usize {
        let bias = self.bias.count * spec.out_channels;
        let weights = self
            .weights
            .map_or(0, |w| w.count * spec.out_channels * spec.fan_in());
        bias.max(weights)
    }

    /// The generated block, then the files.
    fn source(&self, spec: &Spec) -> String {
        let mut out = self.header(spec);
        for file in &self.files {
            out.push_str(&format!("#line 1 \"{}\"\n", file.name));
            out.push_str(file.text);
        }
        out
    }

    fn header(&self, spec: &Spec) -> String {
        let element = match spec.dtype {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
        };
        let (norm, eps, momentum) = match spec.norm {
            Norm::None => ("None", None, None),
            Norm::BatchNorm { momentum, eps } => ("BatchNorm", Some(eps), Some(momentum)),
            Norm::LayerNorm { eps } => ("LayerNorm", Some(eps), None),
        };
        let mut out = format!(
            "// conv2d! layer `{}`: its constants, generated; the kernels follow.\n\
             #define CONV_ELEMENT_{element}\n\
             #define CONV_ACTIVATION {}\n\
             #define CONV_NORM {norm}\n",
            spec.ident,
            spec.activation.name(),
        );
        let sizes = [
            ("BATCH", spec.batch),
            ("IH", spec.in_h()),
            ("IW", spec.in_w()),
            ("IC", spec.in_c()),
            ("OH", spec.out_h()),
            ("OW", spec.out_w()),
            ("OC", spec.out_channels),
            ("KH", spec.kernel[0]),
            ("KW", spec.kernel[1]),
            ("SH", spec.stride[0]),
            ("SW", spec.stride[1]),
            ("PH", spec.padding[0]),
            ("PW", spec.padding[1]),
        ];
        // Only the direct kernels read some of the sizes (IH, IW, SH, SW).
        for (name, value) in sizes {
            out.push_str(&format!(
                "[[maybe_unused]] constexpr int {name} = {value};\n"
            ));
        }
        let chunks = [
            ("BIAS_CHUNKS", self.bias.count),
            ("BIAS_CHUNK_ROWS", self.bias.rows),
        ];
        let weights = self
            .weights
            .iter()
            .flat_map(|w| [("WEIGHT_CHUNKS", w.count), ("WEIGHT_CHUNK_ROWS", w.rows)]);
        for (name, value) in chunks.into_iter().chain(weights) {
            out.push_str(&format!("constexpr int {name} = {value};\n"));
        }
        // `{:?}` is the shortest decimal that reads back as the same f64, a valid C++ literal.
        for (name, value) in [("EPS", eps), ("MOMENTUM", momentum)] {
            if let Some(value) = value {
                out.push_str(&format!("constexpr double {name} = {value:?};\n"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Activation, Init};

    fn spec(input: [usize; 3], oc: usize, kernel: usize, stride: usize, batch: usize) -> Spec {
        Spec {
            attrs: Vec::new(),
            vis: syn::Visibility::Inherited,
            ident: syn::Ident::new("Layer", proc_macro2::Span::call_site()),
            input,
            out_channels: oc,
            kernel: [kernel, kernel],
            stride: [stride, stride],
            padding: [0, 0],
            activation: Activation::Relu,
            norm: Norm::None,
            batch,
            dtype: Dtype::F32,
            init: Init::KaimingUniform {
                legacy: true,
                scale: 1.0,
            },
        }
    }

    #[test]
    fn direct_for_small_work_and_narrow_channels() {
        // The Nature DQN trunk: 3.3 MFLOP at batch 1 is direct; at batch 32, 105 MFLOP with
        // 16 output channels and a 256-value window is cuDNN's.
        let conv1 = |batch| spec([84, 84, 4], 16, 8, 4, batch);
        assert_eq!(forward_flops(&conv1(1)), 2 * 20 * 20 * 16 * 8 * 8 * 4);
        assert!(direct(&conv1(1)));
        assert!(direct(&conv1(4)));
        assert!(!direct(&conv1(32)));
        // Right at the bound: 2 * 2^23 FLOPs.
        let at_bound = spec([1, 1, 1 << 15], 256, 1, 1, 1);
        assert_eq!(forward_flops(&at_bound), DIRECT_MAX_FLOPS);
        assert!(direct(&at_bound));
        let over = spec([1, 1, 1 << 15], 256, 1, 1, 2);
        assert!(!direct(&over));
        // A one-channel value head of 35 MFLOP: narrow, direct.
        let head = spec([64, 64, 64], 1, 3, 1, 8);
        assert!(forward_flops(&head) > DIRECT_MAX_FLOPS);
        assert!(direct(&head));
        // A three-channel 3x3 stem (window 27): narrow up to 2^27.
        assert!(direct(&spec([32, 32, 3], 64, 3, 1, 16)));
        assert!(!direct(&spec([224, 224, 3], 64, 3, 1, 16)));
        // A ResNet block: cuDNN.
        assert!(!direct(&spec([56, 56, 64], 64, 3, 1, 8)));
    }

    #[test]
    fn flops_saturate_instead_of_overflowing() {
        let huge = spec([1 << 20, 1 << 20, 1 << 10], 1 << 10, 1, 1, 1 << 10);
        assert_eq!(forward_flops(&huge), u64::MAX);
        assert!(!direct(&huge));
    }

    #[test]
    fn chunks_cover_the_rows_exactly() {
        for (rows, len) in [
            (1, 1),
            (31, 16),
            (32, 16),
            (400, 16),
            (12800, 16),
            (200_704, 64),
        ] {
            let c = Chunks::new(rows, len);
            assert!(c.count >= 1 && c.count <= MAX_CHUNKS, "{rows} {len}: {c:?}");
            assert!(c.rows >= MIN_CHUNK_ROWS);
            // Every row in exactly one chunk, none empty.
            assert!((c.count - 1) * c.rows < rows && c.count * c.rows >= rows);
        }
        // Small sums take one chunk; large ones fill the GPU.
        assert_eq!(Chunks::new(20, 16), Chunks { count: 1, rows: 32 });
        assert_eq!(
            Chunks::new(12800, 16),
            Chunks {
                count: 400,
                rows: 32
            }
        );
        assert_eq!(
            Chunks::new(200_704, 64),
            Chunks {
                count: 1024,
                rows: 196
            }
        );
        // Many outputs (a weight gradient): few chunks.
        assert_eq!(
            Chunks::new(12800, 16 * 256),
            Chunks {
                count: 16,
                rows: 800
            }
        );
    }

    #[test]
    fn kernels_follow_the_spec() {
        let names = |s: &Spec| -> Vec<&str> {
            Plan::of(s)
                .files
                .iter()
                .flat_map(|f| f.kernels.iter().copied())
                .collect()
        };
        let small = spec([8, 8, 3], 4, 3, 1, 2);
        assert_eq!(
            names(&small),
            [
                "activation_forward",
                "activation_evaluate",
                "activation_backward",
                "bias_grad_partial",
                "bias_grad_finish",
                "conv_forward",
                "conv_backward_data",
                "conv_backward_weights_partial",
                "conv_backward_weights_finish",
            ]
        );
        let mut half_bn_cudnn = spec([56, 56, 64], 64, 3, 1, 8);
        half_bn_cudnn.dtype = Dtype::Bf16;
        half_bn_cudnn.norm = Norm::BatchNorm {
            momentum: 0.1,
            eps: 1e-5,
        };
        let k = names(&half_bn_cudnn);
        assert!(k.contains(&"bn_stats_train") && k.contains(&"norm_affine"));
        assert!(k.contains(&"narrow") && k.contains(&"widen"));
        assert!(!k.contains(&"conv_forward") && !k.contains(&"activation_forward"));
        let mut ln = spec([8, 8, 3], 4, 3, 1, 2);
        ln.norm = Norm::LayerNorm { eps: 1e-5 };
        let k = names(&ln);
        assert!(k.contains(&"ln_stats") && k.contains(&"ln_backward"));
        assert!(!k.contains(&"narrow") && !k.contains(&"bn_stats_train"));
    }

    #[test]
    fn header_carries_the_spec() {
        let mut s = spec([9, 7, 6], 13, 3, 2, 5);
        s.padding = [1, 2];
        s.dtype = Dtype::F16;
        s.activation = Activation::FastTanh;
        s.norm = Norm::BatchNorm {
            momentum: 0.1,
            eps: 1e-5,
        };
        let plan = Plan::of(&s);
        let source = plan.source(&s);
        for line in [
            "#define CONV_ELEMENT_F16\n",
            "#define CONV_ACTIVATION FastTanh\n",
            "#define CONV_NORM BatchNorm\n",
            "[[maybe_unused]] constexpr int BATCH = 5;\n",
            "[[maybe_unused]] constexpr int IH = 9;\n",
            "[[maybe_unused]] constexpr int OH = 5;\n",
            "[[maybe_unused]] constexpr int OW = 5;\n",
            "[[maybe_unused]] constexpr int PW = 2;\n",
            "constexpr double EPS = 1e-5;\n",
            "constexpr double MOMENTUM = 0.1;\n",
            "#line 1 \"conv_macros/kernels/common.cu\"\n",
            "#line 1 \"conv_macros/kernels/batch_norm.cu\"\n",
        ] {
            assert!(source.contains(line), "missing {line:?}");
        }
        assert!(plan.scratch(&s) >= plan.bias.count * 13);
    }
}
