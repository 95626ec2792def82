//! The stand-in through its C functions, as the backend calls them: memory, kernels compiled and
//! launched, the barrier, faults, half-precision conversions, cuDNN's results and refusals.

use std::ffi::{c_int, c_void, CString};

use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdFilterAlgoPerf_t,
    cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t as Fwd, cudnnDeterminism_t,
    cudnnStatus_t as S,
};
use cudarc::driver::sys::{CUcontext, CUdeviceptr, CUfunction, CUmodule, CUresult, CUstream};
use cudarc::nvrtc::sys::{nvrtcProgram, nvrtcResult};

use crate::cudnn::*;
use crate::driver::*;
use crate::exec;
use crate::nvrtc::*;

/// The primary context, current on this thread, released (and so destroyed, with its sticky
/// error) on drop. Holds the test lock.
struct Context {
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Context {
    fn new() -> Context {
        let serial = crate::test_lock();
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!(cuInit(0), CUresult::CUDA_SUCCESS);
            let mut ctx: CUcontext = std::ptr::null_mut();
            assert_eq!(
                cuDevicePrimaryCtxRetain(&mut ctx, 0),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(cuCtxSetCurrent(ctx), CUresult::CUDA_SUCCESS);
        }
        Context { _serial: serial }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: retained in `new`.
        unsafe { cuDevicePrimaryCtxRelease_v2(0) };
    }
}

const STREAM: CUstream = std::ptr::null_mut();

fn alloc(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuMemAllocAsync(&mut p, bytes, STREAM) },
        CUresult::CUDA_SUCCESS
    );
    p
}

fn upload<T: Copy>(values: &[T]) -> CUdeviceptr {
    let bytes = std::mem::size_of_val(values);
    let p = alloc(bytes);
    // SAFETY: `bytes` bytes of host memory into an allocation of that size.
    let r = unsafe { cuMemcpyHtoDAsync_v2(p, values.as_ptr().cast(), bytes, STREAM) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    p
}

fn download<T: Copy + Default>(p: CUdeviceptr, n: usize) -> Vec<T> {
    let mut out = vec![T::default(); n];
    // SAFETY: into a host buffer of the size copied.
    let r = unsafe {
        cuMemcpyDtoHAsync_v2(
            out.as_mut_ptr().cast(),
            p,
            std::mem::size_of_val(&out[..]),
            STREAM,
        )
    };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    out
}

fn free(p: CUdeviceptr) {
    // SAFETY: plain call.
    assert_eq!(unsafe { cuMemFreeAsync(p, STREAM) }, CUresult::CUDA_SUCCESS);
}

/// Compiles `source` with NVRTC's API: the CUBIN, or the status and the log.
fn compile(source: &str, options: &[&str]) -> Result<Vec<u8>, (nvrtcResult, String)> {
    let src = CString::new(source).unwrap();
    let name = CString::new("test.cu").unwrap();
    let options: Vec<CString> = options.iter().map(|o| CString::new(*o).unwrap()).collect();
    let pointers: Vec<_> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: valid strings and out-pointers; buffers of the sizes NVRTC reports.
    unsafe {
        let mut prog: nvrtcProgram = std::ptr::null_mut();
        assert_eq!(
            nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            nvrtcResult::NVRTC_SUCCESS
        );
        let status = nvrtcCompileProgram(prog, pointers.len() as c_int, pointers.as_ptr());
        let mut size = 0;
        assert_eq!(
            nvrtcGetProgramLogSize(prog, &mut size),
            nvrtcResult::NVRTC_SUCCESS
        );
        let mut log = vec![0u8; size];
        assert_eq!(
            nvrtcGetProgramLog(prog, log.as_mut_ptr().cast()),
            nvrtcResult::NVRTC_SUCCESS
        );
        let log = String::from_utf8_lossy(&log[..size - 1]).into_owned();
        let result = if status == nvrtcResult::NVRTC_SUCCESS {
            assert_eq!(
                nvrtcGetCUBINSize(prog, &mut size),
                nvrtcResult::NVRTC_SUCCESS
            );
            let mut cubin = vec![0u8; size];
            if size > 0 {
                assert_eq!(
                    nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()),
                    nvrtcResult::NVRTC_SUCCESS
                );
            }
            Ok(cubin)
        } else {
            Err((status, log))
        };
        assert_eq!(nvrtcDestroyProgram(&mut prog), nvrtcResult::NVRTC_SUCCESS);
        assert!(prog.is_null());
        result
    }
}

struct Loaded(CUmodule);

impl Loaded {
    fn new(cubin: &[u8]) -> Loaded {
        let mut m: CUmodule = std::ptr::null_mut();
        // SAFETY: a whole image from the stand-in NVRTC.
        assert_eq!(
            unsafe { cuModuleLoadData(&mut m, cubin.as_ptr().cast()) },
            CUresult::CUDA_SUCCESS
        );
        Loaded(m)
    }

    fn function(&self, name: &str) -> Result<CUfunction, CUresult> {
        let name = CString::new(name).unwrap();
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module, a valid name and out-pointer.
        match unsafe { cuModuleGetFunction(&mut f, self.0, name.as_ptr()) } {
            CUresult::CUDA_SUCCESS => Ok(f),
            e => Err(e),
        }
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: loaded in `new`.
        unsafe { cuModuleUnload(self.0) };
    }
}

/// Launches `f` on `grid` blocks of `block` threads with these argument pointers.
fn launch(f: CUfunction, grid: u32, block: u32, args: &mut [*mut c_void]) -> CUresult {
    // SAFETY: the arguments are the kernel's, each of its type.
    unsafe {
        cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            STREAM,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

const REDUCTION: &str = r#"
template <bool SYNC>
__device__ void reduce(const float* in, float* out) {
    __shared__ float partial[256];
    partial[threadIdx.x] = in[blockIdx.x * 256 + threadIdx.x];
    __syncthreads();
    for (int half = 128; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        if (SYNC) {
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = partial[0];
    }
}
extern "C" __global__ void __launch_bounds__(256) block_sum(const float* in, float* out) {
    reduce<true>(in, out);
}
extern "C" __global__ void __launch_bounds__(256) block_sum_racy(const float* in, float* out) {
    reduce<false>(in, out);
}
extern "C" __global__ void early_return(float* out) {
    if (threadIdx.x == 3) {
        return;
    }
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void read_past(const float* in, float* out, int n) {
    out[threadIdx.x] = in[n + threadIdx.x];
}
extern "C" __global__ void write_past(float* out, int n) {
    out[n] = 1.0f;
}
"#;

/// Sums of 4 blocks of 256 values (exact in float), through `kernel`, on `schedule`.
fn block_sums(m: &Loaded, kernel: &str, permuted: bool) -> (Vec<f32>, Vec<f32>) {
    let input: Vec<f32> = (0..1024).map(|i| ((i * 37) % 101) as f32).collect();
    let expected: Vec<f32> = input.chunks(256).map(|c| c.iter().sum()).collect();
    let (mut x, mut y) = (upload(&input), alloc(16));
    let f = m.function(kernel).unwrap();
    let r = exec::with_schedule(permuted, 7, || {
        launch(f, 4, 256, &mut [arg(&mut x), arg(&mut y)])
    });
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    let got = download::<f32>(y, 4);
    free(x);
    free(y);
    (got, expected)
}

#[test]
fn device_and_memory() {
    let _ctx = Context::new();
    let mut name = [0 as std::ffi::c_char; 64];
    let (mut count, mut value) = (0, 0);
    // SAFETY: valid out-pointers and sizes.
    unsafe {
        assert_eq!(cuDeviceGetCount(&mut count), CUresult::CUDA_SUCCESS);
        assert_eq!(count, 1);
        let mut dev = 0;
        assert_eq!(
            cuDeviceGet(&mut dev, 1),
            CUresult::CUDA_ERROR_INVALID_DEVICE
        );
        assert_eq!(
            cuDeviceGetName(name.as_mut_ptr(), 64, 0),
            CUresult::CUDA_SUCCESS
        );
        for (attribute, expected) in [
            (75, 9),
            (76, 0),
            (16, 132),
            (1, 1024),
            (10, 32),
            (8, 48 << 10),
            (97, 227 << 10),
            (5, i32::MAX),
            (6, 65535),
        ] {
            assert_eq!(
                cuDeviceGetAttribute(&mut value, attribute, 0),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(value, expected, "attribute {attribute}");
        }
        assert_eq!(
            cuDeviceGetAttribute(&mut value, 9999, 0),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
    }
    // SAFETY: NUL-terminated by cuDeviceGetName.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    assert!(name.to_str().unwrap().contains("stand-in"));

    let p = upload(&[1u8, 2, 3, 4, 5]);
    let host = [0u8; 8];
    // SAFETY: host buffers larger than each copy.
    unsafe {
        assert_eq!(
            cuMemcpyHtoDAsync_v2(p, host.as_ptr().cast(), 6, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cuMemcpyDtoHAsync_v2(host.as_ptr() as *mut c_void, p + 1, 5, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cuMemsetD8Async(p, 0, 6, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(cuMemsetD8Async(p + 1, 0, 4, STREAM), CUresult::CUDA_SUCCESS);
        let q = alloc(5);
        assert_eq!(
            cuMemcpyDtoDAsync_v2(q, p, 5, STREAM),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(download::<u8>(q, 5), [1, 0, 0, 0, 0]);
        free(q);
        assert_eq!(
            cuMemcpyDtoDAsync_v2(q, p, 5, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "freed"
        );
        assert_eq!(
            cuMemFreeAsync(q, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "double free"
        );
        assert_eq!(
            cuMemFreeAsync(p + 1, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "not an allocation's start"
        );
        let mut big = 0;
        assert_eq!(
            cuMemAllocAsync(&mut big, crate::memory::budget() + 1, STREAM),
            CUresult::CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(
            cuMemAllocAsync(&mut big, 0, STREAM),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
        let mut s: CUstream = std::ptr::null_mut();
        assert_eq!(cuStreamCreate(&mut s, 1), CUresult::CUDA_SUCCESS);
        assert_eq!(cuStreamSynchronize(s), CUresult::CUDA_SUCCESS);
        assert_eq!(cuStreamDestroy_v2(s), CUresult::CUDA_SUCCESS);
        assert_eq!(cuStreamSynchronize(s), CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    free(p);
}

#[test]
fn barrier_makes_the_block_reduction_right() {
    let _ctx = Context::new();
    let m = Loaded::new(&compile(REDUCTION, &["--gpu-architecture=sm_90", "--std=c++17"]).unwrap());
    for permuted in [false, true] {
        let (got, expected) = block_sums(&m, "block_sum", permuted);
        assert_eq!(got, expected, "permuted: {permuted}");
        let (racy, expected) = block_sums(&m, "block_sum_racy", permuted);
        assert_ne!(racy, expected, "without the barrier (permuted: {permuted})");
    }
    assert_eq!(m.function("missing"), Err(CUresult::CUDA_ERROR_NOT_FOUND));
    // More threads than the launch bounds, or than a block holds.
    let f = m.function("block_sum").unwrap();
    let (mut x, mut y) = (alloc(4096), alloc(16));
    assert_eq!(
        launch(f, 1, 512, &mut [arg(&mut x), arg(&mut y)]),
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    let g = m.function("read_past").unwrap();
    assert_eq!(
        launch(g, 1, 2048, &mut [arg(&mut x), arg(&mut y), arg(&mut 0)]),
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        launch(g, 0, 1, &mut [arg(&mut x), arg(&mut y), arg(&mut 0)]),
        CUresult::CUDA_ERROR_INVALID_VALUE
    );
    free(x);
    free(y);
}

#[test]
fn a_barrier_not_every_thread_reaches_fails_the_launch() {
    let ctx = Context::new();
    let m = Loaded::new(&compile(REDUCTION, &["--gpu-architecture=sm_90"]).unwrap());
    let mut y = alloc(64 * 4);
    let f = m.function("early_return").unwrap();
    assert_eq!(
        launch(f, 1, 64, &mut [arg(&mut y)]),
        CUresult::CUDA_ERROR_LAUNCH_FAILED
    );
    // Sticky, as on a GPU.
    // SAFETY: plain call.
    assert_eq!(
        unsafe { cuCtxSynchronize() },
        CUresult::CUDA_ERROR_LAUNCH_FAILED
    );
    drop(m);
    drop(ctx);
}

#[test]
fn reading_past_a_buffer_faults() {
    let ctx = Context::new();
    let m = Loaded::new(&compile(REDUCTION, &["--gpu-architecture=sm_90"]).unwrap());
    let (mut x, mut y) = (upload(&[1.0f32; 64]), alloc(64 * 4));
    let f = m.function("read_past").unwrap();
    assert_eq!(
        launch(f, 1, 32, &mut [arg(&mut x), arg(&mut y), arg(&mut 32)]),
        CUresult::CUDA_SUCCESS
    );
    assert_eq!(
        launch(f, 1, 32, &mut [arg(&mut x), arg(&mut y), arg(&mut 33)]),
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    );
    // SAFETY: plain call.
    assert_eq!(
        unsafe { cuCtxSynchronize() },
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    );
    drop(m);
    drop(ctx);

    let ctx = Context::new();
    let m = Loaded::new(&compile(REDUCTION, &["--gpu-architecture=sm_90"]).unwrap());
    // Three floats: the fourth lies in the canary before the guard page.
    let mut z = alloc(12);
    let f = m.function("write_past").unwrap();
    assert_eq!(
        launch(f, 1, 1, &mut [arg(&mut z), arg(&mut 2)]),
        CUresult::CUDA_SUCCESS
    );
    assert_eq!(
        launch(f, 1, 1, &mut [arg(&mut z), arg(&mut 3)]),
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    );
    drop(m);
    drop(ctx);

    let ctx = Context::new();
    let m = Loaded::new(&compile(REDUCTION, &["--gpu-architecture=sm_90"]).unwrap());
    let mut stale = alloc(64);
    free(stale);
    let f = m.function("write_past").unwrap();
    assert_eq!(
        launch(f, 1, 1, &mut [arg(&mut stale), arg(&mut 0)]),
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    );
    drop(m);
    drop(ctx);
}

#[test]
fn nvrtc_errors_and_images() {
    let _ctx = Context::new();
    let (status, log) = compile(
        "extern \"C\" __global__ void broken(int x { }\n",
        &["--gpu-architecture=sm_90"],
    )
    .unwrap_err();
    assert_eq!(status, nvrtcResult::NVRTC_ERROR_COMPILATION);
    assert!(log.contains("test.cu:1"), "{log}");
    let (status, _) = compile("", &["--no-such-option"]).unwrap_err();
    assert_eq!(status, nvrtcResult::NVRTC_ERROR_INVALID_OPTION);
    // A virtual architecture gives no CUBIN, as NVRTC.
    assert!(compile(REDUCTION, &["--gpu-architecture=compute_90"])
        .unwrap()
        .is_empty());
    // A CUBIN for another major architecture does not load.
    let sm80 = compile(REDUCTION, &["--gpu-architecture=sm_80"]).unwrap();
    let mut m: CUmodule = std::ptr::null_mut();
    // SAFETY: a whole image.
    assert_eq!(
        unsafe { cuModuleLoadData(&mut m, sm80.as_ptr().cast()) },
        CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
    );
    let mut not_elf = [0u8; 128];
    not_elf[..4].copy_from_slice(b"PTX ");
    // SAFETY: a readable buffer larger than an ELF header.
    assert_eq!(
        unsafe { cuModuleLoadData(&mut m, not_elf.as_ptr().cast()) },
        CUresult::CUDA_ERROR_INVALID_IMAGE
    );
    let mut major = 0;
    let mut minor = 0;
    // SAFETY: valid out-pointers.
    assert_eq!(
        unsafe { nvrtcVersion(&mut major, &mut minor) },
        nvrtcResult::NVRTC_SUCCESS
    );
    assert_eq!((major, minor), (13, 0));
}

const CONVERSIONS: &str = r#"
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void round_trip(const float* x, unsigned short* h, unsigned short* b, float* hf, float* bf, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const __half a = __float2half_rn(x[i]);
        const __nv_bfloat16 c = __float2bfloat16_rn(x[i]);
        h[i] = a.__x;
        b[i] = c.__x;
        hf[i] = __half2float(a);
        bf[i] = __bfloat162float(c);
    }
}
"#;

#[test]
fn half_conversions_round_to_nearest_even() {
    let _ctx = Context::new();
    let m = Loaded::new(&compile(CONVERSIONS, &["--gpu-architecture=sm_90"]).unwrap());
    let ulp_h = 2f32.powi(-10);
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        1.0 + ulp_h / 2.0,
        1.0 + 1.5 * ulp_h,
        1.0 + ulp_h / 2.0 + 1e-7,
        -(1.0 + 1.5 * ulp_h),
        65504.0,
        65519.99,
        65520.0,
        1e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        2f32.powi(-24),
        2f32.powi(-25),
        1.5 * 2f32.powi(-25),
        3.0 * 2f32.powi(-25),
        2f32.powi(-14) * 0.75,
        6.1e-5,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
    ];
    values.extend((0..2000).map(|i| ((i as f32) * 0.731).sin() * 10f32.powi(i % 9 - 4)));
    let n = values.len();
    let mut x = upload(&values);
    let (mut h, mut b, mut hf, mut bf) = (alloc(2 * n), alloc(2 * n), alloc(4 * n), alloc(4 * n));
    let f = m.function("round_trip").unwrap();
    let mut count = n as c_int;
    let r = launch(
        f,
        1,
        128,
        &mut [
            arg(&mut x),
            arg(&mut h),
            arg(&mut b),
            arg(&mut hf),
            arg(&mut bf),
            arg(&mut count),
        ],
    );
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    let (h, b) = (download::<u16>(h, n), download::<u16>(b, n));
    let (hf, bf) = (download::<f32>(hf, n), download::<f32>(bf, n));
    for (i, &v) in values.iter().enumerate() {
        let (eh, eb) = (half::f16::from_f32(v), half::bf16::from_f32(v));
        if v.is_nan() {
            assert_eq!((h[i], b[i]), (0x7fff, 0x7fff), "CUDA's canonical NaN");
            assert!(hf[i].is_nan() && bf[i].is_nan());
            continue;
        }
        assert_eq!(h[i], eh.to_bits(), "f16 of {v:e}");
        assert_eq!(b[i], eb.to_bits(), "bf16 of {v:e}");
        assert_eq!(
            hf[i].to_bits(),
            eh.to_f32().to_bits(),
            "f16 {v:e} back to f32"
        );
        assert_eq!(
            bf[i].to_bits(),
            eb.to_f32().to_bits(),
            "bf16 {v:e} back to f32"
        );
    }
}

/// cuDNN objects for one convolution, destroyed on drop.
struct Setup {
    h: cudarc::cudnn::sys::cudnnHandle_t,
    x: cudarc::cudnn::sys::cudnnTensorDescriptor_t,
    y: cudarc::cudnn::sys::cudnnTensorDescriptor_t,
    b: cudarc::cudnn::sys::cudnnTensorDescriptor_t,
    w: cudarc::cudnn::sys::cudnnFilterDescriptor_t,
    c: cudarc::cudnn::sys::cudnnConvolutionDescriptor_t,
    a: cudarc::cudnn::sys::cudnnActivationDescriptor_t,
}

/// `[n, c, h, w]`, `[k, r, s]`, pad, stride; the data type (0 float, 1 double) and format.
fn setup(
    x: [c_int; 4],
    w: [c_int; 3],
    pad: c_int,
    stride: c_int,
    dtype: u32,
    format: u32,
) -> Result<Setup, S> {
    let ok = |s: S| {
        if s == S::CUDNN_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(s)
        }
    };
    // SAFETY: valid out-pointers; descriptors just created.
    unsafe {
        let mut s = Setup {
            h: std::ptr::null_mut(),
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
        };
        ok(cudnnCreate(&mut s.h))?;
        ok(cudnnCreateTensorDescriptor(&mut s.x))?;
        ok(cudnnCreateTensorDescriptor(&mut s.y))?;
        ok(cudnnCreateTensorDescriptor(&mut s.b))?;
        ok(cudnnCreateFilterDescriptor(&mut s.w))?;
        ok(cudnnCreateConvolutionDescriptor(&mut s.c))?;
        ok(cudnnCreateActivationDescriptor(&mut s.a))?;
        let [n, c, h, wd] = x;
        let [k, r, q] = w;
        ok(cudnnSetTensor4dDescriptor(s.x, format, dtype, n, c, h, wd))?;
        ok(cudnnSetFilter4dDescriptor(s.w, dtype, format, k, c, r, q))?;
        ok(cudnnSetConvolution2dDescriptor(
            s.c, pad, pad, stride, stride, 1, 1, 1, dtype,
        ))?;
        ok(cudnnSetConvolutionMathType(s.c, 3))?;
        let out = |size: c_int, f: c_int| (size + 2 * pad - f) / stride + 1;
        ok(cudnnSetTensor4dDescriptor(
            s.y,
            format,
            dtype,
            n,
            k,
            out(h, r),
            out(wd, q),
        ))?;
        ok(cudnnSetTensor4dDescriptor(s.b, format, dtype, 1, k, 1, 1))?;
        ok(cudnnSetActivationDescriptor(s.a, 1, 0, 0.0))?;
        Ok(s)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        // SAFETY: created in `setup`.
        unsafe {
            cudnnDestroyTensorDescriptor(self.x);
            cudnnDestroyTensorDescriptor(self.y);
            cudnnDestroyTensorDescriptor(self.b);
            cudnnDestroyFilterDescriptor(self.w);
            cudnnDestroyConvolutionDescriptor(self.c);
            cudnnDestroyActivationDescriptor(self.a);
            cudnnDestroy(self.h);
        }
    }
}

fn forward_ranking(s: &Setup) -> Vec<cudnnConvolutionFwdAlgoPerf_t> {
    // SAFETY: an array of 8 entries (all there are).
    unsafe {
        let mut perf: [cudnnConvolutionFwdAlgoPerf_t; 8] = std::mem::zeroed();
        let mut n = 0;
        let r = cudnnGetConvolutionForwardAlgorithm_v7(
            s.h,
            s.x,
            s.w,
            s.c,
            s.y,
            8,
            &mut n,
            perf.as_mut_ptr(),
        );
        assert_eq!(r, S::CUDNN_STATUS_SUCCESS);
        perf[..n as usize].to_vec()
    }
}

/// A naive NHWC convolution (cross-correlation, OHWI weights) in f64.
#[allow(clippy::too_many_arguments)]
fn naive(
    x: &[f64],
    w: &[f64],
    [n, h, wd, c]: [usize; 4],
    [k, r, s]: [usize; 3],
    pad: usize,
    stride: usize,
) -> Vec<f64> {
    let (oh, ow) = (
        (h + 2 * pad - r) / stride + 1,
        (wd + 2 * pad - s) / stride + 1,
    );
    let mut y = vec![0.0; n * oh * ow * k];
    for ni in 0..n {
        for yi in 0..oh {
            for xi in 0..ow {
                for ki in 0..k {
                    let mut sum = 0.0;
                    for ri in 0..r {
                        for si in 0..s {
                            let (hi, wi) = (
                                (yi * stride + ri) as isize - pad as isize,
                                (xi * stride + si) as isize - pad as isize,
                            );
                            if hi < 0 || wi < 0 || hi >= h as isize || wi >= wd as isize {
                                continue;
                            }
                            for ci in 0..c {
                                sum += x[((ni * h + hi as usize) * wd + wi as usize) * c + ci]
                                    * w[((ki * r + ri) * s + si) * c + ci];
                            }
                        }
                    }
                    y[((ni * oh + yi) * ow + xi) * k + ki] = sum;
                }
            }
        }
    }
    y
}

#[test]
fn cudnn_convolutions_match_a_naive_loop() {
    let _ctx = Context::new();
    let (n, h, wd, c, k, r, pad, stride) = (
        2usize, 7usize, 6usize, 3usize, 4usize, 3usize, 1usize, 2usize,
    );
    let x: Vec<f64> = (0..n * h * wd * c)
        .map(|i| ((i * 7) % 13) as f64 / 8.0 - 0.5)
        .collect();
    let w: Vec<f64> = (0..k * r * r * c)
        .map(|i| ((i * 5) % 11) as f64 / 4.0 - 1.0)
        .collect();
    let expected = naive(&x, &w, [n, h, wd, c], [k, r, r], pad, stride);
    let s = setup(
        [n as c_int, c as c_int, h as c_int, wd as c_int],
        [k as c_int, r as c_int, r as c_int],
        pad as c_int,
        stride as c_int,
        1,
        1,
    )
    .unwrap();
    let (dx, dw) = (upload(&x), upload(&w));
    let dy = upload(&vec![1.0f64; expected.len()]);
    let (one, zero) = (1.0f64, 0.0f64);
    let precomp = Fwd::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM as u32;
    let mut ws = 0;
    // SAFETY: live descriptors and allocations of the descriptors' sizes.
    unsafe {
        assert_eq!(
            cudnnGetConvolutionForwardWorkspaceSize(s.h, s.x, s.w, s.c, s.y, precomp, &mut ws),
            S::CUDNN_STATUS_SUCCESS
        );
        let work = alloc(ws.max(1));
        let run = |beta: &f64| {
            cudnnConvolutionForward(
                s.h,
                arg(&mut one.clone()),
                s.x,
                dx as *const c_void,
                s.w,
                dw as *const c_void,
                s.c,
                precomp,
                work as *mut c_void,
                ws,
                (beta as *const f64).cast(),
                s.y,
                dy as *mut c_void,
            )
        };
        // beta = 0 does not read the destination (here 1.0 everywhere).
        assert_eq!(run(&zero), S::CUDNN_STATUS_SUCCESS);
        let got = download::<f64>(dy, expected.len());
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() < 1e-12, "{g} vs {e}");
        }
        // beta = 1 accumulates.
        assert_eq!(run(&one), S::CUDNN_STATUS_SUCCESS);
        let twice = download::<f64>(dy, expected.len());
        for (g, e) in twice.iter().zip(&expected) {
            assert!((g - 2.0 * e).abs() < 1e-12);
        }
        // A workspace smaller than the algorithm needs.
        if ws > 0 {
            let r = cudnnConvolutionForward(
                s.h,
                arg(&mut one.clone()),
                s.x,
                dx as *const c_void,
                s.w,
                dw as *const c_void,
                s.c,
                precomp,
                work as *mut c_void,
                ws - 1,
                arg(&mut zero.clone()),
                s.y,
                dy as *mut c_void,
            );
            assert_eq!(r, S::CUDNN_STATUS_BAD_PARAM);
        }
        free(work);
    }
    for p in [dx, dw, dy] {
        free(p);
    }
}

#[test]
fn cudnn_refuses_like_cudnn() {
    let _ctx = Context::new();
    // Batch 0, and a negative padding, at set-up.
    assert_eq!(
        setup([0, 3, 8, 8], [4, 3, 3], 1, 1, 0, 1).err(),
        Some(S::CUDNN_STATUS_BAD_PARAM)
    );
    assert_eq!(
        setup([1, 3, 8, 8], [4, 3, 3], -1, 1, 0, 1).err(),
        Some(S::CUDNN_STATUS_BAD_PARAM)
    );

    // 3x3 stride 1, 8 images: untiled FFT first, with a workspace nothing can hold; the fused
    // call refuses it (and everything but IMPLICIT_PRECOMP_GEMM) with a cuDNN 9 sub-code.
    let s = setup([8, 16, 16, 16], [16, 3, 3], 1, 1, 0, 1).unwrap();
    let ranked = forward_ranking(&s);
    assert_eq!(ranked[0].algo, Fwd::CUDNN_CONVOLUTION_FWD_ALGO_FFT);
    assert_eq!(ranked[0].status, S::CUDNN_STATUS_SUCCESS);
    assert!(ranked[0].memory > crate::memory::budget());
    assert!(
        ranked
            .iter()
            .any(|p| p.status == S::CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN),
        "DIRECT"
    );
    let x = alloc(8 * 16 * 16 * 16 * 4);
    let w = alloc(16 * 9 * 16 * 4);
    let y = alloc(8 * 16 * 16 * 16 * 4);
    let b = alloc(16 * 4);
    let (one, zero) = (1.0f32, 0.0f32);
    let fused = |algo: Fwd, y: CUdeviceptr| {
        // SAFETY: live descriptors; allocations of their sizes (unless a test says otherwise).
        unsafe {
            cudnnConvolutionBiasActivationForward(
                s.h,
                arg(&mut one.clone()),
                s.x,
                x as *const c_void,
                s.w,
                w as *const c_void,
                s.c,
                algo as u32,
                std::ptr::null_mut(),
                0,
                arg(&mut zero.clone()),
                s.y,
                y as *const c_void,
                s.b,
                b as *const c_void,
                s.a,
                s.y,
                y as *mut c_void,
            )
        }
    };
    assert_eq!(
        fused(Fwd::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD, y),
        S::CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN
    );
    assert_eq!(
        fused(Fwd::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, y),
        S::CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN
    );
    // IMPLICIT_PRECOMP_GEMM needs a workspace: none given.
    assert_eq!(
        fused(Fwd::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, y),
        S::CUDNN_STATUS_BAD_PARAM
    );

    // The other queries: non-deterministic algorithms first for some shapes.
    // SAFETY: arrays of all the entries there are.
    unsafe {
        let mut n = 0;
        let mut filter: [cudnnConvolutionBwdFilterAlgoPerf_t; 7] = std::mem::zeroed();
        let r = cudnnGetConvolutionBackwardFilterAlgorithm_v7(
            s.h,
            s.x,
            s.y,
            s.c,
            s.w,
            7,
            &mut n,
            filter.as_mut_ptr(),
        );
        assert_eq!(r, S::CUDNN_STATUS_SUCCESS);
        assert_eq!(
            filter[0].determinism,
            cudnnDeterminism_t::CUDNN_NON_DETERMINISTIC
        );
        let strided = setup([2, 16, 16, 16], [16, 3, 3], 1, 2, 0, 1).unwrap();
        let mut data: [cudnnConvolutionBwdDataAlgoPerf_t; 6] = std::mem::zeroed();
        let r = cudnnGetConvolutionBackwardDataAlgorithm_v7(
            strided.h,
            strided.w,
            strided.y,
            strided.c,
            strided.x,
            6,
            &mut n,
            data.as_mut_ptr(),
        );
        assert_eq!(r, S::CUDNN_STATUS_SUCCESS);
        assert_eq!(
            data[0].determinism,
            cudnnDeterminism_t::CUDNN_NON_DETERMINISTIC
        );
        // Descriptors that do not fit: the output of another convolution.
        let r = cudnnGetConvolutionForwardAlgorithm_v7(
            s.h,
            s.x,
            s.w,
            s.c,
            strided.y,
            8,
            &mut n,
            std::mem::zeroed::<[cudnnConvolutionFwdAlgoPerf_t; 8]>().as_mut_ptr(),
        );
        assert_eq!(r, S::CUDNN_STATUS_BAD_PARAM);
    }
    let one_by_one = setup([2, 16, 8, 8], [16, 1, 1], 0, 1, 0, 1).unwrap();
    assert_eq!(
        forward_ranking(&one_by_one)[0].algo,
        Fwd::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
    );

    // A destination that the descriptor says is longer than the allocation.
    let short = alloc(16);
    // SAFETY: live descriptors; `short` is deliberately too small.
    let r = unsafe {
        cudnnConvolutionForward(
            s.h,
            arg(&mut one.clone()),
            s.x,
            x as *const c_void,
            s.w,
            w as *const c_void,
            s.c,
            0,
            std::ptr::null_mut(),
            0,
            arg(&mut zero.clone()),
            s.y,
            short as *mut c_void,
        )
    };
    assert_eq!(r, S::CUDNN_STATUS_EXECUTION_FAILED);
    // The context's error is sticky now: every later call fails.
    // SAFETY: plain call.
    assert_eq!(
        unsafe { cuCtxSynchronize() },
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
    );
}

/// The backward calls are the forward convolution's adjoints, in both layouts:
/// `<dy, conv(x, w)> = <backward_data(w, dy), x> = <backward_filter(x, dy), w>`.
#[test]
fn cudnn_backward_calls_are_adjoints() {
    let _ctx = Context::new();
    let (n, c, h, wd, k, r, pad, stride) = (2, 3, 7, 6, 4, 3, 1, 2);
    for format in [0, 1] {
        let s = setup([n, c, h, wd], [k, r, r], pad, stride, 1, format).unwrap();
        let (oh, ow) = (
            (h + 2 * pad - r) / stride + 1,
            (wd + 2 * pad - r) / stride + 1,
        );
        let values = |len: c_int, seed: usize| -> Vec<f64> {
            (0..len as usize)
                .map(|i| ((i * 7 + seed) % 13) as f64 / 8.0 - 0.7)
                .collect()
        };
        let (xv, wv, dyv) = (
            values(n * c * h * wd, 1),
            values(k * c * r * r, 2),
            values(n * k * oh * ow, 3),
        );
        let (x, w, dy) = (upload(&xv), upload(&wv), upload(&dyv));
        let (y, dx, dw) = (
            alloc(dyv.len() * 8),
            alloc(xv.len() * 8),
            alloc(wv.len() * 8),
        );
        let (one, zero) = (1.0f64, 0.0f64);
        let (alpha, beta) = ((&one as *const f64).cast(), (&zero as *const f64).cast());
        let null = std::ptr::null_mut();
        // SAFETY: live descriptors; allocations of their sizes; algorithms without a workspace.
        unsafe {
            let r = cudnnConvolutionForward(
                s.h,
                alpha,
                s.x,
                x as *const c_void,
                s.w,
                w as *const c_void,
                s.c,
                0,
                null,
                0,
                beta,
                s.y,
                y as *mut c_void,
            );
            assert_eq!(r, S::CUDNN_STATUS_SUCCESS);
            let r = cudnnConvolutionBackwardData(
                s.h,
                alpha,
                s.w,
                w as *const c_void,
                s.y,
                dy as *const c_void,
                s.c,
                1,
                null,
                0,
                beta,
                s.x,
                dx as *mut c_void,
            );
            assert_eq!(r, S::CUDNN_STATUS_SUCCESS);
            let r = cudnnConvolutionBackwardFilter(
                s.h,
                alpha,
                s.x,
                x as *const c_void,
                s.y,
                dy as *const c_void,
                s.c,
                1,
                null,
                0,
                beta,
                s.w,
                dw as *mut c_void,
            );
            assert_eq!(r, S::CUDNN_STATUS_SUCCESS);
        }
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>();
        let forward = dot(&dyv, &download::<f64>(y, dyv.len()));
        let data = dot(&xv, &download::<f64>(dx, xv.len()));
        let filter = dot(&wv, &download::<f64>(dw, wv.len()));
        assert!(
            (forward - data).abs() < 1e-9 && (forward - filter).abs() < 1e-9,
            "format {format}: {forward} {data} {filter}"
        );
        for p in [x, w, dy, y, dx, dw] {
            free(p);
        }
    }
}
