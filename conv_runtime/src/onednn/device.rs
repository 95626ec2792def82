//! The `OneDnn` device: the layers' convolutions run as oneDNN primitives built once per layer
//! type; everything oneDNN cannot do exactly runs the generated CPU code.
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
//! Primitives (inference per batch size, training forward, backward data, backward weights and
//! the weight/gradient reorders) live in a `static` [`ConvSetup`] per layer type, built on first
//! use under a lock and shared by all devices and threads. Weights are reordered into the layout
//! each primitive chose once per parameter change: the device caches reordered copies by the
//! weights' content stamp.

use std::sync::{Arc, Mutex, OnceLock};

use super::{
    arg, Attr, DataType, Eltwise, Engine, FormatTag, Library, Memory, MemoryDesc, Primitive, Prop,
    Stream,
};
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
        let after = |o: usize, s: usize, k: usize, i: usize, p: usize| {
            ((o - 1) * s + k) as i64 - i as i64 - p as i64
        };
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
            dst: md(&self.dst_dims(batch), FormatTag::NHWC)?,
            bias: md(&[self.out_c as i64], FormatTag::X)?,
            user_weights: md(&self.weight_dims(), FormatTag::OHWI)?,
            any_weights: md(&self.weight_dims(), FormatTag::ANY)?,
        })
    }
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

/// Everything oneDNN needs for one layer type, built on first use.
pub struct ConvSetup {
    geometry: ConvGeometry,
    training: OnceLock<std::result::Result<Training, Error>>,
    inference: Mutex<Vec<(usize, Arc<Forward>)>>,
}

impl ConvSetup {
    /// A setup for `geometry`; nothing is built until a device uses it.
    pub const fn new(geometry: ConvGeometry) -> Self {
        Self {
            geometry,
            training: OnceLock::new(),
            inference: Mutex::new(Vec::new()),
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
        let pd = super::conv_forward(
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
        )?;
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

    fn training(&self, engine: &Engine) -> Result<&Training> {
        let built = self.training.get_or_init(|| {
            let g = &self.geometry;
            let lib = engine.library();
            let d = g.descs(lib, g.batch)?;
            let (forward, hint_pd) = self.forward(engine, &d, Prop::ForwardTraining, false)?;
            let (strides, pl, pr) = g.strides_padding();
            let data_pd = super::conv_backward_data(
                engine,
                &d.src,
                &d.any_weights,
                &d.dst,
                strides,
                pl,
                pr,
                &hint_pd,
                &Attr::new(lib)?,
            )?;
            let backward_data_weights = data_pd.query_md(super::Query::Weights)?;
            let weights_pd = super::conv_backward_weights(
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
            )?;
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
        });
        built.as_ref().map_err(Clone::clone)
    }

    fn inference(&self, engine: &Engine, batch: usize) -> Result<Arc<Forward>> {
        let mut cache = self
            .inference
            .lock()
            .map_err(|_| poisoned("inference primitive cache"))?;
        if let Some((_, f)) = cache.iter().find(|(b, _)| *b == batch) {
            return Ok(f.clone());
        }
        let d = self.geometry.descs(engine.library(), batch)?;
        let forward = Arc::new(self.forward(engine, &d, Prop::ForwardInference, true)?.0);
        cache.push((batch, forward.clone()));
        Ok(forward)
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

/// The process-wide CPU engine: primitives built for one device serve every device.
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
pub struct OneDnn {
    engine: Engine,
    stream: Stream,
    cpu: Cpu,
    reordered: Vec<Reordered>,
    clock: u64,
    fallbacks: u64,
}

impl std::fmt::Debug for OneDnn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneDnn")
            .field("fallbacks", &self.fallbacks)
            .finish()
    }
}

impl OneDnn {
    /// Loads oneDNN (`$ONEDNN_LIB_DIR/libdnnl.so.3`) and opens a stream on the CPU engine.
    pub fn new() -> Result<Self> {
        let engine = engine()?;
        let stream = Stream::new(&engine)?;
        Ok(Self {
            engine,
            stream,
            cpu: Cpu::default(),
            reordered: Vec::new(),
            clock: 0,
            fallbacks: 0,
        })
    }

    /// Sets oneDNN's thread count for primitives built from now on, process-wide (default 1,
    /// for comparisons with the single-threaded generated code). Primitives are built on a
    /// layer type's first use, so call this before.
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
        let inference_forward;
        let (forward, kind) = if inference {
            inference_forward = setup.inference(&engine, batch)?;
            (&*inference_forward, batch * 2 + 1)
        } else {
            (&setup.training(&engine)?.forward, 0)
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
        let dst = self.lend(&g.dst_dims(batch), FormatTag::NHWC, y.as_mut_ptr())?;
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
        let diff_dst = self.lend(&g.dst_dims(g.batch), FormatTag::NHWC, dz.as_ptr())?;
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
        let diff_dst = self.lend(&g.dst_dims(g.batch), FormatTag::NHWC, dz.as_ptr())?;
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
