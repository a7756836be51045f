//! Issue 12, "found from outside": a copy-on-write counted twice in one
//! `kvr_kv_pool_extend` batch.

mod common;

use std::ptr::null_mut;

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
