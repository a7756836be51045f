//! GGUF models: a hardened loader (memmap2 + gguf-rs), per-layer plans for the
//! architectures kvreplay serves, pool sizing, and zero-copy typed views of the few weights
//! kvreplay reads itself (GDN A_log / dt_bias, Mamba-2 A / D / dt_bias, conv weights).

pub mod file;
pub mod plan;
pub mod sizing;

pub use file::{GgufFile, TensorInfo};
pub use plan::{plan, AttentionPlan, GdnPlan, LayerPlan, Mamba2Plan, ModelPlan, ARCHITECTURES};
pub use sizing::{sizing, Sizing, SizingParams, VARIANTS};

use crate::error::Result;
use std::path::Path;

/// An opened model: the file and its plan.
#[derive(Debug)]
pub struct Model {
    pub file: GgufFile,
    pub plan: ModelPlan,
}

impl Model {
    /// Opens, validates and plans the GGUF file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Model> {
        let file = GgufFile::open(path)?;
        let plan = plan(&file)?;
        Ok(Model { file, plan })
    }

    /// The same from bytes in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Model> {
        let file = GgufFile::from_bytes(bytes)?;
        let plan = plan(&file)?;
        Ok(Model { file, plan })
    }
}

/// Runs the whole loader on `bytes`: validation, plan, sizing for a few budgets, and a
/// view of every tensor with its first and last element read. Panics only on a bug (the
/// fuzz target and the corpus test call it). Returns whether the bytes were accepted.
#[doc(hidden)]
pub fn exercise(bytes: &[u8]) -> bool {
    let Ok(file) = GgufFile::from_bytes(bytes) else {
        return false;
    };
    for t in file.tensors() {
        if let Ok(v) = file.view(&t.name) {
            let n = v.numel();
            if n > 0 {
                let e = v.dtype().size();
                // SAFETY: the view lies inside the file (checked by the loader).
                unsafe {
                    std::hint::black_box((v.addr() as *const u8).read());
                    std::hint::black_box((v.addr() as *const u8).add(n * e - 1).read());
                }
            }
        }
        let _ = file.tensor_bytes(&t.name);
    }
    if let Ok(p) = plan(&file) {
        for spec in [0, 4, 8] {
            let _ = sizing(
                &p,
                &SizingParams {
                    budget_bytes: 1 << 34,
                    seq_len: 4096,
                    spec_window: spec,
                    ..Default::default()
                },
            );
        }
    }
    true
}
