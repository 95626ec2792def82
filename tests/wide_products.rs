//! Where the CPU has AVX-512, the Winograd layers' products and tile transforms and the dense
//! layers' forward dot products and gradients run on it (`conv_runtime::wide`), and must give
//! the AVX2 kernels' bits: the same result on every x86-64 CPU with AVX2. Each Winograd
//! variant's and three dense layers' evaluate, training forward and backward pass (whose input
//! and weight gradients are products too; a dense layer's gradients skip the zeros of a ReLU)
//! run here, and again in a copy of this test run with `CONV2D_SIMD=avx2` (the choice is made
//! once per process); every value must match bit for bit. The optimizers' steps (Adam, RMSprop,
//! SGD) run on AVX-512 too: their running means are driven denormal here, and the steps' bits
//! must match as well. (A test binary of its own: the copy is this binary, run with a filter.)

use conv_runtime::prelude::*;

/// Where the copy run with AVX2 alone writes its bits.
const OUT_VAR: &str = "CONV2D_WIDE_TEST_OUT";

/// `bits_of_specs! { Name (Input, Output, State, Grads, batch): { spec }, .. }` declares each
/// layer and `all_bits()`: every layer's evaluate output, forward output, input gradient and
/// parameter gradients, from fixed parameters and inputs, as bits, in order.
macro_rules! bits_of_specs {
    ($($name:ident ($input:ident, $output:ident, $state:ident, $grads:ident, $b:literal):
        { $($spec:tt)* },)*) => {
        $(conv_runtime::conv2d! { struct $name { $($spec)*, batch: $b } })*

        fn all_bits() -> Vec<u32> {
            let mut bits: Vec<u32> = Vec::new();
            $({
                let mut cpu = Cpu::with_threads(1).expect("a CPU device");
                let mut rng = Rng::seed_from_u64(11);
                let mut layer = $name::new(&mut rng);
                let x = $input::<$b>::from_fn(|_| rng.uniform(-1.0, 1.0) as f32);
                let mut y = $output::<$b>::zeros();
                layer.evaluate(&mut cpu, &x, &mut y).expect("evaluate");
                let mut state = $state::new();
                layer.forward(&mut cpu, &x, &mut state, Mode::Train).expect("forward");
                let dy = $output::<$b>::from_fn(|_| rng.uniform(-1.0, 1.0) as f32);
                let mut dx = $input::<$b>::zeros();
                let mut grads = $grads::zeros();
                layer
                    .backward_full(&mut cpu, &state, &x, &dy, &mut dx, &mut grads, Mode::Train)
                    .expect("backward_full");
                for part in [
                    y.as_slice(),
                    state.output().as_slice(),
                    dx.as_slice(),
                    grads.weights.as_slice(),
                    grads.biases.as_slice(),
                ] {
                    bits.extend(part.iter().map(|v| v.to_bits()));
                }
            })*
            bits
        }
    };
}

bits_of_specs! {
    F4x3 (F4x3Input, F4x3Output, F4x3State, F4x3Grads, 3): { input: [10, 9, 16],
        out_channels: 16, kernel: 3, padding: 1, activation: Relu },
    F4x3Wide (F4x3WideInput, F4x3WideOutput, F4x3WideState, F4x3WideGrads, 2): {
        input: [12, 12, 32], out_channels: 48, kernel: 3, activation: Gelu },
    F2x3 (F2x3Input, F2x3Output, F2x3State, F2x3Grads, 2): { input: [6, 11, 24],
        out_channels: 40, kernel: 3, padding: [1, 0], activation: FastTanh },
    F3x2 (F3x2Input, F3x2Output, F3x2State, F3x2Grads, 2): { input: [20, 20, 4],
        out_channels: 16, kernel: 4, stride: 2, activation: Relu },
    F5x2 (F5x2Input, F5x2Output, F5x2State, F5x2Grads, 1): { input: [22, 22, 4],
        out_channels: 24, kernel: 4, stride: 2, activation: Relu },
    F2x3S2 (F2x3S2Input, F2x3S2Output, F2x3S2State, F2x3S2Grads, 2): { input: [16, 16, 16],
        out_channels: 32, kernel: 3, stride: 2, padding: 1, activation: Relu },
    // Dense: ragged rows, output channels and inputs (a register tile is 8 rows by 4
    // channels; 100 inputs end in half a vector), and MinAtar's layer at batch 32. Rows 1024
    // or 1028 inputs apart share cache sets, and are packed (on AVX-512 64 rows at a time: 70
    // rows take two chunks, the second with a ragged tile; on AVX2 per 3-row tile, 63 rows at
    // a time, the last tile one row, read as it is), and 1028 inputs end in half a vector.
    Dense (DenseInput, DenseOutput, DenseState, DenseGrads, 11): { input: [1, 1, 100],
        out_channels: 13, kernel: 1, activation: Relu },
    DensePacked (DensePackedInput, DensePackedOutput, DensePackedState, DensePackedGrads, 70): {
        input: [1, 1, 1028], out_channels: 13, kernel: 1, activation: Relu },
    DenseMinAtar (DenseMinAtarInput, DenseMinAtarOutput, DenseMinAtarState, DenseMinAtarGrads,
        32): { input: [1, 1, 1024], out_channels: 128, kernel: 1 },
}

/// Adam, each kind of RMSprop and SGD with momentum step the dense layer 200 times, and the parameters' bits
/// follow. A third of the gradients are zero from the start, a third are zero after 50 steps
/// (their running means decay through the denormals) and a third are tiny (1e-17 to 1e-21:
/// their squares are denormal or underflow to zero). Half the parameters start near the
/// denormals, where steps of that size change them (flushing denormals to zero changes these
/// bits).
fn optimizer_bits() -> Vec<u32> {
    let mut bits = Vec::new();
    for variant in 0..7 {
        let mut rng = Rng::seed_from_u64(3);
        let mut layer = Dense::new(&mut rng);
        let mut adam = Adam::new(1e-3f32);
        let mut sgd = match variant {
            5 => Sgd::new(1e-2f32).with_momentum(0.9),
            _ => {
                let mut sgd = Sgd::new(1e-2f32).with_momentum(0.5).with_weight_decay(1e-3);
                sgd.dampening = 0.1;
                sgd.nesterov = true;
                sgd
            }
        };
        let mut rmsprop = match variant {
            1 => RmsProp::new(2.5e-4f32),
            2 => RmsProp::new(2.5e-4f32)
                .with_centered(true)
                .with_alpha(0.95)
                .with_eps(0.01),
            3 => RmsProp::new(1e-3f32).with_momentum(0.9).with_alpha(0.3),
            _ => RmsProp::new(1e-3f32)
                .with_centered(true)
                .with_momentum(0.5)
                .with_weight_decay(1e-2),
        };
        // Parameters near the denormals too, so that steps of denormal size show in them.
        for part in [layer.weights.as_mut_slice(), layer.biases.as_mut_slice()] {
            for (i, w) in part.iter_mut().enumerate() {
                if i % 2 == 0 {
                    *w *= 1e-36;
                }
            }
        }
        let mut grads = DenseGrads::zeros();
        for step in 0..200 {
            for part in [grads.weights.as_mut_slice(), grads.biases.as_mut_slice()] {
                for (i, g) in part.iter_mut().enumerate() {
                    let u = rng.uniform(-1.0, 1.0) as f32;
                    *g = match i % 3 {
                        0 => 0.0,
                        1 if step >= 50 => 0.0,
                        1 => u,
                        _ => u * 10f32.powi(-17 - (i as i32 / 3) % 5),
                    };
                }
            }
            match variant {
                0 => adam.step(&mut layer, &grads),
                5 | 6 => sgd.step(&mut layer, &grads),
                _ => rmsprop.step(&mut layer, &grads),
            }
        }
        for part in [layer.weights.as_slice(), layer.biases.as_slice()] {
            bits.extend(part.iter().map(|v| v.to_bits()));
        }
    }
    bits
}

#[test]
fn wide_kernels_give_the_same_bits_on_avx512_and_avx2() {
    let mut bits = all_bits();
    bits.extend(optimizer_bits());
    if let Some(path) = std::env::var_os(OUT_VAR) {
        // The copy: write, and let the parent compare.
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        std::fs::write(path, bytes).expect("writing the AVX2 run's bits");
        return;
    }
    if !conv_runtime::simd::avx512() {
        eprintln!(
            "the wide kernels do not run on AVX-512 here (no AVX-512F and VL, or CONV2D_SIMD \
             asks for narrower kernels): both runs would take the AVX2 kernels"
        );
    }
    let out = std::env::temp_dir().join(format!("conv2d-wide-{}.bin", std::process::id()));
    let exe = std::env::current_exe().expect("this test binary");
    let status = std::process::Command::new(exe)
        .args([
            "--exact",
            "wide_kernels_give_the_same_bits_on_avx512_and_avx2",
            "--test-threads=1",
        ])
        .env("CONV2D_SIMD", "avx2")
        .env(OUT_VAR, &out)
        .status()
        .expect("running this test again with CONV2D_SIMD=avx2");
    assert!(status.success(), "the AVX2 run failed: {status}");
    let bytes = std::fs::read(&out).expect("the AVX2 run's bits");
    let _ = std::fs::remove_file(&out);
    let avx2: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(avx2.len(), bits.len());
    let differ = bits.iter().zip(&avx2).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} of {} values differ", bits.len());
}
