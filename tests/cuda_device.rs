//! The CUDA device against the generated CPU code: every generated spec (in its own element
//! type), with and without a norm, through every operation, must agree within the element
//! type's tolerance, both on host tensors and device-resident (`LayerCuda`); the optimizers'
//! GPU step must equal their CPU step bit for bit; extra specs large enough for cuDNN (f32,
//! f64, f16, bf16, with and without cuDNN's fused convolution + bias + ReLU) and small
//! half-precision ones cover both convolution paths; and the synthetic training task of
//! tests/training.rs trains on the GPU.
//!
//! Needs the `cuda` feature. Without a GPU (no driver, no device, no cuDNN) every test prints
//! one "skipped: no GPU (reason)" line and passes, unless `CONV2D_REQUIRE_GPU=1` is set, where
//! a missing GPU fails every test (scripts/gpu-check.sh sets it).
#![cfg(feature = "cuda")]

#[macro_use]
mod common;

use std::io::Write;
use std::sync::Once;

use common::{assert_close, to_f64};
use conv_runtime::prelude::*;

/// The GPU, or `None` after saying why the test is skipped.
fn gpu() -> Option<Cuda> {
    static SKIP: Once = Once::new();
    match Cuda::new(0) {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            if std::env::var("CONV2D_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("CONV2D_REQUIRE_GPU=1 but there is no usable GPU: {e}");
            }
            // Straight to stderr: the test harness would capture `eprintln!` of a passing test.
            SKIP.call_once(|| {
                let _ = writeln!(std::io::stderr(), "skipped: no GPU ({e})");
            });
            None
        }
    }
}

/// Relative tolerance (see `common::rel_err`) between the devices for element type `T`:
/// summation orders differ; half types round the same f32 values on either side of a tie.
fn tolerance<T>() -> f64 {
    match std::mem::size_of::<T>() {
        8 => 1e-9,
        4 => 1e-4,
        _ => 3e-2,
    }
}

/// Both devices' results of one operation, compared by name.
fn same<E: Element>(what: &str, cpu: &[E], gpu: &[E], tolerance: f64) {
    assert_close(what, &to_f64(gpu), &to_f64(cpu), tolerance);
}

/// The tolerance for the gradient of parameter `name`. The bias gradient of a BatchNorm layer in
/// training mode is zero in exact arithmetic (normalizing by the batch mean removes any bias),
/// so each device holds only the rounding noise of its sums over the batch's `rows` output
/// pixels, which grows with sqrt(rows) (for cudnn_f32_stride2: 1.4e-4 on the CPU, 3e-5 on the
/// GPU, against an f64 value of 4e-13).
fn gradient_tolerance(name: &str, batch_norm_train: bool, rows: usize, tolerance: f64) -> f64 {
    if batch_norm_train && name == "biases" {
        tolerance * (rows as f64).sqrt()
    } else {
        tolerance
    }
}

/// Every parameter's gradient in `grads`, by name, in visiting order.
#[allow(clippy::type_complexity)]
fn gradients<P: Parameters + Clone>(
    layer: &P,
    grads: &P::Grads,
) -> Vec<(String, Vec<<P::Elem as Element>::Acc>)> {
    let mut all = Vec::new();
    layer.clone().visit_mut(grads, &mut |name, _, grad| {
        all.push((name.to_string(), grad.to_vec()))
    });
    all
}

/// `equivalence!(name, spec, { keys }, [dtype])` (a spec of `for_each_spec!(parsed ..)`, or of
/// `parse_spec!`): the spec in its own element type without a norm, with BatchNorm and with
/// LayerNorm, each on both devices.
macro_rules! equivalence {
    ($name:ident, $spec:expr, { $($keys:tt)* }, [$($dtype:ident)?]) => {
        mod $name {
            equivalence!(@norm plain, { $($keys)* norm: None, $(dtype: $dtype,)? });
            equivalence!(@norm batch_norm, { $($keys)* norm: BatchNorm { momentum: 0.3, eps: 1e-3 }, $(dtype: $dtype,)? });
            equivalence!(@norm layer_norm, { $($keys)* norm: LayerNorm { eps: 1e-3 }, $(dtype: $dtype,)? });
        }
    };
    (@norm $module:ident, { $($keys:tt)* }) => {
        pub mod $module {
            use crate::common::{convert, SplitMix64};
            use crate::{gpu, gradient_tolerance, gradients, same, tolerance};
            use conv_runtime::prelude::*;

            conv_runtime::conv2d! {
                pub struct Layer {
                    $($keys)*
                }
            }

            type T = <Layer as Parameters>::Elem;
            type Inputs<const B: usize> = Tensor<
                T,
                B,
                { Layer::INPUT_HEIGHT },
                { Layer::INPUT_WIDTH },
                { Layer::INPUT_CHANNELS },
            >;
            type Outputs<const B: usize> = Tensor<
                T,
                B,
                { Layer::OUTPUT_HEIGHT },
                { Layer::OUTPUT_WIDTH },
                { Layer::OUTPUT_CHANNELS },
            >;
            type Input = Inputs<{ Layer::BATCH_SIZE }>;
            type Output = Outputs<{ Layer::BATCH_SIZE }>;
            /// Seeds the test data per spec.
            const SEED: u64 = (Layer::INPUT_HEIGHT * 1000 + Layer::OUTPUT_CHANNELS) as u64;

            #[test]
            fn every_operation_matches_the_cpu() {
                let Some(mut cuda) = gpu() else { return };
                let tol = tolerance::<T>();
                let mut data = SplitMix64::new(0x0c0d_a000 + SEED);
                let layer = Layer::new(&mut Rng::seed_from_u64(5));
                let x = Input::from_vec(convert(&data.values(Input::LEN))).unwrap();
                let d_output = Output::from_vec(convert(&data.values(Output::LEN))).unwrap();
                let mut cpu = Cpu::default();

                // Inference at the spec's batch and at batch 3.
                let (mut y_cpu, mut y_gpu) = (Output::zeros(), Output::zeros());
                layer.evaluate(&mut cpu, &x, &mut y_cpu).unwrap();
                layer.evaluate(&mut cuda, &x, &mut y_gpu).unwrap();
                same("evaluate", y_cpu.as_slice(), y_gpu.as_slice(), tol);
                let x3 = Inputs::<3>::from_vec(convert(&data.values(Inputs::<3>::LEN))).unwrap();
                let mut y3_cpu = Outputs::<3>::zeros();
                let mut y3_gpu = y3_cpu.clone();
                layer.evaluate(&mut cpu, &x3, &mut y3_cpu).unwrap();
                layer.evaluate(&mut cuda, &x3, &mut y3_gpu).unwrap();
                same("evaluate, batch 3", y3_cpu.as_slice(), y3_gpu.as_slice(), tol);

                for mode in [Mode::Train, Mode::Eval] {
                    let (mut l_cpu, mut l_gpu) = (layer.clone(), layer.clone());
                    let (mut s_cpu, mut s_gpu) = (LayerState::new(), LayerState::new());
                    l_cpu.forward(&mut cpu, &x, &mut s_cpu, mode).unwrap();
                    l_gpu.forward(&mut cuda, &x, &mut s_gpu, mode).unwrap();
                    same("forward", s_cpu.output().as_slice(), s_gpu.output().as_slice(), tol);
                    same("forward pre-activation", s_cpu.pre_activation().as_slice(), s_gpu.pre_activation().as_slice(), tol);
                    assert!(l_cpu.abs_diff(&l_gpu) < 1e-3, "running statistics differ");

                    let (mut dx_cpu, mut dx_gpu) = (Input::zeros(), Input::zeros());
                    let (mut g_cpu, mut g_gpu) = (LayerGrads::zeros(), LayerGrads::zeros());
                    l_cpu.backward_full(&mut cpu, &s_cpu, &x, &d_output, &mut dx_cpu, &mut g_cpu, mode).unwrap();
                    l_gpu.backward_full(&mut cuda, &s_gpu, &x, &d_output, &mut dx_gpu, &mut g_gpu, mode).unwrap();
                    same("backward_full d_input", dx_cpu.as_slice(), dx_gpu.as_slice(), tol);
                    same("backward_full d_weights", g_cpu.weights.as_slice(), g_gpu.weights.as_slice(), tol);
                    let bn_train = stringify!($module) == "batch_norm" && matches!(mode, Mode::Train);
                    let rows = Layer::BATCH_SIZE * Layer::OUTPUT_HEIGHT * Layer::OUTPUT_WIDTH;
                    same("backward_full d_biases", g_cpu.biases.as_slice(), g_gpu.biases.as_slice(), gradient_tolerance("biases", bn_train, rows, tol));
                    // Every parameter's gradient, gamma and beta included.
                    for ((name, c), (_, g)) in gradients(&layer, &g_cpu).iter().zip(&gradients(&layer, &g_gpu)) {
                        same(&format!("backward_full d_{name}"), c, g, gradient_tolerance(name, bn_train, rows, tol));
                    }

                    // From the CPU's forward state (the same stored values) the parameter
                    // gradients, kept in the accumulator type, agree at its tolerance: both
                    // devices take the activation's derivative from the stored output, which for
                    // half-precision layers is rounded.
                    let (mut dx_from_cpu, mut g_from_cpu) = (Input::zeros(), LayerGrads::zeros());
                    l_cpu.backward_full(&mut cuda, &s_cpu, &x, &d_output, &mut dx_from_cpu, &mut g_from_cpu, mode).unwrap();
                    for ((name, c), (_, g)) in gradients(&layer, &g_cpu).iter().zip(&gradients(&layer, &g_from_cpu)) {
                        same(&format!("d_{name} from the CPU's state"), c, g, gradient_tolerance(name, bn_train, rows, tolerance::<<T as Element>::Acc>()));
                    }

                    // The split passes equal the fused one; `backward` accumulates.
                    let mut dx_split = Input::from_fn(|_| <T as Element>::from_f64(f64::NAN));
                    l_gpu.backward_input(&mut cuda, &s_gpu, &d_output, &mut dx_split, mode).unwrap();
                    same("backward_input", dx_gpu.as_slice(), dx_split.as_slice(), tol);
                    l_gpu.backward(&mut cuda, &s_gpu, &x, &d_output, &mut g_gpu, mode).unwrap();
                    let twice: Vec<_> = g_cpu.weights.as_slice().iter().map(|g| 2.0 * g).collect();
                    same("backward accumulates", &twice, g_gpu.weights.as_slice(), tol);
                }
            }

            /// The device-resident types: every operation on tensors that stay on the GPU, and
            /// training steps (Adam, SGD with Nesterov momentum, centered RMSprop with momentum) whose optimizer runs on
            /// the GPU and equals the CPU optimizer bit for bit from the same gradients.
            #[test]
            fn resident_operations_and_optimizers() {
                let Some(mut cuda) = gpu() else { return };
                type A = <T as Element>::Acc;
                let tol = tolerance::<T>();
                let mut data = SplitMix64::new(0x0c0d_b000 + SEED);
                let layer = Layer::new(&mut Rng::seed_from_u64(6));
                let x = Input::from_vec(convert(&data.values(Input::LEN))).unwrap();
                let d_output = Output::from_vec(convert(&data.values(Output::LEN))).unwrap();
                let mut cpu = Cpu::default();
                let x_gpu = CudaTensor::upload(&cuda, &x).unwrap();
                let dy_gpu = CudaTensor::upload(&cuda, &d_output).unwrap();

                let mut on_gpu = LayerCuda::upload(&cuda, &layer).unwrap();
                let mut y_cpu = Output::zeros();
                layer.evaluate(&mut cpu, &x, &mut y_cpu).unwrap();
                let mut y_gpu = CudaTensor::zeros(&cuda).unwrap();
                on_gpu.evaluate(&mut cuda, &x_gpu, &mut y_gpu).unwrap();
                same("resident evaluate", y_cpu.as_slice(), y_gpu.download(&cuda).unwrap().as_slice(), tol);

                // `reference` follows the GPU's parameters on the CPU: same gradients, CPU steps.
                let mut reference = layer.clone();
                let mut s_cpu = LayerState::new();
                let mut s_gpu = LayerCudaState::new(&cuda).unwrap();
                let (mut g_cpu, mut g_gpu) = (LayerGrads::zeros(), LayerCudaGrads::zeros(&cuda).unwrap());
                let mut g_host = LayerGrads::zeros();
                let mut dx_cpu = Input::zeros();
                let mut dx_gpu = CudaTensor::zeros(&cuda).unwrap();
                let lr = <A as Element>::from_f64(1e-2);
                let (mut adam_cpu, mut adam_gpu) = (
                    Adam::new(lr).with_weight_decay(<A as Element>::from_f64(1e-2)),
                    Adam::new(lr).with_weight_decay(<A as Element>::from_f64(1e-2)),
                );
                let sgd = || {
                    let mut s = Sgd::new(lr).with_momentum(<A as Element>::from_f64(0.9));
                    s.nesterov = true;
                    s
                };
                let (mut sgd_cpu, mut sgd_gpu) = (sgd(), sgd());
                let rmsprop = || {
                    RmsProp::new(lr)
                        .with_centered(true)
                        .with_momentum(<A as Element>::from_f64(0.9))
                        .with_weight_decay(<A as Element>::from_f64(1e-2))
                };
                let (mut rmsprop_cpu, mut rmsprop_gpu) = (rmsprop(), rmsprop());
                let mut check = layer.clone();
                for step in 0..6 {
                    reference.forward(&mut cpu, &x, &mut s_cpu, Mode::Train).unwrap();
                    on_gpu.forward(&mut cuda, &x_gpu, &mut s_gpu, Mode::Train).unwrap();
                    same("resident forward", s_cpu.output().as_slice(), s_gpu.output().download(&cuda).unwrap().as_slice(), tol);
                    reference.backward_full(&mut cpu, &s_cpu, &x, &d_output, &mut dx_cpu, &mut g_cpu, Mode::Train).unwrap();
                    on_gpu.backward_full(&mut cuda, &s_gpu, &x_gpu, &dy_gpu, &mut dx_gpu, &mut g_gpu, Mode::Train).unwrap();
                    same("resident backward_full d_input", dx_cpu.as_slice(), dx_gpu.download(&cuda).unwrap().as_slice(), tol);
                    g_gpu.download_into(&cuda, &mut g_host).unwrap();
                    for ((name, c), (_, g)) in gradients(&layer, &g_cpu).iter().zip(&gradients(&layer, &g_host)) {
                        let rows = Layer::BATCH_SIZE * Layer::OUTPUT_HEIGHT * Layer::OUTPUT_WIDTH;
                        let bn = stringify!($module) == "batch_norm";
                        same(&format!("resident d_{name}"), c, g, gradient_tolerance(name, bn, rows, tol));
                    }
                    // `backward` adds into every gradient; `backward_input` overwrites `d_input`.
                    on_gpu.backward(&mut cuda, &s_gpu, &x_gpu, &dy_gpu, &mut g_gpu, Mode::Train).unwrap();
                    let mut g_twice = LayerGrads::zeros();
                    g_gpu.download_into(&cuda, &mut g_twice).unwrap();
                    for ((name, once), (_, twice)) in gradients(&layer, &g_host).iter().zip(&gradients(&layer, &g_twice)) {
                        let doubled: Vec<_> = once.iter().map(|&g| g + g).collect();
                        same(&format!("resident backward accumulates d_{name}"), &doubled, twice, tol);
                    }
                    g_gpu = LayerCudaGrads::upload(&cuda, &g_host).unwrap();
                    let nan = Input::from_fn(|_| <T as Element>::from_f64(f64::NAN));
                    let mut dx_split = CudaTensor::upload(&cuda, &nan).unwrap();
                    on_gpu.backward_input(&mut cuda, &s_gpu, &dy_gpu, &mut dx_split, Mode::Train).unwrap();
                    same("resident backward_input", dx_gpu.download(&cuda).unwrap().as_slice(), dx_split.download(&cuda).unwrap().as_slice(), tol);
                    if step < 2 {
                        adam_cpu.step(&mut reference, &g_host);
                        adam_gpu.step_cuda(&mut cuda, &mut on_gpu, &g_gpu).unwrap();
                    } else if step < 4 {
                        sgd_cpu.step(&mut reference, &g_host);
                        sgd_gpu.step_cuda(&mut cuda, &mut on_gpu, &g_gpu).unwrap();
                    } else {
                        rmsprop_cpu.step(&mut reference, &g_host);
                        rmsprop_gpu.step_cuda(&mut cuda, &mut on_gpu, &g_gpu).unwrap();
                    }
                    on_gpu.download_into(&cuda, &mut check).unwrap();
                    let mut expected = Vec::new();
                    reference.visit(&mut |name, v| expected.push((name.to_string(), v.to_vec())));
                    let mut got = Vec::new();
                    check.visit(&mut |name, v| got.push((name.to_string(), v.to_vec())));
                    for ((name, e), (_, g)) in expected.iter().zip(&got) {
                        let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
                        assert!(bits(e) == bits(g), "step {step}: the GPU optimizer's `{name}` differs from the CPU's");
                    }
                    g_cpu.zero();
                    g_gpu.zero(&cuda).unwrap();
                    // Zeroed on the GPU: the next backward pass starts from nothing.
                    g_gpu.download_into(&cuda, &mut g_host).unwrap();
                    assert!(g_host.norm() == 0.0, "zero left {}", g_host.norm());
                }

                // Host parameters copied in replace the GPU's, and the host-tensor operations
                // agree with the resident ones.
                on_gpu.copy_from_host(&cuda, &layer).unwrap();
                on_gpu.evaluate(&mut cuda, &x_gpu, &mut y_gpu).unwrap();
                let mut y_host = Output::zeros();
                layer.evaluate(&mut cuda, &x, &mut y_host).unwrap();
                same("copy_from_host, then evaluate", y_host.as_slice(), y_gpu.download(&cuda).unwrap().as_slice(), 0.0);
            }
        }
    };
}

for_each_spec!(parsed equivalence);

// Large enough for cuDNN (forward FLOPs above 2^24 with wide GEMM dimensions), in every element
// type, and small half-precision layers on the direct kernels.
parse_spec!(equivalence; cudnn_f32, input: [16, 16, 32], out_channels: 32, kernel: 3, padding: 1,
    activation: Relu, batch: 4, dtype: f32);
parse_spec!(equivalence; cudnn_f32_stride2, input: [32, 32, 16], out_channels: 32, kernel: 3, stride: 2,
    padding: 1, activation: Gelu, batch: 8, dtype: f32);
parse_spec!(equivalence; cudnn_f64, input: [16, 16, 32], out_channels: 32, kernel: 3, padding: 1,
    activation: Tanh, batch: 4, dtype: f64);
parse_spec!(equivalence; cudnn_f16, input: [16, 16, 32], out_channels: 32, kernel: [3, 2], padding: [1, 0],
    activation: Sigmoid, batch: 8, dtype: f16);
parse_spec!(equivalence; cudnn_bf16, input: [16, 16, 32], out_channels: 32, kernel: 3, stride: [1, 2],
    padding: 1, activation: FastTanh, batch: 8, dtype: bf16);
parse_spec!(equivalence; cudnn_f16_relu, input: [16, 16, 32], out_channels: 32, kernel: 3, padding: 1,
    activation: Relu, batch: 8, dtype: f16);
parse_spec!(equivalence; direct_f16, input: [8, 9, 4], out_channels: 8, kernel: 3, stride: 2, padding: 1,
    activation: Relu, batch: 2, dtype: f16);
parse_spec!(equivalence; direct_bf16, input: [7, 7, 3], out_channels: 5, kernel: [2, 3], padding: [0, 1],
    activation: Gelu, batch: 3, dtype: bf16);

/// The rule of `conv_macros::expand::cuda` sends the small specs to the direct kernels and the
/// large ones to cuDNN: both paths are exercised above (checked at compile time).
const _: () = {
    assert!(defaults::plain::Layer::__CUDA_DIRECT);
    assert!(atari_conv1::batch_norm::Layer::__CUDA_DIRECT);
    assert!(direct_f16::layer_norm::Layer::__CUDA_DIRECT);
    assert!(direct_bf16::plain::Layer::__CUDA_DIRECT);
    assert!(
        !cudnn_f32::plain::Layer::__CUDA_DIRECT,
        "cudnn_f32 is direct"
    );
    assert!(
        !cudnn_f32_stride2::batch_norm::Layer::__CUDA_DIRECT,
        "cudnn_f32_stride2 is direct"
    );
    assert!(
        !cudnn_f64::layer_norm::Layer::__CUDA_DIRECT,
        "cudnn_f64 is direct"
    );
    assert!(
        !cudnn_f16::plain::Layer::__CUDA_DIRECT,
        "cudnn_f16 is direct"
    );
    assert!(
        !cudnn_bf16::batch_norm::Layer::__CUDA_DIRECT,
        "cudnn_bf16 is direct"
    );
    // cuDNN's fused convolution + bias + ReLU: f32 and half ReLU layers without a norm.
    assert!(cudnn_f32::plain::Layer::__CUDA_FUSED);
    assert!(cudnn_f16_relu::plain::Layer::__CUDA_FUSED);
    assert!(!cudnn_f32::batch_norm::Layer::__CUDA_FUSED);
    assert!(!cudnn_f32_stride2::plain::Layer::__CUDA_FUSED);
    assert!(!defaults::plain::Layer::__CUDA_FUSED);
};

/// A device is an error, never a panic, when there is none; with one, the architecture is the
/// GPU's own.
#[test]
fn device_reports_itself() {
    let Some(cuda) = gpu() else { return };
    assert!(cuda.arch().starts_with("sm_"), "{}", cuda.arch());
    let _ = writeln!(std::io::stderr(), "GPU: {} ({})", cuda.name(), cuda.arch());
    assert!(Cuda::new(10_000).is_err());
}

/// Buffers stay with the device that made them, even on the same GPU (each device orders its
/// work on its own stream); an empty batch is nothing to compute on either path; every
/// gradient algorithm cuDNN was asked for so far was deterministic.
#[test]
fn buffers_belong_to_their_device() {
    let Some(mut cuda) = gpu() else { return };
    let Some(other) = gpu() else { return };
    let layer = defaults::plain::Layer::new(&mut Rng::seed_from_u64(1));
    let on_gpu = defaults::plain::LayerCuda::upload(&cuda, &layer).unwrap();
    let x = CudaTensor::<f32, 2, 8, 8, 1>::zeros(&other).unwrap();
    let mut y = CudaTensor::<f32, 2, 6, 6, 1>::zeros(&cuda).unwrap();
    let error = on_gpu.evaluate(&mut cuda, &x, &mut y).unwrap_err();
    assert!(error.reason.contains("another Cuda device"), "{error}");

    let big = cudnn_f32::plain::Layer::new(&mut Rng::seed_from_u64(1));
    let (x0, mut y0) = (
        Tensor::<f32, 0, 16, 16, 32>::zeros(),
        Tensor::<f32, 0, 16, 16, 32>::zeros(),
    );
    big.evaluate(&mut cuda, &x0, &mut y0).unwrap();
    layer
        .evaluate(
            &mut cuda,
            &Tensor::<f32, 0, 8, 8, 1>::zeros(),
            &mut Tensor::<f32, 0, 6, 6, 1>::zeros(),
        )
        .unwrap();
    assert_eq!(cuda.nondeterministic_algorithms(), 0);
}

/// Without cuDNN (`scripts/cuda-stand-in.sh` runs this test with no cuDNN library to load, and
/// sets `CONV2D_NO_CUDNN=1`), the device and the layers on the direct kernels still run; a
/// layer that needs cuDNN is an error that says so. With cuDNN, both run.
#[test]
fn direct_layers_need_no_cudnn() {
    let Some(mut cuda) = gpu() else { return };
    let without = std::env::var("CONV2D_NO_CUDNN").is_ok_and(|v| v == "1");
    let layer = defaults::plain::Layer::new(&mut Rng::seed_from_u64(1));
    let x = Tensor::<f32, 2, 8, 8, 1>::from_fn(|i| (i % 5) as f32 * 0.25);
    let (mut y, mut y_cpu) = (Tensor::<f32, 2, 6, 6, 1>::zeros(), Tensor::zeros());
    layer.evaluate(&mut cuda, &x, &mut y).unwrap();
    layer.evaluate(&mut Cpu::default(), &x, &mut y_cpu).unwrap();
    same("direct evaluate", y_cpu.as_slice(), y.as_slice(), 1e-4);
    let big = cudnn_f32::plain::Layer::new(&mut Rng::seed_from_u64(1));
    let xb = Tensor::<f32, 1, 16, 16, 32>::zeros();
    let mut yb = Tensor::<f32, 1, 16, 16, 32>::zeros();
    match big.evaluate(&mut cuda, &xb, &mut yb) {
        Ok(()) => assert!(!without, "a cuDNN layer ran without cuDNN"),
        Err(e) => {
            assert!(without, "{e}");
            assert!(e.operation.contains("cuDNN"), "{e}");
        }
    }
}

/// tests/training.rs's synthetic task (which quadrant of a noisy 16x16 image holds a bright 3x3
/// blob) trained by one `network!` on the GPU, device-resident: conv1 (ReLU) -> conv2
/// (BatchNorm, ReLU) -> flatten -> dense read-out, one Adam stepping the whole network on the
/// GPU, minibatches of 32, 6 epochs; >= 95% held-out accuracy through `evaluate`, and two runs
/// with the same seed bit-identical (every GPU reduction has a fixed order).
mod training {
    use super::gpu;
    use conv_runtime::cuda::CudaTensor;
    use conv_runtime::head::argmax;
    use conv_runtime::loss::softmax_cross_entropy;
    use conv_runtime::prelude::*;

    use crate::common::quadrants::{dataset, BATCH, CLASSES, EPOCHS, PIXELS, TEST, TRAIN};

    conv_runtime::network! {
        pub struct Net {
            input: [16, 16, 1],
            batch: 32,
            layers: [
                conv1: Conv2d { out_channels: 8, kernel: 3, stride: 2, padding: 1, activation: Relu },
                conv2: Conv2d {
                    out_channels: 16, kernel: 3, stride: 2, padding: 1, activation: Relu,
                    norm: BatchNorm { momentum: 0.1, eps: 1e-5 },
                },
                flat: Flatten,
                readout: Dense { out_features: 4 },
            ],
        }
    }

    /// Epoch losses and held-out accuracy of one run. The parameters, state, gradients and
    /// optimizer state stay on the GPU for the whole run; per minibatch the images go up, the
    /// logits come down to the loss and their gradient goes up.
    fn run(cuda: &mut Cuda, seed: u64) -> (Vec<f32>, f64) {
        let mut rng = Rng::seed_from_u64(seed);
        let train = dataset(TRAIN, &mut rng);
        let test = dataset(TEST, &mut rng);
        let mut net = NetCuda::upload(cuda, &Net::new(&mut rng)).unwrap();
        let mut adam = Adam::new(1e-2);
        let mut grads = NetCudaGrads::zeros(cuda).unwrap();
        let mut state = NetCudaState::new(cuda).unwrap();
        let mut x = NetInput::<BATCH>::zeros();
        let mut x_gpu = CudaTensor::zeros(cuda).unwrap();
        let mut logits = Tensor::<f32, BATCH, 1, 1, CLASSES>::zeros();
        let mut d_logits = NetOutput::<BATCH>::zeros();
        let mut d_logits_gpu = CudaTensor::zeros(cuda).unwrap();
        let mut labels = vec![0usize; BATCH];
        let mut order: Vec<usize> = (0..TRAIN).collect();
        let mut losses = Vec::new();
        for _ in 0..EPOCHS {
            for i in (1..TRAIN).rev() {
                let j = (rng.uniform(0.0, (i + 1) as f64) as usize).min(i);
                order.swap(i, j);
            }
            let mut epoch = 0.0f32;
            for batch in order.chunks_exact(BATCH) {
                for (b, &i) in batch.iter().enumerate() {
                    x.as_mut_slice()[b * PIXELS..(b + 1) * PIXELS]
                        .copy_from_slice(&train.images[i * PIXELS..(i + 1) * PIXELS]);
                    labels[b] = train.labels[i];
                }
                x_gpu.copy_from_host(cuda, &x).unwrap();
                net.forward(cuda, &x_gpu, &mut state, Mode::Train).unwrap();
                state.output().download_into(cuda, &mut logits).unwrap();
                let host_logits = NetOutput::<BATCH>::from_vec(logits.as_slice().to_vec()).unwrap();
                let loss = softmax_cross_entropy(&host_logits, &labels, &mut d_logits)
                    .unwrap()
                    .mean as f32;
                assert!(loss.is_finite(), "loss {loss}");
                let d_host = Tensor::from_vec(d_logits.as_slice().to_vec()).unwrap();
                d_logits_gpu.copy_from_host(cuda, &d_host).unwrap();
                net.backward(cuda, &state, &x_gpu, &d_logits_gpu, &mut grads, Mode::Train)
                    .unwrap();
                adam.step_cuda(cuda, &mut net, &grads).unwrap();
                grads.zero(cuda).unwrap();
                epoch += loss;
            }
            losses.push(epoch / (TRAIN / BATCH) as f32);
        }
        let x_test =
            CudaTensor::upload(cuda, &NetInput::<TEST>::from_vec(test.images).unwrap()).unwrap();
        let mut y = CudaTensor::<f32, TEST, 1, 1, CLASSES>::zeros(cuda).unwrap();
        net.evaluate(cuda, &x_test, &mut y).unwrap();
        let y = y.download(cuda).unwrap();
        let correct = y
            .as_slice()
            .chunks_exact(CLASSES)
            .map(argmax)
            .zip(&test.labels)
            .filter(|(p, label)| p == *label)
            .count();
        (losses, correct as f64 / TEST as f64)
    }

    #[test]
    fn quadrant_task_trains_on_the_gpu() {
        let Some(mut cuda) = gpu() else { return };
        let start = std::time::Instant::now();
        let (losses, accuracy) = run(&mut cuda, 7);
        eprintln!(
            "GPU training: losses {losses:?}, test accuracy {accuracy} in {:.2?}",
            start.elapsed()
        );
        assert!(
            losses.last().unwrap() < &(0.25 * losses[0]),
            "the loss did not fall: {losses:?}"
        );
        assert!(
            accuracy >= 0.95,
            "test accuracy {accuracy} < 95% (losses {losses:?})"
        );
        let (again, _) = run(&mut cuda, 7);
        assert_eq!(
            losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            again.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
            "two GPU runs with the same seed differ"
        );
    }
}

/// `network!` on the GPU, device-resident (`NetCuda`), against the CPU's generated code:
/// evaluate at three batches, forward in both modes (BatchNorm's running statistics), both
/// backward passes, and optimizer steps on the GPU that equal the CPU's bit for bit from the
/// same gradients. `network_equivalence!(module, dtype, input [h, w, c], output [h, w, c],
/// [entries])`, at batch 4.
macro_rules! network_equivalence {
    ($module:ident, $dtype:ident, [$ih:literal, $iw:literal, $ic:literal], [$oh:literal, $ow:literal, $oc:literal], [$($layers:tt)*]) => {
        mod $module {
            use crate::common::{convert, SplitMix64};
            use crate::{gpu, gradient_tolerance, same, tolerance};
            use conv_runtime::cuda::CudaTensor;
            use conv_runtime::prelude::*;

            conv_runtime::network! {
                pub struct Net {
                    input: [$ih, $iw, $ic],
                    batch: 4,
                    dtype: $dtype,
                    layers: [$($layers)*],
                }
            }

            type T = $dtype;
            type A = <T as Element>::Acc;
            const B: usize = 4;

            /// Every tensor `visit` (parameters) or `visit_buffers_mut` (running statistics)
            /// shows, by name.
            fn values(net: &mut Net) -> Vec<(String, Vec<f64>)> {
                let mut all = Vec::new();
                net.visit(&mut |name, v| all.push((name.to_string(), v.iter().map(|x| x.to_f64()).collect())));
                net.visit_buffers_mut(&mut |name, t| {
                    all.push((name.to_string(), t.values().iter().map(|x| x.to_f64()).collect()))
                });
                all
            }

            /// Every gradient in `grads`, by name.
            fn gradients(grads: &NetGrads) -> Vec<(String, Vec<f64>)> {
                let mut all = Vec::new();
                Net::new(&mut Rng::seed_from_u64(0)).visit_mut(grads, &mut |name, _, g| {
                    all.push((name.to_string(), g.iter().map(|x| x.to_f64()).collect()))
                });
                all
            }

            #[test]
            fn resident_network_matches_the_cpu() {
                let Some(mut cuda) = gpu() else { return };
                let tol = tolerance::<T>();
                let mut data = SplitMix64::new(0x0c0d_c000);
                let net = Net::new(&mut Rng::seed_from_u64(7));
                let mut cpu = Cpu::default();
                let mut on_gpu = NetCuda::upload(&cuda, &net).unwrap();

                // Inference at batches 1, 3 and the training batch.
                macro_rules! evaluate_at {
                    ($b:literal) => {{
                        let x = NetInput::<$b>::from_vec(convert(&data.values(NetInput::<$b>::LEN))).unwrap();
                        let mut y_cpu = NetOutput::<$b>::zeros();
                        net.evaluate(&mut cpu, &x, &mut y_cpu).unwrap();
                        let x_gpu = CudaTensor::upload(&cuda, &x).unwrap();
                        let mut y_gpu = CudaTensor::<T, $b, $oh, $ow, $oc>::zeros(&cuda).unwrap();
                        on_gpu.evaluate(&mut cuda, &x_gpu, &mut y_gpu).unwrap();
                        let y_gpu = y_gpu.download(&cuda).unwrap();
                        same(concat!("evaluate at batch ", $b), y_cpu.as_slice(), y_gpu.as_slice(), tol);
                    }};
                }
                evaluate_at!(1);
                evaluate_at!(3);
                evaluate_at!(4);

                let x = NetInput::<B>::from_vec(convert(&data.values(NetInput::<B>::LEN))).unwrap();
                let d_output = NetOutput::<B>::from_vec(convert(&data.values(NetOutput::<B>::LEN))).unwrap();
                let x_gpu = CudaTensor::upload(&cuda, &x).unwrap();
                let dy_gpu = CudaTensor::upload(&cuda, &Tensor::<T, B, $oh, $ow, $oc>::from_vec(d_output.as_slice().to_vec()).unwrap()).unwrap();
                let rows = B * $ih * $iw;
                for mode in [Mode::Train, Mode::Eval] {
                    let bn_train = matches!(mode, Mode::Train);
                    let (mut n_cpu, mut n_gpu) = (net.clone(), NetCuda::upload(&cuda, &net).unwrap());
                    let (mut s_cpu, mut s_gpu) = (NetState::new(), NetCudaState::new(&cuda).unwrap());
                    n_cpu.forward(&mut cpu, &x, &mut s_cpu, mode).unwrap();
                    n_gpu.forward(&mut cuda, &x_gpu, &mut s_gpu, mode).unwrap();
                    let y = s_gpu.output().download(&cuda).unwrap();
                    same("forward", s_cpu.output().as_slice(), y.as_slice(), tol);
                    let mut back = Net::new(&mut Rng::seed_from_u64(1));
                    n_gpu.download_into(&cuda, &mut back).unwrap();
                    for ((name, c), (_, g)) in values(&mut n_cpu).iter().zip(&values(&mut back)) {
                        same(&format!("after forward: {name}"), c, g, tol);
                    }

                    let (mut dx_cpu, mut g_cpu) = (NetInput::<B>::zeros(), NetGrads::zeros());
                    n_cpu.backward_full(&mut cpu, &s_cpu, &x, &d_output, &mut dx_cpu, &mut g_cpu, mode).unwrap();
                    let mut dx_gpu = CudaTensor::zeros(&cuda).unwrap();
                    let mut g_gpu = NetCudaGrads::zeros(&cuda).unwrap();
                    n_gpu.backward_full(&mut cuda, &s_gpu, &x_gpu, &dy_gpu, &mut dx_gpu, &mut g_gpu, mode).unwrap();
                    same("backward_full d_input", dx_cpu.as_slice(), dx_gpu.download(&cuda).unwrap().as_slice(), tol);
                    let mut g_host = NetGrads::zeros();
                    g_gpu.download_into(&cuda, &mut g_host).unwrap();
                    for ((name, c), (_, g)) in gradients(&g_cpu).iter().zip(&gradients(&g_host)) {
                        let field = name.rsplit('.').next().unwrap_or("");
                        let t = if name.starts_with("conv1.") { gradient_tolerance(field, bn_train, rows, tol) } else { tol };
                        same(&format!("backward_full d_{name}"), c, g, t);
                    }

                    // `backward` adds the parameter gradients again.
                    n_gpu.backward(&mut cuda, &s_gpu, &x_gpu, &dy_gpu, &mut g_gpu, mode).unwrap();
                    let mut twice = NetGrads::zeros();
                    g_gpu.download_into(&cuda, &mut twice).unwrap();
                    for ((name, once), (_, two)) in gradients(&g_host).iter().zip(&gradients(&twice)) {
                        let doubled: Vec<f64> = once.iter().map(|g| 2.0 * g).collect();
                        same(&format!("backward accumulates d_{name}"), &doubled, two, tol);
                    }
                }

                // Training steps on the GPU equal the CPU's from the same gradients.
                let mut reference = net.clone();
                let mut s_gpu = NetCudaState::new(&cuda).unwrap();
                let mut g_gpu = NetCudaGrads::zeros(&cuda).unwrap();
                let mut g_host = NetGrads::zeros();
                let lr = <A as Element>::from_f64(1e-2);
                let (mut adam_cpu, mut adam_gpu) = (Adam::new(lr), Adam::new(lr));
                let rmsprop = || RmsProp::new(lr).with_centered(true).with_alpha(<A as Element>::from_f64(0.95));
                let (mut rms_cpu, mut rms_gpu) = (rmsprop(), rmsprop());
                let mut check = Net::new(&mut Rng::seed_from_u64(2));
                for step in 0..4 {
                    g_gpu.zero(&cuda).unwrap();
                    on_gpu.forward(&mut cuda, &x_gpu, &mut s_gpu, Mode::Train).unwrap();
                    on_gpu.backward(&mut cuda, &s_gpu, &x_gpu, &dy_gpu, &mut g_gpu, Mode::Train).unwrap();
                    g_gpu.download_into(&cuda, &mut g_host).unwrap();
                    // The CPU follows the GPU's running statistics and parameters.
                    on_gpu.download_into(&cuda, &mut check).unwrap();
                    if step < 2 {
                        adam_cpu.step(&mut reference, &g_host);
                        adam_gpu.step_cuda(&mut cuda, &mut on_gpu, &g_gpu).unwrap();
                    } else {
                        rms_cpu.step(&mut reference, &g_host);
                        rms_gpu.step_cuda(&mut cuda, &mut on_gpu, &g_gpu).unwrap();
                    }
                    on_gpu.download_into(&cuda, &mut check).unwrap();
                    let (mut expected, mut got) = (Vec::new(), Vec::new());
                    reference.visit(&mut |name, v| expected.push((name.to_string(), v.to_vec())));
                    check.visit(&mut |name, v| got.push((name.to_string(), v.to_vec())));
                    for ((name, e), (_, g)) in expected.iter().zip(&got) {
                        let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
                        assert!(bits(e) == bits(g), "step {step}: the GPU optimizer's `{name}` differs from the CPU's");
                    }
                }
            }
        }
    };
}

/// Every kind: conv with BatchNorm, max and average pooling with padding, a residual block,
/// standalone activations, flatten, dense layers.
macro_rules! every_kind {
    ($module:ident, $dtype:ident) => {
        network_equivalence!($module, $dtype, [9, 7, 3], [1, 1, 4], [
            conv1: Conv2d {
                out_channels: 8, kernel: [3, 5], padding: [1, 2], activation: Relu,
                norm: BatchNorm { momentum: 0.3, eps: 1e-3 },
            },
            pool: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
            res: Residual { layers: [
                act: Activation(Relu),
                conv: Conv2d { out_channels: 8, kernel: 3, padding: 1, activation: Tanh },
            ] },
            avg: AvgPool2d { kernel: 2, stride: 1, padding: 1 },
            squash: Activation(Sigmoid),
            flat: Flatten,
            fc: Dense { out_features: 10, activation: Relu },
            out: Dense { out_features: 4 },
        ]);
    };
}
every_kind!(network_f32, f32);
every_kind!(network_f64, f64);

// The ends of a chain: a residual block first (the input gradient through it, its inner chain
// starting with pooling) and a `Flatten` last (the output a view of the last map).
network_equivalence!(network_residual_first, f64, [9, 7, 3], [1, 1, 60], [
    res: Residual { layers: [
        avg: AvgPool2d { kernel: 3, stride: 1, padding: 1 },
        conv: Conv2d { out_channels: 3, kernel: 1, activation: Gelu },
    ] },
    act: Activation(Tanh),
    pool: MaxPool2d { kernel: 2, padding: 1 },
    flat: Flatten,
]);

// A `Flatten` first (the input gradient a copy) and a residual block last (writing the output).
network_equivalence!(network_flatten_first, f64, [3, 2, 5], [1, 1, 6], [
    flat: Flatten,
    fc: Dense { out_features: 6, activation: Sigmoid },
    res: Residual { layers: [
        act: Activation(Relu),
        fc2: Dense { out_features: 6 },
    ] },
]);

// Two residual blocks of the same layers, the second's compiled as the first's: each keeps its
// own parameters on the GPU too.
network_equivalence!(network_repeated_blocks, f32, [6, 6, 4], [1, 1, 3], [
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
]);

/// Max-pooling's rules where windows tie, hold NaN or are all -inf (PyTorch's: the first
/// maximum in row-major order wins, the last NaN wins, an all -inf window's first position): the
/// GPU's outputs and input gradient equal the CPU's bit for bit.
mod pool_edge_cases {
    use crate::gpu;
    use conv_runtime::cuda::CudaTensor;
    use conv_runtime::prelude::*;

    conv_runtime::network! {
        pub struct Pool {
            input: [5, 5, 9],
            batch: 2,
            layers: [p: MaxPool2d { kernel: 3, stride: 2, padding: 1 }],
        }
    }

    fn same_bits(what: &str, cpu: &[f32], gpu: &[f32]) {
        for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
            assert!(
                c.to_bits() == g.to_bits() || (c.is_nan() && g.is_nan()),
                "{what}: element {i} is {g} on the GPU, {c} on the CPU"
            );
        }
    }

    #[test]
    fn ties_nan_and_negative_infinity_as_on_the_cpu() {
        let Some(mut cuda) = gpu() else { return };
        let mut x = PoolInput::<2>::zeros();
        crate::common::pooling_edge_values(x.as_mut_slice(), 5 * 5 * 9, 9);
        let mut d_output = PoolOutput::<2>::zeros();
        for (o, v) in d_output.as_mut_slice().iter_mut().enumerate() {
            *v = (o + 1) as f32;
        }
        let mut cpu = Cpu::default();
        let mut net = Pool::new(&mut Rng::seed_from_u64(1));
        let mut y_cpu = PoolOutput::<2>::zeros();
        net.evaluate(&mut cpu, &x, &mut y_cpu).unwrap();
        let mut s_cpu = PoolState::new();
        net.forward(&mut cpu, &x, &mut s_cpu, Mode::Train).unwrap();
        let (mut dx_cpu, mut g_cpu) = (PoolInput::<2>::zeros(), PoolGrads::zeros());
        net.backward_full(
            &mut cpu,
            &s_cpu,
            &x,
            &d_output,
            &mut dx_cpu,
            &mut g_cpu,
            Mode::Train,
        )
        .unwrap();

        let mut on_gpu = PoolCuda::upload(&cuda, &net).unwrap();
        let x_gpu = CudaTensor::upload(&cuda, &x).unwrap();
        let dy_gpu = CudaTensor::upload(&cuda, &d_output).unwrap();
        let mut y_gpu = CudaTensor::<f32, 2, 3, 3, 9>::zeros(&cuda).unwrap();
        on_gpu.evaluate(&mut cuda, &x_gpu, &mut y_gpu).unwrap();
        same_bits(
            "evaluate",
            y_cpu.as_slice(),
            y_gpu.download(&cuda).unwrap().as_slice(),
        );
        let mut s_gpu = PoolCudaState::new(&cuda).unwrap();
        on_gpu
            .forward(&mut cuda, &x_gpu, &mut s_gpu, Mode::Train)
            .unwrap();
        let y = s_gpu.output().download(&cuda).unwrap();
        same_bits("forward", s_cpu.output().as_slice(), y.as_slice());
        let mut dx_gpu = CudaTensor::zeros(&cuda).unwrap();
        let mut g_gpu = PoolCudaGrads::zeros(&cuda).unwrap();
        on_gpu
            .backward_full(
                &mut cuda,
                &s_gpu,
                &x_gpu,
                &dy_gpu,
                &mut dx_gpu,
                &mut g_gpu,
                Mode::Train,
            )
            .unwrap();
        same_bits(
            "d_input",
            dx_cpu.as_slice(),
            dx_gpu.download(&cuda).unwrap().as_slice(),
        );
    }
}
