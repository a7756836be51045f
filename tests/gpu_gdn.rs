//! GPU: the GDN replay kernels against the CPU backend on the same random data: decode
//! across flushes (both layouts, GQA, head dims 64/128/256, f32 and bf16 state and ring,
//! f32 and bf16 inputs, KV-only transitions, the recurrent mode), speculative verify +
//! commit with host and device accepted counts (conv windows compared exactly), batches
//! beyond one launch's inline ids, device-side ids, the Qwen3-Next shape, flush / import /
//! export / reset, a verify + commit + decode captured once in a CUDA Graph and replayed
//! over rounds with different flush decisions and accepted counts, and bad input. Every
//! output element is checked. Skips itself (printing why) without a GPU.

mod common;

use std::sync::Arc;

use common::gdn::{random_tokens, rel_err, Tokens};
use common::gpu::*;
use common::kv::cpu_context;
use common::Rng;
use half::bf16;
use kvreplay::backend::cuda::memory::DeviceBuffer;
use kvreplay::linear::{GdnConfig, GdnIo, GdnOptions, GdnPool, StateLayout};
use kvreplay::{Context, DType, Error, MemoryKind, Stream, TensorView};

fn gpu_ctx(test: &str) -> Option<Arc<Context>> {
    gpu_or_skip(test).map(Arc::new)
}

#[allow(clippy::too_many_arguments)]
fn cfg(
    hk: usize,
    hv: usize,
    d: usize,
    ring: usize,
    tau: usize,
    layout: StateLayout,
    state: DType,
    entry: DType,
) -> GdnConfig {
    GdnConfig {
        layers: 2,
        k_heads: hk,
        v_heads: hv,
        dk: d,
        dv: d,
        ring_len: ring,
        kv_only_threshold: tau,
        max_drafts: if ring == 0 { 8 } else { ring.min(8) },
        state_dtype: state,
        entry_dtype: entry,
        layout,
        max_seqs: 8,
        conv_dim: 0,
        conv_kernel: 4,
        conv_dtype: DType::F32,
    }
}

fn encode(dtype: DType, data: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => data.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        DType::BF16 => data
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_bits().to_ne_bytes())
            .collect(),
        DType::F16 => data
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_ne_bytes())
            .collect(),
        DType::I32 => unreachable!(),
    }
}

/// `encode`'s inverse for F32 and BF16 bytes.
fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => unreachable!(),
    }
}

fn upload(ctx: &Context, bytes: &[u8]) -> DeviceBuffer {
    let b = alloc(ctx, bytes.len().max(16));
    b.upload(bytes).unwrap();
    b
}

fn download_f32(buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    buf.download(&mut v).unwrap();
    v
}

fn ids_host(ids: &[i32]) -> TensorView {
    TensorView::contiguous(
        ids.as_ptr() as usize,
        DType::I32,
        MemoryKind::Host,
        &[ids.len()],
    )
    .unwrap()
}

/// A CPU pool and a CUDA pool with the same configuration, driven with the same data.
struct Pair {
    cpu: GdnPool,
    gpu: GdnPool,
    g: Arc<Context>,
    layer: usize,
    input: DType,
    /// Engine dtypes: g in F32 and the output in `input` (bf16 inputs as torch engines
    /// pass them) instead of everything in `input` and an F32 output.
    mixed: bool,
}

/// One call's inputs encoded as `dtype` bytes (g as `g_dtype`), on the host and on the device.
struct Inputs {
    host: Vec<Vec<u8>>,
    dev: Vec<DeviceBuffer>,
    shapes: Vec<Vec<usize>>,
    g_dtype: DType,
}

impl Inputs {
    fn new(g: &Context, c: &GdnConfig, x: &Tokens, dtype: DType) -> Inputs {
        Inputs::with_g(g, c, x, dtype, dtype)
    }
    fn with_g(g: &Context, c: &GdnConfig, x: &Tokens, dtype: DType, g_dtype: DType) -> Inputs {
        let (b, t) = (x.b, x.t);
        let parts: [(&[f32], Vec<usize>); 6] = [
            (&x.q, vec![b, t, c.k_heads, c.dk]),
            (&x.k, vec![b, t, c.k_heads, c.dk]),
            (&x.v, vec![b, t, c.v_heads, c.dv]),
            (&x.g, vec![b, t, c.v_heads]),
            (&x.beta, vec![b, t, c.v_heads]),
            (&x.conv, vec![b, t, c.conv_dim]),
        ];
        let host: Vec<Vec<u8>> = parts
            .iter()
            .enumerate()
            .map(|(i, (d, _))| encode(if i == 3 { g_dtype } else { dtype }, d))
            .collect();
        let dev = host.iter().map(|h| upload(g, h)).collect();
        Inputs {
            host,
            dev,
            shapes: parts.iter().map(|(_, s)| s.clone()).collect(),
            g_dtype,
        }
    }
    fn views(&self, dtype: DType, device: bool) -> Vec<TensorView> {
        (0..6)
            .map(|i| {
                let (addr, mem) = if device {
                    (self.dev[i].addr(), MemoryKind::Cuda)
                } else {
                    (self.host[i].as_ptr() as usize, MemoryKind::Host)
                };
                let d = if i == 3 { self.g_dtype } else { dtype };
                TensorView::contiguous(addr, d, mem, &self.shapes[i]).unwrap()
            })
            .collect()
    }
}

impl Pair {
    fn new(g: &Arc<Context>, c: GdnConfig, input: DType) -> Pair {
        Pair {
            cpu: GdnPool::new(cpu_context(0), c, None).unwrap(),
            gpu: GdnPool::new(Arc::clone(g), c, None).unwrap(),
            g: Arc::clone(g),
            layer: 1,
            input,
            mixed: false,
        }
    }
    fn c(&self) -> GdnConfig {
        *self.cpu.config()
    }
    fn add(&self) -> i32 {
        let a = self.cpu.seq_add(Stream::DEFAULT).unwrap();
        assert_eq!(a, self.gpu.seq_add(Stream::DEFAULT).unwrap());
        a
    }
    fn free(&self, id: i32) {
        self.cpu.seq_free(id, Stream::DEFAULT).unwrap();
        self.gpu.seq_free(id, Stream::DEFAULT).unwrap();
    }

    /// Decode (verify = false) or verify on both pools; returns (cpu, gpu) outputs.
    fn run(&self, ids: &[i32], x: &Tokens, verify: bool, device_ids: bool) -> (Vec<f32>, Vec<f32>) {
        let c = self.c();
        let n = x.b * x.t * c.v_heads * c.dv;
        let (g_dtype, odt) = if self.mixed {
            (DType::F32, self.input)
        } else {
            (self.input, DType::F32)
        };
        let inp = Inputs::with_g(&self.g, &c, x, self.input, g_dtype);
        let mut want = vec![0u8; n * odt.size()];
        let oshape = [x.b, x.t, c.v_heads, c.dv];
        let opts = GdnOptions {
            scale: None,
            l2norm_qk: true,
        };
        let call = |pool: &GdnPool, v: &[TensorView], idv: &TensorView, out: &TensorView| {
            let io = io_of(idv, v, out, (c.conv_dim > 0).then_some(&v[5]));
            if verify {
                pool.verify(self.layer, &io, &opts, Stream::DEFAULT)
            } else {
                pool.decode(self.layer, &io, &opts, Stream::DEFAULT)
            }
        };
        let hv = inp.views(self.input, false);
        let wo = TensorView::contiguous(want.as_mut_ptr() as usize, odt, MemoryKind::Host, &oshape)
            .unwrap();
        call(&self.cpu, &hv, &ids_host(ids), &wo).unwrap();
        let od = alloc(&self.g, n * odt.size());
        od.fill_async(cuda(&self.g), 0xff, Stream::DEFAULT).unwrap();
        let go = TensorView::contiguous(od.addr(), odt, MemoryKind::Cuda, &oshape).unwrap();
        let dv = inp.views(self.input, true);
        let idd = upload(&self.g, &encode_i32(ids));
        let idv = if device_ids {
            TensorView::contiguous(idd.addr(), DType::I32, MemoryKind::Cuda, &[ids.len()]).unwrap()
        } else {
            ids_host(ids)
        };
        call(&self.gpu, &dv, &idv, &go).unwrap();
        self.g.synchronize(Stream::DEFAULT).unwrap();
        let mut got = vec![0u8; n * odt.size()];
        od.download(&mut got).unwrap();
        (decode(odt, &want), decode(odt, &got))
    }

    /// Commits `acc` on both pools (device counts for the GPU pool when `device`); returns
    /// the conv windows (cpu, gpu) when the pool keeps them.
    fn commit(&self, ids: &[i32], acc: &[i32], device: bool) -> (Vec<f32>, Vec<f32>) {
        let c = self.c();
        let k1 = c.conv_kernel - 1;
        let n = ids.len() * k1 * c.conv_dim;
        let mut cw = vec![f32::NAN; n.max(1)];
        let shape = [ids.len(), k1, c.conv_dim];
        let cs = (c.conv_dim > 0).then(|| {
            TensorView::contiguous(
                cw.as_mut_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &shape,
            )
            .unwrap()
        });
        // The CPU pool takes host counts, checked: give it what the device clamps to.
        let clamped: Vec<i32> = ids
            .iter()
            .zip(acc)
            .map(|(&id, &a)| {
                if id < 0 {
                    0
                } else {
                    a.clamp(0, self.cpu.debug_meta(self.layer, id).unwrap()[3])
                }
            })
            .collect();
        self.cpu
            .commit(
                Some(self.layer),
                &ids_host(ids),
                &ids_host(&clamped),
                cs.as_ref(),
                Stream::DEFAULT,
            )
            .unwrap();
        // NaN-filled like the host buffer, so unused rows stay visibly untouched (and
        // compute-sanitizer's initcheck sees every downloaded byte written).
        let gw = upload(&self.g, &encode(DType::F32, &vec![f32::NAN; n.max(1)]));
        let gs = (c.conv_dim > 0).then(|| {
            TensorView::contiguous(gw.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap()
        });
        let accd = upload(&self.g, &encode_i32(acc));
        let accv = if device {
            TensorView::contiguous(accd.addr(), DType::I32, MemoryKind::Cuda, &[acc.len()]).unwrap()
        } else {
            ids_host(acc)
        };
        self.gpu
            .commit(
                Some(self.layer),
                &ids_host(ids),
                &accv,
                gs.as_ref(),
                Stream::DEFAULT,
            )
            .unwrap();
        self.g.synchronize(Stream::DEFAULT).unwrap();
        (cw[..n].to_vec(), download_f32(&gw, n))
    }

    /// Exports both states of `id` as f32 in the pool's layout.
    fn export(&self, id: i32) -> (Vec<f32>, Vec<f32>) {
        let c = self.c();
        let shape = match c.layout {
            StateLayout::KMajor => [c.v_heads, c.dk, c.dv],
            StateLayout::VMajor => [c.v_heads, c.dv, c.dk],
        };
        let n = c.v_heads * c.dk * c.dv;
        let mut a = vec![f32::NAN; n];
        let av = TensorView::contiguous(
            a.as_mut_ptr() as usize,
            DType::F32,
            MemoryKind::Host,
            &shape,
        )
        .unwrap();
        self.cpu
            .export_state(self.layer, id, &av, None, Stream::DEFAULT)
            .unwrap();
        let gb = alloc(&self.g, n * 4);
        let gv = TensorView::contiguous(gb.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
        self.gpu
            .export_state(self.layer, id, &gv, None, Stream::DEFAULT)
            .unwrap();
        self.g.synchronize(Stream::DEFAULT).unwrap();
        (a, download_f32(&gb, n))
    }

    fn same_meta(&self, id: i32, what: &str) {
        let a = self.cpu.debug_meta(self.layer, id).unwrap();
        let b = self.gpu.debug_meta(self.layer, id).unwrap();
        assert_eq!(
            a[..5],
            b[..5],
            "{what}: metadata of sequence {id} (mode, start, h, pending, conv end)"
        );
        assert_eq!(b[5], 0, "{what}: arrival counter left at {}", b[5]);
    }
}

/// The tensors of a call: `v` holds q, k, v, g, beta (and conv_in) views, in that order.
fn io_of<'a>(
    ids: &'a TensorView,
    v: &'a [TensorView],
    out: &'a TensorView,
    conv_in: Option<&'a TensorView>,
) -> GdnIo<'a> {
    GdnIo {
        seq_ids: ids,
        q: &v[0],
        k: &v[1],
        v: &v[2],
        g: &v[3],
        beta: &v[4],
        out,
        conv_in,
    }
}

fn encode_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn err(cpu: &[f32], gpu: &[f32], d: usize) -> f64 {
    let want: Vec<f64> = cpu.iter().map(|&x| x as f64).collect();
    rel_err(gpu, &want, d)
}

fn tol(c: &GdnConfig) -> f64 {
    if c.state_dtype == DType::BF16 || c.entry_dtype == DType::BF16 {
        5e-2
    } else if c.entry_dtype == DType::F16 {
        // (an entry that the two sides round to neighbouring f16 values differs by 2^-11
        // relative: the decodes that read it by about that)
        3e-3
    } else {
        2e-4
    }
}

/// Decode `steps` tokens on a batch with an unused row, sequences that join late, and one
/// that is freed and replaced midway; returns (worst output error, worst state error).
fn decode_run(p: &Pair, steps: usize, rng: &mut Rng, device_ids: bool) -> (f64, f64) {
    let c = p.c();
    let b = 5;
    let mut ids = vec![-1i32; b];
    let (mut worst, mut worst_state) = (0f64, 0f64);
    for step in 0..steps {
        for (r, id) in ids.iter_mut().enumerate() {
            if r != 3 && *id < 0 && step >= 7 * r {
                *id = p.add();
            }
        }
        if step == steps / 2 {
            p.free(ids[2]);
            ids[2] = p.add();
        }
        let x = random_tokens(rng, &c, b, 1);
        let (want, got) = p.run(&ids, &x, false, device_ids);
        assert!(
            got.iter().all(|v| v.is_finite()),
            "step {step}: non-finite output"
        );
        let e = err(&want, &got, c.dv);
        // (bf16 outputs: each side rounds its own result, one bf16 step apart at most)
        let out_tol = if p.mixed { tol(&c).max(1e-2) } else { tol(&c) };
        assert!(e < out_tol, "{c:?} step {step}: output error {e:e}");
        worst = worst.max(e);
        if step % 16 == 15 || step + 1 == steps {
            for &id in ids.iter().filter(|&&i| i >= 0) {
                p.same_meta(id, &format!("step {step}"));
                let (a, g) = p.export(id);
                let e = err(
                    &a,
                    &g,
                    if c.layout == StateLayout::KMajor {
                        c.dv
                    } else {
                        c.dk
                    },
                );
                assert!(e < tol(&c), "{c:?} step {step}: state error {e:e}");
                worst_state = worst_state.max(e);
            }
        }
    }
    (worst, worst_state)
}

/// The dtypes engines pass (bf16 q, k, v, beta and output with f32 g, as torch engines; f32
/// throughout, as ggml), on the shapes that take the specialized one-launch kernels
/// (kvr_gdn_fdecode_*_x*: dk 128, ring 16 or 32, f32 entries) and on ones that do not.
#[test]
fn gpu_decode_engine_dtypes_match_cpu() {
    let Some(g) = gpu_ctx("gpu_decode_engine_dtypes_match_cpu") else {
        return;
    };
    use DType::{BF16, F32};
    use StateLayout::VMajor as V;
    let mut rng = Rng::new(37);
    let cases = [
        // (hk, hv, d, ring, state, entry, input)
        (2, 4, 128, 16, F32, F32, BF16),
        (2, 4, 128, 32, BF16, F32, BF16),
        (16, 32, 128, 16, F32, F32, BF16), // Qwen3-Next's layer
        (2, 4, 128, 16, F32, BF16, BF16),  // bf16 entries: the general one-launch kernel
        (1, 2, 64, 16, F32, F32, BF16),    // dk 64: the general one-launch kernel
        (2, 4, 128, 32, F32, F32, F32),
    ];
    let mut report = Vec::new();
    for (i, &(hk, hv, d, ring, state, entry, input)) in cases.iter().enumerate() {
        let c = cfg(hk, hv, d, ring, 0, V, state, entry);
        let mut p = Pair::new(&g, c, input);
        p.mixed = true;
        let (e, es) = decode_run(&p, 80, &mut rng, i % 2 == 1);
        report.push(format!(
            "L{ring} {hk}/{hv} d{d} {state}/{entry}/{input} (g f32, out {input}): {e:.1e} {es:.1e}"
        ));
    }
    println!(
        "decode, engine dtypes, vs CPU (max relative error: outputs, states):\n  {}",
        report.join("\n  ")
    );
}

#[test]
fn gpu_decode_matches_cpu_across_flushes() {
    let Some(g) = gpu_ctx("gpu_decode_matches_cpu_across_flushes") else {
        return;
    };
    use DType::{BF16, F16, F32};
    use StateLayout::{KMajor as K, VMajor as V};
    let mut rng = Rng::new(31);
    let cases = [
        // (hk, hv, d, ring, tau, layout, state, entry, input)
        (1, 1, 64, 1, 0, K, F32, F32, F32),
        (1, 2, 64, 4, 0, V, F32, F32, F32),
        (2, 2, 128, 16, 0, K, F32, F32, BF16),
        (1, 2, 128, 64, 0, V, F32, F32, F32),
        (1, 2, 128, 16, 0, K, BF16, BF16, BF16),
        (1, 2, 64, 16, 0, V, BF16, F32, F32),
        (1, 1, 256, 16, 0, K, F32, F32, F32),
        (1, 1, 256, 8, 0, V, F32, F32, F32),
        (1, 2, 32, 16, 0, V, F32, F32, F32),
        (2, 4, 128, 12, 0, V, F32, BF16, BF16), // bf16 entries, a ring of 12
        (16, 32, 128, 16, 0, V, F32, F32, BF16), // Qwen3-Next's layer, V-major
        // The specialized one-launch kernels (dk 128, ring 16 or 32, f32 entries): f32 and
        // bf16 inputs, f32 and bf16 states.
        (2, 4, 128, 32, 0, V, F32, F32, F32),
        (2, 4, 128, 16, 0, V, F32, F32, F32),
        (1, 2, 128, 16, 0, V, BF16, F32, BF16),
        (1, 2, 128, 32, 0, V, BF16, F32, F32),
        (1, 2, 128, 8, 48, K, F32, F32, F32), // KV-only, then state
        (2, 4, 64, 16, 30, V, F32, F32, F32), // KV-only, then state
        (1, 2, 128, 16, 100, V, F32, BF16, BF16), // KV-only with bf16 entries
        // The KV-only kernel at every value width it takes and the Qwen3-Next shape with
        // its default threshold (bf16 entries: 127), rows joining, leaving and
        // materializing while others decode KV-only or in replay.
        (1, 1, 256, 16, 40, V, F32, BF16, F32),
        (2, 2, 64, 8, 30, K, BF16, BF16, F32),
        (16, 32, 128, 16, 127, V, F32, BF16, BF16),
        (2, 4, 128, 16, 60, K, F32, F16, F32), // f16 entries
        (1, 2, 128, 0, 0, K, F32, F32, F32),   // recurrent
        // K-major pools on the warp-streaming decode's K-major state kernel: Qwen3-Next's
        // layer, a ring of 32, a ring of 12 with bf16 entries, recurrent with a bf16 state.
        (16, 32, 128, 16, 0, K, F32, F32, BF16),
        (2, 4, 128, 32, 0, K, F32, F32, F32),
        (2, 4, 128, 12, 0, K, F32, BF16, BF16),
        (2, 4, 128, 0, 0, K, BF16, F32, F32),
        (1, 1, 64, 0, 0, V, BF16, F32, F32), // recurrent, bf16 state
        // Recurrent V-major pools on kvr_gdn_wrec: Qwen3-Next's layer, dk 256.
        (16, 32, 128, 0, 0, V, F32, F32, BF16),
        (1, 2, 256, 0, 0, V, F32, F32, F32),
    ];
    let mut report = Vec::new();
    for (i, &(hk, hv, d, ring, tau, layout, state, entry, input)) in cases.iter().enumerate() {
        let c = cfg(hk, hv, d, ring, tau, layout, state, entry);
        let p = Pair::new(&g, c, input);
        let (e, es) = decode_run(&p, 160, &mut rng, i % 3 == 1);
        report.push(format!(
            "L{ring} {layout:?} {hk}/{hv} d{d} tau{tau} {state}/{entry}/{input}: {e:.1e} {es:.1e}"
        ));
    }
    println!(
        "decode vs CPU (max relative error: outputs, states):\n  {}",
        report.join("\n  ")
    );
}

/// Pools with KV-only mode at the Qwen3-Next shape (bf16 entries, threshold 127: what a
/// head's f32 state memory holds) and host ids, so that the host knows every row's mode:
/// rows that stay KV-only take kvr_gdn_kvdec (1, 2, 4 or 8 CTAs a head by batch size),
/// rows that reach the threshold kvr_gdn_kvmat and then the replay kernels, which take
/// the rows with a state in the same step. Sequences join every few steps, so one batch
/// holds all three kinds and an unused row; both layouts.
#[test]
fn gpu_kv_only_rows_beside_replay_rows() {
    let Some(g) = gpu_ctx("gpu_kv_only_rows_beside_replay_rows") else {
        return;
    };
    let mut rng = Rng::new(41);
    let mut report = Vec::new();
    for (b, every, steps, layout) in [
        (1usize, 0usize, 132usize, StateLayout::VMajor),
        (3, 20, 150, StateLayout::KMajor),
        (40, 3, 140, StateLayout::VMajor),
        (12, 9, 140, StateLayout::KMajor),
    ] {
        let mut c = cfg(16, 32, 128, 16, 127, layout, DType::F32, DType::BF16);
        c.max_seqs = b + 2;
        let p = Pair::new(&g, c, DType::BF16);
        let mut ids = vec![-1i32; b];
        let (mut worst, mut worst_state) = (0f64, 0f64);
        for step in 0..steps {
            for (r, id) in ids.iter_mut().enumerate() {
                // Row 1 stays unused (where the batch has more than one row).
                if *id < 0 && (b == 1 || r != 1) && step >= every * r {
                    *id = p.add();
                }
            }
            let x = random_tokens(&mut rng, &c, b, 1);
            let (want, got) = p.run(&ids, &x, false, false);
            assert!(
                got.iter().all(|v| v.is_finite()),
                "step {step}: non-finite output"
            );
            let e = err(&want, &got, c.dv);
            assert!(
                e < tol(&c),
                "B {b} {layout:?} step {step}: output error {e:e}"
            );
            worst = worst.max(e);
            if step % 25 == 24 || step + 1 == steps || step == 127 {
                for &id in ids.iter().filter(|&&i| i >= 0) {
                    p.same_meta(id, &format!("B {b} step {step}"));
                }
                let id = ids[0];
                let (a, s) = p.export(id);
                let d = if layout == StateLayout::KMajor {
                    c.dv
                } else {
                    c.dk
                };
                let e = err(&a, &s, d);
                assert!(e < tol(&c), "B {b} step {step}: state error {e:e}");
                worst_state = worst_state.max(e);
            }
        }
        report.push(format!(
            "B {b} {layout:?}: outputs {worst:.1e}, states {worst_state:.1e}"
        ));
    }
    println!(
        "KV-only rows beside replay rows vs CPU (max relative error):\n  {}",
        report.join("\n  ")
    );
}

/// Speculative rounds with random accepted counts on both pools.
fn spec_run(p: &Pair, rounds: usize, rng: &mut Rng) -> f64 {
    let c = p.c();
    let b = 4;
    let ids: Vec<i32> = (0..b).map(|r| if r == 2 { -1 } else { p.add() }).collect();
    let live: Vec<i32> = ids.iter().copied().filter(|&i| i >= 0).collect();
    let mut worst = 0f64;
    for round in 0..rounds {
        if round % 7 == 3 {
            let x1 = random_tokens(rng, &c, b, 1);
            let (want, got) = p.run(&ids, &x1, false, false);
            worst = worst.max(err(&want, &got, c.dv));
        }
        let t = 1 + rng.below(c.max_drafts);
        let x = random_tokens(rng, &c, b, t);
        let (want, got) = p.run(&ids, &x, true, false);
        let e = err(&want, &got, c.dv);
        assert!(
            e < tol_of(p),
            "{c:?} round {round} T {t}: verify error {e:e}"
        );
        worst = worst.max(e);
        let acc: Vec<i32> = (0..b)
            .map(|r| match (round + r) % 5 {
                0 => 0,
                1 => t as i32,
                // Device counts beyond the drafts are clamped on the device.
                2 if round % 2 == 1 => t as i32 + 3,
                _ => rng.below(t + 1) as i32,
            })
            .collect();
        let device = round % 2 == 1;
        let acc_host: Vec<i32> = acc.iter().map(|&a| a.min(t as i32)).collect();
        let (cw, gw) = p.commit(&ids, if device { &acc } else { &acc_host }, device);
        // Rows of live sequences; an unused row's window is left untouched (NaN).
        let w = (c.conv_kernel - 1) * c.conv_dim;
        for (r, &id) in ids.iter().enumerate() {
            if id < 0 {
                assert!(
                    gw[r * w..(r + 1) * w].iter().all(|x| x.is_nan()),
                    "round {round} row {r}: an unused row's conv window was written"
                );
            } else {
                assert_eq!(
                    cw[r * w..(r + 1) * w],
                    gw[r * w..(r + 1) * w],
                    "round {round} row {r}: conv windows differ"
                );
            }
        }
        for &id in &live {
            p.same_meta(id, &format!("round {round}"));
        }
    }
    for &id in &live {
        let (a, g) = p.export(id);
        worst = worst.max(err(&a, &g, c.dk.min(c.dv)));
    }
    assert!(worst < tol_of(p), "{c:?}: {worst:e}");
    worst
}

/// `tol` for a pair's outputs: bf16 outputs (engine dtypes) round on each side.
fn tol_of(p: &Pair) -> f64 {
    if p.mixed {
        tol(&p.c()).max(1e-2)
    } else {
        tol(&p.c())
    }
}

#[test]
fn gpu_verify_and_commit_match_cpu() {
    let Some(g) = gpu_ctx("gpu_verify_and_commit_match_cpu") else {
        return;
    };
    use DType::{BF16, F32};
    use StateLayout::{KMajor as K, VMajor as V};
    let mut rng = Rng::new(32);
    let cases = [
        // (hk, hv, d, ring, tau, layout, state, entry, drafts, conv)
        (1, 2, 128, 16, 0, K, F32, F32, 4, 32),
        (1, 1, 64, 8, 0, V, F32, F32, 8, 16), // T > remaining ring: flush one window early
        (2, 4, 128, 32, 0, V, F32, F32, 8, 0),
        (1, 2, 64, 0, 0, K, F32, F32, 8, 8), // recurrent: snapshots per draft
        (1, 2, 64, 16, 21, K, F32, F32, 4, 8), // KV-only -> state mid-round
        (1, 2, 128, 32, 0, K, BF16, F32, 8, 24),
        (1, 1, 256, 16, 0, V, F32, F32, 6, 0),
        (1, 2, 128, 16, 0, V, BF16, BF16, 4, 8),
        (2, 4, 64, 24, 0, K, F32, BF16, 5, 0),
        (4, 8, 128, 64, 0, V, F32, F32, 8, 12), // several heads per key head, wide ring
        (4, 8, 128, 64, 0, K, F32, F32, 8, 12),
        (2, 4, 128, 40, 0, K, BF16, BF16, 3, 0),
        (1, 2, 64, 12, 0, K, BF16, F32, 8, 0),
    ];
    let mut report = Vec::new();
    for &(hk, hv, d, ring, tau, layout, state, entry, drafts, conv) in &cases {
        let mut c = cfg(hk, hv, d, ring, tau, layout, state, entry);
        c.max_drafts = drafts;
        c.conv_dim = conv;
        let p = Pair::new(&g, c, DType::F32);
        // 60 rounds cross several flushes of every ring here; 20 under a sanitizer.
        let e = spec_run(&p, sanitizer_scaled(60, 20), &mut rng);
        report.push(format!(
            "L{ring} {layout:?} {hk}/{hv} d{d} tau{tau} T<={drafts} conv{conv} {state}: {e:.1e}"
        ));
    }
    // The specialized warp-streaming verify builds (dk 128, f32 entries, no conv window) with
    // the dtypes engines pass: bf16 q, k, v, beta and output, f32 g; both state dtypes; rings
    // of more than 16 entries and (the `_r16` builds) up to 16. K-major: the same calls on
    // its state kernel (generic builds; `_r16` up to 16 entries).
    for (ring, state, layout) in [
        (32, F32, V),
        (32, BF16, V),
        (16, F32, V),
        (16, BF16, V),
        (12, F32, V),
        (8, F32, V),
        (16, F32, K),
        (16, BF16, K),
        (32, F32, K),
    ] {
        let mut c = cfg(2, 4, 128, ring, 0, layout, state, F32);
        c.max_drafts = 8;
        c.conv_dim = 0;
        let mut p = Pair::new(&g, c, BF16);
        p.mixed = true;
        let e = spec_run(&p, sanitizer_scaled(60, 20), &mut rng);
        report.push(format!(
            "L{ring} {layout:?} 2/4 d128 T<=8 engine dtypes {state}: {e:.1e}"
        ));
    }
    println!(
        "verify + commit vs CPU (max relative error):\n  {}",
        report.join("\n  ")
    );
}

#[test]
fn gpu_large_batches_device_ids_and_the_qwen3_next_shape() {
    let Some(g) = gpu_ctx("gpu_large_batches_device_ids_and_the_qwen3_next_shape") else {
        return;
    };
    let mut rng = Rng::new(33);
    // 600 rows: more than one launch's inline ids.
    let mut c = cfg(1, 2, 64, 8, 0, StateLayout::VMajor, DType::F32, DType::F32);
    c.max_seqs = 600;
    let p = Pair::new(&g, c, DType::F32);
    let ids: Vec<i32> = (0..600).map(|_| p.add()).collect();
    let mut worst = 0f64;
    for step in 0..20 {
        let x = random_tokens(&mut rng, &c, ids.len(), 1);
        let (want, got) = p.run(&ids, &x, false, step % 2 == 1);
        worst = worst.max(err(&want, &got, c.dv));
    }
    assert!(worst < tol(&c), "{worst:e}");
    // 160 rows of 4 key heads: the warp-streaming decode's prep kernel runs a CTA per row
    // from 128 rows (below, one per row and key head), across flushes of a ring of 16.
    let mut c = cfg(4, 8, 64, 16, 0, StateLayout::VMajor, DType::F32, DType::F32);
    c.max_seqs = 160;
    let p = Pair::new(&g, c, DType::BF16);
    let ids: Vec<i32> = (0..160).map(|_| p.add()).collect();
    for step in 0..36 {
        let x = random_tokens(&mut rng, &c, ids.len(), 1);
        let (want, got) = p.run(&ids, &x, false, step % 2 == 0);
        worst = worst.max(err(&want, &got, c.dv));
    }
    for &id in &ids[..4] {
        p.same_meta(id, "160 rows");
        let (a, b) = p.export(id);
        worst = worst.max(err(&a, &b, c.dk));
    }
    assert!(worst < tol(&c), "{worst:e}");
    // 160 rows in KV-only mode (threshold 30, bf16 entries): above the rows the decode
    // kernel computes KV-only heads itself, the KV-only kernel runs first; rows that join
    // later stay KV-only while the others materialize and replay.
    let mut c = cfg(
        4,
        8,
        64,
        16,
        30,
        StateLayout::VMajor,
        DType::F32,
        DType::BF16,
    );
    c.max_seqs = 160;
    let p = Pair::new(&g, c, DType::BF16);
    let mut ids: Vec<i32> = (0..120).map(|_| p.add()).collect();
    let mut wk = 0f64;
    for step in 0..40 {
        if step == 20 {
            ids.extend((0..40).map(|_| p.add()));
        }
        let x = random_tokens(&mut rng, &c, ids.len(), 1);
        let (want, got) = p.run(&ids, &x, false, step % 2 == 0);
        wk = wk.max(err(&want, &got, c.dv));
    }
    for &id in [ids[0], ids[150]].iter() {
        p.same_meta(id, "160 KV-only rows");
        let (a, b) = p.export(id);
        wk = wk.max(err(&a, &b, c.dk));
    }
    assert!(wk < tol(&c), "{wk:e}");
    // Qwen3-Next: 16 key heads, 32 value heads, dk = dv = 128, bf16 inputs, fp32 state.
    let mut q = cfg(
        16,
        32,
        128,
        16,
        0,
        StateLayout::KMajor,
        DType::F32,
        DType::F32,
    );
    q.max_seqs = 8;
    q.layers = 2;
    let p = Pair::new(&g, q, DType::BF16);
    let ids: Vec<i32> = (0..8).map(|_| p.add()).collect();
    let mut wq = 0f64;
    for _ in 0..40 {
        let x = random_tokens(&mut rng, &q, ids.len(), 1);
        let (want, got) = p.run(&ids, &x, false, false);
        wq = wq.max(err(&want, &got, q.dv));
    }
    let (a, b) = p.export(ids[3]);
    wq = wq.max(err(&a, &b, q.dv));
    assert!(wq < tol(&q), "{wq:e}");
    println!(
        "600-row batch (host and device ids): {worst:.2e}; 160 KV-only rows: {wk:.2e}; \
         Qwen3-Next shape over 40 steps: {wq:.2e}"
    );
}

#[test]
fn gpu_flush_import_export_reset() {
    let Some(g) = gpu_ctx("gpu_flush_import_export_reset") else {
        return;
    };
    let mut rng = Rng::new(34);
    for layout in [StateLayout::KMajor, StateLayout::VMajor] {
        for tau in [0usize, 40] {
            let mut c = cfg(1, 2, 128, 16, tau, layout, DType::F32, DType::F32);
            c.conv_dim = 12;
            let p = Pair::new(&g, c, DType::F32);
            let a = p.add();
            let b = p.add();
            // Import a bf16 state from device memory (as a prefill would leave it) into `a`.
            let n = c.v_heads * c.dk * c.dv;
            let init = rng.vec(n, -0.5, 0.5);
            let bytes = encode(DType::BF16, &init);
            let dev = upload(&g, &bytes);
            let shape = match layout {
                StateLayout::KMajor => [c.v_heads, c.dk, c.dv],
                StateLayout::VMajor => [c.v_heads, c.dv, c.dk],
            };
            let conv0 = rng.vec(3 * 12, -1.0, 1.0);
            let conv_dev = upload(&g, &encode(DType::F32, &conv0));
            p.cpu
                .import_state(
                    1,
                    a,
                    &TensorView::contiguous(
                        bytes.as_ptr() as usize,
                        DType::BF16,
                        MemoryKind::Host,
                        &shape,
                    )
                    .unwrap(),
                    Some(
                        &TensorView::contiguous(
                            conv0.as_ptr() as usize,
                            DType::F32,
                            MemoryKind::Host,
                            &[3, 12],
                        )
                        .unwrap(),
                    ),
                    Stream::DEFAULT,
                )
                .unwrap();
            p.gpu
                .import_state(
                    1,
                    a,
                    &TensorView::contiguous(dev.addr(), DType::BF16, MemoryKind::Cuda, &shape)
                        .unwrap(),
                    Some(
                        &TensorView::contiguous(
                            conv_dev.addr(),
                            DType::F32,
                            MemoryKind::Cuda,
                            &[3, 12],
                        )
                        .unwrap(),
                    ),
                    Stream::DEFAULT,
                )
                .unwrap();
            p.same_meta(a, "import");
            let ids = [a, b];
            for step in 0..11 {
                let x = random_tokens(&mut rng, &c, 2, 1);
                let (w, o) = p.run(&ids, &x, false, false);
                assert!(err(&w, &o, c.dv) < tol(&c), "step {step}");
            }
            for &id in &ids {
                let (x, y) = p.export(id);
                assert!(err(&x, &y, 128) < tol(&c));
            }
            let (cw, gw) = p.commit_noop_window(&ids);
            assert_eq!(cw, gw, "conv windows after decode");
            // Flush both (b may still be KV-only) and compare.
            for pool in [&p.cpu, &p.gpu] {
                pool.flush(None, &ids_host(&ids), Stream::DEFAULT).unwrap();
            }
            for &id in &ids {
                p.same_meta(id, "flush");
                assert_eq!(
                    p.gpu.debug_meta(1, id).unwrap()[2],
                    0,
                    "flush empties the ring"
                );
                let (x, y) = p.export(id);
                assert!(err(&x, &y, 128) < tol(&c));
            }
            // Reset: zero state, empty ring.
            for pool in [&p.cpu, &p.gpu] {
                pool.seq_reset(a, Stream::DEFAULT).unwrap();
            }
            p.same_meta(a, "reset");
            let (_, y) = p.export(a);
            assert!(y.iter().all(|&v| v == 0.0));
        }
    }
    println!("flush / import (bf16, with conv window) / export / reset: CUDA matches CPU");
}

impl Pair {
    /// Conv windows through export (commit-free path).
    fn commit_noop_window(&self, ids: &[i32]) -> (Vec<f32>, Vec<f32>) {
        let c = self.c();
        let k1 = c.conv_kernel - 1;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for &id in ids {
            let n = k1 * c.conv_dim;
            let mut cw = vec![f32::NAN; n];
            let shape_s = match c.layout {
                StateLayout::KMajor => [c.v_heads, c.dk, c.dv],
                StateLayout::VMajor => [c.v_heads, c.dv, c.dk],
            };
            let mut s = vec![0f32; c.v_heads * c.dk * c.dv];
            let sv = TensorView::contiguous(
                s.as_mut_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &shape_s,
            )
            .unwrap();
            let cv = TensorView::contiguous(
                cw.as_mut_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &[k1, c.conv_dim],
            )
            .unwrap();
            self.cpu
                .export_state(self.layer, id, &sv, Some(&cv), Stream::DEFAULT)
                .unwrap();
            let sd = alloc(&self.g, s.len() * 4);
            let cd = alloc(&self.g, n * 4);
            let sg =
                TensorView::contiguous(sd.addr(), DType::F32, MemoryKind::Cuda, &shape_s).unwrap();
            let cg =
                TensorView::contiguous(cd.addr(), DType::F32, MemoryKind::Cuda, &[k1, c.conv_dim])
                    .unwrap();
            self.gpu
                .export_state(self.layer, id, &sg, Some(&cg), Stream::DEFAULT)
                .unwrap();
            self.g.synchronize(Stream::DEFAULT).unwrap();
            a.extend(cw);
            b.extend(download_f32(&cd, n));
        }
        (a, b)
    }
}

#[test]
fn gpu_graph_replays_verify_commit_decode() {
    let Some(g) = gpu_ctx("gpu_graph_replays_verify_commit_decode") else {
        return;
    };
    let mut rng = Rng::new(35);
    let mut c = cfg(1, 2, 64, 8, 21, StateLayout::VMajor, DType::F32, DType::F32);
    c.max_drafts = 3;
    c.conv_dim = 16;
    let p = Pair::new(&g, c, DType::F32);
    let ids: Vec<i32> = (0..3).map(|_| p.add()).collect();
    let (b, t) = (ids.len(), 3);
    let stream = RawStream::new(&g);
    let s = Stream(stream.ptr() as usize);
    // Fixed device buffers the graph reads; refilled before every replay.
    let x0 = random_tokens(&mut rng, &c, b, t);
    let x1 = random_tokens(&mut rng, &c, b, 1);
    let in_v = Inputs::new(&g, &c, &x0, DType::F32);
    let in_d = Inputs::new(&g, &c, &x1, DType::F32);
    let vv = in_v.views(DType::F32, true);
    let dv = in_d.views(DType::F32, true);
    let accd = alloc(&g, 64);
    let ov = alloc(&g, b * t * c.v_heads * c.dv * 4);
    let od = alloc(&g, b * c.v_heads * c.dv * 4);
    let cwd = alloc(&g, b * 3 * c.conv_dim * 4);
    let ovv = TensorView::contiguous(
        ov.addr(),
        DType::F32,
        MemoryKind::Cuda,
        &[b, t, c.v_heads, c.dv],
    )
    .unwrap();
    let odv = TensorView::contiguous(
        od.addr(),
        DType::F32,
        MemoryKind::Cuda,
        &[b, 1, c.v_heads, c.dv],
    )
    .unwrap();
    let cwv = TensorView::contiguous(
        cwd.addr(),
        DType::F32,
        MemoryKind::Cuda,
        &[b, 3, c.conv_dim],
    )
    .unwrap();
    let accv = TensorView::contiguous(accd.addr(), DType::I32, MemoryKind::Cuda, &[b]).unwrap();
    let idh = ids_host(&ids);
    let opts = GdnOptions {
        scale: None,
        l2norm_qk: true,
    };
    g.load_kernels().unwrap();
    let graph = stream.capture(|| {
        let io = io_of(&idh, &vv, &ovv, Some(&vv[5]));
        p.gpu.verify(1, &io, &opts, s).unwrap();
        p.gpu.commit(Some(1), &idh, &accv, Some(&cwv), s).unwrap();
        let io = io_of(&idh, &dv, &odv, Some(&dv[5]));
        p.gpu.decode(1, &io, &opts, s).unwrap();
    });
    let mut worst = 0f64;
    let mut transitions = 0;
    for round in 0..40 {
        let x0 = random_tokens(&mut rng, &c, b, t);
        let x1 = random_tokens(&mut rng, &c, b, 1);
        let acc: Vec<i32> = (0..b)
            .map(|r| {
                if (round + r) % 4 == 0 {
                    0
                } else {
                    rng.below(t + 1) as i32
                }
            })
            .collect();
        let before: Vec<i32> = ids
            .iter()
            .map(|&id| p.cpu.debug_meta(1, id).unwrap()[0])
            .collect();
        // CPU mirror.
        let (want_v, _) = cpu_only(&p, &ids, &x0, true);
        let (cw, _) = cpu_commit(&p, &ids, &acc);
        let (want_d, _) = cpu_only(&p, &ids, &x1, false);
        // GPU: new inputs into the graph's buffers, replay.
        stream.sync();
        for (i, part) in [&x0.q, &x0.k, &x0.v, &x0.g, &x0.beta, &x0.conv]
            .iter()
            .enumerate()
        {
            in_v.dev[i].upload(&encode(DType::F32, part)).unwrap();
        }
        for (i, part) in [&x1.q, &x1.k, &x1.v, &x1.g, &x1.beta, &x1.conv]
            .iter()
            .enumerate()
        {
            in_d.dev[i].upload(&encode(DType::F32, part)).unwrap();
        }
        accd.upload(&acc).unwrap();
        graph.launch(&stream);
        stream.sync();
        let got_v = download_f32(&ov, want_v.len());
        let got_d = download_f32(&od, want_d.len());
        let got_w = download_f32(&cwd, cw.len());
        let e = err(&want_v, &got_v, c.dv).max(err(&want_d, &got_d, c.dv));
        assert!(e < tol(&c), "replay {round}: {e:e}");
        assert_eq!(cw, got_w, "replay {round}: conv window");
        worst = worst.max(e);
        for (i, &id) in ids.iter().enumerate() {
            p.same_meta(id, &format!("replay {round}"));
            if before[i] == 0 && p.cpu.debug_meta(1, id).unwrap()[0] == 1 {
                transitions += 1;
            }
        }
    }
    assert!(
        transitions > 0,
        "no KV-only -> state transition inside the graph"
    );
    println!("graph (verify + device-count commit + decode) over 40 replays: max relative error {worst:.2e}, {transitions} KV-only transitions inside replays");
}

/// A CUDA Graph of one decode step of `ids` on the GPU pool of `p` (layer 1), reading f32
/// inputs from fixed device buffers and writing an f32 output.
struct DecodeGraph {
    stream: RawStream,
    graph: Graph,
    inp: Inputs,
    out: DeviceBuffer,
}

impl DecodeGraph {
    fn capture(p: &Pair, ids: &[i32], rng: &mut Rng) -> DecodeGraph {
        let (c, b) = (p.c(), ids.len());
        let stream = RawStream::new(&p.g);
        let s = Stream(stream.ptr() as usize);
        let x = random_tokens(rng, &c, b, 1);
        let inp = Inputs::new(&p.g, &c, &x, DType::F32);
        let iv = inp.views(DType::F32, true);
        let out = alloc(&p.g, b * c.v_heads * c.dv * 4);
        let ov = TensorView::contiguous(
            out.addr(),
            DType::F32,
            MemoryKind::Cuda,
            &[b, 1, c.v_heads, c.dv],
        )
        .unwrap();
        let idh = ids_host(ids);
        let opts = GdnOptions {
            scale: None,
            l2norm_qk: true,
        };
        p.g.load_kernels().unwrap();
        let graph = stream.capture(|| {
            let io = io_of(&idh, &iv, &ov, None);
            p.gpu.decode(1, &io, &opts, s).unwrap();
        });
        stream.sync();
        DecodeGraph {
            stream,
            graph,
            inp,
            out,
        }
    }

    /// New random tokens into the graph's inputs, one replay, the CPU pool's decode of the
    /// same; every row's metadata compared. Returns the outputs' max relative error.
    fn round(&self, p: &Pair, ids: &[i32], rng: &mut Rng, what: &str) -> f64 {
        let c = p.c();
        let x = random_tokens(rng, &c, ids.len(), 1);
        let (want, _) = cpu_only(p, ids, &x, false);
        self.stream.sync();
        for (i, part) in [&x.q, &x.k, &x.v, &x.g, &x.beta].iter().enumerate() {
            self.inp.dev[i].upload(&encode(DType::F32, part)).unwrap();
        }
        self.graph.launch(&self.stream);
        self.stream.sync();
        let got = download_f32(&self.out, want.len());
        for &id in ids {
            p.same_meta(id, what);
        }
        err(&want, &got, c.dv)
    }
}

/// A pool with KV-only mode decodes through kvr_gdn_kvdec and the warp-streaming decode,
/// which decide every row from the metadata: a graph of decode steps captured while every
/// sequence has a state (the host then expects no KV-only row) stays right when it replays
/// after a reset has put sequences back into KV-only mode, and across their materialization.
#[test]
fn gpu_graph_replays_kv_only_rows_after_a_reset() {
    let Some(g) = gpu_ctx("gpu_graph_replays_kv_only_rows_after_a_reset") else {
        return;
    };
    let mut rng = Rng::new(43);
    let mut report = Vec::new();
    // (rows, layout, threshold): the two-launch decode and (2 rows) the one-launch one.
    for (b, layout, tau) in [
        (12usize, StateLayout::VMajor, 10usize),
        (12, StateLayout::KMajor, 10),
        (2, StateLayout::VMajor, 6),
    ] {
        let mut c = cfg(2, 4, 128, 16, tau, layout, DType::F32, DType::F32);
        c.max_seqs = b;
        let p = Pair::new(&g, c, DType::F32);
        let ids: Vec<i32> = (0..b).map(|_| p.add()).collect();
        // Past the threshold eagerly: every sequence has a state.
        for _ in 0..tau + 2 {
            let x = random_tokens(&mut rng, &c, b, 1);
            let (want, got) = p.run(&ids, &x, false, false);
            assert!(err(&want, &got, c.dv) < tol(&c));
        }
        let dg = DecodeGraph::capture(&p, &ids, &mut rng);
        // Sequences 0 and b / 2 start again, in KV-only mode; the graph decodes them up to and
        // past the threshold beside the others.
        for &id in [ids[0], ids[b / 2]].iter() {
            p.cpu.seq_reset(id, Stream::DEFAULT).unwrap();
            p.gpu.seq_reset(id, Stream::DEFAULT).unwrap();
        }
        g.synchronize(Stream::DEFAULT).unwrap();
        let mut worst = 0f64;
        for round in 0..tau + 6 {
            let what = format!("B {b} {layout:?} replay {round}");
            let e = dg.round(&p, &ids, &mut rng, &what);
            assert!(e < tol(&c), "{what}: {e:e}");
            worst = worst.max(e);
        }
        let (a, st) = p.export(ids[0]);
        let d = if layout == StateLayout::KMajor {
            c.dv
        } else {
            c.dk
        };
        worst = worst.max(err(&a, &st, d));
        assert!(worst < tol(&c), "B {b} {layout:?}: {worst:e}");
        report.push(format!("B {b} {layout:?} tau {tau}: {worst:.1e}"));
    }
    println!(
        "decode graph replayed after resets into KV-only mode (max relative error): {}",
        report.join(", ")
    );
}

/// A CUDA Graph of decode steps replayed across flushes on the engines' shape and dtypes
/// (Qwen3-Next's layer, ring 16, f32 entries and inputs): 12 rows take the specialized two
/// launches (kvr_gdn_dprep_d128_r16_xf32, kvr_gdn_wdecode_f32_v_d128_r16_xf32), the forced
/// runs of gpu-run-all.sh the one-launch and the general builds.
#[test]
fn gpu_graph_replays_engine_decode() {
    let Some(g) = gpu_ctx("gpu_graph_replays_engine_decode") else {
        return;
    };
    let mut rng = Rng::new(43);
    let mut c = cfg(
        16,
        32,
        128,
        16,
        0,
        StateLayout::VMajor,
        DType::F32,
        DType::F32,
    );
    c.max_seqs = 12;
    let p = Pair::new(&g, c, DType::F32);
    let ids: Vec<i32> = (0..12).map(|_| p.add()).collect();
    let dg = DecodeGraph::capture(&p, &ids, &mut rng);
    let mut worst = 0f64;
    let steps = sanitizer_scaled(40, 18);
    for round in 0..steps {
        let e = dg.round(&p, &ids, &mut rng, &format!("replay {round}"));
        assert!(e < tol(&c), "replay {round}: {e:e}");
        worst = worst.max(e);
    }
    println!("graph of engine-dtype decode steps over {steps} replays (flushes every 16): max relative error {worst:.2e}");
}

fn cpu_only(p: &Pair, ids: &[i32], x: &Tokens, verify: bool) -> (Vec<f32>, ()) {
    let c = p.c();
    let inp_host: Vec<Vec<u8>> = [&x.q, &x.k, &x.v, &x.g, &x.beta, &x.conv]
        .iter()
        .map(|d| encode(DType::F32, d))
        .collect();
    let shapes = [
        vec![x.b, x.t, c.k_heads, c.dk],
        vec![x.b, x.t, c.k_heads, c.dk],
        vec![x.b, x.t, c.v_heads, c.dv],
        vec![x.b, x.t, c.v_heads],
        vec![x.b, x.t, c.v_heads],
        vec![x.b, x.t, c.conv_dim],
    ];
    let v: Vec<TensorView> = (0..6)
        .map(|i| {
            TensorView::contiguous(
                inp_host[i].as_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &shapes[i],
            )
            .unwrap()
        })
        .collect();
    let mut out = vec![f32::NAN; x.b * x.t * c.v_heads * c.dv];
    let ov = TensorView::contiguous(
        out.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[x.b, x.t, c.v_heads, c.dv],
    )
    .unwrap();
    let idh = ids_host(ids);
    let io = io_of(&idh, &v, &ov, (c.conv_dim > 0).then_some(&v[5]));
    let opts = GdnOptions {
        scale: None,
        l2norm_qk: true,
    };
    if verify {
        p.cpu.verify(p.layer, &io, &opts, Stream::DEFAULT).unwrap();
    } else {
        p.cpu.decode(p.layer, &io, &opts, Stream::DEFAULT).unwrap();
    }
    (out, ())
}

fn cpu_commit(p: &Pair, ids: &[i32], acc: &[i32]) -> (Vec<f32>, ()) {
    let c = p.c();
    let mut cw = vec![f32::NAN; ids.len() * 3 * c.conv_dim];
    let cv = TensorView::contiguous(
        cw.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[ids.len(), 3, c.conv_dim],
    )
    .unwrap();
    p.cpu
        .commit(
            Some(p.layer),
            &ids_host(ids),
            &ids_host(acc),
            Some(&cv),
            Stream::DEFAULT,
        )
        .unwrap();
    (cw, ())
}

#[test]
fn gpu_bad_input_is_refused_and_changes_nothing() {
    let Some(g) = gpu_ctx("gpu_bad_input_is_refused_and_changes_nothing") else {
        return;
    };
    let mut rng = Rng::new(36);
    // Head dims the kernels do not take.
    let bad = cfg(1, 1, 48, 16, 0, StateLayout::KMajor, DType::F32, DType::F32);
    assert!(matches!(
        GdnPool::new(Arc::clone(&g), bad, None),
        Err(Error::Unsupported(_))
    ));
    let mut c = cfg(1, 2, 64, 8, 0, StateLayout::KMajor, DType::F32, DType::F32);
    c.max_drafts = 4;
    let p = Pair::new(&g, c, DType::F32);
    let id = p.add();
    let x = random_tokens(&mut rng, &c, 1, 1);
    p.run(&[id], &x, false, false);
    let meta = p.gpu.debug_meta(1, id).unwrap();
    let state = p.export(id).1;
    // Host tensors given to a CUDA pool.
    let q = x.q.clone();
    let hq = TensorView::contiguous(
        q.as_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[1, 1, 1, 64],
    )
    .unwrap();
    let inp = Inputs::new(&g, &c, &x, DType::F32);
    let dvw = inp.views(DType::F32, true);
    let o = alloc(&g, 2 * 64 * 4);
    let ov =
        TensorView::contiguous(o.addr(), DType::F32, MemoryKind::Cuda, &[1, 1, 2, 64]).unwrap();
    let one_id = [id];
    let idh = ids_host(&one_id);
    let opts = GdnOptions::default();
    let io = GdnIo {
        seq_ids: &idh,
        q: &hq,
        k: &dvw[1],
        v: &dvw[2],
        g: &dvw[3],
        beta: &dvw[4],
        out: &ov,
        conv_in: None,
    };
    assert!(p.gpu.decode(1, &io, &opts, Stream::DEFAULT).is_err());
    // Verify with device ids; T above max_drafts; unknown sequence; commit without verify.
    let idd = upload(&g, &encode_i32(&[id]));
    let idv = TensorView::contiguous(idd.addr(), DType::I32, MemoryKind::Cuda, &[1]).unwrap();
    let io = io_of(&idv, &dvw, &ov, None);
    assert!(matches!(
        p.gpu.verify(1, &io, &opts, Stream::DEFAULT),
        Err(Error::Unsupported(_))
    ));
    let x5 = random_tokens(&mut rng, &c, 1, 5);
    let in5 = Inputs::new(&g, &c, &x5, DType::F32);
    let v5 = in5.views(DType::F32, true);
    let o5 = alloc(&g, 5 * 2 * 64 * 4);
    let o5v =
        TensorView::contiguous(o5.addr(), DType::F32, MemoryKind::Cuda, &[1, 5, 2, 64]).unwrap();
    let io = io_of(&idh, &v5, &o5v, None);
    assert!(matches!(
        p.gpu.verify(1, &io, &opts, Stream::DEFAULT),
        Err(Error::OutOfRange(_))
    ));
    let unknown_id = [id + 3];
    let unknown = ids_host(&unknown_id);
    let io = io_of(&unknown, &dvw, &ov, None);
    assert!(matches!(
        p.gpu.decode(1, &io, &opts, Stream::DEFAULT),
        Err(Error::UnknownId(_))
    ));
    assert!(matches!(
        p.gpu
            .commit(Some(1), &idh, &ids_host(&[1]), None, Stream::DEFAULT),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(p.gpu.debug_meta(1, id).unwrap(), meta);
    assert_eq!(p.export(id).1, state);
    println!("CUDA pool: bad input refused, state and metadata unchanged");
}

// ---- kvr_context_gdn_recurrent: the stateless recurrent step on CUDA ----

use common::recur::{self as rc, Case, Mem};
use kvreplay::ffi::*;

/// Device memory for the recurrent-step cases (uploads are synchronous).
struct DevMem<'a> {
    g: &'a Context,
    bufs: Vec<DeviceBuffer>,
    stream: &'a RawStream,
}

impl Mem for DevMem<'_> {
    fn upload(&mut self, bytes: &[u8]) -> *mut std::ffi::c_void {
        let b = alloc(self.g, bytes.len().max(16));
        b.upload(bytes).unwrap();
        let p = b.addr() as *mut std::ffi::c_void;
        self.bufs.push(b);
        p
    }
    fn download(&self, p: *mut std::ffi::c_void, bytes: usize) -> Vec<u8> {
        let b = self
            .bufs
            .iter()
            .find(|b| b.addr() == p as usize)
            .expect("a buffer of this case");
        let mut v = vec![0u8; bytes];
        b.download(&mut v).unwrap();
        v
    }
    fn device(&self) -> kvr_device_type {
        KVR_DEVICE_CUDA
    }
    fn sync(&self) {
        self.stream.sync();
    }
    fn stream(&self) -> *mut std::ffi::c_void {
        self.stream.ptr()
    }
}

fn recur_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for d in [32, 64, 128, 256] {
        cases.push(Case::new(2, 1, 2, 4, d));
    }
    // The Qwen3-Next layer (16 key heads tiled over 32 value heads) at batch 1 and 8.
    for b in [1, 8] {
        let mut c = Case::new(b, 1, 16, 32, 128);
        c.tiled = true;
        c.pdl = true;
        cases.push(c);
    }
    let mut c = Case::new(2, 6, 2, 4, 64);
    c.snaps = 4;
    cases.push(c.clone());
    c.snaps = 8;
    c.state_out = false;
    cases.push(c);
    let mut c = Case::new(2, 3, 2, 6, 32);
    c.tiled = true;
    c.l2norm = true;
    c.scale = 0.3;
    c.dv = 24;
    cases.push(c.clone());
    for max in [false, true] {
        c.l2norm_max = max;
        c.l2norm_eps = 3.5;
        cases.push(c.clone());
    }
    // The Qwen3-Next layer with q/k normalized in the kernel (llama.cpp's fused L2 norms).
    let mut c = Case::new(4, 1, 16, 32, 128);
    c.tiled = true;
    c.l2norm = true;
    c.l2norm_max = true;
    cases.push(c);
    let mut c = Case::new(2, 4, 1, 2, 128);
    c.in_place = true;
    c.permuted = true;
    c.padded_state = true;
    c.snaps = 2;
    cases.push(c);
    for dtype in [KVR_DTYPE_F16, KVR_DTYPE_BF16] {
        for d in [64, 256] {
            let mut c = Case::new(2, 2, 2, 4, d);
            c.dtype = dtype;
            cases.push(c);
        }
    }
    // Enough rows for 2 and 4 rows per warp, with a partial last group (dv 42).
    for b in [8, 16] {
        let mut c = Case::new(b, 2, 4, 16, 32);
        c.dv = 42;
        c.snaps = 1;
        cases.push(c);
    }
    let mut c = Case::new(3, 2, 2, 4, 128);
    c.splits = vec![(0, 5), (5, 12)];
    cases.push(c.clone());
    c.in_place = true;
    c.splits = vec![(3, 9)];
    cases.push(c);
    // One token: the one-token kernel (kvr_gdn_recur1*) at 1, 2 and 4 rows per warp (batch
    // 1, 4 and 16 of the Qwen3-Next layer), in place over permuted q/k and padded states,
    // grouped heads with the fla norm; and the calls it must leave to the general kernel:
    // a partial group (dv 42), split items, f16 tensors, snapshots, no state_out.
    for b in [4, 16] {
        let mut c = Case::new(b, 1, 16, 32, 128);
        c.tiled = true;
        c.pdl = true;
        cases.push(c);
    }
    let mut c = Case::new(3, 1, 2, 4, 64);
    c.in_place = true;
    c.permuted = true;
    c.padded_state = true;
    cases.push(c.clone());
    c.l2norm = true;
    c.scale = 0.7;
    cases.push(c);
    let mut c = Case::new(5, 1, 4, 16, 32);
    c.dv = 42;
    cases.push(c);
    let mut c = Case::new(3, 1, 2, 4, 128);
    c.splits = vec![(0, 5), (5, 12)];
    cases.push(c);
    let mut c = Case::new(2, 1, 2, 4, 256);
    c.dtype = KVR_DTYPE_F16;
    cases.push(c);
    let mut c = Case::new(2, 1, 2, 4, 64);
    c.snaps = 1;
    cases.push(c.clone());
    c.state_out = false;
    cases.push(c);
    cases
}

#[test]
fn gpu_recurrent_step_matches_the_reference() {
    let Some(g) = gpu_ctx("gpu_recurrent_step_matches_the_reference") else {
        return;
    };
    let ctx = common::context(KVR_BACKEND_CUDA, std::ptr::null_mut()).unwrap();
    let cpu = common::context(KVR_BACKEND_CPU, std::ptr::null_mut()).unwrap();
    let stream = RawStream::new(&g);
    for c in recur_cases() {
        let x = rc::random_data(&c);
        let mut mem = DevMem {
            g: &g,
            bufs: Vec::new(),
            stream: &stream,
        };
        let got = rc::run(ctx, &c, &x, &mut mem);
        rc::check(&c, &x, &got, rc::tol(&c));
        // The CPU backend on the same data agrees too.
        let host = rc::run(cpu, &c, &x, &mut rc::HostMem::default());
        let want: Vec<f64> = host.out.iter().map(|&v| v as f64).collect();
        let e = rel_err(&got.out, &want, c.dv);
        assert!(e <= rc::tol(&c), "{c:?}: CPU vs CUDA out {e:e}");
    }
    kvr_context_free(cpu);
    kvr_context_free(ctx);
}

#[test]
fn gpu_recurrent_step_replays_in_a_graph() {
    // One call captured with programmatic dependent launch, replayed over new inputs and
    // its own output state (in place), against the reference each time.
    let Some(g) = gpu_ctx("gpu_recurrent_step_replays_in_a_graph") else {
        return;
    };
    let ctx = common::context(KVR_BACKEND_CUDA, std::ptr::null_mut()).unwrap();
    assert_eq!(kvr_context_load_kernels(ctx), KVR_STATUS_OK);
    let stream = RawStream::new(&g);
    let mut c = Case::new(4, 1, 16, 32, 128);
    c.tiled = true;
    c.pdl = true;
    c.in_place = true;
    let mut x = rc::random_data(&c);
    let mut mem = DevMem {
        g: &g,
        bufs: Vec::new(),
        stream: &stream,
    };
    let t = rc::bind(&c, &x, &mut mem);
    let p = rc::params(&c);
    let graph = stream.capture(|| {
        assert_eq!(rc::call(ctx, &t, &p, stream.ptr()), KVR_STATUS_OK);
    });
    for round in 0..3u64 {
        if round > 0 {
            // New inputs in the same buffers; the state carries over.
            let mut c2 = c.clone();
            c2.seed = 100 + round;
            let y = rc::random_data(&c2);
            for (dst, src) in [(t.q.data, &y.q), (t.k.data, &y.k), (t.v.data, &y.v)] {
                let b = mem.bufs.iter().find(|b| b.addr() == dst as usize).unwrap();
                b.upload(src).unwrap();
            }
            for (dst, src) in [(t.g.data, &y.g), (t.beta.data, &y.beta)] {
                let b = mem.bufs.iter().find(|b| b.addr() == dst as usize).unwrap();
                b.upload(src).unwrap();
            }
            let (_, state, _) = rc::read_back(&c, &t, &mem);
            x = rc::Data { s0: state, ..y };
        }
        graph.launch(&stream);
        let (out, state, snaps) = rc::read_back(&c, &t, &mem);
        let got = rc::Got {
            out,
            state,
            snaps,
            status: vec![KVR_STATUS_OK],
        };
        rc::check(&c, &x, &got, rc::tol(&c));
    }
    drop(graph);
    kvr_context_free(ctx);
}

#[test]
fn gpu_recurrent_step_refuses_what_the_kernel_cannot_do() {
    let Some(g) = gpu_ctx("gpu_recurrent_step_refuses_what_the_kernel_cannot_do") else {
        return;
    };
    let ctx = common::context(KVR_BACKEND_CUDA, std::ptr::null_mut()).unwrap();
    let stream = RawStream::new(&g);
    let check = |c: &Case, want: kvr_status, what: &str, edit: &dyn Fn(&mut rc::Bound)| {
        let x = rc::random_data(c);
        let mut mem = DevMem {
            g: &g,
            bufs: Vec::new(),
            stream: &stream,
        };
        let t = rc::bind(c, &x, &mut mem);
        let mut e = t.clone();
        edit(&mut e);
        let st = rc::call(ctx, &e, &rc::params(c), stream.ptr());
        assert_eq!(st, want, "{what}: {}", common::last_error());
        let (out, state, _) = rc::read_back(c, &t, &mem);
        assert!(
            out.iter().all(|&v| v == rc::SENTINEL),
            "{what}: out written"
        );
        assert!(
            state.iter().all(|&v| v == rc::SENTINEL),
            "{what}: state written"
        );
    };
    let c = Case::new(2, 1, 2, 4, 48);
    check(&c, KVR_STATUS_UNSUPPORTED, "dk 48", &|_| {});
    let c = Case::new(2, 2, 2, 4, 64);
    // Refused before anything is read, so views past their buffers are harmless here.
    check(&c, KVR_STATUS_INVALID_ARG, "q keys strided", &|t| {
        t.q.strides[3] = 2;
    });
    check(&c, KVR_STATUS_INVALID_ARG, "state rows misaligned", &|t| {
        t.state_in.strides[2] = 65;
    });
    let mut host = vec![0f32; 2 * 2 * 4 * 64];
    let host_addr = host.as_mut_ptr() as usize;
    check(
        &c,
        KVR_STATUS_INVALID_ARG,
        "host q on a CUDA context",
        &|t| {
            t.q.device = KVR_DEVICE_HOST;
            t.q.data = host_addr as *mut std::ffi::c_void;
        },
    );
    kvr_context_free(ctx);
}
