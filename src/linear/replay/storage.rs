//! Where a replay pool's parts live: the one offset function per part that the CPU
//! executor, the CUDA launch parameters and the cursor all use.
//!
//! Per (layer, sequence slot): a checkpoint state (pool-owned, or the caller's memory
//! through a per-layer pointer and stride), `max_drafts` state snapshots (recurrent pools),
//! `ring_len` ring entries split into u `[Hv][dv]`, k `[Hk][dk]` (entry dtype) and g `[Hv]`
//! (f32) arrays, a conv window of `conv_slots` inputs, and a metadata record. Each part is
//! one array `[layers][max_seqs][part]`; KV-only entries live inside the state memory of
//! their value head: u `[cap][dv]`, k `[cap][dk]` (entry dtype), then g `[cap]` (f32).

use std::sync::Arc;

use super::config::ReplayConfig;
use super::meta::META_INTS;
use crate::backend::buffer::Buffer;
use crate::backend::{BackendKind, Context};
use crate::error::{Error, Result};

/// Where a layer's states live: address of sequence 0 and the stride between sequences,
/// in elements (the heads of one sequence are contiguous, `dk * dv` each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateStorage {
    /// Address of sequence slot 0's state.
    pub addr: usize,
    /// Elements between consecutive sequence slots (>= v_heads * dk * dv).
    pub seq_stride: usize,
}

/// One pool-owned part: `[layers][slots]` blocks of `slot_bytes` from `base` (0: absent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Part {
    /// Address of (layer 0, slot 0); 0 where the pool keeps no such part.
    pub base: usize,
    /// Bytes of one (layer, slot).
    pub slot_bytes: usize,
    slots: usize,
}

impl Part {
    fn new(base: usize, slot_bytes: usize, slots: usize) -> Part {
        Part {
            base,
            slot_bytes,
            slots,
        }
    }
    /// Address of (layer, slot); 0 for an absent part.
    pub fn at(&self, layer: usize, slot: usize) -> usize {
        if self.base == 0 {
            0
        } else {
            self.base + (layer * self.slots + slot) * self.slot_bytes
        }
    }
    /// Bytes of one layer.
    pub fn layer_bytes(&self) -> usize {
        self.slots * self.slot_bytes
    }
}

/// Addresses of every part of a pool (host memory for CPU pools, device memory for CUDA).
#[derive(Clone, Debug)]
pub struct Layout {
    /// The pool's configuration.
    pub cfg: ReplayConfig,
    /// Per-layer checkpoint states.
    pub states: Vec<StateStorage>,
    /// Per-draft snapshots (recurrent pools).
    pub snaps: Part,
    /// Ring values u.
    pub ring_u: Part,
    /// Ring keys.
    pub ring_k: Part,
    /// Ring log decays.
    pub ring_g: Part,
    /// Conv windows.
    pub conv: Part,
    /// Metadata records (`META_INTS` i32 each).
    pub meta: Part,
}

impl Layout {
    /// State of (layer, slot), all value heads.
    pub fn state(&self, layer: usize, slot: usize) -> usize {
        let s = &self.states[layer];
        s.addr + slot * s.seq_stride * self.cfg.state_dtype.size()
    }
    /// State of value head `h` of (layer, slot).
    pub fn head_state(&self, layer: usize, slot: usize, h: usize) -> usize {
        let c = &self.cfg;
        self.state(layer, slot) + h * c.dk * c.dv * c.state_dtype.size()
    }
    /// Snapshot of draft `draft`, value head `h`.
    pub fn snapshot(&self, layer: usize, slot: usize, draft: usize, h: usize) -> usize {
        let c = &self.cfg;
        self.snaps.at(layer, slot)
            + (draft * c.seq_state_elems() + h * c.dk * c.dv) * c.state_dtype.size()
    }
    /// Ring position `pos`: u of value head `h`.
    pub fn ring_u(&self, layer: usize, slot: usize, pos: usize, h: usize) -> usize {
        let c = &self.cfg;
        self.ring_u.at(layer, slot) + ((pos * c.v_heads + h) * c.dv) * c.entry_dtype.size()
    }
    /// Ring position `pos`: key of key head `kh`.
    pub fn ring_k(&self, layer: usize, slot: usize, pos: usize, kh: usize) -> usize {
        let c = &self.cfg;
        self.ring_k.at(layer, slot) + ((pos * c.k_heads + kh) * c.dk) * c.entry_dtype.size()
    }
    /// Ring position `pos`: log decay of value head `h`.
    pub fn ring_g(&self, layer: usize, slot: usize, pos: usize, h: usize) -> usize {
        self.ring_g.at(layer, slot) + (pos * self.cfg.v_heads + h) * 4
    }
    /// KV-only entry `j` of value head `h`: u.
    pub fn kv_u(&self, layer: usize, slot: usize, h: usize, j: usize) -> usize {
        let c = &self.cfg;
        self.head_state(layer, slot, h) + j * c.dv * c.entry_dtype.size()
    }
    /// KV-only entry `j` of value head `h`: key.
    pub fn kv_k(&self, layer: usize, slot: usize, h: usize, j: usize) -> usize {
        let c = &self.cfg;
        self.head_state(layer, slot, h)
            + (c.kv_only_capacity() * c.dv + j * c.dk) * c.entry_dtype.size()
    }
    /// KV-only entry `j` of value head `h`: log decay.
    pub fn kv_g(&self, layer: usize, slot: usize, h: usize, j: usize) -> usize {
        let c = &self.cfg;
        self.head_state(layer, slot, h)
            + c.kv_only_capacity() * (c.dv + c.dk) * c.entry_dtype.size()
            + j * 4
    }
    /// Conv-window slot `i`.
    pub fn conv(&self, layer: usize, slot: usize, i: usize) -> usize {
        let c = &self.cfg;
        self.conv.at(layer, slot) + i * c.conv_dim * c.conv_dtype.size()
    }
    /// Metadata record of (layer, slot).
    pub fn meta(&self, layer: usize, slot: usize) -> usize {
        self.meta.at(layer, slot)
    }
    /// Index (in i32 elements from the metadata base) of one field of (layer, slot).
    pub fn meta_index(&self, layer: usize, slot: usize, field: usize) -> u32 {
        ((layer * self.cfg.max_seqs + slot) * META_INTS + field) as u32
    }
}

fn checked_bytes(parts: &[usize]) -> Result<usize> {
    parts
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| Error::OutOfRange("pool size overflows".into()))
}

/// The pool's memory: its layout and the buffers it owns (zeroed at creation).
pub(crate) struct Storage {
    pub layout: Layout,
    _owned: Vec<Buffer>,
}

impl Storage {
    /// Allocates the parts of a pool; `external` gives per-layer state memory (None: owned).
    pub fn new(
        ctx: &Arc<Context>,
        cfg: &ReplayConfig,
        external: Option<Vec<StateStorage>>,
    ) -> Result<Storage> {
        let (l, n) = (cfg.layers, cfg.max_seqs);
        let mut owned = Vec::new();
        let mut alloc = |slot_bytes: usize| -> Result<Part> {
            let bytes = checked_bytes(&[l, n, slot_bytes])?;
            if bytes == 0 {
                return Ok(Part::new(0, slot_bytes, n));
            }
            let b = Buffer::zeroed(ctx, bytes)?;
            let a = b.addr();
            owned.push(b);
            Ok(Part::new(a, slot_bytes, n))
        };
        let states = match external {
            None => {
                let part = alloc(cfg.state_bytes())?;
                (0..l)
                    .map(|i| StateStorage {
                        addr: part.at(i, 0),
                        seq_stride: cfg.seq_state_elems(),
                    })
                    .collect()
            }
            Some(v) => {
                check_external(ctx, cfg, &v)?;
                v
            }
        };
        let snaps = if cfg.ring_len == 0 {
            alloc(checked_bytes(&[cfg.max_drafts, cfg.state_bytes()])?)?
        } else {
            Part::default()
        };
        let e = cfg.entry_dtype.size();
        let ring_u = alloc(checked_bytes(&[cfg.ring_len, cfg.v_heads * cfg.dv * e])?)?;
        let ring_k = alloc(checked_bytes(&[cfg.ring_len, cfg.k_heads * cfg.dk * e])?)?;
        let ring_g = alloc(checked_bytes(&[cfg.ring_len, cfg.v_heads * 4])?)?;
        let conv = alloc(checked_bytes(&[
            cfg.conv_slots(),
            cfg.conv_dim * cfg.conv_dtype.size(),
        ])?)?;
        let meta = alloc(META_INTS * 4)?;
        Ok(Storage {
            layout: Layout {
                cfg: *cfg,
                states,
                snaps,
                ring_u,
                ring_k,
                ring_g,
                conv,
                meta,
            },
            _owned: owned,
        })
    }
}

fn check_external(ctx: &Context, cfg: &ReplayConfig, v: &[StateStorage]) -> Result<()> {
    if v.len() != cfg.layers {
        return Err(Error::InvalidArgument(format!(
            "{} state layouts for {} layers",
            v.len(),
            cfg.layers
        )));
    }
    let align = if ctx.backend() == BackendKind::Cuda {
        16
    } else {
        cfg.state_dtype.size()
    };
    for (i, s) in v.iter().enumerate() {
        if s.addr == 0 {
            return Err(Error::NullArgument(format!(
                "layer {i}: state pointer is NULL"
            )));
        }
        if s.addr % align != 0 || (s.seq_stride * cfg.state_dtype.size()) % align != 0 {
            return Err(Error::InvalidArgument(format!(
                "layer {i}: state pointer and stride must be multiples of {align} bytes"
            )));
        }
        if s.seq_stride < cfg.seq_state_elems() {
            return Err(Error::InvalidArgument(format!(
                "layer {i}: seq_stride {} is smaller than one state ({} elements)",
                s.seq_stride,
                cfg.seq_state_elems()
            )));
        }
    }
    Ok(())
}
