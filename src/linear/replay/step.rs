//! The step on host memory (CPU backend), for every rule of `plan.rs`: decode and verify
//! through `math`, on the slot operations of `cpu.rs`.

#![allow(clippy::needless_range_loop)] // index-heavy math reads clearer with indices

use super::cpu::{current_state, entry_refs, finish_step, read_vec, round_all, write_vec, Slot};
use super::meta::{self, META_MODE, MODE_RECURRENT};
use super::plan::{Rule, StepPlan};
use super::{Layout, ReplayConfig, Step};
use crate::backend::cpu::ThreadPool;
use crate::linear::math::{self, Draft};

/// q and k of (row b, draft t, key head kh) as the step uses them: optionally
/// L2-normalized, q scaled; k rounded to the entry dtype when it will be buffered.
fn prep_qk(
    cfg: &ReplayConfig,
    plan: &StepPlan,
    b: usize,
    t: usize,
    kh: usize,
    round_k: bool,
) -> (Vec<f32>, Vec<f32>) {
    let mut q = read_vec(&plan.q, &[b, t, kh, 0], cfg.dk);
    let mut k = read_vec(&plan.k, &[b, t, kh, 0], cfg.dk);
    if plan.l2norm {
        math::l2_normalize(&mut q);
        math::l2_normalize(&mut k);
    }
    q.iter_mut().for_each(|x| *x *= plan.scale);
    if round_k {
        round_all(cfg.entry_dtype, &mut k);
    }
    (q, k)
}

/// (log decay, input weight) of (row b, draft t, value head h).
fn token_gb(plan: &StepPlan, b: usize, t: usize, h: usize) -> (f32, f32) {
    let at = |x: &Option<_>, default: f32| {
        x.as_ref()
            .map_or(default, |x| read_vec(x, &[b, t, h], 1)[0])
    };
    match &plan.dt {
        Some(dt) => {
            let a = read_vec(&dt.a, &[h], 1)[0];
            let bias = dt.bias.as_ref().map_or(0.0, |x| read_vec(x, &[h], 1)[0]);
            let (beta, g) = dt.apply(at(&plan.beta, 0.0), a, bias);
            (g, beta)
        }
        None => (at(&plan.g, 0.0), at(&plan.beta, 1.0)),
    }
}

/// The skip and gate of (row b, draft t, value head h) applied to y.
fn epilogue(plan: &StepPlan, b: usize, t: usize, h: usize, v: &[f32], y: &mut [f32]) {
    if let Some(d) = &plan.skip {
        let d = read_vec(d, &[h], 1)[0];
        for (y, x) in y.iter_mut().zip(v) {
            *y += d * x;
        }
    }
    if let Some(z) = &plan.gate {
        let z = read_vec(z, &[b, t, h, 0], y.len());
        for (y, z) in y.iter_mut().zip(z) {
            *y *= z / (1.0 + (-z).exp());
        }
    }
}

/// Decode or verify for every (batch row, value head), then the per-sequence bookkeeping.
pub(crate) fn step(lay: &Layout, step: &Step<'_>, threads: &ThreadPool) {
    let cfg = &lay.cfg;
    let plan = step.plan;
    let ids = step.ids.host().expect("CPU steps take host ids");
    let (hv, group) = (cfg.v_heads, cfg.v_heads / cfg.k_heads);
    let t_count = step.t;
    threads.parallel_for(step.b * hv, |w| {
        let (b, h) = (w / hv, w % hv);
        let id = ids[b];
        if id < 0 {
            for t in 0..t_count {
                write_vec(&plan.out, &[b, t, h, 0], &vec![0f32; cfg.dv]);
            }
            return;
        }
        let s = Slot::new(lay, step.layer, id as usize);
        let meta = s.read_meta();
        let kh = h / group;
        let recurrent = meta[META_MODE] == MODE_RECURRENT;
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut gs = Vec::new();
        let mut betas = Vec::new();
        for t in 0..t_count {
            // Ring modes use the key as it is stored (rounded to the entry dtype).
            let (q, k) = prep_qk(cfg, plan, b, t, kh, !recurrent);
            qs.push(q);
            ks.push(k);
            vs.push(read_vec(&plan.v, &[b, t, h, 0], cfg.dv));
            let (g, beta) = token_gb(plan, b, t, h);
            gs.push(g);
            betas.push(beta);
        }
        let drafts: Vec<Draft<'_>> = (0..t_count)
            .map(|t| Draft {
                q: &qs[t],
                k: &ks[t],
                v: &vs[t],
                g: gs[t],
                beta: betas[t],
            })
            .collect();
        let mut y = vec![vec![0f32; cfg.dv]; t_count];
        let delta = plan.rule == Rule::Delta;
        if recurrent {
            let mut state = s.read_state(s.state(h));
            for t in 0..t_count {
                math::recurrent_step(
                    delta, &mut state, cfg.layout, cfg.dk, cfg.dv, &drafts[t], &mut y[t],
                );
                round_all(cfg.state_dtype, &mut state);
                if step.auto_commit {
                    s.write_state(s.state(h), &state);
                } else {
                    s.write_state(s.snapshot(t, h), &state);
                }
            }
        } else {
            let (flush, kv_only, base) = meta::placement(cfg, &meta, t_count, step.auto_commit);
            let (s0, ents) = if flush {
                let mut cur = current_state(&s, &meta, h);
                round_all(cfg.state_dtype, &mut cur);
                s.write_state(s.state(h), &cur);
                (Some(cur), Vec::new())
            } else if kv_only {
                (None, s.entries(&meta, h))
            } else {
                (Some(s.read_state(s.state(h))), s.entries(&meta, h))
            };
            let mut u = vec![vec![0f32; cfg.dv]; t_count];
            math::verify_head(
                delta,
                s0.as_deref(),
                cfg.layout,
                cfg.dk,
                cfg.dv,
                &entry_refs(&ents),
                &drafts,
                &mut y,
                &mut u,
            );
            for t in 0..t_count {
                let mut ur = std::mem::take(&mut u[t]);
                round_all(cfg.entry_dtype, &mut ur);
                let pos = if kv_only {
                    base + t
                } else {
                    (base + t) % cfg.ring_len
                };
                s.put_entry(kv_only, pos, h, &ur, &ks[t], gs[t]);
            }
        }
        for t in 0..t_count {
            epilogue(plan, b, t, h, &vs[t], &mut y[t]);
            write_vec(&plan.out, &[b, t, h, 0], &y[t]);
        }
    });
    finish_step(
        lay,
        step,
        |b, t, kh| prep_qk(cfg, plan, b, t, kh, true).1,
        plan.conv_in.as_ref(),
    );
}
