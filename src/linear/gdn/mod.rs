//! Gated DeltaNet (Qwen3-Next, Qwen3.5), the first family on the replay core: the entry of
//! a token is `u = beta (v - S k)` per value head (S the state before the token), its
//! L2-normalized key and its log decay; verify solves the drafts' corrections in parallel
//! (`math::verify_head`). Kernels: kernels/gdn*.cu.

mod io;
mod recur;

pub use io::{Gdn, GdnIo, GdnOptions};
pub use recur::{recurrent, HeadMap, RecurrentIo, RecurrentOptions};

use crate::backend::Context;
use crate::error::Result;
use crate::linear::replay::{Family, ReplayConfig, ReplayPool, StepPlan};
use crate::tensor::TensorView;

/// A Gated DeltaNet replay pool.
pub type GdnPool = ReplayPool<Gdn>;
/// Shape and policy of a GDN pool.
pub type GdnConfig = ReplayConfig;

impl Family for Gdn {
    type Io<'a> = GdnIo<'a>;
    type Options = GdnOptions;

    fn seq_ids<'a>(io: &Self::Io<'a>) -> &'a TensorView {
        io.seq_ids
    }

    fn plan(
        c: &ReplayConfig,
        ctx: &Context,
        io: &GdnIo<'_>,
        opts: &GdnOptions,
        b: usize,
        decode: bool,
    ) -> Result<(StepPlan, usize)> {
        io::plan(c, ctx, io, opts, b, decode)
    }
}
