//! The validated network: its entries with every shape chained (plain data that expansion
//! reads).

use syn::{Attribute, Ident, Visibility};

use crate::spec::{Activation, Dtype, Spec};

/// What flows between entries: a `[height, width, channels]` map or `features` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Map([usize; 3]),
    Flat(usize),
}

impl Shape {
    /// Values per sample.
    pub fn len(self) -> usize {
        match self {
            Shape::Map([h, w, c]) => h * w * c,
            Shape::Flat(n) => n,
        }
    }

    /// The `[h, w, c]` the generated code stores it as (a flat shape as `[1, 1, n]`).
    pub fn dims(self) -> [usize; 3] {
        match self {
            Shape::Map(d) => d,
            Shape::Flat(n) => [1, 1, n],
        }
    }
}

/// A pooling window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    Max,
    Avg,
}

pub enum Kind {
    /// A `conv2d!` layer (its spec's `ident` is the entry's name).
    Conv(Box<Spec>),
    /// A dense layer, generated as a 1x1 convolution of a `[1, 1, in]` map (its weights are
    /// `[out, in]` as PyTorch's).
    Dense(Box<Spec>),
    Pool(PoolKind, Pool),
    Activation(Activation),
    Flatten,
    Residual(Vec<Entry>),
}

pub struct Entry {
    /// The name as written.
    pub name: Ident,
    /// The name of its generated items: the entry's path joined by `__` (`block__conv1`).
    pub path: String,
    pub kind: Kind,
    pub input: Shape,
    pub output: Shape,
}

impl Entry {
    /// The layer spec of a `Conv2d` or `Dense` entry.
    pub fn layer(&self) -> Option<&Spec> {
        match &self.kind {
            Kind::Conv(spec) | Kind::Dense(spec) => Some(spec),
            _ => None,
        }
    }
}

pub struct Network {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub ident: Ident,
    pub input: [usize; 3],
    pub batch: usize,
    pub dtype: Dtype,
    pub entries: Vec<Entry>,
}

impl Network {
    pub fn output(&self) -> Shape {
        self.entries
            .last()
            .map_or(Shape::Map(self.input), |e| e.output)
    }

    /// Every entry, those inside residual blocks included, depth first.
    pub fn all_entries(&self) -> Vec<&Entry> {
        self.entries_where(|_, _| true)
    }

    /// Max-pooling entries right after a `Conv2d` in the same list: `evaluate` runs them in the
    /// convolution's epilogue where the device can.
    pub fn fused_pools(&self) -> Vec<&Entry> {
        self.entries_where(is_fused_pool)
    }

    /// The entries, depth first, for which `keep(list, index)` holds in the list holding them.
    fn entries_where(&self, keep: impl Fn(&[Entry], usize) -> bool) -> Vec<&Entry> {
        fn walk<'a>(
            entries: &'a [Entry],
            keep: &dyn Fn(&[Entry], usize) -> bool,
            out: &mut Vec<&'a Entry>,
        ) {
            for (i, e) in entries.iter().enumerate() {
                if keep(entries, i) {
                    out.push(e);
                }
                if let Kind::Residual(inner) = &e.kind {
                    walk(inner, keep, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.entries, &keep, &mut out);
        out
    }
}

/// Whether entry `i` of a list is a max-pooling right after a `Conv2d`.
pub fn is_fused_pool(entries: &[Entry], i: usize) -> bool {
    matches!(entries[i].kind, Kind::Pool(PoolKind::Max, _))
        && i > 0
        && matches!(entries[i - 1].kind, Kind::Conv(_))
}

/// Output size of a window along one axis, as conv2d! and PyTorch compute it.
pub fn window_output(input: usize, padding: usize, kernel: usize, stride: usize) -> usize {
    (input + 2 * padding - kernel) / stride + 1
}
