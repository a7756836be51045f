//! The replay core on host memory (CPU backend): the slot operations every family shares,
//! built on `math`, and the CPU executor that runs them with the family's step.

#![allow(clippy::needless_range_loop)] // index-heavy math reads clearer with indices

use std::sync::Arc;

use half::{bf16, f16};

use super::config::ReplayConfig;
use super::exec::{Commit, Executor, Step};
use super::meta::{
    self, Meta, META_CONV_END, META_H, META_INTS, META_MODE, META_PENDING, META_START,
    MODE_KV_ONLY, MODE_RECURRENT, MODE_REPLAY,
};
use super::storage::Layout;
use crate::backend::cpu::CpuBackend;
use crate::backend::Stream;
use crate::error::Result;
use crate::linear::math::{self, Entry, StateLayout};
use crate::tensor::{DType, TensorView};

// Element `i` of an array of `dtype` at `addr`. The address may be aligned to 2 bytes only:
// KV-only entries and their f32 log decays live inside a head's state memory, which for a
// bf16 state (odd dk * dv, or an external seq_stride that is odd) starts on any even byte.
#[inline]
pub(crate) fn load(addr: usize, dtype: DType, i: usize) -> f32 {
    // SAFETY: callers pass addresses inside the pool's memory or a checked view; the
    // unaligned reads need no alignment.
    unsafe {
        match dtype {
            DType::F32 => (addr as *const f32).add(i).read_unaligned(),
            DType::F16 => (addr as *const f16).add(i).read_unaligned().to_f32(),
            DType::BF16 => (addr as *const bf16).add(i).read_unaligned().to_f32(),
            DType::I32 => (addr as *const i32).add(i).read_unaligned() as f32,
        }
    }
}

#[inline]
pub(crate) fn store(addr: usize, dtype: DType, i: usize, x: f32) {
    // SAFETY: as in `load`.
    unsafe {
        match dtype {
            DType::F32 => (addr as *mut f32).add(i).write_unaligned(x),
            DType::F16 => (addr as *mut f16).add(i).write_unaligned(f16::from_f32(x)),
            DType::BF16 => (addr as *mut bf16)
                .add(i)
                .write_unaligned(bf16::from_f32(x)),
            DType::I32 => (addr as *mut i32).add(i).write_unaligned(x as i32),
        }
    }
}

/// Elements `0..n` of an array of `dtype` at `addr` (as `load`, one dtype dispatch).
pub(crate) fn load_n(addr: usize, dtype: DType, n: usize) -> Vec<f32> {
    fn each<T>(addr: usize, n: usize, f: impl Fn(T) -> f32) -> Vec<f32> {
        // SAFETY: as in `load`.
        (0..n)
            .map(|i| f(unsafe { (addr as *const T).add(i).read_unaligned() }))
            .collect()
    }
    match dtype {
        DType::F32 => each(addr, n, |x: f32| x),
        DType::F16 => each(addr, n, |x: f16| x.to_f32()),
        DType::BF16 => each(addr, n, |x: bf16| x.to_f32()),
        DType::I32 => each(addr, n, |x: i32| x as f32),
    }
}

/// Stores `x` as an array of `dtype` at `addr` (as `store`, one dtype dispatch).
pub(crate) fn store_n(addr: usize, dtype: DType, x: &[f32]) {
    fn each<T>(addr: usize, x: &[f32], f: impl Fn(f32) -> T) {
        for (i, &v) in x.iter().enumerate() {
            // SAFETY: as in `load`.
            unsafe { (addr as *mut T).add(i).write_unaligned(f(v)) }
        }
    }
    match dtype {
        DType::F32 => each(addr, x, |v| v),
        DType::F16 => each(addr, x, f16::from_f32),
        DType::BF16 => each(addr, x, bf16::from_f32),
        DType::I32 => each(addr, x, |v| v as i32),
    }
}

/// Rounds to what storing as `dtype` keeps.
pub fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Rounds every element of `v` to what storing as `dtype` keeps.
pub fn round_all(dtype: DType, v: &mut [f32]) {
    match dtype {
        DType::F16 | DType::BF16 => v.iter_mut().for_each(|x| *x = round(dtype, *x)),
        _ => {}
    }
}

/// Element offset of `idx` in a view.
fn off(t: &TensorView, idx: &[usize]) -> isize {
    idx.iter()
        .zip(t.strides())
        .map(|(&i, &s)| i as isize * s)
        .sum()
}

pub(crate) fn read_vec(t: &TensorView, idx: &[usize], n: usize) -> Vec<f32> {
    let o = off(t, idx);
    let ds = *t.strides().last().unwrap();
    let base = (t.addr() as isize + o * t.dtype().size() as isize) as usize;
    if ds == 1 {
        return load_n(base, t.dtype(), n);
    }
    (0..n)
        .map(|i| {
            load(
                (base as isize + i as isize * ds * t.dtype().size() as isize) as usize,
                t.dtype(),
                0,
            )
        })
        .collect()
}

pub(crate) fn write_vec(t: &TensorView, idx: &[usize], x: &[f32]) {
    let o = off(t, idx);
    let ds = *t.strides().last().unwrap();
    let base = t.addr() as isize + o * t.dtype().size() as isize;
    if ds == 1 {
        return store_n(base as usize, t.dtype(), x);
    }
    for (i, &v) in x.iter().enumerate() {
        store(
            (base + i as isize * ds * t.dtype().size() as isize) as usize,
            t.dtype(),
            0,
            v,
        );
    }
}

/// The parts of one (layer, sequence slot), with the element access the CPU executor needs.
pub struct Slot<'a> {
    /// The pool's configuration.
    pub cfg: &'a ReplayConfig,
    lay: &'a Layout,
    layer: usize,
    seq: usize,
}

impl<'a> Slot<'a> {
    /// (layer, slot) of the pool laid out as `lay`.
    pub fn new(lay: &'a Layout, layer: usize, seq: usize) -> Self {
        Slot {
            cfg: &lay.cfg,
            lay,
            layer,
            seq,
        }
    }
    fn meta_ptr(&self) -> *mut i32 {
        self.lay.meta(self.layer, self.seq) as *mut i32
    }
    /// The metadata record.
    pub fn read_meta(&self) -> Meta {
        let mut m = [0; META_INTS];
        // SAFETY: the pool's host metadata.
        unsafe { std::ptr::copy_nonoverlapping(self.meta_ptr(), m.as_mut_ptr(), META_INTS) };
        m
    }
    /// Replaces the metadata record.
    pub fn write_meta(&self, m: &Meta) {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), self.meta_ptr(), META_INTS) };
    }
    /// Address of value head `h`'s state (dk * dv elements).
    pub fn state(&self, h: usize) -> usize {
        self.lay.head_state(self.layer, self.seq, h)
    }
    /// Address of draft `draft`'s snapshot of value head `h`.
    pub fn snapshot(&self, draft: usize, h: usize) -> usize {
        self.lay.snapshot(self.layer, self.seq, draft, h)
    }
    fn conv(&self, i: usize) -> usize {
        self.lay.conv(self.layer, self.seq, i)
    }
    /// Value head `h`'s state as f32.
    pub fn read_state(&self, addr: usize) -> Vec<f32> {
        let c = self.cfg;
        load_n(addr, c.state_dtype, c.dk * c.dv)
    }
    /// Stores a head's state (rounded to the state dtype).
    pub fn write_state(&self, addr: usize, s: &[f32]) {
        store_n(addr, self.cfg.state_dtype, s);
    }

    /// The committed entries of head `h` (oldest first) as owned vectors.
    pub fn entries(&self, meta: &Meta, h: usize) -> Vec<(Vec<f32>, Vec<f32>, f32)> {
        let c = self.cfg;
        let e = c.entry_dtype;
        let kh = h / (c.v_heads / c.k_heads);
        let (l, s) = (self.layer, self.seq);
        let n = meta[META_H] as usize;
        let read = |addr: usize, n: usize| load_n(addr, e, n);
        (0..n)
            .map(|j| {
                if meta[META_MODE] == MODE_KV_ONLY {
                    (
                        read(self.lay.kv_u(l, s, h, j), c.dv),
                        read(self.lay.kv_k(l, s, h, j), c.dk),
                        load(self.lay.kv_g(l, s, h, j), DType::F32, 0),
                    )
                } else {
                    let pos = (meta[META_START] as usize + j) % c.ring_len;
                    (
                        read(self.lay.ring_u(l, s, pos, h), c.dv),
                        read(self.lay.ring_k(l, s, pos, kh), c.dk),
                        load(self.lay.ring_g(l, s, pos, h), DType::F32, 0),
                    )
                }
            })
            .collect()
    }

    /// Stores entry `j` (KV-only: u, k and g inside head `h`'s state memory) or ring
    /// position `j` (replay: u and g of head `h`; ring keys are shared by the heads of a
    /// group and are written per sequence afterwards, see `put_ring_key`).
    pub fn put_entry(&self, kv_only: bool, j: usize, h: usize, u: &[f32], k: &[f32], g: f32) {
        let e = self.cfg.entry_dtype;
        let (l, s) = (self.layer, self.seq);
        let put = |addr: usize, x: &[f32]| store_n(addr, e, x);
        if kv_only {
            put(self.lay.kv_u(l, s, h, j), u);
            put(self.lay.kv_k(l, s, h, j), k);
            store(self.lay.kv_g(l, s, h, j), DType::F32, 0, g);
        } else {
            put(self.lay.ring_u(l, s, j, h), u);
            store(self.lay.ring_g(l, s, j, h), DType::F32, 0, g);
        }
    }

    /// Stores the key of key head `kh` at ring position `pos`.
    pub fn put_ring_key(&self, pos: usize, kh: usize, k: &[f32]) {
        let e = self.cfg.entry_dtype;
        store_n(self.lay.ring_k(self.layer, self.seq, pos, kh), e, k);
    }

    /// Stores conv input `x` at conv-window slot `i`.
    pub fn put_conv(&self, i: usize, x: &[f32]) {
        store_n(self.conv(i), self.cfg.conv_dtype, x);
    }
}

/// Borrowed entries.
pub fn entry_refs(v: &[(Vec<f32>, Vec<f32>, f32)]) -> Vec<Entry<'_>> {
    v.iter().map(|(u, k, g)| Entry { u, k, g: *g }).collect()
}

fn reset_slot(lay: &Layout, seq: usize, meta: &Meta) {
    let cfg = &lay.cfg;
    for layer in 0..cfg.layers {
        let s = Slot::new(lay, layer, seq);
        for h in 0..cfg.v_heads {
            s.write_state(s.state(h), &vec![0f32; cfg.dk * cfg.dv]);
        }
        for slot in 0..cfg.conv_slots() {
            s.put_conv(slot, &vec![0f32; cfg.conv_dim]);
        }
        s.write_meta(meta);
    }
}

fn import_state(
    lay: &Layout,
    layer: usize,
    seq: usize,
    state: &TensorView,
    conv: Option<&TensorView>,
) {
    let cfg = &lay.cfg;
    let s = Slot::new(lay, layer, seq);
    let inner = match cfg.layout {
        StateLayout::KMajor => (cfg.dk, cfg.dv),
        StateLayout::VMajor => (cfg.dv, cfg.dk),
    };
    for h in 0..cfg.v_heads {
        let mut buf = Vec::with_capacity(cfg.dk * cfg.dv);
        for r in 0..inner.0 {
            buf.extend(read_vec(state, &[h, r, 0], inner.1));
        }
        s.write_state(s.state(h), &buf);
    }
    let mut m = s.read_meta();
    m[META_MODE] = meta::imported_mode(cfg);
    m[META_START] = 0;
    m[META_H] = 0;
    m[META_PENDING] = 0;
    if let Some(cw) = conv {
        for i in 0..cfg.conv_kernel - 1 {
            s.put_conv(i, &read_vec(cw, &[i, 0], cfg.conv_dim));
        }
        m[META_CONV_END] = (cfg.conv_kernel - 1) as i32;
    }
    s.write_meta(&m);
}

/// The current state of head `h` (checkpoint and ring, or the entries alone).
pub fn current_state(s: &Slot<'_>, meta: &Meta, h: usize) -> Vec<f32> {
    state_after(s, meta, h, meta[META_H] as usize)
}

/// The state of head `h` after the checkpoint and the first `keep` entries.
fn state_after(s: &Slot<'_>, meta: &Meta, h: usize, keep: usize) -> Vec<f32> {
    let c = s.cfg;
    if meta[META_MODE] == MODE_RECURRENT {
        return s.read_state(s.state(h));
    }
    let mut ents = s.entries(meta, h);
    ents.truncate(keep);
    let s0 = (meta[META_MODE] == MODE_REPLAY).then(|| s.read_state(s.state(h)));
    let mut out = vec![0f32; c.dk * c.dv];
    math::materialize(
        s0.as_deref(),
        c.layout,
        c.dk,
        c.dv,
        &entry_refs(&ents),
        &mut out,
    );
    out
}

fn conv_window_out(s: &Slot<'_>, end: i32, dst: &TensorView, idx_prefix: &[usize]) {
    let c = s.cfg;
    let slots = c.conv_slots() as i32;
    for i in 0..c.conv_kernel - 1 {
        let slot = (end - (c.conv_kernel as i32 - 1) + i as i32).rem_euclid(slots) as usize;
        let x = load_n(s.conv(slot), c.conv_dtype, c.conv_dim);
        let mut idx = idx_prefix.to_vec();
        idx.extend([i, 0]);
        write_vec(dst, &idx, &x);
    }
}

/// Writes the state of (layer, seq) after `keep` entries (None: all) into `out` at index
/// `lead` (`[]`, or `[layer]` for a materialize), and the conv window at that point.
fn export_state(
    lay: &Layout,
    layer: usize,
    seq: usize,
    keep: Option<usize>,
    lead: &[usize],
    out: &TensorView,
    conv_out: Option<&TensorView>,
) {
    let cfg = &lay.cfg;
    let s = Slot::new(lay, layer, seq);
    let meta = s.read_meta();
    let fill = meta[META_H] as usize;
    let keep = keep.unwrap_or(fill).min(fill);
    let inner = match cfg.layout {
        StateLayout::KMajor => (cfg.dk, cfg.dv),
        StateLayout::VMajor => (cfg.dv, cfg.dk),
    };
    for h in 0..cfg.v_heads {
        let cur = state_after(&s, &meta, h, keep);
        for r in 0..inner.0 {
            let idx: Vec<usize> = lead.iter().copied().chain([h, r, 0]).collect();
            write_vec(out, &idx, &cur[r * inner.1..(r + 1) * inner.1]);
        }
    }
    if let Some(cw) = conv_out {
        let end = meta[META_CONV_END] - (fill - keep) as i32;
        conv_window_out(&s, end, cw, lead);
    }
}

/// Writes the current state into the checkpoint and empties the ring.
fn flush_slot(s: &Slot<'_>, meta: &mut Meta) {
    let c = s.cfg;
    if meta[META_MODE] == MODE_RECURRENT {
        return;
    }
    for h in 0..c.v_heads {
        let mut cur = current_state(s, meta, h);
        round_all(c.state_dtype, &mut cur);
        s.write_state(s.state(h), &cur);
    }
    meta::flushed(c, meta);
}

fn flush(lay: &Layout, layer: usize, ids: &[i32]) {
    for &id in ids.iter().filter(|&&i| i >= 0) {
        let s = Slot::new(lay, layer, id as usize);
        let mut m = s.read_meta();
        flush_slot(&s, &mut m);
        s.write_meta(&m);
    }
}

fn commit(
    lay: &Layout,
    layer: usize,
    ids: &[i32],
    accepted: &[i32],
    conv_state: Option<&TensorView>,
) {
    let cfg = &lay.cfg;
    for (b, &id) in ids.iter().enumerate() {
        if id < 0 {
            continue;
        }
        let s = Slot::new(lay, layer, id as usize);
        let mut m = s.read_meta();
        let a = accepted[b].clamp(0, m[META_PENDING]);
        if m[META_MODE] == MODE_RECURRENT {
            if a > 0 {
                for h in 0..cfg.v_heads {
                    let snap = s.read_state(s.snapshot(a as usize - 1, h));
                    s.write_state(s.state(h), &snap);
                }
            }
        } else {
            m[META_H] += a;
        }
        m[META_CONV_END] += a;
        m[META_PENDING] = 0;
        s.write_meta(&m);
        if let Some(cs) = conv_state {
            conv_window_out(&s, m[META_CONV_END], cs, &[b]);
        }
    }
}

/// The per-sequence bookkeeping of a step on the CPU, after every head has read the old
/// metadata and entries: the new ring keys (`ring_key(row, token, key head)`, as the
/// family forms them), the flush's metadata, the conv inputs `[B, T, conv_dim]`, then the
/// committed (decode) or pending (verify) count.
pub fn finish_step(
    lay: &Layout,
    step: &Step<'_>,
    ring_key: impl Fn(usize, usize, usize) -> Vec<f32>,
    conv_in: Option<&TensorView>,
) {
    let cfg = &lay.cfg;
    let ids = step.ids.host().expect("CPU steps take host ids");
    let t_count = step.t;
    for (b, &id) in ids.iter().enumerate() {
        if id < 0 {
            continue;
        }
        let s = Slot::new(lay, step.layer, id as usize);
        let mut m = s.read_meta();
        if m[META_MODE] != MODE_RECURRENT {
            let (flush, kv_only, base) = meta::placement(cfg, &m, t_count, step.auto_commit);
            if !kv_only {
                for t in 0..t_count {
                    for kh in 0..cfg.k_heads {
                        s.put_ring_key((base + t) % cfg.ring_len, kh, &ring_key(b, t, kh));
                    }
                }
            }
            if flush {
                meta::flushed(cfg, &mut m);
            }
        }
        if let Some(ci) = conv_in {
            let slots = cfg.conv_slots() as i32;
            for t in 0..t_count {
                let slot = (m[META_CONV_END] + t as i32).rem_euclid(slots) as usize;
                s.put_conv(slot, &read_vec(ci, &[b, t, 0], cfg.conv_dim));
            }
        }
        if step.auto_commit {
            if m[META_MODE] != MODE_RECURRENT {
                m[META_H] += t_count as i32;
            }
            m[META_CONV_END] += t_count as i32;
        } else {
            m[META_PENDING] = t_count as i32;
        }
        s.write_meta(&m);
    }
}

/// The CPU executor: the slot operations above plus the step (`step.rs`) on the context's
/// thread pool.
pub struct CpuExecutor {
    cpu: Arc<CpuBackend>,
    lay: Layout,
}

impl CpuExecutor {
    /// The executor of a pool laid out as `lay` in host memory.
    pub fn new(cpu: Arc<CpuBackend>, lay: &Layout) -> Self {
        CpuExecutor {
            cpu,
            lay: lay.clone(),
        }
    }
}

impl Executor for CpuExecutor {
    fn reset_slot(&self, slot: usize, meta: &Meta, _stream: Stream) -> Result<()> {
        reset_slot(&self.lay, slot, meta);
        Ok(())
    }
    fn import_state(
        &self,
        layer: usize,
        slot: usize,
        state: &TensorView,
        conv: Option<&TensorView>,
        _stream: Stream,
    ) -> Result<()> {
        import_state(&self.lay, layer, slot, state, conv);
        Ok(())
    }
    fn export_state(
        &self,
        layer: usize,
        slot: usize,
        out: &TensorView,
        conv_out: Option<&TensorView>,
        _stream: Stream,
    ) -> Result<()> {
        export_state(&self.lay, layer, slot, None, &[], out, conv_out);
        Ok(())
    }
    fn materialize(
        &self,
        slot: usize,
        keep: usize,
        out: &TensorView,
        conv_out: Option<&TensorView>,
        _stream: Stream,
    ) -> Result<()> {
        for l in 0..self.lay.cfg.layers {
            export_state(&self.lay, l, slot, Some(keep), &[l], out, conv_out);
        }
        Ok(())
    }
    fn step(&self, step: &Step<'_>, _stream: Stream) -> Result<()> {
        super::step::step(&self.lay, step, self.cpu.pool());
        Ok(())
    }
    fn commit(&self, c: &Commit<'_>, _stream: Stream) -> Result<()> {
        let accepted = c
            .host_accepted
            .expect("the core reads host counts for the CPU");
        for l in c.layers.clone() {
            commit(&self.lay, l, c.ids, accepted, c.conv_state);
        }
        Ok(())
    }
    fn flush(&self, layer: usize, ids: &[i32], _stream: Stream) -> Result<()> {
        flush(&self.lay, layer, ids);
        Ok(())
    }
    fn read_meta(&self, layer: usize, slot: usize) -> Result<Meta> {
        Ok(Slot::new(&self.lay, layer, slot).read_meta())
    }
}
