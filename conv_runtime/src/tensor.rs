//! Dense, heap-allocated tensors whose shapes live in the type.
//!
//! Every tensor carries a *stamp*: a process-wide unique number that changes whenever the data may
//! have changed (creation, `as_mut_slice`). Two tensors with the same stamp hold the same values
//! (a clone keeps its stamp). Devices use it to cache weights repacked into kernel order: the
//! repack happens once per parameter change, yet public fields stay plain data.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::element::Element;
use crate::params::ParamTensor;

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
        // `repr(C)`: every dense type has the same layout, so a view of one as another of the
        // same length (`crate::network::view`) is the same memory.
        #[repr(C)]
        pub struct $name<T, $(const $dim: usize),+> {
            data: crate::aligned::AlignedBuf<T>,
            stamp: u64,
        }

        // SAFETY: `repr(C)` with the fields every dense type has.
        unsafe impl<T, $(const $dim: usize),+> crate::network::Dense for $name<T, $($dim),+> {
            type Elem = T;
            const LEN: usize = 1 $(* $dim)+;
        }

        impl<T: Element, $(const $dim: usize),+> $name<T, $($dim),+> {
            /// Number of elements.
            pub const LEN: usize = 1 $(* $dim)+;

            /// All zeros.
            pub fn zeros() -> Self {
                Self { data: crate::aligned::AlignedBuf::filled(T::zero(), Self::LEN), stamp: fresh_stamp() }
            }

            /// Takes a row-major buffer of exactly `LEN` elements (moved into the tensor's own
            /// aligned allocation: a copy of its bytes).
            pub fn from_vec(data: Vec<T>) -> Result<Self, ShapeError> {
                if data.len() != Self::LEN {
                    return Err(ShapeError { expected: Self::LEN, got: data.len(), shape: $shape });
                }
                Ok(Self { data: crate::aligned::AlignedBuf::from_vec(data), stamp: fresh_stamp() })
            }

            /// Element `i` (row-major flat index) is `f(i)`.
            pub fn from_fn(f: impl FnMut(usize) -> T) -> Self {
                Self { data: crate::aligned::AlignedBuf::from_fn(Self::LEN, f), stamp: fresh_stamp() }
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
                self.data.as_slice()
            }

            /// The row-major data, mutably; gives the tensor a new stamp.
            #[inline]
            pub fn as_mut_slice(&mut self) -> &mut [T] {
                self.stamp = fresh_stamp();
                self.data.as_mut_slice()
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
                    .field("data", &self.data.as_slice())
                    .finish()
            }
        }

        impl<T: PartialEq, $(const $dim: usize),+> PartialEq for $name<T, $($dim),+> {
            fn eq(&self, other: &Self) -> bool {
                self.data.as_slice() == other.data.as_slice()
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
dense!(
    /// A 2-D tensor, row-major `[R][C]`: a batch of `R` flat samples of `C` values each (a
    /// network's output after `Flatten` or `Dense`: logits, Q-values), or a dense layer's
    /// weights `[out][in]` (PyTorch's `nn.Linear.weight` layout).
    Matrix[R, C],
    "Matrix"
);

impl<T, const N: usize, const H: usize, const W: usize, const C: usize> Tensor<T, N, H, W, C> {
    /// The shape as `[N, H, W, C]`.
    pub const SHAPE: [usize; 4] = [N, H, W, C];
}

impl<T, const N: usize> Vector<T, N> {
    /// The shape as `[N]`.
    pub const SHAPE: [usize; 1] = [N];
}

impl<T, const R: usize, const C: usize> Matrix<T, R, C> {
    /// The shape as `[R, C]`.
    pub const SHAPE: [usize; 2] = [R, C];

    /// Row `i` (sample `i` of a batch).
    ///
    /// # Panics
    ///
    /// If `i >= R`, as slice indexing does.
    #[inline]
    pub fn row(&self, i: usize) -> &[T] {
        assert!(i < R, "row {i} of a matrix with {R} rows");
        &self.as_slice()[i * C..(i + 1) * C]
    }

    /// Row `i`, mutably; gives the matrix a new stamp.
    ///
    /// # Panics
    ///
    /// If `i >= R`, as slice indexing does.
    #[inline]
    pub fn row_mut(&mut self, i: usize) -> &mut [T] {
        assert!(i < R, "row {i} of a matrix with {R} rows");
        &mut self.as_mut_slice()[i * C..(i + 1) * C]
    }

    /// The rows in order (`R` of them, also when `C` is 0).
    pub fn rows(&self) -> impl ExactSizeIterator<Item = &[T]> + '_ {
        (0..R).map(move |i| self.row(i))
    }
}

/// A dense layer's weights are a matrix; optimizers and checkpoints see its two-dimensional
/// shape, so a safetensors file stores `[out, in]` as PyTorch does.
impl<T, const R: usize, const C: usize> ParamTensor<T> for Matrix<T, R, C> {
    fn values_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
    fn values(&self) -> &[T] {
        self.as_slice()
    }
    fn stamp(&self) -> u64 {
        Matrix::stamp(self)
    }
    fn shape(&self) -> &'static [usize] {
        &Self::SHAPE
    }
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

    #[test]
    fn matrix_rows_are_row_major() {
        let mut m = Matrix::<f32, 3, 2>::from_fn(|i| i as f32);
        assert_eq!(
            (Matrix::<f32, 3, 2>::LEN, Matrix::<f32, 3, 2>::SHAPE),
            (6, [3, 2])
        );
        assert_eq!(m.row(1), &[2.0, 3.0]);
        let rows: Vec<&[f32]> = m.rows().collect();
        assert_eq!(rows, [&[0.0, 1.0][..], &[2.0, 3.0], &[4.0, 5.0]]);
        let stamp = m.stamp();
        m.row_mut(2)[0] = 9.0;
        assert_ne!(m.stamp(), stamp);
        assert_eq!(m.as_slice()[4], 9.0);
        assert_eq!(Matrix::<f64, 4, 0>::zeros().rows().count(), 4);
        let err = Matrix::<f32, 2, 3>::from_vec(vec![0.0; 5]).unwrap_err();
        assert_eq!((err.expected, err.got, err.shape), (6, 5, "Matrix"));
        assert_eq!(
            format!("{:?}", Matrix::<f32, 1, 2>::zeros()),
            "Matrix { shape: [1, 2], data: [0.0, 0.0] }"
        );
    }

    #[test]
    #[should_panic(expected = "row 2 of a matrix with 2 rows")]
    fn matrix_row_out_of_range_panics() {
        let m = Matrix::<f32, 2, 3>::zeros();
        let _ = m.row(2);
    }
}
