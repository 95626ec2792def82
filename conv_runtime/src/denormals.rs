//! Flushing denormal numbers to zero, for speed, where a user accepts the change of results.
//!
//! Intel cores handle a denormal operand or result of a multiplication, division or square root
//! in microcode, at about a hundred times an ordinary one's cost (additions take no such
//! assist). Training meets them: an optimizer's running mean decays by a constant factor while
//! a parameter's gradient is zero, and below `f32::MIN_POSITIVE` it settles on a small denormal
//! that the same factor rounds back to itself, so every later step pays for it again. The
//! optimizers ([`crate::Adam`], [`crate::RmsProp`], [`crate::Sgd`]) no longer pay: near the
//! denormals they compute each multiplication, division and square root through f64, which
//! gives the same f32 bits without an assist, on CPUs that take assists ([`assists`]). (Over
//! the DQN example's first 40,000 frames on an Intel Xeon, RMSprop's step had taken 41% of the
//! time.) Flushing still removes denormals from everything else, the layers' own arithmetic
//! included, by trading them for zeros (the x86 control bits FTZ and DAZ, what
//! `torch.set_flush_denormal(True)` sets). It is not IEEE arithmetic: results differ from the
//! default mode's (and from the GPU's) wherever a denormal appeared, so it is off unless asked
//! for.

#[cfg(not(target_arch = "x86_64"))]
use crate::Error;
use crate::Result;
use std::marker::PhantomData;

/// The floating-point mode bits this module sets: x86's FTZ (results) and DAZ (operands).
#[cfg(target_arch = "x86_64")]
const FLUSH: u32 = (1 << 15) | (1 << 6);

/// The calling thread's control and status register (MXCSR on x86-64; 0 elsewhere).
#[inline]
fn mode() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        let mut csr = 0u32;
        // SAFETY: `stmxcsr` stores four bytes to a valid local; SSE is part of x86-64.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
        }
        csr
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Sets the calling thread's register to `csr`, a value [`mode`] returned with control bits
/// from [`control`] (on any thread).
#[inline]
fn set_mode(csr: u32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `csr` is made of bits `stmxcsr` read, so it has no reserved bit set; `ldmxcsr` reads four
    // bytes from a valid local.
    unsafe {
        std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = csr;
}

/// The register's control bits (x86-64: rounding, exception masks, FTZ and DAZ), not its
/// sticky status flags.
const CONTROL: u32 = 0xffc0;

/// The calling thread's control bits, for [`adopt`] on another thread.
#[inline]
pub(crate) fn control() -> u32 {
    mode() & CONTROL
}

/// Gives the calling thread the control bits `control` (from [`control`]), keeping its flags.
#[inline]
pub(crate) fn adopt(control: u32) {
    let csr = mode();
    if csr & CONTROL != control {
        set_mode(csr & !CONTROL | control);
    }
}

/// Whether this CPU takes a microcode assist for a denormal operand or result of a
/// multiplication, division or square root, so that the optimizers' exact operations pay near
/// the denormals: every x86-64 CPU but AMD's Zen cores (family 17h on, and Hygon's), and every
/// other architecture, unless known otherwise. Zen 4 takes about twice an ordinary zmm
/// multiplication's time (0.55 ns) for a denormal result and an ordinary one's for a denormal
/// operand; there the exact operations' conversions cost more than they save (MinAtar's Adam
/// step: 69 us with plain operations, 104 us with exact ones). Decided once per process; only
/// speed depends on it.
pub fn assists() -> bool {
    static ASSISTS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASSISTS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid;
            // CPUID leaves 0 (the vendor) and 1 (the family) exist on every x86-64 CPU; the
            // intrinsic is unsafe on older compilers only.
            #[allow(unused_unsafe)]
            let (vendor, signature) = unsafe { (__cpuid(0), __cpuid(1).eax) };
            let name: Vec<u8> = [vendor.ebx, vendor.edx, vendor.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            let base = (signature >> 8) & 0xf;
            let family = if base == 0xf {
                base + ((signature >> 20) & 0xff)
            } else {
                base
            };
            let zen = (name == b"AuthenticAMD" && family >= 0x17) || name == b"HygonGenuine";
            !zen
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            true
        }
    })
}

/// Whether the calling thread flushes denormals to zero.
pub fn flushing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        control() & FLUSH == FLUSH
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Flushes denormal results and operands to zero on the calling thread until dropped, which
/// restores the mode it found. Every `Cpu` call made meanwhile flushes on all of that device's
/// threads: a call hands its caller's mode to the workers that share it.
///
/// ```
/// # #[cfg(target_arch = "x86_64")] {
/// let flush = conv_runtime::denormals::FlushToZero::on()?;
/// let tiny = std::hint::black_box(f32::MIN_POSITIVE);
/// assert_eq!(tiny * 0.5, 0.0);
/// drop(flush);
/// assert_eq!(std::hint::black_box(tiny) * 0.5, f32::MIN_POSITIVE / 2.0);
/// # }
/// # Ok::<(), conv_runtime::Error>(())
/// ```
#[must_use = "the mode is restored when this is dropped"]
pub struct FlushToZero {
    /// The control bits it found.
    previous: u32,
    /// The mode is the thread's: the guard must drop where it was made.
    _thread: PhantomData<*const ()>,
}

impl FlushToZero {
    /// Starts flushing on the calling thread; an error on targets where this crate cannot set
    /// the mode (all but x86-64).
    pub fn on() -> Result<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let previous = control();
            adopt(previous | FLUSH);
            Ok(Self {
                previous,
                _thread: PhantomData,
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Err(Error::new(
                "flushing denormals to zero",
                "supported on x86-64 targets only",
            ))
        }
    }
}

impl Drop for FlushToZero {
    fn drop(&mut self) {
        adopt(self.previous);
    }
}

impl std::fmt::Debug for FlushToZero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlushToZero").finish_non_exhaustive()
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::hint::black_box;

    #[test]
    fn the_guard_flushes_and_restores() {
        let before = control();
        let tiny = black_box(f32::MIN_POSITIVE);
        assert_eq!(tiny * 0.5, f32::MIN_POSITIVE / 2.0);
        {
            let _flush = FlushToZero::on().expect("x86-64");
            assert!(flushing());
            // FTZ: a denormal result is zero; DAZ: a denormal operand reads as zero.
            assert_eq!(black_box(tiny) * 0.5, 0.0);
            let denormal = black_box(f32::from_bits(1));
            assert_eq!(denormal * 1.0, 0.0);
            assert_eq!(denormal + f32::MIN_POSITIVE, f32::MIN_POSITIVE);
        }
        assert!(!flushing());
        assert_eq!(control(), before);
        assert_eq!(black_box(tiny) * 0.5, f32::MIN_POSITIVE / 2.0);
    }
}
