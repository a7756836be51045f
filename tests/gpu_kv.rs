//! GPU: the paged KV pool and decode kernel against the CPU backend on the same data, over
//! the feature matrix (head dims, GQA groups incl. 5 and 7, page sizes 1..128, lengths up to
//! 32K+, sliding window, softcap, T = 1..8), copy-on-write on the device, device-side and
//! large batches, a contiguous external layout, and a decode captured once in a CUDA Graph
//! and replayed while sequences grow, fork and roll back. Every output element is checked.
//! Skips itself (printing why) without a GPU.

mod common;

use std::sync::Arc;

use common::gpu::*;
use common::kv::*;
use common::Rng;
use kvreplay::backend::cuda::memory::DeviceBuffer;
use kvreplay::kv::{DecodeOptions, KvPool, KvPoolConfig, KvStorage, LayerLayout};
use kvreplay::{Context, DType, Error, MemoryKind, Stream, TensorView};

struct Pair {
    cpu: KvPool,
    gpu: KvPool,
    gctx: Arc<Context>,
}

fn pair(gctx: &Arc<Context>, cfg: KvPoolConfig) -> Pair {
    let cctx = cpu_context(0);
    Pair {
        cpu: KvPool::new(cctx, cfg, KvStorage::Owned).unwrap(),
        gpu: KvPool::new(Arc::clone(gctx), cfg, KvStorage::Owned).unwrap(),
        gctx: Arc::clone(gctx),
    }
}

fn dev_upload<T: Copy>(ctx: &Context, data: &[T]) -> DeviceBuffer {
    let b = alloc(ctx, std::mem::size_of_val(data).max(16));
    b.upload(data).unwrap();
    b
}

impl Pair {
    /// Appends the same random tokens to both pools (from host memory, or from device
    /// memory for the GPU pool when `from_device`).
    fn add_seq(&self, rng: &mut Rng, len: usize, from_device: bool) -> i32 {
        let c = *self.cpu.config();
        let a = self.cpu.seq_add(Stream::DEFAULT).unwrap();
        let b = self.gpu.seq_add(Stream::DEFAULT).unwrap();
        assert_eq!(a, b);
        self.append(a, rng, len, from_device);
        let _ = c;
        a
    }

    fn append(&self, seq: i32, rng: &mut Rng, n: usize, from_device: bool) {
        if n == 0 {
            return;
        }
        let c = *self.cpu.config();
        let shape = [c.layers, n, c.kv_heads, c.head_dim];
        let k = rng.vec(shape.iter().product(), -1.0, 1.0);
        let v = rng.vec(shape.iter().product(), -1.0, 1.0);
        let (kh, vh) = (contiguous_view(&k, &shape), contiguous_view(&v, &shape));
        self.cpu.append(seq, &kh, &vh, Stream::DEFAULT).unwrap();
        if from_device {
            let (kd, vd) = (dev_upload(&self.gctx, &k), dev_upload(&self.gctx, &v));
            let kt =
                TensorView::contiguous(kd.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
            let vt =
                TensorView::contiguous(vd.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
            self.gpu.append(seq, &kt, &vt, Stream::DEFAULT).unwrap();
            self.gctx.synchronize(Stream::DEFAULT).unwrap();
        } else {
            self.gpu.append(seq, &kh, &vh, Stream::DEFAULT).unwrap();
        }
    }

    /// Decodes `layer` on both backends with the same random q; returns (max row-relative
    /// output error, max lse error, elements compared).
    #[allow(clippy::too_many_arguments)]
    fn compare(
        &self,
        rng: &mut Rng,
        layer: usize,
        ids: &[i32],
        t: usize,
        hq: usize,
        q_dtype: DType,
        out_dtype: DType,
        opts: &DecodeOptions,
    ) -> (f64, f64, usize) {
        let c = *self.cpu.config();
        let b = ids.len();
        let n = b * t * hq * c.head_dim;
        // q rounded to q_dtype, then handed to both backends in that dtype.
        let q32: Vec<f32> = rng
            .vec(n, -1.0, 1.0)
            .iter()
            .map(|&x| round_to(q_dtype, x))
            .collect();
        let qbits = encode_all(q_dtype, &q32);
        let shape = [b, t, hq, c.head_dim];
        let idv = TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[b])
            .unwrap();
        // CPU (f32 output).
        let mut cpu_out = vec![f32::NAN; n];
        let mut cpu_lse = vec![f32::NAN; b * t * hq];
        let qh = TensorView::contiguous(qbits.as_ptr() as usize, q_dtype, MemoryKind::Host, &shape)
            .unwrap();
        let oh = TensorView::contiguous(
            cpu_out.as_mut_ptr() as usize,
            DType::F32,
            MemoryKind::Host,
            &shape,
        )
        .unwrap();
        let lh = TensorView::contiguous(
            cpu_lse.as_mut_ptr() as usize,
            DType::F32,
            MemoryKind::Host,
            &[b, t, hq],
        )
        .unwrap();
        kv_decode(
            &self.cpu,
            layer,
            &idv,
            &qh,
            &oh,
            Some(&lh),
            opts,
            Stream::DEFAULT,
        )
        .unwrap();
        // GPU, poisoned outputs.
        let qd = dev_upload(&self.gctx, &qbits);
        let od = alloc(&self.gctx, n * out_dtype.size());
        let ld = alloc(&self.gctx, b * t * hq * 4);
        od.fill_async(cuda(&self.gctx), 0xff, Stream::DEFAULT)
            .unwrap();
        ld.fill_async(cuda(&self.gctx), 0xff, Stream::DEFAULT)
            .unwrap();
        let qg = TensorView::contiguous(qd.addr(), q_dtype, MemoryKind::Cuda, &shape).unwrap();
        let og = TensorView::contiguous(od.addr(), out_dtype, MemoryKind::Cuda, &shape).unwrap();
        let lg =
            TensorView::contiguous(ld.addr(), DType::F32, MemoryKind::Cuda, &[b, t, hq]).unwrap();
        kv_decode(
            &self.gpu,
            layer,
            &idv,
            &qg,
            &og,
            Some(&lg),
            opts,
            Stream::DEFAULT,
        )
        .unwrap();
        self.gctx.synchronize(Stream::DEFAULT).unwrap();
        let gpu_out = download_as_f32(&od, out_dtype, n);
        let mut gpu_lse = vec![0f32; b * t * hq];
        ld.download(&mut gpu_lse).unwrap();
        let want: Vec<f64> = cpu_out.iter().map(|&x| x as f64).collect();
        let err = max_row_relative_error(&gpu_out, &want, c.head_dim);
        if err > tolerance(c.dtype) {
            // Which rows are wrong, for diagnosis.
            let d = c.head_dim;
            let mut rows: Vec<(f64, usize)> = (0..n / d)
                .map(|r| {
                    let w = &want[r * d..(r + 1) * d];
                    let g = &gpu_out[r * d..(r + 1) * d];
                    let scale = w.iter().fold(1e-6f64, |a, &x| a.max(x.abs()));
                    let e = g
                        .iter()
                        .zip(w)
                        .fold(0f64, |a, (&x, &y)| a.max((x as f64 - y).abs() / scale));
                    (e, r)
                })
                .collect();
            rows.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
            // Transient (a race in the kernel) or persistent (wrong data in the pool)?
            for again in 0..3 {
                od.fill_async(cuda(&self.gctx), 0xff, Stream::DEFAULT)
                    .unwrap();
                kv_decode(
                    &self.gpu,
                    layer,
                    &idv,
                    &qg,
                    &og,
                    Some(&lg),
                    opts,
                    Stream::DEFAULT,
                )
                .unwrap();
                self.gctx.synchronize(Stream::DEFAULT).unwrap();
                let redo = download_as_f32(&od, out_dtype, n);
                eprintln!(
                    "  decode again #{again}: error {:.3e}",
                    max_row_relative_error(&redo, &want, c.head_dim)
                );
            }
            for &(e, r) in rows.iter().take(8) {
                let (bi, rest) = (r / (t * hq), r % (t * hq));
                eprintln!(
                    "  row b={bi} (seq {}, len {}) t={} hq={}: error {e:.3e}, got[0..3] {:?}, want[0..3] {:?}",
                    ids[bi],
                    if ids[bi] >= 0 { self.cpu.seq_len(ids[bi]).unwrap() } else { 0 },
                    rest / hq,
                    rest % hq,
                    &gpu_out[r * d..r * d + 3],
                    &want[r * d..r * d + 3]
                );
            }
        }
        let mut lse_err = 0f64;
        for (&g, &w) in gpu_lse.iter().zip(&cpu_lse) {
            if w == f32::NEG_INFINITY {
                assert_eq!(g, f32::NEG_INFINITY, "lse of an empty row");
            } else {
                lse_err = lse_err.max((g as f64 - w as f64).abs());
            }
        }
        (err, lse_err, n)
    }
}

fn encode_all(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_ne_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_ne_bytes())
            .collect(),
        DType::I32 => unreachable!(),
    }
}

fn download_as_f32(buf: &DeviceBuffer, dtype: DType, n: usize) -> Vec<f32> {
    let mut raw = vec![0u8; n * dtype.size()];
    buf.download(&mut raw).unwrap();
    match dtype {
        DType::F32 => raw
            .chunks(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F16 => raw
            .chunks(2)
            .map(|c| half::f16::from_bits(u16::from_ne_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
        DType::BF16 => raw
            .chunks(2)
            .map(|c| half::bf16::from_bits(u16::from_ne_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
        DType::I32 => unreachable!(),
    }
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        3e-2
    } else {
        6e-3
    }
}

fn gpu_ctx(test: &str) -> Option<Arc<Context>> {
    gpu_or_skip(test).map(Arc::new)
}

#[test]
fn gpu_decode_matches_cpu_across_the_matrix() {
    let Some(g) = gpu_ctx("gpu_decode_matches_cpu_across_the_matrix") else {
        return;
    };
    let mut rng = Rng::new(21);
    let mut worst = [0f64; 2];
    let (mut cases, mut elements) = (0, 0);
    let dims = [64usize, 80, 96, 128, 256];
    let groups = [1usize, 2, 4, 5, 7, 8, 16];
    let pages = [1usize, 8, 16, 32, 128];
    for (i, &d) in dims.iter().enumerate() {
        for (j, &grp) in groups.iter().enumerate() {
            let dtype = if (i + j) % 2 == 0 {
                DType::BF16
            } else {
                DType::F16
            };
            let page = pages[(i + 2 * j) % pages.len()];
            let hkv = if grp >= 8 { 1 } else { 2 };
            let cfg = KvPoolConfig {
                layers: 2,
                kv_heads: hkv,
                head_dim: d,
                page_size: page,
                dtype,
                capacity_pages: 8192,
                max_seqs: 64,
                max_seq_len: 1 << 16,
            };
            let p = pair(&g, cfg);
            let t = 1 + (i + j) % 3;
            // The shortest sequence holds exactly its T query tokens.
            let lens = [t, 17, 64, 65, 300 + 37 * j, 2000 + 111 * i];
            let mut ids: Vec<i32> = lens
                .iter()
                .enumerate()
                .map(|(x, &l)| p.add_seq(&mut rng, l, x % 2 == 0))
                .collect();
            ids.insert(2, -1);
            let opts = DecodeOptions {
                window: if j % 3 == 1 { 100 } else { 0 },
                softcap: if j % 4 == 3 { 20.0 } else { 0.0 },
                ..Default::default()
            };
            let qd = [DType::F32, dtype, DType::BF16][(i + j) % 3];
            let od = [dtype, DType::F32][(i + j) % 2];
            let (e, l, n) = p.compare(&mut rng, 1, &ids, t, hkv * grp, qd, od, &opts);
            assert!(
                e < tolerance(dtype),
                "d {d} group {grp} page {page} {dtype:?} T {t} {opts:?}: error {e:e}"
            );
            assert!(l < 2e-2, "lse error {l:e}");
            worst = [worst[0].max(e), worst[1].max(l)];
            cases += 1;
            elements += n;
        }
    }
    // Long and skewed: one 33K sequence with short ones, every T, window and softcap.
    for (dtype, t, window, softcap) in [
        (DType::BF16, 1, 0, 0.0),
        (DType::F16, 4, 0, 0.0),
        (DType::BF16, 8, 4096, 0.0),
        (DType::F16, 3, 0, 50.0),
        (DType::BF16, 2, 1000, 30.0),
    ] {
        let cfg = KvPoolConfig {
            layers: 1,
            kv_heads: 8,
            head_dim: 128,
            page_size: 16,
            dtype,
            capacity_pages: 4096,
            max_seqs: 64,
            max_seq_len: 1 << 16,
        };
        let p = pair(&g, cfg);
        let mut ids = vec![p.add_seq(&mut rng, 33_000, true)];
        for l in [8usize, 9, 100, 1023] {
            ids.push(p.add_seq(&mut rng, l, false));
        }
        let opts = DecodeOptions {
            window,
            softcap,
            ..Default::default()
        };
        let (e, l, n) = p.compare(&mut rng, 0, &ids, t, 32, DType::BF16, DType::F32, &opts);
        assert!(
            e < tolerance(dtype),
            "long {dtype:?} T {t} window {window} softcap {softcap}: {e:e}"
        );
        assert!(l < 2e-2);
        worst = [worst[0].max(e), worst[1].max(l)];
        cases += 1;
        elements += n;
    }
    println!(
        "decode: {cases} cases, {elements} output elements checked, max relative error {:.2e} \
         (row-relative, vs the CPU backend), max lse error {:.2e}",
        worst[0], worst[1]
    );
}

/// Small batches take the short-batch kernels (kernels/kv_decode.cu): short contexts the
/// cluster kernel (a row's 16 parts merged in distributed shared memory), longer ones the
/// split kernel (up to 64 parts per row, folded 16 at a time by the row's last CTA). Rows of
/// every length class around the 64-token tile and the part boundaries, empty rows, two
/// query tiles (GQA 7 x T 3), windows and softcap, checked element by element against the
/// CPU backend. (run-all repeats the file with each kernel forced by KVR_KV_DECODE.)
#[test]
fn gpu_short_batches_match_cpu() {
    let Some(g) = gpu_ctx("gpu_short_batches_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(23);
    let mut worst = [0f64; 2];
    let (mut cases, mut elements) = (0, 0);
    for (hkv, grp, page, dtype) in [
        (1usize, 7usize, 16usize, DType::BF16),
        (4, 7, 16, DType::BF16),
        (8, 4, 32, DType::F16),
        (2, 16, 1, DType::BF16),
    ] {
        let cfg = KvPoolConfig {
            layers: 1,
            kv_heads: hkv,
            head_dim: 128,
            page_size: page,
            dtype,
            capacity_pages: 90_000 / page + 64,
            max_seqs: 16,
            max_seq_len: 1 << 17,
        };
        let p = pair(&g, cfg);
        let long = if page == 1 { 9_000 } else { 70_001 };
        let lens = [1usize, 63, 64, 65, 1_000, 4_097, long];
        let ids: Vec<i32> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| p.add_seq(&mut rng, l, i % 2 == 1))
            .collect();
        // Batches: each row alone, a ragged pair, a short batch with an empty row.
        let mut batches: Vec<Vec<i32>> = ids.iter().map(|&i| vec![i]).collect();
        batches.push(vec![ids[6], ids[1]]);
        batches.push(vec![ids[2], -1, ids[4], ids[3]]);
        for (n, batch) in batches.iter().enumerate() {
            for (t, window, softcap) in [
                (1usize, 0usize, 0.0f32),
                (3, 0, 0.0),
                (1, 700, 0.0),
                (2, 0, 30.0),
            ] {
                if batch
                    .iter()
                    .any(|&i| i >= 0 && lens[ids.iter().position(|&x| x == i).unwrap()] < t)
                {
                    continue;
                }
                let opts = DecodeOptions {
                    window,
                    softcap,
                    ..Default::default()
                };
                let od = [DType::F32, dtype][n % 2];
                let (e, l, m) = p.compare(&mut rng, 0, batch, t, hkv * grp, dtype, od, &opts);
                assert!(
                    e < tolerance(dtype),
                    "hkv {hkv} group {grp} page {page} batch {batch:?} T {t} window {window} \
                     softcap {softcap}: error {e:e}"
                );
                assert!(l < 2e-2, "lse error {l:e}");
                worst = [worst[0].max(e), worst[1].max(l)];
                cases += 1;
                elements += m;
            }
        }
    }
    println!(
        "short batches: {cases} cases, {elements} output elements checked, max relative error \
         {:.2e} (row-relative, vs the CPU backend), max lse error {:.2e}",
        worst[0], worst[1]
    );
}

#[test]
fn gpu_copy_on_write_fork_truncate_and_t8_verify() {
    let Some(g) = gpu_ctx("gpu_copy_on_write_fork_truncate_and_t8_verify") else {
        return;
    };
    let mut rng = Rng::new(22);
    let cfg = KvPoolConfig {
        layers: 3,
        kv_heads: 2,
        head_dim: 64,
        page_size: 8,
        dtype: DType::BF16,
        capacity_pages: 512,
        max_seqs: 16,
        max_seq_len: 4096,
    };
    let p = pair(&g, cfg);
    let a = p.add_seq(&mut rng, 45, false);
    let b1 = p.cpu.seq_fork(a, Stream::DEFAULT).unwrap();
    assert_eq!(b1, p.gpu.seq_fork(a, Stream::DEFAULT).unwrap());
    // Speculative round on the fork: append 8 draft tokens, verify T = 8, reject 5.
    p.append(b1, &mut rng, 8, true);
    p.append(a, &mut rng, 3, false);
    let mut worst = 0f64;
    for layer in 0..3 {
        let (e, _, _) = p.compare(
            &mut rng,
            layer,
            &[a, b1],
            8,
            4,
            DType::BF16,
            DType::BF16,
            &DecodeOptions::default(),
        );
        worst = worst.max(e);
    }
    for pool in [&p.cpu, &p.gpu] {
        pool.seq_truncate(b1, 48, Stream::DEFAULT).unwrap();
    }
    p.append(b1, &mut rng, 2, false);
    let (e, _, _) = p.compare(
        &mut rng,
        2,
        &[b1, a],
        1,
        4,
        DType::F32,
        DType::F32,
        &DecodeOptions::default(),
    );
    worst = worst.max(e);
    assert!(worst < tolerance(DType::BF16), "{worst:e}");
    assert_eq!(p.cpu.stats(), p.gpu.stats());
    println!("copy-on-write / fork / truncate: max relative error {worst:.2e}");
}

/// Batches of more (row, query tile) pairs than the split kernel's wave whose rows are even
/// take one CTA per row (the batch kernel, two CTAs per SM, or the split kernel in waves;
/// src/kv/cuda.rs `choose_path`): a wave of 1K-token rows, and 4K-token rows in several
/// waves, checked element by element against the CPU backend.
#[test]
fn gpu_even_batches_beyond_a_wave_match_cpu() {
    let Some(g) = gpu_ctx("gpu_even_batches_beyond_a_wave_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(29);
    let mut worst = 0f64;
    for (b, hkv, grp, len) in [(33usize, 8usize, 4usize, 1_000usize), (99, 4, 7, 4_100)] {
        let cfg = KvPoolConfig {
            layers: 1,
            kv_heads: hkv,
            head_dim: 128,
            page_size: 16,
            dtype: DType::BF16,
            capacity_pages: b * (len + 400).div_ceil(16),
            max_seqs: b,
            max_seq_len: len + 400,
        };
        let p = pair(&g, cfg);
        let ids: Vec<i32> = (0..b)
            .map(|i| p.add_seq(&mut rng, len + (i * 37) % 200, i % 3 == 0))
            .collect();
        let (e, l, m) = p.compare(
            &mut rng,
            0,
            &ids,
            1,
            hkv * grp,
            DType::BF16,
            DType::BF16,
            &DecodeOptions::default(),
        );
        assert!(e < tolerance(DType::BF16), "B {b} hkv {hkv}: error {e:e}");
        assert!(l < 2e-2, "lse error {l:e}");
        println!("B {b} x {hkv} KV heads, {len}+ tokens: {m} elements, max relative error {e:.2e}");
        worst = worst.max(e);
    }
    println!("even batches beyond a wave: max relative error {worst:.2e} (vs the CPU backend)");
}

#[test]
fn gpu_batches_device_ids_large_batches_and_contiguous_layout() {
    let Some(g) = gpu_ctx("gpu_batches_device_ids_large_batches_and_contiguous_layout") else {
        return;
    };
    let mut rng = Rng::new(23);
    // 600 sequences: host ids go through the copy path (> 512); then the same ids from
    // device memory.
    let cfg = KvPoolConfig {
        layers: 1,
        kv_heads: 4,
        head_dim: 96,
        page_size: 16,
        dtype: DType::F16,
        capacity_pages: 8192,
        max_seqs: 700,
        max_seq_len: 4096,
    };
    let p = pair(&g, cfg);
    let ids: Vec<i32> = (0..600)
        .map(|i| p.add_seq(&mut rng, 1 + (i * 37) % 150, false))
        .collect();
    let (e1, _, _) = p.compare(
        &mut rng,
        0,
        &ids,
        1,
        8,
        DType::F16,
        DType::F16,
        &DecodeOptions::default(),
    );
    // Device-resident ids with unused rows.
    let mut dev_ids = ids[..100].to_vec();
    dev_ids[7] = -1;
    dev_ids[50] = -1;
    let n = dev_ids.len() * 8 * 96;
    let q = rng.vec(n, -1.0, 1.0);
    let shape = [dev_ids.len(), 8, 96];
    let mut cpu_out = vec![0f32; n];
    let idh = TensorView::contiguous(
        dev_ids.as_ptr() as usize,
        DType::I32,
        MemoryKind::Host,
        &[dev_ids.len()],
    )
    .unwrap();
    kv_decode(
        &p.cpu,
        0,
        &idh,
        &contiguous_view(&q, &shape),
        &TensorView::contiguous(
            cpu_out.as_mut_ptr() as usize,
            DType::F32,
            MemoryKind::Host,
            &shape,
        )
        .unwrap(),
        None,
        &DecodeOptions::default(),
        Stream::DEFAULT,
    )
    .unwrap();
    let (idd, qd, od) = (
        dev_upload(&g, &dev_ids),
        dev_upload(&g, &q),
        alloc(&g, n * 4),
    );
    od.fill_async(cuda(&g), 0xff, Stream::DEFAULT).unwrap();
    kv_decode(
        &p.gpu,
        0,
        &TensorView::contiguous(idd.addr(), DType::I32, MemoryKind::Cuda, &[dev_ids.len()])
            .unwrap(),
        &TensorView::contiguous(qd.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap(),
        &TensorView::contiguous(od.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap(),
        None,
        &DecodeOptions::default(),
        Stream::DEFAULT,
    )
    .unwrap();
    let gpu_out = download_as_f32(&od, DType::F32, n);
    let want: Vec<f64> = cpu_out.iter().map(|&x| x as f64).collect();
    let e2 = max_row_relative_error(&gpu_out, &want, 96);
    assert!(
        e1 < tolerance(DType::F16) && e2 < tolerance(DType::F16),
        "{e1:e} {e2:e}"
    );

    // A contiguous external layout ([seq][ctx][heads][dim] per layer): page_size = ctx.
    let ctxlen = 2048usize;
    let seqs = 6usize;
    let ccfg = KvPoolConfig {
        layers: 1,
        kv_heads: 2,
        head_dim: 128,
        page_size: ctxlen,
        dtype: DType::BF16,
        capacity_pages: seqs,
        max_seqs: seqs,
        max_seq_len: ctxlen,
    };
    let elems = seqs * ctxlen * 2 * 128;
    let (kbuf, vbuf) = (alloc(&g, elems * 2), alloc(&g, elems * 2));
    let strides = [ctxlen * 2 * 128, 128, 2 * 128];
    let lay = LayerLayout {
        k: kbuf.addr(),
        v: vbuf.addr(),
        k_strides: strides,
        v_strides: strides,
    };
    let cp = Pair {
        cpu: KvPool::new(cpu_context(0), ccfg, KvStorage::Owned).unwrap(),
        gpu: KvPool::new(Arc::clone(&g), ccfg, KvStorage::External(vec![lay])).unwrap(),
        gctx: Arc::clone(&g),
    };
    let cids: Vec<i32> = (0..seqs)
        .map(|i| cp.add_seq(&mut rng, [2048, 2, 700, 1500, 33, 64][i], i % 2 == 1))
        .collect();
    let (e3, _, _) = cp.compare(
        &mut rng,
        0,
        &cids,
        2,
        8,
        DType::BF16,
        DType::BF16,
        &DecodeOptions::default(),
    );
    assert!(e3 < tolerance(DType::BF16), "{e3:e}");
    println!("large host batch {e1:.2e}, device ids {e2:.2e}, contiguous layout {e3:.2e} (max relative error)");
}

#[test]
fn gpu_decode_graph_replays_while_sequences_grow() {
    let Some(g) = gpu_ctx("gpu_decode_graph_replays_while_sequences_grow") else {
        return;
    };
    let mut rng = Rng::new(24);
    let cfg = KvPoolConfig {
        layers: 1,
        kv_heads: 2,
        head_dim: 128,
        page_size: 16,
        dtype: DType::BF16,
        capacity_pages: 4096,
        max_seqs: 8,
        max_seq_len: 1 << 15,
    };
    let p = pair(&g, cfg);
    let ids: Vec<i32> = [5usize, 700, 3000]
        .iter()
        .map(|&l| p.add_seq(&mut rng, l, false))
        .collect();
    let (b, hq, d) = (ids.len(), 8, 128);
    let n = b * hq * d;
    let shape = [b, hq, d];
    let stream = RawStream::new(&g);
    let s = Stream(stream.ptr() as usize);
    let qd = alloc(&g, n * 4);
    let od = alloc(&g, n * 4);
    let idh =
        TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[b]).unwrap();
    let qg = TensorView::contiguous(qd.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
    let og = TensorView::contiguous(od.addr(), DType::F32, MemoryKind::Cuda, &shape).unwrap();
    g.load_kernels().unwrap();
    let graph = stream.capture(|| {
        kv_decode(
            &p.gpu,
            0,
            &idh,
            &qg,
            &og,
            None,
            &DecodeOptions::default(),
            s,
        )
        .unwrap();
    });
    let mut worst = 0f64;
    for step in 0..24 {
        // Grow every sequence by 1..40 tokens (outside the graph), sometimes fork-free
        // rollback of the middle one, then replay the same graph.
        for &id in &ids {
            let grow = 1 + rng.below(40);
            let c = *p.cpu.config();
            let shape4 = [c.layers, grow, c.kv_heads, c.head_dim];
            let k = rng.vec(shape4.iter().product(), -1.0, 1.0);
            let v = rng.vec(shape4.iter().product(), -1.0, 1.0);
            p.cpu
                .append(
                    id,
                    &contiguous_view(&k, &shape4),
                    &contiguous_view(&v, &shape4),
                    Stream::DEFAULT,
                )
                .unwrap();
            p.gpu
                .append(
                    id,
                    &contiguous_view(&k, &shape4),
                    &contiguous_view(&v, &shape4),
                    s,
                )
                .unwrap();
        }
        if step % 5 == 4 {
            let len = p.cpu.seq_len(ids[1]).unwrap();
            for pool in [&p.cpu, &p.gpu] {
                pool.seq_truncate(ids[1], len - 7, s).unwrap();
            }
        }
        let q = rng.vec(n, -1.0, 1.0);
        let mut qb = q.clone();
        for x in &mut qb {
            *x = round_to(DType::BF16, *x);
        }
        stream.sync();
        qd.upload(&qb).unwrap();
        od.fill_async(cuda(&g), 0xff, s).unwrap();
        graph.launch(&stream);
        stream.sync();
        let got = download_as_f32(&od, DType::F32, n);
        let mut want = vec![0f32; n];
        kv_decode(
            &p.cpu,
            0,
            &idh,
            &contiguous_view(&qb, &shape),
            &TensorView::contiguous(
                want.as_mut_ptr() as usize,
                DType::F32,
                MemoryKind::Host,
                &shape,
            )
            .unwrap(),
            None,
            &DecodeOptions::default(),
            Stream::DEFAULT,
        )
        .unwrap();
        let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
        let e = max_row_relative_error(&got, &want, d);
        assert!(e < tolerance(DType::BF16), "replay {step}: {e:e}");
        worst = worst.max(e);
    }
    println!("graph replay over 24 growing steps: max relative error {worst:.2e}");
}

/// Large buffers (pools from 64 MiB) are mapped through the virtual memory API
/// (`cuMemCreate` + `cuMemMap`), small ones come from `cuMemAlloc`; both read and write
/// every byte, and the mapped memory goes back to the device when dropped.
#[test]
fn gpu_large_buffers_are_mapped_and_returned() {
    let Some(g) = gpu_ctx("gpu_large_buffers_are_mapped_and_returned") else {
        return;
    };
    let vmm = std::env::var("KVR_CUDA_VMM").as_deref() != Ok("0");
    let small = alloc(&g, 1 << 20);
    assert!(!small.is_mapped());
    // Not a multiple of the 2 MiB granularity: the tail of the last chunk is addressable.
    let n = (64 << 20) + 12_345;
    let big = alloc(&g, n);
    assert_eq!(big.is_mapped(), vmm, "a {n}-byte buffer");
    assert_eq!(big.len(), n);
    let pattern: Vec<u32> = (0..n / 4)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761))
        .collect();
    big.upload(&pattern).unwrap();
    let mut back = vec![0u32; n / 4];
    big.download(&mut back).unwrap();
    assert!(back == pattern, "mapped memory read back differs");
    big.fill_async(cuda(&g), 0xA5, Stream::DEFAULT).unwrap();
    big.download(&mut back).unwrap();
    assert!(back.iter().all(|&x| x == 0xA5A5_A5A5));
    drop(big);
    // 8 GiB mapped and dropped in 1 GiB buffers: the device gets it back (other tests of
    // this binary may hold memory meanwhile, far less than the 4 GiB allowance).
    let free = || g.device_info().unwrap().free_memory as i64;
    let before = free();
    for _ in 0..8 {
        let b = alloc(&g, 1 << 30);
        assert_eq!(b.is_mapped(), vmm);
    }
    let after = free();
    assert!(
        after > before - (4 << 30),
        "free device memory {before} -> {after} after 8 GiB of buffers were dropped"
    );
    println!("large buffers: mapped {vmm}, free memory {before} -> {after} bytes");
}

#[test]
fn gpu_pool_refuses_what_it_cannot_decode() {
    let Some(g) = gpu_ctx("gpu_pool_refuses_what_it_cannot_decode") else {
        return;
    };
    let mk = |d: usize, dtype: DType| {
        KvPool::new(
            Arc::clone(&g),
            config(1, 1, d, 16, dtype, 16),
            KvStorage::Owned,
        )
        .unwrap()
    };
    let ids = [0i32];
    let idh =
        TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[1]).unwrap();
    for (d, dtype) in [(64usize, DType::F32), (48, DType::F16)] {
        let pool = mk(d, dtype);
        pool.seq_add(Stream::DEFAULT).unwrap();
        pool.extend(&[(0, 4)], Stream::DEFAULT).unwrap();
        let q = alloc(&g, d * 4);
        let qv =
            TensorView::contiguous(q.addr(), DType::F32, MemoryKind::Cuda, &[1, 1, d]).unwrap();
        let r = kv_decode(
            &pool,
            0,
            &idh,
            &qv,
            &qv,
            None,
            &DecodeOptions::default(),
            Stream::DEFAULT,
        );
        assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    }
    // Host q in a CUDA pool.
    let pool = mk(64, DType::F16);
    pool.seq_add(Stream::DEFAULT).unwrap();
    pool.extend(&[(0, 4)], Stream::DEFAULT).unwrap();
    let q = vec![0f32; 64];
    let r = kv_decode(
        &pool,
        0,
        &idh,
        &contiguous_view(&q, &[1, 1, 64]),
        &contiguous_view(&q, &[1, 1, 64]),
        None,
        &DecodeOptions::default(),
        Stream::DEFAULT,
    );
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}

/// One configuration with two 16-row query tiles per (sequence, KV head) (GQA 16 x T 2)
/// at head dim 256; small enough for compute-sanitizer.
#[test]
fn gpu_decode_two_query_tiles_d256() {
    let Some(g) = gpu_ctx("gpu_decode_two_query_tiles_d256") else {
        return;
    };
    let mut rng = Rng::new(25);
    let cfg = KvPoolConfig {
        layers: 1,
        kv_heads: 1,
        head_dim: 256,
        page_size: 8,
        dtype: DType::BF16,
        capacity_pages: 1024,
        max_seqs: 16,
        max_seq_len: 4096,
    };
    let p = pair(&g, cfg);
    let mut ids: Vec<i32> = [2usize, 17, 64, 65, 522, 2444]
        .iter()
        .map(|&l| p.add_seq(&mut rng, l, false))
        .collect();
    ids.insert(2, -1);
    let mut worst = 0f64;
    for t in [1usize, 2] {
        let (e, _, _) = p.compare(
            &mut rng,
            0,
            &ids,
            t,
            16,
            DType::BF16,
            DType::BF16,
            &DecodeOptions::default(),
        );
        assert!(e < tolerance(DType::BF16), "T {t}: {e:e}");
        worst = worst.max(e);
    }
    println!("d256 x two query tiles: max relative error {worst:.2e}");
}
