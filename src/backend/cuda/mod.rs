//! The CUDA backend: the device's primary context (the one the CUDA runtime uses, so
//! `cudaMalloc` pointers and `cudaStream_t`s of the host work as they are), a stream, and
//! the embedded kernels, loaded once per context on first use.

mod copy;
pub(crate) mod driver;
pub mod memory;
pub(crate) mod module;
pub(crate) mod patch;

pub use module::{build_info, kernels_compiled};

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys;

use self::driver::{check, CurrentContext};
use self::module::{Kernel, LoadedModule};
use super::{BackendKind, DeviceInfo, Stream};
use crate::error::{Error, Result};
use crate::tensor::TensorView;

/// Oldest driver the embedded kernels run on: they are built by CUDA 13.0.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// Number of CUDA devices, or why CUDA cannot be used here.
pub fn device_count() -> Result<i32> {
    Ok(driver::driver()?.device_count)
}

/// The CUDA driver's version (1000 * major + 10 * minor), or why CUDA cannot be used.
pub fn driver_version() -> Result<i32> {
    Ok(driver::driver()?.version)
}

/// One device's primary context, a default stream and the lazily loaded kernels.
pub struct CudaBackend {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    /// The stream used when a call names none.
    stream: sys::CUstream,
    /// True when `stream` was created here (and is destroyed on drop).
    owns_stream: bool,
    sm_count: u32,
    max_shared_optin: u32,
    module: OnceLock<std::result::Result<LoadedModule, Error>>,
}

// SAFETY: the driver's context, stream and module handles may be used from any thread;
// every use makes the context current first.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

impl CudaBackend {
    /// Opens device `ordinal`'s primary context. `stream` is the host's default stream for
    /// this context (`Stream::DEFAULT`: create one). Fails with `NotCompiled` when the
    /// library carries no kernels and `CudaUnavailable` when the driver, the device or a
    /// new enough driver is missing.
    pub fn new(ordinal: i32, stream: Stream) -> Result<CudaBackend> {
        Self::with_fatbin(ordinal, stream, module::fatbin())
    }

    pub(crate) fn with_fatbin(
        ordinal: i32,
        stream: Stream,
        fatbin: Option<&'static [u8]>,
    ) -> Result<CudaBackend> {
        if fatbin.is_none() {
            return Err(Error::NotCompiled(format!(
                "this kvreplay library was built without CUDA kernels ({}); rebuild it with \
                 nvcc available (scripts/install-cuda-toolchain.sh) to use the CUDA backend",
                module::build_info()
            )));
        }
        if ordinal < 0 {
            return Err(Error::InvalidArgument(format!(
                "CUDA device ordinal {ordinal} is negative"
            )));
        }
        let drv = driver::driver()?;
        if drv.version < MIN_DRIVER_VERSION {
            return Err(Error::CudaUnavailable(format!(
                "the CUDA driver supports CUDA {}.{}, but kvreplay's kernels need {}.{} or newer \
                 (driver 580+)",
                drv.version / 1000,
                (drv.version % 1000) / 10,
                MIN_DRIVER_VERSION / 1000,
                (MIN_DRIVER_VERSION % 1000) / 10
            )));
        }
        if ordinal >= drv.device_count {
            return Err(Error::CudaUnavailable(format!(
                "CUDA device {ordinal} was requested but this machine has {} CUDA device(s)",
                drv.device_count
            )));
        }
        // SAFETY: the driver is loaded and initialized; each call writes only its outputs.
        unsafe {
            let mut device: sys::CUdevice = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut device, ordinal))?;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
            )?;
            let mut backend = CudaBackend {
                ordinal,
                device,
                ctx,
                stream: std::ptr::null_mut(),
                owns_stream: false,
                sm_count: 0,
                max_shared_optin: 0,
                module: OnceLock::new(),
            };
            // From here on, `backend`'s Drop releases what was taken.
            let _cur = CurrentContext::push(ctx)?;
            backend.sm_count = attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )? as u32;
            backend.max_shared_optin = attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as u32;
            if stream == Stream::DEFAULT {
                let mut s: sys::CUstream = std::ptr::null_mut();
                check(
                    "cuStreamCreate",
                    sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                )?;
                backend.stream = s;
                backend.owns_stream = true;
            } else {
                let s = stream.0 as sys::CUstream;
                let mut owner: sys::CUcontext = std::ptr::null_mut();
                let r = sys::cuStreamGetCtx(s, &mut owner);
                if r != sys::CUresult::CUDA_SUCCESS {
                    let e = driver::cuda_error("cuStreamGetCtx", r, String::new());
                    return Err(Error::InvalidArgument(format!(
                        "stream {:#x} is not a usable CUstream ({e})",
                        stream.0
                    )));
                }
                if owner != ctx {
                    return Err(Error::InvalidArgument(format!(
                        "stream {:#x} belongs to a CUDA context other than device {ordinal}'s \
                         primary context (the one the CUDA runtime uses); kvreplay launches in \
                         the primary context",
                        stream.0
                    )));
                }
                backend.stream = s;
            }
            Ok(backend)
        }
    }

    /// The CUDA device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Largest dynamic shared memory a block may opt in to, in bytes.
    pub fn max_shared_per_block(&self) -> u32 {
        self.max_shared_optin
    }

    /// The raw primary context.
    pub fn raw_context(&self) -> sys::CUcontext {
        self.ctx
    }

    /// The stream a call runs on: `stream`, or the context's own for `Stream::DEFAULT`.
    pub fn resolve_stream(&self, stream: Stream) -> sys::CUstream {
        if stream == Stream::DEFAULT {
            self.stream
        } else {
            stream.0 as sys::CUstream
        }
    }

    /// Makes this context current on the calling thread until the guard drops.
    pub(crate) fn make_current(&self) -> Result<CurrentContext> {
        // SAFETY: `ctx` is retained for the backend's lifetime.
        unsafe { CurrentContext::push(self.ctx) }
    }

    /// The kernels, loaded on first use (once per context).
    pub(crate) fn module(&self) -> Result<&LoadedModule> {
        self.module
            .get_or_init(|| {
                let image = module::fatbin().ok_or_else(|| {
                    Error::NotCompiled(
                        "this kvreplay library was built without CUDA kernels".into(),
                    )
                })?;
                let _cur = self.make_current()?;
                // SAFETY: the context is current.
                unsafe { LoadedModule::load(image) }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Launches `kernel` on `stream`; `params` points at each kernel argument in order.
    /// Never synchronizes and never allocates device memory, so it can be captured.
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let module = self.module()?;
        let f = module.function(kernel);
        let _cur = self.make_current()?;
        // SAFETY: `f` belongs to this context's module, `params` holds one valid pointer
        // per kernel parameter (the callers build them from #[repr(C)] structs that match
        // the kernel signatures), and the stream belongs to this context.
        let r = unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                self.resolve_stream(stream),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver::cuda_error(
                "cuLaunchKernel",
                r,
                format!(
                    " (kernel {}, grid {grid:?}, block {block:?})",
                    kernel.name()
                ),
            ));
        }
        Ok(())
    }

    /// `launch`, optionally with programmatic dependent launch (`pdl`; used only where the
    /// kernel's code was built for PTX 9.0+, i.e. from compute_90a on sm_90: code JIT-built
    /// from the compute_80 PTX has no `griddepcontrol` and must not start early): the kernel
    /// may start while the previous kernel on the stream finishes, so it must wait
    /// (`griddepcontrol.wait`) before touching memory; and, for `cluster > 0`, in thread-block
    /// clusters of `cluster` CTAs along x (sm_90+; the kernel must have been prepared with
    /// [`CudaBackend::prepare_cluster`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_ex(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
        pdl: bool,
        cluster: u32,
    ) -> Result<()> {
        // KVR_PDL=0 launches every kernel without the programmatic dependency (A/B runs).
        static PDL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let pdl = pdl && *PDL.get_or_init(|| std::env::var("KVR_PDL").as_deref() != Ok("0"));
        if !pdl && cluster == 0 {
            return self.launch(kernel, grid, block, shared_bytes, stream, params);
        }
        let f = self.module()?.function(kernel);
        if self.ptx_version(kernel)? < 90 {
            if cluster > 0 {
                return Err(Error::Unsupported(format!(
                    "kernel {} was not built for sm_90+: no thread-block clusters",
                    kernel.name()
                )));
            }
            return self.launch(kernel, grid, block, shared_bytes, stream, params);
        }
        let _cur = self.make_current()?;
        // SAFETY: an all-zero attribute is a valid (empty) value of the C union.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if pdl {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster > 0 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared_bytes,
            hStream: self.resolve_stream(stream),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: as in `launch`; `config` and `attrs` outlive the call.
        let r =
            unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver::cuda_error(
                "cuLaunchKernelEx",
                r,
                format!(
                    " (kernel {}, grid {grid:?}, block {block:?}, programmatic dependent \
                     launch {pdl}, cluster {cluster})",
                    kernel.name()
                ),
            ));
        }
        Ok(())
    }

    /// The PTX version `kernel`'s code was built from (90 for compute_90a).
    fn ptx_version(&self, kernel: Kernel) -> Result<i32> {
        let f = self.module()?.function(kernel);
        let _cur = self.make_current()?;
        let mut ptx = 0;
        // SAFETY: `f` belongs to this context's module; writes only `ptx`.
        check("cuFuncGetAttribute", unsafe {
            sys::cuFuncGetAttribute(
                &mut ptx,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PTX_VERSION,
                f,
            )
        })?;
        Ok(ptx)
    }

    /// Allows `kernel` clusters of `cluster` CTAs (beyond the portable 8 where the device
    /// allows it) and returns how many such clusters of `block_threads`-thread CTAs with
    /// `shared_bytes` of shared memory can be resident at once (0: none, or no clusters on
    /// this device). Call after [`CudaBackend::prepare_kernel`].
    pub(crate) fn prepare_cluster(
        &self,
        kernel: Kernel,
        cluster: u32,
        shared_bytes: u32,
        block_threads: u32,
    ) -> Result<u32> {
        // Code JIT-built from the compute_80 PTX has no cluster instructions.
        if self.ptx_version(kernel)? < 90 {
            return Ok(0);
        }
        let f = self.module()?.function(kernel);
        let _cur = self.make_current()?;
        // SAFETY: `f` belongs to this context's module; the calls write only outputs.
        unsafe {
            if cluster > 8 {
                let r = sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                );
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Ok(0);
                }
            }
            let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attr.value.clusterDim.x = cluster;
            attr.value.clusterDim.y = 1;
            attr.value.clusterDim.z = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cluster,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: block_threads,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: shared_bytes,
                hStream: std::ptr::null_mut(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            let mut n = 0;
            let r = sys::cuOccupancyMaxActiveClusters(&mut n, f, &config);
            Ok(if r == sys::CUresult::CUDA_SUCCESS {
                n.max(0) as u32
            } else {
                0
            })
        }
    }

    /// Asks for the largest shared-memory carveout for `kernel` (less L1), for kernels whose
    /// occupancy is set by their shared memory.
    pub(crate) fn prefer_shared_memory(&self, kernel: Kernel) -> Result<()> {
        let f = self.module()?.function(kernel);
        let _cur = self.make_current()?;
        // SAFETY: `f` belongs to this context's module.
        unsafe {
            check(
                "cuFuncSetAttribute",
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    100,
                ),
            )
        }
    }

    /// Lets `kernel` use `shared_bytes` of dynamic shared memory and returns how many blocks
    /// of `block_threads` threads fit on one multiprocessor (0: it cannot run).
    pub(crate) fn prepare_kernel(
        &self,
        kernel: Kernel,
        shared_bytes: u32,
        block_threads: u32,
    ) -> Result<u32> {
        let f = self.module()?.function(kernel);
        let _cur = self.make_current()?;
        // SAFETY: `f` belongs to this context's module; the calls write only outputs.
        unsafe {
            check(
                "cuFuncSetAttribute",
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes as i32,
                ),
            )?;
            let mut blocks = 0;
            check(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut blocks,
                    f,
                    block_threads as i32,
                    shared_bytes as usize,
                ),
            )?;
            Ok(blocks.max(0) as u32)
        }
    }

    /// Queues a host-to-device copy on `stream`. `src` may be pageable: the driver has read
    /// it by the time this returns, so the caller may reuse it at once.
    pub(crate) fn copy_to_device_async(
        &self,
        dst: usize,
        src: &[u8],
        stream: Stream,
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let _cur = self.make_current()?;
        // SAFETY: the caller guarantees `dst` has room for `src.len()` bytes.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst as sys::CUdeviceptr,
                src.as_ptr() as *const c_void,
                src.len(),
                self.resolve_stream(stream),
            )
        })
    }

    /// Stream-ordered device allocation (freed with `free_async` on the same stream).
    pub(crate) fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<usize> {
        let _cur = self.make_current()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes only `ptr`.
        let r =
            unsafe { sys::cuMemAllocAsync(&mut ptr, bytes.max(1), self.resolve_stream(stream)) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::OutOfMemory(format!(
                "cannot allocate {bytes} bytes of device staging memory"
            )));
        }
        check("cuMemAllocAsync", r)?;
        Ok(ptr as usize)
    }

    /// Frees a `alloc_async` allocation once the work queued on `stream` so far is done.
    pub(crate) fn free_async(&self, ptr: usize, stream: Stream) -> Result<()> {
        let _cur = self.make_current()?;
        // SAFETY: `ptr` came from `alloc_async`.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr as sys::CUdeviceptr, self.resolve_stream(stream))
        })
    }

    /// Queues a byte fill of `bytes` bytes at device address `dst` on `stream`.
    pub(crate) fn memset_async(
        &self,
        dst: usize,
        byte: u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _cur = self.make_current()?;
        // SAFETY: the caller guarantees `dst` has room for `bytes` bytes.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(
                dst as sys::CUdeviceptr,
                byte,
                bytes,
                self.resolve_stream(stream),
            )
        })
    }

    /// Waits for `stream`, then copies `out.len()` bytes from device address `src`.
    pub(crate) fn read_device(&self, src: usize, out: &mut [u8], stream: Stream) -> Result<()> {
        self.synchronize(stream)?;
        let _cur = self.make_current()?;
        // SAFETY: the caller guarantees `src` holds `out.len()` readable bytes.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr() as *mut c_void,
                src as sys::CUdeviceptr,
                out.len(),
            )
        })
    }

    /// Waits for all work queued in the context, on every stream.
    pub(crate) fn synchronize_all(&self) -> Result<()> {
        let _cur = self.make_current()?;
        // SAFETY: the context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Waits for `stream`.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        let _cur = self.make_current()?;
        // SAFETY: the stream belongs to this context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.resolve_stream(stream))
        })
    }

    /// Describes the device.
    pub fn device_info(&self) -> Result<DeviceInfo> {
        let _cur = self.make_current()?;
        // SAFETY: the context is current; each call writes only its outputs.
        unsafe {
            let mut name = [0 as std::ffi::c_char; 256];
            check(
                "cuDeviceGetName",
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, self.device),
            )?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut total = 0usize;
            check(
                "cuDeviceTotalMem",
                sys::cuDeviceTotalMem_v2(&mut total, self.device),
            )?;
            let (mut free, mut total_now) = (0usize, 0usize);
            check(
                "cuMemGetInfo",
                sys::cuMemGetInfo_v2(&mut free, &mut total_now),
            )?;
            use sys::CUdevice_attribute as A;
            Ok(DeviceInfo {
                backend: BackendKind::Cuda,
                device: self.ordinal,
                name,
                multiprocessor_count: self.sm_count,
                compute_capability: (
                    attribute(self.device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
                    attribute(self.device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
                ),
                total_memory: total as u64,
                free_memory: free as u64,
                l2_cache_bytes: attribute(self.device, A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?
                    as u64,
                driver_version: driver::driver()?.version,
            })
        }
    }

    /// Queues a strided copy with conversion (arguments checked by `Context::copy`).
    pub fn copy(&self, src: &TensorView, dst: &TensorView, stream: Stream) -> Result<()> {
        copy::launch_copy(self, src, dst, stream)
    }
}

/// Reads one device attribute.
///
/// # Safety
/// The driver must be initialized.
unsafe fn attribute(device: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    check(
        "cuDeviceGetAttribute",
        sys::cuDeviceGetAttribute(&mut v, attr, device),
    )?;
    Ok(v)
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: tears down what `new` created, in reverse order, with the context current.
        unsafe {
            if let Ok(_cur) = CurrentContext::push(self.ctx) {
                // Work queued through this context may still use its module and stream.
                let _ = sys::cuCtxSynchronize();
                if self.owns_stream && !self.stream.is_null() {
                    let _ = sys::cuStreamDestroy_v2(self.stream);
                }
                drop(self.module.take());
            }
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_fatbin_means_not_compiled() {
        match CudaBackend::with_fatbin(0, Stream::DEFAULT, None) {
            Err(Error::NotCompiled(m)) => assert!(m.contains("without CUDA kernels"), "{m}"),
            Err(e) => panic!("expected NotCompiled, got {e}"),
            Ok(_) => panic!("expected NotCompiled"),
        }
    }
}
