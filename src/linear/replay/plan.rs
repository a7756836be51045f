//! A checked step, as every executor runs it: the family's tensors normalized to
//! `[B, T, H, D]` (per-token scalars `[B, T, H]`), and how the family forms a token's entry
//! and output from them. Each family's `plan` builds one; the kernels and the CPU step
//! implement every variant, so a family is a front end (its tensors and checks), not a
//! separate kernel set.
//!
//! Per token and value head h, with g the log decay and beta the input weight:
//! - `Rule::Delta` (Gated DeltaNet): `u = beta (v - S k)`, `S <- e^g S + u k^T`;
//! - `Rule::Additive` (linear attention, Mamba-2): `u = beta v`, `S <- e^g S + u k^T`;
//!
//! then `y = S q` (q scaled), plus `skip[h] * v` where a skip is given, times `silu(z)`
//! where a gate is given. With a `DtGate` (Mamba-2), beta and g come from the raw dt:
//! `dt' = clamp(softplus(dt + bias), min, max)`, `beta = dt'`, `g = A[h] dt'`.

use crate::backend::{BackendKind, Context};
use crate::error::{Error, Result};
use crate::linear::replay::ReplayConfig;
use crate::pool::{as_batch_3d, as_batch_4d, check_float};
use crate::tensor::{MemoryKind, TensorView};

/// How a token's entry is formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `u = beta (v - S k)` (the drafts of a verify are solved by forward substitution).
    Delta,
    /// `u = beta v`.
    Additive,
}

/// Mamba-2's discretization (`selective_state_update`): beta and g from the raw dt.
#[derive(Clone, Copy, Debug)]
pub struct DtGate {
    /// A `[Hv]` (negative: the per-head decay rate).
    pub a: TensorView,
    /// dt bias `[Hv]`.
    pub bias: Option<TensorView>,
    /// Apply softplus (threshold 20, as mamba_ssm and llama.cpp) after the bias.
    pub softplus: bool,
    /// Clamp of dt' (`min <= max`; 0 and infinity: none).
    pub min: f32,
    pub max: f32,
}

/// A checked decode/verify call.
#[derive(Clone, Debug)]
pub struct StepPlan {
    pub(crate) rule: Rule,
    pub(crate) q: TensorView,
    pub(crate) k: TensorView,
    pub(crate) v: TensorView,
    pub(crate) out: TensorView,
    /// Log decay `[B, T, Hv]` (None: 0). With a `DtGate`, unused.
    pub(crate) g: Option<TensorView>,
    /// Input weight `[B, T, Hv]` (None: 1); with a `DtGate`, the raw dt.
    pub(crate) beta: Option<TensorView>,
    pub(crate) dt: Option<DtGate>,
    /// Skip weight D `[Hv]`: `y += D[h] v`.
    pub(crate) skip: Option<TensorView>,
    /// Output gate z `[B, T, Hv, dv]`: `y *= silu(z)`.
    pub(crate) gate: Option<TensorView>,
    pub(crate) conv_in: Option<TensorView>,
    pub(crate) scale: f32,
    pub(crate) l2norm: bool,
}

/// softplus as mamba_ssm and llama.cpp compute it (identity above 20).
pub fn softplus(x: f32) -> f32 {
    if x <= 20.0 {
        x.exp().ln_1p()
    } else {
        x
    }
}

impl DtGate {
    /// (beta, g) of a raw dt for head h, given the head's A and bias.
    pub fn apply(&self, dt: f32, a: f32, bias: f32) -> (f32, f32) {
        let x = dt + bias;
        let x = if self.softplus { softplus(x) } else { x };
        let x = x.max(self.min).min(self.max);
        (x, a * x)
    }
}

/// The checks a family's `plan` shares: shapes against the pool, dtypes, memory kind.
pub struct Checker<'a> {
    pub cfg: &'a ReplayConfig,
    pub ctx: &'a Context,
    /// Batch rows.
    pub b: usize,
    /// One token per row (decode): 3-D / 2-D tensors are accepted.
    pub decode: bool,
}

impl Checker<'_> {
    /// A `[B, T, h, d]` float tensor in the context's memory (T is checked by `same_t`).
    pub fn four(&self, t: &TensorView, name: &str, h: usize, d: usize) -> Result<TensorView> {
        let v = as_batch_4d(t, name, self.decode)?;
        let s = v.shape();
        if s[0] != self.b || s[2] != h || s[3] != d {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected [{}, T, {h}, {d}]",
                t.shape(),
                self.b
            )));
        }
        check_float(&v, name)?;
        v.expect_memory(self.ctx.memory(), name)?;
        if self.ctx.backend() == BackendKind::Cuda && v.strides()[3] != 1 {
            return Err(Error::InvalidArgument(format!(
                "on CUDA, {name}'s last dimension must be contiguous"
            )));
        }
        Ok(v)
    }

    /// A `[B, t, last]` float tensor in the context's memory.
    pub fn three(&self, x: &TensorView, name: &str, t: usize, last: usize) -> Result<TensorView> {
        let v = as_batch_3d(x, name, self.decode)?;
        if v.shape() != [self.b, t, last] {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected [{}, {t}, {last}]",
                x.shape(),
                self.b
            )));
        }
        check_float(&v, name)?;
        v.expect_memory(self.ctx.memory(), name)?;
        Ok(v)
    }

    /// A `[n]` float tensor (per-head parameters) in the context's memory.
    pub fn vector(&self, x: &TensorView, name: &str, n: usize) -> Result<TensorView> {
        if x.shape() != [n] {
            return Err(Error::InvalidArgument(format!(
                "{name} has shape {:?}; expected [{n}]",
                x.shape()
            )));
        }
        check_float(x, name)?;
        x.expect_memory(self.ctx.memory(), name)?;
        Ok(*x)
    }

    /// Every tensor in `xs` has the T of the first.
    pub fn same_t(&self, xs: &[(&str, &TensorView)]) -> Result<usize> {
        let t = xs[0].1.shape()[1];
        for (name, x) in &xs[1..] {
            if x.shape()[1] != t {
                return Err(Error::InvalidArgument(format!(
                    "{name} has T = {} but {} has {t}",
                    x.shape()[1],
                    xs[0].0
                )));
            }
        }
        Ok(t)
    }

    /// The conv input against the pool's conv window (required exactly when it keeps one).
    pub fn conv_in(&self, x: Option<&TensorView>, t: usize) -> Result<Option<TensorView>> {
        match (x, self.cfg.conv_dim) {
            (None, 0) => Ok(None),
            (Some(_), 0) => Err(Error::InvalidArgument(
                "conv_in given but the pool keeps no conv window (conv_dim = 0)".into(),
            )),
            (None, _) => Err(Error::NullArgument(
                "conv_in is required: the pool keeps conv windows (conv_dim > 0)".into(),
            )),
            (Some(x), d) => Ok(Some(self.three(x, "conv_in", t, d)?)),
        }
    }

    /// The output: no element written twice.
    pub fn out(&self, out: &TensorView) -> Result<()> {
        if out.is_non_overlapping() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "out has overlapping elements".into(),
            ))
        }
    }

    /// `scale` or 1/sqrt(dk), finite.
    pub fn scale(&self, scale: Option<f32>) -> Result<f32> {
        let s = scale.unwrap_or(1.0 / (self.cfg.dk as f32).sqrt());
        if s.is_finite() {
            Ok(s)
        } else {
            Err(Error::InvalidArgument(format!("scale {s} is not finite")))
        }
    }

    /// The memory kind of the context (host for CPU pools).
    pub fn memory(&self) -> MemoryKind {
        self.ctx.memory()
    }
}
