//! The CPU backend: the reference for every operation and a usable backend on its own,
//! threaded through a [`ThreadPool`].

mod copy;
pub mod element;
pub mod threadpool;

pub use threadpool::ThreadPool;

use super::{BackendKind, DeviceInfo};
use crate::error::{Error, Result};
use crate::tensor::TensorView;

/// CPU execution: a thread pool sized at creation.
pub struct CpuBackend {
    pool: ThreadPool,
}

impl CpuBackend {
    /// Creates the backend with `n_threads` threads (0 = all available cores).
    pub fn new(n_threads: usize) -> Result<Self> {
        let threads = if n_threads == 0 {
            threadpool::available_threads()
        } else {
            n_threads
        };
        if threads > 4096 {
            return Err(Error::InvalidArgument(format!(
                "n_threads {threads} is unreasonable (at most 4096)"
            )));
        }
        let pool = ThreadPool::new(threads)
            .map_err(|e| Error::OutOfMemory(format!("cannot start {threads} CPU threads: {e}")))?;
        Ok(CpuBackend { pool })
    }

    /// The thread pool.
    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Describes the host.
    pub fn device_info(&self) -> DeviceInfo {
        let (total, free) = host_memory();
        DeviceInfo {
            backend: BackendKind::Cpu,
            device: -1,
            name: cpu_model().unwrap_or_else(|| "CPU".to_string()),
            multiprocessor_count: self.pool.threads() as u32,
            compute_capability: (0, 0),
            total_memory: total,
            free_memory: free,
            l2_cache_bytes: 0,
            driver_version: 0,
        }
    }

    /// Strided copy with conversion (arguments already checked by `Context::copy`).
    pub fn copy(&self, src: &TensorView, dst: &TensorView) {
        copy::copy(&self.pool, src, dst)
    }
}

fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
}

fn host_memory() -> (u64, u64) {
    // SAFETY: sysconf has no preconditions.
    let (pages, avail, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_AVPHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        return (0, 0);
    }
    (
        pages as u64 * size as u64,
        avail.max(0) as u64 * size as u64,
    )
}
