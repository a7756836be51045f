// Pieces shared by the streaming GDN kernels (gdn_stream.cu: decode; gdn_sverify.cu:
// verify): CTA size, the bulk-copy + mbarrier primitives of sm_90, and a 4-value warp sum.
#pragma once
#include "gdn_common.cuh"

namespace kvr {
namespace gdn {

constexpr int kStreamThreads = KVR_GDN_STREAM_THREADS;
constexpr int kStreamWarps = kStreamThreads / 32;

__host__ __device__ constexpr int align16(int x) { return (x + 15) & ~15; }

// State tiles travel by the bulk copy engine on sm_90 (cp.async.bulk completing on an
// mbarrier: the bytes in flight are not bounded by the SM's load queues, which capped the
// per-thread cp.async version of this kernel at about 1.4-1.8 TB/s), by cp.async before.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVR_GDN_BULK 1
#else
#define KVR_GDN_BULK 0
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#if KVR_GDN_BULK
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16) from global `src` to shared `dst`, completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

// Sums P[0..4) over the warp; lane l ends with the total of P[l / 8]: exchange 1 splits on
// lane bit 3 into even / odd entries, exchange 2 on bit 4 into first / second of the pair,
// then a butterfly over the 8 lanes that share both bits (7 shuffles instead of 20).
__device__ __forceinline__ float reduce4(float (&P)[4], int lane) {
  // exchange 1: lanes with bit 8 keep the odd entries
  {
    const bool hi = lane & 8;
    const float k0 = hi ? P[1] : P[0], s0 = hi ? P[0] : P[1];
    const float k1 = hi ? P[3] : P[2], s1 = hi ? P[2] : P[3];
    P[0] = k0 + __shfl_xor_sync(0xffffffffu, s0, 8);
    P[1] = k1 + __shfl_xor_sync(0xffffffffu, s1, 8);
  }
  // exchange 2: lanes with bit 16 keep the second
  {
    const bool hi = lane & 16;
    const float k0 = hi ? P[1] : P[0], s0 = hi ? P[0] : P[1];
    P[0] = k0 + __shfl_xor_sync(0xffffffffu, s0, 16);
  }
  float x = P[0];
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}


// A K-major tile from shared memory (DK rows of `row_bytes`) back to its rows of the state, 16
// bytes a thread and consecutive threads along a row. All kStreamThreads threads.
template <typename SD>
__device__ __forceinline__ void store_kmajor_tile(const unsigned char* src, char* hd, int v0, int R, int dv,
                                                  int row_bytes, int DK) {
  const int c16 = R * static_cast<int>(sizeof(SD)) / 16;
  for (int i = threadIdx.x; i < DK * c16; i += kStreamThreads) {
    const int k = i / c16, c = i - k * c16;
    *reinterpret_cast<int4*>(hd + (static_cast<int64_t>(k) * dv + v0) * static_cast<int>(sizeof(SD)) + 16 * c) =
        *reinterpret_cast<const int4*>(src + k * row_bytes + 16 * c);
  }
}

// The drafts' products with each other, a warp per pair (warps w0, w0 + nw, ..): k_s . k_s'
// (s' < s) at cc[s * st + s'] and k_s' . q_s (s' <= s) at cc[st * st + s * st + s'], from
// q and k rows of DK floats (natural key order).
template <int DK>
__device__ __forceinline__ void draft_pairs(const float* qs, const float* ks, int T, int w0, int nw, int lane,
                                            float* cc, int st) {
  for (int x = w0; x < 2 * T * T; x += nw) {
    const bool isq = x >= T * T;
    const int s = (x % (T * T)) / T, s2 = x % T;
    if (isq ? s2 > s : s2 >= s) continue;
    const float* a = (isq ? qs : ks) + s * DK;
    const float* c = ks + s2 * DK;
    float d = 0.f;
    for (int i = lane; i < DK; i += 32) d += a[i] * c[i];
    d = warp_sum(d);
    if (lane == 0) cc[(isq ? st * st : 0) + s * st + s2] = d;
  }
}

// Weights of a ring's entries by a suffix scan over their decays gs[0..nbuf) (one warp, blocks
// of 32 entries, last block first): f(j, w_j) for every entry, w_j = e^{g_{j+1} + ... +
// g_{nbuf-1}}; returns e^G, G the sum of all decays (every lane).
template <typename F>
__device__ __forceinline__ float suffix_weights(const float* gs, int nbuf, int lane, F f) {
  float carry = 0.f;
  for (int blk = nbuf > 0 ? ((nbuf - 1) / 32) * 32 : -32; blk >= 0; blk -= 32) {
    const int jl = blk + lane;
    const float2 sc = warp_suffix(jl < nbuf ? gs[jl] : 0.f, lane);
    if (jl < nbuf) f(jl, expf(carry + sc.x));
    carry += sc.y;
  }
  return expf(carry);
}

// The flush of a tile of R value rows: S' = e^G S + sum_j w_j u_j k_j^T, from the tile in shared
// memory `st` (rows of `row_bytes`), the tile's ring rows `ut` ([j][R], entry dtype), weights
// `wg` and keys entry_k(j) (global, L1/L2-resident), written to the state at `head` (V-major
// rows directly; K-major into `st`, then coalesced). All kStreamThreads threads.
template <typename SD, bool VM, int DK, typename EntryK>
__device__ __forceinline__ void fold_tile(unsigned char* st, char* head, int v0, int R, int dv, int row_bytes,
                                          float eG, int nbuf, const float* wg, const unsigned char* ut,
                                          int entry_dtype, EntryK entry_k) {
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  auto key = [&](int c) { return (c / VW) * (32 * VW) + lane * VW + c % VW; };
  if constexpr (VM) {
    const int rpw = R / kStreamWarps;
    for (int r0 = 0; r0 < rpw; r0 += 2) {
      float s[2][KL];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const SD* row = reinterpret_cast<const SD*>(st + (warp * rpw + r0 + e) * row_bytes);
#pragma unroll
        for (int c = 0; c < KL; c += VW) ld_vec<SD, VW>(row + key(c), &s[e][c]);
#pragma unroll
        for (int c = 0; c < KL; ++c) s[e][c] *= eG;
      }
#pragma unroll 4
      for (int j = 0; j < nbuf; ++j) {
        float kj[KL];
        const char* kp = entry_k(j);
#pragma unroll
        for (int c = 0; c < KL; c += VW) ld_entry<VW>(kp, entry_dtype, key(c), &kj[c]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float wu = wg[j] * ldx(ut, entry_dtype, j * R + warp * rpw + r0 + e);
#pragma unroll
          for (int c = 0; c < KL; ++c) s[e][c] += wu * kj[c];
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int c = 0; c < KL; c += VW)
          st_vec<SD, VW>(reinterpret_cast<SD*>(head) + static_cast<int64_t>(v0 + warp * rpw + r0 + e) * DK + key(c),
                         &s[e][c]);
    }
  } else {
    // lane = (quad, ksub): a quad is 4 value columns, ksub steps over key rows.
    const int nq = R / 32, ns = 32 / nq;
    const int ql = lane / ns, ksub = lane - ql * ns;
    const int c0 = warp * (R / kStreamWarps) + 4 * ql;
    for (int k = ksub; k < DK; k += ns) {
      float s[4];
      ld_vec<SD, 4>(reinterpret_cast<const SD*>(st + k * row_bytes) + c0, s);
#pragma unroll
      for (int x = 0; x < 4; ++x) s[x] *= eG;
#pragma unroll 4
      for (int j = 0; j < nbuf; ++j) {
        const float f = wg[j] * ldx(entry_k(j), entry_dtype, k);
        float u4[4];
        ld_entry<4>(reinterpret_cast<const char*>(ut), entry_dtype, j * R + c0, u4);
#pragma unroll
        for (int x = 0; x < 4; ++x) s[x] += f * u4[x];
      }
      st_vec<SD, 4>(reinterpret_cast<SD*>(st + k * row_bytes) + c0, s);
    }
    __syncthreads();
    store_kmajor_tile<SD>(st, head, v0, R, dv, row_bytes, DK);
  }
}

// 2T dot products of a warp's vector a (KL values per lane in the key map of `key`) with the
// rows x of qs (x < T) and ks (x >= T), [T][DK] each in shared memory, four per reduce4: the
// sums go to out_q[x * stride + idx] and out_k[(x - T) * stride + idx].
template <int KL, int VW, int DK>
__device__ __forceinline__ void dots_2t(const float (&a)[KL], const float* qs, const float* ks, int T, int lane,
                                        float* out_q, float* out_k, int stride, int idx) {
  for (int x0 = 0; x0 < 2 * T; x0 += 4) {
    float P[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int x = min(x0 + e, 2 * T - 1);
      const float* v = x < T ? qs + x * DK : ks + (x - T) * DK;
      float d = 0.f;
#pragma unroll
      for (int c = 0; c < KL; ++c) d += a[c] * v[(c / VW) * (32 * VW) + lane * VW + c % VW];
      P[e] = d;
    }
    const float r = reduce4(P, lane);
    const int x = x0 + (lane >> 3);
    if ((lane & 7) == 0 && x < 2 * T) (x < T ? out_q + x * stride : out_k + (x - T) * stride)[idx] = r;
  }
}

// c += A B on tensor cores (m16n8k8, TF32 inputs, f32 accumulate), the fragments of one warp:
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g] (g = lane / 4,
// t = lane % 4); c = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The same with each operand split into a TF32 high part and a TF32 low part (the rounding
// error): hi*hi + hi*lo + lo*hi, which keeps f32 accuracy (3xTF32).
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const float (&a)[4], const float (&b)[2]) {
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    ah[i] = to_tf32(a[i]);
    al[i] = to_tf32(a[i] - __uint_as_float(ah[i]));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    bh[i] = to_tf32(b[i]);
    bl[i] = to_tf32(b[i] - __uint_as_float(bh[i]));
  }
  mma_tf32(c, al, bh);
  mma_tf32(c, ah, bl);
  mma_tf32(c, ah, bh);
}
}  // namespace gdn
}  // namespace kvr
