//! Generated backward kernels and the backward pass that drives them.
//!
//! - Data gradient (the transposed convolution), scatter form: each output pixel adds
//!   `W[:, kh, :, :]^T . dz[pixel]` into the row segment of the input it read, for every `kh`.
//!   The segment `KW * IC` is contiguous in NHWC, so it is the SIMD dimension (not `IC` alone:
//!   layers with few input channels, such as the first layer of an Atari network, keep their
//!   vectors full), and the reduction runs over the output channels. Weights are repacked
//!   (cached like the forward copy) into `[kh][block][oc][lanes]`.
//! - Weight gradient: `dW[r][oc] += sum over pixels of x[pixel + offset(r)] * dz[pixel][oc]`
//!   for the `KH * KW * IC` window positions `r`, with output channels as the SIMD dimension and
//!   a `P x V` register block of (positions x channel vectors), over chunks of pixels whose
//!   input offsets are computed once per chunk.
//!
//! Both read a zero-bordered input like the forward kernel, so there are no border branches.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, ToTokens};

use super::cpu::{layout_id, staged};
use super::kernel::{
    array_by_loop, dispatched, fma_step, init_accumulators, write_accumulators, Blocking,
    VECTOR_REGISTERS,
};
use super::{lit, rt, scatter, usize_consts, Names};
use crate::spec::{Dtype, Spec};

/// Pixels per weight-gradient chunk: their input offsets live on the stack and their
/// gradients (`QC * OC` values) stay in L1 across the position blocks.
const CHUNK: usize = 64;

/// How the backward pass gets the input gradient, a worker's images at a time: the images a
/// worker's scratch holds at once (`__DX_IMAGES` of them, or as many as it has when `__DX_IMAGES`
/// is 0), the scratch of one image, and the calls that fill the images `group` of `d_input`
/// (`d_inputs`, shared) from `dz` (the batch's output gradient), `packed` (the packed weights)
/// and `zero_row` (`OC` zeros) into the worker's scratch `dx`.
struct DataPath {
    kernel: TokenStream,
    dx_image: TokenStream,
    group: TokenStream,
}

pub fn expand(spec: &Spec) -> TokenStream {
    let data = if gather_applies(spec) {
        gather_kernel(spec)
    } else {
        data_kernel(spec)
    };
    let mut weights = weights_kernel(spec);
    if scatter::applies(spec) {
        weights.extend(scatter::weights(
            &Blocking::new(spec.dtype, spec.out_channels).broadcasts_held(),
        ));
    }
    let pass = backward_pass(spec, &data);
    let data = data.kernel;
    quote! {
        #data
        #weights
        #pass
    }
}

fn data_kernel(spec: &Spec) -> DataPath {
    let rt = rt();
    let null = quote!(::core::ptr::null_mut::<__A>());
    let dzs_array = array_by_loop(
        quote!(__DP),
        quote!(::core::ptr::null::<__A>()),
        "p",
        quote!(if q0 + p < end {
            dz.add((q0 + p) * __OC)
        } else {
            zero_row.as_ptr()
        }),
    );
    let bases_array = array_by_loop(
        quote!(__DP),
        null.clone(),
        "p",
        quote!({
            let q = if q0 + p < end { q0 + p } else { end - 1 };
            let (n, r) = (q / __NPIX - images.start, q % __NPIX);
            let (oh, ow) = (r / __OW, r % __OW);
            dx.add(((n * __XH + oh * __SH) * __XW + ow * __SW) * __IC)
        }),
    );
    let rows_array = array_by_loop(
        quote!(__DP),
        null,
        "p",
        quote!(bases[p].add(kh * __XW * __IC)),
    );
    let segment = spec.kernel[1] * spec.in_c();
    let blk = Blocking::new(spec.dtype, segment);
    let l = blk.lanes;
    let calls = blk.calls("data_tile", false, |tile, first| {
        let dsts = array_by_loop(
            quote!(__DP),
            quote!(::core::ptr::null_mut::<__A>()),
            "p",
            quote!(rows[p].add(#first)),
        );
        quote! {
            let dsts: [*mut __A; __DP] = #dsts;
            #tile::<__S>(&dzs, w.add(kh * __OC * __SEGP + __OC * #first), &dsts);
        }
    });
    let block = lit(blk.v * l);
    let tiles = blk.kinds().into_iter().map(|(nv, last)| {
        let name = format_ident!("__data_tile_{}_{}", nv, last);
        let width = lit(nv * l);
        let init = init_accumulators(blk.p, nv, |_, _| quote!(__S::zero()));
        let step = fma_step(
            blk.p,
            nv,
            |i| {
                let i = lit(i);
                quote!(*dzs[#i].add(oc))
            },
            |v| {
                let off = lit(v * l);
                quote!(w.add(oc * #width + #off))
            },
        );
        let adds = write_accumulators(blk.p, nv, l, last, |acc, i, v, partial| {
            let (i, off) = (lit(i), lit(v * l));
            match partial {
                // Whole-vector load and store, the lanes past the segment written back as
                // read (masked stores are microcoded on AMD CPUs); `dx` has `L` elements of
                // slack past its end for them.
                Some(n) => {
                    let n = lit(n);
                    quote! {
                        let d = dsts[#i].add(#off);
                        let old = __S::load(d);
                        __S::blend_first(old.add(#acc), old, #n).store(d);
                    }
                }
                None => quote! {
                    let d = dsts[#i].add(#off);
                    __S::load(d).add(#acc).store(d);
                },
            }
        });
        quote! {
            /// Adds `W^T . dz` of `DP` pixels into their input row segments (in order: the
            /// segments of neighbouring pixels overlap when the stride is below the kernel).
            #[inline(always)]
            unsafe fn #name<__S: #rt::Simd<Elem = __A>>(
                dzs: &[*const __A; __DP], w: *const __A, dsts: &[*mut __A; __DP],
            ) {
                #init
                for oc in 0..__OC {
                    #step
                }
                #adds
            }
        }
    });
    let kernel = dispatched(
        spec.dtype,
        "data_tiles",
        TokenStream::new(),
        TokenStream::new(),
        quote!(dz: &[__A], w: &[__A], dx: &mut [__A], zero_row: &[__A], images: ::core::ops::Range<usize>),
        quote!(dz, w, dx, zero_row, images),
        quote! {
            ::core::debug_assert!(dz.len() >= __BATCH * __NPIX * __OC && w.len() == __DATA_PACKED_LEN);
            ::core::debug_assert!(dx.len() == images.len() * __XH * __XW * __IC + __L && zero_row.len() >= __OC);
            let (dz, w, dx) = (dz.as_ptr(), w.as_ptr(), dx.as_mut_ptr());
            // Tiles of `DP` pixels over the images' pixels, in order; `dx` holds the images
            // from the first on.
            let (first, end) = (images.start * __NPIX, images.end * __NPIX);
            let mut q0 = first;
            while q0 < end {
                // Pixels past the end of a partial tile read a zero gradient: they add nothing.
                let dzs: [*const __A; __DP] = #dzs_array;
                let bases: [*mut __A; __DP] = #bases_array;
                for kh in 0..__KH {
                    let rows: [*mut __A; __DP] = #rows_array;
                    #calls
                }
                q0 += __DP;
            }
        },
    );
    let (segp, dp) = (lit(blk.padded()), lit(blk.p));
    let packed_len = lit(spec.kernel[0] * spec.out_channels * blk.padded());
    let layout = layout_id(spec, 2);
    let store = if spec.dtype.is_half() {
        quote!(<__T as #rt::Element>::from_acc_slice(src, dst))
    } else {
        quote!(dst.copy_from_slice(src))
    };
    // Where windows overlap, an input gradient sums several pixels' contributions, in the order
    // the tiles reach them: tiles then stay inside one image, so that the order does not depend
    // on which images a worker has. Where they do not, tiles run across a worker's images.
    let overlap = spec.kernel[0] > spec.stride[0] || spec.kernel[1] > spec.stride[1];
    let group = quote! {
        let dx = &mut dx[..group.len() * __XH * __XW * __IC + __L];
        dx.fill(0.0);
        // SAFETY: the slices have the lengths the kernel is built on (checked in debug).
        unsafe { __data_tiles(dz, packed, dx, zero_row, group.clone()) };
        for n in group.clone() {
            // SAFETY: the worker's own images.
            let d_input = unsafe { d_inputs.part(n * __IH * __IW * __IC, __IH * __IW * __IC) };
            let image = &dx[(n - group.start) * __XH * __XW * __IC..];
            for h in 0..__IH {
                let src = &image[((h + __PH) * __XW + __PW) * __IC..][..__IW * __IC];
                let dst = &mut d_input[h * __IW * __IC..][..__IW * __IC];
                #store;
            }
        }
    };
    let images_at_once = lit(usize::from(overlap));
    let kernel = quote! {
        /// Images a worker's input-gradient scratch holds at once (0: all of its images).
        const __DX_IMAGES: usize = #images_at_once;
        const __SEGP: usize = #segp;
        const __DP: usize = #dp;
        const __DATA_PACKED_LEN: usize = #packed_len;
        const __DATA_LAYOUT: u64 = #layout;

        /// OHWI weights -> `[kh][block][oc][lanes of the (kw, ic) segment]`, zero-padded, the
        /// `(kh, block)` pairs dealt to the workers (each a contiguous run of the copy, read and
        /// written in order). Runs once per parameter change.
        fn __pack_data(pool: &#rt::Pool, w: &[__T], out: &mut [__A]) {
            use #rt::Element as _;
            const __BLOCKS: usize = __SEGP.div_ceil(#block);
            let shared = #rt::Shared::new(out);
            pool.split(__KH * __BLOCKS, __OC * #block * 2, &|pairs| {
                for pair in pairs {
                    let (kh, first) = (pair / __BLOCKS, pair % __BLOCKS * #block);
                    // Full blocks are `BLOCK` wide, the last one may be less.
                    let width = if __SEGP - first < #block { __SEGP - first } else { #block };
                    let real = if __SEG - first < width { __SEG - first } else { width };
                    // SAFETY: the pair's run is this worker's alone.
                    let dst = unsafe { shared.part(kh * __OC * __SEGP + __OC * first, __OC * width) };
                    for (oc, row) in dst.chunks_exact_mut(width).enumerate() {
                        let src = &w[(oc * __KH + kh) * __SEG + first..][..real];
                        for (d, s) in row.iter_mut().zip(src) {
                            *d = s.to_acc();
                        }
                        row[real..].fill(0.0);
                    }
                }
            });
        }

        #kernel
        #(#tiles)*
    };
    DataPath {
        kernel,
        // One padded image (and `L` elements of slack past the last for whole-vector stores).
        dx_image: quote!(__XH * __XW * __IC),
        group,
    }
}

/// Accumulators of a gather tile at most.
const GATHER_REGISTERS: usize = 12;

/// Whether the input gradient is gathered (see [`gather_kernel`]): stride 1 and so few input
/// channels that the scatter kernel's vectors would be mostly empty and its overlapping row
/// segments stall on store forwarding, with the accumulators of one pixel in the register budget.
fn gather_applies(spec: &Spec) -> bool {
    let l = spec.dtype.lanes();
    spec.stride == [1, 1]
        && spec.in_c() < l
        && spec.in_c() * spec.out_channels.div_ceil(l) <= GATHER_REGISTERS
}

/// The input gradient of a stride-1 layer with few input channels, gathered:
/// `dx[q][c] = sum over (kh, kw) of W[:, kh, kw, c] . dz[q + PH - kh, q + PW - kw][:]`, each
/// dot product over output channels in vectors, summed across lanes once at the end. `dz` is
/// first copied into a zero-bordered, channel-padded scratch (`ZH x ZW x GOCP`), so every read
/// is a whole vector with no branch; each input pixel is written once, straight into `d_input`.
/// Tiles of `GP` pixels of the flattened batch, `GP x IC x vectors` accumulators.
fn gather_kernel(spec: &Spec) -> DataPath {
    let zs_array = array_by_loop(
        quote!(__GP),
        quote!(::core::ptr::null::<__A>()),
        "p",
        quote!({
            let q = if q0 + p < total { q0 + p } else { total - 1 };
            let (h, x) = (q / __IW, q % __IW);
            zp.add(((h + __PH + __TPH) * __ZW + x + __PW + __TPW) * __GOCP)
        }),
    );
    let rt = rt();
    let l = spec.dtype.lanes();
    let (ic, kv) = (spec.in_c(), spec.out_channels.div_ceil(l));
    // Every load of a step held at once (LLVM hoists them), as in `Blocking::broadcasts_held`:
    // the `IC x vectors` weights, and per pixel its `dz` vectors and `IC x vectors` accumulators
    // (`gather_applies` leaves room for at least the weights).
    let gp = ((VECTOR_REGISTERS - ic * kv) / (kv * (ic + 1))).clamp(1, GATHER_REGISTERS);
    let tph = (spec.kernel[0] - 1).saturating_sub(spec.padding[0]);
    let tpw = (spec.kernel[1] - 1).saturating_sub(spec.padding[1]);
    let consts = usize_consts(&[
        ("TPH", tph),
        ("TPW", tpw),
        ("ZH", spec.out_h() + 2 * tph),
        ("ZW", spec.out_w() + 2 * tpw),
        ("GOCP", kv * l),
        ("GP", gp),
    ]);
    let acc = |p: usize, c: usize, v: usize| format_ident!("acc_{}_{}_{}", p, c, v);
    let mut init = TokenStream::new();
    let mut step = TokenStream::new();
    let mut out = TokenStream::new();
    for p in 0..gp {
        for c in 0..ic {
            for v in 0..kv {
                let a = acc(p, c, v);
                init.extend(quote!(let mut #a = __S::zero();));
            }
        }
    }
    for p in 0..gp {
        let pl = lit(p);
        for v in 0..kv {
            let z = format_ident!("z_{}_{}", p, v);
            let off = lit(v * l);
            step.extend(quote!(let #z = __S::load(zs[#pl].sub(back).add(#off));));
        }
    }
    for c in 0..ic {
        for v in 0..kv {
            let w = format_ident!("w_{}_{}", c, v);
            let off = lit(c * kv * l + v * l);
            step.extend(quote!(let #w = __S::load(wk.add(#off));));
            for p in 0..gp {
                let (a, z) = (acc(p, c, v), format_ident!("z_{}_{}", p, v));
                step.extend(quote!(#a = __S::fma(#z, #w, #a);));
            }
        }
    }
    for p in 0..gp {
        let pl = lit(p);
        for c in 0..ic {
            let sum = (1..kv).fold(acc(p, c, 0).into_token_stream(), |s, v| {
                let a = acc(p, c, v);
                quote!(#s.add(#a))
            });
            let cl = lit(c);
            out.extend(quote! {
                if #pl < valid {
                    *dx.add((q0 + #pl) * __IC + #cl) = <__T as #rt::Element>::from_acc(#sum.sum());
                }
            });
        }
    }
    let kernel_fn = dispatched(
        spec.dtype,
        "gather_tiles",
        TokenStream::new(),
        TokenStream::new(),
        quote!(zp: &[__A], w: &[__A], dx: &mut [__T]),
        quote!(zp, w, dx),
        quote! {
            ::core::debug_assert!(zp.len() == __ZH * __ZW * __GOCP && w.len() == __DATA_PACKED_LEN);
            ::core::debug_assert!(dx.len() == __IH * __IW * __IC);
            let total = __IH * __IW;
            let (zp, w, dx) = (zp.as_ptr(), w.as_ptr(), dx.as_mut_ptr());
            let mut q0 = 0;
            while q0 < total {
                let valid = if total - q0 < __GP { total - q0 } else { __GP };
                // Each pixel's `dz` at kernel offset (0, 0); pixels past the end repeat the last.
                let zs: [*const __A; __GP] = #zs_array;
                #init
                for kh in 0..__KH {
                    for kw in 0..__KW {
                        let back = (kh * __ZW + kw) * __GOCP;
                        let wk = w.add((kh * __KW + kw) * __IC * __GOCP);
                        #step
                    }
                }
                #out
                q0 += __GP;
            }
        },
    );
    let layout = layout_id(spec, 5);
    let kernel = quote! {
        #consts
        /// Images a worker's scratch holds at once: one `dz` padded at a time.
        const __DX_IMAGES: usize = 1;
        const __DATA_PACKED_LEN: usize = __KH * __KW * __IC * __GOCP;
        const __DATA_LAYOUT: u64 = #layout;

        /// OHWI weights -> `[kh][kw][ic][oc padded to GOCP]`, the window positions dealt to
        /// the workers. Once per parameter change.
        fn __pack_data(pool: &#rt::Pool, w: &[__T], out: &mut [__A]) {
            use #rt::Element as _;
            let shared = #rt::Shared::new(out);
            pool.split(__KH * __KW, __IC * __GOCP * 2, &|taps| {
                let (first, len) = (taps.start * __IC * __GOCP, taps.len() * __IC * __GOCP);
                // SAFETY: the rows of the worker's window positions.
                let rows = unsafe { shared.part(first, len) };
                rows.fill(0.0);
                for r in taps {
                    for c in 0..__IC {
                        for k in 0..__OC {
                            rows[(r * __IC + c) * __GOCP + k - first] = w[(k * __KH * __KW + r) * __IC + c].to_acc();
                        }
                    }
                }
            });
        }

        /// One image's `dz` into the zero-bordered, channel-padded `zp`, every element written.
        fn __pad_gradient(dz: &[__A], zp: &mut [__A]) {
            for zh in 0..__ZH {
                let row = &mut zp[zh * __ZW * __GOCP..][..__ZW * __GOCP];
                if zh < __TPH || zh >= __TPH + __OH {
                    row.fill(0.0);
                    continue;
                }
                row[..__TPW * __GOCP].fill(0.0);
                row[(__TPW + __OW) * __GOCP..].fill(0.0);
                let src = &dz[(zh - __TPH) * __OW * __OC..][..__OW * __OC];
                for (dst, src) in row[__TPW * __GOCP..(__TPW + __OW) * __GOCP]
                    .chunks_exact_mut(__GOCP)
                    .zip(src.chunks_exact(__OC))
                {
                    dst[..__OC].copy_from_slice(src);
                    dst[__OC..].fill(0.0);
                }
            }
        }

        #kernel_fn
    };
    DataPath {
        kernel,
        dx_image: quote!(__ZH * __ZW * __GOCP),
        group: quote! {
            let _ = zero_row;
            for n in group {
                __pad_gradient(&dz[n * __NPIX * __OC..][..__NPIX * __OC], dx);
                // SAFETY: the worker's own image; the slices have the lengths the kernel is
                // built on (checked in debug).
                unsafe {
                    let d_input = d_inputs.part(n * __IH * __IW * __IC, __IH * __IW * __IC);
                    __gather_tiles(&dx[..__ZH * __ZW * __GOCP], packed, d_input);
                }
            }
        },
    }
}

fn weights_kernel(spec: &Spec) -> TokenStream {
    let offs_array = array_by_loop(
        quote!(__WP),
        quote!(0),
        "i",
        quote!({
            let r = if r0 + i < __WINDOW {
                r0 + i
            } else {
                __WINDOW - 1
            };
            (r / __SEG) * __XW * __IC + r % __SEG
        }),
    );
    let rows_array = array_by_loop(
        quote!(__WP),
        quote!(::core::ptr::null_mut::<__A>()),
        "i",
        quote!({
            let row = if r0 + i < __WINDOW { r0 + i } else { __WINDOW };
            dw.add((row - first_row) * __OCP)
        }),
    );
    let rt = rt();
    let blk = Blocking::new(spec.dtype, spec.out_channels).broadcasts_held();
    let wp = lit(blk.p);
    let l = blk.lanes;
    let calls = blk.calls("weight_tile", false, |tile, first| {
        let dsts = array_by_loop(
            quote!(__WP),
            quote!(::core::ptr::null_mut::<__A>()),
            "i",
            quote!(rows[i].add(#first)),
        );
        quote! {
            let dsts: [*mut __A; __WP] = #dsts;
            #tile::<__S>(x, &xoff[..count], &offs, dz.add(q0 * __OC + #first), &dsts, q0 == 0);
        }
    });
    let tiles = blk.kinds().into_iter().map(|(nv, last)| {
        let name = format_ident!("__weight_tile_{}_{}", nv, last);
        // The first chunk starts from zero instead of cleared rows.
        let init = init_accumulators(blk.p, nv, |i, v| {
            let (i, off) = (lit(i), lit(v * l));
            quote!(if fresh { __S::zero() } else { __S::load(dsts[#i].add(#off)) })
        });
        let step = fma_step(
            blk.p,
            nv,
            |i| {
                let i = lit(i);
                quote!(*xq.add(offs[#i]))
            },
            |v| {
                let off = lit(v * l);
                quote!(dzq.add(#off))
            },
        );
        // Rows are `OCP` wide, so every vector stores whole; lanes past `OC` collect values
        // of the next pixel's gradient and are never read.
        let stores = write_accumulators(blk.p, nv, l, l, |acc, i, v, _| {
            let (i, off) = (lit(i), lit(v * l));
            quote!(#acc.store(dsts[#i].add(#off));)
        });
        quote! {
            /// Adds `x[pixel + offs[i]] * dz[pixel]` over the chunk's pixels into `P` rows (writes
            /// them when `fresh`).
            #[inline(always)]
            unsafe fn #name<__S: #rt::Simd<Elem = __A>>(
                x: *const __A, xoff: &[usize], offs: &[usize; __WP], dz: *const __A,
                dsts: &[*mut __A; __WP], fresh: bool,
            ) {
                #init
                for (k, &o) in xoff.iter().enumerate() {
                    let (xq, dzq) = (x.add(o), dz.add(k * __OC));
                    #step
                }
                #stores
            }
        }
    });
    let kernel = dispatched(
        spec.dtype,
        "weight_tiles",
        TokenStream::new(),
        TokenStream::new(),
        quote!(x: &[__A], dz: &[__A], dw: #rt::Shared<'_, __A>, blocks: ::core::ops::Range<usize>),
        quote!(x, dz, dw, blocks),
        quote! {
            ::core::debug_assert!(x.len() >= __BATCH * __XH * __XW * __IC);
            ::core::debug_assert!(dz.len() >= __BATCH * __NPIX * __OC + (__OCP - __OC) && dw.len() == (__WINDOW + 1) * __OCP);
            let total = __BATCH * __NPIX;
            // The rows of this worker's position blocks (the sink row with the last block).
            let first_row = blocks.start * __WP;
            let end_row = if blocks.end * __WP < __WINDOW { blocks.end * __WP } else { __WINDOW + 1 };
            let rows_part = dw.part(first_row * __OCP, (end_row - first_row) * __OCP);
            let (x, dz, dw) = (x.as_ptr(), dz.as_ptr(), rows_part.as_mut_ptr());
            let mut q0 = 0;
            while q0 < total {
                let count = if total - q0 < __CHUNK { total - q0 } else { __CHUNK };
                let mut xoff = [0usize; __CHUNK];
                for (k, o) in xoff[..count].iter_mut().enumerate() {
                    let (n, r) = ((q0 + k) / __NPIX, (q0 + k) % __NPIX);
                    let (oh, ow) = (r / __OW, r % __OW);
                    *o = ((n * __XH + oh * __SH) * __XW + ow * __SW) * __IC;
                }
                let mut r0 = blocks.start * __WP;
                while r0 < blocks.end * __WP {
                    // Positions past the window repeat the last one into the sink row.
                    let offs: [usize; __WP] = #offs_array;
                    let rows: [*mut __A; __WP] = #rows_array;
                    #calls
                    r0 += __WP;
                }
                q0 += __CHUNK;
            }
        },
    );
    let chunk = lit(CHUNK);
    quote! {
        const __CHUNK: usize = #chunk;
        const __WP: usize = #wp;
        /// Blocks of `WP` window positions: the weight gradient's parts (each sums over every
        /// pixel in order, so the partition does not change the results).
        const __WBLOCKS: usize = __WINDOW.div_ceil(__WP);
        /// Window positions per kernel row (`KW * IC`, contiguous in NHWC).
        const __SEG: usize = __KW * __IC;
        #kernel
        #(#tiles)*
    }
}

/// Whether the gradient at the convolution's output is the output gradient itself, read in
/// place instead of copied into scratch: no activation or norm, the element type is the
/// accumulator's, and whole vectors of output channels, so the weight kernel's loads end at the
/// last pixel's channels (the copy was 2% of the IMPALA network's training step).
fn dz_in_place(spec: &Spec) -> bool {
    super::output_is_pre_activation(spec)
        && matches!(spec.dtype, Dtype::F32 | Dtype::F64)
        && spec
            .out_channels
            .is_multiple_of(Blocking::new(spec.dtype, spec.out_channels).lanes)
}

/// `backward_pass`: the output gradient through activation and norm (`d_conv`), then the bias,
/// weight and input gradients that were asked for, each on the device's threads: the weight
/// gradient by blocks of window positions, the input gradient by images.
fn backward_pass(spec: &Spec, path: &DataPath) -> TokenStream {
    let rt = rt();
    let input = if staged(spec) {
        quote! {
            if !sparse {
                __stage::<{ __BATCH }>(pool, x, x_scratch);
            }
            let xa: &[__A] = x_scratch;
        }
    } else {
        quote!(let xa: &[__A] = x;)
    };
    let DataPath {
        dx_image, group, ..
    } = path;
    let bias = bias_gradient();
    let dz = if dz_in_place(spec) {
        quote! {
            let _ = (&dz, state, mode);
            let dz: &[__A] = d_output;
        }
    } else {
        quote! {
            // `dz` has `L` zeros past its end for the weight kernel's whole-vector loads.
            dz[__BATCH * __NPIX * __OC..].fill(0.0);
            __d_conv(pool, layer, state, d_output, mode, grads.as_deref_mut(), &mut dz[..__BATCH * __NPIX * __OC]);
            let dz: &[__A] = dz;
        }
    };
    let in_place = dz_in_place(spec);
    let weight_call = if scatter::applies(spec) {
        quote! {
            if sparse {
                #[cfg(target_arch = "x86_64")]
                __scatter_weights(x, dz, dw, blocks);
            } else {
                __weight_tiles(xa, dz, dw, blocks);
            }
        }
    } else {
        quote!({
            let _ = sparse;
            __weight_tiles(xa, dz, dw, blocks)
        })
    };
    pass_fn(
        spec,
        quote! {
            /// `dz` is the output gradient itself, read in place (see `dz_in_place`).
            const __DZ_IN_PLACE: bool = #in_place;
            let (data, weights) = (d_input.is_some(), grads.is_some());
            let (key, packed_len) = if data {
                let stamps = [layer.weights.stamp(), 0];
                (#rt::PackKey { stamps, layout: __DATA_LAYOUT }, __DATA_PACKED_LEN)
            } else {
                (#rt::PackKey { stamps: [0, 0], layout: 0 }, 0)
            };
            let work = __BATCH * __NPIX * __WINDOW * __OCP;
            // The input gradient's scratch per worker: `__DX_IMAGES` images, or all of its own.
            let workers = cpu.__pool().workers(__BATCH, work);
            let images = if __DX_IMAGES == 0 { __BATCH.div_ceil(workers) } else { __DX_IMAGES };
            let dx_per_worker = images * (#dx_image) + __L;
            let dx_len = if data { workers * dx_per_worker } else { 0 };
            let dw_len = if weights { (__WINDOW + 1) * __OCP } else { 0 };
            let x_len = if weights && __STAGED { __BATCH * __XH * __XW * __IC } else { 0 };
            let dz_len = if __DZ_IN_PLACE { 0 } else { __BATCH * __NPIX * __OC + __L };
            let lens = dz_len + __OC + dx_len + dw_len + x_len;
            let #rt::Workspace { packed, scratch, pool } = cpu.__workspace::<__A>(
                key,
                packed_len,
                |pool, out| {
                    if data {
                        __pack_data(pool, layer.weights.as_slice(), out)
                    }
                },
                lens,
            );
            let (dz, rest) = scratch.split_at_mut(dz_len);
            let (zero_row, rest) = rest.split_at_mut(__OC);
            let (dxs, rest) = rest.split_at_mut(dx_len);
            let (dw, x_scratch) = rest.split_at_mut(dw_len);
            // Scratch is not cleared by the device: zero what is accumulated into or read as 0.
            zero_row.fill(0.0);
            let zero_row: &[__A] = zero_row;
            #dz

            if let ::core::option::Option::Some(g) = grads {
                // Mostly zero inputs take the scatter pass: the same results
                // (`expand::scatter`).
                let sparse = __scattered(x);
                #input
                #bias
                let dw = #rt::Shared::new(dw);
                pool.run(__WBLOCKS, work, &|_, blocks| {
                    // SAFETY: the worker's own rows (written by the first chunk: scratch is not
                    // cleared), the slices have the lengths the kernel is built on (checked in
                    // debug).
                    unsafe { #weight_call };
                });
                // SAFETY: the workers are done.
                let dw: &[__A] = unsafe { dw.part(0, dw.len()) };
                // `dw` is `[window][OCP]`, the gradient `[OC][window]`: transposed in blocks of
                // 16 window positions (whose `dw` rows stay in L1), the channels dealt to the
                // workers.
                let gw = #rt::Shared::new(g.weights.as_mut_slice());
                pool.split(__OC, __WINDOW * #rt::ELEMENT_WORK, &|channels| {
                    for r0 in (0..__WINDOW).step_by(16) {
                        let n = if __WINDOW - r0 < 16 { __WINDOW - r0 } else { 16 };
                        for c in channels.clone() {
                            // SAFETY: channel `c`'s row is this worker's alone.
                            let row = unsafe { gw.part(c * __WINDOW + r0, n) };
                            for (i, v) in row.iter_mut().enumerate() {
                                *v += dw[(r0 + i) * __OCP + c];
                            }
                        }
                    }
                });
            }

            if let ::core::option::Option::Some(d_input) = d_input {
                let (d_inputs, dxs) = (#rt::Shared::new(d_input), #rt::Shared::new(dxs));
                pool.run(__BATCH, work, &|worker, mine| {
                    // SAFETY: the worker's own scratch.
                    let dx = unsafe { dxs.part(worker * dx_per_worker, dx_per_worker) };
                    let mut start = mine.start;
                    while start < mine.end {
                        let step = if __DX_IMAGES == 0 { mine.len() } else { __DX_IMAGES };
                        let end = if start + step < mine.end { start + step } else { mine.end };
                        let group = start..end;
                        #group
                        start = end;
                    }
                });
            }
        },
    )
}

/// `backward_pass(cpu, layer, state, x, d_output, d_input, grads, mode)` with `body`: the one
/// signature the direct and Winograd backward passes share.
pub fn pass_fn(spec: &Spec, body: TokenStream) -> TokenStream {
    let rt = rt();
    let Names {
        layer,
        grads,
        state,
        ..
    } = Names::of(spec);
    quote! {
        #[allow(clippy::too_many_arguments)]
        fn __backward_pass(
            cpu: &mut #rt::Cpu,
            layer: &#layer,
            state: &#state,
            x: &[__T],
            d_output: &[__T],
            d_input: ::core::option::Option<&mut [__T]>,
            mut grads: ::core::option::Option<&mut #grads>,
            mode: #rt::Mode,
        ) {
            #body
        }
    }
}

/// Adds the output gradient `dz` (`BATCH * NPIX * OC` first elements) summed over pixels into
/// the bias gradient of `g`: per reduction part on the pool's threads, then in part order.
pub fn bias_gradient() -> TokenStream {
    let rt = rt();
    quote! {
        let mut partial = [[0.0 as __A; __OC]; __RPARTS];
        {
            let sums = #rt::Shared::new(&mut partial[..]);
            pool.each(__RPARTS, __BATCH * __NPIX * __OC * #rt::ELEMENT_WORK, &|p| {
                // SAFETY: each part's own partial.
                let sum = &mut unsafe { sums.part(p, 1) }[0];
                let rows = __part_rows(p);
                #rt::sums::add_channels(&dz[rows.start * __OC..rows.end * __OC], sum);
            });
        }
        let sum = __sum_parts(&partial);
        let db = g.biases.as_mut_slice();
        for c in 0..__OC {
            db[c] += sum[c];
        }
    }
}
