//! Validated [`Network`] -> tokens: every entry's layer (a `conv2d!` expansion) in a hidden
//! module, the network's parameter, gradient and state types, and its operations chaining the
//! entries with every shape a literal.
//!
//! Layout of what is emitted, for `pub struct Net { .. }`:
//! - `mod __Net`: each `Conv2d` and `Dense` entry as a `conv2d!` layer named by its path
//!   (`conv1`, `block__conv1` inside residual `block`; an entry the same as an earlier one in
//!   all but its name as aliases of the earlier one's items, so that repeated blocks compile
//!   their kernels once), a struct per residual block holding its
//!   layers, the pooling and element-wise kernels, and the workspaces (`__Eval<B>` for
//!   `evaluate`, `__Grad` for the backward passes), which the device keeps between calls;
//! - `Net`, `NetGrads` (one field per entry with parameters), `NetState` (what the backward pass
//!   needs: each layer's state, each pooling's output and max-pooling's winners), the
//!   `NetDevice` trait (every layer's device trait and [`NetworkDevice`]), `NetInput<B>`,
//!   `NetOutput<B>`, and `Parameters` with the names `entry.field`.
//!
//! The rules of `crate::hygiene` hold: private names start with `__`, constants in generic
//! arguments are braced, standard items are named by absolute paths.
//!
//! [`NetworkDevice`]: conv_runtime::NetworkDevice

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::spec::{is_fused_pool, Entry, Kind, Network, Pool, PoolKind, Shape};
use crate::expand::{acc, elem, kernel::avx2_target, lit, rt, types::params};
use crate::spec::{Activation, Dtype, Norm};

/// Bytes of running values a pooling kernel keeps per chunk of channels: two AVX2 vectors,
/// two independent chains of compares, whose values and winners' indices stay in registers (a
/// max-pooling of 32 channels at batch 32, 32x32 -> 16x16: one vector 500 us, two 340 us, four
/// 1330 us, spilled).
const POOL_CHUNK_BYTES: usize = 64;

/// The Rust path of an entry's field (`block.conv1`) and its name in `Parameters`
/// (`block.conv1`).
pub(super) fn dotted(path: &str) -> String {
    path.replace("__", ".")
}

pub fn expand(net: &Network) -> TokenStream {
    let rt = rt();
    let t = elem(net.dtype);
    let name = &net.ident;
    let vis = &net.vis;
    let attrs = &net.attrs;
    let module = format_ident!("__{}", name);
    let grads = format_ident!("{}Grads", name);
    let state = format_ident!("{}State", name);
    let device = format_ident!("{}Device", name);
    let input_alias = format_ident!("{}Input", name);
    let output_alias = format_ident!("{}Output", name);
    let all = net.all_entries();
    let batch = lit(net.batch);

    // Layers, and a struct per residual block.
    let layers = layer_items(&all);
    let blocks = all.iter().filter_map(|e| match &e.kind {
        Kind::Residual(inner) => Some(block_structs(&e.path, inner)),
        _ => None,
    });
    let kernels = all.iter().map(|e| kernels(net, e));

    // Top-level fields.
    let prefix = quote!(#module::);
    let (fields, field_tys, grad_tys) = param_fields(&prefix, &net.entries);
    let layer_entries: Vec<&Entry> = all
        .iter()
        .copied()
        .filter(|e| e.layer().is_some())
        .collect();
    let new_fields = init_exprs(&prefix, &net.entries);
    let shared = shared_impls(name, &fields, &grads, &grad_tys);

    // Device trait: every layer's own, and the network's needs.
    let layer_traits: Vec<TokenStream> = layer_entries
        .iter()
        .map(|e| {
            let d = format_ident!("{}Device", e.path);
            quote!(#module::#d)
        })
        .collect();

    // Shapes.
    let [ih, iw, ic] = net.input.map(lit);
    let out = net.output();
    let tensor = |b: &TokenStream, s: Shape| {
        let [h, w, c] = s.dims().map(lit);
        quote!(#rt::Tensor<#t, #b, #h, #w, #c>)
    };
    let generic_b = quote!({ __B });
    let output_ty = |b: &TokenStream| match out {
        Shape::Map(_) => tensor(b, out),
        Shape::Flat(n) => {
            let n = lit(n);
            quote!(#rt::Matrix<#t, #b, #n>)
        }
    };
    let out_generic = output_ty(&generic_b);
    let out_batch = output_ty(&quote!(#batch));
    let in_generic = tensor(&generic_b, Shape::Map(net.input));
    let in_batch = tensor(&quote!(#batch), Shape::Map(net.input));
    let out_consts = match out {
        Shape::Map([h, w, c]) => {
            let (h, w, c) = (lit(h), lit(w), lit(c));
            quote! {
                /// Output height of the last entry.
                pub const OUTPUT_HEIGHT: usize = #h;
                /// Output width of the last entry.
                pub const OUTPUT_WIDTH: usize = #w;
                /// Output channels of the last entry.
                pub const OUTPUT_CHANNELS: usize = #c;
            }
        }
        Shape::Flat(n) => {
            let n = lit(n);
            quote! {
                /// Output features of the last entry.
                pub const OUTPUT_FEATURES: usize = #n;
            }
        }
    };
    let parameter_count: usize = layer_entries
        .iter()
        .filter_map(|e| e.layer())
        .map(|s| {
            let w = s.out_channels * s.kernel[0] * s.kernel[1] * s.in_c();
            let norm = if s.norm == Norm::None { 0 } else { 2 };
            w + s.out_channels * (1 + norm)
        })
        .sum();
    let parameter_count = lit(parameter_count);

    // State fields and workspaces.
    let state_fields = all.iter().map(|e| state_field(net, &module, e));
    let state_inits = all.iter().map(|e| state_init(&module, e, net.batch));
    let fused = net.fused_pools();
    let gate_names: Vec<_> = fused.iter().map(|e| gate_field(e)).collect();
    let gate_inits = fused.iter().map(|e| gate_init(e));
    let eval_fields = all
        .iter()
        .filter_map(|e| buffer_field(net, e, &generic_b))
        .chain(gate_names.iter().map(|g| quote!(pub #g: #rt::PoolGate)));
    let eval_inits = all.iter().filter_map(|e| buffer_init(e)).chain(
        gate_names
            .iter()
            .zip(gate_inits)
            .map(|(g, i)| quote!(#g: #i)),
    );
    let grad_fields = all.iter().filter_map(|e| gradient_field(net, e));
    let grad_inits = all.iter().filter_map(|e| gradient_init(e));

    let evaluate = evaluate_body(net);
    let forward = forward_body(net);
    let backward = backward_body(net, false);
    let backward_full = backward_body(net, true);
    let parameters = parameters_impl(net, name, &grads);
    let entries = entries_impl(net, name);
    let cuda = super::cuda::expand(net);
    let final_output = state_output(net);

    let doc_device = format!(
        "Devices that run [`{name}`]: every device each of its layers runs on (the CPU, oneDNN)."
    );
    let doc_input = format!("The input of [`{name}`] at batch `B`.");
    let doc_output = format!("The output of [`{name}`] at batch `B`.");

    quote! {
        #[doc(hidden)]
        #[allow(non_camel_case_types, non_snake_case, dead_code, clippy::all)]
        #vis mod #module {
            #layers
            #(#blocks)*
            #(#kernels)*

            /// `evaluate`'s buffers at batch `B`, kept by the device between calls.
            pub struct __Eval<const __B: usize> {
                #(#eval_fields,)*
            }

            impl<const __B: usize> ::core::default::Default for __Eval<{ __B }> {
                fn default() -> Self {
                    Self { #(#eval_inits,)* }
                }
            }

            /// The backward passes' gradient buffers (at each entry's output), kept by the
            /// device between calls.
            pub struct __Grad {
                #(#grad_fields,)*
            }

            impl ::core::default::Default for __Grad {
                fn default() -> Self {
                    Self { #(#grad_inits,)* }
                }
            }
        }

        #(#attrs)*
        #vis struct #name {
            #(
                #[doc = ::core::concat!("Entry `", ::core::stringify!(#fields), "`.")]
                pub #fields: #field_tys,
            )*
        }

        /// Gradients of the network's parameters, entry by entry.
        #vis struct #grads {
            #(
                #[doc = ::core::concat!("Gradients of entry `", ::core::stringify!(#fields), "`.")]
                pub #fields: #grad_tys,
            )*
        }

        /// What a forward pass keeps for the backward pass that follows it: each layer's
        /// state, each pooling's and activation's output, max-pooling's winners.
        #vis struct #state {
            #(#state_fields,)*
        }

        #[doc = #doc_device]
        #vis trait #device: #(#layer_traits +)* #rt::NetworkDevice {}
        impl<__D: #(#layer_traits +)* #rt::NetworkDevice> #device for __D {}

        #[doc = #doc_input]
        #[allow(dead_code)]
        #vis type #input_alias<const __B: usize> = #in_generic;
        #[doc = #doc_output]
        #[allow(dead_code)]
        #vis type #output_alias<const __B: usize> = #out_generic;

        impl #name {
            /// Input height.
            pub const INPUT_HEIGHT: usize = #ih;
            /// Input width.
            pub const INPUT_WIDTH: usize = #iw;
            /// Input channels.
            pub const INPUT_CHANNELS: usize = #ic;
            /// The training batch of `forward` and the backward passes.
            pub const BATCH_SIZE: usize = #batch;
            #out_consts
            /// Trainable scalars of every entry.
            pub const PARAMETER_COUNT: usize = #parameter_count;

            /// A network whose layers are initialized by their initializers, in entry order.
            pub fn new(rng: &mut #rt::Rng) -> Self {
                Self { #(#new_fields,)* }
            }

            /// Inference on any batch; BatchNorm uses the running statistics.
            pub fn evaluate<__D: #device, const __B: usize>(
                &self,
                device: &mut __D,
                input: &#in_generic,
                output: &mut #out_generic,
            ) -> #rt::Result<()> {
                #evaluate
            }

            /// Forward pass on the training batch, keeping what the backward pass needs in
            /// `state`; `Mode::Train` uses batch statistics and updates BatchNorm's running ones.
            pub fn forward<__D: #device>(
                &mut self,
                device: &mut __D,
                input: &#in_batch,
                state: &mut #state,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                #forward
            }

            /// Adds the parameter gradients of the forward pass that filled `state` (run in
            /// `mode`) into `grads`.
            pub fn backward<__D: #device>(
                &self,
                device: &mut __D,
                state: &#state,
                input: &#in_batch,
                d_output: &#out_batch,
                grads: &mut #grads,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                let _ = input;
                #backward
            }

            /// `backward`, and the gradient with respect to the input into `d_input`.
            #[allow(clippy::too_many_arguments)]
            pub fn backward_full<__D: #device>(
                &self,
                device: &mut __D,
                state: &#state,
                input: &#in_batch,
                d_output: &#out_batch,
                d_input: &mut #in_batch,
                grads: &mut #grads,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                #backward_full
            }
        }

        #shared

        impl #state {
            /// Zeroed state.
            pub fn new() -> Self {
                Self { #(#state_inits,)* }
            }

            /// The output of the last forward pass.
            pub fn output(&self) -> &#out_batch {
                #final_output
            }
        }

        impl ::core::default::Default for #state {
            fn default() -> Self {
                Self::new()
            }
        }

        #parameters
        #entries
        #cuda
    }
}

/// Every layer's items: a `conv2d!` expansion for each distinct spec, and for a layer that is
/// the same as an earlier one under another name (a repeated residual block), aliases of the
/// earlier one's items, so that its kernels are compiled once. The layers hold their own
/// parameters either way.
fn layer_items(all: &[&Entry]) -> TokenStream {
    let mut expanded: Vec<&crate::spec::Spec> = Vec::new();
    let mut items = TokenStream::new();
    for spec in all.iter().filter_map(|e| e.layer()) {
        match expanded.iter().find(|first| first.same_layer(spec)) {
            Some(first) => items.extend(layer_aliases(first, spec)),
            None => {
                items.extend(crate::expand::expand(spec));
                expanded.push(spec);
            }
        }
    }
    items
}

/// `spec`'s items as aliases of `first`'s (see [`layer_items`]).
fn layer_aliases(first: &crate::spec::Spec, spec: &crate::spec::Spec) -> TokenStream {
    let vis = &spec.vis;
    let [layer, grads, state, device, input, output, cuda, cuda_grads, cuda_state] =
        super::SUFFIXES.map(|s| {
            (
                format_ident!("{}{}", first.ident, s),
                format_ident!("{}{}", spec.ident, s),
            )
        });
    let doc = format!("The same layer as [`{}`].", first.ident);
    let rt = rt();
    let alias = |(of, name): (syn::Ident, syn::Ident)| quote!(#vis type #name = #of;);
    let batched = |(of, name): (syn::Ident, syn::Ident)| quote!(#vis type #name<const __B: usize> = #of<{ __B }>;);
    let (device_of, device_name) = device;
    let (layer, grads, state) = (alias(layer), alias(grads), alias(state));
    let (input, output) = (batched(input), batched(output));
    let (cuda, cuda_grads, cuda_state) = (alias(cuda), alias(cuda_grads), alias(cuda_state));
    quote! {
        #[doc = #doc]
        #layer
        #grads
        #state
        #vis use #device_of as #device_name;
        #input
        #output
        #rt::if_cuda! {
            #cuda
            #cuda_grads
            #cuda_state
        }
    }
}

/// `(field names, types, gradient types)` of the entries of a list that have parameters.
/// `prefix` is the path to the hidden module's items (`__Net::`, or nothing inside it).
fn param_fields(
    prefix: &TokenStream,
    entries: &[Entry],
) -> (Vec<syn::Ident>, Vec<TokenStream>, Vec<TokenStream>) {
    let mut names = Vec::new();
    let mut tys = Vec::new();
    let mut grads = Vec::new();
    for e in entries {
        if matches!(e.kind, Kind::Conv(_) | Kind::Dense(_) | Kind::Residual(_)) {
            let ty = format_ident!("{}", e.path);
            let g = format_ident!("{}Grads", e.path);
            names.push(e.name.clone());
            tys.push(quote!(#prefix #ty));
            grads.push(quote!(#prefix #g));
        }
    }
    (names, tys, grads)
}

/// `field: Type::new(rng)` for the entries of a list with parameters, in order.
fn init_exprs(prefix: &TokenStream, entries: &[Entry]) -> Vec<TokenStream> {
    entries
        .iter()
        .filter(|e| matches!(e.kind, Kind::Conv(_) | Kind::Dense(_) | Kind::Residual(_)))
        .map(|e| {
            let (field, ty) = (&e.name, format_ident!("{}", e.path));
            quote!(#field: #prefix #ty::new(rng))
        })
        .collect()
}

/// A residual block's parameter and gradient structs (its layers' fields).
fn block_structs(path: &str, inner: &[Entry]) -> TokenStream {
    let (fields, tys, grads) = param_fields(&TokenStream::new(), inner);
    let news = init_exprs(&TokenStream::new(), inner);
    let ty = format_ident!("{}", path);
    let g = format_ident!("{}Grads", path);
    let shared = shared_impls(&ty, &fields, &g, &grads);
    quote! {
        /// A residual block's layers.
        pub struct #ty {
            #( pub #fields: #tys, )*
        }

        impl #ty {
            /// The block's layers, initialized in entry order.
            pub fn new(rng: &mut ::conv_runtime::__private::Rng) -> Self {
                let _ = &rng;
                Self { #(#news,)* }
            }
        }

        /// A residual block's gradients.
        pub struct #g {
            #( pub #fields: #grads, )*
        }

        #shared
    }
}

/// What a network and each of its residual blocks define alike, for a parameter struct `ty`
/// with the parameter `fields` and its gradient struct `grads` (field types `grad_tys`):
/// `copy_from`, `Clone`, `Debug`, and the gradients' `zeros`, `zero` and `add`.
fn shared_impls(
    ty: &syn::Ident,
    fields: &[syn::Ident],
    grads: &syn::Ident,
    grad_tys: &[TokenStream],
) -> TokenStream {
    quote! {
        impl #ty {
            /// Copies `other`'s parameters and running statistics into this one (a DQN's
            /// target network).
            pub fn copy_from(&mut self, other: &Self) {
                let _ = other;
                #( self.#fields.copy_from(&other.#fields); )*
            }
        }

        impl ::core::clone::Clone for #ty {
            fn clone(&self) -> Self {
                Self { #( #fields: ::core::clone::Clone::clone(&self.#fields), )* }
            }
        }

        impl ::core::fmt::Debug for #ty {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.debug_struct(::core::stringify!(#ty))
                    #(.field(::core::stringify!(#fields), &self.#fields))*
                    .finish()
            }
        }

        impl #grads {
            /// All-zero gradients.
            pub fn zeros() -> Self {
                Self { #( #fields: <#grad_tys>::zeros(), )* }
            }

            /// Clears every gradient.
            pub fn zero(&mut self) {
                #( self.#fields.zero(); )*
            }

            /// Adds `other`'s gradients into these.
            pub fn add(&mut self, other: &Self) {
                let _ = other;
                #( self.#fields.add(&other.#fields); )*
            }
        }
    }
}

/// The Rust access path of an entry inside `root` (`self.block.conv1`).
pub(super) fn access(root: TokenStream, path: &str) -> TokenStream {
    let parts = path.split("__").map(|p| format_ident!("{}", p));
    quote!(#root #(.#parts)*)
}

/// The state field of an entry, if it keeps anything.
fn state_field(net: &Network, module: &syn::Ident, e: &Entry) -> TokenStream {
    let rt = rt();
    let t = elem(net.dtype);
    let field = format_ident!("{}", e.path);
    let batch = lit(net.batch);
    let [h, w, c] = e.output.dims().map(lit);
    let out = quote!(#rt::Tensor<#t, #batch, #h, #w, #c>);
    match &e.kind {
        Kind::Conv(_) | Kind::Dense(_) => {
            let s = format_ident!("{}State", e.path);
            quote!(#field: #module::#s)
        }
        Kind::Pool(PoolKind::Max, _) => {
            let winners = format_ident!("__winners_{}", e.path);
            quote!(#field: #out, #winners: ::std::vec::Vec<u32>)
        }
        Kind::Pool(PoolKind::Avg, _) | Kind::Activation(_) | Kind::Residual(_) => {
            quote!(#field: #out)
        }
        Kind::Flatten => quote!(#field: ()),
    }
}

fn state_init(module: &syn::Ident, e: &Entry, batch: usize) -> TokenStream {
    let rt = rt();
    let field = format_ident!("{}", e.path);
    match &e.kind {
        Kind::Conv(_) | Kind::Dense(_) => {
            let s = format_ident!("{}State", e.path);
            quote!(#field: #module::#s::new())
        }
        Kind::Pool(PoolKind::Max, _) => {
            let winners = format_ident!("__winners_{}", e.path);
            let n = lit(batch * e.output.len());
            quote!(#field: #rt::Tensor::zeros(), #winners: ::std::vec![0u32; #n])
        }
        Kind::Pool(PoolKind::Avg, _) | Kind::Activation(_) | Kind::Residual(_) => {
            quote!(#field: #rt::Tensor::zeros())
        }
        Kind::Flatten => quote!(#field: ()),
    }
}

/// `evaluate`'s buffer for an entry's output (none for `Flatten`, a view).
fn buffer_field(net: &Network, e: &Entry, b: &TokenStream) -> Option<TokenStream> {
    let rt = rt();
    let t = elem(net.dtype);
    let field = format_ident!("{}", e.path);
    let [h, w, c] = e.output.dims().map(lit);
    (!matches!(e.kind, Kind::Flatten)).then(|| quote!(pub #field: #rt::Tensor<#t, #b, #h, #w, #c>))
}

fn buffer_init(e: &Entry) -> Option<TokenStream> {
    let rt = rt();
    let field = format_ident!("{}", e.path);
    (!matches!(e.kind, Kind::Flatten)).then(|| quote!(#field: #rt::Tensor::zeros()))
}

/// `evaluate`'s progress of a max-pooling fused into the preceding convolution's epilogue.
fn gate_field(e: &Entry) -> syn::Ident {
    format_ident!("__gate_{}", e.path)
}

fn gate_init(e: &Entry) -> TokenStream {
    let rt = rt();
    let Kind::Pool(_, pool) = &e.kind else {
        unreachable!("a gate for an entry that does not pool")
    };
    let [ih, iw, _] = e.input.dims().map(lit);
    let oh = lit(e.output.dims()[0]);
    let [k, s, p] = [pool.kernel[0], pool.stride[0], pool.padding[0]].map(lit);
    quote!(#rt::PoolGate::new(__B, [#ih, #iw], #oh, [#k, #s, #p]))
}

/// The backward passes' buffer for the gradient at an entry's input (none where the entry
/// passes its output gradient on as it is: `Flatten`).
/// A residual block's buffer also holds the gradient at its inner list's input.
fn gradient_field(net: &Network, e: &Entry) -> Option<TokenStream> {
    let rt = rt();
    let t = elem(net.dtype);
    let field = format_ident!("{}", e.path);
    let batch = lit(net.batch);
    let [h, w, c] = e.input.dims().map(lit);
    let ty = quote!(#rt::Tensor<#t, #batch, #h, #w, #c>);
    match e.kind {
        Kind::Flatten => None,
        Kind::Residual(_) => {
            let inner = format_ident!("__inner_{}", e.path);
            Some(quote!(pub #field: #ty, pub #inner: #ty))
        }
        _ => Some(quote!(pub #field: #ty)),
    }
}

fn gradient_init(e: &Entry) -> Option<TokenStream> {
    let rt = rt();
    let field = format_ident!("{}", e.path);
    match e.kind {
        Kind::Flatten => None,
        Kind::Residual(_) => {
            let inner = format_ident!("__inner_{}", e.path);
            Some(quote!(#field: #rt::Tensor::zeros(), #inner: #rt::Tensor::zeros()))
        }
        _ => Some(quote!(#field: #rt::Tensor::zeros())),
    }
}

/// A pooling entry's call: average pooling in the device's own library where it has one for
/// the element type (`own`, an `Option<Result<()>>`), else the generated kernel, counted as a
/// fallback; max-pooling always the generated kernel (see `OneDnn`'s `NetworkDevice` docs).
fn pool_call(kind: PoolKind, own: TokenStream, generated: TokenStream) -> TokenStream {
    match kind {
        PoolKind::Max => quote! {
            device.__fallback();
            #generated
        },
        PoolKind::Avg => quote! {
            match #own {
                ::core::option::Option::Some(__done) => __done?,
                ::core::option::Option::None => {
                    device.__fallback();
                    #generated
                }
            }
        },
    }
}

/// The kernels of an entry that is not a layer: pooling, activation, the residual sum.
fn kernels(net: &Network, e: &Entry) -> TokenStream {
    let rt = rt();
    let t = elem(net.dtype);
    let a = acc(net.dtype);
    let to_acc = quote!(<#t as #rt::Element>::to_acc);
    let from_acc = quote!(<#t as #rt::Element>::from_acc);
    let [ih, iw, c] = e.input.dims().map(lit);
    let [oh, ow, _] = e.output.dims().map(lit);
    let c_value = e.input.dims()[2];
    let forward = format_ident!("__forward_{}", e.path);
    let backward = format_ident!("__backward_{}", e.path);
    let backward_sum = format_ident!("__backward_sum_{}", e.path);
    match &e.kind {
        Kind::Pool(
            kind,
            Pool {
                kernel,
                stride,
                padding,
            },
        ) => {
            let (kh, kw) = (lit(kernel[0]), lit(kernel[1]));
            let (sh, sw) = (lit(stride[0]), lit(stride[1]));
            let (ph, pw) = (lit(padding[0]), lit(padding[1]));
            let area = lit(kernel[0] * kernel[1]);
            // The outputs whose windows cover input row `h` (column `w`): `o * s - p <= h <
            // o * s - p + k`.
            let covering = quote! {
                let lo = (h + #ph + 1).saturating_sub(#kh).div_ceil(#sh);
                let hi = (h + #ph) / #sh + 1;
                let ohs = lo..if hi < #oh { hi } else { #oh };
            };
            let covering_cols = quote! {
                let lo = (w + #pw + 1).saturating_sub(#kw).div_ceil(#sw);
                let hi = (w + #pw) / #sw + 1;
                let ows = lo..if hi < #ow { hi } else { #ow };
            };
            let window = quote! {
                let h0 = oh * #sh;
                let w0 = ow * #sw;
                // The window's rows and columns inside the (unpadded) input.
                let rows = (if h0 < #ph { #ph - h0 } else { 0 })..(if h0 + #kh <= #ph + #ih { #kh } else { #ph + #ih - h0 });
                let cols = (if w0 < #pw { #pw - w0 } else { 0 })..(if w0 + #kw <= #pw + #iw { #kw } else { #pw + #iw - w0 });
            };
            // Each kernel's rows through `__rows`: compiled for AVX2 where the CPU has it, so
            // that the channel loops (innermost, contiguous, branch-free) vectorize.
            let avx2_target = avx2_target();
            let rows_fn = |params: TokenStream, args: TokenStream, body: TokenStream| {
                quote! {
                    #[inline(always)]
                    fn __rows_body<const __B: usize, const __KEEP: bool>(#params) {
                        #body
                    }
                    // Compiled once, for the target's features, where they include AVX2 and
                    // FMA (see `dispatched`).
                    #[cfg(all(target_arch = "x86_64", not(#avx2_target)))]
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn __rows_avx2<const __B: usize, const __KEEP: bool>(#params) {
                        __rows_body::<{ __B }, { __KEEP }>(#args)
                    }
                    // Where the CPU has AVX-512, a 16-lane chunk in one zmm register instead of
                    // two ymm: max-pooling's comparisons and selections one instruction each
                    // (where the compiler takes the 512-bit width). Lane-wise either way: the
                    // same bits.
                    #[cfg(target_arch = "x86_64")]
                    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                    unsafe fn __rows_avx512<const __B: usize, const __KEEP: bool>(#params) {
                        __rows_body::<{ __B }, { __KEEP }>(#args)
                    }
                    fn __rows<const __B: usize, const __KEEP: bool>(#params) {
                        #[cfg(target_arch = "x86_64")]
                        if #rt::simd::avx512() {
                            // SAFETY: the CPU has AVX-512F, AVX-512VL, AVX2 and FMA.
                            return unsafe { __rows_avx512::<{ __B }, { __KEEP }>(#args) };
                        }
                        #[cfg(all(target_arch = "x86_64", not(#avx2_target)))]
                        if #rt::avx2_fma() {
                            // SAFETY: the CPU has AVX2 and FMA.
                            return unsafe { __rows_avx2::<{ __B }, { __KEEP }>(#args) };
                        }
                        __rows_body::<{ __B }, { __KEEP }>(#args)
                    }
                }
            };
            // The channels in chunks of `POOL_CHUNK_BYTES` (and a last chunk of the rest), each
            // chunk's running values in a fixed-size array that stays in registers across the
            // window: the whole channel row as one array lived on the stack, stored (masked)
            // and reloaded at every window position.
            let lanes = POOL_CHUNK_BYTES / if net.dtype == Dtype::F64 { 8 } else { 4 };
            let chunks = |body: &dyn Fn(proc_macro2::Literal) -> TokenStream| {
                let full = c_value - c_value % lanes;
                let rest = c_value % lanes;
                let mut out = TokenStream::new();
                if full > 0 {
                    let (full, step, body) = (lit(full), lit(lanes), body(lit(lanes)));
                    out.extend(quote! {
                        for c0 in (0..#full).step_by(#step) {
                            #body
                        }
                    });
                }
                if rest > 0 {
                    let (start, body) = (lit(full), body(lit(rest)));
                    out.extend(quote! {{
                        let c0 = #start;
                        #body
                    }});
                }
                out
            };
            // Whether the backward pass can write a large map's gradient with streaming stores
            // (see `#backward`).
            let streams = matches!(kind, PoolKind::Max)
                && net.dtype == Dtype::F32
                && c_value.is_multiple_of(16);
            // Per kind: what a call sets up, each output row's extra slices, each output
            // pixel's body (after `window`), and each input pixel's gradient (after the
            // covering outputs).
            let (forward_setup, forward_row, forward_pixel, backward_setup, backward_pixel) =
                match kind {
                    PoolKind::Max => {
                        let forward = chunks(&|width| {
                            quote! {
                                let mut best = [#a::NEG_INFINITY; #width];
                                let mut at = [0u32; #width];
                                for l in 0..#width {
                                    at[l] = (first + c0 + l) as u32;
                                }
                                for i in rows.clone() {
                                    for j in cols.clone() {
                                        let px = ((n * #ih + h0 + i - #ph) * #iw + w0 + j - #pw) * #c + c0;
                                        let xs = &x[px - base..][..#width];
                                        for l in 0..#width {
                                            let (v, b) = (#to_acc(xs[l]), best[l]);
                                            // PyTorch's `val > maxval || isnan(val)`: the last NaN
                                            // wins.
                                            let take = (v > b) | v.is_nan();
                                            best[l] = if take { v } else { b };
                                            if __KEEP {
                                                at[l] = if take { (px + l) as u32 } else { at[l] };
                                            }
                                        }
                                    }
                                }
                                let out = &mut y[ow * #c + c0..][..#width];
                                for l in 0..#width {
                                    out[l] = #from_acc(best[l]);
                                }
                                if __KEEP {
                                    w[ow * #c + c0..][..#width].copy_from_slice(&at);
                                }
                            }
                        });
                        // A large map's gradient is written around the caches (see `#backward`):
                        // f32 rows of whole zmm vectors, where the caller found AVX-512 and the
                        // map aligned.
                        let stream_store = streams.then(|| {
                            quote! {
                                #[cfg(target_arch = "x86_64")]
                                if stream {
                                    // SAFETY: AVX-512F is present and `dx` (a row of whole
                                    // cache lines in a map aligned to one) is aligned to 64
                                    // bytes: the caller checked both.
                                    unsafe {
                                        use ::core::arch::x86_64::{_mm512_loadu_ps, _mm512_stream_ps};
                                        for v in 0..#c / 16 {
                                            _mm512_stream_ps(dx.as_mut_ptr().add(16 * v), _mm512_loadu_ps(sum.as_ptr().add(16 * v)));
                                        }
                                    }
                                    continue;
                                }
                            }
                        });
                        // The gradient keeps whole channel rows: its one running sum per channel
                        // stays in registers as it is (chunks of it ran 4x slower).
                        let backward = quote! {
                            let mut sum = [0.0 as #a; #c];
                            for oh in ohs.clone() {
                                for ow in ows.clone() {
                                    let k = ((n * #oh + oh) * #ow + ow) * #c;
                                    let (ws, gs) = (&winners[k..k + #c], &dy[k..k + #c]);
                                    for ch in 0..#c {
                                        let g = #to_acc(gs[ch]);
                                        sum[ch] += if ws[ch] == (me + ch) as u32 { g } else { 0.0 };
                                    }
                                }
                            }
                            let dx = &mut dx[w * #c..(w + 1) * #c];
                            #stream_store
                            for ch in 0..#c {
                                dx[ch] = #from_acc(sum[ch]);
                            }
                        };
                        (
                            TokenStream::new(),
                            quote!(let w = if __KEEP { unsafe { ws.part(row * #ow * #c, #ow * #c) } } else { &mut [][..] };),
                            quote! {
                                // An all -inf window's winner is its first position, as in
                                // PyTorch.
                                let first = ((n * #ih + h0 + rows.start - #ph) * #iw + w0 + cols.start - #pw) * #c;
                                #forward
                            },
                            TokenStream::new(),
                            quote! {
                                // A loser adds +0: the sum starts at +0, so it is never -0, and
                                // adding +0 leaves its bits as they are.
                                let me = (row * #iw + w) * #c;
                                #backward
                            },
                        )
                    }
                    PoolKind::Avg => {
                        let forward = chunks(&|width| {
                            quote! {
                                let mut sum = [0.0 as #a; #width];
                                for i in rows.clone() {
                                    for j in cols.clone() {
                                        let px = ((n * #ih + h0 + i - #ph) * #iw + w0 + j - #pw) * #c + c0;
                                        let xs = &x[px - base..][..#width];
                                        for l in 0..#width {
                                            sum[l] += #to_acc(xs[l]);
                                        }
                                    }
                                }
                                let y = &mut y[ow * #c + c0..][..#width];
                                for l in 0..#width {
                                    y[l] = #from_acc(sum[l] * scale);
                                }
                            }
                        });
                        let backward = quote! {
                            let mut sum = [0.0 as #a; #c];
                            for oh in ohs.clone() {
                                for ow in ows.clone() {
                                    let k = ((n * #oh + oh) * #ow + ow) * #c;
                                    let gs = &dy[k..k + #c];
                                    for ch in 0..#c {
                                        sum[ch] += #to_acc(gs[ch]);
                                    }
                                }
                            }
                            let dx = &mut dx[w * #c..(w + 1) * #c];
                            for ch in 0..#c {
                                dx[ch] = #from_acc(sum[ch] * scale);
                            }
                        };
                        let scale = quote!(let scale = 1.0 as #a / (#area as #a););
                        (
                            quote!(let _ = ws; #scale),
                            TokenStream::new(),
                            forward,
                            quote!(let _ = winners; #scale),
                            backward,
                        )
                    }
                };
            let forward_rows = rows_fn(
                quote!(x: &[#t], base: usize, ys: &#rt::Shared<'_, #t>, ws: &#rt::Shared<'_, u32>, range: ::core::ops::Range<usize>),
                quote!(x, base, ys, ws, range),
                quote! {
                    #forward_setup
                    for row in range {
                        let (n, oh) = (row / #oh, row % #oh);
                        // SAFETY: the worker's own output rows.
                        let y = unsafe { ys.part(row * #ow * #c, #ow * #c) };
                        #forward_row
                        for ow in 0..#ow {
                            #window
                            #forward_pixel
                        }
                    }
                },
            );
            let backward_rows = rows_fn(
                quote!(dy: &[#t], winners: &[u32], dxs: &#rt::Shared<'_, #t>, range: ::core::ops::Range<usize>, stream: bool),
                quote!(dy, winners, dxs, range, stream),
                quote! {
                    #backward_setup
                    for row in range {
                        let (n, h) = (row / #ih, row % #ih);
                        // SAFETY: the worker's own input rows.
                        let dx = unsafe { dxs.part(row * #iw * #c, #iw * #c) };
                        #covering
                        for w in 0usize..#iw {
                            #covering_cols
                            #backward_pixel
                        }
                    }
                    // The streaming stores are ordered before the workers' join.
                    #[cfg(target_arch = "x86_64")]
                    if stream {
                        // SAFETY: SSE is part of x86-64.
                        unsafe { ::core::arch::x86_64::_mm_sfence() };
                    }
                    let _ = stream;
                },
            );
            let (what, gradient) = match kind {
                PoolKind::Max => (
                    quote! {
                        /// Max-pooling of `B` images, the winners' input indices into `winners`
                        /// (when not empty): padded positions never win, the first maximum in
                        /// row-major window order does, and the last NaN wins, as in PyTorch.
                    },
                    quote! {
                        /// `dx` = the gradient of max-pooling, gathered: each input sums, in
                        /// output order, the gradients of the outputs it won.
                    },
                ),
                PoolKind::Avg => (
                    quote! {
                        /// Average pooling of `B` images; the divisor counts padded positions
                        /// (PyTorch's default).
                    },
                    quote! {
                        /// `dx` = the gradient of average pooling, gathered: each input sums,
                        /// in output order, the gradients of the windows it is in, over the
                        /// area.
                    },
                ),
            };
            // Max-pooling fused into the preceding convolution's epilogue: one output row at a
            // time, by the worker that finished the last map row of its windows.
            let fused = net.fused_pools().iter().any(|f| f.path == e.path);
            let fused_row = fused.then(|| {
                let row = format_ident!("__forward_row_{}", e.path);
                quote! {
                    /// One output row of max-pooling (`row` of the batch-flattened rows, its
                    /// windows reading `window`, rows of its image) from a map that the
                    /// convolution's workers are still writing: only those map rows are read.
                    pub fn #row<const __B: usize>(
                        map: &#rt::Shared<'_, #t>,
                        y: &#rt::Shared<'_, #t>,
                        row: usize,
                        window: ::core::ops::Range<usize>,
                    ) {
                        #forward_rows
                        let base = (row / #oh * #ih + window.start) * #iw * #c;
                        // SAFETY: the window's map rows are final: no worker writes them any
                        // more (see `PoolGate`).
                        let x = unsafe { map.read(base, window.len() * #iw * #c) };
                        __rows::<{ __B }, false>(x, base, y, &#rt::Shared::new(&mut []), row..row + 1);
                    }
                }
            });
            let geometry = format_ident!("__GEOMETRY_{}", e.path);
            let [gh, gw] = [padding[0], padding[1]].map(lit);
            let [kh0, kw0, sh0, sw0] = [kernel[0], kernel[1], stride[0], stride[1]].map(lit);
            let batch = lit(net.batch);
            quote! {
                /// The entry's sizes, for a device's own pooling primitives.
                pub const #geometry: #rt::PoolGeometry = #rt::PoolGeometry {
                    batch: #batch,
                    in_h: #ih,
                    in_w: #iw,
                    channels: #c,
                    out_h: #oh,
                    out_w: #ow,
                    kernel: [#kh0, #kw0],
                    stride: [#sh0, #sw0],
                    padding: [#gh, #gw],
                };

                #fused_row

                #what
                pub fn #forward<const __B: usize>(
                    pool: &#rt::Pool,
                    x: &[#t],
                    y: &mut [#t],
                    winners: &mut [u32],
                ) {
                    #forward_rows
                    // Winners only where they are kept: evaluate tracks none.
                    let keep = !winners.is_empty();
                    let (ys, ws) = (#rt::Shared::new(y), #rt::Shared::new(winners));
                    pool.split(__B * #oh, #ow * #kh * #kw * #c, &|range| {
                        if keep {
                            __rows::<{ __B }, true>(x, 0, &ys, &ws, range)
                        } else {
                            __rows::<{ __B }, false>(x, 0, &ys, &ws, range)
                        }
                    });
                }

                #gradient
                pub fn #backward<const __B: usize>(
                    pool: &#rt::Pool,
                    dy: &[#t],
                    winners: &[u32],
                    dx: &mut [#t],
                ) {
                    #backward_rows
                    // A map larger than a core's L2 cache is written with streaming stores:
                    // its reader finds it in memory either way, and the lines are not first
                    // read from memory to be overwritten.
                    let stream = #streams
                        && ::core::mem::size_of_val(dx) >= #rt::simd::STREAM_BYTES
                        && (dx.as_ptr() as usize).is_multiple_of(64)
                        && #rt::simd::avx512();
                    let dxs = #rt::Shared::new(dx);
                    pool.split(__B * #ih, #iw * #c * #kh * #kw, &|range| {
                        __rows::<{ __B }, true>(dy, winners, &dxs, range, stream)
                    });
                }
            }
        }
        Kind::Activation(activation) => {
            let act = activation_type(*activation);
            quote! {
                /// `y = f(x)`, element-wise.
                pub fn #forward(pool: &#rt::Pool, x: &[#t], y: &mut [#t]) {
                    #rt::activation::entry_forward_on::<#act, #t>(pool, x, y)
                }

                /// `dx = dy * f'(x)` (with `y = f(x)`), element-wise.
                pub fn #backward(pool: &#rt::Pool, dy: &[#t], x: &[#t], y: &[#t], dx: &mut [#t]) {
                    #rt::activation::entry_backward_on::<#act, #t>(pool, dy, x, y, dx)
                }

                /// `dx = skip + dy * f'(x)`: the backward pass and a residual sum after it.
                pub fn #backward_sum(pool: &#rt::Pool, skip: &[#t], dy: &[#t], x: &[#t], y: &[#t], dx: &mut [#t]) {
                    #rt::activation::entry_backward_sum_on::<#act, #t>(pool, skip, dy, x, y, dx)
                }
            }
        }
        Kind::Residual(_) => quote! {
            /// `y = x + f(x)` (and, backward, `dx = dy + df`), element-wise.
            pub fn #forward(pool: &#rt::Pool, x: &[#t], f: &[#t], y: &mut [#t]) {
                #rt::activation::sum_on::<#t>(pool, x, f, y)
            }
        },
        _ => TokenStream::new(),
    }
}

/// The runtime's activation type.
fn activation_type(a: Activation) -> TokenStream {
    crate::expand::cpu::activation_type(a)
}

/// How entries read their input and write their output in one operation.
struct Flow<'a> {
    net: &'a Network,
    /// The batch: `{ __B }` in `evaluate`, the training batch otherwise.
    batch: TokenStream,
}

impl Flow<'_> {
    fn tensor(&self, s: Shape) -> TokenStream {
        let rt = rt();
        let t = elem(self.net.dtype);
        let b = &self.batch;
        let [h, w, c] = s.dims().map(lit);
        quote!(#rt::Tensor<#t, #b, #h, #w, #c>)
    }
}

/// `evaluate`: each entry into its buffer (the last into `output`), `Flatten` as a view.
fn evaluate_body(net: &Network) -> TokenStream {
    let rt = rt();
    let flow = Flow {
        net,
        batch: quote!({ __B }),
    };
    let module = format_ident!("__{}", net.ident);
    let out_view = match net.output() {
        Shape::Map(_) => quote!(output),
        Shape::Flat(_) => {
            let ty = flow.tensor(net.output());
            quote!(#rt::view_mut::<_, #ty>(output))
        }
    };
    let mut body = TokenStream::new();
    let last = emit_evaluate(
        &flow,
        &net.entries,
        quote!(input),
        &mut body,
        Some(out_view.clone()),
    );
    if let Some(last) = last {
        // The last entry was a `Flatten`: its input's buffer is the output.
        let ty = flow.tensor(net.output());
        body.extend(quote! {
            #out_view.as_mut_slice().copy_from_slice(#rt::view::<_, #ty>(#last).as_slice());
        });
    }
    quote! {
        let mut bufs = device.__take::<#module::__Eval<{ __B }>>();
        let result = (|| -> #rt::Result<()> {
            let bufs = &mut *bufs;
            #body
            ::core::result::Result::Ok(())
        })();
        device.__put(bufs);
        result
    }
}

/// `evaluate`'s statements for a list, from `input` (an expression of a `&Tensor`); the last
/// entry writes into `last_into` when given. Returns the expression of the list's output
/// when it still needs a copy into `last_into` (a trailing `Flatten`).
fn emit_evaluate(
    flow: &Flow,
    entries: &[Entry],
    input: TokenStream,
    body: &mut TokenStream,
    last_into: Option<TokenStream>,
) -> Option<TokenStream> {
    let rt = rt();
    let module = format_ident!("__{}", flow.net.ident);
    let mut cur = input;
    let dst_of = |i: usize| {
        let field = format_ident!("{}", entries[i].path);
        match (&last_into, i + 1 == entries.len()) {
            (Some(into), true) => into.clone(),
            _ => quote!(&mut bufs.#field),
        }
    };
    for (i, e) in entries.iter().enumerate() {
        let is_last = i + 1 == entries.len();
        let field = format_ident!("{}", e.path);
        let dst = dst_of(i);
        if is_fused_pool(entries, i) {
            // Run in the convolution's epilogue, or after it where the device cannot.
            cur = quote!(&bufs.#field);
            continue;
        }
        match &e.kind {
            Kind::Conv(_) if i + 1 < entries.len() && is_fused_pool(entries, i + 1) => {
                let layer = access(quote!(self), &e.path);
                let p = &entries[i + 1];
                let (gate, row) = (gate_field(p), format_ident!("__forward_row_{}", p.path));
                let pool_dst = dst_of(i + 1);
                let pool_rows = lit(p.output.dims()[0]);
                let Kind::Pool(kind, _) = &p.kind else {
                    unreachable!("a fused pooling that does not pool")
                };
                let (f, g) = (
                    format_ident!("__forward_{}", p.path),
                    format_ident!("__GEOMETRY_{}", p.path),
                );
                let after = pool_call(
                    *kind,
                    quote!(device.__avg_pool_forward(&#module::#g, __B, bufs.#field.as_slice(), (#pool_dst).as_mut_slice())),
                    quote!(#module::#f::<{ __B }>(device.__pool(), bufs.#field.as_slice(), (#pool_dst).as_mut_slice(), &mut []);),
                );
                body.extend(quote! {
                    bufs.#gate.reset();
                    let __fused = {
                        let __gate = &bufs.#gate;
                        let __y = #rt::Shared::new((#pool_dst).as_mut_slice());
                        #layer.__evaluate_then(device, #cur, &mut bufs.#field, &|__map, __q0, __n| {
                            __gate.done(__q0, __n, &|__row| {
                                #module::#row::<{ __B }>(__map, &__y, __row, __gate.window(__row % #pool_rows));
                            });
                        })?
                    };
                    if !__fused {
                        #after
                    }
                });
            }
            Kind::Conv(_) | Kind::Dense(_) => {
                let layer = access(quote!(self), &e.path);
                body.extend(quote!(#layer.evaluate(device, #cur, #dst)?;));
            }
            Kind::Pool(kind, _) => {
                let f = format_ident!("__forward_{}", e.path);
                let g = format_ident!("__GEOMETRY_{}", e.path);
                body.extend(pool_call(
                    *kind,
                    quote!(device.__avg_pool_forward(&#module::#g, __B, #cur.as_slice(), (#dst).as_mut_slice())),
                    quote!(#module::#f::<{ __B }>(device.__pool(), #cur.as_slice(), (#dst).as_mut_slice(), &mut []);),
                ));
            }
            Kind::Activation(_) => {
                let f = format_ident!("__forward_{}", e.path);
                body.extend(
                    quote!(#module::#f(device.__pool(), #cur.as_slice(), (#dst).as_mut_slice());),
                );
            }
            Kind::Flatten => {
                let ty = flow.tensor(e.output);
                if is_last && last_into.is_some() {
                    return Some(cur);
                }
                cur = quote!(#rt::view::<_, #ty>(#cur));
                continue;
            }
            Kind::Residual(inner) => {
                // f(x) into the inner entries' buffers, then x + f(x).
                let copy = emit_evaluate(flow, inner, cur.clone(), body, None);
                let f_out = match copy {
                    Some(view_of) => {
                        let ty = flow.tensor(e.output);
                        quote!(#rt::view::<_, #ty>(#view_of))
                    }
                    None => {
                        let last = inner.last().map(|l| format_ident!("{}", l.path));
                        quote!(&bufs.#last)
                    }
                };
                let f = format_ident!("__forward_{}", e.path);
                body.extend(quote!(#module::#f(device.__pool(), #cur.as_slice(), #f_out.as_slice(), (#dst).as_mut_slice());));
            }
        }
        cur = quote!(&bufs.#field);
    }
    None
}

/// `forward`: each entry's state from the previous entry's output.
fn forward_body(net: &Network) -> TokenStream {
    let flow = Flow {
        net,
        batch: {
            let b = lit(net.batch);
            quote!(#b)
        },
    };
    let mut body = TokenStream::new();
    emit_forward(&flow, &net.entries, quote!(input), &mut body);
    quote! {
        #body
        ::core::result::Result::Ok(())
    }
}

/// The expression of an entry's output in the state (`Flatten`: its input's, viewed).
fn state_output_of(flow: &Flow, e: &Entry, input: &TokenStream) -> TokenStream {
    output_in(quote!(state), flow, e, input)
}

/// [`state_output_of`] with the state named `root`.
fn output_in(root: TokenStream, flow: &Flow, e: &Entry, input: &TokenStream) -> TokenStream {
    let rt = rt();
    let field = format_ident!("{}", e.path);
    match &e.kind {
        Kind::Conv(_) | Kind::Dense(_) => quote!(#root.#field.output()),
        Kind::Flatten => {
            let ty = flow.tensor(e.output);
            quote!(#rt::view::<_, #ty>(#input))
        }
        _ => quote!(&#root.#field),
    }
}

fn emit_forward(
    flow: &Flow,
    entries: &[Entry],
    input: TokenStream,
    body: &mut TokenStream,
) -> TokenStream {
    let module = format_ident!("__{}", flow.net.ident);
    let batch = lit(flow.net.batch);
    let mut cur = input;
    for e in entries {
        let field = format_ident!("{}", e.path);
        match &e.kind {
            Kind::Conv(_) | Kind::Dense(_) => {
                let layer = access(quote!(self), &e.path);
                body.extend(quote!(#layer.forward(device, #cur, &mut state.#field, mode)?;));
            }
            Kind::Pool(kind, _) => {
                let f = format_ident!("__forward_{}", e.path);
                let winners = match kind {
                    PoolKind::Max => {
                        let w = format_ident!("__winners_{}", e.path);
                        quote!(&mut state.#w[..])
                    }
                    PoolKind::Avg => quote!(&mut []),
                };
                let g = format_ident!("__GEOMETRY_{}", e.path);
                body.extend(pool_call(
                    *kind,
                    quote!(device.__avg_pool_forward(&#module::#g, #batch, #cur.as_slice(), state.#field.as_mut_slice())),
                    quote!(#module::#f::<#batch>(device.__pool(), #cur.as_slice(), state.#field.as_mut_slice(), #winners);),
                ));
            }
            Kind::Activation(_) => {
                let f = format_ident!("__forward_{}", e.path);
                body.extend(quote!(#module::#f(device.__pool(), #cur.as_slice(), state.#field.as_mut_slice());));
            }
            Kind::Flatten => {}
            Kind::Residual(inner) => {
                let f_out = emit_forward(flow, inner, cur.clone(), body);
                let f = format_ident!("__forward_{}", e.path);
                body.extend(quote!(#module::#f(device.__pool(), #cur.as_slice(), #f_out.as_slice(), state.#field.as_mut_slice());));
            }
        }
        cur = state_output_of(flow, e, &cur);
    }
    cur
}

/// `state.output()`: the last entry's output, as the network's output type.
fn state_output(net: &Network) -> TokenStream {
    let rt = rt();
    let flow = Flow {
        net,
        batch: {
            let b = lit(net.batch);
            quote!(#b)
        },
    };
    // The output of each top-level entry, following `Flatten` views back.
    let mut cur = quote!(__unreachable);
    for e in &net.entries {
        cur = output_in(quote!(self), &flow, e, &cur);
    }
    match net.output() {
        Shape::Map(_) => cur,
        Shape::Flat(_) => quote!(#rt::view(#cur)),
    }
}

/// The backward passes: from `d_output` back through every entry, layers' gradients into
/// `grads`; with `full`, the input's gradient into `d_input`.
fn backward_body(net: &Network, full: bool) -> TokenStream {
    let rt = rt();
    let flow = Flow {
        net,
        batch: {
            let b = lit(net.batch);
            quote!(#b)
        },
    };
    let module = format_ident!("__{}", net.ident);
    let d_out = match net.output() {
        Shape::Map(_) => quote!(d_output),
        Shape::Flat(_) => {
            let ty = flow.tensor(net.output());
            quote!(#rt::view::<_, #ty>(d_output))
        }
    };
    let mut body = TokenStream::new();
    let into = full.then(|| quote!(d_input));
    emit_backward(
        &flow,
        &net.entries,
        quote!(input),
        d_out,
        into,
        &mut body,
        &quote!(grads),
    );
    quote! {
        let mut g = device.__take::<#module::__Grad>();
        let result = (|| -> #rt::Result<()> {
            let g = &mut *g;
            #body
            ::core::result::Result::Ok(())
        })();
        device.__put(g);
        result
    }
}

/// Backward statements for a list whose input is `input` (an expression of a `&Tensor`) and
/// output gradient `d_out`; the gradient at the list's input goes into `into` (a `&mut
/// Tensor` expression) when given.
fn emit_backward(
    flow: &Flow,
    entries: &[Entry],
    input: TokenStream,
    d_out: TokenStream,
    into: Option<TokenStream>,
    body: &mut TokenStream,
    grads_root: &TokenStream,
) {
    let rt = rt();
    let module = format_ident!("__{}", flow.net.ident);
    let batch = lit(flow.net.batch);
    // Each entry's input expression, forward.
    let mut inputs = Vec::new();
    let mut cur = input;
    for e in entries {
        inputs.push(cur.clone());
        cur = state_output_of(flow, e, &cur);
    }
    // Backward: `grad` is the gradient at the current entry's output.
    let mut grad = d_out;
    for (i, e) in entries.iter().enumerate().rev() {
        let x = &inputs[i];
        let field = format_ident!("{}", e.path);
        // Where this entry's input gradient goes: the list's `into` for the first entry,
        // else its buffer; `None` when nothing before needs it.
        let dst: Option<TokenStream> = if i == 0 {
            into.clone()
        } else {
            Some(quote!(&mut g.#field))
        };
        let y = state_output_of(flow, e, x);
        match &e.kind {
            Kind::Conv(_) | Kind::Dense(_) => {
                let layer = access(quote!(self), &e.path);
                let grads = access(grads_root.clone(), &e.path);
                match &dst {
                    Some(dst) => body.extend(quote! {
                        #layer.backward_full(device, &state.#field, #x, #grad, #dst, &mut #grads, mode)?;
                    }),
                    None => body.extend(quote! {
                        #layer.backward(device, &state.#field, #x, #grad, &mut #grads, mode)?;
                    }),
                }
            }
            Kind::Pool(kind, _) => {
                let Some(dst) = &dst else { continue };
                let f = format_ident!("__backward_{}", e.path);
                let winners = match kind {
                    PoolKind::Max => {
                        let w = format_ident!("__winners_{}", e.path);
                        quote!(&state.#w)
                    }
                    PoolKind::Avg => quote!(&[]),
                };
                let g = format_ident!("__GEOMETRY_{}", e.path);
                body.extend(pool_call(
                    *kind,
                    quote!(device.__avg_pool_backward(&#module::#g, #grad.as_slice(), (#dst).as_mut_slice())),
                    quote!(#module::#f::<#batch>(device.__pool(), #grad.as_slice(), #winners, (#dst).as_mut_slice());),
                ));
            }
            Kind::Activation(_) => {
                let Some(dst) = &dst else { continue };
                let f = format_ident!("__backward_{}", e.path);
                body.extend(quote! {
                    #module::#f(device.__pool(), #grad.as_slice(), #x.as_slice(), #y.as_slice(), (#dst).as_mut_slice());
                });
            }
            Kind::Flatten => {
                // The gradient passes on as it is, viewed as the input's shape; a first entry
                // copies it into `into`.
                let ty = flow.tensor(e.input);
                let viewed = quote!(#rt::view::<_, #ty>(#grad));
                if let (0, Some(into)) = (i, &into) {
                    body.extend(
                        quote!((#into).as_mut_slice().copy_from_slice(#viewed.as_slice());),
                    );
                }
                grad = viewed;
                continue;
            }
            Kind::Residual(inner) => {
                let flatten_next = matches!(inner.get(1).map(|e| &e.kind), Some(Kind::Flatten));
                if let (
                    Some(dst),
                    Some(
                        act @ Entry {
                            kind: Kind::Activation(_),
                            ..
                        },
                    ),
                    false,
                ) = (&dst, inner.first(), flatten_next)
                {
                    // An inner list that begins with an activation (IMPALA's): its backward
                    // pass and the sum in one, `dx = dy + f'(x) * (the gradient at its output)`.
                    let act_out = state_output_of(flow, act, x);
                    let inner_grad = if inner.len() > 1 {
                        let buf = format_ident!("{}", inner[1].path);
                        emit_backward(
                            flow,
                            &inner[1..],
                            act_out.clone(),
                            grad.clone(),
                            Some(quote!(&mut g.#buf)),
                            body,
                            grads_root,
                        );
                        quote!(g.#buf.as_slice())
                    } else {
                        quote!(#grad.as_slice())
                    };
                    let f = format_ident!("__backward_sum_{}", act.path);
                    body.extend(quote! {
                        #module::#f(device.__pool(), #grad.as_slice(), #inner_grad, #x.as_slice(), #act_out.as_slice(), (#dst).as_mut_slice());
                    });
                } else {
                    // dx = dy + (the inner list's input gradient), through a buffer of its own.
                    let inner_into = dst.as_ref().map(|_| {
                        let buf = format_ident!("__inner_{}", e.path);
                        quote!(&mut g.#buf)
                    });
                    emit_backward(
                        flow,
                        inner,
                        x.clone(),
                        grad.clone(),
                        inner_into.clone(),
                        body,
                        grads_root,
                    );
                    if let (Some(dst), Some(_)) = (&dst, &inner_into) {
                        let f = format_ident!("__forward_{}", e.path);
                        let buf = format_ident!("__inner_{}", e.path);
                        body.extend(quote! {
                            #module::#f(device.__pool(), #grad.as_slice(), g.#buf.as_slice(), (#dst).as_mut_slice());
                        });
                    }
                }
            }
        }
        if i > 0 {
            grad = quote!(&g.#field);
        }
    }
}

/// `Parameters` for the network: every layer's parameters under `entry.field` (Dense weights
/// as `[out, in]`), and BatchNorm's running statistics as buffers.
fn parameters_impl(net: &Network, name: &syn::Ident, grads: &syn::Ident) -> TokenStream {
    let rt = rt();
    let t = elem(net.dtype);
    let a = acc(net.dtype);
    let mut visit_mut = TokenStream::new();
    let mut visit = TokenStream::new();
    let mut params_mut = TokenStream::new();
    let mut buffers = TokenStream::new();
    for e in net.all_entries() {
        let Some(spec) = e.layer() else { continue };
        let dense = matches!(e.kind, Kind::Dense(_));
        let layer = access(quote!(self), &e.path);
        let g = access(quote!(grads), &e.path);
        for p in params(spec) {
            let field = &p.name;
            let label = format!("{}.{}", dotted(&e.path), field);
            let tensor = if dense && field == "weights" {
                quote!(&mut #rt::DenseWeights(&mut #layer.#field))
            } else {
                quote!(&mut #layer.#field)
            };
            visit_mut.extend(quote!(f(#label, #tensor, #g.#field.as_slice());));
            visit.extend(quote!(f(#label, #layer.#field.as_slice());));
            params_mut.extend(quote!(f(#label, #tensor);));
        }
        if matches!(spec.norm, Norm::BatchNorm { .. }) {
            for field in ["running_mean", "running_var"] {
                let label = format!("{}.{}", dotted(&e.path), field);
                let field = format_ident!("{}", field);
                buffers.extend(quote!(f(#label, &mut #layer.#field);));
            }
        }
    }
    quote! {
        impl #rt::Parameters for #name {
            type Elem = #t;
            type Grads = #grads;

            fn visit_mut(
                &mut self,
                grads: &#grads,
                f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::ParamTensor<#t>, &[#a]),
            ) {
                #visit_mut
            }

            fn visit(&self, f: &mut dyn ::core::ops::FnMut(&str, &[#t])) {
                #visit
            }

            fn visit_params_mut(&mut self, f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::ParamTensor<#t>)) {
                #params_mut
            }

            fn visit_buffers_mut(&mut self, f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::ParamTensor<#a>)) {
                let _ = &f;
                #buffers
            }
        }
    }
}

/// `Entries` for the network: each entry's kind, and for a `Dense` the map its features were
/// flattened from (an importer's only way to reorder another framework's flattening).
fn entries_impl(net: &Network, name: &syn::Ident) -> TokenStream {
    fn list(rt: &TokenStream, entries: &[Entry]) -> TokenStream {
        // The (h, w, c) layout of the features flowing into the next entry, while flat.
        let mut flattened = None;
        let items = entries.iter().map(|e| {
            let label = e.name.to_string();
            let kind = match &e.kind {
                Kind::Conv(spec) => {
                    let norm = !matches!(spec.norm, Norm::None);
                    let activation = spec.activation != Activation::Identity;
                    quote!(Conv2d { norm: #norm, activation: #activation })
                }
                Kind::Dense(spec) => {
                    let [h, w, c] = flattened.unwrap_or_else(|| e.input.dims()).map(lit);
                    let activation = spec.activation != Activation::Identity;
                    quote!(Dense { flattened: [#h, #w, #c], activation: #activation })
                }
                Kind::Pool(PoolKind::Max, _) => quote!(MaxPool2d),
                Kind::Pool(PoolKind::Avg, _) => quote!(AvgPool2d),
                Kind::Activation(_) => quote!(Activation),
                Kind::Flatten => quote!(Flatten),
                Kind::Residual(inner) => {
                    let inner = list(rt, inner);
                    quote!(Residual(#inner))
                }
            };
            flattened = match (&e.kind, e.input, e.output) {
                (Kind::Flatten, Shape::Map(dims), _) => Some(dims),
                (Kind::Activation(_), _, Shape::Flat(_)) => flattened,
                _ => None,
            };
            quote!(#rt::EntryInfo { name: #label, kind: #rt::EntryKind::#kind })
        });
        let items: Vec<TokenStream> = items.collect();
        quote!(&[#(#items),*])
    }
    let rt = rt();
    let entries = list(&rt, &net.entries);
    quote! {
        impl #rt::Entries for #name {
            const ENTRIES: &'static [#rt::EntryInfo] = #entries;
        }
    }
}
