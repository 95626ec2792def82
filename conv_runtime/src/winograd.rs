//! Winograd convolution: the tile transforms of the generated F(2x2, 3x3) and F(4x4, 3x3)
//! (stride-1 3x3 layers), F(2x2, 3x3) at stride 2 (stride-2 3x3 layers), F(3x3, 2x2) and
//! F(5x5, 2x2) (kernels twice their stride, as 2x2 convolutions of the space-to-depth input)
//! kernels, and the packing of their transformed weights ([`pack`]), compiled once per variant
//! rather than in every layer.
//!
//! An `m x m` output tile of an `r x r` kernel `g` over an `n x n` input tile `d`
//! (`n = m + r - 1`, or `2 (m - 1) + r` at stride 2) is `Y = A^T [(G g G^T) * (B^T d B)] A`, with `*` element-wise: `n^2`
//! multiplies per tile and channel pair instead of `m^2 r^2` (16 for 36, 36 for 144 or 100). Summed over
//! input channels, the `n^2` element-wise products become matrix products (tiles x input channels times input channels x output channels), which the
//! generated code runs with its register-blocked kernels. These are the transforms around them,
//! one vector of channels at a time, and their adjoints, which give the gradients by the same
//! matrix products:
//! - weights: `dg = G^T [sum over tiles (B^T d B) * (A dY A^T)] G`;
//! - input: `dd = B [(G g G^T) * (A dY A^T)] B^T`, added into the overlapping input tiles.
//!
//! F(2x2, 3x3), its stride-2 form and F(3x3, 2x2) only add and subtract (the halves of `G` are
//! applied once, to the weights), so their rounding differs from the direct sum by a few units in the last
//! place; F(4x4, 3x3) and F(5x5, 2x2) also scale by powers of 2 up to 16 and by 5, 1/6 and 1/24,
//! and their error is larger (the generated layers' tests hold it to the direct kernels'
//! tolerance). Tiles and kernels are `[S; 6]` / `[T; 6]` arrays whatever `n`, `m` and `r`;
//! entries past them are unused.

// The transforms index the rows and columns of 4x4 matrices, as they are written on paper.
#![allow(clippy::needless_range_loop)]

use crate::simd::Simd;
use std::ops::Range;

pub mod tiles;

/// Entries of the arrays the transforms work on: the largest tile.
pub const MAX: usize = 6;

/// One Winograd algorithm: its input tile `N`, output tile `M`, kernel `R` and the 1-D
/// transforms.
pub trait Variant {
    /// Input tile size.
    const N: usize;
    /// Output tile size.
    const M: usize;
    /// Kernel size.
    const R: usize;
    /// The convolution's stride inside a tile: input tiles (`N = STRIDE * (M - 1) + R`) start
    /// `STRIDE * M` apart.
    const STRIDE: usize = 1;
    /// `B^T x`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn bt<S: Simd>(x: [S; MAX]) -> [S; MAX];
    /// `B x`, the adjoint of `bt`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn b<S: Simd>(x: [S; MAX]) -> [S; MAX];
    /// `A^T x` (first `M` entries).
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn at<S: Simd>(x: [S; MAX]) -> [S; MAX];
    /// `A y` of the first `M` entries of `y`, the adjoint of `at`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn a<S: Simd>(y: [S; MAX]) -> [S; MAX];
    /// `G x` of the first `R` entries of `x`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn g<S: Simd>(x: [S; MAX]) -> [S; MAX];
    /// `G^T x` (first `R` entries), the adjoint of `g`.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn gt<S: Simd>(x: [S; MAX]) -> [S; MAX];
}

/// F(2x2, 3x3), interpolation points 0, 1, -1 and infinity.
pub struct F2x3;

/// F(3x3, 2x2), interpolation points 0, 1, -1 and infinity.
pub struct F3x2;

/// F(4x4, 3x3), interpolation points 0, 1, -1, 2, -2 and infinity.
pub struct F4x3;

/// F(5x5, 2x2), interpolation points 0, 1, -1, 2, -2 and infinity: `6 x 6` multiplies for 25
/// outputs where the direct sum does 100, and [`F4x3`]'s input transform (it depends on the
/// points only).
pub struct F5x2;

/// F(2x2, 3x3) at stride 2, per axis the odd taps (kernel taps 0 and 2 over the tile's even
/// inputs) as F(2, 2) (points 0, -1 and infinity, additions only) and the middle tap (over the
/// odd inputs) as it is: `5 x 5` multiplies for 4 outputs where the direct sum does 36.
pub struct F2x3S2;

impl Variant for F2x3 {
    const N: usize = 4;
    const M: usize = 2;
    const R: usize = 3;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([
            x[0].sub(x[2]),
            x[1].add(x[2]),
            x[2].sub(x[1]),
            x[1].sub(x[3]),
        ])
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let z = S::zero();
        pad([
            x[0],
            x[1].sub(x[2]).add(x[3]),
            x[1].add(x[2]).sub(x[0]),
            z.sub(x[3]),
        ])
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([x[0].add(x[1]).add(x[2]), x[1].sub(x[2]).sub(x[3])])
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; MAX]) -> [S; MAX] {
        let z = S::zero();
        pad([y[0], y[0].add(y[1]), y[0].sub(y[1]), z.sub(y[1])])
    }
    #[inline(always)]
    unsafe fn g<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let h = S::splat(c(0.5));
        let s = x[0].add(x[2]);
        pad([x[0], s.add(x[1]).mul(h), s.sub(x[1]).mul(h), x[2]])
    }
    #[inline(always)]
    unsafe fn gt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let h = S::splat(c(0.5));
        let s = x[1].add(x[2]).mul(h);
        pad([x[0].add(s), x[1].sub(x[2]).mul(h), s.add(x[3])])
    }
}

impl Variant for F3x2 {
    const N: usize = 4;
    const M: usize = 3;
    const R: usize = 2;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([
            x[0].sub(x[2]),
            x[1].add(x[2]),
            x[2].sub(x[1]),
            x[3].sub(x[1]),
        ])
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([
            x[0],
            x[1].sub(x[2]).sub(x[3]),
            x[1].add(x[2]).sub(x[0]),
            x[3],
        ])
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([
            x[0].add(x[1]).add(x[2]),
            x[1].sub(x[2]),
            x[1].add(x[2]).add(x[3]),
        ])
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; MAX]) -> [S; MAX] {
        pad([
            y[0],
            y[0].add(y[1]).add(y[2]),
            y[0].sub(y[1]).add(y[2]),
            y[2],
        ])
    }
    #[inline(always)]
    unsafe fn g<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let h = S::splat(c(0.5));
        pad([x[0], x[0].add(x[1]).mul(h), x[0].sub(x[1]).mul(h), x[1]])
    }
    #[inline(always)]
    unsafe fn gt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let h = S::splat(c(0.5));
        pad([
            x[0].add(x[1].add(x[2]).mul(h)),
            x[1].sub(x[2]).mul(h).add(x[3]),
        ])
    }
}

// F(4x4, 3x3) (Lavin and Gray, 2016):
// B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1]
// G   = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]
// A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
impl Variant for F4x3 {
    const N: usize = 6;
    const M: usize = 4;
    const R: usize = 3;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let (c4, c5, c2) = (S::splat(c(4.0)), S::splat(c(5.0)), S::splat(c(2.0)));
        // Shared sums: x4 - 4 x2 and x3 - 4 x1, x4 - x2 and 2 (x3 - x1).
        let (p, q) = (
            S::fma(c4, S::zero().sub(x[2]), x[4]),
            S::fma(c4, S::zero().sub(x[1]), x[3]),
        );
        let (r, t) = (x[4].sub(x[2]), c2.mul(x[3].sub(x[1])));
        pad([
            S::fma(c4, x[0], S::fma(c5, S::zero().sub(x[2]), x[4])),
            p.add(q),
            p.sub(q),
            r.add(t),
            r.sub(t),
            S::fma(c4, x[1], S::fma(c5, S::zero().sub(x[3]), x[5])),
        ])
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        // Columns of B^T: the adjoint of `bt`.
        let (c4, c5, c2) = (S::splat(c(4.0)), S::splat(c(5.0)), S::splat(c(2.0)));
        let (s12, s34) = (x[1].add(x[2]), x[3].add(x[4]));
        pad([
            c4.mul(x[0]),
            S::fma(c4, x[2].sub(x[1]).add(x[5]), c2.mul(x[4].sub(x[3]))),
            S::zero().sub(S::fma(c5, x[0], S::fma(c4, s12, s34))),
            S::fma(c2, x[3].sub(x[4]), x[1].sub(x[2])).sub(c5.mul(x[5])),
            x[0].add(s12).add(s34),
            x[5],
        ])
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let (c2, c4, c8) = (S::splat(c(2.0)), S::splat(c(4.0)), S::splat(c(8.0)));
        let (s12, d12, s34, d34) = sums(&x);
        pad([
            x[0].add(s12).add(s34),
            S::fma(c2, d34, d12),
            S::fma(c4, s34, s12),
            S::fma(c8, d34, d12).add(x[5]),
        ])
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; MAX]) -> [S; MAX] {
        // Columns of A^T: the adjoint of `at`.
        let (c2, c4, c8) = (S::splat(c(2.0)), S::splat(c(4.0)), S::splat(c(8.0)));
        let (even, odd) = (S::fma(c4, y[2], y[0]), S::fma(c8, y[3], c2.mul(y[1])));
        let (e1, o1) = (y[0].add(y[2]), y[1].add(y[3]));
        pad([
            y[0],
            e1.add(o1),
            e1.sub(o1),
            even.add(odd),
            even.sub(odd),
            y[3],
        ])
    }
    #[inline(always)]
    unsafe fn g<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let k = |v: f64| S::splat(c(v));
        let (s, d) = (x[0].add(x[2]), x[1]);
        // A multiply and an add, not `fma`: every weight transform's operations round the
        // same on every vector type (`Lanes`' `fma` is unfused), so the packed copies do too.
        let (u, v) = (k(4.0).mul(x[2]).add(x[0]), k(2.0).mul(x[1]));
        pad([
            x[0].mul(k(0.25)),
            s.add(d).mul(k(-1.0 / 6.0)),
            s.sub(d).mul(k(-1.0 / 6.0)),
            u.add(v).mul(k(1.0 / 24.0)),
            u.sub(v).mul(k(1.0 / 24.0)),
            x[2],
        ])
    }
    #[inline(always)]
    unsafe fn gt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let k = |v: f64| S::splat(c(v));
        let (s12, d12, s34, d34) = sums(&x);
        pad([
            S::fma(
                s34,
                k(1.0 / 24.0),
                S::fma(s12, k(-1.0 / 6.0), x[0].mul(k(0.25))),
            ),
            S::fma(d34, k(1.0 / 12.0), d12.mul(k(-1.0 / 6.0))),
            S::fma(s34.sub(s12), k(1.0 / 6.0), x[5]),
        ])
    }
}

// F(5x5, 2x2): B^T as F(4x4, 3x3)'s,
// G   = [1/4 0; -1/6 -1/6; -1/6 1/6; 1/24 1/12; 1/24 -1/12; 0 1]
// A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 0; 0 1 1 16 16 1]
impl Variant for F5x2 {
    const N: usize = 6;
    const M: usize = 5;
    const R: usize = 2;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        F4x3::bt(x)
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        F4x3::b(x)
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let k = |v: f64| S::splat(c(v));
        let (s12, d12, s34, d34) = sums(&x);
        pad([
            x[0].add(s12).add(s34),
            S::fma(k(2.0), d34, d12),
            S::fma(k(4.0), s34, s12),
            S::fma(k(8.0), d34, d12),
            S::fma(k(16.0), s34, s12).add(x[5]),
        ])
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; MAX]) -> [S; MAX] {
        // Columns of A^T: the adjoint of `at`.
        let k = |v: f64| S::splat(c(v));
        let (e1, o1) = (y[0].add(y[2]).add(y[4]), y[1].add(y[3]));
        let (e2, o2) = (
            S::fma(k(16.0), y[4], S::fma(k(4.0), y[2], y[0])),
            S::fma(k(8.0), y[3], k(2.0).mul(y[1])),
        );
        pad([y[0], e1.add(o1), e1.sub(o1), e2.add(o2), e2.sub(o2), y[4]])
    }
    #[inline(always)]
    unsafe fn g<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        let k = |v: f64| S::splat(c(v));
        let v = k(2.0).mul(x[1]);
        pad([
            x[0].mul(k(0.25)),
            x[0].add(x[1]).mul(k(-1.0 / 6.0)),
            x[0].sub(x[1]).mul(k(-1.0 / 6.0)),
            x[0].add(v).mul(k(1.0 / 24.0)),
            x[0].sub(v).mul(k(1.0 / 24.0)),
            x[1],
        ])
    }
    #[inline(always)]
    unsafe fn gt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        // G^T's first row is F(4x4, 3x3)'s (the same points and scales).
        let k = |v: f64| S::splat(c(v));
        let (_, d12, _, d34) = sums(&x);
        pad([
            F4x3::gt(x)[0],
            S::fma(d34, k(1.0 / 12.0), S::fma(d12, k(-1.0 / 6.0), x[5])),
        ])
    }
}

// F(2, 2) of the odd taps: B^T = [1 -1 0; 0 1 0; 0 -1 1], G = [1 0; 1 1; 0 1], A^T = [1 1 0; 0 1 1].
// Entries 0..3 are its points, 3..5 the middle tap's two outputs.
impl Variant for F2x3S2 {
    const N: usize = 5;
    const M: usize = 2;
    const R: usize = 3;
    const STRIDE: usize = 2;
    #[inline(always)]
    unsafe fn bt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([x[0].sub(x[2]), x[2], x[4].sub(x[2]), x[1], x[3]])
    }
    #[inline(always)]
    unsafe fn b<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([x[0], x[3], x[1].sub(x[0]).sub(x[2]), x[4], x[2]])
    }
    #[inline(always)]
    unsafe fn at<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([x[0].add(x[1]).add(x[3]), x[1].add(x[2]).add(x[4])])
    }
    #[inline(always)]
    unsafe fn a<S: Simd>(y: [S; MAX]) -> [S; MAX] {
        pad([y[0], y[0].add(y[1]), y[1], y[0], y[1]])
    }
    #[inline(always)]
    unsafe fn g<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([x[0], x[0].add(x[2]), x[2], x[1], x[1]])
    }
    #[inline(always)]
    unsafe fn gt<S: Simd>(x: [S; MAX]) -> [S; MAX] {
        pad([x[0].add(x[1]), x[3].add(x[4]), x[1].add(x[2])])
    }
}

/// `x1 + x2`, `x1 - x2`, `x3 + x4` and `x3 - x4`: the sums over the points 1 and -1, 2 and -2 that
/// the transforms of F(4x4, 3x3) and F(5x5, 2x2) share.
#[inline(always)]
unsafe fn sums<S: Simd>(x: &[S; MAX]) -> (S, S, S, S) {
    (
        x[1].add(x[2]),
        x[1].sub(x[2]),
        x[3].add(x[4]),
        x[3].sub(x[4]),
    )
}

/// `x` followed by zeros.
#[inline(always)]
fn pad<S: Simd, const K: usize>(x: [S; K]) -> [S; MAX] {
    const { assert!(K <= MAX) };
    // SAFETY: a zero vector needs no CPU feature beyond the ones `x` was computed with.
    // A copy, not `array::from_fn`: its closure is a call across codegen units without LTO.
    let mut out = [unsafe { S::zero() }; MAX];
    // SAFETY: `K <= MAX` (checked at compile time); the arrays do not overlap.
    unsafe { core::ptr::copy_nonoverlapping(x.as_ptr(), out.as_mut_ptr(), K) };
    out
}

/// A constant in the element type.
#[inline(always)]
fn c<T: crate::element::Element>(x: f64) -> T {
    T::from_f64(x)
}

/// Loads a column of a tile (`N` rows, from `top` on, `step` apart) as the 1-D transforms
/// take it.
#[inline(always)]
unsafe fn column<V: Variant, S: Simd>(top: *const S::Elem, step: usize) -> [S; MAX] {
    let mut x = [S::zero(); MAX];
    for i in 0..V::N {
        x[i] = S::load(top.add(i * step));
    }
    x
}

/// `B^T d B` of one vector of channels: `d[i][j]` at `x + i * row + j * col`; element
/// `e = i * N + j` of the result is stored at `v + e * stride`.
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
    let mut t = [[S::zero(); MAX]; MAX];
    for j in 0..V::N {
        let c = V::bt(column::<V, S>(x.add(j * col), row));
        for i in 0..V::N {
            t[i][j] = c[i];
        }
    }
    for i in 0..V::N {
        let r = V::bt(t[i]);
        for j in 0..V::N {
            r[j].store(v.add((V::N * i + j) * stride));
        }
    }
}

/// `A^T m A` of one vector of channels, element `e` of `m` at `m + e * stride`: the output
/// tile, `[row][column]` (the first `M` of each). The whole tile at once, as the tests hold the
/// kernels' row-by-row transform ([`tiles::Output`]) to it.
///
/// # Safety
/// Every address read holds `S::LANES` elements.
#[cfg(test)]
#[inline(always)]
pub(crate) unsafe fn output<V: Variant, S: Simd>(
    m: *const S::Elem,
    stride: usize,
) -> [[S; MAX]; MAX] {
    let t = output_columns::<V, S>(m, stride);
    let mut y = [[S::zero(); MAX]; MAX];
    for i in 0..V::M {
        y[i] = V::at(t[i]);
    }
    y
}

/// `A^T m`, the first half of the output transform `A^T m A` of one vector of channels
/// (element `e` of `m` at `m + e * stride`): row `i` of the result, through `V::at`, is the
/// output tile's row `i`. Apart, so that a tile clipped at the map's edge transforms only the
/// rows it stores.
///
/// # Safety
/// Every address read holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn output_columns<V: Variant, S: Simd>(
    m: *const S::Elem,
    stride: usize,
) -> [[S; MAX]; MAX] {
    let mut t = [[S::zero(); MAX]; MAX];
    for j in 0..V::N {
        let c = V::at(column::<V, S>(m.add(j * stride), V::N * stride));
        for i in 0..V::M {
            t[i][j] = c[i];
        }
    }
    t
}

/// `A dy A^T` of an output-gradient tile (`[row][column]`, the first `M` of each), element
/// `e` stored at `n + e * stride`.
///
/// # Safety
/// Every address written holds `S::LANES` elements.
#[inline(always)]
pub unsafe fn gradient<V: Variant, S: Simd>(dy: [[S; MAX]; MAX], n: *mut S::Elem, stride: usize) {
    let t = separable::<V, S, A>(dy, V::M, V::N);
    for i in 0..V::N {
        for j in 0..V::N {
            t[i][j].store(n.add((V::N * i + j) * stride));
        }
    }
}

/// `B dv B^T` (element `e` of `dv` at `dv + e * stride`) into the input tile
/// `x + i * row + j * col`: added into its first `add_rows` rows and `add_cols` columns (where
/// earlier tiles overlap it), stored over the rest (which no earlier tile reached, so that the
/// gradient needs no clearing); only rows `rows` and columns `cols` of the tile are touched (the
/// others lie outside the image written).
///
/// # Safety
/// Every address written (rows `rows`, columns `cols`) holds `S::LANES` elements.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn input_gradient<V: Variant, S: Simd>(
    dv: *const S::Elem,
    stride: usize,
    x: *mut S::Elem,
    row: usize,
    col: usize,
    add_rows: usize,
    add_cols: usize,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    let mut t = [[S::zero(); MAX]; MAX];
    for j in 0..V::N {
        let c = V::b(column::<V, S>(dv.add(j * stride), V::N * stride));
        for i in 0..V::N {
            t[i][j] = c[i];
        }
    }
    for i in 0..V::N {
        if i < rows.start || i >= rows.end {
            continue;
        }
        let r = V::b(t[i]);
        for j in 0..V::N {
            if j < cols.start || j >= cols.end {
                continue;
            }
            // Offsets, not `add`: the tile's origin may lie outside the image written.
            let p = x.wrapping_add(i * row + j * col);
            if i < add_rows || j < add_cols {
                S::load(p).add(r[j]).store(p);
            } else {
                r[j].store(p);
            }
        }
    }
}

/// The 1-D transforms [`separable`] applies, chosen by a constant rather than passed as a
/// closure: a closure is a call across codegen units without LTO.
const G: u8 = 0;
const GT: u8 = 1;
const A: u8 = 2;

/// `F x F^T` for the 1-D transform `F` (`V::g`, `V::gt` or `V::a`) from `n` entries to `m`:
/// along the columns, then the rows.
#[inline(always)]
unsafe fn separable<V: Variant, S: Simd, const F: u8>(
    x: [[S; MAX]; MAX],
    n: usize,
    m: usize,
) -> [[S; MAX]; MAX] {
    #[inline(always)]
    unsafe fn f<V: Variant, S: Simd, const F: u8>(x: [S; MAX]) -> [S; MAX] {
        match F {
            G => V::g(x),
            GT => V::gt(x),
            _ => V::a(x),
        }
    }
    let mut t = [[S::zero(); MAX]; MAX];
    for j in 0..n {
        let mut column = [S::zero(); MAX];
        for i in 0..n {
            column[i] = x[i][j];
        }
        let c = f::<V, S, F>(column);
        for i in 0..m {
            t[i][j] = c[i];
        }
    }
    let mut y = [[S::zero(); MAX]; MAX];
    for i in 0..m {
        y[i] = f::<V, S, F>(t[i]);
    }
    y
}

/// `G g G^T`: a kernel (`[kh][kw]`, the first `R` of each) in the transformed domain
/// (`[i][j]`, the first `N` of each), one vector of channel pairs (or one pair: `Lanes<_, 1>`).
///
/// # Safety
/// As [`Simd::zero`].
#[inline(always)]
pub unsafe fn weight<V: Variant, S: Simd>(g: [[S; MAX]; MAX]) -> [[S; MAX]; MAX] {
    separable::<V, S, G>(g, V::R, V::N)
}

/// `G^T du G`, the adjoint of [`weight`]: a transformed-domain gradient back to `[kh][kw]`
/// (the first `R` of each).
///
/// # Safety
/// As [`Simd::zero`].
#[inline(always)]
pub unsafe fn weight_gradient<V: Variant, S: Simd>(du: [[S; MAX]; MAX]) -> [[S; MAX]; MAX] {
    separable::<V, S, GT>(du, V::N, V::R)
}

/// A layer's transformed weights in the layout its matrix products read: `U[e][block][y][x]`,
/// the vectors (`x`, `L` lanes) along output channels for the forward pass (`y` the staged
/// input channels), along staged input channels for the input gradient (`y` the output
/// channels), in blocks of `block` lanes' channels (the last one narrower where they do not
/// divide).
#[derive(Clone, Copy, Debug)]
pub struct Packing {
    /// Output channels (OHWI `O`).
    pub oc: usize,
    /// Kernel height and width (OHWI `H`, `W`), before space-to-depth.
    pub kh: usize,
    /// As `kh`.
    pub kw: usize,
    /// Input channels (OHWI `I`), before space-to-depth.
    pub ic: usize,
    /// Space-to-depth factor: staged channel `(dy * sd + dx) * ic + c` at staged tap `(a, b)`
    /// is channel `c` at tap `(sd a + dy, sd b + dx)`.
    pub sd: usize,
    /// Vectors along output channels (the forward pass's copy), else along staged channels.
    pub k_inner: bool,
    /// Channels of a packed block along the vectors.
    pub block: usize,
}

/// `G g G^T` of every channel pair of OHWI weights `w` into `out` as `p` lays it out, for the
/// rows `ys` (staged channels if `p.k_inner`, else output channels): compiled once per variant,
/// element type and vector width (with AVX2 and FMA where the CPU has them, portably where the
/// `portable` feature or the target wants), not once per layer: the packing runs once per
/// parameter change, and these loops, inlined into every layer, had been more than half of
/// LLVM's function passes in a network's build (the build took 0.55 of its time without them).
/// The operations are the ones the layer would run itself, in the same order.
///
/// # Safety
/// The rows `ys` of `out` are the caller's alone while it runs. Channel counts and `p.block`
/// are multiples of `L`; `w` and `out` hold the layer's weights and their transforms (checked).
pub unsafe fn pack<V: Variant, T: crate::Element, const L: usize>(
    p: &Packing,
    w: &[T],
    out: crate::cpu::Shared<'_, T::Acc>,
    ys: Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn pack_avx2<V: Variant, T: crate::Element, const L: usize>(
            p: &Packing,
            w: &[T],
            out: crate::cpu::Shared<'_, T::Acc>,
            ys: Range<usize>,
        ) {
            use std::any::TypeId;
            // f32 and f64 weights on the AVX2 vectors (the weight transforms use no `fma`, the
            // one operation they round differently from `Lanes`). SAFETY: `T` is the type
            // named, and its own accumulator.
            if L == 8 && TypeId::of::<T>() == TypeId::of::<f32>() {
                let out = std::mem::transmute_copy::<_, crate::cpu::Shared<'_, f32>>(&out);
                let w = std::slice::from_raw_parts(w.as_ptr().cast::<f32>(), w.len());
                return pack_on::<V, f32, crate::simd::Avx2F32, 8>(p, w, out, ys);
            }
            if L == 4 && TypeId::of::<T>() == TypeId::of::<f64>() {
                let out = std::mem::transmute_copy::<_, crate::cpu::Shared<'_, f64>>(&out);
                let w = std::slice::from_raw_parts(w.as_ptr().cast::<f64>(), w.len());
                return pack_on::<V, f64, crate::simd::Avx2F64, 4>(p, w, out, ys);
            }
            pack_on::<V, T, crate::simd::Lanes<T::Acc, L>, L>(p, w, out, ys)
        }
        if crate::simd::avx2_fma() {
            return pack_avx2::<V, T, L>(p, w, out, ys);
        }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        #[cfg(any(feature = "portable", not(target_arch = "x86_64")))]
        {
            #[inline(never)]
            unsafe fn pack_portable<V: Variant, T: crate::Element, const L: usize>(
                p: &Packing,
                w: &[T],
                out: crate::cpu::Shared<'_, T::Acc>,
                ys: Range<usize>,
            ) {
                pack_on::<V, T, crate::simd::Lanes<T::Acc, L>, L>(p, w, out, ys)
            }
            pack_portable::<V, T, L>(p, w, out, ys)
        }
        #[cfg(not(any(feature = "portable", not(target_arch = "x86_64"))))]
        crate::simd::no_kernels()
    }
}

/// [`pack`]'s loops, inlined into each of its paths.
// The lanes are filled by index, as the generated kernels do.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pack_on<V: Variant, T: crate::Element, S: Simd<Elem = T::Acc>, const L: usize>(
    p: &Packing,
    w: &[T],
    out: crate::cpu::Shared<'_, T::Acc>,
    ys: Range<usize>,
) {
    use crate::Element as _;
    let wic = p.sd * p.sd * p.ic;
    let window = p.kh * p.kw * p.ic;
    let (xs, y_len) = if p.k_inner { (p.oc, wic) } else { (wic, p.oc) };
    assert!(
        S::LANES == L
            && xs % L == 0
            && p.block.is_multiple_of(L)
            && ys.end <= y_len
            && w.len() >= p.oc * window
            && out.len() >= V::N * V::N * wic * p.oc,
        "winograd::pack: weights or packed copy too short for {p:?}"
    );
    // The weights this part reads and its rows of the copy, asked for in order first where
    // they fit the L2 cache: the gathers and the element planes' stores below then find them in
    // cache instead of waiting on memory line by line (in a training step the optimizer has
    // just streamed every parameter through the caches).
    // Row `y` of block `first` (`width` lanes wide) in element plane `e`: `U[e][block][y][x]`.
    let row_at =
        |e: usize, first: usize, width: usize, y: usize| e * xs * y_len + y_len * first + y * width;
    let elem_bytes = std::mem::size_of::<T::Acc>();
    let weights = if p.k_inner {
        &w[..p.oc * window]
    } else {
        &w[ys.start * window..ys.end * window]
    };
    let rows_bytes = V::N * V::N * ys.len() * xs * elem_bytes;
    if std::mem::size_of_val(weights) + rows_bytes <= PREFETCH_MOST {
        prefetch_lines::<S>(weights.as_ptr().cast(), std::mem::size_of_val(weights));
        for e in 0..V::N * V::N {
            for first in (0..xs).step_by(p.block) {
                let width = p.block.min(xs - first);
                let start = row_at(e, first, width, ys.start);
                prefetch_lines::<S>(
                    out.ptr(start).cast_const().cast(),
                    ys.len() * width * elem_bytes,
                );
            }
        }
    }
    // Staged channel `c`'s tap (0, 0) in an output channel's window; staged tap (a, b) is
    // `(a kw + b) sd ic` further.
    let staged = |c: usize| {
        let (block, c) = (c / p.ic, c % p.ic);
        ((block / p.sd) * p.kw + block % p.sd) * p.ic + c
    };
    // Where the weights are the accumulator's type, contiguous lanes load as one vector.
    let same = std::any::TypeId::of::<T>() == std::any::TypeId::of::<T::Acc>();
    // `G g G^T` of the `L` channel pairs of row `y` from lane `x0` on.
    let transform = |y: usize, x0: usize| {
        let y_at = if p.k_inner { staged(y) } else { y * window };
        // Lanes `at + i * stride` of `w`.
        let lanes = |at: usize, stride: usize| {
            let w = &w[at..at + (L - 1) * stride + 1];
            if stride == 1 && same {
                S::load(w.as_ptr().cast::<T::Acc>())
            } else {
                let mut taps = [T::Acc::zero(); L];
                for i in 0..L {
                    taps[i] = w[i * stride].to_acc();
                }
                S::load(taps.as_ptr())
            }
        };
        let mut g = [[S::zero(); MAX]; MAX];
        for a in 0..V::R {
            for b in 0..V::R {
                let off = (a * p.kw + b) * p.sd * p.ic;
                g[a][b] = if p.k_inner {
                    // Lanes along output channels, `window` apart.
                    lanes(x0 * window + y_at + off, window)
                } else if p.ic.is_multiple_of(L) {
                    // Lanes along staged channels inside one block: contiguous.
                    lanes(y_at + staged(x0) + off, 1)
                } else {
                    let mut taps = [T::Acc::zero(); L];
                    for i in 0..L {
                        taps[i] = w[y_at + staged(x0 + i) + off].to_acc();
                    }
                    S::load(taps.as_ptr())
                };
            }
        }
        weight::<V, S>(g)
    };
    // Up to `ROWS` rows by `RUN` vectors transformed, then stored plane by plane: each
    // plane's part is one run (rows `width` apart, contiguous where the vectors are the whole
    // block). Stored as transformed, the element planes (16 KiB apart in the Nature DQN: one
    // set of the L1 cache) evicted each other's lines before their stores were done.
    let mut u = [[[[S::zero(); MAX]; MAX]; RUN]; ROWS];
    for first in (0..xs).step_by(p.block) {
        let width = p.block.min(xs - first);
        for x0 in (first..first + width).step_by(RUN * L) {
            let n = ((first + width - x0) / L).min(RUN);
            for y0 in ys.clone().step_by(ROWS) {
                let rows = (ys.end - y0).min(ROWS);
                for (r, u) in u.iter_mut().enumerate().take(rows) {
                    for (j, u) in u.iter_mut().enumerate().take(n) {
                        *u = transform(y0 + r, x0 + j * L);
                    }
                }
                for e in 0..V::N * V::N {
                    let at = row_at(e, first, width, y0) + x0 - first;
                    let part = out.part(at, (rows - 1) * width + n * L).as_mut_ptr();
                    for (r, u) in u.iter().enumerate().take(rows) {
                        for (j, u) in u.iter().enumerate().take(n) {
                            u[e / V::N][e % V::N].store(part.add(r * width + j * L));
                        }
                    }
                }
            }
        }
    }
}

/// Bytes [`pack`] asks for ahead at most: past the L2 cache the lines would evict each other.
const PREFETCH_MOST: usize = 1 << 20;

/// Vectors of a packed row transformed before they are stored, plane by plane.
const RUN: usize = 4;

/// Rows of them.
const ROWS: usize = 8;

/// Asks for the cache lines of the `bytes` bytes from `p` ([`Simd::prefetch`]: a hint, no
/// access, so it races with nothing).
///
/// # Safety
/// The bytes lie inside one allocation.
#[inline(always)]
unsafe fn prefetch_lines<S: Simd>(p: *const u8, bytes: usize) {
    for i in (0..bytes).step_by(64) {
        S::prefetch(p.add(i).cast());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{Lanes, PortableF64};

    type S = PortableF64;
    const L: usize = 4;
    /// One channel pair: the weight transforms on single values.
    type One = Lanes<f64, 1>;

    fn one(x: f64) -> One {
        unsafe { One::splat(x) }
    }

    fn scalar(x: One) -> f64 {
        let mut t = [0.0];
        unsafe { x.store(t.as_mut_ptr()) };
        t[0]
    }

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

    fn lane(v: S, lane: usize) -> f64 {
        let mut tmp = [0.0; L];
        unsafe { v.store(tmp.as_mut_ptr()) };
        tmp[lane]
    }

    /// One channel pair per lane: a tile through the transforms against the direct sums, for
    /// the output, the weight gradient and the input gradient.
    fn tile_matches_direct<V: Variant>(tolerance: f64) {
        let (n, m, r, st) = (V::N, V::M, V::R, V::STRIDE);
        assert_eq!(n, st * (m - 1) + r);
        let close = |a: f64, b: f64| (a - b).abs() <= tolerance * (1.0 + b.abs());
        let d = values(1, n * n * L);
        let g = values(2, r * r * L);
        let dy = values(3, m * m * L);
        let mut v = vec![0.0; n * n * L];
        let mut nn = vec![0.0; n * n * L];
        let dyv: [[S; MAX]; MAX] = std::array::from_fn(|i| {
            std::array::from_fn(|j| {
                if i < m && j < m {
                    unsafe { S::load(dy[(i * m + j) * L..].as_ptr()) }
                } else {
                    unsafe { S::zero() }
                }
            })
        });
        unsafe {
            input::<V, S>(d.as_ptr(), n * L, L, v.as_mut_ptr(), L);
            gradient::<V, S>(dyv, nn.as_mut_ptr(), L);
        }
        for ln in 0..L {
            let di = |i: usize, j: usize| d[(i * n + j) * L + ln];
            let gi = |i: usize, j: usize| g[(i * r + j) * L + ln];
            let dyi = |i: usize, j: usize| dy[(i * m + j) * L + ln];
            let gk: [[One; MAX]; MAX] = std::array::from_fn(|i| {
                std::array::from_fn(|j| one(if i < r && j < r { gi(i, j) } else { 0.0 }))
            });
            let u = unsafe { weight::<V, One>(gk) }.map(|row| row.map(scalar));
            // Output: A^T (U * V) A.
            let mut mm = vec![0.0; n * n * L];
            for e in 0..n * n {
                mm[e * L + ln] = u[e / n][e % n] * v[e * L + ln];
            }
            let y = unsafe { output::<V, S>(mm.as_ptr(), L) };
            for i in 0..m {
                for j in 0..m {
                    let direct: f64 = (0..r * r)
                        .map(|k| gi(k / r, k % r) * di(st * i + k / r, st * j + k % r))
                        .sum();
                    assert!(close(lane(y[i][j], ln), direct), "y[{i}][{j}]");
                }
            }
            // Weight gradient: G^T (V * N) G.
            let du: [[One; MAX]; MAX] = std::array::from_fn(|i| {
                std::array::from_fn(|j| {
                    one(if i < n && j < n {
                        v[(i * n + j) * L + ln] * nn[(i * n + j) * L + ln]
                    } else {
                        0.0
                    })
                })
            });
            let dg = unsafe { weight_gradient::<V, One>(du) }.map(|row| row.map(scalar));
            for kh in 0..r {
                for kw in 0..r {
                    let direct: f64 = (0..m * m)
                        .map(|q| dyi(q / m, q % m) * di(st * (q / m) + kh, st * (q % m) + kw))
                        .sum();
                    assert!(close(dg[kh][kw], direct), "dg[{kh}][{kw}]");
                }
            }
            // Input gradient: B (U * N) B^T, added into the tile.
            let mut dv = vec![0.0; n * n * L];
            for e in 0..n * n {
                dv[e * L + ln] = u[e / n][e % n] * nn[e * L + ln];
            }
            // Added into the first row and the first two columns, stored over the rest.
            let mut dd = vec![0.5; n * n * L];
            unsafe {
                input_gradient::<V, S>(dv.as_ptr(), L, dd.as_mut_ptr(), n * L, L, 1, 2, 0..n, 0..n)
            };
            for i in 0..n {
                for j in 0..n {
                    let mut direct = if i < 1 || j < 2 { 0.5 } else { 0.0 };
                    for q in 0..m * m {
                        let (a, b) = (q / m, q % m);
                        let (i0, j0) = (st * a, st * b);
                        if (i0..i0 + r).contains(&i) && (j0..j0 + r).contains(&j) {
                            direct += dyi(a, b) * gi(i - i0, j - j0);
                        }
                    }
                    assert!(close(dd[(i * n + j) * L + ln], direct), "dd[{i}][{j}]");
                }
            }
            // Clipped to rows 1.. and the columns but the last: the same values there, the rest
            // untouched.
            let mut clipped = vec![0.5; n * n * L];
            unsafe {
                input_gradient::<V, S>(
                    dv.as_ptr(),
                    L,
                    clipped.as_mut_ptr(),
                    n * L,
                    L,
                    1,
                    2,
                    1..n,
                    0..n - 1,
                )
            };
            for i in 0..n {
                for j in 0..n {
                    let at = (i * n + j) * L + ln;
                    let want = if i >= 1 && j < n - 1 { dd[at] } else { 0.5 };
                    assert_eq!(clipped[at], want, "clipped[{i}][{j}]");
                }
            }
        }
    }

    #[test]
    fn f2x3_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F2x3>(1e-12);
    }

    #[test]
    fn f3x2_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F3x2>(1e-12);
    }

    #[test]
    fn f4x3_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F4x3>(1e-12);
    }

    #[test]
    fn f5x2_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F5x2>(1e-12);
    }

    #[test]
    fn f2x3_stride_2_matches_direct_convolution_and_its_gradients() {
        tile_matches_direct::<F2x3S2>(1e-12);
    }

    /// Every value [`pack`] writes from `T` weights in vectors of `LANES`, against `G g G^T` of
    /// its one channel pair gathered straight from the OHWI weights in `T`'s accumulator, bit
    /// for bit: both layouts, space-to-depth, blocks that do not divide the channels. Where the
    /// CPU has AVX2 and FMA, f32 and f64 run on its vectors and the half types on `Lanes`.
    fn pack_matches_one_pair_at_a_time<V: Variant, T: crate::Element, const LANES: usize>(
        sd: usize,
        ic: usize,
        oc: usize,
        block: usize,
    ) {
        use crate::Element as _;
        type Pair<T> = Lanes<<T as crate::Element>::Acc, 1>;
        let (kh, kw) = (sd * V::R, sd * V::R);
        let (window, wic, elems) = (kh * kw * ic, sd * sd * ic, V::N * V::N);
        let w: Vec<T> = values(7, oc * window)
            .into_iter()
            .map(T::from_f64)
            .collect();
        for k_inner in [true, false] {
            let p = Packing {
                oc,
                kh,
                kw,
                ic,
                sd,
                k_inner,
                block,
            };
            let mut out = vec![T::Acc::from_f64(f64::NAN); elems * wic * oc];
            let (xs, ys) = if k_inner { (oc, wic) } else { (wic, oc) };
            // Two callers' rows, as two workers would split them.
            let shared = crate::cpu::Shared::new(&mut out);
            unsafe {
                pack::<V, T, LANES>(&p, &w, shared, 0..ys / 2);
                pack::<V, T, LANES>(&p, &w, shared, ys / 2..ys);
            }
            for k in 0..oc {
                for c in 0..wic {
                    let (block_c, c0) = (c / ic, c % ic);
                    let (dy, dx) = (block_c / sd, block_c % sd);
                    let mut g = [[unsafe { Pair::<T>::zero() }; MAX]; MAX];
                    for a in 0..V::R {
                        for b in 0..V::R {
                            let tap = w[k * window + ((sd * a + dy) * kw + sd * b + dx) * ic + c0];
                            g[a][b] = unsafe { Pair::<T>::splat(tap.to_acc()) };
                        }
                    }
                    let u = unsafe { weight::<V, Pair<T>>(g) };
                    let (x, y) = if k_inner { (k, c) } else { (c, k) };
                    let first = x / block * block;
                    let width = block.min(xs - first);
                    for e in 0..elems {
                        let got = out[e * xs * ys + ys * first + y * width + x - first];
                        let mut want = [T::Acc::from_f64(0.0)];
                        unsafe { u[e / V::N][e % V::N].store(want.as_mut_ptr()) };
                        assert_eq!(
                            got.to_f64().to_bits(),
                            want[0].to_f64().to_bits(),
                            "k_inner {k_inner}, pair ({k}, {c}), element {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn pack_lays_out_every_transformed_pair() {
        pack_matches_one_pair_at_a_time::<F4x3, f64, L>(1, 8, 12, 8);
        pack_matches_one_pair_at_a_time::<F3x2, f64, L>(2, 2, 8, 8);
        pack_matches_one_pair_at_a_time::<F5x2, f64, L>(4, 1, 4, 4);
        pack_matches_one_pair_at_a_time::<F2x3S2, f64, L>(1, 4, 8, 12);
    }

    /// Every element type, on shapes with more rows and vectors than one run of the packer's
    /// stores holds, narrower last blocks, and staged channels in blocks of fewer than a
    /// vector's.
    #[test]
    fn pack_lays_out_every_element_type() {
        fn each<T: crate::Element, const LANES: usize>() {
            pack_matches_one_pair_at_a_time::<F4x3, T, LANES>(1, 24, 40, 48);
            pack_matches_one_pair_at_a_time::<F4x3, T, LANES>(1, 40, 24, 16);
            pack_matches_one_pair_at_a_time::<F3x2, T, LANES>(2, 4, 32, 24);
            pack_matches_one_pair_at_a_time::<F5x2, T, LANES>(4, 4, 16, 16);
            pack_matches_one_pair_at_a_time::<F2x3S2, T, LANES>(1, 16, 24, 8);
            pack_matches_one_pair_at_a_time::<F2x3, T, LANES>(1, 16, 16, 16);
        }
        each::<f32, 8>();
        each::<f64, 4>();
        each::<half::f16, 8>();
        each::<half::bf16, 8>();
    }
}
