//! Execution contexts: a CPU backend (threaded, always available) and a CUDA backend
//! (driver API through cudarc, kernels from the embedded fatbin).

pub mod buffer;
pub mod cpu;
pub mod cuda;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::tensor::{MemoryKind, TensorView};

/// Which backend a caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendRequest {
    /// CUDA if it can be used here (driver, device, kernels), otherwise CPU.
    Auto,
    /// The CPU backend.
    Cpu,
    /// The CUDA backend; an error if it cannot be used.
    Cuda,
}

/// The backend a context actually uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Host memory, host threads.
    Cpu,
    /// Device memory, kernels on a CUDA stream.
    Cuda,
}

impl BackendKind {
    /// The memory this backend reads and writes.
    pub fn memory(self) -> MemoryKind {
        match self {
            BackendKind::Cpu => MemoryKind::Host,
            BackendKind::Cuda => MemoryKind::Cuda,
        }
    }
}

/// A CUDA stream handle (`CUstream` / `cudaStream_t`) as an address; `Stream::DEFAULT`
/// (0) means the context's own stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stream(pub usize);

impl Stream {
    /// The context's own stream.
    pub const DEFAULT: Stream = Stream(0);
}

/// How to create a [`Context`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextOptions {
    /// Backend choice.
    pub backend: BackendRequest,
    /// CUDA device ordinal.
    pub device: i32,
    /// The stream the context launches on when a call names none; `Stream::DEFAULT`
    /// makes the context create (and own) a non-blocking stream.
    pub stream: Stream,
    /// CPU worker threads including the caller's; 0 = all available cores.
    pub n_threads: usize,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions {
            backend: BackendRequest::Auto,
            device: 0,
            stream: Stream::DEFAULT,
            n_threads: 0,
        }
    }
}

/// What a context runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Backend in use.
    pub backend: BackendKind,
    /// CUDA ordinal, or -1 for the CPU.
    pub device: i32,
    /// GPU name, or the CPU model.
    pub name: String,
    /// Streaming multiprocessors (CUDA) or worker threads (CPU).
    pub multiprocessor_count: u32,
    /// Compute capability (CUDA), 0.0 for the CPU.
    pub compute_capability: (u32, u32),
    /// Device memory (CUDA) or physical memory (CPU), in bytes.
    pub total_memory: u64,
    /// Free device memory at the time of the query (CUDA) or available memory (CPU).
    pub free_memory: u64,
    /// L2 cache size in bytes (CUDA); 0 if unknown.
    pub l2_cache_bytes: u64,
    /// Driver's CUDA version as 1000 * major + 10 * minor (CUDA), 0 for the CPU.
    pub driver_version: i32,
}

/// The backend of a context, shared with the executors of the pools built on it (chosen
/// once, when a pool is created).
#[derive(Clone)]
pub(crate) enum Backend {
    Cpu(Arc<cpu::CpuBackend>),
    Cuda(Arc<cuda::CudaBackend>),
}

/// An execution context: one backend, its threads or its device, stream and kernels.
///
/// A context is `Send + Sync`: operations may be called from several threads at once.
pub struct Context {
    backend: Backend,
}

impl Context {
    /// Creates a context. With `BackendRequest::Auto`, any reason CUDA cannot be used
    /// (no driver, no device, library built without kernels, a failing driver call)
    /// selects the CPU backend instead.
    pub fn new(options: &ContextOptions) -> Result<Context> {
        if options.device < 0 {
            return Err(Error::InvalidArgument(format!(
                "CUDA device ordinal {} is negative",
                options.device
            )));
        }
        let backend = match options.backend {
            BackendRequest::Cpu => Backend::Cpu(Arc::new(cpu::CpuBackend::new(options.n_threads)?)),
            BackendRequest::Cuda => Backend::Cuda(Arc::new(cuda::CudaBackend::new(
                options.device,
                options.stream,
            )?)),
            BackendRequest::Auto => match cuda::CudaBackend::new(options.device, options.stream) {
                Ok(b) => Backend::Cuda(Arc::new(b)),
                Err(Error::InvalidArgument(m)) => return Err(Error::InvalidArgument(m)),
                Err(_) => Backend::Cpu(Arc::new(cpu::CpuBackend::new(options.n_threads)?)),
            },
        };
        Ok(Context { backend })
    }

    /// The backend in use.
    pub fn backend(&self) -> BackendKind {
        match self.backend {
            Backend::Cpu(_) => BackendKind::Cpu,
            Backend::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// The memory kind this context's operations read and write.
    pub fn memory(&self) -> MemoryKind {
        self.backend().memory()
    }

    /// The backend, for a pool to pick its executor once.
    pub(crate) fn handle(&self) -> Backend {
        self.backend.clone()
    }

    /// The CPU backend, if this is a CPU context.
    pub fn cpu(&self) -> Option<&cpu::CpuBackend> {
        match &self.backend {
            Backend::Cpu(b) => Some(b),
            Backend::Cuda(_) => None,
        }
    }

    /// The CUDA backend, if this is a CUDA context.
    pub fn cuda(&self) -> Option<&cuda::CudaBackend> {
        match &self.backend {
            Backend::Cuda(b) => Some(b),
            Backend::Cpu(_) => None,
        }
    }

    /// Describes the device (or CPU) behind the context.
    pub fn device_info(&self) -> Result<DeviceInfo> {
        match &self.backend {
            Backend::Cpu(b) => Ok(b.device_info()),
            Backend::Cuda(b) => b.device_info(),
        }
    }

    /// Loads the kernels now rather than at the first launch (CUDA); a no-op on CPU.
    /// Call it before capturing a CUDA Graph so that capture sees no module load.
    pub fn load_kernels(&self) -> Result<()> {
        match &self.backend {
            Backend::Cpu(_) => Ok(()),
            Backend::Cuda(b) => b.module().map(|_| ()),
        }
    }

    /// Waits until the work queued on `stream` (the context's own stream for
    /// `Stream::DEFAULT`) is done. CPU operations are synchronous, so this returns at once.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        match &self.backend {
            Backend::Cpu(_) => Ok(()),
            Backend::Cuda(b) => b.synchronize(stream),
        }
    }

    /// Copies `src` into `dst`, converting between f32, f16 and bf16 (round to nearest
    /// even). Both views must have the same shape and live in this context's memory; `dst`
    /// must not have two elements at one address. A same-dtype copy moves bits unchanged.
    /// On CUDA the copy is queued on `stream` and the call returns without waiting.
    pub fn copy(&self, src: &TensorView, dst: &TensorView, stream: Stream) -> Result<()> {
        check_copy(src, dst, self.memory())?;
        match &self.backend {
            Backend::Cpu(b) => {
                b.copy(src, dst);
                Ok(())
            }
            Backend::Cuda(b) => b.copy(src, dst, stream),
        }
    }
}

fn check_copy(src: &TensorView, dst: &TensorView, memory: MemoryKind) -> Result<()> {
    src.expect_memory(memory, "source tensor")?;
    dst.expect_memory(memory, "destination tensor")?;
    if src.shape() != dst.shape() {
        return Err(Error::InvalidArgument(format!(
            "copy shapes differ: source {:?}, destination {:?}",
            src.shape(),
            dst.shape()
        )));
    }
    if src.dtype().is_float() != dst.dtype().is_float() {
        return Err(Error::DTypeMismatch(format!(
            "cannot copy {} into {}: integer tensors copy only to integer tensors",
            src.dtype(),
            dst.dtype()
        )));
    }
    if !dst.is_non_overlapping() {
        return Err(Error::InvalidArgument(format!(
            "destination strides {:?} for shape {:?} make elements overlap",
            dst.strides(),
            dst.shape()
        )));
    }
    Ok(())
}
