//! Mamba-2 (Nemotron-H, Granite-4 hybrids) on the replay core, with the semantics of
//! mamba_ssm's `selective_state_update` and llama.cpp's `ggml_ssm_scan`: per head h (head
//! dim P) and group (state dim N), `dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max)`,
//! `S <- exp(A dt') S + dt' x B^T`, `y = S C + D x`, optionally `y *= silu(z)`.
//!
//! The core's shape maps as: value heads = `nheads` (dv = P), key heads = `ngroups`
//! (dk = N); a token's entry is `u = dt' x`, its key B (shared by the group's heads), its
//! log decay `A dt'`; the query is C (`plan.rs`, `Rule::Additive` with a `DtGate`). Entry
//! formation, the C·B products and the output-only verify run in the shared kernels.

use crate::backend::Context;
use crate::error::{Error, Result};
use crate::linear::replay::plan::{Checker, DtGate, Rule, StepPlan};
use crate::linear::replay::{Family, ReplayConfig, ReplayPool};
use crate::tensor::TensorView;

/// The Mamba-2 family (a marker type for `ReplayPool`).
#[derive(Clone, Copy, Debug)]
pub struct Mamba2;

/// A Mamba-2 replay pool.
pub type Mamba2Pool = ReplayPool<Mamba2>;

/// Options of one decode / verify call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mamba2Options {
    /// Apply softplus to `dt + dt_bias` (mamba_ssm's `dt_softplus`; llama.cpp always does).
    pub dt_softplus: bool,
    /// Clamp of dt after softplus (`dt_limit`; 0 and infinity: none).
    pub dt_min: f32,
    pub dt_max: f32,
}

impl Default for Mamba2Options {
    fn default() -> Self {
        Mamba2Options {
            dt_softplus: true,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
        }
    }
}

/// The tensors of a decode or verify call: x, z, out `[B, T, nheads, P]`; dt `[B, T,
/// nheads]`; B, C `[B, T, ngroups, N]`; A, D, dt_bias `[nheads]`; conv_in (required when
/// the pool keeps conv windows) `[B, T, conv_dim]`. Decode also takes them without T.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Io<'a> {
    /// i32 `[B]` sequence ids (-1: an unused row, output zeros).
    pub seq_ids: &'a TensorView,
    pub x: &'a TensorView,
    pub dt: &'a TensorView,
    pub a: &'a TensorView,
    pub b: &'a TensorView,
    pub c: &'a TensorView,
    pub d: Option<&'a TensorView>,
    pub z: Option<&'a TensorView>,
    pub dt_bias: Option<&'a TensorView>,
    pub out: &'a TensorView,
    pub conv_in: Option<&'a TensorView>,
}

impl Family for Mamba2 {
    type Io<'a> = Mamba2Io<'a>;
    type Options = Mamba2Options;

    fn seq_ids<'a>(io: &Self::Io<'a>) -> &'a TensorView {
        io.seq_ids
    }

    fn plan(
        cfg: &ReplayConfig,
        ctx: &Context,
        io: &Mamba2Io<'_>,
        opts: &Mamba2Options,
        b: usize,
        decode: bool,
    ) -> Result<(StepPlan, usize)> {
        let ck = Checker {
            cfg,
            ctx,
            b,
            decode,
        };
        let (h, p, g, n) = (cfg.v_heads, cfg.dv, cfg.k_heads, cfg.dk);
        let x = ck.four(io.x, "x", h, p)?;
        let bm = ck.four(io.b, "B", g, n)?;
        let cm = ck.four(io.c, "C", g, n)?;
        let out = ck.four(io.out, "out", h, p)?;
        let mut named = vec![("x", &x), ("B", &bm), ("C", &cm), ("out", &out)];
        let z = io.z.map(|z| ck.four(z, "z", h, p)).transpose()?;
        if let Some(z) = &z {
            named.push(("z", z));
        }
        let t = ck.same_t(&named)?;
        let dt = ck.three(io.dt, "dt", t, h)?;
        ck.out(&out)?;
        let a = ck.vector(io.a, "A", h)?;
        let skip = io.d.map(|d| ck.vector(d, "D", h)).transpose()?;
        let bias = io.dt_bias.map(|d| ck.vector(d, "dt_bias", h)).transpose()?;
        if opts.dt_min.is_nan() || opts.dt_max.is_nan() || opts.dt_min > opts.dt_max {
            return Err(Error::InvalidArgument(format!(
                "dt limits ({}, {}) are not an interval",
                opts.dt_min, opts.dt_max
            )));
        }
        let plan = StepPlan {
            rule: Rule::Additive,
            q: cm,
            k: bm,
            v: x,
            out,
            g: None,
            beta: Some(dt),
            dt: Some(DtGate {
                a,
                bias,
                softplus: opts.dt_softplus,
                min: opts.dt_min,
                max: opts.dt_max,
            }),
            skip,
            gate: z,
            conv_in: ck.conv_in(io.conv_in, t)?,
            scale: 1.0,
            l2norm: false,
        };
        Ok((plan, t))
    }
}
