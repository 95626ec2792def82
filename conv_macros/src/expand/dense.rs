//! Generated CPU code for dense layers: a 1x1 convolution of a 1x1 map (`network!`'s `Dense`,
//! and any `conv2d!` spec of that shape), computed on the weights as they are (`[out][in]`,
//! which is OHWI here) instead of repacked:
//!
//! - forward: `y[b][o] = bias[o] + x[b] . w[o]`, dot products along the inputs in vectors,
//!   `ROWS x COLS` of them per register tile, each summed across lanes once at the end (on
//!   AVX-512, two per zmm register in larger tiles, `conv_runtime::wide::dense`: the same
//!   bits); where rows of `x` share the L1 cache's sets, each tile's rows are first copied
//!   side by side (`conv_runtime::packed_rows`); where they are mostly zeros (after a ReLU) and
//!   the weights are used unchanged (a target network's, inference), over their nonzero
//!   inputs only, on a transposed copy of the weights (`conv_runtime::wide::sparse`: the same
//!   bits);
//! - input gradient: `dx[b] = sum_o dz[b][o] w[o]`, rows of `w` scaled and added in vectors;
//! - weight gradient: `dw[o] += sum_b dz[b][o] x[b]`, likewise, straight into the gradient
//!   (both gradients, on AVX-512, in tiles four times as wide, `conv_runtime::wide::axpys`: the
//!   same bits).
//!
//! The gradients skip the terms whose output gradient is zero, where they are most of a register
//! tile's: after a ReLU (or a loss on one action per row) most are, and each adds an exact zero.
//! The skipped sums are the same sums in the same order.
//!
//! No repack per parameter change and no transposed copy of the weight gradient: a dense
//! layer's weights are most of a small network's, and each step changes them. Every sum runs
//! in a fixed order (inputs, output channels or batch rows ascending), whatever the partition:
//! forward and input gradient by batch rows, weight gradient by output channels; or, where the
//! weights are owned (`__OWNED`), every pass by whole chunks of output channels, the input
//! gradient's chunks added in chunk order.
//!
//! Used for f32 and f64 layers (half-precision layers keep the direct kernels, which stage
//! their input in f32).

use proc_macro2::TokenStream;
use quote::{quote, ToTokens};

use super::kernel::dispatched;
use super::{lit, rt};
use crate::spec::{Dtype, Spec};

/// Whether a spec runs on these kernels.
pub fn applies(spec: &Spec) -> bool {
    spec.in_h() == 1
        && spec.in_w() == 1
        && spec.kernel == [1, 1]
        && spec.padding == [0, 0]
        && matches!(spec.dtype, Dtype::F32 | Dtype::F64)
}

/// Rows and output channels of a forward register tile (dot products in flight: with their
/// rows' input vectors and one weight vector, 16 registers).
const ROWS: usize = 3;
const COLS: usize = 4;
/// Output channels of a forward tile over one row (one action): each is a stream of weights
/// from memory, and eight in flight read them about a tenth faster than four.
const WIDE: usize = 8;
/// Output channels per part where a forward pass has too few rows for the threads: a multiple
/// of `COLS` and `WIDE`, so that every part but the last takes whole tiles.
const CBLOCK: usize = 8 * COLS;
/// Rows (or output channels) and input vectors of a gradient register tile: 12 accumulators,
/// the rows' broadcasts and one vector of the other operand, 16 registers.
const TILE_ROWS: usize = 3;
const VECS: usize = 4;
/// Terms (channels, or batch rows) of a gradient's stripe: the bits of a mask.
const CHUNK: usize = 64;
/// The most masks of nonzero gradient terms a kernel keeps (on its stack: 32 KiB).
const MASK_CAP: usize = 4096;

/// `__conv` (the direct and Winograd kernels' signature) and `__backward_pass`.
pub fn expand(spec: &Spec) -> TokenStream {
    let rt = rt();
    let layer = &spec.ident;
    let (rows, cols, vecs, tile_rows) = (lit(ROWS), lit(COLS), lit(VECS), lit(TILE_ROWS));
    let cblock = lit(CBLOCK);
    let mask_cap = lit(MASK_CAP);
    let chunk = lit(CHUNK);
    // The register tiles, generic over their size so that edges take smaller ones; every loop
    // bound is a constant, so each instantiation is straight-line code around the `k` loop.
    let tiles = quote! {
        /// `R x C` dot products of rows of `x` (`IC` apart, or packed by
        /// `packed_rows::pack` where `P`) and rows of `w`, across lanes.
        #[inline(always)]
        unsafe fn __dense_dots<__S: #rt::Simd<Elem = __A>, const __R: usize, const __C: usize, const __P: bool>(
            x: *const __A, w: *const __A,
        ) -> [[__A; __C]; __R] {
            let mut acc = [[__S::zero(); __C]; __R];
            let mut k = 0;
            while k + __L <= __IC {
                let mut xv = [__S::zero(); __R];
                for r in 0..__R {
                    xv[r] = if __P { __S::load(x.add((k / __L * __R + r) * __L)) } else { __S::load(x.add(r * __IC + k)) };
                }
                for c in 0..__C {
                    let wv = __S::load(w.add(c * __IC + k));
                    for r in 0..__R {
                        acc[r][c] = __S::fma(xv[r], wv, acc[r][c]);
                    }
                }
                k += __L;
            }
            if k < __IC {
                let n = __IC - k;
                let mut xv = [__S::zero(); __R];
                for r in 0..__R {
                    // Packed rows hold zeros past `IC`, as the partial load reads them.
                    xv[r] = if __P { __S::load(x.add((k / __L * __R + r) * __L)) } else { __S::load_partial(x.add(r * __IC + k), n) };
                }
                for c in 0..__C {
                    let wv = __S::load_partial(w.add(c * __IC + k), n);
                    for r in 0..__R {
                        acc[r][c] = __S::fma(xv[r], wv, acc[r][c]);
                    }
                }
            }
            // Summed side by side (the same bits as one by one), and without closures: they
            // would not take on the kernel's target features.
            let mut dots = [[0.0 as __A; __C]; __R];
            // SAFETY: arrays of arrays are contiguous: `R * C` vectors and as many values.
            let (acc, out) = (
                ::core::slice::from_raw_parts(acc.as_ptr() as *const __S, __R * __C),
                ::core::slice::from_raw_parts_mut(dots.as_mut_ptr() as *mut __A, __R * __C),
            );
            __S::sums(acc, out);
            dots
        }

        /// `put(r, c, dot)` for a tile of [`__dense_dots`].
        #[inline(always)]
        unsafe fn __dense_tile<__S: #rt::Simd<Elem = __A>, const __R: usize, const __C: usize, const __P: bool>(
            x: *const __A, w: *const __A, put: &mut impl ::core::ops::FnMut(usize, usize, __A),
        ) {
            let d = __dense_dots::<__S, { __R }, { __C }, { __P }>(x, w);
            for r in 0..__R {
                for c in 0..__C {
                    put(r, c, d[r][c]);
                }
            }
        }

        /// Copies `v[j][k0..k0 + V * L]` of `terms` rows (`IC` apart) into `stripe` (zeros past
        /// `IC`): rows `IC` apart share cache sets (4 KiB apart for 1024 f32 inputs), the stripe
        /// does not.
        #[inline(always)]
        unsafe fn __dense_stripe<const __V: usize>(v: *const __A, terms: usize, k0: usize, stripe: &mut [__A]) {
            let n = if __IC - k0 < __V * __L { __IC - k0 } else { __V * __L };
            for j in 0..terms {
                let dst = &mut stripe[j * __V * __L..][..__V * __L];
                ::core::ptr::copy_nonoverlapping(v.add(j * __IC + k0), dst.as_mut_ptr(), n);
                dst[n..].fill(0.0);
            }
        }

        /// `out[r] (+)= sum_j g[r][j] * v[j]` for `R` rows over `terms` terms, `V` vectors of
        /// the rows from `k0` on (`g` strided by `gs` per row and `gj` per term; `v` a stripe:
        /// its rows `V * L` apart, holding `k0..`); whole vectors when `FULL`, else up to `IC`.
        /// Adds to `out` when `ADD`.
        #[inline(always)]
        unsafe fn __dense_axpys<__S: #rt::Simd<Elem = __A>, const __R: usize, const __V: usize, const __FULL: bool, const __ADD: bool>(
            g: *const __A, gs: usize, gj: usize, terms: usize, v: *const __A, k0: usize, out: *mut __A,
        ) {
            let mut acc = [[__S::zero(); __V]; __R];
            for j in 0..terms {
                let mut gv = [__S::zero(); __R];
                for r in 0..__R {
                    gv[r] = __S::splat(*g.add(r * gs + j * gj));
                }
                for i in 0..__V {
                    // The stripe is zero past `IC`: whole loads.
                    let vv = __S::load(v.add(j * __V * __L + i * __L));
                    for r in 0..__R {
                        acc[r][i] = __S::fma(gv[r], vv, acc[r][i]);
                    }
                }
            }
            for r in 0..__R {
                __dense_put::<__S, { __V }, { __FULL }, { __ADD }>(&acc[r], k0, out.add(r * __IC));
            }
        }

        /// `out[k0..] (+)= acc`, `V` vectors (whole when `FULL`, else up to `IC`).
        #[inline(always)]
        unsafe fn __dense_put<__S: #rt::Simd<Elem = __A>, const __V: usize, const __FULL: bool, const __ADD: bool>(
            acc: &[__S; __V], k0: usize, out: *mut __A,
        ) {
            for i in 0..__V {
                let k = k0 + i * __L;
                let dst = out.add(k);
                if __FULL {
                    let value = if __ADD { __S::load(dst).add(acc[i]) } else { acc[i] };
                    value.store(dst);
                } else if k < __IC {
                    let n = if k + __L <= __IC { __L } else { __IC - k };
                    let value = if __ADD { __S::load_partial(dst, n).add(acc[i]) } else { acc[i] };
                    value.store_partial(dst, n);
                }
            }
        }

        /// [`__dense_axpys`] for one row over only the terms set in `mask`: the same sums in
        /// the same order where the other terms' `g` are zero.
        #[inline(always)]
        unsafe fn __dense_axpys_listed<__S: #rt::Simd<Elem = __A>, const __V: usize, const __FULL: bool, const __ADD: bool>(
            g: *const __A, gj: usize, mut mask: u64, v: *const __A, k0: usize, out: *mut __A,
        ) {
            let mut acc = [__S::zero(); __V];
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                let gv = __S::splat(*g.add(j * gj));
                for i in 0..__V {
                    acc[i] = __S::fma(gv, __S::load(v.add(j * __V * __L + i * __L)), acc[i]);
                }
            }
            __dense_put::<__S, { __V }, { __FULL }, { __ADD }>(&acc, k0, out);
        }

        /// Prefetches the lines of the stripe of `row` (`IC` values) that starts at input `k`
        /// (`VECS` vectors, or up to `IC`).
        #[inline(always)]
        unsafe fn __dense_prefetch<__S: #rt::Simd<Elem = __A>>(row: *const __A, k: usize) {
            let n = if __IC - k < #vecs * __L { __IC - k } else { #vecs * __L };
            let per_line = 64 / ::core::mem::size_of::<__A>();
            let mut i = 0;
            while i < n {
                __S::prefetch(row.add(k + i));
                i += per_line;
            }
            __S::prefetch(row.add(k + n - 1));
        }

        /// Whether a tile of `rows` rows (masks `stride` apart) over `terms` terms has few
        /// enough nonzero terms that skipping the rest one row at a time pays: a listed term
        /// costs about 1.6 of a tile's (it shares no loads across rows).
        #[inline(always)]
        fn __dense_sparse(masks: &[u64], stride: usize, rows: usize, terms: usize) -> bool {
            let mut set = 0;
            for r in 0..rows {
                set += masks[r * stride].count_ones() as usize;
            }
            5 * set < 3 * rows * terms
        }
    };
    let forward_tiles = forward_tiles(spec);
    let wide = lit(WIDE);
    let forward = dispatched(
        spec.dtype,
        "dense_forward",
        TokenStream::new(),
        TokenStream::new(),
        quote! {
            x: &[__A], w: &[__A], wt: &[__A], b: &[__A], y: &#rt::Shared<'_, __A>,
            batch: ::core::ops::Range<usize>, channels: ::core::ops::Range<usize>,
        },
        quote!(x, w, wt, b, y, batch, channels),
        quote! {
            // Channels outside, rows inside: a block of `COLS` weight rows stays in L1 for
            // every row (the whole of `w` does not stay in L2 beside the gradients). One row
            // (one action) takes `WIDE` weight rows at a time, each read once.
            let (xp, wp) = (x.as_ptr(), w.as_ptr());
            // Rows of the batch on AVX-512's registers where the CPU has them, and one row
            // over its nonzero inputs where `__conv` made the transposed copy: the same bits.
            if (batch.len() > 1 || !wt.is_empty())
                && !channels.is_empty()
                && __S::wide_dense(
                    &#rt::wide::Dense {
                        ic: __IC, rows: batch.len(), cols: channels.len(), ldy: __OC,
                        // The transposed copy where `__conv` made one (f32 layers only).
                        wt: if wt.is_empty() { ::core::ptr::null() } else { wt.as_ptr().add(channels.start) as *const f32 },
                        ldt: __OC,
                    },
                    xp.add(batch.start * __IC),
                    wp.add(channels.start * __IC),
                    b.as_ptr().add(channels.start),
                    y.ptr(batch.start * __OC + channels.start),
                )
            {
                return;
            }
            // Rows that share the L1 cache's sets (`__PACK`) copied per register tile, side by
            // side, `__PACK_ROWS` at a time (one-row tiles read their row as it is).
            let step = if batch.len() == 1 { #wide } else { #cols };
            let chunk = if __PACK { __PACK_ROWS } else { batch.len() };
            let mut chunk0 = batch.start;
            while chunk0 < batch.end {
                let end = if batch.end - chunk0 < chunk { batch.end } else { chunk0 + chunk };
                let packed = if __PACK && end - chunk0 > 1 {
                    #rt::packed_rows::pack::<__A, { __L }>(xp.add(chunk0 * __IC), __IC, end - chunk0, #rows)
                } else {
                    xp
                };
                let mut c0 = channels.start;
                while c0 < channels.end {
                    let cs = if channels.end - c0 < step { channels.end - c0 } else { step };
                    let mut r0 = chunk0;
                    while r0 < end {
                        let rs = if end - r0 < #rows { end - r0 } else { #rows };
                        let xr = if __PACK && rs > 1 {
                            packed.add((r0 - chunk0) * __IC.div_ceil(__L) * __L)
                        } else {
                            xp.add(r0 * __IC)
                        };
                        let wc = wp.add(c0 * __IC);
                        let mut put = |r: usize, c: usize, v: __A| {
                            *y.at((r0 + r) * __OC + c0 + c) = b[c0 + c] + v;
                        };
                        #forward_tiles
                        r0 += #rows;
                    }
                    c0 += step;
                }
                chunk0 = end;
            }
        },
    );
    // Rows of `dz` (or of `dz^T`: output channels) against rows of `w` (or `x`), `VECS`
    // vectors at a time: one register tile of `rows_expr` rows (or channels) against the
    // stripe, adding to `out` where `add` (else writing it). Each set holds the values its
    // expression can take for this layer, so only the reachable tile shapes are compiled.
    let axpy_loop = |rows_expr: TokenStream, rows: &[usize], add: TokenStream, adds: &[bool]| {
        let fulls = full_stripes(spec);
        let vecs = &vecs;
        let arms = (0..rows.len()).flat_map(|i| {
            let r_pat = pattern(rows, i);
            let r = lit(rows[i]);
            stripe_arms(&fulls, adds).map(move |(full, add, pat)| {
                quote! {
                    (#r_pat, #pat) => __dense_axpys::<__S, #r, #vecs, #full, #add>(g, gs, gj, terms, v, k0, dst),
                }
            })
        });
        quote! {
            let full = k0 + #vecs * __L <= __IC;
            match (#rows_expr, full, #add) {
                #(#arms)*
            }
        }
    };
    // One row at a time over its listed terms (row `r`'s mask is `masks[row + r * stride]`),
    // against the stripe.
    let listed_loop =
        |rows_expr: TokenStream, add: TokenStream, adds: &[bool], stride: TokenStream| {
            let fulls = full_stripes(spec);
            let arms = stripe_arms(&fulls, adds).map(|(full, add, pat)| {
                quote! {
                    (#pat) => __dense_axpys_listed::<__S, #vecs, #full, #add>(
                        g.add(r * gs), gj, mask, v, k0, dst.add(r * __IC),
                    ),
                }
            });
            quote! {
                let full = k0 + #vecs * __L <= __IC;
                for r in 0..#rows_expr {
                    let mask = masks[row + r * #stride];
                    match (full, #add) {
                        #(#arms)*
                    }
                }
            }
        };
    // The input gradient adds to `dx` from its second chunk of channels on; the weight
    // gradient always adds.
    let data_adds: &[bool] = if spec.out_channels > CHUNK {
        &[false, true]
    } else {
        &[false]
    };
    let data_rows = reachable(spec.batch, TILE_ROWS);
    let weight_rows = reachable(spec.out_channels, TILE_ROWS);
    let data_loop = axpy_loop(quote!(rs), &data_rows, quote!(add), data_adds);
    let data_listed = listed_loop(quote!(rs), quote!(add), data_adds, quote!(__OCHUNKS));
    let data = dispatched(
        spec.dtype,
        "dense_data",
        TokenStream::new(),
        TokenStream::new(),
        quote! {
            dz: &[__A], w: &[__A], dx: #rt::Shared<'_, __A>, batch: ::core::ops::Range<usize>,
            chunks: ::core::ops::Range<usize>,
        },
        quote!(dz, w, dx, batch, chunks),
        quote! {
            // `dx[b] = sum_o dz[b][o] w[o]` over the channels of `chunks`, in order, `CHUNK`
            // at a time (the first written, the others added). Input stripes outside, rows
            // inside: a stripe of `w` (copied, see `__dense_stripe`) stays in L1 for every row.
            let out = dx.part(batch.start * __IC, batch.len() * __IC);
            let (first, end) = (chunks.start * __CHUNK, if chunks.end * __CHUNK < __OC { chunks.end * __CHUNK } else { __OC });
            // Wider tiles on AVX-512's registers where the CPU has them: the same bits.
            if first < end
                && __S::wide_axpys(
                    &#rt::wide::Axpys { n: __IC, rows: batch.len(), terms: end - first, gs: __OC, gj: 1, add: false },
                    dz.as_ptr().add(batch.start * __OC + first),
                    w.as_ptr().add(first * __IC),
                    out.as_mut_ptr(),
                )
            {
                return;
            }
            let mut stripe = [0.0 as __A; __CHUNK * #vecs * __L];
            // The nonzero terms of each row's chunks of channels.
            let mut masks = [0u64; __DATA_MASKS];
            if __DATA_MASKS > 0 {
                for r in batch.clone() {
                    for (o, &g) in dz[r * __OC..(r + 1) * __OC].iter().enumerate() {
                        masks[(r - batch.start) * __OCHUNKS + o / __CHUNK] |= u64::from(g != 0.0) << (o % __CHUNK);
                    }
                }
            }
            let mut k0 = 0;
            while k0 < __IC {
                let mut o0 = first;
                while o0 < end {
                    let terms = if __OC - o0 < __CHUNK { __OC - o0 } else { __CHUNK };
                    __dense_stripe::<#vecs>(w.as_ptr().add(o0 * __IC), terms, k0, &mut stripe);
                    // The next stripe's rows of `w` (`IC` apart: pages apart where the layer is
                    // wide, and no stream prefetcher follows them), a share per row tile.
                    let (next, next_terms, kn) = if o0 + __CHUNK < end {
                        (o0 + __CHUNK, if __OC - o0 - __CHUNK < __CHUNK { __OC - o0 - __CHUNK } else { __CHUNK }, k0)
                    } else {
                        (first, if __OC - first < __CHUNK { __OC - first } else { __CHUNK }, k0 + #vecs * __L)
                    };
                    let tiles = batch.len().div_ceil(#tile_rows);
                    let share = if tiles > 0 && kn < __IC { next_terms.div_ceil(tiles) } else { 0 };
                    let mut r0 = batch.start;
                    while r0 < batch.end {
                        let rs = if batch.end - r0 < #tile_rows { batch.end - r0 } else { #tile_rows };
                        let (g, gs, gj, v) = (dz.as_ptr().add(r0 * __OC + o0), __OC, 1, stripe.as_ptr());
                        let dst = out.as_mut_ptr().add((r0 - batch.start) * __IC);
                        let add = o0 > first;
                        let j0 = (r0 - batch.start) / #tile_rows * share;
                        for j in j0..if j0 + share < next_terms { j0 + share } else { next_terms } {
                            __dense_prefetch::<__S>(w.as_ptr().add((next + j) * __IC), kn);
                        }
                        let row = (r0 - batch.start) * __OCHUNKS + o0 / __CHUNK;
                        if __DATA_MASKS > 0 && __dense_sparse(&masks[row..], __OCHUNKS, rs, terms) {
                            #data_listed
                        } else {
                            #data_loop
                        }
                        r0 += #tile_rows;
                    }
                    o0 += __CHUNK;
                }
                k0 += #vecs * __L;
            }
        },
    );
    let weights_loop = axpy_loop(quote!(os), &weight_rows, quote!(true), &[true]);
    let weights_listed = listed_loop(quote!(os), quote!(true), &[true], quote!(__BCHUNKS));
    let weights = dispatched(
        spec.dtype,
        "dense_weights",
        TokenStream::new(),
        TokenStream::new(),
        quote!(x: &[__A], dz: &[__A], dw: #rt::Shared<'_, __A>, channels: ::core::ops::Range<usize>),
        quote!(x, dz, dw, channels),
        quote! {
            // `dw[o] += sum_b dz[b][o] x[b]`, the batch in order, `CHUNK` rows at a time. Input
            // stripes outside, channels inside: a stripe of `x` (copied, see
            // `__dense_stripe`) stays in L1 for every channel.
            let rows = dw.part(channels.start * __IC, channels.len() * __IC);
            // Wider tiles on AVX-512's registers where the CPU has them: the same bits.
            if __S::wide_axpys(
                &#rt::wide::Axpys { n: __IC, rows: channels.len(), terms: __BATCH, gs: 1, gj: __OC, add: true },
                dz.as_ptr().add(channels.start),
                x.as_ptr(),
                rows.as_mut_ptr(),
            ) {
                return;
            }
            let mut stripe = [0.0 as __A; __CHUNK * #vecs * __L];
            // The nonzero terms (batch rows) of each channel's chunks of rows.
            let mut masks = [0u64; __WEIGHT_MASKS];
            if __WEIGHT_MASKS > 0 {
                for b in 0..__BATCH {
                    for o in channels.clone() {
                        masks[(o - channels.start) * __BCHUNKS + b / __CHUNK] |= u64::from(dz[b * __OC + o] != 0.0) << (b % __CHUNK);
                    }
                }
            }
            let mut k0 = 0;
            while k0 < __IC {
                let mut b0 = 0;
                while b0 < __BATCH {
                    let terms = if __BATCH - b0 < __CHUNK { __BATCH - b0 } else { __CHUNK };
                    __dense_stripe::<#vecs>(x.as_ptr().add(b0 * __IC), terms, k0, &mut stripe);
                    let mut o0 = channels.start;
                    while o0 < channels.end {
                        let os = if channels.end - o0 < #tile_rows { channels.end - o0 } else { #tile_rows };
                        let (g, gs, gj, v) = (dz.as_ptr().add(b0 * __OC + o0), 1, __OC, stripe.as_ptr());
                        let dst = rows.as_mut_ptr().add((o0 - channels.start) * __IC);
                        // The lines of `dw` the tile `AHEAD` channels on adds to (the next
                        // stripe's near the end): its rows are `IC` apart, pages apart where
                        // the layer is wide, and no stream prefetcher follows them.
                        let ahead = o0 - channels.start + __AHEAD;
                        let (ks, oa) = (k0 + ahead / channels.len() * #vecs * __L, channels.start + ahead % channels.len());
                        if ks < __IC {
                            for r in oa..if oa + #tile_rows < channels.end { oa + #tile_rows } else { channels.end } {
                                __dense_prefetch::<__S>(rows.as_ptr().add((r - channels.start) * __IC), ks);
                            }
                        }
                        let row = (o0 - channels.start) * __BCHUNKS + b0 / __CHUNK;
                        if __WEIGHT_MASKS > 0 && __dense_sparse(&masks[row..], __BCHUNKS, os, terms) {
                            #weights_listed
                        } else {
                            #weights_loop
                        }
                        o0 += #tile_rows;
                    }
                    b0 += __CHUNK;
                }
                k0 += #vecs * __L;
            }
        },
    );
    let bias = super::backward::bias_gradient();
    let pass = super::backward::pass_fn(
        spec,
        quote! {
            let work = __BATCH * __IC * __OC;
            // Where the weights are owned (see `__OWNED`), the input gradient's workers take
            // chunks of output channels; the first worker's chunks go straight into `dx`, each
            // other chunk's sum into a slot of scratch, added in chunk order afterwards.
            let slotted = match __owners(cpu.__pool(), work) {
                ::core::option::Option::Some(owners) if owners > 1 && d_input.is_some() => __OCHUNKS - __OCHUNKS / owners,
                _ => 0,
            };
            let #rt::Workspace { scratch, pool, .. } = cpu.__workspace::<__A>(
                #rt::PackKey { stamps: [0, 0], layout: 0 },
                0,
                |_, _| {},
                __BATCH * __OC + slotted * __BATCH * __IC,
            );
            let (dz, slots) = scratch[..__BATCH * __OC + slotted * __BATCH * __IC].split_at_mut(__BATCH * __OC);
            __d_conv(pool, layer, state, d_output, mode, grads.as_deref_mut(), dz);
            let dz: &[__A] = dz;
            if let ::core::option::Option::Some(g) = grads {
                #bias
                let dw = #rt::Shared::new(g.weights.as_mut_slice());
                pool.run(__OC.div_ceil(#tile_rows), work, &|_, tiles| {
                    let channels = tiles.start * #tile_rows..if tiles.end * #tile_rows < __OC { tiles.end * #tile_rows } else { __OC };
                    // SAFETY: the worker's own channels; the slices have the lengths the kernel
                    // reads.
                    unsafe { __dense_weights(x, dz, dw, channels) };
                });
            }
            if let ::core::option::Option::Some(d_input) = d_input {
                let dx = #rt::Shared::new(d_input);
                let w = layer.weights.as_slice();
                let rows = |tiles: ::core::ops::Range<usize>| {
                    tiles.start * #tile_rows..if tiles.end * #tile_rows < __BATCH { tiles.end * #tile_rows } else { __BATCH }
                };
                if slotted == 0 {
                    pool.run(__BATCH.div_ceil(#tile_rows), work, &|_, tiles| {
                        // SAFETY: the worker's own rows; the slices have the lengths the kernel
                        // reads.
                        unsafe { __dense_data(dz, w, dx, rows(tiles), 0..__OCHUNKS) };
                    });
                } else {
                    let head = __OCHUNKS - slotted;
                    let slots = #rt::Shared::new(slots);
                    pool.run(__OCHUNKS, work, &|_, chunks| {
                        if chunks.start == 0 {
                            // SAFETY: `dx` is the first worker's alone in this pass; the
                            // slices have the lengths the kernel reads.
                            unsafe { __dense_data(dz, w, dx, 0..__BATCH, chunks) };
                            return;
                        }
                        for c in chunks {
                            // SAFETY: chunk `c`'s own slot (chunks `head..` are the other
                            // workers', each once), `BATCH` rows long, as the kernel writes.
                            unsafe {
                                let slot = slots.part((c - head) * __BATCH * __IC, __BATCH * __IC);
                                __dense_data(dz, w, #rt::Shared::new(slot), 0..__BATCH, c..c + 1);
                            }
                        }
                    });
                    // The same sums in the same order as one worker's: chunk by chunk.
                    pool.run(__BATCH.div_ceil(#tile_rows), __BATCH * __IC * slotted, &|_, tiles| {
                        let rows = rows(tiles);
                        let span = rows.start * __IC..rows.end * __IC;
                        // SAFETY: the worker's own rows of `dx`, and of each slot (read only).
                        let out = unsafe { dx.part(span.start, span.len()) };
                        for c in 0..slotted {
                            // SAFETY: as `out`.
                            let slot = unsafe { slots.part(c * __BATCH * __IC + span.start, span.len()) };
                            for (o, s) in out.iter_mut().zip(slot.iter()) {
                                *o += *s;
                            }
                        }
                    });
                }
            }
        },
    );
    let layout = super::cpu::layout_id(spec, 6);
    let (sparse, transpose) = if spec.dtype == Dtype::F32 {
        (
            quote!(cpu.__reused(transposed, if __B > 1 { 3 } else { 64 }) && #rt::wide::sparse(x)),
            quote!(|_, out: &mut [__A]| if sparse {
                #rt::wide::transpose(layer.weights.as_slice(), __OC, __IC, out)
            }),
        )
    } else {
        (quote!(false), quote!(|_, _| {}))
    };
    quote! {
        /// Dense layer + bias of `B` rows into `ya` (`None`: scratch), with
        /// `epilogue(rows' results, first row, rows)` on each worker's rows while in cache (on
        /// all rows at the end where the rows are too few for the threads), then `then(first
        /// row, rows)` once they are final.
        /// `RELU` is applied by the epilogue's activation (the dense kernels keep no ReLU of
        /// their own).
        #[inline(always)]
        fn __conv<const __B: usize, const __RELU: bool>(
            cpu: &mut #rt::Cpu,
            layer: &#layer,
            x: &[__T],
            ya: ::core::option::Option<#rt::Shared<'_, __A>>,
            epilogue: &(dyn ::core::ops::Fn(&mut [__A], usize, usize) + ::core::marker::Sync),
            then: &(dyn ::core::ops::Fn(usize, usize) + ::core::marker::Sync),
        ) {
            // Below a register tile of rows, the pass streams its weights from memory at about
            // the cost of that many rows' multiply-adds (Nature DQN's 3136 x 512 at batch 1:
            // 117 us, where as many multiply-adds in cache take about 40).
            let work = (if __B < #rows { #rows } else { __B }) * __IC * __OC;
            let parts = cpu.__pool().workers(__B.div_ceil(#rows), work);
            let y_scratch = if ya.is_some() { 0 } else { __B * __OC };
            // Mostly zero rows (after a ReLU), on AVX-512: a transposed copy of the weights lets
            // the pass skip the zeros (`wide::sparse`: the same bits). Made for weights used
            // unchanged (a target network's, or for inference: the third pass with the same
            // weights), not for those an optimizer changes after each step. One row (an
            // action) waits for the 64th pass: the Nature DQN's copy (3136 x 512) took about
            // three actions' time and paid for itself over about 15 more, so weights kept for
            // fewer actions (a DQN's, updated every 1 to 4 frames) never take one, and those
            // kept for 64 or more (inference, evaluation, a policy-gradient agent's rollouts)
            // pay at most about 5% more before they gain.
            let transposed = #rt::PackKey { stamps: [layer.weights.stamp(), 0], layout: #layout };
            let sparse = #sparse;
            let (key, len) = if sparse {
                (transposed, #rt::wide::transposed_len(__OC, __IC))
            } else {
                (#rt::PackKey { stamps: [0, 0], layout: 0 }, 0)
            };
            let ws = cpu.__workspace::<__A>(key, len, #transpose, y_scratch);
            let (pool, wt) = (ws.pool, ws.packed);
            let y = match ya {
                ::core::option::Option::Some(y) => y,
                ::core::option::Option::None => #rt::Shared::new(&mut ws.scratch[..__B * __OC]),
            };
            let (w, b) = (layer.weights.as_slice(), layer.biases.as_slice());
            let relu = |out: &mut [__A], q0: usize, n: usize| {
                if __RELU {
                    for v in out.iter_mut() {
                        *v = if *v > 0.0 { *v } else { 0.0 };
                    }
                }
                epilogue(out, q0, n);
            };
            let owned = __owners(pool, work).is_some();
            if !owned && parts >= pool.workers(usize::MAX, work) {
                pool.run(parts, work, &|_, range| {
                    let batch = range.start * __B / parts..range.end * __B / parts;
                    if batch.is_empty() {
                        return;
                    }
                    // SAFETY: the worker's own rows, whole; the slices have the lengths the
                    // kernel reads.
                    unsafe {
                        __dense_forward(x, w, wt, b, &y, batch.clone(), 0..__OC);
                        relu(y.part(batch.start * __OC, batch.len() * __OC), batch.start, batch.len());
                        then(batch.start, batch.len());
                    }
                });
            } else {
                // Owned weights, or too few rows for the threads (one action: batch 1): blocks
                // of output channels instead, each worker streaming its own rows of the weights
                // (the same dot products, so the same bits), then the epilogue on every row.
                const __CBLOCK: usize = #cblock;
                let block = if owned { __CHUNK } else { __CBLOCK };
                let blocks = __OC.div_ceil(block);
                pool.run(blocks, work, &|_, range| {
                    let end = range.end * block;
                    let channels = range.start * block..if end < __OC { end } else { __OC };
                    // SAFETY: the worker's own channels of every row (elements written one by
                    // one); the slices have the lengths the kernel reads.
                    unsafe { __dense_forward(x, w, wt, b, &y, 0..__B, channels) };
                });
                // SAFETY: the workers are done: the whole output is the caller's.
                relu(unsafe { y.part(0, __B * __OC) }, 0, __B);
                then(0, __B);
            }
        }

        /// Terms (channels, or batch rows) of a gradient's stripe: the bits of a mask.
        const __CHUNK: usize = #chunk;
        /// Whether the weights are *owned*: on more than one thread, each worker takes whole
        /// chunks of output channels (rows of the weights) in the forward pass and the input
        /// gradient, as the weight gradient and the optimizer's step cut them, so that the rows
        /// an optimizer step writes on one core are not read on another in the next step: they
        /// would move between the cores' caches twice a step (MinAtar's 512 KB, held in L2:
        /// two thirds of the Adam step on two threads). Where the input gradient's slots of
        /// scratch (at most all chunks but one, a batch of inputs each) stay within twice the
        /// weights' size.
        const __OWNED: bool = __OCHUNKS > 1 && (__OCHUNKS - 1) * __BATCH <= 2 * __OC;

        /// The workers of a pass of `work` over whole chunks where the weights are owned and
        /// the chunks leave no thread idle (no more threads than chunks); `None` where the
        /// passes split their rows instead.
        #[inline(always)]
        fn __owners(pool: &#rt::Pool, work: usize) -> ::core::option::Option<usize> {
            let owners = pool.workers(__OCHUNKS, work);
            (__OWNED && owners >= pool.workers(usize::MAX, work)).then_some(owners)
        }
        /// How far ahead of its tile the weight gradient prefetches `dw`, in output channels:
        /// four tiles, about a memory latency of FMAs.
        const __AHEAD: usize = 4 * #tile_rows;
        /// Whether the forward pass packs its register tiles' rows of `x`
        /// (`packed_rows::aliased`).
        const __PACK: bool = #rt::packed_rows::aliased(__IC, ::core::mem::size_of::<__A>(), #rows);
        /// Rows packed at a time: whole register tiles, and a buffer per thread that stays
        /// small whatever the batch (63 rows of 1024 f32 inputs: 252 KiB).
        const __PACK_ROWS: usize = 21 * #rows;
        /// Chunks of output channels, and of batch rows.
        const __OCHUNKS: usize = __OC.div_ceil(__CHUNK);
        const __BCHUNKS: usize = __BATCH.div_ceil(__CHUNK);
        /// Masks of nonzero terms kept on a kernel's stack (0: too many, the layer skips no
        /// terms): the input gradient's for all rows, the weight gradient's for all channels.
        const __DATA_MASKS: usize = if __BATCH * __OCHUNKS <= #mask_cap { __BATCH * __OCHUNKS } else { 0 };
        const __WEIGHT_MASKS: usize = if __OC * __BCHUNKS <= #mask_cap { __OC * __BCHUNKS } else { 0 };

        #tiles
        #forward
        #data
        #weights
        #pass
    }
}

/// The sizes a tile over `total` elements takes, `tile` at a time: the full tile, then the
/// remainder (one size when the tile covers `total`, or divides it).
fn reachable(total: usize, tile: usize) -> Vec<usize> {
    match (total <= tile, total % tile) {
        (true, _) => vec![total],
        (false, 0) => vec![tile],
        (false, rest) => vec![tile, rest],
    }
}

/// Whether a stripe of `VECS` vectors is whole: always, unless the inputs end inside one.
fn full_stripes(spec: &Spec) -> Vec<bool> {
    if spec.input[2].is_multiple_of(VECS * spec.dtype.lanes()) {
        vec![true]
    } else {
        vec![true, false]
    }
}

/// `values[i]` as a match pattern: the last value matches `_`, so that arms for every value of
/// a set (and every combination of sets) cover all the others, which never occur.
fn pattern<T: ToTokens>(values: &[T], i: usize) -> TokenStream {
    if i + 1 == values.len() {
        quote!(_)
    } else {
        values[i].to_token_stream()
    }
}

/// Every `(full, add)` of the two sets, with their patterns.
fn stripe_arms<'a>(
    fulls: &'a [bool],
    adds: &'a [bool],
) -> impl Iterator<Item = (bool, bool, TokenStream)> + 'a {
    (0..fulls.len()).flat_map(move |j| {
        (0..adds.len()).map(move |k| {
            let (f, a) = (pattern(fulls, j), pattern(adds, k));
            (fulls[j], adds[k], quote!(#f, #a))
        })
    })
}

/// The forward pass's tiles of `rs` rows (any: the batch is the caller's) by `cs` output
/// channels (those `COLS` at a time reach), over row `r0` and channel `c0`.
fn forward_tiles(spec: &Spec) -> TokenStream {
    let cols = reachable(spec.out_channels, COLS);
    // A tile of one row also takes `WIDE` channels (the pass over one row steps by them).
    let mut one_row = reachable(spec.out_channels, WIDE);
    one_row.extend(
        cols.iter()
            .filter(|c| !one_row.contains(c))
            .collect::<Vec<_>>(),
    );
    let rows: Vec<usize> = (1..=ROWS).rev().collect();
    let arms = (0..rows.len()).flat_map(|i| {
        let (rows, cols) = (&rows, if rows[i] == 1 { &one_row } else { &cols });
        (0..cols.len()).map(move |j| {
            let (r_pat, c_pat) = (pattern(rows, i), pattern(cols, j));
            let (r, c) = (lit(rows[i]), lit(cols[j]));
            // One-row tiles read their row as it is.
            let p = if rows[i] > 1 {
                quote!(__PACK)
            } else {
                quote!(false)
            };
            quote!((#r_pat, #c_pat) => __dense_tile::<__S, #r, #c, { #p }>(xr, wc, &mut put),)
        })
    });
    quote! {
        match (rs, cs) {
            #(#arms)*
        }
    }
}
