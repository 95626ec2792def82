//! A tile's transforms over all of its channels, as the generated Winograd kernels run them
//! once per tile: each written here once, one vector of channels at a time, so that
//! [`Simd::channels`] can run the same code on the widest vectors the CPU has
//! ([`crate::wide`]). The transforms are lane-wise (each channel's arithmetic is the same
//! whatever the vector's width), so every width gives the same bits.

use super::{Variant, MAX};
use crate::simd::Simd;
use std::ops::Range;

/// One of a tile's transforms, its pointers at channel 0.
pub trait Transform<E> {
    /// The transform of the channels `c..c + S::LANES`.
    ///
    /// # Safety
    /// The transform's addresses, offset by `c`, hold `S::LANES` elements; `S`'s CPU features
    /// are enabled.
    unsafe fn run<V: Variant, S: Simd<Elem = E>>(&self, c: usize);
}

/// Runs `t` over the channels `from..to`, one vector of `S` at a time: [`Simd::channels`]'s
/// loop.
///
/// # Safety
/// As [`Transform::run`] for each vector; `to - from` is a multiple of `S::LANES`.
#[inline(always)]
pub unsafe fn by_vectors<V: Variant, S: Simd, T: Transform<S::Elem>>(
    t: &T,
    from: usize,
    to: usize,
) {
    let mut c = from;
    while c < to {
        t.run::<V, S>(c);
        c += S::LANES;
    }
}

/// [`super::input`] (`B^T d B`): `d[i][j]` at `x + i * row + j * col`, element `e` of the
/// result at `v + e * stride`.
#[derive(Clone, Copy, Debug)]
pub struct Input<E> {
    pub x: *const E,
    pub row: usize,
    pub col: usize,
    pub v: *mut E,
    pub stride: usize,
}

impl<E> Transform<E> for Input<E> {
    #[inline(always)]
    unsafe fn run<V: Variant, S: Simd<Elem = E>>(&self, c: usize) {
        super::input::<V, S>(
            self.x.add(c),
            self.row,
            self.col,
            self.v.add(c),
            self.stride,
        );
    }
}

/// The output tile's epilogue: the output transform `A^T m A` ([`super::output_columns`],
/// then each row; element `e` of `m` at `m + e * stride`) plus the bias, clamped at zero where
/// `relu`, stored at `y + r * row + c * col` for its first `extent.0` rows and `extent.1`
/// columns (the rest lie past the map's edge and are not transformed).
#[derive(Clone, Copy, Debug)]
pub struct Output<E> {
    pub m: *const E,
    pub stride: usize,
    pub bias: *const E,
    pub y: *mut E,
    pub row: usize,
    pub col: usize,
    pub extent: (usize, usize),
    pub relu: bool,
}

impl<E> Transform<E> for Output<E> {
    #[inline(always)]
    unsafe fn run<V: Variant, S: Simd<Elem = E>>(&self, c: usize) {
        let b = S::load(self.bias.add(c));
        let t = super::output_columns::<V, S>(self.m.add(c), self.stride);
        let (down, right) = self.extent;
        // Loops over the constant `M` with the extent as a condition: every index into `t` and
        // `out` is then a constant, so both stay in registers (an index bounded by the extent
        // kept them in memory, zeroed on each call).
        for r in 0..V::M {
            if r >= down {
                break;
            }
            let out = V::at(t[r]);
            for j in 0..V::M {
                if j >= right {
                    break;
                }
                let mut value = out[j].add(b);
                if self.relu {
                    value = value.max(S::zero());
                }
                value.store(self.y.add(r * self.row + j * self.col + c));
            }
        }
    }
}

/// [`super::gradient`] (`A dy A^T`) of the output-gradient tile read at
/// `dy + r * row + c * col`, its first `extent.0` rows and `extent.1` columns (the rest, past
/// the map's edge, zero); element `e` of the result at `n + e * stride`.
#[derive(Clone, Copy, Debug)]
pub struct Gradient<E> {
    pub dy: *const E,
    pub row: usize,
    pub col: usize,
    pub extent: (usize, usize),
    pub n: *mut E,
    pub stride: usize,
}

impl<E> Transform<E> for Gradient<E> {
    #[inline(always)]
    unsafe fn run<V: Variant, S: Simd<Elem = E>>(&self, c: usize) {
        let mut t = [[S::zero(); MAX]; MAX];
        let (down, right) = self.extent;
        // Constant indices, the extent a condition (as in [`Output`]): `t` stays in registers.
        for r in 0..V::M {
            for j in 0..V::M {
                if r < down && j < right {
                    t[r][j] = S::load(self.dy.add(r * self.row + j * self.col + c));
                }
            }
        }
        super::gradient::<V, S>(t, self.n.add(c), self.stride);
    }
}

/// [`super::input_gradient`] (`B dv B^T`, added over the tile's first `add.0` rows and
/// `add.1` columns, stored over the rest, only its rows `rows` and columns `cols` touched).
/// `x` may point outside the image written (offsets, not `add`).
#[derive(Clone, Debug)]
pub struct InputGradient<E> {
    pub dv: *const E,
    pub stride: usize,
    pub x: *mut E,
    pub row: usize,
    pub col: usize,
    pub add: (usize, usize),
    pub rows: Range<usize>,
    pub cols: Range<usize>,
}

impl<E> Transform<E> for InputGradient<E> {
    #[inline(always)]
    unsafe fn run<V: Variant, S: Simd<Elem = E>>(&self, c: usize) {
        super::input_gradient::<V, S>(
            self.dv.add(c),
            self.stride,
            self.x.wrapping_add(c),
            self.row,
            self.col,
            self.add.0,
            self.add.1,
            self.rows.clone(),
            self.cols.clone(),
        );
    }
}
