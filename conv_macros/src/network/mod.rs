//! The `network!` macro: a whole network declared once, parse -> validate -> expand like
//! `conv2d!` (whose `ast` and parser it shares: `layers: [name: Kind, ...]` is a list value).

mod cuda;
mod expand;
mod spec;
mod valid;

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use crate::ast;

pub fn network(tokens: TokenStream) -> TokenStream {
    let input: ast::Input = match syn::parse2(tokens.clone()) {
        Ok(input) => input,
        Err(error) => {
            let fallback = crate::expand::struct_name(tokens)
                .map(|name| fallback(&[], &syn::Visibility::Inherited, &name));
            let error = error.to_compile_error();
            return quote!(#error #fallback);
        }
    };
    let fallback = fallback(&input.attrs, &input.vis, &input.ident);
    match valid::validate(input) {
        Ok(net) => expand::expand(&net),
        Err(errors) => {
            let errors = errors.to_compile_error();
            quote!(#errors #fallback)
        }
    }
}

/// The names an invalid network would have defined, accepting anything, so that the user sees
/// the spec's errors and not a cascade at every use.
fn fallback(attrs: &[syn::Attribute], vis: &syn::Visibility, name: &syn::Ident) -> TokenStream {
    let rt = crate::expand::rt();
    let grads = format_ident!("{}Grads", name);
    let state = format_ident!("{}State", name);
    let input = format_ident!("{}Input", name);
    let output = format_ident!("{}Output", name);
    let stub = |method: &str, receiver: TokenStream, args: usize, ret: TokenStream| {
        let method = format_ident!("{}", method);
        let generics: Vec<_> = (0..args).map(|i| format_ident!("__A{}", i)).collect();
        quote! {
            #[allow(clippy::too_many_arguments)]
            pub fn #method<#(#generics),*>(#receiver #(_: #generics),*) -> #ret {
                ::core::unreachable!("invalid network! spec")
            }
        }
    };
    let result = quote!(#rt::Result<()>);
    let methods = [
        stub("new", quote!(), 1, quote!(Self)),
        stub("evaluate", quote!(&self,), 3, result.clone()),
        stub("forward", quote!(&mut self,), 4, result.clone()),
        stub("backward", quote!(&self,), 6, result.clone()),
        stub("backward_full", quote!(&self,), 7, result.clone()),
        stub("copy_from", quote!(&mut self,), 1, quote!(())),
    ];
    let grads_methods = [
        stub("zeros", quote!(), 0, quote!(Self)),
        stub("zero", quote!(&mut self,), 0, quote!(())),
    ];
    let state_methods = [stub("new", quote!(), 0, quote!(Self))];
    quote! {
        #(#attrs)* #vis struct #name;
        #[allow(dead_code)]
        impl #name {
            #(#methods)*
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
    }
}

/// The items a network defines per name (`Net`, `NetGrads`, ..), and a `conv2d!` layer per
/// entry.
pub(crate) const SUFFIXES: [&str; 9] = [
    "",
    "Grads",
    "State",
    "Device",
    "Input",
    "Output",
    "Cuda",
    "CudaGrads",
    "CudaState",
];

/// The public items a network defines, by name (see `crate::hygiene`).
#[cfg(test)]
pub fn public_names(net: &spec::Network) -> Vec<String> {
    let name = &net.ident;
    let mut names: Vec<String> = SUFFIXES.iter().map(|s| format!("{name}{s}")).collect();
    names.push(format!("__{name}"));
    for e in net.all_entries() {
        let path = &e.path;
        names.extend(SUFFIXES.iter().map(|s| format!("{path}{s}")));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A network with every kind, in every element type.
    fn mixed(dtype: &str) -> spec::Network {
        let dtype = syn::Ident::new(dtype, proc_macro2::Span::call_site());
        let tokens = quote! {
            pub struct Net {
                input: [12, 12, 3],
                batch: 4,
                dtype: #dtype,
                layers: [
                    c1: Conv2d { out_channels: 16, kernel: 3, padding: 1, activation: Relu },
                    p1: MaxPool2d { kernel: 3, stride: 2, padding: 1 },
                    block: Residual {
                        layers: [
                            c2: Conv2d { out_channels: 16, kernel: 3, padding: 1, norm: BatchNorm { momentum: 0.1, eps: 1e-5 } },
                            act: Activation(Tanh),
                            c3: Conv2d { out_channels: 16, kernel: 3, padding: 1, norm: LayerNorm { eps: 1e-5 } },
                        ],
                    },
                    p2: AvgPool2d { kernel: 2 },
                    flat: Flatten,
                    fc: Dense { out_features: 32, activation: Gelu },
                    q: Dense { out_features: 5 },
                ],
            }
        };
        let input: ast::Input = match syn::parse2(tokens) {
            Ok(input) => input,
            Err(e) => panic!("{e}"),
        };
        match valid::validate(input) {
            Ok(net) => net,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn every_expansion_keeps_the_hygiene_rules() {
        for dtype in ["f64", "f32", "f16", "bf16"] {
            let net = mixed(dtype);
            let found = crate::hygiene::violations(expand::expand(&net), &public_names(&net));
            assert!(found.is_empty(), "{dtype}:\n{}", found.join("\n"));
        }
    }

    #[test]
    fn shapes_chain() {
        let net = mixed("f32");
        let shapes: Vec<(String, spec::Shape)> = net
            .all_entries()
            .iter()
            .map(|e| (e.path.clone(), e.output))
            .collect();
        use spec::Shape::{Flat, Map};
        assert_eq!(
            shapes,
            [
                ("c1", Map([12, 12, 16])),
                ("p1", Map([6, 6, 16])),
                ("block", Map([6, 6, 16])),
                ("block__c2", Map([6, 6, 16])),
                ("block__act", Map([6, 6, 16])),
                ("block__c3", Map([6, 6, 16])),
                ("p2", Map([3, 3, 16])),
                ("flat", Flat(144)),
                ("fc", Flat(32)),
                ("q", Flat(5)),
            ]
            .map(|(p, s)| (p.to_string(), s))
        );
    }
}
