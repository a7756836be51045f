//! The CUDA side of the write-gated mode: row copies (kernels/wgkv.cu) into the pool's
//! pages; the tables, copy-on-write copies and decode are the paged pool's own.

use std::ffi::c_void;
use std::sync::Arc;

use super::{Pair, RowSource};
use crate::abi::{dtype_code, WgKvScatterArgs, KVR_WGKV_MAX_PAIRS, KVR_WGKV_SCATTER_THREADS};
use crate::backend::cuda::module::Kernel;
use crate::backend::cuda::CudaBackend;
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::kv::config::LayerLayout;
use crate::tensor::{DType, MemoryKind, TensorView};

/// Launches row copies into the one layer of a one-head pool.
pub(super) struct WgCuda {
    cuda: Arc<CudaBackend>,
    dtype: DType,
    head_dim: usize,
    layout: LayerLayout,
}

impl WgCuda {
    pub(super) fn new(
        cuda: Arc<CudaBackend>,
        dtype: DType,
        head_dim: usize,
        layout: LayerLayout,
    ) -> Self {
        WgCuda {
            cuda,
            dtype,
            head_dim,
            layout,
        }
    }

    /// A device copy of a host tensor (stream-ordered memory, freed with [`Self::free`]
    /// after the launches that read it are queued); device tensors are returned as they are.
    pub(super) fn stage(
        &self,
        t: &TensorView,
        stream: Stream,
    ) -> Result<(TensorView, Option<usize>)> {
        if t.memory() == MemoryKind::Cuda {
            return Ok((*t, None));
        }
        let bytes = t.span_bytes();
        let dst = self.cuda.alloc_async(bytes, stream)?;
        // SAFETY: the view spans `bytes` readable bytes.
        let src = unsafe { std::slice::from_raw_parts(t.addr() as *const u8, bytes) };
        if let Err(e) = self.cuda.copy_to_device_async(dst, src, stream) {
            let _ = self.cuda.free_async(dst, stream);
            return Err(e);
        }
        let v = TensorView::new(dst, t.dtype(), MemoryKind::Cuda, t.shape(), t.strides());
        match v {
            Ok(v) => Ok((v, Some(dst))),
            Err(e) => {
                let _ = self.cuda.free_async(dst, stream);
                Err(e)
            }
        }
    }

    /// Frees staged copies (stream-ordered).
    pub(super) fn free(&self, staged: &[usize], stream: Stream) -> Result<()> {
        for &p in staged {
            self.cuda.free_async(p, stream)?;
        }
        Ok(())
    }

    /// Copies rows of `src` (device memory) to pool positions: up to
    /// `KVR_WGKV_MAX_PAIRS` rows in the launch parameters, more from a device array uploaded
    /// on the stream (one launch either way).
    pub(super) fn scatter(&self, src: &RowSource, pairs: &[Pair], stream: Stream) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let mut p = Box::new(WgKvScatterArgs {
            rows: 0,
            k_src: src.k as u64,
            v_src: src.v as u64,
            k_dst: self.layout.k as u64,
            v_dst: self.layout.v as u64,
            k_src_ds: src.k_ds as i64,
            v_src_ds: src.v_ds as i64,
            k_sp: self.layout.k_strides[0] as i64,
            k_st: self.layout.k_strides[2] as i64,
            v_sp: self.layout.v_strides[0] as i64,
            v_st: self.layout.v_strides[2] as i64,
            d: self.head_dim as i32,
            n_pairs: i32::try_from(pairs.len())
                .map_err(|_| Error::OutOfRange(format!("{} rows in one copy", pairs.len())))?,
            src_dtype: dtype_code(src.dtype),
            dst_dtype: dtype_code(self.dtype),
            k_off: [0; KVR_WGKV_MAX_PAIRS],
            v_off: [0; KVR_WGKV_MAX_PAIRS],
            page: [0; KVR_WGKV_MAX_PAIRS],
            slot: [0; KVR_WGKV_MAX_PAIRS],
        });
        let mut staged = None;
        if pairs.len() <= KVR_WGKV_MAX_PAIRS {
            for (i, &(ko, vo, page, slot)) in pairs.iter().enumerate() {
                p.k_off[i] = ko;
                p.v_off[i] = vo;
                p.page[i] = page as i32;
                p.slot[i] = slot as i32;
            }
        } else {
            let table: Vec<u8> = pairs
                .iter()
                .flat_map(|&(ko, vo, page, slot)| {
                    [ko, vo, ((page as i64) << 32) | slot as i64]
                        .into_iter()
                        .flat_map(|x| x.to_ne_bytes())
                })
                .collect();
            let dst = self.cuda.alloc_async(table.len(), stream)?;
            staged = Some(dst);
            if let Err(e) = self.cuda.copy_to_device_async(dst, &table, stream) {
                let _ = self.cuda.free_async(dst, stream);
                return Err(e);
            }
            p.rows = dst as u64;
        }
        let warps = (KVR_WGKV_SCATTER_THREADS / 32) as usize;
        let grid = (2 * pairs.len())
            .div_ceil(warps)
            .clamp(1, self.cuda.sm_count() as usize * 16) as u32;
        let mut args = [&mut *p as *mut WgKvScatterArgs as *mut c_void];
        let r = self.cuda.launch(
            Kernel::WgKvScatter,
            (grid, 1, 1),
            (KVR_WGKV_SCATTER_THREADS, 1, 1),
            0,
            stream,
            &mut args,
        );
        if let Some(dst) = staged {
            self.cuda.free_async(dst, stream)?;
        }
        r
    }
}
