//! Replay decoding for linear-attention / SSM layers: the replay core (`replay`: a
//! checkpoint state plus a ring of recent inputs, flushes decided where the kernels run,
//! parallel speculative verification without per-draft state, commit by moving a cursor,
//! KV-only mode for short sequences) and its families, Gated DeltaNet first (`gdn`).

pub mod gdn;
pub mod math;
pub mod replay;

pub use gdn::{Gdn, GdnConfig, GdnIo, GdnOptions, GdnPool};
pub use math::StateLayout;
pub use replay::{Family, ReplayConfig, ReplayMemory, ReplayPool, StateStorage, MAX_DRAFTS};
/// Memory of one sequence of a GDN pool.
pub type GdnMemory = ReplayMemory;
