//! The write gate of WG-KV: a per-(layer, KV head) MLP that scores how useful a token's
//! key will be later.
//!
//! For token t, layer l, KV head h, with `k_pre` the key before RoPE and `k_post` after:
//!
//! ```text
//! x   = [ RMSNorm(k_pre; w_pre) ; RMSNorm(k_post; w_post) ]     (2 * head_dim)
//! a   = GELU(W1[h] x + b1[h])                                     (hidden, exact erf GELU)
//! g   = max(sigmoid(W2[h] . a + b2[h]), 1e-3)
//! ```
//!
//! `RMSNorm(x; w) = x / sqrt(mean(x^2) + eps) * w` (eps 1e-6), its weight shared by a
//! layer's heads. This is `GatingPredictor` of the WG-KV reference code (grouped 1x1 Conv1d
//! with groups = KV heads).
//!
//! # GGUF tensors (per attention layer `i` of the file, f32, f16 or bf16)
//!
//! Row-major shapes (GGUF lists the same extents innermost first):
//!
//! | name | shape |
//! |---|---|
//! | `blk.{i}.wg_gate.norm_pre.weight`  | `[head_dim]` |
//! | `blk.{i}.wg_gate.norm_post.weight` | `[head_dim]` |
//! | `blk.{i}.wg_gate.fc1.weight` | `[kv_heads, hidden, 2 * head_dim]` (columns 0..head_dim act on the pre-RoPE key) |
//! | `blk.{i}.wg_gate.fc1.bias`   | `[kv_heads, hidden]` |
//! | `blk.{i}.wg_gate.fc2.weight` | `[kv_heads, hidden]` |
//! | `blk.{i}.wg_gate.fc2.bias`   | `[kv_heads]` |
//!
//! `hidden` comes from `fc1.bias` (512 for Llama-3.1-8B, 192 for Qwen3-4B).
//! `scripts/wgkv_convert.py` writes these from a WG-KV checkpoint.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::tensor::TensorView;

/// Floor of a gate score (the reference's `g_epsilon`).
pub const GATE_FLOOR: f32 = 1e-3;
/// RMSNorm epsilon of the gate's input norms.
pub const GATE_NORM_EPS: f32 = 1e-6;

/// One layer's gate weights, f32, row-major as in the table of the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct GateLayer {
    pub norm_pre: Vec<f32>,
    pub norm_post: Vec<f32>,
    /// `[kv_heads][hidden][2 * head_dim]`
    pub fc1_weight: Vec<f32>,
    /// `[kv_heads][hidden]`
    pub fc1_bias: Vec<f32>,
    /// `[kv_heads][hidden]`
    pub fc2_weight: Vec<f32>,
    /// `[kv_heads]`
    pub fc2_bias: Vec<f32>,
}

/// The gate of every layer of a pool.
#[derive(Clone, Debug, PartialEq)]
pub struct GateWeights {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub layers: Vec<GateLayer>,
}

/// The GGUF tensor names of layer `i`'s gate, in the order of [`GateLayer`]'s fields.
pub fn gate_tensor_names(i: usize) -> [String; 6] {
    [
        format!("blk.{i}.wg_gate.norm_pre.weight"),
        format!("blk.{i}.wg_gate.norm_post.weight"),
        format!("blk.{i}.wg_gate.fc1.weight"),
        format!("blk.{i}.wg_gate.fc1.bias"),
        format!("blk.{i}.wg_gate.fc2.weight"),
        format!("blk.{i}.wg_gate.fc2.bias"),
    ]
}

/// Reads a float view into f32 (any float dtype, any strides).
fn view_to_f32(t: &TensorView) -> Vec<f32> {
    let mut out = Vec::with_capacity(t.numel());
    let shape = t.shape().to_vec();
    let strides = t.strides().to_vec();
    let n = t.numel();
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let off: isize = idx
            .iter()
            .zip(&strides)
            .map(|(&i, &s)| i as isize * s)
            .sum();
        // SAFETY: callers pass checked views over readable memory.
        out.push(unsafe { read_f32(t, off) });
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// Element `off` (in elements) of a float view, as f32.
///
/// # Safety
/// `off` must address an element of the view.
unsafe fn read_f32(t: &TensorView, off: isize) -> f32 {
    use crate::tensor::DType;
    match t.dtype() {
        DType::F32 => (t.addr() as *const f32).offset(off).read(),
        DType::F16 => (t.addr() as *const half::f16).offset(off).read().to_f32(),
        DType::BF16 => (t.addr() as *const half::bf16).offset(off).read().to_f32(),
        DType::I32 => (t.addr() as *const i32).offset(off).read() as f32,
    }
}

impl GateWeights {
    /// Checks and copies per-layer weights given as views (host memory, f32/f16/bf16, any
    /// strides) shaped as in the module docs. `hidden` comes from `fc1_bias`.
    pub fn from_views(
        kv_heads: usize,
        head_dim: usize,
        layers: &[[TensorView; 6]],
    ) -> Result<Self> {
        if layers.is_empty() {
            return Err(Error::InvalidArgument("no gate layers given".into()));
        }
        let hidden = match layers[0][3].shape() {
            [h, n] if *h == kv_heads && *n > 0 => *n,
            s => {
                return Err(Error::InvalidArgument(format!(
                    "gate fc1.bias of layer 0 has shape {s:?}; expected [{kv_heads}, hidden]"
                )))
            }
        };
        let names = [
            "norm_pre.weight",
            "norm_post.weight",
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias",
        ];
        let shapes: [Vec<usize>; 6] = [
            vec![head_dim],
            vec![head_dim],
            vec![kv_heads, hidden, 2 * head_dim],
            vec![kv_heads, hidden],
            vec![kv_heads, hidden],
            vec![kv_heads],
        ];
        let mut out = Vec::with_capacity(layers.len());
        for (l, views) in layers.iter().enumerate() {
            let mut parts: Vec<Vec<f32>> = Vec::with_capacity(6);
            for (i, v) in views.iter().enumerate() {
                if !v.dtype().is_float() {
                    return Err(Error::DTypeMismatch(format!(
                        "gate layer {l} {}: dtype {} (f32, f16 or bf16 expected)",
                        names[i],
                        v.dtype()
                    )));
                }
                if v.shape() != shapes[i].as_slice() {
                    return Err(Error::InvalidArgument(format!(
                        "gate layer {l} {}: shape {:?}; expected {:?}",
                        names[i],
                        v.shape(),
                        shapes[i]
                    )));
                }
                v.expect_memory(crate::tensor::MemoryKind::Host, names[i])?;
                let data = view_to_f32(v);
                if data.iter().any(|x| !x.is_finite()) {
                    return Err(Error::InvalidArgument(format!(
                        "gate layer {l} {}: holds a non-finite value",
                        names[i]
                    )));
                }
                parts.push(data);
            }
            let mut it = parts.into_iter();
            let mut next = || it.next().expect("six parts");
            out.push(GateLayer {
                norm_pre: next(),
                norm_post: next(),
                fc1_weight: next(),
                fc1_bias: next(),
                fc2_weight: next(),
                fc2_bias: next(),
            });
        }
        Ok(GateWeights {
            kv_heads,
            head_dim,
            hidden,
            layers: out,
        })
    }

    /// Reads the gate of the file's blocks `blocks` (one per pool layer, in order; the
    /// attention layers' block indices `blk.{i}`) from a GGUF file. A missing tensor is
    /// `UnknownId`, a wrong shape `InvalidArgument`, a non-float type `DTypeMismatch`.
    pub fn from_gguf(
        file: &GgufFile,
        blocks: &[usize],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(blocks.len());
        for &b in blocks {
            let names = gate_tensor_names(b);
            let mut views = Vec::with_capacity(6);
            for n in &names {
                let view = file.view(n).map_err(|e| match e {
                    Error::Unsupported(m) => Error::DTypeMismatch(m),
                    e => e,
                })?;
                views.push(view);
            }
            let views: [TensorView; 6] = views.try_into().expect("six views");
            layers.push(views);
        }
        Self::from_views(kv_heads, head_dim, &layers)
    }

    /// Scores of `n` tokens of layer `l`: `k_pre`, `k_post` shaped `[n, kv_heads,
    /// head_dim]` (host, float, any strides); returns `[n][kv_heads]`.
    pub fn scores(&self, l: usize, k_pre: &TensorView, k_post: &TensorView) -> Result<Vec<f32>> {
        let (h, d) = (self.kv_heads, self.head_dim);
        let layer = self.layers.get(l).ok_or_else(|| {
            Error::OutOfRange(format!(
                "gate layer {l}; the gate has {}",
                self.layers.len()
            ))
        })?;
        let n = k_pre.shape().first().copied().unwrap_or(0);
        for (name, t) in [("k_pre", k_pre), ("k_post", k_post)] {
            if t.shape() != [n, h, d] {
                return Err(Error::InvalidArgument(format!(
                    "{name} has shape {:?}; expected [{n}, {h}, {d}]",
                    t.shape()
                )));
            }
            if !t.dtype().is_float() {
                return Err(Error::DTypeMismatch(format!(
                    "{name} must be f32, f16 or bf16, not {}",
                    t.dtype()
                )));
            }
            t.expect_memory(crate::tensor::MemoryKind::Host, name)?;
        }
        let pre = view_to_f32(k_pre);
        let post = view_to_f32(k_post);
        let mut out = vec![0f32; n * h];
        let mut x = vec![0f32; 2 * d];
        for t in 0..n {
            for hh in 0..h {
                let row = (t * h + hh) * d;
                rms_norm(&pre[row..row + d], &layer.norm_pre, &mut x[..d]);
                rms_norm(&post[row..row + d], &layer.norm_post, &mut x[d..]);
                out[t * h + hh] = self.head_score(layer, hh, &x);
            }
        }
        Ok(out)
    }

    fn head_score(&self, layer: &GateLayer, h: usize, x: &[f32]) -> f32 {
        let (hid, in_dim) = (self.hidden, 2 * self.head_dim);
        let w1 = &layer.fc1_weight[h * hid * in_dim..(h + 1) * hid * in_dim];
        let b1 = &layer.fc1_bias[h * hid..(h + 1) * hid];
        let w2 = &layer.fc2_weight[h * hid..(h + 1) * hid];
        let mut z = layer.fc2_bias[h] as f64;
        for j in 0..hid {
            let row = &w1[j * in_dim..(j + 1) * in_dim];
            let mut a = b1[j];
            for (w, xi) in row.iter().zip(x) {
                a += w * xi;
            }
            z += (gelu(a) * w2[j]) as f64;
        }
        let g = 1.0 / (1.0 + (-z).exp());
        (g as f32).max(GATE_FLOOR)
    }
}

fn rms_norm(x: &[f32], w: &[f32], out: &mut [f32]) {
    let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + GATE_NORM_EPS as f64).sqrt();
    for ((o, &v), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = (v as f64 * r) as f32 * wi;
    }
}

/// Exact (erf) GELU.
fn gelu(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32
}

/// erf(x) to about 1.2e-7 relative error (Numerical Recipes' Chebyshev fit of erfc).
fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        1.0 - erfc
    } else {
        erfc - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::erf;

    #[test]
    fn erf_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (-2.0, -0.995_322_265_018_952_7),
            (3.5, 0.999_999_256_901_627_7),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {}", erf(x));
        }
    }
}
