//! `network!` against an independent float64 reference: a network mixing every kind (conv with
//! and without BatchNorm, max and average pooling with padding and overlapping windows, a
//! residual block, an activation entry, `Flatten`, two `Dense` layers), through `evaluate`,
//! `forward` and `backward_full` in both modes, every output, gradient and running statistic;
//! the reference is this file's own loops plus the layer reference of tests/common. Also: the
//! contract of API.md (names, shapes, constants, accumulation, `backward` == `backward_full`'s
//! parameter part), the same bits on any number of threads, and one Adam step on the whole
//! network. Last, a dense layer wider and taller than the gradient kernels' 64-term masks, with
//! inputs and output gradients mostly zero in some rows and channels (the terms the gradient
//! kernels skip) and dense in others.

#[macro_use]
mod common;

use common::{assert_close, Activation, Norm, Params, Spec, SplitMix64};
use conv_runtime::prelude::*;

conv_runtime::network! {
    /// Every kind of entry, in f64 for a tight comparison.
    pub struct Mixed {
        input: [9, 9, 3],
        batch: 2,
        dtype: f64,
        layers: [
            c1: Conv2d { out_channels: 4, kernel: 3, padding: 1, activation: Tanh },
            p1: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
            r1: Residual {
                layers: [
                    c2: Conv2d {
                        out_channels: 4, kernel: 3, padding: 1, activation: Relu,
                        norm: BatchNorm { momentum: 0.2, eps: 1e-3 },
                    },
                    a: Activation(Gelu),
                ],
            },
            p2: AvgPool2d { kernel: 2, stride: 1 },
            flat: Flatten,
            fc: Dense { out_features: 5, activation: Sigmoid },
            q: Dense { out_features: 3 },
        ],
    }
}

/// The layer reference's spec of a conv entry.
fn conv(
    input: [usize; 3],
    oc: usize,
    kernel: usize,
    padding: usize,
    activation: Activation,
    norm: Norm,
) -> Spec {
    Spec {
        input,
        out_channels: oc,
        kernel: [kernel, kernel],
        stride: [1, 1],
        padding: [padding, padding],
        activation,
        norm,
        batch: 2,
    }
}

fn dense(features: usize, out: usize, activation: Activation) -> Spec {
    conv([1, 1, features], out, 1, 0, activation, Norm::None)
}

/// A layer's parameters, by the network's names.
fn params<N: Parameters<Elem = f64> + Clone>(net: &N, entry: &str) -> Params {
    let mut p = Params::default();
    net.visit(&mut |name, v| {
        let v: Vec<f64> = v.to_vec();
        match name.strip_prefix(entry).and_then(|n| n.strip_prefix('.')) {
            Some("weights") => p.weights = v,
            Some("biases") => p.biases = v,
            Some("gamma") => p.gamma = v,
            Some("beta") => p.beta = v,
            _ => {}
        }
    });
    let mut copy = net.clone();
    copy.visit_buffers_mut(&mut |name, b| {
        let v: Vec<f64> = b.values().to_vec();
        match name.strip_prefix(entry).and_then(|n| n.strip_prefix('.')) {
            Some("running_mean") => p.running_mean = v,
            Some("running_var") => p.running_var = v,
            _ => {}
        }
    });
    p
}

/// Pooling of `[batch, h, w, c]`, `max` or average (divisor the window's area); the winners'
/// indices for max.
fn pool(
    x: &[f64],
    [h, w, c]: [usize; 3],
    k: usize,
    s: usize,
    p: usize,
    max: bool,
) -> (Vec<f64>, Vec<usize>) {
    let batch = x.len() / (h * w * c);
    let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
    let mut y = vec![0.0; batch * oh * ow * c];
    let mut win = vec![0; y.len()];
    for b in 0..batch {
        for i in 0..oh {
            for j in 0..ow {
                for ch in 0..c {
                    let (mut best, mut at, mut sum) = (f64::NEG_INFINITY, 0, 0.0);
                    for di in 0..k {
                        for dj in 0..k {
                            let (r, q) = (
                                (i * s + di) as isize - p as isize,
                                (j * s + dj) as isize - p as isize,
                            );
                            if r < 0 || q < 0 || r >= h as isize || q >= w as isize {
                                continue;
                            }
                            let idx = ((b * h + r as usize) * w + q as usize) * c + ch;
                            sum += x[idx];
                            if x[idx] > best {
                                best = x[idx];
                                at = idx;
                            }
                        }
                    }
                    let o = ((b * oh + i) * ow + j) * c + ch;
                    y[o] = if max { best } else { sum / (k * k) as f64 };
                    win[o] = at;
                }
            }
        }
    }
    (y, win)
}

/// The gradient of `pool` at its input.
#[allow(clippy::too_many_arguments)] // a reference mirrors `pool`'s parameters
fn pool_backward(
    dy: &[f64],
    win: &[usize],
    [h, w, c]: [usize; 3],
    k: usize,
    s: usize,
    p: usize,
    max: bool,
    batch: usize,
) -> Vec<f64> {
    let mut dx = vec![0.0; batch * h * w * c];
    let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
    for b in 0..batch {
        for i in 0..oh {
            for j in 0..ow {
                for ch in 0..c {
                    let o = ((b * oh + i) * ow + j) * c + ch;
                    if max {
                        dx[win[o]] += dy[o];
                        continue;
                    }
                    for di in 0..k {
                        for dj in 0..k {
                            let (r, q) = (
                                (i * s + di) as isize - p as isize,
                                (j * s + dj) as isize - p as isize,
                            );
                            if r >= 0 && q >= 0 && r < h as isize && q < w as isize {
                                dx[((b * h + r as usize) * w + q as usize) * c + ch] +=
                                    dy[o] / (k * k) as f64;
                            }
                        }
                    }
                }
            }
        }
    }
    dx
}

/// Everything the reference computes for one pass.
struct Reference {
    output: Vec<f64>,
    d_input: Vec<f64>,
    /// `(name, gradient)` in `Parameters` order.
    grads: Vec<(String, Vec<f64>)>,
    /// c2's running statistics after the pass.
    running: (Vec<f64>, Vec<f64>),
}

fn reference(net: &Mixed, x: &[f64], dy: &[f64], train: bool) -> Reference {
    let bn = Norm::Batch {
        momentum: 0.2,
        eps: 1e-3,
    };
    let s1 = conv([9, 9, 3], 4, 3, 1, Activation::Tanh, Norm::None);
    let s2 = conv([5, 5, 4], 4, 3, 1, Activation::Relu, bn);
    let s_fc = dense(64, 5, Activation::Sigmoid);
    let s_q = dense(5, 3, Activation::Identity);
    let (p1, p2, pfc, pq) = (
        params(net, "c1"),
        params(net, "r1.c2"),
        params(net, "fc"),
        params(net, "q"),
    );
    // Forward.
    let f1 = common::forward(&s1, &p1, x, train);
    let (y1, win) = pool(&f1.output, [9, 9, 4], 3, 2, 1, true);
    let f2 = common::forward(&s2, &p2, &y1, train);
    let ya: Vec<f64> = f2
        .output
        .iter()
        .map(|&v| Activation::Gelu.apply(v))
        .collect();
    let r: Vec<f64> = y1.iter().zip(&ya).map(|(a, b)| a + b).collect();
    let (y2, _) = pool(&r, [5, 5, 4], 2, 1, 0, false);
    let ffc = common::forward(&s_fc, &pfc, &y2, train);
    let fq = common::forward(&s_q, &pq, &ffc.output, train);
    // Backward.
    let gq = common::backward(&s_q, &pq, &ffc.output, &fq, dy, train);
    let gfc = common::backward(&s_fc, &pfc, &y2, &ffc, &gq.d_input, train);
    let dr = pool_backward(&gfc.d_input, &[], [5, 5, 4], 2, 1, 0, false, 2);
    let dya: Vec<f64> = dr
        .iter()
        .zip(&f2.output)
        .map(|(d, &v)| d * Activation::Gelu.derivative(v))
        .collect();
    let g2 = common::backward(&s2, &p2, &y1, &f2, &dya, train);
    let dy1: Vec<f64> = dr.iter().zip(&g2.d_input).map(|(a, b)| a + b).collect();
    let dc1 = pool_backward(&dy1, &win, [9, 9, 4], 3, 2, 1, true, 2);
    let g1 = common::backward(&s1, &p1, x, &f1, &dc1, train);
    let grads = vec![
        ("c1.weights".to_string(), g1.d_weights),
        ("c1.biases".to_string(), g1.d_biases),
        ("r1.c2.weights".to_string(), g2.d_weights),
        ("r1.c2.biases".to_string(), g2.d_biases),
        ("r1.c2.gamma".to_string(), g2.d_gamma),
        ("r1.c2.beta".to_string(), g2.d_beta),
        ("fc.weights".to_string(), gfc.d_weights),
        ("fc.biases".to_string(), gfc.d_biases),
        ("q.weights".to_string(), gq.d_weights),
        ("q.biases".to_string(), gq.d_biases),
    ];
    Reference {
        output: fq.output,
        d_input: g1.d_input,
        grads,
        running: (f2.running_mean, f2.running_var),
    }
}

fn data() -> (MixedInput<2>, MixedOutput<2>) {
    let mut rng = SplitMix64::new(17);
    let x = MixedInput::<2>::from_vec(rng.values(MixedInput::<2>::LEN)).unwrap();
    let dy = MixedOutput::<2>::from_vec(rng.values(MixedOutput::<2>::LEN)).unwrap();
    (x, dy)
}

/// `(name, gradient)` of every parameter, in visiting order.
fn gradients<N: Parameters<Elem = f64> + Clone>(
    net: &N,
    grads: &N::Grads,
) -> Vec<(String, Vec<f64>)> {
    let mut all = Vec::new();
    net.clone().visit_mut(grads, &mut |name, _, g| {
        all.push((name.to_string(), g.to_vec()))
    });
    all
}

#[test]
fn every_operation_matches_the_reference() {
    let (x, dy) = data();
    for mode in [Mode::Train, Mode::Eval] {
        let train = mode == Mode::Train;
        let mut net = Mixed::new(&mut Rng::seed_from_u64(3));
        // Running statistics away from their initial values, so that Eval uses something.
        net.r1.c2.running_mean = Vector::from_fn(|i| 0.1 * i as f64 - 0.1);
        net.r1.c2.running_var = Vector::from_fn(|i| 0.5 + 0.25 * i as f64);
        let expected = reference(&net, x.as_slice(), dy.as_slice(), train);
        let mut cpu = common::cpu();
        let mut state = MixedState::new();
        let before = net.clone();
        net.forward(&mut cpu, &x, &mut state, mode).unwrap();
        assert_close("forward", state.output().as_slice(), &expected.output, 1e-9);
        let running = (
            net.r1.c2.running_mean.as_slice().to_vec(),
            net.r1.c2.running_var.as_slice().to_vec(),
        );
        if train {
            assert_close("running mean", &running.0, &expected.running.0, 1e-9);
            assert_close("running var", &running.1, &expected.running.1, 1e-9);
        } else {
            assert_eq!(
                running.0,
                before.r1.c2.running_mean.as_slice(),
                "Eval changed the running mean"
            );
        }
        let mut grads = MixedGrads::zeros();
        let mut d_input = MixedInput::<2>::zeros();
        net.backward_full(&mut cpu, &state, &x, &dy, &mut d_input, &mut grads, mode)
            .unwrap();
        assert_close("d_input", d_input.as_slice(), &expected.d_input, 1e-9);
        let got = gradients(&net, &grads);
        assert_eq!(
            got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            expected
                .grads
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>(),
        );
        for ((name, g), (_, e)) in got.iter().zip(&expected.grads) {
            // BatchNorm in training mode: the bias gradient is zero up to rounding.
            let tolerance = if train && name == "r1.c2.biases" {
                1e-8
            } else {
                1e-9
            };
            assert_close(name, g, e, tolerance);
        }
        // `backward` adds the same parameter gradients.
        net.backward(&mut cpu, &state, &x, &dy, &mut grads, mode)
            .unwrap();
        for ((name, g), (_, e)) in gradients(&net, &grads).iter().zip(&got) {
            let doubled: Vec<f64> = e.iter().map(|v| 2.0 * v).collect();
            assert_close(&format!("{name} accumulated"), g, &doubled, 1e-12);
        }
    }
}

conv_runtime::network! {
    /// Two residual blocks of the same layers: the second block's layers are compiled once,
    /// as the first's, and keep their own parameters.
    pub struct Twins {
        input: [6, 6, 3],
        batch: 2,
        dtype: f64,
        layers: [
            c0: Conv2d { out_channels: 4, kernel: 3, padding: 1, activation: Relu },
            r1: Residual { layers: [
                c1: Conv2d { out_channels: 4, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 4, kernel: 3, padding: 1 },
            ] },
            r2: Residual { layers: [
                c1: Conv2d { out_channels: 4, kernel: 3, padding: 1, activation: Relu },
                c2: Conv2d { out_channels: 4, kernel: 3, padding: 1 },
            ] },
            flat: Flatten,
            q: Dense { out_features: 3 },
        ],
    }
}

conv_runtime::network! {
    /// Max-pooling alone (padded, overlapping windows; 17 channels: a whole chunk of the
    /// kernel's 16 and one more), for PyTorch's rules on ties, NaN and all -inf windows.
    pub struct PoolOnly {
        input: [5, 5, 17],
        batch: 2,
        layers: [p: MaxPool2d { kernel: 3, stride: 2, padding: 1 }],
    }
}

#[test]
fn max_pooling_follows_pytorch_on_ties_nan_and_negative_infinity() {
    let ([h, w, c], (k, s, p), batch) = ([5, 5, 17], (3, 2, 1), 2);
    let (oh, ow) = (3, 3);
    let mut x = PoolOnlyInput::<2>::zeros();
    common::pooling_edge_values(x.as_mut_slice(), h * w * c, c);
    // PyTorch's rule (`val > maxval || isnan(val)`): the window's positions inside the image
    // in row-major order, the first one the candidate, a later one taking over when greater or
    // NaN (so the last NaN wins).
    let xs = x.as_slice();
    let mut expected = vec![0.0f32; batch * oh * ow * c];
    let mut winner = vec![0usize; expected.len()];
    for b in 0..batch {
        for (i, j, ch) in map_positions(oh, ow, c) {
            let mut at = None::<usize>;
            for di in 0..k {
                for dj in 0..k {
                    let (r, q) = ((i * s + di) as isize - p, (j * s + dj) as isize - p);
                    if r < 0 || q < 0 || r >= h as isize || q >= w as isize {
                        continue;
                    }
                    let idx = ((b * h + r as usize) * w + q as usize) * c + ch;
                    at = match at {
                        Some(a) if !(xs[idx] > xs[a] || xs[idx].is_nan()) => Some(a),
                        _ => Some(idx),
                    };
                }
            }
            let o = ((b * oh + i) * ow + j) * c + ch;
            let at = at.unwrap();
            expected[o] = xs[at];
            winner[o] = at;
        }
    }
    let same = |what: &str, got: &[f32]| {
        for (o, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(
                g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()),
                "{what}: output {o} is {g}, expected {e}"
            );
        }
    };
    let mut net = PoolOnly::new(&mut Rng::seed_from_u64(1));
    let mut cpu = common::cpu();
    let mut y = PoolOnlyOutput::<2>::zeros();
    net.evaluate(&mut cpu, &x, &mut y).unwrap();
    same("evaluate", y.as_slice());
    let mut state = PoolOnlyState::new();
    net.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
    same("forward", state.output().as_slice());
    // Each output's gradient goes to its winner: distinct integers, so the sums are exact.
    let mut dy = PoolOnlyOutput::<2>::zeros();
    for (o, v) in dy.as_mut_slice().iter_mut().enumerate() {
        *v = (o + 1) as f32;
    }
    let mut dx_expected = vec![0.0f32; xs.len()];
    for (o, &at) in winner.iter().enumerate() {
        dx_expected[at] += dy.as_slice()[o];
    }
    let mut grads = PoolOnlyGrads::zeros();
    let mut dx = PoolOnlyInput::<2>::zeros();
    net.backward_full(&mut cpu, &state, &x, &dy, &mut dx, &mut grads, Mode::Train)
        .unwrap();
    for (i, (g, e)) in dx.as_slice().iter().zip(&dx_expected).enumerate() {
        assert_eq!(g.to_bits(), e.to_bits(), "d_input {i} is {g}, expected {e}");
    }
}

conv_runtime::network! {
    /// Max-pooling whose input gradient is a map of 4 MiB, twice `conv_runtime`'s
    /// `STREAM_BYTES`: the backward pass writes it with streaming stores where the CPU has
    /// AVX-512.
    pub struct PoolLarge {
        input: [64, 64, 16],
        batch: 16,
        layers: [p: MaxPool2d { kernel: 3, stride: 2, padding: 1 }],
    }
}

#[test]
fn max_pooling_of_a_large_map_routes_every_gradient_to_its_winner() {
    let ([h, w, c], batch) = ([64, 64, 16], 16);
    assert!(batch * h * w * c * 4 >= 2 * conv_runtime::simd::STREAM_BYTES);
    if !conv_runtime::simd::avx512() {
        eprintln!("no AVX-512 (or CONV2D_SIMD): the gradient is written without streaming stores");
    }
    // Quantized values: ties in most windows.
    let mut rng = SplitMix64::new(17);
    let x = PoolLargeInput::<16>::from_fn(|_| (rng.next_f64() * 8.0).floor() as f32 - 4.0);
    let dy = PoolLargeOutput::<16>::from_fn(|_| rng.next_f64() as f32 - 0.5);
    let xs: Vec<f64> = x.as_slice().iter().map(|v| f64::from(*v)).collect();
    let (_, winner) = pool(&xs, [h, w, c], 3, 2, 1, true);
    // Each input sums the gradients of the outputs it won, in output order, in f32.
    let mut expected = vec![0.0f32; batch * h * w * c];
    for (o, &at) in winner.iter().enumerate() {
        expected[at] += dy.as_slice()[o];
    }
    let net = PoolLarge::new(&mut Rng::seed_from_u64(1));
    for threads in [1, 2, 3] {
        let mut cpu = Cpu::with_threads(threads).unwrap().__split_everything();
        let mut state = PoolLargeState::new();
        let mut net = net.clone();
        net.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
        let (mut grads, mut dx) = (PoolLargeGrads::zeros(), PoolLargeInput::<16>::zeros());
        net.backward_full(&mut cpu, &state, &x, &dy, &mut dx, &mut grads, Mode::Train)
            .unwrap();
        let wrong = dx
            .as_slice()
            .iter()
            .zip(&expected)
            .position(|(g, e)| g.to_bits() != e.to_bits());
        assert_eq!(
            wrong, None,
            "{threads} threads: the first wrong input gradient"
        );
    }
}

/// `(i, j, ch)` over an `oh x ow x c` map, row-major.
fn map_positions(oh: usize, ow: usize, c: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..oh).flat_map(move |i| (0..ow).flat_map(move |j| (0..c).map(move |ch| (i, j, ch))))
}

#[test]
fn repeated_layers_keep_their_own_parameters() {
    let mut rng = SplitMix64::new(23);
    let x = TwinsInput::<2>::from_vec(rng.values(TwinsInput::<2>::LEN)).unwrap();
    let dy = TwinsOutput::<2>::from_vec(rng.values(TwinsOutput::<2>::LEN)).unwrap();
    let mut net = Twins::new(&mut Rng::seed_from_u64(5));
    let (r1c1, r2c1) = (params(&net, "r1.c1"), params(&net, "r2.c1"));
    assert_ne!(
        r1c1.weights, r2c1.weights,
        "the twins were initialized alike"
    );
    // The reference: each layer with its own parameters.
    let s0 = conv([6, 6, 3], 4, 3, 1, Activation::Relu, Norm::None);
    let s1 = conv([6, 6, 4], 4, 3, 1, Activation::Relu, Norm::None);
    let s2 = conv([6, 6, 4], 4, 3, 1, Activation::Identity, Norm::None);
    let sq = dense(144, 3, Activation::Identity);
    let f0 = common::forward(&s0, &params(&net, "c0"), x.as_slice(), true);
    let mut h = vec![f0.output.clone()];
    let mut blocks = Vec::new();
    for block in ["r1", "r2"] {
        let (p1, p2) = (
            params(&net, &format!("{block}.c1")),
            params(&net, &format!("{block}.c2")),
        );
        let input = h[h.len() - 1].clone();
        let f1 = common::forward(&s1, &p1, &input, true);
        let f2 = common::forward(&s2, &p2, &f1.output, true);
        h.push(input.iter().zip(&f2.output).map(|(a, b)| a + b).collect());
        blocks.push((block, p1, p2, input, f1, f2));
    }
    let pq = params(&net, "q");
    let fq = common::forward(&sq, &pq, &h[2], true);
    let gq = common::backward(&sq, &pq, &h[2], &fq, dy.as_slice(), true);
    let mut expected = vec![
        ("q.biases".to_string(), gq.d_biases),
        ("q.weights".to_string(), gq.d_weights),
    ];
    let mut d = gq.d_input;
    for (block, p1, p2, input, f1, f2) in blocks.iter().rev() {
        let g2 = common::backward(&s2, p2, &f1.output, f2, &d, true);
        let g1 = common::backward(&s1, p1, input, f1, &g2.d_input, true);
        d = d.iter().zip(&g1.d_input).map(|(a, b)| a + b).collect();
        for (layer, g) in [("c2", g2), ("c1", g1)] {
            expected.push((format!("{block}.{layer}.biases"), g.d_biases));
            expected.push((format!("{block}.{layer}.weights"), g.d_weights));
        }
    }
    let g0 = common::backward(&s0, &params(&net, "c0"), x.as_slice(), &f0, &d, true);
    expected.push(("c0.biases".to_string(), g0.d_biases));
    expected.push(("c0.weights".to_string(), g0.d_weights));

    let mut cpu = common::cpu();
    let mut state = TwinsState::new();
    net.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
    assert_close("forward", state.output().as_slice(), &fq.output, 1e-9);
    let mut y = TwinsOutput::<2>::zeros();
    net.evaluate(&mut cpu, &x, &mut y).unwrap();
    assert_close("evaluate", y.as_slice(), &fq.output, 1e-9);
    let (mut grads, mut d_input) = (TwinsGrads::zeros(), TwinsInput::<2>::zeros());
    net.backward_full(
        &mut cpu,
        &state,
        &x,
        &dy,
        &mut d_input,
        &mut grads,
        Mode::Train,
    )
    .unwrap();
    assert_close("d_input", d_input.as_slice(), &g0.d_input, 1e-9);
    let got = gradients(&net, &grads);
    assert_eq!(got.len(), expected.len());
    for (name, g) in &got {
        let e = expected.iter().find(|(n, _)| n == name);
        let e = e.unwrap_or_else(|| panic!("no reference gradient for {name}"));
        assert_close(name, g, &e.1, 1e-9);
    }
}

#[test]
fn evaluate_is_the_eval_forward_at_any_batch() {
    let (x, _) = data();
    let mut net = Mixed::new(&mut Rng::seed_from_u64(4));
    net.r1.c2.running_var = Vector::from_fn(|i| 0.5 + 0.25 * i as f64);
    let expected = reference(&net, x.as_slice(), &[0.0; MixedOutput::<2>::LEN], false);
    let mut cpu = common::cpu();
    let mut y = MixedOutput::<2>::zeros();
    net.evaluate(&mut cpu, &x, &mut y).unwrap();
    assert_close("evaluate", y.as_slice(), &expected.output, 1e-9);
    // One sample at a time: the same rows.
    let x1 = MixedInput::<1>::from_vec(x.as_slice()[243..].to_vec()).unwrap();
    let mut y1 = MixedOutput::<1>::zeros();
    net.evaluate(&mut cpu, &x1, &mut y1).unwrap();
    assert_close(
        "evaluate, batch 1",
        y1.as_slice(),
        &expected.output[3..],
        1e-9,
    );
}

#[test]
fn the_contract_of_api_md() {
    assert_eq!(
        (
            Mixed::INPUT_HEIGHT,
            Mixed::INPUT_WIDTH,
            Mixed::INPUT_CHANNELS
        ),
        (9, 9, 3)
    );
    assert_eq!((Mixed::OUTPUT_FEATURES, Mixed::BATCH_SIZE), (3, 2));
    let net = Mixed::new(&mut Rng::seed_from_u64(1));
    assert_eq!(Mixed::PARAMETER_COUNT, net.parameter_count());
    // Dense weights are [out, in] as PyTorch's, the conv weights OHWI.
    let mut shapes = Vec::new();
    net.clone()
        .visit_params_mut(&mut |name, t| shapes.push((name.to_string(), t.shape().to_vec())));
    assert_eq!(
        shapes,
        [
            ("c1.weights", vec![4, 3, 3, 3]),
            ("c1.biases", vec![4]),
            ("r1.c2.weights", vec![4, 3, 3, 4]),
            ("r1.c2.biases", vec![4]),
            ("r1.c2.gamma", vec![4]),
            ("r1.c2.beta", vec![4]),
            ("fc.weights", vec![5, 64]),
            ("fc.biases", vec![5]),
            ("q.weights", vec![3, 5]),
            ("q.biases", vec![3]),
        ]
        .map(|(n, s)| (n.to_string(), s))
    );
    let mut buffers = Vec::new();
    net.clone()
        .visit_buffers_mut(&mut |name, _| buffers.push(name.to_string()));
    assert_eq!(buffers, ["r1.c2.running_mean", "r1.c2.running_var"]);
}

#[test]
fn the_same_bits_on_any_number_of_threads() {
    let (x, dy) = data();
    let run = |cpu: &mut Cpu| {
        let mut net = Mixed::new(&mut Rng::seed_from_u64(5));
        let mut state = MixedState::new();
        net.forward(cpu, &x, &mut state, Mode::Train).unwrap();
        let (mut grads, mut d_input) = (MixedGrads::zeros(), MixedInput::<2>::zeros());
        net.backward_full(cpu, &state, &x, &dy, &mut d_input, &mut grads, Mode::Train)
            .unwrap();
        let mut y = MixedOutput::<2>::zeros();
        net.evaluate(cpu, &x, &mut y).unwrap();
        let mut all = vec![
            state.output().as_slice().to_vec(),
            d_input.as_slice().to_vec(),
            y.as_slice().to_vec(),
        ];
        all.extend(gradients(&net, &grads).into_iter().map(|(_, g)| g));
        all
    };
    let one = run(&mut Cpu::default());
    for threads in [2, 3, 7] {
        let mut cpu = Cpu::with_threads(threads).unwrap().__split_everything();
        let many = run(&mut cpu);
        for (a, b) in one.iter().zip(&many) {
            assert!(
                a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{threads} threads"
            );
        }
    }
}

conv_runtime::conv2d! {
    /// A half-precision layer: its optimizers keep f32 master copies.
    pub struct HalfConv { input: [5, 5, 8], out_channels: 16, kernel: 3, batch: 2, dtype: bf16 }
}

/// Three steps of each optimizer (momentum, Nesterov, weight decay, centered RMSprop) with
/// `step` and with `step_on` a device of 1 to 7 threads splitting every tensor: the same bits.
macro_rules! same_steps_on_threads {
    ($net:expr, $grads:expr, $lr:expr) => {{
        let (net, grads) = ($net, $grads);
        let bits = |n: &_| {
            let mut all = Vec::new();
            Parameters::visit(n, &mut |_, v| all.extend(common::to_f64(v)));
            all.iter().map(|v| v.to_bits()).collect::<Vec<u64>>()
        };
        for threads in [1, 2, 3, 7] {
            let device = Cpu::with_threads(threads).unwrap().__split_everything();
            let mut sgd = (
                Sgd::new($lr).with_momentum($lr),
                Sgd::new($lr).with_momentum($lr),
            );
            sgd.0.nesterov = true;
            sgd.1.nesterov = true;
            let mut adam = (
                Adam::new($lr).with_weight_decay($lr),
                Adam::new($lr).with_weight_decay($lr),
            );
            let rmsprop = || RmsProp::new($lr).with_centered(true).with_momentum($lr);
            let mut rmsprop = (rmsprop(), rmsprop());
            let (mut a, mut b) = (net.clone(), net.clone());
            for step in 0..3 {
                sgd.0.step(&mut a, grads);
                sgd.1.step_on(&device, &mut b, grads);
                adam.0.step(&mut a, grads);
                adam.1.step_on(&device, &mut b, grads);
                rmsprop.0.step(&mut a, grads);
                rmsprop.1.step_on(&device, &mut b, grads);
                assert_ne!(bits(&a), bits(net), "step {step} changed nothing");
                assert!(
                    bits(&a) == bits(&b),
                    "step {step} on {threads} threads: other bits than on the calling thread"
                );
            }
        }
    }};
}

#[test]
fn optimizers_step_the_same_bits_on_any_number_of_threads() {
    let (x, dy) = data();
    let mut net = Mixed::new(&mut Rng::seed_from_u64(3));
    let mut cpu = common::cpu();
    let mut state = MixedState::new();
    net.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
    let mut grads = MixedGrads::zeros();
    net.backward(&mut cpu, &state, &x, &dy, &mut grads, Mode::Train)
        .unwrap();
    same_steps_on_threads!(&net, &grads, 0.01);

    // Half precision: the master copies are updated in parts too.
    let mut rng = SplitMix64::new(31);
    let layer = HalfConv::new(&mut Rng::seed_from_u64(4));
    let mut grads = HalfConvGrads::zeros();
    let n = grads.weights.as_slice().len();
    grads.weights = Tensor::from_vec(common::convert(&rng.values(n))).unwrap();
    grads.biases = Vector::from_vec(common::convert(&rng.values(16))).unwrap();
    same_steps_on_threads!(&layer, &grads, 0.01f32);
}

#[test]
fn adam_steps_the_whole_network() {
    let (x, dy) = data();
    let mut net = Mixed::new(&mut Rng::seed_from_u64(6));
    let before = net.clone();
    let mut cpu = Cpu::default();
    let mut state = MixedState::new();
    net.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
    let mut grads = MixedGrads::zeros();
    net.backward(&mut cpu, &state, &x, &dy, &mut grads, Mode::Train)
        .unwrap();
    let mut adam = Adam::new(1e-2);
    adam.step(&mut net, &grads);
    let mut changed = Vec::new();
    let mut old = Vec::new();
    before.visit(&mut |_, v| old.push(v.to_vec()));
    let mut i = 0;
    net.visit(&mut |name, v| {
        if v != old[i].as_slice() {
            changed.push(name.to_string());
        }
        i += 1;
    });
    // Every parameter moved (the first Adam step moves each by about lr).
    assert_eq!(changed.len(), 10, "{changed:?}");
    grads.zero();
    let mut zero = true;
    net.clone()
        .visit_mut(&grads, &mut |_, _, g| zero &= g.iter().all(|&v| v == 0.0));
    assert!(zero);
}

conv_runtime::network! {
    /// One dense layer: 130 channels and 70 rows (more than one 64-term mask of each), 100
    /// inputs (two mask words, a partial vector).
    pub struct WideF64 {
        input: [1, 1, 100],
        batch: 70,
        dtype: f64,
        layers: [flat: Flatten, fc: Dense { out_features: 130 }],
    }
}

conv_runtime::network! {
    /// [`WideF64`] in f32 (8 lanes, so other tile edges).
    pub struct WideF32 {
        input: [1, 1, 100],
        batch: 70,
        layers: [flat: Flatten, fc: Dense { out_features: 130 }],
    }
}

const WIDE_IN: usize = 100;
const WIDE_OUT: usize = 130;
const WIDE_BATCH: usize = 70;

/// Densities of nonzero values, each for three rows in turn.
const DENSITY: [f64; 6] = [0.0, 0.05, 0.2, 0.45, 0.7, 1.0];

/// Whether to keep a value, with probability `density`.
fn keep(rng: &mut SplitMix64, density: f64) -> bool {
    // `next_f64` is uniform in [-1, 1).
    (rng.next_f64() + 1.0) / 2.0 < density
}

/// An input whose rows come in threes of the same density, beginning at 5% (a ReLU's output
/// is mostly zeros).
fn sparse_input(rng: &mut SplitMix64) -> Vec<f64> {
    (0..WIDE_BATCH * WIDE_IN)
        .map(|i| {
            let value = rng.next_f64();
            if keep(rng, DENSITY[(i / WIDE_IN / 3 + 1) % DENSITY.len()]) {
                value
            } else {
                0.0
            }
        })
        .collect()
}

/// An output gradient whose rows come in threes of the same density (none, 5%, 20%, 45%, 70%,
/// all), with channel 2 of every 5 zero in every row and channel 0 of every 5 in none: tiles of
/// either kind in both gradient kernels.
fn sparse_output_gradient(rng: &mut SplitMix64) -> Vec<f64> {
    let mut dy = vec![0.0; WIDE_BATCH * WIDE_OUT];
    for (i, v) in dy.iter_mut().enumerate() {
        let (r, o) = (i / WIDE_OUT, i % WIDE_OUT);
        let value = rng.next_f64();
        let kept = keep(rng, DENSITY[(r / 3) % DENSITY.len()]);
        *v = match o % 5 {
            2 => 0.0,
            0 => value,
            _ if kept => value,
            _ => 0.0,
        };
    }
    dy
}

/// `(output, d_input, weight gradient, bias gradient)` of `y = W x + b`, in f64.
fn wide_reference(w: &[f64], b: &[f64], x: &[f64], dy: &[f64]) -> [Vec<f64>; 4] {
    let (n, oc, ic) = (WIDE_BATCH, WIDE_OUT, WIDE_IN);
    let mut y = vec![0.0; n * oc];
    let mut dx = vec![0.0; n * ic];
    let mut dw = vec![0.0; oc * ic];
    let mut db = vec![0.0; oc];
    for r in 0..n {
        for o in 0..oc {
            let g = dy[r * oc + o];
            y[r * oc + o] = b[o];
            db[o] += g;
            for k in 0..ic {
                y[r * oc + o] += w[o * ic + k] * x[r * ic + k];
                dx[r * ic + k] += g * w[o * ic + k];
                dw[o * ic + k] += g * x[r * ic + k];
            }
        }
    }
    [y, dx, dw, db]
}

macro_rules! wide_case {
    ($name:ident, $net:ident, $input:ident, $output:ident, $grads:ident, $state:ident, $elem:ty, $tol:expr) => {
        #[test]
        fn $name() {
            let mut rng = SplitMix64::new(29);
            let net = $net::new(&mut Rng::seed_from_u64(8));
            let x = sparse_input(&mut rng);
            let dy = sparse_output_gradient(&mut rng);
            let (to, back) = (common::convert::<$elem>, common::to_f64::<$elem>);
            let xs = $input::<WIDE_BATCH>::from_vec(to(&x)).unwrap();
            let dys = $output::<WIDE_BATCH>::from_vec(to(&dy)).unwrap();
            // The reference on the values the layer holds (rounded to its type).
            let (x, dy) = (back(xs.as_slice()), back(dys.as_slice()));
            let (w, b) = (
                back(net.fc.weights.as_slice()),
                back(net.fc.biases.as_slice()),
            );
            let [y, dx, dw, db] = wide_reference(&w, &b, &x, &dy);
            let run = |cpu: &mut Cpu| {
                let mut state = $state::new();
                net.clone()
                    .forward(cpu, &xs, &mut state, Mode::Train)
                    .unwrap();
                let (mut grads, mut d_input) = ($grads::zeros(), $input::<WIDE_BATCH>::zeros());
                net.backward_full(
                    cpu,
                    &state,
                    &xs,
                    &dys,
                    &mut d_input,
                    &mut grads,
                    Mode::Train,
                )
                .unwrap();
                let mut all = vec![back(state.output().as_slice()), back(d_input.as_slice())];
                net.clone()
                    .visit_mut(&grads, &mut |_, _, g| all.push(back(g)));
                all
            };
            let mut cpu = common::cpu();
            let got = run(&mut cpu);
            // `evaluate`, whole (repeatedly, unchanged weights) and a row at a time, has the same
            // bits.
            let mut whole = $output::<WIDE_BATCH>::zeros();
            for call in 0..3 {
                net.evaluate(&mut cpu, &xs, &mut whole).unwrap();
                assert!(
                    whole
                        .as_slice()
                        .iter()
                        .zip(&got[0])
                        .all(|(p, q)| (*p as f64).to_bits() == q.to_bits()),
                    "evaluate, call {call}"
                );
            }
            // A row alone is shared out by output channels where there are threads for them.
            let mut threads = Cpu::with_threads(3).unwrap().__split_everything();
            for r in [0, 4, 10, 17, 69] {
                let row =
                    $input::<1>::from_vec(xs.as_slice()[r * WIDE_IN..(r + 1) * WIDE_IN].to_vec())
                        .unwrap();
                for device in [&mut cpu, &mut threads] {
                    let mut y1 = $output::<1>::zeros();
                    net.evaluate(device, &row, &mut y1).unwrap();
                    assert_eq!(
                        y1.as_slice(),
                        &whole.as_slice()[r * WIDE_OUT..(r + 1) * WIDE_OUT],
                        "row {r} alone"
                    );
                }
            }
            for ((what, g), e) in ["output", "d_input", "fc.weights", "fc.biases"]
                .iter()
                .zip(&got)
                .zip([&y, &dx, &dw, &db])
            {
                assert_close(what, g, e, $tol);
            }
            // On 2 and 3 threads the workers own chunks of output channels (130: three
            // chunks, the last ragged): the input gradient's slots are added in chunk order.
            for threads in [2, 3] {
                let split = run(&mut Cpu::with_threads(threads).unwrap().__split_everything());
                for (what, (a, b)) in ["output", "d_input", "fc.weights", "fc.biases"]
                    .iter()
                    .zip(got.iter().zip(&split))
                {
                    assert!(
                        a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{what}: other bits on {threads} threads"
                    );
                }
            }
        }
    };
}

wide_case!(
    dense_gradients_with_zero_terms_f64,
    WideF64,
    WideF64Input,
    WideF64Output,
    WideF64Grads,
    WideF64State,
    f64,
    1e-12
);
wide_case!(
    dense_gradients_with_zero_terms_f32,
    WideF32,
    WideF32Input,
    WideF32Output,
    WideF32Grads,
    WideF32State,
    f32,
    1e-5
);

/// A convolution and a max-pooling as `network!` fuses them in `evaluate` (the pooling in the
/// convolution's epilogue), and the same two with an `Identity` activation between them, which
/// keeps them apart: the same parameters give the same bits.
macro_rules! fused_and_apart {
    ($fused:ident, $apart:ident, $t:ty, $input:tt, $conv:tt, $pool:tt) => {
        conv_runtime::network! {
            pub struct $fused { input: $input, batch: 3, dtype: $t, layers: [c: Conv2d $conv, p: MaxPool2d $pool] }
        }
        conv_runtime::network! {
            pub struct $apart {
                input: $input, batch: 3, dtype: $t,
                layers: [c: Conv2d $conv, a: Activation(Identity), p: MaxPool2d $pool],
            }
        }
    };
}

fused_and_apart!(FusedWinograd, ApartWinograd, f32, [16, 16, 16],
    { out_channels: 32, kernel: 3, padding: 1, activation: Relu },
    { kernel: 3, stride: 2, padding: 1 });
fused_and_apart!(FusedDirect, ApartDirect, f32, [11, 9, 3],
    { out_channels: 8, kernel: 3, padding: 1, activation: Tanh },
    { kernel: [3, 2], stride: [2, 1], padding: [1, 1] });
fused_and_apart!(FusedNorm, ApartNorm, f64, [10, 10, 4],
    { out_channels: 6, kernel: 2, stride: 1, norm: BatchNorm { momentum: 0.1, eps: 1e-5 } },
    { kernel: 2, stride: 2 });
fused_and_apart!(FusedHalf, ApartHalf, bf16, [12, 12, 8],
    { out_channels: 16, kernel: 3, padding: 1, activation: Relu },
    { kernel: 3, stride: 2, padding: 1 });

#[test]
fn max_pooling_in_the_convolution_epilogue_keeps_the_bits() {
    macro_rules! check {
        ($fused:ident, $input:ident, $output:ident, $apart:ident, $t:ty, $nan:expr) => {{
            // The same seed initializes the same convolution.
            let fused = $fused::new(&mut Rng::seed_from_u64(7));
            let apart = $apart::new(&mut Rng::seed_from_u64(7));
            let (mut p, mut q) = (Vec::new(), Vec::new());
            Parameters::visit(&fused, &mut |_, v| p.extend(common::to_f64(v)));
            Parameters::visit(&apart, &mut |_, v| q.extend(common::to_f64(v)));
            assert_eq!(p, q);
            // Signs mixed, one NaN in the first image: NaN windows pool as they do apart (ReLU
            // in registers drops NaN, as `max(x, 0)`).
            let mut rng = SplitMix64::new(11);
            let mut x =
                $input::<3>::from_fn(|_| <$t as Element>::from_f64(rng.next_f64() * 4.0 - 2.0));
            x.as_mut_slice()[17] = <$t as Element>::from_f64(f64::NAN);
            for threads in [1, 2, 3, 7] {
                let mut cpu = Cpu::with_threads(threads).unwrap().__split_everything();
                let mut a = $output::<3>::zeros();
                let mut b = a.clone();
                fused.evaluate(&mut cpu, &x, &mut a).unwrap();
                apart.evaluate(&mut cpu, &x, &mut b).unwrap();
                let bits = |v: &[$t]| {
                    v.iter()
                        .map(|v| <$t as Element>::to_f64(*v).to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    bits(a.as_slice()),
                    bits(b.as_slice()),
                    "{} on {threads} threads",
                    stringify!($fused)
                );
                assert_eq!(
                    a.as_slice()
                        .iter()
                        .any(|v| <$t as Element>::to_f64(*v).is_nan()),
                    $nan
                );
            }
        }};
    }
    use conv_runtime::Element;
    check!(
        FusedWinograd,
        FusedWinogradInput,
        FusedWinogradOutput,
        ApartWinograd,
        f32,
        false
    );
    check!(
        FusedDirect,
        FusedDirectInput,
        FusedDirectOutput,
        ApartDirect,
        f32,
        true
    );
    check!(
        FusedNorm,
        FusedNormInput,
        FusedNormOutput,
        ApartNorm,
        f64,
        true
    );
    check!(
        FusedHalf,
        FusedHalfInput,
        FusedHalfOutput,
        ApartHalf,
        bf16,
        false
    );
}

conv_runtime::network! {
    /// Residual blocks whose inner lists begin with an activation (IMPALA's `relu, conv, relu,
    /// conv`), one of them the activation alone: their backward pass and the block's sum run
    /// as one.
    pub struct PreActivated {
        input: [5, 5, 3],
        batch: 2,
        dtype: f64,
        layers: [
            c0: Conv2d { out_channels: 4, kernel: 3, padding: 1 },
            r1: Residual { layers: [
                a: Activation(Gelu),
                c1: Conv2d { out_channels: 4, kernel: 3, padding: 1, activation: Tanh },
                c2: Conv2d { out_channels: 4, kernel: 3, padding: 1 },
            ] },
            r2: Residual { layers: [a: Activation(Tanh)] },
            flat: Flatten,
            q: Dense { out_features: 3 },
        ],
    }
}

#[test]
fn pre_activated_residual_blocks_match_finite_differences() {
    let mut rng = SplitMix64::new(7);
    let net = PreActivated::new(&mut Rng::seed_from_u64(3));
    let x = PreActivatedInput::<2>::from_fn(|_| rng.next_f64());
    let dy = PreActivatedOutput::<2>::from_fn(|_| rng.next_f64() * 0.5);
    // `backward_full`'s input gradient on a device.
    let d_input_on = |device: &mut Cpu| {
        let (mut net, mut state) = (net.clone(), PreActivatedState::new());
        net.forward(device, &x, &mut state, Mode::Train).unwrap();
        let (mut grads, mut d_input) =
            (PreActivatedGrads::zeros(), PreActivatedInput::<2>::zeros());
        net.backward_full(
            device,
            &state,
            &x,
            &dy,
            &mut d_input,
            &mut grads,
            Mode::Train,
        )
        .unwrap();
        d_input
    };
    let mut cpu = common::cpu();
    let d_input = d_input_on(&mut cpu);
    // The loss `sum(dy * y)`, numerically.
    let loss = |cpu: &mut Cpu, x: &PreActivatedInput<2>| {
        let mut y = PreActivatedOutput::<2>::zeros();
        net.evaluate(cpu, x, &mut y).unwrap();
        y.as_slice()
            .iter()
            .zip(dy.as_slice())
            .map(|(y, d)| y * d)
            .sum::<f64>()
    };
    let eps = 1e-6;
    let numeric: Vec<f64> = (0..x.as_slice().len())
        .map(|i| {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus.as_mut_slice()[i] += eps;
            minus.as_mut_slice()[i] -= eps;
            (loss(&mut cpu, &plus) - loss(&mut cpu, &minus)) / (2.0 * eps)
        })
        .collect();
    assert!(
        numeric.iter().any(|g| g.abs() > 1e-3),
        "a gradient that can fail"
    );
    assert_close("d_input", d_input.as_slice(), &numeric, 1e-7);
    // The same bits on two threads, whose workers split the fused pass.
    let mut two = Cpu::with_threads(2).unwrap().__split_everything();
    assert_eq!(d_input.as_slice(), d_input_on(&mut two).as_slice());
}
