//! The `Cuda` device: a context, a stream, a cuDNN handle and a workspace; and what generated
//! layers call to run their operations on it.
//!
//! Each layer type has a `static` [`LayerSetup`] (its CUDA source, kernel names and, for
//! cuDNN layers, its convolution geometry with the spec's literal sizes). On first use the
//! source is compiled with NVRTC for the GPU's own architecture (`sm_XY` from its compute
//! capability) and the CUBIN is kept in the setup, per architecture, for every device and
//! thread; each device loads the module once and resolves every kernel the layer lists. cuDNN
//! descriptors are built once per layer type and batch (in the setup); the algorithms are chosen
//! once per device, layer type and batch, each the first in cuDNN's ranking that is
//! deterministic and whose workspace can be allocated (the first that runs and fits where none
//! is deterministic), all with `CUDNN_FMA_MATH` (TF32 would round the operands).
//!
//! The operations take host tensors: a [`Session`] uploads what a kernel reads, runs the
//! recipe of `conv_macros::expand::cuda` and downloads the results. Gradients accumulate on
//! the GPU into an uploaded copy of the host gradients (every reduction kernel and cuDNN's
//! weight gradient add to their destination), which then replaces the host copy.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cudnn::sys as dnn;
use cudarc::driver::{
    sys as drv, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::memory::Buf;
use super::{nvrtc, THREADS};
use crate::{bf16, f16, Element, Error, Result};

/// Element types that live on the GPU as their bytes (plain data without padding).
pub trait DeviceElement: Element + sealed::Sealed {
    /// The type's name in kernel names (`f64`, `f32`, `f16`, `bf16`).
    const NAME: &'static str;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! device_element {
    ($($t:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl DeviceElement for $t {
            const NAME: &'static str = stringify!($t);
        }
    )*};
}
device_element!(f64, f32, f16, bf16);

pub(super) fn as_bytes<T: DeviceElement>(values: &[T]) -> &[u8] {
    // SAFETY: f64, f32, f16 and bf16 are plain data without padding; any byte is readable.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

pub(super) fn as_bytes_mut<T: DeviceElement>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern is a valid value of these types.
    unsafe {
        std::slice::from_raw_parts_mut(
            values.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(values),
        )
    }
}

pub(super) fn driver(operation: &str, e: cudarc::driver::DriverError) -> Error {
    Error::new(operation, format!("{:?}", e.0))
}

fn cudnn(operation: &str, status: dnn::cudnnStatus_t) -> Result<()> {
    if status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut reason = format!("{status:?}");
    if status == dnn::cudnnStatus_t::CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED {
        if let Some(failures) = SUBLIBRARY_FAILURES.get().filter(|f| !f.is_empty()) {
            reason.push_str(&format!(" ({})", failures.join("; ")));
        }
    }
    Err(Error::new(operation, reason))
}

/// cuDNN sub-libraries that failed to load when cuDNN was loaded by path, with the loader's
/// reasons.
static SUBLIBRARY_FAILURES: OnceLock<Vec<String>> = OnceLock::new();

/// A convolution's sizes, as literals in the generated code of a cuDNN layer.
#[derive(Clone, Copy, Debug)]
pub struct ConvGeometry {
    pub in_h: usize,
    pub in_w: usize,
    pub in_c: usize,
    pub out_h: usize,
    pub out_w: usize,
    pub out_c: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    /// f64 layers convolve in double; every other layer in float (half layers on widened
    /// copies, see `conv_macros/kernels/widen.cu`).
    pub double: bool,
}

/// Everything one layer type needs on any device, built on first use.
pub struct LayerSetup {
    source: &'static str,
    kernels: &'static [&'static str],
    geometry: Option<ConvGeometry>,
    /// CUBINs per architecture.
    cubins: Mutex<Vec<(String, Arc<Vec<u8>>)>>,
    /// cuDNN descriptors per batch.
    descriptors: Mutex<Vec<(usize, Arc<Descriptors>)>>,
}

impl LayerSetup {
    /// A setup for a layer's `__CUDA_SOURCE` and `__CUDA_KERNELS`, and its geometry when its
    /// convolutions run in cuDNN (`None` when they run in the direct kernels).
    pub const fn new(
        source: &'static str,
        kernels: &'static [&'static str],
        geometry: Option<ConvGeometry>,
    ) -> Self {
        Self {
            source,
            kernels,
            geometry,
            cubins: Mutex::new(Vec::new()),
            descriptors: Mutex::new(Vec::new()),
        }
    }

    fn id(&'static self) -> usize {
        self as *const Self as usize
    }

    fn cubin(&self, arch: &str) -> Result<Arc<Vec<u8>>> {
        // Held while compiling: two threads wanting the same layer compile it once.
        let mut cubins = self
            .cubins
            .lock()
            .map_err(|_| Error::new("CUDA kernel cache", "poisoned by a panic"))?;
        if let Some((_, cubin)) = cubins.iter().find(|(a, _)| a == arch) {
            return Ok(cubin.clone());
        }
        let cubin = Arc::new(nvrtc::compile(self.source, arch)?);
        cubins.push((arch.to_string(), cubin.clone()));
        Ok(cubin)
    }

    fn descriptors(&self, batch: usize) -> Result<Arc<Descriptors>> {
        let geometry = self.geometry.ok_or_else(|| {
            Error::new(
                "cuDNN convolution",
                "the layer's convolutions run in the direct kernels",
            )
        })?;
        let mut all = self
            .descriptors
            .lock()
            .map_err(|_| Error::new("cuDNN descriptor cache", "poisoned by a panic"))?;
        if let Some((_, d)) = all.iter().find(|(b, _)| *b == batch) {
            return Ok(d.clone());
        }
        // Descriptors are cuDNN's: load it first, so that its absence is an error, not a panic
        // in the loader.
        load_cudnn()?;
        let d = Arc::new(Descriptors::new(&geometry, batch)?);
        all.push((batch, d.clone()));
        Ok(d)
    }
}

/// cuDNN descriptors of one layer type at one batch: NHWC tensors, an OHWI (`KRSC`) filter.
struct Descriptors {
    x: TensorDesc,
    y: TensorDesc,
    bias: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    /// ReLU, for the fused convolution + bias + activation call.
    relu: ActivationDesc,
    double: bool,
}

// SAFETY: the descriptors are written once, when created, and only read afterwards (cuDNN
// reads descriptors without modifying them).
unsafe impl Send for Descriptors {}
unsafe impl Sync for Descriptors {}

impl Descriptors {
    fn new(g: &ConvGeometry, batch: usize) -> Result<Self> {
        let int = |n: usize| {
            c_int::try_from(n)
                .map_err(|_| Error::new("cuDNN descriptor", format!("{n} exceeds int")))
        };
        let data = if g.double {
            dnn::cudnnDataType_t::CUDNN_DATA_DOUBLE
        } else {
            dnn::cudnnDataType_t::CUDNN_DATA_FLOAT
        };
        let nhwc = dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        let x = TensorDesc::nhwc(
            data,
            [int(batch)?, int(g.in_c)?, int(g.in_h)?, int(g.in_w)?],
        )?;
        let y = TensorDesc::nhwc(
            data,
            [int(batch)?, int(g.out_c)?, int(g.out_h)?, int(g.out_w)?],
        )?;
        let bias = TensorDesc::nhwc(data, [1, int(g.out_c)?, 1, 1])?;
        let w = FilterDesc::new()?;
        // SAFETY: a descriptor just created.
        cudnn("cudnnSetFilter4dDescriptor", unsafe {
            dnn::cudnnSetFilter4dDescriptor(
                w.0,
                data,
                nhwc,
                int(g.out_c)?,
                int(g.in_c)?,
                int(g.kernel[0])?,
                int(g.kernel[1])?,
            )
        })?;
        let conv = ConvDesc::new()?;
        // SAFETY: a descriptor just created.
        cudnn("cudnnSetConvolution2dDescriptor", unsafe {
            dnn::cudnnSetConvolution2dDescriptor(
                conv.0,
                int(g.padding[0])?,
                int(g.padding[1])?,
                int(g.stride[0])?,
                int(g.stride[1])?,
                1,
                1,
                dnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                data,
            )
        })?;
        // Plain FMA arithmetic: no tensor-core conversions (TF32) of the operands.
        // SAFETY: as above.
        cudnn("cudnnSetConvolutionMathType", unsafe {
            dnn::cudnnSetConvolutionMathType(conv.0, dnn::cudnnMathType_t::CUDNN_FMA_MATH)
        })?;
        let relu = ActivationDesc::new()?;
        // max(x, 0): no ceiling (`coef` is read only by clipped ReLU); NaN becomes 0, as in the
        // generated ReLU (`x > 0 ? x : 0`), and the only setting the fused call supports.
        // SAFETY: a descriptor just created.
        cudnn("cudnnSetActivationDescriptor", unsafe {
            dnn::cudnnSetActivationDescriptor(
                relu.0,
                dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                dnn::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                0.0,
            )
        })?;
        Ok(Self {
            x,
            y,
            bias,
            w,
            conv,
            relu,
            double: g.double,
        })
    }
}

/// `struct Name(raw)` owning a cuDNN descriptor: `Name::new()` creates it (a failure is an error
/// naming the call) and dropping it destroys it.
macro_rules! descriptor {
    ($($name:ident($raw:ty): $create:ident, $destroy:ident;)*) => {$(
        struct $name($raw);

        impl $name {
            fn new() -> Result<Self> {
                load_cudnn()?;
                let mut raw = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                cudnn(stringify!($create), unsafe { dnn::$create(&mut raw) })?;
                Ok(Self(raw))
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: created by the matching create call, destroyed only here.
                let _ = unsafe { dnn::$destroy(self.0) };
            }
        }
    )*};
}

descriptor! {
    TensorDesc(dnn::cudnnTensorDescriptor_t): cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor;
    FilterDesc(dnn::cudnnFilterDescriptor_t): cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor;
    ConvDesc(dnn::cudnnConvolutionDescriptor_t): cudnnCreateConvolutionDescriptor, cudnnDestroyConvolutionDescriptor;
    ActivationDesc(dnn::cudnnActivationDescriptor_t): cudnnCreateActivationDescriptor, cudnnDestroyActivationDescriptor;
}

impl TensorDesc {
    /// An NHWC tensor of `data` with sizes given as cuDNN orders them, `[n, c, h, w]`.
    fn nhwc(data: dnn::cudnnDataType_t, nchw: [c_int; 4]) -> Result<Self> {
        let desc = Self::new()?;
        let [n, c, h, w] = nchw;
        // SAFETY: a descriptor just created.
        cudnn("cudnnSetTensor4dDescriptor", unsafe {
            dnn::cudnnSetTensor4dDescriptor(
                desc.0,
                dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
                data,
                n,
                c,
                h,
                w,
            )
        })?;
        Ok(desc)
    }
}

struct Handle(dnn::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreate, destroyed only here.
        let _ = unsafe { dnn::cudnnDestroy(self.0) };
    }
}

/// The algorithms chosen for one layer type and batch on one device.
#[derive(Clone, Copy)]
struct Algorithms {
    forward: dnn::cudnnConvolutionFwdAlgo_t,
    forward_bytes: usize,
    data: dnn::cudnnConvolutionBwdDataAlgo_t,
    data_bytes: usize,
    filter: dnn::cudnnConvolutionBwdFilterAlgo_t,
    filter_bytes: usize,
}

/// The algorithm to run among cuDNN's ranked candidates `(status, determinism, algorithm,
/// workspace bytes)`: the first deterministic one cuDNN can run and whose workspace `fits`, so
/// that training is reproducible; else the first it can run at all (a layer is better
/// slower-to-reproduce than unusable), which the caller counts (`false`: not deterministic).
fn pick<A: Copy>(
    operation: &str,
    candidates: impl Iterator<Item = (dnn::cudnnStatus_t, dnn::cudnnDeterminism_t, A, usize)> + Clone,
    mut fits: impl FnMut(usize) -> Result<bool>,
) -> Result<(A, bool)> {
    let runs = |c: &(dnn::cudnnStatus_t, dnn::cudnnDeterminism_t, A, usize)| {
        c.0 == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS
    };
    let deterministic = |c: &(dnn::cudnnStatus_t, dnn::cudnnDeterminism_t, A, usize)| {
        c.1 == dnn::cudnnDeterminism_t::CUDNN_DETERMINISTIC
    };
    let first = candidates.clone().filter(|c| runs(c) && deterministic(c));
    for c in first.chain(candidates.filter(runs)) {
        if fits(c.3)? {
            return Ok((c.2, deterministic(&c)));
        }
    }
    Err(Error::new(operation, "no algorithm supports the layer"))
}

/// A layer type's module on one device: every kernel it lists, by name.
struct Kernels(HashMap<&'static str, CudaFunction>);

/// A CUDA GPU. Create with [`Cuda::new`]; pass to a layer's operations like [`crate::Cpu`].
///
/// Fields drop in declaration order: the cuDNN handle (bound to the stream) and the buffers
/// before the stream, the stream before the context.
pub struct Cuda {
    /// cuDNN, loaded and bound to the stream on first use: a GPU without cuDNN still runs the
    /// layers whose convolutions are the direct kernels.
    handle: Option<Handle>,
    workspace: Option<CudaSlice<u8>>,
    modules: HashMap<usize, Arc<Kernels>>,
    algorithms: HashMap<(usize, usize), Algorithms>,
    /// Layer types and batches whose fused convolution + bias + ReLU cuDNN does not support.
    unfused: std::collections::HashSet<(usize, usize)>,
    /// Algorithm choices that found no deterministic algorithm cuDNN could run.
    nondeterministic: usize,
    arch: String,
    name: String,
    /// Unique among the devices of the process: buffers remember the device that made them.
    id: u64,
    pub(super) stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl Cuda {
    /// The GPU with this ordinal: a context, a stream and a cuDNN handle on it. A missing
    /// driver, no such GPU, or a missing cuDNN is an error naming the call.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics when it cannot open libcuda: ask first.
        // SAFETY: only tries to load the library.
        if !unsafe { drv::is_culib_present() } {
            return Err(Error::new(
                "loading the CUDA driver",
                "libcuda.so was not found (no NVIDIA driver installed)",
            ));
        }
        let count =
            CudaContext::device_count().map_err(|e| driver("cuInit / cuDeviceGetCount", e))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(Error::new(
                "cuDeviceGet",
                format!("GPU {ordinal} requested, {count} present"),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
        // One stream orders every operation of this device: cudarc's per-buffer events would
        // only add work.
        // SAFETY: nothing of this context is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| driver("cuStreamCreate", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("cuDeviceGetAttribute (compute capability)", e))?;
        let name = ctx.name().map_err(|e| driver("cuDeviceGetName", e))?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            handle: None,
            workspace: None,
            modules: HashMap::new(),
            algorithms: HashMap::new(),
            unfused: Default::default(),
            nondeterministic: 0,
            arch: format!("sm_{major}{minor}"),
            name,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            stream,
            ctx,
        })
    }

    /// The cuDNN handle, on first use loading cuDNN, creating the handle and binding it to the
    /// device's stream.
    fn cudnn_handle(&mut self) -> Result<dnn::cudnnHandle_t> {
        if let Some(h) = &self.handle {
            return Ok(h.0);
        }
        load_cudnn()?;
        self.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the context is current on this thread.
        cudnn("cudnnCreate", unsafe { dnn::cudnnCreate(&mut raw) })?;
        let handle = Handle(raw);
        // SAFETY: a live handle and stream.
        cudnn("cudnnSetStream", unsafe {
            dnn::cudnnSetStream(handle.0, self.stream.cu_stream() as dnn::cudaStream_t)
        })?;
        let h = handle.0;
        self.handle = Some(handle);
        Ok(h)
    }

    /// Identifies this device among the process's devices.
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// Layer types and batches whose cuDNN gradients found no deterministic algorithm cuDNN
    /// could run (with its workspace) and run a non-deterministic one: their training is not
    /// bit-reproducible. Zero on every shape the suites check.
    pub fn nondeterministic_algorithms(&self) -> usize {
        self.nondeterministic
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes the context current on this thread (every call into the driver needs it).
    pub(super) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))
    }

    /// The architecture kernels are compiled for, e.g. `"sm_90"`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for everything queued on the device.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver("cuStreamSynchronize", e))
    }

    /// Starts an operation of the layer type `setup` (generated code calls this).
    #[doc(hidden)]
    pub fn __session(&mut self, setup: &'static LayerSetup) -> Result<Session<'_>> {
        self.bind()?;
        let kernels = match self.modules.get(&setup.id()) {
            Some(k) => k.clone(),
            None => {
                let cubin = setup.cubin(&self.arch)?;
                let module: Arc<CudaModule> = self
                    .ctx
                    .load_module(Ptx::from_binary(cubin.as_ref().clone()))
                    .map_err(|e| driver("cuModuleLoadData", e))?;
                let mut map = HashMap::new();
                for &name in setup.kernels {
                    let f = module
                        .load_function(name)
                        .map_err(|e| driver(&format!("cuModuleGetFunction({name})"), e))?;
                    map.insert(name, f);
                }
                let k = Arc::new(Kernels(map));
                self.modules.insert(setup.id(), k.clone());
                k
            }
        };
        Ok(Session {
            dev: self,
            setup,
            kernels,
        })
    }

    fn algorithms(
        &mut self,
        setup: &'static LayerSetup,
        batch: usize,
        d: &Descriptors,
    ) -> Result<Algorithms> {
        if let Some(a) = self.algorithms.get(&(setup.id(), batch)) {
            return Ok(*a);
        }
        let h = self.cudnn_handle()?;
        const N: usize = 16;
        let mut count: c_int = 0;
        // SAFETY (all three queries): live handle and descriptors, out-arrays of N entries.
        let mut fwd: [dnn::cudnnConvolutionFwdAlgoPerf_t; N] = unsafe { std::mem::zeroed() };
        cudnn("cudnnGetConvolutionForwardAlgorithm_v7", unsafe {
            dnn::cudnnGetConvolutionForwardAlgorithm_v7(
                h,
                d.x.0,
                d.w.0,
                d.conv.0,
                d.y.0,
                N as c_int,
                &mut count,
                fwd.as_mut_ptr(),
            )
        })?;
        let (forward, forward_deterministic) = pick(
            "cudnnGetConvolutionForwardAlgorithm_v7",
            fwd[..count.max(0) as usize]
                .iter()
                .map(|p| (p.status, p.determinism, p.algo, p.memory)),
            |bytes| self.workspace_fits(bytes),
        )?;
        let mut bwd: [dnn::cudnnConvolutionBwdDataAlgoPerf_t; N] = unsafe { std::mem::zeroed() };
        cudnn("cudnnGetConvolutionBackwardDataAlgorithm_v7", unsafe {
            dnn::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                h,
                d.w.0,
                d.y.0,
                d.conv.0,
                d.x.0,
                N as c_int,
                &mut count,
                bwd.as_mut_ptr(),
            )
        })?;
        let (data, data_deterministic) = pick(
            "cudnnGetConvolutionBackwardDataAlgorithm_v7",
            bwd[..count.max(0) as usize]
                .iter()
                .map(|p| (p.status, p.determinism, p.algo, p.memory)),
            |bytes| self.workspace_fits(bytes),
        )?;
        let mut flt: [dnn::cudnnConvolutionBwdFilterAlgoPerf_t; N] = unsafe { std::mem::zeroed() };
        cudnn("cudnnGetConvolutionBackwardFilterAlgorithm_v7", unsafe {
            dnn::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                h,
                d.x.0,
                d.y.0,
                d.conv.0,
                d.w.0,
                N as c_int,
                &mut count,
                flt.as_mut_ptr(),
            )
        })?;
        let (filter, filter_deterministic) = pick(
            "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
            flt[..count.max(0) as usize]
                .iter()
                .map(|p| (p.status, p.determinism, p.algo, p.memory)),
            |bytes| self.workspace_fits(bytes),
        )?;
        if !(forward_deterministic && data_deterministic && filter_deterministic) {
            self.nondeterministic += 1;
        }
        let (mut forward_bytes, mut data_bytes, mut filter_bytes) = (0usize, 0usize, 0usize);
        // SAFETY: live handle and descriptors, valid out-pointers.
        cudnn("cudnnGetConvolutionForwardWorkspaceSize", unsafe {
            dnn::cudnnGetConvolutionForwardWorkspaceSize(
                h,
                d.x.0,
                d.w.0,
                d.conv.0,
                d.y.0,
                forward,
                &mut forward_bytes,
            )
        })?;
        cudnn("cudnnGetConvolutionBackwardDataWorkspaceSize", unsafe {
            dnn::cudnnGetConvolutionBackwardDataWorkspaceSize(
                h,
                d.w.0,
                d.y.0,
                d.conv.0,
                d.x.0,
                data,
                &mut data_bytes,
            )
        })?;
        cudnn("cudnnGetConvolutionBackwardFilterWorkspaceSize", unsafe {
            dnn::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                h,
                d.x.0,
                d.y.0,
                d.conv.0,
                d.w.0,
                filter,
                &mut filter_bytes,
            )
        })?;
        let a = Algorithms {
            forward,
            forward_bytes,
            data,
            data_bytes,
            filter,
            filter_bytes,
        };
        self.algorithms.insert((setup.id(), batch), a);
        Ok(a)
    }

    /// The workspace, at least `bytes` long: its pointer (0 when none is needed).
    fn workspace(&mut self, bytes: usize) -> Result<u64> {
        self.grow_workspace(bytes)
            .map_err(|e| driver("cuMemAlloc (cuDNN workspace)", e))
    }

    /// Whether a workspace of `bytes` can be had (it is kept): cuDNN ranks its algorithms
    /// without regard to free memory, so its first choice may need more than the GPU has.
    fn workspace_fits(&mut self, bytes: usize) -> Result<bool> {
        match self.grow_workspace(bytes) {
            Ok(_) => Ok(true),
            Err(e) if e.0 == drv::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Ok(false),
            Err(e) => Err(driver("cuMemAlloc (cuDNN workspace)", e)),
        }
    }

    fn grow_workspace(
        &mut self,
        bytes: usize,
    ) -> std::result::Result<u64, cudarc::driver::DriverError> {
        if bytes == 0 {
            return Ok(0);
        }
        if self.workspace.as_ref().is_none_or(|w| w.len() < bytes) {
            self.workspace = None;
            // SAFETY: scratch memory, written by cuDNN before it reads it.
            self.workspace = Some(unsafe { self.stream.alloc::<u8>(bytes) }?);
        }
        Ok(self
            .workspace
            .as_ref()
            .map_or(0, |w| w.device_ptr(&self.stream).0))
    }
}

/// One kernel argument.
pub enum Arg<'a> {
    /// `int`
    Int(usize),
    /// `long long`
    Long(usize),
    /// A pointer to a buffer.
    Buf(&'a Buf),
    /// `double`
    F64(f64),
    /// `nullptr`
    Null,
}

/// Blocks for `items` work items of one thread each (the kernels loop over any remainder).
pub fn blocks_for(items: usize) -> usize {
    items.div_ceil(THREADS as usize).clamp(1, 65_535)
}

/// One operation of one layer type on a [`Cuda`] device.
pub struct Session<'a> {
    dev: &'a mut Cuda,
    setup: &'static LayerSetup,
    kernels: Arc<Kernels>,
}

impl Session<'_> {
    /// A buffer of `len` elements of `T`, zeroed.
    pub fn zeros<T: DeviceElement>(&self, len: usize) -> Result<Buf> {
        Buf::zeros(self.dev, len * std::mem::size_of::<T>())
    }

    /// A buffer of `bytes` bytes, zeroed.
    pub fn zeros_bytes(&self, bytes: usize) -> Result<Buf> {
        Buf::zeros(self.dev, bytes)
    }

    /// Launches `kernel` on `blocks` blocks of `THREADS` threads.
    pub fn launch(&self, kernel: &str, blocks: usize, args: &[Arg<'_>]) -> Result<()> {
        let f = self.kernels.0.get(kernel).ok_or_else(|| {
            Error::new(
                format!("launching {kernel}"),
                "the layer's module has no such kernel",
            )
        })?;
        let operation = || format!("cuLaunchKernel({kernel})");
        let ints = args
            .iter()
            .map(|a| match a {
                Arg::Int(n) => i32::try_from(*n)
                    .map_err(|_| Error::new(operation(), format!("{n} exceeds int"))),
                _ => Ok(0),
            })
            .collect::<Result<Vec<i32>>>()?;
        let longs = args
            .iter()
            .map(|a| match a {
                Arg::Long(n) => i64::try_from(*n)
                    .map_err(|_| Error::new(operation(), format!("{n} exceeds long long"))),
                Arg::Buf(b) => {
                    b.check(self.dev, &operation())?;
                    i64::try_from(b.ptr()).map_err(|_| Error::new(operation(), "pointer"))
                }
                _ => Ok(0),
            })
            .collect::<Result<Vec<i64>>>()?;
        let mut builder = self.dev.stream.launch_builder(f);
        for (i, a) in args.iter().enumerate() {
            match a {
                Arg::Int(_) => builder.arg(&ints[i]),
                Arg::F64(v) => builder.arg(v),
                // A pointer is passed as its 64-bit value.
                Arg::Long(_) | Arg::Buf(_) | Arg::Null => builder.arg(&longs[i]),
            };
        }
        let grid = u32::try_from(blocks.max(1)).unwrap_or(u32::MAX);
        let config = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list is the kernel's (its comment in conv_macros/kernels), as
        // the generated recipe writes it; the buffers hold what the kernel indexes.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|e| driver(&operation(), e))
    }

    fn scalars(&self, d: &Descriptors) -> ([u8; 8], [u8; 8], [u8; 8]) {
        // cuDNN's alpha and beta are doubles for double convolutions, floats otherwise.
        let s = |v: f64| {
            let mut b = [0u8; 8];
            if d.double {
                b.copy_from_slice(&v.to_ne_bytes());
            } else {
                b[..4].copy_from_slice(&(v as f32).to_ne_bytes());
            }
            b
        };
        (s(0.0), s(1.0), s(0.0))
    }

    /// An error unless every buffer lives on this session's GPU.
    fn check(&self, operation: &str, bufs: &[&Buf]) -> Result<()> {
        bufs.iter().try_for_each(|b| b.check(self.dev, operation))
    }

    /// `y = max(conv(x, w) + bias, 0)` in one cuDNN call (`cudnnConvolutionBiasActivationForward`,
    /// rl_tools' fused path), `batch` images (accumulator-type buffers). `Ok(false)` when cuDNN
    /// does not support the fused call for this layer (remembered per layer type and batch):
    /// the caller then runs the separate calls.
    pub fn conv_forward_relu(
        &mut self,
        batch: usize,
        x: &Buf,
        w: &Buf,
        bias: &Buf,
        y: &Buf,
    ) -> Result<bool> {
        let operation = "cudnnConvolutionBiasActivationForward";
        self.check(operation, &[x, w, bias, y])?;
        let key = (self.setup.id(), batch);
        if self.dev.unfused.contains(&key) {
            return Ok(false);
        }
        let d = self.setup.descriptors(batch)?;
        let handle = self.dev.cudnn_handle()?;
        let a = self.dev.algorithms(self.setup, batch, &d)?;
        let ws = self.dev.workspace(a.forward_bytes)?;
        let (zero, one, _) = self.scalars(&d);
        // `z` is `y` scaled by alpha2 = 0; cleared first, so that whatever `y` held (an
        // infinity times zero is NaN) cannot reach the result.
        self.clear(y)?;
        // SAFETY: live handle and descriptors; the buffers have the descriptors' sizes.
        let status = unsafe {
            dnn::cudnnConvolutionBiasActivationForward(
                handle,
                one.as_ptr().cast(),
                d.x.0,
                x.ptr() as *const c_void,
                d.w.0,
                w.ptr() as *const c_void,
                d.conv.0,
                a.forward,
                ws as *mut c_void,
                a.forward_bytes,
                zero.as_ptr().cast(),
                d.y.0,
                y.ptr() as *const c_void,
                d.bias.0,
                bias.ptr() as *const c_void,
                d.relu.0,
                d.y.0,
                y.ptr() as *mut c_void,
            )
        };
        // CUDNN_STATUS_NOT_SUPPORTED, or one of the sub-codes by which cuDNN 9 says why
        // (CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN and the others, 3001-3013).
        if (3000..4000).contains(&(status as u32)) {
            self.dev.unfused.insert(key);
            return Ok(false);
        }
        cudnn(operation, status).map(|()| true)
    }

    /// Sets every byte of `buf` to zero (queued on the stream).
    pub fn clear(&self, buf: &Buf) -> Result<()> {
        buf.check(self.dev, "cuMemsetD8Async")?;
        // SAFETY: the buffer's own address and length, on its own GPU's stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                buf.ptr(),
                0,
                buf.len(),
                self.dev.stream.cu_stream(),
            )
        }
        .map_err(|e| driver("cuMemsetD8Async", e))
    }

    /// `y = conv(x, w) + bias` in cuDNN, `batch` images (accumulator-type buffers).
    pub fn conv_forward(
        &mut self,
        batch: usize,
        x: &Buf,
        w: &Buf,
        bias: &Buf,
        y: &Buf,
    ) -> Result<()> {
        self.check("cudnnConvolutionForward", &[x, w, bias, y])?;
        let d = self.setup.descriptors(batch)?;
        let handle = self.dev.cudnn_handle()?;
        let a = self.dev.algorithms(self.setup, batch, &d)?;
        let ws = self.dev.workspace(a.forward_bytes)?;
        let (zero, one, _) = self.scalars(&d);
        // SAFETY: live handle and descriptors; the buffers have the descriptors' sizes.
        cudnn("cudnnConvolutionForward", unsafe {
            dnn::cudnnConvolutionForward(
                handle,
                one.as_ptr().cast(),
                d.x.0,
                x.ptr() as *const c_void,
                d.w.0,
                w.ptr() as *const c_void,
                d.conv.0,
                a.forward,
                ws as *mut c_void,
                a.forward_bytes,
                zero.as_ptr().cast(),
                d.y.0,
                y.ptr() as *mut c_void,
            )
        })?;
        // SAFETY: as above; the bias broadcasts over batch and pixels.
        cudnn("cudnnAddTensor", unsafe {
            dnn::cudnnAddTensor(
                handle,
                one.as_ptr().cast(),
                d.bias.0,
                bias.ptr() as *const c_void,
                one.as_ptr().cast(),
                d.y.0,
                y.ptr() as *mut c_void,
            )
        })
    }

    /// `dx = conv_transpose(dz, w)` in cuDNN at the training batch (overwrites `dx`).
    pub fn conv_backward_data(&mut self, batch: usize, w: &Buf, dz: &Buf, dx: &Buf) -> Result<()> {
        self.check("cudnnConvolutionBackwardData", &[w, dz, dx])?;
        let d = self.setup.descriptors(batch)?;
        let handle = self.dev.cudnn_handle()?;
        let a = self.dev.algorithms(self.setup, batch, &d)?;
        let ws = self.dev.workspace(a.data_bytes)?;
        let (zero, one, _) = self.scalars(&d);
        // SAFETY: live handle and descriptors; the buffers have the descriptors' sizes.
        cudnn("cudnnConvolutionBackwardData", unsafe {
            dnn::cudnnConvolutionBackwardData(
                handle,
                one.as_ptr().cast(),
                d.w.0,
                w.ptr() as *const c_void,
                d.y.0,
                dz.ptr() as *const c_void,
                d.conv.0,
                a.data,
                ws as *mut c_void,
                a.data_bytes,
                zero.as_ptr().cast(),
                d.x.0,
                dx.ptr() as *mut c_void,
            )
        })
    }

    /// `dw += weight gradient of (x, dz)` in cuDNN at the training batch.
    pub fn conv_backward_filter(
        &mut self,
        batch: usize,
        x: &Buf,
        dz: &Buf,
        dw: &Buf,
    ) -> Result<()> {
        self.check("cudnnConvolutionBackwardFilter", &[x, dz, dw])?;
        let d = self.setup.descriptors(batch)?;
        let handle = self.dev.cudnn_handle()?;
        let a = self.dev.algorithms(self.setup, batch, &d)?;
        let ws = self.dev.workspace(a.filter_bytes)?;
        let (_, one, _) = self.scalars(&d);
        // SAFETY: live handle and descriptors; the buffers have the descriptors' sizes.
        cudnn("cudnnConvolutionBackwardFilter", unsafe {
            dnn::cudnnConvolutionBackwardFilter(
                handle,
                one.as_ptr().cast(),
                d.x.0,
                x.ptr() as *const c_void,
                d.y.0,
                dz.ptr() as *const c_void,
                d.conv.0,
                a.filter,
                ws as *mut c_void,
                a.filter_bytes,
                // beta = 1: gradients accumulate.
                one.as_ptr().cast(),
                d.w.0,
                dw.ptr() as *mut c_void,
            )
        })
    }
}

/// The cuDNN library's file name (cuDNN 9).
const CUDNN_LIBRARY: &str = "libcudnn.so.9";

/// Makes `libcudnn.so.9` loadable by name for cudarc: found by the loader's own search, else
/// in `$CUDNN_LIB_DIR`, the CUDA toolkit's `lib64`, or pip's `nvidia/cudnn/lib` (the
/// `nvidia-cudnn-cu13` wheel), where it and its sub-libraries are loaded by path.
fn load_cudnn() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<Vec<libloading::Library>, Error>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let operation = "loading cuDNN";
            // SAFETY: only tries to load the library.
            if unsafe { dnn::is_culib_present() } {
                return Ok(Vec::new());
            }
            let site = nvrtc::python_site_packages();
            let dirs: Vec<PathBuf> = std::env::var_os("CUDNN_LIB_DIR")
                .map(PathBuf::from)
                .into_iter()
                .chain(
                    ["CUDA_HOME", "CUDA_PATH"]
                        .iter()
                        .filter_map(std::env::var_os)
                        .map(|h| PathBuf::from(h).join("lib64")),
                )
                .chain([PathBuf::from("/usr/local/cuda/lib64")])
                .chain(site.iter().flat_map(|s| [s.join("nvidia/cudnn/lib"), s.join("nvidia/cu13/lib")]))
                .collect();
            let dir = dirs
                .iter()
                .find(|d| d.join(CUDNN_LIBRARY).is_file())
                .ok_or_else(|| {
                    Error::new(
                        operation,
                        format!(
                            "{CUDNN_LIBRARY} was not found: set CUDNN_LIB_DIR or LD_LIBRARY_PATH to \
                             its directory (`pip install nvidia-cudnn-cu13` puts it in \
                             site-packages/nvidia/cudnn/lib)"
                        ),
                    )
                })?;
            let libraries = preload_cudnn(dir).map_err(|reason| Error::new(operation, reason))?;
            // SAFETY: as above.
            if !unsafe { dnn::is_culib_present() } {
                return Err(Error::new(
                    operation,
                    format!("{CUDNN_LIBRARY} was loaded from {} but cannot be opened by name", dir.display()),
                ));
            }
            Ok(libraries)
        })
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

/// Loads cuDNN's sub-libraries (which it opens by name later) and then cuDNN from `dir`.
/// Sub-libraries that need another one first are retried after it.
fn preload_cudnn(dir: &Path) -> std::result::Result<Vec<libloading::Library>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut pending: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libcudnn_") && n.ends_with(".so.9"))
        })
        .collect();
    let mut loaded = Vec::new();
    let mut failures = Vec::new();
    while !pending.is_empty() {
        let before = pending.len();
        failures.clear();
        pending.retain(|path| {
            // SAFETY: NVIDIA's libraries, whose initializers have no preconditions.
            match unsafe { libloading::Library::new(path) } {
                Ok(lib) => {
                    loaded.push(lib);
                    false
                }
                Err(e) => {
                    failures.push(format!("{}: {e}", path.display()));
                    true
                }
            }
        });
        if pending.len() == before {
            break;
        }
    }
    // Kept for the error of a cuDNN call that needs one of them (cuDNN only says that a
    // sub-library failed to load).
    let _ = SUBLIBRARY_FAILURES.set(failures);
    let main = dir.join(CUDNN_LIBRARY);
    // SAFETY: as above.
    let lib = unsafe { libloading::Library::new(&main) }
        .map_err(|e| format!("{}: {e}", main.display()))?;
    loaded.push(lib);
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: dnn::cudnnStatus_t = dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
    const DET: dnn::cudnnDeterminism_t = dnn::cudnnDeterminism_t::CUDNN_DETERMINISTIC;
    const NONDET: dnn::cudnnDeterminism_t = dnn::cudnnDeterminism_t::CUDNN_NON_DETERMINISTIC;

    fn choose(
        candidates: &[(dnn::cudnnStatus_t, dnn::cudnnDeterminism_t, u32, usize)],
        room: usize,
    ) -> Result<(u32, bool)> {
        pick(
            "test",
            candidates.iter().copied(),
            |bytes| Ok(bytes <= room),
        )
    }

    #[test]
    fn deterministic_first_then_whatever_runs() -> Result<()> {
        // cuDNN may rank a non-deterministic algorithm first.
        assert_eq!(
            choose(&[(OK, NONDET, 1, 0), (OK, DET, 2, 0)], 0)?,
            (2, true)
        );
        // Only a non-deterministic one runs: taken, and reported as such.
        assert_eq!(choose(&[(OK, NONDET, 1, 0)], 0)?, (1, false));
        let refused = dnn::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED;
        assert_eq!(
            choose(&[(refused, DET, 1, 0), (OK, NONDET, 2, 0)], 0)?,
            (2, false)
        );
        assert!(choose(&[(refused, DET, 1, 0)], 0).is_err());
        Ok(())
    }

    #[test]
    fn a_workspace_that_does_not_fit_moves_on() -> Result<()> {
        let huge = 48 << 30;
        assert_eq!(
            choose(&[(OK, DET, 1, huge), (OK, DET, 2, 64)], 1 << 20)?,
            (2, true)
        );
        assert_eq!(
            choose(&[(OK, DET, 1, huge), (OK, NONDET, 2, 64)], 1 << 20)?,
            (2, false)
        );
        assert!(choose(&[(OK, DET, 1, huge)], 1 << 20).is_err());
        // An allocation failure other than "out of memory" is the call's error.
        let failing = pick("test", [(OK, DET, 1u32, 64)].into_iter(), |_| {
            Err(Error::new("cuMemAlloc", "broken"))
        });
        assert!(failing.is_err());
        Ok(())
    }
}
