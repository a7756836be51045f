//! The sequence slots of a pool: ids are slot indices, a new sequence takes the lowest free
//! slot, and a freed id is unknown until it is handed out again.

use crate::error::{Error, Result};

/// Sequence slots holding a `T` per live sequence.
#[derive(Clone, Debug)]
pub struct SlotTable<T> {
    slots: Vec<Option<T>>,
}

impl<T> SlotTable<T> {
    /// `capacity` empty slots.
    pub fn new(capacity: usize) -> Self {
        SlotTable {
            slots: (0..capacity).map(|_| None).collect(),
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Live sequences.
    pub fn live_count(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// The lowest free slot, or `PoolExhausted`.
    pub fn free_slot(&self) -> Result<usize> {
        self.slots.iter().position(Option::is_none).ok_or_else(|| {
            Error::PoolExhausted(format!(
                "all {} sequence slots are in use",
                self.slots.len()
            ))
        })
    }

    /// Puts `value` into free slot `slot` (from `free_slot`).
    pub fn fill(&mut self, slot: usize, value: T) {
        debug_assert!(self.slots[slot].is_none());
        self.slots[slot] = Some(value);
    }

    /// Whether `id` names a live sequence.
    pub fn is_live(&self, id: i32) -> bool {
        id >= 0 && (id as usize) < self.slots.len() && self.slots[id as usize].is_some()
    }

    /// The slot of live sequence `id`, or `UnknownId`.
    pub fn slot(&self, id: i32) -> Result<usize> {
        if self.is_live(id) {
            Ok(id as usize)
        } else {
            Err(Error::UnknownId(format!("sequence {id} is not live")))
        }
    }

    /// The value of live sequence `id`.
    pub fn get(&self, id: i32) -> Result<&T> {
        let s = self.slot(id)?;
        Ok(self.slots[s].as_ref().expect("live"))
    }

    /// The value of live sequence `id`, mutable.
    pub fn get_mut(&mut self, id: i32) -> Result<&mut T> {
        let s = self.slot(id)?;
        Ok(self.slots[s].as_mut().expect("live"))
    }

    /// Frees live sequence `id` and returns its value.
    pub fn remove(&mut self, id: i32) -> Result<T> {
        let s = self.slot(id)?;
        Ok(self.slots[s].take().expect("live"))
    }

    /// The live sequences with their values.
    pub fn iter(&self) -> impl Iterator<Item = (i32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|v| (i as i32, v)))
    }

    /// The live sequences with their values, mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (i32, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| s.as_mut().map(|v| (i as i32, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_free_slot_and_liveness() {
        let mut t = SlotTable::new(3);
        for want in 0..3 {
            let s = t.free_slot().unwrap();
            assert_eq!(s, want);
            t.fill(s, want * 10);
        }
        assert!(matches!(t.free_slot(), Err(Error::PoolExhausted(_))));
        assert_eq!(t.remove(1).unwrap(), 10);
        assert!(!t.is_live(1) && t.is_live(2) && !t.is_live(-1) && !t.is_live(3));
        assert!(matches!(t.get(1), Err(Error::UnknownId(_))));
        assert_eq!(t.free_slot().unwrap(), 1);
        assert_eq!(t.live_count(), 2);
        assert_eq!(t.iter().map(|(i, _)| i).collect::<Vec<_>>(), [0, 2]);
    }
}
