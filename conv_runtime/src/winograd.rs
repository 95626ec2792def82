//! Winograd convolution on 4x4 input tiles: the tile transforms of the generated F(2x2, 3x3)
//! (stride-1 3x3 layers) and F(3x3, 2x2) (stride-2 4x4 layers, as 2x2 convolutions of the
//! space-to-depth input) kernels.
//!
//! An `m x m` output tile of an `r x r` kernel `g` over a 4x4 input tile `d` (`m + r - 1 = 4`)
//! is `Y = A^T [(G g G^T) * (B^T d B)] A`, with `*` element-wise: 16 multiplies per tile and
//! channel pair instead of 36. Summed over input channels, the 16 element-wise products become
//! 16 matrix products (tiles x input channels times input channels x output channels), which the
//! generated code runs with its register-blocked kernels. These are the transforms around them,
//! one vector of channels at a time, and their adjoints, which give the gradients by the same
//! matrix products:
//! - weights: `dg = G^T [sum over tiles (B^T d B) * (A dY A^T)] G`;
//! - input: `dd = B [(G g G^T) * (A dY A^T)] B^T`, added into the overlapping input tiles.
//!
//! The transforms only add and subtract (the halves of `G` are applied once, to the weights),
//! so the rounding differs from the direct sum by a few units in the last place. Tiles and
//! kernels are `[S; 4]` / `[R; 4]` arrays whatever `m` and `r`; entries past them are unused.

// The transforms index the rows and columns of 4x4 matrices, as they are written on paper.
#![allow(clippy::needless_range_loop)]

use crate::element::Real;
use crate::simd::Simd;

/// One Winograd algorithm: its output tile `M`, kernel `R` and the 1-D transforms.
pub trait Variant {
    /// Output tile size.
    const M: usize;
    /// Kernel size.
    const R: usize;
    /// `B^T x`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn bt<S: Simd>(x: [S; 4]) -> [S; 4];
    /// `B x`, the adjoint of `bt`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn b<S: Simd>(x: [S; 4]) -> [S; 4];
    /// `A^T x` (first `M` entries).
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn at<S: Simd>(x: [S; 4]) -> [S; 4];
    /// `A y` of the first `M` entries of `y`, the adjoint of `at`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn a<S: Simd>(y: [S; 4]) -> [S; 4];
    /// `G x` of the first `R` entries of `x`.
    fn g<T: Real>(x: [T; 4]) -> [T; 4];
    /// `G^T x` (first `R` entries), the adjoint of `g`.
    fn gt<T: Real>(x: [T; 4]) -> [T; 4];
}

/// F(2x2, 3x3), interpolation points 0, 1, -1 and infinity.
pub struct F2x3;

/// F(3x3, 2x2), interpolation points 0, 1, -1 and infinity.
pub struct F3x2;

impl Variant for F2x3 {
    const M: usize = 2;
    const R: usize = 3;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; 4]) -> [S; 4] {
        [
            x[0].sub(x[2]),
            x[1].add(x[2]),
            x[2].sub(x[1]),
            x[1].sub(x[3]),
        ]
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; 4]) -> [S; 4] {
        [
            x[0],
            x[1].sub(x[2]).add(x[3]),
            x[1].add(x[2]).sub(x[0]),
            S::zero().sub(x[3]),
        ]
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; 4]) -> [S; 4] {
        let z = S::zero();
        [x[0].add(x[1]).add(x[2]), x[1].sub(x[2]).sub(x[3]), z, z]
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; 4]) -> [S; 4] {
        [y[0], y[0].add(y[1]), y[0].sub(y[1]), S::zero().sub(y[1])]
    }
    #[inline(always)]
    fn g<T: Real>(x: [T; 4]) -> [T; 4] {
        let half = T::from_f64(0.5);
        [
            x[0],
            (x[0] + x[1] + x[2]) * half,
            (x[0] - x[1] + x[2]) * half,
            x[2],
        ]
    }
    #[inline(always)]
    fn gt<T: Real>(x: [T; 4]) -> [T; 4] {
        let half = T::from_f64(0.5);
        [
            x[0] + (x[1] + x[2]) * half,
            (x[1] - x[2]) * half,
            (x[1] + x[2]) * half + x[3],
            T::zero(),
        ]
    }
}

impl Variant for F3x2 {
    const M: usize = 3;
    const R: usize = 2;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; 4]) -> [S; 4] {
        [
            x[0].sub(x[2]),
            x[1].add(x[2]),
            x[2].sub(x[1]),
            x[3].sub(x[1]),
        ]
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; 4]) -> [S; 4] {
        [
            x[0],
            x[1].sub(x[2]).sub(x[3]),
            x[1].add(x[2]).sub(x[0]),
            x[3],
        ]
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; 4]) -> [S; 4] {
        [
            x[0].add(x[1]).add(x[2]),
            x[1].sub(x[2]),
            x[1].add(x[2]).add(x[3]),
            S::zero(),
        ]
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; 4]) -> [S; 4] {
        [
            y[0],
            y[0].add(y[1]).add(y[2]),
            y[0].sub(y[1]).add(y[2]),
            y[2],
        ]
    }
    #[inline(always)]
    fn g<T: Real>(x: [T; 4]) -> [T; 4] {
        let half = T::from_f64(0.5);
        [x[0], (x[0] + x[1]) * half, (x[0] - x[1]) * half, x[1]]
    }
    #[inline(always)]
    fn gt<T: Real>(x: [T; 4]) -> [T; 4] {
        let half = T::from_f64(0.5);
        [
            x[0] + (x[1] + x[2]) * half,
            (x[1] - x[2]) * half + x[3],
            T::zero(),
            T::zero(),
        ]
    }
}

/// `B^T d B` of one vector of channels: `d[i][j]` at `x + i * row + j * col`; element `e` of
/// the result is stored at `v + e * stride`.
///
/// # Safety
/// Every address read or written holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn input<V: Variant, S: Simd>(
    x: *const S::Elem,
    row: usize,
    col: usize,
    v: *mut S::Elem,
    stride: usize,
) {
    let mut t = [[S::zero(); 4]; 4];
    for j in 0..4 {
        let c = V::bt([0, 1, 2, 3].map(|i| S::load(x.add(i * row + j * col))));
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    for (i, ti) in t.into_iter().enumerate() {
        for (j, r) in V::bt(ti).into_iter().enumerate() {
            r.store(v.add((4 * i + j) * stride));
        }
    }
}

/// `A^T m A` of one vector of channels, element `e` of `m` at `m + e * stride`: the output
/// tile, `[row][column]` (the first `M` of each).
///
/// # Safety
/// Every address read holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn output<V: Variant, S: Simd>(m: *const S::Elem, stride: usize) -> [[S; 4]; 4] {
    let mut t = [[S::zero(); 4]; 4];
    for j in 0..4 {
        let c = V::at([0, 1, 2, 3].map(|i| S::load(m.add((4 * i + j) * stride))));
        for i in 0..V::M {
            t[i][j] = c[i];
        }
    }
    let mut y = [[S::zero(); 4]; 4];
    for i in 0..V::M {
        y[i] = V::at(t[i]);
    }
    y
}

/// `A dy A^T` of an output-gradient tile (`[row][column]`, the first `M` of each), element
/// `e` stored at `n + e * stride`.
///
/// # Safety
/// Every address written holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn gradient<V: Variant, S: Simd>(dy: [[S; 4]; 4], n: *mut S::Elem, stride: usize) {
    let mut t = [[S::zero(); 4]; 4];
    for j in 0..V::M {
        let c = V::a([dy[0][j], dy[1][j], dy[2][j], dy[3][j]]);
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    for (i, ti) in t.into_iter().enumerate() {
        for (j, r) in V::a(ti).into_iter().enumerate() {
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
pub unsafe fn input_gradient<V: Variant, S: Simd>(
    dv: *const S::Elem,
    stride: usize,
    x: *mut S::Elem,
    row: usize,
    col: usize,
) {
    let mut t = [[S::zero(); 4]; 4];
    for j in 0..4 {
        let c = V::b([0, 1, 2, 3].map(|i| S::load(dv.add((4 * i + j) * stride))));
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    for (i, ti) in t.into_iter().enumerate() {
        for (j, r) in V::b(ti).into_iter().enumerate() {
            let p = x.add(i * row + j * col);
            S::load(p).add(r).store(p);
        }
    }
}

/// `G g G^T`: a kernel (`[kh][kw]`, the first `R` of each) in the transformed domain.
#[inline(always)]
pub fn weight<V: Variant, T: Real>(g: [[T; 4]; 4]) -> [[T; 4]; 4] {
    let mut t = [[T::zero(); 4]; 4];
    for j in 0..V::R {
        let c = V::g([g[0][j], g[1][j], g[2][j], g[3][j]]);
        for i in 0..4 {
            t[i][j] = c[i];
        }
    }
    [V::g(t[0]), V::g(t[1]), V::g(t[2]), V::g(t[3])]
}

/// `G^T du G`, the adjoint of [`weight`]: a transformed-domain gradient back to `[kh][kw]`
/// (the first `R` of each).
#[inline(always)]
pub fn weight_gradient<V: Variant, T: Real>(du: [[T; 4]; 4]) -> [[T; 4]; 4] {
    let mut t = [[T::zero(); 4]; 4];
    for j in 0..4 {
        let c = V::gt([du[0][j], du[1][j], du[2][j], du[3][j]]);
        for i in 0..V::R {
            t[i][j] = c[i];
        }
    }
    let mut g = [[T::zero(); 4]; 4];
    for i in 0..V::R {
        g[i] = V::gt(t[i]);
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::PortableF64;

    type S = PortableF64;
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

    fn lane(v: S, lane: usize) -> f64 {
        let mut tmp = [0.0; L];
        unsafe { v.store(tmp.as_mut_ptr()) };
        tmp[lane]
    }

    /// One channel pair per lane: a tile through the transforms against the direct sums, for
    /// the output, the weight gradient and the input gradient.
    fn tile_matches_direct<V: Variant>() {
        let (m, r) = (V::M, V::R);
        let d = values(1, 16 * L);
        let g = values(2, r * r * L);
        let dy = values(3, m * m * L);
        let mut v = vec![0.0; 16 * L];
        let mut n = vec![0.0; 16 * L];
        let dyv: [[S; 4]; 4] = std::array::from_fn(|i| {
            std::array::from_fn(|j| {
                if i < m && j < m {
                    unsafe { S::load(dy[(i * m + j) * L..].as_ptr()) }
                } else {
                    unsafe { S::zero() }
                }
            })
        });
        unsafe {
            input::<V, S>(d.as_ptr(), 4 * L, L, v.as_mut_ptr(), L);
            gradient::<V, S>(dyv, n.as_mut_ptr(), L);
        }
        for ln in 0..L {
            let di = |i: usize, j: usize| d[(i * 4 + j) * L + ln];
            let gi = |i: usize, j: usize| g[(i * r + j) * L + ln];
            let dyi = |i: usize, j: usize| dy[(i * m + j) * L + ln];
            let gk: [[f64; 4]; 4] = std::array::from_fn(|i| {
                std::array::from_fn(|j| if i < r && j < r { gi(i, j) } else { 0.0 })
            });
            let u = weight::<V, f64>(gk);
            // Output: A^T (U * V) A.
            let mut mm = vec![0.0; 16 * L];
            for e in 0..16 {
                mm[e * L + ln] = u[e / 4][e % 4] * v[e * L + ln];
            }
            let y = unsafe { output::<V, S>(mm.as_ptr(), L) };
            for i in 0..m {
                for j in 0..m {
                    let direct: f64 = (0..r * r)
                        .map(|k| gi(k / r, k % r) * di(i + k / r, j + k % r))
                        .sum();
                    assert!(close(lane(y[i][j], ln), direct), "y[{i}][{j}]");
                }
            }
            // Weight gradient: G^T (V * N) G.
            let du: [[f64; 4]; 4] = std::array::from_fn(|i| {
                std::array::from_fn(|j| v[(i * 4 + j) * L + ln] * n[(i * 4 + j) * L + ln])
            });
            let dg = weight_gradient::<V, f64>(du);
            for kh in 0..r {
                for kw in 0..r {
                    let direct: f64 = (0..m * m)
                        .map(|q| dyi(q / m, q % m) * di(q / m + kh, q % m + kw))
                        .sum();
                    assert!(close(dg[kh][kw], direct), "dg[{kh}][{kw}]");
                }
            }
            // Input gradient: B (U * N) B^T, added into the tile.
            let mut dv = vec![0.0; 16 * L];
            for e in 0..16 {
                dv[e * L + ln] = u[e / 4][e % 4] * n[e * L + ln];
            }
            let mut dd = vec![0.5; 16 * L];
            unsafe { input_gradient::<V, S>(dv.as_ptr(), L, dd.as_mut_ptr(), 4 * L, L) };
            for i in 0..4 {
                for j in 0..4 {
                    let mut direct = 0.5;
                    for q in 0..m * m {
                        let (a, b) = (q / m, q % m);
                        if (a..a + r).contains(&i) && (b..b + r).contains(&j) {
                            direct += dyi(a, b) * gi(i - a, j - b);
                        }
                    }
                    assert!(close(dd[(i * 4 + j) * L + ln], direct), "dd[{i}][{j}]");
                }
            }
        }
    }

    #[test]
    fn f2x3_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F2x3>();
    }

    #[test]
    fn f3x2_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F3x2>();
    }
}
