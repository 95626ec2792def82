//! Generated CPU code: the forward convolution kernel, and every operation of the `Cpu` device.
//!
//! Layout (chosen here, from the spec):
//! - activations NHWC; output channels are the SIMD dimension;
//! - weights are repacked once per parameter change (the device caches the packed copy by the
//!   weights' content stamp) into `[block][kh][kw][ic][lanes]`, a block being `V` vectors of
//!   output channels zero-padded to whole vectors, followed by the padded biases;
//! - the output pixels of the whole batch, flattened, are cut into tiles of `P`, each a
//!   `P x V` register block fed by `V` weight loads and `P` broadcasts per reduction step.
//!   Each pixel of a tile has its own input pointer, so tiles cross row and image boundaries
//!   freely and only the last tile of a call is partial;
//! - a padded spec (or a half-precision one) first copies its input into a zero-bordered scratch
//!   image in the accumulator type, so the kernel has no border branches at all (the copy is
//!   `1 / (KH * KW * OC)` of the work).

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::kernel::{
    array_by_loop, dispatched, fma_step, init_accumulators, write_accumulators, Blocking,
};
use super::{acc, backward, dense, elem, lit, norm, onednn, rt, scatter, usize_consts, winograd};
use crate::spec::{Activation, Norm, Spec};

/// The runtime's activation type for a spec's activation.
pub fn activation_type(a: Activation) -> TokenStream {
    let rt = rt();
    let name = format_ident!("{}", a.name());
    quote!(#rt::activation::#name)
}

/// Whether the kernels read the input from an accumulator-typed, zero-bordered copy.
pub fn staged(spec: &Spec) -> bool {
    spec.has_padding() || spec.dtype.is_half()
}

/// Layout identifiers of packed copies: different layers whose weights share a stamp (clones)
/// share a packed copy only when its layout is the same.
pub fn layout_id(spec: &Spec, kind: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let dims = [
        spec.out_channels,
        spec.kernel[0],
        spec.kernel[1],
        spec.in_c(),
        spec.dtype.lanes(),
    ];
    for n in dims.into_iter().map(|d| d as u64).chain([kind]) {
        h = (h ^ n).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

pub fn expand(spec: &Spec) -> TokenStream {
    let t = elem(spec.dtype);
    let a = acc(spec.dtype);
    let blk = Blocking::new(spec.dtype, spec.out_channels);
    let consts = constants(spec, &blk);
    // Stride-1 3x3 and stride-2 4x4 layers with enough channels run on Winograd kernels, the
    // rest on direct ones.
    let (forward_kernel, stage, backward) = if let Some(plan) = winograd::plan(spec) {
        (
            winograd::forward(spec, plan),
            TokenStream::new(),
            winograd::backward(spec, plan),
        )
    } else if dense::applies(spec) {
        (dense::expand(spec), TokenStream::new(), TokenStream::new())
    } else {
        (
            forward_kernel(spec, &blk),
            stage_fn(spec),
            backward::expand(spec),
        )
    };
    let norm = norm::expand(spec);
    let ops = operations(spec);
    let onednn = onednn::expand(spec);
    quote! {
        // Literal arithmetic (`x % 1`, `0 * n`, ...) and index loops over literal bounds are the
        // point of specializing, not style problems of the user's crate.
        #[allow(clippy::all)]
        const _: () = {
            type __T = #t;
            type __A = #a;
            #consts
            #stage
            #forward_kernel
            #backward
            #norm
            #ops
            #onednn
        };
    }
}

/// The spec's numbers as constants of the generated block.
fn constants(spec: &Spec, blk: &Blocking) -> TokenStream {
    let window = spec.kernel[0] * spec.kernel[1] * spec.in_c();
    let derived = [
        ("XH", spec.padded_h()),
        ("XW", spec.padded_w()),
        ("NPIX", spec.out_h() * spec.out_w()),
        ("L", blk.lanes),
        ("P", blk.p),
        ("OCP", blk.padded()),
        ("WINDOW", window),
        ("BIAS_OFFSET", window * blk.padded()),
        ("PACKED_LEN", window * blk.padded() + blk.padded()),
    ];
    let pairs: Vec<_> = spec.sizes().into_iter().chain(derived).collect();
    usize_consts(&pairs)
}

/// `stage(pool, x, xa)`: the input in the accumulator type with a zero border, where the
/// kernels need a copy (padding or a half type), the images shared among the workers.
fn stage_fn(spec: &Spec) -> TokenStream {
    let rt = rt();
    if staged(spec) {
        quote! {
            const __STAGED: bool = true;
            /// Copies `B` images into `xa` (`B * XH * XW * IC`) inside a zero border.
            fn __stage<const __B: usize>(pool: &#rt::Pool, x: &[__T], xa: &mut [__A]) {
                let xa = #rt::Shared::new(xa);
                pool.each(__B, __B * __XH * __XW * __IC * #rt::ELEMENT_WORK, &|n| {
                    {
                        // SAFETY: each image is one part's.
                        let image = unsafe { xa.part(n * __XH * __XW * __IC, __XH * __XW * __IC) };
                        if __PH + __PW > 0 {
                            image.fill(0.0);
                        }
                        for h in 0..__IH {
                            let src = &x[(n * __IH + h) * __IW * __IC..][..__IW * __IC];
                            let dst = &mut image[((h + __PH) * __XW + __PW) * __IC..][..__IW * __IC];
                            <__T as #rt::Element>::to_acc_slice(src, dst);
                        }
                    }
                });
            }
        }
    } else {
        quote! {
            const __STAGED: bool = false;
        }
    }
}

/// The forward convolution: `conv::<B, RELU>(cpu, layer, x, ya, epilogue, then)`.
fn forward_kernel(spec: &Spec, blk: &Blocking) -> TokenStream {
    let xs_array = array_by_loop(
        quote!(__P),
        quote!(::core::ptr::null::<__A>()),
        "p",
        quote!({
            let q = if q0 + p < total { q0 + p } else { total - 1 };
            let (n, r) = (q / __NPIX, q % __NPIX);
            let (oh, ow) = (r / __OW, r % __OW);
            x.add(((n * __XH + oh * __SH) * __XW + ow * __SW) * __IC)
        }),
    );
    let rt = rt();
    let layer = &spec.ident;
    let block_calls = blk.calls("tile", true, |tile, first| {
        quote! {
            #tile::<__S>(&xs, w.add(__WINDOW * #first), w.add(__BIAS_OFFSET + #first), out.add(#first), relu);
        }
    });
    let block = lit(blk.v * blk.lanes);
    let tiles = blk
        .kinds()
        .into_iter()
        .map(|(nv, last)| forward_tile(spec, blk, nv, last));
    let layout = layout_id(spec, 1);
    let staged_len = if staged(spec) {
        quote!(__B * __XH * __XW * __IC)
    } else {
        quote!(0)
    };
    let stage_call = if staged(spec) {
        quote! {
            let (xa, rest) = ws.scratch.split_at_mut(__B * __XH * __XW * __IC);
            if !sparse {
                __stage::<{ __B }>(pool, x, xa);
            }
            let xa: &[__A] = xa;
        }
    } else {
        quote!(let (xa, rest): (&[__A], &mut [__A]) = (x, ws.scratch);)
    };

    let dense_call = quote! {
        let tail = tails.part(range.start * __P * __OC, __P * __OC);
        __conv_tiles(xa, w, ya, tail, epilogue, then, first..end, __RELU);
    };
    let scatter_test = scatter::test(spec);
    let (scatter, tiles_call) = if scatter::applies(spec) {
        (
            scatter::forward(spec, blk),
            quote! {
                if sparse {
                    #[cfg(target_arch = "x86_64")]
                    __scatter_tiles(x, w, ya, epilogue, then, first..end, __RELU);
                } else {
                    #dense_call
                }
            },
        )
    } else {
        (TokenStream::new(), quote!(let _ = sparse; #dense_call))
    };
    let finished = tile_finished();
    let kernel = dispatched(
        spec.dtype,
        "conv_tiles",
        TokenStream::new(),
        TokenStream::new(),
        quote! {
            x: &[__A], w: &[__A], y: #rt::Shared<'_, __A>, tail: &mut [__A],
            epilogue: &(dyn ::core::ops::Fn(&mut [__A], usize, usize) + ::core::marker::Sync),
            then: &(dyn ::core::ops::Fn(usize, usize) + ::core::marker::Sync),
            tiles: ::core::ops::Range<usize>, relu: bool,
        },
        quote!(x, w, y, tail, epilogue, then, tiles, relu),
        quote! {
            // The batch and the ReLU are arguments, not constants: one instantiation serves
            // every call of the layer.
            let total = y.len() / __OC;
            ::core::debug_assert!(x.len() >= total / __NPIX * __XH * __XW * __IC && w.len() == __PACKED_LEN);
            ::core::debug_assert!(total % __NPIX == 0 && tail.len() == __P * __OC);
            let (x, w) = (x.as_ptr(), w.as_ptr());
            // `then` hears of finished pixels a map row at a time (`tile_finished`).
            let (mut reported, last) = (tiles.start * __P, tiles.end);
            for tile in tiles {
                let q0 = tile * __P;
                let valid = if total - q0 < __P { total - q0 } else { __P };
                // SAFETY: the tiles of the workers are disjoint.
                let yt = y.part(q0 * __OC, valid * __OC);
                // Pixels past the end of a partial tile repeat the last one; their results go
                // to `tail` and are dropped.
                let xs: [*const __A; __P] = #xs_array;
                let out: *mut __A = if valid == __P { yt.as_mut_ptr() } else { tail.as_mut_ptr() };
                #block_calls
                if valid < __P {
                    yt.copy_from_slice(&tail[..valid * __OC]);
                }
                #finished
            }
        },
    );

    quote! {
        /// Convolution + bias of `B` images into `ya` (accumulator type; `None`: scratch), with
        /// `epilogue(tile results, first pixel, pixels)` run on each finished tile while it is
        /// in cache, on the device's threads (tiles of `P` pixels dealt in contiguous ranges),
        /// then `then(first pixel, pixels)` once they are final, a map row at a time (pooling
        /// fused into `evaluate`). `RELU` applies ReLU in registers.
        #[inline(always)]
        fn __conv<const __B: usize, const __RELU: bool>(
            cpu: &mut #rt::Cpu,
            layer: &#layer,
            x: &[__T],
            ya: ::core::option::Option<#rt::Shared<'_, __A>>,
            epilogue: &(dyn ::core::ops::Fn(&mut [__A], usize, usize) + ::core::marker::Sync),
            then: &(dyn ::core::ops::Fn(usize, usize) + ::core::marker::Sync),
        ) {
            let key = #rt::PackKey {
                stamps: [layer.weights.stamp(), layer.biases.stamp()],
                layout: #layout,
            };
            // One part per worker: every output pixel is computed alone, so the partition does
            // not change the results.
            let (tiles, work) = ((__B * __NPIX).div_ceil(__P), __B * __NPIX * __WINDOW * __OCP);
            let parts = cpu.__pool().workers(tiles, work);
            let y_scratch = if ya.is_some() { 0 } else { __B * __NPIX * __OC };
            let ws = cpu.__workspace::<__A>(
                key,
                __PACKED_LEN,
                |pool, out| __pack(pool, layer.weights.as_slice(), layer.biases.as_slice(), out),
                #staged_len + parts * __P * __OC + y_scratch,
            );
            let (w, pool) = (ws.packed, ws.pool);
            // Mostly zero inputs take the scatter pass: the same results (`expand::scatter`).
            let sparse = __scattered(x);
            #stage_call
            let (tails, rest) = rest.split_at_mut(parts * __P * __OC);
            let ya = match ya {
                ::core::option::Option::Some(y) => y,
                ::core::option::Option::None => #rt::Shared::new(&mut rest[..__B * __NPIX * __OC]),
            };
            let tails = #rt::Shared::new(tails);
            pool.run(parts, work, &|_, range| {
                let first = range.start * tiles / parts;
                let end = range.end * tiles / parts;
                // SAFETY: each worker has its own tail (`range` is its own), the tile ranges are
                // disjoint, every slice has the length the kernel is built on (checked in debug).
                unsafe {
                    #tiles_call
                }
            });
        }

        #kernel
        #scatter_test
        #scatter

        /// OHWI weights -> `[block][kh][kw][ic][lanes]`, zero-padded, then the biases, the
        /// blocks dealt to the workers (each a contiguous run written in order, from `width`
        /// rows of the weights read in order). Runs once per parameter change.
        fn __pack(pool: &#rt::Pool, w: &[__T], b: &[__T], out: &mut [__A]) {
            use #rt::Element as _;
            const __BLOCKS: usize = __OCP.div_ceil(#block);
            let biases = &mut out[__BIAS_OFFSET..];
            for (o, b) in biases.iter_mut().zip(b) {
                *o = b.to_acc();
            }
            biases[__OC..].fill(0.0);
            let shared = #rt::Shared::new(&mut out[..__BIAS_OFFSET]);
            pool.split(__BLOCKS, __WINDOW * #block * 2, &|blocks| {
                for block in blocks {
                    // Full blocks are `BLOCK` wide, the last one may be less.
                    let first = block * #block;
                    let width = if __OCP - first < #block { __OCP - first } else { #block };
                    let real = if __OC - first < width { __OC - first } else { width };
                    // SAFETY: the block's run is this worker's alone.
                    let dst = unsafe { shared.part(__WINDOW * first, __WINDOW * width) };
                    for (k, row) in dst.chunks_exact_mut(width).enumerate() {
                        for (lane, d) in row[..real].iter_mut().enumerate() {
                            *d = w[(first + lane) * __WINDOW + k].to_acc();
                        }
                        row[real..].fill(0.0);
                    }
                }
            });
        }

        #(#tiles)*
    }
}

/// A forward tile's end in a tile loop (`__conv_tiles`, `__scatter_tiles`): `epilogue` on the
/// tile's `valid` pixels `yt` from `q0`, then `then` told of the finished pixels a map row at a
/// time (where a tile reaches or crosses a row's end) and at the range's end (`last` tiles),
/// one report per row, not per tile.
pub fn tile_finished() -> TokenStream {
    quote! {
        epilogue(yt, q0, valid);
        let end = q0 + valid;
        if end / __OW != reported / __OW || tile + 1 == last {
            then(reported, end - reported);
            reported = end;
        }
    }
}

/// One `P x nv` forward tile: accumulators start at the biases, run over the window, and are
/// stored (ReLU applied in registers when `RELU`).
fn forward_tile(spec: &Spec, blk: &Blocking, nv: usize, last_lanes: usize) -> TokenStream {
    let rt = rt();
    let name = format_ident!("__tile_{}_{}", nv, last_lanes);
    let (p, l) = (blk.p, blk.lanes);
    let width = lit(nv * l);
    let init = init_accumulators(p, nv, |_, v| {
        let off = lit(v * l);
        quote!(__S::load(bias.add(#off)))
    });
    let step = fma_step(
        p,
        nv,
        |i| {
            let i = lit(i);
            quote!(*rows[#i].add(j))
        },
        |v| {
            let off = lit(v * l);
            quote!(wr.add(j * #width + #off))
        },
    );
    let stores = write_accumulators(p, nv, l, last_lanes, |acc, i, v, partial| {
        let off = lit(i * spec.out_channels + v * l);
        let store = match partial {
            Some(n) => {
                let n = lit(n);
                quote!(#acc.store_partial(y.add(#off), #n);)
            }
            None => quote!(#acc.store(y.add(#off));),
        };
        quote! {
            if relu { #acc = #acc.max(__S::zero()); }
            #store
        }
    });
    let rows = (0..p).map(lit);
    quote! {
        #[inline(always)]
        unsafe fn #name<__S: #rt::Simd<Elem = __A>>(
            xs: &[*const __A; __P], w: *const __A, bias: *const __A, y: *mut __A, relu: bool,
        ) {
            #init
            for kh in 0..__KH {
                let rows: [*const __A; __P] = [#(xs[#rows].add(kh * __XW * __IC)),*];
                let wr = w.add(kh * __KW * __IC * #width);
                for j in 0..__KW * __IC {
                    #step
                }
            }
            #stores
        }
    }
}

/// The `Cpu` device's implementation of the layer's operations.
fn operations(spec: &Spec) -> TokenStream {
    let rt = rt();
    let half = spec.dtype.is_half();
    let act = activation_type(spec.activation);
    let apply = quote!(#rt::activation::apply::<#act, _>);
    let f = quote!(<#act as #rt::Activation>::f);
    // Rounds accumulator values into element-typed storage.
    let store = if half {
        quote!(<__T as #rt::Element>::from_acc_slice)
    } else {
        quote!((|src: &[__A], dst: &mut [__T]| dst.copy_from_slice(src)))
    };
    let relu = spec.activation == Activation::Relu;

    // Epilogues run on the device's threads, each on its own tiles: outputs are written
    // through `Shared` slices, in the tiles' disjoint pixel ranges.
    let part = quote!(unsafe { out.part(q0 * __OC, n * __OC) });
    let aliased = super::output_is_pre_activation(spec);
    // `evaluate`'s body, each tile handed to `then` (`None`: plain `evaluate`) once final.
    let evaluate = |then: Option<TokenStream>| {
        let done = then.map_or(
            quote!(&|_, _| {}),
            |then| quote!(&|q0, n| #then(&out, q0, n)),
        );
        match spec.norm {
            Norm::None if half => quote! {
                let out = #rt::Shared::new(output.as_mut_slice());
                __conv::<{ __B }, #relu>(self, layer, input.as_slice(), ::core::option::Option::None, &|ya, q0, n| {
                    if !#relu { #apply(ya); }
                    // SAFETY: the tile's own pixels.
                    #store(ya, #part);
                }, #done);
            },
            Norm::None => quote! {
                // The tiles are the output itself: the activation runs in place, in cache.
                let out = #rt::Shared::new(output.as_mut_slice());
                __conv::<{ __B }, #relu>(self, layer, input.as_slice(), ::core::option::Option::Some(out), &|ya, _, _| {
                    if !#relu { #apply(ya); }
                }, #done);
            },
            Norm::BatchNorm { .. } => quote! {
                // Running statistics fold into one scale and shift per channel, applied to
                // each tile while it is in cache.
                let (scale, shift) = __eval_affine(layer);
                let out = #rt::Shared::new(output.as_mut_slice());
                __conv::<{ __B }, false>(self, layer, input.as_slice(), ::core::option::Option::None, &|ya, q0, n| {
                    for px in ya.chunks_exact_mut(__OC) {
                        for c in 0..__OC {
                            px[c] = #f(px[c] * scale[c] + shift[c]);
                        }
                    }
                    // SAFETY: the tile's own pixels.
                    #store(ya, #part);
                }, #done);
            },
            Norm::LayerNorm { .. } => quote! {
                let out = #rt::Shared::new(output.as_mut_slice());
                __conv::<{ __B }, false>(self, layer, input.as_slice(), ::core::option::Option::None, &|ya, q0, n| {
                    // SAFETY: the tile's own pixels.
                    #store(ya, #part);
                }, &|_, _| {});
                __evaluate_norm(self.__pool(), layer, output.as_mut_slice());
            },
        }
    };
    let forward = match spec.norm {
        Norm::None if half => quote! {
            let pre = #rt::Shared::new(state.pre_activation.as_mut_slice());
            let out = #rt::Shared::new(state.output.as_mut_slice());
            __conv::<{ __BATCH }, false>(self, layer, input.as_slice(), ::core::option::Option::None, &|ya, q0, n| {
                // SAFETY: the tile's own pixels.
                #store(ya, unsafe { pre.part(q0 * __OC, n * __OC) });
                #apply(ya);
                #store(ya, #part);
            }, &|_, _| {});
        },
        Norm::None => quote! {
            let out = #rt::Shared::new(state.output.as_mut_slice());
            __conv::<{ __BATCH }, false>(self, layer, input.as_slice(), ::core::option::Option::Some(#rt::Shared::new(state.pre_activation.as_mut_slice())), &|ya, q0, n| {
                // SAFETY: the tile's own pixels.
                #rt::activation::apply_to::<#act, _>(ya, #part);
            }, &|_, _| {});
        },
        Norm::BatchNorm { .. } | Norm::LayerNorm { .. } => quote! {
            __conv_to_state(self, layer, input.as_slice(), state);
            __norm_forward(self.__pool(), layer, state, mode);
        },
    };
    // Without an activation or norm the state's one map is output and pre-activation: the
    // forward pass writes it as `evaluate` writes its output.
    let forward = match (aliased, half) {
        (false, _) => forward,
        (true, true) => quote! {
            let out = #rt::Shared::new(state.output.as_mut_slice());
            __conv::<{ __BATCH }, false>(self, layer, input.as_slice(), ::core::option::Option::None, &|ya, q0, n| {
                // SAFETY: the tile's own pixels.
                #store(ya, #part);
            }, &|_, _| {});
        },
        (true, false) => quote! {
            __conv::<{ __BATCH }, false>(self, layer, input.as_slice(), ::core::option::Option::Some(#rt::Shared::new(state.output.as_mut_slice())), &|_, _, _| {}, &|_, _| {});
        },
    };

    let some = quote!(::core::option::Option::Some);
    let none = quote!(::core::option::Option::None);
    let ok = quote!(::core::result::Result::Ok(()));
    // LayerNorm's statistics need the whole image: its tiles are final only after it.
    let evaluate_then = match spec.norm {
        Norm::LayerNorm { .. } => TokenStream::new(),
        _ => {
            let signature = super::types::evaluate_then_signature(spec);
            let body = evaluate(Some(quote!(then)));
            quote! {
                #signature {
                    #body
                    ::core::result::Result::Ok(true)
                }
            }
        }
    };
    let evaluate = evaluate(None);
    super::types::device_impl_with(
        spec,
        quote!(#rt::Cpu),
        |method| match method {
            "evaluate" => quote! {
                #evaluate
                #ok
            },
            "forward" => quote! {
                let _ = mode;
                #forward
                #ok
            },
            "backward_input" => quote! {
                __backward_pass(self, layer, state, &[], d_output.as_slice(), #some(d_input.as_mut_slice()), #none, mode);
                #ok
            },
            "backward" => quote! {
                __backward_pass(self, layer, state, input.as_slice(), d_output.as_slice(), #none, #some(grads), mode);
                #ok
            },
            _ => quote! {
                __backward_pass(self, layer, state, input.as_slice(), d_output.as_slice(), #some(d_input.as_mut_slice()), #some(grads), mode);
                #ok
            },
        },
        evaluate_then,
    )
}
