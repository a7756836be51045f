//! The GDN pool through the C API: parameters and sizing, a verify/commit/decode round trip,
//! and bad input (each a status with a message, the pool unchanged).

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::*;
use kvreplay::ffi::*;

fn cpu_ctx() -> *mut kvr_context {
    context(KVR_BACKEND_CPU, null_mut()).unwrap()
}

fn params() -> kvr_gdn_pool_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_gdn_pool_params_default(p.as_mut_ptr()));
    let mut p: kvr_gdn_pool_params = unsafe { p.assume_init() };
    p.n_layers = 2;
    p.n_k_heads = 1;
    p.n_v_heads = 2;
    p.dk = 32;
    p.dv = 32;
    p.max_seqs = 4;
    p.max_drafts = 4;
    p.conv_dim = 8;
    p
}

fn host(data: &mut [f32], shape: &[i64]) -> kvr_tensor {
    tensor(
        data.as_mut_ptr() as *mut c_void,
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        shape,
        &contiguous_strides(shape),
    )
}

fn ids(data: &mut [i32]) -> kvr_tensor {
    tensor(
        data.as_mut_ptr() as *mut c_void,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[data.len() as i64],
        &[1],
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

fn memory(p: &kvr_gdn_pool_params) -> kvr_gdn_pool_memory {
    let mut m: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
    m.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
    ok(kvr_gdn_pool_params_memory(p, &mut m));
    m
}

/// Random inputs for B rows x T drafts (q, k, v, g, beta, conv).
struct Step {
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

impl Step {
    fn new(rng: &mut Rng, b: i64, t: i64) -> Step {
        let n = (b * t) as usize;
        Step {
            q: rng.vec(n * 32, -1.0, 1.0),
            k: rng.vec(n * 32, -1.0, 1.0),
            v: rng.vec(n * 64, -1.0, 1.0),
            g: rng.vec(n * 2, -0.3, -0.01),
            beta: rng.vec(n * 2, 0.1, 0.9),
            conv: rng.vec(n * 8, -1.0, 1.0),
            out: vec![f32::NAN; n * 64],
            b,
            t,
        }
    }
    /// (q, k, v, g, beta, conv, out) descriptors with a T dimension.
    fn tensors(&mut self) -> [kvr_tensor; 7] {
        let (b, t) = (self.b, self.t);
        [
            host(&mut self.q, &[b, t, 1, 32]),
            host(&mut self.k, &[b, t, 1, 32]),
            host(&mut self.v, &[b, t, 2, 32]),
            host(&mut self.g, &[b, t, 2]),
            host(&mut self.beta, &[b, t, 2]),
            host(&mut self.conv, &[b, t, 8]),
            host(&mut self.out, &[b, t, 2, 32]),
        ]
    }
}

fn verify(pool: *mut kvr_gdn_pool, layer: i32, id: &kvr_tensor, s: &mut Step) -> kvr_status {
    let t = s.tensors();
    gdn_pool_call(
        pool,
        layer,
        id,
        true,
        t.each_ref().map(|x| x as *const _),
        null(),
    )
}

/// One decode of `s` with l2-normalized q and k (the step's other options at their defaults).
fn decode_l2(pool: *mut kvr_gdn_pool, layer: i32, id: &kvr_tensor, s: &mut Step) -> kvr_status {
    let t = s.tensors();
    let mut sp = std::mem::MaybeUninit::uninit();
    ok(kvr_gdn_step_params_default(sp.as_mut_ptr()));
    let mut sp: kvr_gdn_step_params = unsafe { sp.assume_init() };
    sp.l2norm_qk = 1;
    gdn_pool_call(
        pool,
        layer,
        id,
        false,
        t.each_ref().map(|x| x as *const _),
        &sp,
    )
}

#[test]
fn params_sizing_and_a_round_trip() {
    let mut d = std::mem::MaybeUninit::uninit();
    ok(kvr_gdn_pool_params_default(d.as_mut_ptr()));
    let d: kvr_gdn_pool_params = unsafe { d.assume_init() };
    assert_eq!(
        (d.ring_len, d.kv_only_threshold, d.max_seqs, d.conv_kernel),
        (16, KVR_GDN_THRESHOLD_DEFAULT, 256, 4)
    );
    assert_eq!(
        (d.state_dtype, d.entry_dtype, d.layout),
        (KVR_DTYPE_F32, KVR_DTYPE_F32, KVR_STATE_K_MAJOR)
    );
    assert!(d.states.is_null());
    // Sizing: a recurrent pool with 4 snapshots against a ring of 16.
    let mut p = params();
    let replay = memory(&p);
    assert_eq!(replay.state_bytes, 2 * 2 * 32 * 32 * 4);
    assert_eq!(replay.snapshot_bytes, 0);
    assert_eq!(replay.kv_only_threshold, 0, "the default threshold is off");
    // KV-only mode on request: up to what a head's state memory holds (15 entries of dk +
    // dv f32 and a log decay in 32 x 32 f32), in the same memory.
    let kv_only = kv_only_threshold(p.dk, p.dv, p.state_dtype, p.entry_dtype);
    assert_eq!(kv_only, 15, "min(dk, what a head's state memory holds)");
    p.kv_only_threshold = kv_only;
    let with_kv_only = memory(&p);
    assert_eq!(with_kv_only.kv_only_threshold, 15);
    assert_eq!(with_kv_only.total_bytes, replay.total_bytes);
    p.kv_only_threshold = kv_only + 1;
    let mut m: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
    m.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
    assert_eq!(
        kvr_gdn_pool_params_memory(&p, &mut m),
        KVR_STATUS_OUT_OF_RANGE
    );
    p.kv_only_threshold = KVR_GDN_THRESHOLD_DEFAULT;
    p.ring_len = 0;
    let snap = memory(&p);
    assert_eq!(snap.snapshot_bytes, 4 * snap.state_bytes);
    assert_eq!(snap.kv_only_threshold, 0);
    assert!(snap.total_bytes > 2 * replay.total_bytes);
    // A round trip through KV-only mode: verify 3 drafts, accept 2, then a decode step.
    let ctx = cpu_ctx();
    let mut p = params();
    p.kv_only_threshold = kv_only;
    let mut pool = null_mut();
    ok(kvr_gdn_pool_new(ctx, &p, &mut pool));
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    assert_eq!(cursor(pool, 1, seq).mode, KVR_GDN_MODE_KV_ONLY);
    let mut rng = Rng::new(1);
    let mut idv = [seq];
    let id = ids(&mut idv);
    let mut s = Step::new(&mut rng, 1, 3);
    ok(verify(pool, 1, &id, &mut s));
    assert!(s.out.iter().all(|x| x.is_finite()));
    assert_eq!(cursor(pool, 1, seq).pending, 3);
    let mut acc = [2i32];
    let accv = ids(&mut acc);
    let mut window = vec![f32::NAN; 3 * 8];
    let wv = host(&mut window, &[1, 3, 8]);
    ok(kvr_gdn_pool_commit(pool, 1, &id, &accv, &wv, null_mut()));
    let c = cursor(pool, 1, seq);
    assert_eq!((c.buffered, c.pending), (2, 0));
    assert_eq!(
        &window[8..],
        &s.conv[..16],
        "window = [0, conv(draft 0), conv(draft 1)]"
    );
    assert!(window[..8].iter().all(|&x| x == 0.0));
    let mut s1 = Step::new(&mut rng, 1, 1);
    ok(decode_l2(pool, 1, &id, &mut s1));
    assert_eq!(cursor(pool, 1, seq).buffered, 3);
    // Export, flush, import, reset.
    let mut st = vec![0f32; 2 * 32 * 32];
    let stv = host(&mut st, &[2, 32, 32]);
    ok(kvr_gdn_pool_export_state(
        pool,
        1,
        seq,
        &stv,
        null(),
        null_mut(),
    ));
    assert!(st.iter().any(|&x| x != 0.0));
    ok(kvr_gdn_pool_flush(pool, KVR_LAYER_ALL, &id, null_mut()));
    assert_eq!(cursor(pool, 1, seq).mode, KVR_GDN_MODE_REPLAY);
    ok(kvr_gdn_pool_import_state(
        pool,
        0,
        seq,
        &stv,
        null(),
        null_mut(),
    ));
    ok(kvr_gdn_pool_seq_reset(pool, seq, null_mut()));
    assert_eq!(cursor(pool, 1, seq).buffered, 0);
    let mut m: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
    m.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
    ok(kvr_gdn_pool_get_memory(pool, &mut m));
    assert_eq!(m.total_bytes, replay.total_bytes);
    ok(kvr_gdn_pool_seq_free(pool, seq, null_mut()));
    kvr_gdn_pool_free(pool);
    kvr_gdn_pool_free(null_mut());
    kvr_context_free(ctx);
}

#[test]
fn bad_input_is_a_status_and_changes_nothing() {
    let ctx = cpu_ctx();
    let mut out = null_mut();
    // Parameters.
    type Edit = Box<dyn Fn(&mut kvr_gdn_pool_params)>;
    let bad: Vec<(Edit, kvr_status, &str)> = vec![
        (
            Box::new(|p| p.n_layers = 0),
            KVR_STATUS_INVALID_ARG,
            "layers",
        ),
        (Box::new(|p| p.dk = -4), KVR_STATUS_INVALID_ARG, "dk"),
        (
            Box::new(|p| (p.n_k_heads, p.n_v_heads) = (2, 3)),
            KVR_STATUS_INVALID_ARG,
            "multiple",
        ),
        (
            Box::new(|p| p.max_drafts = 9),
            KVR_STATUS_OUT_OF_RANGE,
            "max_drafts",
        ),
        (
            Box::new(|p| p.ring_len = 2),
            KVR_STATUS_INVALID_ARG,
            "ring_len",
        ),
        (Box::new(|p| p.layout = 7), KVR_STATUS_INVALID_ARG, "layout"),
        (
            Box::new(|p| p.state_dtype = KVR_DTYPE_F16),
            KVR_STATUS_DTYPE_MISMATCH,
            "state dtype",
        ),
        (
            Box::new(|p| p.entry_dtype = 42),
            KVR_STATUS_INVALID_ARG,
            "dtype",
        ),
        (
            Box::new(|p| p.kv_only_threshold = 1000),
            KVR_STATUS_OUT_OF_RANGE,
            "kv_only_threshold",
        ),
        (
            Box::new(|p| p.conv_kernel = 1),
            KVR_STATUS_INVALID_ARG,
            "conv_kernel",
        ),
        (
            Box::new(|p| p.struct_size = 3),
            KVR_STATUS_INVALID_ARG,
            "struct_size",
        ),
    ];
    for (edit, want, word) in bad {
        let mut p = params();
        edit(&mut p);
        let s = kvr_gdn_pool_new(ctx, &p, &mut out);
        assert_eq!(s, want, "{word}: {}", last_error());
        assert!(last_error().contains(word), "{word}: {}", last_error());
        assert!(out.is_null());
    }
    // Calls on a pool without KV-only mode (the default) and on one whose sequence stays
    // KV-only throughout (at most 3 tokens + 2 drafts, threshold 15).
    for thr in [KVR_GDN_THRESHOLD_DEFAULT, 15] {
        let mut p = params();
        p.kv_only_threshold = thr;
        bad_calls_change_nothing(ctx, p);
    }
    kvr_context_free(ctx);
}

/// Failed calls on a pool made with `p` leave its cursors and states as they were.
fn bad_calls_change_nothing(ctx: *mut kvr_context, p: kvr_gdn_pool_params) {
    let mut out = null_mut();
    assert_eq!(kvr_gdn_pool_new(ctx, null(), &mut out), KVR_STATUS_NULL_ARG);
    assert_eq!(kvr_gdn_pool_new(ctx, &p, null_mut()), KVR_STATUS_NULL_ARG);
    assert_eq!(kvr_gdn_pool_new(null(), &p, &mut out), KVR_STATUS_NULL_ARG);
    let mut pool = null_mut();
    ok(kvr_gdn_pool_new(ctx, &p, &mut pool));
    let mut seq = -1;
    ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
    let mut rng = Rng::new(2);
    let mut idv = [seq];
    let id = ids(&mut idv);
    let mut s = Step::new(&mut rng, 1, 2);
    ok(verify(pool, 0, &id, &mut s));
    let mut acc = [1i32];
    ok(kvr_gdn_pool_commit(
        pool,
        0,
        &id,
        &ids(&mut acc),
        null(),
        null_mut(),
    ));
    let mode = if p.kv_only_threshold > 0 {
        KVR_GDN_MODE_KV_ONLY
    } else {
        KVR_GDN_MODE_REPLAY
    };
    assert_eq!(cursor(pool, 0, seq).mode, mode);
    let before = (cursor(pool, 0, seq), cursor(pool, 1, seq));
    let mut st = vec![0f32; 2 * 32 * 32];
    let stv = host(&mut st, &[2, 32, 32]);
    ok(kvr_gdn_pool_export_state(
        pool,
        0,
        seq,
        &stv,
        null(),
        null_mut(),
    ));
    let state0 = st.clone();
    let unchanged = |pool: *mut kvr_gdn_pool, st: &mut Vec<f32>| {
        let now = (cursor(pool, 0, seq), cursor(pool, 1, seq));
        assert_eq!(format!("{now:?}"), format!("{before:?}"));
        let stv = host(st, &[2, 32, 32]);
        ok(kvr_gdn_pool_export_state(
            pool,
            0,
            seq,
            &stv,
            null(),
            null_mut(),
        ));
        assert_eq!(*st, state0);
    };
    // Unknown sequence, bad layer, T above max_drafts, NULL tensors, missing conv input.
    let mut unknown = [seq + 1];
    let uv = ids(&mut unknown);
    assert_eq!(
        verify(pool, 0, &uv, &mut Step::new(&mut rng, 1, 2)),
        KVR_STATUS_UNKNOWN_ID
    );
    assert_eq!(
        verify(pool, 5, &id, &mut Step::new(&mut rng, 1, 2)),
        KVR_STATUS_OUT_OF_RANGE
    );
    assert_eq!(
        verify(pool, -1, &id, &mut Step::new(&mut rng, 1, 2)),
        KVR_STATUS_OUT_OF_RANGE
    );
    assert_eq!(
        verify(pool, 0, &id, &mut Step::new(&mut rng, 1, 5)),
        KVR_STATUS_OUT_OF_RANGE
    );
    let mut s2 = Step::new(&mut rng, 1, 2);
    let [q, k, v, g, beta, _conv, o] = s2.tensors();
    assert_eq!(
        gdn_pool_call(
            pool,
            0,
            &id,
            true,
            [&q, &k, &v, &g, &beta, null(), &o],
            null()
        ),
        KVR_STATUS_NULL_ARG
    );
    assert!(last_error().contains("conv_in"), "{}", last_error());
    assert_eq!(
        gdn_pool_call(
            pool,
            0,
            &id,
            false,
            [null(), &k, &v, &g, &beta, null(), &o],
            null()
        ),
        KVR_STATUS_NULL_ARG
    );
    // Wrong dtype: f32 sequence ids.
    let mut fid = [0f32];
    let fv = host(&mut fid, &[1]);
    assert_eq!(
        verify(pool, 0, &fv, &mut Step::new(&mut rng, 1, 2)),
        KVR_STATUS_DTYPE_MISMATCH
    );
    // Commit without verify; commit more than was verified.
    assert_eq!(
        kvr_gdn_pool_commit(pool, 0, &id, &ids(&mut [1]), null(), null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    ok(verify(pool, 1, &id, &mut Step::new(&mut rng, 1, 2)));
    assert_eq!(
        kvr_gdn_pool_commit(pool, 1, &id, &ids(&mut [3]), null(), null_mut()),
        KVR_STATUS_OUT_OF_RANGE
    );
    assert_eq!(
        kvr_gdn_pool_commit(pool, 1, &id, &ids(&mut [-1]), null(), null_mut()),
        KVR_STATUS_OUT_OF_RANGE
    );
    // Decoding or exporting while drafts are pending.
    assert_eq!(
        verify(pool, 1, &id, &mut Step::new(&mut rng, 1, 1)),
        KVR_STATUS_INVALID_ARG
    );
    ok(kvr_gdn_pool_commit(
        pool,
        1,
        &id,
        &ids(&mut [0]),
        null(),
        null_mut(),
    ));
    unchanged(pool, &mut st);
    // Stale handles and freed sequences.
    let mut info = kvr_gdn_cursor {
        mode: 0,
        ring_start: 0,
        buffered: 0,
        pending: 0,
    };
    assert_eq!(
        kvr_gdn_pool_get_cursor(pool, 0, 3, &mut info),
        KVR_STATUS_UNKNOWN_ID
    );
    assert_eq!(
        kvr_gdn_pool_get_cursor(pool, 0, seq, null_mut()),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_gdn_pool_seq_free(pool, 3, null_mut()),
        KVR_STATUS_UNKNOWN_ID
    );
    let stale = 0x1234usize as *mut kvr_gdn_pool;
    let mut other = -1;
    assert_eq!(
        kvr_gdn_pool_seq_add(stale, null_mut(), &mut other),
        KVR_STATUS_INVALID_ARG
    );
    unchanged(pool, &mut st);
    // The pool is full after max_seqs sequences.
    let mut n = 1;
    let mut x = 0;
    while kvr_gdn_pool_seq_add(pool, null_mut(), &mut x) == KVR_STATUS_OK {
        n += 1;
    }
    assert_eq!(n, 4);
    assert_eq!(
        kvr_gdn_pool_seq_add(pool, null_mut(), &mut x),
        KVR_STATUS_POOL_EXHAUSTED
    );
    assert_eq!(cursor(pool, 0, seq).mode, mode);
    kvr_gdn_pool_free(pool);
    assert_eq!(
        kvr_gdn_pool_seq_add(pool, null_mut(), &mut x),
        KVR_STATUS_INVALID_ARG
    );
}

/// The default threshold is off: a default pool's sequences keep a state from their first
/// token (replay mode), and both memory reports say 0. An explicit threshold still starts
/// them KV-only, until a decode would take them past it.
#[test]
fn default_pools_replay_from_the_first_token() {
    let ctx = cpu_ctx();
    let mut rng = Rng::new(3);
    for thr in [KVR_GDN_THRESHOLD_DEFAULT, KVR_GDN_THRESHOLD_OFF, 4] {
        let mut p = params();
        p.kv_only_threshold = thr;
        let on = thr > 0;
        let mode = if on {
            KVR_GDN_MODE_KV_ONLY
        } else {
            KVR_GDN_MODE_REPLAY
        };
        assert_eq!(memory(&p).kv_only_threshold, thr.max(0) as i64);
        let mut pool = null_mut();
        ok(kvr_gdn_pool_new(ctx, &p, &mut pool));
        let mut m: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
        m.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
        ok(kvr_gdn_pool_get_memory(pool, &mut m));
        assert_eq!(m.kv_only_threshold, thr.max(0) as i64, "threshold {thr}");
        let mut seq = -1;
        ok(kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq));
        assert_eq!(cursor(pool, 0, seq).mode, mode, "threshold {thr}");
        let mut idv = [seq];
        let id = ids(&mut idv);
        for token in 1..=5 {
            let mut s = Step::new(&mut rng, 1, 1);
            ok(decode_l2(pool, 0, &id, &mut s));
            assert!(s.out.iter().all(|x| x.is_finite()));
            let c = cursor(pool, 0, seq);
            // KV-only up to the threshold's 4 tokens; the fifth decode materializes.
            let want = if on && token <= 4 {
                KVR_GDN_MODE_KV_ONLY
            } else {
                KVR_GDN_MODE_REPLAY
            };
            assert_eq!(c.mode, want, "threshold {thr}, after token {token}");
            assert_eq!(cursor(pool, 1, seq).mode, mode, "layer 1 has no tokens");
        }
        kvr_gdn_pool_free(pool);
    }
    kvr_context_free(ctx);
}
