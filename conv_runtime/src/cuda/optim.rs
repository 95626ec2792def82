//! The optimizers' step on parameters that live on the GPU ([`CudaParameters`]): the kernels of
//! `optim.cu`, one launch per parameter tensor, with the optimizer's state (moments, momentum
//! buffers, the f32 master copy of half-precision parameters) kept on the GPU beside them.
//!
//! The kernels repeat the CPU step's arithmetic operation for operation, without fused
//! multiply-adds, so a GPU step equals a CPU step bit for bit (tests/cuda_device.rs checks it).

use super::memory::{Buf, CudaParamTensor};
use super::{Arg, Cuda, DeviceElement, LayerSetup};
use crate::{Element, Error, Result};

/// The optimizer kernels' source (compiled by NVRTC on first use, like a layer's): RMSprop's
/// kernels continue optim.cu, whose helpers they use.
#[doc(hidden)]
pub const OPTIMIZER_SOURCE: &str = concat!(include_str!("optim.cu"), include_str!("rmsprop.cu"));

/// The kernels [`OPTIMIZER_SOURCE`] defines.
#[doc(hidden)]
pub const OPTIMIZER_KERNELS: &[&str] = &[
    "sgd_f64",
    "adam_f64",
    "sgd_f32",
    "adam_f32",
    "sgd_f16",
    "adam_f16",
    "sgd_bf16",
    "adam_bf16",
    "rmsprop_f64",
    "rmsprop_f32",
    "rmsprop_f16",
    "rmsprop_bf16",
];

static OPTIMIZER: LayerSetup = LayerSetup::new(OPTIMIZER_SOURCE, OPTIMIZER_KERNELS, None);

/// Trainable parameters on the GPU with gradients of the same shapes: the device-resident layers
/// `conv2d!` generates (`LayerCuda`, with `LayerCudaGrads`), and whatever a user adds.
///
/// Parameters are visited in a fixed order, so an optimizer's state lines up with them call
/// after call (as [`crate::Parameters`]).
pub trait CudaParameters {
    /// The parameters' element type.
    type Elem: DeviceElement;
    /// The gradients' container (gradients in `<Elem as Element>::Acc`).
    type Grads;

    /// Calls `f(name, parameter, gradient)` for each trainable parameter.
    fn visit_cuda_mut(
        &mut self,
        grads: &Self::Grads,
        f: &mut dyn FnMut(&str, &mut dyn CudaParamTensor, &Buf),
    );
}

/// An optimizer's state for one parameter tensor, on the GPU.
struct Slot {
    /// First moment / momentum buffer.
    m: Buf,
    /// Second moment (Adam), mean of the squared gradients (RMSprop).
    v: Option<Buf>,
    /// Mean of the gradients (centered RMSprop).
    mean: Option<Buf>,
    /// f32 master copy of half-precision parameters.
    master: Option<Buf>,
    /// The stamp the parameters had after this optimizer last wrote them.
    written: u64,
}

/// An optimizer's GPU state: a slot per parameter tensor, on one GPU.
#[derive(Default)]
pub(crate) struct DeviceState {
    slots: Vec<Slot>,
    ordinal: Option<usize>,
}

/// Which update [`DeviceState::apply`] launches, with its scalars.
pub(crate) enum Update {
    Sgd {
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
        first: bool,
    },
    Adam {
        step_size: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        correction2_sqrt: f64,
    },
    RmsProp {
        lr: f64,
        alpha: f64,
        eps: f64,
        weight_decay: f64,
        momentum: f64,
        centered: bool,
    },
}

impl DeviceState {
    /// Runs `update` on every parameter of `params` with `grads`.
    pub(crate) fn apply<P: CudaParameters>(
        &mut self,
        dev: &mut Cuda,
        params: &mut P,
        grads: &P::Grads,
        update: &Update,
    ) -> Result<()> {
        let operation = "optimizer step on the GPU";
        if self.ordinal.is_some_and(|o| o != dev.ordinal()) {
            return Err(Error::new(
                operation,
                "the optimizer's state lives on another GPU (reset it first)",
            ));
        }
        self.ordinal = Some(dev.ordinal());
        let acc = std::mem::size_of::<<P::Elem as Element>::Acc>();
        let half = std::mem::size_of::<P::Elem>() == 2;
        let (kernel, two_moments) = match update {
            Update::Sgd { .. } => (format!("sgd_{}", P::Elem::NAME), false),
            Update::Adam { .. } => (format!("adam_{}", P::Elem::NAME), true),
            Update::RmsProp { .. } => (format!("rmsprop_{}", P::Elem::NAME), true),
        };
        let centered = matches!(update, Update::RmsProp { centered: true, .. });
        let s = dev.__session(&OPTIMIZER)?;
        let slots = &mut self.slots;
        let mut index = 0;
        let mut result = Ok(());
        params.visit_cuda_mut(grads, &mut |name, param, grad| {
            if result.is_err() {
                return;
            }
            result = (|| {
                let n = param.len();
                if grad.len() < n * acc {
                    return Err(Error::new(
                        operation,
                        format!("the gradient of `{name}` is smaller than the parameter"),
                    ));
                }
                if slots.len() == index {
                    slots.push(Slot {
                        m: s.zeros_bytes(n * acc)?,
                        v: None,
                        mean: None,
                        master: None,
                        written: 0,
                    });
                }
                let slot = &mut slots[index];
                index += 1;
                if slot.m.len() < n * acc {
                    return Err(Error::new(
                        operation,
                        format!("`{name}` changed size since the last step (reset the optimizer)"),
                    ));
                }
                if two_moments && slot.v.is_none() {
                    slot.v = Some(s.zeros_bytes(n * acc)?);
                }
                if centered && slot.mean.is_none() {
                    slot.mean = Some(s.zeros_bytes(n * acc)?);
                }
                let mut init_master = 0;
                if half && slot.master.is_none() {
                    slot.master = Some(s.zeros_bytes(n * acc)?);
                    init_master = 1;
                }
                if half && slot.written != param.stamp() {
                    // Written outside the optimizer: start again from its values.
                    init_master = 1;
                }
                let master = slot.master.as_ref().map_or(Arg::Null, Arg::Buf);
                let target = param.buf_mut();
                let mut args = vec![
                    Arg::Long(n),
                    Arg::Buf(target),
                    Arg::Buf(grad),
                    master,
                    Arg::Int(init_master),
                    Arg::Buf(&slot.m),
                ];
                match *update {
                    Update::Sgd {
                        lr,
                        momentum,
                        dampening,
                        weight_decay,
                        nesterov,
                        first,
                    } => args.extend([
                        Arg::F64(lr),
                        Arg::F64(momentum),
                        Arg::F64(dampening),
                        Arg::F64(weight_decay),
                        Arg::Int(usize::from(nesterov)),
                        Arg::Int(usize::from(first)),
                    ]),
                    Update::Adam {
                        step_size,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        correction2_sqrt,
                    } => {
                        let v = slot
                            .v
                            .as_ref()
                            .ok_or_else(|| Error::new(operation, "no second moment"))?;
                        args.extend([
                            Arg::Buf(v),
                            Arg::F64(step_size),
                            Arg::F64(beta1),
                            Arg::F64(beta2),
                            Arg::F64(eps),
                            Arg::F64(weight_decay),
                            Arg::F64(correction2_sqrt),
                        ]);
                    }
                    Update::RmsProp {
                        lr,
                        alpha,
                        eps,
                        weight_decay,
                        momentum,
                        centered,
                    } => {
                        let v = slot
                            .v
                            .as_ref()
                            .ok_or_else(|| Error::new(operation, "no mean of squares"))?;
                        args.extend([
                            Arg::Buf(v),
                            slot.mean.as_ref().map_or(Arg::Null, Arg::Buf),
                            Arg::F64(lr),
                            Arg::F64(alpha),
                            Arg::F64(eps),
                            Arg::F64(weight_decay),
                            Arg::F64(momentum),
                            Arg::Int(usize::from(centered)),
                        ]);
                    }
                }
                s.launch(&kernel, super::blocks_for(n), &args)?;
                slot.written = param.stamp();
                Ok(())
            })();
        });
        result
    }
}
