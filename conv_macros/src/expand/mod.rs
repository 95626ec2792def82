//! Validated [`Spec`] -> tokens. One module per output.

mod backward;
mod cpu;
mod kernel;
mod norm;
mod types;

use proc_macro2::{Literal, TokenStream};
use quote::{format_ident, quote};

use crate::ast::Input;
use crate::spec::{Dtype, Spec};

pub fn expand(spec: &Spec) -> TokenStream {
    let types = types::expand(spec);
    let cpu = cpu::expand(spec);
    quote! {
        #types
        #cpu
    }
}

/// Empty definitions of the names an invalid spec would have defined.
pub fn fallback(input: &Input) -> TokenStream {
    let (attrs, vis, name) = (&input.attrs, &input.vis, &input.ident);
    let grads = format_ident!("{}Grads", name);
    let state = format_ident!("{}State", name);
    quote! {
        #(#attrs)* #vis struct #name;
        #vis struct #grads;
        #vis struct #state;
    }
}

/// The runtime's private module, the only path generated code reaches the runtime through.
fn rt() -> TokenStream {
    quote!(::conv_runtime::__private)
}

fn lit(n: usize) -> Literal {
    Literal::usize_unsuffixed(n)
}

/// The names of the items one spec defines.
struct Names {
    layer: syn::Ident,
    grads: syn::Ident,
    state: syn::Ident,
    device: syn::Ident,
}

impl Names {
    fn of(spec: &Spec) -> Self {
        let layer = spec.ident.clone();
        Self {
            grads: format_ident!("{}Grads", layer),
            state: format_ident!("{}State", layer),
            device: format_ident!("{}Device", layer),
            layer,
        }
    }
}

/// The element type's tokens.
fn elem(dtype: Dtype) -> TokenStream {
    let rt = rt();
    match dtype {
        Dtype::F64 => quote!(f64),
        Dtype::F32 => quote!(f32),
        Dtype::F16 => quote!(#rt::f16),
        Dtype::Bf16 => quote!(#rt::bf16),
    }
}

/// The accumulator type's tokens.
fn acc(dtype: Dtype) -> TokenStream {
    match dtype {
        Dtype::F64 => quote!(f64),
        _ => quote!(f32),
    }
}
