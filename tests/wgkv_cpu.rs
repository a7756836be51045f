//! Write-gated KV mode on the CPU: decode equals dense attention over exactly the kept
//! tokens (ring + admitted + sinks + drafts), drafts and rollback, forks, page accounting
//! under random operations, the gate MLP against an fp64 statement, bad gate weights.

#![allow(clippy::needless_range_loop)]

mod common;

use common::wgkv::*;
use common::Rng;
use kvreplay::kv::wgkv::{GateWeights, WgKvConfig, WgKvPool};
use kvreplay::{DType, Error, Stream};

const S: Stream = Stream::DEFAULT;

fn append(
    pool: &WgKvPool,
    m: &mut SeqModel,
    rng: &mut Rng,
    seq: i32,
    layer: Option<usize>,
    n: usize,
    draft: bool,
) {
    let c = *pool.config();
    let nl = if layer.is_some() { 1 } else { c.layers };
    let (k, v, s) = random_tokens(rng, nl, n, c.kv_heads, c.head_dim);
    let shape: Vec<usize> = match layer {
        Some(_) => vec![n, c.kv_heads, c.head_dim],
        None => vec![c.layers, n, c.kv_heads, c.head_dim],
    };
    pool.append(
        seq,
        layer,
        &view(&k, &shape),
        &view(&v, &shape),
        &s,
        draft,
        S,
    )
    .unwrap();
    let layers = match layer {
        Some(l) => l..l + 1,
        None => 0..c.layers,
    };
    record(m, &c, layers, n, &k, &v, &s, draft);
}

fn check_decode(pool: &WgKvPool, rng: &mut Rng, seqs: &[(i32, &SeqModel)], t: usize, g: usize) {
    let c = *pool.config();
    let hq = c.kv_heads * g;
    for layer in 0..c.layers {
        let ids: Vec<i32> = seqs.iter().map(|s| s.0).collect();
        let q = rng.vec(ids.len() * t * hq * c.head_dim, -1.0, 1.0);
        let got = decode(pool, layer, &ids, &q, t, hq).unwrap();
        let models: Vec<Option<&SeqModel>> = seqs.iter().map(|s| Some(s.1)).collect();
        let want = reference(
            &models,
            &c,
            layer,
            &q,
            t,
            hq,
            1.0 / (c.head_dim as f64).sqrt(),
        );
        let e = max_err(&got, &want);
        let tol = if c.dtype == DType::F32 { 1e-5 } else { 1e-3 };
        assert!(e < tol, "layer {layer} T {t}: error {e}");
    }
}

fn check_rows(pool: &WgKvPool, seq: i32, m: &SeqModel) {
    let c = *pool.config();
    for (r, st) in pool.seq_rows(seq).unwrap().iter().enumerate() {
        assert_eq!(st.total, m.rows[r].0.len(), "row {r}");
        assert_eq!(st.drafts, m.rows[r].1.len(), "row {r}");
        assert_eq!(st.global, m.global(r, &c), "row {r}");
        assert_eq!(st.ring, m.rows[r].0.len().min(c.local_window), "row {r}");
    }
}

#[test]
fn decode_equals_dense_over_kept_tokens() {
    for (dtype, sinks, tau, ps, w) in [
        (DType::F32, 0, 0.1, 4, 8),
        (DType::F32, 3, 0.5, 4, 16),
        (DType::F16, 0, 0.1, 1, 8),
        (DType::BF16, 2, 0.9, 8, 8),
    ] {
        let ctx = cpu_ctx();
        let mut cfg = config(2, 2, 16, ps, w, dtype, 4000);
        cfg.sinks = sinks;
        cfg.tau = tau;
        let pool = WgKvPool::new(ctx, cfg).unwrap();
        let mut rng = Rng::new(7);
        let a = pool.seq_add(S).unwrap();
        let b = pool.seq_add(S).unwrap();
        let (mut ma, mut mb) = (SeqModel::new(4), SeqModel::new(4));
        append(&pool, &mut ma, &mut rng, a, None, 41, false); // prefill past the ring
        append(&pool, &mut mb, &mut rng, b, None, 5, false); // ring not full
        check_rows(&pool, a, &ma);
        check_rows(&pool, b, &mb);
        check_decode(&pool, &mut rng, &[(a, &ma), (b, &mb)], 1, 2);
        for step in 0..30 {
            if step % 3 == 0 {
                // Layer by layer, as an engine appends.
                for l in 0..2 {
                    append(&pool, &mut ma, &mut rng, a, Some(l), 1, false);
                    append(&pool, &mut mb, &mut rng, b, Some(l), 1, false);
                }
            } else {
                append(&pool, &mut ma, &mut rng, a, None, 1, false);
                append(&pool, &mut mb, &mut rng, b, None, 1 + step % 2, false);
            }
            check_decode(&pool, &mut rng, &[(b, &mb), (a, &ma)], 1, 1 + step % 3);
        }
        check_rows(&pool, a, &ma);
        check_rows(&pool, b, &mb);
        // Memory against a full cache.
        let st = pool.stats().unwrap();
        assert!(st.pages_used <= st.full_pages, "{st:?}");
        assert_eq!(
            st.kept_tokens,
            (0..4)
                .map(|r| ma.kept(r, &cfg).len() + mb.kept(r, &cfg).len())
                .sum::<usize>()
        );
    }
}

#[test]
fn drafts_decode_commit_and_rollback_inside_and_across_the_ring() {
    let ctx = cpu_ctx();
    let cfg = config(2, 2, 16, 4, 8, DType::F32, 4000);
    let pool = WgKvPool::new(ctx, cfg).unwrap();
    let mut rng = Rng::new(11);
    // Ring partly filled (5 of 8): drafts cross the ring boundary; then a full ring.
    for prefill in [5usize, 3, 30] {
        let a = pool.seq_add(S).unwrap();
        let mut m = SeqModel::new(4);
        append(&pool, &mut m, &mut rng, a, None, prefill, false);
        for round in 0..6 {
            let t = 1 + (round + prefill) % 6;
            append(&pool, &mut m, &mut rng, a, None, t, true);
            check_rows(&pool, a, &m);
            for tq in 1..=t {
                check_decode(&pool, &mut rng, &[(a, &m)], tq, 2);
            }
            // Roll back some drafts, then accept part of the rest.
            let back = round % 3;
            let keep = t.saturating_sub(back);
            let committed = m.rows[0].0.len();
            pool.truncate(a, committed + keep, S).unwrap();
            for r in &mut m.rows {
                r.1.truncate(keep);
            }
            // Committed tokens cannot be rolled back.
            assert!(
                matches!(
                    pool.truncate(a, committed.saturating_sub(1), S),
                    Err(Error::OutOfRange(_))
                ) || committed == 0
            );
            let acc = keep.saturating_sub(round % 2);
            pool.commit(a, acc, S).unwrap();
            commit(&mut m, acc);
            check_rows(&pool, a, &m);
            check_decode(&pool, &mut rng, &[(a, &m)], 1, 1);
            append(&pool, &mut m, &mut rng, a, None, 1, false);
            check_decode(&pool, &mut rng, &[(a, &m)], 1, 2);
        }
        pool.seq_free(a, S).unwrap();
    }
    assert_eq!(pool.stats().unwrap().pages_used, 0);
}

#[test]
fn fork_is_copy_on_write() {
    let ctx = cpu_ctx();
    let cfg = config(1, 2, 16, 4, 8, DType::F32, 4000);
    let pool = WgKvPool::new(ctx, cfg).unwrap();
    let mut rng = Rng::new(3);
    let a = pool.seq_add(S).unwrap();
    let mut ma = SeqModel::new(2);
    append(&pool, &mut ma, &mut rng, a, None, 22, false);
    let used = pool.stats().unwrap().pages_used;
    let b = pool.seq_fork(a, S).unwrap();
    let mut mb = ma.clone();
    assert_eq!(pool.stats().unwrap().pages_used, used);
    assert_eq!(pool.stats().unwrap().pages_shared, used);
    for _ in 0..12 {
        append(&pool, &mut ma, &mut rng, a, None, 1, false);
        check_decode(&pool, &mut rng, &[(a, &ma), (b, &mb)], 1, 2);
        append(&pool, &mut mb, &mut rng, b, None, 1, false);
        check_decode(&pool, &mut rng, &[(b, &mb), (a, &ma)], 1, 2);
    }
    // Drafts on a fork, committed, while the parent keeps its ring.
    append(&pool, &mut mb, &mut rng, b, None, 3, true);
    pool.commit(b, 3, S).unwrap();
    commit(&mut mb, 3);
    check_decode(&pool, &mut rng, &[(a, &ma), (b, &mb)], 1, 2);
    pool.seq_free(a, S).unwrap();
    check_decode(&pool, &mut rng, &[(b, &mb)], 1, 2);
    pool.seq_free(b, S).unwrap();
    assert_eq!(pool.stats().unwrap().pages_used, 0);
}

#[test]
fn strided_queries_decode_per_head() {
    let ctx = cpu_ctx();
    let cfg = config(1, 2, 16, 4, 8, DType::F32, 1000);
    let pool = WgKvPool::new(ctx, cfg).unwrap();
    let mut rng = Rng::new(5);
    let a = pool.seq_add(S).unwrap();
    let mut m = SeqModel::new(2);
    append(&pool, &mut m, &mut rng, a, None, 20, false);
    // q [1, 4, 16] inside a wider buffer: batch stride 100 (heads not folded).
    let (b, hq, d) = (1, 4, 16);
    let buf = rng.vec(200, -1.0, 1.0);
    let q: Vec<f32> = (0..hq * d).map(|i| buf[i]).collect();
    let mut out = vec![0f32; 200];
    let qv = kvreplay::TensorView::new(
        buf.as_ptr() as usize,
        DType::F32,
        kvreplay::MemoryKind::Host,
        &[b, hq, d],
        &[100, 16, 1],
    )
    .unwrap();
    let ov = kvreplay::TensorView::new(
        out.as_mut_ptr() as usize,
        DType::F32,
        kvreplay::MemoryKind::Host,
        &[b, hq, d],
        &[100, 16, 1],
    )
    .unwrap();
    let ids = [a];
    let idv = view_i32(&ids);
    pool.decode(
        0,
        &kvreplay::kv::DecodeIo {
            seq_ids: &idv,
            q: &qv,
            out: &ov,
            lse: None,
        },
        &Default::default(),
        S,
    )
    .unwrap();
    let want = reference(&[Some(&m)], &cfg, 0, &q, 1, hq, 0.25);
    assert!(max_err(&out[..hq * d], &want) < 1e-5);
}

fn view_i32(ids: &[i32]) -> kvreplay::TensorView {
    kvreplay::TensorView::contiguous(
        ids.as_ptr() as usize,
        DType::I32,
        kvreplay::MemoryKind::Host,
        &[ids.len()],
    )
    .unwrap()
}

#[test]
fn bad_calls_change_nothing() {
    let ctx = cpu_ctx();
    let cfg = config(1, 2, 16, 4, 8, DType::F32, 12);
    let pool = WgKvPool::new(ctx, cfg).unwrap();
    let mut rng = Rng::new(9);
    let a = pool.seq_add(S).unwrap();
    let mut m = SeqModel::new(2);
    append(&pool, &mut m, &mut rng, a, None, 10, false);
    let before = (pool.stats().unwrap(), pool.seq_rows(a).unwrap());
    let (k, v, s) = random_tokens(&mut rng, 1, 200, 2, 16);
    // Exhausted: 200 tokens at ~90 % admitted need more than the 12 pages.
    let r = pool.append(
        a,
        None,
        &view(&k, &[1, 200, 2, 16]),
        &view(&v, &[1, 200, 2, 16]),
        &s,
        false,
        S,
    );
    assert!(matches!(r, Err(Error::PoolExhausted(_))), "{r:?}");
    // Wrong shapes, scores, ids, NaN scores, too many drafts.
    assert!(pool
        .append(
            a,
            None,
            &view(&k, &[1, 200, 1, 32]),
            &view(&v, &[1, 200, 2, 16]),
            &s,
            false,
            S
        )
        .is_err());
    assert!(pool
        .append(
            a,
            None,
            &view(&k, &[1, 2, 2, 16]),
            &view(&v, &[1, 2, 2, 16]),
            &s,
            false,
            S
        )
        .is_err());
    assert!(matches!(
        pool.append(
            7,
            None,
            &view(&k, &[1, 2, 2, 16]),
            &view(&v, &[1, 2, 2, 16]),
            &s[..4],
            false,
            S
        ),
        Err(Error::UnknownId(_))
    ));
    let nan = [f32::NAN, 0.5, 0.5, 0.5];
    assert!(pool
        .append(
            a,
            None,
            &view(&k, &[1, 2, 2, 16]),
            &view(&v, &[1, 2, 2, 16]),
            &nan,
            false,
            S
        )
        .is_err());
    assert!(matches!(
        pool.append(
            a,
            None,
            &view(&k, &[1, 9, 2, 16]),
            &view(&v, &[1, 9, 2, 16]),
            &s[..18],
            true,
            S
        ),
        Err(Error::OutOfRange(_))
    ));
    assert!(matches!(pool.commit(a, 1, S), Err(Error::OutOfRange(_))));
    assert!(matches!(pool.truncate(a, 5, S), Err(Error::OutOfRange(_))));
    assert_eq!((pool.stats().unwrap(), pool.seq_rows(a).unwrap()), before);
    check_decode(&pool, &mut rng, &[(a, &m)], 1, 2);
    // Decode: T > drafts, window, bad ids.
    let q = rng.vec(2 * 4 * 16, -1.0, 1.0);
    assert!(matches!(
        decode(&pool, 0, &[a], &q, 2, 4),
        Err(Error::OutOfRange(_))
    ));
    assert!(matches!(
        decode(&pool, 0, &[3], &q[..64], 1, 4),
        Err(Error::UnknownId(_))
    ));
    assert!(decode(&pool, 0, &[a, a], &q[..128], 1, 4).is_err());
    assert!(matches!(
        decode(&pool, 1, &[a], &q[..64], 1, 4),
        Err(Error::OutOfRange(_))
    ));
    // Config checks.
    for bad in [
        WgKvConfig {
            local_window: 6,
            ..cfg
        },
        WgKvConfig {
            local_window: 4,
            page_size: 2,
            ..cfg
        },
        WgKvConfig { tau: 1.0, ..cfg },
        WgKvConfig {
            tau: f32::NAN,
            ..cfg
        },
        WgKvConfig { layers: 0, ..cfg },
    ] {
        assert!(WgKvPool::new(cpu_ctx(), bad).is_err(), "{bad:?}");
    }
}

/// 10^5 random operations: after each, the pages the rows hold equal the allocator's
/// count, no page is owned twice except by forks (refcounts), every row holds exactly the
/// pages its length needs, and the row counts follow the model; decodes are checked
/// against the reference every 500 operations.
#[test]
fn random_operations_keep_exact_page_accounting() {
    let ctx = cpu_ctx();
    let mut cfg = config(1, 2, 8, 4, 8, DType::F32, 400);
    cfg.sinks = 1;
    cfg.max_seqs = 6;
    cfg.max_global_tokens = 200;
    let pool = WgKvPool::new(ctx, cfg).unwrap();
    let mut rng = Rng::new(2026);
    let mut live: Vec<(i32, SeqModel)> = Vec::new();
    let ops: usize = std::env::var("KVR_WGKV_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    for op in 0..ops {
        let choice = rng.below(100);
        if live.is_empty() || (choice < 8 && live.len() < 6) {
            if let Ok(s) = pool.seq_add(S) {
                live.push((s, SeqModel::new(2)));
            }
            continue;
        }
        let i = rng.below(live.len());
        let (seq, m) = &mut live[i];
        let seq = *seq;
        let drafts = m.rows[0].1.len();
        let n_rows = 2;
        match choice {
            8..=11 => {
                if live.len() < 6 {
                    let m2 = live[i].1.clone();
                    let s2 = pool.seq_fork(seq, S).unwrap();
                    live.push((s2, m2));
                }
            }
            12..=15 => {
                pool.seq_free(seq, S).unwrap();
                live.swap_remove(i);
            }
            16..=55 => {
                let draft = drafts > 0 || rng.below(4) == 0;
                let n = if draft {
                    (1 + rng.below(MAXD)).min(MAXD - drafts)
                } else {
                    let max = if rng.below(10) == 0 { 30 } else { 3 };
                    1 + rng.below(max)
                };
                if n == 0 {
                    continue;
                }
                let (k, v, s) = random_tokens(&mut rng, 1, n, 2, 8);
                let r = pool.append(
                    seq,
                    None,
                    &view(&k, &[1, n, 2, 8]),
                    &view(&v, &[1, n, 2, 8]),
                    &s,
                    draft,
                    S,
                );
                match r {
                    Ok(()) => record(m, &cfg, 0..1, n, &k, &v, &s, draft),
                    Err(Error::PoolExhausted(_)) | Err(Error::OutOfRange(_)) => {}
                    Err(e) => panic!("op {op}: {e}"),
                }
            }
            56..=75 => {
                if drafts > 0 {
                    let acc = rng.below(drafts + 1);
                    match pool.commit(seq, acc, S) {
                        Ok(()) => commit(m, acc),
                        Err(Error::PoolExhausted(_)) | Err(Error::OutOfRange(_)) => {}
                        Err(e) => panic!("op {op}: {e}"),
                    }
                }
            }
            _ => {
                if drafts > 0 {
                    let keep = rng.below(drafts + 1);
                    let c = m.rows[0].0.len();
                    pool.truncate(seq, c + keep, S).unwrap();
                    for r in &mut m.rows {
                        r.1.truncate(keep);
                    }
                }
            }
        }
        // Accounting.
        let inner = pool.inner();
        let st = inner.stats();
        let mut owners = std::collections::HashMap::<u32, usize>::new();
        for (s, m) in &live {
            for r in 0..n_rows {
                let id = pool.row_id(*s, 0, r);
                let pages = inner.seq_pages(id).unwrap();
                let len = inner.seq_len(id).unwrap();
                assert_eq!(pages.len(), len.div_ceil(cfg.page_size), "op {op}");
                for p in pages {
                    *owners.entry(p).or_default() += 1;
                }
                let _ = m;
            }
            check_rows(&pool, *s, m);
        }
        assert_eq!(st.pages_used, owners.len(), "op {op}: pages leaked or lost");
        assert_eq!(
            st.pages_shared,
            owners.values().filter(|&&n| n > 1).count(),
            "op {op}"
        );
        if op % 500 == 0 {
            let seqs: Vec<(i32, &SeqModel)> = live
                .iter()
                .filter(|(_, m)| m.rows.iter().all(|r| !r.0.is_empty() || !r.1.is_empty()))
                .map(|(s, m)| (*s, m))
                .collect();
            if !seqs.is_empty() {
                check_decode(&pool, &mut rng, &seqs, 1, 2);
            }
        }
    }
    for (s, _) in live {
        pool.seq_free(s, S).unwrap();
    }
    assert_eq!(pool.inner().stats().pages_used, 0);
}

const MAXD: usize = kvreplay::kv::wgkv::MAX_DRAFTS;

// ---- gate ----

#[test]
fn gate_matches_fp64_formula_and_drives_admission() {
    let mut rng = Rng::new(17);
    let (l, h, d, hid) = (2, 3, 32, 24);
    let (_, g) = random_gate(&mut rng, l, h, d, hid);
    let n = 40;
    let pre = rng.vec(l * n * h * d, -2.0, 2.0);
    let post = rng.vec(l * n * h * d, -2.0, 2.0);
    let mut lo = f64::MAX;
    let mut hi = f64::MIN;
    for li in 0..l {
        let off = li * n * h * d;
        let s = g
            .scores(
                li,
                &view(&pre[off..off + n * h * d], &[n, h, d]),
                &view(&post[off..off + n * h * d], &[n, h, d]),
            )
            .unwrap();
        for t in 0..n {
            for hh in 0..h {
                let at = off + (t * h + hh) * d;
                let want = gate_f64(&g, li, hh, &pre[at..at + d], &post[at..at + d]);
                let got = s[t * h + hh] as f64;
                assert!(
                    (got - want).abs() < 2e-6 * want.max(1e-3) / 1e-3 || (got - want).abs() < 2e-6,
                    "{got} vs {want}"
                );
                lo = lo.min(want);
                hi = hi.max(want);
            }
        }
    }
    assert!(
        lo < 0.1 && hi > 0.1,
        "scores {lo}..{hi} do not straddle tau"
    );
    // append_gated == append with those scores.
    let cfg = config(l, h, d, 4, 8, DType::F32, 4000);
    let pool = WgKvPool::new(cpu_ctx(), cfg).unwrap();
    pool.set_gate(Some(g.clone())).unwrap();
    let a = pool.seq_add(S).unwrap();
    let v = rng.vec(l * n * h * d, -1.0, 1.0);
    let shape = [l, n, h, d];
    pool.append_gated(
        a,
        None,
        &view(&pre, &shape),
        &view(&post, &shape),
        &view(&v, &shape),
        false,
        S,
    )
    .unwrap();
    let scores = pool
        .gate_scores(&g, None, &view(&pre, &shape), &view(&post, &shape))
        .unwrap();
    let mut m = SeqModel::new(l * h);
    record(&mut m, &cfg, 0..l, n, &post, &v, &scores, false);
    check_rows(&pool, a, &m);
    check_decode(&pool, &mut rng, &[(a, &m)], 1, 2);
    // A gate of another shape is refused.
    let (_, g2) = random_gate(&mut rng, l, h, 16, hid);
    assert!(pool.set_gate(Some(g2)).is_err());
}

#[test]
fn gate_from_gguf_and_bad_weight_files() {
    use common::gguf::Builder;
    const F32: u32 = 0;
    const F16: u32 = 1;
    const I32: u32 = 26;
    let mut rng = Rng::new(23);
    let (l, h, d, hid) = (2, 2, 16, 8);
    let (raw, g) = random_gate(&mut rng, l, h, d, hid);
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let dims = |i: usize| -> Vec<u64> {
        match i {
            0 | 1 => vec![d as u64],
            2 => vec![2 * d as u64, hid as u64, h as u64],
            3 | 4 => vec![hid as u64, h as u64],
            _ => vec![h as u64],
        }
    };
    let build = |skip: Option<(usize, usize)>,
                 shape_bad: Option<(usize, usize)>,
                 type_bad: Option<(usize, usize)>|
     -> Vec<u8> {
        let mut b = Builder::new("llama");
        for li in 0..l {
            let names = kvreplay::kv::wgkv::gate_tensor_names(li);
            for i in 0..6 {
                if skip == Some((li, i)) {
                    continue;
                }
                let mut dm = dims(i);
                let mut data = bytes(&raw[li][i]);
                if shape_bad == Some((li, i)) {
                    dm[0] -= 1;
                    data.truncate(data.len() / dims(i)[0] as usize * dm[0] as usize);
                }
                let ty = if type_bad == Some((li, i)) { I32 } else { F32 };
                b.tensor(&names[i], &dm, ty, &data);
            }
        }
        b.build()
    };
    let ok = kvreplay::gguf::GgufFile::from_bytes(&build(None, None, None)).unwrap();
    assert_eq!(GateWeights::from_gguf(&ok, &[0, 1], h, d).unwrap(), g);
    let missing = kvreplay::gguf::GgufFile::from_bytes(&build(Some((1, 2)), None, None)).unwrap();
    let e = GateWeights::from_gguf(&missing, &[0, 1], h, d).unwrap_err();
    assert!(
        matches!(e, Error::UnknownId(_)) && e.to_string().contains("blk.1.wg_gate.fc1.weight"),
        "{e}"
    );
    let shaped = kvreplay::gguf::GgufFile::from_bytes(&build(None, Some((0, 4)), None)).unwrap();
    let e = GateWeights::from_gguf(&shaped, &[0, 1], h, d).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("fc2.weight"),
        "{e}"
    );
    let typed = kvreplay::gguf::GgufFile::from_bytes(&build(None, None, Some((1, 0)))).unwrap();
    let e = GateWeights::from_gguf(&typed, &[0, 1], h, d).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch(_)), "{e}");
    // f16 weights are accepted (converted).
    let mut b = Builder::new("llama");
    for li in 0..l {
        for (i, n) in kvreplay::kv::wgkv::gate_tensor_names(li).iter().enumerate() {
            let data: Vec<u8> = raw[li][i]
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect();
            b.tensor(n, &dims(i), F16, &data);
        }
    }
    let f = kvreplay::gguf::GgufFile::from_bytes(&b.build()).unwrap();
    assert_eq!(
        GateWeights::from_gguf(&f, &[0, 1], h, d).unwrap().hidden,
        hid
    );
}

/// lse through the folded and the per-head paths, against the fp64 log-sum-exp over the
/// kept tokens.
#[test]
fn lse_folded_and_per_head() {
    let ctx = cpu_ctx();
    let cfg = config(1, 2, 16, 4, 8, DType::F32, 1000);
    let pool = WgKvPool::new(ctx, cfg).unwrap();
    let mut rng = Rng::new(31);
    let a = pool.seq_add(S).unwrap();
    let b = pool.seq_add(S).unwrap();
    let mut ma = SeqModel::new(2);
    let mut mb = SeqModel::new(2);
    append(&pool, &mut ma, &mut rng, a, None, 37, false);
    append(&pool, &mut mb, &mut rng, b, None, 6, false);
    let (hq, d) = (6, 16);
    let ids = [b, -1, a];
    let q = rng.vec(3 * hq * d, -1.0, 1.0);
    let scale = 0.25f64;
    for lse_stride in [1usize, 2] {
        let mut out = vec![f32::NAN; 3 * hq * d];
        // Stride 2 with a padded row: lse rows not foldable (one decode per head).
        let row = if lse_stride == 1 { hq } else { 2 * hq + 1 };
        let mut lse = vec![f32::NAN; 3 * row];
        let idv = view_i32(&ids);
        let qv = view(&q, &[3, hq, d]);
        let ov = kvreplay::TensorView::contiguous(
            out.as_mut_ptr() as usize,
            DType::F32,
            kvreplay::MemoryKind::Host,
            &[3, hq, d],
        )
        .unwrap();
        let lv = kvreplay::TensorView::new(
            lse.as_mut_ptr() as usize,
            DType::F32,
            kvreplay::MemoryKind::Host,
            &[3, hq],
            &[row as isize, lse_stride as isize],
        )
        .unwrap();
        pool.decode(
            0,
            &kvreplay::kv::DecodeIo {
                seq_ids: &idv,
                q: &qv,
                out: &ov,
                lse: Some(&lv),
            },
            &Default::default(),
            S,
        )
        .unwrap();
        let want = reference(&[Some(&mb), None, Some(&ma)], &cfg, 0, &q, 1, hq, scale);
        assert!(max_err(&out, &want) < 1e-5);
        for (bi, m) in [(0usize, Some(&mb)), (1, None), (2, Some(&ma))] {
            for h in 0..hq {
                let got = lse[bi * lv.strides()[0] as usize + h * lv.strides()[1] as usize];
                let Some(m) = m else {
                    assert_eq!(got, f32::NEG_INFINITY);
                    continue;
                };
                let kh = h / 3;
                let qv = &q[(bi * hq + h) * d..(bi * hq + h + 1) * d];
                let s: Vec<f64> = m
                    .kept(kh, &cfg)
                    .iter()
                    .map(|t| {
                        t.k.iter()
                            .zip(qv)
                            .map(|(&x, &y)| x as f64 * y as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let want = mx + s.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
                assert!((got as f64 - want).abs() < 1e-4, "{got} vs {want}");
            }
        }
    }
}

/// `WgKvConfig::pages_per_seq` equals the pool's own page count for a sequence built with
/// scores that admit exactly the fraction asked (every other token past the sinks for 0.5),
/// across ring fills, sinks, drafts and page sizes; bad arguments get their errors.
#[test]
fn pages_per_seq_matches_the_pool() {
    let ctx = cpu_ctx();
    for (ps, w) in [(4usize, 8usize), (8, 16)] {
        for sinks in [0usize, 3] {
            let mut cfg = config(2, 2, 4, ps, w, DType::F32, 4096);
            cfg.sinks = sinks;
            for context in [0usize, 5, w, w + 1, 3 * w + 7] {
                for admit in [0.0, 0.5, 1.0] {
                    for drafts in [0usize, 3] {
                        let pool = WgKvPool::new(ctx.clone(), cfg).unwrap();
                        let a = pool.seq_add(S).unwrap();
                        let older = context.saturating_sub(w);
                        let score = |j: usize| -> f32 {
                            let pick = j < older
                                && j >= sinks
                                && (admit == 1.0 || (admit == 0.5 && (j - sinks) % 2 == 0));
                            if pick {
                                0.9
                            } else {
                                0.05
                            }
                        };
                        let h = cfg.kv_heads;
                        let mut rng = Rng::new(5);
                        for (n, draft) in [(context, false), (drafts, true)] {
                            if n == 0 {
                                continue;
                            }
                            let (k, v, _) = random_tokens(&mut rng, cfg.layers, n, h, cfg.head_dim);
                            let s: Vec<f32> = (0..cfg.layers * n * h)
                                .map(|i| if draft { 0.5 } else { score(i / h % n) })
                                .collect();
                            let shape = [cfg.layers, n, h, cfg.head_dim];
                            pool.append(
                                a,
                                None,
                                &view(&k, &shape),
                                &view(&v, &shape),
                                &s,
                                draft,
                                S,
                            )
                            .unwrap();
                        }
                        let want = pool.stats().unwrap().pages_used;
                        let got = cfg.pages_per_seq(context, admit, drafts).unwrap();
                        assert_eq!(
                            got, want,
                            "page {ps} ring {w} sinks {sinks} context {context} admit {admit} \
                             drafts {drafts}"
                        );
                    }
                }
            }
        }
    }
    let cfg = config(2, 2, 4, 4, 8, DType::F32, 64);
    assert!(matches!(
        cfg.pages_per_seq(10, 1.5, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        cfg.pages_per_seq(10, f64::NAN, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        cfg.pages_per_seq(10, 0.5, 9),
        Err(Error::OutOfRange(_))
    ));
    let mut small = cfg;
    small.max_global_tokens = 4;
    assert!(matches!(
        small.pages_per_seq(100, 1.0, 0),
        Err(Error::OutOfRange(_))
    ));
    assert_eq!(small.pages_per_seq(12, 1.0, 0).unwrap(), 4 * 3);
    let mut bad = cfg;
    bad.local_window = 6;
    assert!(matches!(
        bad.pages_per_seq(10, 0.5, 0),
        Err(Error::InvalidArgument(_))
    ));
    bad.local_window = kvreplay::kv::wgkv::MAX_LOCAL_WINDOW + bad.page_size;
    assert!(matches!(
        bad.pages_per_seq(10, 0.5, 0),
        Err(Error::InvalidArgument(_))
    ));
}

// ---- device steps (the CPU backend's semantics of reserve + step) ----

fn view_mut(data: &mut [f32], shape: &[usize]) -> kvreplay::TensorView {
    kvreplay::TensorView::contiguous(
        data.as_mut_ptr() as usize,
        DType::F32,
        kvreplay::MemoryKind::Host,
        shape,
    )
    .unwrap()
}

/// One step of `layer` for `ids` through the gate (`gated`) or given scores; records the
/// tokens with the scores the pool reports; checks gated scores against the fp64 formula.
fn step(
    pool: &WgKvPool,
    models: &mut [&mut SeqModel],
    rng: &mut Rng,
    ids: &[i32],
    layer: usize,
    gate: Option<&GateWeights>,
) -> kvreplay::Result<()> {
    let c = *pool.config();
    let (b, h, d) = (ids.len(), c.kv_heads, c.head_dim);
    let pre = rng.vec(b * h * d, -2.0, 2.0);
    let k = rng.vec(b * h * d, -1.0, 1.0);
    let v = rng.vec(b * h * d, -1.0, 1.0);
    let given = rng.vec(b * h, 0.0, 1.0);
    let mut out = vec![f32::NAN; b * h];
    let (pv, gv) = (view(&pre, &[b, h, d]), view(&given, &[b, h]));
    pool.step(
        layer,
        ids,
        gate.map(|_| &pv),
        &view(&k, &[b, h, d]),
        &view(&v, &[b, h, d]),
        if gate.is_some() { None } else { Some(&gv) },
        Some(&view_mut(&mut out, &[b, h])),
        S,
    )?;
    for i in 0..b {
        let r = i * h * d..(i + 1) * h * d;
        if let Some(g) = gate {
            for hh in 0..h {
                let at = (i * h + hh) * d;
                let want = gate_f64(g, layer, hh, &pre[at..at + d], &k[at..at + d]);
                let got = out[i * h + hh] as f64;
                assert!(
                    (got - want).abs() < 1e-5 * want.max(1e-2),
                    "{got} vs {want}"
                );
            }
        } else {
            assert_eq!(out[i * h..(i + 1) * h], given[i * h..(i + 1) * h]);
        }
        let s = &out[i * h..(i + 1) * h];
        record(
            models[i],
            &c,
            layer..layer + 1,
            1,
            &k[r.clone()],
            &v[r],
            s,
            false,
        );
    }
    Ok(())
}

#[test]
fn steps_equal_one_token_appends_within_reservations() {
    let mut rng = Rng::new(23);
    let (l, h, d, hid) = (2, 2, 32, 40);
    let (_, g) = random_gate(&mut rng, l, h, d, hid);
    let mut cfg = config(l, h, d, 4, 8, DType::F32, 4000);
    cfg.sinks = 1;
    let pool = WgKvPool::new(cpu_ctx(), cfg).unwrap();
    pool.set_gate(Some(g.clone())).unwrap();
    let (a, b) = (pool.seq_add(S).unwrap(), pool.seq_add(S).unwrap());
    let (mut ma, mut mb) = (SeqModel::new(l * h), SeqModel::new(l * h));
    append(&pool, &mut ma, &mut rng, a, None, 5, false);
    append(&pool, &mut mb, &mut rng, b, None, 13, false);
    let before = (pool.stats().unwrap(), pool.seq_rows(a).unwrap());
    let e = step(&pool, &mut [&mut ma], &mut rng, &[a], 0, Some(&g)).unwrap_err();
    assert!(matches!(e, Error::OutOfRange(_)), "{e}");
    assert_eq!((pool.stats().unwrap(), pool.seq_rows(a).unwrap()), before);
    for (round, steps) in [1usize, 3, 16, 2, 9, 5].into_iter().enumerate() {
        let free = pool.stats().unwrap().pages_free;
        pool.reserve(a, steps, S).unwrap();
        pool.reserve(b, steps, S).unwrap();
        assert!(pool.stats().unwrap().pages_free <= free);
        let gate = (round % 2 == 0).then_some(&g);
        for _ in 0..steps {
            for layer in 0..l {
                step(
                    &pool,
                    &mut [&mut mb, &mut ma],
                    &mut rng,
                    &[b, a],
                    layer,
                    gate,
                )
                .unwrap();
            }
        }
        check_rows(&pool, a, &ma);
        check_rows(&pool, b, &mb);
        check_decode(&pool, &mut rng, &[(a, &ma), (b, &mb)], 1, 2);
        // The budget is spent: refused, nothing changes.
        let before = (pool.stats().unwrap(), pool.seq_rows(a).unwrap());
        let e = step(&pool, &mut [&mut ma], &mut rng, &[a], 1, gate).unwrap_err();
        assert!(matches!(e, Error::OutOfRange(_)), "{e}");
        assert_eq!((pool.stats().unwrap(), pool.seq_rows(a).unwrap()), before);
    }
    // Any other operation ends a reservation.
    pool.reserve(a, 4, S).unwrap();
    step(&pool, &mut [&mut ma], &mut rng, &[a], 0, None).unwrap();
    step(&pool, &mut [&mut ma], &mut rng, &[a], 1, None).unwrap();
    append(&pool, &mut ma, &mut rng, a, None, 1, false);
    assert!(step(&pool, &mut [&mut ma], &mut rng, &[a], 0, None).is_err());
    check_rows(&pool, a, &ma);
    check_decode(&pool, &mut rng, &[(a, &ma), (b, &mb)], 1, 2);
    // Forks share the reserved pages; freeing everything returns every page.
    pool.reserve(a, 20, S).unwrap();
    let f = pool.seq_fork(a, S).unwrap();
    assert!(step(&pool, &mut [&mut ma], &mut rng, &[a], 0, None).is_err());
    for s in [a, b, f] {
        pool.seq_free(s, S).unwrap();
    }
    assert_eq!(pool.stats().unwrap().pages_used, 0);
}

#[test]
fn bad_steps_and_reservations_change_nothing() {
    let mut rng = Rng::new(29);
    let (l, h, d) = (2, 2, 16);
    let (_, g) = random_gate(&mut rng, l, h, d, 8);
    let cfg = config(l, h, d, 4, 8, DType::F32, 40);
    let pool = WgKvPool::new(cpu_ctx(), cfg).unwrap();
    let a = pool.seq_add(S).unwrap();
    let empty = pool.seq_add(S).unwrap();
    let mut ma = SeqModel::new(l * h);
    let e = pool.reserve(empty, 1, S).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    append(&pool, &mut ma, &mut rng, a, None, 3, false);
    pool.reserve(a, 2, S).unwrap();
    let snap = |p: &WgKvPool| (p.stats().unwrap(), p.seq_rows(a).unwrap());
    let before = snap(&pool);
    for n in [0, kvreplay::kv::wgkv::MAX_RESERVE_STEPS + 1] {
        assert!(matches!(pool.reserve(a, n, S), Err(Error::OutOfRange(_))));
    }
    assert!(matches!(pool.reserve(7, 1, S), Err(Error::UnknownId(_))));
    // Too many steps for the pool's pages.
    assert!(matches!(
        pool.reserve(a, 4000, S),
        Err(Error::PoolExhausted(_))
    ));
    assert_eq!(snap(&pool), before);
    let (b2, hd) = (2, h * d);
    let k = rng.vec(b2 * hd, -1.0, 1.0);
    let sc = vec![0.5f32; b2 * h];
    let mut out = vec![0f32; b2 * h + 1];
    let kv = view(&k, &[2, h, d]);
    let k1 = view(&k[..hd], &[1, h, d]);
    let scv = view(&sc, &[2, h]);
    let sc1 = view(&sc[..h], &[1, h]);
    let bad_shape = view(&sc[..h], &[h, 1]);
    let strided = kvreplay::TensorView::new(
        out.as_mut_ptr() as usize,
        DType::F32,
        kvreplay::MemoryKind::Host,
        &[1, h],
        &[h as isize + 1, 2],
    )
    .unwrap();
    let cases: Vec<(&str, kvreplay::Result<()>)> = vec![
        (
            "both",
            pool.step(0, &[a], Some(&k1), &k1, &k1, Some(&sc1), None, S),
        ),
        ("neither", pool.step(0, &[a], None, &k1, &k1, None, None, S)),
        (
            "no gate",
            pool.step(0, &[a], Some(&k1), &k1, &k1, None, None, S),
        ),
        (
            "twice",
            pool.step(0, &[a, a], None, &kv, &kv, Some(&scv), None, S),
        ),
        (
            "count",
            pool.step(0, &[a], None, &kv, &kv, Some(&scv), None, S),
        ),
        (
            "layer",
            pool.step(2, &[a], None, &k1, &k1, Some(&sc1), None, S),
        ),
        (
            "unknown",
            pool.step(0, &[5], None, &k1, &k1, Some(&sc1), None, S),
        ),
        (
            "unreserved",
            pool.step(0, &[empty], None, &k1, &k1, Some(&sc1), None, S),
        ),
        (
            "scores shape",
            pool.step(0, &[a], None, &k1, &k1, Some(&bad_shape), None, S),
        ),
        (
            "out strided",
            pool.step(0, &[a], None, &k1, &k1, Some(&sc1), Some(&strided), S),
        ),
    ];
    for (what, r) in cases {
        assert!(r.is_err(), "{what} was accepted");
    }
    let nan = [f32::NAN; 2];
    let e = pool
        .step(
            0,
            &[a],
            None,
            &k1,
            &k1,
            Some(&view(&nan[..h], &[1, h])),
            None,
            S,
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(snap(&pool), before);
    // Drafts pending: no reservation.
    pool.set_gate(Some(g)).unwrap();
    append(&pool, &mut ma, &mut rng, a, None, 1, true);
    assert!(matches!(
        pool.reserve(a, 1, S),
        Err(Error::InvalidArgument(_))
    ));
}

/// Two pools with the same history: one steps and then decodes, the other does both in one
/// `step_decode`; outputs, scores, rows and page counts must be identical. Bad fused calls
/// change nothing (the step is not applied when the decode's arguments are wrong).
#[test]
fn step_decode_equals_step_then_decode() {
    let (l, h, d, hid, g) = (2, 2, 16, 24, 3);
    let hq = h * g;
    let mut rng = Rng::new(31);
    let (_, gate) = random_gate(&mut rng, l, h, d, hid);
    let mut cfg = config(l, h, d, 4, 8, DType::F32, 400);
    cfg.sinks = 1;
    let pools = [
        WgKvPool::new(cpu_ctx(), cfg).unwrap(),
        WgKvPool::new(cpu_ctx(), cfg).unwrap(),
    ];
    let mut ids = Vec::new();
    for p in &pools {
        p.set_gate(Some(gate.clone())).unwrap();
        // The same prefill in both (same seed).
        let mut r = Rng::new(37);
        let (a, b) = (p.seq_add(S).unwrap(), p.seq_add(S).unwrap());
        let (mut ma, mut mb) = (SeqModel::new(l * h), SeqModel::new(l * h));
        append(p, &mut ma, &mut r, a, None, 6, false);
        append(p, &mut mb, &mut r, b, None, 11, false);
        p.reserve(a, 20, S).unwrap();
        p.reserve(b, 20, S).unwrap();
        ids = vec![b, a];
    }
    let bsz = ids.len();
    let snap = |p: &WgKvPool| {
        (
            p.stats().unwrap(),
            ids.iter()
                .map(|&s| p.seq_rows(s).unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let opts = kvreplay::kv::DecodeOptions::default();
    for it in 0..20 {
        let layer = it % l;
        let gated = it % 3 != 1;
        let pre = rng.vec(bsz * h * d, -2.0, 2.0);
        let k = rng.vec(bsz * h * d, -1.0, 1.0);
        let v = rng.vec(bsz * h * d, -1.0, 1.0);
        let given = rng.vec(bsz * h, 0.0, 1.0);
        let q = rng.vec(bsz * hq * d, -1.0, 1.0);
        let (pv, kv, vv, gv) = (
            view(&pre, &[bsz, h, d]),
            view(&k, &[bsz, h, d]),
            view(&v, &[bsz, h, d]),
            view(&given, &[bsz, h]),
        );
        let mut sc = [vec![f32::NAN; bsz * h], vec![f32::NAN; bsz * h]];
        let mut out = [vec![f32::NAN; bsz * hq * d], vec![f32::NAN; bsz * hq * d]];
        let mut lse = [vec![f32::NAN; bsz * hq], vec![f32::NAN; bsz * hq]];
        // Pool 0: step, then decode.
        {
            let so = view_mut(&mut sc[0], &[bsz, h]);
            pools[0]
                .step(
                    layer,
                    &ids,
                    gated.then_some(&pv),
                    &kv,
                    &vv,
                    (!gated).then_some(&gv),
                    Some(&so),
                    S,
                )
                .unwrap();
            let idv = view_i32(&ids);
            let qv = view(&q, &[bsz, hq, d]);
            let ov = view_mut(&mut out[0], &[bsz, hq, d]);
            let lv = view_mut(&mut lse[0], &[bsz, hq]);
            let io = kvreplay::kv::DecodeIo {
                seq_ids: &idv,
                q: &qv,
                out: &ov,
                lse: Some(&lv),
            };
            pools[0].decode(layer, &io, &opts, S).unwrap();
        }
        // Pool 1: both in one call; first a few bad calls that must change nothing.
        {
            let so = view_mut(&mut sc[1], &[bsz, h]);
            let step = kvreplay::kv::wgkv::WgStep {
                layer,
                seqs: &ids,
                k_pre: gated.then_some(&pv),
                k: &kv,
                v: &vv,
                scores: (!gated).then_some(&gv),
                scores_out: Some(&so),
            };
            let q4 = vec![0f32; bsz * 2 * hq * d];
            let mut junk = vec![f32::NAN; bsz * 2 * hq * d];
            let before = snap(&pools[1]);
            let two = view(&q4, &[bsz, 2, hq, d]);
            let two_out = view_mut(&mut junk, &[bsz, 2, hq, d]);
            let qv = view(&q, &[bsz, hq, d]);
            let short_q = view(&q[..hq * d], &[1, hq, d]);
            let ov = view_mut(&mut out[1], &[bsz, hq, d]);
            let lv = view_mut(&mut lse[1], &[bsz, hq]);
            let bad_lse = view(&lse[0][..hq], &[1, hq]);
            let mut windowed = opts;
            windowed.window = 4;
            let cases: Vec<(&str, kvreplay::Result<()>)> = vec![
                (
                    "two tokens",
                    pools[1].step_decode(&step, &two, &two_out, None, &opts, S),
                ),
                (
                    "q batch",
                    pools[1].step_decode(&step, &short_q, &ov, None, &opts, S),
                ),
                (
                    "out shape",
                    pools[1].step_decode(&step, &qv, &short_q, None, &opts, S),
                ),
                (
                    "lse shape",
                    pools[1].step_decode(&step, &qv, &ov, Some(&bad_lse), &opts, S),
                ),
                (
                    "window",
                    pools[1].step_decode(&step, &qv, &ov, None, &windowed, S),
                ),
                (
                    "layer",
                    pools[1].step_decode(
                        &kvreplay::kv::wgkv::WgStep { layer: l, ..step },
                        &qv,
                        &ov,
                        None,
                        &opts,
                        S,
                    ),
                ),
                (
                    "twice",
                    pools[1].step_decode(
                        &kvreplay::kv::wgkv::WgStep {
                            seqs: &[ids[0], ids[0]],
                            ..step
                        },
                        &qv,
                        &ov,
                        None,
                        &opts,
                        S,
                    ),
                ),
            ];
            for (what, r) in cases {
                assert!(r.is_err(), "{what} was accepted");
            }
            assert_eq!(snap(&pools[1]), before, "a refused call changed the pool");
            assert!(
                sc[1].iter().all(|x| x.is_nan()),
                "a refused call wrote scores"
            );
            pools[1]
                .step_decode(&step, &qv, &ov, Some(&lv), &opts, S)
                .unwrap();
        }
        assert_eq!(sc[0], sc[1], "step {it}: scores");
        assert_eq!(out[0], out[1], "step {it}: outputs");
        assert_eq!(lse[0], lse[1], "step {it}: lse");
        assert_eq!(snap(&pools[0]), snap(&pools[1]), "step {it}: rows");
    }
}
