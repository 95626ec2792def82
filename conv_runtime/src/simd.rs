//! The vector operations generated kernels are written in.
//!
//! Generated kernels are generic over [`Simd`] and marked `#[inline(always)]`; the macro
//! instantiates each twice, with the AVX2+FMA types inside a `#[target_feature]` function and
//! with the portable types, and [`avx2_fma`] picks one per call. The AVX2 methods inline into the
//! target-feature function, so the kernel body compiles to plain `vfmadd`/`vbroadcast` code.
//! Both implementations have the same lane count, so blocking is identical on both paths.

use crate::element::{Element, Real};

/// A vector of `LANES` accumulator values.
pub trait Simd: Copy {
    /// The scalar type.
    type Elem: Real;
    /// Number of lanes.
    const LANES: usize;

    /// # Safety
    /// Callers must run on a CPU with the features the implementation needs.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn splat(x: Self::Elem) -> Self;
    /// # Safety
    /// `p` is valid for `LANES` reads.
    unsafe fn load(p: *const Self::Elem) -> Self;
    /// # Safety
    /// `p` is valid for `LANES` writes.
    unsafe fn store(self, p: *mut Self::Elem);
    /// `a * b + c` (fused where the hardware has it).
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn add(self, o: Self) -> Self;
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn sub(self, o: Self) -> Self;
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn mul(self, o: Self) -> Self;
    /// Lane-wise maximum.
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn max(self, o: Self) -> Self;

    /// The sum of the lanes.
    /// # Safety
    /// As [`Simd::zero`].
    #[inline(always)]
    unsafe fn sum(self) -> Self::Elem {
        let mut t = [Self::Elem::zero(); 16];
        self.store(t.as_mut_ptr());
        let mut total = Self::Elem::zero();
        for x in &t[..Self::LANES] {
            total += *x;
        }
        total
    }

    /// The first `n` lanes of `a`, the rest of `b`.
    /// # Safety
    /// As [`Simd::zero`]; `n <= LANES`.
    #[inline(always)]
    unsafe fn blend_first(a: Self, b: Self, n: usize) -> Self {
        let (mut ta, mut tb) = ([Self::Elem::zero(); 16], [Self::Elem::zero(); 16]);
        a.store(ta.as_mut_ptr());
        b.store(tb.as_mut_ptr());
        ta[n..Self::LANES].copy_from_slice(&tb[n..Self::LANES]);
        Self::load(ta.as_ptr())
    }

    /// Loads the first `n` lanes, the rest zero.
    /// # Safety
    /// `p` is valid for `n <= LANES` reads.
    #[inline(always)]
    unsafe fn load_partial(p: *const Self::Elem, n: usize) -> Self {
        let mut tmp = [Self::Elem::zero(); 16];
        std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
        Self::load(tmp.as_ptr())
    }

    /// Stores the first `n` lanes.
    /// # Safety
    /// `p` is valid for `n <= LANES` writes.
    #[inline(always)]
    unsafe fn store_partial(self, p: *mut Self::Elem, n: usize) {
        let mut tmp = [Self::Elem::zero(); 16];
        self.store(tmp.as_mut_ptr());
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), p, n);
    }
}

/// Whether the AVX2+FMA kernels run: where the CPU has them, unless the environment variable
/// `CONV2D_SIMD=portable` asks for the portable kernels (to test them, or to compare). Decided
/// once per process.
#[inline]
pub fn avx2_fma() -> bool {
    static CHOICE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let portable = std::env::var_os("CONV2D_SIMD").is_some_and(|v| v == "portable");
        !portable && detected()
    })
}

/// Whether the AVX2 kernels run in their AVX-512VL instantiation: the same 256-bit operations
/// with 32 vector registers instead of 16, so that register tiles and their operands never
/// spill. Where the CPU has AVX-512F and VL, unless `CONV2D_SIMD=avx2` (or `portable`) asks
/// otherwise. Decided once per process.
#[inline]
pub fn avx512vl() -> bool {
    static CHOICE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let avx2_only = std::env::var_os("CONV2D_SIMD").is_some_and(|v| v == "avx2");
        avx2_fma() && !avx2_only && detected_avx512vl()
    })
}

fn detected() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn detected_avx512vl() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Portable vectors of `L` lanes; LLVM vectorizes them for the baseline target.
#[derive(Clone, Copy)]
pub struct Lanes<R, const L: usize>([R; L]);

/// Portable f32 vectors, as wide as [`Avx2F32`].
pub type PortableF32 = Lanes<f32, 8>;
/// Portable f64 vectors, as wide as [`Avx2F64`].
pub type PortableF64 = Lanes<f64, 4>;

impl<R: Real, const L: usize> Simd for Lanes<R, L> {
    type Elem = R;
    const LANES: usize = L;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Self([R::zero(); L])
    }
    #[inline(always)]
    unsafe fn splat(x: R) -> Self {
        Self([x; L])
    }
    #[inline(always)]
    unsafe fn load(p: *const R) -> Self {
        Self(std::ptr::read_unaligned(p as *const [R; L]))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut R) {
        std::ptr::write_unaligned(p as *mut [R; L], self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        // Separate multiply and add: `mul_add` without hardware FMA is a libm call.
        Self(std::array::from_fn(|i| a.0[i] * b.0[i] + c.0[i]))
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] + o.0[i]))
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] - o.0[i]))
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] * o.0[i]))
    }
    #[inline(always)]
    unsafe fn max(self, o: Self) -> Self {
        Self(std::array::from_fn(|i| {
            if self.0[i] > o.0[i] {
                self.0[i]
            } else {
                o.0[i]
            }
        }))
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2F32, Avx2F64};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Simd;
    use std::arch::x86_64::*;

    /// Eight f32 lanes in a ymm register.
    #[derive(Clone, Copy)]
    pub struct Avx2F32(__m256);

    /// Four f64 lanes in a ymm register.
    #[derive(Clone, Copy)]
    pub struct Avx2F64(__m256d);

    macro_rules! avx2 {
        ($ty:ident, $elem:ty, $lanes:literal, $reg:ty, $zero:ident, $splat:ident, $load:ident,
         $store:ident, $fma:ident, $add:ident, $sub:ident, $mul:ident, $max:ident,
     $maskload:ident, $maskstore:ident, $blendv:ident, $cast:ident, $sum:ident, $masks:ident) => {
            impl Simd for $ty {
                type Elem = $elem;
                const LANES: usize = $lanes;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    Self($zero())
                }
                #[inline(always)]
                unsafe fn splat(x: $elem) -> Self {
                    Self($splat(x))
                }
                #[inline(always)]
                unsafe fn load(p: *const $elem) -> Self {
                    Self($load(p))
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut $elem) {
                    $store(p, self.0)
                }
                #[inline(always)]
                unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
                    Self($fma(a.0, b.0, c.0))
                }
                #[inline(always)]
                unsafe fn add(self, o: Self) -> Self {
                    Self($add(self.0, o.0))
                }
                #[inline(always)]
                unsafe fn sub(self, o: Self) -> Self {
                    Self($sub(self.0, o.0))
                }
                #[inline(always)]
                unsafe fn mul(self, o: Self) -> Self {
                    Self($mul(self.0, o.0))
                }
                #[inline(always)]
                unsafe fn max(self, o: Self) -> Self {
                    Self($max(self.0, o.0))
                }
                // Masked moves touch only the first `n` lanes' memory.
                #[inline(always)]
                unsafe fn load_partial(p: *const $elem, n: usize) -> Self {
                    let mask =
                        _mm256_loadu_si256($masks.0.as_ptr().add($lanes - n) as *const __m256i);
                    Self($maskload(p, mask))
                }
                #[inline(always)]
                unsafe fn sum(self) -> $elem {
                    $sum(self.0)
                }
                // A blend, not masked moves: masked stores are microcoded on AMD CPUs.
                #[inline(always)]
                unsafe fn blend_first(a: Self, b: Self, n: usize) -> Self {
                    let mask =
                        _mm256_loadu_si256($masks.0.as_ptr().add($lanes - n) as *const __m256i);
                    Self($blendv(b.0, a.0, $cast(mask)))
                }
                #[inline(always)]
                unsafe fn store_partial(self, p: *mut $elem, n: usize) {
                    let mask =
                        _mm256_loadu_si256($masks.0.as_ptr().add($lanes - n) as *const __m256i);
                    $maskstore(p, mask, self.0)
                }
            }
        };
    }

    /// Halves added until one lane is left.
    #[inline(always)]
    unsafe fn sum_f32(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    #[inline(always)]
    unsafe fn sum_f64(v: __m256d) -> f64 {
        let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
        _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)))
    }

    /// `LANES` all-ones lanes then `LANES` zero lanes: a window of `LANES` starting at
    /// `LANES - n` enables the first `n`. Aligned so a window never splits a cache line badly.
    #[repr(align(64))]
    struct Masks<T, const N: usize>([T; N]);
    static MASKS_32: Masks<i32, 16> =
        Masks([-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0]);
    static MASKS_64: Masks<i64, 8> = Masks([-1, -1, -1, -1, 0, 0, 0, 0]);

    avx2!(
        Avx2F32,
        f32,
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_sub_ps,
        _mm256_mul_ps,
        _mm256_max_ps,
        _mm256_maskload_ps,
        _mm256_maskstore_ps,
        _mm256_blendv_ps,
        _mm256_castsi256_ps,
        sum_f32,
        MASKS_32
    );
    avx2!(
        Avx2F64,
        f64,
        4,
        __m256d,
        _mm256_setzero_pd,
        _mm256_set1_pd,
        _mm256_loadu_pd,
        _mm256_storeu_pd,
        _mm256_fmadd_pd,
        _mm256_add_pd,
        _mm256_sub_pd,
        _mm256_mul_pd,
        _mm256_max_pd,
        _mm256_maskload_pd,
        _mm256_maskstore_pd,
        _mm256_blendv_pd,
        _mm256_castsi256_pd,
        sum_f64,
        MASKS_64
    );
}
