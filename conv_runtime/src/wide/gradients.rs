//! A dense layer's gradient products on AVX-512's registers: the input gradient
//! (`dx[b] = sum_o dz[b][o] w[o]`) and the weight gradient (`dw[o] += sum_b dz[b][o] x[b]`) are
//! both rows of scaled rows added up ([`Axpys`]), which the generated 8-lane kernels run three
//! rows by four ymm vectors at a time. Here a register tile holds 16 accumulators of 32
//! registers: two rows by eight zmm vectors where rows are short, four rows by four where they
//! are long (see [`WIDE_ROWS`]).
//!
//! After a ReLU most of the gradient's terms are zero, and in columns: a unit that is off for
//! one row is mostly off for the others. A tile runs only the terms that are nonzero in one of
//! its rows (rows with no nonzero term at all run in no tile), and its rows are the live rows
//! in order of their counts of nonzero terms, so that rows alike share tiles. A zero term adds
//! an exact zero (`acc + 0 * v` is `acc` where `v` is finite: an accumulator that starts at
//! `+0` is never `-0`), so each output is the 8-lane kernel's chain of fused multiply-adds
//! over the nonzero terms in order: the same bits.

/// One call's products, as the generated `__dense_data` and `__dense_weights` lay them out:
/// for each of `rows` rows `r`, `out[r * n..][..n] (+)= sum_j g[r * gs + j * gj] v[j * n..][..n]`
/// over `terms` terms, in chunks of 64 terms from the first. Each chunk's sum starts at zero
/// and runs over its terms in order; the first chunk's is written to `out` (added where
/// `add`), every later chunk's added.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Axpys {
    /// The length of `v`'s and `out`'s rows (and their stride).
    pub n: usize,
    /// Rows of `out`.
    pub rows: usize,
    /// Terms: rows of `v`.
    pub terms: usize,
    /// `g`'s stride per row.
    pub gs: usize,
    /// `g`'s stride per term.
    pub gj: usize,
    /// Whether the first chunk adds to `out` (else it writes it).
    pub add: bool,
}

/// Terms per chunk: the bits of a mask.
const CHUNK: usize = 64;

/// The longest rows that take tiles of two rows by eight vectors. A tile runs every term
/// nonzero in any of its rows, so two rows waste fewer multiply-adds than four: in MinAtar's
/// DQN 1.20 terms per nonzero one against 1.37 (both gradients alike), and its gradients took
/// 5% less time. Past this length, where the rows stream from memory (the Nature DQN's
/// 3136 inputs), four rows by four vectors were as fast or faster (AMD Zen 4).
const WIDE_ROWS: usize = 2048;

/// Runs `a`'s products on AVX-512 where [`crate::simd::avx512`] chooses it: `true` if it did.
/// The same bits as the 8-lane kernels wherever `v` is finite.
///
/// # Safety
/// `g` can be read at `r * a.gs + j * a.gj` for every row `r` and term `j`; `v` holds
/// `a.terms` rows and `out` holds `a.rows` rows, each `a.n` long.
#[doc(hidden)]
#[inline]
pub unsafe fn axpys(a: &Axpys, g: *const f32, v: *const f32, out: *mut f32) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            avx512::axpys(a, g, v, out);
            return true;
        }
    }
    let _ = (a, g, v, out);
    false
}

// Index loops over the tiles' rows and vectors, as `crate::wide` writes them.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Axpys, CHUNK};
    use crate::wide::lanes;
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    /// The most zmm vectors of a register tile's rows: the widest stripe.
    const MOST_VECS: usize = 8;

    /// A thread's masks of nonzero terms and its live rows, kept from call to call.
    #[derive(Default)]
    struct Scratch {
        /// `masks[r * chunks + c]`: row `r`'s nonzero terms in chunk `c`.
        masks: Vec<u64>,
        /// The rows with a nonzero term, most terms first.
        live: Vec<u32>,
        /// The rows without one.
        dead: Vec<u32>,
        /// The live rows' sort keys: fewer terms, then the row (in the low half).
        keyed: Vec<u64>,
        /// The stripe, allocated on the first call: only its copied terms are read.
        stripe: Option<Box<Stripe>>,
    }

    std::thread_local! {
        static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    }

    /// One chunk's stripe of `v`: its terms' values `k0..k0 + 16 * V`, zeros past `n`, rows
    /// `16 * V` apart. Rows of `v` lie `n` apart (4 KiB for 1024 f32 inputs: all in one set of
    /// the L1 cache); the stripe's rows do not.
    #[repr(align(64))]
    struct Stripe([f32; CHUNK * 16 * MOST_VECS]);

    pub unsafe fn axpys(a: &Axpys, g: *const f32, v: *const f32, out: *mut f32) {
        if a.rows == 0 {
            return;
        }
        // The borrow ends with the closure, and nothing else borrows the scratch: it cannot
        // fail.
        SCRATCH.with(|s| {
            let s = &mut s.borrow_mut();
            if a.n <= super::WIDE_ROWS {
                run::<2, 8>(a, g, v, out, s)
            } else {
                run::<4, 4>(a, g, v, out, s)
            }
        });
    }

    /// Tiles of up to `R` rows by `V` vectors.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn run<const R: usize, const V: usize>(
        a: &Axpys,
        g: *const f32,
        v: *const f32,
        out: *mut f32,
        s: &mut Scratch,
    ) {
        let width_v = 16 * V;
        let chunks = a.terms.div_ceil(CHUNK);
        masks(a, g, chunks, s);
        // Rows without a nonzero term: each chunk's sum is +0.
        for &r in &s.dead {
            let row = out.add(r as usize * a.n);
            for k in (0..a.n).step_by(16) {
                let m = lanes(a.n - k);
                let value = if a.add {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(m, row.add(k)), _mm512_setzero_ps())
                } else {
                    _mm512_setzero_ps()
                };
                _mm512_mask_storeu_ps(row.add(k), m, value);
            }
        }
        if s.live.is_empty() {
            return;
        }
        let stripe = s
            .stripe
            .get_or_insert_with(|| Box::new(Stripe([0.0; CHUNK * 16 * MOST_VECS])));
        for k0 in (0..a.n).step_by(width_v) {
            let width = width_v.min(a.n - k0);
            for c in 0..chunks {
                let j0 = c * CHUNK;
                let mut union = 0u64;
                for &r in &s.live {
                    union |= s.masks[r as usize * chunks + c];
                }
                copy_stripe::<V>(a, v, j0, union, k0, width, stripe);
                let first = c == 0 && !a.add;
                let tiles = s.live.chunks(R);
                let count = tiles.len();
                for (t, rows) in tiles.enumerate() {
                    if t + 1 < count {
                        // The next tile's lines of `out`: its rows are `n` apart, pages apart
                        // where the layer is wide, which no stream prefetcher follows.
                        for &r in &s.live[(t + 1) * R..((t + 2) * R).min(s.live.len())] {
                            prefetch_row::<V>(out.add(r as usize * a.n + k0), width);
                        }
                    }
                    let mut mask = 0u64;
                    for &r in rows {
                        mask |= s.masks[r as usize * chunks + c];
                    }
                    let t = Tile {
                        a,
                        g: g.add(j0 * a.gj),
                        stripe: stripe.0.as_ptr(),
                        out,
                        k0,
                        mask,
                        first,
                    };
                    match rows.len() {
                        4 => tile::<4, V>(&t, rows),
                        3 => tile::<3, V>(&t, rows),
                        2 => tile::<2, V>(&t, rows),
                        _ => tile::<1, V>(&t, rows),
                    }
                }
            }
        }
    }

    /// Each row's masks of nonzero terms (NaN counts as nonzero), and its live and dead rows.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,popcnt")]
    unsafe fn masks(a: &Axpys, g: *const f32, chunks: usize, s: &mut Scratch) {
        s.masks.clear();
        s.masks.resize(a.rows * chunks, 0);
        let zero = _mm512_setzero_ps();
        if a.gj == 1 {
            // Each row's terms side by side (the input gradient's rows of `dz`).
            for r in 0..a.rows {
                for j in (0..a.terms).step_by(16) {
                    let m = lanes(a.terms - j);
                    let values = _mm512_maskz_loadu_ps(m, g.add(r * a.gs + j));
                    let set = _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(m, values, zero);
                    s.masks[r * chunks + j / CHUNK] |= u64::from(set) << (j % CHUNK);
                }
            }
        } else if a.gs == 1 {
            // Each term's rows side by side (the weight gradient's output channels): 16 rows'
            // masks at a time, in two vectors of 8, each term's bit set in its nonzero rows'
            // lanes (a loop over the set bits took a branch per nonzero term).
            for r0 in (0..a.rows).step_by(16) {
                let m = lanes(a.rows - r0);
                for c in 0..chunks {
                    let (mut low, mut high) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for j in c * CHUNK..a.terms.min((c + 1) * CHUNK) {
                        let values = _mm512_maskz_loadu_ps(m, g.add(j * a.gj + r0));
                        let set = _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(m, values, zero);
                        let bit = _mm512_set1_epi64((1u64 << (j % CHUNK)) as i64);
                        low = _mm512_mask_or_epi64(low, set as u8, low, bit);
                        high = _mm512_mask_or_epi64(high, (set >> 8) as u8, high, bit);
                    }
                    let mut rows = [0u64; 16];
                    _mm512_storeu_si512(rows.as_mut_ptr().cast(), low);
                    _mm512_storeu_si512(rows.as_mut_ptr().add(8).cast(), high);
                    for (i, &mask) in rows.iter().enumerate().take(a.rows - r0) {
                        s.masks[(r0 + i) * chunks + c] = mask;
                    }
                }
            }
        } else {
            for r in 0..a.rows {
                for j in 0..a.terms {
                    let value = *g.add(r * a.gs + j * a.gj);
                    s.masks[r * chunks + j / CHUNK] |= u64::from(value != 0.0) << (j % CHUNK);
                }
            }
        }
        s.live.clear();
        s.dead.clear();
        s.keyed.clear();
        for r in 0..a.rows {
            let row = &s.masks[r * chunks..(r + 1) * chunks];
            let count: u32 = row.iter().map(|m| m.count_ones()).sum();
            if count > 0 {
                s.keyed.push(u64::from(u32::MAX - count) << 32 | r as u64);
            } else {
                s.dead.push(r as u32);
            }
        }
        // Rows alike in their counts side by side: most terms first, equals in row order.
        s.keyed.sort_unstable();
        s.live.extend(s.keyed.iter().map(|&key| key as u32));
    }

    /// Copies the terms of `union` (chunk `j0`'s) into the stripe and asks for their next
    /// stripe's lines.
    #[inline(always)]
    unsafe fn copy_stripe<const V: usize>(
        a: &Axpys,
        v: *const f32,
        j0: usize,
        mut union: u64,
        k0: usize,
        width: usize,
        stripe: &mut Stripe,
    ) {
        let next = k0 + 16 * V < a.n;
        while union != 0 {
            let j = union.trailing_zeros() as usize;
            union &= union - 1;
            let src = v.add((j0 + j) * a.n + k0);
            let dst = stripe.0.as_mut_ptr().add(j * 16 * V);
            for i in 0..V {
                let m = lanes(width.saturating_sub(16 * i));
                _mm512_store_ps(dst.add(16 * i), _mm512_maskz_loadu_ps(m, src.add(16 * i)));
            }
            if next {
                prefetch_row::<V>(src.add(16 * V), a.n - k0 - 16 * V);
            }
        }
    }

    /// Asks for the lines of the `16 * V` values from `p` on (or `len`, where fewer).
    #[inline(always)]
    unsafe fn prefetch_row<const V: usize>(p: *const f32, len: usize) {
        let len = len.min(16 * V);
        for i in (0..len).step_by(16) {
            _mm_prefetch::<_MM_HINT_T0>(p.add(i).cast::<i8>());
        }
        _mm_prefetch::<_MM_HINT_T0>(p.add(len - 1).cast::<i8>());
    }

    /// A register tile's operands besides its rows.
    struct Tile<'a> {
        a: &'a Axpys,
        /// `g` at the chunk's first term.
        g: *const f32,
        stripe: *const f32,
        out: *mut f32,
        k0: usize,
        /// The terms nonzero in one of the tile's rows.
        mask: u64,
        /// Whether the sums are written (else added).
        first: bool,
    }

    /// `R` rows' sums over the tile's terms, `V` vectors wide, written or added to their rows
    /// of `out`.
    #[inline(always)]
    unsafe fn tile<const R: usize, const V: usize>(t: &Tile, rows: &[u32]) {
        let a = t.a;
        let mut gs = [t.g; R];
        for (p, &r) in gs.iter_mut().zip(rows) {
            *p = t.g.add(r as usize * a.gs);
        }
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        let mut mask = t.mask;
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let mut vv = [_mm512_setzero_ps(); V];
            for (i, vv) in vv.iter_mut().enumerate() {
                *vv = _mm512_load_ps(t.stripe.add(j * 16 * V + 16 * i));
            }
            for r in 0..R {
                let gv = _mm512_set1_ps(*gs[r].add(j * a.gj));
                for i in 0..V {
                    acc[r][i] = _mm512_fmadd_ps(gv, vv[i], acc[r][i]);
                }
            }
        }
        for r in 0..R {
            let row = t.out.add(rows[r] as usize * a.n);
            for i in 0..V {
                let k = t.k0 + 16 * i;
                if k >= a.n {
                    break;
                }
                let m = lanes(a.n - k);
                let value = if t.first {
                    acc[r][i]
                } else {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(m, row.add(k)), acc[r][i])
                };
                _mm512_mask_storeu_ps(row.add(k), m, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each output's chain of fused multiply-adds over every term in order, chunk by chunk.
    fn reference(a: &Axpys, g: &[f32], v: &[f32], out: &mut [f32]) {
        for r in 0..a.rows {
            for k in 0..a.n {
                for c in 0..a.terms.div_ceil(CHUNK) {
                    let mut acc = 0f32;
                    for j in c * CHUNK..a.terms.min((c + 1) * CHUNK) {
                        acc = g[r * a.gs + j * a.gj].mul_add(v[j * a.n + k], acc);
                    }
                    let o = &mut out[r * a.n + k];
                    *o = if c == 0 && !a.add { acc } else { *o + acc };
                }
            }
        }
    }

    /// Both layouts of `g`, written and added, over ragged rows, terms (two chunks and part of
    /// a third) and widths, with rows and terms that are zero throughout (dead ReLU units) and
    /// scattered zeros, in both tile shapes (rows past [`WIDE_ROWS`] long): the reference's
    /// bits.
    #[test]
    fn axpys_give_the_fused_chains_bits() {
        if !crate::simd::avx512() {
            eprintln!("no AVX-512 here: the products run on the 8-lane kernels");
            return;
        }
        let mut rng = crate::Rng::seed_from_u64(5);
        for (n, rows, terms) in [
            (1024, 32, 128),
            (100, 13, 11),
            (37, 7, 150),
            (64, 5, 64),
            (WIDE_ROWS + 52, 9, 70),
        ] {
            for (by_rows, add) in [(true, false), (true, true), (false, true), (false, false)] {
                let (gs, gj) = if by_rows { (terms, 1) } else { (1, rows) };
                let g: Vec<f32> = (0..rows * terms)
                    .map(|i| {
                        let (r, j) = if by_rows {
                            (i / terms, i % terms)
                        } else {
                            (i % rows, i / rows)
                        };
                        let u = rng.uniform(-1.0, 1.0) as f32;
                        if r % 5 == 3 || j % 7 == 2 || u < 0.0 {
                            0.0
                        } else {
                            u
                        }
                    })
                    .collect();
                let v: Vec<f32> = (0..terms * n)
                    .map(|_| rng.uniform(-1.0, 1.0) as f32)
                    .collect();
                let start: Vec<f32> = (0..rows * n)
                    .map(|_| rng.uniform(-1.0, 1.0) as f32)
                    .collect();
                let a = Axpys {
                    n,
                    rows,
                    terms,
                    gs,
                    gj,
                    add,
                };
                let (mut want, mut got) = (start.clone(), start);
                reference(&a, &g, &v, &mut want);
                // SAFETY: the slices have the lengths `a` describes.
                assert!(unsafe { axpys(&a, g.as_ptr(), v.as_ptr(), got.as_mut_ptr()) });
                let differ = want
                    .iter()
                    .zip(&got)
                    .filter(|(w, o)| w.to_bits() != o.to_bits())
                    .count();
                assert_eq!(differ, 0, "{a:?}: {differ} values differ");
            }
        }
    }
}
