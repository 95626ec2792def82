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
        // An index loop: `zip` is a call across codegen units without LTO.
        for i in 0..dst.len().min(src.len()) {
            dst[i] = src[i].to_acc();
        }
    }

    /// Rounds a slice (vectorized for the half types).
    #[inline]
    fn from_acc_slice(src: &[Self::Acc], dst: &mut [Self]) {
        for i in 0..dst.len().min(src.len()) {
            dst[i] = Self::from_acc(src[i]);
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
    /// Natural logarithm.
    fn ln(self) -> Self;
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
    ($t:ty, $exp:path, $tanh:path) => {
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
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                $tanh(self)
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

real!(f32, fast_math::exp, fast_math::tanh);
real!(f64, f64::exp, f64::tanh);

/// f32 `exp` and `tanh` without libm calls or branches, so element-wise loops over them
/// vectorize (libm's `expf`/`tanhf` are scalar calls costing ~8 ns an element, more than the
/// convolution itself on small layers). Errors are a few ulp; f64 keeps libm, whose accuracy
/// the f64 reference tolerance (1e-9) needs.
mod fast_math {
    /// e^x: x = n ln2 + r with |r| <= ln2 / 2, Cephes' degree-6 polynomial for e^r, 2^n from
    /// the exponent bits.
    #[inline(always)]
    pub fn exp(x: f32) -> f32 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        // ln 2 split in two so that n * LN2_HI is exact.
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer with SSE2 only.
        const ROUND: f32 = 12_582_912.0;
        let x = x.clamp(-87.0, 88.0);
        let n = (x * LOG2E + ROUND) - ROUND;
        let r = x - n * LN2_HI - n * LN2_LO;
        let p = 1.987_569_1e-4;
        let p = p * r + 1.398_2e-3;
        let p = p * r + 8.333_452e-3;
        let p = p * r + 4.166_579_6e-2;
        let p = p * r + 0.166_666_65;
        let p = p * r + 0.5;
        let e_r = p * r * r + r + 1.0;
        // SAFETY: `n` is an integer in [-126, 127] (x is clamped above), so the conversion is
        // exact; unlike `as`, it compiles to one vector instruction (no saturation checks).
        let n: i32 = unsafe { n.to_int_unchecked() };
        e_r * f32::from_bits(((n + 127) as u32) << 23)
    }

    /// tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)).
    #[inline(always)]
    pub fn tanh(x: f32) -> f32 {
        let t = exp(-2.0 * x.abs());
        ((1.0 - t) / (1.0 + t)).copysign(x)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn close_to_libm() {
            let mut worst = (0.0f64, 0.0f64);
            for i in -200_000..=200_000 {
                let x = i as f32 * 4.35e-4; // |x| <= 87: below that exp is denormal and clamped
                let e = (super::exp(x) as f64 - (x as f64).exp()).abs() / (x as f64).exp();
                let t = (super::tanh(x) as f64 - (x as f64).tanh()).abs();
                worst = (worst.0.max(e), worst.1.max(t));
            }
            assert!(worst.0 < 4e-7 && worst.1 < 2e-7, "{worst:?}");
            assert_eq!(super::exp(-200.0), super::exp(-87.0));
            assert!(super::exp(100.0).is_finite());
        }
    }
}

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
