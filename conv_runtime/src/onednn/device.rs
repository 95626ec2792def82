//! The `OneDnn` device: the layers' convolutions run as oneDNN primitives built once per layer
//! type and thread count; everything oneDNN cannot do exactly runs the generated CPU code.
//!
//! What runs where, per spec feature:
//!
//! | spec | convolution + bias | activation | normalization |
//! |---|---|---|---|
//! | f32 | oneDNN | fused post-op in `evaluate` for Relu, Tanh, Sigmoid, Gelu (oneDNN's `relu`, `tanh`, `logistic`, `gelu_tanh` are these functions); generated code otherwise and in training | generated code |
//! | f64, f16, bf16 | generated code (oneDNN has no f64 convolution; half layers keep the generated mixed-precision path) | generated | generated |
//!
//! BatchNorm and LayerNorm run in the generated code on every path: the statistics are the
//! same two-pass algorithm as the CPU device, so both devices agree to rounding. Every operation
//! that falls back is counted ([`OneDnn::fallbacks`]).
//!
//! A layer that is a 1x1 convolution of a 1x1 map (every `Dense` entry of a network) runs
//! oneDNN's inner product instead of its convolution: measured side by side in one process
//! (oneDNN 3.2, one thread, batch 32), the convolution's training forward + backward data +
//! backward weights took 10-14x the inner product's (3136 -> 512: 107-117 ms against 8-11 ms;
//! 2048 -> 256: 32-43 ms against 2.4-4.5 ms), one action (batch 1) 1.2x.
//!
//! In networks, average pooling runs oneDNN's `pooling_avg_include_padding` primitives in f32 (built
//! on first use per geometry, thread count and batch); max-pooling runs the generated code,
//! counted, because oneDNN's own drops NaN (see the `NetworkDevice` impl).
//!
//! Primitives (inference per batch size, training forward, backward data, backward weights and
//! the weight/gradient reorders) live in a `static` [`ConvSetup`] per layer type, built on a
//! thread count's first use under a lock and shared by all devices and threads of that count.
//! Weights are reordered into the layout each primitive chose once per parameter change: the
//! device caches reordered copies by the weights' content stamp.
//!
//! Threads: a device has a count ([`OneDnn::with_threads`]). The generated code runs on its
//! [`Cpu`] of that many threads; oneDNN's primitives run on that many OpenMP threads (libgomp's
//! `omp_set_num_threads`, applied on the calling thread before each execution), and a layer
//! type keeps one set of primitives per count, so devices of different counts coexist.

use std::any::TypeId;
use std::sync::{Arc, Mutex, OnceLock};

use super::{
    arg, Attr, DataType, Eltwise, Engine, FormatTag, Library, Memory, MemoryDesc, Pooling,
    Primitive, PrimitiveDesc, Prop, Stream,
};
use crate::network::PoolGeometry;
use crate::{Cpu, Error, Result};

/// A convolution's sizes, as literals in the generated code.
#[derive(Clone, Copy, Debug)]
pub struct ConvGeometry {
    pub batch: usize,
    pub in_h: usize,
    pub in_w: usize,
    pub in_c: usize,
    pub out_h: usize,
    pub out_w: usize,
    pub out_c: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    /// Padding before (top, left).
    pub padding: [usize; 2],
    /// The activation fused into `evaluate`, where oneDNN's is exactly the layer's.
    pub fused: Option<Eltwise>,
}

impl ConvGeometry {
    /// Padding after (bottom, right): what the last output row/column reaches past the input.
    /// Smaller than the padding before when the output size was floored.
    fn padding_after(&self) -> [i64; 2] {
        [
            after(
                self.out_h,
                self.stride[0],
                self.kernel[0],
                self.in_h,
                self.padding[0],
            ),
            after(
                self.out_w,
                self.stride[1],
                self.kernel[1],
                self.in_w,
                self.padding[1],
            ),
        ]
    }

    fn src_dims(&self, batch: usize) -> [i64; 4] {
        [batch, self.in_c, self.in_h, self.in_w].map(|d| d as i64)
    }

    fn dst_dims(&self, batch: usize) -> [i64; 4] {
        [batch, self.out_c, self.out_h, self.out_w].map(|d| d as i64)
    }

    /// A 1x1 convolution of a 1x1 map (a `Dense` entry): oneDNN's inner product, the
    /// primitive made for it, runs it.
    fn dense(&self) -> bool {
        [self.in_h, self.in_w, self.out_h, self.out_w] == [1; 4] && self.kernel == [1, 1]
    }

    /// The output's logical dims (the first `len`) and layout: (N, OC, H, W) NHWC, or (N, OC)
    /// for an inner product (the same bytes).
    fn dst_layout(&self, batch: usize) -> ([i64; 4], usize, FormatTag) {
        if self.dense() {
            ([batch as i64, self.out_c as i64, 0, 0], 2, FormatTag::NC)
        } else {
            (self.dst_dims(batch), 4, FormatTag::NHWC)
        }
    }

    fn weight_dims(&self) -> [i64; 4] {
        [self.out_c, self.in_c, self.kernel[0], self.kernel[1]].map(|d| d as i64)
    }

    /// Strides, padding before and padding after, as the convolution builders take them.
    fn strides_padding(&self) -> ([i64; 2], [i64; 2], [i64; 2]) {
        (
            self.stride.map(|s| s as i64),
            self.padding.map(|p| p as i64),
            self.padding_after(),
        )
    }

    /// The descriptors a layer type's primitives are built from, for `batch` images.
    fn descs(&self, lib: &Library, batch: usize) -> Result<Descs> {
        let md = |dims: &[i64], tag| MemoryDesc::new(lib, dims, DataType::F32, tag);
        Ok(Descs {
            src: md(&self.src_dims(batch), FormatTag::NHWC)?,
            dst: {
                let (dims, len, tag) = self.dst_layout(batch);
                md(&dims[..len], tag)?
            },
            bias: md(&[self.out_c as i64], FormatTag::X)?,
            user_weights: md(&self.weight_dims(), FormatTag::OHWI)?,
            any_weights: md(&self.weight_dims(), FormatTag::ANY)?,
        })
    }
}

/// Padding after (bottom or right) of a window of `k` at stride `s` over `i` inputs padded by
/// `p` before, `o` outputs: what the last window reaches past the input (less than `p` where
/// the output size was floored).
fn after(o: usize, s: usize, k: usize, i: usize, p: usize) -> i64 {
    ((o - 1) * s + k) as i64 - i as i64 - p as i64
}

/// The tensors' descriptors as the generated code lays them out (NHWC activations, OHWI
/// weights), and the weights in `ANY` layout so that each primitive picks its own.
struct Descs {
    src: MemoryDesc,
    dst: MemoryDesc,
    bias: MemoryDesc,
    user_weights: MemoryDesc,
    any_weights: MemoryDesc,
}

/// A forward primitive and the weight layout it chose.
struct Forward {
    primitive: Primitive,
    weights: MemoryDesc,
    /// OHWI -> `weights`.
    reorder: Primitive,
}

/// The training primitives of a layer type (its spec's batch).
struct Training {
    forward: Forward,
    backward_data: Primitive,
    backward_data_weights: MemoryDesc,
    /// OHWI -> `backward_data_weights`.
    backward_data_reorder: Primitive,
    backward_weights: Primitive,
    diff_weights: MemoryDesc,
    /// `diff_weights` -> OHWI.
    diff_weights_reorder: Primitive,
}

/// Objects built on their key's first use, under a lock (a failed build is not kept: the next
/// use tries again and reports the same error).
struct Cache<K, V>(Mutex<Vec<(K, Arc<V>)>>);

impl<K: Copy + PartialEq, V> Cache<K, V> {
    const fn new() -> Self {
        Self(Mutex::new(Vec::new()))
    }

    fn get(&self, key: K, what: &str, build: impl FnOnce() -> Result<V>) -> Result<Arc<V>> {
        let mut entries = self.0.lock().map_err(|_| poisoned(what))?;
        if let Some((_, v)) = entries.iter().find(|(k, _)| *k == key) {
            return Ok(v.clone());
        }
        let built = Arc::new(build()?);
        entries.push((key, built.clone()));
        Ok(built)
    }
}

/// Everything oneDNN needs for one layer type, built on first use, once per thread count:
/// oneDNN fixes a primitive's work split when building it.
pub struct ConvSetup {
    geometry: ConvGeometry,
    /// By thread count.
    training: Cache<usize, Training>,
    /// By (thread count, batch).
    inference: Cache<(usize, usize), Forward>,
}

impl ConvSetup {
    /// A setup for `geometry`; nothing is built until a device uses it.
    pub const fn new(geometry: ConvGeometry) -> Self {
        Self {
            geometry,
            training: Cache::new(),
            inference: Cache::new(),
        }
    }

    fn id(&'static self) -> usize {
        self as *const Self as usize
    }

    /// A forward primitive on `d`, and its descriptor (the backward primitives' hint).
    fn forward(
        &self,
        engine: &Engine,
        d: &Descs,
        prop: Prop,
        fuse: bool,
    ) -> Result<(Forward, super::PrimitiveDesc)> {
        let g = &self.geometry;
        let lib = engine.library();
        let attr = match (fuse, g.fused) {
            (true, Some(alg)) => Attr::with_eltwise(lib, alg, 0.0, 0.0)?,
            _ => Attr::new(lib)?,
        };
        let (strides, pl, pr) = g.strides_padding();
        let pd = if g.dense() {
            super::inner_product_forward(
                engine,
                prop,
                &d.src,
                &d.any_weights,
                Some(&d.bias),
                &d.dst,
                &attr,
            )?
        } else {
            super::conv_forward(
                engine,
                prop,
                &d.src,
                &d.any_weights,
                Some(&d.bias),
                &d.dst,
                strides,
                pl,
                pr,
                &attr,
            )?
        };
        let weights = pd.query_md(super::Query::Weights)?;
        let reorder = Primitive::new(&super::reorder(engine, &d.user_weights, &weights)?)?;
        Ok((
            Forward {
                primitive: Primitive::new(&pd)?,
                weights,
                reorder,
            },
            pd,
        ))
    }

    /// The training primitives for `engine`'s thread count.
    fn training(&self, engine: &Engine) -> Result<Arc<Training>> {
        self.training
            .get(engine.threads(), "training primitives", || {
                self.build_training(engine)
            })
    }

    fn build_training(&self, engine: &Engine) -> Result<Training> {
        let g = &self.geometry;
        let lib = engine.library();
        let d = g.descs(lib, g.batch)?;
        let (forward, hint_pd) = self.forward(engine, &d, Prop::ForwardTraining, false)?;
        let (strides, pl, pr) = g.strides_padding();
        let (data_pd, weights_pd) = if g.dense() {
            (
                super::inner_product_backward_data(
                    engine,
                    &d.src,
                    &d.any_weights,
                    &d.dst,
                    &hint_pd,
                    &Attr::new(lib)?,
                )?,
                super::inner_product_backward_weights(
                    engine,
                    &d.src,
                    &d.any_weights,
                    Some(&d.bias),
                    &d.dst,
                    &hint_pd,
                    &Attr::new(lib)?,
                )?,
            )
        } else {
            (
                super::conv_backward_data(
                    engine,
                    &d.src,
                    &d.any_weights,
                    &d.dst,
                    strides,
                    pl,
                    pr,
                    &hint_pd,
                    &Attr::new(lib)?,
                )?,
                super::conv_backward_weights(
                    engine,
                    &d.src,
                    &d.any_weights,
                    Some(&d.bias),
                    &d.dst,
                    strides,
                    pl,
                    pr,
                    &hint_pd,
                    &Attr::new(lib)?,
                )?,
            )
        };
        let backward_data_weights = data_pd.query_md(super::Query::Weights)?;
        let diff_weights = weights_pd.query_md(super::Query::DiffWeights)?;
        Ok(Training {
            forward,
            backward_data: Primitive::new(&data_pd)?,
            backward_data_reorder: Primitive::new(&super::reorder(
                engine,
                &d.user_weights,
                &backward_data_weights,
            )?)?,
            backward_data_weights,
            backward_weights: Primitive::new(&weights_pd)?,
            diff_weights_reorder: Primitive::new(&super::reorder(
                engine,
                &diff_weights,
                &d.user_weights,
            )?)?,
            diff_weights,
        })
    }

    /// The inference primitive of `batch` images for `engine`'s thread count.
    fn inference(&self, engine: &Engine, batch: usize) -> Result<Arc<Forward>> {
        let key = (engine.threads(), batch);
        self.inference.get(key, "inference primitives", || {
            let d = self.geometry.descs(engine.library(), batch)?;
            Ok(self.forward(engine, &d, Prop::ForwardInference, true)?.0)
        })
    }
}

fn poisoned(what: &str) -> Error {
    Error::new(
        format!("oneDNN {what}"),
        "a thread panicked while building it",
    )
}

/// Weights reordered for one primitive, valid while the weights keep their stamp.
struct Reordered {
    setup: usize,
    /// Which primitive's layout (forward of a batch, or backward data).
    kind: usize,
    stamp: u64,
    memory: Memory,
    last_use: u64,
}

/// Reordered weight copies kept per device.
const REORDERED_CAPACITY: usize = 32;

/// The process-wide CPU engine; each device uses it through a handle with its thread count, and
/// primitives built for one device serve every device of the same count.
fn engine() -> Result<Engine> {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    if let Some(e) = ENGINE.get() {
        return Ok(e.clone());
    }
    let engine = Engine::cpu(&Library::load()?)?;
    Ok(ENGINE.get_or_init(|| engine).clone())
}

/// A device that runs layers' convolutions with oneDNN (see the module docs for what runs
/// where). Single stream; not `Sync`: use one device per thread.
///
/// # Threads
///
/// [`OneDnn::new`] computes on the calling thread alone; [`OneDnn::with_threads`]`(n)` on `n`
/// threads, with two mechanisms under one count:
///
/// - oneDNN's primitives run on `n` OpenMP threads. The oneDNN this backend is built for
///   (`onednn-cpu-gomp`) runs on GNU OpenMP (libgomp); the device sets the count with libgomp's
///   `omp_set_num_threads` on the calling thread before each primitive is built and before each execution (it only affects
///   the calling thread, so other threads' devices and OpenMP users keep their own count), and
///   each layer type keeps one set of primitives per count, so devices of different counts
///   coexist in one process, and on one thread. The process-wide [`crate::onednn::set_threads`]
///   does not apply to devices.
/// - The generated code (normalization, activations outside the fused ones, and every
///   operation of f64, f16 and bf16 layers) runs on the device's [`Cpu`], made with
///   [`Cpu::with_threads`]`(n)`: its own pool of `n - 1` threads besides the caller.
///
/// The two sets of threads take turns (each call finishes before the next starts), so a device
/// of `n` threads keeps about `n` cores busy. Threads pay only where those cores are otherwise
/// idle: every oneDNN call ends with its OpenMP threads joining, and where other processes keep
/// the cores busy a call waits a scheduler time slice (milliseconds) for a thread that is not
/// running; on the 2-core development machine under a load of 7, a device of 2 threads was
/// many times slower than one of 1. Unlike the generated code, oneDNN does not promise
/// bit-identical results across thread counts: counts may differ by rounding (weight gradients
/// summed in another order).
pub struct OneDnn {
    engine: Engine,
    stream: Stream,
    cpu: Cpu,
    reordered: Vec<Reordered>,
    clock: u64,
    fallbacks: u64,
}

/// Average pooling's primitives, by (geometry, thread count, batch).
type PoolForwards = Cache<(PoolGeometry, usize, usize), Primitive>;
/// Its backward primitives, by (geometry, thread count), at the geometry's batch.
type PoolBackwards = Cache<(PoolGeometry, usize), Primitive>;

static POOL_FORWARD: PoolForwards = Cache::new();
static POOL_BACKWARD: PoolBackwards = Cache::new();

/// Logical (N, C, H, W) dims of a pooling's input and output, and the descriptors of both
/// (NHWC, f32).
fn pool_descs(
    lib: &Library,
    g: &PoolGeometry,
    batch: usize,
) -> Result<([i64; 4], [i64; 4], MemoryDesc, MemoryDesc)> {
    let src = [batch, g.channels, g.in_h, g.in_w].map(|d| d as i64);
    let dst = [batch, g.channels, g.out_h, g.out_w].map(|d| d as i64);
    let md = |dims: &[i64]| MemoryDesc::new(lib, dims, DataType::F32, FormatTag::NHWC);
    Ok((src, dst, md(&src)?, md(&dst)?))
}

/// Strides, kernel, padding before and after of a pooling, as the builders take them.
fn pool_window(g: &PoolGeometry) -> [[i64; 2]; 4] {
    [
        g.stride.map(|s| s as i64),
        g.kernel.map(|k| k as i64),
        g.padding.map(|p| p as i64),
        [
            after(g.out_h, g.stride[0], g.kernel[0], g.in_h, g.padding[0]),
            after(g.out_w, g.stride[1], g.kernel[1], g.in_w, g.padding[1]),
        ],
    ]
}

/// The forward pooling descriptor of `batch` images.
fn pool_forward_pd(engine: &Engine, g: &PoolGeometry, batch: usize) -> Result<PrimitiveDesc> {
    let lib = engine.library();
    let (_, _, src, dst) = pool_descs(lib, g, batch)?;
    let [s, k, pl, pr] = pool_window(g);
    super::pool_forward(
        engine,
        Prop::ForwardTraining,
        Pooling::AvgIncludePadding,
        &src,
        &dst,
        s,
        k,
        pl,
        pr,
        &Attr::new(lib)?,
    )
}

/// Networks run on oneDNN as their layers do. Average pooling (f32) runs oneDNN's
/// `pooling_avg_include_padding`, exactly the entry's definition; max-pooling runs the generated
/// code, counted as a fallback: oneDNN leaves NaN inputs undefined (an all-NaN window gives
/// -FLT_MAX), where the entry propagates NaN as PyTorch does, and its winners must be the ones
/// the gradient goes to. The other code between layers (element-wise entries, residual sums,
/// views) is generated code on the device's CPU threads, as on `Cpu`.
impl crate::network::NetworkDevice for OneDnn {
    fn __avg_pool_forward<A: 'static>(
        &mut self,
        geometry: &PoolGeometry,
        batch: usize,
        x: &[A],
        y: &mut [A],
    ) -> Option<Result<()>> {
        let (x, y) = (as_f32(x)?, as_f32_mut(y)?);
        Some(self.avg_pool_forward(geometry, batch, x, y))
    }

    fn __avg_pool_backward<A: 'static>(
        &mut self,
        geometry: &PoolGeometry,
        dy: &[A],
        dx: &mut [A],
    ) -> Option<Result<()>> {
        let (dy, dx) = (as_f32(dy)?, as_f32_mut(dx)?);
        Some(self.avg_pool_backward(geometry, dy, dx))
    }

    fn __pool(&self) -> &crate::cpu::Pool {
        self.cpu.__pool()
    }

    fn __take<X: std::any::Any + Send + Default>(&mut self) -> Box<X> {
        crate::network::NetworkDevice::__take(&mut self.cpu)
    }

    fn __put<X: std::any::Any + Send>(&mut self, x: Box<X>) {
        crate::network::NetworkDevice::__put(&mut self.cpu, x)
    }

    fn __fallback(&mut self) {
        self.fallbacks += 1;
    }
}

/// `x` as f32, where its elements are f32.
fn as_f32<A: 'static>(x: &[A]) -> Option<&[f32]> {
    if TypeId::of::<A>() != TypeId::of::<f32>() {
        return None;
    }
    // SAFETY: `A` is `f32`.
    Some(unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) })
}

/// [`as_f32`], mutably.
fn as_f32_mut<A: 'static>(x: &mut [A]) -> Option<&mut [f32]> {
    if TypeId::of::<A>() != TypeId::of::<f32>() {
        return None;
    }
    // SAFETY: `A` is `f32`.
    Some(unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<f32>(), x.len()) })
}

impl std::fmt::Debug for OneDnn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneDnn")
            .field("threads", &self.threads())
            .field("fallbacks", &self.fallbacks)
            .finish()
    }
}

impl OneDnn {
    /// Loads oneDNN (`$ONEDNN_LIB_DIR/libdnnl.so.3`) and opens a stream on the CPU engine: a
    /// device computing on the calling thread alone (as `Cpu::default()`).
    pub fn new() -> Result<Self> {
        Self::with_threads(1)
    }

    /// As [`OneDnn::new`], computing on `threads` threads: oneDNN's on that many OpenMP
    /// threads, the generated code on a [`Cpu::with_threads`]`(threads)` (see the type's docs).
    /// Zero threads, a count OpenMP cannot take, or threads the system cannot start are an
    /// error.
    pub fn with_threads(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(Error::new(
                "OneDnn::with_threads",
                "a device needs at least one thread",
            ));
        }
        let engine = engine()?
            .with_threads(threads)
            .map_err(|e| Error::new("OneDnn::with_threads", e.to_string()))?;
        let stream = Stream::new(&engine)?;
        Ok(Self {
            engine,
            stream,
            cpu: Cpu::with_threads(threads)?,
            reordered: Vec::new(),
            clock: 0,
            fallbacks: 0,
        })
    }

    /// A device with a thread per core the system reports ([`Cpu::all_cores`]'s count).
    pub fn all_cores() -> Result<Self> {
        let cores = std::thread::available_parallelism().map_err(|e| {
            Error::new(
                "OneDnn::all_cores",
                format!("the core count is unknown: {e}"),
            )
        })?;
        Self::with_threads(cores.get())
    }

    /// The threads this device computes on, the caller's included.
    pub fn threads(&self) -> usize {
        self.engine.threads()
    }

    /// Sets the process-wide thread count of oneDNN descriptors built on engines without a
    /// count of their own. Devices have their own count and ignore it.
    #[deprecated(
        note = "a device has its own thread count: use `OneDnn::with_threads`; \
                `conv_runtime::onednn::set_threads` sets the low-level API's default"
    )]
    pub fn set_threads(n: usize) {
        super::set_threads(n);
    }

    /// Operations that ran the generated CPU code because oneDNN cannot do their spec exactly.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks
    }

    /// The CPU device for the parts that run generated code; counts a fallback when `counted`.
    #[doc(hidden)]
    pub fn __cpu(&mut self, counted: bool) -> &mut Cpu {
        self.fallbacks += u64::from(counted);
        &mut self.cpu
    }

    /// The weights (OHWI, stamp `stamp`) in the layout `kind` of `setup` wants, reordered once
    /// per stamp.
    fn reordered(
        &mut self,
        setup: &'static ConvSetup,
        kind: usize,
        desc: &MemoryDesc,
        reorder: &Primitive,
        weights: &[f32],
        stamp: u64,
    ) -> Result<usize> {
        self.clock += 1;
        let id = setup.id();
        if let Some(i) = self
            .reordered
            .iter()
            .position(|r| r.setup == id && r.kind == kind && r.stamp == stamp)
        {
            self.reordered[i].last_use = self.clock;
            return Ok(i);
        }
        let memory = Memory::allocate(&self.engine, desc)?;
        // The layer's OHWI tensor; the reorder only reads it.
        let from = self.lend(
            &setup.geometry.weight_dims(),
            FormatTag::OHWI,
            weights.as_ptr(),
        )?;
        reorder.execute(&self.stream, &[(arg::FROM, &from), (arg::TO, &memory)])?;
        let entry = Reordered {
            setup: id,
            kind,
            stamp,
            memory,
            last_use: self.clock,
        };
        if self.reordered.len() < REORDERED_CAPACITY {
            self.reordered.push(entry);
            Ok(self.reordered.len() - 1)
        } else {
            let oldest = (0..self.reordered.len())
                .min_by_key(|&i| self.reordered[i].last_use)
                .unwrap_or(0);
            self.reordered[oldest] = entry;
            Ok(oldest)
        }
    }

    /// Binds `data` to a new f32 memory of `dims` laid out as `tag`, for one execution.
    fn lend(&self, dims: &[i64], tag: FormatTag, data: *const f32) -> Result<Memory> {
        let desc = MemoryDesc::new(self.engine.library(), dims, DataType::F32, tag)?;
        let mut memory = Memory::unbound(&self.engine, &desc)?;
        // SAFETY: callers pass slices of exactly `desc`'s size that outlive the execution;
        // oneDNN writes only to destination arguments, which callers pass as `&mut`.
        unsafe { memory.set_data_handle(data as *mut _)? };
        Ok(memory)
    }

    /// Average pooling of `batch` images, NHWC.
    fn avg_pool_forward(
        &mut self,
        g: &PoolGeometry,
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<()> {
        let engine = self.engine.clone();
        let key = (*g, engine.threads(), batch);
        let primitive = POOL_FORWARD.get(key, "pooling primitives", || {
            Primitive::new(&pool_forward_pd(&engine, g, batch)?)
        })?;
        let (src_dims, dst_dims, _, _) = pool_descs(engine.library(), g, batch)?;
        let src = self.lend(&src_dims, FormatTag::NHWC, x.as_ptr())?;
        let dst = self.lend(&dst_dims, FormatTag::NHWC, y.as_mut_ptr())?;
        primitive.execute(&self.stream, &[(arg::SRC, &src), (arg::DST, &dst)])
    }

    /// The gradient of average pooling at its input (NHWC, overwritten), at the training batch.
    fn avg_pool_backward(&mut self, g: &PoolGeometry, dy: &[f32], dx: &mut [f32]) -> Result<()> {
        let engine = self.engine.clone();
        let primitive = POOL_BACKWARD.get((*g, engine.threads()), "pooling primitives", || {
            let hint = pool_forward_pd(&engine, g, g.batch)?;
            let (_, _, src, dst) = pool_descs(engine.library(), g, g.batch)?;
            let [s, k, pl, pr] = pool_window(g);
            Primitive::new(&super::pool_backward(
                &engine,
                Pooling::AvgIncludePadding,
                &src,
                &dst,
                s,
                k,
                pl,
                pr,
                &hint,
                &Attr::new(engine.library())?,
            )?)
        })?;
        let (src_dims, dst_dims, _, _) = pool_descs(engine.library(), g, g.batch)?;
        let diff_dst = self.lend(&dst_dims, FormatTag::NHWC, dy.as_ptr())?;
        let diff_src = self.lend(&src_dims, FormatTag::NHWC, dx.as_mut_ptr())?;
        primitive.execute(
            &self.stream,
            &[(arg::DIFF_DST, &diff_dst), (arg::DIFF_SRC, &diff_src)],
        )
    }

    /// Convolution + bias of `batch` images (`x` NHWC) into `y` (NHWC): the inference primitive
    /// of that batch with the fused activation, or the training one without.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn __conv_forward(
        &mut self,
        setup: &'static ConvSetup,
        batch: usize,
        inference: bool,
        weights: &[f32],
        stamp: u64,
        bias: &[f32],
        x: &[f32],
        y: &mut [f32],
    ) -> Result<()> {
        let engine = self.engine.clone();
        let g = setup.geometry;
        let (inference_forward, training);
        let (forward, kind) = if inference {
            inference_forward = setup.inference(&engine, batch)?;
            (&*inference_forward, batch * 2 + 1)
        } else {
            training = setup.training(&engine)?;
            (&training.forward, 0)
        };
        let w = self.reordered(
            setup,
            kind,
            &forward.weights,
            &forward.reorder,
            weights,
            stamp,
        )?;
        let src = self.lend(&g.src_dims(batch), FormatTag::NHWC, x.as_ptr())?;
        let (dims, len, tag) = g.dst_layout(batch);
        let dst = self.lend(&dims[..len], tag, y.as_mut_ptr())?;
        let b = self.lend(&[g.out_c as i64], FormatTag::X, bias.as_ptr())?;
        forward.primitive.execute(
            &self.stream,
            &[
                (arg::SRC, &src),
                (arg::WEIGHTS, &self.reordered[w].memory),
                (arg::BIAS, &b),
                (arg::DST, &dst),
            ],
        )
    }

    /// The input gradient (NHWC, overwritten) from the gradient at the convolution's output.
    #[doc(hidden)]
    pub fn __conv_backward_data(
        &mut self,
        setup: &'static ConvSetup,
        weights: &[f32],
        stamp: u64,
        dz: &[f32],
        dx: &mut [f32],
    ) -> Result<()> {
        let engine = self.engine.clone();
        let g = setup.geometry;
        let t = setup.training(&engine)?;
        let w = self.reordered(
            setup,
            2,
            &t.backward_data_weights,
            &t.backward_data_reorder,
            weights,
            stamp,
        )?;
        let (dims, len, tag) = g.dst_layout(g.batch);
        let diff_dst = self.lend(&dims[..len], tag, dz.as_ptr())?;
        let diff_src = self.lend(&g.src_dims(g.batch), FormatTag::NHWC, dx.as_mut_ptr())?;
        t.backward_data.execute(
            &self.stream,
            &[
                (arg::DIFF_DST, &diff_dst),
                (arg::WEIGHTS, &self.reordered[w].memory),
                (arg::DIFF_SRC, &diff_src),
            ],
        )
    }

    /// Adds the weight (OHWI) and bias gradients to `dw` and `db`.
    #[doc(hidden)]
    pub fn __conv_backward_weights(
        &mut self,
        setup: &'static ConvSetup,
        x: &[f32],
        dz: &[f32],
        dw: &mut [f32],
        db: &mut [f32],
    ) -> Result<()> {
        let engine = self.engine.clone();
        let g = setup.geometry;
        let t = setup.training(&engine)?;
        let src = self.lend(&g.src_dims(g.batch), FormatTag::NHWC, x.as_ptr())?;
        let (dims, len, tag) = g.dst_layout(g.batch);
        let diff_dst = self.lend(&dims[..len], tag, dz.as_ptr())?;
        let diff_weights = Memory::allocate(&engine, &t.diff_weights)?;
        let mut bias = vec![0.0f32; g.out_c];
        let diff_bias = self.lend(&[g.out_c as i64], FormatTag::X, bias.as_mut_ptr())?;
        t.backward_weights.execute(
            &self.stream,
            &[
                (arg::SRC, &src),
                (arg::DIFF_DST, &diff_dst),
                (arg::DIFF_WEIGHTS, &diff_weights),
                (arg::DIFF_BIAS, &diff_bias),
            ],
        )?;
        drop(diff_bias);
        let mut ohwi = vec![0.0f32; dw.len()];
        let plain = self.lend(&g.weight_dims(), FormatTag::OHWI, ohwi.as_mut_ptr())?;
        t.diff_weights_reorder.execute(
            &self.stream,
            &[(arg::FROM, &diff_weights), (arg::TO, &plain)],
        )?;
        drop(plain);
        for (a, g) in dw.iter_mut().zip(&ohwi) {
            *a += g;
        }
        for (a, g) in db.iter_mut().zip(&bias) {
            *a += g;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Eltwise;
    use super::*;

    /// A strided, padded layer large enough for oneDNN to split among two threads.
    static SETUP: ConvSetup = ConvSetup::new(ConvGeometry {
        batch: 4,
        in_h: 12,
        in_w: 12,
        in_c: 8,
        out_h: 6,
        out_w: 6,
        out_c: 16,
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
        fused: Some(Eltwise::Relu),
    });

    const IN: usize = 4 * 12 * 12 * 8;
    const OUT: usize = 4 * 6 * 6 * 16;
    const WEIGHTS: usize = 16 * 3 * 3 * 8;

    /// Deterministic values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
                bits as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn device(threads: usize) -> OneDnn {
        OneDnn::with_threads(threads).expect("oneDNN (set ONEDNN_LIB_DIR; see the README)")
    }

    /// The calling thread's OpenMP count, as oneDNN would read it now.
    fn omp_threads(device: &OneDnn) -> usize {
        device.engine.library().omp_max_threads()
    }

    /// Every convolution entry point on `device`, checking after each execution that the
    /// calling thread runs OpenMP at the device's count: inference at batch 4 (fused ReLU) and
    /// 1, training forward, backward data, backward weights.
    fn every_operation(device: &mut OneDnn) -> Vec<Vec<f32>> {
        let (x, w, b, dz) = (
            values(1, IN),
            values(2, WEIGHTS),
            values(3, 16),
            values(4, OUT),
        );
        let threads = device.threads();
        let mut outputs = Vec::new();
        for (batch, inference) in [(4, true), (1, true), (4, false)] {
            let mut y = vec![f32::NAN; OUT / 4 * batch];
            device
                .__conv_forward(
                    &SETUP,
                    batch,
                    inference,
                    &w,
                    7,
                    &b,
                    &x[..IN / 4 * batch],
                    &mut y,
                )
                .expect("forward");
            assert_eq!(omp_threads(device), threads, "forward ran at another count");
            outputs.push(y);
        }
        let mut dx = vec![f32::NAN; IN];
        device
            .__conv_backward_data(&SETUP, &w, 7, &dz, &mut dx)
            .expect("backward data");
        assert_eq!(
            omp_threads(device),
            threads,
            "backward data ran at another count"
        );
        outputs.push(dx);
        let (mut dw, mut db) = (vec![0.0; WEIGHTS], vec![0.0; 16]);
        device
            .__conv_backward_weights(&SETUP, &x, &dz, &mut dw, &mut db)
            .expect("backward weights");
        assert_eq!(
            omp_threads(device),
            threads,
            "backward weights ran at another count"
        );
        outputs.extend([dw, db]);
        outputs
    }

    /// Equal within f32 rounding of sums of about a thousand terms, relative to the largest.
    fn assert_close(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
        assert_eq!(a.len(), b.len());
        for (i, (a, b)) in a.iter().zip(b).enumerate() {
            let scale = a.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            for (j, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * scale,
                    "{what}: output {i}, element {j}: {x} vs {y}"
                );
            }
        }
    }

    /// A dense layer (1x1 map, 1x1 kernel): oneDNN's inner product, against plain loops.
    #[test]
    fn dense_layers_run_the_inner_product() {
        const N: usize = 5;
        const I: usize = 40;
        const O: usize = 24;
        static DENSE: ConvSetup = ConvSetup::new(ConvGeometry {
            batch: N,
            in_h: 1,
            in_w: 1,
            in_c: I,
            out_h: 1,
            out_w: 1,
            out_c: O,
            kernel: [1, 1],
            stride: [1, 1],
            padding: [0, 0],
            fused: Some(Eltwise::Relu),
        });
        let (x, w, b, dz) = (
            values(5, N * I),
            values(6, O * I),
            values(7, O),
            values(8, N * O),
        );
        let mut device = device(1);
        let z: Vec<f32> = (0..N * O)
            .map(|k| {
                let (n, o) = (k / O, k % O);
                b[o] + (0..I).map(|i| w[o * I + i] * x[n * I + i]).sum::<f32>()
            })
            .collect();
        let relu: Vec<f32> = z.iter().map(|v| v.max(0.0)).collect();
        let dx: Vec<f32> = (0..N * I)
            .map(|k| {
                let (n, i) = (k / I, k % I);
                (0..O).map(|o| w[o * I + i] * dz[n * O + o]).sum()
            })
            .collect();
        let dw: Vec<f32> = (0..O * I)
            .map(|k| {
                let (o, i) = (k / I, k % I);
                (0..N).map(|n| dz[n * O + o] * x[n * I + i]).sum()
            })
            .collect();
        let db: Vec<f32> = (0..O)
            .map(|o| (0..N).map(|n| dz[n * O + o]).sum())
            .collect();

        let (mut y, mut y_train) = (vec![f32::NAN; N * O], vec![f32::NAN; N * O]);
        device
            .__conv_forward(&DENSE, N, true, &w, 1, &b, &x, &mut y)
            .expect("inference");
        device
            .__conv_forward(&DENSE, N, false, &w, 1, &b, &x, &mut y_train)
            .expect("training forward");
        let mut got_dx = vec![f32::NAN; N * I];
        device
            .__conv_backward_data(&DENSE, &w, 1, &dz, &mut got_dx)
            .expect("backward data");
        let (mut got_dw, mut got_db) = (vec![0.0; O * I], vec![0.0; O]);
        device
            .__conv_backward_weights(&DENSE, &x, &dz, &mut got_dw, &mut got_db)
            .expect("backward weights");
        assert_close(
            "dense",
            &[relu, z, dx, dw, db],
            &[y, y_train, got_dx, got_dw, got_db],
        );

        let training = device.engine.clone();
        let t = DENSE.training(&training).expect("training primitives");
        assert_eq!(t.forward.primitive.desc().name(), "inner product forward");
        assert_eq!(t.backward_data.desc().name(), "inner product backward data");
        assert_eq!(
            t.backward_weights.desc().name(),
            "inner product backward weights"
        );
    }

    #[test]
    fn zero_threads_is_an_error_naming_the_call() {
        let error = OneDnn::with_threads(0).expect_err("0 threads").to_string();
        assert!(error.contains("OneDnn::with_threads"), "{error}");
    }

    #[test]
    fn two_threads_compute_what_one_does() {
        let (mut one, mut two) = (device(1), device(2));
        assert_eq!((one.threads(), two.threads()), (1, 2));
        assert_eq!(
            (one.__cpu(false).threads(), two.__cpu(false).threads()),
            (1, 2)
        );
        let reference = every_operation(&mut one);
        assert_close("2 threads vs 1", &reference, &every_operation(&mut two));
        assert_eq!(one.fallbacks() + two.fallbacks(), 0);
    }

    /// Devices of different counts, interleaved on one thread and side by side on two: each
    /// runs primitives built for its own count, at its own count, and computes the same.
    #[test]
    fn devices_of_different_counts_coexist() {
        let (mut one, mut two, mut three) = (device(1), device(2), device(3));
        let reference = every_operation(&mut one);
        for _ in 0..2 {
            assert_close(
                "2 threads, interleaved",
                &reference,
                &every_operation(&mut two),
            );
            assert_close(
                "1 thread, interleaved",
                &reference,
                &every_operation(&mut one),
            );
            assert_close(
                "3 threads, interleaved",
                &reference,
                &every_operation(&mut three),
            );
        }
        std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                let mut two = device(2);
                (0..3)
                    .map(|_| every_operation(&mut two))
                    .collect::<Vec<_>>()
            });
            for _ in 0..3 {
                assert_close(
                    "1 thread, concurrent",
                    &reference,
                    &every_operation(&mut one),
                );
            }
            for outputs in other.join().expect("the 2-thread device's thread") {
                assert_close("2 threads, concurrent", &reference, &outputs);
            }
        });

        // One set of primitives per count, each built for its count.
        let training = SETUP.training.0.lock().expect("training cache");
        let mut counts: Vec<usize> = training.iter().map(|(n, _)| *n).collect();
        counts.sort_unstable();
        assert_eq!(counts, [1, 2, 3]);
        for (n, t) in training.iter() {
            for primitive in [&t.forward.primitive, &t.backward_data, &t.backward_weights] {
                assert_eq!(primitive.desc().threads(), *n);
            }
        }
        let inference = SETUP.inference.0.lock().expect("inference cache");
        for ((n, _), f) in inference.iter() {
            assert_eq!(f.primitive.desc().threads(), *n);
        }
        assert_eq!(inference.len(), 3 * 2, "one primitive per count and batch");
    }
}
