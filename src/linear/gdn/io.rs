//! The GDN family's call: its tensors, options and the checked plan its executors run.

use crate::backend::Context;
use crate::error::Result;
use crate::linear::replay::plan::{Checker, Rule, StepPlan};
use crate::linear::replay::ReplayConfig;
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

/// Checks a decode/verify call of `b` rows and normalizes its tensors.
pub(crate) fn plan(
    c: &ReplayConfig,
    ctx: &Context,
    io: &GdnIo<'_>,
    opts: &GdnOptions,
    b: usize,
    decode: bool,
) -> Result<(StepPlan, usize)> {
    let ck = Checker {
        cfg: c,
        ctx,
        b,
        decode,
    };
    let q = ck.four(io.q, "q", c.k_heads, c.dk)?;
    let k = ck.four(io.k, "k", c.k_heads, c.dk)?;
    let v = ck.four(io.v, "v", c.v_heads, c.dv)?;
    let out = ck.four(io.out, "out", c.v_heads, c.dv)?;
    let t = ck.same_t(&[("q", &q), ("k", &k), ("v", &v), ("out", &out)])?;
    let g = ck.three(io.g, "g", t, c.v_heads)?;
    let beta = ck.three(io.beta, "beta", t, c.v_heads)?;
    ck.out(&out)?;
    let plan = StepPlan {
        rule: Rule::Delta,
        q,
        k,
        v,
        out,
        g: Some(g),
        beta: Some(beta),
        dt: None,
        skip: None,
        gate: None,
        conv_in: ck.conv_in(io.conv_in, t)?,
        scale: ck.scale(opts.scale)?,
        l2norm: opts.l2norm_qk,
    };
    Ok((plan, t))
}
