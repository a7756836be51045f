//! `kvr_mamba2_pool`: replay decoding for Mamba-2 layers (Nemotron-H, Granite-4 hybrids),
//! with mamba_ssm's `selective_state_update` / llama.cpp's `ggml_ssm_scan` semantics. The
//! pool, cursor and memory types are the replay core's (shared with `kvr_gdn_pool`).

use std::ffi::c_void;
use std::sync::Arc;

use super::context::{context_from, kvr_context};
use super::gdn::{
    config_from, default_pool_params, kvr_gdn_cursor, kvr_gdn_pool_memory, kvr_gdn_pool_params,
    kvr_gdn_state_storage, kvr_gdn_threshold, kvr_state_layout, KVR_GDN_THRESHOLD_DEFAULT,
    KVR_STATE_V_MAJOR,
};
use super::guard::{guard, non_null, read_versioned};
use super::handles::Registry;
use super::kv_pool::{kvr_layer_select, kvr_seq_id, one_layer};
use super::replay::{self, optional_view, stream_of, view};
use super::status::kvr_status;
use super::tensor::{kvr_dtype, kvr_tensor, KVR_DTYPE_F32};
use crate::error::Result;
use crate::linear::{Mamba2Io, Mamba2Options, Mamba2Pool};

/// A Mamba-2 replay pool (opaque). Created by `kvr_mamba2_pool_new`, freed by
/// `kvr_mamba2_pool_free`.
pub struct kvr_mamba2_pool {
    _private: [u8; 0],
}

pub(crate) static MAMBA2_POOLS: Registry<Mamba2Pool> = Registry::new("kvr_mamba2_pool");

fn pool_from(p: *const kvr_mamba2_pool) -> Result<Arc<Mamba2Pool>> {
    MAMBA2_POOLS.get(p as usize)
}

/// Options for `kvr_mamba2_pool_new`; fill with `kvr_mamba2_pool_params_default`. The state
/// of a head is `[head_dim, d_state]` (`KVR_STATE_V_MAJOR`, as mamba_ssm and llama.cpp
/// keep it) or `[d_state, head_dim]` (`KVR_STATE_K_MAJOR`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_mamba2_pool_params {
    /// `sizeof(kvr_mamba2_pool_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Mamba-2 layers (required, >= 1).
    pub n_layers: i32,
    /// Heads (`nheads`, required, a multiple of `n_groups`). Head h reads B and C of group
    /// h / (n_heads / n_groups), as mamba_ssm's `repeat` does.
    pub n_heads: i32,
    /// Head dim P (required; CUDA: <= 256).
    pub head_dim: i32,
    /// Groups of B and C (`ngroups`, required).
    pub n_groups: i32,
    /// State dim N (`d_state`, required; CUDA: <= 256).
    pub d_state: i32,
    /// Ring length L (default 16); 0 = recurrent mode (one state snapshot per draft).
    pub ring_len: i32,
    /// KV-only mode for short sequences, as `kvr_gdn_pool_params.kv_only_threshold`
    /// (default `KVR_GDN_THRESHOLD_DEFAULT`: off, as for GDN pools; a count > 0, at most
    /// what one head's state memory holds, turns it on, with the same costs on CUDA).
    pub kv_only_threshold: kvr_gdn_threshold,
    /// Most drafts per verify, 1..=8 and <= ring_len (0 = default: min(8, ring_len), or 8).
    pub max_drafts: i32,
    /// State element type: `KVR_DTYPE_F32` (default) or `_BF16`.
    pub state_dtype: kvr_dtype,
    /// Ring element type (default `KVR_DTYPE_F32`).
    pub entry_dtype: kvr_dtype,
    /// `KVR_STATE_V_MAJOR` (default) or `KVR_STATE_K_MAJOR`.
    pub layout: kvr_state_layout,
    /// Sequence slots (default 256).
    pub max_seqs: i32,
    /// Channels of the causal-conv input (xBC: n_heads * head_dim + 2 * n_groups * d_state)
    /// whose window the pool keeps (0 = none, default).
    pub conv_dim: i32,
    /// Conv kernel width (default 4).
    pub conv_kernel: i32,
    /// Conv window element type (default `KVR_DTYPE_F32`).
    pub conv_dtype: kvr_dtype,
    /// NULL (default): the pool allocates the states; otherwise `n_layers` entries of
    /// caller-owned state memory, as `kvr_gdn_pool_params.states`.
    pub states: *const kvr_gdn_state_storage,
}

const POOL_PARAMS_V1: usize = size_of::<kvr_mamba2_pool_params>();

pub(crate) fn default_pool() -> kvr_mamba2_pool_params {
    let g = default_pool_params();
    kvr_mamba2_pool_params {
        struct_size: size_of::<kvr_mamba2_pool_params>() as u32,
        n_layers: 0,
        n_heads: 0,
        head_dim: 0,
        n_groups: 0,
        d_state: 0,
        ring_len: g.ring_len,
        kv_only_threshold: KVR_GDN_THRESHOLD_DEFAULT,
        max_drafts: 0,
        state_dtype: KVR_DTYPE_F32,
        entry_dtype: KVR_DTYPE_F32,
        layout: KVR_STATE_V_MAJOR,
        max_seqs: g.max_seqs,
        conv_dim: 0,
        conv_kernel: 4,
        conv_dtype: KVR_DTYPE_F32,
        states: std::ptr::null(),
    }
}

/// The core's shape: value heads = heads (dv = P), key heads = groups (dk = N).
fn as_replay_params(p: &kvr_mamba2_pool_params) -> kvr_gdn_pool_params {
    kvr_gdn_pool_params {
        n_layers: p.n_layers,
        n_k_heads: p.n_groups,
        n_v_heads: p.n_heads,
        dk: p.d_state,
        dv: p.head_dim,
        ring_len: p.ring_len,
        kv_only_threshold: p.kv_only_threshold,
        max_drafts: p.max_drafts,
        state_dtype: p.state_dtype,
        entry_dtype: p.entry_dtype,
        layout: p.layout,
        max_seqs: p.max_seqs,
        conv_dim: p.conv_dim,
        conv_kernel: p.conv_kernel,
        conv_dtype: p.conv_dtype,
        states: p.states,
        ..default_pool_params()
    }
}

/// Fills `*params` with the defaults (ring of 16, `KVR_GDN_THRESHOLD_DEFAULT`: no KV-only
/// mode, f32 state and ring, V-major, 256 sequences, no conv window, owned memory); the
/// caller still sets `n_layers`, `n_heads`, `head_dim`, `n_groups` and `d_state`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_params_default(
    params: *mut kvr_mamba2_pool_params,
) -> kvr_status {
    guard("kvr_mamba2_pool_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL, writable.
        unsafe { params.write(default_pool()) };
        Ok(())
    })
}

/// Creates a Mamba-2 pool on `ctx` and stores it in `*out`; as `kvr_gdn_pool_new`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `ctx`, `params` or `out`);
/// `KVR_STATUS_INVALID_ARG` (zero or negative sizes, heads not a multiple of groups,
/// ring_len < max_drafts, a KV-only threshold > 0 with ring_len 0, unknown layout or dtype,
/// `struct_size` too small, or larger with a non-zero byte past this library's struct);
/// `KVR_STATUS_OUT_OF_RANGE` (max_drafts > 8, head_dim or d_state > 256, threshold above
/// the KV-only capacity, sizes that overflow); `KVR_STATUS_DTYPE_MISMATCH` (a state, ring or
/// conv dtype other than f32 or bf16); `KVR_STATUS_UNSUPPORTED`; `KVR_STATUS_OUT_OF_MEMORY`;
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the caller owns the new pool and frees it with `kvr_mamba2_pool_free`; the
/// pool keeps `ctx` alive. `params` is copied; state memory given in `states` stays the
/// caller's and must outlive the pool.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written and nothing is left allocated.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_new(
    ctx: *const kvr_context,
    params: *const kvr_mamba2_pool_params,
    out: *mut *mut kvr_mamba2_pool,
) -> kvr_status {
    guard("kvr_mamba2_pool_new", || {
        let ctx = context_from(ctx)?;
        non_null(params, "params")?;
        non_null(out, "out")?;
        // SAFETY: non-NULL; `struct_size` readable bytes.
        let p = unsafe {
            read_versioned(
                params,
                default_pool(),
                POOL_PARAMS_V1,
                "kvr_mamba2_pool_params",
            )?
        };
        let (cfg, states) = config_from(&as_replay_params(&p))?;
        let pool = Mamba2Pool::new(ctx, cfg, states)?;
        let h = MAMBA2_POOLS.insert(pool);
        // SAFETY: non-NULL.
        unsafe { out.write(h as *mut kvr_mamba2_pool) };
        Ok(())
    })
}

/// Frees a pool and everything it allocated; NULL is a no-op. As `kvr_gdn_pool_free`.
///
/// Returns: nothing.
/// Ownership: ends the caller's ownership of `pool`.
/// Thread safety: thread-safe; a call already running on another thread keeps the pool
/// alive until it returns.
/// On failure: a handle that is not a live pool is ignored and recorded in
/// `kvr_error_last_message`; nothing changes.
#[no_mangle]
pub extern "C" fn kvr_mamba2_pool_free(pool: *mut kvr_mamba2_pool) {
    if pool.is_null() {
        return;
    }
    let _ = guard("kvr_mamba2_pool_free", || {
        MAMBA2_POOLS.remove(pool as usize).map(drop)
    });
}

/// Per-sequence memory of the pool, and the KV-only threshold it uses. Set
/// `out->struct_size` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `struct_size` too small).
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_get_memory(
    pool: *const kvr_mamba2_pool,
    out: *mut kvr_gdn_pool_memory,
) -> kvr_status {
    guard("kvr_mamba2_pool_get_memory", || {
        replay::get_memory(&*pool_from(pool)?, out)
    })
}

/// Adds a sequence (zero state, empty ring, zero conv window) and stores its id in
/// `*out_seq`; on CUDA the reset is queued on `stream`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_POOL_EXHAUSTED`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the pool owns the sequence until `kvr_mamba2_pool_seq_free`.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: `*out_seq` is not written and the pool is unchanged (after
/// `KVR_STATUS_CUDA_ERROR`: queued work may be half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_seq_add(
    pool: *mut kvr_mamba2_pool,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> kvr_status {
    guard("kvr_mamba2_pool_seq_add", || {
        replay::seq_add(&*pool_from(pool)?, stream, out_seq)
    })
}

/// Frees a sequence's slot (every layer, pending drafts included). `stream` is unused.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`.
/// Ownership: the slot returns to the pool.
/// Thread safety: thread-safe.
/// On failure: the pool is unchanged.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_seq_free(
    pool: *mut kvr_mamba2_pool,
    seq: kvr_seq_id,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_seq_free", || {
        pool_from(pool)?.seq_free(seq, stream_of(stream))
    })
}

/// Resets a sequence to the empty state in every layer, discarding pending drafts.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: nothing changes hands.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the pool is unchanged (after `KVR_STATUS_CUDA_ERROR`: queued work may be
/// half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_seq_reset(
    pool: *mut kvr_mamba2_pool,
    seq: kvr_seq_id,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_seq_reset", || {
        pool_from(pool)?.seq_reset(seq, stream_of(stream))
    })
}

/// Reads a sequence's cursor for `layer` (as `kvr_gdn_pool_get_cursor`; synchronizes on
/// CUDA: diagnostics and tests).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_OUT_OF_RANGE` (layer); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_get_cursor(
    pool: *const kvr_mamba2_pool,
    layer: i32,
    seq: kvr_seq_id,
    out: *mut kvr_gdn_cursor,
) -> kvr_status {
    guard("kvr_mamba2_pool_get_cursor", || {
        replay::get_cursor(&*pool_from(pool)?, layer, seq, out)
    })
}

/// Replaces a sequence's state in `layer` (`[n_heads, head_dim, d_state]` for V-major
/// pools, `[n_heads, d_state, head_dim]` for K-major; any float dtype and strides) and, if
/// `conv` is not NULL, its conv window (`[conv_kernel - 1, conv_dim]`); the ring empties.
/// As `kvr_gdn_pool_import_state`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, memory kind, `conv` without conv windows, pending drafts);
/// `KVR_STATUS_OUT_OF_RANGE` (layer); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH`;
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `state`, `conv` and `stream` stay the caller's; device memory must stay valid
/// until the queued copy has run.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the sequence is unchanged (after `KVR_STATUS_CUDA_ERROR`: queued work may
/// be half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_import_state(
    pool: *mut kvr_mamba2_pool,
    layer: i32,
    seq: kvr_seq_id,
    state: *const kvr_tensor,
    conv: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_import_state", || {
        replay::import_state(&*pool_from(pool)?, layer, seq, state, conv, stream)
    })
}

/// Writes a sequence's current state in `layer` (shape as for import) and, if `conv_out`
/// is not NULL, its conv window. As `kvr_gdn_pool_export_state`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, memory kind, overlapping outputs, `conv_out` without conv windows, pending
/// drafts); `KVR_STATUS_OUT_OF_RANGE` (layer); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `out`, `conv_out` and `stream` stay the caller's.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the outputs are not written (after `KVR_STATUS_CUDA_ERROR`: unspecified).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_export_state(
    pool: *const kvr_mamba2_pool,
    layer: i32,
    seq: kvr_seq_id,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_export_state", || {
        replay::export_state(&*pool_from(pool)?, layer, seq, out, conv_out, stream)
    })
}

/// Writes the state every layer of `seq` had `keep` tokens past its checkpoint into `out`
/// (`[n_layers, ...]`, shape as for import per layer) and, at the newest token only, the
/// conv windows into `conv_out` (`[n_layers, conv_kernel - 1, conv_dim]` or NULL). As
/// `kvr_gdn_pool_materialize` (synchronizes on CUDA; not capturable).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, memory kind, overlapping outputs, `conv_out` without conv windows or short of the
/// ring fill, pending drafts); `KVR_STATUS_OUT_OF_RANGE` (`keep` negative or past a layer's
/// ring fill); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `out`, `conv_out` and `stream` stay the caller's.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the outputs are not written (after `KVR_STATUS_CUDA_ERROR`: unspecified).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_materialize(
    pool: *const kvr_mamba2_pool,
    seq: kvr_seq_id,
    keep: i32,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_materialize", || {
        replay::materialize(&*pool_from(pool)?, seq, keep, out, conv_out, stream)
    })
}

/// The tensors of a Mamba-2 decode or verify (B rows, T tokens each; decode also takes them
/// without the T dimension). Every tensor is f32, f16 or bf16 in the context's memory; on
/// CUDA the last dimension of x, B, C, z and out is contiguous.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_mamba2_tensors {
    /// i32 `[B]` sequence ids (`KVR_SEQ_NONE`: an unused row, output zeros).
    pub seq_ids: *const kvr_tensor,
    /// `[B, T, n_heads, head_dim]` (required).
    pub x: *const kvr_tensor,
    /// Raw dt `[B, T, n_heads]` (before bias and softplus; required).
    pub dt: *const kvr_tensor,
    /// A `[n_heads]` (required; negative).
    pub a: *const kvr_tensor,
    /// B `[B, T, n_groups, d_state]` (required).
    pub b: *const kvr_tensor,
    /// C `[B, T, n_groups, d_state]` (required).
    pub c: *const kvr_tensor,
    /// D `[n_heads]` skip (NULL: none).
    pub d: *const kvr_tensor,
    /// z `[B, T, n_heads, head_dim]` gate, `y *= silu(z)` (NULL: none; models that apply a
    /// gated RMSNorm pass NULL and gate there).
    pub z: *const kvr_tensor,
    /// dt bias `[n_heads]` (NULL: none).
    pub dt_bias: *const kvr_tensor,
    /// Conv input `[B, T, conv_dim]` (required exactly when the pool keeps conv windows).
    pub conv_in: *const kvr_tensor,
    /// Output y `[B, T, n_heads, head_dim]` (required).
    pub out: *const kvr_tensor,
}

/// Options of `kvr_mamba2_pool_decode` / `_verify`; fill with
/// `kvr_mamba2_step_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_mamba2_step_params {
    /// `sizeof(kvr_mamba2_step_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Non-zero (default): softplus of dt + dt_bias (mamba_ssm's `dt_softplus`; llama.cpp's
    /// `ggml_ssm_scan` always applies it).
    pub dt_softplus: i32,
    /// Lower clamp of dt after softplus (default 0).
    pub dt_min: f32,
    /// Upper clamp of dt after softplus (default infinity).
    pub dt_max: f32,
}

const STEP_PARAMS_V1: usize = size_of::<kvr_mamba2_step_params>();

fn default_step() -> kvr_mamba2_step_params {
    let o = Mamba2Options::default();
    kvr_mamba2_step_params {
        struct_size: size_of::<kvr_mamba2_step_params>() as u32,
        dt_softplus: o.dt_softplus as i32,
        dt_min: o.dt_min,
        dt_max: o.dt_max,
    }
}

/// Fills `*params` with the defaults (softplus on, no clamp).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_step_params_default(
    params: *mut kvr_mamba2_step_params,
) -> kvr_status {
    guard("kvr_mamba2_step_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL, writable.
        unsafe { params.write(default_step()) };
        Ok(())
    })
}

fn step(
    name: &str,
    pool: *mut kvr_mamba2_pool,
    layer: i32,
    t: *const kvr_mamba2_tensors,
    params: *const kvr_mamba2_step_params,
    stream: *mut c_void,
    verify: bool,
) -> kvr_status {
    guard(name, || {
        let pool = pool_from(pool)?;
        let layer = one_layer(layer)?;
        non_null(t, "tensors")?;
        // SAFETY: non-NULL.
        let t = unsafe { t.read() };
        let p = if params.is_null() {
            default_step()
        } else {
            // SAFETY: non-NULL; `struct_size` readable bytes.
            unsafe {
                read_versioned(
                    params,
                    default_step(),
                    STEP_PARAMS_V1,
                    "kvr_mamba2_step_params",
                )?
            }
        };
        let (ids, x, dt, a, b, c, out) = (
            view(t.seq_ids, "seq_ids")?,
            view(t.x, "x")?,
            view(t.dt, "dt")?,
            view(t.a, "A")?,
            view(t.b, "B")?,
            view(t.c, "C")?,
            view(t.out, "out")?,
        );
        let d = optional_view(t.d, "D")?;
        let z = optional_view(t.z, "z")?;
        let bias = optional_view(t.dt_bias, "dt_bias")?;
        let conv_in = optional_view(t.conv_in, "conv_in")?;
        let io = Mamba2Io {
            seq_ids: &ids,
            x: &x,
            dt: &dt,
            a: &a,
            b: &b,
            c: &c,
            d: d.as_ref(),
            z: z.as_ref(),
            dt_bias: bias.as_ref(),
            out: &out,
            conv_in: conv_in.as_ref(),
        };
        let opts = Mamba2Options {
            dt_softplus: p.dt_softplus != 0,
            dt_min: p.dt_min,
            dt_max: p.dt_max,
        };
        if verify {
            pool.verify(layer, &io, &opts, stream_of(stream))
        } else {
            pool.decode(layer, &io, &opts, stream_of(stream))
        }
    })
}

/// One token per sequence (T = 1): y from the checkpoint and the ring, the state written
/// only where a sequence's ring is full; the token is committed at once. `params` NULL:
/// defaults. Graph-capturable on CUDA (no host synchronization).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL handle, `tensors` or a required
/// tensor); `KVR_STATUS_INVALID_ARG` (handle, shapes, T != 1, memory kind, strides,
/// overlapping `out`, conv_in missing or unexpected, dt limits that are not an interval,
/// pending drafts, duplicate ids); `KVR_STATUS_OUT_OF_RANGE` (layer);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the tensors and `stream` stay the caller's.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the pool is unchanged (after `KVR_STATUS_CUDA_ERROR`: queued work may be
/// half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_decode(
    pool: *mut kvr_mamba2_pool,
    layer: i32,
    tensors: *const kvr_mamba2_tensors,
    params: *const kvr_mamba2_step_params,
    stream: *mut c_void,
) -> kvr_status {
    step(
        "kvr_mamba2_pool_decode",
        pool,
        layer,
        tensors,
        params,
        stream,
        false,
    )
}

/// T = 1..=max_drafts draft tokens per sequence: y of every draft from the checkpoint, the
/// ring and the drafts before it, with no per-draft state; the drafts stay pending until
/// `kvr_mamba2_pool_commit`. Graph-capturable on CUDA.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (as decode,
/// T outside 1..=max_drafts, drafts already pending); `KVR_STATUS_OUT_OF_RANGE` (layer);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the tensors and `stream` stay the caller's.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the pool is unchanged (after `KVR_STATUS_CUDA_ERROR`: queued work may be
/// half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_verify(
    pool: *mut kvr_mamba2_pool,
    layer: i32,
    tensors: *const kvr_mamba2_tensors,
    params: *const kvr_mamba2_step_params,
    stream: *mut c_void,
) -> kvr_status {
    step(
        "kvr_mamba2_pool_verify",
        pool,
        layer,
        tensors,
        params,
        stream,
        true,
    )
}

/// Commits the first `accepted[i]` pending drafts of `seq_ids[i]` in `layer` (or every
/// layer, `KVR_LAYER_ALL`): host or device i32 counts, the cursor moves where the kernels
/// run. `conv_state` (one layer only; `[B, conv_kernel - 1, conv_dim]` or NULL) receives the
/// conv window of the accepted prefix. As `kvr_gdn_pool_commit`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, device ids, host counts outside 0..=pending, `conv_state` with
/// `KVR_LAYER_ALL`); `KVR_STATUS_OUT_OF_RANGE` (layer); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the tensors and `stream` stay the caller's.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the pool is unchanged (after `KVR_STATUS_CUDA_ERROR`: queued work may be
/// half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_commit(
    pool: *mut kvr_mamba2_pool,
    layer: kvr_layer_select,
    seq_ids: *const kvr_tensor,
    accepted: *const kvr_tensor,
    conv_state: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_commit", || {
        replay::commit(
            &*pool_from(pool)?,
            layer,
            seq_ids,
            accepted,
            conv_state,
            stream,
        )
    })
}

/// Writes the current state of each listed sequence into its checkpoint in `layer` (or
/// every layer) and empties the ring. As `kvr_gdn_pool_flush`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, device ids, pending drafts); `KVR_STATUS_OUT_OF_RANGE` (layer);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the tensors and `stream` stay the caller's.
/// Thread safety: thread-safe; on CUDA the device work of calls on one pool must be
/// ordered by the caller.
/// On failure: the pool is unchanged (after `KVR_STATUS_CUDA_ERROR`: queued work may be
/// half done).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_mamba2_pool_flush(
    pool: *mut kvr_mamba2_pool,
    layer: kvr_layer_select,
    seq_ids: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_mamba2_pool_flush", || {
        replay::flush(&*pool_from(pool)?, layer, seq_ids, stream)
    })
}
