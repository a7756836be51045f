//! `kvr_context`: a backend (CPU threads, or a CUDA device with a stream and kernels).

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use super::guard::{guard, guard_value, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::status::kvr_status;
use crate::backend::{BackendKind, BackendRequest, Context, ContextOptions, Stream};
use crate::error::{Error, Result};

/// Which backend a context uses.
pub type kvr_backend = i32;
/// Only returned by `kvr_context_get_backend` for a NULL or dead handle.
pub const KVR_BACKEND_INVALID: kvr_backend = -1 as kvr_backend;
/// CUDA if it can be used here (driver, device and kernels present), else CPU.
pub const KVR_BACKEND_AUTO: kvr_backend = 0 as kvr_backend;
/// Host memory and host threads.
pub const KVR_BACKEND_CPU: kvr_backend = 1 as kvr_backend;
/// CUDA device memory and kernels on a stream.
pub const KVR_BACKEND_CUDA: kvr_backend = 2 as kvr_backend;

/// An execution context (opaque). Created by `kvr_context_new`, freed by `kvr_context_free`.
pub struct kvr_context {
    _private: [u8; 0],
}

pub(crate) static CONTEXTS: Registry<Context> = Registry::new("kvr_context");

/// The live context behind a C handle.
pub(crate) fn context_from(ctx: *const kvr_context) -> Result<Arc<Context>> {
    CONTEXTS.get(ctx as usize)
}

/// Options for `kvr_context_new`. Fill with `kvr_context_params_default`, then change
/// fields; `struct_size` lets later versions add fields at the end.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_context_params {
    /// `sizeof(kvr_context_params)` as the caller compiled it (set by the default function).
    pub struct_size: u32,
    /// `KVR_BACKEND_AUTO` (default), `KVR_BACKEND_CPU` or `KVR_BACKEND_CUDA`.
    pub backend: kvr_backend,
    /// CUDA device ordinal (default 0).
    pub device: i32,
    /// The `CUstream` / `cudaStream_t` used when a call passes a NULL stream. NULL (default):
    /// the context creates its own non-blocking stream. A stream passed here must belong to
    /// the device's primary context (the CUDA runtime's) and outlive the context. NULL never
    /// means the legacy default stream here or in any call: pass `CU_STREAM_LEGACY`
    /// (`cudaStreamLegacy`, `(void *)0x1`) or `CU_STREAM_PER_THREAD` (`(void *)0x2`) for those.
    pub stream: *mut c_void,
    /// CPU threads including the caller's; 0 (default) = all available cores.
    pub n_threads: i32,
}

/// Size of the first published `kvr_context_params` layout.
const CONTEXT_PARAMS_V1: usize = size_of::<kvr_context_params>();

fn default_params() -> kvr_context_params {
    kvr_context_params {
        struct_size: size_of::<kvr_context_params>() as u32,
        backend: KVR_BACKEND_AUTO,
        device: 0,
        stream: std::ptr::null_mut(),
        n_threads: 0,
    }
}

/// Fills `*params` with the defaults (AUTO backend, device 0, own stream, all cores) and
/// sets `struct_size`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_context_params_default(params: *mut kvr_context_params) -> kvr_status {
    guard("kvr_context_params_default", || {
        non_null(params, "params")?;
        // SAFETY: checked non-NULL; the caller passes a writable struct.
        unsafe { params.write(default_params()) };
        Ok(())
    })
}

fn options_from_c(p: &kvr_context_params) -> Result<ContextOptions> {
    let backend = match p.backend {
        KVR_BACKEND_AUTO => BackendRequest::Auto,
        KVR_BACKEND_CPU => BackendRequest::Cpu,
        KVR_BACKEND_CUDA => BackendRequest::Cuda,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown backend {other} (expected KVR_BACKEND_AUTO, _CPU or _CUDA)"
            )))
        }
    };
    if p.device < 0 {
        return Err(Error::InvalidArgument(format!(
            "device {} is negative",
            p.device
        )));
    }
    if p.n_threads < 0 {
        return Err(Error::InvalidArgument(format!(
            "n_threads {} is negative (0 = all cores)",
            p.n_threads
        )));
    }
    Ok(ContextOptions {
        backend,
        device: p.device,
        stream: Stream(p.stream as usize),
        n_threads: p.n_threads as usize,
    })
}

/// Creates a context and stores it in `*out`. `params` may be NULL for the defaults.
///
/// AUTO picks CUDA when the driver, the device and the library's kernels are all usable,
/// else the CPU. CUDA work runs in the device's primary context (the one the CUDA runtime
/// uses), so `cudaMalloc` pointers and streams of the host can be passed as they are.
/// Kernels are loaded on first use (or by `kvr_context_load_kernels`).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`out` is NULL);
/// `KVR_STATUS_INVALID_ARG` (an unknown backend, a negative device or thread count, a
/// `struct_size` smaller than the first published layout or larger with a non-zero byte
/// past this library's struct, a stream that is not of the device's primary context);
/// `KVR_STATUS_CUDA_UNAVAILABLE` (CUDA requested and no driver library, no such device or
/// too old a driver); `KVR_STATUS_NOT_COMPILED` (CUDA requested from a library built
/// without kernels); `KVR_STATUS_CUDA_ERROR` / `KVR_STATUS_OUT_OF_MEMORY` (setup failed).
/// Ownership: the caller owns the new context and frees it with `kvr_context_free`.
/// `params` is copied; a stream given in it stays the caller's and must outlive the
/// context.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written and nothing is left allocated.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_context_new(
    params: *const kvr_context_params,
    out: *mut *mut kvr_context,
) -> kvr_status {
    guard("kvr_context_new", || {
        non_null(out, "out")?;
        let p = if params.is_null() {
            default_params()
        } else {
            // SAFETY: non-NULL; the caller passes `struct_size` readable bytes.
            unsafe {
                read_versioned(
                    params,
                    default_params(),
                    CONTEXT_PARAMS_V1,
                    "kvr_context_params",
                )?
            }
        };
        let options = options_from_c(&p)?;
        let ctx = Context::new(&options)?;
        let handle = CONTEXTS.insert(ctx);
        // SAFETY: checked non-NULL.
        unsafe { out.write(handle as *mut kvr_context) };
        Ok(())
    })
}

/// Releases the caller's handle to a context. NULL is a no-op. The handle is invalid at
/// once; the context itself lives on while pools made from it exist and is destroyed when
/// the last of them is freed. Destroying it on CUDA waits for the work queued through its
/// device, destroys the stream it created and unloads its kernels: destroy CUDA Graphs that
/// hold its kernels first.
///
/// Returns: nothing.
/// Ownership: ends the caller's ownership of `ctx`; a stream given in `kvr_context_params`
/// stays the caller's.
/// Thread safety: thread-safe; a call already running on another thread keeps the context
/// alive until it returns, and calls that start later get `KVR_STATUS_INVALID_ARG`.
/// On failure: a handle that is not a live context (freed already, or of another kind) is
/// ignored and recorded in `kvr_error_last_message`; nothing changes.
#[no_mangle]
pub extern "C" fn kvr_context_free(ctx: *mut kvr_context) {
    if ctx.is_null() {
        return;
    }
    let _ = guard("kvr_context_free", || {
        CONTEXTS.remove(ctx as usize).map(drop)
    });
}

/// Returns the backend a context uses.
///
/// Returns: `KVR_BACKEND_CPU` or `KVR_BACKEND_CUDA` (never AUTO); `KVR_BACKEND_INVALID` for
/// a NULL or dead handle.
/// Ownership: nothing changes hands.
/// Thread safety: thread-safe.
/// On failure: `KVR_BACKEND_INVALID`, with the reason in `kvr_error_last_message`.
#[no_mangle]
pub extern "C" fn kvr_context_get_backend(ctx: *const kvr_context) -> kvr_backend {
    guard_value(
        "kvr_context_get_backend",
        KVR_BACKEND_INVALID,
        || match context_from(ctx) {
            Ok(c) => match c.backend() {
                BackendKind::Cpu => KVR_BACKEND_CPU,
                BackendKind::Cuda => KVR_BACKEND_CUDA,
            },
            Err(e) => {
                super::guard::set_last_error(&format!("kvr_context_get_backend: {e}"));
                KVR_BACKEND_INVALID
            }
        },
    )
}

/// What a context runs on, filled by `kvr_context_get_device_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_device_info {
    /// Set to `sizeof(kvr_device_info)` before the call; at most that many bytes are
    /// written, and on return it holds the number of bytes written.
    pub struct_size: u32,
    /// `KVR_BACKEND_CPU` or `KVR_BACKEND_CUDA`.
    pub backend: kvr_backend,
    /// CUDA device ordinal, or -1 for the CPU.
    pub device: i32,
    /// Streaming multiprocessors (CUDA) or worker threads (CPU).
    pub multiprocessor_count: i32,
    /// Compute capability major (CUDA), 0 for the CPU.
    pub compute_capability_major: i32,
    /// Compute capability minor (CUDA), 0 for the CPU.
    pub compute_capability_minor: i32,
    /// CUDA version the driver supports (1000 * major + 10 * minor), 0 for the CPU.
    pub driver_version: i32,
    /// Reserved, 0.
    pub reserved: i32,
    /// Device memory (CUDA) or physical memory (CPU), bytes.
    pub total_memory_bytes: u64,
    /// Free device memory (CUDA) or available memory (CPU) at the time of the call, bytes.
    pub free_memory_bytes: u64,
    /// L2 cache (CUDA), bytes; 0 for the CPU.
    pub l2_cache_bytes: u64,
    /// NUL-terminated device name (GPU name, or CPU model).
    pub name: [c_char; 256],
}

/// Describes the device behind `ctx`: name, SM count, compute capability, memory, driver.
/// Set `out->struct_size = sizeof(kvr_device_info)` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `ctx` or `out`);
/// `KVR_STATUS_INVALID_ARG` (not a live context, `struct_size` too small);
/// `KVR_STATUS_CUDA_ERROR` (the driver query failed).
/// Ownership: `*out` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_context_get_device_info(
    ctx: *const kvr_context,
    out: *mut kvr_device_info,
) -> kvr_status {
    guard("kvr_context_get_device_info", || {
        let ctx = context_from(ctx)?;
        non_null(out, "out")?;
        let info = ctx.device_info()?;
        let mut c = kvr_device_info {
            struct_size: size_of::<kvr_device_info>() as u32,
            backend: match info.backend {
                BackendKind::Cpu => KVR_BACKEND_CPU,
                BackendKind::Cuda => KVR_BACKEND_CUDA,
            },
            device: info.device,
            multiprocessor_count: info.multiprocessor_count as i32,
            compute_capability_major: info.compute_capability.0 as i32,
            compute_capability_minor: info.compute_capability.1 as i32,
            driver_version: info.driver_version,
            reserved: 0,
            total_memory_bytes: info.total_memory,
            free_memory_bytes: info.free_memory,
            l2_cache_bytes: info.l2_cache_bytes,
            name: [0; 256],
        };
        for (dst, &b) in c.name.iter_mut().zip(info.name.as_bytes().iter().take(255)) {
            *dst = b as c_char;
        }
        // SAFETY: non-NULL; the caller passes `struct_size` writable bytes.
        unsafe { write_versioned(out, c, size_of::<kvr_device_info>(), "kvr_device_info") }
    })
}

/// Loads the context's CUDA kernels now instead of at the first launch, so that a CUDA
/// Graph capture that follows sees no module load. A no-op for a CPU context.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (NULL or dead
/// handle); `KVR_STATUS_NOT_COMPILED`; `KVR_STATUS_CUDA_ERROR` (the fatbin has no code this
/// GPU or driver can run).
/// Ownership: the module belongs to the context and is unloaded with it.
/// Thread safety: thread-safe; the module is loaded once per context.
/// On failure: nothing is loaded; a later call or launch tries again.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_context_load_kernels(ctx: *const kvr_context) -> kvr_status {
    guard("kvr_context_load_kernels", || {
        context_from(ctx)?.load_kernels()
    })
}

/// Waits until the work queued on `stream` (NULL: the context's stream) is done; returns at
/// once for a CPU context. This is the only kvreplay call besides setup and teardown that
/// blocks on the device.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (NULL or dead
/// handle); `KVR_STATUS_CUDA_ERROR` (queued work failed, for example an illegal address in
/// a kernel).
/// Ownership: `stream` stays the caller's.
/// Thread safety: thread-safe.
/// On failure: nothing changes; after `KVR_STATUS_CUDA_ERROR` the queued work that failed
/// left its objects in an unspecified state (free them; the CUDA context is usually
/// unusable).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_context_synchronize(
    ctx: *const kvr_context,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_context_synchronize", || {
        context_from(ctx)?.synchronize(Stream(stream as usize))
    })
}

/// Stores the number of CUDA devices in `*out`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`out` is NULL);
/// `KVR_STATUS_CUDA_UNAVAILABLE` (no driver library, or it cannot initialize).
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_cuda_get_device_count(out: *mut i32) -> kvr_status {
    guard("kvr_cuda_get_device_count", || {
        non_null(out, "out")?;
        let n = crate::backend::cuda::device_count()?;
        // SAFETY: checked non-NULL.
        unsafe { out.write(n) };
        Ok(())
    })
}
