//! KV-pool test support: a seeded pool builder and an fp64 attention reference.
#![allow(dead_code)]
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use half::{bf16, f16};
use kvreplay::kv::{DecodeIo, DecodeOptions, KvPool, KvPoolConfig, KvStorage};
use kvreplay::{Context, DType, MemoryKind, Stream, TensorView};

use super::Rng;

/// Rounds f32 values the way the pool stores them.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::I32 => unreachable!(),
    }
}

/// Host K/V of every sequence: `k[seq][layer][token][head][dim]` flattened per sequence.
pub struct SeqData {
    pub len: usize,
    /// [layers][len][hkv][d]
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

pub fn contiguous_view(data: &[f32], shape: &[usize]) -> TensorView {
    TensorView::contiguous(data.as_ptr() as usize, DType::F32, MemoryKind::Host, shape).unwrap()
}

/// Appends `len` random tokens (all layers) to a fresh sequence; returns its id and data.
pub fn add_random_seq(pool: &KvPool, rng: &mut Rng, len: usize) -> (i32, SeqData) {
    let c = *pool.config();
    let seq = pool.seq_add(Stream::DEFAULT).unwrap();
    let n = c.layers * len * c.kv_heads * c.head_dim;
    let k = rng.vec(n, -1.0, 1.0);
    let v = rng.vec(n, -1.0, 1.0);
    if len > 0 {
        let shape = [c.layers, len, c.kv_heads, c.head_dim];
        pool.append(
            seq,
            &contiguous_view(&k, &shape),
            &contiguous_view(&v, &shape),
            Stream::DEFAULT,
        )
        .unwrap();
    }
    let k = k.iter().map(|&x| round_to(c.dtype, x)).collect();
    let v = v.iter().map(|&x| round_to(c.dtype, x)).collect();
    (seq, SeqData { len, k, v })
}

/// fp64 attention of one query row over a sequence's keys `lo..=hi` of `layer`, head `h`.
#[allow(clippy::too_many_arguments)]
pub fn reference_row(
    cfg: &KvPoolConfig,
    data: &SeqData,
    layer: usize,
    h: usize,
    q: &[f64],
    visible: impl Fn(usize) -> bool,
    scale: f64,
    softcap: f64,
) -> (Vec<f64>, f64) {
    let d = cfg.head_dim;
    let idx = |t: usize, i: usize| ((layer * data.len + t) * cfg.kv_heads + h) * d + i;
    let mut scores = Vec::new();
    for t in 0..data.len {
        if !visible(t) {
            continue;
        }
        let mut s = 0f64;
        for i in 0..d {
            s += q[i] * data.k[idx(t, i)] as f64;
        }
        let s = if softcap > 0.0 {
            softcap * (s * scale / softcap).tanh()
        } else {
            s * scale
        };
        scores.push((t, s));
    }
    let mut out = vec![0f64; d];
    if scores.is_empty() {
        return (out, f64::NEG_INFINITY);
    }
    let m = scores.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0f64;
    for &(t, s) in &scores {
        let p = (s - m).exp();
        sum += p;
        for i in 0..d {
            out[i] += p * data.v[idx(t, i)] as f64;
        }
    }
    for o in &mut out {
        *o /= sum;
    }
    (out, m + sum.ln())
}

/// Reference for a whole decode: q `[B][T][Hq][D]` (f32, already rounded as the kernel
/// sees it), returns out `[B][T][Hq][D]` and lse `[B][T][Hq]`.
#[allow(clippy::too_many_arguments)]
pub fn reference_decode(
    cfg: &KvPoolConfig,
    seqs: &[Option<&SeqData>],
    layer: usize,
    q: &[f32],
    t_count: usize,
    hq: usize,
    opts: &DecodeOptions,
) -> (Vec<f64>, Vec<f64>) {
    let d = cfg.head_dim;
    let g = hq / cfg.kv_heads;
    let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt()) as f64;
    let mut out = vec![0f64; seqs.len() * t_count * hq * d];
    let mut lse = vec![f64::NEG_INFINITY; seqs.len() * t_count * hq];
    for (b, s) in seqs.iter().enumerate() {
        let Some(data) = s else { continue };
        for t in 0..t_count {
            let qpos = data.len as isize - t_count as isize + t as isize;
            for head in 0..hq {
                let base = ((b * t_count + t) * hq + head) * d;
                let qr: Vec<f64> = q[base..base + d].iter().map(|&x| x as f64).collect();
                let vis = |kp: usize| {
                    (kp as isize) <= qpos
                        && (opts.window == 0 || kp as isize > qpos - opts.window as isize)
                };
                let (o, l) = reference_row(
                    cfg,
                    data,
                    layer,
                    head / g,
                    &qr,
                    vis,
                    scale,
                    opts.softcap as f64,
                );
                out[base..base + d].copy_from_slice(&o);
                lse[(b * t_count + t) * hq + head] = l;
            }
        }
    }
    (out, lse)
}

/// Largest |got - want| over each output row, relative to that row's largest |want|.
pub fn max_row_relative_error(got: &[f32], want: &[f64], d: usize) -> f64 {
    let mut worst = 0f64;
    for (g, w) in got.chunks(d).zip(want.chunks(d)) {
        let scale = w.iter().fold(0f64, |a, &x| a.max(x.abs())).max(1e-6);
        for (&a, &b) in g.iter().zip(w) {
            let e = (a as f64 - b).abs() / scale;
            if !e.is_finite() {
                return f64::INFINITY;
            }
            worst = worst.max(e);
        }
    }
    worst
}

/// A CPU context.
pub fn cpu_context(threads: usize) -> Arc<Context> {
    Arc::new(
        Context::new(&kvreplay::ContextOptions {
            backend: kvreplay::BackendRequest::Cpu,
            n_threads: threads,
            ..Default::default()
        })
        .unwrap(),
    )
}

pub fn pool(ctx: &Arc<Context>, cfg: KvPoolConfig) -> KvPool {
    KvPool::new(Arc::clone(ctx), cfg, KvStorage::Owned).unwrap()
}

pub fn config(
    layers: usize,
    hkv: usize,
    d: usize,
    page: usize,
    dtype: DType,
    pages: usize,
) -> KvPoolConfig {
    KvPoolConfig {
        layers,
        kv_heads: hkv,
        head_dim: d,
        page_size: page,
        dtype,
        capacity_pages: pages,
        max_seqs: 64,
        max_seq_len: 1 << 17,
    }
}

/// `pool.decode` with the tensors passed one by one.
#[allow(clippy::too_many_arguments)]
pub fn kv_decode(
    pool: &KvPool,
    layer: usize,
    seq_ids: &TensorView,
    q: &TensorView,
    out: &TensorView,
    lse: Option<&TensorView>,
    opts: &DecodeOptions,
    stream: Stream,
) -> kvreplay::Result<()> {
    pool.decode(
        layer,
        &DecodeIo {
            seq_ids,
            q,
            out,
            lse,
        },
        opts,
        stream,
    )
}
