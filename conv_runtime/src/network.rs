//! What `network!`'s generated code calls between its layers: the devices a network runs on,
//! views of one buffer as another shape of the same length (`Flatten` is free), and the
//! `[out, in]` view of a dense layer's weights that optimizers and checkpoints see.

use std::any::{Any, TypeId};

use crate::cpu::{Cpu, Pool};
use crate::params::ParamTensor;
use crate::tensor::Tensor;

/// A device a network runs on: besides each layer's operations (their own device traits), the
/// threads for the code between layers and buffers cached across calls, so that no call
/// allocates once the first has run.
pub trait NetworkDevice {
    /// The threads the generated code between layers runs on.
    #[doc(hidden)]
    fn __pool(&self) -> &Pool;

    /// The cached `X` (built by `Default` on first use), taken out of the device for one call;
    /// hand it back with [`NetworkDevice::__put`].
    #[doc(hidden)]
    fn __take<X: Any + Send + Default>(&mut self) -> Box<X>;

    /// Returns a buffer taken by [`NetworkDevice::__take`].
    #[doc(hidden)]
    fn __put<X: Any + Send>(&mut self, x: Box<X>);

    /// Counts an entry that ran the generated code where the device's own library might have
    /// (oneDNN's fallbacks).
    #[doc(hidden)]
    fn __fallback(&mut self) {}

    /// Average pooling of `batch` images (`x` and `y` NHWC) in the device's own library;
    /// `None` where it has none for `A` (the generated code runs instead).
    #[doc(hidden)]
    fn __avg_pool_forward<A: 'static>(
        &mut self,
        _geometry: &PoolGeometry,
        _batch: usize,
        _x: &[A],
        _y: &mut [A],
    ) -> Option<crate::Result<()>> {
        None
    }

    /// The gradient of average pooling at its input (overwritten), from the gradient at its
    /// output, at the geometry's batch; `None` as in [`NetworkDevice::__avg_pool_forward`].
    #[doc(hidden)]
    fn __avg_pool_backward<A: 'static>(
        &mut self,
        _geometry: &PoolGeometry,
        _dy: &[A],
        _dx: &mut [A],
    ) -> Option<crate::Result<()>> {
        None
    }
}

/// A pooling entry's sizes (NHWC maps, the network's training batch), as literals in a
/// network's generated code: what a device's own pooling primitives are built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolGeometry {
    pub batch: usize,
    pub in_h: usize,
    pub in_w: usize,
    pub channels: usize,
    pub out_h: usize,
    pub out_w: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Padding before (top, left); after, what the last window reaches past the input.
    pub padding: [usize; 2],
}

/// Buffers a device keeps for networks, one per type (a network's per-batch workspaces).
#[derive(Default)]
pub(crate) struct Buffers(Vec<(TypeId, Box<dyn Any + Send>)>);

impl Buffers {
    pub(crate) fn take<X: Any + Send + Default>(&mut self) -> Box<X> {
        let id = TypeId::of::<X>();
        match self.0.iter().position(|(t, _)| *t == id) {
            Some(i) => {
                let (_, b) = self.0.swap_remove(i);
                b.downcast::<X>().unwrap_or_default()
            }
            None => Box::default(),
        }
    }

    pub(crate) fn put<X: Any + Send>(&mut self, x: Box<X>) {
        self.0.push((TypeId::of::<X>(), x));
    }
}

impl NetworkDevice for Cpu {
    fn __pool(&self) -> &Pool {
        Cpu::__pool(self)
    }

    fn __take<X: Any + Send + Default>(&mut self) -> Box<X> {
        self.buffers.take()
    }

    fn __put<X: Any + Send>(&mut self, x: Box<X>) {
        self.buffers.put(x)
    }
}

/// The dense tensor types of this crate (all `#[repr(C)]` with the same fields): a view of one
/// as another of the same element type and length is the same memory.
///
/// # Safety
/// Implemented only by the crate's dense types, whose layouts are identical.
pub unsafe trait Dense {
    type Elem;
    const LEN: usize;
}

/// `a` as a `B` of the same length (a flattened map as features, or back).
pub fn view<A: Dense, B: Dense<Elem = A::Elem>>(a: &A) -> &B {
    assert!(A::LEN == B::LEN, "a view keeps the length");
    // SAFETY: both are dense types of the same element type (same layout, `Dense`) and length.
    unsafe { &*(a as *const A).cast::<B>() }
}

/// [`view`], mutably.
pub fn view_mut<A: Dense, B: Dense<Elem = A::Elem>>(a: &mut A) -> &mut B {
    assert!(A::LEN == B::LEN, "a view keeps the length");
    // SAFETY: as in `view`.
    unsafe { &mut *(a as *mut A).cast::<B>() }
}

/// A dense layer's weights (a 1x1 convolution's `[out, 1, 1, in]`) as PyTorch's `[out, in]`:
/// the shape optimizers and checkpoints see.
pub struct DenseWeights<'a, T, const O: usize, const I: usize>(pub &'a mut Tensor<T, O, 1, 1, I>);

impl<T, const O: usize, const I: usize> DenseWeights<'_, T, O, I> {
    const SHAPE: [usize; 2] = [O, I];
}

impl<T, const O: usize, const I: usize> ParamTensor<T> for DenseWeights<'_, T, O, I> {
    fn values_mut(&mut self) -> &mut [T] {
        self.0.as_mut_slice()
    }
    fn values(&self) -> &[T] {
        self.0.as_slice()
    }
    fn stamp(&self) -> u64 {
        self.0.stamp()
    }
    fn shape(&self) -> &'static [usize] {
        &Self::SHAPE
    }
}

/// A generated network's entries in declaration order: what an importer needs to name its
/// parameters in another framework's terms (see
/// [`import_pytorch_network`](crate::safetensors::import_pytorch_network)).
pub trait Entries {
    /// The top-level entries; residual blocks hold theirs.
    const ENTRIES: &'static [EntryInfo];
}

/// One entry of a network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    /// The entry's name as declared.
    pub name: &'static str,
    pub kind: EntryKind,
}

/// What an entry is, as far as its parameters' names and layouts go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A `Conv2d`: whether it normalizes (gamma, beta and, for BatchNorm, running statistics)
    /// and whether it applies an activation other than `Identity`.
    Conv2d {
        norm: bool,
        activation: bool,
    },
    /// A `Dense`: the `[h, w, c]` map its input features were flattened from (`[1, 1, n]` when
    /// they were never a map), and whether it applies an activation other than `Identity`.
    Dense {
        flattened: [usize; 3],
        activation: bool,
    },
    MaxPool2d,
    AvgPool2d,
    Activation,
    Flatten,
    Residual(&'static [EntryInfo]),
}
