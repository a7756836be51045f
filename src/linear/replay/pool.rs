//! The replay pool: sequence slots, pending drafts, and the checks of every operation
//! before its executor runs it (an error changes nothing).

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use super::config::{ReplayConfig, ReplayMemory};
use super::cpu::CpuExecutor;
use super::cuda::ReplayCuda;
use super::exec::{Commit, Executor, Family, Step};
use super::meta::{self, META_INTS};
use super::storage::{Layout, StateStorage, Storage};
use crate::backend::{Backend, BackendKind, Context, Stream};
use crate::error::{Error, Result};
use crate::linear::math::StateLayout;
use crate::pool::{check_float, check_layer, layer_range, read_host_i32, BatchIds, SlotTable};
use crate::tensor::{DType, MemoryKind, TensorView};

#[derive(Clone, Debug)]
struct SeqHost {
    /// Drafts verified and not yet committed, per layer.
    pending: Vec<u8>,
    /// Per layer: at least how many tokens the sequence has committed in KV-only mode
    /// (decodes count one each, commits with host counts their accepted drafts, device
    /// counts none), or `STATEFUL` once it surely has a state (import, flush, a step past
    /// the threshold). Only decides whether a step launches the KV-only kernel: the mode
    /// itself lives where the kernels run.
    kv_tokens: Vec<u32>,
}

/// `SeqHost::kv_tokens` of a sequence that surely keeps a state.
const STATEFUL: u32 = u32::MAX;

/// A replay pool of family `F`. Thread-safe; device work of one pool must be ordered on one
/// stream by the caller.
pub struct ReplayPool<F: Family> {
    ctx: Arc<Context>,
    cfg: ReplayConfig,
    storage: Storage,
    seqs: Mutex<SlotTable<SeqHost>>,
    exec: Box<dyn Executor>,
    _family: PhantomData<fn() -> F>,
}

impl<F: Family> ReplayPool<F> {
    /// Creates a pool; `external` gives per-layer state memory (None: owned).
    pub fn new(
        ctx: Arc<Context>,
        cfg: ReplayConfig,
        external: Option<Vec<StateStorage>>,
    ) -> Result<Self> {
        cfg.validate()?;
        let storage = Storage::new(&ctx, &cfg, external)?;
        let exec: Box<dyn Executor> = match ctx.handle() {
            Backend::Cpu(cpu) => Box::new(CpuExecutor::new(cpu, &storage.layout)),
            Backend::Cuda(cuda) => Box::new(ReplayCuda::new(cuda, &storage.layout)?),
        };
        Ok(ReplayPool {
            seqs: Mutex::new(SlotTable::new(cfg.max_seqs)),
            ctx,
            cfg,
            storage,
            exec,
            _family: PhantomData,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ReplayConfig {
        &self.cfg
    }
    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
    /// Where the pool's parts live.
    pub fn layout(&self) -> &Layout {
        &self.storage.layout
    }

    fn lock(&self) -> MutexGuard<'_, SlotTable<SeqHost>> {
        self.seqs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The host record of a new (or reset) sequence.
    fn new_host(&self) -> SeqHost {
        let kv = if meta::initial_mode(&self.cfg) == meta::MODE_KV_ONLY {
            0
        } else {
            STATEFUL
        };
        SeqHost {
            pending: vec![0; self.cfg.layers],
            kv_tokens: vec![kv; self.cfg.layers],
        }
    }

    /// Whether (sequence, layer) may still be in KV-only mode.
    fn may_be_kv_only(&self, s: &SeqHost, layer: usize) -> bool {
        s.kv_tokens[layer] as usize <= self.cfg.kv_only_threshold
    }

    /// The host count after `tokens` more committed tokens (`need` = what the step checked
    /// against the threshold: a step past it materialized the state).
    fn kv_after(&self, kv: u32, tokens: usize, need: usize) -> u32 {
        if kv == STATEFUL || kv as usize + need > self.cfg.kv_only_threshold {
            STATEFUL
        } else {
            kv + tokens as u32
        }
    }

    /// Adds a sequence (zero state, empty ring, zero conv window) and returns its id.
    pub fn seq_add(&self, stream: Stream) -> Result<i32> {
        let mut seqs = self.lock();
        let s = seqs.free_slot()?;
        self.exec.reset_slot(s, &meta::initial(&self.cfg), stream)?;
        seqs.fill(s, self.new_host());
        Ok(s as i32)
    }

    /// Frees a sequence.
    pub fn seq_free(&self, seq: i32, _stream: Stream) -> Result<()> {
        self.lock().remove(seq).map(|_| ())
    }

    /// Resets a sequence to the empty state (as if just added).
    pub fn seq_reset(&self, seq: i32, stream: Stream) -> Result<()> {
        let mut seqs = self.lock();
        let s = seqs.slot(seq)?;
        self.exec.reset_slot(s, &meta::initial(&self.cfg), stream)?;
        *seqs.get_mut(seq)? = self.new_host();
        Ok(())
    }

    fn check_state_tensor(&self, t: &TensorView, name: &str) -> Result<()> {
        self.check_state_tensor_in(t, name, &[])
    }

    /// A state tensor with leading dimensions `lead`.
    fn check_state_tensor_in(&self, t: &TensorView, name: &str, lead: &[usize]) -> Result<()> {
        let c = &self.cfg;
        let inner = match c.layout {
            StateLayout::KMajor => [c.v_heads, c.dk, c.dv],
            StateLayout::VMajor => [c.v_heads, c.dv, c.dk],
        };
        let want: Vec<usize> = lead.iter().chain(&inner).copied().collect();
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
        self.check_conv_tensor_in(t, name, &[])
    }

    /// A conv window tensor with leading dimensions `lead`.
    fn check_conv_tensor_in(&self, t: &TensorView, name: &str, lead: &[usize]) -> Result<()> {
        let want: Vec<usize> = lead
            .iter()
            .copied()
            .chain([self.cfg.conv_kernel - 1, self.cfg.conv_dim])
            .collect();
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

    /// Fails if sequence `id` has uncommitted drafts in `layer`.
    fn check_no_pending(seqs: &SlotTable<SeqHost>, id: i32, layer: usize) -> Result<()> {
        if seqs.get(id)?.pending[layer] > 0 {
            return Err(Error::InvalidArgument(format!(
                "sequence {id} has uncommitted drafts in layer {layer}; commit them first"
            )));
        }
        Ok(())
    }

    /// Checks an import or export: a live sequence without pending drafts in `layer`, a
    /// state tensor and an optional conv window of the right shapes. Returns the slot.
    fn check_state_io(
        &self,
        seqs: &SlotTable<SeqHost>,
        layer: usize,
        seq: i32,
        (state, state_name): (&TensorView, &str),
        conv: Option<(&TensorView, &str)>,
    ) -> Result<usize> {
        let s = seqs.slot(seq)?;
        check_layer(layer, self.cfg.layers)?;
        self.check_state_tensor(state, state_name)?;
        if let Some((c, name)) = conv {
            self.check_conv_tensor(c, name)?;
        }
        Self::check_no_pending(seqs, seq, layer)?;
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
        let mut seqs = self.lock();
        let conv = conv.map(|c| (c, "conv window"));
        let s = self.check_state_io(&seqs, layer, seq, (state, "state"), conv)?;
        self.exec
            .import_state(layer, s, state, conv.map(|c| c.0), stream)?;
        seqs.get_mut(seq)?.kv_tokens[layer] = STATEFUL;
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
        let conv = conv_out.map(|c| (c, "conv_out"));
        let s = self.check_state_io(&seqs, layer, seq, (out, "out"), conv)?;
        for (t, name) in std::iter::once((out, "out")).chain(conv) {
            if !t.is_non_overlapping() {
                return Err(Error::InvalidArgument(format!(
                    "{name} has overlapping elements (a stride of 0, or strides that make two \
                     elements share an address)"
                )));
            }
        }
        self.exec.export_state(layer, s, out, conv_out, stream)
    }

    /// Writes the state every layer of `seq` had `keep` tokens past its checkpoint (0 <=
    /// keep <= the layer's ring fill, the tokens buffered since its last flush) into `out`
    /// (`[layers, ...]`, the pool's layout, any float dtype) and, if given, the conv windows
    /// into `conv_out` (`[layers, conv_kernel - 1, conv_dim]`; only at the newest token,
    /// `keep` = fill: the window ring's older slots may hold rejected drafts). The pool does
    /// not change. Reads every layer's metadata first (on CUDA this synchronizes with the
    /// device, so it cannot be captured in a CUDA Graph).
    pub fn materialize(
        &self,
        seq: i32,
        keep: usize,
        out: &TensorView,
        conv_out: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let c = &self.cfg;
        let seqs = self.lock();
        let s = seqs.slot(seq)?;
        let layers = [c.layers];
        self.check_state_tensor_in(out, "out", &layers)?;
        if let Some(cw) = conv_out {
            self.check_conv_tensor_in(cw, "conv_out", &layers)?;
        }
        for (t, name) in std::iter::once((out, "out")).chain(conv_out.map(|c| (c, "conv_out"))) {
            if !t.is_non_overlapping() {
                return Err(Error::InvalidArgument(format!(
                    "{name} has overlapping elements"
                )));
            }
        }
        for l in 0..c.layers {
            Self::check_no_pending(&seqs, seq, l)?;
        }
        if self.ctx.backend() == BackendKind::Cuda {
            self.ctx.synchronize(stream)?;
        }
        for l in 0..c.layers {
            let fill = self.exec.read_meta(l, s)?[meta::META_H] as usize;
            if keep > fill {
                return Err(Error::OutOfRange(format!(
                    "keep {keep} exceeds the {fill} tokens layer {l} of sequence {seq} buffers \
                     past its checkpoint"
                )));
            }
            if conv_out.is_some() && keep != fill {
                return Err(Error::InvalidArgument(format!(
                    "conv_out is kept only at the newest token (keep = {fill} in layer {l}), \
                     not {} tokens back",
                    fill - keep
                )));
            }
        }
        self.exec.materialize(s, keep, out, conv_out, stream)
    }

    fn run_step(
        &self,
        layer: usize,
        io: &F::Io<'_>,
        opts: &F::Options,
        decode: bool,
        stream: Stream,
    ) -> Result<()> {
        let c = &self.cfg;
        let mut seqs = self.lock();
        check_layer(layer, c.layers)?;
        let ids = BatchIds::check(F::seq_ids(io), &seqs, self.ctx.backend())?;
        let b = F::seq_ids(io).shape()[0];
        let (plan, t) = F::plan(c, &self.ctx, io, opts, b, decode)?;
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
        // Every listed sequence must be free of uncommitted drafts in this layer.
        for id in ids.live() {
            Self::check_no_pending(&seqs, id, layer)?;
        }
        // Whether some row may be a sequence in KV-only mode (device ids may name any live
        // sequence), and the most entries the host counts for such a row.
        let (mut kv_only_rows, mut kv_only_entries) = (false, 0);
        let mut see = |s: &SeqHost| {
            if self.may_be_kv_only(s, layer) {
                kv_only_rows = true;
                kv_only_entries = kv_only_entries.max(s.kv_tokens[layer] as usize);
            }
        };
        match &ids {
            BatchIds::Host(_) => ids
                .live()
                .filter_map(|id| seqs.get(id).ok())
                .for_each(&mut see),
            BatchIds::Device(_) => seqs.iter().for_each(|(_, s)| see(s)),
        }
        let step = Step {
            layer,
            b,
            t,
            auto_commit: decode,
            kv_only_rows,
            kv_only_entries,
            ids: &ids,
            plan: &plan,
        };
        if b > 0 {
            self.exec.step(&step, stream)?;
        }
        // A decode commits its token; a verify commits nothing yet, but one past the
        // threshold materializes (whatever is accepted later).
        let (tokens, need) = if decode { (t, t) } else { (0, 2 * t) };
        for id in ids.live() {
            let s = seqs.get_mut(id)?;
            s.kv_tokens[layer] = self.kv_after(s.kv_tokens[layer], tokens, need);
            if !decode {
                s.pending[layer] = t as u8;
            }
        }
        Ok(())
    }

    /// One token per sequence: output from the checkpoint and the ring; the state is
    /// written only where a sequence's ring is full (flush, decided where the kernels
    /// run). The token is committed at once.
    pub fn decode(
        &self,
        layer: usize,
        io: &F::Io<'_>,
        opts: &F::Options,
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
        io: &F::Io<'_>,
        opts: &F::Options,
        stream: Stream,
    ) -> Result<()> {
        if F::seq_ids(io).memory() == MemoryKind::Cuda {
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
        seqs: &SlotTable<SeqHost>,
        layer: Option<usize>,
        seq_ids: &TensorView,
        what: &str,
    ) -> Result<(Vec<i32>, Range<usize>)> {
        let layers = layer_range(layer, self.cfg.layers)?;
        if seq_ids.memory() != MemoryKind::Host {
            return Err(Error::Unsupported(format!(
                "{what} takes seq_ids in host memory"
            )));
        }
        match BatchIds::check(seq_ids, seqs, self.ctx.backend())? {
            BatchIds::Host(ids) => Ok((ids, layers)),
            BatchIds::Device(_) => unreachable!("host memory was checked"),
        }
    }

    /// Commits `accepted[i]` of the pending drafts of `seq_ids[i]` (for `layer`, or every
    /// layer with None): accepted entries stay in the ring, the rest vanish; recurrent
    /// pools adopt the accepted draft's snapshot. `accepted` is i32 `[B]` in host or device
    /// memory (device counts are clamped to 0..=pending where the kernels run; the host
    /// never synchronizes). With `conv_state` (`[B, conv_kernel-1, conv_dim]`), the conv
    /// window of the accepted prefix is written there.
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
        if accepted.dtype() != DType::I32 {
            return Err(Error::DTypeMismatch(format!(
                "accepted must be an i32 tensor, not {}",
                accepted.dtype()
            )));
        }
        if accepted.shape() != [b] {
            return Err(Error::InvalidArgument(format!(
                "accepted has shape {:?}; expected [{b}] (one count per seq_ids row)",
                accepted.shape()
            )));
        }
        for &id in ids.iter().filter(|&&i| i >= 0) {
            for l in layers.clone() {
                if seqs.get(id)?.pending[l] == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {id} has no verified drafts to commit in layer {l}"
                    )));
                }
            }
        }
        let host_accepted = match accepted.memory() {
            MemoryKind::Host => {
                let a = read_host_i32(accepted, b);
                for (i, &id) in ids.iter().enumerate() {
                    if id < 0 {
                        continue;
                    }
                    // Every layer committed must hold that many drafts (layers can have
                    // verified different T).
                    let pending = &seqs.get(id)?.pending;
                    for l in layers.clone() {
                        let p = pending[l] as i32;
                        if a[i] < 0 || a[i] > p {
                            return Err(Error::OutOfRange(format!(
                                "accepted[{i}] = {} but sequence {id} has {p} verified drafts \
                                 in layer {l}",
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
            if cs.shape() != want {
                return Err(Error::InvalidArgument(format!(
                    "conv_state has shape {:?}; expected {want:?}",
                    cs.shape()
                )));
            }
            check_float(cs, "conv_state")?;
            cs.expect_memory(self.ctx.memory(), "conv_state")?;
            if layer.is_none() {
                return Err(Error::InvalidArgument(
                    "conv_state is per layer: commit one layer at a time (not KVR_LAYER_ALL) \
                     to receive it"
                        .into(),
                ));
            }
            if !cs.is_non_overlapping() {
                return Err(Error::InvalidArgument(
                    "conv_state has overlapping elements".into(),
                ));
            }
        }
        let commit = Commit {
            layers: layers.clone(),
            ids: &ids,
            host_accepted: host_accepted.as_deref(),
            accepted,
            conv_state,
        };
        self.exec.commit(&commit, stream)?;
        for (i, &id) in ids.iter().enumerate().filter(|&(_, &i)| i >= 0) {
            // Device counts add nothing to the host's lower bound.
            let acc = host_accepted.as_ref().map_or(0, |a| a[i] as usize);
            for l in layers.clone() {
                let s = seqs.get_mut(id)?;
                s.pending[l] = 0;
                s.kv_tokens[l] = self.kv_after(s.kv_tokens[l], acc, acc);
            }
        }
        Ok(())
    }

    /// Writes each listed sequence's current state into its checkpoint and empties its
    /// ring (before saving a checkpoint or preempting); KV-only sequences get their state
    /// materialized. `layer` None = every layer.
    pub fn flush(&self, layer: Option<usize>, seq_ids: &TensorView, stream: Stream) -> Result<()> {
        let mut seqs = self.lock();
        let (ids, layers) = self.host_ids_and_layers(&seqs, layer, seq_ids, "flush")?;
        for &id in ids.iter().filter(|&&i| i >= 0) {
            for l in layers.clone() {
                Self::check_no_pending(&seqs, id, l)?;
            }
        }
        for l in layers.clone() {
            self.exec.flush(l, &ids, stream)?;
        }
        for &id in ids.iter().filter(|&&i| i >= 0) {
            let s = seqs.get_mut(id)?;
            layers.clone().for_each(|l| s.kv_tokens[l] = STATEFUL);
        }
        Ok(())
    }

    /// Memory per sequence of this pool.
    pub fn memory(&self) -> ReplayMemory {
        self.cfg.memory()
    }

    /// The metadata record of (layer, seq) as the kernels left it (synchronizes on CUDA;
    /// for the cursor, tests and diagnostics): mode, ring start, committed count, pending,
    /// conv end.
    pub fn debug_meta(&self, layer: usize, seq: i32) -> Result<[i32; META_INTS]> {
        let seqs = self.lock();
        let s = seqs.slot(seq)?;
        check_layer(layer, self.cfg.layers)?;
        self.exec.read_meta(layer, s)
    }
}
