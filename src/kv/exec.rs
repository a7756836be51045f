//! What a backend does for a paged KV pool, chosen once when the pool is created: the CPU
//! executor here, the CUDA one in `cuda.rs`. Every call has been checked by the pool.

use std::ops::Range;
use std::sync::Arc;

use super::config::{KvPoolConfig, LayerLayout};
use super::decode::DecodePlan;
use super::state::PoolState;
use crate::backend::cpu::CpuBackend;
use crate::backend::Stream;
use crate::error::Result;
use crate::tensor::TensorView;

/// A write of tokens: (slot, first position, count, first source token) per sequence.
pub(crate) type Placed = [(usize, usize, usize, usize)];

/// A backend of the paged KV pool.
pub(crate) trait KvExecutor: Send + Sync {
    /// Issues the pool's pending table work: copy-on-write page copies, then block-table
    /// and length patches (the CPU copies pages now; its host table is the table). On
    /// failure the pending work stays for the next call.
    fn sync_tables(&self, st: &mut PoolState, stream: Stream) -> Result<()>;
    /// Writes K and V of `placed` tokens for `layers`.
    fn write_tokens(
        &self,
        st: &PoolState,
        layers: Range<usize>,
        placed: &Placed,
        k: &TensorView,
        v: &TensorView,
        stream: Stream,
    ) -> Result<()>;
    /// Device addresses of the block table `[max_seqs][pages_per_seq]` and the lengths
    /// `[max_seqs]` that decode reads (None on the CPU, whose host mirror is the table).
    fn device_tables(&self) -> Option<(usize, usize)> {
        None
    }
    /// Attention over one layer (`lay`) for a checked batch.
    fn decode(
        &self,
        lay: &LayerLayout,
        st: &PoolState,
        plan: &DecodePlan,
        stream: Stream,
    ) -> Result<()>;
}

/// The CPU executor: host memory, the context's thread pool.
pub(crate) struct CpuKv {
    cpu: Arc<CpuBackend>,
    cfg: KvPoolConfig,
    layout: Vec<LayerLayout>,
}

impl CpuKv {
    pub(crate) fn new(cpu: Arc<CpuBackend>, cfg: KvPoolConfig, layout: Vec<LayerLayout>) -> Self {
        CpuKv { cpu, cfg, layout }
    }
}

impl KvExecutor for CpuKv {
    fn sync_tables(&self, st: &mut PoolState, _stream: Stream) -> Result<()> {
        for (src, dst) in std::mem::take(&mut st.page_copies) {
            super::cpu::copy_page(&self.cfg, &self.layout, src, dst);
        }
        st.patches.clear();
        Ok(())
    }
    fn write_tokens(
        &self,
        st: &PoolState,
        layers: Range<usize>,
        placed: &Placed,
        k: &TensorView,
        v: &TensorView,
        _stream: Stream,
    ) -> Result<()> {
        super::cpu::write_tokens(&self.cfg, &self.layout, st, layers, placed, k, v);
        Ok(())
    }
    fn decode(
        &self,
        lay: &LayerLayout,
        st: &PoolState,
        plan: &DecodePlan,
        _stream: Stream,
    ) -> Result<()> {
        super::cpu::decode(&self.cfg, lay, st, plan, self.cpu.pool());
        Ok(())
    }
}
