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
    let input = syn::parse_macro_input!(input as ast::Input);
    let fallback = expand::fallback(&input);
    match valid::validate(input) {
        Ok(spec) => expand::expand(&spec).into(),
        // Still define the layer's names so the user sees the spec's errors, not a cascade of
        // "cannot find type" errors at every use.
        Err(errors) => {
            let errors = errors.to_compile_error();
            quote::quote!(#errors #fallback).into()
        }
    }
}
