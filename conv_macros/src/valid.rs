//! [`ast::Input`] -> [`Spec`]: every semantic check, each error at the token it is about.
//!
//! Errors are collected in a [`Ctxt`] and reported together, so one compile shows every
//! independent mistake of an invocation.

use proc_macro2::Span;

use crate::ast::{Entry, Input, Value};
use crate::spec::{output_size, Activation, Dtype, Init, Norm, Spec};

const KEYS: [&str; 10] = [
    "input",
    "out_channels",
    "kernel",
    "stride",
    "padding",
    "activation",
    "norm",
    "batch",
    "dtype",
    "init",
];

/// Largest element count of any one tensor of a spec: sizes are checked to stay within what the
/// generated code's index arithmetic and every backend's 32-bit sizes handle.
const MAX_ELEMENTS: u128 = 1 << 31;

/// Collected errors (serde_derive's `Ctxt`).
#[derive(Default)]
pub struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    pub fn error(&mut self, span: Span, message: impl std::fmt::Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    /// All errors combined into one, or `Ok` when there are none.
    pub fn check(self) -> syn::Result<()> {
        let mut errors = self.errors.into_iter();
        match errors.next() {
            None => Ok(()),
            Some(mut first) => {
                first.extend(errors);
                Err(first)
            }
        }
    }
}

pub fn validate(input: Input) -> syn::Result<Spec> {
    let mut cx = Ctxt::default();
    let mut seen: Vec<&Entry> = Vec::new();
    for entry in &input.entries {
        let key = entry.key.to_string();
        if !KEYS.contains(&key.as_str()) {
            cx.error(entry.key.span(), unknown("key", &key, &KEYS));
        } else if seen.iter().any(|e| e.key == entry.key) {
            cx.error(
                entry.key.span(),
                format_args!("duplicate key `{key}`: each key may appear once"),
            );
        } else {
            seen.push(entry);
        }
    }
    let get = |key: &str| seen.iter().find(|e| e.key == key).map(|e| &e.value);

    let required = |cx: &mut Ctxt, key: &str, what: &str| {
        let value = get(key);
        if value.is_none() {
            cx.error(
                input.ident.span(),
                format_args!(
                    "missing required key `{key}` ({what}) in the spec of `{}`",
                    input.ident
                ),
            );
        }
        value
    };
    let input_v = required(&mut cx, "input", "`[height, width, channels]`");
    let out_channels_v = required(&mut cx, "out_channels", "a positive integer");
    let kernel_v = required(&mut cx, "kernel", "a positive integer or `[height, width]`");

    let shape = input_v.and_then(|v| input_shape(&mut cx, v));
    let out_channels = out_channels_v.and_then(|v| positive(&mut cx, v, "out_channels"));
    let kernel = kernel_v.and_then(|v| pair(&mut cx, v, "kernel", 1));
    let stride = get("stride").map_or(Some([1, 1]), |v| pair(&mut cx, v, "stride", 1));
    let padding = get("padding").map_or(Some([0, 0]), |v| pair(&mut cx, v, "padding", 0));
    let activation = get("activation").map_or(Some(Activation::Identity), |v| {
        named_choice(&mut cx, v, "activation", &Activation::ALL)
    });
    let norm = get("norm").map_or(Some(Norm::None), |v| norm(&mut cx, v));
    let batch = get("batch").map_or(Some(1), |v| positive(&mut cx, v, "batch"));
    let dtype = get("dtype").map_or(Some(Dtype::F32), |v| {
        named_choice(&mut cx, v, "dtype", &Dtype::ALL)
    });
    let init = get("init").map_or(
        Some(Init::KaimingUniform {
            legacy: true,
            scale: 1.0,
        }),
        |v| init(&mut cx, v),
    );

    if let (Some(shape), Some(kernel), Some(padding)) = (shape, kernel, padding) {
        for (axis, name) in ["height", "width"].iter().enumerate() {
            let padded = shape[axis] + 2 * padding[axis];
            if kernel[axis] > padded {
                let span = kernel_v.map_or(input.ident.span(), Value::span);
                cx.error(
                    span,
                    format_args!(
                        "kernel {name} {} is larger than the padded input {name} {padded} ({} + 2 * padding {}): use a kernel of at most {padded} or more padding",
                        kernel[axis], shape[axis], padding[axis]
                    ),
                );
            }
        }
    }

    if let (Some(shape), Some(oc), Some(kernel), Some(stride), Some(padding), Some(batch)) =
        (shape, out_channels, kernel, stride, padding, batch)
    {
        if kernel[0] <= shape[0] + 2 * padding[0] && kernel[1] <= shape[1] + 2 * padding[1] {
            let oh = output_size(shape[0], padding[0], kernel[0], stride[0]) as u128;
            let ow = output_size(shape[1], padding[1], kernel[1], stride[1]) as u128;
            let (b, oc) = (batch as u128, oc as u128);
            let [h, w, c] = shape.map(|s| s as u128);
            let (ph, pw) = (h + 2 * padding[0] as u128, w + 2 * padding[1] as u128);
            let tensors = [
                ("input", b * ph * pw * c, input_v),
                ("output", b * oh * ow * oc, out_channels_v),
                (
                    "weight",
                    oc * kernel[0] as u128 * kernel[1] as u128 * c,
                    kernel_v,
                ),
            ];
            for (what, elements, value) in tensors {
                if elements > MAX_ELEMENTS {
                    cx.error(
                        value.map_or(input.ident.span(), Value::span),
                        format_args!(
                            "the {what} tensor of this spec would have {elements} elements; at most 2^31 = {MAX_ELEMENTS} are supported: use smaller sizes or a smaller batch"
                        ),
                    );
                }
            }
        }
    }

    cx.check()?;
    match (
        shape,
        out_channels,
        kernel,
        stride,
        padding,
        activation,
        norm,
        batch,
        dtype,
        init,
    ) {
        (
            Some(input_shape),
            Some(out_channels),
            Some(kernel),
            Some(stride),
            Some(padding),
            Some(activation),
            Some(norm),
            Some(batch),
            Some(dtype),
            Some(init),
        ) => Ok(Spec {
            attrs: input.attrs,
            vis: input.vis,
            ident: input.ident,
            input: input_shape,
            out_channels,
            kernel,
            stride,
            padding,
            activation,
            norm,
            batch,
            dtype,
            init,
        }),
        _ => Err(syn::Error::new(input.body_span, "invalid conv2d! spec")),
    }
}

/// "unknown KIND `name`; expected one of: ..." with a suggestion for near misses.
fn unknown(kind: &str, name: &str, choices: &[&str]) -> String {
    let mut message = format!("unknown {kind} `{name}`");
    let close = choices
        .iter()
        .min_by_key(|c| edit_distance(&c.to_lowercase(), &name.to_lowercase()));
    if let Some(c) = close.filter(|c| edit_distance(&c.to_lowercase(), &name.to_lowercase()) <= 2) {
        message += &format!(": did you mean `{c}`?");
    }
    message += &format!(" Expected one of: {}", choices.join(", "));
    message
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// An integer `>= min`.
fn integer(cx: &mut Ctxt, value: &Value, what: &str, min: usize) -> Option<usize> {
    let accepted = if min == 0 {
        "a non-negative integer"
    } else {
        "a positive integer"
    };
    match value {
        Value::Int { value: v, span, .. } if *v >= min as i128 => match usize::try_from(*v) {
            Ok(v) => Some(v),
            Err(_) => {
                cx.error(*span, format_args!("`{what}` is too large"));
                None
            }
        },
        Value::Int { value: v, span, .. } => {
            let problem = if *v < 0 { "negative" } else { "zero" };
            cx.error(
                *span,
                format_args!("`{what}` must be {accepted}, found {problem} `{v}`"),
            );
            None
        }
        other => {
            cx.error(
                other.span(),
                format_args!("`{what}` must be {accepted}, found {}", other.describe()),
            );
            None
        }
    }
}

fn positive(cx: &mut Ctxt, value: &Value, what: &str) -> Option<usize> {
    integer(cx, value, what, 1)
}

/// A scalar or `[height, width]`.
fn pair(cx: &mut Ctxt, value: &Value, what: &str, min: usize) -> Option<[usize; 2]> {
    match value {
        Value::Array { items, span } => {
            if items.len() != 2 {
                cx.error(
                    *span,
                    format_args!(
                        "`{what}` takes one number or `[height, width]`, found {} values",
                        items.len()
                    ),
                );
                return None;
            }
            let h = integer(cx, &items[0], &format!("{what} height"), min);
            let w = integer(cx, &items[1], &format!("{what} width"), min);
            Some([h?, w?])
        }
        other => integer(cx, other, what, min).map(|v| [v, v]),
    }
}

fn input_shape(cx: &mut Ctxt, value: &Value) -> Option<[usize; 3]> {
    match value {
        Value::Array { items, .. } if items.len() == 3 => {
            let h = positive(cx, &items[0], "input height");
            let w = positive(cx, &items[1], "input width");
            let c = positive(cx, &items[2], "input channels");
            Some([h?, w?, c?])
        }
        other => {
            cx.error(
                other.span(),
                format_args!(
                    "`input` must be `[height, width, channels]`, found {}",
                    other.describe()
                ),
            );
            None
        }
    }
}

/// A bare name out of `choices`.
fn named_choice<T: Copy>(
    cx: &mut Ctxt,
    value: &Value,
    what: &str,
    choices: &[(&str, T)],
) -> Option<T> {
    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
    match value {
        Value::Named { name, fields: None } => {
            let text = name.to_string();
            match choices.iter().find(|(n, _)| *n == text) {
                Some((_, v)) => Some(*v),
                None => {
                    cx.error(name.span(), unknown(what, &text, &names));
                    None
                }
            }
        }
        Value::Named {
            name,
            fields: Some(_),
        } => {
            cx.error(
                name.span(),
                format_args!("`{what}` `{name}` takes no fields"),
            );
            None
        }
        other => {
            cx.error(
                other.span(),
                format_args!(
                    "expected a {what} name (one of: {}), found {}",
                    names.join(", "),
                    other.describe()
                ),
            );
            None
        }
    }
}

/// The fields of `Name { ... }`: known ones by name, unknown or duplicate ones reported.
fn fields<'a>(cx: &mut Ctxt, of: &str, entries: &'a [Entry], allowed: &[&str]) -> Vec<&'a Entry> {
    let mut out: Vec<&Entry> = Vec::new();
    for e in entries {
        let key = e.key.to_string();
        if !allowed.contains(&key.as_str()) {
            cx.error(
                e.key.span(),
                unknown(&format!("field of `{of}`"), &key, allowed),
            );
        } else if out.iter().any(|o| o.key == e.key) {
            cx.error(e.key.span(), format_args!("duplicate field `{key}`"));
        } else {
            out.push(e);
        }
    }
    out
}

fn number(cx: &mut Ctxt, value: &Value, what: &str) -> Option<f64> {
    match value {
        Value::Float { value, .. } => Some(*value),
        Value::Int { value, .. } => Some(*value as f64),
        other => {
            cx.error(
                other.span(),
                format_args!("`{what}` must be a number, found {}", other.describe()),
            );
            None
        }
    }
}

fn field_number(
    cx: &mut Ctxt,
    fields: &[&Entry],
    key: &str,
    default: f64,
    of: &str,
) -> Option<(f64, Span)> {
    match fields.iter().find(|e| e.key == key) {
        Some(e) => number(cx, &e.value, &format!("{of} {key}")).map(|v| (v, e.value.span())),
        None => Some((default, Span::call_site())),
    }
}

fn eps(cx: &mut Ctxt, fields: &[&Entry], of: &str) -> Option<f64> {
    let (eps, span) = field_number(cx, fields, "eps", 1e-5, of)?;
    if !(eps > 0.0 && eps.is_finite()) {
        cx.error(
            span,
            format_args!("`{of}` eps must be a finite number > 0, found {eps}"),
        );
        return None;
    }
    Some(eps)
}

fn norm(cx: &mut Ctxt, value: &Value) -> Option<Norm> {
    const NAMES: [&str; 3] = ["None", "BatchNorm", "LayerNorm"];
    let Value::Named {
        name,
        fields: entries,
    } = value
    else {
        cx.error(
            value.span(),
            format_args!("expected a norm (`None`, `BatchNorm {{ momentum, eps }}` or `LayerNorm {{ eps }}`), found {}", value.describe()),
        );
        return None;
    };
    let empty = Vec::new();
    let entries = entries.as_ref().map_or(&empty, |(e, _)| e);
    match name.to_string().as_str() {
        "None" if entries.is_empty() => Some(Norm::None),
        "None" => {
            cx.error(name.span(), "`None` takes no fields");
            None
        }
        "BatchNorm" => {
            let f = fields(cx, "BatchNorm", entries, &["momentum", "eps"]);
            let momentum = field_number(cx, &f, "momentum", 0.1, "BatchNorm");
            if let Some((m, span)) = momentum {
                if !(0.0..=1.0).contains(&m) {
                    cx.error(
                        span,
                        format_args!("BatchNorm momentum must be in [0, 1], found {m}"),
                    );
                    return None;
                }
            }
            let eps = eps(cx, &f, "BatchNorm");
            Some(Norm::BatchNorm {
                momentum: momentum?.0,
                eps: eps?,
            })
        }
        "LayerNorm" => {
            let f = fields(cx, "LayerNorm", entries, &["eps"]);
            Some(Norm::LayerNorm {
                eps: eps(cx, &f, "LayerNorm")?,
            })
        }
        other => {
            cx.error(name.span(), unknown("norm", other, &NAMES));
            None
        }
    }
}

fn init(cx: &mut Ctxt, value: &Value) -> Option<Init> {
    let Value::Named {
        name,
        fields: entries,
    } = value
    else {
        cx.error(
            value.span(),
            format_args!(
                "expected an initializer (`KaimingUniform {{ legacy, scale }}`), found {}",
                value.describe()
            ),
        );
        return None;
    };
    if name != "KaimingUniform" {
        cx.error(
            name.span(),
            unknown("initializer", &name.to_string(), &["KaimingUniform"]),
        );
        return None;
    }
    let empty = Vec::new();
    let entries = entries.as_ref().map_or(&empty, |(e, _)| e);
    let f = fields(cx, "KaimingUniform", entries, &["legacy", "scale"]);
    let legacy = match f.iter().find(|e| e.key == "legacy").map(|e| &e.value) {
        None => Some(true),
        Some(Value::Bool { value, .. }) => Some(*value),
        Some(other) => {
            cx.error(
                other.span(),
                format_args!(
                    "`legacy` must be `true` or `false`, found {}",
                    other.describe()
                ),
            );
            None
        }
    };
    let (scale, span) = field_number(cx, &f, "scale", 1.0, "KaimingUniform")?;
    if !(scale > 0.0 && scale.is_finite()) {
        cx.error(
            span,
            format_args!("KaimingUniform scale must be a finite number > 0, found {scale}"),
        );
        return None;
    }
    Some(Init::KaimingUniform {
        legacy: legacy?,
        scale,
    })
}
