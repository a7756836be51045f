//! Memory a pool owns in its context's memory kind: host (CPU backend) or device (CUDA).

use super::cuda::memory::DeviceBuffer;
use super::{BackendKind, Context, Stream};
use crate::error::{Error, Result};

/// Zeroed, 64-byte aligned host memory.
pub struct HostBuffer {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: plain memory owned by this value; access is governed by its owner's API.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `bytes` (at least 64) of zeroed host memory.
    pub fn zeroed(bytes: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(64), 64)
            .map_err(|e| Error::OutOfMemory(format!("cannot lay out {bytes} bytes: {e}")))?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::OutOfMemory(format!(
                "cannot allocate {bytes} bytes of host memory"
            )));
        }
        Ok(HostBuffer { ptr, layout })
    }

    /// The address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// Owned memory in a context's memory kind, zeroed at allocation.
pub enum Buffer {
    /// Host memory (CPU backend).
    Host(HostBuffer),
    /// Device memory (CUDA backend).
    Device(DeviceBuffer),
}

impl Buffer {
    /// Allocates `bytes` of zeroed memory for `ctx` (synchronous: setup time only).
    pub fn zeroed(ctx: &Context, bytes: usize) -> Result<Buffer> {
        match ctx.backend() {
            BackendKind::Cpu => Ok(Buffer::Host(HostBuffer::zeroed(bytes)?)),
            BackendKind::Cuda => {
                let cuda = ctx.cuda().expect("CUDA backend");
                let buf = DeviceBuffer::new(cuda, bytes)?;
                buf.fill_async(cuda, 0, Stream::DEFAULT)?;
                ctx.synchronize(Stream::DEFAULT)?;
                Ok(Buffer::Device(buf))
            }
        }
    }

    /// The address (host or device).
    pub fn addr(&self) -> usize {
        match self {
            Buffer::Host(b) => b.addr(),
            Buffer::Device(b) => b.addr(),
        }
    }
}
