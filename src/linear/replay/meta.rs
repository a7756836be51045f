//! The per-(layer, sequence) metadata record and the rules that advance it. The record
//! lives where the kernels run (host memory on the CPU, device memory on CUDA) and is
//! advanced by them, so commit counts can be device data and the host never waits.
//! kernels/gdn_common.cuh reads the same record.

use super::config::ReplayConfig;

// The record's slots and the mode values are part of the kernel ABI (kernels/kvr_abi.h).
pub(crate) use crate::abi::{
    KVR_GDN_KV_ONLY as MODE_KV_ONLY, KVR_GDN_META_CONV_END as META_CONV_END,
    KVR_GDN_META_H as META_H, KVR_GDN_META_INTS as META_INTS, KVR_GDN_META_MODE as META_MODE,
    KVR_GDN_META_PENDING as META_PENDING, KVR_GDN_META_START as META_START,
    KVR_GDN_RECURRENT as MODE_RECURRENT, KVR_GDN_REPLAY as MODE_REPLAY,
};

/// One metadata record.
pub type Meta = [i32; META_INTS];

/// The mode a new (or reset) sequence starts in.
pub fn initial_mode(cfg: &ReplayConfig) -> i32 {
    if cfg.ring_len == 0 {
        MODE_RECURRENT
    } else if cfg.kv_only_threshold > 0 {
        MODE_KV_ONLY
    } else {
        MODE_REPLAY
    }
}

/// The record of a new (or reset) sequence.
pub fn initial(cfg: &ReplayConfig) -> Meta {
    let mut m = [0; META_INTS];
    m[META_MODE] = initial_mode(cfg);
    m[META_CONV_END] = if cfg.conv_dim > 0 {
        (cfg.conv_kernel - 1) as i32
    } else {
        0
    };
    m
}

/// The mode after an import (a state exists, the ring is empty).
pub fn imported_mode(cfg: &ReplayConfig) -> i32 {
    if cfg.ring_len == 0 {
        MODE_RECURRENT
    } else {
        MODE_REPLAY
    }
}

/// Whether a step of `t` tokens flushes the ring (or materializes a KV-only sequence's
/// state) first: decode when the ring cannot take the tokens, verify one window early
/// (`h + 2T > L`) so that a commit never overflows.
pub fn needs_flush(cfg: &ReplayConfig, m: &Meta, t: usize, auto_commit: bool) -> bool {
    let need = if auto_commit { t } else { 2 * t };
    match m[META_MODE] {
        MODE_REPLAY => m[META_H] as usize + need > cfg.ring_len,
        MODE_KV_ONLY => m[META_H] as usize + need > cfg.kv_only_threshold,
        _ => false,
    }
}

/// Where a step's new entries go: (flushes first, into the KV-only store, first position).
pub fn placement(cfg: &ReplayConfig, m: &Meta, t: usize, auto_commit: bool) -> (bool, bool, usize) {
    let flush = needs_flush(cfg, m, t, auto_commit);
    let (mode, start, h) = (m[META_MODE], m[META_START] as usize, m[META_H] as usize);
    match (mode, flush) {
        (MODE_KV_ONLY, false) => (false, true, h),
        (MODE_KV_ONLY, true) => (true, false, 0),
        (_, f) => (f, false, (start + h) % cfg.ring_len.max(1)),
    }
}

/// The record after a flush: the ring starts after the flushed entries, empty; replay mode.
pub fn flushed(cfg: &ReplayConfig, m: &mut Meta) {
    m[META_START] = if m[META_MODE] == MODE_REPLAY {
        ((m[META_START] + m[META_H]) as usize % cfg.ring_len) as i32
    } else {
        0
    };
    m[META_H] = 0;
    m[META_MODE] = MODE_REPLAY;
}
