//! The Nature DQN network (Mnih et al. 2015) on 84x84x4 Atari frames, one `network!`: the
//! latency of choosing actions for a batch of frames, the call reinforcement-learning agents make
//! at every environment step.
//!
//! `cargo run --release --example nature_cnn [-- --threads N]`

use std::time::Instant;

use conv_runtime::prelude::*;

conv_runtime::network! {
    /// 84x84x4 frames -> one Q-value per action.
    pub struct NatureDqn {
        input: [84, 84, 4],
        batch: 32,
        layers: [
            conv1: Conv2d { out_channels: 32, kernel: 8, stride: 4, activation: Relu },
            conv2: Conv2d { out_channels: 64, kernel: 4, stride: 2, activation: Relu },
            conv3: Conv2d { out_channels: 64, kernel: 3, activation: Relu },
            flat: Flatten,
            fc: Dense { out_features: 512, activation: Relu },
            q: Dense { out_features: 6 },
        ],
    }
}

/// The greedy action of each row of Q-values.
fn greedy<const B: usize>(q: &NatureDqnOutput<B>) -> [usize; B] {
    let mut actions = [0; B];
    for (b, a) in actions.iter_mut().enumerate() {
        let row = q.row(b);
        *a = (0..row.len())
            .max_by(|&i, &j| row[i].total_cmp(&row[j]))
            .unwrap_or(0);
    }
    actions
}

fn latency<const B: usize>(
    net: &NatureDqn,
    cpu: &mut Cpu,
    rng: &mut Rng,
) -> conv_runtime::Result<()> {
    let frames = NatureDqnInput::<B>::from_fn(|_| rng.uniform(0.0, 1.0) as f32);
    let mut q = NatureDqnOutput::<B>::zeros();
    for _ in 0..5 {
        net.evaluate(cpu, &frames, &mut q)?;
    }
    let calls = 200;
    let start = Instant::now();
    for _ in 0..calls {
        net.evaluate(cpu, &frames, &mut q)?;
    }
    let per_call = start.elapsed().as_secs_f64() / calls as f64;
    let actions = greedy(&q);
    println!(
        "batch {B:>3}: {:>8.1} us per call, {:>8.0} frames/s   (actions of the first frames: {:?})",
        per_call * 1e6,
        B as f64 / per_call,
        &actions[..B.min(4)]
    );
    Ok(())
}

fn main() -> conv_runtime::Result<()> {
    let mut threads = 1;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next().map(|v| v.parse::<usize>())) {
            ("--threads", Some(Ok(n))) => threads = n,
            _ => {
                eprintln!("usage: nature_cnn [--threads N]");
                std::process::exit(2);
            }
        }
    }
    let mut cpu = Cpu::with_threads(threads)?;
    let mut rng = Rng::seed_from_u64(7);
    let net = NatureDqn::new(&mut rng);
    println!(
        "Nature DQN, 84x84x4 frames -> 6 actions ({} parameters), {threads} thread(s), generated CPU code",
        NatureDqn::PARAMETER_COUNT
    );
    latency::<1>(&net, &mut cpu, &mut rng)?;
    latency::<8>(&net, &mut cpu, &mut rng)?;
    latency::<32>(&net, &mut cpu, &mut rng)?;
    Ok(())
}
