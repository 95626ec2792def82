//! The synthetic task the training tests learn, on the CPU (tests/training.rs) and on the GPU
//! (tests/cuda_device.rs): which quadrant of a noisy 16x16 image holds a bright 3x3 blob.

use conv_runtime::prelude::*;

pub const SIDE: usize = 16;
pub const PIXELS: usize = SIDE * SIDE;
pub const CLASSES: usize = 4;
/// conv2's output, 4x4x16, is the read-out's input.
pub const FEATURES: usize = 4 * 4 * 16;
pub const BATCH: usize = 32;
pub const TRAIN: usize = 1024;
pub const TEST: usize = 512;
pub const EPOCHS: usize = 6;
pub const NOISE: f64 = 0.5;

/// Images (row-major, one channel, `PIXELS` each) and their labels.
pub struct Dataset {
    pub images: Vec<f32>,
    pub labels: Vec<usize>,
}

/// `n` images: background noise N(0, 0.25^2), plus 1.0 on a 3x3 blob lying entirely inside a
/// random quadrant (the label: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right).
pub fn dataset(n: usize, rng: &mut Rng) -> Dataset {
    let mut images = vec![0.0f32; n * PIXELS];
    let mut labels = Vec::with_capacity(n);
    for image in images.chunks_exact_mut(PIXELS) {
        for p in image.iter_mut() {
            *p = (NOISE * rng.normal()) as f32;
        }
        let quadrant = (rng.uniform(0.0, 4.0) as usize).min(3);
        let half = SIDE / 2;
        let top =
            (quadrant / 2) * half + (rng.uniform(0.0, (half - 2) as f64) as usize).min(half - 3);
        let left =
            (quadrant % 2) * half + (rng.uniform(0.0, (half - 2) as f64) as usize).min(half - 3);
        for r in top..top + 3 {
            for c in left..left + 3 {
                image[r * SIDE + c] += 1.0;
            }
        }
        labels.push(quadrant);
    }
    Dataset { images, labels }
}
