//! Normalization (BatchNorm, LayerNorm) and the gradient through activation and norm.
//!
//! Statistics accumulate in the accumulator type in two passes (the mean, then squared
//! deviations from it): no `E[x^2] - E[x]^2` cancellation. Variances are biased, as rl_tools
//! and PyTorch's normalization use them. The forward pass keeps the convolution's output, the
//! mean and `1 / sqrt(var + eps)` per group (channel or sample) for the backward pass.

use proc_macro2::TokenStream;
use quote::quote;

use super::cpu::activation_type;
use super::{lit, rt, Names};
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

/// Partial sums of a reduction over the training batch: whole images each, summed in a fixed
/// order, so that results do not depend on the thread count (at most 8: the reductions are a
/// small part of the work, their partials cost `OC` values each).
pub fn reduction_parts(spec: &Spec) -> usize {
    spec.batch.min(8)
}

/// The items every normalization shares: the reduction's parts.
fn parts_items(spec: &Spec) -> TokenStream {
    let parts = lit(reduction_parts(spec));
    quote! {
        /// Partial sums of the batch reductions (see `reduction_parts`).
        const __RPARTS: usize = #parts;

        /// The output pixels (of the training batch) of reduction part `p`: whole images.
        fn __part_rows(p: usize) -> ::core::ops::Range<usize> {
            p * __BATCH / __RPARTS * __NPIX..(p + 1) * __BATCH / __RPARTS * __NPIX
        }

        /// `sum_p partial[p]` per channel, in part order.
        fn __sum_parts<const __K: usize>(partial: &[[__A; __OC]; __K]) -> [__A; __OC] {
            let mut sum = [0.0 as __A; __OC];
            for part in partial {
                for c in 0..__OC {
                    sum[c] += part[c];
                }
            }
            sum
        }
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
            let z = #rt::Shared::new(state.conv.as_mut_slice());
            __conv::<{ __BATCH }, false>(cpu, layer, x, ::core::option::Option::None, &|ya, q0, n| {
                // SAFETY: the tile's own pixels.
                <__T as #rt::Element>::from_acc_slice(ya, unsafe { z.part(q0 * __OC, n * __OC) });
            }, &|_, _| {});
        }
    } else {
        quote! {
            let z = ::core::option::Option::Some(#rt::Shared::new(state.conv.as_mut_slice()));
            __conv::<{ __BATCH }, false>(cpu, layer, x, z, &|_, _, _| {}, &|_, _| {});
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

            /// Per-channel mean and biased variance over (batch, OH, OW): per reduction part,
            /// then summed in part order.
            fn __batch_stats(pool: &#rt::Pool, z: &[__T]) -> ([__A; __OC], [__A; __OC]) {
                let n = (__BATCH * __NPIX) as __A;
                let work = __BATCH * __NPIX * __OC * #rt::ELEMENT_WORK;
                let mut partial = [[0.0 as __A; __OC]; __RPARTS];
                {
                    let sums = #rt::Shared::new(&mut partial[..]);
                    pool.each(__RPARTS, work, &|p| {
                        // SAFETY: each part's own partial.
                        let sum = &mut unsafe { sums.part(p, 1) }[0];
                        let rows = __part_rows(p);
                        #rt::sums::add_channels(&z[rows.start * __OC..rows.end * __OC], sum);
                    });
                }
                let sum = __sum_parts(&partial);
                let mean: [__A; __OC] = ::core::array::from_fn(|c| sum[c] / n);
                let mut partial = [[0.0 as __A; __OC]; __RPARTS];
                {
                    let sums = #rt::Shared::new(&mut partial[..]);
                    pool.each(__RPARTS, work, &|p| {
                        // SAFETY: each part's own partial.
                        let squares = &mut unsafe { sums.part(p, 1) }[0];
                        let rows = __part_rows(p);
                        for px in z[rows.start * __OC..rows.end * __OC].chunks_exact(__OC) {
                            for c in 0..__OC {
                                let d = #to_acc(px[c]) - mean[c];
                                squares[c] += d * d;
                            }
                        }
                    });
                }
                let squares = __sum_parts(&partial);
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
                        let (mean, var) = __batch_stats(pool, state.conv.as_slice());
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
                let pixels = out.len() / __OC;
                let out = #rt::Shared::new(out);
                pool.split(pixels, __OC * #rt::ELEMENT_WORK, &|range| {
                    // SAFETY: the worker's own pixels.
                    let out = unsafe { out.part(range.start * __OC, range.len() * __OC) };
                    for px in out.chunks_exact_mut(__OC) {
                        for c in 0..__OC {
                            px[c] = #from_acc(#f(#to_acc(px[c]) * scale[c] + shift[c]));
                        }
                    }
                });
            },
        ),
        _ => (
            quote! {
                let _ = mode;
                let z = state.conv.as_slice();
                let (mean, inv_std) = (
                    #rt::Shared::new(state.mean.as_mut_slice()),
                    #rt::Shared::new(state.inv_std.as_mut_slice()),
                );
                pool.each(__BATCH, __BATCH * __NPIX * __OC * #rt::ELEMENT_WORK, &|n| {
                    let (m, s) = __sample_stats(&z[n * __NPIX * __OC..][..__NPIX * __OC]);
                    // SAFETY: each sample's own statistics.
                    unsafe {
                        mean.part(n, 1)[0] = m;
                        inv_std.part(n, 1)[0] = s;
                    }
                });
            },
            quote! {
                let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
                let beta: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.beta.as_slice()[c]));
                let samples = out.len() / (__NPIX * __OC);
                let out = #rt::Shared::new(out);
                pool.each(samples, samples * __NPIX * __OC * #rt::ELEMENT_WORK, &|n| {
                    // SAFETY: each sample is one part's.
                    let sample = unsafe { out.part(n * __NPIX * __OC, __NPIX * __OC) };
                    let (mean, inv_std) = __sample_stats(sample);
                    for px in sample.chunks_exact_mut(__OC) {
                        for c in 0..__OC {
                            let y = gamma[c] * (#to_acc(px[c]) - mean) * inv_std + beta[c];
                            px[c] = #from_acc(#f(y));
                        }
                    }
                });
            },
        ),
    };
    let parts = parts_items(spec);
    quote! {
        const __EPS: __A = #eps as __A;

        #parts

        /// The convolution's output (with bias) into `state.conv`.
        fn __conv_to_state(cpu: &mut #rt::Cpu, layer: &#layer, x: &[__T], state: &mut #state) {
            #conv_to_state
        }

        #stats

        /// Normalization of the forward pass, after the convolution filled `state.conv`:
        /// statistics into `state` (BatchNorm in training also updates the running ones), then
        /// `normalize`. Shared by every device.
        fn __norm_forward(pool: &#rt::Pool, layer: &mut #layer, state: &mut #state, mode: #rt::Mode) {
            #norm_forward
            __normalize(pool, layer, state);
        }

        /// Inference-mode normalization and activation of `out` (the convolution's output), in
        /// place.
        #[allow(dead_code)]
        fn __evaluate_norm(pool: &#rt::Pool, layer: &#layer, out: &mut [__T]) {
            #evaluate_norm
        }

        /// pre_activation = gamma * (conv - mean) * inv_std + beta; output = f(pre_activation),
        /// with the statistics the forward pass stored in `state`.
        fn __normalize(pool: &#rt::Pool, layer: &#layer, state: &mut #state) {
            let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
            let beta: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.beta.as_slice()[c]));
            let (mean, inv_std) = (state.mean.as_slice(), state.inv_std.as_slice());
            let z = state.conv.as_slice();
            let pre = #rt::Shared::new(state.pre_activation.as_mut_slice());
            let out = #rt::Shared::new(state.output.as_mut_slice());
            pool.split(__BATCH * __NPIX, __OC * #rt::ELEMENT_WORK, &|range| {
                let first = range.start * __OC;
                // SAFETY: the worker's own pixels.
                let (pre, out) = unsafe {
                    (pre.part(first, range.len() * __OC), out.part(first, range.len() * __OC))
                };
                for q in range {
                    for c in 0..__OC {
                        let g = #group;
                        let (i, j) = (q * __OC + c, (q * __OC + c) - first);
                        let y = gamma[c] * (#to_acc(z[i]) - mean[g]) * inv_std[g] + beta[c];
                        pre[j] = #from_acc(y);
                        out[j] = #from_acc(#f(y));
                    }
                }
            });
        }
    }
}

/// `d_conv`: the gradient at the convolution's output (`dz`) from the output gradient, and the
/// norm's parameter gradients accumulated into `grads` when given.
///
/// With `xhat = (z - mean) * inv_std` and `g = d_pre * gamma`, over a group of `N` values:
/// training statistics give `dz = inv_std * (g - mean(g) - xhat * mean(g * xhat))`; fixed
/// (evaluation-mode BatchNorm) statistics give `dz = g * inv_std`. Sums over the batch take the
/// reduction parts; per-sample sums (LayerNorm) are one sample's, in order.
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
            let work = __BATCH * __NPIX * __OC * #rt::ELEMENT_WORK;
            let mut partial = [[[0.0 as __A; __OC]; __RPARTS]; 2];
            {
                let [sums, sums_xhat] = &mut partial;
                let (sums, sums_xhat) = (#rt::Shared::new(&mut sums[..]), #rt::Shared::new(&mut sums_xhat[..]));
                let dz: &[__A] = dz;
                pool.each(__RPARTS, work, &|p| {
                    // SAFETY: each part's own partials.
                    let (sum, sum_xhat) = unsafe { (&mut sums.part(p, 1)[0], &mut sums_xhat.part(p, 1)[0]) };
                    for q in __part_rows(p) {
                        for c in 0..__OC {
                            let i = q * __OC + c;
                            sum[c] += dz[i];
                            sum_xhat[c] += dz[i] * (#to_acc(z[i]) - mean[c]) * inv_std[c];
                        }
                    }
                });
            }
            let (sum, sum_xhat) = (__sum_parts(&partial[0]), __sum_parts(&partial[1]));
            if let ::core::option::Option::Some(g) = grads {
                let (dg, db) = (g.gamma.as_mut_slice(), g.beta.as_mut_slice());
                for c in 0..__OC {
                    dg[c] += sum_xhat[c];
                    db[c] += sum[c];
                }
            }
            let n = (__BATCH * __NPIX) as __A;
            let mean_d: [__A; __OC] = ::core::array::from_fn(|c| sum[c] / n);
            let mean_dx: [__A; __OC] = ::core::array::from_fn(|c| sum_xhat[c] / n);
            let train = mode == #rt::Mode::Train;
            let dz = #rt::Shared::new(dz);
            pool.split(__BATCH * __NPIX, __OC * #rt::ELEMENT_WORK, &|range| {
                let first = range.start * __OC;
                // SAFETY: the worker's own pixels.
                let dz = unsafe { dz.part(first, range.len() * __OC) };
                for q in range {
                    for c in 0..__OC {
                        let i = q * __OC + c;
                        let d = &mut dz[i - first];
                        if train {
                            let xhat = (#to_acc(z[i]) - mean[c]) * inv_std[c];
                            *d = gamma[c] * inv_std[c] * (*d - mean_d[c] - xhat * mean_dx[c]);
                        } else {
                            *d *= gamma[c] * inv_std[c];
                        }
                    }
                }
            });
        },
        Norm::LayerNorm { .. } => quote! {
            let _ = mode;
            let gamma: [__A; __OC] = ::core::array::from_fn(|c| #to_acc(layer.gamma.as_slice()[c]));
            let z = state.conv.as_slice();
            let n = (__NPIX * __OC) as __A;
            let work = __BATCH * __NPIX * __OC * #rt::ELEMENT_WORK;
            // Per reduction part, the parameter gradients of its samples, in sample order.
            let mut partial = [[[0.0 as __A; __OC]; __RPARTS]; 2];
            {
                let [gammas, betas] = &mut partial;
                let (gammas, betas) = (#rt::Shared::new(&mut gammas[..]), #rt::Shared::new(&mut betas[..]));
                let dz = #rt::Shared::new(dz);
                pool.each(__RPARTS, work, &|p| {
                    // SAFETY: each part's own partials and samples.
                    let (d_gamma, d_beta) = unsafe { (&mut gammas.part(p, 1)[0], &mut betas.part(p, 1)[0]) };
                    let rows = __part_rows(p);
                    for s in rows.start / __NPIX..rows.end / __NPIX {
                        let (mean, inv_std) = (state.mean.as_slice()[s], state.inv_std.as_slice()[s]);
                        let zs = &z[s * __NPIX * __OC..][..__NPIX * __OC];
                        // SAFETY: as above.
                        let ds = unsafe { dz.part(s * __NPIX * __OC, __NPIX * __OC) };
                        let mut sum_g: __A = 0.0;
                        let mut sum_gx: __A = 0.0;
                        for (zp, dp) in zs.chunks_exact(__OC).zip(ds.chunks_exact(__OC)) {
                            for c in 0..__OC {
                                let xhat = (#to_acc(zp[c]) - mean) * inv_std;
                                sum_g += dp[c] * gamma[c];
                                sum_gx += dp[c] * gamma[c] * xhat;
                                d_gamma[c] += dp[c] * xhat;
                                d_beta[c] += dp[c];
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
                });
            }
            if let ::core::option::Option::Some(g) = grads {
                let (d_gamma, d_beta) = (__sum_parts(&partial[0]), __sum_parts(&partial[1]));
                let (dg, db) = (g.gamma.as_mut_slice(), g.beta.as_mut_slice());
                for c in 0..__OC {
                    dg[c] += d_gamma[c];
                    db[c] += d_beta[c];
                }
            }
        },
    };
    let parts = (spec.norm == Norm::None).then(|| parts_items(spec));
    quote! {
        #parts

        /// The gradient at the convolution's output into `dz`, on the pool's threads.
        fn __d_conv(
            pool: &#rt::Pool,
            layer: &#layer,
            state: &#state,
            d_output: &[__T],
            mode: #rt::Mode,
            grads: ::core::option::Option<&mut #grads>,
            dz: &mut [__A],
        ) {
            let dz = &mut dz[..__BATCH * __NPIX * __OC];
            #rt::activation::backward_on::<#act, __T>(
                pool,
                d_output,
                state.pre_activation().as_slice(),
                state.output.as_slice(),
                dz,
            );
            #norm
        }
    }
}
