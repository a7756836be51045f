//! Mamba-2 and linear-attention replay on the CPU backend against independent f64
//! references (tests/common/ssm.rs): decode across flushes, speculative verify + commit with
//! random accepted counts and the conv window, KV-only transitions, recurrent pools,
//! `materialize` at every ring prefix, and bad input.

#![allow(clippy::needless_range_loop)]

mod common;

use std::collections::VecDeque;

use common::gdn::{cpu_ctx, rel_err};
use common::ssm::*;
use common::Rng;
use kvreplay::linear::{Mamba2Io, Mamba2Options, ReplayConfig, StateLayout};
use kvreplay::{DType, Error, MemoryKind, Stream, TensorView};

/// Per (row, layer): the reference and its states after each of the last committed tokens.
struct Track {
    r: Reference,
    /// (tokens committed, state) for the most recent positions, oldest first.
    hist: VecDeque<(usize, Vec<Vec<f64>>)>,
    len: usize,
}

impl Track {
    fn new(c: &ReplayConfig, kind: Kind) -> Track {
        let r = Reference::new(c, kind);
        let mut hist = VecDeque::new();
        hist.push_back((0, r.state.clone()));
        Track { r, hist, len: 0 }
    }
    fn commit(&mut self, r: Reference) {
        self.r = r;
        self.len += 1;
        self.hist.push_back((self.len, self.r.state.clone()));
        if self.hist.len() > 80 {
            self.hist.pop_front();
        }
    }
    fn state_at(&self, len: usize) -> &Vec<Vec<f64>> {
        &self.hist.iter().find(|(l, _)| *l == len).expect("kept").1
    }
}

/// Decode and speculative rounds on 3 rows x 2 layers (rows join at different steps); every
/// output, conv window, materialized prefix and final state against the reference.
/// Returns (worst relative error, steps run).
fn session(c: ReplayConfig, kind: Kind, rounds: usize, seed: u64) -> (f64, usize) {
    let pool = Pool::new(cpu_ctx(), c, kind);
    let mut rng = Rng::new(seed);
    let prm: Vec<Params> = (0..c.layers).map(|_| random_params(&mut rng, &c)).collect();
    let b = 3;
    let mut ids = vec![-1i32; b];
    let mut tr: Vec<Vec<Track>> = (0..b)
        .map(|_| (0..c.layers).map(|_| Track::new(&c, kind)).collect())
        .collect();
    let k1 = c.conv_kernel - 1;
    // The last k1 + 8 accepted conv inputs per row (zeros before the first).
    let keep_conv = k1 + 8;
    let mut conv_hist: Vec<VecDeque<Vec<f32>>> =
        vec![VecDeque::from(vec![vec![0.0; c.conv_dim]; keep_conv]); b];
    let (mut worst, mut steps) = (0f64, 0usize);
    let n = c.v_heads * c.dv;
    let mut saw_kv_transition = false;
    for round in 0..rounds {
        for (r, id) in ids.iter_mut().enumerate() {
            if *id < 0 && round >= 3 * r {
                *id = pool.seq_add();
            }
        }
        let spec = c.max_drafts > 1 && round % 3 == 2;
        let t = if spec { 1 + rng.below(c.max_drafts) } else { 1 };
        let x = random_tokens(&mut rng, &c, kind, b, t);
        let mode_before: Vec<i32> = ids
            .iter()
            .map(|&id| if id >= 0 { pool.meta(0, id)[0] } else { -1 })
            .collect();
        let accepted: Vec<i32> = (0..b)
            .map(|r| {
                if !spec {
                    1
                } else {
                    match (round + r) % 4 {
                        0 => 0,
                        1 => t as i32,
                        _ => rng.below(t + 1) as i32,
                    }
                }
            })
            .collect();
        let mut outs = Vec::new();
        for l in 0..c.layers {
            outs.push(pool.run(l, kind, &prm[l], &ids, &x, spec).unwrap());
        }
        let conv = if spec {
            Some(pool.commit(&ids, &accepted).unwrap())
        } else {
            None
        };
        steps += 1;
        for r in 0..b {
            if ids[r] < 0 {
                for l in 0..c.layers {
                    assert!(outs[l][r * t * n..(r + 1) * t * n]
                        .iter()
                        .all(|&v| v == 0.0));
                }
                continue;
            }
            for l in 0..c.layers {
                let mut probe = tr[r][l].r.clone();
                for s in 0..t {
                    let want = probe.step(&prm[l], &x, r, s);
                    let o = (r * t + s) * n;
                    worst = worst.max(rel_err(&outs[l][o..o + n], &want, c.dv));
                    if s < accepted[r] as usize {
                        tr[r][l].commit(probe.clone());
                    }
                }
            }
            for s in 0..accepted[r] as usize {
                let o = (r * t + s) * c.conv_dim;
                conv_hist[r].push_back(x.conv[o..o + c.conv_dim].to_vec());
                conv_hist[r].pop_front();
            }
            if let Some(cw) = &conv {
                for i in 0..k1 {
                    let o = (r * k1 + i) * c.conv_dim;
                    assert_eq!(
                        &cw[o..o + c.conv_dim],
                        conv_hist[r][keep_conv - k1 + i].as_slice(),
                        "round {round} row {r} conv"
                    );
                }
            }
            let m = pool.meta(0, ids[r]);
            if mode_before[r] == 0 && m[0] == 1 {
                saw_kv_transition = true;
            }
        }
        // Materialize one row at every prefix its ring holds (conv while it is kept).
        if round % 5 == 4 {
            let r = round % b;
            if ids[r] >= 0 {
                let fill = pool.fill(0, ids[r]);
                assert_eq!(fill, pool.fill(1, ids[r]), "layers step together");
                let len = tr[r][0].len;
                for keep in 0..=fill {
                    let back = fill - keep;
                    let with_conv = c.conv_dim > 0 && back == 0;
                    let (states, cw) = pool.materialize(ids[r], keep, with_conv).unwrap();
                    for l in 0..c.layers {
                        let want = tr[r][l].state_at(len - back);
                        for h in 0..c.v_heads {
                            let g: Vec<f32> = states[l][h].iter().map(|&v| v as f32).collect();
                            worst = worst.max(rel_err(&g, &want[h], c.dk));
                        }
                    }
                    if with_conv {
                        // The window that ends `back` tokens before the newest.
                        let end = conv_hist[r].len() - back;
                        for l in 0..c.layers {
                            for i in 0..k1 {
                                let o = (l * k1 + i) * c.conv_dim;
                                let want = &conv_hist[r][end - k1 + i];
                                assert_eq!(&cw[o..o + c.conv_dim], want.as_slice(), "back {back}");
                            }
                        }
                    }
                }
                assert!(matches!(
                    pool.materialize(ids[r], fill + 1, false),
                    Err(Error::OutOfRange(_))
                ));
                if c.conv_dim > 0 && fill > 0 {
                    assert!(pool.materialize(ids[r], fill - 1, true).is_err());
                }
            }
        }
        if round == rounds / 2 {
            pool.seq_free(ids[1]);
            ids[1] = pool.seq_add();
            tr[1] = (0..c.layers).map(|_| Track::new(&c, kind)).collect();
            conv_hist[1] = VecDeque::from(vec![vec![0.0; c.conv_dim]; keep_conv]);
        }
    }
    if c.kv_only_threshold > 0 {
        assert!(saw_kv_transition, "no KV-only -> replay transition");
    }
    for r in 0..b {
        let (states, _) = pool
            .materialize(ids[r], pool.fill(0, ids[r]), false)
            .unwrap();
        for l in 0..c.layers {
            for h in 0..c.v_heads {
                let g: Vec<f32> = states[l][h].iter().map(|&v| v as f32).collect();
                worst = worst.max(rel_err(&g, &tr[r][l].r.state[h], c.dk));
            }
        }
    }
    (worst, steps)
}

fn kinds() -> Vec<Kind> {
    vec![
        MAMBA2,
        Kind::Mamba2 {
            z: false,
            d: false,
            bias: false,
            softplus: false,
            limits: (0.0, f32::INFINITY),
        },
        Kind::Mamba2 {
            z: true,
            d: false,
            bias: true,
            softplus: true,
            limits: (0.05, 0.5),
        },
        Kind::Lin(Decay::None),
        Kind::Lin(Decay::Head),
        Kind::Lin(Decay::Token),
    ]
}

#[test]
fn replay_verify_commit_and_materialize_equal_the_references() {
    let mut worst = 0f64;
    let mut steps = 0;
    for (i, kind) in kinds().into_iter().enumerate() {
        for (j, (ring, tau, layout, conv)) in [
            (16usize, 0usize, StateLayout::VMajor, 12usize),
            (4, 0, StateLayout::KMajor, 0),
            (0, 0, StateLayout::VMajor, 12), // recurrent: verify keeps per-draft snapshots
            (16, 5, StateLayout::KMajor, 12), // KV-only for the first tokens
        ]
        .into_iter()
        .enumerate()
        {
            let c = config(ring, tau, layout, conv);
            let rounds = if ring == 16 && tau == 0 { 200 } else { 60 };
            let (e, s) = session(c, kind, rounds, 100 + 10 * i as u64 + j as u64);
            assert!(e < 2e-4, "{kind:?} ring {ring} tau {tau} {layout:?}: {e:e}");
            worst = worst.max(e);
            steps += s;
        }
    }
    assert!(steps >= 2048);
    println!("{steps} rounds over 6 kinds x 4 pools: max relative error {worst:.2e} vs f64");
}

/// Long decode-only run across many flushes (ring 16), Mamba-2 at the default options.
#[test]
fn mamba2_decode_2048_steps() {
    let (e, s) = session(config(16, 0, StateLayout::VMajor, 0), MAMBA2, 2048, 9);
    assert!(e < 2e-4, "{e:e}");
    assert_eq!(s, 2048);
}

fn hv(data: &[f32], shape: &[usize]) -> TensorView {
    TensorView::contiguous(data.as_ptr() as usize, DType::F32, MemoryKind::Host, shape).unwrap()
}

#[test]
fn bad_mamba2_calls_fail_and_change_nothing() {
    let c = config(16, 0, StateLayout::VMajor, 0);
    let pool = Pool::new(cpu_ctx(), c, MAMBA2);
    let Pool::Mamba2(p) = &pool else {
        unreachable!()
    };
    let mut rng = Rng::new(5);
    let prm = random_params(&mut rng, &c);
    let id = pool.seq_add();
    let x = random_tokens(&mut rng, &c, MAMBA2, 1, 1);
    pool.run(0, MAMBA2, &prm, &[id], &x, false).unwrap();
    let before = pool.materialize(id, 0, false).unwrap().0;
    let meta = pool.meta(0, id);
    let ids = [id];
    let idv = ids_view(&ids);
    let xv = hv(&x.v, &[1, 1, 4, 32]);
    let dt = hv(&x.g, &[1, 1, 4]);
    let bm = hv(&x.k, &[1, 1, 2, 32]);
    let a = hv(&prm.a, &[4]);
    let a_bad = hv(&prm.a, &[3]);
    let wrong_x = hv(&x.v, &[1, 1, 8, 16]);
    let mut out = vec![0f32; 128];
    let o = hv(&out, &[1, 1, 4, 32]);
    let io = Mamba2Io {
        seq_ids: &idv,
        x: &xv,
        dt: &dt,
        a: &a,
        b: &bm,
        c: &bm,
        d: None,
        z: None,
        dt_bias: None,
        out: &o,
        conv_in: None,
    };
    let s = Stream::DEFAULT;
    let opts = Mamba2Options::default();
    let cases: Vec<(Mamba2Io<'_>, Mamba2Options)> = vec![
        (Mamba2Io { a: &a_bad, ..io }, opts),
        (Mamba2Io { x: &wrong_x, ..io }, opts),
        (Mamba2Io { b: &xv, ..io }, opts),
        (
            Mamba2Io {
                d: Some(&a_bad),
                ..io
            },
            opts,
        ),
        (Mamba2Io { z: Some(&bm), ..io }, opts),
        (
            Mamba2Io {
                conv_in: Some(&dt),
                ..io
            },
            opts,
        ),
        (
            io,
            Mamba2Options {
                dt_min: 1.0,
                dt_max: 0.5,
                ..opts
            },
        ),
        (
            io,
            Mamba2Options {
                dt_min: f32::NAN,
                ..opts
            },
        ),
    ];
    for (i, (io, o)) in cases.iter().enumerate() {
        assert!(p.decode(0, io, o, s).is_err(), "case {i}");
        assert!(p.verify(0, io, o, s).is_err(), "case {i}");
    }
    // A bad materialize: wrong shapes, keep past the fill.
    let mut small = vec![0f32; 8];
    let sv = TensorView::contiguous(
        small.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[8],
    )
    .unwrap();
    assert!(p.materialize(id, 0, &sv, None, s).is_err());
    assert!(matches!(
        pool.materialize(id, 99, false),
        Err(Error::OutOfRange(_))
    ));
    assert!(
        pool.materialize(id, 0, true).is_err(),
        "no conv window kept"
    );
    out.iter_mut().for_each(|v| *v = 1.0);
    assert_eq!(pool.meta(0, id), meta);
    assert_eq!(pool.materialize(id, 0, false).unwrap().0, before);
}
