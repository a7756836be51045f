//! Replay decoding for Gated DeltaNet layers: the pool, its configuration and operations.
//!
//! # What is kept per (sequence, layer)
//!
//! - A **checkpoint state** slot `[Hv][dk][dv]` (K-major) or `[Hv][dv][dk]` (V-major), f32
//!   or bf16, owned by the pool or in the caller's memory (per-layer pointer + stride).
//! - A **ring** of the last `ring_len` (L) entries `(u, k, g)`: the corrected value
//!   `u = beta (v - S k)` per value head, the (normalized) key per key head and the log
//!   decay per value head, with a start cursor and a committed count `h`. The state is
//!   written only when the ring flushes (decode: when it is full; verify: when
//!   `h + 2T > L`, one window early), and the flush decision is made per sequence on the
//!   device.
//! - **KV-only mode** for short sequences: while a sequence has fewer than
//!   `kv_only_threshold` tokens, no state exists: its entries live in the memory of its
//!   (unused) state slot, laid out per value head, and outputs come from the entries
//!   alone (parallel form). When the next step would overflow the threshold, the state is
//!   materialized from the entries (in place, head by head) and the sequence continues in
//!   replay mode. The threshold is capped by what fits in one head's state memory
//!   (`kv_only_capacity`).
//! - A **conv window ring** (when `conv_dim` > 0): the raw conv inputs of the last
//!   `conv_kernel - 1` committed tokens plus the current drafts. kvreplay does not run the
//!   conv; after a speculative round, `commit` writes the conv state of the accepted prefix
//!   back into the caller's conv-state tensor, so no per-draft conv snapshot is needed.
//! - A metadata record (mode, ring start, committed count, pending drafts, conv end)
//!   that lives where the kernels run and is advanced by them (commit counts can be device
//!   data: the host never synchronizes).
//!
//! With `ring_len = 0` the pool is **recurrent**: every step reads and writes the state,
//! and verify keeps one state snapshot per draft (the baseline engines use today).

use std::sync::{Arc, Mutex};

use super::math::StateLayout;
use crate::backend::buffer::Buffer;
use crate::backend::{BackendKind, Context, Stream};
use crate::error::{Error, Result};
use crate::tensor::{DType, MemoryKind, TensorView};

/// Most draft tokens one verify can carry.
pub const MAX_DRAFTS: usize = crate::abi::KVR_GDN_MAX_T;

/// Per-sequence mode values in the metadata, and the (layer, sequence) metadata record:
/// `META_INTS` i32 fields (kernels/kvr_abi.h).
pub(crate) use crate::abi::{
    KVR_GDN_KV_ONLY as MODE_KV_ONLY, KVR_GDN_META_CONV_END as META_CONV_END,
    KVR_GDN_META_H as META_H, KVR_GDN_META_INTS as META_INTS, KVR_GDN_META_MODE as META_MODE,
    KVR_GDN_META_PENDING as META_PENDING, KVR_GDN_META_START as META_START,
    KVR_GDN_RECURRENT as MODE_RECURRENT, KVR_GDN_REPLAY as MODE_REPLAY,
};

/// Shape and policy of a GDN pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnConfig {
    /// GDN layers.
    pub layers: usize,
    /// Key heads (Hk).
    pub k_heads: usize,
    /// Value heads (Hv, a multiple of Hk).
    pub v_heads: usize,
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// Ring length L; 0 = recurrent mode.
    pub ring_len: usize,
    /// Sequences of at most this many tokens keep no state (KV-only); 0 = off.
    pub kv_only_threshold: usize,
    /// Most drafts per verify (1..=8).
    pub max_drafts: usize,
    /// f32 or bf16 state.
    pub state_dtype: DType,
    /// f32, f16 or bf16 ring entries (f32: replay equals recurrent to f32 rounding).
    pub entry_dtype: DType,
    /// State layout.
    pub layout: StateLayout,
    /// Sequence slots.
    pub max_seqs: usize,
    /// Channels of the conv input (0: no conv window is kept).
    pub conv_dim: usize,
    /// Conv kernel width (the window keeps `conv_kernel - 1` inputs).
    pub conv_kernel: usize,
    /// Element type of the conv window.
    pub conv_dtype: DType,
}

impl GdnConfig {
    /// State elements of one sequence in one layer.
    pub fn seq_state_elems(&self) -> usize {
        self.v_heads * self.dk * self.dv
    }
    /// Bytes of one (sequence, layer) state.
    pub fn state_bytes(&self) -> usize {
        self.seq_state_elems() * self.state_dtype.size()
    }
    /// Bytes of one ring entry (all heads).
    pub fn entry_bytes(&self) -> usize {
        (self.v_heads * self.dv + self.k_heads * self.dk) * self.entry_dtype.size()
            + self.v_heads * 4
    }
    /// Entries of the conv window ring.
    pub fn conv_slots(&self) -> usize {
        if self.conv_dim == 0 {
            0
        } else {
            self.conv_kernel - 1 + self.max_drafts
        }
    }
    /// Most KV-only entries one value head's state memory holds.
    pub fn kv_only_capacity(&self) -> usize {
        let head_bytes = self.dk * self.dv * self.state_dtype.size();
        head_bytes / ((self.dk + self.dv) * self.entry_dtype.size() + 4)
    }
    /// Memory of one sequence (all layers), by part.
    pub fn memory(&self) -> GdnMemory {
        let l = self.layers;
        GdnMemory {
            state_bytes: l * self.state_bytes(),
            ring_bytes: l * self.ring_len * self.entry_bytes(),
            conv_bytes: l * self.conv_slots() * self.conv_dim * self.conv_dtype.size(),
            snapshot_bytes: if self.ring_len == 0 {
                l * self.max_drafts * self.state_bytes()
            } else {
                0
            },
        }
    }

    /// Checks the configuration (backend limits are checked when a pool is created).
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("layers", self.layers),
            ("k_heads", self.k_heads),
            ("v_heads", self.v_heads),
            ("dk", self.dk),
            ("dv", self.dv),
            ("max_seqs", self.max_seqs),
            ("max_drafts", self.max_drafts),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument(format!("{name} must be at least 1")));
            }
        }
        if self.v_heads % self.k_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "v_heads ({}) must be a multiple of k_heads ({})",
                self.v_heads, self.k_heads
            )));
        }
        if self.max_drafts > MAX_DRAFTS {
            return Err(Error::OutOfRange(format!(
                "max_drafts {} exceeds {MAX_DRAFTS}",
                self.max_drafts
            )));
        }
        if !matches!(self.state_dtype, DType::F32 | DType::BF16) {
            return Err(Error::DTypeMismatch(format!(
                "state dtype must be f32 or bf16, not {}",
                self.state_dtype
            )));
        }
        if !self.entry_dtype.is_float() || !self.conv_dtype.is_float() {
            return Err(Error::DTypeMismatch(
                "entry and conv dtypes must be f32, f16 or bf16".into(),
            ));
        }
        if self.ring_len > 0 && self.ring_len < self.max_drafts {
            return Err(Error::InvalidArgument(format!(
                "ring_len {} cannot hold max_drafts {} drafts",
                self.ring_len, self.max_drafts
            )));
        }
        if self.ring_len > 1024 {
            return Err(Error::OutOfRange(format!(
                "ring_len {} exceeds 1024",
                self.ring_len
            )));
        }
        if self.kv_only_threshold > 0 {
            if self.ring_len == 0 {
                return Err(Error::InvalidArgument(
                    "KV-only mode needs a ring (ring_len > 0)".into(),
                ));
            }
            let cap = self.kv_only_capacity();
            if self.kv_only_threshold > cap {
                return Err(Error::OutOfRange(format!(
                    "kv_only_threshold {} exceeds the {cap} entries one head's state memory holds",
                    self.kv_only_threshold
                )));
            }
        }
        if self.conv_dim > 0 && !(2..=16).contains(&self.conv_kernel) {
            return Err(Error::InvalidArgument(format!(
                "conv_kernel {} must be 2..=16",
                self.conv_kernel
            )));
        }
        if self.dk > 256 || self.dv > 256 {
            return Err(Error::OutOfRange("dk and dv must be at most 256".into()));
        }
        if self.max_seqs > 1 << 20 || self.layers > 4096 {
            return Err(Error::OutOfRange("max_seqs or layers too large".into()));
        }
        Ok(())
    }
}

/// Bytes one sequence needs (all layers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GdnMemory {
    /// Checkpoint states.
    pub state_bytes: usize,
    /// Rings.
    pub ring_bytes: usize,
    /// Conv windows.
    pub conv_bytes: usize,
    /// Per-draft state snapshots (recurrent pools only).
    pub snapshot_bytes: usize,
}

impl GdnMemory {
    /// Total.
    pub fn total(&self) -> usize {
        self.state_bytes + self.ring_bytes + self.conv_bytes + self.snapshot_bytes
    }
}

/// Where a layer's states live: address of sequence 0 and the stride between sequences,
/// in elements (the heads of one sequence are contiguous, `dk * dv` each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateStorage {
    /// Address of sequence slot 0's state.
    pub addr: usize,
    /// Elements between consecutive sequence slots (>= v_heads * dk * dv).
    pub seq_stride: usize,
}

/// Options of one decode / verify call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GdnOptions {
    /// Scale applied to q (after the optional L2 norm); None = 1/sqrt(dk).
    pub scale: Option<f32>,
    /// L2-normalize q and k inside the kernel (fla's `use_qk_l2norm_in_kernel`).
    pub l2norm_qk: bool,
}

/// The tensors of a decode or verify call. q, k: `[B, T, Hk, dk]` (or `[B, Hk, dk]` for
/// decode); v and out: `[B, T, Hv, dv]`; g (log decay) and beta (post-sigmoid): `[B, T, Hv]`;
/// conv_in (required when the pool keeps conv windows): `[B, T, conv_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnIo<'a> {
    /// i32 `[B]` sequence ids (-1: an unused row, output zeros).
    pub seq_ids: &'a TensorView,
    pub q: &'a TensorView,
    pub k: &'a TensorView,
    pub v: &'a TensorView,
    pub g: &'a TensorView,
    pub beta: &'a TensorView,
    pub out: &'a TensorView,
    pub conv_in: Option<&'a TensorView>,
}

/// A decode/verify call with every tensor normalized to 4-D `[B, T, H, D]` (g, beta,
/// conv_in: `[B, T, X]`).
#[derive(Clone, Debug)]
pub(crate) struct StepPlan {
    pub b: usize,
    pub t: usize,
    pub auto_commit: bool,
    pub host_ids: Option<Vec<i32>>,
    pub device_ids: Option<usize>,
    pub q: TensorView,
    pub k: TensorView,
    pub v: TensorView,
    pub g: TensorView,
    pub beta: TensorView,
    pub out: TensorView,
    pub conv_in: Option<TensorView>,
    pub scale: f32,
    pub l2norm: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct SeqHost {
    /// Drafts verified and not yet committed, per layer.
    pub pending: Vec<u8>,
}

/// The pool's buffers (host memory for CPU, device memory for CUDA).
pub(crate) struct Storage {
    pub states: Vec<StateStorage>,
    pub snaps: usize,
    pub ring_u: usize,
    pub ring_k: usize,
    pub ring_g: usize,
    pub conv: usize,
    pub meta: usize,
    _owned: Vec<Buffer>,
}

/// A Gated DeltaNet replay pool. Thread-safe; device work of one pool must be ordered on
/// one stream by the caller.
pub struct GdnPool {
    ctx: Arc<Context>,
    cfg: GdnConfig,
    pub(crate) storage: Storage,
    pub(crate) seqs: Mutex<Vec<Option<SeqHost>>>,
    pub(crate) device: Option<super::gdn_cuda::DeviceState>,
}

fn checked_bytes(parts: &[usize]) -> Result<usize> {
    parts
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| Error::OutOfRange("pool size overflows".into()))
}

impl GdnPool {
    /// Creates a pool; `external` gives per-layer state memory (None: owned).
    pub fn new(
        ctx: Arc<Context>,
        cfg: GdnConfig,
        external: Option<Vec<StateStorage>>,
    ) -> Result<GdnPool> {
        cfg.validate()?;
        let (l, n) = (cfg.layers, cfg.max_seqs);
        let mut owned = Vec::new();
        let mut alloc = |bytes: usize| -> Result<usize> {
            if bytes == 0 {
                return Ok(0);
            }
            let b = Buffer::zeroed(&ctx, bytes)?;
            let a = b.addr();
            owned.push(b);
            Ok(a)
        };
        let states = match external {
            None => {
                let bytes = checked_bytes(&[l, n, cfg.state_bytes()])?;
                let base = alloc(bytes)?;
                (0..l)
                    .map(|i| StateStorage {
                        addr: base + i * n * cfg.state_bytes(),
                        seq_stride: cfg.seq_state_elems(),
                    })
                    .collect()
            }
            Some(v) => {
                if v.len() != l {
                    return Err(Error::InvalidArgument(format!(
                        "{} state layouts for {l} layers",
                        v.len()
                    )));
                }
                let align = if ctx.backend() == BackendKind::Cuda {
                    16
                } else {
                    cfg.state_dtype.size()
                };
                for (i, s) in v.iter().enumerate() {
                    if s.addr == 0 {
                        return Err(Error::NullArgument(format!(
                            "layer {i}: state pointer is NULL"
                        )));
                    }
                    if s.addr % align != 0 || (s.seq_stride * cfg.state_dtype.size()) % align != 0 {
                        return Err(Error::InvalidArgument(format!(
                            "layer {i}: state pointer and stride must be multiples of {align} bytes"
                        )));
                    }
                    if s.seq_stride < cfg.seq_state_elems() {
                        return Err(Error::InvalidArgument(format!(
                            "layer {i}: seq_stride {} is smaller than one state ({} elements)",
                            s.seq_stride,
                            cfg.seq_state_elems()
                        )));
                    }
                }
                v
            }
        };
        let snaps = if cfg.ring_len == 0 {
            alloc(checked_bytes(&[l, n, cfg.max_drafts, cfg.state_bytes()])?)?
        } else {
            0
        };
        let e = cfg.entry_dtype.size();
        let ring_u = alloc(checked_bytes(&[
            l,
            n,
            cfg.ring_len,
            cfg.v_heads * cfg.dv * e,
        ])?)?;
        let ring_k = alloc(checked_bytes(&[
            l,
            n,
            cfg.ring_len,
            cfg.k_heads * cfg.dk * e,
        ])?)?;
        let ring_g = alloc(checked_bytes(&[l, n, cfg.ring_len, cfg.v_heads * 4])?)?;
        let conv = alloc(checked_bytes(&[
            l,
            n,
            cfg.conv_slots(),
            cfg.conv_dim * cfg.conv_dtype.size(),
        ])?)?;
        let meta = alloc(checked_bytes(&[l, n, META_INTS * 4])?)?;
        let storage = Storage {
            states,
            snaps,
            ring_u,
            ring_k,
            ring_g,
            conv,
            meta,
            _owned: owned,
        };
        let device = match ctx.cuda() {
            Some(cuda) => Some(super::gdn_cuda::DeviceState::new(cuda, &cfg, &storage)?),
            None => None,
        };
        Ok(GdnPool {
            ctx,
            cfg,
            storage,
            seqs: Mutex::new(vec![None; n]),
            device,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GdnConfig {
        &self.cfg
    }
    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<SeqHost>>> {
        self.seqs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live(seqs: &[Option<SeqHost>], seq: i32) -> Result<usize> {
        if seq < 0 || seq as usize >= seqs.len() || seqs[seq as usize].is_none() {
            return Err(Error::UnknownId(format!("sequence {seq} is not live")));
        }
        Ok(seq as usize)
    }

    fn initial_mode(&self) -> i32 {
        if self.cfg.ring_len == 0 {
            MODE_RECURRENT
        } else if self.cfg.kv_only_threshold > 0 {
            MODE_KV_ONLY
        } else {
            MODE_REPLAY
        }
    }

    /// Resets slot `s` of every layer: empty ring, zero state, zero conv window.
    fn reset_slot(&self, s: usize, stream: Stream) -> Result<()> {
        let mut meta = [0i32; META_INTS];
        meta[META_MODE] = self.initial_mode();
        meta[META_CONV_END] = if self.cfg.conv_dim > 0 {
            (self.cfg.conv_kernel - 1) as i32
        } else {
            0
        };
        match &self.device {
            None => {
                super::gdn_cpu::reset_slot(&self.cfg, &self.storage, s, &meta);
                Ok(())
            }
            Some(dev) => dev.reset_slot(
                self.ctx.cuda().expect("CUDA"),
                &self.cfg,
                &self.storage,
                s,
                &meta,
                stream,
            ),
        }
    }

    /// Adds a sequence (zero state, empty ring, zero conv window) and returns its id.
    pub fn seq_add(&self, stream: Stream) -> Result<i32> {
        let mut seqs = self.lock();
        let s = seqs.iter().position(Option::is_none).ok_or_else(|| {
            Error::PoolExhausted(format!(
                "all {} sequence slots are in use",
                self.cfg.max_seqs
            ))
        })?;
        self.reset_slot(s, stream)?;
        seqs[s] = Some(SeqHost {
            pending: vec![0; self.cfg.layers],
        });
        Ok(s as i32)
    }

    /// Frees a sequence.
    pub fn seq_free(&self, seq: i32, _stream: Stream) -> Result<()> {
        let mut seqs = self.lock();
        let s = Self::live(&seqs, seq)?;
        seqs[s] = None;
        Ok(())
    }

    /// Resets a sequence to the empty state (as if just added).
    pub fn seq_reset(&self, seq: i32, stream: Stream) -> Result<()> {
        let mut seqs = self.lock();
        let s = Self::live(&seqs, seq)?;
        self.reset_slot(s, stream)?;
        seqs[s]
            .as_mut()
            .expect("live")
            .pending
            .iter_mut()
            .for_each(|p| *p = 0);
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.cfg.layers {
            return Err(Error::OutOfRange(format!(
                "layer {layer} out of range (the pool has {})",
                self.cfg.layers
            )));
        }
        Ok(())
    }

    fn check_state_tensor(&self, t: &TensorView, name: &str) -> Result<()> {
        let c = &self.cfg;
        let want = match c.layout {
            StateLayout::KMajor => [c.v_heads, c.dk, c.dv],
            StateLayout::VMajor => [c.v_heads, c.dv, c.dk],
        };
        if t.shape() != want {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected {want:?} (the pool's {:?} layout)",
                t.shape(),
                c.layout
            )));
        }
        if !t.dtype().is_float() {
            return Err(Error::DTypeMismatch(format!(
                "{name} must be a float tensor"
            )));
        }
        t.expect_memory(self.ctx.memory(), name)
    }

    fn check_conv_tensor(&self, t: &TensorView, name: &str) -> Result<()> {
        let want = [self.cfg.conv_kernel - 1, self.cfg.conv_dim];
        if self.cfg.conv_dim == 0 {
            return Err(Error::InvalidArgument(format!(
                "{name} given but the pool keeps no conv window (conv_dim = 0)"
            )));
        }
        if t.shape() != want {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected {want:?}",
                t.shape()
            )));
        }
        if !t.dtype().is_float() {
            return Err(Error::DTypeMismatch(format!(
                "{name} must be a float tensor"
            )));
        }
        t.expect_memory(self.ctx.memory(), name)
    }

    /// Checks an import or export: a live sequence without pending drafts in `layer`, a
    /// state tensor and an optional conv window of the right shapes. Returns the slot.
    #[allow(clippy::too_many_arguments)]
    fn check_state_io(
        &self,
        seqs: &[Option<SeqHost>],
        layer: usize,
        seq: i32,
        state: &TensorView,
        state_name: &str,
        conv: Option<&TensorView>,
        conv_name: &str,
    ) -> Result<usize> {
        let s = Self::live(seqs, seq)?;
        self.check_layer(layer)?;
        self.check_state_tensor(state, state_name)?;
        if let Some(c) = conv {
            self.check_conv_tensor(c, conv_name)?;
        }
        if seqs[s].as_ref().expect("live").pending[layer] > 0 {
            return Err(Error::InvalidArgument(format!(
                "sequence {seq} has uncommitted drafts in layer {layer}; commit first"
            )));
        }
        Ok(s)
    }

    /// Replaces a sequence's state in `layer` by `state` (the host's prefill result; the
    /// pool's layout, any float dtype) and, if given, its conv window (`[conv_kernel-1,
    /// conv_dim]`). The ring empties and the sequence leaves KV-only mode.
    pub fn import_state(
        &self,
        layer: usize,
        seq: i32,
        state: &TensorView,
        conv: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let seqs = self.lock();
        let s = self.check_state_io(&seqs, layer, seq, state, "state", conv, "conv window")?;
        match &self.device {
            None => super::gdn_cpu::import_state(&self.cfg, &self.storage, layer, s, state, conv),
            Some(dev) => dev.import_state(
                self.ctx.cuda().expect("CUDA"),
                &self.cfg,
                &self.storage,
                layer,
                s,
                state,
                conv,
                stream,
            )?,
        }
        Ok(())
    }

    /// Writes the sequence's current state in `layer` (materialized from the checkpoint and
    /// the ring; zeros-based for KV-only) into `out`, and its conv window into `conv_out`.
    /// The pool does not change.
    pub fn export_state(
        &self,
        layer: usize,
        seq: i32,
        out: &TensorView,
        conv_out: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let seqs = self.lock();
        let s = self.check_state_io(&seqs, layer, seq, out, "out", conv_out, "conv_out")?;
        match &self.device {
            None => {
                super::gdn_cpu::export_state(&self.cfg, &self.storage, layer, s, out, conv_out);
                Ok(())
            }
            Some(dev) => dev.export_state(
                self.ctx.cuda().expect("CUDA"),
                &self.cfg,
                &self.storage,
                layer,
                s,
                out,
                conv_out,
                stream,
            ),
        }
    }

    fn read_ids(ids: &TensorView) -> Vec<i32> {
        (0..ids.shape()[0])
            // SAFETY: a checked host i32 view.
            .map(|i| unsafe {
                (ids.addr() as *const i32)
                    .offset(i as isize * ids.strides()[0])
                    .read()
            })
            .collect()
    }

    fn check_ids(
        &self,
        seqs: &[Option<SeqHost>],
        ids: &TensorView,
    ) -> Result<(Option<Vec<i32>>, Option<usize>)> {
        if ids.dtype() != DType::I32 || ids.ndim() != 1 {
            return Err(Error::DTypeMismatch(
                "seq_ids must be a 1-D i32 tensor".into(),
            ));
        }
        if ids.shape()[0] > self.cfg.max_seqs {
            return Err(Error::OutOfRange(format!(
                "batch of {} rows exceeds max_seqs {}",
                ids.shape()[0],
                self.cfg.max_seqs
            )));
        }
        match ids.memory() {
            MemoryKind::Host => {
                let v = Self::read_ids(ids);
                for (i, &id) in v.iter().enumerate() {
                    if id == -1 {
                        continue;
                    }
                    Self::live(seqs, id).map_err(|_| {
                        Error::UnknownId(format!("seq_ids[{i}] = {id} is not a live sequence"))
                    })?;
                    if v[..i].contains(&id) {
                        return Err(Error::InvalidArgument(format!(
                            "sequence {id} appears twice"
                        )));
                    }
                }
                Ok((Some(v), None))
            }
            MemoryKind::Cuda => {
                if self.ctx.backend() != BackendKind::Cuda {
                    return Err(Error::InvalidArgument(
                        "seq_ids is in CUDA memory but the pool is on the CPU".into(),
                    ));
                }
                if ids.shape()[0] > 1 && ids.strides()[0] != 1 {
                    return Err(Error::InvalidArgument(
                        "device seq_ids must be contiguous".into(),
                    ));
                }
                Ok((None, Some(ids.addr())))
            }
        }
    }

    fn plan(
        &self,
        seqs: &[Option<SeqHost>],
        layer: usize,
        io: &GdnIo<'_>,
        opts: &GdnOptions,
        decode: bool,
    ) -> Result<StepPlan> {
        let c = &self.cfg;
        self.check_layer(layer)?;
        let (host_ids, device_ids) = self.check_ids(seqs, io.seq_ids)?;
        let b = io.seq_ids.shape()[0];
        let memory = self.ctx.memory();
        let four = |t: &TensorView, name: &str, h: usize, d: usize| -> Result<TensorView> {
            let v = match (t.ndim(), decode) {
                (3, true) => TensorView::new(
                    t.addr(),
                    t.dtype(),
                    t.memory(),
                    &[t.shape()[0], 1, t.shape()[1], t.shape()[2]],
                    &[t.strides()[0], 0, t.strides()[1], t.strides()[2]],
                )?,
                (4, _) => *t,
                (n, _) => {
                    return Err(Error::InvalidArgument(format!(
                        "{name} must be [B, T, H, D]{} ({n} dimensions given)",
                        if decode { " or [B, H, D]" } else { "" }
                    )))
                }
            };
            let s = v.shape();
            if s[0] != b || s[2] != h || s[3] != d {
                return Err(Error::InvalidArgument(format!(
                    "{name} has shape {:?}; expected [{b}, T, {h}, {d}]",
                    t.shape()
                )));
            }
            if !v.dtype().is_float() {
                return Err(Error::DTypeMismatch(format!(
                    "{name} must be f32, f16 or bf16, not {}",
                    v.dtype()
                )));
            }
            v.expect_memory(memory, name)?;
            Ok(v)
        };
        let q = four(io.q, "q", c.k_heads, c.dk)?;
        let t = q.shape()[1];
        let k = four(io.k, "k", c.k_heads, c.dk)?;
        let v = four(io.v, "v", c.v_heads, c.dv)?;
        let out = four(io.out, "out", c.v_heads, c.dv)?;
        let three = |x: &TensorView, name: &str, last: usize| -> Result<TensorView> {
            let v = match (x.ndim(), decode) {
                (2, true) => TensorView::new(
                    x.addr(),
                    x.dtype(),
                    x.memory(),
                    &[x.shape()[0], 1, x.shape()[1]],
                    &[x.strides()[0], 0, x.strides()[1]],
                )?,
                (3, _) => *x,
                (n, _) => {
                    return Err(Error::InvalidArgument(format!(
                        "{name} must be [B, T, {last}] ({n} dimensions given)"
                    )))
                }
            };
            if v.shape() != [b, t, last] {
                return Err(Error::InvalidArgument(format!(
                    "{name} has shape {:?}; expected [{b}, {t}, {last}]",
                    x.shape()
                )));
            }
            if !v.dtype().is_float() {
                return Err(Error::DTypeMismatch(format!(
                    "{name} must be f32, f16 or bf16"
                )));
            }
            v.expect_memory(memory, name)?;
            Ok(v)
        };
        let g = three(io.g, "g", c.v_heads)?;
        let beta = three(io.beta, "beta", c.v_heads)?;
        for (name, x) in [("k", &k), ("v", &v), ("out", &out)] {
            if x.shape()[1] != t {
                return Err(Error::InvalidArgument(format!(
                    "{name} has T = {} but q has {t}",
                    x.shape()[1]
                )));
            }
        }
        if decode && t != 1 {
            return Err(Error::InvalidArgument(format!(
                "decode takes one token per sequence, not {t}"
            )));
        }
        if t == 0 || t > c.max_drafts.max(1) {
            return Err(Error::OutOfRange(format!(
                "{t} drafts; this pool verifies 1..={}",
                c.max_drafts
            )));
        }
        if c.ring_len > 0 && t > c.ring_len {
            return Err(Error::OutOfRange(format!(
                "{t} drafts exceed ring_len {}",
                c.ring_len
            )));
        }
        if !out.is_non_overlapping() {
            return Err(Error::InvalidArgument(
                "out has overlapping elements".into(),
            ));
        }
        let conv_in = match (io.conv_in, c.conv_dim) {
            (None, 0) => None,
            (Some(_), 0) => {
                return Err(Error::InvalidArgument(
                    "conv_in given but the pool keeps no conv window (conv_dim = 0)".into(),
                ))
            }
            (None, _) => {
                return Err(Error::NullArgument(
                    "conv_in is required: the pool keeps conv windows (conv_dim > 0)".into(),
                ))
            }
            (Some(x), d) => Some(three(x, "conv_in", d)?),
        };
        if self.ctx.backend() == BackendKind::Cuda {
            for (name, x) in [("q", &q), ("k", &k), ("v", &v), ("out", &out)] {
                if x.strides()[3] != 1 {
                    return Err(Error::InvalidArgument(format!(
                        "on CUDA, {name}'s last dimension must be contiguous"
                    )));
                }
            }
        }
        let scale = opts.scale.unwrap_or(1.0 / (c.dk as f32).sqrt());
        if !scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "scale {scale} is not finite"
            )));
        }
        // Every listed sequence must be free of uncommitted drafts in this layer.
        if let Some(ids) = &host_ids {
            for &id in ids.iter().filter(|&&i| i >= 0) {
                if seqs[id as usize].as_ref().expect("live").pending[layer] > 0 {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {id} has uncommitted drafts in layer {layer}; commit them first"
                    )));
                }
            }
        }
        Ok(StepPlan {
            b,
            t,
            auto_commit: decode,
            host_ids,
            device_ids,
            q,
            k,
            v,
            g,
            beta,
            out,
            conv_in,
            scale,
            l2norm: opts.l2norm_qk,
        })
    }

    fn run_step(
        &self,
        layer: usize,
        io: &GdnIo<'_>,
        opts: &GdnOptions,
        decode: bool,
        stream: Stream,
    ) -> Result<()> {
        let mut seqs = self.lock();
        let plan = self.plan(&seqs, layer, io, opts, decode)?;
        match &self.device {
            None => {
                let pool = self.ctx.cpu().expect("CPU").pool();
                super::gdn_cpu::step(&self.cfg, &self.storage, layer, &plan, pool);
            }
            Some(dev) => dev.step(
                self.ctx.cuda().expect("CUDA"),
                &self.cfg,
                &self.storage,
                layer,
                &plan,
                stream,
            )?,
        }
        if !decode {
            if let Some(ids) = &plan.host_ids {
                for &id in ids.iter().filter(|&&i| i >= 0) {
                    seqs[id as usize].as_mut().expect("live").pending[layer] = plan.t as u8;
                }
            }
        }
        Ok(())
    }

    /// One token per sequence: output from the checkpoint and the ring; the state is
    /// written only where a sequence's ring is full (flush, decided on the device). The
    /// token is committed at once.
    pub fn decode(
        &self,
        layer: usize,
        io: &GdnIo<'_>,
        opts: &GdnOptions,
        stream: Stream,
    ) -> Result<()> {
        self.run_step(layer, io, opts, true, stream)
    }

    /// T draft tokens per sequence in one launch: outputs for every draft, no per-draft
    /// state (recurrent pools: one snapshot per draft). The drafts stay pending until
    /// `commit`.
    pub fn verify(
        &self,
        layer: usize,
        io: &GdnIo<'_>,
        opts: &GdnOptions,
        stream: Stream,
    ) -> Result<()> {
        if io.seq_ids.memory() == MemoryKind::Cuda {
            // Pending counts are tracked per sequence; with device ids the host cannot see
            // which sequences were verified.
            return Err(Error::Unsupported(
                "verify takes seq_ids in host memory (commit may take device counts)".into(),
            ));
        }
        self.run_step(layer, io, opts, false, stream)
    }

    /// Host sequence ids (checked) and the layers a commit or flush covers.
    fn host_ids_and_layers(
        &self,
        seqs: &[Option<SeqHost>],
        layer: Option<usize>,
        seq_ids: &TensorView,
        what: &str,
    ) -> Result<(Vec<i32>, Vec<usize>)> {
        if let Some(l) = layer {
            self.check_layer(l)?;
        }
        if seq_ids.memory() != MemoryKind::Host {
            return Err(Error::Unsupported(format!(
                "{what} takes seq_ids in host memory"
            )));
        }
        let (ids, _) = self.check_ids(seqs, seq_ids)?;
        let layers = match layer {
            Some(l) => vec![l],
            None => (0..self.cfg.layers).collect(),
        };
        Ok((ids.expect("host ids"), layers))
    }

    /// Commits `accepted[i]` of the pending drafts of `seq_ids[i]` (for `layer`, or every
    /// layer with None): accepted entries stay in the ring, the rest vanish; recurrent
    /// pools adopt the accepted draft's snapshot. `accepted` is i32 `[B]` in host or device
    /// memory (device counts are clamped to 0..=pending on the device; the host never
    /// synchronizes). With `conv_state` (`[B, conv_kernel-1, conv_dim]`), the conv window of
    /// the accepted prefix is written there.
    pub fn commit(
        &self,
        layer: Option<usize>,
        seq_ids: &TensorView,
        accepted: &TensorView,
        conv_state: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let mut seqs = self.lock();
        let (ids, layers) = self.host_ids_and_layers(&seqs, layer, seq_ids, "commit")?;
        let b = ids.len();
        if accepted.dtype() != DType::I32 || accepted.shape() != [b] {
            return Err(Error::DTypeMismatch(format!(
                "accepted must be i32 [{b}], not {} {:?}",
                accepted.dtype(),
                accepted.shape()
            )));
        }
        for &id in ids.iter().filter(|&&i| i >= 0) {
            for &l in &layers {
                if seqs[id as usize].as_ref().expect("live").pending[l] == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {id} has no verified drafts to commit in layer {l}"
                    )));
                }
            }
        }
        let host_accepted = match accepted.memory() {
            MemoryKind::Host => {
                let a = Self::read_ids(accepted);
                for (i, &id) in ids.iter().enumerate() {
                    if id >= 0 {
                        let p = seqs[id as usize].as_ref().expect("live").pending[layers[0]] as i32;
                        if a[i] < 0 || a[i] > p {
                            return Err(Error::OutOfRange(format!(
                                "accepted[{i}] = {} but sequence {id} has {p} verified drafts",
                                a[i]
                            )));
                        }
                    }
                }
                Some(a)
            }
            MemoryKind::Cuda => {
                if self.ctx.backend() != BackendKind::Cuda {
                    return Err(Error::InvalidArgument(
                        "accepted is in CUDA memory but the pool is on the CPU".into(),
                    ));
                }
                None
            }
        };
        if let Some(cs) = conv_state {
            if self.cfg.conv_dim == 0 {
                return Err(Error::InvalidArgument(
                    "conv_state given but the pool keeps no conv window".into(),
                ));
            }
            let want = [b, self.cfg.conv_kernel - 1, self.cfg.conv_dim];
            if cs.shape() != want || !cs.dtype().is_float() {
                return Err(Error::InvalidArgument(format!(
                    "conv_state must be a float tensor of shape {want:?}, not {:?}",
                    cs.shape()
                )));
            }
            cs.expect_memory(self.ctx.memory(), "conv_state")?;
            if layers.len() > 1 {
                return Err(Error::InvalidArgument(
                    "conv_state is per layer: commit one layer at a time to receive it".into(),
                ));
            }
            if !cs.is_non_overlapping() {
                return Err(Error::InvalidArgument(
                    "conv_state has overlapping elements".into(),
                ));
            }
        }
        match &self.device {
            None => {
                for &l in &layers {
                    super::gdn_cpu::commit(
                        &self.cfg,
                        &self.storage,
                        l,
                        &ids,
                        host_accepted.as_ref().expect("CPU: host counts"),
                        conv_state,
                    );
                }
            }
            Some(dev) => dev.commit(
                self.ctx.cuda().expect("CUDA"),
                &self.cfg,
                &self.storage,
                layers[0]..layers[layers.len() - 1] + 1,
                &ids,
                host_accepted.as_deref(),
                Some(accepted),
                conv_state,
                stream,
            )?,
        }
        for &id in ids.iter().filter(|&&i| i >= 0) {
            for &l in &layers {
                seqs[id as usize].as_mut().expect("live").pending[l] = 0;
            }
        }
        Ok(())
    }

    /// Writes each listed sequence's current state into its checkpoint and empties its
    /// ring (before saving a checkpoint or preempting); KV-only sequences get their state
    /// materialized. `layer` None = every layer.
    pub fn flush(&self, layer: Option<usize>, seq_ids: &TensorView, stream: Stream) -> Result<()> {
        let seqs = self.lock();
        let (ids, layers) = self.host_ids_and_layers(&seqs, layer, seq_ids, "flush")?;
        for &id in ids.iter().filter(|&&i| i >= 0) {
            for &l in &layers {
                if seqs[id as usize].as_ref().expect("live").pending[l] > 0 {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {id} has uncommitted drafts in layer {l}; commit first"
                    )));
                }
            }
        }
        for &l in &layers {
            match &self.device {
                None => super::gdn_cpu::flush(&self.cfg, &self.storage, l, &ids),
                Some(dev) => dev.flush(
                    self.ctx.cuda().expect("CUDA"),
                    &self.cfg,
                    &self.storage,
                    l,
                    &ids,
                    stream,
                )?,
            }
        }
        Ok(())
    }

    /// Memory per sequence of this pool.
    pub fn memory(&self) -> GdnMemory {
        self.cfg.memory()
    }

    /// The metadata record of (layer, seq) as the kernels left it (synchronizes on CUDA;
    /// for tests and diagnostics): mode, ring start, committed count, pending, conv end.
    pub fn debug_meta(&self, layer: usize, seq: i32) -> Result<[i32; META_INTS]> {
        let seqs = self.lock();
        let s = Self::live(&seqs, seq)?;
        self.check_layer(layer)?;
        let off = (layer * self.cfg.max_seqs + s) * META_INTS * 4;
        let mut m = [0i32; META_INTS];
        match &self.device {
            // SAFETY: the pool's own host metadata.
            None => unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.storage.meta + off) as *const i32,
                    m.as_mut_ptr(),
                    META_INTS,
                )
            },
            Some(dev) => dev.read_meta(
                self.ctx.cuda().expect("CUDA"),
                self.storage.meta + off,
                &mut m,
                Stream::DEFAULT,
            )?,
        }
        Ok(m)
    }
}
