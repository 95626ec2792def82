//! Per-channel sums over the pixels of channels-last maps: the layers' bias gradients and
//! BatchNorm's batch means.
//!
//! Written as a loop over pixels that adds each channel into a running sum, the generated
//! passes kept the sums in memory (the part's slot) and added one scalar at a time: 3.3% of the
//! IMPALA CNN's training step at one thread. Here the sums are a local array (in registers where
//! they fit) and the channels are added lane-wise, a vector at a time: each channel's sum is the
//! same chain of additions in pixel order, so the bits do not change.

use crate::element::Element;

/// `sums[c] += rows[p * C + c]` (in the accumulator type) over the whole pixels `p` of `rows`,
/// in pixel order; vectorized with AVX2 where the CPU has it.
#[inline]
pub fn add_channels<T: Element, const C: usize>(rows: &[T], sums: &mut [T::Acc; C]) {
    #[inline(always)]
    fn run<T: Element, const C: usize>(rows: &[T], sums: &mut [T::Acc; C]) {
        // A local copy: the compiler keeps it in registers across the pixels.
        let mut acc = *sums;
        for px in rows.chunks_exact(C) {
            for c in 0..C {
                acc[c] += px[c].to_acc();
            }
        }
        *sums = acc;
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run_avx2<T: Element, const C: usize>(rows: &[T], sums: &mut [T::Acc; C]) {
            run(rows, sums)
        }
        if crate::simd::avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { run_avx2(rows, sums) };
        }
    }
    run(rows, sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar chain, pixel by pixel in the accumulator type: the same bits for every
    /// channel, including values whose order of addition matters.
    fn check<T: Element, const C: usize>(pixels: usize) {
        let mut rng = crate::Rng::seed_from_u64(C as u64 + pixels as u64);
        // A part of one more pixel at the end, which is not summed.
        let rows: Vec<T> = (0..pixels * C + C - 1)
            .map(|_| {
                // Magnitudes from 1e-3 to 1e3: rounding depends on the order of the additions.
                let scale = 10f64.powf(rng.uniform(-3.0, 3.0));
                T::from_f64(rng.uniform(-1.0, 1.0) * scale)
            })
            .collect();
        let start: [T::Acc; C] = core::array::from_fn(|c| T::Acc::from_f64(c as f64 * 0.25));
        let mut expected = start;
        for p in 0..pixels {
            for c in 0..C {
                expected[c] += rows[p * C + c].to_acc();
            }
        }
        let mut sums = start;
        add_channels(&rows, &mut sums);
        for c in 0..C {
            assert_eq!(
                sums[c].to_f64().to_bits(),
                expected[c].to_f64().to_bits(),
                "channel {c}"
            );
        }
    }

    #[test]
    fn channel_sums_keep_the_scalar_chains_bits() {
        for pixels in [0, 1, 7, 1000] {
            check::<f32, 1>(pixels);
            check::<f32, 3>(pixels);
            check::<f32, 16>(pixels);
            check::<f32, 37>(pixels);
            check::<f64, 16>(pixels);
            check::<f64, 5>(pixels);
            check::<crate::f16, 16>(pixels);
            check::<crate::bf16, 7>(pixels);
        }
    }
}
