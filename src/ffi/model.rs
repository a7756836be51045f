//! `kvr_model`: a GGUF model's layer plan, pool sizing and zero-copy weight views.

use std::ffi::{c_char, CStr, CString};
use std::sync::Arc;

use super::gdn::{kvr_gdn_pool_params, KVR_STATE_K_MAJOR, KVR_STATE_V_MAJOR};
use super::guard::{guard, guard_value, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::kv_pool::kvr_kv_pool_params;
use super::mamba2::kvr_mamba2_pool_params;
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
pub const KVR_LAYER_ATTENTION: kvr_layer_kind = 0 as kvr_layer_kind;
/// Gated DeltaNet (a linear-attention state).
pub const KVR_LAYER_GDN: kvr_layer_kind = 1 as kvr_layer_kind;
/// Mamba-2 (an SSM state).
pub const KVR_LAYER_MAMBA2: kvr_layer_kind = 2 as kvr_layer_kind;
/// A block without a sequence mixer (no cache).
pub const KVR_LAYER_MLP: kvr_layer_kind = 3 as kvr_layer_kind;

/// Opens a GGUF file (memory-mapped, not read into memory), validates it and plans its
/// layers. Architectures: llama, qwen2, qwen3, qwen3next, qwen35, mamba2, nemotron_h,
/// granitehybrid.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (`path` is not
/// UTF-8); `KVR_STATUS_IO_ERROR` (cannot open or map); `KVR_STATUS_MALFORMED_FILE`
/// (truncated, corrupted or inconsistent: counts or lengths past the end, tensors past the
/// end, misaligned or overlapping, missing or out-of-range keys); `KVR_STATUS_UNSUPPORTED`
/// (another architecture, big-endian, GGUF v1).
/// Ownership: the caller owns the new model and frees it with `kvr_model_free`; `path` is
/// read during the call only.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written and nothing stays mapped.
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

/// Frees a model and unmaps its file. NULL is a no-op. Views from `kvr_model_get_tensor`
/// and the string from `kvr_model_get_arch` become invalid; pools sized from the model are
/// independent of it.
///
/// Returns: nothing.
/// Ownership: ends the caller's ownership of `model`.
/// Thread safety: thread-safe; a call already running on another thread keeps the model
/// alive until it returns, and calls that start later get `KVR_STATUS_INVALID_ARG`.
/// On failure: a handle that is not a live model (freed already, or of another kind) is
/// ignored and recorded in `kvr_error_last_message`; nothing changes.
#[no_mangle]
pub extern "C" fn kvr_model_free(model: *mut kvr_model) {
    if model.is_null() {
        return;
    }
    let _ = guard("kvr_model_free", || MODELS.remove(model as usize).map(drop));
}

/// The architecture name (`general.architecture`).
///
/// Returns: a NUL-terminated string; NULL for a NULL or dead handle.
/// Ownership: the model's; valid until `kvr_model_free`. Do not free it.
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: NULL, with the reason in `kvr_error_last_message`.
#[no_mangle]
pub extern "C" fn kvr_model_get_arch(model: *const kvr_model) -> *const c_char {
    guard_value("kvr_model_get_arch", std::ptr::null(), || {
        match model_from(model) {
            // The entry (and its CString) lives in the registry until kvr_model_free.
            Ok(m) => m.arch.as_ptr(),
            Err(e) => {
                super::guard::set_last_error(&format!("kvr_model_get_arch: {e}"));
                std::ptr::null()
            }
        }
    })
}

/// Counts from a model's plan, filled by `kvr_model_get_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_model_info {
    /// `sizeof(kvr_model_info)` as the caller compiled it.
    pub struct_size: u32,
    /// Layers (`{arch}.block_count`).
    pub n_layers: i32,
    /// Softmax-attention layers (`KVR_LAYER_ATTENTION`).
    pub n_attention_layers: i32,
    /// Gated DeltaNet layers (`KVR_LAYER_GDN`).
    pub n_gdn_layers: i32,
    /// Mamba-2 layers (`KVR_LAYER_MAMBA2`).
    pub n_mamba2_layers: i32,
    /// Blocks without a sequence mixer (`KVR_LAYER_MLP`).
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

/// Writes the plan's counts into `*out`. Set `out->struct_size` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `struct_size` too small).
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_info(
    model: *const kvr_model,
    out: *mut kvr_model_info,
) -> kvr_status {
    guard("kvr_model_get_info", || {
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

/// One layer's plan, filled by `kvr_model_get_layer`; fields that do not apply to the kind
/// are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvr_layer_plan {
    /// `KVR_LAYER_ATTENTION`, `_GDN`, `_MAMBA2` or `_MLP`.
    pub kind: kvr_layer_kind,
    /// Attention: query heads.
    pub heads: i32,
    /// Attention: KV heads.
    pub kv_heads: i32,
    /// Attention: K head dim.
    pub head_dim_k: i32,
    /// Attention: V head dim.
    pub head_dim_v: i32,
    /// Attention: sliding window in tokens (0: none).
    pub sliding_window: i32,
    /// GDN: key heads Hk.
    pub k_heads: i32,
    /// GDN: value heads Hv.
    pub v_heads: i32,
    /// GDN: key head dim.
    pub dk: i32,
    /// GDN: value head dim.
    pub dv: i32,
    /// Mamba-2: heads.
    pub ssm_heads: i32,
    /// Mamba-2: head dim.
    pub ssm_head_dim: i32,
    /// Mamba-2: groups.
    pub ssm_groups: i32,
    /// Mamba-2: state size.
    pub ssm_state: i32,
    /// GDN and Mamba-2: causal-conv kernel width.
    pub conv_kernel: i32,
    /// GDN and Mamba-2: causal-conv channels.
    pub conv_dim: i32,
}

/// Writes the plan of layer `layer` (0-based) into `*out`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_OUT_OF_RANGE` (layer).
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_layer(
    model: *const kvr_model,
    layer: i32,
    out: *mut kvr_layer_plan,
) -> kvr_status {
    guard("kvr_model_get_layer", || {
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

/// A tensor of the file, any ggml type, filled by `kvr_model_get_tensor_info`.
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

/// Describes tensor `name` (any ggml type) in `*out`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `name` not UTF-8); `KVR_STATUS_UNKNOWN_ID` (no such tensor).
/// Ownership: `name` is read during the call; `*out` is the caller's.
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_tensor_info(
    model: *const kvr_model,
    name: *const c_char,
    out: *mut kvr_model_tensor_info,
) -> kvr_status {
    guard("kvr_model_get_tensor_info", || {
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

/// A zero-copy view of tensor `name` (host memory: the mapped file, read-only): f32, f16 or
/// bf16, shape outermost first, contiguous. To use it on the GPU, copy it to device memory
/// yourself (e.g. `cudaMemcpy`: `kvr_tensor_copy` copies within one context's memory only).
/// With `expect_ndim > 0`, the shape must equal `expect_shape[0..expect_ndim]`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle, shape
/// mismatch, `expect_ndim` negative or above `KVR_MAX_DIMS`); `KVR_STATUS_UNKNOWN_ID` (no
/// such tensor); `KVR_STATUS_UNSUPPORTED` (a quantized or integer ggml type: reported,
/// never misread).
/// Ownership: the data belongs to the model and stays valid until `kvr_model_free`; never
/// write through the view.
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_tensor(
    model: *const kvr_model,
    name: *const c_char,
    expect_ndim: i32,
    expect_shape: *const i64,
    out: *mut kvr_tensor,
) -> kvr_status {
    guard("kvr_model_get_tensor", || {
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

/// What an engine plans for (`kvr_model_compute_sizing`, `kvr_model_get_kv_pool_params`,
/// `kvr_model_get_gdn_pool_params`, `kvr_model_get_mamba2_pool_params`); fill with
/// `kvr_model_sizing_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_model_sizing_params {
    /// `sizeof(kvr_model_sizing_params)` as the caller compiled it.
    pub struct_size: u32,
    /// KV page size in tokens (default 16).
    pub page_size: i32,
    /// Bytes for caches and states, all layers and sequences (required).
    pub budget_bytes: i64,
    /// Tokens per sequence (prompt + output); 0 (default) = the model's context length.
    pub seq_len: i64,
    /// Ring length of the GDN and Mamba-2 pools (default 16; raised to `spec_window`, and
    /// to 1).
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

const SIZING_PARAMS_V1: usize = size_of::<kvr_model_sizing_params>();

fn default_sizing_params() -> kvr_model_sizing_params {
    kvr_model_sizing_params {
        struct_size: size_of::<kvr_model_sizing_params>() as u32,
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
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_sizing_params_default(
    params: *mut kvr_model_sizing_params,
) -> kvr_status {
    guard("kvr_model_sizing_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL.
        unsafe { params.write(default_sizing_params()) };
        Ok(())
    })
}

/// A memory layout `kvr_model_compute_sizing` compares: the index into the per-layout arrays
/// of `kvr_model_sizing` (`bytes_per_seq[KVR_MODEL_LAYOUT_PAGED_RING]`, ...).
pub type kvr_model_layout = i32;
/// Paged KV + GDN / Mamba-2 replay rings (kvreplay).
pub const KVR_MODEL_LAYOUT_PAGED_RING: kvr_model_layout = 0 as kvr_model_layout;
/// Paged KV + per-draft state snapshots.
pub const KVR_MODEL_LAYOUT_PAGED_SNAPSHOTS: kvr_model_layout = 1 as kvr_model_layout;
/// Contiguous KV (the model's context, or `seq_len` if longer, plus the speculative window,
/// reserved per sequence) + GDN / Mamba-2 replay rings.
pub const KVR_MODEL_LAYOUT_CONTIGUOUS_RING: kvr_model_layout = 2 as kvr_model_layout;
/// Contiguous KV + per-draft state snapshots.
pub const KVR_MODEL_LAYOUT_CONTIGUOUS_SNAPSHOTS: kvr_model_layout = 3 as kvr_model_layout;
/// Number of layouts: the length of the per-layout arrays of `kvr_model_sizing`.
pub const KVR_MODEL_LAYOUT_COUNT: usize = 4;

/// Per-sequence costs and how many sequences fit, for each `kvr_model_layout`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_model_sizing {
    /// `sizeof(kvr_model_sizing)` as the library wrote it.
    pub struct_size: u32,
    /// Softmax-attention layers.
    pub n_attention_layers: i32,
    /// Gated DeltaNet layers.
    pub n_gdn_layers: i32,
    /// Mamba-2 layers.
    pub n_mamba2_layers: i32,
    /// Tokens per sequence used (seq_len, or the context length).
    pub seq_len: i64,
    /// KV bytes per token, all attention layers.
    pub kv_bytes_per_token: i64,
    /// Pages per sequence (seq_len + spec_window tokens).
    pub pages_per_seq: i64,
    /// Paged KV bytes per sequence (`pages_per_seq` pages).
    pub paged_kv_bytes_per_seq: i64,
    /// Contiguous KV bytes per sequence: (max(context length, `seq_len`) + `spec_window`) *
    /// `kv_bytes_per_token` (the speculative window's draft tokens are reserved on top of
    /// the model's whole context).
    pub contiguous_kv_bytes_per_seq: i64,
    /// GDN and Mamba-2 states (every layout).
    pub state_bytes_per_seq: i64,
    /// GDN and Mamba-2 rings and conv window rings (the ring layouts).
    pub ring_bytes_per_seq: i64,
    /// Per-draft states and conv windows, GDN and Mamba-2 (the snapshot layouts).
    pub snapshot_bytes_per_seq: i64,
    /// The Mamba-2 layers' part of `state_bytes_per_seq + ring_bytes_per_seq` (included
    /// there, not on top): the `total_bytes` per sequence of the pool from
    /// `kvr_model_get_mamba2_pool_params`. 0 without Mamba-2 layers. (This slot was
    /// `mamba2_extra_bytes_per_seq` before Mamba-2 layers were sized with the replay pool:
    /// their conv windows and per-draft states, added to every layout.)
    pub mamba2_bytes_per_seq: i64,
    /// Bytes per sequence, indexed by `kvr_model_layout`.
    pub bytes_per_seq: [i64; KVR_MODEL_LAYOUT_COUNT],
    /// Sequences that fit in the budget, indexed by `kvr_model_layout`.
    pub max_seqs: [i64; KVR_MODEL_LAYOUT_COUNT],
}

fn sizing_params(p: &kvr_model_sizing_params) -> Result<gguf::SizingParams> {
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
    params: *const kvr_model_sizing_params,
) -> Result<(Arc<ModelEntry>, gguf::Sizing, kvr_model_sizing_params)> {
    let m = model_from(model)?;
    non_null(params, "params")?;
    // SAFETY: non-NULL; `struct_size` readable bytes.
    let p = unsafe {
        read_versioned(
            params,
            default_sizing_params(),
            SIZING_PARAMS_V1,
            "kvr_model_sizing_params",
        )?
    };
    let s = gguf::sizing(&m.model.plan, &sizing_params(&p)?)?;
    Ok((m, s, p))
}

/// `compute` for the pool getters: the `KVR_MODEL_LAYOUT_PAGED_RING` layout they fill must
/// fit one sequence in the budget.
fn compute_fitting(
    model: *const kvr_model,
    params: *const kvr_model_sizing_params,
) -> Result<(gguf::Sizing, kvr_model_sizing_params)> {
    let (_, s, p) = compute(model, params)?;
    if s.max_seqs[KVR_MODEL_LAYOUT_PAGED_RING as usize] == 0 {
        return Err(Error::OutOfRange(format!(
            "not one sequence fits in {} bytes",
            p.budget_bytes
        )));
    }
    Ok((s, p))
}

/// Sizes pools for the model under `params` into `*out`: per-sequence costs and sequences
/// that fit, for each `kvr_model_layout`. Set `out->struct_size` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// negative sizes or budget, a `struct_size` too small, or in `params` larger with a
/// non-zero byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE`
/// (spec_window > 8, sizes that overflow); `KVR_STATUS_DTYPE_MISMATCH` (a dtype the pools
/// do not store); `KVR_STATUS_UNSUPPORTED` (GDN or Mamba-2 layers their pool cannot hold,
/// e.g. a head or state dim above 256).
/// Ownership: `params` is read during the call; `*out` is the caller's.
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_compute_sizing(
    model: *const kvr_model,
    params: *const kvr_model_sizing_params,
    out: *mut kvr_model_sizing,
) -> kvr_status {
    guard("kvr_model_compute_sizing", || {
        non_null(out, "out")?;
        let (_, s, _) = compute(model, params)?;
        let c = kvr_model_sizing {
            struct_size: size_of::<kvr_model_sizing>() as u32,
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
            mamba2_bytes_per_seq: s.mamba2_bytes_per_seq as i64,
            bytes_per_seq: s.per_seq.map(|x| x as i64),
            max_seqs: s.max_seqs.map(|x| x as i64),
        };
        // SAFETY: non-NULL; `struct_size` writable bytes.
        unsafe { write_versioned(out, c, size_of::<kvr_model_sizing>(), "kvr_model_sizing") }
    })
}

/// Fills `*out` (as `kvr_kv_pool_params_default` would, then) with the KV pool for the
/// `KVR_MODEL_LAYOUT_PAGED_RING` layout: attention layers, KV heads, head dim, page size,
/// dtype, capacity and sequence slots.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// negative sizes or budget, a `struct_size` too small, or in `params` larger with a
/// non-zero byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE`
/// (spec_window > 8, sizes that overflow); `KVR_STATUS_DTYPE_MISMATCH` (a dtype the pools
/// do not store); `KVR_STATUS_UNSUPPORTED` (no attention layers, layers of different
/// shapes, or K and V head dims that differ; GDN or Mamba-2 layers their pool cannot
/// hold); `KVR_STATUS_OUT_OF_RANGE` also when not one sequence fits the budget.
/// Ownership: `params` is read during the call; `*out` is the caller's (its `layers` is
/// NULL).
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_kv_pool_params(
    model: *const kvr_model,
    params: *const kvr_model_sizing_params,
    out: *mut kvr_kv_pool_params,
) -> kvr_status {
    guard("kvr_model_get_kv_pool_params", || {
        non_null(out, "out")?;
        let (s, p) = compute_fitting(model, params)?;
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

/// Fills `*out` (as `kvr_gdn_pool_params_default` would, then) with the GDN pool for the
/// `KVR_MODEL_LAYOUT_PAGED_RING` layout: layers, heads, dims, ring, drafts, dtypes, conv
/// window, sequence slots; K-major state.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// negative sizes or budget, a `struct_size` too small, or in `params` larger with a
/// non-zero byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE`
/// (spec_window > 8, sizes that overflow); `KVR_STATUS_DTYPE_MISMATCH` (a dtype the pools
/// do not store); `KVR_STATUS_UNSUPPORTED` (no GDN layers, or GDN or Mamba-2 layers their
/// pool cannot hold); `KVR_STATUS_OUT_OF_RANGE` also when not one sequence fits the budget.
/// Ownership: `params` is read during the call; `*out` is the caller's (its `states` is
/// NULL).
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_gdn_pool_params(
    model: *const kvr_model,
    params: *const kvr_model_sizing_params,
    out: *mut kvr_gdn_pool_params,
) -> kvr_status {
    guard("kvr_model_get_gdn_pool_params", || {
        non_null(out, "out")?;
        let (s, p) = compute_fitting(model, params)?;
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

/// Fills `*out` (as `kvr_mamba2_pool_params_default` would, then) with the Mamba-2 pool for
/// the `KVR_MODEL_LAYOUT_PAGED_RING` layout: Mamba-2 layers, heads, head dim, groups, state
/// dim, ring, drafts, dtypes, conv window (kernel and xBC channels), sequence slots;
/// V-major state.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// negative sizes or budget, a `struct_size` too small, or in `params` larger with a
/// non-zero byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE`
/// (spec_window > 8, sizes that overflow); `KVR_STATUS_DTYPE_MISMATCH` (a dtype the pools
/// do not store); `KVR_STATUS_UNSUPPORTED` (no Mamba-2 layers, or GDN or Mamba-2 layers
/// their pool cannot hold); `KVR_STATUS_OUT_OF_RANGE` also when not one sequence fits the
/// budget.
/// Ownership: `params` is read during the call; `*out` is the caller's (its `states` is
/// NULL).
/// Thread safety: thread-safe (a model does not change after `kvr_model_open`).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_model_get_mamba2_pool_params(
    model: *const kvr_model,
    params: *const kvr_model_sizing_params,
    out: *mut kvr_mamba2_pool_params,
) -> kvr_status {
    guard("kvr_model_get_mamba2_pool_params", || {
        non_null(out, "out")?;
        let (s, p) = compute_fitting(model, params)?;
        let c = s
            .mamba2_pool
            .ok_or_else(|| Error::Unsupported("the model has no Mamba-2 layers".into()))?;
        // The core's shape (linear::mamba2): value heads = heads (dv = head dim), key heads
        // = groups (dk = state dim).
        let mut m = super::mamba2::default_pool();
        m.n_layers = c.layers as i32;
        m.n_heads = c.v_heads as i32;
        m.head_dim = c.dv as i32;
        m.n_groups = c.k_heads as i32;
        m.d_state = c.dk as i32;
        m.ring_len = c.ring_len as i32;
        m.max_drafts = c.max_drafts as i32;
        m.state_dtype = p.state_dtype;
        m.entry_dtype = p.entry_dtype;
        m.layout = KVR_STATE_V_MAJOR;
        m.max_seqs = c.max_seqs.min(i32::MAX as usize) as i32;
        m.conv_dim = c.conv_dim as i32;
        m.conv_kernel = c.conv_kernel as i32;
        m.conv_dtype = p.conv_dtype;
        // SAFETY: non-NULL.
        unsafe { out.write(m) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_index_the_core_variants() {
        let name = |l: kvr_model_layout| gguf::VARIANTS[l as usize];
        assert_eq!(gguf::VARIANTS.len(), KVR_MODEL_LAYOUT_COUNT);
        assert_eq!(name(KVR_MODEL_LAYOUT_PAGED_RING), "paged KV + ring");
        assert_eq!(
            name(KVR_MODEL_LAYOUT_PAGED_SNAPSHOTS),
            "paged KV + snapshots"
        );
        assert_eq!(
            name(KVR_MODEL_LAYOUT_CONTIGUOUS_RING),
            "contiguous KV + ring"
        );
        assert_eq!(
            name(KVR_MODEL_LAYOUT_CONTIGUOUS_SNAPSHOTS),
            "contiguous KV + snapshots"
        );
    }
}
