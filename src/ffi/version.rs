//! Library version and build facts.

use std::ffi::c_char;

static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

/// Returns the library version, "MAJOR.MINOR.PATCH", equal to the header's
/// `KVR_VERSION_MAJOR/MINOR/PATCH` when header and library match. Static, never NULL,
/// thread-safe; must not be freed.
#[no_mangle]
pub extern "C" fn kvr_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

/// Returns a static description of how the CUDA kernels were built (nvcc release and
/// targets) or why the library has none. Never NULL, thread-safe; must not be freed.
#[no_mangle]
pub extern "C" fn kvr_build_info() -> *const c_char {
    use std::sync::OnceLock;
    static INFO: OnceLock<std::ffi::CString> = OnceLock::new();
    INFO.get_or_init(|| {
        std::ffi::CString::new(crate::backend::cuda::build_info().replace('\0', " "))
            .unwrap_or_default()
    })
    .as_ptr()
}

/// Returns true when the library carries CUDA kernels (it was built with nvcc). Without
/// them, CUDA contexts fail with `KVR_STATUS_NOT_COMPILED`. Thread-safe.
#[no_mangle]
pub extern "C" fn kvr_kernels_compiled() -> bool {
    crate::backend::cuda::kernels_compiled()
}
