//! Library version and build facts.

use std::ffi::c_char;

static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// The library version, "MAJOR.MINOR.PATCH".
///
/// Returns: a static, NUL-terminated string equal to the header's
/// `KVR_VERSION_MAJOR/MINOR/PATCH` when header and library match. Never NULL.
/// Ownership: static; do not free it.
/// Thread safety: thread-safe.
/// On failure: cannot fail.
#[no_mangle]
pub extern "C" fn kvr_library_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

/// How the CUDA kernels were built (nvcc release and targets), or why the library has none.
///
/// Returns: a static, NUL-terminated description. Never NULL.
/// Ownership: static; do not free it.
/// Thread safety: thread-safe.
/// On failure: cannot fail.
#[no_mangle]
pub extern "C" fn kvr_library_build_info() -> *const c_char {
    use std::sync::OnceLock;
    static INFO: OnceLock<std::ffi::CString> = OnceLock::new();
    INFO.get_or_init(|| {
        std::ffi::CString::new(crate::backend::cuda::build_info().replace('\0', " "))
            .unwrap_or_default()
    })
    .as_ptr()
}

/// Says whether the library carries CUDA kernels (it was built with nvcc). Without them,
/// CUDA contexts fail with `KVR_STATUS_NOT_COMPILED`.
///
/// Returns: true when the kernels are compiled in.
/// Ownership: nothing changes hands.
/// Thread safety: thread-safe.
/// On failure: cannot fail.
#[no_mangle]
pub extern "C" fn kvr_library_kernels_compiled() -> bool {
    crate::backend::cuda::kernels_compiled()
}
