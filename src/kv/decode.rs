//! Decode arguments: options, validation, and the normalized plan both backends run.

use super::config::KvPoolConfig;
use super::state::PoolState;
use crate::backend::cuda::module::DECODE_HEAD_DIMS;
use crate::backend::BackendKind;
use crate::error::{Error, Result};
use crate::pool::{as_batch_4d, check_float, check_layer, BatchIds};
use crate::tensor::{DType, TensorView};

/// Most query tokens per sequence in one decode (speculative verification window).
pub const MAX_QUERY_TOKENS: usize = 8;
/// Largest GQA group (query heads per KV head).
pub const MAX_GQA_GROUP: usize = 16;

/// Attention options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeOptions {
    /// Softmax scale; `None` = 1/sqrt(head_dim).
    pub scale: Option<f32>,
    /// Logit softcap `c`: scores become `c * tanh(s / c)` (after scaling); 0 = off.
    pub softcap: f32,
    /// Sliding window: a query at position p sees keys p - window + 1 ..= p; 0 = off.
    pub window: usize,
    /// CUDA: most CTAs per launch (0 = one full wave).
    pub max_ctas: usize,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            scale: None,
            softcap: 0.0,
            window: 0,
            max_ctas: 0,
        }
    }
}

/// The tensors of one decode call.
#[derive(Clone, Copy, Debug)]
pub struct DecodeIo<'a> {
    /// i32 `[B]` sequence ids, -1 for an unused row (host memory, or device memory on CUDA).
    pub seq_ids: &'a TensorView,
    /// Queries `[B, Hq, D]`, or `[B, T, Hq, D]` for T = 1..8 query tokens per sequence (the
    /// last T tokens of each sequence, causal among themselves).
    pub q: &'a TensorView,
    /// Output, the shape of `q`.
    pub out: &'a TensorView,
    /// Optional log-sum-exp of the scaled scores, f32 `[B, Hq]` / `[B, T, Hq]`, natural log.
    pub lse: Option<&'a TensorView>,
}

/// A checked decode: every tensor normalized to `[B, T, Hq, D]` (q, out) and `[B, T, Hq]`
/// (lse).
#[derive(Clone, Debug)]
pub(crate) struct DecodePlan {
    pub b: usize,
    pub t: usize,
    pub hq: usize,
    pub g: usize,
    /// Sequence ids (host: checked; device: read by the kernel).
    pub ids: BatchIds,
    pub q: TensorView,
    pub out: TensorView,
    pub lse: Option<TensorView>,
    pub scale: f32,
    pub softcap: f32,
    pub window: usize,
    pub max_ctas: usize,
}

/// Validates a decode call against the pool and normalizes its tensors.
pub(crate) fn check(
    cfg: &KvPoolConfig,
    backend: BackendKind,
    st: &PoolState,
    layer: usize,
    io: &DecodeIo<'_>,
    opts: &DecodeOptions,
) -> Result<DecodePlan> {
    let DecodeIo {
        seq_ids,
        q,
        out,
        lse,
    } = *io;
    let memory = backend.memory();
    check_layer(layer, cfg.layers)?;
    let ids = BatchIds::check(seq_ids, &st.seqs, backend)?;
    let b = seq_ids.shape()[0];
    if !(3..=4).contains(&q.ndim()) {
        return Err(Error::InvalidArgument(format!(
            "q must have 3 ([B, Hq, D]) or 4 ([B, T, Hq, D]) dimensions, not {}",
            q.ndim()
        )));
    }
    let q4 = as_batch_4d(q, "q", true)?;
    let o4 = as_batch_4d(out, "out", true)?;
    let [qb, t, hq, d] = [q4.shape()[0], q4.shape()[1], q4.shape()[2], q4.shape()[3]];
    if qb != b {
        return Err(Error::InvalidArgument(format!(
            "q has {qb} rows but seq_ids has {b}"
        )));
    }
    if out.shape() != q.shape() {
        return Err(Error::InvalidArgument(format!(
            "out has shape {:?}; q has {:?}",
            out.shape(),
            q.shape()
        )));
    }
    if t == 0 || t > MAX_QUERY_TOKENS {
        return Err(Error::OutOfRange(format!(
            "{t} query tokens per sequence; 1..={MAX_QUERY_TOKENS} are supported"
        )));
    }
    if d != cfg.head_dim {
        return Err(Error::InvalidArgument(format!(
            "q head dim {d} differs from the pool's {}",
            cfg.head_dim
        )));
    }
    if hq == 0 || hq % cfg.kv_heads != 0 {
        return Err(Error::InvalidArgument(format!(
            "{hq} query heads is not a multiple of the pool's {} KV heads",
            cfg.kv_heads
        )));
    }
    let g = hq / cfg.kv_heads;
    if g > MAX_GQA_GROUP {
        return Err(Error::OutOfRange(format!(
            "GQA group of {g} query heads per KV head; at most {MAX_GQA_GROUP}"
        )));
    }
    for (name, tv) in [("q", &q4), ("out", &o4)] {
        check_float(tv, name)?;
        tv.expect_memory(memory, name)?;
        if backend == BackendKind::Cuda && tv.strides()[3] != 1 {
            return Err(Error::InvalidArgument(format!(
                "on CUDA, {name}'s last dimension must be contiguous (stride 1)"
            )));
        }
    }
    if !o4.is_non_overlapping() {
        return Err(Error::InvalidArgument(
            "out has overlapping elements".into(),
        ));
    }
    let lse = match lse {
        None => None,
        Some(l) => {
            if l.dtype() != DType::F32 {
                return Err(Error::DTypeMismatch(format!(
                    "lse must be f32, not {}",
                    l.dtype()
                )));
            }
            l.expect_memory(memory, "lse")?;
            let l3 = match l.ndim() {
                3 if q.ndim() == 4 => *l,
                2 if q.ndim() == 3 => TensorView::new(
                    l.addr(),
                    l.dtype(),
                    l.memory(),
                    &[l.shape()[0], 1, l.shape()[1]],
                    &[l.strides()[0], 0, l.strides()[1]],
                )?,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "lse must be [B, Hq] (or [B, T, Hq] for 4-D q), not {:?}",
                        l.shape()
                    )))
                }
            };
            if l3.shape() != [b, t, hq] {
                return Err(Error::InvalidArgument(format!(
                    "lse has shape {:?}; expected [{b}, {t}, {hq}] (or [{b}, {hq}])",
                    l.shape()
                )));
            }
            if !l3.is_non_overlapping() {
                return Err(Error::InvalidArgument(
                    "lse has overlapping elements".into(),
                ));
            }
            Some(l3)
        }
    };
    if backend == BackendKind::Cuda {
        if !matches!(cfg.dtype, DType::F16 | DType::BF16) {
            return Err(Error::Unsupported(format!(
                "CUDA decode reads f16 or bf16 KV; this pool holds {} (f32 KV decodes on the CPU)",
                cfg.dtype
            )));
        }
        if !DECODE_HEAD_DIMS.contains(&cfg.head_dim) {
            return Err(Error::Unsupported(format!(
                "CUDA decode supports head dims {DECODE_HEAD_DIMS:?}, not {}",
                cfg.head_dim
            )));
        }
    }
    let scale = opts.scale.unwrap_or(1.0 / (cfg.head_dim as f32).sqrt());
    if !scale.is_finite() || scale <= 0.0 {
        return Err(Error::InvalidArgument(format!(
            "scale {scale} must be finite and > 0"
        )));
    }
    if !opts.softcap.is_finite() || opts.softcap < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "softcap {} must be finite and >= 0",
            opts.softcap
        )));
    }
    if opts.window > i32::MAX as usize {
        return Err(Error::OutOfRange(format!(
            "window {} is too large",
            opts.window
        )));
    }
    if let Some(ids) = ids.host() {
        check_batch_lengths(st, ids, t)?;
    }
    Ok(DecodePlan {
        b,
        t,
        hq,
        g,
        ids,
        q: q4,
        out: o4,
        lse,
        scale,
        softcap: opts.softcap,
        window: opts.window,
        max_ctas: opts.max_ctas,
    })
}

/// Every live sequence must hold its `t` query tokens.
fn check_batch_lengths(st: &PoolState, ids: &[i32], t: usize) -> Result<()> {
    for &id in ids {
        if id >= 0 {
            let len = st.seqs.get(id).map_or(0, |s| s.len);
            if len < t {
                return Err(Error::OutOfRange(format!(
                    "sequence {id} has {len} tokens but {t} query tokens were given; append the \
                     queries' K/V before decoding"
                )));
            }
        }
    }
    Ok(())
}
