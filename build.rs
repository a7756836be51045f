//! Build script: compiles `kernels/*.cu` into one fatbin embedded in the library.
//!
//! nvcc is looked up in this order: `KVR_NVCC` (a path, or `none` to build CPU-only),
//! `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, `nvcc` on `PATH`, and the pinned toolchain
//! that `scripts/install-cuda-toolchain.sh` puts in `.cuda-toolchain/`. No GPU is probed.
//!
//! - No usable nvcc: the library builds CPU-only and the CUDA backend reports
//!   `KVR_STATUS_NOT_COMPILED`, unless `KVR_REQUIRE_KERNELS=1`, which makes it an error.
//! - nvcc found but a kernel does not compile: always an error (a broken kernel is a bug,
//!   never a silent CPU-only build). Set `KVR_NVCC=none` to build without kernels on purpose.
//!
//! Targets: sm_80, sm_86, sm_89 and sm_90a machine code plus compute_80 PTX
//! (`KVR_CUDA_ARCHS=90a` narrows the machine-code list for quick local builds).
//! With the `header` feature and `KVR_HEADER_OUT` set, it also writes the C header there.
//!
//! Kernel cache: compiling the fatbin for every target takes many minutes, and cargo runs
//! this script once per profile and target directory (check, test, release, the C examples'
//! CMake build). The fatbin is therefore kept under a key made of everything that goes into
//! it (the bytes of every file in `kernels/`, the nvcc path, release, size and time, every
//! nvcc argument) in `kvr-kernel-cache/` of the outermost cargo target directory, and reused
//! when the key matches. `KVR_KERNEL_CACHE` names another directory, or `none` to always compile.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_ARCHS: &str = "80,86,89,90a";
const PTX_ARCH: &str = "80";

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo::rustc-check-cfg=cfg(kvr_kernels)");
    println!("cargo::rerun-if-changed=build.rs");
    for var in [
        "KVR_NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "PATH",
        "KVR_REQUIRE_KERNELS",
        "KVR_CUDA_ARCHS",
        "KVR_NVCC_FLAGS",
        "KVR_PTXAS_VERBOSE",
        "KVR_HEADER_OUT",
        "KVR_KERNEL_CACHE",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }

    build_kernels(&manifest, &out_dir);

    #[cfg(feature = "header")]
    generate_header(&manifest);
}

fn require_kernels() -> bool {
    matches!(
        env::var("KVR_REQUIRE_KERNELS").as_deref(),
        Ok("1") | Ok("true") | Ok("yes")
    )
}

/// Writes `kernels.rs` into OUT_DIR: the embedded fatbin (or `None`) and how it was built.
fn write_kernel_module(out_dir: &Path, fatbin: Option<&Path>, description: &str) {
    let body = match fatbin {
        Some(path) => format!(
            "/// The fatbin compiled from kernels/*.cu.\npub(crate) static FATBIN: Option<&[u8]> = Some(include_bytes!({path:?}));\n/// How the kernels were built.\npub(crate) const BUILD_INFO: &str = {description:?};\n"
        ),
        None => format!(
            "/// No kernels: the library was built without a usable nvcc.\npub(crate) static FATBIN: Option<&[u8]> = None;\n/// Why no kernels were built.\npub(crate) const BUILD_INFO: &str = {description:?};\n"
        ),
    };
    fs::write(out_dir.join("kernels.rs"), body).expect("write kernels.rs");
}

fn build_kernels(manifest: &Path, out_dir: &Path) {
    let kernel_dir = manifest.join("kernels");
    println!("cargo::rerun-if-changed={}", kernel_dir.display());
    let mut sources = Vec::new();
    if let Ok(entries) = fs::read_dir(&kernel_dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("cu") => {
                    println!("cargo::rerun-if-changed={}", path.display());
                    sources.push(path);
                }
                Some("cuh" | "h") => println!("cargo::rerun-if-changed={}", path.display()),
                _ => {}
            }
        }
    }
    sources.sort();

    let nvcc = match find_nvcc(manifest) {
        NvccSearch::Found(path, version) => (path, version),
        NvccSearch::Disabled => {
            if require_kernels() {
                panic!("KVR_REQUIRE_KERNELS=1 but KVR_NVCC=none disables the kernel build");
            }
            write_kernel_module(out_dir, None, "built without kernels: KVR_NVCC=none");
            return;
        }
        NvccSearch::Missing(why) => {
            if require_kernels() {
                panic!(
                    "KVR_REQUIRE_KERNELS=1 but no usable nvcc was found ({why}). \
                     Run scripts/install-cuda-toolchain.sh or set KVR_NVCC."
                );
            }
            println!(
                "cargo::warning=kvreplay: no usable nvcc ({why}); building CPU-only. \
                 Run scripts/install-cuda-toolchain.sh (then `cargo clean -p kvreplay`) for CUDA kernels."
            );
            write_kernel_module(out_dir, None, &format!("built without kernels: {why}"));
            return;
        }
    };
    let (nvcc, version) = nvcc;
    if sources.is_empty() {
        panic!("no kernels/*.cu found in {}", kernel_dir.display());
    }

    // One translation unit that includes every kernel source, so there is one fatbin.
    let umbrella = out_dir.join("kvreplay_kernels.cu");
    let mut text =
        String::from("// Generated by build.rs: every kernels/*.cu in one translation unit.\n");
    for src in &sources {
        text.push_str(&format!("#include \"{}\"\n", src.display()));
    }
    fs::write(&umbrella, text).expect("write umbrella .cu");

    let archs = env::var("KVR_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    let fatbin = out_dir.join("kvreplay.fatbin");
    let mut cmd = Command::new(&nvcc);
    cmd.arg("--fatbin")
        .arg("-o")
        .arg(&fatbin)
        .arg(&umbrella)
        .arg("-std=c++17")
        .arg("-O3")
        .arg("-lineinfo")
        .arg("--threads")
        .arg("0")
        .arg("-I")
        .arg(&kernel_dir);
    let mut arch_list = Vec::new();
    for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        cmd.arg(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
        arch_list.push(format!("sm_{arch}"));
    }
    cmd.arg(format!(
        "-gencode=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}"
    ));
    arch_list.push(format!("compute_{PTX_ARCH} PTX"));
    let verbose = matches!(env::var("KVR_PTXAS_VERBOSE").as_deref(), Ok("1"));
    if verbose {
        cmd.arg("-Xptxas=-v");
    }
    // nvcc 12.8+ can compress the machine code hard: ~10x smaller fatbin, decompressed
    // once when the module loads.
    if release_at_least(&version, 12, 8) {
        cmd.arg("--compress-mode=size");
    }
    if let Ok(extra) = env::var("KVR_NVCC_FLAGS") {
        cmd.args(extra.split_whitespace());
    }
    let cache = if verbose {
        None
    } else {
        kernel_cache(out_dir, manifest, &kernel_dir, &nvcc, &version, &cmd)
    };
    let description = format!(
        "nvcc {version} ({}), targets {}",
        nvcc.display(),
        arch_list.join(", ")
    );
    if let Some(cached) = cache.as_ref().filter(|c| c.is_file()) {
        if fs::copy(cached, &fatbin).is_ok() {
            println!("cargo::rustc-cfg=kvr_kernels");
            write_kernel_module(out_dir, Some(&fatbin), &description);
            return;
        }
    }
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("failed to run {}: {e}", nvcc.display()));
    let stderr = String::from_utf8_lossy(&output.stderr);
    if verbose {
        fs::write(out_dir.join("ptxas.log"), stderr.as_bytes()).ok();
        println!(
            "cargo::warning=kvreplay: ptxas report in {}",
            out_dir.join("ptxas.log").display()
        );
    }
    if !output.status.success() {
        panic!(
            "kernel compilation failed ({}; {version}):\n{stderr}\n\
             Set KVR_NVCC=none to build without CUDA kernels.",
            nvcc.display()
        );
    }
    if let Some(cached) = cache {
        store_in_cache(&fatbin, &cached);
    }
    println!("cargo::rustc-cfg=kvr_kernels");
    write_kernel_module(out_dir, Some(&fatbin), &description);
}

/// The cache file for this build's fatbin, or `None` when caching is off or no cache
/// directory can be found. The key hashes every file in `kernels/` (name and bytes), the
/// source tree's path (line info names the sources), the nvcc path, release, size and
/// modification time, and every nvcc argument except the output and umbrella paths (which
/// differ per profile).
fn kernel_cache(
    out_dir: &Path,
    manifest: &Path,
    kernel_dir: &Path,
    nvcc: &Path,
    version: &str,
    cmd: &Command,
) -> Option<PathBuf> {
    let dir = match env::var_os("KVR_KERNEL_CACHE") {
        Some(v) if matches!(v.to_str(), Some("none" | "off" | "0")) => return None,
        Some(v) if !v.is_empty() => PathBuf::from(v),
        // The outermost ancestor of OUT_DIR that cargo marked as a target directory, so
        // that nested target directories (`--target-dir target/x`) share one cache.
        _ => out_dir
            .ancestors()
            .filter(|d| d.join("CACHEDIR.TAG").is_file())
            .last()?
            .join("kvr-kernel-cache"),
    };
    let mut files: Vec<PathBuf> = fs::read_dir(kernel_dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut key = Fnv64::new();
    key.add(b"kvreplay kernel cache v1");
    key.add(manifest.as_os_str().as_encoded_bytes());
    key.add(nvcc.as_os_str().as_encoded_bytes());
    key.add(version.as_bytes());
    // The release names no patch level: the binary's size and time stand for it.
    if let Ok(meta) = fs::metadata(nvcc) {
        key.add(&meta.len().to_le_bytes());
        if let Ok(d) = meta
            .modified()
            .map(|t| t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default())
        {
            key.add(&d.as_nanos().to_le_bytes());
        }
    }
    for arg in cmd.get_args() {
        let arg = Path::new(arg);
        if arg.starts_with(out_dir) {
            continue;
        }
        key.add(arg.as_os_str().as_encoded_bytes());
    }
    for file in &files {
        key.add(file.file_name()?.as_encoded_bytes());
        key.add(&fs::read(file).ok()?);
    }
    Some(dir.join(format!("{:016x}.fatbin", key.finish())))
}

/// Copies a freshly compiled fatbin into the cache (write, then rename: a concurrent build
/// never reads half a file) and keeps the 4 newest entries. Failures only cost the cache.
fn store_in_cache(fatbin: &Path, cached: &Path) {
    let Some(dir) = cached.parent() else { return };
    if fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = cached.with_extension(format!("tmp{}", std::process::id()));
    if fs::copy(fatbin, &tmp).is_err() || fs::rename(&tmp, cached).is_err() {
        fs::remove_file(&tmp).ok();
        return;
    }
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "fatbin"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    entries.sort();
    let excess = entries.len().saturating_sub(4);
    for (_, old) in entries.into_iter().take(excess) {
        fs::remove_file(old).ok();
    }
}

/// 64-bit FNV-1a over length-prefixed fields (stable across Rust releases, unlike
/// `DefaultHasher`).
struct Fnv64(u64);

impl Fnv64 {
    fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, bytes: &[u8]) {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

enum NvccSearch {
    Found(PathBuf, String),
    Disabled,
    Missing(String),
}

fn find_nvcc(manifest: &Path) -> NvccSearch {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(explicit) = env::var("KVR_NVCC") {
        if matches!(explicit.as_str(), "none" | "off" | "0") {
            return NvccSearch::Disabled;
        }
        // An explicit choice is the only candidate: a wrong path must not fall through.
        let path = PathBuf::from(&explicit);
        return match nvcc_version(&path) {
            Ok(v) => NvccSearch::Found(path, v),
            Err(e) => NvccSearch::Missing(format!("KVR_NVCC={explicit}: {e}")),
        };
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = env::var(var) {
            candidates.push(Path::new(&home).join("bin").join("nvcc"));
        }
    }
    if let Some(paths) = env::var_os("PATH") {
        for dir in env::split_paths(&paths) {
            candidates.push(dir.join("nvcc"));
        }
    }
    candidates.push(manifest.join(".cuda-toolchain/nvidia/cu13/bin/nvcc"));
    let mut rejected = Vec::new();
    for path in candidates {
        if !path.is_file() {
            continue;
        }
        match nvcc_version(&path) {
            Ok(v) => return NvccSearch::Found(path, v),
            Err(e) => rejected.push(format!("{}: {e}", path.display())),
        }
    }
    if rejected.is_empty() {
        NvccSearch::Missing("nvcc not found".into())
    } else {
        NvccSearch::Missing(rejected.join("; "))
    }
}

/// Runs `nvcc --version` and returns "release X.Y"; rejects releases older than 12.0
/// (sm_90a needs 12.0).
fn nvcc_version(path: &Path) -> Result<String, String> {
    let out = Command::new(path)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run: {e}"))?;
    if !out.status.success() {
        return Err("`nvcc --version` failed".into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let release = text
        .split("release ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .ok_or_else(|| "cannot read the release from `nvcc --version`".to_string())?
        .trim()
        .to_string();
    let major: u32 = release
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| format!("cannot parse release {release}"))?;
    if major < 12 {
        return Err(format!("CUDA {release} is too old (need 12.0 or newer)"));
    }
    Ok(format!("release {release}"))
}

/// True when "release X.Y" is at least major.minor.
fn release_at_least(version: &str, major: u32, minor: u32) -> bool {
    let nums: Vec<u32> = version
        .trim_start_matches("release ")
        .split('.')
        .filter_map(|x| x.parse().ok())
        .collect();
    match nums.as_slice() {
        [ma, mi, ..] => (*ma, *mi) >= (major, minor),
        _ => false,
    }
}

#[cfg(feature = "header")]
fn generate_header(manifest: &Path) {
    let Ok(dest) = env::var("KVR_HEADER_OUT") else {
        return;
    };
    println!("cargo::rerun-if-changed=cbindgen.toml");
    println!("cargo::rerun-if-changed=src/ffi");
    let mut config =
        cbindgen::Config::from_file(manifest.join("cbindgen.toml")).expect("read cbindgen.toml");
    let version = |name: &str| env::var(name).expect("version variable");
    let macros = format!(
        "/** Major version of this header (0 while the API may still change between minors). */\n\
         #define KVR_VERSION_MAJOR {}\n\
         /** Minor version of this header. */\n\
         #define KVR_VERSION_MINOR {}\n\
         /** Patch version of this header. */\n\
         #define KVR_VERSION_PATCH {}\n\
         /** The version as one number: major * 10000 + minor * 100 + patch. */\n\
         #define KVR_VERSION_NUMBER ((KVR_VERSION_MAJOR * 10000) + (KVR_VERSION_MINOR * 100) + KVR_VERSION_PATCH)\n",
        version("CARGO_PKG_VERSION_MAJOR"),
        version("CARGO_PKG_VERSION_MINOR"),
        version("CARGO_PKG_VERSION_PATCH"),
    );
    let existing = config.after_includes.take().unwrap_or_default();
    config.after_includes = Some(format!("\n{macros}{existing}"));
    // Only src/ffi (and the modules it declares) is parsed: the core's public items are
    // not part of the C API.
    let mut text = Vec::new();
    cbindgen::Builder::new()
        .with_src(manifest.join("src/ffi/mod.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen failed")
        .write(&mut text);
    let text = String::from_utf8(text).expect("cbindgen wrote UTF-8");
    std::fs::write(&dest, parenthesize_casts(&text)).expect("write the header");
}

/// cbindgen writes a constant declared `N as kvr_x` as `#define NAME (kvr_x)N`; wrap the
/// value in parentheses so that the macro expands to one expression everywhere
/// (`sizeof KVR_STATUS_OK`, `-KVR_LAYER_ALL`).
#[cfg(feature = "header")]
fn parenthesize_casts(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 1024);
    for line in text.lines() {
        match line
            .strip_prefix("#define ")
            .and_then(|r| r.split_once(' '))
        {
            Some((name, value)) if value.starts_with("(kvr_") => {
                out.push_str(&format!("#define {name} ({value})"));
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}
