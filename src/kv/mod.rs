//! Paged KV memory for softmax-attention layers: a page pool with per-sequence block
//! tables, copy-on-write forks, truncation, admission checks, and batched split-K decode
//! that reads K/V through the block table (CPU and CUDA).

pub mod allocator;
mod cpu;
pub(crate) mod cuda;
pub mod decode;
pub mod pool;
pub mod sizing;

pub use allocator::BlockAllocator;
pub use decode::{DecodeIo, DecodeOptions, MAX_GQA_GROUP, MAX_QUERY_TOKENS};
pub use pool::{Admission, KvPool, KvPoolConfig, KvStorage, LayerLayout, PoolStats, SeqId};
