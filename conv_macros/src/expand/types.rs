//! The layer, gradient and state types, the associated constants, initialization, and the
//! device-generic operation methods (each forwards to the device's implementation).

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::{acc, elem, lit, rt, Names};
use crate::spec::{Init, Norm, Spec};

/// One trainable parameter: its field name and its type with element type `ty`.
pub struct Param {
    pub name: syn::Ident,
    pub shape: TokenStream,
}

impl Param {
    pub fn ty(&self, elem: &TokenStream) -> TokenStream {
        let rt = rt();
        let shape = &self.shape;
        if self.name == "weights" {
            quote!(#rt::Tensor<#elem, #shape>)
        } else {
            quote!(#rt::Vector<#elem, #shape>)
        }
    }
}

/// The trainable parameters of a spec, in a fixed order (weights, biases, gamma, beta).
pub fn params(spec: &Spec) -> Vec<Param> {
    let (oc, kh, kw, ic) = (
        lit(spec.out_channels),
        lit(spec.kernel[0]),
        lit(spec.kernel[1]),
        lit(spec.in_c()),
    );
    let mut out = vec![
        Param {
            name: format_ident!("weights"),
            shape: quote!(#oc, #kh, #kw, #ic),
        },
        Param {
            name: format_ident!("biases"),
            shape: quote!(#oc),
        },
    ];
    if spec.norm != Norm::None {
        out.push(Param {
            name: format_ident!("gamma"),
            shape: quote!(#oc),
        });
        out.push(Param {
            name: format_ident!("beta"),
            shape: quote!(#oc),
        });
    }
    out
}

/// The associated constants every layer has.
pub const CONSTANTS: [&str; 13] = [
    "INPUT_HEIGHT",
    "INPUT_WIDTH",
    "INPUT_CHANNELS",
    "OUTPUT_HEIGHT",
    "OUTPUT_WIDTH",
    "OUTPUT_CHANNELS",
    "KERNEL_HEIGHT",
    "KERNEL_WIDTH",
    "STRIDE_HEIGHT",
    "STRIDE_WIDTH",
    "PADDING_HEIGHT",
    "PADDING_WIDTH",
    "BATCH_SIZE",
];

/// One operation of the per-layer device trait.
pub struct DeviceMethod {
    pub name: &'static str,
    doc: &'static str,
    /// `fn name<..>(&mut self, ..) -> Result<()>`.
    signature: TokenStream,
}

/// The operations every device implements for a layer, written once for the trait and for
/// every device's implementation.
pub fn device_methods(spec: &Spec) -> Vec<DeviceMethod> {
    let rt = rt();
    let Names {
        layer,
        grads,
        state,
        ..
    } = Names::of(spec);
    let t = elem(spec.dtype);
    let (ih, iw, ic) = (lit(spec.in_h()), lit(spec.in_w()), lit(spec.in_c()));
    let (oh, ow, oc) = (lit(spec.out_h()), lit(spec.out_w()), lit(spec.out_channels));
    let batch = lit(spec.batch);
    let x_ty = quote!(#rt::Tensor<#t, #batch, #ih, #iw, #ic>);
    let y_ty = quote!(#rt::Tensor<#t, #batch, #oh, #ow, #oc>);
    let result = quote!(#rt::Result<()>);
    let method =
        |name: &'static str, doc: &'static str, generics: TokenStream, params: TokenStream| {
            let ident = format_ident!("{}", name);
            let signature = quote! {
                #[allow(clippy::too_many_arguments)]
                fn #ident #generics(&mut self, #params) -> #result
            };
            DeviceMethod {
                name,
                doc,
                signature,
            }
        };
    vec![
        method(
            "evaluate",
            "Inference on any batch.",
            quote!(<const __B: usize>),
            quote! {
                layer: &#layer,
                input: &#rt::Tensor<#t, { __B }, #ih, #iw, #ic>,
                output: &mut #rt::Tensor<#t, { __B }, #oh, #ow, #oc>,
            },
        ),
        method(
            "forward",
            "Training-batch forward pass keeping what the backward pass needs.",
            quote!(),
            quote!(layer: &mut #layer, input: &#x_ty, state: &mut #state, mode: #rt::Mode,),
        ),
        method(
            "backward_input",
            "Input gradient of the last forward pass.",
            quote!(),
            quote! {
                layer: &#layer, state: &#state, d_output: &#y_ty, d_input: &mut #x_ty,
                mode: #rt::Mode,
            },
        ),
        method(
            "backward",
            "Parameter gradients of the last forward pass, added into `grads`.",
            quote!(),
            quote! {
                layer: &#layer, state: &#state, input: &#x_ty, d_output: &#y_ty,
                grads: &mut #grads, mode: #rt::Mode,
            },
        ),
        method(
            "backward_full",
            "Input and parameter gradients in one pass.",
            quote!(),
            quote! {
                layer: &#layer, state: &#state, input: &#x_ty, d_output: &#y_ty,
                d_input: &mut #x_ty, grads: &mut #grads, mode: #rt::Mode,
            },
        ),
    ]
}

/// `impl <Layer>Device for <device>` with `body(method name)` as each method's body.
pub fn device_impl(
    spec: &Spec,
    device: TokenStream,
    body: impl Fn(&str) -> TokenStream,
) -> TokenStream {
    device_impl_with(spec, device, body, TokenStream::new())
}

/// [`device_impl`] with `extra` items in the impl (overrides of the trait's provided methods).
pub fn device_impl_with(
    spec: &Spec,
    device: TokenStream,
    body: impl Fn(&str) -> TokenStream,
    extra: TokenStream,
) -> TokenStream {
    let device_trait = Names::of(spec).device;
    let methods = device_methods(spec).into_iter().map(|m| {
        let (signature, body) = (&m.signature, body(m.name));
        quote!(#signature { #body })
    });
    quote! {
        impl #device_trait for #device {
            #(#methods)*
            #extra
        }
    }
}

/// The signature of the provided method `__evaluate_then`: `evaluate`, each run of output
/// pixels handed to `then(output, first pixel, pixels)` once final, on the device's threads,
/// where the device can (a network's max-pooling in the convolution's epilogue). Returns
/// whether it did; if not, `then` never ran.
pub fn evaluate_then_signature(spec: &Spec) -> TokenStream {
    let rt = rt();
    let layer = Names::of(spec).layer;
    let t = elem(spec.dtype);
    let (ih, iw, ic) = (lit(spec.in_h()), lit(spec.in_w()), lit(spec.in_c()));
    let (oh, ow, oc) = (lit(spec.out_h()), lit(spec.out_w()), lit(spec.out_channels));
    quote! {
        fn __evaluate_then<const __B: usize>(
            &mut self,
            layer: &#layer,
            input: &#rt::Tensor<#t, { __B }, #ih, #iw, #ic>,
            output: &mut #rt::Tensor<#t, { __B }, #oh, #ow, #oc>,
            then: &(dyn ::core::ops::Fn(&#rt::Shared<'_, #t>, usize, usize) + ::core::marker::Sync),
        ) -> #rt::Result<bool>
    }
}

/// Whether the user's attributes derive `name` (then the macro does not implement it).
fn derives(attrs: &[syn::Attribute], name: &str) -> bool {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("derive"))
        .any(|a| {
            let mut found = false;
            // A derive list that does not parse is left for rustc to report.
            let _ = a.parse_nested_meta(|meta| {
                found |= meta.path.segments.last().is_some_and(|s| s.ident == name);
                Ok(())
            });
            found
        })
}

pub fn expand(spec: &Spec) -> TokenStream {
    let rt = rt();
    let Names {
        layer,
        grads,
        state,
        device,
    } = Names::of(spec);
    let (attrs, vis) = (&spec.attrs, &spec.vis);
    let t = elem(spec.dtype);
    let a = acc(spec.dtype);
    let oc = lit(spec.out_channels);
    let (ih, iw, ic) = (lit(spec.in_h()), lit(spec.in_w()), lit(spec.in_c()));
    let (oh, ow) = (lit(spec.out_h()), lit(spec.out_w()));
    let batch = lit(spec.batch);
    let params = params(spec);
    let names: Vec<_> = params.iter().map(|p| &p.name).collect();
    let param_tys: Vec<_> = params.iter().map(|p| p.ty(&t)).collect();
    let grad_tys: Vec<_> = params.iter().map(|p| p.ty(&a)).collect();

    let running = matches!(spec.norm, Norm::BatchNorm { .. });
    let running_fields = running.then(|| {
        quote! {
            /// Running mean per channel (BatchNorm), in the accumulator type.
            pub running_mean: #rt::Vector<#a, #oc>,
            /// Running biased variance per channel (BatchNorm), in the accumulator type.
            pub running_var: #rt::Vector<#a, #oc>,
        }
    });
    let running_init = running.then(|| {
        quote! {
            running_mean: #rt::Vector::zeros(),
            running_var: #rt::Vector::from_fn(|_| 1.0),
        }
    });
    let running_names: Vec<syn::Ident> = if running {
        vec![format_ident!("running_mean"), format_ident!("running_var")]
    } else {
        Vec::new()
    };
    let norm_init = (spec.norm != Norm::None).then(|| {
        quote! {
            gamma: #rt::Vector::from_fn(|_| <#t as #rt::Element>::from_f64(1.0)),
            beta: #rt::Vector::zeros(),
        }
    });
    let Init::KaimingUniform { legacy, scale } = spec.init;
    let fan_in = lit(spec.fan_in());

    // Statistics the forward pass keeps for the backward pass: per channel (BatchNorm) or per
    // sample (LayerNorm).
    let stats_len = match spec.norm {
        Norm::None => None,
        Norm::BatchNorm { .. } => ::core::option::Option::Some(oc.clone()),
        Norm::LayerNorm { .. } => ::core::option::Option::Some(batch.clone()),
    };
    let stats_fields = stats_len.as_ref().map(|n| {
        quote! {
            /// The convolution's output with bias, before normalization.
            conv: #rt::Tensor<#t, #batch, #oh, #ow, #oc>,
            /// Mean of the normalization groups the forward pass used.
            mean: #rt::Vector<#a, #n>,
            /// 1 / sqrt(var + eps) of the same groups.
            inv_std: #rt::Vector<#a, #n>,
        }
    });
    let stats_names: Vec<syn::Ident> = if stats_len.is_some() {
        ["conv", "mean", "inv_std"]
            .iter()
            .map(|n| format_ident!("{}", n))
            .collect()
    } else {
        Vec::new()
    };
    let aliased = super::output_is_pre_activation(spec);
    let state_names: Vec<syn::Ident> = stats_names
        .iter()
        .cloned()
        .chain((!aliased).then(|| format_ident!("pre_activation")))
        .chain([format_ident!("output")])
        .collect();

    let values = [
        spec.in_h(),
        spec.in_w(),
        spec.in_c(),
        spec.out_h(),
        spec.out_w(),
        spec.out_channels,
        spec.kernel[0],
        spec.kernel[1],
        spec.stride[0],
        spec.stride[1],
        spec.padding[0],
        spec.padding[1],
        spec.batch,
    ];
    let consts = CONSTANTS.iter().zip(values).map(|(name, value)| {
        let name = format_ident!("{}", name);
        let value = lit(value);
        quote!(pub const #name: usize = #value;)
    });
    let clone = (!derives(attrs, "Clone")).then(|| {
        quote! {
            impl ::core::clone::Clone for #layer {
                fn clone(&self) -> Self {
                    Self { #(#names: self.#names.clone(),)* #(#running_names: self.#running_names.clone(),)* }
                }
            }
        }
    });
    let debug = (!derives(attrs, "Debug")).then(|| {
        quote! {
            impl ::core::fmt::Debug for #layer {
                fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                    f.debug_struct(::core::stringify!(#layer))
                        #(.field(::core::stringify!(#names), &self.#names))*
                        #(.field(::core::stringify!(#running_names), &self.#running_names))*
                        .finish()
                }
            }
        }
    });

    let evaluate_then = evaluate_then_signature(spec);
    let trait_methods = device_methods(spec).into_iter().map(|m| {
        let DeviceMethod { doc, signature, .. } = m;
        quote! {
            #[doc = #doc]
            #signature;
        }
    });
    let layer_doc = format!(
        "Devices that can run [`{layer}`]: the CPU, and the other backends the runtime was built with."
    );
    let input_alias = format_ident!("{}Input", layer);
    let output_alias = format_ident!("{}Output", layer);
    let input_doc = format!("The input of [`{layer}`] at batch `B`.");
    let output_doc = format!("The output of [`{layer}`] at batch `B`.");
    let x_ty = quote!(#rt::Tensor<#t, #batch, #ih, #iw, #ic>);
    let y_ty = quote!(#rt::Tensor<#t, #batch, #oh, #ow, #oc>);
    let (pre_field, pre_ref) = if aliased {
        (TokenStream::new(), quote!(&self.output))
    } else {
        (
            quote! {
                /// The activation's input.
                pre_activation: #y_ty,
            },
            quote!(&self.pre_activation),
        )
    };

    quote! {
        #(#attrs)*
        #vis struct #layer {
            #(
                #[doc = ::core::concat!("Trainable parameter `", ::core::stringify!(#names), "`.")]
                pub #names: #param_tys,
            )*
            #running_fields
        }

        /// Gradients of the layer's trainable parameters, in the accumulator type.
        #[allow(dead_code)]
        #vis struct #grads {
            #(
                #[doc = ::core::concat!("Gradient of `", ::core::stringify!(#names), "`.")]
                pub #names: #grad_tys,
            )*
        }

        /// What a forward pass keeps for the backward pass that follows it.
        #[allow(dead_code)]
        #vis struct #state {
            #stats_fields
            #pre_field
            /// The layer's output (and the activation's input where there is no activation
            /// or norm).
            output: #y_ty,
        }

        #[doc = #input_doc]
        #[allow(dead_code)]
        #vis type #input_alias<const __B: usize> = #rt::Tensor<#t, { __B }, #ih, #iw, #ic>;
        #[doc = #output_doc]
        #[allow(dead_code)]
        #vis type #output_alias<const __B: usize> = #rt::Tensor<#t, { __B }, #oh, #ow, #oc>;

        #[doc = #layer_doc]
        #vis trait #device {
            #(#trait_methods)*

            #[doc(hidden)]
            #evaluate_then {
                let _ = then;
                self.evaluate(layer, input, output)?;
                ::core::result::Result::Ok(false)
            }
        }

        impl #layer {
            #(#consts)*

            /// A layer initialized by the spec's initializer.
            pub fn new(rng: &mut #rt::Rng) -> Self {
                let mut weights = #rt::Tensor::zeros();
                let mut biases = #rt::Vector::zeros();
                #rt::kaiming_uniform::<#t>(
                    rng,
                    weights.as_mut_slice(),
                    biases.as_mut_slice(),
                    #fan_in,
                    #legacy,
                    #scale,
                );
                Self { weights, biases, #norm_init #running_init }
            }

            /// Inference on any batch; BatchNorm uses the running statistics.
            #[inline]
            pub fn evaluate<__D: #device, const __B: usize>(
                &self,
                device: &mut __D,
                input: &#rt::Tensor<#t, { __B }, #ih, #iw, #ic>,
                output: &mut #rt::Tensor<#t, { __B }, #oh, #ow, #oc>,
            ) -> #rt::Result<()> {
                device.evaluate(self, input, output)
            }

            /// `evaluate`, each run of output pixels handed to `then` once final where the
            /// device can (see the device trait's `__evaluate_then`).
            #[doc(hidden)]
            #[inline]
            pub fn __evaluate_then<__D: #device, const __B: usize>(
                &self,
                device: &mut __D,
                input: &#rt::Tensor<#t, { __B }, #ih, #iw, #ic>,
                output: &mut #rt::Tensor<#t, { __B }, #oh, #ow, #oc>,
                then: &(dyn ::core::ops::Fn(&#rt::Shared<'_, #t>, usize, usize) + ::core::marker::Sync),
            ) -> #rt::Result<bool> {
                device.__evaluate_then(self, input, output, then)
            }

            /// Forward pass on the training batch, keeping pre-activations and statistics in
            /// `state`. `Mode::Train` uses batch statistics and updates BatchNorm's running ones.
            #[inline]
            pub fn forward<__D: #device>(
                &mut self,
                device: &mut __D,
                input: &#x_ty,
                state: &mut #state,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                device.forward(self, input, state, mode)
            }

            /// Writes the gradient of the loss with respect to the input of the forward pass
            /// that filled `state` (run in `mode`) into `d_input`.
            #[inline]
            pub fn backward_input<__D: #device>(
                &self,
                device: &mut __D,
                state: &#state,
                d_output: &#y_ty,
                d_input: &mut #x_ty,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                device.backward_input(self, state, d_output, d_input, mode)
            }

            /// Adds the parameter gradients of the forward pass that filled `state` into `grads`.
            #[inline]
            pub fn backward<__D: #device>(
                &self,
                device: &mut __D,
                state: &#state,
                input: &#x_ty,
                d_output: &#y_ty,
                grads: &mut #grads,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                device.backward(self, state, input, d_output, grads, mode)
            }

            /// `backward_input` and `backward` in one pass over the data.
            #[inline]
            #[allow(clippy::too_many_arguments)]
            pub fn backward_full<__D: #device>(
                &self,
                device: &mut __D,
                state: &#state,
                input: &#x_ty,
                d_output: &#y_ty,
                d_input: &mut #x_ty,
                grads: &mut #grads,
                mode: #rt::Mode,
            ) -> #rt::Result<()> {
                device.backward_full(self, state, input, d_output, d_input, grads, mode)
            }
        }

        impl #layer {
            /// Copies `other`'s parameters (and running statistics) into this layer.
            pub fn copy_from(&mut self, other: &Self) {
                #(self.#names.as_mut_slice().copy_from_slice(other.#names.as_slice());)*
                #(self.#running_names.as_mut_slice().copy_from_slice(other.#running_names.as_slice());)*
            }

            /// Sum of absolute differences to `other` over parameters and running statistics,
            /// in f64 (rl_tools' `abs_diff`).
            pub fn abs_diff(&self, other: &Self) -> f64 {
                let mut sum = 0.0f64;
                #(
                    for (a, b) in self.#names.as_slice().iter().zip(other.#names.as_slice()) {
                        sum += (<#t as #rt::Element>::to_f64(*a) - <#t as #rt::Element>::to_f64(*b)).abs();
                    }
                )*
                #(
                    for (a, b) in self.#running_names.as_slice().iter().zip(other.#running_names.as_slice()) {
                        sum += (<#a as #rt::Element>::to_f64(*a) - <#a as #rt::Element>::to_f64(*b)).abs();
                    }
                )*
                sum
            }

            /// Whether any parameter or running statistic is NaN.
            pub fn is_nan(&self) -> bool {
                false
                    #(|| self.#names.as_slice().iter().any(|v| #rt::Element::is_nan(*v)))*
                    #(|| self.#running_names.as_slice().iter().any(|v| #rt::Element::is_nan(*v)))*
            }
        }

        impl #rt::Parameters for #layer {
            type Elem = #t;
            type Grads = #grads;

            fn visit_mut(
                &mut self,
                grads: &#grads,
                f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::ParamTensor<#t>, &[#a]),
            ) {
                #(f(::core::stringify!(#names), &mut self.#names, grads.#names.as_slice());)*
            }

            fn visit(&self, f: &mut dyn ::core::ops::FnMut(&str, &[#t])) {
                #(f(::core::stringify!(#names), self.#names.as_slice());)*
            }

            fn visit_params_mut(&mut self, f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::ParamTensor<#t>)) {
                #(f(::core::stringify!(#names), &mut self.#names);)*
            }

            fn visit_buffers_mut(&mut self, f: &mut dyn ::core::ops::FnMut(&str, &mut dyn #rt::ParamTensor<#a>)) {
                let _ = &f;
                #(f(::core::stringify!(#running_names), &mut self.#running_names);)*
            }
        }

        #clone
        #debug

        impl #grads {
            /// All-zero gradients.
            pub fn zeros() -> Self {
                Self { #(#names: ::core::default::Default::default(),)* }
            }

            /// Clears every gradient.
            pub fn zero(&mut self) {
                #(self.#names.fill(0.0);)*
            }

            /// Adds `other`'s gradients into these (e.g. from a second batch or worker).
            pub fn add(&mut self, other: &Self) {
                #(
                    for (a, b) in self.#names.as_mut_slice().iter_mut().zip(other.#names.as_slice()) {
                        *a += *b;
                    }
                )*
            }

            /// Copies `other`'s gradients into these.
            pub fn copy_from(&mut self, other: &Self) {
                #(self.#names.as_mut_slice().copy_from_slice(other.#names.as_slice());)*
            }

            /// The L2 norm of all gradients together, in f64.
            pub fn norm(&self) -> f64 {
                let mut sum = 0.0f64;
                #(
                    for v in self.#names.as_slice() {
                        let v = <#a as #rt::Element>::to_f64(*v);
                        sum += v * v;
                    }
                )*
                sum.sqrt()
            }

            /// Whether any gradient is NaN.
            pub fn is_nan(&self) -> bool {
                false #(|| self.#names.as_slice().iter().any(|v| v.is_nan()))*
            }
        }

        impl ::core::clone::Clone for #grads {
            fn clone(&self) -> Self {
                Self { #(#names: self.#names.clone(),)* }
            }
        }

        impl ::core::fmt::Debug for #grads {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.debug_struct(::core::stringify!(#grads))
                    #(.field(::core::stringify!(#names), &self.#names))*
                    .finish()
            }
        }

        impl #state {
            /// Zeroed state.
            pub fn new() -> Self {
                Self { #(#state_names: ::core::default::Default::default(),)* }
            }

            /// The output of the last forward pass.
            pub fn output(&self) -> &#y_ty {
                &self.output
            }

            /// The activation's input in the last forward pass.
            pub fn pre_activation(&self) -> &#y_ty {
                #pre_ref
            }

            /// Zeroes everything the last forward pass left.
            pub fn reset(&mut self) {
                *self = Self::new();
            }

            /// Whether anything the last forward pass left is NaN.
            pub fn is_nan(&self) -> bool {
                false #(|| self.#state_names.as_slice().iter().any(|v| #rt::Element::is_nan(*v)))*
            }
        }

        impl ::core::default::Default for #state {
            fn default() -> Self {
                Self::new()
            }
        }
    }
}
