//! A dense layer's forward pass over the nonzero inputs only, on AVX-512's registers: after a
//! ReLU half of a layer's inputs are zero or more (MinAtar's DQN: half, in a trained network),
//! and a dot product along the inputs cannot skip them, since a vector of 8 inputs is rarely
//! all zero. Over a transposed copy of the weights (`[in][out]`, cached by the device until the
//! weights change) each nonzero input is one row of weights, scaled and added to the outputs.
//!
//! The sums are the 8-lane dot products' own: lane `j` of a dot product adds the inputs
//! `k = j, j + 8, ...` in order from zero, and the lanes are summed in a fixed tree. Here
//! output `o`'s partial sum of class `j` (the inputs `k % 8 == j`) runs over the nonzero inputs
//! of the class in order, from zero, and the classes are summed in the same tree: a zero input
//! adds an exact zero (`acc + 0 * w` is `acc` where `w` is finite), so each output gets the
//! same bits. Four rows share each weight load, over the inputs nonzero in one of them.

/// Whether `x`'s rows are sparse enough for the pass over [`super::Dense::wt`]: at most
/// `MAX_DENSITY` of their values nonzero (of the first `SAMPLE`: the check is a few percent of
/// the pass where it reads them all), and AVX-512 at hand ([`crate::simd::avx512`]).
#[doc(hidden)]
pub fn sparse(x: &[f32]) -> bool {
    const SAMPLE: usize = 8192;
    /// Nonzero inputs, as a share, above which the dot products are as fast: MinAtar's dense
    /// layer at batch 32 (1024 -> 128, AMD Zen 4) took 77 us on the copy against about 90 us
    /// with the dot products at 0.64 nonzero (a DQN's first 40,000 frames), 75 us against 98 us
    /// at about 0.5 (100,000 frames), in profiles of the whole agent.
    const MAX_DENSITY: f32 = 0.7;
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            let x = &x[..x.len().min(SAMPLE)];
            return nonzero_at_most(x, (MAX_DENSITY * x.len() as f32) as usize);
        }
    }
    let _ = x;
    false
}

/// Whether at most `limit` of `x`'s values are nonzero (NaN counts), read a block at a time
/// until the count passes it: a convolution's test of its input before a pass over the
/// nonzero values only, which reads little of a dense input.
#[doc(hidden)]
pub fn nonzero_at_most(x: &[f32], limit: usize) -> bool {
    const BLOCK: usize = 256;
    let mut count = 0;
    for block in x.chunks(BLOCK) {
        count += nonzero(block);
        if count > limit {
            return false;
        }
    }
    true
}

/// Nonzero values of `x` (NaN counts).
fn nonzero(x: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            // SAFETY: AVX-512F and POPCNT are present ([`crate::simd::avx512`]).
            return unsafe { avx512::nonzero(x) };
        }
    }
    x.iter().filter(|v| **v != 0.0).count()
}

/// The length of [`transpose`]'s copy of an `oc x ic` layer's weights.
#[doc(hidden)]
pub const fn transposed_len(oc: usize, ic: usize) -> usize {
    ic.div_ceil(8) * 8 * oc
}

/// The weights `w` (`oc` rows of `ic`) transposed into `out` class by class: input `k`'s
/// weights (`oc` values) are row `(k % 8) * ic.div_ceil(8) + k / 8`, so that a class's inputs
/// lie in order, one row apart; rows of no input are zeros.
#[doc(hidden)]
pub fn transpose(w: &[f32], oc: usize, ic: usize, out: &mut [f32]) {
    assert!(w.len() >= oc * ic && out.len() >= transposed_len(oc, ic));
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx2_fma() {
            // SAFETY: AVX is present; the lengths are checked above.
            unsafe { avx512::transpose(w, oc, ic, out) };
            return;
        }
    }
    let q = ic.div_ceil(8);
    for o in 0..oc {
        for k in 0..ic {
            out[((k % 8) * q + k / 8) * oc + o] = w[o * ic + k];
        }
    }
    for k in ic..q * 8 {
        out[((k % 8) * q + k / 8) * oc..][..oc].fill(0.0);
    }
}

// Index loops over the passes' rows and vectors, as `crate::wide` writes them.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use crate::wide::{lanes, Dense};
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    /// Rows and output vectors of a pass: 16 accumulators, each weight load feeding 4 rows.
    const ROWS: usize = 4;
    const VECS: usize = 4;
    /// Output vectors of a pass over one row (one action): 8 accumulators per class, the
    /// multiply-adds in flight that two a cycle of 4 cycles' latency need, where 4 rows of a
    /// 4-vector block would be three quarters repeats of the row.
    const VECS_ONE_ROW: usize = 8;

    /// [`super::transpose`] in 8 x 8 blocks (scalar at the edges).
    #[target_feature(enable = "avx2")]
    pub unsafe fn transpose(w: &[f32], oc: usize, ic: usize, out: &mut [f32]) {
        let q = ic.div_ceil(8);
        let row = |k: usize| (k % 8) * q + k / 8;
        let (whole_o, whole_k) = (oc / 8 * 8, ic / 8 * 8);
        // Inputs outside: each block of 8 rows of `out` is written in order, while the lines
        // of `w` it reads half of stay in cache for the next.
        for k0 in (0..ic).step_by(8) {
            for o0 in (0..oc).step_by(8) {
                if o0 < whole_o && k0 < whole_k {
                    // The block's rows of `out` are `row(k0) + j * q` for `k0 + j`.
                    let dst = out.as_mut_ptr().add(row(k0) * oc + o0);
                    block(w.as_ptr().add(o0 * ic + k0), ic, dst, q * oc);
                    continue;
                }
                for o in o0..oc.min(o0 + 8) {
                    for k in k0..ic.min(k0 + 8) {
                        out[row(k) * oc + o] = w[o * ic + k];
                    }
                }
            }
        }
        // The rows of the inputs past `ic` in the last round of classes.
        for k in ic..q * 8 {
            out[row(k) * oc..][..oc].fill(0.0);
        }
    }

    /// An 8 x 8 block transposed: `src` rows `ld` apart into `dst` rows `ldd` apart.
    #[inline(always)]
    unsafe fn block(src: *const f32, ld: usize, dst: *mut f32, ldd: usize) {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * ld)));
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xee>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xee>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xee>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xee>(t5, t7);
        let c = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (j, c) in c.iter().enumerate() {
            _mm256_storeu_ps(dst.add(j * ldd), *c);
        }
    }

    /// Nonzero values of `x` (NaN counts).
    #[target_feature(enable = "avx512f,popcnt")]
    pub unsafe fn nonzero(x: &[f32]) -> usize {
        let mut count = 0;
        for k in (0..x.len()).step_by(16) {
            let m = lanes(x.len() - k);
            let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(k));
            count += _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(m, v, _mm512_setzero_ps()).count_ones();
        }
        count as usize
    }

    std::thread_local! {
        /// Each class's inputs (`k % 8`) nonzero in a pair of rows, kept from call to call.
        static LISTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    /// [`super::super::dense`] over `d.wt`: groups of `ROWS` rows, blocks of `16 * VECS`
    /// output channels (a row alone: blocks of `16 * VECS_ONE_ROW`).
    pub unsafe fn dense(d: &Dense, x: *const f32, bias: *const f32, y: *mut f32) {
        // The borrow ends with the closure, and nothing else borrows the lists: it cannot fail.
        LISTS.with(|l| run(d, x, bias, y, &mut l.borrow_mut()));
    }

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn run(d: &Dense, x: *const f32, bias: *const f32, y: *mut f32, lists: &mut Vec<u32>) {
        // Class `j`'s inputs (`k / 8`) at `lists[j * cap..]`, and a slot past them for the
        // appends of lanes past `ic`.
        let cap = d.ic.div_ceil(8) + 1;
        lists.resize(8 * cap, 0);
        let mut r = 0;
        while r < d.rows {
            let count = (d.rows - r).min(ROWS);
            // Past the group's rows, its last row again (computed, not stored).
            let rows: [*const f32; ROWS] =
                std::array::from_fn(|i| x.add((r + i.min(count - 1)) * d.ic));
            let mut lens = [0usize; 8];
            for k0 in (0..d.ic).step_by(16) {
                let m = lanes(d.ic - k0);
                let zero = _mm512_setzero_ps();
                let mut set = 0u16;
                for row in rows {
                    let v = _mm512_maskz_loadu_ps(m, row.add(k0));
                    set |= _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(m, v, zero);
                }
                // Branch-free appends: lane `b` is input `k0 + b`, of class `b % 8`.
                for b in 0..16 {
                    let j = b % 8;
                    *lists.get_unchecked_mut(j * cap + lens[j]) = ((k0 + b) / 8) as u32;
                    lens[j] += usize::from(set >> b & 1 == 1);
                }
            }
            let width = if count == 1 { VECS_ONE_ROW } else { VECS };
            for c0 in (0..d.cols).step_by(16 * width) {
                let t = Pass {
                    d,
                    rows,
                    count,
                    lists: lists.as_ptr(),
                    cap,
                    lens,
                    c0,
                    bias,
                    y: y.add(r * d.ldy),
                };
                match ((d.cols - c0).div_ceil(16).min(width), count) {
                    (8, 1) => pass::<1, 8>(&t),
                    (7, 1) => pass::<1, 7>(&t),
                    (6, 1) => pass::<1, 6>(&t),
                    (5, 1) => pass::<1, 5>(&t),
                    (4, 1) => pass::<1, 4>(&t),
                    (3, 1) => pass::<1, 3>(&t),
                    (2, 1) => pass::<1, 2>(&t),
                    (_, 1) => pass::<1, 1>(&t),
                    (4, _) => pass::<ROWS, 4>(&t),
                    (3, _) => pass::<ROWS, 3>(&t),
                    (2, _) => pass::<ROWS, 2>(&t),
                    _ => pass::<ROWS, 1>(&t),
                }
            }
            r += count;
        }
    }

    /// A group of rows (`count` of them stored) against a block of output channels.
    struct Pass<'a> {
        d: &'a Dense,
        rows: [*const f32; ROWS],
        count: usize,
        lists: *const u32,
        cap: usize,
        lens: [usize; 8],
        c0: usize,
        bias: *const f32,
        y: *mut f32,
    }

    /// `V` vectors of output channels from `c0` on, for the group's first `R` rows (`R` is 1
    /// or `ROWS`, at least `count`): each class's partial sums over its listed inputs, then
    /// the classes summed as the 8-lane kernel sums its lanes.
    #[inline(always)]
    unsafe fn pass<const R: usize, const V: usize>(t: &Pass) {
        debug_assert!(t.count <= R && R <= ROWS);
        let d = t.d;
        let last = lanes(d.cols - t.c0 - 16 * (V - 1));
        let q = d.ic.div_ceil(8);
        // part[j][row][v]: class `j`'s partial sums.
        let mut part = [[[_mm512_setzero_ps(); V]; R]; 8];
        for (j, part) in part.iter_mut().enumerate() {
            let list = t.lists.add(j * t.cap);
            // The class's rows of the copy, in order, and its inputs of each row.
            let wt = d.wt.add(j * q * d.ldt + t.c0);
            let xs: [*const f32; R] = std::array::from_fn(|i| t.rows[i].add(j));
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            for i in 0..t.lens[j] {
                let m = *list.add(i) as usize;
                let row = wt.add(m * d.ldt);
                let mut w = [_mm512_setzero_ps(); V];
                for v in 0..V {
                    w[v] = if v + 1 == V {
                        _mm512_maskz_loadu_ps(last, row.add(16 * v))
                    } else {
                        _mm512_loadu_ps(row.add(16 * v))
                    };
                }
                for r in 0..R {
                    let xv = _mm512_set1_ps(*xs[r].add(8 * m));
                    for v in 0..V {
                        acc[r][v] = _mm512_fmadd_ps(xv, w[v], acc[r][v]);
                    }
                }
            }
            *part = acc;
        }
        for row in 0..t.count {
            let y = t.y.add(row * d.ldy);
            for v in 0..V {
                let p = |j: usize| part[j][row][v];
                // The tree of `Avx2F32::sums`: halves, lanes two apart, neighbours.
                let dot = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(p(0), p(4)), _mm512_add_ps(p(2), p(6))),
                    _mm512_add_ps(_mm512_add_ps(p(1), p(5)), _mm512_add_ps(p(3), p(7))),
                );
                let m = if v + 1 == V { last } else { 0xffff };
                let c = t.c0 + 16 * v;
                let out = _mm512_add_ps(_mm512_maskz_loadu_ps(m, t.bias.add(c)), dot);
                _mm512_mask_storeu_ps(y.add(c), m, out);
            }
        }
    }
}
