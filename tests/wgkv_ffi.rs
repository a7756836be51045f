//! The write-gated pool through the C API: create, append with scores or a gate, decode
//! against the fp64 reference, drafts, stats; bad input gets a status and a message and
//! changes nothing.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::wgkv::{record, reference, SeqModel};
use common::*;
use kvreplay::ffi::*;
use kvreplay::kv::wgkv::WgKvConfig;

const L: usize = 2;
const H: usize = 2;
const D: usize = 16;

fn t32(data: &[f32], shape: &[i64]) -> kvr_tensor {
    tensor(
        data.as_ptr() as *mut c_void,
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        shape,
        &contiguous_strides(shape),
    )
}

/// The test pool's parameters (`pages` pages; ring 8, one sink).
fn params(pages: i64) -> (kvr_kv_pool_params, kvr_wgkv_params) {
    let mut kv = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_pool_params_default(kv.as_mut_ptr()));
    let mut kv: kvr_kv_pool_params = unsafe { kv.assume_init() };
    kv.n_layers = L as i32;
    kv.n_kv_heads = H as i32;
    kv.head_dim = D as i32;
    kv.page_size = 4;
    kv.dtype = KVR_DTYPE_F32;
    kv.capacity_pages = pages;
    kv.max_seqs = 4;
    kv.max_seq_len = 4096;
    let mut wg = std::mem::MaybeUninit::uninit();
    ok(kvr_wgkv_params_default(wg.as_mut_ptr()));
    let mut wg: kvr_wgkv_params = unsafe { wg.assume_init() };
    assert_eq!((wg.local_window, wg.tau, wg.sinks), (256, 0.1, 0));
    wg.local_window = 8;
    wg.sinks = 1;
    (kv, wg)
}

fn new_pool(ctx: *mut kvr_context, pages: i64) -> (*mut kvr_wgkv_pool, WgKvConfig) {
    let (kv, wg) = params(pages);
    let mut pool = null_mut();
    ok(kvr_wgkv_pool_new(ctx, &kv, &wg, &mut pool));
    let cfg = WgKvConfig {
        layers: L,
        kv_heads: H,
        head_dim: D,
        page_size: 4,
        dtype: kvreplay::DType::F32,
        capacity_pages: pages as usize,
        max_seqs: 4,
        max_global_tokens: 4096,
        local_window: 8,
        tau: 0.1,
        sinks: 1,
    };
    (pool, cfg)
}

fn stats(pool: *const kvr_wgkv_pool) -> kvr_wgkv_pool_stats {
    let mut s: kvr_wgkv_pool_stats = unsafe { std::mem::zeroed() };
    s.struct_size = size_of::<kvr_wgkv_pool_stats>() as u32;
    ok(kvr_wgkv_pool_get_stats(pool, &mut s));
    s
}

fn rows(pool: *const kvr_wgkv_pool, seq: i32) -> Vec<kvr_wgkv_row_stats> {
    let mut r = vec![kvr_wgkv_row_stats::default(); L * H];
    let mut n = 0;
    ok(kvr_wgkv_pool_get_seq_rows(
        pool,
        seq,
        r.as_mut_ptr(),
        r.len() as i64,
        &mut n,
    ));
    assert_eq!(n as usize, L * H);
    r
}

fn decode_check(
    pool: *mut kvr_wgkv_pool,
    cfg: &WgKvConfig,
    seq: i32,
    m: &SeqModel,
    rng: &mut Rng,
    t: usize,
) {
    let hq = 2 * H;
    for layer in 0..L {
        let q = rng.vec(t * hq * D, -1.0, 1.0);
        let out = vec![f32::NAN; t * hq * D];
        let ids = [seq];
        let idt = tensor(
            ids.as_ptr() as *mut c_void,
            KVR_DTYPE_I32,
            KVR_DEVICE_HOST,
            &[1],
            &[1],
        );
        let shape = [1, t as i64, hq as i64, D as i64];
        ok(kvr_wgkv_pool_decode(
            pool,
            layer as i32,
            &idt,
            &t32(&q, &shape),
            &t32(&out, &shape),
            null(),
            null(),
            null_mut(),
        ));
        let want = reference(&[Some(m)], cfg, layer, &q, t, hq, 0.25);
        let e = common::wgkv::max_err(&out, &want);
        assert!(e < 1e-5, "layer {layer}: {e}");
    }
}

/// Appends `n` committed tokens with random K/V and scores to every layer of `seq` through
/// the C API, and records them in `m`.
fn append_committed(
    pool: *mut kvr_wgkv_pool,
    cfg: &WgKvConfig,
    seq: i32,
    m: &mut SeqModel,
    rng: &mut Rng,
    n: usize,
) {
    let k = rng.vec(L * n * H * D, -1.0, 1.0);
    let v = rng.vec(L * n * H * D, -1.0, 1.0);
    let s = rng.vec(L * n * H, 0.0, 1.0);
    let shape = [L as i64, n as i64, H as i64, D as i64];
    ok(kvr_wgkv_pool_append(
        pool,
        seq,
        KVR_LAYER_ALL,
        &t32(&k, &shape),
        &t32(&v, &shape),
        null(),
        &t32(&s, &[L as i64, n as i64, H as i64]),
        KVR_WGKV_COMMITTED,
        null_mut(),
    ));
    record(m, cfg, 0..L, n, &k, &v, &s, false);
}

#[test]
fn append_decode_drafts_and_stats_through_the_c_api() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, cfg) = new_pool(ctx, 2000);
    let mut rng = Rng::new(1);
    let mut seq = -1;
    ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut seq));
    let mut m = SeqModel::new(L * H);
    let n = 30;
    append_committed(pool, &cfg, seq, &mut m, &mut rng, n);
    decode_check(pool, &cfg, seq, &m, &mut rng, 1);
    // Per layer, drafts, decode over them, commit 2 of 3.
    for l in 0..L {
        let k = rng.vec(3 * H * D, -1.0, 1.0);
        let v = rng.vec(3 * H * D, -1.0, 1.0);
        let s = rng.vec(3 * H, 0.0, 1.0);
        let sh = [3, H as i64, D as i64];
        ok(kvr_wgkv_pool_append(
            pool,
            seq,
            l as i32,
            &t32(&k, &sh),
            &t32(&v, &sh),
            null(),
            &t32(&s, &[3, H as i64]),
            KVR_WGKV_DRAFT,
            null_mut(),
        ));
        record(&mut m, &cfg, l..l + 1, 3, &k, &v, &s, true);
    }
    decode_check(pool, &cfg, seq, &m, &mut rng, 3);
    ok(kvr_wgkv_pool_commit(pool, seq, 2, null_mut()));
    common::wgkv::commit(&mut m, 2);
    decode_check(pool, &cfg, seq, &m, &mut rng, 1);
    let r = rows(pool, seq);
    for (i, row) in r.iter().enumerate() {
        assert_eq!(row.total as usize, n + 2);
        assert_eq!(row.global as usize, m.global(i, &cfg));
        assert_eq!(row.ring, 8);
    }
    let st = stats(pool);
    assert_eq!(st.sequences, 1);
    assert_eq!(st.full_tokens as usize, L * H * (n + 2));
    assert!(
        st.kept_tokens < st.full_tokens && st.pages_used <= st.full_pages,
        "{st:?}"
    );
    // Fork, free.
    let mut child = -1;
    ok(kvr_wgkv_pool_seq_fork(pool, seq, null_mut(), &mut child));
    assert_eq!(stats(pool).pages_shared, st.pages_used);
    ok(kvr_wgkv_pool_seq_free(pool, seq, null_mut()));
    decode_check(pool, &cfg, child, &m, &mut rng, 1);
    ok(kvr_wgkv_pool_seq_free(pool, child, null_mut()));
    assert_eq!(stats(pool).pages_used, 0);
    kvr_wgkv_pool_free(pool);
    kvr_wgkv_pool_free(null_mut());
    kvr_context_free(ctx);
}

#[test]
fn bad_input_gets_a_status_and_changes_nothing() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, _cfg) = new_pool(ctx, 40);
    let mut rng = Rng::new(2);
    let mut seq = -1;
    ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut seq));
    let n = 4;
    let k = rng.vec(L * n * H * D, -1.0, 1.0);
    let s = rng.vec(L * n * H, 0.0, 1.0);
    let shape = [L as i64, n as i64, H as i64, D as i64];
    let sshape = [L as i64, n as i64, H as i64];
    ok(kvr_wgkv_pool_append(
        pool,
        seq,
        KVR_LAYER_ALL,
        &t32(&k, &shape),
        &t32(&k, &shape),
        null(),
        &t32(&s, &sshape),
        0,
        null_mut(),
    ));
    let before = (
        format!("{:?}", stats(pool)),
        format!("{:?}", rows(pool, seq)),
    );
    let kt = t32(&k, &shape);
    let st = t32(&s, &sshape);
    let big = rng.vec(L * 200 * H * D, -1.0, 1.0);
    let bigs = vec![0.9f32; L * 200 * H];
    let cases: Vec<(kvr_status, Box<dyn Fn() -> kvr_status>)> = vec![
        (
            KVR_STATUS_NULL_ARG,
            Box::new(|| {
                kvr_wgkv_pool_append(pool, seq, -1, null(), &kt, null(), &st, 0, null_mut())
            }),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            Box::new(|| {
                kvr_wgkv_pool_append(pool, seq, -1, &kt, &kt, null(), null(), 0, null_mut())
            }),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            Box::new(|| kvr_wgkv_pool_append(pool, seq, -1, &kt, &kt, &kt, null(), 0, null_mut())),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            Box::new(|| kvr_wgkv_pool_append(pool, seq, -1, &kt, &kt, null(), &st, 4, null_mut())),
        ),
        (
            KVR_STATUS_UNKNOWN_ID,
            Box::new(|| kvr_wgkv_pool_append(pool, 3, -1, &kt, &kt, null(), &st, 0, null_mut())),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            Box::new(|| kvr_wgkv_pool_append(pool, seq, 5, &kt, &kt, null(), &st, 0, null_mut())),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            Box::new(|| kvr_wgkv_pool_append(pool, seq, 0, &kt, &kt, null(), &st, 0, null_mut())),
        ),
        (
            KVR_STATUS_POOL_EXHAUSTED,
            Box::new(|| {
                let shape = [L as i64, 200, H as i64, D as i64];
                kvr_wgkv_pool_append(
                    pool,
                    seq,
                    -1,
                    &t32(&big, &shape),
                    &t32(&big, &shape),
                    null(),
                    &t32(&bigs, &[L as i64, 200, H as i64]),
                    0,
                    null_mut(),
                )
            }),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            Box::new(|| kvr_wgkv_pool_commit(pool, seq, 1, null_mut())),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            Box::new(|| kvr_wgkv_pool_commit(pool, seq, -1, null_mut())),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            Box::new(|| kvr_wgkv_pool_seq_truncate(pool, seq, 2, null_mut())),
        ),
        (
            KVR_STATUS_NULL_ARG,
            Box::new(|| kvr_wgkv_pool_set_gate(pool, null(), 4)),
        ),
        (
            KVR_STATUS_NULL_ARG,
            Box::new(|| kvr_wgkv_pool_load_gate(pool, null(), null(), 0)),
        ),
        (
            KVR_STATUS_IO_ERROR,
            Box::new(|| {
                kvr_wgkv_pool_load_gate(pool, c"/nonexistent/gate.gguf".as_ptr(), null(), 0)
            }),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            Box::new(|| {
                kvr_wgkv_pool_append(
                    0x5550 as *mut kvr_wgkv_pool,
                    seq,
                    -1,
                    &kt,
                    &kt,
                    null(),
                    &st,
                    0,
                    null_mut(),
                )
            }),
        ),
    ];
    for (i, (want, f)) in cases.iter().enumerate() {
        let got = f();
        assert_eq!(
            got,
            *want,
            "case {i}: {} ({})",
            status_name(got),
            last_error()
        );
        assert!(!last_error().is_empty());
        assert_eq!(
            (
                format!("{:?}", stats(pool)),
                format!("{:?}", rows(pool, seq))
            ),
            before,
            "case {i}"
        );
    }
    // Appending with k_pre but no gate set.
    assert_eq!(
        kvr_wgkv_pool_append(pool, seq, -1, &kt, &kt, &kt, null(), 0, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert!(last_error().contains("gate"), "{}", last_error());
    // Decode: window refused, device ids refused, T > drafts.
    let q = vec![0.5f32; 4 * D];
    let out = vec![0f32; 4 * D];
    let ids = [seq];
    let idt = tensor(
        ids.as_ptr() as *mut c_void,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[1],
        &[1],
    );
    let qt = t32(&q, &[1, 4, D as i64]);
    let ot = t32(&out, &[1, 4, D as i64]);
    let mut dp = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_decode_params_default(dp.as_mut_ptr()));
    let mut dp: kvr_kv_decode_params = unsafe { dp.assume_init() };
    dp.window = 4;
    assert_eq!(
        kvr_wgkv_pool_decode(pool, 0, &idt, &qt, &ot, null(), &dp, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert!(out.iter().all(|&x| x == 0.0));
    let q2 = vec![0.5f32; 2 * 4 * D];
    let out2 = vec![0f32; 2 * 4 * D];
    let sh2 = [1, 2, 4, D as i64];
    assert_eq!(
        kvr_wgkv_pool_decode(
            pool,
            0,
            &idt,
            &t32(&q2, &sh2),
            &t32(&out2, &sh2),
            null(),
            null(),
            null_mut()
        ),
        KVR_STATUS_OUT_OF_RANGE
    );
    // Params: bad window / tau / external layers.
    let mut kv = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_pool_params_default(kv.as_mut_ptr()));
    let mut kv: kvr_kv_pool_params = unsafe { kv.assume_init() };
    kv.n_layers = 1;
    kv.n_kv_heads = 1;
    kv.head_dim = 8;
    kv.capacity_bytes = 1 << 20;
    kv.max_seqs = 2;
    kv.max_seq_len = 1024;
    let mut wg = std::mem::MaybeUninit::uninit();
    ok(kvr_wgkv_params_default(wg.as_mut_ptr()));
    let wg: kvr_wgkv_params = unsafe { wg.assume_init() };
    let mut p = 0x55usize as *mut kvr_wgkv_pool;
    for (edit, want) in [
        (
            Box::new(|w: &mut kvr_wgkv_params| w.local_window = 20)
                as Box<dyn Fn(&mut kvr_wgkv_params)>,
            KVR_STATUS_INVALID_ARG,
        ),
        (
            Box::new(|w: &mut kvr_wgkv_params| w.local_window = (1 << 19) + 16),
            KVR_STATUS_INVALID_ARG,
        ),
        (
            Box::new(|w: &mut kvr_wgkv_params| w.tau = 1.5),
            KVR_STATUS_INVALID_ARG,
        ),
        (
            Box::new(|w: &mut kvr_wgkv_params| w.sinks = -1),
            KVR_STATUS_INVALID_ARG,
        ),
        (
            Box::new(|w: &mut kvr_wgkv_params| w.struct_size = 4),
            KVR_STATUS_INVALID_ARG,
        ),
    ] {
        let mut w = wg;
        edit(&mut w);
        assert_eq!(
            kvr_wgkv_pool_new(ctx, &kv, &w, &mut p),
            want,
            "{}",
            last_error()
        );
        assert_eq!(p as usize, 0x55);
    }
    // capacity_bytes buys write-gated pages (2 * 16 * 8 * 2 bytes each).
    ok(kvr_wgkv_pool_new(ctx, &kv, null(), &mut p));
    assert_eq!(stats(p).pages_total, (1 << 20) / 512);
    assert_eq!(stats(p).page_bytes, 512);
    kvr_wgkv_pool_free(p);
    kvr_wgkv_pool_free(pool);
    kvr_context_free(ctx);
}

#[test]
fn gate_through_the_c_api() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, cfg) = new_pool(ctx, 2000);
    let mut rng = Rng::new(5);
    let hid = 12;
    let raw: Vec<[Vec<f32>; 6]> = (0..L)
        .map(|_| {
            [
                rng.vec(D, 0.5, 1.5),
                rng.vec(D, 0.5, 1.5),
                rng.vec(H * hid * 2 * D, -0.3, 0.3),
                rng.vec(H * hid, -0.5, 0.5),
                rng.vec(H * hid, -0.8, 0.8),
                rng.vec(H, -1.0, 1.0),
            ]
        })
        .collect();
    let layers: Vec<kvr_wgkv_gate_layer> = raw
        .iter()
        .map(|r| kvr_wgkv_gate_layer {
            norm_pre: r[0].as_ptr(),
            norm_post: r[1].as_ptr(),
            fc1_weight: r[2].as_ptr(),
            fc1_bias: r[3].as_ptr(),
            fc2_weight: r[4].as_ptr(),
            fc2_bias: r[5].as_ptr(),
        })
        .collect();
    ok(kvr_wgkv_pool_set_gate(pool, layers.as_ptr(), hid as i32));
    let mut bad = layers.clone();
    bad[1].fc2_bias = null();
    assert_eq!(
        kvr_wgkv_pool_set_gate(pool, bad.as_ptr(), hid as i32),
        KVR_STATUS_NULL_ARG
    );
    let mut seq = -1;
    ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut seq));
    let n = 25;
    let kp = rng.vec(L * n * H * D, -2.0, 2.0);
    let k = rng.vec(L * n * H * D, -2.0, 2.0);
    let v = rng.vec(L * n * H * D, -1.0, 1.0);
    let shape = [L as i64, n as i64, H as i64, D as i64];
    ok(kvr_wgkv_pool_append(
        pool,
        seq,
        KVR_LAYER_ALL,
        &t32(&k, &shape),
        &t32(&v, &shape),
        &t32(&kp, &shape),
        null(),
        0,
        null_mut(),
    ));
    // The same scores through the Rust gate.
    let views: Vec<[kvreplay::TensorView; 6]> = raw
        .iter()
        .map(|r| {
            let vw = common::wgkv::view;
            [
                vw(&r[0], &[D]),
                vw(&r[1], &[D]),
                vw(&r[2], &[H, hid, 2 * D]),
                vw(&r[3], &[H, hid]),
                vw(&r[4], &[H, hid]),
                vw(&r[5], &[H]),
            ]
        })
        .collect();
    let g = kvreplay::kv::wgkv::GateWeights::from_views(H, D, &views).unwrap();
    let mut scores = Vec::new();
    for l in 0..L {
        let o = l * n * H * D;
        let sh = [n, H, D];
        scores.extend(
            g.scores(
                l,
                &common::wgkv::view(&kp[o..o + n * H * D], &sh),
                &common::wgkv::view(&k[o..o + n * H * D], &sh),
            )
            .unwrap(),
        );
    }
    let mut m = SeqModel::new(L * H);
    record(&mut m, &cfg, 0..L, n, &k, &v, &scores, false);
    decode_check(pool, &cfg, seq, &m, &mut rng, 1);
    kvr_wgkv_pool_free(pool);
    kvr_context_free(ctx);
}

/// `kvr_wgkv_params_compute_pages_per_seq` equals the pool's page count for a sequence built through the
/// C API and the core helper; no capacity needed; bad input gets a status and writes nothing.
#[test]
fn pages_per_seq_through_the_c_api() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, cfg) = new_pool(ctx, 512);
    // 30 committed tokens (ring 8, sink 1, every token past it admitted: scores 0.9), 2 drafts.
    let seq = {
        let mut s = -1;
        ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut s));
        s
    };
    for (n, draft) in [(30usize, false), (2, true)] {
        let k = vec![0.25f32; L * n * H * D];
        let sc = vec![0.9f32; L * n * H];
        let shape = [L as i64, n as i64, H as i64, D as i64];
        let (kt, vt) = (t32(&k, &shape), t32(&k, &shape));
        let st = t32(&sc, &[L as i64, n as i64, H as i64]);
        let flags = if draft {
            KVR_WGKV_DRAFT
        } else {
            KVR_WGKV_COMMITTED
        };
        ok(kvr_wgkv_pool_append(
            pool,
            seq,
            KVR_LAYER_ALL,
            &kt,
            &vt,
            null(),
            &st,
            flags,
            null_mut(),
        ));
    }
    let (kv, wg) = params(0); // no capacity: sizing comes first
    let mut pages = -7i64;
    ok(kvr_wgkv_params_compute_pages_per_seq(
        &kv, &wg, 30, 1.0, 2, &mut pages,
    ));
    assert_eq!(pages, stats(pool).pages_used);
    assert_eq!(pages as usize, cfg.pages_per_seq(30, 1.0, 2).unwrap());
    // (8 ring + 22 global + 2 drafts) / 4 per row, 4 rows.
    assert_eq!(pages, 4 * 8);
    for (context, admit, drafts, want) in [
        (-1i64, 0.5, 0, KVR_STATUS_INVALID_ARG),
        (30, 1.01, 0, KVR_STATUS_INVALID_ARG),
        (30, f64::NAN, 0, KVR_STATUS_INVALID_ARG),
        (30, -0.1, 0, KVR_STATUS_INVALID_ARG),
        (30, 0.5, 9, KVR_STATUS_OUT_OF_RANGE),
        (30, 0.5, -1, KVR_STATUS_OUT_OF_RANGE),
        (1 << 40, 1.0, 0, KVR_STATUS_OUT_OF_RANGE),
    ] {
        let mut out = 0x55i64;
        assert_eq!(
            kvr_wgkv_params_compute_pages_per_seq(&kv, &wg, context, admit, drafts, &mut out),
            want,
            "context {context} admit {admit} drafts {drafts}: {}",
            last_error()
        );
        assert_eq!(out, 0x55);
    }
    let mut out = 0x55i64;
    assert_eq!(
        kvr_wgkv_params_compute_pages_per_seq(null(), &wg, 30, 0.5, 0, &mut out),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_wgkv_params_compute_pages_per_seq(&kv, &wg, 30, 0.5, 0, null_mut()),
        KVR_STATUS_NULL_ARG
    );
    let mut bad = wg;
    bad.local_window = 6;
    assert_eq!(
        kvr_wgkv_params_compute_pages_per_seq(&kv, &bad, 30, 0.5, 0, &mut out),
        KVR_STATUS_INVALID_ARG
    );
    let mut bad = kv;
    bad.dtype = 77;
    assert_ne!(
        kvr_wgkv_params_compute_pages_per_seq(&bad, &wg, 30, 0.5, 0, &mut out),
        KVR_STATUS_OK
    );
    assert_eq!(out, 0x55);
    // NULL `wg`: the defaults (ring 256): 30 tokens stay in the ring, 8 pages per row.
    ok(kvr_wgkv_params_compute_pages_per_seq(
        &kv,
        null(),
        30,
        0.5,
        0,
        &mut out,
    ));
    assert_eq!(out, 4 * 8);
    kvr_wgkv_pool_free(pool);
    kvr_context_free(ctx);
}

#[test]
fn reserve_and_step_through_the_c_api() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, cfg) = new_pool(ctx, 400);
    let mut rng = Rng::new(3);
    let (mut a, mut b) = (-1, -1);
    ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut a));
    ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut b));
    let (mut ma, mut mb) = (SeqModel::new(L * H), SeqModel::new(L * H));
    for (s, m, n) in [(a, &mut ma, 5usize), (b, &mut mb, 11)] {
        let k = rng.vec(L * n * H * D, -1.0, 1.0);
        let sc = rng.vec(L * n * H, 0.0, 1.0);
        let shape = [L as i64, n as i64, H as i64, D as i64];
        ok(kvr_wgkv_pool_append(
            pool,
            s,
            KVR_LAYER_ALL,
            &t32(&k, &shape),
            &t32(&k, &shape),
            null(),
            &t32(&sc, &[L as i64, n as i64, H as i64]),
            KVR_WGKV_COMMITTED,
            null_mut(),
        ));
        record(m, &cfg, 0..L, n, &k, &k, &sc, false);
    }
    let ids = [b, a];
    let idt = tensor(
        ids.as_ptr() as *mut c_void,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[2],
        &[1],
    );
    let steps = 6;
    let step = |layer: i32, k: &[f32], v: &[f32], sc: &[f32], out: &mut [f32]| {
        let sh = [2, H as i64, D as i64];
        kvr_wgkv_pool_step(
            pool,
            layer,
            &idt,
            &t32(k, &sh),
            &t32(v, &sh),
            null(),
            &t32(sc, &[2, H as i64]),
            &t32(out, &[2, H as i64]),
            null_mut(),
        )
    };
    let mut out = vec![0f32; 2 * H];
    let k0 = rng.vec(2 * H * D, -1.0, 1.0);
    let s0 = vec![0.5f32; 2 * H];
    assert_eq!(
        step(0, &k0, &k0, &s0, &mut out),
        KVR_STATUS_OUT_OF_RANGE,
        "no reservation"
    );
    assert!(last_error().contains("reserve"), "{}", last_error());
    for s in [a, b] {
        ok(kvr_wgkv_pool_reserve(pool, s, steps, null_mut()));
    }
    for _ in 0..steps {
        for layer in 0..L {
            let k = rng.vec(2 * H * D, -1.0, 1.0);
            let v = rng.vec(2 * H * D, -1.0, 1.0);
            let sc = rng.vec(2 * H, 0.0, 1.0);
            ok(step(layer as i32, &k, &v, &sc, &mut out));
            assert_eq!(out, sc);
            for (i, m) in [&mut mb, &mut ma].into_iter().enumerate() {
                let r = i * H * D..(i + 1) * H * D;
                let s = &sc[i * H..(i + 1) * H];
                record(m, &cfg, layer..layer + 1, 1, &k[r.clone()], &v[r], s, false);
            }
        }
    }
    decode_check(pool, &cfg, a, &ma, &mut rng, 1);
    decode_check(pool, &cfg, b, &mb, &mut rng, 1);
    // Bad calls: a status, nothing changes.
    let before = (
        format!("{:?}", stats(pool)),
        format!("{:?}", rows(pool, a)),
        format!("{:?}", rows(pool, b)),
    );
    let kt = t32(&k0, &[2, H as i64, D as i64]);
    let st = t32(&s0, &[2, H as i64]);
    let cases: Vec<(kvr_status, kvr_status)> = vec![
        (
            KVR_STATUS_OUT_OF_RANGE,
            step(0, &k0, &k0, &s0, &mut out), // the budget is spent
        ),
        (
            KVR_STATUS_NULL_ARG,
            kvr_wgkv_pool_step(pool, 0, null(), &kt, &kt, null(), &st, null(), null_mut()),
        ),
        (
            KVR_STATUS_NULL_ARG,
            kvr_wgkv_pool_step(pool, 0, &idt, &kt, null(), null(), &st, null(), null_mut()),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            kvr_wgkv_pool_step(pool, 0, &idt, &kt, &kt, null(), null(), null(), null_mut()),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            kvr_wgkv_pool_step(pool, 0, &idt, &kt, &kt, &kt, null(), null(), null_mut()),
        ),
        (
            KVR_STATUS_INVALID_ARG,
            kvr_wgkv_pool_step(pool, 0, &kt, &kt, &kt, null(), &st, null(), null_mut()),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            kvr_wgkv_pool_step(pool, 5, &idt, &kt, &kt, null(), &st, null(), null_mut()),
        ),
        (
            KVR_STATUS_NULL_ARG,
            kvr_wgkv_pool_step(
                null_mut(),
                0,
                &idt,
                &kt,
                &kt,
                null(),
                &st,
                null(),
                null_mut(),
            ),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            kvr_wgkv_pool_reserve(pool, a, -1, null_mut()),
        ),
        (
            KVR_STATUS_OUT_OF_RANGE,
            kvr_wgkv_pool_reserve(pool, a, 0, null_mut()),
        ),
        (
            KVR_STATUS_UNKNOWN_ID,
            kvr_wgkv_pool_reserve(pool, 3, 1, null_mut()),
        ),
        (
            KVR_STATUS_POOL_EXHAUSTED,
            kvr_wgkv_pool_reserve(pool, a, 3000, null_mut()),
        ),
        (
            KVR_STATUS_NULL_ARG,
            kvr_wgkv_pool_reserve(null_mut(), a, 1, null_mut()),
        ),
    ];
    for (i, (want, got)) in cases.into_iter().enumerate() {
        assert_eq!(got, want, "case {i}: {}", last_error());
    }
    let after = (
        format!("{:?}", stats(pool)),
        format!("{:?}", rows(pool, a)),
        format!("{:?}", rows(pool, b)),
    );
    assert_eq!(after, before);
    kvr_wgkv_pool_free(pool);
    kvr_context_free(ctx);
}

#[test]
fn step_decode_through_the_c_api() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, cfg) = new_pool(ctx, 400);
    let mut rng = Rng::new(5);
    let mut a = -1;
    ok(kvr_wgkv_pool_seq_add(pool, null_mut(), &mut a));
    let mut m = SeqModel::new(L * H);
    append_committed(pool, &cfg, a, &mut m, &mut rng, 7);
    let ids = [a];
    let idt = tensor(
        ids.as_ptr() as *mut c_void,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[1],
        &[1],
    );
    let hq = 2 * H;
    let (sh, qsh) = ([1, H as i64, D as i64], [1, hq as i64, D as i64]);
    let fused = |layer: i32, kv: &[f32], sc: &[f32], q: &[f32], out: &mut [f32]| {
        kvr_wgkv_pool_step_decode(
            pool,
            layer,
            &idt,
            &t32(kv, &sh),
            &t32(kv, &sh),
            null(),
            &t32(sc, &[1, H as i64]),
            null(),
            &t32(q, &qsh),
            &t32(out, &qsh),
            null(),
            null(),
            null_mut(),
        )
    };
    let steps = 12; // past the ring of 8: evictions and promotions
    ok(kvr_wgkv_pool_reserve(pool, a, steps, null_mut()));
    for _ in 0..steps {
        for layer in 0..L {
            let kv = rng.vec(H * D, -1.0, 1.0);
            let s = rng.vec(H, 0.0, 1.0);
            let q = rng.vec(hq * D, -1.0, 1.0);
            let mut out = vec![f32::NAN; hq * D];
            ok(fused(layer as i32, &kv, &s, &q, &mut out));
            record(&mut m, &cfg, layer..layer + 1, 1, &kv, &kv, &s, false);
            let want = reference(&[Some(&m)], &cfg, layer, &q, 1, hq, 0.25);
            let e = common::wgkv::max_err(&out, &want);
            assert!(e < 1e-5, "layer {layer}: {e}");
        }
    }
    // Bad calls: a status, nothing changes, out is not written.
    ok(kvr_wgkv_pool_reserve(pool, a, 1, null_mut()));
    let before = (format!("{:?}", stats(pool)), format!("{:?}", rows(pool, a)));
    let kv = rng.vec(H * D, -1.0, 1.0);
    let s = vec![0.5f32; H];
    let q = rng.vec(2 * hq * D, -1.0, 1.0);
    let out = vec![f32::NAN; 2 * hq * D];
    let (kt, st) = (t32(&kv, &sh), t32(&s, &[1, H as i64]));
    let (qt, ot) = (t32(&q[..hq * D], &qsh), t32(&out[..hq * D], &qsh));
    let q2 = t32(&q, &[1, 2, hq as i64, D as i64]);
    let o2 = t32(&out, &[1, 2, hq as i64, D as i64]);
    let bad_out = t32(&out[..hq * D], &[1, H as i64, 2 * D as i64]);
    let call = |pl: *mut kvr_wgkv_pool,
                layer: i32,
                q: *const kvr_tensor,
                o: *const kvr_tensor,
                sc: *const kvr_tensor| {
        kvr_wgkv_pool_step_decode(
            pl,
            layer,
            &idt,
            &kt,
            &kt,
            null(),
            sc,
            null(),
            q,
            o,
            null(),
            null(),
            null_mut(),
        )
    };
    let cases: Vec<(kvr_status, kvr_status)> = vec![
        (KVR_STATUS_NULL_ARG, call(pool, 0, null(), &ot, &st)),
        (KVR_STATUS_NULL_ARG, call(pool, 0, &qt, null(), &st)),
        (KVR_STATUS_INVALID_ARG, call(pool, 0, &qt, &ot, null())),
        (KVR_STATUS_INVALID_ARG, call(pool, 0, &q2, &o2, &st)),
        (KVR_STATUS_INVALID_ARG, call(pool, 0, &qt, &bad_out, &st)),
        (KVR_STATUS_NULL_ARG, call(null_mut(), 0, &qt, &ot, &st)),
        (KVR_STATUS_OUT_OF_RANGE, call(pool, L as i32, &qt, &ot, &st)),
    ];
    for (i, (want, got)) in cases.into_iter().enumerate() {
        assert_eq!(got, want, "case {i}: {}", last_error());
    }
    assert!(out.iter().all(|x| x.is_nan()), "a refused call wrote out");
    let after = (format!("{:?}", stats(pool)), format!("{:?}", rows(pool, a)));
    assert_eq!(before, after, "a refused call changed the pool");
    kvr_wgkv_pool_free(pool);
    kvr_context_free(ctx);
}
