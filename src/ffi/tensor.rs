//! `kvr_tensor`: the tensor descriptor every operation takes, and `kvr_tensor_copy`.

use std::ffi::c_void;

use super::context::{context_from, kvr_context};
use super::guard::{guard, non_null};
use super::status::kvr_status;
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::tensor::{DType, MemoryKind, TensorView, MAX_DIMS};

/// Element type of a tensor.
pub type kvr_dtype = i32;
/// 32-bit IEEE float.
pub const KVR_DTYPE_F32: kvr_dtype = 0 as kvr_dtype;
/// 16-bit IEEE float.
pub const KVR_DTYPE_F16: kvr_dtype = 1 as kvr_dtype;
/// bfloat16.
pub const KVR_DTYPE_BF16: kvr_dtype = 2 as kvr_dtype;
/// 32-bit signed integer (sequence ids, counts).
pub const KVR_DTYPE_I32: kvr_dtype = 3 as kvr_dtype;

/// Where a tensor's memory lives.
pub type kvr_device_type = i32;
/// Host memory (CPU backend).
pub const KVR_DEVICE_HOST: kvr_device_type = 0 as kvr_device_type;
/// CUDA device memory of the context's device (CUDA backend).
pub const KVR_DEVICE_CUDA: kvr_device_type = 1 as kvr_device_type;

/// Most dimensions a `kvr_tensor` can have.
pub const KVR_MAX_DIMS: usize = 8;

const _: () = assert!(KVR_MAX_DIMS == MAX_DIMS);

/// Describes memory the caller owns: kvreplay reads or writes it during a call (or, on
/// CUDA, in the work the call queues) and never keeps the pointer afterwards unless a
/// function says so.
///
/// Element (i0, ..., i{ndim-1}) is at `data + sum(ik * strides[k]) * sizeof(dtype)`.
/// Strides count elements, not bytes, and must be >= 0. Entries past `ndim` are ignored.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_tensor {
    /// Address of element 0; may be NULL only when the tensor has no elements. Must be
    /// aligned to the element size.
    pub data: *mut c_void,
    /// `KVR_DTYPE_*`.
    pub dtype: kvr_dtype,
    /// `KVR_DEVICE_*`: must match the context's backend (host for CPU, CUDA for CUDA).
    pub device: kvr_device_type,
    /// Number of dimensions, 0 (a scalar) to `KVR_MAX_DIMS`.
    pub ndim: i32,
    /// Extent of each dimension (>= 0).
    pub shape: [i64; KVR_MAX_DIMS],
    /// Stride of each dimension, in elements (>= 0).
    pub strides: [i64; KVR_MAX_DIMS],
}

/// The core dtype for a C value.
pub(crate) fn dtype_from_c(d: kvr_dtype) -> Result<DType> {
    match d {
        KVR_DTYPE_F32 => Ok(DType::F32),
        KVR_DTYPE_F16 => Ok(DType::F16),
        KVR_DTYPE_BF16 => Ok(DType::BF16),
        KVR_DTYPE_I32 => Ok(DType::I32),
        other => Err(Error::InvalidArgument(format!(
            "unknown dtype {other} (expected KVR_DTYPE_F32, _F16, _BF16 or _I32)"
        ))),
    }
}

fn memory_from_c(d: kvr_device_type) -> Result<MemoryKind> {
    match d {
        KVR_DEVICE_HOST => Ok(MemoryKind::Host),
        KVR_DEVICE_CUDA => Ok(MemoryKind::Cuda),
        other => Err(Error::InvalidArgument(format!(
            "unknown device type {other} (expected KVR_DEVICE_HOST or KVR_DEVICE_CUDA)"
        ))),
    }
}

fn ndim_from_c(ndim: i32) -> Result<usize> {
    if ndim < 0 || ndim as usize > KVR_MAX_DIMS {
        return Err(Error::InvalidArgument(format!(
            "ndim {ndim} is outside 0..={KVR_MAX_DIMS}"
        )));
    }
    Ok(ndim as usize)
}

/// Checks a C tensor descriptor and turns it into a view; `what` names it in messages.
///
/// # Safety
/// `t` must be NULL or point at a readable `kvr_tensor`.
pub(crate) unsafe fn view_from_c(t: *const kvr_tensor, what: &str) -> Result<TensorView> {
    non_null(t, what)?;
    let t = t.read();
    let dtype = dtype_from_c(t.dtype).map_err(|e| prefix(e, what))?;
    let memory = memory_from_c(t.device).map_err(|e| prefix(e, what))?;
    let ndim = ndim_from_c(t.ndim).map_err(|e| prefix(e, what))?;
    let mut shape = [0usize; MAX_DIMS];
    let mut strides = [0isize; MAX_DIMS];
    for d in 0..ndim {
        if t.shape[d] < 0 {
            return Err(Error::InvalidArgument(format!(
                "{what}: shape[{d}] = {} is negative",
                t.shape[d]
            )));
        }
        shape[d] = usize::try_from(t.shape[d])
            .map_err(|_| Error::InvalidArgument(format!("{what}: shape[{d}] is too large")))?;
        strides[d] = isize::try_from(t.strides[d])
            .map_err(|_| Error::InvalidArgument(format!("{what}: strides[{d}] is too large")))?;
    }
    TensorView::new(
        t.data as usize,
        dtype,
        memory,
        &shape[..ndim],
        &strides[..ndim],
    )
    .map_err(|e| prefix(e, what))
}

fn prefix(e: Error, what: &str) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{what}: {m}")),
        Error::NullArgument(m) => Error::NullArgument(format!("{what}: {m}")),
        other => other,
    }
}

/// Fills `*tensor` with a row-major contiguous description of `ndim` dimensions of `shape`
/// at `data`. Nothing is allocated and the memory is not touched.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`tensor` is NULL, or `shape` is NULL
/// with `ndim > 0`, or `data` is NULL for a non-empty shape); `KVR_STATUS_INVALID_ARG` (an
/// unknown dtype or device, `ndim` outside 0..=KVR_MAX_DIMS, a negative extent, a
/// misaligned `data`).
/// Ownership: `data` stays the caller's; the descriptor only points at it.
/// Thread safety: thread-safe.
/// On failure: `*tensor` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_tensor_init(
    tensor: *mut kvr_tensor,
    data: *mut c_void,
    dtype: kvr_dtype,
    device: kvr_device_type,
    ndim: i32,
    shape: *const i64,
) -> kvr_status {
    guard("kvr_tensor_init", || {
        non_null(tensor, "tensor")?;
        let n = ndim_from_c(ndim)?;
        if n > 0 {
            non_null(shape, "shape")?;
        }
        let mut t = kvr_tensor {
            data,
            dtype,
            device,
            ndim,
            shape: [0; KVR_MAX_DIMS],
            strides: [0; KVR_MAX_DIMS],
        };
        for d in 0..n {
            // SAFETY: the caller passes `ndim` readable extents.
            t.shape[d] = unsafe { shape.add(d).read() };
        }
        let mut stride = 1i64;
        for d in (0..n).rev() {
            t.strides[d] = stride;
            stride = stride.saturating_mul(t.shape[d].max(0));
        }
        // SAFETY: `t` is a local.
        unsafe { view_from_c(&t, "tensor")? };
        // SAFETY: checked non-NULL above.
        unsafe { tensor.write(t) };
        Ok(())
    })
}

/// Copies `src` into `dst`, converting between f32, f16 and bf16 (round to nearest even; a
/// same-dtype copy moves the bits unchanged; i32 copies only to i32). Shapes must be equal;
/// strides are free (any non-contiguous layout) except that `dst` must not hold two
/// elements at one address. Both tensors must be in the context's memory (`KVR_DEVICE_HOST`
/// for a CPU context, `KVR_DEVICE_CUDA` for a CUDA one). If `src` and `dst` share elements
/// the result is unspecified (but memory-safe), except that copying a tensor onto itself is
/// a no-op.
///
/// CUDA: the kernel is queued on `stream` (a `CUstream`/`cudaStream_t` of the context's
/// device; NULL = the context's stream) and the call returns without waiting; it never
/// synchronizes or allocates, so it can be captured in a CUDA Graph (after
/// `kvr_context_load_kernels`). CPU: runs on the context's threads and returns when done.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `ctx`, `src`, `dst`, or data of a
/// non-empty tensor); `KVR_STATUS_INVALID_ARG` (not a live context, malformed tensor, shape
/// mismatch, wrong memory kind, overlapping `dst`); `KVR_STATUS_DTYPE_MISMATCH` (i32 with a
/// float type); `KVR_STATUS_NOT_COMPILED` / `KVR_STATUS_CUDA_ERROR` (kernels missing, or
/// the launch failed).
/// Ownership: both buffers and `stream` stay the caller's; nothing is kept after the call
/// (CUDA: after the queued copy).
/// Thread safety: thread-safe; calls on one context may run concurrently.
/// On failure: `dst` is not written, except after `KVR_STATUS_CUDA_ERROR` (contents
/// unspecified).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_tensor_copy(
    ctx: *const kvr_context,
    src: *const kvr_tensor,
    dst: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_tensor_copy", || {
        let ctx = context_from(ctx)?;
        // SAFETY: NULL is checked; otherwise the caller passes readable descriptors.
        let (src, dst) = unsafe { (view_from_c(src, "src")?, view_from_c(dst, "dst")?) };
        ctx.copy(&src, &dst, Stream(stream as usize))
    })
}
