//! The worker threads of a `Cpu` device: a fixed team that runs one call's parts at a time.
//!
//! A call publishes its job and wakes the team; every thread of the call, the caller's
//! included, first claims its own part (part `w` for worker `w`, so a part's data stays in one
//! core's caches from call to call), then any part nobody has claimed yet, and the call returns
//! when every claimed part is done. A worker that is late — asleep, or its core taken by
//! another process or by the hypervisor — before it enters a call costs the call nothing beyond
//! its part's work, which the others take over (one already inside, preempted, is waited for);
//! a part's result never depends on which thread runs it. Between calls the workers spin for a
//! while ([`SPIN`]) before they sleep: the operations of a training step follow each other
//! within microseconds, and waking a sleeping thread costs tens to hundreds of microseconds on
//! the virtual machines RL runs on (about 260 on the development machine) — more than a small
//! layer's whole call (the README has the measurement that chose this over rayon's pool).
//! Sleeping workers cost nothing.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next call before it sleeps.
pub const SPIN: Duration = Duration::from_micros(200);

/// A job: `f(part)` for the parts `0..count` of a call.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    count: usize,
    /// The caller's floating-point control bits (`crate::denormals`): every part runs in them.
    control: u32,
}

/// `Shared::gate` packs the current call (above [`CALL_SHIFT`]), whether it is closed, and the
/// workers inside it.
const CALL_SHIFT: u32 = 16;
const CLOSED: u64 = 1 << 15;
const INSIDE: u64 = CLOSED - 1;

struct Shared {
    /// Per worker (index 0 unused): the last call it is asked to, bumped by the caller (after
    /// the call is open) for the workers of the call only.
    epochs: Vec<AtomicU64>,
    /// The calls so far (written by the caller holding `Team::calls`).
    calls: AtomicU64,
    /// The current call, whether it is closed, and how many workers are inside it. A worker
    /// enters only an open call (the increment's Acquire pairs with the opening Release, so it
    /// sees the job); the caller closes the call once nobody is inside, after which nobody
    /// enters, so the job can be replaced and the closure go away.
    gate: AtomicU64,
    /// Per part: the last call that claimed it (each part runs once per call).
    claims: Vec<AtomicU64>,
    /// The current call's job. Written by the caller before it opens the call, read by workers
    /// inside it.
    job: UnsafeCell<Job>,
    /// The first panic of a part in the current call.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    shutdown: AtomicBool,
    /// Sleeping workers wait here.
    sleep: Mutex<()>,
    wake: Condvar,
    sleepers: AtomicUsize,
}

// SAFETY: `job` is written only by the caller holding `Team::calls` while the previous call is
// closed (no worker inside, none can enter), and read only by workers inside the open call
// (after the gate's Acquire), so reads and the write never overlap; the pointer is to a `Sync`
// closure that outlives the call, which is not closed before every worker inside has left.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

impl Shared {
    /// Claims `part` for `call`: true for the first thread that asks.
    fn claim(&self, part: usize, call: u64) -> bool {
        let slot = &self.claims[part];
        slot.load(Ordering::Relaxed) != call && slot.swap(call, Ordering::Relaxed) != call
    }

    /// Runs part `own`, then every part of the call nobody has claimed yet; a panic is kept
    /// for the caller.
    fn run_parts(&self, job: Job, call: u64, own: usize) {
        // SAFETY: the closure outlives the call (see `Shared`).
        let f = unsafe { &*job.f };
        if own != 0 {
            crate::denormals::adopt(job.control);
        }
        let parts = (own..job.count).chain(0..own);
        for part in parts {
            if !self.claim(part, call) {
                continue;
            }
            if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| f(part))) {
                let mut first = self.panic.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(payload);
            }
        }
    }
}

/// `threads - 1` worker threads and the right to call them.
pub struct Team {
    shared: Arc<Shared>,
    /// Held for the length of a call: one call at a time.
    calls: Mutex<()>,
    handles: Vec<JoinHandle<()>>,
}

impl Team {
    /// A team of `workers` threads (besides the callers').
    pub fn new(workers: usize) -> std::io::Result<Self> {
        if workers as u64 >= INSIDE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{workers} worker threads: a team holds at most {}",
                    INSIDE - 1
                ),
            ));
        }
        let shared = Arc::new(Shared {
            epochs: (0..=workers).map(|_| AtomicU64::new(0)).collect(),
            calls: AtomicU64::new(0),
            gate: AtomicU64::new(CLOSED),
            claims: (0..=workers).map(|_| AtomicU64::new(0)).collect(),
            job: UnsafeCell::new(Job {
                f: &|_| {},
                count: 0,
                control: 0,
            }),
            panic: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        });
        let mut team = Self {
            shared: shared.clone(),
            calls: Mutex::new(()),
            handles: Vec::with_capacity(workers),
        };
        for index in 1..=workers {
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("conv2d-cpu-{index}"))
                .spawn(move || work(&shared, index))?;
            team.handles.push(handle);
        }
        Ok(team)
    }

    /// Threads of a call, the caller's included.
    pub fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// `f(part)` for `part` in `0..count` (at most [`Team::threads`]), each once, on the
    /// calling thread and the team (part `w` on worker `w` unless it is late), returning when
    /// all are done. The first panic of a part is resumed here. A call made while the team is
    /// busy (from a worker, or from another thread) runs every part on its own thread instead:
    /// the same results, as partitions never depend on who runs them.
    pub fn run(&self, count: usize, f: &(dyn Fn(usize) + Sync)) {
        let count = count.min(self.threads());
        let guard = match self.calls.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                (0..count).for_each(f);
                return;
            }
        };
        if count <= 1 {
            (0..count).for_each(f);
            return;
        }
        let shared = &*self.shared;
        // SAFETY: the job's lifetime is erased; it is read only inside the call, and this call
        // does not return before it is closed (see `Shared`).
        let f_static: *const (dyn Fn(usize) + Sync) =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), _>(f) };
        let job = Job {
            f: f_static,
            count,
            control: crate::denormals::control(),
        };
        // SAFETY: the previous call is closed: no worker reads the job (see `Shared`).
        unsafe {
            *shared.job.get() = job;
        }
        let call = shared.calls.load(Ordering::Relaxed) + 1;
        shared.calls.store(call, Ordering::Relaxed);
        shared.gate.store(call << CALL_SHIFT, Ordering::Release);
        // SeqCst here and in a worker going to sleep (its count of sleepers, then its epoch): one
        // of the two sees the other's store, so no call is missed by a sleeping worker.
        for epoch in &shared.epochs[1..count] {
            epoch.store(call, Ordering::SeqCst);
        }
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            shared.wake.notify_all();
        }
        shared.run_parts(job, call, 0);
        // Every part is claimed now; wait for the workers still running theirs, and close the
        // call so that no late one enters it.
        let mut spins = 0u32;
        loop {
            let gate = shared.gate.load(Ordering::Acquire);
            if gate & INSIDE == 0
                && shared
                    .gate
                    .compare_exchange_weak(
                        gate,
                        gate | CLOSED,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Taken before the next call may start, so that its panics stay its own.
        let panic = shared
            .panic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(guard);
        if let Some(payload) = panic {
            panic::resume_unwind(payload);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _lock = self.shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

/// Enters `call` if it is still open: true if this worker is now inside it.
fn enter(shared: &Shared, call: u64) -> bool {
    let mut gate = shared.gate.load(Ordering::Relaxed);
    loop {
        if gate >> CALL_SHIFT != call || gate & CLOSED != 0 {
            return false;
        }
        match shared.gate.compare_exchange_weak(
            gate,
            gate + 1,
            Ordering::Acquire,
            Ordering::Relaxed,
        ) {
            Ok(_) => return true,
            Err(now) => gate = now,
        }
    }
}

/// A worker's life: wait for a call (spinning, then sleeping), run its part and any left,
/// repeat.
fn work(shared: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let epoch = shared.epochs[index].load(Ordering::Acquire);
            if epoch != seen {
                break epoch;
            }
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || started.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // Sleep until a call (or the team's end) wakes us; the epoch is checked again under
            // the lock, so a call published meanwhile is not missed.
            let mut lock = shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            while shared.epochs[index].load(Ordering::SeqCst) == seen
                && !shared.shutdown.load(Ordering::Acquire)
            {
                lock = shared.wake.wait(lock).unwrap_or_else(|p| p.into_inner());
            }
            shared.sleepers.fetch_sub(1, Ordering::AcqRel);
        };
        seen = epoch;
        if !enter(shared, epoch) {
            // The call is over (woken too late, or for an older call): its parts are done.
            continue;
        }
        // SAFETY: read inside the open call (see `Shared`).
        let job = unsafe { *shared.job.get() };
        shared.run_parts(job, epoch, index);
        shared.gate.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_part_runs_once_per_call() {
        let team = Team::new(3).expect("threads");
        assert_eq!(team.threads(), 4);
        for count in [1, 2, 4, 9] {
            let runs: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..100 {
                team.run(count, &|w| {
                    runs[w].fetch_add(1, Ordering::Relaxed);
                });
            }
            for (w, r) in runs.iter().enumerate() {
                let expected = if w < count.min(4) { 100 } else { 0 };
                assert_eq!(r.load(Ordering::Relaxed), expected, "worker {w} of {count}");
            }
        }
    }

    /// Parts on the workers run in the caller's floating-point mode, set or not.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn workers_take_the_callers_denormal_mode() {
        let team = Team::new(1).expect("threads");
        let caller = std::thread::current().id();
        // Calls until a worker takes a part: whether it flushed there, held to `flushed`.
        let on_worker = |flushed: bool| {
            for _ in 0..1000 {
                let seen = Mutex::new(None);
                team.run(2, &|_| {
                    if std::thread::current().id() != caller {
                        *seen.lock().expect("lock") = Some(crate::denormals::flushing());
                    } else {
                        // Time for the worker to take the other part.
                        std::thread::sleep(Duration::from_millis(1));
                    }
                });
                if let Some(mode) = seen.into_inner().expect("lock") {
                    return assert_eq!(mode, flushed);
                }
            }
            panic!("no part ran on the worker");
        };
        on_worker(false);
        {
            let _flush = crate::denormals::FlushToZero::on().expect("x86-64");
            on_worker(true);
        }
        on_worker(false);
    }

    #[test]
    fn sleeping_workers_wake_for_a_call() {
        let team = Team::new(1).expect("threads");
        std::thread::sleep(SPIN * 5);
        let sum = AtomicUsize::new(0);
        team.run(2, &|w| {
            sum.fetch_add(w + 1, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_team_goes_on() {
        let team = Team::new(2).expect("threads");
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            team.run(3, &|w| assert!(w != 2, "worker 2 fails"));
        }));
        assert!(result.is_err());
        let count = AtomicUsize::new(0);
        team.run(3, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn the_caller_takes_over_the_part_of_a_late_worker() {
        // A sleeping worker is late by a wake-up (the caller even holds the lock it must take
        // on waking while it notifies); the caller, with nothing to do in part 0, takes part 1.
        let team = Team::new(1).expect("threads");
        let caller = std::thread::current().id();
        let mut taken = 0;
        for _ in 0..20 {
            std::thread::sleep(SPIN * 5);
            let by_caller = AtomicUsize::new(0);
            let runs = AtomicUsize::new(0);
            team.run(2, &|part| {
                runs.fetch_add(1, Ordering::Relaxed);
                if part == 1 && std::thread::current().id() == caller {
                    by_caller.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert_eq!(runs.load(Ordering::Relaxed), 2);
            taken += by_caller.load(Ordering::Relaxed);
        }
        assert!(
            taken > 0,
            "the caller waited for a sleeping worker in 20 calls out of 20"
        );
    }

    #[test]
    fn a_finished_call_admits_no_late_worker() {
        let team = Team::new(2).expect("threads");
        team.run(3, &|_| {});
        let call = team.shared.calls.load(Ordering::Relaxed);
        assert!(!enter(&team.shared, call));
        assert!(!enter(&team.shared, call + 1));
    }

    #[test]
    fn a_call_from_inside_a_call_runs_on_its_own_thread() {
        let team = Team::new(1).expect("threads");
        let inner = AtomicUsize::new(0);
        team.run(2, &|_| {
            team.run(2, &|_| {
                inner.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(inner.load(Ordering::Relaxed), 4);
    }
}
