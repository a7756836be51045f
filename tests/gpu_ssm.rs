//! GPU: Mamba-2 and linear-attention pools (the shared kernels' additive rule, Mamba-2's dt
//! gate, skip and z gate) and `materialize` against the CPU backend on the same random
//! data: decode across flushes, speculative verify + commit with random accepted counts
//! (conv windows compared exactly), recurrent and KV-only pools, both layouts, every ring
//! prefix materialized. Every output element is checked. Skips itself without a GPU.

#![allow(clippy::needless_range_loop)]

mod common;

use std::sync::Arc;

use common::gdn::rel_err;
use common::gpu::{gpu_or_skip, sanitizer_scaled};
use common::kv::cpu_context;
use common::ssm::*;
use common::Rng;
use kvreplay::linear::{ReplayConfig, StateLayout};

fn err(cpu: &[f32], gpu: &[f32], d: usize) -> f64 {
    let want: Vec<f64> = cpu.iter().map(|&x| x as f64).collect();
    rel_err(gpu, &want, d)
}

/// Same rounds on a CPU and a CUDA pool; returns the worst relative difference.
fn pair_session(
    g: &Arc<kvreplay::Context>,
    c: ReplayConfig,
    kind: Kind,
    rounds: usize,
    seed: u64,
) -> f64 {
    let cpu = Pool::new(cpu_context(2), c, kind);
    let gpu = Pool::new(g.clone(), c, kind);
    let mut rng = Rng::new(seed);
    let prm: Vec<Params> = (0..c.layers).map(|_| random_params(&mut rng, &c)).collect();
    let b = 5;
    let ids: Vec<i32> = (0..b)
        .map(|_| {
            let (x, y) = (cpu.seq_add(), gpu.seq_add());
            assert_eq!(x, y);
            x
        })
        .collect();
    let mut worst = 0f64;
    for round in 0..rounds {
        let spec = c.max_drafts > 1 && round % 3 != 0;
        let t = if spec { 1 + rng.below(c.max_drafts) } else { 1 };
        let x = random_tokens(&mut rng, &c, kind, b, t);
        // Row 3 is an unused row in some rounds.
        let mut row_ids = ids.clone();
        if round % 4 == 1 {
            row_ids[3] = -1;
        }
        for l in 0..c.layers {
            let a = cpu.run(l, kind, &prm[l], &row_ids, &x, spec).unwrap();
            let bb = gpu.run(l, kind, &prm[l], &row_ids, &x, spec).unwrap();
            worst = worst.max(err(&a, &bb, c.dv));
        }
        if spec {
            let acc: Vec<i32> = (0..b).map(|_| rng.below(t + 1) as i32).collect();
            for l in 0..c.layers {
                let a = cpu.commit_layer(l, &row_ids, &acc).unwrap();
                let bb = gpu.commit_layer(l, &row_ids, &acc).unwrap();
                if c.conv_dim > 0 {
                    // Bit for bit (unused rows are left unwritten: NaN on both sides).
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&bb), "conv windows, round {round} layer {l}");
                }
            }
        }
        for &id in &ids {
            for l in 0..c.layers {
                assert_eq!(
                    cpu.meta(l, id)[..5],
                    gpu.meta(l, id)[..5],
                    "metadata round {round}"
                );
            }
        }
        if round % 6 == 5 {
            let id = ids[round % b];
            let fill = cpu.fill(0, id);
            for keep in 0..=fill {
                let with_conv = c.conv_dim > 0 && keep == fill;
                let (sa, ca) = cpu.materialize(id, keep, with_conv).unwrap();
                let (sb, cb) = gpu.materialize(id, keep, with_conv).unwrap();
                for l in 0..c.layers {
                    for h in 0..c.v_heads {
                        let ga: Vec<f32> = sb[l][h].iter().map(|&v| v as f32).collect();
                        worst = worst.max(rel_err(&ga, &sa[l][h], c.dk));
                    }
                }
                if with_conv {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&ca), bits(&cb), "materialized conv windows");
                }
            }
        }
    }
    worst
}

#[test]
fn gpu_mamba2_and_linear_attention_match_cpu() {
    let Some(g) = gpu_or_skip("gpu_mamba2_and_linear_attention_match_cpu").map(Arc::new) else {
        return;
    };
    let kinds = [
        MAMBA2,
        Kind::Mamba2 {
            z: false,
            d: true,
            bias: false,
            softplus: true,
            limits: (0.05, 0.8),
        },
        Kind::Lin(Decay::None),
        Kind::Lin(Decay::Head),
        Kind::Lin(Decay::Token),
    ];
    let mut worst = 0f64;
    let mut cases = 0;
    for (i, kind) in kinds.into_iter().enumerate() {
        for (j, (ring, tau, layout, conv)) in [
            (16usize, 0usize, StateLayout::VMajor, 12usize),
            (16, 0, StateLayout::KMajor, 0),
            (4, 0, StateLayout::VMajor, 0),
            (0, 0, StateLayout::VMajor, 12),
            (0, 0, StateLayout::VMajor, 0), // recurrent without a prep kernel: kvr_gdn_wrec
            (16, 5, StateLayout::KMajor, 12),
        ]
        .into_iter()
        .enumerate()
        {
            let c = config(ring, tau, layout, conv);
            let steps = sanitizer_scaled(48, 16);
            let e = pair_session(&g, c, kind, steps, 300 + 10 * i as u64 + j as u64);
            assert!(e < 2e-4, "{kind:?} ring {ring} tau {tau} {layout:?}: {e:e}");
            worst = worst.max(e);
            cases += 1;
        }
    }
    // Head dims the streaming kernels take (dk 64: the warp-streaming decode, its prep kernel
    // with 4 warps per group of 8 heads, the warp-streaming verify of both layouts; recurrent
    // decode on the warp kernel), every kind.
    for (i, kind) in kinds.into_iter().enumerate() {
        for (j, (ring, tau, layout, conv)) in [
            (16usize, 0usize, StateLayout::VMajor, 12usize),
            (16, 0, StateLayout::KMajor, 0),
            (0, 0, StateLayout::VMajor, 12),
            (0, 0, StateLayout::VMajor, 0),
            // KV-only mode on a shape of kvr_gdn_kvdec: the rows' decodes take it until
            // they materialize (kvr_gdn_kvmat) mid-session.
            (16, 24, StateLayout::VMajor, 12),
            (16, 24, StateLayout::KMajor, 0),
        ]
        .into_iter()
        .enumerate()
        {
            let mut c = config(ring, tau, layout, conv);
            (c.k_heads, c.v_heads, c.dk, c.dv) = (2, 16, 64, 64);
            let steps = sanitizer_scaled(40, 12);
            let e = pair_session(&g, c, kind, steps, 700 + 10 * i as u64 + j as u64);
            assert!(
                e < 2e-4,
                "dk 64: {kind:?} ring {ring} tau {tau} {layout:?}: {e:e}"
            );
            worst = worst.max(e);
            cases += 1;
        }
    }
    // The Nemotron-H shape (128 heads of 64, 8 groups of 128), V-major: ring 16; the same with
    // KV-only mode (threshold 20: kvr_gdn_kvdec at dk 128, dv 64, then the replay kernels;
    // its worst difference, 5.4e-4 on the H200, is the same with the older kernels,
    // KVR_GDN_KVDEC=0: the f32 sums of 128-key states built from 20 entries); recurrent mode
    // without a conv window (kvr_gdn_wrec, 64-row heads).
    for (what, ring, tau, steps, seed, bound) in [
        ("ring 16", 16, 0, sanitizer_scaled(24, 8), 9, 2e-4),
        ("KV-only mode", 16, 20, sanitizer_scaled(40, 12), 11, 1e-3),
        ("recurrent", 0, 0, sanitizer_scaled(24, 8), 10, 2e-4),
    ] {
        let mut c = config(ring, tau, StateLayout::VMajor, 0);
        (c.k_heads, c.v_heads, c.dk, c.dv, c.layers) = (8, 128, 128, 64, 1);
        let e = pair_session(&g, c, MAMBA2, steps, seed);
        assert!(e < bound, "Nemotron-H shape, {what}: {e:e}");
        worst = worst.max(e);
        cases += 1;
    }
    println!("{cases} configurations: GPU vs CPU max relative error {worst:.2e}");
}

/// Mamba-2 decode with the dtypes engines pass (bf16 x, B, C, z and output; f32 dt, A, D,
/// dt_bias) on shapes that take the specialized one-launch kernel
/// (kvr_gdn_fdecode_*_m2bf16: dk 128, ring 16 or 32, f32 entries) and one that does not
/// (bf16 entries), f32 and bf16 states.
#[test]
fn gpu_mamba2_engine_dtypes_match_cpu() {
    let Some(g) = gpu_or_skip("gpu_mamba2_engine_dtypes_match_cpu").map(Arc::new) else {
        return;
    };
    use kvreplay::DType::{BF16, F32};
    let mut report = Vec::new();
    for (i, (ring, state, entry)) in [
        (16, F32, F32),
        (32, BF16, F32),
        (16, F32, BF16),
        (32, F32, F32),
        (16, BF16, F32),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = config(ring, 0, StateLayout::VMajor, 0);
        (c.k_heads, c.v_heads, c.dk, c.dv, c.layers) = (2, 8, 128, 64, 1);
        (c.state_dtype, c.entry_dtype) = (state, entry);
        let cpu = Pool::new(cpu_context(2), c, MAMBA2);
        let gpu = Pool::new(g.clone(), c, MAMBA2);
        let mut rng = Rng::new(70 + i as u64);
        let prm = random_params(&mut rng, &c);
        let ids: Vec<i32> = (0..3)
            .map(|_| {
                let (x, y) = (cpu.seq_add(), gpu.seq_add());
                assert_eq!(x, y);
                x
            })
            .collect();
        let mut worst = 0f64;
        for round in 0..sanitizer_scaled(2 * ring + 5, ring + 2) {
            let x = random_tokens(&mut rng, &c, MAMBA2, ids.len(), 1);
            let a = cpu.run_as(0, MAMBA2, &prm, &ids, &x, false, BF16).unwrap();
            let b = gpu.run_as(0, MAMBA2, &prm, &ids, &x, false, BF16).unwrap();
            assert!(
                b.iter().all(|v| v.is_finite()),
                "round {round}: non-finite output"
            );
            let e = err(&a, &b, c.dv);
            // bf16 outputs: each side rounds its own result (one bf16 step apart at most);
            // bf16 states and entries round along the way.
            let tol = if state == BF16 || entry == BF16 {
                5e-2
            } else {
                1e-2
            };
            assert!(e < tol, "ring {ring} {state}/{entry} round {round}: {e:e}");
            worst = worst.max(e);
            // Verify rounds with these dtypes (f32 entries: the specialized warp-streaming verify
            // kernels), then a commit of some of the drafts.
            if round % 3 == 2 {
                let t = 1 + round % 8;
                let xv = random_tokens(&mut rng, &c, MAMBA2, ids.len(), t);
                let a = cpu.run_as(0, MAMBA2, &prm, &ids, &xv, true, BF16).unwrap();
                let b = gpu.run_as(0, MAMBA2, &prm, &ids, &xv, true, BF16).unwrap();
                let e = err(&a, &b, c.dv);
                assert!(
                    e < tol,
                    "ring {ring} {state}/{entry} verify round {round} T {t}: {e:e}"
                );
                worst = worst.max(e);
                let acc: Vec<i32> = (0..ids.len())
                    .map(|r| ((round + r) % (t + 1)) as i32)
                    .collect();
                cpu.commit(&ids, &acc).unwrap();
                gpu.commit(&ids, &acc).unwrap();
            }
            for &id in &ids {
                assert_eq!(cpu.meta(0, id)[..5], gpu.meta(0, id)[..5], "round {round}");
            }
        }
        report.push(format!(
            "ring {ring} state {state} entries {entry}: {worst:.1e}"
        ));
    }
    println!(
        "Mamba-2, bf16 x/B/C/z/out, vs CPU (max relative error):\n  {}",
        report.join("\n  ")
    );
}
