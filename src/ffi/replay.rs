//! What every replay pool's C functions share (`kvr_gdn_pool_*`, `kvr_mamba2_pool_*`): the
//! bodies of the family-independent operations, over the core's `ReplayPool<F>`.

use std::ffi::c_void;

use super::gdn::{
    kvr_gdn_cursor, kvr_gdn_pool_memory, KVR_GDN_MODE_KV_ONLY, KVR_GDN_MODE_RECURRENT,
    KVR_GDN_MODE_REPLAY,
};
use super::guard::{non_null, write_versioned};
use super::kv_pool::{kvr_layer_select, kvr_seq_id, layer_arg, one_layer};
use super::tensor::{kvr_tensor, view_from_c};
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::linear::replay::meta::{
    META_H, META_MODE, META_PENDING, META_START, MODE_KV_ONLY, MODE_RECURRENT, MODE_REPLAY,
};
use crate::linear::{Family, ReplayMemory, ReplayPool};
use crate::tensor::TensorView;

/// A C tensor descriptor that may be NULL.
pub(crate) fn optional_view(t: *const kvr_tensor, name: &str) -> Result<Option<TensorView>> {
    if t.is_null() {
        Ok(None)
    } else {
        // SAFETY: non-NULL descriptor.
        Ok(Some(unsafe { view_from_c(t, name)? }))
    }
}

/// A C tensor descriptor that must not be NULL.
pub(crate) fn view(t: *const kvr_tensor, name: &str) -> Result<TensorView> {
    // SAFETY: `view_from_c` checks for NULL.
    unsafe { view_from_c(t, name) }
}

pub(crate) fn stream_of(stream: *mut c_void) -> Stream {
    Stream(stream as usize)
}

pub(crate) fn memory_to_c(m: ReplayMemory, threshold: usize) -> kvr_gdn_pool_memory {
    kvr_gdn_pool_memory {
        struct_size: size_of::<kvr_gdn_pool_memory>() as u32,
        reserved: 0,
        state_bytes: m.state_bytes as i64,
        ring_bytes: m.ring_bytes as i64,
        conv_bytes: m.conv_bytes as i64,
        snapshot_bytes: m.snapshot_bytes as i64,
        total_bytes: m.total() as i64,
        kv_only_threshold: threshold as i64,
    }
}

/// `*out` = the pool's per-sequence memory.
pub(crate) fn get_memory<F: Family>(
    pool: &ReplayPool<F>,
    out: *mut kvr_gdn_pool_memory,
) -> Result<()> {
    non_null(out, "out")?;
    let m = memory_to_c(pool.memory(), pool.config().kv_only_threshold);
    // SAFETY: non-NULL; `struct_size` writable bytes.
    unsafe {
        write_versioned(
            out,
            m,
            size_of::<kvr_gdn_pool_memory>(),
            "kvr_gdn_pool_memory",
        )
    }
}

/// `*out_seq` = a new sequence.
pub(crate) fn seq_add<F: Family>(
    pool: &ReplayPool<F>,
    stream: *mut c_void,
    out_seq: *mut kvr_seq_id,
) -> Result<()> {
    non_null(out_seq, "out_seq")?;
    let id = pool.seq_add(stream_of(stream))?;
    // SAFETY: non-NULL.
    unsafe { out_seq.write(id) };
    Ok(())
}

/// `*out` = the cursor of (layer, seq).
pub(crate) fn get_cursor<F: Family>(
    pool: &ReplayPool<F>,
    layer: i32,
    seq: kvr_seq_id,
    out: *mut kvr_gdn_cursor,
) -> Result<()> {
    non_null(out, "out")?;
    let layer = one_layer(layer)?;
    let m = pool.debug_meta(layer, seq)?;
    let mode = match m[META_MODE] {
        MODE_KV_ONLY => KVR_GDN_MODE_KV_ONLY,
        MODE_REPLAY => KVR_GDN_MODE_REPLAY,
        MODE_RECURRENT => KVR_GDN_MODE_RECURRENT,
        other => {
            return Err(Error::Panic(format!(
                "sequence {seq}, layer {layer}: metadata holds unknown mode {other}"
            )))
        }
    };
    let cursor = kvr_gdn_cursor {
        mode,
        ring_start: m[META_START],
        buffered: m[META_H],
        pending: m[META_PENDING],
    };
    // SAFETY: non-NULL.
    unsafe { out.write(cursor) };
    Ok(())
}

pub(crate) fn import_state<F: Family>(
    pool: &ReplayPool<F>,
    layer: i32,
    seq: kvr_seq_id,
    state: *const kvr_tensor,
    conv: *const kvr_tensor,
    stream: *mut c_void,
) -> Result<()> {
    let layer = one_layer(layer)?;
    let state = view(state, "state")?;
    let conv = optional_view(conv, "conv")?;
    pool.import_state(layer, seq, &state, conv.as_ref(), stream_of(stream))
}

pub(crate) fn export_state<F: Family>(
    pool: &ReplayPool<F>,
    layer: i32,
    seq: kvr_seq_id,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> Result<()> {
    let layer = one_layer(layer)?;
    let out = view(out, "out")?;
    let conv_out = optional_view(conv_out, "conv_out")?;
    pool.export_state(layer, seq, &out, conv_out.as_ref(), stream_of(stream))
}

pub(crate) fn materialize<F: Family>(
    pool: &ReplayPool<F>,
    seq: kvr_seq_id,
    keep: i32,
    out: *const kvr_tensor,
    conv_out: *const kvr_tensor,
    stream: *mut c_void,
) -> Result<()> {
    let keep =
        usize::try_from(keep).map_err(|_| Error::OutOfRange(format!("keep {keep} is negative")))?;
    let out = view(out, "out")?;
    let conv_out = optional_view(conv_out, "conv_out")?;
    pool.materialize(seq, keep, &out, conv_out.as_ref(), stream_of(stream))
}

pub(crate) fn commit<F: Family>(
    pool: &ReplayPool<F>,
    layer: kvr_layer_select,
    seq_ids: *const kvr_tensor,
    accepted: *const kvr_tensor,
    conv_state: *const kvr_tensor,
    stream: *mut c_void,
) -> Result<()> {
    let layer = layer_arg(layer, true)?;
    let ids = view(seq_ids, "seq_ids")?;
    let acc = view(accepted, "accepted")?;
    let cs = optional_view(conv_state, "conv_state")?;
    pool.commit(layer, &ids, &acc, cs.as_ref(), stream_of(stream))
}

pub(crate) fn flush<F: Family>(
    pool: &ReplayPool<F>,
    layer: kvr_layer_select,
    seq_ids: *const kvr_tensor,
    stream: *mut c_void,
) -> Result<()> {
    let layer = layer_arg(layer, true)?;
    let ids = view(seq_ids, "seq_ids")?;
    pool.flush(layer, &ids, stream_of(stream))
}
