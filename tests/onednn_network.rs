//! Whole networks on the oneDNN device against the CPU device: a network of every kind in f32
//! through `evaluate` (at the training batch and at batch 1), `forward` and `backward_full` in
//! both modes must agree within f32 tolerance. Average pooling runs oneDNN's pooling primitives
//! (no fallback counted); max-pooling runs the generated code, one fallback per call, and equals
//! the CPU device's bits on inputs with ties, NaN and -inf, which oneDNN leaves undefined.
//!
//! Needs the `onednn` feature and `ONEDNN_LIB_DIR` (see README).
#![cfg(feature = "onednn")]

#[macro_use]
mod common;

use common::{assert_close, to_f64, SplitMix64};
use conv_runtime::prelude::*;

/// f32 tolerance between two implementations of the same math with different summation orders.
const TOLERANCE: f64 = 1e-4;

conv_runtime::network! {
    /// Every kind of entry; both poolings pad, and their windows overlap.
    pub struct Mixed {
        input: [11, 11, 3],
        batch: 3,
        layers: [
            c1: Conv2d { out_channels: 8, kernel: 3, padding: 1, activation: Relu },
            p1: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
            r1: Residual {
                layers: [
                    c2: Conv2d {
                        out_channels: 8, kernel: 3, padding: 1, activation: Tanh,
                        norm: BatchNorm { momentum: 0.2, eps: 1e-3 },
                    },
                    a: Activation(Gelu),
                ],
            },
            p2: AvgPool2d { kernel: 3, stride: 2, padding: 1 },
            flat: Flatten,
            fc: Dense { out_features: 10, activation: Relu },
            q: Dense { out_features: 4 },
        ],
    }
}

conv_runtime::network! {
    /// Average pooling only (padded, overlapping, and a window that does not reach the last
    /// input row): nothing on oneDNN falls back.
    pub struct AvgOnly {
        input: [10, 10, 5],
        batch: 2,
        layers: [
            c: Conv2d { out_channels: 6, kernel: 3, activation: Relu },
            p: AvgPool2d { kernel: 3, stride: 2, padding: 1 },
            p2: AvgPool2d { kernel: 2 },
            flat: Flatten,
            q: Dense { out_features: 3 },
        ],
    }
}

/// Every result of one network on one device: `evaluate` at the training batch and at batch
/// 1, then per mode the forward's output, the input gradient and every parameter gradient.
macro_rules! run_all {
    ($net:ident, $input:ident, $output:ident, $state:ident, $grads:ident, $batch:literal, $device:expr) => {{
        {
            let device = $device;
            let mut rng = SplitMix64::new(3);
            let mut values = |n: usize| rng.values(n).into_iter().map(|v| v as f32).collect();
            let x = $input::<$batch>::from_vec(values($input::<$batch>::LEN)).unwrap();
            let dy = $output::<$batch>::from_vec(values($output::<$batch>::LEN)).unwrap();
            let net = $net::new(&mut Rng::seed_from_u64(9));
            let mut all = Vec::new();
            let mut y = $output::<$batch>::zeros();
            net.evaluate(device, &x, &mut y).unwrap();
            all.push(("evaluate".to_string(), y.as_slice().to_vec()));
            let x1 = $input::<1>::from_fn(|i| x.as_slice()[i]);
            let mut y1 = $output::<1>::zeros();
            net.evaluate(device, &x1, &mut y1).unwrap();
            all.push(("evaluate at batch 1".to_string(), y1.as_slice().to_vec()));
            for mode in [Mode::Train, Mode::Eval] {
                let mut net = net.clone();
                let mut state = $state::new();
                net.forward(device, &x, &mut state, mode).unwrap();
                all.push((
                    format!("{mode:?} forward"),
                    state.output().as_slice().to_vec(),
                ));
                let (mut grads, mut dx) = ($grads::zeros(), $input::<$batch>::zeros());
                net.backward_full(device, &state, &x, &dy, &mut dx, &mut grads, mode)
                    .unwrap();
                all.push((format!("{mode:?} input gradient"), dx.as_slice().to_vec()));
                net.clone().visit_mut(&grads, &mut |name, _, g| {
                    all.push((format!("{mode:?} gradient of {name}"), g.to_vec()))
                });
            }
            all
        }
    }};
}

fn same(cpu: &[(String, Vec<f32>)], onednn: &[(String, Vec<f32>)]) {
    assert_eq!(cpu.len(), onednn.len());
    for ((what, a), (_, b)) in cpu.iter().zip(onednn) {
        assert_close(what, &to_f64(b), &to_f64(a), TOLERANCE);
    }
}

#[test]
fn every_kind_agrees_with_the_cpu_device() {
    macro_rules! run {
        ($device:expr) => {
            run_all!(
                Mixed,
                MixedInput,
                MixedOutput,
                MixedState,
                MixedGrads,
                3,
                $device
            )
        };
    }
    let cpu: Vec<(String, Vec<f32>)> = run!(&mut Cpu::default());
    for threads in [1, 2] {
        let mut onednn = OneDnn::with_threads(threads).unwrap();
        same(&cpu, &run!(&mut onednn));
        // Max-pooling's calls: two evaluates, two forwards, two backwards.
        assert_eq!(onednn.fallbacks(), 6, "{threads} thread(s)");
    }
}

#[test]
fn average_pooling_runs_in_onednn() {
    macro_rules! run {
        ($device:expr) => {
            run_all!(
                AvgOnly,
                AvgOnlyInput,
                AvgOnlyOutput,
                AvgOnlyState,
                AvgOnlyGrads,
                2,
                $device
            )
        };
    }
    let cpu: Vec<(String, Vec<f32>)> = run!(&mut Cpu::default());
    let mut onednn = OneDnn::new().unwrap();
    same(&cpu, &run!(&mut onednn));
    assert_eq!(onednn.fallbacks(), 0, "an f32 entry ran generated code");
}

conv_runtime::network! {
    /// Max-pooling alone, f32.
    pub struct MaxOnly {
        input: [4, 4, 2],
        batch: 1,
        layers: [p: MaxPool2d { kernel: 2, stride: 1, padding: 1 }],
    }
}

/// The generated max-pooling on oneDNN: NaN propagates and ties go to the first maximum, the
/// CPU device's bits, where oneDNN's own pooling leaves NaN undefined.
#[test]
fn max_pooling_keeps_the_cpu_semantics() {
    let mut x = MaxOnlyInput::<1>::from_fn(|i| [1.0, 1.0, -2.0, 0.5][i % 4]);
    x.as_mut_slice()[5] = f32::NAN;
    x.as_mut_slice()[12] = f32::NEG_INFINITY;
    let net = MaxOnly::new(&mut Rng::seed_from_u64(1));
    let (mut y_cpu, mut y_dnn) = (MaxOnlyOutput::<1>::zeros(), MaxOnlyOutput::<1>::zeros());
    net.evaluate(&mut Cpu::default(), &x, &mut y_cpu).unwrap();
    let mut onednn = OneDnn::new().unwrap();
    net.evaluate(&mut onednn, &x, &mut y_dnn).unwrap();
    assert!(y_cpu.as_slice().iter().any(|v| v.is_nan()));
    let bits = |t: &MaxOnlyOutput<1>| t.as_slice().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&y_cpu), bits(&y_dnn));
    assert_eq!(onednn.fallbacks(), 1);
}

/// Why max-pooling stays generated code: oneDNN's own max-pooling (3.2, its AVX2 kernel here)
/// drops NaN, and an all-NaN window gives -FLT_MAX, where PyTorch and the generated code give
/// NaN. Should this fail, oneDNN propagates NaN now, and max-pooling could run in oneDNN.
#[test]
fn onednn_max_pooling_drops_nan() {
    use conv_runtime::onednn::{
        arg, pool_forward, Attr, DataType, Engine, FormatTag, Library, Memory, MemoryDesc, Pooling,
        Primitive, Prop, Stream,
    };
    let lib = Library::load().unwrap();
    let engine = Engine::cpu(&lib).unwrap();
    let stream = Stream::new(&engine).unwrap();
    let md = |dims: &[i64]| MemoryDesc::new(&lib, dims, DataType::F32, FormatTag::NHWC).unwrap();
    let (src, dst) = (md(&[1, 4, 2, 2]), md(&[1, 4, 1, 1]));
    let attr = Attr::new(&lib).unwrap();
    let (p0, k) = ([0, 0], [2, 2]);
    let pd = pool_forward(
        &engine,
        Prop::ForwardInference,
        Pooling::Max,
        &src,
        &dst,
        k,
        k,
        p0,
        p0,
        &attr,
    )
    .unwrap();
    // Four channels' 2x2 windows: NaN first, NaN last, all NaN, no NaN.
    let n = f32::NAN;
    let windows = [
        [n, 1.0, 2.0, 3.0],
        [1.0, 2.0, 3.0, n],
        [n; 4],
        [5.0, 1.0, 1.0, 1.0],
    ];
    let x: Vec<f32> = (0..16).map(|i| windows[i % 4][i / 4]).collect();
    let (mut x_mem, y_mem) = (
        Memory::allocate(&engine, &src).unwrap(),
        Memory::allocate(&engine, &dst).unwrap(),
    );
    x_mem.write(&x).unwrap();
    Primitive::new(&pd)
        .unwrap()
        .execute(&stream, &[(arg::SRC, &x_mem), (arg::DST, &y_mem)])
        .unwrap();
    stream.wait().unwrap();
    assert_eq!(y_mem.to_vec::<f32>().unwrap(), [3.0, 3.0, f32::MIN, 5.0]);
}
