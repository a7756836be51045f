//! The KV pool through the C API: parameters, lifecycle, and bad input (each a status
//! with a message, the pool unchanged).

mod common;

use std::ptr::{null, null_mut};

use common::*;
use kvreplay::ffi::*;

fn cpu_ctx() -> *mut kvr_context {
    context(KVR_BACKEND_CPU, null_mut()).unwrap()
}

fn params(layers: i32, heads: i32, dim: i32, page: i32, pages: i64) -> kvr_kv_pool_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_pool_params_default(p.as_mut_ptr()));
    let mut p: kvr_kv_pool_params = unsafe { p.assume_init() };
    p.n_layers = layers;
    p.n_kv_heads = heads;
    p.head_dim = dim;
    p.page_size = page;
    p.capacity_pages = pages;
    p.dtype = KVR_DTYPE_F32;
    p
}

fn stats(pool: *const kvr_kv_pool) -> kvr_kv_pool_stats {
    let mut s: kvr_kv_pool_stats = unsafe { std::mem::zeroed() };
    s.struct_size = size_of::<kvr_kv_pool_stats>() as u32;
    ok(kvr_kv_pool_get_stats(pool, &mut s));
    s
}

fn same(a: &kvr_kv_pool_stats, b: &kvr_kv_pool_stats) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

#[test]
fn pool_params_and_lifecycle() {
    let ctx = cpu_ctx();
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_pool_params_default(p.as_mut_ptr()));
    let d: kvr_kv_pool_params = unsafe { p.assume_init() };
    assert_eq!(
        (d.page_size, d.dtype, d.max_seqs, d.max_seq_len),
        (16, KVR_DTYPE_F16, 256, 131072)
    );
    assert!(d.layers.is_null());
    assert_eq!(kvr_kv_pool_params_default(null_mut()), KVR_STATUS_NULL_ARG);
    let sentinel = 0x77usize as *mut kvr_kv_pool;
    type Edit = Box<dyn Fn(&mut kvr_kv_pool_params)>;
    let bad: Vec<(Edit, kvr_status, &str)> = vec![
        (
            Box::new(|p| p.n_layers = 0),
            KVR_STATUS_INVALID_ARG,
            "n_layers",
        ),
        (
            Box::new(|p| p.n_kv_heads = -1),
            KVR_STATUS_INVALID_ARG,
            "n_kv_heads",
        ),
        (
            Box::new(|p| p.page_size = 0),
            KVR_STATUS_INVALID_ARG,
            "page_size",
        ),
        (Box::new(|p| p.dtype = 9), KVR_STATUS_INVALID_ARG, "dtype"),
        (
            Box::new(|p| p.dtype = KVR_DTYPE_I32),
            KVR_STATUS_DTYPE_MISMATCH,
            "f32, f16 or bf16",
        ),
        (
            Box::new(|p| p.capacity_pages = 0),
            KVR_STATUS_INVALID_ARG,
            "capacity",
        ),
        (
            Box::new(|p| p.capacity_bytes = 1 << 20),
            KVR_STATUS_INVALID_ARG,
            "only one",
        ),
        (
            Box::new(|p| {
                p.capacity_pages = 0;
                p.capacity_bytes = 10
            }),
            KVR_STATUS_OUT_OF_RANGE,
            "smaller than one page",
        ),
        (
            Box::new(|p| p.struct_size = 12),
            KVR_STATUS_INVALID_ARG,
            "struct_size",
        ),
        (
            Box::new(|p| p.max_seq_len = -5),
            KVR_STATUS_INVALID_ARG,
            "max_seq_len",
        ),
        (
            Box::new(|p| {
                p.max_seqs = 1 << 20;
                p.max_seq_len = 1 << 28
            }),
            KVR_STATUS_OUT_OF_RANGE,
            "block table",
        ),
    ];
    for (i, (edit, want, words)) in bad.iter().enumerate() {
        let mut q = params(2, 2, 8, 4, 32);
        edit(&mut q);
        let mut out = sentinel;
        assert_eq!(
            kvr_kv_pool_new(ctx, &q, &mut out),
            *want,
            "case {i}: {}",
            last_error()
        );
        assert!(
            last_error().contains(words),
            "case {i}: {:?} lacks {words:?}",
            last_error()
        );
        assert_eq!(out, sentinel);
    }
    let q = params(2, 2, 8, 4, 32);
    assert_eq!(
        kvr_kv_pool_new(null(), &q, &mut null_mut()),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_kv_pool_new(ctx, null(), &mut null_mut()),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(kvr_kv_pool_new(ctx, &q, null_mut()), KVR_STATUS_NULL_ARG);
    // A byte budget: 2 layers x K,V x 2 heads x 4 tokens x 8 dims x 4 bytes = 1 KiB a page.
    let mut q = params(2, 2, 8, 4, 0);
    q.capacity_bytes = 1024 * 10 + 100;
    let mut pool = null_mut();
    ok(kvr_kv_pool_new(ctx, &q, &mut pool));
    let s = stats(pool);
    assert_eq!((s.pages_total, s.page_bytes), (10, 1024));
    // The pool keeps the context alive after the context is freed.
    kvr_context_free(ctx);
    let mut seq = -1;
    ok(kvr_kv_pool_seq_add(pool, null_mut(), &mut seq));
    assert_eq!(seq, 0);
    kvr_kv_pool_free(pool);
    kvr_kv_pool_free(pool); // detected, ignored
    kvr_kv_pool_free(null_mut());
    assert_eq!(
        kvr_kv_pool_seq_add(pool, null_mut(), &mut seq),
        KVR_STATUS_INVALID_ARG
    );
    // A context handle is not a pool handle.
    let ctx2 = cpu_ctx();
    assert_eq!(
        kvr_kv_pool_seq_add(ctx2 as *mut kvr_kv_pool, null_mut(), &mut seq),
        KVR_STATUS_INVALID_ARG
    );
    kvr_context_free(ctx2);
}

#[test]
fn pool_bad_inputs_leave_it_unchanged() {
    let ctx = cpu_ctx();
    let q = params(2, 1, 4, 4, 8);
    let mut pool = null_mut();
    ok(kvr_kv_pool_new(ctx, &q, &mut pool));
    let mut seq = -1;
    ok(kvr_kv_pool_seq_add(pool, null_mut(), &mut seq));
    let mut kv = vec![0.5f32; 2 * 6 * 4];
    let t = tensor(
        kv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[2, 6, 1, 4],
        &[24, 4, 4, 1],
    );
    ok(kvr_kv_pool_append(pool, seq, &t, &t, null_mut()));
    let before = stats(pool);
    let s = |st: kvr_status, want: kvr_status, what: &str| {
        assert_eq!(st, want, "{what}: {}", last_error());
        assert!(!last_error().is_empty());
        assert!(same(&stats(pool), &before), "{what} changed the pool");
    };
    // Unknown sequences.
    s(
        kvr_kv_pool_seq_free(pool, 5, null_mut()),
        KVR_STATUS_UNKNOWN_ID,
        "free unknown",
    );
    s(
        kvr_kv_pool_seq_free(pool, -3, null_mut()),
        KVR_STATUS_UNKNOWN_ID,
        "free negative",
    );
    s(
        kvr_kv_pool_seq_free(pool, 1 << 30, null_mut()),
        KVR_STATUS_UNKNOWN_ID,
        "free huge",
    );
    let mut out = 99;
    s(
        kvr_kv_pool_seq_fork(pool, 3, null_mut(), &mut out),
        KVR_STATUS_UNKNOWN_ID,
        "fork unknown",
    );
    assert_eq!(out, 99);
    s(
        kvr_kv_pool_append(pool, 2, &t, &t, null_mut()),
        KVR_STATUS_UNKNOWN_ID,
        "append unknown",
    );
    let mut len = -1;
    s(
        kvr_kv_pool_get_seq_len(pool, 9, &mut len),
        KVR_STATUS_UNKNOWN_ID,
        "len unknown",
    );
    assert_eq!(len, -1);
    // Truncate past the length, negative.
    s(
        kvr_kv_pool_seq_truncate(pool, seq, 7, null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "truncate past",
    );
    s(
        kvr_kv_pool_seq_truncate(pool, seq, -1, null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "truncate negative",
    );
    // Append past capacity: 8 pages, 2 used; 7 more pages do not fit.
    let mut big = vec![0f32; 2 * 28 * 4];
    let bt = tensor(
        big.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[2, 28, 1, 4],
        &[112, 4, 4, 1],
    );
    s(
        kvr_kv_pool_append(pool, seq, &bt, &bt, null_mut()),
        KVR_STATUS_POOL_EXHAUSTED,
        "append past capacity",
    );
    let (seqs, counts) = ([seq], [100i32]);
    s(
        kvr_kv_pool_extend(pool, seqs.as_ptr(), counts.as_ptr(), 1, null_mut()),
        KVR_STATUS_POOL_EXHAUSTED,
        "extend past capacity",
    );
    let dup = [seq, seq];
    let ones = [1, 1];
    s(
        kvr_kv_pool_extend(pool, dup.as_ptr(), ones.as_ptr(), 2, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "listed twice",
    );
    let neg = [-2i32];
    s(
        kvr_kv_pool_extend(pool, seqs.as_ptr(), neg.as_ptr(), 1, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "negative count",
    );
    s(
        kvr_kv_pool_extend(pool, null(), counts.as_ptr(), 1, null_mut()),
        KVR_STATUS_NULL_ARG,
        "NULL seqs",
    );
    // Wrong dtype / shape / layer.
    let mut wrong = t;
    wrong.dtype = KVR_DTYPE_I32;
    s(
        kvr_kv_pool_append(pool, seq, &wrong, &wrong, null_mut()),
        KVR_STATUS_DTYPE_MISMATCH,
        "i32 k",
    );
    let mut shape = t;
    shape.shape[2] = 2;
    s(
        kvr_kv_pool_append(pool, seq, &shape, &shape, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "wrong heads",
    );
    let one = tensor(
        kv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 1, 4],
        &[4, 4, 1],
    );
    let (s1, c1) = ([seq], [1i32]);
    s(
        kvr_kv_pool_write(pool, 2, s1.as_ptr(), c1.as_ptr(), 1, &one, &one, null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "layer 2",
    );
    s(
        kvr_kv_pool_write(
            pool,
            -7,
            s1.as_ptr(),
            c1.as_ptr(),
            1,
            &one,
            &one,
            null_mut(),
        ),
        KVR_STATUS_OUT_OF_RANGE,
        "layer -7",
    );
    let c9 = [9i32];
    s(
        kvr_kv_pool_write(pool, 0, s1.as_ptr(), c9.as_ptr(), 1, &one, &one, null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "write past length",
    );
    s(
        kvr_kv_pool_append(pool, seq, null(), &t, null_mut()),
        KVR_STATUS_NULL_ARG,
        "NULL k",
    );
    let mut dev = t;
    dev.device = KVR_DEVICE_CUDA;
    s(
        kvr_kv_pool_append(pool, seq, &dev, &dev, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "CUDA memory in a CPU pool",
    );
    // Decode bad inputs.
    let ids = [seq];
    let idt = tensor(
        ids.as_ptr() as *mut _,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[1],
        &[1],
    );
    let mut qv = vec![0.1f32; 200];
    let mut ov = vec![0f32; 200];
    let qt = tensor(
        qv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 2, 4],
        &[8, 4, 1],
    );
    let ot = tensor(
        ov.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 2, 4],
        &[8, 4, 1],
    );
    ok(kvr_kv_pool_decode(
        pool,
        1,
        &idt,
        &qt,
        &ot,
        null(),
        null(),
        null_mut(),
    ));
    s(
        kvr_kv_pool_decode(pool, 2, &idt, &qt, &ot, null(), null(), null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "decode layer 2",
    );
    let bad_ids = [4i32];
    let bidt = tensor(
        bad_ids.as_ptr() as *mut _,
        KVR_DTYPE_I32,
        KVR_DEVICE_HOST,
        &[1],
        &[1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &bidt, &qt, &ot, null(), null(), null_mut()),
        KVR_STATUS_UNKNOWN_ID,
        "decode unknown seq",
    );
    let fidt = tensor(
        qv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1],
        &[1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &fidt, &qt, &ot, null(), null(), null_mut()),
        KVR_STATUS_DTYPE_MISMATCH,
        "f32 ids",
    );
    let q9 = tensor(
        qv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 9, 1, 4],
        &[36, 4, 4, 1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &q9, &q9, null(), null(), null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "T = 9",
    );
    let q17 = tensor(
        qv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 17, 4],
        &[68, 4, 1],
    );
    let o17 = tensor(
        ov.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 17, 4],
        &[68, 4, 1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &q17, &o17, null(), null(), null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "group 17",
    );
    let q8 = tensor(
        qv.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 8, 1, 4],
        &[32, 4, 4, 1],
    );
    let o8 = tensor(
        ov.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 8, 1, 4],
        &[32, 4, 4, 1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &q8, &o8, null(), null(), null_mut()),
        KVR_STATUS_OUT_OF_RANGE,
        "T past the length",
    );
    let o_short = tensor(
        ov.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[1, 1, 4],
        &[4, 4, 1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &qt, &o_short, null(), null(), null_mut()),
        KVR_STATUS_INVALID_ARG,
        "out shape",
    );
    let mut lv = [0u16; 2];
    let lse16 = tensor(
        lv.as_mut_ptr().cast(),
        KVR_DTYPE_F16,
        KVR_DEVICE_HOST,
        &[1, 2],
        &[2, 1],
    );
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &qt, &ot, &lse16, null(), null_mut()),
        KVR_STATUS_DTYPE_MISMATCH,
        "f16 lse",
    );
    let mut dp = std::mem::MaybeUninit::uninit();
    ok(kvr_kv_decode_params_default(dp.as_mut_ptr()));
    let mut dp: kvr_kv_decode_params = unsafe { dp.assume_init() };
    dp.window = -1;
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &qt, &ot, null(), &dp, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "negative window",
    );
    dp.window = 0;
    dp.scale = -1.0;
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &qt, &ot, null(), &dp, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "negative scale",
    );
    dp.scale = 0.0;
    dp.struct_size = 4;
    s(
        kvr_kv_pool_decode(pool, 0, &idt, &qt, &ot, null(), &dp, null_mut()),
        KVR_STATUS_INVALID_ARG,
        "struct_size",
    );
    s(
        kvr_kv_pool_decode(pool, 0, null(), &qt, &ot, null(), null(), null_mut()),
        KVR_STATUS_NULL_ARG,
        "NULL ids",
    );
    // Admission and the block table export.
    let mut verdict = -1;
    ok(kvr_kv_pool_admit(pool, KVR_SEQ_NONE, 24, &mut verdict));
    assert_eq!(verdict, KVR_ADMIT_OK);
    ok(kvr_kv_pool_admit(pool, KVR_SEQ_NONE, 33, &mut verdict));
    assert_eq!(verdict, KVR_ADMIT_NEVER);
    ok(kvr_kv_pool_admit(pool, KVR_SEQ_NONE, 25, &mut verdict));
    assert_eq!(verdict, KVR_ADMIT_LATER);
    ok(kvr_kv_pool_admit(pool, seq, 26, &mut verdict));
    assert_eq!(verdict, KVR_ADMIT_OK);
    ok(kvr_kv_pool_admit(pool, seq, 27, &mut verdict));
    assert_eq!(verdict, KVR_ADMIT_NEVER);
    s(
        kvr_kv_pool_admit(pool, 5, 1, &mut verdict),
        KVR_STATUS_UNKNOWN_ID,
        "admit unknown",
    );
    s(
        kvr_kv_pool_admit(pool, seq, -1, &mut verdict),
        KVR_STATUS_INVALID_ARG,
        "admit negative",
    );
    let mut pages = [0i32; 4];
    let mut n = 0i64;
    ok(kvr_kv_pool_get_seq_pages(
        pool,
        seq,
        pages.as_mut_ptr(),
        4,
        &mut n,
    ));
    assert_eq!((n, pages[0], pages[1]), (2, 0, 1));
    assert_eq!(
        kvr_kv_pool_get_seq_pages(pool, seq, pages.as_mut_ptr(), 1, &mut n),
        KVR_STATUS_OUT_OF_RANGE
    );
    assert_eq!(n, 2, "the needed size is reported");
    kvr_kv_pool_free(pool);
    kvr_context_free(ctx);
}
