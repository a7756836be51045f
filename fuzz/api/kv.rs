//! The paged KV pool through its C API: the input becomes a pool configuration and a
//! sequence of calls (valid and invalid ids, counts, shapes, dtypes, strides, NULLs,
//! struct sizes, dead and foreign handles). A model kept here predicts every status, and
//! after every call the pool is checked against it: lengths, block tables (each model page
//! maps to one real page, for good; no real page serves two model pages), page accounting
//! and sharing in the stats, the K/V bytes of pools over harness-owned memory, and decode
//! outputs against dense attention over the model's tokens. A failed call must leave the
//! pool as the model says (unchanged) and write no output.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

use kvreplay::ffi::*;

use super::common::*;

const MAX_OPS: usize = 48;

#[derive(Clone, Copy, Debug)]
struct Cfg {
    layers: usize,
    heads: usize,
    dim: usize,
    ps: usize,
    dtype: kvr_dtype,
    cap: usize,
    max_seqs: usize,
    max_len: usize,
    /// Harness-owned memory: (token-major, padding of token, head and page strides).
    external: Option<(bool, [usize; 3])>,
    /// Capacity given as a byte budget (with this many spare bytes).
    by_bytes: Option<usize>,
}

impl Cfg {
    fn page_bytes(&self) -> usize {
        2 * self.layers * self.heads * self.ps * self.dim * dsize(self.dtype)
    }
    /// (page, head, token) strides of harness-owned memory.
    fn strides(&self) -> [usize; 3] {
        let (tm, [pt, ph, pp]) = self.external.expect("external");
        if tm {
            let head = self.dim + ph;
            let token = self.heads * head + pt;
            [self.ps * token + pp, head, token]
        } else {
            let token = self.dim + pt;
            let head = self.ps * token + ph;
            [self.heads * head + pp, head, token]
        }
    }
    fn span(&self) -> usize {
        let [sp, sh, st] = self.strides();
        (self.cap - 1) * sp + (self.heads - 1) * sh + (self.ps - 1) * st + self.dim
    }
}

/// One token of one layer: K and V, `[heads * dim]` each, as the pool stores them.
type Token = Option<(Vec<f32>, Vec<f32>)>;

/// A sequence's length and pages (the contents are kept apart, in `Harness::data`, so that
/// the model is cheap to copy for what-if runs).
#[derive(Clone, Debug)]
struct SeqM {
    len: usize,
    /// Model page ids (never reused).
    pages: Vec<u64>,
}

#[derive(Clone, Debug)]
struct Model {
    cfg: Cfg,
    seqs: BTreeMap<i32, SeqM>,
    next_page: u64,
}

impl Model {
    fn refs(&self, page: u64) -> usize {
        self.seqs
            .values()
            .filter(|s| s.pages.contains(&page))
            .count()
    }
    fn distinct_pages(&self) -> usize {
        let mut all: Vec<u64> = self
            .seqs
            .values()
            .flat_map(|s| s.pages.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }
    fn lowest_free(&self) -> Option<i32> {
        (0..self.cfg.max_seqs as i32).find(|i| !self.seqs.contains_key(i))
    }
    fn fresh(&mut self) -> u64 {
        self.next_page += 1;
        self.next_page
    }
    /// Grows `seq` by `n` positions: copy-on-write of a shared partial last page, new pages.
    fn extend_one(&mut self, seq: i32, n: usize) {
        if n == 0 {
            return;
        }
        let ps = self.cfg.ps;
        let (len, last) = {
            let s = &self.seqs[&seq];
            (s.len, s.pages.last().copied())
        };
        if len % ps != 0 && self.refs(last.expect("partial page")) > 1 {
            let p = self.fresh();
            *self.seqs.get_mut(&seq).unwrap().pages.last_mut().unwrap() = p;
        }
        let need = (len + n).div_ceil(ps) - self.seqs[&seq].pages.len();
        let fresh: Vec<u64> = (0..need).map(|_| self.fresh()).collect();
        let s = self.seqs.get_mut(&seq).unwrap();
        s.pages.extend(fresh);
        s.len = len + n;
    }
    fn truncate(&mut self, seq: i32, len: usize) {
        let ps = self.cfg.ps;
        let s = self.seqs.get_mut(&seq).unwrap();
        s.len = len;
        s.pages.truncate(len.div_ceil(ps));
    }
    /// Whether the positions `len - n .. len` of `seq` touch a page another sequence holds.
    fn shared_tail(&self, seq: i32, n: usize) -> bool {
        let s = &self.seqs[&seq];
        if n == 0 {
            return false;
        }
        let ps = self.cfg.ps;
        (((s.len - n) / ps)..s.len.div_ceil(ps)).any(|pi| self.refs(s.pages[pi]) > 1)
    }
}

struct KvHarness {
    cfg: Cfg,
    pool: *mut kvr_kv_pool,
    model: Model,
    /// Model page -> real page, kept while the model page lives.
    real: HashMap<u64, i32>,
    /// Per live sequence, `[layer][position]` tokens; None = reserved by extend and not
    /// written yet.
    data: BTreeMap<i32, Vec<Vec<Token>>>,
    /// Harness-owned K and V memory per layer.
    ext: Vec<(Mem, Mem)>,
    rng: Rng,
}

const API: PoolApi<kvr_kv_pool> = PoolApi {
    name: "kv",
    seq_add: kvr_kv_pool_seq_add,
    seq_free: kvr_kv_pool_seq_free,
    free: kvr_kv_pool_free,
    dead: dead_pool,
    foreign: || context() as *mut kvr_kv_pool,
};

/// A handle that was a live pool once (handles are never reused).
fn dead_pool() -> *mut kvr_kv_pool {
    static DEAD: OnceLock<usize> = OnceLock::new();
    *DEAD.get_or_init(|| {
        let mut p = std::mem::MaybeUninit::uninit();
        assert_eq!(kvr_kv_pool_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
        // SAFETY: filled above.
        let mut p: kvr_kv_pool_params = unsafe { p.assume_init() };
        p.n_layers = 1;
        p.n_kv_heads = 1;
        p.head_dim = 1;
        p.capacity_pages = 1;
        p.max_seqs = 1;
        let mut pool = null_mut();
        assert_eq!(kvr_kv_pool_new(context(), &p, &mut pool), KVR_STATUS_OK);
        kvr_kv_pool_free(pool);
        pool as usize
    }) as *mut kvr_kv_pool
}

/// Ways to break `kvr_kv_pool_new`, one at a time, and the status each must give.
#[derive(Clone, Copy, Debug)]
enum BadNew {
    Layers0,
    LayersNegative,
    Heads0,
    Dim0,
    PageSize0,
    DtypeI32,
    DtypeUnknown,
    BothCapacities,
    NoCapacity,
    BudgetBelowPage,
    NegativeCapacity,
    MaxSeqs0,
    MaxLen0,
    StructSmaller,
    StructTail,
    NullParams,
    NullOut,
    NullCtx,
    ForeignCtx,
    ExtNullK,
    ExtTokenStride,
    ExtOverlap,
    ExtNegativeStride,
    ExtMisaligned,
}

const BAD_NEW: [BadNew; 24] = [
    BadNew::Layers0,
    BadNew::LayersNegative,
    BadNew::Heads0,
    BadNew::Dim0,
    BadNew::PageSize0,
    BadNew::DtypeI32,
    BadNew::DtypeUnknown,
    BadNew::BothCapacities,
    BadNew::NoCapacity,
    BadNew::BudgetBelowPage,
    BadNew::NegativeCapacity,
    BadNew::MaxSeqs0,
    BadNew::MaxLen0,
    BadNew::StructSmaller,
    BadNew::StructTail,
    BadNew::NullParams,
    BadNew::NullOut,
    BadNew::NullCtx,
    BadNew::ForeignCtx,
    BadNew::ExtNullK,
    BadNew::ExtTokenStride,
    BadNew::ExtOverlap,
    BadNew::ExtNegativeStride,
    BadNew::ExtMisaligned,
];

fn params_of(cfg: &Cfg, ext: &mut [(Mem, Mem)]) -> (kvr_kv_pool_params, Vec<kvr_kv_layer_layout>) {
    let mut p = std::mem::MaybeUninit::uninit();
    assert_eq!(kvr_kv_pool_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
    // SAFETY: filled above.
    let mut p: kvr_kv_pool_params = unsafe { p.assume_init() };
    p.n_layers = cfg.layers as i32;
    p.n_kv_heads = cfg.heads as i32;
    p.head_dim = cfg.dim as i32;
    p.page_size = cfg.ps as i32;
    p.dtype = cfg.dtype;
    match cfg.by_bytes {
        Some(spare) => {
            p.capacity_pages = 0;
            p.capacity_bytes = (cfg.cap * cfg.page_bytes() + spare) as i64;
        }
        None => p.capacity_pages = cfg.cap as i64,
    }
    p.max_seqs = cfg.max_seqs as i32;
    p.max_seq_len = cfg.max_len as i64;
    let mut layouts = Vec::new();
    if cfg.external.is_some() {
        let [sp, sh, st] = cfg.strides();
        for (k, v) in ext.iter_mut() {
            layouts.push(kvr_kv_layer_layout {
                k: k.ptr(),
                v: v.ptr(),
                k_stride_page: sp as i64,
                k_stride_head: sh as i64,
                k_stride_token: st as i64,
                v_stride_page: sp as i64,
                v_stride_head: sh as i64,
                v_stride_token: st as i64,
            });
        }
    }
    (p, layouts)
}

fn create(cfg: &Cfg, ext: &mut [(Mem, Mem)], size: StructSize) -> *mut kvr_kv_pool {
    let (mut p, layouts) = params_of(cfg, ext);
    if !layouts.is_empty() {
        p.layers = layouts.as_ptr();
    }
    let v = Versioned::new(p, size);
    let mut pool = null_mut();
    Expect::ok().check(
        kvr_kv_pool_new(context(), v.ptr(), &mut pool),
        "kv_pool_new",
    );
    assert!(!pool.is_null());
    pool
}

/// Tries one broken creation; it must fail with its status and write nothing.
fn bad_create(cfg: &Cfg, ext: &mut [(Mem, Mem)], bad: BadNew) {
    let (mut p, mut layouts) = params_of(cfg, ext);
    let mut size = StructSize::Exact;
    let mut ctx = context() as *const kvr_context;
    let mut null_params = false;
    let mut null_out = false;
    let want = match bad {
        BadNew::Layers0 => {
            p.n_layers = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::LayersNegative => {
            p.n_layers = -3;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::Heads0 => {
            p.n_kv_heads = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::Dim0 => {
            p.head_dim = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::PageSize0 => {
            p.page_size = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::DtypeI32 => {
            p.dtype = KVR_DTYPE_I32;
            (p.capacity_pages, p.capacity_bytes) = (cfg.cap as i64, 0);
            KVR_STATUS_DTYPE_MISMATCH
        }
        BadNew::DtypeUnknown => {
            p.dtype = 42;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::BothCapacities => {
            p.capacity_pages = cfg.cap as i64;
            p.capacity_bytes = (cfg.cap * cfg.page_bytes()) as i64;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::NoCapacity => {
            p.capacity_pages = 0;
            p.capacity_bytes = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::BudgetBelowPage => {
            p.capacity_pages = 0;
            p.capacity_bytes = (cfg.page_bytes() - 1) as i64;
            KVR_STATUS_OUT_OF_RANGE
        }
        BadNew::NegativeCapacity => {
            p.capacity_pages = -1;
            p.capacity_bytes = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::MaxSeqs0 => {
            p.max_seqs = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::MaxLen0 => {
            p.max_seq_len = 0;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::StructSmaller => {
            size = StructSize::Smaller;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::StructTail => {
            size = StructSize::LargerNonZero;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::NullParams => {
            null_params = true;
            KVR_STATUS_NULL_ARG
        }
        BadNew::NullOut => {
            null_out = true;
            KVR_STATUS_NULL_ARG
        }
        BadNew::NullCtx => {
            ctx = null();
            KVR_STATUS_NULL_ARG
        }
        BadNew::ForeignCtx => {
            ctx = dead_pool() as *const kvr_context;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::ExtNullK
        | BadNew::ExtTokenStride
        | BadNew::ExtOverlap
        | BadNew::ExtNegativeStride
        | BadNew::ExtMisaligned
            if layouts.is_empty() =>
        {
            return;
        }
        BadNew::ExtNullK => {
            layouts[0].k = null_mut();
            KVR_STATUS_NULL_ARG
        }
        BadNew::ExtTokenStride => {
            layouts[0].v_stride_token = cfg.dim as i64 - 1;
            KVR_STATUS_INVALID_ARG
        }
        BadNew::ExtOverlap => {
            if cfg.heads > 1 && cfg.ps > 1 {
                layouts[0].k_stride_head = layouts[0].k_stride_token;
            } else if cfg.cap > 1 && cfg.ps > 1 {
                layouts[0].k_stride_page = layouts[0].k_stride_token;
            } else {
                layouts[0].k_stride_token = cfg.dim as i64 - 1;
            }
            KVR_STATUS_INVALID_ARG
        }
        BadNew::ExtNegativeStride => {
            layouts[0].k_stride_page = -(layouts[0].k_stride_page);
            if layouts[0].k_stride_page == 0 {
                layouts[0].k_stride_page = -1;
            }
            KVR_STATUS_INVALID_ARG
        }
        BadNew::ExtMisaligned => {
            layouts[0].k = (layouts[0].k as usize + 1) as *mut c_void;
            KVR_STATUS_INVALID_ARG
        }
    };
    if !layouts.is_empty() {
        p.layers = layouts.as_ptr();
    }
    let v = Versioned::new(p, size);
    let sentinel = 0x5A50 as *mut kvr_kv_pool;
    let mut out = sentinel;
    let s = kvr_kv_pool_new(
        ctx,
        if null_params { null() } else { v.ptr() },
        if null_out { null_mut() } else { &mut out },
    );
    Expect::only(want).check(s, &format!("kv_pool_new with {bad:?}"));
    assert_eq!(out, sentinel, "kv_pool_new with {bad:?} wrote *out");
}

fn pick_id(inp: &mut Input, m: &Model) -> i32 {
    super::common::pick_id(inp, &m.seqs, m.cfg.max_seqs)
}

fn is_live(m: &Model, id: i32) -> bool {
    m.seqs.contains_key(&id)
}

/// K/V source tensors of `shape` with random values; a broken variant per `bad`.
struct KvSrc {
    k: Tensor,
    v: Tensor,
}

/// How the K/V tensors of a write or append are given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SrcBad {
    None,
    Shape,
    VShape,
    DtypeI32,
    Break(Break),
    NullK,
    NullV,
}

fn pick_src_bad(inp: &mut Input) -> SrcBad {
    if inp.chance(3, 4) {
        return SrcBad::None;
    }
    match inp.below(6) {
        0 => SrcBad::Shape,
        1 => SrcBad::VShape,
        2 => SrcBad::DtypeI32,
        3 => SrcBad::NullK,
        4 => SrcBad::NullV,
        _ => SrcBad::Break(inp.pick(&BREAKS)),
    }
}

impl Harness for KvHarness {
    fn new(inp: &mut Input) -> Self {
        let layers = 1 + inp.below(2);
        let heads = 1 + inp.below(2);
        let dim = inp.pick(&[1, 2, 3, 4, 8]);
        let ps = 1 + inp.below(4);
        let dtype = inp.pick(&[KVR_DTYPE_F16, KVR_DTYPE_BF16, KVR_DTYPE_F32]);
        let cap = 1 + inp.below(10);
        let max_seqs = 1 + inp.below(5);
        let max_len = 1 + inp.below(24);
        let ext_byte = inp.byte();
        let external = (ext_byte % 3 == 0).then_some((
            ext_byte & 8 != 0,
            [
                (ext_byte >> 4) as usize & 1,
                (ext_byte >> 5) as usize & 1,
                (ext_byte >> 6) as usize & 1,
            ],
        ));
        let bb = inp.byte();
        let cfg0 = Cfg {
            layers,
            heads,
            dim,
            ps,
            dtype,
            cap,
            max_seqs,
            max_len,
            external,
            by_bytes: None,
        };
        let by_bytes = (bb % 4 == 0).then(|| bb as usize % cfg0.page_bytes());
        let cfg = Cfg { by_bytes, ..cfg0 };
        let mut ext = Vec::new();
        if cfg.external.is_some() {
            let bytes = cfg.span() * dsize(cfg.dtype);
            for _ in 0..layers {
                ext.push((Mem::new(bytes), Mem::new(bytes)));
            }
        }
        let bad = inp.byte();
        if bad % 4 == 0 {
            bad_create(&cfg, &mut ext, BAD_NEW[(bad as usize / 4) % BAD_NEW.len()]);
        }
        let size = StructSize::valid_one(inp, 4);
        let pool = create(&cfg, &mut ext, size);
        let seed = inp.byte() as u64;
        KvHarness {
            cfg,
            pool,
            model: Model {
                cfg,
                seqs: BTreeMap::new(),
                next_page: 0,
            },
            real: HashMap::new(),
            data: BTreeMap::new(),
            ext,
            rng: Rng::new(seed),
        }
    }

    fn step(&mut self, inp: &mut Input) {
        match inp.below(16) {
            0 | 1 => self.op_append(inp),
            2 => self.op_add(inp),
            3 => self.op_fork(inp),
            4 => self.op_extend(inp, false),
            5 => self.op_write(inp, None),
            6 => self.op_truncate(inp),
            7 => self.op_free(inp),
            8 | 9 => self.op_decode(inp),
            10 => self.op_admit(inp),
            11 => self.op_stats(inp),
            12 => self.op_queries(inp),
            13 => self.op_extend(inp, true),
            14 => self.op_misuse(inp),
            _ => {
                if inp.chance(1, 4) {
                    self.op_recreate(inp);
                } else {
                    self.op_append(inp);
                }
            }
        }
    }

    /// The pool against the model: stats, lengths, block tables, harness-owned K/V bytes.
    fn check(&mut self) {
        let mut st: kvr_kv_pool_stats = unsafe { std::mem::zeroed() };
        st.struct_size = size_of::<kvr_kv_pool_stats>() as u32;
        Expect::ok().check(kvr_kv_pool_get_stats(self.pool, &mut st), "kv get_stats");
        self.check_stats(&st);
        let mut seen: HashMap<i32, u64> = HashMap::new();
        let mut tables: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
        for (&id, s) in &self.model.seqs {
            let mut len = -1;
            Expect::ok().check(
                kvr_kv_pool_get_seq_len(self.pool, id, &mut len),
                "get_seq_len",
            );
            assert_eq!(len, s.len as i64, "length of sequence {id}");
            let mut pages = vec![-1i32; s.pages.len()];
            let mut n = -1;
            Expect::ok().check(
                kvr_kv_pool_get_seq_pages(
                    self.pool,
                    id,
                    pages.as_mut_ptr(),
                    pages.len() as i64,
                    &mut n,
                ),
                "get_seq_pages",
            );
            assert_eq!(n, s.pages.len() as i64, "page count of sequence {id}");
            for (&mp, &rp) in s.pages.iter().zip(&pages) {
                assert!(
                    rp >= 0 && (rp as usize) < self.cfg.cap,
                    "sequence {id} holds page {rp} outside the pool"
                );
                if let Some(&prev) = self.real.get(&mp) {
                    assert_eq!(prev, rp, "a page of sequence {id} moved or was not shared");
                }
                self.real.insert(mp, rp);
                if let Some(&other) = seen.get(&rp) {
                    assert_eq!(other, mp, "page {rp} serves two different model pages");
                }
                seen.insert(rp, mp);
            }
            tables.insert(id, pages);
        }
        let live: std::collections::HashSet<u64> = self
            .model
            .seqs
            .values()
            .flat_map(|s| s.pages.iter().copied())
            .collect();
        self.real.retain(|p, _| live.contains(p));
        if self.cfg.external.is_none() {
            return;
        }
        let [sp, sh, stt] = self.cfg.strides();
        let (ps, h, d, dt) = (self.cfg.ps, self.cfg.heads, self.cfg.dim, self.cfg.dtype);
        for id in self.model.seqs.keys() {
            let table = &tables[id];
            for (l, layer) in self.data[id].iter().enumerate() {
                for (pos, tok) in layer.iter().enumerate() {
                    let Some((k, v)) = tok else { continue };
                    let page = table[pos / ps] as usize;
                    for hh in 0..h {
                        for dd in 0..d {
                            let e = page * sp + hh * sh + (pos % ps) * stt + dd;
                            let (gk, gv) = (self.ext[l].0.get(dt, e), self.ext[l].1.get(dt, e));
                            assert!(
                                gk == k[hh * d + dd] && gv == v[hh * d + dd],
                                "sequence {id}, layer {l}, position {pos}: pool memory holds \
                                 ({gk}, {gv}), the model ({}, {})",
                                k[hh * d + dd],
                                v[hh * d + dd]
                            );
                        }
                    }
                }
            }
        }
    }

    fn close(self) {
        kvr_kv_pool_free(self.pool)
    }
}

impl KvHarness {
    /// Token storage follows the model: dead sequences dropped, new ones empty, lengths
    /// matched (positions past a truncation dropped, new ones unwritten).
    fn sync_data(&mut self) {
        let m = &self.model;
        self.data.retain(|id, _| m.seqs.contains_key(id));
        for (&id, s) in &m.seqs {
            let d = self
                .data
                .entry(id)
                .or_insert_with(|| vec![Vec::new(); self.cfg.layers]);
            for l in d.iter_mut() {
                l.resize(s.len, None);
            }
        }
    }

    fn values(&mut self, t: &mut Tensor) {
        let rng = &mut self.rng;
        t.fill(|_| rng.uniform(-1.0, 1.0));
    }

    /// Source tensors `[tokens, H, D]` (one layer) or `[L, tokens, H, D]`.
    fn src(
        &mut self,
        inp: &mut Input,
        all: bool,
        tokens: usize,
        bad: SrcBad,
        want: &mut Expect,
    ) -> KvSrc {
        let (h, d, l) = (self.cfg.heads, self.cfg.dim, self.cfg.layers);
        let shape = |tok: usize, dd: usize| -> Vec<usize> {
            if all {
                vec![l, tok, h, dd]
            } else {
                vec![tok, h, dd]
            }
        };
        let dk = inp.pick(&FLOATS);
        let dv = inp.pick(&FLOATS);
        let sk = inp.pick(&INPUT_STYLES);
        let sv = inp.pick(&INPUT_STYLES);
        let mut kshape = shape(tokens, d);
        let mut vshape = kshape.clone();
        let (mut dtk, mut dtv) = (dk, dv);
        match bad {
            SrcBad::Shape => {
                if inp.chance(1, 2) {
                    kshape = shape(tokens, d + 1);
                } else if all {
                    kshape.remove(0);
                } else {
                    kshape.insert(0, l);
                }
                vshape = kshape.clone();
                want.add(KVR_STATUS_INVALID_ARG);
            }
            SrcBad::VShape => {
                vshape = shape(tokens + 1, d);
                want.add(KVR_STATUS_INVALID_ARG);
            }
            SrcBad::DtypeI32 => {
                if inp.chance(1, 2) {
                    dtk = KVR_DTYPE_I32;
                } else {
                    dtv = KVR_DTYPE_I32;
                }
                want.add(KVR_STATUS_DTYPE_MISMATCH);
            }
            _ => {}
        }
        let mut k = Tensor::new(dtk, &kshape, sk);
        let mut v = Tensor::new(dtv, &vshape, sv);
        if is_float(dtk) {
            self.values(&mut k);
        }
        if is_float(dtv) {
            self.values(&mut v);
        }
        match bad {
            SrcBad::Break(b) => {
                let t = if inp.chance(1, 2) { &mut k } else { &mut v };
                want.add(b.apply(t));
            }
            SrcBad::NullK | SrcBad::NullV => want.add(KVR_STATUS_NULL_ARG),
            _ => {}
        }
        KvSrc { k, v }
    }

    /// Stores token `tok` of the source (layer index `li` of an all-layer tensor) as pool
    /// values.
    fn token_of(&self, src: &KvSrc, all: bool, li: usize, tok: usize) -> (Vec<f32>, Vec<f32>) {
        let (h, d) = (self.cfg.heads, self.cfg.dim);
        let mut k = Vec::with_capacity(h * d);
        let mut v = Vec::with_capacity(h * d);
        for hh in 0..h {
            for dd in 0..d {
                let idx: Vec<usize> = if all {
                    vec![li, tok, hh, dd]
                } else {
                    vec![tok, hh, dd]
                };
                k.push(round(self.cfg.dtype, src.k.get(&idx)));
                v.push(round(self.cfg.dtype, src.v.get(&idx)));
            }
        }
        (k, v)
    }

    fn op_add(&mut self, inp: &mut Input) {
        let next = self.model.lowest_free();
        if let Some(id) = API.add(self.pool, inp, next.is_some()) {
            assert_eq!(Some(id), next, "seq_add returns the lowest free id");
            self.model.seqs.insert(
                id,
                SeqM {
                    len: 0,
                    pages: Vec::new(),
                },
            );
            self.sync_data();
        }
    }

    fn op_fork(&mut self, inp: &mut Input) {
        let src = pick_id(inp, &self.model);
        let null_out = inp.chance(1, 8);
        let mut want = Expect::ok();
        want.add_if(null_out, KVR_STATUS_NULL_ARG);
        want.add_if(!is_live(&self.model, src), KVR_STATUS_UNKNOWN_ID);
        let next = self.model.lowest_free();
        want.add_if(next.is_none(), KVR_STATUS_POOL_EXHAUSTED);
        let mut id = -77;
        let s = kvr_kv_pool_seq_fork(
            self.pool,
            src,
            null_mut(),
            if null_out { null_mut() } else { &mut id },
        );
        if want.check(s, "kv seq_fork") {
            assert!(
                id >= 0 && (id as usize) < self.cfg.max_seqs && !is_live(&self.model, id),
                "fork returned id {id}, not a free one"
            );
            let child = self.model.seqs[&src].clone();
            self.model.seqs.insert(id, child);
            let d = self.data[&src].clone();
            self.data.insert(id, d);
        } else {
            assert_eq!(id, -77, "a failed seq_fork wrote *out_seq");
        }
    }

    fn op_free(&mut self, inp: &mut Input) {
        let id = pick_id(inp, &self.model);
        if API.free_seq(self.pool, id, is_live(&self.model, id)) {
            self.model.seqs.remove(&id);
            self.sync_data();
        }
    }

    fn op_truncate(&mut self, inp: &mut Input) {
        let id = pick_id(inp, &self.model);
        let cur = self.model.seqs.get(&id).map_or(0, |s| s.len) as i64;
        let len: i64 = match inp.below(8) {
            0 => -1,
            1 => cur + 1,
            2 => i64::MIN,
            3 => cur,
            _ => inp.below(cur as usize + 1) as i64,
        };
        let mut want = Expect::ok();
        want.add_if(!is_live(&self.model, id), KVR_STATUS_UNKNOWN_ID);
        want.add_if(len < 0 || len > cur, KVR_STATUS_OUT_OF_RANGE);
        if want.check(
            kvr_kv_pool_seq_truncate(self.pool, id, len, null_mut()),
            "kv seq_truncate",
        ) {
            self.model.truncate(id, len as usize);
            self.sync_data();
        }
    }

    /// A batch of (seq, count) entries for extend or write.
    fn groups(&mut self, inp: &mut Input, write: bool) -> Vec<(i32, i32)> {
        let n = inp.below(4);
        let mut g: Vec<(i32, i32)> = Vec::new();
        for _ in 0..n {
            let id = pick_id(inp, &self.model);
            let len = self.model.seqs.get(&id).map_or(0, |s| s.len);
            let c = match inp.below(10) {
                0 => -1,
                1 if write => len as i32 + 1,
                1 => (self.cfg.max_len + 1) as i32,
                2 => 0,
                _ if write => inp.below(len + 1) as i32,
                _ => inp.below(self.cfg.ps * 2 + 1) as i32,
            };
            g.push((id, c));
        }
        g
    }

    /// Statuses of a batch's ids and counts: unknown ids, duplicates, negative counts.
    fn group_errors(&self, g: &[(i32, i32)], want: &mut Expect) {
        for (i, &(id, c)) in g.iter().enumerate() {
            want.add_if(c < 0, KVR_STATUS_INVALID_ARG);
            want.add_if(!is_live(&self.model, id), KVR_STATUS_UNKNOWN_ID);
            want.add_if(g[..i].iter().any(|x| x.0 == id), KVR_STATUS_INVALID_ARG);
        }
    }

    /// Extend (and, with `then_write`, a valid write of the new positions after it).
    fn op_extend(&mut self, inp: &mut Input, then_write: bool) {
        let g = self.groups(inp, false);
        let mut want = Expect::ok();
        self.group_errors(&g, &mut want);
        let (n_arg, null_arrays) = match inp.below(12) {
            0 => (-1, false),
            1 if !g.is_empty() => (g.len() as i32, true),
            _ => (g.len() as i32, false),
        };
        want.add_if(n_arg < 0, KVR_STATUS_INVALID_ARG);
        want.add_if(null_arrays, KVR_STATUS_NULL_ARG);
        for &(id, c) in &g {
            if let Some(s) = self.model.seqs.get(&id) {
                want.add_if(
                    c >= 0 && s.len + c as usize > self.cfg.max_len,
                    KVR_STATUS_OUT_OF_RANGE,
                );
            }
        }
        let mut after = self.model.clone();
        if want.is_ok() {
            for &(id, c) in &g {
                after.extend_one(id, c as usize);
            }
            want.add_if(
                after.distinct_pages() > self.cfg.cap,
                KVR_STATUS_POOL_EXHAUSTED,
            );
        }
        let ids: Vec<i32> = g.iter().map(|x| x.0).collect();
        let counts: Vec<i32> = g.iter().map(|x| x.1).collect();
        let s = kvr_kv_pool_extend(
            self.pool,
            if null_arrays { null() } else { ids.as_ptr() },
            if null_arrays { null() } else { counts.as_ptr() },
            n_arg,
            null_mut(),
        );
        if want.check(s, "kv extend") {
            self.model = after;
            self.sync_data();
            self.check();
            if then_write {
                let wg: Vec<(i32, i32)> = g.iter().copied().filter(|x| x.1 > 0).collect();
                self.op_write(inp, Some(wg));
            }
        }
    }

    /// A write of `given` groups (valid ones, after an extend) or of fuzzed ones.
    fn op_write(&mut self, inp: &mut Input, given: Option<Vec<(i32, i32)>>) {
        let valid_path = given.is_some();
        let g = match given {
            Some(g) => g,
            None => self.groups(inp, true),
        };
        let mut want = Expect::ok();
        self.group_errors(&g, &mut want);
        let (n_arg, null_arrays) = match (valid_path, inp.below(12)) {
            (false, 0) => (-1, false),
            (false, 1) if !g.is_empty() => (g.len() as i32, true),
            _ => (g.len() as i32, false),
        };
        want.add_if(n_arg < 0, KVR_STATUS_INVALID_ARG);
        want.add_if(null_arrays, KVR_STATUS_NULL_ARG);
        for &(id, c) in &g {
            if let Some(s) = self.model.seqs.get(&id) {
                if c >= 0 {
                    want.add_if(c as usize > s.len, KVR_STATUS_OUT_OF_RANGE);
                    if c as usize <= s.len {
                        want.add_if(
                            self.model.shared_tail(id, c as usize),
                            KVR_STATUS_INVALID_ARG,
                        );
                    }
                }
            }
        }
        let layer: i32 = match inp.below(10) {
            0 if !valid_path => inp.pick(&[-2, i32::MIN, self.cfg.layers as i32, 99]),
            1..=4 => KVR_LAYER_ALL,
            _ => inp.below(self.cfg.layers) as i32,
        };
        want.add_if(
            layer < -1 || layer >= self.cfg.layers as i32,
            KVR_STATUS_OUT_OF_RANGE,
        );
        let all = layer == KVR_LAYER_ALL;
        let tokens: usize = g.iter().map(|x| x.1.max(0) as usize).sum();
        let bad = if valid_path {
            SrcBad::None
        } else {
            pick_src_bad(inp)
        };
        let src = self.src(inp, all, tokens, bad, &mut want);
        let (kd, vd) = (src.k.desc(), src.v.desc());
        let ids: Vec<i32> = g.iter().map(|x| x.0).collect();
        let counts: Vec<i32> = g.iter().map(|x| x.1).collect();
        let s = kvr_kv_pool_write(
            self.pool,
            layer,
            if null_arrays { null() } else { ids.as_ptr() },
            if null_arrays { null() } else { counts.as_ptr() },
            n_arg,
            if bad == SrcBad::NullK { null() } else { &kd },
            if bad == SrcBad::NullV { null() } else { &vd },
            null_mut(),
        );
        if want.check(s, "kv write") {
            let layers: Vec<usize> = if all {
                (0..self.cfg.layers).collect()
            } else {
                vec![layer as usize]
            };
            let mut off = 0;
            for &(id, c) in &g {
                let c = c as usize;
                let len = self.model.seqs[&id].len;
                for j in 0..c {
                    for (li, &l) in layers.iter().enumerate() {
                        let tok = self.token_of(&src, all, li, off + j);
                        self.data.get_mut(&id).unwrap()[l][len - c + j] = Some(tok);
                    }
                }
                off += c;
            }
        }
    }

    fn op_append(&mut self, inp: &mut Input) {
        let id = pick_id(inp, &self.model);
        let n = match inp.below(10) {
            0 => 0,
            1 => self.cfg.ps * 3,
            _ => 1 + inp.below(3),
        };
        let mut want = Expect::ok();
        want.add_if(!is_live(&self.model, id), KVR_STATUS_UNKNOWN_ID);
        let bad = pick_src_bad(inp);
        let src = self.src(inp, true, n, bad, &mut want);
        let mut after = self.model.clone();
        if let Some(s) = self.model.seqs.get(&id) {
            if s.len + n > self.cfg.max_len {
                want.add(KVR_STATUS_OUT_OF_RANGE);
            } else {
                after.extend_one(id, n);
                want.add_if(
                    after.distinct_pages() > self.cfg.cap,
                    KVR_STATUS_POOL_EXHAUSTED,
                );
            }
        }
        let (kd, vd) = (src.k.desc(), src.v.desc());
        let s = kvr_kv_pool_append(
            self.pool,
            id,
            if bad == SrcBad::NullK { null() } else { &kd },
            if bad == SrcBad::NullV { null() } else { &vd },
            null_mut(),
        );
        if want.check(s, "kv append") {
            let len = self.model.seqs[&id].len;
            self.model = after;
            self.sync_data();
            for j in 0..n {
                for l in 0..self.cfg.layers {
                    let tok = self.token_of(&src, true, l, j);
                    self.data.get_mut(&id).unwrap()[l][len + j] = Some(tok);
                }
            }
        }
    }

    fn op_admit(&mut self, inp: &mut Input) {
        let seq = if inp.chance(1, 3) {
            KVR_SEQ_NONE
        } else {
            pick_id(inp, &self.model)
        };
        let n: i64 = match inp.below(8) {
            0 => -1,
            1 => i64::MAX / 2,
            _ => inp.below(self.cfg.ps * self.cfg.cap + 3) as i64,
        };
        let null_out = inp.chance(1, 10);
        let mut want = Expect::ok();
        want.add_if(n < 0, KVR_STATUS_INVALID_ARG);
        want.add_if(null_out, KVR_STATUS_NULL_ARG);
        want.add_if(
            seq != KVR_SEQ_NONE && !is_live(&self.model, seq),
            KVR_STATUS_UNKNOWN_ID,
        );
        let mut out = -5;
        let s = kvr_kv_pool_admit(
            self.pool,
            seq,
            n,
            if null_out { null_mut() } else { &mut out },
        );
        if want.check(s, "kv admit") {
            let n = n as usize;
            let (ps, cap) = (self.cfg.ps, self.cfg.cap);
            let free = cap - self.model.distinct_pages();
            let (len, needed, slot) = if seq == KVR_SEQ_NONE {
                (0, n.div_ceil(ps), self.model.lowest_free().is_some())
            } else {
                let mut after = self.model.clone();
                let len = after.seqs[&seq].len;
                let before = after.distinct_pages();
                if len + n <= self.cfg.max_len {
                    after.extend_one(seq, n);
                }
                (len, after.distinct_pages() - before, true)
            };
            let verdict = if len.saturating_add(n) > self.cfg.max_len
                || len.saturating_add(n).div_ceil(ps) > cap
            {
                KVR_ADMIT_NEVER
            } else if needed > free || !slot {
                KVR_ADMIT_LATER
            } else {
                KVR_ADMIT_OK
            };
            assert_eq!(out, verdict, "admit(seq {seq}, {n} tokens)");
        } else {
            assert_eq!(out, -5, "a failed admit wrote *out");
        }
    }

    fn op_stats(&mut self, inp: &mut Input) {
        let full = size_of::<kvr_kv_pool_stats>();
        let (declared, ok) = match inp.below(4) {
            0 => (full - 8, false),
            1 => (full + 16, true),
            2 => (4, false),
            _ => (full, true),
        };
        let mut o = OutStruct::new(declared, full + 32);
        let s = kvr_kv_pool_get_stats(self.pool, o.ptr());
        let want = if ok {
            Expect::ok()
        } else {
            Expect::only(KVR_STATUS_INVALID_ARG)
        };
        if want.check(s, "kv get_stats") {
            let st: kvr_kv_pool_stats = o.read();
            assert_eq!(st.struct_size as usize, full);
            assert!(o.tail_untouched(full), "get_stats wrote past its struct");
            self.check_stats(&st);
        } else {
            assert!(o.tail_untouched(4), "a failed get_stats wrote *out");
        }
    }

    /// get_seq_len / get_seq_pages with odd arguments.
    fn op_queries(&mut self, inp: &mut Input) {
        let id = pick_id(inp, &self.model);
        let live = self.model.seqs.get(&id).cloned();
        let mut want = Expect::ok();
        want.add_if(live.is_none(), KVR_STATUS_UNKNOWN_ID);
        if inp.chance(1, 3) {
            let null_out = inp.chance(1, 3);
            want.add_if(null_out, KVR_STATUS_NULL_ARG);
            let mut n = -9i64;
            let s =
                kvr_kv_pool_get_seq_len(self.pool, id, if null_out { null_mut() } else { &mut n });
            if want.check(s, "kv get_seq_len") {
                assert_eq!(n, live.unwrap().len as i64);
            } else {
                assert_eq!(n, -9);
            }
            return;
        }
        let count = live.as_ref().map_or(0, |s| s.pages.len()) as i64;
        let capacity: i64 = match inp.below(5) {
            0 => count - 1,
            1 => -3,
            2 => count + 2,
            _ => count,
        };
        let null_pages = inp.chance(1, 4);
        let null_count = inp.chance(1, 8);
        want.add_if(null_count, KVR_STATUS_NULL_ARG);
        let room_short = count > capacity.max(0);
        want.add_if(live.is_some() && room_short, KVR_STATUS_OUT_OF_RANGE);
        want.add_if(
            live.is_some() && null_pages && count > 0 && !room_short,
            KVR_STATUS_NULL_ARG,
        );
        let mut pages = vec![-3i32; capacity.max(0) as usize + 1];
        let mut out = -9i64;
        let s = kvr_kv_pool_get_seq_pages(
            self.pool,
            id,
            if null_pages {
                null_mut()
            } else {
                pages.as_mut_ptr()
            },
            capacity,
            if null_count { null_mut() } else { &mut out },
        );
        if want.check(s, "kv get_seq_pages") {
            assert_eq!(out, count);
            assert!(pages[count as usize..].iter().all(|&p| p == -3));
        } else {
            assert!(
                pages.iter().all(|&p| p == -3),
                "a failed get_seq_pages wrote pages"
            );
            if s == KVR_STATUS_OUT_OF_RANGE && !null_count {
                assert_eq!(out, count, "OUT_OF_RANGE stores the page count");
            } else {
                assert_eq!(out, -9);
            }
        }
    }

    /// Calls through a NULL, freed or foreign handle: refused, nothing changes.
    fn op_misuse(&mut self, inp: &mut Input) {
        let (h, want) = API.bad_handle(inp);
        let mut id = -4;
        let mut n = -4i64;
        let ids = [0i32];
        let counts = [1i32];
        // Valid-looking tensors for the calls that take them (one token, one layer).
        let c = self.cfg;
        let kv = Tensor::new(
            KVR_DTYPE_F32,
            &[c.layers, 1, c.heads, c.dim],
            Style::Contiguous,
        );
        let q = Tensor::new(KVR_DTYPE_F32, &[1, c.heads, c.dim], Style::Contiguous);
        let mut out = Tensor::new(KVR_DTYPE_F32, &[1, c.heads, c.dim], Style::Contiguous);
        out.poison();
        let idt = ids_tensor(&[0], Style::Contiguous);
        let mut pages = [-3i32; 4];
        let s = match inp.below(12) {
            0 => kvr_kv_pool_seq_add(h, null_mut(), &mut id),
            1 => kvr_kv_pool_seq_free(h, 0, null_mut()),
            2 => kvr_kv_pool_seq_fork(h, 0, null_mut(), &mut id),
            3 => kvr_kv_pool_seq_truncate(h, 0, 0, null_mut()),
            4 => kvr_kv_pool_extend(h, ids.as_ptr(), counts.as_ptr(), 1, null_mut()),
            5 => kvr_kv_pool_get_seq_len(h, 0, &mut n),
            6 => {
                let mut o = OutStruct::new(size_of::<kvr_kv_pool_stats>(), 128);
                kvr_kv_pool_get_stats(h, o.ptr())
            }
            7 => {
                let mut a = 0;
                kvr_kv_pool_admit(h, KVR_SEQ_NONE, 1, &mut a)
            }
            8 => kvr_kv_pool_append(h, 0, &kv.desc(), &kv.desc(), null_mut()),
            9 => kvr_kv_pool_write(
                h,
                KVR_LAYER_ALL,
                ids.as_ptr(),
                counts.as_ptr(),
                1,
                &kv.desc(),
                &kv.desc(),
                null_mut(),
            ),
            10 => kvr_kv_pool_decode(
                h,
                0,
                &idt.desc(),
                &q.desc(),
                &out.desc(),
                null(),
                null(),
                null_mut(),
            ),
            _ => kvr_kv_pool_get_seq_pages(h, 0, pages.as_mut_ptr(), 4, &mut n),
        };
        want.check(s, "kv call through a bad handle");
        assert_eq!((id, n), (-4, -4));
        assert!(
            out.untouched() && pages == [-3; 4],
            "a refused call wrote its outputs"
        );
        API.free_bad(h);
    }

    /// Frees the pool, checks that its handle is dead, and starts a new one.
    fn op_recreate(&mut self, inp: &mut Input) {
        API.free_checked(self.pool);
        let size = StructSize::valid_one(inp, 2);
        self.pool = create(&self.cfg, &mut self.ext, size);
        self.model.seqs.clear();
        self.real.clear();
        self.data.clear();
    }

    fn op_decode(&mut self, inp: &mut Input) {
        let cfg = self.cfg;
        let mut want = Expect::ok();
        let layer: i32 = if inp.chance(1, 10) {
            inp.pick(&[-1, -5, cfg.layers as i32, i32::MAX])
        } else {
            inp.below(cfg.layers) as i32
        };
        want.add_if(
            layer < 0 || layer >= cfg.layers as i32,
            KVR_STATUS_OUT_OF_RANGE,
        );
        // Rows: live sequences (distinct), -1 rows, sometimes bad ids.
        let b = if inp.chance(1, 16) {
            cfg.max_seqs + 1
        } else {
            inp.below(4)
        };
        let live: Vec<i32> = self.model.seqs.keys().copied().collect();
        let mut rows = Vec::with_capacity(b);
        for _ in 0..b {
            let id = match inp.below(8) {
                0 => -1,
                1 => pick_id(inp, &self.model),
                _ if !live.is_empty() => {
                    let unused: Vec<i32> =
                        live.iter().copied().filter(|x| !rows.contains(x)).collect();
                    if unused.is_empty() {
                        -1
                    } else {
                        unused[inp.below(unused.len())]
                    }
                }
                _ => -1,
            };
            rows.push(id);
        }
        let t = match inp.below(12) {
            0 => 0,
            1 => 9,
            _ => 1 + inp.below(3),
        };
        let four = t != 1 || inp.chance(1, 2);
        let group = match inp.below(12) {
            0 => 17,
            _ => 1 + inp.below(2),
        };
        let mut hq = cfg.heads * group;
        let mut d = cfg.dim;
        match inp.below(16) {
            0 => {
                hq = 0;
                want.add(KVR_STATUS_INVALID_ARG);
            }
            1 if cfg.heads > 1 => {
                hq = cfg.heads + 1;
                want.add(KVR_STATUS_INVALID_ARG);
            }
            2 => {
                d = cfg.dim + 1;
                want.add(KVR_STATUS_INVALID_ARG);
            }
            _ => {}
        }
        want.add_if(
            group > 16 && hq == cfg.heads * group,
            KVR_STATUS_OUT_OF_RANGE,
        );
        want.add_if(t == 0 || t > 8, KVR_STATUS_OUT_OF_RANGE);
        let qshape: Vec<usize> = if four {
            vec![b, t, hq, d]
        } else {
            vec![b, hq, d]
        };
        let (idt, seen, null_ids) = id_arg(inp, &rows, &mut want, false);
        want.add_if(b > cfg.max_seqs, KVR_STATUS_OUT_OF_RANGE);
        for (i, &id) in seen.iter().enumerate() {
            if id != -1 && !is_live(&self.model, id) {
                want.add(KVR_STATUS_UNKNOWN_ID);
            }
            if id >= 0 && seen[..i].contains(&id) {
                want.add(KVR_STATUS_INVALID_ARG);
            }
            if let Some(s) = self.model.seqs.get(&id) {
                want.add_if(s.len < t, KVR_STATUS_OUT_OF_RANGE);
            }
        }
        // q, out, lse
        let qd = inp.pick(&[
            KVR_DTYPE_F32,
            KVR_DTYPE_F32,
            KVR_DTYPE_F16,
            KVR_DTYPE_BF16,
            KVR_DTYPE_I32,
        ]);
        want.add_if(qd == KVR_DTYPE_I32, KVR_STATUS_DTYPE_MISMATCH);
        let mut q = Tensor::new(qd, &qshape, inp.pick(&INPUT_STYLES));
        if is_float(qd) {
            self.values(&mut q);
        }
        let od = inp.pick(&[
            KVR_DTYPE_F32,
            KVR_DTYPE_F32,
            KVR_DTYPE_F16,
            KVR_DTYPE_BF16,
            KVR_DTYPE_I32,
        ]);
        want.add_if(od == KVR_DTYPE_I32, KVR_STATUS_DTYPE_MISMATCH);
        let mut oshape = qshape.clone();
        if inp.chance(1, 16) {
            oshape[0] += 1;
            want.add(KVR_STATUS_INVALID_ARG);
        }
        let ostyle = if inp.chance(1, 10) {
            Style::Broadcast
        } else {
            inp.pick(&OUTPUT_STYLES)
        };
        want.add_if(
            ostyle == Style::Broadcast && broadcast_overlaps(&oshape),
            KVR_STATUS_INVALID_ARG,
        );
        let mut out = Tensor::new(od, &oshape, ostyle);
        let mut null_q = false;
        let mut null_o = false;
        match inp.below(20) {
            0 => want.add(inp.pick(&BREAKS).apply(&mut q)),
            1 => want.add(inp.pick(&BREAKS).apply(&mut out)),
            2 => {
                null_q = true;
                want.add(KVR_STATUS_NULL_ARG);
            }
            3 => {
                null_o = true;
                want.add(KVR_STATUS_NULL_ARG);
            }
            _ => {}
        }
        let mut lse = None;
        if inp.chance(1, 2) {
            let mut lshape: Vec<usize> = if four { vec![b, t, hq] } else { vec![b, hq] };
            let mut ld = KVR_DTYPE_F32;
            let mut lstyle = inp.pick(&OUTPUT_STYLES);
            match inp.below(12) {
                0 => {
                    ld = KVR_DTYPE_F16;
                    want.add(KVR_STATUS_DTYPE_MISMATCH);
                }
                1 => {
                    lshape.push(1);
                    want.add(KVR_STATUS_INVALID_ARG);
                }
                2 => {
                    lstyle = Style::Broadcast;
                    want.add_if(broadcast_overlaps(&lshape), KVR_STATUS_INVALID_ARG);
                }
                _ => {}
            }
            lse = Some(Tensor::new(ld, &lshape, lstyle));
        }
        // params
        let mut p = std::mem::MaybeUninit::uninit();
        assert_eq!(kvr_kv_decode_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
        // SAFETY: filled above.
        let mut p: kvr_kv_decode_params = unsafe { p.assume_init() };
        let null_params = inp.chance(1, 3);
        let mut size = StructSize::Exact;
        if !null_params {
            p.scale = match inp.below(8) {
                0 => -1.0,
                1 => f32::NAN,
                2 => f32::INFINITY,
                3..=5 => 0.0,
                _ => 0.25 + inp.below(8) as f32 * 0.25,
            };
            want.add_if(
                !(p.scale.is_finite() && p.scale >= 0.0),
                KVR_STATUS_INVALID_ARG,
            );
            p.softcap = match inp.below(8) {
                0 => -2.0,
                1 => f32::NAN,
                2 | 3 => 1.0 + inp.below(4) as f32,
                _ => 0.0,
            };
            want.add_if(
                !(p.softcap.is_finite() && p.softcap >= 0.0),
                KVR_STATUS_INVALID_ARG,
            );
            p.window = match inp.below(8) {
                0 => -1,
                1..=3 => 1 + inp.below(4) as i32,
                _ => 0,
            };
            p.max_ctas = match inp.below(8) {
                0 => -1,
                1 => 3,
                _ => 0,
            };
            want.add_if(p.window < 0 || p.max_ctas < 0, KVR_STATUS_INVALID_ARG);
            size = inp.pick(&STRUCT_SIZES);
            want.add_if(!size.valid(), KVR_STATUS_INVALID_ARG);
        }
        let pv = Versioned::new(p, size);
        out.poison();
        if let Some(l) = lse.as_mut() {
            l.poison();
        }
        let (idd, qdd, odd) = (idt.desc(), q.desc(), out.desc());
        let ld = lse.as_ref().map(|l| l.desc());
        let s = kvr_kv_pool_decode(
            self.pool,
            layer,
            if null_ids { null() } else { &idd },
            if null_q { null() } else { &qdd },
            if null_o { null() } else { &odd },
            ld.as_ref().map_or(null(), |d| d as *const kvr_tensor),
            if null_params { null() } else { pv.ptr() },
            null_mut(),
        );
        if !want.check(s, "kv decode") {
            assert!(out.untouched(), "a failed decode ({s}) wrote out");
            if let Some(l) = &lse {
                assert!(l.untouched(), "a failed decode ({s}) wrote lse");
            }
            return;
        }
        // Reference: dense attention over the model's tokens (f64).
        let scale = if null_params || p.scale == 0.0 {
            1.0 / (cfg.dim as f64).sqrt()
        } else {
            p.scale as f64
        };
        let softcap = if null_params { 0.0 } else { p.softcap as f64 };
        let window = if null_params { 0 } else { p.window as usize };
        let tol = match od {
            KVR_DTYPE_F32 => 1e-4,
            KVR_DTYPE_F16 => 2e-3,
            _ => 1.6e-2,
        };

        let l = layer as usize;
        for (bi, &id) in seen.iter().enumerate() {
            if id < 0 {
                for ti in 0..t {
                    for h in 0..hq {
                        for dd in 0..d {
                            assert_eq!(
                                out.get_bt(four, bi, ti, &[h, dd]),
                                0.0,
                                "unused row not zero"
                            );
                        }
                        if let Some(lt) = &lse {
                            assert_eq!(lt.get_bt(four, bi, ti, &[h]), f32::NEG_INFINITY);
                        }
                    }
                }
                continue;
            }
            let sm = &self.model.seqs[&id];
            for ti in 0..t {
                let qpos = sm.len - t + ti;
                let lo = if window > 0 {
                    (qpos + 1).saturating_sub(window)
                } else {
                    0
                };
                let keys = &self.data[&id][l][lo..=qpos];
                if keys.iter().any(|x| x.is_none()) {
                    continue; // positions reserved but never written
                }
                for h in 0..hq {
                    let kvh = h / group;
                    let qv: Vec<f64> = (0..d)
                        .map(|dd| q.get_bt(four, bi, ti, &[h, dd]) as f64)
                        .collect();
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|tok| {
                            let k = &tok.as_ref().unwrap().0;
                            let s: f64 = (0..d)
                                .map(|dd| qv[dd] * k[kvh * d + dd] as f64)
                                .sum::<f64>()
                                * scale;
                            if softcap > 0.0 {
                                softcap * (s / softcap).tanh()
                            } else {
                                s
                            }
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for dd in 0..d {
                        let want_o: f64 = keys
                            .iter()
                            .zip(&w)
                            .map(|(tok, wi)| wi * tok.as_ref().unwrap().1[kvh * d + dd] as f64)
                            .sum::<f64>()
                            / sum;
                        let got = out.get_bt(four, bi, ti, &[h, dd]) as f64;
                        assert!(
                            close(got, want_o, tol),
                            "decode out[{bi},{ti},{h},{dd}] = {got}, reference {want_o}"
                        );
                    }
                    if let Some(lt) = &lse {
                        let got = lt.get_bt(four, bi, ti, &[h]) as f64;
                        let want_l = m + sum.ln();
                        assert!(close(got, want_l, 1e-4), "lse {got}, reference {want_l}");
                    }
                }
            }
        }
    }

    fn check_stats(&self, st: &kvr_kv_pool_stats) {
        let m = &self.model;
        let ps = self.cfg.ps;
        let used = m.distinct_pages();
        let mut filled: HashMap<u64, usize> = HashMap::new();
        let mut shared = 0;
        for s in m.seqs.values() {
            for (i, &p) in s.pages.iter().enumerate() {
                let n = (s.len - i * ps).min(ps);
                let e = filled.entry(p).or_insert(0);
                *e = (*e).max(n);
            }
        }
        for &p in filled.keys() {
            if m.refs(p) > 1 {
                shared += 1;
            }
        }
        let held: usize = filled.values().sum();
        let want = (
            self.cfg.cap as i64,
            used as i64,
            (self.cfg.cap - used) as i64,
            shared as i64,
            m.seqs.len() as i64,
            m.seqs.values().map(|s| s.len).sum::<usize>() as i64,
            (used * ps - held) as i64,
            self.cfg.page_bytes() as i64,
        );
        let got = (
            st.pages_total,
            st.pages_used,
            st.pages_free,
            st.pages_shared,
            st.sequences,
            st.tokens,
            st.waste_slots,
            st.page_bytes,
        );
        assert_eq!(
            got, want,
            "stats (total, used, free, shared, sequences, tokens, waste, page_bytes)"
        );
    }
}

/// Decodes `data` into a pool and a sequence of calls and checks each against the model.
/// Panics (with the reason) on any disagreement.
pub fn run(data: &[u8]) {
    drive::<KvHarness>(data, MAX_OPS)
}
