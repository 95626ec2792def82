//! Host stand-ins of the CUDA driver, NVRTC and cuDNN 9: one shared library that the CUDA
//! backend loads, unchanged, in place of `libcuda.so`, `libnvrtc.so` and `libcudnn.so`
//! (`scripts/cuda-stand-in.sh` links it under those names and runs `tests/cuda_device.rs`
//! against it). It is a test double: it never ships, and nothing in a user's build depends on
//! it.
//!
//! It exports, with their real C signatures and status codes, exactly the functions the backend
//! calls through cudarc, and it is strict: every pointer the backend hands the driver or cuDNN
//! is checked against the live allocations, device memory sits against inaccessible guard
//! pages, and it errs where the real libraries err.
//!
//! - The driver ([`driver`]) is one sm_90 device with an H200's attributes; device memory is
//!   host memory ([`memory`]) under a budget (`CUDA_STAND_IN_MEMORY`, 8 GiB by default);
//!   streams are in order and execute synchronously.
//! - NVRTC ([`nvrtc`]) compiles the same CUDA source with the host's C++ compiler (`g++`, or
//!   `CUDA_STAND_IN_CXX`) against `include/cuda_stand_in.h`, which gives the kernels CUDA's
//!   dialect and their launcher; the "CUBIN" is the compiled shared object, cached by source
//!   and options (`CUDA_STAND_IN_CACHE`).
//! - Kernels ([`exec`]) run on the launching thread, block after block, each block's threads as
//!   fibers with a real barrier; `CUDA_STAND_IN_SCHEDULE=permuted` (seed `CUDA_STAND_IN_SEED`)
//!   runs the threads of every barrier phase, and the blocks, in a pseudo-random order.
//! - cuDNN ([`cudnn`]) validates descriptors like cuDNN 9, ranks algorithms adversarially (a
//!   non-deterministic or impossibly memory-hungry one first for some shapes, one the fused
//!   call refuses first for others) and computes each convolution with plain loops in the
//!   convolution's compute type.
//!
//! # What passing against it proves
//!
//! The backend's host logic (every driver and cuDNN call, its arguments, its error handling and
//! fallbacks), the kernels' launch geometry, index arithmetic, reductions and block-level
//! synchronization (a missing `__syncthreads()` or a shared-memory race changes the results,
//! especially under the permuted schedule), and that no kernel or library call touches memory
//! outside the buffers it was given (a fault is `CUDA_ERROR_ILLEGAL_ADDRESS`, as on a GPU).
//!
//! # What it does not prove
//!
//! Speed; anything about the GPU's memory model (warps, coalescing, caches, memory ordering
//! between blocks or of atomics — blocks never run concurrently here); the GPU's own math
//! library to the last bit (the host's libm stands in for it); and cuDNN's own algorithms,
//! whose rankings, workspaces and refusals are modelled, not reproduced.

pub mod cudnn;
pub mod driver;
pub mod exec;
pub mod memory;
pub mod nvrtc;

/// An environment variable as a string, if set and not empty.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Serializes the unit tests: they share the one primary context, and some of them make its
/// error sticky on purpose.
#[cfg(test)]
pub(crate) fn test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
