//! Max-pooling in the preceding convolution's epilogue (a network's `evaluate`): the
//! convolution's workers report each run of output pixels as they finish it, and whichever
//! worker finishes the last map row that a pooling row's windows read pools that row at once,
//! while its map rows are still in cache. Nothing waits: a row is pooled exactly once, by the
//! worker whose report completes it.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Which pooling rows of a map (batch-flattened NHWC rows) are complete, as the convolution's
/// workers finish its pixels.
#[doc(hidden)]
#[derive(Debug)]
pub struct PoolGate {
    /// Per map row (`batch * in_h`): its pixels finished so far.
    pixels: Vec<AtomicUsize>,
    /// Per pooling row (`batch * out_h`): the map rows its windows read, finished so far.
    rows: Vec<AtomicUsize>,
    in_h: usize,
    in_w: usize,
    out_h: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
}

impl PoolGate {
    /// A gate for `batch` maps of `in_h x in_w` pixels pooled into `out_h` rows by windows of
    /// `kernel` rows, `stride` apart, the first starting `padding` rows above the map.
    pub fn new(
        batch: usize,
        [in_h, in_w]: [usize; 2],
        out_h: usize,
        [kernel, stride, padding]: [usize; 3],
    ) -> Self {
        let counters = |n: usize| (0..n).map(|_| AtomicUsize::new(0)).collect();
        Self {
            pixels: counters(batch * in_h),
            rows: counters(batch * out_h),
            in_h,
            in_w,
            out_h,
            kernel,
            stride,
            padding,
        }
    }

    /// Forgets the previous call's progress.
    pub fn reset(&mut self) {
        for c in self.pixels.iter_mut().chain(self.rows.iter_mut()) {
            *c.get_mut() = 0;
        }
    }

    /// The map rows (of its image) that pooling row `row` of an image reads.
    pub fn window(&self, row: usize) -> Range<usize> {
        let start = row * self.stride;
        let first = start.saturating_sub(self.padding);
        let end = (start + self.kernel)
            .saturating_sub(self.padding)
            .min(self.in_h);
        first..end.max(first)
    }

    /// Pixels `first..first + count` of the maps (batch-flattened) are final: runs `pool` on
    /// each pooling row (batch-flattened) they complete, on the calling thread.
    pub fn done(&self, first: usize, count: usize, pool: &dyn Fn(usize)) {
        if count == 0 {
            return;
        }
        let end = first + count;
        for r in first / self.in_w..=(end - 1) / self.in_w {
            let here = end.min((r + 1) * self.in_w) - first.max(r * self.in_w);
            // A run covering the whole row finishes it alone; otherwise the report that brings
            // the count to the row's width does. Acquire-release: the finisher sees every
            // other worker's pixels of the row.
            if here < self.in_w
                && self.pixels[r].fetch_add(here, Ordering::AcqRel) + here < self.in_w
            {
                continue;
            }
            let (image, h) = (r / self.in_h, r % self.in_h);
            // The pooling rows whose windows read map row `h`.
            let lo = (h + self.padding + 1)
                .saturating_sub(self.kernel)
                .div_ceil(self.stride);
            let hi = ((h + self.padding) / self.stride + 1).min(self.out_h);
            for p in lo..hi {
                let row = image * self.out_h + p;
                if self.rows[row].fetch_add(1, Ordering::AcqRel) + 1 == self.window(p).len() {
                    pool(row);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Every pooling row runs exactly once, after every map row its windows read, whatever the
    /// order and the cut of the reports.
    #[test]
    fn each_row_once_after_its_window() {
        for (in_h, in_w, kernel, stride, padding) in [
            (64, 64, 3, 2, 1),
            (7, 5, 2, 2, 0),
            (9, 3, 3, 1, 1),
            (1, 4, 2, 1, 1),
        ] {
            let out_h = (in_h + 2 * padding - kernel) / stride + 1;
            let batch = 2;
            let mut gate = PoolGate::new(batch, [in_h, in_w], out_h, [kernel, stride, padding]);
            for run in [1, 3, in_w, 2 * in_w + 1, batch * in_h * in_w] {
                gate.reset();
                let finished = Mutex::new(vec![false; batch * in_h]);
                let pooled = Mutex::new(vec![0; batch * out_h]);
                let total = batch * in_h * in_w;
                // Runs reported in reverse order.
                let starts: Vec<_> = (0..total).step_by(run).collect();
                let mut row_pixels = vec![0; batch * in_h];
                for &s in starts.iter().rev() {
                    let count = run.min(total - s);
                    for q in s..s + count {
                        row_pixels[q / in_w] += 1;
                        if row_pixels[q / in_w] == in_w {
                            finished.lock().unwrap()[q / in_w] = true;
                        }
                    }
                    gate.done(s, count, &|row| {
                        let (image, p) = (row / out_h, row % out_h);
                        let done = finished.lock().unwrap();
                        for h in gate.window(p) {
                            assert!(done[image * in_h + h], "row {row} before map row {h}");
                        }
                        pooled.lock().unwrap()[row] += 1;
                    });
                }
                assert!(pooled.into_inner().unwrap().iter().all(|&n| n == 1));
            }
        }
    }
}
