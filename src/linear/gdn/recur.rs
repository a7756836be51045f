//! The stateless recurrent GDN step over the caller's tensors (`kvr_context_gdn_recurrent`):
//! the state comes in as a tensor and goes out as one (or as per-token snapshots), and
//! nothing is kept between calls. That is the shape of llama.cpp's `GGML_OP_GATED_DELTA_NET`
//! (integrations/llama.cpp) and of any engine that owns its recurrent states.
//!
//! Per (sequence b, value head h) and token t, with S the `dv x dk` state (V-major: dk
//! contiguous) and q, k read from key head `kh(h)`:
//!   S <- e^{g} S;  u = beta (v - S k);  S <- S + u k^T;  y = scale * S q.
//! CPU: per (b, h) on the context's threads (or, for a share of the items, on the calling
//! thread alone when the context has one thread), the recurrence of `math::recurrent_step`
//! fused into two passes over the state (`step_vmajor`, the CUDA kernel's order). CUDA:
//! kernels/gdn_recur.cu, one warp per 1, 2 or 4 value rows; a decode step (one token, f32,
//! no snapshots) runs on its lean one-token kernel (`cuda_run1`).

use std::ops::Range;

use crate::abi::{
    dtype_code, GdnRecur1Args, GdnRecurArgs, GdnTensor as DevTensor,
    KVR_GDN_RECUR_THREADS as RECUR_THREADS,
};
use crate::backend::cpu::ThreadPool;
use crate::backend::cuda::module::{Kernel, GDN_RECUR_DKS, GDN_RECUR_ROWS};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Context, Stream};
use crate::error::{Error, Result};
use crate::linear::math::{Draft, L2Norm};
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
    /// L2-normalize q and k first, and how; None = use them as given.
    pub l2norm: Option<L2Norm>,
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
    let mut buf: [(&str, &TensorView); 9] = [
        ("q", io.q),
        ("k", io.k),
        ("v", io.v),
        ("g", io.g),
        ("beta", io.beta),
        ("state_in", io.state_in),
        ("out", io.out),
        ("", io.out),
        ("", io.out),
    ];
    let mut n = 7;
    for (name, t) in [("state_out", io.state_out), ("snapshots", io.snapshots)] {
        if let Some(t) = t {
            buf[n] = (name, t);
            n += 1;
        }
    }
    let named = &buf[..n];
    for (name, t) in named {
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
    for (name, t) in named {
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
    // (Byte ranges computed once: this runs on every call of an engine's decode step.)
    let mut ranges = [(0usize, 0usize); 9];
    for (r, (_, t)) in ranges.iter_mut().zip(named) {
        let b = byte_range(t);
        *r = (b.start, b.end);
    }
    let is_output = |n: &str| matches!(n, "out" | "state_out" | "snapshots");
    for (i, (name, o)) in named.iter().enumerate().filter(|(_, (n, _))| is_output(n)) {
        if !o.is_non_overlapping() {
            return Err(Error::InvalidArgument(format!(
                "{name} has overlapping elements"
            )));
        }
        for (j, (other, x)) in named.iter().enumerate() {
            if i == j {
                continue;
            }
            let in_place = *name == "state_out" && *other == "state_in" && same_view(o, x);
            let (r, s) = (ranges[i], ranges[j]);
            if !in_place && r.0 < s.1 && s.0 < r.1 {
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

/// Element offset of `idx` (a prefix of the view's dimensions) in `t`.
fn offset(t: &TensorView, idx: &[usize]) -> isize {
    idx.iter()
        .zip(t.strides())
        .map(|(&i, &s)| i as isize * s)
        .sum()
}

/// Reads the `n` elements of the innermost dimension at `idx` into `dst` (f32, contiguous:
/// a plain copy; otherwise element by element).
fn read_row(t: &TensorView, idx: &[usize], dst: &mut [f32]) {
    let at = t.addr() as isize + offset(t, idx) * t.dtype().size() as isize;
    if t.dtype() == DType::F32 && t.strides()[t.ndim() - 1] == 1 {
        // SAFETY: the plan checked that the view lies in the caller's memory; `dst.len()`
        // is the extent of its last dimension.
        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(at as *const f32, dst.len()) });
    } else {
        dst.copy_from_slice(&read_vec(t, idx, dst.len()));
    }
}

/// Writes `src` to the innermost dimension at `idx` (f32 states and outputs: a plain copy).
fn write_row(t: &TensorView, idx: &[usize], src: &[f32]) {
    let at = t.addr() as isize + offset(t, idx) * t.dtype().size() as isize;
    if t.dtype() == DType::F32 && t.strides()[t.ndim() - 1] == 1 {
        // SAFETY: as in `read_row`; outputs overlap no other tensor (checked by the plan).
        unsafe { std::slice::from_raw_parts_mut(at as *mut f32, src.len()) }.copy_from_slice(src);
    } else {
        write_vec(t, idx, src);
    }
}

/// (`r . k`, `r . q`) with 8 partial sums each, reading `r` once (vectorizes; the order
/// differs from a plain loop only in rounding).
#[inline(always)]
fn dots(r: &[f32], k: &[f32], q: &[f32]) -> (f32, f32) {
    let (mut ak, mut aq) = ([0f32; 8], [0f32; 8]);
    let (cr, ck, cq) = (r.chunks_exact(8), k.chunks_exact(8), q.chunks_exact(8));
    let (mut tk, mut tq) = (0f32, 0f32);
    for ((x, y), z) in cr
        .remainder()
        .iter()
        .zip(ck.remainder())
        .zip(cq.remainder())
    {
        tk += x * y;
        tq += x * z;
    }
    for ((x, y), z) in cr.zip(ck).zip(cq) {
        for l in 0..8 {
            ak[l] += x[l] * y[l];
            aq[l] += x[l] * z[l];
        }
    }
    let sum = |a: [f32; 8]| (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
    (sum(ak) + tk, sum(aq) + tq)
}

/// One token on V-major state rows, in the CUDA kernel's order: from the rows before the
/// token, a = S_r . k and b = S_r . q; then u = beta (v_r - e^g a), S_r <- e^g S_r + u k
/// and y_r = scale (e^g b + u (k . q)): the recurrence of `math::recurrent_step`, two
/// passes over the state instead of four.
fn step_vmajor(rows: &mut [&mut [f32]], d: &Draft<'_>, scale: f32, y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        /// The same code compiled for AVX2 (8-wide), picked at run time.
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(rows: &mut [&mut [f32]], d: &Draft<'_>, scale: f32, y: &mut [f32]) {
            step_vmajor_body(rows, d, scale, y)
        }
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { avx2(rows, d, scale, y) };
    }
    step_vmajor_body(rows, d, scale, y)
}

#[inline(always)]
fn step_vmajor_body(rows: &mut [&mut [f32]], d: &Draft<'_>, scale: f32, y: &mut [f32]) {
    let e = d.g.exp();
    let kq = dots(d.k, d.k, d.q).1;
    for ((row, yr), &vr) in rows.iter_mut().zip(y.iter_mut()).zip(d.v) {
        let (a, b) = dots(row, d.k, d.q);
        let u = d.beta * (vr - e * a);
        for (x, &kk) in row.iter_mut().zip(d.k) {
            *x = e * *x + u * kk;
        }
        *yr = scale * (e * b + u * kq);
    }
}

/// The address of the innermost row at `idx` of an f32 view whose last dimension is
/// contiguous, else None.
fn f32_row(t: &TensorView, idx: &[usize]) -> Option<*mut f32> {
    (t.dtype() == DType::F32 && t.strides()[t.ndim() - 1] == 1)
        .then(|| (t.addr() as isize + offset(t, idx) * 4) as *mut f32)
}

fn cpu_run(threads: &ThreadPool, io: &RecurrentIo<'_>, opts: &RecurrentOptions, p: &Plan) {
    let (dk, dv) = (p.dk, p.dv);
    let n_snaps = io.snapshots.map_or(0, |s| s.shape()[0]);
    threads.parallel_for(p.items.len(), |i| {
        let item = p.items.start + i;
        let (b, h) = (item / p.hv, item % p.hv);
        let kh = p.key_head(h, opts.head_map);
        // The state rows: state_out's own rows when they are plain f32 (the step then runs
        // in place there, as ggml's does), else a local copy.
        let direct = io
            .state_out
            .and_then(|so| f32_row(so, &[b, h, 0]).map(|_| so));
        let mut local = if direct.is_some() {
            Vec::new()
        } else {
            vec![0f32; dv * dk]
        };
        let mut rows: Vec<&mut [f32]> = match direct {
            // SAFETY: the rows of (b, h) lie in state_out (the plan checked its extent),
            // are disjoint from each other and from every other tensor (non-overlapping
            // outputs) except state_in itself in place, which is read through them only;
            // no other work item touches them.
            Some(so) => (0..dv)
                .map(|r| unsafe {
                    std::slice::from_raw_parts_mut(f32_row(so, &[b, h, r]).unwrap(), dk)
                })
                .collect(),
            None => local.chunks_exact_mut(dk).collect(),
        };
        for (r, row) in rows.iter_mut().enumerate() {
            let src = f32_row(io.state_in, &[b, h, r]);
            if src != Some(row.as_mut_ptr()) {
                read_row(io.state_in, &[b, h, r], row);
            }
        }
        let (mut q, mut k, mut v, mut y) = (
            vec![0f32; dk],
            vec![0f32; dk],
            vec![0f32; dv],
            vec![0f32; dv],
        );
        let mut one = [0f32; 1];
        for t in 0..p.t {
            read_row(io.q, &[b, t, kh], &mut q);
            read_row(io.k, &[b, t, kh], &mut k);
            if let Some(n) = opts.l2norm {
                n.apply(&mut q);
                n.apply(&mut k);
            }
            read_row(io.v, &[b, t, h], &mut v);
            read_row(io.g, &[b, t, h], &mut one);
            let g = one[0];
            read_row(io.beta, &[b, t, h], &mut one);
            let d = Draft {
                q: &q,
                k: &k,
                v: &v,
                g,
                beta: one[0],
            };
            step_vmajor(&mut rows, &d, p.scale, &mut y);
            write_row(io.out, &[b, t, h], &y);
            let slot = p.t - 1 - t;
            if let Some(snaps) = io.snapshots.filter(|_| slot < n_snaps) {
                for (r, row) in rows.iter().enumerate() {
                    write_row(snaps, &[slot, b, h, r], row);
                }
            }
        }
        if let (Some(so), None) = (io.state_out, direct) {
            for (r, row) in rows.iter().enumerate() {
                write_row(so, &[b, h, r], row);
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

/// `KVR_GDN_RECUR_ROWS` (1, 2 or 4, read once).
fn forced_rows() -> Option<usize> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| {
        std::env::var("KVR_GDN_RECUR_ROWS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|r| GDN_RECUR_ROWS.contains(r))
    })
}

/// Value rows per warp of the general kernel: the most (fewer warps, fewer redundant q/k loads and reductions)
/// that still gives the device `8 x SMs` warps (H200, Qwen3-Next shape: 2 rows at batch 1,
/// 4 from batch 2); `KVR_GDN_RECUR_ROWS` (1, 2 or 4, read once) forces it.
fn rows_per_warp(cuda: &CudaBackend, rows_total: usize) -> usize {
    if let Some(r) = forced_rows() {
        return r;
    }
    let target = 8 * cuda.sm_count().max(1) as usize;
    GDN_RECUR_ROWS
        .iter()
        .rev()
        .copied()
        .find(|&r| rows_total / r >= target)
        .unwrap_or(1)
}

/// Value rows per warp of the one-token kernel, measured on an H200 at the Qwen3-Next shape
/// (bench/gdn_recur_ab.cu): 1 while one row per warp leaves at most 32 warps per SM (batch
/// 1), 2 up to 128 (batch 2 to 4), else 4; with the in-kernel L2 norm always 4. The
/// `KVR_GDN_RECUR_ROWS` override applies here as well.
fn rows_per_warp1(cuda: &CudaBackend, rows_total: usize, norm: bool) -> usize {
    if let Some(r) = forced_rows() {
        return r;
    }
    let sms = cuda.sm_count().max(1) as usize;
    if norm {
        4
    } else if rows_total <= 32 * sms {
        1
    } else if rows_total <= 128 * sms {
        2
    } else {
        4
    }
}

/// The one-token kernel (`kvr_gdn_recur1*`) over the call, if it fits it: one token, every
/// tensor f32, no snapshots, a state to write, whole sequences from the first (an exact
/// grid: no bounds checks in the kernel) and token tensors addressable in 32 bits.
/// `KVR_GDN_RECUR1=0` (read once) keeps every call on the general kernel.
fn cuda_run1(
    cuda: &CudaBackend,
    io: &RecurrentIo<'_>,
    opts: &RecurrentOptions,
    p: &Plan,
    stream: Stream,
) -> Option<Result<()>> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("KVR_GDN_RECUR1").is_ok_and(|v| v == "0")) {
        return None;
    }
    let tokens = [io.q, io.k, io.v, io.g, io.beta, io.out];
    let state_out = io.state_out?;
    let rows = rows_per_warp1(cuda, p.b * p.hv * p.dv, opts.l2norm.is_some());
    let fits = p.t == 1
        && io.snapshots.is_none()
        && p.items == (0..p.b * p.hv)
        && p.dv % (rows * (RECUR_THREADS as usize / 32)) == 0
        && tokens.iter().all(|t| {
            t.dtype() == DType::F32
                && t.max_element_offset()
                    .is_some_and(|o| o < i32::MAX as usize)
        });
    if !fits {
        return None;
    }
    // Strides as [B, T, H, row] (q, k: [B, T, Hq, dk], v, out: [B, T, Hv, dv], g, beta:
    // [B, T, Hv]); each below 2^31 as its tensor's extent is.
    let st = |t: &TensorView, i: usize| t.strides()[i] as i32;
    let st3 = |t: &TensorView| [st(t, 0), st(t, 2), st(t, 3)];
    let st2 = |t: &TensorView| [st(t, 0), st(t, 2)];
    let s3 = |t: &TensorView| {
        let s = t.strides();
        [s[0] as i64, s[1] as i64, s[2] as i64]
    };
    let (l2norm, l2norm_eps) = match opts.l2norm {
        None => (0, 0.0),
        Some(L2Norm::SumEps(e)) => (1, e),
        Some(L2Norm::MaxEps(e)) => (2, e),
    };
    let mut args = GdnRecur1Args {
        q: io.q.addr() as u64,
        k: io.k.addr() as u64,
        v: io.v.addr() as u64,
        g: io.g.addr() as u64,
        beta: io.beta.addr() as u64,
        state_in: io.state_in.addr() as u64,
        out: io.out.addr() as u64,
        state_out: state_out.addr() as u64,
        si: s3(io.state_in),
        so: s3(state_out),
        qs: st2(io.q),
        ks: st2(io.k),
        vs: st3(io.v),
        ys: st3(io.out),
        gs: st2(io.g),
        bs: st2(io.beta),
        hq: p.hq as i32,
        kh_div: (p.hv / p.hq) as i32,
        tiled: (opts.head_map == HeadMap::Tiled) as i32,
        l2norm,
        scale: p.scale,
        l2norm_eps,
    };
    let grid = (
        (p.dv / (rows * (RECUR_THREADS as usize / 32))) as u32,
        p.hv as u32,
        p.b as u32,
    );
    let mut params = [&mut args as *mut GdnRecur1Args as *mut std::ffi::c_void];
    Some(cuda.launch_ex(
        Kernel::GdnRecur1 {
            dk: p.dk,
            rows,
            norm: l2norm != 0,
        },
        grid,
        (RECUR_THREADS, 1, 1),
        0,
        stream,
        &mut params,
        opts.pdl,
        0,
    ))
}

fn cuda_run(
    cuda: &CudaBackend,
    io: &RecurrentIo<'_>,
    opts: &RecurrentOptions,
    p: &Plan,
    stream: Stream,
) -> Result<()> {
    if let Some(r) = cuda_run1(cuda, io, opts, p, stream) {
        return r;
    }
    let rows = rows_per_warp(cuda, p.items.len() * p.dv);
    let groups = p.dv.div_ceil(rows);
    let per_block = RECUR_THREADS as usize / 32;
    // Grid (warp groups, value heads, the sequences the items cover).
    let (b0, b1) = (p.items.start / p.hv, p.items.end.div_ceil(p.hv));
    let seqs = b1 - b0;
    if seqs > 65535 || b1 > i32::MAX as usize || p.hv > 65535 {
        return Err(Error::OutOfRange(format!(
            "work items {}..{} span {seqs} sequences of {} value heads: one launch takes at most \
             65535 of each",
            p.items.start, p.items.end, p.hv
        )));
    }
    let grid = (groups.div_ceil(per_block) as u32, p.hv as u32, seqs as u32);
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
        b0: b0 as i32,
        kh_div: (p.hv / p.hq) as i32,
        tiled: (opts.head_map == HeadMap::Tiled) as i32,
        l2norm: match opts.l2norm {
            None => 0,
            Some(L2Norm::SumEps(_)) => 1,
            Some(L2Norm::MaxEps(_)) => 2,
        },
        n_snaps: io.snapshots.map_or(0, |s| s.shape()[0].min(p.t)) as i32,
        scale: p.scale,
        l2norm_eps: match opts.l2norm {
            None => 0.0,
            Some(L2Norm::SumEps(e) | L2Norm::MaxEps(e)) => e,
        },
    };
    debug_assert!(p.b * p.hv >= p.items.end);
    let mut params = [&mut args as *mut GdnRecurArgs as *mut std::ffi::c_void];
    cuda.launch_ex(
        Kernel::GdnRecur { dk: p.dk, rows },
        grid,
        (RECUR_THREADS, 1, 1),
        0,
        stream,
        &mut params,
        opts.pdl,
        0,
    )
}
