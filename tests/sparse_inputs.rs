//! A dense layer whose inputs are mostly zero (after a ReLU) runs its forward pass over the
//! nonzero inputs only, on a transposed copy of its weights, from the third pass with the same
//! weights on (on AVX-512: `conv_runtime::wide::sparse`; elsewhere every pass takes the dot
//! products). Each pass must give the first pass's bits: on one thread and on two that split
//! every call, after the weights change, and for `forward` as for `evaluate`.

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
    let mut devices = [
        Cpu::with_threads(1).expect("a CPU device"),
        Cpu::with_threads(2)
            .expect("a 2-thread CPU device")
            .__split_everything(),
    ];
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
