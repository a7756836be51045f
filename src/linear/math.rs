//! The replay step math, per (sequence, layer, value head), on plain f32 slices. The CPU
//! backend runs it directly; the CUDA kernels (kernels/gdn*.cu) implement the same formulas
//! and are tested against it.
//!
//! Recurrence (one token): S <- e^g S; u = beta (v - S k) (the delta rule, Gated DeltaNet)
//! or u = beta v (additive: linear attention, Mamba-2); S <- S + u k^T; y = S q, with S a
//! `dv x dk` matrix (stored K-major `[dk][dv]` or V-major `[dv][dk]`).
//!
//! Replay: a checkpoint S0 plus h buffered entries (u_j, k_j, g_j) stand for
//! S_h = e^{G_h} S0 + sum_j e^{G_h - G_j} u_j k_j^T with G_j = g_1 + ... + g_j. Because u_j is
//! cached (not v_j), no intermediate state is needed to replay the buffer.
//!
//! T drafts (verify): with Gam_s = g_1 + ... + g_s (draft-local) and x_s = S_h x,
//!   (I + A) U = R, A[s][s'] = beta_s e^{Gam_s - Gam_s'} (k_s . k_s') for s' < s,
//!   R_s = beta_s (v_s - e^{Gam_s} S_h k_s),
//!   y_s = e^{Gam_s} S_h q_s + sum_{s' <= s} e^{Gam_s - Gam_s'} (k_s' . q_s) U_s'.
//! A is strictly lower triangular: forward substitution, no per-draft state. The additive
//! rule has A = 0 and R_s = beta_s v_s.

#![allow(clippy::needless_range_loop)] // index-heavy math reads clearer with indices

/// How the state matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateLayout {
    /// `[dk][dv]`, dv contiguous (fla's default).
    KMajor,
    /// `[dv][dk]`, dk contiguous (llama.cpp, vLLM, FlashInfer).
    VMajor,
}

impl StateLayout {
    /// Index of S[i_v][i_k] (S as a dv x dk matrix).
    #[inline(always)]
    pub fn index(self, dk: usize, dv: usize, iv: usize, ik: usize) -> usize {
        match self {
            StateLayout::KMajor => ik * dv + iv,
            StateLayout::VMajor => iv * dk + ik,
        }
    }
}

/// L2-normalizes `x` in place the way fla does (`x / sqrt(sum x^2 + 1e-6)`).
pub fn l2_normalize(x: &mut [f32]) {
    L2Norm::SumEps(1e-6).apply(x);
}

/// How q and k are L2-normalized before a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum L2Norm {
    /// `x / sqrt(sum x^2 + eps)`: fla's `l2norm`, and llama.cpp's GDN models (an RMS norm
    /// with eps / n, scaled by 1 / sqrt(n)).
    SumEps(f32),
    /// `x / max(sqrt(sum x^2), eps)`: ggml's `ggml_l2_norm`.
    MaxEps(f32),
}

impl L2Norm {
    /// The factor that normalizes a vector whose squares sum to `ss`.
    #[inline]
    pub fn factor(self, ss: f32) -> f32 {
        match self {
            L2Norm::SumEps(eps) => 1.0 / (ss + eps).sqrt(),
            L2Norm::MaxEps(eps) => 1.0 / ss.sqrt().max(eps),
        }
    }

    pub fn apply(self, x: &mut [f32]) {
        let ss: f32 = x.iter().map(|v| v * v).sum();
        let inv = self.factor(ss);
        for v in x {
            *v *= inv;
        }
    }
}

/// `a . b`, summed in index order (the CPU reference's order; do not reassociate).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |s, (x, y)| s + x * y)
}

/// `out[iv] = sum_ik S[iv][ik] x[ik]` for a `dv x dk` state, each sum in `ik` order.
fn state_times(s: &[f32], layout: StateLayout, dk: usize, dv: usize, x: &[f32], out: &mut [f32]) {
    let (s, x, out) = (&s[..dk * dv], &x[..dk], &mut out[..dv]);
    match layout {
        StateLayout::VMajor => {
            for (o, row) in out.iter_mut().zip(s.chunks_exact(dk)) {
                *o = dot(row, x);
            }
        }
        StateLayout::KMajor => {
            out.fill(0.0);
            for (row, &xk) in s.chunks_exact(dv).zip(x) {
                for (o, &sv) in out.iter_mut().zip(row) {
                    *o += sv * xk;
                }
            }
        }
    }
}

/// `S += u k^T` (`S[iv][ik] += u[iv] k[ik]`).
fn add_outer(s: &mut [f32], layout: StateLayout, dk: usize, dv: usize, u: &[f32], k: &[f32]) {
    let (s, u, k) = (&mut s[..dk * dv], &u[..dv], &k[..dk]);
    match layout {
        StateLayout::VMajor => {
            for (row, &uv) in s.chunks_exact_mut(dk).zip(u) {
                for (x, &kk) in row.iter_mut().zip(k) {
                    *x += uv * kk;
                }
            }
        }
        StateLayout::KMajor => {
            for (row, &kk) in s.chunks_exact_mut(dv).zip(k) {
                for (x, &uv) in row.iter_mut().zip(u) {
                    *x += uv * kk;
                }
            }
        }
    }
}

/// One buffered entry of a head: the corrected value u, the key k and the log decay g.
pub struct Entry<'a> {
    pub u: &'a [f32],
    pub k: &'a [f32],
    pub g: f32,
}

/// `out = S_h x` for the checkpoint `s0` (None = zero) and `entries` (oldest first).
pub fn history_apply(
    s0: Option<&[f32]>,
    layout: StateLayout,
    dk: usize,
    dv: usize,
    entries: &[Entry<'_>],
    x: &[f32],
    out: &mut [f32],
) {
    let g_total: f32 = entries.iter().map(|e| e.g).sum();
    out.iter_mut().for_each(|o| *o = 0.0);
    if let Some(s) = s0 {
        let a = g_total.exp();
        state_times(s, layout, dk, dv, x, out);
        out.iter_mut().for_each(|o| *o *= a);
    }
    // Entry j weighs e^{G_h - G_j}: the decays of the entries newer than j.
    let mut suffix = 0f32;
    for e in entries.iter().rev() {
        let w = suffix.exp() * dot(e.k, x);
        for (o, &u) in out[..dv].iter_mut().zip(&e.u[..dv]) {
            *o += w * u;
        }
        suffix += e.g;
    }
}

/// Materializes `S_h` into `dst` (the same layout): checkpoint decayed plus the entries.
pub fn materialize(
    s0: Option<&[f32]>,
    layout: StateLayout,
    dk: usize,
    dv: usize,
    entries: &[Entry<'_>],
    dst: &mut [f32],
) {
    let g_total: f32 = entries.iter().map(|e| e.g).sum();
    match s0 {
        Some(s) => {
            let a = g_total.exp();
            for (d, &x) in dst.iter_mut().zip(s) {
                *d = a * x;
            }
        }
        None => dst.iter_mut().for_each(|d| *d = 0.0),
    }
    let mut suffix = 0f32;
    let mut wu = vec![0f32; dv];
    for e in entries.iter().rev() {
        let w = suffix.exp();
        for (d, &u) in wu.iter_mut().zip(&e.u[..dv]) {
            *d = w * u;
        }
        add_outer(dst, layout, dk, dv, &wu, e.k);
        suffix += e.g;
    }
}

/// One draft token of a head, after q/k preprocessing.
pub struct Draft<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: f32,
    pub beta: f32,
}

/// Outputs `y[s]` and entry values `u[s]` for T drafts on top of the history
/// (`s0`, `entries`), without materializing any state (`delta`: the delta rule, else
/// additive).
#[allow(clippy::too_many_arguments)]
pub fn verify_head(
    delta: bool,
    s0: Option<&[f32]>,
    layout: StateLayout,
    dk: usize,
    dv: usize,
    entries: &[Entry<'_>],
    drafts: &[Draft<'_>],
    y: &mut [Vec<f32>],
    u: &mut [Vec<f32>],
) {
    let t = drafts.len();
    let mut gam = vec![0f32; t];
    let mut acc = 0f32;
    for s in 0..t {
        acc += drafts[s].g;
        gam[s] = acc;
    }
    let mut hk = vec![0f32; dv];
    let mut hq = vec![vec![0f32; dv]; t];
    // R_s and the history readouts.
    for s in 0..t {
        history_apply(s0, layout, dk, dv, entries, drafts[s].q, &mut hq[s]);
        if !delta {
            for iv in 0..dv {
                u[s][iv] = drafts[s].beta * drafts[s].v[iv];
            }
            continue;
        }
        history_apply(s0, layout, dk, dv, entries, drafts[s].k, &mut hk);
        let e = gam[s].exp();
        for iv in 0..dv {
            u[s][iv] = drafts[s].beta * (drafts[s].v[iv] - e * hk[iv]);
        }
        // Forward substitution: U_s = R_s - sum_{s' < s} A[s][s'] U_s'.
        for sp in 0..s {
            let a = drafts[s].beta * (gam[s] - gam[sp]).exp() * dot(drafts[s].k, drafts[sp].k);
            for iv in 0..dv {
                let x = u[sp][iv];
                u[s][iv] -= a * x;
            }
        }
    }
    for s in 0..t {
        let e = gam[s].exp();
        for iv in 0..dv {
            y[s][iv] = e * hq[s][iv];
        }
        for sp in 0..=s {
            let w = (gam[s] - gam[sp]).exp() * dot(drafts[sp].k, drafts[s].q);
            for iv in 0..dv {
                y[s][iv] += w * u[sp][iv];
            }
        }
    }
}

/// The plain recurrence for one token, in place: returns y and leaves S updated.
pub fn recurrent_step(
    delta: bool,
    s: &mut [f32],
    layout: StateLayout,
    dk: usize,
    dv: usize,
    d: &Draft<'_>,
    y: &mut [f32],
) {
    let a = d.g.exp();
    for x in s.iter_mut() {
        *x *= a;
    }
    // u = beta (v - S k) (S k = 0 for the additive rule), S += u k^T, y = S q.
    let mut u = vec![0f32; dv];
    if delta {
        state_times(s, layout, dk, dv, d.k, &mut u);
    }
    for (u, &v) in u.iter_mut().zip(&d.v[..dv]) {
        *u = d.beta * (v - *u);
    }
    add_outer(s, layout, dk, dv, &u, d.k);
    state_times(s, layout, dk, dv, d.q, y);
}
