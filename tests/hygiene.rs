//! Any name works: a crate whose items are named after everything an expansion names internally
//! (its `__`-prefixed constants, functions, types and generic parameters, without the prefix),
//! after the standard prelude's items and after the runtime's public types still builds its
//! layers, and they compute exactly what the same layers compute in a module with none of those
//! names.
//!
//! `conv_runtime::__private::hygiene_names!` expands the kernel families below and lists their
//! private names (and fails to compile where an expansion breaks the hygiene rules of
//! conv_macros/src/hygiene.rs), so a name added to the macro joins this test by itself. Module
//! `hostile` defines each name twice, as a type and as a value (a constant, or a function for
//! the expansion's function names), and each case module glob-imports it and declares one layer
//! named after one name, the families taken in turn: every name is a layer's name somewhere,
//! every family has layers among all the names. Each case runs every operation once on the CPU
//! (and on oneDNN with the `onednn` feature) and requires the same bits as its family's twin,
//! declared in module `twins` where none of the names exist.
#![recursion_limit = "512"]
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unused_imports,
    unused_macros,
    clippy::upper_case_acronyms
)]

#[macro_use]
mod common;

/// The specs reaching every kernel family: direct convolutions (input gradient scattered, and
/// gathered), each Winograd variant (F(4x4, 3x3), F(2x2, 3x3), F(3x3, 2x2) and F(5x5, 2x2) on
/// space-to-depth, F(2x2, 3x3) at stride 2), f64, f16, bf16, each norm, and a layer large
/// enough for cuDNN on the CUDA device. `families!(m, extra..)` calls `m! { extra..; name: { keys }, .. }`.
macro_rules! families {
    ($m:path $(, $($extra:tt)*)?) => {
        $m! {
            $($($extra)*)?;
            direct: { input: [9, 7, 3], out_channels: 5, kernel: [3, 2], stride: [2, 1],
                padding: 1, activation: Tanh, batch: 2 },
            gathered: { input: [8, 8, 3], out_channels: 6, kernel: 3, padding: 1,
                activation: Relu, batch: 2 },
            float64: { input: [7, 5, 2], out_channels: 3, kernel: [2, 3], activation: Sigmoid,
                batch: 2, dtype: f64 },
            wino_f4x3: { input: [5, 5, 16], out_channels: 16, kernel: 3, activation: Gelu,
                batch: 2 },
            wino_f2x3: { input: [6, 11, 24], out_channels: 40, kernel: 3, padding: [1, 0],
                activation: FastTanh, batch: 2 },
            wino_f3x2: { input: [20, 20, 4], out_channels: 16, kernel: 4, stride: 2,
                activation: Relu, batch: 1 },
            wino_f5x2: { input: [22, 22, 4], out_channels: 16, kernel: 4, stride: 2,
                activation: Relu, batch: 1 },
            wino_f2x3s2: { input: [16, 16, 16], out_channels: 32, kernel: 3, stride: 2,
                padding: 1, activation: Relu, batch: 2 },
            half_f16: { input: [5, 5, 16], out_channels: 16, kernel: 3, activation: Tanh,
                norm: BatchNorm { momentum: 0.1, eps: 1e-5 }, batch: 2, dtype: f16 },
            half_bf16: { input: [9, 7, 3], out_channels: 5, kernel: 3, activation: Relu,
                norm: LayerNorm { eps: 1e-5 }, batch: 2, dtype: bf16 },
            batch_norm: { input: [8, 6, 4], out_channels: 7, kernel: 3, stride: 2, padding: 1,
                activation: Relu, norm: BatchNorm { momentum: 0.3, eps: 1e-3 }, batch: 3 },
            layer_norm: { input: [6, 6, 3], out_channels: 4, kernel: 2, activation: Gelu,
                norm: LayerNorm { eps: 1e-3 }, batch: 2, dtype: f64 },
            cudnn: { input: [84, 84, 4], out_channels: 32, kernel: 8, stride: 4,
                activation: Relu, batch: 32 },
        }
    };
}

/// The twins: each family's layer in a module where none of the names exist.
macro_rules! twins {
    (; $($family:ident: { $($keys:tt)* },)*) => {
        mod twins {
            $(
                pub mod $family {
                    ::conv_runtime::conv2d! {
                        pub struct Twin { $($keys)* }
                    }
                }
            )*
        }
    };
}
families!(twins);

/// Asks the macro for the families' private names, then calls `hostile!` with them.
macro_rules! private_names {
    (; $($family:ident: { $($keys:tt)* },)*) => {
        ::conv_runtime::__private::hygiene_names! {
            hostile;
            $(pub struct $family { $($keys)* })*
        }
    };
}

/// User macros named like the standard ones: the expansion must name those by absolute paths.
macro_rules! vec {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's vec!")
    };
}
macro_rules! debug_assert {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's debug_assert!")
    };
}
macro_rules! assert {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's assert!")
    };
}
macro_rules! unreachable {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's unreachable!")
    };
}
macro_rules! format {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's format!")
    };
}
macro_rules! stringify {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's stringify!")
    };
}
macro_rules! concat {
    ($($t:tt)*) => {
        ::core::compile_error!("the expansion used the prelude's concat!")
    };
}

/// Defines the hostile items and one case per name (the private names the macro listed, the
/// prelude's and the runtime's names).
macro_rules! hostile {
    (
        values: [$(($value:ident $value_grads:ident $value_state:ident))*],
        functions: [$(($function:ident $function_grads:ident $function_state:ident))*],
        types: [$(($type:ident $type_grads:ident $type_state:ident))*],
    ) => {
        mod hostile {
            $(
                pub struct $value {}
                pub const $value: usize = 3;
            )*
            $(
                pub struct $function {}
                pub fn $function() {}
            )*
            $(
                pub struct $type {}
                pub const $type: usize = 3;
            )*
            // The prelude's types, variants and traits.
            pub struct Vec {}
            pub struct Option {}
            pub struct Result {}
            pub struct Box {}
            pub struct String {}
            pub const Some: usize = 3;
            pub const Ok: usize = 3;
            pub const Err: usize = 3;
            pub const None: usize = 3;
            pub trait Clone {}
            pub trait Copy {}
            pub trait Default {}
            pub trait FnMut {}
            pub trait Iterator {}
            pub trait Into {}
            pub trait From {}
            pub fn drop() {}
            // The runtime's names and the ones a layer is usually called by.
            pub struct Layer {}
            pub struct State {}
            pub struct Grads {}
            pub struct Simd {}
            pub struct Cpu {}
            pub struct Tensor {}
            pub struct Mode {}
            pub struct Element {}
            pub struct Parameters {}
            pub const Layer: usize = 3;
            pub const State: usize = 3;
            pub const Grads: usize = 3;
            pub const Simd: usize = 3;
            pub const Cpu: usize = 3;
            pub const Tensor: usize = 3;
            pub const Mode: usize = 3;
            // Modules named like the standard library's crates.
            pub mod core {}
            pub mod std {}
            pub mod alloc {}
        }

        families!(cases, [
            $(($value $value_grads $value_state))*
            $(($function $function_grads $function_state))*
            $(($type $type_grads $type_state))*
            (Vec VecGrads VecState) (Option OptionGrads OptionState)
            (Result ResultGrads ResultState) (Box BoxGrads BoxState)
            (String StringGrads StringState) (Some SomeGrads SomeState)
            (Ok OkGrads OkState) (Err ErrGrads ErrState) (None NoneGrads NoneState)
            (Layer LayerGrads LayerState) (State StateGrads StateState)
            (Grads GradsGrads GradsState) (Simd SimdGrads SimdState)
            (Cpu CpuGrads CpuState) (Tensor TensorGrads TensorState)
            (Mode ModeGrads ModeState)
        ]);
    };
}

/// `cases! { [names]; families }`: one case per name.
macro_rules! cases {
    ([$($names:tt)*]; $($family:ident: { $($keys:tt)* },)*) => {
        mod cases {
            deal!([$(($family { $($keys)* }))*] $($names)*);
        }
    };
}

/// One case per name, the families in turn (the first family moves to the back).
macro_rules! deal {
    ([$($families:tt)*]) => {};
    ([$first:tt $($rest:tt)*] $name:tt $($names:tt)*) => {
        case!($name $first);
        deal!([$($rest)* $first] $($names)*);
    };
}

/// A layer named `$layer`, among the hostile items, against its family's twin.
macro_rules! case {
    (($layer:ident $grads:ident $state:ident) ($family:ident { $($keys:tt)* })) => {
        pub mod $layer {
            use crate::hostile::*;

            ::conv_runtime::conv2d! {
                /// A layer named after a name the expansion uses itself.
                pub struct $layer { $($keys)* }
            }

            #[test]
            fn runs_every_operation_as_its_twin() {
                use crate::twins::$family::{Twin, TwinGrads, TwinState};
                let cpu = || ::conv_runtime::Cpu::with_threads(2).expect("threads");
                let ours = every_operation!($layer, $grads, $state, cpu());
                let twin = every_operation!(Twin, TwinGrads, TwinState, cpu());
                crate::common::operations::same_bits("CPU", &ours, &twin);
                #[cfg(feature = "onednn")]
                {
                    let onednn = || ::conv_runtime::OneDnn::new().expect("oneDNN");
                    let ours = every_operation!($layer, $grads, $state, onednn());
                    let twin = every_operation!(Twin, TwinGrads, TwinState, onednn());
                    crate::common::operations::same_bits("oneDNN", &ours, &twin);
                }
            }
        }
    };
}

families!(private_names);
