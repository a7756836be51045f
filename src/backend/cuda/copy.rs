//! Launch of the strided copy kernels (kernels/copy.cu).

use std::ffi::c_void;

use super::module::Kernel;
use super::CudaBackend;
use crate::abi::{CopyArgs as CopyParams, KVR_COPY_THREADS as BLOCK};
use crate::backend::Stream;
use crate::error::Result;
use crate::tensor::{DType, StridedLoop, TensorView, MAX_DIMS};

pub(super) fn launch_copy(
    backend: &CudaBackend,
    src: &TensorView,
    dst: &TensorView,
    stream: Stream,
) -> Result<()> {
    let lp = StridedLoop::new([src, dst]);
    let n = lp.numel();
    if n == 0 {
        return Ok(());
    }
    let mut p = CopyParams {
        src: src.addr() as u64,
        dst: dst.addr() as u64,
        n: n as i64,
        ndim: lp.shape.len() as i32,
        vectorized: 0,
        shape: [1; MAX_DIMS],
        src_stride: [0; MAX_DIMS],
        dst_stride: [0; MAX_DIMS],
    };
    for d in 0..lp.shape.len() {
        p.shape[d] = lp.shape[d] as i64;
        p.src_stride[d] = lp.strides[0][d] as i64;
        p.dst_stride[d] = lp.strides[1][d] as i64;
    }
    let unit_strides = lp.shape.len() <= 1 && lp.strides.iter().all(|s| s.iter().all(|&x| x == 1));
    if unit_strides && src.addr() % 16 == 0 && dst.addr() % 16 == 0 {
        p.vectorized = 1;
    }
    let work = if p.vectorized == 1 { n.div_ceil(8) } else { n };
    let max_blocks = (backend.sm_count().max(1) * 16) as usize;
    let blocks = work.div_ceil(BLOCK as usize).clamp(1, max_blocks) as u32;
    let mut params = [&mut p as *mut CopyParams as *mut c_void];
    backend.launch(
        // i32 -> i32 is a 4-byte bit copy: the f32 kernel.
        Kernel::Copy {
            src: if src.dtype() == DType::I32 {
                DType::F32
            } else {
                src.dtype()
            },
            dst: if dst.dtype() == DType::I32 {
                DType::F32
            } else {
                dst.dtype()
            },
        },
        (blocks, 1, 1),
        (BLOCK, 1, 1),
        0,
        stream,
        &mut params,
    )
}
