//! Kernel modules and launches: the compiled programs the driver loads, and how a launch runs.
//!
//! A module is the shared object the stand-in NVRTC compiled, opened with `dlopen` (each load a
//! copy of its own). It carries the launcher of `include/cuda_stand_in.h`
//! (`cuda_stand_in_launch`: blocks one after another on the calling thread, each block's threads
//! as fibers with a real barrier, one launch of the module at a time) and a table of its
//! kernels, each with a function that reads cuLaunchKernel's `void** kernelParams` as the
//! kernel's own parameter types, and one that checks its pointer parameters against the live
//! allocations before anything runs.
//!
//! A fault while a kernel runs (SIGSEGV or SIGBUS: a guard page, freed memory, a wild pointer,
//! a fiber's stack overflowing into its guard page) is caught by a handler running on the
//! thread's alternate signal stack, which jumps back into the launcher (`siglongjmp`): the launch
//! fails with `CUDA_ERROR_ILLEGAL_ADDRESS` instead of the process dying. Faults anywhere else go
//! to the handler that was installed before (Rust's stack-overflow handler, or the default).

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, OnceLock};

use crate::memory;

/// The launcher ABI of `include/cuda_stand_in.h` (`CUDA_STAND_IN_ABI`).
const ABI: c_int = 1;
/// Most threads per block (the device's limit; the launcher's arrays hold this many).
pub const MAX_THREADS: u32 = 1024;
/// Stack of each fiber, above a guard page.
const STACK_SIZE: usize = 256 << 10;
/// The alternate signal stack of a thread that has none.
const SIGNAL_STACK_SIZE: usize = 64 << 10;

/// What the stand-in offers a module (`cuda_stand_in::Api`).
#[repr(C)]
struct Api {
    valid_pointer: unsafe extern "C" fn(*const c_void) -> c_int,
    enter_kernel: unsafe extern "C" fn(Landing, *mut c_void),
    leave_kernel: unsafe extern "C" fn(),
}

/// Where a fault in a kernel jumps to: the launcher's `siglongjmp`.
type Landing = unsafe extern "C" fn(*mut c_void);

/// One kernel of a module (`cuda_stand_in::Kernel`).
#[repr(C)]
struct KernelEntry {
    name: *const c_char,
    run: unsafe extern "C" fn(*mut *mut c_void),
    check: unsafe extern "C" fn(*mut *mut c_void, *const Api) -> c_int,
    params: c_uint,
    max_threads: c_uint,
}

/// One launch (`cuda_stand_in::Launch`).
#[repr(C)]
struct Launch {
    kernel: *const KernelEntry,
    params: *mut *mut c_void,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    stacks: *const *mut c_void,
    stack_size: usize,
    api: *const Api,
    permuted: c_uint,
    seed: c_ulonglong,
}

static API: Api = Api {
    valid_pointer,
    enter_kernel,
    leave_kernel,
};

/// Why a module could not be loaded.
#[derive(Debug, PartialEq, Eq)]
pub enum LoadError {
    /// Not a module the stand-in NVRTC made.
    InvalidImage(String),
    /// Made for a GPU this one cannot run (a CUBIN runs on its own major architecture only).
    WrongArchitecture(String),
}

/// Why a launch failed.
#[derive(Debug, PartialEq, Eq)]
pub enum LaunchError {
    /// A pointer parameter (its index) outside every live allocation.
    BadPointer(usize),
    /// No parameter array for a kernel that takes parameters.
    NoParameters,
    /// Some threads of a block returned while others wait at `__syncthreads()`.
    DivergentBarrier,
    /// A fault at this address while the kernel ran.
    Fault(u64),
    /// The kernel wrote into the canary beside the allocation holding this address.
    Overrun(u64),
    /// No memory for the fibers' stacks.
    OutOfResources,
}

/// A loaded module.
pub struct Module {
    handle: *mut c_void,
    /// Held by a launch: the module's launcher keeps its state (threadIdx, shared memory, the
    /// fibers) in its own globals, so it runs one launch at a time.
    running: Mutex<()>,
    kernels: *const KernelEntry,
    count: usize,
    launch: unsafe extern "C" fn(*const Launch) -> c_int,
}

// SAFETY: the module's code and tables are immutable once loaded; each launch has its own state.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: opened by `load`, closed only here; no launch can be running (launches hold
        // the module through an `Arc`).
        unsafe { libc::dlclose(self.handle) };
    }
}

/// The length of the ELF file at `image`: its headers say where everything is.
///
/// # Safety
/// `image` must point to a whole ELF file (the driver API passes the image without a length).
unsafe fn elf_length(image: *const u8) -> Result<usize, LoadError> {
    let invalid = |why: &str| LoadError::InvalidImage(why.to_string());
    let header = std::slice::from_raw_parts(image, 64);
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(invalid("not a 64-bit little-endian ELF file"));
    }
    let u16_at = |b: &[u8], at: usize| u64::from(u16::from_le_bytes([b[at], b[at + 1]]));
    let u64_at = |b: &[u8], at: usize| {
        let mut v = [0u8; 8];
        v.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(v)
    };
    let (phoff, shoff) = (u64_at(header, 0x20), u64_at(header, 0x28));
    let (phsize, phnum) = (u16_at(header, 0x36), u16_at(header, 0x38));
    let (shsize, shnum) = (u16_at(header, 0x3a), u16_at(header, 0x3c));
    if shsize < 64 || phsize < 56 || shoff > 1 << 32 || phoff > 1 << 32 {
        return Err(invalid("corrupt ELF header"));
    }
    let mut end = (shoff + shsize * shnum).max(phoff + phsize * phnum);
    for i in 0..shnum {
        let section = std::slice::from_raw_parts(image.add((shoff + i * shsize) as usize), 64);
        // SHT_NOBITS sections occupy no bytes of the file.
        if u16_at(section, 4) != 8 {
            end = end.max(u64_at(section, 24) + u64_at(section, 32));
        }
    }
    for i in 0..phnum {
        let segment = std::slice::from_raw_parts(image.add((phoff + i * phsize) as usize), 56);
        end = end.max(u64_at(segment, 8) + u64_at(segment, 32));
    }
    if end > 1 << 32 {
        return Err(invalid("corrupt ELF header"));
    }
    Ok(end as usize)
}

impl Module {
    /// Loads the module image at `image` for a device of compute capability `major.minor`.
    ///
    /// # Safety
    /// `image` must point to a whole ELF file.
    pub unsafe fn load(image: *const u8, major: u32, minor: u32) -> Result<Module, LoadError> {
        let len = elf_length(image)?;
        let bytes = std::slice::from_raw_parts(image, len);
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = crate::nvrtc::cache_dir().join("modules");
        let path = dir.join(format!(
            "{}-{}.so",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let written = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, bytes));
        if let Err(e) = written {
            return Err(LoadError::InvalidImage(format!("{}: {e}", path.display())));
        }
        let opened = open(&path);
        // The mapping outlives the file.
        let _ = std::fs::remove_file(&path);
        let handle = opened?;
        let module = Module::from_handle(handle)?;
        let arch = module.arch()?;
        if !runs_on(&arch, major, minor) {
            return Err(LoadError::WrongArchitecture(arch));
        }
        Ok(module)
    }

    /// # Safety
    /// `handle` must be an open module; it is closed when the result is dropped (or on error).
    unsafe fn from_handle(handle: *mut c_void) -> Result<Module, LoadError> {
        let close = |why: String| {
            libc::dlclose(handle);
            LoadError::InvalidImage(why)
        };
        let abi = symbol(handle, c"cuda_stand_in_abi");
        let table = symbol(handle, c"cuda_stand_in_kernels");
        let launch = symbol(handle, c"cuda_stand_in_launch");
        let (Some(abi), Some(table), Some(launch)) = (abi, table, launch) else {
            return Err(close("not a module of the stand-in NVRTC".into()));
        };
        let abi: unsafe extern "C" fn() -> c_int = std::mem::transmute(abi);
        if abi() != ABI {
            return Err(close(format!(
                "made for launcher ABI {} (this stand-in has {ABI})",
                abi()
            )));
        }
        let table: unsafe extern "C" fn(*mut c_uint) -> *const KernelEntry =
            std::mem::transmute(table);
        let mut count: c_uint = 0;
        let kernels = table(&mut count);
        Ok(Module {
            handle,
            running: Mutex::new(()),
            kernels,
            count: count as usize,
            launch: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const Launch) -> c_int>(
                launch,
            ),
        })
    }

    /// The architecture the module was compiled for (`sm_90`).
    fn arch(&self) -> Result<String, LoadError> {
        // SAFETY: an open module; the symbol is a function returning a static string.
        unsafe {
            let f = symbol(self.handle, c"cuda_stand_in_arch")
                .ok_or_else(|| LoadError::InvalidImage("no architecture".into()))?;
            let f: unsafe extern "C" fn() -> *const c_char = std::mem::transmute(f);
            Ok(CStr::from_ptr(f()).to_string_lossy().into_owned())
        }
    }

    fn entries(&self) -> &[KernelEntry] {
        if self.kernels.is_null() {
            return &[];
        }
        // SAFETY: the module's static table of `count` entries, alive while the module is.
        unsafe { std::slice::from_raw_parts(self.kernels, self.count) }
    }

    /// The index of the kernel called `name`.
    pub fn function(&self, name: &CStr) -> Option<usize> {
        self.entries()
            .iter()
            // SAFETY: the table's names are static NUL-terminated strings.
            .position(|k| unsafe { CStr::from_ptr(k.name) } == name)
    }

    /// The kernel's name.
    pub fn name(&self, index: usize) -> String {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(self.entries()[index].name) }
            .to_string_lossy()
            .into_owned()
    }

    /// The kernel's `__launch_bounds__` (0 without).
    pub fn max_threads(&self, index: usize) -> u32 {
        self.entries()[index].max_threads
    }

    /// Runs kernel `index` on `grid` x `block` threads with cuLaunchKernel's `params`. The
    /// geometry must be valid (the driver checks it first).
    ///
    /// # Safety
    /// `params` must hold one pointer to each of the kernel's arguments, of its type.
    pub unsafe fn launch(
        &self,
        index: usize,
        grid: [u32; 3],
        block: [u32; 3],
        params: *mut *mut c_void,
    ) -> Result<(), LaunchError> {
        let kernel = &self.entries()[index];
        if kernel.params > 0 && params.is_null() {
            return Err(LaunchError::NoParameters);
        }
        let _running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        CHECKED.with(|c| c.borrow_mut().clear());
        let bad = (kernel.check)(params, &API);
        if let Ok(bad) = usize::try_from(bad) {
            return Err(LaunchError::BadPointer(bad));
        }
        install_fault_handler();
        ensure_signal_stack();
        let threads = (block[0] * block[1] * block[2]) as usize;
        let stacks = STACKS
            .with(|s| s.borrow_mut().get(threads))
            .ok_or(LaunchError::OutOfResources)?;
        let (permuted, seed) = schedule();
        let launch = Launch {
            kernel,
            params,
            grid,
            block,
            stacks,
            stack_size: STACK_SIZE,
            api: &API,
            permuted: c_uint::from(permuted),
            seed: seed ^ fnv1a(CStr::from_ptr(kernel.name).to_bytes()),
        };
        match (self.launch)(&launch) {
            0 => {}
            1 => return Err(LaunchError::DivergentBarrier),
            _ => return Err(LaunchError::Fault(FAULT_ADDRESS.with(Cell::get))),
        }
        let pointers = CHECKED.with(|c| c.borrow().clone());
        match pointers.into_iter().find(|&p| !memory::canaries_intact(p)) {
            Some(p) => Err(LaunchError::Overrun(p)),
            None => Ok(()),
        }
    }
}

/// `dlopen` of a module file.
fn open(path: &Path) -> Result<*mut c_void, LoadError> {
    let invalid = |why: String| LoadError::InvalidImage(why);
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| invalid("module path".into()))?;
    // SAFETY: a file this process just wrote; its initializers are the C++ runtime's.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a message (or null) owned by the C library.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "dlopen failed".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(invalid(why));
    }
    Ok(handle)
}

/// # Safety
/// `handle` must be an open module.
unsafe fn symbol(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    let s = libc::dlsym(handle, name.as_ptr());
    (!s.is_null()).then_some(s)
}

/// Whether a CUBIN for `arch` runs on compute capability `major.minor`: same major, minor at
/// least the CUBIN's; an `a` (architecture-specific) CUBIN only on its own exact capability.
fn runs_on(arch: &str, major: u32, minor: u32) -> bool {
    let Some(rest) = arch.strip_prefix("sm_") else {
        return false;
    };
    let digits = rest.trim_end_matches(|c: char| c.is_ascii_lowercase());
    let suffix = &rest[digits.len()..];
    let Ok(number) = digits.parse::<u32>() else {
        return false;
    };
    let (m, n) = (number / 10, number % 10);
    match suffix {
        "" => m == major && n <= minor,
        "a" => m == major && n == minor,
        _ => false,
    }
}

/// FNV-1a, to give each kernel its own permutations.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `(permuted, seed)` from `CUDA_STAND_IN_SCHEDULE` and `CUDA_STAND_IN_SEED`.
fn schedule() -> (bool, u64) {
    #[cfg(test)]
    if let Some(s) = SCHEDULE_OVERRIDE.with(Cell::get) {
        return s;
    }
    static SCHEDULE: OnceLock<(bool, u64)> = OnceLock::new();
    *SCHEDULE.get_or_init(|| {
        let permuted = match crate::env("CUDA_STAND_IN_SCHEDULE").as_deref() {
            None | Some("in-order") => false,
            Some("permuted") => true,
            Some(other) => {
                eprintln!(
                    "cuda-stand-in: CUDA_STAND_IN_SCHEDULE={other} is neither `in-order` nor \
                     `permuted`; running in order"
                );
                false
            }
        };
        let seed = crate::env("CUDA_STAND_IN_SEED")
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        (permuted, seed)
    })
}

#[cfg(test)]
thread_local! {
    static SCHEDULE_OVERRIDE: Cell<Option<(bool, u64)>> = const { Cell::new(None) };
}

/// Runs `f` with the schedule `(permuted, seed)` on this thread.
#[cfg(test)]
pub(crate) fn with_schedule<R>(permuted: bool, seed: u64, f: impl FnOnce() -> R) -> R {
    SCHEDULE_OVERRIDE.with(|s| s.set(Some((permuted, seed))));
    let r = f();
    SCHEDULE_OVERRIDE.with(|s| s.set(None));
    r
}

thread_local! {
    /// The pointers a launch's check found valid, for the canary check after it.
    static CHECKED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// Where a fault jumps while a kernel runs on this thread.
    static LANDING: Cell<Option<(Landing, *mut c_void)>> = const { Cell::new(None) };
    /// The address of the last fault in a kernel on this thread.
    static FAULT_ADDRESS: Cell<u64> = const { Cell::new(0) };
    /// The fibers' stacks of this thread.
    static STACKS: RefCell<Stacks> = const { RefCell::new(Stacks { stacks: Vec::new(), tops: Vec::new() }) };
    /// The alternate signal stack this thread got from us, if it had none.
    static SIGNAL_STACK: RefCell<Option<SignalStack>> = const { RefCell::new(None) };
}

unsafe extern "C" fn valid_pointer(p: *const c_void) -> c_int {
    let p = p as u64;
    let valid = memory::find(p).is_some();
    if valid {
        CHECKED.with(|c| c.borrow_mut().push(p));
    }
    c_int::from(valid)
}

unsafe extern "C" fn enter_kernel(landing: Landing, arg: *mut c_void) {
    LANDING.with(|l| l.set(Some((landing, arg))));
}

unsafe extern "C" fn leave_kernel() {
    LANDING.with(|l| l.set(None));
}

/// Mappings with a guard page below (stacks grow down), reused by every launch on the thread.
struct Stacks {
    stacks: Vec<(usize, usize)>,
    /// The usable low end of each stack, as the launcher takes them.
    tops: Vec<*mut c_void>,
}

impl Stacks {
    /// At least `n` stacks; null if the host has no memory for them.
    fn get(&mut self, n: usize) -> Option<*const *mut c_void> {
        let page = page_size();
        while self.stacks.len() < n {
            let len = STACK_SIZE + page;
            // SAFETY: a fresh anonymous mapping.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if map == libc::MAP_FAILED {
                return None;
            }
            // SAFETY: the first page of the mapping just made.
            unsafe { libc::mprotect(map, page, libc::PROT_NONE) };
            self.stacks.push((map as usize, len));
            self.tops.push((map as usize + page) as *mut c_void);
        }
        Some(self.tops.as_ptr())
    }
}

impl Drop for Stacks {
    fn drop(&mut self) {
        for &(map, len) in &self.stacks {
            // SAFETY: mappings made by `get`, used by no fiber once the thread ends.
            unsafe { libc::munmap(map as *mut c_void, len) };
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// An alternate signal stack, so that the fault handler runs even when a fiber's stack is full.
struct SignalStack {
    map: usize,
}

impl Drop for SignalStack {
    fn drop(&mut self) {
        // SAFETY: disables the thread's alternate stack (ours) before unmapping it.
        unsafe {
            let off = libc::stack_t {
                ss_sp: std::ptr::null_mut(),
                ss_flags: libc::SS_DISABLE,
                ss_size: 0,
            };
            libc::sigaltstack(&off, std::ptr::null_mut());
            libc::munmap(self.map as *mut c_void, SIGNAL_STACK_SIZE);
        }
    }
}

fn ensure_signal_stack() {
    // SAFETY: queries and, if there is none, sets this thread's alternate signal stack to a
    // mapping it keeps until it ends.
    unsafe {
        let mut current: libc::stack_t = std::mem::zeroed();
        libc::sigaltstack(std::ptr::null(), &mut current);
        if current.ss_flags & libc::SS_DISABLE == 0 {
            return;
        }
        let map = libc::mmap(
            std::ptr::null_mut(),
            SIGNAL_STACK_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if map == libc::MAP_FAILED {
            return;
        }
        let stack = libc::stack_t {
            ss_sp: map,
            ss_flags: 0,
            ss_size: SIGNAL_STACK_SIZE,
        };
        libc::sigaltstack(&stack, std::ptr::null_mut());
        SIGNAL_STACK.with(|s| *s.borrow_mut() = Some(SignalStack { map: map as usize }));
    }
}

/// The handlers that were installed before ours (SIGSEGV, SIGBUS).
static PREVIOUS: OnceLock<[libc::sigaction; 2]> = OnceLock::new();
const SIGNALS: [c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

fn install_fault_handler() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: reads the current handlers, keeps them, then installs ours.
        unsafe {
            let mut previous: [libc::sigaction; 2] = std::mem::zeroed();
            for (sig, old) in SIGNALS.iter().zip(previous.iter_mut()) {
                libc::sigaction(*sig, std::ptr::null(), old);
            }
            let _ = PREVIOUS.set(previous);
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fault as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            for sig in SIGNALS {
                libc::sigaction(sig, &action, std::ptr::null_mut());
            }
        }
    });
}

/// In a kernel: note the address and leave the kernel through the launcher's landing. Else:
/// what the previous handler would do.
unsafe extern "C" fn on_fault(sig: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    if let Some((landing, arg)) = LANDING.with(|l| l.take()) {
        FAULT_ADDRESS.with(|f| f.set((*info).si_addr() as u64));
        landing(arg);
    }
    let previous = PREVIOUS
        .get()
        .and_then(|p| SIGNALS.iter().position(|&s| s == sig).map(|i| p[i]));
    match previous {
        Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
            if old.sa_flags & libc::SA_SIGINFO != 0 {
                let f: unsafe extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                    std::mem::transmute(old.sa_sigaction);
                f(sig, info, context);
            } else {
                let f: unsafe extern "C" fn(c_int) = std::mem::transmute(old.sa_sigaction);
                f(sig);
            }
        }
        _ => {
            // The default action: returning re-runs the faulting instruction, which then ends
            // the process as it would have without us.
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &default, std::ptr::null_mut());
        }
    }
}

/// A fault's message: the kernel and where the address is.
pub fn describe_fault(kernel: &str, at: u64) -> String {
    format!(
        "cuda-stand-in: kernel `{kernel}` faulted at {at:#x}, {}",
        memory::describe(at)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures() {
        assert!(runs_on("sm_90", 9, 0));
        assert!(runs_on("sm_90a", 9, 0));
        assert!(!runs_on("sm_80", 9, 0));
        assert!(!runs_on("sm_100", 9, 0));
        assert!(!runs_on("sm_91", 9, 0));
        assert!(!runs_on("compute_90", 9, 0));
    }
}
