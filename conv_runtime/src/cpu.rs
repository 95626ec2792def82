//! The CPU device: its threads, scratch memory and the cache of weights repacked into kernel
//! order.

use std::any::Any;
use std::marker::PhantomData;
use std::ops::Range;

use crate::aligned::AlignedBuf;
use crate::element::Real;
use crate::team::Team;
use crate::{Error, Result};

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
    /// An `AlignedBuf<A>` holding the packed values from its start on.
    data: Box<dyn Any + Send>,
    len: usize,
}

/// The first `len` elements of `buf`, replaced by a larger buffer where it is too short (its
/// values are scratch, not kept). The buffer starts on a cache line, so that no vector load of
/// the kernels splits one (the allocator gives 16, and the kernels' 32-byte loads from such
/// buffers ran about 10% slower), and from 2 MB on in transparent huge pages (see
/// `crate::aligned`): the Winograd layers' transforms are megabytes, walked once a pass.
fn at_least<A: CpuScalar>(buf: &mut AlignedBuf<A>, len: usize) -> &mut [A] {
    if buf.as_slice().len() < len {
        // The old buffer goes first: its values are not kept, and both at once would be the
        // device's largest memory peak.
        drop(std::mem::take(buf));
        *buf = AlignedBuf::scratch(A::zero(), len);
    }
    &mut buf.as_mut_slice()[..len]
}

/// Packed copies kept per device; enough for the layers of a typical network, each with a
/// forward and a backward layout. Least recently used is dropped first.
const PACK_CAPACITY: usize = 32;

/// The generated CPU code's device: deterministic on any number of threads.
///
/// It owns its threads (`Cpu::default()` has one, the caller's; [`Cpu::with_threads`] adds a
/// team of its own), reusable scratch memory and a small cache of weights repacked into the order each
/// kernel reads them, keyed by the weights' content stamp (see [`crate::Tensor`]), so a
/// parameter change costs one repack and an unchanged layer none.
///
/// Every operation splits its work into parts the macro chose from the spec (output pixels,
/// images, weight-gradient positions), runs them on the device's threads, and sums every
/// reduction (weight, bias and normalization gradients, statistics) over a fixed number of
/// partial sums in a fixed order: results are bit-identical for every thread count. Calls whose
/// work is too small to pay for a hand-off stay on the calling thread.
///
/// Threads are the device's own: two devices of 4 threads each (each its caller and 3 workers)
/// use 8 cores. Size devices so that their threads add up to the cores, e.g.
/// `Cpu::with_threads(cores / actors)` for one device per actor thread.
///
/// Memory: scratch is sized by the spec of each call and kept for the next; the thread count
/// adds only the workers' own parts: an image group of the input gradient each (together the
/// batch's input gradient and at most one image per worker) and one Winograd chunk's
/// transforms and staged input images each. Partial sums do not grow with the threads: the
/// Winograd weight gradient keeps at most 8 partials of the layer's transformed weights, bias
/// gradients and normalization statistics at most 8 of `OC` values.
#[derive(Default)]
pub struct Cpu {
    packs: Vec<Packed>,
    clock: u64,
    /// Keys asked about by [`Cpu::__reused`] without a packed copy, and how often: the most
    /// recently asked last.
    asked: Vec<(PackKey, u32)>,
    scratch: Scratch,
    pool: Pool,
    /// Networks' workspaces, kept between calls (`crate::network::NetworkDevice`).
    pub(crate) buffers: crate::network::Buffers,
}

/// Reusable scratch memory, one buffer per scalar type.
#[doc(hidden)]
#[derive(Default)]
pub struct Scratch {
    f32: AlignedBuf<f32>,
    f64: AlignedBuf<f64>,
}

/// Multiply-adds (or element operations, for the memory-bound passes) below which a part of a
/// call is not worth handing to another thread: about 10-20 us of the kernels' work, against a
/// hand-off of a few microseconds. A call with less than twice this runs on the calling thread.
pub const MIN_PART_WORK: usize = 1 << 20;

/// The threads of a device: the calling thread and a team of `threads - 1` (see
/// `crate::team`).
#[doc(hidden)]
#[derive(Default)]
pub struct Pool {
    /// `None` for one thread.
    team: Option<Team>,
    /// The least work per part (0: [`MIN_PART_WORK`]).
    min_work: usize,
}

impl Pool {
    /// Threads that work on a call, the caller's included.
    pub fn threads(&self) -> usize {
        self.team.as_ref().map_or(1, Team::threads)
    }

    /// A pool of `threads` threads in all (the caller's and `threads - 1` of its own).
    pub fn new(threads: usize) -> Result<Self> {
        let operation = "starting a CPU thread pool";
        if threads == 0 {
            return Err(Error::new(operation, "a device needs at least one thread"));
        }
        if threads == 1 {
            return Ok(Self::default());
        }
        let team = Team::new(threads - 1).map_err(|e| Error::new(operation, e.to_string()))?;
        Ok(Self {
            team: Some(team),
            min_work: 0,
        })
    }

    /// Workers for a call of `parts` parts and `work` multiply-adds (or element operations,
    /// for the memory-bound passes): one per part, up to the thread count, none with less than
    /// [`MIN_PART_WORK`].
    pub fn workers(&self, parts: usize, work: usize) -> usize {
        let least = if self.min_work == 0 {
            MIN_PART_WORK
        } else {
            self.min_work
        };
        (work / least).clamp(1, parts.max(1)).min(self.threads())
    }

    /// Runs `f(worker, parts)` for each of [`Pool::workers`]`(parts, work)` workers, the parts
    /// `0..parts` dealt in contiguous ranges (the first worker on the calling thread), and
    /// returns when all are done; a panic in a worker is resumed here. A partition is the
    /// caller's: results that must not depend on the thread count come from parts that do not.
    pub fn run(&self, parts: usize, work: usize, f: &(dyn Fn(usize, Range<usize>) + Sync)) {
        let workers = self.workers(parts, work);
        let range = |w: usize| w * parts / workers..(w + 1) * parts / workers;
        match &self.team {
            Some(team) if workers > 1 => team.run(workers, &|w| f(w, range(w))),
            _ => f(0, 0..parts),
        }
    }

    /// `f(part)` for every part of `0..parts`, on the workers (see [`Pool::run`]).
    pub fn each(&self, parts: usize, work: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run(parts, work, &|_, range| range.for_each(f));
    }

    /// `f(range)` over `0..len` cut into one contiguous range per worker, for passes whose
    /// partition does not change the results; `work` per item, as in [`Pool::workers`].
    pub fn split(&self, len: usize, work: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let total = len.saturating_mul(work);
        let parts = self.workers(len, total);
        self.each(parts, total, &|p| f(p * len / parts..(p + 1) * len / parts));
    }
}

/// The work of one element of a memory-bound pass (activation, normalization, conversion), in
/// the multiply-adds [`Pool::workers`] counts.
pub const ELEMENT_WORK: usize = 16;

impl std::fmt::Debug for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cpu")
            .field("threads", &self.threads())
            .field("packed_entries", &self.packs.len())
            .finish()
    }
}

/// A mutable slice that the workers of one call write in disjoint parts.
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct Shared<'a, T> {
    ptr: *mut T,
    len: usize,
    _slice: PhantomData<&'a mut [T]>,
}

// SAFETY: only disjoint parts are handed out (the contract of `part`), each to one worker.
unsafe impl<T: Send> Send for Shared<'_, T> {}
unsafe impl<T: Send> Sync for Shared<'_, T> {}

// Inlined: called per element in generated loops, from other codegen units without LTO.
impl<'a, T> Shared<'a, T> {
    #[inline]
    pub fn new(slice: &'a mut [T]) -> Self {
        Self {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
            _slice: PhantomData,
        }
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// No two parts in use at the same time overlap.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn part(&self, start: usize, len: usize) -> &'a mut [T] {
        assert!(
            start <= self.len && len <= self.len - start,
            "part {start}..{} of a slice of {}",
            start + len,
            self.len
        );
        // SAFETY: in bounds (checked); disjoint from every other part in use (the caller's
        // contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// Elements `start..start + len`, read while workers write other parts.
    ///
    /// # Safety
    /// No part overlapping these elements is written while the slice is in use.
    #[inline]
    pub unsafe fn read(&self, start: usize, len: usize) -> &'a [T] {
        assert!(
            start <= self.len && len <= self.len - start,
            "read {start}..{} of a slice of {}",
            start + len,
            self.len
        );
        // SAFETY: in bounds (checked); not written while in use (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) }
    }

    /// Element `i`, for workers that write disjoint scattered elements.
    ///
    /// # Safety
    /// No other reference to element `i` is in use at the same time.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn at(&self, i: usize) -> &'a mut T {
        assert!(i < self.len, "element {i} of a slice of {}", self.len);
        // SAFETY: in bounds (checked); not aliased (the caller's contract).
        unsafe { &mut *self.ptr.add(i) }
    }

    /// A pointer to element `start`, for kernels that write disjoint scattered elements
    /// through it.
    ///
    /// # Safety
    /// As [`Shared::at`] for every element written through it, each inside the slice.
    #[inline]
    pub unsafe fn ptr(&self, start: usize) -> *mut T {
        assert!(
            start <= self.len,
            "element {start} of a slice of {}",
            self.len
        );
        // SAFETY: in bounds or one past the end (checked).
        unsafe { self.ptr.add(start) }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Scalars the CPU device keeps scratch memory for.
#[doc(hidden)]
pub trait CpuScalar: Real {
    /// The first `len` elements of this type's scratch buffer.
    fn scratch(scratch: &mut Scratch, len: usize) -> &mut [Self];
}

impl CpuScalar for f32 {
    fn scratch(scratch: &mut Scratch, len: usize) -> &mut [f32] {
        at_least(&mut scratch.f32, len)
    }
}

impl CpuScalar for f64 {
    fn scratch(scratch: &mut Scratch, len: usize) -> &mut [f64] {
        at_least(&mut scratch.f64, len)
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
    /// The device's threads.
    pub pool: &'a Pool,
}

impl Cpu {
    /// A one-thread device (the caller's) with empty caches: what RL set-ups with one device
    /// per actor thread want. It cannot refuse a CPU this build has no kernels for (see
    /// [`Cpu::with_threads`], which does): there the first kernel stops the program.
    pub fn new() -> Self {
        Self::default()
    }

    /// A device computing on `threads` threads: the caller's and `threads - 1` of its own.
    /// Zero threads, threads the system cannot start, or a CPU this build has no kernels for
    /// ([`crate::simd::kernels_for_this_cpu`]) are an error.
    pub fn with_threads(threads: usize) -> Result<Self> {
        crate::simd::kernels_for_this_cpu()?;
        Ok(Self {
            pool: Pool::new(threads)?,
            ..Self::default()
        })
    }

    /// A device with a thread per core the system reports ([`std::thread::available_parallelism`]).
    pub fn all_cores() -> Result<Self> {
        let cores = std::thread::available_parallelism()
            .map_err(|e| Error::new("Cpu::all_cores", format!("the core count is unknown: {e}")))?;
        Self::with_threads(cores.get())
    }

    /// The threads this device computes on, the caller's included.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The device, splitting every call among its threads however small (for tests of the
    /// parallel paths on small layers).
    #[doc(hidden)]
    pub fn __split_everything(mut self) -> Self {
        self.pool.min_work = 1;
        self
    }

    /// The device's threads, for generated code outside a workspace.
    #[doc(hidden)]
    pub fn __pool(&self) -> &Pool {
        &self.pool
    }

    /// Whether parameters are worth an optional packed copy (one a kernel can do without): a
    /// copy for `key` is cached, or this is the `uses`-th time `key` is asked about. Parameters
    /// that change after each use or two (a network being trained) never get one; those used
    /// unchanged (a target network, inference) do, once.
    #[doc(hidden)]
    pub fn __reused(&mut self, key: PackKey, uses: u32) -> bool {
        /// Keys remembered: a few per network.
        const ASKED: usize = 16;
        if self.packs.iter().any(|p| p.key == key) {
            return true;
        }
        let count = match self.asked.iter().position(|(k, _)| *k == key) {
            Some(i) => self.asked.remove(i).1 + 1,
            None => 1,
        };
        if self.asked.len() >= ASKED {
            self.asked.remove(0);
        }
        self.asked.push((key, count));
        count >= uses
    }

    /// Packed parameters for `key` (built by `pack` on a miss, on the device's threads; it
    /// must write every one of the `packed_len` elements, which are left over from an evicted
    /// copy) and `scratch_len` scratch elements (not cleared).
    #[doc(hidden)]
    #[inline]
    pub fn __workspace<A: CpuScalar>(
        &mut self,
        key: PackKey,
        packed_len: usize,
        pack: impl FnOnce(&Pool, &mut [A]),
        scratch_len: usize,
    ) -> Workspace<'_, A> {
        // The cache's code is compiled once per element type, not once per layer's packer:
        // every layer calls this, and each copy was some hundred lines of IR to compile.
        let mut pack = Some(pack);
        self.workspace(
            key,
            packed_len,
            &mut |pool, data| {
                if let Some(pack) = pack.take() {
                    pack(pool, data);
                }
            },
            scratch_len,
        )
    }

    fn workspace<A: CpuScalar>(
        &mut self,
        key: PackKey,
        packed_len: usize,
        pack: &mut dyn FnMut(&Pool, &mut [A]),
        scratch_len: usize,
    ) -> Workspace<'_, A> {
        self.clock += 1;
        let clock = self.clock;
        let hit = self
            .packs
            .iter()
            .position(|p| p.key == key && p.data.is::<AlignedBuf<A>>());
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
                        old.downcast::<AlignedBuf<A>>()
                            .map(|v| *v)
                            .unwrap_or_default()
                    }
                    None => AlignedBuf::default(),
                };
                // Not cleared: every packer writes every element of its copy (clearing a large
                // layer's copy cost as much as a third of its repack).
                pack(&self.pool, at_least(&mut data, packed_len));
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
        let packed = match entry.data.downcast_ref::<AlignedBuf<A>>() {
            Some(v) => &v.as_slice()[..entry.len],
            None => unreachable!("the entry's type was checked when it was found or built"),
        };
        Workspace {
            packed,
            scratch: A::scratch(&mut self.scratch, scratch_len),
            pool: &self.pool,
        }
    }

    /// Drops every cached packed copy.
    pub fn clear_cache(&mut self) {
        self.packs.clear();
    }
}
