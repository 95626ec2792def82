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

use crate::element::{Element, Real};
use crate::params::{ParamTensor, Parameters};

/// Per-parameter-tensor state.
struct Slot<A> {
    /// First moment / momentum buffer.
    m: Vec<A>,
    /// Second moment (Adam).
    v: Vec<A>,
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

    /// Runs `update(slot, grad, values in A)` for every parameter, handling the master copy.
    fn apply<P: Parameters>(
        &mut self,
        params: &mut P,
        grads: &P::Grads,
        mut update: impl FnMut(&mut Slot<A>, &[A], &mut [A]),
    ) where
        P::Elem: Element<Acc = A>,
    {
        let needs_master = TypeId::of::<P::Elem>() != TypeId::of::<A>();
        let mut index = 0;
        let slots = &mut self.slots;
        params.visit_mut(
            grads,
            &mut |_, tensor: &mut dyn ParamTensor<P::Elem>, grad: &[A]| {
                if slots.len() == index {
                    let n = grad.len();
                    slots.push(Slot {
                        m: vec![A::zero(); n],
                        v: Vec::new(),
                        master: Vec::new(),
                        written: 0,
                    });
                }
                let slot = &mut slots[index];
                index += 1;
                if needs_master {
                    if slot.master.len() != grad.len() || slot.written != tensor.stamp() {
                        slot.master = tensor.values().iter().map(|v| v.to_acc()).collect();
                    }
                    let mut master = std::mem::take(&mut slot.master);
                    update(slot, grad, &mut master);
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
                    update(slot, grad, values);
                }
            },
        );
    }
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

    /// One step on `params` with `grads`.
    pub fn step<P: Parameters>(&mut self, params: &mut P, grads: &P::Grads)
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
        self.state.apply(params, grads, |slot, grad, values| {
            for i in 0..values.len() {
                let mut g = grad[i] + wd * values[i];
                if momentum != A::zero() {
                    let buf = &mut slot.m[i];
                    *buf = if first {
                        g
                    } else {
                        momentum * *buf + (A::ONE - dampening) * g
                    };
                    g = if nesterov { g + momentum * *buf } else { *buf };
                }
                values[i] -= lr * g;
            }
        });
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

    /// One step on `params` with `grads`.
    pub fn step<P: Parameters>(&mut self, params: &mut P, grads: &P::Grads)
    where
        P::Elem: Element<Acc = A>,
    {
        self.state.step += 1;
        let (correction2_sqrt, step_size) = self.corrections(self.state.step);
        let (b1, b2, eps, wd) = (self.beta1, self.beta2, self.eps, self.weight_decay);
        self.state.apply(params, grads, |slot, grad, values| {
            if slot.v.len() != values.len() {
                slot.v = vec![A::zero(); values.len()];
            }
            for i in 0..values.len() {
                let g = grad[i] + wd * values[i];
                slot.m[i] = b1 * slot.m[i] + (A::ONE - b1) * g;
                slot.v[i] = b2 * slot.v[i] + (A::ONE - b2) * g * g;
                let denom = slot.v[i].sqrt() / correction2_sqrt + eps;
                values[i] -= step_size * slot.m[i] / denom;
            }
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Vector;

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
}
