//! Generated CPU code: the direct convolution kernel and the operations built on it.
//!
//! Layout and blocking (chosen here, from the spec):
//! - activations NHWC; output channels are the SIMD dimension (`L` lanes of the accumulator
//!   type per 256-bit vector);
//! - weights are repacked once per parameter change (the device caches the packed copy by the
//!   weights' content stamp) into `[block][kh][kw][ic][lanes]`, a block being `V` vectors of
//!   output channels, zero-padded to whole vectors, followed by the padded biases;
//! - the output pixels of the whole batch, flattened, are cut into tiles of `P`: a tile is a
//!   `P x V` register block of accumulators, fully unrolled, fed by one weight vector load per
//!   `V` and one broadcast per pixel for each of the `KH * KW * IC` reduction steps. Each pixel
//!   of a tile has its own input pointer, so tiles cross row and image boundaries freely and
//!   only the last tile of a call is partial;
//! - a padded spec copies its input into a zero-bordered scratch image first, so the kernel
//!   has no border branches at all (the copy is `1 / (KH * KW * OC)` of the work);
//! - the tile's unrolled body is the only unrolling the macro does: `P * V <= 12` accumulators
//!   plus `V` weights and a broadcast fit the 16 vector registers of AVX2, the budget that keeps
//!   the code size bounded for any layer. The window loops keep constant bounds for LLVM.
//!
//! Every kernel is emitted once, generic over the runtime's `Simd` vectors, and instantiated for
//! AVX2+FMA inside a `#[target_feature]` function and for the portable vectors; the choice is
//! made per call from the CPU's features.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::{acc, elem, lit, rt, Names};
use crate::spec::{Activation, Dtype, Norm, Spec};

/// Accumulator registers per tile: 12 of AVX2's 16 vector registers, leaving room for the
/// weight vectors and the broadcast.
const ACC_REGISTERS: usize = 12;
/// Pixels per tile at most: each needs a pointer register of its own.
const MAX_PIXELS: usize = 6;

/// The register blocking of the forward kernel.
pub struct Blocking {
    /// Lanes per vector.
    pub lanes: usize,
    /// Output-channel vectors, output channels rounded up to whole vectors.
    pub vectors: usize,
    /// Vectors per full block.
    pub v: usize,
    /// Pixels per tile.
    pub p: usize,
}

impl Blocking {
    pub fn of(spec: &Spec) -> Self {
        let lanes = spec.dtype.lanes();
        let vectors = spec.out_channels.div_ceil(lanes);
        // Three vectors when that covers the channels exactly, else two (or one): wide enough
        // that each broadcast feeds several FMAs, narrow enough for six pixels per tile.
        let v = match vectors {
            1 => 1,
            3 => 3,
            _ => 2,
        };
        let p = (ACC_REGISTERS / v).min(MAX_PIXELS);
        Self {
            lanes,
            vectors,
            v,
            p,
        }
    }

    /// Blocks as (first vector, vectors in the block).
    fn blocks(&self) -> Vec<(usize, usize)> {
        (0..self.vectors)
            .step_by(self.v)
            .map(|s| (s, self.v.min(self.vectors - s)))
            .collect()
    }

    pub fn padded_channels(&self) -> usize {
        self.vectors * self.lanes
    }
}

/// The runtime's activation type for a spec's activation.
pub fn activation_type(a: Activation) -> TokenStream {
    let rt = rt();
    let name = format_ident!("{}", a.name());
    quote!(#rt::activation::#name)
}

pub fn expand(spec: &Spec) -> TokenStream {
    let rt = rt();
    let Names {
        layer,
        state,
        device,
        ..
    } = Names::of(spec);
    let t = elem(spec.dtype);
    let a = acc(spec.dtype);
    let blk = Blocking::of(spec);
    let half = matches!(spec.dtype, Dtype::F16 | Dtype::Bf16);
    let (simd_avx2, simd_portable) = match spec.dtype {
        Dtype::F64 => (quote!(#rt::simd::Avx2F64), quote!(#rt::simd::PortableF64)),
        _ => (quote!(#rt::simd::Avx2F32), quote!(#rt::simd::PortableF32)),
    };
    let act = activation_type(spec.activation);
    let relu_in_register = spec.activation == Activation::Relu;

    let (kh, kw, ic, oc) = (
        spec.kernel[0],
        spec.kernel[1],
        spec.in_c(),
        spec.out_channels,
    );
    let window_row = kw * ic;
    let block_len = |nv: usize| kh * window_row * nv * blk.lanes;
    let blocks = blk.blocks();
    let bias_offset: usize = blocks.iter().map(|&(_, nv)| block_len(nv)).sum();
    let packed_len = bias_offset + blk.padded_channels();

    // One tile function per distinct (vectors, lanes in the last vector) combination.
    let mut tile_kinds: Vec<(usize, usize)> = Vec::new();
    let mut block_calls = Vec::new();
    let mut w_off = 0;
    for &(first, nv) in &blocks {
        let last_lanes = (oc - (first + nv - 1) * blk.lanes).min(blk.lanes);
        if !tile_kinds.contains(&(nv, last_lanes)) {
            tile_kinds.push((nv, last_lanes));
        }
        let tile = format_ident!("tile_{}_{}", nv, last_lanes);
        let (w_off_l, c_off) = (lit(w_off), lit(first * blk.lanes));
        let bias = lit(bias_offset + first * blk.lanes);
        block_calls.push(quote! {
            #tile::<S, RELU>(&xs, w.add(#w_off_l), w.add(#bias), out.add(#c_off));
        });
        w_off += block_len(nv);
    }
    let tiles = tile_kinds
        .iter()
        .map(|&(nv, last_lanes)| tile_fn(spec, &blk, nv, last_lanes));

    // Packing: OHWI weights -> [block][kh][kw][ic][lanes], then the biases.
    let pack_blocks = blocks.iter().scan(0usize, |off, &(first, nv)| {
        let (o, f, width) = (lit(*off), lit(first * blk.lanes), lit(nv * blk.lanes));
        *off += block_len(nv);
        ::core::option::Option::Some(quote! {
            for c in 0..#width {
                let oc = #f + c;
                if oc < OC {
                    for k in 0..KH * KW * IC {
                        out[#o + k * #width + c] = w[oc * KH * KW * IC + k].to_acc();
                    }
                }
            }
        })
    });

    let layout_id = {
        // Different layers whose weights share a stamp (clones) share packed copies only when
        // the layout is the same.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for n in [oc, kh, kw, ic, blk.v, blk.lanes, 1] {
            h = (h ^ n as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h
    };

    let consts = constants(spec, &blk, packed_len, bias_offset);

    // Input staging: padded specs and half types copy into accumulator-typed scratch.
    let staged = spec.has_padding() || half;
    let stage_input = if staged {
        quote! {
            let (xa, rest) = ws.scratch.split_at_mut(__B * XH * XW * IC);
            for n in 0..__B {
                for h in 0..IH {
                    let src = &x[(n * IH + h) * IW * IC..][..IW * IC];
                    let dst = &mut xa[((n * XH + h + PH) * XW + PW) * IC..][..IW * IC];
                    <__T as #rt::Element>::to_acc_slice(src, dst);
                }
            }
            let xa: &[__A] = xa;
        }
    } else {
        quote! {
            let (xa, rest): (&[__A], &mut [__A]) = (x, ws.scratch);
        }
    };
    let staged_len = if staged {
        quote!(__B * XH * XW * IC)
    } else {
        quote!(0)
    };

    let kernel = quote! {
        /// Convolution + bias of `B` images into `ya` (accumulator type; `None`: scratch), with
        /// `epilogue(tile results, first pixel, pixels)` run on each finished tile while it is
        /// in cache. `RELU` applies ReLU in registers.
        #[inline(always)]
        fn conv<const __B: usize, const RELU: bool>(
            cpu: &mut #rt::Cpu,
            layer: &#layer,
            x: &[__T],
            ya: ::core::option::Option<&mut [__A]>,
            epilogue: &mut dyn FnMut(&mut [__A], usize, usize),
        ) {
            let key = #rt::PackKey {
                stamps: [layer.weights.stamp(), layer.biases.stamp()],
                layout: #layout_id,
            };
            let y_scratch = if ya.is_some() { 0 } else { __B * NPIX * OC };
            let ws = cpu.__workspace::<__A>(
                key,
                PACKED_LEN,
                |out| pack(layer.weights.as_slice(), layer.biases.as_slice(), out),
                #staged_len + P * OC + y_scratch,
            );
            let w = ws.packed;
            #stage_input
            let (tail, rest) = rest.split_at_mut(P * OC);
            let ya: &mut [__A] = match ya {
                ::core::option::Option::Some(y) => y,
                ::core::option::Option::None => &mut rest[..__B * NPIX * OC],
            };
            // SAFETY: the slices have the lengths the kernel's index arithmetic is built on
            // (checked in debug builds), and the AVX2 path runs only where the CPU has it.
            unsafe {
                #[cfg(target_arch = "x86_64")]
                {
                    if #rt::avx2_fma() {
                        return conv_avx2::<__B, RELU>(xa, w, ya, tail, epilogue);
                    }
                }
                conv_kernel::<#simd_portable, __B, RELU>(xa, w, ya, tail, epilogue)
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn conv_avx2<const __B: usize, const RELU: bool>(
            x: &[__A], w: &[__A], y: &mut [__A], tail: &mut [__A],
            epilogue: &mut dyn FnMut(&mut [__A], usize, usize),
        ) {
            conv_kernel::<#simd_avx2, __B, RELU>(x, w, y, tail, epilogue)
        }

        #[inline(always)]
        unsafe fn conv_kernel<S: #rt::Simd<Elem = __A>, const __B: usize, const RELU: bool>(
            x: &[__A], w: &[__A], y: &mut [__A], tail: &mut [__A],
            epilogue: &mut dyn FnMut(&mut [__A], usize, usize),
        ) {
            ::core::debug_assert!(x.len() >= __B * XH * XW * IC && w.len() == PACKED_LEN);
            ::core::debug_assert!(y.len() == __B * NPIX * OC && tail.len() == P * OC);
            let total = __B * NPIX;
            let (x, w) = (x.as_ptr(), w.as_ptr());
            let mut q0 = 0;
            while q0 < total {
                let valid = if total - q0 < P { total - q0 } else { P };
                // Pixels past the end of a partial tile repeat the last one; their results go
                // to `tail` and are dropped.
                let xs: [*const __A; P] = ::core::array::from_fn(|p| {
                    let q = if q0 + p < total { q0 + p } else { total - 1 };
                    let (n, r) = (q / NPIX, q % NPIX);
                    let (oh, ow) = (r / OW, r % OW);
                    x.add(((n * XH + oh * SH) * XW + ow * SW) * IC)
                });
                let out: *mut __A =
                    if valid == P { y.as_mut_ptr().add(q0 * OC) } else { tail.as_mut_ptr() };
                #(#block_calls)*
                if valid < P {
                    y[q0 * OC..(q0 + valid) * OC].copy_from_slice(&tail[..valid * OC]);
                }
                epilogue(&mut y[q0 * OC..(q0 + valid) * OC], q0, valid);
                q0 += P;
            }
        }

        /// OHWI weights -> `[block][kh][kw][ic][lanes]`, zero-padded, then the biases.
        fn pack(w: &[__T], b: &[__T], out: &mut [__A]) {
            use #rt::Element as _;
            #(#pack_blocks)*
            for c in 0..OC {
                out[BIAS_OFFSET + c] = b[c].to_acc();
            }
        }

        #(#tiles)*
    };

    let ops = operations(spec, half, relu_in_register, &act);
    let names = Names::of(spec);
    let _ = (&names, &state, &device);

    quote! {
        const _: () = {
            type __T = #t;
            type __A = #a;
            #consts
            #kernel
            #ops
        };
    }
}

/// The spec's numbers as constants of the generated block.
fn constants(spec: &Spec, blk: &Blocking, packed_len: usize, bias_offset: usize) -> TokenStream {
    let pairs = [
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
        ("XH", spec.padded_h()),
        ("XW", spec.padded_w()),
        ("NPIX", spec.out_h() * spec.out_w()),
        ("BATCH", spec.batch),
        ("P", blk.p),
        ("PACKED_LEN", packed_len),
        ("BIAS_OFFSET", bias_offset),
    ];
    let items = pairs.iter().map(|(name, value)| {
        let (name, value) = (format_ident!("{}", name), lit(*value));
        quote!(#[allow(dead_code)] const #name: usize = #value;)
    });
    quote!(#(#items)*)
}

/// `evaluate` and `forward` for the CPU device.
fn operations(spec: &Spec, half: bool, relu_in_register: bool, act: &TokenStream) -> TokenStream {
    let rt = rt();
    let Names {
        layer,
        state,
        device,
        ..
    } = Names::of(spec);
    let t = elem(spec.dtype);
    let apply = quote!(<#act as #rt::Activation>::apply);
    let f = quote!(<#act as #rt::Activation>::f);

    // Rounds accumulator values into element-typed storage.
    let store = if half {
        quote!(<__T as #rt::Element>::from_acc_slice)
    } else {
        quote!((|src: &[__A], dst: &mut [__T]| dst.copy_from_slice(src)))
    };

    let norm_fns = norm_fns(spec);

    let (evaluate, forward) = match spec.norm {
        Norm::None => {
            let relu = relu_in_register;
            let evaluate = if half {
                quote! {
                    let out = output.as_mut_slice();
                    conv::<__B, #relu>(self, layer, input.as_slice(), ::core::option::Option::None, &mut |ya, q0, n| {
                        if !#relu { #apply(ya); }
                        #store(ya, &mut out[q0 * OC..(q0 + n) * OC]);
                    });
                }
            } else {
                quote! {
                    conv::<__B, #relu>(self, layer, input.as_slice(), ::core::option::Option::Some(output.as_mut_slice()), &mut |ya, _, _| {
                        if !#relu { #apply(ya); }
                    });
                }
            };
            let forward = if half {
                quote! {
                    let pre = state.pre_activation.as_mut_slice();
                    let out = state.output.as_mut_slice();
                    conv::<BATCH, false>(self, layer, input.as_slice(), ::core::option::Option::None, &mut |ya, q0, n| {
                        let range = q0 * OC..(q0 + n) * OC;
                        #store(ya, &mut pre[range.clone()]);
                        #apply(ya);
                        #store(ya, &mut out[range]);
                    });
                }
            } else {
                quote! {
                    let out = state.output.as_mut_slice();
                    conv::<BATCH, false>(self, layer, input.as_slice(), ::core::option::Option::Some(state.pre_activation.as_mut_slice()), &mut |ya, q0, n| {
                        let dst = &mut out[q0 * OC..(q0 + n) * OC];
                        dst.copy_from_slice(ya);
                        #apply(dst);
                    });
                }
            };
            (evaluate, forward)
        }
        Norm::BatchNorm { .. } => {
            let evaluate = quote! {
                // Running statistics fold into one scale and shift per channel, applied to
                // each tile while it is in cache.
                let (scale, shift) = eval_affine(layer);
                let out = output.as_mut_slice();
                conv::<__B, false>(self, layer, input.as_slice(), ::core::option::Option::None, &mut |ya, q0, n| {
                    for px in ya.chunks_exact_mut(OC) {
                        for c in 0..OC {
                            px[c] = #f(px[c] * scale[c] + shift[c]);
                        }
                    }
                    #store(ya, &mut out[q0 * OC..(q0 + n) * OC]);
                });
            };
            let forward = quote! {
                conv_to_state(self, layer, input.as_slice(), state);
                match mode {
                    #rt::Mode::Train => {
                        let (mean, var) = batch_stats(state.conv.as_slice());
                        update_running_stats(layer, &mean, &var);
                        set_stats(state, &mean, &var);
                    }
                    #rt::Mode::Eval => {
                        let mean = *as_array(layer.running_mean.as_slice());
                        let var = *as_array(layer.running_var.as_slice());
                        set_stats(state, &mean, &var);
                    }
                }
                normalize(layer, state);
            };
            (evaluate, forward)
        }
        Norm::LayerNorm { .. } => {
            let evaluate = quote! {
                let out = output.as_mut_slice();
                conv::<__B, false>(self, layer, input.as_slice(), ::core::option::Option::None, &mut |ya, q0, n| {
                    #store(ya, &mut out[q0 * OC..(q0 + n) * OC]);
                });
                for sample in out.chunks_exact_mut(NPIX * OC) {
                    let (mean, inv_std) = sample_stats(sample);
                    for px in sample.chunks_exact_mut(OC) {
                        for c in 0..OC {
                            let g = <__T as #rt::Element>::to_acc(layer.gamma.as_slice()[c]);
                            let b = <__T as #rt::Element>::to_acc(layer.beta.as_slice()[c]);
                            let z = <__T as #rt::Element>::to_acc(px[c]);
                            px[c] = <__T as #rt::Element>::from_acc(#f(g * (z - mean) * inv_std + b));
                        }
                    }
                }
            };
            let forward = quote! {
                let _ = mode;
                conv_to_state(self, layer, input.as_slice(), state);
                for n in 0..BATCH {
                    let (mean, inv_std) = sample_stats(&state.conv.as_slice()[n * NPIX * OC..][..NPIX * OC]);
                    state.mean.as_mut_slice()[n] = mean;
                    state.inv_std.as_mut_slice()[n] = inv_std;
                }
                normalize(layer, state);
            };
            (evaluate, forward)
        }
    };
    let _ = t;

    quote! {
        #norm_fns

        impl #device for #rt::Cpu {
            fn evaluate<const __B: usize>(
                &mut self,
                layer: &#layer,
                input: &#rt::Tensor<__T, __B, IH, IW, IC>,
                output: &mut #rt::Tensor<__T, __B, OH, OW, OC>,
            ) -> #rt::Result<()> {
                #evaluate
                ::core::result::Result::Ok(())
            }

            fn forward(
                &mut self,
                layer: &mut #layer,
                input: &#rt::Tensor<__T, BATCH, IH, IW, IC>,
                state: &mut #state,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                let _ = mode;
                #forward
                ::core::result::Result::Ok(())
            }
        }
    }
}

/// Statistics and normalization helpers of a normalized spec (nothing without a norm).
///
/// Statistics accumulate in the accumulator type in two passes (mean, then squared deviations
/// from it): no `E[x^2] - E[x]^2` cancellation. The same algorithm runs on every backend.
fn norm_fns(spec: &Spec) -> TokenStream {
    let rt = rt();
    let Names { layer, state, .. } = Names::of(spec);
    let half = matches!(spec.dtype, Dtype::F16 | Dtype::Bf16);
    let act = activation_type(spec.activation);
    let f = quote!(<#act as #rt::Activation>::f);
    let to_acc = quote!(<__T as #rt::Element>::to_acc);
    let from_acc = quote!(<__T as #rt::Element>::from_acc);
    let eps = match spec.norm {
        Norm::None => return TokenStream::new(),
        Norm::BatchNorm { eps, .. } | Norm::LayerNorm { eps } => eps,
    };
    let conv_to_state = if half {
        quote! {
            fn conv_to_state(cpu: &mut #rt::Cpu, layer: &#layer, x: &[__T], state: &mut #state) {
                let z = state.conv.as_mut_slice();
                conv::<BATCH, false>(cpu, layer, x, ::core::option::Option::None, &mut |ya, q0, n| {
                    <__T as #rt::Element>::from_acc_slice(ya, &mut z[q0 * OC..(q0 + n) * OC]);
                });
            }
        }
    } else {
        quote! {
            fn conv_to_state(cpu: &mut #rt::Cpu, layer: &#layer, x: &[__T], state: &mut #state) {
                conv::<BATCH, false>(cpu, layer, x, ::core::option::Option::Some(state.conv.as_mut_slice()), &mut |_, _, _| {});
            }
        }
    };
    let (group_of, bn_fns) = match spec.norm {
        Norm::BatchNorm { momentum, .. } => (
            quote!(c),
            quote! {
                const MOMENTUM: __A = #momentum as __A;

                fn as_array(v: &[__A]) -> &[__A; OC] {
                    match v.try_into() {
                        ::core::result::Result::Ok(a) => a,
                        ::core::result::Result::Err(_) => ::core::unreachable!("per-channel vectors have OC elements"),
                    }
                }

                /// Per-channel mean and biased variance over (batch, OH, OW), two passes.
                fn batch_stats(z: &[__T]) -> ([__A; OC], [__A; OC]) {
                    let n = (BATCH * NPIX) as __A;
                    let mut sum = [0.0 as __A; OC];
                    for px in z.chunks_exact(OC) {
                        for c in 0..OC {
                            sum[c] += #to_acc(px[c]);
                        }
                    }
                    let mean: [__A; OC] = ::core::array::from_fn(|c| sum[c] / n);
                    let mut squares = [0.0 as __A; OC];
                    for px in z.chunks_exact(OC) {
                        for c in 0..OC {
                            let d = #to_acc(px[c]) - mean[c];
                            squares[c] += d * d;
                        }
                    }
                    (mean, ::core::array::from_fn(|c| squares[c] / n))
                }

                /// running = (1 - momentum) * running + momentum * batch statistic.
                fn update_running_stats(layer: &mut #layer, mean: &[__A; OC], var: &[__A; OC]) {
                    let rm = layer.running_mean.as_mut_slice();
                    for c in 0..OC {
                        rm[c] = (1.0 - MOMENTUM) * rm[c] + MOMENTUM * mean[c];
                    }
                    let rv = layer.running_var.as_mut_slice();
                    for c in 0..OC {
                        rv[c] = (1.0 - MOMENTUM) * rv[c] + MOMENTUM * var[c];
                    }
                }

                fn set_stats(state: &mut #state, mean: &[__A; OC], var: &[__A; OC]) {
                    state.mean.as_mut_slice().copy_from_slice(mean);
                    let inv_std = state.inv_std.as_mut_slice();
                    for c in 0..OC {
                        inv_std[c] = 1.0 / (var[c] + EPS).sqrt();
                    }
                }

                /// Evaluation-mode BatchNorm as `scale * z + shift` per channel.
                fn eval_affine(layer: &#layer) -> ([__A; OC], [__A; OC]) {
                    let scale: [__A; OC] = ::core::array::from_fn(|c| {
                        #to_acc(layer.gamma.as_slice()[c])
                            / (layer.running_var.as_slice()[c] + EPS).sqrt()
                    });
                    let shift = ::core::array::from_fn(|c| {
                        #to_acc(layer.beta.as_slice()[c]) - scale[c] * layer.running_mean.as_slice()[c]
                    });
                    (scale, shift)
                }
            },
        ),
        _ => (
            quote!(q / NPIX),
            quote! {
                /// Mean and 1 / sqrt(biased variance + eps) of one sample, two passes.
                fn sample_stats(z: &[__T]) -> (__A, __A) {
                    let n = z.len() as __A;
                    let mut sum: __A = 0.0;
                    for v in z {
                        sum += #to_acc(*v);
                    }
                    let mean = sum / n;
                    let mut squares: __A = 0.0;
                    for v in z {
                        let d = #to_acc(*v) - mean;
                        squares += d * d;
                    }
                    (mean, 1.0 / (squares / n + EPS).sqrt())
                }
            },
        ),
    };
    quote! {
        const EPS: __A = #eps as __A;

        #conv_to_state
        #bn_fns

        /// pre_activation = gamma * (conv - mean) * inv_std + beta; output = f(pre_activation),
        /// with the statistics the forward pass stored in `state`.
        fn normalize(layer: &#layer, state: &mut #state) {
            let gamma: [__A; OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
            let beta: [__A; OC] = ::core::array::from_fn(|c| #to_acc(layer.beta.as_slice()[c]));
            let (mean, inv_std) = (state.mean.as_slice(), state.inv_std.as_slice());
            let z = state.conv.as_slice();
            let pre = state.pre_activation.as_mut_slice();
            let out = state.output.as_mut_slice();
            for q in 0..BATCH * NPIX {
                for c in 0..OC {
                    let g = #group_of;
                    let i = q * OC + c;
                    let y = gamma[c] * (#to_acc(z[i]) - mean[g]) * inv_std[g] + beta[c];
                    pre[i] = #from_acc(y);
                    out[i] = #from_acc(#f(y));
                }
            }
        }
    }
}

/// One `P x nv` tile: accumulators start at the biases, run over the window, and are stored
/// (ReLU applied in registers when `RELU`). The last vector stores `last_lanes` lanes.
fn tile_fn(spec: &Spec, blk: &Blocking, nv: usize, last_lanes: usize) -> TokenStream {
    let rt = rt();
    let name = format_ident!("tile_{}_{}", nv, last_lanes);
    let (p_n, l) = (blk.p, blk.lanes);
    let width = lit(nv * l);
    let acc = |p: usize, v: usize| format_ident!("acc_{}_{}", p, v);
    let init = (0..p_n).flat_map(|p| {
        (0..nv).map(move |v| {
            let (name, off) = (acc(p, v), lit(v * l));
            quote!(let mut #name = S::load(bias.add(#off));)
        })
    });
    let wloads = (0..nv).map(|v| {
        let (name, off) = (format_ident!("w_{}", v), lit(v * l));
        quote!(let #name = S::load(wr.add(j * #width + #off));)
    });
    let fmas = (0..p_n).map(|p| {
        let x = format_ident!("x_{}", p);
        let pl = lit(p);
        let updates = (0..nv).map(|v| {
            let (name, w) = (acc(p, v), format_ident!("w_{}", v));
            quote!(#name = S::fma(#x, #w, #name);)
        });
        quote! {
            let #x = S::splat(*rows[#pl].add(j));
            #(#updates)*
        }
    });
    let stores = (0..p_n).flat_map(|p| {
        (0..nv).map(move |v| {
            let name = acc(p, v);
            let off = lit(p * spec.out_channels + v * l);
            let store = if v + 1 == nv && last_lanes < l {
                let n = lit(last_lanes);
                quote!(#name.store_partial(y.add(#off), #n);)
            } else {
                quote!(#name.store(y.add(#off));)
            };
            quote! {
                if RELU { #name = #name.max(S::zero()); }
                #store
            }
        })
    });
    let _ = rt;
    let p_lits = (0..p_n).map(lit);
    quote! {
        #[inline(always)]
        unsafe fn #name<S: #rt::Simd<Elem = __A>, const RELU: bool>(
            xs: &[*const __A; P], w: *const __A, bias: *const __A, y: *mut __A,
        ) {
            #(#init)*
            for kh in 0..KH {
                let rows: [*const __A; P] = [#(xs[#p_lits].add(kh * XW * IC)),*];
                let wr = w.add(kh * KW * IC * #width);
                for j in 0..KW * IC {
                    #(#wloads)*
                    #(#fmas)*
                }
            }
            #(#stores)*
        }
    }
}
