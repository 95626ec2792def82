//! Finite-difference gradient checks in f64 for every activation x norm x mode, on a small plain
//! shape and on a strided and padded one.
//!
//! The loss is `L = sum(output * R)` for a fixed random `R` (so `d_output = R`). The analytic
//! `d_input` (`backward_input`) and parameter gradients (`backward`) are compared with central
//! differences of `L` recomputed by `forward` in the same mode, on a fresh clone of the layer for
//! every perturbation (BatchNorm's Train-mode forward updates running statistics; they do not
//! change the Train-mode output, but every evaluation starts from the same layer anyway). The
//! parameters are enumerated through `Parameters::visit_mut`, so gamma and beta are covered
//! without naming fields a spec does not have; the names and order are asserted as well.
//!
//! FastTanh: rl_tools (and API.md) take its derivative to be `1 - f(x)^2`, which is *not* the
//! derivative of the rational function `x (27 + x^2) / (27 + 9 x^2)` (e.g. at x = 1 the exact
//! derivative is 4/9 = 0.444... while 1 - f(1)^2 = 1 - (7/9)^2 = 0.395...). A finite difference of `L` would therefore
//! disagree with a correct implementation by up to a few percent, and a loose tolerance would
//! hide real bugs. Instead, for FastTanh the check is split exactly:
//!   * the forward output is checked against the reference `f(pre)` computed in this test, and
//!   * the backward pass is checked through the surrogate loss `L' = sum(pre * D)` with the fixed
//!     weights `D = R * (1 - f(pre0)^2)` (`pre0` = the unperturbed pre-activation, `f` this
//!     test's reference). Everything between the parameters/input and `pre` is smooth, so central
//!     differences of `L'` are the exact `J_pre^T D`, which is precisely what a backward pass
//!     using the stated derivative `1 - f^2` must return for `d_output = R`; the same 1e-6
//!     tolerance applies. The clamp at |x| = 3 is no kink for `L'` (it is linear in `pre`), and
//!     pre-activations are kept mostly below 2.5 anyway so that `D` is not trivially zero.
//!
//! ReLU: the data is redrawn (next seed) until every |pre-activation| >= 1e-4, so no central
//! difference (h = 1e-6) straddles the kink.
//!
//! Each test also checks accumulation: two `backward` calls give 2x, `zero()` clears,
//! `Grads::add` doubles, `Grads::norm` is the L2 norm, `backward_full` == `backward_input` +
//! `backward`, and `d_input` is overwritten rather than accumulated; in Eval mode the layer
//! (running statistics included) is unchanged by `forward`, and for BatchNorm in Train mode
//! the bias gradient is ~0 (|.| < 1e-9) since the batch mean cancels the bias.

#[macro_use]
mod common;

/// Central-difference step.
const STEP: f64 = 1e-6;
/// max|fd - analytic| / max(1, max|analytic|).
const TOLERANCE: f64 = 1e-6;
/// For comparisons of two analytic results that should agree up to summation order.
const TIGHT: f64 = 1e-12;

/// The activations as API.md states them (FastTanh clamps first).
fn activation(name: &str, x: f64) -> f64 {
    match name {
        "Identity" => x,
        "Relu" => x.max(0.0),
        "Gelu" => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
        }
        "Tanh" => x.tanh(),
        "FastTanh" => {
            let x = x.clamp(-3.0, 3.0);
            x * (27.0 + x * x) / (27.0 + 9.0 * x * x)
        }
        "Sigmoid" => 1.0 / (1.0 + (-x).exp()),
        _ => panic!("unknown activation {name}"),
    }
}

/// FastTanh's derivative as rl_tools defines it.
fn fast_tanh_stated_derivative(x: f64) -> f64 {
    let f = activation("FastTanh", x);
    1.0 - f * f
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// max|a - b| / max(1, max|reference|) and the index of the worst element.
fn rel_err(got: &[f64], reference: &[f64]) -> (f64, usize) {
    assert_eq!(got.len(), reference.len());
    let scale = reference.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    let mut worst = (0.0f64, 0usize);
    for (i, (a, b)) in got.iter().zip(reference).enumerate() {
        let d = (a - b).abs();
        if d > worst.0 || d.is_nan() {
            worst = (d, i);
        }
    }
    (worst.0 / scale, worst.1)
}

#[track_caller]
fn assert_close(what: &str, got: &[f64], reference: &[f64], tolerance: f64) {
    assert!(!got.is_empty());
    let (err, i) = rel_err(got, reference);
    if std::env::var_os("GRADCHECK_VERBOSE").is_some() {
        eprintln!("{what}: relative error {err:.3e}");
    }
    assert!(
        err < tolerance && !err.is_nan(),
        "{what}: relative error {err:.3e} >= {tolerance:e}; worst index {i}: got {} vs reference {}\n\
         got       = {got:?}\nreference = {reference:?}",
        got[i],
        reference[i],
    );
}

/// Sets BatchNorm's running statistics to non-trivial values (no-op for the other norms).
macro_rules! randomize_running {
    ((BatchNorm $($rest:tt)*), $layer:ident, $rng:ident) => {
        $layer.running_mean = Vector::from_fn(|_| $rng.uniform(-0.5, 0.5));
        $layer.running_var = Vector::from_fn(|_| $rng.uniform(0.5, 2.0));
    };
    (($($norm:tt)*), $layer:ident, $rng:ident) => {};
}

/// BatchNorm's running statistics, concatenated (empty for the other norms).
macro_rules! running_stats {
    ((BatchNorm $($rest:tt)*), $layer:expr) => {{
        let layer = &$layer;
        let mut v = layer.running_mean.as_slice().to_vec();
        v.extend_from_slice(layer.running_var.as_slice());
        v
    }};
    (($($norm:tt)*), $layer:expr) => {
        Vec::<f64>::new()
    };
}

/// `gradcheck!(module, Activation, { norm }, { shape keys })`: a module with the layer and a
/// Train and an Eval test.
macro_rules! gradcheck {
    ($name:ident, $act:ident, { $($norm:tt)* }, { $($shape:tt)* }) => {
        mod $name {
            #[allow(unused_imports)]
            use conv_runtime::prelude::*;
            use crate::{
                activation, assert_close, dot, fast_tanh_stated_derivative, STEP, TIGHT, TOLERANCE,
            };

            conv_runtime::conv2d! {
                pub struct Layer {
                    $($shape)*
                    activation: $act,
                    norm: $($norm)*,
                    dtype: f64,
                }
            }

            type X = Tensor<
                f64,
                { Layer::BATCH_SIZE },
                { Layer::INPUT_HEIGHT },
                { Layer::INPUT_WIDTH },
                { Layer::INPUT_CHANNELS },
            >;
            type Y = Tensor<
                f64,
                { Layer::BATCH_SIZE },
                { Layer::OUTPUT_HEIGHT },
                { Layer::OUTPUT_WIDTH },
                { Layer::OUTPUT_CHANNELS },
            >;

            const ACTIVATION: &str = stringify!($act);
            const NORM: &str = stringify!($($norm)*);

            fn is_batch_norm() -> bool {
                NORM.starts_with("BatchNorm")
            }

            fn probes_pre_activation() -> bool {
                ACTIVATION == "FastTanh"
            }

            /// A layer with random parameters (pre-activations of order 0.6), an input and R.
            fn setup(seed: u64) -> (Layer, X, Y) {
                let mut rng = Rng::seed_from_u64(seed);
                let mut layer = Layer::new(&mut rng);
                let fan_in =
                    (Layer::KERNEL_HEIGHT * Layer::KERNEL_WIDTH * Layer::INPUT_CHANNELS) as f64;
                let a = (3.0 / fan_in).sqrt();
                layer.weights = Tensor::from_fn(|_| rng.uniform(-a, a));
                layer.biases = Vector::from_fn(|_| rng.uniform(-0.5, 0.5));
                let dummy = LayerGrads::zeros();
                layer.visit_mut(&dummy, &mut |name, tensor, _| match name {
                    "gamma" => tensor.values_mut().iter_mut().for_each(|v| *v = rng.uniform(0.5, 0.9)),
                    "beta" => tensor.values_mut().iter_mut().for_each(|v| *v = rng.uniform(-0.3, 0.3)),
                    _ => {}
                });
                randomize_running!(($($norm)*), layer, rng);
                let x = X::from_fn(|_| rng.uniform(-1.0, 1.0));
                let r = Y::from_fn(|_| rng.normal());
                (layer, x, r)
            }

            /// The (name, values) of every gradient, in visiting order.
            fn grad_list(layer: &Layer, grads: &LayerGrads) -> Vec<(String, Vec<f64>)> {
                let mut layer = layer.clone();
                let mut out = Vec::new();
                layer.visit_mut(grads, &mut |name, _, g| out.push((name.to_string(), g.to_vec())));
                out
            }

            /// The scalar the finite differences are taken of: `sum(output * w)`, or for
            /// FastTanh `sum(pre_activation * w)` (see the module docs).
            fn loss(cpu: &mut Cpu, layer: &Layer, x: &X, w: &[f64], mode: Mode) -> f64 {
                let mut layer = layer.clone();
                let mut state = LayerState::new();
                layer.forward(cpu, x, &mut state, mode).unwrap();
                if probes_pre_activation() {
                    dot(state.pre_activation().as_slice(), w)
                } else {
                    dot(state.output().as_slice(), w)
                }
            }

            fn perturbed(layer: &Layer, name: &str, i: usize, delta: f64) -> Layer {
                let mut layer = layer.clone();
                let dummy = LayerGrads::zeros();
                let mut hit = false;
                layer.visit_mut(&dummy, &mut |n, tensor, _| {
                    if n == name {
                        tensor.values_mut()[i] += delta;
                        hit = true;
                    }
                });
                assert!(hit, "no parameter {name}");
                layer
            }

            fn check(mode: Mode) {
                let mut cpu = crate::common::cpu();

                // Data without a pre-activation near ReLU's kink.
                let mut found = None;
                for seed in 0..64u64 {
                    let (layer, x, r) = setup(1000 + seed);
                    let mut trained = layer.clone();
                    let mut state = LayerState::new();
                    trained.forward(&mut cpu, &x, &mut state, mode).unwrap();
                    let near_kink = ACTIVATION == "Relu"
                        && state.pre_activation().as_slice().iter().any(|p| p.abs() < 1e-4);
                    if !near_kink {
                        found = Some((layer, x, r, trained, state));
                        break;
                    }
                }
                let (layer, x, r, trained, state) =
                    found.expect("no seed keeps ReLU pre-activations away from 0");

                // The forward output is the activation of the pre-activation.
                let pre = state.pre_activation().as_slice().to_vec();
                let expected: Vec<f64> = pre.iter().map(|&p| activation(ACTIVATION, p)).collect();
                assert_close("output = f(pre_activation)", state.output().as_slice(), &expected, TIGHT);
                assert!(pre.iter().all(|p| p.is_finite()));
                if ACTIVATION == "FastTanh" && NORM == "None" {
                    let max = pre.iter().fold(0.0f64, |m, p| m.max(p.abs()));
                    assert!(max < 2.5, "FastTanh pre-activations should stay below the clamp: {max}");
                }

                // Eval never changes the layer; Train changes exactly BatchNorm's running stats.
                let before = running_stats!(($($norm)*), layer);
                let after = running_stats!(($($norm)*), trained);
                if mode == Mode::Train && is_batch_norm() {
                    assert_ne!(before, after, "Train forward must update BatchNorm's running statistics");
                } else {
                    assert_eq!(before, after, "forward changed the running statistics");
                }
                let mut params_before = Vec::new();
                layer.visit(&mut |_, v| params_before.push(v.to_vec()));
                let mut params_after = Vec::new();
                trained.visit(&mut |_, v| params_after.push(v.to_vec()));
                assert_eq!(params_before, params_after, "forward changed trainable parameters");

                // The weights of the probed quantity.
                let w: Vec<f64> = if probes_pre_activation() {
                    r.as_slice()
                        .iter()
                        .zip(&pre)
                        .map(|(r, &p)| r * fast_tanh_stated_derivative(p))
                        .collect()
                } else {
                    r.as_slice().to_vec()
                };

                // Analytic gradients (d_input deliberately pre-filled: it must be overwritten).
                let mut d_input = X::from_fn(|i| 123.0 + i as f64);
                trained.backward_input(&mut cpu, &state, &r, &mut d_input, mode).unwrap();
                let mut grads = LayerGrads::zeros();
                trained.backward(&mut cpu, &state, &x, &r, &mut grads, mode).unwrap();
                let analytic = grad_list(&trained, &grads);

                // Names and order of the trainable parameters.
                let names: Vec<&str> = analytic.iter().map(|(n, _)| n.as_str()).collect();
                if NORM == "None" {
                    assert_eq!(names, ["weights", "biases"]);
                } else {
                    assert_eq!(names, ["weights", "biases", "gamma", "beta"]);
                }
                assert_eq!(analytic[0].1, grads.weights.as_slice());
                assert_eq!(analytic[1].1, grads.biases.as_slice());

                // d_input by central differences.
                let mut fd_input = vec![0.0; X::LEN];
                for i in 0..X::LEN {
                    let mut xp = x.clone();
                    xp.as_mut_slice()[i] += STEP;
                    let lp = loss(&mut cpu, &layer, &xp, &w, mode);
                    let mut xm = x.clone();
                    xm.as_mut_slice()[i] -= STEP;
                    let lm = loss(&mut cpu, &layer, &xm, &w, mode);
                    fd_input[i] = (lp - lm) / (2.0 * STEP);
                }
                assert_close("d_input", d_input.as_slice(), &fd_input, TOLERANCE);

                // Parameter gradients by central differences.
                for (name, g) in &analytic {
                    let mut fd = vec![0.0; g.len()];
                    for i in 0..g.len() {
                        let lp = loss(&mut cpu, &perturbed(&layer, name, i, STEP), &x, &w, mode);
                        let lm = loss(&mut cpu, &perturbed(&layer, name, i, -STEP), &x, &w, mode);
                        fd[i] = (lp - lm) / (2.0 * STEP);
                    }
                    assert_close(&format!("d_{name}"), g, &fd, TOLERANCE);
                }

                // Train-mode BatchNorm: the batch mean removes the bias, whose gradient is ~0.
                if mode == Mode::Train && is_batch_norm() {
                    for (c, g) in grads.biases.as_slice().iter().enumerate() {
                        assert!(g.abs() < 1e-9, "BatchNorm Train d_biases[{c}] = {g:e}, expected ~0");
                    }
                }

                // Accumulation: a second backward doubles; zero() clears.
                let mut twice = LayerGrads::zeros();
                trained.backward(&mut cpu, &state, &x, &r, &mut twice, mode).unwrap();
                assert_eq!(grad_list(&trained, &twice), analytic, "backward is not deterministic");
                trained.backward(&mut cpu, &state, &x, &r, &mut twice, mode).unwrap();
                for ((name, got), (_, once)) in grad_list(&trained, &twice).iter().zip(&analytic) {
                    let doubled: Vec<f64> = once.iter().map(|v| 2.0 * v).collect();
                    assert_close(&format!("2 x backward: d_{name}"), got, &doubled, TIGHT);
                }
                twice.zero();
                for (name, g) in grad_list(&trained, &twice) {
                    assert!(g.iter().all(|&v| v == 0.0), "zero() left d_{name} = {g:?}");
                }
                assert_eq!(twice.norm(), 0.0);

                // add() and norm().
                let mut added = LayerGrads::zeros();
                added.add(&grads);
                added.add(&grads);
                for ((name, got), (_, once)) in grad_list(&trained, &added).iter().zip(&analytic) {
                    let doubled: Vec<f64> = once.iter().map(|v| 2.0 * v).collect();
                    assert_close(&format!("add: d_{name}"), got, &doubled, TIGHT);
                }
                let norm = analytic
                    .iter()
                    .flat_map(|(_, g)| g.iter())
                    .map(|v| v * v)
                    .sum::<f64>()
                    .sqrt();
                assert!((grads.norm() - norm).abs() <= TIGHT * norm.max(1.0), "{} vs {norm}", grads.norm());

                // backward_full == backward_input + backward (d_input overwritten, grads added).
                let mut d_input_full = X::from_fn(|i| -77.0 - i as f64);
                let mut grads_full = LayerGrads::zeros();
                trained
                    .backward_full(&mut cpu, &state, &x, &r, &mut d_input_full, &mut grads_full, mode)
                    .unwrap();
                assert_close("backward_full d_input", d_input_full.as_slice(), d_input.as_slice(), TIGHT);
                for ((name, got), (_, reference)) in grad_list(&trained, &grads_full).iter().zip(&analytic) {
                    assert_close(&format!("backward_full d_{name}"), got, reference, TIGHT);
                }
                trained
                    .backward_full(&mut cpu, &state, &x, &r, &mut d_input_full, &mut grads_full, mode)
                    .unwrap();
                assert_close("backward_full d_input (again)", d_input_full.as_slice(), d_input.as_slice(), TIGHT);
                for ((name, got), (_, once)) in grad_list(&trained, &grads_full).iter().zip(&analytic) {
                    let doubled: Vec<f64> = once.iter().map(|v| 2.0 * v).collect();
                    assert_close(&format!("2 x backward_full: d_{name}"), got, &doubled, TIGHT);
                }

                // backward_input again over a filled d_input: overwritten, not accumulated.
                let mut d_input_again = d_input.clone();
                trained.backward_input(&mut cpu, &state, &r, &mut d_input_again, mode).unwrap();
                assert_close("backward_input (again)", d_input_again.as_slice(), d_input.as_slice(), TIGHT);
            }

            #[test]
            fn train() {
                check(Mode::Train);
            }

            #[test]
            fn eval() {
                check(Mode::Eval);
            }
        }
    };
}

/// Every activation x norm for one shape.
macro_rules! all_cases {
    ($shape_module:ident, { $($shape:tt)* }) => {
        mod $shape_module {
            gradcheck!(identity_plain, Identity, { None }, { $($shape)* });
            gradcheck!(identity_batch_norm, Identity, { BatchNorm { momentum: 0.1, eps: 1e-5 } }, { $($shape)* });
            gradcheck!(identity_layer_norm, Identity, { LayerNorm { eps: 1e-5 } }, { $($shape)* });
            gradcheck!(relu_plain, Relu, { None }, { $($shape)* });
            gradcheck!(relu_batch_norm, Relu, { BatchNorm { momentum: 0.1, eps: 1e-5 } }, { $($shape)* });
            gradcheck!(relu_layer_norm, Relu, { LayerNorm { eps: 1e-5 } }, { $($shape)* });
            gradcheck!(gelu_plain, Gelu, { None }, { $($shape)* });
            gradcheck!(gelu_batch_norm, Gelu, { BatchNorm { momentum: 0.1, eps: 1e-5 } }, { $($shape)* });
            gradcheck!(gelu_layer_norm, Gelu, { LayerNorm { eps: 1e-5 } }, { $($shape)* });
            gradcheck!(tanh_plain, Tanh, { None }, { $($shape)* });
            gradcheck!(tanh_batch_norm, Tanh, { BatchNorm { momentum: 0.1, eps: 1e-5 } }, { $($shape)* });
            gradcheck!(tanh_layer_norm, Tanh, { LayerNorm { eps: 1e-5 } }, { $($shape)* });
            gradcheck!(fast_tanh_plain, FastTanh, { None }, { $($shape)* });
            gradcheck!(fast_tanh_batch_norm, FastTanh, { BatchNorm { momentum: 0.1, eps: 1e-5 } }, { $($shape)* });
            gradcheck!(fast_tanh_layer_norm, FastTanh, { LayerNorm { eps: 1e-5 } }, { $($shape)* });
            gradcheck!(sigmoid_plain, Sigmoid, { None }, { $($shape)* });
            gradcheck!(sigmoid_batch_norm, Sigmoid, { BatchNorm { momentum: 0.1, eps: 1e-5 } }, { $($shape)* });
            gradcheck!(sigmoid_layer_norm, Sigmoid, { LayerNorm { eps: 1e-5 } }, { $($shape)* });
        }
    };
}

all_cases!(small, {
    input: [5, 6, 2], out_channels: 3, kernel: 3, stride: 1, padding: 0, batch: 2,
});

all_cases!(strided_padded, {
    input: [7, 6, 3], out_channels: 4, kernel: [3, 2], stride: [2, 1], padding: [1, 2], batch: 3,
});

/// The FastTanh treatment above rests on the stated derivative differing from the exact one.
#[test]
fn fast_tanh_stated_derivative_is_not_the_exact_one() {
    let x = 1.0;
    let exact = (activation("FastTanh", x + 1e-6) - activation("FastTanh", x - 1e-6)) / 2e-6;
    assert!((exact - 4.0 / 9.0).abs() < 1e-8, "{exact}");
    assert!((fast_tanh_stated_derivative(x) - 32.0 / 81.0).abs() < 1e-15);
    assert!((fast_tanh_stated_derivative(x) - exact).abs() > 0.04);
}
