//! The interface between the replay core and a family (its calls, checked into a
//! `StepPlan`), and the executor each backend provides (chosen once, when a pool is
//! created; it runs every family's plans).

use std::ops::Range;

use super::config::ReplayConfig;
use super::meta::Meta;
use super::plan::StepPlan;
use crate::backend::{Context, Stream};
use crate::error::Result;
use crate::pool::BatchIds;
use crate::tensor::TensorView;

/// A linear-attention family on the replay core.
pub trait Family: Sized + Send + Sync + 'static {
    /// The tensors of one decode or verify call.
    type Io<'a>: Copy;
    /// Options of one decode or verify call.
    type Options;
    /// The i32 `[B]` sequence ids of a call.
    fn seq_ids<'a>(io: &Self::Io<'a>) -> &'a TensorView;
    /// Checks a call of `b` rows against the pool (the ids are checked by the core) and
    /// returns the plan and the tokens per sequence (T; 1 for decode).
    fn plan(
        cfg: &ReplayConfig,
        ctx: &Context,
        io: &Self::Io<'_>,
        opts: &Self::Options,
        b: usize,
        decode: bool,
    ) -> Result<(StepPlan, usize)>;
}

/// One decode (`auto_commit`, T = 1) or verify (T drafts, pending until `commit`) launch.
pub struct Step<'a> {
    /// Layer.
    pub layer: usize,
    /// Batch rows.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Decode: the tokens are committed at once.
    pub auto_commit: bool,
    /// Some row may be a sequence in KV-only mode (false: every listed sequence surely
    /// has a state; the host's lower bound of each sequence's tokens, see `pool.rs`).
    pub kv_only_rows: bool,
    /// The most entries the host counts for such a row (0 where none may be KV-only): a
    /// lower bound of the rows' entries when a captured graph replays the step later, a
    /// hint for how many to fetch before the metadata arrives.
    pub kv_only_entries: usize,
    /// Sequence ids (-1: unused row, outputs zeros).
    pub ids: &'a BatchIds,
    /// The checked call.
    pub plan: &'a StepPlan,
}

/// A commit of the pending drafts of `ids` in `layers`.
pub struct Commit<'a> {
    /// Layers (one, or all).
    pub layers: Range<usize>,
    /// Host sequence ids (-1: unused row).
    pub ids: &'a [i32],
    /// Accepted counts when they are host data (checked against the pending counts).
    pub host_accepted: Option<&'a [i32]>,
    /// The caller's i32 `[B]` accepted counts (host or device memory).
    pub accepted: &'a TensorView,
    /// Where to write the conv window of the accepted prefix (`[B, conv_kernel-1, conv_dim]`).
    pub conv_state: Option<&'a TensorView>,
}

/// What a backend does for a pool; chosen once, when the pool is created. Every call has
/// been checked by the core: ids are live, shapes match, no pending drafts where none may
/// be.
pub trait Executor: Send + Sync {
    /// Zero state, empty ring, zero conv window, metadata `meta`, in every layer of `slot`.
    fn reset_slot(&self, slot: usize, meta: &Meta, stream: Stream) -> Result<()>;
    /// Replaces the state of (layer, slot) (and its conv window); the ring empties.
    fn import_state(
        &self,
        layer: usize,
        slot: usize,
        state: &TensorView,
        conv: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()>;
    /// Writes the current state of (layer, slot) (and its conv window); changes nothing.
    fn export_state(
        &self,
        layer: usize,
        slot: usize,
        out: &TensorView,
        conv_out: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()>;
    /// Writes the state of every layer of `slot` after its checkpoint and the first `keep`
    /// ring entries into `out` (`[layers, ...]`), and the conv windows at that point into
    /// `conv_out` (`[layers, conv_kernel - 1, conv_dim]`); changes nothing. The core has
    /// checked `keep` against every layer's ring fill.
    fn materialize(
        &self,
        slot: usize,
        keep: usize,
        out: &TensorView,
        conv_out: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()>;
    /// A decode or verify step.
    fn step(&self, step: &Step<'_>, stream: Stream) -> Result<()>;
    /// Commits pending drafts.
    fn commit(&self, commit: &Commit<'_>, stream: Stream) -> Result<()>;
    /// Writes the current state of each listed sequence into its checkpoint, empties the ring.
    fn flush(&self, layer: usize, ids: &[i32], stream: Stream) -> Result<()>;
    /// The metadata record of (layer, slot) (synchronizes on CUDA).
    fn read_meta(&self, layer: usize, slot: usize) -> Result<Meta>;
}
