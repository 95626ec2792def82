//! Activation functions and the derivatives backward passes use.
//!
//! Each activation is a zero-sized type so generated code names it once and the compiler
//! inlines it into the kernel that applies it.

use crate::element::{Element, Real};

/// An element-wise activation `f` with the derivative `df` the backward pass multiplies by,
/// both taken at the pre-activation `x`.
pub trait Activation {
    /// The name as written in a spec.
    const NAME: &'static str;
    /// f(x).
    fn f<R: Real>(x: R) -> R;
    /// The derivative used by backward passes (for FastTanh, rl_tools' `1 - f(x)^2`).
    fn df<R: Real>(x: R) -> R;

    /// The same derivative given also the output `y = f(x)`, which the ones defined through
    /// their output (Tanh, Sigmoid, FastTanh) use instead of evaluating `f` again.
    #[inline(always)]
    fn df_given_output<R: Real>(x: R, y: R) -> R {
        let _ = y;
        Self::df(x)
    }

    /// Applies `f` in place; the ones that vectorize as written override nothing.
    #[inline(always)]
    fn apply<R: Real>(xs: &mut [R]) {
        for x in xs {
            *x = Self::f(*x);
        }
    }

    /// `dst = f(src)`, element by element.
    #[inline(always)]
    fn apply_to<R: Real>(src: &[R], dst: &mut [R]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::f(*s);
        }
    }
}

/// Applies `A` in place, vectorized with AVX2+FMA where the CPU has it: the generated kernels'
/// epilogues call this rather than `A::apply`, whose loop would otherwise be compiled for the
/// baseline target only.
#[inline]
pub fn apply<A: Activation, R: Real>(xs: &mut [R]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn apply_avx2<A: Activation, R: Real>(xs: &mut [R]) {
            A::apply(xs)
        }
        if crate::simd::avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { apply_avx2::<A, R>(xs) };
        }
    }
    A::apply(xs)
}

/// `dst = f(src)` (one pass where a copy then [`apply`] would take two), vectorized as
/// [`apply`].
#[inline]
pub fn apply_to<A: Activation, R: Real>(src: &[R], dst: &mut [R]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn apply_to_avx2<A: Activation, R: Real>(src: &[R], dst: &mut [R]) {
            A::apply_to(src, dst)
        }
        if crate::simd::avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { apply_to_avx2::<A, R>(src, dst) };
        }
    }
    A::apply_to(src, dst)
}

/// `out[i] = f([inputs[0][i], ..])` over the shortest of the slices, vectorized with AVX2+FMA
/// where the CPU has it (the loop inlined into an AVX2 instantiation, as [`apply`]): the one
/// loop of the element-wise passes below.
#[inline(always)]
fn map<const N: usize, T: Copy, U, F: Fn([T; N]) -> U>(inputs: [&[T]; N], out: &mut [U], f: &F) {
    #[inline(always)]
    fn run<const N: usize, T: Copy, U, F: Fn([T; N]) -> U>(
        inputs: [&[T]; N],
        out: &mut [U],
        f: &F,
    ) {
        // Every slice cut to one length, so that the indexing below needs no checks.
        let n = inputs.iter().fold(out.len(), |n, x| n.min(x.len()));
        let (inputs, out) = (inputs.map(|x| &x[..n]), &mut out[..n]);
        for i in 0..n {
            out[i] = f(::core::array::from_fn(|k| inputs[k][i]));
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run_avx2<const N: usize, T: Copy, U, F: Fn([T; N]) -> U>(
            inputs: [&[T]; N],
            out: &mut [U],
            f: &F,
        ) {
            run(inputs, out, f)
        }
        if crate::simd::avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { run_avx2(inputs, out, f) };
        }
    }
    run(inputs, out, f)
}

/// [`map`] on the pool's threads, the elements cut into one contiguous range per worker (each
/// element is computed alone: the partition does not change the results).
#[inline(always)]
fn map_on<const N: usize, T: Copy + Sync, U: Send, F: Fn([T; N]) -> U + Sync>(
    pool: &crate::cpu::Pool,
    inputs: [&[T]; N],
    out: &mut [U],
    f: F,
) {
    let outs = crate::cpu::Shared::new(out);
    pool.split(outs.len(), crate::cpu::ELEMENT_WORK, &|r| {
        // SAFETY: the workers' ranges are disjoint.
        let out = unsafe { outs.part(r.start, r.len()) };
        map(inputs.map(|x| &x[r.clone()]), out, &f);
    });
}

/// `dy * f'(x)` (given `y = f(x)`) in the accumulator type: the product of every backward pass
/// below.
#[inline(always)]
fn gradient<A: Activation, T: Element>(dy: T, x: T, y: T) -> T::Acc {
    dy.to_acc() * A::df_given_output(x.to_acc(), y.to_acc())
}

/// `dz = d_output * f'(pre)` (with `output = f(pre)`), in the accumulator type, vectorized with
/// AVX2+FMA where the CPU has it: the first step of every generated backward pass.
#[inline]
pub fn backward<A: Activation, T: Element>(
    d_output: &[T],
    pre: &[T],
    output: &[T],
    dz: &mut [T::Acc],
) {
    map([d_output, pre, output], dz, &|[d, x, y]: [T; 3]| {
        gradient::<A, T>(d, x, y)
    });
}

/// [`backward`] on the pool's threads.
pub fn backward_on<A: Activation, T: Element>(
    pool: &crate::cpu::Pool,
    d_output: &[T],
    pre: &[T],
    output: &[T],
    dz: &mut [T::Acc],
) where
    T::Acc: Send,
{
    map_on(pool, [d_output, pre, output], dz, |[d, x, y]: [T; 3]| {
        gradient::<A, T>(d, x, y)
    });
}

/// `network!`'s `Activation` entry: `y = f(x)` in the element type (through the accumulator),
/// on the pool's threads.
pub fn entry_forward_on<A: Activation, T: Element>(pool: &crate::cpu::Pool, x: &[T], y: &mut [T]) {
    map_on(pool, [x], y, |[x]: [T; 1]| T::from_acc(A::f(x.to_acc())));
}

/// The gradient of [`entry_forward_on`]: `dx = dy * f'(x)` (given `y = f(x)`), in the element
/// type, on the pool's threads.
pub fn entry_backward_on<A: Activation, T: Element>(
    pool: &crate::cpu::Pool,
    dy: &[T],
    x: &[T],
    y: &[T],
    dx: &mut [T],
) {
    map_on(pool, [dy, x, y], dx, |[dy, x, y]: [T; 3]| {
        T::from_acc(gradient::<A, T>(dy, x, y))
    });
}

/// [`entry_backward_on`] and the residual sum after it in one pass: `dx = skip + dy * f'(x)`
/// (given `y = f(x)`), for a residual block whose inner list begins with the activation. The
/// same bits as the two passes: the product is rounded to the element type before the sum.
pub fn entry_backward_sum_on<A: Activation, T: Element>(
    pool: &crate::cpu::Pool,
    skip: &[T],
    dy: &[T],
    x: &[T],
    y: &[T],
    dx: &mut [T],
) {
    map_on(pool, [skip, dy, x, y], dx, |[skip, dy, x, y]: [T; 4]| {
        let t = T::from_acc(gradient::<A, T>(dy, x, y));
        T::from_acc(skip.to_acc() + t.to_acc())
    });
}

/// A residual block's sum `y = a + b` (and, backward, its input gradient), in the element
/// type through the accumulator, on the pool's threads.
pub fn sum_on<T: Element>(pool: &crate::cpu::Pool, a: &[T], b: &[T], y: &mut [T]) {
    map_on(pool, [a, b], y, |[a, b]: [T; 2]| {
        T::from_acc(a.to_acc() + b.to_acc())
    });
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
    /// `max` (NaN to 0 like `f`): written as `f`, the loop compiles to masked stores of the
    /// zeros, microcoded on AMD CPUs and 5x slower than the convolution that precedes it.
    #[inline(always)]
    fn apply<R: Real>(xs: &mut [R]) {
        for x in xs {
            *x = x.max(R::zero());
        }
    }
    #[inline(always)]
    fn apply_to<R: Real>(src: &[R], dst: &mut [R]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.max(R::zero());
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
    #[inline(always)]
    fn df_given_output<R: Real>(_: R, y: R) -> R {
        R::ONE - y * y
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
    #[inline(always)]
    fn df_given_output<R: Real>(_: R, y: R) -> R {
        R::ONE - y * y
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
    #[inline(always)]
    fn df_given_output<R: Real>(_: R, y: R) -> R {
        y * (R::ONE - y)
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
    fn derivative_given_output_is_the_derivative() {
        fn check<A: Activation>() {
            for i in -40..=40 {
                let x = i as f64 * 0.173 + 0.011;
                assert!(
                    (A::df_given_output(x, A::f(x)) - A::df(x)).abs() < 1e-15,
                    "{}",
                    A::NAME
                );
            }
        }
        check::<Identity>();
        check::<Relu>();
        check::<Gelu>();
        check::<Tanh>();
        check::<FastTanh>();
        check::<Sigmoid>();
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
