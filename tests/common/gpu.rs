//! GPU test support: skip logic, a core CUDA context for allocations, raw streams.
#![allow(dead_code)]

use cudarc::driver::sys;
use kvreplay::backend::cuda::memory::DeviceBuffer;
use kvreplay::backend::cuda::CudaBackend;
use kvreplay::ffi::*;
use kvreplay::{BackendRequest, Context, ContextOptions};

/// Returns a CUDA core context, or None after printing why GPU tests are skipped. With
/// `KVR_REQUIRE_GPU=1` (set by gpu-bundle's run-all.sh) a missing GPU fails instead.
pub fn gpu_or_skip(test: &str) -> Option<Context> {
    let why = if !kvr_library_kernels_compiled() {
        Some("the library was built without CUDA kernels".to_string())
    } else {
        let mut n = 0;
        match kvr_cuda_get_device_count(&mut n) {
            KVR_STATUS_OK if n > 0 => None,
            KVR_STATUS_OK => Some("no CUDA device".to_string()),
            _ => Some(super::last_error()),
        }
    };
    if let Some(why) = why {
        if std::env::var("KVR_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{test}: KVR_REQUIRE_GPU=1 but no usable GPU: {why}");
        }
        println!("SKIP {test}: no GPU here ({why})");
        return None;
    }
    let opts = ContextOptions {
        backend: BackendRequest::Cuda,
        ..Default::default()
    };
    Some(Context::new(&opts).expect("CUDA context"))
}

pub fn cuda(ctx: &Context) -> &CudaBackend {
    ctx.cuda().expect("a CUDA context")
}

pub fn alloc(ctx: &Context, bytes: usize) -> DeviceBuffer {
    DeviceBuffer::new(cuda(ctx), bytes).expect("cuMemAlloc")
}

/// A stream created in the device's primary context, as an engine would create one.
pub struct RawStream {
    pub stream: sys::CUstream,
    ctx: sys::CUcontext,
}

impl RawStream {
    pub fn new(ctx: &Context) -> RawStream {
        let c = cuda(ctx).raw_context();
        unsafe {
            assert_eq!(sys::cuCtxPushCurrent_v2(c), sys::CUresult::CUDA_SUCCESS);
            let mut s = std::ptr::null_mut();
            assert_eq!(
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                sys::CUresult::CUDA_SUCCESS
            );
            let mut prev = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut prev);
            RawStream { stream: s, ctx: c }
        }
    }
    pub fn ptr(&self) -> *mut std::ffi::c_void {
        self.stream as *mut std::ffi::c_void
    }
    pub fn sync(&self) {
        unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx);
            assert_eq!(
                sys::cuStreamSynchronize(self.stream),
                sys::CUresult::CUDA_SUCCESS
            );
            let mut prev = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut prev);
        }
    }
    /// Captures what `f` queues on this stream into a graph and instantiates it.
    pub fn capture(&self, f: impl FnOnce()) -> Graph {
        unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx);
            assert_eq!(
                sys::cuStreamBeginCapture_v2(
                    self.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                ),
                sys::CUresult::CUDA_SUCCESS
            );
            f();
            let mut g = std::ptr::null_mut();
            assert_eq!(
                sys::cuStreamEndCapture(self.stream, &mut g),
                sys::CUresult::CUDA_SUCCESS
            );
            let mut exec = std::ptr::null_mut();
            assert_eq!(
                sys::cuGraphInstantiateWithFlags(&mut exec, g, 0),
                sys::CUresult::CUDA_SUCCESS
            );
            let mut prev = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut prev);
            Graph {
                graph: g,
                exec,
                ctx: self.ctx,
            }
        }
    }
}

impl Drop for RawStream {
    fn drop(&mut self) {
        unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx);
            sys::cuStreamDestroy_v2(self.stream);
            let mut prev = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut prev);
        }
    }
}

/// An instantiated CUDA Graph.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: sys::CUcontext,
}

impl Graph {
    pub fn launch(&self, stream: &RawStream) {
        unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx);
            assert_eq!(
                sys::cuGraphLaunch(self.exec, stream.stream),
                sys::CUresult::CUDA_SUCCESS
            );
            let mut prev = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut prev);
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        unsafe {
            sys::cuCtxPushCurrent_v2(self.ctx);
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
            let mut prev = std::ptr::null_mut();
            sys::cuCtxPopCurrent_v2(&mut prev);
        }
    }
}

/// A long GPU test's loop count `n`, cut to a quarter (at least `min`) when the test runs
/// under compute-sanitizer (`run-all.sh --sanitize` sets `KVR_UNDER_SANITIZER=1`): racecheck
/// runs the kernels two orders of magnitude slower, and every configuration still runs.
pub fn sanitizer_scaled(n: usize, min: usize) -> usize {
    if std::env::var("KVR_UNDER_SANITIZER").is_ok_and(|v| v == "1") {
        (n / 4).max(min).min(n)
    } else {
        n
    }
}
