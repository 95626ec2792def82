//! Whole networks from `network!`, the torsos pixel RL runs: the latency of one action (`evaluate`
//! at batch 1), `evaluate` at batch 32 (a target network's pass) and the training step at batch 32
//! (`forward` + `backward` + one Adam step over the whole network), at each thread count, and the
//! step's three parts (`step_forward`, `step_backward`, `step_adam`) timed inside consecutive
//! steps. Also MinAtar's dense layer alone at densities of nonzero output gradients from 100% to
//! 10% (`fc1024`): what its gradients save by skipping zero terms. IMPALA's second max-pooling
//! alone (`maxpool32`): evaluate, forward with the winners kept, backward. And the device's thread
//! team alone (`pool`, batch column 0): one call of a 20-us part per thread, back to back and after
//! the workers have gone to sleep.
//!
//! ```sh
//! cargo run --release --example bench_networks -- --threads 1,2
//! ```
//!
//! Prints a table (median of 5 repetitions of about 0.3 s each, and the repetitions' spread)
//! and one `BENCH_JSON` line per row. `scripts/bench_pytorch.py --networks` times PyTorch's same
//! `nn.Sequential` networks and prints the same lines with `"backend": "pytorch"`.
//!
//! Built with `--features onednn` (and `ONEDNN_LIB_DIR` set), each network also runs on the
//! `OneDnn` device right after the `Cpu` one (backend `onednn`: its convolutions, inner products
//! and average pooling in oneDNN, the rest generated code; Adam on a `Cpu` of the same thread
//! count), and a table of oneDNN's time over ours follows; `--no-onednn` leaves it out.
//!
//! `--flush-denormals` runs everything with denormal numbers flushed to zero
//! (`conv_runtime::denormals`, as `torch.set_flush_denormal(True)`): on Intel cores it shows what
//! the optimizer's denormal running means cost the default, exact mode.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use conv_runtime::prelude::*;

conv_runtime::network! {
    /// The Nature DQN (Mnih et al. 2015): 84x84x4 frames, 6 actions.
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

conv_runtime::network! {
    /// The IMPALA CNN (Espeholt et al. 2018): 64x64x3 frames, three stacks of conv 3x3, max-pool
    /// 3/2 and two residual blocks (16, 32, 32 channels), dense 256, 15 actions (Procgen's).
    pub struct Impala {
        input: [64, 64, 3],
        batch: 32,
        layers: [
            conv1: Conv2d { out_channels: 16, kernel: 3, padding: 1 },
            pool1: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
            res1a: Residual { layers: [
                a1: Activation(Relu),
                c1: Conv2d { out_channels: 16, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 16, kernel: 3, padding: 1 },
            ] },
            res1b: Residual { layers: [
                a1: Activation(Relu),
                c1: Conv2d { out_channels: 16, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 16, kernel: 3, padding: 1 },
            ] },
            conv2: Conv2d { out_channels: 32, kernel: 3, padding: 1 },
            pool2: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
            res2a: Residual { layers: [
                a1: Activation(Relu),
                c1: Conv2d { out_channels: 32, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 32, kernel: 3, padding: 1 },
            ] },
            res2b: Residual { layers: [
                a1: Activation(Relu),
                c1: Conv2d { out_channels: 32, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 32, kernel: 3, padding: 1 },
            ] },
            conv3: Conv2d { out_channels: 32, kernel: 3, padding: 1 },
            pool3: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
            res3a: Residual { layers: [
                a1: Activation(Relu),
                c1: Conv2d { out_channels: 32, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 32, kernel: 3, padding: 1 },
            ] },
            res3b: Residual { layers: [
                a1: Activation(Relu),
                c1: Conv2d { out_channels: 32, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 32, kernel: 3, padding: 1 },
            ] },
            relu: Activation(Relu),
            flat: Flatten,
            fc: Dense { out_features: 256, activation: Relu },
            logits: Dense { out_features: 15 },
        ],
    }
}

conv_runtime::network! {
    /// MinAtar's DQN network (Young and Tian 2019): a 10x10x4 state, 3 actions.
    pub struct MinAtarDqn {
        input: [10, 10, 4],
        batch: 32,
        layers: [
            conv: Conv2d { out_channels: 16, kernel: 3, activation: Relu },
            flat: Flatten,
            fc: Dense { out_features: 128, activation: Relu },
            q: Dense { out_features: 3 },
        ],
    }
}

conv_runtime::network! {
    /// A dense layer the size of MinAtar's (1024 -> 128, ReLU), for the gradients' skipped
    /// zero terms.
    pub struct Fc1024 {
        input: [1, 1, 1024],
        batch: 32,
        layers: [flat: Flatten, fc: Dense { out_features: 128, activation: Relu }],
    }
}

conv_runtime::network! {
    /// IMPALA's second max-pooling alone (32x32x32 -> 16x16x32, 3/2, padding 1).
    pub struct MaxPool32 {
        input: [32, 32, 32],
        batch: 32,
        layers: [pool: MaxPool2d { kernel: 3, stride: 2, padding: 1 }],
    }
}

/// Of every 100 values, `percent` nonzero (spread by a multiplicative hash).
fn with_density(len: usize, percent: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
            if (h % 100) < percent as u64 {
                ((i % 13) as f32 - 6.0) * 0.1
            } else {
                0.0
            }
        })
        .collect()
}

/// The dense layer's `backward_full` at batch 32 at each density of nonzero values of the
/// output gradient (and of the input, as after a ReLU).
fn bench_sparse(threads: usize) -> conv_runtime::Result<Vec<Row>> {
    let mut cpu = Cpu::with_threads(threads)?;
    let net = Fc1024::new(&mut Rng::seed_from_u64(1));
    let mut rows = Vec::new();
    for (percent, op) in [
        (100, "backward_nz100"),
        (30, "backward_nz30"),
        (20, "backward_nz20"),
        (10, "backward_nz10"),
    ] {
        let x = Fc1024Input::<32>::from_vec(with_density(Fc1024Input::<32>::LEN, percent))?;
        let dy = Fc1024Output::<32>::from_vec(with_density(Fc1024Output::<32>::LEN, percent))?;
        let mut state = Fc1024State::new();
        net.clone().forward(&mut cpu, &x, &mut state, Mode::Train)?;
        let (mut grads, mut dx) = (Fc1024Grads::zeros(), Fc1024Input::<32>::zeros());
        let (us, spread) = time(|| {
            net.backward_full(&mut cpu, &state, &x, &dy, &mut dx, &mut grads, Mode::Train)
        })?;
        rows.push(Row {
            network: "fc1024",
            op,
            batch: 32,
            backend: "cpu",
            threads,
            us,
            spread,
        });
    }
    Ok(rows)
}

/// Max-pooling alone at batch 32: `evaluate` (no winners kept), `forward` (the winners kept
/// for the backward pass) and `backward` (each input gathers the gradients of the outputs it
/// won).
fn bench_maxpool(threads: usize) -> conv_runtime::Result<Vec<Row>> {
    let mut cpu = Cpu::with_threads(threads)?;
    let mut net = MaxPool32::new(&mut Rng::seed_from_u64(1));
    let x = MaxPool32Input::<32>::from_fn(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0);
    let dy = MaxPool32Output::<32>::from_fn(|i| ((i % 7) as f32 - 3.0) * 1e-3);
    let (mut y, mut state) = (MaxPool32Output::<32>::zeros(), MaxPool32State::new());
    let (mut grads, mut dx) = (MaxPool32Grads::zeros(), MaxPool32Input::<32>::zeros());
    let evaluate = time(|| net.evaluate(&mut cpu, black_box(&x), &mut y))?;
    let forward = time(|| net.forward(&mut cpu, black_box(&x), &mut state, Mode::Train))?;
    let backward =
        time(|| net.backward_full(&mut cpu, &state, &x, &dy, &mut dx, &mut grads, Mode::Train))?;
    let row = |op: &'static str, (us, spread): (f64, f64)| Row {
        network: "maxpool32",
        op,
        batch: 32,
        backend: "cpu",
        threads,
        us,
        spread,
    };
    Ok(vec![
        row("evaluate", evaluate),
        row("forward", forward),
        row("backward", backward),
    ])
}

/// The device's thread team alone: a call of one 20-us part per thread (spinning, no memory),
/// back to back (`busy`) and after 1 ms without calls (`after_idle`: the workers have
/// gone to sleep, and waking one costs a virtual machine far more than the part).
fn bench_pool(threads: usize) -> conv_runtime::Result<Vec<Row>> {
    let cpu = Cpu::with_threads(threads)?;
    let pool = cpu.__pool();
    let part = std::time::Duration::from_micros(20);
    let call = || {
        pool.each(threads, threads * conv_runtime::MIN_PART_WORK, &|_| {
            let start = Instant::now();
            while start.elapsed() < part {
                std::hint::spin_loop();
            }
        })
    };
    let mut rows = Vec::new();
    for (op, idle) in [
        ("busy", None),
        ("after_idle", Some(std::time::Duration::from_millis(1))),
    ] {
        let samples: Vec<f64> = (0..1000)
            .map(|_| {
                if let Some(idle) = idle {
                    std::thread::sleep(idle);
                }
                let start = Instant::now();
                call();
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        let (us, spread) = groups(&samples);
        rows.push(Row {
            network: "pool",
            op,
            batch: 0,
            backend: "cpu",
            threads,
            us,
            spread,
        });
    }
    Ok(rows)
}

/// Median and spread ((max - min) / median) of 5 repetitions of about 0.3 s each, in
/// microseconds per call, after a warm-up.
fn time(mut f: impl FnMut() -> conv_runtime::Result<()>) -> conv_runtime::Result<(f64, f64)> {
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed().as_secs_f64() < 0.1 || calls < 3 {
        f()?;
        calls += 1;
    }
    let per_call = start.elapsed().as_secs_f64() / f64::from(calls);
    let n = ((0.3 / per_call) as u32).max(3);
    let mut reps = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..n {
            f()?;
        }
        reps.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
    }
    reps.sort_by(f64::total_cmp);
    let median = reps[2];
    Ok((median, (reps[4] - reps[0]) / median))
}

/// Times one network at one thread count on one device (`cpu` or `onednn`; Adam steps on
/// `stepper`, a `Cpu`): a row per operation.
macro_rules! bench_network {
    ($net:ident, $grads:ident, $state:ident, $input:ident, $output:ident, $name:expr, $threads:expr,
     $backend:literal, $cpu:ident = $device:expr, stepper: $stepper:expr) => {{
        let threads: usize = $threads;
        let mut $cpu = $device;
        let mut rng = Rng::seed_from_u64(1);
        let mut net = $net::new(&mut rng);
        let x1 = $input::<1>::from_fn(|i| ((i * 7919) % 256) as f32 / 255.0);
        let mut y1 = $output::<1>::zeros();
        let act = time(|| net.evaluate(&mut $cpu, black_box(&x1), &mut y1))?;
        let x = $input::<32>::from_fn(|i| ((i * 7919) % 256) as f32 / 255.0);
        let mut y32 = $output::<32>::zeros();
        let evaluate = time(|| net.evaluate(&mut $cpu, black_box(&x), &mut y32))?;
        let d_output = $output::<32>::from_vec(
            (0..$output::<32>::LEN)
                .map(|i| ((i % 7) as f32 - 3.0) * 1e-3)
                .collect(),
        )?;
        let (mut grads, mut state) = ($grads::zeros(), $state::new());
        let mut adam = Adam::new(1e-4);
        // One step, with the instants its parts end at.
        let mut step_marked = || -> conv_runtime::Result<[Instant; 3]> {
            net.forward(&mut $cpu, black_box(&x), &mut state, Mode::Train)?;
            let forward = Instant::now();
            grads.zero();
            net.backward(&mut $cpu, &state, &x, &d_output, &mut grads, Mode::Train)?;
            let backward = Instant::now();
            adam.step_on($stepper, &mut net, &grads);
            Ok([forward, backward, Instant::now()])
        };
        let step = time(|| step_marked().map(|_| ()))?;
        // The step's parts, timed inside consecutive steps: what one part leaves in the other
        // cores' caches costs the next.
        let steps = ((1.5e6 / step.0) as usize).max(15);
        let mut parts = [vec![0.0; steps], vec![0.0; steps], vec![0.0; steps]];
        for i in 0..steps {
            let start = Instant::now();
            let [t1, t2, t3] = step_marked()?;
            for (part, (a, b)) in parts.iter_mut().zip([(start, t1), (t1, t2), (t2, t3)]) {
                part[i] = (b - a).as_secs_f64() * 1e6;
            }
        }
        let [forward, backward, optimizer] = parts.map(|p| groups(&p));
        let row = |op: &'static str, batch: usize, (us, spread): (f64, f64)| Row {
            network: $name,
            op,
            batch,
            backend: $backend,
            threads,
            us,
            spread,
        };
        [
            row("act", 1, act),
            row("evaluate", 32, evaluate),
            row("train_step", 32, step),
            row("step_forward", 32, forward),
            row("step_backward", 32, backward),
            row("step_adam", 32, optimizer),
        ]
    }};
}

/// Median and spread ((max - min) / median) of the means of 5 consecutive groups of `samples`,
/// as [`time`] reports its repetitions.
fn groups(samples: &[f64]) -> (f64, f64) {
    let n = samples.len() / 5;
    let mut means: Vec<f64> = samples
        .chunks_exact(n)
        .take(5)
        .map(|g| g.iter().sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    (means[2], (means[4] - means[0]) / means[2])
}

struct Row {
    network: &'static str,
    op: &'static str,
    batch: usize,
    backend: &'static str,
    threads: usize,
    us: f64,
    spread: f64,
}

fn run(threads: &[usize], filter: Option<&str>, onednn: bool) -> conv_runtime::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let wanted = |name: &str| filter.is_none_or(|f| name.contains(f));
    // Each network on the CPU device, then at once on oneDNN, so that both see the same machine.
    macro_rules! network {
        ($net:ident, $grads:ident, $state:ident, $input:ident, $output:ident, $name:literal, $t:expr) => {
            if wanted($name) {
                rows.extend(bench_network!(
                    $net, $grads, $state, $input, $output, $name, $t,
                    "cpu", cpu = Cpu::with_threads($t)?, stepper: &cpu
                ));
                #[cfg(feature = "onednn")]
                if onednn {
                    let stepper = Cpu::with_threads($t)?;
                    rows.extend(bench_network!(
                        $net, $grads, $state, $input, $output, $name, $t,
                        "onednn", device = OneDnn::with_threads($t)?, stepper: &stepper
                    ));
                }
            }
        };
    }
    let _ = onednn;
    for &t in threads {
        network!(
            NatureDqn,
            NatureDqnGrads,
            NatureDqnState,
            NatureDqnInput,
            NatureDqnOutput,
            "nature_dqn",
            t
        );
        network!(
            Impala,
            ImpalaGrads,
            ImpalaState,
            ImpalaInput,
            ImpalaOutput,
            "impala",
            t
        );
        if wanted("maxpool") {
            rows.extend(bench_maxpool(t)?);
        }
        if wanted("pool") {
            rows.extend(bench_pool(t)?);
        }
        if wanted("fc1024") {
            rows.extend(bench_sparse(t)?);
        }
        network!(
            MinAtarDqn,
            MinAtarDqnGrads,
            MinAtarDqnState,
            MinAtarDqnInput,
            MinAtarDqnOutput,
            "minatar_dqn",
            t
        );
    }
    Ok(rows)
}

fn parse_threads(text: &str) -> Result<Vec<usize>, String> {
    text.split(',')
        .map(|t| match t.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "--threads takes positive counts like 1,2, not `{text}`"
            )),
        })
        .collect()
}

fn main() -> ExitCode {
    let mut threads = vec![1];
    let mut filter = None;
    let mut onednn = cfg!(feature = "onednn");
    let mut flush = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--threads" => match args.next().as_deref().map(parse_threads) {
                Some(Ok(t)) => threads = t,
                Some(Err(e)) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
                None => {
                    eprintln!("--threads needs a value, e.g. --threads 1,2");
                    return ExitCode::FAILURE;
                }
            },
            "--no-onednn" => onednn = false,
            "--flush-denormals" => flush = true,
            "--help" | "-h" => {
                println!(
                    "usage: bench_networks [--threads 1,2] [--no-onednn] [--flush-denormals] \
                     [NAME_FILTER]"
                );
                return ExitCode::SUCCESS;
            }
            other => filter = Some(other.to_string()),
        }
    }
    // Held for the whole run: every device call flushes, on all of its threads.
    let _flush = match flush
        .then(conv_runtime::denormals::FlushToZero::on)
        .transpose()
    {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("bench_networks: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rows = match run(&threads, filter.as_deref(), onednn) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("bench_networks: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("network       op             batch backend threads      us/call  spread");
    for r in &rows {
        println!(
            "{:<13} {:<14} {:>5} {:<7} {:>7} {:>12.1} {:>6.1}%",
            r.network,
            r.op,
            r.batch,
            r.backend,
            r.threads,
            r.us,
            r.spread * 100.0
        );
    }
    let ratios: Vec<(&Row, &Row)> = rows
        .iter()
        .filter(|r| r.backend == "onednn")
        .filter_map(|d| {
            rows.iter()
                .find(|c| {
                    c.backend == "cpu"
                        && (c.network, c.op, c.batch, c.threads)
                            == (d.network, d.op, d.batch, d.threads)
                })
                .map(|c| (c, d))
        })
        .collect();
    if !ratios.is_empty() {
        println!("\nours vs oneDNN (oneDNN time / ours: above 1, ours is faster)");
        println!("network       op             batch threads    onednn us      cpu us   ratio");
        for (c, d) in &ratios {
            println!(
                "{:<13} {:<14} {:>5} {:>7} {:>12.1} {:>12.1} {:>6.2}x",
                c.network,
                c.op,
                c.batch,
                c.threads,
                d.us,
                c.us,
                d.us / c.us
            );
        }
    }
    for r in &rows {
        println!(
            "BENCH_JSON {{\"network\":\"{}\",\"op\":\"{}\",\"batch\":{},\"backend\":\"{}\",\"threads\":{},\"us\":{:.2},\"spread\":{:.4},\"flush_denormals\":{}}}",
            r.network, r.op, r.batch, r.backend, r.threads, r.us, r.spread, flush
        );
    }
    ExitCode::SUCCESS
}
