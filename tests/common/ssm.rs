//! Mamba-2 and linear-attention test support: random inputs, independent f64 references
//! (Mamba-2 restates mamba_ssm's `selective_state_update`), and one driver over both pool
//! types through the Rust API.
#![allow(dead_code)]
#![allow(clippy::needless_range_loop)]

use kvreplay::backend::cuda::memory::DeviceBuffer;
use kvreplay::linear::{
    LinAttnIo, LinAttnOptions, LinAttnPool, Mamba2Io, Mamba2Options, Mamba2Pool, ReplayConfig,
    StateLayout,
};
use kvreplay::{Context, DType, MemoryKind, Stream, TensorView};

use super::Rng;

/// Which family and which of its options a test runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Mamba2 {
        z: bool,
        d: bool,
        bias: bool,
        softplus: bool,
        limits: (f32, f32),
    },
    Lin(Decay),
}

/// Linear attention's decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    None,
    /// One constant per head.
    Head,
    /// One per token and head.
    Token,
}

pub const MAMBA2: Kind = Kind::Mamba2 {
    z: true,
    d: true,
    bias: true,
    softplus: true,
    limits: (0.0, f32::INFINITY),
};

/// A small pool shape: 2 key heads (groups), 4 value heads, dk 32, dv 32 (the CUDA
/// kernels' smallest head dims).
pub fn config(ring: usize, tau: usize, layout: StateLayout, conv_dim: usize) -> ReplayConfig {
    ReplayConfig {
        layers: 2,
        k_heads: 2,
        v_heads: 4,
        dk: 32,
        dv: 32,
        ring_len: ring,
        kv_only_threshold: tau,
        max_drafts: if ring == 0 { 8 } else { ring.min(8) },
        state_dtype: DType::F32,
        entry_dtype: DType::F32,
        layout,
        max_seqs: 8,
        conv_dim,
        conv_kernel: 4,
        conv_dtype: DType::F32,
    }
}

/// Per-layer parameters (A, D, dt_bias, or the per-head log decay).
#[derive(Clone)]
pub struct Params {
    pub a: Vec<f32>,
    pub d: Vec<f32>,
    pub bias: Vec<f32>,
    pub head_decay: Vec<f32>,
}

pub fn random_params(rng: &mut Rng, c: &ReplayConfig) -> Params {
    Params {
        a: rng.vec(c.v_heads, -2.0, -0.2),
        d: rng.vec(c.v_heads, -1.0, 1.0),
        bias: rng.vec(c.v_heads, -1.0, 0.5),
        head_decay: rng.vec(c.v_heads, -0.3, -0.01),
    }
}

/// A batch of tokens `[B][T]...`: q (C), k (B), v (x), z, per-token decay or raw dt, conv.
#[derive(Clone)]
pub struct Tokens {
    pub b: usize,
    pub t: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub z: Vec<f32>,
    pub g: Vec<f32>,
    pub conv: Vec<f32>,
}

pub fn random_tokens(rng: &mut Rng, c: &ReplayConfig, kind: Kind, b: usize, t: usize) -> Tokens {
    let n = b * t;
    let g = match kind {
        // Raw dt: softplus makes it positive; without softplus keep it positive.
        Kind::Mamba2 { softplus, .. } => {
            if softplus {
                rng.vec(n * c.v_heads, -3.0, 1.0)
            } else {
                rng.vec(n * c.v_heads, 1.1, 1.6)
            }
        }
        Kind::Lin(_) => rng.vec(n * c.v_heads, -0.3, -0.01),
    };
    Tokens {
        b,
        t,
        q: rng.vec(n * c.k_heads * c.dk, -1.0, 1.0),
        k: rng.vec(n * c.k_heads * c.dk, -1.0, 1.0),
        v: rng.vec(n * c.v_heads * c.dv, -1.0, 1.0),
        z: rng.vec(n * c.v_heads * c.dv, -2.0, 2.0),
        g,
        conv: rng.vec(n * c.conv_dim, -1.0, 1.0),
    }
}

/// Tokens `t0..t1` of `x` (all rows).
pub fn slice(x: &Tokens, c: &ReplayConfig, t0: usize, t1: usize) -> Tokens {
    let cut = |v: &[f32], per: usize| -> Vec<f32> {
        (0..x.b)
            .flat_map(|b| v[(b * x.t + t0) * per..(b * x.t + t1) * per].to_vec())
            .collect()
    };
    Tokens {
        b: x.b,
        t: t1 - t0,
        q: cut(&x.q, c.k_heads * c.dk),
        k: cut(&x.k, c.k_heads * c.dk),
        v: cut(&x.v, c.v_heads * c.dv),
        z: cut(&x.z, c.v_heads * c.dv),
        g: cut(&x.g, c.v_heads),
        conv: cut(&x.conv, c.conv_dim),
    }
}

/// One layer's states `[Hv][dv * dk]`.
pub type States = Vec<Vec<f64>>;

/// A pool of either family.
pub enum Pool {
    Mamba2(Mamba2Pool),
    Lin(LinAttnPool),
}

/// f32 data, stored as F32 or BF16, where a pool's context keeps it: host memory, or a
/// device copy (CUDA pools).
pub struct Placed {
    pub view: TensorView,
    host: Vec<u8>,
    dtype: DType,
    dev: Option<DeviceBuffer>,
}

impl Placed {
    pub fn new(ctx: &Context, data: &[f32], shape: &[usize]) -> Placed {
        Placed::new_as(ctx, data, shape, DType::F32)
    }
    pub fn new_as(ctx: &Context, data: &[f32], shape: &[usize], dtype: DType) -> Placed {
        let mut host: Vec<u8> = match dtype {
            DType::F32 => data.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            DType::BF16 => data
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_ne_bytes())
                .collect(),
            _ => unreachable!("F32 or BF16"),
        };
        host.resize(host.len().max(4), 0);
        let (addr, mem, dev) = if ctx.memory() == MemoryKind::Cuda {
            let b = super::gpu::alloc(ctx, host.len());
            b.upload(&host).unwrap();
            (b.addr(), MemoryKind::Cuda, Some(b))
        } else {
            (host.as_ptr() as usize, MemoryKind::Host, None)
        };
        let view = TensorView::contiguous(addr, dtype, mem, shape).unwrap();
        Placed {
            view,
            host,
            dtype,
            dev,
        }
    }
    /// The current contents.
    pub fn read(&mut self) -> Vec<f32> {
        if let Some(d) = &self.dev {
            d.download(&mut self.host).unwrap();
        }
        let n = self.view.numel();
        match self.dtype {
            DType::BF16 => self.host[..2 * n]
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32())
                .collect(),
            _ => self.host[..4 * n]
                .chunks_exact(4)
                .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }
    }
}

pub fn ids_view(ids: &[i32]) -> TensorView {
    TensorView::contiguous(
        ids.as_ptr() as usize,
        DType::I32,
        MemoryKind::Host,
        &[ids.len()],
    )
    .unwrap()
}

impl Pool {
    pub fn new(ctx: std::sync::Arc<kvreplay::Context>, c: ReplayConfig, kind: Kind) -> Pool {
        match kind {
            Kind::Mamba2 { .. } => Pool::Mamba2(Mamba2Pool::new(ctx, c, None).unwrap()),
            Kind::Lin(_) => Pool::Lin(LinAttnPool::new(ctx, c, None).unwrap()),
        }
    }
    pub fn ctx(&self) -> std::sync::Arc<Context> {
        match self {
            Pool::Mamba2(p) => p.context().clone(),
            Pool::Lin(p) => p.context().clone(),
        }
    }
    pub fn config(&self) -> ReplayConfig {
        match self {
            Pool::Mamba2(p) => *p.config(),
            Pool::Lin(p) => *p.config(),
        }
    }
    pub fn seq_add(&self) -> i32 {
        match self {
            Pool::Mamba2(p) => p.seq_add(Stream::DEFAULT),
            Pool::Lin(p) => p.seq_add(Stream::DEFAULT),
        }
        .unwrap()
    }
    pub fn seq_free(&self, id: i32) {
        match self {
            Pool::Mamba2(p) => p.seq_free(id, Stream::DEFAULT),
            Pool::Lin(p) => p.seq_free(id, Stream::DEFAULT),
        }
        .unwrap()
    }
    pub fn fill(&self, layer: usize, id: i32) -> usize {
        match self {
            Pool::Mamba2(p) => p.debug_meta(layer, id),
            Pool::Lin(p) => p.debug_meta(layer, id),
        }
        .unwrap()[2] as usize
    }
    pub fn meta(&self, layer: usize, id: i32) -> [i32; 8] {
        match self {
            Pool::Mamba2(p) => p.debug_meta(layer, id),
            Pool::Lin(p) => p.debug_meta(layer, id),
        }
        .unwrap()
    }

    /// Decode or verify `x` in `layer`; returns out `[B][T][Hv][dv]`.
    pub fn run(
        &self,
        layer: usize,
        kind: Kind,
        prm: &Params,
        ids: &[i32],
        x: &Tokens,
        verify: bool,
    ) -> kvreplay::Result<Vec<f32>> {
        self.run_as(layer, kind, prm, ids, x, verify, DType::F32)
    }

    /// `run` with q, k, v, z and the output stored as `dtype` (the per-token decay or dt
    /// and the per-head parameters stay F32, as engines pass them).
    #[allow(clippy::too_many_arguments)]
    pub fn run_as(
        &self,
        layer: usize,
        kind: Kind,
        prm: &Params,
        ids: &[i32],
        x: &Tokens,
        verify: bool,
        dtype: DType,
    ) -> kvreplay::Result<Vec<f32>> {
        let c = self.config();
        let ctx = self.ctx();
        let (b, t) = (x.b, x.t);
        let nan = vec![f32::NAN; b * t * c.v_heads * c.dv];
        let mut out = Placed::new_as(&ctx, &nan, &[b, t, c.v_heads, c.dv], dtype);
        let pl = |d: &[f32], sh: &[usize]| Placed::new(&ctx, d, sh);
        let px = |d: &[f32], sh: &[usize]| Placed::new_as(&ctx, d, sh, dtype);
        let idv = ids_view(ids);
        let hold = [
            px(&x.q, &[b, t, c.k_heads, c.dk]),
            px(&x.k, &[b, t, c.k_heads, c.dk]),
            px(&x.v, &[b, t, c.v_heads, c.dv]),
            px(&x.z, &[b, t, c.v_heads, c.dv]),
            pl(&x.g, &[b, t, c.v_heads]),
            pl(&prm.a, &[c.v_heads]),
            pl(&prm.d, &[c.v_heads]),
            pl(&prm.bias, &[c.v_heads]),
            pl(&prm.head_decay, &[c.v_heads]),
        ];
        let [q, k, v, z, g, a, d, bias, hd] = hold.each_ref().map(|p| p.view);
        let conv_p = (c.conv_dim > 0).then(|| pl(&x.conv, &[b, t, c.conv_dim]));
        let conv = conv_p.as_ref().map(|p| p.view);
        let o = out.view;
        let s = Stream::DEFAULT;
        match (self, kind) {
            (
                Pool::Mamba2(p),
                Kind::Mamba2 {
                    z: zz,
                    d: dd,
                    bias: bb,
                    softplus,
                    limits,
                },
            ) => {
                let io = Mamba2Io {
                    seq_ids: &idv,
                    x: &v,
                    dt: &g,
                    a: &a,
                    b: &k,
                    c: &q,
                    d: dd.then_some(&d),
                    z: zz.then_some(&z),
                    dt_bias: bb.then_some(&bias),
                    out: &o,
                    conv_in: conv.as_ref(),
                };
                let opts = Mamba2Options {
                    dt_softplus: softplus,
                    dt_min: limits.0,
                    dt_max: limits.1,
                };
                if verify {
                    p.verify(layer, &io, &opts, s)?
                } else {
                    p.decode(layer, &io, &opts, s)?
                }
            }
            (Pool::Lin(p), Kind::Lin(decay)) => {
                let io = LinAttnIo {
                    seq_ids: &idv,
                    q: &q,
                    k: &k,
                    v: &v,
                    log_decay: match decay {
                        Decay::None => None,
                        Decay::Head => Some(&hd),
                        Decay::Token => Some(&g),
                    },
                    out: &o,
                    conv_in: conv.as_ref(),
                };
                let opts = LinAttnOptions { scale: Some(0.5) };
                if verify {
                    p.verify(layer, &io, &opts, s)?
                } else {
                    p.decode(layer, &io, &opts, s)?
                }
            }
            _ => panic!("pool and kind disagree"),
        }
        Ok(out.read())
    }

    /// Commits `accepted` drafts of `ids` in every layer, one layer at a time (each layer
    /// has its own conv window); returns the windows of the last layer.
    pub fn commit(&self, ids: &[i32], accepted: &[i32]) -> kvreplay::Result<Vec<f32>> {
        let c = self.config();
        let mut last = Vec::new();
        for l in 0..c.layers {
            last = self.commit_layer(l, ids, accepted)?;
        }
        Ok(last)
    }

    /// Commits `accepted` drafts of `ids` in `layer`; returns its conv windows.
    pub fn commit_layer(
        &self,
        layer: usize,
        ids: &[i32],
        accepted: &[i32],
    ) -> kvreplay::Result<Vec<f32>> {
        let c = self.config();
        let k1 = c.conv_kernel - 1;
        let nan = vec![f32::NAN; ids.len() * k1 * c.conv_dim];
        let mut conv = Placed::new(&self.ctx(), &nan, &[ids.len(), k1, c.conv_dim]);
        let cv = (c.conv_dim > 0).then_some(conv.view);
        let idv = ids_view(ids);
        let acc = ids_view(accepted);
        match self {
            Pool::Mamba2(p) => p.commit(Some(layer), &idv, &acc, cv.as_ref(), Stream::DEFAULT),
            Pool::Lin(p) => p.commit(Some(layer), &idv, &acc, cv.as_ref(), Stream::DEFAULT),
        }?;
        Ok(conv.read())
    }

    /// Materializes every layer of `id` after `keep` entries: states `[layers][Hv][dv][dk]`
    /// (whatever the layout) and conv windows `[layers][k1][conv_dim]`.
    pub fn materialize(
        &self,
        id: i32,
        keep: usize,
        with_conv: bool,
    ) -> kvreplay::Result<(Vec<States>, Vec<f32>)> {
        let c = self.config();
        let ctx = self.ctx();
        let per = c.v_heads * c.dk * c.dv;
        let shape = match c.layout {
            StateLayout::KMajor => [c.layers, c.v_heads, c.dk, c.dv],
            StateLayout::VMajor => [c.layers, c.v_heads, c.dv, c.dk],
        };
        let mut st = Placed::new(&ctx, &vec![f32::NAN; c.layers * per], &shape);
        let k1 = c.conv_kernel - 1;
        let nan = vec![f32::NAN; c.layers * k1 * c.conv_dim];
        let mut cv = Placed::new(&ctx, &nan, &[c.layers, k1, c.conv_dim]);
        let cvo = with_conv.then_some(&cv.view);
        match self {
            Pool::Mamba2(p) => p.materialize(id, keep, &st.view, cvo, Stream::DEFAULT),
            Pool::Lin(p) => p.materialize(id, keep, &st.view, cvo, Stream::DEFAULT),
        }?;
        let buf = st.read();
        let conv = cv.read();
        let states = (0..c.layers)
            .map(|l| to_vdk(&c, &buf[l * per..(l + 1) * per]))
            .collect();
        Ok((states, conv))
    }
}

/// A state `[Hv][...]` in the pool's layout as `[Hv][dv * dk]` (V-major) f64.
pub fn to_vdk(c: &ReplayConfig, buf: &[f32]) -> Vec<Vec<f64>> {
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

fn softplus(x: f64) -> f64 {
    if x <= 20.0 {
        (1.0 + x.exp()).ln()
    } else {
        x
    }
}

/// Independent f64 reference of one layer of one sequence: states `[Hv][dv][dk]`.
#[derive(Clone)]
pub struct Reference {
    pub c: ReplayConfig,
    pub kind: Kind,
    pub state: Vec<Vec<f64>>,
}

impl Reference {
    pub fn new(c: &ReplayConfig, kind: Kind) -> Self {
        Reference {
            c: *c,
            kind,
            state: vec![vec![0.0; c.dk * c.dv]; c.v_heads],
        }
    }

    /// One token (row `b`, position `t` of `x`): returns y `[Hv][dv]`, updates the state.
    /// Mamba-2 as `selective_state_update`: dt = softplus(dt + dt_bias) clamped, dA =
    /// exp(dt A), state = state dA + dt x B^T, y = state C + D x, y *= silu(z). Linear
    /// attention: S = e^g S + v k^T, y = 0.5 S q.
    pub fn step(&mut self, prm: &Params, x: &Tokens, b: usize, t: usize) -> Vec<f64> {
        let c = self.c;
        let (hk, hv, dk, dv) = (c.k_heads, c.v_heads, c.dk, c.dv);
        let mut y = vec![0.0; hv * dv];
        for h in 0..hv {
            let kh = h / (hv / hk);
            let ko = ((b * x.t + t) * hk + kh) * dk;
            let vo = ((b * x.t + t) * hv + h) * dv;
            let go = (b * x.t + t) * hv + h;
            let qv: Vec<f64> = x.q[ko..ko + dk].iter().map(|&v| v as f64).collect();
            let kv: Vec<f64> = x.k[ko..ko + dk].iter().map(|&v| v as f64).collect();
            let xv: Vec<f64> = x.v[vo..vo + dv].iter().map(|&v| v as f64).collect();
            let (decay, weight, scale) = match self.kind {
                Kind::Mamba2 {
                    bias,
                    softplus: sp,
                    limits,
                    ..
                } => {
                    let mut dt = x.g[go] as f64 + if bias { prm.bias[h] as f64 } else { 0.0 };
                    if sp {
                        dt = softplus(dt);
                    }
                    dt = dt.max(limits.0 as f64).min(limits.1 as f64);
                    ((dt * prm.a[h] as f64).exp(), dt, 1.0)
                }
                Kind::Lin(Decay::None) => (1.0, 1.0, 0.5),
                Kind::Lin(Decay::Head) => ((prm.head_decay[h] as f64).exp(), 1.0, 0.5),
                Kind::Lin(Decay::Token) => ((x.g[go] as f64).exp(), 1.0, 0.5),
            };
            let s = &mut self.state[h];
            for iv in 0..dv {
                for ik in 0..dk {
                    s[iv * dk + ik] = s[iv * dk + ik] * decay + weight * xv[iv] * kv[ik];
                }
            }
            for iv in 0..dv {
                let mut acc: f64 = (0..dk).map(|ik| s[iv * dk + ik] * qv[ik]).sum::<f64>() * scale;
                if let Kind::Mamba2 { z, d, .. } = self.kind {
                    if d {
                        acc += prm.d[h] as f64 * xv[iv];
                    }
                    if z {
                        let zz = x.z[vo + iv] as f64;
                        acc *= zz / (1.0 + (-zz).exp());
                    }
                }
                y[h * dv + iv] = acc;
            }
        }
        y
    }
}
