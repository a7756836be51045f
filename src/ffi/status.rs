//! Status codes and their strings.

use std::ffi::c_char;

use crate::error::Error;

/// Result of every fallible call: `KVR_STATUS_OK` (0) or a negative error code. Values are
/// explicit and never reused; `kvr_error_last_message()` gives the details of a failure.
pub type kvr_status = i32;

/// Success.
pub const KVR_STATUS_OK: kvr_status = 0 as kvr_status;
/// A required pointer argument was NULL.
pub const KVR_STATUS_NULL_ARG: kvr_status = -1 as kvr_status;
/// An argument is malformed: unknown enum value, struct_size too small (or larger than
/// this library's struct with a non-zero byte past it), bad shape or strides, a handle
/// that is not a live object of the expected kind.
pub const KVR_STATUS_INVALID_ARG: kvr_status = -2 as kvr_status;
/// Host or device memory could not be allocated.
pub const KVR_STATUS_OUT_OF_MEMORY: kvr_status = -3 as kvr_status;
/// CUDA cannot be used here: no driver library, no device, a bad ordinal, an old driver.
pub const KVR_STATUS_CUDA_UNAVAILABLE: kvr_status = -4 as kvr_status;
/// The library was built without CUDA kernels (no nvcc at build time).
pub const KVR_STATUS_NOT_COMPILED: kvr_status = -5 as kvr_status;
/// A CUDA driver call or kernel launch failed.
pub const KVR_STATUS_CUDA_ERROR: kvr_status = -6 as kvr_status;
/// The operation or combination of arguments is not supported.
pub const KVR_STATUS_UNSUPPORTED: kvr_status = -7 as kvr_status;
/// An internal error (a bug) was caught before it crossed the C boundary.
pub const KVR_STATUS_PANIC: kvr_status = -8 as kvr_status;
/// A tensor has an element type the operation does not accept.
pub const KVR_STATUS_DTYPE_MISMATCH: kvr_status = -9 as kvr_status;
/// A size or index is outside what the object holds or supports.
pub const KVR_STATUS_OUT_OF_RANGE: kvr_status = -10 as kvr_status;
/// A sequence id that is not live in the pool.
pub const KVR_STATUS_UNKNOWN_ID: kvr_status = -11 as kvr_status;
/// The pool is full: not enough free pages, or no free sequence slot. Nothing changed.
pub const KVR_STATUS_POOL_EXHAUSTED: kvr_status = -12 as kvr_status;
/// A file could not be opened, read or mapped.
pub const KVR_STATUS_IO_ERROR: kvr_status = -13 as kvr_status;
/// A file is truncated, corrupted or inconsistent (a model file kvreplay will not use).
pub const KVR_STATUS_MALFORMED_FILE: kvr_status = -14 as kvr_status;

/// The status code for a core error (the one place errors become codes).
pub fn status_of(e: &Error) -> kvr_status {
    match e {
        Error::NullArgument(_) => KVR_STATUS_NULL_ARG,
        Error::InvalidArgument(_) => KVR_STATUS_INVALID_ARG,
        Error::DTypeMismatch(_) => KVR_STATUS_DTYPE_MISMATCH,
        Error::OutOfRange(_) => KVR_STATUS_OUT_OF_RANGE,
        Error::UnknownId(_) => KVR_STATUS_UNKNOWN_ID,
        Error::PoolExhausted(_) => KVR_STATUS_POOL_EXHAUSTED,
        Error::OutOfMemory(_) => KVR_STATUS_OUT_OF_MEMORY,
        Error::CudaUnavailable(_) => KVR_STATUS_CUDA_UNAVAILABLE,
        Error::NotCompiled(_) => KVR_STATUS_NOT_COMPILED,
        Error::Cuda { .. } => KVR_STATUS_CUDA_ERROR,
        Error::Unsupported(_) => KVR_STATUS_UNSUPPORTED,
        Error::Io(_) => KVR_STATUS_IO_ERROR,
        Error::MalformedFile(_) => KVR_STATUS_MALFORMED_FILE,
        Error::Panic(_) => KVR_STATUS_PANIC,
    }
}

/// Every status with its static description (the table `kvr_status_string` reads).
pub const STATUS_STRINGS: &[(kvr_status, &str)] = &[
    (KVR_STATUS_OK, "ok\0"),
    (
        KVR_STATUS_NULL_ARG,
        "a required pointer argument was NULL\0",
    ),
    (KVR_STATUS_INVALID_ARG, "invalid argument\0"),
    (KVR_STATUS_OUT_OF_MEMORY, "out of memory\0"),
    (
        KVR_STATUS_CUDA_UNAVAILABLE,
        "CUDA is not available on this machine\0",
    ),
    (
        KVR_STATUS_NOT_COMPILED,
        "the library was built without CUDA kernels\0",
    ),
    (KVR_STATUS_CUDA_ERROR, "a CUDA call failed\0"),
    (
        KVR_STATUS_UNSUPPORTED,
        "unsupported operation or arguments\0",
    ),
    (
        KVR_STATUS_PANIC,
        "internal error (a bug in kvreplay; please report it)\0",
    ),
    (
        KVR_STATUS_DTYPE_MISMATCH,
        "a tensor has the wrong element type\0",
    ),
    (KVR_STATUS_OUT_OF_RANGE, "a size or index is out of range\0"),
    (KVR_STATUS_UNKNOWN_ID, "unknown sequence id\0"),
    (KVR_STATUS_POOL_EXHAUSTED, "the pool is full\0"),
    (KVR_STATUS_IO_ERROR, "a file could not be opened or read\0"),
    (
        KVR_STATUS_MALFORMED_FILE,
        "a file is truncated, corrupted or inconsistent\0",
    ),
];

/// Describes a status code.
///
/// Returns: a static, NUL-terminated description of `status`; "unknown status" for a value
/// that is not a kvreplay status. Never NULL.
/// Ownership: static; do not free it.
/// Thread safety: thread-safe.
/// On failure: cannot fail.
#[no_mangle]
pub extern "C" fn kvr_status_string(status: kvr_status) -> *const c_char {
    match STATUS_STRINGS.iter().find(|(s, _)| *s == status) {
        Some((_, text)) => text.as_ptr().cast(),
        None => c"unknown status".as_ptr(),
    }
}
