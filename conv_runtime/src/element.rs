//! Element types of layers and the accumulator types they compute in.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A type a layer can store its parameters and activations in.
///
/// `Acc` is the type every sum is accumulated in (convolution sums, statistics, gradients):
/// f64 for f64, f32 for f32 and the half types.
pub trait Element: Copy + Debug + Default + PartialEq + Send + Sync + 'static {
    /// The accumulator type.
    type Acc: Real;
    /// Rounds an f64 to this type (round to nearest).
    fn from_f64(x: f64) -> Self;
    /// Widens to f64 (exact).
    fn to_f64(self) -> f64;
    /// Widens to the accumulator type (exact).
    fn to_acc(self) -> Self::Acc;
    /// Rounds an accumulator value to this type.
    fn from_acc(x: Self::Acc) -> Self;
    /// Zero.
    fn zero() -> Self;
    /// True for NaN.
    fn is_nan(self) -> bool;

    /// Widens a slice (vectorized for the half types).
    #[inline]
    fn to_acc_slice(src: &[Self], dst: &mut [Self::Acc]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_acc();
        }
    }

    /// Rounds a slice (vectorized for the half types).
    #[inline]
    fn from_acc_slice(src: &[Self::Acc], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_acc(*s);
        }
    }
}

/// The accumulator types (f32, f64): the arithmetic generated code and optimizers need.
pub trait Real:
    Element<Acc = Self>
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    /// One.
    const ONE: Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// e^x.
    fn exp(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Absolute value.
    fn abs(self) -> Self;
    /// The larger of the two (NaN-propagation as `f32::max`).
    fn max(self, other: Self) -> Self;
    /// The smaller of the two.
    fn min(self, other: Self) -> Self;
    /// x^n.
    fn powi(self, n: i32) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Element for $t {
            type Acc = $t;
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn to_acc(self) -> Self {
                self
            }
            #[inline(always)]
            fn from_acc(x: Self) -> Self {
                x
            }
            #[inline(always)]
            fn zero() -> Self {
                0.0
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }

        impl Real for $t {
            const ONE: Self = 1.0;
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            #[inline(always)]
            fn min(self, other: Self) -> Self {
                <$t>::min(self, other)
            }
            #[inline(always)]
            fn powi(self, n: i32) -> Self {
                <$t>::powi(self, n)
            }
        }
    };
}

real!(f32);
real!(f64);

macro_rules! half_element {
    ($t:ty) => {
        impl Element for $t {
            type Acc = f32;
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline(always)]
            fn to_acc(self) -> f32 {
                <$t>::to_f32(self)
            }
            #[inline(always)]
            fn from_acc(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            #[inline(always)]
            fn zero() -> Self {
                <$t>::ZERO
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            // `half`'s slice conversions use F16C where the CPU has it (detected at run time).
            #[inline]
            fn to_acc_slice(src: &[Self], dst: &mut [f32]) {
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
            }
            #[inline]
            fn from_acc_slice(src: &[f32], dst: &mut [Self]) {
                half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
            }
        }
    };
}

half_element!(half::f16);
half_element!(half::bf16);
