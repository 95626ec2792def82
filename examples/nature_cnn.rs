//! The Nature DQN network (Mnih et al. 2015) on 84x84x4 Atari frames: three generated conv
//! layers and a linear policy head, evaluating a batch of frames and reporting per-call latency,
//! the shape reinforcement-learning agents run at every environment step.
//!
//! `cargo run --release --example nature_cnn`

use std::time::Instant;

use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    /// 84x84x4 frames -> 20x20x32.
    pub struct Conv1 { input: [84, 84, 4], out_channels: 32, kernel: 8, stride: 4, activation: Relu }
}
conv_runtime::conv2d! {
    /// 20x20x32 -> 9x9x64.
    pub struct Conv2 { input: [20, 20, 32], out_channels: 64, kernel: 4, stride: 2, activation: Relu }
}
conv_runtime::conv2d! {
    /// 9x9x64 -> 7x7x64.
    pub struct Conv3 { input: [9, 9, 64], out_channels: 64, kernel: 3, stride: 1, activation: Relu }
}

const ACTIONS: usize = 6;
const FEATURES: usize = 7 * 7 * 64;

/// Conv layers, their activations for a batch of `B` frames, and a linear policy head.
struct Policy<const B: usize> {
    conv1: Conv1,
    conv2: Conv2,
    conv3: Conv3,
    head: Vec<f32>,
    h1: Tensor<f32, B, 20, 20, 32>,
    h2: Tensor<f32, B, 9, 9, 64>,
    h3: Tensor<f32, B, 7, 7, 64>,
}

impl<const B: usize> Policy<B> {
    fn new(rng: &mut Rng) -> Self {
        let bound = 1.0 / (FEATURES as f64).sqrt();
        Self {
            conv1: Conv1::new(rng),
            conv2: Conv2::new(rng),
            conv3: Conv3::new(rng),
            head: (0..FEATURES * ACTIONS)
                .map(|_| rng.uniform(-bound, bound) as f32)
                .collect(),
            h1: Tensor::zeros(),
            h2: Tensor::zeros(),
            h3: Tensor::zeros(),
        }
    }

    /// Greedy action per frame.
    fn act(
        &mut self,
        cpu: &mut Cpu,
        frames: &Tensor<f32, B, 84, 84, 4>,
    ) -> conv_runtime::Result<[usize; B]> {
        self.conv1.evaluate(cpu, frames, &mut self.h1)?;
        self.conv2.evaluate(cpu, &self.h1, &mut self.h2)?;
        self.conv3.evaluate(cpu, &self.h2, &mut self.h3)?;
        let mut actions = [0; B];
        for (b, features) in self.h3.as_slice().chunks_exact(FEATURES).enumerate() {
            let logits: Vec<f32> = self
                .head
                .chunks_exact(FEATURES)
                .map(|w| w.iter().zip(features).map(|(w, x)| w * x).sum())
                .collect();
            actions[b] = (0..ACTIONS)
                .max_by(|&i, &j| logits[i].total_cmp(&logits[j]))
                .unwrap_or(0);
        }
        Ok(actions)
    }
}

fn latency<const B: usize>(cpu: &mut Cpu, rng: &mut Rng) -> conv_runtime::Result<()> {
    let mut policy = Policy::<B>::new(rng);
    let frames = Tensor::<f32, B, 84, 84, 4>::from_fn(|_| rng.uniform(0.0, 1.0) as f32);
    for _ in 0..5 {
        policy.act(cpu, &frames)?;
    }
    let calls = 200;
    let start = Instant::now();
    let mut last = [0; B];
    for _ in 0..calls {
        last = policy.act(cpu, &frames)?;
    }
    let per_call = start.elapsed().as_secs_f64() / calls as f64;
    println!(
        "batch {B:>3}: {:>8.1} us per call, {:>8.0} frames/s   (actions of the first frames: {:?})",
        per_call * 1e6,
        B as f64 / per_call,
        &last[..B.min(4)]
    );
    Ok(())
}

fn main() -> conv_runtime::Result<()> {
    let mut cpu = Cpu::default();
    let mut rng = Rng::seed_from_u64(7);
    println!("Nature DQN policy, 84x84x4 frames, single thread, generated CPU code");
    latency::<1>(&mut cpu, &mut rng)?;
    latency::<8>(&mut cpu, &mut rng)?;
    latency::<32>(&mut cpu, &mut rng)?;
    Ok(())
}
