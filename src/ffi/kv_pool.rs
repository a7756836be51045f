//! `kvr_kv_pool`: the paged KV pool and batched decode.

use std::ffi::c_void;

use super::context::{context_from, kvr_context};
use super::guard::{guard, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::status::kvr_status;
use super::tensor::{dtype_from_c, kvr_dtype, kvr_tensor, view_from_c, KVR_DTYPE_F16};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::kv::{
    Admission, DecodeIo, DecodeOptions, KvPool, KvPoolConfig, KvStorage, LayerLayout, SeqId,
};

/// A sequence id of a pool (`kvr_kv_pool`, `kvr_gdn_pool`): >= 0 for a live sequence, or
/// `KVR_SEQ_NONE`.
pub type kvr_seq_id = i32;
/// No sequence: a new one in `kvr_kv_pool_admit`, an unused row in a batch's `seq_ids`.
pub const KVR_SEQ_NONE: kvr_seq_id = -1 as kvr_seq_id;

/// A paged KV pool (opaque). Created by `kvr_kv_pool_new`, freed by `kvr_kv_pool_free`.
pub struct kvr_kv_pool {
    _private: [u8; 0],
}

pub(crate) static POOLS: Registry<KvPool> = Registry::new("kvr_kv_pool");

/// The `layer` argument of calls that can cover every layer at once (`kvr_kv_pool_write`,
/// `kvr_gdn_pool_commit`, `kvr_gdn_pool_flush`): a layer index >= 0, or `KVR_LAYER_ALL`.
/// In these and in every call that takes one layer (`int32_t layer`), any other negative
/// value or an index past the pool's last layer is `KVR_STATUS_OUT_OF_RANGE`.
pub type kvr_layer_select = i32;
/// Every layer of the pool, in one call.
pub const KVR_LAYER_ALL: kvr_layer_select = -1 as kvr_layer_select;

/// One layer's K and V memory for a pool over caller-owned tensors. Element `d` of head `h`
/// at slot `s` of page `p` is at `k + (p * k_stride_page + h * k_stride_head +
/// s * k_stride_token + d) * sizeof(dtype)` (likewise V). Strides are in elements; the head
/// dimension is contiguous. A per-sequence contiguous cache `[ctx][heads][dim]` is
/// `page_size = ctx` with strides `{ctx * heads * dim, dim, heads * dim}`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_kv_layer_layout {
    /// Page 0, head 0, slot 0 of K.
    pub k: *mut c_void,
    /// Page 0, head 0, slot 0 of V.
    pub v: *mut c_void,
    /// K stride between pages (elements).
    pub k_stride_page: i64,
    /// K stride between heads (elements).
    pub k_stride_head: i64,
    /// K stride between tokens of a page (elements).
    pub k_stride_token: i64,
    /// V stride between pages (elements).
    pub v_stride_page: i64,
    /// V stride between heads (elements).
    pub v_stride_head: i64,
    /// V stride between tokens of a page (elements).
    pub v_stride_token: i64,
}

/// Options for `kvr_kv_pool_new`; fill with `kvr_kv_pool_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_kv_pool_params {
    /// `sizeof(kvr_kv_pool_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Attention layers (required, >= 1).
    pub n_layers: i32,
    /// KV heads per layer (required, >= 1).
    pub n_kv_heads: i32,
    /// Elements per head (required, >= 1; CUDA decode: 64, 80, 96, 128 or 256).
    pub head_dim: i32,
    /// Tokens per page, >= 1 (default 16).
    pub page_size: i32,
    /// K/V element type: `KVR_DTYPE_F16` (default), `_BF16` or `_F32` (CPU decode only).
    pub dtype: kvr_dtype,
    /// Capacity in pages; 0 = derive it from `capacity_bytes`. Set exactly one.
    pub capacity_pages: i64,
    /// Capacity as a byte budget for K and V (all layers); used when `capacity_pages` is 0.
    pub capacity_bytes: i64,
    /// Sequence slots (default 256).
    pub max_seqs: i32,
    /// Reserved, 0.
    pub reserved: i32,
    /// Longest sequence in tokens (default 131072); sets the block-table width.
    pub max_seq_len: i64,
    /// NULL (default): the pool allocates its memory (zeroed) in the context's memory.
    /// Otherwise `n_layers` layouts of caller-owned memory in the context's memory (host
    /// for CPU, device for CUDA); the array is copied, the memory must outlive the pool.
    pub layers: *const kvr_kv_layer_layout,
}

const POOL_PARAMS_V1: usize = size_of::<kvr_kv_pool_params>();

pub(crate) fn default_pool_params() -> kvr_kv_pool_params {
    kvr_kv_pool_params {
        struct_size: size_of::<kvr_kv_pool_params>() as u32,
        n_layers: 0,
        n_kv_heads: 0,
        head_dim: 0,
        page_size: 16,
        dtype: KVR_DTYPE_F16,
        capacity_pages: 0,
        capacity_bytes: 0,
        max_seqs: 256,
        reserved: 0,
        max_seq_len: 131072,
        layers: std::ptr::null(),
    }
}

pub(crate) fn positive(name: &str, v: i64) -> Result<usize> {
    if v <= 0 {
        return Err(Error::InvalidArgument(format!(
            "{name} must be >= 1 (got {v})"
        )));
    }
    usize::try_from(v).map_err(|_| Error::OutOfRange(format!("{name} = {v} is too large")))
}

fn pool_from(p: *const kvr_kv_pool) -> Result<std::sync::Arc<KvPool>> {
    POOLS.get(p as usize)
}

/// Fills `*params` with the defaults (page size 16, f16, 256 sequences, 131072 tokens,
/// owned memory); the caller still sets `n_layers`, `n_kv_heads`, `head_dim` and a
/// capacity.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_params_default(params: *mut kvr_kv_pool_params) -> kvr_status {
    guard("kvr_kv_pool_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL, writable.
        unsafe { params.write(default_pool_params()) };
        Ok(())
    })
}

pub(crate) fn config_from(p: &kvr_kv_pool_params) -> Result<(KvPoolConfig, KvStorage)> {
    let dtype = dtype_from_c(p.dtype)?;
    let mut cfg = KvPoolConfig {
        layers: positive("n_layers", p.n_layers as i64)?,
        kv_heads: positive("n_kv_heads", p.n_kv_heads as i64)?,
        head_dim: positive("head_dim", p.head_dim as i64)?,
        page_size: positive("page_size", p.page_size as i64)?,
        dtype,
        capacity_pages: 0,
        max_seqs: positive("max_seqs", p.max_seqs as i64)?,
        max_seq_len: positive("max_seq_len", p.max_seq_len)?,
    };
    cfg.capacity_pages = match (p.capacity_pages, p.capacity_bytes) {
        (0, 0) => {
            return Err(Error::InvalidArgument(
                "set capacity_pages or capacity_bytes".into(),
            ))
        }
        (n, 0) => positive("capacity_pages", n)?,
        (0, b) => {
            let bytes = positive("capacity_bytes", b)?;
            let pages = cfg.pages_for_budget(bytes);
            if pages == 0 {
                return Err(Error::OutOfRange(format!(
                    "capacity_bytes {bytes} is smaller than one page ({} bytes)",
                    cfg.page_bytes()
                )));
            }
            pages
        }
        _ => {
            return Err(Error::InvalidArgument(
                "set only one of capacity_pages and capacity_bytes".into(),
            ))
        }
    };
    let storage = if p.layers.is_null() {
        KvStorage::Owned
    } else {
        let mut v = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            // SAFETY: the caller passes `n_layers` readable layouts.
            let c = unsafe { p.layers.add(l).read() };
            let st = |name: &str, x: i64| -> Result<usize> {
                usize::try_from(x).map_err(|_| {
                    Error::InvalidArgument(format!("layer {l}: {name} {x} is negative"))
                })
            };
            v.push(LayerLayout {
                k: c.k as usize,
                v: c.v as usize,
                k_strides: [
                    st("k_stride_page", c.k_stride_page)?,
                    st("k_stride_head", c.k_stride_head)?,
                    st("k_stride_token", c.k_stride_token)?,
                ],
                v_strides: [
                    st("v_stride_page", c.v_stride_page)?,
                    st("v_stride_head", c.v_stride_head)?,
                    st("v_stride_token", c.v_stride_token)?,
                ],
            });
        }
        KvStorage::External(v)
    };
    Ok((cfg, storage))
}

/// Creates a pool on `ctx` and stores it in `*out`. Owned memory is allocated zeroed in the
/// context's memory (synchronously: setup time only).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `ctx`, `params` or `out`, or a
/// NULL pointer in `layers`); `KVR_STATUS_INVALID_ARG` (a size < 1, unknown dtype, both or
/// neither capacity set, `struct_size` too small or larger with a non-zero byte past this
/// library's struct, overlapping or misaligned external strides, not a live context);
/// `KVR_STATUS_DTYPE_MISMATCH` (i32 KV);
/// `KVR_STATUS_OUT_OF_RANGE` (sizes past the 32-bit device indices, a budget smaller than a
/// page); `KVR_STATUS_OUT_OF_MEMORY`; `KVR_STATUS_UNSUPPORTED` (CUDA shared memory too
/// small); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the caller owns the new pool and frees it with `kvr_kv_pool_free`; the pool
/// keeps `ctx` alive. `params` and its `layers` array are copied; the memory `layers`
/// points at stays the caller's and must outlive the pool.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written and nothing is left allocated.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_new(
    ctx: *const kvr_context,
    params: *const kvr_kv_pool_params,
    out: *mut *mut kvr_kv_pool,
) -> kvr_status {
    guard("kvr_kv_pool_new", || {
        let ctx = context_from(ctx)?;
        non_null(params, "params")?;
        non_null(out, "out")?;
        // SAFETY: non-NULL; `struct_size` readable bytes.
        let p = unsafe {
            read_versioned(
                params,
                default_pool_params(),
                POOL_PARAMS_V1,
                "kvr_kv_pool_params",
            )?
        };
        let (cfg, storage) = config_from(&p)?;
        let pool = KvPool::new(ctx, cfg, storage)?;
        let h = POOLS.insert(pool);
        // SAFETY: non-NULL.
        unsafe { out.write(h as *mut kvr_kv_pool) };
        Ok(())
    })
}

/// Frees a pool, every sequence in it and (if the pool allocated it) its memory. NULL is a
/// no-op. On CUDA, work queued that uses the pool must be complete (CUDA Graphs that
/// contain its launches must not run again): owned memory is released at once.
///
/// Returns: nothing.
/// Ownership: ends the caller's ownership of `pool` and releases its reference to the
/// context; memory given in `kvr_kv_pool_params.layers` stays the caller's.
/// Thread safety: thread-safe; a call already running on another thread keeps the pool
/// alive until it returns, and calls that start later get `KVR_STATUS_INVALID_ARG`.
/// On failure: a handle that is not a live pool (freed already, or of another kind) is
/// ignored and recorded in `kvr_error_last_message`; nothing changes.
#[no_mangle]
pub extern "C" fn kvr_kv_pool_free(pool: *mut kvr_kv_pool) {
    if pool.is_null() {
        return;
    }
    let _ = guard("kvr_kv_pool_free", || POOLS.remove(pool as usize).map(drop));
}

/// Adds an empty sequence (the lowest free id) and stores its id in `*out_seq`. Device
/// tables are patched on `stream` (NULL: the context's stream).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (dead handle);
/// `KVR_STATUS_POOL_EXHAUSTED` (all `max_seqs` ids in use); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the pool owns the sequence until `kvr_kv_pool_seq_free` or
/// `kvr_kv_pool_free`.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `*out_seq` is not written and the pool is unchanged, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_seq_add(
    pool: *mut kvr_kv_pool,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> kvr_status {
    guard("kvr_kv_pool_seq_add", || {
        let pool = pool_from(pool)?;
        non_null(out_seq, "out_seq")?;
        let id = pool.seq_add(Stream(stream as usize))?;
        // SAFETY: non-NULL.
        unsafe { out_seq.write(id) };
        Ok(())
    })
}

/// Frees sequence `seq`, releasing its pages (shared pages stay with their other owners).
/// Its id becomes free for `kvr_kv_pool_seq_add`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID` (not a live sequence); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the sequence's pages return to the pool.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: the pool is unchanged, except after `KVR_STATUS_CUDA_ERROR`, which can leave
/// queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_seq_free(
    pool: *mut kvr_kv_pool,
    seq: kvr_seq_id,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_kv_pool_seq_free", || {
        pool_from(pool)?.seq_free(seq, Stream(stream as usize))
    })
}

/// Creates a sequence sharing all of `src`'s pages (no copy; reference counts) and stores
/// its id in `*out_seq`. A later append into a shared, partly filled last page copies that
/// page first (copy-on-write), on either side.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_POOL_EXHAUSTED` (no free id);
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the pool owns the new sequence; free it with `kvr_kv_pool_seq_free`.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: `*out_seq` is not written and the pool is unchanged, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_seq_fork(
    pool: *mut kvr_kv_pool,
    src: kvr_seq_id,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> kvr_status {
    guard("kvr_kv_pool_seq_fork", || {
        let pool = pool_from(pool)?;
        non_null(out_seq, "out_seq")?;
        let id = pool.seq_fork(src, Stream(stream as usize))?;
        // SAFETY: non-NULL.
        unsafe { out_seq.write(id) };
        Ok(())
    })
}

/// Shortens `seq` to `len` tokens (rejecting speculative tokens), releasing whole pages
/// past the new end.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (`len` negative or past the current
/// length); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: released pages return to the pool.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: the pool is unchanged, except after `KVR_STATUS_CUDA_ERROR`, which can leave
/// queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_seq_truncate(
    pool: *mut kvr_kv_pool,
    seq: kvr_seq_id,
    len: i64,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_kv_pool_seq_truncate", || {
        let pool = pool_from(pool)?;
        let len = usize::try_from(len)
            .map_err(|_| Error::OutOfRange(format!("length {len} is negative")))?;
        pool.seq_truncate(seq, len, Stream(stream as usize))
    })
}

/// Stores the length of `seq` in `*out_len`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`.
/// Ownership: `*out_len` is the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out_len` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_get_seq_len(
    pool: *const kvr_kv_pool,
    seq: kvr_seq_id,
    out_len: *mut i64,
) -> kvr_status {
    guard("kvr_kv_pool_get_seq_len", || {
        let pool = pool_from(pool)?;
        non_null(out_len, "out_len")?;
        let n = pool.seq_len(seq)? as i64;
        // SAFETY: non-NULL.
        unsafe { out_len.write(n) };
        Ok(())
    })
}

/// Copies `seq`'s block table (page ids in token order) into `pages` (room for `capacity`
/// entries; may be NULL when `capacity` is 0) and stores the number of pages in
/// `*out_count`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (more pages than `capacity`).
/// Ownership: `pages` and `*out_count` are the caller's.
/// Thread safety: thread-safe.
/// On failure: nothing is written, except that `KVR_STATUS_OUT_OF_RANGE` stores the page
/// count in `*out_count` (the room to make) and copies nothing.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_get_seq_pages(
    pool: *const kvr_kv_pool,
    seq: kvr_seq_id,
    pages: *mut i32,
    capacity: i64,
    out_count: *mut i64,
) -> kvr_status {
    guard("kvr_kv_pool_get_seq_pages", || {
        let pool = pool_from(pool)?;
        non_null(out_count, "out_count")?;
        let table = pool.seq_pages(seq)?;
        if (table.len() as i64) > capacity.max(0) {
            // SAFETY: non-NULL. The count is the documented exception to "outputs only on
            // success": it tells the caller how much room to make.
            unsafe { out_count.write(table.len() as i64) };
            return Err(Error::OutOfRange(format!(
                "sequence {seq} has {} pages; the buffer holds {capacity}",
                table.len()
            )));
        }
        if !table.is_empty() {
            non_null(pages, "pages")?;
        }
        for (i, &p) in table.iter().enumerate() {
            // SAFETY: `capacity` >= len writable entries.
            unsafe { pages.add(i).write(p as i32) };
        }
        // SAFETY: non-NULL.
        unsafe { out_count.write(table.len() as i64) };
        Ok(())
    })
}

/// Reads `n` (sequence, count) pairs from two C arrays.
fn groups_from(seqs: *const kvr_seq_id, counts: *const i32, n: i32) -> Result<Vec<(SeqId, usize)>> {
    if n < 0 {
        return Err(Error::InvalidArgument(format!("n = {n} is negative")));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    non_null(seqs, "seqs")?;
    non_null(counts, "counts")?;
    (0..n as usize)
        .map(|i| {
            // SAFETY: the caller passes `n` readable entries in each array.
            let (s, c) = unsafe { (seqs.add(i).read(), counts.add(i).read()) };
            if c < 0 {
                return Err(Error::InvalidArgument(format!(
                    "counts[{i}] = {c} is negative"
                )));
            }
            Ok((s, c as usize))
        })
        .collect()
}

/// Reserves `counts[i]` more positions in sequence `seqs[i]` for each of the `n` entries,
/// allocating pages (and copying a shared, partly filled last page first). The lengths grow
/// at once; fill the new positions with `kvr_kv_pool_write` (per layer or all layers)
/// before decoding over them. Device work is queued on `stream`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL arrays with n > 0);
/// `KVR_STATUS_INVALID_ARG` (handle, negative count, a sequence listed twice);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (past `max_seq_len`);
/// `KVR_STATUS_POOL_EXHAUSTED` (not enough free pages); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `seqs` and `counts` are read during the call only.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: all or nothing: no sequence grows, except after `KVR_STATUS_CUDA_ERROR`,
/// which can leave queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_extend(
    pool: *mut kvr_kv_pool,
    seqs: *const kvr_seq_id,
    counts: *const i32,
    n: i32,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_kv_pool_extend", || {
        let pool = pool_from(pool)?;
        let groups = groups_from(seqs, counts, n)?;
        pool.extend(&groups, Stream(stream as usize))
    })
}

/// Writes K and V into the last `counts[i]` positions of each sequence `seqs[i]`: for one
/// layer (`layer` >= 0, `k`/`v` shaped `[tokens, n_kv_heads, head_dim]`) or all layers
/// (`layer = KVR_LAYER_ALL`, `[n_layers, tokens, n_kv_heads, head_dim]`), where tokens are
/// the sequences' new tokens in list order (`tokens = sum(counts)`). `k` and `v` may be in
/// host memory or (CUDA) device memory, any float dtype (converted to the pool's, round to
/// nearest even) and any strides. The positions must not be in a page shared with another
/// sequence (extend first). CUDA: the copy is queued on `stream`; K/V in host memory are
/// first copied into stream-ordered device memory (`cuMemAllocAsync`, freed on `stream`
/// after the copy) and read before the call returns, so that form allocates and cannot be
/// captured in a CUDA Graph (pass device memory there).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, negative `n` or count, a sequence listed twice, shared page, CUDA memory in a
/// CPU pool); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (layer negative other than
/// `KVR_LAYER_ALL` or past the pool's, count past a length, more sequences than one write
/// takes); `KVR_STATUS_DTYPE_MISMATCH` (K/V not f32, f16 or bf16);
/// `KVR_STATUS_OUT_OF_MEMORY` / `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `k`, `v`, `seqs`, `counts` and `stream` stay the caller's; device-memory
/// `k`/`v` must stay valid until the queued copy has run.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: nothing is written, except after `KVR_STATUS_CUDA_ERROR`, which can leave
/// queued device work half done (free the objects the call used).
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_kv_pool_write(
    pool: *mut kvr_kv_pool,
    layer: kvr_layer_select,
    seqs: *const kvr_seq_id,
    counts: *const i32,
    n: i32,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_kv_pool_write", || {
        let pool = pool_from(pool)?;
        let groups = groups_from(seqs, counts, n)?;
        let layer = layer_arg(layer, true)?;
        // SAFETY: NULL-checked descriptors.
        let (k, v) = unsafe { (view_from_c(k, "k")?, view_from_c(v, "v")?) };
        pool.write(layer, &groups, &k, &v, Stream(stream as usize))
    })
}

/// A `layer` argument: an index (checked against the pool later) or, where `all_allowed`,
/// `KVR_LAYER_ALL` (None). Any other negative value is a layer outside the pool:
/// `OutOfRange`, like an index past the pool's layers, in every pool call.
pub(crate) fn layer_arg(layer: kvr_layer_select, all_allowed: bool) -> Result<Option<usize>> {
    match layer {
        KVR_LAYER_ALL if all_allowed => Ok(None),
        l if l >= 0 => Ok(Some(l as usize)),
        KVR_LAYER_ALL => Err(Error::OutOfRange(
            "layer -1 (KVR_LAYER_ALL) is not accepted here: this call takes one layer".into(),
        )),
        l => Err(Error::OutOfRange(format!(
            "layer {l} is negative (outside the pool)"
        ))),
    }
}

/// A `layer` argument of a call that takes one layer.
pub(crate) fn one_layer(layer: i32) -> Result<usize> {
    Ok(layer_arg(layer, false)?.expect("one layer"))
}

/// Appends tokens to `seq` for all layers: `k`/`v` shaped `[n_layers, n, n_kv_heads,
/// head_dim]` (n new tokens; host or device memory, any float dtype, converted to the
/// pool's with round to nearest even, and any strides). Equal to `kvr_kv_pool_extend` by n
/// plus `kvr_kv_pool_write` of all layers (host K/V allocate as there).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, CUDA memory in a CPU pool); `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE`
/// (past `max_seq_len`); `KVR_STATUS_DTYPE_MISMATCH` (K/V not f32, f16 or bf16);
/// `KVR_STATUS_POOL_EXHAUSTED`; `KVR_STATUS_OUT_OF_MEMORY` / `KVR_STATUS_CUDA_ERROR`.
/// Ownership: as for `kvr_kv_pool_write`.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events).
/// On failure: all or nothing: the sequence does not grow, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_append(
    pool: *mut kvr_kv_pool,
    seq: kvr_seq_id,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_kv_pool_append", || {
        let pool = pool_from(pool)?;
        // SAFETY: NULL-checked descriptors.
        let (k, v) = unsafe { (view_from_c(k, "k")?, view_from_c(v, "v")?) };
        pool.append(seq, &k, &v, Stream(stream as usize))
    })
}

/// Admission verdict of `kvr_kv_pool_admit`.
pub type kvr_admission = i32;
/// Fits now.
pub const KVR_ADMIT_OK: kvr_admission = 0 as kvr_admission;
/// Does not fit now, would in a pool with enough pages / ids free.
pub const KVR_ADMIT_LATER: kvr_admission = 1 as kvr_admission;
/// Can never fit: longer than `max_seq_len` or more pages than the pool has.
pub const KVR_ADMIT_NEVER: kvr_admission = 2 as kvr_admission;

/// Says whether a new sequence of `n_tokens` (`seq = KVR_SEQ_NONE`) or growing `seq` by
/// `n_tokens` fits: `KVR_ADMIT_OK`, `KVR_ADMIT_LATER` (not enough free pages or ids now) or
/// `KVR_ADMIT_NEVER`, stored in `*out`. Changes nothing.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// negative `n_tokens`); `KVR_STATUS_UNKNOWN_ID`.
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe; the verdict can change as soon as another thread changes the
/// pool.
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_admit(
    pool: *const kvr_kv_pool,
    seq: kvr_seq_id,
    n_tokens: i64,
    out: *mut kvr_admission,
) -> kvr_status {
    guard("kvr_kv_pool_admit", || {
        let pool = pool_from(pool)?;
        non_null(out, "out")?;
        let n = usize::try_from(n_tokens)
            .map_err(|_| Error::InvalidArgument(format!("n_tokens {n_tokens} is negative")))?;
        let a = pool.admit(if seq == KVR_SEQ_NONE { None } else { Some(seq) }, n)?;
        let v = match a {
            Admission::Ok => KVR_ADMIT_OK,
            Admission::Later => KVR_ADMIT_LATER,
            Admission::Never => KVR_ADMIT_NEVER,
        };
        // SAFETY: non-NULL.
        unsafe { out.write(v) };
        Ok(())
    })
}

/// Pool occupancy, filled by `kvr_kv_pool_get_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_kv_pool_stats {
    /// Set to `sizeof(kvr_kv_pool_stats)` before the call.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Pages in the pool.
    pub pages_total: i64,
    /// Pages referenced by a sequence.
    pub pages_used: i64,
    /// Pages free.
    pub pages_free: i64,
    /// Pages referenced by more than one sequence.
    pub pages_shared: i64,
    /// Live sequences.
    pub sequences: i64,
    /// Sum of sequence lengths (shared tokens count once per sequence).
    pub tokens: i64,
    /// Slots of used pages holding no token of any sequence (internal fragmentation).
    pub waste_slots: i64,
    /// Bytes of K and V per page, all layers.
    pub page_bytes: i64,
}

/// Fills `*out` with the pool's occupancy. Set `out->struct_size` first.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `struct_size` too small).
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe (a consistent snapshot under the pool's lock).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_pool_get_stats(
    pool: *const kvr_kv_pool,
    out: *mut kvr_kv_pool_stats,
) -> kvr_status {
    guard("kvr_kv_pool_get_stats", || {
        let pool = pool_from(pool)?;
        non_null(out, "out")?;
        let s = pool.stats();
        let c = kvr_kv_pool_stats {
            struct_size: size_of::<kvr_kv_pool_stats>() as u32,
            reserved: 0,
            pages_total: s.pages_total as i64,
            pages_used: s.pages_used as i64,
            pages_free: s.pages_free as i64,
            pages_shared: s.pages_shared as i64,
            sequences: s.sequences as i64,
            tokens: s.tokens as i64,
            waste_slots: s.waste_slots as i64,
            page_bytes: s.page_bytes as i64,
        };
        // SAFETY: non-NULL, `struct_size` writable bytes.
        unsafe { write_versioned(out, c, size_of::<kvr_kv_pool_stats>(), "kvr_kv_pool_stats") }
    })
}

/// Options for `kvr_kv_pool_decode`; fill with `kvr_kv_decode_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_kv_decode_params {
    /// `sizeof(kvr_kv_decode_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Softmax scale; 0 (default) = 1 / sqrt(head_dim).
    pub scale: f32,
    /// Logit softcap c (scores become c * tanh(scores / c)); 0 (default) = off.
    pub softcap: f32,
    /// Sliding window in tokens (a query at position p sees p - window + 1 ..= p);
    /// 0 (default) = the whole sequence.
    pub window: i32,
    /// CUDA: upper bound on CTAs (0 = one full wave); a fixed value makes the split, and so
    /// the rounding, the same from call to call.
    pub max_ctas: i32,
}

const DECODE_PARAMS_V1: usize = size_of::<kvr_kv_decode_params>();

fn default_decode_params() -> kvr_kv_decode_params {
    kvr_kv_decode_params {
        struct_size: size_of::<kvr_kv_decode_params>() as u32,
        scale: 0.0,
        softcap: 0.0,
        window: 0,
        max_ctas: 0,
    }
}

/// Fills `*params` with the defaults (scale 1/sqrt(d), no softcap, no window, CTAs for one
/// full wave).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_kv_decode_params_default(params: *mut kvr_kv_decode_params) -> kvr_status {
    guard("kvr_kv_decode_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL.
        unsafe { params.write(default_decode_params()) };
        Ok(())
    })
}

/// Attention for a batch of sequences in one launch: `q` `[B, Hq, head_dim]` (one query
/// token per sequence) or `[B, T, Hq, head_dim]` (T = 1..8 query tokens: the last T tokens
/// of each sequence, causal among themselves, for speculative verification) against the K/V
/// of `layer`, written to `out` (same shape as `q`) and, if `lse` is not NULL, the
/// log-sum-exp of the scaled scores (natural log, f32 `[B, Hq]` / `[B, T, Hq]`). `seq_ids`
/// is an i32 `[B]` tensor of sequence ids (`KVR_SEQ_NONE`: an unused row, which gets
/// zeros). Hq must be a multiple of the pool's KV heads, at most 16 per KV head (GQA, MQA,
/// MHA). q/out: f32, f16 or bf16 (converted); the pool's K/V: f16 or bf16 on CUDA (f32 too
/// on the CPU). `params` may be NULL for the defaults.
///
/// CUDA: queued on `stream`; never synchronizes or allocates. The split across the GPU is
/// computed on the device from the lengths in device memory, so a decode captured in a CUDA
/// Graph stays correct while sequences grow. With `seq_ids` in host memory and B <= 512 the
/// ids travel in the launch parameters (a captured graph keeps that batch); more host ids
/// are copied into a buffer of the pool (`cuMemcpyHtoDAsync` from pageable memory: not
/// capturable); with `seq_ids` in device memory the kernel reads them (the batch may change
/// between replays).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, memory kinds, strides, overlapping `out` or `lse`, an id listed twice, negative
/// `window` or `max_ctas`, a scale or softcap out of range, `params->struct_size` too small
/// or larger with a non-zero byte past this library's struct); `KVR_STATUS_DTYPE_MISMATCH`
/// (ids not i32, q/out not f32, f16 or bf16, lse not f32); `KVR_STATUS_UNKNOWN_ID` (an id
/// in host `seq_ids` that is not live); `KVR_STATUS_OUT_OF_RANGE` (layer negative or past
/// the pool's, T > 8, group > 16, a sequence shorter than T, B > max_seqs);
/// `KVR_STATUS_UNSUPPORTED` (f32 KV or a head dim without a kernel on CUDA);
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors, `params` and `stream` stay the caller's; device memory must stay
/// valid until the queued launch has run.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work of
/// calls on one pool must be ordered by the caller (one stream, or events). Decodes and
/// pool updates of one pool must be ordered on one stream.
/// On failure: `out` and `lse` are not written and the pool never changes, except after
/// `KVR_STATUS_CUDA_ERROR`, which can leave queued device work half done (free the objects
/// the call used).
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_kv_pool_decode(
    pool: *mut kvr_kv_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    q: *const kvr_tensor,
    out: *const kvr_tensor,
    lse: *const kvr_tensor,
    params: *const kvr_kv_decode_params,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_kv_pool_decode", || {
        let pool = pool_from(pool)?;
        let layer = one_layer(layer)?;
        let opts = decode_options_from(params)?;
        // SAFETY: NULL-checked descriptors.
        let (ids, q, out) = unsafe {
            (
                view_from_c(seq_ids, "seq_ids")?,
                view_from_c(q, "q")?,
                view_from_c(out, "out")?,
            )
        };
        let lse = if lse.is_null() {
            None
        } else {
            // SAFETY: non-NULL descriptor.
            Some(unsafe { view_from_c(lse, "lse")? })
        };
        let io = DecodeIo {
            seq_ids: &ids,
            q: &q,
            out: &out,
            lse: lse.as_ref(),
        };
        pool.decode(layer, &io, &opts, Stream(stream as usize))
    })
}

/// Reads optional decode parameters (NULL: defaults) into core options.
pub(crate) fn decode_options_from(params: *const kvr_kv_decode_params) -> Result<DecodeOptions> {
    let p = if params.is_null() {
        default_decode_params()
    } else {
        // SAFETY: non-NULL; `struct_size` readable bytes.
        unsafe {
            read_versioned(
                params,
                default_decode_params(),
                DECODE_PARAMS_V1,
                "kvr_kv_decode_params",
            )?
        }
    };
    if p.window < 0 || p.max_ctas < 0 {
        return Err(Error::InvalidArgument(format!(
            "window ({}) and max_ctas ({}) must be >= 0",
            p.window, p.max_ctas
        )));
    }
    let opts = DecodeOptions {
        scale: if p.scale == 0.0 { None } else { Some(p.scale) },
        softcap: p.softcap,
        window: p.window as usize,
        max_ctas: p.max_ctas as usize,
    };
    Ok(opts)
}
