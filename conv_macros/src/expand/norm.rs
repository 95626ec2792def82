//! Normalization (BatchNorm, LayerNorm) and the gradient through activation and norm.
//!
//! Statistics accumulate in the accumulator type in two passes (the mean, then squared
//! deviations from it): no `E[x^2] - E[x]^2` cancellation. Variances are biased, as rl_tools
//! and PyTorch's normalization use them. The forward pass keeps the convolution's output, the
//! mean and `1 / sqrt(var + eps)` per group (channel or sample) for the backward pass.

use proc_macro2::TokenStream;
use quote::quote;

use super::cpu::activation_type;
use super::{rt, Names};
use crate::spec::{Norm, Spec};

pub fn expand(spec: &Spec) -> TokenStream {
    let forward = match spec.norm {
        Norm::None => TokenStream::new(),
        _ => forward(spec),
    };
    let d_conv = d_conv(spec);
    quote! {
        #forward
        #d_conv
    }
}

fn forward(spec: &Spec) -> TokenStream {
    let rt = rt();
    let Names { layer, state, .. } = Names::of(spec);
    let act = activation_type(spec.activation);
    let f = quote!(<#act as #rt::Activation>::f);
    let to_acc = quote!(<__T as #rt::Element>::to_acc);
    let from_acc = quote!(<__T as #rt::Element>::from_acc);
    let conv_to_state = if spec.dtype.is_half() {
        quote! {
            let z = state.conv.as_mut_slice();
            __conv::<{ __BATCH }, false>(cpu, layer, x, ::core::option::Option::None, &mut |ya, q0, n| {
                <__T as #rt::Element>::from_acc_slice(ya, &mut z[q0 * __OC..(q0 + n) * __OC]);
            });
        }
    } else {
        quote! {
            let z = ::core::option::Option::Some(state.conv.as_mut_slice());
            __conv::<{ __BATCH }, false>(cpu, layer, x, z, &mut |_, _, _| {});
        }
    };
    let (eps, group) = match spec.norm {
        Norm::BatchNorm { eps, .. } => (eps, quote!(c)),
        Norm::LayerNorm { eps } => (eps, quote!(q / __NPIX)),
        Norm::None => unreachable!("forward normalization of a spec without a norm"),
    };
    let stats = match spec.norm {
        Norm::BatchNorm { momentum, .. } => quote! {
            const __MOMENTUM: __A = #momentum as __A;

            fn __as_array(v: &[__A]) -> &[__A; __OC] {
                match v.try_into() {
                    ::core::result::Result::Ok(a) => a,
                    ::core::result::Result::Err(_) => ::core::unreachable!("per-channel vectors have OC elements"),
                }
            }

            /// Per-channel mean and biased variance over (batch, OH, OW).
            fn __batch_stats(z: &[__T]) -> ([__A; __OC], [__A; __OC]) {
                let n = (__BATCH * __NPIX) as __A;
                let mut sum = [0.0 as __A; __OC];
                for px in z.chunks_exact(__OC) {
                    for c in 0..__OC {
                        sum[c] += #to_acc(px[c]);
                    }
                }
                let mean: [__A; __OC] = ::core::array::from_fn(|c| sum[c] / n);
                let mut squares = [0.0 as __A; __OC];
                for px in z.chunks_exact(__OC) {
                    for c in 0..__OC {
                        let d = #to_acc(px[c]) - mean[c];
                        squares[c] += d * d;
                    }
                }
                (mean, ::core::array::from_fn(|c| squares[c] / n))
            }

            /// running = (1 - momentum) * running + momentum * batch statistic.
            fn __update_running_stats(layer: &mut #layer, mean: &[__A; __OC], var: &[__A; __OC]) {
                let rm = layer.running_mean.as_mut_slice();
                for c in 0..__OC {
                    rm[c] = (1.0 - __MOMENTUM) * rm[c] + __MOMENTUM * mean[c];
                }
                let rv = layer.running_var.as_mut_slice();
                for c in 0..__OC {
                    rv[c] = (1.0 - __MOMENTUM) * rv[c] + __MOMENTUM * var[c];
                }
            }

            fn __set_stats(state: &mut #state, mean: &[__A; __OC], var: &[__A; __OC]) {
                state.mean.as_mut_slice().copy_from_slice(mean);
                let inv_std = state.inv_std.as_mut_slice();
                for c in 0..__OC {
                    inv_std[c] = 1.0 / (var[c] + __EPS).sqrt();
                }
            }

            /// Evaluation-mode BatchNorm as `scale * z + shift` per channel.
            fn __eval_affine(layer: &#layer) -> ([__A; __OC], [__A; __OC]) {
                let (rm, rv) = (layer.running_mean.as_slice(), layer.running_var.as_slice());
                let scale: [__A; __OC] = ::core::array::from_fn(|c| {
                    #to_acc(layer.gamma.as_slice()[c]) / (rv[c] + __EPS).sqrt()
                });
                let shift = ::core::array::from_fn(|c| {
                    #to_acc(layer.beta.as_slice()[c]) - scale[c] * rm[c]
                });
                (scale, shift)
            }
        },
        _ => quote! {
            /// Mean and 1 / sqrt(biased variance + eps) of one sample.
            fn __sample_stats(z: &[__T]) -> (__A, __A) {
                let n = z.len() as __A;
                let mut sum: __A = 0.0;
                for v in z {
                    sum += #to_acc(*v);
                }
                let mean = sum / n;
                let mut squares: __A = 0.0;
                for v in z {
                    let d = #to_acc(*v) - mean;
                    squares += d * d;
                }
                (mean, 1.0 / (squares / n + __EPS).sqrt())
            }
        },
    };
    let (norm_forward, evaluate_norm) = match spec.norm {
        Norm::BatchNorm { .. } => (
            quote! {
                match mode {
                    #rt::Mode::Train => {
                        let (mean, var) = __batch_stats(state.conv.as_slice());
                        __update_running_stats(layer, &mean, &var);
                        __set_stats(state, &mean, &var);
                    }
                    #rt::Mode::Eval => {
                        let mean = *__as_array(layer.running_mean.as_slice());
                        let var = *__as_array(layer.running_var.as_slice());
                        __set_stats(state, &mean, &var);
                    }
                }
            },
            quote! {
                let (scale, shift) = __eval_affine(layer);
                for px in out.chunks_exact_mut(__OC) {
                    for c in 0..__OC {
                        px[c] = #from_acc(#f(#to_acc(px[c]) * scale[c] + shift[c]));
                    }
                }
            },
        ),
        _ => (
            quote! {
                let _ = mode;
                for n in 0..__BATCH {
                    let (mean, inv_std) = __sample_stats(&state.conv.as_slice()[n * __NPIX * __OC..][..__NPIX * __OC]);
                    state.mean.as_mut_slice()[n] = mean;
                    state.inv_std.as_mut_slice()[n] = inv_std;
                }
            },
            quote! {
                let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
                let beta: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.beta.as_slice()[c]));
                for sample in out.chunks_exact_mut(__NPIX * __OC) {
                    let (mean, inv_std) = __sample_stats(sample);
                    for px in sample.chunks_exact_mut(__OC) {
                        for c in 0..__OC {
                            let y = gamma[c] * (#to_acc(px[c]) - mean) * inv_std + beta[c];
                            px[c] = #from_acc(#f(y));
                        }
                    }
                }
            },
        ),
    };
    quote! {
        const __EPS: __A = #eps as __A;

        /// The convolution's output (with bias) into `state.conv`.
        fn __conv_to_state(cpu: &mut #rt::Cpu, layer: &#layer, x: &[__T], state: &mut #state) {
            #conv_to_state
        }

        #stats

        /// Normalization of the forward pass, after the convolution filled `state.conv`:
        /// statistics into `state` (BatchNorm in training also updates the running ones), then
        /// `normalize`. Shared by every device.
        fn __norm_forward(layer: &mut #layer, state: &mut #state, mode: #rt::Mode) {
            #norm_forward
            __normalize(layer, state);
        }

        /// Inference-mode normalization and activation of `out` (the convolution's output), in
        /// place.
        #[allow(dead_code)]
        fn __evaluate_norm(layer: &#layer, out: &mut [__T]) {
            #evaluate_norm
        }

        /// pre_activation = gamma * (conv - mean) * inv_std + beta; output = f(pre_activation),
        /// with the statistics the forward pass stored in `state`.
        fn __normalize(layer: &#layer, state: &mut #state) {
            let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
            let beta: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.beta.as_slice()[c]));
            let (mean, inv_std) = (state.mean.as_slice(), state.inv_std.as_slice());
            let z = state.conv.as_slice();
            let pre = state.pre_activation.as_mut_slice();
            let out = state.output.as_mut_slice();
            for q in 0..__BATCH * __NPIX {
                for c in 0..__OC {
                    let g = #group;
                    let i = q * __OC + c;
                    let y = gamma[c] * (#to_acc(z[i]) - mean[g]) * inv_std[g] + beta[c];
                    pre[i] = #from_acc(y);
                    out[i] = #from_acc(#f(y));
                }
            }
        }
    }
}

/// `d_conv`: the gradient at the convolution's output (`dz`) from the output gradient, and the
/// norm's parameter gradients accumulated into `grads` when given.
///
/// With `xhat = (z - mean) * inv_std` and `g = d_pre * gamma`, over a group of `N` values:
/// training statistics give `dz = inv_std * (g - mean(g) - xhat * mean(g * xhat))`; fixed
/// (evaluation-mode BatchNorm) statistics give `dz = g * inv_std`.
fn d_conv(spec: &Spec) -> TokenStream {
    let rt = rt();
    let Names {
        layer,
        grads,
        state,
        ..
    } = Names::of(spec);
    let act = activation_type(spec.activation);
    let to_acc = quote!(<__T as #rt::Element>::to_acc);
    let norm = match spec.norm {
        Norm::None => quote! { let _ = (layer, mode, grads); },
        Norm::BatchNorm { .. } => quote! {
            let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
            let (mean, inv_std) = (state.mean.as_slice(), state.inv_std.as_slice());
            let z = state.conv.as_slice();
            let mut sum = [0.0 as __A; __OC];
            let mut sum_xhat = [0.0 as __A; __OC];
            for q in 0..__BATCH * __NPIX {
                for c in 0..__OC {
                    let i = q * __OC + c;
                    sum[c] += dz[i];
                    sum_xhat[c] += dz[i] * (#to_acc(z[i]) - mean[c]) * inv_std[c];
                }
            }
            if let ::core::option::Option::Some(g) = grads {
                let (dg, db) = (g.gamma.as_mut_slice(), g.beta.as_mut_slice());
                for c in 0..__OC {
                    dg[c] += sum_xhat[c];
                    db[c] += sum[c];
                }
            }
            match mode {
                #rt::Mode::Train => {
                    let n = (__BATCH * __NPIX) as __A;
                    let mean_d: [__A; __OC] = ::core::array::from_fn(|c| sum[c] / n);
                    let mean_dx: [__A; __OC] = ::core::array::from_fn(|c| sum_xhat[c] / n);
                    for q in 0..__BATCH * __NPIX {
                        for c in 0..__OC {
                            let i = q * __OC + c;
                            let xhat = (#to_acc(z[i]) - mean[c]) * inv_std[c];
                            dz[i] = gamma[c] * inv_std[c] * (dz[i] - mean_d[c] - xhat * mean_dx[c]);
                        }
                    }
                }
                #rt::Mode::Eval => {
                    for q in 0..__BATCH * __NPIX {
                        for c in 0..__OC {
                            dz[q * __OC + c] *= gamma[c] * inv_std[c];
                        }
                    }
                }
            }
        },
        Norm::LayerNorm { .. } => quote! {
            let _ = mode;
            let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
            let z = state.conv.as_slice();
            let mut grads = grads;
            let n = (__NPIX * __OC) as __A;
            for s in 0..__BATCH {
                let (mean, inv_std) = (state.mean.as_slice()[s], state.inv_std.as_slice()[s]);
                let range = s * __NPIX * __OC..(s + 1) * __NPIX * __OC;
                let (zs, ds) = (&z[range.clone()], &mut dz[range]);
                let mut sum_g: __A = 0.0;
                let mut sum_gx: __A = 0.0;
                let mut d_gamma = [0.0 as __A; __OC];
                let mut d_beta = [0.0 as __A; __OC];
                for (zp, dp) in zs.chunks_exact(__OC).zip(ds.chunks_exact(__OC)) {
                    for c in 0..__OC {
                        let xhat = (#to_acc(zp[c]) - mean) * inv_std;
                        sum_g += dp[c] * gamma[c];
                        sum_gx += dp[c] * gamma[c] * xhat;
                        d_gamma[c] += dp[c] * xhat;
                        d_beta[c] += dp[c];
                    }
                }
                if let ::core::option::Option::Some(g) = grads.as_deref_mut() {
                    let (dg, db) = (g.gamma.as_mut_slice(), g.beta.as_mut_slice());
                    for c in 0..__OC {
                        dg[c] += d_gamma[c];
                        db[c] += d_beta[c];
                    }
                }
                let (mean_g, mean_gx) = (sum_g / n, sum_gx / n);
                for (zp, dp) in zs.chunks_exact(__OC).zip(ds.chunks_exact_mut(__OC)) {
                    for c in 0..__OC {
                        let xhat = (#to_acc(zp[c]) - mean) * inv_std;
                        dp[c] = inv_std * (dp[c] * gamma[c] - mean_g - xhat * mean_gx);
                    }
                }
            }
        },
    };
    quote! {
        /// The gradient at the convolution's output into `dz`.
        fn __d_conv(
            layer: &#layer,
            state: &#state,
            d_output: &[__T],
            mode: #rt::Mode,
            grads: ::core::option::Option<&mut #grads>,
            dz: &mut [__A],
        ) {
            #rt::activation::backward::<#act, __T>(
                d_output,
                state.pre_activation.as_slice(),
                state.output.as_slice(),
                &mut dz[..__BATCH * __NPIX * __OC],
            );
            #norm
        }
    }
}
