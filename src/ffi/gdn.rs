//! `kvr_gdn_pool`: replay decoding for Gated DeltaNet layers (checkpoint state + ring of
//! recent inputs, parallel speculative verify, device-side commit, KV-only short contexts).

use std::ffi::c_void;
use std::sync::Arc;

use super::context::{context_from, kvr_context};
use super::guard::{guard, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::kv_pool::KVR_ALL_LAYERS;
use super::status::kvr_status;
use super::tensor::{dtype_from_c, kvr_dtype, kvr_tensor, view_from_c, KVR_DTYPE_F32};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::linear::{GdnConfig, GdnIo, GdnMemory, GdnOptions, GdnPool, StateLayout, StateStorage};
use crate::tensor::TensorView;

/// A Gated DeltaNet replay pool (opaque). Created by `kvr_gdn_pool_new`, freed by
/// `kvr_gdn_pool_free`.
pub struct kvr_gdn_pool {
    _private: [u8; 0],
}

pub(crate) static GDN_POOLS: Registry<GdnPool> = Registry::new("kvr_gdn_pool");

/// How a state matrix is stored.
pub type kvr_state_layout = i32;
/// `[dk][dv]` per value head, dv contiguous (flash-linear-attention's default).
pub const KVR_STATE_K_MAJOR: kvr_state_layout = 0;
/// `[dv][dk]` per value head, dk contiguous (llama.cpp, vLLM, FlashInfer).
pub const KVR_STATE_V_MAJOR: kvr_state_layout = 1;

/// `kv_only_threshold` value that picks the default: min(dk, what one head's state memory
/// holds).
pub const KVR_GDN_DEFAULT_THRESHOLD: i32 = -1;

/// Per-sequence modes reported by `kvr_gdn_seq_cursor`.
pub const KVR_GDN_MODE_KV_ONLY: i32 = 0;
/// Checkpoint state plus ring.
pub const KVR_GDN_MODE_REPLAY: i32 = 1;
/// State read and written every step (pools with `ring_len` 0).
pub const KVR_GDN_MODE_RECURRENT: i32 = 2;

/// One layer's state memory in a pool over caller-owned states: sequence slot `s`, value
/// head `h` starts at `state + (s * seq_stride + h * dk * dv) * sizeof(state_dtype)`.
/// Must be 16-byte aligned on CUDA, with `seq_stride * sizeof(state_dtype)` a multiple of 16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_state_storage {
    /// Sequence slot 0's state.
    pub state: *mut c_void,
    /// Elements between sequence slots (>= n_v_heads * dk * dv).
    pub seq_stride: i64,
}

/// Options for `kvr_gdn_pool_new`; fill with `kvr_gdn_pool_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_pool_params {
    /// `sizeof(kvr_gdn_pool_params)` as the caller compiled it.
    pub struct_size: u32,
    /// GDN layers (required, >= 1).
    pub n_layers: i32,
    /// Key heads Hk (required).
    pub n_k_heads: i32,
    /// Value heads Hv (required, a multiple of Hk).
    pub n_v_heads: i32,
    /// Key head dim (required; CUDA: 32, 64, 128 or 256).
    pub dk: i32,
    /// Value head dim (required; CUDA: 32, 64, 128 or 256).
    pub dv: i32,
    /// Ring length L, the inputs kept beside the checkpoint (default 16); 0 = recurrent
    /// mode (state read and written every step, one state snapshot per draft).
    pub ring_len: i32,
    /// Sequences of at most this many tokens keep no state (KV-only);
    /// `KVR_GDN_DEFAULT_THRESHOLD` (default) = min(dk, capacity), 0 = off.
    pub kv_only_threshold: i32,
    /// Most drafts per verify, 1..=8 and <= ring_len (0 = default: min(8, ring_len), or 8).
    pub max_drafts: i32,
    /// State element type: `KVR_DTYPE_F32` (default) or `_BF16`.
    pub state_dtype: kvr_dtype,
    /// Ring element type (default `KVR_DTYPE_F32`: replay equals the recurrence to f32
    /// rounding; `_BF16` halves the ring and doubles the KV-only capacity).
    pub entry_dtype: kvr_dtype,
    /// `KVR_STATE_K_MAJOR` (default) or `KVR_STATE_V_MAJOR`.
    pub layout: kvr_state_layout,
    /// Sequence slots (default 256).
    pub max_seqs: i32,
    /// Channels of the causal-conv input whose window the pool keeps (0 = none, default).
    pub conv_dim: i32,
    /// Conv kernel width (default 4): the window is `conv_kernel - 1` inputs.
    pub conv_kernel: i32,
    /// Conv window element type (default `KVR_DTYPE_F32`).
    pub conv_dtype: kvr_dtype,
    /// NULL (default): the pool allocates the states. Otherwise `n_layers` entries of
    /// caller-owned state memory in the context's memory (copied; must outlive the pool).
    pub states: *const kvr_gdn_state_storage,
}

const POOL_PARAMS_V1: usize = size_of::<kvr_gdn_pool_params>();

pub(crate) fn default_pool_params() -> kvr_gdn_pool_params {
    kvr_gdn_pool_params {
        struct_size: size_of::<kvr_gdn_pool_params>() as u32,
        n_layers: 0,
        n_k_heads: 0,
        n_v_heads: 0,
        dk: 0,
        dv: 0,
        ring_len: 16,
        kv_only_threshold: KVR_GDN_DEFAULT_THRESHOLD,
        max_drafts: 0,
        state_dtype: KVR_DTYPE_F32,
        entry_dtype: KVR_DTYPE_F32,
        layout: KVR_STATE_K_MAJOR,
        max_seqs: 256,
        conv_dim: 0,
        conv_kernel: 4,
        conv_dtype: KVR_DTYPE_F32,
        states: std::ptr::null(),
    }
}

fn non_negative(name: &str, v: i32) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{name} = {v} is negative")))
}

fn config_from(p: &kvr_gdn_pool_params) -> Result<(GdnConfig, Option<Vec<StateStorage>>)> {
    let layout = match p.layout {
        KVR_STATE_K_MAJOR => StateLayout::KMajor,
        KVR_STATE_V_MAJOR => StateLayout::VMajor,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown layout {other} (expected KVR_STATE_K_MAJOR or KVR_STATE_V_MAJOR)"
            )))
        }
    };
    let ring_len = non_negative("ring_len", p.ring_len)?;
    let max_drafts = match p.max_drafts {
        0 if ring_len == 0 => crate::linear::MAX_DRAFTS,
        0 => ring_len.min(crate::linear::MAX_DRAFTS),
        n => non_negative("max_drafts", n)?,
    };
    let mut cfg = GdnConfig {
        layers: non_negative("n_layers", p.n_layers)?,
        k_heads: non_negative("n_k_heads", p.n_k_heads)?,
        v_heads: non_negative("n_v_heads", p.n_v_heads)?,
        dk: non_negative("dk", p.dk)?,
        dv: non_negative("dv", p.dv)?,
        ring_len,
        kv_only_threshold: 0,
        max_drafts,
        state_dtype: dtype_from_c(p.state_dtype)?,
        entry_dtype: dtype_from_c(p.entry_dtype)?,
        layout,
        max_seqs: non_negative("max_seqs", p.max_seqs)?,
        conv_dim: non_negative("conv_dim", p.conv_dim)?,
        conv_kernel: non_negative("conv_kernel", p.conv_kernel)?,
        conv_dtype: dtype_from_c(p.conv_dtype)?,
    };
    cfg.kv_only_threshold = match p.kv_only_threshold {
        KVR_GDN_DEFAULT_THRESHOLD if ring_len == 0 => 0,
        KVR_GDN_DEFAULT_THRESHOLD => cfg.dk.min(cfg.kv_only_capacity()),
        n => non_negative("kv_only_threshold", n)?,
    };
    let states = if p.states.is_null() {
        None
    } else {
        let mut v = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            // SAFETY: the caller passes `n_layers` readable entries.
            let s = unsafe { p.states.add(l).read() };
            v.push(StateStorage {
                addr: s.state as usize,
                seq_stride: usize::try_from(s.seq_stride).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "layer {l}: seq_stride {} is negative",
                        s.seq_stride
                    ))
                })?,
            });
        }
        Some(v)
    };
    Ok((cfg, states))
}

fn pool_from(p: *const kvr_gdn_pool) -> Result<Arc<GdnPool>> {
    GDN_POOLS.get(p as usize)
}

/// Fills `*params` with the defaults (ring of 16, default KV-only threshold, f32 state and
/// ring, K-major, 256 sequences, no conv window, owned memory); the caller still sets
/// `n_layers`, `n_k_heads`, `n_v_heads`, `dk` and `dv`.
///
/// Returns `KVR_STATUS_OK` or `KVR_STATUS_NULL_ARG`. Thread-safe.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_params_default(params: *mut kvr_gdn_pool_params) -> kvr_status {
    guard("kvr_gdn_pool_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL, writable.
        unsafe { params.write(default_pool_params()) };
        Ok(())
    })
}

/// Creates a GDN pool on `ctx` and stores it in `*out`. Owned memory is allocated zeroed in
/// the context's memory (synchronously: setup time only).
///
/// Errors: NULL_ARG; INVALID_ARG (zero or negative sizes, Hv not a multiple of Hk,
/// ring_len < max_drafts, unknown layout); OUT_OF_RANGE (max_drafts > 8, threshold above
/// capacity, huge sizes); DTYPE_MISMATCH (state not f32/bf16); UNSUPPORTED (CUDA: head dims
/// outside {32, 64, 128, 256}); OUT_OF_MEMORY; CUDA errors. Thread-safe.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_new(
    ctx: *const kvr_context,
    params: *const kvr_gdn_pool_params,
    out: *mut *mut kvr_gdn_pool,
) -> kvr_status {
    guard("kvr_gdn_pool_new", || {
        let ctx = context_from(ctx)?;
        non_null(params, "params")?;
        non_null(out, "out")?;
        // SAFETY: non-NULL; `struct_size` readable bytes.
        let p = unsafe {
            read_versioned(
                params,
                default_pool_params(),
                POOL_PARAMS_V1,
                "kvr_gdn_pool_params",
            )?
        };
        let (cfg, states) = config_from(&p)?;
        let pool = GdnPool::new(ctx, cfg, states)?;
        let h = GDN_POOLS.insert(pool);
        // SAFETY: non-NULL.
        unsafe { out.write(h as *mut kvr_gdn_pool) };
        Ok(())
    })
}

/// Frees a pool (NULL is a no-op). Work queued on CUDA streams that uses the pool must be
/// finished or ordered before the caller reuses the memory. Thread-safe.
#[no_mangle]
pub extern "C" fn kvr_gdn_pool_free(pool: *mut kvr_gdn_pool) {
    if pool.is_null() {
        return;
    }
    let _ = guard("kvr_gdn_pool_free", || {
        GDN_POOLS.remove(pool as usize).map(drop)
    });
}

/// Memory one sequence of a pool needs (all layers), by part. `snapshot_bytes` is what a
/// recurrent pool spends on per-draft states; a replay pool spends `ring_bytes` instead.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_memory {
    /// `sizeof(kvr_gdn_memory)` as the library wrote it.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Checkpoint states.
    pub state_bytes: i64,
    /// Rings.
    pub ring_bytes: i64,
    /// Conv windows.
    pub conv_bytes: i64,
    /// Per-draft snapshots (recurrent pools).
    pub snapshot_bytes: i64,
    /// Sum of the above.
    pub total_bytes: i64,
    /// The KV-only threshold the pool uses (tokens).
    pub kv_only_threshold: i64,
}

fn memory_to_c(m: GdnMemory, threshold: usize) -> kvr_gdn_memory {
    kvr_gdn_memory {
        struct_size: size_of::<kvr_gdn_memory>() as u32,
        reserved: 0,
        state_bytes: m.state_bytes as i64,
        ring_bytes: m.ring_bytes as i64,
        conv_bytes: m.conv_bytes as i64,
        snapshot_bytes: m.snapshot_bytes as i64,
        total_bytes: m.total() as i64,
        kv_only_threshold: threshold as i64,
    }
}

/// Per-sequence memory of the pool `params` describes, without creating it (for sizing:
/// e.g. "T drafts with snapshots" (`ring_len` 0, `max_drafts` T) against a ring). The
/// configuration is validated as `kvr_gdn_pool_new` would (except backend limits).
/// `out->struct_size` must be set by the caller. Thread-safe.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_memory_for(
    params: *const kvr_gdn_pool_params,
    out: *mut kvr_gdn_memory,
) -> kvr_status {
    guard("kvr_gdn_memory_for", || {
        non_null(params, "params")?;
        non_null(out, "out")?;
        // SAFETY: non-NULL; `struct_size` readable bytes.
        let p = unsafe {
            read_versioned(
                params,
                default_pool_params(),
                POOL_PARAMS_V1,
                "kvr_gdn_pool_params",
            )?
        };
        let (cfg, _) = config_from(&p)?;
        cfg.validate()?;
        // SAFETY: non-NULL; `struct_size` writable bytes.
        unsafe {
            write_versioned(
                out,
                memory_to_c(cfg.memory(), cfg.kv_only_threshold),
                size_of::<kvr_gdn_memory>(),
                "kvr_gdn_memory",
            )
        }
    })
}

/// Per-sequence memory of an existing pool. `out->struct_size` must be set by the caller.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_memory(
    pool: *const kvr_gdn_pool,
    out: *mut kvr_gdn_memory,
) -> kvr_status {
    guard("kvr_gdn_pool_memory", || {
        let pool = pool_from(pool)?;
        non_null(out, "out")?;
        let c = pool.memory();
        // SAFETY: non-NULL; `struct_size` writable bytes.
        unsafe {
            write_versioned(
                out,
                memory_to_c(c, pool.config().kv_only_threshold),
                size_of::<kvr_gdn_memory>(),
                "kvr_gdn_memory",
            )
        }
    })
}

/// Adds a sequence (zero state, empty ring, zero conv window; KV-only when the pool has a
/// threshold) and writes its id to `*out_seq`. Errors: POOL_EXHAUSTED when every slot is in
/// use. On CUDA the reset is queued on `stream` (NULL: the context's stream).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_seq_add(
    pool: *mut kvr_gdn_pool,
    stream: *mut c_void,
    out_seq: *mut i32,
) -> kvr_status {
    guard("kvr_gdn_seq_add", || {
        let pool = pool_from(pool)?;
        non_null(out_seq, "out_seq")?;
        let id = pool.seq_add(Stream(stream as usize))?;
        // SAFETY: non-NULL.
        unsafe { out_seq.write(id) };
        Ok(())
    })
}

/// Frees a sequence's slot. Errors: UNKNOWN_ID.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_seq_free(
    pool: *mut kvr_gdn_pool,
    seq: i32,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_seq_free", || {
        pool_from(pool)?.seq_free(seq, Stream(stream as usize))
    })
}

/// Resets a sequence to the empty state (as just added), discarding pending drafts.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_seq_reset(
    pool: *mut kvr_gdn_pool,
    seq: i32,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_seq_reset", || {
        pool_from(pool)?.seq_reset(seq, Stream(stream as usize))
    })
}

/// What `kvr_gdn_seq_cursor` reports about one (layer, sequence).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_cursor {
    /// `KVR_GDN_MODE_*`.
    pub mode: i32,
    /// Ring position of the oldest buffered entry.
    pub ring_start: i32,
    /// Buffered committed entries (tokens since the checkpoint, or the KV-only length).
    pub buffered: i32,
    /// Verified drafts awaiting commit.
    pub pending: i32,
}

/// Reads a sequence's cursor for `layer`. On CUDA this waits for the context's own stream
/// (work queued on another stream must be finished or ordered before it by the caller) and
/// copies from the device: for diagnostics and tests, not the decode loop.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_seq_cursor(
    pool: *const kvr_gdn_pool,
    layer: i32,
    seq: i32,
    out: *mut kvr_gdn_cursor,
) -> kvr_status {
    guard("kvr_gdn_seq_cursor", || {
        let pool = pool_from(pool)?;
        non_null(out, "out")?;
        let layer = non_negative("layer", layer)?;
        let m = pool.debug_meta(layer, seq)?;
        // SAFETY: non-NULL.
        unsafe {
            out.write(kvr_gdn_cursor {
                mode: m[0],
                ring_start: m[1],
                buffered: m[2],
                pending: m[3],
            })
        };
        Ok(())
    })
}

fn optional_view(t: *const kvr_tensor, name: &str) -> Result<Option<TensorView>> {
    if t.is_null() {
        Ok(None)
    } else {
        // SAFETY: non-NULL descriptor.
        Ok(Some(unsafe { view_from_c(t, name)? }))
    }
}

/// Replaces a sequence's state in `layer` by `state` (the host's prefill result: shape
/// `[Hv, dk, dv]` for K-major pools or `[Hv, dv, dk]` for V-major, any float dtype, any
/// strides) and, if `conv` is not NULL, its conv window (`[conv_kernel - 1, conv_dim]`,
/// oldest first). The ring empties and the sequence leaves KV-only mode. Errors:
/// UNKNOWN_ID, OUT_OF_RANGE (layer), INVALID_ARG (shape, memory kind, pending drafts),
/// DTYPE_MISMATCH.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_import_state(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq: i32,
    state: *const kvr_tensor,
    conv: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_import_state", || {
        let pool = pool_from(pool)?;
        let layer = non_negative("layer", layer)?;
        // SAFETY: NULL-checked descriptor.
        let state = unsafe { view_from_c(state, "state")? };
        let conv = optional_view(conv, "conv")?;
        pool.import_state(layer, seq, &state, conv.as_ref(), Stream(stream as usize))
    })
}

/// Writes a sequence's current state in `layer` (materialized from the checkpoint and the
/// ring, or from the KV-only entries) into `out` (shape as for import, any float dtype)
/// and, if `conv_out` is not NULL, its conv window. The pool does not change.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_export_state(
    pool: *const kvr_gdn_pool,
    layer: i32,
    seq: i32,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_export_state", || {
        let pool = pool_from(pool)?;
        let layer = non_negative("layer", layer)?;
        // SAFETY: NULL-checked descriptor.
        let out = unsafe { view_from_c(out, "out")? };
        let conv_out = optional_view(conv_out, "conv_out")?;
        pool.export_state(layer, seq, &out, conv_out.as_ref(), Stream(stream as usize))
    })
}

/// Options of `kvr_gdn_decode` / `kvr_gdn_verify`; fill with `kvr_gdn_step_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_step_params {
    /// `sizeof(kvr_gdn_step_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Scale applied to q after the optional L2 norm; 0 (default) = 1/sqrt(dk).
    pub scale: f32,
    /// Non-zero: L2-normalize q and k in the kernel, as flash-linear-attention's
    /// `use_qk_l2norm_in_kernel` (default 0).
    pub l2norm_qk: i32,
}

const STEP_PARAMS_V1: usize = size_of::<kvr_gdn_step_params>();

fn default_step_params() -> kvr_gdn_step_params {
    kvr_gdn_step_params {
        struct_size: size_of::<kvr_gdn_step_params>() as u32,
        scale: 0.0,
        l2norm_qk: 0,
    }
}

/// Fills `*params` with the defaults (scale 1/sqrt(dk), no L2 norm).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_step_params_default(params: *mut kvr_gdn_step_params) -> kvr_status {
    guard("kvr_gdn_step_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL.
        unsafe { params.write(default_step_params()) };
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
fn step(
    name: &str,
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    q: *const kvr_tensor,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    g: *const kvr_tensor,
    beta: *const kvr_tensor,
    conv_in: *const kvr_tensor,
    out: *const kvr_tensor,
    params: *const kvr_gdn_step_params,
    stream: *mut c_void,
    verify: bool,
) -> kvr_status {
    guard(name, || {
        let pool = pool_from(pool)?;
        let layer = non_negative("layer", layer)?;
        let p = if params.is_null() {
            default_step_params()
        } else {
            // SAFETY: non-NULL; `struct_size` readable bytes.
            unsafe {
                read_versioned(
                    params,
                    default_step_params(),
                    STEP_PARAMS_V1,
                    "kvr_gdn_step_params",
                )?
            }
        };
        // SAFETY: NULL-checked descriptors.
        let (ids, q, k, v, g, beta, out) = unsafe {
            (
                view_from_c(seq_ids, "seq_ids")?,
                view_from_c(q, "q")?,
                view_from_c(k, "k")?,
                view_from_c(v, "v")?,
                view_from_c(g, "g")?,
                view_from_c(beta, "beta")?,
                view_from_c(out, "out")?,
            )
        };
        let conv_in = optional_view(conv_in, "conv_in")?;
        let io = GdnIo {
            seq_ids: &ids,
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            out: &out,
            conv_in: conv_in.as_ref(),
        };
        let opts = GdnOptions {
            scale: if p.scale == 0.0 { None } else { Some(p.scale) },
            l2norm_qk: p.l2norm_qk != 0,
        };
        if verify {
            pool.verify(layer, &io, &opts, Stream(stream as usize))
        } else {
            pool.decode(layer, &io, &opts, Stream(stream as usize))
        }
    })
}

/// One token for each sequence of a batch, in one launch, committed at once.
///
/// `seq_ids`: i32 `[B]`, host or device memory (-1: an unused row, output zeros; device ids
/// must be distinct and live, and discard any uncommitted drafts). q, k: `[B, Hk, dk]` (or
/// `[B, 1, Hk, dk]`); v, out: `[B, Hv, dv]`; g (log decay), beta (post-sigmoid): `[B, Hv]`;
/// conv_in (required when the pool keeps conv windows, else NULL): `[B, conv_dim]`. Float
/// dtypes f32/f16/bf16 (each tensor its own); on CUDA the last dimension of q, k, v, out
/// must be contiguous. The output comes from the checkpoint and the ring; the state is
/// written only for sequences whose ring is full (decided on the device) or that leave
/// KV-only mode. Asynchronous on CUDA and capturable in a CUDA Graph (host ids travel in
/// the launch parameters).
///
/// Errors: UNKNOWN_ID, OUT_OF_RANGE (layer, batch), INVALID_ARG (shapes, memory kinds,
/// pending drafts), DTYPE_MISMATCH; nothing changes on error.
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_gdn_decode(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    q: *const kvr_tensor,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    g: *const kvr_tensor,
    beta: *const kvr_tensor,
    conv_in: *const kvr_tensor,
    out: *const kvr_tensor,
    params: *const kvr_gdn_step_params,
    stream: *mut c_void,
) -> kvr_status {
    step(
        "kvr_gdn_decode",
        pool,
        layer,
        seq_ids,
        q,
        k,
        v,
        g,
        beta,
        conv_in,
        out,
        params,
        stream,
        false,
    )
}

/// T draft tokens per sequence (1..=max_drafts, <= ring_len) in one launch: outputs for
/// every draft without any per-draft state (recurrent pools: one snapshot per draft). The
/// drafts stay pending until `kvr_gdn_commit`; a sequence whose ring cannot take 2T more
/// entries flushes first.
///
/// Tensors as for `kvr_gdn_decode` with a T dimension: q, k `[B, T, Hk, dk]`; v, out
/// `[B, T, Hv, dv]`; g, beta `[B, T, Hv]`; conv_in `[B, T, conv_dim]`. `seq_ids` must be in
/// host memory. Errors as for decode, plus OUT_OF_RANGE for T.
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_gdn_verify(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    q: *const kvr_tensor,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    g: *const kvr_tensor,
    beta: *const kvr_tensor,
    conv_in: *const kvr_tensor,
    out: *const kvr_tensor,
    params: *const kvr_gdn_step_params,
    stream: *mut c_void,
) -> kvr_status {
    step(
        "kvr_gdn_verify",
        pool,
        layer,
        seq_ids,
        q,
        k,
        v,
        g,
        beta,
        conv_in,
        out,
        params,
        stream,
        true,
    )
}

/// Commits `accepted[i]` of the verified drafts of `seq_ids[i]` in `layer`
/// (`KVR_ALL_LAYERS`: every layer, one launch). Accepted drafts stay in the ring where
/// verify put them; the rest vanish; recurrent pools adopt the last accepted draft's
/// snapshot. `accepted` is i32 `[B]` in host memory (checked: 0..=T) or device memory
/// (clamped to 0..=T on the device; the host never waits). `seq_ids` is host i32 `[B]`.
/// With `conv_state` (`[B, conv_kernel - 1, conv_dim]`, one layer only), the conv window of
/// each accepted prefix is written there: the conv state the host's next step needs.
///
/// Errors: INVALID_ARG (no verified drafts, shapes), OUT_OF_RANGE (host counts),
/// UNKNOWN_ID, DTYPE_MISMATCH; nothing changes on error.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_commit(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    accepted: *const kvr_tensor,
    conv_state: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_commit", || {
        let pool = pool_from(pool)?;
        let layer = layer_arg(layer)?;
        // SAFETY: NULL-checked descriptors.
        let (ids, acc) = unsafe {
            (
                view_from_c(seq_ids, "seq_ids")?,
                view_from_c(accepted, "accepted")?,
            )
        };
        let cs = optional_view(conv_state, "conv_state")?;
        pool.commit(layer, &ids, &acc, cs.as_ref(), Stream(stream as usize))
    })
}

fn layer_arg(layer: i32) -> Result<Option<usize>> {
    match layer {
        KVR_ALL_LAYERS => Ok(None),
        l if l >= 0 => Ok(Some(l as usize)),
        l => Err(Error::OutOfRange(format!("layer {l} is negative"))),
    }
}

/// Writes each listed sequence's current state into its checkpoint and empties its ring
/// (before saving a checkpoint or preempting); KV-only sequences get their state
/// materialized. `layer` may be `KVR_ALL_LAYERS`; `seq_ids` is host i32 `[B]`.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_flush(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_flush", || {
        let pool = pool_from(pool)?;
        let layer = layer_arg(layer)?;
        // SAFETY: NULL-checked descriptor.
        let ids = unsafe { view_from_c(seq_ids, "seq_ids")? };
        pool.flush(layer, &ids, Stream(stream as usize))
    })
}
