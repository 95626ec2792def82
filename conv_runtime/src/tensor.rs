//! Dense, heap-allocated tensors whose shapes live in the type.
//!
//! Every tensor carries a *stamp*: a process-wide unique number that changes whenever the data may
//! have changed (creation, `as_mut_slice`). Two tensors with the same stamp hold the same values
//! (a clone keeps its stamp). Devices use it to cache weights repacked into kernel order: the
//! repack happens once per parameter change, yet public fields stay plain data.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::element::Element;

static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

pub(crate) fn fresh_stamp() -> u64 {
    NEXT_STAMP.fetch_add(1, Ordering::Relaxed)
}

/// A buffer handed to `from_vec` whose length does not match the tensor's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError {
    /// Element count the shape needs.
    pub expected: usize,
    /// Element count that was given.
    pub got: usize,
    /// The shape, for the message.
    pub shape: &'static str,
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shape mismatch: a {} needs {} elements, got {}",
            self.shape, self.expected, self.got
        )
    }
}

impl std::error::Error for ShapeError {}

macro_rules! dense {
    ($(#[$doc:meta])* $name:ident [$($dim:ident),+], $shape:literal) => {
        $(#[$doc])*
        pub struct $name<T, $(const $dim: usize),+> {
            data: Box<[T]>,
            stamp: u64,
        }

        impl<T: Element, $(const $dim: usize),+> $name<T, $($dim),+> {
            /// Number of elements.
            pub const LEN: usize = 1 $(* $dim)+;

            /// All zeros.
            pub fn zeros() -> Self {
                Self { data: vec![T::zero(); Self::LEN].into_boxed_slice(), stamp: fresh_stamp() }
            }

            /// Takes a row-major buffer of exactly `LEN` elements.
            pub fn from_vec(data: Vec<T>) -> Result<Self, ShapeError> {
                if data.len() != Self::LEN {
                    return Err(ShapeError { expected: Self::LEN, got: data.len(), shape: $shape });
                }
                Ok(Self { data: data.into_boxed_slice(), stamp: fresh_stamp() })
            }

            /// Element `i` (row-major flat index) is `f(i)`.
            pub fn from_fn(f: impl FnMut(usize) -> T) -> Self {
                Self { data: (0..Self::LEN).map(f).collect(), stamp: fresh_stamp() }
            }

            /// Sets every element to `value`.
            pub fn fill(&mut self, value: T) {
                self.as_mut_slice().fill(value);
            }
        }

        impl<T, $(const $dim: usize),+> $name<T, $($dim),+> {
            /// The row-major data.
            #[inline]
            pub fn as_slice(&self) -> &[T] {
                &self.data
            }

            /// The row-major data, mutably; gives the tensor a new stamp.
            #[inline]
            pub fn as_mut_slice(&mut self) -> &mut [T] {
                self.stamp = fresh_stamp();
                &mut self.data
            }

            /// Identifies the current contents (see the module docs).
            #[inline]
            pub fn stamp(&self) -> u64 {
                self.stamp
            }
        }

        impl<T: Clone, $(const $dim: usize),+> Clone for $name<T, $($dim),+> {
            fn clone(&self) -> Self {
                Self { data: self.data.clone(), stamp: self.stamp }
            }
        }

        impl<T: fmt::Debug, $(const $dim: usize),+> fmt::Debug for $name<T, $($dim),+> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("shape", &[$($dim),+])
                    .field("data", &self.data)
                    .finish()
            }
        }

        impl<T: PartialEq, $(const $dim: usize),+> PartialEq for $name<T, $($dim),+> {
            fn eq(&self, other: &Self) -> bool {
                self.data == other.data
            }
        }

        impl<T: Element, $(const $dim: usize),+> Default for $name<T, $($dim),+> {
            fn default() -> Self {
                Self::zeros()
            }
        }
    };
}

dense!(
    /// A 4-D tensor, row-major `[N][H][W][C]` (NHWC; for weights OHWI).
    Tensor[N, H, W, C],
    "Tensor"
);
dense!(
    /// A 1-D tensor (per-channel parameters and statistics).
    Vector[N],
    "Vector"
);

impl<T, const N: usize, const H: usize, const W: usize, const C: usize> Tensor<T, N, H, W, C> {
    /// The shape as `[N, H, W, C]`.
    pub const SHAPE: [usize; 4] = [N, H, W, C];
}

impl<T, const N: usize> Vector<T, N> {
    /// The shape as `[N]`.
    pub const SHAPE: [usize; 1] = [N];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_vec_checks_length() {
        let err = Tensor::<f32, 1, 2, 2, 3>::from_vec(vec![0.0; 11]).unwrap_err();
        assert_eq!((err.expected, err.got), (12, 11));
        assert!(Vector::<f64, 3>::from_vec(vec![1.0; 3]).is_ok());
    }

    #[test]
    fn stamp_follows_mutation_not_clone() {
        let mut t = Tensor::<f32, 1, 1, 1, 4>::from_fn(|i| i as f32);
        let c = t.clone();
        assert_eq!(t.stamp(), c.stamp());
        t.as_mut_slice()[0] = 5.0;
        assert_ne!(t.stamp(), c.stamp());
    }
}
