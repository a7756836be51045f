// Gated DeltaNet decode of KV-only sequences (no state yet, only their entries), one token
// (T = 1, auto-commit, delta rule), one (batch row, value head) per CTA of
// KVR_GDN_KVONLY_THREADS: kvonly_head, run by the kernel kvr_gdn_kvonly_* (gdn_kvonly.cu; a
// CTA per row and head, launched beside kvr_gdn_decode_*, which skips those rows: `kv_split`
// 1) or, for small batches, by the decode kernel's CTA of the head's first value-row tile
// (`kv_split` 2: one launch; kernels/gdn_decode.cu). The decode kernel materializes the
// sequences that reach the threshold and kvr_gdn_finish advances the metadata of all.
//
// A KV-only sequence of n entries (u_j [dv], k_j [dk], g_j; in the memory of its unused
// state, per value head) has, with w_j = e^{g_{j+1} + ... + g_{n-1}},
//   S_{t-1} x = sum_j w_j (k_j . x) u_j          for x in {q_t, k_t},
// then u_t = beta (v_t - e^{g_t} S_{t-1} k_t) and y_t = e^{g_t} S_{t-1} q_t + (k_t . q_t) u_t,
// as the decode kernel's readout without state computes it. Where that readout gave each
// 32-row tile of a head its own CTA, which loaded every key again and walked the entries in
// dependent chunks of 16 with a barrier each, this is one CTA over all dv rows in phases:
// (1) q and k normalized into shared memory; (2) a thread per entry: k_j . q and k_j . k
// from 16-byte loads of the entry's key, and the decay weights by a block scan; (3) the
// weighted sums of the u rows, a warp per group of entries with 8 contiguous rows per lane
// (coalesced 16-byte loads, 4 entries in flight), reduced over the warps in shared memory. The bytes are the
// entries' keys and values once: the KV-only mode's point (fewer than a state's).
#pragma once

#include "gdn_common.cuh"

namespace kvr {
namespace gdn {

constexpr int kKvThreads = KVR_GDN_KVONLY_THREADS;
constexpr int kKvWarps = kKvThreads / 32;
constexpr int kKvMax = KVR_GDN_KVONLY_MAX;

// One (batch row b, value head h) of sequence `seq` whose metadata `m4` (mode, start, h,
// pending) says KV-only without a flush this step, by the calling CTA of kKvThreads threads.
template <typename SD, int DK>
__device__ void kvonly_head(const StepParams& p, int b, int h, int seq, const int4 m4) {
  __shared__ float sq[DK], sk[DK];
  __shared__ float cw[2][kKvMax];            // k_j . q, k_j . k, then times w_j
  __shared__ float red[2][kKvWarps][kKvMax];  // per-warp row sums
  __shared__ float part[3][kKvWarps];
  __shared__ float scan[kKvWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const int n = m4.z, dv = p.dv, kh = h / (p.hv / p.hk);
  const int dt = p.entry_dtype;
  const int ee = dt == KVR_DT_F32 ? 4 : 2;
  char* head = p.state + (static_cast<int64_t>(seq) * p.seq_stride + static_cast<int64_t>(h) * DK * dv) *
                             static_cast<int64_t>(sizeof(SD));
  char* eu = head;                                              // u [cap][dv]
  char* ek = head + static_cast<int64_t>(p.kv_cap) * dv * ee;   // k [cap][dk]
  float* eg = reinterpret_cast<float*>(head + static_cast<int64_t>(p.kv_cap) * (dv + DK) * ee);  // g [cap]

  // (1) q and k of the token (normalized, q scaled, k rounded as it is buffered); the
  // entries' decays in flight meanwhile.
  constexpr int NC = kKvMax / kKvThreads;  // entries per thread at most
  float gc[NC];                            // thread t: entries n - 1 - t - c * threads
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int j = n - 1 - tid - c * kKvThreads;
    gc[c] = j >= 0 ? eg[j] : 0.f;
  }
  const float2 gb = token_gb(p, b, 0, h);
  {
    float nq = 0.f, nk = 0.f;
    const int64_t qo = b * p.q.s[0] + kh * p.q.s[2], ko = b * p.k.s[0] + kh * p.k.s[2];
    for (int i = tid; i < DK; i += kKvThreads) {
      const float x = ldx(p.q.p, p.q.dtype, qo + i * p.q.s[3]);
      const float y = ldx(p.k.p, p.k.dtype, ko + i * p.k.s[3]);
      sq[i] = x;
      sk[i] = y;
      nq += x * x;
      nk += y * y;
    }
    nq = warp_sum(nq);
    nk = warp_sum(nk);
    if (lane == 0) {
      part[0][warp] = nq;
      part[1][warp] = nk;
    }
    __syncthreads();
    nq = nk = 0.f;
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) {
      nq += part[0][w];
      nk += part[1][w];
    }
    const float fq = (p.l2norm ? 1.f / sqrtf(nq + 1e-6f) : 1.f) * p.scale;
    const float fk = p.l2norm ? 1.f / sqrtf(nk + 1e-6f) : 1.f;
    float kq = 0.f;
    for (int i = tid; i < DK; i += kKvThreads) {
      const float x = sq[i] * fq, y = roundx(dt, sk[i] * fk);
      sq[i] = x;
      sk[i] = y;
      kq += x * y;
    }
    kq = warp_sum(kq);
    if (lane == 0) part[2][warp] = kq;
    __syncthreads();
  }

  // (2) A thread per entry: its key products (16-byte loads, all issued before the sums).
  for (int j = tid; j < n; j += kKvThreads) {
    const char* kp = ek + static_cast<int64_t>(j) * DK * ee;
    float a = 0.f, c = 0.f;
    constexpr int V = 8;  // keys per step
#pragma unroll 4
    for (int i = 0; i < DK; i += V) {
      float x[V];
      ld_entry<V>(kp, dt, i, x);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        a = fmaf(x[e], sq[i + e], a);
        c = fmaf(x[e], sk[i + e], c);
      }
    }
    cw[0][j] = a;
    cw[1][j] = c;
  }
  // ... and the weights: thread t holds entry n - 1 - t (and every kKvThreads further back):
  // an inclusive scan over t gives sum_{i >= j} g_i; w_j leaves out g_j itself.
  float carry = 0.f, wj[NC];
  const int chunks = (n + kKvThreads - 1) / kKvThreads;  // uniform over the CTA
#pragma unroll
  for (int half = 0; half < NC; ++half) {
    wj[half] = 0.f;
    if (half >= chunks) continue;
    const float x0 = gc[half];
    float x = x0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) scan[warp] = x;
    __syncthreads();
    float off = carry, tot = 0.f;
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) {
      if (w < warp) off += scan[w];
      tot += scan[w];
    }
    wj[half] = expf(off + x - x0);
    carry += tot;
    __syncthreads();  // scan[] is reused
  }
#pragma unroll
#pragma unroll
  for (int half = 0; half < NC; ++half) {
    const int j = n - 1 - tid - half * kKvThreads;
    if (j >= 0) {
      cw[0][j] *= wj[half];
      cw[1][j] *= wj[half];
    }
  }
  __syncthreads();

  // (3) Row sums: LPE lanes per entry, 8 contiguous value rows per lane.
  const int lpe = dv / 8, epw = 32 / lpe;  // dv in {32, 64, 128, 256}
  const int sub = lane / lpe, col = (lane % lpe) * 8;
  float hq[8], hk[8];
#pragma unroll
  for (int r = 0; r < 8; ++r) hq[r] = hk[r] = 0.f;
  const int step = kKvWarps * epw;
  int j = warp * epw + sub;
  for (; j + 3 * step < n; j += 4 * step) {
    float x[4][8];
#pragma unroll
    for (int e = 0; e < 4; ++e) ld_entry<8>(eu, dt, static_cast<int64_t>(j + e * step) * dv + col, x[e]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float a = cw[0][j + e * step], c = cw[1][j + e * step];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        hq[r] = fmaf(a, x[e][r], hq[r]);
        hk[r] = fmaf(c, x[e][r], hk[r]);
      }
    }
  }
  for (; j < n; j += step) {
    float x[8];
    ld_entry<8>(eu, dt, static_cast<int64_t>(j) * dv + col, x);
    const float a = cw[0][j], c = cw[1][j];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      hq[r] = fmaf(a, x[r], hq[r]);
      hk[r] = fmaf(c, x[r], hk[r]);
    }
  }
  for (int o = lpe; o < 32; o <<= 1)
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      hq[r] += __shfl_xor_sync(0xffffffffu, hq[r], o);
      hk[r] += __shfl_xor_sync(0xffffffffu, hk[r], o);
    }
  if (sub == 0)
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      red[0][warp][col + r] = hq[r];
      red[1][warp][col + r] = hk[r];
    }
  __syncthreads();

  // (4) The new entry and the output.
  float kq = 0.f;
#pragma unroll
  for (int w = 0; w < kKvWarps; ++w) kq += part[2][w];
  const float a = expf(gb.x), beta = gb.y;
  for (int r = tid; r < dv; r += kKvThreads) {
    float q_hist = 0.f, k_hist = 0.f;
#pragma unroll
    for (int w = 0; w < kKvWarps; ++w) {
      q_hist += red[0][w][r];
      k_hist += red[1][w][r];
    }
    const float v = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + r * p.v.s[3]);
    const float u = beta * (v - a * k_hist);
    const float y = a * q_hist + kq * u;
    stx(p.out.p, p.out.dtype, b * p.out.s[0] + h * p.out.s[2] + r * p.out.s[3], epilogue(p, b, 0, h, r, v, y));
    stx(eu, dt, static_cast<int64_t>(n) * dv + r, u);
  }
  for (int i = tid; i < DK; i += kKvThreads) stx(ek, dt, static_cast<int64_t>(n) * DK + i, sk[i]);
  if (tid == 0) eg[n] = gb.x;
  if (p.conv_dim > 0) {
    // The decode kernel's CTAs of this head would each have copied a share of the window.
    const int conv_end = __ldcg(meta + kMetaConvEnd);
    for (int tile = 0; tile < p.tiles; ++tile) conv_window_share(p, b, seq, h, tile, conv_end, tid, kKvThreads);
  }
}

// The KV-only kernel: a CTA per (batch row, value head); rows that are not KV-only, or
// materialize this step, are the decode kernel's.
template <typename SD, int DK>
__device__ void kvonly_body(const StepParams& p) {
  const int h = blockIdx.x % p.hv, b = blockIdx.x / p.hv;
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  if (seq < 0) return;  // the decode kernel writes the zeros of unused rows
  const int4 m4 = __ldcg(reinterpret_cast<const int4*>(p.meta + static_cast<int64_t>(seq) * kMetaInts));
  if (m4.x != kModeKvOnly || placement(p, m4.x, m4.y, m4.z).flush) return;
  kvonly_head<SD, DK>(p, b, h, seq, m4);
}

}  // namespace gdn
}  // namespace kvr

