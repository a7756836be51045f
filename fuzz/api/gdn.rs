//! The GDN pool through its C API: the input becomes a pool configuration (replay or
//! recurrent, KV-only threshold on or off, dtypes, layouts, conv windows, owned or
//! harness-owned states) and a sequence of calls (decode, verify, commit, flush, import,
//! export, add, free, reset, cursors) with valid and invalid ids, counts, shapes, dtypes,
//! strides, NULLs, struct sizes and handles. A model keeps, per (layer, sequence), the
//! cursor the header's rules predict and an f64 state advanced by the plain recurrence over
//! the accepted tokens; after every call each cursor is compared and each state without
//! pending drafts is exported and compared, outputs of valid calls are compared with the
//! reference, and a failed call must leave everything as it was and write no output.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

use kvreplay::ffi::*;

use super::common::*;

const MAX_OPS: usize = 40;

#[derive(Clone, Copy, Debug)]
struct Cfg {
    layers: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    ring: usize,
    /// `kv_only_threshold` as passed (DEFAULT, OFF or a count).
    tau_param: i32,
    /// `max_drafts` as passed (0 = default).
    drafts_param: i32,
    state_dtype: kvr_dtype,
    entry_dtype: kvr_dtype,
    vmajor: bool,
    max_seqs: usize,
    conv_dim: usize,
    conv_kernel: usize,
    conv_dtype: kvr_dtype,
    /// Harness-owned states: padding between sequence slots, in elements.
    external: Option<usize>,
}

impl Cfg {
    fn max_drafts(&self) -> usize {
        match self.drafts_param {
            0 if self.ring == 0 => 8,
            0 => self.ring.min(8),
            n => n as usize,
        }
    }
    /// KV-only entries one value head's state memory holds.
    fn capacity(&self) -> usize {
        let head = self.dk * self.dv * dsize(self.state_dtype);
        head / ((self.dk + self.dv) * dsize(self.entry_dtype) + 4)
    }
    /// The threshold the pool uses (the default is off for every pool).
    fn tau(&self) -> usize {
        match self.tau_param {
            KVR_GDN_THRESHOLD_DEFAULT => 0,
            n => n as usize,
        }
    }
    fn seq_stride(&self) -> usize {
        self.hv * self.dk * self.dv + self.external.unwrap_or(0)
    }
    fn initial_mode(&self) -> i32 {
        if self.ring == 0 {
            KVR_GDN_MODE_RECURRENT
        } else if self.tau() > 0 {
            KVR_GDN_MODE_KV_ONLY
        } else {
            KVR_GDN_MODE_REPLAY
        }
    }
    /// Shape of a state tensor (import, export).
    fn state_shape(&self) -> [usize; 3] {
        if self.vmajor {
            [self.hv, self.dv, self.dk]
        } else {
            [self.hv, self.dk, self.dv]
        }
    }
    /// Output tolerance (relative to 1 + |reference|) for the pool's storage types.
    fn tol(&self) -> f64 {
        [self.state_dtype, self.entry_dtype]
            .iter()
            .map(|&d| match d {
                KVR_DTYPE_BF16 => 6e-2,
                KVR_DTYPE_F16 => 1e-2,
                _ => 2e-3,
            })
            .fold(0.0, f64::max)
    }
}

fn out_tol(dtype: kvr_dtype) -> f64 {
    match dtype {
        KVR_DTYPE_BF16 => 1e-2,
        KVR_DTYPE_F16 => 1e-3,
        _ => 0.0,
    }
}

/// Drafts verified and awaiting commit in one layer.
#[derive(Clone, Debug)]
struct Pending {
    /// States after each draft, `[hv][dv][dk]`.
    snaps: Vec<Vec<f64>>,
    /// The drafts' conv inputs, as the pool stores them.
    conv: Vec<Vec<f32>>,
}

#[derive(Clone, Debug)]
struct LayerSeq {
    /// `[hv][dv][dk]`.
    s: Vec<f64>,
    /// The states at the checkpoint and after each token buffered since (`h + 1` of them;
    /// recurrent sequences buffer nothing: `[s]`), for materialize.
    hist: Vec<Vec<f64>>,
    /// `conv_kernel - 1` rows, oldest first, as stored (conv dtype).
    conv: Vec<Vec<f32>>,
    mode: i32,
    start: usize,
    h: usize,
    pending: Option<Pending>,
}

impl LayerSeq {
    fn new(c: &Cfg) -> Self {
        LayerSeq {
            s: vec![0.0; c.hv * c.dv * c.dk],
            hist: vec![vec![0.0; c.hv * c.dv * c.dk]],
            conv: if c.conv_dim > 0 {
                vec![vec![0.0; c.conv_dim]; c.conv_kernel - 1]
            } else {
                Vec::new()
            },
            mode: c.initial_mode(),
            start: 0,
            h: 0,
            pending: None,
        }
    }
    fn pending_t(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.snaps.len())
    }
    /// The record after a flush (meta::flushed).
    fn flushed(&mut self, c: &Cfg) {
        self.start = if self.mode == KVR_GDN_MODE_REPLAY {
            (self.start + self.h) % c.ring
        } else {
            0
        };
        self.h = 0;
        self.mode = KVR_GDN_MODE_REPLAY;
        self.hist = vec![self.s.clone()];
    }
    /// The state `keep` tokens past the checkpoint (`keep <= h`).
    fn at(&self, keep: usize) -> &[f64] {
        if self.mode == KVR_GDN_MODE_RECURRENT {
            &self.s
        } else {
            &self.hist[keep]
        }
    }
    /// Tokens accepted (decoded or committed) with their states after each.
    fn accept(&mut self, states: &[Vec<f64>]) {
        if let Some(last) = states.last() {
            self.s = last.clone();
        }
        if self.mode != KVR_GDN_MODE_RECURRENT {
            self.h += states.len();
            self.hist.extend_from_slice(states);
        }
    }
    /// Flushes first when a step of `need` entries does not fit (decode: 1, verify: 2T).
    fn before_step(&mut self, c: &Cfg, need: usize) {
        let flush = match self.mode {
            KVR_GDN_MODE_REPLAY => self.h + need > c.ring,
            KVR_GDN_MODE_KV_ONLY => self.h + need > c.tau(),
            _ => false,
        };
        if flush {
            self.flushed(c);
        }
    }
    fn push_conv(&mut self, row: Vec<f32>) {
        if !self.conv.is_empty() {
            self.conv.remove(0);
            self.conv.push(row);
        }
    }
}

/// A conv window written by the pool (`t[lead]` when given, else `t`) against the model's.
fn check_conv(c: &Cfg, window: &[Vec<f32>], t: &Tensor, lead: Option<usize>, what: &str) {
    for i in 0..c.conv_kernel - 1 {
        for d in 0..c.conv_dim {
            let got = match lead {
                Some(j) => t.get(&[j, i, d]),
                None => t.get(&[i, d]),
            };
            let want = round(t.dtype, window[i][d]);
            assert!(got == want, "{what}[{i}][{d}] = {got}, model {want}");
        }
    }
}

/// One token's inputs for one sequence, as the reference reads them.
struct TokenIn {
    /// `[hk][dk]` each.
    q: Vec<f64>,
    k: Vec<f64>,
    /// `[hv][dv]`.
    v: Vec<f64>,
    /// `[hv]` each.
    g: Vec<f64>,
    beta: Vec<f64>,
    /// `[conv_dim]`, as the pool stores it.
    conv: Vec<f32>,
}

/// One recurrent step on `s` (`[hv][dv][dk]`); returns y `[hv][dv]`.
fn recurrent(c: &Cfg, s: &mut [f64], x: &TokenIn, scale: f64, l2: bool) -> Vec<f64> {
    let (hk, hv, dk, dv) = (c.hk, c.hv, c.dk, c.dv);
    let group = hv / hk;
    let mut y = vec![0.0; hv * dv];
    for h in 0..hv {
        let kh = h / group;
        let mut q: Vec<f64> = x.q[kh * dk..(kh + 1) * dk].to_vec();
        let mut k: Vec<f64> = x.k[kh * dk..(kh + 1) * dk].to_vec();
        if l2 {
            for vec in [&mut q, &mut k] {
                let n = (vec.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
                vec.iter_mut().for_each(|a| *a /= n);
            }
        }
        q.iter_mut().for_each(|a| *a *= scale);
        let st = &mut s[h * dv * dk..(h + 1) * dv * dk];
        let a = x.g[h].exp();
        st.iter_mut().for_each(|e| *e *= a);
        for iv in 0..dv {
            let row = &mut st[iv * dk..(iv + 1) * dk];
            let sk: f64 = row.iter().zip(&k).map(|(a, b)| a * b).sum();
            let u = x.beta[h] * (x.v[h * dv + iv] - sk);
            row.iter_mut().zip(&k).for_each(|(e, kk)| *e += u * kk);
            y[h * dv + iv] = row.iter().zip(&q).map(|(a, b)| a * b).sum();
        }
    }
    y
}

struct GdnHarness {
    cfg: Cfg,
    pool: *mut kvr_gdn_pool,
    seqs: BTreeMap<i32, Vec<LayerSeq>>,
    ext: Vec<Mem>,
    rng: Rng,
}

const API: PoolApi<kvr_gdn_pool> = PoolApi {
    name: "gdn",
    seq_add: kvr_gdn_pool_seq_add,
    seq_free: kvr_gdn_pool_seq_free,
    free: kvr_gdn_pool_free,
    dead: dead_pool,
    foreign: foreign_pool,
};

fn dead_pool() -> *mut kvr_gdn_pool {
    static DEAD: OnceLock<usize> = OnceLock::new();
    *DEAD.get_or_init(|| {
        let mut p = std::mem::MaybeUninit::uninit();
        assert_eq!(kvr_gdn_pool_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
        // SAFETY: filled above.
        let mut p: kvr_gdn_pool_params = unsafe { p.assume_init() };
        (p.n_layers, p.n_k_heads, p.n_v_heads, p.dk, p.dv, p.max_seqs) = (1, 1, 1, 2, 2, 1);
        let mut pool = null_mut();
        assert_eq!(kvr_gdn_pool_new(context(), &p, &mut pool), KVR_STATUS_OK);
        kvr_gdn_pool_free(pool);
        pool as usize
    }) as *mut kvr_gdn_pool
}

/// A KV pool handle: foreign to every GDN call.
fn foreign_pool() -> *mut kvr_gdn_pool {
    static FOREIGN: OnceLock<usize> = OnceLock::new();
    *FOREIGN.get_or_init(|| {
        let mut p = std::mem::MaybeUninit::uninit();
        assert_eq!(kvr_kv_pool_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
        // SAFETY: filled above.
        let mut p: kvr_kv_pool_params = unsafe { p.assume_init() };
        (
            p.n_layers,
            p.n_kv_heads,
            p.head_dim,
            p.capacity_pages,
            p.max_seqs,
        ) = (1, 1, 1, 1, 1);
        let mut pool = null_mut();
        assert_eq!(kvr_kv_pool_new(context(), &p, &mut pool), KVR_STATUS_OK);
        pool as usize
    }) as *mut kvr_gdn_pool
}

fn params_of(c: &Cfg, ext: &mut [Mem]) -> (kvr_gdn_pool_params, Vec<kvr_gdn_state_storage>) {
    let mut p = std::mem::MaybeUninit::uninit();
    assert_eq!(kvr_gdn_pool_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
    // SAFETY: filled above.
    let mut p: kvr_gdn_pool_params = unsafe { p.assume_init() };
    p.n_layers = c.layers as i32;
    p.n_k_heads = c.hk as i32;
    p.n_v_heads = c.hv as i32;
    p.dk = c.dk as i32;
    p.dv = c.dv as i32;
    p.ring_len = c.ring as i32;
    p.kv_only_threshold = c.tau_param;
    p.max_drafts = c.drafts_param;
    p.state_dtype = c.state_dtype;
    p.entry_dtype = c.entry_dtype;
    p.layout = if c.vmajor {
        KVR_STATE_V_MAJOR
    } else {
        KVR_STATE_K_MAJOR
    };
    p.max_seqs = c.max_seqs as i32;
    p.conv_dim = c.conv_dim as i32;
    p.conv_kernel = c.conv_kernel as i32;
    p.conv_dtype = c.conv_dtype;
    let states: Vec<kvr_gdn_state_storage> = ext
        .iter_mut()
        .map(|m| kvr_gdn_state_storage {
            state: m.ptr(),
            seq_stride: c.seq_stride() as i64,
        })
        .collect();
    (p, states)
}

fn memory_of(m: &OutStruct) -> kvr_gdn_pool_memory {
    m.read()
}

/// The memory report against the configuration.
fn check_memory(c: &Cfg, m: &kvr_gdn_pool_memory) {
    let state = (c.layers * c.hv * c.dk * c.dv * dsize(c.state_dtype)) as i64;
    assert_eq!(m.state_bytes, state, "memory.state_bytes");
    let snaps = if c.ring == 0 {
        state * c.max_drafts() as i64
    } else {
        0
    };
    assert_eq!(m.snapshot_bytes, snaps, "memory.snapshot_bytes");
    assert_eq!((m.ring_bytes > 0), c.ring > 0, "memory.ring_bytes");
    assert_eq!((m.conv_bytes > 0), c.conv_dim > 0, "memory.conv_bytes");
    assert_eq!(
        m.total_bytes,
        m.state_bytes + m.ring_bytes + m.conv_bytes + m.snapshot_bytes
    );
    assert_eq!(
        m.kv_only_threshold,
        c.tau() as i64,
        "memory.kv_only_threshold"
    );
}

fn create(c: &Cfg, ext: &mut [Mem], size: StructSize) -> *mut kvr_gdn_pool {
    let (mut p, states) = params_of(c, ext);
    if !states.is_empty() {
        p.states = states.as_ptr();
    }
    let v = Versioned::new(p, size);
    let mut pool = null_mut();
    Expect::ok().check(
        kvr_gdn_pool_new(context(), v.ptr(), &mut pool),
        "gdn_pool_new",
    );
    let full = size_of::<kvr_gdn_pool_memory>();
    let mut a = OutStruct::new(full, full + 16);
    Expect::ok().check(
        kvr_gdn_pool_params_memory(v.ptr(), a.ptr()),
        "params_memory",
    );
    let mut b = OutStruct::new(full, full + 16);
    Expect::ok().check(kvr_gdn_pool_get_memory(pool, b.ptr()), "get_memory");
    let (ma, mb) = (memory_of(&a), memory_of(&b));
    check_memory(c, &ma);
    check_memory(c, &mb);
    pool
}

#[derive(Clone, Copy, Debug)]
enum BadNew {
    Layers0,
    Hk0,
    HvNotMultiple,
    Dk0,
    DvNegative,
    RingNegative,
    RingBelowDrafts,
    Drafts9,
    ThresholdRecurrent,
    ThresholdAboveCapacity,
    ThresholdNegative,
    StateF16,
    StateI32,
    EntryI32,
    ConvDtypeUnknown,
    LayoutUnknown,
    ConvKernel1,
    MaxSeqs0,
    StructSmaller,
    StructTail,
    NullParams,
    NullOut,
    NullCtx,
    ForeignCtx,
    ExtNull,
    ExtStrideSmall,
    ExtNegativeStride,
    ExtMisaligned,
}

const BAD_NEW: [BadNew; 28] = [
    BadNew::Layers0,
    BadNew::Hk0,
    BadNew::HvNotMultiple,
    BadNew::Dk0,
    BadNew::DvNegative,
    BadNew::RingNegative,
    BadNew::RingBelowDrafts,
    BadNew::Drafts9,
    BadNew::ThresholdRecurrent,
    BadNew::ThresholdAboveCapacity,
    BadNew::ThresholdNegative,
    BadNew::StateF16,
    BadNew::StateI32,
    BadNew::EntryI32,
    BadNew::ConvDtypeUnknown,
    BadNew::LayoutUnknown,
    BadNew::ConvKernel1,
    BadNew::MaxSeqs0,
    BadNew::StructSmaller,
    BadNew::StructTail,
    BadNew::NullParams,
    BadNew::NullOut,
    BadNew::NullCtx,
    BadNew::ForeignCtx,
    BadNew::ExtNull,
    BadNew::ExtStrideSmall,
    BadNew::ExtNegativeStride,
    BadNew::ExtMisaligned,
];

fn bad_create(c: &Cfg, ext: &mut [Mem], bad: BadNew) {
    let (mut p, mut states) = params_of(c, ext);
    let mut size = StructSize::Exact;
    let mut ctx = context() as *const kvr_context;
    let (mut null_params, mut null_out) = (false, false);
    let mut want = Expect::ok();
    // Whether kvr_gdn_pool_params_memory must refuse the same parameters alike.
    let mut memory_too = true;
    match bad {
        BadNew::Layers0 => {
            p.n_layers = 0;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::Hk0 => {
            p.n_k_heads = 0;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::HvNotMultiple => {
            (p.n_k_heads, p.n_v_heads) = (2, 3);
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::Dk0 => {
            p.dk = 0;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::DvNegative => {
            p.dv = -4;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::RingNegative => {
            p.ring_len = -1;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::RingBelowDrafts => {
            if c.ring == 0 || c.ring >= 8 {
                return;
            }
            p.max_drafts = c.ring as i32 + 1;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::Drafts9 => {
            p.max_drafts = 9;
            want.add(KVR_STATUS_OUT_OF_RANGE);
            want.add_if(c.ring > 0 && c.ring < 9, KVR_STATUS_INVALID_ARG);
        }
        BadNew::ThresholdRecurrent => {
            p.ring_len = 0;
            p.max_drafts = 0;
            p.kv_only_threshold = 1;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::ThresholdAboveCapacity => {
            if c.ring == 0 {
                return;
            }
            p.kv_only_threshold = c.capacity() as i32 + 1;
            want.add(KVR_STATUS_OUT_OF_RANGE);
        }
        BadNew::ThresholdNegative => {
            p.kv_only_threshold = -2;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::StateF16 => {
            p.state_dtype = KVR_DTYPE_F16;
            want.add(KVR_STATUS_DTYPE_MISMATCH);
            // An explicit threshold may no longer fit the smaller state.
            want.add_if(c.tau_param > 0, KVR_STATUS_OUT_OF_RANGE);
        }
        BadNew::StateI32 => {
            p.state_dtype = KVR_DTYPE_I32;
            want.add(KVR_STATUS_DTYPE_MISMATCH);
        }
        BadNew::EntryI32 => {
            p.entry_dtype = KVR_DTYPE_I32;
            want.add(KVR_STATUS_DTYPE_MISMATCH);
            want.add_if(c.tau_param > 0, KVR_STATUS_OUT_OF_RANGE);
        }
        BadNew::ConvDtypeUnknown => {
            p.conv_dtype = 9;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::LayoutUnknown => {
            p.layout = 2;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::ConvKernel1 => {
            p.conv_dim = 2;
            p.conv_kernel = 1;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::MaxSeqs0 => {
            p.max_seqs = 0;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::StructSmaller => {
            size = StructSize::Smaller;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::StructTail => {
            size = StructSize::LargerNonZero;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::NullParams => {
            null_params = true;
            want.add(KVR_STATUS_NULL_ARG);
        }
        BadNew::NullOut => {
            null_out = true;
            want.add(KVR_STATUS_NULL_ARG);
        }
        BadNew::NullCtx => {
            ctx = null();
            want.add(KVR_STATUS_NULL_ARG);
            memory_too = false;
        }
        BadNew::ForeignCtx => {
            ctx = foreign_pool() as *const kvr_context;
            want.add(KVR_STATUS_INVALID_ARG);
            memory_too = false;
        }
        BadNew::ExtNull
        | BadNew::ExtStrideSmall
        | BadNew::ExtNegativeStride
        | BadNew::ExtMisaligned
            if states.is_empty() =>
        {
            return;
        }
        BadNew::ExtNull => {
            states[0].state = null_mut();
            want.add(KVR_STATUS_NULL_ARG);
            memory_too = false;
        }
        BadNew::ExtStrideSmall => {
            states[0].seq_stride = (c.hv * c.dk * c.dv) as i64 - 1;
            want.add(KVR_STATUS_INVALID_ARG);
            memory_too = false;
        }
        BadNew::ExtNegativeStride => {
            states[0].seq_stride = -1;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        BadNew::ExtMisaligned => {
            states[0].state = (states[0].state as usize + dsize(c.state_dtype) / 2) as *mut c_void;
            want.add(KVR_STATUS_INVALID_ARG);
            memory_too = false;
        }
    }
    if !states.is_empty() {
        p.states = states.as_ptr();
    }
    let v = Versioned::new(p, size);
    let sentinel = 0x5A50 as *mut kvr_gdn_pool;
    let mut out = sentinel;
    let pp = if null_params { null() } else { v.ptr() };
    let s = kvr_gdn_pool_new(ctx, pp, if null_out { null_mut() } else { &mut out });
    want.check(s, &format!("gdn_pool_new with {bad:?}"));
    assert_eq!(out, sentinel, "gdn_pool_new with {bad:?} wrote *out");
    if memory_too {
        let full = size_of::<kvr_gdn_pool_memory>();
        let mut m = OutStruct::new(full, full + 16);
        let mp = if null_out { null_mut() } else { m.ptr() };
        let s = kvr_gdn_pool_params_memory(pp, mp);
        want.check(s, &format!("gdn_pool_params_memory with {bad:?}"));
        assert!(m.tail_untouched(4), "a failed params_memory wrote *out");
    }
}

/// Rows of a batch: distinct live sequences, -1 rows, sometimes any id.
fn pick_rows(
    inp: &mut Input,
    seqs: &BTreeMap<i32, Vec<LayerSeq>>,
    max_seqs: usize,
    prefer: &[i32],
) -> Vec<i32> {
    let b = if inp.chance(1, 16) {
        max_seqs + 1
    } else {
        inp.below(4)
    };
    let live: Vec<i32> = if prefer.is_empty() {
        seqs.keys().copied().collect()
    } else {
        prefer.to_vec()
    };
    let mut rows = Vec::with_capacity(b);
    for _ in 0..b {
        let id = match inp.below(10) {
            0 => -1,
            1 => pick_id(inp, seqs, max_seqs),
            _ => {
                let unused: Vec<i32> = live.iter().copied().filter(|x| !rows.contains(x)).collect();
                if unused.is_empty() {
                    -1
                } else {
                    unused[inp.below(unused.len())]
                }
            }
        };
        rows.push(id);
    }
    rows
}

/// Statuses of the ids a batch lists.
fn row_errors(
    seen: &[i32],
    seqs: &BTreeMap<i32, Vec<LayerSeq>>,
    max_seqs: usize,
    want: &mut Expect,
) {
    want.add_if(seen.len() > max_seqs, KVR_STATUS_OUT_OF_RANGE);
    for (i, &id) in seen.iter().enumerate() {
        want.add_if(id != -1 && !seqs.contains_key(&id), KVR_STATUS_UNKNOWN_ID);
        want.add_if(id >= 0 && seen[..i].contains(&id), KVR_STATUS_INVALID_ARG);
    }
}

fn layer_arg(inp: &mut Input, layers: usize, all: bool) -> i32 {
    match inp.below(12) {
        0 => inp.pick(&[-2, -7, layers as i32, i32::MAX]),
        1 if !all => -1,
        1..=3 if all => KVR_LAYER_ALL,
        _ => inp.below(layers) as i32,
    }
}

/// A layer argument that may be `KVR_LAYER_ALL`, and the layers it selects (none if invalid).
fn layer_selection(inp: &mut Input, layers: usize, want: &mut Expect) -> (i32, Vec<usize>) {
    let layer = layer_arg(inp, layers, true);
    layer_errors(layer, layers, true, want);
    let sel = if layer == KVR_LAYER_ALL {
        (0..layers).collect()
    } else if (0..layers as i32).contains(&layer) {
        vec![layer as usize]
    } else {
        Vec::new()
    };
    (layer, sel)
}

fn layer_errors(layer: i32, layers: usize, all: bool, want: &mut Expect) {
    let ok = (0..layers as i32).contains(&layer) || (all && layer == KVR_LAYER_ALL);
    want.add_if(!ok, KVR_STATUS_OUT_OF_RANGE);
}

/// The step tensors of a decode or verify.
struct StepArgs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    conv: Option<Tensor>,
    out: Tensor,
    /// Which are passed as NULL: q, k, v, g, beta, conv, out.
    null: [bool; 7],
    /// Index shapes: (q/k/v/out with a T dimension, g/beta with T, conv with T).
    four: [bool; 3],
}

impl StepArgs {
    /// Descriptors in argument order (q, k, v, g, beta, conv, out); out's stands in for an
    /// absent conv.
    fn descs(&self) -> [kvr_tensor; 7] {
        [
            self.q.desc(),
            self.k.desc(),
            self.v.desc(),
            self.g.desc(),
            self.beta.desc(),
            self.conv.as_ref().map_or(self.out.desc(), |x| x.desc()),
            self.out.desc(),
        ]
    }

    /// A decode or verify with every tensor passed (conv NULL when absent), default params.
    fn call(
        &self,
        pool: *mut kvr_gdn_pool,
        layer: i32,
        ids: &kvr_tensor,
        verify: bool,
    ) -> kvr_status {
        let d = self.descs();
        let mut p = d.each_ref().map(|x| x as *const kvr_tensor);
        if self.conv.is_none() {
            p[5] = null();
        }
        gdn_pool_call(pool, layer, ids, verify, p, null())
    }
}

/// The tensors of an import, export or materialize: a state and an optional conv window
/// (outputs poisoned), each maybe broken.
struct StateArgs {
    state: Tensor,
    conv: Option<Tensor>,
    /// The state passed as NULL.
    null: bool,
    descs: (kvr_tensor, Option<kvr_tensor>),
}

impl StateArgs {
    fn state_ptr(&self) -> *const kvr_tensor {
        if self.null {
            null()
        } else {
            &self.descs.0
        }
    }
    fn conv_ptr(&self) -> *const kvr_tensor {
        self.descs
            .1
            .as_ref()
            .map_or(null(), |d| d as *const kvr_tensor)
    }
    /// After a failed call: no output was written.
    fn assert_untouched(&self, what: &str, s: kvr_status) {
        assert!(self.state.untouched(), "a failed {what} ({s}) wrote out");
        if let Some(t) = &self.conv {
            assert!(t.untouched(), "a failed {what} ({s}) wrote conv_out");
        }
    }
}

impl Harness for GdnHarness {
    fn new(inp: &mut Input) -> Self {
        let layers = 1 + inp.below(2);
        let hk = 1 + inp.below(2);
        let hv = hk * (1 + inp.below(2));
        let dk = inp.pick(&[1, 2, 3, 4, 5, 8]);
        let dv = inp.pick(&[1, 2, 3, 4, 5, 8]);
        let ring = if inp.chance(1, 4) {
            0
        } else {
            1 + inp.below(6)
        };
        let drafts_param = if inp.chance(1, 2) {
            0
        } else if ring == 0 {
            1 + inp.below(4) as i32
        } else {
            1 + inp.below(ring.min(8)) as i32
        };
        let state_dtype = inp.pick(&[KVR_DTYPE_F32, KVR_DTYPE_F32, KVR_DTYPE_BF16]);
        let entry_dtype = inp.pick(&[KVR_DTYPE_F32, KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16]);
        let vmajor = inp.chance(1, 2);
        let max_seqs = 1 + inp.below(4);
        let conv_dim = if inp.chance(1, 2) {
            0
        } else {
            1 + inp.below(3)
        };
        let conv_kernel = 2 + inp.below(3);
        let conv_dtype = inp.pick(&FLOATS);
        let external = inp.chance(1, 4).then(|| inp.below(3));
        let mut c = Cfg {
            layers,
            hk,
            hv,
            dk,
            dv,
            ring,
            tau_param: KVR_GDN_THRESHOLD_DEFAULT,
            drafts_param,
            state_dtype,
            entry_dtype,
            vmajor,
            max_seqs,
            conv_dim,
            conv_kernel,
            conv_dtype,
            external,
        };
        // Off, the default (off too), a count up to the capacity, or min(dk, capacity): the
        // largest useful count, which the default picked before it became off.
        c.tau_param = match inp.below(4) {
            0 => KVR_GDN_THRESHOLD_OFF,
            1 if ring > 0 && c.capacity() > 0 => 1 + inp.below(c.capacity()) as i32,
            3 if ring > 0 => dk.min(c.capacity()) as i32,
            _ => KVR_GDN_THRESHOLD_DEFAULT,
        };
        let mut ext = Vec::new();
        if c.external.is_some() {
            let bytes = max_seqs * c.seq_stride() * dsize(state_dtype);
            for _ in 0..layers {
                ext.push(Mem::new(bytes));
            }
        }
        let bad = inp.byte();
        if bad % 4 == 0 {
            bad_create(&c, &mut ext, BAD_NEW[(bad as usize / 4) % BAD_NEW.len()]);
        }
        let size = StructSize::valid_one(inp, 4);
        let pool = create(&c, &mut ext, size);
        let seed = inp.byte() as u64;
        GdnHarness {
            cfg: c,
            pool,
            seqs: BTreeMap::new(),
            ext,
            rng: Rng::new(seed),
        }
    }

    fn step(&mut self, inp: &mut Input) {
        match inp.below(18) {
            0..=2 => self.op_step(inp, false),
            3 | 4 => self.op_step(inp, true),
            5 | 6 => self.op_commit(inp),
            7 => self.op_flush(inp),
            8 => self.op_import(inp),
            9 => self.op_export(inp),
            10 => self.op_add(inp),
            11 => self.op_free(inp),
            12 => self.op_reset(inp),
            13 => self.op_queries(inp),
            14 => self.op_misuse(inp),
            15 => self.op_materialize(inp),
            _ => match inp.below(8) {
                0 => self.op_recreate(inp),
                1 | 2 => self.op_add(inp),
                _ => self.op_burst(inp),
            },
        }
    }

    /// Every cursor, and every state without pending drafts, against the model.
    fn check(&mut self) {
        let c = self.cfg;
        for (&id, layers) in &self.seqs {
            for (l, ls) in layers.iter().enumerate() {
                let mut cur = kvr_gdn_cursor {
                    mode: -9,
                    ring_start: -9,
                    buffered: -9,
                    pending: -9,
                };
                Expect::ok().check(
                    kvr_gdn_pool_get_cursor(self.pool, l as i32, id, &mut cur),
                    "get_cursor",
                );
                self.check_cursor(l, id, &cur);
                if ls.pending.is_some() {
                    continue;
                }
                let out = Tensor::new(KVR_DTYPE_F32, &c.state_shape(), Style::Contiguous);
                let conv = (c.conv_dim > 0).then(|| {
                    Tensor::new(
                        KVR_DTYPE_F32,
                        &[c.conv_kernel - 1, c.conv_dim],
                        Style::Contiguous,
                    )
                });
                let (od, cd) = (out.desc(), conv.as_ref().map(|t| t.desc()));
                Expect::ok().check(
                    kvr_gdn_pool_export_state(
                        self.pool,
                        l as i32,
                        id,
                        &od,
                        cd.as_ref().map_or(null(), |d| d as *const kvr_tensor),
                        null_mut(),
                    ),
                    "export_state",
                );
                self.compare_state(l, id, None, &out, false, conv.as_ref());
            }
        }
    }

    fn close(self) {
        kvr_gdn_pool_free(self.pool)
    }
}

impl GdnHarness {
    fn op_add(&mut self, inp: &mut Input) {
        let free_slot = self.seqs.len() < self.cfg.max_seqs;
        if let Some(id) = API.add(self.pool, inp, free_slot) {
            assert!(
                id >= 0 && (id as usize) < self.cfg.max_seqs && !self.seqs.contains_key(&id),
                "seq_add returned {id}, not a free id"
            );
            let c = self.cfg;
            self.seqs
                .insert(id, (0..c.layers).map(|_| LayerSeq::new(&c)).collect());
        }
    }

    fn op_free(&mut self, inp: &mut Input) {
        let id = pick_id(inp, &self.seqs, self.cfg.max_seqs);
        if API.free_seq(self.pool, id, self.seqs.contains_key(&id)) {
            self.seqs.remove(&id);
        }
    }

    fn op_reset(&mut self, inp: &mut Input) {
        let id = pick_id(inp, &self.seqs, self.cfg.max_seqs);
        let mut want = Expect::ok();
        want.add_if(!self.seqs.contains_key(&id), KVR_STATUS_UNKNOWN_ID);
        if want.check(
            kvr_gdn_pool_seq_reset(self.pool, id, null_mut()),
            "gdn seq_reset",
        ) {
            let c = self.cfg;
            self.seqs
                .insert(id, (0..c.layers).map(|_| LayerSeq::new(&c)).collect());
        }
    }

    /// The tensors of a decode (`t` = 1, each tensor 3-D or 4-D) or a verify of `t` drafts.
    fn step_args(
        &mut self,
        inp: &mut Input,
        b: usize,
        t: usize,
        verify: bool,
        want: &mut Expect,
    ) -> StepArgs {
        let c = self.cfg;
        let four = if verify {
            [true, true, true]
        } else {
            [inp.chance(1, 2), inp.chance(1, 2), inp.chance(1, 2)]
        };
        let sh = |tdim: bool, x: usize, y: Option<usize>| -> Vec<usize> {
            let mut v = vec![b];
            if tdim {
                v.push(t);
            }
            v.push(x);
            if let Some(y) = y {
                v.push(y);
            }
            v
        };
        let mut shapes = [
            sh(four[0], c.hk, Some(c.dk)),
            sh(four[0], c.hk, Some(c.dk)),
            sh(four[0], c.hv, Some(c.dv)),
            sh(four[1], c.hv, None),
            sh(four[1], c.hv, None),
            sh(four[2], c.conv_dim.max(1), None),
            sh(four[0], c.hv, Some(c.dv)),
        ];
        let mut dtypes = [0; 7];
        for d in dtypes.iter_mut() {
            *d = inp.pick(&[KVR_DTYPE_F32, KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16]);
        }
        let mut null = [false; 7];
        let mut conv_given = c.conv_dim > 0;
        let mut out_style = inp.pick(&OUTPUT_STYLES);
        let mut break_at = None;
        if inp.chance(1, 3) {
            let which = inp.below(7);
            // Which T form tensor `which` uses (q, k, v, out / g, beta / conv_in).
            let tform = four[match which {
                3 | 4 => 1,
                5 => 2,
                _ => 0,
            }];
            let absent = which == 5 && !conv_given;
            match inp.below(7) {
                2 if which == 5 => {
                    conv_given = !conv_given;
                    want.add(if conv_given {
                        KVR_STATUS_INVALID_ARG
                    } else {
                        KVR_STATUS_NULL_ARG
                    });
                }
                _ if absent => {}
                0 => {
                    let last = shapes[which].len() - 1;
                    shapes[which][last] += 1;
                    want.add(KVR_STATUS_INVALID_ARG);
                }
                1 => {
                    dtypes[which] = KVR_DTYPE_I32;
                    want.add(KVR_STATUS_DTYPE_MISMATCH);
                }
                2 => {
                    null[which] = true;
                    want.add(KVR_STATUS_NULL_ARG);
                }
                3 => {
                    out_style = Style::Broadcast;
                    want.add_if(broadcast_overlaps(&shapes[6]), KVR_STATUS_INVALID_ARG);
                }
                4 if tform => {
                    // A T dimension of another length on one tensor.
                    shapes[which][1] += 1;
                    want.add(KVR_STATUS_INVALID_ARG);
                    want.add_if(which == 0 && verify, KVR_STATUS_OUT_OF_RANGE);
                }
                4 => {}
                5 => {
                    // Batch rows that differ from seq_ids.
                    shapes[which][0] += 1;
                    want.add(KVR_STATUS_INVALID_ARG);
                }
                _ => break_at = Some((which, inp.pick(&BREAKS))),
            }
        }
        if !conv_given {
            null[5] = true;
        }
        let styles: Vec<Style> = (0..7)
            .map(|i| {
                if i == 6 {
                    out_style
                } else {
                    inp.pick(&INPUT_STYLES)
                }
            })
            .collect();
        let mut ts: Vec<Tensor> = (0..7)
            .map(|i| Tensor::new(dtypes[i], &shapes[i], styles[i]))
            .collect();
        let rng = &mut self.rng;
        for (i, t) in ts.iter_mut().enumerate() {
            if !is_float(t.dtype) || i == 6 {
                continue;
            }
            match i {
                // Keys of norm <= 1 whatever the strides alias (the delta rule is stable
                // then, with or without the in-kernel norm).
                1 => {
                    let c = 1.0 / (t.shape[t.shape.len() - 1].max(1) as f32).sqrt();
                    t.fill(|_| {
                        let x = rng.uniform(-1.0, 1.0);
                        c * x.signum() * (0.3 + 0.7 * x.abs())
                    })
                }
                3 => t.fill(|_| rng.uniform(-0.4, -0.01)),
                4 => t.fill(|_| rng.uniform(0.1, 0.9)),
                _ => t.fill(|_| rng.uniform(-1.0, 1.0)),
            }
        }
        if let Some((which, br)) = break_at {
            want.add(br.apply(&mut ts[which]));
        }
        let out = ts.pop().unwrap();
        let conv = ts.pop().unwrap();
        let beta = ts.pop().unwrap();
        let g = ts.pop().unwrap();
        let v = ts.pop().unwrap();
        let k = ts.pop().unwrap();
        let q = ts.pop().unwrap();
        StepArgs {
            q,
            k,
            v,
            g,
            beta,
            conv: conv_given.then_some(conv),
            out,
            null,
            four,
        }
    }

    /// The inputs of row `bi`, token `ti`, as the reference reads them.
    fn token_in(&self, a: &StepArgs, bi: usize, ti: usize) -> TokenIn {
        let c = &self.cfg;

        let mut x = TokenIn {
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            g: Vec::new(),
            beta: Vec::new(),
            conv: Vec::new(),
        };
        for kh in 0..c.hk {
            for d in 0..c.dk {
                x.q.push(a.q.get_bt(a.four[0], bi, ti, &[kh, d]) as f64);
                x.k.push(a.k.get_bt(a.four[0], bi, ti, &[kh, d]) as f64);
            }
        }
        for h in 0..c.hv {
            for d in 0..c.dv {
                x.v.push(a.v.get_bt(a.four[0], bi, ti, &[h, d]) as f64);
            }
            x.g.push(a.g.get_bt(a.four[1], bi, ti, &[h]) as f64);
            x.beta.push(a.beta.get_bt(a.four[1], bi, ti, &[h]) as f64);
        }
        if let Some(cv) = &a.conv {
            for d in 0..c.conv_dim {
                x.conv
                    .push(round(c.conv_dtype, cv.get_bt(a.four[2], bi, ti, &[d])));
            }
        }
        x
    }

    fn step_params(
        &self,
        inp: &mut Input,
        want: &mut Expect,
    ) -> (Versioned<kvr_gdn_step_params>, bool, f64, bool) {
        let mut p = std::mem::MaybeUninit::uninit();
        assert_eq!(kvr_gdn_step_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
        // SAFETY: filled above.
        let mut p: kvr_gdn_step_params = unsafe { p.assume_init() };
        let null = inp.chance(1, 3);
        let mut size = StructSize::Exact;
        if !null {
            p.scale = match inp.below(10) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => -0.5,
                3 | 4 => 0.5 + inp.below(3) as f32 * 0.25,
                _ => 0.0,
            };
            want.add_if(!p.scale.is_finite(), KVR_STATUS_INVALID_ARG);
            p.l2norm_qk = inp.pick(&[0, 1, 1, 7]);
            size = inp.pick(&[
                StructSize::Exact,
                StructSize::Exact,
                StructSize::LargerZero,
                StructSize::Smaller,
                StructSize::LargerNonZero,
            ]);
            want.add_if(!size.valid(), KVR_STATUS_INVALID_ARG);
        }
        let scale = if null || p.scale == 0.0 {
            1.0 / (self.cfg.dk as f64).sqrt()
        } else {
            p.scale as f64
        };
        let l2 = !null && p.l2norm_qk != 0;
        (Versioned::new(p, size), null, scale, l2)
    }

    /// A decode (one token per sequence, committed at once) or a verify of T drafts.
    fn op_step(&mut self, inp: &mut Input, verify: bool) {
        let c = self.cfg;
        let mut want = Expect::ok();
        let layer = layer_arg(inp, c.layers, false);
        layer_errors(layer, c.layers, false, &mut want);
        let rows = pick_rows(inp, &self.seqs, c.max_seqs, &[]);
        let b = rows.len();
        let (idt, seen, null_ids) = id_arg(inp, &rows, &mut want, verify);
        row_errors(&seen, &self.seqs, c.max_seqs, &mut want);
        let t = if verify {
            match inp.below(12) {
                0 => 0,
                1 => c.max_drafts() + 1,
                _ => 1 + inp.below(c.max_drafts()),
            }
        } else {
            1
        };
        if verify {
            want.add_if(t == 0 || t > c.max_drafts(), KVR_STATUS_OUT_OF_RANGE);
        }
        let mut a = self.step_args(inp, b, t, verify, &mut want);
        if !verify && inp.chance(1, 16) {
            // A decode given two tokens.
            a.q = Tensor::new(KVR_DTYPE_F32, &[b, 2, c.hk, c.dk], Style::Contiguous);
            a.four[0] = true;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        if (0..c.layers as i32).contains(&layer) {
            for &id in &seen {
                if let Some(ls) = self.seqs.get(&id) {
                    want.add_if(ls[layer as usize].pending.is_some(), KVR_STATUS_INVALID_ARG);
                }
            }
        }
        let (pv, null_params, scale, l2) = self.step_params(inp, &mut want);
        a.out.poison();
        let d = a.descs();
        let arg = |i: usize| -> *const kvr_tensor {
            if a.null[i] {
                null()
            } else {
                &d[i]
            }
        };
        let idd = idt.desc();
        let s = gdn_pool_call(
            self.pool,
            layer,
            if null_ids { null() } else { &idd },
            verify,
            std::array::from_fn(arg),
            if null_params { null() } else { pv.ptr() },
        );
        let what = if verify { "gdn verify" } else { "gdn decode" };
        if !want.check(s, what) {
            assert!(a.out.untouched(), "a failed {what} ({s}) wrote out");
            return;
        }
        self.step_done(layer as usize, &seen, &a, t, verify, scale, l2, what);
    }

    /// The model after a successful decode or verify, and its outputs against the reference.
    fn step_done(
        &mut self,
        l: usize,
        seen: &[i32],
        a: &StepArgs,
        t: usize,
        verify: bool,
        scale: f64,
        l2: bool,
        what: &str,
    ) {
        let c = self.cfg;
        let tol = c.tol() + out_tol(a.out.dtype);
        for (bi, &id) in seen.iter().enumerate() {
            if id < 0 {
                for ti in 0..t {
                    for h in 0..c.hv {
                        for dd in 0..c.dv {
                            assert_eq!(
                                a.out.get_bt(a.four[0], bi, ti, &[h, dd]),
                                0.0,
                                "{what}: unused row not zero"
                            );
                        }
                    }
                }
                continue;
            }
            let tokens: Vec<TokenIn> = (0..t).map(|ti| self.token_in(a, bi, ti)).collect();
            let ls = &mut self.seqs.get_mut(&id).unwrap()[l];
            ls.before_step(&c, if verify { 2 * t } else { 1 });
            let mut s = ls.s.clone();
            let mut snaps = Vec::with_capacity(t);
            for (ti, x) in tokens.iter().enumerate() {
                let y = recurrent(&c, &mut s, x, scale, l2);
                for h in 0..c.hv {
                    for dd in 0..c.dv {
                        let got = a.out.get_bt(a.four[0], bi, ti, &[h, dd]) as f64;
                        let want_y = y[h * c.dv + dd];
                        assert!(
                            close(got, want_y, tol),
                            "{what}: sequence {id}, layer {l}, token {ti}, head {h}, [{dd}]: \
                             {got}, reference {want_y}"
                        );
                    }
                }
                snaps.push(s.clone());
            }
            if verify {
                ls.pending = Some(Pending {
                    snaps,
                    conv: tokens.iter().map(|x| x.conv.clone()).collect(),
                });
            } else {
                ls.accept(std::slice::from_ref(&s));
                ls.push_conv(tokens[0].conv.clone());
            }
        }
    }

    /// Valid tensors (f32, contiguous, with a T dimension) of `b` rows and `t` tokens.
    fn clean_args(&mut self, b: usize, t: usize) -> StepArgs {
        let c = self.cfg;
        let f = KVR_DTYPE_F32;
        let st = Style::Contiguous;
        let mut q = Tensor::new(f, &[b, t, c.hk, c.dk], st);
        let mut k = Tensor::new(f, &[b, t, c.hk, c.dk], st);
        let mut v = Tensor::new(f, &[b, t, c.hv, c.dv], st);
        let mut g = Tensor::new(f, &[b, t, c.hv], st);
        let mut beta = Tensor::new(f, &[b, t, c.hv], st);
        let mut conv = (c.conv_dim > 0).then(|| Tensor::new(f, &[b, t, c.conv_dim], st));
        let out = Tensor::new(f, &[b, t, c.hv, c.dv], st);
        let rng = &mut self.rng;
        let kc = 1.0 / (c.dk as f32).sqrt();
        q.fill(|_| rng.uniform(-1.0, 1.0));
        k.fill(|_| kc * rng.uniform(-1.0, 1.0));
        v.fill(|_| rng.uniform(-1.0, 1.0));
        g.fill(|_| rng.uniform(-0.4, -0.01));
        beta.fill(|_| rng.uniform(0.1, 0.9));
        if let Some(x) = conv.as_mut() {
            x.fill(|_| rng.uniform(-1.0, 1.0));
        }
        StepArgs {
            q,
            k,
            v,
            g,
            beta,
            conv,
            out,
            null: [false; 7],
            four: [true; 3],
        }
    }

    /// A valid decode or verify of every live sequence without pending drafts in `l`.
    fn clean_step(&mut self, l: usize, t: usize, verify: bool) -> Vec<i32> {
        let rows: Vec<i32> = self
            .seqs
            .iter()
            .filter(|(_, ls)| ls[l].pending.is_none())
            .map(|(&id, _)| id)
            .collect();
        let a = self.clean_args(rows.len(), t);
        let ids = ids_tensor(&rows, Style::Contiguous);
        let what = if verify { "gdn verify" } else { "gdn decode" };
        let s = a.call(self.pool, l as i32, &ids.desc(), verify);
        Expect::ok().check(s, what);
        let scale = 1.0 / (self.cfg.dk as f64).sqrt();
        self.step_done(l, &rows, &a, t, verify, scale, false, what);
        rows
    }

    /// Several valid steps in a row (rings fill and wrap, KV-only sequences graduate): decodes,
    /// or verifies each followed by a commit of random counts.
    fn op_burst(&mut self, inp: &mut Input) {
        let c = self.cfg;
        for _ in 0..1 + inp.below(8) {
            let l = inp.below(c.layers);
            if inp.chance(1, 3) {
                let t = 1 + inp.below(c.max_drafts());
                let rows = self.clean_step(l, t, true);
                let counts: Vec<i32> = rows.iter().map(|_| inp.below(t + 1) as i32).collect();
                let ids = ids_tensor(&rows, Style::Contiguous);
                let acc = ids_tensor(&counts, Style::Contiguous);
                let cs = (c.conv_dim > 0).then(|| {
                    Tensor::new(
                        KVR_DTYPE_F32,
                        &[rows.len(), c.conv_kernel - 1, c.conv_dim],
                        Style::Contiguous,
                    )
                });
                let csd = cs.as_ref().map(|x| x.desc());
                let s = kvr_gdn_pool_commit(
                    self.pool,
                    l as i32,
                    &ids.desc(),
                    &acc.desc(),
                    csd.as_ref().map_or(null(), |d| d as *const kvr_tensor),
                    null_mut(),
                );
                Expect::ok().check(s, "gdn commit");
                self.commit_done(&[l], &rows, &counts, cs.as_ref());
            } else {
                self.clean_step(l, 1, false);
            }
        }
        // The states the rings now hold, at a random prefix of each sequence.
        let ids: Vec<i32> = self.seqs.keys().copied().collect();
        for id in ids {
            let ls = &self.seqs[&id];
            if ls.iter().any(|x| x.pending.is_some()) {
                continue;
            }
            let fill = ls.iter().map(|x| x.h).min().unwrap_or(0);
            let keep = fill - inp.below(fill + 1).min(inp.below(fill + 1));
            self.clean_materialize(id, keep);
        }
    }

    /// A valid materialize of `id` at `keep` (with the conv windows when `keep` is every
    /// layer's fill), against the model.
    fn clean_materialize(&mut self, id: i32, keep: usize) {
        let c = self.cfg;
        let mut shape = vec![c.layers];
        shape.extend(c.state_shape());
        let out = Tensor::new(KVR_DTYPE_F32, &shape, Style::Contiguous);
        let newest = self.seqs[&id].iter().all(|x| x.h == keep);
        let conv = (c.conv_dim > 0 && newest).then(|| {
            Tensor::new(
                KVR_DTYPE_F32,
                &[c.layers, c.conv_kernel - 1, c.conv_dim],
                Style::Contiguous,
            )
        });
        let cd = conv.as_ref().map(|t| t.desc());
        let s = kvr_gdn_pool_materialize(
            self.pool,
            id,
            keep as i32,
            &out.desc(),
            cd.as_ref().map_or(null(), |d| d as *const kvr_tensor),
            null_mut(),
        );
        Expect::ok().check(s, "gdn materialize");
        for l in 0..c.layers {
            self.compare_state(l, id, Some(keep), &out, true, conv.as_ref());
        }
    }

    fn op_commit(&mut self, inp: &mut Input) {
        let c = self.cfg;
        let mut want = Expect::ok();
        let (layer, layers) = layer_selection(inp, c.layers, &mut want);
        let pending: Vec<i32> = self
            .seqs
            .iter()
            .filter(|(_, ls)| layers.iter().all(|&l| ls[l].pending.is_some()) && !layers.is_empty())
            .map(|(&id, _)| id)
            .collect();
        let rows = pick_rows(inp, &self.seqs, c.max_seqs, &pending);
        let b = rows.len();
        let (idt, seen, null_ids) = id_arg(inp, &rows, &mut want, true);
        row_errors(&seen, &self.seqs, c.max_seqs, &mut want);
        // Counts: in 0..=T mostly.
        let mut counts = Vec::with_capacity(b);
        for &id in &seen {
            let tmax = self.seqs.get(&id).map_or(0, |ls| {
                layers.iter().map(|&l| ls[l].pending_t()).max().unwrap_or(0)
            });
            let n = match inp.below(12) {
                0 if id >= 0 => -1,
                1 if id >= 0 => tmax as i32 + 1,
                _ => inp.below(tmax + 1) as i32,
            };
            counts.push(n);
        }
        for (i, &id) in seen.iter().enumerate() {
            if let Some(ls) = self.seqs.get(&id) {
                for &l in &layers {
                    let t = ls[l].pending_t();
                    want.add_if(t == 0, KVR_STATUS_INVALID_ARG);
                    want.add_if(
                        counts[i] < 0 || counts[i] as usize > t,
                        KVR_STATUS_OUT_OF_RANGE,
                    );
                }
            }
        }
        let mut acc = Tensor::new(KVR_DTYPE_I32, &[b], inp.pick(&OUTPUT_STYLES));
        for (i, &n) in counts.iter().enumerate() {
            let j = acc.index(&[i]);
            acc.mem.set_bits(KVR_DTYPE_I32, j, n as u32);
        }
        let mut null_acc = false;
        match inp.below(20) {
            0 => {
                acc.desc.dtype = KVR_DTYPE_F32;
                want.add(KVR_STATUS_DTYPE_MISMATCH);
            }
            1 => {
                acc = Tensor::new(KVR_DTYPE_I32, &[b, 1], Style::Contiguous);
                for (i, &n) in counts.iter().enumerate() {
                    acc.mem.set_bits(KVR_DTYPE_I32, i, n as u32);
                }
                want.add(KVR_STATUS_INVALID_ARG);
            }
            2 => {
                acc = Tensor::new(KVR_DTYPE_I32, &[b + 1], Style::Contiguous);
                want.add(KVR_STATUS_INVALID_ARG);
            }
            3 => want.add(inp.pick(&BREAKS).apply(&mut acc)),
            4 => {
                null_acc = true;
                want.add(KVR_STATUS_NULL_ARG);
            }
            _ => {}
        }
        // conv_state
        let mut cs = None;
        if inp.chance(1, 2) && (c.conv_dim > 0 || inp.chance(1, 4)) {
            let mut shape = vec![b, c.conv_kernel - 1, c.conv_dim.max(1)];
            want.add_if(c.conv_dim == 0, KVR_STATUS_INVALID_ARG);
            want.add_if(layer == KVR_LAYER_ALL, KVR_STATUS_INVALID_ARG);
            let mut dt = inp.pick(&FLOATS);
            let mut style = inp.pick(&OUTPUT_STYLES);
            match inp.below(12) {
                0 => {
                    shape[1] += 1;
                    want.add(KVR_STATUS_INVALID_ARG);
                }
                1 => {
                    dt = KVR_DTYPE_I32;
                    want.add(KVR_STATUS_DTYPE_MISMATCH);
                }
                2 => {
                    style = Style::Broadcast;
                    want.add_if(broadcast_overlaps(&shape), KVR_STATUS_INVALID_ARG);
                }
                _ => {}
            }
            let mut t = Tensor::new(dt, &shape, style);
            if inp.chance(1, 12) {
                want.add(inp.pick(&BREAKS).apply(&mut t));
            }
            cs = Some(t);
        }
        if let Some(t) = cs.as_mut() {
            t.poison();
        }
        let (idd, ad) = (idt.desc(), acc.desc());
        let csd = cs.as_ref().map(|t| t.desc());
        let s = kvr_gdn_pool_commit(
            self.pool,
            layer,
            if null_ids { null() } else { &idd },
            if null_acc { null() } else { &ad },
            csd.as_ref().map_or(null(), |d| d as *const kvr_tensor),
            null_mut(),
        );
        if !want.check(s, "gdn commit") {
            if let Some(t) = &cs {
                assert!(t.untouched(), "a failed commit ({s}) wrote conv_state");
            }
            return;
        }
        self.commit_done(&layers, &seen, &counts, cs.as_ref());
    }

    /// The model after a successful commit, and the conv windows it wrote.
    fn commit_done(&mut self, layers: &[usize], seen: &[i32], counts: &[i32], cs: Option<&Tensor>) {
        let c = self.cfg;
        for (bi, &id) in seen.iter().enumerate() {
            if id < 0 {
                continue;
            }
            let n = counts[bi] as usize;
            for &l in layers {
                let ls = &mut self.seqs.get_mut(&id).unwrap()[l];
                let p = ls.pending.take().expect("pending");
                ls.accept(&p.snaps[..n]);
                for row in p.conv.into_iter().take(n) {
                    ls.push_conv(row);
                }
                if let Some(t) = cs {
                    let what = format!("commit of sequence {id}, layer {l}: conv_state[{bi}]");
                    check_conv(&c, &ls.conv, t, Some(bi), &what);
                }
            }
        }
    }

    fn op_flush(&mut self, inp: &mut Input) {
        let c = self.cfg;
        let mut want = Expect::ok();
        let (layer, layers) = layer_selection(inp, c.layers, &mut want);
        let rows = pick_rows(inp, &self.seqs, c.max_seqs, &[]);
        let (idt, seen, null_ids) = id_arg(inp, &rows, &mut want, true);
        row_errors(&seen, &self.seqs, c.max_seqs, &mut want);
        for &id in &seen {
            if let Some(ls) = self.seqs.get(&id) {
                for &l in &layers {
                    want.add_if(ls[l].pending.is_some(), KVR_STATUS_INVALID_ARG);
                }
            }
        }
        let idd = idt.desc();
        let s = kvr_gdn_pool_flush(
            self.pool,
            layer,
            if null_ids { null() } else { &idd },
            null_mut(),
        );
        if want.check(s, "gdn flush") {
            for &id in seen.iter().filter(|&&i| i >= 0) {
                for &l in &layers {
                    let ls = &mut self.seqs.get_mut(&id).unwrap()[l];
                    if ls.mode != KVR_GDN_MODE_RECURRENT {
                        ls.flushed(&c);
                    }
                }
            }
        }
    }

    /// Arguments shared by import and export: layer, sequence and the statuses they give.
    fn state_target(&self, inp: &mut Input, want: &mut Expect) -> (i32, i32) {
        let c = self.cfg;
        let layer = layer_arg(inp, c.layers, false);
        layer_errors(layer, c.layers, false, want);
        let id = pick_id(inp, &self.seqs, c.max_seqs);
        want.add_if(!self.seqs.contains_key(&id), KVR_STATUS_UNKNOWN_ID);
        if let (Some(ls), true) = (self.seqs.get(&id), (0..c.layers as i32).contains(&layer)) {
            want.add_if(ls[layer as usize].pending.is_some(), KVR_STATUS_INVALID_ARG);
        }
        (layer, id)
    }

    /// A state or conv tensor for import/export, maybe broken.
    fn state_tensor(
        &mut self,
        inp: &mut Input,
        conv: bool,
        output: bool,
        all: bool,
        one_layer: bool,
        want: &mut Expect,
    ) -> Tensor {
        let c = self.cfg;
        let mut expected: Vec<usize> = if conv {
            vec![c.conv_kernel - 1, c.conv_dim]
        } else {
            c.state_shape().to_vec()
        };
        if all {
            expected.insert(0, c.layers);
        }
        // Wrong shapes: one layer's where every layer's is expected, a dimension off by one,
        // a trailing 1 (a mismatch is decided on the final shape: two changes can cancel).
        let mut shape = expected.clone();
        if all && one_layer {
            shape.remove(0);
        }
        if conv {
            let last = shape.len() - 1;
            shape[last] = shape[last].max(1);
        }
        let mut dt = inp.pick(&FLOATS);
        let mut style = if output {
            inp.pick(&OUTPUT_STYLES)
        } else {
            inp.pick(&INPUT_STYLES)
        };
        let mut brk = None;
        if inp.chance(1, 5) {
            match inp.below(5) {
                0 => {
                    let last = shape.len() - 1;
                    shape[last] += 1;
                }
                1 => shape.push(1),
                2 => {
                    dt = KVR_DTYPE_I32;
                    want.add(KVR_STATUS_DTYPE_MISMATCH);
                }
                3 if output => {
                    style = Style::Broadcast;
                    want.add_if(broadcast_overlaps(&shape), KVR_STATUS_INVALID_ARG);
                }
                _ => brk = Some(inp.pick(&BREAKS)),
            }
        }
        want.add_if(shape != expected, KVR_STATUS_INVALID_ARG);
        let mut t = Tensor::new(dt, &shape, style);
        if !output && is_float(dt) {
            let rng = &mut self.rng;
            t.fill(|_| rng.uniform(-0.5, 0.5));
        }
        if let Some(b) = brk {
            want.add(b.apply(&mut t));
        }
        t
    }

    /// Index of S[h][iv][ik] in a state tensor of the pool's layout.
    fn sidx(&self, h: usize, iv: usize, ik: usize) -> [usize; 3] {
        if self.cfg.vmajor {
            [h, iv, ik]
        } else {
            [h, ik, iv]
        }
    }

    /// A state (NULL sometimes) and, sometimes, a conv window: inputs of an import
    /// (`output` false) or outputs of an export or materialize (`all`: of every layer).
    fn state_args(
        &mut self,
        inp: &mut Input,
        output: bool,
        all: bool,
        one_layer: bool,
        want: &mut Expect,
    ) -> StateArgs {
        let c = self.cfg;
        let null = inp.chance(1, 16);
        want.add_if(null, KVR_STATUS_NULL_ARG);
        let mut state = self.state_tensor(inp, false, output, all, one_layer, want);
        let mut conv = if inp.chance(1, 2) && (c.conv_dim > 0 || inp.chance(1, 4)) {
            want.add_if(c.conv_dim == 0, KVR_STATUS_INVALID_ARG);
            Some(self.state_tensor(inp, true, output, all, one_layer, want))
        } else {
            None
        };
        if output {
            state.poison();
            if let Some(t) = conv.as_mut() {
                t.poison();
            }
        }
        let descs = (state.desc(), conv.as_ref().map(|t| t.desc()));
        StateArgs {
            state,
            conv,
            null,
            descs,
        }
    }

    fn op_import(&mut self, inp: &mut Input) {
        let c = self.cfg;
        let mut want = Expect::ok();
        let (layer, id) = self.state_target(inp, &mut want);
        let a = self.state_args(inp, false, false, false, &mut want);
        let s = kvr_gdn_pool_import_state(
            self.pool,
            layer,
            id,
            a.state_ptr(),
            a.conv_ptr(),
            null_mut(),
        );
        if !want.check(s, "gdn import_state") {
            return;
        }
        let (st, conv) = (&a.state, &a.conv);
        let l = layer as usize;
        let mut s_new = vec![0.0; c.hv * c.dv * c.dk];
        for h in 0..c.hv {
            for iv in 0..c.dv {
                for ik in 0..c.dk {
                    s_new[(h * c.dv + iv) * c.dk + ik] =
                        round(c.state_dtype, st.get(&self.sidx(h, iv, ik))) as f64;
                }
            }
        }
        let ls = &mut self.seqs.get_mut(&id).unwrap()[l];
        ls.hist = vec![s_new.clone()];
        ls.s = s_new;
        ls.mode = if c.ring == 0 {
            KVR_GDN_MODE_RECURRENT
        } else {
            KVR_GDN_MODE_REPLAY
        };
        ls.start = 0;
        ls.h = 0;
        if let Some(cv) = conv {
            for i in 0..c.conv_kernel - 1 {
                for d in 0..c.conv_dim {
                    ls.conv[i][d] = round(c.conv_dtype, cv.get(&[i, d]));
                }
            }
        }
    }

    fn op_export(&mut self, inp: &mut Input) {
        let mut want = Expect::ok();
        let (layer, id) = self.state_target(inp, &mut want);
        let a = self.state_args(inp, true, false, false, &mut want);
        let s = kvr_gdn_pool_export_state(
            self.pool,
            layer,
            id,
            a.state_ptr(),
            a.conv_ptr(),
            null_mut(),
        );
        if !want.check(s, "gdn export_state") {
            a.assert_untouched("export", s);
            return;
        }
        self.compare_state(layer as usize, id, None, &a.state, false, a.conv.as_ref());
    }

    /// Materialize: every layer's state `keep` tokens past its checkpoint (and, at the newest
    /// token, the conv windows) against the model's history; the pool must not change.
    fn op_materialize(&mut self, inp: &mut Input) {
        let c = self.cfg;
        let mut want = Expect::ok();
        let id = pick_id(inp, &self.seqs, c.max_seqs);
        let live = self.seqs.get(&id);
        want.add_if(live.is_none(), KVR_STATUS_UNKNOWN_ID);
        // Fills of the layers (the tokens each buffers since its checkpoint).
        let fills: Vec<usize> = live.map_or(Vec::new(), |ls| ls.iter().map(|x| x.h).collect());
        let lo = fills.iter().copied().min().unwrap_or(0);
        let hi = fills.iter().copied().max().unwrap_or(0);
        let keep: i32 = match inp.below(10) {
            0 => inp.pick(&[-1, i32::MIN]),
            1 => hi as i32 + 1,
            2 => i32::MAX,
            3 | 4 => hi as i32,
            _ => inp.below(lo + 1) as i32,
        };
        want.add_if(keep < 0, KVR_STATUS_OUT_OF_RANGE);
        if let Some(ls) = live {
            want.add_if(
                ls.iter().any(|x| x.pending.is_some()),
                KVR_STATUS_INVALID_ARG,
            );
            want.add_if(
                keep >= 0 && fills.iter().any(|&f| keep as usize > f),
                KVR_STATUS_OUT_OF_RANGE,
            );
        }
        // Sometimes one layer's shapes (no leading layer dimension).
        let one_layer = inp.chance(1, 16);
        let a = self.state_args(inp, true, true, one_layer, &mut want);
        want.add_if(
            a.conv.is_some() && keep >= 0 && fills.iter().any(|&f| keep as usize != f),
            KVR_STATUS_INVALID_ARG,
        );
        let s =
            kvr_gdn_pool_materialize(self.pool, id, keep, a.state_ptr(), a.conv_ptr(), null_mut());
        if !want.check(s, "gdn materialize") {
            a.assert_untouched("materialize", s);
            return;
        }
        for l in 0..c.layers {
            self.compare_state(l, id, Some(keep as usize), &a.state, true, a.conv.as_ref());
        }
    }

    /// The state of `id` in layer `l`, `keep` tokens past its checkpoint (None: the current
    /// one), and its conv window, against what an export (`all` false: `out` is one layer's)
    /// or a materialize (`all`: `out` and `conv` lead with the layer) wrote.
    fn compare_state(
        &self,
        l: usize,
        id: i32,
        keep: Option<usize>,
        out: &Tensor,
        all: bool,
        conv: Option<&Tensor>,
    ) {
        let c = self.cfg;
        let ls = &self.seqs[&id][l];
        let tol = c.tol() + out_tol(out.dtype);
        let state = keep.map_or(&ls.s[..], |k| ls.at(k));
        let at = |i: [usize; 3]| -> f32 {
            if all {
                out.get(&[l, i[0], i[1], i[2]])
            } else {
                out.get(&i)
            }
        };
        for h in 0..c.hv {
            for iv in 0..c.dv {
                for ik in 0..c.dk {
                    let got = at(self.sidx(h, iv, ik)) as f64;
                    let want_s = state[(h * c.dv + iv) * c.dk + ik];
                    assert!(
                        close(got, want_s, tol),
                        "sequence {id}, layer {l}, keep {keep:?}: state[{h}][v {iv}][k {ik}] = \
                         {got}, reference {want_s} (mode {}, buffered {})",
                        ls.mode,
                        ls.h
                    );
                }
            }
        }
        if let Some(t) = conv {
            let what = format!("sequence {id}, layer {l}: conv");
            check_conv(&c, &ls.conv, t, all.then_some(l), &what);
        }
    }

    /// Cursor and memory queries with odd arguments.
    fn op_queries(&mut self, inp: &mut Input) {
        let c = self.cfg;
        if inp.chance(1, 3) {
            let full = size_of::<kvr_gdn_pool_memory>();
            let (declared, ok) = match inp.below(3) {
                0 => (full - 8, false),
                1 => (full + 16, true),
                _ => (full, true),
            };
            let mut o = OutStruct::new(declared, full + 32);
            let want = if ok {
                Expect::ok()
            } else {
                Expect::only(KVR_STATUS_INVALID_ARG)
            };
            if want.check(
                kvr_gdn_pool_get_memory(self.pool, o.ptr()),
                "gdn get_memory",
            ) {
                let m: kvr_gdn_pool_memory = o.read();
                assert_eq!(m.struct_size as usize, full);
                assert!(o.tail_untouched(full));
                check_memory(&c, &m);
            } else {
                assert!(o.tail_untouched(4));
            }
            return;
        }
        let mut want = Expect::ok();
        let layer = layer_arg(inp, c.layers, false);
        layer_errors(layer, c.layers, false, &mut want);
        let id = pick_id(inp, &self.seqs, c.max_seqs);
        want.add_if(!self.seqs.contains_key(&id), KVR_STATUS_UNKNOWN_ID);
        let null_out = inp.chance(1, 4);
        want.add_if(null_out, KVR_STATUS_NULL_ARG);
        let mut cur = kvr_gdn_cursor {
            mode: -9,
            ring_start: -9,
            buffered: -9,
            pending: -9,
        };
        let s = kvr_gdn_pool_get_cursor(
            self.pool,
            layer,
            id,
            if null_out { null_mut() } else { &mut cur },
        );
        if want.check(s, "gdn get_cursor") {
            self.check_cursor(layer as usize, id, &cur);
        } else {
            assert_eq!(
                (cur.mode, cur.ring_start, cur.buffered, cur.pending),
                (-9, -9, -9, -9)
            );
        }
    }

    fn op_misuse(&mut self, inp: &mut Input) {
        let (h, want) = API.bad_handle(inp);
        let mut id = -4;
        let ids = ids_tensor(&[0], Style::Contiguous);
        let idd = ids.desc();
        let c = self.cfg;
        let mut a = self.clean_args(1, 1);
        a.out.poison();
        let st = Tensor::new(KVR_DTYPE_F32, &c.state_shape(), Style::Contiguous);
        let mut all = vec![c.layers];
        all.extend(c.state_shape());
        let mut so = Tensor::new(KVR_DTYPE_F32, &all, Style::Contiguous);
        so.poison();
        let s = match inp.below(13) {
            0 => kvr_gdn_pool_seq_add(h, null_mut(), &mut id),
            1 => kvr_gdn_pool_seq_free(h, 0, null_mut()),
            2 => kvr_gdn_pool_seq_reset(h, 0, null_mut()),
            3 => kvr_gdn_pool_flush(h, 0, &idd, null_mut()),
            4 => kvr_gdn_pool_commit(h, 0, &idd, &idd, null(), null_mut()),
            5 => {
                let mut cur = kvr_gdn_cursor {
                    mode: 0,
                    ring_start: 0,
                    buffered: 0,
                    pending: 0,
                };
                kvr_gdn_pool_get_cursor(h, 0, 0, &mut cur)
            }
            6 => {
                let mut o = OutStruct::new(size_of::<kvr_gdn_pool_memory>(), 128);
                kvr_gdn_pool_get_memory(h, o.ptr())
            }
            7 | 8 => {
                let verify = !inp.chance(1, 2);
                a.call(h, 0, &idd, verify)
            }
            9 => kvr_gdn_pool_import_state(h, 0, 0, &st.desc(), null(), null_mut()),
            10 => {
                let mut o = Tensor::new(KVR_DTYPE_F32, &c.state_shape(), Style::Contiguous);
                o.poison();
                let s = kvr_gdn_pool_export_state(h, 0, 0, &o.desc(), null(), null_mut());
                assert!(o.untouched(), "a refused export wrote out");
                s
            }
            _ => kvr_gdn_pool_materialize(h, 0, 0, &so.desc(), null(), null_mut()),
        };
        want.check(s, "gdn call through a bad handle");
        assert_eq!(id, -4);
        assert!(
            a.out.untouched() && so.untouched(),
            "a refused call wrote its outputs"
        );
        API.free_bad(h);
    }

    fn op_recreate(&mut self, inp: &mut Input) {
        API.free_checked(self.pool);
        let size = StructSize::valid_one(inp, 2);
        self.pool = create(&self.cfg, &mut self.ext, size);
        self.seqs.clear();
    }

    fn check_cursor(&self, l: usize, id: i32, cur: &kvr_gdn_cursor) {
        let ls = &self.seqs[&id][l];
        let want = (ls.mode, ls.start as i32, ls.h as i32, ls.pending_t() as i32);
        let got = (cur.mode, cur.ring_start, cur.buffered, cur.pending);
        assert_eq!(
            got, want,
            "cursor (mode, ring_start, buffered, pending) of sequence {id}, layer {l}"
        );
    }
}

/// Decodes `data` into a pool and a sequence of calls and checks each against the model.
/// Panics (with the reason) on any disagreement.
pub fn run(data: &[u8]) {
    drive::<GdnHarness>(data, MAX_OPS)
}
