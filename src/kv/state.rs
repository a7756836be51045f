//! The mutable state of a paged KV pool (behind its mutex): the page allocator, the
//! sequences, the host block table and lengths, and the device work not yet issued.

use super::allocator::BlockAllocator;
use super::config::KvPoolConfig;
use crate::pool::SlotTable;

/// A live sequence: its pages (one per `page_size` tokens) and length.
#[derive(Clone, Debug)]
pub(crate) struct SeqState {
    pub(crate) pages: Vec<u32>,
    pub(crate) len: usize,
}

/// Mutable pool state, behind the pool's mutex.
pub(crate) struct PoolState {
    pub(crate) alloc: BlockAllocator,
    pub(crate) seqs: SlotTable<SeqState>,
    /// Host mirror of the block table `[max_seqs][pages_per_seq]` and lengths `[max_seqs]`.
    pub(crate) table: Vec<i32>,
    pub(crate) lens: Vec<i32>,
    /// Device entries to patch: (index into [table | lens], value).
    pub(crate) patches: Vec<(u32, i32)>,
    /// Page pairs (source, destination) to copy for copy-on-write, not yet issued.
    pub(crate) page_copies: Vec<(u32, u32)>,
    pps: usize,
}

impl PoolState {
    /// The state of an empty pool.
    pub(crate) fn new(cfg: &KvPoolConfig) -> PoolState {
        let pps = cfg.pages_per_seq();
        PoolState {
            alloc: BlockAllocator::new(cfg.capacity_pages),
            seqs: SlotTable::new(cfg.max_seqs),
            table: vec![0; cfg.max_seqs * pps],
            lens: vec![0; cfg.max_seqs],
            patches: Vec::new(),
            page_copies: Vec::new(),
            pps,
        }
    }

    /// Sets the length of `slot` (host mirror and a device patch).
    pub(crate) fn set_len(&mut self, slot: usize, len: usize) {
        self.lens[slot] = len as i32;
        let idx = (self.seqs.capacity() * self.pps + slot) as u32;
        self.patches.push((idx, len as i32));
    }

    /// Sets table entry `i` of `slot` (host mirror and a device patch).
    pub(crate) fn set_table(&mut self, slot: usize, i: usize, page: u32) {
        let idx = slot * self.pps + i;
        self.table[idx] = page as i32;
        self.patches.push((idx as u32, page as i32));
    }

    /// The sequence in `slot` (live).
    pub(crate) fn seq(&self, slot: usize) -> &SeqState {
        self.seqs.get(slot as i32).expect("live")
    }

    /// The sequence in `slot` (live), mutable.
    pub(crate) fn seq_mut(&mut self, slot: usize) -> &mut SeqState {
        self.seqs.get_mut(slot as i32).expect("live")
    }
}
