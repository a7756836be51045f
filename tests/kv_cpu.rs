//! The paged KV pool on the CPU backend: decode against an fp64 reference over the feature
//! matrix, copy-on-write forks, truncation, and a randomized property test of the pool's
//! bookkeeping against a simple model.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};

use common::kv::*;
use common::Rng;
use kvreplay::kv::{Admission, DecodeOptions, KvPool, KvPoolConfig};
use kvreplay::{DType, Error, MemoryKind, Stream, TensorView};

struct Case {
    hkv: usize,
    g: usize,
    d: usize,
    page: usize,
    dtype: DType,
    t: usize,
    lens: Vec<usize>,
    opts: DecodeOptions,
}

/// Builds a pool with the case's sequences, decodes layer 1, and returns the worst error
/// against the fp64 reference (outputs relative to each row's scale; lse absolute).
fn run_case(c: &Case, rng: &mut Rng) -> (f64, f64) {
    let ctx = cpu_context(2);
    let total_pages: usize = c.lens.iter().map(|l| l.div_ceil(c.page)).sum::<usize>() + 4;
    let pool = pool(&ctx, config(2, c.hkv, c.d, c.page, c.dtype, total_pages));
    let mut datas = Vec::new();
    let mut ids = Vec::new();
    for &len in &c.lens {
        let (id, data) = add_random_seq(&pool, rng, len);
        ids.push(id);
        datas.push(data);
    }
    // An unused row in the middle of the batch.
    ids.insert(1.min(ids.len()), -1);
    let b = ids.len();
    let hq = c.hkv * c.g;
    let n = b * c.t * hq * c.d;
    let q: Vec<f32> = rng.vec(n, -1.0, 1.0);
    let mut out = vec![f32::NAN; n];
    let mut lse = vec![f32::NAN; b * c.t * hq];
    let idv =
        TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[b]).unwrap();
    let qv = contiguous_view(&q, &[b, c.t, hq, c.d]);
    let ov = TensorView::contiguous(
        out.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[b, c.t, hq, c.d],
    )
    .unwrap();
    let lv = TensorView::contiguous(
        lse.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[b, c.t, hq],
    )
    .unwrap();
    kv_decode(
        &pool,
        1,
        &idv,
        &qv,
        &ov,
        Some(&lv),
        &c.opts,
        Stream::DEFAULT,
    )
    .unwrap();
    let mut refs: Vec<Option<&SeqData>> = datas.iter().map(Some).collect();
    refs.insert(1.min(refs.len()), None);
    let (want, want_lse) = reference_decode(pool.config(), &refs, 1, &q, c.t, hq, &c.opts);
    assert!(
        out.iter().all(|x| x.is_finite()),
        "unwritten or non-finite output"
    );
    let err = max_row_relative_error(&out, &want, c.d);
    let mut lse_err = 0f64;
    for (&a, &b) in lse.iter().zip(&want_lse) {
        if b == f64::NEG_INFINITY {
            assert_eq!(a, f32::NEG_INFINITY);
        } else {
            lse_err = lse_err.max((a as f64 - b).abs());
        }
    }
    (err, lse_err)
}

#[test]
fn cpu_decode_matches_fp64_reference() {
    let mut rng = Rng::new(11);
    let mut cases = Vec::new();
    // Head dims x GQA groups (including 5 and 7) x page sizes.
    for (i, &d) in [64usize, 80, 96, 128, 256, 32].iter().enumerate() {
        for (j, &g) in [1usize, 2, 4, 5, 7, 8, 16].iter().enumerate() {
            let page = [1usize, 8, 16, 32, 128][(i + j) % 5];
            cases.push(Case {
                hkv: if g == 16 { 1 } else { 2 },
                g,
                d,
                page,
                dtype: [DType::F16, DType::BF16, DType::F32][(i + j) % 3],
                t: 1,
                lens: vec![1, 37, 200 + 13 * j],
                opts: DecodeOptions::default(),
            });
        }
    }
    // Multi-token queries, sliding window, softcap, explicit scale.
    for t in 1..=8 {
        cases.push(Case {
            hkv: 2,
            g: 4,
            d: 64,
            page: 16,
            dtype: DType::BF16,
            t,
            lens: vec![t, t + 5, 300],
            opts: DecodeOptions {
                window: if t % 2 == 0 { 50 } else { 0 },
                softcap: if t % 3 == 0 { 30.0 } else { 0.0 },
                scale: if t == 5 { Some(0.3) } else { None },
                max_ctas: 0,
            },
        });
    }
    // A long sequence mixed with short ones.
    cases.push(Case {
        hkv: 1,
        g: 8,
        d: 128,
        page: 16,
        dtype: DType::F16,
        t: 2,
        lens: vec![4096, 3, 64, 65],
        opts: DecodeOptions::default(),
    });
    let mut worst = (0f64, 0f64);
    for c in &cases {
        let (e, l) = run_case(c, &mut rng);
        assert!(
            e < 1e-4 && l < 1e-4,
            "hkv {} g {} d {} page {} {:?} T {} {:?}: error {e:e}, lse error {l:e}",
            c.hkv,
            c.g,
            c.d,
            c.page,
            c.dtype,
            c.t,
            c.opts
        );
        worst = (worst.0.max(e), worst.1.max(l));
    }
    println!(
        "{} cases: max relative error {:.2e}, max lse error {:.2e}",
        cases.len(),
        worst.0,
        worst.1
    );
}

#[test]
fn fork_copy_on_write_and_truncate() {
    let ctx = cpu_context(2);
    let cfg = config(1, 1, 4, 4, DType::F32, 16);
    let pool = pool(&ctx, cfg);
    let mut rng = Rng::new(5);
    let (a, _) = add_random_seq(&pool, &mut rng, 6); // pages: 4 + 2 (partial)
    let b = pool.seq_fork(a, Stream::DEFAULT).unwrap();
    assert_eq!(pool.seq_pages(a).unwrap(), pool.seq_pages(b).unwrap());
    let s = pool.stats();
    assert_eq!((s.pages_used, s.pages_shared, s.tokens), (2, 2, 12));
    // Appending to b copies its shared partial page; the full page stays shared.
    let k = vec![9.0f32; 4];
    let kv = contiguous_view(&k, &[1, 1, 1, 4]);
    pool.append(b, &kv, &kv, Stream::DEFAULT).unwrap();
    let (pa, pb) = (pool.seq_pages(a).unwrap(), pool.seq_pages(b).unwrap());
    assert_eq!(pa[0], pb[0]);
    assert_ne!(pa[1], pb[1]);
    let s = pool.stats();
    assert_eq!((s.pages_used, s.pages_shared, s.tokens), (3, 1, 13));
    // Writing into a shared page is refused.
    let one = contiguous_view(&k, &[1, 1, 4]);
    let e = pool.write(
        Some(0),
        &[(a, 3)],
        &contiguous_view(&[0.0; 12], &[3, 1, 4]),
        &contiguous_view(&[0.0; 12], &[3, 1, 4]),
        Stream::DEFAULT,
    );
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    pool.write(Some(0), &[(a, 1)], &one, &one, Stream::DEFAULT)
        .unwrap(); // its own page
                   // Truncate b back into the shared page, then grow again: copy-on-write again.
    pool.seq_truncate(b, 3, Stream::DEFAULT).unwrap();
    assert_eq!(pool.stats().pages_used, 2);
    pool.extend(&[(b, 1)], Stream::DEFAULT).unwrap();
    assert_ne!(pool.seq_pages(b).unwrap()[0], pool.seq_pages(a).unwrap()[0]);
    assert!(matches!(
        pool.seq_truncate(b, 9, Stream::DEFAULT),
        Err(Error::OutOfRange(_))
    ));
    pool.seq_free(a, Stream::DEFAULT).unwrap();
    pool.seq_free(b, Stream::DEFAULT).unwrap();
    let s = pool.stats();
    assert_eq!(
        (s.pages_used, s.pages_free, s.sequences, s.tokens),
        (0, 16, 0, 0)
    );
}

#[test]
fn admission() {
    let ctx = cpu_context(1);
    let mut cfg = config(1, 1, 8, 16, DType::F16, 10);
    cfg.max_seq_len = 1000;
    cfg.max_seqs = 2;
    let pool = pool(&ctx, cfg);
    assert_eq!(pool.admit(None, 160).unwrap(), Admission::Ok);
    assert_eq!(pool.admit(None, 161).unwrap(), Admission::Never); // 11 pages > 10
    assert_eq!(pool.admit(None, 1001).unwrap(), Admission::Never);
    let a = pool.seq_add(Stream::DEFAULT).unwrap();
    pool.extend(&[(a, 100)], Stream::DEFAULT).unwrap(); // 7 pages
    assert_eq!(pool.admit(None, 64).unwrap(), Admission::Later);
    assert_eq!(pool.admit(Some(a), 12).unwrap(), Admission::Ok); // fits the partial page
    assert_eq!(pool.admit(Some(a), 60).unwrap(), Admission::Ok); // 3 more pages
    assert_eq!(pool.admit(Some(a), 61).unwrap(), Admission::Never); // 11 pages in all
    let b = pool.seq_add(Stream::DEFAULT).unwrap();
    pool.extend(&[(b, 16)], Stream::DEFAULT).unwrap(); // 2 pages left
    assert_eq!(pool.admit(Some(a), 60).unwrap(), Admission::Later);
    assert_eq!(pool.admit(None, 1).unwrap(), Admission::Later); // no free id
    assert!(matches!(pool.admit(Some(7), 1), Err(Error::UnknownId(_))));
    let before = pool.stats();
    let e = pool.extend(&[(a, 60)], Stream::DEFAULT);
    assert!(matches!(e, Err(Error::PoolExhausted(_))), "{e:?}");
    assert_eq!(pool.stats(), before, "a failed extend changed the pool");
}

/// The model: each sequence is a list of token values; each token's K (layer 0, head 0,
/// dim 0) holds its value, so reading the pool back shows sharing and copy-on-write bugs.
struct Model {
    seqs: BTreeMap<i32, Vec<f32>>,
    next_value: f32,
}

fn read_back(pool: &KvPool, seq: i32, len: usize) -> Vec<f32> {
    let cfg = pool.config();
    let lay = pool.layer_layout(0).unwrap();
    let pages = pool.seq_pages(seq).unwrap();
    (0..len)
        .map(|i| {
            let p = pages[i / cfg.page_size] as usize;
            let off = p * lay.k_strides[0] + (i % cfg.page_size) * lay.k_strides[2];
            // SAFETY: the pool's own host memory.
            unsafe { *(lay.k as *const f32).add(off) }
        })
        .collect()
}

fn check_against_model(pool: &KvPool, model: &Model) {
    let cfg = pool.config();
    let mut refs: HashMap<u32, usize> = HashMap::new();
    let mut tokens = 0;
    let mut filled: HashMap<u32, usize> = HashMap::new();
    for (&seq, vals) in &model.seqs {
        assert_eq!(pool.seq_len(seq).unwrap(), vals.len());
        let pages = pool.seq_pages(seq).unwrap();
        assert_eq!(pages.len(), vals.len().div_ceil(cfg.page_size), "seq {seq}");
        let distinct: HashSet<u32> = pages.iter().copied().collect();
        assert_eq!(distinct.len(), pages.len(), "seq {seq} holds a page twice");
        for (i, &p) in pages.iter().enumerate() {
            *refs.entry(p).or_default() += 1;
            let n = (vals.len() - i * cfg.page_size).min(cfg.page_size);
            let f = filled.entry(p).or_default();
            *f = (*f).max(n);
        }
        assert_eq!(
            &read_back(pool, seq, vals.len()),
            vals,
            "contents of seq {seq}"
        );
        tokens += vals.len();
    }
    let s = pool.stats();
    assert_eq!(s.sequences, model.seqs.len());
    assert_eq!(s.tokens, tokens);
    assert_eq!(s.pages_used, refs.len(), "leaked or missing pages");
    assert_eq!(s.pages_free + s.pages_used, s.pages_total);
    assert_eq!(s.pages_shared, refs.values().filter(|&&r| r > 1).count());
    let held: usize = filled.values().sum();
    assert_eq!(s.waste_slots, s.pages_used * cfg.page_size - held);
}

#[test]
fn pool_property_test_random_operations() {
    let ctx = cpu_context(1);
    let cfg = KvPoolConfig {
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        page_size: 4,
        dtype: DType::F32,
        capacity_pages: 48,
        max_seqs: 12,
        max_seq_len: 64,
    };
    let pool = pool(&ctx, cfg);
    let mut model = Model {
        seqs: BTreeMap::new(),
        next_value: 1.0,
    };
    let mut rng = Rng::new(99);
    let (mut ok_ops, mut refused) = (0, 0);
    let ops = 100_000;
    for step in 0..ops {
        let live: Vec<i32> = model.seqs.keys().copied().collect();
        let pick = |rng: &mut Rng| live[rng.below(live.len())];
        let before = pool.stats();
        let r: Result<(), Error> = match rng.below(10) {
            0 | 1 => pool.seq_add(Stream::DEFAULT).map(|id| {
                assert!(!model.seqs.contains_key(&id));
                model.seqs.insert(id, Vec::new());
            }),
            2..=5 if !live.is_empty() => {
                let seq = pick(&mut rng);
                let n = 1 + rng.below(9);
                let vals: Vec<f32> = (0..n).map(|i| model.next_value + i as f32).collect();
                let kv = contiguous_view(&vals, &[1, n, 1, 1]);
                pool.append(seq, &kv, &kv, Stream::DEFAULT).map(|_| {
                    model.next_value += n as f32;
                    model.seqs.get_mut(&seq).unwrap().extend(vals);
                })
            }
            6 if !live.is_empty() => {
                let seq = pick(&mut rng);
                pool.seq_fork(seq, Stream::DEFAULT).map(|id| {
                    let v = model.seqs[&seq].clone();
                    model.seqs.insert(id, v);
                })
            }
            7 if !live.is_empty() => {
                let seq = pick(&mut rng);
                let len = model.seqs[&seq].len();
                let to = if rng.below(8) == 0 {
                    len + 1
                } else {
                    rng.below(len + 1)
                };
                pool.seq_truncate(seq, to, Stream::DEFAULT).map(|_| {
                    model.seqs.get_mut(&seq).unwrap().truncate(to);
                })
            }
            8 if !live.is_empty() => {
                let seq = pick(&mut rng);
                pool.seq_free(seq, Stream::DEFAULT).map(|_| {
                    model.seqs.remove(&seq);
                })
            }
            _ => {
                // Unknown or dead ids are refused.
                let bogus = [-1, 12, 1000][rng.below(3)];
                let dead = (0..12).find(|s| !model.seqs.contains_key(s)).unwrap_or(-5);
                let id = if rng.below(2) == 0 { bogus } else { dead };
                match pool.seq_free(id, Stream::DEFAULT) {
                    Err(Error::UnknownId(_)) => Err(Error::UnknownId(String::new())),
                    other => panic!("step {step}: freeing {id} gave {other:?}"),
                }
            }
        };
        match r {
            Ok(()) => ok_ops += 1,
            Err(Error::PoolExhausted(_)) | Err(Error::OutOfRange(_)) | Err(Error::UnknownId(_)) => {
                refused += 1;
                assert_eq!(
                    pool.stats(),
                    before,
                    "step {step}: a refused call changed the pool"
                );
            }
            Err(e) => panic!("step {step}: unexpected {e}"),
        }
        if step % 7 == 0 || step + 1 == ops {
            check_against_model(&pool, &model);
        }
    }
    println!("{ops} operations: {ok_ops} done, {refused} refused as expected");
    assert!(ok_ops > ops / 2 && refused > 100);
}
