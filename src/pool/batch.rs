//! The sequence ids of a batched call: i32 `[B]` in host memory (checked here) or in device
//! memory (read by the kernels; -1 marks an unused row either way).

use super::SlotTable;
use crate::backend::BackendKind;
use crate::error::{Error, Result};
use crate::tensor::{DType, MemoryKind, TensorView};

/// Checked batch ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchIds {
    /// Read from host memory: each id is -1 or a live sequence, none twice.
    Host(Vec<i32>),
    /// Address of `B` contiguous i32 ids in device memory.
    Device(usize),
}

/// Reads `n` i32 values from a checked host view.
pub fn read_host_i32(t: &TensorView, n: usize) -> Vec<i32> {
    (0..n)
        // SAFETY: callers pass a host i32 view with at least `n` elements along dim 0.
        .map(|i| unsafe {
            (t.addr() as *const i32)
                .offset(i as isize * t.strides()[0])
                .read()
        })
        .collect()
}

impl BatchIds {
    /// Checks `ids` (i32 `[B]`, B <= the slot count) against `slots`. Device ids need a CUDA
    /// backend and contiguous storage; host ids must be -1 or live, and distinct.
    pub fn check<T>(
        ids: &TensorView,
        slots: &SlotTable<T>,
        backend: BackendKind,
    ) -> Result<BatchIds> {
        if ids.dtype() != DType::I32 {
            return Err(Error::DTypeMismatch(format!(
                "seq_ids must be an i32 tensor, not {}",
                ids.dtype()
            )));
        }
        if ids.ndim() != 1 {
            return Err(Error::InvalidArgument(format!(
                "seq_ids must be 1-D [B], not {}-D {:?}",
                ids.ndim(),
                ids.shape()
            )));
        }
        let b = ids.shape()[0];
        if b > slots.capacity() {
            return Err(Error::OutOfRange(format!(
                "batch of {b} rows exceeds the pool's max_seqs ({})",
                slots.capacity()
            )));
        }
        match ids.memory() {
            MemoryKind::Host => {
                let v = read_host_i32(ids, b);
                for (i, &id) in v.iter().enumerate() {
                    if id != -1 && !slots.is_live(id) {
                        return Err(Error::UnknownId(format!(
                            "seq_ids[{i}] = {id} is not a live sequence (use -1 for an unused row)"
                        )));
                    }
                }
                let mut sorted: Vec<i32> = v.iter().copied().filter(|&i| i >= 0).collect();
                sorted.sort_unstable();
                if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {} appears twice in seq_ids",
                        w[0]
                    )));
                }
                Ok(BatchIds::Host(v))
            }
            MemoryKind::Cuda => {
                if backend != BackendKind::Cuda {
                    return Err(Error::InvalidArgument(
                        "seq_ids is in CUDA memory but the pool is on the CPU".into(),
                    ));
                }
                if b > 1 && ids.strides()[0] != 1 {
                    return Err(Error::InvalidArgument(
                        "device seq_ids must be contiguous".into(),
                    ));
                }
                Ok(BatchIds::Device(ids.addr()))
            }
        }
    }

    /// The host ids, if the batch came from host memory.
    pub fn host(&self) -> Option<&[i32]> {
        match self {
            BatchIds::Host(v) => Some(v),
            BatchIds::Device(_) => None,
        }
    }

    /// The live sequences of a host batch (none for device ids).
    pub fn live(&self) -> impl Iterator<Item = i32> + '_ {
        self.host()
            .unwrap_or(&[])
            .iter()
            .copied()
            .filter(|&i| i >= 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(v: &[i32]) -> TensorView {
        TensorView::contiguous(
            v.as_ptr() as usize,
            DType::I32,
            MemoryKind::Host,
            &[v.len()],
        )
        .unwrap()
    }

    #[test]
    fn host_ids_are_checked() {
        let mut slots = SlotTable::new(4);
        slots.fill(0, ());
        slots.fill(2, ());
        let ok = [2, -1, 0];
        assert_eq!(
            BatchIds::check(&view(&ok), &slots, BackendKind::Cpu).unwrap(),
            BatchIds::Host(vec![2, -1, 0])
        );
        for (bad, code) in [
            (&[1][..], "unknown"),
            (&[0, 2, 0][..], "twice"),
            (&[-2][..], "unknown"),
            (&[0, 0, 0, 0, 0][..], "max_seqs"),
        ] {
            let e = BatchIds::check(&view(bad), &slots, BackendKind::Cpu).unwrap_err();
            let m = e.to_string();
            assert!(
                m.contains(code) || (code == "unknown" && m.contains("not a live")),
                "{bad:?}: {m}"
            );
        }
        let dev = TensorView::contiguous(256, DType::I32, MemoryKind::Cuda, &[2]).unwrap();
        assert!(BatchIds::check(&dev, &slots, BackendKind::Cpu).is_err());
        assert_eq!(
            BatchIds::check(&dev, &slots, BackendKind::Cuda).unwrap(),
            BatchIds::Device(256)
        );
    }
}
