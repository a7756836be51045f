//! GDN replay decoding on the CPU backend against an independent f64 recurrence: decode
//! across many flushes, speculative verify + commit (with the conv window), KV-only mode,
//! explicit flush / import / export / reset, and bad input.

#![allow(clippy::needless_range_loop)]

mod common;

use std::sync::Arc;

use common::gdn::*;
use common::Rng;
use kvreplay::linear::{GdnConfig, GdnPool, StateLayout};
use kvreplay::{DType, Error, MemoryKind, Stream, TensorView};

fn pool(c: GdnConfig) -> GdnPool {
    GdnPool::new(cpu_ctx(), c, None).unwrap()
}

fn ids_view(ids: &[i32]) -> TensorView {
    TensorView::contiguous(
        ids.as_ptr() as usize,
        DType::I32,
        MemoryKind::Host,
        &[ids.len()],
    )
    .unwrap()
}

/// Decode `steps` tokens on a batch whose sequences join at different steps (so they flush
/// on different steps); every output against the reference.
fn decode_run(c: GdnConfig, steps: usize, seed: u64) -> f64 {
    let p = pool(c);
    let mut rng = Rng::new(seed);
    let b = 3;
    let mut ids = vec![-1i32; b];
    let mut refs: Vec<Reference> = (0..b).map(|_| Reference::new(&c)).collect();
    let mut worst = 0f64;
    for step in 0..steps {
        // Row r joins at step 5 r; row 2 leaves and a new sequence takes its place midway.
        for (r, id) in ids.iter_mut().enumerate() {
            if *id < 0 && step >= 5 * r {
                *id = p.seq_add(Stream::DEFAULT).unwrap();
                refs[r] = Reference::new(&c);
            }
        }
        if step == steps / 2 {
            p.seq_free(ids[2], Stream::DEFAULT).unwrap();
            ids[2] = p.seq_add(Stream::DEFAULT).unwrap();
            refs[2] = Reference::new(&c);
        }
        let x = random_tokens(&mut rng, &c, b, 1);
        let out = run(&p, &ids, &x, false).unwrap();
        for r in 0..b {
            let n = c.v_heads * c.dv;
            if ids[r] < 0 {
                assert!(out[r * n..(r + 1) * n].iter().all(|&v| v == 0.0));
                continue;
            }
            let want = refs[r].step(&x, r, 0);
            worst = worst.max(rel_err(&out[r * n..(r + 1) * n], &want, c.dv));
        }
    }
    // The final states agree too.
    for r in 0..b {
        let got = export(&p, ids[r]);
        for h in 0..c.v_heads {
            let g: Vec<f32> = got[h].iter().map(|&x| x as f32).collect();
            worst = worst.max(rel_err(&g, &refs[r].state[h], c.dk));
        }
    }
    worst
}

#[test]
fn replay_equals_recurrent_across_flushes() {
    let mut worst = 0f64;
    let mut cases = 0;
    for (i, &ring) in [1usize, 4, 16, 64].iter().enumerate() {
        for (j, layout) in [StateLayout::KMajor, StateLayout::VMajor]
            .into_iter()
            .enumerate()
        {
            for (hk, hv) in [(2usize, 2usize), (1, 2)] {
                let c = config(hk, hv, 64, ring, 0, layout);
                let e = decode_run(c, 2048, (i * 10 + j) as u64 + hv as u64);
                assert!(e < 1e-4, "L {ring} {layout:?} Hk {hk} Hv {hv}: {e:e}");
                worst = worst.max(e);
                cases += 1;
            }
        }
        // dk = dv = 128 (alternating layout and GQA).
        let layout = if i % 2 == 0 {
            StateLayout::KMajor
        } else {
            StateLayout::VMajor
        };
        let c = config(1, 1 + i % 2, 128, ring, 0, layout);
        let e = decode_run(c, 2048, 100 + i as u64);
        assert!(e < 1e-4, "d 128 L {ring}: {e:e}");
        worst = worst.max(e);
        cases += 1;
    }
    // The recurrent pool (L = 0) itself.
    let e = decode_run(config(1, 2, 64, 0, 0, StateLayout::KMajor), 512, 7);
    assert!(e < 1e-4);
    println!("{cases} replay configurations x 2048 steps: max relative error {worst:.2e} vs the f64 recurrence");
}

/// Speculative rounds with random accepted counts; the reference follows the accepted
/// tokens only. Returns the worst error.
fn spec_run(c: GdnConfig, rounds: usize, seed: u64, check_kv_only: bool) -> f64 {
    let p = pool(c);
    let mut rng = Rng::new(seed);
    let b = 3;
    let ids: Vec<i32> = (0..b)
        .map(|_| p.seq_add(Stream::DEFAULT).unwrap())
        .collect();
    let mut refs: Vec<Reference> = (0..b).map(|_| Reference::new(&c)).collect();
    // The conv window the host would hold: the last conv_kernel-1 accepted inputs.
    let k1 = c.conv_kernel - 1;
    let mut conv_hist: Vec<Vec<Vec<f32>>> = vec![vec![vec![0.0; c.conv_dim]; k1]; b];
    let mut lens = vec![0usize; b];
    let mut worst = 0f64;
    let mut saw_transition = false;
    for round in 0..rounds {
        let t = 1 + rng.below(c.max_drafts);
        let x = random_tokens(&mut rng, &c, b, t);
        if round % 7 == 3 {
            // A plain decode step between speculative rounds.
            let x1 = random_tokens(&mut rng, &c, b, 1);
            let out = run(&p, &ids, &x1, false).unwrap();
            for r in 0..b {
                let n = c.v_heads * c.dv;
                let want = refs[r].step(&x1, r, 0);
                worst = worst.max(rel_err(&out[r * n..(r + 1) * n], &want, c.dv));
                lens[r] += 1;
                if c.conv_dim > 0 {
                    conv_hist[r].push(x1.conv[r * c.conv_dim..(r + 1) * c.conv_dim].to_vec());
                    conv_hist[r].remove(0);
                }
            }
        }
        let before: Vec<i32> = ids
            .iter()
            .map(|&id| p.debug_meta(0, id).unwrap()[0])
            .collect();
        let out = run(&p, &ids, &x, true).unwrap();
        let accepted: Vec<i32> = (0..b)
            .map(|r| match (round + r) % 5 {
                0 => 0,        // reject the whole window
                1 => t as i32, // accept everything
                _ => rng.below(t + 1) as i32,
            })
            .collect();
        let mut conv_out = vec![f32::NAN; b * k1 * c.conv_dim.max(1)];
        let cs = (c.conv_dim > 0).then(|| {
            TensorView::contiguous(
                conv_out.as_mut_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &[b, k1, c.conv_dim],
            )
            .unwrap()
        });
        let acc_view = ids_view(&accepted);
        p.commit(
            Some(0),
            &ids_view(&ids),
            &acc_view,
            cs.as_ref(),
            Stream::DEFAULT,
        )
        .unwrap();
        for r in 0..b {
            // Every draft's output is defined by the history and the drafts before it.
            let mut probe = refs[r].clone();
            let n = c.v_heads * c.dv;
            for s in 0..t {
                let want = probe.step(&x, r, s);
                let o = ((r * t) + s) * n;
                worst = worst.max(rel_err(&out[o..o + n], &want, c.dv));
                if s + 1 == accepted[r] as usize {
                    refs[r] = probe.clone();
                }
            }
            lens[r] += accepted[r] as usize;
            if c.conv_dim > 0 {
                for s in 0..accepted[r] as usize {
                    let o = (r * t + s) * c.conv_dim;
                    conv_hist[r].push(x.conv[o..o + c.conv_dim].to_vec());
                    conv_hist[r].remove(0);
                }
                for i in 0..k1 {
                    let o = (r * k1 + i) * c.conv_dim;
                    assert_eq!(
                        &conv_out[o..o + c.conv_dim],
                        conv_hist[r][i].as_slice(),
                        "round {round} row {r} conv"
                    );
                }
            }
            let m = p.debug_meta(0, ids[r]).unwrap();
            if check_kv_only && before[r] == 0 && m[0] == 1 {
                saw_transition = true;
            }
            if check_kv_only && lens[r] + 2 * c.max_drafts <= c.kv_only_threshold {
                assert_eq!(m[0], 0, "a short sequence keeps no state");
            }
        }
    }
    if check_kv_only {
        assert!(
            saw_transition,
            "no KV-only -> state transition happened in a speculative round"
        );
    }
    // Final states.
    for r in 0..b {
        let got = export(&p, ids[r]);
        for h in 0..c.v_heads {
            let g: Vec<f32> = got[h].iter().map(|&x| x as f32).collect();
            worst = worst.max(rel_err(&g, &refs[r].state[h], c.dk));
        }
    }
    worst
}

#[test]
fn verify_and_commit_equal_the_recurrence_on_accepted_tokens() {
    let mut worst = 0f64;
    for (i, (ring, drafts, hv, layout)) in [
        (16usize, 4usize, 2usize, StateLayout::KMajor),
        (8, 8, 1, StateLayout::VMajor), // T > remaining ring space: flush one window early
        (16, 8, 2, StateLayout::VMajor),
        (64, 3, 2, StateLayout::KMajor),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = config(1, hv, 64, ring, 0, layout);
        c.max_drafts = drafts;
        c.conv_dim = 24;
        let e = spec_run(c, 300, 40 + i as u64, false);
        assert!(e < 1e-4, "ring {ring} drafts {drafts}: {e:e}");
        worst = worst.max(e);
    }
    // The recurrent pool's verify keeps one snapshot per draft.
    let mut c = config(1, 2, 64, 0, 0, StateLayout::KMajor);
    c.max_drafts = 4;
    c.conv_dim = 8;
    worst = worst.max(spec_run(c, 100, 9, false));
    assert!(worst < 1e-4);
    println!("speculative rounds (verify T = 1..8, random accepts, conv window): max relative error {worst:.2e}");
}

#[test]
fn kv_only_until_the_threshold_then_state() {
    // Decode: no state while short, materialized when crossing the threshold.
    let mut c = config(1, 2, 64, 16, 24, StateLayout::KMajor);
    c.max_drafts = 4;
    let p = pool(c);
    let mut rng = Rng::new(3);
    let id = p.seq_add(Stream::DEFAULT).unwrap();
    let mut r = Reference::new(&c);
    let mut worst = 0f64;
    for step in 0..200 {
        let m = p.debug_meta(0, id).unwrap();
        assert_eq!(m[0], if step <= 24 { 0 } else { 1 }, "step {step}: mode");
        let x = random_tokens(&mut rng, &c, 1, 1);
        let out = run(&p, &[id], &x, false).unwrap();
        worst = worst.max(rel_err(&out, &r.step(&x, 0, 0), c.dv));
    }
    assert!(worst < 1e-4, "{worst:e}");
    // Speculative rounds that cross the threshold mid-round.
    let mut c = config(1, 2, 64, 16, 21, StateLayout::VMajor);
    c.max_drafts = 4;
    c.conv_dim = 4;
    let e = spec_run(c, 60, 11, true);
    assert!(e < 1e-4, "{e:e}");
    // The threshold is capped by what one head's state memory holds.
    let mut big = config(1, 1, 64, 16, 0, StateLayout::KMajor);
    let cap = big.kv_only_capacity();
    assert!(cap >= 31, "{cap}");
    big.kv_only_threshold = cap + 1;
    assert!(matches!(
        GdnPool::new(cpu_ctx(), big, None),
        Err(Error::OutOfRange(_))
    ));
    println!("KV-only: max relative error {worst:.2e}, {e:.2e} across transitions");
}

#[test]
fn flush_import_export_reset() {
    let c = config(1, 2, 64, 16, 0, StateLayout::KMajor);
    let p = pool(c);
    let mut rng = Rng::new(5);
    let id = p.seq_add(Stream::DEFAULT).unwrap();
    // Import a random state (as a prefill would), decode, and compare with the reference.
    let init = rng.vec(c.v_heads * c.dk * c.dv, -0.5, 0.5);
    let t = TensorView::contiguous(
        init.as_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[c.v_heads, c.dk, c.dv],
    )
    .unwrap();
    p.import_state(0, id, &t, None, Stream::DEFAULT).unwrap();
    let mut r = Reference::new(&c);
    for h in 0..c.v_heads {
        for ik in 0..c.dk {
            for iv in 0..c.dv {
                r.state[h][iv * c.dk + ik] = init[h * c.dk * c.dv + ik * c.dv + iv] as f64;
            }
        }
    }
    for _ in 0..7 {
        let x = random_tokens(&mut rng, &c, 1, 1);
        let out = run(&p, &[id], &x, false).unwrap();
        assert!(rel_err(&out, &r.step(&x, 0, 0), c.dv) < 1e-4);
    }
    assert_eq!(p.debug_meta(0, id).unwrap()[2], 7);
    let before = export(&p, id);
    p.flush(Some(0), &ids_view(&[id]), Stream::DEFAULT).unwrap();
    let m = p.debug_meta(0, id).unwrap();
    assert_eq!(
        (m[1], m[2]),
        (7, 0),
        "flush moves the start and empties the ring"
    );
    let after = export(&p, id);
    for h in 0..c.v_heads {
        let a: Vec<f32> = after[h].iter().map(|&x| x as f32).collect();
        assert!(rel_err(&a, &before[h], c.dk) < 1e-6);
        let w: Vec<f32> = before[h].iter().map(|&x| x as f32).collect();
        assert!(rel_err(&w, &r.state[h], c.dk) < 1e-4);
    }
    p.seq_reset(id, Stream::DEFAULT).unwrap();
    assert!(export(&p, id).iter().all(|h| h.iter().all(|&x| x == 0.0)));
    let mem = p.memory();
    assert_eq!(mem.state_bytes, c.v_heads * c.dk * c.dv * 4);
    assert_eq!(
        mem.ring_bytes,
        16 * ((c.v_heads * c.dv + c.dk) * 4 + c.v_heads * 4)
    );
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let mut c = config(1, 2, 64, 8, 0, StateLayout::KMajor);
    c.max_drafts = 4;
    let p = pool(c);
    let mut rng = Rng::new(8);
    let id = p.seq_add(Stream::DEFAULT).unwrap();
    let x = random_tokens(&mut rng, &c, 1, 1);
    run(&p, &[id], &x, false).unwrap();
    let state = export(&p, id);
    let meta = p.debug_meta(0, id).unwrap();
    let same = |p: &GdnPool| {
        assert_eq!(p.debug_meta(0, id).unwrap(), meta);
        assert_eq!(export(p, id), state);
    };
    // Unknown sequences.
    assert!(matches!(
        run(&p, &[id + 1], &x, false),
        Err(Error::UnknownId(_))
    ));
    assert!(matches!(
        run(&p, &[99], &x, false),
        Err(Error::UnknownId(_))
    ));
    same(&p);
    // T > max_drafts, T > ring length.
    let x5 = random_tokens(&mut rng, &c, 1, 5);
    assert!(matches!(
        run(&p, &[id], &x5, true),
        Err(Error::OutOfRange(_))
    ));
    let mut c9 = c;
    c9.max_drafts = 8;
    let p9 = pool(c9);
    let id9 = p9.seq_add(Stream::DEFAULT).unwrap();
    let x9 = random_tokens(&mut rng, &c9, 1, 9);
    assert!(matches!(
        run(&p9, &[id9], &x9, true),
        Err(Error::OutOfRange(_))
    ));
    // Commit without verify; commit more than verified; decode while drafts are pending.
    let one = [1i32];
    assert!(matches!(
        p.commit(
            Some(0),
            &ids_view(&[id]),
            &ids_view(&one),
            None,
            Stream::DEFAULT
        ),
        Err(Error::InvalidArgument(_))
    ));
    same(&p);
    let x3 = random_tokens(&mut rng, &c, 1, 3);
    run(&p, &[id], &x3, true).unwrap();
    let four = [4i32];
    assert!(matches!(
        p.commit(
            Some(0),
            &ids_view(&[id]),
            &ids_view(&four),
            None,
            Stream::DEFAULT
        ),
        Err(Error::OutOfRange(_))
    ));
    let neg = [-1i32];
    assert!(matches!(
        p.commit(
            Some(0),
            &ids_view(&[id]),
            &ids_view(&neg),
            None,
            Stream::DEFAULT
        ),
        Err(Error::OutOfRange(_))
    ));
    assert!(matches!(
        run(&p, &[id], &x, false),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        run(&p, &[id], &x3, true),
        Err(Error::InvalidArgument(_))
    ));
    let zero = [0i32];
    p.commit(
        Some(0),
        &ids_view(&[id]),
        &ids_view(&zero),
        None,
        Stream::DEFAULT,
    )
    .unwrap();
    same(&p); // rejecting every draft leaves the sequence as it was
              // Wrong dtypes and shapes.
    let ids = [id];
    let idv = ids_view(&ids);
    let f = [0f32; 1];
    let fv =
        TensorView::contiguous(f.as_ptr() as usize, DType::F32, MemoryKind::Host, &[1]).unwrap();
    assert!(matches!(
        p.commit(Some(0), &fv, &ids_view(&one), None, Stream::DEFAULT),
        Err(Error::DTypeMismatch(_))
    ));
    assert!(matches!(
        p.flush(Some(3), &idv, Stream::DEFAULT),
        Err(Error::OutOfRange(_))
    ));
    let wrong =
        TensorView::contiguous(f.as_ptr() as usize, DType::F32, MemoryKind::Host, &[1, 1]).unwrap();
    assert!(matches!(
        p.import_state(0, id, &wrong, None, Stream::DEFAULT),
        Err(Error::InvalidArgument(_))
    ));
    same(&p);
    // Bad configurations.
    let mut bad = c;
    bad.v_heads = 3;
    bad.k_heads = 2;
    assert!(matches!(
        GdnPool::new(cpu_ctx(), bad, None),
        Err(Error::InvalidArgument(_))
    ));
    let mut bad = c;
    bad.max_drafts = 9;
    assert!(matches!(
        GdnPool::new(cpu_ctx(), bad, None),
        Err(Error::OutOfRange(_))
    ));
    let mut bad = c;
    bad.state_dtype = DType::F16;
    assert!(matches!(
        GdnPool::new(cpu_ctx(), bad, None),
        Err(Error::DTypeMismatch(_))
    ));
    let _ = Arc::clone(p.context());
}
