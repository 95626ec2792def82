//! Winograd F(2x2, 3x3): the tile transforms of the generated stride-1 3x3 convolutions.
//!
//! A 2x2 output tile of a 3x3 kernel `g` over a 4x4 input tile `d` is
//! `Y = A^T [(G g G^T) * (B^T d B)] A`, with `*` element-wise: 16 multiplies per tile and
//! channel pair instead of 36. Summed over input channels, the 16 element-wise products become
//! 16 matrix products (tiles x input channels times input channels x output channels), which the
//! generated code runs with its register-blocked kernels. These are the transforms around them,
//! one vector of channels at a time, and their adjoints, which give the gradients by the same
//! matrix products:
//! - weights: `dg = G^T [sum over tiles (B^T d B) * (A dY A^T)] G`;
//! - input: `dd = B [(G g G^T) * (A dY A^T)] B^T`, added into the overlapping input tiles.
//!
//! The transforms only add and subtract (the halves of `G` are applied once, to the weights),
//! so the rounding differs from the direct sum by a few units in the last place.

// The transforms index the rows and columns of 4x4 matrices, as they are written on paper.
#![allow(clippy::needless_range_loop)]

use crate::element::Real;
use crate::simd::Simd;

/// `B^T x`.
#[inline(always)]
unsafe fn bt<S: Simd>(x: [S; 4]) -> [S; 4] {
    [
        x[0].sub(x[2]),
        x[1].add(x[2]),
        x[2].sub(x[1]),
        x[1].sub(x[3]),
    ]
}

/// `B x`, the adjoint of [`bt`].
#[inline(always)]
unsafe fn b<S: Simd>(x: [S; 4]) -> [S; 4] {
    [
        x[0],
        x[1].sub(x[2]).add(x[3]),
        x[1].add(x[2]).sub(x[0]),
        S::zero().sub(x[3]),
    ]
}

/// `A^T x`.
#[inline(always)]
unsafe fn at<S: Simd>(x: [S; 4]) -> [S; 2] {
    [x[0].add(x[1]).add(x[2]), x[1].sub(x[2]).sub(x[3])]
}

/// `A x`, the adjoint of [`at`].
#[inline(always)]
unsafe fn a<S: Simd>(x: [S; 2]) -> [S; 4] {
    [x[0], x[0].add(x[1]), x[0].sub(x[1]), S::zero().sub(x[1])]
}

/// `B^T d B` of one vector of channels: `d[i][j]` at `x + i * row + j * col`; element `e` of
/// the result is stored at `v + e * stride`.
///
/// # Safety
/// Every address read or written holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn input<S: Simd>(
    x: *const S::Elem,
    row: usize,
    col: usize,
    v: *mut S::Elem,
    stride: usize,
) {
    let mut t = [[S::zero(); 4]; 4];
    for j in 0..4 {
        let c = bt([0, 1, 2, 3].map(|i| S::load(x.add(i * row + j * col))));
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    for (i, ti) in t.into_iter().enumerate() {
        for (j, r) in bt(ti).into_iter().enumerate() {
            r.store(v.add((4 * i + j) * stride));
        }
    }
}

/// `A^T m A` of one vector of channels, element `e` of `m` at `m + e * stride`: the 2x2 output
/// tile, `[row][column]`.
///
/// # Safety
/// Every address read holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn output<S: Simd>(m: *const S::Elem, stride: usize) -> [[S; 2]; 2] {
    let mut t = [[S::zero(); 4]; 2];
    for j in 0..4 {
        let c = at([0, 1, 2, 3].map(|i| S::load(m.add((4 * i + j) * stride))));
        t[0][j] = c[0];
        t[1][j] = c[1];
    }
    [at(t[0]), at(t[1])]
}

/// `A dy A^T` of a 2x2 output-gradient tile (`[row][column]`), element `e` stored at
/// `n + e * stride`.
///
/// # Safety
/// Every address written holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn gradient<S: Simd>(dy: [[S; 2]; 2], n: *mut S::Elem, stride: usize) {
    let mut t = [[S::zero(); 2]; 4];
    for j in 0..2 {
        let c = a([dy[0][j], dy[1][j]]);
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    for (i, ti) in t.into_iter().enumerate() {
        for (j, r) in a(ti).into_iter().enumerate() {
            r.store(n.add((4 * i + j) * stride));
        }
    }
}

/// Adds `B dv B^T` (element `e` of `dv` at `dv + e * stride`) into the input tile
/// `x + i * row + j * col`.
///
/// # Safety
/// Every address read or written holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn input_gradient<S: Simd>(
    dv: *const S::Elem,
    stride: usize,
    x: *mut S::Elem,
    row: usize,
    col: usize,
) {
    let mut t = [[S::zero(); 4]; 4];
    for j in 0..4 {
        let c = b([0, 1, 2, 3].map(|i| S::load(dv.add((4 * i + j) * stride))));
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    for (i, ti) in t.into_iter().enumerate() {
        for (j, r) in b(ti).into_iter().enumerate() {
            let p = x.add(i * row + j * col);
            S::load(p).add(r).store(p);
        }
    }
}

/// `G g G^T`: a 3x3 kernel (`[kh][kw]`) in the transformed domain.
#[inline(always)]
pub fn weight<R: Real>(g: [[R; 3]; 3]) -> [[R; 4]; 4] {
    let half = R::from_f64(0.5);
    let gm = |x: [R; 3]| {
        [
            x[0],
            (x[0] + x[1] + x[2]) * half,
            (x[0] - x[1] + x[2]) * half,
            x[2],
        ]
    };
    let mut t = [[R::zero(); 3]; 4];
    for j in 0..3 {
        let c = gm([g[0][j], g[1][j], g[2][j]]);
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    [gm(t[0]), gm(t[1]), gm(t[2]), gm(t[3])]
}

/// `G^T du G`, the adjoint of [`weight`]: a transformed-domain gradient back to `[kh][kw]`.
#[inline(always)]
pub fn weight_gradient<R: Real>(du: [[R; 4]; 4]) -> [[R; 3]; 3] {
    let half = R::from_f64(0.5);
    let gt = |x: [R; 4]| {
        [
            x[0] + (x[1] + x[2]) * half,
            (x[1] - x[2]) * half,
            (x[1] + x[2]) * half + x[3],
        ]
    };
    let mut t = [[R::zero(); 4]; 3];
    for j in 0..4 {
        let c = gt([du[0][j], du[1][j], du[2][j], du[3][j]]);
        for i in 0..3 {
            t[i][j] = c[i];
        }
    }
    [gt(t[0]), gt(t[1]), gt(t[2])]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::PortableF64;

    type V = PortableF64;
    const L: usize = 4;

    /// Deterministic values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + b.abs())
    }

    /// One channel pair, lanes independent: the transforms against the direct sums.
    #[test]
    fn tile_matches_direct_convolution_and_its_gradients() {
        // d[i][j][lane], g[kh][kw][lane], dy[r][c][lane]
        let d = values(1, 16 * L);
        let g = values(2, 9 * L);
        let dy = values(3, 4 * L);
        for lane in 0..L {
            let di = |i: usize, j: usize| d[(i * 4 + j) * L + lane];
            let gi = |i: usize, j: usize| g[(i * 3 + j) * L + lane];
            let dyi = |i: usize, j: usize| dy[(i * 2 + j) * L + lane];
            // Transformed weights, element-wise product with the transformed input.
            let u = weight([0, 1, 2].map(|i| [0, 1, 2].map(|j| gi(i, j))));
            let mut v = vec![0.0; 16 * L];
            let mut n = vec![0.0; 16 * L];
            let mut m = vec![0.0; 16 * L];
            unsafe {
                input::<V>(d.as_ptr(), 4 * L, L, v.as_mut_ptr(), L);
                let dyv = [0, 1].map(|i| [0, 1].map(|j| V::load(dy[(i * 2 + j) * L..].as_ptr())));
                gradient::<V>(dyv, n.as_mut_ptr(), L);
            }
            for e in 0..16 {
                m[e * L + lane] = u[e / 4][e % 4] * v[e * L + lane];
            }
            let mut y = [[0.0; 2]; 2];
            unsafe {
                let out = output::<V>(m.as_ptr(), L);
                for (r, row) in out.iter().enumerate() {
                    let mut tmp = [0.0; L];
                    for c in 0..2 {
                        row[c].store(tmp.as_mut_ptr());
                        y[r][c] = tmp[lane];
                    }
                }
            }
            for r in 0..2 {
                for c in 0..2 {
                    let direct: f64 = (0..9)
                        .map(|k| gi(k / 3, k % 3) * di(r + k / 3, c + k % 3))
                        .sum();
                    assert!(
                        close(y[r][c], direct),
                        "y[{r}][{c}] {} vs {direct}",
                        y[r][c]
                    );
                }
            }
            // Weight gradient: G^T (V * N) G.
            let du = [0, 1, 2, 3].map(|i| {
                [0, 1, 2, 3].map(|j| v[(i * 4 + j) * L + lane] * n[(i * 4 + j) * L + lane])
            });
            let dg = weight_gradient(du);
            for kh in 0..3 {
                for kw in 0..3 {
                    let direct: f64 = (0..4)
                        .map(|q| dyi(q / 2, q % 2) * di(q / 2 + kh, q % 2 + kw))
                        .sum();
                    assert!(close(dg[kh][kw], direct), "dg[{kh}][{kw}]");
                }
            }
            // Input gradient: B (U * N) B^T, added into the tile.
            let mut dv = vec![0.0; 16 * L];
            for e in 0..16 {
                dv[e * L + lane] = u[e / 4][e % 4] * n[e * L + lane];
            }
            let mut dd = vec![0.5; 16 * L];
            unsafe { input_gradient::<V>(dv.as_ptr(), L, dd.as_mut_ptr(), 4 * L, L) };
            for i in 0..4 {
                for j in 0..4 {
                    let mut direct = 0.5;
                    for q in 0..4 {
                        let (r, c) = (q / 2, q % 2);
                        if (r..r + 3).contains(&i) && (c..c + 3).contains(&j) {
                            direct += dyi(r, c) * gi(i - r, j - c);
                        }
                    }
                    assert!(close(dd[(i * 4 + j) * L + lane], direct), "dd[{i}][{j}]");
                }
            }
        }
    }
}
