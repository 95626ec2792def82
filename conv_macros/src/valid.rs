//! [`ast::Input`] -> [`Spec`]: every semantic check, each error at the token it is about.
//!
//! Errors are collected in a [`Ctxt`] and reported together, so one compile shows every
//! independent mistake of an invocation. Sizes are checked with saturating arithmetic: no
//! input, however large, makes the macro panic or wrap around.

use proc_macro2::Span;

use crate::ast::{Entry, Input, Value};
use crate::spec::{Activation, Dtype, Init, Norm, Spec};

pub(crate) const KEYS: [&str; 10] = [
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

/// Largest element count of any one tensor of a spec: what the generated index arithmetic and
/// every backend's 32-bit sizes handle.
const MAX_ELEMENTS: u128 = 1 << 31;

/// Names people write for the ones this macro accepts (PyTorch's, and common spellings).
const ALIASES: [(&str, &str); 13] = [
    ("epsilon", "eps"),
    ("float64", "f64"),
    ("double", "f64"),
    ("float32", "f32"),
    ("float", "f32"),
    ("float16", "f16"),
    ("half", "f16"),
    ("bfloat16", "bf16"),
    ("kernel_size", "kernel"),
    ("strides", "stride"),
    ("pad", "padding"),
    ("BatchNorm2d", "BatchNorm"),
    ("GroupNorm", "LayerNorm"),
];

/// Collected errors (serde_derive's `Ctxt`).
#[derive(Default)]
pub struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    pub fn error(&mut self, span: Span, message: impl std::fmt::Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    /// Errors found elsewhere (a network's `Conv2d` entry validated as a layer).
    pub fn push(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// An error covering `value` as written.
    pub fn at(&mut self, value: &Value, message: impl std::fmt::Display) {
        self.errors.push(value.error(message));
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
    // Keys a typo was taken for: they are not reported as missing as well.
    let mut suggested: Vec<&str> = Vec::new();
    for entry in &input.entries {
        let key = entry.key.to_string();
        if !KEYS.contains(&key.as_str()) {
            suggested.extend(suggestion(&key, &KEYS));
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
        if value.is_none() && !suggested.contains(&key) {
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
    let out_channels = out_channels_v.and_then(|v| integer(&mut cx, v, "out_channels", 1));
    let kernel = kernel_v.and_then(|v| pair(&mut cx, v, "kernel", 1));
    let stride = get("stride").map_or(Some([1, 1]), |v| pair(&mut cx, v, "stride", 1));
    let padding = get("padding").map_or(Some([0, 0]), |v| pair(&mut cx, v, "padding", 0));
    let activation = get("activation").map_or(Some(Activation::Identity), |v| {
        named_choice(&mut cx, v, "activation", &Activation::ALL)
    });
    let norm = get("norm").map_or(Some(Norm::None), |v| norm(&mut cx, v));
    let batch = get("batch").map_or(Some(1), |v| integer(&mut cx, v, "batch", 1));
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

    let padded = |shape: [usize; 3], padding: [usize; 2], axis: usize| {
        shape[axis].saturating_add(padding[axis].saturating_mul(2))
    };
    let mut fits = true;
    if let (Some(shape), Some(kernel), Some(padding)) = (shape, kernel, padding) {
        for (axis, name) in ["height", "width"].iter().enumerate() {
            let room = padded(shape, padding, axis);
            if kernel[axis] > room {
                fits = false;
                let message = format!(
                    "kernel {name} {} is larger than the padded input {name} {room} ({} + 2 * padding {}): use a kernel of at most {room} or more padding",
                    kernel[axis], shape[axis], padding[axis]
                );
                match kernel_v {
                    Some(Value::Array { items, .. }) if items.len() == 2 => {
                        cx.at(&items[axis], message)
                    }
                    Some(v) => cx.at(v, message),
                    None => cx.error(input.ident.span(), message),
                }
            }
        }
    }

    if let (Some(shape), Some(oc), Some(kernel), Some(stride), Some(padding), Some(batch), true) =
        (shape, out_channels, kernel, stride, padding, batch, fits)
    {
        let product = |factors: &[usize]| {
            factors
                .iter()
                .fold(1u128, |p, &f| p.saturating_mul(f as u128))
        };
        let (ph, pw) = (padded(shape, padding, 0), padded(shape, padding, 1));
        let (oh, ow) = (
            (ph - kernel[0]) / stride[0] + 1,
            (pw - kernel[1]) / stride[1] + 1,
        );
        let tensors = [
            ("input", product(&[batch, ph, pw, shape[2]]), input_v),
            ("output", product(&[batch, oh, ow, oc]), out_channels_v),
            (
                "weight",
                product(&[oc, kernel[0], kernel[1], shape[2]]),
                kernel_v,
            ),
        ];
        for (what, elements, value) in tensors {
            if elements > MAX_ELEMENTS {
                let count = if elements == u128::MAX {
                    "more than 2^127".to_string()
                } else {
                    elements.to_string()
                };
                let message = format!(
                    "the {what} tensor of this spec would have {count} elements; at most 2^31 = {MAX_ELEMENTS} are supported: use smaller sizes or a smaller batch"
                );
                match value {
                    Some(v) => cx.at(v, message),
                    None => cx.error(input.ident.span(), message),
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

/// The accepted name `name` was probably meant to be, if any.
pub(crate) fn suggestion<'a>(name: &str, choices: &[&'a str]) -> Option<&'a str> {
    if let Some((_, to)) = ALIASES.iter().find(|(from, _)| *from == name) {
        if let Some(c) = choices.iter().find(|c| *c == to) {
            return Some(c);
        }
    }
    let lower = name.to_lowercase();
    choices
        .iter()
        .map(|c| (edit_distance(&c.to_lowercase(), &lower), *c))
        .filter(|&(d, _)| d <= 2)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// "unknown KIND `name` (did you mean `x`?); expected one of: ...".
pub(crate) fn unknown(kind: &str, name: &str, choices: &[&str]) -> String {
    let hint =
        suggestion(name, choices).map_or(String::new(), |c| format!(" (did you mean `{c}`?)"));
    format!(
        "unknown {kind} `{name}`{hint}; expected one of: {}",
        choices.join(", ")
    )
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
pub(crate) fn integer(cx: &mut Ctxt, value: &Value, what: &str, min: usize) -> Option<usize> {
    let accepted = if min == 0 {
        "a non-negative integer"
    } else {
        "a positive integer"
    };
    match value {
        Value::Int { value: v, .. } if *v >= min as i128 => match usize::try_from(*v) {
            Ok(v) => Some(v),
            Err(_) => {
                cx.at(value, format_args!("`{what}` is too large"));
                None
            }
        },
        Value::Int { value: v, text, .. } => {
            let problem = if *v < 0 { "negative" } else { "zero" };
            cx.at(
                value,
                format_args!("`{what}` must be {accepted}, found {problem} `{text}`"),
            );
            None
        }
        other => {
            cx.at(
                other,
                format_args!("`{what}` must be {accepted}, found {}", other.describe()),
            );
            None
        }
    }
}

/// A scalar or `[height, width]`.
pub(crate) fn pair(cx: &mut Ctxt, value: &Value, what: &str, min: usize) -> Option<[usize; 2]> {
    match value {
        Value::Array { items, .. } if items.len() == 2 => {
            let h = integer(cx, &items[0], &format!("{what} height"), min);
            let w = integer(cx, &items[1], &format!("{what} width"), min);
            Some([h?, w?])
        }
        Value::Array { .. } => {
            cx.at(
                value,
                format_args!(
                    "`{what}` takes one number or `[height, width]`, found {}",
                    value.describe()
                ),
            );
            None
        }
        other => integer(cx, other, what, min).map(|v| [v, v]),
    }
}

fn input_shape(cx: &mut Ctxt, value: &Value) -> Option<[usize; 3]> {
    match value {
        Value::Array { items, .. } if items.len() == 3 => {
            let h = integer(cx, &items[0], "input height", 1);
            let w = integer(cx, &items[1], "input width", 1);
            let c = integer(cx, &items[2], "input channels", 1);
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

/// A bare name out of `choices`.
pub(crate) fn named_choice<T: Copy>(
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
            cx.error(name.span(), format_args!("{what} `{name}` takes no fields"));
            None
        }
        other => {
            cx.at(
                other,
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
pub(crate) fn fields<'a>(
    cx: &mut Ctxt,
    of: &str,
    entries: &'a [Entry],
    allowed: &[&str],
) -> Vec<&'a Entry> {
    let mut out: Vec<&Entry> = Vec::new();
    for e in entries {
        let key = e.key.to_string();
        if !allowed.contains(&key.as_str()) {
            let hint = suggestion(&key, allowed)
                .map_or(String::new(), |c| format!(" (did you mean `{c}`?)"));
            cx.error(
                e.key.span(),
                format_args!(
                    "unknown field `{key}` of `{of}`{hint}; expected one of: {}",
                    allowed.join(", ")
                ),
            );
        } else if out.iter().any(|o| o.key == e.key) {
            cx.error(
                e.key.span(),
                format_args!("duplicate field `{key}` of `{of}`"),
            );
        } else {
            out.push(e);
        }
    }
    out
}

/// A numeric field of `of` (or its default), checked by `valid`; the error names the accepted
/// range `accepted` and shows the number as written.
fn checked_number(
    cx: &mut Ctxt,
    fields: &[&Entry],
    of: &str,
    key: &str,
    default: f64,
    valid: impl Fn(f64) -> bool,
    accepted: &str,
) -> Option<f64> {
    let Some(entry) = fields.iter().find(|e| e.key == key) else {
        return Some(default);
    };
    let (value, text) = match &entry.value {
        Value::Float { value, text, .. } => (*value, text),
        Value::Int { value, text, .. } => (*value as f64, text),
        other => {
            cx.at(
                other,
                format_args!("`{of}` {key} must be a number, found {}", other.describe()),
            );
            return None;
        }
    };
    if !valid(value) {
        cx.at(
            &entry.value,
            format_args!("`{of}` {key} must be {accepted}, found `{text}`"),
        );
        return None;
    }
    Some(value)
}

fn eps(cx: &mut Ctxt, fields: &[&Entry], of: &str) -> Option<f64> {
    checked_number(
        cx,
        fields,
        of,
        "eps",
        1e-5,
        |e| e > 0.0 && e.is_finite(),
        "a finite number > 0",
    )
}

fn norm(cx: &mut Ctxt, value: &Value) -> Option<Norm> {
    const NAMES: [&str; 3] = ["None", "BatchNorm", "LayerNorm"];
    let Value::Named {
        name,
        fields: entries,
    } = value
    else {
        cx.at(
            value,
            format_args!(
                "expected a norm (`None`, `BatchNorm {{ momentum, eps }}` or `LayerNorm {{ eps }}`), found {}",
                value.describe()
            ),
        );
        return None;
    };
    let entries = entries.as_ref().map_or(&[][..], |(e, _)| e.as_slice());
    match name.to_string().as_str() {
        "None" if entries.is_empty() => Some(Norm::None),
        "None" => {
            cx.error(name.span(), "norm `None` takes no fields");
            None
        }
        "BatchNorm" => {
            let f = fields(cx, "BatchNorm", entries, &["momentum", "eps"]);
            let in_range = |m: f64| (0.0..=1.0).contains(&m);
            let momentum =
                checked_number(cx, &f, "BatchNorm", "momentum", 0.1, in_range, "in [0, 1]");
            // Checked even when the momentum is wrong, so both errors show at once.
            let eps = eps(cx, &f, "BatchNorm");
            Some(Norm::BatchNorm {
                momentum: momentum?,
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

pub(crate) fn init(cx: &mut Ctxt, value: &Value) -> Option<Init> {
    let Value::Named {
        name,
        fields: entries,
    } = value
    else {
        cx.at(
            value,
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
    let entries = entries.as_ref().map_or(&[][..], |(e, _)| e.as_slice());
    let f = fields(cx, "KaimingUniform", entries, &["legacy", "scale"]);
    let legacy = match f.iter().find(|e| e.key == "legacy").map(|e| &e.value) {
        None => Some(true),
        Some(Value::Bool { value, .. }) => Some(*value),
        Some(other) => {
            cx.at(
                other,
                format_args!(
                    "`KaimingUniform` legacy must be `true` or `false`, found {}",
                    other.describe()
                ),
            );
            None
        }
    };
    let positive = |s: f64| s > 0.0 && s.is_finite();
    let scale = checked_number(
        cx,
        &f,
        "KaimingUniform",
        "scale",
        1.0,
        positive,
        "a finite number > 0",
    );
    Some(Init::KaimingUniform {
        legacy: legacy?,
        scale: scale?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_cover_typos_and_aliases() {
        assert_eq!(suggestion("kernal", &KEYS), Some("kernel"));
        assert_eq!(suggestion("strides", &KEYS), Some("stride"));
        assert_eq!(suggestion("epsilon", &["momentum", "eps"]), Some("eps"));
        assert_eq!(
            suggestion("float32", &["f64", "f32", "f16", "bf16"]),
            Some("f32")
        );
        assert_eq!(suggestion("colour", &KEYS), None);
    }
}
