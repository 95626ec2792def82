//! The worker threads of a `Cpu` device: a fixed team that runs one call's parts at a time.
//!
//! A call publishes its job and wakes the team, the calling thread takes part 0, and the call
//! returns when every worker is done. Between calls the workers spin for a while
//! ([`SPIN`]) before they sleep: the operations of a training step follow each other within
//! microseconds, and waking a sleeping thread costs tens of microseconds on the virtual
//! machines RL runs on — more than a small layer's whole call (the README has the measurement
//! that chose this over rayon's pool). Sleeping workers cost nothing.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next call before it sleeps.
pub const SPIN: Duration = Duration::from_micros(200);

/// A job: `f(worker)` for the workers of a call (the caller runs worker 0).
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
}

struct Shared {
    /// Per worker (index 0 unused): the last call it is part of, bumped by the caller (Release
    /// after the job is written) for the workers of the call only.
    epochs: Vec<AtomicU64>,
    /// The calls so far (written by the caller holding `Team::calls`).
    calls: AtomicU64,
    /// The current call's job. Written by the caller before it bumps the workers' epochs, read
    /// by those workers after they see their new epoch, valid until `remaining` is 0 again.
    job: UnsafeCell<Job>,
    /// Workers of the current call not done yet.
    remaining: AtomicUsize,
    /// The first panic of a worker in the current call.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    shutdown: AtomicBool,
    /// Sleeping workers wait here.
    sleep: Mutex<()>,
    wake: Condvar,
    sleepers: AtomicUsize,
}

// SAFETY: `job` is written only by the caller holding `Team::calls`, while no worker reads it
// (every worker of the previous call is done, and the workers of this one do not see their new
// epoch yet), and read only by a call's workers after their epoch's Acquire, so reads and the
// write never overlap; the pointer is to a `Sync` closure that outlives the call.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

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
        let shared = Arc::new(Shared {
            epochs: (0..=workers).map(|_| AtomicU64::new(0)).collect(),
            calls: AtomicU64::new(0),
            job: UnsafeCell::new(Job { f: &|_| {} }),
            remaining: AtomicUsize::new(0),
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

    /// `f(worker)` for `worker` in `0..count` (at most [`Team::threads`]): 0 on the calling
    /// thread, the others on the team, returning when all are done. A panic in any is resumed
    /// here. A call made while the team is busy (from a worker, or from another thread) runs
    /// every part on its own thread instead: the same results, as partitions never depend on
    /// who runs them.
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
        // SAFETY: the job's lifetime is erased; it is read only while `remaining` is not 0,
        // and this call does not return before it is 0 again (see `Shared`).
        let f_static: *const (dyn Fn(usize) + Sync) =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), _>(f) };
        // SAFETY: no worker reads the job now (the previous call is over, see `Shared`).
        unsafe {
            *shared.job.get() = Job { f: f_static };
        }
        shared.remaining.store(count - 1, Ordering::Relaxed);
        let call = shared.calls.load(Ordering::Relaxed) + 1;
        shared.calls.store(call, Ordering::Relaxed);
        // SeqCst here and in a worker going to sleep (its count of sleepers, then its epoch): one
        // of the two sees the other's store, so no call is missed by a sleeping worker.
        for epoch in &shared.epochs[1..count] {
            epoch.store(call, Ordering::SeqCst);
        }
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            shared.wake.notify_all();
        }
        let own = panic::catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while shared.remaining.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        drop(guard);
        if let Err(payload) = own {
            panic::resume_unwind(payload);
        }
        let worker_panic = shared
            .panic
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(payload) = worker_panic {
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

/// A worker's life: wait for a call (spinning, then sleeping), run its part, repeat.
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
        // SAFETY: read after the epoch's Acquire; valid until this worker's decrement below.
        let job = unsafe { *shared.job.get() };
        // SAFETY: the caller waits for this worker before the closure goes away.
        let f = unsafe { &*job.f };
        if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| f(index))) {
            let mut first = shared.panic.lock().unwrap_or_else(|p| p.into_inner());
            first.get_or_insert(payload);
        }
        shared.remaining.fetch_sub(1, Ordering::Release);
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
