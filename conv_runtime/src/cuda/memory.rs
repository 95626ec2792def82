//! GPU memory: untyped buffers for generated code, and the typed tensors users keep on the GPU.
//!
//! [`CudaTensor`] and [`CudaVector`] mirror [`Tensor`] and [`Vector`]: the shape lives in the
//! type, so a layer's device-resident operations accept exactly the shapes its spec allows. Each
//! carries a stamp like the host tensors (a new one whenever its contents may change), which the
//! optimizers use to notice parameters written behind their back. Every buffer remembers its
//! GPU; using it on another one is an error, not undefined behaviour.

use std::marker::PhantomData;

use cudarc::driver::{CudaSlice, DevicePtr};

use super::device::{as_bytes, as_bytes_mut, driver, Cuda, DeviceElement};
use crate::tensor::fresh_stamp;
use crate::{Error, Result, Tensor, Vector};

/// A buffer in GPU memory (untyped; generated code passes it to kernels and cuDNN).
pub struct Buf {
    bytes: CudaSlice<u8>,
    ptr: u64,
    ordinal: usize,
    /// The [`Cuda`] device (and so the stream) it belongs to: another device on the same GPU
    /// orders its work on another stream, which would race with this one's.
    device: u64,
}

impl Buf {
    /// `bytes` zeroed bytes on `dev` (at least one, so that every buffer has an address).
    pub(crate) fn zeros(dev: &Cuda, bytes: usize) -> Result<Self> {
        dev.bind()?;
        let slice = dev
            .stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| driver("cuMemAlloc", e))?;
        Ok(Self::wrap(dev, slice))
    }

    /// A copy of `host` on `dev`.
    pub(crate) fn upload<T: DeviceElement>(dev: &Cuda, host: &[T]) -> Result<Self> {
        if host.is_empty() {
            return Self::zeros(dev, 0);
        }
        dev.bind()?;
        let slice = dev
            .stream
            .clone_htod(as_bytes(host))
            .map_err(|e| driver("cuMemcpyHtoD", e))?;
        Ok(Self::wrap(dev, slice))
    }

    fn wrap(dev: &Cuda, bytes: CudaSlice<u8>) -> Self {
        let ptr = bytes.device_ptr(&dev.stream).0;
        Self {
            bytes,
            ptr,
            ordinal: dev.ordinal(),
            device: dev.id(),
        }
    }

    /// Its device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether it has no bytes (never: buffers have at least one).
    pub fn is_empty(&self) -> bool {
        self.bytes.len() == 0
    }

    /// An error unless the buffer was made by `dev` (not merely on its GPU: each device has its
    /// own stream).
    pub(crate) fn check(&self, dev: &Cuda, operation: &str) -> Result<()> {
        if self.device == dev.id() {
            Ok(())
        } else if self.ordinal == dev.ordinal() {
            Err(Error::new(
                operation,
                format!(
                    "a buffer of another Cuda device on GPU {} was passed to this one: each device orders its work on its own stream, so buffers stay with the device that made them",
                    self.ordinal
                ),
            ))
        } else {
            Err(Error::new(
                operation,
                format!(
                    "a buffer of GPU {} was passed to GPU {}",
                    self.ordinal,
                    dev.ordinal()
                ),
            ))
        }
    }

    /// Overwrites the first `host.len()` elements with `host`.
    pub(crate) fn write<T: DeviceElement>(&mut self, dev: &Cuda, host: &[T]) -> Result<()> {
        self.check(dev, "cuMemcpyHtoD")?;
        let host = as_bytes(host);
        if host.len() > self.bytes.len() {
            return Err(Error::new(
                "cuMemcpyHtoD",
                "the buffer is smaller than the tensor",
            ));
        }
        dev.bind()?;
        let mut dst = self.bytes.slice_mut(..host.len());
        dev.stream
            .memcpy_htod(host, &mut dst)
            .map_err(|e| driver("cuMemcpyHtoD", e))
    }

    /// Copies the first `host.len()` elements into `host` and waits for them.
    pub(crate) fn read<T: DeviceElement>(&self, dev: &Cuda, host: &mut [T]) -> Result<()> {
        self.check(dev, "cuMemcpyDtoH")?;
        let host = as_bytes_mut(host);
        if host.len() > self.bytes.len() {
            return Err(Error::new(
                "cuMemcpyDtoH",
                "the buffer is smaller than the tensor",
            ));
        }
        dev.bind()?;
        let src = self.bytes.slice(..host.len());
        dev.stream
            .memcpy_dtoh(&src, host)
            .map_err(|e| driver("cuMemcpyDtoH", e))?;
        dev.synchronize()
    }

    /// Sets every byte to zero.
    pub(crate) fn clear(&mut self, dev: &Cuda) -> Result<()> {
        self.check(dev, "cuMemsetD8Async")?;
        dev.bind()?;
        dev.stream
            .memset_zeros(&mut self.bytes)
            .map_err(|e| driver("cuMemsetD8Async", e))
    }

    /// Copies `other` (of the same length) into this buffer, on the GPU.
    pub(crate) fn copy_from(&mut self, dev: &Cuda, other: &Buf) -> Result<()> {
        self.check(dev, "cuMemcpyDtoDAsync")?;
        other.check(dev, "cuMemcpyDtoDAsync")?;
        if other.len() != self.len() {
            return Err(Error::new(
                "cuMemcpyDtoDAsync",
                "buffers of different sizes",
            ));
        }
        dev.bind()?;
        dev.stream
            .memcpy_dtod(&other.bytes, &mut self.bytes)
            .map_err(|e| driver("cuMemcpyDtoDAsync", e))
    }
}

/// A parameter tensor on the GPU as the optimizers see it (see [`super::CudaParameters`]).
pub trait CudaParamTensor {
    /// The buffer, for reading.
    fn buf(&self) -> &Buf;
    /// The buffer, for writing: gives the tensor a new stamp.
    fn buf_mut(&mut self) -> &mut Buf;
    /// The content stamp.
    fn stamp(&self) -> u64;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether it has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

macro_rules! device_dense {
    ($(#[$doc:meta])* $name:ident => $host:ident [$($dim:ident),+]) => {
        $(#[$doc])*
        // `repr(C)`: every shape has the same layout, so `reshape` is a pointer cast.
        #[repr(C)]
        pub struct $name<T, $(const $dim: usize),+> {
            buf: Buf,
            stamp: u64,
            _element: PhantomData<T>,
        }

        impl<T: DeviceElement, $(const $dim: usize),+> $name<T, $($dim),+> {
            /// Number of elements.
            pub const LEN: usize = 1 $(* $dim)+;

            /// All zeros, on `dev`.
            pub fn zeros(dev: &Cuda) -> Result<Self> {
                Ok(Self::wrap(Buf::zeros(dev, Self::LEN * std::mem::size_of::<T>())?))
            }

            /// A copy of `host` on `dev`.
            pub fn upload(dev: &Cuda, host: &$host<T, $($dim),+>) -> Result<Self> {
                Ok(Self::wrap(Buf::upload(dev, host.as_slice())?))
            }

            /// Overwrites the contents with `host`.
            pub fn copy_from_host(&mut self, dev: &Cuda, host: &$host<T, $($dim),+>) -> Result<()> {
                self.stamp = fresh_stamp();
                self.buf.write(dev, host.as_slice())
            }

            /// Overwrites the contents with those of `other`, on the GPU.
            pub fn copy_from(&mut self, dev: &Cuda, other: &Self) -> Result<()> {
                self.stamp = fresh_stamp();
                self.buf.copy_from(dev, &other.buf)
            }

            /// A host copy (waits for the GPU).
            pub fn download(&self, dev: &Cuda) -> Result<$host<T, $($dim),+>> {
                let mut host = $host::zeros();
                self.download_into(dev, &mut host)?;
                Ok(host)
            }

            /// Copies the contents into `host` (waits for the GPU).
            pub fn download_into(&self, dev: &Cuda, host: &mut $host<T, $($dim),+>) -> Result<()> {
                self.buf.read(dev, host.as_mut_slice())
            }

            /// Sets every element to zero.
            pub fn zero(&mut self, dev: &Cuda) -> Result<()> {
                self.stamp = fresh_stamp();
                self.buf.clear(dev)
            }

            fn wrap(buf: Buf) -> Self {
                Self { buf, stamp: fresh_stamp(), _element: PhantomData }
            }
        }

        impl<T, $(const $dim: usize),+> $name<T, $($dim),+> {
            /// The content stamp (see [`CudaParamTensor`]).
            pub fn stamp(&self) -> u64 {
                self.stamp
            }

            /// The buffer, for reading (generated code).
            #[doc(hidden)]
            pub fn __buf(&self) -> &Buf {
                &self.buf
            }

            /// The buffer, for writing (generated code); gives a new stamp.
            #[doc(hidden)]
            pub fn __buf_mut(&mut self) -> &mut Buf {
                self.stamp = fresh_stamp();
                &mut self.buf
            }
        }

        impl<T: DeviceElement, $(const $dim: usize),+> CudaParamTensor for $name<T, $($dim),+> {
            fn buf(&self) -> &Buf {
                &self.buf
            }
            fn buf_mut(&mut self) -> &mut Buf {
                self.__buf_mut()
            }
            fn stamp(&self) -> u64 {
                self.stamp
            }
            fn len(&self) -> usize {
                Self::LEN
            }
        }

        impl<T, $(const $dim: usize),+> std::fmt::Debug for $name<T, $($dim),+> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("shape", &[$($dim),+])
                    .field("gpu", &self.buf.ordinal)
                    .finish()
            }
        }
    };
}

device_dense!(
    /// A [`Tensor`] in GPU memory: dense, row-major NHWC, its shape in the type.
    CudaTensor => Tensor [N, H, W, C]
);
device_dense!(
    /// A [`Vector`] in GPU memory.
    CudaVector => Vector [N]
);

/// `t` as a tensor of the same batch and length in another shape: `network!`'s `Flatten` (a
/// map as `[B, 1, 1, H * W * C]` features) on the GPU, without a copy.
///
/// # Panics
/// When the lengths differ (generated code calls it with shapes chained at expansion time).
pub fn reshape<
    T,
    const B: usize,
    const H: usize,
    const W: usize,
    const C: usize,
    const H2: usize,
    const W2: usize,
    const C2: usize,
>(
    t: &CudaTensor<T, B, H, W, C>,
) -> &CudaTensor<T, B, H2, W2, C2> {
    assert!(H * W * C == H2 * W2 * C2, "a reshape keeps the length");
    // SAFETY: `CudaTensor` is `repr(C)` with fields independent of the shape parameters.
    unsafe { &*(t as *const CudaTensor<T, B, H, W, C>).cast::<CudaTensor<T, B, H2, W2, C2>>() }
}
