//! GDN test support: random inputs, an independent f64 recurrent reference, and helpers
//! to drive a pool through the Rust API.
#![allow(dead_code)]
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use kvreplay::linear::{GdnConfig, GdnIo, GdnOptions, GdnPool, StateLayout};
use kvreplay::{Context, DType, MemoryKind, Stream, TensorView};

use super::Rng;

pub fn config(
    hk: usize,
    hv: usize,
    d: usize,
    ring: usize,
    tau: usize,
    layout: StateLayout,
) -> GdnConfig {
    GdnConfig {
        layers: 1,
        k_heads: hk,
        v_heads: hv,
        dk: d,
        dv: d,
        ring_len: ring,
        kv_only_threshold: tau,
        max_drafts: if ring == 0 { 8 } else { ring.min(8) },
        state_dtype: DType::F32,
        entry_dtype: DType::F32,
        layout,
        max_seqs: 16,
        conv_dim: 0,
        conv_kernel: 4,
        conv_dtype: DType::F32,
    }
}

/// One token's inputs for a batch: q, k `[B][Hk][dk]`, v `[B][Hv][dv]`, g, beta `[B][Hv]`.
#[derive(Clone)]
pub struct Tokens {
    pub b: usize,
    pub t: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
    pub conv: Vec<f32>,
}

pub fn random_tokens(rng: &mut Rng, c: &GdnConfig, b: usize, t: usize) -> Tokens {
    Tokens {
        b,
        t,
        q: rng.vec(b * t * c.k_heads * c.dk, -1.0, 1.0),
        k: rng.vec(b * t * c.k_heads * c.dk, -1.0, 1.0),
        v: rng.vec(b * t * c.v_heads * c.dv, -1.0, 1.0),
        g: rng.vec(b * t * c.v_heads, -0.4, -0.01),
        beta: rng.vec(b * t * c.v_heads, 0.1, 0.9),
        conv: rng.vec(b * t * c.conv_dim, -1.0, 1.0),
    }
}

fn view(data: &[f32], shape: &[usize]) -> TensorView {
    TensorView::contiguous(data.as_ptr() as usize, DType::F32, MemoryKind::Host, shape).unwrap()
}

/// Runs decode (t == 1, auto-commit) or verify on the CPU pool; returns out `[B][T][Hv][dv]`.
pub fn run(pool: &GdnPool, ids: &[i32], x: &Tokens, verify: bool) -> kvreplay::Result<Vec<f32>> {
    let c = *pool.config();
    let (b, t) = (x.b, x.t);
    let mut out = vec![f32::NAN; b * t * c.v_heads * c.dv];
    let idv =
        TensorView::contiguous(ids.as_ptr() as usize, DType::I32, MemoryKind::Host, &[b]).unwrap();
    let q = view(&x.q, &[b, t, c.k_heads, c.dk]);
    let k = view(&x.k, &[b, t, c.k_heads, c.dk]);
    let v = view(&x.v, &[b, t, c.v_heads, c.dv]);
    let g = view(&x.g, &[b, t, c.v_heads]);
    let beta = view(&x.beta, &[b, t, c.v_heads]);
    let o = TensorView::contiguous(
        out.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &[b, t, c.v_heads, c.dv],
    )
    .unwrap();
    let conv = (c.conv_dim > 0).then(|| view(&x.conv, &[b, t, c.conv_dim]));
    let io = GdnIo {
        seq_ids: &idv,
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
        out: &o,
        conv_in: conv.as_ref(),
    };
    let opts = GdnOptions {
        scale: None,
        l2norm_qk: true,
    };
    if verify {
        pool.verify(0, &io, &opts, Stream::DEFAULT)?;
    } else {
        pool.decode(0, &io, &opts, Stream::DEFAULT)?;
    }
    Ok(out)
}

/// Independent f64 reference: states `[Hv][dv][dk]` per sequence.
#[derive(Clone)]
pub struct Reference {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub state: Vec<Vec<f64>>,
}

impl Reference {
    pub fn new(c: &GdnConfig) -> Self {
        Reference {
            hk: c.k_heads,
            hv: c.v_heads,
            dk: c.dk,
            dv: c.dv,
            state: vec![vec![0.0; c.dk * c.dv]; c.v_heads],
        }
    }

    /// One token (row `b`, position `t` of `x`); returns y `[Hv][dv]` and updates the state.
    pub fn step(&mut self, x: &Tokens, b: usize, t: usize) -> Vec<f64> {
        let (hk, hv, dk, dv) = (self.hk, self.hv, self.dk, self.dv);
        let group = hv / hk;
        let mut y = vec![0.0; hv * dv];
        for h in 0..hv {
            let kh = h / group;
            let qo = ((b * x.t + t) * hk + kh) * dk;
            let mut q: Vec<f64> = x.q[qo..qo + dk].iter().map(|&v| v as f64).collect();
            let mut k: Vec<f64> = x.k[qo..qo + dk].iter().map(|&v| v as f64).collect();
            for vec in [&mut q, &mut k] {
                let n = (vec.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
                vec.iter_mut().for_each(|a| *a /= n);
            }
            let scale = 1.0 / (dk as f64).sqrt();
            q.iter_mut().for_each(|a| *a *= scale);
            let vo = ((b * x.t + t) * hv + h) * dv;
            let go = (b * x.t + t) * hv + h;
            let (g, beta) = (x.g[go] as f64, x.beta[go] as f64);
            let s = &mut self.state[h];
            let a = g.exp();
            s.iter_mut().for_each(|e| *e *= a);
            for iv in 0..dv {
                let sk: f64 = (0..dk).map(|ik| s[iv * dk + ik] * k[ik]).sum();
                let u = beta * (x.v[vo + iv] as f64 - sk);
                for ik in 0..dk {
                    s[iv * dk + ik] += u * k[ik];
                }
            }
            for iv in 0..dv {
                y[h * dv + iv] = (0..dk).map(|ik| s[iv * dk + ik] * q[ik]).sum();
            }
        }
        y
    }
}

/// Largest |got - want| per output row, relative to that row's largest |want|.
pub fn rel_err(got: &[f32], want: &[f64], d: usize) -> f64 {
    let mut worst = 0f64;
    for (g, w) in got.chunks(d).zip(want.chunks(d)) {
        let scale = w.iter().fold(1e-3f64, |a, &x| a.max(x.abs()));
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

pub fn cpu_ctx() -> Arc<Context> {
    super::kv::cpu_context(2)
}

/// Exports the state of (layer 0, seq) as `[Hv][dv][dk]` f64, whatever the layout.
pub fn export(pool: &GdnPool, seq: i32) -> Vec<Vec<f64>> {
    let c = *pool.config();
    let mut buf = vec![0f32; c.v_heads * c.dk * c.dv];
    let shape = match c.layout {
        StateLayout::KMajor => [c.v_heads, c.dk, c.dv],
        StateLayout::VMajor => [c.v_heads, c.dv, c.dk],
    };
    let t = TensorView::contiguous(
        buf.as_mut_ptr() as usize,
        DType::F32,
        MemoryKind::Host,
        &shape,
    )
    .unwrap();
    pool.export_state(0, seq, &t, None, Stream::DEFAULT)
        .unwrap();
    (0..c.v_heads)
        .map(|h| {
            let mut s = vec![0.0; c.dk * c.dv];
            for iv in 0..c.dv {
                for ik in 0..c.dk {
                    let i = match c.layout {
                        StateLayout::KMajor => ik * c.dv + iv,
                        StateLayout::VMajor => iv * c.dk + ik,
                    };
                    s[iv * c.dk + ik] = buf[h * c.dk * c.dv + i] as f64;
                }
            }
            s
        })
        .collect()
}
