//! The Winograd layers' matrix products and tile transforms, and the dense layers' forward dot
//! products and gradients, on AVX-512's registers where the CPU has them.
//!
//! Generated kernels are written for 8-lane vectors, so that their blocking and the packed
//! weights are the same on every x86-64 CPU. A Winograd layer spends most of its time in the
//! products of its tile elements (tiles x channels times channels x channels), whose packed
//! weights hold each block's 16 (or 24, or 8) output columns side by side for every reduction
//! step: one zmm register covers two of the AVX2 kernel's vectors, and a CPU with two 512-bit
//! FMA units issues twice the multiply-adds per cycle. Every output is the same chain of fused
//! multiply-adds in the same order as in the AVX2 kernel (from zero, over the reduction in
//! order), so the bits do not change, and a layer gives the same results on either.
//!
//! The weight gradient's products ([`weight_product`]) are the same chains of fused
//! multiply-adds, output channel by output channel, 16 to a zmm register instead of 8.
//!
//! The tile transforms around the products ([`crate::winograd::tiles`]) are lane-wise: each
//! channel's arithmetic is the same whatever the vector's width, so [`channels`] runs a tile's
//! channels 16 at a time (8 for the rest) through the same code, one call per tile.
//!
//! A dense layer's forward pass sums dot products across the lanes of 8-lane vectors; [`dense`]
//! keeps those vectors, two to a zmm register, in a larger register tile than 16 ymm registers
//! allow. Where its inputs are mostly zeros, [`sparse()`] chooses the same sums over the
//! nonzero ones only. Its gradients ([`axpys`]) are lane-wise sums of scaled rows, run 128
//! values wide (64 where rows are longer than 2048).

use crate::winograd::tiles::Transform;
use crate::winograd::Variant;

mod gradients;
mod sparse;
pub use gradients::{axpys, Axpys};
pub use sparse::{nonzero_at_most, sparse, transpose, transposed_len};

/// One chunk's products, as the generated `__wino_gemm` and `__wino_data_product` lay them
/// out: for each tile element `e`, `o[e][r][..n] = a[e][r][..k] . w[e]` for the first `count`
/// rows `r`.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Product {
    /// Tile elements, each its own product.
    pub elems: usize,
    /// Rows per element in `a` and `o` (the chunk's capacity; `count` of them are computed).
    pub rows: usize,
    /// The reduction's length: `a`'s row width.
    pub k: usize,
    /// Output columns, a multiple of 8: `o`'s row width. `w` holds `k * n` values per element.
    pub n: usize,
    /// Columns per packed block, a multiple of 8: `w[e]` is `[block][k][block columns]`, the
    /// last block narrower where it does not divide `n`.
    pub block: usize,
}

/// Runs `p`'s products on AVX-512 where [`crate::simd::avx512`] chooses it: `true` if it did.
///
/// # Safety
/// `a` holds `p.elems * p.rows * p.k` values, `w` holds `p.elems * p.k * p.n` and `o` holds
/// `p.elems * p.rows * p.n`; `count <= p.rows`; `p.n` and `p.block` are multiples of 8.
#[doc(hidden)]
#[inline]
pub unsafe fn product(
    p: &Product,
    a: *const f32,
    w: *const f32,
    o: *mut f32,
    count: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            avx512::product(p, a, w, o, count);
            return true;
        }
    }
    let _ = (p, a, w, o, count);
    false
}

/// One chunk's weight-gradient products, as the generated `__wino_weight_product` lays them
/// out: for each tile element `e`, `du[e][c][..oc] (+)= sum over the first count rows t of
/// v[e][t][c] * n[e][t][..oc]`, for every staged input channel `c < wic`.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct WeightProduct {
    /// Tile elements, each its own product.
    pub elems: usize,
    /// Rows per element in `v` and `n` (the chunk's capacity).
    pub rows: usize,
    /// Staged input channels: `v`'s row width, `du`'s rows.
    pub wic: usize,
    /// Output channels: `n`'s and `du`'s row width. The wide kernel runs where they are a
    /// multiple of 8.
    pub oc: usize,
}

/// Runs `p`'s products on AVX-512 where [`crate::simd::avx512`] chooses it: `true` if it did.
/// Each output starts from zero where `fresh` (else from `du`) and adds its products over the
/// rows in order, one fused multiply-add each, as the generated 8-lane kernel does: the same
/// bits, 16 output channels to a register instead of 8, in tiles of 24 accumulators, or 16
/// input channels by one vector where a group's output channels fit one (8 input channels ran
/// 9% slower at 16 channels).
///
/// # Safety
/// `v` holds `p.elems * p.rows * p.wic` values, `n` holds `p.elems * p.rows * p.oc` and `du`
/// holds `p.elems * p.wic * p.oc`; `count <= p.rows`.
#[doc(hidden)]
#[inline]
pub unsafe fn weight_product(
    p: &WeightProduct,
    v: *const f32,
    n: *const f32,
    du: *mut f32,
    count: usize,
    fresh: bool,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() && p.oc.is_multiple_of(8) {
            avx512::weight_product(p, v, n, du, count, fresh);
            return true;
        }
    }
    let _ = (p, v, n, du, count, fresh);
    false
}

/// Runs a tile's transform over its `channels` channels (a multiple of 8) on AVX-512 where
/// [`crate::simd::avx512`] chooses it, 16 at a time and 8 for the rest: `true` if it did.
/// Lane-wise arithmetic, the same operations on each channel as the 8-lane kernels, so the
/// same bits.
///
/// # Safety
/// As [`Transform::run`] for every vector of 8 of the `channels`.
#[doc(hidden)]
#[inline]
pub unsafe fn channels<V: Variant, T: Transform<f32>>(t: &T, channels: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            avx512::channels::<V, T>(t, channels);
            return true;
        }
    }
    let _ = (t, channels);
    false
}

/// One dense layer's forward dot products, as the generated `__dense_forward` lays them out:
/// `y[r * ldy + c] = bias[c] + x[r] . w[c]` for `rows` rows of `x` and `cols` rows of `w`, each
/// `ic` long.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Dense {
    /// The inputs: the rows' length.
    pub ic: usize,
    /// Rows of `x` (batch rows), `ic` apart.
    pub rows: usize,
    /// Rows of `w` (output channels), `ic` apart.
    pub cols: usize,
    /// `y`'s row stride.
    pub ldy: usize,
    /// The weights transposed ([`transpose`]'s copy: a row per input, `ldt` apart, from the
    /// first of the `cols` output channels), or null: where rows of `x` are mostly zeros
    /// ([`sparse()`]), the pass runs over their nonzero inputs only, on this copy (`sparse.rs`:
    /// the same bits).
    pub wt: *const f32,
    pub ldt: usize,
}

/// Runs `d`'s dot products on AVX-512 where [`crate::simd::avx512`] chooses it: `true` if it
/// did. Each zmm register holds two of the 8-lane kernel's dot products, one per half (rows
/// `c` and `c + 1` of the weights against a row of `x` broadcast to both halves), so each lane
/// adds the same products in the same order, and the halves are summed across their lanes as
/// the 8-lane kernel sums its vectors: the same bits. The gain is the register tile that 32
/// registers allow: 16 such accumulators (8 rows by 4 output channels), 32 dot products in
/// flight against the 8-lane kernel's 12. Where rows of `x` share the L1 cache's sets (1024 or
/// 2048 inputs apart), each tile's rows are first copied side by side into one stream.
///
/// # Safety
/// `x` holds `d.rows` rows and `w` holds `d.cols` rows, `d.ic` apart; `bias` holds `d.cols`
/// values; `y` can be written at `r * d.ldy + c` for every `r < d.rows`, `c < d.cols`; `d.wt`
/// is null or holds [`transpose`]'s copy of the layer's weights from the first of the `cols`
/// channels on (rows `d.ldt` apart).
#[doc(hidden)]
#[inline]
pub unsafe fn dense(
    d: &Dense,
    x: *const f32,
    w: *const f32,
    bias: *const f32,
    y: *mut f32,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            if d.wt.is_null() {
                avx512::dense(d, x, w, bias, y);
            } else {
                sparse::avx512::dense(d, x, bias, y);
            }
            return true;
        }
    }
    let _ = (d, x, w, bias, y);
    false
}

/// The first `n` of 16 lanes (all 16 where `n >= 16`): the masks of the AVX-512 kernels'
/// ragged ends.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes(n: usize) -> std::arch::x86_64::__mmask16 {
    if n >= 16 {
        0xffff
    } else {
        (1u16 << n) - 1
    }
}

// Index loops over the tiles' rows and columns, as `crate::winograd` writes them.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Dense, Product, Transform, Variant, WeightProduct};
    use crate::simd::{Avx2F32, Simd};
    use crate::winograd::tiles;
    use std::arch::x86_64::*;

    /// Sixteen f32 lanes in a zmm register, for the lane-wise tile transforms: each lane's
    /// operations are those of [`Avx2F32`]'s lanes (`vmaxps` keeps the second operand unless
    /// the first is greater, as on ymm).
    #[derive(Clone, Copy)]
    struct Avx512F32(__m512);

    impl Simd for Avx512F32 {
        type Elem = f32;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Self(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Self(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Self(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Self(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn add(self, o: Self) -> Self {
            Self(_mm512_add_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn sub(self, o: Self) -> Self {
            Self(_mm512_sub_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn mul(self, o: Self) -> Self {
            Self(_mm512_mul_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn max(self, o: Self) -> Self {
            Self(_mm512_max_ps(self.0, o.0))
        }
    }

    /// [`super::channels`]: 16 channels at a time on zmm, then 8 on ymm.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn channels<V: Variant, T: Transform<f32>>(t: &T, channels: usize) {
        debug_assert!(channels.is_multiple_of(8));
        let wide = channels / 16 * 16;
        tiles::by_vectors::<V, Avx512F32, T>(t, 0, wide);
        tiles::by_vectors::<V, Avx2F32, T>(t, wide, channels);
    }

    /// Rows per register tile: 24 accumulators for two column groups (each broadcast feeding
    /// two multiply-adds), 12 for one, where 6 would leave the multiply-adds waiting on each
    /// other. A chunk holds 12 tiles where it can, so one register tile covers it. (Tiles of
    /// 6 rows by two groups, as the AVX2 kernels', ran the Nature DQN's step about 4% slower.)
    const ROWS: usize = 12;

    /// 16 output columns of one block: where `w` starts, its row stride, which lanes exist.
    #[derive(Clone, Copy)]
    struct Columns {
        w: usize,
        stride: usize,
        col: usize,
        mask: __mmask16,
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn product(p: &Product, a: *const f32, w: *const f32, o: *mut f32, count: usize) {
        for e in 0..p.elems {
            let (ae, we, oe) = (
                a.add(e * p.rows * p.k),
                w.add(e * p.k * p.n),
                o.add(e * p.rows * p.n),
            );
            let mut row = 0;
            while row < count {
                let rows = (count - row).min(ROWS);
                let (ar, or) = (ae.add(row * p.k), oe.add(row * p.n));
                // Two column groups per tile (each broadcast feeds two multiply-adds), in the
                // order of the blocks.
                let mut pending: Option<Columns> = None;
                for f in (0..p.n).step_by(p.block) {
                    let width = p.block.min(p.n - f);
                    for g in (0..width).step_by(16) {
                        let c = Columns {
                            w: p.k * f + g,
                            stride: width,
                            col: f + g,
                            mask: if width - g >= 16 { 0xffff } else { 0x00ff },
                        };
                        match pending.take() {
                            None => pending = Some(c),
                            Some(first) => tile_rows::<2>(rows, ar, p, we, [first, c], or),
                        }
                    }
                }
                if let Some(last) = pending {
                    tile_rows::<1>(rows, ar, p, we, [last, last], or);
                }
                row += rows;
            }
        }
    }

    /// A tile of up to `ROWS` rows by `Z` column groups.
    #[inline(always)]
    unsafe fn tile_rows<const Z: usize>(
        rows: usize,
        a: *const f32,
        p: &Product,
        w: *const f32,
        c: [Columns; 2],
        o: *mut f32,
    ) {
        match rows {
            12 => tile::<12, Z>(a, p.k, w, c, o, p.n),
            11 => tile::<11, Z>(a, p.k, w, c, o, p.n),
            10 => tile::<10, Z>(a, p.k, w, c, o, p.n),
            9 => tile::<9, Z>(a, p.k, w, c, o, p.n),
            8 => tile::<8, Z>(a, p.k, w, c, o, p.n),
            7 => tile::<7, Z>(a, p.k, w, c, o, p.n),
            6 => tile::<6, Z>(a, p.k, w, c, o, p.n),
            5 => tile::<5, Z>(a, p.k, w, c, o, p.n),
            4 => tile::<4, Z>(a, p.k, w, c, o, p.n),
            3 => tile::<3, Z>(a, p.k, w, c, o, p.n),
            2 => tile::<2, Z>(a, p.k, w, c, o, p.n),
            _ => tile::<1, Z>(a, p.k, w, c, o, p.n),
        }
    }

    /// `P` rows times `Z` column groups, reduced over `k`.
    #[inline(always)]
    unsafe fn tile<const P: usize, const Z: usize>(
        a: *const f32,
        k: usize,
        w: *const f32,
        c: [Columns; 2],
        o: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; P];
        let mut ws = [w.add(c[0].w), w.add(c[1].w)];
        // Rows in threes from one pointer moved along the reduction: row `3q + t` at
        // `b + q * 3k + t * k`, so a tile of 12 rows needs a few registers for its addresses
        // (an index register scaled by 4 and 8), not one per row, and none are spilled.
        let k3 = 3 * k;
        let mut b = a;
        for _ in 0..k {
            let mut wv = [_mm512_setzero_ps(); 2];
            for z in 0..Z {
                wv[z] = _mm512_maskz_loadu_ps(c[z].mask, ws[z]);
                ws[z] = ws[z].add(c[z].stride);
            }
            for q in 0..P.div_ceil(3) {
                let bq = b.add(q * k3);
                for t in 0..3 {
                    let i = 3 * q + t;
                    if i < P {
                        let x = _mm512_set1_ps(*bq.add(t * k));
                        for z in 0..Z {
                            acc[i][z] = _mm512_fmadd_ps(x, wv[z], acc[i][z]);
                        }
                    }
                }
            }
            b = b.add(1);
        }
        for (i, acc) in acc.iter().enumerate() {
            for z in 0..Z {
                _mm512_mask_storeu_ps(o.add(i * n + c[z].col), c[z].mask, acc[z]);
            }
        }
    }

    /// [`super::weight_product`]: output channels in groups of up to 4 zmm vectors outside
    /// (as the 8-lane kernel's blocks: one group of `n` stays in L1 across the rows), register
    /// tiles of input channels inside, each reduced over the chunk's rows.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weight_product(
        p: &WeightProduct,
        v: *const f32,
        n: *const f32,
        du: *mut f32,
        count: usize,
        fresh: bool,
    ) {
        for e in 0..p.elems {
            let (ve, ne, de) = (
                v.add(e * p.rows * p.wic),
                n.add(e * p.rows * p.oc),
                du.add(e * p.wic * p.oc),
            );
            let mut o0 = 0;
            while o0 < p.oc {
                let cols = (p.oc - o0).min(64);
                let masks = [0, 1, 2, 3].map(|z| super::lanes(cols.saturating_sub(16 * z)));
                let g = Gradients {
                    v: ve,
                    n: ne.add(o0),
                    du: de.add(o0),
                    wic: p.wic,
                    oc: p.oc,
                    count,
                    fresh,
                    masks,
                };
                match cols.div_ceil(16) {
                    4 => g.rows::<6, 4>(),
                    3 => g.rows::<8, 3>(),
                    2 => g.rows::<12, 2>(),
                    _ => g.rows::<16, 1>(),
                }
                o0 += cols;
            }
        }
    }

    /// One group of output channels of [`weight_product`]: `n` and `du` from its first.
    struct Gradients {
        v: *const f32,
        n: *const f32,
        du: *mut f32,
        wic: usize,
        oc: usize,
        count: usize,
        fresh: bool,
        /// The lanes of each vector of the group.
        masks: [__mmask16; 4],
    }

    impl Gradients {
        /// Every input channel, `P` at a time, then one at a time.
        #[inline(always)]
        unsafe fn rows<const P: usize, const Z: usize>(&self) {
            let mut c = 0;
            while c + P <= self.wic {
                self.tile::<P, Z>(c);
                c += P;
            }
            while c + 4 <= self.wic {
                self.tile::<4, Z>(c);
                c += 4;
            }
            while c < self.wic {
                self.tile::<1, Z>(c);
                c += 1;
            }
        }

        /// Input channels `c..c + P` by the group's `Z` vectors.
        #[inline(always)]
        unsafe fn tile<const P: usize, const Z: usize>(&self, c: usize) {
            let mut acc = [[_mm512_setzero_ps(); Z]; P];
            if !self.fresh {
                for (i, acc) in acc.iter_mut().enumerate() {
                    for z in 0..Z {
                        let at = self.du.add((c + i) * self.oc + 16 * z);
                        acc[z] = _mm512_maskz_loadu_ps(self.masks[z], at);
                    }
                }
            }
            for t in 0..self.count {
                let (vt, nt) = (self.v.add(t * self.wic + c), self.n.add(t * self.oc));
                let mut nv = [_mm512_setzero_ps(); Z];
                for z in 0..Z {
                    nv[z] = _mm512_maskz_loadu_ps(self.masks[z], nt.add(16 * z));
                }
                for (i, acc) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*vt.add(i));
                    for z in 0..Z {
                        acc[z] = _mm512_fmadd_ps(x, nv[z], acc[z]);
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                for z in 0..Z {
                    let at = self.du.add((c + i) * self.oc + 16 * z);
                    _mm512_mask_storeu_ps(at, self.masks[z], acc[z]);
                }
            }
        }
    }

    /// Rows and pairs of output channels of a dense register tile: 16 accumulators, a pair of
    /// weight rows per 2 of them, one row of `x` broadcast at a time.
    const DENSE_ROWS: usize = 8;
    const DENSE_PAIRS: usize = 2;

    /// Rows of `x` packed at a time: 8 register tiles.
    const PACKED_ROWS: usize = 8 * DENSE_ROWS;

    /// [`super::dense`] over chunks of [`PACKED_ROWS`] rows, each packed where its rows alias
    /// ([`crate::packed_rows`]: a tile's rows then read as one stream), then output channels
    /// outside (a block of `2 * DENSE_PAIRS` weight rows read by every row tile), rows inside,
    /// as the 8-lane kernel.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub unsafe fn dense(d: &Dense, x: *const f32, w: *const f32, bias: *const f32, y: *mut f32) {
        let pack = crate::packed_rows::aliased(d.ic, 4, DENSE_ROWS);
        let padded = d.ic.div_ceil(8) * 8;
        let mut chunk0 = 0;
        while chunk0 < d.rows {
            let chunk = (d.rows - chunk0).min(PACKED_ROWS);
            let packed = if pack {
                Some(crate::packed_rows::pack::<f32, 8>(
                    x.add(chunk0 * d.ic),
                    d.ic,
                    chunk,
                    DENSE_ROWS,
                ))
            } else {
                None
            };
            let mut c0 = 0;
            while c0 < d.cols {
                let cs = (d.cols - c0).min(2 * DENSE_PAIRS);
                let mut r0 = 0;
                while r0 < chunk {
                    let rs = (chunk - r0).min(DENSE_ROWS);
                    let t = DenseTile {
                        packed: packed.map(|p| p.add(r0 * padded)),
                        x: x.add((chunk0 + r0) * d.ic),
                        w: w.add(c0 * d.ic),
                        ic: d.ic,
                        cols: cs,
                        bias: bias.add(c0),
                        y: y.add((chunk0 + r0) * d.ldy + c0),
                        ldy: d.ldy,
                    };
                    if cs > 2 {
                        dense_rows::<2>(rs, &t);
                    } else {
                        dense_rows::<1>(rs, &t);
                    }
                    r0 += rs;
                }
                c0 += cs;
            }
            chunk0 += chunk;
        }
    }

    /// One register tile's operands: `cols` (at most `2 * P`) rows of `w` against the rows of
    /// `x` (also packed by [`crate::packed_rows::pack`] where they alias), written to `y`
    /// with the bias.
    struct DenseTile {
        packed: Option<*const f32>,
        x: *const f32,
        w: *const f32,
        ic: usize,
        cols: usize,
        bias: *const f32,
        y: *mut f32,
        ldy: usize,
    }

    #[inline(always)]
    unsafe fn dense_rows<const P: usize>(rows: usize, t: &DenseTile) {
        match rows {
            8 => dense_tile::<8, P>(t),
            7 => dense_tile::<7, P>(t),
            6 => dense_tile::<6, P>(t),
            5 => dense_tile::<5, P>(t),
            4 => dense_tile::<4, P>(t),
            3 => dense_tile::<3, P>(t),
            2 => dense_tile::<2, P>(t),
            _ => dense_tile::<1, P>(t),
        }
    }

    /// Two 8-lane vectors in a zmm register's halves.
    #[inline(always)]
    unsafe fn halves(lo: __m256, hi: __m256) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        ))
    }

    /// `R` rows by `P` pairs of output channels. A pair past `cols` repeats its first row in
    /// its second half, whose sums are not stored.
    #[inline(always)]
    unsafe fn dense_tile<const R: usize, const P: usize>(t: &DenseTile) {
        let ic = t.ic;
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        // One pointer per row, for unpacked rows and the rest past the last whole vector.
        let mut xs = [t.x; R];
        for (i, r) in xs.iter_mut().enumerate() {
            *r = t.x.add(i * ic);
        }
        let mut ws = [[t.w; 2]; P];
        for (p, pair) in ws.iter_mut().enumerate() {
            for (h, row) in pair.iter_mut().enumerate() {
                *row = t.w.add((2 * p + h).min(t.cols - 1) * ic);
            }
        }
        for j in 0..ic / 8 {
            let k = 8 * j;
            let mut wv = [_mm512_setzero_ps(); P];
            for p in 0..P {
                wv[p] = halves(
                    _mm256_loadu_ps(ws[p][0].add(k)),
                    _mm256_loadu_ps(ws[p][1].add(k)),
                );
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = match t.packed {
                    Some(packed) => packed.add((j * R + r) * 8),
                    None => xs[r].add(k),
                };
                let xv = halves_of(_mm256_loadu_ps(row));
                for p in 0..P {
                    acc[p] = _mm512_fmadd_ps(xv, wv[p], acc[p]);
                }
            }
        }
        let k = ic / 8 * 8;
        if k < ic {
            // The rest of the row with zeros past it, as `Avx2F32::load_partial` loads it.
            let n = ic - k;
            let mut wv = [_mm512_setzero_ps(); P];
            for p in 0..P {
                wv[p] = halves(
                    Avx2F32::load_partial(ws[p][0].add(k), n).raw(),
                    Avx2F32::load_partial(ws[p][1].add(k), n).raw(),
                );
            }
            for r in 0..R {
                let xv = halves_of(Avx2F32::load_partial(xs[r].add(k), n).raw());
                for p in 0..P {
                    acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
                }
            }
        }
        // Each half summed across its lanes as the 8-lane kernel sums its vectors.
        let mut v = [Avx2F32::zero(); 2 * DENSE_ROWS * DENSE_PAIRS];
        for r in 0..R {
            for p in 0..P {
                let i = 2 * (r * P + p);
                v[i] = Avx2F32::from_raw(_mm512_castps512_ps256(acc[r][p]));
                v[i + 1] = Avx2F32::from_raw(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(acc[r][p]),
                )));
            }
        }
        let mut dots = [0f32; 2 * DENSE_ROWS * DENSE_PAIRS];
        Avx2F32::sums(&v[..2 * R * P], &mut dots[..2 * R * P]);
        for r in 0..R {
            for c in 0..t.cols {
                *t.y.add(r * t.ldy + c) = *t.bias.add(c) + dots[2 * r * P + c];
            }
        }
    }

    /// An 8-lane vector in both halves of a zmm register.
    #[inline(always)]
    unsafe fn halves_of(v: __m256) -> __m512 {
        _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` values drawn uniformly from [-1, 1).
    fn uniform(rng: &mut crate::Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
    }

    /// The AVX2 kernels' sums, one output at a time: fused multiply-adds from zero, in order.
    fn reference(p: &Product, a: &[f32], w: &[f32], o: &mut [f32], count: usize) {
        for e in 0..p.elems {
            for r in 0..count {
                for col in 0..p.n {
                    let (f, g) = (col / p.block * p.block, col % p.block);
                    let width = p.block.min(p.n - f);
                    let mut acc = 0f32;
                    for j in 0..p.k {
                        let x = a[(e * p.rows + r) * p.k + j];
                        let wv = w[e * p.k * p.n + p.k * f + j * width + g];
                        acc = x.mul_add(wv, acc);
                    }
                    o[(e * p.rows + r) * p.n + col] = acc;
                }
            }
        }
    }

    /// Each transform's loads and epilogue written out apart from [`crate::winograd::tiles`],
    /// 8 lanes at a time: the reference the tile transforms are held to on both widths.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::needless_range_loop)]
    mod narrow {
        use crate::simd::{Avx2F32, Simd};
        use crate::winograd::{self, Variant, MAX};
        use std::ops::Range;

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn input<V: Variant>(x: *const f32, l: [usize; 3], v: *mut f32, ch: usize) {
            for c in (0..ch).step_by(8) {
                winograd::input::<V, Avx2F32>(x.add(c), l[0], l[1], v.add(c), l[2]);
            }
        }

        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn output<V: Variant>(
            m: *const f32,
            stride: usize,
            bias: *const f32,
            y: *mut f32,
            (row, col, ch): (usize, usize, usize),
            (down, right): (usize, usize),
            relu: bool,
        ) {
            for k in (0..ch).step_by(8) {
                let b = Avx2F32::load(bias.add(k));
                let out = winograd::output::<V, Avx2F32>(m.add(k), stride);
                for r in 0..down {
                    for c in 0..right {
                        let mut value = out[r][c].add(b);
                        if relu {
                            value = value.max(Avx2F32::zero());
                        }
                        value.store(y.add(r * row + c * col + k));
                    }
                }
            }
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn gradient<V: Variant>(
            dy: *const f32,
            (row, col, ch): (usize, usize, usize),
            (down, right): (usize, usize),
            n: *mut f32,
            stride: usize,
        ) {
            for k in (0..ch).step_by(8) {
                let mut t = [[Avx2F32::zero(); MAX]; MAX];
                for r in 0..down {
                    for c in 0..right {
                        t[r][c] = Avx2F32::load(dy.add(r * row + c * col + k));
                    }
                }
                winograd::gradient::<V, Avx2F32>(t, n.add(k), stride);
            }
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn input_gradient<V: Variant>(
            dv: *const f32,
            stride: usize,
            x: *mut f32,
            (row, col, ch): (usize, usize, usize),
            (add_rows, add_cols): (usize, usize),
            (rows, cols): (Range<usize>, Range<usize>),
        ) {
            for c in (0..ch).step_by(8) {
                winograd::input_gradient::<V, Avx2F32>(
                    dv.add(c),
                    stride,
                    x.add(c),
                    row,
                    col,
                    add_rows,
                    add_cols,
                    rows.clone(),
                    cols.clone(),
                );
            }
        }
    }

    /// Each transform on 16 lanes against the 8-lane code it replaces, for one variant: 24
    /// channels (a zmm and a ymm vector), clipped tiles, ReLU on and off, NaNs among the inputs.
    #[cfg(target_arch = "x86_64")]
    fn transforms_match<V: Variant>(name: &str) {
        use crate::winograd::{tiles, MAX};
        let mut rng = crate::Rng::seed_from_u64(5);
        let ch = 24;
        // Element `e` of a tile `stride` apart; a tile's pixels `col` apart, rows `row`.
        let (stride, col) = (ch + 8, ch + 8);
        let row = MAX * col + 8;
        let mut fill = |len: usize| -> Vec<f32> {
            let mut v: Vec<f32> = (0..len).map(|_| rng.uniform(-2.0, 2.0) as f32).collect();
            v[len / 3] = f32::NAN;
            v
        };
        let same = |a: &[f32], b: &[f32], what: &str| {
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{name} {what} at {i}");
            }
        };
        let (tile, elems) = (MAX * row, MAX * MAX * stride);
        let (x, m, bias, dv) = (fill(tile), fill(elems), fill(ch), fill(elems));
        // SAFETY: every buffer covers the addresses the transforms touch (`MAX` rows and
        // columns of the strides above); `avx512()` said the CPU has AVX-512F (so AVX2, FMA).
        unsafe {
            let (mut got, mut want) = (vec![f32::NAN; elems], vec![f32::NAN; elems]);
            let input = tiles::Input {
                x: x.as_ptr(),
                row,
                col,
                v: got.as_mut_ptr(),
                stride,
            };
            assert!(channels::<V, _>(&input, ch));
            narrow::input::<V>(x.as_ptr(), [row, col, stride], want.as_mut_ptr(), ch);
            same(&got, &want, "input");
            for extent in [(V::M, V::M), (1, V::M), (V::M - 1, 1)] {
                for relu in [false, true] {
                    let (mut got, mut want) = (vec![f32::NAN; tile], vec![f32::NAN; tile]);
                    let y = (row, col, ch);
                    let output = tiles::Output {
                        m: m.as_ptr(),
                        stride,
                        bias: bias.as_ptr(),
                        y: got.as_mut_ptr(),
                        row,
                        col,
                        extent,
                        relu,
                    };
                    assert!(channels::<V, _>(&output, ch));
                    narrow::output::<V>(
                        m.as_ptr(),
                        stride,
                        bias.as_ptr(),
                        want.as_mut_ptr(),
                        y,
                        extent,
                        relu,
                    );
                    same(&got, &want, "output");
                }
                let (mut got, mut want) = (vec![f32::NAN; elems], vec![f32::NAN; elems]);
                let gradient = tiles::Gradient {
                    dy: x.as_ptr(),
                    row,
                    col,
                    extent,
                    n: got.as_mut_ptr(),
                    stride,
                };
                assert!(channels::<V, _>(&gradient, ch));
                narrow::gradient::<V>(
                    x.as_ptr(),
                    (row, col, ch),
                    extent,
                    want.as_mut_ptr(),
                    stride,
                );
                same(&got, &want, "gradient");
            }
            for (add, clip) in [
                ((0, 0), (0..V::N, 0..V::N)),
                ((2, 1), (0..V::N, 0..V::N)),
                ((1, 0), (1..V::N - 1, 0..V::N - 2)),
            ] {
                let (mut got, mut want) = (x.clone(), x.clone());
                let input_gradient = tiles::InputGradient {
                    dv: dv.as_ptr(),
                    stride,
                    x: got.as_mut_ptr(),
                    row,
                    col,
                    add,
                    rows: clip.0.clone(),
                    cols: clip.1.clone(),
                };
                assert!(channels::<V, _>(&input_gradient, ch));
                narrow::input_gradient::<V>(
                    dv.as_ptr(),
                    stride,
                    want.as_mut_ptr(),
                    (row, col, ch),
                    add,
                    clip,
                );
                same(&got, &want, "input gradient");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_transforms_give_the_8_lane_bits() {
        if !crate::simd::avx512() {
            eprintln!("no AVX-512 on this CPU (or CONV2D_SIMD asks for narrower kernels): the wide transforms cannot run here");
            return;
        }
        use crate::winograd::{F2x3, F2x3S2, F3x2, F4x3, F5x2};
        transforms_match::<F2x3>("F2x3");
        transforms_match::<F3x2>("F3x2");
        transforms_match::<F4x3>("F4x3");
        transforms_match::<F5x2>("F5x2");
        transforms_match::<F2x3S2>("F2x3S2");
    }

    /// The 8-lane dense kernel's dot products, one at a time: fused multiply-adds of whole
    /// vectors from zero, the rest of the row with zeros past it, then the lanes summed.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dense_reference(d: &Dense, x: &[f32], w: &[f32], bias: &[f32], y: &mut [f32]) {
        use crate::simd::{Avx2F32, Simd};
        for r in 0..d.rows {
            for c in 0..d.cols {
                let (xr, wc) = (x.as_ptr().add(r * d.ic), w.as_ptr().add(c * d.ic));
                let mut acc = Avx2F32::zero();
                let mut k = 0;
                while k + 8 <= d.ic {
                    acc = Avx2F32::fma(Avx2F32::load(xr.add(k)), Avx2F32::load(wc.add(k)), acc);
                    k += 8;
                }
                if k < d.ic {
                    let n = d.ic - k;
                    let (xv, wv) = (
                        Avx2F32::load_partial(xr.add(k), n),
                        Avx2F32::load_partial(wc.add(k), n),
                    );
                    acc = Avx2F32::fma(xv, wv, acc);
                }
                y[r * d.ldy + c] = bias[c] + acc.sum();
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn wide_dense_gives_the_8_lane_bits() {
        if !crate::simd::avx512() {
            eprintln!("no AVX-512 on this CPU (or CONV2D_SIMD asks for narrower kernels): the wide dense kernel cannot run here");
            return;
        }
        let mut rng = crate::Rng::seed_from_u64(9);
        for ic in [1, 7, 8, 9, 100, 1024] {
            for rows in [1, 2, 3, 8, 9, 17] {
                for cols in [1, 2, 3, 4, 5, 13, 130, 257] {
                    let mut d = Dense {
                        ic,
                        rows,
                        cols,
                        ldy: cols + 3,
                        wt: std::ptr::null(),
                        ldt: 0,
                    };
                    let (mut x, mut w, bias) = (
                        uniform(&mut rng, rows * ic),
                        uniform(&mut rng, cols * ic),
                        uniform(&mut rng, cols),
                    );
                    // A NaN in one product, and a row of `x` of negative zeros (its sums
                    // keep the sign of the zero they start from).
                    w[(cols - 1) * ic] = f32::NAN;
                    for v in &mut x[(rows - 1) * ic..] {
                        *v = -0.0;
                    }
                    // The rows' gaps stay NaN: nothing is written past `cols`.
                    let check = |d: &Dense, x: &[f32], w: &[f32], what: &str| {
                        let len = rows * d.ldy;
                        let (mut got, mut want) = (vec![f32::NAN; len], vec![f32::NAN; len]);
                        // SAFETY: the buffers have the lengths `Dense` describes (`wt` holds
                        // `ic` rows of `cols` where it is not null); the CPU has AVX-512F,
                        // AVX-512VL, AVX2 and FMA (`avx512()`).
                        unsafe {
                            let out = got.as_mut_ptr();
                            assert!(dense(d, x.as_ptr(), w.as_ptr(), bias.as_ptr(), out));
                            dense_reference(d, x, w, &bias, &mut want);
                        }
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{what}: ic {ic} rows {rows} cols {cols} at {i}"
                            );
                        }
                    };
                    check(&d, &x, &w, "dot products");
                    // Over the nonzero inputs of a transposed copy (finite weights: a NaN
                    // times a skipped zero is not there to spread), with half the inputs
                    // zero and the first `ic` in row 0 alone (the other row of its pair
                    // zero there).
                    w[(cols - 1) * ic] = 0.5;
                    for (i, v) in x.iter_mut().enumerate() {
                        if *v < 0.0 || (i % ic < 3 && i >= ic) {
                            *v = 0.0;
                        }
                    }
                    let mut wt = vec![f32::NAN; transposed_len(cols, ic)];
                    transpose(&w, cols, ic, &mut wt);
                    (d.wt, d.ldt) = (wt.as_ptr(), cols);
                    check(&d, &x, &w, "nonzero inputs");
                }
            }
        }
    }

    #[test]
    fn wide_weight_products_give_the_avx2_kernels_bits() {
        if !crate::simd::avx512() {
            eprintln!("no AVX-512 on this CPU (or CONV2D_SIMD asks for narrower kernels): the wide products cannot run here");
            return;
        }
        let mut rng = crate::Rng::seed_from_u64(4);
        // Groups of 4 vectors, then of 3, 2 or 1, the last one 8 lanes wide or whole; input
        // channels in whole tiles and not.
        for oc in [8, 16, 24, 32, 48, 64, 72, 88, 112] {
            for wic in [1, 5, 8, 12, 13, 16, 19, 30, 64] {
                for count in [1, 6, 17] {
                    for fresh in [true, false] {
                        let p = WeightProduct {
                            elems: 2,
                            rows: 18,
                            wic,
                            oc,
                        };
                        let v = uniform(&mut rng, p.elems * p.rows * wic);
                        let n = uniform(&mut rng, p.elems * p.rows * oc);
                        let start = uniform(&mut rng, p.elems * wic * oc);
                        // The 8-lane kernel's sums: from zero or the values there, fused
                        // multiply-adds over the rows in order.
                        let mut want = start.clone();
                        for e in 0..p.elems {
                            for c in 0..wic {
                                for o in 0..oc {
                                    let at = (e * wic + c) * oc + o;
                                    let mut acc = if fresh { 0.0 } else { want[at] };
                                    for t in 0..count {
                                        let (x, g) = (
                                            v[(e * p.rows + t) * wic + c],
                                            n[(e * p.rows + t) * oc + o],
                                        );
                                        acc = x.mul_add(g, acc);
                                    }
                                    want[at] = acc;
                                }
                            }
                        }
                        let mut got = start;
                        // SAFETY: the buffers have the lengths `WeightProduct` describes.
                        let ran = unsafe {
                            weight_product(
                                &p,
                                v.as_ptr(),
                                n.as_ptr(),
                                got.as_mut_ptr(),
                                count,
                                fresh,
                            )
                        };
                        assert!(ran);
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "oc {oc} wic {wic} count {count} fresh {fresh} at {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn wide_products_give_the_avx2_kernels_bits() {
        if !crate::simd::avx512() {
            eprintln!("no AVX-512 on this CPU (or CONV2D_SIMD asks for narrower kernels): the wide products cannot run here");
            return;
        }
        let mut rng = crate::Rng::seed_from_u64(3);
        // (n, block): blocks of 16, of 24 (three vectors), one of 8 left over, one block only.
        for (n, block) in [
            (16, 16),
            (24, 24),
            (32, 16),
            (40, 16),
            (64, 16),
            (48, 16),
            (8, 8),
        ] {
            for k in [1, 7, 16, 64] {
                for count in [1, 5, 6, 7, 9, 11, 12, 13, 24, 26] {
                    let p = Product {
                        elems: 3,
                        rows: 26,
                        k,
                        n,
                        block,
                    };
                    let a = uniform(&mut rng, p.elems * p.rows * k);
                    let w = uniform(&mut rng, p.elems * k * n);
                    let len = p.elems * p.rows * n;
                    let (mut got, mut want) = (vec![f32::NAN; len], vec![f32::NAN; len]);
                    reference(&p, &a, &w, &mut want, count);
                    // SAFETY: the buffers have the lengths `Product` describes.
                    let ran =
                        unsafe { product(&p, a.as_ptr(), w.as_ptr(), got.as_mut_ptr(), count) };
                    assert!(ran);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "n {n} block {block} k {k} count {count} at {i}"
                        );
                    }
                }
            }
        }
    }
}
