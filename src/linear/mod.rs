//! Replay decoding for linear-attention / SSM layers: the replay core (`replay`: a
//! checkpoint state plus a ring of recent inputs, flushes decided where the kernels run,
//! parallel speculative verification without per-draft state, commit by moving a cursor,
//! KV-only mode for short sequences) and its families: Gated DeltaNet (`gdn`), Mamba-2
//! (`mamba2`) and linear attention (`linattn`).

pub mod gdn;
pub mod linattn;
pub mod mamba2;
pub mod math;
pub mod replay;

/// The stateless recurrent GDN step over caller tensors (`kvr_context_gdn_recurrent`).
pub use gdn::{recurrent as gdn_recurrent, HeadMap, RecurrentIo, RecurrentOptions};
pub use gdn::{Gdn, GdnConfig, GdnIo, GdnOptions, GdnPool};
pub use linattn::{LinAttn, LinAttnIo, LinAttnOptions, LinAttnPool};
pub use mamba2::{Mamba2, Mamba2Io, Mamba2Options, Mamba2Pool};
pub use math::StateLayout;
pub use replay::{Family, ReplayConfig, ReplayMemory, ReplayPool, StateStorage, MAX_DRAFTS};
/// Memory of one sequence of a GDN pool.
pub type GdnMemory = ReplayMemory;
