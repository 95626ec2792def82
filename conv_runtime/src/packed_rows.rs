//! A dense layer's rows of `x`, copied register tile by register tile so that a tile's loads
//! read one stream in order: where the rows lie a multiple of 4 KiB apart (1024 f32 inputs, or
//! 2048), every step's loads of a tile's rows and of its weight rows fall in one set of the L1
//! cache, more lines than its ways hold. Used by the generated 8-lane dense kernels and by the
//! AVX-512 one ([`crate::wide::dense`]).

use crate::Real;
use std::cell::RefCell;

std::thread_local! {
    /// Each thread's packed rows, kept from call to call (in f64 units: aligned for f32 and f64).
    static BUFFER: RefCell<Vec<f64>> = const { RefCell::new(Vec::new()) };
}

/// Copies `rows` rows of `x` (`ic` values apart) into this thread's buffer for register tiles
/// of `tile` rows: tile by tile (the last one shorter), vector `j` (`L` values) of the tile's
/// rows side by side, the last vector of each row padded with zeros past `ic` (as a partial
/// load reads it). Tile `t` starts at `t * tile * ic.div_ceil(L) * L`. `L` is a constant so
/// that each whole vector is one move, not a call of `memcpy`.
///
/// # Safety
/// `x` holds `rows` rows `ic` apart, and `A` is f32 or f64. The result is valid until this
/// thread's next call. The buffer keeps the largest size asked for: callers pack a bounded
/// number of rows at a time.
#[doc(hidden)]
pub unsafe fn pack<A: Real, const L: usize>(
    x: *const A,
    ic: usize,
    rows: usize,
    tile: usize,
) -> *const A {
    let lanes = L;
    debug_assert!(std::mem::align_of::<A>() <= 8 && std::mem::size_of::<A>() <= 8);
    let vectors = ic.div_ceil(lanes);
    let len = rows * vectors * lanes;
    let units = (len * std::mem::size_of::<A>()).div_ceil(8);
    // The borrow ends with the closure, and nothing else borrows the buffer: it cannot fail.
    let out = BUFFER.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        if buffer.len() < units {
            buffer.resize(units, 0.0);
        }
        buffer.as_mut_ptr().cast::<A>()
    });
    let mut r0 = 0;
    while r0 < rows {
        let rs = tile.min(rows - r0);
        let base = out.add(r0 * vectors * lanes);
        for j in 0..vectors {
            let n = lanes.min(ic - j * lanes);
            for r in 0..rs {
                let (src, dst) = (
                    x.add((r0 + r) * ic + j * lanes),
                    base.add((j * rs + r) * lanes),
                );
                if n == L {
                    std::ptr::copy_nonoverlapping(src, dst, L);
                } else {
                    std::ptr::copy_nonoverlapping(src, dst, n);
                    for i in n..L {
                        *dst.add(i) = A::zero();
                    }
                }
            }
        }
        r0 += rs;
    }
    out
}

/// Whether `rows` rows of `size`-byte values, `ic` apart, put their lines at fewer than `rows`
/// offsets within 4 KiB (one way of the L1 cache): where the dense kernels pack them.
/// A constant of the generated code.
pub const fn aliased(ic: usize, size: usize, rows: usize) -> bool {
    let mut lines = 0u64;
    let mut r = 0;
    while r < rows {
        lines |= 1 << (r * ic * size % 4096 / 64);
        r += 1;
    }
    (lines.count_ones() as usize) < rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_interleaved_per_tile_and_padded() {
        // 5 rows of 10 values, tiles of 3 rows, 4 lanes: 3 vectors a row, the last half zeros.
        let x: Vec<f32> = (0..50).map(|i| i as f32 + 1.0).collect();
        // SAFETY: `x` holds 5 rows of 10.
        let packed =
            unsafe { std::slice::from_raw_parts(pack::<f32, 4>(x.as_ptr(), 10, 5, 3), 60) };
        let at = |tile_start: usize, rs: usize, r: usize, k: usize| {
            packed[tile_start * 12 + ((k / 4) * rs + r) * 4 + k % 4]
        };
        for row in 0..5 {
            let (tile_start, rs) = if row < 3 { (0, 3) } else { (3, 2) };
            for k in 0..12 {
                let want = if k < 10 { x[row * 10 + k] } else { 0.0 };
                assert_eq!(
                    at(tile_start, rs, row - tile_start, k),
                    want,
                    "row {row}, k {k}"
                );
            }
        }
    }

    #[test]
    fn rows_4_kib_apart_alias() {
        assert!(aliased(1024, 4, 3));
        assert!(aliased(2048, 4, 8));
        assert!(aliased(512, 8, 3));
        assert!(!aliased(3136, 4, 8));
        assert!(!aliased(100, 4, 3));
    }
}
