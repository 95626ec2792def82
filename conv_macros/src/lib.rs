//! The `conv2d!` proc macro: parse -> validate -> expand.
//!
//! Use it through `conv_runtime`, which re-exports it; generated code names runtime items only
//! through `::conv_runtime::__private`.

mod ast;
mod expand;
mod parse;
mod spec;
mod valid;

use proc_macro::TokenStream;

/// Defines a convolution layer, its gradients and forward state, with every shape computed at
/// expansion time and every operation specialized to the spec. See `conv_runtime`'s API docs.
#[proc_macro]
pub fn conv2d(input: TokenStream) -> TokenStream {
    let tokens = proc_macro2::TokenStream::from(input);
    let input: ast::Input = match syn::parse2(tokens.clone()) {
        Ok(input) => input,
        Err(error) => {
            // Still define the layer's names, so the syntax error is the only one.
            let fallback = expand::struct_name(tokens)
                .map(|name| expand::fallback(&[], &syn::Visibility::Inherited, &name));
            let error = error.to_compile_error();
            return quote::quote!(#error #fallback).into();
        }
    };
    let fallback = expand::fallback(&input.attrs, &input.vis, &input.ident);
    match valid::validate(input) {
        Ok(spec) => expand::expand(&spec).into(),
        Err(errors) => {
            let errors = errors.to_compile_error();
            quote::quote!(#errors #fallback).into()
        }
    }
}
