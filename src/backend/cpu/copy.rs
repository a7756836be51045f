//! Strided copy with dtype conversion on host memory.

use std::any::TypeId;

use super::element::Element;
use super::ThreadPool;
use crate::tensor::{StridedLoop, TensorView};
use crate::with_element;

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 16;

pub(super) fn copy(pool: &ThreadPool, src: &TensorView, dst: &TensorView) {
    with_element!(src.dtype(), S => with_element!(dst.dtype(), D => copy_typed::<S, D>(pool, src, dst)))
}

fn copy_typed<S: Element, D: Element>(pool: &ThreadPool, src: &TensorView, dst: &TensorView) {
    let lp = StridedLoop::new([src, dst]);
    let n = lp.numel();
    if n == 0 {
        return;
    }
    if src.addr() == dst.addr() && src.dtype() == dst.dtype() && lp.strides[0] == lp.strides[1] {
        return; // the same elements: nothing to move
    }
    let (inner, s_inner, d_inner) = match lp.shape.last() {
        Some(&len) => (
            len,
            lp.strides[0][lp.shape.len() - 1],
            lp.strides[1][lp.shape.len() - 1],
        ),
        None => (1, 0, 0),
    };
    // Slices may only be formed when the two byte ranges are disjoint.
    let (s0, s1) = (src.addr(), src.addr() + src.span_bytes());
    let (d0, d1) = (dst.addr(), dst.addr() + dst.span_bytes());
    let disjoint = s1 <= d0 || d1 <= s0;
    let (src_addr, dst_addr) = (src.addr(), dst.addr());
    let process = |i0: usize, i1: usize| {
        let mut i = i0;
        while i < i1 {
            let [so, dof] = lp.offsets(i);
            let len = (inner - i % inner).min(i1 - i);
            // SAFETY: the views were checked to describe valid element offsets; the caller
            // guarantees the memory exists (the C API's contract).
            unsafe {
                let sp = (src_addr as *const S).offset(so);
                let dp = (dst_addr as *mut D).offset(dof);
                copy_row::<S, D>(sp, s_inner, dp, d_inner, len, disjoint);
            }
            i += len;
        }
    };
    let chunks = n.div_ceil(CHUNK);
    if chunks == 1 || pool.threads() == 1 {
        process(0, n);
    } else {
        pool.parallel_for(chunks, |c| process(c * CHUNK, ((c + 1) * CHUNK).min(n)));
    }
}

/// Copies `len` elements from `sp` (stride `ss`) to `dp` (stride `ds`).
///
/// # Safety
/// Every touched element must be valid memory; `disjoint` must be true only when the two
/// ranges do not overlap.
unsafe fn copy_row<S: Element, D: Element>(
    sp: *const S,
    ss: isize,
    dp: *mut D,
    ds: isize,
    len: usize,
    disjoint: bool,
) {
    let same = TypeId::of::<S>() == TypeId::of::<D>();
    if ss == 1 && ds == 1 && disjoint {
        if same {
            std::ptr::copy_nonoverlapping(sp as *const u8, dp as *mut u8, len * size_of::<S>());
        } else {
            let s = std::slice::from_raw_parts(sp, len);
            let d = std::slice::from_raw_parts_mut(dp, len);
            for (o, &x) in d.iter_mut().zip(s) {
                *o = D::from_f32(x.to_f32());
            }
        }
        return;
    }
    for j in 0..len as isize {
        let x = sp.offset(j * ss).read();
        let y = if same {
            // Same type: move the bits (keeps NaN payloads), like the CUDA kernel.
            std::mem::transmute_copy::<S, D>(&x)
        } else {
            D::from_f32(x.to_f32())
        };
        dp.offset(j * ds).write(y);
    }
}
