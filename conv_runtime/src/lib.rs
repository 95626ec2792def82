//! Runtime of `conv2d!`-generated layers.
//!
//! A user crate depends on this crate alone: it re-exports the [`conv2d!`] macro, and the code the
//! macro generates reaches everything it needs through `::conv_runtime::__private`, never through
//! what the user imported. Nothing here depends on a particular layer spec; every size the
//! generated kernels use is a literal in the generated code.
//!
//! ```
//! use conv_runtime::prelude::*;
//!
//! conv_runtime::conv2d! {
//!     /// The first layer of the Nature DQN network.
//!     pub struct Conv1 { input: [84, 84, 4], out_channels: 32, kernel: 8, stride: 4, activation: Relu }
//! }
//!
//! # fn main() -> conv_runtime::Result<()> {
//! let mut cpu = Cpu::default();
//! let layer = Conv1::new(&mut Rng::seed_from_u64(0));
//! let frames = Tensor::<f32, 2, 84, 84, 4>::from_fn(|i| (i % 7) as f32 / 7.0);
//! let mut features = Tensor::<f32, 2, 20, 20, 32>::zeros();
//! layer.evaluate(&mut cpu, &frames, &mut features)?;
//! assert_eq!(Conv1::OUTPUT_HEIGHT, 20);
//! # Ok(())
//! # }
//! ```

pub mod activation;
mod aligned;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod denormals;
mod element;
mod error;
mod fused;
pub mod head;
pub mod init;
pub mod loss;
mod network;
#[cfg(feature = "onednn")]
pub mod onednn;
pub mod optim;
#[doc(hidden)]
pub mod packed_rows;
mod params;
mod rng;
pub mod safetensors;
pub mod simd;
#[doc(hidden)]
pub mod sums;
mod team;
mod tensor;
#[doc(hidden)]
pub mod wide;
#[doc(hidden)]
pub mod winograd;

pub use conv_macros::{conv2d, network};
pub use cpu::{Cpu, Mode, MIN_PART_WORK};
pub use element::{Element, Real};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use loss::Loss;
pub use network::{Entries, EntryInfo, EntryKind, NetworkDevice};
pub use optim::{Adam, RmsProp, Sgd};
pub use params::{ParamTensor, Parameters};
pub use rng::Rng;
pub use tensor::{Matrix, ShapeError, Tensor, Vector};

/// Expands its input only when this crate was built with the `onednn` feature: generated code
/// is compiled in the user's crate, whose own features say nothing about the runtime's.
#[cfg(feature = "onednn")]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_onednn {
    ($($tokens:tt)*) => { $($tokens)* };
}

#[cfg(not(feature = "onednn"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_onednn {
    ($($tokens:tt)*) => {};
}

#[cfg(feature = "onednn")]
pub use onednn::OneDnn;

/// Expands its input only when this crate was built with the `cuda` feature (as `__if_onednn`).
#[cfg(feature = "cuda")]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_cuda {
    ($($tokens:tt)*) => { $($tokens)* };
}

#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_cuda {
    ($($tokens:tt)*) => {};
}

#[cfg(feature = "cuda")]
pub use cuda::Cuda;

/// `{ A } else { B }`: `A` where generated kernels get a portable copy (the `portable` feature,
/// or any target but x86-64), else `B`. As `__if_onednn`, decided by this crate's features.
#[cfg(any(feature = "portable", not(target_arch = "x86_64")))]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_portable {
    ({ $($yes:tt)* } else { $($no:tt)* }) => { $($yes)* };
}

#[cfg(not(any(feature = "portable", not(target_arch = "x86_64"))))]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_portable {
    ({ $($yes:tt)* } else { $($no:tt)* }) => { $($no)* };
}

/// Everything a user of generated layers needs in scope.
pub mod prelude {
    #[cfg(feature = "cuda")]
    pub use crate::cuda::{CudaParameters, CudaTensor, CudaVector};
    #[cfg(feature = "cuda")]
    pub use crate::Cuda;
    #[cfg(feature = "onednn")]
    pub use crate::OneDnn;
    pub use crate::{
        bf16, conv2d, f16, network, Adam, Cpu, Element, Matrix, Mode, NetworkDevice, ParamTensor,
        Parameters, RmsProp, Rng, Sgd, Tensor, Vector,
    };
}

/// What generated code names. Not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::__if_cuda as if_cuda;
    pub use crate::__if_onednn as if_onednn;
    pub use crate::__if_portable as if_portable;
    pub use crate::activation::{self, Activation};
    pub use crate::cpu::{CpuScalar, PackKey, Pool, Shared, Workspace, ELEMENT_WORK};
    #[cfg(feature = "cuda")]
    pub use crate::cuda;
    pub use crate::fused::PoolGate;
    pub use crate::init::kaiming_uniform;
    pub use crate::network::{
        view, view_mut, Dense, DenseWeights, Entries, EntryInfo, EntryKind, PoolGeometry,
    };
    #[cfg(feature = "onednn")]
    pub use crate::onednn;
    pub use crate::packed_rows;
    pub use crate::simd::{self, avx2_fma, Simd};
    pub use crate::sums;
    pub use crate::wide;
    pub use crate::winograd;
    pub use crate::{
        bf16, f16, Cpu, Element, Error, Matrix, Mode, NetworkDevice, ParamTensor, Parameters, Real,
        Result, Rng, Tensor, Vector,
    };
    /// For the project's hygiene test (tests/hygiene.rs).
    pub use conv_macros::__hygiene_names as hygiene_names;
}

/// The README's examples, compiled and run as doc tests so that they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
