//! The stateless recurrent GDN step (`kvr_context_gdn_recurrent`): test cases, random data,
//! an independent f64 reference (llama.cpp's CPU `GGML_OP_GATED_DELTA_NET`, transcribed:
//! the state as `M[j][i] = S[i][j]`, decayed, corrected row by row, then read out), and a
//! runner through the C API over host or device memory.
#![allow(dead_code)]

use std::ffi::c_void;
use std::ptr::null;

use half::{bf16, f16};
use kvreplay::ffi::*;

use super::{tensor, Rng};

/// Where a case's tensors live.
pub trait Mem {
    /// Copies `bytes` into new memory (16-byte aligned) and returns its address.
    fn upload(&mut self, bytes: &[u8]) -> *mut c_void;
    fn download(&self, p: *mut c_void, bytes: usize) -> Vec<u8>;
    fn device(&self) -> kvr_device_type;
    /// Waits for the work queued on the call's stream.
    fn sync(&self) {}
    /// The stream the call runs on.
    fn stream(&self) -> *mut c_void {
        std::ptr::null_mut()
    }
}

/// Host memory (CPU contexts).
#[derive(Default)]
pub struct HostMem {
    bufs: Vec<Vec<u128>>,
}

impl Mem for HostMem {
    fn upload(&mut self, bytes: &[u8]) -> *mut c_void {
        let mut w = vec![0u128; bytes.len().div_ceil(16).max(1)];
        // SAFETY: w holds at least bytes.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), w.as_mut_ptr() as *mut u8, bytes.len())
        };
        let p = w.as_mut_ptr() as *mut c_void;
        self.bufs.push(w);
        p
    }
    fn download(&self, p: *mut c_void, bytes: usize) -> Vec<u8> {
        // SAFETY: p came from upload with at least `bytes` bytes.
        unsafe { std::slice::from_raw_parts(p as *const u8, bytes) }.to_vec()
    }
    fn device(&self) -> kvr_device_type {
        KVR_DEVICE_HOST
    }
}

/// One call's configuration.
#[derive(Clone, Debug)]
pub struct Case {
    pub b: usize,
    pub t: usize,
    pub hq: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    /// Snapshot slots (0: none).
    pub snaps: usize,
    /// Write state_out (else only snapshots).
    pub state_out: bool,
    /// state_out is state_in.
    pub in_place: bool,
    pub tiled: bool,
    pub l2norm: bool,
    /// 0: default scale.
    pub scale: f32,
    /// dtype of q, k, v, g, beta and out.
    pub dtype: kvr_dtype,
    /// q and k stored [B, Hq, T, dk] (non-contiguous [B, T, Hq, dk] views).
    pub permuted: bool,
    /// State rows padded to dk + 4 elements.
    pub padded_state: bool,
    /// (item_begin, item_end) calls that together make the step (empty: one call, all).
    pub splits: Vec<(i64, i64)>,
    pub pdl: bool,
    pub seed: u64,
}

impl Case {
    pub fn new(b: usize, t: usize, hq: usize, hv: usize, d: usize) -> Case {
        Case {
            b,
            t,
            hq,
            hv,
            dk: d,
            dv: d,
            snaps: 0,
            state_out: true,
            in_place: false,
            tiled: false,
            l2norm: false,
            scale: 0.0,
            dtype: KVR_DTYPE_F32,
            permuted: false,
            padded_state: false,
            splits: Vec::new(),
            pdl: false,
            seed: 1,
        }
    }
    fn row(&self) -> usize {
        if self.padded_state {
            self.dk + 4
        } else {
            self.dk
        }
    }
    pub fn state_elems(&self) -> usize {
        self.b * self.hv * self.dv * self.row()
    }
}

/// Logical (contiguous) inputs.
pub struct Data {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
    /// [B, Hv, dv, dk]
    pub s0: Vec<f32>,
}

fn round(dtype: kvr_dtype, x: f32) -> f32 {
    match dtype {
        KVR_DTYPE_F16 => f16::from_f32(x).to_f32(),
        KVR_DTYPE_BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

pub fn random_data(c: &Case) -> Data {
    let mut rng = Rng::new(c.seed);
    let nq = c.b * c.t * c.hq * c.dk;
    let nv = c.b * c.t * c.hv * c.dv;
    let ng = c.b * c.t * c.hv;
    let mut d = Data {
        q: rng.vec(nq, -1.0, 1.0),
        k: rng.vec(nq, -1.0, 1.0),
        v: rng.vec(nv, -1.0, 1.0),
        g: rng.vec(ng, -2.0, -0.01),
        beta: rng.vec(ng, 0.05, 1.0),
        s0: rng.vec(c.b * c.hv * c.dv * c.dk, -0.5, 0.5),
    };
    if !c.l2norm {
        // Keys of norm ~1 (llama.cpp normalizes them before the op) keep the recurrence tame.
        let n = c.dk;
        for x in d.q.chunks_mut(n).chain(d.k.chunks_mut(n)) {
            let s: f32 = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            x.iter_mut().for_each(|v| *v /= s);
        }
    }
    for x in [&mut d.q, &mut d.k, &mut d.v, &mut d.g, &mut d.beta] {
        x.iter_mut().for_each(|v| *v = round(c.dtype, *v));
    }
    d
}

/// The expected outputs: out [B, T, Hv, dv], the final state [B, Hv, dv, dk] and the
/// snapshots [S, B, Hv, dv, dk] (NaN where a slot is not written).
pub struct Expected {
    pub out: Vec<f64>,
    pub state: Vec<f64>,
    pub snaps: Vec<f64>,
}

pub fn reference(c: &Case, x: &Data) -> Expected {
    let (dk, dv) = (c.dk, c.dv);
    let mut e = Expected {
        out: vec![0.0; c.b * c.t * c.hv * dv],
        state: vec![0.0; c.b * c.hv * dv * dk],
        snaps: vec![f64::NAN; c.snaps * c.b * c.hv * dv * dk],
    };
    let scale = if c.scale == 0.0 {
        1.0 / (dk as f64).sqrt()
    } else {
        c.scale as f64
    };
    let norm = |v: &[f32]| -> Vec<f64> {
        let v: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        if !c.l2norm {
            return v;
        }
        let n = (v.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
        v.iter().map(|x| x / n).collect()
    };
    for b in 0..c.b {
        for h in 0..c.hv {
            let kh = if c.tiled { h % c.hq } else { h / (c.hv / c.hq) };
            let base = (b * c.hv + h) * dv * dk;
            // m[j * dk + i] = S[i][j]: row j (a value index) holds the keys.
            let mut m: Vec<f64> = x.s0[base..base + dv * dk]
                .iter()
                .map(|&v| v as f64)
                .collect();
            for t in 0..c.t {
                let qo = ((b * c.t + t) * c.hq + kh) * dk;
                let q = norm(&x.q[qo..qo + dk]);
                let k = norm(&x.k[qo..qo + dk]);
                let gi = (b * c.t + t) * c.hv + h;
                let decay = (x.g[gi] as f64).exp();
                let beta = x.beta[gi] as f64;
                m.iter_mut().for_each(|v| *v *= decay);
                let vo = ((b * c.t + t) * c.hv + h) * dv;
                let delta: Vec<f64> = (0..dv)
                    .map(|j| {
                        let sum: f64 = (0..dk).map(|i| m[j * dk + i] * k[i]).sum();
                        (x.v[vo + j] as f64 - sum) * beta
                    })
                    .collect();
                for j in 0..dv {
                    for i in 0..dk {
                        m[j * dk + i] += k[i] * delta[j];
                    }
                }
                for j in 0..dv {
                    let sum: f64 = (0..dk).map(|i| m[j * dk + i] * q[i]).sum();
                    e.out[vo + j] = sum * scale;
                }
                let slot = c.t - 1 - t;
                if slot < c.snaps {
                    let so = ((slot * c.b + b) * c.hv + h) * dv * dk;
                    e.snaps[so..so + dv * dk].copy_from_slice(&m);
                }
            }
            e.state[base..base + dv * dk].copy_from_slice(&m);
        }
    }
    e
}

fn encode(dtype: kvr_dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        KVR_DTYPE_F32 => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        KVR_DTYPE_F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_bits().to_ne_bytes())
            .collect(),
        _ => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_bits().to_ne_bytes())
            .collect(),
    }
}

fn decode(dtype: kvr_dtype, b: &[u8]) -> Vec<f32> {
    match dtype {
        KVR_DTYPE_F32 => b
            .chunks(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
        KVR_DTYPE_F16 => b
            .chunks(2)
            .map(|c| f16::from_bits(u16::from_ne_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
        _ => b
            .chunks(2)
            .map(|c| bf16::from_bits(u16::from_ne_bytes(c.try_into().unwrap())).to_f32())
            .collect(),
    }
}

/// A sentinel the outputs start with: a value no result has.
pub const SENTINEL: f32 = -12345.0;

/// What a run produced (logical layouts as in `Expected`; unwritten = SENTINEL).
pub struct Got {
    pub out: Vec<f32>,
    pub state: Vec<f32>,
    pub snaps: Vec<f32>,
    pub status: Vec<kvr_status>,
}

/// The descriptors of one case in `mem` (inputs uploaded, outputs filled with SENTINEL).
#[derive(Clone)]
pub struct Bound {
    pub q: kvr_tensor,
    pub k: kvr_tensor,
    pub v: kvr_tensor,
    pub g: kvr_tensor,
    pub beta: kvr_tensor,
    pub state_in: kvr_tensor,
    pub state_out: Option<kvr_tensor>,
    pub snaps: Option<kvr_tensor>,
    pub out: kvr_tensor,
}

pub fn bind(c: &Case, x: &Data, mem: &mut dyn Mem) -> Bound {
    let dev = mem.device();
    let es = match c.dtype {
        KVR_DTYPE_F32 => 4,
        _ => 2,
    };
    let (b, t, hq, hv, dk, dv) = (
        c.b as i64,
        c.t as i64,
        c.hq as i64,
        c.hv as i64,
        c.dk as i64,
        c.dv as i64,
    );
    // q, k: logical [B, T, Hq, dk]; stored [B, Hq, T, dk] when permuted.
    let qk = |data: &[f32], mem: &mut dyn Mem| -> kvr_tensor {
        if c.permuted {
            let mut p = vec![0f32; data.len()];
            for bi in 0..c.b {
                for ti in 0..c.t {
                    for h in 0..c.hq {
                        let src = ((bi * c.t + ti) * c.hq + h) * c.dk;
                        let dst = ((bi * c.hq + h) * c.t + ti) * c.dk;
                        p[dst..dst + c.dk].copy_from_slice(&data[src..src + c.dk]);
                    }
                }
            }
            let ptr = mem.upload(&encode(c.dtype, &p));
            tensor(
                ptr,
                c.dtype,
                dev,
                &[b, t, hq, dk],
                &[hq * t * dk, dk, t * dk, 1],
            )
        } else {
            let ptr = mem.upload(&encode(c.dtype, data));
            tensor(
                ptr,
                c.dtype,
                dev,
                &[b, t, hq, dk],
                &[t * hq * dk, hq * dk, dk, 1],
            )
        }
    };
    let q = qk(&x.q, mem);
    let k = qk(&x.k, mem);
    let v = tensor(
        mem.upload(&encode(c.dtype, &x.v)),
        c.dtype,
        dev,
        &[b, t, hv, dv],
        &[t * hv * dv, hv * dv, dv, 1],
    );
    let gb = |data: &[f32], mem: &mut dyn Mem| {
        tensor(
            mem.upload(&encode(c.dtype, data)),
            c.dtype,
            dev,
            &[b, t, hv],
            &[t * hv, hv, 1],
        )
    };
    let g = gb(&x.g, mem);
    let beta = gb(&x.beta, mem);
    let row = c.row() as i64;
    let sshape = [b, hv, dv, dk];
    let sstr = [hv * dv * row, dv * row, row, 1];
    let mut s0 = vec![SENTINEL; c.state_elems()];
    for i in 0..c.b * c.hv * c.dv {
        s0[i * c.row()..i * c.row() + c.dk].copy_from_slice(&x.s0[i * c.dk..(i + 1) * c.dk]);
    }
    let state_in = tensor(
        mem.upload(&encode(KVR_DTYPE_F32, &s0)),
        KVR_DTYPE_F32,
        dev,
        &sshape,
        &sstr,
    );
    let state_out = if !c.state_out {
        None
    } else if c.in_place {
        Some(state_in)
    } else {
        let s = vec![SENTINEL; c.state_elems()];
        Some(tensor(
            mem.upload(&encode(KVR_DTYPE_F32, &s)),
            KVR_DTYPE_F32,
            dev,
            &sshape,
            &sstr,
        ))
    };
    let snaps = (c.snaps > 0).then(|| {
        let s = vec![SENTINEL; c.snaps * c.state_elems()];
        let slot = c.state_elems() as i64;
        tensor(
            mem.upload(&encode(KVR_DTYPE_F32, &s)),
            KVR_DTYPE_F32,
            dev,
            &[c.snaps as i64, b, hv, dv, dk],
            &[slot, sstr[0], sstr[1], sstr[2], 1],
        )
    });
    let out = tensor(
        mem.upload(&encode(c.dtype, &vec![SENTINEL; c.b * c.t * c.hv * c.dv])),
        c.dtype,
        dev,
        &[b, t, hv, dv],
        &[t * hv * dv, hv * dv, dv, 1],
    );
    let _ = es;
    Bound {
        q,
        k,
        v,
        g,
        beta,
        state_in,
        state_out,
        snaps,
        out,
    }
}

pub fn params(c: &Case) -> kvr_gdn_recurrent_params {
    let mut p = std::mem::MaybeUninit::uninit();
    assert_eq!(
        kvr_gdn_recurrent_params_default(p.as_mut_ptr()),
        KVR_STATUS_OK
    );
    // SAFETY: initialized by the default function.
    let mut p: kvr_gdn_recurrent_params = unsafe { p.assume_init() };
    p.scale = c.scale;
    p.l2norm_qk = c.l2norm as i32;
    p.head_map = if c.tiled {
        KVR_GDN_HEADS_TILED
    } else {
        KVR_GDN_HEADS_GROUPED
    };
    p.pdl = c.pdl as i32;
    p
}

/// Calls `kvr_context_gdn_recurrent` on bound tensors with `p`.
pub fn call(
    ctx: *const kvr_context,
    t: &Bound,
    p: &kvr_gdn_recurrent_params,
    stream: *mut c_void,
) -> kvr_status {
    kvr_context_gdn_recurrent(
        ctx,
        &t.q,
        &t.k,
        &t.v,
        &t.g,
        &t.beta,
        &t.state_in,
        t.state_out.as_ref().map_or(null(), |x| x as *const _),
        t.snaps.as_ref().map_or(null(), |x| x as *const _),
        &t.out,
        p,
        stream,
    )
}

/// Reads a bound case's outputs back in logical layout.
pub fn read_back(c: &Case, t: &Bound, mem: &dyn Mem) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    mem.sync();
    let es = if c.dtype == KVR_DTYPE_F32 { 4 } else { 2 };
    let out = decode(
        c.dtype,
        &mem.download(t.out.data, c.b * c.t * c.hv * c.dv * es),
    );
    let unpad = |v: Vec<f32>, n: usize| -> Vec<f32> {
        let mut r = Vec::with_capacity(n * c.dk);
        for i in 0..n {
            r.extend_from_slice(&v[i * c.row()..i * c.row() + c.dk]);
        }
        r
    };
    let rows = c.b * c.hv * c.dv;
    let state = t.state_out.as_ref().map_or(Vec::new(), |s| {
        unpad(
            decode(KVR_DTYPE_F32, &mem.download(s.data, c.state_elems() * 4)),
            rows,
        )
    });
    let snaps = t.snaps.as_ref().map_or(Vec::new(), |s| {
        unpad(
            decode(
                KVR_DTYPE_F32,
                &mem.download(s.data, c.snaps * c.state_elems() * 4),
            ),
            c.snaps * rows,
        )
    });
    (out, state, snaps)
}

/// Uploads, calls (once, or once per split) and reads back.
pub fn run(ctx: *const kvr_context, c: &Case, x: &Data, mem: &mut dyn Mem) -> Got {
    let t = bind(c, x, mem);
    let mut p = params(c);
    let mut status = Vec::new();
    if c.splits.is_empty() {
        status.push(call(ctx, &t, &p, mem.stream()));
    } else {
        for &(lo, hi) in &c.splits {
            p.item_begin = lo;
            p.item_end = hi;
            status.push(call(ctx, &t, &p, mem.stream()));
        }
    }
    let (out, state, snaps) = read_back(c, &t, mem);
    Got {
        out,
        state,
        snaps,
        status,
    }
}

/// Largest |got - want| over max |want| (both sets), with SENTINEL / NaN agreement: a
/// slot the reference leaves unwritten (NaN) must still hold SENTINEL, and no written
/// element may.
pub fn max_rel_err(got: &[f32], want: &[f64], what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1e-30f64, |m, x| m.max(x.abs()));
    let mut worst = 0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert_eq!(g, SENTINEL, "{what}[{i}]: an unwritten slot was written");
            continue;
        }
        assert!(g != SENTINEL, "{what}[{i}]: not written");
        assert!(g.is_finite(), "{what}[{i}] = {g}");
        worst = worst.max((g as f64 - w).abs() / scale);
    }
    worst
}

/// Checks a run against the reference: every output within `tol` (relative to the
/// largest expected magnitude), items outside the splits untouched.
pub fn check(c: &Case, x: &Data, got: &Got, tol: f64) {
    assert!(
        got.status.iter().all(|&s| s == KVR_STATUS_OK),
        "{c:?}: status {:?}: {}",
        got.status,
        super::last_error()
    );
    let mut want = reference(c, x);
    if !c.splits.is_empty() {
        // Items no split covers keep SENTINEL (and in place: their input state).
        let covered = |item: usize| {
            c.splits
                .iter()
                .any(|&(lo, hi)| (lo as usize..hi as usize).contains(&item))
        };
        for item in 0..c.b * c.hv {
            if covered(item) {
                continue;
            }
            let (b, h) = (item / c.hv, item % c.hv);
            for t in 0..c.t {
                let o = ((b * c.t + t) * c.hv + h) * c.dv;
                want.out[o..o + c.dv].iter_mut().for_each(|v| *v = f64::NAN);
            }
            let so = item * c.dv * c.dk;
            for j in so..so + c.dv * c.dk {
                want.state[j] = if c.in_place { x.s0[j] as f64 } else { f64::NAN };
            }
            for s in 0..c.snaps {
                let o = s * c.b * c.hv * c.dv * c.dk + so;
                want.snaps[o..o + c.dv * c.dk]
                    .iter_mut()
                    .for_each(|v| *v = f64::NAN);
            }
        }
    }
    let e_out = max_rel_err(&got.out, &want.out, "out");
    assert!(e_out <= tol, "{c:?}: out error {e_out:e} > {tol:e}");
    if c.state_out {
        let e = max_rel_err(&got.state, &want.state, "state_out");
        assert!(e <= tol, "{c:?}: state error {e:e} > {tol:e}");
    }
    if c.snaps > 0 {
        let e = max_rel_err(&got.snaps, &want.snaps, "snapshots");
        assert!(e <= tol, "{c:?}: snapshot error {e:e} > {tol:e}");
    }
}

/// Tolerance for a case: f32 inputs agree to ~1e-5 of the largest value; 16-bit outputs
/// are rounded.
pub fn tol(c: &Case) -> f64 {
    match c.dtype {
        KVR_DTYPE_F32 => 2e-5 * (c.t as f64).sqrt().max(1.0),
        KVR_DTYPE_F16 => 2e-3,
        _ => 1e-2,
    }
}
