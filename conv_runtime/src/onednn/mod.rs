//! A safe layer over oneDNN 3.x (the C API), loaded at run time.
//!
//! Nothing oneDNN is needed to build: [`Library::load`] opens `$ONEDNN_LIB_DIR/libdnnl.so.3`
//! when the program runs and fails with a clear [`Error`] when the variable is unset or the file
//! is missing. oneDNN 3.2 with the GNU OpenMP runtime is what this layer was written and tested
//! against (`pip install onednn-devel-cpu-gomp==2023.2.0`, whose `lib` directory is what
//! `ONEDNN_LIB_DIR` should name).
//!
//! The types mirror oneDNN's objects, each owning its handle and destroying it on drop:
//! [`Engine`], [`Stream`], [`MemoryDesc`], [`Memory`], [`PostOps`], [`Attr`],
//! [`PrimitiveDesc`] (built by [`conv_forward`], [`conv_backward_data`],
//! [`conv_backward_weights`], [`batch_norm_forward`], [`batch_norm_backward`],
//! [`eltwise_forward`], [`eltwise_backward`], [`reorder`]) and [`Primitive`]. Every oneDNN status
//! is checked; a failure becomes `Error::new("oneDNN <call>", "<status name> (<code>)")`.
//!
//! # Buffers and lifetimes
//!
//! A [`Memory`] either owns a buffer the library allocated ([`Memory::allocate`]), or has none
//! until the caller binds one with the `unsafe` [`Memory::set_data_handle`]
//! ([`Memory::unbound`]). The intended use by generated layers: create unbound memories once per
//! layer and shape, and right before each [`Primitive::execute`] bind the tensors' pointers;
//! execution on a CPU stream is synchronous, so the pointers need to stay valid (and not be
//! touched through Rust references) only until `execute` returns. [`Primitive::execute`]
//! refuses an unbound memory, an argument the primitive does not take and a memory whose
//! descriptor differs from the one the primitive expects (oneDNN itself refuses a missing
//! argument), so a wrong binding cannot make oneDNN read or write outside the bound buffer.
//!
//! # Threads
//!
//! oneDNN's CPU kernels run on OpenMP (this build of oneDNN uses the GNU runtime, libgomp).
//! oneDNN sizes a primitive's work split and scratchpad for the thread count in effect when its
//! descriptor is created, so each [`PrimitiveDesc`] records the count of the [`Engine`] handle
//! it was built on, and that count is applied on the calling thread with libgomp's
//! `omp_set_num_threads` (which sets only the calling thread's `nthreads-var`) before creating
//! the descriptor, creating its primitive, and each execution. Descriptors of different counts
//! thus coexist in one process and on one thread: each execution runs at its own count.
//!
//! An engine handle has its own count when made with [`Engine::with_threads`] (what the
//! [`OneDnn`] device does: one count per device); otherwise descriptors built on it take the
//! process-wide default of [`set_threads`] (1 unless set) at their creation, and a later
//! [`set_threads`] affects only descriptors built afterwards, never a primitive in use.
//!
//! Thread safety follows oneDNN's documentation: engines, memory descriptors, attributes and
//! primitive descriptors are immutable once built (`Send + Sync`); primitives may be executed
//! from several threads (`Send + Sync`) because every descriptor built here uses the *user*
//! scratchpad mode and each [`Primitive`] owns its scratchpad behind a lock (the library mode
//! would share one scratchpad among all primitives of a thread); streams and memories are
//! `Send` but not `Sync`.

mod device;
pub mod ffi;

pub use device::{ConvGeometry, ConvSetup, OneDnn};

use std::ffi::CStr;
use std::fmt;
use std::mem::ManuallyDrop;
use std::os::raw::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::{bf16, f16, Error, Result};

/// The environment variable that names the directory holding `libdnnl.so.3`.
pub const LIB_DIR_VAR: &str = "ONEDNN_LIB_DIR";

/// The oneDNN 3.x shared library's file name.
pub const LIB_NAME: &str = "libdnnl.so.3";

/// The GNU OpenMP runtime's file name, loaded only if `libdnnl` does not already provide the
/// OpenMP entry points through its dependencies.
const GOMP_NAME: &str = "libgomp.so.1";

/// The operation named by loading errors.
const LOAD_OP: &str = "oneDNN library load";

/// The name of a oneDNN status, as the headers spell it without the `dnnl_` prefix.
fn status_name(status: ffi::dnnl_status_t) -> &'static str {
    match status {
        ffi::dnnl_success => "success",
        ffi::dnnl_out_of_memory => "out_of_memory",
        ffi::dnnl_invalid_arguments => "invalid_arguments",
        ffi::dnnl_unimplemented => "unimplemented",
        ffi::dnnl_last_impl_reached => "last_impl_reached",
        ffi::dnnl_runtime_error => "runtime_error",
        ffi::dnnl_not_required => "not_required",
        ffi::dnnl_invalid_graph => "invalid_graph",
        ffi::dnnl_invalid_graph_op => "invalid_graph_op",
        ffi::dnnl_invalid_shape => "invalid_shape",
        ffi::dnnl_invalid_data_type => "invalid_data_type",
        _ => "unknown status",
    }
}

/// Turns a oneDNN status into a `Result`, naming the call.
fn check(status: ffi::dnnl_status_t, call: &str) -> Result<()> {
    if status == ffi::dnnl_success {
        Ok(())
    } else {
        Err(Error::new(
            format!("oneDNN {call}"),
            format!("{} ({status})", status_name(status)),
        ))
    }
}

/// A oneDNN call that reported success but returned no handle: a library bug, not a panic.
fn null_handle(call: &str) -> Error {
    Error::new(
        format!("oneDNN {call}"),
        "returned success but a null handle",
    )
}

/// `call!(api, dnnl_f(args))` calls `api.dnnl_f(args)` and checks its status. The error names
/// the function from its identifier, so the name cannot drift from the call. The call is
/// unsafe: the caller's `unsafe` block and SAFETY comment cover it.
macro_rules! call {
    ($api:expr, $f:ident($($arg:expr),* $(,)?)) => {
        check(($api.$f)($($arg),*), stringify!($f))
    };
}

/// `create!(api, dnnl_x_create(args))` calls `dnnl_x_create(&mut out, args)` (every oneDNN
/// create call writes the new handle through its first parameter) and returns the handle: an
/// error for a failed status or a null handle. Unsafe like `call!`.
macro_rules! create {
    ($api:expr, $f:ident($($arg:expr),* $(,)?)) => {{
        let mut out = std::ptr::null_mut();
        call!($api, $f(&mut out, $($arg),*)).and_then(|()| {
            if out.is_null() {
                Err(null_handle(stringify!($f)))
            } else {
                Ok(out)
            }
        })
    }};
}

/// Declares a type that owns one oneDNN handle (`raw`) and the library it came from (`lib`),
/// and destroys the handle on drop with `$destroy`.
///
/// The type is `Send + Sync`, so only objects that are immutable once built or changed only
/// through `&mut self` may be declared with it: oneDNN lets any thread read those, and destroy
/// them once nothing else refers to them.
macro_rules! owned_handle {
    ($(#[$attr:meta])* $vis:vis struct $name:ident($raw:ty) destroyed by $destroy:ident;) => {
        $(#[$attr])*
        $vis struct $name {
            lib: Library,
            raw: $raw,
        }

        // SAFETY: immutable once built, or changed only through `&mut self` (see above).
        unsafe impl Send for $name {}
        // SAFETY: as above.
        unsafe impl Sync for $name {}

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: `raw` came from a create call and is owned by this value; whatever
                // else uses the object holds this value (through an `Arc`) or a borrow of it.
                unsafe { (self.lib.api().$destroy)(self.raw) };
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Threads

/// The OpenMP thread count that descriptors built from now on record, on engines without a
/// count of their own.
static THREADS: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// The count last applied on this thread (0: never), so the OpenMP call is made only when
    /// the wanted count changes.
    static APPLIED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The most threads a count may name: OpenMP takes an `int`.
const MAX_THREADS: usize = c_int::MAX as usize;

/// Sets the process-wide default of OpenMP threads for descriptors built on engines without a
/// count of their own (default 1; 0 counts as 1).
///
/// It applies to primitive descriptors built afterwards (and their primitives, wherever they
/// execute); existing ones keep the count they were built with. The [`OneDnn`] device does not
/// read it: its engine has the device's own count ([`OneDnn::with_threads`]).
pub fn set_threads(n: usize) {
    THREADS.store(n.clamp(1, MAX_THREADS), Ordering::Relaxed);
}

/// The thread count set by [`set_threads`].
pub fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Library

struct Loaded {
    api: ffi::Api,
    omp: ffi::OmpApi,
    version: (u32, u32, u32),
    dir: PathBuf,
    // Never unloaded: oneDNN's OpenMP workers and thread-local caches can outlive every handle,
    // and unloading the code under them would crash at thread exit.
    _dnnl: ManuallyDrop<libloading::Library>,
    _gomp: Option<ManuallyDrop<libloading::Library>>,
}

/// The loaded oneDNN library: its function table, shared by every object made from it.
#[derive(Clone)]
pub struct Library(Arc<Loaded>);

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("dir", &self.0.dir)
            .field("version", &self.0.version)
            .finish()
    }
}

impl Library {
    /// Loads `$ONEDNN_LIB_DIR/libdnnl.so.3`.
    pub fn load() -> Result<Self> {
        match std::env::var_os(LIB_DIR_VAR) {
            Some(dir) if !dir.is_empty() => Self::load_from(dir),
            _ => Err(Error::new(
                LOAD_OP,
                format!(
                    "{LIB_DIR_VAR} is not set; set it to the directory that holds {LIB_NAME} \
                     (oneDNN 3.x, e.g. the `lib` directory of the Python prefix after \
                     `pip install onednn-devel-cpu-gomp==2023.2.0`)"
                ),
            )),
        }
    }

    /// Loads `dir/libdnnl.so.3`. [`Library::load`] calls this with `$ONEDNN_LIB_DIR`.
    pub fn load_from(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join(LIB_NAME);
        // SAFETY: loading runs the library's initializers; oneDNN's are ordinary C++ static
        // constructors with no preconditions.
        let dnnl = unsafe { libloading::Library::new(&path) }.map_err(|e| {
            Error::new(
                LOAD_OP,
                format!(
                    "could not load {}: {e}; set {LIB_DIR_VAR} to the directory that holds \
                     {LIB_NAME} (oneDNN 3.x)",
                    path.display()
                ),
            )
        })?;
        // SAFETY: the file is named libdnnl.so.3, oneDNN 3.x's soname; the version is checked
        // right below before any other entry is called. The library is never unloaded.
        let api = unsafe { ffi::Api::load(&dnnl) }.map_err(|(name, e)| {
            Error::new(
                LOAD_OP,
                format!("{} lacks {name}: {e} (is it oneDNN 3.x?)", path.display()),
            )
        })?;
        // SAFETY: dnnl_version returns a pointer to a static struct (or null, checked).
        let version = unsafe { (api.dnnl_version)().as_ref() }.ok_or_else(|| {
            Error::new(
                LOAD_OP,
                format!("{}: dnnl_version returned null", path.display()),
            )
        })?;
        let v = (
            version.major.max(0) as u32,
            version.minor.max(0) as u32,
            version.patch.max(0) as u32,
        );
        if v.0 != 3 {
            return Err(Error::new(
                LOAD_OP,
                format!(
                    "{} is oneDNN {}.{}.{}; this backend needs 3.x",
                    path.display(),
                    v.0,
                    v.1,
                    v.2
                ),
            ));
        }
        let (omp, gomp) = Self::load_omp(&dnnl, dir)?;
        Ok(Self(Arc::new(Loaded {
            api,
            omp,
            version: v,
            dir: dir.to_path_buf(),
            _dnnl: ManuallyDrop::new(dnnl),
            _gomp: gomp.map(ManuallyDrop::new),
        })))
    }

    /// Finds `omp_set_num_threads`: first among libdnnl's own dependencies (the OpenMP runtime
    /// it was linked with, whichever it is), else in `libgomp.so.1` by soname (the copy already
    /// loaded, if any), else in `dir`.
    fn load_omp(
        dnnl: &libloading::Library,
        dir: &Path,
    ) -> Result<(ffi::OmpApi, Option<libloading::Library>)> {
        // SAFETY: these symbols, where present, are the OpenMP runtime's with the C types the
        // table declares; the libraries are never unloaded.
        unsafe {
            if let Ok(omp) = ffi::OmpApi::load(dnnl) {
                return Ok((omp, None));
            }
            let mut tried = Vec::new();
            for candidate in [PathBuf::from(GOMP_NAME), dir.join(GOMP_NAME)] {
                match libloading::Library::new(&candidate) {
                    Ok(lib) => match ffi::OmpApi::load(&lib) {
                        Ok(omp) => return Ok((omp, Some(lib))),
                        Err((name, e)) => {
                            tried.push(format!("{}: {name}: {e}", candidate.display()))
                        }
                    },
                    Err(e) => tried.push(format!("{}: {e}", candidate.display())),
                }
            }
            Err(Error::new(
                LOAD_OP,
                format!(
                    "no OpenMP runtime found for oneDNN's thread count (tried libdnnl's \
                     dependencies, {}); install libgomp or put {GOMP_NAME} in {LIB_DIR_VAR}",
                    tried.join("; ")
                ),
            ))
        }
    }

    /// The loaded library's (major, minor, patch) version.
    pub fn version(&self) -> (u32, u32, u32) {
        self.0.version
    }

    /// The directory the library was loaded from.
    pub fn dir(&self) -> &Path {
        &self.0.dir
    }

    /// The calling thread's OpenMP `nthreads-var` (what oneDNN would use here now), for checks.
    pub fn omp_max_threads(&self) -> usize {
        // SAFETY: no preconditions.
        unsafe { (self.0.omp.omp_get_max_threads)() }.max(0) as usize
    }

    fn api(&self) -> &ffi::Api {
        &self.0.api
    }

    /// Makes `want` threads the calling thread's OpenMP count, unless it already is.
    fn apply_threads(&self, want: usize) {
        APPLIED.with(|applied| {
            if applied.get() != want {
                // SAFETY: no preconditions; `want` is within 1..=c_int::MAX.
                unsafe { (self.0.omp.omp_set_num_threads)(want as c_int) };
                applied.set(want);
            }
        });
    }
}

/// The version of the oneDNN library that `$ONEDNN_LIB_DIR` names.
pub fn version() -> Result<(u32, u32, u32)> {
    Library::load().map(|lib| lib.version())
}

// ---------------------------------------------------------------------------------------------
// Engine and stream

owned_handle! {
    /// Immutable after creation; every object using it holds a clone of the [`Engine`].
    struct EngineInner(ffi::dnnl_engine_t) destroyed by dnnl_engine_destroy;
}

/// A CPU engine. Cheap to clone (shared); memories, descriptors and streams keep it alive.
///
/// The handle also carries the OpenMP thread count that descriptors built on it record (see
/// the module docs on threads): its own after [`Engine::with_threads`], else the process-wide
/// [`threads`] at each descriptor's creation. Handles made from one another with different
/// counts are the same oneDNN engine, so their memories, streams and primitives mix freely.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
    /// None: the process-wide count.
    threads: Option<usize>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("kind", &"cpu")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Engine {
    /// The CPU engine (index 0); its descriptors take the process-wide thread count.
    pub fn cpu(lib: &Library) -> Result<Self> {
        // SAFETY: no preconditions beyond the out-pointer `create!` passes.
        let raw = unsafe { create!(lib.api(), dnnl_engine_create(ffi::dnnl_cpu, 0)) }?;
        Ok(Self {
            inner: Arc::new(EngineInner {
                lib: lib.clone(),
                raw,
            }),
            threads: None,
        })
    }

    /// The same engine, with descriptors built through the result running on `threads` OpenMP
    /// threads whatever [`set_threads`] says. Zero threads, or more than OpenMP can count, are
    /// an error.
    pub fn with_threads(&self, threads: usize) -> Result<Self> {
        if threads == 0 || threads > MAX_THREADS {
            return Err(Error::new(
                "oneDNN Engine::with_threads",
                format!("{threads} threads; a count is in 1..={MAX_THREADS}"),
            ));
        }
        Ok(Self {
            inner: self.inner.clone(),
            threads: Some(threads),
        })
    }

    /// The OpenMP thread count a descriptor built on this handle now would record.
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(threads)
    }

    /// The library this engine came from.
    pub fn library(&self) -> &Library {
        &self.inner.lib
    }

    fn raw(&self) -> ffi::dnnl_engine_t {
        self.inner.raw
    }
}

/// An in-order execution stream. `Send` but not `Sync`: oneDNN streams must not be used from
/// two threads at once; give each thread its own.
pub struct Stream {
    engine: Engine,
    raw: ffi::dnnl_stream_t,
}

// SAFETY: a stream may move between threads; `Stream` is not `Sync`, so it is never used from
// two at once.
unsafe impl Send for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream").finish_non_exhaustive()
    }
}

impl Stream {
    /// A new in-order stream on `engine`.
    pub fn new(engine: &Engine) -> Result<Self> {
        // SAFETY: the engine is live and outlives the stream (held below).
        let raw = unsafe {
            create!(
                engine.library().api(),
                dnnl_stream_create(engine.raw(), ffi::dnnl_stream_default_flags)
            )
        }?;
        Ok(Self {
            engine: engine.clone(),
            raw,
        })
    }

    /// Waits until everything submitted to the stream has finished.
    pub fn wait(&self) -> Result<()> {
        // SAFETY: `raw` is a live stream, used from this thread only (`Stream: !Sync`).
        unsafe { call!(self.engine.library().api(), dnnl_stream_wait(self.raw)) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: `raw` came from dnnl_stream_create; nothing else refers to it.
        unsafe { (self.engine.library().api().dnnl_stream_destroy)(self.raw) };
    }
}

// ---------------------------------------------------------------------------------------------
// Enumerations

/// Element data types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    F16,
    BF16,
    F32,
    F64,
    S32,
    S8,
    U8,
}

impl DataType {
    fn raw(self) -> ffi::dnnl_data_type_t {
        match self {
            DataType::F16 => ffi::dnnl_f16,
            DataType::BF16 => ffi::dnnl_bf16,
            DataType::F32 => ffi::dnnl_f32,
            DataType::F64 => ffi::dnnl_f64,
            DataType::S32 => ffi::dnnl_s32,
            DataType::S8 => ffi::dnnl_s8,
            DataType::U8 => ffi::dnnl_u8,
        }
    }

    fn from_raw(raw: ffi::dnnl_data_type_t) -> Option<Self> {
        Some(match raw {
            ffi::dnnl_f16 => DataType::F16,
            ffi::dnnl_bf16 => DataType::BF16,
            ffi::dnnl_f32 => DataType::F32,
            ffi::dnnl_f64 => DataType::F64,
            ffi::dnnl_s32 => DataType::S32,
            ffi::dnnl_s8 => DataType::S8,
            ffi::dnnl_u8 => DataType::U8,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::S8 | DataType::U8 => 1,
            DataType::F16 | DataType::BF16 => 2,
            DataType::F32 | DataType::S32 => 4,
            DataType::F64 => 8,
        }
    }
}

/// A memory format tag: the physical order of the logical dimensions.
///
/// oneDNN's logical order is fixed: activations (N, C, H, W), weights (O, I, H, W); a tag names
/// the physical order, outermost first. The semantic names are aliases of the plain ones
/// (`NHWC` and `OHWI` are both `ACDB`), hence constants rather than an enum.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FormatTag(ffi::dnnl_format_tag_t);

impl FormatTag {
    /// Let the primitive choose (only for primitive-descriptor creation, not for memories).
    pub const ANY: Self = Self(ffi::dnnl_format_tag_any);
    pub const A: Self = Self(ffi::dnnl_a);
    pub const AB: Self = Self(ffi::dnnl_ab);
    pub const ABC: Self = Self(ffi::dnnl_abc);
    pub const ABCD: Self = Self(ffi::dnnl_abcd);
    pub const BA: Self = Self(ffi::dnnl_ba);
    pub const ACB: Self = Self(ffi::dnnl_acb);
    pub const ACDB: Self = Self(ffi::dnnl_acdb);
    pub const BACD: Self = Self(ffi::dnnl_bacd);
    pub const BCDA: Self = Self(ffi::dnnl_bcda);
    pub const CDBA: Self = Self(ffi::dnnl_cdba);
    /// 1-D: per-channel vectors (bias, BatchNorm scale, shift, mean, variance).
    pub const X: Self = Self(ffi::dnnl_x);
    pub const NC: Self = Self(ffi::dnnl_nc);
    pub const NCHW: Self = Self(ffi::dnnl_nchw);
    pub const NHWC: Self = Self(ffi::dnnl_nhwc);
    pub const OIHW: Self = Self(ffi::dnnl_oihw);
    pub const OHWI: Self = Self(ffi::dnnl_ohwi);
    pub const HWIO: Self = Self(ffi::dnnl_hwio);
    pub const IHWO: Self = Self(ffi::dnnl_ihwo);
    pub const IOHW: Self = Self(ffi::dnnl_iohw);
}

impl fmt::Debug for FormatTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FormatTag({})", self.0)
    }
}

/// Propagation kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prop {
    /// Forward, keeping what the backward pass needs (BatchNorm: batch statistics).
    ForwardTraining,
    /// Forward only (BatchNorm: given statistics).
    ForwardInference,
    /// Backward with respect to data and weights (BatchNorm: diff_src, diff scale and shift).
    Backward,
    /// Backward with respect to data only.
    BackwardData,
    /// Backward with respect to weights only.
    BackwardWeights,
}

impl Prop {
    fn raw(self) -> ffi::dnnl_prop_kind_t {
        match self {
            Prop::ForwardTraining => ffi::dnnl_forward_training,
            Prop::ForwardInference => ffi::dnnl_forward_inference,
            Prop::Backward => ffi::dnnl_backward,
            Prop::BackwardData => ffi::dnnl_backward_data,
            Prop::BackwardWeights => ffi::dnnl_backward_weights,
        }
    }
}

/// Element-wise algorithms (post-ops and eltwise primitives). `alpha` and `beta` mean what
/// oneDNN says per algorithm (e.g. ReLU's `alpha` is the negative slope).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Eltwise {
    Relu,
    Tanh,
    Logistic,
    GeluTanh,
    GeluErf,
    Elu,
    Swish,
    Linear,
    Clip,
    /// ReLU whose backward takes the forward's output instead of its input.
    ReluUseDst,
    /// Tanh whose backward takes the forward's output.
    TanhUseDst,
    /// Logistic whose backward takes the forward's output.
    LogisticUseDst,
}

impl Eltwise {
    fn raw(self) -> ffi::dnnl_alg_kind_t {
        match self {
            Eltwise::Relu => ffi::dnnl_eltwise_relu,
            Eltwise::Tanh => ffi::dnnl_eltwise_tanh,
            Eltwise::Logistic => ffi::dnnl_eltwise_logistic,
            Eltwise::GeluTanh => ffi::dnnl_eltwise_gelu_tanh,
            Eltwise::GeluErf => ffi::dnnl_eltwise_gelu_erf,
            Eltwise::Elu => ffi::dnnl_eltwise_elu,
            Eltwise::Swish => ffi::dnnl_eltwise_swish,
            Eltwise::Linear => ffi::dnnl_eltwise_linear,
            Eltwise::Clip => ffi::dnnl_eltwise_clip,
            Eltwise::ReluUseDst => ffi::dnnl_eltwise_relu_use_dst_for_bwd,
            Eltwise::TanhUseDst => ffi::dnnl_eltwise_tanh_use_dst_for_bwd,
            Eltwise::LogisticUseDst => ffi::dnnl_eltwise_logistic_use_dst_for_bwd,
        }
    }
}

/// Pooling algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pooling {
    Max,
    /// The divisor is the window's area, padded positions included (PyTorch's default).
    AvgIncludePadding,
    /// The divisor counts only the positions inside the input.
    AvgExcludePadding,
}

impl Pooling {
    fn raw(self) -> ffi::dnnl_alg_kind_t {
        match self {
            Pooling::Max => ffi::dnnl_pooling_max,
            Pooling::AvgIncludePadding => ffi::dnnl_pooling_avg_include_padding,
            Pooling::AvgExcludePadding => ffi::dnnl_pooling_avg_exclude_padding,
        }
    }
}

/// Batch-normalization flags, combined with `|`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NormFlags(u32);

impl NormFlags {
    pub const NONE: Self = Self(ffi::dnnl_normalization_flags_none);
    /// Use the given mean and variance instead of computing batch statistics.
    pub const USE_GLOBAL_STATS: Self = Self(ffi::dnnl_use_global_stats);
    /// Multiply by a per-channel scale (`arg::SCALE`).
    pub const USE_SCALE: Self = Self(ffi::dnnl_use_scale);
    /// Add a per-channel shift (`arg::SHIFT`).
    pub const USE_SHIFT: Self = Self(ffi::dnnl_use_shift);
    /// Apply ReLU to the output (the backward then needs `arg::WORKSPACE`).
    pub const FUSE_NORM_RELU: Self = Self(ffi::dnnl_fuse_norm_relu);
    /// Add `arg::SRC_1` and apply ReLU.
    pub const FUSE_NORM_ADD_RELU: Self = Self(ffi::dnnl_fuse_norm_add_relu);

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl std::ops::BitOr for NormFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// Memory-descriptor queries on a primitive descriptor (index 0 of each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Query {
    Src,
    DiffSrc,
    Weights,
    DiffWeights,
    Dst,
    DiffDst,
    Workspace,
    Scratchpad,
}

impl Query {
    fn raw(self) -> ffi::dnnl_query_t {
        match self {
            Query::Src => ffi::dnnl_query_src_md,
            Query::DiffSrc => ffi::dnnl_query_diff_src_md,
            Query::Weights => ffi::dnnl_query_weights_md,
            Query::DiffWeights => ffi::dnnl_query_diff_weights_md,
            Query::Dst => ffi::dnnl_query_dst_md,
            Query::DiffDst => ffi::dnnl_query_diff_dst_md,
            Query::Workspace => ffi::dnnl_query_workspace_md,
            Query::Scratchpad => ffi::dnnl_query_scratchpad_md,
        }
    }
}

/// An execution-argument index (`DNNL_ARG_*`), see [`arg`].
pub type Arg = c_int;

/// Execution-argument indices for [`Primitive::execute`].
pub mod arg {
    use super::{ffi, Arg};

    pub const SRC: Arg = ffi::DNNL_ARG_SRC;
    /// BatchNorm with `FUSE_NORM_ADD_RELU`: the added tensor.
    pub const SRC_1: Arg = ffi::DNNL_ARG_SRC_1;
    pub const DST: Arg = ffi::DNNL_ARG_DST;
    /// Reorder source (same index as `SRC`).
    pub const FROM: Arg = ffi::DNNL_ARG_FROM;
    /// Reorder destination (same index as `DST`).
    pub const TO: Arg = ffi::DNNL_ARG_TO;
    pub const WEIGHTS: Arg = ffi::DNNL_ARG_WEIGHTS;
    pub const BIAS: Arg = ffi::DNNL_ARG_BIAS;
    pub const MEAN: Arg = ffi::DNNL_ARG_MEAN;
    pub const VARIANCE: Arg = ffi::DNNL_ARG_VARIANCE;
    pub const SCALE: Arg = ffi::DNNL_ARG_SCALE;
    pub const SHIFT: Arg = ffi::DNNL_ARG_SHIFT;
    pub const WORKSPACE: Arg = ffi::DNNL_ARG_WORKSPACE;
    /// Supplied by [`super::Primitive`] itself; not accepted from callers.
    pub const SCRATCHPAD: Arg = ffi::DNNL_ARG_SCRATCHPAD;
    pub const DIFF_SRC: Arg = ffi::DNNL_ARG_DIFF_SRC;
    pub const DIFF_SRC_1: Arg = ffi::DNNL_ARG_DIFF_SRC_1;
    pub const DIFF_DST: Arg = ffi::DNNL_ARG_DIFF_DST;
    pub const DIFF_WEIGHTS: Arg = ffi::DNNL_ARG_DIFF_WEIGHTS;
    pub const DIFF_BIAS: Arg = ffi::DNNL_ARG_DIFF_BIAS;
    pub const DIFF_SCALE: Arg = ffi::DNNL_ARG_DIFF_SCALE;
    pub const DIFF_SHIFT: Arg = ffi::DNNL_ARG_DIFF_SHIFT;

    /// Every argument the primitives built by this layer can take, scratchpad aside (`FROM`
    /// and `TO` are `SRC` and `DST`).
    pub(super) const ALL: [Arg; 17] = [
        SRC,
        SRC_1,
        DST,
        WEIGHTS,
        BIAS,
        MEAN,
        VARIANCE,
        SCALE,
        SHIFT,
        WORKSPACE,
        DIFF_SRC,
        DIFF_SRC_1,
        DIFF_DST,
        DIFF_WEIGHTS,
        DIFF_BIAS,
        DIFF_SCALE,
        DIFF_SHIFT,
    ];
}

// ---------------------------------------------------------------------------------------------
// Memory descriptors

owned_handle! {
    /// A memory descriptor: logical dims, data type and physical layout. Immutable.
    pub struct MemoryDesc(ffi::dnnl_memory_desc_t) destroyed by dnnl_memory_desc_destroy;
}

/// Copies `values` into a `dnnl_dims_t`, refusing more than `DNNL_MAX_NDIMS`.
fn dims_array(what: &str, values: &[i64]) -> Result<ffi::dnnl_dims_t> {
    if values.len() > ffi::DNNL_MAX_NDIMS {
        return Err(Error::new(
            format!("oneDNN {what}"),
            format!(
                "{} dimensions; at most {} are supported",
                values.len(),
                ffi::DNNL_MAX_NDIMS
            ),
        ));
    }
    let mut out = [0; ffi::DNNL_MAX_NDIMS];
    out[..values.len()].copy_from_slice(values);
    Ok(out)
}

impl MemoryDesc {
    /// A descriptor of `dims` (logical order) laid out as `tag` says; `FormatTag::ANY` lets a
    /// primitive choose.
    pub fn new(lib: &Library, dims: &[i64], dtype: DataType, tag: FormatTag) -> Result<Self> {
        const CALL: &str = "dnnl_memory_desc_create_with_tag";
        let d = dims_array(CALL, dims)?;
        // SAFETY: `d` holds DNNL_MAX_NDIMS entries.
        let raw = unsafe {
            create!(
                lib.api(),
                dnnl_memory_desc_create_with_tag(
                    dims.len() as c_int,
                    d.as_ptr(),
                    dtype.raw(),
                    tag.0
                )
            )
        }?;
        Ok(Self {
            lib: lib.clone(),
            raw,
        })
    }

    /// A plain descriptor with explicit element strides per logical dimension.
    pub fn with_strides(
        lib: &Library,
        dims: &[i64],
        dtype: DataType,
        strides: &[i64],
    ) -> Result<Self> {
        const CALL: &str = "dnnl_memory_desc_create_with_strides";
        if strides.len() != dims.len() {
            return Err(Error::new(
                format!("oneDNN {CALL}"),
                format!("{} dims but {} strides", dims.len(), strides.len()),
            ));
        }
        let d = dims_array(CALL, dims)?;
        let s = dims_array(CALL, strides)?;
        // SAFETY: `d` and `s` hold DNNL_MAX_NDIMS entries.
        let raw = unsafe {
            create!(
                lib.api(),
                dnnl_memory_desc_create_with_strides(
                    dims.len() as c_int,
                    d.as_ptr(),
                    dtype.raw(),
                    s.as_ptr()
                )
            )
        }?;
        Ok(Self {
            lib: lib.clone(),
            raw,
        })
    }

    /// An owned copy of a descriptor the library lends (e.g. from a primitive descriptor).
    fn clone_raw(lib: &Library, md: ffi::const_dnnl_memory_desc_t) -> Result<Self> {
        const CALL: &str = "dnnl_memory_desc_clone";
        if md.is_null() {
            return Err(Error::new(
                format!("oneDNN {CALL}"),
                "null source descriptor",
            ));
        }
        // SAFETY: `md` is a live descriptor.
        let raw = unsafe { create!(lib.api(), dnnl_memory_desc_clone(md)) }?;
        Ok(Self {
            lib: lib.clone(),
            raw,
        })
    }

    /// A copy (a new library object; can fail, hence not `Clone`).
    pub fn try_clone(&self) -> Result<Self> {
        Self::clone_raw(&self.lib, self.raw)
    }

    /// Bytes a buffer for this descriptor needs (0 for a zero descriptor or `ANY` layout).
    pub fn size_bytes(&self) -> usize {
        // SAFETY: `raw` is live.
        unsafe { (self.lib.api().dnnl_memory_desc_get_size)(self.raw) }
    }

    fn query(&self, what: ffi::dnnl_query_t, result: *mut c_void) -> Result<()> {
        // SAFETY: `raw` is live; every caller passes a `result` of the type `what` writes.
        unsafe {
            call!(
                self.lib.api(),
                dnnl_memory_desc_query(self.raw, what, result)
            )
        }
    }

    /// Number of logical dimensions (0 for the zero descriptor of an unused argument).
    pub fn ndims(&self) -> usize {
        let mut n: c_int = 0;
        match self.query(ffi::dnnl_query_ndims_s32, (&mut n as *mut c_int).cast()) {
            Ok(()) => n.max(0) as usize,
            Err(_) => 0,
        }
    }

    /// Whether this is the zero descriptor (an argument a primitive does not use).
    pub fn is_zero(&self) -> bool {
        self.ndims() == 0
    }

    /// Reads one of the `dnnl_dims_t`-valued queries (`dims`, `strides`, ...).
    fn query_dims(&self, what: ffi::dnnl_query_t) -> Result<Vec<i64>> {
        let n = self.ndims().min(ffi::DNNL_MAX_NDIMS);
        // The query writes a pointer to the descriptor's own `dnnl_dims_t` (see dnnl.hpp's
        // `query_dims`).
        let mut p: *const ffi::dnnl_dims_t = ptr::null();
        self.query(what, (&mut p as *mut *const ffi::dnnl_dims_t).cast())?;
        // SAFETY: on success `p` points to DNNL_MAX_NDIMS entries inside the live descriptor.
        match unsafe { p.as_ref() } {
            Some(dims) => Ok(dims[..n].to_vec()),
            None => Err(Error::new(
                "oneDNN dnnl_memory_desc_query",
                "returned a null dims array",
            )),
        }
    }

    /// Logical dimensions.
    pub fn dims(&self) -> Result<Vec<i64>> {
        self.query_dims(ffi::dnnl_query_dims)
    }

    /// Element strides of the outermost blocks (per logical dimension); fails for a layout that
    /// is not blocked (`ANY`, opaque).
    pub fn strides(&self) -> Result<Vec<i64>> {
        self.query_dims(ffi::dnnl_query_strides)
    }

    /// Number of inner blocks (0 for a plain strided layout; blocked layouts chosen by a
    /// primitive have some).
    pub fn inner_blocks(&self) -> Result<usize> {
        let mut n: c_int = 0;
        self.query(
            ffi::dnnl_query_inner_nblks_s32,
            (&mut n as *mut c_int).cast(),
        )?;
        Ok(n.max(0) as usize)
    }

    /// Element data type.
    pub fn data_type(&self) -> Result<DataType> {
        let mut t: ffi::dnnl_data_type_t = ffi::dnnl_data_type_undef;
        self.query(
            ffi::dnnl_query_data_type,
            (&mut t as *mut ffi::dnnl_data_type_t).cast(),
        )?;
        DataType::from_raw(t).ok_or_else(|| {
            Error::new(
                "oneDNN dnnl_memory_desc_query",
                format!("unsupported data type {t}"),
            )
        })
    }
}

impl PartialEq for MemoryDesc {
    /// oneDNN's own comparison: equal descriptors need no reorder between them.
    fn eq(&self, other: &Self) -> bool {
        // SAFETY: both descriptors are live.
        unsafe { (self.lib.api().dnnl_memory_desc_equal)(self.raw, other.raw) != 0 }
    }
}

impl fmt::Debug for MemoryDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryDesc")
            .field("dims", &self.dims().unwrap_or_default())
            .field("data_type", &self.data_type().ok())
            .field("strides", &self.strides().ok())
            .field("inner_blocks", &self.inner_blocks().ok())
            .field("size_bytes", &self.size_bytes())
            .finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Memory

/// Element types [`Memory::write`] and [`Memory::read`] copy: plain data, every bit pattern
/// valid.
pub trait Plain: Copy + Default + sealed::Sealed {
    /// The oneDNN data type of this element type.
    const DATA_TYPE: DataType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! plain {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {
            const DATA_TYPE: DataType = DataType::$d;
        }
    )*};
}

plain!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i32 => S32, i8 => S8, u8 => U8);

/// A memory object: a descriptor plus a buffer that is either owned by the library or lent by
/// the caller (see the module docs). `Send`, not `Sync`.
pub struct Memory {
    engine: Engine,
    desc: MemoryDesc,
    raw: ffi::dnnl_memory_t,
    /// The bound buffer (null: none).
    handle: *mut c_void,
    /// Whether the library allocated `handle` (then it is never replaced).
    owned: bool,
}

// SAFETY: the memory object and its buffer may move between threads; a lent buffer's validity
// is the caller's promise from `set_data_handle`, independent of the thread.
unsafe impl Send for Memory {}

impl fmt::Debug for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memory")
            .field("desc", &self.desc)
            .field("bound", &!self.handle.is_null())
            .field("owned", &self.owned)
            .finish()
    }
}

impl Memory {
    fn create(engine: &Engine, desc: &MemoryDesc, handle: *mut c_void) -> Result<Self> {
        let desc = desc.try_clone()?;
        let api = engine.library().api();
        // SAFETY: the descriptor and engine are live; `handle` is NONE or ALLOCATE.
        let raw = unsafe { create!(api, dnnl_memory_create(desc.raw, engine.raw(), handle)) }?;
        let mut memory = Self {
            engine: engine.clone(),
            desc,
            raw,
            handle: ptr::null_mut(),
            owned: handle == ffi::DNNL_MEMORY_ALLOCATE,
        };
        let mut actual = ptr::null_mut();
        // SAFETY: `raw` is live; `actual` is a valid out-pointer.
        unsafe { call!(api, dnnl_memory_get_data_handle(memory.raw, &mut actual)) }?;
        memory.handle = actual;
        Ok(memory)
    }

    /// Memory with a zeroed buffer the library allocates and frees.
    pub fn allocate(engine: &Engine, desc: &MemoryDesc) -> Result<Self> {
        let memory = Self::create(engine, desc, ffi::DNNL_MEMORY_ALLOCATE)?;
        let size = memory.desc.size_bytes();
        if size > 0 {
            if memory.handle.is_null() {
                return Err(null_handle("dnnl_memory_create"));
            }
            // SAFETY: the library allocated `size` bytes at `handle` for this memory alone.
            // Zeroed so that reading before any write never sees uninitialized bytes.
            unsafe { ptr::write_bytes(memory.handle.cast::<u8>(), 0, size) };
        }
        Ok(memory)
    }

    /// Memory without a buffer; bind one with [`Memory::set_data_handle`] before executing.
    pub fn unbound(engine: &Engine, desc: &MemoryDesc) -> Result<Self> {
        Self::create(engine, desc, ffi::DNNL_MEMORY_NONE)
    }

    /// Lends `ptr` as this memory's buffer, replacing any previous one.
    ///
    /// # Safety
    /// `ptr` must be aligned for the element type and valid for reads and writes of
    /// `self.desc().size_bytes()` bytes for as long as it stays bound (until it is replaced,
    /// [`Memory::unbind`] is called or the memory is dropped) and any primitive executing with
    /// this memory may read or write it; during such an execution no Rust reference may alias
    /// the bytes the primitive writes.
    pub unsafe fn set_data_handle(&mut self, ptr: *mut c_void) -> Result<()> {
        const CALL: &str = "dnnl_memory_set_data_handle";
        if self.owned {
            return Err(Error::new(
                format!("oneDNN {CALL}"),
                "this memory owns a library-allocated buffer; use Memory::unbound for lent buffers",
            ));
        }
        // Element sizes are powers of two.
        let align = self.desc.data_type().map(DataType::size).unwrap_or(1);
        if (ptr as usize) & (align - 1) != 0 {
            return Err(Error::new(
                format!("oneDNN {CALL}"),
                format!("pointer {ptr:p} is not aligned to {align} bytes"),
            ));
        }
        // SAFETY: `raw` is live and not shared with another thread (`Memory: !Sync`).
        unsafe {
            call!(
                self.engine.library().api(),
                dnnl_memory_set_data_handle(self.raw, ptr)
            )
        }?;
        self.handle = ptr;
        Ok(())
    }

    /// Forgets a lent buffer, so that nothing can reach it through this memory any more.
    pub fn unbind(&mut self) -> Result<()> {
        if self.owned {
            return Ok(());
        }
        // SAFETY: a null handle is always valid and leaves the memory unbound.
        unsafe { self.set_data_handle(ffi::DNNL_MEMORY_NONE) }
    }

    /// The bound buffer, or null.
    pub fn data_handle(&self) -> *mut c_void {
        self.handle
    }

    /// Whether a buffer is bound (always, for allocated memory).
    pub fn is_bound(&self) -> bool {
        !self.handle.is_null() || self.desc.size_bytes() == 0
    }

    /// This memory's descriptor.
    pub fn desc(&self) -> &MemoryDesc {
        &self.desc
    }

    /// Checks that `len` elements of `T` are exactly this memory's buffer.
    fn check_buffer<T: Plain>(&self, len: usize, call: &str) -> Result<()> {
        let dtype = self.desc.data_type()?;
        let size = self.desc.size_bytes();
        if T::DATA_TYPE != dtype {
            return Err(Error::new(
                format!("oneDNN memory {call}"),
                format!("memory holds {dtype:?}, not {:?}", T::DATA_TYPE),
            ));
        }
        if len * std::mem::size_of::<T>() != size {
            return Err(Error::new(
                format!("oneDNN memory {call}"),
                format!(
                    "{len} elements for a {size}-byte buffer (the buffer's physical layout, \
                     padding included, is copied as is)"
                ),
            ));
        }
        if size > 0 && self.handle.is_null() {
            return Err(Error::new(
                format!("oneDNN memory {call}"),
                "no buffer is bound",
            ));
        }
        Ok(())
    }

    /// Copies `src` into the buffer, in its physical order.
    pub fn write<T: Plain>(&mut self, src: &[T]) -> Result<()> {
        self.check_buffer::<T>(src.len(), "write")?;
        if !src.is_empty() {
            // SAFETY: the buffer is bound and holds exactly `src.len()` elements of `T`
            // (checked); `&mut self` excludes other users of it through this memory.
            unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.handle.cast::<T>(), src.len()) };
        }
        Ok(())
    }

    /// Copies the buffer, in its physical order, into `dst`.
    pub fn read<T: Plain>(&self, dst: &mut [T]) -> Result<()> {
        self.check_buffer::<T>(dst.len(), "read")?;
        if !dst.is_empty() {
            // SAFETY: the buffer is bound and holds exactly `dst.len()` initialized elements of
            // `T` (checked; allocated buffers start zeroed, every bit pattern of `T` is valid).
            unsafe {
                ptr::copy_nonoverlapping(self.handle.cast::<T>(), dst.as_mut_ptr(), dst.len())
            };
        }
        Ok(())
    }

    /// The buffer's contents, in its physical order.
    pub fn to_vec<T: Plain>(&self) -> Result<Vec<T>> {
        let dtype = self.desc.data_type()?;
        let n = self.desc.size_bytes() / dtype.size().max(1);
        let mut out = vec![T::default(); n];
        self.read(&mut out)?;
        Ok(out)
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: `raw` is owned here; destroying it frees a library-allocated buffer and
        // never touches a lent one.
        unsafe { (self.engine.library().api().dnnl_memory_destroy)(self.raw) };
    }
}

// ---------------------------------------------------------------------------------------------
// Attributes

owned_handle! {
    /// A list of operations fused after a primitive's main computation. Changed only through
    /// `&mut self`.
    pub struct PostOps(ffi::dnnl_post_ops_t) destroyed by dnnl_post_ops_destroy;
}

impl PostOps {
    /// An empty list.
    pub fn new(lib: &Library) -> Result<Self> {
        // SAFETY: no preconditions beyond the out-pointer `create!` passes.
        let raw = unsafe { create!(lib.api(), dnnl_post_ops_create()) }?;
        Ok(Self {
            lib: lib.clone(),
            raw,
        })
    }

    /// Appends an element-wise operation.
    pub fn append_eltwise(&mut self, alg: Eltwise, alpha: f32, beta: f32) -> Result<()> {
        // SAFETY: `raw` is live and exclusively borrowed.
        unsafe {
            call!(
                self.lib.api(),
                dnnl_post_ops_append_eltwise(self.raw, alg.raw(), alpha, beta)
            )
        }
    }
}

impl fmt::Debug for PostOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostOps").finish_non_exhaustive()
    }
}

owned_handle! {
    /// Primitive attributes. Always in the user scratchpad mode (see the module docs on thread
    /// safety); the builders copy them, so one `Attr` can serve many descriptors. Changed only
    /// through `&mut self`.
    pub struct Attr(ffi::dnnl_primitive_attr_t) destroyed by dnnl_primitive_attr_destroy;
}

impl Attr {
    /// Default attributes (no post-ops), user scratchpad mode.
    pub fn new(lib: &Library) -> Result<Self> {
        // SAFETY: no preconditions beyond the out-pointer `create!` passes.
        let raw = unsafe { create!(lib.api(), dnnl_primitive_attr_create()) }?;
        let attr = Self {
            lib: lib.clone(),
            raw,
        };
        // SAFETY: `raw` is live and owned.
        unsafe {
            call!(
                lib.api(),
                dnnl_primitive_attr_set_scratchpad_mode(attr.raw, ffi::dnnl_scratchpad_mode_user)
            )
        }?;
        Ok(attr)
    }

    /// Attributes with one element-wise post-op (e.g. a fused activation).
    pub fn with_eltwise(lib: &Library, alg: Eltwise, alpha: f32, beta: f32) -> Result<Self> {
        let mut post_ops = PostOps::new(lib)?;
        post_ops.append_eltwise(alg, alpha, beta)?;
        let mut attr = Self::new(lib)?;
        attr.set_post_ops(&post_ops)?;
        Ok(attr)
    }

    /// Sets the post-ops (copied: `post_ops` may be dropped afterwards).
    pub fn set_post_ops(&mut self, post_ops: &PostOps) -> Result<()> {
        // SAFETY: both are live; `self.raw` is exclusively borrowed.
        unsafe {
            call!(
                self.lib.api(),
                dnnl_primitive_attr_set_post_ops(self.raw, post_ops.raw)
            )
        }
    }
}

impl fmt::Debug for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attr").finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------------
// Primitive descriptors

struct PdInner {
    engine: Engine,
    raw: ffi::dnnl_primitive_desc_t,
    /// What it computes, for error messages (e.g. "convolution forward").
    name: &'static str,
    /// The OpenMP thread count it was created with, applied again for its primitive.
    threads: usize,
    /// The forward descriptor a backward one was built with: oneDNN may keep a pointer to it.
    _hint: Option<PrimitiveDesc>,
}

// SAFETY: a primitive descriptor is immutable after creation; queries only read it.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: `raw` is owned here; descriptors built with it as hint hold a clone of it.
        unsafe { (self.engine.library().api().dnnl_primitive_desc_destroy)(self.raw) };
    }
}

/// A primitive descriptor: an operation with its shapes and the implementation oneDNN chose
/// (query the layouts it wants with [`PrimitiveDesc::query_md`]). Cheap to clone (shared).
#[derive(Clone)]
pub struct PrimitiveDesc(Arc<PdInner>);

impl fmt::Debug for PrimitiveDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrimitiveDesc")
            .field("name", &self.0.name)
            .field("impl", &self.impl_info().unwrap_or_default())
            .finish()
    }
}

impl PrimitiveDesc {
    /// Runs a `*_primitive_desc_create` call (`f`, through `create!`) with the engine's thread
    /// count applied, since oneDNN picks its work split here, and wraps the result.
    fn create(
        engine: &Engine,
        name: &'static str,
        hint: Option<&PrimitiveDesc>,
        f: impl FnOnce(&ffi::Api) -> Result<ffi::dnnl_primitive_desc_t>,
    ) -> Result<Self> {
        let lib = engine.library();
        let threads = engine.threads();
        lib.apply_threads(threads);
        let raw = f(lib.api())?;
        Ok(Self(Arc::new(PdInner {
            engine: engine.clone(),
            raw,
            name,
            threads,
            _hint: hint.cloned(),
        })))
    }

    fn lib(&self) -> &Library {
        self.0.engine.library()
    }

    /// The engine it was built on.
    pub fn engine(&self) -> &Engine {
        &self.0.engine
    }

    /// What it computes (e.g. "convolution forward").
    pub fn name(&self) -> &'static str {
        self.0.name
    }

    /// The OpenMP thread count it was built with, applied before each execution (see the
    /// module docs on threads).
    pub fn threads(&self) -> usize {
        self.0.threads
    }

    fn md(&self, what: ffi::dnnl_query_t, index: c_int) -> Result<MemoryDesc> {
        // SAFETY: `raw` is live; the result is borrowed from it and cloned right away.
        let md =
            unsafe { (self.lib().api().dnnl_primitive_desc_query_md)(self.0.raw, what, index) };
        if md.is_null() {
            return Err(Error::new(
                "oneDNN dnnl_primitive_desc_query_md",
                format!("{}: query {what} index {index} failed", self.0.name),
            ));
        }
        MemoryDesc::clone_raw(self.lib(), md)
    }

    /// The descriptor the primitive uses for `what` (a zero descriptor if it has none).
    pub fn query_md(&self, what: Query) -> Result<MemoryDesc> {
        self.md(what.raw(), 0)
    }

    /// The descriptor of execution argument `arg` (a zero descriptor if it is not used).
    pub fn exec_arg_md(&self, arg: Arg) -> Result<MemoryDesc> {
        self.md(ffi::dnnl_query_exec_arg_md, arg)
    }

    /// The implementation oneDNN chose (e.g. "brg:avx2", "gemm:jit", "ref:any").
    pub fn impl_info(&self) -> Result<String> {
        let mut s: *const std::os::raw::c_char = ptr::null();
        // SAFETY: the impl-info query writes a `const char *` owned by the descriptor.
        unsafe {
            call!(
                self.lib().api(),
                dnnl_primitive_desc_query(
                    self.0.raw,
                    ffi::dnnl_query_impl_info_str,
                    0,
                    (&mut s as *mut *const std::os::raw::c_char).cast(),
                )
            )
        }?;
        if s.is_null() {
            return Ok(String::new());
        }
        // SAFETY: a NUL-terminated string alive as long as the descriptor.
        Ok(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
    }
}

/// 2-D spatial parameters as `dnnl_dims_t`.
fn spatial(v: [i64; 2]) -> ffi::dnnl_dims_t {
    let mut out = [0; ffi::DNNL_MAX_NDIMS];
    out[..2].copy_from_slice(&v);
    out
}

/// A pointer to an optional descriptor (null: none).
fn opt_md(md: Option<&MemoryDesc>) -> ffi::const_dnnl_memory_desc_t {
    md.map_or(ptr::null(), |m| m.raw)
}

/// A 2-D convolution, forward. Descriptors use logical dims: `src` and `dst` (N, C, H, W),
/// `weights` (OC, IC, KH, KW) (pass `FormatTag::ANY` for the layout the kernel prefers, then
/// reorder into [`Query::Weights`]), `bias` (OC). Direct algorithm: `auto` may pick Winograd,
/// which trades accuracy for speed. `padding_l`/`padding_r` are (top, left) and
/// (bottom, right).
#[allow(clippy::too_many_arguments)]
pub fn conv_forward(
    engine: &Engine,
    prop: Prop,
    src: &MemoryDesc,
    weights: &MemoryDesc,
    bias: Option<&MemoryDesc>,
    dst: &MemoryDesc,
    strides: [i64; 2],
    padding_l: [i64; 2],
    padding_r: [i64; 2],
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    let (s, pl, pr) = (spatial(strides), spatial(padding_l), spatial(padding_r));
    PrimitiveDesc::create(engine, "convolution forward", None, |api| {
        // SAFETY: every descriptor and the attr are live; the dims arrays hold
        // DNNL_MAX_NDIMS entries; null dilations mean none, as in dnnl.hpp.
        unsafe {
            create!(
                api,
                dnnl_convolution_forward_primitive_desc_create(
                    engine.raw(),
                    prop.raw(),
                    ffi::dnnl_convolution_direct,
                    src.raw,
                    weights.raw,
                    opt_md(bias),
                    dst.raw,
                    s.as_ptr(),
                    ptr::null(),
                    pl.as_ptr(),
                    pr.as_ptr(),
                    attr.raw,
                )
            )
        }
    })
}

/// A 2-D convolution's gradient with respect to its input, given the forward descriptor
/// `hint` (which oneDNN uses to pick a matching implementation; kept alive by the result).
#[allow(clippy::too_many_arguments)]
pub fn conv_backward_data(
    engine: &Engine,
    diff_src: &MemoryDesc,
    weights: &MemoryDesc,
    diff_dst: &MemoryDesc,
    strides: [i64; 2],
    padding_l: [i64; 2],
    padding_r: [i64; 2],
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    let (s, pl, pr) = (spatial(strides), spatial(padding_l), spatial(padding_r));
    PrimitiveDesc::create(engine, "convolution backward data", Some(hint), |api| {
        // SAFETY: as in `conv_forward`; `hint` is a live forward descriptor.
        unsafe {
            create!(
                api,
                dnnl_convolution_backward_data_primitive_desc_create(
                    engine.raw(),
                    ffi::dnnl_convolution_direct,
                    diff_src.raw,
                    weights.raw,
                    diff_dst.raw,
                    s.as_ptr(),
                    ptr::null(),
                    pl.as_ptr(),
                    pr.as_ptr(),
                    hint.0.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// A 2-D convolution's gradient with respect to its weights (and bias, if `diff_bias`), given
/// the forward descriptor `hint`.
#[allow(clippy::too_many_arguments)]
pub fn conv_backward_weights(
    engine: &Engine,
    src: &MemoryDesc,
    diff_weights: &MemoryDesc,
    diff_bias: Option<&MemoryDesc>,
    diff_dst: &MemoryDesc,
    strides: [i64; 2],
    padding_l: [i64; 2],
    padding_r: [i64; 2],
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    let (s, pl, pr) = (spatial(strides), spatial(padding_l), spatial(padding_r));
    PrimitiveDesc::create(engine, "convolution backward weights", Some(hint), |api| {
        // SAFETY: as in `conv_backward_data`.
        unsafe {
            create!(
                api,
                dnnl_convolution_backward_weights_primitive_desc_create(
                    engine.raw(),
                    ffi::dnnl_convolution_direct,
                    src.raw,
                    diff_weights.raw,
                    opt_md(diff_bias),
                    diff_dst.raw,
                    s.as_ptr(),
                    ptr::null(),
                    pl.as_ptr(),
                    pr.as_ptr(),
                    hint.0.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// An inner product (a dense layer), forward: `src` (N, C) or (N, C, H, W), `weights` (OC, C)
/// or (OC, C, H, W) (`FormatTag::ANY`: the layout the kernel prefers), `bias` (OC), `dst`
/// (N, OC).
pub fn inner_product_forward(
    engine: &Engine,
    prop: Prop,
    src: &MemoryDesc,
    weights: &MemoryDesc,
    bias: Option<&MemoryDesc>,
    dst: &MemoryDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(engine, "inner product forward", None, |api| {
        // SAFETY: every descriptor and the attr are live (a null bias: none).
        unsafe {
            create!(
                api,
                dnnl_inner_product_forward_primitive_desc_create(
                    engine.raw(),
                    prop.raw(),
                    src.raw,
                    weights.raw,
                    opt_md(bias),
                    dst.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// An inner product's gradient with respect to its input, given the forward descriptor `hint`.
pub fn inner_product_backward_data(
    engine: &Engine,
    diff_src: &MemoryDesc,
    weights: &MemoryDesc,
    diff_dst: &MemoryDesc,
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(engine, "inner product backward data", Some(hint), |api| {
        // SAFETY: every descriptor, the hint and the attr are live.
        unsafe {
            create!(
                api,
                dnnl_inner_product_backward_data_primitive_desc_create(
                    engine.raw(),
                    diff_src.raw,
                    weights.raw,
                    diff_dst.raw,
                    hint.0.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// An inner product's gradient with respect to its weights (and bias, if `diff_bias`), given
/// the forward descriptor `hint`.
pub fn inner_product_backward_weights(
    engine: &Engine,
    src: &MemoryDesc,
    diff_weights: &MemoryDesc,
    diff_bias: Option<&MemoryDesc>,
    diff_dst: &MemoryDesc,
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(
        engine,
        "inner product backward weights",
        Some(hint),
        |api| {
            // SAFETY: every descriptor, the hint and the attr are live (a null bias: none).
            unsafe {
                create!(
                    api,
                    dnnl_inner_product_backward_weights_primitive_desc_create(
                        engine.raw(),
                        src.raw,
                        diff_weights.raw,
                        opt_md(diff_bias),
                        diff_dst.raw,
                        hint.0.raw,
                        attr.raw,
                    )
                )
            }
        },
    )
}

/// Batch normalization, forward. `ForwardTraining` computes batch statistics into
/// `arg::MEAN`/`arg::VARIANCE` (unless `USE_GLOBAL_STATS`); `ForwardInference` with
/// `USE_GLOBAL_STATS` takes them as inputs.
pub fn batch_norm_forward(
    engine: &Engine,
    prop: Prop,
    src: &MemoryDesc,
    dst: &MemoryDesc,
    epsilon: f32,
    flags: NormFlags,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(engine, "batch normalization forward", None, |api| {
        // SAFETY: every descriptor and the attr are live.
        unsafe {
            create!(
                api,
                dnnl_batch_normalization_forward_primitive_desc_create(
                    engine.raw(),
                    prop.raw(),
                    src.raw,
                    dst.raw,
                    epsilon,
                    flags.0,
                    attr.raw,
                )
            )
        }
    })
}

/// Batch normalization, backward (`Prop::Backward`: also the scale and shift gradients;
/// `Prop::BackwardData`: only `diff_src`), given the forward descriptor `hint`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    engine: &Engine,
    prop: Prop,
    diff_src: &MemoryDesc,
    diff_dst: &MemoryDesc,
    src: &MemoryDesc,
    epsilon: f32,
    flags: NormFlags,
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(engine, "batch normalization backward", Some(hint), |api| {
        // SAFETY: every descriptor, the hint and the attr are live.
        unsafe {
            create!(
                api,
                dnnl_batch_normalization_backward_primitive_desc_create(
                    engine.raw(),
                    prop.raw(),
                    diff_src.raw,
                    diff_dst.raw,
                    src.raw,
                    epsilon,
                    flags.0,
                    hint.0.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// An element-wise operation, forward.
#[allow(clippy::too_many_arguments)]
pub fn eltwise_forward(
    engine: &Engine,
    prop: Prop,
    alg: Eltwise,
    src: &MemoryDesc,
    dst: &MemoryDesc,
    alpha: f32,
    beta: f32,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(engine, "eltwise forward", None, |api| {
        // SAFETY: every descriptor and the attr are live.
        unsafe {
            create!(
                api,
                dnnl_eltwise_forward_primitive_desc_create(
                    engine.raw(),
                    prop.raw(),
                    alg.raw(),
                    src.raw,
                    dst.raw,
                    alpha,
                    beta,
                    attr.raw,
                )
            )
        }
    })
}

/// An element-wise operation, backward. `data` is the forward's source, or its destination
/// for the `*UseDst` algorithms.
#[allow(clippy::too_many_arguments)]
pub fn eltwise_backward(
    engine: &Engine,
    alg: Eltwise,
    diff_src: &MemoryDesc,
    diff_dst: &MemoryDesc,
    data: &MemoryDesc,
    alpha: f32,
    beta: f32,
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    PrimitiveDesc::create(engine, "eltwise backward", Some(hint), |api| {
        // SAFETY: every descriptor, the hint and the attr are live.
        unsafe {
            create!(
                api,
                dnnl_eltwise_backward_primitive_desc_create(
                    engine.raw(),
                    alg.raw(),
                    diff_src.raw,
                    diff_dst.raw,
                    data.raw,
                    alpha,
                    beta,
                    hint.0.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// A 2-D pooling, forward. `src` and `dst` use logical dims (N, C, H, W); `padding_l` and
/// `padding_r` are (top, left) and (bottom, right). Max-pooling's training forward has a
/// workspace (query [`Query::Workspace`]) that its backward takes.
#[allow(clippy::too_many_arguments)]
pub fn pool_forward(
    engine: &Engine,
    prop: Prop,
    alg: Pooling,
    src: &MemoryDesc,
    dst: &MemoryDesc,
    strides: [i64; 2],
    kernel: [i64; 2],
    padding_l: [i64; 2],
    padding_r: [i64; 2],
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    let (s, k, d) = (spatial(strides), spatial(kernel), spatial([0, 0]));
    let (pl, pr) = (spatial(padding_l), spatial(padding_r));
    PrimitiveDesc::create(engine, "pooling forward", None, |api| {
        // SAFETY: every descriptor and the attr are live; the dims arrays hold
        // DNNL_MAX_NDIMS entries (zero dilation: none).
        unsafe {
            create!(
                api,
                dnnl_pooling_forward_primitive_desc_create(
                    engine.raw(),
                    prop.raw(),
                    alg.raw(),
                    src.raw,
                    dst.raw,
                    s.as_ptr(),
                    k.as_ptr(),
                    d.as_ptr(),
                    pl.as_ptr(),
                    pr.as_ptr(),
                    attr.raw,
                )
            )
        }
    })
}

/// A 2-D pooling's gradient with respect to its input, given the forward descriptor `hint`.
#[allow(clippy::too_many_arguments)]
pub fn pool_backward(
    engine: &Engine,
    alg: Pooling,
    diff_src: &MemoryDesc,
    diff_dst: &MemoryDesc,
    strides: [i64; 2],
    kernel: [i64; 2],
    padding_l: [i64; 2],
    padding_r: [i64; 2],
    hint: &PrimitiveDesc,
    attr: &Attr,
) -> Result<PrimitiveDesc> {
    let (s, k, d) = (spatial(strides), spatial(kernel), spatial([0, 0]));
    let (pl, pr) = (spatial(padding_l), spatial(padding_r));
    PrimitiveDesc::create(engine, "pooling backward", Some(hint), |api| {
        // SAFETY: as in `pool_forward`; `hint` is a live forward descriptor.
        unsafe {
            create!(
                api,
                dnnl_pooling_backward_primitive_desc_create(
                    engine.raw(),
                    alg.raw(),
                    diff_src.raw,
                    diff_dst.raw,
                    s.as_ptr(),
                    k.as_ptr(),
                    d.as_ptr(),
                    pl.as_ptr(),
                    pr.as_ptr(),
                    hint.0.raw,
                    attr.raw,
                )
            )
        }
    })
}

/// A copy between two layouts (or data types) of the same logical tensor, on one engine.
pub fn reorder(engine: &Engine, from: &MemoryDesc, to: &MemoryDesc) -> Result<PrimitiveDesc> {
    let attr = Attr::new(engine.library())?;
    PrimitiveDesc::create(engine, "reorder", None, |api| {
        // SAFETY: both descriptors and the attr are live; one engine on both sides.
        unsafe {
            create!(
                api,
                dnnl_reorder_primitive_desc_create(
                    from.raw,
                    engine.raw(),
                    to.raw,
                    engine.raw(),
                    attr.raw,
                )
            )
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Primitives

/// Most arguments one execution can pass (the largest primitive here takes about ten).
const MAX_ARGS: usize = 24;

/// An executable primitive, with its own scratchpad. `Send + Sync`: executions from several
/// threads are allowed (each on its own stream, all on the primitive's engine); executions of
/// one primitive take turns on its scratchpad.
pub struct Primitive {
    pd: PrimitiveDesc,
    raw: ffi::dnnl_primitive_t,
    /// The arguments the primitive accepts, with the descriptors it expects.
    args: Vec<(Arg, MemoryDesc)>,
    /// The user-mode scratchpad (None: the primitive needs none).
    scratchpad: Mutex<Option<Memory>>,
}

// SAFETY: oneDNN primitives are thread-safe to execute when the scratchpad is the user's (it
// is: `Attr` sets user mode and every descriptor here is built with one); the scratchpad is
// behind a mutex.
unsafe impl Send for Primitive {}
// SAFETY: as above.
unsafe impl Sync for Primitive {}

impl fmt::Debug for Primitive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Primitive")
            .field("pd", &self.pd)
            .field(
                "args",
                &self.args.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Primitive {
    /// Creates the primitive (JIT code generation happens here: do it once per layer).
    pub fn new(pd: &PrimitiveDesc) -> Result<Self> {
        let lib = pd.lib();
        let mut args = Vec::new();
        for a in arg::ALL {
            let md = pd.exec_arg_md(a)?;
            if !md.is_zero() {
                args.push((a, md));
            }
        }
        let scratch_md = pd.query_md(Query::Scratchpad)?;
        let scratchpad = if scratch_md.size_bytes() > 0 {
            Some(Memory::allocate(pd.engine(), &scratch_md)?)
        } else {
            None
        };
        lib.apply_threads(pd.threads());
        // SAFETY: the descriptor is live.
        let raw = unsafe { create!(lib.api(), dnnl_primitive_create(pd.0.raw)) }?;
        Ok(Self {
            pd: pd.clone(),
            raw,
            args,
            scratchpad: Mutex::new(scratchpad),
        })
    }

    /// Its descriptor.
    pub fn desc(&self) -> &PrimitiveDesc {
        &self.pd
    }

    /// The arguments [`Primitive::execute`] accepts, with the descriptors it expects: those
    /// with a non-zero descriptor in the primitive descriptor (`exec_arg_md`). A few may go
    /// unused (e.g. `SHIFT` in a BatchNorm backward); oneDNN ignores them if given.
    pub fn accepted_args(&self) -> &[(Arg, MemoryDesc)] {
        &self.args
    }

    /// Executes on `stream` with `args`; the scratchpad is added here.
    ///
    /// Refused here, before oneDNN sees them: an argument given twice, one the primitive does
    /// not accept, a memory whose descriptor differs from the expected one, an unbound memory,
    /// a stream or memory on another engine. oneDNN itself counts the inputs and outputs it
    /// uses and fails with `invalid_arguments (2)` when one is missing. On a CPU stream this
    /// returns once the computation is done; [`Stream::wait`] makes that explicit.
    pub fn execute(&self, stream: &Stream, args: &[(Arg, &Memory)]) -> Result<()> {
        let op = || format!("oneDNN {} execute", self.pd.0.name);
        let engine = self.pd.engine().raw();
        if stream.engine.raw() != engine {
            return Err(Error::new(
                op(),
                "the stream is on another engine than the primitive",
            ));
        }
        if args.len() >= MAX_ARGS {
            return Err(Error::new(op(), format!("{} arguments", args.len())));
        }
        for (i, (a, memory)) in args.iter().enumerate() {
            if args[..i].iter().any(|(b, _)| b == a) {
                return Err(Error::new(op(), format!("argument {a} given twice")));
            }
            let Some((_, expected)) = self.args.iter().find(|(b, _)| b == a) else {
                return Err(Error::new(
                    op(),
                    format!("argument {a} is not one this primitive takes"),
                ));
            };
            if memory.desc() != expected {
                return Err(Error::new(
                    op(),
                    format!(
                        "argument {a}: memory is {:?}, the primitive expects {:?} \
                         (reorder into the layout `query_md`/`exec_arg_md` gives)",
                        memory.desc(),
                        expected
                    ),
                ));
            }
            if !memory.is_bound() {
                return Err(Error::new(
                    op(),
                    format!("argument {a}: no buffer is bound"),
                ));
            }
            if memory.engine.raw() != engine {
                return Err(Error::new(
                    op(),
                    format!("argument {a}: memory is on another engine than the primitive"),
                ));
            }
        }
        let mut c_args = [ffi::dnnl_exec_arg_t {
            arg: 0,
            memory: ptr::null_mut(),
        }; MAX_ARGS];
        for (slot, (a, memory)) in c_args.iter_mut().zip(args) {
            *slot = ffi::dnnl_exec_arg_t {
                arg: *a,
                memory: memory.raw,
            };
        }
        let mut n = args.len();
        // A poisoned lock only means another execution panicked; the scratchpad holds no state.
        let scratchpad = self
            .scratchpad
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(memory) = scratchpad.as_ref() {
            c_args[n] = ffi::dnnl_exec_arg_t {
                arg: arg::SCRATCHPAD,
                memory: memory.raw,
            };
            n += 1;
        }
        let lib = self.pd.lib();
        lib.apply_threads(self.pd.threads());
        // SAFETY: the primitive, stream and memories are live; every memory matches the
        // descriptor the primitive expects and is bound to a buffer of that size (allocated, or
        // lent under `set_data_handle`'s contract); the scratchpad is locked for this call.
        let status = unsafe {
            (lib.api().dnnl_primitive_execute)(self.raw, stream.raw, n as c_int, c_args.as_ptr())
        };
        drop(scratchpad);
        check(
            status,
            &format!("{} execute (dnnl_primitive_execute)", self.pd.0.name),
        )
    }
}

impl Drop for Primitive {
    fn drop(&mut self) {
        // SAFETY: `raw` is owned here; no execution is in progress (`&mut self`).
        unsafe { (self.pd.lib().api().dnnl_primitive_destroy)(self.raw) };
    }
}
