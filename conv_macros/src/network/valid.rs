//! [`ast::Input`] (a `network!` body) -> [`Network`]: every check, each error at the entry or
//! token it is about. Shapes are chained entry by entry; `Conv2d` entries are validated as the
//! `conv2d!` specs they are (`crate::valid`), with the network's input shape, batch and dtype.

use proc_macro2::Span;
use syn::Ident;

use super::spec::{window_output, Entry, Kind, Network, Pool, PoolKind, Shape};
use crate::ast::{self, Value};
use crate::spec::{Activation, Dtype, Init, Norm, Spec};
use crate::valid::{self as layer, Ctxt};

const KEYS: [&str; 4] = ["input", "batch", "dtype", "layers"];
const KINDS: [&str; 7] = [
    "Conv2d",
    "MaxPool2d",
    "AvgPool2d",
    "Activation",
    "Flatten",
    "Dense",
    "Residual",
];
/// The keys of a `Conv2d` entry: `conv2d!`'s, less the ones the network sets.
const CONV_KEYS: [&str; 7] = [
    "out_channels",
    "kernel",
    "stride",
    "padding",
    "activation",
    "norm",
    "init",
];

pub fn validate(input: ast::Input) -> syn::Result<Network> {
    let mut cx = Ctxt::default();
    let top = layer::fields(&mut cx, "network", &input.entries, &KEYS);
    let get = |key: &str| top.iter().find(|e| e.key == key).map(|e| &e.value);
    let missing = |cx: &mut Ctxt, key: &str, what: &str| {
        cx.error(
            input.ident.span(),
            format_args!(
                "missing required key `{key}` ({what}) in the network `{}`",
                input.ident
            ),
        )
    };
    let shape = match get("input") {
        Some(v) => shape3(&mut cx, v),
        None => {
            missing(&mut cx, "input", "`[height, width, channels]`");
            None
        }
    };
    let batch = get("batch").map_or(Some(1), |v| layer::integer(&mut cx, v, "batch", 1));
    let dtype = get("dtype").map_or(Some(Dtype::F32), |v| {
        layer::named_choice(&mut cx, v, "dtype", &Dtype::ALL)
    });
    let layers = match get("layers") {
        Some(Value::List { entries, span }) => Some((entries, *span)),
        Some(Value::Array { items, span }) if items.is_empty() => {
            cx.error(
                *span,
                "a network needs at least one layer: `layers: [name: Kind, ...]`",
            );
            None
        }
        Some(other) => {
            cx.at(
                other,
                format_args!(
                    "`layers` must be a list `[name: Kind, ...]`, found {}",
                    other.describe()
                ),
            );
            None
        }
        None => {
            missing(&mut cx, "layers", "`[name: Kind, ...]`");
            None
        }
    };
    let (Some(shape), Some(batch), Some(dtype), Some((layers, span))) =
        (shape, batch, dtype, layers)
    else {
        cx.check()?;
        return Err(syn::Error::new(input.body_span, "invalid network! spec"));
    };
    let chain = Chain { batch, dtype };
    let entries = chain.list(&mut cx, layers, span, Shape::Map(shape), "");
    cx.check()?;
    Ok(Network {
        attrs: input.attrs,
        vis: input.vis,
        ident: input.ident,
        input: shape,
        batch,
        dtype,
        entries: entries.ok_or_else(|| syn::Error::new(span, "invalid layers"))?,
    })
}

/// What every entry shares.
struct Chain {
    batch: usize,
    dtype: Dtype,
}

impl Chain {
    /// The entries of a list from `input` on, or `None` after reporting why the chain broke.
    /// `prefix` is the path of the enclosing residual block (`"block__"`), or empty.
    fn list(
        &self,
        cx: &mut Ctxt,
        list: &[ast::Entry],
        span: Span,
        input: Shape,
        prefix: &str,
    ) -> Option<Vec<Entry>> {
        if list.is_empty() {
            cx.error(span, "a layer list needs at least one entry");
            return None;
        }
        let mut seen: Vec<&Ident> = Vec::new();
        let mut out = Vec::new();
        let mut shape = input;
        for e in list {
            let name = e.key.to_string();
            if name.contains("__") {
                cx.error(
                    e.key.span(),
                    format_args!("entry names may not contain `__` (`{name}`): the network's generated names join paths with it"),
                );
            }
            if seen.contains(&&e.key) {
                cx.error(
                    e.key.span(),
                    format_args!("duplicate entry name `{name}`: names are unique within a list"),
                );
            }
            seen.push(&e.key);
            let path = format!("{prefix}{name}");
            let kind = self.entry(cx, e, &path, shape)?;
            let output = match &kind {
                Kind::Conv(spec) => Shape::Map([spec.out_h(), spec.out_w(), spec.out_channels]),
                Kind::Dense(spec) => Shape::Flat(spec.out_channels),
                Kind::Pool(_, p) => {
                    let [h, w, c] = shape.dims();
                    Shape::Map([
                        window_output(h, p.padding[0], p.kernel[0], p.stride[0]),
                        window_output(w, p.padding[1], p.kernel[1], p.stride[1]),
                        c,
                    ])
                }
                Kind::Activation(_) | Kind::Residual(_) => shape,
                Kind::Flatten => Shape::Flat(shape.len()),
            };
            out.push(Entry {
                name: e.key.clone(),
                path,
                kind,
                input: shape,
                output,
            });
            shape = output;
        }
        Some(out)
    }

    /// One entry's kind, checked against its input shape.
    fn entry(&self, cx: &mut Ctxt, e: &ast::Entry, path: &str, input: Shape) -> Option<Kind> {
        let (kind, fields) = match &e.value {
            Value::Named { name, fields } => (name, fields.as_ref()),
            Value::Call { name, args, span } if name == "Activation" => {
                return match args.as_slice() {
                    [arg] => layer::named_choice(cx, arg, "activation", &Activation::ALL)
                        .map(Kind::Activation),
                    _ => {
                        cx.error(
                            *span,
                            "`Activation` takes one activation, e.g. `Activation(Relu)`",
                        );
                        None
                    }
                };
            }
            other => {
                cx.at(
                    other,
                    format_args!(
                        "expected a layer kind ({}), found {}",
                        KINDS.join(", "),
                        other.describe()
                    ),
                );
                return None;
            }
        };
        let entries = fields.map_or(&[][..], |(f, _)| f.as_slice());
        let body = fields.map_or(kind.span(), |(_, span)| *span);
        let map_input = |cx: &mut Ctxt, what: &str| match input {
            Shape::Map(dims) => Some(dims),
            Shape::Flat(n) => {
                cx.error(
                    kind.span(),
                    format_args!("`{what}` needs a map input, but its input is flat ({n} features): move it before the `Flatten`"),
                );
                None
            }
        };
        match kind.to_string().as_str() {
            "Conv2d" => {
                let dims = map_input(cx, "Conv2d");
                for f in entries {
                    let key = f.key.to_string();
                    if ["input", "batch", "dtype"].contains(&key.as_str()) {
                        cx.error(
                            f.key.span(),
                            format_args!("`{key}` of a Conv2d entry is the network's: its input is the previous entry's output, and `batch` and `dtype` are set once for the whole network"),
                        );
                    } else if !CONV_KEYS.contains(&key.as_str()) {
                        cx.error(
                            f.key.span(),
                            layer::unknown("key of `Conv2d`", &key, &CONV_KEYS),
                        );
                    }
                }
                let own: Vec<ast::Entry> = entries
                    .iter()
                    .filter(|f| CONV_KEYS.contains(&f.key.to_string().as_str()))
                    .cloned()
                    .collect();
                let spec = self.conv(cx, e, path, dims?, own, body)?;
                Some(Kind::Conv(Box::new(spec)))
            }
            "Dense" => {
                let f = layer::fields(
                    cx,
                    "Dense",
                    entries,
                    &["out_features", "activation", "init"],
                );
                let get = |key: &str| f.iter().find(|e| e.key == key).map(|e| &e.value);
                let out = match get("out_features") {
                    Some(v) => layer::integer(cx, v, "out_features", 1),
                    None => {
                        cx.error(
                            kind.span(),
                            "missing required field `out_features` of `Dense`",
                        );
                        None
                    }
                };
                let activation = get("activation").map_or(Some(Activation::Identity), |v| {
                    layer::named_choice(cx, v, "activation", &Activation::ALL)
                });
                let init = get("init").map_or(
                    Some(Init::KaimingUniform {
                        legacy: true,
                        scale: 1.0,
                    }),
                    |v| layer::init(cx, v),
                );
                let features = match input {
                    Shape::Flat(n) => Some(n),
                    Shape::Map(dims) => {
                        cx.error(
                            kind.span(),
                            format_args!("`Dense` needs a flat input, but its input is a {}x{}x{} map: add `flat: Flatten` before it", dims[0], dims[1], dims[2]),
                        );
                        None
                    }
                };
                let spec = Spec {
                    attrs: Vec::new(),
                    vis: syn::parse_quote!(pub),
                    ident: Ident::new(path, e.key.span()),
                    input: [1, 1, features?],
                    out_channels: out?,
                    kernel: [1, 1],
                    stride: [1, 1],
                    padding: [0, 0],
                    activation: activation?,
                    norm: Norm::None,
                    batch: self.batch,
                    dtype: self.dtype,
                    init: init?,
                };
                Some(Kind::Dense(Box::new(spec)))
            }
            "MaxPool2d" | "AvgPool2d" => {
                let what = kind.to_string();
                let f = layer::fields(cx, &what, entries, &["kernel", "stride", "padding"]);
                let get = |key: &str| f.iter().find(|e| e.key == key).map(|e| &e.value);
                let window = match get("kernel") {
                    Some(v) => layer::pair(cx, v, "kernel", 1),
                    None => {
                        cx.error(
                            kind.span(),
                            format_args!("missing required field `kernel` of `{what}`"),
                        );
                        None
                    }
                };
                let stride = match get("stride") {
                    Some(v) => layer::pair(cx, v, "stride", 1),
                    None => window,
                };
                let padding =
                    get("padding").map_or(Some([0, 0]), |v| layer::pair(cx, v, "padding", 0));
                let dims = map_input(cx, &what);
                let (window, stride, padding, dims) = (window?, stride?, padding?, dims?);
                let mut fits = true;
                for (axis, side) in ["height", "width"].iter().enumerate() {
                    // PyTorch's rule: a window must keep one real input.
                    if 2 * padding[axis] > window[axis] {
                        fits = false;
                        let at = get("padding").map_or(kind.span(), |v| v.span());
                        cx.error(at, format_args!(
                            "pooling padding {side} {} is more than half the kernel {side} {}: a window must cover at least one input",
                            padding[axis], window[axis]
                        ));
                    }
                    let room = dims[axis] + 2 * padding[axis];
                    if window[axis] > room {
                        fits = false;
                        let at = get("kernel").map_or(kind.span(), |v| v.span());
                        cx.error(at, format_args!(
                            "pooling kernel {side} {} is larger than the padded input {side} {room} ({} + 2 * padding {})",
                            window[axis], dims[axis], padding[axis]
                        ));
                    }
                }
                let pool = if what == "MaxPool2d" {
                    PoolKind::Max
                } else {
                    PoolKind::Avg
                };
                fits.then_some(Kind::Pool(
                    pool,
                    Pool {
                        kernel: window,
                        stride,
                        padding,
                    },
                ))
            }
            "Flatten" => {
                if fields.is_some() {
                    cx.error(kind.span(), "`Flatten` takes no fields");
                }
                map_input(cx, "Flatten").map(|_| Kind::Flatten)
            }
            "Activation" => {
                cx.error(
                    kind.span(),
                    "write the activation in parentheses: `Activation(Relu)`",
                );
                None
            }
            "Residual" => {
                let f = layer::fields(cx, "Residual", entries, &["layers"]);
                let Some(list) = f.iter().find(|e| e.key == "layers") else {
                    cx.error(kind.span(), "missing required field `layers` of `Residual`");
                    return None;
                };
                let Value::List {
                    entries: inner,
                    span,
                } = &list.value
                else {
                    cx.at(
                        &list.value,
                        format_args!(
                            "`layers` must be a list `[name: Kind, ...]`, found {}",
                            list.value.describe()
                        ),
                    );
                    return None;
                };
                let inner = self.list(cx, inner, *span, input, &format!("{path}__"))?;
                let output = inner.last().map_or(input, |e| e.output);
                if output != input {
                    cx.error(e.key.span(), format_args!(
                        "the residual block `{}` must keep its input's shape for `x + f(x)`: {} in, {} out",
                        e.key, describe(input), describe(output)
                    ));
                    return None;
                }
                Some(Kind::Residual(inner))
            }
            other => {
                cx.error(kind.span(), layer::unknown("layer kind", other, &KINDS));
                None
            }
        }
    }

    /// A `Conv2d` entry as the `conv2d!` spec it is: its own keys plus the network's input
    /// shape, batch and dtype (spanned at the entry's name).
    fn conv(
        &self,
        cx: &mut Ctxt,
        e: &ast::Entry,
        path: &str,
        dims: [usize; 3],
        mut entries: Vec<ast::Entry>,
        body: Span,
    ) -> Option<Spec> {
        let span = e.key.span();
        let int = |n: usize| Value::Int {
            value: n as i128,
            span,
            minus: None,
            text: n.to_string(),
        };
        let key = |k: &str| Ident::new(k, span);
        entries.push(ast::Entry {
            key: key("input"),
            value: Value::Array {
                items: dims.iter().map(|&d| int(d)).collect(),
                span,
            },
        });
        entries.push(ast::Entry {
            key: key("batch"),
            value: int(self.batch),
        });
        let dtype = Dtype::ALL
            .iter()
            .find(|(_, d)| *d == self.dtype)
            .map_or("f32", |(n, _)| n);
        entries.push(ast::Entry {
            key: key("dtype"),
            value: Value::Named {
                name: key(dtype),
                fields: None,
            },
        });
        let input = ast::Input {
            attrs: Vec::new(),
            vis: syn::parse_quote!(pub),
            ident: Ident::new(path, span),
            entries,
            body_span: body,
        };
        match crate::valid::validate(input) {
            Ok(spec) => Some(spec),
            Err(error) => {
                cx.push(error);
                None
            }
        }
    }
}

fn describe(shape: Shape) -> String {
    match shape {
        Shape::Map([h, w, c]) => format!("a {h}x{w}x{c} map"),
        Shape::Flat(n) => format!("{n} features"),
    }
}

fn shape3(cx: &mut Ctxt, value: &Value) -> Option<[usize; 3]> {
    match value {
        Value::Array { items, .. } if items.len() == 3 => {
            let h = layer::integer(cx, &items[0], "input height", 1);
            let w = layer::integer(cx, &items[1], "input width", 1);
            let c = layer::integer(cx, &items[2], "input channels", 1);
            Some([h?, w?, c?])
        }
        other => {
            cx.at(
                other,
                format_args!(
                    "`input` must be `[height, width, channels]`, found {}",
                    other.describe()
                ),
            );
            None
        }
    }
}
