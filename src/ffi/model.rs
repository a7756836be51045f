//! `kvr_model`: a GGUF model's layer plan, pool sizing and zero-copy weight views.

use std::ffi::{c_char, CStr, CString};
use std::sync::Arc;

use super::gdn::{kvr_gdn_pool_params, KVR_STATE_K_MAJOR};
use super::guard::{guard, guard_value, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::kv_pool::kvr_kv_pool_params;
use super::status::kvr_status;
use super::tensor::{
    dtype_from_c, kvr_dtype, kvr_tensor, KVR_DEVICE_HOST, KVR_DTYPE_BF16, KVR_DTYPE_F16,
    KVR_DTYPE_F32, KVR_MAX_DIMS,
};
use crate::error::{Error, Result};
use crate::gguf::{self, LayerPlan, Model};
use crate::tensor::DType;

/// An opened GGUF model (opaque): its plan, and views into its mapped weights. Created by
/// `kvr_model_open`, freed by `kvr_model_free`.
pub struct kvr_model {
    _private: [u8; 0],
}

struct ModelEntry {
    model: Model,
    arch: CString,
}

static MODELS: Registry<ModelEntry> = Registry::new("kvr_model");

fn model_from(p: *const kvr_model) -> Result<Arc<ModelEntry>> {
    MODELS.get(p as usize)
}

/// Layer kinds of `kvr_layer_plan`.
pub type kvr_layer_kind = i32;
/// Softmax attention (a KV cache).
pub const KVR_LAYER_ATTENTION: kvr_layer_kind = 0;
/// Gated DeltaNet (a linear-attention state).
pub const KVR_LAYER_GDN: kvr_layer_kind = 1;
/// Mamba-2 (an SSM state).
pub const KVR_LAYER_MAMBA2: kvr_layer_kind = 2;
/// A block without a sequence mixer (no cache).
pub const KVR_LAYER_MLP: kvr_layer_kind = 3;

/// Opens a GGUF file (memory-mapped, not read into memory), validates it and plans its
/// layers. Architectures: llama, qwen2, qwen3, qwen3next, qwen35, mamba2, nemotron_h,
/// granitehybrid.
///
/// Errors: NULL_ARG; IO_ERROR (cannot open or map); MALFORMED_FILE (truncated, corrupted
/// or inconsistent: counts or lengths past the end, tensors past the end, misaligned or
/// overlapping, missing or out-of-range keys); UNSUPPORTED (another architecture,
/// big-endian, GGUF v1). Thread-safe.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_open(path: *const c_char, out: *mut *mut kvr_model) -> kvr_status {
    guard("kvr_model_open", || {
        non_null(path, "path")?;
        non_null(out, "out")?;
        // SAFETY: non-NULL, NUL-terminated by contract.
        let path = unsafe { CStr::from_ptr(path) };
        let path = path
            .to_str()
            .map_err(|_| Error::InvalidArgument("path is not valid UTF-8".into()))?;
        let model = Model::open(path)?;
        let arch = CString::new(model.plan.arch.clone())
            .map_err(|_| Error::MalformedFile("architecture name holds a NUL".into()))?;
        let h = MODELS.insert(ModelEntry { model, arch });
        // SAFETY: non-NULL.
        unsafe { out.write(h as *mut kvr_model) };
        Ok(())
    })
}

/// Frees a model (NULL is a no-op). Views taken from it become invalid.
#[no_mangle]
pub extern "C" fn kvr_model_free(model: *mut kvr_model) {
    if model.is_null() {
        return;
    }
    let _ = guard("kvr_model_free", || MODELS.remove(model as usize).map(drop));
}

/// The architecture name (`general.architecture`), valid until `kvr_model_free`; NULL for
/// an invalid handle.
#[no_mangle]
pub extern "C" fn kvr_model_arch(model: *const kvr_model) -> *const c_char {
    guard_value("kvr_model_arch", std::ptr::null(), || {
        match model_from(model) {
            // The entry (and its CString) lives in the registry until kvr_model_free.
            Ok(m) => m.arch.as_ptr(),
            Err(e) => {
                super::guard::set_last_error(&format!("kvr_model_arch: {e}"));
                std::ptr::null()
            }
        }
    })
}

/// Counts from a model's plan.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_model_info {
    /// `sizeof(kvr_model_info)` as the caller compiled it.
    pub struct_size: u32,
    /// Layers (`{arch}.block_count`).
    pub n_layers: i32,
    pub n_attention_layers: i32,
    pub n_gdn_layers: i32,
    pub n_mamba2_layers: i32,
    pub n_mlp_layers: i32,
    /// `{arch}.context_length` (0 if absent).
    pub context_length: i64,
    /// `{arch}.embedding_length`.
    pub embedding_length: i64,
    /// Tensors in the file.
    pub n_tensors: i64,
    /// File size in bytes.
    pub file_bytes: i64,
}

/// Writes the plan's counts. `out->struct_size` must be set.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_info_get(
    model: *const kvr_model,
    out: *mut kvr_model_info,
) -> kvr_status {
    guard("kvr_model_info_get", || {
        let m = model_from(model)?;
        non_null(out, "out")?;
        let (a, g, mb, f) = m.model.plan.counts();
        let info = kvr_model_info {
            struct_size: size_of::<kvr_model_info>() as u32,
            n_layers: m.model.plan.layers.len() as i32,
            n_attention_layers: a as i32,
            n_gdn_layers: g as i32,
            n_mamba2_layers: mb as i32,
            n_mlp_layers: f as i32,
            context_length: m.model.plan.context_length as i64,
            embedding_length: m.model.plan.embedding_length as i64,
            n_tensors: m.model.file.tensors().len() as i64,
            file_bytes: m.model.file.len() as i64,
        };
        // SAFETY: non-NULL; `struct_size` writable bytes.
        unsafe { write_versioned(out, info, size_of::<kvr_model_info>(), "kvr_model_info") }
    })
}

/// One layer's plan; fields that do not apply to the kind are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvr_layer_plan {
    /// `KVR_LAYER_*`.
    pub kind: kvr_layer_kind,
    /// Attention: query heads, KV heads, K and V head dims, sliding window (0: none).
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim_k: i32,
    pub head_dim_v: i32,
    pub sliding_window: i32,
    /// GDN: key heads, value heads, key and value head dims.
    pub k_heads: i32,
    pub v_heads: i32,
    pub dk: i32,
    pub dv: i32,
    /// Mamba-2: heads, head dim, groups, state size.
    pub ssm_heads: i32,
    pub ssm_head_dim: i32,
    pub ssm_groups: i32,
    pub ssm_state: i32,
    /// GDN and Mamba-2: causal-conv kernel width and channels.
    pub conv_kernel: i32,
    pub conv_dim: i32,
}

/// Writes the plan of layer `layer` (0-based). Errors: OUT_OF_RANGE, NULL_ARG.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_layer(
    model: *const kvr_model,
    layer: i32,
    out: *mut kvr_layer_plan,
) -> kvr_status {
    guard("kvr_model_layer", || {
        let m = model_from(model)?;
        non_null(out, "out")?;
        let n = m.model.plan.layers.len();
        let l = usize::try_from(layer)
            .ok()
            .filter(|&l| l < n)
            .ok_or_else(|| {
                Error::OutOfRange(format!("layer {layer} out of range (the model has {n})"))
            })?;
        let mut p = kvr_layer_plan::default();
        match m.model.plan.layers[l] {
            LayerPlan::Attention(a) => {
                p.kind = KVR_LAYER_ATTENTION;
                p.heads = a.heads as i32;
                p.kv_heads = a.kv_heads as i32;
                p.head_dim_k = a.head_dim_k as i32;
                p.head_dim_v = a.head_dim_v as i32;
                p.sliding_window = a.sliding_window as i32;
            }
            LayerPlan::Gdn(g) => {
                p.kind = KVR_LAYER_GDN;
                p.k_heads = g.k_heads as i32;
                p.v_heads = g.v_heads as i32;
                p.dk = g.dk as i32;
                p.dv = g.dv as i32;
                p.conv_kernel = g.conv_kernel as i32;
                p.conv_dim = g.conv_dim as i32;
            }
            LayerPlan::Mamba2(s) => {
                p.kind = KVR_LAYER_MAMBA2;
                p.ssm_heads = s.heads as i32;
                p.ssm_head_dim = s.head_dim as i32;
                p.ssm_groups = s.groups as i32;
                p.ssm_state = s.state as i32;
                p.conv_kernel = s.conv_kernel as i32;
                p.conv_dim = s.conv_dim as i32;
            }
            LayerPlan::Mlp => p.kind = KVR_LAYER_MLP,
        }
        // SAFETY: non-NULL.
        unsafe { out.write(p) };
        Ok(())
    })
}

/// A tensor of the file, any ggml type.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_model_tensor_info {
    /// ggml type id (`enum ggml_type`: 0 f32, 1 f16, 30 bf16, 8 q8_0, ...).
    pub ggml_type: i32,
    /// Dimensions.
    pub ndim: i32,
    /// Extents, outermost first (row-major, as in a `kvr_tensor`).
    pub shape: [i64; 4],
    /// Bytes of data.
    pub bytes: i64,
    /// Offset of the data in the file.
    pub file_offset: i64,
}

fn name_arg<'a>(name: *const c_char) -> Result<&'a str> {
    non_null(name, "name")?;
    // SAFETY: non-NULL, NUL-terminated by contract.
    unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| Error::InvalidArgument("name is not valid UTF-8".into()))
}

/// Describes tensor `name`. Errors: UNKNOWN_ID (no such tensor), NULL_ARG.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_tensor_info_get(
    model: *const kvr_model,
    name: *const c_char,
    out: *mut kvr_model_tensor_info,
) -> kvr_status {
    guard("kvr_model_tensor_info_get", || {
        let m = model_from(model)?;
        let name = name_arg(name)?;
        non_null(out, "out")?;
        let t = m.model.file.tensor(name)?;
        let mut shape = [0i64; 4];
        for (i, d) in t.shape().iter().enumerate() {
            shape[i] = *d as i64;
        }
        // SAFETY: non-NULL.
        unsafe {
            out.write(kvr_model_tensor_info {
                ggml_type: t.ggml_type as i32,
                ndim: t.dims.len() as i32,
                shape,
                bytes: t.size as i64,
                file_offset: t.offset as i64,
            })
        };
        Ok(())
    })
}

/// A zero-copy view of tensor `name` (host memory: the mapped file, read-only), valid
/// until `kvr_model_free`: f32, f16 or bf16, shape outermost first, contiguous. To use it
/// on the GPU, copy it to device memory yourself (e.g. `cudaMemcpy`: `kvr_tensor_copy`
/// copies within one context's memory only). With
/// `expect_ndim > 0`, the shape must equal `expect_shape[0..expect_ndim]`.
///
/// Errors: UNKNOWN_ID (no such tensor); UNSUPPORTED (a quantized or integer ggml type:
/// reported, never misread); INVALID_ARG (shape mismatch); NULL_ARG.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_tensor(
    model: *const kvr_model,
    name: *const c_char,
    expect_ndim: i32,
    expect_shape: *const i64,
    out: *mut kvr_tensor,
) -> kvr_status {
    guard("kvr_model_tensor", || {
        let m = model_from(model)?;
        let name = name_arg(name)?;
        non_null(out, "out")?;
        let v = if expect_ndim > 0 {
            non_null(expect_shape, "expect_shape")?;
            if expect_ndim as usize > KVR_MAX_DIMS {
                return Err(Error::InvalidArgument(format!(
                    "expect_ndim {expect_ndim} exceeds {KVR_MAX_DIMS}"
                )));
            }
            let mut shape = Vec::with_capacity(expect_ndim as usize);
            for i in 0..expect_ndim as usize {
                // SAFETY: the caller passes expect_ndim readable entries.
                let d = unsafe { expect_shape.add(i).read() };
                shape.push(usize::try_from(d).map_err(|_| {
                    Error::InvalidArgument(format!("expect_shape[{i}] = {d} is negative"))
                })?);
            }
            m.model.file.view_shaped(name, &shape)?
        } else if expect_ndim < 0 {
            return Err(Error::InvalidArgument(format!(
                "expect_ndim {expect_ndim} is negative"
            )));
        } else {
            m.model.file.view(name)?
        };
        let mut t = kvr_tensor {
            data: v.addr() as *mut std::ffi::c_void,
            dtype: match v.dtype() {
                DType::F32 => KVR_DTYPE_F32,
                DType::F16 => KVR_DTYPE_F16,
                _ => KVR_DTYPE_BF16,
            },
            device: KVR_DEVICE_HOST,
            ndim: v.ndim() as i32,
            shape: [0; KVR_MAX_DIMS],
            strides: [0; KVR_MAX_DIMS],
        };
        for d in 0..v.ndim() {
            t.shape[d] = v.shape()[d] as i64;
            t.strides[d] = v.strides()[d] as i64;
        }
        // SAFETY: non-NULL.
        unsafe { out.write(t) };
        Ok(())
    })
}

/// What an engine plans for; fill with `kvr_sizing_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_sizing_params {
    /// `sizeof(kvr_sizing_params)` as the caller compiled it.
    pub struct_size: u32,
    /// KV page size in tokens (default 16).
    pub page_size: i32,
    /// Bytes for caches and states, all layers and sequences (required).
    pub budget_bytes: i64,
    /// Tokens per sequence (prompt + output); 0 (default) = the model's context length.
    pub seq_len: i64,
    /// GDN ring length (default 16).
    pub ring_len: i32,
    /// Draft tokens per speculative round, 0..8 (default 0).
    pub spec_window: i32,
    /// KV element type (default f16).
    pub kv_dtype: kvr_dtype,
    /// Recurrent state element type (default f32).
    pub state_dtype: kvr_dtype,
    /// Ring entry element type (default f32).
    pub entry_dtype: kvr_dtype,
    /// Conv window element type (default f32).
    pub conv_dtype: kvr_dtype,
}

const SIZING_PARAMS_V1: usize = size_of::<kvr_sizing_params>();

fn default_sizing_params() -> kvr_sizing_params {
    kvr_sizing_params {
        struct_size: size_of::<kvr_sizing_params>() as u32,
        page_size: 16,
        budget_bytes: 0,
        seq_len: 0,
        ring_len: 16,
        spec_window: 0,
        kv_dtype: KVR_DTYPE_F16,
        state_dtype: KVR_DTYPE_F32,
        entry_dtype: KVR_DTYPE_F32,
        conv_dtype: KVR_DTYPE_F32,
    }
}

/// Fills `*params` with the defaults (page 16, ring 16, no speculation, f16 KV, f32 state,
/// ring and conv window); the caller sets `budget_bytes` (and usually `seq_len`).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_sizing_params_default(params: *mut kvr_sizing_params) -> kvr_status {
    guard("kvr_sizing_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL.
        unsafe { params.write(default_sizing_params()) };
        Ok(())
    })
}

/// Per-sequence costs and how many sequences fit, for four layouts: index 0 paged KV +
/// GDN ring (kvreplay), 1 paged KV + per-draft snapshots, 2 contiguous KV (the model's
/// context reserved per sequence) + ring, 3 contiguous KV + snapshots.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_sizing {
    /// `sizeof(kvr_sizing)` as the library wrote it.
    pub struct_size: u32,
    pub n_attention_layers: i32,
    pub n_gdn_layers: i32,
    pub n_mamba2_layers: i32,
    /// Tokens per sequence used (seq_len, or the context length).
    pub seq_len: i64,
    /// KV bytes per token, all attention layers.
    pub kv_bytes_per_token: i64,
    /// Pages per sequence (seq_len + spec_window tokens).
    pub pages_per_seq: i64,
    pub paged_kv_bytes_per_seq: i64,
    pub contiguous_kv_bytes_per_seq: i64,
    /// GDN and Mamba-2 states.
    pub state_bytes_per_seq: i64,
    /// GDN rings and conv window rings.
    pub ring_bytes_per_seq: i64,
    /// Per-draft states and conv windows (GDN and Mamba-2).
    pub snapshot_bytes_per_seq: i64,
    /// Mamba-2 conv windows and per-draft states (every layout: no Mamba-2 ring yet).
    pub mamba2_extra_bytes_per_seq: i64,
    /// Bytes per sequence for the four layouts.
    pub bytes_per_seq: [i64; 4],
    /// Sequences that fit in the budget for the four layouts.
    pub max_seqs: [i64; 4],
}

fn sizing_params(p: &kvr_sizing_params) -> Result<gguf::SizingParams> {
    let nonneg = |name: &str, v: i64| -> Result<usize> {
        usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{name} = {v} is negative")))
    };
    Ok(gguf::SizingParams {
        budget_bytes: u64::try_from(p.budget_bytes).map_err(|_| {
            Error::InvalidArgument(format!("budget_bytes = {} is negative", p.budget_bytes))
        })?,
        seq_len: nonneg("seq_len", p.seq_len)?,
        page_size: nonneg("page_size", p.page_size as i64)?,
        ring_len: nonneg("ring_len", p.ring_len as i64)?,
        spec_window: nonneg("spec_window", p.spec_window as i64)?,
        kv_dtype: dtype_from_c(p.kv_dtype)?,
        state_dtype: dtype_from_c(p.state_dtype)?,
        entry_dtype: dtype_from_c(p.entry_dtype)?,
        conv_dtype: dtype_from_c(p.conv_dtype)?,
    })
}

fn compute(
    model: *const kvr_model,
    params: *const kvr_sizing_params,
) -> Result<(Arc<ModelEntry>, gguf::Sizing, kvr_sizing_params)> {
    let m = model_from(model)?;
    non_null(params, "params")?;
    // SAFETY: non-NULL; `struct_size` readable bytes.
    let p = unsafe {
        read_versioned(
            params,
            default_sizing_params(),
            SIZING_PARAMS_V1,
            "kvr_sizing_params",
        )?
    };
    let s = gguf::sizing(&m.model.plan, &sizing_params(&p)?)?;
    Ok((m, s, p))
}

/// Sizes pools for the model under `params`. `out->struct_size` must be set.
/// Errors: INVALID_ARG, OUT_OF_RANGE (spec_window > 8), DTYPE_MISMATCH, NULL_ARG.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_sizing(
    model: *const kvr_model,
    params: *const kvr_sizing_params,
    out: *mut kvr_sizing,
) -> kvr_status {
    guard("kvr_model_sizing", || {
        non_null(out, "out")?;
        let (_, s, _) = compute(model, params)?;
        let c = kvr_sizing {
            struct_size: size_of::<kvr_sizing>() as u32,
            n_attention_layers: s.attention_layers as i32,
            n_gdn_layers: s.gdn_layers as i32,
            n_mamba2_layers: s.mamba2_layers as i32,
            seq_len: s.seq_len as i64,
            kv_bytes_per_token: s.kv_bytes_per_token as i64,
            pages_per_seq: s.pages_per_seq as i64,
            paged_kv_bytes_per_seq: s.paged_kv_bytes_per_seq as i64,
            contiguous_kv_bytes_per_seq: s.contiguous_kv_bytes_per_seq as i64,
            state_bytes_per_seq: s.state_bytes_per_seq as i64,
            ring_bytes_per_seq: s.ring_bytes_per_seq as i64,
            snapshot_bytes_per_seq: s.snapshot_bytes_per_seq as i64,
            mamba2_extra_bytes_per_seq: s.mamba2_extra_bytes_per_seq as i64,
            bytes_per_seq: s.per_seq.map(|x| x as i64),
            max_seqs: s.max_seqs.map(|x| x as i64),
        };
        // SAFETY: non-NULL; `struct_size` writable bytes.
        unsafe { write_versioned(out, c, size_of::<kvr_sizing>(), "kvr_sizing") }
    })
}

/// Fills `*out` (after `kvr_kv_pool_params_default`) with the KV pool for the sizing's
/// paged + ring layout: attention layers, KV heads, head dim, page size, dtype, capacity
/// and sequence slots. Errors: UNSUPPORTED (no attention layers, layers of different
/// shapes, or K and V head dims that differ), OUT_OF_RANGE (nothing fits the budget).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_kv_pool_params(
    model: *const kvr_model,
    params: *const kvr_sizing_params,
    out: *mut kvr_kv_pool_params,
) -> kvr_status {
    guard("kvr_model_kv_pool_params", || {
        non_null(out, "out")?;
        let (_, s, p) = compute(model, params)?;
        if s.max_seqs[0] == 0 {
            return Err(Error::OutOfRange(format!(
                "not one sequence fits in {} bytes",
                p.budget_bytes
            )));
        }
        let c = s.kv_pool.ok_or_else(|| {
            Error::Unsupported(
                "the model has no attention layers, or its attention layers differ in shape or in K and V head dims"
                    .into(),
            )
        })?;
        let mut k = super::kv_pool::default_pool_params();
        k.n_layers = c.layers as i32;
        k.n_kv_heads = c.kv_heads as i32;
        k.head_dim = c.head_dim as i32;
        k.page_size = c.page_size as i32;
        k.dtype = p.kv_dtype;
        k.capacity_pages = c.capacity_pages as i64;
        k.max_seqs = c.max_seqs.min(i32::MAX as usize) as i32;
        k.max_seq_len = c.max_seq_len as i64;
        // SAFETY: non-NULL.
        unsafe { out.write(k) };
        Ok(())
    })
}

/// Fills `*out` with the GDN pool for the sizing's paged + ring layout (layers, heads,
/// dims, ring, drafts, dtypes, conv window, sequence slots; K-major state). Errors:
/// UNSUPPORTED (no GDN layers), OUT_OF_RANGE (nothing fits the budget).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_gdn_pool_params(
    model: *const kvr_model,
    params: *const kvr_sizing_params,
    out: *mut kvr_gdn_pool_params,
) -> kvr_status {
    guard("kvr_model_gdn_pool_params", || {
        non_null(out, "out")?;
        let (_, s, p) = compute(model, params)?;
        if s.max_seqs[0] == 0 {
            return Err(Error::OutOfRange(format!(
                "not one sequence fits in {} bytes",
                p.budget_bytes
            )));
        }
        let c = s
            .gdn_pool
            .ok_or_else(|| Error::Unsupported("the model has no Gated DeltaNet layers".into()))?;
        let mut g = super::gdn::default_pool_params();
        g.n_layers = c.layers as i32;
        g.n_k_heads = c.k_heads as i32;
        g.n_v_heads = c.v_heads as i32;
        g.dk = c.dk as i32;
        g.dv = c.dv as i32;
        g.ring_len = c.ring_len as i32;
        g.max_drafts = c.max_drafts as i32;
        g.state_dtype = p.state_dtype;
        g.entry_dtype = p.entry_dtype;
        g.layout = KVR_STATE_K_MAJOR;
        g.max_seqs = c.max_seqs.min(i32::MAX as usize) as i32;
        g.conv_dim = c.conv_dim as i32;
        g.conv_kernel = c.conv_kernel as i32;
        g.conv_dtype = p.conv_dtype;
        // SAFETY: non-NULL.
        unsafe { out.write(g) };
        Ok(())
    })
}
