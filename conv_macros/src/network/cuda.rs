//! The network on the `Cuda` device, device-resident: `NetCuda` (every layer's `LayerCuda`),
//! `NetCudaGrads`, `NetCudaState` and the operations on tensors in GPU memory, chaining the
//! layers' own CUDA operations with generated kernels for the other entries.
//!
//! Each pooling, activation and residual entry gets CUDA source specialized to its shapes, as a
//! layer does: a generated block of constants, then `kernels/common.cu` and `kernels/network.cu`
//! (`Net::__CUDA_SOURCES` lists them with their kernels, plain data present with or without the
//! runtime's `cuda` feature, for the NVRTC test). `Flatten` is a reshape of the same buffer
//! (`conv_runtime::cuda::reshape`). Every entry's output is a buffer of its own: in the state
//! for `forward` (the backward pass reads them), allocated per call for `evaluate`, whose
//! batch is the caller's.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::expand::{access, dotted};
use super::spec::{Entry, Kind, Network, PoolKind, Shape};
use crate::expand::cuda::{element_name, entry_source};
use crate::expand::{elem, lit, rt, types::params};
use crate::spec::Activation;

/// The name of an entry's CUDA source constant.
fn source_const(e: &Entry) -> syn::Ident {
    format_ident!("__CUDA_SOURCE_{}", e.path)
}

/// The name of an entry's kernel setup.
fn setup_static(e: &Entry) -> syn::Ident {
    format_ident!("__CUDA_SETUP_{}", e.path)
}

/// The CUDA source of an entry that is neither a layer nor a `Flatten`, and its kernels.
fn source(net: &Network, e: &Entry) -> Option<(String, &'static [&'static str])> {
    let (kind, activation, window, kernels): (_, _, _, &'static [&'static str]) = match &e.kind {
        Kind::Pool(kind, pool) => (
            match kind {
                PoolKind::Max => "NETWORK_MAX_POOL",
                PoolKind::Avg => "NETWORK_AVG_POOL",
            },
            Activation::Identity,
            Some(*pool),
            &["pool_forward", "pool_backward"],
        ),
        Kind::Activation(a) => (
            "NETWORK_ACTIVATION",
            *a,
            None,
            &["entry_activation_forward", "entry_activation_backward"],
        ),
        Kind::Residual(_) => (
            "NETWORK_RESIDUAL",
            Activation::Identity,
            None,
            &["residual_add"],
        ),
        _ => return None,
    };
    let element = element_name(net.dtype);
    let [ih, iw, ic] = e.input.dims();
    let [oh, ow, oc] = e.output.dims();
    let (k, s, p) = window.map_or(([1, 1], [1, 1], [0, 0]), |w| {
        (w.kernel, w.stride, w.padding)
    });
    let mut header = format!(
        "// network! `{}` entry `{}`: its constants, generated; the kernels follow.\n\
         #define CONV_ELEMENT_{element}\n\
         #define CONV_ACTIVATION {}\n\
         #define CONV_NORM None\n\
         #define {kind}\n",
        net.ident,
        dotted(&e.path),
        activation.name(),
    );
    for (name, value) in [
        ("BATCH", net.batch),
        ("IH", ih),
        ("IW", iw),
        ("IC", ic),
        ("OH", oh),
        ("OW", ow),
        ("OC", oc),
        ("KH", k[0]),
        ("KW", k[1]),
        ("SH", s[0]),
        ("SW", s[1]),
        ("PH", p[0]),
        ("PW", p[1]),
    ] {
        header.push_str(&format!(
            "[[maybe_unused]] constexpr int {name} = {value};\n"
        ));
    }
    Some((entry_source(header), kernels))
}

/// `CudaTensor<T, B, h, w, c>` of a shape (a flat one as `[1, 1, n]`).
fn tensor(net: &Network, b: &TokenStream, shape: Shape) -> TokenStream {
    let rt = rt();
    let t = elem(net.dtype);
    let [h, w, c] = shape.dims().map(lit);
    quote!(#rt::cuda::CudaTensor<#t, #b, #h, #w, #c>)
}

/// `x` (of shape `from`) as a tensor of shape `to`.
fn reshaped(net: &Network, b: &TokenStream, x: TokenStream, from: Shape, to: Shape) -> TokenStream {
    if from.dims() == to.dims() {
        return x;
    }
    let rt = rt();
    let t = elem(net.dtype);
    let [h, w, c] = from.dims().map(lit);
    let [h2, w2, c2] = to.dims().map(lit);
    quote!(#rt::cuda::reshape::<#t, #b, #h, #w, #c, #h2, #w2, #c2>(#x))
}

/// One kernel launch over `count` items in the entry's session, reading the buffers of
/// `inputs` (tensor expressions) and writing the tensor `output` (a `&mut` expression).
fn launch(
    e: &Entry,
    kernel: &str,
    count: TokenStream,
    inputs: &[TokenStream],
    output: TokenStream,
) -> TokenStream {
    let setup = setup_static(e);
    quote! {{
        let __out: &Buf = (#output).__buf_mut();
        let __s = &mut dev.__session(&#setup)?;
        let __n: usize = #count;
        __s.launch(#kernel, blocks_for(__n), &[Arg::Long(__n), #(Arg::Buf(#inputs.__buf()),)* Arg::Buf(__out)])?;
    }}
}

/// The forward kernel of a pooling or activation entry.
fn forward_kernel(e: &Entry) -> &'static str {
    if matches!(e.kind, Kind::Pool(..)) {
        "pool_forward"
    } else {
        "entry_activation_forward"
    }
}

/// Where an entry's output goes in `evaluate`.
enum Dest {
    /// A buffer of its own, named.
    Local(syn::Ident),
    /// The caller's output.
    Output,
}

/// `evaluate`'s chain over `entries` from `input` (a `&CudaTensor` expression); the last entry
/// writes into `output` when `last_to_output`. Returns the code and the expression of the
/// chain's output.
fn evaluate_chain(
    net: &Network,
    entries: &[Entry],
    mut input: TokenStream,
    last_to_output: bool,
) -> (TokenStream, TokenStream) {
    let b = quote!({ __B });
    let mut code = TokenStream::new();
    for (i, e) in entries.iter().enumerate() {
        let dest = if last_to_output && i + 1 == entries.len() {
            Dest::Output
        } else {
            Dest::Local(format_ident!("__o_{}", e.path))
        };
        let ty = tensor(net, &b, e.output);
        let (declare, out_mut, out_ref) = match &dest {
            Dest::Local(name) => (
                quote!(let mut #name = <#ty>::zeros(dev)?;),
                quote!(&mut #name),
                quote!((&#name)),
            ),
            Dest::Output => (quote!(), quote!(output), quote!((&*output))),
        };
        let len = lit(e.output.len());
        match &e.kind {
            Kind::Conv(_) | Kind::Dense(_) => {
                let layer = format_ident!("{}", e.path);
                code.extend(quote! {
                    #declare
                    self.#layer.evaluate::<{ __B }>(dev, #input, #out_mut)?;
                });
            }
            Kind::Pool(..) | Kind::Activation(_) => {
                let kernel = forward_kernel(e);
                let run = launch(e, kernel, quote!(__B * #len), &[input.clone()], out_mut);
                code.extend(quote!(#declare #run));
            }
            Kind::Flatten => {
                let view = reshaped(net, &b, input.clone(), e.input, e.output);
                match dest {
                    Dest::Output => code.extend(quote!(output.copy_from(dev, #view)?;)),
                    Dest::Local(_) => {
                        input = view;
                        continue;
                    }
                }
            }
            Kind::Residual(inner) => {
                let (inner_code, inner_out) = evaluate_chain(net, inner, input.clone(), false);
                let run = launch(
                    e,
                    "residual_add",
                    quote!(__B * #len),
                    &[input.clone(), inner_out],
                    out_mut,
                );
                // The inner chain's buffers live in the block that sums into the entry's own.
                code.extend(quote! {
                    #declare
                    {
                        #inner_code
                        #run
                    }
                });
            }
        }
        input = out_ref;
    }
    (code, input)
}

/// The expression of an entry's output in the state `root`, given its input's.
fn output_in(net: &Network, root: &TokenStream, e: &Entry, input: &TokenStream) -> TokenStream {
    let field = format_ident!("{}", e.path);
    let b = lit(net.batch);
    match &e.kind {
        Kind::Conv(_) | Kind::Dense(_) => quote!(#root.#field.output()),
        Kind::Flatten => reshaped(net, &quote!(#b), input.clone(), e.input, e.output),
        _ => quote!((&#root.#field)),
    }
}

/// [`output_in`] the `state` argument.
fn state_output(net: &Network, e: &Entry, input: &TokenStream) -> TokenStream {
    output_in(net, &quote!(state), e, input)
}

/// `forward`'s chain over `entries` from `input`; returns the code and the chain's output.
fn forward_chain(
    net: &Network,
    entries: &[Entry],
    mut input: TokenStream,
) -> (TokenStream, TokenStream) {
    let mut code = TokenStream::new();
    for e in entries {
        let field = format_ident!("{}", e.path);
        let len = lit(e.output.len());
        let batch = lit(net.batch);
        match &e.kind {
            Kind::Conv(_) | Kind::Dense(_) => code.extend(quote! {
                self.#field.forward(dev, #input, &mut state.#field, mode)?;
            }),
            Kind::Pool(..) | Kind::Activation(_) => {
                code.extend(launch(
                    e,
                    forward_kernel(e),
                    quote!(#batch * #len),
                    &[input.clone()],
                    quote!(state.#field),
                ));
            }
            Kind::Flatten => {}
            Kind::Residual(inner) => {
                let (inner_code, inner_out) = forward_chain(net, inner, input.clone());
                let run = launch(
                    e,
                    "residual_add",
                    quote!(#batch * #len),
                    &[input.clone(), inner_out],
                    quote!(state.#field),
                );
                code.extend(quote!(#inner_code #run));
            }
        }
        input = state_output(net, e, &input);
    }
    (code, input)
}

/// Where the gradient at an entry's input goes in the backward pass.
enum Grad {
    /// Not wanted (the network's input, in `backward`).
    None,
    /// A buffer of its own.
    Local(syn::Ident),
    /// The caller's `d_input`.
    DInput,
}

/// The backward pass over `entries` (whose chain input is `input`), from `d` (the gradient at
/// the chain's output); `first` says where the gradient at the chain's input goes. Returns the
/// code and the expression of that gradient (when wanted).
fn backward_chain(
    net: &Network,
    entries: &[Entry],
    input: TokenStream,
    mut d: TokenStream,
    first: Grad,
) -> (TokenStream, Option<TokenStream>) {
    let batch = lit(net.batch);
    let b = quote!(#batch);
    // Each entry's input in the forward pass.
    let mut inputs = Vec::new();
    let mut x = input;
    for e in entries {
        inputs.push(x.clone());
        x = state_output(net, e, &x);
    }
    let mut code = TokenStream::new();
    let mut first = Some(first);
    let mut result = None;
    for (i, e) in entries.iter().enumerate().rev() {
        let x = &inputs[i];
        let field = format_ident!("{}", e.path);
        let grad = if i == 0 {
            first.take().unwrap_or(Grad::None)
        } else {
            Grad::Local(format_ident!("__d_{}", e.path))
        };
        let in_ty = tensor(net, &b, e.input);
        let (declare, dx_mut, dx_ref) = match &grad {
            Grad::None => (quote!(), quote!(), None),
            Grad::Local(name) => (
                quote!(let mut #name = <#in_ty>::zeros(dev)?;),
                quote!(&mut #name),
                Some(quote!((&#name))),
            ),
            Grad::DInput => (quote!(), quote!(d_input), Some(quote!((&*d_input)))),
        };
        let in_len = lit(e.input.len());
        let wanted = !matches!(grad, Grad::None);
        match &e.kind {
            Kind::Conv(_) | Kind::Dense(_) => {
                if wanted {
                    code.extend(quote! {
                        #declare
                        self.#field.backward_full(dev, &state.#field, #x, #d, #dx_mut, &mut grads.#field, mode)?;
                    });
                } else {
                    code.extend(quote! {
                        self.#field.backward(dev, &state.#field, #x, #d, &mut grads.#field, mode)?;
                    });
                }
            }
            Kind::Pool(..) | Kind::Activation(_) => {
                if wanted {
                    let (kernel, inputs) = if matches!(e.kind, Kind::Pool(..)) {
                        ("pool_backward", vec![x.clone(), d.clone()])
                    } else {
                        let y = quote!((&state.#field));
                        ("entry_activation_backward", vec![x.clone(), y, d.clone()])
                    };
                    let run = launch(e, kernel, quote!(#batch * #in_len), &inputs, dx_mut);
                    code.extend(quote!(#declare #run));
                }
            }
            Kind::Flatten => {
                let view = reshaped(net, &b, d.clone(), e.output, e.input);
                match grad {
                    Grad::None => {}
                    Grad::DInput => code.extend(quote!(d_input.copy_from(dev, #view)?;)),
                    Grad::Local(_) => {
                        d = view;
                        if i == 0 {
                            result = Some(d.clone());
                        }
                        continue;
                    }
                }
            }
            Kind::Residual(inner) => {
                // f's input gradient, then d + that; f's parameters' gradients either way.
                let inner_grad = if wanted {
                    Grad::Local(format_ident!("__df_{}", e.path))
                } else {
                    Grad::None
                };
                let (inner_code, inner_dx) =
                    backward_chain(net, inner, x.clone(), d.clone(), inner_grad);
                code.extend(quote!(#declare));
                match inner_dx {
                    Some(inner_dx) => {
                        let run = launch(
                            e,
                            "residual_add",
                            quote!(#batch * #in_len),
                            &[d.clone(), inner_dx],
                            dx_mut,
                        );
                        code.extend(quote!({ #inner_code #run }));
                    }
                    None => code.extend(quote!({ #inner_code })),
                }
            }
        }
        if let Some(dx) = dx_ref {
            d = dx;
        }
        if i == 0 {
            result = wanted.then(|| d.clone());
        }
    }
    (code, result)
}

pub fn expand(net: &Network) -> TokenStream {
    let rt = rt();
    let t = elem(net.dtype);
    let name = &net.ident;
    let vis = &net.vis;
    let module = format_ident!("__{}", name);
    let cuda_net = format_ident!("{}Cuda", name);
    let cuda_grads = format_ident!("{}CudaGrads", name);
    let cuda_state = format_ident!("{}CudaState", name);
    let grads_host = format_ident!("{}Grads", name);
    let all = net.all_entries();
    let batch = lit(net.batch);
    let cuda = quote!(#rt::cuda::Cuda);
    let result = quote!(#rt::Result<()>);

    // Sources of the entries with kernels.
    let mut source_items = TokenStream::new();
    let mut source_list = Vec::new();
    let mut setups = TokenStream::new();
    for e in &all {
        if let Some((text, kernels)) = source(net, e) {
            let konst = source_const(e);
            let setup = setup_static(e);
            let label = dotted(&e.path);
            source_items.extend(quote! {
                #[doc(hidden)]
                pub const #konst: &'static str = #text;
            });
            source_list.push(quote!((#label, #name::#konst, &[#(#kernels),*])));
            setups.extend(quote! {
                static #setup: #rt::cuda::LayerSetup =
                    #rt::cuda::LayerSetup::new(#name::#konst, &[#(#kernels),*], ::core::option::Option::None);
            });
        }
    }

    // Types.
    let layers: Vec<&&Entry> = all.iter().filter(|e| e.layer().is_some()).collect();
    let layer_fields: Vec<syn::Ident> =
        layers.iter().map(|e| format_ident!("{}", e.path)).collect();
    let layer_tys: Vec<syn::Ident> = layers
        .iter()
        .map(|e| format_ident!("{}Cuda", e.path))
        .collect();
    let layer_grads: Vec<syn::Ident> = layers
        .iter()
        .map(|e| format_ident!("{}CudaGrads", e.path))
        .collect();
    let host_access: Vec<TokenStream> = layers
        .iter()
        .map(|e| access(quote!(net), &e.path))
        .collect();
    let grads_access: Vec<TokenStream> = layers
        .iter()
        .map(|e| access(quote!(grads), &e.path))
        .collect();
    // Every parameter tensor as `(label, layer field, parameter field)`, named as the host's
    // `Parameters` names them, so that no name is built per optimizer step.
    let mut visits = TokenStream::new();
    for e in &layers {
        let Some(spec) = e.layer() else { continue };
        let layer = format_ident!("{}", e.path);
        for p in params(spec) {
            let field = &p.name;
            let label = format!("{}.{}", dotted(&e.path), field);
            visits.extend(quote!(f(#label, &mut self.#layer.#field, grads.#layer.#field.__buf());));
        }
    }
    let mut state_fields = Vec::new();
    let mut state_inits = Vec::new();
    for e in &all {
        let field = format_ident!("{}", e.path);
        match &e.kind {
            Kind::Conv(_) | Kind::Dense(_) => {
                let ty = format_ident!("{}CudaState", e.path);
                state_fields.push(quote!(#field: #module::#ty));
                state_inits.push(quote!(#field: #module::#ty::new(dev)?));
            }
            Kind::Pool(..) | Kind::Activation(_) | Kind::Residual(_) => {
                let ty = tensor(net, &quote!(#batch), e.output);
                state_fields.push(quote!(#field: #ty));
                state_inits.push(quote!(#field: <#ty>::zeros(dev)?));
            }
            Kind::Flatten => {}
        }
    }
    // A network of `Flatten`s alone keeps its output itself: no entry has a buffer.
    let copies_output = net.entries.iter().all(|e| matches!(e.kind, Kind::Flatten));
    let out_batch = tensor(net, &quote!(#batch), net.output());
    let out_generic = tensor(net, &quote!({ __B }), net.output());
    let in_batch = tensor(net, &quote!(#batch), Shape::Map(net.input));
    let in_generic = tensor(net, &quote!({ __B }), Shape::Map(net.input));
    if copies_output {
        state_fields.push(quote!(__output: #out_batch));
        state_inits.push(quote!(__output: <#out_batch>::zeros(dev)?));
    }

    // Operations.
    let (eval_code, _) = evaluate_chain(net, &net.entries, quote!(input), true);
    let (forward_code, forward_out) = forward_chain(net, &net.entries, quote!(input));
    let forward_code = if copies_output {
        quote! {
            #forward_code
            state.__output.copy_from(dev, #forward_out)?;
        }
    } else {
        forward_code
    };
    let state_out = if copies_output {
        quote!(&self.__output)
    } else {
        // Not a chain of `Flatten`s alone, so the input is never reached.
        let mut x = TokenStream::new();
        for e in &net.entries {
            x = output_in(net, &quote!(self), e, &x);
        }
        x
    };
    let (backward_code, _) = backward_chain(
        net,
        &net.entries,
        quote!(input),
        quote!(d_output),
        Grad::None,
    );
    let (backward_full_code, _) = backward_chain(
        net,
        &net.entries,
        quote!(input),
        quote!(d_output),
        Grad::DInput,
    );

    let doc_net = format!(
        "[`{name}`]'s parameters (and running statistics) in GPU memory, with its operations on \
         tensors in GPU memory: each layer's own CUDA path, generated kernels between them, \
         nothing copied to the host. Create with `upload`, copy back with `download_into`; \
         step with the optimizers' `step_cuda`."
    );
    let doc_grads = format!("[`{grads_host}`] in GPU memory.");
    let doc_state =
        format!("What [`{cuda_net}::forward`] keeps for the backward pass, in GPU memory.");

    quote! {
        impl #name {
            /// The CUDA source of every entry with kernels of its own besides the layers': the
            /// entry's name, the source and its kernels.
            #[doc(hidden)]
            pub const __CUDA_SOURCES: &'static [(&'static str, &'static str, &'static [&'static str])] = &[#(#source_list),*];
            #source_items
        }

        #rt::if_cuda! {
            #[doc = #doc_net]
            #vis struct #cuda_net {
                #( pub #layer_fields: #module::#layer_tys, )*
            }

            #[doc = #doc_grads]
            #vis struct #cuda_grads {
                #( pub #layer_fields: #module::#layer_grads, )*
            }

            #[doc = #doc_state]
            #vis struct #cuda_state {
                #( #state_fields, )*
            }

            #[allow(clippy::all, unused_braces, unused_mut, unused_variables, non_upper_case_globals)]
            const _: () = {
                use #rt::cuda::{blocks_for, Arg, Buf};
                #setups

                impl #cuda_net {
                    /// A copy of the network (parameters and running statistics) on the GPU.
                    pub fn upload(dev: &#cuda, net: &#name) -> #rt::Result<Self> {
                        ::core::result::Result::Ok(Self {
                            #( #layer_fields: #module::#layer_tys::upload(dev, &#host_access)?, )*
                        })
                    }

                    /// Overwrites the parameters (and running statistics) with `net`'s.
                    pub fn copy_from_host(&mut self, dev: &#cuda, net: &#name) -> #result {
                        #( self.#layer_fields.copy_from_host(dev, &#host_access)?; )*
                        ::core::result::Result::Ok(())
                    }

                    /// Copies the parameters (and running statistics) into `net`.
                    pub fn download_into(&self, dev: &#cuda, net: &mut #name) -> #result {
                        #( self.#layer_fields.download_into(dev, &mut #host_access)?; )*
                        ::core::result::Result::Ok(())
                    }

                    /// Inference on any batch, on the GPU (BatchNorm uses the running statistics).
                    pub fn evaluate<const __B: usize>(
                        &self,
                        dev: &mut #cuda,
                        input: &#in_generic,
                        output: &mut #out_generic,
                    ) -> #result {
                        if __B == 0 {
                            return ::core::result::Result::Ok(());
                        }
                        #eval_code
                        ::core::result::Result::Ok(())
                    }

                    /// The training-batch forward pass into `state`, on the GPU.
                    pub fn forward(
                        &mut self,
                        dev: &mut #cuda,
                        input: &#in_batch,
                        state: &mut #cuda_state,
                        mode: #rt::Mode,
                    ) -> #result {
                        #forward_code
                        ::core::result::Result::Ok(())
                    }

                    /// Adds the parameter gradients of the forward pass that filled `state` into
                    /// `grads`.
                    pub fn backward(
                        &self,
                        dev: &mut #cuda,
                        state: &#cuda_state,
                        input: &#in_batch,
                        d_output: &#out_batch,
                        grads: &mut #cuda_grads,
                        mode: #rt::Mode,
                    ) -> #result {
                        #backward_code
                        ::core::result::Result::Ok(())
                    }

                    /// `backward` and the input gradient (written into `d_input`) in one pass.
                    #[allow(clippy::too_many_arguments)]
                    pub fn backward_full(
                        &self,
                        dev: &mut #cuda,
                        state: &#cuda_state,
                        input: &#in_batch,
                        d_output: &#out_batch,
                        d_input: &mut #in_batch,
                        grads: &mut #cuda_grads,
                        mode: #rt::Mode,
                    ) -> #result {
                        #backward_full_code
                        ::core::result::Result::Ok(())
                    }
                }

                impl #rt::cuda::CudaParameters for #cuda_net {
                    type Elem = #t;
                    type Grads = #cuda_grads;

                    fn visit_cuda_mut(
                        &mut self,
                        grads: &#cuda_grads,
                        f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::cuda::CudaParamTensor, &Buf),
                    ) {
                        #visits
                    }
                }

                impl #cuda_grads {
                    /// Zero gradients on the GPU.
                    pub fn zeros(dev: &#cuda) -> #rt::Result<Self> {
                        ::core::result::Result::Ok(Self {
                            #( #layer_fields: #module::#layer_grads::zeros(dev)?, )*
                        })
                    }

                    /// Sets every gradient to zero.
                    pub fn zero(&mut self, dev: &#cuda) -> #result {
                        #( self.#layer_fields.zero(dev)?; )*
                        ::core::result::Result::Ok(())
                    }

                    /// Copies the gradients into `grads`.
                    pub fn download_into(&self, dev: &#cuda, grads: &mut #grads_host) -> #result {
                        #( self.#layer_fields.download_into(dev, &mut #grads_access)?; )*
                        ::core::result::Result::Ok(())
                    }
                }

                impl #cuda_state {
                    /// Zeroed state on the GPU.
                    pub fn new(dev: &#cuda) -> #rt::Result<Self> {
                        ::core::result::Result::Ok(Self { #( #state_inits, )* })
                    }

                    /// The network's output in the last forward pass.
                    pub fn output(&self) -> &#out_batch {
                        #state_out
                    }
                }
            };
        }
    }
}
