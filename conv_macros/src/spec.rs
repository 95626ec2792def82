//! The validated layer spec with every derived shape: plain data that expansion reads.

use syn::{Attribute, Ident, Visibility};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Identity,
    Relu,
    Gelu,
    Tanh,
    FastTanh,
    Sigmoid,
}

impl Activation {
    pub const ALL: [(&'static str, Activation); 6] = [
        ("Identity", Activation::Identity),
        ("Relu", Activation::Relu),
        ("Gelu", Activation::Gelu),
        ("Tanh", Activation::Tanh),
        ("FastTanh", Activation::FastTanh),
        ("Sigmoid", Activation::Sigmoid),
    ];

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, a)| *a == self)
            .map_or("Identity", |(n, _)| n)
    }
}

/// Variant names are the spec's own syntax (`norm: BatchNorm { .. }`).
#[allow(clippy::enum_variant_names)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Norm {
    None,
    BatchNorm { momentum: f64, eps: f64 },
    LayerNorm { eps: f64 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F64,
    F32,
    F16,
    Bf16,
}

impl Dtype {
    pub const ALL: [(&'static str, Dtype); 4] = [
        ("f64", Dtype::F64),
        ("f32", Dtype::F32),
        ("f16", Dtype::F16),
        ("bf16", Dtype::Bf16),
    ];

    /// Stored in a half type and computed in f32.
    pub fn is_half(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::Bf16)
    }

    /// Lanes of one vector register (256 bits) of the accumulator type.
    pub fn lanes(self) -> usize {
        match self {
            Dtype::F64 => 4,
            _ => 8,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    KaimingUniform { legacy: bool, scale: f64 },
}

/// A validated spec. Sizes are `[height, width]` pairs where the spec has two axes.
pub struct Spec {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub ident: Ident,
    pub input: [usize; 3],
    pub out_channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub activation: Activation,
    pub norm: Norm,
    pub batch: usize,
    pub dtype: Dtype,
    pub init: Init,
}

impl Spec {
    pub fn in_h(&self) -> usize {
        self.input[0]
    }
    pub fn in_w(&self) -> usize {
        self.input[1]
    }
    pub fn in_c(&self) -> usize {
        self.input[2]
    }
    /// Output size per axis: `(in + 2 pad - kernel) / stride + 1`.
    pub fn out_h(&self) -> usize {
        output_size(
            self.input[0],
            self.padding[0],
            self.kernel[0],
            self.stride[0],
        )
    }
    pub fn out_w(&self) -> usize {
        output_size(
            self.input[1],
            self.padding[1],
            self.kernel[1],
            self.stride[1],
        )
    }
    /// Padded input sizes.
    pub fn padded_h(&self) -> usize {
        self.input[0] + 2 * self.padding[0]
    }
    pub fn padded_w(&self) -> usize {
        self.input[1] + 2 * self.padding[1]
    }
    pub fn has_padding(&self) -> bool {
        self.padding != [0, 0]
    }
    pub fn fan_in(&self) -> usize {
        self.in_c() * self.kernel[0] * self.kernel[1]
    }
    /// Whether `other` generates the same code as this spec under its own name: the same shapes,
    /// activation, normalization, element type and initialization. Attributes and visibility
    /// are not compared (a network's layers have none and are all `pub`).
    pub fn same_layer(&self, other: &Spec) -> bool {
        self.input == other.input
            && self.out_channels == other.out_channels
            && self.kernel == other.kernel
            && self.stride == other.stride
            && self.padding == other.padding
            && self.activation == other.activation
            && self.norm == other.norm
            && self.batch == other.batch
            && self.dtype == other.dtype
            && self.init == other.init
    }
    /// The sizes every generated block names, under the names the CPU and CUDA code use.
    pub fn sizes(&self) -> [(&'static str, usize); 13] {
        [
            ("BATCH", self.batch),
            ("IH", self.in_h()),
            ("IW", self.in_w()),
            ("IC", self.in_c()),
            ("OH", self.out_h()),
            ("OW", self.out_w()),
            ("OC", self.out_channels),
            ("KH", self.kernel[0]),
            ("KW", self.kernel[1]),
            ("SH", self.stride[0]),
            ("SW", self.stride[1]),
            ("PH", self.padding[0]),
            ("PW", self.padding[1]),
        ]
    }
}

#[cfg(test)]
impl Spec {
    /// A square-kernel f32 ReLU spec for the expansion rules' unit tests.
    pub fn for_tests(
        input: [usize; 3],
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        batch: usize,
    ) -> Spec {
        Spec {
            attrs: Vec::new(),
            vis: syn::Visibility::Inherited,
            ident: syn::Ident::new("Layer", proc_macro2::Span::call_site()),
            input,
            out_channels,
            kernel: [kernel, kernel],
            stride: [stride, stride],
            padding: [padding, padding],
            activation: Activation::Relu,
            norm: Norm::None,
            batch,
            dtype: Dtype::F32,
            init: Init::KaimingUniform {
                legacy: true,
                scale: 1.0,
            },
        }
    }
}

pub fn output_size(input: usize, padding: usize, kernel: usize, stride: usize) -> usize {
    (input + 2 * padding - kernel) / stride + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_size_floors() {
        assert_eq!(output_size(84, 0, 8, 4), 20);
        assert_eq!(output_size(20, 0, 4, 2), 9);
        assert_eq!(output_size(16, 1, 3, 2), 8);
        assert_eq!(output_size(11, 2, 5, 2), 6);
        assert_eq!(output_size(3, 0, 3, 4), 1);
    }
}
