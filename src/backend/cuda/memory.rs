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
    /// Bytes reserved and mapped through the virtual memory API (`map_large`); 0 for a
    /// `cuMemAlloc` allocation.
    mapped: usize,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

/// Allocations of at least this many bytes are mapped through the driver's virtual memory
/// API (`cuMemCreate` + `cuMemMap`, one physical allocation rounded up to the recommended
/// granularity) instead of `cuMemAlloc`. The reason is measured (H200, BENCHMARKS.md, issue
/// 15): once a process has allocated and freed many GiB, a multi-GiB `cuMemAlloc` pool
/// made the paged decode, whose CTAs read 4-8 KB of many scattered pages, 15-19 % slower
/// (2295 vs 1975 us at 8 GiB) while contiguous reads barely moved; the same pool on mapped
/// memory stayed at its fresh-process speed. `KVR_CUDA_VMM=0` turns it off (A/B runs).
const VMM_MIN_BYTES: usize = 64 << 20;

// SAFETY: a device pointer and a retained context handle may be used from any thread.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) of device memory, 256-byte aligned (from
    /// `VMM_MIN_BYTES` on mapped through the virtual memory API, aligned to its granularity).
    /// Synchronous (cuMemAlloc, cuMemMap): never call it inside a decode step.
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
            if bytes >= VMM_MIN_BYTES && vmm_enabled() {
                match map_large(device, bytes) {
                    Ok(Some((ptr, mapped))) => {
                        return Ok(DeviceBuffer {
                            ptr,
                            bytes,
                            mapped,
                            device,
                            ctx,
                        })
                    }
                    // No virtual memory management on this device: cuMemAlloc below.
                    Ok(None) => {}
                    Err(e) => {
                        let _ = sys::cuDevicePrimaryCtxRelease_v2(device);
                        return Err(e);
                    }
                }
            }
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
                mapped: 0,
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

    /// True where the memory is mapped through the virtual memory API (large buffers).
    pub fn is_mapped(&self) -> bool {
        self.mapped > 0
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
                if self.mapped > 0 {
                    // cuMemFree waits for work that may still read the memory; unmapping
                    // does not promise to, so wait first. The physical memory goes with
                    // its last mapping.
                    let _ = sys::cuCtxSynchronize();
                    let _ = sys::cuMemUnmap(self.ptr, self.mapped);
                    let _ = sys::cuMemAddressFree(self.ptr, self.mapped);
                } else {
                    let _ = sys::cuMemFree_v2(self.ptr);
                }
            }
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

fn vmm_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVR_CUDA_VMM").as_deref() != Ok("0"))
}

/// Reserves an address range for `bytes` (rounded up to the recommended granularity), backs
/// it with one physical allocation on `device` and maps it read-write for that device:
/// `(address, mapped bytes)`, or `None` where the device has no virtual memory management.
/// Out of memory is `Error::OutOfMemory`; every step is undone on failure.
///
/// # Safety
/// `device`'s primary context must be current.
unsafe fn map_large(
    device: sys::CUdevice,
    bytes: usize,
) -> Result<Option<(sys::CUdeviceptr, usize)>> {
    let mut vmm = 0;
    let r = sys::cuDeviceGetAttribute(
        &mut vmm,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        device,
    );
    if r != sys::CUresult::CUDA_SUCCESS || vmm == 0 {
        return Ok(None);
    }
    // SAFETY: plain-old-data driver structs; every field that matters is set below.
    let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    let mut gran = 0usize;
    check(
        "cuMemGetAllocationGranularity",
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        ),
    )?;
    let gran = gran.max(1);
    let size = bytes.div_ceil(gran) * gran;
    let oom = |r: sys::CUresult, call: &'static str| {
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory(format!("cannot allocate {bytes} bytes of device memory"))
        } else {
            super::driver::cuda_error(call, r, String::new())
        }
    };
    let mut ptr: sys::CUdeviceptr = 0;
    let r = sys::cuMemAddressReserve(&mut ptr, size, gran, 0, 0);
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(oom(r, "cuMemAddressReserve"));
    }
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let r = sys::cuMemCreate(&mut handle, size, &prop, 0);
    if r != sys::CUresult::CUDA_SUCCESS {
        let _ = sys::cuMemAddressFree(ptr, size);
        return Err(oom(r, "cuMemCreate"));
    }
    let r = sys::cuMemMap(ptr, size, 0, handle, 0);
    // The mapping holds the physical memory from here on (or nothing does).
    let _ = sys::cuMemRelease(handle);
    if r != sys::CUresult::CUDA_SUCCESS {
        let _ = sys::cuMemAddressFree(ptr, size);
        return Err(oom(r, "cuMemMap"));
    }
    let mut access: sys::CUmemAccessDesc = std::mem::zeroed();
    access.location = prop.location;
    access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let r = sys::cuMemSetAccess(ptr, size, &access, 1);
    if r != sys::CUresult::CUDA_SUCCESS {
        let _ = sys::cuMemUnmap(ptr, size);
        let _ = sys::cuMemAddressFree(ptr, size);
        return Err(oom(r, "cuMemSetAccess"));
    }
    Ok(Some((ptr, size)))
}
