//! Building blocks of the CUDA backend (feature `cuda`).
//!
//! Nothing CUDA is needed to build: cudarc loads NVRTC (and, for the device, the driver and
//! cuDNN) when the program runs. Each generated layer carries its kernels as CUDA source
//! specialized to its spec (`Layer::__CUDA_SOURCE`, written from `conv_macros/kernels/*.cu`, with
//! the list of its kernels in `Layer::__CUDA_KERNELS`); [`nvrtc::compile`] turns that source into
//! a CUBIN for the GPU's architecture and [`nvrtc::kernel_names`] lists what a CUBIN defines.
//!
//! Data lives on the GPU in [`CudaTensor`] and [`CudaVector`]; each layer type also gets
//! device-resident counterparts (`LayerCuda`, `LayerCudaGrads`, `LayerCudaState`) whose operations
//! take and leave everything on the GPU, and [`crate::Sgd`] / [`crate::Adam`] step them there
//! (`step_cuda`, through [`CudaParameters`]). The layer's operations on host tensors
//! (`layer.forward(&mut cuda, ..)`) upload, run the same code and download.

mod device;
mod memory;
pub mod nvrtc;
pub(crate) mod optim;

pub use device::{blocks_for, Arg, ConvGeometry, Cuda, DeviceElement, LayerSetup, Session};
pub use memory::{reshape, Buf, CudaParamTensor, CudaTensor, CudaVector};
pub use optim::{CudaParameters, OPTIMIZER_KERNELS, OPTIMIZER_SOURCE};

/// Threads per block of every generated kernel (1-D blocks); any number of blocks is correct.
/// The kernels' `THREADS` (`conv_macros/kernels/common.cu`); tests/cuda_kernels.rs checks that
/// the two agree.
pub const THREADS: u32 = 256;
