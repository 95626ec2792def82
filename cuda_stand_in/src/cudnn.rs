//! cuDNN 9's legacy convolution API: handles, 4-d tensor, filter, convolution and activation
//! descriptors, the `_v7` algorithm queries, workspace sizes, and the forward, backward-data,
//! backward-filter, add-tensor and fused convolution + bias + activation calls.
//!
//! # Validation, as cuDNN
//!
//! Non-positive sizes (a batch of 0 included), negative padding, non-positive strides or
//! dilations are `CUDNN_STATUS_BAD_PARAM` when a descriptor is set. Descriptors that do not
//! fit together (data types, channel counts, batch, an output size that is not the
//! convolution's) are `BAD_PARAM` in every call that takes them; so is a workspace smaller than
//! the algorithm needs, and a null data pointer (`BAD_PARAM_NULL_POINTER`).
//!
//! Every data pointer is checked against the stand-in driver's live allocations for the whole
//! extent its descriptor implies. Out of range is `CUDNN_STATUS_EXECUTION_FAILED`, and the
//! context's error becomes `CUDA_ERROR_ILLEGAL_ADDRESS`: cuDNN itself does not check pointers
//! (it cannot), so on a GPU its kernel would fault, which cuDNN reports as an execution
//! failure and the driver makes sticky. A context that already has a sticky error fails every
//! call with `CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER`.
//!
//! # Approximations of the real library
//!
//! - Computation: plain loops in the convolution's compute type (float or double; the data
//!   types must be that type: half and bfloat16 tensors are `NOT_SUPPORTED_DATA_TYPE` here).
//!   With `CUDNN_DEFAULT_MATH` or the tensor-op math types a float convolution rounds its
//!   operands to TF32 first, as cuDNN may on sm_80 and later; `CUDNN_FMA_MATH` keeps them.
//!   Tensor, filter and output must share one layout (NCHW or NHWC, the filter KCRS or KRSC)
//!   or the call is `NOT_SUPPORTED_LAYOUT`.
//! - The algorithms that cuDNN ranks `NON_DETERMINISTIC` (backward data `ALGO_0`, backward
//!   filter `ALGO_0` and `ALGO_3`) sum in an order that changes from call to call, as their
//!   atomics do: the results differ in the last bits between runs.
//! - Supported algorithms: FFT and FFT tiling need stride and dilation 1, Winograd 3x3 (fused)
//!   or 3x3/5x5 (non-fused) at stride 1, all of them float; `FWD_ALGO_DIRECT` and
//!   `BWD_FILTER_ALGO_WINOGRAD` have no implementation. An unsupported algorithm's status is
//!   the cuDNN 9 sub-code saying why (`NOT_SUPPORTED_SHAPE`, `_DATA_TYPE`, `_GRAPH_PATTERN`).
//! - Workspaces: none for the implicit GEMMs, Winograd and backward `ALGO_0`/`ALGO_1`; the
//!   column matrix of one image for `GEMM`; tiles for FFT tiling and non-fused Winograd; and
//!   [`FFT_WORKSPACE`] (48 GiB) for untiled FFT, which no budget of the stand-in can hold.
//! - Rankings (the `_v7` heuristics) are deterministic functions of the shape, chosen so that
//!   a backend that takes the first entry without looking is caught: for 3x3 stride-1 float
//!   convolutions of 8 or more images, untiled FFT comes first (its workspace cannot be
//!   allocated), then non-fused Winograd; backward filter puts non-deterministic `ALGO_3`
//!   first from 8 images on; backward data puts non-deterministic `ALGO_0` first for strided
//!   convolutions; 1x1 convolutions rank `IMPLICIT_GEMM` first; otherwise
//!   `IMPLICIT_PRECOMP_GEMM` and `ALGO_1` lead. Unsupported algorithms come last.
//! - `cudnnConvolutionBiasActivationForward` runs with `IMPLICIT_PRECOMP_GEMM` only — the one
//!   algorithm cuDNN documents for every activation of this call — and refuses any other with
//!   `CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN`, the way cuDNN 9's fusion engines refuse a
//!   pattern they have no kernel for; activations other than ReLU and identity likewise. It
//!   always reads `z` (scaled by `alpha2`), as its formula says; `beta = 0` of the other calls
//!   does not read the destination, as cuDNN documents.

#![allow(non_snake_case)]
// Each export's contract is cuDNN's: the caller passes valid pointers as its documentation says.
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::too_many_arguments)]

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use cudarc::cudnn::sys::{
    cudaStream_t, cudnnActivationDescriptor_t, cudnnConvolutionBwdDataAlgoPerf_t,
    cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdFilterAlgoPerf_t,
    cudnnConvolutionBwdFilterAlgo_t, cudnnConvolutionDescriptor_t, cudnnConvolutionFwdAlgoPerf_t,
    cudnnConvolutionFwdAlgo_t, cudnnDeterminism_t, cudnnFilterDescriptor_t, cudnnHandle_t,
    cudnnMathType_t, cudnnStatus_t, cudnnTensorDescriptor_t,
};
use cudarc::driver::sys::{CUresult, CUstream};

use crate::{driver, memory};

type S = cudnnStatus_t;
type R<T> = Result<T, S>;

/// Untiled FFT's workspace: beyond any budget (see the module docs).
pub const FFT_WORKSPACE: usize = 48 << 30;

/// Data types the stand-in knows the size of (cuDNN's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DType {
    Float,
    Double,
    Half,
    Bf16,
    /// A valid cuDNN type the stand-in does not compute with.
    Other(u32),
}

impl DType {
    fn from_raw(raw: u32) -> R<DType> {
        Ok(match raw {
            0 => DType::Float,
            1 => DType::Double,
            2 => DType::Half,
            9 => DType::Bf16,
            3..=16 => DType::Other(raw),
            _ => return Err(S::CUDNN_STATUS_BAD_PARAM),
        })
    }

    fn size(self) -> usize {
        match self {
            DType::Double => 8,
            DType::Half | DType::Bf16 => 2,
            _ => 4,
        }
    }
}

const NCHW: u32 = 0;
const NHWC: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tensor {
    dtype: DType,
    format: u32,
    /// n, c, h, w.
    dims: [usize; 4],
    /// Element strides of n, c, h, w.
    strides: [usize; 4],
}

impl Tensor {
    fn offset(&self, n: usize, c: usize, h: usize, w: usize) -> usize {
        n * self.strides[0] + c * self.strides[1] + h * self.strides[2] + w * self.strides[3]
    }

    /// Bytes from the first element to one past the last.
    fn bytes(&self) -> usize {
        let elements = 1 + self
            .dims
            .iter()
            .zip(self.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum::<usize>();
        elements * self.dtype.size()
    }
}

#[derive(Clone, Copy, Debug)]
struct Filter {
    dtype: DType,
    format: u32,
    /// k, c, r, s.
    dims: [usize; 4],
}

impl Filter {
    fn offset(&self, k: usize, c: usize, r: usize, s: usize) -> usize {
        let [_, cs, rs, ss] = self.dims;
        if self.format == NHWC {
            ((k * rs + r) * ss + s) * cs + c
        } else {
            ((k * cs + c) * rs + r) * ss + s
        }
    }

    fn bytes(&self) -> usize {
        self.dims.iter().product::<usize>() * self.dtype.size()
    }
}

#[derive(Clone, Copy, Debug)]
struct Conv {
    pad: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    /// 0: convolution (the filter flipped), 1: cross-correlation.
    mode: u32,
    compute: DType,
    math: u32,
}

#[derive(Clone, Copy, Debug)]
struct Activation {
    mode: u32,
    propagate_nan: bool,
}

const RELU: u32 = 1;
const IDENTITY: u32 = 5;

#[derive(Clone, Copy, Debug)]
enum Object {
    Handle { stream: usize },
    Tensor(Option<Tensor>),
    Filter(Option<Filter>),
    Conv(Option<Conv>),
    Activation(Option<Activation>),
}

static OBJECTS: Mutex<BTreeMap<usize, Object>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicUsize = AtomicUsize::new(1);
/// Varies the summation order of the non-deterministic algorithms from call to call.
static CALLS: AtomicU64 = AtomicU64::new(0);

fn objects() -> MutexGuard<'static, BTreeMap<usize, Object>> {
    OBJECTS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn create(out: *mut *mut c_void, object: Object) -> S {
    if out.is_null() {
        return S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
    }
    let handle = NEXT.fetch_add(1, Ordering::Relaxed) << 4 | 0x9;
    objects().insert(handle, object);
    // SAFETY: checked non-null; the caller's out-pointer.
    unsafe { *out = handle as *mut c_void };
    S::CUDNN_STATUS_SUCCESS
}

fn destroy(handle: *mut c_void, same_kind: fn(&Object) -> bool) -> S {
    let mut map = objects();
    match map.get(&(handle as usize)) {
        Some(o) if same_kind(o) => {
            map.remove(&(handle as usize));
            S::CUDNN_STATUS_SUCCESS
        }
        _ => S::CUDNN_STATUS_BAD_PARAM,
    }
}

fn get(handle: *mut c_void) -> R<Object> {
    objects()
        .get(&(handle as usize))
        .copied()
        .ok_or(S::CUDNN_STATUS_BAD_PARAM)
}

fn set(handle: *mut c_void, object: Object) {
    objects().insert(handle as usize, object);
}

fn status(r: R<()>) -> S {
    r.err().unwrap_or(S::CUDNN_STATUS_SUCCESS)
}

fn handle(h: cudnnHandle_t) -> R<usize> {
    match get(h.cast())? {
        Object::Handle { stream } => Ok(stream),
        _ => Err(S::CUDNN_STATUS_BAD_PARAM),
    }
}

fn tensor(d: cudnnTensorDescriptor_t) -> R<Tensor> {
    match get(d.cast())? {
        Object::Tensor(Some(t)) => Ok(t),
        _ => Err(S::CUDNN_STATUS_BAD_PARAM),
    }
}

fn filter(d: cudnnFilterDescriptor_t) -> R<Filter> {
    match get(d.cast())? {
        Object::Filter(Some(f)) => Ok(f),
        _ => Err(S::CUDNN_STATUS_BAD_PARAM),
    }
}

fn conv(d: cudnnConvolutionDescriptor_t) -> R<Conv> {
    match get(d.cast())? {
        Object::Conv(Some(c)) => Ok(c),
        _ => Err(S::CUDNN_STATUS_BAD_PARAM),
    }
}

fn activation(d: cudnnActivationDescriptor_t) -> R<Activation> {
    match get(d.cast())? {
        Object::Activation(Some(a)) => Ok(a),
        _ => Err(S::CUDNN_STATUS_BAD_PARAM),
    }
}

/// Positive sizes as `usize`; anything else is `BAD_PARAM`.
fn sizes<const N: usize>(v: [c_int; N]) -> R<[usize; N]> {
    let mut out = [0usize; N];
    for (o, &x) in out.iter_mut().zip(&v) {
        *o = usize::try_from(x)
            .ok()
            .filter(|&x| x > 0)
            .ok_or(S::CUDNN_STATUS_BAD_PARAM)?;
    }
    // cuDNN's sizes are 32-bit: so is the product.
    let total = out
        .iter()
        .try_fold(1usize, |p, &x| p.checked_mul(x))
        .ok_or(S::CUDNN_STATUS_BAD_PARAM)?;
    if total > i32::MAX as usize {
        return Err(S::CUDNN_STATUS_BAD_PARAM);
    }
    Ok(out)
}

/// A forward convolution's descriptors, checked to fit together.
#[derive(Clone, Copy, Debug)]
struct Problem {
    x: Tensor,
    w: Filter,
    y: Tensor,
    conv: Conv,
}

impl Problem {
    fn new(x: Tensor, w: Filter, conv: Conv, y: Tensor) -> R<Problem> {
        let bad = Err(S::CUDNN_STATUS_BAD_PARAM);
        let [n, c, h, wd] = x.dims;
        let [k, fc, r, s] = w.dims;
        if x.dtype != w.dtype || x.dtype != y.dtype || fc != c || y.dims[0] != n || y.dims[1] != k {
            return bad;
        }
        let out = |size: usize, pad: usize, f: usize, dil: usize, stride: usize| {
            let span = (f - 1) * dil + 1;
            (size + 2 * pad >= span).then(|| (size + 2 * pad - span) / stride + 1)
        };
        let oh = out(h, conv.pad[0], r, conv.dilation[0], conv.stride[0]);
        let ow = out(wd, conv.pad[1], s, conv.dilation[1], conv.stride[1]);
        if oh != Some(y.dims[2]) || ow != Some(y.dims[3]) {
            return bad;
        }
        if x.format != y.format || x.format != w.format {
            return Err(S::CUDNN_STATUS_NOT_SUPPORTED_LAYOUT);
        }
        match (x.dtype, conv.compute) {
            (DType::Float, DType::Float) | (DType::Double, DType::Double) => {}
            _ => return Err(S::CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE),
        }
        Ok(Problem { x, w, y, conv })
    }

    fn double(&self) -> bool {
        self.x.dtype == DType::Double
    }

    /// Float operands rounded to TF32 (the math type allows tensor cores).
    fn tf32(&self) -> bool {
        !self.double() && self.conv.math != 3
    }

    fn kernel_is(&self, r: usize, s: usize) -> bool {
        self.w.dims[2] == r && self.w.dims[3] == s
    }

    fn unit_stride(&self) -> bool {
        self.conv.stride == [1, 1] && self.conv.dilation == [1, 1]
    }

    /// The shapes for which the rankings put an algorithm with an impossible workspace first.
    fn big_3x3(&self) -> bool {
        !self.double() && self.kernel_is(3, 3) && self.unit_stride() && self.x.dims[0] >= 8
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Forward,
    Data,
    Filter,
}

/// What an algorithm is, whatever its number in its direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    ImplicitGemm,
    PrecompGemm,
    Gemm,
    Fft,
    FftTiling,
    Winograd,
    WinogradNonfused,
    /// Backward `ALGO_0`, `ALGO_1`, `ALGO_3`.
    Plain,
    /// An algorithm cuDNN has no implementation of.
    Missing,
}

fn kind(dir: Direction, algo: u32) -> Option<Kind> {
    use Kind::*;
    let kinds: &[Kind] = match dir {
        Direction::Forward => &[
            ImplicitGemm,
            PrecompGemm,
            Gemm,
            Missing,
            Fft,
            FftTiling,
            Winograd,
            WinogradNonfused,
        ],
        Direction::Data => &[Plain, Plain, Fft, FftTiling, Winograd, WinogradNonfused],
        Direction::Filter => &[
            Plain,
            Plain,
            Fft,
            Plain,
            Missing,
            WinogradNonfused,
            FftTiling,
        ],
    };
    kinds.get(algo as usize).copied()
}

/// An algorithm's verdict for a problem.
#[derive(Clone, Copy, Debug)]
struct Algo {
    id: u32,
    status: S,
    workspace: usize,
    deterministic: bool,
}

fn algo(dir: Direction, p: &Problem, id: u32) -> Option<Algo> {
    let kind = kind(dir, id)?;
    let float_only = || {
        if p.double() {
            Err(S::CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE)
        } else {
            Ok(())
        }
    };
    let shape = |ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(S::CUDNN_STATUS_NOT_SUPPORTED_SHAPE)
        }
    };
    let support = match kind {
        Kind::Missing => Err(S::CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN),
        Kind::Fft | Kind::FftTiling => float_only().and_then(|()| shape(p.unit_stride())),
        Kind::Winograd => float_only().and_then(|()| shape(p.unit_stride() && p.kernel_is(3, 3))),
        Kind::WinogradNonfused => float_only()
            .and_then(|()| shape(p.unit_stride() && (p.kernel_is(3, 3) || p.kernel_is(5, 5)))),
        _ => Ok(()),
    };
    let [n, c, _, _] = p.x.dims;
    let [k, _, r, s] = p.w.dims;
    let [_, _, oh, ow] = p.y.dims;
    let elem = p.x.dtype.size();
    let workspace = match kind {
        Kind::PrecompGemm => 4 * c * r * s,
        Kind::Gemm => elem * c * r * s * oh * ow,
        Kind::Fft => FFT_WORKSPACE,
        Kind::FftTiling => elem * 2 * n * (c + k) * 32 * 32,
        Kind::WinogradNonfused => elem * 16 * (c + k) * n * oh.div_ceil(2) * ow.div_ceil(2),
        Kind::Plain if dir == Direction::Filter && id == 3 => elem * k * c * r * s,
        _ => 0,
    };
    let deterministic = !matches!((dir, id), (Direction::Data, 0) | (Direction::Filter, 0 | 3));
    Some(Algo {
        id,
        status: support.err().unwrap_or(S::CUDNN_STATUS_SUCCESS),
        workspace,
        deterministic,
    })
}

/// The `_v7` ranking: the preferred supported algorithms in order, the other supported ones,
/// then the unsupported ones.
fn ranking(dir: Direction, p: &Problem) -> Vec<Algo> {
    let strided = p.conv.stride != [1, 1];
    let many = p.x.dims[0] >= 8;
    let preferred: &[u32] = match dir {
        Direction::Forward if p.big_3x3() => &[4, 7, 1, 0, 2, 6, 5],
        Direction::Forward if p.kernel_is(1, 1) => &[0, 2, 1],
        Direction::Forward => &[1, 0, 2, 7, 6, 5, 4],
        Direction::Data if p.big_3x3() => &[2, 5, 1, 0],
        Direction::Data if strided => &[0, 1],
        Direction::Data => &[1, 0, 5, 4, 3, 2],
        Direction::Filter if p.big_3x3() => &[3, 2, 0, 1],
        Direction::Filter if many => &[3, 0, 1],
        Direction::Filter => &[1, 0, 3],
    };
    let count = match dir {
        Direction::Forward => 8,
        Direction::Data => 6,
        Direction::Filter => 7,
    };
    let all: Vec<Algo> = (0..count).filter_map(|id| algo(dir, p, id)).collect();
    let supported = |a: &&Algo| a.status == S::CUDNN_STATUS_SUCCESS;
    let mut ranked: Vec<Algo> = preferred
        .iter()
        .filter_map(|&id| all.iter().find(|a| a.id == id))
        .filter(supported)
        .copied()
        .collect();
    for a in all.iter().filter(supported) {
        if !ranked.iter().any(|b| b.id == a.id) {
            ranked.push(*a);
        }
    }
    ranked.extend(all.iter().filter(|a| a.status != S::CUDNN_STATUS_SUCCESS));
    ranked
}

/// The floating-point types the stand-in computes in.
trait Real: Copy + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + PartialOrd {
    const ZERO: Self;
    fn from_f64(v: f64) -> Self;
    fn is_nan(self) -> bool;
    /// Rounded to TF32 (10 mantissa bits, to nearest even) where `on`.
    fn operand(self, on: bool) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn operand(self, on: bool) -> Self {
        if !on || !self.is_finite() {
            return self;
        }
        let b = self.to_bits();
        f32::from_bits((b + 0xfff + ((b >> 13) & 1)) & !0x1fff)
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    fn from_f64(v: f64) -> Self {
        v
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn operand(self, _: bool) -> Self {
        self
    }
}

/// Device memory for the whole extent of a descriptor: `BAD_PARAM_NULL_POINTER` for null, an
/// execution failure (and the context's sticky `ILLEGAL_ADDRESS`) when it leaves the
/// allocation, as the real kernel's fault would be.
fn extent(ptr: *const c_void, bytes: usize, what: &str) -> R<()> {
    if ptr.is_null() {
        return Err(S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER);
    }
    if memory::check(ptr as u64, bytes).is_err() {
        eprintln!(
            "cuda-stand-in: cuDNN: {what} ({bytes} bytes at {ptr:p}) is not inside one live allocation"
        );
        driver::set_sticky(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        return Err(S::CUDNN_STATUS_EXECUTION_FAILED);
    }
    Ok(())
}

/// The handle and the context are usable.
fn ready(h: cudnnHandle_t) -> R<()> {
    let stream = handle(h)?;
    if driver::sticky_error().is_some() {
        return Err(S::CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER);
    }
    if !driver::valid_stream(stream as CUstream) {
        return Err(S::CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH);
    }
    Ok(())
}

/// A host scaling factor: double for double data, float otherwise.
unsafe fn scalar(p: *const c_void, double: bool) -> R<f64> {
    if p.is_null() {
        return Err(S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER);
    }
    Ok(if double {
        *p.cast::<f64>()
    } else {
        f64::from(*p.cast::<f32>())
    })
}

/// The workspace is large enough and is device memory.
fn workspace(a: &Algo, ptr: *mut c_void, size: usize) -> R<()> {
    if size < a.workspace {
        return Err(S::CUDNN_STATUS_BAD_PARAM);
    }
    if a.workspace > 0 {
        extent(ptr, a.workspace, "the workspace")?;
    }
    Ok(())
}

/// The algorithm `id` of `dir`, if it supports the problem.
fn supported(dir: Direction, p: &Problem, id: u32) -> R<Algo> {
    let a = algo(dir, p, id).ok_or(S::CUDNN_STATUS_BAD_PARAM)?;
    if a.status != S::CUDNN_STATUS_SUCCESS {
        return Err(a.status);
    }
    Ok(a)
}

/// `dst[i] = alpha * value(i) + beta * dst[i]` over `offsets` (the destination not read when
/// beta is 0).
unsafe fn blend<T: Real>(
    dst: *mut T,
    offsets: impl Iterator<Item = (usize, T)>,
    alpha: f64,
    beta: f64,
) {
    let (a, b) = (T::from_f64(alpha), T::from_f64(beta));
    for (o, v) in offsets {
        let p = dst.add(o);
        *p = if beta == 0.0 { a * v } else { a * v + b * *p };
    }
}

/// The input coordinate tap `f` of output coordinate `o` reads on one axis, if inside.
fn tap(o: usize, f: usize, axis: usize, p: &Problem, size: usize) -> Option<usize> {
    let at = (o * p.conv.stride[axis] + f * p.conv.dilation[axis]).checked_sub(p.conv.pad[axis])?;
    (at < size).then_some(at)
}

/// The filter tap a window position uses (flipped for true convolution).
fn flip(p: &Problem, r: usize, s: usize) -> (usize, usize) {
    if p.conv.mode == 0 {
        (p.w.dims[2] - 1 - r, p.w.dims[3] - 1 - s)
    } else {
        (r, s)
    }
}

/// The convolution's outputs `(y offset, value)`.
unsafe fn forward<T: Real>(p: &Problem, x: *const T, w: *const T) -> Vec<(usize, T)> {
    let [n, c, h, wd] = p.x.dims;
    let [k, _, r, s] = p.w.dims;
    let [_, _, oh, ow] = p.y.dims;
    let tf = p.tf32();
    let mut out = Vec::with_capacity(n * k * oh * ow);
    for ni in 0..n {
        for ki in 0..k {
            for yi in 0..oh {
                for xi in 0..ow {
                    let mut sum = T::ZERO;
                    for ri in 0..r {
                        let Some(hi) = tap(yi, ri, 0, p, h) else {
                            continue;
                        };
                        for si in 0..s {
                            let Some(wi) = tap(xi, si, 1, p, wd) else {
                                continue;
                            };
                            let (fr, fs) = flip(p, ri, si);
                            for ci in 0..c {
                                let xv = (*x.add(p.x.offset(ni, ci, hi, wi))).operand(tf);
                                let wv = (*w.add(p.w.offset(ki, ci, fr, fs))).operand(tf);
                                sum = sum + xv * wv;
                            }
                        }
                    }
                    out.push((p.y.offset(ni, ki, yi, xi), sum));
                }
            }
        }
    }
    out
}

/// The input gradient `(dx offset, value)`; `rotate` starts the output channels elsewhere.
unsafe fn backward_data<T: Real>(
    p: &Problem,
    w: *const T,
    dy: *const T,
    rotate: usize,
) -> Vec<(usize, T)> {
    let [n, c, h, wd] = p.x.dims;
    let [k, _, r, s] = p.w.dims;
    let [_, _, oh, ow] = p.y.dims;
    let tf = p.tf32();
    let mut acc = vec![T::ZERO; n * c * h * wd];
    let at = |ni: usize, ci: usize, hi: usize, wi: usize| ((ni * c + ci) * h + hi) * wd + wi;
    for ni in 0..n {
        for kk in 0..k {
            let ki = (kk + rotate) % k;
            for yi in 0..oh {
                for xi in 0..ow {
                    let g = (*dy.add(p.y.offset(ni, ki, yi, xi))).operand(tf);
                    for ri in 0..r {
                        let Some(hi) = tap(yi, ri, 0, p, h) else {
                            continue;
                        };
                        for si in 0..s {
                            let Some(wi) = tap(xi, si, 1, p, wd) else {
                                continue;
                            };
                            let (fr, fs) = flip(p, ri, si);
                            for ci in 0..c {
                                let wv = (*w.add(p.w.offset(ki, ci, fr, fs))).operand(tf);
                                let a = &mut acc[at(ni, ci, hi, wi)];
                                *a = *a + g * wv;
                            }
                        }
                    }
                }
            }
        }
    }
    let mut out = Vec::with_capacity(acc.len());
    for ni in 0..n {
        for ci in 0..c {
            for hi in 0..h {
                for wi in 0..wd {
                    out.push((p.x.offset(ni, ci, hi, wi), acc[at(ni, ci, hi, wi)]));
                }
            }
        }
    }
    out
}

/// The filter gradient `(dw offset, value)`; `rotate` starts the images elsewhere.
unsafe fn backward_filter<T: Real>(
    p: &Problem,
    x: *const T,
    dy: *const T,
    rotate: usize,
) -> Vec<(usize, T)> {
    let [n, c, h, wd] = p.x.dims;
    let [k, _, r, s] = p.w.dims;
    let [_, _, oh, ow] = p.y.dims;
    let tf = p.tf32();
    let mut out = Vec::with_capacity(k * c * r * s);
    for ki in 0..k {
        for ci in 0..c {
            for ri in 0..r {
                for si in 0..s {
                    let mut sum = T::ZERO;
                    for nn in 0..n {
                        let ni = (nn + rotate) % n;
                        for yi in 0..oh {
                            let Some(hi) = tap(yi, ri, 0, p, h) else {
                                continue;
                            };
                            for xi in 0..ow {
                                let Some(wi) = tap(xi, si, 1, p, wd) else {
                                    continue;
                                };
                                let xv = (*x.add(p.x.offset(ni, ci, hi, wi))).operand(tf);
                                let g = (*dy.add(p.y.offset(ni, ki, yi, xi))).operand(tf);
                                sum = sum + xv * g;
                            }
                        }
                    }
                    let (fr, fs) = flip(p, ri, si);
                    out.push((p.w.offset(ki, ci, fr, fs), sum));
                }
            }
        }
    }
    out
}

/// The rotation a call of algorithm `a` sums with: 0 for deterministic ones.
fn rotation(a: &Algo) -> usize {
    if a.deterministic {
        0
    } else {
        CALLS.fetch_add(1, Ordering::Relaxed) as usize
    }
}

#[no_mangle]
pub unsafe extern "C" fn cudnnCreate(handle: *mut cudnnHandle_t) -> S {
    create(handle.cast(), Object::Handle { stream: 0 })
}

#[no_mangle]
pub unsafe extern "C" fn cudnnDestroy(handle: cudnnHandle_t) -> S {
    destroy(handle.cast(), |o| matches!(o, Object::Handle { .. }))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnSetStream(h: cudnnHandle_t, streamId: cudaStream_t) -> S {
    status((|| {
        handle(h)?;
        if !driver::valid_stream(streamId as CUstream) {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        set(
            h.cast(),
            Object::Handle {
                stream: streamId as usize,
            },
        );
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnCreateTensorDescriptor(d: *mut cudnnTensorDescriptor_t) -> S {
    create(d.cast(), Object::Tensor(None))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnDestroyTensorDescriptor(d: cudnnTensorDescriptor_t) -> S {
    destroy(d.cast(), |o| matches!(o, Object::Tensor(_)))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnSetTensor4dDescriptor(
    d: cudnnTensorDescriptor_t,
    format: u32,
    dataType: u32,
    n: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
) -> S {
    status((|| {
        let Object::Tensor(_) = get(d.cast())? else {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        };
        let dtype = DType::from_raw(dataType)?;
        let dims = sizes([n, c, h, w])?;
        let [_, c, h, w] = dims;
        let strides = match format {
            NCHW => [c * h * w, h * w, w, 1],
            NHWC => [h * w * c, 1, w * c, c],
            _ => return Err(S::CUDNN_STATUS_BAD_PARAM),
        };
        set(
            d.cast(),
            Object::Tensor(Some(Tensor {
                dtype,
                format,
                dims,
                strides,
            })),
        );
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnCreateFilterDescriptor(d: *mut cudnnFilterDescriptor_t) -> S {
    create(d.cast(), Object::Filter(None))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnDestroyFilterDescriptor(d: cudnnFilterDescriptor_t) -> S {
    destroy(d.cast(), |o| matches!(o, Object::Filter(_)))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnSetFilter4dDescriptor(
    d: cudnnFilterDescriptor_t,
    dataType: u32,
    format: u32,
    k: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
) -> S {
    status((|| {
        let Object::Filter(_) = get(d.cast())? else {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        };
        let dtype = DType::from_raw(dataType)?;
        let dims = sizes([k, c, h, w])?;
        if format != NCHW && format != NHWC {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        set(
            d.cast(),
            Object::Filter(Some(Filter {
                dtype,
                format,
                dims,
            })),
        );
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnCreateConvolutionDescriptor(
    d: *mut cudnnConvolutionDescriptor_t,
) -> S {
    create(d.cast(), Object::Conv(None))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnDestroyConvolutionDescriptor(d: cudnnConvolutionDescriptor_t) -> S {
    destroy(d.cast(), |o| matches!(o, Object::Conv(_)))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnSetConvolution2dDescriptor(
    d: cudnnConvolutionDescriptor_t,
    pad_h: c_int,
    pad_w: c_int,
    u: c_int,
    v: c_int,
    dilation_h: c_int,
    dilation_w: c_int,
    mode: u32,
    computeType: u32,
) -> S {
    status((|| {
        let Object::Conv(old) = get(d.cast())? else {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        };
        let compute = DType::from_raw(computeType)?;
        let pad = [pad_h, pad_w].map(|p| usize::try_from(p).ok());
        let [Some(ph), Some(pw)] = pad else {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        };
        let [sh, sw, dh, dw] = sizes([u, v, dilation_h, dilation_w])?;
        if mode > 1 {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        let conv = Conv {
            pad: [ph, pw],
            stride: [sh, sw],
            dilation: [dh, dw],
            mode,
            compute,
            math: old.map_or(0, |c| c.math),
        };
        set(d.cast(), Object::Conv(Some(conv)));
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnSetConvolutionMathType(
    d: cudnnConvolutionDescriptor_t,
    mathType: u32,
) -> S {
    status((|| {
        let Object::Conv(Some(mut c)) = get(d.cast())? else {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        };
        if mathType > 3 {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        c.math = mathType;
        set(d.cast(), Object::Conv(Some(c)));
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnCreateActivationDescriptor(d: *mut cudnnActivationDescriptor_t) -> S {
    create(d.cast(), Object::Activation(None))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnDestroyActivationDescriptor(d: cudnnActivationDescriptor_t) -> S {
    destroy(d.cast(), |o| matches!(o, Object::Activation(_)))
}

#[no_mangle]
pub unsafe extern "C" fn cudnnSetActivationDescriptor(
    d: cudnnActivationDescriptor_t,
    mode: u32,
    reluNanOpt: u32,
    coef: f64,
) -> S {
    status((|| {
        let Object::Activation(_) = get(d.cast())? else {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        };
        if mode > 6 || reluNanOpt > 1 || coef.is_nan() {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        set(
            d.cast(),
            Object::Activation(Some(Activation {
                mode,
                propagate_nan: reluNanOpt == 1,
            })),
        );
        Ok(())
    })())
}

fn math_type(raw: u32) -> cudnnMathType_t {
    match raw {
        1 => cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        2 => cudnnMathType_t::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        3 => cudnnMathType_t::CUDNN_FMA_MATH,
        _ => cudnnMathType_t::CUDNN_DEFAULT_MATH,
    }
}

fn determinism(a: &Algo) -> cudnnDeterminism_t {
    if a.deterministic {
        cudnnDeterminism_t::CUDNN_DETERMINISTIC
    } else {
        cudnnDeterminism_t::CUDNN_NON_DETERMINISTIC
    }
}

const FWD: [cudnnConvolutionFwdAlgo_t; 8] = {
    use cudnnConvolutionFwdAlgo_t::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};
const DATA: [cudnnConvolutionBwdDataAlgo_t; 6] = {
    use cudnnConvolutionBwdDataAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};
const FILTER: [cudnnConvolutionBwdFilterAlgo_t; 7] = {
    use cudnnConvolutionBwdFilterAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ]
};

/// Fills a `_v7` result array from the ranking.
unsafe fn report<P>(
    dir: Direction,
    p: &Problem,
    requested: c_int,
    returned: *mut c_int,
    results: *mut P,
    entry: impl Fn(&Algo, cudnnMathType_t) -> P,
) -> R<()> {
    if returned.is_null() || results.is_null() {
        return Err(S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER);
    }
    let requested = usize::try_from(requested)
        .ok()
        .filter(|&r| r > 0)
        .ok_or(S::CUDNN_STATUS_BAD_PARAM)?;
    let ranked = ranking(dir, p);
    let n = ranked.len().min(requested);
    for (i, a) in ranked.iter().take(n).enumerate() {
        results.add(i).write(entry(a, math_type(p.conv.math)));
    }
    *returned = n as c_int;
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionForwardAlgorithm_v7(
    h: cudnnHandle_t,
    srcDesc: cudnnTensorDescriptor_t,
    filterDesc: cudnnFilterDescriptor_t,
    convDesc: cudnnConvolutionDescriptor_t,
    destDesc: cudnnTensorDescriptor_t,
    requestedAlgoCount: c_int,
    returnedAlgoCount: *mut c_int,
    perfResults: *mut cudnnConvolutionFwdAlgoPerf_t,
) -> S {
    status((|| {
        handle(h)?;
        let p = Problem::new(
            tensor(srcDesc)?,
            filter(filterDesc)?,
            conv(convDesc)?,
            tensor(destDesc)?,
        )?;
        report(
            Direction::Forward,
            &p,
            requestedAlgoCount,
            returnedAlgoCount,
            perfResults,
            |a, math| cudnnConvolutionFwdAlgoPerf_t {
                algo: FWD[a.id as usize],
                status: a.status,
                time: -1.0,
                memory: a.workspace,
                determinism: determinism(a),
                mathType: math,
                reserved: [0; 3],
            },
        )
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardDataAlgorithm_v7(
    h: cudnnHandle_t,
    filterDesc: cudnnFilterDescriptor_t,
    diffDesc: cudnnTensorDescriptor_t,
    convDesc: cudnnConvolutionDescriptor_t,
    gradDesc: cudnnTensorDescriptor_t,
    requestedAlgoCount: c_int,
    returnedAlgoCount: *mut c_int,
    perfResults: *mut cudnnConvolutionBwdDataAlgoPerf_t,
) -> S {
    status((|| {
        handle(h)?;
        let p = Problem::new(
            tensor(gradDesc)?,
            filter(filterDesc)?,
            conv(convDesc)?,
            tensor(diffDesc)?,
        )?;
        report(
            Direction::Data,
            &p,
            requestedAlgoCount,
            returnedAlgoCount,
            perfResults,
            |a, math| cudnnConvolutionBwdDataAlgoPerf_t {
                algo: DATA[a.id as usize],
                status: a.status,
                time: -1.0,
                memory: a.workspace,
                determinism: determinism(a),
                mathType: math,
                reserved: [0; 3],
            },
        )
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    h: cudnnHandle_t,
    srcDesc: cudnnTensorDescriptor_t,
    diffDesc: cudnnTensorDescriptor_t,
    convDesc: cudnnConvolutionDescriptor_t,
    gradDesc: cudnnFilterDescriptor_t,
    requestedAlgoCount: c_int,
    returnedAlgoCount: *mut c_int,
    perfResults: *mut cudnnConvolutionBwdFilterAlgoPerf_t,
) -> S {
    status((|| {
        handle(h)?;
        let p = Problem::new(
            tensor(srcDesc)?,
            filter(gradDesc)?,
            conv(convDesc)?,
            tensor(diffDesc)?,
        )?;
        report(
            Direction::Filter,
            &p,
            requestedAlgoCount,
            returnedAlgoCount,
            perfResults,
            |a, math| cudnnConvolutionBwdFilterAlgoPerf_t {
                algo: FILTER[a.id as usize],
                status: a.status,
                time: -1.0,
                memory: a.workspace,
                determinism: determinism(a),
                mathType: math,
                reserved: [0; 3],
            },
        )
    })())
}

unsafe fn workspace_size(dir: Direction, p: R<Problem>, algo: u32, size: *mut usize) -> S {
    status((|| {
        let p = p?;
        if size.is_null() {
            return Err(S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER);
        }
        *size = supported(dir, &p, algo)?.workspace;
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionForwardWorkspaceSize(
    h: cudnnHandle_t,
    xDesc: cudnnTensorDescriptor_t,
    wDesc: cudnnFilterDescriptor_t,
    convDesc: cudnnConvolutionDescriptor_t,
    yDesc: cudnnTensorDescriptor_t,
    algo: u32,
    sizeInBytes: *mut usize,
) -> S {
    let p = handle(h).and_then(|_| {
        Problem::new(
            tensor(xDesc)?,
            filter(wDesc)?,
            conv(convDesc)?,
            tensor(yDesc)?,
        )
    });
    workspace_size(Direction::Forward, p, algo, sizeInBytes)
}

#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardDataWorkspaceSize(
    h: cudnnHandle_t,
    wDesc: cudnnFilterDescriptor_t,
    dyDesc: cudnnTensorDescriptor_t,
    convDesc: cudnnConvolutionDescriptor_t,
    dxDesc: cudnnTensorDescriptor_t,
    algo: u32,
    sizeInBytes: *mut usize,
) -> S {
    let p = handle(h).and_then(|_| {
        Problem::new(
            tensor(dxDesc)?,
            filter(wDesc)?,
            conv(convDesc)?,
            tensor(dyDesc)?,
        )
    });
    workspace_size(Direction::Data, p, algo, sizeInBytes)
}

#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionBackwardFilterWorkspaceSize(
    h: cudnnHandle_t,
    xDesc: cudnnTensorDescriptor_t,
    dyDesc: cudnnTensorDescriptor_t,
    convDesc: cudnnConvolutionDescriptor_t,
    gradDesc: cudnnFilterDescriptor_t,
    algo: u32,
    sizeInBytes: *mut usize,
) -> S {
    let p = handle(h).and_then(|_| {
        Problem::new(
            tensor(xDesc)?,
            filter(gradDesc)?,
            conv(convDesc)?,
            tensor(dyDesc)?,
        )
    });
    workspace_size(Direction::Filter, p, algo, sizeInBytes)
}

#[no_mangle]
pub unsafe extern "C" fn cudnnConvolutionForward(
    h: cudnnHandle_t,
    alpha: *const c_void,
    xDesc: cudnnTensorDescriptor_t,
    x: *const c_void,
    wDesc: cudnnFilterDescriptor_t,
    w: *const c_void,
    convDesc: cudnnConvolutionDescriptor_t,
    algo: u32,
    workSpace: *mut c_void,
    workSpaceSizeInBytes: usize,
    beta: *const c_void,
    yDesc: cudnnTensorDescriptor_t,
    y: *mut c_void,
) -> S {
    status((|| {
        ready(h)?;
        let p = Problem::new(
            tensor(xDesc)?,
            filter(wDesc)?,
            conv(convDesc)?,
            tensor(yDesc)?,
        )?;
        let a = supported(Direction::Forward, &p, algo)?;
        let (alpha, beta) = (scalar(alpha, p.double())?, scalar(beta, p.double())?);
        workspace(&a, workSpace, workSpaceSizeInBytes)?;
        extent(x, p.x.bytes(), "x")?;
        extent(w, p.w.bytes(), "w")?;
        extent(y, p.y.bytes(), "y")?;
        if p.double() {
            blend(
                y.cast::<f64>(),
                forward(&p, x.cast(), w.cast()).into_iter(),
                alpha,
                beta,
            );
        } else {
            blend(
                y.cast::<f32>(),
                forward(&p, x.cast(), w.cast()).into_iter(),
                alpha,
                beta,
            );
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnConvolutionBackwardData(
    h: cudnnHandle_t,
    alpha: *const c_void,
    wDesc: cudnnFilterDescriptor_t,
    w: *const c_void,
    dyDesc: cudnnTensorDescriptor_t,
    dy: *const c_void,
    convDesc: cudnnConvolutionDescriptor_t,
    algo: u32,
    workSpace: *mut c_void,
    workSpaceSizeInBytes: usize,
    beta: *const c_void,
    dxDesc: cudnnTensorDescriptor_t,
    dx: *mut c_void,
) -> S {
    status((|| {
        ready(h)?;
        let p = Problem::new(
            tensor(dxDesc)?,
            filter(wDesc)?,
            conv(convDesc)?,
            tensor(dyDesc)?,
        )?;
        let a = supported(Direction::Data, &p, algo)?;
        let (alpha, beta) = (scalar(alpha, p.double())?, scalar(beta, p.double())?);
        workspace(&a, workSpace, workSpaceSizeInBytes)?;
        extent(w, p.w.bytes(), "w")?;
        extent(dy, p.y.bytes(), "dy")?;
        extent(dx, p.x.bytes(), "dx")?;
        let rotate = rotation(&a);
        if p.double() {
            blend(
                dx.cast::<f64>(),
                backward_data(&p, w.cast(), dy.cast(), rotate).into_iter(),
                alpha,
                beta,
            );
        } else {
            blend(
                dx.cast::<f32>(),
                backward_data(&p, w.cast(), dy.cast(), rotate).into_iter(),
                alpha,
                beta,
            );
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudnnConvolutionBackwardFilter(
    h: cudnnHandle_t,
    alpha: *const c_void,
    xDesc: cudnnTensorDescriptor_t,
    x: *const c_void,
    dyDesc: cudnnTensorDescriptor_t,
    dy: *const c_void,
    convDesc: cudnnConvolutionDescriptor_t,
    algo: u32,
    workSpace: *mut c_void,
    workSpaceSizeInBytes: usize,
    beta: *const c_void,
    dwDesc: cudnnFilterDescriptor_t,
    dw: *mut c_void,
) -> S {
    status((|| {
        ready(h)?;
        let p = Problem::new(
            tensor(xDesc)?,
            filter(dwDesc)?,
            conv(convDesc)?,
            tensor(dyDesc)?,
        )?;
        let a = supported(Direction::Filter, &p, algo)?;
        let (alpha, beta) = (scalar(alpha, p.double())?, scalar(beta, p.double())?);
        workspace(&a, workSpace, workSpaceSizeInBytes)?;
        extent(x, p.x.bytes(), "x")?;
        extent(dy, p.y.bytes(), "dy")?;
        extent(dw, p.w.bytes(), "dw")?;
        let rotate = rotation(&a);
        if p.double() {
            blend(
                dw.cast::<f64>(),
                backward_filter(&p, x.cast(), dy.cast(), rotate).into_iter(),
                alpha,
                beta,
            );
        } else {
            blend(
                dw.cast::<f32>(),
                backward_filter(&p, x.cast(), dy.cast(), rotate).into_iter(),
                alpha,
                beta,
            );
        }
        Ok(())
    })())
}

/// `C = alpha * A + beta * C`, `A` broadcast over the dimensions where it has size 1.
unsafe fn add<T: Real>(a: &Tensor, ap: *const T, c: &Tensor, cp: *mut T, alpha: f64, beta: f64) {
    let [n, ch, h, w] = c.dims;
    let pick = |i: usize, d: usize| if a.dims[d] == 1 { 0 } else { i };
    let mut values = Vec::with_capacity(n * ch * h * w);
    for ni in 0..n {
        for ci in 0..ch {
            for hi in 0..h {
                for wi in 0..w {
                    let v = *ap.add(a.offset(pick(ni, 0), pick(ci, 1), pick(hi, 2), pick(wi, 3)));
                    values.push((c.offset(ni, ci, hi, wi), v));
                }
            }
        }
    }
    blend(cp, values.into_iter(), alpha, beta);
}

#[no_mangle]
pub unsafe extern "C" fn cudnnAddTensor(
    h: cudnnHandle_t,
    alpha: *const c_void,
    aDesc: cudnnTensorDescriptor_t,
    A: *const c_void,
    beta: *const c_void,
    cDesc: cudnnTensorDescriptor_t,
    C: *mut c_void,
) -> S {
    status((|| {
        ready(h)?;
        let (a, c) = (tensor(aDesc)?, tensor(cDesc)?);
        if a.dtype != c.dtype || a.dims.iter().zip(c.dims).any(|(&x, y)| x != 1 && x != y) {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        let double = match c.dtype {
            DType::Float => false,
            DType::Double => true,
            _ => return Err(S::CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE),
        };
        let (alpha, beta) = (scalar(alpha, double)?, scalar(beta, double)?);
        extent(A, a.bytes(), "A")?;
        extent(C, c.bytes(), "C")?;
        if double {
            add(&a, A.cast::<f64>(), &c, C.cast::<f64>(), alpha, beta);
        } else {
            add(&a, A.cast::<f32>(), &c, C.cast::<f32>(), alpha, beta);
        }
        Ok(())
    })())
}

/// `y = act(alpha1 * conv + alpha2 * z + bias)`.
unsafe fn fused<T: Real>(
    p: &Problem,
    x: *const T,
    w: *const T,
    z: *const T,
    bias: (&Tensor, *const T),
    act: Activation,
    alpha1: f64,
    alpha2: f64,
    y: *mut T,
) {
    let (a1, a2) = (T::from_f64(alpha1), T::from_f64(alpha2));
    let conv = forward(p, x, w);
    let [n, k, oh, ow] = p.y.dims;
    // `conv` is in (n, k, h, w) order: the bias of each entry's channel.
    let mut i = 0;
    for _ in 0..n {
        for ki in 0..k {
            let b = *bias.1.add(bias.0.offset(0, ki, 0, 0));
            for _ in 0..oh * ow {
                let (o, c) = conv[i];
                i += 1;
                let v = a1 * c + a2 * *z.add(o) + b;
                *y.add(o) =
                    if act.mode == IDENTITY || (act.propagate_nan && v.is_nan()) || v > T::ZERO {
                        v
                    } else {
                        T::ZERO
                    };
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cudnnConvolutionBiasActivationForward(
    h: cudnnHandle_t,
    alpha1: *const c_void,
    xDesc: cudnnTensorDescriptor_t,
    x: *const c_void,
    wDesc: cudnnFilterDescriptor_t,
    w: *const c_void,
    convDesc: cudnnConvolutionDescriptor_t,
    algo: u32,
    workSpace: *mut c_void,
    workSpaceSizeInBytes: usize,
    alpha2: *const c_void,
    zDesc: cudnnTensorDescriptor_t,
    z: *const c_void,
    biasDesc: cudnnTensorDescriptor_t,
    bias: *const c_void,
    activationDesc: cudnnActivationDescriptor_t,
    yDesc: cudnnTensorDescriptor_t,
    y: *mut c_void,
) -> S {
    status((|| {
        ready(h)?;
        let p = Problem::new(
            tensor(xDesc)?,
            filter(wDesc)?,
            conv(convDesc)?,
            tensor(yDesc)?,
        )?;
        let (zt, bt, act) = (
            tensor(zDesc)?,
            tensor(biasDesc)?,
            activation(activationDesc)?,
        );
        if zt != p.y || bt.dtype != p.y.dtype || bt.dims != [1, p.y.dims[1], 1, 1] {
            return Err(S::CUDNN_STATUS_BAD_PARAM);
        }
        let a = supported(Direction::Forward, &p, algo)?;
        if (act.mode != RELU && act.mode != IDENTITY) || algo != 1 {
            return Err(S::CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN);
        }
        let (alpha1, alpha2) = (scalar(alpha1, p.double())?, scalar(alpha2, p.double())?);
        workspace(&a, workSpace, workSpaceSizeInBytes)?;
        extent(x, p.x.bytes(), "x")?;
        extent(w, p.w.bytes(), "w")?;
        extent(z, zt.bytes(), "z")?;
        extent(bias, bt.bytes(), "bias")?;
        extent(y, p.y.bytes(), "y")?;
        if p.double() {
            fused::<f64>(
                &p,
                x.cast(),
                w.cast(),
                z.cast(),
                (&bt, bias.cast()),
                act,
                alpha1,
                alpha2,
                y.cast(),
            );
        } else {
            fused::<f32>(
                &p,
                x.cast(),
                w.cast(),
                z.cast(),
                (&bt, bias.cast()),
                act,
                alpha1,
                alpha2,
                y.cast(),
            );
        }
        Ok(())
    })())
}
