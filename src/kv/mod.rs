//! Paged KV memory for softmax-attention layers: a page pool with per-sequence block
//! tables, copy-on-write forks, truncation, admission checks, and batched split-K decode
//! that reads K/V through the block table (CPU and CUDA).

pub mod allocator;
pub mod config;
mod cpu;
mod cuda;
pub mod decode;
mod exec;
pub mod pool;
pub mod sizing;
mod state;
pub mod wgkv;

pub use allocator::BlockAllocator;
pub use config::{KvPoolConfig, LayerLayout, SeqId};
pub use decode::{DecodeIo, DecodeOptions, MAX_GQA_GROUP, MAX_QUERY_TOKENS};
pub use pool::{Admission, KvPool, KvStorage, PoolStats};
