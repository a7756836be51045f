//! `kvr_gdn_pool`: replay decoding for Gated DeltaNet layers (checkpoint state + ring of
//! recent inputs, parallel speculative verify, device-side commit, KV-only short contexts).

use std::ffi::c_void;
use std::sync::Arc;

use super::context::{context_from, kvr_context};
use super::guard::{guard, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::kv_pool::{kvr_layer_select, kvr_seq_id, one_layer};
use super::replay;
use super::status::kvr_status;
use super::tensor::{dtype_from_c, kvr_dtype, kvr_tensor, view_from_c, KVR_DTYPE_F32};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::linear::{
    gdn_recurrent, GdnConfig, GdnIo, GdnOptions, GdnPool, HeadMap, L2Norm, RecurrentIo,
    RecurrentOptions, StateLayout, StateStorage,
};

/// A Gated DeltaNet replay pool (opaque). Created by `kvr_gdn_pool_new`, freed by
/// `kvr_gdn_pool_free`.
pub struct kvr_gdn_pool {
    _private: [u8; 0],
}

pub(crate) static GDN_POOLS: Registry<GdnPool> = Registry::new("kvr_gdn_pool");

/// How a state matrix is stored.
pub type kvr_state_layout = i32;
/// `[dk][dv]` per value head, dv contiguous (flash-linear-attention's default).
pub const KVR_STATE_K_MAJOR: kvr_state_layout = 0 as kvr_state_layout;
/// `[dv][dk]` per value head, dk contiguous (llama.cpp, vLLM, FlashInfer).
pub const KVR_STATE_V_MAJOR: kvr_state_layout = 1 as kvr_state_layout;

/// A KV-only threshold in tokens (`kvr_gdn_pool_params.kv_only_threshold`): a count >= 0
/// or `KVR_GDN_THRESHOLD_DEFAULT`.
pub type kvr_gdn_threshold = i32;
/// Picks the default threshold: 0 (off, as `KVR_GDN_THRESHOLD_OFF`) for every pool, replay
/// or recurrent, GDN or Mamba-2; pools planned from GGUF files use 0 too. KV-only mode is
/// an opt-in (an explicit count > 0), from the measured crossover against a pool without
/// it (H200, Qwen3-Next's layer, bf16 entries, ring 16, threshold 127, BENCHMARKS.md): on
/// CUDA such a pool decodes its KV-only rows on their own kernel before the warp-streaming
/// decode, which is faster than a pool without the mode at B = 64 up to about 90 tokens
/// and at B = 8 up to the threshold, but not at B = 1 (0.84-0.85x); and it pays for the
/// mode after the threshold (0.89x / 0.87x / 0.70x at B = 64 / 8 / 1) and in verify (the
/// older kernels). Large batches of short sequences gain from a threshold of about 64.
pub const KVR_GDN_THRESHOLD_DEFAULT: kvr_gdn_threshold = -1 as kvr_gdn_threshold;
/// No KV-only mode: every sequence keeps a state from its first token.
pub const KVR_GDN_THRESHOLD_OFF: kvr_gdn_threshold = 0 as kvr_gdn_threshold;

/// How a sequence of a GDN pool is decoded in one layer (`kvr_gdn_cursor.mode`).
pub type kvr_gdn_mode = i32;
/// No state yet: the output is computed from the buffered entries (short sequences).
pub const KVR_GDN_MODE_KV_ONLY: kvr_gdn_mode = 0 as kvr_gdn_mode;
/// Checkpoint state plus ring.
pub const KVR_GDN_MODE_REPLAY: kvr_gdn_mode = 1 as kvr_gdn_mode;
/// State read and written every step (pools with `ring_len` 0).
pub const KVR_GDN_MODE_RECURRENT: kvr_gdn_mode = 2 as kvr_gdn_mode;

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
    /// Value heads Hv (required, a multiple of Hk). Value head h reads q and k of key head
    /// h / (Hv / Hk): consecutive value heads share a key head, as `repeat_interleave` of q
    /// and k gives (Qwen3-Next); q/k tiled the other way (key head h % Hk) must be
    /// reordered first.
    pub n_v_heads: i32,
    /// Key head dim (required; CUDA: 32, 64, 128 or 256).
    pub dk: i32,
    /// Value head dim (required; CUDA: 32, 64, 128 or 256).
    pub dv: i32,
    /// Ring length L, the inputs kept beside the checkpoint (default 16); 0 = recurrent
    /// mode (state read and written every step, one state snapshot per draft).
    pub ring_len: i32,
    /// KV-only mode for short sequences: a new sequence keeps no state, only its entries,
    /// until its state is materialized (for good) before a decode that would take it past
    /// this many tokens, before a verify of T drafts when its length + 2T exceeds this
    /// (whatever is accepted later: a verify can end KV-only mode at fewer tokens), or by
    /// an import or a flush. `KVR_GDN_THRESHOLD_DEFAULT` (default) and
    /// `KVR_GDN_THRESHOLD_OFF` = 0, off (`KVR_GDN_THRESHOLD_DEFAULT` says why). A count > 0
    /// turns it on (at most the entries one head's state memory holds; min(dk, that) was
    /// the default before); on CUDA such a pool verifies on the older kernels and decodes
    /// with one more launch (on the older kernels too where its head dims, ring or states
    /// do not fit `kvr_gdn_kvdec`); `ring_len` 0 has no KV-only mode: a value > 0 there is
    /// `KVR_STATUS_INVALID_ARG`.
    pub kv_only_threshold: kvr_gdn_threshold,
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
        kv_only_threshold: KVR_GDN_THRESHOLD_DEFAULT,
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

pub(crate) fn config_from(
    p: &kvr_gdn_pool_params,
) -> Result<(GdnConfig, Option<Vec<StateStorage>>)> {
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
    // The default is off for every pool (KVR_GDN_THRESHOLD_DEFAULT's doc says why); only an
    // explicit count turns KV-only mode on.
    cfg.kv_only_threshold = match p.kv_only_threshold {
        KVR_GDN_THRESHOLD_DEFAULT => 0,
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

/// Fills `*params` with the defaults (ring of 16, `KVR_GDN_THRESHOLD_DEFAULT`: no KV-only
/// mode, f32 state and ring, K-major, 256 sequences, no conv window, owned memory); the
/// caller still sets `n_layers`, `n_k_heads`, `n_v_heads`, `dk` and `dv`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
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
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `ctx`, `params` or `out`);
/// `KVR_STATUS_INVALID_ARG` (zero or negative sizes, Hv not a multiple of Hk, ring_len <
/// max_drafts, a KV-only threshold > 0 with ring_len 0, unknown layout or dtype,
/// `struct_size` too small, or larger with a non-zero byte past this library's struct);
/// `KVR_STATUS_OUT_OF_RANGE` (max_drafts > 8, threshold above the KV-only capacity, sizes
/// that overflow);
/// `KVR_STATUS_DTYPE_MISMATCH` (a state, ring or conv dtype other than f32 or bf16);
/// `KVR_STATUS_UNSUPPORTED` (CUDA: head dims outside {32, 64, 128, 256});
/// `KVR_STATUS_OUT_OF_MEMORY`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the caller owns the new pool and frees it with `kvr_gdn_pool_free`; the pool
/// keeps `ctx` alive. `params` and its `states` array are copied; the memory `states`
/// points at stays the caller's and must outlive the pool.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written and nothing is left allocated.
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

/// Frees a pool, every sequence in it and (if the pool allocated them) its states, rings
/// and conv windows. NULL is a no-op. On CUDA, work queued that uses the pool must be
/// complete (CUDA Graphs that contain its launches must not run again): owned memory is
/// released at once.
///
/// Returns: nothing.
/// Ownership: ends the caller's ownership of `pool` and releases its reference to the
/// context; memory given in `kvr_gdn_pool_params.states` stays the caller's.
/// Thread safety: thread-safe; a call already running on another thread keeps the pool
/// alive until it returns, and calls that start later get `KVR_STATUS_INVALID_ARG`.
/// On failure: a handle that is not a live pool (freed already, or of another kind) is
/// ignored and recorded in `kvr_error_last_message`; nothing changes.
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
pub struct kvr_gdn_pool_memory {
    /// `sizeof(kvr_gdn_pool_memory)` as the library wrote it.
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

/// Per-sequence memory of the pool `params` describes, without creating it (for sizing:
/// e.g. "T drafts with snapshots" (`ring_len` 0, `max_drafts` T) against a ring). The
/// configuration is validated as `kvr_gdn_pool_new` would (except backend limits). Set
/// `out->struct_size` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `params` or `out`);
/// `KVR_STATUS_INVALID_ARG` (zero or negative sizes, Hv not a multiple of Hk, ring_len <
/// max_drafts, a KV-only threshold > 0 with ring_len 0, unknown layout or dtype,
/// `struct_size` too small, or larger with a non-zero byte past this library's struct);
/// `KVR_STATUS_OUT_OF_RANGE` (max_drafts > 8, threshold above the KV-only capacity, sizes
/// that overflow);
/// `KVR_STATUS_DTYPE_MISMATCH` (a state, ring or conv dtype other than f32 or bf16);
/// `KVR_STATUS_INVALID_ARG` also for `out->struct_size` too small.
/// Ownership: `params` is read during the call; `*out` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_params_memory(
    params: *const kvr_gdn_pool_params,
    out: *mut kvr_gdn_pool_memory,
) -> kvr_status {
    guard("kvr_gdn_pool_params_memory", || {
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
                replay::memory_to_c(cfg.memory(), cfg.kv_only_threshold),
                size_of::<kvr_gdn_pool_memory>(),
                "kvr_gdn_pool_memory",
            )
        }
    })
}

/// Per-sequence memory of an existing pool, and the KV-only threshold it uses. Set
/// `out->struct_size` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `struct_size` too small).
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_get_memory(
    pool: *const kvr_gdn_pool,
    out: *mut kvr_gdn_pool_memory,
) -> kvr_status {
    guard("kvr_gdn_pool_get_memory", || {
        replay::get_memory(&*pool_from(pool)?, out)
    })
}

/// Adds a sequence (zero state, empty ring, zero conv window; KV-only when the pool has a
/// threshold) and stores its id in `*out_seq`. On CUDA the reset is queued on `stream`
/// (NULL: the context's stream).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_POOL_EXHAUSTED` (every slot in use); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the pool owns the sequence until `kvr_gdn_pool_seq_free` or
/// `kvr_gdn_pool_free`.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `*out_seq` is not written and the pool is unchanged, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_seq_add(
    pool: *mut kvr_gdn_pool,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> kvr_status {
    guard("kvr_gdn_pool_seq_add", || {
        replay::seq_add(&*pool_from(pool)?, stream, out_seq)
    })
}

/// Frees a sequence's slot (in every layer, pending drafts included); the slot is reset
/// when `kvr_gdn_pool_seq_add` reuses it. No device work: `stream` is unused.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID` (not a live sequence).
/// Ownership: the slot returns to the pool.
/// Thread safety: thread-safe; device work already queued for the sequence may still run.
/// On failure: the pool is unchanged.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_seq_free(
    pool: *mut kvr_gdn_pool,
    seq: kvr_seq_id,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_seq_free", || {
        pool_from(pool)?.seq_free(seq, Stream(stream as usize))
    })
}

/// Resets a sequence to the empty state (as just added) in every layer, discarding pending
/// drafts. On CUDA the reset is queued on `stream`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: nothing changes hands.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: the pool is unchanged, except after `KVR_STATUS_CUDA_ERROR`, which can leave
/// queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_seq_reset(
    pool: *mut kvr_gdn_pool,
    seq: kvr_seq_id,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_seq_reset", || {
        pool_from(pool)?.seq_reset(seq, Stream(stream as usize))
    })
}

/// What `kvr_gdn_pool_get_cursor` reports about one (layer, sequence).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_cursor {
    /// `KVR_GDN_MODE_KV_ONLY`, `_REPLAY` or `_RECURRENT`.
    pub mode: kvr_gdn_mode,
    /// Ring position of the oldest buffered entry.
    pub ring_start: i32,
    /// Buffered committed entries (tokens since the checkpoint, or the KV-only length).
    pub buffered: i32,
    /// Verified drafts awaiting commit.
    pub pending: i32,
}

/// Reads a sequence's cursor for `layer` into `*out`. On CUDA this waits for the context's
/// own stream (work queued on another stream must be finished or ordered before it by the
/// caller) and copies from the device: for diagnostics and tests, not the decode loop.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_OUT_OF_RANGE` (layer negative or past the pool's); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_get_cursor(
    pool: *const kvr_gdn_pool,
    layer: i32,
    seq: kvr_seq_id,
    out: *mut kvr_gdn_cursor,
) -> kvr_status {
    guard("kvr_gdn_pool_get_cursor", || {
        replay::get_cursor(&*pool_from(pool)?, layer, seq, out)
    })
}

/// Replaces a sequence's state in `layer` by `state` (the host's prefill result: shape
/// `[Hv, dk, dv]` for K-major pools or `[Hv, dv, dk]` for V-major, any float dtype, any
/// strides, in the context's memory) and, if `conv` is not NULL, its conv window
/// (`[conv_kernel - 1, conv_dim]`, oldest first), both converted to the pool's dtypes
/// (round to nearest even). The ring empties and the sequence leaves KV-only mode. On CUDA
/// the copy is queued on `stream`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL handle or `state`);
/// `KVR_STATUS_INVALID_ARG` (handle, shapes, memory kind, `conv` given to a pool without
/// conv windows, pending drafts in `layer`); `KVR_STATUS_OUT_OF_RANGE` (layer negative or
/// past the pool's); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH` (a tensor that is
/// not f32, f16 or bf16); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `state`, `conv` and `stream` stay the caller's; device memory must stay valid
/// until the queued copy has run.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: the sequence is unchanged, except after `KVR_STATUS_CUDA_ERROR`, which can
/// leave queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_import_state(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    seq: kvr_seq_id,
    state: *const kvr_tensor,
    conv: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_import_state", || {
        replay::import_state(&*pool_from(pool)?, layer, seq, state, conv, stream)
    })
}

/// Writes a sequence's current state in `layer` (materialized from the checkpoint and the
/// ring, or from the KV-only entries) into `out` (shape as for import, any float dtype, in
/// the context's memory) and, if `conv_out` is not NULL, its conv window (converted to the
/// tensors' dtypes, round to nearest even). Neither may hold two elements at one address.
/// A sequence with verified drafts awaiting commit in `layer` has no single current state:
/// commit first. The pool does not change. On CUDA the work is queued on `stream`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, memory kind, overlapping `out` or `conv_out` (a stride of 0), `conv_out` given
/// to a pool without conv windows, pending drafts in `layer`); `KVR_STATUS_OUT_OF_RANGE`
/// (layer negative or past the pool's); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH` (a tensor that is not f32, f16 or bf16);
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `out`, `conv_out` and `stream` stay the caller's.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `out` and `conv_out` are not written (after `KVR_STATUS_CUDA_ERROR`:
/// unspecified).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_export_state(
    pool: *const kvr_gdn_pool,
    layer: i32,
    seq: kvr_seq_id,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_export_state", || {
        replay::export_state(&*pool_from(pool)?, layer, seq, out, conv_out, stream)
    })
}

/// Options of `kvr_gdn_pool_decode` / `kvr_gdn_pool_verify`; fill with
/// `kvr_gdn_step_params_default`.
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
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
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
        let layer = one_layer(layer)?;
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
        let conv_in = replay::optional_view(conv_in, "conv_in")?;
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
/// `seq_ids`: i32 `[B]`, host or device memory (`KVR_SEQ_NONE`: an unused row, output
/// zeros; device ids must be distinct and live, and discard any uncommitted drafts). q, k:
/// `[B, Hk, dk]` (or `[B, 1, Hk, dk]`); v, out: `[B, Hv, dv]`; g (log decay), beta
/// (post-sigmoid): `[B, Hv]`; conv_in (required when the pool keeps conv windows, else
/// NULL): `[B, conv_dim]`. Value head h uses key head h / (Hv / Hk). Float dtypes
/// f32/f16/bf16 (each tensor its own; k, v and the decay are stored in the ring as the
/// pool's `entry_dtype`, round to nearest even); `out` must not hold two elements at one
/// address; on CUDA the last dimension of q, k, v, out must be contiguous. `params` may be
/// NULL for the defaults. A sequence with verified drafts awaiting commit in `layer` is
/// refused (host ids). The output comes from the checkpoint and the ring; the state is
/// written only for sequences whose ring is full (decided on the device) or that leave
/// KV-only mode (see `kvr_gdn_pool_params.kv_only_threshold`).
/// CUDA: queued on `stream`; never synchronizes or allocates, and capturable in a CUDA
/// Graph (host ids travel in the launch parameters, 512 rows per launch).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (a required tensor, or `conv_in` when
/// the pool keeps conv windows); `KVR_STATUS_INVALID_ARG` (handle, shapes, memory kinds,
/// strides, overlapping `out`, a non-finite scale, pending drafts, `conv_in` given to a
/// pool without conv windows, `params->struct_size` too small or larger with a non-zero
/// byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE` (layer negative or past the
/// pool's, batch above max_seqs); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH` (ids
/// not i32, a float tensor of another type); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors, `params` and `stream` stay the caller's; device memory must stay
/// valid until the queued launch has run.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `out` is not written and the pool never changes, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_gdn_pool_decode(
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
        "kvr_gdn_pool_decode",
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
/// drafts stay pending until `kvr_gdn_pool_commit`, and a second verify (or a decode,
/// export or flush) of a sequence in that layer before the commit is refused. A sequence
/// whose ring cannot take 2T more entries flushes first; a KV-only sequence whose length +
/// 2T exceeds the threshold gets its state first (see `kv_only_threshold`).
///
/// Tensors as for `kvr_gdn_pool_decode` with a T dimension: q, k `[B, T, Hk, dk]`; v, out
/// `[B, T, Hv, dv]`; g, beta `[B, T, Hv]`; conv_in `[B, T, conv_dim]`. `seq_ids` must be in
/// host memory. `params` may be NULL for the defaults. CUDA: queued on `stream`, never
/// synchronizes or allocates.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (a required tensor, or `conv_in` when
/// the pool keeps conv windows); `KVR_STATUS_INVALID_ARG` (handle, shapes, memory kinds,
/// strides, overlapping `out`, a non-finite scale, pending drafts, `conv_in` given to a
/// pool without conv windows, `params->struct_size` too small or larger with a non-zero
/// byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE` (layer negative or past the
/// pool's, batch above max_seqs, T outside 1..=max_drafts); `KVR_STATUS_UNSUPPORTED`
/// (`seq_ids` in device memory); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH` (ids
/// not i32, a float tensor of another type); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: as for `kvr_gdn_pool_decode`.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `out` is not written and no draft becomes pending, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_gdn_pool_verify(
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
        "kvr_gdn_pool_verify",
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
/// (`KVR_LAYER_ALL`: every layer, one launch). Accepted drafts stay in the ring where
/// verify put them; the rest vanish; recurrent pools adopt the last accepted draft's
/// snapshot. `accepted` is i32 `[B]` in host memory (checked: 0..=T) or device memory
/// (clamped to 0..=T on the device; the host never waits). `seq_ids` is host i32 `[B]`.
/// With `conv_state` (`[B, conv_kernel - 1, conv_dim]`, any float dtype, no two elements at
/// one address, one layer only), the conv window of each accepted prefix is written there:
/// the conv state the host's next step needs. CUDA: queued on `stream`, never synchronizes
/// or allocates.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle, no
/// verified drafts, shapes (`seq_ids` not 1-D, `accepted` not `[B]`, `conv_state`),
/// overlapping `conv_state`, `conv_state` with `KVR_LAYER_ALL` or for a pool without conv
/// windows, `accepted` in device memory of a CPU pool); `KVR_STATUS_OUT_OF_RANGE` (layer
/// negative other than `KVR_LAYER_ALL` or past the pool's, host counts below 0 or above
/// T); `KVR_STATUS_UNSUPPORTED` (`seq_ids` in device memory); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH` (`seq_ids` or `accepted` not i32, `conv_state` not f32, f16
/// or bf16); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors and `stream` stay the caller's; device memory must stay valid
/// until the queued launch has run.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: the drafts stay pending and nothing is written, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_commit(
    pool: *mut kvr_gdn_pool,
    layer: kvr_layer_select,
    seq_ids: *const kvr_tensor,
    accepted: *const kvr_tensor,
    conv_state: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_commit", || {
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

/// Writes each listed sequence's current state into its checkpoint and empties its ring
/// (before saving a checkpoint or preempting); KV-only sequences get their state
/// materialized. `layer` may be `KVR_LAYER_ALL`; `seq_ids` is host i32 `[B]`. CUDA: queued
/// on `stream`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `seq_ids` not 1-D, pending drafts); `KVR_STATUS_OUT_OF_RANGE` (layer negative other
/// than `KVR_LAYER_ALL` or past the pool's, batch above max_seqs); `KVR_STATUS_UNSUPPORTED`
/// (`seq_ids` in device memory); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH`
/// (`seq_ids` not i32); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `seq_ids` and `stream` stay the caller's.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: the pool is unchanged, except after `KVR_STATUS_CUDA_ERROR`, which can leave
/// queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_flush(
    pool: *mut kvr_gdn_pool,
    layer: kvr_layer_select,
    seq_ids: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_flush", || {
        replay::flush(&*pool_from(pool)?, layer, seq_ids, stream)
    })
}

/// Writes the state every layer of `seq` had `keep` tokens past its checkpoint into `out`
/// (`[n_layers, Hv, dk, dv]` for K-major pools, `[n_layers, Hv, dv, dk]` for V-major; any
/// float dtype and strides, in the context's memory): 0 <= keep <= the tokens the layer
/// buffers since its last flush (`kvr_gdn_cursor.buffered`; KV-only sequences: their
/// length), so an engine can cache a hybrid model's prefix at any token its rings hold.
/// `conv_out` (`[n_layers, conv_kernel - 1, conv_dim]`, or NULL) receives the conv windows,
/// only when `keep` is every layer's full ring fill (the newest token). The pool does not
/// change. The state export of all layers is one launch on `stream`; the call first reads
/// every layer's cursor, so on CUDA it synchronizes with the context's stream and cannot be
/// captured in a CUDA Graph.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL handle or `out`);
/// `KVR_STATUS_INVALID_ARG` (handle, shapes, memory kind, overlapping `out` or `conv_out`,
/// `conv_out` given to a pool without conv windows or with `keep` short of the ring fill,
/// pending drafts in any layer); `KVR_STATUS_OUT_OF_RANGE` (`keep` negative or past a
/// layer's ring fill); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_DTYPE_MISMATCH` (a tensor that
/// is not f32, f16 or bf16); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `out`, `conv_out` and `stream` stay the caller's.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `out` and `conv_out` are not written (after `KVR_STATUS_CUDA_ERROR`:
/// unspecified).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_pool_materialize(
    pool: *const kvr_gdn_pool,
    seq: kvr_seq_id,
    keep: i32,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_gdn_pool_materialize", || {
        replay::materialize(&*pool_from(pool)?, seq, keep, out, conv_out, stream)
    })
}

/// Which key head a value head reads when q and k have fewer heads (Hq) than v (Hv), in
/// `kvr_context_gdn_recurrent` (`kvr_gdn_recurrent_params.head_map`).
pub type kvr_gdn_head_map = i32;
/// Value head h reads key head h / (Hv / Hq): consecutive value heads share a key head
/// (`repeat_interleave`; Qwen3-Next checkpoints and the GDN pools).
pub const KVR_GDN_HEADS_GROUPED: kvr_gdn_head_map = 0 as kvr_gdn_head_map;
/// Value head h reads key head h % Hq (`ggml_repeat`; llama.cpp's broadcast in
/// `ggml_gated_delta_net`).
pub const KVR_GDN_HEADS_TILED: kvr_gdn_head_map = 1 as kvr_gdn_head_map;

/// Options of `kvr_context_gdn_recurrent`; fill with `kvr_gdn_recurrent_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_gdn_recurrent_params {
    /// `sizeof(kvr_gdn_recurrent_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Scale of the output (the same as scaling q); 0 (default) = 1/sqrt(dk).
    pub scale: f32,
    /// 0 (default): q and k as given. `KVR_GDN_L2NORM_MAX_EPS`: L2-normalize them first as
    /// `x / max(sqrt(sum x^2), l2norm_eps)` (ggml's `ggml_l2_norm`). Any other non-zero value
    /// (`KVR_GDN_L2NORM_SUM_EPS`): as `x / sqrt(sum x^2 + l2norm_eps)` (fla's
    /// `use_qk_l2norm_in_kernel`; llama.cpp's GDN models, whose RMS norm with eps / n scaled
    /// by 1 / sqrt(n) is the same).
    pub l2norm_qk: i32,
    /// `KVR_GDN_HEADS_GROUPED` (default) or `KVR_GDN_HEADS_TILED`.
    pub head_map: kvr_gdn_head_map,
    /// First work item this call computes. Item `b * Hv + h` is (sequence b, value head h):
    /// its outputs, snapshots and new state. Default 0.
    pub item_begin: i64,
    /// One past the last work item; -1 (default) = B * Hv. Splitting [0, B * Hv) over
    /// several calls lets an engine run the step from its own worker threads (on a CPU
    /// context of one thread each call runs on its caller alone).
    pub item_end: i64,
    /// Non-zero, CUDA sm_90+: launch with programmatic dependent launch, so the kernel
    /// starts while the previous kernel on the stream finishes (it waits for that kernel
    /// before touching memory). Ignored elsewhere. Default 0.
    pub pdl: i32,
    /// The epsilon of the L2 norm (`l2norm_qk`): finite, >= 0; 0 (default) = 1e-6.
    pub l2norm_eps: f32,
}

/// `kvr_gdn_recurrent_params.l2norm_qk`: `x / sqrt(sum x^2 + eps)` (fla).
pub const KVR_GDN_L2NORM_SUM_EPS: i32 = 1;
/// `kvr_gdn_recurrent_params.l2norm_qk`: `x / max(sqrt(sum x^2), eps)` (`ggml_l2_norm`).
pub const KVR_GDN_L2NORM_MAX_EPS: i32 = 2;

const RECURRENT_PARAMS_V1: usize = size_of::<kvr_gdn_recurrent_params>();

fn default_recurrent_params() -> kvr_gdn_recurrent_params {
    kvr_gdn_recurrent_params {
        struct_size: size_of::<kvr_gdn_recurrent_params>() as u32,
        scale: 0.0,
        l2norm_qk: 0,
        head_map: KVR_GDN_HEADS_GROUPED,
        item_begin: 0,
        item_end: -1,
        pdl: 0,
        l2norm_eps: 0.0,
    }
}

/// Fills `*params` with the defaults (scale 1/sqrt(dk), no L2 norm, grouped heads, every
/// work item, no programmatic dependent launch).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_gdn_recurrent_params_default(
    params: *mut kvr_gdn_recurrent_params,
) -> kvr_status {
    guard("kvr_gdn_recurrent_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL.
        unsafe { params.write(default_recurrent_params()) };
        Ok(())
    })
}

fn recurrent_options(p: &kvr_gdn_recurrent_params) -> Result<RecurrentOptions> {
    let head_map = match p.head_map {
        KVR_GDN_HEADS_GROUPED => HeadMap::Grouped,
        KVR_GDN_HEADS_TILED => HeadMap::Tiled,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown head_map {other} (expected KVR_GDN_HEADS_GROUPED or KVR_GDN_HEADS_TILED)"
            )))
        }
    };
    let items = match (p.item_begin, p.item_end) {
        (0, -1) => None,
        (b, e) if b >= 0 && e >= 0 => Some(b as usize..e as usize),
        (b, -1) if b >= 0 => Some(b as usize..usize::MAX),
        (b, e) => {
            return Err(Error::OutOfRange(format!(
                "items {b}..{e}: item_begin must be >= 0 and item_end >= 0 or -1"
            )))
        }
    };
    if !p.l2norm_eps.is_finite() || p.l2norm_eps < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "l2norm_eps {} must be finite and >= 0",
            p.l2norm_eps
        )));
    }
    let eps = if p.l2norm_eps == 0.0 {
        1e-6
    } else {
        p.l2norm_eps
    };
    Ok(RecurrentOptions {
        scale: if p.scale == 0.0 { None } else { Some(p.scale) },
        l2norm: match p.l2norm_qk {
            0 => None,
            KVR_GDN_L2NORM_MAX_EPS => Some(L2Norm::MaxEps(eps)),
            _ => Some(L2Norm::SumEps(eps)),
        },
        head_map,
        items,
        pdl: p.pdl != 0,
    })
}

/// One Gated DeltaNet recurrence over the caller's tensors, stateless: T tokens for each of
/// B sequences, from `state_in` to `state_out` and/or per-token `snapshots`. Nothing is kept
/// between calls (no pool): the step of engines that own their recurrent states, such as
/// llama.cpp's `GGML_OP_GATED_DELTA_NET`.
///
/// Per (sequence b, value head h) and token t, with S the `dv x dk` state and q, k of key
/// head h / (Hv / Hq) or h % Hq (`head_map`): S <- e^g S; u = beta (v - S k);
/// S <- S + u k^T; out = scale * S q. Tensors (any strides on the CPU): q, k `[B, T, Hq,
/// dk]`; v, out `[B, T, Hv, dv]`; g (log decay), beta `[B, T, Hv]`, each f32, f16 or bf16;
/// `state_in`, `state_out` `[B, Hv, dv, dk]` f32 (V-major: a K-major state is the same memory
/// with the last two strides swapped, CPU only); `snapshots` `[S, B, Hv, dv, dk]` f32, slot s
/// = the state after token T - 1 - s, written for s < min(S, T) (slots past T untouched).
/// `state_out` and `snapshots` may each be NULL, not both. `state_out` may be `state_in`
/// itself (an update in place: same address, shape and strides); otherwise no output may
/// overlap another tensor, nor hold two elements at one address. Only the work items of
/// `params` (default all) are read and written. `params` may be NULL for the defaults.
/// CUDA: dk 32, 64, 128 or 256; the last dimension of q, k and the states contiguous and
/// each of their rows aligned to min(dk / 32 elements, 16 bytes); queued on `stream`
/// (NULL: the context's stream), never synchronizes or allocates: capturable in a CUDA Graph
/// (after `kvr_context_load_kernels`). CPU: runs on the context's threads and returns when
/// done.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `ctx` or a required tensor, both
/// `state_out` and `snapshots` NULL, NULL data of a non-empty tensor);
/// `KVR_STATUS_INVALID_ARG` (dead handle, ranks, shapes, an empty dimension, Hv not a
/// multiple of Hq, memory kind, overlapping outputs, CUDA strides or alignment, unknown
/// `head_map`, a non-finite scale, `params->struct_size` too small or larger with a non-zero
/// byte past this library's struct); `KVR_STATUS_OUT_OF_RANGE` (work items outside
/// [0, B * Hv], a launch too large); `KVR_STATUS_DTYPE_MISMATCH` (a state not f32, an input
/// or `out` not a float type); `KVR_STATUS_UNSUPPORTED` (a dk the CUDA kernel is not built
/// for); `KVR_STATUS_NOT_COMPILED`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: every tensor and `stream` stay the caller's; device memory must stay valid
/// until the queued work has run.
/// Thread safety: thread-safe; calls writing disjoint work items may run at once.
/// On failure: nothing is written, except after `KVR_STATUS_CUDA_ERROR`, which can leave
/// queued device work half done.
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_context_gdn_recurrent(
    ctx: *const kvr_context,
    q: *const kvr_tensor,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    g: *const kvr_tensor,
    beta: *const kvr_tensor,
    state_in: *const kvr_tensor,
    state_out: *const kvr_tensor,
    snapshots: *const kvr_tensor,
    out: *const kvr_tensor,
    params: *const kvr_gdn_recurrent_params,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_context_gdn_recurrent", || {
        let ctx = context_from(ctx)?;
        let p = if params.is_null() {
            default_recurrent_params()
        } else {
            // SAFETY: non-NULL; `struct_size` readable bytes.
            unsafe {
                read_versioned(
                    params,
                    default_recurrent_params(),
                    RECURRENT_PARAMS_V1,
                    "kvr_gdn_recurrent_params",
                )?
            }
        };
        let mut opts = recurrent_options(&p)?;
        // SAFETY: NULL-checked descriptors.
        let (q, k, v, g, beta, state_in, out) = unsafe {
            (
                view_from_c(q, "q")?,
                view_from_c(k, "k")?,
                view_from_c(v, "v")?,
                view_from_c(g, "g")?,
                view_from_c(beta, "beta")?,
                view_from_c(state_in, "state_in")?,
                view_from_c(out, "out")?,
            )
        };
        let state_out = replay::optional_view(state_out, "state_out")?;
        let snapshots = replay::optional_view(snapshots, "snapshots")?;
        if let Some(r) = opts.items.as_mut().filter(|r| r.end == usize::MAX) {
            // item_end -1 with a start: up to B * Hv.
            r.end =
                q.shape().first().copied().unwrap_or(0) * v.shape().get(2).copied().unwrap_or(0);
        }
        let io = RecurrentIo {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            state_in: &state_in,
            state_out: state_out.as_ref(),
            snapshots: snapshots.as_ref(),
            out: &out,
        };
        gdn_recurrent(&ctx, &io, &opts, Stream(stream as usize))
    })
}
