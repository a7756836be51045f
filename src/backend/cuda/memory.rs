//! Device memory owned by kvreplay (pools, scratch) and host-side transfer helpers.

use cudarc::driver::sys;

use super::driver::{check, CurrentContext};
use super::CudaBackend;
use crate::backend::Stream;
use crate::error::{Error, Result};

/// A device allocation in a device's primary context, freed on drop. It retains the
/// primary context itself, so it stays valid even if the creating backend goes first.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a device pointer and a retained context handle may be used from any thread.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) of device memory, 256-byte aligned.
    /// Synchronous (cuMemAlloc): never call it inside a decode step.
    pub fn new(backend: &CudaBackend, bytes: usize) -> Result<DeviceBuffer> {
        let _cur = backend.make_current()?;
        // SAFETY: the context is current; retain/alloc write only their outputs.
        unsafe {
            let mut device: sys::CUdevice = 0;
            check(
                "cuDeviceGet",
                sys::cuDeviceGet(&mut device, backend.ordinal()),
            )?;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
            )?;
            let mut ptr: sys::CUdeviceptr = 0;
            let r = sys::cuMemAlloc_v2(&mut ptr, bytes.max(1));
            if r != sys::CUresult::CUDA_SUCCESS {
                let _ = sys::cuDevicePrimaryCtxRelease_v2(device);
                if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    return Err(Error::OutOfMemory(format!(
                        "cannot allocate {bytes} bytes of device memory"
                    )));
                }
                return Err(super::driver::cuda_error("cuMemAlloc", r, String::new()));
            }
            Ok(DeviceBuffer {
                ptr,
                bytes,
                device,
                ctx,
            })
        }
    }

    /// The device address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `data` to the start of the buffer and waits until the device holds it
    /// (synchronous; setup and tests). A plain `cuMemcpyHtoD` from pageable memory may
    /// return before its DMA lands, and work queued afterwards on a non-blocking stream is
    /// not ordered after it, so this synchronizes the context before returning.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        if bytes > self.bytes {
            return Err(Error::OutOfRange(format!(
                "upload of {bytes} bytes into a {}-byte device buffer",
                self.bytes
            )));
        }
        // SAFETY: the range fits in the allocation; the context is retained.
        unsafe {
            let _cur = CurrentContext::push(self.ctx)?;
            check(
                "cuMemcpyHtoD",
                sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr() as *const _, bytes),
            )?;
            check("cuCtxSynchronize", sys::cuCtxSynchronize())
        }
    }

    /// Copies the start of the buffer into `out` (synchronous; waits for all prior work
    /// in the context).
    pub fn download<T: Copy>(&self, out: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        if bytes > self.bytes {
            return Err(Error::OutOfRange(format!(
                "download of {bytes} bytes from a {}-byte device buffer",
                self.bytes
            )));
        }
        // SAFETY: the range fits in the allocation; the context is retained.
        unsafe {
            let _cur = CurrentContext::push(self.ctx)?;
            check("cuCtxSynchronize", sys::cuCtxSynchronize())?;
            check(
                "cuMemcpyDtoH",
                sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut _, self.ptr, bytes),
            )
        }
    }

    /// Fills the buffer with `byte` on `stream` (asynchronous).
    pub fn fill_async(&self, backend: &CudaBackend, byte: u8, stream: Stream) -> Result<()> {
        // SAFETY: the range is the allocation; the stream belongs to the context.
        unsafe {
            let _cur = CurrentContext::push(self.ctx)?;
            check(
                "cuMemsetD8Async",
                sys::cuMemsetD8Async(self.ptr, byte, self.bytes, backend.resolve_stream(stream)),
            )
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: frees what `new` allocated, then releases the retained context.
        unsafe {
            if let Ok(_cur) = CurrentContext::push(self.ctx) {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}
