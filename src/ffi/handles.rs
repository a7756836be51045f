//! Registries of live objects handed to C.
//!
//! A handle is an opaque token, never a pointer kvreplay dereferences: calls look it up
//! in the registry of its kind. A freed, foreign or made-up handle is therefore an
//! `INVALID_ARG` error instead of a use-after-free, freeing twice is detected, and an
//! object freed by one thread while another still uses it lives until that call returns
//! (the registry holds an `Arc`). Handle values are never reused within a process.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::error::{Error, Result};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// Live objects of one kind, keyed by handle value.
pub(crate) struct Registry<T> {
    kind: &'static str,
    live: RwLock<BTreeMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    /// An empty registry; `kind` is the C type name used in messages.
    pub(crate) const fn new(kind: &'static str) -> Self {
        Registry {
            kind,
            live: RwLock::new(BTreeMap::new()),
        }
    }

    /// Registers `value` and returns its new handle (never 0, never reused).
    pub(crate) fn insert(&self, value: T) -> usize {
        // 16-aligned, non-zero values that look like (but are not) heap addresses.
        let handle = NEXT_ID.fetch_add(1, Ordering::Relaxed) << 4;
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(handle, Arc::new(value));
        handle
    }

    /// The object behind `handle`.
    pub(crate) fn get(&self, handle: usize) -> Result<Arc<T>> {
        if handle == 0 {
            return Err(Error::NullArgument(format!("{} handle is NULL", self.kind)));
        }
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&handle)
            .cloned()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{handle:#x} is not a live {} (already freed, or a handle of another kind)",
                    self.kind
                ))
            })
    }

    /// Unregisters `handle`; the object is dropped once no call still uses it.
    pub(crate) fn remove(&self, handle: usize) -> Result<Arc<T>> {
        if handle == 0 {
            return Err(Error::NullArgument(format!("{} handle is NULL", self.kind)));
        }
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&handle)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{handle:#x} is not a live {} (freed twice, or a handle of another kind)",
                    self.kind
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle() {
        static R: Registry<u32> = Registry::new("kvr_test");
        let h = R.insert(7);
        assert_ne!(h, 0);
        assert_eq!(*R.get(h).unwrap(), 7);
        let held = R.get(h).unwrap();
        assert_eq!(*R.remove(h).unwrap(), 7);
        assert_eq!(*held, 7); // still alive for the caller that holds it
        assert!(matches!(R.get(h), Err(Error::InvalidArgument(_))));
        assert!(matches!(R.remove(h), Err(Error::InvalidArgument(_))));
        assert!(matches!(R.get(0), Err(Error::NullArgument(_))));
        let h2 = R.insert(8);
        assert_ne!(h, h2);
    }
}
