//! The paged KV pool.
//!
//! # Physical layout
//!
//! Every layer has a K array and a V array of `capacity_pages` pages. Element `d` of head
//! `h`, slot `s` (token `s` of the page) of page `p` is at
//! `base + p * stride_page + h * stride_head + s * stride_token + d` (in elements). A pool
//! that owns its memory uses the "HND" layout: `stride_token = head_dim`,
//! `stride_head = page_size * head_dim`, `stride_page = kv_heads * page_size * head_dim`, with
//! layers stored one after another (`[layer][K|V][page][head][slot][dim]`), so one KV head of
//! one page is a contiguous `page_size x head_dim` block. An engine can instead hand in
//! per-layer pointers and strides (for example its own `[ctx][heads][dim]` tensors, which
//! are the "contiguous" case: `page_size = ctx`, one page per sequence); `head_dim` must be
//! the contiguous dimension.
//!
//! All layers share one block table: token `i` of a sequence lives in page
//! `table[seq][i / page_size]`, slot `i % page_size`, in every layer.
//!
//! # Sequences
//!
//! Sequences are small integers (slots `0..max_seqs`). `extend` reserves positions (and
//! pages), `write` fills the last positions of sequences for one layer or all layers,
//! `append` does both for one sequence. `fork` shares all pages (reference counts);
//! extending a sequence whose last, partly filled page is shared first copies that page
//! (copy-on-write). `truncate` releases whole pages past the new length.
//!
//! # Device state (CUDA)
//!
//! The block table and lengths live in device memory and every mutating call patches only
//! the entries it changed, on the caller's stream, with a kernel whose parameters carry the
//! patches (no host synchronization, no staging memory). Pool calls and decodes on one pool
//! must be ordered on one stream (or ordered by the caller).

use std::sync::{Arc, Mutex, MutexGuard};

use super::allocator::BlockAllocator;
use super::config::{KvPoolConfig, LayerLayout, SeqId, MAX_WRITE_GROUPS};
use super::decode::{self, DecodeIo, DecodeOptions};
use super::exec::{CpuKv, KvExecutor};
use super::state::{PoolState, SeqState};
use crate::backend::buffer::Buffer;
use crate::backend::{Backend, BackendKind, Context, Stream};
use crate::error::{Error, Result};
use crate::pool::{check_float, layer_range};
use crate::tensor::{MemoryKind, TensorView};

/// Who owns the pool's K/V memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvStorage {
    /// The pool allocates it (HND layout, zeroed).
    Owned,
    /// The caller's memory, one layout per layer, in the context's memory kind.
    External(Vec<LayerLayout>),
}

/// Answer of [`KvPool::admit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Fits now.
    Ok,
    /// Does not fit now but would in an empty pool.
    Later,
    /// Can never fit (longer than `max_seq_len` or more pages than the pool has).
    Never,
}

/// Pool occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub pages_total: usize,
    /// Pages referenced by at least one sequence.
    pub pages_used: usize,
    /// Pages on the free list.
    pub pages_free: usize,
    /// Pages referenced by more than one sequence.
    pub pages_shared: usize,
    /// Live sequences.
    pub sequences: usize,
    /// Sum of sequence lengths (a shared token counts once per sequence).
    pub tokens: usize,
    /// Token slots in used pages that hold no token of any sequence (internal waste).
    pub waste_slots: usize,
    /// Bytes of K and V per page (all layers).
    pub page_bytes: usize,
}

/// A paged KV pool. Thread-safe: calls may come from several threads (they serialize on
/// the pool's mutex); device work must still be stream-ordered by the caller.
pub struct KvPool {
    ctx: Arc<Context>,
    cfg: KvPoolConfig,
    layout: Vec<LayerLayout>,
    _owned: Option<Buffer>,
    state: Mutex<PoolState>,
    pub(crate) exec: Box<dyn KvExecutor>,
}

impl KvPool {
    /// Creates a pool on `ctx`: storage owned (allocated now, zeroed) or external.
    pub fn new(ctx: Arc<Context>, cfg: KvPoolConfig, storage: KvStorage) -> Result<KvPool> {
        cfg.validate()?;
        let elem = cfg.dtype.size();
        let (layout, owned) = match storage {
            KvStorage::Owned => {
                let per_page = cfg.kv_heads * cfg.page_size * cfg.head_dim;
                let per_array = per_page
                    .checked_mul(cfg.capacity_pages)
                    .ok_or_else(|| Error::OutOfRange("pool size overflows".into()))?;
                let total_bytes = per_array
                    .checked_mul(2 * cfg.layers * elem)
                    .ok_or_else(|| Error::OutOfRange("pool size overflows".into()))?;
                let owned = Buffer::zeroed(&ctx, total_bytes)?;
                let base = owned.addr();
                let strides = [per_page, cfg.page_size * cfg.head_dim, cfg.head_dim];
                let layout = (0..cfg.layers)
                    .map(|l| LayerLayout {
                        k: base + (2 * l) * per_array * elem,
                        v: base + (2 * l + 1) * per_array * elem,
                        k_strides: strides,
                        v_strides: strides,
                    })
                    .collect();
                (layout, Some(owned))
            }
            KvStorage::External(layers) => {
                if layers.len() != cfg.layers {
                    return Err(Error::InvalidArgument(format!(
                        "{} layer layouts given for a pool of {} layers",
                        layers.len(),
                        cfg.layers
                    )));
                }
                for (l, lay) in layers.iter().enumerate() {
                    check_external_layout(&cfg, l, lay, ctx.backend())?;
                }
                (layers, None)
            }
        };
        let state = PoolState::new(&cfg);
        let exec: Box<dyn KvExecutor> = match ctx.handle() {
            Backend::Cpu(cpu) => Box::new(CpuKv::new(cpu, cfg, layout.clone())),
            Backend::Cuda(cuda) => Box::new(super::cuda::DeviceState::new(cuda, &cfg, &layout)?),
        };
        Ok(KvPool {
            ctx,
            cfg,
            layout,
            _owned: owned,
            state: Mutex::new(state),
            exec,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KvPoolConfig {
        &self.cfg
    }
    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
    /// Layer `l`'s memory layout.
    pub fn layer_layout(&self, l: usize) -> Option<&LayerLayout> {
        self.layout.get(l)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live<'a>(&self, st: &'a PoolState, seq: SeqId) -> Result<&'a SeqState> {
        st.seqs.get(seq)
    }

    /// Issues pending table work (page copies, then table/length patches) on `stream`.
    /// On failure the pending work is kept for the next call.
    pub(crate) fn flush(&self, st: &mut PoolState, stream: Stream) -> Result<()> {
        self.exec.sync_tables(st, stream)
    }

    /// Adds an empty sequence and returns its id (the lowest free slot).
    pub fn seq_add(&self, stream: Stream) -> Result<SeqId> {
        let mut st = self.lock();
        let slot = st.seqs.free_slot()?;
        st.seqs.fill(
            slot,
            SeqState {
                pages: Vec::new(),
                len: 0,
            },
        );
        st.set_len(slot, 0);
        self.flush(&mut st, stream)?;
        Ok(slot as SeqId)
    }

    /// Frees a sequence and releases its pages.
    pub fn seq_free(&self, seq: SeqId, stream: Stream) -> Result<()> {
        let mut st = self.lock();
        let s = st.seqs.remove(seq)?;
        for p in s.pages {
            st.alloc.release(p);
        }
        st.set_len(seq as usize, 0);
        self.flush(&mut st, stream)
    }

    /// Creates a sequence that shares all of `src`'s pages (reference counted); either side
    /// copies a shared partial page before appending into it.
    pub fn seq_fork(&self, src: SeqId, stream: Stream) -> Result<SeqId> {
        let mut st = self.lock();
        let parent = self.live(&st, src)?.clone();
        let slot = st.seqs.free_slot()?;
        for (i, &p) in parent.pages.iter().enumerate() {
            st.alloc.retain(p);
            st.set_table(slot, i, p);
        }
        st.set_len(slot, parent.len);
        st.seqs.fill(slot, parent);
        self.flush(&mut st, stream)?;
        Ok(slot as SeqId)
    }

    /// Shortens a sequence to `len` tokens (speculative rollback), releasing whole pages.
    pub fn seq_truncate(&self, seq: SeqId, len: usize, stream: Stream) -> Result<()> {
        let mut st = self.lock();
        let cur = self.live(&st, seq)?.len;
        let slot = seq as usize;
        if len > cur {
            return Err(Error::OutOfRange(format!(
                "cannot truncate sequence {seq} to {len} tokens: it has {cur}"
            )));
        }
        self.truncate_locked(&mut st, slot, len);
        self.flush(&mut st, stream)
    }

    /// Shortens live `slot` to `len` (<= its length) on the host, releasing whole pages.
    pub(crate) fn truncate_locked(&self, st: &mut PoolState, slot: usize, len: usize) {
        let keep = len.div_ceil(self.cfg.page_size);
        let released: Vec<u32> = {
            let s = st.seq_mut(slot);
            s.len = len;
            s.pages.split_off(keep)
        };
        for p in released {
            st.alloc.release(p);
        }
        st.set_len(slot, len);
    }

    /// Gives live `slot` its own copy of its page `index` if another sequence shares it
    /// (the copy is queued for the next flush); needs one free page in that case.
    pub(crate) fn make_page_private(&self, st: &mut PoolState, slot: usize, index: usize) {
        let page = st.seq(slot).pages[index];
        if st.alloc.refcount(page) > 1 {
            let fresh = st.alloc.alloc_n(1).expect("counted by the caller")[0];
            st.page_copies.push((page, fresh));
            st.alloc.release(page);
            st.seq_mut(slot).pages[index] = fresh;
            st.set_table(slot, index, fresh);
        }
    }

    /// Length of a sequence.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        let st = self.lock();
        Ok(self.live(&st, seq)?.len)
    }

    /// The block table of a sequence (page ids, one per `page_size` tokens).
    pub fn seq_pages(&self, seq: SeqId) -> Result<Vec<u32>> {
        let st = self.lock();
        Ok(self.live(&st, seq)?.pages.clone())
    }

    /// Pages needed to grow `s` by `n` tokens, counting a copy-on-write page.
    fn pages_needed(&self, alloc: &BlockAllocator, s: &SeqState, n: usize) -> usize {
        self.pages_needed_in_batch(alloc, s, n, &mut Vec::new())
    }

    /// As [`Self::pages_needed`] for one sequence of a batch, where `copied` counts the
    /// copy-on-write copies the earlier sequences of the batch make of each page (each
    /// drops one reference before this sequence's turn); records this sequence's copy.
    fn pages_needed_in_batch(
        &self,
        alloc: &BlockAllocator,
        s: &SeqState,
        n: usize,
        copied: &mut Vec<(u32, u32)>,
    ) -> usize {
        if n == 0 {
            return 0;
        }
        let ps = self.cfg.page_size;
        let new_pages = (s.len + n).div_ceil(ps) - s.pages.len();
        if s.len % ps == 0 {
            return new_pages;
        }
        let last = *s.pages.last().expect("partial page");
        let done = copied.iter().find(|c| c.0 == last).map_or(0, |c| c.1);
        if alloc.refcount(last) - done <= 1 {
            return new_pages;
        }
        match copied.iter_mut().find(|c| c.0 == last) {
            Some(c) => c.1 += 1,
            None => copied.push((last, 1)),
        }
        new_pages + 1
    }

    /// Whether a new sequence of `tokens` (`seq = None`) or growing `seq` by `tokens` fits.
    pub fn admit(&self, seq: Option<SeqId>, tokens: usize) -> Result<Admission> {
        let st = self.lock();
        let (len, needed, slot_free) = match seq {
            None => (
                0,
                tokens.div_ceil(self.cfg.page_size),
                st.seqs.free_slot().is_ok(),
            ),
            Some(q) => {
                let s = self.live(&st, q)?;
                (s.len, self.pages_needed(&st.alloc, s, tokens), true)
            }
        };
        let total_pages = (len + tokens).div_ceil(self.cfg.page_size);
        if len + tokens > self.cfg.max_seq_len || total_pages > self.cfg.capacity_pages {
            return Ok(Admission::Never);
        }
        if needed > st.alloc.free_count() || !slot_free {
            return Ok(Admission::Later);
        }
        Ok(Admission::Ok)
    }

    /// Reserves `count` more positions in each listed sequence, allocating pages (and
    /// copying a shared partial last page first). All or nothing: if the pages do not all
    /// fit, nothing changes and the error is `PoolExhausted`.
    pub fn extend(&self, grow: &[(SeqId, usize)], stream: Stream) -> Result<()> {
        let mut st = self.lock();
        self.extend_locked(&mut st, grow)?;
        self.flush(&mut st, stream)
    }

    pub(crate) fn extend_locked(&self, st: &mut PoolState, grow: &[(SeqId, usize)]) -> Result<()> {
        let mut needed = 0usize;
        // Copy-on-write pages already counted in this batch: (page, copies). A sequence
        // that copies a shared page drops its reference, so a later sequence of the batch
        // sharing that page may own it alone by its turn (as in sequential calls).
        let mut copied: Vec<(u32, u32)> = Vec::new();
        for (i, &(seq, n)) in grow.iter().enumerate() {
            let s = self.live(st, seq)?;
            if grow[..i].iter().any(|&(q, _)| q == seq) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} is listed twice"
                )));
            }
            if s.len + n > self.cfg.max_seq_len {
                return Err(Error::OutOfRange(format!(
                    "sequence {seq} would reach {} tokens; max_seq_len is {}",
                    s.len + n,
                    self.cfg.max_seq_len
                )));
            }
            needed += self.pages_needed_in_batch(&st.alloc, s, n, &mut copied);
        }
        if needed > st.alloc.free_count() {
            return Err(Error::PoolExhausted(format!(
                "{needed} pages needed, {} free",
                st.alloc.free_count()
            )));
        }
        let ps = self.cfg.page_size;
        for &(seq, n) in grow {
            if n == 0 {
                continue;
            }
            let slot = seq as usize;
            let (len, npages, last) = {
                let s = st.seq(slot);
                (s.len, s.pages.len(), s.pages.last().copied())
            };
            if len % ps != 0 {
                let last = last.expect("partial page");
                if st.alloc.refcount(last) > 1 {
                    let fresh = st.alloc.alloc_n(1).expect("counted")[0];
                    st.page_copies.push((last, fresh));
                    st.alloc.release(last);
                    st.seq_mut(slot).pages[npages - 1] = fresh;
                    st.set_table(slot, npages - 1, fresh);
                }
            }
            let add = (len + n).div_ceil(ps) - npages;
            let fresh = st.alloc.alloc_n(add).expect("counted");
            for (j, &p) in fresh.iter().enumerate() {
                st.set_table(slot, npages + j, p);
            }
            let s = st.seq_mut(slot);
            s.pages.extend_from_slice(&fresh);
            s.len = len + n;
            st.set_len(slot, len + n);
        }
        Ok(())
    }

    /// Checks a `write`: counts within the sequences, the written positions in pages no
    /// other sequence shares, and K/V shaped `[tokens, kv_heads, head_dim]` (one layer) or
    /// `[layers, tokens, kv_heads, head_dim]` (all layers, `layer = None`).
    fn check_write(
        &self,
        st: &PoolState,
        layer: Option<usize>,
        groups: &[(SeqId, usize)],
        k: &TensorView,
        v: &TensorView,
        extending: bool,
    ) -> Result<usize> {
        layer_range(layer, self.cfg.layers)?;
        let total: usize = groups.iter().map(|g| g.1).sum();
        let ps = self.cfg.page_size;
        for (i, &(seq, n)) in groups.iter().enumerate() {
            let s = self.live(st, seq)?;
            if grow_dup(groups, i) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} is listed twice"
                )));
            }
            if !extending {
                if n > s.len {
                    return Err(Error::OutOfRange(format!(
                        "cannot write the last {n} positions of sequence {seq}: it has {}",
                        s.len
                    )));
                }
                if n > 0 {
                    for pi in (s.len - n) / ps..s.len.div_ceil(ps) {
                        if st.alloc.refcount(s.pages[pi]) > 1 {
                            return Err(Error::InvalidArgument(format!(
                                "position {} of sequence {seq} is in a page shared with another \
                                 sequence; extend the sequence and write only the new positions",
                                (pi * ps).max(s.len - n)
                            )));
                        }
                    }
                }
            }
        }
        let (h, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        let want: Vec<usize> = match layer {
            Some(_) => vec![total, h, d],
            None => vec![self.cfg.layers, total, h, d],
        };
        for (name, t) in [("k", k), ("v", v)] {
            if t.shape() != want.as_slice() {
                return Err(Error::InvalidArgument(format!(
                    "{name} has shape {:?}; expected {want:?} ([layers,] tokens, kv_heads, head_dim)",
                    t.shape()
                )));
            }
            check_float(t, name)?;
            if self.ctx.backend() == BackendKind::Cpu && t.memory() == MemoryKind::Cuda {
                return Err(Error::InvalidArgument(format!(
                    "{name} is in CUDA memory but the pool is on the CPU"
                )));
            }
        }
        if groups.len() > MAX_WRITE_GROUPS * 64 {
            return Err(Error::OutOfRange(format!(
                "{} sequences in one write; at most {}",
                groups.len(),
                MAX_WRITE_GROUPS * 64
            )));
        }
        Ok(total)
    }

    fn do_write(
        &self,
        st: &PoolState,
        layer: Option<usize>,
        groups: &[(SeqId, usize)],
        k: &TensorView,
        v: &TensorView,
        stream: Stream,
    ) -> Result<()> {
        // (slot, first position, count, first source token)
        let mut placed = Vec::with_capacity(groups.len());
        let mut off = 0usize;
        for &(seq, n) in groups {
            if n == 0 {
                continue;
            }
            let len = st.seq(seq as usize).len;
            placed.push((seq as usize, len - n, n, off));
            off += n;
        }
        if placed.is_empty() {
            return Ok(());
        }
        let layers = layer_range(layer, self.cfg.layers)?;
        self.exec.write_tokens(st, layers, &placed, k, v, stream)
    }

    /// Writes K and V for the last `count` positions of each listed sequence, for one layer
    /// (`Some(l)`, tensors `[tokens, kv_heads, head_dim]`) or all layers (`None`, tensors
    /// `[layers, tokens, kv_heads, head_dim]`); tokens are in list order. Sources may be
    /// host or (CUDA) device memory of any float dtype and any strides.
    pub fn write(
        &self,
        layer: Option<usize>,
        groups: &[(SeqId, usize)],
        k: &TensorView,
        v: &TensorView,
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.lock();
        self.check_write(&st, layer, groups, k, v, false)?;
        self.flush(&mut st, stream)?;
        self.do_write(&st, layer, groups, k, v, stream)
    }

    /// Appends `n` tokens to one sequence for all layers (`extend` + `write`), K and V
    /// shaped `[layers, n, kv_heads, head_dim]`; `n` comes from the tensors.
    pub fn append(&self, seq: SeqId, k: &TensorView, v: &TensorView, stream: Stream) -> Result<()> {
        let mut st = self.lock();
        let n = if k.ndim() == 4 { k.shape()[1] } else { 0 };
        let groups = [(seq, n)];
        self.check_write(&st, None, &groups, k, v, true)?;
        self.extend_locked(&mut st, &groups)?;
        self.flush(&mut st, stream)?;
        self.do_write(&st, None, &groups, k, v, stream)
    }

    /// Occupancy counts.
    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        let ps = self.cfg.page_size;
        // Tokens held by each used page: the most any sequence keeps in it.
        let mut filled = vec![0u32; self.cfg.capacity_pages];
        let mut sequences = 0;
        let mut tokens = 0;
        for (_, s) in st.seqs.iter() {
            sequences += 1;
            tokens += s.len;
            for (i, &p) in s.pages.iter().enumerate() {
                let n = (s.len - i * ps).min(ps) as u32;
                filled[p as usize] = filled[p as usize].max(n);
            }
        }
        let used = st.alloc.used_count();
        let held: usize = filled.iter().map(|&n| n as usize).sum();
        PoolStats {
            pages_total: self.cfg.capacity_pages,
            pages_used: used,
            pages_free: st.alloc.free_count(),
            pages_shared: st.alloc.shared_count(),
            sequences,
            tokens,
            waste_slots: used * ps - held,
            page_bytes: self.cfg.page_bytes(),
        }
    }

    /// Attention of `io.q` over the KV of `layer` for the sequences in `io.seq_ids` (see
    /// [`DecodeIo`]).
    pub fn decode(
        &self,
        layer: usize,
        io: &DecodeIo<'_>,
        opts: &DecodeOptions,
        stream: Stream,
    ) -> Result<()> {
        let st = self.lock();
        let plan = decode::check(&self.cfg, self.ctx.backend(), &st, layer, io, opts)?;
        self.exec.decode(&self.layout[layer], &st, &plan, stream)
    }
}

fn grow_dup(groups: &[(SeqId, usize)], i: usize) -> bool {
    groups[..i].iter().any(|&(q, _)| q == groups[i].0)
}

fn check_external_layout(
    cfg: &KvPoolConfig,
    l: usize,
    lay: &LayerLayout,
    backend: BackendKind,
) -> Result<()> {
    let elem = cfg.dtype.size();
    for (name, addr, strides) in [("k", lay.k, lay.k_strides), ("v", lay.v, lay.v_strides)] {
        if addr == 0 {
            return Err(Error::NullArgument(format!(
                "layer {l}: {name} pointer is NULL"
            )));
        }
        if addr % elem != 0 {
            return Err(Error::InvalidArgument(format!(
                "layer {l}: {name} pointer is not aligned to {elem} bytes"
            )));
        }
        let [sp, sh, st] = strides;
        if st < cfg.head_dim || sh < cfg.head_dim || sp < cfg.head_dim {
            return Err(Error::InvalidArgument(format!(
                "layer {l}: {name} strides {strides:?} (page, head, token) must each be at least \
                 head_dim ({}) so rows do not overlap",
                cfg.head_dim
            )));
        }
        // The view over every element must not overlap itself.
        let view = TensorView::new(
            addr,
            cfg.dtype,
            MemoryKind::Host,
            &[
                cfg.capacity_pages,
                cfg.kv_heads,
                cfg.page_size,
                cfg.head_dim,
            ],
            &[sp as isize, sh as isize, st as isize, 1],
        )
        .map_err(|e| Error::InvalidArgument(format!("layer {l}: {name}: {e}")))?;
        if !view.is_non_overlapping() {
            return Err(Error::InvalidArgument(format!(
                "layer {l}: {name} strides {strides:?} make pages, heads or tokens overlap"
            )));
        }
        if backend == BackendKind::Cuda
            && (addr % 16 != 0 || strides.iter().any(|&s| (s * elem) % 16 != 0))
        {
            return Err(Error::InvalidArgument(format!(
                "layer {l}: on CUDA, {name}'s pointer and strides must be multiples of 16 bytes \
                 (the decode kernel moves 16-byte chunks)"
            )));
        }
    }
    Ok(())
}
