// Stateless recurrent Gated DeltaNet over the caller's tensors (kvr_context_gdn_recurrent):
//   kvr_gdn_recur_d<dk>_r<rows>   T tokens for B sequences, state in -> state out (and/or
//                                 the last per-token states as snapshots)
//   kvr_gdn_recur1[n]_d<dk>_r<rows>  one token, all f32, no snapshots (a decode step; n: q
//                                 and k L2-normalized in the kernel), over a compact
//                                 parameter block (kvr_gdn_recur1_args)
// (src/linear/gdn/recur.rs launches it; llama.cpp's GGML_OP_GATED_DELTA_NET runs on it.)
//
// The step is a stream over the states: each state element is read once, updated T times
// in registers and written once (plus once per snapshot), so the kernel is shaped for
// memory-level parallelism. CTA (x, h, z) serves value head h of sequence b0 + z, its warps
// consecutive groups of value rows (neighbouring CTAs share q and k in L1); it reaches its
// first load with one integer division. One warp owns R value rows of one (sequence, value
// head) with the whole key dimension: lane l holds keys [l * VW, l * VW + VW) of each row (VW = dk /
// 32, read as one or two 16-byte vectors), so a warp instruction reads 512 contiguous
// bytes of a row. No shared memory and no CTA barrier; R is picked on the host so that the
// launch still has 16 warps per SM (1 row per warp at batch 1, 4 from batch ~8 at the
// Qwen3-Next shape), more rows per warp meaning fewer redundant q/k loads and reductions.
//
// Per token, with e = exp(g) and S the rows before the token, all dot products come from
// one butterfly over the warp (no second reduction after the update):
//   a_r = S_r . k,  b_r = S_r . q,  c = k . q   (k, q L2-normalized first if asked, in
//   fla's form x / sqrt(|x|^2 + eps) or ggml_l2_norm's x / max(|x|, eps))
//   u_r = beta (v_r - e a_r),  y_r = scale (e b_r + u_r c),  S_r <- e S_r + u_r k.
//
// Launched with programmatic dependent launch (sm_90+, kvr_gdn_recur_args from a pdl
// call), the kernel may start while the previous kernel on the stream finishes: it waits
// (griddepcontrol.wait) before touching global memory, and lets the next kernel launch once
// its states are loaded.
#include "gdn_common.cuh"

namespace kvr {
namespace gdn {

using RecurParams = kvr_gdn_recur_args;


// One token's inputs of a warp: the lane's VW keys of q and k, the R rows' v, g and beta.
template <int VW, int R> struct RecurIn {
  float q[VW], k[VW], v[R], g, beta;
};

// The dot products of a token, in one butterfly over the warp: d[2r] = S_r . k, d[2r + 1] =
// S_r . q, d[2R] = k . q, and with NORM the factors that L2-normalize k and q (|k|^2 and
// |q|^2 ride in the same butterfly), 1 without.
template <int VW, int R> struct RecurDots {
  float d[2 * R + 1];
  float fk, fq;
};
template <int VW, int R, bool NORM>
__device__ __forceinline__ RecurDots<VW, R> recur_dots(const float (&s)[R][VW], const float* k, const float* q,
                                                       int l2norm, float eps) {
  constexpr int nd = NORM ? 2 * R + 3 : 2 * R + 1;
  float d[nd];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float a = 0.f, bq = 0.f;
#pragma unroll
    for (int c = 0; c < VW; ++c) {
      a = fmaf(s[r][c], k[c], a);
      bq = fmaf(s[r][c], q[c], bq);
    }
    d[2 * r] = a;
    d[2 * r + 1] = bq;
  }
  float kq = 0.f;
#pragma unroll
  for (int c = 0; c < VW; ++c) kq = fmaf(k[c], q[c], kq);
  d[2 * R] = kq;
  if constexpr (NORM) {
    float nk = 0.f, nq = 0.f;
#pragma unroll
    for (int c = 0; c < VW; ++c) {
      nk = fmaf(k[c], k[c], nk);
      nq = fmaf(q[c], q[c], nq);
    }
    d[2 * R + 1] = nk;
    d[2 * R + 2] = nq;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < nd; ++i) d[i] += __shfl_xor_sync(0xffffffffu, d[i], o);
  RecurDots<VW, R> x;
#pragma unroll
  for (int i = 0; i <= 2 * R; ++i) x.d[i] = d[i];
  x.fk = 1.f;
  x.fq = 1.f;
  if constexpr (NORM) {
    const float nk = d[2 * R + 1], nq = d[2 * R + 2];
    if (l2norm == 2) {  // ggml_l2_norm: x / max(|x|, eps)
      x.fk = 1.f / fmaxf(sqrtf(nk), eps);
      x.fq = 1.f / fmaxf(sqrtf(nq), eps);
    } else {  // fla: x / sqrt(|x|^2 + eps)
      x.fk = 1.f / sqrtf(nk + eps);
      x.fq = 1.f / sqrtf(nq + eps);
    }
  }
  return x;
}

// F32: every input and the output are f32 (llama.cpp's op): plain float loads and stores,
// no dtype dispatch (fewer instructions between the dependency wait and the last store,
// which is what a batch of one sequence waits on).
template <int DK, int R, bool F32, bool NORM>
__device__ __forceinline__ void recur_impl(const RecurParams& p) {
  constexpr int VW = DK / 32;
  const int lane = threadIdx.x & 31;
  // The grid is (warp groups, value heads, sequences): no division before the first load
  // but the key head's, which is on the critical path of a small batch.
  const int group = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (group >= p.groups) return;
  const int h = blockIdx.y, b = p.b0 + blockIdx.z;
  const int64_t item = static_cast<int64_t>(b) * p.hv + h;
  if (item < p.item0 || item >= p.item_end) return;
  const int row0 = group * R;
  const int kh = p.tiled ? h % p.hq : h / p.kh_div;
  bool valid[R];
#pragma unroll
  for (int r = 0; r < R; ++r) valid[r] = row0 + r < p.dv;

  // Every offset is computed (and pinned: the compiler would sink it) before the wait for
  // the previous kernel, which under programmatic dependent launch overlaps that kernel.
  int64_t q_at = b * p.q.s[0] + kh * p.q.s[2] + lane * VW;
  int64_t k_at = b * p.k.s[0] + kh * p.k.s[2] + lane * VW;
  int64_t v_at = b * p.v.s[0] + h * p.v.s[2] + row0 * p.v.s[3];
  int64_t g_at = b * p.g.s[0] + h * p.g.s[2];
  int64_t beta_at = b * p.beta.s[0] + h * p.beta.s[2];
  int64_t out_at = b * p.out.s[0] + h * p.out.s[2] + row0 * p.out.s[3];
  const float* src = p.state_in + b * p.si[0] + h * p.si[1] + row0 * p.si[2] + lane * VW;
  asm volatile("" : "+l"(q_at), "+l"(k_at), "+l"(v_at), "+l"(g_at), "+l"(beta_at), "+l"(out_at), "+l"(src));
  auto load = [&](int t, RecurIn<VW, R>& x) {
    if constexpr (F32) {
      ld_vec<float, VW>(static_cast<const float*>(p.q.p) + q_at + t * p.q.s[1], x.q);
      ld_vec<float, VW>(static_cast<const float*>(p.k.p) + k_at + t * p.k.s[1], x.k);
      const float* v = static_cast<const float*>(p.v.p) + v_at + t * p.v.s[1];
#pragma unroll
      for (int r = 0; r < R; ++r) x.v[r] = valid[r] ? v[r * p.v.s[3]] : 0.f;
      x.g = static_cast<const float*>(p.g.p)[g_at + t * p.g.s[1]];
      x.beta = static_cast<const float*>(p.beta.p)[beta_at + t * p.beta.s[1]];
    } else {
      ld_entry<VW>(static_cast<const char*>(p.q.p), p.q.dtype, q_at + t * p.q.s[1], x.q);
      ld_entry<VW>(static_cast<const char*>(p.k.p), p.k.dtype, k_at + t * p.k.s[1], x.k);
#pragma unroll
      for (int r = 0; r < R; ++r)
        x.v[r] = valid[r] ? ldx(p.v.p, p.v.dtype, v_at + t * p.v.s[1] + r * p.v.s[3]) : 0.f;
      x.g = ldx(p.g.p, p.g.dtype, g_at + t * p.g.s[1]);
      x.beta = ldx(p.beta.p, p.beta.dtype, beta_at + t * p.beta.s[1]);
    }
  };

  pdl_wait();
  float s[R][VW];
  {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (valid[r]) {
        ld_vec<float, VW>(src + r * p.si[2], s[r]);
      } else {
#pragma unroll
        for (int c = 0; c < VW; ++c) s[r][c] = 0.f;
      }
    }
  }
  pdl_launch_dependents();

  for (int t = 0; t < p.t; ++t) {
    RecurIn<VW, R> cur;
    load(t, cur);
    // a_r, b_r and c in one butterfly (2R + 1 sums; 2R + 3 with |k|^2 and |q|^2).
    const RecurDots<VW, R> x = recur_dots<VW, R, NORM>(s, cur.k, cur.q, p.l2norm, p.l2norm_eps);
    const float* d = x.d;
    const float fk = x.fk, fq = x.fq;

    const float e = expf(cur.g);
    const float c = d[2 * R] * fk * fq;
    const int slot = p.t - 1 - t;
    const int64_t out_t = out_at + t * p.out.s[1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float u = cur.beta * (cur.v[r] - e * (d[2 * r] * fk));
      const float y = p.scale * (e * (d[2 * r + 1] * fq) + u * c);
      const float uk = u * fk;
#pragma unroll
      for (int cc = 0; cc < VW; ++cc) s[r][cc] = fmaf(e, s[r][cc], uk * cur.k[cc]);
      if (lane == r && valid[r]) {
        if constexpr (F32)
          static_cast<float*>(p.out.p)[out_t + r * p.out.s[3]] = y;
        else
          stx(p.out.p, p.out.dtype, out_t + r * p.out.s[3], y);
      }
    }
    if (slot < p.n_snaps) {
      float* dst = p.snaps + slot * p.sn[0] + b * p.sn[1] + h * p.sn[2] + row0 * p.sn[3] + lane * VW;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (valid[r]) st_vec<float, VW>(dst + r * p.sn[3], s[r]);
    }
  }
  if (p.state_out) {
    float* dst = p.state_out + b * p.so[0] + h * p.so[1] + row0 * p.so[2] + lane * VW;
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (valid[r]) st_vec<float, VW>(dst + r * p.so[2], s[r]);
  }
}


// One token, every tensor f32, no snapshots (llama.cpp's decode op), over the compact
// kvr_gdn_recur1_args: the step above without its token loop, dtype dispatch, snapshot path
// and bounds checks (the host launches it only on an exact grid), in about half the
// registers (31-48 at dk 128 instead of 62-80), so twice the warps fit an SM. 32-bit token
// offsets, pinned before the dependency wait; after it come only the loads, one butterfly,
// the update and the stores. Each of these choices measured faster at batch 1 on an H200
// (bench/gdn_recur_ab.cu), where the step is a chain of latencies.
template <int DK, int R, bool NORM>
__device__ __forceinline__ void recur1_impl(const kvr_gdn_recur1_args& p) {
  constexpr int VW = DK / 32;
  const int lane = threadIdx.x & 31;
  const int group = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int h = blockIdx.y, b = blockIdx.z;
  const int row0 = group * R;
  const int kh = p.tiled ? h % p.hq : h / p.kh_div;
  int qo = b * p.qs[0] + kh * p.qs[1] + lane * VW;
  int ko = b * p.ks[0] + kh * p.ks[1] + lane * VW;
  int vo = b * p.vs[0] + h * p.vs[1] + row0 * p.vs[2];
  int go = b * p.gs[0] + h * p.gs[1];
  int bo = b * p.bs[0] + h * p.bs[1];
  int yo = b * p.ys[0] + h * p.ys[1] + row0 * p.ys[2];
  const float* src = p.state_in + b * p.si[0] + h * p.si[1] + row0 * p.si[2] + lane * VW;
  float* dst = p.state_out + b * p.so[0] + h * p.so[1] + row0 * p.so[2] + lane * VW;
  asm volatile("" : "+r"(qo), "+r"(ko), "+r"(vo), "+r"(go), "+r"(bo), "+r"(yo), "+l"(src), "+l"(dst));

  pdl_wait();
  float s[R][VW];
#pragma unroll
  for (int r = 0; r < R; ++r) ld_vec<float, VW>(src + r * p.si[2], s[r]);
  pdl_launch_dependents();
  float qv[VW], kv[VW], vv[R];
  ld_vec<float, VW>(p.q + qo, qv);
  ld_vec<float, VW>(p.k + ko, kv);
#pragma unroll
  for (int r = 0; r < R; ++r) vv[r] = p.v[vo + r * p.vs[2]];
  const float gv = p.g[go], bv = p.beta[bo];

  const RecurDots<VW, R> x = recur_dots<VW, R, NORM>(s, kv, qv, p.l2norm, p.l2norm_eps);
  const float* d = x.d;
  const float fk = x.fk, fq = x.fq;
  const float e = expf(gv);
  const float c = d[2 * R] * fk * fq;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float u = bv * (vv[r] - e * (d[2 * r] * fk));
    const float y = p.scale * (e * (d[2 * r + 1] * fq) + u * c);
    const float uk = u * fk;
#pragma unroll
    for (int cc = 0; cc < VW; ++cc) s[r][cc] = fmaf(e, s[r][cc], uk * kv[cc]);
    if (lane == r) p.out[yo + r * p.ys[2]] = y;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) st_vec<float, VW>(dst + r * p.so[2], s[r]);
}

template <int DK, int R>
__device__ __forceinline__ void recur_body(const RecurParams& p) {
  // KVR_DT_F32 is 0: one uniform branch picks the path for the whole grid.
  const bool f32 = (p.q.dtype | p.k.dtype | p.v.dtype | p.g.dtype | p.beta.dtype | p.out.dtype) == KVR_DT_F32;
  if (f32) {
    if (p.l2norm) recur_impl<DK, R, true, true>(p);
    else recur_impl<DK, R, true, false>(p);
  } else {
    if (p.l2norm) recur_impl<DK, R, false, true>(p);
    else recur_impl<DK, R, false, false>(p);
  }
}

}  // namespace gdn
}  // namespace kvr

// Resident CTAs per SM the register budget aims for (no spills with nvcc 13.0 at sm_90a):
// more rows per warp hold more registers but also more bytes in flight per warp.
#define KVR_GDN_RECUR_MINB(DK, R) ((DK) > 128 ? ((R) == 4 ? 4 : (R) == 2 ? 6 : 7) : ((R) == 4 ? 6 : 8))
#define KVR_GDN_RECUR(DK, R)                                                                        \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_RECUR_THREADS, KVR_GDN_RECUR_MINB(DK, R))    \
      kvr_gdn_recur_d##DK##_r##R(const __grid_constant__ kvr::gdn::RecurParams p) {                 \
    kvr::gdn::recur_body<DK, R>(p);                                                                 \
  }
// kvr_gdn_recur1[n]_d<dk>_r<rows>: the one-token f32 step (n: with the L2 norms).
#define KVR_GDN_RECUR1(DK, R, NAME, NORM)                                                           \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_RECUR_THREADS)                               \
      NAME##_d##DK##_r##R(const __grid_constant__ kvr_gdn_recur1_args p) {                        \
    kvr::gdn::recur1_impl<DK, R, NORM>(p);                                                          \
  }
#define KVR_GDN_RECUR_DK(DK)                                                                          \
  KVR_GDN_RECUR(DK, 1) KVR_GDN_RECUR(DK, 2) KVR_GDN_RECUR(DK, 4)                                     \
  KVR_GDN_RECUR1(DK, 1, kvr_gdn_recur1, false) KVR_GDN_RECUR1(DK, 2, kvr_gdn_recur1, false)          \
  KVR_GDN_RECUR1(DK, 4, kvr_gdn_recur1, false) KVR_GDN_RECUR1(DK, 1, kvr_gdn_recur1n, true)          \
  KVR_GDN_RECUR1(DK, 2, kvr_gdn_recur1n, true) KVR_GDN_RECUR1(DK, 4, kvr_gdn_recur1n, true)
KVR_GDN_RECUR_DK(32)
KVR_GDN_RECUR_DK(64)
KVR_GDN_RECUR_DK(128)
KVR_GDN_RECUR_DK(256)
#undef KVR_GDN_RECUR_DK
#undef KVR_GDN_RECUR1
#undef KVR_GDN_RECUR
#undef KVR_GDN_RECUR_MINB
