//! Issue 12, "found from outside": the two defects (a copy-on-write counted twice in one
//! `kvr_kv_pool_extend` batch; a commit's shape error reported as a dtype error) and the
//! places where the header and the behaviour disagreed, each pinned through the C API.

mod common;

use std::ffi::{c_void, CString};
use std::ptr::{null, null_mut};

use common::*;
use kvreplay::ffi::*;

fn cpu_ctx() -> *mut kvr_context {
    context(KVR_BACKEND_CPU, null_mut()).unwrap()
}

// ---------------------------------------------------------------------------------------
// KV pool helpers

fn kv_params(page: i32, pages: i64) -> kvr_kv_pool_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_pool_params_default(p.as_mut_ptr()));
    let mut p: kvr_kv_pool_params = unsafe { p.assume_init() };
    p.n_layers = 1;
    p.n_kv_heads = 1;
    p.head_dim = 8;
    p.page_size = page;
    p.capacity_pages = pages;
    p.dtype = KVR_DTYPE_F32;
    p.max_seqs = 8;
    p
}

fn kv_pool(ctx: *mut kvr_context, page: i32, pages: i64) -> *mut kvr_kv_pool {
    let mut pool = null_mut();
    ok(kvr_kv_pool_new(ctx, &kv_params(page, pages), &mut pool));
    pool
}

fn kv_stats(pool: *const kvr_kv_pool) -> kvr_kv_pool_stats {
    let mut s: kvr_kv_pool_stats = unsafe { std::mem::zeroed() };
    s.struct_size = size_of::<kvr_kv_pool_stats>() as u32;
    ok(kvr_kv_pool_get_stats(pool, &mut s));
    s
}

fn kv_len(pool: *const kvr_kv_pool, seq: i32) -> i64 {
    let mut n = -1;
    ok(kvr_kv_pool_get_seq_len(pool, seq, &mut n));
    n
}

fn kv_add(pool: *mut kvr_kv_pool) -> i32 {
    let mut s = -1;
    ok(kvr_kv_pool_seq_add(pool, null_mut(), &mut s));
    s
}

fn kv_fork(pool: *mut kvr_kv_pool, src: i32) -> i32 {
    let mut s = -1;
    ok(kvr_kv_pool_seq_fork(pool, src, null_mut(), &mut s));
    s
}

fn kv_extend(pool: *mut kvr_kv_pool, seqs: &[i32], counts: &[i32]) -> kvr_status {
    kvr_kv_pool_extend(
        pool,
        seqs.as_ptr(),
        counts.as_ptr(),
        seqs.len() as i32,
        null_mut(),
    )
}

// ---------------------------------------------------------------------------------------
// Defect 1: one batch must need exactly the pages the same extends one at a time need.

#[test]
fn extend_batch_counts_a_shared_page_copy_once() {
    let ctx = cpu_ctx();
    // The reproduction: page size 4, 3 pages; a holds 2 tokens, b = fork(a), c fills one
    // page: 1 page free.
    let setup = || {
        let pool = kv_pool(ctx, 4, 3);
        let a = kv_add(pool);
        ok(kv_extend(pool, &[a], &[2]));
        let b = kv_fork(pool, a);
        let c = kv_add(pool);
        ok(kv_extend(pool, &[c], &[4]));
        assert_eq!(kv_stats(pool).pages_free, 1);
        (pool, a, b)
    };
    let (seq_pool, a, b) = setup();
    ok(kv_extend(seq_pool, &[a], &[1])); // a copies the shared page
    ok(kv_extend(seq_pool, &[b], &[1])); // b now owns the original alone
    let (batch_pool, a2, b2) = setup();
    assert_eq!((a, b), (a2, b2));
    ok(kv_extend(batch_pool, &[a, b], &[1, 1]));
    let (s1, s2) = (kv_stats(seq_pool), kv_stats(batch_pool));
    assert_eq!(format!("{s1:?}"), format!("{s2:?}"));
    assert_eq!((kv_len(batch_pool, a), kv_len(batch_pool, b)), (3, 3));
    assert_eq!(s2.pages_free, 0);
    assert_eq!(s2.pages_shared, 0);
    // The batch still fails, all or nothing, when even the sequential calls cannot fit.
    let (pool, a, b) = setup();
    ok(kv_extend(pool, &[a], &[0])); // nothing
    let before = kv_stats(pool);
    assert_eq!(kv_extend(pool, &[a, b], &[1, 3]), KVR_STATUS_POOL_EXHAUSTED);
    assert_eq!(format!("{before:?}"), format!("{:?}", kv_stats(pool)));
    assert_eq!((kv_len(pool, a), kv_len(pool, b)), (2, 2));
    for p in [seq_pool, batch_pool, pool] {
        kvr_kv_pool_free(p);
    }
    kvr_context_free(ctx);
}

/// Random pools (forks of forks sharing partial pages): a batch extend succeeds exactly
/// when the same extends one at a time do, and leaves the same pool.
#[test]
fn extend_batch_equals_sequential_extends() {
    let ctx = cpu_ctx();
    let mut rng = Rng::new(12);
    let mut agreed = (0, 0);
    for case in 0..300 {
        let page = 1 + rng.below(4) as i32;
        let pages = 4 + rng.below(8) as i64;
        // The same random history in two pools.
        let ops: Vec<(usize, usize, i32)> = (0..8)
            .map(|_| {
                (
                    rng.below(3),
                    rng.below(8),
                    rng.below(2 * page as usize) as i32,
                )
            })
            .collect();
        let build = || {
            let pool = kv_pool(ctx, page, pages);
            let mut live = vec![kv_add(pool)];
            for &(kind, pick, n) in &ops {
                let s = live[pick % live.len()];
                match kind {
                    0 if live.len() < 8 => live.push(kv_fork(pool, s)),
                    1 => {
                        let _ = kv_extend(pool, &[s], &[n]);
                    }
                    _ => {
                        let len = kv_len(pool, s);
                        ok(kvr_kv_pool_seq_truncate(pool, s, len / 2, null_mut()));
                    }
                }
            }
            (pool, live)
        };
        let (p1, live) = build();
        let (p2, live2) = build();
        assert_eq!(live, live2);
        let mut seqs = live.clone();
        seqs.truncate(1 + rng.below(live.len()));
        let counts: Vec<i32> = seqs
            .iter()
            .map(|_| rng.below(page as usize + 2) as i32)
            .collect();
        let before = kv_stats(p1);
        let batch = kv_extend(p1, &seqs, &counts);
        let mut sequential = KVR_STATUS_OK;
        for (s, c) in seqs.iter().zip(&counts) {
            sequential = kv_extend(p2, &[*s], &[*c]);
            if sequential != KVR_STATUS_OK {
                break;
            }
        }
        assert_eq!(
            batch,
            sequential,
            "case {case}: page {page}, {pages} pages, extend {seqs:?} by {counts:?}: {}",
            last_error()
        );
        if batch == KVR_STATUS_OK {
            agreed.0 += 1;
            assert_eq!(
                format!("{:?}", kv_stats(p1)),
                format!("{:?}", kv_stats(p2)),
                "case {case}"
            );
            for &s in &live {
                assert_eq!(kv_len(p1, s), kv_len(p2, s));
            }
        } else {
            agreed.1 += 1;
            assert_eq!(format!("{before:?}"), format!("{:?}", kv_stats(p1)));
        }
        kvr_kv_pool_free(p1);
        kvr_kv_pool_free(p2);
    }
    assert!(agreed.0 > 50 && agreed.1 > 10, "{agreed:?}");
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// GDN helpers

const HK: i64 = 1;
const HV: i64 = 2;
const D: i64 = 16;
const CONV: i64 = 4;

fn gdn_params() -> kvr_gdn_pool_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_gdn_pool_params_default(p.as_mut_ptr()));
    let mut p: kvr_gdn_pool_params = unsafe { p.assume_init() };
    p.n_layers = 2;
    p.n_k_heads = HK as i32;
    p.n_v_heads = HV as i32;
    p.dk = D as i32;
    p.dv = D as i32;
    p.ring_len = 8;
    p.max_drafts = 4;
    p.max_seqs = 4;
    p.conv_dim = CONV as i32;
    p.conv_kernel = 3;
    p
}

/// The KV-only threshold the tests of KV-only mode set (the default is off): min(dk, what a
/// head's state memory holds) for `gdn_params()`, min(16, 1024 / 132) = 7.
fn kv_only() -> kvr_gdn_threshold {
    let t = kv_only_threshold(D as i32, D as i32, KVR_DTYPE_F32, KVR_DTYPE_F32);
    assert_eq!(t, 7);
    t
}

/// The mode a new sequence of a `gdn_params()` pool with threshold `thr` starts in.
fn mode_of(thr: kvr_gdn_threshold) -> kvr_gdn_mode {
    if thr > 0 {
        KVR_GDN_MODE_KV_ONLY
    } else {
        KVR_GDN_MODE_REPLAY
    }
}

fn gdn_pool(ctx: *mut kvr_context, p: &kvr_gdn_pool_params) -> *mut kvr_gdn_pool {
    let mut pool = null_mut();
    ok(kvr_gdn_pool_new(ctx, p, &mut pool));
    pool
}

fn host_f32(data: &mut [f32], shape: &[i64]) -> kvr_tensor {
    tensor(
        data.as_mut_ptr() as *mut c_void,
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        shape,
        &contiguous_strides(shape),
    )
}

fn host_i32(data: &mut [i32], shape: &[i64]) -> kvr_tensor {
    tensor(
        data.as_mut_ptr() as *mut c_void,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        shape,
        &contiguous_strides(shape),
    )
}

fn cursor(pool: *const kvr_gdn_pool, layer: i32, seq: i32) -> kvr_gdn_cursor {
    let mut c = kvr_gdn_cursor {
        mode: -1,
        ring_start: -1,
        buffered: -1,
        pending: -1,
    };
    ok(kvr_gdn_pool_get_cursor(pool, layer, seq, &mut c));
    c
}

/// Inputs of one decode (t = 0: `[B, H, D]`) or verify (`[B, T, H, D]`) call.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    conv: Vec<f32>,
    out: Vec<f32>,
    b: i64,
    t: i64,
}

impl Inputs {
    fn new(rng: &mut Rng, b: i64, t: i64) -> Inputs {
        let n = (b * t.max(1)) as usize;
        Inputs {
            q: rng.vec(n * (HK * D) as usize, -1.0, 1.0),
            k: rng.vec(n * (HK * D) as usize, -1.0, 1.0),
            v: rng.vec(n * (HV * D) as usize, -1.0, 1.0),
            g: rng.vec(n * HV as usize, -0.3, -0.01),
            beta: rng.vec(n * HV as usize, 0.1, 0.9),
            conv: rng.vec(n * CONV as usize, -1.0, 1.0),
            out: vec![f32::NAN; n * (HV * D) as usize],
            b,
            t,
        }
    }
    fn shape(&self, rest: &[i64]) -> Vec<i64> {
        let mut s = vec![self.b];
        if self.t > 0 {
            s.push(self.t);
        }
        s.extend_from_slice(rest);
        s
    }
    fn run(
        &mut self,
        pool: *mut kvr_gdn_pool,
        layer: i32,
        ids: &kvr_tensor,
        params: *const kvr_gdn_step_params,
    ) -> kvr_status {
        let (sq, sv, sg, sc) = (
            self.shape(&[HK, D]),
            self.shape(&[HV, D]),
            self.shape(&[HV]),
            self.shape(&[CONV]),
        );
        let q = host_f32(&mut self.q, &sq);
        let k = host_f32(&mut self.k, &sq);
        let v = host_f32(&mut self.v, &sv);
        let g = host_f32(&mut self.g, &sg);
        let beta = host_f32(&mut self.beta, &sg);
        let conv = host_f32(&mut self.conv, &sc);
        let out = host_f32(&mut self.out, &sv);
        gdn_pool_call(
            pool,
            layer,
            ids,
            self.t > 0,
            [&q, &k, &v, &g, &beta, &conv, &out],
            params,
        )
    }
}

fn export(pool: *const kvr_gdn_pool, layer: i32, seq: i32) -> Vec<f32> {
    let mut st = vec![0f32; (HV * D * D) as usize];
    let t = host_f32(&mut st, &[HV, D, D]);
    ok(kvr_gdn_pool_export_state(
        pool,
        layer,
        seq,
        &t,
        null(),
        null_mut(),
    ));
    st
}

// ---------------------------------------------------------------------------------------
// Defect 2 and the shape/dtype split: shape errors are INVALID_ARG, element types
// DTYPE_MISMATCH, in commit and every call that takes seq_ids.

#[test]
fn commit_shape_errors_are_invalid_arg_and_dtype_errors_dtype_mismatch() {
    let ctx = cpu_ctx();
    let pool = gdn_pool(ctx, &gdn_params());
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    let mut rng = Rng::new(3);
    let mut idv = [seq];
    let id = host_i32(&mut idv, &[1]);
    ok(Inputs::new(&mut rng, 1, 2).run(pool, 0, &id, null()));
    let pending = format!("{:?}", cursor(pool, 0, seq));
    let mut two = [1i32, 1];
    let mut one = [1i32];
    let mut f = [1f32];
    let mut cs = vec![0f32; (2 * CONV) as usize];
    let cases: Vec<(kvr_tensor, kvr_tensor, Option<kvr_tensor>, kvr_status, &str)> = vec![
        // accepted i32 [2] for one id: a shape error.
        (
            id,
            host_i32(&mut two, &[2]),
            None,
            KVR_STATUS_INVALID_ARG,
            "shape",
        ),
        // accepted i32 [1, 1].
        (
            id,
            host_i32(&mut two[..1], &[1, 1]),
            None,
            KVR_STATUS_INVALID_ARG,
            "shape",
        ),
        // accepted f32 [1]: the element type.
        (
            id,
            host_f32(&mut f, &[1]),
            None,
            KVR_STATUS_DTYPE_MISMATCH,
            "i32",
        ),
        // seq_ids i32 [1, 1]: a shape error; f32 seq_ids: a dtype error.
        (
            host_i32(&mut idv.clone(), &[1, 1]),
            host_i32(&mut one, &[1]),
            None,
            KVR_STATUS_INVALID_ARG,
            "1-D",
        ),
        (
            host_f32(&mut [seq as f32], &[1]),
            host_i32(&mut one, &[1]),
            None,
            KVR_STATUS_DTYPE_MISMATCH,
            "i32",
        ),
        // conv_state of the wrong shape, and of an integer type.
        (
            id,
            host_i32(&mut one, &[1]),
            Some(host_f32(&mut cs, &[1, 1, 2 * CONV])),
            KVR_STATUS_INVALID_ARG,
            "shape",
        ),
        (
            id,
            host_i32(&mut one, &[1]),
            Some(tensor(
                cs.as_mut_ptr() as *mut c_void,
                KVR_DTYPE_I32,
                KVR_DEVICE_HOST,
                &[1, 2, CONV],
                &[2 * CONV, CONV, 1],
            )),
            KVR_STATUS_DTYPE_MISMATCH,
            "conv_state",
        ),
        // conv_state with overlapping elements.
        (
            id,
            host_i32(&mut one, &[1]),
            Some(tensor(
                cs.as_mut_ptr() as *mut c_void,
                KVR_DTYPE_F32,
                KVR_DEVICE_HOST,
                &[1, 2, CONV],
                &[2 * CONV, 0, 1],
            )),
            KVR_STATUS_INVALID_ARG,
            "overlapping",
        ),
    ];
    for (ids, acc, conv_state, want, word) in cases {
        let cs_ptr = conv_state.as_ref().map_or(null(), |c| c as *const _);
        let s = kvr_gdn_pool_commit(pool, 0, &ids, &acc, cs_ptr, null_mut());
        assert_eq!(s, want, "{word}: {}", last_error());
        assert!(last_error().contains(word), "{word}: {}", last_error());
        // The drafts stay pending.
        assert_eq!(format!("{:?}", cursor(pool, 0, seq)), pending);
    }
    // Flush and decode/verify take seq_ids the same way.
    let mut flat = [seq];
    let id2 = host_i32(&mut flat, &[1, 1]);
    assert_eq!(
        kvr_gdn_pool_flush(pool, 1, &id2, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        Inputs::new(&mut rng, 1, 0).run(pool, 1, &id2, null()),
        KVR_STATUS_INVALID_ARG
    );
    ok(kvr_gdn_pool_commit(
        pool,
        0,
        &id,
        &host_i32(&mut one, &[1]),
        null(),
        null_mut(),
    ));
    assert_eq!(cursor(pool, 0, seq).pending, 0);
    kvr_gdn_pool_free(pool);
    kvr_context_free(ctx);
}

#[test]
fn kv_decode_seq_ids_shape_is_invalid_arg() {
    let ctx = cpu_ctx();
    let pool = kv_pool(ctx, 4, 4);
    let s = kv_add(pool);
    ok(kv_extend(pool, &[s], &[3]));
    let mut ids = [s];
    let mut q = vec![0.5f32; 8];
    let mut out = vec![0f32; 8];
    let qt = host_f32(&mut q, &[1, 1, 8]);
    let ot = host_f32(&mut out, &[1, 1, 8]);
    assert_eq!(
        kvr_kv_pool_decode(
            pool,
            0,
            &host_i32(&mut ids, &[1, 1]),
            &qt,
            &ot,
            null(),
            null(),
            null_mut()
        ),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        kvr_kv_pool_decode(
            pool,
            0,
            &host_f32(&mut [0.0], &[1]),
            &qt,
            &ot,
            null(),
            null(),
            null_mut()
        ),
        KVR_STATUS_DTYPE_MISMATCH
    );
    ok(kvr_kv_pool_decode(
        pool,
        0,
        &host_i32(&mut ids, &[1]),
        &qt,
        &ot,
        null(),
        null(),
        null_mut(),
    ));
    kvr_kv_pool_free(pool);
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// struct_size larger than the library's: a zero tail is accepted, a non-zero one refused.

#[repr(C)]
#[derive(Clone, Copy)]
struct Newer<T: Copy> {
    p: T,
    extra: [u64; 4],
}

fn newer<T: Copy>(p: T, tail_byte: Option<usize>) -> Newer<T> {
    // Zeroed first: the padding between `p` and `extra` is part of the tail the library
    // checks (a C caller clears the struct with memset or `= {0}` the same way).
    let mut n: Newer<T> = unsafe { std::mem::zeroed() };
    unsafe { std::ptr::write(&mut n.p, p) };
    // SAFETY: every struct here starts with `uint32_t struct_size`.
    unsafe { (&mut n as *mut Newer<T> as *mut u32).write(size_of::<Newer<T>>() as u32) };
    if let Some(i) = tail_byte {
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                (&mut n.extra as *mut [u64; 4]) as *mut u8,
                size_of::<[u64; 4]>(),
            )
        };
        bytes[i] = 1;
    }
    n
}

/// Checks one input struct: `call` runs the function on a pointer to the struct.
fn check_newer<T: Copy>(what: &str, p: T, mut call: impl FnMut(*const T) -> kvr_status) {
    let zero = newer(p, None);
    assert_eq!(
        call(&zero as *const Newer<T> as *const T),
        KVR_STATUS_OK,
        "{what}, zero tail: {}",
        last_error()
    );
    for byte in [0, 13, 31] {
        let bad = newer(p, Some(byte));
        assert_eq!(
            call(&bad as *const Newer<T> as *const T),
            KVR_STATUS_INVALID_ARG,
            "{what}, byte {byte} of the tail set"
        );
        assert!(
            last_error().contains("struct_size") && last_error().contains("cannot honour"),
            "{what}: {}",
            last_error()
        );
    }
    let mut huge = newer(p, None);
    unsafe { (&mut huge as *mut Newer<T> as *mut u32).write(1 << 20) };
    assert_eq!(
        call(&huge as *const Newer<T> as *const T),
        KVR_STATUS_INVALID_ARG,
        "{what}, struct_size 1 MiB"
    );
}

#[test]
fn a_larger_struct_size_with_unknown_fields_set_is_refused() {
    let ctx = cpu_ctx();
    // kvr_context_params
    let mut cp = std::mem::MaybeUninit::uninit();
    ok(kvr_context_params_default(cp.as_mut_ptr()));
    let mut cp: kvr_context_params = unsafe { cp.assume_init() };
    cp.backend = KVR_BACKEND_CPU;
    let sentinel = 0x55usize as *mut kvr_context;
    check_newer("kvr_context_params", cp, |p| {
        let mut out = sentinel;
        let s = kvr_context_new(p, &mut out);
        if s == KVR_STATUS_OK {
            kvr_context_free(out);
        } else {
            assert_eq!(out, sentinel);
        }
        s
    });
    // kvr_kv_pool_params
    check_newer("kvr_kv_pool_params", kv_params(4, 4), |p| {
        let mut out = null_mut();
        let s = kvr_kv_pool_new(ctx, p, &mut out);
        kvr_kv_pool_free(out);
        s
    });
    // kvr_gdn_pool_params (pool creation and the sizing query)
    check_newer("kvr_gdn_pool_params", gdn_params(), |p| {
        let mut out = null_mut();
        let s = kvr_gdn_pool_new(ctx, p, &mut out);
        kvr_gdn_pool_free(out);
        s
    });
    check_newer("kvr_gdn_pool_params (memory)", gdn_params(), |p| {
        let mut m: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
        m.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
        kvr_gdn_pool_params_memory(p, &mut m)
    });
    // kvr_kv_decode_params
    let kv = kv_pool(ctx, 4, 4);
    let s = kv_add(kv);
    ok(kv_extend(kv, &[s], &[2]));
    let mut dp = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_decode_params_default(dp.as_mut_ptr()));
    let dp: kvr_kv_decode_params = unsafe { dp.assume_init() };
    let mut ids = [s];
    let mut q = vec![0.25f32; 8];
    let mut out = vec![0f32; 8];
    let (it, qt, ot) = (
        host_i32(&mut ids, &[1]),
        host_f32(&mut q, &[1, 1, 8]),
        host_f32(&mut out, &[1, 1, 8]),
    );
    check_newer("kvr_kv_decode_params", dp, |p| {
        kvr_kv_pool_decode(kv, 0, &it, &qt, &ot, null(), p, null_mut())
    });
    kvr_kv_pool_free(kv);
    // kvr_gdn_step_params
    let gp = gdn_pool(ctx, &gdn_params());
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(gp, null_mut(), &mut seq));
    let mut sp = std::mem::MaybeUninit::uninit();
    ok(kvr_gdn_step_params_default(sp.as_mut_ptr()));
    let sp: kvr_gdn_step_params = unsafe { sp.assume_init() };
    let mut gids = [seq];
    let gid = host_i32(&mut gids, &[1]);
    let mut rng = Rng::new(5);
    check_newer("kvr_gdn_step_params", sp, |p| {
        Inputs::new(&mut rng, 1, 0).run(gp, 0, &gid, p)
    });
    kvr_gdn_pool_free(gp);
    // kvr_model_sizing_params
    let path = CString::new(format!(
        "{}/tests/data/tiny-qwen3next.gguf",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let mut m = null_mut();
    ok(kvr_model_open(path.as_ptr(), &mut m));
    let mut mp = std::mem::MaybeUninit::uninit();
    ok(kvr_model_sizing_params_default(mp.as_mut_ptr()));
    let mut mp: kvr_model_sizing_params = unsafe { mp.assume_init() };
    mp.budget_bytes = 64 << 20;
    check_newer("kvr_model_sizing_params", mp, |p| {
        let mut out: kvr_model_sizing = unsafe { std::mem::zeroed() };
        out.struct_size = size_of::<kvr_model_sizing>() as u32;
        kvr_model_compute_sizing(m, p, &mut out)
    });
    kvr_model_free(m);
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// export_state refuses outputs with overlapping elements (as decode and tensor_copy do).

#[test]
fn export_refuses_overlapping_outputs() {
    // A sequence in replay mode (the default) and one still KV-only after 3 tokens, whose
    // export computes the state from its entries.
    for thr in [KVR_GDN_THRESHOLD_DEFAULT, kv_only()] {
        export_refuses_overlapping_outputs_with(thr);
    }
}

fn export_refuses_overlapping_outputs_with(thr: kvr_gdn_threshold) {
    let ctx = cpu_ctx();
    let mut p = gdn_params();
    p.kv_only_threshold = thr;
    let pool = gdn_pool(ctx, &p);
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    let mut rng = Rng::new(7);
    let mut idv = [seq];
    let id = host_i32(&mut idv, &[1]);
    for _ in 0..3 {
        ok(Inputs::new(&mut rng, 1, 0).run(pool, 0, &id, null()));
    }
    assert_eq!(cursor(pool, 0, seq).mode, mode_of(thr));
    let mut st = vec![-7f32; (HV * D * D) as usize];
    let mut conv = vec![-7f32; (2 * CONV) as usize];
    let shape = [HV, D, D];
    for strides in [[D * D, 0, 1], [0, D, 1], [D * D, D, 0], [1, 1, 1]] {
        let t = tensor(
            st.as_mut_ptr() as *mut c_void,
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            &shape,
            &strides,
        );
        assert_eq!(
            kvr_gdn_pool_export_state(pool, 0, seq, &t, null(), null_mut()),
            KVR_STATUS_INVALID_ARG,
            "strides {strides:?}"
        );
        assert!(last_error().contains("overlapping"), "{}", last_error());
    }
    let good = host_f32(&mut st.clone(), &shape);
    let cv = tensor(
        conv.as_mut_ptr() as *mut c_void,
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[2, CONV],
        &[0, 1],
    );
    assert_eq!(
        kvr_gdn_pool_export_state(pool, 0, seq, &good, &cv, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert!(last_error().contains("conv_out"), "{}", last_error());
    assert!(st.iter().chain(&conv).all(|&x| x == -7.0));
    // Overlapping *inputs* are fine: import reads a broadcast state.
    let mut one = vec![0.5f32; (D * D) as usize];
    let bcast = tensor(
        one.as_mut_ptr() as *mut c_void,
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &shape,
        &[0, D, 1],
    );
    ok(kvr_gdn_pool_import_state(
        pool,
        1,
        seq,
        &bcast,
        null(),
        null_mut(),
    ));
    assert!(export(pool, 1, seq).iter().all(|&x| x == 0.5));
    kvr_gdn_pool_free(pool);
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// A layer outside the pool is OUT_OF_RANGE in every call (-1 included where KVR_LAYER_ALL
// is not accepted).

#[test]
fn layers_outside_the_pool_are_out_of_range_everywhere() {
    let ctx = cpu_ctx();
    let pool = gdn_pool(ctx, &gdn_params());
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    let mut rng = Rng::new(9);
    let mut idv = [seq];
    let id = host_i32(&mut idv, &[1]);
    let mut st = vec![0f32; (HV * D * D) as usize];
    let stt = host_f32(&mut st, &[HV, D, D]);
    for layer in [-1, -2, i32::MIN, 2, 100] {
        let mut c = kvr_gdn_cursor {
            mode: 0,
            ring_start: 0,
            buffered: 0,
            pending: 0,
        };
        let calls: [(&str, kvr_status); 5] = [
            (
                "get_cursor",
                kvr_gdn_pool_get_cursor(pool, layer, seq, &mut c),
            ),
            (
                "import",
                kvr_gdn_pool_import_state(pool, layer, seq, &stt, null(), null_mut()),
            ),
            (
                "export",
                kvr_gdn_pool_export_state(pool, layer, seq, &stt, null(), null_mut()),
            ),
            (
                "decode",
                Inputs::new(&mut rng, 1, 0).run(pool, layer, &id, null()),
            ),
            (
                "verify",
                Inputs::new(&mut rng, 1, 2).run(pool, layer, &id, null()),
            ),
        ];
        for (name, s) in calls {
            assert_eq!(
                s,
                KVR_STATUS_OUT_OF_RANGE,
                "{name} layer {layer}: {}",
                last_error()
            );
        }
        if layer != KVR_LAYER_ALL {
            let mut a = [0i32];
            assert_eq!(
                kvr_gdn_pool_commit(
                    pool,
                    layer,
                    &id,
                    &host_i32(&mut a, &[1]),
                    null(),
                    null_mut()
                ),
                KVR_STATUS_OUT_OF_RANGE,
                "commit layer {layer}"
            );
            assert_eq!(
                kvr_gdn_pool_flush(pool, layer, &id, null_mut()),
                KVR_STATUS_OUT_OF_RANGE,
                "flush layer {layer}"
            );
        }
    }
    // KVR_LAYER_ALL where it is accepted.
    ok(kvr_gdn_pool_flush(pool, KVR_LAYER_ALL, &id, null_mut()));
    kvr_gdn_pool_free(pool);

    let kv = kv_pool(ctx, 4, 4);
    let s = kv_add(kv);
    ok(kv_extend(kv, &[s], &[1]));
    let mut ids = [s];
    let mut q = vec![0.1f32; 8];
    let mut out = vec![0f32; 8];
    let mut kvd = vec![0.3f32; 8];
    let (it, qt, ot) = (
        host_i32(&mut ids, &[1]),
        host_f32(&mut q, &[1, 1, 8]),
        host_f32(&mut out, &[1, 1, 8]),
    );
    let kt = host_f32(&mut kvd, &[1, 1, 8]);
    for layer in [-1, -2, 1] {
        assert_eq!(
            kvr_kv_pool_decode(kv, layer, &it, &qt, &ot, null(), null(), null_mut()),
            KVR_STATUS_OUT_OF_RANGE
        );
        if layer != KVR_LAYER_ALL {
            assert_eq!(
                kvr_kv_pool_write(kv, layer, &s, &1, 1, &kt, &kt, null_mut()),
                KVR_STATUS_OUT_OF_RANGE
            );
        }
    }
    ok(kvr_kv_pool_write(kv, 0, &s, &1, 1, &kt, &kt, null_mut()));
    kvr_kv_pool_free(kv);
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// KV-only mode: a verify ends it when length + 2T exceeds the threshold, whatever is
// accepted; a decode only past the threshold.

#[test]
fn kv_only_ends_at_a_verify_window_past_the_threshold() {
    let ctx = cpu_ctx();
    let mut p = gdn_params();
    p.n_layers = 1;
    p.kv_only_threshold = 6;
    let pool = gdn_pool(ctx, &p);
    let mut rng = Rng::new(11);
    let (mut a, mut b) = (-1, -1);
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut a));
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut b));
    let mut both = [a, b];
    let ids2 = host_i32(&mut both, &[2]);
    // 3 tokens each by decode: KV-only.
    for _ in 0..3 {
        ok(Inputs::new(&mut rng, 2, 0).run(pool, 0, &ids2, null()));
    }
    assert_eq!(cursor(pool, 0, a).mode, KVR_GDN_MODE_KV_ONLY);
    // a: verify T = 2 (3 + 4 > 6) and accept none: the state exists now, at 3 tokens.
    let mut ida = [a];
    let ia = host_i32(&mut ida, &[1]);
    ok(Inputs::new(&mut rng, 1, 2).run(pool, 0, &ia, null()));
    ok(kvr_gdn_pool_commit(
        pool,
        0,
        &ia,
        &host_i32(&mut [0], &[1]),
        null(),
        null_mut(),
    ));
    let c = cursor(pool, 0, a);
    assert_eq!((c.mode, c.buffered), (KVR_GDN_MODE_REPLAY, 0));
    // b: decodes up to the threshold stay KV-only; the next one leaves.
    let mut idb = [b];
    let ib = host_i32(&mut idb, &[1]);
    for _ in 0..3 {
        ok(Inputs::new(&mut rng, 1, 0).run(pool, 0, &ib, null()));
    }
    let c = cursor(pool, 0, b);
    assert_eq!((c.mode, c.buffered), (KVR_GDN_MODE_KV_ONLY, 6));
    ok(Inputs::new(&mut rng, 1, 0).run(pool, 0, &ib, null()));
    assert_eq!(cursor(pool, 0, b).mode, KVR_GDN_MODE_REPLAY);
    kvr_gdn_pool_free(pool);
    kvr_context_free(ctx);
}

#[test]
fn recurrent_pools_have_no_kv_only_threshold() {
    let ctx = cpu_ctx();
    let mut p = gdn_params();
    p.ring_len = 0;
    // The default means off; an explicit threshold is refused.
    let mut m: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
    m.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
    ok(kvr_gdn_pool_params_memory(&p, &mut m));
    assert_eq!(m.kv_only_threshold, 0);
    let pool = gdn_pool(ctx, &p);
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    assert_eq!(cursor(pool, 0, seq).mode, KVR_GDN_MODE_RECURRENT);
    kvr_gdn_pool_free(pool);
    p.kv_only_threshold = KVR_GDN_THRESHOLD_OFF;
    kvr_gdn_pool_free(gdn_pool(ctx, &p));
    p.kv_only_threshold = 4;
    let mut out = null_mut();
    assert_eq!(kvr_gdn_pool_new(ctx, &p, &mut out), KVR_STATUS_INVALID_ARG);
    assert!(last_error().contains("KV-only"), "{}", last_error());
    assert_eq!(
        kvr_gdn_pool_params_memory(&p, &mut m),
        KVR_STATUS_INVALID_ARG
    );
    assert!(out.is_null());
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// Pending drafts: export, flush, decode and a second verify refuse them (INVALID_ARG) and
// change nothing; NULL step params are the defaults for verify too.

#[test]
fn pending_drafts_are_refused_and_null_params_are_the_defaults() {
    // Drafts pending on a sequence in replay mode (the default) and on one still KV-only
    // (0 + 2 * 3 tokens <= the threshold).
    for thr in [KVR_GDN_THRESHOLD_DEFAULT, kv_only()] {
        pending_drafts_are_refused_with(thr);
    }
}

fn pending_drafts_are_refused_with(thr: kvr_gdn_threshold) {
    let ctx = cpu_ctx();
    let mut p = gdn_params();
    p.kv_only_threshold = thr;
    let (p1, p2) = (gdn_pool(ctx, &p), gdn_pool(ctx, &p));
    let mut rng = Rng::new(13);
    let mut seq = -1;
    for pool in [p1, p2] {
        ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    }
    let mut idv = [seq];
    let id = host_i32(&mut idv, &[1]);
    let mut defaults = std::mem::MaybeUninit::uninit();
    ok(kvr_gdn_step_params_default(defaults.as_mut_ptr()));
    let defaults: kvr_gdn_step_params = unsafe { defaults.assume_init() };
    let mut x = Inputs::new(&mut rng, 1, 3);
    let mut y = Inputs {
        out: vec![f32::NAN; x.out.len()],
        q: x.q.clone(),
        k: x.k.clone(),
        v: x.v.clone(),
        g: x.g.clone(),
        beta: x.beta.clone(),
        conv: x.conv.clone(),
        ..Inputs::new(&mut rng, 1, 3)
    };
    ok(x.run(p1, 0, &id, null()));
    ok(y.run(p2, 0, &id, &defaults));
    assert_eq!(x.out, y.out, "NULL params and the defaults differ");
    assert_eq!(cursor(p1, 0, seq).mode, mode_of(thr));
    let before = format!("{:?}", cursor(p1, 0, seq));
    let mut st = vec![-3f32; (HV * D * D) as usize];
    let stt = host_f32(&mut st, &[HV, D, D]);
    assert_eq!(
        kvr_gdn_pool_export_state(p1, 0, seq, &stt, null(), null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert!(last_error().contains("uncommitted"), "{}", last_error());
    assert!(st.iter().all(|&v| v == -3.0));
    assert_eq!(
        kvr_gdn_pool_flush(p1, 0, &id, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        kvr_gdn_pool_flush(p1, KVR_LAYER_ALL, &id, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        Inputs::new(&mut rng, 1, 2).run(p1, 0, &id, null()),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        Inputs::new(&mut rng, 1, 0).run(p1, 0, &id, null()),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        kvr_gdn_pool_import_state(p1, 0, seq, &stt, null(), null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(format!("{:?}", cursor(p1, 0, seq)), before);
    // The other layer is free of drafts.
    ok(kvr_gdn_pool_export_state(
        p1,
        1,
        seq,
        &stt,
        null(),
        null_mut(),
    ));
    ok(kvr_gdn_pool_commit(
        p1,
        0,
        &id,
        &host_i32(&mut [2], &[1]),
        null(),
        null_mut(),
    ));
    ok(kvr_gdn_pool_flush(p1, KVR_LAYER_ALL, &id, null_mut()));
    kvr_gdn_pool_free(p1);
    kvr_gdn_pool_free(p2);
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// Value head h reads key head h / (Hv / Hk): with Hk = 2, Hv = 4, value heads 0, 1 read
// key head 0 and value heads 2, 3 key head 1 (checked against the f64 reference, which
// does that; the same reference fed the two key heads swapped disagrees, so the check
// tells the key heads apart).

#[test]
fn value_heads_share_key_heads_in_consecutive_groups() {
    use common::gdn::{random_tokens, rel_err, run, Reference};
    use kvreplay::linear::{GdnPool, StateLayout};
    use kvreplay::Stream;
    let ctx = common::gdn::cpu_ctx();
    for ring in [0usize, 4] {
        let c = common::gdn::config(2, 4, 32, ring, 0, StateLayout::KMajor);
        let pool = GdnPool::new(ctx.clone(), c, None).unwrap();
        let id = pool.seq_add(Stream::DEFAULT).unwrap();
        let mut reference = Reference::new(&c);
        let mut swapped = Reference::new(&c);
        let mut rng = Rng::new(17);
        let (mut worst, mut worst_swapped) = (0f64, 0f64);
        for _ in 0..12 {
            let x = random_tokens(&mut rng, &c, 1, 1);
            let got = run(&pool, &[id], &x, false).unwrap();
            worst = worst.max(rel_err(&got, &reference.step(&x, 0, 0), 32));
            let mut x2 = x.clone();
            for v in [&mut x2.q, &mut x2.k] {
                let (a, b) = v.split_at_mut(32);
                a.swap_with_slice(&mut b[..32]);
            }
            worst_swapped = worst_swapped.max(rel_err(&got, &swapped.step(&x2, 0, 0), 32));
        }
        assert!(worst < 1e-4, "ring {ring}: {worst:e}");
        assert!(worst_swapped > 1e-2, "ring {ring}: {worst_swapped:e}");
    }
}

// ---------------------------------------------------------------------------------------
// Pool writes round to nearest even (as tensor_copy does): KV writes into caller-owned f16
// and bf16 pages, and a state import into a caller-owned bf16 state.

#[test]
fn pool_writes_round_to_nearest_even() {
    let ctx = cpu_ctx();
    // Values exactly halfway between two f16 / bf16 neighbours, and their neighbours.
    let ties: Vec<f32> = vec![
        1.0 + 1.0 / 2048.0, // f16 tie: rounds down to 1.0 (even)
        1.0 + 3.0 / 2048.0, // f16 tie: rounds up
        1.0 + 1.0 / 256.0,  // bf16 tie: rounds down
        1.0 + 3.0 / 256.0,  // bf16 tie: rounds up
        -(1.0 + 3.0 / 2048.0),
        -(1.0 + 3.0 / 256.0),
        65519.0,            // f16: rounds to 65504
        1.0 + 1.0 / 4096.0, // below the f16 tie
    ];
    for dtype in [KVR_DTYPE_F16, KVR_DTYPE_BF16] {
        let (page, dim) = (4i64, 8i64);
        let mut kbuf = HostBuf::new(dtype, (2 * page * dim) as usize, 0xffff);
        let mut vbuf = HostBuf::new(dtype, (2 * page * dim) as usize, 0xffff);
        let layout = kvr_kv_layer_layout {
            k: kbuf.ptr(),
            v: vbuf.ptr(),
            k_stride_page: page * dim,
            k_stride_head: page * dim,
            k_stride_token: dim,
            v_stride_page: page * dim,
            v_stride_head: page * dim,
            v_stride_token: dim,
        };
        let mut p = kv_params(page as i32, 2);
        p.dtype = dtype;
        p.layers = &layout;
        let mut pool = null_mut();
        ok(kvr_kv_pool_new(ctx, &p, &mut pool));
        let s = kv_add(pool);
        let mut k = ties.clone();
        let mut v: Vec<f32> = ties.iter().map(|x| -x).collect();
        let (kt, vt) = (
            host_f32(&mut k, &[1, 1, 1, 8]),
            host_f32(&mut v, &[1, 1, 1, 8]),
        );
        ok(kvr_kv_pool_append(pool, s, &kt, &vt, null_mut()));
        let mut pages = [-1i32; 1];
        let mut count = 0;
        ok(kvr_kv_pool_get_seq_pages(
            pool,
            s,
            pages.as_mut_ptr(),
            1,
            &mut count,
        ));
        let base = (pages[0] as i64 * page * dim) as usize;
        for (i, &x) in ties.iter().enumerate() {
            assert_eq!(
                kbuf.bits(base + i),
                encode(dtype, x),
                "{dtype} k[{i}] = {x}"
            );
            assert_eq!(vbuf.bits(base + i), encode(dtype, -x), "{dtype} v[{i}]");
        }
        kvr_kv_pool_free(pool);
    }
    // GDN: import an f32 state of ties into a caller-owned bf16 state.
    let mut p = gdn_params();
    p.n_layers = 1;
    p.state_dtype = KVR_DTYPE_BF16;
    p.kv_only_threshold = KVR_GDN_THRESHOLD_OFF;
    let n = (HV * D * D) as usize;
    let mut states = HostBuf::new(KVR_DTYPE_BF16, n * p.max_seqs as usize, 0);
    let storage = kvr_gdn_state_storage {
        state: states.ptr(),
        seq_stride: n as i64,
    };
    p.states = &storage;
    let pool = gdn_pool(ctx, &p);
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    let mut st: Vec<f32> = (0..n).map(|i| ties[i % ties.len()]).collect();
    let stt = host_f32(&mut st, &[HV, D, D]);
    ok(kvr_gdn_pool_import_state(
        pool,
        0,
        seq,
        &stt,
        null(),
        null_mut(),
    ));
    for (i, &x) in st.iter().enumerate() {
        assert_eq!(
            states.bits(seq as usize * n + i),
            encode(KVR_DTYPE_BF16, x),
            "state[{i}] = {x}"
        );
    }
    kvr_gdn_pool_free(pool);
    kvr_context_free(ctx);
}

// ---------------------------------------------------------------------------------------
// contiguous_kv_bytes_per_seq reserves the speculative window on top of the context.

#[test]
fn contiguous_kv_reserves_the_spec_window_on_top_of_the_context() {
    let path = CString::new(format!(
        "{}/tests/data/tiny-qwen3next.gguf",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let mut m = null_mut();
    ok(kvr_model_open(path.as_ptr(), &mut m));
    let mut info: kvr_model_info = unsafe { std::mem::zeroed() };
    info.struct_size = size_of::<kvr_model_info>() as u32;
    ok(kvr_model_get_info(m, &mut info));
    let ctx_len = info.context_length;
    assert!(ctx_len > 0);
    for (seq_len, t) in [(ctx_len / 2, 0), (ctx_len / 2, 4), (ctx_len * 2, 8)] {
        let mut p = std::mem::MaybeUninit::uninit();
        ok(kvr_model_sizing_params_default(p.as_mut_ptr()));
        let mut p: kvr_model_sizing_params = unsafe { p.assume_init() };
        p.budget_bytes = 1 << 30;
        p.seq_len = seq_len;
        p.spec_window = t;
        let mut s: kvr_model_sizing = unsafe { std::mem::zeroed() };
        s.struct_size = size_of::<kvr_model_sizing>() as u32;
        ok(kvr_model_compute_sizing(m, &p, &mut s));
        assert_eq!(
            s.contiguous_kv_bytes_per_seq,
            (ctx_len.max(seq_len) + t as i64) * s.kv_bytes_per_token,
            "seq_len {seq_len}, spec_window {t}"
        );
    }
    kvr_model_free(m);
}
