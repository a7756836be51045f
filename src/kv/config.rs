//! The shape of a paged KV pool and where its layers live (shared by the pool and its
//! CPU and CUDA executors).

use crate::error::{Error, Result};
use crate::pool::require_positive;
use crate::tensor::DType;

/// Most write groups of one CUDA write launch (kernels/kvr_abi.h); a write takes at most 64
/// launches' worth of sequences on every backend.
pub(crate) use crate::abi::KVR_KV_MAX_WRITE_GROUPS as MAX_WRITE_GROUPS;

/// A sequence id: a slot in `0..max_seqs`.
pub type SeqId = i32;

/// Shape and capacity of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPoolConfig {
    /// Attention layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per page (any >= 1).
    pub page_size: usize,
    /// Element type of K and V.
    pub dtype: DType,
    /// Pages in the pool.
    pub capacity_pages: usize,
    /// Sequence slots.
    pub max_seqs: usize,
    /// Longest sequence (sets the block-table width).
    pub max_seq_len: usize,
}

impl KvPoolConfig {
    /// Bytes of K plus V for one page across all layers.
    pub fn page_bytes(&self) -> usize {
        2 * self.layers * self.kv_heads * self.page_size * self.head_dim * self.dtype.size()
    }
    /// Block-table entries per sequence.
    pub fn pages_per_seq(&self) -> usize {
        self.max_seq_len.div_ceil(self.page_size)
    }
    /// The capacity, in pages, that a byte budget for K and V buys.
    pub fn pages_for_budget(&self, bytes: usize) -> usize {
        bytes / self.page_bytes().max(1)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        require_positive(&[
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("page_size", self.page_size),
            ("capacity_pages", self.capacity_pages),
            ("max_seqs", self.max_seqs),
            ("max_seq_len", self.max_seq_len),
        ])?;
        if !self.dtype.is_float() {
            return Err(Error::DTypeMismatch(format!(
                "KV dtype must be f32, f16 or bf16, not {}",
                self.dtype
            )));
        }
        // Device-side indices are 32-bit.
        let limits = [
            ("capacity_pages", self.capacity_pages, i32::MAX as usize),
            ("max_seqs", self.max_seqs, 1 << 20),
            ("max_seq_len", self.max_seq_len, i32::MAX as usize / 2),
            ("page_size", self.page_size, 1 << 24),
            ("layers", self.layers, 4096),
            ("kv_heads", self.kv_heads, 4096),
            ("head_dim", self.head_dim, 1 << 16),
        ];
        for (name, v, max) in limits {
            if v > max {
                return Err(Error::OutOfRange(format!("{name} = {v} exceeds {max}")));
            }
        }
        let table = self.max_seqs.checked_mul(self.pages_per_seq());
        if table.is_none_or(|t| t > (i32::MAX as usize) / 2) {
            return Err(Error::OutOfRange(format!(
                "the block table ({} sequences x {} pages) is too large; lower max_seqs or max_seq_len",
                self.max_seqs,
                self.pages_per_seq()
            )));
        }
        Ok(())
    }
}

/// Where one layer's K and V live: addresses and (page, head, token) strides in elements;
/// the head dimension is contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    /// Address of page 0, head 0, slot 0 of K.
    pub k: usize,
    /// Address of page 0, head 0, slot 0 of V.
    pub v: usize,
    /// K strides: page, head, token.
    pub k_strides: [usize; 3],
    /// V strides: page, head, token.
    pub v_strides: [usize; 3],
}
