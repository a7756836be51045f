// Write-gated KV (src/kv/wgkv): row copies into the pool's pages.
//   kvr_wgkv_scatter   rows of a source (new tokens from the host's K/V, or the pool's own
//                      rows: ring -> global promotions, drafts -> scratch -> ring) to
//                      (page, slot) positions, with dtype conversion; one warp per row.
//   kvr_wgkv_step      one committed token per sequence of a batch, for one layer, wholly on
//                      the device (graph-capturable): the write gate's MLP (or given
//                      scores), then per (sequence, KV head) row the ring update -- the
//                      evicted oldest token copied to the global cache if its score was > tau
//                      (or it is a sink), the new token into its slot -- against row state
//                      kept on the device, within a budget of steps the host reserved pages
//                      for (src/kv/wgkv/mod.rs `reserve`).
// Up to KVR_WGKV_MAX_PAIRS rows travel in the parameters; larger batches (a prefill) read
// their rows from a device array the host uploads on the stream.
#include "mma.cuh"

namespace kvr {

__device__ __forceinline__ float wg_load(const void* p, int64_t i, int dtype) {
  if (dtype == KVR_DT_F32) return static_cast<const float*>(p)[i];
  if (dtype == KVR_DT_F16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ void wg_store(void* p, int64_t i, int dtype, float x) {
  if (dtype == KVR_DT_F32) static_cast<float*>(p)[i] = x;
  else if (dtype == KVR_DT_F16) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
}

// Two rows of d elements (element lane + 32 j of each, j < N, to this lane), one element
// type: every load is issued before any is converted (a dtype branch per element would
// make each load wait for the one before).
template <int N, typename T>
__device__ __forceinline__ void wg_rows_load_t(const T* a, int64_t ia, int64_t sa, const T* b, int64_t ib,
                                               int64_t sb, int d, float (&xa)[N], float (&xb)[N]) {
  const int lane = threadIdx.x & 31;
  T va[N], vb[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + 32 * j;
    va[j] = e < d ? a[ia + e * sa] : T();
    vb[j] = e < d ? b[ib + e * sb] : T();
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    xa[j] = to_float(va[j]);
    xb[j] = to_float(vb[j]);
  }
}

template <int N>
__device__ __forceinline__ void wg_rows_load(const void* a, int64_t ia, int64_t sa, const void* b, int64_t ib,
                                             int64_t sb, int d, int dtype, float (&xa)[N], float (&xb)[N]) {
  if (dtype == KVR_DT_F32)
    wg_rows_load_t<N>(static_cast<const float*>(a), ia, sa, static_cast<const float*>(b), ib, sb, d, xa, xb);
  else if (dtype == KVR_DT_F16)
    wg_rows_load_t<N>(static_cast<const __half*>(a), ia, sa, static_cast<const __half*>(b), ib, sb, d, xa, xb);
  else
    wg_rows_load_t<N>(static_cast<const __nv_bfloat16*>(a), ia, sa, static_cast<const __nv_bfloat16*>(b), ib, sb,
                      d, xa, xb);
}

// Stores two contiguous rows of d elements (as wg_rows_load spreads them).
template <int N>
__device__ __forceinline__ void wg_rows_store(void* a, int64_t ia, void* b, int64_t ib, int d, int dtype,
                                              const float (&xa)[N], const float (&xb)[N]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int e = lane + 32 * j;
    if (e < d) {
      wg_store(a, ia + e, dtype, xa[j]);
      wg_store(b, ib + e, dtype, xb[j]);
    }
  }
}

__device__ __forceinline__ float wg_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Gate input of one token into xs: [RMSNorm(k_pre); RMSNorm(k)] (one warp; head dim
// <= KVR_WGKV_GATE_MAX_IN / 2), from rows at kp[bp + i * kp_sd] and k[bk + i * k_sd].
__device__ __forceinline__ void wg_gate_input_rows(const kvr_wgkv_step_args& p, const void* kp, int64_t bp,
                                                   int64_t kp_sd, int kp_dtype, const void* k, int64_t bk,
                                                   int64_t k_sd, int k_dtype, float* xs) {
  constexpr int kPer = KVR_WGKV_GATE_MAX_IN / 64;
  const int lane = threadIdx.x & 31;
  const int d = p.d;
  float x[2][kPer];
  if (kp_dtype == k_dtype) {
    wg_rows_load<kPer>(kp, bp, kp_sd, k, bk, k_sd, d, k_dtype, x[0], x[1]);
  } else {
    float unused[kPer];
    wg_rows_load<kPer>(kp, bp, kp_sd, kp, bp, kp_sd, d, kp_dtype, x[0], unused);
    wg_rows_load<kPer>(k, bk, k_sd, k, bk, k_sd, d, k_dtype, x[1], unused);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) ss += x[half][j] * x[half][j];
    const float r = rsqrtf(wg_warp_sum(ss) / static_cast<float>(d) + p.norm_eps);
    const float* w = half ? p.norm_post : p.norm_pre;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = lane + 32 * j;
      if (i < d) xs[half * d + i] = x[half][j] * r * w[i];
    }
  }
}

// The gate input of token t of the launch (head h), from the step's k_pre and k.
__device__ __forceinline__ void wg_gate_input(const kvr_wgkv_step_args& p, int64_t t, int h, float* xs) {
  wg_gate_input_rows(p, p.k_pre, t * p.kp_sb + h * p.kp_sh, p.kp_sd, p.kp_dtype, p.k, t * p.k_sb + h * p.k_sh,
                     p.k_sd, p.k_dtype, xs);
}

// Entries a mover's code asks the gate to score: the row's queued tokens when it is due,
// and this step's token when it is gated here and has a slot.
__device__ __forceinline__ int wg_entries(const kvr_wgkv_step_args& p, int code) {
  if (!(code & KVR_WGKV_SLOT_DUE)) return 0;
  const int q = (code >> KVR_WGKV_SLOT_QSHIFT) & KVR_WGKV_SLOT_QMASK;
  const bool cur = p.scores_in == nullptr && p.mode != KVR_WGKV_MODE_FLUSH && !(code & KVR_WGKV_SLOT_NOCUR);
  return q + (cur ? 1 : 0);
}

// A gate CTA of kvr_wgkv_step: CTA (c > 0, h, z) scores the gate entries of tokens [16 z,
// 16 z + 16) of head h -- per token, as the mover CTA publishes in slots: none, or (a due
// row) the row's queued tokens and then this step's -- on gate hidden units [(c - 1) *
// KVR_WGKV_GATE_CHUNK, ...), 16 entries at a time, and adds its part of each fc2 dot
// product to zacc; the last of them (a counter) finishes the scores, sets the entries'
// admission bits and restores the slots. KIN: inputs a lane (2 d <= 32 KIN).
// COPIES: the launch may use slot copies (p.slot_copies; kvr_wgkv_move only).
template <int KIN, bool COPIES>
__device__ __forceinline__ void wg_gate_cta(const kvr_wgkv_step_args& p, float (*xs)[KVR_WGKV_GATE_MAX_IN],
                                            float (*zp)[KVR_WGKV_STEP_TILE], int* s_last, int* s_code,
                                            int* s_off) {
  constexpr int kTile = KVR_WGKV_STEP_TILE;
  constexpr int kWarps = KVR_WGKV_STEP_THREADS / 32;
  constexpr int kUnits = KVR_WGKV_GATE_CHUNK / kWarps;  // hidden units per warp
  const int h = blockIdx.y;
  const int t0 = blockIdx.z * kTile;
  const int nt = min(kTile, p.n - t0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int in = 2 * p.d;
  const int qlen = max(p.queue_len, 1);
  float w[kUnits][KIN], b1[kUnits], w2[kUnits];
  const int u0 = (static_cast<int>(blockIdx.x) - 1) * KVR_WGKV_GATE_CHUNK + warp;
  auto load_weights = [&]() {
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const int u = u0 + j * kWarps;
      const bool live = u < p.hidden;
      const int64_t unit = static_cast<int64_t>(h) * p.hidden + (live ? u : 0);
      const float* row = p.fc1_w + unit * in;
#pragma unroll
      for (int e = 0; e < KIN; ++e) w[j][e] = live && lane + 32 * e < in ? __ldg(row + lane + 32 * e) : 0.f;
      b1[j] = live ? __ldg(p.fc1_b + unit) : 0.f;
      w2[j] = live ? __ldg(p.fc2_w + unit) : 0.f;
    }
  };
  // An immediate gate scores every step: its weights come first (nothing the previous
  // kernel writes). A deferred one loads them only when a row is due.
  const bool early = p.mode == KVR_WGKV_MODE_IMMEDIATE && p.scores_in == nullptr;
  if (early) load_weights();
  pdl_wait();
  pdl_launch_dependents();
  // Each token's code, once the mover has read its row (relaxed: no data rides on it
  // except what the previous launches wrote, visible since the wait).
  // With slot copies, this CTA's own copy, which it restores itself.
  // (The count is the grid's: gate CTAs 1 .. gridDim.x - 1.)
  const int copies = COPIES && p.slot_copies > 0 ? static_cast<int>(gridDim.x) - 1 : 0;
  if (threadIdx.x < nt) {
    int32_t* at = p.slots + (static_cast<int64_t>(t0 + threadIdx.x) * p.hkv + h) * max(copies, 1) +
                  (copies > 0 ? static_cast<int>(blockIdx.x) - 1 : 0);
    int code;
    do {
      asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(code) : "l"(at) : "memory");
    } while (code == KVR_WGKV_SLOT_PENDING);
    s_code[threadIdx.x] = code;
    if (copies > 0) *at = KVR_WGKV_SLOT_PENDING;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int e = 0;
    for (int i = 0; i < nt; ++i) {
      s_off[i] = e;
      e += wg_entries(p, s_code[i]);
    }
    s_off[nt] = e;
  }
  __syncthreads();
  const int total = s_off[nt];
  // Nothing to score (every gate CTA of (h, z) reads the same codes): with slot copies
  // there is nothing to restore either.
  if (copies > 0 && total == 0) return;
  // Entry e: token ti of the tile, j-th of its entries (j < q: queued).
  auto entry = [&](int e, int& ti, int& j, int& q) {
    ti = 0;
    while (s_off[ti + 1] <= e) ++ti;
    j = e - s_off[ti];
    q = (s_code[ti] >> KVR_WGKV_SLOT_QSHIFT) & KVR_WGKV_SLOT_QMASK;
  };
  auto row_of = [&](int ti) {
    return static_cast<int64_t>(p.seq[t0 + ti]) * p.rows_per_seq + p.row0 + h;
  };
  if (total > 0 && !early) load_weights();
  static_assert(kUnits == 2, "two units a warp");
#pragma unroll 1
  for (int e0 = 0; e0 < total; e0 += kTile) {
    const int ne = min(kTile, total - e0);
    for (int i = warp; i < ne; i += kWarps) {
      int ti, j, q;
      entry(e0 + i, ti, j, q);
      if (j < q) {
        const float* qe = p.queue + (row_of(ti) * qlen + j) * in;
        wg_gate_input_rows(p, qe, 0, 1, KVR_DT_F32, qe + p.d, 0, 1, KVR_DT_F32, xs[i]);
      } else {
        wg_gate_input(p, t0 + ti, h, xs[i]);
      }
    }
    __syncthreads();
    // Four entries at a time (a loop, so that the work and the code follow ne): the warp's
    // dot products of (entry i0 + q, unit j) at v[2 q + j], each lane's share of the inputs,
    // summed over the lanes all at once (a butterfly over the 8 values, then two plain
    // steps: lanes 4 k .. 4 k + 3 end with value k), GELU and fc2 once per lane, an entry's
    // two units added by one more shuffle (lane 8 q holds entry i0 + q's part).
#pragma unroll 1
    for (int i0 = 0; i0 < ne; i0 += 4) {
      float v[8];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float d0 = 0.f, d1 = 0.f;
        if (i0 + q < ne) {
          const float* xr = xs[i0 + q];
#pragma unroll
          for (int e = 0; e < KIN; ++e) {
            const float x = lane + 32 * e < in ? xr[lane + 32 * e] : 0.f;
            d0 = fmaf(w[0][e], x, d0);
            d1 = fmaf(w[1][e], x, d1);
          }
        }
        v[2 * q] = d0;
        v[2 * q + 1] = d1;
      }
#pragma unroll
      for (int o = 16, n = 8; o >= 4; o >>= 1, n >>= 1) {
        const bool up = (lane & o) != 0;
#pragma unroll
        for (int m = 0; m < n / 2; ++m) {
          const float send = up ? v[m] : v[m + n / 2];
          const float keep = up ? v[m + n / 2] : v[m];
          v[m] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
      }
      float a = v[0] + __shfl_xor_sync(0xffffffffu, v[0], 2);
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      const int k = (lane >> 2) & 7, j = k & 1;  // value (entry i0 + k / 2, unit j)
      a += j ? b1[1] : b1[0];
      float z = 0.5f * a * (1.f + erff(a * 0.70710678118654752f)) * (j ? w2[1] : w2[0]);
      z += __shfl_xor_sync(0xffffffffu, z, 4);
      const int ei = i0 + (k >> 1);
      if ((lane & 7) == 0 && ei < ne) zp[warp][ei] = z;
    }
    __syncthreads();
    if (threadIdx.x < ne) {
      float zs = 0.f;
#pragma unroll
      for (int w8 = 0; w8 < kWarps; ++w8) zs += zp[w8][threadIdx.x];
      int ti, j, q;
      entry(e0 + threadIdx.x, ti, j, q);
      atomicAdd(p.zacc + (static_cast<int64_t>(t0 + ti) * qlen + j) * p.hkv + h, zs);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0)
    *s_last = count_in_last(p.counters + static_cast<int64_t>(blockIdx.z) * p.hkv + h, gridDim.x - 1);
  __syncthreads();
  if (!*s_last) return;
  // The last gate CTA: every gate CTA has read the codes; one thread per entry finishes its
  // score and sets its bit (an atomic on the word: no round trip).
  if (copies == 0 && threadIdx.x < nt)
    p.slots[static_cast<int64_t>(t0 + threadIdx.x) * p.hkv + h] = KVR_WGKV_SLOT_PENDING;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    int ti, j, q;
    entry(e, ti, j, q);
    const int64_t row = row_of(ti);
    const int64_t at = (static_cast<int64_t>(t0 + ti) * qlen + j) * p.hkv + h;
    const float zt = __ldcg(p.zacc + at) + p.fc2_b[h];
    p.zacc[at] = 0.f;
    const float score = fmaxf(1.f / (1.f + expf(-zt)), p.gate_floor);
    const int code = j < q ? p.queue_codes[row * qlen + j] : s_code[ti];
    if (j == q && p.scores_out) p.scores_out[static_cast<int64_t>(t0 + ti) * p.hkv + h] = score;
    const int slot = code & KVR_WGKV_SLOT_MASK;
    uint32_t* word = p.admit + row * p.admit_words + (slot >> 5);
    const uint32_t m = 1u << (slot & 31);
    if ((code & KVR_WGKV_SLOT_SINK) || score > p.tau)
      atomicOr(word, m);
    else
      atomicAnd(word, ~m);
  }
}

}  // namespace kvr

extern "C" __global__ void kvr_wgkv_scatter(const __grid_constant__ kvr_wgkv_scatter_args p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t n_rows = 2 * static_cast<int64_t>(p.n_pairs);
  for (int64_t r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < n_rows; r += warps) {
    const int64_t i = r >> 1;
    const bool is_v = r & 1;
    const void* src = is_v ? p.v_src : p.k_src;
    void* dst = is_v ? p.v_dst : p.k_dst;
    int64_t s0, pg, sl;
    if (p.rows) {
      const int64_t* e = p.rows + 3 * static_cast<int64_t>(i);
      s0 = is_v ? e[1] : e[0];
      pg = e[2] >> 32;
      sl = e[2] & 0xffffffff;
    } else {
      s0 = is_v ? p.v_off[i] : p.k_off[i];
      pg = p.page[i];
      sl = p.slot[i];
    }
    const int64_t sd = is_v ? p.v_src_ds : p.k_src_ds;
    const int64_t d0 = pg * (is_v ? p.v_sp : p.k_sp) + sl * (is_v ? p.v_st : p.k_st);
    for (int d = lane; d < p.d; d += 32)
      kvr::wg_store(dst, d0 + d, p.dst_dtype, kvr::wg_load(src, s0 + d * sd, p.src_dtype));
  }
}

namespace kvr {

// The mover CTA of kvr_wgkv_step (one warp per row of the tile); KPER: elements of a row
// per lane (d <= 32 KPER).
// COPIES: as wg_gate_cta's.
template <int kPer, bool COPIES>
__device__ __forceinline__ void wg_move_rows(const kvr_wgkv_step_args& p) {
  constexpr int kTile = KVR_WGKV_STEP_TILE;
  constexpr int kWarps = KVR_WGKV_STEP_THREADS / 32;
  const int h = blockIdx.y;
  const int t0 = blockIdx.z * kTile;
  const int nt = min(kTile, p.n - t0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool gate = p.scores_in == nullptr;
  // Gate CTAs in the grid: every row publishes a code for them.
  const bool publish = gridDim.x > 1;
  const bool flush = p.mode == KVR_WGKV_MODE_FLUSH;
  const bool defer = p.mode == KVR_WGKV_MODE_DEFERRED;
  const int qlen = max(p.queue_len, 1);
  const int in = 2 * p.d;
  for (int i = warp; i < nt; i += kWarps) {
    const int t = t0 + i;
    const int64_t row = static_cast<int64_t>(p.seq[t]) * p.rows_per_seq + p.row0 + h;
    int32_t* st = p.rows + row * KVR_WGKV_ROW_INTS;
    // The row's code for the gate CTAs (warp-uniform): one slot, or one copy per gate CTA.
    const int copies = COPIES && p.slot_copies > 0 ? max(static_cast<int>(gridDim.x) - 1, 1) : 1;
    int32_t* pub = p.slots + (static_cast<int64_t>(t) * p.hkv + h) * copies;
    auto publish_code = [&](int code) {
      if (!COPIES) {
        asm volatile("st.relaxed.gpu.global.b32 [%0], %1;\n" ::"l"(pub), "r"(code) : "memory");
      } else {
        for (int c = lane; c < copies; c += 32)
          asm volatile("st.relaxed.gpu.global.b32 [%0], %1;\n" ::"l"(pub + c), "r"(code) : "memory");
      }
    };
    if (flush) {
      // No new token: the row's queue is scored now.
      const int q = st[6];
      const int code = q > 0 ? KVR_WGKV_SLOT_DUE | KVR_WGKV_SLOT_NOCUR | (q << KVR_WGKV_SLOT_QSHIFT) : 0;
      if (COPIES) {
        __syncwarp();  // every lane has read the count (each publishes copies)
        if (lane == 0) st[6] = 0;
        publish_code(code);
      } else if (lane == 0) {
        st[6] = 0;
        publish_code(code);
      }
      continue;
    }
    uint32_t* bits = p.admit + row * p.admit_words;
    const int32_t* tb = p.table + row * p.table_stride;
    // Everything that does not depend on the row's state, loaded at once.
    const int4 s4 = *reinterpret_cast<const int4*>(st);
    const int4 s5 = *reinterpret_cast<const int4*>(st + 4);  // budget, dropped, queued, 0
    const int budget = s5.x, queued = s5.z;
    const uint32_t word = lane < p.admit_words ? bits[lane] : 0u;
    // The ring's page ids (the table's first window / page_size entries), one per lane.
    const int ring_pages = p.window / p.page_size;
    const int32_t rpage = lane < ring_pages ? tb[lane] : 0;
    const float given = gate ? 0.f : p.scores_in[t * p.s_sb + h * p.s_sh];
    float kn[kPer], vn[kPer], kp[kPer];  // k and v share a dtype (checked by the host)
    wg_rows_load<kPer>(p.k, t * p.k_sb + h * p.k_sh, p.k_sd, p.v, t * p.v_sb + h * p.v_sh, p.v_sd, p.d,
                            p.k_dtype, kn, vn);
    // k_pre with the other loads (queued below unless the row is due); for long rows only
    // once it is known to be queued (registers).
    constexpr bool kEarlyKp = kPer <= 4;
    auto load_kp = [&]() {
      float unused[kPer];
      const int64_t bp = t * p.kp_sb + h * p.kp_sh;
      wg_rows_load<kPer>(p.k_pre, bp, p.kp_sd, p.k_pre, bp, p.kp_sd, p.d, p.kp_dtype, kp, unused);
    };
    if (kEarlyKp && defer) load_kp();
    int fill = s4.x, ptr = s4.y, glob = s4.z;
    const int total = s4.w;
    // A row is scored now (due) when its gate is immediate, its queue is full, or (given
    // scores) it still queues tokens.
    const bool due = gate ? (!defer || queued + 1 >= qlen) : queued > 0;
    int slot = -1;
    if (budget > 0) {
      int gpos = -1;
      if (fill < p.window) {
        slot = fill++;
      } else {
        slot = ptr;
        ptr = ptr + 1 == p.window ? 0 : ptr + 1;
        const uint32_t w = p.admit_words <= 32 ? __shfl_sync(0xffffffffu, word, slot >> 5) : bits[slot >> 5];
        if ((w >> (slot & 31)) & 1u) gpos = p.window + glob++;
      }
      const int sink = total < p.sinks ? KVR_WGKV_SLOT_SINK : 0;
      if (publish && (COPIES || lane == 0)) {
        // The finishing gate CTA sets this token's bit from here on (it waits for this
        // value): the slot and whether the token is a sink (this step's total is not yet
        // written). The value depends on the evicted slot's bit as read above (gpos), so it
        // cannot be stored before that read returns: the finisher's update of the same word
        // comes after it without a fence (a relaxed store; a release cost the step ~2 us).
        const int code = slot | sink | (gpos >= 0 ? KVR_WGKV_SLOT_EVICTED : 0) |
                         (due ? KVR_WGKV_SLOT_DUE | (queued << KVR_WGKV_SLOT_QSHIFT) : 0);
        publish_code(code);
      }
      if (gate && !due) {
        // Queued: the gate's input, scored with the row's next due step.
        if (!kEarlyKp) load_kp();
        float* qe = p.queue + (row * qlen + queued) * in;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int e = lane + 32 * j;
          if (e < p.d) {
            qe[e] = kp[j];
            qe[p.d + e] = kn[j];
          }
        }
        if (lane == 0) p.queue_codes[row * qlen + queued] = slot | sink;
      }
      const int64_t ps = ring_pages <= 32 ? __shfl_sync(0xffffffffu, rpage, slot / p.page_size)
                                          : tb[slot / p.page_size];
      const int64_t os = slot % p.page_size;
      const int64_t pg = gpos >= 0 ? tb[gpos / p.page_size] : 0, og = gpos % p.page_size;
      const int64_t ks = ps * p.k_sp + os * p.k_st, vs = ps * p.v_sp + os * p.v_st;
      if (gpos >= 0) {
        // Each lane moves the elements it reads: the old row is read before the new
        // token overwrites it below.
        const int64_t kg = pg * p.k_sp + og * p.k_st, vg = pg * p.v_sp + og * p.v_st;
        float ko[kPer], vo[kPer];
        wg_rows_load<kPer>(p.k_dst, ks, 1, p.v_dst, vs, 1, p.d, p.pool_dtype, ko, vo);
        wg_rows_store<kPer>(p.k_dst, kg, p.v_dst, vg, p.d, p.pool_dtype, ko, vo);
      }
      wg_rows_store<kPer>(p.k_dst, ks, p.v_dst, vs, p.d, p.pool_dtype, kn, vn);
    } else if (publish && (COPIES || lane == 0)) {
      // No budget: no new token; a due row's queue is still scored.
      publish_code(KVR_WGKV_SLOT_NOCUR | (due && queued > 0 ? KVR_WGKV_SLOT_DUE | (queued << KVR_WGKV_SLOT_QSHIFT) : 0));
    }
    // slot is the same in every lane.
    const uint32_t wslot = slot >= 0 && p.admit_words <= 32 ? __shfl_sync(0xffffffffu, word, slot >> 5) : 0u;
    if (lane == 0) {
      if (slot < 0) {
        st[5] += 1;  // no budget: the row is left as it is
        if (due) st[6] = 0;
      } else {
        *reinterpret_cast<int4*>(st) = make_int4(fill, ptr, glob, total + 1);
        st[4] = budget - 1;
        st[6] = due ? 0 : queued + (gate ? 1 : 0);
        p.lens[row] = glob == 0 ? fill : p.window + glob;
        if (!gate) {
          if (p.scores_out) p.scores_out[static_cast<int64_t>(t) * p.hkv + h] = given;
          const uint32_t m = 1u << (slot & 31);
          const bool keep = total < p.sinks || given > p.tau;
          if (publish) {
            // Atomics: the gate CTAs may set other bits of the word at the same time.
            if (keep)
              atomicOr(bits + (slot >> 5), m);
            else
              atomicAnd(bits + (slot >> 5), ~m);
          } else {
            // The word as read above, written back (an atomic on a line not in L2 waits for
            // DRAM first).
            const uint32_t w = p.admit_words <= 32 ? wslot : bits[slot >> 5];
            bits[slot >> 5] = keep ? w | m : w & ~m;
          }
        }
      }
    }
  }
}

}  // namespace kvr

// See the header comment and kvr_abi.h. CTA (c, h, z) of token tile z, head h: CTA c = 0
// moves the tile's rows (one warp per row: promotion, new token, state), which needs no
// score except for the new token's admission bit, and publishes each row's code (the new
// token's slot, and whether the gate scores the row now) as soon as the row's state is
// read; CTAs c > 0 score gate chunk c - 1 of what the codes ask for (wg_gate_cta), and the
// last of them sets those bits. A deferred gate queues a token's input (f32 k_pre and k)
// in its row and scores a row's queue once it is full, so most steps carry no gate work;
// with given scores CTA 0 sets the new tokens' bits itself (the grid has gate CTAs then
// only to score rows that still queue tokens of earlier deferred steps).
// Two CTAs per SM (128 registers): the gate grid of hidden 512 x 8 heads is one wave.
extern "C" __global__ void __launch_bounds__(KVR_WGKV_STEP_THREADS, 2)
    kvr_wgkv_step(const __grid_constant__ kvr_wgkv_step_args p) {
  constexpr int kTile = KVR_WGKV_STEP_TILE;
  constexpr int kWarps = KVR_WGKV_STEP_THREADS / 32;
  __shared__ float xs[kTile][KVR_WGKV_GATE_MAX_IN];
  __shared__ float zp[kWarps][kTile];
  __shared__ int s_last, s_code[kTile], s_off[kTile + 1];
  const int in = 2 * p.d;
  if (blockIdx.x > 0) {
    // CTA c > 0 scores gate chunk c - 1 (inputs 2 d <= 256: 8 a lane).
    if (in <= 256)
      kvr::wg_gate_cta<8, false>(p, xs, zp, &s_last, s_code, s_off);
    else
      kvr::wg_gate_cta<KVR_WGKV_GATE_MAX_IN / 32, false>(p, xs, zp, &s_last, s_code, s_off);
    return;
  }
  kvr::pdl_wait();
  if (p.d <= 128)
    kvr::wg_move_rows<4, false>(p);
  else
    kvr::wg_move_rows<KVR_WGKV_GATE_MAX_IN / 64, false>(p);
  if (gridDim.x > 1) kvr::pdl_launch_dependents();
}

namespace kvr {

// kvr_wgkv_move's gate CTAs: wg_gate_cta out of line, with its shared memory.
__device__ __noinline__ void wg_gate_entry(const kvr_wgkv_step_args& p) {
  constexpr int kTile = KVR_WGKV_STEP_TILE;
  constexpr int kWarps = KVR_WGKV_STEP_THREADS / 32;
  __shared__ float xs[kTile][KVR_WGKV_GATE_MAX_IN];
  __shared__ float zp[kWarps][kTile];
  __shared__ int s_last, s_code[kTile], s_off[kTile + 1];
  if (2 * p.d <= 256)
    wg_gate_cta<8, true>(p, xs, zp, &s_last, s_code, s_off);
  else
    wg_gate_cta<KVR_WGKV_GATE_MAX_IN / 32, true>(p, xs, zp, &s_last, s_code, s_off);
}

// kvr_wgkv_move's mover CTAs for head dims over 128, out of line.
__device__ __noinline__ void wg_move_rows_wide(const kvr_wgkv_step_args& p) {
  wg_move_rows<KVR_WGKV_GATE_MAX_IN / 64, true>(p);
}

}  // namespace kvr

// kvr_wgkv_step with compact code for the mover CTAs: the same work and grid, but the gate
// CTAs' code (and the movers' for head dims over 128) is out of line, so the code a mover CTA
// runs is the kernel's body alone. In a layer's decode step the step's instructions are
// fetched cold (the 436 MiB of a layer's weights evict them from L2): with the gate inlined,
// a mover warp of the given-scores path stalled ~3,000 cycles on instruction fetch.
// Experimental: the library launches it only with KVR_WGKV_MOVE=1 until it is measured.
extern "C" __global__ void __launch_bounds__(KVR_WGKV_STEP_THREADS, 2)
    kvr_wgkv_move(const __grid_constant__ kvr_wgkv_step_args p) {
  if (blockIdx.x > 0) {
    kvr::wg_gate_entry(p);
    return;
  }
  kvr::pdl_wait();
  if (p.d <= 128)
    kvr::wg_move_rows<4, true>(p);
  else
    kvr::wg_move_rows_wide(p);
  if (gridDim.x > 1) kvr::pdl_launch_dependents();
}
