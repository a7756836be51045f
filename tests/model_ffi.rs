//! The GGUF model API through C: plans, views, sizing, pool parameters that create working
//! pools, and bad input (each a status with a message).

mod common;

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};

use common::*;
use kvreplay::ffi::*;

fn tiny(arch: &str) -> CString {
    CString::new(format!(
        "{}/tests/data/tiny-{arch}.gguf",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn open(arch: &str) -> *mut kvr_model {
    let mut m = null_mut();
    ok(kvr_model_open(tiny(arch).as_ptr(), &mut m));
    m
}

fn sizing_params(budget: i64, seq_len: i64, t: i32) -> kvr_model_sizing_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_model_sizing_params_default(p.as_mut_ptr()));
    let mut p: kvr_model_sizing_params = unsafe { p.assume_init() };
    p.budget_bytes = budget;
    p.seq_len = seq_len;
    p.spec_window = t;
    p
}

#[test]
fn plan_views_sizing_and_pools_from_a_model() {
    let m = open("qwen3next");
    let arch = unsafe { CStr::from_ptr(kvr_model_get_arch(m)) };
    assert_eq!(arch.to_str().unwrap(), "qwen3next");
    let mut info: kvr_model_info = unsafe { std::mem::zeroed() };
    info.struct_size = size_of::<kvr_model_info>() as u32;
    ok(kvr_model_get_info(m, &mut info));
    assert_eq!(
        (
            info.n_layers,
            info.n_attention_layers,
            info.n_gdn_layers,
            info.n_mamba2_layers
        ),
        (4, 1, 3, 0)
    );
    assert_eq!((info.context_length, info.embedding_length), (256, 64));
    let mut l = kvr_layer_plan::default();
    ok(kvr_model_get_layer(m, 0, &mut l));
    assert_eq!(
        (
            l.kind,
            l.k_heads,
            l.v_heads,
            l.dk,
            l.dv,
            l.conv_kernel,
            l.conv_dim
        ),
        (KVR_LAYER_GDN, 2, 4, 16, 16, 4, 128)
    );
    ok(kvr_model_get_layer(m, 3, &mut l));
    assert_eq!(
        (l.kind, l.heads, l.kv_heads, l.head_dim_k, l.head_dim_v),
        (KVR_LAYER_ATTENTION, 4, 2, 32, 32)
    );
    // Views.
    let name = CString::new("blk.0.ssm_conv1d.weight").unwrap();
    let mut ti: kvr_model_tensor_info = unsafe { std::mem::zeroed() };
    ok(kvr_model_get_tensor_info(m, name.as_ptr(), &mut ti));
    assert_eq!(
        (ti.ggml_type, ti.ndim, ti.shape[0], ti.shape[1], ti.bytes),
        (30, 2, 128, 4, 128 * 4 * 2)
    );
    let mut t: kvr_tensor = unsafe { std::mem::zeroed() };
    ok(kvr_model_get_tensor(
        m,
        name.as_ptr(),
        2,
        [128i64, 4].as_ptr(),
        &mut t,
    ));
    assert_eq!(
        (
            t.dtype,
            t.device,
            t.ndim,
            t.shape[0],
            t.shape[1],
            t.strides[0]
        ),
        (KVR_DTYPE_BF16, KVR_DEVICE_HOST, 2, 128, 4, 4)
    );
    // A view can be copied like any host tensor (here: converted to f32 on a CPU context).
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let mut f32s = vec![0f32; 512];
    let dst = tensor(
        f32s.as_mut_ptr() as *mut _,
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[128, 4],
        &[4, 1],
    );
    ok(kvr_tensor_copy(ctx, &t, &dst, null_mut()));
    assert!(f32s.iter().all(|x| x.abs() <= 1.0) && f32s.iter().any(|&x| x != 0.0));
    // Sizing and pools built from it.
    let p = sizing_params(64 << 20, 100, 4);
    let mut s: kvr_model_sizing = unsafe { std::mem::zeroed() };
    s.struct_size = size_of::<kvr_model_sizing>() as u32;
    ok(kvr_model_compute_sizing(m, &p, &mut s));
    assert_eq!(
        (
            s.n_attention_layers,
            s.n_gdn_layers,
            s.pages_per_seq,
            s.kv_bytes_per_token
        ),
        (1, 3, 7, 256)
    );
    assert!(
        s.max_seqs[0] > s.max_seqs[1],
        "a ring fits more sequences than snapshots"
    );
    let mut kp = std::mem::MaybeUninit::uninit();
    ok(kvr_model_get_kv_pool_params(m, &p, kp.as_mut_ptr()));
    let kp: kvr_kv_pool_params = unsafe { kp.assume_init() };
    assert_eq!(
        (
            kp.n_layers,
            kp.n_kv_heads,
            kp.head_dim,
            kp.page_size,
            kp.max_seqs as i64
        ),
        (1, 2, 32, 16, s.max_seqs[0])
    );
    let mut kv = null_mut();
    ok(kvr_kv_pool_new(ctx, &kp, &mut kv));
    let mut gp = std::mem::MaybeUninit::uninit();
    ok(kvr_model_get_gdn_pool_params(m, &p, gp.as_mut_ptr()));
    let gp: kvr_gdn_pool_params = unsafe { gp.assume_init() };
    assert_eq!(
        (
            gp.n_layers,
            gp.n_k_heads,
            gp.n_v_heads,
            gp.dk,
            gp.dv,
            gp.max_drafts,
            gp.conv_dim
        ),
        (3, 2, 4, 16, 16, 4, 128)
    );
    let mut gdn = null_mut();
    ok(kvr_gdn_pool_new(ctx, &gp, &mut gdn));
    let mut mem: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
    mem.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
    ok(kvr_gdn_pool_get_memory(gdn, &mut mem));
    assert_eq!(
        mem.state_bytes + mem.ring_bytes + mem.conv_bytes,
        s.state_bytes_per_seq + s.ring_bytes_per_seq
    );
    kvr_gdn_pool_free(gdn);
    kvr_kv_pool_free(kv);
    kvr_context_free(ctx);
    kvr_model_free(m);
}

#[test]
fn bad_input_is_a_status() {
    let mut m = null_mut();
    assert_eq!(kvr_model_open(null(), &mut m), KVR_STATUS_NULL_ARG);
    assert_eq!(
        kvr_model_open(tiny("llama").as_ptr(), null_mut()),
        KVR_STATUS_NULL_ARG
    );
    let missing = CString::new("/nonexistent/model.gguf").unwrap();
    assert_eq!(
        kvr_model_open(missing.as_ptr(), &mut m),
        KVR_STATUS_IO_ERROR
    );
    assert!(
        last_error().contains("/nonexistent/model.gguf"),
        "{}",
        last_error()
    );
    // A truncated file.
    let bytes = std::fs::read(tiny("mamba2").to_str().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("kvr-trunc-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(
        kvr_model_open(cpath.as_ptr(), &mut m),
        KVR_STATUS_MALFORMED_FILE
    );
    assert!(last_error().contains("past the end"), "{}", last_error());
    let _ = std::fs::remove_file(&path);
    assert!(m.is_null());
    // Calls on a model.
    let m = open("mamba2");
    let mut l = kvr_layer_plan::default();
    ok(kvr_model_get_layer(m, 1, &mut l));
    assert_eq!(
        (
            l.kind,
            l.ssm_heads,
            l.ssm_head_dim,
            l.ssm_groups,
            l.ssm_state
        ),
        (KVR_LAYER_MAMBA2, 8, 16, 2, 16)
    );
    assert_eq!(kvr_model_get_layer(m, 2, &mut l), KVR_STATUS_OUT_OF_RANGE);
    assert_eq!(kvr_model_get_layer(m, -1, &mut l), KVR_STATUS_OUT_OF_RANGE);
    assert_eq!(kvr_model_get_layer(m, 0, null_mut()), KVR_STATUS_NULL_ARG);
    let mut t: kvr_tensor = unsafe { std::mem::zeroed() };
    let nope = CString::new("blk.9.ssm_a").unwrap();
    assert_eq!(
        kvr_model_get_tensor(m, nope.as_ptr(), 0, null(), &mut t),
        KVR_STATUS_UNKNOWN_ID
    );
    let q8 = CString::new("output.weight").unwrap();
    assert_eq!(
        kvr_model_get_tensor(m, q8.as_ptr(), 0, null(), &mut t),
        KVR_STATUS_UNSUPPORTED
    );
    assert!(last_error().contains("Q8_0"), "{}", last_error());
    let a = CString::new("blk.0.ssm_a").unwrap();
    assert_eq!(
        kvr_model_get_tensor(m, a.as_ptr(), 1, [9i64].as_ptr(), &mut t),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        kvr_model_get_tensor(m, a.as_ptr(), 1, null(), &mut t),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_model_get_tensor(m, a.as_ptr(), -1, null(), &mut t),
        KVR_STATUS_INVALID_ARG
    );
    ok(kvr_model_get_tensor(
        m,
        a.as_ptr(),
        1,
        [8i64].as_ptr(),
        &mut t,
    ));
    assert_eq!(
        kvr_model_get_tensor(m, null(), 0, null(), &mut t),
        KVR_STATUS_NULL_ARG
    );
    // Sizing: no attention layers and no GDN layers in mamba2.
    let p = sizing_params(1 << 30, 128, 2);
    let mut kp = std::mem::MaybeUninit::uninit();
    assert_eq!(
        kvr_model_get_kv_pool_params(m, &p, kp.as_mut_ptr()),
        KVR_STATUS_UNSUPPORTED
    );
    let mut gp = std::mem::MaybeUninit::uninit();
    assert_eq!(
        kvr_model_get_gdn_pool_params(m, &p, gp.as_mut_ptr()),
        KVR_STATUS_UNSUPPORTED
    );
    let mut bad = p;
    bad.spec_window = 9;
    let mut s: kvr_model_sizing = unsafe { std::mem::zeroed() };
    s.struct_size = size_of::<kvr_model_sizing>() as u32;
    assert_eq!(
        kvr_model_compute_sizing(m, &bad, &mut s),
        KVR_STATUS_OUT_OF_RANGE
    );
    bad = p;
    bad.budget_bytes = -1;
    assert_eq!(
        kvr_model_compute_sizing(m, &bad, &mut s),
        KVR_STATUS_INVALID_ARG
    );
    bad = p;
    bad.kv_dtype = KVR_DTYPE_I32;
    assert_eq!(
        kvr_model_compute_sizing(m, &bad, &mut s),
        KVR_STATUS_DTYPE_MISMATCH
    );
    assert_eq!(
        kvr_model_compute_sizing(m, null(), &mut s),
        KVR_STATUS_NULL_ARG
    );
    let q = open("qwen3next");
    let tiny_budget = sizing_params(100, 128, 2);
    assert_eq!(
        kvr_model_get_kv_pool_params(q, &tiny_budget, kp.as_mut_ptr()),
        KVR_STATUS_OUT_OF_RANGE
    );
    kvr_model_free(q);
    // Stale handles.
    kvr_model_free(m);
    kvr_model_free(null_mut());
    assert_eq!(kvr_model_get_layer(m, 0, &mut l), KVR_STATUS_INVALID_ARG);
    assert!(kvr_model_get_arch(m).is_null());
}

fn mamba2_params_sentinel() -> kvr_mamba2_pool_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_mamba2_pool_params_default(p.as_mut_ptr()));
    let mut p: kvr_mamba2_pool_params = unsafe { p.assume_init() };
    p.n_layers = 12345;
    p.d_state = -7;
    p
}

fn bytes_of<T>(v: &T) -> Vec<u8> {
    // SAFETY: a plain #[repr(C)] struct, read as bytes.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()).to_vec() }
}

/// A host f32 view of a 1-D tensor of the model.
fn weights(m: *mut kvr_model, name: &str, n: i64) -> (kvr_tensor, Vec<f32>) {
    let name = CString::new(name).unwrap();
    let mut t: kvr_tensor = unsafe { std::mem::zeroed() };
    ok(kvr_model_get_tensor(
        m,
        name.as_ptr(),
        1,
        [n].as_ptr(),
        &mut t,
    ));
    assert_eq!(t.dtype, KVR_DTYPE_F32);
    let v = unsafe { std::slice::from_raw_parts(t.data as *const f32, n as usize) }.to_vec();
    (t, v)
}

/// The sizing and the Mamba-2 pool parameters of `m` under `p`.
fn mamba2_sizing(
    m: *mut kvr_model,
    p: &kvr_model_sizing_params,
) -> (kvr_model_sizing, kvr_mamba2_pool_params) {
    let mut s: kvr_model_sizing = unsafe { std::mem::zeroed() };
    s.struct_size = size_of::<kvr_model_sizing>() as u32;
    ok(kvr_model_compute_sizing(m, p, &mut s));
    let mut mp = mamba2_params_sentinel();
    ok(kvr_model_get_mamba2_pool_params(m, p, &mut mp));
    assert_eq!(mp.struct_size as usize, size_of::<kvr_mamba2_pool_params>());
    assert!(mp.states.is_null());
    (s, mp)
}

/// Layers, heads, head dim, groups, state dim, ring, drafts.
fn mamba2_shape(mp: &kvr_mamba2_pool_params) -> [i32; 7] {
    [
        mp.n_layers,
        mp.n_heads,
        mp.head_dim,
        mp.n_groups,
        mp.d_state,
        mp.ring_len,
        mp.max_drafts,
    ]
}

/// A CPU pool created with `mp`, and its memory per sequence.
fn mamba2_pool(
    ctx: *mut kvr_context,
    mp: &kvr_mamba2_pool_params,
) -> (*mut kvr_mamba2_pool, kvr_gdn_pool_memory) {
    let mut pool = null_mut();
    ok(kvr_mamba2_pool_new(ctx, mp, &mut pool));
    let mut mem: kvr_gdn_pool_memory = unsafe { std::mem::zeroed() };
    mem.struct_size = size_of::<kvr_gdn_pool_memory>() as u32;
    ok(kvr_mamba2_pool_get_memory(pool, &mut mem));
    (pool, mem)
}

#[test]
fn mamba2_pool_params_from_a_model_decode() {
    for arch in ["mamba2", "nemotron_h", "granitehybrid"] {
        let m = open(arch);
        let p = sizing_params(1 << 20, 100, 2);
        let (s, mp) = mamba2_sizing(m, &p);
        // Two Mamba-2 layers in each tiny model (blk.0 is one of them).
        assert_eq!((s.n_gdn_layers, s.n_mamba2_layers), (0, 2), "{arch}");
        assert_eq!(mamba2_shape(&mp), [2, 8, 16, 2, 16, 16, 2], "{arch}");
        assert_eq!(
            (
                mp.conv_dim,
                mp.conv_kernel,
                mp.layout,
                mp.max_seqs as i64,
                mp.kv_only_threshold
            ),
            (
                192,
                4,
                KVR_STATE_V_MAJOR,
                s.max_seqs[KVR_MODEL_LAYOUT_PAGED_RING as usize],
                KVR_GDN_THRESHOLD_DEFAULT // off
            ),
            "{arch}"
        );
        // The pool these parameters create takes what the sizing says.
        let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
        let (pool, mem) = mamba2_pool(ctx, &mp);
        assert_eq!(mem.total_bytes, s.mamba2_bytes_per_seq, "{arch}");
        assert_eq!(
            mem.total_bytes,
            s.state_bytes_per_seq + s.ring_bytes_per_seq,
            "{arch}"
        );
        assert_eq!(mem.snapshot_bytes, 0);
        assert_eq!(
            mem.kv_only_threshold, 0,
            "{arch}: pools planned from a model use 0"
        );
        two_decodes(m, arch, pool, KVR_GDN_MODE_REPLAY);
        kvr_mamba2_pool_free(pool);
        // The same decodes through KV-only mode, on request: min(d_state, what a head's
        // state memory holds) = min(16, 1024 / 132) = 7 tokens.
        let mut kp = mp;
        kp.kv_only_threshold =
            kv_only_threshold(mp.d_state, mp.head_dim, mp.state_dtype, mp.entry_dtype);
        assert_eq!(kp.kv_only_threshold, 7);
        let (pool, mem) = mamba2_pool(ctx, &kp);
        assert_eq!(mem.kv_only_threshold, 7);
        assert_eq!(mem.total_bytes, s.mamba2_bytes_per_seq, "{arch}");
        two_decodes(m, arch, pool, KVR_GDN_MODE_KV_ONLY);
        kvr_mamba2_pool_free(pool);
        kvr_context_free(ctx);
        kvr_model_free(m);
    }
}

/// Two decode steps on two new sequences of `pool` (the first Mamba-2 layer of `m`), with
/// the model's A, D and dt_bias, against a direct f64 recurrence; the sequences stay in
/// `mode`.
fn two_decodes(m: *mut kvr_model, arch: &str, pool: *mut kvr_mamba2_pool, mode: kvr_gdn_mode) {
    let layer = 0;
    let (h, pd, g, n, cd, b) = (8usize, 16usize, 2usize, 16usize, 192usize, 2usize);
    let (a_t, a) = weights(m, &format!("blk.{layer}.ssm_a"), h as i64);
    let (d_t, d) = weights(m, &format!("blk.{layer}.ssm_d"), h as i64);
    let (bias_t, bias) = weights(m, &format!("blk.{layer}.ssm_dt.bias"), h as i64);
    let mut seqs = [0i32; 2];
    for s in &mut seqs {
        ok(kvr_mamba2_pool_seq_add(pool, null_mut(), s));
        assert_eq!(mamba2_mode(pool, layer, *s), mode, "{arch}");
    }
    let mut rng = Rng::new(7);
    let mut state = vec![0f64; b * h * pd * n];
    let host = |v: &mut Vec<f32>, shape: &[i64]| {
        tensor(
            v.as_mut_ptr() as *mut _,
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            shape,
            &contiguous_strides(shape),
        )
    };
    let mut ids = seqs.to_vec();
    let ids_t = tensor(
        ids.as_mut_ptr() as *mut _,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[b as i64],
        &[1],
    );
    for _step in 0..2 {
        let mut x = rng.vec(b * h * pd, -1.0, 1.0);
        let mut dt = rng.vec(b * h, -1.0, 1.0);
        let mut bm = rng.vec(b * g * n, -1.0, 1.0);
        let mut cm = rng.vec(b * g * n, -1.0, 1.0);
        let mut conv = rng.vec(b * cd, -1.0, 1.0);
        let mut out = vec![0f32; b * h * pd];
        let (x_t, dt_t, b_t, c_t, conv_t, out_t) = (
            host(&mut x, &[b as i64, h as i64, pd as i64]),
            host(&mut dt, &[b as i64, h as i64]),
            host(&mut bm, &[b as i64, g as i64, n as i64]),
            host(&mut cm, &[b as i64, g as i64, n as i64]),
            host(&mut conv, &[b as i64, cd as i64]),
            host(&mut out, &[b as i64, h as i64, pd as i64]),
        );
        let io = kvr_mamba2_tensors {
            seq_ids: &ids_t,
            x: &x_t,
            dt: &dt_t,
            a: &a_t,
            b: &b_t,
            c: &c_t,
            d: &d_t,
            z: null(),
            dt_bias: &bias_t,
            conv_in: &conv_t,
            out: &out_t,
        };
        ok(kvr_mamba2_pool_decode(pool, layer, &io, null(), null_mut()));
        let mut worst = 0f64;
        for r in 0..b {
            for hh in 0..h {
                let gg = hh / (h / g);
                let v = dt[r * h + hh] as f64 + bias[hh] as f64;
                let dtp = if v > 20.0 { v } else { v.exp().ln_1p() };
                let decay = (a[hh] as f64 * dtp).exp();
                for p_ in 0..pd {
                    let xv = x[(r * h + hh) * pd + p_] as f64;
                    let mut y = d[hh] as f64 * xv;
                    for k in 0..n {
                        let st = &mut state[((r * h + hh) * pd + p_) * n + k];
                        *st = decay * *st + dtp * xv * bm[(r * g + gg) * n + k] as f64;
                        y += *st * cm[(r * g + gg) * n + k] as f64;
                    }
                    let got = out[(r * h + hh) * pd + p_] as f64;
                    worst = worst.max((got - y).abs() / (1.0 + y.abs()));
                }
            }
        }
        assert!(worst < 1e-4, "{arch}: decode off by {worst}");
        for s in seqs {
            assert_eq!(mamba2_mode(pool, layer, s), mode, "{arch}");
        }
    }
}

/// The mode of sequence `seq` of a Mamba-2 pool in `layer`.
fn mamba2_mode(pool: *const kvr_mamba2_pool, layer: i32, seq: i32) -> kvr_gdn_mode {
    let mut c = kvr_gdn_cursor {
        mode: -1,
        ring_start: -1,
        buffered: -1,
        pending: -1,
    };
    ok(kvr_mamba2_pool_get_cursor(pool, layer, seq, &mut c));
    c.mode
}

/// The default KV-only threshold is off for Mamba-2 pools too: a default pool's sequences
/// replay from their first token and the pool reports 0; an explicit threshold still
/// starts them KV-only, until a decode would take them past it.
#[test]
fn mamba2_default_pools_replay_from_the_first_token() {
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let host = |v: &mut Vec<f32>, shape: &[i64]| {
        tensor(
            v.as_mut_ptr() as *mut _,
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            shape,
            &contiguous_strides(shape),
        )
    };
    let mut rng = Rng::new(5);
    for thr in [KVR_GDN_THRESHOLD_DEFAULT, KVR_GDN_THRESHOLD_OFF, 3] {
        let mut p = std::mem::MaybeUninit::uninit();
        ok(kvr_mamba2_pool_params_default(p.as_mut_ptr()));
        let mut p: kvr_mamba2_pool_params = unsafe { p.assume_init() };
        assert_eq!(p.kv_only_threshold, KVR_GDN_THRESHOLD_DEFAULT);
        (p.n_layers, p.n_heads, p.head_dim, p.n_groups, p.d_state) = (1, 2, 8, 1, 8);
        p.max_seqs = 2;
        p.kv_only_threshold = thr;
        let on = thr > 0;
        if on {
            // min(d_state, what a head's state memory holds): min(8, 256 / 68).
            assert_eq!(
                thr,
                kv_only_threshold(p.d_state, p.head_dim, p.state_dtype, p.entry_dtype)
            );
        }
        let (pool, mem) = mamba2_pool(ctx, &p);
        assert_eq!(mem.kv_only_threshold, thr.max(0) as i64, "threshold {thr}");
        let mut seq = -1;
        ok(kvr_mamba2_pool_seq_add(pool, null_mut(), &mut seq));
        let mode = |token: i32| {
            if on && token <= thr {
                KVR_GDN_MODE_KV_ONLY
            } else {
                KVR_GDN_MODE_REPLAY
            }
        };
        assert_eq!(mamba2_mode(pool, 0, seq), mode(0), "threshold {thr}");
        let mut a = vec![-0.5f32, -1.0];
        let a_t = host(&mut a, &[2]);
        for token in 1..=4 {
            let mut ids = vec![seq];
            let ids_t = tensor(
                ids.as_mut_ptr() as *mut _,
                KVR_DTYPE_I32,
                KVR_DEVICE_HOST,
                &[1],
                &[1],
            );
            let mut x = rng.vec(16, -1.0, 1.0);
            let mut dt = rng.vec(2, -1.0, 1.0);
            let mut bm = rng.vec(8, -1.0, 1.0);
            let mut cm = rng.vec(8, -1.0, 1.0);
            let mut out = vec![f32::NAN; 16];
            let (x_t, dt_t, b_t, c_t, out_t) = (
                host(&mut x, &[1, 2, 8]),
                host(&mut dt, &[1, 2]),
                host(&mut bm, &[1, 1, 8]),
                host(&mut cm, &[1, 1, 8]),
                host(&mut out, &[1, 2, 8]),
            );
            let io = kvr_mamba2_tensors {
                seq_ids: &ids_t,
                x: &x_t,
                dt: &dt_t,
                a: &a_t,
                b: &b_t,
                c: &c_t,
                d: null(),
                z: null(),
                dt_bias: null(),
                conv_in: null(),
                out: &out_t,
            };
            ok(kvr_mamba2_pool_decode(pool, 0, &io, null(), null_mut()));
            assert!(out.iter().all(|v| v.is_finite()));
            assert_eq!(
                mamba2_mode(pool, 0, seq),
                mode(token),
                "threshold {thr}, after token {token}"
            );
        }
        kvr_mamba2_pool_free(pool);
    }
    kvr_context_free(ctx);
}

/// Nemotron-H-8B's Mamba-2 shape (head dim 64, state dim 128): the getter puts each in its
/// field, and the pool takes what the sizing says.
#[test]
fn mamba2_pool_params_of_the_nemotron_h_shape() {
    let bytes = common::gguf::nemotron_h_like().build();
    let path = std::env::temp_dir().join(format!("kvr-nemotron-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let cpath = CString::new(path.to_str().unwrap()).unwrap();
    let mut m = null_mut();
    ok(kvr_model_open(cpath.as_ptr(), &mut m));
    let _ = std::fs::remove_file(&path);
    let mut p = sizing_params(40 << 30, 8192, 4);
    p.state_dtype = KVR_DTYPE_BF16;
    p.ring_len = 8;
    let (s, mut mp) = mamba2_sizing(m, &p);
    assert_eq!(mamba2_shape(&mp), [2, 128, 64, 8, 128, 8, 4]);
    assert_eq!(
        (
            mp.conv_dim,
            mp.conv_kernel,
            mp.state_dtype,
            mp.max_seqs as i64
        ),
        (10240, 4, KVR_DTYPE_BF16, s.max_seqs[0])
    );
    mp.max_seqs = 1;
    let ctx = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let (pool, mem) = mamba2_pool(ctx, &mp);
    assert_eq!(mem.total_bytes, s.mamba2_bytes_per_seq);
    assert_eq!(mem.state_bytes, s.state_bytes_per_seq);
    assert_eq!(mem.ring_bytes + mem.conv_bytes, s.ring_bytes_per_seq);
    kvr_mamba2_pool_free(pool);
    kvr_context_free(ctx);
    kvr_model_free(m);
}

#[test]
fn mamba2_pool_params_bad_input() {
    let m = open("mamba2");
    let p = sizing_params(1 << 20, 128, 2);
    let sentinel = mamba2_params_sentinel();
    let mut out = sentinel;
    let check = |model: *const kvr_model,
                 params: *const kvr_model_sizing_params,
                 out: *mut kvr_mamba2_pool_params,
                 want: kvr_status,
                 msg: &str| {
        assert_eq!(
            kvr_model_get_mamba2_pool_params(model, params, out),
            want,
            "{msg}: {}",
            last_error()
        );
        let e = last_error();
        assert!(
            e.contains("kvr_model_get_mamba2_pool_params") && e.contains(msg),
            "{msg}: {e}"
        );
    };
    check(null(), &p, &mut out, KVR_STATUS_NULL_ARG, "NULL");
    check(m, null(), &mut out, KVR_STATUS_NULL_ARG, "params");
    check(m, &p, null_mut(), KVR_STATUS_NULL_ARG, "out");
    let mut small = p;
    small.struct_size = 8;
    check(m, &small, &mut out, KVR_STATUS_INVALID_ARG, "struct_size");
    let mut bad = p;
    bad.spec_window = 9;
    check(m, &bad, &mut out, KVR_STATUS_OUT_OF_RANGE, "spec_window");
    bad = p;
    bad.state_dtype = KVR_DTYPE_F16;
    check(m, &bad, &mut out, KVR_STATUS_DTYPE_MISMATCH, "state_dtype");
    bad = p;
    bad.budget_bytes = 100;
    check(
        m,
        &bad,
        &mut out,
        KVR_STATUS_OUT_OF_RANGE,
        "not one sequence fits",
    );
    // Models without Mamba-2 layers: attention only, GDN + attention.
    for arch in ["llama", "qwen3next"] {
        let q = open(arch);
        check(q, &p, &mut out, KVR_STATUS_UNSUPPORTED, "no Mamba-2 layers");
        kvr_model_free(q);
        // A freed handle.
        check(
            q,
            &p,
            &mut out,
            KVR_STATUS_INVALID_ARG,
            "not a live kvr_model",
        );
    }
    assert_eq!(
        bytes_of(&out),
        bytes_of(&sentinel),
        "a failed call wrote *out"
    );
    // And the other way: no GDN pool from a Mamba-2 model.
    let mut gp = std::mem::MaybeUninit::<kvr_gdn_pool_params>::uninit();
    assert_eq!(
        kvr_model_get_gdn_pool_params(m, &p, gp.as_mut_ptr()),
        KVR_STATUS_UNSUPPORTED
    );
    assert!(last_error().contains("no Gated DeltaNet layers"));
    kvr_model_free(m);
}
