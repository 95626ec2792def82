//! The parameter-visiting traits generated layers implement; optimizers and utilities are
//! written once against them, for every layer.

use crate::element::Element;
use crate::tensor::{Tensor, Vector};

/// A parameter tensor as optimizers see it: its values and its content stamp.
pub trait ParamTensor<T> {
    /// The values (row-major); gives the tensor a new stamp.
    fn values_mut(&mut self) -> &mut [T];
    /// The values.
    fn values(&self) -> &[T];
    /// The content stamp (see [`Tensor`]).
    fn stamp(&self) -> u64;
    /// The shape (`[N, H, W, C]` for tensors, `[N]` for vectors).
    fn shape(&self) -> &'static [usize];
}

impl<T, const N: usize, const H: usize, const W: usize, const C: usize> ParamTensor<T>
    for Tensor<T, N, H, W, C>
{
    fn values_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
    fn values(&self) -> &[T] {
        self.as_slice()
    }
    fn stamp(&self) -> u64 {
        Tensor::stamp(self)
    }
    fn shape(&self) -> &'static [usize] {
        &Self::SHAPE
    }
}

impl<T, const N: usize> ParamTensor<T> for Vector<T, N> {
    fn values_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
    fn values(&self) -> &[T] {
        self.as_slice()
    }
    fn stamp(&self) -> u64 {
        Vector::stamp(self)
    }
    fn shape(&self) -> &'static [usize] {
        &Self::SHAPE
    }
}

/// Something with trainable parameters and gradients of the same shapes: every generated layer,
/// and whatever a user adds (a linear read-out) by implementing the two visits.
///
/// Parameters are visited in a fixed order (for layers: weights, biases, gamma, beta), so an
/// optimizer's state lines up with them call after call. (The visitors' types are written out:
/// an alias would change the trait objects' default lifetimes.)
#[allow(clippy::type_complexity)]
pub trait Parameters {
    /// The parameters' element type.
    type Elem: Element;
    /// The gradients' container.
    type Grads;

    /// Calls `f(name, parameter, gradient)` for each trainable parameter.
    fn visit_mut(
        &mut self,
        grads: &Self::Grads,
        f: &mut dyn FnMut(&str, &mut dyn ParamTensor<Self::Elem>, &[<Self::Elem as Element>::Acc]),
    );

    /// Calls `f(name, values)` for each trainable parameter.
    fn visit(&self, f: &mut dyn FnMut(&str, &[Self::Elem]));

    /// Calls `f(name, tensor)` for each trainable parameter, mutably (loading parameters).
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&str, &mut dyn ParamTensor<Self::Elem>));

    /// Calls `f(name, tensor)` for each non-trainable buffer (BatchNorm's running statistics),
    /// kept in the accumulator type. None by default.
    fn visit_buffers_mut(
        &mut self,
        f: &mut dyn FnMut(&str, &mut dyn ParamTensor<<Self::Elem as Element>::Acc>),
    ) {
        let _ = f;
    }

    /// Number of trainable scalars.
    fn parameter_count(&self) -> usize {
        let mut n = 0;
        self.visit(&mut |_, v| n += v.len());
        n
    }
}
