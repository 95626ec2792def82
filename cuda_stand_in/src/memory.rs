//! Device memory: host memory, one mapping per allocation, in a table of live allocations that
//! every copy, memset, kernel launch and cuDNN call is checked against.
//!
//! Each allocation ends against an inaccessible guard page (its start 16-byte aligned, as the
//! kernels' widest loads need; a GPU aligns to 256), with an inaccessible page before it too, so
//! a kernel that runs off a buffer faults instead of reading a neighbour. The few bytes between
//! the end and the guard page, and the 16 before the start, hold a canary that a launch checks
//! afterwards: writing there is an error too. Fresh memory holds `0xff` bytes (NaN in every
//! floating-point type), not zeros, so a read of memory nothing wrote shows. Freed memory
//! becomes inaccessible and stays reserved for a while (the last [`QUARANTINE`] frees), so a
//! kernel using a stale pointer faults instead of reading a newer allocation.
//!
//! The live allocations count against a budget, `CUDA_STAND_IN_MEMORY` bytes (a `K`, `M` or `G`
//! suffix allowed; 8 GiB by default): beyond it allocation fails as on a full GPU.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Alignment of every allocation's start.
const ALIGN: usize = 16;
/// Written around each allocation; checked after each launch.
const CANARY: u8 = 0xcd;
/// Fresh memory's bytes.
const FRESH: u8 = 0xff;
/// How many freed allocations stay reserved (inaccessible) before their addresses are reused.
pub const QUARANTINE: usize = 4096;
/// The default budget.
const DEFAULT_BUDGET: usize = 8 << 30;

/// Why a memory operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// Beyond the budget, or the host refused the mapping.
    OutOfMemory,
    /// Not a live allocation (never allocated, freed, or a range that leaves it).
    Invalid,
}

/// One live allocation.
#[derive(Clone, Copy, Debug)]
pub struct Allocation {
    /// The mapping: a guard page, the accessible pages, a guard page.
    map: usize,
    map_len: usize,
    /// The device pointer and the size asked for.
    pub ptr: u64,
    pub len: usize,
    /// The context it belongs to (freed with it).
    pub context: u64,
}

impl Allocation {
    fn end(&self) -> u64 {
        self.ptr + self.len as u64
    }

    /// The first byte of the trailing guard page.
    fn guard(&self) -> usize {
        self.map + self.map_len - page()
    }
}

struct Memory {
    live: BTreeMap<u64, Allocation>,
    used: usize,
    /// Freed mappings, oldest first, inaccessible until unmapped.
    freed: VecDeque<Allocation>,
}

static MEMORY: Mutex<Memory> = Mutex::new(Memory {
    live: BTreeMap::new(),
    used: 0,
    freed: VecDeque::new(),
});

fn memory() -> MutexGuard<'static, Memory> {
    // The table stays consistent whatever panicked while holding it.
    MEMORY
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn page() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(size)
            .ok()
            .filter(|&s| s > 0)
            .unwrap_or(4096)
    })
}

/// The budget in bytes.
pub fn budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        crate::env("CUDA_STAND_IN_MEMORY")
            .and_then(|v| parse_size(&v))
            .unwrap_or(DEFAULT_BUDGET)
    })
}

/// `123`, `64K`, `512M`, `8G` (binary multiples) as bytes.
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last()?.to_ascii_uppercase() {
        'K' => (&text[..text.len() - 1], 10),
        'M' => (&text[..text.len() - 1], 20),
        'G' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(1 << shift)
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|m| m / to * to)
}

/// Bytes of live allocations.
pub fn used() -> usize {
    memory().used
}

/// A new allocation of `len` bytes (not zeroed: [`FRESH`] bytes) for `context`.
pub fn alloc(len: usize, context: u64) -> Result<u64, Error> {
    if len == 0 {
        return Err(Error::Invalid);
    }
    let mut m = memory();
    if m.used.checked_add(len).is_none_or(|total| total > budget()) {
        return Err(Error::OutOfMemory);
    }
    let page = page();
    // Room for the leading canary, whatever the alignment takes.
    let body = round_up(len, ALIGN)
        .and_then(|n| n.checked_add(ALIGN))
        .ok_or(Error::OutOfMemory)?;
    let accessible = round_up(body, page).ok_or(Error::OutOfMemory)?;
    let map_len = accessible.checked_add(2 * page).ok_or(Error::OutOfMemory)?;
    // SAFETY: a fresh anonymous mapping; nothing else refers to it.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(Error::OutOfMemory);
    }
    let map = map as usize;
    // SAFETY: inside the mapping just made.
    if unsafe {
        libc::mprotect(
            (map + page) as *mut libc::c_void,
            accessible,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    } != 0
    {
        // SAFETY: the mapping just made, unused.
        unsafe { libc::munmap(map as *mut libc::c_void, map_len) };
        return Err(Error::OutOfMemory);
    }
    let guard = map + page + accessible;
    let ptr = (guard - len) & !(ALIGN - 1);
    // SAFETY: [map + page, guard) is accessible and ours.
    unsafe {
        let start = (map + page) as *mut u8;
        std::ptr::write_bytes(start, CANARY, ptr - (map + page));
        std::ptr::write_bytes(ptr as *mut u8, FRESH, len);
        std::ptr::write_bytes((ptr + len) as *mut u8, CANARY, guard - (ptr + len));
    }
    let a = Allocation {
        map,
        map_len,
        ptr: ptr as u64,
        len,
        context,
    };
    m.live.insert(a.ptr, a);
    m.used += len;
    Ok(a.ptr)
}

/// Frees the allocation that starts at `ptr`.
pub fn free(ptr: u64) -> Result<(), Error> {
    let mut m = memory();
    let a = m.live.remove(&ptr).ok_or(Error::Invalid)?;
    m.used -= a.len;
    retire(&mut m, a);
    Ok(())
}

/// Makes a freed allocation inaccessible and keeps its addresses reserved for a while.
fn retire(m: &mut Memory, a: Allocation) {
    // SAFETY: the allocation's own mapping, no longer in the table.
    unsafe {
        libc::mprotect(a.map as *mut libc::c_void, a.map_len, libc::PROT_NONE);
        libc::madvise(a.map as *mut libc::c_void, a.map_len, libc::MADV_DONTNEED);
    }
    m.freed.push_back(a);
    while m.freed.len() > QUARANTINE {
        if let Some(old) = m.freed.pop_front() {
            // SAFETY: a retired mapping nothing refers to any more.
            unsafe { libc::munmap(old.map as *mut libc::c_void, old.map_len) };
        }
    }
}

/// Frees every allocation of `context` (the context was destroyed).
pub fn free_context(context: u64) {
    let mut m = memory();
    let gone: Vec<u64> = m
        .live
        .values()
        .filter(|a| a.context == context)
        .map(|a| a.ptr)
        .collect();
    for ptr in gone {
        if let Some(a) = m.live.remove(&ptr) {
            m.used -= a.len;
            retire(&mut m, a);
        }
    }
}

/// The live allocation holding the address `at`.
pub fn find(at: u64) -> Option<Allocation> {
    let m = memory();
    let (_, a) = m.live.range(..=at).next_back()?;
    (at < a.end()).then_some(*a)
}

/// An error unless `[ptr, ptr + len)` lies inside one live allocation (an empty range anywhere).
pub fn check(ptr: u64, len: usize) -> Result<Allocation, Error> {
    let a = find(ptr).ok_or(Error::Invalid)?;
    let end = ptr.checked_add(len as u64).ok_or(Error::Invalid)?;
    if end > a.end() {
        return Err(Error::Invalid);
    }
    Ok(a)
}

/// Whether the canaries around the allocation holding `at` are intact.
pub fn canaries_intact(at: u64) -> bool {
    let Some(a) = find(at) else {
        return true;
    };
    let (ptr, end, guard) = (a.ptr as usize, a.end() as usize, a.guard());
    // SAFETY: both ranges lie in the allocation's accessible pages, which stay mapped while it
    // is live.
    let (before, after) = unsafe {
        (
            std::slice::from_raw_parts((ptr - ALIGN) as *const u8, ALIGN),
            std::slice::from_raw_parts(end as *const u8, guard - end),
        )
    };
    before.iter().chain(after).all(|&b| b == CANARY)
}

/// Where `at` is, for a fault's message.
pub fn describe(at: u64) -> String {
    let m = memory();
    let near = |a: &Allocation| {
        let at = at as usize;
        at >= a.map && at < a.map + a.map_len
    };
    if let Some(a) = m.live.values().find(|a| near(a)) {
        if at >= a.end() {
            return format!(
                "{} bytes past the end of the {}-byte allocation at {:#x}",
                at - a.end() + 1,
                a.len,
                a.ptr
            );
        }
        if at < a.ptr {
            return format!(
                "{} bytes before the {}-byte allocation at {:#x}",
                a.ptr - at,
                a.len,
                a.ptr
            );
        }
        return format!("inside the {}-byte allocation at {:#x}", a.len, a.ptr);
    }
    if let Some(a) = m.freed.iter().rev().find(|a| near(a)) {
        return format!("in the freed {}-byte allocation at {:#x}", a.len, a.ptr);
    }
    "outside device memory".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size("64k"), Some(64 << 10));
        assert_eq!(parse_size("8G"), Some(8 << 30));
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn table() {
        let _serial = crate::test_lock();
        let before = used();
        let p = alloc(10, 0).unwrap();
        assert_eq!(p % ALIGN as u64, 0);
        assert_eq!(used(), before + 10);
        // Fresh memory is NaN, not zero.
        // SAFETY: a live 10-byte allocation.
        assert_eq!(unsafe { *(p as *const u8) }, FRESH);
        assert!(check(p, 10).is_ok());
        assert!(check(p + 9, 1).is_ok());
        assert_eq!(check(p + 1, 10).err(), Some(Error::Invalid));
        assert_eq!(check(p + 10, 1).err(), Some(Error::Invalid));
        assert_eq!(check(p - 1, 1).err(), Some(Error::Invalid));
        assert!(canaries_intact(p));
        // SAFETY: the byte after the allocation, inside its accessible page (a canary).
        unsafe { *((p + 10) as *mut u8) = 0 };
        assert!(!canaries_intact(p));
        assert!(describe(p + 11).contains("2 bytes past the end of the 10-byte allocation"));
        free(p).unwrap();
        assert_eq!(used(), before);
        assert_eq!(check(p, 1).err(), Some(Error::Invalid));
        assert_eq!(free(p), Err(Error::Invalid), "double free");
        assert!(describe(p).contains("freed 10-byte allocation"));
        assert_eq!(alloc(0, 0), Err(Error::Invalid));
        assert_eq!(alloc(budget() + 1, 0), Err(Error::OutOfMemory));
    }

    #[test]
    fn contexts_free_their_memory() {
        let _serial = crate::test_lock();
        let a = alloc(100, 77).unwrap();
        let b = alloc(100, 78).unwrap();
        free_context(77);
        assert!(find(a).is_none());
        assert!(find(b).is_some());
        free(b).unwrap();
    }
}
