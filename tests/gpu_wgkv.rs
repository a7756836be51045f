//! GPU: the write-gated pool on CUDA against the same pool on the CPU, on the same data:
//! prefill and single-token appends (host and device K/V), drafts verified with T query
//! tokens, commit and rollback, a copy-on-write fork, folded and per-head decodes; device
//! steps (`reserve` + `step`: the gate and the ring update on the device, also replayed
//! from a CUDA graph) against host appends of the same tokens and scores; every output
//! element compared, and both compared with the fp64 reference over the kept tokens. Skips
//! itself (printing why) without a GPU.

mod common;

use std::sync::Arc;

use common::gpu::*;
use common::wgkv::*;
use common::Rng;
use kvreplay::backend::cuda::memory::DeviceBuffer;
use kvreplay::kv::wgkv::{WgKvConfig, WgKvPool};
use kvreplay::kv::{DecodeIo, DecodeOptions};
use kvreplay::{Context, DType, MemoryKind, Stream, TensorView};

const S: Stream = Stream::DEFAULT;

struct Both {
    cpu: WgKvPool,
    gpu: WgKvPool,
    gctx: Arc<Context>,
    cfg: WgKvConfig,
}

fn upload(ctx: &Context, data: &[f32]) -> DeviceBuffer {
    let b = alloc(ctx, std::mem::size_of_val(data).max(16));
    b.upload(data).unwrap();
    b
}

impl Both {
    fn append(
        &self,
        m: &mut SeqModel,
        rng: &mut Rng,
        seq: i32,
        n: usize,
        draft: bool,
        from_device: bool,
    ) {
        let c = self.cfg;
        let (k, v, s) = random_tokens(rng, c.layers, n, c.kv_heads, c.head_dim);
        let shape = [c.layers, n, c.kv_heads, c.head_dim];
        self.cpu
            .append(
                seq,
                None,
                &view(&k, &shape),
                &view(&v, &shape),
                &s,
                draft,
                S,
            )
            .unwrap();
        if from_device {
            let (kd, vd) = (upload(&self.gctx, &k), upload(&self.gctx, &v));
            let kv =
                TensorView::contiguous(kd.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
            let vv =
                TensorView::contiguous(vd.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
            self.gpu.append(seq, None, &kv, &vv, &s, draft, S).unwrap();
            self.gctx.synchronize(S).unwrap();
        } else {
            self.gpu
                .append(
                    seq,
                    None,
                    &view(&k, &shape),
                    &view(&v, &shape),
                    &s,
                    draft,
                    S,
                )
                .unwrap();
        }
        record(m, &c, 0..c.layers, n, &k, &v, &s, draft);
    }

    /// Decodes both pools; returns (max |gpu - cpu| relative, max error against fp64).
    fn compare(
        &self,
        rng: &mut Rng,
        seqs: &[(i32, &SeqModel)],
        t: usize,
        g: usize,
        strided: bool,
    ) -> (f64, f64) {
        let c = self.cfg;
        let hq = c.kv_heads * g;
        let d = c.head_dim;
        let mut worst = (0f64, 0f64);
        for layer in 0..c.layers {
            let ids: Vec<i32> = seqs.iter().map(|s| s.0).collect();
            let b = ids.len();
            // Strided: each batch row padded by one head (not foldable: one decode per head).
            let pad = if strided { d } else { 0 };
            let row = t * hq * d + pad;
            let q = rng.vec(b * row, -1.0, 1.0);
            let shape = [b, t, hq, d];
            let strides = [row as isize, (hq * d) as isize, d as isize, 1];
            let mut cpu_out = vec![f32::NAN; b * row];
            let idv =
                TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[b])
                    .unwrap();
            let qh = TensorView::new(
                q.as_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &shape,
                &strides,
            )
            .unwrap();
            let oh = TensorView::new(
                cpu_out.as_mut_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &shape,
                &strides,
            )
            .unwrap();
            let opts = DecodeOptions::default();
            self.cpu
                .decode(
                    layer,
                    &DecodeIo {
                        seq_ids: &idv,
                        q: &qh,
                        out: &oh,
                        lse: None,
                    },
                    &opts,
                    S,
                )
                .unwrap();
            let qd = upload(&self.gctx, &q);
            let od = alloc(&self.gctx, b * row * 4);
            od.fill_async(cuda(&self.gctx), 0xff, S).unwrap();
            let qg =
                TensorView::new(qd.addr(), DType::F32, MemoryKind::Cuda, &shape, &strides).unwrap();
            let og =
                TensorView::new(od.addr(), DType::F32, MemoryKind::Cuda, &shape, &strides).unwrap();
            self.gpu
                .decode(
                    layer,
                    &DecodeIo {
                        seq_ids: &idv,
                        q: &qg,
                        out: &og,
                        lse: None,
                    },
                    &opts,
                    S,
                )
                .unwrap();
            self.gctx.synchronize(S).unwrap();
            let mut gpu_out = vec![0f32; b * row];
            od.download(&mut gpu_out).unwrap();
            // Packed copies for the reference.
            let pick = |v: &[f32]| -> Vec<f32> {
                (0..b)
                    .flat_map(|i| v[i * row..i * row + t * hq * d].to_vec())
                    .collect()
            };
            let (qp, cp, gp) = (pick(&q), pick(&cpu_out), pick(&gpu_out));
            let models: Vec<Option<&SeqModel>> = seqs.iter().map(|s| Some(s.1)).collect();
            let want = reference(&models, &c, layer, &qp, t, hq, 1.0 / (d as f64).sqrt());
            let cpu64: Vec<f64> = cp.iter().map(|&x| x as f64).collect();
            worst.0 = worst.0.max(max_err(&gp, &cpu64));
            worst.1 = worst.1.max(max_err(&gp, &want));
        }
        worst
    }
}

fn both(test: &str, cfg: WgKvConfig) -> Option<Both> {
    let g = Arc::new(gpu_or_skip(test)?);
    Some(Both {
        cpu: WgKvPool::new(cpu_ctx(), cfg).unwrap(),
        gpu: WgKvPool::new(Arc::clone(&g), cfg).unwrap(),
        gctx: g,
        cfg,
    })
}

#[test]
fn gpu_wgkv_matches_cpu_element_wise() {
    for (dtype, d, ps, w, g) in [
        (DType::F16, 128, 16, 64, 4),
        (DType::BF16, 64, 4, 32, 2),
        (DType::F16, 64, 1, 8, 8),
    ] {
        let mut cfg = config(2, 2, d, ps, w, dtype, 20000);
        cfg.sinks = 2;
        let Some(p) = both("gpu_wgkv_matches_cpu_element_wise", cfg) else {
            return;
        };
        let tol = if dtype == DType::BF16 { 3e-2 } else { 6e-3 };
        let mut rng = Rng::new(99);
        let a = p.cpu.seq_add(S).unwrap();
        assert_eq!(p.gpu.seq_add(S).unwrap(), a);
        let b = p.cpu.seq_add(S).unwrap();
        assert_eq!(p.gpu.seq_add(S).unwrap(), b);
        let (mut ma, mut mb) = (SeqModel::new(4), SeqModel::new(4));
        p.append(&mut ma, &mut rng, a, 700, false, false);
        p.append(&mut mb, &mut rng, b, 5, false, true);
        let check = |e: (f64, f64), what: &str| {
            assert!(e.0 < tol && e.1 < tol, "{dtype} d{d} p{ps}: {what}: {e:?}")
        };
        check(
            p.compare(&mut rng, &[(a, &ma), (b, &mb)], 1, g, false),
            "prefill",
        );
        check(
            p.compare(&mut rng, &[(b, &mb), (a, &ma)], 1, g, true),
            "prefill, per head",
        );
        for step in 0..20 {
            p.append(&mut ma, &mut rng, a, 1, false, step % 2 == 0);
            p.append(&mut mb, &mut rng, b, 1 + step % 3, false, false);
            check(
                p.compare(&mut rng, &[(a, &ma), (b, &mb)], 1, g, false),
                "step",
            );
        }
        // Drafts: verify T = 4, roll back 1, accept 2.
        p.append(&mut ma, &mut rng, a, 4, true, false);
        check(p.compare(&mut rng, &[(a, &ma)], 4, g, false), "verify");
        let c = ma.rows[0].0.len();
        for pool in [&p.cpu, &p.gpu] {
            pool.truncate(a, c + 3, S).unwrap();
            pool.commit(a, 2, S).unwrap();
        }
        for r in &mut ma.rows {
            r.1.truncate(3);
        }
        commit(&mut ma, 2);
        check(
            p.compare(&mut rng, &[(a, &ma), (b, &mb)], 1, g, false),
            "after commit",
        );
        // Fork, both sides grow (copy-on-write of ring pages on the device).
        let f = p.cpu.seq_fork(a, S).unwrap();
        assert_eq!(p.gpu.seq_fork(a, S).unwrap(), f);
        let mut mf = ma.clone();
        for _ in 0..10 {
            p.append(&mut ma, &mut rng, a, 1, false, false);
            p.append(&mut mf, &mut rng, f, 1, false, true);
        }
        check(
            p.compare(&mut rng, &[(a, &ma), (f, &mf), (b, &mb)], 1, g, false),
            "fork",
        );
        assert_eq!(p.cpu.stats().unwrap(), p.gpu.stats().unwrap());
        for (cr, gr) in [
            (p.cpu.seq_rows(a), p.gpu.seq_rows(a)),
            (p.cpu.seq_rows(f), p.gpu.seq_rows(f)),
        ] {
            assert_eq!(cr.unwrap(), gr.unwrap());
        }
    }
}

/// Device f32 tensor of `shape` holding `data`.
fn dev_view(buf: &DeviceBuffer, shape: &[usize]) -> TensorView {
    TensorView::contiguous(buf.addr(), DType::F32, MemoryKind::Cuda, shape).unwrap()
}

impl Both {
    /// One device step of `layer` for `ids` on the GPU pool (gate or given scores); the
    /// CPU pool appends the same tokens with the scores the GPU used. Returns the largest
    /// gate score error against the fp64 formula.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        models: &mut [&mut SeqModel],
        rng: &mut Rng,
        ids: &[i32],
        layer: usize,
        gate: Option<&kvreplay::kv::wgkv::GateWeights>,
    ) -> f64 {
        let c = self.cfg;
        let (b, h, d) = (ids.len(), c.kv_heads, c.head_dim);
        let pre = rng.vec(b * h * d, -2.0, 2.0);
        let k = rng.vec(b * h * d, -1.0, 1.0);
        let v = rng.vec(b * h * d, -1.0, 1.0);
        let given = rng.vec(b * h, 0.0, 1.0);
        let (pd, kd, vd, gd) = (
            upload(&self.gctx, &pre),
            upload(&self.gctx, &k),
            upload(&self.gctx, &v),
            upload(&self.gctx, &given),
        );
        let od = alloc(&self.gctx, b * h * 4);
        let pv = dev_view(&pd, &[b, h, d]);
        let gv = dev_view(&gd, &[b, h]);
        self.gpu
            .step(
                layer,
                ids,
                gate.map(|_| &pv),
                &dev_view(&kd, &[b, h, d]),
                &dev_view(&vd, &[b, h, d]),
                if gate.is_some() { None } else { Some(&gv) },
                Some(&dev_view(&od, &[b, h])),
                S,
            )
            .unwrap();
        self.gctx.synchronize(S).unwrap();
        let mut out = vec![0f32; b * h];
        od.download(&mut out).unwrap();
        let mut worst = 0f64;
        for i in 0..b {
            let r = i * h * d..(i + 1) * h * d;
            let s = &out[i * h..(i + 1) * h];
            match gate {
                Some(g) => {
                    for (hh, &got) in s.iter().enumerate() {
                        let at = (i * h + hh) * d;
                        let want = gate_f64(g, layer, hh, &pre[at..at + d], &k[at..at + d]);
                        worst = worst.max((got as f64 - want).abs() / want.max(1e-2));
                    }
                }
                None => assert_eq!(s, &given[i * h..(i + 1) * h]),
            }
            let shape = [1, h, d];
            self.cpu
                .append(
                    ids[i],
                    Some(layer),
                    &view(&k[r.clone()], &shape),
                    &view(&v[r.clone()], &shape),
                    s,
                    false,
                    S,
                )
                .unwrap();
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
        worst
    }

    /// A random gate of `hid` hidden units on both pools and two sequences with `n[0]`
    /// tokens appended from host memory and `n[1]` from device memory, and their models.
    fn gated_pair(
        &self,
        rng: &mut Rng,
        hid: usize,
        n: [usize; 2],
    ) -> (kvreplay::kv::wgkv::GateWeights, [(i32, SeqModel); 2]) {
        let c = self.cfg;
        let (_, gate) = random_gate(rng, c.layers, c.kv_heads, c.head_dim, hid);
        self.cpu.set_gate(Some(gate.clone())).unwrap();
        self.gpu.set_gate(Some(gate.clone())).unwrap();
        let seqs = [0, 1].map(|i| {
            let s = self.cpu.seq_add(S).unwrap();
            assert_eq!(self.gpu.seq_add(S).unwrap(), s);
            let mut m = SeqModel::new(c.layers * c.kv_heads);
            self.append(&mut m, rng, s, n[i], false, i == 1);
            (s, m)
        });
        (gate, seqs)
    }

    fn same_rows(&self, seqs: &[i32]) {
        for &s in seqs {
            assert_eq!(self.cpu.seq_rows(s).unwrap(), self.gpu.seq_rows(s).unwrap());
        }
    }
}

#[test]
fn gpu_steps_match_cpu_appends_and_replay_in_graphs() {
    for (dtype, d, ps, w, hid, g) in [
        (DType::BF16, 128, 16, 32, 64, 4),
        (DType::F16, 64, 4, 8, 40, 2),
        (DType::BF16, 256, 2, 16, 96, 1),
    ] {
        let mut cfg = config(2, 2, d, ps, w, dtype, 20000);
        cfg.sinks = 1;
        let Some(p) = both("gpu_steps_match_cpu_appends_and_replay_in_graphs", cfg) else {
            return;
        };
        let what = format!("{dtype} d{d} p{ps} w{w}");
        let tol = if dtype == DType::BF16 { 3e-2 } else { 6e-3 };
        let mut rng = Rng::new(5);
        let (gate, [(a, mut ma), (b, mut mb)]) = p.gated_pair(&mut rng, hid, [9, 3 * w + 5]);
        let mut gate_err = 0f64;
        for (round, steps) in [3usize, 2 * w + 1, 1, 17].into_iter().enumerate() {
            p.gpu.reserve(a, steps, S).unwrap();
            p.gpu.reserve(b, steps, S).unwrap();
            let gated = (round % 2 == 0).then_some(&gate);
            for _ in 0..steps {
                for layer in 0..cfg.layers {
                    let e = p.step(&mut [&mut mb, &mut ma], &mut rng, &[b, a], layer, gated);
                    gate_err = gate_err.max(e);
                }
            }
            let e = p.compare(&mut rng, &[(a, &ma), (b, &mb)], 1, g, false);
            assert!(e.0 < tol && e.1 < tol, "{what}: round {round}: {e:?}");
            p.same_rows(&[a, b]);
        }
        assert!(gate_err < 1e-4, "{what}: gate scores off by {gate_err}");
        // A fork after steps: copy-on-write from the device-driven state.
        let f = p.cpu.seq_fork(a, S).unwrap();
        assert_eq!(p.gpu.seq_fork(a, S).unwrap(), f);
        let mut mf = ma.clone();
        p.gpu.reserve(f, 3, S).unwrap();
        for _ in 0..3 {
            for layer in 0..cfg.layers {
                p.step(&mut [&mut mf], &mut rng, &[f], layer, Some(&gate));
            }
        }
        p.append(&mut ma, &mut rng, a, 2, false, false);
        let e = p.compare(&mut rng, &[(a, &ma), (f, &mf), (b, &mb)], 1, g, false);
        assert!(e.0 < tol && e.1 < tol, "{what}: fork: {e:?}");
        p.same_rows(&[a, f, b]);
        // Graph: two layers' steps captured once, replayed within the budget, then once past
        // it (skipped, reported once by the next host read).
        let stream = RawStream::new(&p.gctx);
        let rs = Stream(stream.ptr() as usize);
        let (h, n) = (cfg.kv_heads, 2usize);
        let k = rng.vec(n * h * d, -1.0, 1.0);
        let v = rng.vec(n * h * d, -1.0, 1.0);
        let sc: Vec<f32> = (0..n * h).map(|i| [0.05, 0.9, 0.3][i % 3]).collect();
        let (kd, vd, sd) = (
            upload(&p.gctx, &k),
            upload(&p.gctx, &v),
            upload(&p.gctx, &sc),
        );
        let replays = 5;
        p.gpu.reserve(b, replays, rs).unwrap();
        p.gpu.reserve(f, replays, rs).unwrap();
        stream.sync();
        let ids = [f, b];
        let graph = stream.capture(|| {
            for layer in 0..cfg.layers {
                p.gpu
                    .step(
                        layer,
                        &ids,
                        None,
                        &dev_view(&kd, &[n, h, d]),
                        &dev_view(&vd, &[n, h, d]),
                        Some(&dev_view(&sd, &[n, h])),
                        None,
                        rs,
                    )
                    .unwrap();
            }
        });
        for _ in 0..replays {
            graph.launch(&stream);
            for (i, (&id, m)) in ids.iter().zip([&mut mf, &mut mb]).enumerate() {
                for layer in 0..cfg.layers {
                    let r = i * h * d..(i + 1) * h * d;
                    let s = &sc[i * h..(i + 1) * h];
                    let shape = [1, h, d];
                    p.cpu
                        .append(
                            id,
                            Some(layer),
                            &view(&k[r.clone()], &shape),
                            &view(&v[r.clone()], &shape),
                            s,
                            false,
                            S,
                        )
                        .unwrap();
                    record(m, &cfg, layer..layer + 1, 1, &k[r.clone()], &v[r], s, false);
                }
            }
        }
        stream.sync();
        let e = p.compare(&mut rng, &[(f, &mf), (b, &mb)], 1, g, false);
        assert!(e.0 < tol && e.1 < tol, "{what}: graph: {e:?}");
        p.same_rows(&[f, b]);
        graph.launch(&stream);
        stream.sync();
        for s in [b, f] {
            let err = p.gpu.seq_rows(s).unwrap_err();
            assert!(
                matches!(err, kvreplay::Error::PoolExhausted(_)),
                "{what}: {err}"
            );
        }
        p.same_rows(&[f, b]);
        // The budget was spent (and read back): the host refuses the next step at once.
        let e = p
            .gpu
            .step(
                0,
                &[b],
                None,
                &dev_view(&kd, &[1, h, d]),
                &dev_view(&vd, &[1, h, d]),
                Some(&dev_view(&sd, &[1, h])),
                None,
                rs,
            )
            .unwrap_err();
        assert!(matches!(e, kvreplay::Error::OutOfRange(_)), "{what}: {e}");
        assert_eq!(
            p.cpu.stats().unwrap().kept_tokens,
            p.gpu.stats().unwrap().kept_tokens
        );
        for s in [a, b, f] {
            p.cpu.seq_free(s, S).unwrap();
            p.gpu.seq_free(s, S).unwrap();
        }
        assert_eq!(p.gpu.stats().unwrap().pages_used, 0);
        println!("{what}: steps match (gate score error {gate_err:.2e})");
    }
}

/// Gated device steps of more sequences than a token tile (two tiles, more rows than the
/// mover CTA's warps) against host appends of the GPU's scores, sinks included; then a gated
/// step replayed from a graph past a row's budget: the row publishes no slot, the finishing
/// gate CTA skips it (no wait), and the next host read reports the exhaustion.
#[test]
fn gpu_gated_steps_of_many_sequences_match_cpu() {
    const N: usize = 20;
    let mut cfg = config(1, 2, 64, 4, 8, DType::BF16, 20000);
    cfg.max_seqs = N + 1;
    cfg.sinks = 2;
    let Some(p) = both("gpu_gated_steps_of_many_sequences_match_cpu", cfg) else {
        return;
    };
    let (h, d) = (cfg.kv_heads, cfg.head_dim);
    let mut rng = Rng::new(11);
    let (_, gate) = random_gate(&mut rng, cfg.layers, h, d, 40);
    p.cpu.set_gate(Some(gate.clone())).unwrap();
    p.gpu.set_gate(Some(gate.clone())).unwrap();
    let mut ids = Vec::new();
    let mut models = Vec::new();
    for i in 0..N {
        let s = p.cpu.seq_add(S).unwrap();
        assert_eq!(p.gpu.seq_add(S).unwrap(), s);
        let mut m = SeqModel::new(4);
        // Rows at every stage: empty, filling the ring, past it.
        p.append(&mut m, &mut rng, s, 1 + i % 13, false, false);
        ids.push(s);
        models.push(m);
    }
    let steps = 2 * cfg.local_window + 3;
    for &s in &ids {
        p.gpu.reserve(s, steps, S).unwrap();
    }
    let mut gate_err = 0f64;
    for _ in 0..steps {
        let mut ms: Vec<&mut SeqModel> = models.iter_mut().collect();
        gate_err = gate_err.max(p.step(&mut ms, &mut rng, &ids, 0, Some(&gate)));
    }
    let seqs: Vec<(i32, &SeqModel)> = ids.iter().copied().zip(models.iter()).collect();
    let e = p.compare(&mut rng, &seqs, 1, 2, false);
    assert!(e.0 < 3e-2 && e.1 < 3e-2, "{N} sequences: {e:?}");
    p.same_rows(&ids);
    assert!(gate_err < 1e-4, "gate scores off by {gate_err}");

    // Past the budget, gated, from a graph.
    let x = p.gpu.seq_add(S).unwrap();
    p.gpu
        .append(
            x,
            None,
            &view(&rng.vec(h * d, -1.0, 1.0), &[1, 1, h, d]),
            &view(&rng.vec(h * d, -1.0, 1.0), &[1, 1, h, d]),
            &[0.5; 2],
            false,
            S,
        )
        .unwrap();
    let stream = RawStream::new(&p.gctx);
    let rs = Stream(stream.ptr() as usize);
    let pre = upload(&p.gctx, &rng.vec(2 * h * d, -2.0, 2.0));
    let kd = upload(&p.gctx, &rng.vec(2 * h * d, -1.0, 1.0));
    let vd = upload(&p.gctx, &rng.vec(2 * h * d, -1.0, 1.0));
    p.gpu.reserve(x, 1, rs).unwrap();
    p.gpu.reserve(ids[0], 3, rs).unwrap();
    stream.sync();
    let two = [ids[0], x];
    let graph = stream.capture(|| {
        p.gpu
            .step(
                0,
                &two,
                Some(&dev_view(&pre, &[2, h, d])),
                &dev_view(&kd, &[2, h, d]),
                &dev_view(&vd, &[2, h, d]),
                None,
                None,
                rs,
            )
            .unwrap();
    });
    for _ in 0..3 {
        graph.launch(&stream);
    }
    stream.sync();
    let err = p.gpu.seq_rows(x).unwrap_err();
    assert!(matches!(err, kvreplay::Error::PoolExhausted(_)), "{err}");
    let rows = p.gpu.seq_rows(ids[0]).unwrap();
    let before = p.cpu.seq_rows(ids[0]).unwrap();
    for (r, b) in rows.iter().zip(&before) {
        assert_eq!(r.total, b.total + 3, "the row with budget took every step");
    }
}

/// One gated device step of `layer` for `ids` on two GPU pools with the same data: `pa`
/// scores at once (scores_out asked for), `pb` defers its gate (no scores_out); both CPU
/// pools append the tokens with `pa`'s scores. With `given`, both take those scores instead.
#[allow(clippy::too_many_arguments)]
fn step_both_modes(
    pa: &Both,
    pb: &Both,
    models: &mut [&mut SeqModel],
    rng: &mut Rng,
    ids: &[i32],
    layer: usize,
    given: bool,
) {
    let c = pa.cfg;
    let (b, h, d) = (ids.len(), c.kv_heads, c.head_dim);
    let pre = rng.vec(b * h * d, -2.0, 2.0);
    let k = rng.vec(b * h * d, -1.0, 1.0);
    let v = rng.vec(b * h * d, -1.0, 1.0);
    let sc = rng.vec(b * h, 0.0, 1.0);
    let (pd, kd, vd, sd) = (
        upload(&pa.gctx, &pre),
        upload(&pa.gctx, &k),
        upload(&pa.gctx, &v),
        upload(&pa.gctx, &sc),
    );
    let od = alloc(&pa.gctx, b * h * 4);
    let (pv, kv, vv, sv, ov) = (
        dev_view(&pd, &[b, h, d]),
        dev_view(&kd, &[b, h, d]),
        dev_view(&vd, &[b, h, d]),
        dev_view(&sd, &[b, h]),
        dev_view(&od, &[b, h]),
    );
    let (kp, sin) = if given {
        (None, Some(&sv))
    } else {
        (Some(&pv), None)
    };
    pa.gpu
        .step(layer, ids, kp, &kv, &vv, sin, Some(&ov), S)
        .unwrap();
    pb.gpu.step(layer, ids, kp, &kv, &vv, sin, None, S).unwrap();
    pa.gctx.synchronize(S).unwrap();
    let mut out = vec![0f32; b * h];
    od.download(&mut out).unwrap();
    for i in 0..b {
        let r = i * h * d..(i + 1) * h * d;
        let s = &out[i * h..(i + 1) * h];
        let shape = [1, h, d];
        for cpu in [&pa.cpu, &pb.cpu] {
            cpu.append(
                ids[i],
                Some(layer),
                &view(&k[r.clone()], &shape),
                &view(&v[r.clone()], &shape),
                s,
                false,
                S,
            )
            .unwrap();
        }
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
}

/// The deferred gate (a gated step without scores_out queues its rows' gate inputs and
/// scores a row when its queue is full) against the immediate one on the same data: rows,
/// admissions (the rows' global counts) and decode outputs equal, through ring wraps, host
/// reads with tokens still queued, graph replays, steps with given scores while rows still
/// queue tokens, and a gate replaced while they do. Windows of 8 (queue = window) and 32.
#[test]
fn gpu_deferred_gate_matches_immediate() {
    const N: usize = 20;
    for (w, sinks) in [(8usize, 2usize), (32, 1)] {
        let mut cfg = config(2, 2, 64, 4, w, DType::BF16, 20000);
        cfg.max_seqs = N;
        cfg.sinks = sinks;
        let name = "gpu_deferred_gate_matches_immediate";
        let Some(pa) = both(name, cfg) else {
            return;
        };
        let pb = Both {
            cpu: WgKvPool::new(cpu_ctx(), cfg).unwrap(),
            gpu: WgKvPool::new(Arc::clone(&pa.gctx), cfg).unwrap(),
            gctx: Arc::clone(&pa.gctx),
            cfg,
        };
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let mut rng = Rng::new(23 + w as u64);
        let (_, gate) = random_gate(&mut rng, cfg.layers, h, d, 40);
        for p in [&pa.cpu, &pa.gpu, &pb.cpu, &pb.gpu] {
            p.set_gate(Some(gate.clone())).unwrap();
        }
        let mut ids = Vec::new();
        let mut models = Vec::new();
        for i in 0..N {
            let s = pa.cpu.seq_add(S).unwrap();
            for p in [&pa.gpu, &pb.cpu, &pb.gpu] {
                assert_eq!(p.seq_add(S).unwrap(), s);
            }
            // Rows at every stage: filling the ring, past it.
            let n = 1 + i % 13;
            let (k, v, sc) = random_tokens(&mut rng, cfg.layers, n, h, d);
            let shape = [cfg.layers, n, h, d];
            for p in [&pa.cpu, &pa.gpu, &pb.cpu, &pb.gpu] {
                p.append(s, None, &view(&k, &shape), &view(&v, &shape), &sc, false, S)
                    .unwrap();
            }
            let mut m = SeqModel::new(4);
            record(&mut m, &cfg, 0..cfg.layers, n, &k, &v, &sc, false);
            ids.push(s);
            models.push(m);
        }
        let check = |models: &[SeqModel], rng: &mut Rng, what: &str| {
            for &s in &ids {
                let want = pa.gpu.seq_rows(s).unwrap();
                assert_eq!(pb.gpu.seq_rows(s).unwrap(), want, "w{w} {what}: seq {s}");
                assert_eq!(pa.cpu.seq_rows(s).unwrap(), want, "w{w} {what}: seq {s}");
            }
            let seqs: Vec<(i32, &SeqModel)> = ids.iter().copied().zip(models.iter()).collect();
            for p in [&pa, &pb] {
                let e = p.compare(rng, &seqs, 1, 2, false);
                assert!(e.0 < 3e-2 && e.1 < 3e-2, "w{w} {what}: {e:?}");
            }
        };
        // One reservation, then segments of (steps, given scores).
        let steps = |pa: &Both,
                     pb: &Both,
                     models: &mut Vec<SeqModel>,
                     rng: &mut Rng,
                     segs: &[(usize, bool)]| {
            let n: usize = segs.iter().map(|x| x.0).sum();
            for s in &ids {
                pa.gpu.reserve(*s, n, S).unwrap();
                pb.gpu.reserve(*s, n, S).unwrap();
            }
            for &(n, given) in segs {
                for _ in 0..n {
                    for layer in 0..cfg.layers {
                        let mut ms: Vec<&mut SeqModel> = models.iter_mut().collect();
                        step_both_modes(pa, pb, &mut ms, rng, &ids, layer, given);
                    }
                }
            }
        };
        // Through two ring wraps; then 5 steps (a host read with 5 tokens queued).
        steps(&pa, &pb, &mut models, &mut rng, &[(2 * w + 3, false)]);
        check(&models, &mut rng, "after wraps");
        steps(&pa, &pb, &mut models, &mut rng, &[(5, false)]);
        check(&models, &mut rng, "5 queued");
        // Given scores while rows still queue tokens (their gate CTAs score the queues),
        // then gated again.
        steps(
            &pa,
            &pb,
            &mut models,
            &mut rng,
            &[(3, false), (w + 1, true), (w + 3, false)],
        );
        check(&models, &mut rng, "given after queued");
        // A gate replaced while rows queue tokens: they are scored with the old one first.
        steps(&pa, &pb, &mut models, &mut rng, &[(3, false)]);
        let (_, gate2) = random_gate(&mut rng, cfg.layers, h, d, 24);
        for p in [&pa.cpu, &pa.gpu, &pb.cpu, &pb.gpu] {
            p.set_gate(Some(gate2.clone())).unwrap();
        }
        steps(&pa, &pb, &mut models, &mut rng, &[(w + 2, false)]);
        check(&models, &mut rng, "new gate");

        // Deferred steps replayed from a graph (pb) against eager immediate steps (pa) on
        // the same inputs, past the queue's length and the ring.
        let stream = RawStream::new(&pa.gctx);
        let rs = Stream(stream.ptr() as usize);
        let n = ids.len();
        let pre = rng.vec(n * h * d, -2.0, 2.0);
        let k = rng.vec(n * h * d, -1.0, 1.0);
        let v = rng.vec(n * h * d, -1.0, 1.0);
        let (pd, kd, vd) = (
            upload(&pa.gctx, &pre),
            upload(&pa.gctx, &k),
            upload(&pa.gctx, &v),
        );
        let od = alloc(&pa.gctx, n * h * 4);
        let replays = w + 5;
        for s in &ids {
            pa.gpu.reserve(*s, replays, rs).unwrap();
            pb.gpu.reserve(*s, replays, rs).unwrap();
        }
        stream.sync();
        let (pv, kv, vv, ov) = (
            dev_view(&pd, &[n, h, d]),
            dev_view(&kd, &[n, h, d]),
            dev_view(&vd, &[n, h, d]),
            dev_view(&od, &[n, h]),
        );
        let graph = stream.capture(|| {
            for layer in 0..cfg.layers {
                pb.gpu
                    .step(layer, &ids, Some(&pv), &kv, &vv, None, None, rs)
                    .unwrap();
            }
        });
        for _ in 0..replays {
            graph.launch(&stream);
            for layer in 0..cfg.layers {
                pa.gpu
                    .step(layer, &ids, Some(&pv), &kv, &vv, None, Some(&ov), rs)
                    .unwrap();
                stream.sync();
                let mut out = vec![0f32; n * h];
                od.download(&mut out).unwrap();
                for (i, m) in models.iter_mut().enumerate() {
                    let r = i * h * d..(i + 1) * h * d;
                    let s = &out[i * h..(i + 1) * h];
                    for cpu in [&pa.cpu, &pb.cpu] {
                        cpu.append(
                            ids[i],
                            Some(layer),
                            &view(&k[r.clone()], &[1, h, d]),
                            &view(&v[r.clone()], &[1, h, d]),
                            s,
                            false,
                            S,
                        )
                        .unwrap();
                    }
                    record(m, &cfg, layer..layer + 1, 1, &k[r.clone()], &v[r], s, false);
                }
            }
        }
        stream.sync();
        check(&models, &mut rng, "graph");
        let (sa, sb) = (pa.gpu.stats().unwrap(), pb.gpu.stats().unwrap());
        assert_eq!(sa.kept_tokens, sb.kept_tokens);
        assert_eq!(sa.pages_used, sb.pages_used);
        println!(
            "w{w}: deferred gate matches immediate ({} kept tokens)",
            sb.kept_tokens
        );
    }
}

/// The fused call (`step_decode`: the device step, then the decode of the same sequences,
/// checked as one) on the GPU against the CPU pool appending the GPU's scores and then
/// decoding the same queries: every output element, both against the fp64 reference over the
/// kept tokens; gated (scores in the step) and given-score steps, across ring wraps.
#[test]
fn gpu_step_decode_matches_cpu_step_then_decode() {
    for (dtype, d, ps, w, hid, g) in [
        (DType::BF16, 128, 16, 16, 64, 4),
        (DType::F16, 64, 4, 8, 40, 2),
    ] {
        let mut cfg = config(2, 2, d, ps, w, dtype, 20000);
        cfg.sinks = 1;
        let Some(p) = both("gpu_step_decode_matches_cpu_step_then_decode", cfg) else {
            return;
        };
        let what = format!("{dtype} d{d} p{ps} w{w}");
        let tol = if dtype == DType::BF16 { 3e-2 } else { 6e-3 };
        let mut rng = Rng::new(41);
        let (_, [(a, mut ma), (b, mut mb)]) = p.gated_pair(&mut rng, hid, [5, 2 * w + 3]);
        let steps = 2 * w + 2;
        p.gpu.reserve(a, steps, S).unwrap();
        p.gpu.reserve(b, steps, S).unwrap();
        let ids = [b, a];
        let (n, h) = (ids.len(), cfg.kv_heads);
        let hq = h * g;
        let mut worst = (0f64, 0f64);
        for it in 0..steps {
            for layer in 0..cfg.layers {
                let gated = it % 2 == 0;
                let pre = rng.vec(n * h * d, -2.0, 2.0);
                let k = rng.vec(n * h * d, -1.0, 1.0);
                let v = rng.vec(n * h * d, -1.0, 1.0);
                let given = rng.vec(n * h, 0.0, 1.0);
                let q = rng.vec(n * hq * d, -1.0, 1.0);
                let (pd, kd, vd, gd, qd) = (
                    upload(&p.gctx, &pre),
                    upload(&p.gctx, &k),
                    upload(&p.gctx, &v),
                    upload(&p.gctx, &given),
                    upload(&p.gctx, &q),
                );
                let sd = alloc(&p.gctx, n * h * 4);
                let od = alloc(&p.gctx, n * hq * d * 4);
                od.fill_async(cuda(&p.gctx), 0xff, S).unwrap();
                let (pv, kv, vv, gv, sv) = (
                    dev_view(&pd, &[n, h, d]),
                    dev_view(&kd, &[n, h, d]),
                    dev_view(&vd, &[n, h, d]),
                    dev_view(&gd, &[n, h]),
                    dev_view(&sd, &[n, h]),
                );
                let step = kvreplay::kv::wgkv::WgStep {
                    layer,
                    seqs: &ids,
                    k_pre: gated.then_some(&pv),
                    k: &kv,
                    v: &vv,
                    scores: (!gated).then_some(&gv),
                    scores_out: Some(&sv),
                };
                p.gpu
                    .step_decode(
                        &step,
                        &dev_view(&qd, &[n, hq, d]),
                        &dev_view(&od, &[n, hq, d]),
                        None,
                        &DecodeOptions::default(),
                        S,
                    )
                    .unwrap();
                p.gctx.synchronize(S).unwrap();
                let (mut sc, mut gout) = (vec![0f32; n * h], vec![0f32; n * hq * d]);
                sd.download(&mut sc).unwrap();
                od.download(&mut gout).unwrap();
                if !gated {
                    assert_eq!(sc, given, "{what}: given scores");
                }
                for (i, m) in [&mut mb, &mut ma].into_iter().enumerate() {
                    let r = i * h * d..(i + 1) * h * d;
                    let s = &sc[i * h..(i + 1) * h];
                    let shape = [1, h, d];
                    p.cpu
                        .append(
                            ids[i],
                            Some(layer),
                            &view(&k[r.clone()], &shape),
                            &view(&v[r.clone()], &shape),
                            s,
                            false,
                            S,
                        )
                        .unwrap();
                    record(m, &cfg, layer..layer + 1, 1, &k[r.clone()], &v[r], s, false);
                }
                let cpu_out = decode(&p.cpu, layer, &ids, &q, 1, hq).unwrap();
                let models = [Some(&mb), Some(&ma)];
                let want = reference(&models, &cfg, layer, &q, 1, hq, 1.0 / (d as f64).sqrt());
                let c64: Vec<f64> = cpu_out.iter().map(|&x| x as f64).collect();
                worst.0 = worst.0.max(max_err(&gout, &c64));
                worst.1 = worst.1.max(max_err(&gout, &want));
            }
        }
        assert!(worst.0 < tol && worst.1 < tol, "{what}: {worst:?}");
        p.same_rows(&[a, b]);
        println!(
            "{what}: fused step + decode match (max relative error {:.2e} against the CPU, {:.2e} \
             against fp64)",
            worst.0, worst.1
        );
    }
}
