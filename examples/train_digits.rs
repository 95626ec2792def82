//! A small CNN, one `network!`, trained on the UCI handwritten digits: 1,797 8x8 images
//! with pixel values 0..16, 10 classes (the copy scikit-learn ships; see `examples/data/`).
//!
//! ```sh
//! cargo run --release --example train_digits                 # full run (>= 97% test accuracy)
//! cargo run --release --example train_digits -- --quick      # 3 epochs, must reach 80% (CI)
//! cargo run --release --example train_digits -- --help
//! ```
//!
//! Network (`Net`, one `network!`): conv1 `[8,8,1] -> 16`, kernel 3, padding 1, ReLU; conv2
//! `[8,8,16] -> 32`, kernel 3, stride 2, padding 1, BatchNorm, ReLU; flatten; a dense read-out
//! `4*4*32 = 512 -> 10` with soft-max cross-entropy (`loss::softmax_cross_entropy`). One Adam
//! steps the whole network; minibatches of 32, learning rate 5e-3 decayed to 0 over the run on
//! a cosine (20 epochs by default).
//!
//! Devices: `--backend cpu` (default) or `onednn`, on `--threads N` threads (default 1;
//! `Cpu::with_threads`, `OneDnn::with_threads`). The cpu device computes the same bits on any
//! number of threads, so a run's losses and accuracy do not depend on N; oneDNN's may differ by
//! rounding.
//!
//! Data: pixels scaled to [0, 1]. A fixed split (a shuffle with its own seed, independent of
//! `--seed`): 1,437 training and 360 test images. Each epoch reshuffles the training images and
//! drops the last partial batch (1,437 = 44 * 32 + 29): every batch then has the layers' fixed
//! training batch size and BatchNorm statistics over 32 images, and the dropped 29 differ from
//! epoch to epoch, so over the epochs all images are trained on. Test accuracy uses `evaluate`
//! (BatchNorm's running statistics) on all 360 test images at once.
//!
//! Reports: a progress bar per epoch (loss and accuracy of the epoch's batches so far; shown
//! only on a terminal), a line per epoch, then test accuracy, training time (the training loop
//! alone, without data loading, per-epoch test evaluation or plotting) and images per second.
//! It writes a PNG of loss and accuracy per epoch (`--plot`, default `target/train_digits.png`
//! relative to the current folder; text in the Go font embedded from `examples/data/fonts/`, so
//! no system font is needed), saves the trained parameters as safetensors (`--save`, default
//! `target/train_digits.safetensors`), loads them back into a fresh network and checks that it
//! computes the same test outputs, bit for bit. The last line is machine-readable:
//! `TRAIN_DIGITS_RESULT {json}`. The exit status is non-zero when the test accuracy is below
//! the bar (`--min-accuracy`; default 97% for the full run, 80% for shorter runs, "it learned"),
//! for an unavailable backend, bad arguments, or any error.

use std::error::Error as StdError;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use conv_runtime::head::argmax;
use conv_runtime::loss::softmax_cross_entropy;
use conv_runtime::prelude::*;
use conv_runtime::safetensors::{Reader, Writer};

/// Image side; the images are 8x8 with one channel.
const SIDE: usize = 8;
const PIXELS: usize = SIDE * SIDE;
const CLASSES: usize = 10;
/// Images in the data set.
const SAMPLES: usize = 1797;
/// Held-out images (20%); a constant because `evaluate` takes the batch as a type parameter.
const TEST: usize = 360;
const BATCH: usize = 32;

/// Seed of the train/test split: fixed, so every run tests on the same images.
const SPLIT_SEED: u64 = 20_240_611;
const DEFAULT_SEED: u64 = 1;
const DEFAULT_EPOCHS: usize = 20;
const QUICK_EPOCHS: usize = 3;
/// The bar of the full run.
const FULL_ACCURACY: f64 = 0.97;
/// The bar of shorter runs: clearly above chance (10%), so a network that does not learn fails.
const LEARNED_ACCURACY: f64 = 0.80;
const LEARNING_RATE: f32 = 5e-3;

/// The data set as committed (scikit-learn's copy; licence in examples/data/README.md).
const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/digits.csv.gz");
/// Go Regular (BSD-3-Clause, examples/data/fonts/LICENSE): the plot's text needs no system fonts.
const FONT: &[u8] = include_bytes!("data/fonts/Go-Regular.ttf");

conv_runtime::network! {
    /// 8x8x1 digits -> 10 logits: edge and stroke features, then 4x4x32 features normalized
    /// per channel over the batch, then a dense read-out.
    pub struct Net {
        input: [8, 8, 1],
        batch: 32,
        layers: [
            conv1: Conv2d { out_channels: 16, kernel: 3, padding: 1, activation: Relu },
            conv2: Conv2d {
                out_channels: 32, kernel: 3, stride: 2, padding: 1, activation: Relu,
                norm: BatchNorm { momentum: 0.1, eps: 1e-5 },
            },
            flat: Flatten,
            readout: Dense { out_features: 10 },
        ],
    }
}

// ---------------------------------------------------------------------------------------------
// Data

/// Images (row-major 8x8, scaled to [0, 1]) and labels.
pub struct Digits {
    pub images: Vec<f32>,
    pub labels: Vec<usize>,
}

impl Digits {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn image(&self, i: usize) -> &[f32] {
        &self.images[i * PIXELS..(i + 1) * PIXELS]
    }

    /// The images at `indices`, in that order.
    fn subset(&self, indices: &[usize]) -> Digits {
        Digits {
            images: indices
                .iter()
                .flat_map(|&i| self.image(i))
                .copied()
                .collect(),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
        }
    }
}

/// Reads scikit-learn's `digits.csv.gz`: one image per line, 64 pixels (0..16) then the label.
pub fn load_digits(path: &Path) -> Result<Digits, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: not a gzip-compressed text file: {e}", path.display()))?;
    let mut digits = Digits {
        images: Vec::with_capacity(SAMPLES * PIXELS),
        labels: Vec::with_capacity(SAMPLES),
    };
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let fields: Vec<&str> = line.split(',').collect();
        let bad = |what: String| format!("{} line {}: {what}", path.display(), n + 1);
        if fields.len() != PIXELS + 1 {
            return Err(bad(format!(
                "{} fields, expected {}",
                fields.len(),
                PIXELS + 1
            )));
        }
        // Integers written as "5" or "5.0" both occur in copies of this file.
        let values = fields
            .iter()
            .map(|f| match f.trim().parse::<f64>() {
                Ok(v) if v.fract() == 0.0 && (0.0..=16.0).contains(&v) => Ok(v),
                _ => Err(bad(format!("`{f}` is not an integer in 0..16"))),
            })
            .collect::<Result<Vec<f64>, String>>()?;
        let label = values[PIXELS];
        if label > 9.0 {
            return Err(bad(format!("label {label} is not a digit")));
        }
        digits
            .images
            .extend(values[..PIXELS].iter().map(|&v| (v / 16.0) as f32));
        digits.labels.push(label as usize);
    }
    if digits.len() != SAMPLES {
        return Err(format!(
            "{}: {} images, expected {SAMPLES}",
            path.display(),
            digits.len()
        ));
    }
    Ok(digits)
}

/// Fisher-Yates with `rng`.
fn shuffle(order: &mut [usize], rng: &mut Rng) {
    for i in (1..order.len()).rev() {
        let j = (rng.uniform(0.0, (i + 1) as f64) as usize).min(i);
        order.swap(i, j);
    }
}

/// The fixed split: (training, test).
pub fn split(all: &Digits) -> (Digits, Digits) {
    let mut order: Vec<usize> = (0..all.len()).collect();
    shuffle(&mut order, &mut Rng::seed_from_u64(SPLIT_SEED));
    (all.subset(&order[TEST..]), all.subset(&order[..TEST]))
}

// ---------------------------------------------------------------------------------------------
// The network

/// The trainable network and what it is evaluated and saved with.
pub struct Model {
    pub net: Net,
}

impl Model {
    pub fn new(rng: &mut Rng) -> Self {
        Self { net: Net::new(rng) }
    }

    /// Logits of the whole test set through `evaluate` (BatchNorm's running statistics).
    pub fn test_logits(
        &self,
        device: &mut impl NetDevice,
        test: &Digits,
    ) -> conv_runtime::Result<Vec<[f32; CLASSES]>> {
        let x = NetInput::<TEST>::from_vec(test.images.clone())?;
        let mut logits = NetOutput::<TEST>::zeros();
        self.net.evaluate(device, &x, &mut logits)?;
        Ok(logits
            .as_slice()
            .chunks_exact(CLASSES)
            .map(|z| std::array::from_fn(|k| z[k]))
            .collect())
    }

    /// Fraction of the test set classified correctly.
    pub fn test_accuracy(
        &self,
        device: &mut impl NetDevice,
        test: &Digits,
    ) -> conv_runtime::Result<f64> {
        let logits = self.test_logits(device, test)?;
        let correct = logits
            .iter()
            .zip(&test.labels)
            .filter(|(z, &label)| argmax(&z[..]) == label)
            .count();
        Ok(correct as f64 / test.len() as f64)
    }

    /// Saves the parameters (and BatchNorm's running statistics) as `conv1.*`, `conv2.*`,
    /// `readout.*` in one safetensors file.
    pub fn save(&mut self, path: &Path) -> conv_runtime::Result<()> {
        Writer::new().add("", &mut self.net)?.write_file(path)
    }

    /// Loads what [`Model::save`] wrote, checking every name, shape and dtype.
    pub fn load(&mut self, path: &Path) -> conv_runtime::Result<()> {
        Reader::open(path)?.load("", &mut self.net)
    }
}

/// Loss and accuracy of one epoch.
#[derive(Clone, Copy, Debug)]
pub struct EpochStats {
    /// Mean minibatch loss.
    pub loss: f64,
    /// Accuracy on the epoch's training batches (while training).
    pub train_accuracy: f64,
    /// Test accuracy after the epoch (`evaluate`).
    pub test_accuracy: f64,
}

/// How to train.
pub struct Config {
    pub epochs: usize,
    pub seed: u64,
    /// Draw a progress bar (on a terminal).
    pub progress: bool,
}

/// A trained network and how training went.
pub struct Trained {
    pub model: Model,
    pub history: Vec<EpochStats>,
    /// Seconds in the training loop proper (forward, backward, optimizer steps).
    pub train_seconds: f64,
    /// Images trained on (batches times the batch size, over all epochs).
    pub images: usize,
}

/// Trains a new network on `train` with `device`, reporting per epoch.
pub fn train(
    device: &mut impl NetDevice,
    train: &Digits,
    test: &Digits,
    config: &Config,
) -> conv_runtime::Result<Trained> {
    let mut rng = Rng::seed_from_u64(config.seed);
    let mut model = Model::new(&mut rng);
    let mut adam = Adam::new(LEARNING_RATE);
    let mut grads = NetGrads::zeros();
    let mut state = NetState::new();
    let mut x = NetInput::<BATCH>::zeros();
    let mut d_logits = NetOutput::<BATCH>::zeros();
    let mut labels = [0usize; BATCH];

    let batches = train.len() / BATCH;
    let mut order: Vec<usize> = (0..train.len()).collect();
    let mut history = Vec::new();
    let mut train_seconds = 0.0;
    for epoch in 1..=config.epochs {
        let bar = progress_bar(config, epoch, batches);
        // Cosine decay of the learning rate over the run: large steps early, fine ones late.
        let progress = (epoch - 1) as f32 / config.epochs as f32;
        let lr = LEARNING_RATE * 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        adam.lr = lr;
        shuffle(&mut order, &mut rng);
        let started = Instant::now();
        let (mut loss_sum, mut correct) = (0.0f64, 0usize);
        for (n, batch) in order.chunks_exact(BATCH).enumerate() {
            let xs = x.as_mut_slice();
            for (b, &i) in batch.iter().enumerate() {
                xs[b * PIXELS..(b + 1) * PIXELS].copy_from_slice(train.image(i));
                labels[b] = train.labels[i];
            }

            model.net.forward(device, &x, &mut state, Mode::Train)?;
            let loss = softmax_cross_entropy(state.output(), &labels, &mut d_logits)?;
            // The input needs no gradient: only the parameters'.
            model
                .net
                .backward(device, &state, &x, &d_logits, &mut grads, Mode::Train)?;
            adam.step(&mut model.net, &grads);
            grads.zero();
            let (loss, hits) = (loss.mean, loss.correct.unwrap_or(0));

            loss_sum += loss;
            correct += hits;
            if let Some(bar) = &bar {
                bar.set_position(n as u64 + 1);
                bar.set_message(format!(
                    "loss {:.4}  acc {:.1}%",
                    loss_sum / (n + 1) as f64,
                    100.0 * correct as f64 / ((n + 1) * BATCH) as f64
                ));
            }
        }
        train_seconds += started.elapsed().as_secs_f64();
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }

        let stats = EpochStats {
            loss: loss_sum / batches as f64,
            train_accuracy: correct as f64 / (batches * BATCH) as f64,
            test_accuracy: model.test_accuracy(device, test)?,
        };
        if !stats.loss.is_finite() {
            return Err(conv_runtime::Error::new(
                "training",
                format!("the loss diverged in epoch {epoch}"),
            ));
        }
        println!(
            "epoch {epoch:>2}/{}: loss {:.4}, train accuracy {:5.1}%, test accuracy {:5.1}%",
            config.epochs,
            stats.loss,
            100.0 * stats.train_accuracy,
            100.0 * stats.test_accuracy
        );
        history.push(stats);
    }
    Ok(Trained {
        model,
        history,
        train_seconds,
        images: config.epochs * batches * BATCH,
    })
}

fn progress_bar(config: &Config, epoch: usize, batches: usize) -> Option<indicatif::ProgressBar> {
    if !config.progress {
        return None;
    }
    // indicatif draws on stderr only when it is a terminal, so logs stay clean.
    let bar = indicatif::ProgressBar::new(batches as u64);
    let style = indicatif::ProgressStyle::with_template(
        "epoch {prefix:>5} [{bar:25}] {pos:>2}/{len}  {msg}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(format!("{epoch}/{}", config.epochs));
    Some(bar)
}

// ---------------------------------------------------------------------------------------------
// The plot

/// Loss (left) and accuracy (right) per epoch, as a PNG.
pub fn plot(path: &Path, history: &[EpochStats]) -> Result<(), Box<dyn StdError>> {
    use plotters::prelude::*;

    // With the `ab_glyph` feature plotters draws text only in fonts registered here: the
    // embedded one. Registering twice (tests) just replaces it.
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the embedded font is not a valid TrueType font")?;

    let epochs = history.len().max(1) as f64;
    let x_range = 0.5..epochs + 0.5;
    let x_labels = history.len().clamp(1, 12);
    let root = BitMapBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(550);

    // The loss falls over orders of magnitude: a log scale shows all of it.
    let (min_loss, max_loss) = history
        .iter()
        .map(|s| s.loss)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), l| {
            (lo.min(l), hi.max(l))
        });
    let (low, high) = if min_loss.is_finite() && min_loss > 0.0 {
        (min_loss / 1.5, max_loss * 1.5)
    } else {
        (1e-3, 10.0)
    };
    let mut chart = ChartBuilder::on(&left)
        .caption("Training loss", ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range.clone(), (low..high).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("mean cross-entropy (log scale)")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_labels(x_labels)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0e}"))
        .draw()?;
    let loss: Vec<(f64, f64)> = (1..)
        .map(|e| e as f64)
        .zip(history.iter().map(|s| s.loss))
        .collect();
    chart
        .draw_series(LineSeries::new(loss.iter().copied(), RED.stroke_width(2)))?
        .label("train loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart.draw_series(loss.iter().map(|&p| Circle::new(p, 3, RED.filled())))?;
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 15))
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;

    let lowest = history
        .iter()
        .flat_map(|s| [s.train_accuracy, s.test_accuracy])
        .fold(1.0, f64::min);
    let floor = ((100.0 * lowest - 5.0) / 10.0).floor().clamp(0.0, 9.0) * 10.0;
    let mut chart = ChartBuilder::on(&right)
        .caption("Accuracy", ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range, floor..100.0)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("accuracy (%)")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_labels(x_labels)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    for (name, color, of) in [
        (
            "train (batches)",
            BLUE,
            (|s: &EpochStats| s.train_accuracy) as fn(&EpochStats) -> f64,
        ),
        ("test (evaluate)", GREEN, |s: &EpochStats| s.test_accuracy),
    ] {
        let points: Vec<(f64, f64)> = (1..)
            .map(|e| e as f64)
            .zip(history.iter().map(|s| 100.0 * of(s)))
            .collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 15))
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Command line

/// The backends a user can ask for.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Cpu,
    OneDnn,
    Cuda,
}

impl Backend {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "cpu" => Some(Self::Cpu),
            "onednn" => Some(Self::OneDnn),
            "cuda" => Some(Self::Cuda),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::OneDnn => "onednn",
            Self::Cuda => "cuda",
        }
    }
}

struct Args {
    backend: Backend,
    /// Threads of the cpu and onednn devices.
    threads: usize,
    epochs: usize,
    seed: u64,
    min_accuracy: f64,
    plot: PathBuf,
    save: PathBuf,
    data: PathBuf,
}

const USAGE: &str = "\
usage: train_digits [options]
  --backend cpu|onednn|cuda   device for the conv layers (default cpu)
  --threads N                 threads of the cpu and onednn devices (default 1); results do
                              not depend on it on cpu
  --epochs N                  epochs (default 20)
  --quick                     3 epochs (what CI runs)
  --seed N                    initialization and shuffling seed (default 1); the split is fixed
  --min-accuracy F            exit non-zero below this test accuracy (default 0.97 for the
                              full run, 0.80 for shorter runs)
  --plot PATH                 loss/accuracy PNG (default target/train_digits.png)
  --save PATH                 trained parameters, safetensors (default target/train_digits.safetensors)
  --data PATH                 digits.csv.gz (default examples/data/digits.csv.gz)";

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        backend: Backend::Cpu,
        threads: 1,
        epochs: DEFAULT_EPOCHS,
        seed: DEFAULT_SEED,
        min_accuracy: f64::NAN,
        plot: PathBuf::from("target/train_digits.png"),
        save: PathBuf::from("target/train_digits.safetensors"),
        data: PathBuf::from(DATA),
    };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--backend" => {
                let v = value("--backend")?;
                parsed.backend = Backend::parse(&v)
                    .ok_or(format!("unknown backend `{v}` (cpu, onednn or cuda)"))?;
            }
            "--threads" => {
                let v = value("--threads")?;
                parsed.threads = v
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(format!("--threads takes a positive integer, not `{v}`"))?;
            }
            "--epochs" => {
                let v = value("--epochs")?;
                parsed.epochs = v
                    .parse()
                    .ok()
                    .filter(|&e| e > 0)
                    .ok_or(format!("--epochs takes a positive integer, not `{v}`"))?;
            }
            "--quick" => parsed.epochs = QUICK_EPOCHS,
            "--seed" => {
                let v = value("--seed")?;
                parsed.seed = v
                    .parse()
                    .map_err(|_| format!("--seed takes an integer, not `{v}`"))?;
            }
            "--min-accuracy" => {
                let v = value("--min-accuracy")?;
                parsed.min_accuracy = v
                    .parse()
                    .ok()
                    .filter(|a: &f64| (0.0..=1.0).contains(a))
                    .ok_or(format!(
                        "--min-accuracy takes a fraction in [0, 1], not `{v}`"
                    ))?;
            }
            "--plot" => parsed.plot = value("--plot")?.into(),
            "--save" => parsed.save = value("--save")?.into(),
            "--data" => parsed.data = value("--data")?.into(),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if parsed.min_accuracy.is_nan() {
        parsed.min_accuracy = if parsed.epochs >= DEFAULT_EPOCHS {
            FULL_ACCURACY
        } else {
            LEARNED_ACCURACY
        };
    }
    Ok(parsed)
}

/// Why a run did not succeed, and its exit status.
enum Failure {
    /// Bad arguments or an unavailable backend: 2.
    Usage(String),
    /// Anything that went wrong while running: 1.
    Run(String),
}

impl From<conv_runtime::Error> for Failure {
    fn from(e: conv_runtime::Error) -> Self {
        Failure::Run(e.to_string())
    }
}

/// The one place a backend is chosen: everything below `run` is generic over the device.
/// Each backend this example can run gets its arm here (behind its cargo feature); the CUDA
/// one does not have its arm yet.
fn run_on_backend(args: &Args) -> Result<f64, Failure> {
    match args.backend {
        Backend::Cpu => {
            let mut device = Cpu::with_threads(args.threads)
                .map_err(|e| Failure::Run(format!("backend `cpu` could not start: {e}")))?;
            run(&mut device, args)
        }
        #[cfg(feature = "onednn")]
        Backend::OneDnn => {
            let mut device = conv_runtime::OneDnn::with_threads(args.threads)
                .map_err(|e| Failure::Run(format!("backend `onednn` could not start: {e}")))?;
            run(&mut device, args)
        }
        unavailable => Err(Failure::Usage(format!(
            "backend `{}` is not available in this build of train_digits (available: {})",
            unavailable.name(),
            if cfg!(feature = "onednn") {
                "cpu, onednn; cuda needs a build with the cuda backend"
            } else {
                "cpu; onednn needs `--features onednn`"
            }
        ))),
    }
}

/// Trains, reports, plots, saves and checks the reload; returns the test accuracy.
fn run(device: &mut impl NetDevice, args: &Args) -> Result<f64, Failure> {
    let all = load_digits(&args.data).map_err(Failure::Run)?;
    let (train_set, test_set) = split(&all);
    println!(
        "digits: {} training and {} test images of 8x8, {} classes; {} epochs of {} batches of {BATCH} on `{}`, {} thread{}",
        train_set.len(),
        test_set.len(),
        CLASSES,
        args.epochs,
        train_set.len() / BATCH,
        args.backend.name(),
        args.threads,
        if args.threads == 1 { "" } else { "s" }
    );
    let config = Config {
        epochs: args.epochs,
        seed: args.seed,
        progress: true,
    };
    let mut trained = train(device, &train_set, &test_set, &config)?;
    let accuracy = trained.model.test_accuracy(device, &test_set)?;
    let images_per_second = trained.images as f64 / trained.train_seconds;
    println!(
        "test accuracy {:.2}% ({} of {TEST}); training {:.2} s, {:.0} images/s",
        100.0 * accuracy,
        (accuracy * TEST as f64).round(),
        trained.train_seconds,
        images_per_second
    );

    for path in [&args.plot, &args.save] {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Failure::Run(format!("creating {}: {e}", dir.display())))?;
        }
    }
    plot(&args.plot, &trained.history)
        .map_err(|e| Failure::Run(format!("plotting to {}: {e}", args.plot.display())))?;
    println!("plot: {}", args.plot.display());

    // Save, load into a differently initialized network, and compare the test outputs.
    trained.model.save(&args.save)?;
    let mut reloaded = Model::new(&mut Rng::seed_from_u64(args.seed.wrapping_add(1)));
    reloaded.load(&args.save)?;
    let (a, b) = (
        trained.model.test_logits(device, &test_set)?,
        reloaded.test_logits(device, &test_set)?,
    );
    let identical = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .all(|(x, y)| x.to_bits() == y.to_bits());
    if !identical {
        return Err(Failure::Run(format!(
            "the model reloaded from {} computes different test outputs",
            args.save.display()
        )));
    }
    println!(
        "saved: {} (reloaded: identical test outputs)",
        args.save.display()
    );

    println!(
        "TRAIN_DIGITS_RESULT {{\"backend\":\"{}\",\"epochs\":{},\"seed\":{},\"test_accuracy\":{:.4},\"train_seconds\":{:.3},\"images_per_second\":{:.0},\"threads\":{},\"min_accuracy\":{},\"passed\":{}}}",
        args.backend.name(),
        args.epochs,
        args.seed,
        accuracy,
        trained.train_seconds,
        images_per_second,
        args.threads,
        args.min_accuracy,
        accuracy >= args.min_accuracy
    );
    Ok(accuracy)
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) if message.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("error: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run_on_backend(&args) {
        Ok(accuracy) if accuracy >= args.min_accuracy => ExitCode::SUCCESS,
        Ok(accuracy) => {
            eprintln!(
                "error: test accuracy {:.2}% is below the required {:.2}%: the network did not learn enough",
                100.0 * accuracy,
                100.0 * args.min_accuracy
            );
            ExitCode::FAILURE
        }
        Err(Failure::Usage(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Run(message)) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
