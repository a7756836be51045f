// Batched split-K flash decode over a paged KV pool (kvr_kv_decode).
//
// One launch serves a whole batch of sequences of any lengths, 1..8 query tokens each
// (causal inside the draft window), any GQA group 1..16, optional sliding window, logit
// softcap and log-sum-exp output. The grid is fixed (SMs x CTAs per SM, divided over the
// 16-row query tiles in grid.y); the work split is derived on the device from the lengths
// in device memory, so a captured CUDA Graph stays valid while sequences grow.
//
// Work: every (batch row b, KV head h) is a row of 64-token tiles (only the tiles inside the
// sliding window). All rows are laid end to end and cut into N equal contiguous ranges, one
// per CTA (stream-K). A CTA walks its range: K/V tiles stream through a cp.async pipeline
// (page-table lookup fused into each 16-byte copy), QK^T and PV run on mma.sync m16n8k16
// with the GQA group (x query tokens) as the 16 MMA rows, softmax is online in base 2, and
// the 4 warps (16 tokens of each tile apiece) merge at the end of a row. A row covered by
// one CTA is written directly; a row split across CTAs writes partials, and the last CTA to
// finish it (atomic counter) merges them by log-sum-exp and resets the counter.
//
// Layout of a KV element: base + page * stride_page + head * stride_head + slot * stride_token
// + d, with the page from table[seq][token / page_size] (the pool's layout, src/kv/pool.rs).
#include "mma.cuh"

namespace kvr {

constexpr int kTileN = 64;      // tokens per tile (16 per warp)
constexpr int kDecodeThreads = 128;
constexpr int kMaxInlineBatch = 512;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Must match `DecodeParams` in src/kv/cuda.rs field for field.
struct DecodeParams {
  const void* q;
  void* out;
  float* lse;         // optional [B, T, Hq] (natural log)
  const void* k;
  const void* v;
  const int32_t* table;   // [max_seqs][table_stride] page ids
  const int32_t* lens;    // [max_seqs]
  const int32_t* batch;   // [B] sequence slots in device memory, or null: batch_inline
  float* part_o;          // [ctas][2][16][D] normalized partial outputs
  float* part_lse;        // [ctas][2][16] base-2 log-sum-exp of each partial
  int32_t* counters;      // [B][Hkv][Y], zero between launches
  int64_t q_sb, q_st, q_sh;
  int64_t o_sb, o_st, o_sh;
  int64_t l_sb, l_st, l_sh;
  int64_t k_sp, k_sh, k_st;
  int64_t v_sp, v_sh, v_st;
  FastDiv page;
  int32_t table_stride;
  int32_t max_seqs;
  int32_t B, T, Hq, Hkv, G;
  int32_t q_dtype, out_dtype;  // 0 f32, 1 f16, 2 bf16
  int32_t window;              // 0: no sliding window
  int32_t min_tiles_per_cta;
  int32_t stages;              // 1..3 pipeline stages
  float scale_log2;            // scale * log2(e), no softcap
  float qk_scale;              // scale (softcap path)
  float softcap;               // 0: off
  int32_t batch_inline[kMaxInlineBatch];
};

__device__ __forceinline__ float load_any(const void* p, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  if (dtype == 1) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ __forceinline__ void store_any(void* p, int64_t i, int dtype, float x) {
  if (dtype == 0) static_cast<float*>(p)[i] = x;
  else if (dtype == 1) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
}

// What the kernel needs about one (batch row, KV head) row of tiles.
struct RowCursor {
  int b, h;          // batch row and KV head
  int tile, ntiles;  // tile within the row, tiles in the row
  int slot, len;     // sequence slot (-1: none) and its length
  int first_tile;    // index of the row's first tile within the sequence (window start)
  long long row_first;  // global index of the row's first tile
};

__device__ __forceinline__ int batch_slot(const DecodeParams& p, int b) {
  int s = p.batch ? p.batch[b] : p.batch_inline[b];
  return (s >= 0 && s < p.max_seqs) ? s : -1;
}

// Tiles of batch row b (>= 1: an empty row still gets one tile, which writes zeros).
__device__ __forceinline__ void row_shape(const DecodeParams& p, int slot, int* len, int* first_tile,
                                          int* ntiles) {
  int l = slot >= 0 ? p.lens[slot] : 0;
  if (l < 0) l = 0;
  int kstart = 0;
  if (p.window > 0) kstart = max(0, l - p.T - p.window + 1);
  const int ft = kstart / kTileN;
  const int last = (l + kTileN - 1) / kTileN;
  *len = l;
  *first_tile = ft;
  *ntiles = max(1, last - ft);
}

__device__ __forceinline__ void cursor_load_row(const DecodeParams& p, RowCursor& c) {
  c.slot = batch_slot(p, c.b);
  row_shape(p, c.slot, &c.len, &c.first_tile, &c.ntiles);
}

__device__ __forceinline__ void cursor_advance(const DecodeParams& p, RowCursor& c) {
  if (++c.tile < c.ntiles) return;
  c.tile = 0;
  c.row_first += c.ntiles;
  if (++c.h < p.Hkv) return;
  c.h = 0;
  if (++c.b < p.B) cursor_load_row(p, c);
}

// CTA that owns global tile x when W tiles are cut into N ranges [floor(cW/N), floor((c+1)W/N)).
__device__ __forceinline__ long long cta_of(long long x, long long W, long long N) {
  return ((x + 1) * N + W - 1) / W - 1;
}
__device__ __forceinline__ long long range_start(long long c, long long W, long long N) {
  return c * W / N;
}

template <typename KV, int D> struct DecodeSmem {
  static constexpr int kStride = D + 8;  // padded row (16 bytes): conflict-free ldmatrix
  static constexpr int kTileElems = kTileN * kStride;
  static constexpr int kStageBytes = 2 * kTileElems * static_cast<int>(sizeof(KV));
  // Per-warp softmax state for the end-of-row merge, and scan scratch.
  static constexpr int kFixedBytes = 4 * 16 * 2 * 4 + 64 * 8;
  static constexpr int bytes(int stages) { return stages * kStageBytes + kFixedBytes; }
};

template <typename KV, int D> __device__ __forceinline__ void decode_body(const DecodeParams& p) {
  using Sm = DecodeSmem<KV, D>;
  constexpr int kStride = Sm::kStride;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem[];
  KV* stages_base = reinterpret_cast<KV*>(smem);
  float* s_ml = reinterpret_cast<float*>(smem + p.stages * Sm::kStageBytes);  // [2][4][16]
  long long* s_scan = reinterpret_cast<long long*>(s_ml + 4 * 16 * 2);        // [64]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int Y = gridDim.y, y = blockIdx.y;

  // ---- Work partition, recomputed by every CTA from the device lengths. ----
  // Each thread sums the tiles of a contiguous chunk of batch rows; a block scan gives W.
  const int per = (p.B + kDecodeThreads - 1) / kDecodeThreads;
  const int b0 = min(p.B, tid * per), b1 = min(p.B, b0 + per);
  long long mine = 0;
  for (int b = b0; b < b1; ++b) {
    int len, ft, nt;
    row_shape(p, batch_slot(p, b), &len, &ft, &nt);
    mine += nt;
  }
  mine *= p.Hkv;
  // Block-wide inclusive scan of `mine` (4 warps).
  long long incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    long long n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) s_scan[warp] = incl;
  __syncthreads();
  long long warp_base = 0;
  for (int w = 0; w < warp; ++w) warp_base += s_scan[w];
  const long long W = s_scan[0] + s_scan[1] + s_scan[2] + s_scan[3];
  const long long excl = warp_base + incl - mine;
  long long N = W / max(1, p.min_tiles_per_cta);
  if (N < 1) N = 1;
  if (N > static_cast<long long>(gridDim.x)) N = gridDim.x;
  const long long c = blockIdx.x;
  if (c >= N) return;
  const long long S = range_start(c, W, N), E = range_start(c + 1, W, N);
  if (S >= E) return;
  // The thread whose chunk holds tile S finds its row.
  __syncthreads();
  if (S >= excl && S < excl + mine) {
    long long acc = excl;
    for (int b = b0; b < b1; ++b) {
      int len, ft, nt;
      row_shape(p, batch_slot(p, b), &len, &ft, &nt);
      const long long span = static_cast<long long>(nt) * p.Hkv;
      if (S < acc + span) {
        const long long off = S - acc;
        s_scan[8] = b;
        s_scan[9] = off / nt;            // head
        s_scan[10] = off % nt;           // tile in row
        s_scan[11] = acc + (off / nt) * nt;  // row_first
        break;
      }
      acc += span;
    }
  }
  __syncthreads();
  RowCursor start;
  start.b = static_cast<int>(s_scan[8]);
  start.h = static_cast<int>(s_scan[9]);
  start.tile = static_cast<int>(s_scan[10]);
  start.row_first = s_scan[11];
  cursor_load_row(p, start);
  const int n_tiles = static_cast<int>(E - S);

  // Rows of this CTA's 16-row query tile: two per thread (lane/4 and lane/4 + 8).
  const int rows_total = p.G * p.T;
  int t_of[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int R = y * 16 + (lane >> 2) + r * 8;
    t_of[r] = min(R, rows_total - 1) / p.G;
  }

  // ---- K/V tile loader (all threads). ----
  auto stage_k = [&](int s) { return stages_base + s * 2 * Sm::kTileElems; };
  auto stage_v = [&](int s) { return stages_base + s * 2 * Sm::kTileElems + Sm::kTileElems; };
  auto load_tile = [&](const RowCursor& lc, int s) {
    KV* sk = stage_k(s);
    KV* sv = stage_v(s);
    const int tok0 = (lc.first_tile + lc.tile) * kTileN;
    const KV* kb = static_cast<const KV*>(p.k) + lc.h * p.k_sh;
    const KV* vb = static_cast<const KV*>(p.v) + lc.h * p.v_sh;
    const int32_t* trow = p.table + static_cast<int64_t>(max(lc.slot, 0)) * p.table_stride;
#pragma unroll 4
    for (int j = tid; j < kTileN * kChunks; j += kDecodeThreads) {
      const int row = j / kChunks, col = j % kChunks;
      const int tok = tok0 + row;
      const bool valid = tok < lc.len;
      const KV* ksrc = static_cast<const KV*>(p.k);
      const KV* vsrc = static_cast<const KV*>(p.v);
      if (valid) {
        const uint32_t pi = p.page.div(static_cast<uint32_t>(tok));
        const int64_t page = trow[pi];
        const int64_t sl = tok - static_cast<int64_t>(pi) * p.page.d;
        ksrc = kb + page * p.k_sp + sl * p.k_st + col * 8;
        vsrc = vb + page * p.v_sp + sl * p.v_st + col * 8;
      }
      cp_async_16(sk + row * kStride + col * 8, ksrc, valid ? 16 : 0);
      cp_async_16(sv + row * kStride + col * 8, vsrc, valid ? 16 : 0);
    }
  };

  // ---- Per-row state. ----
  uint32_t qf[D / 16][4];
  float acc[D / 8][4];
  float m_run[2], l_run[2];

  auto begin_row = [&](const RowCursor& rc, int free_stage) {
    // Stage the 16 query rows (converted to the KV type) in the free stage, then load the
    // MMA A fragments.
    KV* sq = stage_k(free_stage);
    for (int i = tid; i < 16 * D; i += kDecodeThreads) {
      const int r = i / D, d = i % D;
      const int R = y * 16 + r;
      float x = 0.f;
      if (R < rows_total && rc.slot >= 0) {
        const int t = R / p.G, g = R % p.G;
        const int64_t off = rc.b * p.q_sb + t * p.q_st + (rc.h * p.G + g) * p.q_sh + d;
        x = load_any(p.q, off, p.q_dtype);
      }
      sq[r * kStride + d] = from_float<KV>(x);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int r = (lane & 7) + ((lane >> 3) & 1) * 8;
      const int col = kk * 16 + (lane >> 4) * 8;
      ldmatrix_x4(qf[kk], sq + r * kStride + col);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
    __syncthreads();  // the stage is reused by the loader afterwards
  };

  auto end_row = [&](const RowCursor& rc, int free_stage) {
    // Merge the 4 warps: per-row max and sum through shared memory, accumulators by
    // shared-memory atomics into a [16][D] f32 buffer in the free stage.
    float* s_acc = reinterpret_cast<float*>(stage_k(free_stage));
    for (int i = tid; i < 16 * D; i += kDecodeThreads) s_acc[i] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    if ((lane & 3) == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s_ml[warp * 16 + (lane >> 2) + r * 8] = m_run[r];
        s_ml[64 + warp * 16 + (lane >> 2) + r * 8] = l_run[r];
      }
    }
    __syncthreads();
    float f[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rr = (lane >> 2) + r * 8;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_ml[w * 16 + rr]);
      f[r] = (M == -INFINITY) ? 0.f : exp2f(m_run[r] - M);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = (lane >> 2) + (e >> 1) * 8;
        const int col = n * 8 + (lane & 3) * 2 + (e & 1);
        atomicAdd(&s_acc[rr * D + col], acc[n][e] * f[e >> 1]);
      }
    }
    __syncthreads();
    // This CTA covers the whole row unless the row's tiles reach past its range.
    const long long W_ = W, N_ = N;
    const long long c_first = cta_of(rc.row_first, W_, N_);
    const long long c_last = cta_of(rc.row_first + rc.ntiles - 1, W_, N_);
    const bool split = c_first != c_last;
    const int pslot = (S >= rc.row_first) ? 0 : 1;
    const long long pidx = (static_cast<long long>(y) * gridDim.x + c) * 2 + pslot;
    for (int i = tid; i < 16 * D; i += kDecodeThreads) {
      const int r = i / D, d = i % D;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_ml[w * 16 + r]);
      float L = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < 4; ++w) L += s_ml[64 + w * 16 + r] * exp2f(s_ml[w * 16 + r] - M);
      }
      const float o = L > 0.f ? s_acc[i] / L : 0.f;
      const float lse2 = L > 0.f ? M + __log2f(L) : -INFINITY;
      const int R = y * 16 + r;
      if (split) {
        p.part_o[pidx * 16 * D + i] = o;
        if (d == 0) p.part_lse[pidx * 16 + r] = lse2;
      } else if (R < rows_total) {
        const int t = R / p.G, g = R % p.G, hq = rc.h * p.G + g;
        store_any(p.out, rc.b * p.o_sb + t * p.o_st + hq * p.o_sh + d, p.out_dtype, o);
        if (p.lse && d == 0) p.lse[rc.b * p.l_sb + t * p.l_st + hq * p.l_sh] = lse2 * kLn2;
      }
    }
    if (split) {
      __threadfence();
      __syncthreads();
      int* s_last_p = reinterpret_cast<int*>(s_scan + 12);
      if (tid == 0) {
        int32_t* counter = p.counters + (static_cast<int64_t>(rc.b) * p.Hkv + rc.h) * Y + y;
        const int prev = atomicAdd(counter, 1);
        const int need = static_cast<int>(c_last - c_first + 1);
        *s_last_p = (prev == need - 1);
        if (prev == need - 1) *counter = 0;  // ready for the next launch
      }
      __syncthreads();
      if (*s_last_p) {
        __threadfence();
        for (int i = tid; i < 16 * D; i += kDecodeThreads) {
          const int r = i / D, d = i % D;
          const int R = y * 16 + r;
          if (R >= rows_total) continue;
          float M = -INFINITY;
          for (long long cc = c_first; cc <= c_last; ++cc) {
            const int sl = (range_start(cc, W_, N_) >= rc.row_first) ? 0 : 1;
            const long long pi = (static_cast<long long>(y) * gridDim.x + cc) * 2 + sl;
            M = fmaxf(M, __ldcg(p.part_lse + pi * 16 + r));
          }
          float num = 0.f, den = 0.f;
          if (M != -INFINITY) {
            for (long long cc = c_first; cc <= c_last; ++cc) {
              const int sl = (range_start(cc, W_, N_) >= rc.row_first) ? 0 : 1;
              const long long pi = (static_cast<long long>(y) * gridDim.x + cc) * 2 + sl;
              const float w = exp2f(__ldcg(p.part_lse + pi * 16 + r) - M);
              num += w * __ldcg(p.part_o + pi * 16 * D + i);
              den += w;
            }
          }
          const int t = R / p.G, g = R % p.G, hq = rc.h * p.G + g;
          store_any(p.out, rc.b * p.o_sb + t * p.o_st + hq * p.o_sh + d, p.out_dtype,
                    den > 0.f ? num / den : 0.f);
          if (p.lse && d == 0)
            p.lse[rc.b * p.l_sb + t * p.l_st + hq * p.l_sh] =
                den > 0.f ? (M + __log2f(den)) * kLn2 : -INFINITY;
        }
      }
    }
    __syncthreads();
  };

  // ---- Compute one tile (each warp: its 16 tokens). ----
  auto compute_tile = [&](const RowCursor& rc, int s) {
    const KV* sk = stage_k(s);
    const KV* sv = stage_v(s);
    const int tok0 = (rc.first_tile + rc.tile) * kTileN + warp * 16;
    if (rc.slot < 0 || tok0 >= rc.len) return;  // nothing visible in this warp's slice
    float sc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t kb[4];
      const int r = warp * 16 + (lane & 7) + (lane >> 4) * 8;
      const int col = kk * 16 + ((lane >> 3) & 1) * 8;
      ldmatrix_x4(kb, sk + r * kStride + col);
      Mma<KV>::run(sc[0], qf[kk], kb[0], kb[1]);
      Mma<KV>::run(sc[1], qf[kk], kb[2], kb[3]);
    }
    // Scale (or softcap), then mask what a query may not see: keys past its own position
    // (causal within the draft window and the end of the sequence) or before its window.
    const int last_pos = rc.len - p.T;  // position of query t is last_pos + t
    const bool full = (tok0 + 15 <= last_pos) &&
                      (p.window <= 0 || tok0 >= rc.len - 1 - p.window + 1);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[j][e];
        if (p.softcap > 0.f) {
          x = p.softcap * tanhf(x * p.qk_scale / p.softcap) * kLog2e;
        } else {
          x *= p.scale_log2;
        }
        if (!full) {
          const int kp = tok0 + j * 8 + (lane & 3) * 2 + (e & 1);
          const int qpos = last_pos + t_of[e >> 1];
          const bool vis = kp <= qpos && (p.window <= 0 || kp > qpos - p.window);
          if (!vis) x = -INFINITY;
        }
        sc[j][e] = x;
      }
    }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]), fmaxf(sc[1][2 * r], sc[1][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[r], mx);
      const float m_use = (m_new == -INFINITY) ? 0.f : m_new;
      corr[r] = exp2f(m_run[r] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        sc[j][2 * r] = exp2f(sc[j][2 * r] - m_use);
        sc[j][2 * r + 1] = exp2f(sc[j][2 * r + 1] - m_use);
        sum += sc[j][2 * r] + sc[j][2 * r + 1];
      }
      l_run[r] = l_run[r] * corr[r] + sum;
      m_run[r] = m_new;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][0] *= corr[0];
      acc[n][1] *= corr[0];
      acc[n][2] *= corr[1];
      acc[n][3] *= corr[1];
    }
    uint32_t pa[4];
    pa[0] = Mma<KV>::pack(sc[0][0], sc[0][1]);
    pa[1] = Mma<KV>::pack(sc[0][2], sc[0][3]);
    pa[2] = Mma<KV>::pack(sc[1][0], sc[1][1]);
    pa[3] = Mma<KV>::pack(sc[1][2], sc[1][3]);
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      uint32_t vb[4];
      const int r = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int col = jj * 16 + (lane >> 4) * 8;
      ldmatrix_x4_trans(vb, sv + r * kStride + col);
      Mma<KV>::run(acc[2 * jj], pa, vb[0], vb[1]);
      Mma<KV>::run(acc[2 * jj + 1], pa, vb[2], vb[3]);
    }
  };

  // ---- Main loop: prefetch stages-1 tiles ahead, across row boundaries. ----
  const int S_ = p.stages;
  RowCursor lc = start;   // next tile to load
  RowCursor cur = start;  // tile being computed
  RowCursor active = start;  // row whose softmax state is in registers
  int issued = 0;
  for (int s = 0; s < S_ - 1; ++s) {
    if (issued < n_tiles) {
      load_tile(lc, issued % S_);
      cursor_advance(p, lc);
    }
    ++issued;
    cp_async_commit();
  }
  for (int i = 0; i < n_tiles; ++i) {
    // The stage that held tile i-1 (or, at i = 0, the one the prologue left empty) is free
    // until the load issued below.
    const int free_stage = (i + S_ - 1) % S_;
    if (i == 0) {
      begin_row(cur, free_stage);
    } else if (cur.tile == 0) {
      end_row(active, free_stage);
      active = cur;
      begin_row(cur, free_stage);
    }
    if (issued < n_tiles) {
      load_tile(lc, issued % S_);
      cursor_advance(p, lc);
    }
    ++issued;
    cp_async_commit();
    if (S_ == 3) cp_async_wait<2>();
    else if (S_ == 2) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    compute_tile(cur, i % S_);
    __syncthreads();
    cursor_advance(p, cur);
  }
  end_row(active, (n_tiles + S_ - 1) % S_);
}

}  // namespace kvr

#define KVR_DECODE_KERNEL(NAME, KV, D)                                                          \
  extern "C" __global__ void __launch_bounds__(kvr::kDecodeThreads)                              \
      kvr_kv_decode_##NAME##_d##D(const __grid_constant__ kvr::DecodeParams p) {                   \
    kvr::decode_body<KV, D>(p);                                                                \
  }

KVR_DECODE_KERNEL(f16, __half, 64)
KVR_DECODE_KERNEL(f16, __half, 80)
KVR_DECODE_KERNEL(f16, __half, 96)
KVR_DECODE_KERNEL(f16, __half, 128)
KVR_DECODE_KERNEL(f16, __half, 256)
KVR_DECODE_KERNEL(bf16, __nv_bfloat16, 64)
KVR_DECODE_KERNEL(bf16, __nv_bfloat16, 80)
KVR_DECODE_KERNEL(bf16, __nv_bfloat16, 96)
KVR_DECODE_KERNEL(bf16, __nv_bfloat16, 128)
KVR_DECODE_KERNEL(bf16, __nv_bfloat16, 256)
