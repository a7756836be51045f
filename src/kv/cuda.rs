//! The pool's device state and launches (kernels/kv_pool.cu, kernels/kv_decode.cu).

use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;

use super::config::{KvPoolConfig, LayerLayout, MAX_WRITE_GROUPS};
use super::decode::DecodePlan;
use super::exec::{KvExecutor, Placed};
use super::state::PoolState;
use crate::abi::{
    dtype_code, kv_decode_smem_bytes as decode_smem, kv_decode_stage_bytes as decode_stage_bytes,
    kv_split_decode_groups, kv_split_decode_smem_bytes, FastDiv, KvDecodeArgs as DecodeParams,
    KvLayerDesc as LayerDesc, KvPageCopyArgs as PageCopyParams, KvWriteArgs as WriteParams,
    KvWriteGroup as WriteGroup, KVR_KV_DECODE_THREADS as DECODE_THREADS,
    KVR_KV_DECODE_TILE as TILE, KVR_KV_MAX_INLINE_BATCH as MAX_INLINE_BATCH,
    KVR_KV_MAX_PAGE_COPIES as MAX_PAGE_COPIES, KVR_KV_Q_SCALAR, KVR_KV_Q_VEC_F32, KVR_KV_Q_VEC_KV,
    KVR_KV_SDECODE_STAGES as SPLIT_STAGES, KVR_KV_SDECODE_THREADS as SPLIT_THREADS,
};
use crate::backend::cuda::memory::DeviceBuffer;
use crate::backend::cuda::module::{Kernel, SplitKind};
use crate::backend::cuda::patch::patch_i32;
use crate::backend::cuda::CudaBackend;
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::pool::BatchIds;
use crate::tensor::{DType, MemoryKind, TensorView};

/// Deepest decode pipeline (ring of tiles between the producer and consumer warps).
const MAX_STAGES: usize = 8;
/// Smallest share of a CTA, in 64-token tiles: short batches use fewer, longer ranges.
const MIN_TILES_PER_CTA: i32 = 2;
/// Most 16-row query tiles per decode: 16 heads x 8 tokens / 16.
const MAX_Y_TILES: usize = 8;
/// Most parts a row is split into by the short-batch split kernel (its last CTA folds them).
const MAX_SPLIT_PARTS: usize = 64;
/// The split kernel's smallest share of a row, in tiles (the kernel derives the row's parts
/// from its length: short rows use fewer parts).
const SPLIT_MIN_TILES: i32 = 2;
/// CTAs per cluster of the cluster kernel (a row's parts, merged in distributed shared
/// memory); it takes batches of at most as many rows as clusters can be resident at once
/// whose 64-token tiles, all rows together, number at most CLUSTER_MAX_TILES (longer
/// contexts stream faster through the split kernel, which needs no co-scheduled cluster).
const CLUSTER: usize = 16;
const CLUSTER_MAX_TILES: usize = 256;
/// Mean tiles per row from which a batch larger than a wave takes one split-kernel CTA per
/// row (`even_rows`; measured better than stream-K from 4K-token rows at B = 32-128).
const WAVE_ROW_MIN_TILES: usize = 64;
/// The same for the batch kernel (two CTAs per SM; measured better than stream-K and the
/// split kernel from 1K-token rows at B = 32 and 128, BENCHMARKS.md, fifteenth session).
const BATCH_ROW_MIN_TILES: usize = 16;

/// Which decode kernel a call takes (`KVR_KV_DECODE`: auto, stream, split, cluster or batch).
#[derive(Clone, Copy, Debug, PartialEq)]
enum DecodePath {
    Auto,
    /// The stream-K kernel (`kvr_kv_decode_*`): any batch, load-balanced.
    Stream,
    /// `kvr_kv_sdecode_*`: a fixed number of CTAs per (row, query tile), partials folded by
    /// the row's last CTA.
    Split,
    /// `kvr_kv_cdecode_*`: one cluster of CLUSTER CTAs per (row, query tile).
    Cluster,
    /// `kvr_kv_bdecode_*`: the split kernel with one group of warps per CTA (two CTAs per SM),
    /// for batches of more (row, query tile) pairs than the split kernel's wave.
    Batch,
}

impl FastDiv {
    pub(crate) fn new(d: u32) -> FastDiv {
        assert!(d >= 1);
        let shift = 32 - (d - 1).leading_zeros(); // ceil(log2 d)
        let mul = (((1u64 << 32) * ((1u64 << shift) - d as u64)) / d as u64 + 1) as u32;
        FastDiv { d, mul, shift }
    }
    #[cfg(test)]
    fn div(&self, n: u32) -> u32 {
        let hi = ((n as u64 * self.mul as u64) >> 32) as u32;
        (hi + n) >> self.shift
    }
}

/// How the decode kernel may load q rows with 16-byte vectors: `KVR_KV_Q_VEC_KV` when q has
/// the KV dtype, `KVR_KV_Q_VEC_F32` when it is f32, with the address and every stride a
/// multiple of 16 bytes; else `KVR_KV_Q_SCALAR` (element loads).
fn q_vector_mode(q: &TensorView, kv: DType) -> i32 {
    let elem = q.dtype().size();
    let aligned = q.addr() % 16 == 0
        && q.strides()[..3]
            .iter()
            .all(|&s| (s * elem as isize) % 16 == 0);
    match q.dtype() {
        _ if !aligned => KVR_KV_Q_SCALAR,
        d if d == kv => KVR_KV_Q_VEC_KV,
        DType::F32 => KVR_KV_Q_VEC_F32,
        _ => KVR_KV_Q_SCALAR,
    }
}

/// How decode launches on this device for the pool's (dtype, head dim).
#[derive(Clone, Copy, Debug)]
struct DecodeLaunch {
    kernel: Kernel,
    /// Threads per CTA.
    threads: u32,
    stages: u32,
    shared_bytes: u32,
    /// CTAs in one full wave (SMs x CTAs per SM).
    wave: u32,
}

/// Device memory and launch settings of one pool.
pub(super) struct DeviceState {
    cuda: Arc<CudaBackend>,
    cfg: KvPoolConfig,
    /// Block table `[max_seqs][pages_per_seq]` followed by lengths `[max_seqs]`.
    tables: DeviceBuffer,
    layers: DeviceBuffer,
    /// Sequence ids of batches too large to pass inline.
    batch: DeviceBuffer,
    part_o: DeviceBuffer,
    part_lse: DeviceBuffer,
    counters: DeviceBuffer,
    /// Byte offset of the group counters in `counters`.
    group_counters_at: usize,
    decode: Option<DecodeLaunch>,
    /// The split kernels (same dtype and head dim as `decode`): the split kernel, the
    /// cluster kernel where clusters of CLUSTER CTAs can run, and the batch kernel.
    split: Option<DecodeLaunch>,
    cluster: Option<DecodeLaunch>,
    batch_kernel: Option<DecodeLaunch>,
    path: DecodePath,
    sm_count: u32,
}

impl DeviceState {
    pub(super) fn new(
        cuda_arc: Arc<CudaBackend>,
        cfg: &KvPoolConfig,
        layout: &[LayerLayout],
    ) -> Result<Self> {
        let cuda = &*cuda_arc;
        let table_ints = cfg.max_seqs * cfg.pages_per_seq() + cfg.max_seqs;
        let tables = DeviceBuffer::new(cuda, table_ints * 4)?;
        tables.upload(&vec![0i32; table_ints])?;
        let descs: Vec<LayerDesc> = layout
            .iter()
            .map(|l| LayerDesc {
                k: l.k as u64,
                v: l.v as u64,
                k_sp: l.k_strides[0] as i64,
                k_sh: l.k_strides[1] as i64,
                k_st: l.k_strides[2] as i64,
                v_sp: l.v_strides[0] as i64,
                v_sh: l.v_strides[1] as i64,
                v_st: l.v_strides[2] as i64,
            })
            .collect();
        let layers = DeviceBuffer::new(cuda, descs.len() * size_of::<LayerDesc>())?;
        layers.upload(&descs)?;
        let batch = DeviceBuffer::new(cuda, cfg.max_seqs * 4)?;
        let decode = Self::decode_launch(cuda, cfg)?;
        let [split, cluster, batch_kernel] = match decode {
            Some(_) => SplitKind::ALL.map(|kind| Self::split_launch(cuda, cfg, kind)),
            None => [Ok(None), Ok(None), Ok(None)],
        };
        let (split, cluster, batch_kernel) = (split?, cluster?, batch_kernel?);
        let path = match std::env::var("KVR_KV_DECODE").as_deref() {
            Ok("stream") => DecodePath::Stream,
            Ok("split") => DecodePath::Split,
            Ok("cluster") => DecodePath::Cluster,
            Ok("batch") => DecodePath::Batch,
            _ => DecodePath::Auto,
        };
        // Partial slots: two per CTA of a stream-K wave; the split kernels use at most one
        // per CTA of their wave (no more than the stream-K kernel's: same shared memory class).
        let wave = [split, batch_kernel]
            .iter()
            .flatten()
            .map(|l| (l.wave as usize).div_ceil(2))
            .fold(decode.map_or(1, |d| d.wave as usize), usize::max);
        let part_o = DeviceBuffer::new(cuda, wave * 2 * 16 * cfg.head_dim * 4)?;
        let part_lse = DeviceBuffer::new(cuda, wave * 2 * 16 * 4)?;
        // Row counters [max_seqs][kv_heads][Y], then group counters [wave][2] (one per
        // partial slot) for the two-level merge of rows split into many parts.
        let n_row_counters = cfg.max_seqs * cfg.kv_heads * MAX_Y_TILES;
        let n_counters = n_row_counters + wave * 2;
        let counters = DeviceBuffer::new(cuda, n_counters * 4)?;
        counters.upload(&vec![0i32; n_counters])?;
        Ok(DeviceState {
            cuda: cuda_arc.clone(),
            cfg: *cfg,
            tables,
            layers,
            batch,
            part_o,
            part_lse,
            counters,
            group_counters_at: n_row_counters * 4,
            decode,
            split,
            cluster,
            batch_kernel,
            path,
            sm_count: cuda.sm_count(),
        })
    }

    /// A split kernel's launch (shared memory, CTAs per wave; for the cluster kernel, CTAs
    /// resident in clusters of CLUSTER at once), None where the device cannot run it.
    fn split_launch(
        cuda: &CudaBackend,
        cfg: &KvPoolConfig,
        kind: SplitKind,
    ) -> Result<Option<DecodeLaunch>> {
        let groups = match kind {
            SplitKind::Batch => 1,
            _ => kv_split_decode_groups(cfg.head_dim),
        };
        let threads = SPLIT_THREADS * groups as u32;
        let bytes =
            kv_split_decode_smem_bytes(cfg.head_dim, cfg.dtype.size(), SPLIT_STAGES, groups) as u32;
        if bytes > cuda.max_shared_per_block() {
            return Ok(None);
        }
        let kernel = Kernel::KvSplitDecode {
            kv: cfg.dtype,
            head_dim: cfg.head_dim,
            kind,
        };
        let per_sm = cuda.prepare_kernel(kernel, bytes, threads)?;
        if per_sm == 0 {
            return Ok(None);
        }
        let wave = if kind == SplitKind::Cluster {
            cuda.prepare_cluster(kernel, CLUSTER as u32, bytes, threads)? * CLUSTER as u32
        } else {
            per_sm * cuda.sm_count()
        };
        Ok((wave > 0).then_some(DecodeLaunch {
            kernel,
            threads,
            stages: SPLIT_STAGES as u32,
            shared_bytes: bytes,
            wave,
        }))
    }

    /// Picks the deepest pipeline that fits the device's shared memory and measures the
    /// occupancy; None when the dtype or head dim has no decode kernel.
    fn decode_launch(cuda: &CudaBackend, cfg: &KvPoolConfig) -> Result<Option<DecodeLaunch>> {
        if !matches!(cfg.dtype, DType::F16 | DType::BF16)
            || !crate::backend::cuda::module::DECODE_HEAD_DIMS.contains(&cfg.head_dim)
        {
            return Ok(None);
        }
        let kernel = Kernel::KvDecode {
            kv: cfg.dtype,
            head_dim: cfg.head_dim,
        };
        // Most CTAs per SM first (more consumer warps hide the math latency; measured on
        // H100), then the deepest ring that still allows it. KVR_DECODE_STAGES forces the
        // ring depth (for benchmarking).
        let stage = decode_stage_bytes(cfg.head_dim, cfg.dtype.size());
        let forced: Option<usize> = std::env::var("KVR_DECODE_STAGES")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| (1..=MAX_STAGES).contains(&n));
        let mut best: Option<(u32, usize, u32)> = None; // (per SM, in flight, stages)
        for stages in (1..=MAX_STAGES).rev() {
            if forced.is_some_and(|f| f != stages) {
                continue;
            }
            let bytes = decode_smem(cfg.head_dim, cfg.dtype.size(), stages);
            if bytes > cuda.max_shared_per_block() as usize {
                continue;
            }
            let per_sm = cuda.prepare_kernel(kernel, bytes as u32, DECODE_THREADS)?;
            if per_sm == 0 {
                continue;
            }
            let in_flight = per_sm as usize * stages * stage;
            if best.is_none_or(|(n, f, _)| (per_sm, in_flight) > (n, f)) {
                best = Some((per_sm, in_flight, stages as u32));
            }
        }
        if let Some((per_sm, _, stages)) = best {
            let bytes = decode_smem(cfg.head_dim, cfg.dtype.size(), stages as usize);
            cuda.prepare_kernel(kernel, bytes as u32, DECODE_THREADS)?;
            return Ok(Some(DecodeLaunch {
                kernel,
                threads: DECODE_THREADS,
                stages,
                shared_bytes: bytes as u32,
                wave: per_sm * cuda.sm_count(),
            }));
        }
        Err(Error::Unsupported(format!(
            "this GPU's shared memory ({} bytes per block) is too small for the decode kernel \
             at head dim {}",
            cuda.max_shared_per_block(),
            cfg.head_dim
        )))
    }

    fn grid_for(&self, rows: usize, rows_per_block: usize) -> u32 {
        rows.div_ceil(rows_per_block)
            .clamp(1, self.sm_count as usize * 16) as u32
    }

    /// Applies (index, value) patches to the block table / lengths.
    pub(super) fn apply_patches(
        &self,
        cuda: &CudaBackend,
        patches: &[(u32, i32)],
        stream: Stream,
    ) -> Result<()> {
        patch_i32(cuda, self.tables.addr(), patches, stream)
    }

    /// Copies whole pages (copy-on-write), all layers.
    pub(super) fn copy_pages(
        &self,
        cuda: &CudaBackend,
        cfg: &KvPoolConfig,
        pairs: &[(u32, u32)],
        stream: Stream,
    ) -> Result<()> {
        for chunk in pairs.chunks(MAX_PAGE_COPIES) {
            let mut p = Box::new(PageCopyParams {
                layers: self.layers.addr() as u64,
                n_layers: cfg.layers as i32,
                hkv: cfg.kv_heads as i32,
                d: cfg.head_dim as i32,
                page_size: cfg.page_size as i32,
                elem_bytes: cfg.dtype.size() as i32,
                n_pairs: chunk.len() as i32,
                src: [0; MAX_PAGE_COPIES],
                dst: [0; MAX_PAGE_COPIES],
            });
            for (i, &(s, d)) in chunk.iter().enumerate() {
                p.src[i] = s as i32;
                p.dst[i] = d as i32;
            }
            let rows = chunk.len() * cfg.layers * 2 * cfg.kv_heads * cfg.page_size;
            let mut args = [&mut *p as *mut PageCopyParams as *mut c_void];
            cuda.launch(
                Kernel::KvCopyPages,
                (self.grid_for(rows, 4), 1, 1),
                (128, 1, 1),
                0,
                stream,
                &mut args,
            )?;
        }
        Ok(())
    }

    /// Scatters tokens into their pages; host sources are staged through stream-ordered
    /// device memory.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_tokens(
        &self,
        cuda: &CudaBackend,
        cfg: &KvPoolConfig,
        layers: Range<usize>,
        placed: &[(usize, usize, usize, usize)],
        k: &TensorView,
        v: &TensorView,
        stream: Stream,
    ) -> Result<()> {
        if k.dtype() != v.dtype() {
            return Err(Error::DTypeMismatch(format!(
                "k ({}) and v ({}) must have the same dtype",
                k.dtype(),
                v.dtype()
            )));
        }
        let mut staged = Vec::new();
        let mut device_view = |t: &TensorView| -> Result<u64> {
            match t.memory() {
                MemoryKind::Cuda => Ok(t.addr() as u64),
                MemoryKind::Host => {
                    let bytes = t.span_bytes();
                    let dst = cuda.alloc_async(bytes, stream)?;
                    staged.push(dst);
                    // SAFETY: the view spans `bytes` readable bytes.
                    let src = unsafe { std::slice::from_raw_parts(t.addr() as *const u8, bytes) };
                    cuda.copy_to_device_async(dst, src, stream)?;
                    Ok(dst as u64)
                }
            }
        };
        let result = (|| {
            let (k_addr, v_addr) = (device_view(k)?, device_view(v)?);
            let strides4 = |t: &TensorView| -> [i64; 4] {
                let s = t.strides();
                if t.ndim() == 4 {
                    [s[0] as i64, s[1] as i64, s[2] as i64, s[3] as i64]
                } else {
                    [0, s[0] as i64, s[1] as i64, s[2] as i64]
                }
            };
            let (ks, vs) = (strides4(k), strides4(v));
            let elem = k.dtype().size() as u64;
            for chunk in placed.chunks(MAX_WRITE_GROUPS) {
                let off0 = chunk[0].3;
                let n_tokens: usize = chunk.iter().map(|g| g.2).sum();
                let mut p = Box::new(WriteParams {
                    layers: self.layers.addr() as u64,
                    table: self.tables.addr() as u64,
                    k_src: k_addr + (off0 as i64 * ks[1]) as u64 * elem,
                    v_src: v_addr + (off0 as i64 * vs[1]) as u64 * elem,
                    ks,
                    vs,
                    page: FastDiv::new(cfg.page_size as u32),
                    table_stride: cfg.pages_per_seq() as i32,
                    layer0: layers.start as i32,
                    n_layers: layers.len() as i32,
                    hkv: cfg.kv_heads as i32,
                    d: cfg.head_dim as i32,
                    n_groups: chunk.len() as i32,
                    n_tokens: n_tokens as i32,
                    groups: [WriteGroup::default(); MAX_WRITE_GROUPS],
                });
                for (i, &(slot, start, count, off)) in chunk.iter().enumerate() {
                    p.groups[i] = WriteGroup {
                        slot: slot as i32,
                        start: start as i32,
                        count: count as i32,
                        src_offset: (off - off0) as i32,
                    };
                }
                let rows = layers.len() * n_tokens * cfg.kv_heads * 2;
                let mut args = [&mut *p as *mut WriteParams as *mut c_void];
                cuda.launch(
                    Kernel::KvWrite {
                        src: k.dtype(),
                        dst: cfg.dtype,
                    },
                    (self.grid_for(rows, 8), 1, 1),
                    (256, 1, 1),
                    0,
                    stream,
                    &mut args,
                )?;
            }
            Ok(())
        })();
        for ptr in staged {
            cuda.free_async(ptr, stream)?;
        }
        result
    }

    /// Launches the decode kernel.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode(
        &self,
        cuda: &CudaBackend,
        cfg: &KvPoolConfig,
        st: &PoolState,
        lay: &LayerLayout,
        plan: &DecodePlan,
        stream: Stream,
    ) -> Result<()> {
        let launch = self.decode.ok_or_else(|| {
            Error::Unsupported(format!(
                "no CUDA decode kernel for {} KV with head dim {}",
                cfg.dtype, cfg.head_dim
            ))
        })?;
        if plan.b == 0 {
            return Ok(());
        }
        let mut batch_inline = [0i32; MAX_INLINE_BATCH];
        let batch_ptr = match &plan.ids {
            BatchIds::Host(ids) if ids.len() <= MAX_INLINE_BATCH => {
                batch_inline[..ids.len()].copy_from_slice(ids);
                0
            }
            BatchIds::Host(ids) => {
                // Too many to travel in the parameters: copy them (not graph-capturable).
                let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_ne_bytes()).collect();
                cuda.copy_to_device_async(self.batch.addr(), &bytes, stream)?;
                self.batch.addr() as u64
            }
            BatchIds::Device(addr) => *addr as u64,
        };
        let y_tiles = (plan.g * plan.t).div_ceil(16);
        let (path, split_x) = self.choose_path(cfg, st, plan, y_tiles);
        let mut wave = launch.wave as usize;
        if plan.max_ctas > 0 {
            wave = wave.min(plan.max_ctas.max(y_tiles));
        }
        let grid_x = (wave / y_tiles).max(1) as u32;
        let s3 = |t: &TensorView| -> [i64; 3] {
            let s = t.strides();
            [s[0] as i64, s[1] as i64, s[2] as i64]
        };
        let [q_sb, q_st, q_sh] = s3(&plan.q);
        let [o_sb, o_st, o_sh] = s3(&plan.out);
        let [l_sb, l_st, l_sh] = plan.lse.as_ref().map_or([0; 3], s3);
        let [k_sp, k_sh, k_st] = lay.k_strides.map(|x| x as i64);
        let [v_sp, v_sh, v_st] = lay.v_strides.map(|x| x as i64);
        let pps = cfg.pages_per_seq();
        let mut p = Box::new(DecodeParams {
            q: plan.q.addr() as u64,
            out: plan.out.addr() as u64,
            lse: plan.lse.as_ref().map_or(0, |l| l.addr() as u64),
            k: lay.k as u64,
            v: lay.v as u64,
            table: self.tables.addr() as u64,
            lens: (self.tables.addr() + cfg.max_seqs * pps * 4) as u64,
            batch: batch_ptr,
            part_o: self.part_o.addr() as u64,
            part_lse: self.part_lse.addr() as u64,
            counters: self.counters.addr() as u64,
            group_counters: (self.counters.addr() + self.group_counters_at) as u64,
            q_sb,
            q_st,
            q_sh,
            o_sb,
            o_st,
            o_sh,
            l_sb,
            l_st,
            l_sh,
            k_sp,
            k_sh,
            k_st,
            v_sp,
            v_sh,
            v_st,
            page: FastDiv::new(cfg.page_size as u32),
            table_stride: pps as i32,
            max_seqs: cfg.max_seqs as i32,
            b: plan.b as i32,
            t: plan.t as i32,
            hq: plan.hq as i32,
            hkv: cfg.kv_heads as i32,
            g: plan.g as i32,
            q_dtype: dtype_code(plan.q.dtype()),
            out_dtype: dtype_code(plan.out.dtype()),
            window: plan.window as i32,
            min_tiles_per_cta: if path == DecodePath::Stream {
                MIN_TILES_PER_CTA
            } else {
                SPLIT_MIN_TILES
            },
            stages: launch.stages as i32,
            q_vec: q_vector_mode(&plan.q, cfg.dtype),
            scale_log2: plan.scale * std::f32::consts::LOG2_E,
            qk_scale: plan.scale,
            softcap: plan.softcap,
            batch_inline,
            pad: 0,
        });
        let mut args = [&mut *p as *mut DecodeParams as *mut c_void];
        let rows = (plan.b * cfg.kv_heads) as u32;
        let short = match path {
            DecodePath::Cluster => self.cluster.map(|l| (l, CLUSTER as u32)),
            DecodePath::Split => self.split.map(|l| (l, 0)),
            DecodePath::Batch => self.batch_kernel.map(|l| (l, 0)),
            _ => None,
        };
        match short {
            Some((l, cluster)) => {
                // A programmatic dependent: the kernel waits for the previous one first.
                cuda.launch_ex(
                    l.kernel,
                    (split_x as u32, rows, y_tiles as u32),
                    (l.threads, 1, 1),
                    l.shared_bytes,
                    stream,
                    &mut args,
                    true,
                    cluster,
                )
            }
            None => cuda.launch(
                launch.kernel,
                (grid_x, y_tiles as u32, 1),
                (DECODE_THREADS, 1, 1),
                launch.shared_bytes,
                stream,
                &mut args,
            ),
        }
    }

    /// Picks the kernel of a decode call and, for the split and cluster kernels, their CTAs
    /// per (row, query tile). Batches of at most one wave of (row, query tile) pairs take the
    /// split kernel (fixed parts per row, up to a wave of CTAs); among them, a few rows whose
    /// tiles (from the host's lengths) are few take the cluster kernel. Larger batches of
    /// even rows take the batch or split kernel with one CTA per row, the rest stream-K. The
    /// choice affects speed only: every kernel serves every length, so a captured graph stays
    /// valid while sequences grow. `KVR_KV_DECODE` forces one (where the device has it).
    fn choose_path(
        &self,
        cfg: &KvPoolConfig,
        st: &PoolState,
        plan: &DecodePlan,
        y_tiles: usize,
    ) -> (DecodePath, usize) {
        let pairs = plan.b * cfg.kv_heads * y_tiles;
        let cap = if plan.max_ctas > 0 {
            plan.max_ctas
        } else {
            usize::MAX
        };
        // Rows above 2^16 - 1 do not fit grid.y.
        let fits = plan.b * cfg.kv_heads < 65_536;
        let cluster_ok = fits && self.cluster.is_some() && pairs * CLUSTER <= cap;
        // A power of two: rows of 2^k tiles split into equal parts.
        let split_parts = |wave: usize| {
            let n = (wave / pairs).min(MAX_SPLIT_PARTS).min(cap / pairs).max(1);
            1usize << n.ilog2()
        };
        let split_ok = fits && self.split.is_some() && pairs <= cap;
        let batch_ok = fits && self.batch_kernel.is_some() && pairs <= cap;
        let wave_of = |l: Option<DecodeLaunch>| l.map_or(0, |l| l.wave as usize);
        match self.path {
            DecodePath::Stream => return (DecodePath::Stream, 0),
            DecodePath::Cluster if cluster_ok => return (DecodePath::Cluster, CLUSTER),
            DecodePath::Split if split_ok => {
                return (
                    DecodePath::Split,
                    split_parts(wave_of(self.split).max(pairs)),
                );
            }
            DecodePath::Batch if batch_ok => {
                return (
                    DecodePath::Batch,
                    split_parts(wave_of(self.batch_kernel).max(pairs)),
                );
            }
            DecodePath::Auto => {}
            _ => return (DecodePath::Stream, 0),
        }
        // Only as many rows as clusters can be resident at once (one wave of clusters).
        let clusters = wave_of(self.cluster) / CLUSTER;
        if cluster_ok && pairs <= clusters {
            let tiles: usize = match &plan.ids {
                BatchIds::Host(ids) => {
                    ids.iter()
                        .filter(|&&id| id >= 0)
                        .map(|&id| (st.lens[id as usize] as usize).div_ceil(TILE).max(1))
                        .sum::<usize>()
                        * cfg.kv_heads
                }
                BatchIds::Device(_) => usize::MAX,
            };
            if tiles <= CLUSTER_MAX_TILES {
                return (DecodePath::Cluster, CLUSTER);
            }
        }
        let wave = wave_of(self.split);
        if split_ok && pairs <= wave {
            return (DecodePath::Split, split_parts(wave));
        }
        // More pairs than a wave: one CTA per pair, in waves, when the rows are alike and
        // the last wave is nearly full: the batch kernel (two CTAs per SM) from 1K-token rows,
        // else the split kernel from 4K-token rows. They stream a row faster than the stream-K
        // partition, which stays for ragged, short or awkward batches.
        if y_tiles == 1 {
            let batch_wave = wave_of(self.batch_kernel);
            if batch_ok && even_rows(st, plan, pairs, batch_wave, BATCH_ROW_MIN_TILES) {
                return (DecodePath::Batch, 1);
            }
            if split_ok && even_rows(st, plan, pairs, wave, WAVE_ROW_MIN_TILES) {
                return (DecodePath::Split, 1);
            }
        }
        (DecodePath::Stream, 0)
    }
}

/// Whether a batch of `pairs` rows (host lengths) suits one CTA per row, in waves of `wave`:
/// at least `min_tiles` tiles per sequence on average, the longest within 25 % of the mean,
/// and the last wave at least 90 % full.
fn even_rows(
    st: &PoolState,
    plan: &DecodePlan,
    pairs: usize,
    wave: usize,
    min_tiles: usize,
) -> bool {
    let BatchIds::Host(ids) = &plan.ids else {
        return false;
    };
    let tiles: Vec<usize> = ids
        .iter()
        .filter(|&&id| id >= 0)
        .map(|&id| (st.lens[id as usize] as usize).div_ceil(TILE))
        .collect();
    let (n, sum) = (tiles.len(), tiles.iter().sum::<usize>());
    let max = tiles.iter().copied().max().unwrap_or(0);
    wave > 0
        && n > 0
        && sum >= min_tiles * n
        && 4 * max * n <= 5 * sum
        && 10 * pairs >= 9 * pairs.div_ceil(wave) * wave
}

impl KvExecutor for DeviceState {
    fn sync_tables(&self, st: &mut PoolState, stream: Stream) -> Result<()> {
        if !st.page_copies.is_empty() {
            self.copy_pages(&self.cuda, &self.cfg, &st.page_copies, stream)?;
            st.page_copies.clear();
        }
        if !st.patches.is_empty() {
            self.apply_patches(&self.cuda, &st.patches, stream)?;
            st.patches.clear();
        }
        Ok(())
    }
    fn write_tokens(
        &self,
        _st: &PoolState,
        layers: Range<usize>,
        placed: &Placed,
        k: &TensorView,
        v: &TensorView,
        stream: Stream,
    ) -> Result<()> {
        DeviceState::write_tokens(self, &self.cuda, &self.cfg, layers, placed, k, v, stream)
    }
    fn device_tables(&self) -> Option<(usize, usize)> {
        let t = self.tables.addr();
        Some((t, t + self.cfg.max_seqs * self.cfg.pages_per_seq() * 4))
    }
    fn decode(
        &self,
        lay: &LayerLayout,
        st: &PoolState,
        plan: &DecodePlan,
        stream: Stream,
    ) -> Result<()> {
        DeviceState::decode(self, &self.cuda, &self.cfg, st, lay, plan, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fastdiv_matches_division() {
        for d in [
            1u32, 2, 3, 5, 7, 8, 15, 16, 17, 31, 100, 128, 1000, 4097, 65536, 131071,
        ] {
            let f = FastDiv::new(d);
            let mut n = 0u32;
            while n < (1 << 31) {
                assert_eq!(f.div(n), n / d, "{n} / {d}");
                n = n.wrapping_mul(3).wrapping_add(1 + d);
                if n == 0 {
                    break;
                }
            }
            for n in [
                (1u32 << 31) - 1,
                (1 << 31) - 2,
                d.saturating_sub(1),
                d,
                d + 1,
            ] {
                if n < (1 << 31) {
                    assert_eq!(f.div(n), n / d, "{n} / {d}");
                }
            }
        }
    }

    #[test]
    fn param_structs_fit_the_launch_limit() {
        for size in [
            size_of::<WriteParams>(),
            size_of::<PageCopyParams>(),
            size_of::<DecodeParams>(),
        ] {
            assert!(size <= 4096, "{size}");
        }
    }
}
