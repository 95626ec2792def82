//! Parameters in the [safetensors] format: saving and loading any [`Parameters`] (every
//! generated layer, and user types such as a linear read-out), and importing PyTorch
//! `Conv2d` / `BatchNorm2d` weights.
//!
//! # Names, layouts and dtypes
//!
//! A layer is stored under a name prefix (`conv1` below); each tensor is named
//! `<prefix>.<field>` after the visiting order of [`Parameters`] (with an empty prefix, just
//! `<field>`):
//!
//! | tensor                | shape                                   | dtype                        |
//! |-----------------------|-----------------------------------------|------------------------------|
//! | `conv1.weights`       | `[OC, KH, KW, IC]` (OHWI, as in memory) | the layer's (F64/F32/F16/BF16) |
//! | `conv1.biases`        | `[OC]`                                  | the layer's                  |
//! | `conv1.gamma`         | `[OC]` (with a norm)                    | the layer's                  |
//! | `conv1.beta`          | `[OC]` (with a norm)                    | the layer's                  |
//! | `conv1.running_mean`  | `[OC]` (BatchNorm)                      | the accumulator type's (F64 for f64 layers, F32 otherwise) |
//! | `conv1.running_var`   | `[OC]` (BatchNorm, biased variance)     | the accumulator type's       |
//!
//! Data is little-endian and row-major, exactly the tensor's memory order, so a saved file is a
//! bit-exact copy of the parameters. Other [`Parameters`] implementations are stored the same
//! way with their own field names and [`ParamTensor::shape`]s.
//!
//! Loading ([`Reader::load`]) is strict: every tensor the layer has must be in the file with
//! the same shape and dtype, and no tensor under the prefix may be left over (a file saved from
//! a layer with BatchNorm does not load into one without). Every mismatch is reported in one
//! [`Error`], and the layer is left untouched unless everything matches.
//!
//! # PyTorch
//!
//! [`import_pytorch_conv2d`] reads a `Conv2d` (and optionally the `BatchNorm2d` that follows
//! it) from a safetensors file written by PyTorch (`safetensors.torch.save_file(
//! model.state_dict(), ...)`), converting layouts and dtypes; see its documentation.
//! [`import_pytorch_network`] reads a whole `network!` from the state dict of the PyTorch
//! model that mirrors it, `Flatten`'s different order included.
//!
//! ```
//! use conv_runtime::prelude::*;
//! use conv_runtime::safetensors::{Reader, Writer};
//!
//! conv_runtime::conv2d! {
//!     pub struct Conv { input: [8, 8, 1], out_channels: 4, kernel: 3, norm: BatchNorm { momentum: 0.1, eps: 1e-5 } }
//! }
//!
//! # fn main() -> conv_runtime::Result<()> {
//! let mut conv = Conv::new(&mut Rng::seed_from_u64(1));
//! let bytes = Writer::new().add("conv", &mut conv)?.to_bytes()?;
//! let mut copy = Conv::new(&mut Rng::seed_from_u64(2));
//! Reader::from_bytes(bytes)?.load("conv", &mut copy)?;
//! assert_eq!(copy.abs_diff(&conv), 0.0);
//! # Ok(())
//! # }
//! ```
//!
//! [safetensors]: https://huggingface.co/docs/safetensors

use std::any::TypeId;
use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use crate::network::{Entries, EntryInfo, EntryKind};

use ::safetensors::tensor::{Dtype, SafeTensors, TensorView, View};

use crate::element::Element;
use crate::error::{Error, Result};
use crate::params::{ParamTensor, Parameters};

/// The header metadata [`Writer`] records, so that a file explains its own layout.
const LAYOUT_NOTE: &str = "conv2d: weights OHWI [out_channels, kernel_h, kernel_w, in_channels]; \
biases, gamma, beta, running_mean, running_var [out_channels]; running statistics in the \
accumulator type";

// -------------------------------------------------------------------------------------------
// Element types <-> safetensors dtypes

/// The safetensors dtype that stores `T` exactly, if `T` is one of the four element types.
fn dtype_of<T: Element>() -> Option<Dtype> {
    let id = TypeId::of::<T>();
    if id == TypeId::of::<f64>() {
        Some(Dtype::F64)
    } else if id == TypeId::of::<f32>() {
        Some(Dtype::F32)
    } else if id == TypeId::of::<half::f16>() {
        Some(Dtype::F16)
    } else if id == TypeId::of::<half::bf16>() {
        Some(Dtype::BF16)
    } else {
        None
    }
}

/// [`dtype_of`], or an error naming the type (a user-defined [`Element`]).
fn require_dtype<T: Element>(operation: &str) -> Result<Dtype> {
    dtype_of::<T>().ok_or_else(|| {
        Error::new(
            operation,
            format!(
                "element type {} has no safetensors dtype (supported: f64, f32, f16, bf16)",
                std::any::type_name::<T>()
            ),
        )
    })
}

/// Appends `values` to `out` as little-endian `dtype` (the dtype of `T`, so exact).
fn encode<T: Element>(values: &[T], dtype: Dtype, out: &mut Vec<u8>) {
    // Every element type widens to f64 exactly, and narrowing back to its own dtype is exact.
    for v in values {
        let x = v.to_f64();
        match dtype {
            Dtype::F64 => out.extend_from_slice(&x.to_le_bytes()),
            Dtype::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            Dtype::BF16 => out.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            _ => unreachable!("encode is only called with dtype_of's dtypes"),
        }
    }
}

/// The values of a floating-point tensor as f64 (exact for every dtype accepted).
fn decode(view: &TensorView<'_>) -> std::result::Result<Vec<f64>, String> {
    let data = view.data();
    // `chunks_exact` on the byte slice: the data of a tensor in a file is not necessarily
    // aligned for its element type, so it is never reinterpreted in place.
    let values = match view.dtype() {
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect(),
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        other => return Err(format!("dtype {other} is not a floating-point type")),
    };
    Ok(values)
}

/// `prefix.name`, or `name` for an empty prefix.
fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Whether `name` lies under `prefix` (`prefix.*`; with an empty prefix: has no dot).
fn under(prefix: &str, name: &str) -> bool {
    if prefix.is_empty() {
        !name.contains('.')
    } else {
        name.strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
    }
}

// -------------------------------------------------------------------------------------------
// Writing

/// One tensor to write, already encoded.
struct Encoded {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Encoded {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Collects the parameters of several layers under name prefixes, then writes them as one
/// safetensors file (see the [module documentation](self) for names and layouts).
///
/// ```no_run
/// # use conv_runtime::prelude::*;
/// # conv_runtime::conv2d! { pub struct Conv1 { input: [8, 8, 1], out_channels: 4, kernel: 3 } }
/// # conv_runtime::conv2d! { pub struct Conv2 { input: [6, 6, 4], out_channels: 4, kernel: 3 } }
/// # let mut rng = Rng::seed_from_u64(0);
/// # let (mut conv1, mut conv2) = (Conv1::new(&mut rng), Conv2::new(&mut rng));
/// conv_runtime::safetensors::Writer::new()
///     .add("conv1", &mut conv1)?
///     .add("conv2", &mut conv2)?
///     .write_file("model.safetensors")?;
/// # Ok::<(), conv_runtime::Error>(())
/// ```
#[derive(Default)]
pub struct Writer {
    tensors: Vec<(String, Encoded)>,
}

impl Writer {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `layer`'s trainable parameters and buffers as `prefix.<name>`.
    ///
    /// It takes `&mut` only because [`Parameters`] exposes shapes and running statistics through
    /// its mutable visitors; nothing is changed (not even the tensors' content stamps, so cached
    /// packed weights stay valid). Fails on a name already added, or an element type without a
    /// safetensors dtype.
    pub fn add<P: Parameters>(&mut self, prefix: &str, layer: &mut P) -> Result<&mut Self> {
        let operation = format!("saving `{prefix}` as safetensors");
        let elem = require_dtype::<P::Elem>(&operation)?;
        let acc = require_dtype::<<P::Elem as Element>::Acc>(&operation)?;
        let mut added = Vec::new();
        layer.visit_params_mut(&mut |name, tensor: &mut dyn ParamTensor<P::Elem>| {
            added.push(encoded(join(prefix, name), tensor, elem));
        });
        layer.visit_buffers_mut(
            &mut |name, tensor: &mut dyn ParamTensor<<P::Elem as Element>::Acc>| {
                added.push(encoded(join(prefix, name), tensor, acc));
            },
        );
        for (name, _) in &added {
            if self.tensors.iter().any(|(n, _)| n == name) {
                return Err(Error::new(
                    operation,
                    format!("tensor `{name}` was already added"),
                ));
            }
        }
        self.tensors.extend(added);
        Ok(self)
    }

    /// Names of the tensors added so far, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        ::safetensors::serialize(self.views(), Some(metadata()))
            .map_err(|e| Error::new("serializing safetensors", e.to_string()))
    }

    /// Writes the file to `path` (through a temporary file in the same folder that is then
    /// renamed, so an existing file is replaced whole or not at all).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        ::safetensors::serialize_to_file(self.views(), Some(metadata()), path).map_err(|e| {
            Error::new(
                format!("writing safetensors file {}", path.display()),
                e.to_string(),
            )
        })
    }

    fn views(&self) -> impl Iterator<Item = (&str, &Encoded)> {
        self.tensors.iter().map(|(n, t)| (n.as_str(), t))
    }
}

fn metadata() -> HashMap<String, String> {
    HashMap::from([("layout".to_string(), LAYOUT_NOTE.to_string())])
}

fn encoded<T: Element>(
    name: String,
    tensor: &dyn ParamTensor<T>,
    dtype: Dtype,
) -> (String, Encoded) {
    let values = tensor.values();
    let mut data = Vec::with_capacity(values.len() * dtype.bitsize() / 8);
    encode(values, dtype, &mut data);
    (
        name,
        Encoded {
            dtype,
            shape: tensor.shape().to_vec(),
            data,
        },
    )
}

// -------------------------------------------------------------------------------------------
// Reading

/// A safetensors file in memory, from which layers are loaded by prefix.
pub struct Reader {
    /// Where the bytes came from, for messages.
    source: String,
    bytes: Vec<u8>,
}

impl Reader {
    /// Reads and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let source = format!("safetensors file {}", path.display());
        let bytes = std::fs::read(path)
            .map_err(|e| Error::new(format!("reading {source}"), e.to_string()))?;
        Self::with_source(source, bytes)
    }

    /// Validates `bytes` as a safetensors file.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::with_source("safetensors data".to_string(), bytes)
    }

    fn with_source(source: String, bytes: Vec<u8>) -> Result<Self> {
        let reader = Self { source, bytes };
        reader.parse()?;
        Ok(reader)
    }

    /// The file's header, parsed again on each use: cheap next to the data, and it keeps the
    /// reader free of self-references.
    fn parse(&self) -> Result<SafeTensors<'_>> {
        parse(&self.source, &self.bytes)
    }

    /// The names of the tensors in the file, sorted.
    pub fn names(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = self
            .parse()?
            .names()
            .into_iter()
            .map(String::from)
            .collect();
        names.sort();
        Ok(names)
    }

    /// The shape and values (as f64, exactly) of the floating-point tensor `name`: for data kept
    /// beside parameters (inputs, expected outputs), or to inspect a file.
    pub fn tensor_f64(&self, name: &str) -> Result<(Vec<usize>, Vec<f64>)> {
        let operation = format!("reading tensor `{name}` from {}", self.source);
        let file = self.parse()?;
        let view = file
            .tensor(name)
            .map_err(|_| Error::new(&operation, format!("missing tensor `{name}`")))?;
        let values = decode(&view).map_err(|reason| Error::new(&operation, reason))?;
        Ok((view.shape().to_vec(), values))
    }

    /// Loads `layer`'s parameters and buffers from the tensors `prefix.<name>`.
    ///
    /// Every tensor the layer has must be present with the layer's shape and dtype (running
    /// statistics in the accumulator type), and no other tensor may be under `prefix.`; all
    /// mismatches are reported together, and on error the layer is unchanged.
    pub fn load<P: Parameters>(&self, prefix: &str, layer: &mut P) -> Result<()> {
        let file = self.parse()?;
        load(&file, &self.source, prefix, layer)
    }

    /// [`import_pytorch_conv2d`] from this file.
    pub fn import_pytorch_conv2d<P: Parameters>(
        &self,
        conv: &str,
        norm: Option<&str>,
        layer: &mut P,
    ) -> Result<()> {
        let file = self.parse()?;
        import(&file, &self.source, conv, norm, layer)
    }

    /// [`import_pytorch_network`] from this file.
    pub fn import_pytorch_network<N: Parameters + Entries>(
        &self,
        modules: &[(&str, &str)],
        net: &mut N,
    ) -> Result<()> {
        let file = self.parse()?;
        import_network(&file, &self.source, modules, net)
    }
}

fn parse<'a>(source: &str, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| {
        Error::new(
            format!("reading {source}"),
            format!("not a valid safetensors file: {e}"),
        )
    })
}

/// What one tensor of the layer is to be filled from.
struct Source {
    /// The tensor's name in the file.
    name: String,
    /// The shape it must have there.
    shape: Vec<usize>,
    /// How the file's layout maps to ours.
    layout: Layout,
    /// The value to fill with when the tensor is absent; `None`: it is required.
    default: Option<f64>,
}

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Same order.
    Same,
    /// PyTorch's OIHW weights into our OHWI.
    Oihw,
    /// PyTorch's `Linear` weights `[out, in]` after an `nn.Flatten` of an NCHW map `[c, h,
    /// w]`, into ours, whose inputs are the NHWC map flattened in `(h, w, c)` order.
    Flattened([usize; 3]),
}

/// The dtype rule of a load.
#[derive(Clone, Copy)]
enum Dtypes {
    /// The file's dtype must be exactly this one.
    Exact(Dtype),
    /// Any floating-point dtype, rounded to the layer's type.
    AnyFloat,
}

/// Checks one source against the file, collecting problems; returns the tensor to read (`None`
/// when it is absent).
fn check<'a>(
    file: &SafeTensors<'a>,
    source: &Source,
    dtypes: Dtypes,
    problems: &mut Vec<String>,
) -> Option<TensorView<'a>> {
    let view = match file.tensor(&source.name) {
        Ok(view) => view,
        Err(_) if source.default.is_some() => return None,
        Err(_) => {
            problems.push(format!("missing tensor `{}`", source.name));
            return None;
        }
    };
    if view.shape() != source.shape.as_slice() {
        problems.push(format!(
            "tensor `{}` has shape {:?}, expected {:?}",
            source.name,
            view.shape(),
            source.shape
        ));
    }
    match dtypes {
        Dtypes::Exact(dtype) if view.dtype() != dtype => problems.push(format!(
            "tensor `{}` has dtype {}, expected {dtype}",
            source.name,
            view.dtype()
        )),
        Dtypes::AnyFloat
            if !matches!(
                view.dtype(),
                Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16
            ) =>
        {
            problems.push(format!(
                "tensor `{}` has dtype {}, expected a floating-point dtype (F64, F32, F16, BF16)",
                source.name,
                view.dtype()
            ))
        }
        _ => {}
    }
    Some(view)
}

/// Fills `tensor` from `view` (already checked) or with the source's default.
fn fill<T: Element>(
    tensor: &mut dyn ParamTensor<T>,
    source: &Source,
    view: Option<&TensorView<'_>>,
) -> std::result::Result<(), String> {
    let Some(view) = view else {
        let value = T::from_f64(source.default.unwrap_or(0.0));
        tensor.values_mut().fill(value);
        return Ok(());
    };
    let values = decode(view)?;
    let out = tensor.values_mut();
    if values.len() != out.len() {
        // Unreachable after `check`, kept so a logic error cannot write out of bounds.
        return Err(format!(
            "tensor `{}` has {} values, expected {}",
            source.name,
            values.len(),
            out.len()
        ));
    }
    match source.layout {
        Layout::Same => {
            for (o, v) in out.iter_mut().zip(values) {
                *o = T::from_f64(v);
            }
        }
        Layout::Oihw => {
            // The file's shape is [OC, IC, KH, KW]; ours is [OC][KH][KW][IC], written in order.
            let [_, ic, kh, kw] = source.shape[..] else {
                return Err(format!("tensor `{}` is not 4-dimensional", source.name));
            };
            let mut ours = out.iter_mut();
            for o in 0..values.len() / (ic * kh * kw).max(1) {
                for y in 0..kh {
                    for x in 0..kw {
                        for c in 0..ic {
                            if let Some(slot) = ours.next() {
                                *slot = T::from_f64(values[((o * ic + c) * kh + y) * kw + x]);
                            }
                        }
                    }
                }
            }
        }
        Layout::Flattened([h, w, c]) => {
            // Row `o` of the file is `[c][h][w]`; ours is `[h][w][c]`, written in order.
            let features = h * w * c;
            let mut ours = out.iter_mut();
            for o in 0..values.len() / features.max(1) {
                for y in 0..h {
                    for x in 0..w {
                        for ch in 0..c {
                            if let Some(slot) = ours.next() {
                                *slot = T::from_f64(values[o * features + (ch * h + y) * w + x]);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs the two passes of a load: check everything, then (only if nothing is wrong) write.
fn two_pass<P: Parameters>(
    file: &SafeTensors<'_>,
    operation: String,
    layer: &mut P,
    dtypes: (Dtypes, Dtypes),
    mut source_of: impl FnMut(&str, &[usize]) -> std::result::Result<Source, String>,
    extra_problems: impl FnOnce(&BTreeSet<String>) -> Vec<String>,
) -> Result<()> {
    // Pass 1: where each tensor comes from, and whether the file has it as expected.
    let mut problems = Vec::new();
    let mut params = Vec::new();
    let mut buffers = Vec::new();
    layer.visit_params_mut(
        &mut |name, tensor: &mut dyn ParamTensor<P::Elem>| match source_of(name, tensor.shape()) {
            Ok(s) => params.push(s),
            Err(p) => problems.push(p),
        },
    );
    layer.visit_buffers_mut(
        &mut |name, tensor: &mut dyn ParamTensor<<P::Elem as Element>::Acc>| match source_of(
            name,
            tensor.shape(),
        ) {
            Ok(s) => buffers.push(s),
            Err(p) => problems.push(p),
        },
    );
    let mut views = Vec::new();
    for s in &params {
        views.push(check(file, s, dtypes.0, &mut problems));
    }
    for s in &buffers {
        views.push(check(file, s, dtypes.1, &mut problems));
    }
    let used: BTreeSet<String> = params
        .iter()
        .chain(&buffers)
        .map(|s| s.name.clone())
        .collect();
    problems.extend(extra_problems(&used));
    if !problems.is_empty() {
        return Err(Error::new(operation, problems.join("; ")));
    }

    // Pass 2: every tensor matched; copy (visiting order is fixed, so the lists line up).
    let (param_views, buffer_views) = views.split_at(params.len());
    let mut index = 0;
    layer.visit_params_mut(&mut |_, tensor: &mut dyn ParamTensor<P::Elem>| {
        if let (Some(s), Some(v)) = (params.get(index), param_views.get(index)) {
            if let Err(p) = fill(tensor, s, v.as_ref()) {
                problems.push(p);
            }
        }
        index += 1;
    });
    let mut index = 0;
    layer.visit_buffers_mut(
        &mut |_, tensor: &mut dyn ParamTensor<<P::Elem as Element>::Acc>| {
            if let (Some(s), Some(v)) = (buffers.get(index), buffer_views.get(index)) {
                if let Err(p) = fill(tensor, s, v.as_ref()) {
                    problems.push(p);
                }
            }
            index += 1;
        },
    );
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::new(operation, problems.join("; ")))
    }
}

fn load<P: Parameters>(
    file: &SafeTensors<'_>,
    source: &str,
    prefix: &str,
    layer: &mut P,
) -> Result<()> {
    let operation = format!("loading `{prefix}` from {source}");
    let elem = require_dtype::<P::Elem>(&operation)?;
    let acc = require_dtype::<<P::Elem as Element>::Acc>(&operation)?;
    two_pass(
        file,
        operation,
        layer,
        (Dtypes::Exact(elem), Dtypes::Exact(acc)),
        |name, shape| {
            Ok(Source {
                name: join(prefix, name),
                shape: shape.to_vec(),
                layout: Layout::Same,
                default: None,
            })
        },
        |used| {
            let mut extra: Vec<String> = file
                .names()
                .into_iter()
                .filter(|n| under(prefix, n) && !used.contains(*n))
                .map(|n| format!("unexpected tensor `{n}`: the layer has no such parameter"))
                .collect();
            extra.sort();
            extra
        },
    )
}

// -------------------------------------------------------------------------------------------
// PyTorch

/// Imports a PyTorch `Conv2d` (tensors `{conv}.weight`, `{conv}.bias`) and, with `norm`, the
/// `BatchNorm2d` after it (`{norm}.weight`, `.bias`, `.running_mean`, `.running_var`) into a
/// generated layer, from the bytes of a safetensors file such as
/// `safetensors.torch.save_file(model.state_dict(), path)` writes.
///
/// - `weight` `[OC, IC, KH, KW]` (OIHW) is transposed into our `weights` `[OC, KH, KW, IC]`.
/// - `bias` goes into `biases`; a `Conv2d(bias=False)` has none, and the biases are set to 0.
/// - BatchNorm's `weight` and `bias` go into `gamma` and `beta` (absent with `affine=False`:
///   1 and 0), `running_mean` and `running_var` into the running statistics, unchanged.
///   PyTorch's running variance is updated with the *unbiased* batch variance and ours with
///   the biased one, but both use the stored value as is in evaluation, so the imported layer's
///   `evaluate` computes PyTorch's `eval()` output. `num_batches_tracked` is ignored.
/// - A layer with LayerNorm takes `{norm}.weight` / `.bias` of a `GroupNorm(1, OC)`, which
///   normalizes the same way (per sample, over channels and pixels, per-channel affine).
/// - Values in F64, F32, F16 or BF16 are rounded to the layer's element type.
///
/// What the file cannot tell is the caller's to match: stride, padding (zeros), dilation 1,
/// groups 1, BatchNorm's `eps` (PyTorch's default is 1e-5) and the activation. Shapes are
/// checked, and all problems (missing tensors, shapes `[got]` vs `[expected]` in PyTorch's
/// layout, non-float dtypes, a BatchNorm file for a layer without running statistics, a norm
/// prefix given or not given for a layer with or without a norm) come back in one error; on
/// error the layer is unchanged.
pub fn import_pytorch_conv2d<P: Parameters>(
    safetensors: &[u8],
    conv: &str,
    norm: Option<&str>,
    layer: &mut P,
) -> Result<()> {
    let source = "PyTorch safetensors data";
    let file = parse(source, safetensors)?;
    import(&file, source, conv, norm, layer)
}

fn import<P: Parameters>(
    file: &SafeTensors<'_>,
    source: &str,
    conv: &str,
    norm: Option<&str>,
    layer: &mut P,
) -> Result<()> {
    let operation = match norm {
        Some(norm) => format!("importing PyTorch `{conv}` + `{norm}` from {source}"),
        None => format!("importing PyTorch `{conv}` from {source}"),
    };
    let mut has_gamma = false;
    let mut has_running = false;
    layer.visit_params_mut(&mut |name, _: &mut dyn ParamTensor<P::Elem>| {
        has_gamma |= name == "gamma";
    });
    layer.visit_buffers_mut(
        &mut |_, _: &mut dyn ParamTensor<<P::Elem as Element>::Acc>| {
            has_running = true;
        },
    );

    let mut problems = Vec::new();
    match (norm, has_gamma) {
        (Some(n), false) => problems.push(format!(
            "a norm `{n}` was given but the layer has no normalization"
        )),
        (None, true) => problems.push(
            "the layer has a normalization (gamma, beta) but no norm prefix was given".to_string(),
        ),
        _ => {}
    }
    if let Some(n) = norm {
        let names = file.names();
        if !names.iter().any(|name| under(n, name)) {
            problems.push(format!("no tensor named `{n}.*` in the file"));
        } else if !has_running && file.tensor(&join(n, "running_mean")).is_ok() {
            problems.push(format!(
                "`{n}` is a BatchNorm (it has running_mean) but the layer has no running statistics"
            ));
        }
    }
    if !problems.is_empty() {
        return Err(Error::new(operation, problems.join("; ")));
    }

    let norm = norm.unwrap_or("");
    two_pass(
        file,
        operation,
        layer,
        (Dtypes::AnyFloat, Dtypes::AnyFloat),
        |name, shape| conv_source(name, shape, conv, norm),
        |_| Vec::new(),
    )
}

/// Where a convolution layer's tensor `name` (of our `shape`) comes from in a PyTorch state
/// dict: the `Conv2d` module `conv` and the norm module `norm` after it.
fn conv_source(
    name: &str,
    shape: &[usize],
    conv: &str,
    norm: &str,
) -> std::result::Result<Source, String> {
    let (name, shape, layout, default) = match (name, shape) {
        ("weights", &[oc, kh, kw, ic]) => (
            join(conv, "weight"),
            vec![oc, ic, kh, kw],
            Layout::Oihw,
            None,
        ),
        ("biases", _) => (join(conv, "bias"), shape.to_vec(), Layout::Same, Some(0.0)),
        ("gamma", _) => (
            join(norm, "weight"),
            shape.to_vec(),
            Layout::Same,
            Some(1.0),
        ),
        ("beta", _) => (join(norm, "bias"), shape.to_vec(), Layout::Same, Some(0.0)),
        ("running_mean" | "running_var", _) => {
            (join(norm, name), shape.to_vec(), Layout::Same, None)
        }
        _ => {
            return Err(format!(
                "the layer's `{name}` {shape:?} has no PyTorch Conv2d/BatchNorm2d counterpart"
            ))
        }
    };
    Ok(Source {
        name,
        shape,
        layout,
        default,
    })
}

/// Imports a whole network generated by `network!` from a PyTorch state dict saved as
/// safetensors (`safetensors.torch.save_file(model.state_dict(), path)`).
///
/// Module names follow the `nn.Sequential` that mirrors the network entry for entry, unless
/// `modules` says otherwise:
///
/// - `Conv2d`: a `Conv2d`, then (with a norm) a `BatchNorm2d` (a `GroupNorm(1, C)` for
///   LayerNorm), then (with an activation other than Identity) the activation module;
/// - `Dense`: a `Linear`, then the activation module if any;
/// - `MaxPool2d`, `AvgPool2d`, `Activation` and `Flatten`: one module each (no tensors);
/// - `Residual`: one module whose children are the inner list, indexed from 0 (such as
///   `class Residual(nn.Sequential)` with `forward` returning `x + super().forward(x)`).
///
/// So `Conv2d { activation: Relu }, Flatten, Dense { .. }` reads `0.weight`, `0.bias`,
/// `3.weight` and `3.bias`. `modules` maps an entry (its dotted path, `stack1.res1.conv`) to
/// the PyTorch module it comes from instead (for a residual block: the module holding its
/// children), and `<entry>.norm` to a convolution's norm module: `&[("conv1", "features.0"),
/// ("conv1.norm", "features.1"), ("fc", "head.fc")]`. Entries not listed keep their
/// `nn.Sequential` names, counted as above.
///
/// Layouts: convolution weights as in [`import_pytorch_conv2d`] (OIHW to OHWI, norms likewise);
/// `Linear` weights `[out, in]` as they are, except after a `Flatten` of a map: PyTorch
/// flattens NCHW maps in `(c, h, w)` order and we flatten NHWC ones in `(h, w, c)`, so that
/// layer's columns are permuted (the network knows the map's shape: [`Entries`]). Missing
/// biases (`bias=False`) are zeros, a missing affine norm is 1 and 0; values in any float
/// dtype are rounded to the network's.
///
/// Every mismatch (a missing tensor, a shape, a `modules` key naming no entry, a `weight`,
/// `bias` or running statistic in the file that no entry takes) comes back in one error, and
/// the network is unchanged unless everything matches.
pub fn import_pytorch_network<N: Parameters + Entries>(
    safetensors: &[u8],
    modules: &[(&str, &str)],
    net: &mut N,
) -> Result<()> {
    let source = "PyTorch safetensors data";
    let file = parse(source, safetensors)?;
    import_network(&file, source, modules, net)
}

/// The PyTorch modules of a network entry with tensors.
enum Module {
    /// A `Conv2d` and the norm module after it (unused without a norm).
    Conv { conv: String, norm: String },
    /// A `Linear`, with its weights' layout.
    Dense { linear: String, layout: Layout },
}

/// The PyTorch modules of each of a network's entries with tensors, by the entry's dotted
/// path; the keys of `modules` that named an entry go into `used_keys`.
fn network_modules(
    entries: &[EntryInfo],
    ours: &str,
    theirs: &str,
    modules: &[(&str, &str)],
    used_keys: &mut BTreeSet<String>,
    out: &mut HashMap<String, Module>,
) {
    let mut index = 0;
    let mut next = || {
        index += 1;
        index - 1
    };
    let module_of = |path: &str, default: usize, used_keys: &mut BTreeSet<String>| match modules
        .iter()
        .find(|(key, _)| *key == path)
    {
        Some((key, module)) => {
            used_keys.insert(key.to_string());
            module.to_string()
        }
        None => join(theirs, &default.to_string()),
    };
    for entry in entries {
        let path = join(ours, entry.name);
        match entry.kind {
            EntryKind::Conv2d { norm, activation } => {
                let conv = module_of(&path, next(), used_keys);
                let norm = if norm {
                    module_of(&join(&path, "norm"), next(), used_keys)
                } else {
                    String::new()
                };
                if activation {
                    next();
                }
                out.insert(path, Module::Conv { conv, norm });
            }
            EntryKind::Dense {
                flattened,
                activation,
            } => {
                let linear = module_of(&path, next(), used_keys);
                let layout = if flattened[0] * flattened[1] > 1 {
                    Layout::Flattened(flattened)
                } else {
                    Layout::Same
                };
                if activation {
                    next();
                }
                out.insert(path, Module::Dense { linear, layout });
            }
            EntryKind::Residual(inner) => {
                let block = module_of(&path, next(), used_keys);
                network_modules(inner, &path, &block, modules, used_keys, out);
            }
            EntryKind::MaxPool2d
            | EntryKind::AvgPool2d
            | EntryKind::Activation
            | EntryKind::Flatten => {
                next();
            }
        }
    }
}

fn import_network<N: Parameters + Entries>(
    file: &SafeTensors<'_>,
    source: &str,
    modules: &[(&str, &str)],
    net: &mut N,
) -> Result<()> {
    let operation = format!("importing a PyTorch network from {source}");
    let mut used_keys = BTreeSet::new();
    let mut entries = HashMap::new();
    network_modules(N::ENTRIES, "", "", modules, &mut used_keys, &mut entries);
    let mut unknown: Vec<String> = modules
        .iter()
        .filter(|(key, _)| !used_keys.contains(*key))
        .map(|(key, _)| format!("`{key}` in the module names is no entry (or norm) of the network"))
        .collect();
    unknown.sort();
    two_pass(
        file,
        operation,
        net,
        (Dtypes::AnyFloat, Dtypes::AnyFloat),
        |name, shape| {
            let no_counterpart = || format!("the network's `{name}` has no PyTorch counterpart");
            let (entry, field) = name.rsplit_once('.').ok_or_else(no_counterpart)?;
            match (entries.get(entry), field) {
                (Some(Module::Conv { conv, norm }), _) => conv_source(field, shape, conv, norm),
                (Some(Module::Dense { linear, layout }), "weights" | "biases") => {
                    let (theirs, layout, default) = if field == "weights" {
                        ("weight", *layout, None)
                    } else {
                        ("bias", Layout::Same, Some(0.0))
                    };
                    Ok(Source {
                        name: join(linear, theirs),
                        shape: shape.to_vec(),
                        layout,
                        default,
                    })
                }
                _ => Err(no_counterpart()),
            }
        },
        |used| {
            let mut extra = unknown;
            let mut left: Vec<String> = file
                .names()
                .into_iter()
                .filter(|n| {
                    let field = n.rsplit('.').next().unwrap_or("");
                    matches!(field, "weight" | "bias" | "running_mean" | "running_var")
                        && !used.contains(*n)
                })
                .map(|n| format!("unexpected tensor `{n}`: no entry of the network takes it"))
                .collect();
            left.sort();
            extra.extend(left);
            extra
        },
    )
}
