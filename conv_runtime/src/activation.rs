//! Activation functions and the derivatives backward passes use.
//!
//! Each activation is a zero-sized type so generated code names it once and the compiler
//! inlines it into the kernel that applies it.

use crate::element::Real;

/// An element-wise activation `f` with the derivative `df` the backward pass multiplies by,
/// both taken at the pre-activation `x`.
pub trait Activation {
    /// The name as written in a spec.
    const NAME: &'static str;
    /// f(x).
    fn f<R: Real>(x: R) -> R;
    /// The derivative used by backward passes (for FastTanh, rl_tools' `1 - f(x)^2`).
    fn df<R: Real>(x: R) -> R;

    /// Applies `f` in place; the ones that vectorize as written override nothing.
    #[inline(always)]
    fn apply<R: Real>(xs: &mut [R]) {
        for x in xs {
            *x = Self::f(*x);
        }
    }
}

fn c<R: Real>(x: f64) -> R {
    R::from_f64(x)
}

/// f(x) = x.
pub struct Identity;
impl Activation for Identity {
    const NAME: &'static str = "Identity";
    #[inline(always)]
    fn f<R: Real>(x: R) -> R {
        x
    }
    #[inline(always)]
    fn df<R: Real>(_: R) -> R {
        R::ONE
    }
    #[inline(always)]
    fn apply<R: Real>(_: &mut [R]) {}
}

/// max(x, 0); derivative 0 at 0 (PyTorch's convention).
pub struct Relu;
impl Activation for Relu {
    const NAME: &'static str = "Relu";
    #[inline(always)]
    fn f<R: Real>(x: R) -> R {
        if x > R::zero() {
            x
        } else {
            R::zero()
        }
    }
    #[inline(always)]
    fn df<R: Real>(x: R) -> R {
        if x > R::zero() {
            R::ONE
        } else {
            R::zero()
        }
    }
}

/// The tanh approximation of GELU (PyTorch `approximate="tanh"`).
pub struct Gelu;
const GELU_K: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;
impl Activation for Gelu {
    const NAME: &'static str = "Gelu";
    #[inline(always)]
    fn f<R: Real>(x: R) -> R {
        let t = (c::<R>(GELU_K) * (x + c::<R>(GELU_A) * x * x * x)).tanh();
        c::<R>(0.5) * x * (R::ONE + t)
    }
    #[inline(always)]
    fn df<R: Real>(x: R) -> R {
        let t = (c::<R>(GELU_K) * (x + c::<R>(GELU_A) * x * x * x)).tanh();
        let dinner = c::<R>(GELU_K) * (R::ONE + c::<R>(3.0 * GELU_A) * x * x);
        c::<R>(0.5) * (R::ONE + t) + c::<R>(0.5) * x * (R::ONE - t * t) * dinner
    }
}

/// tanh(x).
pub struct Tanh;
impl Activation for Tanh {
    const NAME: &'static str = "Tanh";
    #[inline(always)]
    fn f<R: Real>(x: R) -> R {
        x.tanh()
    }
    #[inline(always)]
    fn df<R: Real>(x: R) -> R {
        let t = x.tanh();
        R::ONE - t * t
    }
}

/// rl_tools' rational tanh: clamp to [-3, 3], then x (27 + x^2) / (27 + 9 x^2).
pub struct FastTanh;
impl Activation for FastTanh {
    const NAME: &'static str = "FastTanh";
    #[inline(always)]
    fn f<R: Real>(x: R) -> R {
        let x = x.max(c(-3.0)).min(c(3.0));
        let x2 = x * x;
        x * (c::<R>(27.0) + x2) / (c::<R>(27.0) + c::<R>(9.0) * x2)
    }
    #[inline(always)]
    fn df<R: Real>(x: R) -> R {
        let t = Self::f(x);
        R::ONE - t * t
    }
}

/// 1 / (1 + e^-x).
pub struct Sigmoid;
impl Activation for Sigmoid {
    const NAME: &'static str = "Sigmoid";
    #[inline(always)]
    fn f<R: Real>(x: R) -> R {
        R::ONE / (R::ONE + (-x).exp())
    }
    #[inline(always)]
    fn df<R: Real>(x: R) -> R {
        let s = Self::f(x);
        s * (R::ONE - s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_derivative<A: Activation>() {
        for i in -40..=40 {
            let x = i as f64 * 0.173 + 0.011;
            let h = 1e-6;
            let fd = (A::f(x + h) - A::f(x - h)) / (2.0 * h);
            assert!(
                (fd - A::df(x)).abs() < 1e-6,
                "{} at {x}: {fd} vs {}",
                A::NAME,
                A::df(x)
            );
        }
    }

    #[test]
    fn derivatives_match_finite_differences() {
        check_derivative::<Identity>();
        check_derivative::<Relu>();
        check_derivative::<Gelu>();
        check_derivative::<Tanh>();
        check_derivative::<Sigmoid>();
    }

    #[test]
    fn fast_tanh_is_rl_tools_rational() {
        assert_eq!(FastTanh::f(5.0f64), 1.0);
        assert!((FastTanh::f(0.5f64) - 0.5 * 27.25 / 29.25).abs() < 1e-15);
        assert!((FastTanh::df(0.5f64) - (1.0 - (0.5f64 * 27.25 / 29.25).powi(2))).abs() < 1e-15);
    }
}
