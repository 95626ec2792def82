//! The `conv2d!` and `network!` proc macros: parse -> validate -> expand.
//!
//! Use them through `conv_runtime`, which re-exports them; generated code names runtime items
//! only through `::conv_runtime::__private`.
//!
//! Every expansion is hygienic: no name the user defines or imports changes what it means. Its
//! private names start with `__`, constants passed as generic arguments are braced, and standard
//! items and macros are named by absolute paths. This holds for everything the crate's macros
//! emit, `conv2d!` and `network!` alike, now and later; `hygiene.rs` states the rules and checks
//! them over expanded code (each macro's unit tests run the check over every expansion).

mod ast;
mod expand;
mod hygiene;
mod network;
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

/// Defines a whole network — conv layers, pooling, dense layers, residual blocks — with its
/// shapes chained at expansion time and every entry specialized as `conv2d!` specializes a
/// layer: one parameter struct, one state, `evaluate` / `forward` / `backward` /
/// `backward_full`, and `Parameters` under the names `entry.field`. See `conv_runtime`'s API
/// docs.
#[proc_macro]
pub fn network(input: TokenStream) -> TokenStream {
    network::network(input.into()).into()
}

/// `__hygiene_names! { callback; spec spec .. }` (each `spec` a `conv2d!` body) calls
/// `callback! { values: [..], functions: [..], types: [..] }` with the private names the specs'
/// expansions define, without their `__` prefix, by kind (each name once, as
/// `(Name NameGrads NameState)`), or a compile error where an expansion
/// breaks the hygiene rules (`hygiene.rs`). For the project's hygiene test
/// (tests/hygiene.rs), which names its layers and items after them; not part of the API.
#[doc(hidden)]
#[proc_macro]
pub fn __hygiene_names(input: TokenStream) -> TokenStream {
    // The callback, `;`, then specs, each ending at its braced body.
    let mut tokens = proc_macro2::TokenStream::from(input).into_iter().peekable();
    let mut callback = proc_macro2::TokenStream::new();
    for tree in tokens.by_ref() {
        match &tree {
            proc_macro2::TokenTree::Punct(p) if p.as_char() == ';' => break,
            _ => callback.extend([tree]),
        }
    }
    let mut inputs = Vec::new();
    let mut spec = proc_macro2::TokenStream::new();
    for tree in tokens {
        let end = matches!(&tree, proc_macro2::TokenTree::Group(g)
            if g.delimiter() == proc_macro2::Delimiter::Brace);
        spec.extend([tree]);
        if end {
            match syn::parse2::<ast::Input>(std::mem::take(&mut spec)) {
                Ok(input) => inputs.push(input),
                Err(error) => return error.to_compile_error().into(),
            }
        }
    }
    let mut names = hygiene::Names::default();
    for input in inputs {
        match valid::validate(input) {
            Ok(spec) => {
                let (expansion, public) = (expand::expand(&spec), expand::public_names(&spec));
                let broken = hygiene::violations(expansion.clone(), &public);
                if !broken.is_empty() {
                    let message = format!(
                        "the expansion breaks its hygiene rules:\n{}",
                        broken.join("\n")
                    );
                    return syn::Error::new(spec.ident.span(), message)
                        .to_compile_error()
                        .into();
                }
                names.add(expansion, &public);
            }
            Err(errors) => return errors.to_compile_error().into(),
        }
    }
    // Each name once, in the namespace it is most dangerous in (a function name would turn a
    // user's constant of that name into a pattern nowhere; a constant's is checked as a value).
    let values = &names.values - &names.functions;
    let types = &(&names.types - &names.values) - &names.functions;
    // `(Name NameGrads NameState)`: a layer's names, for a case that defines one per name.
    let layers = |set: &std::collections::BTreeSet<String>| -> Vec<proc_macro2::TokenStream> {
        set.iter()
            .map(|n| {
                let span = proc_macro2::Span::call_site();
                let layer = syn::Ident::new(n, span);
                let grads = quote::format_ident!("{}Grads", layer);
                let state = quote::format_ident!("{}State", layer);
                quote::quote!((#layer #grads #state))
            })
            .collect()
    };
    let (values, functions, types) = (layers(&values), layers(&names.functions), layers(&types));
    quote::quote! {
        #callback! {
            values: [#(#values)*],
            functions: [#(#functions)*],
            types: [#(#types)*],
        }
    }
    .into()
}
