//! Throughput of the generated CPU code on a suite of real layer shapes, against this machine's
//! FMA peak measured in the same process, and against oneDNN in the same process.
//!
//! ```text
//! cargo run --release --example bench [FILTER] [--quick] [--no-onednn] [--threads 1,2]
//! ONEDNN_LIB_DIR=... cargo run --release --features onednn --example bench -- --threads 1,2
//! ```
//!
//! FILTER keeps only shapes whose name contains it; `--quick` trades precision for time;
//! `--threads` lists the thread counts (default 1): every `cpu` row runs on
//! `Cpu::with_threads(n)` and every `onednn` row on `OneDnn::with_threads(n)` for each count `n`.
//! Every result is printed as a table row and, at the end, as one `BENCH_JSON {...}` line for
//! scripts (with its `"threads"`); then the ratios: ours vs oneDNN (each shape's rows run back
//! to back, both at the same thread count), and half precision vs f32, each also as
//! `BENCH_RATIO {...}` lines; with several counts, each row's speedup over the first count, per
//! backend, also as `BENCH_SCALING {...}` lines.
//!
//! The peak is one core's, measured on one thread; a row of `n` threads is compared with `n`
//! times it (at most the cores the system reports).

use conv_runtime::prelude::*;
use std::hint::black_box;
use std::time::{Duration, Instant};

// The suite: DQN "Nature" trunk (84x84 Atari frames) and its first dense layer (a 1x1
// convolution of a 1x1 map: the generated dense kernels, oneDNN's inner product), a CIFAR stem,
// a strided 16x16 layer, a tiny single-channel layer where per-call overhead dominates, a
// ResNet-50 body layer where arithmetic dominates, and the IMPALA CNN's first residual layer (16
// channels: Winograd products of one column group). Training batch 32 (ResNet 8, to keep the run
// short).

conv_runtime::conv2d! {
    pub struct Nature1 {
        input: [84, 84, 4], out_channels: 32, kernel: 8, stride: 4, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Nature2 {
        input: [20, 20, 32], out_channels: 64, kernel: 4, stride: 2, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Nature3 {
        input: [9, 9, 64], out_channels: 64, kernel: 3, stride: 1, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct NatureFc {
        input: [1, 1, 3136], out_channels: 512, kernel: 1, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Cifar1 {
        input: [32, 32, 3], out_channels: 16, kernel: 3, stride: 1, padding: 1, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Bn16 {
        input: [16, 16, 16], out_channels: 32, kernel: 3, stride: 2, padding: 1, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Tiny {
        input: [8, 8, 1], out_channels: 8, kernel: 3, stride: 1, padding: 1, activation: Tanh,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Resnet {
        input: [56, 56, 64], out_channels: 64, kernel: 3, stride: 1, padding: 1, activation: Relu,
        batch: 8, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Impala1 {
        input: [32, 32, 16], out_channels: 16, kernel: 3, stride: 1, padding: 1, activation: Relu,
        batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Nature2Bn {
        input: [20, 20, 32], out_channels: 64, kernel: 4, stride: 2, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 32, dtype: f32,
    }
}
conv_runtime::conv2d! {
    pub struct Bn16Bn {
        input: [16, 16, 16], out_channels: 32, kernel: 3, stride: 2, padding: 1, activation: Relu,
        norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 32, dtype: f32,
    }
}

// Half-precision variants of the compute-bound shapes (the win is memory, not arithmetic).
macro_rules! half_layers {
    ($($name:ident: [$ih:literal, $iw:literal, $ic:literal] -> $oc:literal, k $k:literal, s $s:literal, p $p:literal, batch $b:literal, $t:ident;)*) => {$(
        conv_runtime::conv2d! {
            pub struct $name {
                input: [$ih, $iw, $ic], out_channels: $oc, kernel: $k, stride: $s, padding: $p,
                activation: Relu, batch: $b, dtype: $t,
            }
        }
    )*};
}
half_layers! {
    Nature2F16: [20, 20, 32] -> 64, k 4, s 2, p 0, batch 32, f16;
    Nature3F16: [9, 9, 64] -> 64, k 3, s 1, p 0, batch 32, f16;
    ResnetF16: [56, 56, 64] -> 64, k 3, s 1, p 1, batch 8, f16;
    Nature2Bf16: [20, 20, 32] -> 64, k 4, s 2, p 0, batch 32, bf16;
    Nature3Bf16: [9, 9, 64] -> 64, k 3, s 1, p 0, batch 32, bf16;
    ResnetBf16: [56, 56, 64] -> 64, k 3, s 1, p 1, batch 8, bf16;
}

/// Emits the rows of each listed layer type on one device and dtype: `evaluate` at each listed
/// batch, then, at the spec's batch, `forward` in `Mode::Train`, `backward_full`, and the two
/// together as one training step. A macro rather than a generic function because the tensor shapes are the layer's
/// associated constants, which can only appear in types where the layer is concrete.
///
/// A new backend or dtype is one more invocation with its own device, element type and backend
/// name (and its own layer types for another dtype); `Bench` and the output need no change.
macro_rules! bench_layers {
    (
        $bench:expr, device: $device:expr => $backend:literal, threads: $threads:expr, dtype: $t:ty,
        layers: { $($name:literal: $layer:ident / $grads:ident / $state:ident,
                    eval_batches [$($b:literal),*];)* }
    ) => {$({
        let bench: &mut Bench = $bench;
        if bench.wants($name) {
            const IH: usize = $layer::INPUT_HEIGHT;
            const IW: usize = $layer::INPUT_WIDTH;
            const IC: usize = $layer::INPUT_CHANNELS;
            const OH: usize = $layer::OUTPUT_HEIGHT;
            const OW: usize = $layer::OUTPUT_WIDTH;
            const OC: usize = $layer::OUTPUT_CHANNELS;
            const TRAIN_BATCH: usize = $layer::BATCH_SIZE;
            let forward_flops = |batch: usize| {
                2.0 * (batch * OH * OW * OC * $layer::KERNEL_HEIGHT * $layer::KERNEL_WIDTH * IC)
                    as f64
            };
            let dtype = stringify!($t);
            let threads: usize = $threads;
            let mut device = $device;
            let mut layer = $layer::new(&mut Rng::seed_from_u64(42));

            $(
                let mut x = Tensor::<$t, $b, IH, IW, IC>::zeros();
                fill_random(x.as_mut_slice(), 1);
                let mut y = Tensor::<$t, $b, OH, OW, OC>::zeros();
                let row = Row::new($name, "evaluate", $b, dtype, $backend, threads, forward_flops($b));
                bench.run(row, || {
                    layer
                        .evaluate(&mut device, black_box(&x), black_box(&mut y))
                        .expect("evaluate");
                });
            )*

            let mut x = Tensor::<$t, TRAIN_BATCH, IH, IW, IC>::zeros();
            fill_random(x.as_mut_slice(), 2);
            let mut d_output = Tensor::<$t, TRAIN_BATCH, OH, OW, OC>::zeros();
            fill_random(d_output.as_mut_slice(), 3);
            let mut d_input = Tensor::<$t, TRAIN_BATCH, IH, IW, IC>::zeros();
            let mut grads = $grads::zeros();
            let mut state = $state::new();
            // Gradients are not zeroed between calls: accumulating is what a real step does with
            // them, and `zero()` is not convolution work.
            let forward = |layer: &mut $layer, device: &mut _, state: &mut $state| {
                layer
                    .forward(device, black_box(&x), state, Mode::Train)
                    .expect("forward");
            };
            let mut backward = |layer: &mut $layer, device: &mut _, state: &$state| {
                layer
                    .backward_full(
                        device,
                        state,
                        &x,
                        black_box(&d_output),
                        &mut d_input,
                        &mut grads,
                        Mode::Train,
                    )
                    .expect("backward_full");
            };

            // The two halves of a step apart, so that a slow one stands out; backward data and
            // backward weights are two convolutions' worth of FLOPs.
            let flops = forward_flops(TRAIN_BATCH);
            let row = Row::new($name, "forward_train", TRAIN_BATCH, dtype, $backend, threads, flops);
            bench.run(row, || forward(&mut layer, &mut device, &mut state));
            let row = Row::new($name, "backward_full", TRAIN_BATCH, dtype, $backend, threads, 2.0 * flops);
            bench.run(row, || backward(&mut layer, &mut device, &state));

            let row = Row::new($name, "train_step", TRAIN_BATCH, dtype, $backend, threads, 3.0 * flops);
            bench.run(row, || {
                // An optimizer changes the parameters every step; giving them new stamps makes
                // the device repack them, as it would after a real update.
                black_box(layer.weights.as_mut_slice());
                black_box(layer.biases.as_mut_slice());
                forward(&mut layer, &mut device, &mut state);
                backward(&mut layer, &mut device, &state);
            });
        }
    })*};
}

fn main() {
    let config = Config::from_args();
    let started = Instant::now();
    let peak = peak::measure(config.quick);
    match &peak {
        Some(p) => println!(
            "single-core f32 FMA peak: {:.1} GFLOP/s ({}; {})",
            p.gflops,
            p.isa,
            p.detail.join(", ")
        ),
        None => println!("single-core f32 FMA peak: unknown on this architecture"),
    }
    println!(
        "timing: median of {} repetitions of ~{:.2} s each; threads: {}\n",
        config.repetitions,
        config.target.as_secs_f64(),
        config
            .threads
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut bench = Bench::new(config, peak);
    if !bench.onednn {
        println!("oneDNN rows: off (build with `--features onednn` and set ONEDNN_LIB_DIR)\n");
    }
    bench.print_header();
    run_suite(&mut bench);

    println!();
    for row in &bench.rows {
        println!("BENCH_JSON {}", row.json(bench.peak.as_ref()));
    }
    print_ratios(
        &bench.rows,
        "ours vs oneDNN (oneDNN time / ours: above 1, ours is faster)",
        ("onednn", "f32"),
        ("cpu", "f32"),
    );
    for half in ["f16", "bf16"] {
        print_ratios(
            &bench.rows,
            &format!("{half} vs f32 (f32 time / {half}: the half layer's relative throughput)"),
            ("cpu", "f32"),
            ("cpu", half),
        );
    }
    print_scaling(&bench.rows, &bench.config.threads);
    println!("\ntotal {:.1} s", started.elapsed().as_secs_f64());
}

fn run_suite(bench: &mut Bench) {
    let counts = bench.config.threads.clone();
    // Each f32 shape on the CPU device, then at once on oneDNN (where built and loadable), so
    // both see the same machine state; each thread count in turn.
    macro_rules! shape {
        ($name:literal: $layer:ident / $grads:ident / $state:ident, eval_batches [$($b:literal),*]) => {
            for &threads in &counts {
                bench_layers!(bench, device: cpu(threads) => "cpu", threads: threads, dtype: f32, layers: {
                    $name: $layer / $grads / $state, eval_batches [$($b),*];
                });
                #[cfg(feature = "onednn")]
                if bench.onednn {
                    match OneDnn::with_threads(threads) {
                        Ok(device) => bench_layers!(bench, device: device => "onednn", threads: threads, dtype: f32, layers: {
                            $name: $layer / $grads / $state, eval_batches [$($b),*];
                        }),
                        Err(e) => println!("oneDNN, {threads} threads: {e}"),
                    }
                }
            }
        };
    }
    shape!("nature1": Nature1 / Nature1Grads / Nature1State, eval_batches [1, 32]);
    shape!("nature2": Nature2 / Nature2Grads / Nature2State, eval_batches [1, 32]);
    shape!("nature3": Nature3 / Nature3Grads / Nature3State, eval_batches [1, 32]);
    shape!("nature_fc": NatureFc / NatureFcGrads / NatureFcState, eval_batches [1, 32]);
    shape!("cifar1": Cifar1 / Cifar1Grads / Cifar1State, eval_batches [1, 32]);
    shape!("bn16": Bn16 / Bn16Grads / Bn16State, eval_batches [1, 32]);
    shape!("tiny": Tiny / TinyGrads / TinyState, eval_batches [1, 32]);
    shape!("resnet": Resnet / ResnetGrads / ResnetState, eval_batches [1, 8]);
    shape!("impala1": Impala1 / Impala1Grads / Impala1State, eval_batches [1, 32]);
    // BatchNorm's cost is in training (statistics and their backward); inference applies it to
    // each tile in cache, so one evaluate row is enough to see what it costs.
    shape!("nature2_bn": Nature2Bn / Nature2BnGrads / Nature2BnState, eval_batches [32]);
    shape!("bn16_bn": Bn16Bn / Bn16BnGrads / Bn16BnState, eval_batches [32]);

    for &threads in &counts {
        bench_layers!(bench, device: cpu(threads) => "cpu", threads: threads, dtype: f16, layers: {
            "nature2": Nature2F16 / Nature2F16Grads / Nature2F16State, eval_batches [1, 32];
            "nature3": Nature3F16 / Nature3F16Grads / Nature3F16State, eval_batches [1, 32];
            "resnet": ResnetF16 / ResnetF16Grads / ResnetF16State, eval_batches [1, 8];
        });
        bench_layers!(bench, device: cpu(threads) => "cpu", threads: threads, dtype: bf16, layers: {
            "nature2": Nature2Bf16 / Nature2Bf16Grads / Nature2Bf16State, eval_batches [1, 32];
            "nature3": Nature3Bf16 / Nature3Bf16Grads / Nature3Bf16State, eval_batches [1, 32];
            "resnet": ResnetBf16 / ResnetBf16Grads / ResnetBf16State, eval_batches [1, 8];
        });
    }
}

/// The CPU device of `threads` threads; the bench cannot go on without it.
fn cpu(threads: usize) -> Cpu {
    Cpu::with_threads(threads).unwrap_or_else(|e| {
        eprintln!("error: the CPU device of {threads} threads: {e}");
        std::process::exit(1)
    })
}

/// Prints `numerator / denominator` time ratios of matching rows (same shape, op, batch and
/// thread count) as a table and `BENCH_RATIO` lines: above 1 means the denominator's rows are
/// faster.
fn print_ratios(rows: &[Row], title: &str, numerator: (&str, &str), denominator: (&str, &str)) {
    fn pick<'a>(
        rows: &'a [Row],
        (backend, dtype): (&'a str, &'a str),
    ) -> impl Iterator<Item = &'a Row> {
        rows.iter()
            .filter(move |r| r.backend == backend && r.dtype == dtype)
    }
    let pairs: Vec<(&Row, &Row)> = pick(rows, denominator)
        .filter_map(|d| {
            pick(rows, numerator)
                .find(|n| n.same_call(d) && n.threads == d.threads)
                .map(|n| (n, d))
        })
        .collect();
    if pairs.is_empty() {
        return;
    }
    let label = |(b, t): (&str, &str)| format!("{b}/{t}");
    println!("\n{title}");
    println!(
        "{:<11} {:<13} {:>5} {:>3} {:>14} {:>14} {:>7}",
        "shape",
        "op",
        "batch",
        "thr",
        label(numerator),
        label(denominator),
        "ratio"
    );
    for (n, d) in &pairs {
        println!(
            "{:<11} {:<13} {:>5} {:>3} {:>11.2} us {:>11.2} us {:>6.2}x",
            d.shape,
            d.op,
            d.batch,
            d.threads,
            n.seconds * 1e6,
            d.seconds * 1e6,
            n.seconds / d.seconds
        );
    }
    for (n, d) in &pairs {
        println!(
            concat!(
                r#"BENCH_RATIO {{"shape":"{}","op":"{}","batch":{},"threads":{},"numerator":"{}","#,
                r#""denominator":"{}","ratio":{:.4}}}"#
            ),
            d.shape,
            d.op,
            d.batch,
            d.threads,
            label(numerator),
            label(denominator),
            n.seconds / d.seconds
        );
    }
}

/// With several thread counts: each row's speedup over the same row at the first count
/// (`base`), the f32 backends side by side, as a table and `BENCH_SCALING` lines (speedup: time
/// at `base` threads / time at `threads`; efficiency: the speedup over the ideal
/// `threads / base`).
fn print_scaling(rows: &[Row], counts: &[usize]) {
    let Some((&base, others)) = counts.split_first() else {
        return;
    };
    let speedup = |row: &Row| {
        rows.iter()
            .find(|b| b.threads == base && b.backend == row.backend && b.same_call(row))
            .map(|b| b.seconds / row.seconds)
    };
    let scaled: Vec<(&Row, f64)> = rows
        .iter()
        .filter(|r| others.contains(&r.threads))
        .filter_map(|r| speedup(r).map(|s| (r, s)))
        .collect();
    if scaled.is_empty() {
        return;
    }
    println!(
        "\nthread scaling (time at {base} thread{} / time at N: ours and oneDNN, per row)",
        if base == 1 { "" } else { "s" }
    );
    println!(
        "{:<11} {:<13} {:>5} {:<5} {:>3} {:>8} {:>8}",
        "shape", "op", "batch", "dtype", "N", "cpu", "onednn"
    );
    // One line per call and count, from its `cpu` row (and the matching `onednn` one).
    for (row, cpu) in scaled.iter().filter(|(r, _)| r.backend == "cpu") {
        let onednn = scaled
            .iter()
            .find(|(o, _)| o.backend == "onednn" && o.threads == row.threads && o.same_call(row))
            .map_or("-".to_string(), |(_, s)| format!("{s:.2}x"));
        println!(
            "{:<11} {:<13} {:>5} {:<5} {:>3} {:>7.2}x {:>8}",
            row.shape, row.op, row.batch, row.dtype, row.threads, cpu, onednn
        );
    }
    for (row, speedup) in &scaled {
        println!(
            concat!(
                r#"BENCH_SCALING {{"shape":"{}","op":"{}","batch":{},"dtype":"{}","backend":"{}","#,
                r#""threads":{},"base_threads":{},"speedup":{:.4},"efficiency":{:.4}}}"#
            ),
            row.shape,
            row.op,
            row.batch,
            row.dtype,
            row.backend,
            row.threads,
            base,
            speedup,
            speedup * base as f64 / row.threads as f64
        );
    }
}

struct Config {
    filter: Option<String>,
    quick: bool,
    no_onednn: bool,
    /// Thread counts, each device and row run at each (default: 1).
    threads: Vec<usize>,
    /// Wall time of one timed repetition.
    target: Duration,
    repetitions: usize,
}

const USAGE: &str = "usage: bench [SHAPE_FILTER] [--quick] [--no-onednn] [--threads N[,N...]]";

impl Config {
    fn from_args() -> Self {
        let mut config = Config {
            filter: None,
            quick: false,
            no_onednn: false,
            threads: vec![1],
            target: Duration::from_millis(300),
            repetitions: 5,
        };
        let mut args = std::env::args().skip(1);
        let usage = |problem: &str| -> ! {
            eprintln!("{problem}{USAGE}");
            std::process::exit(2)
        };
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--no-onednn" => config.no_onednn = true,
                "--quick" => {
                    config.quick = true;
                    config.target = Duration::from_millis(50);
                    config.repetitions = 3;
                }
                "--threads" => {
                    let list = args
                        .next()
                        .unwrap_or_else(|| usage("--threads needs a list, e.g. 1,2\n"));
                    config.threads = parse_counts(&list).unwrap_or_else(|| {
                        usage(&format!(
                            "--threads takes positive counts separated by commas, not `{list}`\n"
                        ))
                    });
                }
                _ if arg.starts_with('-') => usage(""),
                _ => config.filter = Some(arg),
            }
        }
        config
    }
}

/// `1,2,4` as distinct positive counts in the given order; None for anything else.
fn parse_counts(list: &str) -> Option<Vec<usize>> {
    let mut counts: Vec<usize> = Vec::new();
    for item in list.split(',') {
        let n: usize = item.trim().parse().ok().filter(|&n| n > 0)?;
        if !counts.contains(&n) {
            counts.push(n);
        }
    }
    Some(counts)
}

/// One measured (or about to be measured) result.
struct Row {
    shape: &'static str,
    op: &'static str,
    batch: usize,
    dtype: &'static str,
    backend: &'static str,
    /// The device's thread count.
    threads: usize,
    /// Useful floating-point operations per call.
    flops: f64,
    /// Median and fastest seconds per call over the repetitions.
    seconds: f64,
    fastest: f64,
}

impl Row {
    fn new(
        shape: &'static str,
        op: &'static str,
        batch: usize,
        dtype: &'static str,
        backend: &'static str,
        threads: usize,
        flops: f64,
    ) -> Self {
        Row {
            shape,
            op,
            batch,
            dtype,
            backend,
            threads,
            flops,
            seconds: f64::NAN,
            fastest: f64::NAN,
        }
    }

    fn gflops(&self) -> f64 {
        self.flops / self.seconds / 1e9
    }

    /// Whether `other` times the same call (shape, operation, batch and dtype).
    fn same_call(&self, other: &Row) -> bool {
        self.shape == other.shape
            && self.op == other.op
            && self.batch == other.batch
            && self.dtype == other.dtype
    }

    /// The FMA peak of the row's threads: one core's times the threads (at most the cores).
    fn peak_gflops(&self, peak: Option<&peak::Peak>) -> f64 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        peak.map_or(f64::NAN, |p| p.gflops * self.threads.min(cores) as f64)
    }

    /// Hand-formatted: every string is a fixed ASCII identifier, so no escaping is needed, and
    /// non-finite numbers (which JSON cannot represent) become null.
    fn json(&self, peak: Option<&peak::Peak>) -> String {
        let num = |v: f64| {
            if v.is_finite() {
                format!("{v:.4}")
            } else {
                "null".into()
            }
        };
        let peak_gflops = self.peak_gflops(peak);
        format!(
            concat!(
                r#"{{"shape":"{}","op":"{}","batch":{},"dtype":"{}","us":{},"gflops":{},"#,
                r#""peak_fraction":{},"backend":"{}","threads":{},"flops":{},"peak_gflops":{},"#,
                r#""us_min":{}}}"#,
            ),
            self.shape,
            self.op,
            self.batch,
            self.dtype,
            num(self.seconds * 1e6),
            num(self.gflops()),
            num(self.gflops() / peak_gflops),
            self.backend,
            self.threads,
            self.flops,
            num(peak_gflops),
            num(self.fastest * 1e6),
        )
    }
}

struct Bench {
    /// Whether to run the oneDNN rows (built with the feature, and not `--no-onednn`).
    onednn: bool,
    config: Config,
    peak: Option<peak::Peak>,
    rows: Vec<Row>,
}

impl Bench {
    fn new(config: Config, peak: Option<peak::Peak>) -> Self {
        Bench {
            onednn: cfg!(feature = "onednn") && !config.no_onednn,
            config,
            peak,
            rows: Vec::new(),
        }
    }

    fn wants(&self, shape: &str) -> bool {
        self.config
            .filter
            .as_deref()
            .is_none_or(|f| shape.contains(f))
    }

    fn print_header(&self) {
        println!(
            "{:<11} {:<13} {:>5} {:<5} {:<7} {:>3} {:>9} {:>11} {:>7} {:>9} {:>7}",
            "shape",
            "op",
            "batch",
            "dtype",
            "backend",
            "thr",
            "MFLOP",
            "us/call",
            "spread",
            "GFLOP/s",
            "%peak"
        );
    }

    /// Times `f`, records the row and prints it at once, so a long run shows progress.
    fn run(&mut self, mut row: Row, f: impl FnMut()) {
        let mut samples = measure(self.config.target, self.config.repetitions, f);
        samples.sort_by(f64::total_cmp);
        row.seconds = samples[samples.len() / 2];
        row.fastest = samples[0];
        // How far apart the repetitions were: a large spread means another process interfered
        // and the row deserves a rerun, not an interpretation.
        let spread = (samples[samples.len() - 1] - samples[0]) / row.seconds;
        let fraction = match self.peak {
            Some(_) => format!(
                "{:.1}%",
                100.0 * row.gflops() / row.peak_gflops(self.peak.as_ref())
            ),
            None => "n/a".into(),
        };
        println!(
            "{:<11} {:<13} {:>5} {:<5} {:<7} {:>3} {:>9.2} {:>11.2} {:>6.1}% {:>9.2} {:>7}",
            row.shape,
            row.op,
            row.batch,
            row.dtype,
            row.backend,
            row.threads,
            row.flops / 1e6,
            row.seconds * 1e6,
            100.0 * spread,
            row.gflops(),
            fraction
        );
        self.rows.push(row);
    }
}

/// Seconds per call of `f`, one sample per repetition. A warm-up (caches, page faults, lazily
/// packed weights, CPU clock ramp) also estimates the cost of one call, which sets how many calls
/// fill one repetition of `target`; the caller takes the median, which discards short
/// interference from other processes on a shared machine.
fn measure(target: Duration, repetitions: usize, mut f: impl FnMut()) -> Vec<f64> {
    let warmup = target / 4;
    let start = Instant::now();
    let mut calls = 0u64;
    while calls < 2 || start.elapsed() < warmup {
        f();
        calls += 1;
    }
    let per_call = start.elapsed().as_secs_f64() / calls as f64;
    let iterations = ((target.as_secs_f64() / per_call).round() as u64).max(1);

    (0..repetitions)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iterations {
                f();
            }
            start.elapsed().as_secs_f64() / iterations as f64
        })
        .collect()
}

/// Deterministic values in [-1, 1): inputs of realistic magnitude without pulling in `rand`
/// (and without zeros, which would let ReLU/BatchNorm take unrepresentative paths).
fn fill_random<T: Element>(values: &mut [T], seed: u64) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for v in values {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        *v = T::from_f64(bits as f64 / (1u64 << 52) as f64 - 1.0);
    }
}

/// The single-core f32 FMA peak: many independent FMA chains, so that throughput, not latency,
/// limits the loop (FMA latency is 4-5 cycles and up to two issue per cycle, so at least ~10
/// chains are needed).
mod peak {
    pub struct Peak {
        pub gflops: f64,
        /// The instruction set that gave the peak.
        pub isa: &'static str,
        /// Every variant measured, for the record.
        pub detail: Vec<String>,
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn measure(_quick: bool) -> Option<Peak> {
        None
    }

    #[cfg(target_arch = "x86_64")]
    pub fn measure(quick: bool) -> Option<Peak> {
        let budget = if quick { 0.05 } else { 0.2 };
        let mut variants: Vec<(&'static str, f64)> = Vec::new();
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has the features the function is compiled for.
            let flops_per_iteration = (2 * 8 * x86::CHAINS) as f64;
            variants.push((
                "avx2+fma",
                rate(budget, flops_per_iteration, |n| unsafe { x86::avx2_fma(n) }),
            ));
        }
        if is_x86_feature_detected!("avx512f") {
            let flops_per_iteration = (2 * 16 * x86::CHAINS) as f64;
            // SAFETY: as above.
            variants.push((
                "avx512f",
                rate(budget, flops_per_iteration, |n| unsafe {
                    x86::avx512_fma(n)
                }),
            ));
        }
        let (isa, gflops) = variants
            .iter()
            .copied()
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        let detail = variants
            .iter()
            .map(|(isa, g)| format!("{isa} {g:.1}"))
            .collect();
        Some(Peak {
            gflops,
            isa,
            detail,
        })
    }

    /// Best GFLOP/s of `kernel(iterations)` over a few runs of roughly `budget` seconds in all.
    /// The best rather than the median: interference only ever makes a run slower.
    #[cfg(target_arch = "x86_64")]
    fn rate(budget: f64, flops_per_iteration: f64, kernel: impl Fn(u64) -> f32) -> f64 {
        use std::hint::black_box;
        use std::time::Instant;
        // Grow the run until it is long enough to time; this doubles as the warm-up that lets
        // the core reach its vector clock.
        let mut iterations = 1u64 << 12;
        let mut elapsed;
        loop {
            let start = Instant::now();
            black_box(kernel(black_box(iterations)));
            elapsed = start.elapsed().as_secs_f64();
            if elapsed > budget / 10.0 {
                break;
            }
            iterations *= 2;
        }
        let iterations = ((iterations as f64) * budget / 5.0 / elapsed).max(1.0) as u64;
        (0..5)
            .map(|_| {
                let start = Instant::now();
                black_box(kernel(black_box(iterations)));
                iterations as f64 * flops_per_iteration / start.elapsed().as_secs_f64() / 1e9
            })
            .fold(0.0, f64::max)
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;
        use std::hint::black_box;

        pub const CHAINS: usize = 12;

        // acc = acc * a + b converges to b / (1 - a) = 1: no overflow and no denormals, which
        // would slow the FMA units down and understate the peak.
        const A: f32 = 0.9999;
        const B: f32 = 1e-4;

        #[target_feature(enable = "avx2,fma")]
        pub fn avx2_fma(iterations: u64) -> f32 {
            let a = _mm256_set1_ps(black_box(A));
            let b = _mm256_set1_ps(black_box(B));
            let mut acc = [_mm256_setzero_ps(); CHAINS];
            for _ in 0..iterations {
                for v in &mut acc {
                    *v = _mm256_fmadd_ps(*v, a, b);
                }
            }
            let sum = acc
                .iter()
                .fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
            // SAFETY: __m256 is eight f32 lanes.
            let lanes: [f32; 8] = unsafe { std::mem::transmute(sum) };
            lanes.iter().sum()
        }

        #[target_feature(enable = "avx512f")]
        pub fn avx512_fma(iterations: u64) -> f32 {
            let a = _mm512_set1_ps(black_box(A));
            let b = _mm512_set1_ps(black_box(B));
            let mut acc = [_mm512_setzero_ps(); CHAINS];
            for _ in 0..iterations {
                for v in &mut acc {
                    *v = _mm512_fmadd_ps(*v, a, b);
                }
            }
            _mm512_reduce_add_ps(
                acc.iter()
                    .fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v)),
            )
        }
    }
}
