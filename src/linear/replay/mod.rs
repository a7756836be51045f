//! The replay core shared by every linear-attention family: a pool of sequence slots, each
//! holding per layer a checkpoint state plus a ring of the last `ring_len` entries, and the
//! protocol around them (decode, verify, commit, flush, import, export, reset).
//!
//! # What is kept per (sequence, layer)
//!
//! - A **checkpoint state** slot `[Hv][dk][dv]` (K-major) or `[Hv][dv][dk]` (V-major), f32
//!   or bf16, owned by the pool or in the caller's memory (per-layer pointer + stride).
//! - A **ring** of the last `ring_len` (L) entries `(u, k, g)`: a value-side vector per
//!   value head, a key per key head and a log decay per value head, with a start cursor
//!   and a committed count `h` (`math::Entry`; each family says how it forms them: GDN
//!   `u = beta (v - S k)`, Mamba-2 `u = dt x, k = B, g = dt A`, linear attention `u = v`).
//!   The state is written only when the ring flushes (decode: when it is full; verify:
//!   when `h + 2T > L`, one window early), and the flush decision is made per sequence
//!   where the kernels run.
//! - **KV-only mode** for short sequences: while a sequence has fewer than
//!   `kv_only_threshold` tokens, no state exists: its entries live in the memory of its
//!   (unused) state slot, laid out per value head, and outputs come from the entries
//!   alone. When the next step would overflow the threshold, the state is materialized
//!   from the entries and the sequence continues in replay mode.
//! - A **conv window ring** (when `conv_dim` > 0): the raw conv inputs of the last
//!   `conv_kernel - 1` committed tokens plus the current drafts. kvreplay does not run the
//!   conv; after a speculative round, `commit` writes the conv state of the accepted prefix
//!   back into the caller's conv-state tensor, so no per-draft conv snapshot is needed.
//! - A metadata record (`meta.rs`) that lives where the kernels run and is advanced by
//!   them (commit counts can be device data: the host never synchronizes).
//!
//! With `ring_len = 0` the pool is **recurrent**: every step reads and writes the state,
//! and verify keeps one state snapshot per draft (the baseline engines use today).
//!
//! # Where a family plugs in
//!
//! A family implements [`Family`]: its step tensors (`Io`), options, the check that turns
//! them into a plan, and the executors of its backends ([`Executor`]), picked once when a
//! pool is created. The CPU executor builds on `cpu.rs` (the generic slot operations);
//! storage offsets come from `storage.rs` only.

pub mod config;
pub mod cpu;
mod cuda;
pub mod exec;
pub mod meta;
pub mod plan;
mod pool;
mod step;
pub mod storage;

pub use config::{ReplayConfig, ReplayMemory, MAX_DRAFTS};
pub use exec::{Commit, Executor, Family, Step};
pub use plan::{DtGate, Rule, StepPlan};
pub use pool::ReplayPool;
pub use storage::{Layout, Part, StateStorage};
