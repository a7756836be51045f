//! Tensor-view and argument helpers of batched pool calls.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::tensor::TensorView;

/// `t` as `[B, T, H, D]`: 4-D views pass, and where `one_token` allows it a 3-D `[B, H, D]`
/// view becomes `[B, 1, H, D]`. `name` and `shape` (e.g. "[B, T, H, D]") go into the error.
pub fn as_batch_4d(t: &TensorView, name: &str, one_token: bool) -> Result<TensorView> {
    match (t.ndim(), one_token) {
        (4, _) => Ok(*t),
        (3, true) => TensorView::new(
            t.addr(),
            t.dtype(),
            t.memory(),
            &[t.shape()[0], 1, t.shape()[1], t.shape()[2]],
            &[t.strides()[0], 0, t.strides()[1], t.strides()[2]],
        ),
        (n, _) => Err(Error::InvalidArgument(format!(
            "{name} must be [B, T, H, D]{} ({n} dimensions given)",
            if one_token { " or [B, H, D]" } else { "" }
        ))),
    }
}

/// `t` as `[B, T, X]`: 3-D views pass, and where `one_token` allows it a 2-D `[B, X]` view
/// becomes `[B, 1, X]`.
pub fn as_batch_3d(t: &TensorView, name: &str, one_token: bool) -> Result<TensorView> {
    match (t.ndim(), one_token) {
        (3, _) => Ok(*t),
        (2, true) => TensorView::new(
            t.addr(),
            t.dtype(),
            t.memory(),
            &[t.shape()[0], 1, t.shape()[1]],
            &[t.strides()[0], 0, t.strides()[1]],
        ),
        (n, _) => Err(Error::InvalidArgument(format!(
            "{name} must be [B, T, X]{} ({n} dimensions given)",
            if one_token { " or [B, X]" } else { "" }
        ))),
    }
}

/// f32, f16 or bf16.
pub fn check_float(t: &TensorView, name: &str) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch(format!(
            "{name} must be f32, f16 or bf16, not {}",
            t.dtype()
        )))
    }
}

/// `layer` < `layers`.
pub fn check_layer(layer: usize, layers: usize) -> Result<()> {
    if layer < layers {
        Ok(())
    } else {
        Err(Error::OutOfRange(format!(
            "layer {layer} out of range (the pool has {layers})"
        )))
    }
}

/// The layers a call covers: `Some(l)` one (checked), `None` all.
pub fn layer_range(layer: Option<usize>, layers: usize) -> Result<Range<usize>> {
    match layer {
        Some(l) => check_layer(l, layers).map(|_| l..l + 1),
        None => Ok(0..layers),
    }
}

/// Every named count is at least 1.
pub fn require_positive(fields: &[(&str, usize)]) -> Result<()> {
    match fields.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(Error::InvalidArgument(format!("{name} must be at least 1"))),
        None => Ok(()),
    }
}
