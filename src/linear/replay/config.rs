//! The configuration of a replay pool: shape, policy, memory per sequence.

use crate::error::{Error, Result};
use crate::linear::math::StateLayout;
use crate::pool::require_positive;
use crate::tensor::DType;

/// Most draft tokens one verify can carry.
pub const MAX_DRAFTS: usize = crate::abi::KVR_GDN_MAX_T;

/// Shape and policy of a replay pool. The field names are GDN's; other families map onto
/// them: a value head is a head of the recurrence (Mamba-2: `nheads`, dv = head dim P), a
/// key head a group sharing keys (Mamba-2: `ngroups` of B, dk = state dim N).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayConfig {
    /// Layers of the family kept by the pool.
    pub layers: usize,
    /// Key heads (Hk).
    pub k_heads: usize,
    /// Value heads (Hv, a multiple of Hk).
    pub v_heads: usize,
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// Ring length L; 0 = recurrent mode.
    pub ring_len: usize,
    /// Sequences of at most this many tokens keep no state (KV-only); 0 = off.
    pub kv_only_threshold: usize,
    /// Most drafts per verify (1..=8).
    pub max_drafts: usize,
    /// f32 or bf16 state.
    pub state_dtype: DType,
    /// f32, f16 or bf16 ring entries (f32: replay equals recurrent to f32 rounding).
    pub entry_dtype: DType,
    /// State layout.
    pub layout: StateLayout,
    /// Sequence slots.
    pub max_seqs: usize,
    /// Channels of the conv input (0: no conv window is kept).
    pub conv_dim: usize,
    /// Conv kernel width (the window keeps `conv_kernel - 1` inputs).
    pub conv_kernel: usize,
    /// Element type of the conv window.
    pub conv_dtype: DType,
}

impl ReplayConfig {
    /// State elements of one sequence in one layer.
    pub fn seq_state_elems(&self) -> usize {
        self.v_heads * self.dk * self.dv
    }
    /// Bytes of one (sequence, layer) state.
    pub fn state_bytes(&self) -> usize {
        self.seq_state_elems() * self.state_dtype.size()
    }
    /// Bytes of one ring entry (all heads).
    pub fn entry_bytes(&self) -> usize {
        (self.v_heads * self.dv + self.k_heads * self.dk) * self.entry_dtype.size()
            + self.v_heads * 4
    }
    /// Entries of the conv window ring.
    pub fn conv_slots(&self) -> usize {
        if self.conv_dim == 0 {
            0
        } else {
            self.conv_kernel - 1 + self.max_drafts
        }
    }
    /// Most KV-only entries one value head's state memory holds.
    pub fn kv_only_capacity(&self) -> usize {
        let head_bytes = self.dk * self.dv * self.state_dtype.size();
        head_bytes / ((self.dk + self.dv) * self.entry_dtype.size() + 4)
    }
    /// Memory of one sequence (all layers), by part.
    pub fn memory(&self) -> ReplayMemory {
        let l = self.layers;
        ReplayMemory {
            state_bytes: l * self.state_bytes(),
            ring_bytes: l * self.ring_len * self.entry_bytes(),
            conv_bytes: l * self.conv_slots() * self.conv_dim * self.conv_dtype.size(),
            snapshot_bytes: if self.ring_len == 0 {
                l * self.max_drafts * self.state_bytes()
            } else {
                0
            },
        }
    }

    /// Checks the configuration (backend limits are checked when a pool is created).
    pub fn validate(&self) -> Result<()> {
        require_positive(&[
            ("layers", self.layers),
            ("k_heads", self.k_heads),
            ("v_heads", self.v_heads),
            ("dk", self.dk),
            ("dv", self.dv),
            ("max_seqs", self.max_seqs),
            ("max_drafts", self.max_drafts),
        ])?;
        if self.v_heads % self.k_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "v_heads ({}) must be a multiple of k_heads ({})",
                self.v_heads, self.k_heads
            )));
        }
        if self.max_drafts > MAX_DRAFTS {
            return Err(Error::OutOfRange(format!(
                "max_drafts {} exceeds {MAX_DRAFTS}",
                self.max_drafts
            )));
        }
        if !matches!(self.state_dtype, DType::F32 | DType::BF16) {
            return Err(Error::DTypeMismatch(format!(
                "state dtype must be f32 or bf16, not {}",
                self.state_dtype
            )));
        }
        if !self.entry_dtype.is_float() || !self.conv_dtype.is_float() {
            return Err(Error::DTypeMismatch(
                "entry and conv dtypes must be f32, f16 or bf16".into(),
            ));
        }
        if self.ring_len > 0 && self.ring_len < self.max_drafts {
            return Err(Error::InvalidArgument(format!(
                "ring_len {} cannot hold max_drafts {} drafts",
                self.ring_len, self.max_drafts
            )));
        }
        if self.ring_len > 1024 {
            return Err(Error::OutOfRange(format!(
                "ring_len {} exceeds 1024",
                self.ring_len
            )));
        }
        if self.kv_only_threshold > 0 {
            if self.ring_len == 0 {
                return Err(Error::InvalidArgument(
                    "KV-only mode needs a ring (ring_len > 0)".into(),
                ));
            }
            let cap = self.kv_only_capacity();
            if self.kv_only_threshold > cap {
                return Err(Error::OutOfRange(format!(
                    "kv_only_threshold {} exceeds the {cap} entries one head's state memory holds",
                    self.kv_only_threshold
                )));
            }
        }
        if self.conv_dim > 0 && !(2..=16).contains(&self.conv_kernel) {
            return Err(Error::InvalidArgument(format!(
                "conv_kernel {} must be 2..=16",
                self.conv_kernel
            )));
        }
        if self.dk > 256 || self.dv > 256 {
            return Err(Error::OutOfRange("dk and dv must be at most 256".into()));
        }
        if self.max_seqs > 1 << 20 || self.layers > 4096 {
            return Err(Error::OutOfRange("max_seqs or layers too large".into()));
        }
        Ok(())
    }
}

/// Bytes one sequence needs (all layers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayMemory {
    /// Checkpoint states.
    pub state_bytes: usize,
    /// Rings.
    pub ring_bytes: usize,
    /// Conv windows.
    pub conv_bytes: usize,
    /// Per-draft state snapshots (recurrent pools only).
    pub snapshot_bytes: usize,
}

impl ReplayMemory {
    /// Total.
    pub fn total(&self) -> usize {
        self.state_bytes + self.ring_bytes + self.conv_bytes + self.snapshot_bytes
    }
}
