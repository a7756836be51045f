//! Write-gated KV admission (WG-KV, arXiv 2512.17452) as a mode of the paged pool.
//!
//! # Model
//!
//! Every (sequence, layer, KV head) -- a *row* -- keeps a local ring of the last
//! `local_window` (W) tokens and a global cache that only grows. When a token is appended
//! to a full ring, the ring's oldest token is *promoted* to the global cache if its gate
//! score is `> tau` (strict, as in the reference code) or it is one of the sequence's first
//! `sinks` tokens, and dropped otherwise; the new token takes its slot. A prefill (many
//! tokens in one append) is the same rule applied token by token: tokens older than the
//! last W are admitted or dropped at once, the last W wait in the ring. Attention for a row
//! reads ring + global (+ pending drafts).
//!
//! # Layout: a mode of [`KvPool`]
//!
//! The rows live in one ordinary [`KvPool`] (its allocator, block tables, CPU and CUDA
//! decode) configured with one layer and one KV head: a pool page holds `page_size` tokens
//! of one (layer, head) of one sequence, and row `(seq, layer, head)` is the inner sequence
//! `seq * layers * kv_heads + layer * kv_heads + head`, with its own block table (so heads
//! are ragged). A row's inner positions are `[0, W)` for the ring (pages allocated as the
//! ring fills; ring order is not time order, which decode does not care about) and
//! `[W, W + global)` for the global cache (promotion order), then the pending drafts.
//! Decode of one layer folds (sequence, KV head) into the inner batch (`hkv = 1`, GQA group
//! g): the query heads of a group read their KV head's row, with per-row lengths.
//!
//! # Speculative drafts and how far rollback goes
//!
//! Draft tokens (`append(.., draft = true)`, at most 8 per row) are not put in the ring:
//! they sit after the global cache, so decode with T query tokens sees the committed ring +
//! global + the drafts causally, and nothing is evicted or promoted for them.
//! `commit(seq, n)` accepts the first n drafts (moving them into the ring, evicting and
//! promoting exactly as a committed append would) and drops the rest; `truncate` can go back
//! to any length between the committed length and the committed length plus the drafts.
//! Committed tokens cannot be rolled back (a dropped token's K/V is gone). While drafts are
//! pending, a draft's attention also sees the up to T oldest ring tokens that committing it
//! would evict (the sequential decode would not, unless they are admitted).
//!
//! Forks share every page (copy-on-write): ring slots are rewritten in place, so a shared
//! ring page is copied before a write into it.

mod cuda;
pub mod gate;

use std::sync::{Arc, Mutex, MutexGuard};

pub use gate::{gate_tensor_names, GateLayer, GateWeights, GATE_FLOOR, GATE_NORM_EPS};

use super::config::{KvPoolConfig, SeqId};
use super::decode::{self, DecodeIo, DecodeOptions, MAX_QUERY_TOKENS};
use super::pool::{KvPool, KvStorage};
use super::state::{PoolState, SeqState};
use crate::backend::cpu::element::Element;
use crate::backend::{Backend, Context, Stream};
use crate::error::{Error, Result};
use crate::pool::{as_batch_3d, as_batch_4d, read_host_i32, SlotTable};
use crate::tensor::{DType, MemoryKind, TensorView};

/// Most pending draft tokens per row.
pub const MAX_DRAFTS: usize = MAX_QUERY_TOKENS;

/// Largest ring (the device step's codes hold a slot in 20 bits).
pub const MAX_LOCAL_WINDOW: usize = 1 << 19;

/// Most device steps one reservation covers.
pub const MAX_RESERVE_STEPS: usize = 1 << 16;

/// Shape, capacity and admission policy of a write-gated pool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WgKvConfig {
    /// Attention layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per page (one page holds one (layer, head) of one sequence).
    pub page_size: usize,
    /// Element type of K and V.
    pub dtype: DType,
    /// Pages in the pool.
    pub capacity_pages: usize,
    /// Sequence slots.
    pub max_seqs: usize,
    /// Most tokens one row's global cache may hold (sets the block-table width).
    pub max_global_tokens: usize,
    /// Ring size W per row (a multiple of `page_size`, >= 8, <= [`MAX_LOCAL_WINDOW`];
    /// reference default 256).
    pub local_window: usize,
    /// Promotion threshold: a token is admitted if its score is > tau (default 0.1).
    pub tau: f32,
    /// The first `sinks` tokens of each sequence are always admitted (default 0).
    pub sinks: usize,
}

impl WgKvConfig {
    /// Bytes of K plus V of one page (one layer, one head).
    pub fn page_bytes(&self) -> usize {
        2 * self.page_size * self.head_dim * self.dtype.size()
    }
    /// Rows per sequence (layers x KV heads).
    pub fn rows_per_seq(&self) -> usize {
        self.layers * self.kv_heads
    }

    /// Pages one sequence holds (all its rows; `capacity_pages` is not looked at) after
    /// `context` committed tokens of which a fraction `admit` of those that left the ring,
    /// beyond the sinks, were admitted (rounded up per row), with `drafts` pending: per row
    /// the ring (`min(context, W)` tokens; the whole window once a token is in the global
    /// cache), the global cache (sinks + admitted) and the drafts, in whole pages. This is
    /// what the pool's own accounting holds for such a sequence (a fork shares them until
    /// a write copies a shared page). Sizing a pool: `max_seqs` times this at the longest
    /// context and the highest admission rate expected; `admit` 1 gives the bound.
    ///
    /// Errors: `InvalidArgument` for a configuration the pool would refuse or `admit`
    /// outside [0, 1]; `OutOfRange` for more than [`MAX_DRAFTS`] drafts, a global cache past
    /// `max_global_tokens` (appends would fail) or a count that overflows.
    pub fn pages_per_seq(&self, context: usize, admit: f64, drafts: usize) -> Result<usize> {
        self.inner()?;
        if !(0.0..=1.0).contains(&admit) {
            return Err(Error::InvalidArgument(format!(
                "admit {admit} must be in [0, 1]"
            )));
        }
        if drafts > MAX_DRAFTS {
            return Err(Error::OutOfRange(format!(
                "{drafts} drafts; at most {MAX_DRAFTS}"
            )));
        }
        let w = self.local_window;
        let fill = context.min(w);
        let older = context - fill;
        let sinks = older.min(self.sinks);
        let global = sinks + ((older - sinks) as f64 * admit).ceil() as usize;
        if global > self.max_global_tokens {
            return Err(Error::OutOfRange(format!(
                "{global} global tokens per row at context {context}; max_global_tokens is {}",
                self.max_global_tokens
            )));
        }
        let mut row = Row::new(w);
        row.fill = fill;
        row.global = global;
        let len = row.committed_len(w) + drafts;
        len.div_ceil(self.page_size)
            .checked_mul(self.rows_per_seq())
            .ok_or_else(|| Error::OutOfRange("the page count overflows".into()))
    }

    fn inner(&self) -> Result<KvPoolConfig> {
        if self.page_size == 0 || self.local_window == 0 {
            return Err(Error::InvalidArgument(
                "page_size and local_window must be >= 1".into(),
            ));
        }
        if self.local_window % self.page_size != 0
            || self.local_window < MAX_DRAFTS
            || self.local_window > MAX_LOCAL_WINDOW
        {
            return Err(Error::InvalidArgument(format!(
                "local_window {} must be a multiple of page_size {}, at least {MAX_DRAFTS} and \
                 at most {MAX_LOCAL_WINDOW}",
                self.local_window, self.page_size
            )));
        }
        if !self.tau.is_finite() || !(0.0..1.0).contains(&self.tau) {
            return Err(Error::InvalidArgument(format!(
                "tau {} must be in [0, 1)",
                self.tau
            )));
        }
        let rows = self
            .max_seqs
            .checked_mul(self.rows_per_seq())
            .filter(|&r| r < 1 << 20)
            .ok_or_else(|| {
                Error::OutOfRange(format!(
                    "max_seqs x layers x kv_heads ({} x {} x {}) must stay below 2^20",
                    self.max_seqs, self.layers, self.kv_heads
                ))
            })?;
        let len = self
            .local_window
            .checked_add(self.max_global_tokens)
            .and_then(|n| n.checked_add(MAX_DRAFTS))
            .ok_or_else(|| Error::OutOfRange("max_global_tokens is too large".into()))?;
        let c = KvPoolConfig {
            layers: 1,
            kv_heads: 1,
            head_dim: self.head_dim,
            page_size: self.page_size,
            dtype: self.dtype,
            capacity_pages: self.capacity_pages,
            max_seqs: rows,
            max_seq_len: len,
        };
        if self.layers == 0 || self.kv_heads == 0 || self.max_seqs == 0 {
            return Err(Error::InvalidArgument(
                "layers, kv_heads and max_seqs must be >= 1".into(),
            ));
        }
        Ok(c)
    }
}

/// One row's admission state (host).
#[derive(Clone, Debug)]
struct Row {
    /// Tokens in the ring (<= W).
    fill: usize,
    /// Ring slot of the oldest token once the ring is full.
    ptr: usize,
    /// Tokens in the global cache.
    global: usize,
    /// Committed tokens appended to the row.
    total: usize,
    /// Scores of the pending drafts.
    drafts: Vec<f32>,
    /// Per ring slot: promote on eviction.
    admit: Vec<bool>,
    /// Device steps the last reservation still allows (zero after any other operation).
    budget: usize,
    /// The row's state lives on the device (a CUDA pool's reserved sequence): the host
    /// mirror is read back before every host operation.
    driven: bool,
}

impl Row {
    fn new(w: usize) -> Row {
        Row {
            fill: 0,
            ptr: 0,
            global: 0,
            total: 0,
            drafts: Vec::new(),
            admit: vec![false; w],
            budget: 0,
            driven: false,
        }
    }
    /// Inner length of the committed tokens.
    fn committed_len(&self, w: usize) -> usize {
        if self.global == 0 {
            self.fill
        } else {
            w + self.global
        }
    }
}

/// Where the tokens of an append (or commit) go.
struct Placement {
    /// (ring slot, global position): promotions of tokens already in the ring.
    promote_old: Vec<(usize, usize)>,
    /// (new token, inner position): ring slots and direct promotions.
    place_new: Vec<(usize, usize)>,
    /// The row afterwards (drafts untouched).
    after: Row,
}

/// Per-row counts of [`WgKvPool::seq_rows`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WgRowStats {
    /// Tokens in the ring.
    pub ring: usize,
    /// Tokens in the global cache.
    pub global: usize,
    /// Pending drafts.
    pub drafts: usize,
    /// Committed tokens appended.
    pub total: usize,
}

/// Occupancy of a write-gated pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WgKvStats {
    /// Pages in the pool.
    pub pages_total: usize,
    /// Pages referenced by at least one row.
    pub pages_used: usize,
    /// Pages free.
    pub pages_free: usize,
    /// Pages referenced by more than one row (forks).
    pub pages_shared: usize,
    /// Live sequences.
    pub sequences: usize,
    /// Tokens attention reads, summed over rows (ring + global + drafts).
    pub kept_tokens: usize,
    /// Tokens a full cache would hold, summed over rows (committed + drafts).
    pub full_tokens: usize,
    /// Pages a full paged cache of the same page size would use for the live sequences.
    pub full_pages: usize,
    /// Bytes of K and V per page.
    pub page_bytes: usize,
}

/// One device-side decode step's inputs ([`WgKvPool::step`], [`WgKvPool::step_decode`]):
/// one committed token for each sequence of `seqs` in layer `layer`, K/V `[B, kv_heads,
/// head_dim]`, and exactly one of `k_pre` (the pool's gate scores the token) and `scores`
/// (f32 `[B, kv_heads]`); `scores_out` receives the scores used.
#[derive(Clone, Copy)]
pub struct WgStep<'a> {
    pub layer: usize,
    pub seqs: &'a [i32],
    pub k_pre: Option<&'a TensorView>,
    pub k: &'a TensorView,
    pub v: &'a TensorView,
    pub scores: Option<&'a TensorView>,
    pub scores_out: Option<&'a TensorView>,
}

/// A paged KV pool in write-gated mode. Thread-safe (calls serialize on its lock); device
/// work must be stream-ordered by the caller, as for [`KvPool`].
pub struct WgKvPool {
    cfg: WgKvConfig,
    inner: KvPool,
    rows: Mutex<SlotTable<Vec<Row>>>,
    gate: Mutex<Option<Arc<GateWeights>>>,
    /// The CUDA row copies (None on the CPU).
    cuda: Option<cuda::WgCuda>,
}

/// Where scattered rows come from: K and V base addresses (the context's memory), their
/// dtype, and the element stride along head_dim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowSource {
    k: usize,
    v: usize,
    dtype: DType,
    k_ds: isize,
    v_ds: isize,
}

/// One copied row: (K element offset, V element offset) from the source, destination
/// (page, slot).
pub(crate) type Pair = (i64, i64, u32, u32);

impl WgKvPool {
    /// Creates a write-gated pool on `ctx` (memory owned by the pool, zeroed).
    pub fn new(ctx: Arc<Context>, cfg: WgKvConfig) -> Result<WgKvPool> {
        let inner_cfg = cfg.inner()?;
        let inner = KvPool::new(ctx, inner_cfg, KvStorage::Owned)?;
        let cuda = match inner.context().handle() {
            Backend::Cpu(_) => None,
            Backend::Cuda(c) => Some(cuda::WgCuda::new(
                c,
                &cfg,
                *inner.layer_layout(0).expect("one layer"),
                inner.exec.device_tables().ok_or_else(|| {
                    Error::Unsupported("the CUDA pool exposes no device tables".into())
                })?,
                inner_cfg.pages_per_seq(),
            )?),
        };
        Ok(WgKvPool {
            cfg,
            inner,
            rows: Mutex::new(SlotTable::new(cfg.max_seqs)),
            gate: Mutex::new(None),
            cuda,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &WgKvConfig {
        &self.cfg
    }
    /// The underlying one-layer, one-head paged pool (its rows are this pool's rows).
    pub fn inner(&self) -> &KvPool {
        &self.inner
    }
    /// The inner sequence of row (seq, layer, head).
    pub fn row_id(&self, seq: SeqId, layer: usize, head: usize) -> SeqId {
        (seq as usize * self.cfg.rows_per_seq() + layer * self.cfg.kv_heads + head) as SeqId
    }

    fn lock_rows(&self) -> MutexGuard<'_, SlotTable<Vec<Row>>> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets (or with `None` clears) the gate used by [`Self::append_gated`]; its layers,
    /// heads and head dim must match the pool.
    pub fn set_gate(&self, gate: Option<GateWeights>) -> Result<()> {
        if let Some(g) = &gate {
            if g.layers.len() != self.cfg.layers
                || g.kv_heads != self.cfg.kv_heads
                || g.head_dim != self.cfg.head_dim
            {
                return Err(Error::InvalidArgument(format!(
                    "the gate has {} layers x {} heads x dim {}; the pool {} x {} x {}",
                    g.layers.len(),
                    g.kv_heads,
                    g.head_dim,
                    self.cfg.layers,
                    self.cfg.kv_heads,
                    self.cfg.head_dim
                )));
            }
        }
        if let Some(c) = &self.cuda {
            // Rows may still queue inputs of the old gate (a deferred gate): score them
            // with it first.
            let mut rows = self.lock_rows();
            let mut st = self.inner.lock();
            self.sync_all(&mut rows, &mut st)?;
            c.set_gate(gate.as_ref())?;
        }
        *self.gate.lock().unwrap_or_else(|e| e.into_inner()) = gate.map(Arc::new);
        Ok(())
    }

    /// Adds an empty sequence (the lowest free id).
    pub fn seq_add(&self, stream: Stream) -> Result<SeqId> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        let seq = rows.free_slot()?;
        for r in 0..self.cfg.rows_per_seq() {
            let slot = seq * self.cfg.rows_per_seq() + r;
            st.seqs.fill(
                slot,
                SeqState {
                    pages: Vec::new(),
                    len: 0,
                },
            );
            st.set_len(slot, 0);
        }
        rows.fill(
            seq,
            vec![Row::new(self.cfg.local_window); self.cfg.rows_per_seq()],
        );
        self.inner.flush(&mut st, stream)?;
        Ok(seq as SeqId)
    }

    /// Frees a sequence and releases its pages.
    pub fn seq_free(&self, seq: SeqId, stream: Stream) -> Result<()> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        let mut gone = rows.remove(seq)?;
        if gone.first().is_some_and(|r| r.driven) {
            // No budget may outlive the sequence in its slot.
            let w = self.cfg.local_window;
            for r in &mut gone {
                *r = Row::new(w);
            }
            self.push_seq(&gone, seq as usize * self.cfg.rows_per_seq(), stream)?;
        }
        for r in 0..self.cfg.rows_per_seq() {
            let slot = seq as usize * self.cfg.rows_per_seq() + r;
            let s = st.seqs.remove(slot as i32)?;
            for p in s.pages {
                st.alloc.release(p);
            }
            st.set_len(slot, 0);
        }
        self.inner.flush(&mut st, stream)
    }

    /// A new sequence sharing all of `src`'s pages and state (copy-on-write).
    pub fn seq_fork(&self, src: SeqId, stream: Stream) -> Result<SeqId> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, src, Some(stream))?;
        let mut parent = rows.get(src)?.clone();
        let seq = rows.free_slot()?;
        let n = self.cfg.rows_per_seq();
        for r in 0..n {
            let from = src as usize * n + r;
            let to = seq * n + r;
            let s = st.seq(from).clone();
            for (i, &p) in s.pages.iter().enumerate() {
                st.alloc.retain(p);
                st.set_table(to, i, p);
            }
            st.set_len(to, s.len);
            st.seqs.fill(to, s);
        }
        for r in &mut parent {
            r.budget = 0;
            r.driven = false;
        }
        rows.fill(seq, parent);
        self.inner.flush(&mut st, stream)?;
        // The parent's pages are shared now: its reservation ends.
        self.end_reservation(&mut rows, src, stream)?;
        Ok(seq as SeqId)
    }

    /// Per row (layer-major, then head) counts of a sequence.
    pub fn seq_rows(&self, seq: SeqId) -> Result<Vec<WgRowStats>> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, seq, None)?;
        Ok(rows
            .get(seq)?
            .iter()
            .map(|r| WgRowStats {
                ring: r.fill,
                global: r.global,
                drafts: r.drafts.len(),
                total: r.total,
            })
            .collect())
    }

    /// Committed tokens of a sequence (layer 0, head 0) plus its pending drafts.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, seq, None)?;
        let r = &rows.get(seq)?[0];
        Ok(r.total + r.drafts.len())
    }

    /// Brings the host mirror of a device-driven sequence (see [`Self::reserve`]) up to date:
    /// waits for `stream` (every stream of the context for None) and reads its rows' state
    /// and lengths, after scoring the tokens its rows still queue (a deferred gate). Device
    /// steps that found no reservation are reported here, once.
    fn sync_seq(
        &self,
        rows: &mut SlotTable<Vec<Row>>,
        st: &mut PoolState,
        seq: SeqId,
        stream: Option<Stream>,
    ) -> Result<()> {
        let rs = rows.get_mut(seq)?;
        let Some(c) = self.cuda.as_ref().filter(|_| rs[0].driven) else {
            return Ok(());
        };
        let (w, nr, h) = (self.cfg.local_window, rs.len(), self.cfg.kv_heads);
        let base = seq as usize * nr;
        let (mut words, mut bits) = c.pull_rows(base, nr, stream)?;
        // Row state word 6: tokens queued for a deferred gate; their bits come first.
        let due: Vec<usize> = (0..self.cfg.layers)
            .filter(|&l| words[l * h..(l + 1) * h].iter().any(|x| x[6] > 0))
            .collect();
        if !due.is_empty() {
            for l in due {
                c.flush(l, &[seq], stream.unwrap_or(Stream::DEFAULT))?;
            }
            (words, bits) = c.pull_rows(base, nr, stream)?;
        }
        let wpr = c.admit_words();
        let mut dropped = 0usize;
        for (r, row) in rs.iter_mut().enumerate() {
            let x = words[r];
            let at = |i: usize| x[i].max(0) as usize;
            (row.fill, row.ptr, row.global, row.total, row.budget) =
                (at(0), at(1), at(2), at(3), at(4));
            dropped += at(5);
            for (s, a) in row.admit.iter_mut().enumerate() {
                *a = (bits[r * wpr + s / 32] >> (s % 32)) & 1 == 1;
            }
            let len = row.committed_len(w) + row.drafts.len();
            st.seq_mut(base + r).len = len;
            st.lens[base + r] = len as i32;
        }
        if dropped > 0 {
            self.push_seq(rs, base, stream.unwrap_or(Stream::DEFAULT))?;
            return Err(Error::PoolExhausted(format!(
                "{dropped} device steps on rows of sequence {seq} found no reservation \
                 (reserve before stepping) and were skipped: those tokens are not in the pool"
            )));
        }
        Ok(())
    }

    /// [`Self::sync_seq`] for every device-driven sequence (waits for every stream).
    fn sync_all(&self, rows: &mut SlotTable<Vec<Row>>, st: &mut PoolState) -> Result<()> {
        let driven: Vec<SeqId> = rows
            .iter()
            .filter(|(_, rs)| rs[0].driven)
            .map(|(id, _)| id)
            .collect();
        for seq in driven {
            self.sync_seq(rows, st, seq, None)?;
        }
        Ok(())
    }

    /// Queues the upload of a sequence's rows (state, budget, admission bits) to the
    /// device step's state, whose rows start at `base` (nothing on the CPU).
    fn push_seq(&self, rs: &[Row], base: usize, stream: Stream) -> Result<()> {
        let Some(c) = &self.cuda else {
            return Ok(());
        };
        let wpr = c.admit_words();
        let words: Vec<cuda::RowWords> = rs
            .iter()
            .map(|r| {
                let i = |x: usize| x.min(i32::MAX as usize) as i32;
                [
                    i(r.fill),
                    i(r.ptr),
                    i(r.global),
                    i(r.total),
                    i(r.budget),
                    0,
                    0,
                    0,
                ]
            })
            .collect();
        let mut bits = vec![0u32; rs.len() * wpr];
        for (i, r) in rs.iter().enumerate() {
            for (s, _) in r.admit.iter().enumerate().filter(|x| *x.1) {
                bits[i * wpr + s / 32] |= 1 << (s % 32);
            }
        }
        c.push_rows(base, &words, &bits, stream)
    }

    /// Ends a sequence's reservation after a host operation changed it: the budget drops
    /// to zero, and a device-driven sequence's new state goes to the device.
    fn end_reservation(
        &self,
        rows: &mut SlotTable<Vec<Row>>,
        seq: SeqId,
        stream: Stream,
    ) -> Result<()> {
        let rs = rows.get_mut(seq)?;
        for r in rs.iter_mut() {
            r.budget = 0;
        }
        if rs[0].driven {
            self.push_seq(rs, seq as usize * self.cfg.rows_per_seq(), stream)?;
        }
        Ok(())
    }

    /// Simulates appending tokens with `scores` to `row` (committed tokens).
    fn simulate(&self, row: &Row, scores: &[f32]) -> Placement {
        let w = self.cfg.local_window;
        let mut r = row.clone();
        r.drafts.clear();
        let mut occupant: Vec<Option<usize>> = vec![None; w];
        let mut promote_old = Vec::new();
        let mut place_new = Vec::new();
        for (j, &s) in scores.iter().enumerate() {
            let admitted = r.total < self.cfg.sinks || s > self.cfg.tau;
            let slot = if r.fill < w {
                r.fill += 1;
                r.fill - 1
            } else {
                let slot = r.ptr;
                r.ptr = (r.ptr + 1) % w;
                if r.admit[slot] {
                    let gpos = w + r.global;
                    r.global += 1;
                    match occupant[slot] {
                        None => promote_old.push((slot, gpos)),
                        Some(j0) => place_new.push((j0, gpos)),
                    }
                }
                slot
            };
            occupant[slot] = Some(j);
            r.admit[slot] = admitted;
            r.total += 1;
        }
        for (slot, o) in occupant.iter().enumerate() {
            if let Some(j) = o {
                place_new.push((*j, slot));
            }
        }
        Placement {
            promote_old,
            place_new,
            after: r,
        }
    }

    /// The pool's own memory as a row source.
    fn pool_source(&self) -> RowSource {
        let lay = self.inner.layer_layout(0).expect("one layer");
        RowSource {
            k: lay.k,
            v: lay.v,
            dtype: self.cfg.dtype,
            k_ds: 1,
            v_ds: 1,
        }
    }

    /// Source offsets (K, V) of the row at `(page, slot)` of the pool.
    fn pool_offsets(&self, (page, slot): (u32, u32)) -> (i64, i64) {
        let lay = self.inner.layer_layout(0).expect("one layer");
        let at = |[sp, _, st]: [usize; 3]| (page as usize * sp + slot as usize * st) as i64;
        (at(lay.k_strides), at(lay.v_strides))
    }

    /// Copies rows into the pool (CPU now, or queued on CUDA).
    fn scatter(&self, src: &RowSource, pairs: &[Pair], stream: Stream) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        if let Some(c) = &self.cuda {
            return c.scatter(src, pairs, stream);
        }
        let lay = self.inner.layer_layout(0).expect("one layer");
        let d = self.cfg.head_dim;
        crate::with_element!(self.cfg.dtype, E => {
            for (base, [sp, _, st], src_base, ds, is_v) in [
                (lay.k, lay.k_strides, src.k, src.k_ds, false),
                (lay.v, lay.v_strides, src.v, src.v_ds, true),
            ] {
                for &(ko, vo, page, slot) in pairs {
                    let off = if is_v { vo } else { ko };
                    let dst = (base as *mut E).wrapping_add(page as usize * sp + slot as usize * st);
                    crate::with_element!(src.dtype, S => {
                        let p0 = (src_base as *const S).wrapping_offset(off as isize);
                        for i in 0..d {
                            // SAFETY: offsets were computed from checked views (or the
                            // pool's layout) and destinations lie in the pool; no
                            // destination row is a source row of the same call.
                            unsafe {
                                let x = p0.offset(i as isize * ds).read();
                                dst.add(i).write(E::from_f32(x.to_f32()));
                            }
                        }
                    });
                }
            }
        });
        Ok(())
    }

    /// (page, slot) of inner position `pos` of `slot`.
    fn dest(&self, st: &PoolState, slot: usize, pos: usize) -> (u32, u32) {
        let ps = self.cfg.page_size;
        (st.seq(slot).pages[pos / ps], (pos % ps) as u32)
    }

    /// Pages a row needs to write `positions` and grow to `new_len` from `keep` tokens:
    /// shared pages it writes into (copied first) plus new pages.
    fn pages_for(
        &self,
        st: &PoolState,
        slot: usize,
        keep: usize,
        new_len: usize,
        positions: &[usize],
    ) -> usize {
        let ps = self.cfg.page_size;
        let s = st.seq(slot);
        let kept_pages = keep.div_ceil(ps).min(s.pages.len());
        let mut touched: Vec<usize> = positions
            .iter()
            .map(|p| p / ps)
            .filter(|&i| i < kept_pages)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        let shared = touched
            .iter()
            .filter(|&&i| st.alloc.refcount(s.pages[i]) > 1)
            .count();
        shared + new_len.div_ceil(ps).saturating_sub(kept_pages)
    }

    /// Makes the pages of `positions` private and grows `slot` from its length to
    /// `new_len` (host; pages counted by the caller).
    fn grow_row(&self, st: &mut PoolState, slot: usize, new_len: usize, positions: &[usize]) {
        self.provide_pages(st, slot, new_len, positions);
        st.seq_mut(slot).len = new_len;
        st.set_len(slot, new_len);
    }

    /// Makes the pages of `positions` private and gives `slot` pages up to `new_len`
    /// tokens, its length unchanged (pages counted by the caller).
    fn provide_pages(&self, st: &mut PoolState, slot: usize, new_len: usize, positions: &[usize]) {
        let ps = self.cfg.page_size;
        let npages = st.seq(slot).pages.len();
        let mut touched: Vec<usize> = positions
            .iter()
            .map(|p| p / ps)
            .filter(|&i| i < npages)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        for i in touched {
            self.inner.make_page_private(st, slot, i);
        }
        let add = new_len.div_ceil(ps).saturating_sub(npages);
        let fresh = st.alloc.alloc_n(add).expect("counted");
        for (j, &p) in fresh.iter().enumerate() {
            st.set_table(slot, npages + j, p);
        }
        st.seq_mut(slot).pages.extend_from_slice(&fresh);
    }

    /// Checks K/V (and optional k_pre) of an append: `[n, kv_heads, head_dim]` for one
    /// layer, `[layers, n, kv_heads, head_dim]` for all; returns (layers, n).
    fn check_tokens(
        &self,
        layer: Option<usize>,
        ts: &[(&str, &TensorView)],
    ) -> Result<(std::ops::Range<usize>, usize)> {
        let layers = crate::pool::layer_range(layer, self.cfg.layers)?;
        let k = ts[0].1;
        let n = match (layer, k.ndim()) {
            (Some(_), 3) => k.shape()[0],
            (None, 4) => k.shape()[1],
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "k has {} dimensions; expected [n, kv_heads, head_dim] for one layer or \
                     [layers, n, kv_heads, head_dim] for all",
                    k.ndim()
                )))
            }
        };
        let (h, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let want: Vec<usize> = match layer {
            Some(_) => vec![n, h, d],
            None => vec![self.cfg.layers, n, h, d],
        };
        let backend = self.inner.context().backend();
        for &(name, t) in ts {
            if t.shape() != want.as_slice() {
                return Err(Error::InvalidArgument(format!(
                    "{name} has shape {:?}; expected {want:?}",
                    t.shape()
                )));
            }
            crate::pool::check_float(t, name)?;
            if backend == crate::backend::BackendKind::Cpu && t.memory() == MemoryKind::Cuda {
                return Err(Error::InvalidArgument(format!(
                    "{name} is in CUDA memory but the pool is on the CPU"
                )));
            }
        }
        Ok((layers, n))
    }

    /// Appends `n` tokens to `seq` for one layer (`Some(l)`, K/V `[n, kv_heads,
    /// head_dim]`, scores `[n][kv_heads]`) or all layers (`None`, K/V `[layers, n,
    /// kv_heads, head_dim]`, scores `[layers][n][kv_heads]`). Committed tokens
    /// (`draft = false`) go through the ring (promoting or dropping what they evict);
    /// drafts wait after the global cache until [`Self::commit`]. All or nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn append(
        &self,
        seq: SeqId,
        layer: Option<usize>,
        k: &TensorView,
        v: &TensorView,
        scores: &[f32],
        draft: bool,
        stream: Stream,
    ) -> Result<()> {
        let (layers, n) = self.check_tokens(layer, &[("k", k), ("v", v)])?;
        let h = self.cfg.kv_heads;
        if scores.len() != layers.len() * n * h {
            return Err(Error::InvalidArgument(format!(
                "{} scores given; expected {} ([layers,] n, kv_heads)",
                scores.len(),
                layers.len() * n * h
            )));
        }
        if let Some(s) = scores.iter().find(|s| !s.is_finite()) {
            return Err(Error::InvalidArgument(format!("a score is {s}")));
        }
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, seq, Some(stream))?;
        self.append_rows(
            &mut rows, &mut st, seq, layers, n, k, v, scores, draft, stream,
        )?;
        self.end_reservation(&mut rows, seq, stream)
    }

    /// [`Self::append`] on checked arguments, with the locks held (the rows' budgets kept).
    #[allow(clippy::too_many_arguments)]
    fn append_rows(
        &self,
        rows: &mut SlotTable<Vec<Row>>,
        st: &mut PoolState,
        seq: SeqId,
        layers: std::ops::Range<usize>,
        n: usize,
        k: &TensorView,
        v: &TensorView,
        scores: &[f32],
        draft: bool,
        stream: Stream,
    ) -> Result<()> {
        let h = self.cfg.kv_heads;
        let srows = rows.get(seq)?.clone();
        if n == 0 {
            return Ok(());
        }
        let w = self.cfg.local_window;
        let nr = self.cfg.rows_per_seq();
        let base = seq as usize * nr;
        // Plan every row, count pages.
        struct RowPlan {
            r: usize,
            li: usize,
            h: usize,
            keep: usize,
            new_len: usize,
            promote_old: Vec<(usize, usize)>,
            place_new: Vec<(usize, usize)>,
            after: Row,
        }
        let mut plans = Vec::with_capacity(layers.len() * h);
        let mut needed = 0usize;
        for (li, l) in layers.clone().enumerate() {
            for hh in 0..h {
                let r = l * h + hh;
                let row = &srows[r];
                let sc: Vec<f32> = (0..n).map(|j| scores[(li * n + j) * h + hh]).collect();
                let c = row.committed_len(w);
                let plan = if draft {
                    if row.drafts.len() + n > MAX_DRAFTS {
                        return Err(Error::OutOfRange(format!(
                            "{} drafts pending in layer {l} head {hh} and {n} more given; at most \
                             {MAX_DRAFTS}",
                            row.drafts.len()
                        )));
                    }
                    let at = c + row.drafts.len();
                    let mut after = row.clone();
                    after.drafts.extend_from_slice(&sc);
                    RowPlan {
                        r,
                        li,
                        h: hh,
                        keep: at,
                        new_len: at + n,
                        promote_old: Vec::new(),
                        place_new: (0..n).map(|j| (j, at + j)).collect(),
                        after,
                    }
                } else {
                    if !row.drafts.is_empty() {
                        return Err(Error::InvalidArgument(format!(
                            "sequence {seq} has {} pending drafts in layer {l}; commit or \
                             truncate them before appending committed tokens",
                            row.drafts.len()
                        )));
                    }
                    let p = self.simulate(row, &sc);
                    RowPlan {
                        r,
                        li,
                        h: hh,
                        keep: c,
                        new_len: p.after.committed_len(w),
                        promote_old: p.promote_old,
                        place_new: p.place_new,
                        after: p.after,
                    }
                };
                if plan.after.global > self.cfg.max_global_tokens {
                    return Err(Error::OutOfRange(format!(
                        "layer {l} head {hh} of sequence {seq} would hold {} global tokens; \
                         max_global_tokens is {}",
                        plan.after.global, self.cfg.max_global_tokens
                    )));
                }
                let positions = written(&plan.place_new, &plan.promote_old);
                // Pages a reservation gave the row beyond its length are kept.
                let keep = plan
                    .keep
                    .max(st.seq(base + r).pages.len() * self.cfg.page_size);
                needed += self.pages_for(st, base + r, keep, plan.new_len, &positions);
                plans.push(plan);
            }
        }
        if needed > st.alloc.free_count() {
            return Err(Error::PoolExhausted(format!(
                "{needed} pages needed, {} free",
                st.alloc.free_count()
            )));
        }
        // Host state, then the device tables (and copy-on-write copies).
        for p in &plans {
            let positions = written(&p.place_new, &p.promote_old);
            self.grow_row(st, base + p.r, p.new_len, &positions);
        }
        self.inner.flush(st, stream)?;
        // Promotions of ring tokens (before the ring slots are rewritten).
        let mut promos: Vec<Pair> = Vec::new();
        for p in &plans {
            let slot = base + p.r;
            for &(ring, gpos) in &p.promote_old {
                let (page, s) = self.dest(st, slot, gpos);
                let (ko, vo) = self.pool_offsets(self.dest(st, slot, ring));
                promos.push((ko, vo, page, s));
            }
        }
        self.scatter(&self.pool_source(), &promos, stream)?;
        // The new tokens, all rows in one scatter (host K/V staged once on CUDA).
        let mut staged = Vec::new();
        let result = (|| -> Result<()> {
            let (kd, vd) = match &self.cuda {
                Some(c) => {
                    let (kd, a) = c.stage(k, stream)?;
                    staged.extend(a);
                    let (vd, b) = c.stage(v, stream)?;
                    staged.extend(b);
                    (kd, vd)
                }
                None => (*k, *v),
            };
            let (ks, vs) = (kd.strides(), vd.strides());
            let four = kd.ndim() == 4;
            let off = |s: &[isize], li: usize, j: usize, h: usize| -> i64 {
                if four {
                    (li as isize * s[0] + j as isize * s[1] + h as isize * s[2]) as i64
                } else {
                    (j as isize * s[0] + h as isize * s[1]) as i64
                }
            };
            let mut pairs: Vec<Pair> = Vec::new();
            for p in &plans {
                let slot = base + p.r;
                for &(j, pos) in &p.place_new {
                    let (page, sl) = self.dest(st, slot, pos);
                    pairs.push((off(ks, p.li, j, p.h), off(vs, p.li, j, p.h), page, sl));
                }
            }
            let src = RowSource {
                k: kd.addr(),
                v: vd.addr(),
                dtype: kd.dtype(),
                k_ds: ks[ks.len() - 1],
                v_ds: vs[vs.len() - 1],
            };
            if kd.dtype() != vd.dtype() {
                return Err(Error::DTypeMismatch(format!(
                    "k ({}) and v ({}) must have the same dtype",
                    kd.dtype(),
                    vd.dtype()
                )));
            }
            self.scatter(&src, &pairs, stream)
        })();
        if let Some(c) = &self.cuda {
            c.free(&staged, stream)?;
        }
        result?;
        let rs = rows.get_mut(seq)?;
        for p in plans {
            rs[p.r] = p.after;
        }
        Ok(())
    }

    /// As [`Self::append`], with the scores from the pool's gate (see [`Self::set_gate`])
    /// evaluated on the CPU from `k_pre` (keys before RoPE, shaped like `k`) and `k` (after
    /// RoPE, the cached keys); host memory.
    #[allow(clippy::too_many_arguments)]
    pub fn append_gated(
        &self,
        seq: SeqId,
        layer: Option<usize>,
        k_pre: &TensorView,
        k: &TensorView,
        v: &TensorView,
        draft: bool,
        stream: Stream,
    ) -> Result<()> {
        let gate = self
            .gate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::InvalidArgument("the pool has no gate; set one first".into()))?;
        let scores = self.gate_scores(&gate, layer, k_pre, k)?;
        self.append(seq, layer, k, v, &scores, draft, stream)
    }

    /// Gate scores `[layers][n][kv_heads]` of an append's keys.
    pub fn gate_scores(
        &self,
        gate: &GateWeights,
        layer: Option<usize>,
        k_pre: &TensorView,
        k: &TensorView,
    ) -> Result<Vec<f32>> {
        let (layers, _) = self.check_tokens(layer, &[("k", k), ("k_pre", k_pre)])?;
        let mut scores = Vec::new();
        for (li, l) in layers.enumerate() {
            let (a, b) = if k.ndim() == 4 {
                (layer_slice(k_pre, li)?, layer_slice(k, li)?)
            } else {
                (*k_pre, *k)
            };
            scores.extend(gate.scores(l, &a, &b)?);
        }
        Ok(scores)
    }

    /// Reserves `steps` device steps for `seq` (every layer): pages for the ring slots and
    /// global positions the next `steps` committed tokens can write (all assumed admitted:
    /// the tokens already in the ring are counted by their known scores), made private
    /// (copy-on-write) and added to the rows' block tables, their length unchanged. Until
    /// the next other operation on the sequence, each [`Self::step`] of a layer uses one
    /// step of that layer's budget. On CUDA the sequence is then *device-driven*: its rows'
    /// state lives on the device, and every host operation on it first waits for `stream`
    /// and reads the state back (a step that found no budget is reported there). Needs at
    /// least one committed token and no pending drafts. All or nothing.
    pub fn reserve(&self, seq: SeqId, steps: usize, stream: Stream) -> Result<()> {
        if steps == 0 || steps > MAX_RESERVE_STEPS {
            return Err(Error::OutOfRange(format!(
                "{steps} steps; reserve 1 to {MAX_RESERVE_STEPS}"
            )));
        }
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, seq, Some(stream))?;
        let srows = rows.get(seq)?.clone();
        let (w, ps) = (self.cfg.local_window, self.cfg.page_size);
        let base = seq as usize * self.cfg.rows_per_seq();
        let mut plans = Vec::with_capacity(srows.len());
        let mut needed = 0usize;
        for (r, row) in srows.iter().enumerate() {
            let (l, hh) = (r / self.cfg.kv_heads, r % self.cfg.kv_heads);
            if !row.drafts.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} has {} pending drafts in layer {l}; commit or truncate \
                     them before reserving steps",
                    row.drafts.len()
                )));
            }
            if row.total == 0 {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} has no tokens in layer {l}; append (prefill) at least one \
                     before reserving steps"
                )));
            }
            let p = self.simulate(row, &vec![1.0; steps]);
            if p.after.global > self.cfg.max_global_tokens {
                return Err(Error::OutOfRange(format!(
                    "{steps} steps could take layer {l} head {hh} of sequence {seq} to {} \
                     global tokens; max_global_tokens is {}",
                    p.after.global, self.cfg.max_global_tokens
                )));
            }
            let positions = written(&p.place_new, &p.promote_old);
            let new_len = p.after.committed_len(w);
            let keep = row.committed_len(w).max(st.seq(base + r).pages.len() * ps);
            needed += self.pages_for(&st, base + r, keep, new_len, &positions);
            plans.push((new_len, positions));
        }
        if needed > st.alloc.free_count() {
            return Err(Error::PoolExhausted(format!(
                "reserving {steps} steps needs {needed} pages, {} free",
                st.alloc.free_count()
            )));
        }
        for (r, (new_len, positions)) in plans.iter().enumerate() {
            self.provide_pages(&mut st, base + r, *new_len, positions);
        }
        self.inner.flush(&mut st, stream)?;
        let rs = rows.get_mut(seq)?;
        for r in rs.iter_mut() {
            r.budget = steps;
            r.driven = self.cuda.is_some();
        }
        self.push_seq(rs, base, stream)
    }

    /// One committed token for each sequence of `seqs` (unique, each with a reservation:
    /// [`Self::reserve`]) in layer `layer`: K/V `[B, kv_heads, head_dim]`, scores from the
    /// pool's gate on `k_pre` (keys before RoPE, like `k`) and `k`, or given (`scores`, f32
    /// `[B, kv_heads]`); `scores_out` (f32 `[B, kv_heads]`, contiguous) receives them. The
    /// same ring update as a committed [`Self::append`] of one token. On CUDA every tensor
    /// is device memory and the step is one kernel per 128 sequences, with no host work
    /// that depends on the device: graph-capturable, replayable while the budget lasts (a
    /// row whose budget is spent is left as it is and reported by the next host operation
    /// on its sequence). On the CPU the scores are computed on the host and a spent budget
    /// is an error before anything changes.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &self,
        layer: usize,
        seqs: &[i32],
        k_pre: Option<&TensorView>,
        k: &TensorView,
        v: &TensorView,
        scores: Option<&TensorView>,
        scores_out: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let io = WgStep {
            layer,
            seqs,
            k_pre,
            k,
            v,
            scores,
            scores_out,
        };
        let gate = self.step_check_io(&io)?;
        if seqs.is_empty() {
            return Ok(());
        }
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.step_check_rows(&rows, &io)?;
        self.step_run(&mut rows, &mut st, &io, gate, stream)
    }

    /// [`Self::step`] and then [`Self::decode`] of the same sequences in one call (one
    /// query token per sequence: q `[B, Hq, D]` or `[B, 1, Hq, D]`), checked as one: on an
    /// error nothing is queued and nothing changes.
    pub fn step_decode(
        &self,
        io: &WgStep<'_>,
        q: &TensorView,
        out: &TensorView,
        lse: Option<&TensorView>,
        opts: &DecodeOptions,
        stream: Stream,
    ) -> Result<()> {
        let gate = self.step_check_io(io)?;
        if q.ndim() == 4 && q.shape()[1] != 1 {
            return Err(Error::InvalidArgument(format!(
                "q has {} query tokens per sequence; a step decodes one",
                q.shape()[1]
            )));
        }
        let ids_view = TensorView::contiguous(
            io.seqs.as_ptr() as usize,
            DType::I32,
            MemoryKind::Host,
            &[io.seqs.len()],
        )?;
        let dio = DecodeIo {
            seq_ids: &ids_view,
            q,
            out,
            lse,
        };
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        if !io.seqs.is_empty() {
            self.step_check_rows(&rows, io)?;
        }
        let plans = self.decode_plans(&rows, &st, io.layer, &dio, opts)?;
        if io.seqs.is_empty() {
            return Ok(());
        }
        self.step_run(&mut rows, &mut st, io, gate, stream)?;
        self.decode_run(&st, &plans, stream)
    }

    /// The checks of a step's layer and tensors, and the pool's gate when the step scores
    /// (`k_pre`).
    fn step_check_io(&self, io: &WgStep<'_>) -> Result<Option<Arc<GateWeights>>> {
        let (k, v, k_pre, scores, scores_out) = (io.k, io.v, io.k_pre, io.scores, io.scores_out);
        let (layer, seqs) = (io.layer, io.seqs);
        crate::pool::check_layer(layer, self.cfg.layers)?;
        let (b, h) = (seqs.len(), self.cfg.kv_heads);
        let mut ts: Vec<(&str, &TensorView)> = vec![("k", k), ("v", v)];
        match (k_pre, scores) {
            (Some(kp), None) => ts.push(("k_pre", kp)),
            (None, Some(_)) => {}
            _ => {
                return Err(Error::InvalidArgument(
                    "give exactly one of scores and k_pre".into(),
                ))
            }
        }
        let (_, n) = self.check_tokens(Some(layer), &ts)?;
        if n != b {
            return Err(Error::InvalidArgument(format!(
                "k has {n} tokens for {b} sequences; a step takes one token per sequence"
            )));
        }
        if b == 0 {
            return Ok(None);
        }
        let on_cuda = self.cuda.is_some();
        let want_mem = if on_cuda {
            MemoryKind::Cuda
        } else {
            MemoryKind::Host
        };
        for (name, t) in ts
            .iter()
            .copied()
            .chain(scores.map(|t| ("scores", t)))
            .chain(scores_out.map(|t| ("scores_out", t)))
        {
            t.expect_memory(want_mem, name)?;
        }
        for (name, t) in scores
            .map(|t| ("scores", t))
            .into_iter()
            .chain(scores_out.map(|t| ("scores_out", t)))
        {
            if t.dtype() != DType::F32 || t.shape() != [b, h] {
                return Err(Error::InvalidArgument(format!(
                    "{name} is {} {:?}; expected f32 [{b}, {h}]",
                    t.dtype(),
                    t.shape()
                )));
            }
        }
        if let Some(t) = scores_out {
            if t.strides() != [h as isize, 1] {
                return Err(Error::InvalidArgument(
                    "scores_out must be contiguous".into(),
                ));
            }
        }
        if k.dtype() != v.dtype() {
            return Err(Error::DTypeMismatch(format!(
                "k ({}) and v ({}) must have the same dtype",
                k.dtype(),
                v.dtype()
            )));
        }
        let gate = match k_pre {
            Some(_) => Some(
                self.gate
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
                    .ok_or_else(|| {
                        Error::InvalidArgument("the pool has no gate; set one first".into())
                    })?,
            ),
            None => None,
        };
        Ok(gate)
    }

    /// The checks of a step against the rows: sequences listed once, each with a
    /// reservation, and a device gate where the step scores on CUDA.
    fn step_check_rows(&self, rows: &SlotTable<Vec<Row>>, io: &WgStep<'_>) -> Result<()> {
        let (layer, seqs, h) = (io.layer, io.seqs, self.cfg.kv_heads);
        let on_cuda = self.cuda.is_some();
        for (i, &id) in seqs.iter().enumerate() {
            if seqs[..i].contains(&id) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {id} is listed twice"
                )));
            }
            // The host's budget: the reservation's on CUDA (the device counts the steps
            // down, graph replays included), the steps left on the CPU; zero after any
            // other operation on the sequence either way.
            if rows.get(id)?[layer * h].budget == 0 {
                return Err(Error::OutOfRange(format!(
                    "sequence {id} has no reserved steps{}; reserve before stepping (any other \
                     operation on the sequence ends a reservation)",
                    if on_cuda { "" } else { " left in this layer" }
                )));
            }
        }
        if let Some(c) = &self.cuda {
            if io.k_pre.is_some() && !c.has_gate() {
                return Err(Error::Unsupported(format!(
                    "the gate's input (2 x head_dim = {}) exceeds the device gate's {}; pass \
                     scores",
                    2 * self.cfg.head_dim,
                    crate::abi::KVR_WGKV_GATE_MAX_IN
                )));
            }
        }
        Ok(())
    }

    /// A checked, non-empty step ([`Self::step_check_io`], [`Self::step_check_rows`]).
    fn step_run(
        &self,
        rows: &mut SlotTable<Vec<Row>>,
        st: &mut PoolState,
        io: &WgStep<'_>,
        gate: Option<Arc<GateWeights>>,
        stream: Stream,
    ) -> Result<()> {
        let WgStep {
            layer,
            seqs,
            k_pre,
            k,
            v,
            scores,
            scores_out,
        } = *io;
        let (b, h) = (seqs.len(), self.cfg.kv_heads);
        if let Some(c) = &self.cuda {
            // A gate whose scores nobody reads now is deferred: a token's bit is needed only
            // when it leaves the ring.
            let mode = match (scores, scores_out) {
                (Some(_), _) => cuda::GateMode::Given,
                (None, None) if c.defers() => cuda::GateMode::Deferred,
                (None, _) => cuda::GateMode::Immediate,
            };
            let io = cuda::StepIo {
                layer,
                seqs,
                k_pre,
                k: Some(k),
                v: Some(v),
                scores,
                scores_out,
                mode,
            };
            return c.step(&io, stream);
        }
        // CPU: scores on the host, then one committed append per sequence.
        let sc: Vec<f32> = match (scores, &gate, k_pre) {
            (Some(t), _, _) => read_f32_2d(t),
            (None, Some(g), Some(kp)) => g.scores(layer, kp, k)?,
            _ => unreachable!("checked above"),
        };
        if let Some(s) = sc.iter().find(|s| !s.is_finite()) {
            return Err(Error::InvalidArgument(format!("a score is {s}")));
        }
        for (i, &id) in seqs.iter().enumerate() {
            let (ki, vi) = (token_slice(k, i)?, token_slice(v, i)?);
            let s = &sc[i * h..(i + 1) * h];
            self.append_rows(
                rows,
                st,
                id,
                layer..layer + 1,
                1,
                &ki,
                &vi,
                s,
                false,
                stream,
            )?;
            for r in &mut rows.get_mut(id)?[layer * h..(layer + 1) * h] {
                r.budget -= 1;
            }
        }
        if let Some(t) = scores_out {
            // SAFETY: a checked, contiguous f32 host view of b x h elements.
            unsafe { std::slice::from_raw_parts_mut(t.addr() as *mut f32, b * h) }
                .copy_from_slice(&sc);
        }
        Ok(())
    }

    /// Accepts the first `accepted` pending drafts of every row of `seq` (moving them into
    /// the ring, with the evictions and promotions a committed append makes) and drops the
    /// rest. Needs free pages for the moved drafts while it runs. All or nothing.
    pub fn commit(&self, seq: SeqId, accepted: usize, stream: Stream) -> Result<()> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, seq, Some(stream))?;
        let srows = rows.get(seq)?.clone();
        let w = self.cfg.local_window;
        let ps = self.cfg.page_size;
        let nr = self.cfg.rows_per_seq();
        let base = seq as usize * nr;
        if let Some((r, row)) = srows
            .iter()
            .enumerate()
            .find(|(_, r)| r.drafts.len() < accepted)
        {
            return Err(Error::OutOfRange(format!(
                "cannot accept {accepted} drafts: layer {} head {} of sequence {seq} has {}",
                r / self.cfg.kv_heads,
                r % self.cfg.kv_heads,
                row.drafts.len()
            )));
        }
        struct RowPlan {
            keep: usize,
            new_len: usize,
            promote_old: Vec<(usize, usize)>,
            /// (draft index, ring slot) of drafts that move.
            moved: Vec<(usize, usize)>,
            after: Row,
        }
        let mut plans = Vec::with_capacity(nr);
        let mut needed = 0usize;
        let mut released = 0usize;
        let mut n_moved = 0usize;
        for (r, row) in srows.iter().enumerate() {
            let c = row.committed_len(w);
            let p = self.simulate(row, &row.drafts[..accepted]);
            let moved: Vec<(usize, usize)> = p
                .place_new
                .iter()
                .copied()
                .filter(|&(j, pos)| pos != c + j)
                .collect();
            let keep = p
                .place_new
                .iter()
                .filter(|&&(j, pos)| pos == c + j)
                .map(|&(_, pos)| pos + 1)
                .max()
                .unwrap_or(0)
                .max(c);
            let new_len = p.after.committed_len(w);
            let positions = written(&moved, &p.promote_old);
            needed += self.pages_for(&st, base + r, keep, new_len, &positions);
            let s = st.seq(base + r);
            released += s.pages[keep.div_ceil(ps).min(s.pages.len())..]
                .iter()
                .filter(|&&pg| st.alloc.refcount(pg) == 1)
                .count();
            n_moved += moved.len();
            plans.push(RowPlan {
                keep,
                new_len,
                promote_old: p.promote_old,
                moved,
                after: p.after,
            });
        }
        let scratch_pages = n_moved.div_ceil(ps);
        let free = st.alloc.free_count();
        if scratch_pages > free || needed + scratch_pages > free + released {
            return Err(Error::PoolExhausted(format!(
                "committing needs {} pages ({scratch_pages} of them while it runs), {free} free",
                needed + scratch_pages
            )));
        }
        // 1. Moved drafts -> scratch rows.
        let scratch_pages = st.alloc.alloc_n(scratch_pages).expect("counted");
        let mut to_scratch = Vec::with_capacity(n_moved);
        let mut i = 0usize;
        for (r, p) in plans.iter().enumerate() {
            let c = srows[r].committed_len(w);
            for &(j, _) in &p.moved {
                let (ko, vo) = self.pool_offsets(self.dest(&st, base + r, c + j));
                to_scratch.push((ko, vo, scratch_pages[i / ps], (i % ps) as u32));
                i += 1;
            }
        }
        self.scatter(&self.pool_source(), &to_scratch, stream)?;
        // 2. Host state: drop the drafts' tail, grow for promotions, copy-on-write.
        for (r, p) in plans.iter().enumerate() {
            let slot = base + r;
            self.inner.truncate_locked(&mut st, slot, p.keep);
            let positions = written(&p.moved, &p.promote_old);
            self.grow_row(&mut st, slot, p.new_len, &positions);
        }
        self.inner.flush(&mut st, stream)?;
        // 3. Promotions, 4. scratch -> ring.
        let mut promos: Vec<Pair> = Vec::new();
        let mut from_scratch: Vec<Pair> = Vec::with_capacity(n_moved);
        let mut i = 0usize;
        for (r, p) in plans.iter().enumerate() {
            let slot = base + r;
            for &(ring, gpos) in &p.promote_old {
                let (page, s) = self.dest(&st, slot, gpos);
                let (ko, vo) = self.pool_offsets(self.dest(&st, slot, ring));
                promos.push((ko, vo, page, s));
            }
            for &(_, ring) in &p.moved {
                let (page, s) = self.dest(&st, slot, ring);
                let (ko, vo) = self.pool_offsets((scratch_pages[i / ps], (i % ps) as u32));
                from_scratch.push((ko, vo, page, s));
                i += 1;
            }
        }
        self.scatter(&self.pool_source(), &promos, stream)?;
        self.scatter(&self.pool_source(), &from_scratch, stream)?;
        for p in scratch_pages {
            st.alloc.release(p);
        }
        let rs = rows.get_mut(seq)?;
        for (r, p) in plans.into_iter().enumerate() {
            rs[r] = p.after;
        }
        self.end_reservation(&mut rows, seq, stream)
    }

    /// Rolls `seq` back to `len` tokens, which must lie between its committed length and
    /// the committed length plus its pending drafts (in every row): drafts past `len` are
    /// dropped. Committed tokens cannot be rolled back.
    pub fn truncate(&self, seq: SeqId, len: usize, stream: Stream) -> Result<()> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_seq(&mut rows, &mut st, seq, Some(stream))?;
        let srows = rows.get(seq)?;
        let w = self.cfg.local_window;
        for (r, row) in srows.iter().enumerate() {
            if len < row.total || len > row.total + row.drafts.len() {
                return Err(Error::OutOfRange(format!(
                    "cannot truncate sequence {seq} to {len} tokens: layer {} head {} has {} \
                     committed tokens and {} drafts (only drafts can be rolled back)",
                    r / self.cfg.kv_heads,
                    r % self.cfg.kv_heads,
                    row.total,
                    row.drafts.len()
                )));
            }
        }
        let base = seq as usize * self.cfg.rows_per_seq();
        let rs = rows.get_mut(seq)?;
        for (r, row) in rs.iter_mut().enumerate() {
            let keep = len - row.total;
            row.drafts.truncate(keep);
            self.inner
                .truncate_locked(&mut st, base + r, row.committed_len(w) + keep);
        }
        self.inner.flush(&mut st, stream)?;
        self.end_reservation(&mut rows, seq, stream)
    }

    /// Occupancy (waits for the device when a sequence is device-driven).
    pub fn stats(&self) -> Result<WgKvStats> {
        let mut rows = self.lock_rows();
        let mut st = self.inner.lock();
        self.sync_all(&mut rows, &mut st)?;
        let ps = self.cfg.page_size;
        let mut s = WgKvStats {
            pages_total: self.cfg.capacity_pages,
            pages_used: st.alloc.used_count(),
            pages_free: st.alloc.free_count(),
            pages_shared: st.alloc.shared_count(),
            page_bytes: self.cfg.page_bytes(),
            ..Default::default()
        };
        for (_, rs) in rows.iter() {
            s.sequences += 1;
            for r in rs {
                s.kept_tokens += r.fill + r.global + r.drafts.len();
                let full = r.total + r.drafts.len();
                s.full_tokens += full;
                s.full_pages += full.div_ceil(ps);
            }
        }
        Ok(s)
    }

    /// Attention of `io.q` over layer `layer`'s rows (ring + global + drafts) of the
    /// sequences in `io.seq_ids` (host i32 `[B]`, -1 = unused row). q `[B, Hq, D]` or `[B,
    /// T, Hq, D]`: T > 1 needs T pending drafts in every row of the layer (the last T
    /// tokens, causal among themselves). With q/out/lse's heads contiguous per batch row
    /// (`stride(B) = Hq * stride(head)`) one inner decode serves the layer, (sequence, KV
    /// head) folded into its batch; otherwise one per KV head. No sliding window.
    pub fn decode(
        &self,
        layer: usize,
        io: &DecodeIo<'_>,
        opts: &DecodeOptions,
        stream: Stream,
    ) -> Result<()> {
        let rows = self.lock_rows();
        let st = self.inner.lock();
        let plans = self.decode_plans(&rows, &st, layer, io, opts)?;
        self.decode_run(&st, &plans, stream)
    }

    /// The checked inner decodes of [`Self::decode`] (all checks, nothing queued).
    fn decode_plans(
        &self,
        rows: &SlotTable<Vec<Row>>,
        st: &PoolState,
        layer: usize,
        io: &DecodeIo<'_>,
        opts: &DecodeOptions,
    ) -> Result<Vec<decode::DecodePlan>> {
        crate::pool::check_layer(layer, self.cfg.layers)?;
        if opts.window != 0 {
            return Err(Error::InvalidArgument(
                "a write-gated pool has no sliding window (its ring is the local window)".into(),
            ));
        }
        let ids_t = io.seq_ids;
        if ids_t.dtype() != DType::I32 || ids_t.ndim() != 1 {
            return Err(Error::InvalidArgument(format!(
                "seq_ids must be an i32 [B] tensor, not {} {:?}",
                ids_t.dtype(),
                ids_t.shape()
            )));
        }
        if ids_t.memory() != MemoryKind::Host {
            return Err(Error::Unsupported(
                "a write-gated pool's decode takes seq_ids in host memory".into(),
            ));
        }
        let b = ids_t.shape()[0];
        if b > self.cfg.max_seqs {
            return Err(Error::OutOfRange(format!(
                "batch of {b} rows exceeds max_seqs ({})",
                self.cfg.max_seqs
            )));
        }
        let ids = read_host_i32(ids_t, b);
        for (i, &id) in ids.iter().enumerate() {
            if id >= 0 && ids[..i].contains(&id) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {id} is listed twice"
                )));
            }
            if id != -1 {
                rows.get(id)?;
            }
        }
        let q4 = as_batch_4d(io.q, "q", true)?;
        let o4 = as_batch_4d(io.out, "out", true)?;
        if io.out.shape() != io.q.shape() {
            return Err(Error::InvalidArgument(format!(
                "out has shape {:?}; q has {:?}",
                io.out.shape(),
                io.q.shape()
            )));
        }
        let [qb, t, hq, _] = [q4.shape()[0], q4.shape()[1], q4.shape()[2], q4.shape()[3]];
        let hkv = self.cfg.kv_heads;
        if qb != b {
            return Err(Error::InvalidArgument(format!(
                "q has {qb} rows but seq_ids has {b}"
            )));
        }
        if hq == 0 || hq % hkv != 0 {
            return Err(Error::InvalidArgument(format!(
                "{hq} query heads is not a multiple of the pool's {hkv} KV heads"
            )));
        }
        let g = hq / hkv;
        let l3 = match io.lse {
            Some(l) => Some(as_batch_3d(l, "lse", io.q.ndim() == 3)?),
            None => None,
        };
        if let Some(l) = &l3 {
            if l.shape() != [b, t, hq] {
                return Err(Error::InvalidArgument(format!(
                    "lse has shape {:?}; expected [{b}, {t}, {hq}] (or [{b}, {hq}])",
                    l.shape()
                )));
            }
        }
        for &id in ids.iter().filter(|&&id| id >= 0) {
            for hh in 0..hkv {
                let row = &rows.get(id)?[layer * hkv + hh];
                if t > 1 && row.drafts.len() < t {
                    return Err(Error::OutOfRange(format!(
                        "{t} query tokens need {t} pending drafts; layer {layer} head {hh} of \
                         sequence {id} has {}",
                        row.drafts.len()
                    )));
                }
                if row.fill + row.drafts.len() == 0 {
                    return Err(Error::OutOfRange(format!(
                        "sequence {id} has no tokens in layer {layer}; append before decoding"
                    )));
                }
            }
        }
        let inner_id = |id: i32, hh: usize| -> i32 {
            if id < 0 {
                -1
            } else {
                self.row_id(id, layer, hh)
            }
        };
        let folds = |v: &TensorView, head_dim: usize| {
            v.strides()[0] == (hkv * g) as isize * v.strides()[head_dim]
        };
        let fold =
            folds(&q4, 2) && folds(&o4, 2) && l3.as_ref().is_none_or(|l| folds(l, 2)) && b > 0;
        // (ids, q, out, lse) per inner decode.
        let mut calls: Vec<(Vec<i32>, TensorView, TensorView, Option<TensorView>)> = Vec::new();
        // The rows of KV head `hh` (or, folded, of every (sequence, KV head)) of q / out
        // `[B, T, Hq, D]` or lse `[B, T, Hq]`: `[rows, T, g (, D)]`.
        let sub = |v: &TensorView, hh: usize, folded: bool| -> Result<TensorView> {
            let s = v.strides();
            let off = hh as isize * g as isize * s[2] * v.dtype().size() as isize;
            let (rows_n, rs) = if folded {
                (b * hkv, g as isize * s[2])
            } else {
                (b, s[0])
            };
            let n = v.ndim();
            let mut shape = [rows_n, t, g, 0];
            let mut strides = [rs, s[1], s[2], 0];
            if n == 4 {
                shape[3] = v.shape()[3];
                strides[3] = s[3];
            }
            TensorView::new(
                (v.addr() as isize + off) as usize,
                v.dtype(),
                v.memory(),
                &shape[..n],
                &strides[..n],
            )
        };
        if fold {
            let inner: Vec<i32> = ids
                .iter()
                .flat_map(|&id| (0..hkv).map(move |hh| (id, hh)))
                .map(|(id, hh)| inner_id(id, hh))
                .collect();
            calls.push((
                inner,
                sub(&q4, 0, true)?,
                sub(&o4, 0, true)?,
                l3.as_ref().map(|l| sub(l, 0, true)).transpose()?,
            ));
        } else {
            for hh in 0..hkv {
                calls.push((
                    ids.iter().map(|&id| inner_id(id, hh)).collect(),
                    sub(&q4, hh, false)?,
                    sub(&o4, hh, false)?,
                    l3.as_ref().map(|l| sub(l, hh, false)).transpose()?,
                ));
            }
        }
        // Check every inner call before running any.
        let backend = self.inner.context().backend();
        let mut checked = Vec::with_capacity(calls.len());
        for (inner_ids, q, out, lse) in &calls {
            let ids_view = TensorView::contiguous(
                inner_ids.as_ptr() as usize,
                DType::I32,
                MemoryKind::Host,
                &[inner_ids.len()],
            )?;
            let dio = DecodeIo {
                seq_ids: &ids_view,
                q,
                out,
                lse: lse.as_ref(),
            };
            checked.push(decode::check(
                self.inner.config(),
                backend,
                st,
                0,
                &dio,
                opts,
            )?);
        }
        Ok(checked)
    }

    /// Queues checked inner decodes ([`Self::decode_plans`]).
    fn decode_run(
        &self,
        st: &PoolState,
        plans: &[decode::DecodePlan],
        stream: Stream,
    ) -> Result<()> {
        let lay = *self.inner.layer_layout(0).expect("one layer");
        for plan in plans {
            self.inner.exec.decode(&lay, st, plan, stream)?;
        }
        Ok(())
    }
}

/// Inner positions a row update writes: where its tokens go (`(token, position)`) and
/// where its promotions go (`(ring slot, position)`).
fn written(placed: &[(usize, usize)], promoted: &[(usize, usize)]) -> Vec<usize> {
    placed.iter().chain(promoted).map(|x| x.1).collect()
}

/// Token `i` of a `[n, H, D]` view, as `[1, H, D]`.
fn token_slice(t: &TensorView, i: usize) -> Result<TensorView> {
    let s = t.strides();
    let mut shape = t.shape().to_vec();
    shape[0] = 1;
    TensorView::new(
        (t.addr() as isize + i as isize * s[0] * t.dtype().size() as isize) as usize,
        t.dtype(),
        t.memory(),
        &shape,
        s,
    )
}

/// The elements of an f32 `[n, m]` host view (any strides), row-major.
fn read_f32_2d(t: &TensorView) -> Vec<f32> {
    let (s, [n, m]) = (t.strides(), [t.shape()[0], t.shape()[1]]);
    (0..n * m)
        // SAFETY: a checked f32 host view; (i / m, i % m) is one of its elements.
        .map(|i| unsafe {
            (t.addr() as *const f32)
                .offset((i / m) as isize * s[0] + (i % m) as isize * s[1])
                .read()
        })
        .collect()
}

/// Layer `li` of a `[layers, n, H, D]` view, as `[n, H, D]`.
fn layer_slice(t: &TensorView, li: usize) -> Result<TensorView> {
    let s = t.strides();
    TensorView::new(
        (t.addr() as isize + li as isize * s[0] * t.dtype().size() as isize) as usize,
        t.dtype(),
        t.memory(),
        &t.shape()[1..],
        &s[1..],
    )
}
