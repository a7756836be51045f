//! `kvr_wgkv_pool`: the paged KV pool in write-gated mode (WG-KV admission: a local ring
//! per (sequence, layer, KV head) plus a global cache of the tokens the gate admits).

use std::ffi::{c_char, c_void, CStr};

use super::context::{context_from, kvr_context};
use super::guard::{guard, non_null, read_versioned, write_versioned};
use super::handles::Registry;
use super::kv_pool::{
    config_from, default_pool_params, kvr_kv_decode_params, kvr_kv_pool_params, kvr_layer_select,
    kvr_seq_id, layer_arg, one_layer, positive,
};
use super::status::kvr_status;
use super::tensor::{kvr_tensor, view_from_c};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv::wgkv::{GateWeights, WgKvConfig, WgKvPool, WgStep};
use crate::kv::{DecodeIo, KvStorage};
use crate::tensor::{DType, MemoryKind, TensorView};

/// A paged KV pool in write-gated mode (opaque). Created by `kvr_wgkv_pool_new`, freed by
/// `kvr_wgkv_pool_free`.
pub struct kvr_wgkv_pool {
    _private: [u8; 0],
}

static WG_POOLS: Registry<WgKvPool> = Registry::new("kvr_wgkv_pool");

fn pool_from(p: *const kvr_wgkv_pool) -> Result<std::sync::Arc<WgKvPool>> {
    WG_POOLS.get(p as usize)
}

/// Admission options of `kvr_wgkv_pool_new`; fill with `kvr_wgkv_params_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_wgkv_params {
    /// `sizeof(kvr_wgkv_params)` as the caller compiled it.
    pub struct_size: u32,
    /// Ring size W per (sequence, layer, KV head): a multiple of the page size, >= 8 and
    /// <= 2^19 (default 256).
    pub local_window: i32,
    /// Promotion threshold: a token leaving the ring is kept if its score is > tau (strict;
    /// default 0.1), 0 <= tau < 1.
    pub tau: f32,
    /// The first `sinks` tokens of each sequence are always kept (default 0).
    pub sinks: i32,
    /// Hidden size of the gate MLP: 0 (default) = whatever the weights have; otherwise
    /// `kvr_wgkv_pool_set_gate` / `_load_gate` refuse other sizes.
    pub gate_hidden: i32,
    /// Reserved, 0.
    pub reserved: i32,
    /// Most tokens the global cache of one (sequence, layer, head) holds; 0 (default) =
    /// the pool's `max_seq_len`. Sets the block-table width (host and device memory:
    /// `max_seqs * n_layers * n_kv_heads * (local_window + max_global_tokens + 8) /
    /// page_size * 4` bytes).
    pub max_global_tokens: i64,
}

const WG_PARAMS_V1: usize = size_of::<kvr_wgkv_params>();

fn default_wg_params() -> kvr_wgkv_params {
    kvr_wgkv_params {
        struct_size: size_of::<kvr_wgkv_params>() as u32,
        local_window: 256,
        tau: 0.1,
        sinks: 0,
        gate_hidden: 0,
        reserved: 0,
        max_global_tokens: 0,
    }
}

/// Fills `*params` with the defaults (ring 256, tau 0.1, no sinks, gate size from the
/// weights, global cache up to the pool's `max_seq_len`).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`params` is NULL).
/// Ownership: `*params` is the caller's; nothing is kept.
/// Thread safety: thread-safe.
/// On failure: nothing is written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_params_default(params: *mut kvr_wgkv_params) -> kvr_status {
    guard("kvr_wgkv_params_default", || {
        non_null(params, "params")?;
        // SAFETY: non-NULL, writable.
        unsafe { params.write(default_wg_params()) };
        Ok(())
    })
}

/// The pool's gate-size requirement (0 = any), kept next to the registry entry.
static GATE_HIDDEN: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

fn required_hidden(handle: usize) -> usize {
    GATE_HIDDEN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|e| e.0 == handle)
        .map_or(0, |e| e.1)
}

/// The pool configuration of `kvr_wgkv_pool_new`'s arguments (`kv` non-NULL), and the
/// write-gated parameters read. `sizing`: a capacity may be left unset (0 and 0).
fn wg_config(
    kv: *const kvr_kv_pool_params,
    wg: *const kvr_wgkv_params,
    sizing: bool,
) -> Result<(WgKvConfig, kvr_wgkv_params)> {
    // SAFETY: non-NULL; `struct_size` readable bytes.
    let mut p = unsafe {
        read_versioned(
            kv,
            default_pool_params(),
            size_of::<kvr_kv_pool_params>(),
            "kvr_kv_pool_params",
        )?
    };
    let w = if wg.is_null() {
        default_wg_params()
    } else {
        // SAFETY: non-NULL; `struct_size` readable bytes.
        unsafe { read_versioned(wg, default_wg_params(), WG_PARAMS_V1, "kvr_wgkv_params")? }
    };
    if !p.layers.is_null() {
        return Err(Error::Unsupported(
            "a write-gated pool owns its memory; kv->layers must be NULL".into(),
        ));
    }
    if sizing && p.capacity_pages == 0 && p.capacity_bytes == 0 {
        p.capacity_pages = 1;
    }
    // Capacity in write-gated pages (one layer, one head).
    let bytes = p.capacity_bytes;
    if p.capacity_pages == 0 && bytes > 0 {
        p.capacity_pages = 1;
        p.capacity_bytes = 0;
    }
    let (kc, storage) = config_from(&p)?;
    debug_assert_eq!(storage, KvStorage::Owned);
    for (name, v) in [
        ("sinks", w.sinks as i64),
        ("gate_hidden", w.gate_hidden as i64),
        ("max_global_tokens", w.max_global_tokens),
    ] {
        if v < 0 {
            return Err(Error::InvalidArgument(format!("{name} = {v} is negative")));
        }
    }
    let mut cfg = WgKvConfig {
        layers: kc.layers,
        kv_heads: kc.kv_heads,
        head_dim: kc.head_dim,
        page_size: kc.page_size,
        dtype: kc.dtype,
        capacity_pages: kc.capacity_pages,
        max_seqs: kc.max_seqs,
        max_global_tokens: if w.max_global_tokens == 0 {
            kc.max_seq_len
        } else {
            w.max_global_tokens as usize
        },
        local_window: positive("local_window", w.local_window as i64)?,
        tau: w.tau,
        sinks: w.sinks as usize,
    };
    if p.capacity_pages == 1 && bytes > 0 {
        let bytes = bytes as usize;
        cfg.capacity_pages = bytes / cfg.page_bytes();
        if cfg.capacity_pages == 0 {
            return Err(Error::OutOfRange(format!(
                "capacity_bytes {bytes} is smaller than one page ({} bytes)",
                cfg.page_bytes()
            )));
        }
    }
    Ok((cfg, w))
}

/// Creates a write-gated pool on `ctx` and stores it in `*out`. `kv` gives the shape and
/// capacity as for `kvr_kv_pool_new` (`n_layers`, `n_kv_heads`, `head_dim`, `page_size`,
/// `dtype`, `capacity_pages` or `capacity_bytes`, `max_seqs`, `max_seq_len`); here one
/// page holds `page_size` tokens of one (sequence, layer, KV head), so `capacity_bytes`
/// buys `capacity_bytes / (2 * page_size * head_dim * sizeof(dtype))` pages. The pool
/// owns its memory (`kv->layers` must be NULL). `wg` may be NULL for the defaults.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (sizes,
/// `local_window` not a multiple of the page size, < 8 or > 2^19, tau outside [0, 1), negative
/// `sinks`, `gate_hidden` or `max_global_tokens`, `struct_size`, not a live context);
/// `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_OUT_OF_RANGE` (max_seqs x layers x heads >=
/// 2^20, tables past the 32-bit device indices); `KVR_STATUS_UNSUPPORTED` (external
/// memory); `KVR_STATUS_OUT_OF_MEMORY`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the caller owns the new pool and frees it with `kvr_wgkv_pool_free`; the
/// pool keeps `ctx` alive; `kv` and `wg` are copied.
/// Thread safety: thread-safe.
/// On failure: `*out` is not written and nothing is left allocated.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_new(
    ctx: *const kvr_context,
    kv: *const kvr_kv_pool_params,
    wg: *const kvr_wgkv_params,
    out: *mut *mut kvr_wgkv_pool,
) -> kvr_status {
    guard("kvr_wgkv_pool_new", || {
        let ctx = context_from(ctx)?;
        non_null(kv, "kv")?;
        non_null(out, "out")?;
        let (cfg, w) = wg_config(kv, wg, false)?;
        let pool = WgKvPool::new(ctx, cfg)?;
        let h = WG_POOLS.insert(pool);
        GATE_HIDDEN
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((h, w.gate_hidden as usize));
        // SAFETY: non-NULL.
        unsafe { out.write(h as *mut kvr_wgkv_pool) };
        Ok(())
    })
}

/// Pages (each `page_size` tokens of one sequence, layer and KV head, `2 * page_size *
/// head_dim * sizeof(dtype)` bytes) that one sequence of a write-gated pool holds after
/// `context` committed tokens of which a fraction `admit` of those that left the local ring,
/// beyond the sinks, were admitted (rounded up per row), with `drafts` pending drafts; with
/// `kv` and `wg` as for `kvr_wgkv_pool_new`, whose capacity may be left unset here. Per row:
/// the ring (`min(context, local_window)` tokens, the whole window once a token is in the
/// global cache), the global cache (sinks and admitted tokens) and the drafts, in whole
/// pages; this is the pool's own accounting for such a sequence (a fork shares its pages
/// until a write copies a shared page). To size a pool for `max_seqs` sequences: that many
/// times this at the longest context and highest admission rate expected (`admit` 1 is the
/// bound; the default `max_global_tokens` is `max_seq_len`).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`kv` or `out_pages` NULL);
/// `KVR_STATUS_INVALID_ARG` (parameters `kvr_wgkv_pool_new` refuses, negative `context`,
/// `admit` outside [0, 1] or NaN); `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_OUT_OF_RANGE`
/// (`drafts` outside 0..=8, a global cache past `max_global_tokens`, which appends would
/// refuse, or a count past `INT64_MAX`); `KVR_STATUS_UNSUPPORTED` (external memory).
/// Ownership: nothing is kept; `kv` and `wg` stay the caller's.
/// Thread safety: thread-safe.
/// On failure: `*out_pages` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_params_compute_pages_per_seq(
    kv: *const kvr_kv_pool_params,
    wg: *const kvr_wgkv_params,
    context: i64,
    admit: f64,
    drafts: i32,
    out_pages: *mut i64,
) -> kvr_status {
    guard("kvr_wgkv_params_compute_pages_per_seq", || {
        non_null(kv, "kv")?;
        non_null(out_pages, "out_pages")?;
        let (cfg, _) = wg_config(kv, wg, true)?;
        let context = usize::try_from(context)
            .map_err(|_| Error::InvalidArgument(format!("context = {context} is negative")))?;
        let drafts = usize::try_from(drafts)
            .map_err(|_| Error::OutOfRange(format!("drafts = {drafts} is negative")))?;
        let pages = cfg.pages_per_seq(context, admit, drafts)?;
        let pages = i64::try_from(pages)
            .map_err(|_| Error::OutOfRange("the page count overflows int64_t".into()))?;
        // SAFETY: non-NULL.
        unsafe { out_pages.write(pages) };
        Ok(())
    })
}

/// Frees a write-gated pool, its sequences and its memory. NULL is a no-op. On CUDA, work
/// queued that uses the pool must be complete.
///
/// Returns: nothing.
/// Ownership: ends the caller's ownership of `pool` and releases its reference to the
/// context.
/// Thread safety: thread-safe; a call already running on another thread keeps the pool
/// alive until it returns, and calls that start later get `KVR_STATUS_INVALID_ARG`.
/// On failure: a handle that is not a live pool is ignored and recorded in
/// `kvr_error_last_message`; nothing changes.
#[no_mangle]
pub extern "C" fn kvr_wgkv_pool_free(pool: *mut kvr_wgkv_pool) {
    if pool.is_null() {
        return;
    }
    let _ = guard("kvr_wgkv_pool_free", || {
        WG_POOLS.remove(pool as usize).map(drop)?;
        GATE_HIDDEN
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|e| e.0 != pool as usize);
        Ok(())
    });
}

/// One layer's gate weights in host memory, f32, row-major (see `kvr_wgkv_pool_set_gate`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_wgkv_gate_layer {
    /// RMSNorm weight of the pre-RoPE key, `[head_dim]` (shared by the layer's heads).
    pub norm_pre: *const f32,
    /// RMSNorm weight of the post-RoPE key, `[head_dim]`.
    pub norm_post: *const f32,
    /// First linear layer, `[n_kv_heads][hidden][2 * head_dim]` (inputs 0..head_dim are
    /// the normalized pre-RoPE key, the rest the post-RoPE key).
    pub fc1_weight: *const f32,
    /// Its bias, `[n_kv_heads][hidden]`.
    pub fc1_bias: *const f32,
    /// Second linear layer, `[n_kv_heads][hidden]`.
    pub fc2_weight: *const f32,
    /// Its bias, `[n_kv_heads]`.
    pub fc2_bias: *const f32,
}

fn check_hidden(pool: *const kvr_wgkv_pool, g: &GateWeights) -> Result<()> {
    let want = required_hidden(pool as usize);
    if want != 0 && want != g.hidden {
        return Err(Error::InvalidArgument(format!(
            "the gate's hidden size is {}; the pool was created for {want}",
            g.hidden
        )));
    }
    Ok(())
}

/// Sets the pool's gate from host arrays: `layers` holds `n_layers` entries (one per pool
/// layer), each MLP of hidden size `hidden`. Per token, layer and KV head the score is
/// `max(sigmoid(fc2 . GELU(fc1 [RMSNorm(k_pre); RMSNorm(k)] + b1) + b2), 1e-3)` (exact erf
/// GELU, RMSNorm eps 1e-6). The weights are copied.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (NULL `layers` or a NULL array in
/// it); `KVR_STATUS_INVALID_ARG` (handle, `hidden` < 1 or not the pool's `gate_hidden`, a
/// non-finite weight).
/// Ownership: the arrays stay the caller's (read during the call only).
/// Thread safety: thread-safe; appends running on other threads use the old or the new
/// gate.
/// On failure: the pool keeps its previous gate.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_set_gate(
    pool: *mut kvr_wgkv_pool,
    layers: *const kvr_wgkv_gate_layer,
    hidden: i32,
) -> kvr_status {
    guard("kvr_wgkv_pool_set_gate", || {
        let p = pool_from(pool)?;
        non_null(layers, "layers")?;
        let hidden = positive("hidden", hidden as i64)?;
        let c = *p.config();
        let (h, d) = (c.kv_heads, c.head_dim);
        let mut views = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            // SAFETY: the caller passes `n_layers` readable entries.
            let e = unsafe { layers.add(l).read() };
            let mk = |ptr: *const f32, name: &str, shape: &[usize]| -> Result<TensorView> {
                non_null(ptr, &format!("layers[{l}].{name}"))?;
                TensorView::contiguous(ptr as usize, DType::F32, MemoryKind::Host, shape)
            };
            views.push([
                mk(e.norm_pre, "norm_pre", &[d])?,
                mk(e.norm_post, "norm_post", &[d])?,
                mk(e.fc1_weight, "fc1_weight", &[h, hidden, 2 * d])?,
                mk(e.fc1_bias, "fc1_bias", &[h, hidden])?,
                mk(e.fc2_weight, "fc2_weight", &[h, hidden])?,
                mk(e.fc2_bias, "fc2_bias", &[h])?,
            ]);
        }
        let g = GateWeights::from_views(h, d, &views)?;
        check_hidden(pool, &g)?;
        p.set_gate(Some(g))
    })
}

/// Loads the pool's gate from a GGUF file: for pool layer j the tensors
/// `blk.{b}.wg_gate.norm_pre.weight` `[head_dim]`, `.norm_post.weight` `[head_dim]`,
/// `.fc1.weight` `[n_kv_heads, hidden, 2 * head_dim]`, `.fc1.bias` `[n_kv_heads, hidden]`,
/// `.fc2.weight` `[n_kv_heads, hidden]`, `.fc2.bias` `[n_kv_heads]` (row-major shapes; f32,
/// f16 or bf16), with b = `blocks[j]` (`blocks` NULL: b = j). scripts/wgkv_convert.py
/// writes such a file from a WG-KV checkpoint.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` (`path`); `KVR_STATUS_INVALID_ARG`
/// (handle, `path` not UTF-8, `n_blocks` not the pool's layer count when `blocks` is set,
/// a tensor of the wrong shape, a hidden size other than the pool's `gate_hidden`, a
/// non-finite weight); `KVR_STATUS_UNKNOWN_ID` (a tensor is missing);
/// `KVR_STATUS_DTYPE_MISMATCH` (a tensor that is not f32, f16 or bf16);
/// `KVR_STATUS_IO_ERROR`; `KVR_STATUS_MALFORMED_FILE`.
/// Ownership: the file is read during the call only; the weights are copied.
/// Thread safety: thread-safe.
/// On failure: the pool keeps its previous gate.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_load_gate(
    pool: *mut kvr_wgkv_pool,
    path: *const c_char,
    blocks: *const i32,
    n_blocks: i32,
) -> kvr_status {
    guard("kvr_wgkv_pool_load_gate", || {
        let p = pool_from(pool)?;
        non_null(path, "path")?;
        // SAFETY: non-NULL, NUL-terminated by contract.
        let path = unsafe { CStr::from_ptr(path) }
            .to_str()
            .map_err(|_| Error::InvalidArgument("path is not valid UTF-8".into()))?;
        let c = *p.config();
        let blocks: Vec<usize> = if blocks.is_null() {
            (0..c.layers).collect()
        } else {
            if n_blocks as i64 != c.layers as i64 {
                return Err(Error::InvalidArgument(format!(
                    "{n_blocks} blocks given for a pool of {} layers",
                    c.layers
                )));
            }
            (0..c.layers)
                .map(|j| {
                    // SAFETY: `n_blocks` readable entries.
                    let b = unsafe { blocks.add(j).read() };
                    usize::try_from(b).map_err(|_| {
                        Error::InvalidArgument(format!("blocks[{j}] = {b} is negative"))
                    })
                })
                .collect::<Result<_>>()?
        };
        let file = GgufFile::open(path)?;
        let g = GateWeights::from_gguf(&file, &blocks, c.kv_heads, c.head_dim)?;
        check_hidden(pool, &g)?;
        p.set_gate(Some(g))
    })
}

/// Adds an empty sequence (the lowest free id) and stores its id in `*out_seq`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_POOL_EXHAUSTED` (all ids in use); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the pool owns the sequence until `kvr_wgkv_pool_seq_free` or
/// `kvr_wgkv_pool_free`.
/// Thread safety: thread-safe (calls on one pool take its lock); on CUDA the device work
/// of calls on one pool must be ordered by the caller.
/// On failure: `*out_seq` is not written and the pool is unchanged.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_seq_add(
    pool: *mut kvr_wgkv_pool,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> kvr_status {
    guard("kvr_wgkv_pool_seq_add", || {
        let p = pool_from(pool)?;
        non_null(out_seq, "out_seq")?;
        let id = p.seq_add(Stream(stream as usize))?;
        // SAFETY: non-NULL.
        unsafe { out_seq.write(id) };
        Ok(())
    })
}

/// Frees sequence `seq` and releases its pages (pages shared with forks stay with them).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the sequence's pages return to the pool.
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: the pool is unchanged.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_seq_free(
    pool: *mut kvr_wgkv_pool,
    seq: kvr_seq_id,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_seq_free", || {
        pool_from(pool)?.seq_free(seq, Stream(stream as usize))
    })
}

/// Creates a sequence sharing all of `src`'s pages and admission state (copy-on-write:
/// either side copies a shared page before writing into it) and stores its id in
/// `*out_seq`. Pending drafts are forked too.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_POOL_EXHAUSTED` (no free id);
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: the pool owns the new sequence.
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: `*out_seq` is not written and the pool is unchanged.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_seq_fork(
    pool: *mut kvr_wgkv_pool,
    src: kvr_seq_id,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> kvr_status {
    guard("kvr_wgkv_pool_seq_fork", || {
        let p = pool_from(pool)?;
        non_null(out_seq, "out_seq")?;
        let id = p.seq_fork(src, Stream(stream as usize))?;
        // SAFETY: non-NULL.
        unsafe { out_seq.write(id) };
        Ok(())
    })
}

/// Flags of `kvr_wgkv_pool_append`.
pub type kvr_wgkv_append_flags = u32;
/// Committed tokens: they enter the ring (evicting, promoting or dropping its oldest).
pub const KVR_WGKV_COMMITTED: kvr_wgkv_append_flags = 0 as kvr_wgkv_append_flags;
/// Speculative drafts: kept after the global cache until `kvr_wgkv_pool_commit` (at most 8
/// pending per sequence); nothing is evicted or promoted for them.
pub const KVR_WGKV_DRAFT: kvr_wgkv_append_flags = 1 as kvr_wgkv_append_flags;

/// Reads f32 scores `[n, H]` or `[L, n, H]` (host, any strides) in row-major order.
fn scores_from(t: &TensorView) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch(format!(
            "scores must be f32, not {}",
            t.dtype()
        )));
    }
    if t.memory() != MemoryKind::Host {
        return Err(Error::InvalidArgument(
            "scores must be in host memory".into(),
        ));
    }
    let shape = t.shape().to_vec();
    let strides = t.strides().to_vec();
    let mut idx = vec![0usize; shape.len()];
    let mut out = Vec::with_capacity(t.numel());
    for _ in 0..t.numel() {
        let off: isize = idx
            .iter()
            .zip(&strides)
            .map(|(&i, &s)| i as isize * s)
            .sum();
        // SAFETY: a checked host view.
        out.push(unsafe { (t.addr() as *const f32).offset(off).read() });
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// Appends n tokens to `seq` for one layer (`layer` >= 0: `k`, `v` `[n, n_kv_heads,
/// head_dim]`) or every layer (`KVR_LAYER_ALL`: `[n_layers, n, n_kv_heads, head_dim]`).
/// Exactly one of `scores` and `k_pre` is given: `scores` are the gate's outputs, f32 host
/// `[n, n_kv_heads]` (`[n_layers, n, n_kv_heads]` for all layers); `k_pre` (the keys before
/// RoPE, shaped like `k`, host memory, with `k` in host memory too) has the pool's gate
/// (`kvr_wgkv_pool_set_gate`) computed on the CPU. `k` is the cached, post-RoPE key. With
/// `KVR_WGKV_COMMITTED` each token enters its (layer, head)'s ring; the ring's oldest token
/// is promoted to the global cache if its score is > tau or it is one of the first `sinks`
/// tokens, and dropped otherwise (a prefill does this for every token older than the last
/// `local_window` at once). With `KVR_WGKV_DRAFT` the tokens wait as drafts. On CUDA, K/V
/// may be host or device memory (host K/V are copied in on `stream`); the copies into the
/// pool are queued on `stream` (not graph-capturable: which rows move is decided on the
/// host).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, both or neither of `scores` / `k_pre`, a non-finite score, no gate set,
/// committed tokens while drafts are pending, unknown flags); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_OUT_OF_RANGE` (layer, more than 8 drafts, a
/// global cache past `max_global_tokens`); `KVR_STATUS_POOL_EXHAUSTED`;
/// `KVR_STATUS_OUT_OF_MEMORY` / `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors stay the caller's (read during the call).
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: all or nothing: the sequence does not change, except after
/// `KVR_STATUS_CUDA_ERROR` / `KVR_STATUS_OUT_OF_MEMORY` while queuing the copies, which can
/// leave queued device work half done (free the pool).
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_wgkv_pool_append(
    pool: *mut kvr_wgkv_pool,
    seq: kvr_seq_id,
    layer: kvr_layer_select,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    k_pre: *const kvr_tensor,
    scores: *const kvr_tensor,
    flags: kvr_wgkv_append_flags,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_append", || {
        let p = pool_from(pool)?;
        let layer = layer_arg(layer, true)?;
        if flags & !KVR_WGKV_DRAFT != 0 {
            return Err(Error::InvalidArgument(format!("unknown flags {flags:#x}")));
        }
        let draft = flags & KVR_WGKV_DRAFT != 0;
        // SAFETY: NULL-checked descriptors.
        let (k, v) = unsafe { (view_from_c(k, "k")?, view_from_c(v, "v")?) };
        let stream = Stream(stream as usize);
        match (k_pre.is_null(), scores.is_null()) {
            (true, false) => {
                // SAFETY: non-NULL descriptor.
                let s = unsafe { view_from_c(scores, "scores")? };
                let s = scores_from(&s)?;
                p.append(seq, layer, &k, &v, &s, draft, stream)
            }
            (false, true) => {
                // SAFETY: non-NULL descriptor.
                let kp = unsafe { view_from_c(k_pre, "k_pre")? };
                p.append_gated(seq, layer, &kp, &k, &v, draft, stream)
            }
            _ => Err(Error::InvalidArgument(
                "give exactly one of scores and k_pre".into(),
            )),
        }
    })
}

/// Reserves `n_steps` device steps (`kvr_wgkv_pool_step`) for `seq`, every layer: pages for
/// the ring slots and global positions its next `n_steps` committed tokens can write (each
/// counted as admitted unless its score is already known), made private and put in the
/// block tables now, so that a step needs no host decision. Each step of a layer uses one
/// step of that layer's budget; any other operation on the sequence (append, commit,
/// truncate, fork, free) ends the reservation. On CUDA the sequence becomes device-driven:
/// its rows' state lives on the device from here on, and every later host call on it waits
/// for `stream` (every stream for calls without one) to read it back. Call it every
/// `n_steps` decode steps, e.g. 16 or 64, before replaying a captured graph of steps.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle,
/// pending drafts, a sequence with no tokens); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_OUT_OF_RANGE` (`n_steps` outside 1..65536, a global cache that could pass
/// `max_global_tokens`); `KVR_STATUS_POOL_EXHAUSTED` (too few free pages, or earlier steps
/// of this sequence found no budget and were skipped: reported once, by the next call
/// that reads the sequence back); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: reserved pages belong to the sequence (counted in `pages_used`).
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: the sequence is unchanged, except after `KVR_STATUS_CUDA_ERROR`.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_reserve(
    pool: *mut kvr_wgkv_pool,
    seq: kvr_seq_id,
    n_steps: i32,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_reserve", || {
        let p = pool_from(pool)?;
        let n = usize::try_from(n_steps)
            .map_err(|_| Error::OutOfRange(format!("n_steps {n_steps} is negative")))?;
        p.reserve(seq, n, Stream(stream as usize))
    })
}

/// A step's sequence ids (i32 `[B]` in host memory, read) and its optional tensors
/// (`k_pre`, `scores`, `scores_out`; NULL: none).
type StepInputs = (
    Vec<i32>,
    Option<TensorView>,
    Option<TensorView>,
    Option<TensorView>,
);

/// The checked descriptor behind `t`, or `None` for NULL.
fn optional_view(t: *const kvr_tensor, name: &str) -> Result<Option<TensorView>> {
    if t.is_null() {
        Ok(None)
    } else {
        // SAFETY: non-NULL descriptor.
        unsafe { view_from_c(t, name) }.map(Some)
    }
}

/// Reads a step's ids and optional tensors ([`StepInputs`]).
fn step_inputs(
    seq_ids: *const kvr_tensor,
    k_pre: *const kvr_tensor,
    scores: *const kvr_tensor,
    scores_out: *const kvr_tensor,
) -> Result<StepInputs> {
    // SAFETY: NULL-checked descriptor.
    let ids = unsafe { view_from_c(seq_ids, "seq_ids")? };
    if ids.dtype() != DType::I32 || ids.ndim() != 1 || ids.memory() != MemoryKind::Host {
        return Err(Error::InvalidArgument(format!(
            "seq_ids must be an i32 [B] tensor in host memory, not {} {:?} in {:?} memory",
            ids.dtype(),
            ids.shape(),
            ids.memory()
        )));
    }
    Ok((
        crate::pool::read_host_i32(&ids, ids.shape()[0]),
        optional_view(k_pre, "k_pre")?,
        optional_view(scores, "scores")?,
        optional_view(scores_out, "scores_out")?,
    ))
}

/// One decode step of layer `layer`: one committed token for each sequence of `seq_ids`
/// (i32 `[B]`, host memory, unique, each with steps reserved by `kvr_wgkv_pool_reserve`).
/// `k`, `v`: `[B, n_kv_heads, head_dim]` (the cached, post-RoPE key). Exactly one of
/// `k_pre` (the keys before RoPE, shaped like `k`: the pool's gate scores the token) and
/// `scores` (f32 `[B, n_kv_heads]`, the gate's outputs) is given; `scores_out` (optional,
/// f32 `[B, n_kv_heads]`, contiguous) receives the scores used. Each (sequence, KV head)
/// row does what a committed one-token `kvr_wgkv_pool_append` does: the ring's oldest
/// token is promoted if its score was > tau (or it is a sink) and dropped otherwise, the
/// new token takes its slot. On CUDA a gated step without `scores_out` defers its gate: a
/// token's score is needed only when it leaves the ring, so each row keeps the inputs of up
/// to min(16, local_window) tokens (f32, in the pool's device memory) and scores them in
/// the step that fills that queue; any host call on the sequence (and a step with given
/// scores or `scores_out`) scores what its rows still hold first, so every result is the
/// same as with the gate in each step (set `KVR_WGKV_GATE_DEFER=0` in the environment
/// before creating the pool to score every step). On CUDA every tensor is device memory and the call queues
/// one kernel per 128 sequences (gate, ring update and copies fused) whose launches
/// depend on nothing the host reads back: it can be captured in a CUDA graph and replayed
/// while the reservation lasts; a row whose budget is spent is left unchanged and the
/// next host call on its sequence returns `KVR_STATUS_POOL_EXHAUSTED`. The device gate
/// takes head_dim <= 256. A captured step holds the addresses of the pool's device copy of
/// the gate: capture again after `kvr_wgkv_pool_set_gate` / `kvr_wgkv_pool_load_gate`. On the
/// CPU the tensors are host memory and a spent budget is an error before anything changes.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, both or neither of `k_pre` / `scores`, memory kinds, a sequence listed twice,
/// no gate set, a non-finite score on the CPU); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_OUT_OF_RANGE` (layer, a sequence without a
/// reservation); `KVR_STATUS_UNSUPPORTED` (the device gate for head_dim > 256: pass
/// scores); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors stay the caller's.
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: nothing changes (nothing is queued).
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_wgkv_pool_step(
    pool: *mut kvr_wgkv_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    k_pre: *const kvr_tensor,
    scores: *const kvr_tensor,
    scores_out: *const kvr_tensor,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_step", || {
        let p = pool_from(pool)?;
        let layer = one_layer(layer)?;
        // SAFETY: NULL-checked descriptors.
        let (k, v) = unsafe { (view_from_c(k, "k")?, view_from_c(v, "v")?) };
        let (ids, kp, sc, so) = step_inputs(seq_ids, k_pre, scores, scores_out)?;
        p.step(
            layer,
            &ids,
            kp.as_ref(),
            &k,
            &v,
            sc.as_ref(),
            so.as_ref(),
            Stream(stream as usize),
        )
    })
}

/// Accepts the first `n_accepted` pending drafts of `seq` (every layer and head): they
/// enter the ring in order, evicting and promoting exactly as committed appends would; the
/// other drafts are dropped.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (`n_accepted` negative or more than
/// the drafts pending); `KVR_STATUS_POOL_EXHAUSTED` (the moved drafts need free pages
/// while the call runs); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: released pages return to the pool.
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: the sequence is unchanged, except after `KVR_STATUS_CUDA_ERROR`, which can
/// leave queued device work half done (free the pool).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_commit(
    pool: *mut kvr_wgkv_pool,
    seq: kvr_seq_id,
    n_accepted: i32,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_commit", || {
        let p = pool_from(pool)?;
        let n = usize::try_from(n_accepted)
            .map_err(|_| Error::OutOfRange(format!("n_accepted {n_accepted} is negative")))?;
        p.commit(seq, n, Stream(stream as usize))
    })
}

/// Rolls `seq` back to `len` tokens (committed plus drafts), dropping the drafts past it.
/// Only drafts can be rolled back: `len` must lie between the committed length and the
/// committed length plus the pending drafts.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG` / `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE`; `KVR_STATUS_CUDA_ERROR`.
/// Ownership: released pages return to the pool.
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: the sequence is unchanged.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_seq_truncate(
    pool: *mut kvr_wgkv_pool,
    seq: kvr_seq_id,
    len: i64,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_seq_truncate", || {
        let p = pool_from(pool)?;
        let len = usize::try_from(len)
            .map_err(|_| Error::OutOfRange(format!("length {len} is negative")))?;
        p.truncate(seq, len, Stream(stream as usize))
    })
}

/// Attention for a batch of sequences over layer `layer`'s ring + global cache (+ drafts)
/// of each (sequence, KV head), as `kvr_kv_pool_decode`: `q`/`out` `[B, Hq, head_dim]` or
/// `[B, T, Hq, head_dim]` (T > 1: the last T tokens must be pending drafts, causal among
/// themselves), `lse` optional, `seq_ids` i32 `[B]` in host memory. (sequence, KV head)
/// are folded into the decode's batch when q/out/lse keep each row's heads contiguous
/// (one launch), else one launch per KV head. `params` may be NULL; its `window` must be 0.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// shapes, a sequence listed twice, a window); `KVR_STATUS_DTYPE_MISMATCH`;
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (layer, T > drafts, an empty
/// sequence, group > 16); `KVR_STATUS_UNSUPPORTED` (device `seq_ids`, CUDA dtypes / head
/// dims as `kvr_kv_pool_decode`); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors stay the caller's.
/// Thread safety: thread-safe (calls on one pool take its lock).
/// On failure: `out` and `lse` are not written; the pool never changes.
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_wgkv_pool_decode(
    pool: *mut kvr_wgkv_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    q: *const kvr_tensor,
    out: *const kvr_tensor,
    lse: *const kvr_tensor,
    params: *const kvr_kv_decode_params,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_decode", || {
        let p = pool_from(pool)?;
        let layer = one_layer(layer)?;
        let opts = super::kv_pool::decode_options_from(params)?;
        // SAFETY: NULL-checked descriptors.
        let (ids, q, out) = unsafe {
            (
                view_from_c(seq_ids, "seq_ids")?,
                view_from_c(q, "q")?,
                view_from_c(out, "out")?,
            )
        };
        let lse = optional_view(lse, "lse")?;
        let io = DecodeIo {
            seq_ids: &ids,
            q: &q,
            out: &out,
            lse: lse.as_ref(),
        };
        p.decode(layer, &io, &opts, Stream(stream as usize))
    })
}

/// `kvr_wgkv_pool_step` and then `kvr_wgkv_pool_decode` of the same sequences in one call:
/// the step's committed token for each sequence of `seq_ids` (arguments as
/// `kvr_wgkv_pool_step`), then attention of `q` over the rows with that token in them
/// (`q`/`out` `[B, Hq, head_dim]` or `[B, 1, Hq, head_dim]`, `lse` optional, `params` as
/// `kvr_wgkv_pool_decode`). Every argument of both is checked before anything is queued.
/// On CUDA the call queues the step's kernel and then the decode's (graph-capturable, as
/// both are).
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (as either
/// call, or more than one query token per sequence); `KVR_STATUS_UNKNOWN_ID`;
/// `KVR_STATUS_DTYPE_MISMATCH`; `KVR_STATUS_OUT_OF_RANGE`; `KVR_STATUS_UNSUPPORTED`;
/// `KVR_STATUS_CUDA_ERROR`.
/// Ownership: all tensors stay the caller's.
/// Thread safety: thread-safe (the call holds the pool's lock throughout).
/// On failure: nothing changes and `out` / `lse` are not written, except after
/// `KVR_STATUS_CUDA_ERROR` from the decode's launch, which leaves the step queued.
#[no_mangle]
#[must_use]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn kvr_wgkv_pool_step_decode(
    pool: *mut kvr_wgkv_pool,
    layer: i32,
    seq_ids: *const kvr_tensor,
    k: *const kvr_tensor,
    v: *const kvr_tensor,
    k_pre: *const kvr_tensor,
    scores: *const kvr_tensor,
    scores_out: *const kvr_tensor,
    q: *const kvr_tensor,
    out: *const kvr_tensor,
    lse: *const kvr_tensor,
    params: *const kvr_kv_decode_params,
    stream: *mut c_void,
) -> kvr_status {
    guard("kvr_wgkv_pool_step_decode", || {
        let p = pool_from(pool)?;
        let layer = one_layer(layer)?;
        let opts = super::kv_pool::decode_options_from(params)?;
        // SAFETY: NULL-checked descriptors.
        let (k, v, q, out) = unsafe {
            (
                view_from_c(k, "k")?,
                view_from_c(v, "v")?,
                view_from_c(q, "q")?,
                view_from_c(out, "out")?,
            )
        };
        let (ids, kp, sc, so) = step_inputs(seq_ids, k_pre, scores, scores_out)?;
        let lse = optional_view(lse, "lse")?;
        let io = WgStep {
            layer,
            seqs: &ids,
            k_pre: kp.as_ref(),
            k: &k,
            v: &v,
            scores: sc.as_ref(),
            scores_out: so.as_ref(),
        };
        p.step_decode(&io, &q, &out, lse.as_ref(), &opts, Stream(stream as usize))
    })
}

/// Occupancy of a write-gated pool, filled by `kvr_wgkv_pool_get_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_wgkv_pool_stats {
    /// Set to `sizeof(kvr_wgkv_pool_stats)` before the call.
    pub struct_size: u32,
    /// Reserved, 0.
    pub reserved: u32,
    /// Pages in the pool.
    pub pages_total: i64,
    /// Pages referenced by a sequence.
    pub pages_used: i64,
    /// Pages free.
    pub pages_free: i64,
    /// Pages shared by forks.
    pub pages_shared: i64,
    /// Live sequences.
    pub sequences: i64,
    /// Tokens attention reads, summed over (sequence, layer, head): ring + global + drafts.
    pub kept_tokens: i64,
    /// Tokens a full cache would hold, summed the same way.
    pub full_tokens: i64,
    /// Pages of the same size a full paged cache would use for the live sequences.
    pub full_pages: i64,
    /// Bytes of K and V per page (one layer, one head).
    pub page_bytes: i64,
}

/// Fills `*out` with the pool's occupancy (memory used against a full cache). Set
/// `out->struct_size` first.
///
/// Device-driven sequences (`kvr_wgkv_pool_reserve` on CUDA) are read back first, after
/// waiting for every stream of the context.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle,
/// `struct_size` too small); `KVR_STATUS_POOL_EXHAUSTED` (device steps that found no
/// reservation, reported once); `KVR_STATUS_CUDA_ERROR`.
/// Ownership: `*out` is the caller's.
/// Thread safety: thread-safe (a snapshot under the pool's lock).
/// On failure: `*out` is not written.
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_get_stats(
    pool: *const kvr_wgkv_pool,
    out: *mut kvr_wgkv_pool_stats,
) -> kvr_status {
    guard("kvr_wgkv_pool_get_stats", || {
        let p = pool_from(pool)?;
        non_null(out, "out")?;
        let s = p.stats()?;
        let c = kvr_wgkv_pool_stats {
            struct_size: size_of::<kvr_wgkv_pool_stats>() as u32,
            reserved: 0,
            pages_total: s.pages_total as i64,
            pages_used: s.pages_used as i64,
            pages_free: s.pages_free as i64,
            pages_shared: s.pages_shared as i64,
            sequences: s.sequences as i64,
            kept_tokens: s.kept_tokens as i64,
            full_tokens: s.full_tokens as i64,
            full_pages: s.full_pages as i64,
            page_bytes: s.page_bytes as i64,
        };
        // SAFETY: non-NULL, `struct_size` writable bytes.
        unsafe {
            write_versioned(
                out,
                c,
                size_of::<kvr_wgkv_pool_stats>(),
                "kvr_wgkv_pool_stats",
            )
        }
    })
}

/// Counts of one (sequence, layer, KV head), from `kvr_wgkv_pool_get_seq_rows`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvr_wgkv_row_stats {
    /// Tokens in the local ring.
    pub ring: i64,
    /// Tokens in the global cache (promoted).
    pub global: i64,
    /// Pending drafts.
    pub drafts: i64,
    /// Committed tokens appended (kept or not).
    pub total: i64,
}

/// Copies the counts of every (layer, KV head) of `seq` (layer-major: entry `layer *
/// n_kv_heads + head`) into `rows` (room for `capacity` entries) and stores the number of
/// entries in `*out_count`.
///
/// Returns: `KVR_STATUS_OK`; `KVR_STATUS_NULL_ARG`; `KVR_STATUS_INVALID_ARG` (handle);
/// `KVR_STATUS_UNKNOWN_ID`; `KVR_STATUS_OUT_OF_RANGE` (`capacity` too small);
/// `KVR_STATUS_POOL_EXHAUSTED` / `KVR_STATUS_CUDA_ERROR` (reading a device-driven sequence
/// back, as `kvr_wgkv_pool_get_stats`).
/// Ownership: `rows` and `*out_count` are the caller's.
/// Thread safety: thread-safe.
/// On failure: nothing is written, except that `KVR_STATUS_OUT_OF_RANGE` stores the entry
/// count in `*out_count` (the room to make).
#[no_mangle]
#[must_use]
pub extern "C" fn kvr_wgkv_pool_get_seq_rows(
    pool: *const kvr_wgkv_pool,
    seq: kvr_seq_id,
    rows: *mut kvr_wgkv_row_stats,
    capacity: i64,
    out_count: *mut i64,
) -> kvr_status {
    guard("kvr_wgkv_pool_get_seq_rows", || {
        let p = pool_from(pool)?;
        non_null(out_count, "out_count")?;
        let r = p.seq_rows(seq)?;
        if (r.len() as i64) > capacity.max(0) {
            // SAFETY: non-NULL; the documented exception (the room to make).
            unsafe { out_count.write(r.len() as i64) };
            return Err(Error::OutOfRange(format!(
                "sequence {seq} has {} rows; the buffer holds {capacity}",
                r.len()
            )));
        }
        non_null(rows, "rows")?;
        for (i, s) in r.iter().enumerate() {
            // SAFETY: `capacity` >= len writable entries.
            unsafe {
                rows.add(i).write(kvr_wgkv_row_stats {
                    ring: s.ring as i64,
                    global: s.global as i64,
                    drafts: s.drafts as i64,
                    total: s.total as i64,
                })
            };
        }
        // SAFETY: non-NULL.
        unsafe { out_count.write(r.len() as i64) };
        Ok(())
    })
}
