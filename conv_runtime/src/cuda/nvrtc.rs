//! Run-time compilation of generated kernel source with NVRTC, to a CUBIN.
//!
//! # Finding NVRTC
//!
//! cudarc loads `libnvrtc.so.13` on first use (feature `dynamic-loading`). It is found, in this
//! order:
//!
//! 1. in `$NVRTC_LIB_DIR` when that is set;
//! 2. by the dynamic loader's own search (`LD_LIBRARY_PATH`, the system's library cache);
//! 3. in `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`, and pip's CUDA 13
//!    wheels (`nvidia/cu13/lib` in the site-packages directories `python3` reports), where
//!    `pip install nvidia-cuda-nvrtc` puts it.
//!
//! A library found in a directory (1, 3) is loaded by its path, together with the
//! `libnvrtc-builtins.so.13.*` beside it that NVRTC opens by name while compiling: once loaded,
//! both are found by name without `LD_LIBRARY_PATH`.
//!
//! The CUDA headers that half-precision kernels include (`cuda_fp16.h`, `cuda_bf16.h`) come from
//! `$CUDA_INCLUDE_DIR` when set, else the first that has `cuda_fp16.h` of: `include` beside the
//! library's directory (the one it was loaded from, or the `LD_LIBRARY_PATH` entry holding it),
//! `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include` and pip's
//! `nvidia/cu13/include` (`pip install nvidia-cuda-runtime`).
//!
//! # Listing kernels
//!
//! [`kernel_names`] reads the CUBIN's ELF symbol table: the kernels are the global functions
//! marked as CUDA entry points. That is what the driver resolves when the host looks a kernel
//! up in the loaded module, read from the very binary that is loaded, with no second
//! compilation (a PTX listing of `.entry` lines would need one, and would describe the PTX
//! rather than the CUBIN).

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use crate::{Error, Result};

/// The name NVRTC gives the source in its messages, for lines before the source's first
/// `#line` (generated sources name each kernel file with one).
pub const PROGRAM_NAME: &str = "layer.cu";

/// The NVRTC library's file name (CUDA 13, as the cudarc bindings).
const LIBRARY: &str = "libnvrtc.so.13";
/// The prefix of the builtins library NVRTC opens while compiling.
const BUILTINS_PREFIX: &str = "libnvrtc-builtins.so.13.";
/// A header every half-precision kernel includes: marks a CUDA include directory.
const MARKER_HEADER: &str = "cuda_fp16.h";

/// Compiles `source` for the GPU architecture `arch` (e.g. `"sm_90"`) into a CUBIN.
///
/// The source is C++17 CUDA. The precise math library is used (no fast-math); multiply-adds
/// may contract to FMAs (NVRTC's default, as the CPU's convolution uses FMA), so results agree
/// with the CPU's to rounding, not bit for bit. A compilation error is an [`Error`] whose
/// reason carries NVRTC's log.
pub fn compile(source: &str, arch: &str) -> Result<Vec<u8>> {
    compile_with_log(source, arch).map(|compiled| compiled.cubin)
}

/// A successful compilation.
pub struct Compiled {
    /// The module, for the driver to load.
    pub cubin: Vec<u8>,
    /// NVRTC's log: its warnings, empty when there are none.
    pub log: String,
}

/// [`compile`], keeping NVRTC's log of a successful compilation.
pub fn compile_with_log(source: &str, arch: &str) -> Result<Compiled> {
    let operation = format!("NVRTC compilation for {arch}");
    if !is_real_architecture(arch) {
        return Err(Error::new(
            operation,
            format!("`{arch}` is not a GPU architecture such as sm_90 (a CUBIN is built for one)"),
        ));
    }
    let toolkit = toolkit()?;
    let source = CString::new(source)
        .map_err(|_| Error::new(&operation, "the source contains a NUL byte"))?;
    let name = CString::new(PROGRAM_NAME).map_err(|_| Error::new(&operation, "program name"))?;
    let program = result::create_program(&source, Some(&name))
        .map(Program)
        .map_err(|e| Error::new(&operation, format!("nvrtcCreateProgram: {:?}", e.0)))?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    if let Some(dir) = &toolkit.include {
        options.push(format!("--include-path={}", dir.display()));
    }
    // SAFETY: `program` was created above and is destroyed only when dropped.
    if let Err(status) = unsafe { result::compile_program(program.0, &options) } {
        let hint = if toolkit.include.is_none() {
            "\n(no CUDA include directory was found: half-precision kernels need CUDA_INCLUDE_DIR)"
        } else {
            ""
        };
        return Err(Error::new(
            operation,
            format!("{:?}:\n{}{hint}", status.0, program.log()),
        ));
    }
    let cubin = program
        .cubin()
        .map_err(|e| Error::new(operation, format!("nvrtcGetCUBIN: {:?}", e.0)))?;
    Ok(Compiled {
        cubin,
        log: program.log().trim().to_string(),
    })
}

/// The version of the NVRTC library in use, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    toolkit()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::new("nvrtcVersion", format!("{:?}", e.0)))?;
    Ok((major, minor))
}

/// The names of the kernels (`__global__` functions) a CUBIN defines, in symbol-table order.
pub fn kernel_names(cubin: &[u8]) -> Result<Vec<String>> {
    const SHT_SYMTAB: u32 = 2;
    const STT_FUNC: u8 = 2;
    const STB_GLOBAL: u8 = 1;
    // st_other flag of a kernel entry point in NVIDIA's ELF.
    const STO_CUDA_ENTRY: u8 = 0x10;

    let elf = Elf(cubin);
    if cubin.get(..4) != Some(b"\x7fELF".as_slice()) {
        return Err(elf.error("not an ELF file"));
    }
    if elf.u8(4)? != 2 || elf.u8(5)? != 1 {
        return Err(elf.error("not a 64-bit little-endian ELF file"));
    }
    let section_table = elf.u64(0x28)?;
    let section_size = u64::from(elf.u16(0x3a)?);
    let sections = u64::from(elf.u16(0x3c)?);
    let section = |i: u64| -> Result<Section> {
        let base = section_table.saturating_add(i.saturating_mul(section_size));
        Ok(Section {
            kind: elf.u32(base + 4)?,
            offset: elf.u64(base + 24)?,
            size: elf.u64(base + 32)?,
            link: elf.u32(base + 40)?,
            entry_size: elf.u64(base + 56)?,
        })
    };
    let mut names = Vec::new();
    for i in 0..sections {
        let table = section(i)?;
        if table.kind != SHT_SYMTAB {
            continue;
        }
        let strings = section(u64::from(table.link))?;
        let entry_size = if table.entry_size == 0 {
            24
        } else {
            table.entry_size
        };
        for k in 0..table.size / entry_size {
            let symbol = table.offset.saturating_add(k * entry_size);
            let (info, other) = (elf.u8(symbol + 4)?, elf.u8(symbol + 5)?);
            if info & 0xf == STT_FUNC && info >> 4 == STB_GLOBAL && other & STO_CUDA_ENTRY != 0 {
                let name = u64::from(elf.u32(symbol)?);
                let (at, limit) = (
                    strings.offset.saturating_add(name),
                    strings.size.saturating_sub(name),
                );
                names.push(elf.string(at, limit)?);
            }
        }
    }
    Ok(names)
}

/// `sm_` followed by digits and an optional feature suffix (`sm_90`, `sm_90a`, `sm_100f`).
fn is_real_architecture(arch: &str) -> bool {
    let Some(rest) = arch.strip_prefix("sm_") else {
        return false;
    };
    let digits = rest.trim_end_matches(|c: char| c.is_ascii_lowercase());
    !digits.is_empty()
        && digits.len() + 1 >= rest.len()
        && digits.bytes().all(|b| b.is_ascii_digit())
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Program {
    fn log(&self) -> String {
        // SAFETY: a live program.
        match unsafe { result::get_program_log(self.0) } {
            Ok(log) => {
                let bytes: Vec<u8> = log
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Err(e) => format!("(no log: {:?})", e.0),
        }
    }

    fn cubin(&self) -> Result<Vec<u8>, result::NvrtcError> {
        let mut size = 0usize;
        // SAFETY: a live, compiled program; the buffer has the size NVRTC reports.
        unsafe {
            sys::nvrtcGetCUBINSize(self.0, &mut size).result()?;
            let mut cubin = vec![0u8; size];
            sys::nvrtcGetCUBIN(self.0, cubin.as_mut_ptr().cast::<c_char>()).result()?;
            Ok(cubin)
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// What was found of the CUDA toolkit, once per process.
struct Toolkit {
    /// Where the CUDA headers are, if anywhere.
    include: Option<PathBuf>,
    /// Libraries loaded by path, kept loaded for the process so that NVRTC finds them by name.
    _preloaded: Vec<libloading::Library>,
}

fn toolkit() -> Result<&'static Toolkit> {
    static TOOLKIT: OnceLock<Result<Toolkit>> = OnceLock::new();
    TOOLKIT
        .get_or_init(find_toolkit)
        .as_ref()
        .map_err(Clone::clone)
}

fn find_toolkit() -> Result<Toolkit> {
    let operation = "loading NVRTC";
    let mut site_packages = None;
    let mut site = || -> Vec<PathBuf> {
        site_packages
            .get_or_insert_with(python_site_packages)
            .iter()
            .map(|dir| dir.join("nvidia/cu13"))
            .collect()
    };
    let explicit = std::env::var_os("NVRTC_LIB_DIR").map(PathBuf::from);
    // SAFETY: only tries to load the library by name (no symbol is used).
    let by_name = explicit.is_none() && unsafe { sys::is_culib_present() };
    let lib_dir = match explicit {
        Some(dir) => Some(dir),
        None if by_name => None,
        None => {
            let toolkits = cuda_homes().into_iter().map(|home| home.join("lib64"));
            let pip = site().into_iter().map(|dir| dir.join("lib"));
            let found = toolkits.chain(pip).find(|dir| dir.join(LIBRARY).is_file());
            if found.is_none() {
                return Err(Error::new(
                    operation,
                    format!(
                        "{LIBRARY} was not found: set NVRTC_LIB_DIR to the directory holding it \
                         (`pip install nvidia-cuda-nvrtc` puts it in site-packages/nvidia/cu13/lib) \
                         or add that directory to LD_LIBRARY_PATH"
                    ),
                ));
            }
            found
        }
    };
    let preloaded = match &lib_dir {
        Some(dir) => preload(dir).map_err(|reason| Error::new(operation, reason))?,
        None => Vec::new(),
    };
    // SAFETY: as above; cudarc finds the preloaded library among the loaded ones by name.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::new(
            operation,
            format!("{LIBRARY} was loaded from {lib_dir:?} but cudarc cannot open it by name"),
        ));
    }

    let include = match std::env::var_os("CUDA_INCLUDE_DIR") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => {
            // A library found by name is looked for in LD_LIBRARY_PATH's directories.
            let searched = std::env::var_os("LD_LIBRARY_PATH")
                .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
                .unwrap_or_default();
            let beside = lib_dir
                .iter()
                .cloned()
                .chain(
                    searched
                        .into_iter()
                        .filter(|dir| dir.join(LIBRARY).is_file()),
                )
                .filter_map(|dir| dir.parent().map(|d| d.join("include")));
            let toolkits = cuda_homes().into_iter().map(|home| home.join("include"));
            let pip = site().into_iter().map(|dir| dir.join("include"));
            beside
                .chain(toolkits)
                .chain(pip)
                .find(|dir| dir.join(MARKER_HEADER).is_file())
        }
    };
    Ok(Toolkit {
        include,
        _preloaded: preloaded,
    })
}

/// Loads the builtins library and NVRTC from `dir` by path.
fn preload(dir: &Path) -> std::result::Result<Vec<libloading::Library>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let builtins = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(BUILTINS_PREFIX))
        })
        .ok_or_else(|| format!("no {BUILTINS_PREFIX}* in {}", dir.display()))?;
    [builtins, dir.join(LIBRARY)]
        .iter()
        .map(|path| {
            // SAFETY: NVIDIA's libraries, whose initializers have no preconditions.
            unsafe { libloading::Library::new(path) }
                .map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}

/// CUDA toolkit roots: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`.
fn cuda_homes() -> Vec<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")])
        .collect()
}

/// The site-packages directories of `python3`, where pip installs NVIDIA's wheels; none when
/// there is no python3.
pub(crate) fn python_site_packages() -> Vec<PathBuf> {
    const SCRIPT: &str = "import site, sysconfig\n\
        p = sysconfig.get_paths()\n\
        dirs = [p['purelib'], p['platlib']] + getattr(site, 'getsitepackages', list)()\n\
        print('\\n'.join(dirs + [site.getusersitepackages()]))";
    match Command::new("python3").args(["-c", SCRIPT]).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// One section header's fields that the symbol walk needs.
struct Section {
    kind: u32,
    offset: u64,
    size: u64,
    link: u32,
    entry_size: u64,
}

/// Bounds-checked little-endian reads from an ELF file.
struct Elf<'a>(&'a [u8]);

impl Elf<'_> {
    fn error(&self, why: &str) -> Error {
        Error::new("reading the kernels of a CUBIN", why)
    }

    fn bytes<const N: usize>(&self, offset: u64) -> Result<[u8; N]> {
        usize::try_from(offset)
            .ok()
            .and_then(|start| self.0.get(start..start.checked_add(N)?))
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| self.error("truncated or corrupt ELF file"))
    }

    fn u8(&self, offset: u64) -> Result<u8> {
        Ok(self.bytes::<1>(offset)?[0])
    }

    fn u16(&self, offset: u64) -> Result<u16> {
        self.bytes(offset).map(u16::from_le_bytes)
    }

    fn u32(&self, offset: u64) -> Result<u32> {
        self.bytes(offset).map(u32::from_le_bytes)
    }

    fn u64(&self, offset: u64) -> Result<u64> {
        self.bytes(offset).map(u64::from_le_bytes)
    }

    /// The NUL-terminated string at `offset`, within `limit` bytes.
    fn string(&self, offset: u64, limit: u64) -> Result<String> {
        let start = usize::try_from(offset).map_err(|_| self.error("string offset"))?;
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let tail = self
            .0
            .get(start..)
            .ok_or_else(|| self.error("string offset"))?;
        let tail = &tail[..tail.len().min(limit)];
        let end = tail
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.error("unterminated symbol name"))?;
        Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures() {
        for arch in ["sm_90", "sm_80", "sm_90a", "sm_100f", "sm_120"] {
            assert!(is_real_architecture(arch), "{arch}");
        }
        for arch in ["compute_90", "sm_", "sm_9x0", "90", "sm_90ab", "SM_90"] {
            assert!(!is_real_architecture(arch), "{arch}");
        }
    }

    #[test]
    fn not_a_cubin() -> Result<()> {
        assert!(kernel_names(b"").is_err());
        assert!(kernel_names(b"\x7fELF\x02\x01").is_err());
        let mut header = vec![0u8; 64];
        header[..6].copy_from_slice(b"\x7fELF\x02\x01");
        // No sections: no kernels.
        assert_eq!(kernel_names(&header)?, Vec::<String>::new());
        header[0x3c] = 1; // one section header, past the end of the file
        header[0x28] = 64;
        assert!(kernel_names(&header).is_err());
        Ok(())
    }
}
