//! Layers whose inputs are mostly zero run passes over the nonzero inputs only, with the same
//! bits as the passes over every input:
//! - a dense layer (after a ReLU) runs its forward pass on a transposed copy of its weights,
//!   from the third pass with the same weights on, from the 64th at batch 1 (on AVX-512:
//!   `conv_runtime::wide::sparse`; elsewhere every pass takes the dot products). Each pass must
//!   give the first pass's bits: on one thread and on two that split every call, after the
//!   weights change, and for `forward` as for `evaluate`; an action (batch 1) the bits of its
//!   row in a batch;
//! - a direct convolution whose input is at most an eighth nonzero (a binary game screen)
//!   scatters each nonzero input into the outputs and weight-gradient rows it reaches
//!   (`conv_macros::expand::scatter`). The choice is per call, on the whole batch: image 0 of a
//!   batch with a dense image 1 takes the tile kernels, of a batch of two sparse images the
//!   scatter, and both must give the same bits (the weight gradient with image 1's output
//!   gradient zero, so that it adds nothing).

use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    // Ragged everywhere: 1030 inputs (half a vector left), 130 outputs (two blocks of 64 and
    // 2 more), 9 rows (groups of 4 and one row).
    struct Fc { input: [1, 1, 1030], out_channels: 130, kernel: 1, activation: Relu, batch: 9 }
}

/// `passes` evaluations and as many training forward passes, each as bits.
fn passes(cpu: &mut Cpu, layer: &mut Fc, x: &FcInput<9>, passes: usize) -> Vec<Vec<u32>> {
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let mut out = Vec::new();
    for _ in 0..passes {
        let mut y = FcOutput::<9>::zeros();
        layer.evaluate(cpu, x, &mut y).expect("evaluate");
        out.push(bits(y.as_slice()));
    }
    for _ in 0..passes {
        let mut state = FcState::new();
        layer
            .forward(cpu, x, &mut state, Mode::Train)
            .expect("forward");
        out.push(bits(state.output().as_slice()));
    }
    out
}

/// A device of one thread and one of two that splits every call.
fn devices() -> [Cpu; 2] {
    [
        Cpu::with_threads(1).expect("a CPU device"),
        Cpu::with_threads(2)
            .expect("a 2-thread CPU device")
            .__split_everything(),
    ]
}

#[test]
fn passes_over_the_nonzero_inputs_give_the_dot_products_bits() {
    let mut rng = Rng::seed_from_u64(21);
    let mut layer = Fc::new(&mut rng);
    // Half the inputs zero (or negative zero), as after a ReLU, in runs and alone.
    let x = FcInput::<9>::from_fn(|i| match (i * 7919) % 13 {
        0..=4 => 0.0,
        5 => -0.0,
        6 if i % 1030 < 40 => 0.0,
        _ => rng.uniform(0.0, 2.0) as f32,
    });
    let mut devices = devices();
    let mut first: Option<Vec<u32>> = None;
    for step in 0..2 {
        if step == 1 {
            // New weights: a new copy, and new results.
            for w in layer.weights.as_mut_slice().iter_mut().step_by(3) {
                *w = -*w;
            }
            first = None;
        }
        for cpu in &mut devices {
            for (i, bits) in passes(cpu, &mut layer, &x, 5).into_iter().enumerate() {
                let want = first.get_or_insert_with(|| bits.clone());
                let differ = bits.iter().zip(want.iter()).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differ, 0,
                    "weights {step}, pass {i}: {differ} values differ"
                );
            }
        }
    }
}

#[test]
fn one_row_over_the_nonzero_inputs_gives_its_rows_bits_in_a_batch() {
    let mut rng = Rng::seed_from_u64(22);
    let mut layer = Fc::new(&mut rng);
    let x = FcInput::<9>::from_fn(|i| match (i * 7919) % 11 {
        0..=5 => 0.0,
        _ => rng.uniform(0.0, 2.0) as f32,
    });
    let mut devices = devices();
    for step in 0..2 {
        if step == 1 {
            for w in layer.weights.as_mut_slice().iter_mut().step_by(5) {
                *w = -*w;
            }
        }
        // The batch's first pass takes the dot products; each row alone, 70 passes (past
        // the 64th on the copy), must give its row's bits.
        let mut batch = FcOutput::<9>::zeros();
        layer
            .evaluate(&mut devices[0], &x, &mut batch)
            .expect("evaluate");
        for cpu in &mut devices {
            for row in [0, 4, 8] {
                let one =
                    FcInput::<1>::from_vec(x.as_slice()[row * 1030..(row + 1) * 1030].to_vec())
                        .expect("a row");
                let want = &batch.as_slice()[row * 130..(row + 1) * 130];
                for pass in 0..70 {
                    let mut y = FcOutput::<1>::zeros();
                    layer.evaluate(cpu, &one, &mut y).expect("evaluate");
                    let differ = y
                        .as_slice()
                        .iter()
                        .zip(want)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "weights {step}, row {row}, pass {pass}: {differ} values differ"
                    );
                }
            }
        }
    }
}

/// `scatter_case!(name, { keys }, probe)`: a layer of `keys` at batch 2; `evaluate`, `forward`
/// and `backward_full` of image 0 (mostly zero) beside a dense image 1 (the tile kernels) and
/// beside itself (the scatter) must give the same bits, the weight gradient with image 1's
/// output gradient zero. `probe`: also check which pass ran (a ReLU maps the probe's NaN to
/// zero).
macro_rules! scatter_case {
    ($name:ident, { $($keys:tt)* }, $probe:expr) => {
        mod $name {
            use conv_runtime::prelude::*;

            conv_runtime::conv2d! {
                struct Layer { $($keys)* batch: 2 }
            }

            #[test]
            fn scatter_gives_the_tile_kernels_bits() {
                const LEN: usize = Layer::INPUT_HEIGHT * Layer::INPUT_WIDTH * Layer::INPUT_CHANNELS;
                const OUT: usize =
                    Layer::OUTPUT_HEIGHT * Layer::OUTPUT_WIDTH * Layer::OUTPUT_CHANNELS;
                let mut rng = Rng::seed_from_u64(5);
                let mut layer = Layer::new(&mut rng);
                // Image 0: about 1 in 9 values nonzero, ones and fractions, the last channel
                // all zero; image 1: every value nonzero.
                let sparse: Vec<f32> = (0..LEN)
                    .map(|i| match (i * 7919 + 3) % 9 {
                        0 if i % Layer::INPUT_CHANNELS != Layer::INPUT_CHANNELS - 1 => {
                            if i % 2 == 0 {
                                1.0
                            } else {
                                rng.uniform(-2.0, 2.0) as f32
                            }
                        }
                        _ => 0.0,
                    })
                    .collect();
                let dense: Vec<f32> = (0..LEN).map(|_| rng.uniform(0.1, 1.0) as f32).collect();
                let d_out: Vec<f32> = (0..OUT).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
                let batch = |second: &[f32]| {
                    LayerInput::<2>::from_fn(|i| if i < LEN { sparse[i] } else { second[i - LEN] })
                };
                let d_output = LayerOutput::<2>::from_fn(|i| if i < OUT { d_out[i] } else { 0.0 });
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                let devices = [
                    Cpu::with_threads(1).expect("a CPU device"),
                    Cpu::with_threads(2)
                        .expect("a 2-thread CPU device")
                        .__split_everything(),
                ];
                for mut cpu in devices {
                    let mut results = Vec::new();
                    for second in [&dense, &sparse] {
                        let x = batch(second);
                        let mut y = LayerOutput::<2>::zeros();
                        layer.evaluate(&mut cpu, &x, &mut y).expect("evaluate");
                        let mut state = LayerState::new();
                        layer
                            .forward(&mut cpu, &x, &mut state, Mode::Train)
                            .expect("forward");
                        let mut d_input = LayerInput::<2>::zeros();
                        let mut grads = LayerGrads::zeros();
                        layer
                            .backward_full(
                                &mut cpu,
                                &state,
                                &x,
                                &d_output,
                                &mut d_input,
                                &mut grads,
                                Mode::Train,
                            )
                            .expect("backward_full");
                        results.push([
                            bits(&y.as_slice()[..OUT]),
                            bits(&state.output().as_slice()[..OUT]),
                            bits(&d_input.as_slice()[..LEN]),
                            bits(grads.weights.as_slice()),
                            bits(grads.biases.as_slice()),
                        ]);
                    }
                    let what = [
                        "evaluate",
                        "forward",
                        "input gradient",
                        "weight gradient",
                        "bias gradient",
                    ];
                    for (i, what) in what.iter().enumerate() {
                        let differ = results[0][i]
                            .iter()
                            .zip(&results[1][i])
                            .filter(|(a, b)| a != b)
                            .count();
                        assert_eq!(
                            differ,
                            0,
                            "{}: {what}: {differ} values differ",
                            stringify!($name)
                        );
                    }
                }

                // Which pass ran: an infinite weight on the channel image 0 leaves zero makes
                // the tile kernels' `0 * inf` a NaN in every output of its channel; the
                // scatter never reads it.
                if $probe {
                    let mut probed = layer.clone();
                    probed.weights.as_mut_slice()[Layer::INPUT_CHANNELS - 1] = f32::INFINITY;
                    let mut cpu = Cpu::default();
                    let nan = |second: &[f32], cpu: &mut Cpu| {
                        let mut y = LayerOutput::<2>::zeros();
                        probed
                            .evaluate(cpu, &batch(second), &mut y)
                            .expect("evaluate");
                        y.as_slice()[..OUT].iter().any(|v| v.is_nan())
                    };
                    assert!(
                        nan(&dense, &mut cpu),
                        "a batch with a dense image takes the tile kernels"
                    );
                    // The scatter runs with the AVX2 kernels only (elsewhere: the tiles).
                    let scatter = cfg!(target_arch = "x86_64") && conv_runtime::simd::avx2_fma();
                    assert_eq!(
                        !nan(&sparse, &mut cpu),
                        scatter,
                        "a batch of sparse images takes the scatter where AVX2 kernels run"
                    );
                }
            }
        }
    };
}

// MinAtar's DQN layer: 4 binary channels, 16 outputs (two AVX2 vectors), no padding; the ReLU
// hides the probe.
scatter_case!(screen, {
    input: [10, 10, 4], out_channels: 16, kernel: 3, activation: Relu,
}, false);
// The same without an activation.
scatter_case!(plain, { input: [10, 10, 4], out_channels: 16, kernel: 3, }, true);
// Padded, strided and not square; 12 outputs (a vector and a half); LayerNorm (per image) and
// Tanh.
scatter_case!(ragged, {
    input: [9, 11, 3], out_channels: 12, kernel: [3, 2], stride: [2, 1], padding: 1,
    activation: Tanh, norm: LayerNorm { eps: 1e-3 },
}, true);
