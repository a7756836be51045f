//! The GDN family's call: its tensors, options and the checked plan its executors run.

use crate::backend::{BackendKind, Context};
use crate::error::{Error, Result};
use crate::linear::replay::ReplayConfig;
use crate::pool::{as_batch_3d, as_batch_4d, check_float};
use crate::tensor::TensorView;

/// The GDN family (a marker type for `ReplayPool`).
#[derive(Clone, Copy, Debug)]
pub struct Gdn;

/// Options of one decode / verify call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GdnOptions {
    /// Scale applied to q (after the optional L2 norm); None = 1/sqrt(dk).
    pub scale: Option<f32>,
    /// L2-normalize q and k inside the kernel (fla's `use_qk_l2norm_in_kernel`).
    pub l2norm_qk: bool,
}

/// The tensors of a decode or verify call. q, k: `[B, T, Hk, dk]` (or `[B, Hk, dk]` for
/// decode); v and out: `[B, T, Hv, dv]`; g (log decay) and beta (post-sigmoid): `[B, T, Hv]`;
/// conv_in (required when the pool keeps conv windows): `[B, T, conv_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnIo<'a> {
    /// i32 `[B]` sequence ids (-1: an unused row, output zeros).
    pub seq_ids: &'a TensorView,
    pub q: &'a TensorView,
    pub k: &'a TensorView,
    pub v: &'a TensorView,
    pub g: &'a TensorView,
    pub beta: &'a TensorView,
    pub out: &'a TensorView,
    pub conv_in: Option<&'a TensorView>,
}

/// A checked decode/verify call: every tensor normalized to `[B, T, H, D]` (g, beta,
/// conv_in: `[B, T, X]`).
#[derive(Clone, Debug)]
pub struct GdnPlan {
    pub(crate) q: TensorView,
    pub(crate) k: TensorView,
    pub(crate) v: TensorView,
    pub(crate) g: TensorView,
    pub(crate) beta: TensorView,
    pub(crate) out: TensorView,
    pub(crate) conv_in: Option<TensorView>,
    pub(crate) scale: f32,
    pub(crate) l2norm: bool,
}

/// Checks a decode/verify call of `b` rows and normalizes its tensors.
pub(crate) fn plan(
    c: &ReplayConfig,
    ctx: &Context,
    io: &GdnIo<'_>,
    opts: &GdnOptions,
    b: usize,
    decode: bool,
) -> Result<(GdnPlan, usize)> {
    let memory = ctx.memory();
    let four = |t: &TensorView, name: &str, h: usize, d: usize| -> Result<TensorView> {
        let v = as_batch_4d(t, name, decode)?;
        let s = v.shape();
        if s[0] != b || s[2] != h || s[3] != d {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected [{b}, T, {h}, {d}]",
                t.shape()
            )));
        }
        check_float(&v, name)?;
        v.expect_memory(memory, name)?;
        Ok(v)
    };
    let q = four(io.q, "q", c.k_heads, c.dk)?;
    let t = q.shape()[1];
    let k = four(io.k, "k", c.k_heads, c.dk)?;
    let v = four(io.v, "v", c.v_heads, c.dv)?;
    let out = four(io.out, "out", c.v_heads, c.dv)?;
    let three = |x: &TensorView, name: &str, last: usize| -> Result<TensorView> {
        let v = as_batch_3d(x, name, decode)?;
        if v.shape() != [b, t, last] {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected [{b}, {t}, {last}]",
                x.shape()
            )));
        }
        check_float(&v, name)?;
        v.expect_memory(memory, name)?;
        Ok(v)
    };
    let g = three(io.g, "g", c.v_heads)?;
    let beta = three(io.beta, "beta", c.v_heads)?;
    for (name, x) in [("k", &k), ("v", &v), ("out", &out)] {
        if x.shape()[1] != t {
            return Err(Error::InvalidArgument(format!(
                "{name} has T = {} but q has {t}",
                x.shape()[1]
            )));
        }
    }
    if !out.is_non_overlapping() {
        return Err(Error::InvalidArgument(
            "out has overlapping elements".into(),
        ));
    }
    let conv_in = match (io.conv_in, c.conv_dim) {
        (None, 0) => None,
        (Some(_), 0) => {
            return Err(Error::InvalidArgument(
                "conv_in given but the pool keeps no conv window (conv_dim = 0)".into(),
            ))
        }
        (None, _) => {
            return Err(Error::NullArgument(
                "conv_in is required: the pool keeps conv windows (conv_dim > 0)".into(),
            ))
        }
        (Some(x), d) => Some(three(x, "conv_in", d)?),
    };
    if ctx.backend() == BackendKind::Cuda {
        for (name, x) in [("q", &q), ("k", &k), ("v", &v), ("out", &out)] {
            if x.strides()[3] != 1 {
                return Err(Error::InvalidArgument(format!(
                    "on CUDA, {name}'s last dimension must be contiguous"
                )));
            }
        }
    }
    let scale = opts.scale.unwrap_or(1.0 / (c.dk as f32).sqrt());
    if !scale.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "scale {scale} is not finite"
        )));
    }
    let plan = GdnPlan {
        q,
        k,
        v,
        g,
        beta,
        out,
        conv_in,
        scale,
        l2norm: opts.l2norm_qk,
    };
    Ok((plan, t))
}
