//! The `portable` feature (default) holds the generated kernels' copy for x86-64 CPUs without
//! AVX2 and FMA. `CONV2D_SIMD=portable` stands in for such a CPU here. With the feature, the
//! portable kernels run and compute what a scalar f64 reference computes; without it
//! (`cargo test --no-default-features --test portable_feature`), the fallible device refuses
//! the CPU with an error naming the operation, and the infallible one stops at the first kernel
//! with the same reason. (A test binary of its own: it sets the process environment before the
//! first kernel choice.)

use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    struct Probe { input: [7, 6, 5], out_channels: 9, kernel: 3, padding: 1, activation: Relu }
}

/// `Probe`'s output for one image, in f64 (NHWC, OHWI weights).
fn reference(layer: &Probe, x: &[f32]) -> Vec<f64> {
    let (h, w, c, k) = (7, 6, 5, 9);
    let (weights, biases) = (layer.weights.as_slice(), layer.biases.as_slice());
    let mut y = vec![0.0; h * w * k];
    for oh in 0..h {
        for ow in 0..w {
            for o in 0..k {
                let mut sum = f64::from(biases[o]);
                // Taps outside the image read the zero padding.
                for (kh, ih) in (0..3)
                    .map(|kh| (kh, oh + kh))
                    .filter(|&(_, i)| (1..=h).contains(&i))
                {
                    for (kw, iw) in (0..3)
                        .map(|kw| (kw, ow + kw))
                        .filter(|&(_, i)| (1..=w).contains(&i))
                    {
                        for i in 0..c {
                            let xi = x[((ih - 1) * w + iw - 1) * c + i];
                            sum +=
                                f64::from(weights[((o * 3 + kh) * 3 + kw) * c + i]) * f64::from(xi);
                        }
                    }
                }
                y[(oh * w + ow) * k + o] = sum.max(0.0);
            }
        }
    }
    y
}

#[test]
fn a_cpu_without_avx2_gets_the_portable_kernels_or_a_clear_refusal() {
    std::env::set_var("CONV2D_SIMD", "portable");
    let mut rng = Rng::seed_from_u64(7);
    let layer = Probe::new(&mut rng);
    let x = Tensor::<f32, 1, 7, 6, 5>::from_fn(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0);
    let mut y = Tensor::<f32, 1, 7, 6, 9>::zeros();
    if cfg!(any(feature = "portable", not(target_arch = "x86_64"))) {
        assert!(
            !conv_runtime::simd::avx2_fma(),
            "CONV2D_SIMD=portable was ignored"
        );
        conv_runtime::simd::kernels_for_this_cpu().expect("the portable kernels were built");
        let mut cpu = Cpu::with_threads(1).expect("the portable kernels run on any CPU");
        layer.evaluate(&mut cpu, &x, &mut y).expect("evaluate");
        for (got, want) in y.as_slice().iter().zip(reference(&layer, x.as_slice())) {
            assert!(
                (f64::from(*got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
        return;
    }
    let Err(error) = Cpu::with_threads(1) else {
        panic!("a CPU without kernels is accepted");
    };
    assert_eq!(error.operation, "choosing the CPU kernels");
    assert!(error.reason.contains("`portable` feature"), "{error}");
    let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = layer.evaluate(&mut Cpu::new(), &x, &mut y);
    }))
    .expect_err("the infallible device stops at the first kernel");
    let message = stopped.downcast_ref::<String>().map_or("", String::as_str);
    assert!(message.contains("`portable` feature"), "{message}");
}
