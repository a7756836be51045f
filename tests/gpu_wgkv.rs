//! GPU: the write-gated pool on CUDA against the same pool on the CPU, on the same data:
//! prefill and single-token appends (host and device K/V), drafts verified with T query
//! tokens, commit and rollback, a copy-on-write fork, folded and per-head decodes; every
//! output element compared, and both compared with the fp64 reference over the kept
//! tokens. Skips itself (printing why) without a GPU.

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
        assert_eq!(p.cpu.stats(), p.gpu.stats());
        for (cr, gr) in [
            (p.cpu.seq_rows(a), p.gpu.seq_rows(a)),
            (p.cpu.seq_rows(f), p.gpu.seq_rows(f)),
        ] {
            assert_eq!(cr.unwrap(), gr.unwrap());
        }
    }
}
