//! The macro input as written: a struct header and loosely typed `key: value` entries.
//!
//! Parsing accepts any well-formed value for any key; what a key may hold is checked in
//! `valid.rs`, so that one invocation reports every semantic error at once.

use proc_macro2::Span;
use syn::{Attribute, Ident, Visibility};

/// `#[attrs] vis struct Name { entries }`.
#[derive(Clone)]
pub struct Input {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub ident: Ident,
    pub entries: Vec<Entry>,
    /// The braces, for errors about the whole body (missing keys).
    pub body_span: Span,
}

/// `key: value`.
#[derive(Clone)]
pub struct Entry {
    pub key: Ident,
    pub value: Value,
}

/// A value as written.
#[derive(Clone)]
pub enum Value {
    /// An integer literal, possibly negative (`minus` is the sign's span), as written (`text`).
    Int {
        value: i128,
        span: Span,
        minus: Option<Span>,
        text: String,
    },
    /// A float literal, possibly negative, as written.
    Float {
        value: f64,
        span: Span,
        minus: Option<Span>,
        text: String,
    },
    /// `true` / `false`.
    Bool { value: bool, span: Span },
    /// `[a, b, ...]`.
    Array { items: Vec<Value>, span: Span },
    /// `Name` or `Name { key: value, ... }`.
    Named {
        name: Ident,
        fields: Option<(Vec<Entry>, Span)>,
    },
    /// `Name(value, ...)` (`network!`'s `Activation(Relu)`).
    Call {
        name: Ident,
        args: Vec<Value>,
        span: Span,
    },
    /// `[name: value, ...]` (`network!`'s layer lists).
    List { entries: Vec<Entry>, span: Span },
    /// A string literal (never valid; kept to point at it).
    Str { span: Span },
}

impl Value {
    pub fn span(&self) -> Span {
        match self {
            Value::Int { span, .. }
            | Value::Float { span, .. }
            | Value::Bool { span, .. }
            | Value::Array { span, .. }
            | Value::List { span, .. }
            | Value::Str { span } => *span,
            Value::Named { name, .. } | Value::Call { name, .. } => name.span(),
        }
    }

    /// An error covering the whole value (a negative number from its sign on).
    pub fn error(&self, message: impl std::fmt::Display) -> syn::Error {
        match self {
            Value::Int {
                span,
                minus: Some(minus),
                ..
            }
            | Value::Float {
                span,
                minus: Some(minus),
                ..
            } => {
                // `Span::join` is unstable; an error spanned over two tokens covers both.
                let tokens: proc_macro2::TokenStream =
                    [Ident::new("minus", *minus), Ident::new("value", *span)]
                        .into_iter()
                        .map(proc_macro2::TokenTree::Ident)
                        .collect();
                syn::Error::new_spanned(tokens, message)
            }
            other => syn::Error::new(other.span(), message),
        }
    }

    /// A short description for "expected X, found Y" messages.
    pub fn describe(&self) -> String {
        match self {
            Value::Int { text, .. } => format!("the integer `{text}`"),
            Value::Float { text, .. } => format!("the number `{text}`"),
            Value::Bool { value, .. } => format!("`{value}`"),
            Value::Array { items, .. } => format!("an array of {} values", items.len()),
            Value::Named { name, .. } => format!("`{name}`"),
            Value::Call { name, .. } => format!("`{name}(..)`"),
            Value::List { entries, .. } => format!("a list of {} named entries", entries.len()),
            Value::Str { .. } => "a string".into(),
        }
    }
}
