// Declarations shared by the GDN kernels (kernels/gdn.cu, gdn_decode.cu, gdn_stream.cu): the
// launch parameters, metadata record and codes under their kernel names (defined in
// kvr_abi.h), element access and the placement rule the step, decode and finish kernels must
// agree on.
#pragma once

#include "mma.cuh"
namespace kvr {
namespace gdn {

constexpr int kThreads = KVR_GDN_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = KVR_GDN_CHUNK;
constexpr int kMaxT = KVR_GDN_MAX_T;

enum : int {
  kModeKvOnly = KVR_GDN_KV_ONLY,
  kModeReplay = KVR_GDN_REPLAY,
  kModeRecurrent = KVR_GDN_RECURRENT
};
enum : int {
  kMetaMode = KVR_GDN_META_MODE,
  kMetaStart = KVR_GDN_META_START,
  kMetaH = KVR_GDN_META_H,
  kMetaPending = KVR_GDN_META_PENDING,
  kMetaConvEnd = KVR_GDN_META_CONV_END,
  kMetaArrive = KVR_GDN_META_ARRIVE,
  kMetaInts = KVR_GDN_META_INTS
};
enum : int { kOpStep = KVR_GDN_OP_STEP, kOpFlush = KVR_GDN_OP_FLUSH, kOpExport = KVR_GDN_OP_EXPORT };
// The decode kernels read mode, start, h and pending as one int4.
static_assert(kMetaMode == 0 && kMetaStart == 1 && kMetaH == 2 && kMetaPending == 3,
              "mode, start, h, pending are the record's first four words");
static_assert(kMetaInts % 4 == 0 && kMetaArrive < kMetaInts, "16-byte metadata records");

using Tensor = kvr_gdn_tensor;
using StepParams = kvr_gdn_step_args;
using LayerState = kvr_gdn_layer_state;
using CommitParams = kvr_gdn_commit_args;

__device__ __forceinline__ float ldx(const void* p, int dt, int64_t i) {
  if (dt == KVR_DT_F32) return static_cast<const float*>(p)[i];
  if (dt == KVR_DT_F16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ void stx(void* p, int dt, int64_t i, float x) {
  if (dt == KVR_DT_F32)
    static_cast<float*>(p)[i] = x;
  else if (dt == KVR_DT_F16)
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  else
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
}

// What storing as `dt` keeps.
__device__ __forceinline__ float roundx(int dt, float x) {
  if (dt == KVR_DT_F16) return __half2float(__float2half_rn(x));
  if (dt == KVR_DT_BF16) return __bfloat162float(__float2bfloat16_rn(x));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Suffix sums over a warp, lane j's value x_j: (x_{j+1} + ... + x_31, the warp's total) in lane
// j. The ring weights' scan (w_j = e^{g_{j+1} + ... + g_{h-1}}).
__device__ __forceinline__ float2 warp_suffix(float x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float t = __shfl_down_sync(0xffffffffu, x, o);
    if (lane + o < 32) x += t;
  }
  float excl = __shfl_down_sync(0xffffffffu, x, 1);
  if (lane == 31) excl = 0.f;
  return make_float2(excl, __shfl_sync(0xffffffffu, x, 0));
}

template <typename SD> struct StateIO;
template <> struct StateIO<float> {
  static __device__ __forceinline__ float4 load(const char* base, int64_t e) {
    return *reinterpret_cast<const float4*>(base + e * 4);
  }
  static __device__ __forceinline__ void store(char* base, int64_t e, float4 v) {
    *reinterpret_cast<float4*>(base + e * 4) = v;
  }
  static __device__ __forceinline__ float4 round(float4 v) { return v; }
};
template <> struct StateIO<__nv_bfloat16> {
  static __device__ __forceinline__ float4 load(const char* base, int64_t e) {
    const uint2 r = *reinterpret_cast<const uint2*>(base + e * 2);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
  static __device__ __forceinline__ void store(char* base, int64_t e, float4 v) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y);
    const __nv_bfloat162 b = __floats2bfloat162_rn(v.z, v.w);
    uint2 r;
    r.x = *reinterpret_cast<const uint32_t*>(&a);
    r.y = *reinterpret_cast<const uint32_t*>(&b);
    *reinterpret_cast<uint2*>(base + e * 2) = r;
  }
  static __device__ __forceinline__ float4 round(float4 v) {
    return make_float4(roundx(KVR_DT_BF16, v.x), roundx(KVR_DT_BF16, v.y), roundx(KVR_DT_BF16, v.z),
                       roundx(KVR_DT_BF16, v.w));
  }
};

// Vector loads and stores and warp reductions shared by the decode kernels (gdn_decode.cu,
// gdn_stream.cu).
// N contiguous elements of T at p (aligned to their size, up to 16 bytes) as floats.
template <typename T, int N>
__device__ __forceinline__ void ld_vec(const T* p, float* d) {
  if constexpr (sizeof(T) == 4) {
    if constexpr (N == 1) {
      d[0] = p[0];
    } else if constexpr (N == 2) {
      const float2 a = *reinterpret_cast<const float2*>(p);
      d[0] = a.x;
      d[1] = a.y;
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        const float4 a = *reinterpret_cast<const float4*>(p + i);
        d[i] = a.x;
        d[i + 1] = a.y;
        d[i + 2] = a.z;
        d[i + 3] = a.w;
      }
    }
  } else {
    auto two = [&](uint32_t r, float* o) {
      float2 f;
      if constexpr (IsSame<T, __half>::value)
        f = __half22float2(*reinterpret_cast<const __half2*>(&r));
      else
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r));
      o[0] = f.x;
      o[1] = f.y;
    };
    if constexpr (N == 1) {
      d[0] = to_float(p[0]);
    } else if constexpr (N == 2) {
      two(*reinterpret_cast<const uint32_t*>(p), d);
    } else if constexpr (N == 4) {
      const uint2 r = *reinterpret_cast<const uint2*>(p);
      two(r.x, d);
      two(r.y, d + 2);
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 8) {
        const uint4 r = *reinterpret_cast<const uint4*>(p + i);
        two(r.x, d + i);
        two(r.y, d + i + 2);
        two(r.z, d + i + 4);
        two(r.w, d + i + 6);
      }
    }
  }
}

// The same for a runtime entry dtype (KVR_DT_*); `e` counts elements.
template <int N>
__device__ __forceinline__ void ld_entry(const char* base, int dt, int64_t e, float* d) {
  if (dt == KVR_DT_F32)
    ld_vec<float, N>(reinterpret_cast<const float*>(base) + e, d);
  else if (dt == KVR_DT_F16)
    ld_vec<__half, N>(reinterpret_cast<const __half*>(base) + e, d);
  else
    ld_vec<__nv_bfloat16, N>(reinterpret_cast<const __nv_bfloat16*>(base) + e, d);
}

// N contiguous floats stored as T at p.
template <typename T, int N>
__device__ __forceinline__ void st_vec(T* p, const float* s) {
  if constexpr (sizeof(T) == 4) {
    if constexpr (N == 1) {
      p[0] = s[0];
    } else if constexpr (N == 2) {
      *reinterpret_cast<float2*>(p) = make_float2(s[0], s[1]);
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 4)
        *reinterpret_cast<float4*>(p + i) = make_float4(s[i], s[i + 1], s[i + 2], s[i + 3]);
    }
  } else {
    static_assert(IsSame<T, __nv_bfloat16>::value, "bf16 is the only 2-byte state");
    auto two = [&](int i) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(s[i], s[i + 1]);
      return *reinterpret_cast<const uint32_t*>(&b);
    };
    if constexpr (N == 1) {
      p[0] = __float2bfloat16_rn(s[0]);
    } else if constexpr (N == 2) {
      *reinterpret_cast<uint32_t*>(p) = two(0);
    } else if constexpr (N == 4) {
      *reinterpret_cast<uint2*>(p) = make_uint2(two(0), two(2));
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 8)
        *reinterpret_cast<uint4*>(p + i) = make_uint4(two(i), two(i + 2), two(i + 4), two(i + 6));
    }
  }
}

// c ? a : b on values (a plain ?: on array elements can become a local-memory load).
__device__ __forceinline__ float pick(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return __uint_as_float((__float_as_uint(a) & m) | (__float_as_uint(b) & ~m));
}

// One halving exchange of reduce_scatter: lanes with bit M keep the odd entries, the others
// the even ones, each adding its partner's copy; then the next exchange.
template <int N, int M>
__device__ __forceinline__ void halve(float* P, int lane) {
  const bool hi = lane & M;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float keep = pick(hi, P[2 * i + 1], P[2 * i]);
    const float send = pick(hi, P[2 * i], P[2 * i + 1]);
    P[i] = keep + __shfl_xor_sync(0xffffffffu, send, M);
  }
  if constexpr (N / 2 > 1) halve<N / 2, 2 * M>(P, lane);
}

// Sums P[i] over the warp for every i < N (N a power of two, 2..32) and leaves the total of
// P[lane / (32 / N)] in this lane: log2(N) halving exchanges, then a butterfly over the
// lanes that share an index. N - 1 + log2(32 / N) shuffles instead of 5 N.
template <int N>
__device__ __forceinline__ float reduce_scatter(float (&P)[N], int lane) {
  constexpr int S = 32 / N;
  halve<N, S>(P, lane);
  float x = P[0];
#pragma unroll
  for (int m = 1; m < S; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// A warp's 8 state rows x KL keys (s[r][c], key map shared with q and k): (S q) and (S k) of
// row (lane & 7) in every lane, by one reduce_scatter of the 16 partial sums (lane 2 r holds
// row r's S q, lane 16 + 2 r its S k). The decode kernels' hot dot products (gdn_decode.cu,
// gdn_wdecode.cu).
template <int KL>
__device__ __forceinline__ float2 rows8_dots(const float (&s)[8][KL], const float (&q)[KL], const float (&k)[KL],
                                             int lane) {
  float P[16];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    float x = 0.f, z = 0.f;
#pragma unroll
    for (int c = 0; c < KL; ++c) {
      x += s[r][c] * q[c];
      z += s[r][c] * k[c];
    }
    P[r] = x;
    P[8 + r] = z;
  }
  const float own = reduce_scatter<16>(P, lane);  // P[lane / 2]
  const int rr = lane & 7;
  return make_float2(__shfl_sync(0xffffffffu, own, 2 * rr), __shfl_sync(0xffffffffu, own, 16 + 2 * rr));
}

// s *= f for every element of a warp's rows.
template <int RL, int KL>
__device__ __forceinline__ void scale_rows(float (&s)[RL][KL], float f) {
#pragma unroll
  for (int r = 0; r < RL; ++r)
#pragma unroll
    for (int c = 0; c < KL; ++c) s[r][c] *= f;
}

// One token's conv inputs of batch row b: the share of (value head h, tile) of the conv_dim
// channels goes into the sequence's window ring at slot conv_end (decode kernels, T = 1).
__device__ __forceinline__ void conv_window_share(const StepParams& p, int b, int seq, int h, int tile, int conv_end,
                                                  int tid, int nthreads) {
  const int parts = p.hv * p.tiles, part = h * p.tiles + tile;
  const int lo = static_cast<int>(static_cast<int64_t>(part) * p.conv_dim / parts);
  const int hi = static_cast<int>(static_cast<int64_t>(part + 1) * p.conv_dim / parts);
  const int ce = p.conv_dtype == KVR_DT_F32 ? 4 : 2;
  char* cw = p.conv + (static_cast<int64_t>(seq) * p.conv_slots + conv_end % p.conv_slots) * p.conv_dim * ce;
  for (int c = lo + tid; c < hi; c += nthreads)
    stx(cw, p.conv_dtype, c, ldx(p.conv_in.p, p.conv_in.dtype, b * p.conv_in.s[0] + c * p.conv_in.s[2]));
}

// q L2-normalized (if asked) and scaled, k L2-normalized (and rounded to the entry dtype
// when `round_k`: replay buffers it), for a warp holding KL elements of each per lane.
// Returns the factors applied to q and to k.
template <int KL>
__device__ __forceinline__ float2 normalize_qk(const StepParams& p, float (&q)[KL], float (&k)[KL], bool round_k) {
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int c = 0; c < KL; ++c) {
    sq += q[c] * q[c];
    sk += k[c] * k[c];
  }
  sq = warp_sum(sq);
  sk = warp_sum(sk);
  const float fq = p.l2norm ? 1.f / sqrtf(sq + 1e-6f) : 1.f;
  const float fk = p.l2norm ? 1.f / sqrtf(sk + 1e-6f) : 1.f;
#pragma unroll
  for (int c = 0; c < KL; ++c) {
    q[c] = q[c] * fq * p.scale;
    k[c] = k[c] * fk;
    if (round_k) k[c] = roundx(p.entry_dtype, k[c]);
  }
  return make_float2(fq * p.scale, fk);
}

// Waits until `n` CTAs (the tiles of one head) have arrived.
__device__ __forceinline__ void head_barrier(uint32_t* ctr, int n) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr, 1u);
    while (*reinterpret_cast<volatile uint32_t*>(ctr) < static_cast<uint32_t>(n)) __nanosleep(100);
    __threadfence();
  }
  __syncthreads();
}

// Where a step's new entries go, from the sequence's metadata before the step: whether it
// flushes (or leaves KV-only mode) first, whether the entries stay in the KV-only store,
// and the first position. The step and finish kernels must agree, so both use this.
// (log decay g, input weight beta) of (row b, token s, value head h): the g and beta tensors
// (absent: 0 and 1), or Mamba-2's discretization of the raw dt in `beta` (kvr_abi.h,
// KVR_GDN_DT_*; softplus as mamba_ssm and llama.cpp: identity above 20).
__device__ __forceinline__ float2 token_gb(const StepParams& p, int b, int s, int h) {
  if (p.dt_mode == KVR_GDN_DT_NONE) {
    const float g = p.g.p ? ldx(p.g.p, p.g.dtype, b * p.g.s[0] + s * p.g.s[1] + h * p.g.s[2]) : 0.f;
    const float beta =
        p.beta.p ? ldx(p.beta.p, p.beta.dtype, b * p.beta.s[0] + s * p.beta.s[1] + h * p.beta.s[2]) : 1.f;
    return make_float2(g, beta);
  }
  float dt = ldx(p.beta.p, p.beta.dtype, b * p.beta.s[0] + s * p.beta.s[1] + h * p.beta.s[2]);
  if (p.dt_bias.p) dt += ldx(p.dt_bias.p, p.dt_bias.dtype, h * p.dt_bias.s[0]);
  if (p.dt_mode == KVR_GDN_DT_SOFTPLUS) dt = dt <= 20.f ? log1pf(expf(dt)) : dt;
  dt = fminf(fmaxf(dt, p.dt_min), p.dt_max);
  return make_float2(ldx(p.a.p, p.a.dtype, h * p.a.s[0]) * dt, dt);
}

// The output of (row b, token s, value head h, value row r) after the skip and the gate:
// (y + skip[h] v) * silu(z). Its inputs can be loaded ahead (epilogue_in), so that a kernel's
// last step does not wait on a cold read.
struct EpilogueIn {
  float skip, z;
};
__device__ __forceinline__ EpilogueIn epilogue_in(const StepParams& p, int b, int s, int h, int r) {
  EpilogueIn e{0.f, 0.f};
  if (p.skip.p) e.skip = ldx(p.skip.p, p.skip.dtype, h * p.skip.s[0]);
  if (p.gate.p)
    e.z = ldx(p.gate.p, p.gate.dtype, b * p.gate.s[0] + s * p.gate.s[1] + h * p.gate.s[2] + r * p.gate.s[3]);
  return e;
}
__device__ __forceinline__ float epilogue(const StepParams& p, const EpilogueIn& e, float v, float y) {
  if (p.skip.p) y += e.skip * v;
  if (p.gate.p) y *= e.z / (1.f + expf(-e.z));
  return y;
}
__device__ __forceinline__ float epilogue(const StepParams& p, int b, int s, int h, int r, float v, float y) {
  return epilogue(p, epilogue_in(p, b, s, h, r), v, y);
}

struct Place {
  bool flush, kv_store;
  int base;
};

__device__ __forceinline__ Place placement(const StepParams& p, int mode, int start, int hcnt) {
  Place r{false, false, 0};
  if (p.op == kOpStep && mode != kModeRecurrent) {
    const int need = p.auto_commit ? p.t : 2 * p.t;
    if (mode == kModeKvOnly) {
      r.flush = hcnt + need > p.thr;
      r.kv_store = !r.flush;
      r.base = r.flush ? 0 : hcnt;
    } else {
      r.flush = hcnt + need > p.l;
      r.base = (start + hcnt) % p.l;
    }
  } else if (p.op == kOpFlush) {
    r.flush = mode == kModeKvOnly || (mode == kModeReplay && hcnt > 0);
  }
  return r;
}

// The ring keys (L2-normalized as the step kernels do, rounded to the entry dtype) and decays
// of a step's T new entries of batch row b, from position `base` on; `nthreads` threads.
__device__ __forceinline__ void ring_keys_and_decays(const StepParams& p, int b, int seq, int base,
                                                     int warp, int lane, int tid, int nthreads) {
  const int T = p.t, dk = p.dk, ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  const int L = p.l > 0 ? p.l : 1;
  for (int x = warp; x < T * p.hk; x += nthreads / 32) {
    const int s = x / p.hk, kk = x % p.hk;
    const int64_t o = b * p.k.s[0] + s * p.k.s[1] + kk * p.k.s[2];
    float ss = 0.f;
    for (int i = lane; i < dk; i += 32) {
      const float v = ldx(p.k.p, p.k.dtype, o + i * p.k.s[3]);
      ss += v * v;
    }
    ss = warp_sum(ss);
    const float f = p.l2norm ? 1.f / sqrtf(ss + 1e-6f) : 1.f;
    const int pos = (base + s) % L;
    char* dst = p.ring_k + ((static_cast<int64_t>(seq) * L + pos) * p.hk + kk) * dk * ee;
    for (int i = lane; i < dk; i += 32)
      stx(dst, p.entry_dtype, i, roundx(p.entry_dtype, ldx(p.k.p, p.k.dtype, o + i * p.k.s[3]) * f));
  }
  for (int i = tid; i < T * p.hv; i += nthreads) {
    const int s = i / p.hv, hh = i % p.hv;
    const int pos = (base + s) % L;
    p.ring_g[(static_cast<int64_t>(seq) * L + pos) * p.hv + hh] = token_gb(p, b, s, hh).x;
  }
}

// A sequence's metadata after a step or flush launch, from the values before it (one thread,
// once every CTA of the launch has read them).
__device__ __forceinline__ void finish_meta(const StepParams& p, int32_t* meta, int mode, int start, int hcnt,
                                            int pending, int conv_end, const Place& pl) {
  const int L = p.l > 0 ? p.l : 1;
  int m_mode = mode, m_start = start, m_h = hcnt, m_pending = pending, m_conv = conv_end;
  if (pl.flush) {
    m_start = mode == kModeReplay ? (start + hcnt) % L : 0;
    m_h = 0;
    m_mode = kModeReplay;
  }
  if (p.op == kOpStep) {
    if (p.auto_commit) {
      if (mode != kModeRecurrent) m_h += p.t;
      m_conv += p.t;
      m_pending = 0;
    } else {
      m_pending = p.t;
    }
  }
  meta[kMetaMode] = m_mode;
  meta[kMetaStart] = m_start;
  meta[kMetaH] = m_h;
  meta[kMetaPending] = m_pending;
  meta[kMetaConvEnd] = m_conv;
}

}  // namespace gdn
}  // namespace kvr
