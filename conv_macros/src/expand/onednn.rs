//! Generated code of the oneDNN device: the layer's geometry as literals in a `static` setup
//! (primitives built on first use, see `conv_runtime::onednn`), and the operations: the
//! convolution and its gradients run in oneDNN; activation and normalization run the generated
//! code the CPU device also runs, so the two devices agree to rounding.
//!
//! Only f32 layers use oneDNN's convolution; f64 (which oneDNN lacks) and f16/bf16 (which keep
//! the generated mixed-precision path) run the CPU code on every operation, counted as
//! fallbacks. Emitted inside `conv_runtime::__private::if_onednn!`, so it exists exactly when
//! the runtime was built with the `onednn` feature.

use proc_macro2::TokenStream;
use quote::quote;

use super::cpu::activation_type;
use super::types::device_impl;
use super::{rt, Names};
use crate::spec::{Activation, Dtype, Norm, Spec};

pub fn expand(spec: &Spec) -> TokenStream {
    let rt = rt();
    let body = if spec.dtype == Dtype::F32 {
        native(spec)
    } else {
        fallback(spec)
    };
    quote! {
        #rt::if_onednn! {
            #body
        }
    }
}

/// Every operation runs the CPU device's generated code.
fn fallback(spec: &Spec) -> TokenStream {
    let rt = rt();
    let device = Names::of(spec).device;
    device_impl(spec, quote!(#rt::onednn::OneDnn), |method| {
        let (method, args) = match method {
            "evaluate" => ("evaluate", quote!(layer, input, output)),
            "forward" => ("forward", quote!(layer, input, state, mode)),
            "backward_input" => (
                "backward_input",
                quote!(layer, state, d_output, d_input, mode),
            ),
            "backward" => (
                "backward",
                quote!(layer, state, input, d_output, grads, mode),
            ),
            _ => (
                "backward_full",
                quote!(layer, state, input, d_output, d_input, grads, mode),
            ),
        };
        let method = quote::format_ident!("{}", method);
        quote!(<#rt::Cpu as #device>::#method(self.__cpu(true), #args))
    })
}

/// f32: the convolution in oneDNN.
fn native(spec: &Spec) -> TokenStream {
    let rt = rt();
    let act = activation_type(spec.activation);
    let apply = quote!(#rt::activation::apply::<#act, _>);
    // oneDNN's relu, tanh, logistic and gelu_tanh are exactly these activations.
    let fused = match spec.activation {
        Activation::Relu => Some(quote!(Relu)),
        Activation::Tanh => Some(quote!(Tanh)),
        Activation::Sigmoid => Some(quote!(Logistic)),
        Activation::Gelu => Some(quote!(GeluTanh)),
        Activation::Identity | Activation::FastTanh => None,
    };
    let norm = spec.norm != Norm::None;
    let fused_field = match (&fused, norm) {
        (Some(alg), false) => quote!(::core::option::Option::Some(#rt::onednn::Eltwise::#alg)),
        _ => quote!(::core::option::Option::None),
    };
    let evaluate_post = match (norm, fused.is_some()) {
        (true, _) => {
            quote!(__evaluate_norm(self.__cpu(false).__pool(), layer, output.as_mut_slice());)
        }
        (false, true) => TokenStream::new(),
        (false, false) => quote!(#apply(output.as_mut_slice());),
    };
    let forward = if norm {
        quote! {
            let w = &layer.weights;
            self.__conv_forward(&__ONEDNN, __BATCH, false, w.as_slice(), w.stamp(), layer.biases.as_slice(), input.as_slice(), state.conv.as_mut_slice())?;
            __norm_forward(self.__cpu(false).__pool(), layer, state, mode);
        }
    } else if super::output_is_pre_activation(spec) {
        quote! {
            let _ = mode;
            let w = &layer.weights;
            self.__conv_forward(&__ONEDNN, __BATCH, false, w.as_slice(), w.stamp(), layer.biases.as_slice(), input.as_slice(), state.output.as_mut_slice())?;
        }
    } else {
        quote! {
            let _ = mode;
            let w = &layer.weights;
            self.__conv_forward(&__ONEDNN, __BATCH, false, w.as_slice(), w.stamp(), layer.biases.as_slice(), input.as_slice(), state.pre_activation.as_mut_slice())?;
            let out = state.output.as_mut_slice();
            out.copy_from_slice(state.pre_activation.as_slice());
            #apply(out);
        }
    };
    let methods = device_impl(spec, quote!(#rt::onednn::OneDnn), |method| match method {
        "evaluate" => quote! {
            let w = &layer.weights;
            self.__conv_forward(&__ONEDNN, __B, true, w.as_slice(), w.stamp(), layer.biases.as_slice(), input.as_slice(), output.as_mut_slice())?;
            #evaluate_post
            ::core::result::Result::Ok(())
        },
        "forward" => quote! {
            #forward
            ::core::result::Result::Ok(())
        },
        "backward_input" => quote! {
            let mut dz = ::std::vec![0.0f32; __BATCH * __NPIX * __OC];
            __d_conv(self.__cpu(false).__pool(), layer, state, d_output.as_slice(), mode, ::core::option::Option::None, &mut dz);
            let w = &layer.weights;
            self.__conv_backward_data(&__ONEDNN, w.as_slice(), w.stamp(), &dz, d_input.as_mut_slice())
        },
        "backward" => quote! {
            let mut dz = ::std::vec![0.0f32; __BATCH * __NPIX * __OC];
            __d_conv(self.__cpu(false).__pool(), layer, state, d_output.as_slice(), mode, ::core::option::Option::Some(&mut *grads), &mut dz);
            self.__conv_backward_weights(&__ONEDNN, input.as_slice(), &dz, grads.weights.as_mut_slice(), grads.biases.as_mut_slice())
        },
        _ => quote! {
            let mut dz = ::std::vec![0.0f32; __BATCH * __NPIX * __OC];
            __d_conv(self.__cpu(false).__pool(), layer, state, d_output.as_slice(), mode, ::core::option::Option::Some(&mut *grads), &mut dz);
            let w = &layer.weights;
            self.__conv_backward_data(&__ONEDNN, w.as_slice(), w.stamp(), &dz, d_input.as_mut_slice())?;
            self.__conv_backward_weights(&__ONEDNN, input.as_slice(), &dz, grads.weights.as_mut_slice(), grads.biases.as_mut_slice())
        },
    });
    quote! {
        static __ONEDNN: #rt::onednn::ConvSetup = #rt::onednn::ConvSetup::new(#rt::onednn::ConvGeometry {
            batch: __BATCH,
            in_h: __IH,
            in_w: __IW,
            in_c: __IC,
            out_h: __OH,
            out_w: __OW,
            out_c: __OC,
            kernel: [__KH, __KW],
            stride: [__SH, __SW],
            padding: [__PH, __PW],
            fused: #fused_field,
        });

        #methods
    }
}
