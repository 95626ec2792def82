//! The Winograd layers' matrix products on AVX-512's 16-lane registers, where the CPU has them.
//!
//! Generated kernels are written for 8-lane vectors, so that their blocking and the packed
//! weights are the same on every x86-64 CPU. A Winograd layer spends most of its time in the
//! products of its tile elements (tiles x channels times channels x channels), whose packed
//! weights hold each block's 16 (or 24, or 8) output columns side by side for every reduction
//! step: one zmm register covers two of the AVX2 kernel's vectors, and a CPU with two 512-bit
//! FMA units issues twice the multiply-adds per cycle. Every output is the same chain of fused
//! multiply-adds in the same order as in the AVX2 kernel (from zero, over the reduction in
//! order), so the bits do not change, and a layer gives the same results on either.

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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Product;
    use std::arch::x86_64::*;

    /// Rows per register tile: as the AVX2 tiles, each row's pointer needs a register.
    const ROWS: usize = 6;

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
        let ws = [w.add(c[0].w), w.add(c[1].w)];
        // One pointer per row, indexed by the step: the rows' offsets are not recomputed.
        let mut rows = [a; P];
        for (i, r) in rows.iter_mut().enumerate() {
            *r = a.add(i * k);
        }
        for j in 0..k {
            let mut wv = [_mm512_setzero_ps(); 2];
            for z in 0..Z {
                wv[z] = _mm512_maskz_loadu_ps(c[z].mask, ws[z].add(j * c[z].stride));
            }
            for (acc, r) in acc.iter_mut().zip(&rows) {
                let x = _mm512_set1_ps(*r.add(j));
                for z in 0..Z {
                    acc[z] = _mm512_fmadd_ps(x, wv[z], acc[z]);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            for z in 0..Z {
                _mm512_mask_storeu_ps(o.add(i * n + c[z].col), c[z].mask, acc[z]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                for count in [1, 5, 6, 7, 12, 13] {
                    let p = Product {
                        elems: 3,
                        rows: 14,
                        k,
                        n,
                        block,
                    };
                    let a: Vec<f32> = (0..p.elems * p.rows * k)
                        .map(|_| rng.uniform(-1.0, 1.0) as f32)
                        .collect();
                    let w: Vec<f32> = (0..p.elems * k * n)
                        .map(|_| rng.uniform(-1.0, 1.0) as f32)
                        .collect();
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
