//! Page allocation with reference counts: O(1) allocate, retain and release.

/// Hands out page ids `0..capacity` and counts references to each; a page returns to the
/// free list when its last reference is released.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    /// Free pages; `pop` returns the lowest ids first on a fresh allocator.
    free: Vec<u32>,
    refs: Vec<u32>,
    /// Pages with more than one reference.
    shared: usize,
}

impl BlockAllocator {
    /// An allocator of `capacity` free pages.
    pub fn new(capacity: usize) -> Self {
        BlockAllocator {
            free: (0..capacity as u32).rev().collect(),
            refs: vec![0; capacity],
            shared: 0,
        }
    }

    /// Total pages.
    pub fn capacity(&self) -> usize {
        self.refs.len()
    }
    /// Pages on the free list.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
    /// Pages with at least one reference.
    pub fn used_count(&self) -> usize {
        self.refs.len() - self.free.len()
    }
    /// Pages with more than one reference.
    pub fn shared_count(&self) -> usize {
        self.shared
    }
    /// References to `page`.
    pub fn refcount(&self, page: u32) -> u32 {
        self.refs[page as usize]
    }

    /// Takes `n` pages with one reference each, or none if fewer than `n` are free.
    pub fn alloc_n(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let pages = self.free.split_off(self.free.len() - n);
        let mut pages = pages;
        pages.reverse();
        for &p in &pages {
            debug_assert_eq!(self.refs[p as usize], 0);
            self.refs[p as usize] = 1;
        }
        Some(pages)
    }

    /// Adds a reference to a used page.
    pub fn retain(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        debug_assert!(*r > 0, "retain of free page {page}");
        *r += 1;
        if *r == 2 {
            self.shared += 1;
        }
    }

    /// Drops a reference; returns true when the page became free.
    pub fn release(&mut self, page: u32) -> bool {
        let r = &mut self.refs[page as usize];
        debug_assert!(*r > 0, "release of free page {page}");
        *r -= 1;
        match *r {
            0 => {
                self.free.push(page);
                true
            }
            1 => {
                self.shared -= 1;
                false
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_retain_release() {
        let mut a = BlockAllocator::new(4);
        assert_eq!(a.alloc_n(2), Some(vec![0, 1]));
        assert_eq!(a.alloc_n(3), None);
        assert_eq!(a.free_count(), 2);
        a.retain(1);
        assert_eq!(a.shared_count(), 1);
        assert!(!a.release(1));
        assert_eq!(a.shared_count(), 0);
        assert!(a.release(1));
        assert_eq!(a.free_count(), 3);
        assert_eq!(a.alloc_n(3).map(|v| v.len()), Some(3));
        assert_eq!(a.used_count(), 4);
    }
}
