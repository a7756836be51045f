//! CPU implementations of the pool's data movement and of decode.

use std::ops::Range;

use super::config::{KvPoolConfig, LayerLayout};
use super::decode::DecodePlan;
use super::state::PoolState;
use crate::backend::cpu::element::Element;
use crate::backend::cpu::ThreadPool;
use crate::tensor::TensorView;
use crate::with_element;

/// Copies page `src` to page `dst` in every layer (K and V), for copy-on-write.
pub(super) fn copy_page(cfg: &KvPoolConfig, layout: &[LayerLayout], src: u32, dst: u32) {
    let elem = cfg.dtype.size();
    for lay in layout {
        for (base, [sp, sh, st]) in [(lay.k, lay.k_strides), (lay.v, lay.v_strides)] {
            for h in 0..cfg.kv_heads {
                for s in 0..cfg.page_size {
                    let row = h * sh + s * st;
                    let from = base + (src as usize * sp + row) * elem;
                    let to = base + (dst as usize * sp + row) * elem;
                    // SAFETY: rows of distinct pages of the pool's memory never overlap.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            from as *const u8,
                            to as *mut u8,
                            cfg.head_dim * elem,
                        )
                    };
                }
            }
        }
    }
}

/// Element offset of `idx` in a view.
fn offset(t: &TensorView, idx: &[usize]) -> isize {
    idx.iter()
        .zip(t.strides())
        .map(|(&i, &s)| i as isize * s)
        .sum()
}

/// Writes the tokens `placed` = (slot, first position, count, first source token) for
/// `layers` from `k`/`v` (`[tokens, H, D]` for one layer, `[L, tokens, H, D]` for all).
pub(super) fn write_tokens(
    cfg: &KvPoolConfig,
    layout: &[LayerLayout],
    st: &PoolState,
    layers: Range<usize>,
    placed: &[(usize, usize, usize, usize)],
    k: &TensorView,
    v: &TensorView,
) {
    let pps = cfg.pages_per_seq();
    let all_layers = k.ndim() == 4;
    with_element!(cfg.dtype, D => {
        for (li, l) in layers.clone().enumerate() {
            let lay = &layout[l];
            for &(slot, start, n, off) in placed {
                for j in 0..n {
                    let pos = start + j;
                    let page = st.table[slot * pps + pos / cfg.page_size] as usize;
                    let s = pos % cfg.page_size;
                    for h in 0..cfg.kv_heads {
                        for (src, base, [sp, sh, stt]) in
                            [(k, lay.k, lay.k_strides), (v, lay.v, lay.v_strides)]
                        {
                            let idx: Vec<usize> = if all_layers {
                                vec![li, off + j, h, 0]
                            } else {
                                vec![off + j, h, 0]
                            };
                            let so = offset(src, &idx);
                            let dstep = src.strides()[src.ndim() - 1];
                            let dst = (base as *mut D).wrapping_add(page * sp + h * sh + s * stt);
                            with_element!(src.dtype(), S => {
                                let sp0 = (src.addr() as *const S).wrapping_offset(so);
                                for d in 0..cfg.head_dim {
                                    // SAFETY: the view was checked to hold these elements and
                                    // the destination row is inside the pool.
                                    unsafe {
                                        let x = sp0.offset(d as isize * dstep).read();
                                        dst.add(d).write(D::from_f32(x.to_f32()));
                                    }
                                }
                            });
                        }
                    }
                }
            }
        }
    });
}

/// Reads `n` elements of a row starting at `p` into f32.
///
/// # Safety
/// `p` must point at `n` readable elements.
unsafe fn row_f32<E: Element>(p: *const E, out: &mut [f32]) {
    for (d, o) in out.iter_mut().enumerate() {
        *o = p.add(d).read().to_f32();
    }
}

/// Attention for every (batch row, KV head) pair, spread over the thread pool.
pub(super) fn decode(
    cfg: &KvPoolConfig,
    lay: &LayerLayout,
    st: &PoolState,
    plan: &DecodePlan,
    threads: &ThreadPool,
) {
    let ids = plan.ids.host().expect("CPU decode takes host seq ids");
    let (hkv, dim, t_count, g) = (cfg.kv_heads, cfg.head_dim, plan.t, plan.g);
    let pps = cfg.pages_per_seq();
    let work = plan.b * hkv;
    with_element!(cfg.dtype, KV => {
        threads.parallel_for(work, |w| {
            let (b, h) = (w / hkv, w % hkv);
            let rows = g * t_count;
            let mut out = vec![0f32; rows * dim];
            let mut lse = vec![f32::NEG_INFINITY; rows];
            let id = ids[b];
            if id >= 0 {
                let slot = id as usize;
                let len = st.lens[slot] as usize;
                let last_pos = len as isize - t_count as isize;
                let kstart = if plan.window > 0 {
                    (last_pos - plan.window as isize + 1).max(0) as usize
                } else {
                    0
                };
                // Queries (converted to f32), rows ordered (t, g).
                let mut qv = vec![0f32; rows * dim];
                for t in 0..t_count {
                    for gi in 0..g {
                        let r = t * g + gi;
                        let o = offset(&plan.q, &[b, t, h * g + gi, 0]);
                        let ds = plan.q.strides()[3];
                        with_element!(plan.q.dtype(), Q => {
                            let p0 = (plan.q.addr() as *const Q).wrapping_offset(o);
                            for d in 0..dim {
                                // SAFETY: checked view.
                                qv[r * dim + d] = unsafe { p0.offset(d as isize * ds).read().to_f32() };
                            }
                        });
                    }
                }
                let nkeys = len.saturating_sub(kstart);
                let mut scores = vec![f32::NEG_INFINITY; rows * nkeys];
                let mut kr = vec![0f32; dim];
                let row_ptr = |base: usize, [sp, sh, stt]: [usize; 3], pos: usize| {
                    let page = st.table[slot * pps + pos / cfg.page_size] as usize;
                    (base as *const KV).wrapping_add(page * sp + h * sh + (pos % cfg.page_size) * stt)
                };
                for j in 0..nkeys {
                    let pos = kstart + j;
                    // SAFETY: the page table maps positions < len into the pool.
                    unsafe { row_f32(row_ptr(lay.k, lay.k_strides, pos), &mut kr) };
                    for t in 0..t_count {
                        let qpos = last_pos + t as isize;
                        let visible = (pos as isize) <= qpos
                            && (plan.window == 0 || pos as isize > qpos - plan.window as isize);
                        if !visible {
                            continue;
                        }
                        for gi in 0..g {
                            let r = t * g + gi;
                            let qr = &qv[r * dim..(r + 1) * dim];
                            let mut s = 0f32;
                            for d in 0..dim {
                                s += qr[d] * kr[d];
                            }
                            let s = if plan.softcap > 0.0 {
                                plan.softcap * (s * plan.scale / plan.softcap).tanh()
                            } else {
                                s * plan.scale
                            };
                            scores[r * nkeys + j] = s;
                        }
                    }
                }
                // Softmax per row, then the weighted sum of V.
                let mut sums = vec![0f32; rows];
                let mut maxes = vec![f32::NEG_INFINITY; rows];
                for r in 0..rows {
                    let row = &mut scores[r * nkeys..(r + 1) * nkeys];
                    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    if m == f32::NEG_INFINITY {
                        continue;
                    }
                    let mut sum = 0f32;
                    for x in row.iter_mut() {
                        *x = (*x - m).exp();
                        sum += *x;
                    }
                    maxes[r] = m;
                    sums[r] = sum;
                }
                let mut vr = vec![0f32; dim];
                for j in 0..nkeys {
                    // SAFETY: as above.
                    unsafe { row_f32(row_ptr(lay.v, lay.v_strides, kstart + j), &mut vr) };
                    for r in 0..rows {
                        let p = scores[r * nkeys + j];
                        if p > 0.0 {
                            let o = &mut out[r * dim..(r + 1) * dim];
                            for d in 0..dim {
                                o[d] += p * vr[d];
                            }
                        }
                    }
                }
                for r in 0..rows {
                    if sums[r] > 0.0 {
                        for d in 0..dim {
                            out[r * dim + d] /= sums[r];
                        }
                        lse[r] = maxes[r] + sums[r].ln();
                    }
                }
            }
            // Store.
            for t in 0..t_count {
                for gi in 0..g {
                    let r = t * g + gi;
                    let hq = h * g + gi;
                    let o = offset(&plan.out, &[b, t, hq, 0]);
                    let ds = plan.out.strides()[3];
                    with_element!(plan.out.dtype(), O => {
                        let p0 = (plan.out.addr() as *mut O).wrapping_offset(o);
                        for d in 0..dim {
                            // SAFETY: checked, non-overlapping output view; each (b, hq)
                            // row is written by exactly one work item.
                            unsafe { p0.offset(d as isize * ds).write(O::from_f32(out[r * dim + d])) };
                        }
                    });
                    if let Some(l) = &plan.lse {
                        let lo = offset(l, &[b, t, hq]);
                        // SAFETY: as above.
                        unsafe { (l.addr() as *mut f32).offset(lo).write(lse[r]) };
                    }
                }
            }
        });
    });
}
