//! Heap slices whose first element sits on a cache-line boundary, as tensors hold their data.
//!
//! glibc's allocator places a large block 16 bytes past a page boundary, so a tensor allocated
//! as it comes has every 64-byte vector of the AVX-512 kernels (and every other 32-byte one of
//! the AVX2 kernels) spanning two cache lines. Aligned, the IMPALA CNN's forward and backward
//! passes and the Nature DQN's action (one thread) ran 1-2% faster, in alternating runs of the
//! same loops. The device's scratch and packed weights are aligned the same way (`cpu.rs`).

/// Bytes the data is aligned to: a cache line.
const ALIGN: usize = 64;

/// `len` elements of one allocation, from its first `ALIGN`-byte boundary on.
pub(crate) struct AlignedBuf<T> {
    /// The allocation: `start` elements of padding, the data, the rest of the padding. It never
    /// grows, so it never moves.
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T> AlignedBuf<T> {
    /// Elements of padding enough for any allocation to reach a boundary.
    const PAD: usize = ALIGN
        / if std::mem::size_of::<T>() == 0 {
            1
        } else {
            std::mem::size_of::<T>()
        };

    /// The data.
    #[inline]
    pub(crate) fn as_slice(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The data, mutably.
    #[inline]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// Where the first boundary of `buf` is (0 where none is within the padding: the data
    /// then starts unaligned, never outside the allocation).
    fn start_of(buf: &[T]) -> usize {
        match buf.as_ptr().align_offset(ALIGN) {
            offset if offset <= Self::PAD => offset,
            _ => 0,
        }
    }
}

impl<T: Clone> AlignedBuf<T> {
    /// `len` copies of `value`.
    pub(crate) fn filled(value: T, len: usize) -> Self {
        let buf = vec![value; len + Self::PAD];
        let start = Self::start_of(&buf);
        Self { buf, start, len }
    }

    /// A copy of `data`.
    pub(crate) fn from_slice(data: &[T]) -> Self {
        match data.first() {
            Some(first) => {
                let mut out = Self::filled(first.clone(), data.len());
                out.as_mut_slice().clone_from_slice(data);
                out
            }
            None => Self {
                buf: Vec::new(),
                start: 0,
                len: 0,
            },
        }
    }

    /// `data` itself where it starts on a boundary, else a copy.
    pub(crate) fn from_vec(data: Vec<T>) -> Self {
        if data.as_ptr().align_offset(ALIGN) == 0 {
            let len = data.len();
            Self {
                buf: data,
                start: 0,
                len,
            }
        } else {
            Self::from_slice(&data)
        }
    }
}

impl<T: Clone> Clone for AlignedBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aligned<T>(s: &[T]) -> bool {
        s.as_ptr().align_offset(ALIGN) == 0
    }

    #[test]
    fn every_constructor_aligns_and_keeps_the_values() {
        for len in [1, 3, 16, 1000, 100_000] {
            let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let filled = AlignedBuf::filled(2.5f32, len);
            assert!(aligned(filled.as_slice()) && filled.as_slice().len() == len);
            assert!(filled.as_slice().iter().all(|&v| v == 2.5));
            for b in [
                AlignedBuf::from_slice(&values),
                AlignedBuf::from_vec(values.clone()),
            ] {
                assert!(aligned(b.as_slice()));
                assert_eq!(b.as_slice(), &values[..]);
                let c = b.clone();
                assert!(aligned(c.as_slice()));
                assert_eq!(c.as_slice(), &values[..]);
            }
            let halves: Vec<u16> = (0..len).map(|i| i as u16).collect();
            let b = AlignedBuf::from_vec(halves.clone());
            assert!(aligned(b.as_slice()));
            assert_eq!(b.as_slice(), &halves[..]);
        }
        let empty = AlignedBuf::<f64>::from_slice(&[]);
        assert!(empty.as_slice().is_empty());
    }

    #[test]
    fn writes_land_in_the_data() {
        let mut b = AlignedBuf::filled(0.0f64, 10);
        b.as_mut_slice()[9] = 1.0;
        assert_eq!(b.as_slice()[9], 1.0);
        assert_eq!(b.clone().as_slice()[9], 1.0);
    }
}
