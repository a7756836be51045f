//! Plain and decayed linear attention (KVBuffer; RetNet / Lightning Attention style decays)
//! on the replay core: `S <- gamma S + v k^T`, `y = S q` (scaled), with no decay, a
//! constant decay per head, or a per-token decay per head, given as log decays (log gamma).
//! The entry of a token is its v (`plan.rs`, `Rule::Additive`); chunkwise decode is the
//! ring with a flush every `ring_len` tokens, parallel verify and KV-only mode come from the
//! core.

use crate::backend::Context;
use crate::error::{Error, Result};
use crate::linear::replay::plan::{Checker, Rule, StepPlan};
use crate::linear::replay::{Family, ReplayConfig, ReplayPool};
use crate::tensor::TensorView;

/// The linear-attention family (a marker type for `ReplayPool`).
#[derive(Clone, Copy, Debug)]
pub struct LinAttn;

/// A linear-attention replay pool.
pub type LinAttnPool = ReplayPool<LinAttn>;

/// Options of one decode / verify call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinAttnOptions {
    /// Scale applied to q; None = 1/sqrt(dk).
    pub scale: Option<f32>,
}

/// The tensors of a decode or verify call: q, k `[B, T, Hk, dk]`; v, out `[B, T, Hv, dv]`;
/// the log decay (None: no decay) `[Hv]` (a constant per head) or `[B, T, Hv]` (per token);
/// conv_in `[B, T, conv_dim]` when the pool keeps conv windows. Decode also takes them
/// without T.
#[derive(Clone, Copy, Debug)]
pub struct LinAttnIo<'a> {
    /// i32 `[B]` sequence ids (-1: an unused row, output zeros).
    pub seq_ids: &'a TensorView,
    pub q: &'a TensorView,
    pub k: &'a TensorView,
    pub v: &'a TensorView,
    pub log_decay: Option<&'a TensorView>,
    pub out: &'a TensorView,
    pub conv_in: Option<&'a TensorView>,
}

impl Family for LinAttn {
    type Io<'a> = LinAttnIo<'a>;
    type Options = LinAttnOptions;

    fn seq_ids<'a>(io: &Self::Io<'a>) -> &'a TensorView {
        io.seq_ids
    }

    fn plan(
        cfg: &ReplayConfig,
        ctx: &Context,
        io: &LinAttnIo<'_>,
        opts: &LinAttnOptions,
        b: usize,
        decode: bool,
    ) -> Result<(StepPlan, usize)> {
        let ck = Checker {
            cfg,
            ctx,
            b,
            decode,
        };
        let q = ck.four(io.q, "q", cfg.k_heads, cfg.dk)?;
        let k = ck.four(io.k, "k", cfg.k_heads, cfg.dk)?;
        let v = ck.four(io.v, "v", cfg.v_heads, cfg.dv)?;
        let out = ck.four(io.out, "out", cfg.v_heads, cfg.dv)?;
        let t = ck.same_t(&[("q", &q), ("k", &k), ("v", &v), ("out", &out)])?;
        ck.out(&out)?;
        let g = match io.log_decay {
            None => None,
            Some(d) if d.ndim() == 1 => {
                let d = ck.vector(d, "log_decay", cfg.v_heads)?;
                // A constant per head: the same value for every row and token.
                Some(TensorView::new(
                    d.addr(),
                    d.dtype(),
                    d.memory(),
                    &[b, t, cfg.v_heads],
                    &[0, 0, d.strides()[0]],
                )?)
            }
            Some(d) if d.ndim() >= 2 => Some(ck.three(d, "log_decay", t, cfg.v_heads)?),
            Some(d) => {
                return Err(Error::InvalidArgument(format!(
                    "log_decay must be [Hv] or [B, T, Hv], not {:?}",
                    d.shape()
                )))
            }
        };
        let plan = StepPlan {
            rule: Rule::Additive,
            q,
            k,
            v,
            out,
            g,
            beta: None,
            dt: None,
            skip: None,
            gate: None,
            conv_in: ck.conv_in(io.conv_in, t)?,
            scale: ck.scale(opts.scale)?,
            l2norm: false,
        };
        Ok((plan, t))
    }
}
