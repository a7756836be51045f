// Stateless recurrent Gated DeltaNet over the caller's tensors (kvr_context_gdn_recurrent):
//   kvr_gdn_recur_d<dk>_r<rows>   T tokens for B sequences, state in -> state out (and/or
//                                 the last per-token states as snapshots)
// (src/linear/gdn/recur.rs launches it; llama.cpp's GGML_OP_GATED_DELTA_NET runs on it.)
//
// The step is a stream over the states: each state element is read once, updated T times
// in registers and written once (plus once per snapshot), so the kernel is shaped for
// memory-level parallelism. One warp owns R value rows of one (sequence, value head) with
// the whole key dimension: lane l holds keys [l * VW, l * VW + VW) of each row (VW = dk /
// 32, read as one or two 16-byte vectors), so a warp instruction reads 512 contiguous
// bytes of a row. No shared memory and no CTA barrier; R is picked on the host so that the
// launch still has 16 warps per SM (1 row per warp at batch 1, 4 from batch ~8 at the
// Qwen3-Next shape), more rows per warp meaning fewer redundant q/k loads and reductions.
//
// Per token, with e = exp(g) and S the rows before the token, all dot products come from
// one butterfly over the warp (no second reduction after the update):
//   a_r = S_r . k,  b_r = S_r . q,  c = k . q   (k, q L2-normalized first if asked)
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

template <int DK, int R>
__device__ __forceinline__ void recur_body(const RecurParams& p) {
  constexpr int VW = DK / 32;
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t item = p.item0 + warp / p.groups;
  if (item >= p.item_end) return;
  const int row0 = static_cast<int>(warp % p.groups) * R;
  const int b = static_cast<int>(item / p.hv), h = static_cast<int>(item % p.hv);
  const int kh = p.tiled ? h % p.hq : h / (p.hv / p.hq);
  bool valid[R];
#pragma unroll
  for (int r = 0; r < R; ++r) valid[r] = row0 + r < p.dv;

  const int64_t q_at = b * p.q.s[0] + kh * p.q.s[2] + lane * VW;
  const int64_t k_at = b * p.k.s[0] + kh * p.k.s[2] + lane * VW;
  const int64_t v_at = b * p.v.s[0] + h * p.v.s[2] + row0 * p.v.s[3];
  const int64_t g_at = b * p.g.s[0] + h * p.g.s[2];
  const int64_t beta_at = b * p.beta.s[0] + h * p.beta.s[2];
  auto load = [&](int t, RecurIn<VW, R>& x) {
    ld_entry<VW>(static_cast<const char*>(p.q.p), p.q.dtype, q_at + t * p.q.s[1], x.q);
    ld_entry<VW>(static_cast<const char*>(p.k.p), p.k.dtype, k_at + t * p.k.s[1], x.k);
#pragma unroll
    for (int r = 0; r < R; ++r)
      x.v[r] = valid[r] ? ldx(p.v.p, p.v.dtype, v_at + t * p.v.s[1] + r * p.v.s[3]) : 0.f;
    x.g = ldx(p.g.p, p.g.dtype, g_at + t * p.g.s[1]);
    x.beta = ldx(p.beta.p, p.beta.dtype, beta_at + t * p.beta.s[1]);
  };

  pdl_wait();
  float s[R][VW];
  {
    const float* src = p.state_in + b * p.si[0] + h * p.si[1] + row0 * p.si[2] + lane * VW;
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
    // a_r, b_r and c in one butterfly (2R + 1 sums).
    float d[2 * R + 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float a = 0.f, bq = 0.f;
#pragma unroll
      for (int c = 0; c < VW; ++c) {
        a = fmaf(s[r][c], cur.k[c], a);
        bq = fmaf(s[r][c], cur.q[c], bq);
      }
      d[2 * r] = a;
      d[2 * r + 1] = bq;
    }
    float kq = 0.f;
#pragma unroll
    for (int c = 0; c < VW; ++c) kq = fmaf(cur.k[c], cur.q[c], kq);
    d[2 * R] = kq;
    float fk = 1.f, fq = 1.f;
    if (p.l2norm) {
      float nk = 0.f, nq = 0.f;
#pragma unroll
      for (int c = 0; c < VW; ++c) {
        nk = fmaf(cur.k[c], cur.k[c], nk);
        nq = fmaf(cur.q[c], cur.q[c], nq);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        nk += __shfl_xor_sync(0xffffffffu, nk, o);
        nq += __shfl_xor_sync(0xffffffffu, nq, o);
      }
      fk = 1.f / sqrtf(nk + 1e-6f);
      fq = 1.f / sqrtf(nq + 1e-6f);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int i = 0; i < 2 * R + 1; ++i) d[i] += __shfl_xor_sync(0xffffffffu, d[i], o);

    const float e = expf(cur.g);
    const float c = d[2 * R] * fk * fq;
    const int slot = p.t - 1 - t;
    const int64_t out_at = b * p.out.s[0] + t * p.out.s[1] + h * p.out.s[2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float u = cur.beta * (cur.v[r] - e * (d[2 * r] * fk));
      const float y = p.scale * (e * (d[2 * r + 1] * fq) + u * c);
      const float uk = u * fk;
#pragma unroll
      for (int cc = 0; cc < VW; ++cc) s[r][cc] = fmaf(e, s[r][cc], uk * cur.k[cc]);
      if (lane == r && valid[r]) stx(p.out.p, p.out.dtype, out_at + (row0 + r) * p.out.s[3], y);
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
#define KVR_GDN_RECUR_DK(DK) KVR_GDN_RECUR(DK, 1) KVR_GDN_RECUR(DK, 2) KVR_GDN_RECUR(DK, 4)
KVR_GDN_RECUR_DK(32)
KVR_GDN_RECUR_DK(64)
KVR_GDN_RECUR_DK(128)
KVR_GDN_RECUR_DK(256)
#undef KVR_GDN_RECUR_DK
#undef KVR_GDN_RECUR
#undef KVR_GDN_RECUR_MINB
