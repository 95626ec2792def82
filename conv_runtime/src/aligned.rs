//! Heap slices whose first element sits on a cache-line boundary, as tensors hold their data;
//! on Linux, those of 2 MB or more on a 2 MB boundary in transparent huge pages.
//!
//! glibc's allocator places a large block 16 bytes past a page boundary, so a tensor allocated
//! as it comes has every 64-byte vector of the AVX-512 kernels (and every other 32-byte one of
//! the AVX2 kernels) spanning two cache lines; aligned, the IMPALA CNN's forward and backward
//! passes and the Nature DQN's action (one thread) ran 1-2% faster. A network's maps and dense
//! weights are megabytes each, walked in 4 KB pages unless asked otherwise (the usual
//! `transparent_hugepage` setting is `madvise`): in huge pages, at one thread, IMPALA's training
//! step ran 5% faster and the Nature DQN's 9-11% (`bench_networks`, two runs beside the binary
//! before). The device's scratch and packed weights are buffers of this module too (`cpu.rs`).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Bytes every buffer is aligned to: a cache line (the device's scratch too, `cpu.rs`).
pub(crate) const LINE: usize = 64;
/// Bytes from which a buffer is aligned to (and advised into) huge pages: one huge page.
const HUGE: usize = 2 << 20;

/// `len` initialized elements of an allocation of `cap`, aligned as the module says.
pub(crate) struct AlignedBuf<T> {
    ptr: NonNull<T>,
    /// Elements allocated (the layout is `layout(cap)`).
    cap: usize,
    /// Elements initialized, from the first.
    len: usize,
}

// SAFETY: the buffer owns its elements, as a `Vec` does.
unsafe impl<T: Send> Send for AlignedBuf<T> {}
// SAFETY: shared access only reads, as through a `&[T]`.
unsafe impl<T: Sync> Sync for AlignedBuf<T> {}

impl<T> AlignedBuf<T> {
    /// The allocation of `cap` elements (`None`: nothing to allocate, zero bytes).
    fn layout(cap: usize) -> Option<Layout> {
        let bytes = cap.saturating_mul(std::mem::size_of::<T>());
        if bytes == 0 {
            return None;
        }
        let align = if bytes >= HUGE { HUGE } else { LINE };
        // Too large for the address space (as `Vec` does, a panic: no allocation could hold it).
        match Layout::from_size_align(bytes, align.max(std::mem::align_of::<T>())) {
            Ok(layout) => Some(layout),
            Err(e) => panic!("a tensor of {cap} elements does not fit in memory: {e}"),
        }
    }

    /// Room for `cap` elements, none initialized yet.
    fn with_capacity(cap: usize) -> Self {
        let Some(layout) = Self::layout(cap) else {
            return Self {
                ptr: NonNull::dangling(),
                cap,
                len: 0,
            };
        };
        // SAFETY: the layout's size is not zero.
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            alloc::handle_alloc_error(layout)
        };
        if layout.align() == HUGE {
            advise_huge_pages(raw, layout.size() / HUGE * HUGE);
        }
        Self { ptr, cap, len: 0 }
    }

    /// Appends `value` (`len < cap`).
    fn push(&mut self, value: T) {
        assert!(self.len < self.cap, "an aligned buffer never grows");
        // SAFETY: element `len` is inside the allocation and not initialized.
        unsafe { self.ptr.as_ptr().add(self.len).write(value) };
        self.len += 1;
    }

    /// The data.
    #[inline]
    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: the first `len` elements are initialized (a dangling, aligned pointer where
        // nothing was allocated, as an empty or zero-sized slice allows).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The data, mutably.
    #[inline]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Element `i` is `f(i)`, called in order.
    pub(crate) fn from_fn(len: usize, mut f: impl FnMut(usize) -> T) -> Self {
        let mut out = Self::with_capacity(len);
        for i in 0..len {
            out.push(f(i));
        }
        out
    }

    /// `data`'s elements, moved (a copy of their bytes; `data` keeps none).
    pub(crate) fn from_vec(mut data: Vec<T>) -> Self {
        let mut out = Self::with_capacity(data.len());
        // SAFETY: `out` has room for `data.len()` elements, in another allocation; setting
        // `data`'s length to zero first hands the elements over without dropping them twice.
        unsafe {
            let n = data.len();
            data.set_len(0);
            std::ptr::copy_nonoverlapping(data.as_ptr(), out.ptr.as_ptr(), n);
            out.len = n;
        }
        out
    }
}

impl<T: Clone> AlignedBuf<T> {
    /// At least `len` copies of `value`, as scratch memory: from 2 MB on, rounded up to whole
    /// huge pages, so that none of it is left in small pages.
    pub(crate) fn scratch(value: T, len: usize) -> Self {
        let size = std::mem::size_of::<T>().max(1);
        let per_page = HUGE / size;
        let len = if len >= per_page {
            len.div_ceil(per_page).saturating_mul(per_page)
        } else {
            len
        };
        Self::filled(value, len)
    }

    /// `len` copies of `value`.
    pub(crate) fn filled(value: T, len: usize) -> Self {
        Self::from_fn(len, |_| value.clone())
    }

    /// A copy of `data`.
    pub(crate) fn from_slice(data: &[T]) -> Self {
        Self::from_fn(data.len(), |i| data[i].clone())
    }
}

impl<T> Default for AlignedBuf<T> {
    /// No elements, nothing allocated.
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl<T: Clone> Clone for AlignedBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self.as_slice())
    }
}

impl<T> Drop for AlignedBuf<T> {
    fn drop(&mut self) {
        // SAFETY: the first `len` elements are initialized and dropped once; the allocation is
        // freed with the layout it was made with.
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ));
            if let Some(layout) = Self::layout(self.cap) {
                alloc::dealloc(self.ptr.as_ptr().cast::<u8>(), layout);
            }
        }
    }
}

/// Asks Linux to back `bytes` from `p` (on a huge-page boundary) with transparent huge pages;
/// where it declines, the pages stay small and nothing else changes.
#[cfg(target_os = "linux")]
fn advise_huge_pages(p: *mut u8, bytes: usize) {
    // SAFETY: the range is inside one allocation of this process; the advice moves no data.
    unsafe {
        libc::madvise(p.cast::<libc::c_void>(), bytes, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_: *mut u8, _: usize) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    fn aligned<T>(s: &[T], to: usize) -> bool {
        s.as_ptr().align_offset(to) == 0
    }

    #[test]
    fn every_constructor_aligns_and_keeps_the_values() {
        for len in [1, 3, 16, 1000, 100_000, (HUGE / 4) + 5] {
            let to = if len * 4 >= HUGE { HUGE } else { LINE };
            let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let filled = AlignedBuf::filled(2.5f32, len);
            assert!(aligned(filled.as_slice(), to) && filled.as_slice().len() == len);
            assert!(filled.as_slice().iter().all(|&v| v == 2.5));
            for b in [
                AlignedBuf::from_slice(&values),
                AlignedBuf::from_vec(values.clone()),
            ] {
                assert!(aligned(b.as_slice(), to));
                assert_eq!(b.as_slice(), &values[..]);
                let c = b.clone();
                assert!(aligned(c.as_slice(), to));
                assert_eq!(c.as_slice(), &values[..]);
            }
            let halves: Vec<u16> = (0..len).map(|i| i as u16).collect();
            let b = AlignedBuf::from_vec(halves.clone());
            assert!(aligned(b.as_slice(), LINE));
            assert_eq!(b.as_slice(), &halves[..]);
        }
        let empty = AlignedBuf::<f64>::from_slice(&[]);
        assert!(empty.as_slice().is_empty());
        let units = AlignedBuf::filled((), 7);
        assert_eq!(units.as_slice().len(), 7);
        let squares = AlignedBuf::from_fn(5, |i| i * i);
        assert_eq!(squares.as_slice(), &[0, 1, 4, 9, 16]);
    }

    #[test]
    fn writes_land_in_the_data() {
        let mut b = AlignedBuf::filled(0.0f64, 10);
        b.as_mut_slice()[9] = 1.0;
        assert_eq!(b.as_slice()[9], 1.0);
        assert_eq!(b.clone().as_slice()[9], 1.0);
    }

    #[test]
    fn elements_are_dropped_once() {
        let shared = Rc::new(());
        {
            let moved = AlignedBuf::from_vec(vec![shared.clone(), shared.clone()]);
            let copied = moved.clone();
            assert_eq!(Rc::strong_count(&shared), 5);
            drop((moved, copied));
        }
        assert_eq!(Rc::strong_count(&shared), 1);
    }
}
