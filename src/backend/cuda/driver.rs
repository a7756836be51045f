//! Thin helpers over the CUDA driver API (cudarc's `sys` layer): loading checks, error
//! mapping, and making a context current for the duration of a call.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Turns a driver result into `Error::Cuda` naming the call.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(cuda_error(call, r, String::new()))
}

/// Builds `Error::Cuda` for a failed call, with the driver's name and description.
pub(crate) fn cuda_error(call: &'static str, r: sys::CUresult, detail: String) -> Error {
    let mut name_ptr: *const std::ffi::c_char = std::ptr::null();
    let mut desc_ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver library is loaded (every caller got here through `driver()`),
    // and both calls only write the out pointers, to static strings.
    let (name, desc) = unsafe {
        let name = if sys::cuGetErrorName(r, &mut name_ptr) == sys::CUresult::CUDA_SUCCESS
            && !name_ptr.is_null()
        {
            CStr::from_ptr(name_ptr).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        };
        let desc = if sys::cuGetErrorString(r, &mut desc_ptr) == sys::CUresult::CUDA_SUCCESS
            && !desc_ptr.is_null()
        {
            CStr::from_ptr(desc_ptr).to_string_lossy().into_owned()
        } else {
            String::new()
        };
        (name, desc)
    };
    let mut full = String::new();
    if !desc.is_empty() {
        full.push_str(": ");
        full.push_str(&desc);
    }
    full.push_str(&detail);
    Error::Cuda {
        call,
        code: r as i32,
        name,
        detail: full,
    }
}

/// Facts about the driver, found once per process.
#[derive(Clone, Debug)]
pub(crate) struct Driver {
    /// CUDA version the driver supports, 1000 * major + 10 * minor.
    pub version: i32,
    /// Number of CUDA devices.
    pub device_count: i32,
}

/// Loads and initializes the driver once; afterwards returns the same answer.
///
/// cudarc panics when libcuda is missing, so the library is probed first: on a machine
/// without it every CUDA request gets `Error::CudaUnavailable`, never a panic.
pub(crate) fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<std::result::Result<Driver, Error>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: probing only tries to dlopen candidate names.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::CudaUnavailable(
                    "the CUDA driver library (libcuda.so.1) was not found: no NVIDIA driver \
                     is installed on this machine"
                        .into(),
                ));
            }
            // SAFETY: the library is present; these calls only write their out-parameters.
            unsafe {
                let r = sys::cuInit(0);
                if r != sys::CUresult::CUDA_SUCCESS {
                    let e = cuda_error("cuInit", r, String::new());
                    return Err(Error::CudaUnavailable(format!(
                        "the CUDA driver could not be initialized ({e}); is there a usable GPU?"
                    )));
                }
                let mut version = 0;
                check("cuDriverGetVersion", sys::cuDriverGetVersion(&mut version))
                    .map_err(|e| Error::CudaUnavailable(e.to_string()))?;
                let mut device_count = 0;
                check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut device_count))
                    .map_err(|e| Error::CudaUnavailable(e.to_string()))?;
                Ok(Driver {
                    version,
                    device_count,
                })
            }
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Makes a context current on this thread until dropped, then restores the previous one.
pub(crate) struct CurrentContext {
    _private: (),
}

impl CurrentContext {
    /// Pushes `ctx` onto this thread's context stack.
    ///
    /// # Safety
    /// `ctx` must be a live context (a retained primary context).
    pub(crate) unsafe fn push(ctx: sys::CUcontext) -> Result<Self> {
        check("cuCtxPushCurrent", sys::cuCtxPushCurrent_v2(ctx))?;
        Ok(CurrentContext { _private: () })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: paired with the successful push in `push`.
        unsafe {
            let _ = sys::cuCtxPopCurrent_v2(&mut popped);
        }
    }
}
