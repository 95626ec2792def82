//! Generated CPU code: a direct convolution's forward pass and weight gradient over the nonzero
//! inputs only, for inputs that are mostly zeros (a binary game screen: MinAtar's states are
//! about 8% ones). Each nonzero input is scattered into the outputs (or weight-gradient rows)
//! it reaches, with the tile kernels' own operation per term.
//!
//! The sums are the tile kernels' own, in their order: an output starts at its bias and adds
//! its window's terms in `(kh, kw, ic)` order, a weight-gradient row starts at zero and adds
//! the pixels' terms in pixel order; inputs visited in `(image, ih, iw, ic)` order reach every
//! output, and every row, in exactly that order. A zero input's term, `0 * w`, is an exact zero
//! where `w` is finite, and adding it changes no sum (only the sign of a zero bias), so skipping
//! it gives the same bits. Which pass runs is a per-call choice on the input's density
//! ([`SHARE`]): the results are the same either way.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::kernel::Blocking;
use super::{lit, rt};
use crate::spec::{Dtype, Spec};

/// The scatter runs where at most `1 / SHARE` of the input's values are nonzero (of its first
/// `SAMPLE`: the test is a few percent of the pass where it reads them all). Each nonzero input
/// costs a load, a multiply-add and a store per output vector it reaches, where the tile
/// kernels' multiply-adds stay in registers: MinAtar's layer at batch 32 (AMD Zen 4, one
/// thread) evaluates in 11.7-14.4 us against 22.3-22.7 us at 5% ones, 17.5-17.7 us at 10%,
/// and the two are even at 15%.
const SHARE: usize = 8;
const SAMPLE: usize = 4096;

/// Whether a direct convolution has the scatter passes: f32 (the runtime's density test reads
/// f32; half inputs are staged into f32 copies first, where a scatter would gain little).
pub fn applies(spec: &Spec) -> bool {
    spec.dtype == Dtype::F32
}

/// `__scattered(x)`: whether this call's input takes the scatter passes (always `false` where
/// they are not generated).
pub fn test(spec: &Spec) -> TokenStream {
    let rt = rt();
    if applies(spec) {
        let (share, sample) = (lit(SHARE), lit(SAMPLE));
        quote! {
            /// Whether `x` is sparse enough for the scatter passes (see `__scatter_tiles`).
            #[inline(always)]
            fn __scattered(x: &[__T]) -> bool {
                let x = &x[..if x.len() < #sample { x.len() } else { #sample }];
                ::core::cfg!(target_arch = "x86_64")
                    && #rt::avx2_fma()
                    && #rt::wide::nonzero_at_most(x, x.len() / #share)
            }
        }
    } else {
        quote! {
            #[inline(always)]
            fn __scattered(x: &[__T]) -> bool {
                let _ = x;
                false
            }
        }
    }
}

/// `unsafe fn name(params) { body }` on the AVX2 vectors, for x86-64 only: elsewhere, and where
/// the portable kernels run, `__scattered` is always `false` (a portable copy of each pass
/// would cost every layer's build for CPUs that gain little from it).
fn avx2_only(name: &str, params: TokenStream, body: TokenStream) -> TokenStream {
    let rt = rt();
    let name = format_ident!("__{}", name);
    quote! {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn #name(#params) {
            use #rt::Simd as _;
            type __S = #rt::simd::Avx2F32;
            #body
        }
    }
}

/// `body` for every term of the nonzero inputs of images `images` of `x` (unpadded NHWC), the
/// inputs in order: `xs` the input broadcast, `q` the output pixel, `k` the window position.
/// Each input row's nonzero values are found by a mask, 64 values at a time.
fn each_nonzero(images: TokenStream, body: TokenStream) -> TokenStream {
    quote! {
        const __ROW: usize = __IW * __IC;
        for n in #images {
            for ih in 0..__IH {
                let row = x.add((n * __IH + ih) * __ROW);
                let mut j0 = 0;
                while j0 < __ROW {
                    let count = if __ROW - j0 < 64 { __ROW - j0 } else { 64 };
                    let mut mask = 0u64;
                    for j in 0..count {
                        mask |= ((*row.add(j0 + j) != 0.0) as u64) << j;
                    }
                    while mask != 0 {
                        let j = j0 + mask.trailing_zeros() as usize;
                        mask &= mask - 1;
                        let (iw, ic, value) = (j / __IC, j % __IC, *row.add(j));
                        let xs = __S::splat(value);
                        // The outputs (oh, ow) whose window holds the input at (kh, kw).
                        for kh in 0..__KH {
                            let th = ih + __PH;
                            if th < kh || (th - kh) % __SH != 0 || (th - kh) / __SH >= __OH {
                                continue;
                            }
                            let oh = (th - kh) / __SH;
                            for kw in 0..__KW {
                                let tw = iw + __PW;
                                if tw < kw || (tw - kw) % __SW != 0 || (tw - kw) / __SW >= __OW {
                                    continue;
                                }
                                let ow = (tw - kw) / __SW;
                                let q = n * __NPIX + oh * __OW + ow;
                                let k = (kh * __KW + kw) * __IC + ic;
                                #body
                            }
                        }
                    }
                    j0 += 64;
                }
            }
        }
    }
}

/// `__scatter_tiles(x, w, y, epilogue, then, tiles, relu)`: `__conv_tiles` over the nonzero
/// inputs (`x` unpadded, `w` the tile kernels' packed weights), then each tile's ReLU,
/// epilogue and report as `__conv_tiles` runs them.
pub fn forward(spec: &Spec, blk: &Blocking) -> TokenStream {
    let rt = rt();
    let l = blk.lanes;
    let lanes_of = |u: usize| (spec.out_channels - u * l).min(l);
    let load = |u: usize, ptr: TokenStream| {
        let (off, n) = (lit(u * l), lanes_of(u));
        if n == l {
            quote!(__S::load(#ptr.add(#off)))
        } else {
            let n = lit(n);
            quote!(__S::load_partial(#ptr.add(#off), #n))
        }
    };
    let store = |u: usize, value: TokenStream, ptr: TokenStream| {
        let (off, n) = (lit(u * l), lanes_of(u));
        if n == l {
            quote!(#value.store(#ptr.add(#off));)
        } else {
            let n = lit(n);
            quote!(#value.store_partial(#ptr.add(#off), #n);)
        }
    };
    let bias_stores = (0..blk.vectors).map(|u| {
        let b = load(u, quote!(bias));
        store(u, b, quote!(yq))
    });
    // Vector `u` of window position `k` in the packed weights: its block's run, `k` rows of
    // the block's width into it.
    let fmas = (0..blk.vectors).map(|u| {
        let first = u / blk.v * blk.v;
        let width = blk.v.min(blk.vectors - first) * l;
        let base = lit(spec.kernel[0] * spec.kernel[1] * spec.in_c() * first * l + (u - first) * l);
        let width = lit(width);
        let acc = load(u, quote!(yq));
        let sum = quote!(__S::fma(xs, __S::load(w.add(#base + k * #width)), #acc));
        store(u, sum, quote!(yq))
    });
    let scatter = each_nonzero(
        quote!(q_first / __NPIX..(q_end - 1) / __NPIX + 1),
        quote! {
            if q < q_first || q >= q_end {
                continue;
            }
            let yq = yr.add((q - q_first) * __OC);
            #(#fmas)*
        },
    );
    let finished = super::cpu::tile_finished();
    let kernel = avx2_only(
        "scatter_tiles",
        quote! {
            x: &[__A], w: &[__A], y: #rt::Shared<'_, __A>,
            epilogue: &(dyn ::core::ops::Fn(&mut [__A], usize, usize) + ::core::marker::Sync),
            then: &(dyn ::core::ops::Fn(usize, usize) + ::core::marker::Sync),
            tiles: ::core::ops::Range<usize>, relu: bool,
        },
        quote! {
            let total = y.len() / __OC;
            ::core::debug_assert!(x.len() >= total / __NPIX * __IH * __IW * __IC && w.len() == __PACKED_LEN);
            let q_first = tiles.start * __P;
            let q_end = if tiles.end * __P < total { tiles.end * __P } else { total };
            if q_first >= q_end {
                return;
            }
            let (x, w) = (x.as_ptr(), w.as_ptr());
            {
                // SAFETY: the tiles of the workers are disjoint.
                let yr = y.part(q_first * __OC, (q_end - q_first) * __OC).as_mut_ptr();
                let bias = w.add(__BIAS_OFFSET);
                for q in 0..q_end - q_first {
                    let yq = yr.add(q * __OC);
                    #(#bias_stores)*
                }
                #scatter
            }
            let (mut reported, last) = (tiles.start * __P, tiles.end);
            for tile in tiles {
                let q0 = tile * __P;
                let valid = if total - q0 < __P { total - q0 } else { __P };
                // SAFETY: as above; the scatter's slice is no longer used.
                let yt = y.part(q0 * __OC, valid * __OC);
                if relu {
                    let p = yt.as_mut_ptr();
                    let mut i = 0;
                    while i + __L <= yt.len() {
                        __S::load(p.add(i)).max(__S::zero()).store(p.add(i));
                        i += __L;
                    }
                    if i < yt.len() {
                        let n = yt.len() - i;
                        __S::load_partial(p.add(i), n).max(__S::zero()).store_partial(p.add(i), n);
                    }
                }
                #finished
            }
        },
    );
    quote! {
        /// `__conv_tiles` over the nonzero inputs of `x` (unpadded): each one's terms added to
        /// the outputs it reaches, in the tile kernels' order (see `expand::scatter`).
        #kernel
    }
}

/// `__scatter_weights(x, dz, dw, blocks)`: `__weight_tiles` over the nonzero inputs (`x`
/// unpadded): the worker's rows of window positions zeroed, then each nonzero input's terms
/// added to the rows it reaches.
pub fn weights(blk: &Blocking) -> TokenStream {
    let rt = rt();
    let l = lit(blk.lanes);
    let fmas = (0..blk.vectors).map(|u| {
        let off = lit(u);
        quote! {
            let (a, b) = (dwr.add(#off * #l), dzq.add(#off * #l));
            __S::fma(xs, __S::load(b), __S::load(a)).store(a);
        }
    });
    let scatter = each_nonzero(
        quote!(0..__BATCH),
        quote! {
            if k < first_row || k >= end_row {
                continue;
            }
            let (dwr, dzq) = (dw.add((k - first_row) * __OCP), dz.add(q * __OC));
            #(#fmas)*
        },
    );
    let kernel = avx2_only(
        "scatter_weights",
        quote!(x: &[__A], dz: &[__A], dw: #rt::Shared<'_, __A>, blocks: ::core::ops::Range<usize>),
        quote! {
            ::core::debug_assert!(x.len() >= __BATCH * __IH * __IW * __IC);
            ::core::debug_assert!(dz.len() >= __BATCH * __NPIX * __OC + (__OCP - __OC) && dw.len() == (__WINDOW + 1) * __OCP);
            let first_row = blocks.start * __WP;
            let end_row = if blocks.end * __WP < __WINDOW { blocks.end * __WP } else { __WINDOW + 1 };
            let rows = dw.part(first_row * __OCP, (end_row - first_row) * __OCP);
            rows.fill(0.0);
            let (x, dz, dw) = (x.as_ptr(), dz.as_ptr(), rows.as_mut_ptr());
            #scatter
        },
    );
    quote! {
        /// `__weight_tiles` over the nonzero inputs of `x` (unpadded): each one's terms added
        /// to the rows of window positions it reaches, in pixel order (see `expand::scatter`).
        #kernel
    }
}
