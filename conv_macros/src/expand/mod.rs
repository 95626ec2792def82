//! Validated [`Spec`] -> tokens. One module per output.

mod backward;
pub(crate) mod cpu;
pub(crate) mod cuda;
mod dense;
pub(crate) mod kernel;
mod norm;
mod onednn;
mod scatter;
pub(crate) mod types;
mod winograd;

use proc_macro2::{Literal, TokenStream};
use quote::{format_ident, quote};

use crate::spec::{Dtype, Spec};

pub fn expand(spec: &Spec) -> TokenStream {
    let types = types::expand(spec);
    let cpu = cpu::expand(spec);
    let cuda = cuda::expand(spec);
    quote! {
        #types
        #cpu
        #cuda
    }
}

/// Stand-ins for the items an invalid spec would have defined: the names, the associated
/// constants and the methods, accepting anything, so that the user sees the spec's errors and
/// not a cascade of "cannot find" and "no method" errors at every use (thiserror's fallback).
pub fn fallback(attrs: &[syn::Attribute], vis: &syn::Visibility, name: &syn::Ident) -> TokenStream {
    let grads = format_ident!("{}Grads", name);
    let state = format_ident!("{}State", name);
    let input = format_ident!("{}Input", name);
    let output = format_ident!("{}Output", name);
    let rt = rt();
    let consts = types::CONSTANTS.iter().map(|c| {
        let c = format_ident!("{}", c);
        quote!(pub const #c: usize = 0;)
    });
    let stub = |method: &str, receiver: TokenStream, args: usize, ret: TokenStream| {
        let method = format_ident!("{}", method);
        let generics: Vec<_> = (0..args).map(|i| format_ident!("__A{}", i)).collect();
        quote! {
            #[allow(clippy::too_many_arguments)]
            pub fn #method<#(#generics),*>(#receiver #(_: #generics),*) -> #ret {
                ::core::unreachable!("invalid conv2d! spec")
            }
        }
    };
    let result = quote!(#rt::Result<()>);
    let layer_methods = [
        stub("new", quote!(), 1, quote!(Self)),
        stub("evaluate", quote!(&self,), 3, result.clone()),
        stub("forward", quote!(&mut self,), 4, result.clone()),
        stub("backward_input", quote!(&self,), 5, result.clone()),
        stub("backward", quote!(&self,), 6, result.clone()),
        stub("backward_full", quote!(&self,), 7, result.clone()),
        stub("copy_from", quote!(&mut self,), 1, quote!(())),
        stub("abs_diff", quote!(&self,), 1, quote!(f64)),
        stub("is_nan", quote!(&self,), 0, quote!(bool)),
    ];
    let grads_methods = [
        stub("zeros", quote!(), 0, quote!(Self)),
        stub("zero", quote!(&mut self,), 0, quote!(())),
        stub("add", quote!(&mut self,), 1, quote!(())),
        stub("copy_from", quote!(&mut self,), 1, quote!(())),
        stub("norm", quote!(&self,), 0, quote!(f64)),
        stub("is_nan", quote!(&self,), 0, quote!(bool)),
    ];
    let state_methods = [
        stub("new", quote!(), 0, quote!(Self)),
        stub("reset", quote!(&mut self,), 0, quote!(())),
        stub("is_nan", quote!(&self,), 0, quote!(bool)),
    ];
    // The device-resident types (see `cuda::device`), with their constructors.
    let cuda_layer = format_ident!("{}Cuda", name);
    let cuda_grads = format_ident!("{}CudaGrads", name);
    let cuda_state = format_ident!("{}CudaState", name);
    let cuda_methods = [
        stub("upload", quote!(), 2, quote!(#rt::Result<Self>)),
        stub("zeros", quote!(), 1, quote!(#rt::Result<Self>)),
        stub("new", quote!(), 1, quote!(#rt::Result<Self>)),
    ];
    quote! {
        #(#attrs)* #vis struct #name;
        #[allow(dead_code)]
        impl #name {
            #(#consts)*
            #(#layer_methods)*
        }
        #vis struct #grads;
        #[allow(dead_code)]
        impl #grads {
            #(#grads_methods)*
        }
        #vis struct #state;
        #[allow(dead_code)]
        impl #state {
            #(#state_methods)*
        }
        #vis type #input<const __B: usize> = [(); __B];
        #vis type #output<const __B: usize> = [(); __B];
        #rt::if_cuda! {
            #vis struct #cuda_layer;
            #vis struct #cuda_grads;
            #vis struct #cuda_state;
            #[allow(dead_code)]
            impl #cuda_layer {
                #(#cuda_methods)*
            }
            #[allow(dead_code)]
            impl #cuda_grads {
                #(#cuda_methods)*
            }
            #[allow(dead_code)]
            impl #cuda_state {
                #(#cuda_methods)*
            }
        }
    }
}

/// The name after `struct` in tokens that did not parse, for the fallback.
pub fn struct_name(tokens: proc_macro2::TokenStream) -> Option<syn::Ident> {
    let mut tokens = tokens.into_iter();
    while let Some(tree) = tokens.next() {
        if let proc_macro2::TokenTree::Ident(i) = &tree {
            if i == "struct" {
                return match tokens.next() {
                    Some(proc_macro2::TokenTree::Ident(name)) => Some(name),
                    _ => None,
                };
            }
        }
    }
    None
}

/// The runtime's private module, the only path generated code reaches the runtime through.
pub(crate) fn rt() -> TokenStream {
    quote!(::conv_runtime::__private)
}

pub(crate) fn lit(n: usize) -> Literal {
    Literal::usize_unsuffixed(n)
}

/// `const __NAME: usize = value;` for each pair: the spec's numbers as constants of a generated
/// block (not every block uses every one), private to the expansion by the `__` prefix.
fn usize_consts(pairs: &[(&str, usize)]) -> TokenStream {
    let items = pairs.iter().map(|(name, value)| {
        let (name, value) = (format_ident!("__{}", name), lit(*value));
        quote!(#[allow(dead_code)] const #name: usize = #value;)
    });
    quote!(#(#items)*)
}

/// The public items one spec defines, by name: the only names of an expansion without the `__`
/// prefix (see `crate::hygiene`).
pub fn public_names(spec: &Spec) -> Vec<String> {
    let names = Names::of(spec);
    let layer = &names.layer;
    [
        layer.to_string(),
        names.grads.to_string(),
        names.state.to_string(),
        names.device.to_string(),
        format!("{layer}Input"),
        format!("{layer}Output"),
        format!("{layer}Cuda"),
        format!("{layer}CudaGrads"),
        format!("{layer}CudaState"),
    ]
    .into()
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
pub(crate) fn elem(dtype: Dtype) -> TokenStream {
    let rt = rt();
    match dtype {
        Dtype::F64 => quote!(f64),
        Dtype::F32 => quote!(f32),
        Dtype::F16 => quote!(#rt::f16),
        Dtype::Bf16 => quote!(#rt::bf16),
    }
}

/// Whether the layer's output is its pre-activation (no activation, no norm): the CPU state
/// keeps one map for both, which a forward pass writes once (the copy was 3% of the IMPALA
/// network's training step, and the map as much memory again).
pub(crate) fn output_is_pre_activation(spec: &crate::spec::Spec) -> bool {
    spec.activation == crate::spec::Activation::Identity && spec.norm == crate::spec::Norm::None
}

/// The accumulator type's tokens.
pub(crate) fn acc(dtype: Dtype) -> TokenStream {
    match dtype {
        Dtype::F64 => quote!(f64),
        _ => quote!(f32),
    }
}
