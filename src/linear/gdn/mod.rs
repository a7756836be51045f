//! Gated DeltaNet (Qwen3-Next, Qwen3.5), the first family on the replay core: the entry of
//! a token is `u = beta (v - S k)` per value head (S the state before the token), its
//! L2-normalized key and its log decay; verify solves the drafts' corrections in parallel
//! (`math::verify_head`). Kernels: kernels/gdn*.cu.

mod cpu;
mod cuda;
mod io;

use std::sync::Arc;

pub use io::{Gdn, GdnIo, GdnOptions, GdnPlan};

use crate::backend::cpu::ThreadPool;
use crate::backend::cuda::CudaBackend;
use crate::backend::Context;
use crate::error::Result;
use crate::linear::replay::{Executor, Family, Layout, ReplayConfig, ReplayPool, Step};
use crate::tensor::TensorView;

/// A Gated DeltaNet replay pool.
pub type GdnPool = ReplayPool<Gdn>;
/// Shape and policy of a GDN pool.
pub type GdnConfig = ReplayConfig;

impl Family for Gdn {
    type Io<'a> = GdnIo<'a>;
    type Options = GdnOptions;
    type Plan = GdnPlan;

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
    ) -> Result<(GdnPlan, usize)> {
        io::plan(c, ctx, io, opts, b, decode)
    }

    fn cpu_step(layout: &Layout, step: &Step<'_, GdnPlan>, threads: &ThreadPool) {
        cpu::step(layout, step, threads)
    }

    fn cuda_executor(cuda: Arc<CudaBackend>, layout: &Layout) -> Result<Box<dyn Executor<Gdn>>> {
        Ok(Box::new(cuda::GdnCuda::new(cuda, layout)?))
    }
}
