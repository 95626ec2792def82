//! The CPU device: scratch memory and the cache of weights repacked into kernel order.

use std::any::Any;

use crate::element::Real;

/// Whether a forward pass trains (BatchNorm uses and updates batch statistics) or evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Batch statistics; running statistics are updated.
    #[default]
    Train,
    /// Running statistics, used as constants (also by the backward pass).
    Eval,
}

/// Identifies one packed copy of parameters: the stamps of the tensors it was built from and
/// the layout (a number the macro derives from the kernel's blocking).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackKey {
    pub stamps: [u64; 2],
    pub layout: u64,
}

struct Packed {
    key: PackKey,
    last_use: u64,
    /// A `Vec<A>` holding the packed values from its first cache-line boundary on.
    data: Box<dyn Any + Send>,
    len: usize,
}

/// Bytes the packed copies and the scratch memory are aligned to: a cache line, so that no
/// vector load of the kernels splits one (the allocator gives 16, and the kernels' 32-byte loads
/// from such buffers ran about 10% slower).
const ALIGN: usize = 64;

/// `len` elements of `v` from its first `ALIGN`-byte boundary on, growing it as needed.
fn aligned<A: CpuScalar>(v: &mut Vec<A>, len: usize) -> &mut [A] {
    let extra = ALIGN / std::mem::size_of::<A>();
    if v.len() < len + extra {
        v.resize(len + extra, A::zero());
    }
    let offset = aligned_offset(v);
    &mut v[offset..offset + len]
}

/// Where `v`'s first `ALIGN`-byte boundary is (0 where the allocation cannot reach one).
fn aligned_offset<A>(v: &[A]) -> usize {
    let offset = v.as_ptr().align_offset(ALIGN);
    if offset < ALIGN / std::mem::size_of::<A>() {
        offset
    } else {
        0
    }
}

/// Packed copies kept per device; enough for the layers of a typical network, each with a
/// forward and a backward layout. Least recently used is dropped first.
const PACK_CAPACITY: usize = 32;

/// The generated CPU code's device: single-threaded, deterministic.
///
/// It owns reusable scratch memory and a small cache of weights repacked into the order each
/// kernel reads them, keyed by the weights' content stamp (see [`crate::Tensor`]), so a
/// parameter change costs one repack and an unchanged layer none.
#[derive(Default)]
pub struct Cpu {
    packs: Vec<Packed>,
    clock: u64,
    scratch: Scratch,
}

/// Reusable scratch memory, one buffer per scalar type.
#[doc(hidden)]
#[derive(Default)]
pub struct Scratch {
    f32: Vec<f32>,
    f64: Vec<f64>,
}

impl std::fmt::Debug for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cpu")
            .field("packed_entries", &self.packs.len())
            .finish()
    }
}

/// Scalars the CPU device keeps scratch memory for.
#[doc(hidden)]
pub trait CpuScalar: Real {
    fn buffer(scratch: &mut Scratch) -> &mut Vec<Self>;
}

impl CpuScalar for f32 {
    fn buffer(scratch: &mut Scratch) -> &mut Vec<f32> {
        &mut scratch.f32
    }
}

impl CpuScalar for f64 {
    fn buffer(scratch: &mut Scratch) -> &mut Vec<f64> {
        &mut scratch.f64
    }
}

/// What a generated kernel gets from the device for one call.
#[doc(hidden)]
pub struct Workspace<'a, A> {
    /// Parameters in kernel order.
    pub packed: &'a [A],
    /// Scratch memory of the requested length; its contents are left over from earlier calls,
    /// so kernels clear what they accumulate into (clearing all of it cost more than some
    /// small layers' convolutions).
    pub scratch: &'a mut [A],
}

impl Cpu {
    /// A device with empty caches.
    pub fn new() -> Self {
        Self::default()
    }

    /// Packed parameters for `key` (built by `pack` on a miss) and `scratch_len` scratch
    /// elements (not cleared).
    #[doc(hidden)]
    pub fn __workspace<A: CpuScalar>(
        &mut self,
        key: PackKey,
        packed_len: usize,
        pack: impl FnOnce(&mut [A]),
        scratch_len: usize,
    ) -> Workspace<'_, A> {
        self.clock += 1;
        let clock = self.clock;
        let hit = self
            .packs
            .iter()
            .position(|p| p.key == key && p.data.is::<Vec<A>>());
        let index = match hit {
            Some(i) => i,
            None => {
                // A full cache gives up its least recently used entry, and that entry's memory:
                // after every optimizer step each layer misses, and fresh allocations of
                // packed weights cost page faults that took as long as the convolution.
                let victim = (self.packs.len() >= PACK_CAPACITY).then(|| {
                    (0..self.packs.len())
                        .min_by_key(|&i| self.packs[i].last_use)
                        .unwrap_or(0)
                });
                let mut data = match victim {
                    Some(i) => {
                        let old = std::mem::replace(&mut self.packs[i].data, Box::new(()));
                        old.downcast::<Vec<A>>().map(|v| *v).unwrap_or_default()
                    }
                    None => Vec::new(),
                };
                data.clear();
                pack(aligned(&mut data, packed_len));
                let entry = Packed {
                    key,
                    last_use: clock,
                    data: Box::new(data),
                    len: packed_len,
                };
                match victim {
                    Some(i) => {
                        self.packs[i] = entry;
                        i
                    }
                    None => {
                        self.packs.push(entry);
                        self.packs.len() - 1
                    }
                }
            }
        };
        self.packs[index].last_use = clock;
        let entry = &self.packs[index];
        let packed = match entry.data.downcast_ref::<Vec<A>>() {
            Some(v) => &v[aligned_offset(v)..][..entry.len],
            None => unreachable!("the entry's type was checked when it was found or built"),
        };
        Workspace {
            packed,
            scratch: aligned(A::buffer(&mut self.scratch), scratch_len),
        }
    }

    /// Drops every cached packed copy.
    pub fn clear_cache(&mut self) {
        self.packs.clear();
    }
}
