//! `kvr_context_gdn_recurrent` on the CPU backend, through the C API, against an
//! independent f64 transcription of llama.cpp's CPU `GGML_OP_GATED_DELTA_NET`: decode and
//! multi-token steps, snapshots (fewer and more slots than tokens), both head maps, L2
//! norm, scale, in-place states, strided q/k and padded states, 16-bit inputs, work split
//! over several calls (and over threads, as ggml's workers call it), and bad input (each
//! a status with a message, nothing written).

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::recur::*;
use common::*;
use kvreplay::ffi::*;

fn cpu_ctx(threads: i32) -> *mut kvr_context {
    let mut p = std::mem::MaybeUninit::<kvr_context_params>::uninit();
    ok(kvr_context_params_default(p.as_mut_ptr()));
    // SAFETY: filled above.
    let mut p = unsafe { p.assume_init() };
    p.backend = KVR_BACKEND_CPU;
    p.n_threads = threads;
    let mut ctx = null_mut();
    ok(kvr_context_new(&p, &mut ctx));
    ctx
}

fn run_case(ctx: *const kvr_context, c: &Case) {
    let x = random_data(c);
    let got = run(ctx, c, &x, &mut HostMem::default());
    check(c, &x, &got, tol(c));
}

#[test]
fn matches_the_reference_across_shapes_and_options() {
    let ctx = cpu_ctx(0);
    let mut cases = Vec::new();
    // Decode at llama.cpp's tiny-model and Qwen3-Next-like shapes (scaled down).
    cases.push(Case::new(1, 1, 2, 2, 128));
    cases.push(Case::new(3, 1, 4, 8, 32));
    // Prefill / verify: several tokens, snapshots fewer and more than the tokens.
    let mut c = Case::new(2, 5, 2, 4, 16);
    c.snaps = 3;
    cases.push(c.clone());
    c.snaps = 8;
    c.state_out = false;
    cases.push(c.clone());
    // Tiled heads (llama.cpp's broadcast), L2 norm, explicit scale, dv != dk.
    let mut c = Case::new(2, 3, 2, 6, 32);
    c.tiled = true;
    c.l2norm = true;
    c.scale = 0.3;
    c.dv = 24;
    cases.push(c);
    // In place, strided q/k, padded state rows.
    let mut c = Case::new(2, 4, 1, 2, 32);
    c.in_place = true;
    c.permuted = true;
    c.padded_state = true;
    c.snaps = 2;
    cases.push(c);
    // 16-bit inputs and outputs.
    for dtype in [KVR_DTYPE_F16, KVR_DTYPE_BF16] {
        let mut c = Case::new(2, 2, 2, 4, 32);
        c.dtype = dtype;
        c.seed = 7;
        cases.push(c);
    }
    for c in &cases {
        run_case(ctx, c);
    }
    kvr_context_free(ctx);
}

#[test]
fn work_items_split_over_calls_and_threads() {
    // Each call computes only its items; together they make the whole step. With a
    // one-thread context each call runs on its caller, as ggml's workers use it.
    let ctx = cpu_ctx(1);
    let mut c = Case::new(3, 3, 2, 4, 32);
    c.snaps = 2;
    c.splits = vec![(0, 5), (5, 5), (5, 12)];
    run_case(ctx, &c);
    // Part of the items only: the rest stays untouched (in place: the input state).
    c.in_place = true;
    c.splits = vec![(2, 7)];
    run_case(ctx, &c);
    // item_end -1 with a start: to the end.
    c.splits = vec![(0, 4), (4, -1)];
    run_case(ctx, &c);

    // From several threads at once on disjoint items.
    let c = Case::new(4, 2, 2, 8, 32);
    let x = random_data(&c);
    let mut mem = HostMem::default();
    let t = bind(&c, &x, &mut mem);
    let n = (c.b * c.hv) as i64;
    let ctx_addr = ctx as usize;
    /// The descriptors, shared by the threads (each writes only its items).
    struct Shared<'a>(&'a Bound);
    // SAFETY: the threads only read the descriptors; the memory they point at is written
    // on disjoint items.
    unsafe impl Sync for Shared<'_> {}
    let shared = Shared(&t);
    std::thread::scope(|s| {
        for part in 0..4i64 {
            let t = &shared;
            let c = &c;
            s.spawn(move || {
                let mut p = params(c);
                p.item_begin = part * n / 4;
                p.item_end = (part + 1) * n / 4;
                let st = call(ctx_addr as *const kvr_context, t.0, &p, null_mut());
                assert_eq!(st, KVR_STATUS_OK, "{}", last_error());
            });
        }
    });
    let (out, state, snaps) = read_back(&c, &t, &mem);
    check(
        &c,
        &x,
        &Got {
            out,
            state,
            snaps,
            status: vec![KVR_STATUS_OK],
        },
        tol(&c),
    );
    kvr_context_free(ctx);
}

/// Runs a modified call and checks its status and that no output changed.
fn refused(
    ctx: *const kvr_context,
    c: &Case,
    want: kvr_status,
    what: &str,
    edit: impl FnOnce(&mut Bound, &mut kvr_gdn_recurrent_params),
) {
    let x = random_data(c);
    let mut mem = HostMem::default();
    let t = bind(c, &x, &mut mem);
    let mut e = t.clone();
    let mut p = params(c);
    edit(&mut e, &mut p);
    let st = call(ctx, &e, &p, null_mut());
    assert_eq!(
        st,
        want,
        "{what}: got {} ({})",
        status_name(st),
        last_error()
    );
    assert!(!last_error().is_empty(), "{what}: no message");
    let (out, state, snaps) = read_back(c, &t, &mem);
    assert!(out.iter().all(|&v| v == SENTINEL), "{what}: out written");
    if !c.in_place {
        assert!(
            state.iter().all(|&v| v == SENTINEL),
            "{what}: state written"
        );
    }
    assert!(
        snaps.iter().all(|&v| v == SENTINEL),
        "{what}: snapshots written"
    );
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    let ctx = cpu_ctx(0);
    let mut c = Case::new(2, 2, 2, 4, 32);
    c.snaps = 2;
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "k shape", |t, _| {
        t.k.shape[2] = 1
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "v rank", |t, _| {
        t.v.ndim = 3
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "g shape", |t, _| {
        t.g.shape[1] = 1
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "state shape", |t, _| {
        t.state_in.shape[3] = 16
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "snapshot rank", |t, _| {
        t.snaps.as_mut().unwrap().ndim = 4
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "Hv % Hq", |t, _| {
        for x in [&mut t.q, &mut t.k] {
            x.shape[2] = 3;
        }
    });
    refused(ctx, &c, KVR_STATUS_DTYPE_MISMATCH, "bf16 state", |t, _| {
        t.state_in.dtype = KVR_DTYPE_BF16;
        t.state_in.strides = [0; KVR_MAX_DIMS];
        t.state_in.strides[..4].copy_from_slice(&[256, 64, 2, 1]);
    });
    refused(ctx, &c, KVR_STATUS_DTYPE_MISMATCH, "i32 q", |t, _| {
        t.q.dtype = KVR_DTYPE_I32
    });
    refused(ctx, &c, KVR_STATUS_NULL_ARG, "no output state", |t, _| {
        t.state_out = None;
        t.snaps = None;
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "out overlaps q", |t, _| {
        t.out.data = t.q.data
    });
    refused(
        ctx,
        &c,
        KVR_STATUS_INVALID_ARG,
        "snapshots overlap state_out",
        |t, _| {
            t.snaps.as_mut().unwrap().data = t.state_out.unwrap().data;
        },
    );
    refused(
        ctx,
        &c,
        KVR_STATUS_INVALID_ARG,
        "state_out a shifted state_in",
        |t, _| {
            let mut s = t.state_in;
            s.data = (s.data as *mut f32).wrapping_add(1) as *mut c_void;
            s.shape[3] = 32;
            t.state_out = Some(s);
        },
    );
    refused(
        ctx,
        &c,
        KVR_STATUS_INVALID_ARG,
        "out writes one element twice",
        |t, _| t.out.strides[1] = 0,
    );
    refused(
        ctx,
        &c,
        KVR_STATUS_OUT_OF_RANGE,
        "items past B * Hv",
        |_, p| p.item_end = 9,
    );
    refused(
        ctx,
        &c,
        KVR_STATUS_OUT_OF_RANGE,
        "negative item_begin",
        |_, p| p.item_begin = -1,
    );
    refused(
        ctx,
        &c,
        KVR_STATUS_OUT_OF_RANGE,
        "begin after end",
        |_, p| {
            p.item_begin = 5;
            p.item_end = 3;
        },
    );
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "head map", |_, p| {
        p.head_map = 7
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "scale", |_, p| {
        p.scale = f32::INFINITY
    });
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "struct_size", |_, p| {
        p.struct_size = 4
    });
    refused(
        ctx,
        &c,
        KVR_STATUS_INVALID_ARG,
        "CUDA tensors on a CPU context",
        |t, _| t.v.device = KVR_DEVICE_CUDA,
    );
    refused(ctx, &c, KVR_STATUS_INVALID_ARG, "empty T", |t, _| {
        for x in [
            &mut t.q,
            &mut t.k,
            &mut t.v,
            &mut t.out,
            &mut t.g,
            &mut t.beta,
        ] {
            x.shape[1] = 0;
        }
    });

    // NULL and dead handles, NULL required tensors.
    let x = random_data(&c);
    let mut mem = HostMem::default();
    let t = bind(&c, &x, &mut mem);
    let p = params(&c);
    let st = kvr_context_gdn_recurrent(
        null(),
        &t.q,
        &t.k,
        &t.v,
        &t.g,
        &t.beta,
        &t.state_in,
        null(),
        t.snaps.as_ref().unwrap(),
        &t.out,
        &p,
        null_mut(),
    );
    assert_eq!(st, KVR_STATUS_NULL_ARG);
    let st = kvr_context_gdn_recurrent(
        ctx,
        &t.q,
        null(),
        &t.v,
        &t.g,
        &t.beta,
        &t.state_in,
        null(),
        t.snaps.as_ref().unwrap(),
        &t.out,
        &p,
        null_mut(),
    );
    assert_eq!(st, KVR_STATUS_NULL_ARG);
    // NULL params: the defaults.
    let st = kvr_context_gdn_recurrent(
        ctx,
        &t.q,
        &t.k,
        &t.v,
        &t.g,
        &t.beta,
        &t.state_in,
        t.state_out.as_ref().unwrap(),
        t.snaps.as_ref().unwrap(),
        &t.out,
        null(),
        null_mut(),
    );
    assert_eq!(st, KVR_STATUS_OK, "{}", last_error());
    let dead = cpu_ctx(1);
    kvr_context_free(dead);
    assert_eq!(call(dead, &t, &p, null_mut()), KVR_STATUS_INVALID_ARG);
    assert_eq!(
        kvr_gdn_recurrent_params_default(null_mut()),
        KVR_STATUS_NULL_ARG
    );
    kvr_context_free(ctx);
}
