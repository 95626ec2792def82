//! Tokens -> [`ast::Input`]. Only syntax errors stop here.

use syn::parse::{Parse, ParseStream};
use syn::{braced, bracketed, Attribute, Ident, Lit, Token, Visibility};

use crate::ast::{Entry, Input, Value};

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        input.parse::<Token![struct]>()?;
        let ident: Ident = input.parse()?;
        let content;
        let brace = braced!(content in input);
        let entries = parse_entries(&content)?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the layer spec: write one `struct Name { ... }` per conv2d! invocation"));
        }
        Ok(Input {
            attrs,
            vis,
            ident,
            entries,
            body_span: brace.span.join(),
        })
    }
}

pub fn parse_entries(input: ParseStream) -> syn::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    while !input.is_empty() {
        let key: Ident = input.call(syn::ext::IdentExt::parse_any)?;
        input.parse::<Token![:]>()?;
        let value = parse_value(input)?;
        entries.push(Entry { key, value });
        if input.is_empty() {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    Ok(entries)
}

fn parse_value(input: ParseStream) -> syn::Result<Value> {
    if input.peek(syn::token::Bracket) {
        let content;
        let bracket = bracketed!(content in input);
        // `[name: value, ...]`: a list of named entries.
        if content.peek(Ident) && content.peek2(Token![:]) && !content.peek2(Token![::]) {
            return Ok(Value::List {
                entries: parse_entries(&content)?,
                span: bracket.span.join(),
            });
        }
        let mut items = Vec::new();
        while !content.is_empty() {
            items.push(parse_value(&content)?);
            if content.is_empty() {
                break;
            }
            content.parse::<Token![,]>()?;
        }
        return Ok(Value::Array {
            items,
            span: bracket.span.join(),
        });
    }
    if input.peek(Token![-]) {
        let sign: Token![-] = input.parse()?;
        return match parse_value(input)? {
            Value::Int {
                value,
                span,
                minus: None,
                text,
            } => Ok(Value::Int {
                value: -value,
                span,
                minus: Some(sign.span),
                text: format!("-{text}"),
            }),
            Value::Float {
                value,
                span,
                minus: None,
                text,
            } => Ok(Value::Float {
                value: -value,
                span,
                minus: Some(sign.span),
                text: format!("-{text}"),
            }),
            other => Err(syn::Error::new(other.span(), "expected a number after `-`")),
        };
    }
    if input.peek(Ident) && !input.peek(syn::LitBool) {
        let name: Ident = input.call(syn::ext::IdentExt::parse_any)?;
        if input.peek(syn::token::Paren) {
            let content;
            let paren = syn::parenthesized!(content in input);
            let mut args = Vec::new();
            while !content.is_empty() {
                args.push(parse_value(&content)?);
                if content.is_empty() {
                    break;
                }
                content.parse::<Token![,]>()?;
            }
            return Ok(Value::Call {
                name,
                args,
                span: paren.span.join(),
            });
        }
        let fields = if input.peek(syn::token::Brace) {
            let content;
            let brace = braced!(content in input);
            Some((parse_entries(&content)?, brace.span.join()))
        } else {
            None
        };
        return Ok(Value::Named { name, fields });
    }
    let lit: Lit = input.parse().map_err(|e| {
        syn::Error::new(
            e.span(),
            "expected a value: a number, `[a, b]`, or a name such as `Relu`",
        )
    })?;
    Ok(match lit {
        Lit::Int(i) => {
            let text = i.to_string();
            match i.base10_parse::<i128>() {
                Ok(value) => Value::Int {
                    value,
                    span: i.span(),
                    minus: None,
                    text,
                },
                Err(_) => return Err(syn::Error::new(i.span(), "integer literal out of range")),
            }
        }
        Lit::Float(f) => Value::Float {
            value: f.base10_parse::<f64>()?,
            span: f.span(),
            minus: None,
            text: f.to_string(),
        },
        Lit::Bool(b) => Value::Bool {
            value: b.value,
            span: b.span(),
        },
        other => Value::Str { span: other.span() },
    })
}
