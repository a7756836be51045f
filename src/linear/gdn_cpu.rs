//! The GDN pool's operations on host memory (CPU backend), built on `math`.

#![allow(clippy::needless_range_loop)] // index-heavy math reads clearer with indices

use half::{bf16, f16};

use super::gdn::{
    GdnConfig, StepPlan, Storage, META_CONV_END, META_H, META_INTS, META_MODE, META_PENDING,
    META_START, MODE_KV_ONLY, MODE_RECURRENT, MODE_REPLAY,
};
use super::math::{self, Draft, Entry};
use crate::backend::cpu::ThreadPool;
use crate::tensor::{DType, TensorView};

#[inline]
fn load(addr: usize, dtype: DType, i: usize) -> f32 {
    // SAFETY: callers pass addresses inside the pool's memory or a checked view.
    unsafe {
        match dtype {
            DType::F32 => (addr as *const f32).add(i).read(),
            DType::F16 => (addr as *const f16).add(i).read().to_f32(),
            DType::BF16 => (addr as *const bf16).add(i).read().to_f32(),
            DType::I32 => (addr as *const i32).add(i).read() as f32,
        }
    }
}

#[inline]
fn store(addr: usize, dtype: DType, i: usize, x: f32) {
    // SAFETY: as in `load`.
    unsafe {
        match dtype {
            DType::F32 => (addr as *mut f32).add(i).write(x),
            DType::F16 => (addr as *mut f16).add(i).write(f16::from_f32(x)),
            DType::BF16 => (addr as *mut bf16).add(i).write(bf16::from_f32(x)),
            DType::I32 => (addr as *mut i32).add(i).write(x as i32),
        }
    }
}

/// Rounds to what storing as `dtype` keeps.
pub(crate) fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Element offset of `idx` in a view.
fn off(t: &TensorView, idx: &[usize]) -> isize {
    idx.iter()
        .zip(t.strides())
        .map(|(&i, &s)| i as isize * s)
        .sum()
}

fn read_vec(t: &TensorView, idx: &[usize], n: usize) -> Vec<f32> {
    let o = off(t, idx);
    let ds = *t.strides().last().unwrap();
    let base = (t.addr() as isize + o * t.dtype().size() as isize) as usize;
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

fn write_vec(t: &TensorView, idx: &[usize], x: &[f32]) {
    let o = off(t, idx);
    let ds = *t.strides().last().unwrap();
    let base = t.addr() as isize + o * t.dtype().size() as isize;
    for (i, &v) in x.iter().enumerate() {
        store(
            (base + i as isize * ds * t.dtype().size() as isize) as usize,
            t.dtype(),
            0,
            v,
        );
    }
}

/// Addresses of the pool's parts for one (layer, sequence).
pub(crate) struct Slot<'a> {
    cfg: &'a GdnConfig,
    st: &'a Storage,
    layer: usize,
    seq: usize,
}

impl<'a> Slot<'a> {
    pub(crate) fn new(cfg: &'a GdnConfig, st: &'a Storage, layer: usize, seq: usize) -> Self {
        Slot {
            cfg,
            st,
            layer,
            seq,
        }
    }
    fn ls(&self) -> usize {
        self.layer * self.cfg.max_seqs + self.seq
    }
    pub(crate) fn meta(&self) -> *mut i32 {
        (self.st.meta + self.ls() * META_INTS * 4) as *mut i32
    }
    fn read_meta(&self) -> [i32; META_INTS] {
        let mut m = [0; META_INTS];
        // SAFETY: the pool's host metadata.
        unsafe { std::ptr::copy_nonoverlapping(self.meta(), m.as_mut_ptr(), META_INTS) };
        m
    }
    fn write_meta(&self, m: &[i32; META_INTS]) {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), self.meta(), META_INTS) };
    }
    /// Address of value head `h`'s state (dk * dv elements).
    fn state(&self, h: usize) -> usize {
        let c = self.cfg;
        let s = &self.st.states[self.layer];
        s.addr + (self.seq * s.seq_stride + h * c.dk * c.dv) * c.state_dtype.size()
    }
    fn snapshot(&self, draft: usize, h: usize) -> usize {
        let c = self.cfg;
        self.st.snaps
            + ((self.ls() * c.max_drafts + draft) * c.seq_state_elems() + h * c.dk * c.dv)
                * c.state_dtype.size()
    }
    fn ring_u(&self, pos: usize, h: usize) -> usize {
        let c = self.cfg;
        self.st.ring_u
            + (((self.ls() * c.ring_len + pos) * c.v_heads + h) * c.dv) * c.entry_dtype.size()
    }
    fn ring_k(&self, pos: usize, kh: usize) -> usize {
        let c = self.cfg;
        self.st.ring_k
            + (((self.ls() * c.ring_len + pos) * c.k_heads + kh) * c.dk) * c.entry_dtype.size()
    }
    fn ring_g(&self, pos: usize, h: usize) -> usize {
        let c = self.cfg;
        self.st.ring_g + ((self.ls() * c.ring_len + pos) * c.v_heads + h) * 4
    }
    /// KV-only entries of value head `h` inside its state memory.
    fn kv_u(&self, j: usize, h: usize) -> usize {
        self.state(h) + j * self.cfg.dv * self.cfg.entry_dtype.size()
    }
    fn kv_k(&self, j: usize, h: usize) -> usize {
        let c = self.cfg;
        self.state(h) + (c.kv_only_capacity() * c.dv + j * c.dk) * c.entry_dtype.size()
    }
    fn kv_g(&self, j: usize, h: usize) -> usize {
        let c = self.cfg;
        self.state(h) + c.kv_only_capacity() * (c.dv + c.dk) * c.entry_dtype.size() + j * 4
    }
    fn conv(&self, slot: usize) -> usize {
        let c = self.cfg;
        self.st.conv + ((self.ls() * c.conv_slots() + slot) * c.conv_dim) * c.conv_dtype.size()
    }

    fn read_state(&self, addr: usize) -> Vec<f32> {
        let c = self.cfg;
        (0..c.dk * c.dv)
            .map(|i| load(addr, c.state_dtype, i))
            .collect()
    }
    fn write_state(&self, addr: usize, s: &[f32]) {
        for (i, &x) in s.iter().enumerate() {
            store(addr, self.cfg.state_dtype, i, x);
        }
    }

    /// The committed entries of head `h` (oldest first) as owned vectors.
    fn entries(&self, meta: &[i32; META_INTS], h: usize) -> Vec<(Vec<f32>, Vec<f32>, f32)> {
        let c = self.cfg;
        let e = c.entry_dtype;
        let kh = h / (c.v_heads / c.k_heads);
        let n = meta[META_H] as usize;
        (0..n)
            .map(|j| {
                if meta[META_MODE] == MODE_KV_ONLY {
                    (
                        (0..c.dv).map(|i| load(self.kv_u(j, h), e, i)).collect(),
                        (0..c.dk).map(|i| load(self.kv_k(j, h), e, i)).collect(),
                        load(self.kv_g(j, h), DType::F32, 0),
                    )
                } else {
                    let pos = (meta[META_START] as usize + j) % c.ring_len;
                    (
                        (0..c.dv).map(|i| load(self.ring_u(pos, h), e, i)).collect(),
                        (0..c.dk)
                            .map(|i| load(self.ring_k(pos, kh), e, i))
                            .collect(),
                        load(self.ring_g(pos, h), DType::F32, 0),
                    )
                }
            })
            .collect()
    }

    /// Stores entry `j` (KV-only: u, k and g inside head `h`'s state memory) or ring
    /// position `j` (replay: u and g of head `h`; ring keys are shared by the heads of a
    /// group and are written per sequence afterwards, see `put_ring_keys`).
    fn put_entry(&self, kv_only: bool, j: usize, h: usize, u: &[f32], k: &[f32], g: f32) {
        let e = self.cfg.entry_dtype;
        if kv_only {
            u.iter()
                .enumerate()
                .for_each(|(i, &x)| store(self.kv_u(j, h), e, i, x));
            k.iter()
                .enumerate()
                .for_each(|(i, &x)| store(self.kv_k(j, h), e, i, x));
            store(self.kv_g(j, h), DType::F32, 0, g);
        } else {
            u.iter()
                .enumerate()
                .for_each(|(i, &x)| store(self.ring_u(j, h), e, i, x));
            store(self.ring_g(j, h), DType::F32, 0, g);
        }
    }

    fn put_ring_key(&self, pos: usize, kh: usize, k: &[f32]) {
        let e = self.cfg.entry_dtype;
        k.iter()
            .enumerate()
            .for_each(|(i, &x)| store(self.ring_k(pos, kh), e, i, x));
    }
}

fn entry_refs(v: &[(Vec<f32>, Vec<f32>, f32)]) -> Vec<Entry<'_>> {
    v.iter().map(|(u, k, g)| Entry { u, k, g: *g }).collect()
}

pub(crate) fn reset_slot(cfg: &GdnConfig, st: &Storage, seq: usize, meta: &[i32; META_INTS]) {
    for layer in 0..cfg.layers {
        let s = Slot::new(cfg, st, layer, seq);
        for h in 0..cfg.v_heads {
            s.write_state(s.state(h), &vec![0f32; cfg.dk * cfg.dv]);
        }
        for slot in 0..cfg.conv_slots() {
            for i in 0..cfg.conv_dim {
                store(s.conv(slot), cfg.conv_dtype, i, 0.0);
            }
        }
        s.write_meta(meta);
    }
}

pub(crate) fn import_state(
    cfg: &GdnConfig,
    st: &Storage,
    layer: usize,
    seq: usize,
    state: &TensorView,
    conv: Option<&TensorView>,
) {
    let s = Slot::new(cfg, st, layer, seq);
    let inner = match cfg.layout {
        super::math::StateLayout::KMajor => (cfg.dk, cfg.dv),
        super::math::StateLayout::VMajor => (cfg.dv, cfg.dk),
    };
    for h in 0..cfg.v_heads {
        let mut buf = Vec::with_capacity(cfg.dk * cfg.dv);
        for r in 0..inner.0 {
            buf.extend(read_vec(state, &[h, r, 0], inner.1));
        }
        s.write_state(s.state(h), &buf);
    }
    let mut m = s.read_meta();
    m[META_MODE] = if cfg.ring_len == 0 {
        MODE_RECURRENT
    } else {
        MODE_REPLAY
    };
    m[META_START] = 0;
    m[META_H] = 0;
    m[META_PENDING] = 0;
    if let Some(cw) = conv {
        for i in 0..cfg.conv_kernel - 1 {
            let x = read_vec(cw, &[i, 0], cfg.conv_dim);
            x.iter()
                .enumerate()
                .for_each(|(d, &v)| store(s.conv(i), cfg.conv_dtype, d, v));
        }
        m[META_CONV_END] = (cfg.conv_kernel - 1) as i32;
    }
    s.write_meta(&m);
}

/// The current state of head `h` (checkpoint and ring, or the entries alone).
fn current_state(s: &Slot<'_>, meta: &[i32; META_INTS], h: usize) -> Vec<f32> {
    let c = s.cfg;
    if meta[META_MODE] == MODE_RECURRENT {
        return s.read_state(s.state(h));
    }
    let ents = s.entries(meta, h);
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
        let x: Vec<f32> = (0..c.conv_dim)
            .map(|d| load(s.conv(slot), c.conv_dtype, d))
            .collect();
        let mut idx = idx_prefix.to_vec();
        idx.extend([i, 0]);
        write_vec(dst, &idx, &x);
    }
}

pub(crate) fn export_state(
    cfg: &GdnConfig,
    st: &Storage,
    layer: usize,
    seq: usize,
    out: &TensorView,
    conv_out: Option<&TensorView>,
) {
    let s = Slot::new(cfg, st, layer, seq);
    let meta = s.read_meta();
    let inner = match cfg.layout {
        super::math::StateLayout::KMajor => (cfg.dk, cfg.dv),
        super::math::StateLayout::VMajor => (cfg.dv, cfg.dk),
    };
    for h in 0..cfg.v_heads {
        let cur = current_state(&s, &meta, h);
        for r in 0..inner.0 {
            write_vec(out, &[h, r, 0], &cur[r * inner.1..(r + 1) * inner.1]);
        }
    }
    if let Some(cw) = conv_out {
        conv_window_out(&s, meta[META_CONV_END], cw, &[]);
    }
}

/// Writes the current state into the checkpoint and empties the ring.
fn flush_slot(s: &Slot<'_>, meta: &mut [i32; META_INTS]) {
    let c = s.cfg;
    if meta[META_MODE] == MODE_RECURRENT {
        return;
    }
    for h in 0..c.v_heads {
        let cur = current_state(s, meta, h);
        let rounded: Vec<f32> = cur.iter().map(|&x| round(c.state_dtype, x)).collect();
        s.write_state(s.state(h), &rounded);
    }
    flushed_meta(c, meta);
}

pub(crate) fn flush(cfg: &GdnConfig, st: &Storage, layer: usize, ids: &[i32]) {
    for &id in ids.iter().filter(|&&i| i >= 0) {
        let s = Slot::new(cfg, st, layer, id as usize);
        let mut m = s.read_meta();
        flush_slot(&s, &mut m);
        s.write_meta(&m);
    }
}

/// Whether this step flushes the ring (or materializes a KV-only sequence's state) first.
pub(crate) fn needs_flush(
    cfg: &GdnConfig,
    meta: &[i32; META_INTS],
    t: usize,
    auto_commit: bool,
) -> bool {
    let need = if auto_commit { t } else { 2 * t };
    match meta[META_MODE] {
        MODE_REPLAY => meta[META_H] as usize + need > cfg.ring_len,
        MODE_KV_ONLY => meta[META_H] as usize + need > cfg.kv_only_threshold,
        _ => false,
    }
}

/// Where a step's new entries go: (flushes first, into the KV-only store, first position).
fn placement(
    cfg: &GdnConfig,
    meta: &[i32; META_INTS],
    t: usize,
    auto_commit: bool,
) -> (bool, bool, usize) {
    let flush = needs_flush(cfg, meta, t, auto_commit);
    let (mode, start, h) = (
        meta[META_MODE],
        meta[META_START] as usize,
        meta[META_H] as usize,
    );
    match (mode, flush) {
        (MODE_KV_ONLY, false) => (false, true, h),
        (MODE_KV_ONLY, true) => (true, false, 0),
        (_, f) => (f, false, (start + h) % cfg.ring_len.max(1)),
    }
}

/// The metadata after a step's flush (if any): ring start and count, mode.
fn flushed_meta(cfg: &GdnConfig, m: &mut [i32; META_INTS]) {
    m[META_START] = if m[META_MODE] == MODE_REPLAY {
        ((m[META_START] + m[META_H]) as usize % cfg.ring_len) as i32
    } else {
        0
    };
    m[META_H] = 0;
    m[META_MODE] = MODE_REPLAY;
}

/// q and k of (row b, draft t, key head kh) as the step uses them: optionally
/// L2-normalized, q scaled; k rounded to the entry dtype when it will be buffered.
fn prep_qk(
    cfg: &GdnConfig,
    plan: &StepPlan,
    b: usize,
    t: usize,
    kh: usize,
    round_k: bool,
) -> (Vec<f32>, Vec<f32>) {
    let mut q = read_vec(&plan.q, &[b, t, kh, 0], cfg.dk);
    let mut k = read_vec(&plan.k, &[b, t, kh, 0], cfg.dk);
    if plan.l2norm {
        math::l2_normalize(&mut q);
        math::l2_normalize(&mut k);
    }
    q.iter_mut().for_each(|x| *x *= plan.scale);
    if round_k {
        k.iter_mut().for_each(|x| *x = round(cfg.entry_dtype, *x));
    }
    (q, k)
}

/// Decode or verify for every (batch row, value head), then the per-sequence bookkeeping.
pub(crate) fn step(
    cfg: &GdnConfig,
    st: &Storage,
    layer: usize,
    plan: &StepPlan,
    threads: &ThreadPool,
) {
    let ids = plan.host_ids.as_ref().expect("CPU takes host ids");
    let (hv, group) = (cfg.v_heads, cfg.v_heads / cfg.k_heads);
    let t_count = plan.t;
    threads.parallel_for(plan.b * hv, |w| {
        let (b, h) = (w / hv, w % hv);
        let id = ids[b];
        if id < 0 {
            for t in 0..t_count {
                write_vec(&plan.out, &[b, t, h, 0], &vec![0f32; cfg.dv]);
            }
            return;
        }
        let s = Slot::new(cfg, st, layer, id as usize);
        let meta = s.read_meta();
        let kh = h / group;
        let recurrent = meta[META_MODE] == MODE_RECURRENT;
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut gs = Vec::new();
        let mut betas = Vec::new();
        for t in 0..t_count {
            // Ring modes use the key as it is stored (rounded to the entry dtype).
            let (q, k) = prep_qk(cfg, plan, b, t, kh, !recurrent);
            qs.push(q);
            ks.push(k);
            vs.push(read_vec(&plan.v, &[b, t, h, 0], cfg.dv));
            gs.push(read_vec(&plan.g, &[b, t, h], 1)[0]);
            betas.push(read_vec(&plan.beta, &[b, t, h], 1)[0]);
        }
        let drafts: Vec<Draft<'_>> = (0..t_count)
            .map(|t| Draft {
                q: &qs[t],
                k: &ks[t],
                v: &vs[t],
                g: gs[t],
                beta: betas[t],
            })
            .collect();
        let mut y = vec![vec![0f32; cfg.dv]; t_count];
        if recurrent {
            let mut state = s.read_state(s.state(h));
            for t in 0..t_count {
                math::recurrent_step(
                    &mut state, cfg.layout, cfg.dk, cfg.dv, &drafts[t], &mut y[t],
                );
                let rounded: Vec<f32> = state.iter().map(|&x| round(cfg.state_dtype, x)).collect();
                if plan.auto_commit {
                    s.write_state(s.state(h), &rounded);
                } else {
                    s.write_state(s.snapshot(t, h), &rounded);
                }
                state = rounded;
            }
        } else {
            let (flush, kv_only, base) = placement(cfg, &meta, t_count, plan.auto_commit);
            let (s0, ents) = if flush {
                let cur = current_state(&s, &meta, h);
                let rounded: Vec<f32> = cur.iter().map(|&x| round(cfg.state_dtype, x)).collect();
                s.write_state(s.state(h), &rounded);
                (Some(rounded), Vec::new())
            } else if kv_only {
                (None, s.entries(&meta, h))
            } else {
                (Some(s.read_state(s.state(h))), s.entries(&meta, h))
            };
            let mut u = vec![vec![0f32; cfg.dv]; t_count];
            math::verify_head(
                s0.as_deref(),
                cfg.layout,
                cfg.dk,
                cfg.dv,
                &entry_refs(&ents),
                &drafts,
                &mut y,
                &mut u,
            );
            for t in 0..t_count {
                let ur: Vec<f32> = u[t].iter().map(|&x| round(cfg.entry_dtype, x)).collect();
                let pos = if kv_only {
                    base + t
                } else {
                    (base + t) % cfg.ring_len
                };
                s.put_entry(kv_only, pos, h, &ur, &ks[t], gs[t]);
            }
        }
        for t in 0..t_count {
            write_vec(&plan.out, &[b, t, h, 0], &y[t]);
        }
    });
    // Per-sequence bookkeeping, after every head has read the old metadata and entries.
    for (b, &id) in ids.iter().enumerate() {
        if id < 0 {
            continue;
        }
        let s = Slot::new(cfg, st, layer, id as usize);
        let mut m = s.read_meta();
        if m[META_MODE] != MODE_RECURRENT {
            let (flush, kv_only, base) = placement(cfg, &m, t_count, plan.auto_commit);
            if !kv_only {
                for t in 0..t_count {
                    for kh in 0..cfg.k_heads {
                        let (_, k) = prep_qk(cfg, plan, b, t, kh, true);
                        s.put_ring_key((base + t) % cfg.ring_len, kh, &k);
                    }
                }
            }
            if flush {
                flushed_meta(cfg, &mut m);
            }
        }
        if let Some(ci) = &plan.conv_in {
            let slots = cfg.conv_slots() as i32;
            for t in 0..t_count {
                let slot = (m[META_CONV_END] + t as i32).rem_euclid(slots) as usize;
                let x = read_vec(ci, &[b, t, 0], cfg.conv_dim);
                x.iter()
                    .enumerate()
                    .for_each(|(d, &v)| store(s.conv(slot), cfg.conv_dtype, d, v));
            }
        }
        if plan.auto_commit {
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

pub(crate) fn commit(
    cfg: &GdnConfig,
    st: &Storage,
    layer: usize,
    ids: &[i32],
    accepted: &[i32],
    conv_state: Option<&TensorView>,
) {
    for (b, &id) in ids.iter().enumerate() {
        if id < 0 {
            continue;
        }
        let s = Slot::new(cfg, st, layer, id as usize);
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
