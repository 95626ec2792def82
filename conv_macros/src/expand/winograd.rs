//! Generated Winograd CPU code for layers with enough channels, f32 or half precision (computed
//! in f32): F(2x2, 3x3) or F(4x4, 3x3) for stride-1 3x3 layers, F(2x2, 3x3) at stride 2 for
//! stride-2 3x3 layers (per axis F(2, 2) over the outer taps and the middle tap as it is, input
//! tiles `WSTEP = 2 * WM` apart), and F(3x3, 2x2) or F(5x5, 2x2) for layers whose kernel is
//! twice their stride (the Atari network's 8x8 stride-4 first layer and 4x4 stride-2 second),
//! which are 2x2 stride-1 convolutions of the input rearranged space-to-depth (each `s x s` block
//! of pixels one pixel of `s * s` times the channels). Per output tile and (staged) channel
//! pair, `WN * WN` multiplies (16, 25 or 36) where the direct convolution does 36, 100 (F(5x5,
//! 2x2)) or 144 (F(4x4, 3x3)).
//!
//! The batch's output is cut into `WM x WM` tiles, taken a chunk of whole tile rows at a time (so
//! each chunk's outputs are one contiguous pixel range, handed to the epilogue while in cache):
//! - forward: input tiles -> `V[e][tile][ic]` (runtime `winograd::tiles::Input`), `WN * WN` products
//!   `M[e] = V[e] . U[e]` with the register-blocked tiles of [`super::kernel`], then bias,
//!   ReLU and the output tiles (`winograd::tiles::Output`). `U[e][block][ic][lanes]` (`G g G^T`) is
//!   packed once per parameter change like the direct kernel's weights;
//! - backward: output-gradient tiles -> `N[e][tile][oc]`; the weight gradient accumulates
//!   `dU[e] += V[e]^T . N[e]` over the batch and is transformed back once; the input gradient is
//!   `dV[e] = N[e] . U[e]^T` (from a second packed copy, `[e][block][oc][lanes]`) added into the
//!   overlapping input tiles (`winograd::tiles::InputGradient`).
//!
//! f32 layers without space-to-depth read each tile's input window in place, border windows
//! through a zero-padded copy (`DIRECT_INPUT`). Otherwise each image is staged (space-to-depth,
//! or converted from a half type) in a zero-bordered copy as large as the whole tiles read, when
//! the first chunk reaches it, in one of `SLOTS` buffers that stay in cache. The input gradient
//! is stored where no earlier tile reached and added where tiles overlap: in place, each tile
//! clipped to the image, where tiles read the input in place; otherwise in such a slot, copied
//! out when the image's last chunk is done. Outputs of tiles past the
//! last row or column are not stored, and their gradients are zero. `WIC` is the staged image's channel
//! count (`IC`, or `SD * SD * IC` space-to-depth).

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use super::cpu::{activation_type, layout_id};
use super::kernel::{
    array_by_loop, dispatched, fma_step, init_accumulators, write_accumulators, Blocking,
};
use super::{lit, rt, usize_consts};
use crate::spec::{Activation, Dtype, Norm, Spec};

/// Tiles per chunk at most, and the size aimed at. Small chunks keep the chunk's transforms
/// (`16 * tiles * channels` each) in cache next to the transformed weights; measured on the
/// benchmark's shapes, 12 tiles beat 24 and 48 by 10-20% (Atari layer 3), and a chunk that
/// fills whole register tiles beats a smaller one that does not (ResNet: 84 over 28).
const MAX_TILES: usize = 96;
const TARGET_TILES: usize = 12;

/// How many times more multiplies a plan with larger tiles must save than the one with smaller
/// tiles of the same kernel to be taken over it.
const LARGER_TILES: f64 = 1.2;

/// The Winograd algorithm a spec runs on.
#[derive(Clone, Copy)]
pub struct Plan {
    /// Input tile size.
    n: usize,
    /// Output tile size.
    m: usize,
    /// Kernel size (of the staged input).
    r: usize,
    /// The convolution's stride over the staged input: input tiles start `stride * m` apart.
    stride: usize,
    /// Space-to-depth factor of the staged input (the layer's stride).
    sd: usize,
    /// The runtime's `winograd::Variant`.
    variant: &'static str,
    /// Fewest multiplies saved (`gain`) for which the transforms pay.
    min_gain: f64,
}

impl Plan {
    const F2X3: Plan = Plan {
        n: 4,
        m: 2,
        r: 3,
        stride: 1,
        sd: 1,
        variant: "F2x3",
        min_gain: 1.5,
    };
    const F4X3: Plan = Plan {
        n: 6,
        m: 4,
        r: 3,
        stride: 1,
        sd: 1,
        variant: "F4x3",
        min_gain: 1.5,
    };
    const F2X3S2: Plan = Plan {
        n: 5,
        m: 2,
        r: 3,
        stride: 2,
        sd: 1,
        variant: "F2x3S2",
        // Additions only, and the middle tap untransformed: at 1.44x (the most it saves, on
        // 8x8 outputs) the BatchNorm benchmark layer's training step took 0.83x the direct one's.
        min_gain: 1.4,
    };

    /// F(3x3, 2x2) on the input rearranged space-to-depth by `sd`: a `2 sd x 2 sd` kernel at
    /// stride `sd` is a 2x2 stride-1 convolution of `sd * sd` times the channels (the Atari
    /// network's first layer, 8x8 stride 4, and its second, 4x4 stride 2).
    const fn f3x2(sd: usize) -> Plan {
        Plan {
            n: 4,
            m: 3,
            r: 2,
            stride: 1,
            sd,
            variant: "F3x2",
            min_gain: 1.5,
        }
    }

    /// F(5x5, 2x2) on the same space-to-depth input: fewer multiplies where the outputs fill
    /// 5x5 tiles better than 3x3 ones (the Atari network's 20x20 first layer: 16 tiles of 36
    /// multiplies against 49 of 16), at the price of F(4x4, 3x3)'s transforms and rounding.
    const fn f5x2(sd: usize) -> Plan {
        Plan {
            n: 6,
            m: 5,
            r: 2,
            stride: 1,
            sd,
            variant: "F5x2",
            min_gain: 1.5,
        }
    }

    /// `self`, or `larger` (larger tiles of the same kernel) where it saves [`LARGER_TILES`]
    /// times more multiplies: its transforms cost more, and its rounding error is larger.
    fn or_larger(self, larger: Plan, spec: &Spec) -> Plan {
        if larger.gain(spec) >= LARGER_TILES * self.gain(spec) {
            larger
        } else {
            self
        }
    }

    /// Direct multiplies over Winograd multiplies for the spec's output, the outputs of
    /// ragged tiles computed for nothing counted.
    fn gain(self, spec: &Spec) -> f64 {
        let (oh, ow, m) = (spec.out_h(), spec.out_w(), self.m);
        let direct = spec.kernel[0] * spec.kernel[1] * oh * ow;
        // Per input channel: space-to-depth has `sd * sd` staged channels for each.
        let winograd = self.n * self.n * oh.div_ceil(m) * ow.div_ceil(m) * self.sd * self.sd;
        direct as f64 / winograd as f64
    }
}

/// The spec's Winograd plan, if it runs on these kernels: f32 (or a half type, computed in
/// f32; f64 layers keep the direct sums), 3x3 at stride 1 or 2, or a kernel twice its stride,
/// channel counts (of the staged input) in whole vectors of at least two, and at least 1.5x
/// fewer multiplies than the direct kernel. Stride-1 layers take F(4x4, 3x3) where it saves
/// [`LARGER_TILES`] times more than F(2x2, 3x3), space-to-depth layers F(5x5, 2x2) where it
/// does against F(3x3, 2x2).
pub fn plan(spec: &Spec) -> Option<Plan> {
    let lanes = spec.dtype.lanes();
    let channels = |c: usize| c.is_multiple_of(lanes) && c >= 2 * lanes;
    let plan = match (spec.kernel, spec.stride) {
        ([3, 3], [1, 1]) => Plan::F2X3.or_larger(Plan::F4X3, spec),
        ([k, kw], [sd, sw]) if k == kw && sd == sw && sd >= 2 && k == 2 * sd => {
            Plan::f3x2(sd).or_larger(Plan::f5x2(sd), spec)
        }
        ([3, 3], [2, 2]) => Plan::F2X3S2,
        _ => return None,
    };
    let fits = spec.dtype != Dtype::F64
        && channels(plan.sd * plan.sd * spec.in_c())
        && channels(spec.out_channels)
        && plan.gain(spec) >= plan.min_gain;
    fits.then_some(plan)
}

/// Parts of the backward pass: whole images each, with a weight-gradient partial (`dU`,
/// `U_LEN` values) of their own, summed in part order at the end, so that the results do not
/// depend on the thread count. A power of two (threads usually are), at most 8 and at most one
/// per 64 tiles: summing the partials reads `parts * U_LEN` values, which must stay small
/// beside the products' `tiles * U_LEN` multiply-adds.
fn weight_parts(spec: &Spec, plan: Plan) -> usize {
    let tiles = spec.batch * spec.out_h().div_ceil(plan.m) * spec.out_w().div_ceil(plan.m);
    let most = spec.batch.min(8).min((tiles / 64).max(1));
    1 << most.ilog2()
}

/// Tile rows per chunk: the fewest rows missing from the products' last register tile of `P`
/// rows (a narrower tile, run for the rows left), then the chunk nearest `TARGET_TILES`.
fn chunk_rows(spec: &Spec, plan: Plan) -> usize {
    let (th, tw) = (spec.out_h().div_ceil(plan.m), spec.out_w().div_ceil(plan.m));
    let p = Blocking::new(spec.dtype, spec.out_channels).p;
    let max = (MAX_TILES / tw).clamp(1, spec.batch * th);
    (1..=max)
        .min_by_key(|&rows| {
            let tiles = rows * tw;
            // Waste in parts per thousand, then the distance to the target.
            let waste = (tiles.next_multiple_of(p) - tiles) * 1000 / tiles;
            (waste, tiles.abs_diff(TARGET_TILES))
        })
        .unwrap_or(1)
}

/// Tile geometry as constants: `WM x WM` output tiles, `WTH x WTW` of them per image, the
/// staged `WH x WW x WIC` image (space-to-depth by `SD`), chunks of `WROWS` tile rows, `WCT`
/// tiles each (the rows of a chunk's transforms and products); `WV` the runtime's variant.
fn constants(spec: &Spec, plan: Plan) -> TokenStream {
    let rt = rt();
    let (m, sd) = (plan.m, plan.sd);
    let (th, tw) = (spec.out_h().div_ceil(m), spec.out_w().div_ceil(m));
    let rows = chunk_rows(spec, plan);
    let wic = sd * sd * spec.in_c();
    let step = plan.stride * m;
    let direct = sd == 1 && !spec.dtype.is_half();
    let (wh, ww) = (step * th + plan.n - step, step * tw + plan.n - step);
    let slots = (rows - 1).div_ceil(th) + 1;
    let consts = usize_consts(&[
        ("WM", m),
        ("WN", plan.n),
        ("WR", plan.r),
        ("WSTEP", step),
        ("SD", sd),
        ("WIC", wic),
        ("WTH", th),
        ("WTW", tw),
        ("WH", wh),
        ("WW", ww),
        // Input rows and columns the staged image holds: the ones past it feed no output.
        (
            "SIH",
            spec.in_h().min((sd * wh).saturating_sub(spec.padding[0])),
        ),
        (
            "SIW",
            spec.in_w().min((sd * ww).saturating_sub(spec.padding[1])),
        ),
        ("WROWS", rows),
        // Staged images a chunk can touch: each is staged (and its input gradient begun) when
        // a chunk first reaches it, in slot `image % SLOTS`, so the staged copies stay in cache.
        ("SLOTS", slots),
        ("WCT", rows * tw),
        ("ELEMS", plan.n * plan.n),
        ("IMAGE", spec.in_h() * spec.in_w() * spec.in_c()),
        ("STAGED_IMAGE", wh * ww * wic),
        // Scratch for the input: a border window, or the staged slots.
        (
            "XS_LEN",
            if direct {
                plan.n * plan.n * wic
            } else {
                slots * wh * ww * wic
            },
        ),
        ("U_LEN", plan.n * plan.n * wic * spec.out_channels),
    ]);
    let variant = format_ident!("{}", plan.variant);
    quote! {
        /// Whether tiles read the input in place (border windows from a zero-padded copy)
        /// rather than from staged slots: in the accumulator type, without space-to-depth.
        const __DIRECT_INPUT: bool = #direct;
        #consts
        type __WV = #rt::winograd::#variant;
    }
}

/// The forward convolution (`conv`, the same signature as the direct kernel's), the staging
/// and the packing.
pub fn forward(spec: &Spec, plan: Plan) -> TokenStream {
    let rt = rt();
    let layer = &spec.ident;
    let (oc_blk, ic_blk) = (
        Blocking::new(spec.dtype, spec.out_channels),
        Blocking::new(spec.dtype, plan.sd * plan.sd * spec.in_c()),
    );
    let consts = constants(spec, plan);
    let layout = layout_id(spec, 3);
    let gemm = product("__wino_gemm", &oc_blk, quote!(__WIC), quote!(__OC));
    let tiles = gemm_tiles(spec, &[&oc_blk, &ic_blk]);
    let helpers = helpers();
    // OHWI weights -> `U[e][block of OC][staged channel][lanes]` (the biases follow, copied by
    // the caller). Once per parameter change.
    let pack = packer("__pack_wino", true, oc_blk.v * oc_blk.lanes);
    let kernel = dispatched(
        spec.dtype,
        "wino_tiles",
        TokenStream::new(),
        TokenStream::new(),
        quote! {
            x: &[__T], xs: &mut [__A], u: &[__A], v: &mut [__A], m: &mut [__A], y: #rt::Shared<'_, __A>,
            epilogue: &(dyn ::core::ops::Fn(&mut [__A], usize, usize) + ::core::marker::Sync),
            then: &(dyn ::core::ops::Fn(usize, usize) + ::core::marker::Sync),
            tile_rows: ::core::ops::Range<usize>, relu: bool,
        },
        quote!(x, xs, u, v, m, y, epilogue, then, tile_rows, relu),
        quote! {
            // The batch and the ReLU are arguments, not constants: one instantiation serves
            // every call of the layer.
            ::core::debug_assert!(x.len() % __IMAGE == 0 && xs.len() >= __XS_LEN);
            ::core::debug_assert!(u.len() == __U_LEN + __OC);
            ::core::debug_assert!(v.len() >= __ELEMS * __WCT * __WIC && m.len() >= __ELEMS * __WCT * __OC);
            ::core::debug_assert!(y.len() == x.len() / __IMAGE * __NPIX * __OC);
            let (u, vp, mp) = (u.as_ptr(), v.as_mut_ptr(), m.as_mut_ptr());
            let bias = u.add(__U_LEN);
            // This worker's tile rows, in chunks from its first: the first stages the image it
            // starts in.
            let (mut r0, end) = (tile_rows.start, tile_rows.end);
            let mut staged = r0 / __WTH;
            while r0 < end {
                let rows = if end - r0 < __WROWS { end - r0 } else { __WROWS };
                let count = rows * __WTW;
                // The chunk's whole tile rows are one contiguous range of output pixels.
                let last = r0 + rows - 1;
                let first = r0 / __WTH * __NPIX + __WM * (r0 % __WTH) * __OW;
                let end_row = if __WM * (last % __WTH) + __WM < __OH { __WM * (last % __WTH) + __WM } else { __OH };
                let end_pixel = last / __WTH * __NPIX + end_row * __OW;
                // SAFETY: the chunks of the workers are disjoint.
                let yt = y.part(first * __OC, (end_pixel - first) * __OC);
                while !__DIRECT_INPUT && staged <= (r0 + rows - 1) / __WTH {
                    let slot = &mut xs[staged % __SLOTS * __STAGED_IMAGE..][..__STAGED_IMAGE];
                    __wino_stage(&x[staged * __IMAGE..][..__IMAGE], slot);
                    staged += 1;
                }
                let source = if __DIRECT_INPUT { x.as_ptr() as *const __A } else { xs.as_ptr() };
                __wino_input::<__S>(source, xs.as_mut_ptr(), vp, r0, count);
                __wino_gemm::<__S>(vp, u, mp, count);
                let yp = yt.as_mut_ptr();
                for t in 0..count {
                    let (g, tw) = (r0 + t / __WTW, t % __WTW);
                    let (n, th) = (g / __WTH, g % __WTH);
                    let (oh, ow) = (__WM * th, __WM * tw);
                    let base = yp.add(((n * __OH + oh) * __OW + ow - first) * __OC);
                    // The tile's rows and columns inside the output.
                    let down = if __OH - oh < __WM { __OH - oh } else { __WM };
                    let right = if __OW - ow < __WM { __OW - ow } else { __WM };
                    // All of the tile's channels in one call: on AVX-512, 16 lanes at a time
                    // (`conv_runtime::wide`; lane-wise, so the same bits); here and below.
                    let out = #rt::winograd::tiles::Output {
                        m: mp.add(t * __OC), stride: __WCT * __OC, bias, y: base,
                        row: __OW * __OC, col: __OC, extent: (down, right), relu,
                    };
                    __S::channels::<__WV, _>(&out, __OC);
                }
                epilogue(yt, first, end_pixel - first);
                then(first, end_pixel - first);
                r0 += rows;
            }
        },
    );
    quote! {
        #consts

        /// Copies one image into `xs` (`WH * WW * WIC`, space-to-depth by `SD`: padded pixel
        /// `(h, w)` goes to `(h / SD, w / SD)`, channel block `(h % SD) * SD + w % SD`) inside a
        /// zero border that covers every tile.
        fn __wino_stage(x: &[__T], xs: &mut [__A]) {
            // Zeros where the input does not cover the staged image: the border rows and
            // columns without space-to-depth, everything with it unless the input covers all
            // of it (as for the Atari network's second layer).
            if __SD == 1 {
                xs[..__PH * __WW * __WIC].fill(0.0);
                xs[(__PH + __SIH) * __WW * __WIC..].fill(0.0);
                for h in __PH..__PH + __SIH {
                    let row = &mut xs[h * __WW * __WIC..][..__WW * __WIC];
                    row[..__PW * __WIC].fill(0.0);
                    row[(__PW + __SIW) * __WIC..].fill(0.0);
                }
            } else if __PH + __PW > 0 || __IH != __SD * __WH || __IW != __SD * __WW {
                xs.fill(0.0);
            }
            for h in 0..__SIH {
                let (h2, dy) = ((h + __PH) / __SD, (h + __PH) % __SD);
                if __SD == 1 {
                    let src = &x[h * __IW * __IC..][..__SIW * __IC];
                    let dst = &mut xs[(h2 * __WW + __PW) * __IC..][..__SIW * __IC];
                    <__T as #rt::Element>::to_acc_slice(src, dst);
                    continue;
                }
                for w in 0..__SIW {
                    let (w2, dx) = ((w + __PW) / __SD, (w + __PW) % __SD);
                    let src = &x[(h * __IW + w) * __IC..][..__IC];
                    let block = (dy * __SD + dx) * __IC;
                    let dst = &mut xs[(h2 * __WW + w2) * __WIC + block..][..__IC];
                    <__T as #rt::Element>::to_acc_slice(src, dst);
                }
            }
        }

        /// The staged gradient of one image back to NHWC (`wino_stage` inverted); inputs past
        /// the staged image feed no output.
        fn __wino_unstage(dx: &[__A], d_input: &mut [__T]) {
            let zero = <__T as #rt::Element>::zero();
            for h in 0..__IH {
                let row = &mut d_input[h * __IW * __IC..][..__IW * __IC];
                if h >= __SIH {
                    row.fill(zero);
                    continue;
                }
                row[__SIW * __IC..].fill(zero);
                let (h2, dy) = ((h + __PH) / __SD, (h + __PH) % __SD);
                if __SD == 1 {
                    let src = &dx[(h2 * __WW + __PW) * __IC..][..__SIW * __IC];
                    <__T as #rt::Element>::from_acc_slice(src, &mut row[..__SIW * __IC]);
                    continue;
                }
                for w in 0..__SIW {
                    let (w2, dx_) = ((w + __PW) / __SD, (w + __PW) % __SD);
                    let block = (dy * __SD + dx_) * __IC;
                    let src = &dx[(h2 * __WW + w2) * __WIC + block..][..__IC];
                    <__T as #rt::Element>::from_acc_slice(src, &mut row[w * __IC..][..__IC]);
                }
            }
        }

        /// The rows (or columns) of a tile at staged row `s` that hold inputs the staged image
        /// holds (`held` of them after `pad` rows of padding).
        #[inline(always)]
        fn __wino_clip(s: usize, pad: usize, held: usize) -> ::core::ops::Range<usize> {
            let end = (held + pad).saturating_sub(s);
            pad.saturating_sub(s)..if end < __WN { end } else { __WN }
        }

        /// Zeros over the inputs past the staged image (they feed no output), where the
        /// input gradient is written in place: no tile reaches them.
        fn __wino_unreached(d_input: &mut [__T]) {
            if __SIH == __IH && __SIW == __IW {
                return;
            }
            let zero = <__T as #rt::Element>::zero();
            for h in 0..__IH {
                let row = &mut d_input[h * __IW * __IC..][..__IW * __IC];
                let from = if h >= __SIH { 0 } else { __SIW * __IC };
                row[from..].fill(zero);
            }
        }

        /// Convolution + bias of `B` images into `ya` (`None`: scratch), with
        /// `epilogue(results, first pixel, pixels)` run on each chunk while it is in cache, on
        /// the device's threads (tile rows dealt in contiguous ranges, each worker with its own
        /// scratch), then `then(first pixel, pixels)` once the chunk is final. `RELU` applies
        /// ReLU in registers.
        #[inline(always)]
        fn __conv<const __B: usize, const __RELU: bool>(
            cpu: &mut #rt::Cpu,
            layer: &#layer,
            x: &[__T],
            ya: ::core::option::Option<#rt::Shared<'_, __A>>,
            epilogue: &(dyn ::core::ops::Fn(&mut [__A], usize, usize) + ::core::marker::Sync),
            then: &(dyn ::core::ops::Fn(usize, usize) + ::core::marker::Sync),
        ) {
            let key = #rt::PackKey {
                stamps: [layer.weights.stamp(), layer.biases.stamp()],
                layout: #layout,
            };
            // One part per worker, of whole tile rows: every output is computed alone, so the
            // partition does not change the results.
            let rows = __B * __WTH;
            let work = __B * __NPIX * __WINDOW * __OC;
            let parts = cpu.__pool().workers(rows, work);
            const __SCRATCH: usize = __XS_LEN + __ELEMS * __WCT * (__WIC + __OC);
            let y_scratch = if ya.is_some() { 0 } else { __B * __NPIX * __OC };
            let ws = cpu.__workspace::<__A>(
                key,
                __U_LEN + __OC,
                // SAFETY: the packer indexes slices, checked.
                |pool, out| {
                    use #rt::Element as _;
                    for (o, b) in out[__U_LEN..].iter_mut().zip(layer.biases.as_slice()) {
                        *o = b.to_acc();
                    }
                    let out = #rt::Shared::new(out);
                    pool.split(__WIC, __OC * __ELEMS * 16, &|channels| {
                        // SAFETY: the packer writes the rows of its channels only.
                        unsafe { __pack_wino(layer.weights.as_slice(), out, channels) }
                    });
                },
                parts * __SCRATCH + y_scratch,
            );
            let (packed, pool) = (ws.packed, ws.pool);
            let (scratch, rest) = ws.scratch.split_at_mut(parts * __SCRATCH);
            let y = match ya {
                ::core::option::Option::Some(y) => y,
                ::core::option::Option::None => #rt::Shared::new(&mut rest[..__B * __NPIX * __OC]),
            };
            let scratch = #rt::Shared::new(scratch);
            pool.run(parts, work, &|_, range| {
                // SAFETY: each worker has its own scratch (`range` is its own) and chunks;
                // every slice has the length the kernel is built on (checked in debug).
                unsafe {
                    let scratch = scratch.part(range.start * __SCRATCH, __SCRATCH);
                    let (xs, rest) = scratch.split_at_mut(__XS_LEN);
                    let (v, m) = rest.split_at_mut(__ELEMS * __WCT * __WIC);
                    let tile_rows = range.start * rows / parts..range.end * rows / parts;
                    __wino_tiles(x, xs, packed, v, m, y, epilogue, then, tile_rows, __RELU);
                }
            });
        }

        #kernel

        /// Where tap `(a, b)` of the staged kernel for staged channel `cp` is in the OHWI
        /// weights of output channel 0 (space-to-depth: tap `(SD a + dy, SD b + dx)`).
        #[inline(always)]
        fn __wino_tap(a: usize, b: usize, cp: usize) -> usize {
            let (block, c) = (cp / __IC, cp % __IC);
            let (dy, dx) = (block / __SD, block % __SD);
            ((__SD * a + dy) * __KW + __SD * b + dx) * __IC + c
        }

        #pack

        #helpers
        #gemm
        #(#tiles)*
    }
}

/// `name(w, out, rows)`: the runtime's packer for this layer's layout, vectors along output
/// channels if `k_inner` (the forward pass's copy) else along staged channels (the input
/// gradient's), in blocks of `block` channels.
fn packer(name: &str, k_inner: bool, block: usize) -> TokenStream {
    let rt = rt();
    let (name, block) = (format_ident!("{}", name), lit(block));
    quote! {
        /// # Safety
        /// As the runtime's `winograd::pack`: the rows `ys` of `out` are the caller's alone.
        #[inline(always)]
        unsafe fn #name(w: &[__T], out: #rt::Shared<'_, __A>, ys: ::core::ops::Range<usize>) {
            const __PACKING: #rt::winograd::Packing = #rt::winograd::Packing {
                oc: __OC,
                kh: __KH,
                kw: __KW,
                ic: __IC,
                sd: __SD,
                k_inner: #k_inner,
                block: #block,
            };
            #rt::winograd::pack::<__WV, __T, { __L }>(&__PACKING, w, out, ys)
        }
    }
}

/// The tile loops every direction shares: input transform of a chunk.
fn helpers() -> TokenStream {
    let rt = rt();
    quote! {
        /// `V[e][t][staged channel]` of the chunk's `count` tiles from tile row `r0` on, read
        /// from `xs`: the input itself (`DIRECT_INPUT`, with `tb` for border windows) or the
        /// staged slots.
        #[inline(always)]
        unsafe fn __wino_input<__S: #rt::Simd<Elem = __A>>(
            xs: *const __A, tb: *mut __A, v: *mut __A, r0: usize, count: usize,
        ) {
            for t in 0..count {
                let (g, tw) = (r0 + t / __WTW, t % __WTW);
                let (n, th) = (g / __WTH, g % __WTH);
                let (src, row) = if __DIRECT_INPUT {
                    __wino_window(xs, tb, n, th, tw)
                } else {
                    (xs.add(n % __SLOTS * __STAGED_IMAGE + (__WSTEP * th * __WW + __WSTEP * tw) * __WIC), __WW * __WIC)
                };
                let input = #rt::winograd::tiles::Input {
                    x: src, row, col: __WIC, v: v.add(t * __WIC), stride: __WCT * __WIC,
                };
                __S::channels::<__WV, _>(&input, __WIC);
            }
        }

        /// The input window of tile `(th, tw)` of image `n` and its row stride: in place in the
        /// input `x` where it lies inside the image, else copied into `tb` (`WN * WN * WIC`)
        /// with zeros for the padding and past the edges.
        #[inline(always)]
        unsafe fn __wino_window(
            x: *const __A, tb: *mut __A, n: usize, th: usize, tw: usize,
        ) -> (*const __A, usize) {
            // Padded coordinates of the window's first row and column.
            let (h0, w0) = (__WSTEP * th, __WSTEP * tw);
            if h0 >= __PH && h0 + __WN <= __PH + __IH && w0 >= __PW && w0 + __WN <= __PW + __IW {
                return (x.add(((n * __IH + h0 - __PH) * __IW + w0 - __PW) * __IC), __IW * __IC);
            }
            for i in 0..__WN {
                for j in 0..__WN {
                    let (h, w) = (h0 + i, w0 + j);
                    let dst = tb.add((i * __WN + j) * __WIC);
                    if h >= __PH && h < __PH + __IH && w >= __PW && w < __PW + __IW {
                        let src = x.add(((n * __IH + h - __PH) * __IW + w - __PW) * __IC);
                        ::core::ptr::copy_nonoverlapping(src, dst, __IC);
                    } else {
                        ::core::ptr::write_bytes(dst, 0, __IC);
                    }
                }
            }
            (tb, __WN * __WIC)
        }
    }
}

/// `name::<S>(a, w, out, count)`: for each element, `out[e] = a[e] . w[e]` over the chunk's
/// first `count` rows, `a` rows `K` wide, `w[e]` packed `[block][K][lanes]` over `N` columns
/// (`blk`): whole register tiles of `p` rows, then one of the rows left. Rounded up to whole
/// tiles instead, a single image's few tiles (one action) computed up to a third more rows
/// than it has. On a CPU with AVX-512 the AVX2 instantiation hands the chunk to
/// `conv_runtime::wide` instead: the same sums on vectors twice as wide.
fn product(name: &str, blk: &Blocking, k: TokenStream, n: TokenStream) -> TokenStream {
    let rt = rt();
    let name = format_ident!("{}", name);
    let tile = |rows: usize| {
        let rows_lit = lit(rows);
        let rows_array = array_by_loop(
            quote!(#rows_lit),
            quote!(::core::ptr::null::<__A>()),
            "i",
            quote!(ae.add((row + i) * #k)),
        );
        let calls = blk.calls(
            &format!("wgemm{rows}"),
            true,
            |tile, first| quote!(#tile::<__S, { #k }, { #n }>(&rows, we.add(#k * #first), out.add(#first));),
        );
        quote! {{
            let rows: [*const __A; #rows_lit] = #rows_array;
            let out = oe.add(row * #n);
            #calls
        }}
    };
    let p = lit(blk.p);
    let block = lit(blk.v * blk.lanes);
    let full = tile(blk.p);
    let (left, tiles): (Vec<_>, Vec<_>) = (1..blk.p).map(|r| (lit(r), tile(r))).unzip();
    quote! {
        #[inline(always)]
        unsafe fn #name<__S: #rt::Simd<Elem = __A>>(
            a: *const __A, w: *const __A, o: *mut __A, count: usize,
        ) {
            let wide = #rt::wide::Product { elems: __ELEMS, rows: __WCT, k: #k, n: #n, block: #block };
            if __S::wide_product(&wide, a, w, o, count) {
                return;
            }
            for e in 0..__ELEMS {
                let (ae, we, oe) = (a.add(e * __WCT * #k), w.add(e * #k * #n), o.add(e * __WCT * #n));
                let mut row = 0;
                while row + #p <= count {
                    #full
                    row += #p;
                }
                match count - row {
                    #(#left => #tiles)*
                    _ => {}
                }
            }
        }
    }
}

/// `wgemm{p}_{nv}_{lanes}::<S, K, N>(rows, w, out)`: `p` rows times `nv` vectors of a packed
/// block, reduced over `K`, stored into rows `N` apart. Every row count (up to the blockings'
/// `p`, for the rows left after whole tiles) and block shape the products use, once.
fn gemm_tiles(spec: &Spec, blockings: &[&Blocking]) -> Vec<TokenStream> {
    let rt = rt();
    let mut kinds: Vec<(usize, usize, usize)> = Vec::new();
    for blk in blockings {
        for p in 1..=blk.p {
            for (nv, last) in blk.kinds() {
                if !kinds.contains(&(p, nv, last)) {
                    kinds.push((p, nv, last));
                }
            }
        }
    }
    let l = spec.dtype.lanes();
    kinds
        .into_iter()
        .map(|(p, nv, last)| {
            let name = format_ident!("__wgemm{}_{}_{}", p, nv, last);
            let width = lit(nv * l);
            let init = init_accumulators(p, nv, |_, _| quote!(__S::zero()));
            let step = fma_step(
                p,
                nv,
                |i| {
                    let i = lit(i);
                    quote!(*rows[#i].add(j))
                },
                |v| {
                    let off = lit(v * l);
                    quote!(w.add(j * #width + #off))
                },
            );
            let stores = write_accumulators(p, nv, l, last, |acc, i, v, _| {
                let (i, off) = (lit(i), lit(v * l));
                quote!(#acc.store(out.add(#i * __N + #off));)
            });
            let pl = lit(p);
            quote! {
                #[inline(always)]
                unsafe fn #name<__S: #rt::Simd<Elem = __A>, const __K: usize, const __N: usize>(
                    rows: &[*const __A; #pl], w: *const __A, out: *mut __A,
                ) {
                    #init
                    for j in 0..__K {
                        #step
                    }
                    #stores
                }
            }
        })
        .collect()
}

/// `wgrad{p}_{nv}_{lanes}`: `dU[e]` rows `c..c + p` (vectors of output channels) plus
/// `sum over the chunk's tiles V[e][t][c + i] * N[e][t][..]`.
fn weight_tiles(spec: &Spec, plan: Plan, blk: &Blocking) -> (Vec<TokenStream>, TokenStream) {
    let rt = rt();
    let l = blk.lanes;
    let ic = plan.sd * plan.sd * spec.in_c();
    let (full, rem) = (ic / blk.p, ic % blk.p);
    let mut ps = vec![blk.p];
    if rem > 0 {
        ps.push(rem);
    }
    let mut tiles = Vec::new();
    for &p in &ps {
        for (nv, last) in blk.kinds() {
            let name = format_ident!("__wgrad{}_{}_{}", p, nv, last);
            // The first chunk of a part starts from zero instead of a cleared `dU`.
            let init = init_accumulators(p, nv, |i, v| {
                let off = lit(i * spec.out_channels + v * l);
                quote!(if fresh { __S::zero() } else { __S::load(dst.add(#off)) })
            });
            let step = fma_step(
                p,
                nv,
                |i| {
                    let i = lit(i);
                    quote!(*vt.add(#i))
                },
                |v| {
                    let off = lit(v * l);
                    quote!(nt.add(#off))
                },
            );
            let stores = write_accumulators(p, nv, l, last, |acc, i, v, _| {
                let off = lit(i * spec.out_channels + v * l);
                quote!(#acc.store(dst.add(#off));)
            });
            tiles.push(quote! {
                #[inline(always)]
                unsafe fn #name<__S: #rt::Simd<Elem = __A>>(
                    v: *const __A, n: *const __A, count: usize, dst: *mut __A, fresh: bool,
                ) {
                    #init
                    for t in 0..count {
                        let (vt, nt) = (v.add(t * __WIC), n.add(t * __OC));
                        #step
                    }
                    #stores
                }
            });
        }
    }
    // Output-channel blocks outside, input-channel rows inside: one block of `N[e]` stays in
    // L1 across the rows (the whole of `V[e]`, `N[e]` and `dU[e]` does not).
    let pl = lit(blk.p);
    let full = lit(full);
    let blocks = blk.blocks().into_iter().map(|b| {
        let first = lit(b.first * l);
        let tile = format_ident!("__wgrad{}_{}_{}", blk.p, b.nv, b.last_lanes);
        let rem_call = (rem > 0).then(|| {
            let tile = format_ident!("__wgrad{}_{}_{}", rem, b.nv, b.last_lanes);
            let c0 = lit(ic - rem);
            quote!(#tile::<__S>(ve.add(#c0), ne.add(#first), count, de.add(#c0 * __OC + #first), fresh);)
        });
        quote! {
            for ct in 0..#full {
                let c0 = ct * #pl;
                #tile::<__S>(ve.add(c0), ne.add(#first), count, de.add(c0 * __OC + #first), fresh);
            }
            #rem_call
        }
    });
    let driver = quote! {
        /// `dU[e] += V[e]^T . N[e]` over the chunk's `count` tiles (`dU[e] =` when `fresh`).
        #[inline(always)]
        unsafe fn __wino_weight_product<__S: #rt::Simd<Elem = __A>>(
            v: *const __A, n: *const __A, du: *mut __A, count: usize, fresh: bool,
        ) {
            let wide = #rt::wide::WeightProduct { elems: __ELEMS, rows: __WCT, wic: __WIC, oc: __OC };
            if __S::wide_weight_product(&wide, v, n, du, count, fresh) {
                return;
            }
            for e in 0..__ELEMS {
                let (ve, ne, de) = (v.add(e * __WCT * __WIC), n.add(e * __WCT * __OC), du.add(e * __WIC * __OC));
                #(#blocks)*
            }
        }
    };
    (tiles, driver)
}

/// `backward_pass` with the Winograd kernels (the same signature as the direct one's).
pub fn backward(spec: &Spec, plan: Plan) -> TokenStream {
    let rt = rt();
    let (oc_blk, ic_blk) = (
        Blocking::new(spec.dtype, spec.out_channels),
        Blocking::new(spec.dtype, plan.sd * plan.sd * spec.in_c()),
    );
    let data_product = product("__wino_data_product", &ic_blk, quote!(__OC), quote!(__WIC));
    let (wtiles, weight_product) = weight_tiles(spec, plan, &oc_blk);
    let layout = layout_id(spec, 4);
    // OHWI weights -> `U[e][block of staged channels][oc][lanes]`, the input gradient's order.
    let pack_data = packer("__pack_wino_data", false, ic_blk.v * ic_blk.lanes);
    // Without a norm the activation's gradient needs nothing from the whole batch: each chunk
    // computes its own `dz` (and bias gradient) in cache instead of a pass over the batch first.
    let fused = spec.norm == Norm::None;
    let act = activation_type(spec.activation);
    // Where `dz` is the output gradient itself (no activation, and the element type is the
    // accumulator's), a chunk reads it in place instead of copying it.
    let in_place =
        spec.activation == Activation::Identity && matches!(spec.dtype, Dtype::F32 | Dtype::F64);
    let chunk = if in_place {
        quote! {
            let _ = (pre, output, &dzc);
            let chunk: &[__A] = &d_output[range];
        }
    } else {
        quote! {
            let chunk = &mut dzc[..range.len()];
            #rt::activation::backward::<#act, __T>(
                &d_output[range.clone()], &pre[range.clone()], &output[range], chunk,
            );
            let chunk: &[__A] = chunk;
        }
    };
    let kernel = dispatched(
        spec.dtype,
        "wino_backward_tiles",
        TokenStream::new(),
        TokenStream::new(),
        quote! {
            x: &[__T], xs: &mut [__A], g: __DzSource<'_>, dz: &[__A], dzc: &mut [__A], ut: &[__A],
            v: &mut [__A], n: &mut [__A], du: &mut [__A], dx: &mut [__A],
            d_input: #rt::Shared<'_, __T>, images: ::core::ops::Range<usize>,
        },
        quote!(x, xs, g, dz, dzc, ut, v, n, du, dx, d_input, images),
        quote! {
            let (weights, data) = (!du.is_empty(), !d_input.is_empty());
            ::core::debug_assert!(!weights || (x.len() == __BATCH * __IMAGE && du.len() == __U_LEN));
            ::core::debug_assert!(!weights || xs.len() >= __XS_LEN);
            ::core::debug_assert!(!data || (ut.len() == __U_LEN && dx.len() >= __DX_SLOTS));
            ::core::debug_assert!(!data || d_input.len() == __BATCH * __IMAGE);
            ::core::debug_assert!(if __FUSED { dzc.len() >= __DZ_CHUNK } else { dz.len() >= __BATCH * __NPIX * __OC });
            ::core::debug_assert!(v.len() >= __ELEMS * __WCT * __WIC && n.len() >= __ELEMS * __WCT * __OC);
            let ut = ut.as_ptr();
            let (vp, np, dup) = (v.as_mut_ptr(), n.as_mut_ptr(), du.as_mut_ptr());
            let __DzSource { d_output, pre, output, db } = g;
            // The bias gradient of the chunks' `dz`, one vector of output channels at a time.
            let mut bias = [__S::zero(); __OC / __L];
            // The part's tile rows in chunks from its first image on; images staged so far, and
            // gradients copied out.
            let rows_total = images.end * __WTH;
            let (mut r0, mut staged, mut done) = (images.start * __WTH, images.start, images.start);
            while r0 < rows_total {
                let rows = if rows_total - r0 < __WROWS { rows_total - r0 } else { __WROWS };
                let count = rows * __WTW;
                while staged <= (r0 + rows - 1) / __WTH {
                    let slot = staged % __SLOTS * __STAGED_IMAGE;
                    if weights && !__DIRECT_INPUT {
                        __wino_stage(&x[staged * __IMAGE..][..__IMAGE], &mut xs[slot..][..__STAGED_IMAGE]);
                    }
                    staged += 1;
                }
                if weights {
                    let source = if __DIRECT_INPUT { x.as_ptr() as *const __A } else { xs.as_ptr() };
                    __wino_input::<__S>(source, xs.as_mut_ptr(), vp, r0, count);
                }
                // `dz` of the chunk's outputs (one contiguous pixel range), unless the pass
                // computed all of it first.
                let (dzp, origin) = if __FUSED {
                    let last = r0 + rows - 1;
                    let first = r0 / __WTH * __NPIX + __WM * (r0 % __WTH) * __OW;
                    let end_row = if __WM * (last % __WTH) + __WM < __OH { __WM * (last % __WTH) + __WM } else { __OH };
                    let end = last / __WTH * __NPIX + end_row * __OW;
                    let range = first * __OC..end * __OC;
                    #chunk
                    if !db.is_empty() {
                        for px in chunk.chunks_exact(__OC) {
                            for k in 0..__OC / __L {
                                bias[k] = bias[k].add(__S::load(px.as_ptr().add(k * __L)));
                            }
                        }
                    }
                    (chunk.as_ptr(), first)
                } else {
                    (dz.as_ptr(), 0)
                };
                // Output-gradient tiles; outputs past the last row or column contribute zero.
                for t in 0..count {
                    let (g, tw) = (r0 + t / __WTW, t % __WTW);
                    let (img, th) = (g / __WTH, g % __WTH);
                    let (oh, ow) = (__WM * th, __WM * tw);
                    let base = dzp.add(((img * __OH + oh) * __OW + ow - origin) * __OC);
                    let down = if __OH - oh < __WM { __OH - oh } else { __WM };
                    let right = if __OW - ow < __WM { __OW - ow } else { __WM };
                    let gradient = #rt::winograd::tiles::Gradient {
                        dy: base, row: __OW * __OC, col: __OC, extent: (down, right),
                        n: np.add(t * __OC), stride: __WCT * __OC,
                    };
                    __S::channels::<__WV, _>(&gradient, __OC);
                }
                if weights {
                    __wino_weight_product::<__S>(vp, np, dup, count, r0 == images.start * __WTH);
                }
                if data {
                    // `dV` reuses `V`'s buffer.
                    __wino_data_product::<__S>(np, ut, vp, count);
                    let dxp = dx.as_mut_ptr();
                    for t in 0..count {
                        let (g, tw) = (r0 + t / __WTW, t % __WTW);
                        let (img, th) = (g / __WTH, g % __WTH);
                        // Tiles run in rows, left to right: the ones above and to the left
                        // overlap this one in its first `WN - WSTEP` rows and columns.
                        let add_rows = if th == 0 { 0 } else { __WN - __WSTEP };
                        let add_cols = if tw == 0 { 0 } else { __WN - __WSTEP };
                        let (sy, sx) = (__WSTEP * th, __WSTEP * tw);
                        if __DIRECT_INPUT {
                            // Straight into the image (staged row `sy` is input row `sy - PH`),
                            // the tile clipped to the inputs the staged image holds.
                            let (rows, cols) = (__wino_clip(sy, __PH, __SIH), __wino_clip(sx, __PW, __SIW));
                            let image = d_input.part(img * __IMAGE, __IMAGE).as_mut_ptr() as *mut __A;
                            let origin = (sy as isize - __PH as isize) * (__IW * __IC) as isize + (sx as isize - __PW as isize) * __IC as isize;
                            let dst = image.wrapping_offset(origin);
                            let input_gradient = #rt::winograd::tiles::InputGradient {
                                dv: vp.add(t * __WIC), stride: __WCT * __WIC, x: dst,
                                row: __IW * __IC, col: __IC, add: (add_rows, add_cols), rows, cols,
                            };
                            __S::channels::<__WV, _>(&input_gradient, __IC);
                        } else {
                            let dst = dxp.add(img % __SLOTS * __STAGED_IMAGE + (sy * __WW + sx) * __WIC);
                            let input_gradient = #rt::winograd::tiles::InputGradient {
                                dv: vp.add(t * __WIC), stride: __WCT * __WIC, x: dst,
                                row: __WW * __WIC, col: __WIC, add: (add_rows, add_cols),
                                rows: 0..__WN, cols: 0..__WN,
                            };
                            __S::channels::<__WV, _>(&input_gradient, __WIC);
                        }
                    }
                }
                r0 += rows;
                // Images whose tiles are all done: their input gradient is complete.
                while data && done < r0 / __WTH {
                    // SAFETY: the image is this part's.
                    let image = d_input.part(done * __IMAGE, __IMAGE);
                    if __DIRECT_INPUT {
                        __wino_unreached(image);
                    } else {
                        __wino_unstage(&dx[done % __SLOTS * __STAGED_IMAGE..][..__STAGED_IMAGE], image);
                    }
                    done += 1;
                }
            }
            if !db.is_empty() {
                for k in 0..__OC / __L {
                    bias[k].store(db.as_mut_ptr().add(k * __L));
                }
            }
        },
    );
    // Scratch for a chunk's `dz` only where the chunk computes it.
    let dz_chunk = lit(if fused && !in_place {
        chunk_rows(spec, plan) * plan.m * spec.out_w() * spec.out_channels
    } else {
        0
    });
    let wparts = lit(weight_parts(spec, plan));
    let items = quote! {
        /// Whether each chunk computes its own `dz` (see `DzSource`).
        const __FUSED: bool = #fused;
        /// The backward pass's parts: whole images each, with a weight-gradient partial of
        /// their own (see `weight_parts`).
        const __WPARTS: usize = #wparts;
        /// The staged input gradients' slots of a worker: none where the gradient is written in
        /// place.
        const __DX_SLOTS: usize = if __DIRECT_INPUT { 0 } else { __SLOTS * __STAGED_IMAGE };
        /// `dz` of one chunk at most: its tile rows' output rows (none where a chunk reads the
        /// output gradient in place).
        const __DZ_CHUNK: usize = #dz_chunk;

        /// Where the fused kernel takes `dz` from: the output gradient, the pre-activations and
        /// outputs of the forward pass; `db` (`OC`, or empty for no bias gradient) gets the sum
        /// of `dz` over the part's images. Empty where the pass computes `dz` first.
        struct __DzSource<'a> {
            d_output: &'a [__T],
            pre: &'a [__T],
            output: &'a [__T],
            db: &'a mut [__A],
        }

        #pack_data

        #kernel
        #data_product
        #weight_product
        #(#wtiles)*
    };
    let bias = super::backward::bias_gradient();
    let pass = super::backward::pass_fn(
        spec,
        quote! {
            let (data, weights) = (d_input.is_some(), grads.is_some());
            let key = if data {
                #rt::PackKey { stamps: [layer.weights.stamp(), 0], layout: #layout }
            } else {
                #rt::PackKey { stamps: [0, 0], layout: 0 }
            };
            let work = __BATCH * __NPIX * __WINDOW * __OC;
            let workers = cpu.__pool().workers(__WPARTS, work);
            // Each worker's scratch: `dz` of a chunk, the transforms, the staged input and the
            // staged input gradient (if any).
            const __DZC: usize = if __FUSED { __DZ_CHUNK } else { 0 };
            const __WORKER: usize = __DZC + __ELEMS * __WCT * (__WIC + __OC) + __XS_LEN + __DX_SLOTS;
            let dz_len = if __FUSED { 0 } else { __BATCH * __NPIX * __OC };
            let du_len = if weights { __WPARTS * __U_LEN } else { 0 };
            let #rt::Workspace { packed, scratch, pool } = cpu.__workspace::<__A>(
                key,
                if data { __U_LEN } else { 0 },
                |pool, out| {
                    if data {
                        let out = #rt::Shared::new(out);
                        pool.split(__OC, __WIC * __ELEMS * 16, &|channels| {
                            // SAFETY: the packer writes the rows of its channels only.
                            unsafe { __pack_wino_data(layer.weights.as_slice(), out, channels) }
                        });
                    }
                },
                dz_len + workers * __WORKER + du_len,
            );
            let (dz, rest) = scratch.split_at_mut(dz_len);
            let (scratches, rest) = rest.split_at_mut(workers * __WORKER);
            let dus = &mut rest[..du_len];
            if !__FUSED {
                __d_conv(pool, layer, state, d_output, mode, grads.as_deref_mut(), dz);
            }
            let _ = mode;
            let dz: &[__A] = dz;
            let x: &[__T] = if weights { x } else { &[] };
            let d_input = #rt::Shared::new(match d_input {
                ::core::option::Option::Some(d) => d,
                ::core::option::Option::None => &mut [],
            });
            let (pre, output) = (state.pre_activation().as_slice(), state.output.as_slice());
            let mut dbs = [[0.0 as __A; __OC]; __WPARTS];
            {
                let (scratches, dus, dbs) = (
                    #rt::Shared::new(scratches),
                    #rt::Shared::new(&mut *dus),
                    #rt::Shared::new(&mut dbs[..]),
                );
                pool.run(__WPARTS, work, &|worker, parts| {
                    // SAFETY: each worker has its own scratch, each part its own partials and
                    // images; the slices have the lengths the kernel is built on (checked in
                    // debug).
                    unsafe {
                        let scratch = scratches.part(worker * __WORKER, __WORKER);
                        let (dzc, rest) = scratch.split_at_mut(__DZC);
                        let (v, rest) = rest.split_at_mut(__ELEMS * __WCT * __WIC);
                        let (n, rest) = rest.split_at_mut(__ELEMS * __WCT * __OC);
                        let (xs, dx) = rest.split_at_mut(__XS_LEN);
                        let xs: &mut [__A] = if weights { xs } else { &mut [] };
                        let dx: &mut [__A] = if data { dx } else { &mut [] };
                        for p in parts {
                            // Written by the part's first chunk, then accumulated (scratch is not
                            // cleared by the device; the staged input gradient is stored where no
                            // tile reached it before).
                            let du: &mut [__A] = if weights { dus.part(p * __U_LEN, __U_LEN) } else { &mut [] };
                            let source = if __FUSED {
                                __DzSource {
                                    d_output,
                                    pre,
                                    output,
                                    db: if weights { &mut dbs.part(p, 1)[0][..] } else { &mut [] },
                                }
                            } else {
                                __DzSource { d_output: &[], pre: &[], output: &[], db: &mut [] }
                            };
                            let images = p * __BATCH / __WPARTS..(p + 1) * __BATCH / __WPARTS;
                            __wino_backward_tiles(x, xs, source, dz, dzc, packed, v, n, du, dx, d_input, images);
                        }
                    }
                });
            }
            // The weight-gradient partials, summed in part order into the first.
            if weights && __WPARTS > 1 {
                let (first, others) = dus.split_at_mut(__U_LEN);
                let others: &[__A] = others;
                let first = #rt::Shared::new(first);
                pool.split(__U_LEN, __WPARTS * #rt::ELEMENT_WORK, &|range| {
                    // SAFETY: the worker's own elements.
                    let sum = unsafe { first.part(range.start, range.len()) };
                    for p in 1..__WPARTS {
                        let part = &others[(p - 1) * __U_LEN + range.start..][..range.len()];
                        for (s, v) in sum.iter_mut().zip(part) {
                            *s += *v;
                        }
                    }
                });
            }
            let du: &[__A] = &dus[..if weights { __U_LEN } else { 0 }];

            if let ::core::option::Option::Some(g) = grads {
                if __FUSED {
                    let db = __sum_parts(&dbs);
                    let gb = &mut g.biases.as_mut_slice()[..__OC];
                    for c in 0..__OC {
                        gb[c] += db[c];
                    }
                } else {
                    #bias
                }
                // `G^T dU G`, one vector of output channels at a time, the staged channels
                // dealt to the workers (each writes the taps of its own channels).
                use #rt::Simd as _;
                type __Lanes = #rt::simd::Lanes<__A, { __L }>;
                const __MAX: usize = #rt::winograd::MAX;
                let gw = #rt::Shared::new(g.weights.as_mut_slice());
                pool.split(__WIC, __OC * __ELEMS * 16, &|channels| {
                    for c in channels {
                        for k in (0..__OC).step_by(__L) {
                            // SAFETY: portable vectors need no CPU feature; every pointer is to
                            // `L` elements; the taps of channel `c` are this worker's alone.
                            unsafe {
                                let mut dt = [[__Lanes::zero(); __MAX]; __MAX];
                                for e in 0..__ELEMS {
                                    dt[e / __WN][e % __WN] = __Lanes::load(du[e * __WIC * __OC + c * __OC + k..][..__L].as_ptr());
                                }
                                let dg = #rt::winograd::weight_gradient::<__WV, __Lanes>(dt);
                                for a in 0..__WR {
                                    for b in 0..__WR {
                                        let mut values = [0.0; __L];
                                        dg[a][b].store(values.as_mut_ptr());
                                        for (i, value) in values.into_iter().enumerate() {
                                            *gw.at((k + i) * __WINDOW + __wino_tap(a, b, c)) += value;
                                        }
                                    }
                                }
                            }
                        }
                    }
                });
            }
        },
    );
    quote!(#items #pass)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn variant(spec: &Spec) -> Option<&'static str> {
        plan(spec).map(|p| p.variant)
    }

    #[test]
    fn plans_follow_the_multiplies_saved() {
        // The benchmark's shapes: Atari layers 2 and 3, ResNet, and the direct ones.
        let nature2 = Spec::for_tests([20, 20, 32], 64, 4, 2, 0, 32);
        assert_eq!(variant(&nature2), Some("F3x2"));
        assert!((Plan::f3x2(2).gain(&nature2) - 2.25).abs() < 1e-12);
        let nature3 = Spec::for_tests([9, 9, 64], 64, 3, 1, 0, 32);
        assert_eq!(variant(&nature3), Some("F4x3"));
        assert_eq!(
            variant(&Spec::for_tests([56, 56, 64], 64, 3, 1, 1, 8)),
            Some("F4x3")
        );
        // Atari layer 1, 8x8 stride 4: 2x2 taps over 64 staged channels, 20x20 outputs in
        // 4x4 tiles of 5x5 (2.78x), not 7x7 tiles of 3x3 (2.04x). Layer 2's 9x9 outputs fill
        // 3x3 tiles exactly: F(5x5, 2x2) saves no more there (2.25x either way).
        let nature1 = Spec::for_tests([84, 84, 4], 32, 8, 4, 0, 32);
        assert_eq!(variant(&nature1), Some("F5x2"));
        assert!((Plan::f5x2(4).gain(&nature1) - 25600.0 / 9216.0).abs() < 1e-12);
        assert!((Plan::f3x2(4).gain(&nature1) - 25600.0 / 12544.0).abs() < 1e-12);
        assert!((Plan::f5x2(2).gain(&nature2) - 2.25).abs() < 1e-12);
        // Ragged 5x5 tiles: 14x13 outputs in 3x3 of them (11648 / 5184, 2.25x) against 5x5
        // tiles of 3x3 (11648 / 6400, 1.82x).
        let mut s4_ragged = Spec::for_tests([58, 56, 4], 16, 8, 4, 1, 2);
        assert_eq!(variant(&s4_ragged), Some("F5x2"));
        assert!((Plan::f5x2(4).gain(&s4_ragged) - 11648.0 / 5184.0).abs() < 1e-12);
        s4_ragged.dtype = Dtype::F64;
        assert_eq!(variant(&s4_ragged), None);
        // The suites' padded stride-4 case: 6x5 outputs in 2x2 tiles (1.875x).
        let mut s4 = Spec::for_tests([23, 21, 2], 24, 8, 4, 3, 2);
        assert_eq!(variant(&s4), Some("F3x2"));
        s4.dtype = Dtype::F64;
        assert_eq!(variant(&s4), None);
        // Stride 3, 6x6: 8 input channels make 72 staged ones; 6x6 outputs in 2x2 tiles.
        let s3 = Spec::for_tests([20, 20, 8], 16, 6, 3, 1, 2);
        assert_eq!(variant(&s3), Some("F3x2"));
        assert!((Plan::f3x2(3).gain(&s3) - 2.25).abs() < 1e-12);
        // Too few staged channels (8 at stride 2), and a kernel that is not twice the stride.
        assert_eq!(
            variant(&Spec::for_tests([84, 84, 2], 32, 4, 2, 0, 32)),
            None
        );
        assert_eq!(
            variant(&Spec::for_tests([84, 84, 4], 32, 6, 2, 0, 32)),
            None
        );
        // Stride-2 3x3 (the BatchNorm benchmark layer): 8x8 outputs in 2x2 tiles, 1.44x; with
        // ragged tiles (7x7 outputs) too little.
        let bn16 = Spec::for_tests([16, 16, 16], 32, 3, 2, 1, 32);
        assert_eq!(variant(&bn16), Some("F2x3S2"));
        assert!((Plan::F2X3S2.gain(&bn16) - 1.44).abs() < 1e-12);
        assert_eq!(
            variant(&Spec::for_tests([15, 15, 16], 32, 3, 2, 0, 32)),
            None
        );
        assert_eq!(
            variant(&Spec::for_tests([18, 17, 16], 24, 3, 2, 0, 3)),
            Some("F2x3S2")
        );
        // 6x9 outputs: F(4x4, 3x3) saves only 1.11x more than F(2x2, 3x3).
        let mut s = Spec::for_tests([6, 11, 24], 40, 3, 1, 0, 2);
        s.padding = [1, 0];
        assert_eq!(variant(&s), Some("F2x3"));
        // Too few channels (the cifar stem), channels not in whole vectors, other types.
        assert_eq!(
            variant(&Spec::for_tests([32, 32, 3], 16, 3, 1, 1, 32)),
            None
        );
        assert_eq!(
            variant(&Spec::for_tests([16, 16, 12], 16, 3, 1, 1, 32)),
            None
        );
        assert_eq!(
            variant(&Spec::for_tests([16, 16, 16], 12, 3, 1, 1, 32)),
            None
        );
        let mut f64_spec = nature3;
        f64_spec.dtype = Dtype::F64;
        assert_eq!(variant(&f64_spec), None);
        // A 3x3 output is one 4x4 tile (2.25x); a 1x1 output wastes the saving.
        assert_eq!(
            variant(&Spec::for_tests([5, 5, 16], 16, 3, 1, 0, 32)),
            Some("F4x3")
        );
        assert_eq!(variant(&Spec::for_tests([3, 3, 16], 16, 3, 1, 0, 32)), None);
        // Space-to-depth: 4 input channels make 16 staged ones.
        assert_eq!(
            variant(&Spec::for_tests([20, 20, 4], 16, 4, 2, 0, 1)),
            Some("F3x2")
        );
    }
}
