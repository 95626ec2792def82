//! The driver API: one device, `CUDA stand-in (NVIDIA H200 attributes)`, compute capability
//! 9.0, with the attributes of an H200 and memory pools (cudarc allocates with
//! `cuMemAllocAsync`), its primary context, streams, memory and modules.
//!
//! Streams are in order and execute synchronously: every operation is complete when its call
//! returns, which is one of the orders the real driver may choose. Errors are the real
//! driver's: a copy or memset whose range leaves a live allocation is
//! `CUDA_ERROR_INVALID_VALUE`; a kernel that faults, or is given a pointer outside device
//! memory, or writes past the end of a buffer, is `CUDA_ERROR_ILLEGAL_ADDRESS` (the GPU would
//! fault when the kernel touched it: the stand-in refuses before running, or stops at the
//! fault); a block whose threads do not all reach a barrier is `CUDA_ERROR_LAUNCH_FAILED`. Those
//! launch errors are sticky as on a GPU: every later call in the context returns them until the
//! primary context is released by all who retained it (destroyed) and retained anew.

#![allow(non_snake_case)]
// Each export's contract is the driver API's: the caller passes valid pointers as its
// documentation says.
#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uchar, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute as A, CUdeviceptr, CUfunction, CUmodule, CUresult,
    CUstream,
};

use crate::exec::{self, LaunchError, LoadError, Module};
use crate::memory;

/// The device's name.
pub const NAME: &str = "CUDA stand-in (NVIDIA H200 attributes)";
/// Compute capability.
pub const MAJOR: u32 = 9;
pub const MINOR: u32 = 0;
const MAX_GRID: [u32; 3] = [i32::MAX as u32, 65535, 65535];
const MAX_BLOCK: [u32; 3] = [1024, 1024, 64];
/// Shared memory a block may have without opting in (cuFuncSetAttribute, not offered).
const MAX_SHARED: u32 = 48 << 10;

/// Handle tags (low bits): handles are opaque numbers, checked on every use.
const CONTEXT: usize = 0x1;
const STREAM: usize = 0x2;
const MODULE: usize = 0x3;
const FUNCTION: usize = 0x4;

/// An H200's value of every attribute CUDA 13.0 defines.
const ATTRIBUTES: &[(A, c_int)] = &[
    (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64),
    (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, i32::MAX),
    (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535),
    (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535),
    (A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, 48 << 10),
    (A::CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY, 64 << 10),
    (A::CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32),
    (A::CU_DEVICE_ATTRIBUTE_MAX_PITCH, i32::MAX),
    (A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, 65536),
    (A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 1_980_000),
    (A::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 512),
    (A::CU_DEVICE_ATTRIBUTE_GPU_OVERLAP, 1),
    (A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 132),
    (A::CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT, 0),
    (A::CU_DEVICE_ATTRIBUTE_INTEGRATED, 0),
    (A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1),
    (A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, 0),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_WIDTH, 131072),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_WIDTH, 131072),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_HEIGHT, 65536),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH, 16384),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT, 16384),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH, 16384),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_HEIGHT,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_LAYERS,
        2048,
    ),
    (A::CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT, 512),
    (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, 1),
    (A::CU_DEVICE_ATTRIBUTE_ECC_ENABLED, 1),
    (A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_TCC_DRIVER, 0),
    (A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, 3_201_000),
    (A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, 6144),
    (A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 50 << 20),
    (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048),
    (A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 3),
    (A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LAYERED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LAYERED_LAYERS,
        2048,
    ),
    (A::CU_DEVICE_ATTRIBUTE_CAN_TEX2D_GATHER, 1),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_GATHER_WIDTH, 32768),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_GATHER_HEIGHT,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH_ALTERNATE,
        8192,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT_ALTERNATE,
        8192,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE,
        32768,
    ),
    (A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, 32),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURECUBEMAP_WIDTH, 32768),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURECUBEMAP_LAYERED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS,
        2046,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE1D_WIDTH, 32768),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_WIDTH, 131072),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_HEIGHT, 65536),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE3D_WIDTH, 16384),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE3D_HEIGHT, 16384),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE3D_DEPTH, 16384),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE1D_LAYERED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE1D_LAYERED_LAYERS,
        2048,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_LAYERED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_LAYERED_HEIGHT,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACE2D_LAYERED_LAYERS,
        2048,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACECUBEMAP_WIDTH, 32768),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACECUBEMAP_LAYERED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS,
        2046,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LINEAR_WIDTH,
        268_435_456,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_WIDTH,
        131072,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_HEIGHT,
        65000,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_PITCH,
        2_097_120,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT,
        32768,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        MAJOR as c_int,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        MINOR as c_int,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH,
        32768,
    ),
    (A::CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        228 << 10,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
        65536,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1),
    (A::CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD, 0),
    (A::CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO,
        2,
    ),
    (A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, 0),
    (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, 1),
    (A::CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
        1,
    ),
    (A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, 1),
    (A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1, 1),
    (A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1, 1),
    (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, 1),
    (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        227 << 10,
    ),
    (A::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, 0),
    (A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
        0,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST,
        0,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        1,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        1,
    ),
    (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_HANDLE_SUPPORTED, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED,
        0,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, 32),
    (A::CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
        32_505_856,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE,
        134_213_632,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        1,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
        1024,
    ),
    (A::CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_TIMELINE_SEMAPHORE_INTEROP_SUPPORTED,
        1,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
        1,
    ),
    (A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, 100),
    (A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, 1),
    (A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED,
        1,
    ),
    (A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, 1),
    (A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 1),
    (A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_MEM_SYNC_DOMAIN_COUNT, 4),
    (A::CU_DEVICE_ATTRIBUTE_TENSOR_MAP_ACCESS_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_UNIFIED_FUNCTION_POINTERS, 1),
    (A::CU_DEVICE_ATTRIBUTE_NUMA_CONFIG, 0),
    (A::CU_DEVICE_ATTRIBUTE_NUMA_ID, -1),
    (A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED, 0),
    (A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_D3D12_CIG_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_ALGORITHM_MASK, 0),
    (A::CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_MAXIMUM_LENGTH, 0),
    (A::CU_DEVICE_ATTRIBUTE_VULKAN_CIG_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID, 0x2335_10de),
    (A::CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        0,
    ),
    (A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_MULTINODE_IPC_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        0,
    ),
    (A::CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_ONLY_PARTIAL_HOST_NATIVE_ATOMIC_SUPPORTED,
        0,
    ),
];

struct Driver {
    initialized: bool,
    /// The primary context: how many hold it, which incarnation it is (its handle changes when
    /// it is destroyed and made anew), and its sticky error.
    refs: u32,
    generation: usize,
    sticky: Option<CUresult>,
    /// Handle -> the context generation it belongs to (and what it is).
    streams: BTreeMap<usize, usize>,
    modules: BTreeMap<usize, (usize, Arc<Module>)>,
    functions: BTreeMap<usize, (usize, Arc<Module>, usize)>,
    next: usize,
}

static DRIVER: Mutex<Driver> = Mutex::new(Driver {
    initialized: false,
    refs: 0,
    generation: 1,
    sticky: None,
    streams: BTreeMap::new(),
    modules: BTreeMap::new(),
    functions: BTreeMap::new(),
    next: 1,
});

thread_local! {
    /// This thread's current context (its handle; 0 for none).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn driver() -> MutexGuard<'static, Driver> {
    DRIVER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

type R<T> = Result<T, CUresult>;

fn status(r: R<()>) -> CUresult {
    r.err().unwrap_or(CUresult::CUDA_SUCCESS)
}

impl Driver {
    fn context_handle(&self) -> usize {
        self.generation << 4 | CONTEXT
    }

    fn handle(&mut self, tag: usize) -> usize {
        self.next += 1;
        self.next << 4 | tag
    }

    fn initialized(&self) -> R<()> {
        if self.initialized {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_NOT_INITIALIZED)
        }
    }

    /// The current context's generation, if it is the live primary context.
    fn current(&self) -> R<usize> {
        self.initialized()?;
        let current = CURRENT.with(Cell::get);
        if current == 0 || self.refs == 0 || current != self.context_handle() {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        Ok(self.generation)
    }

    /// As `current`, and an error once a launch failed in the context.
    fn usable(&self) -> R<usize> {
        let generation = self.current()?;
        match self.sticky {
            Some(error) => Err(error),
            None => Ok(generation),
        }
    }

    fn stream(&self, stream: CUstream, generation: usize) -> R<()> {
        let s = stream as usize;
        // The legacy default stream (0 or CU_STREAM_LEGACY) and the per-thread one.
        if s <= 2 || self.streams.get(&s) == Some(&generation) {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_HANDLE)
        }
    }

    /// A context and a stream to run an operation on.
    fn ready(&self, stream: CUstream) -> R<usize> {
        let generation = self.usable()?;
        self.stream(stream, generation)?;
        Ok(generation)
    }

    /// Destroys the primary context: its memory, modules and streams go with it.
    fn destroy(&mut self) {
        let generation = self.generation;
        memory::free_context(generation as u64);
        self.streams.retain(|_, g| *g != generation);
        self.modules.retain(|_, (g, _)| *g != generation);
        self.functions.retain(|_, (g, _, _)| *g != generation);
        self.sticky = None;
        self.generation += 1;
    }
}

/// The sticky error of the primary context, if it is live and has one (for cuDNN).
pub fn sticky_error() -> Option<CUresult> {
    driver().sticky
}

/// Makes `error` the primary context's sticky error (a fault seen by cuDNN).
pub fn set_sticky(error: CUresult) {
    driver().sticky.get_or_insert(error);
}

/// Whether `stream` is a stream of the live primary context (for cuDNN).
pub fn valid_stream(stream: CUstream) -> bool {
    let d = driver();
    d.refs > 0 && d.stream(stream, d.generation).is_ok()
}

#[no_mangle]
pub unsafe extern "C" fn cuInit(Flags: c_uint) -> CUresult {
    if Flags != 0 {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    driver().initialized = true;
    CUresult::CUDA_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    status((|| {
        driver().initialized()?;
        if count.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        *count = 1;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    status((|| {
        driver().initialized()?;
        if device.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if ordinal != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        *device = 0;
        Ok(())
    })())
}

fn device(dev: CUdevice) -> R<()> {
    driver().initialized()?;
    if dev == 0 {
        Ok(())
    } else {
        Err(CUresult::CUDA_ERROR_INVALID_DEVICE)
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    status((|| {
        device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Truncated to the buffer, always NUL-terminated.
        let n = NAME.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(NAME.as_ptr(), name.cast::<u8>(), n);
        *name.add(n) = 0;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_uint,
    dev: CUdevice,
) -> CUresult {
    status((|| {
        device(dev)?;
        if pi.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (_, value) = ATTRIBUTES
            .iter()
            .find(|(a, _)| *a as c_uint == attrib)
            .ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        *pi = *value;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    status((|| {
        device(dev)?;
        if pctx.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let mut d = driver();
        d.refs += 1;
        *pctx = d.context_handle() as CUcontext;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    status((|| {
        device(dev)?;
        let mut d = driver();
        if d.refs == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        d.refs -= 1;
        if d.refs == 0 {
            d.destroy();
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    status((|| {
        driver().initialized()?;
        if pctx.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        *pctx = CURRENT.with(Cell::get) as CUcontext;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    status((|| {
        let d = driver();
        d.initialized()?;
        let handle = ctx as usize;
        if handle != 0 && (d.refs == 0 || handle != d.context_handle()) {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(handle));
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    status(driver().usable().map(drop))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) -> CUresult {
    status((|| {
        let mut d = driver();
        let generation = d.usable()?;
        // CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING.
        if phStream.is_null() || Flags > 1 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let handle = d.handle(STREAM);
        d.streams.insert(handle, generation);
        *phStream = handle as CUstream;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(hStream: CUstream) -> CUresult {
    status((|| {
        let mut d = driver();
        d.current()?;
        d.streams
            .remove(&(hStream as usize))
            .map(drop)
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    status(driver().ready(hStream).map(drop))
}

fn memory_error(e: memory::Error) -> CUresult {
    match e {
        memory::Error::OutOfMemory => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        memory::Error::Invalid => CUresult::CUDA_ERROR_INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    hStream: CUstream,
) -> CUresult {
    status((|| {
        let generation = driver().ready(hStream)?;
        if dptr.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        *dptr = memory::alloc(bytesize, generation as u64).map_err(memory_error)?;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    status((|| {
        driver().ready(hStream)?;
        memory::free(dptr).map_err(memory_error)
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dstDevice: CUdeviceptr,
    uc: c_uchar,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    status((|| {
        driver().ready(hStream)?;
        memory::check(dstDevice, N).map_err(memory_error)?;
        std::ptr::write_bytes(dstDevice as *mut u8, uc, N);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    status((|| {
        driver().ready(hStream)?;
        memory::check(dstDevice, ByteCount).map_err(memory_error)?;
        if srcHost.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        std::ptr::copy(srcHost.cast::<u8>(), dstDevice as *mut u8, ByteCount);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    status((|| {
        driver().ready(hStream)?;
        memory::check(srcDevice, ByteCount).map_err(memory_error)?;
        if dstHost.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        std::ptr::copy(srcDevice as *const u8, dstHost.cast::<u8>(), ByteCount);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    status((|| {
        driver().ready(hStream)?;
        memory::check(dstDevice, ByteCount).map_err(memory_error)?;
        memory::check(srcDevice, ByteCount).map_err(memory_error)?;
        std::ptr::copy(srcDevice as *const u8, dstDevice as *mut u8, ByteCount);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    status((|| {
        let generation = driver().usable()?;
        if module.is_null() || image.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // Compiled and opened without the lock: it takes a while.
        let loaded = Module::load(image.cast::<u8>(), MAJOR, MINOR).map_err(|e| match e {
            LoadError::InvalidImage(why) => {
                eprintln!("cuda-stand-in: cuModuleLoadData: {why}");
                CUresult::CUDA_ERROR_INVALID_IMAGE
            }
            LoadError::WrongArchitecture(_) => CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU,
        })?;
        let mut d = driver();
        if d.current()? != generation {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        let handle = d.handle(MODULE);
        d.modules.insert(handle, (generation, Arc::new(loaded)));
        *module = handle as CUmodule;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    hfunc: *mut CUfunction,
    hmod: CUmodule,
    name: *const c_char,
) -> CUresult {
    status((|| {
        let mut d = driver();
        let generation = d.current()?;
        if hfunc.is_null() || name.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (g, module) = d
            .modules
            .get(&(hmod as usize))
            .cloned()
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        if g != generation {
            return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
        }
        let index = module
            .function(CStr::from_ptr(name))
            .ok_or(CUresult::CUDA_ERROR_NOT_FOUND)?;
        let handle = d.handle(FUNCTION);
        d.functions.insert(handle, (generation, module, index));
        *hfunc = handle as CUfunction;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(hmod: CUmodule) -> CUresult {
    status((|| {
        let mut d = driver();
        d.current()?;
        let (_, module) = d
            .modules
            .remove(&(hmod as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        // Its functions become invalid handles; a launch still running keeps the code loaded.
        d.functions.retain(|_, (_, m, _)| !Arc::ptr_eq(m, &module));
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gridDimX: c_uint,
    gridDimY: c_uint,
    gridDimZ: c_uint,
    blockDimX: c_uint,
    blockDimY: c_uint,
    blockDimZ: c_uint,
    sharedMemBytes: c_uint,
    hStream: CUstream,
    kernelParams: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let grid = [gridDimX, gridDimY, gridDimZ];
    let block = [blockDimX, blockDimY, blockDimZ];
    status((|| {
        let (module, index) = {
            let d = driver();
            let generation = d.current()?;
            let (g, module, index) = d
                .functions
                .get(&(f as usize))
                .cloned()
                .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
            if g != generation {
                return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
            }
            d.ready(hStream)?;
            (module, index)
        };
        if !extra.is_null() {
            // Arguments packed into one buffer (CU_LAUNCH_PARAM_BUFFER_POINTER): the stand-in
            // reads only kernelParams.
            return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
        }
        let threads = u64::from(blockDimX) * u64::from(blockDimY) * u64::from(blockDimZ);
        let bounds = module.max_threads(index);
        let geometry_ok = grid
            .iter()
            .zip(MAX_GRID)
            .all(|(&g, max)| g >= 1 && g <= max)
            && block
                .iter()
                .zip(MAX_BLOCK)
                .all(|(&b, max)| b >= 1 && b <= max)
            && threads <= u64::from(exec::MAX_THREADS)
            && (bounds == 0 || threads <= u64::from(bounds))
            && sharedMemBytes <= MAX_SHARED;
        if !geometry_ok {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let Err(failure) = module.launch(index, grid, block, kernelParams) else {
            return Ok(());
        };
        let name = module.name(index);
        let error = match failure {
            LaunchError::NoParameters => return Err(CUresult::CUDA_ERROR_INVALID_VALUE),
            LaunchError::OutOfResources => {
                return Err(CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
            }
            LaunchError::BadPointer(i) => {
                eprintln!(
                    "cuda-stand-in: kernel `{name}`: parameter {i} points outside device memory \
                     (freed, never allocated, or host memory)"
                );
                CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            }
            LaunchError::DivergentBarrier => {
                eprintln!(
                    "cuda-stand-in: kernel `{name}`: some threads of a block returned while \
                     others wait at __syncthreads()"
                );
                CUresult::CUDA_ERROR_LAUNCH_FAILED
            }
            LaunchError::Fault(at) => {
                eprintln!("{}", exec::describe_fault(&name, at));
                CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            }
            LaunchError::Overrun(at) => {
                eprintln!(
                    "cuda-stand-in: kernel `{name}` wrote just outside the allocation holding \
                     {at:#x}"
                );
                CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            }
        };
        // Sticky, as a fault or a failed kernel is on a GPU.
        set_sticky(error);
        Err(error)
    })())
}
