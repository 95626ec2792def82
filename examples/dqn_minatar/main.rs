//! DQN on MinAtar Breakout, learning from pixels, with MinAtar's published settings.
//!
//! ```sh
//! cargo run --release --example dqn_minatar                      # the full 5M-frame protocol
//! cargo run --release --example dqn_minatar -- --frames 300000   # a shorter run
//! cargo run --release --example dqn_minatar -- --quick           # CI: must beat random play
//! cargo run --release --example dqn_minatar -- --eval target/dqn_minatar.safetensors
//! ```
//!
//! The environment is `env.rs` beside this file: MinAtar's Breakout (the `minatar` package's
//! `Environment('breakout')`, sticky actions 0.1, all 6 actions), step for step identical to the
//! Python package (tests/minatar_replay.rs).
//!
//! The agent is MinAtar's DQN (Young and Tian, 2019; their `examples/dqn.py`):
//! - the network, one `network!`: conv 16 3x3 stride 1 ReLU on the 10x10x4 state, dense 128
//!   ReLU, one Q-value per action;
//! - a replay buffer of 100,000 transitions, minibatches of 32, one update per frame from
//!   frame 5,000 on (random actions before), a target network copied every 1,000 frames;
//! - epsilon-greedy acting, epsilon linear from 1.0 to 0.1 over the first 100,000 frames after
//!   learning starts, then 0.1; discount 0.99;
//! - the Huber loss (PyTorch's `smooth_l1_loss`, beta 1) of the taken action's Q-value against
//!   `r + 0.99 * (1 - terminal) * max_a Q_target(s', a)`;
//! - centered RMSprop: step size 0.00025, squared-gradient momentum (alpha) 0.95, eps 0.01.
//!
//! Acting is `evaluate` at batch 1; learning is `forward` + `backward` at batch 32 on the
//! device's threads (`--threads`), the target's `evaluate` at batch 32. Everything is seeded
//! (`--seed`): the environment (numpy's Mersenne Twister, as MinAtar), the exploration, the
//! replay sampling and the initialization; the CPU device computes the same bits on any number
//! of threads, so the same seed gives the same returns twice, on any thread count.
//!
//! Reports: a progress bar (frames, frames per second, epsilon, the mean return of the last 100
//! episodes; on a terminal), a line every 100,000 frames, a PNG of the return against frames
//! (`--plot`, default `target/dqn_minatar.png`), a safetensors checkpoint of the online network
//! (`--save`, default `target/dqn_minatar.safetensors`), and last a machine-readable line:
//! `DQN_RESULT {"frames":...,"frames_per_second":...,"mean_return":...,"random_return":...,
//! "passed":...}`. `mean_return` is the mean over the last 100 training episodes (an
//! epsilon-greedy agent's, as MinAtar reports them); `random_return` the random policy's mean
//! return over 1,000 episodes of the same environment.
//!
//! `--quick` is a short run for CI: 100,000 frames with exploration decayed over the first
//! 25,000 (the other settings unchanged); it passes when the mean return of the last 100
//! episodes beats the random policy's. The full run passes when it does, too.
//!
//! `--flush-denormals` flushes denormal numbers to zero (`conv_runtime::denormals`; PyTorch's
//! `torch.set_flush_denormal(True)`). RMSprop's running means of parameters whose gradient
//! stays zero settle on denormals, which cost microcode assists on Intel cores; the optimizer
//! now steps them exactly without assists, so the flag gains little here. It is no longer IEEE
//! arithmetic: the returns can differ from the default mode's wherever a flushed value changes
//! a decision.
//!
//! `--eval CHECKPOINT` plays `--episodes N` (default 100) episodes greedily (epsilon 0.01, so a
//! stuck agent cannot loop forever) with the saved network and prints their mean return.

// Shared with tests/minatar_replay.rs, which uses more of it than the agent does (env.rs
// allows the items the agent leaves unused).
mod env;

use std::error::Error as StdError;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use conv_runtime::loss::huber_on_actions;
use conv_runtime::prelude::*;
use conv_runtime::safetensors::{Reader, Writer};
use env::{Breakout, NUM_ACTIONS, STATE_LEN};

conv_runtime::network! {
    /// MinAtar's DQN network: the 10x10x4 state, one Q-value per action.
    pub struct QNet {
        input: [10, 10, 4],
        batch: 32,
        layers: [
            conv: Conv2d { out_channels: 16, kernel: 3, activation: Relu },
            flat: Flatten,
            fc: Dense { out_features: 128, activation: Relu },
            q: Dense { out_features: 6 },
        ],
    }
}

const BATCH: usize = 32;
const REPLAY: usize = 100_000;
const LEARN_FROM: usize = 5_000;
const TARGET_EVERY: usize = 1_000;
const EXPLORE_FRAMES: usize = 100_000;
const QUICK_EXPLORE_FRAMES: usize = 25_000;
const FIRST_EPSILON: f64 = 1.0;
const LAST_EPSILON: f64 = 0.1;
const GAMMA: f32 = 0.99;
const STEP_SIZE: f32 = 0.000_25;
const SQUARED_GRAD_MOMENTUM: f32 = 0.95;
const MIN_SQUARED_GRAD: f32 = 0.01;
const DEFAULT_FRAMES: usize = 5_000_000;
const QUICK_FRAMES: usize = 100_000;
/// Episodes the random policy's mean return is measured over.
const RANDOM_EPISODES: usize = 1_000;
/// Words of a bit-packed state (400 cells).
const WORDS: usize = STATE_LEN.div_ceil(64);

const _: () = assert!(NUM_ACTIONS == QNet::OUTPUT_FEATURES);

/// Options from the command line.
struct Config {
    frames: usize,
    explore: usize,
    seed: u64,
    threads: usize,
    quick: bool,
    plot: PathBuf,
    save: PathBuf,
    eval: Option<PathBuf>,
    episodes: usize,
    flush_denormals: bool,
}

fn usage() -> &'static str {
    "usage: dqn_minatar [--frames N] [--seed S] [--threads N] [--quick] [--plot PATH] [--save PATH]\n\
     \x20                  [--flush-denormals] [--eval CHECKPOINT [--episodes N]]"
}

fn parse_args() -> Result<Config, String> {
    let mut config = Config {
        frames: DEFAULT_FRAMES,
        explore: EXPLORE_FRAMES,
        seed: 1,
        threads: 1,
        quick: false,
        plot: PathBuf::from("target/dqn_minatar.png"),
        save: PathBuf::from("target/dqn_minatar.safetensors"),
        eval: None,
        episodes: 100,
        flush_denormals: false,
    };
    let mut frames = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let number = |text: String, name: &str| {
            text.replace('_', "")
                .parse::<usize>()
                .map_err(|_| format!("{name} takes a number, not {text:?}"))
        };
        match arg.as_str() {
            "--frames" => frames = Some(number(value("--frames")?, "--frames")?),
            "--seed" => config.seed = number(value("--seed")?, "--seed")? as u64,
            "--threads" => config.threads = number(value("--threads")?, "--threads")?,
            "--episodes" => config.episodes = number(value("--episodes")?, "--episodes")?,
            "--quick" => config.quick = true,
            "--flush-denormals" => config.flush_denormals = true,
            "--plot" => config.plot = PathBuf::from(value("--plot")?),
            "--save" => config.save = PathBuf::from(value("--save")?),
            "--eval" => config.eval = Some(PathBuf::from(value("--eval")?)),
            "--help" | "-h" => return Err(usage().to_string()),
            other => return Err(format!("unknown option {other:?}\n{}", usage())),
        }
    }
    if config.quick {
        config.frames = QUICK_FRAMES;
        config.explore = QUICK_EXPLORE_FRAMES;
    }
    if let Some(frames) = frames {
        config.frames = frames;
    }
    if config.frames <= LEARN_FROM {
        return Err(format!(
            "--frames must be more than {LEARN_FROM} (learning starts there)"
        ));
    }
    Ok(config)
}

/// One transition, states bit-packed (the state is boolean): two cache lines, read together.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Transition {
    state: [u64; WORDS],
    next: [u64; WORDS],
    action: usize,
    reward: f32,
    terminal: bool,
}

/// The replay buffer: a ring of `REPLAY` transitions.
struct Replay {
    transitions: Vec<Transition>,
    len: usize,
    at: usize,
}

fn pack(state: &[bool; STATE_LEN]) -> [u64; WORDS] {
    let mut words = [0u64; WORDS];
    for (i, &on) in state.iter().enumerate() {
        words[i / 64] |= u64::from(on) << (i % 64);
    }
    words
}

/// The state as 0.0 / 1.0, 32 bits at a time, each tested against its mask: vector compares a
/// few instructions per 4 values, where a shift and an integer conversion per bit took 4.5% of
/// a frame (64 states a frame).
fn unpack(words: &[u64; WORDS], out: &mut [f32]) {
    for (c, values) in out[..STATE_LEN].chunks_mut(32).enumerate() {
        let bits = (words[c / 2] >> (32 * (c % 2))) as u32;
        for (j, v) in values.iter_mut().enumerate() {
            *v = if bits & (1 << j) != 0 { 1.0 } else { 0.0 };
        }
    }
}

impl Replay {
    fn new() -> Self {
        let empty = Transition {
            state: [0; WORDS],
            next: [0; WORDS],
            action: 0,
            reward: 0.0,
            terminal: false,
        };
        Self {
            transitions: vec![empty; REPLAY],
            len: 0,
            at: 0,
        }
    }

    fn push(&mut self, t: Transition) {
        self.transitions[self.at] = t;
        self.at = (self.at + 1) % REPLAY;
        self.len = (self.len + 1).min(REPLAY);
    }
}

/// The agent's own random numbers (exploration and replay sampling): splitmix64.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// The greedy action for `state` (at batch 1).
fn act(
    net: &QNet,
    cpu: &mut Cpu,
    env: &Breakout,
    input: &mut QNetInput<1>,
    q: &mut QNetOutput<1>,
) -> conv_runtime::Result<usize> {
    env.write_state(input.as_mut_slice());
    net.evaluate(cpu, input, q)?;
    Ok(argmax(q.as_slice()))
}

/// The random policy's mean return over `episodes` episodes of the environment seeded `seed`.
fn random_return(seed: u64, episodes: usize) -> f64 {
    let mut env = Breakout::new(seed as u32 ^ 0x5eed);
    let mut rng = Random(seed ^ 0xabad_1dea);
    let mut total = 0.0;
    for _ in 0..episodes {
        env.reset();
        loop {
            let (reward, done) = env.act(rng.below(NUM_ACTIONS));
            total += f64::from(reward);
            if done {
                break;
            }
        }
    }
    total / episodes as f64
}

/// What a training run measured.
struct Run {
    /// `(frame, return)` of every finished episode.
    episodes: Vec<(usize, f32)>,
    frames_per_second: f64,
    net: QNet,
}

fn mean_last(episodes: &[(usize, f32)], n: usize) -> f64 {
    let last = &episodes[episodes.len().saturating_sub(n)..];
    if last.is_empty() {
        return 0.0;
    }
    last.iter().map(|&(_, r)| f64::from(r)).sum::<f64>() / last.len() as f64
}

fn train(config: &Config) -> Result<Run, Box<dyn StdError>> {
    let mut cpu = Cpu::with_threads(config.threads)?;
    let mut init = Rng::seed_from_u64(config.seed);
    let mut net = QNet::new(&mut init);
    let mut target = net.clone();
    let mut grads = QNetGrads::zeros();
    let mut state = QNetState::new();
    let mut optimizer = RmsProp::new(STEP_SIZE)
        .with_alpha(SQUARED_GRAD_MOMENTUM)
        .with_eps(MIN_SQUARED_GRAD)
        .with_centered(true);
    let mut env = Breakout::new(config.seed as u32);
    let mut rng = Random(config.seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut replay = Replay::new();
    let (mut input1, mut q1) = (QNetInput::<1>::zeros(), QNetOutput::<1>::zeros());
    let (mut batch, mut next) = (QNetInput::<BATCH>::zeros(), QNetInput::<BATCH>::zeros());
    let mut q_next = QNetOutput::<BATCH>::zeros();
    let mut d_q = QNetOutput::<BATCH>::zeros();
    let (mut actions, mut targets) = ([0usize; BATCH], [0f32; BATCH]);

    let bar = progress_bar(config.frames as u64);
    let mut episodes: Vec<(usize, f32)> = Vec::new();
    let mut episode_return = 0.0f32;
    let mut s = pack(&env.state());
    let start = Instant::now();
    for frame in 1..=config.frames {
        let epsilon = if frame <= LEARN_FROM {
            1.0
        } else {
            let progress = ((frame - LEARN_FROM) as f64 / config.explore as f64).min(1.0);
            FIRST_EPSILON + (LAST_EPSILON - FIRST_EPSILON) * progress
        };
        let action = if rng.uniform() < epsilon {
            rng.below(NUM_ACTIONS)
        } else {
            act(&net, &mut cpu, &env, &mut input1, &mut q1)?
        };
        let (reward, done) = env.act(action);
        let s2 = pack(&env.state());
        replay.push(Transition {
            state: s,
            next: s2,
            action,
            reward,
            terminal: done,
        });
        episode_return += reward;
        if done {
            episodes.push((frame, episode_return));
            episode_return = 0.0;
            env.reset();
            s = pack(&env.state());
        } else {
            s = s2;
        }

        if frame > LEARN_FROM {
            // One update: a minibatch of transitions, the Huber loss on the taken actions.
            let mut picks = [0usize; BATCH];
            for p in &mut picks {
                *p = rng.below(replay.len);
            }
            // The minibatch copied out of the 13 MB buffer first: the copies' loads are
            // independent, so their cache misses overlap, where unpacking each transition as
            // it was read waited for them one at a time (3% of a frame).
            let picked = picks.map(|i| replay.transitions[i]);
            let (xs, ns) = (batch.as_mut_slice(), next.as_mut_slice());
            for (b, t) in picked.iter().enumerate() {
                unpack(&t.state, &mut xs[b * STATE_LEN..(b + 1) * STATE_LEN]);
                unpack(&t.next, &mut ns[b * STATE_LEN..(b + 1) * STATE_LEN]);
                actions[b] = t.action;
            }
            target.evaluate(&mut cpu, &next, &mut q_next)?;
            for (b, t) in picked.iter().enumerate() {
                let best = q_next
                    .row(b)
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let future = if t.terminal { 0.0 } else { GAMMA * best };
                targets[b] = t.reward + future;
            }
            net.forward(&mut cpu, &batch, &mut state, Mode::Train)?;
            huber_on_actions(state.output(), &actions, &targets, &mut d_q)?;
            net.backward(&mut cpu, &state, &batch, &d_q, &mut grads, Mode::Train)?;
            optimizer.step_on(&cpu, &mut net, &grads);
            grads.zero();
        }
        if frame % TARGET_EVERY == 0 {
            target.copy_from(&net);
        }
        if frame % 1000 == 0 {
            if let Some(bar) = &bar {
                let fps = frame as f64 / start.elapsed().as_secs_f64();
                bar.set_position(frame as u64);
                bar.set_message(format!(
                    "{fps:.0} frames/s, epsilon {epsilon:.3}, mean return (last 100) {:.2}",
                    mean_last(&episodes, 100)
                ));
            }
        }
        if frame % 100_000 == 0 {
            let fps = frame as f64 / start.elapsed().as_secs_f64();
            let line = format!(
                "frame {frame}: {fps:.0} frames/s, epsilon {epsilon:.3}, episodes {}, mean return (last 100) {:.2}",
                episodes.len(),
                mean_last(&episodes, 100)
            );
            match &bar {
                Some(bar) => bar.println(line),
                None => println!("{line}"),
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(Run {
        episodes,
        frames_per_second: config.frames as f64 / start.elapsed().as_secs_f64(),
        net,
    })
}

fn progress_bar(frames: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(frames);
    let style = indicatif::ProgressStyle::with_template(
        "{bar:30} {pos}/{len} frames {elapsed_precise} {msg}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    Some(bar)
}

/// Plays `episodes` episodes with the network at epsilon 0.01; the mean return.
fn evaluate_policy(
    net: &QNet,
    seed: u64,
    episodes: usize,
    threads: usize,
) -> Result<f64, Box<dyn StdError>> {
    let mut cpu = Cpu::with_threads(threads)?;
    let mut env = Breakout::new(seed as u32 ^ 0xe7a1);
    let mut rng = Random(seed ^ 0x0e7a_1000);
    let (mut input, mut q) = (QNetInput::<1>::zeros(), QNetOutput::<1>::zeros());
    let mut total = 0.0;
    for _ in 0..episodes {
        env.reset();
        loop {
            let action = if rng.uniform() < 0.01 {
                rng.below(NUM_ACTIONS)
            } else {
                act(net, &mut cpu, &env, &mut input, &mut q)?
            };
            let (reward, done) = env.act(action);
            total += f64::from(reward);
            if done {
                break;
            }
        }
    }
    Ok(total / episodes.max(1) as f64)
}

/// The return of every episode against the frame it ended at, with the running mean of the
/// last 100, as a PNG.
fn plot(path: &Path, episodes: &[(usize, f32)], random: f64) -> Result<(), Box<dyn StdError>> {
    use plotters::prelude::*;
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the embedded font is not a valid TrueType font")?;
    let frames = episodes.last().map_or(1, |&(f, _)| f) as f64;
    let top = episodes
        .iter()
        .map(|&(_, r)| f64::from(r))
        .fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("DQN on MinAtar Breakout", ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..frames, 0.0..top * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("frames")
        .y_desc("episode return")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_label_formatter(&|x| {
            if frames >= 2e6 {
                format!("{:.1}M", x / 1e6)
            } else {
                format!("{:.0}k", x / 1e3)
            }
        })
        .draw()?;
    chart.draw_series(
        episodes
            .iter()
            .map(|&(f, r)| Circle::new((f as f64, f64::from(r)), 1, BLUE.mix(0.15).filled())),
    )?;
    let mean: Vec<(f64, f64)> = (0..episodes.len())
        .map(|i| (episodes[i].0 as f64, mean_last(&episodes[..=i], 100)))
        .collect();
    chart
        .draw_series(LineSeries::new(mean, RED.stroke_width(2)))?
        .label("mean of the last 100 episodes")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            [(0.0, random), (frames, random)],
            BLACK.stroke_width(1),
        ))?
        .label("random policy")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Go Regular (BSD-3-Clause, examples/data/fonts/LICENSE), as train_digits uses it.
const FONT: &[u8] = include_bytes!("../data/fonts/Go-Regular.ttf");

fn run() -> Result<bool, Box<dyn StdError>> {
    let config = parse_args()?;
    // Held for the whole run: every device call below flushes, on all of its threads.
    let _flush = if config.flush_denormals {
        Some(conv_runtime::denormals::FlushToZero::on()?)
    } else {
        None
    };
    if let Some(checkpoint) = &config.eval {
        let mut net = QNet::new(&mut Rng::seed_from_u64(0));
        Reader::open(checkpoint)?.load("", &mut net)?;
        let mean = evaluate_policy(&net, config.seed, config.episodes, config.threads)?;
        println!(
            "{} episodes with {}: mean return {mean:.2} (epsilon 0.01)",
            config.episodes,
            checkpoint.display()
        );
        return Ok(true);
    }
    let random = random_return(config.seed, RANDOM_EPISODES);
    println!(
        "DQN on MinAtar Breakout: {} frames, seed {}, {} thread(s){}; random policy's mean return {random:.3}",
        config.frames,
        config.seed,
        config.threads,
        if config.flush_denormals {
            ", denormals flushed to zero"
        } else {
            ""
        }
    );
    let run = train(&config)?;
    let mean = mean_last(&run.episodes, 100);
    println!(
        "{} frames in {} episodes, {:.0} frames/s; mean return of the last 100 episodes {mean:.2}",
        config.frames,
        run.episodes.len(),
        run.frames_per_second
    );
    if let Some(dir) = config.plot.parent() {
        std::fs::create_dir_all(dir)?;
    }
    plot(&config.plot, &run.episodes, random)?;
    println!("plot: {}", config.plot.display());
    if let Some(dir) = config.save.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut net = run.net;
    Writer::new().add("", &mut net)?.write_file(&config.save)?;
    println!("saved: {}", config.save.display());
    let passed = mean > random;
    println!(
        "DQN_RESULT {{\"frames\":{},\"frames_per_second\":{:.1},\"mean_return\":{mean:.3},\"random_return\":{random:.3},\"seed\":{},\"threads\":{},\"flush_denormals\":{},\"passed\":{passed}}}",
        config.frames, run.frames_per_second, config.seed, config.threads, config.flush_denormals
    );
    Ok(passed)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("the agent did not beat the random policy");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
