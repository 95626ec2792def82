//! `denormals::FlushToZero`: a `Cpu` call made under it flushes on every thread of the device,
//! and one made after it flushes nowhere. The inputs are denormal, so every sum of a call is one
//! of denormal products: zero where the mode flushes, nonzero where it does not. The devices
//! split every call, so the workers compute parts of each.
#![cfg(target_arch = "x86_64")]

use conv_runtime::denormals::FlushToZero;
use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    pub struct Layer {
        input: [32, 32, 16], out_channels: 32, kernel: 3, padding: 1, activation: Relu, batch: 8,
    }
}

/// `evaluate`, the forward pass and the weight gradient, on `cpu`.
fn run(cpu: &mut Cpu) -> Vec<Vec<f32>> {
    let mut layer = Layer::new(&mut Rng::seed_from_u64(3));
    // Positive weights and no bias: the sums of positive denormals stay nonzero unflushed.
    layer.visit_params_mut(&mut |name, tensor| {
        for v in tensor.values_mut() {
            *v = if name.contains("bias") { 0.0 } else { v.abs() };
        }
    });
    let x = LayerInput::<8>::from_fn(|i| f32::from_bits(1 + (i as u32 * 7919) % 100_000));
    let mut y = LayerOutput::<8>::zeros();
    layer.evaluate(cpu, &x, &mut y).expect("evaluate");
    let mut state = LayerState::new();
    layer
        .forward(cpu, &x, &mut state, Mode::Train)
        .expect("forward");
    let d_output = LayerOutput::<8>::from_fn(|i| (i % 5) as f32 + 1.0);
    let mut grads = LayerGrads::zeros();
    layer
        .backward(cpu, &state, &x, &d_output, &mut grads, Mode::Train)
        .expect("backward");
    let mut dw = Vec::new();
    layer.visit_mut(&grads, &mut |_, _, g| dw.extend_from_slice(g));
    vec![
        y.as_slice().to_vec(),
        state.output().as_slice().to_vec(),
        dw,
    ]
}

fn bits(results: &[Vec<f32>]) -> Vec<Vec<u32>> {
    results
        .iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn a_call_under_the_guard_flushes_on_every_thread() {
    let mut many = Cpu::with_threads(2).expect("threads").__split_everything();
    let kept = run(&mut Cpu::default());
    for (i, r) in kept.iter().enumerate() {
        assert!(
            r.iter().all(|v| v.is_finite()) && r.iter().any(|&v| v != 0.0),
            "result {i}: denormal sums, kept"
        );
    }
    {
        let _flush = FlushToZero::on().expect("x86-64");
        let flushed = run(&mut Cpu::default());
        for (i, r) in flushed.iter().enumerate() {
            assert!(r.iter().all(|&v| v == 0.0), "result {i}: flushed to zero");
        }
        assert_eq!(
            bits(&run(&mut many)),
            bits(&flushed),
            "two threads, flushing"
        );
    }
    assert_eq!(
        bits(&run(&mut many)),
        bits(&kept),
        "two threads, after the guard"
    );
}
