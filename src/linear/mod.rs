//! Replay decoding for linear-attention / SSM layers. Gated DeltaNet (Qwen3-Next, Qwen3.5):
//! a checkpoint state plus a ring of recent inputs, flushes decided on the device, parallel
//! speculative verification without per-draft state, commit by moving a cursor, and a
//! KV-only mode for short sequences (CPU and CUDA).

pub mod gdn;
mod gdn_cpu;
mod gdn_cuda;
pub mod math;

pub use gdn::{GdnConfig, GdnIo, GdnMemory, GdnOptions, GdnPool, StateStorage, MAX_DRAFTS};
pub use math::StateLayout;
