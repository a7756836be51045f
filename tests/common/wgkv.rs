//! Write-gated KV test support: an independent model of what a row keeps and an fp64
//! dense-attention reference over exactly those tokens.
#![allow(dead_code)]
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use kvreplay::kv::wgkv::{GateWeights, WgKvConfig, WgKvPool};
use kvreplay::kv::{DecodeIo, DecodeOptions};
use kvreplay::{Context, DType, MemoryKind, Stream, TensorView};

use super::kv::round_to;
use super::Rng;

/// One token of one row in the model.
#[derive(Clone, Debug)]
pub struct Tok {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub score: f32,
}

/// The model of one sequence: per row (layer-major, then head) its committed tokens and
/// drafts, in time order.
#[derive(Clone, Debug, Default)]
pub struct SeqModel {
    pub rows: Vec<(Vec<Tok>, Vec<Tok>)>,
}

impl SeqModel {
    pub fn new(rows: usize) -> Self {
        SeqModel {
            rows: vec![(Vec::new(), Vec::new()); rows],
        }
    }
    /// Committed tokens attention sees: the last W, the first `sinks`, and older ones
    /// whose score is > tau.
    pub fn kept<'a>(&'a self, row: usize, cfg: &WgKvConfig) -> Vec<&'a Tok> {
        let toks = &self.rows[row].0;
        let n = toks.len();
        toks.iter()
            .enumerate()
            .filter(|(i, t)| i + cfg.local_window >= n || *i < cfg.sinks || t.score > cfg.tau)
            .map(|(_, t)| t)
            .collect()
    }
    /// Global-cache size the model predicts for a row.
    pub fn global(&self, row: usize, cfg: &WgKvConfig) -> usize {
        let n = self.rows[row].0.len();
        self.kept(row, cfg).len() - n.min(cfg.local_window)
    }
}

/// A random K/V append for `rows` rows: ([L][n][H][D] k, v, [L][n][H] scores); scores
/// uniform in [0, 1) (about `1 - tau` admitted).
pub fn random_tokens(
    rng: &mut Rng,
    l: usize,
    n: usize,
    h: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        rng.vec(l * n * h * d, -1.0, 1.0),
        rng.vec(l * n * h * d, -1.0, 1.0),
        rng.vec(l * n * h, 0.0, 1.0),
    )
}

/// Records an append of layers `layers` (`k`/`v` `[layers][n][H][D]`, scores
/// `[layers][n][H]`) into the model.
#[allow(clippy::too_many_arguments)]
pub fn record(
    m: &mut SeqModel,
    cfg: &WgKvConfig,
    layers: std::ops::Range<usize>,
    n: usize,
    k: &[f32],
    v: &[f32],
    scores: &[f32],
    draft: bool,
) {
    let (h, d) = (cfg.kv_heads, cfg.head_dim);
    for (li, l) in layers.enumerate() {
        for j in 0..n {
            for hh in 0..h {
                let at = ((li * n + j) * h + hh) * d;
                let t = Tok {
                    k: k[at..at + d]
                        .iter()
                        .map(|&x| round_to(cfg.dtype, x))
                        .collect(),
                    v: v[at..at + d]
                        .iter()
                        .map(|&x| round_to(cfg.dtype, x))
                        .collect(),
                    score: scores[(li * n + j) * h + hh],
                };
                let row = &mut m.rows[l * h + hh];
                if draft {
                    row.1.push(t);
                } else {
                    row.0.push(t);
                }
            }
        }
    }
}

/// Accepts `n` drafts of every row of the model and drops the rest.
pub fn commit(m: &mut SeqModel, n: usize) {
    for (c, d) in &mut m.rows {
        c.extend(d.drain(..).take(n));
    }
}

/// fp64 reference: `q` `[B][T][Hq][D]`, returns `[B][T][Hq][D]`; query t of a sequence
/// sees the kept committed tokens and drafts 0 ..= (drafts - T + t).
pub fn reference(
    models: &[Option<&SeqModel>],
    cfg: &WgKvConfig,
    layer: usize,
    q: &[f32],
    t_count: usize,
    hq: usize,
    scale: f64,
) -> Vec<f64> {
    let (h, d) = (cfg.kv_heads, cfg.head_dim);
    let g = hq / h;
    let mut out = vec![0f64; models.len() * t_count * hq * d];
    for (b, m) in models.iter().enumerate() {
        let Some(m) = m else { continue };
        for hh in 0..h {
            let row = layer * h + hh;
            let kept = m.kept(row, cfg);
            let drafts = &m.rows[row].1;
            for t in 0..t_count {
                let nd = drafts.len() + 1 + t - t_count;
                let keys: Vec<&Tok> = kept.iter().copied().chain(drafts[..nd].iter()).collect();
                for gi in 0..g {
                    let qh = hh * g + gi;
                    let qo = ((b * t_count + t) * hq + qh) * d;
                    let qv = &q[qo..qo + d];
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|k| {
                            k.k.iter()
                                .zip(qv)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for (k, w) in keys.iter().zip(&e) {
                        for dd in 0..d {
                            out[qo + dd] += w / sum * k.v[dd] as f64;
                        }
                    }
                }
            }
        }
    }
    out
}

pub fn view(data: &[f32], shape: &[usize]) -> TensorView {
    TensorView::contiguous(data.as_ptr() as usize, DType::F32, MemoryKind::Host, shape).unwrap()
}

/// Decodes layer `layer` for `ids` with T query tokens; returns out `[B][T][Hq][D]`.
pub fn decode(
    pool: &WgKvPool,
    layer: usize,
    ids: &[i32],
    q: &[f32],
    t: usize,
    hq: usize,
) -> kvreplay::Result<Vec<f32>> {
    let d = pool.config().head_dim;
    let b = ids.len();
    let mut out = vec![f32::NAN; b * t * hq * d];
    let idv =
        TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[b]).unwrap();
    let qv = view(q, &[b, t, hq, d]);
    let ov = TensorView::contiguous(
        out.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[b, t, hq, d],
    )
    .unwrap();
    pool.decode(
        layer,
        &DecodeIo {
            seq_ids: &idv,
            q: &qv,
            out: &ov,
            lse: None,
        },
        &DecodeOptions::default(),
        Stream::DEFAULT,
    )?;
    Ok(out)
}

/// Largest |got - want| over all elements, relative to max(1, |want|) rows.
pub fn max_err(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b).abs() / b.abs().max(1.0))
        .fold(0.0, f64::max)
}

pub fn cpu_ctx() -> Arc<Context> {
    super::kv::cpu_context(2)
}

pub fn config(
    l: usize,
    h: usize,
    d: usize,
    ps: usize,
    w: usize,
    dtype: DType,
    pages: usize,
) -> WgKvConfig {
    WgKvConfig {
        layers: l,
        kv_heads: h,
        head_dim: d,
        page_size: ps,
        dtype,
        capacity_pages: pages,
        max_seqs: 8,
        max_global_tokens: 1 << 14,
        local_window: w,
        tau: 0.1,
        sinks: 0,
    }
}

// ---- gate ----

extern "C" {
    fn erf(x: f64) -> f64;
}

/// The gate formula in f64, written from the paper / reference code.
pub fn gate_f64(g: &GateWeights, l: usize, h: usize, pre: &[f32], post: &[f32]) -> f64 {
    let d = g.head_dim;
    let lay = &g.layers[l];
    let norm = |x: &[f32], w: &[f32]| -> Vec<f64> {
        let ms = x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() / d as f64;
        x.iter()
            .zip(w)
            .map(|(&a, &b)| a as f64 / (ms + 1e-6).sqrt() * b as f64)
            .collect()
    };
    let mut x = norm(pre, &lay.norm_pre);
    x.extend(norm(post, &lay.norm_post));
    let hid = g.hidden;
    let mut z = lay.fc2_bias[h] as f64;
    for j in 0..hid {
        let mut a = lay.fc1_bias[h * hid + j] as f64;
        for i in 0..2 * d {
            a += lay.fc1_weight[(h * hid + j) * 2 * d + i] as f64 * x[i];
        }
        // SAFETY: libm.
        let gelu = 0.5 * a * (1.0 + unsafe { erf(a / std::f64::consts::SQRT_2) });
        z += gelu * lay.fc2_weight[h * hid + j] as f64;
    }
    (1.0 / (1.0 + (-z).exp())).max(1e-3)
}

pub fn random_gate(
    rng: &mut Rng,
    l: usize,
    h: usize,
    d: usize,
    hid: usize,
) -> (Vec<[Vec<f32>; 6]>, GateWeights) {
    let mut raw = Vec::new();
    for _ in 0..l {
        raw.push([
            rng.vec(d, 0.5, 1.5),
            rng.vec(d, 0.5, 1.5),
            rng.vec(h * hid * 2 * d, -0.2, 0.2),
            rng.vec(h * hid, -0.5, 0.5),
            rng.vec(h * hid, -0.6, 0.6),
            rng.vec(h, -1.0, 1.0),
        ]);
    }
    let views: Vec<[kvreplay::TensorView; 6]> = raw
        .iter()
        .map(|p| {
            [
                view(&p[0], &[d]),
                view(&p[1], &[d]),
                view(&p[2], &[h, hid, 2 * d]),
                view(&p[3], &[h, hid]),
                view(&p[4], &[h, hid]),
                view(&p[5], &[h]),
            ]
        })
        .collect();
    let g = GateWeights::from_views(h, d, &views).unwrap();
    (raw, g)
}
