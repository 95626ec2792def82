//! NVRTC: the same CUDA source, compiled for the host with a C++ compiler (`g++`, or
//! `$CUDA_STAND_IN_CXX`).
//!
//! A program is compiled in two passes. The first preprocesses it (with `CUDA_STAND_IN_SCAN`
//! defined, so that `__global__` and `__launch_bounds__` survive macro expansion) and finds its
//! `extern "C" __global__` function definitions; the second compiles it as a shared object with
//! a kernel table appended (`CUDA_STAND_IN_KERNEL`, `include/cuda_stand_in.h`), with
//! `-ffp-contract=off` so that no multiply-add is fused and each `_rn` intrinsic rounds on its
//! own. The "CUBIN" is that shared object; the stand-in driver's `cuModuleLoadData` opens it.
//!
//! Options are NVRTC's: `--gpu-architecture` / `-arch` (`sm_XY` gives a CUBIN; `compute_XY`,
//! like NVRTC, none), `--std`, `--include-path` / `-I`, `--define-macro` / `-D`,
//! `--undefine-macro` / `-U`, and, accepted without effect, the debug and line-info options and
//! `--fmad` / `--use_fast_math` (the stand-in never fuses and always uses the precise math
//! library). Anything else is `NVRTC_ERROR_INVALID_OPTION`. Include paths that hold a
//! `cuda_fp16.h` are the CUDA toolkit's (or a copy of the stand-in's): the stand-in's own
//! headers, built into it, take their place. A compile error is `NVRTC_ERROR_COMPILATION` with
//! the compiler's messages as the program log.
//!
//! Compiled programs are cached by a hash of everything that goes into them (source, options,
//! headers, the stand-in's launcher and the compiler's version) in `$CUDA_STAND_IN_CACHE`
//! (default: `cuda-stand-in-cache` in the system's temporary directory).

#![allow(non_snake_case)]
// Each export's contract is NVRTC's: the caller passes valid pointers as its documentation says.
#![allow(clippy::missing_safety_doc)]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cudarc::nvrtc::sys::{nvrtcProgram, nvrtcResult};

/// The stand-in's headers, written to the cache for the compiler.
const HEADERS: [(&str, &str); 3] = [
    (
        "cuda_stand_in.h",
        include_str!("../include/cuda_stand_in.h"),
    ),
    ("cuda_fp16.h", include_str!("../include/cuda_fp16.h")),
    ("cuda_bf16.h", include_str!("../include/cuda_bf16.h")),
];

/// NVRTC 13's default architecture, when no option names one.
const DEFAULT_ARCH: &str = "compute_75";

struct Program {
    source: String,
    name: String,
    /// Headers given at creation: `(include name, contents)`.
    headers: Vec<(String, String)>,
    log: String,
    /// The compiled module, when compiled for a real architecture.
    cubin: Option<Vec<u8>>,
}

static PROGRAMS: Mutex<BTreeMap<usize, Program>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(1);

fn programs() -> MutexGuard<'static, BTreeMap<usize, Program>> {
    PROGRAMS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn with_program<R>(
    prog: nvrtcProgram,
    f: impl FnOnce(&mut Program) -> R,
) -> Result<R, nvrtcResult> {
    programs()
        .get_mut(&(prog as usize))
        .map(f)
        .ok_or(nvrtcResult::NVRTC_ERROR_INVALID_PROGRAM)
}

/// The cache directory (created on first use).
pub fn cache_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = crate::env("CUDA_STAND_IN_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("cuda-stand-in-cache"));
        let _ = std::fs::create_dir_all(&dir);
        dir
    })
    .clone()
}

fn compiler() -> String {
    crate::env("CUDA_STAND_IN_CXX").unwrap_or_else(|| "g++".to_string())
}

/// FNV-1a with 128 bits: the cache key.
fn hash128(parts: &[&[u8]]) -> u128 {
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for part in parts {
        for &b in part.iter().chain(&(part.len() as u64).to_le_bytes()) {
            h ^= u128::from(b);
            h = h.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
        }
    }
    h
}

/// Writes `contents` to `path` unless it is there already (atomically: other processes and
/// threads may be writing the same file).
fn write_once(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    if path.exists() {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp{}", unique()));
    std::fs::write(&tmp, contents)?;
    std::fs::rename(&tmp, path)
}

fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The stand-in's include directory in the cache.
fn include_dir() -> std::io::Result<PathBuf> {
    let parts: Vec<&[u8]> = HEADERS.iter().map(|(_, text)| text.as_bytes()).collect();
    let dir = cache_dir().join(format!("include-{:032x}", hash128(&parts)));
    std::fs::create_dir_all(&dir)?;
    for (name, text) in HEADERS {
        write_once(&dir.join(name), text.as_bytes())?;
    }
    Ok(dir)
}

/// The compiler's version line, part of the cache key.
fn compiler_version() -> String {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            Command::new(compiler())
                .arg("--version")
                .output()
                .ok()
                .map(|o| {
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .next()
                        .unwrap_or("")
                        .to_string()
                })
                .unwrap_or_default()
        })
        .clone()
}

/// What the options ask for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Options {
    /// `sm_90`, `compute_90`, ...
    arch: String,
    std: Option<String>,
    includes: Vec<PathBuf>,
    /// `-D`/`-U` arguments for the compiler, in order.
    macros: Vec<String>,
}

/// Parses NVRTC's options; the unknown one on error.
fn parse_options(options: &[String]) -> Result<Options, String> {
    let mut o = Options {
        arch: DEFAULT_ARCH.to_string(),
        ..Options::default()
    };
    let mut args = options.iter();
    while let Some(option) = args.next() {
        // `-Ifoo`, `-DX=1` glued to their value; otherwise `--name=value` or `--name value`.
        let glued = ["-I", "-D", "-U"]
            .into_iter()
            .find(|p| option.len() > 2 && option.starts_with(p));
        let (name, inline) = match (glued, option.split_once('=')) {
            (Some(p), _) => (p, Some(option[2..].to_string())),
            (None, Some((n, v))) => (n, Some(v.to_string())),
            (None, None) => (option.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next().cloned())
                .ok_or_else(|| option.clone())
        };
        match name {
            "--gpu-architecture" | "-arch" => {
                let arch = value()?;
                if !valid_arch(&arch) {
                    return Err(option.clone());
                }
                o.arch = arch;
            }
            "--std" | "-std" => {
                let std = value()?;
                if !["c++11", "c++14", "c++17", "c++20"].contains(&std.as_str()) {
                    return Err(option.clone());
                }
                o.std = Some(std);
            }
            "--include-path" | "-I" => o.includes.push(PathBuf::from(value()?)),
            "--define-macro" | "-D" => o.macros.push(format!("-D{}", value()?)),
            "--undefine-macro" | "-U" => o.macros.push(format!("-U{}", value()?)),
            "--fmad" | "-fmad" => {
                if !["true", "false"].contains(&value()?.as_str()) {
                    return Err(option.clone());
                }
            }
            "--use_fast_math"
            | "-use_fast_math"
            | "--device-debug"
            | "-G"
            | "--generate-line-info"
            | "-lineinfo"
            | "--device-as-default-execution-space"
            | "-default-device" => {}
            _ => return Err(option.clone()),
        }
    }
    Ok(o)
}

/// `sm_XY`, `sm_XYa`, `sm_XYf` or `compute_XY` for an architecture NVRTC 13 knows (7.5 on).
fn valid_arch(arch: &str) -> bool {
    let rest = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"));
    let Some(rest) = rest else {
        return false;
    };
    let digits = rest.trim_end_matches(['a', 'f']);
    rest.len() - digits.len() <= 1 && digits.parse::<u32>().is_ok_and(|n| (75..=121).contains(&n))
}

/// `__CUDA_ARCH__` for an architecture: 900 for sm_90.
fn cuda_arch(arch: &str) -> u32 {
    let digits: String = arch.chars().filter(char::is_ascii_digit).collect();
    digits.parse::<u32>().unwrap_or(75) * 10
}

/// One `extern "C" __global__` function definition: its name and its launch bounds (the first
/// argument of `__launch_bounds__`, as C++ text, or `0`).
#[derive(Debug, PartialEq, Eq)]
struct KernelDef {
    name: String,
    bounds: String,
}

/// Tokens of preprocessed C++: identifiers and numbers, literals, single punctuation.
fn tokens(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let bytes = line.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            let start = i;
            if c.is_ascii_whitespace() {
                i += 1;
                continue;
            }
            if c.is_ascii_alphanumeric() || c == b'_' {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
            } else if c == b'"' || c == b'\'' {
                i += 1;
                while i < bytes.len() && bytes[i] != c {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i = (i + 1).min(bytes.len());
            } else {
                i += 1;
            }
            out.push(&line[start..i]);
        }
    }
    out
}

/// The kernel definitions of a preprocessed program.
fn find_kernels(preprocessed: &str) -> Vec<KernelDef> {
    let t = tokens(preprocessed);
    let mut found = Vec::new();
    let mut i = 0;
    while i + 3 < t.len() {
        if !(t[i] == "extern"
            && t[i + 1] == "\"C\""
            && t[i + 2] == "__global__"
            && t[i + 3] == "void")
        {
            i += 1;
            continue;
        }
        let mut j = i + 4;
        let mut bounds = "0".to_string();
        if t.get(j) == Some(&"__launch_bounds__") && t.get(j + 1) == Some(&"(") {
            // The first argument, up to a top-level comma or the closing parenthesis.
            let (mut depth, mut first, mut k) = (0usize, Vec::new(), j + 2);
            let mut in_first = true;
            while k < t.len() {
                match t[k] {
                    "(" => depth += 1,
                    ")" if depth == 0 => break,
                    ")" => depth -= 1,
                    "," if depth == 0 => in_first = false,
                    _ => {}
                }
                if in_first {
                    first.push(t[k]);
                }
                k += 1;
            }
            bounds = format!("({})", first.join(" "));
            j = k + 1;
        }
        let Some(name) = t
            .get(j)
            .filter(|n| n.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
        else {
            i += 1;
            continue;
        };
        // Only definitions: the parameter list is followed by the body.
        let mut k = j + 1;
        let mut depth = 0usize;
        while k < t.len() {
            match t[k] {
                "(" => depth += 1,
                ")" => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            k += 1;
        }
        if t.get(j + 1) == Some(&"(") && t.get(k + 1) == Some(&"{") {
            found.push(KernelDef {
                name: name.to_string(),
                bounds,
            });
        }
        i = k;
    }
    found
}

/// The table appended to a program.
fn kernel_table(kernels: &[KernelDef], arch: &str) -> String {
    let mut out = String::from("\n#line 1 \"cuda-stand-in-kernel-table\"\n");
    out.push_str(&format!(
        "CUDA_STAND_IN_EXPORT const char* cuda_stand_in_arch() {{ return \"{arch}\"; }}\n"
    ));
    out.push_str("CUDA_STAND_IN_EXPORT const cuda_stand_in::Kernel* cuda_stand_in_kernels(unsigned int* count) {\n");
    if kernels.is_empty() {
        out.push_str("    *count = 0;\n    return nullptr;\n}\n");
        return out;
    }
    out.push_str("    static const cuda_stand_in::Kernel table[] = {\n");
    for k in kernels {
        out.push_str(&format!(
            "        CUDA_STAND_IN_KERNEL({}, {}),\n",
            k.name, k.bounds
        ));
    }
    out.push_str(&format!(
        "    }};\n    *count = {};\n    return table;\n}}\n",
        kernels.len()
    ));
    out
}

/// A program name usable as a file name.
fn file_name(name: &str) -> String {
    let base = Path::new(name)
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| {
            !n.is_empty()
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        })
        .unwrap_or("default_program");
    base.to_string()
}

/// How a compilation ended.
struct Compiled {
    status: nvrtcResult,
    log: String,
    cubin: Option<Vec<u8>>,
}

fn failed(status: nvrtcResult, log: String) -> Compiled {
    Compiled {
        status,
        log,
        cubin: None,
    }
}

/// Compiles `p` with `options` (or takes it from the cache).
fn compile(p: &Program, options: &[String]) -> Compiled {
    let o = match parse_options(options) {
        Ok(o) => o,
        Err(bad) => {
            return failed(
                nvrtcResult::NVRTC_ERROR_INVALID_OPTION,
                format!("nvrtc: error: unrecognized option `{bad}`\n"),
            )
        }
    };
    let internal = |what: &str, e: std::io::Error| {
        failed(
            nvrtcResult::NVRTC_ERROR_INTERNAL_ERROR,
            format!("cuda-stand-in: {what}: {e}\n"),
        )
    };
    let include = match include_dir() {
        Ok(dir) => dir,
        Err(e) => return internal("writing the stand-in headers", e),
    };
    // CUDA's own include directories (or copies of ours) give way to the stand-in's headers.
    let includes: Vec<&PathBuf> = o
        .includes
        .iter()
        .filter(|d| !d.join("cuda_fp16.h").is_file())
        .collect();
    let mut key_parts: Vec<Vec<u8>> = vec![
        compiler_version().into_bytes(),
        include.as_os_str().as_encoded_bytes().to_vec(),
        p.name.clone().into_bytes(),
        p.source.clone().into_bytes(),
        format!("{o:?}").into_bytes(),
    ];
    for (name, text) in &p.headers {
        key_parts.push(name.clone().into_bytes());
        key_parts.push(text.clone().into_bytes());
    }
    let key = hash128(&key_parts.iter().map(Vec::as_slice).collect::<Vec<_>>());
    let cached = cache_dir().join(format!("{key:032x}.so"));
    let cached_log = cache_dir().join(format!("{key:032x}.log"));
    let real = o.arch.starts_with("sm_");
    if let (Ok(cubin), Ok(log)) = (std::fs::read(&cached), std::fs::read_to_string(&cached_log)) {
        return Compiled {
            status: nvrtcResult::NVRTC_SUCCESS,
            log,
            cubin: real.then_some(cubin),
        };
    }

    let work = cache_dir().join(format!("work-{}", unique()));
    let result = build(p, &o, &include, &includes, &work);
    let _ = std::fs::remove_dir_all(&work);
    let (so, log) = match result {
        Ok(built) => built,
        Err(Build::Failed(log)) => return failed(nvrtcResult::NVRTC_ERROR_COMPILATION, log),
        Err(Build::Io(what, e)) => return internal(&what, e),
    };
    if let Err(e) = write_once(&cached_log, log.as_bytes()).and_then(|()| write_once(&cached, &so))
    {
        return internal("writing the compile cache", e);
    }
    Compiled {
        status: nvrtcResult::NVRTC_SUCCESS,
        log,
        cubin: real.then_some(so),
    }
}

enum Build {
    /// The compiler's messages.
    Failed(String),
    Io(String, std::io::Error),
}

/// The two compiler passes in `work`: the shared object and the compiler's warnings.
fn build(
    p: &Program,
    o: &Options,
    include: &Path,
    includes: &[&PathBuf],
    work: &Path,
) -> Result<(Vec<u8>, String), Build> {
    let io = |what: &str| {
        let what = what.to_string();
        move |e| Build::Io(what, e)
    };
    let headers = work.join("headers");
    std::fs::create_dir_all(&headers).map_err(io("creating the work directory"))?;
    for (name, text) in &p.headers {
        let path = headers.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io("writing a program header"))?;
        }
        std::fs::write(&path, text).map_err(io("writing a program header"))?;
    }
    let source = work.join(file_name(&p.name));
    std::fs::write(&source, &p.source).map_err(io("writing the program"))?;

    let std_flag = format!("-std={}", o.std.as_deref().unwrap_or("c++17"));
    let common = |cmd: &mut Command| {
        cmd.current_dir(work)
            .arg(&std_flag)
            .arg("-include")
            .arg(include.join("cuda_stand_in.h"))
            .arg("-I")
            .arg(include)
            .arg("-I")
            .arg(&headers);
        for dir in includes {
            cmd.arg("-I").arg(dir);
        }
        cmd.arg("-D__CUDACC__")
            .arg("-D__CUDACC_RTC__")
            .arg(format!("-D__CUDA_ARCH__={}", cuda_arch(&o.arch)))
            .args(&o.macros)
            .arg("-x")
            .arg("c++");
    };
    let run = |cmd: &mut Command| -> Result<std::process::Output, Build> {
        cmd.output()
            .map_err(|e| Build::Io(format!("running {}", compiler()), e))
    };

    let mut scan = Command::new(compiler());
    common(&mut scan);
    scan.arg("-E").arg("-DCUDA_STAND_IN_SCAN").arg(&source);
    let scanned = run(&mut scan)?;
    if !scanned.status.success() {
        return Err(Build::Failed(
            String::from_utf8_lossy(&scanned.stderr).into_owned(),
        ));
    }
    let kernels = find_kernels(&String::from_utf8_lossy(&scanned.stdout));
    let mut text = p.source.clone();
    text.push_str(&kernel_table(&kernels, &o.arch));
    std::fs::write(&source, text).map_err(io("writing the program"))?;

    let output = work.join("module.so");
    let mut cc = Command::new(compiler());
    common(&mut cc);
    cc.args([
        "-O2",
        "-fPIC",
        "-shared",
        "-ffp-contract=off",
        "-fno-fast-math",
        "-fvisibility=hidden",
        "-U_FORTIFY_SOURCE",
    ])
    .arg(&source)
    .arg("-o")
    .arg(&output);
    let compiled = run(&mut cc)?;
    let log = String::from_utf8_lossy(&compiled.stderr).into_owned();
    if !compiled.status.success() {
        return Err(Build::Failed(log));
    }
    let so = std::fs::read(&output).map_err(io("reading the compiled module"))?;
    Ok((so, log))
}

unsafe fn string(p: *const c_char) -> Option<String> {
    (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> nvrtcResult {
    if major.is_null() || minor.is_null() {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    *major = 13;
    *minor = 0;
    nvrtcResult::NVRTC_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut nvrtcProgram,
    src: *const c_char,
    name: *const c_char,
    numHeaders: c_int,
    headers: *const *const c_char,
    includeNames: *const *const c_char,
) -> nvrtcResult {
    let Some(source) = string(src) else {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    };
    if prog.is_null()
        || numHeaders < 0
        || (numHeaders > 0 && (headers.is_null() || includeNames.is_null()))
    {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    let mut given = Vec::new();
    for i in 0..numHeaders as usize {
        match (string(*includeNames.add(i)), string(*headers.add(i))) {
            (Some(n), Some(h)) => given.push((n, h)),
            _ => return nvrtcResult::NVRTC_ERROR_INVALID_INPUT,
        }
    }
    let handle = (NEXT.fetch_add(1, Ordering::Relaxed) << 4 | 0x7) as usize;
    let program = Program {
        source,
        name: string(name).unwrap_or_else(|| "default_program".to_string()),
        headers: given,
        log: String::new(),
        cubin: None,
    };
    programs().insert(handle, program);
    *prog = handle as nvrtcProgram;
    nvrtcResult::NVRTC_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut nvrtcProgram) -> nvrtcResult {
    if prog.is_null() {
        return nvrtcResult::NVRTC_ERROR_INVALID_PROGRAM;
    }
    match programs().remove(&(*prog as usize)) {
        Some(_) => {
            *prog = std::ptr::null_mut();
            nvrtcResult::NVRTC_SUCCESS
        }
        None => nvrtcResult::NVRTC_ERROR_INVALID_PROGRAM,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCompileProgram(
    prog: nvrtcProgram,
    numOptions: c_int,
    options: *const *const c_char,
) -> nvrtcResult {
    if numOptions < 0 || (numOptions > 0 && options.is_null()) {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    let mut given = Vec::new();
    for i in 0..numOptions as usize {
        match string(*options.add(i)) {
            Some(o) => given.push(o),
            None => return nvrtcResult::NVRTC_ERROR_INVALID_INPUT,
        }
    }
    // Compiled outside the lock (it takes seconds); the program is copied out and back.
    let copy = with_program(prog, |p| Program {
        source: p.source.clone(),
        name: p.name.clone(),
        headers: p.headers.clone(),
        log: String::new(),
        cubin: None,
    });
    let copy = match copy {
        Ok(c) => c,
        Err(status) => return status,
    };
    let compiled = compile(&copy, &given);
    let stored = with_program(prog, |p| {
        p.log = compiled.log;
        p.cubin = compiled.cubin;
    });
    match stored {
        Ok(()) => compiled.status,
        Err(status) => status,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(
    prog: nvrtcProgram,
    logSizeRet: *mut usize,
) -> nvrtcResult {
    if logSizeRet.is_null() {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    match with_program(prog, |p| p.log.len() + 1) {
        Ok(n) => {
            *logSizeRet = n;
            nvrtcResult::NVRTC_SUCCESS
        }
        Err(status) => status,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: nvrtcProgram, log: *mut c_char) -> nvrtcResult {
    if log.is_null() {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    let copied = with_program(prog, |p| {
        std::ptr::copy_nonoverlapping(p.log.as_ptr(), log.cast::<u8>(), p.log.len());
        *log.add(p.log.len()) = 0;
    });
    match copied {
        Ok(()) => nvrtcResult::NVRTC_SUCCESS,
        Err(status) => status,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBINSize(
    prog: nvrtcProgram,
    cubinSizeRet: *mut usize,
) -> nvrtcResult {
    if cubinSizeRet.is_null() {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    // 0 after a compilation for a virtual architecture, as NVRTC.
    match with_program(prog, |p| p.cubin.as_ref().map_or(0, Vec::len)) {
        Ok(n) => {
            *cubinSizeRet = n;
            nvrtcResult::NVRTC_SUCCESS
        }
        Err(status) => status,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBIN(prog: nvrtcProgram, cubin: *mut c_char) -> nvrtcResult {
    if cubin.is_null() {
        return nvrtcResult::NVRTC_ERROR_INVALID_INPUT;
    }
    let copied = with_program(prog, |p| match &p.cubin {
        Some(bytes) => {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), cubin.cast::<u8>(), bytes.len());
            nvrtcResult::NVRTC_SUCCESS
        }
        None => nvrtcResult::NVRTC_ERROR_INVALID_INPUT,
    });
    copied.unwrap_or_else(|status| status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options() {
        let o = |v: &[&str]| parse_options(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let parsed = o(&[
            "--gpu-architecture=sm_90",
            "--std=c++17",
            "--include-path=/x",
            "-DA=1",
            "-I",
            "/y",
        ])
        .unwrap();
        assert_eq!(parsed.arch, "sm_90");
        assert_eq!(parsed.std.as_deref(), Some("c++17"));
        assert_eq!(parsed.includes, [PathBuf::from("/x"), PathBuf::from("/y")]);
        assert_eq!(parsed.macros, ["-DA=1"]);
        assert_eq!(o(&[]).unwrap().arch, DEFAULT_ARCH);
        assert_eq!(o(&["-arch=compute_90"]).unwrap().arch, "compute_90");
        assert_eq!(
            o(&["--gpu-architecture=sm_52"]),
            Err("--gpu-architecture=sm_52".to_string())
        );
        assert_eq!(o(&["--frobnicate"]), Err("--frobnicate".to_string()));
        assert_eq!(o(&["-I"]), Err("-I".to_string()));
    }

    #[test]
    fn kernels_after_preprocessing() {
        let text = "# 1 \"x.cu\"\nextern \"C\" __global__ void __launch_bounds__(THREADS)\nfoo(int n, const float* x) { }\n\
                    extern \"C\" __global__ void bar(long long n) { if (n) {} }\n\
                    extern \"C\" __global__ void declared(int);\n\
                    extern \"C\" __global__ void __launch_bounds__(f(1, 2), 4) baz() {}\n\
                    __global__ void not_extern_c() {}\n";
        assert_eq!(
            find_kernels(text),
            [
                KernelDef {
                    name: "foo".into(),
                    bounds: "(THREADS)".into()
                },
                KernelDef {
                    name: "bar".into(),
                    bounds: "0".into()
                },
                KernelDef {
                    name: "baz".into(),
                    bounds: "(f ( 1 , 2 ))".into()
                },
            ]
        );
    }
}
