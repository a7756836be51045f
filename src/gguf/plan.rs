//! Per-layer plans from GGUF metadata, following llama.cpp's loaders.
//!
//! Key names are llama.cpp's (gguf-py `gguf/constants.py`, class `Keys`, package `gguf`
//! 0.19.0 on PyPI), with `{arch}` the value of `general.architecture`:
//!
//! | key                                   | gguf-py constant                    |
//! |---------------------------------------|-------------------------------------|
//! | `{arch}.block_count`                  | `Keys.LLM.BLOCK_COUNT`              |
//! | `{arch}.context_length`               | `Keys.LLM.CONTEXT_LENGTH`           |
//! | `{arch}.embedding_length`             | `Keys.LLM.EMBEDDING_LENGTH`         |
//! | `{arch}.feed_forward_length`          | `Keys.LLM.FEED_FORWARD_LENGTH`      |
//! | `{arch}.full_attention_interval`      | `Keys.LLM.FULL_ATTENTION_INTERVAL`  |
//! | `{arch}.nextn_predict_layers`         | `Keys.LLM.NEXTN_PREDICT_LAYERS`     |
//! | `{arch}.attention.head_count`         | `Keys.Attention.HEAD_COUNT`         |
//! | `{arch}.attention.head_count_kv`      | `Keys.Attention.HEAD_COUNT_KV`      |
//! | `{arch}.attention.key_length`         | `Keys.Attention.KEY_LENGTH`         |
//! | `{arch}.attention.value_length`       | `Keys.Attention.VALUE_LENGTH`       |
//! | `{arch}.ssm.conv_kernel`              | `Keys.SSM.CONV_KERNEL`              |
//! | `{arch}.ssm.inner_size`               | `Keys.SSM.INNER_SIZE`               |
//! | `{arch}.ssm.state_size`               | `Keys.SSM.STATE_SIZE`               |
//! | `{arch}.ssm.time_step_rank`           | `Keys.SSM.TIME_STEP_RANK`           |
//! | `{arch}.ssm.group_count`              | `Keys.SSM.GROUP_COUNT`              |
//! | `{arch}.attention.recurrent_layers`   | `Keys.Attention.RECURRENT_LAYERS` * |
//!
//! \* Not in gguf 0.19.0; in the gguf-py that llama.cpp 0c1e570 vendors (`add_recurrent_layers`
//! writes a bool array), and written by llama.cpp's own model saver (`test-llama-archs -o`).
//!
//! Layer kinds (llama.cpp `llama-model.cpp`, `load_hparams`):
//! - llama, qwen2, qwen3: every layer is softmax attention. None of these loaders applies
//!   a sliding window.
//! - qwen3next, qwen35: layer i is a Gated DeltaNet layer when flag i of
//!   `attention.recurrent_layers` is set (one flag per layer, or one for all; bool or
//!   integer, non-zero = set), or, without that key, when `(i + 1) % full_attention_interval
//!   != 0` (default 4) and it is not one of the trailing `nextn_predict_layers` (MTP)
//!   blocks; the others are attention. GDN shapes:
//!   key heads = `ssm.group_count`, value heads = `ssm.time_step_rank`, dk =
//!   `ssm.state_size`, dv = `ssm.inner_size / ssm.time_step_rank`; the causal conv runs over
//!   q, k and v: `2 * Hk * dk + Hv * dv` channels.
//! - mamba2: every layer is Mamba-2: heads = `ssm.time_step_rank`, head dim =
//!   `ssm.inner_size / heads`, groups = `ssm.group_count`, state = `ssm.state_size`; conv
//!   channels `inner + 2 * groups * state`.
//! - nemotron_h: Mamba-2 where the per-layer `head_count_kv` and `feed_forward_length` are
//!   both 0, attention where `head_count_kv > 0`, an MLP-only block otherwise.
//! - granitehybrid: Mamba-2 where `head_count_kv` is 0, attention otherwise.
//!
//! Attention head dims default to `embedding_length / head_count` (llama.cpp's
//! `n_embd_head_k`); `head_count_kv` defaults to `head_count`; scalar or per-layer arrays
//! are both accepted, as llama.cpp's `get_key_or_arr`.

use serde_json::Value;

use super::file::GgufFile;
use crate::error::{Error, Result};

/// Architectures kvreplay plans for.
pub const ARCHITECTURES: [&str; 8] = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3next",
    "qwen35",
    "mamba2",
    "nemotron_h",
    "granitehybrid",
];

/// A softmax-attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionPlan {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Tokens a query sees (0: the whole context).
    pub sliding_window: usize,
}

/// A Gated DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnPlan {
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub conv_kernel: usize,
    pub conv_dim: usize,
}

/// A Mamba-2 layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mamba2Plan {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    pub conv_kernel: usize,
    pub conv_dim: usize,
}

/// What one layer needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerPlan {
    Attention(AttentionPlan),
    Gdn(GdnPlan),
    Mamba2(Mamba2Plan),
    /// A block without a sequence mixer (nemotron_h's MLP-only layers): no cache.
    Mlp,
}

/// A model's plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPlan {
    pub arch: String,
    pub context_length: usize,
    pub embedding_length: usize,
    pub layers: Vec<LayerPlan>,
}

impl ModelPlan {
    /// Layers of each kind: (attention, GDN, Mamba-2, MLP-only).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let mut c = (0, 0, 0, 0);
        for l in &self.layers {
            match l {
                LayerPlan::Attention(_) => c.0 += 1,
                LayerPlan::Gdn(_) => c.1 += 1,
                LayerPlan::Mamba2(_) => c.2 += 1,
                LayerPlan::Mlp => c.3 += 1,
            }
        }
        c
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error::MalformedFile(msg.into())
}

/// Reads the model's metadata with bounds on every value.
struct Keys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn number(&self, key: &str, v: &Value, max: u64) -> Result<usize> {
        let n = v
            .as_u64()
            .or_else(|| v.as_i64().filter(|&x| x >= 0).map(|x| x as u64))
            .ok_or_else(|| bad(format!("{key} = {v} is not a non-negative integer")))?;
        if n > max {
            return Err(bad(format!("{key} = {n} is out of range (at most {max})")));
        }
        Ok(n as usize)
    }

    /// An unsigned integer key of this architecture.
    fn u(&self, k: &str, max: u64) -> Result<Option<usize>> {
        let key = self.key(k);
        match self.file.get(&key) {
            None => Ok(None),
            Some(Value::Array(_)) => Err(bad(format!(
                "{key} is an array; a single value is expected"
            ))),
            Some(v) => self.number(&key, v, max).map(Some),
        }
    }

    fn required(&self, k: &str, max: u64) -> Result<usize> {
        self.u(k, max)?
            .ok_or_else(|| bad(format!("required key {} is missing", self.key(k))))
    }

    /// A scalar or a per-layer array (llama.cpp's get_key_or_arr).
    fn per_layer(&self, k: &str, n: usize, max: u64) -> Result<Option<Vec<usize>>> {
        let key = self.key(k);
        match self.file.get(&key) {
            None => Ok(None),
            Some(Value::Array(a)) => {
                if a.len() != n {
                    return Err(bad(format!("{key} has {} entries for {n} layers", a.len())));
                }
                a.iter()
                    .map(|v| self.number(&key, v, max))
                    .collect::<Result<Vec<_>>>()
                    .map(Some)
            }
            Some(v) => Ok(Some(vec![self.number(&key, v, max)?; n])),
        }
    }

    /// Per-layer flags, a scalar or one per layer (llama.cpp's get_key_or_arr into a u32
    /// array: bool or integer elements, non-zero = set).
    fn flags(&self, k: &str, n: usize) -> Result<Option<Vec<bool>>> {
        let key = self.key(k);
        let flag = |v: &Value| match v {
            Value::Bool(b) => Ok(*b),
            v => self.number(&key, v, u64::from(u32::MAX)).map(|x| x != 0),
        };
        match self.file.get(&key) {
            None => Ok(None),
            Some(Value::Array(a)) => {
                if a.len() != n {
                    return Err(bad(format!("{key} has {} entries for {n} layers", a.len())));
                }
                a.iter().map(flag).collect::<Result<Vec<_>>>().map(Some)
            }
            Some(v) => Ok(Some(vec![flag(v)?; n])),
        }
    }
}

const MAX_LAYERS: u64 = 4096;
const MAX_HEADS: u64 = 1 << 16;
const MAX_DIM: u64 = 1 << 20;

fn ssm_dims(keys: &Keys<'_>) -> Result<(usize, usize, usize, usize, usize)> {
    let kernel = keys.required("ssm.conv_kernel", 64)?;
    let inner = keys.required("ssm.inner_size", MAX_DIM)?;
    let state = keys.required("ssm.state_size", MAX_DIM)?;
    let rank = keys.required("ssm.time_step_rank", MAX_HEADS)?;
    let groups = keys.required("ssm.group_count", MAX_HEADS)?;
    for (name, v) in [
        ("ssm.conv_kernel", kernel),
        ("ssm.inner_size", inner),
        ("ssm.state_size", state),
        ("ssm.time_step_rank", rank),
        ("ssm.group_count", groups),
    ] {
        if v == 0 {
            return Err(bad(format!("{} is 0", keys.key(name))));
        }
    }
    if inner % rank != 0 {
        return Err(bad(format!(
            "ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {rank}"
        )));
    }
    if rank % groups != 0 {
        return Err(bad(format!(
            "ssm.time_step_rank {rank} is not a multiple of ssm.group_count {groups}"
        )));
    }
    Ok((kernel, inner, state, rank, groups))
}

/// The plan of a validated file.
pub fn plan(file: &GgufFile) -> Result<ModelPlan> {
    let arch = match file.get("general.architecture") {
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(bad(format!("general.architecture = {v} is not a string"))),
        None => return Err(bad("general.architecture is missing")),
    };
    if !ARCHITECTURES.contains(&arch) {
        return Err(Error::Unsupported(format!(
            "architecture '{arch}' is not supported; kvreplay plans {}",
            ARCHITECTURES.join(", ")
        )));
    }
    let keys = Keys { file, arch };
    let n = keys.required("block_count", MAX_LAYERS)?;
    if n == 0 {
        return Err(bad(format!("{} is 0", keys.key("block_count"))));
    }
    let context_length = keys.u("context_length", 1 << 30)?.unwrap_or(0);
    let embedding_length = keys.required("embedding_length", MAX_DIM)?;

    let attention = |i: usize, heads: &[usize], kv: &[usize]| -> Result<LayerPlan> {
        let h = heads[i];
        if h == 0 {
            return Err(bad(format!(
                "layer {i}: {} is 0 for an attention layer",
                keys.key("attention.head_count")
            )));
        }
        if kv[i] == 0 || h % kv[i] != 0 {
            return Err(bad(format!(
                "layer {i}: head_count {h} is not a multiple of head_count_kv {}",
                kv[i]
            )));
        }
        let default = embedding_length / h;
        let hk = keys.u("attention.key_length", MAX_DIM)?.unwrap_or(default);
        let hv = keys
            .u("attention.value_length", MAX_DIM)?
            .unwrap_or(default);
        if hk == 0 || hv == 0 {
            return Err(bad(format!("layer {i}: attention head dim is 0")));
        }
        Ok(LayerPlan::Attention(AttentionPlan {
            heads: h,
            kv_heads: kv[i],
            head_dim_k: hk,
            head_dim_v: hv,
            sliding_window: 0,
        }))
    };
    let heads_kv = |required: bool| -> Result<(Vec<usize>, Vec<usize>)> {
        let heads = match keys.per_layer("attention.head_count", n, MAX_HEADS)? {
            Some(h) => h,
            None if required => {
                return Err(bad(format!(
                    "required key {} is missing",
                    keys.key("attention.head_count")
                )))
            }
            None => vec![0; n],
        };
        let kv = keys
            .per_layer("attention.head_count_kv", n, MAX_HEADS)?
            .unwrap_or_else(|| heads.clone());
        Ok((heads, kv))
    };

    let layers = match arch {
        "llama" | "qwen2" | "qwen3" => {
            let (heads, kv) = heads_kv(true)?;
            (0..n)
                .map(|i| attention(i, &heads, &kv))
                .collect::<Result<Vec<_>>>()?
        }
        "qwen3next" | "qwen35" => {
            let (kernel, inner, dk, hv, hk) = ssm_dims(&keys)?;
            let gdn = GdnPlan {
                k_heads: hk,
                v_heads: hv,
                dk,
                dv: inner / hv,
                conv_kernel: kernel,
                conv_dim: 2 * hk * dk + inner,
            };
            let nextn = keys.u("nextn_predict_layers", MAX_LAYERS)?.unwrap_or(0);
            if nextn >= n {
                return Err(bad(format!(
                    "nextn_predict_layers {nextn} leaves no trunk in {n} layers"
                )));
            }
            // llama.cpp (qwen3next.cpp, qwen35.cpp `load_arch_hparams`): the file's flags
            // when it has them, else every full_attention_interval-th trunk layer is
            // attention.
            let recurrent = match keys.flags("attention.recurrent_layers", n)? {
                Some(f) => f,
                None => {
                    let interval = keys.u("full_attention_interval", MAX_LAYERS)?.unwrap_or(4);
                    if interval == 0 {
                        return Err(bad(format!("{} is 0", keys.key("full_attention_interval"))));
                    }
                    (0..n)
                        .map(|i| i < n - nextn && (i + 1) % interval != 0)
                        .collect()
                }
            };
            let (heads, kv) = heads_kv(true)?;
            (0..n)
                .map(|i| {
                    if recurrent[i] {
                        Ok(LayerPlan::Gdn(gdn))
                    } else {
                        attention(i, &heads, &kv)
                    }
                })
                .collect::<Result<Vec<_>>>()?
        }
        _ => {
            // mamba2, nemotron_h, granitehybrid
            let (kernel, inner, state, heads_m, groups) = ssm_dims(&keys)?;
            let m = LayerPlan::Mamba2(Mamba2Plan {
                heads: heads_m,
                head_dim: inner / heads_m,
                groups,
                state,
                conv_kernel: kernel,
                conv_dim: inner + 2 * groups * state,
            });
            if arch == "mamba2" {
                vec![m; n]
            } else {
                let (heads, kv) = heads_kv(false)?;
                let ff = keys
                    .per_layer("feed_forward_length", n, 1 << 24)?
                    .unwrap_or(vec![0; n]);
                (0..n)
                    .map(|i| match (kv[i], ff[i], arch) {
                        (0, 0, _) | (0, _, "granitehybrid") => Ok(m),
                        (0, _, _) => Ok(LayerPlan::Mlp),
                        _ => attention(i, &heads, &kv),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        }
    };
    Ok(ModelPlan {
        arch: arch.to_string(),
        context_length,
        embedding_length,
        layers,
    })
}
