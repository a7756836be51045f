//! Small asynchronous writes into device tables (block tables, lengths, replay metadata):
//! the values travel in the kernel parameters, so a patch needs no staging buffer, never
//! synchronizes and can be captured in a CUDA Graph.

use std::ffi::c_void;

use super::module::Kernel;
use super::CudaBackend;
use crate::backend::Stream;
use crate::error::Result;

use crate::abi::{KvPatchArgs as PatchParams, KVR_KV_MAX_PATCHES as MAX_PATCHES};

/// Writes `value` at `dst[index]` (i32 elements) for each pair, on the stream: the
/// values travel in the kernel parameters, so this is asynchronous and capturable.
pub(crate) fn patch_i32(
    cuda: &CudaBackend,
    dst: usize,
    patches: &[(u32, i32)],
    stream: Stream,
) -> Result<()> {
    for chunk in patches.chunks(MAX_PATCHES) {
        let mut p = Box::new(PatchParams {
            dst: dst as u64,
            count: chunk.len() as i32,
            pad: 0,
            index: [0; MAX_PATCHES],
            value: [0; MAX_PATCHES],
        });
        for (i, &(idx, val)) in chunk.iter().enumerate() {
            p.index[i] = idx;
            p.value[i] = val;
        }
        let mut args = [&mut *p as *mut PatchParams as *mut c_void];
        let blocks = chunk.len().div_ceil(128) as u32;
        cuda.launch(
            Kernel::KvPatch,
            (blocks, 1, 1),
            (128, 1, 1),
            0,
            stream,
            &mut args,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_fit_the_launch_limit() {
        assert!(size_of::<super::PatchParams>() <= 4096);
    }
}
