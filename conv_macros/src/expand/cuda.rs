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
//! Layers without a norm on the direct kernels run each forward operation as one kernel with
//! the activation inside (`conv_evaluate`, `conv_forward_activation`): at the sizes the direct
//! kernels serve, a launch and a round trip through memory cost as much as the arithmetic.
//!
//! - `evaluate`: cuDNN layers without a norm whose activation is ReLU run cuDNN's fused
//!   convolution + bias + ReLU into the output (f32; half types on widened copies, then
//!   `narrow`), see [`fused`]. Otherwise convolution into `y`; then no norm:
//!   `activation_evaluate`; BatchNorm: `bn_evaluate`; LayerNorm: `y` rounded into the output
//!   (`narrow` for half types), `ln_stats` into a per-sample scratch, `norm_affine` in place
//!   without pre-activation.
//! - `forward`: convolution into `y`; then no norm: `activation_forward`; with a norm: `y`
//!   rounded into `conv` (`narrow` for half types), then BatchNorm `bn_stats_train` (Train) or
//!   `bn_stats_eval` (Eval), or LayerNorm `ln_stats`, then `norm_affine`.
//! - `backward*`: `activation_backward` into `dz`; BatchNorm: `bn_backward_train` or
//!   `bn_backward_eval` (by the mode of the forward pass); LayerNorm: `ln_param_grads` (when
//!   the gradients are wanted) then `ln_backward`; then, for the gradients,
//!   `bias_grad_partial` + `bias_grad_finish` and the weight gradient, and for `d_input` the
//!   data gradient.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::types::{device_impl, params};
use super::{acc, elem, lit, rt, usize_consts, Names};
use crate::spec::{Activation, Dtype, Norm, Spec};

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
    kernels: &[],
};
const DIRECT_FORWARD: File = File {
    name: "conv_macros/kernels/direct_forward.cu",
    text: include_str!("../../kernels/direct_forward.cu"),
    kernels: &["conv_forward"],
};
const DIRECT_FUSED: File = File {
    name: "conv_macros/kernels/direct_fused.cu",
    text: include_str!("../../kernels/direct_fused.cu"),
    kernels: &["conv_evaluate", "conv_forward_activation"],
};
const DIRECT_BACKWARD: File = File {
    name: "conv_macros/kernels/direct_backward.cu",
    text: include_str!("../../kernels/direct_backward.cu"),
    kernels: &[
        "conv_backward_data",
        "conv_backward_weights_partial",
        "conv_backward_weights_finish",
    ],
};

const NETWORK: File = File {
    name: "conv_macros/kernels/network.cu",
    text: include_str!("../../kernels/network.cu"),
    kernels: &[],
};

/// The element type as the kernels' `CONV_ELEMENT_*` macro names it.
pub(crate) fn element_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F64 => "F64",
        Dtype::F32 => "F32",
        Dtype::F16 => "F16",
        Dtype::Bf16 => "BF16",
    }
}

/// The source of a `network!` entry's kernels (pooling, activation, residual sum): its
/// generated `header` (constants as a layer's, and the `NETWORK_*` kind), then the shared
/// definitions and `kernels/network.cu`.
pub(crate) fn entry_source(header: String) -> String {
    let mut out = header;
    for file in [COMMON, NETWORK] {
        out.push_str(&format!("#line 1 \"{}\"\n", file.name));
        out.push_str(file.text);
    }
    out
}

pub fn expand(spec: &Spec) -> TokenStream {
    let layer = &spec.ident;
    let plan = Plan::of(spec);
    let source = plan.source(spec);
    let kernels = plan.files.iter().flat_map(|f| f.kernels);
    let (direct, fused) = (plan.direct, plan.fused);
    let scratch = lit(plan.scratch(spec));
    let device = device(spec, &plan);
    quote! {
        #device
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
            /// Whether inference runs cuDNN's fused convolution + bias + ReLU.
            #[doc(hidden)]
            pub const __CUDA_FUSED: bool = #fused;
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

/// Whether inference runs in one cuDNN call, convolution + bias + ReLU
/// (`cudnnConvolutionBiasActivationForward`, rl_tools' fused path): cuDNN layers without a norm
/// whose activation is ReLU, in f32 (on widened copies for the half types). cuDNN's other fused
/// activations are not ours (clipped ReLU, ELU) or need a particular algorithm (identity); f64
/// keeps the separate calls, whose double support is certain.
fn fused(spec: &Spec, direct: bool) -> bool {
    !direct
        && spec.norm == Norm::None
        && spec.activation == Activation::Relu
        && spec.dtype != Dtype::F64
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
    /// Whether inference runs cuDNN's fused convolution + bias + ReLU.
    fused: bool,
    files: Vec<File>,
    bias: Chunks,
    /// The weight gradient's chunking, for the direct kernels.
    weights: Option<Chunks>,
}

impl Plan {
    fn of(spec: &Spec) -> Self {
        let direct = direct(spec);
        let half = spec.dtype.is_half();
        let rows = spec.batch * spec.out_h() * spec.out_w();
        let norm = spec.norm != Norm::None;
        let mut files = vec![COMMON];
        match spec.norm {
            // The direct kernels apply the activation themselves.
            Norm::None if direct => {}
            Norm::None => files.push(ACTIVATION),
            Norm::BatchNorm { .. } => files.extend([NORMALIZE, BATCH_NORM]),
            Norm::LayerNorm { .. } => files.extend([NORMALIZE, LAYER_NORM]),
        }
        files.push(BACKWARD);
        if half && (norm || !direct) {
            files.push(NARROW);
        }
        if half && !direct {
            files.push(WIDEN);
        }
        if direct {
            files.push(DIRECT);
            files.push(if norm { DIRECT_FORWARD } else { DIRECT_FUSED });
            files.push(DIRECT_BACKWARD);
        }
        Self {
            direct,
            fused: fused(spec, direct),
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
        let element = element_name(spec.dtype);
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
        // Only the direct kernels read some of the sizes (IH, IW, SH, SW).
        for (name, value) in spec.sizes() {
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

/// The device-resident types (`LayerCuda`, `LayerCudaGrads`, `LayerCudaState`) with their
/// operations (the recipe of the module docs on GPU buffers), and the `Cuda` device's
/// implementation of the layer's operations on host tensors (upload, the same operations,
/// download). Emitted inside `conv_runtime::__private::if_cuda!`, so that it exists exactly when
/// the runtime was built with the `cuda` feature. The spec's choices (direct or cuDNN, norm, half
/// precision, the fused cuDNN call) are made here; the generated code has no branch on them.
fn device(spec: &Spec, plan: &Plan) -> TokenStream {
    let rt = rt();
    let Names {
        layer,
        grads,
        state,
        ..
    } = Names::of(spec);
    let vis = &spec.vis;
    let cuda_layer = format_ident!("{}Cuda", layer);
    let cuda_grads = format_ident!("{}CudaGrads", layer);
    let cuda_state = format_ident!("{}CudaState", layer);
    let t = elem(spec.dtype);
    let a = acc(spec.dtype);
    let half = spec.dtype.is_half();
    let direct = plan.direct;
    let batch_norm = matches!(spec.norm, Norm::BatchNorm { .. });
    let derived = [
        ("NPIX", spec.out_h() * spec.out_w()),
        ("WINDOW", spec.fan_in()),
        ("SCRATCH", plan.scratch(spec)),
        ("BIAS_ITEMS", plan.bias.count * spec.out_channels),
        (
            "WEIGHT_ITEMS",
            plan.weights
                .map_or(0, |w| w.count * spec.out_channels * spec.fan_in()),
        ),
    ];
    let consts: Vec<_> = spec.sizes().into_iter().chain(derived).collect();
    let consts = usize_consts(&consts);
    let geometry = if direct {
        quote!(::core::option::Option::None)
    } else {
        let double = spec.dtype == Dtype::F64;
        let (ph, pw) = (lit(spec.padding[0]), lit(spec.padding[1]));
        let (sh, sw) = (lit(spec.stride[0]), lit(spec.stride[1]));
        let (kh, kw) = (lit(spec.kernel[0]), lit(spec.kernel[1]));
        quote! {
            ::core::option::Option::Some(#rt::cuda::ConvGeometry {
                in_h: __IH, in_w: __IW, in_c: __IC, out_h: __OH, out_w: __OW, out_c: __OC,
                kernel: [#kh, #kw], stride: [#sh, #sw], padding: [#ph, #pw], double: #double,
            })
        }
    };
    let ok = quote!(::core::result::Result::Ok);
    let some = quote!(::core::option::Option::Some);
    let none = quote!(::core::option::Option::None);
    let result = quote!(#rt::Result<()>);

    // The types' fields, in literal sizes.
    let (oc, batch) = (lit(spec.out_channels), lit(spec.batch));
    let (ih, iw, ic) = (lit(spec.in_h()), lit(spec.in_w()), lit(spec.in_c()));
    let (oh, ow) = (lit(spec.out_h()), lit(spec.out_w()));
    let tensor = |elem: &TokenStream, shape: &TokenStream, vector: bool| {
        if vector {
            quote!(#rt::cuda::CudaVector<#elem, #shape>)
        } else {
            quote!(#rt::cuda::CudaTensor<#elem, #shape>)
        }
    };
    let params = params(spec);
    let names: Vec<_> = params.iter().map(|p| &p.name).collect();
    let param_tys: Vec<_> = params
        .iter()
        .map(|p| tensor(&t, &p.shape, p.name != "weights"))
        .collect();
    let grad_tys: Vec<_> = params
        .iter()
        .map(|p| tensor(&a, &p.shape, p.name != "weights"))
        .collect();
    let running: Vec<syn::Ident> = if batch_norm {
        vec![format_ident!("running_mean"), format_ident!("running_var")]
    } else {
        Vec::new()
    };
    let running_fields = batch_norm.then(|| {
        quote! {
            /// Running mean per channel (BatchNorm), in the accumulator type.
            pub running_mean: #rt::cuda::CudaVector<#a, #oc>,
            /// Running biased variance per channel (BatchNorm), in the accumulator type.
            pub running_var: #rt::cuda::CudaVector<#a, #oc>,
        }
    });
    let stats_len = match spec.norm {
        Norm::None => None,
        Norm::BatchNorm { .. } => Some(oc.clone()),
        Norm::LayerNorm { .. } => Some(batch.clone()),
    };
    let y_ty = quote!(#rt::cuda::CudaTensor<#t, #batch, #oh, #ow, #oc>);
    let x_ty = quote!(#rt::cuda::CudaTensor<#t, #batch, #ih, #iw, #ic>);
    let stats_fields = stats_len.as_ref().map(|n| {
        quote! {
            conv: #y_ty,
            mean: #rt::cuda::CudaVector<#a, #n>,
            inv_std: #rt::cuda::CudaVector<#a, #n>,
        }
    });
    let mut state_names = Vec::new();
    let mut state_tys = Vec::new();
    if let Some(n) = &stats_len {
        state_names.extend(["conv", "mean", "inv_std"].map(|f| format_ident!("{}", f)));
        let stats = quote!(#rt::cuda::CudaVector<#a, #n>);
        state_tys.extend([y_ty.clone(), stats.clone(), stats]);
    }
    state_names.extend(["pre_activation", "output"].map(|f| format_ident!("{}", f)));
    state_tys.extend([y_ty.clone(), y_ty.clone()]);
    // The host state's field each GPU field copies from, and the fields copied back: a host
    // state without an activation or norm keeps its pre-activation in `output`.
    let aliased = super::output_is_pre_activation(spec);
    let host_sources: Vec<syn::Ident> = state_names
        .iter()
        .map(|n| {
            if aliased && n == "pre_activation" {
                format_ident!("output")
            } else {
                n.clone()
            }
        })
        .collect();
    let host_names: Vec<syn::Ident> = state_names
        .iter()
        .filter(|n| !(aliased && *n == "pre_activation"))
        .cloned()
        .collect();

    // Widened copies for cuDNN in f32 (half layers).
    let widen_fn = (half && !direct).then(|| {
        quote! {
            fn __widen(s: &Session<'_>, src: &Buf, n: usize) -> #rt::Result<Buf> {
                let dst = s.zeros::<__A>(n)?;
                s.launch("widen", blocks_for(n), &[Arg::Long(n), Arg::Buf(src), Arg::Buf(&dst)])?;
                #ok(dst)
            }
        }
    });
    let narrow = |n: TokenStream, src: TokenStream, dst: TokenStream| quote!(s.launch("narrow", blocks_for(#n), &[Arg::Long(#n), Arg::Buf(#src), Arg::Buf(#dst)])?;);
    let conv_body = match (direct, half) {
        (true, _) => quote! {
            s.launch("conv_forward", blocks_for(batch * __NPIX * __OC), &[Arg::Int(batch), Arg::Buf(x), Arg::Buf(w), Arg::Buf(b), Arg::Buf(y)])?;
        },
        (false, false) => quote! {
            s.conv_forward(batch, x, w, b, y)?;
        },
        (false, true) => quote! {
            let xa = __widen(s, x, batch * __IH * __IW * __IC)?;
            let wa = __widen(s, w, __OC * __WINDOW)?;
            let ba = __widen(s, b, __OC)?;
            s.conv_forward(batch, &xa, &wa, &ba, y)?;
        },
    };

    let fused = plan.fused;
    let evaluate_body = match spec.norm {
        // The separate calls where cuDNN turns the fused one down (`conv_forward_relu` says so).
        Norm::None if fused && !half => quote! {
            if !s.conv_forward_relu(__B, x, w, b, out)? {
                __conv(s, __B, x, w, b, out)?;
                s.launch("activation_evaluate", blocks_for(count), &[Arg::Long(count), Arg::Buf(out), Arg::Buf(out)])?;
            }
        },
        Norm::None if fused => {
            let narrow = narrow(quote!(count), quote!(&y), quote!(out));
            quote! {
                let xa = __widen(s, x, __B * __IH * __IW * __IC)?;
                let wa = __widen(s, w, __OC * __WINDOW)?;
                let ba = __widen(s, b, __OC)?;
                let y = s.zeros::<__A>(count)?;
                if s.conv_forward_relu(__B, &xa, &wa, &ba, &y)? {
                    #narrow
                } else {
                    s.conv_forward(__B, &xa, &wa, &ba, &y)?;
                    s.launch("activation_evaluate", blocks_for(count), &[Arg::Long(count), Arg::Buf(&y), Arg::Buf(out)])?;
                }
            }
        }
        Norm::None if direct => quote! {
            s.launch("conv_evaluate", blocks_for(count), &[Arg::Int(__B), Arg::Buf(x), Arg::Buf(w), Arg::Buf(b), Arg::Buf(out)])?;
        },
        Norm::None => quote! {
            let y = s.zeros::<__A>(count)?;
            __conv(s, __B, x, w, b, &y)?;
            s.launch("activation_evaluate", blocks_for(count), &[Arg::Long(count), Arg::Buf(&y), Arg::Buf(out)])?;
        },
        Norm::BatchNorm { .. } => quote! {
            let y = s.zeros::<__A>(count)?;
            __conv(s, __B, x, w, b, &y)?;
            s.launch("bn_evaluate", blocks_for(count), &[Arg::Int(__B), Arg::Buf(&y), Arg::Buf(self.gamma.__buf()), Arg::Buf(self.beta.__buf()), Arg::Buf(self.running_mean.__buf()), Arg::Buf(self.running_var.__buf()), Arg::Buf(out)])?;
        },
        Norm::LayerNorm { .. } => {
            let rounded = if half {
                let narrow = narrow(quote!(count), quote!(&y), quote!(out));
                quote! {
                    let y = s.zeros::<__A>(count)?;
                    __conv(s, __B, x, w, b, &y)?;
                    #narrow
                }
            } else {
                quote!(__conv(s, __B, x, w, b, out)?;)
            };
            quote! {
                #rounded
                let mean = s.zeros::<__A>(__B)?;
                let inv_std = s.zeros::<__A>(__B)?;
                s.launch("ln_stats", __B, &[Arg::Int(__B), Arg::Buf(out), Arg::Buf(&mean), Arg::Buf(&inv_std)])?;
                s.launch("norm_affine", blocks_for(count), &[Arg::Int(__B), Arg::Buf(out), Arg::Buf(&mean), Arg::Buf(&inv_std), Arg::Buf(self.gamma.__buf()), Arg::Buf(self.beta.__buf()), Arg::Null, Arg::Buf(out)])?;
            }
        }
    };

    let forward_body = match spec.norm {
        Norm::None if direct => quote! {
            let _ = mode;
            s.launch("conv_forward_activation", blocks_for(n), &[Arg::Buf(x), Arg::Buf(w), Arg::Buf(b), Arg::Buf(state.pre_activation.__buf_mut()), Arg::Buf(state.output.__buf_mut())])?;
        },
        Norm::None => {
            // f32 and f64: the convolution writes the pre-activation itself (T is the
            // accumulator type; the activation reads each element before writing it).
            let y = if half {
                quote! {
                    let y = s.zeros::<__A>(n)?;
                    __conv(s, __BATCH, x, w, b, &y)?;
                    let y = &y;
                }
            } else {
                quote! {
                    __conv(s, __BATCH, x, w, b, state.pre_activation.__buf_mut())?;
                    let y = state.pre_activation.__buf();
                }
            };
            quote! {
                let _ = mode;
                #y
                s.launch("activation_forward", blocks_for(n), &[Arg::Long(n), Arg::Buf(y), Arg::Buf(state.pre_activation.__buf()), Arg::Buf(state.output.__buf_mut())])?;
            }
        }
        norm => {
            let rounded = if half {
                let narrow = narrow(quote!(n), quote!(&y), quote!(state.conv.__buf_mut()));
                quote! {
                    let y = s.zeros::<__A>(n)?;
                    __conv(s, __BATCH, x, w, b, &y)?;
                    #narrow
                }
            } else {
                quote!(__conv(s, __BATCH, x, w, b, state.conv.__buf_mut())?;)
            };
            let stats = match norm {
                Norm::BatchNorm { .. } => quote! {
                    if ::core::matches!(mode, #rt::Mode::Train) {
                        s.launch("bn_stats_train", __OC, &[Arg::Buf(state.conv.__buf()), Arg::Buf(state.mean.__buf_mut()), Arg::Buf(state.inv_std.__buf_mut()), Arg::Buf(self.running_mean.__buf_mut()), Arg::Buf(self.running_var.__buf_mut())])?;
                    } else {
                        s.launch("bn_stats_eval", blocks_for(__OC), &[Arg::Buf(self.running_mean.__buf()), Arg::Buf(self.running_var.__buf()), Arg::Buf(state.mean.__buf_mut()), Arg::Buf(state.inv_std.__buf_mut())])?;
                    }
                },
                _ => quote! {
                    let _ = mode;
                    s.launch("ln_stats", __BATCH, &[Arg::Int(__BATCH), Arg::Buf(state.conv.__buf()), Arg::Buf(state.mean.__buf_mut()), Arg::Buf(state.inv_std.__buf_mut())])?;
                },
            };
            quote! {
                #rounded
                #stats
                s.launch("norm_affine", blocks_for(n), &[Arg::Int(__BATCH), Arg::Buf(state.conv.__buf()), Arg::Buf(state.mean.__buf()), Arg::Buf(state.inv_std.__buf()), Arg::Buf(self.gamma.__buf()), Arg::Buf(self.beta.__buf()), Arg::Buf(state.pre_activation.__buf_mut()), Arg::Buf(state.output.__buf_mut())])?;
            }
        }
    };

    // Backward through the norm, in place on `dz`; the gamma and beta gradients accumulate
    // when `grads` is given.
    let norm_backward = match spec.norm {
        Norm::None => quote!(let _ = mode;),
        Norm::BatchNorm { .. } => quote! {
            let (d_gamma, d_beta) = match grads.as_deref() {
                #some(g) => (Arg::Buf(g.gamma.__buf()), Arg::Buf(g.beta.__buf())),
                #none => (Arg::Null, Arg::Null),
            };
            let kernel = if ::core::matches!(mode, #rt::Mode::Train) { "bn_backward_train" } else { "bn_backward_eval" };
            s.launch(kernel, __OC, &[Arg::Buf(&dz), Arg::Buf(state.conv.__buf()), Arg::Buf(state.mean.__buf()), Arg::Buf(state.inv_std.__buf()), Arg::Buf(layer.gamma.__buf()), d_gamma, d_beta])?;
        },
        Norm::LayerNorm { .. } => quote! {
            let _ = mode;
            if let #some(g) = grads.as_deref() {
                s.launch("ln_param_grads", __OC, &[Arg::Buf(&dz), Arg::Buf(state.conv.__buf()), Arg::Buf(state.mean.__buf()), Arg::Buf(state.inv_std.__buf()), Arg::Buf(g.gamma.__buf()), Arg::Buf(g.beta.__buf())])?;
            }
            s.launch("ln_backward", __BATCH, &[Arg::Buf(&dz), Arg::Buf(state.conv.__buf()), Arg::Buf(state.mean.__buf()), Arg::Buf(state.inv_std.__buf()), Arg::Buf(layer.gamma.__buf())])?;
        },
    };
    let weight_grad = match (direct, half) {
        (true, _) => quote! {
            s.launch("conv_backward_weights_partial", blocks_for(__WEIGHT_ITEMS), &[Arg::Buf(x), Arg::Buf(&dz), Arg::Buf(&partials)])?;
            s.launch("conv_backward_weights_finish", __OC * __WINDOW, &[Arg::Buf(&partials), Arg::Buf(grads.weights.__buf())])?;
        },
        (false, false) => quote! {
            s.conv_backward_filter(__BATCH, x, &dz, grads.weights.__buf())?;
        },
        (false, true) => quote! {
            let xa = __widen(s, x, __BATCH * __IH * __IW * __IC)?;
            s.conv_backward_filter(__BATCH, &xa, &dz, grads.weights.__buf())?;
        },
    };
    let data_grad = match (direct, half) {
        (true, _) => quote! {
            s.launch("conv_backward_data", blocks_for(len), &[Arg::Buf(&dz), Arg::Buf(w), Arg::Buf(dx)])?;
        },
        (false, false) => quote! {
            s.conv_backward_data(__BATCH, w, &dz, dx)?;
        },
        (false, true) => {
            let narrow = narrow(quote!(len), quote!(&dxa), quote!(dx));
            quote! {
                let wa = __widen(s, w, __OC * __WINDOW)?;
                let dxa = s.zeros::<__A>(len)?;
                s.conv_backward_data(__BATCH, &wa, &dz, &dxa)?;
                #narrow
            }
        }
    };
    let running_download = batch_norm.then(|| {
        quote! {
            if ::core::matches!(mode, #rt::Mode::Train) {
                on_gpu.running_mean.download_into(self, &mut layer.running_mean)?;
                on_gpu.running_var.download_into(self, &mut layer.running_var)?;
            }
        }
    });

    let host_ops = device_impl(spec, quote!(#rt::cuda::Cuda), |method| match method {
        "evaluate" => quote! {
            let on_gpu = #cuda_layer::upload(self, layer)?;
            let x = #rt::cuda::CudaTensor::upload(self, input)?;
            let mut y = #rt::cuda::CudaTensor::zeros(self)?;
            on_gpu.evaluate(self, &x, &mut y)?;
            y.download_into(self, output)
        },
        "forward" => quote! {
            let mut on_gpu = #cuda_layer::upload(self, layer)?;
            let x = #rt::cuda::CudaTensor::upload(self, input)?;
            let mut s = #cuda_state::new(self)?;
            on_gpu.forward(self, &x, &mut s, mode)?;
            s.download_into(self, state)?;
            #running_download
            #ok(())
        },
        "backward_input" => quote! {
            let on_gpu = #cuda_layer::upload(self, layer)?;
            let s = #cuda_state::upload(self, state)?;
            let dy = #rt::cuda::CudaTensor::upload(self, d_output)?;
            let mut dx = #rt::cuda::CudaTensor::zeros(self)?;
            on_gpu.backward_input(self, &s, &dy, &mut dx, mode)?;
            dx.download_into(self, d_input)
        },
        "backward" => quote! {
            let on_gpu = #cuda_layer::upload(self, layer)?;
            let s = #cuda_state::upload(self, state)?;
            let x = #rt::cuda::CudaTensor::upload(self, input)?;
            let dy = #rt::cuda::CudaTensor::upload(self, d_output)?;
            let mut g = #cuda_grads::upload(self, grads)?;
            on_gpu.backward(self, &s, &x, &dy, &mut g, mode)?;
            g.download_into(self, grads)
        },
        _ => quote! {
            let on_gpu = #cuda_layer::upload(self, layer)?;
            let s = #cuda_state::upload(self, state)?;
            let x = #rt::cuda::CudaTensor::upload(self, input)?;
            let dy = #rt::cuda::CudaTensor::upload(self, d_output)?;
            let mut dx = #rt::cuda::CudaTensor::zeros(self)?;
            let mut g = #cuda_grads::upload(self, grads)?;
            on_gpu.backward_full(self, &s, &x, &dy, &mut dx, &mut g, mode)?;
            dx.download_into(self, d_input)?;
            g.download_into(self, grads)
        },
    });

    let layer_doc = format!(
        "`{layer}`'s parameters (and running statistics) in GPU memory, with its operations on \
         tensors in GPU memory: nothing is copied between host and GPU. Create with `upload`, \
         copy back with `download_into`; step with `Sgd::step_cuda` / `Adam::step_cuda`."
    );
    let grads_doc = format!("`{grads}` in GPU memory: gradients of `{cuda_layer}`'s parameters.");
    let state_doc = format!(
        "`{state}` in GPU memory: what `{cuda_layer}::forward` keeps for the backward pass."
    );
    let cuda = quote!(#rt::cuda::Cuda);

    quote! {
        #rt::if_cuda! {
            #[doc = #layer_doc]
            #[allow(dead_code)]
            #vis struct #cuda_layer {
                #(
                    #[doc = ::core::concat!("Trainable parameter `", ::core::stringify!(#names), "`.")]
                    pub #names: #param_tys,
                )*
                #running_fields
            }

            #[doc = #grads_doc]
            #[allow(dead_code)]
            #vis struct #cuda_grads {
                #(
                    #[doc = ::core::concat!("Gradient of `", ::core::stringify!(#names), "`.")]
                    pub #names: #grad_tys,
                )*
            }

            #[doc = #state_doc]
            #[allow(dead_code)]
            #vis struct #cuda_state {
                #stats_fields
                pre_activation: #y_ty,
                output: #y_ty,
            }

            // Literal arithmetic is the point of specializing (as in the CPU block).
            #[allow(clippy::all)]
            const _: () = {
                use #rt::cuda::{blocks_for, Arg, Buf, Session};
                type __T = #t;
                type __A = #a;
                #consts

                static __SETUP: #rt::cuda::LayerSetup = #rt::cuda::LayerSetup::new(
                    #layer::__CUDA_SOURCE,
                    #layer::__CUDA_KERNELS,
                    #geometry,
                );

                #widen_fn

                /// The convolution with bias of `batch` images, into the accumulator-type `y`.
                #[allow(dead_code)]
                fn __conv(s: &mut Session<'_>, batch: usize, x: &Buf, w: &Buf, b: &Buf, y: &Buf) -> #result {
                    #conv_body
                    #ok(())
                }

                /// Every backward operation: the input gradient when `d_input` is given, the
                /// parameter gradients (accumulated) when `grads` is.
                #[allow(clippy::too_many_arguments)]
                fn __backward_pass(
                    dev: &mut #cuda,
                    layer: &#cuda_layer,
                    state: &#cuda_state,
                    input: ::core::option::Option<&Buf>,
                    d_output: &Buf,
                    d_input: ::core::option::Option<&mut Buf>,
                    grads: ::core::option::Option<&mut #cuda_grads>,
                    mode: #rt::Mode,
                ) -> #result {
                    let s = &mut dev.__session(&__SETUP)?;
                    let n = __BATCH * __NPIX * __OC;
                    let dz = s.zeros::<__A>(n)?;
                    s.launch("activation_backward", blocks_for(n), &[Arg::Long(n), Arg::Buf(d_output), Arg::Buf(state.pre_activation.__buf()), Arg::Buf(state.output.__buf()), Arg::Buf(&dz)])?;
                    #norm_backward
                    if let (#some(grads), #some(x)) = (grads, input) {
                        let partials = s.zeros::<__A>(__SCRATCH)?;
                        s.launch("bias_grad_partial", blocks_for(__BIAS_ITEMS), &[Arg::Buf(&dz), Arg::Buf(&partials)])?;
                        s.launch("bias_grad_finish", __OC, &[Arg::Buf(&partials), Arg::Buf(grads.biases.__buf_mut())])?;
                        let _ = grads.weights.__buf_mut();
                        #weight_grad
                    }
                    if let #some(dx) = d_input {
                        let len = __BATCH * __IH * __IW * __IC;
                        let w = layer.weights.__buf();
                        let dx = &*dx;
                        #data_grad
                    }
                    #ok(())
                }

                impl #cuda_layer {
                    /// A copy of `layer` (parameters and running statistics) on the GPU.
                    pub fn upload(dev: &#cuda, layer: &#layer) -> #rt::Result<Self> {
                        #ok(Self {
                            #(#names: <#param_tys>::upload(dev, &layer.#names)?,)*
                            #(#running: <#rt::cuda::CudaVector<__A, { __OC }>>::upload(dev, &layer.#running)?,)*
                        })
                    }

                    /// Overwrites the parameters (and running statistics) with `layer`'s.
                    pub fn copy_from_host(&mut self, dev: &#cuda, layer: &#layer) -> #result {
                        #(self.#names.copy_from_host(dev, &layer.#names)?;)*
                        #(self.#running.copy_from_host(dev, &layer.#running)?;)*
                        #ok(())
                    }

                    /// Copies the parameters (and running statistics) into `layer`.
                    pub fn download_into(&self, dev: &#cuda, layer: &mut #layer) -> #result {
                        #(self.#names.download_into(dev, &mut layer.#names)?;)*
                        #(self.#running.download_into(dev, &mut layer.#running)?;)*
                        #ok(())
                    }

                    /// Inference on any batch, on the GPU (BatchNorm uses the running statistics).
                    pub fn evaluate<const __B: usize>(
                        &self,
                        dev: &mut #cuda,
                        input: &#rt::cuda::CudaTensor<__T, { __B }, { __IH }, { __IW }, { __IC }>,
                        output: &mut #rt::cuda::CudaTensor<__T, { __B }, { __OH }, { __OW }, { __OC }>,
                    ) -> #result {
                        // An empty batch has nothing to compute (cuDNN refuses its descriptors).
                        if __B == 0 {
                            return #ok(());
                        }
                        let s = &mut dev.__session(&__SETUP)?;
                        let count = __B * __NPIX * __OC;
                        let (x, w, b) = (input.__buf(), self.weights.__buf(), self.biases.__buf());
                        let out: &Buf = output.__buf_mut();
                        #evaluate_body
                        #ok(())
                    }

                    /// The training-batch forward pass into `state`, on the GPU; `Mode::Train`
                    /// uses batch statistics and updates BatchNorm's running ones.
                    pub fn forward(
                        &mut self,
                        dev: &mut #cuda,
                        input: &#x_ty,
                        state: &mut #cuda_state,
                        mode: #rt::Mode,
                    ) -> #result {
                        let s = &mut dev.__session(&__SETUP)?;
                        let n = __BATCH * __NPIX * __OC;
                        let (x, w, b) = (input.__buf(), self.weights.__buf(), self.biases.__buf());
                        #forward_body
                        #ok(())
                    }

                    /// The input gradient of the forward pass that filled `state` (run in `mode`).
                    pub fn backward_input(
                        &self,
                        dev: &mut #cuda,
                        state: &#cuda_state,
                        d_output: &#y_ty,
                        d_input: &mut #x_ty,
                        mode: #rt::Mode,
                    ) -> #result {
                        __backward_pass(dev, self, state, #none, d_output.__buf(), #some(d_input.__buf_mut()), #none, mode)
                    }

                    /// Adds the parameter gradients of the forward pass that filled `state` into
                    /// `grads`.
                    pub fn backward(
                        &self,
                        dev: &mut #cuda,
                        state: &#cuda_state,
                        input: &#x_ty,
                        d_output: &#y_ty,
                        grads: &mut #cuda_grads,
                        mode: #rt::Mode,
                    ) -> #result {
                        __backward_pass(dev, self, state, #some(input.__buf()), d_output.__buf(), #none, #some(grads), mode)
                    }

                    /// `backward_input` and `backward` in one pass.
                    #[allow(clippy::too_many_arguments)]
                    pub fn backward_full(
                        &self,
                        dev: &mut #cuda,
                        state: &#cuda_state,
                        input: &#x_ty,
                        d_output: &#y_ty,
                        d_input: &mut #x_ty,
                        grads: &mut #cuda_grads,
                        mode: #rt::Mode,
                    ) -> #result {
                        __backward_pass(dev, self, state, #some(input.__buf()), d_output.__buf(), #some(d_input.__buf_mut()), #some(grads), mode)
                    }
                }

                impl #rt::cuda::CudaParameters for #cuda_layer {
                    type Elem = __T;
                    type Grads = #cuda_grads;

                    fn visit_cuda_mut(
                        &mut self,
                        grads: &#cuda_grads,
                        f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::cuda::CudaParamTensor, &Buf),
                    ) {
                        #(f(::core::stringify!(#names), &mut self.#names, grads.#names.__buf());)*
                    }
                }

                impl #cuda_grads {
                    /// Zero gradients on the GPU.
                    pub fn zeros(dev: &#cuda) -> #rt::Result<Self> {
                        #ok(Self { #(#names: <#grad_tys>::zeros(dev)?,)* })
                    }

                    /// A copy of `grads` on the GPU.
                    pub fn upload(dev: &#cuda, grads: &#grads) -> #rt::Result<Self> {
                        #ok(Self { #(#names: <#grad_tys>::upload(dev, &grads.#names)?,)* })
                    }

                    /// Sets every gradient to zero.
                    pub fn zero(&mut self, dev: &#cuda) -> #result {
                        #(self.#names.zero(dev)?;)*
                        #ok(())
                    }

                    /// Copies the gradients into `grads`.
                    pub fn download_into(&self, dev: &#cuda, grads: &mut #grads) -> #result {
                        #(self.#names.download_into(dev, &mut grads.#names)?;)*
                        #ok(())
                    }
                }

                impl #cuda_state {
                    /// Zeroed state on the GPU.
                    pub fn new(dev: &#cuda) -> #rt::Result<Self> {
                        #ok(Self { #(#state_names: <#state_tys>::zeros(dev)?,)* })
                    }

                    /// A copy of `state` on the GPU.
                    pub fn upload(dev: &#cuda, state: &#state) -> #rt::Result<Self> {
                        let mut s = Self::new(dev)?;
                        #(s.#state_names.copy_from_host(dev, &state.#host_sources)?;)*
                        #ok(s)
                    }

                    /// Copies the state into `state`.
                    pub fn download_into(&self, dev: &#cuda, state: &mut #state) -> #result {
                        #(self.#host_names.download_into(dev, &mut state.#host_names)?;)*
                        #ok(())
                    }

                    /// The output of the last forward pass.
                    pub fn output(&self) -> &#y_ty {
                        &self.output
                    }

                    /// The activation's input in the last forward pass.
                    pub fn pre_activation(&self) -> &#y_ty {
                        &self.pre_activation
                    }
                }
            };

            #host_ops
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(input: [usize; 3], oc: usize, kernel: usize, stride: usize, batch: usize) -> Spec {
        Spec::for_tests(input, oc, kernel, stride, 0, batch)
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
    fn fused_inference_for_cudnn_relu_without_norm() {
        let mut s = spec([56, 56, 64], 64, 3, 1, 8);
        assert!(fused(&s, direct(&s)));
        s.dtype = Dtype::Bf16;
        assert!(fused(&s, direct(&s)));
        s.dtype = Dtype::F64;
        assert!(!fused(&s, direct(&s)));
        s.dtype = Dtype::F32;
        s.activation = Activation::Gelu;
        assert!(!fused(&s, direct(&s)));
        s.activation = Activation::Relu;
        s.norm = Norm::LayerNorm { eps: 1e-5 };
        assert!(!fused(&s, direct(&s)));
        let small = spec([8, 8, 3], 4, 3, 1, 2);
        assert!(!fused(&small, direct(&small)));
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
                "activation_backward",
                "bias_grad_partial",
                "bias_grad_finish",
                "conv_evaluate",
                "conv_forward_activation",
                "conv_backward_data",
                "conv_backward_weights_partial",
                "conv_backward_weights_finish",
            ]
        );
        let mut small_bn = spec([8, 8, 3], 4, 3, 1, 2);
        small_bn.norm = Norm::BatchNorm {
            momentum: 0.1,
            eps: 1e-5,
        };
        let k = names(&small_bn);
        assert!(k.contains(&"conv_forward") && !k.contains(&"conv_evaluate"));
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
        let mut cudnn_relu = spec([56, 56, 64], 64, 3, 1, 8);
        cudnn_relu.norm = Norm::None;
        let k = names(&cudnn_relu);
        assert!(k.contains(&"activation_evaluate") && !k.contains(&"conv_evaluate"));
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
