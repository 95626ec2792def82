//! Building blocks of the emitted SIMD kernels: register blocking, the unrolled FMA step, and
//! the AVX2/portable instantiation of a kernel.
//!
//! Every kernel is emitted once, generic over the runtime's `Simd` vectors, and instantiated
//! for AVX2+FMA inside a `#[target_feature]` function and for the portable vectors; a
//! dispatcher picks one per call from the CPU's features (cached by the standard library).
//! Where the target itself has AVX2 and FMA (`-C target-cpu=native` on such a CPU) the portable
//! copy is not emitted into the build at all (`#[cfg]` in the generated code, decided by the
//! user's crate flags): it could never run, and it was 40% of the build time. Nor is it on
//! x86-64 where the runtime was built without its `portable` feature (`if_portable!`, decided
//! by the runtime's features): there a CPU without AVX2 and FMA is refused.
//!
//! The register tile is the only loop the macro unrolls: `P x V` accumulators, with
//! `P * V <= 12` so that they, `V` vector loads and a broadcast fit AVX2's 16 vector registers.
//! That budget bounds the code size of every kernel whatever the layer's size; the window and
//! channel loops keep literal bounds and are left to LLVM.

use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote, ToTokens};

use super::{lit, rt};
use crate::spec::Dtype;

/// AVX2's vector registers.
pub const VECTOR_REGISTERS: usize = 16;
/// Accumulator registers per tile.
const ACC_REGISTERS: usize = 12;
/// Broadcast rows per tile at most: each needs a pointer register of its own.
const MAX_ROWS: usize = 6;

/// How a vectorized dimension of `len` elements is cut into register tiles.
#[derive(Clone, Copy)]
pub struct Blocking {
    /// Lanes per vector.
    pub lanes: usize,
    /// Vectors covering the dimension, the last one possibly partial.
    pub vectors: usize,
    /// Elements in the dimension.
    pub len: usize,
    /// Vectors per full block.
    pub v: usize,
    /// Broadcast rows (pixels, or reduction positions) per tile.
    pub p: usize,
}

/// One block of vectors: the first vector, how many, and the lanes its last vector stores.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub first: usize,
    pub nv: usize,
    pub last_lanes: usize,
}

impl Blocking {
    /// The tile with its rows cut until the accumulators, the `V` vector loads and every
    /// row's broadcast fit the registers together: in some kernels (the weight gradient's) LLVM
    /// hoists all of a step's broadcasts ahead of its FMAs and then keeps accumulators on the
    /// stack, a store-to-load chain on every pixel (cifar1's weight gradient, 6 rows of 2
    /// vectors: 1048 us; 4 rows: 608 us).
    pub fn broadcasts_held(self) -> Self {
        let p = (VECTOR_REGISTERS - self.v) / (self.v + 1);
        Self {
            p: p.clamp(1, self.p),
            ..self
        }
    }

    pub fn new(dtype: Dtype, len: usize) -> Self {
        let lanes = dtype.lanes();
        let vectors = len.div_ceil(lanes);
        // Three vectors when that covers the dimension exactly, else two (or one): wide enough
        // that each broadcast feeds several FMAs, narrow enough for six rows per tile.
        let v = match vectors {
            1 => 1,
            3 => 3,
            _ => 2,
        };
        let p = (ACC_REGISTERS / v).min(MAX_ROWS);
        Self {
            lanes,
            vectors,
            len,
            v,
            p,
        }
    }

    pub fn padded(&self) -> usize {
        self.vectors * self.lanes
    }

    pub fn blocks(&self) -> Vec<Block> {
        (0..self.vectors)
            .step_by(self.v)
            .map(|first| {
                let nv = self.v.min(self.vectors - first);
                let last_lanes = (self.len - (first + nv - 1) * self.lanes).min(self.lanes);
                Block {
                    first,
                    nv,
                    last_lanes,
                }
            })
            .collect()
    }

    /// The tile calls covering the dimension, the partial block last.
    /// `call(tile function, first element of the block)` emits one call. With `looped`, the full
    /// blocks share one inlined copy of their tile in a loop (bounded code for wide layers);
    /// otherwise each block is its own call with constant offsets, which the backward kernels
    /// (whose tiles read and write memory per block) need: looped, they ran 1.6x slower.
    pub fn calls(
        &self,
        prefix: &str,
        looped: bool,
        call: impl Fn(&Ident, TokenStream) -> TokenStream,
    ) -> TokenStream {
        let blocks = self.blocks();
        let full = blocks
            .iter()
            .filter(|b| looped && b.nv == self.v && b.last_lanes == self.lanes)
            .count();
        let mut out = TokenStream::new();
        if full > 0 {
            let tile = format_ident!("__{}_{}_{}", prefix, self.v, self.lanes);
            let (count, width) = (lit(full), lit(self.v * self.lanes));
            let body = call(&tile, quote!(first));
            out.extend(quote! {
                for block in 0..#count {
                    let first = block * #width;
                    #body
                }
            });
        }
        for b in &blocks[full..] {
            let tile = format_ident!("__{}_{}_{}", prefix, b.nv, b.last_lanes);
            out.extend(call(&tile, lit(b.first * self.lanes).into_token_stream()));
        }
        out
    }

    /// The distinct block shapes, one tile function each.
    pub fn kinds(&self) -> Vec<(usize, usize)> {
        let mut kinds = Vec::new();
        for b in self.blocks() {
            if !kinds.contains(&(b.nv, b.last_lanes)) {
                kinds.push((b.nv, b.last_lanes));
            }
        }
        kinds
    }
}

/// The runtime's AVX2 and portable vector types for a dtype's accumulator.
pub fn simd_types(dtype: Dtype) -> (TokenStream, TokenStream) {
    let rt = rt();
    match dtype {
        Dtype::F64 => (quote!(#rt::simd::Avx2F64), quote!(#rt::simd::PortableF64)),
        _ => (quote!(#rt::simd::Avx2F32), quote!(#rt::simd::PortableF32)),
    }
}

/// `[value; len]` for `index` in `0..len`, built by a loop from `[fill; len]`: in a tile kernel,
/// `core::array::from_fn` instantiates its machinery once per closure and per instantiation of
/// the kernel, which had made a fifth of a network's IR.
pub fn array_by_loop(
    len: TokenStream,
    fill: TokenStream,
    index: &str,
    value: TokenStream,
) -> TokenStream {
    let index = format_ident!("{}", index);
    quote! {{
        let mut __array = [#fill; #len];
        for #index in 0..#len {
            __array[#index] = #value;
        }
        __array
    }}
}

pub fn accumulator(p: usize, v: usize) -> Ident {
    format_ident!("acc_{}_{}", p, v)
}

/// Declares the `p x nv` accumulators with `init(p, v)`.
pub fn init_accumulators(
    p: usize,
    nv: usize,
    init: impl Fn(usize, usize) -> TokenStream,
) -> TokenStream {
    let decls = (0..p).flat_map(|i| {
        let init = &init;
        (0..nv).map(move |v| {
            let (name, value) = (accumulator(i, v), init(i, v));
            quote!(let mut #name = #value;)
        })
    });
    quote!(#(#decls)*)
}

/// One reduction step: `nv` vector loads, `p` broadcasts, `p * nv` FMAs.
pub fn fma_step(
    p: usize,
    nv: usize,
    broadcast: impl Fn(usize) -> TokenStream,
    load: impl Fn(usize) -> TokenStream,
) -> TokenStream {
    let loads = (0..nv).map(|v| {
        let (name, value) = (format_ident!("w_{}", v), load(v));
        quote!(let #name = __S::load(#value);)
    });
    let rows = (0..p).map(|i| {
        let (x, value) = (format_ident!("x_{}", i), broadcast(i));
        let fmas = (0..nv).map(|v| {
            let (acc, w) = (accumulator(i, v), format_ident!("w_{}", v));
            quote!(#acc = __S::fma(#x, #w, #acc);)
        });
        quote! {
            let #x = __S::splat(#value);
            #(#fmas)*
        }
    });
    quote! {
        #(#loads)*
        #(#rows)*
    }
}

/// Writes each accumulator back: `store(acc, p, v, partial lanes or None)`.
pub fn write_accumulators(
    p: usize,
    nv: usize,
    lanes: usize,
    last_lanes: usize,
    write: impl Fn(&Ident, usize, usize, Option<usize>) -> TokenStream,
) -> TokenStream {
    let writes = (0..p).flat_map(|i| {
        let write = &write;
        (0..nv).map(move |v| {
            let partial = (v + 1 == nv && last_lanes < lanes).then_some(last_lanes);
            write(&accumulator(i, v), i, v, partial)
        })
    });
    quote!(#(#writes)*)
}

/// The `cfg` predicate of a target that has AVX2 and FMA itself (`-C target-cpu=native` on
/// such a CPU), evaluated with the user's crate flags: there the AVX2 kernels run without a
/// check and no portable copy is compiled. (`conv_runtime::avx2_fma` tests the same.)
pub fn avx2_target() -> TokenStream {
    quote!(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))
}

/// `name_kernel::<S, ..>` (the body, generic over the vectors), `name_avx2`, `name_portable`
/// and `name`, the dispatcher. `generics` are extra const generics (`const N: usize, ...`),
/// `args` their names.
///
/// No AVX-512 instantiation: one of every AVX2 kernel with AVX-512VL's 32 registers ran no
/// faster on any benchmarked layer or network (on Zen 4), and was one more copy of every kernel
/// to compile. Where AVX-512 pays, the kernels call functions compiled once in the runtime
/// (`conv_runtime::wide`): the Winograd products and tile transforms, and the dense layers'
/// forward dot products and gradients.
pub fn dispatched(
    dtype: Dtype,
    name: &str,
    generics: TokenStream,
    generic_args: TokenStream,
    params: TokenStream,
    args: TokenStream,
    body: TokenStream,
) -> TokenStream {
    let rt = rt();
    let (avx2, portable) = simd_types(dtype);
    let name = format_ident!("__{}", name);
    let kernel = format_ident!("{}_kernel", name);
    let avx2_fn = format_ident!("{}_avx2", name);
    let portable_fn = format_ident!("{}_portable", name);
    let avx2_target = avx2_target();
    quote! {
        #[inline(always)]
        unsafe fn #kernel<__S: #rt::Simd<Elem = __A>, #generics>(#params) {
            #body
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn #avx2_fn<#generics>(#params) {
            #kernel::<#avx2, #generic_args>(#args)
        }

        #rt::if_portable! {
            {
                /// The kernel for CPUs without AVX2 and FMA, compiled once: not inlined into
                /// every caller of the dispatcher. Not compiled at all where the target has
                /// AVX2 and FMA (`-C target-cpu=native` on such a CPU): there it could never
                /// run.
                #[cfg(not(#avx2_target))]
                #[inline(never)]
                unsafe fn #portable_fn<#generics>(#params) {
                    #kernel::<#portable, #generic_args>(#args)
                }
            } else {}
        }

        /// # Safety
        /// The slices have the lengths the kernel's index arithmetic is built on.
        #[inline(always)]
        unsafe fn #name<#generics>(#params) {
            #[cfg(#avx2_target)]
            {
                #avx2_fn::<#generic_args>(#args)
            }
            #[cfg(not(#avx2_target))]
            {
                #[cfg(target_arch = "x86_64")]
                {
                    if #rt::avx2_fma() {
                        return #avx2_fn::<#generic_args>(#args);
                    }
                }
                #rt::if_portable!({ #portable_fn::<#generic_args>(#args) } else { #rt::simd::no_kernels() })
            }
        }
    }
}
