//! Optimizers with PyTorch's semantics, generic over anything that implements [`Parameters`].
//!
//! Each optimizer keeps its state (moments, momentum buffers) in the accumulator type, sized
//! from the parameters on the first step, one state per parameter tensor in visiting order.
//! Layers stored in f16/bf16 also get an f32 *master copy* of their parameters here, in the
//! optimizer's state: updates are applied to the master copy and rounded into the layer, so
//! steps smaller than the half type's resolution still accumulate instead of being lost. If
//! the parameters change outside the optimizer (their stamp differs from the one the optimizer
//! wrote), the master copy is re-read from them.

use std::any::TypeId;

use crate::cpu::{Cpu, Pool, Shared};
use crate::element::{Element, Real};
use crate::params::{ParamTensor, Parameters};

/// Per-parameter-tensor state.
struct Slot<A> {
    /// First moment / momentum buffer.
    m: Vec<A>,
    /// Second moment (Adam), mean of the squared gradients (RMSprop).
    v: Vec<A>,
    /// Mean of the gradients (centered RMSprop).
    mean: Vec<A>,
    /// f32 master copy of half-precision parameters (empty otherwise).
    master: Vec<A>,
    /// The stamp the parameters had after this optimizer last wrote them.
    written: u64,
}

/// State shared by the optimizers: slots, and the step count.
struct State<A> {
    slots: Vec<Slot<A>>,
    step: u64,
}

impl<A: Real> State<A> {
    fn new() -> Self {
        Self {
            slots: Vec::new(),
            step: 0,
        }
    }

    /// Runs `update` over every parameter tensor (with its gradient and the optimizer's state,
    /// `v` and `mean` allocated where asked), handling the master copy. With a pool, a tensor
    /// large enough is cut into contiguous parts updated on its threads: element by element,
    /// the same arithmetic, so the same bits whatever the threads.
    fn apply<P: Parameters>(
        &mut self,
        params: &mut P,
        grads: &P::Grads,
        pool: Option<&Pool>,
        (with_v, with_mean): (bool, bool),
        update: &(dyn Fn(Part<'_, A>) + Sync),
    ) where
        P::Elem: Element<Acc = A>,
    {
        let needs_master = TypeId::of::<P::Elem>() != TypeId::of::<A>();
        let mut index = 0;
        let slots = &mut self.slots;
        params.visit_mut(
            grads,
            &mut |_, tensor: &mut dyn ParamTensor<P::Elem>, grad: &[A]| {
                let n = grad.len();
                if slots.len() == index {
                    slots.push(Slot {
                        m: vec![A::zero(); n],
                        v: Vec::new(),
                        mean: Vec::new(),
                        master: Vec::new(),
                        written: 0,
                    });
                }
                let slot = &mut slots[index];
                index += 1;
                if with_v && slot.v.len() != n {
                    slot.v = vec![A::zero(); n];
                }
                if with_mean && slot.mean.len() != n {
                    slot.mean = vec![A::zero(); n];
                }
                if needs_master {
                    if slot.master.len() != n || slot.written != tensor.stamp() {
                        slot.master = tensor.values().iter().map(|v| v.to_acc()).collect();
                    }
                    let mut master = std::mem::take(&mut slot.master);
                    run_parts(pool, slot, grad, &mut master, update);
                    let values = tensor.values_mut();
                    P::Elem::from_acc_slice(&master, values);
                    slot.master = master;
                    slot.written = tensor.stamp();
                } else {
                    // Element and accumulator are the same type: update in place.
                    let values = tensor.values_mut();
                    // SAFETY: `P::Elem` is `A` (checked by `TypeId` above), so the cast is the identity.
                    let values: &mut [A] = unsafe {
                        std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut A, values.len())
                    };
                    run_parts(pool, slot, grad, values, update);
                }
            },
        );
    }
}

/// One tensor's elements (or a contiguous part of them) in a step: the values, their gradients
/// and the optimizer's state, each of one length (`v` and `mean` empty where not kept).
struct Part<'a, A> {
    values: &'a mut [A],
    grad: &'a [A],
    m: &'a mut [A],
    v: &'a mut [A],
    mean: &'a mut [A],
}

/// The work of one element of an optimizer step, in [`Pool::workers`]' multiply-adds: a square
/// root and a division or two.
const STEP_WORK: usize = 2 * crate::cpu::ELEMENT_WORK;

/// `update` over one tensor: in one part, or with a pool in one contiguous part per worker.
fn run_parts<A: Real>(
    pool: Option<&Pool>,
    slot: &mut Slot<A>,
    grad: &[A],
    values: &mut [A],
    update: &(dyn Fn(Part<'_, A>) + Sync),
) {
    let n = values.len();
    let (m, v, mean) = (&mut slot.m[..n], &mut slot.v[..], &mut slot.mean[..]);
    let Some(pool) = pool.filter(|p| p.workers(n, n * STEP_WORK) > 1) else {
        update(Part {
            values,
            grad,
            m,
            v,
            mean,
        });
        return;
    };
    let [values, m, v, mean] = [values, m, v, mean].map(Shared::new);
    pool.split(n, STEP_WORK, &|range| {
        let (start, len) = (range.start, range.len());
        update(Part {
            // SAFETY: the workers' ranges are disjoint.
            values: unsafe { values.part(start, len) },
            grad: &grad[range],
            // SAFETY: as the values.
            m: unsafe { state_part(&m, start, len) },
            v: unsafe { state_part(&v, start, len) },
            mean: unsafe { state_part(&mean, start, len) },
        });
    });
}

/// Elements `start..start + len` of a kept state; an empty one (not kept) stays empty.
///
/// # Safety
/// As [`Shared::part`].
unsafe fn state_part<'a, A>(s: &Shared<'a, A>, start: usize, len: usize) -> &'a mut [A] {
    if s.is_empty() {
        Default::default()
    } else {
        // SAFETY: the caller's.
        unsafe { s.part(start, len) }
    }
}

/// An optimizer's `step` (on the calling thread) and `step_on` (on a device's threads), both
/// through its `step_with`.
macro_rules! steps {
    ($name:ident) => {
        /// One step on `params` with `grads`.
        pub fn step<P: Parameters>(&mut self, params: &mut P, grads: &P::Grads)
        where
            P::Elem: Element<Acc = A>,
        {
            self.step_with(None, params, grads);
        }

        #[doc = concat!("[`", stringify!($name), "::step`] on the device's threads: a tensor large")]
        /// enough is cut into one part per thread. The same bits as `step`, whatever the
        /// threads.
        pub fn step_on<P: Parameters>(&mut self, cpu: &Cpu, params: &mut P, grads: &P::Grads)
        where
            P::Elem: Element<Acc = A>,
        {
            self.step_with(Some(cpu.__pool()), params, grads);
        }
    };
}

/// Stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight decay
/// (`torch.optim.SGD`).
pub struct Sgd<A: Real> {
    /// Learning rate.
    pub lr: A,
    /// Momentum factor (0: plain SGD).
    pub momentum: A,
    /// Dampening of the momentum's gradient term.
    pub dampening: A,
    /// L2 penalty added to the gradient.
    pub weight_decay: A,
    /// Nesterov momentum.
    pub nesterov: bool,
    state: State<A>,
    #[cfg(feature = "cuda")]
    device: crate::cuda::optim::DeviceState,
}

impl<A: Real> Sgd<A> {
    /// SGD with learning rate `lr`, other settings off.
    pub fn new(lr: A) -> Self {
        Self {
            lr,
            momentum: A::zero(),
            dampening: A::zero(),
            weight_decay: A::zero(),
            nesterov: false,
            state: State::new(),
            #[cfg(feature = "cuda")]
            device: Default::default(),
        }
    }

    /// Sets the momentum factor.
    pub fn with_momentum(mut self, momentum: A) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the L2 weight decay.
    pub fn with_weight_decay(mut self, weight_decay: A) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    steps!(Sgd);

    fn step_with<P: Parameters>(&mut self, pool: Option<&Pool>, params: &mut P, grads: &P::Grads)
    where
        P::Elem: Element<Acc = A>,
    {
        let (lr, momentum, dampening, wd, nesterov) = (
            self.lr,
            self.momentum,
            self.dampening,
            self.weight_decay,
            self.nesterov,
        );
        let first = self.state.step == 0;
        self.state.step += 1;
        let k = SgdStep {
            lr,
            momentum,
            dampening,
            wd,
            nesterov,
            first,
            exact: crate::denormals::assists(),
        };
        self.state
            .apply(params, grads, pool, (false, false), &|p| sgd_update(p, &k));
    }

    /// One step on parameters that live on the GPU, with the same arithmetic as [`Sgd::step`]
    /// (bit for bit); its state stays on the GPU. An optimizer steps one parameter set, on the
    /// CPU or on one GPU. After an error some tensors may have been stepped and others not:
    /// reset the optimizer (and restore the parameters) before going on.
    #[cfg(feature = "cuda")]
    pub fn step_cuda<P: crate::cuda::CudaParameters>(
        &mut self,
        dev: &mut crate::cuda::Cuda,
        params: &mut P,
        grads: &P::Grads,
    ) -> crate::Result<()>
    where
        P::Elem: Element<Acc = A>,
    {
        let update = crate::cuda::optim::Update::Sgd {
            lr: self.lr.to_f64(),
            momentum: self.momentum.to_f64(),
            dampening: self.dampening.to_f64(),
            weight_decay: self.weight_decay.to_f64(),
            nesterov: self.nesterov,
            first: self.state.step == 0,
        };
        self.device.apply(dev, params, grads, &update)?;
        self.state.step += 1;
        Ok(())
    }

    /// Forgets the momentum buffers (and master copies).
    pub fn reset(&mut self) {
        self.state = State::new();
        #[cfg(feature = "cuda")]
        {
            self.device = Default::default();
        }
    }
}

/// Adam with bias correction and L2 weight decay (`torch.optim.Adam`).
pub struct Adam<A: Real> {
    /// Learning rate.
    pub lr: A,
    /// Decay of the first moment.
    pub beta1: A,
    /// Decay of the second moment.
    pub beta2: A,
    /// Added to the denominator's square root.
    pub eps: A,
    /// L2 penalty added to the gradient.
    pub weight_decay: A,
    state: State<A>,
    #[cfg(feature = "cuda")]
    device: crate::cuda::optim::DeviceState,
}

impl<A: Real> Adam<A> {
    /// Adam with learning rate `lr` and PyTorch's defaults otherwise (0.9, 0.999, 1e-8, 0).
    pub fn new(lr: A) -> Self {
        Self {
            lr,
            beta1: A::from_f64(0.9),
            beta2: A::from_f64(0.999),
            eps: A::from_f64(1e-8),
            weight_decay: A::zero(),
            state: State::new(),
            #[cfg(feature = "cuda")]
            device: Default::default(),
        }
    }

    /// Sets the moment decays.
    pub fn with_betas(mut self, beta1: A, beta2: A) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }

    /// Sets epsilon.
    pub fn with_eps(mut self, eps: A) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the L2 weight decay.
    pub fn with_weight_decay(mut self, weight_decay: A) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Steps taken since creation or the last reset.
    pub fn steps(&self) -> u64 {
        self.state.step
    }

    steps!(Adam);

    fn step_with<P: Parameters>(&mut self, pool: Option<&Pool>, params: &mut P, grads: &P::Grads)
    where
        P::Elem: Element<Acc = A>,
    {
        self.state.step += 1;
        let (correction2_sqrt, step_size) = self.corrections(self.state.step);
        let k = AdamStep {
            b1: self.beta1,
            b2: self.beta2,
            eps: self.eps,
            wd: self.weight_decay,
            correction2_sqrt,
            step_size,
            exact: crate::denormals::assists(),
        };
        self.state
            .apply(params, grads, pool, (true, false), &|p| adam_update(p, &k));
    }

    /// One step on parameters that live on the GPU, with the same arithmetic as [`Adam::step`]
    /// (bit for bit); its state stays on the GPU. An optimizer steps one parameter set, on the
    /// CPU or on one GPU. After an error some tensors may have been stepped and others not:
    /// reset the optimizer (and restore the parameters) before going on.
    #[cfg(feature = "cuda")]
    pub fn step_cuda<P: crate::cuda::CudaParameters>(
        &mut self,
        dev: &mut crate::cuda::Cuda,
        params: &mut P,
        grads: &P::Grads,
    ) -> crate::Result<()>
    where
        P::Elem: Element<Acc = A>,
    {
        let t = self.state.step + 1;
        let (correction2_sqrt, step_size) = self.corrections(t);
        let update = crate::cuda::optim::Update::Adam {
            step_size: step_size.to_f64(),
            beta1: self.beta1.to_f64(),
            beta2: self.beta2.to_f64(),
            eps: self.eps.to_f64(),
            weight_decay: self.weight_decay.to_f64(),
            correction2_sqrt: correction2_sqrt.to_f64(),
        };
        self.device.apply(dev, params, grads, &update)?;
        self.state.step = t;
        Ok(())
    }

    /// `sqrt(1 - beta2^t)` and `lr / (1 - beta1^t)`, in the accumulator type.
    fn corrections(&self, t: u64) -> (A, A) {
        let t = t as i32;
        let correction1 = A::ONE - self.beta1.powi(t);
        let step_size = self.lr / correction1;
        let correction2_sqrt = (A::ONE - self.beta2.powi(t)).sqrt();
        (correction2_sqrt, step_size)
    }

    /// Forgets the moments, the step count (and master copies).
    pub fn reset(&mut self) {
        self.state = State::new();
        #[cfg(feature = "cuda")]
        {
            self.device = Default::default();
        }
    }
}

/// RMSprop (`torch.optim.RMSprop`): each step divides the gradient by a running root mean
/// square of the gradients, optionally centered, with L2 weight decay and momentum.
///
/// Per parameter, with gradient `g` (plus `weight_decay * p`), the state starting at zero:
///
/// ```text
/// v    = alpha * v + (1 - alpha) * g * g
/// mean = lerp(mean, g, 1 - alpha)                  (centered only)
/// avg  = sqrt(v - mean * mean) + eps               (centered)
///      = sqrt(v) + eps                             (otherwise)
/// buf  = momentum * buf + g / avg;   p -= lr * buf (momentum > 0)
///                                    p -= lr * (g / avg)
/// ```
///
/// These are PyTorch's operations in PyTorch's order, PyTorch's `lerp` included (`mean + w *
/// (g - mean)` for a weight `w < 0.5`, `g - (g - mean) * (1 - w)` otherwise), so a step differs
/// from PyTorch's only by the rounding of the scalars, which are computed in the accumulator
/// type here (`1 - alpha` in f32 for f32 layers; PyTorch computes it in f64 in Python). Three
/// points that differ from other RMSprop implementations and matter when porting settings:
/// `eps` is added outside the square root (TensorFlow adds it inside); the momentum buffer
/// starts at zero, not at the first update; and unlike [`Adam`] there is no bias correction,
/// so the first steps are large: the first moves each parameter by about
/// `lr / sqrt(1 - alpha)` (10 `lr` at the default alpha) against its gradient's sign.
///
/// Centered: `v - mean^2` is a running variance, positive in exact arithmetic; as in PyTorch
/// it is not clamped, so a gradient that stays constant for thousands of steps can round it
/// below zero and make the step NaN.
///
/// ```
/// use conv_runtime::prelude::*;
///
/// conv_runtime::conv2d! {
///     pub struct Conv { input: [6, 6, 2], out_channels: 3, kernel: 3, batch: 2 }
/// }
///
/// # fn main() -> conv_runtime::Result<()> {
/// let mut cpu = Cpu::default();
/// let mut layer = Conv::new(&mut Rng::seed_from_u64(1));
/// let (mut grads, mut state) = (ConvGrads::zeros(), ConvState::new());
/// let x = Tensor::<f32, 2, 6, 6, 2>::from_fn(|i| (i % 5) as f32 * 0.25 - 0.5);
/// let d_output = Tensor::<f32, 2, 4, 4, 3>::from_fn(|i| (i % 3) as f32 - 1.0);
/// layer.forward(&mut cpu, &x, &mut state, Mode::Train)?;
/// layer.backward(&mut cpu, &state, &x, &d_output, &mut grads, Mode::Train)?;
///
/// let before = layer.clone();
/// let mut rmsprop = RmsProp::new(1e-3);
/// rmsprop.step(&mut layer, &grads);
/// // The first step: v = 0.01 g^2, so p moves by lr * g / (0.1 |g| + eps), 10 lr against g.
/// for (p, p0, g) in [
///     (layer.weights.as_slice(), before.weights.as_slice(), grads.weights.as_slice()),
///     (layer.biases.as_slice(), before.biases.as_slice(), grads.biases.as_slice()),
/// ] {
///     for i in 0..p.len() {
///         let expected = p0[i] - 1e-3 * g[i] / ((0.01 * g[i] * g[i]).sqrt() + 1e-8);
///         assert!((p[i] - expected).abs() <= 1e-6 * expected.abs().max(1.0));
///     }
/// }
/// # Ok(())
/// # }
/// ```
pub struct RmsProp<A: Real> {
    /// Learning rate.
    pub lr: A,
    /// Smoothing constant: the weight of the past in the running means (PyTorch's `alpha`).
    pub alpha: A,
    /// Added to the denominator, outside the square root.
    pub eps: A,
    /// L2 penalty added to the gradient.
    pub weight_decay: A,
    /// Momentum factor (0: none).
    pub momentum: A,
    /// Normalizes by the running variance of the gradient instead of its mean square.
    pub centered: bool,
    state: State<A>,
    #[cfg(feature = "cuda")]
    device: crate::cuda::optim::DeviceState,
}

impl<A: Real> RmsProp<A> {
    /// RMSprop with learning rate `lr` and PyTorch's defaults otherwise (alpha 0.99, eps 1e-8,
    /// no weight decay, no momentum, not centered).
    pub fn new(lr: A) -> Self {
        Self {
            lr,
            alpha: A::from_f64(0.99),
            eps: A::from_f64(1e-8),
            weight_decay: A::zero(),
            momentum: A::zero(),
            centered: false,
            state: State::new(),
            #[cfg(feature = "cuda")]
            device: Default::default(),
        }
    }

    /// Sets the smoothing constant.
    pub fn with_alpha(mut self, alpha: A) -> Self {
        self.alpha = alpha;
        self
    }

    /// Sets epsilon.
    pub fn with_eps(mut self, eps: A) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the L2 weight decay.
    pub fn with_weight_decay(mut self, weight_decay: A) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Sets the momentum factor.
    pub fn with_momentum(mut self, momentum: A) -> Self {
        self.momentum = momentum;
        self
    }

    /// Centers the second moment (PyTorch's `centered=True`).
    pub fn with_centered(mut self, centered: bool) -> Self {
        self.centered = centered;
        self
    }

    /// Steps taken since creation or the last reset.
    pub fn steps(&self) -> u64 {
        self.state.step
    }

    steps!(RmsProp);

    fn step_with<P: Parameters>(&mut self, pool: Option<&Pool>, params: &mut P, grads: &P::Grads)
    where
        P::Elem: Element<Acc = A>,
    {
        self.state.step += 1;
        let (lr, alpha, eps, wd, momentum, centered) = (
            self.lr,
            self.alpha,
            self.eps,
            self.weight_decay,
            self.momentum,
            self.centered,
        );
        // `1 - alpha` is the weight of the new gradient in both running means.
        let weight = A::ONE - alpha;
        let small_weight = weight.abs() < A::from_f64(0.5);
        // PyTorch keeps a momentum buffer only for momentum > 0 (a negative one is rejected
        // there, skipped here).
        let with_momentum = momentum > A::zero();
        let k = RmsPropStep {
            lr,
            alpha,
            eps,
            wd,
            momentum,
            weight,
            exact: crate::denormals::assists(),
        };
        self.state
            .apply(params, grads, pool, (true, centered), &|slices| {
                // The options fixed for the loop, so that it vectorizes (AVX2 where the CPU has it).
                match (centered, with_momentum, small_weight) {
                    (false, false, _) => rmsprop_update::<A, false, false, false>(slices, &k),
                    (false, true, _) => rmsprop_update::<A, false, true, false>(slices, &k),
                    (true, false, false) => rmsprop_update::<A, true, false, false>(slices, &k),
                    (true, false, true) => rmsprop_update::<A, true, false, true>(slices, &k),
                    (true, true, false) => rmsprop_update::<A, true, true, false>(slices, &k),
                    (true, true, true) => rmsprop_update::<A, true, true, true>(slices, &k),
                }
            });
    }

    /// One step on parameters that live on the GPU, with the same arithmetic as
    /// [`RmsProp::step`] (bit for bit); its state stays on the GPU. An optimizer steps one
    /// parameter set, on the CPU or on one GPU. After an error some tensors may have been
    /// stepped and others not: reset the optimizer (and restore the parameters) before going on.
    #[cfg(feature = "cuda")]
    pub fn step_cuda<P: crate::cuda::CudaParameters>(
        &mut self,
        dev: &mut crate::cuda::Cuda,
        params: &mut P,
        grads: &P::Grads,
    ) -> crate::Result<()>
    where
        P::Elem: Element<Acc = A>,
    {
        let update = crate::cuda::optim::Update::RmsProp {
            lr: self.lr.to_f64(),
            alpha: self.alpha.to_f64(),
            eps: self.eps.to_f64(),
            weight_decay: self.weight_decay.to_f64(),
            momentum: self.momentum.to_f64(),
            centered: self.centered,
        };
        self.device.apply(dev, params, grads, &update)?;
        self.state.step += 1;
        Ok(())
    }

    /// Forgets the running means, the momentum buffers, the step count (and master copies).
    pub fn reset(&mut self) {
        self.state = State::new();
        #[cfg(feature = "cuda")]
        {
            self.device = Default::default();
        }
    }
}

/// Elements per run of an optimizer's loop: one 512-bit vector of f32. On a CPU that takes
/// microcode assists for denormals ([`crate::denormals::assists`]), a run where any element is
/// near the denormals takes the [`Exact`](crate::element::exact::Exact) operations (the same
/// bits without assists, slower than plain ones when there are none), the others the plain
/// ones. With one flag for the whole run and the run's length a constant, each kind of
/// run is straight-line vector code. Elsewhere a tensor is one plain loop: runs would cost a
/// branch and a reload of the step's scalars per vector (MinAtar's network, centered RMSprop on
/// an AMD Zen 4: 53-59 us a step in runs, 44-49 us in one loop).
const RUN: usize = 16;

/// Products of two values of at least 2^-50 and a constant of at least 2^-20 stay clear of the
/// denormals (2^-126): below that bound a gradient, a parameter or a running mean (other than
/// of squares) counts as near them.
const NEAR: i32 = -50;

/// Running means of squares enter products with constants only, and square roots: they count
/// as near the denormals below 2^-100 (whole layers' squared gradients lie below [`NEAR`]).
const NEAR_SQUARES: i32 = -100;

/// Whether any of `xs` is nonzero and below 2^`exponent` ([`NEAR`], [`NEAR_SQUARES`]). Only
/// speed depends on it: both kinds of run give the same bits.
#[inline(always)]
fn near<A: Real>(xs: &[A], exponent: i32) -> bool {
    xs.iter().fold(false, |any, x| any | x.below(exponent))
}

/// `a * b`, [`Exact`](crate::element::exact::Exact) or plain. `exact` is a constant where it
/// is inlined.
#[inline(always)]
fn mul<A: Real>(exact: bool, a: A, b: A) -> A {
    if exact {
        a.mul_exact(b)
    } else {
        a * b
    }
}

/// `a / b`, as [`mul`].
#[inline(always)]
fn div<A: Real>(exact: bool, a: A, b: A) -> A {
    if exact {
        a.div_exact(b)
    } else {
        a / b
    }
}

/// The square root, as [`mul`].
#[inline(always)]
fn sqrt<A: Real>(exact: bool, a: A) -> A {
    if exact {
        a.sqrt_exact()
    } else {
        a.sqrt()
    }
}

/// One optimizer's step over one tensor (slices of one length), in runs of [`RUN`] elements,
/// each run [`Exact`](crate::element::exact::Exact) if any of its elements is near the
/// denormals. Each element's arithmetic is the same, operation for operation (no FMA
/// contraction), at every vector width, so the bits are those of the scalar loop and of the
/// GPU; [`dispatch`] instantiates `run` for the widest the CPU has.
trait Update<A: Real> {
    /// Steps every element of `p`.
    fn run(&self, p: Part<'_, A>);
}

/// `u` over `p` in an AVX-512 or AVX2 instantiation where the CPU has it. `Update::run` is
/// `#[inline(always)]` in each implementation, so each instantiation holds the whole loop.
fn dispatch<A: Real, U: Update<A>>(u: &U, p: Part<'_, A>) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<A: Real, U: Update<A>>(u: &U, p: Part<'_, A>) {
            u.run(p)
        }
        #[target_feature(enable = "avx512f,avx512vl,avx2")]
        unsafe fn avx512<A: Real, U: Update<A>>(u: &U, p: Part<'_, A>) {
            u.run(p)
        }
        if crate::simd::avx512() {
            // SAFETY: the CPU has AVX-512F and VL.
            return unsafe { avx512(u, p) };
        }
        if crate::simd::avx2_fma() {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(u, p) };
        }
    }
    u.run(p)
}

/// The scalars of one SGD step.
struct SgdStep<A> {
    lr: A,
    momentum: A,
    dampening: A,
    wd: A,
    nesterov: bool,
    /// The first step (the momentum buffer starts as the gradient).
    first: bool,
    /// Whether runs near the denormals take the exact operations: where the CPU takes
    /// microcode assists for denormals ([`crate::denormals::assists`]). The same bits either way.
    exact: bool,
}

impl<A: Real> SgdStep<A> {
    /// One element, the multiplications [`Exact`](crate::element::exact::Exact) or plain.
    #[inline(always)]
    fn element<const EXACT: bool>(&self, value: &mut A, grad: A, buf: &mut A) {
        let mut g = grad + mul(EXACT, self.wd, *value);
        if self.momentum != A::zero() {
            *buf = if self.first {
                g
            } else {
                mul(EXACT, self.momentum, *buf) + mul(EXACT, A::ONE - self.dampening, g)
            };
            g = if self.nesterov {
                g + mul(EXACT, self.momentum, *buf)
            } else {
                *buf
            };
        }
        *value -= mul(EXACT, self.lr, g);
    }

    /// A run of elements.
    #[inline(always)]
    fn span(&self, values: &mut [A], grad: &[A], m: &mut [A]) {
        let exact = self.exact && (near(values, NEAR) | near(grad, NEAR) | near(m, NEAR));
        macro_rules! each {
            ($exact:literal) => {
                for ((value, &grad), buf) in values.iter_mut().zip(grad).zip(m) {
                    self.element::<$exact>(value, grad, buf);
                }
            };
        }
        if exact {
            each!(true)
        } else {
            each!(false)
        }
    }
}

impl<A: Real> Update<A> for SgdStep<A> {
    #[inline(always)]
    fn run(&self, p: Part<'_, A>) {
        let n = p.values.len();
        if !self.exact {
            return self.span(p.values, &p.grad[..n], &mut p.m[..n]);
        }
        let (values, values_tail) = p.values.as_chunks_mut::<RUN>();
        let (grad, grad_tail) = p.grad[..n].as_chunks::<RUN>();
        let (m, m_tail) = p.m[..n].as_chunks_mut::<RUN>();
        for ((values, grad), m) in values.iter_mut().zip(grad).zip(m) {
            self.span(values, grad, m);
        }
        self.span(values_tail, grad_tail, m_tail);
    }
}

/// One SGD step over one tensor.
fn sgd_update<A: Real>(p: Part<'_, A>, k: &SgdStep<A>) {
    dispatch(k, p)
}

/// The constants of one Adam step.
struct AdamStep<A> {
    b1: A,
    b2: A,
    eps: A,
    wd: A,
    /// `sqrt(1 - beta2^t)`.
    correction2_sqrt: A,
    /// `lr / (1 - beta1^t)`.
    step_size: A,
    /// Whether runs near the denormals take the exact operations: where the CPU takes
    /// microcode assists for denormals ([`crate::denormals::assists`]). The same bits either way.
    exact: bool,
}

impl<A: Real> AdamStep<A> {
    /// One element, the multiplications, divisions and square root
    /// [`Exact`](crate::element::exact::Exact) or plain.
    #[inline(always)]
    fn element<const EXACT: bool>(&self, value: &mut A, grad: A, m: &mut A, v: &mut A) {
        let g = grad + mul(EXACT, self.wd, *value);
        *m = mul(EXACT, self.b1, *m) + mul(EXACT, A::ONE - self.b1, g);
        *v = mul(EXACT, self.b2, *v) + mul(EXACT, mul(EXACT, A::ONE - self.b2, g), g);
        // The square root of a denormal is at least 2^-75: the division needs no care.
        let denom = sqrt(EXACT, *v) / self.correction2_sqrt + self.eps;
        *value -= div(EXACT, mul(EXACT, self.step_size, *m), denom);
    }

    /// A run of elements.
    #[inline(always)]
    fn span(&self, values: &mut [A], grad: &[A], m: &mut [A], v: &mut [A]) {
        let exact = self.exact
            && (near(values, NEAR) | near(grad, NEAR) | near(m, NEAR) | near(v, NEAR_SQUARES));
        macro_rules! each {
            ($exact:literal) => {
                for (((value, &grad), m), v) in values.iter_mut().zip(grad).zip(m).zip(v) {
                    self.element::<$exact>(value, grad, m, v);
                }
            };
        }
        if exact {
            each!(true)
        } else {
            each!(false)
        }
    }
}

impl<A: Real> Update<A> for AdamStep<A> {
    #[inline(always)]
    fn run(&self, p: Part<'_, A>) {
        let n = p.values.len();
        if !self.exact {
            return self.span(p.values, &p.grad[..n], &mut p.m[..n], &mut p.v[..n]);
        }
        let (values, values_tail) = p.values.as_chunks_mut::<RUN>();
        let (grad, grad_tail) = p.grad[..n].as_chunks::<RUN>();
        let (m, m_tail) = p.m[..n].as_chunks_mut::<RUN>();
        let (v, v_tail) = p.v[..n].as_chunks_mut::<RUN>();
        for (((values, grad), m), v) in values.iter_mut().zip(grad).zip(m).zip(v) {
            self.span(values, grad, m, v);
        }
        self.span(values_tail, grad_tail, m_tail, v_tail);
    }
}

/// One Adam step over one tensor.
fn adam_update<A: Real>(p: Part<'_, A>, k: &AdamStep<A>) {
    dispatch(k, p)
}

/// The scalars of one RMSprop step.
struct RmsPropStep<A> {
    lr: A,
    alpha: A,
    eps: A,
    wd: A,
    momentum: A,
    /// `1 - alpha`.
    weight: A,
    /// Whether runs near the denormals take the exact operations: where the CPU takes
    /// microcode assists for denormals ([`crate::denormals::assists`]). The same bits either way.
    exact: bool,
}

/// An RMSprop step with its options as constants, so that each combination's loop is
/// straight-line vector code: `CENTERED`, `MOMENTUM` (a momentum buffer), `SMALL`
/// (`at::native::lerp`'s branch for a weight below 0.5).
struct RmsPropOptions<'k, A, const CENTERED: bool, const MOMENTUM: bool, const SMALL: bool>(
    &'k RmsPropStep<A>,
);

impl<A: Real, const CENTERED: bool, const MOMENTUM: bool, const SMALL: bool>
    RmsPropOptions<'_, A, CENTERED, MOMENTUM, SMALL>
{
    /// One element, the multiplications, divisions and square root
    /// [`Exact`](crate::element::exact::Exact) or plain. `m` and `mean` are read only where
    /// kept (`MOMENTUM`, `CENTERED`).
    #[inline(always)]
    fn element<const EXACT: bool>(
        &self,
        value: &mut A,
        grad: A,
        v: &mut A,
        m: &mut A,
        mean: &mut A,
    ) {
        let k = self.0;
        let g = grad + mul(EXACT, k.wd, *value);
        let vi = mul(EXACT, k.alpha, *v) + mul(EXACT, mul(EXACT, k.weight, g), g);
        *v = vi;
        let root = if CENTERED {
            let mi = *mean;
            // at::native::lerp, with its branch for numerical accuracy.
            let mi = if SMALL {
                mi + mul(EXACT, k.weight, g - mi)
            } else {
                g - mul(EXACT, g - mi, A::ONE - k.weight)
            };
            *mean = mi;
            sqrt(EXACT, vi - mul(EXACT, mi, mi))
        } else {
            sqrt(EXACT, vi)
        };
        let avg = root + k.eps;
        if MOMENTUM {
            let buf = mul(EXACT, k.momentum, *m) + div(EXACT, g, avg);
            *m = buf;
            *value -= mul(EXACT, k.lr, buf);
        } else {
            *value -= mul(EXACT, k.lr, div(EXACT, g, avg));
        }
    }

    /// A run of elements. `mean` is empty unless `CENTERED`.
    #[inline(always)]
    fn span(&self, values: &mut [A], grad: &[A], v: &mut [A], m: &mut [A], mean: &mut [A]) {
        let exact = self.0.exact
            && (near(values, NEAR)
                | near(grad, NEAR)
                | near(v, NEAR_SQUARES)
                | (MOMENTUM && near(m, NEAR))
                | (CENTERED && near(mean, NEAR)));
        let mut unused = A::zero();
        macro_rules! each {
            ($exact:literal) => {
                for i in 0..values.len() {
                    let mean = if CENTERED { &mut mean[i] } else { &mut unused };
                    self.element::<$exact>(&mut values[i], grad[i], &mut v[i], &mut m[i], mean);
                }
            };
        }
        if exact {
            each!(true)
        } else {
            each!(false)
        }
    }
}

impl<A: Real, const CENTERED: bool, const MOMENTUM: bool, const SMALL: bool> Update<A>
    for RmsPropOptions<'_, A, CENTERED, MOMENTUM, SMALL>
{
    #[inline(always)]
    fn run(&self, s: Part<'_, A>) {
        let n = s.values.len();
        if !self.0.exact {
            let mean: &mut [A] = if CENTERED { &mut s.mean[..n] } else { &mut [] };
            return self.span(s.values, &s.grad[..n], &mut s.v[..n], &mut s.m[..n], mean);
        }
        let (values, values_tail) = s.values.as_chunks_mut::<RUN>();
        let (grad, grad_tail) = s.grad[..n].as_chunks::<RUN>();
        let (v, v_tail) = s.v[..n].as_chunks_mut::<RUN>();
        let (m, m_tail) = s.m[..n].as_chunks_mut::<RUN>();
        let mean: &mut [A] = if CENTERED { &mut s.mean[..n] } else { &mut [] };
        let (means, mean_tail) = mean.as_chunks_mut::<RUN>();
        let runs = values.iter_mut().zip(grad).zip(v.iter_mut().zip(m));
        for (r, ((values, grad), (v, m))) in runs.enumerate() {
            let mean: &mut [A] = if CENTERED { &mut means[r] } else { &mut [] };
            self.span(values, grad, v, m, mean);
        }
        self.span(values_tail, grad_tail, v_tail, m_tail, mean_tail);
    }
}

/// PyTorch's `_single_tensor_rmsprop` over one tensor, the options as constants
/// ([`RmsPropOptions`]). Running means decay into the denormals where gradients stay zero, and
/// Intel cores take a microcode assist for each instruction with a denormal operand or result:
/// there, runs of elements near them take the [`Exact`](crate::element::exact::Exact)
/// operations ([`RUN`]), which give the same bits without assists.
fn rmsprop_update<A: Real, const CENTERED: bool, const MOMENTUM: bool, const SMALL: bool>(
    s: Part<'_, A>,
    k: &RmsPropStep<A>,
) {
    dispatch(&RmsPropOptions::<A, CENTERED, MOMENTUM, SMALL>(k), s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Tensor, Vector};

    /// A quadratic bowl `0.5 * |x - target|^2` as a parameter set.
    struct Bowl<T> {
        x: Vector<T, 3>,
    }

    impl<T: Element> Parameters for Bowl<T> {
        type Elem = T;
        type Grads = Vector<T::Acc, 3>;
        fn visit_mut(
            &mut self,
            grads: &Self::Grads,
            f: &mut dyn FnMut(&str, &mut dyn ParamTensor<T>, &[T::Acc]),
        ) {
            f("x", &mut self.x, grads.as_slice());
        }
        fn visit(&self, f: &mut dyn FnMut(&str, &[T])) {
            f("x", self.x.as_slice());
        }
        fn visit_params_mut(&mut self, f: &mut dyn FnMut(&str, &mut dyn ParamTensor<T>)) {
            f("x", &mut self.x);
        }
    }

    fn grad<T: Element>(b: &Bowl<T>) -> Vector<T::Acc, 3> {
        Vector::from_fn(|i| {
            <T::Acc as Element>::from_f64(b.x.as_slice()[i].to_f64() - [1.0, -2.0, 0.5][i])
        })
    }

    #[test]
    fn adam_matches_pytorch_first_steps() {
        // torch.optim.Adam(lr=0.1) on x = 0 with grad x - target: the first step moves each
        // coordinate by lr * sign(grad) (bias correction makes m_hat / sqrt(v_hat) = sign).
        let mut b = Bowl {
            x: Vector::<f64, 3>::zeros(),
        };
        let mut adam = Adam::new(0.1);
        let g = grad(&b);
        adam.step(&mut b, &g);
        for (x, t) in b.x.as_slice().iter().zip([1.0, -2.0, 0.5]) {
            assert!((x - 0.1 * f64::signum(t)).abs() < 1e-6, "{x}");
        }
        for _ in 0..500 {
            let g = grad(&b);
            adam.step(&mut b, &g);
        }
        for (x, t) in b.x.as_slice().iter().zip([1.0, -2.0, 0.5]) {
            assert!((x - t).abs() < 1e-2, "{x} vs {t}");
        }
    }

    #[test]
    fn sgd_momentum_matches_pytorch() {
        // buf1 = g1; p1 = p0 - lr * g1; buf2 = m * buf1 + g2; p2 = p1 - lr * buf2.
        let mut b = Bowl {
            x: Vector::<f64, 3>::zeros(),
        };
        let mut sgd = Sgd::new(0.1).with_momentum(0.9);
        let g1 = grad(&b);
        sgd.step(&mut b, &g1);
        let g2 = grad(&b);
        sgd.step(&mut b, &g2);
        let expected = -0.1 * g1.as_slice()[0] - 0.1 * (0.9 * g1.as_slice()[0] + g2.as_slice()[0]);
        assert!((b.x.as_slice()[0] - expected).abs() < 1e-12);
    }

    /// A layer-like parameter set: two tensors of different shapes, so each gets its own state.
    struct Pair<T> {
        weights: Tensor<T, 2, 1, 1, 3>,
        biases: Vector<T, 4>,
    }

    type PairGrads<A> = (Tensor<A, 2, 1, 1, 3>, Vector<A, 4>);

    impl<T: Element> Parameters for Pair<T> {
        type Elem = T;
        type Grads = PairGrads<T::Acc>;
        fn visit_mut(
            &mut self,
            grads: &Self::Grads,
            f: &mut dyn FnMut(&str, &mut dyn ParamTensor<T>, &[T::Acc]),
        ) {
            f("weights", &mut self.weights, grads.0.as_slice());
            f("biases", &mut self.biases, grads.1.as_slice());
        }
        fn visit(&self, f: &mut dyn FnMut(&str, &[T])) {
            f("weights", self.weights.as_slice());
            f("biases", self.biases.as_slice());
        }
        fn visit_params_mut(&mut self, f: &mut dyn FnMut(&str, &mut dyn ParamTensor<T>)) {
            f("weights", &mut self.weights);
            f("biases", &mut self.biases);
        }
    }

    /// Parameter `j`'s starting value, and its gradient at step `s` (parameter 9's is always 0:
    /// only weight decay moves it).
    fn start(j: usize) -> f64 {
        0.25 * j as f64 - 1.1
    }
    fn gradient(j: usize, s: usize) -> f64 {
        if j == 9 {
            return 0.0;
        }
        (1.3 * j as f64 + 0.7 * s as f64).sin() * (0.2 + 0.1 * j as f64)
    }

    /// `torch.optim.RMSprop`'s update (torch/optim/rmsprop.py), written out in f64, state from
    /// zero, per parameter:
    ///
    /// ```text
    /// g = grad + weight_decay * p
    /// v = alpha v + (1 - alpha) g^2
    /// centered: mean = alpha mean + (1 - alpha) g   (PyTorch's lerp, in exact arithmetic)
    ///           avg = sqrt(v - mean^2) + eps
    /// else:     avg = sqrt(v) + eps
    /// momentum > 0: buf = momentum buf + g / avg;  p = p - lr buf
    /// else:         p = p - lr g / avg
    /// ```
    fn rmsprop_reference(o: &RmsProp<f64>, steps: usize, mut p: Vec<f64>) -> Vec<f64> {
        let (mut v, mut mean, mut buf) = (vec![0.0; 10], vec![0.0; 10], vec![0.0; 10]);
        for s in 0..steps {
            for j in 0..10 {
                let g = gradient(j, s) + o.weight_decay * p[j];
                v[j] = o.alpha * v[j] + (1.0 - o.alpha) * g * g;
                mean[j] = o.alpha * mean[j] + (1.0 - o.alpha) * g;
                let avg = if o.centered {
                    (v[j] - mean[j] * mean[j]).sqrt() + o.eps
                } else {
                    v[j].sqrt() + o.eps
                };
                if o.momentum > 0.0 {
                    buf[j] = o.momentum * buf[j] + g / avg;
                    p[j] -= o.lr * buf[j];
                } else {
                    p[j] -= o.lr * g / avg;
                }
            }
        }
        p
    }

    /// `steps` steps of `optimizer` on a [`Pair`] stored in `T`; the parameters, widened.
    fn rmsprop_run<T: Element>(mut optimizer: RmsProp<T::Acc>, steps: usize) -> Vec<f64> {
        let mut pair = Pair {
            weights: Tensor::<T, 2, 1, 1, 3>::from_fn(|j| T::from_f64(start(j))),
            biases: Vector::from_fn(|j| T::from_f64(start(6 + j))),
        };
        for s in 0..steps {
            let g = |j| <T::Acc as Element>::from_f64(gradient(j, s));
            let grads = (Tensor::from_fn(g), Vector::from_fn(|j| g(6 + j)));
            optimizer.step(&mut pair, &grads);
        }
        assert_eq!(optimizer.steps(), steps as u64);
        let mut values = Vec::new();
        pair.visit(&mut |_, v| values.extend(v.iter().map(|x| x.to_f64())));
        values
    }

    /// Every combination of the options, with both branches of PyTorch's lerp (alpha 0.99 gives
    /// the new gradient a weight below one half, alpha 0.3 one above), against the reference:
    /// f64 to rounding, f32 to its precision, f16 and bf16 within half an ulp (the master copy
    /// keeps the steps in f32, each step's result rounded into the half type on its own;
    /// stepping from the rounded values instead drifts further, and fails this).
    #[test]
    fn rmsprop_matches_the_reference_for_every_option() {
        let steps = 6;
        for bits in 0..16 {
            let mut o = RmsProp::new(0.01);
            if bits & 1 != 0 {
                o.momentum = 0.9;
            }
            if bits & 2 != 0 {
                o.weight_decay = 0.05;
            }
            if bits & 4 != 0 {
                (o.alpha, o.eps) = (0.3, 1e-2);
            }
            o.centered = bits & 8 != 0;
            let case = format!(
                "momentum {} weight_decay {} alpha {} eps {} centered {}",
                o.momentum, o.weight_decay, o.alpha, o.eps, o.centered
            );
            let f32_settings = RmsProp::new(0.01f32)
                .with_momentum(o.momentum as f32)
                .with_weight_decay(o.weight_decay as f32)
                .with_alpha(o.alpha as f32)
                .with_eps(o.eps as f32)
                .with_centered(o.centered);
            let runs: [(&str, Vec<f64>, f64, f64); 4] = [
                (
                    "f64",
                    rmsprop_run::<f64>(o.clone_settings(), steps),
                    1e-13,
                    0.0,
                ),
                (
                    "f32",
                    rmsprop_run::<f32>(f32_settings.clone_settings(), steps),
                    1e-5,
                    0.0,
                ),
                (
                    "f16",
                    rmsprop_run::<half::f16>(f32_settings.clone_settings(), steps),
                    1e-5,
                    2f64.powi(-11),
                ),
                (
                    "bf16",
                    rmsprop_run::<half::bf16>(f32_settings, steps),
                    1e-5,
                    2f64.powi(-8),
                ),
            ];
            for (name, got, abs, rel) in runs {
                // From the starting values as the element type holds them.
                let round = |x: f64| match name {
                    "f16" => half::f16::from_f64(x).to_f64(),
                    "bf16" => half::bf16::from_f64(x).to_f64(),
                    "f32" => x as f32 as f64,
                    _ => x,
                };
                let expected =
                    rmsprop_reference(&o, steps, (0..10).map(|j| round(start(j))).collect());
                for (j, (g, e)) in got.iter().zip(&expected).enumerate() {
                    assert!(
                        (g - e).abs() <= abs + rel * e.abs(),
                        "{name} {case}: parameter {j} is {g}, expected {e}"
                    );
                }
            }
        }
    }

    impl<A: Real> RmsProp<A> {
        /// A fresh optimizer with the same settings.
        fn clone_settings(&self) -> Self {
            RmsProp::new(self.lr)
                .with_alpha(self.alpha)
                .with_eps(self.eps)
                .with_weight_decay(self.weight_decay)
                .with_momentum(self.momentum)
                .with_centered(self.centered)
        }
    }

    /// Three steps PyTorch 2.15 took in float64 (`torch.optim.RMSprop(..., foreach=False)` on
    /// `[0.5, -1.0, 2.0]` with the gradients below).
    #[test]
    fn rmsprop_matches_pytorch() {
        let grads = [[0.1, -0.2, 0.3], [-0.05, 0.4, 0.3], [0.2, 0.0, -0.1]];
        let cases = [
            (
                RmsProp::new(0.01)
                    .with_alpha(0.9)
                    .with_eps(1e-3)
                    .with_weight_decay(0.1)
                    .with_momentum(0.5)
                    .with_centered(true),
                [0.41403368945931385, -0.9691213292143029, 1.8991699588311857],
            ),
            (
                RmsProp::new(0.01).with_alpha(0.3).with_centered(true),
                [0.467127073600881, -0.9940198279473529, 1.9488761654543265],
            ),
            (
                RmsProp::new(0.01),
                [0.3574274567414971, -0.9895323261670684, 1.8522177065554255],
            ),
        ];
        for (mut rmsprop, torch) in cases {
            let mut b = Bowl {
                x: Vector::<f64, 3>::from_vec(vec![0.5, -1.0, 2.0]).unwrap(),
            };
            for g in grads {
                rmsprop.step(&mut b, &Vector::from_vec(g.to_vec()).unwrap());
            }
            for (x, t) in b.x.as_slice().iter().zip(torch) {
                assert!((x - t).abs() < 1e-15, "{x} vs PyTorch's {t}");
            }
            rmsprop.reset();
            assert_eq!(rmsprop.steps(), 0);
        }
    }

    #[test]
    fn half_parameters_accumulate_small_steps_in_the_master_copy() {
        // 1000 steps of 1e-4 on a bf16 value of 1.0 (resolution 2^-7): without a master copy
        // each step would round away.
        let mut b = Bowl {
            x: Vector::<half::bf16, 3>::from_fn(|_| half::bf16::from_f32(1.0)),
        };
        let mut sgd = Sgd::new(1e-4f32);
        let g = Vector::<f32, 3>::from_fn(|_| 1.0);
        for _ in 0..1000 {
            sgd.step(&mut b, &g);
        }
        assert!((b.x.as_slice()[0].to_f32() - 0.9).abs() < 0.01);
    }

    /// Arrays for one step: values, gradients and three states, a third of each in or near the
    /// denormals, a third zero, the rest ordinary (100 elements: six runs and a tail).
    fn denormal_heavy(seed: u64) -> [Vec<f32>; 5] {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        std::array::from_fn(|_| {
            (0..100)
                .map(|_| {
                    let x = match rng.random_range(0..6) {
                        0 => f32::from_bits(rng.random_range(1..64)),
                        1 => f32::from_bits(rng.random_range(1..1 << 23)),
                        2 => rng.random_range(1e-37f32..1e-20),
                        3 | 4 => 0.0,
                        _ => rng.random_range(-1f32..1.0),
                    };
                    if rng.random() {
                        -x
                    } else {
                        x
                    }
                })
                .collect()
        })
    }

    /// Runs `update` on copies of `arrays` (values, grad, m, v, mean) and returns them.
    fn stepped(arrays: &[Vec<f32>; 5], update: impl Fn(Part<'_, f32>)) -> [Vec<f32>; 5] {
        let [mut values, grad, mut m, mut v, mut mean] = arrays.clone();
        update(Part {
            values: &mut values,
            grad: &grad,
            m: &mut m,
            v: &mut v,
            mean: &mut mean,
        });
        [values, grad, m, v, mean]
    }

    fn assert_same_bits(a: &[Vec<f32>; 5], b: &[Vec<f32>; 5], what: &str) {
        for (x, y) in a.iter().zip(b) {
            let differ = x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits());
            assert_eq!(differ.count(), 0, "{what}");
        }
    }

    /// The steps with their exact operations near the denormals give the bits of the plain
    /// formulas (PyTorch's, operation for operation), states and parameters alike.
    #[test]
    fn steps_near_the_denormals_give_the_plain_bits() {
        for seed in 0..20 {
            let arrays = denormal_heavy(seed);
            let adam = AdamStep {
                b1: 0.9f32,
                b2: 0.999,
                eps: 1e-8,
                wd: if seed % 2 == 0 { 0.0 } else { 1e-2 },
                correction2_sqrt: 0.3,
                step_size: 1e-3,
                exact: true,
            };
            let ours = stepped(&arrays, |p| adam_update(p, &adam));
            let plain = stepped(&arrays, |p| {
                let k = &adam;
                for i in 0..p.values.len() {
                    let g = p.grad[i] + k.wd * p.values[i];
                    p.m[i] = k.b1 * p.m[i] + (1.0 - k.b1) * g;
                    p.v[i] = k.b2 * p.v[i] + (1.0 - k.b2) * g * g;
                    let denom = p.v[i].sqrt() / k.correction2_sqrt + k.eps;
                    p.values[i] -= k.step_size * p.m[i] / denom;
                }
            });
            assert_same_bits(&ours, &plain, "adam");

            let rms = RmsPropStep {
                lr: 2.5e-4f32,
                alpha: 0.95,
                eps: 0.01,
                wd: adam.wd,
                momentum: 0.9,
                weight: 0.05,
                exact: true,
            };
            fn plain_rmsprop<const CENTERED: bool, const MOMENTUM: bool, const SMALL: bool>(
                p: Part<'_, f32>,
                k: &RmsPropStep<f32>,
            ) {
                for i in 0..p.values.len() {
                    let g = p.grad[i] + k.wd * p.values[i];
                    let vi = k.alpha * p.v[i] + k.weight * g * g;
                    p.v[i] = vi;
                    let root = if CENTERED {
                        let mi = p.mean[i];
                        let mi = if SMALL {
                            mi + k.weight * (g - mi)
                        } else {
                            g - (g - mi) * (1.0 - k.weight)
                        };
                        p.mean[i] = mi;
                        (vi - mi * mi).sqrt()
                    } else {
                        vi.sqrt()
                    };
                    let avg = root + k.eps;
                    if MOMENTUM {
                        let buf = k.momentum * p.m[i] + g / avg;
                        p.m[i] = buf;
                        p.values[i] -= k.lr * buf;
                    } else {
                        p.values[i] -= k.lr * (g / avg);
                    }
                }
            }
            macro_rules! rmsprop {
                ($c:literal, $m:literal, $s:literal) => {
                    let ours = stepped(&arrays, |p| rmsprop_update::<f32, $c, $m, $s>(p, &rms));
                    let plain = stepped(&arrays, |p| plain_rmsprop::<$c, $m, $s>(p, &rms));
                    assert_same_bits(&ours, &plain, stringify!(rmsprop $c $m $s));
                };
            }
            rmsprop!(false, false, true);
            rmsprop!(true, false, true);
            rmsprop!(true, false, false);
            rmsprop!(false, true, true);
            rmsprop!(true, true, false);

            for (first, nesterov) in [(false, false), (false, true), (true, false)] {
                let sgd = SgdStep {
                    lr: 1e-2f32,
                    momentum: 0.9,
                    dampening: 0.1,
                    wd: adam.wd,
                    nesterov,
                    first,
                    exact: true,
                };
                let ours = stepped(&arrays, |p| sgd_update(p, &sgd));
                let plain = stepped(&arrays, |p| {
                    let k = &sgd;
                    for i in 0..p.values.len() {
                        let mut g = p.grad[i] + k.wd * p.values[i];
                        let buf = &mut p.m[i];
                        *buf = if k.first {
                            g
                        } else {
                            k.momentum * *buf + (1.0 - k.dampening) * g
                        };
                        g = if k.nesterov {
                            g + k.momentum * *buf
                        } else {
                            *buf
                        };
                        p.values[i] -= k.lr * g;
                    }
                });
                assert_same_bits(&ours, &plain, "sgd");
            }
        }
    }
}
