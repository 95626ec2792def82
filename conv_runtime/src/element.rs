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
    exact::Exact
    + Element<Acc = Self>
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

/// Multiplications, divisions and square roots that give the plain operations' bits without
/// denormal operands or results, for the optimizers' running means: Intel cores take a
/// microcode assist (about 150 cycles) for each such instruction, and a running mean whose
/// gradient stays zero decays into the denormals and stays there (see [`crate::denormals`]).
/// Additions and subtractions need none of this: they take no assist.
pub(crate) mod exact {
    /// See the module. Implemented for the accumulator types only (a supertrait of
    /// [`super::Real`] that users cannot name).
    pub trait Exact: Copy {
        /// Nonzero and below 2^`exponent` in magnitude (`exponent` between -126 and 0): near
        /// enough to the denormals that products with it may meet them. Never for f64 (its
        /// denormals lie 900 binary orders further down than f32's).
        fn below(self, exponent: i32) -> bool;
        /// `self * other`, its bits.
        fn mul_exact(self, other: Self) -> Self;
        /// `self / other`, its bits.
        fn div_exact(self, other: Self) -> Self;
        /// The square root, its bits.
        fn sqrt_exact(self) -> Self;
    }

    /// f32 through f64: conversions take no assist either way, and f32 denormals are normal
    /// f64 numbers. A product of two f32 is exact in f64, so rounding it to f32 rounds once. A
    /// quotient or square root is rounded twice, to f64 and then to f32, which gives the
    /// correctly rounded f32 all the same: f64's 53 bits are at least twice f32's 24 plus two
    /// (Figueroa, "When is double rounding innocuous?", 1995). In the denormal range, where f32
    /// keeps fewer bits, a quotient of two f32 lies at least 2^-48 of itself away from any
    /// rounding midpoint it is not equal to (its numerator, the midpoint times its
    /// denominator, are multiples of a power of two), further than f64's rounding moves it.
    impl Exact for f32 {
        #[inline(always)]
        fn below(self, exponent: i32) -> bool {
            let magnitude = self.to_bits() & 0x7fff_ffff;
            magnitude != 0 && magnitude < ((127 + exponent) as u32) << 23
        }
        #[inline(always)]
        fn mul_exact(self, other: Self) -> Self {
            (f64::from(self) * SCALE * f64::from(other) * UNSCALE) as f32
        }
        #[inline(always)]
        fn div_exact(self, other: Self) -> Self {
            (f64::from(self) * SCALE / f64::from(other) * UNSCALE) as f32
        }
        #[inline(always)]
        fn sqrt_exact(self) -> Self {
            ((f64::from(self) * SCALE).sqrt() * ROOT_UNSCALE) as f32
        }
    }

    /// 2^64, its inverse and the inverse of its square root. Scaling by them is exact (no f32
    /// value comes near f64's limits), and it keeps the compiler from shrinking an f64
    /// operation on two widened f32 back to the f32 operation (LLVM does, as the bits allow).
    const SCALE: f64 = 18_446_744_073_709_551_616.0;
    const UNSCALE: f64 = 1.0 / SCALE;
    const ROOT_UNSCALE: f64 = 1.0 / 4_294_967_296.0;

    impl Exact for f64 {
        #[inline(always)]
        fn below(self, _exponent: i32) -> bool {
            false
        }
        #[inline(always)]
        fn mul_exact(self, other: Self) -> Self {
            self * other
        }
        #[inline(always)]
        fn div_exact(self, other: Self) -> Self {
            self / other
        }
        #[inline(always)]
        fn sqrt_exact(self) -> Self {
            self.sqrt()
        }
    }

    #[cfg(test)]
    mod tests {
        use super::Exact;
        use rand::{Rng, SeedableRng};

        /// Equal bits, or both NaN (a NaN's payload depends on the operand order the compiler
        /// picks, in the plain operations too).
        fn same(a: f32, b: f32) -> bool {
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
        }

        /// An f32 from random bits, its exponent mostly near or in the denormals (and the
        /// specials), else anywhere.
        fn value(rng: &mut impl Rng) -> f32 {
            let bits: u32 = rng.random();
            let exponent = match rng.random_range(0..8) {
                0 => 0,                            // denormals and zeros
                1 => rng.random_range(1..40),      // just above them
                2 => 255,                          // infinities and NaNs
                3 => rng.random_range(100..150),   // around one
                _ => rng.random_range(0..=255u32), // anywhere
            };
            let mantissa = match rng.random_range(0..4) {
                0 => bits & 0xf,       // tiny denormals
                1 => bits & 0x7f_fff0, // ties are likelier with trailing zeros
                _ => bits & 0x7f_ffff,
            };
            f32::from_bits((bits & 0x8000_0000) | (exponent << 23) | mantissa)
        }

        #[test]
        fn exact_operations_give_the_plain_bits() {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
            let (mut denormal_results, mut denormal_quotients) = (0, 0);
            for _ in 0..2_000_000 {
                let (a, b) = (value(&mut rng), value(&mut rng));
                // Products and quotients that land in the denormals, or on their boundary.
                let c = if rng.random() {
                    b
                } else {
                    f32::from_bits(b.to_bits() ^ 1) * 0.95
                };
                for (x, y) in [(a, b), (a, c), (c, a)] {
                    assert!(same(x.mul_exact(y), x * y), "{x:e} * {y:e}");
                    assert!(same(x.div_exact(y), x / y), "{x:e} / {y:e}");
                    denormal_results += usize::from((x * y).is_subnormal());
                    denormal_quotients += usize::from((x / y).is_subnormal());
                }
                assert!(same(a.sqrt_exact(), a.sqrt()), "sqrt {a:e}");
            }
            // The cases that matter were met often.
            assert!(
                denormal_results > 100_000 && denormal_quotients > 100_000,
                "{denormal_results} {denormal_quotients}"
            );
            // A running mean stuck in the denormals: 0.95 times the smallest ones.
            for k in 0..64u32 {
                let x = f32::from_bits(k);
                assert_eq!(x.mul_exact(0.95).to_bits(), (x * 0.95).to_bits());
            }
            for x in [1e-40f32, -1e-40, 1.2e-38, 0.0, -0.0, f32::MIN_POSITIVE] {
                assert!(x.below(-126) == (x != 0.0 && x.is_subnormal()), "{x:e}");
                assert!(x.below(-100) == (x != 0.0), "{x:e}");
            }
            let bound = 2f32.powi(-40);
            assert!(!bound.below(-40) && f32::from_bits(bound.to_bits() - 1).below(-40));
            assert!(!f32::NAN.below(0) && !f32::INFINITY.below(0) && 0.5f32.below(0));
        }
    }
}

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
