//! The CUDA side of the write-gated mode: row copies (kernels/wgkv.cu) into the pool's
//! pages, and the device step (`kvr_wgkv_step`: gate, ring update and promotion on the
//! device, against row state kept in device memory); the tables, copy-on-write copies and
//! decode are the paged pool's own.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::gate::{GateWeights, GATE_FLOOR, GATE_NORM_EPS};
use super::{Pair, RowSource, WgKvConfig};
use crate::abi::{
    dtype_code, WgKvScatterArgs, WgKvStepArgs, KVR_WGKV_GATE_CHUNK, KVR_WGKV_GATE_MAX_IN,
    KVR_WGKV_GATE_QUEUE, KVR_WGKV_MAX_PAIRS, KVR_WGKV_MODE_DEFERRED, KVR_WGKV_MODE_FLUSH,
    KVR_WGKV_MODE_IMMEDIATE, KVR_WGKV_ROW_INTS, KVR_WGKV_SCATTER_THREADS, KVR_WGKV_SLOT_PENDING,
    KVR_WGKV_STEP_MAX_SEQS, KVR_WGKV_STEP_THREADS, KVR_WGKV_STEP_TILE,
};
use crate::backend::cuda::memory::DeviceBuffer;
use crate::backend::cuda::module::Kernel;
use crate::backend::cuda::CudaBackend;
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::kv::config::LayerLayout;
use crate::tensor::{DType, MemoryKind, TensorView};

/// One row's device state: fill, ptr, global, total, budget, dropped (then two zeros).
pub(super) type RowWords = [i32; KVR_WGKV_ROW_INTS];

/// The gate's weights in device memory: per layer the addresses of norm_pre, norm_post,
/// fc1 weight, fc1 bias, fc2 weight, fc2 bias (f32); and the deferred gate's queues
/// (`[rows][queue_len][2 head_dim]` f32 inputs, `[rows][queue_len]` their slots).
struct DeviceGate {
    _buf: DeviceBuffer,
    hidden: usize,
    layers: Vec<[u64; 6]>,
    queue: Option<(DeviceBuffer, DeviceBuffer)>,
    /// A copy of each row's code per gate CTA (`[KVR_WGKV_STEP_MAX_SEQS][kv_heads][gate
    /// CTAs]`, pending between launches; see `KVR_WGKV_SLOT_PENDING`; experimental, with
    /// `KVR_WGKV_SLOT_COPIES=1`), or `None`: the one `slots` and the finishing CTA's restore.
    slot_copies: Option<DeviceBuffer>,
}

/// Whether the device step launches `kvr_wgkv_move` (experimental, opt-in until measured
/// on the device: `KVR_WGKV_MOVE=1`), the step with the gate CTAs' code out of line for a
/// layer's step that fetches its code cold; read once.
fn compact_step() -> bool {
    static MOVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MOVE.get_or_init(|| std::env::var("KVR_WGKV_MOVE").as_deref() == Ok("1"))
}

/// How a device step's gate runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum GateMode {
    /// Given scores (no gate for the new tokens).
    Given,
    /// Every new token scored in its step.
    Immediate,
    /// New tokens queued per row, a row scored when its queue is full.
    Deferred,
    /// No new tokens: the rows' queues scored.
    Flush,
}

/// Launches row copies into the one layer of a one-head pool, and the device step.
pub(super) struct WgCuda {
    cuda: Arc<CudaBackend>,
    dtype: DType,
    head_dim: usize,
    layout: LayerLayout,
    cfg: WgKvConfig,
    /// The inner pool's device block table and lengths, and the table's width.
    table: usize,
    lens: usize,
    table_stride: usize,
    /// Row state `[rows][KVR_WGKV_ROW_INTS]` and admission bits `[rows][admit_words]`.
    rows: DeviceBuffer,
    admit: DeviceBuffer,
    admit_words: usize,
    /// The gate's partial sums `[KVR_WGKV_STEP_MAX_SEQS][kv_heads]` and CTA counters
    /// `[tiles][kv_heads]`, zero between launches.
    zacc: DeviceBuffer,
    counters: DeviceBuffer,
    /// Each row's code in a launch `[KVR_WGKV_STEP_MAX_SEQS][kv_heads]`,
    /// `KVR_WGKV_SLOT_PENDING` between launches.
    slots: DeviceBuffer,
    gate: Mutex<Option<DeviceGate>>,
    /// Gate inputs a row queues before it is scored (0: every gated step scores at once).
    queue_len: usize,
    /// A deferred step was queued (rows may hold queued tokens): steps with given scores
    /// then carry gate CTAs for them.
    deferred_used: AtomicBool,
}

/// What one device step reads and writes (checked by the pool).
pub(super) struct StepIo<'a> {
    pub(super) layer: usize,
    pub(super) seqs: &'a [i32],
    pub(super) k_pre: Option<&'a TensorView>,
    pub(super) k: Option<&'a TensorView>,
    pub(super) v: Option<&'a TensorView>,
    pub(super) scores: Option<&'a TensorView>,
    pub(super) scores_out: Option<&'a TensorView>,
    pub(super) mode: GateMode,
}

impl WgCuda {
    pub(super) fn new(
        cuda: Arc<CudaBackend>,
        cfg: &WgKvConfig,
        layout: LayerLayout,
        (table, lens): (usize, usize),
        table_stride: usize,
    ) -> Result<Self> {
        let n_rows = cfg.max_seqs * cfg.rows_per_seq();
        let admit_words = cfg.local_window.div_ceil(32);
        let rows = DeviceBuffer::new(&cuda, n_rows * KVR_WGKV_ROW_INTS * 4)?;
        rows.upload(&vec![0i32; n_rows * KVR_WGKV_ROW_INTS])?;
        let admit = DeviceBuffer::new(&cuda, n_rows * admit_words * 4)?;
        let tiles = KVR_WGKV_STEP_MAX_SEQS.div_ceil(KVR_WGKV_STEP_TILE);
        // The deferred gate (KVR_WGKV_GATE_DEFER=0 turns it off): a token's bit is needed
        // when it leaves the ring, so a row queues at most the window.
        let defer = std::env::var("KVR_WGKV_GATE_DEFER").map_or(true, |v| v != "0");
        let queue_len = if defer {
            KVR_WGKV_GATE_QUEUE.min(cfg.local_window)
        } else {
            0
        };
        let zn = KVR_WGKV_STEP_MAX_SEQS * queue_len.max(1) * cfg.kv_heads;
        let zacc = DeviceBuffer::new(&cuda, zn * 4)?;
        zacc.upload(&vec![0f32; zn])?;
        let counters = DeviceBuffer::new(&cuda, tiles * cfg.kv_heads * 4)?;
        counters.upload(&vec![0i32; tiles * cfg.kv_heads])?;
        let slots = DeviceBuffer::new(&cuda, KVR_WGKV_STEP_MAX_SEQS * cfg.kv_heads * 4)?;
        slots.upload(&vec![
            KVR_WGKV_SLOT_PENDING;
            KVR_WGKV_STEP_MAX_SEQS * cfg.kv_heads
        ])?;
        Ok(WgCuda {
            cuda,
            dtype: cfg.dtype,
            head_dim: cfg.head_dim,
            layout,
            cfg: *cfg,
            table,
            lens,
            table_stride,
            rows,
            admit,
            admit_words,
            zacc,
            counters,
            slots,
            gate: Mutex::new(None),
            queue_len,
            deferred_used: AtomicBool::new(false),
        })
    }

    /// Whether a gated step without `scores_out` defers its gate (see [`GateMode`]).
    pub(super) fn defers(&self) -> bool {
        self.queue_len > 0
    }

    /// Words of admission bits per row.
    pub(super) fn admit_words(&self) -> usize {
        self.admit_words
    }

    /// Puts the gate's weights in device memory (or drops them). A gate wider than the
    /// kernel's input limit stays host-only: the device step then needs given scores.
    pub(super) fn set_gate(&self, gate: Option<&GateWeights>) -> Result<()> {
        let dev = match gate {
            Some(g) if 2 * g.head_dim <= KVR_WGKV_GATE_MAX_IN => {
                let mut all: Vec<f32> = Vec::new();
                let mut offs = Vec::with_capacity(g.layers.len());
                for l in &g.layers {
                    let mut o = [0usize; 6];
                    for (i, part) in [
                        &l.norm_pre,
                        &l.norm_post,
                        &l.fc1_weight,
                        &l.fc1_bias,
                        &l.fc2_weight,
                        &l.fc2_bias,
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        // 16-byte aligned parts.
                        all.resize(all.len().next_multiple_of(4), 0.0);
                        o[i] = all.len();
                        all.extend_from_slice(part);
                    }
                    offs.push(o);
                }
                let buf = DeviceBuffer::new(&self.cuda, all.len() * 4)?;
                buf.upload(&all)?;
                let base = buf.addr() as u64;
                let queue = if self.queue_len > 0 {
                    let n = self.cfg.max_seqs * self.cfg.rows_per_seq() * self.queue_len;
                    Some((
                        DeviceBuffer::new(&self.cuda, n * 2 * self.head_dim * 4)?,
                        DeviceBuffer::new(&self.cuda, n * 4)?,
                    ))
                } else {
                    None
                };
                let copies = g.hidden.div_ceil(KVR_WGKV_GATE_CHUNK);
                // Experimental, opt-in until measured on the device (KVR_WGKV_SLOT_COPIES=1,
                // used by the compact step kernel only).
                let slot_copies = if compact_step()
                    && std::env::var("KVR_WGKV_SLOT_COPIES").as_deref() == Ok("1")
                {
                    let n = KVR_WGKV_STEP_MAX_SEQS * self.cfg.kv_heads * copies;
                    let b = DeviceBuffer::new(&self.cuda, n * 4)?;
                    b.upload(&vec![KVR_WGKV_SLOT_PENDING; n])?;
                    Some(b)
                } else {
                    None
                };
                Some(DeviceGate {
                    slot_copies,
                    layers: offs
                        .iter()
                        .map(|o| o.map(|x| base + 4 * x as u64))
                        .collect(),
                    hidden: g.hidden,
                    _buf: buf,
                    queue,
                })
            }
            _ => None,
        };
        *self.gate.lock().unwrap_or_else(|e| e.into_inner()) = dev;
        Ok(())
    }

    /// Whether the device holds a gate.
    pub(super) fn has_gate(&self) -> bool {
        self.gate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Queues the upload of the state of rows `first..first + words.len()` (and their
    /// admission bits, `admit_words` per row) on `stream`.
    pub(super) fn push_rows(
        &self,
        first: usize,
        words: &[RowWords],
        bits: &[u32],
        stream: Stream,
    ) -> Result<()> {
        let bytes: Vec<u8> = words
            .iter()
            .flatten()
            .flat_map(|x| x.to_ne_bytes())
            .collect();
        self.cuda.copy_to_device_async(
            self.rows.addr() + first * KVR_WGKV_ROW_INTS * 4,
            &bytes,
            stream,
        )?;
        let bytes: Vec<u8> = bits.iter().flat_map(|x| x.to_ne_bytes()).collect();
        self.cuda.copy_to_device_async(
            self.admit.addr() + first * self.admit_words * 4,
            &bytes,
            stream,
        )
    }

    /// Waits for `stream` (every stream of the context for None) and reads the state and
    /// admission bits of `n` rows from `first`.
    pub(super) fn pull_rows(
        &self,
        first: usize,
        n: usize,
        stream: Option<Stream>,
    ) -> Result<(Vec<RowWords>, Vec<u32>)> {
        if stream.is_none() {
            self.cuda.synchronize_all()?;
        }
        let stream = stream.unwrap_or(Stream::DEFAULT);
        let mut raw = vec![0u8; n * KVR_WGKV_ROW_INTS * 4];
        self.cuda.read_device(
            self.rows.addr() + first * KVR_WGKV_ROW_INTS * 4,
            &mut raw,
            stream,
        )?;
        let words = raw
            .chunks_exact(KVR_WGKV_ROW_INTS * 4)
            .map(|c| {
                let mut w = [0i32; KVR_WGKV_ROW_INTS];
                for (x, b) in w.iter_mut().zip(c.chunks_exact(4)) {
                    *x = i32::from_ne_bytes(b.try_into().expect("4 bytes"));
                }
                w
            })
            .collect();
        let mut raw = vec![0u8; n * self.admit_words * 4];
        self.cuda.read_device(
            self.admit.addr() + first * self.admit_words * 4,
            &mut raw,
            stream,
        )?;
        let bits = raw
            .chunks_exact(4)
            .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
            .collect();
        Ok((words, bits))
    }

    /// Queues the device step: one launch per `KVR_WGKV_STEP_MAX_SEQS` sequences.
    pub(super) fn step(&self, io: &StepIo<'_>, stream: Stream) -> Result<()> {
        let c = &self.cfg;
        let h = c.kv_heads;
        let gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        // With given scores, gate CTAs only for rows that may queue tokens.
        let queued = self.deferred_used.load(Ordering::Relaxed);
        let (gl, hidden, queue, copies) = match (io.mode, &*gate) {
            (GateMode::Given, Some(g)) if queued => (
                g.layers[io.layer],
                g.hidden,
                g.queue.as_ref(),
                g.slot_copies.as_ref(),
            ),
            (GateMode::Given, _) => ([0u64; 6], 0, None, None),
            (_, Some(g)) => (
                g.layers[io.layer],
                g.hidden,
                g.queue.as_ref(),
                g.slot_copies.as_ref(),
            ),
            (GateMode::Flush, None) => return Ok(()),
            (_, None) => {
                return Err(Error::Unsupported(
                    "the pool's gate is not on the device (none set, or 2 * head_dim above \
                     KVR_WGKV_GATE_MAX_IN): pass scores"
                        .into(),
                ))
            }
        };
        let mode = match io.mode {
            GateMode::Deferred if queue.is_some() => {
                self.deferred_used.store(true, Ordering::Relaxed);
                KVR_WGKV_MODE_DEFERRED
            }
            GateMode::Flush => KVR_WGKV_MODE_FLUSH,
            _ => KVR_WGKV_MODE_IMMEDIATE,
        };
        // CTA 0 moves the rows; the others score gate chunks.
        let chunks = 1 + hidden.div_ceil(KVR_WGKV_GATE_CHUNK);
        let compact = compact_step();
        // Slot copies (experimental, KVR_WGKV_SLOT_COPIES=1) only in that kernel.
        let (slots, slot_copies) = match copies {
            Some(b) if chunks > 1 && compact => (b.addr() as u64, (chunks - 1) as i32),
            _ => (self.slots.addr() as u64, 0),
        };
        let (queue, queue_codes) =
            queue.map_or((0, 0), |(q, c)| (q.addr() as u64, c.addr() as u64));
        let s3 = |t: Option<&TensorView>| {
            t.map_or([0i64; 3], |t| {
                let s = t.strides();
                [s[0] as i64, s[1] as i64, s[2] as i64]
            })
        };
        let (kp, kk, vv) = (s3(io.k_pre), s3(io.k), s3(io.v));
        let ss = io.scores.map_or([0i64; 2], |t| {
            let s = t.strides();
            [s[0] as i64, s[1] as i64]
        });
        for (ci, chunk) in io.seqs.chunks(KVR_WGKV_STEP_MAX_SEQS).enumerate() {
            let t0 = (ci * KVR_WGKV_STEP_MAX_SEQS) as u64;
            let at = |t: Option<&TensorView>, s0: i64| -> u64 {
                t.map_or(0, |t| {
                    (t.addr() as i64 + t0 as i64 * s0 * t.dtype().size() as i64) as u64
                })
            };
            let mut p = Box::new(WgKvStepArgs {
                k_pre: at(io.k_pre, kp[0]),
                k: at(io.k, kk[0]),
                v: at(io.v, vv[0]),
                scores_in: at(io.scores, ss[0]),
                scores_out: at(io.scores_out, h as i64),
                norm_pre: gl[0],
                norm_post: gl[1],
                fc1_w: gl[2],
                fc1_b: gl[3],
                fc2_w: gl[4],
                fc2_b: gl[5],
                rows: self.rows.addr() as u64,
                admit: self.admit.addr() as u64,
                table: self.table as u64,
                lens: self.lens as u64,
                k_dst: self.layout.k as u64,
                v_dst: self.layout.v as u64,
                zacc: self.zacc.addr() as u64,
                counters: self.counters.addr() as u64,
                slots,
                queue,
                queue_codes,
                kp_sb: kp[0],
                kp_sh: kp[1],
                kp_sd: kp[2],
                k_sb: kk[0],
                k_sh: kk[1],
                k_sd: kk[2],
                v_sb: vv[0],
                v_sh: vv[1],
                v_sd: vv[2],
                s_sb: ss[0],
                s_sh: ss[1],
                k_sp: self.layout.k_strides[0] as i64,
                k_st: self.layout.k_strides[2] as i64,
                v_sp: self.layout.v_strides[0] as i64,
                v_st: self.layout.v_strides[2] as i64,
                n: chunk.len() as i32,
                hkv: h as i32,
                d: self.head_dim as i32,
                hidden: hidden as i32,
                window: c.local_window as i32,
                page_size: c.page_size as i32,
                table_stride: self.table_stride as i32,
                admit_words: self.admit_words as i32,
                rows_per_seq: c.rows_per_seq() as i32,
                row0: (io.layer * h) as i32,
                sinks: c.sinks.min(i32::MAX as usize) as i32,
                kp_dtype: io.k_pre.map_or(0, |t| dtype_code(t.dtype())),
                k_dtype: io.k.map_or(0, |t| dtype_code(t.dtype())),
                v_dtype: io.v.map_or(0, |t| dtype_code(t.dtype())),
                pool_dtype: dtype_code(self.dtype),
                queue_len: self.queue_len as i32,
                mode,
                slot_copies,
                pad3: 0,
                pad4: 0,
                tau: c.tau,
                norm_eps: GATE_NORM_EPS,
                gate_floor: GATE_FLOOR,
                pad1: 0.0,
                seq: [0; KVR_WGKV_STEP_MAX_SEQS],
            });
            p.seq[..chunk.len()].copy_from_slice(chunk);
            let grid = (
                chunks as u32,
                h as u32,
                chunk.len().div_ceil(KVR_WGKV_STEP_TILE) as u32,
            );
            let mut args = [&mut *p as *mut WgKvStepArgs as *mut c_void];
            let kernel = if compact {
                Kernel::WgKvMove
            } else {
                Kernel::WgKvStep
            };
            self.cuda.launch_ex(
                kernel,
                grid,
                (KVR_WGKV_STEP_THREADS, 1, 1),
                0,
                stream,
                &mut args,
                true,
                0,
            )?;
        }
        Ok(())
    }

    /// Queues the scoring of the tokens that `seqs`' rows of `layer` still queue (a deferred
    /// gate), with no new tokens.
    pub(super) fn flush(&self, layer: usize, seqs: &[i32], stream: Stream) -> Result<()> {
        let io = StepIo {
            layer,
            seqs,
            k_pre: None,
            k: None,
            v: None,
            scores: None,
            scores_out: None,
            mode: GateMode::Flush,
        };
        self.step(&io, stream)
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
