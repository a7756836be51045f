//! The stateless recurrent GDN step over the caller's tensors (`kvr_context_gdn_recurrent`):
//! the state comes in as a tensor and goes out as one (or as per-token snapshots), and
//! nothing is kept between calls. That is the shape of llama.cpp's `GGML_OP_GATED_DELTA_NET`
//! (integrations/llama.cpp) and of any engine that owns its recurrent states.
//!
//! Per (sequence b, value head h) and token t, with S the `dv x dk` state (V-major: dk
//! contiguous) and q, k read from key head `kh(h)`:
//!   S <- e^{g} S;  u = beta (v - S k);  S <- S + u k^T;  y = scale * S q.
//! CPU: `math::recurrent_step` per (b, h) on the context's threads (or, for a share of the
//! items, on the calling thread alone when the context has one thread). CUDA:
//! kernels/gdn_recur.cu, one warp per 1, 2 or 4 value rows.

use std::ops::Range;

use crate::abi::{
    dtype_code, GdnRecurArgs, GdnTensor as DevTensor, KVR_GDN_RECUR_THREADS as RECUR_THREADS,
};
use crate::backend::cpu::ThreadPool;
use crate::backend::cuda::module::{Kernel, GDN_RECUR_DKS, GDN_RECUR_ROWS};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Context, Stream};
use crate::error::{Error, Result};
use crate::linear::math::{self, Draft, StateLayout};
use crate::linear::replay::cpu::{read_vec, write_vec};
use crate::pool::check_float;
use crate::tensor::{DType, TensorView};

/// Which key head a value head reads when there are fewer key heads (Hq) than value heads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeadMap {
    /// Value head h reads key head h / (Hv / Hq): consecutive value heads share a key head
    /// (`repeat_interleave`, Qwen3-Next checkpoints, the GDN pools).
    #[default]
    Grouped,
    /// Value head h reads key head h % Hq (`ggml_repeat`, llama.cpp's broadcast).
    Tiled,
}

/// The tensors of one call. q, k: `[B, T, Hq, dk]`; v, out: `[B, T, Hv, dv]`; g (log
/// decay), beta: `[B, T, Hv]`; state_in, state_out: `[B, Hv, dv, dk]` f32; snapshots: `[S,
/// B, Hv, dv, dk]` f32, slot s = the state after token T - 1 - s (written for s < min(S, T)).
#[derive(Clone, Copy, Debug)]
pub struct RecurrentIo<'a> {
    pub q: &'a TensorView,
    pub k: &'a TensorView,
    pub v: &'a TensorView,
    pub g: &'a TensorView,
    pub beta: &'a TensorView,
    pub state_in: &'a TensorView,
    pub state_out: Option<&'a TensorView>,
    pub snapshots: Option<&'a TensorView>,
    pub out: &'a TensorView,
}

/// Options of one call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecurrentOptions {
    /// Scale of the output (the same as scaling q); None = 1/sqrt(dk).
    pub scale: Option<f32>,
    /// L2-normalize q and k first (`x / sqrt(sum x^2 + 1e-6)`).
    pub l2norm_qk: bool,
    pub head_map: HeadMap,
    /// The work items (b * Hv + h) this call computes; None = all.
    pub items: Option<Range<usize>>,
    /// CUDA: launch with programmatic dependent launch (sm_90+; ignored elsewhere).
    pub pdl: bool,
}

/// A checked call.
struct Plan {
    b: usize,
    t: usize,
    hq: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    items: Range<usize>,
    scale: f32,
}

impl Plan {
    fn key_head(&self, h: usize, map: HeadMap) -> usize {
        match map {
            HeadMap::Grouped => h / (self.hv / self.hq),
            HeadMap::Tiled => h % self.hq,
        }
    }
}

fn shape_err(name: &str, t: &TensorView, want: String) -> Error {
    Error::InvalidArgument(format!("{name} has shape {:?}; expected {want}", t.shape()))
}

fn byte_range(t: &TensorView) -> Range<usize> {
    t.addr()..t.addr() + t.span_bytes()
}

fn same_view(a: &TensorView, b: &TensorView) -> bool {
    a.addr() == b.addr()
        && a.dtype() == b.dtype()
        && a.shape() == b.shape()
        && a.strides() == b.strides()
}

/// Checks a call; an error leaves every tensor untouched.
fn plan(ctx: &Context, io: &RecurrentIo<'_>, opts: &RecurrentOptions) -> Result<Plan> {
    let memory = ctx.memory();
    let mut named: Vec<(&str, &TensorView)> = vec![
        ("q", io.q),
        ("k", io.k),
        ("v", io.v),
        ("g", io.g),
        ("beta", io.beta),
        ("state_in", io.state_in),
        ("out", io.out),
    ];
    if let Some(s) = io.state_out {
        named.push(("state_out", s));
    }
    if let Some(s) = io.snapshots {
        named.push(("snapshots", s));
    }
    for (name, t) in &named {
        t.expect_memory(memory, name)?;
    }
    let ranks = [
        ("q", 4),
        ("k", 4),
        ("v", 4),
        ("g", 3),
        ("beta", 3),
        ("state_in", 4),
        ("out", 4),
        ("state_out", 4),
        ("snapshots", 5),
    ];
    for (name, t) in &named {
        let want = ranks.iter().find(|r| r.0 == *name).map_or(0, |r| r.1);
        if t.ndim() != want {
            return Err(Error::InvalidArgument(format!(
                "{name} must have {want} dimensions ({} given)",
                t.ndim()
            )));
        }
    }
    let [b, t, hq, dk] = [0, 1, 2, 3].map(|i| io.q.shape()[i]);
    let [hv, dv] = [io.v.shape()[2], io.v.shape()[3]];
    if b == 0 || t == 0 || hq == 0 || dk == 0 || hv == 0 || dv == 0 {
        return Err(Error::InvalidArgument(format!(
            "empty call: q {:?}, v {:?} (B, T, heads and head dims must be >= 1)",
            io.q.shape(),
            io.v.shape()
        )));
    }
    if io.k.shape() != io.q.shape() {
        return Err(shape_err("k", io.k, format!("{:?} (as q)", io.q.shape())));
    }
    for (name, x) in [("v", io.v), ("out", io.out)] {
        if x.shape() != [b, t, hv, dv] {
            return Err(shape_err(name, x, format!("[{b}, {t}, {hv}, {dv}]")));
        }
    }
    for (name, x) in [("g", io.g), ("beta", io.beta)] {
        if x.shape() != [b, t, hv] {
            return Err(shape_err(name, x, format!("[{b}, {t}, {hv}]")));
        }
    }
    if hv % hq != 0 {
        return Err(Error::InvalidArgument(format!(
            "value heads ({hv}) must be a multiple of key heads ({hq})"
        )));
    }
    let state = [b, hv, dv, dk];
    for (name, x) in [("state_in", Some(io.state_in)), ("state_out", io.state_out)] {
        if let Some(x) = x {
            if x.shape() != state {
                return Err(shape_err(name, x, format!("{state:?} ([B, Hv, dv, dk])")));
            }
        }
    }
    if let Some(s) = io.snapshots {
        if s.shape()[1..] != state || s.shape()[0] == 0 {
            return Err(shape_err(
                "snapshots",
                s,
                format!("[S >= 1, {b}, {hv}, {dv}, {dk}]"),
            ));
        }
    }
    if io.state_out.is_none() && io.snapshots.is_none() {
        return Err(Error::NullArgument(
            "state_out and snapshots are both NULL: the new state must go somewhere".into(),
        ));
    }
    for (name, x) in &named[..5] {
        check_float(x, name)?;
    }
    check_float(io.out, "out")?;
    for (name, x) in &named[5..] {
        if *name != "out" && x.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch(format!(
                "{name} must be f32, not {}",
                x.dtype()
            )));
        }
    }
    // Outputs: no element written twice, and no overlap with any other tensor, except a
    // state updated in place (state_out exactly state_in).
    let outputs: Vec<(&str, &TensorView)> = named
        .iter()
        .filter(|(n, _)| matches!(*n, "out" | "state_out" | "snapshots"))
        .copied()
        .collect();
    for (name, o) in &outputs {
        if !o.is_non_overlapping() {
            return Err(Error::InvalidArgument(format!(
                "{name} has overlapping elements"
            )));
        }
        for (other, x) in &named {
            if other == name {
                continue;
            }
            let in_place = *name == "state_out" && *other == "state_in" && same_view(o, x);
            let (r, s) = (byte_range(o), byte_range(x));
            if !in_place && r.start < s.end && s.start < r.end {
                return Err(Error::InvalidArgument(format!(
                    "{name} overlaps {other} (only state_out may be state_in itself, for an \
                     update in place)"
                )));
            }
        }
    }
    let n_items = b * hv;
    let items = match &opts.items {
        None => 0..n_items,
        Some(r) if r.start <= r.end && r.end <= n_items => r.clone(),
        Some(r) => {
            return Err(Error::OutOfRange(format!(
                "items {}..{} outside 0..{n_items} (B * Hv)",
                r.start, r.end
            )))
        }
    };
    let scale = opts.scale.unwrap_or(1.0 / (dk as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "scale {scale} is not finite"
        )));
    }
    if ctx.cuda().is_some() {
        cuda_checks(io, dk)?;
    }
    Ok(Plan {
        b,
        t,
        hq,
        hv,
        dk,
        dv,
        items,
        scale,
    })
}

/// What the CUDA kernel needs beyond the shapes: a compiled dk, and key rows it can load
/// as vectors: contiguous, each lane's dk / 32 keys aligned to their size up to 16 bytes.
fn cuda_checks(io: &RecurrentIo<'_>, dk: usize) -> Result<()> {
    if !GDN_RECUR_DKS.contains(&dk) {
        return Err(Error::Unsupported(format!(
            "dk = {dk}: the CUDA kernel is built for dk in {GDN_RECUR_DKS:?}"
        )));
    }
    let keyed = [
        ("q", Some(io.q)),
        ("k", Some(io.k)),
        ("state_in", Some(io.state_in)),
        ("state_out", io.state_out),
        ("snapshots", io.snapshots),
    ];
    for (name, x) in keyed {
        let Some(x) = x else { continue };
        let n = x.ndim();
        let es = x.dtype().size();
        let align = ((dk / 32) * es).min(16) / es;
        let rows_aligned = x.strides()[..n - 1]
            .iter()
            .zip(x.shape())
            .all(|(&s, &e)| e == 1 || s as usize % align == 0);
        if x.strides()[n - 1] != 1 || (x.addr() / x.dtype().size()) % align != 0 || !rows_aligned {
            return Err(Error::InvalidArgument(format!(
                "on CUDA, {name}'s last dimension must be contiguous and every row must start \
                 at a multiple of {align} elements (strides {:?}, address {:#x})",
                x.strides(),
                x.addr()
            )));
        }
    }
    Ok(())
}

/// Runs one call: checks everything, then computes on the context's backend (CUDA: queued
/// on `stream`, returns without waiting).
pub fn recurrent(
    ctx: &Context,
    io: &RecurrentIo<'_>,
    opts: &RecurrentOptions,
    stream: Stream,
) -> Result<()> {
    let p = plan(ctx, io, opts)?;
    if p.items.is_empty() {
        return Ok(());
    }
    if let Some(cpu) = ctx.cpu() {
        cpu_run(cpu.pool(), io, opts, &p);
        Ok(())
    } else if let Some(cuda) = ctx.cuda() {
        cuda_run(cuda, io, opts, &p, stream)
    } else {
        Err(Error::Unsupported("no backend".into()))
    }
}

fn cpu_run(threads: &ThreadPool, io: &RecurrentIo<'_>, opts: &RecurrentOptions, p: &Plan) {
    let (dk, dv) = (p.dk, p.dv);
    let n_snaps = io.snapshots.map_or(0, |s| s.shape()[0]);
    threads.parallel_for(p.items.len(), |i| {
        let item = p.items.start + i;
        let (b, h) = (item / p.hv, item % p.hv);
        let kh = p.key_head(h, opts.head_map);
        let mut s = vec![0f32; dv * dk];
        for r in 0..dv {
            s[r * dk..(r + 1) * dk].copy_from_slice(&read_vec(io.state_in, &[b, h, r, 0], dk));
        }
        let mut y = vec![0f32; dv];
        for t in 0..p.t {
            let mut q = read_vec(io.q, &[b, t, kh, 0], dk);
            let mut k = read_vec(io.k, &[b, t, kh, 0], dk);
            if opts.l2norm_qk {
                math::l2_normalize(&mut q);
                math::l2_normalize(&mut k);
            }
            let v = read_vec(io.v, &[b, t, h, 0], dv);
            let d = Draft {
                q: &q,
                k: &k,
                v: &v,
                g: read_vec(io.g, &[b, t, h], 1)[0],
                beta: read_vec(io.beta, &[b, t, h], 1)[0],
            };
            math::recurrent_step(true, &mut s, StateLayout::VMajor, dk, dv, &d, &mut y);
            y.iter_mut().for_each(|x| *x *= p.scale);
            write_vec(io.out, &[b, t, h, 0], &y);
            let slot = p.t - 1 - t;
            if let Some(snaps) = io.snapshots.filter(|_| slot < n_snaps) {
                for r in 0..dv {
                    write_vec(snaps, &[slot, b, h, r, 0], &s[r * dk..(r + 1) * dk]);
                }
            }
        }
        if let Some(so) = io.state_out {
            for r in 0..dv {
                write_vec(so, &[b, h, r, 0], &s[r * dk..(r + 1) * dk]);
            }
        }
    });
}

/// A view as a kernel tensor argument (strides padded to 4 dims).
fn dev(t: &TensorView) -> DevTensor {
    let mut s = [0i64; 4];
    for (i, &x) in t.strides().iter().enumerate().take(4) {
        s[i] = x as i64;
    }
    DevTensor {
        p: t.addr() as u64,
        s,
        dtype: dtype_code(t.dtype()),
        pad: 0,
    }
}

/// Value rows per warp: the most (fewer warps, fewer redundant q/k loads and reductions)
/// that still gives the device `16 x SMs` warps; `KVR_GDN_RECUR_ROWS` (1, 2 or 4) forces it.
fn rows_per_warp(cuda: &CudaBackend, rows_total: usize) -> usize {
    if let Some(r) = std::env::var("KVR_GDN_RECUR_ROWS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|r| GDN_RECUR_ROWS.contains(r))
    {
        return r;
    }
    let target = 16 * cuda.sm_count().max(1) as usize;
    GDN_RECUR_ROWS
        .iter()
        .rev()
        .copied()
        .find(|&r| rows_total / r >= target)
        .unwrap_or(1)
}

fn cuda_run(
    cuda: &CudaBackend,
    io: &RecurrentIo<'_>,
    opts: &RecurrentOptions,
    p: &Plan,
    stream: Stream,
) -> Result<()> {
    let rows = rows_per_warp(cuda, p.items.len() * p.dv);
    let groups = p.dv.div_ceil(rows);
    let warps = p.items.len() * groups;
    let per_block = RECUR_THREADS as usize / 32;
    let blocks = warps.div_ceil(per_block);
    let blocks = u32::try_from(blocks)
        .ok()
        .filter(|&x| x < i32::MAX as u32)
        .ok_or_else(|| Error::OutOfRange(format!("{warps} warps exceed one launch")))?;
    let strides = |t: Option<&TensorView>, n: usize| -> [i64; 4] {
        let mut s = [0i64; 4];
        if let Some(t) = t {
            for (i, &x) in t.strides().iter().take(n).enumerate() {
                s[i] = x as i64;
            }
        }
        s
    };
    let si = strides(Some(io.state_in), 3);
    let so = strides(io.state_out, 3);
    let mut args = GdnRecurArgs {
        q: dev(io.q),
        k: dev(io.k),
        v: dev(io.v),
        g: dev(io.g),
        beta: dev(io.beta),
        out: dev(io.out),
        state_in: io.state_in.addr() as u64,
        state_out: io.state_out.map_or(0, |t| t.addr() as u64),
        snaps: io.snapshots.map_or(0, |t| t.addr() as u64),
        si: [si[0], si[1], si[2]],
        so: [so[0], so[1], so[2]],
        sn: strides(io.snapshots, 4),
        item0: p.items.start as i64,
        item_end: p.items.end as i64,
        t: p.t as i32,
        hq: p.hq as i32,
        hv: p.hv as i32,
        dv: p.dv as i32,
        groups: groups as i32,
        tiled: (opts.head_map == HeadMap::Tiled) as i32,
        l2norm: opts.l2norm_qk as i32,
        n_snaps: io.snapshots.map_or(0, |s| s.shape()[0].min(p.t)) as i32,
        scale: p.scale,
        pad: 0,
    };
    debug_assert!(p.b * p.hv >= p.items.end);
    let mut params = [&mut args as *mut GdnRecurArgs as *mut std::ffi::c_void];
    cuda.launch_ex(
        Kernel::GdnRecur { dk: p.dk, rows },
        (blocks, 1, 1),
        (RECUR_THREADS, 1, 1),
        0,
        stream,
        &mut params,
        opts.pdl,
    )
}
