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

    /// `out[i] = v[i].sum()` for every `i`: the same sums, bit for bit, computed side by side
    /// where the implementation can (a register tile's dot products end here).
    /// # Safety
    /// As [`Simd::zero`]; `out` is at least as long as `v`.
    #[inline(always)]
    unsafe fn sums(v: &[Self], out: &mut [Self::Elem]) {
        // Index loops, here and below: iterator adapters and `copy_from_slice` are calls across
        // codegen units without LTO.
        for i in 0..v.len().min(out.len()) {
            out[i] = v[i].sum();
        }
    }

    /// The first `n` lanes of `a`, the rest of `b`.
    /// # Safety
    /// As [`Simd::zero`]; `n <= LANES`.
    #[inline(always)]
    unsafe fn blend_first(a: Self, b: Self, n: usize) -> Self {
        let (mut ta, mut tb) = ([Self::Elem::zero(); 16], [Self::Elem::zero(); 16]);
        a.store(ta.as_mut_ptr());
        b.store(tb.as_mut_ptr());
        std::ptr::copy_nonoverlapping(tb.as_ptr().add(n), ta.as_mut_ptr().add(n), Self::LANES - n);
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

    /// Runs a Winograd chunk's products ([`crate::wide`]) on wider vectors than `Self`'s where
    /// the CPU has them: `true` if it did. The same sums in the same order, so the same bits.
    /// # Safety
    /// As [`crate::wide::product`].
    #[inline(always)]
    unsafe fn wide_product(
        _p: &crate::wide::Product,
        _a: *const Self::Elem,
        _w: *const Self::Elem,
        _o: *mut Self::Elem,
        _count: usize,
    ) -> bool {
        false
    }

    /// Runs a Winograd chunk's weight-gradient products ([`crate::wide::weight_product`]) on
    /// wider vectors than `Self`'s where the CPU has them: `true` if it did. The same bits.
    /// # Safety
    /// As [`crate::wide::weight_product`].
    #[inline(always)]
    unsafe fn wide_weight_product(
        _p: &crate::wide::WeightProduct,
        _v: *const Self::Elem,
        _n: *const Self::Elem,
        _du: *mut Self::Elem,
        _count: usize,
        _fresh: bool,
    ) -> bool {
        false
    }

    /// Runs a dense layer's forward dot products ([`crate::wide::dense`]) on wider vectors
    /// than `Self`'s where the CPU has them: `true` if it did. The same bits.
    /// # Safety
    /// As [`crate::wide::dense`].
    #[inline(always)]
    unsafe fn wide_dense(
        _d: &crate::wide::Dense,
        _x: *const Self::Elem,
        _w: *const Self::Elem,
        _bias: *const Self::Elem,
        _y: *mut Self::Elem,
    ) -> bool {
        false
    }

    /// Runs a dense layer's gradient products ([`crate::wide::axpys`]) on wider vectors than
    /// `Self`'s where the CPU has them: `true` if it did. The same bits.
    /// # Safety
    /// As [`crate::wide::axpys`].
    #[inline(always)]
    unsafe fn wide_axpys(
        _a: &crate::wide::Axpys,
        _g: *const Self::Elem,
        _v: *const Self::Elem,
        _out: *mut Self::Elem,
    ) -> bool {
        false
    }

    /// Runs a Winograd tile's transform ([`crate::winograd::tiles`]) over its `channels`
    /// channels (a multiple of `LANES`): a vector of `Self` at a time, or wider vectors where
    /// the CPU has them ([`crate::wide::channels`]). Lane-wise, so the same bits.
    /// # Safety
    /// As [`crate::winograd::tiles::Transform::run`] for every vector of the channels.
    #[inline(always)]
    unsafe fn channels<V, T>(t: &T, channels: usize)
    where
        V: crate::winograd::Variant,
        T: crate::winograd::tiles::Transform<Self::Elem>,
    {
        crate::winograd::tiles::by_vectors::<V, Self, T>(t, 0, channels)
    }

    /// Asks for the cache line holding `p` ahead of its use (`prefetcht0` on x86_64, nothing
    /// elsewhere): for kernels whose next lines are a page or more apart, which the hardware's
    /// stream prefetchers do not follow.
    /// # Safety
    /// As [`Simd::zero`]; `p` is inside an allocation (a prefetch never faults).
    #[inline(always)]
    unsafe fn prefetch(p: *const Self::Elem) {
        #[cfg(target_arch = "x86_64")]
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// Whether the AVX2+FMA kernels run: where the CPU has them, unless the environment variable
/// `CONV2D_SIMD=portable` asks for the portable kernels (to test them, or to compare). Decided
/// once per process. Always, without a look at either, in a build whose target has AVX2 and
/// FMA (`-C target-cpu=native` on such a CPU): generated code compiles no portable kernels
/// there.
#[inline]
pub fn avx2_fma() -> bool {
    if cfg!(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )) {
        return true;
    }
    static CHOICE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| !asked("portable") && detected())
}

/// Whether the Winograd layers' products and tile transforms and the dense layers' forward dot
/// products run on AVX-512 ([`crate::wide`]), and the networks' pooling rows with them (a large
/// max-pooling gradient with streaming stores, [`STREAM_BYTES`]): where the AVX2 kernels run and
/// the CPU has AVX-512F and AVX-512VL (the 256-bit halves in registers 16-31), and POPCNT (every
/// AVX-512 CPU: the kernels count their masks' bits), unless `CONV2D_SIMD=avx2` asks for AVX2
/// alone (to compare). Decided once per process.
#[inline]
pub fn avx512() -> bool {
    static CHOICE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let detected = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("popcnt");
        #[cfg(not(target_arch = "x86_64"))]
        let detected = false;
        !asked("avx2") && avx2_fma() && detected
    })
}

/// Bytes from which a pass writes a map it does not read again with streaming stores (around
/// the caches): a core's L2 cache on the machine measured (2 MiB, 2 vCPUs), past which the
/// map's reader mostly misses it anyway, and its lines are not first read from memory only to be
/// overwritten. (Streaming stores skip the shared L3 too: on a machine whose L3 holds such a
/// map, this may not pay.)
#[doc(hidden)]
pub const STREAM_BYTES: usize = 2 << 20;

/// Whether `CONV2D_SIMD` asks for `value`'s kernels.
fn asked(value: &str) -> bool {
    std::env::var_os("CONV2D_SIMD").is_some_and(|v| v == value)
}

/// Whether generated kernels can run on this CPU: `Ok` where they have a portable copy (the
/// `portable` feature, default; any target but x86-64) or the CPU takes their AVX2 copy. A
/// build without `portable` on an x86-64 CPU without AVX2 and FMA (or asked for the portable
/// kernels by `CONV2D_SIMD=portable`) has none to run: devices that can fail refuse it here
/// ([`crate::Cpu::with_threads`]); others stop at the first kernel (see [`no_kernels`]).
pub fn kernels_for_this_cpu() -> crate::Result<()> {
    if cfg!(any(feature = "portable", not(target_arch = "x86_64"))) || avx2_fma() {
        return Ok(());
    }
    Err(crate::Error::new("choosing the CPU kernels", NO_KERNELS))
}

const NO_KERNELS: &str = "this CPU has no AVX2 and FMA (or CONV2D_SIMD=portable asks for the \
     portable kernels), and conv_runtime was built without its `portable` feature, which holds \
     the kernels for such CPUs";

/// Where generated code goes on a CPU it has no kernels for (see [`kernels_for_this_cpu`]).
/// A device that could not refuse the CPU (`Cpu::new`, infallible) got here.
#[doc(hidden)]
#[cold]
#[inline(never)]
pub fn no_kernels() -> ! {
    panic!("conv_runtime: {NO_KERNELS}")
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

/// Portable vectors of `L` lanes; LLVM vectorizes them for the baseline target.
#[derive(Clone, Copy)]
pub struct Lanes<R, const L: usize>([R; L]);

/// Portable f32 vectors, as wide as [`Avx2F32`].
#[cfg(not(target_arch = "x86_64"))]
pub type PortableF32 = Lanes<f32, 8>;
/// Portable f64 vectors, as wide as [`Avx2F64`].
#[cfg(not(target_arch = "x86_64"))]
pub type PortableF64 = Lanes<f64, 4>;
/// On x86_64 the portable vectors are the baseline's SSE2 registers, two per vector, written
/// out: the fallback kernels compile from ready vector operations instead of arrays LLVM must
/// vectorize, which had made half of a network's build time.
#[cfg(target_arch = "x86_64")]
pub type PortableF32 = Sse2F32;
/// As [`PortableF32`].
#[cfg(target_arch = "x86_64")]
pub type PortableF64 = Sse2F64;

// Index loops: `array::from_fn`'s closure is a call across codegen units without LTO.
#[allow(clippy::needless_range_loop)]
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
        let mut r = c.0;
        for i in 0..L {
            r[i] = a.0[i] * b.0[i] + c.0[i];
        }
        Self(r)
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        let mut r = self.0;
        for i in 0..L {
            r[i] = self.0[i] + o.0[i];
        }
        Self(r)
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        let mut r = self.0;
        for i in 0..L {
            r[i] = self.0[i] - o.0[i];
        }
        Self(r)
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        let mut r = self.0;
        for i in 0..L {
            r[i] = self.0[i] * o.0[i];
        }
        Self(r)
    }
    #[inline(always)]
    unsafe fn max(self, o: Self) -> Self {
        let mut r = o.0;
        for i in 0..L {
            if self.0[i] > o.0[i] {
                r[i] = self.0[i];
            }
        }
        Self(r)
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2F32, Avx2F64, Sse2F32, Sse2F64};

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

    impl Avx2F32 {
        /// The register, for [`crate::wide`]'s kernels, which hold two of these in a zmm's halves.
        #[inline(always)]
        pub(crate) fn raw(self) -> __m256 {
            self.0
        }

        #[inline(always)]
        pub(crate) fn from_raw(v: __m256) -> Self {
            Self(v)
        }
    }

    macro_rules! avx2 {
        ($ty:ident, $elem:ty, $lanes:literal, $reg:ty, $zero:ident, $splat:ident, $load:ident,
         $store:ident, $fma:ident, $add:ident, $sub:ident, $mul:ident, $max:ident,
     $maskload:ident, $maskstore:ident, $blendv:ident, $cast:ident, $sum:ident, $sums:ident,
     $masks:ident $(, $wide:path)?) => {
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
                $(
                    #[inline(always)]
                    unsafe fn wide_product(
                        p: &crate::wide::Product,
                        a: *const $elem,
                        w: *const $elem,
                        o: *mut $elem,
                        count: usize,
                    ) -> bool {
                        $wide(p, a, w, o, count)
                    }
                    #[inline(always)]
                    unsafe fn wide_weight_product(
                        p: &crate::wide::WeightProduct,
                        v: *const $elem,
                        n: *const $elem,
                        du: *mut $elem,
                        count: usize,
                        fresh: bool,
                    ) -> bool {
                        crate::wide::weight_product(p, v, n, du, count, fresh)
                    }
                    #[inline(always)]
                    unsafe fn wide_dense(
                        d: &crate::wide::Dense,
                        x: *const $elem,
                        w: *const $elem,
                        bias: *const $elem,
                        y: *mut $elem,
                    ) -> bool {
                        crate::wide::dense(d, x, w, bias, y)
                    }
                    #[inline(always)]
                    unsafe fn wide_axpys(
                        a: &crate::wide::Axpys,
                        g: *const $elem,
                        v: *const $elem,
                        out: *mut $elem,
                    ) -> bool {
                        crate::wide::axpys(a, g, v, out)
                    }
                    #[inline(always)]
                    unsafe fn channels<V, T>(t: &T, channels: usize)
                    where
                        V: crate::winograd::Variant,
                        T: crate::winograd::tiles::Transform<Self::Elem>,
                    {
                        if !crate::wide::channels::<V, T>(t, channels) {
                            crate::winograd::tiles::by_vectors::<V, Self, T>(t, 0, channels)
                        }
                    }
                )?
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
                #[inline(always)]
                unsafe fn sums(v: &[Self], out: &mut [$elem]) {
                    $sums(v, out)
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

    /// Eight f32 lanes in two xmm registers (SSE2, the x86_64 baseline).
    #[derive(Clone, Copy)]
    pub struct Sse2F32(__m128, __m128);

    /// Four f64 lanes in two xmm registers (SSE2, the x86_64 baseline).
    #[derive(Clone, Copy)]
    pub struct Sse2F64(__m128d, __m128d);

    /// The portable vectors' operations on register pairs: the same results, lane for lane,
    /// as [`super::Lanes`] (a separate multiply and add; `max` keeps the second operand unless
    /// the first is greater, as `maxps` does).
    macro_rules! sse2 {
        ($ty:ident, $elem:ty, $lanes:literal, $half:literal, $zero:ident, $splat:ident,
         $load:ident, $store:ident, $add:ident, $sub:ident, $mul:ident, $max:ident) => {
            impl Simd for $ty {
                type Elem = $elem;
                const LANES: usize = $lanes;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    Self($zero(), $zero())
                }
                #[inline(always)]
                unsafe fn splat(x: $elem) -> Self {
                    Self($splat(x), $splat(x))
                }
                #[inline(always)]
                unsafe fn load(p: *const $elem) -> Self {
                    Self($load(p), $load(p.add($half)))
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut $elem) {
                    $store(p, self.0);
                    $store(p.add($half), self.1);
                }
                #[inline(always)]
                unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
                    Self($add($mul(a.0, b.0), c.0), $add($mul(a.1, b.1), c.1))
                }
                #[inline(always)]
                unsafe fn add(self, o: Self) -> Self {
                    Self($add(self.0, o.0), $add(self.1, o.1))
                }
                #[inline(always)]
                unsafe fn sub(self, o: Self) -> Self {
                    Self($sub(self.0, o.0), $sub(self.1, o.1))
                }
                #[inline(always)]
                unsafe fn mul(self, o: Self) -> Self {
                    Self($mul(self.0, o.0), $mul(self.1, o.1))
                }
                #[inline(always)]
                unsafe fn max(self, o: Self) -> Self {
                    Self($max(self.0, o.0), $max(self.1, o.1))
                }
            }
        };
    }

    sse2!(
        Sse2F32,
        f32,
        8,
        4,
        _mm_setzero_ps,
        _mm_set1_ps,
        _mm_loadu_ps,
        _mm_storeu_ps,
        _mm_add_ps,
        _mm_sub_ps,
        _mm_mul_ps,
        _mm_max_ps
    );
    sse2!(
        Sse2F64,
        f64,
        4,
        2,
        _mm_setzero_pd,
        _mm_set1_pd,
        _mm_loadu_pd,
        _mm_storeu_pd,
        _mm_add_pd,
        _mm_sub_pd,
        _mm_mul_pd,
        _mm_max_pd
    );

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

    /// [`sum_f32`] of up to eight vectors at once, transposed: the same additions in the same
    /// tree (halves, then lanes two apart, then neighbours), so the same bits.
    #[inline(always)]
    unsafe fn sums_f32(v: &[Avx2F32], out: &mut [f32]) {
        let len = v.len().min(out.len());
        let mut start = 0;
        while start < len {
            let n = (len - start).min(8);
            let mut g = [_mm256_setzero_ps(); 8];
            for i in 0..n {
                g[i] = v[start + i].0;
            }
            // u[i]: vector i's halves added (lanes 0-3), vector i + 4's (lanes 4-7).
            let mut u = [_mm256_setzero_ps(); 4];
            for (i, u) in u.iter_mut().enumerate() {
                *u = _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(g[i], g[i + 4]),
                    _mm256_permute2f128_ps::<0x31>(g[i], g[i + 4]),
                );
            }
            // Lanes two apart: [0 0 1 1 | 4 4 5 5] and [2 2 3 3 | 6 6 7 7], then neighbours.
            let sums = _mm256_hadd_ps(two_apart(u[0], u[1]), two_apart(u[2], u[3]));
            let mut t = [0.0f32; 8];
            _mm256_storeu_ps(t.as_mut_ptr(), sums);
            std::ptr::copy_nonoverlapping(t.as_ptr(), out.as_mut_ptr().add(start), n);
            start += 8;
        }
    }

    /// Lanes two apart added, of `a`'s two halves and `b`'s (a helper function, not a closure:
    /// closures do not take on the caller's target features, and would not inline).
    #[inline(always)]
    unsafe fn two_apart(a: __m256, b: __m256) -> __m256 {
        let (a, b) = (_mm256_castps_pd(a), _mm256_castps_pd(b));
        _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)),
        )
    }

    /// [`sum_f64`] of up to four vectors at once, transposed, bit for bit (see [`sums_f32`]).
    #[inline(always)]
    unsafe fn sums_f64(v: &[Avx2F64], out: &mut [f64]) {
        let len = v.len().min(out.len());
        let mut start = 0;
        while start < len {
            let n = (len - start).min(4);
            let mut g = [_mm256_setzero_pd(); 4];
            for i in 0..n {
                g[i] = v[start + i].0;
            }
            // [0 0 | 2 2] and [1 1 | 3 3], halves added, then neighbours.
            let (a, b) = (
                _mm256_add_pd(
                    _mm256_permute2f128_pd::<0x20>(g[0], g[2]),
                    _mm256_permute2f128_pd::<0x31>(g[0], g[2]),
                ),
                _mm256_add_pd(
                    _mm256_permute2f128_pd::<0x20>(g[1], g[3]),
                    _mm256_permute2f128_pd::<0x31>(g[1], g[3]),
                ),
            );
            let sums = _mm256_hadd_pd(a, b);
            let mut t = [0.0f64; 4];
            _mm256_storeu_pd(t.as_mut_ptr(), sums);
            std::ptr::copy_nonoverlapping(t.as_ptr(), out.as_mut_ptr().add(start), n);
            start += 4;
        }
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
        sums_f32,
        MASKS_32,
        crate::wide::product
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
        sums_f64,
        MASKS_64
    );
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Values of many magnitudes and both signs, so that any other order of additions shows.
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let mantissa = (x >> 40) as f64 / (1u64 << 24) as f64 - 0.5;
                mantissa * 2f64.powi(((x >> 8) % 40) as i32 - 20)
            })
            .collect()
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn check<S: Simd>(cast: impl Fn(f64) -> S::Elem) {
        for count in 1..=19 {
            let data: Vec<S::Elem> = values(count * S::LANES, count as u64)
                .into_iter()
                .map(&cast)
                .collect();
            let v: Vec<S> = (0..count)
                .map(|i| S::load(data[i * S::LANES..].as_ptr()))
                .collect();
            let mut side_by_side = vec![cast(0.0); count];
            S::sums(&v, &mut side_by_side);
            for (i, x) in v.iter().enumerate() {
                assert!(side_by_side[i] == x.sum(), "sum {i} of {count}");
            }
        }
    }

    /// Every operation of `S` on `data`, stored: the bits to compare between implementations.
    unsafe fn all_ops<S: Simd>(data: &[S::Elem]) -> Vec<S::Elem> {
        let l = S::LANES;
        let (a, b, c) = (
            S::load(data.as_ptr()),
            S::load(data[l..].as_ptr()),
            S::load(data[2 * l..].as_ptr()),
        );
        let results = [
            S::zero(),
            S::splat(data[3]),
            S::fma(a, b, c),
            a.add(b),
            a.sub(b),
            a.mul(b),
            a.max(b),
            b.max(a),
            S::blend_first(a, b, 3),
            S::load_partial(data.as_ptr(), l - 1),
        ];
        let mut out = vec![data[0]; results.len() * l + 2 * l];
        for (r, o) in results.iter().zip(out.chunks_mut(l)) {
            r.store(o.as_mut_ptr());
        }
        c.store_partial(out[results.len() * l..].as_mut_ptr(), l - 2);
        out.push(a.sum());
        out
    }

    /// The SSE2 pairs (x86_64's portable vectors) and the array vectors (every other
    /// architecture's) agree bit for bit, NaN and zero signs included: the portable kernels the
    /// tests run on x86_64 compute what they compute elsewhere.
    #[test]
    fn sse2_pairs_are_the_array_vectors() {
        let mut data = values(3 * 8, 7);
        data[1] = f64::NAN;
        data[8 + 2] = f64::NAN;
        // Zeros of both signs against each other: lane 4 of the f32 vectors, lane 0 of the f64
        // ones (which see the first 12 values).
        data[4] = 0.0;
        data[8 + 4] = -0.0;
        data[0] = -0.0;
        data[5] = f64::INFINITY;
        let (d32, d64): (Vec<f32>, Vec<f64>) = (data.iter().map(|&x| x as f32).collect(), data);
        let bits32 = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let bits64 = |v: Vec<f64>| v.into_iter().map(f64::to_bits).collect::<Vec<_>>();
        // SAFETY: both implementations need only the baseline target.
        unsafe {
            assert_eq!(
                bits32(all_ops::<Sse2F32>(&d32)),
                bits32(all_ops::<Lanes<f32, 8>>(&d32))
            );
            assert_eq!(
                bits64(all_ops::<Sse2F64>(&d64[..12])),
                bits64(all_ops::<Lanes<f64, 4>>(&d64[..12]))
            );
        }
    }

    #[test]
    fn sums_side_by_side_are_the_same_bits_as_one_by_one() {
        if !detected() {
            return;
        }
        // SAFETY: the CPU has AVX2 and FMA (checked).
        unsafe {
            check::<Avx2F32>(|x| x as f32);
            check::<Avx2F64>(|x| x);
        }
    }
}
