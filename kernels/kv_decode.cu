// Batched split-K flash decode over a paged KV pool (kvr_kv_decode).
//
// One launch serves a whole batch of sequences of any lengths, 1..8 query tokens each
// (causal inside the draft window), any GQA group 1..16, optional sliding window, logit
// softcap and log-sum-exp output. The grid is fixed (SMs x CTAs per SM, divided over the
// 16-row query tiles in grid.y); the work split is derived on the device from the lengths
// in device memory, so a captured CUDA Graph stays valid while sequences grow.
//
// Work: every (batch row b, KV head h) is a row of 64-token tiles (only the tiles inside the
// sliding window). All rows are laid end to end and cut into ranges of k whole tiles, one
// per CTA (stream-K): k is the smallest that fits the grid (at least min_tiles_per_cta),
// rounded to split the longest row evenly when that costs little. A CTA walks its range: K/V
// tiles stream through a cp.async pipeline (page-table lookup fused into each 16-byte copy,
// L2 evict-first), QK^T and PV run on mma.sync m16n8k16 with the GQA group (x query tokens)
// as the 16 MMA rows, softmax is online in base 2, and the 4 warps (16 tokens of each tile
// apiece) merge at the end of a row. A row covered by one CTA is written directly; a row
// split across CTAs writes partials, and the last CTA to finish it (atomic counter) merges
// them by log-sum-exp and resets the counter (rows of more than 16 parts: in two levels,
// groups of 8 parts first).
//
// Layout of a KV element: base + page * stride_page + head * stride_head + slot * stride_token
// + d, with the page from table[seq][token / page_size] (the pool's layout, src/kv/pool.rs).
#include "mma.cuh"

namespace kvr {

constexpr int kTileN = KVR_KV_DECODE_TILE;          // tokens per tile (16 per warp)
constexpr int kDecodeThreads = KVR_KV_DECODE_THREADS;  // 4 consumer warps + 2 producer warps
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x in one MUFU instruction (flushes subnormal results to 0: fine for softmax weights).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

using DecodeParams = kvr_kv_decode_args;

__device__ __forceinline__ float load_any(const void* p, int64_t i, int dtype) {
  if (dtype == KVR_DT_F32) return static_cast<const float*>(p)[i];
  if (dtype == KVR_DT_F16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ __forceinline__ void store_any(void* p, int64_t i, int dtype, float x) {
  if (dtype == KVR_DT_F32) static_cast<float*>(p)[i] = x;
  else if (dtype == KVR_DT_F16) static_cast<__half*>(p)[i] = __float2half_rn(x);
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
  if (p.window > 0) kstart = max(0, l - p.t - p.window + 1);
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
  if (++c.h < p.hkv) return;
  c.h = 0;
  if (++c.b < p.b) cursor_load_row(p, c);
}

// CTA that owns global tile x when the tiles are cut into ranges of k: [c*k, (c+1)*k).
__device__ __forceinline__ long long cta_of(long long x, long long k) { return x / k; }

// mbarrier helpers (sm_80+).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(a), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared.b64 st, [%0];\n}\n" ::"r"(a) : "memory");
}
// Arrives once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(a) : "memory");
}
// Waits until the phase with the given parity has completed. Called by whole warps: the
// lanes leave the loop together (a vote each round), because the ldmatrix / mma that follow
// are warp-collective and must not run with part of the warp still polling.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  while (true) {
    unsigned done;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // try_wait suspends the warp in hardware until the phase completes (or a time limit),
    // instead of polling: waiting consumers leave the issue slots to the producers.
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
#endif
    if (__all_sync(0xffffffffu, done)) break;
  }
}

// 16-byte global -> shared copy (zeros for src_bytes = 0) with an L2 eviction policy: the
// K/V stream is read once, so it goes first and the block table, lengths and partials stay.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void cp_async_16_stream(void* smem, const void* gmem, int src_bytes,
                                                   uint64_t pol) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(s),
               "l"(gmem), "r"(src_bytes), "l"(pol)
               : "memory");
}

// Barrier among the 4 consumer warps only (the producer warps never join it).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }

constexpr int kConsumerThreads = 128;
constexpr int kWarpsTotal = kDecodeThreads / 32;  // 4 consumers + 2 producers

// Shared-memory layout, area by area as kvr_kv_decode_smem_layout (kvr_abi.h) sizes them (the
// host sizes the launch by its total). K/V tile rows: head dims that are a multiple of 64 use
// an XOR swizzle of the 16-byte chunks (chunk c of row r is stored at c ^ (r % 8)):
// conflict-free ldmatrix with no padding, so 3 stages fit twice per SM. Other head dims pad
// each row by 16 bytes. Merge buffer rows are padded by 8 floats: the 4 warps' float2
// read-modify-writes (8 rows x 4 column pairs per access) hit distinct banks in each
// half-warp.
template <typename KV, int D> struct DecodeSmem {
  static constexpr kvr_kv_decode_smem kLayout = kvr_kv_decode_smem_layout(D, sizeof(KV), 1);
  static constexpr bool kSwizzle = kLayout.swizzled != 0;
  static constexpr int kStride = kLayout.row_stride;
  static constexpr int kQStride = kLayout.q_stride;
  static constexpr int kMStride = kLayout.merge_stride;
  static constexpr int kTileElems = kTileN * kStride;
  static constexpr int kStageBytes = kLayout.stage_bytes;
  static_assert(kStageBytes == 2 * kTileElems * static_cast<int>(sizeof(KV)), "a stage is a K and a V tile");
  static __device__ __forceinline__ int chunk(int row, int c) { return kSwizzle ? (c ^ (row & 7)) : c; }
};

// Writes outputs d..d+3 of query row r (of query tile y) of a (batch row, KV head) row, and
// its log-sum-exp (natural log) when asked for.
__device__ __forceinline__ void store_out(const DecodeParams& p, int y, const RowCursor& rc, int r,
                                          int d, float4 o, float lse2) {
  const int R = y * 16 + r;
  const int t = R / p.g, g = R % p.g, hq = rc.h * p.g + g;
  const int64_t base = rc.b * p.o_sb + t * p.o_st + hq * p.o_sh + d;
  store_any(p.out, base, p.out_dtype, o.x);
  store_any(p.out, base + 1, p.out_dtype, o.y);
  store_any(p.out, base + 2, p.out_dtype, o.z);
  store_any(p.out, base + 3, p.out_dtype, o.w);
  if (p.lse && d == 0) p.lse[rc.b * p.l_sb + t * p.l_st + hq * p.l_sh] = lse2 * kLn2;
}

// Folds n <= N partials of one output vector (each: base-2 log-sum-exp l and normalized
// output x, from load(j, l, x)) into a running log-sum-exp merge (max M, denominator den,
// unnormalized sum o): all loads issued first, one rescale when the max grows.
template <int N, typename Load>
__device__ __forceinline__ void fold_parts(int n, float& M, float& den, float4& o, Load load) {
  float l[N];
  float4 x[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    l[j] = -INFINITY;
    x[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j < n) load(j, l[j], x[j]);
  }
  float m = M;
#pragma unroll
  for (int j = 0; j < N; ++j) m = fmaxf(m, l[j]);
  if (m == -INFINITY) return;
  const float sc = exp2f(M - m);  // 0 while M is -inf
  den *= sc;
  o.x *= sc; o.y *= sc; o.z *= sc; o.w *= sc;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float w = exp2f(l[j] - m);
    den += w;
    o.x += w * x[j].x; o.y += w * x[j].y; o.z += w * x[j].z; o.w += w * x[j].w;
  }
  M = m;
}

// Merges `count` partials of a split row (those of CTAs first, first + stride, ...) by
// log-sum-exp into the output, or (out_part >= 0) into that partial slot. One pass, 8
// partials at a time, their log-sum-exps and outputs loaded together, the running sum
// rescaled when the max grows. Called by the 128 consumer threads, at most a few times
// per CTA.
template <int D>
__device__ __forceinline__ void merge_partials(const DecodeParams& p, const RowCursor& rc, int y,
                                            int rows_here, long long c_first, int first_slot,
                                            long long first, int stride, int count,
                                            long long out_part, float* s_row) {
  constexpr int kBatch = 8;
  const int tid = threadIdx.x;
  auto part_index = [&](long long cc) {
    return (static_cast<long long>(y) * gridDim.x + cc) * 2 + (cc == c_first ? first_slot : 0);
  };
  for (int i4 = tid; i4 < rows_here * D / 4; i4 += kConsumerThreads) {
    const int i = i4 * 4;
    const int r = i / D, d = i % D;
    float M = -INFINITY, den = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k0 = 0; k0 < count; k0 += kBatch) {
      fold_parts<kBatch>(min(kBatch, count - k0), M, den, o, [&](int j, float& l, float4& x) {
        const long long pi = part_index(first + static_cast<long long>(k0 + j) * stride);
        l = __ldcg(p.part_lse + pi * 16 + r);
        x = __ldcg(reinterpret_cast<const float4*>(p.part_o + pi * 16 * D + i));
      });
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    const float lse2 = den > 0.f ? M + __log2f(den) : -INFINITY;
    if (out_part < 0) {
      store_out(p, y, rc, r, d, o, lse2);
    } else {
      *reinterpret_cast<float4*>(p.part_o + out_part * 16 * D + i) = o;
      if (d == 0) s_row[r] = lse2;
    }
  }
  if (out_part >= 0) {
    consumer_sync();  // every thread has read the slot's log-sum-exps
    if (tid < rows_here) p.part_lse[out_part * 16 + tid] = s_row[tid];
  }
}

// The query token of each of the two MMA rows a lane holds in query tile y (rows past the
// last repeat the last row's token).
__device__ __forceinline__ void lane_query_tokens(const DecodeParams& p, int y, int lane, int (&t_of)[2]) {
  const int rows_total = p.g * p.t;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int R = y * 16 + (lane >> 2) + r * 8;
    t_of[r] = min(R, rows_total - 1) / p.g;
  }
}

// The 16 query rows of query tile y of (batch row b, KV head h), as KV rows of the Q staging
// buffer (zeros past the last row, or for a row with no sequence). Vector paths (q_vec): load()
// into registers, store() into the buffer, so the loads can be issued before the barrier that
// frees it; else load_scalar() (element loads, any dtype and strides).
template <typename KV, int D> struct QTile {
  static constexpr int kChunks = D / 8;
  static constexpr int kIt = (16 * kChunks + kConsumerThreads - 1) / kConsumerThreads;
  static constexpr int kQStride = DecodeSmem<KV, D>::kQStride;
  uint4 v[kIt];

  __device__ __forceinline__ void load(const DecodeParams& p, int y, int b, int h, bool live,
                                       int tid) {
    const int rows_total = p.g * p.t;
#pragma unroll
    for (int k = 0; k < kIt; ++k) {
      const int i = tid + k * kConsumerThreads;
      const int r = i / kChunks, ch = i % kChunks;
      const int R = y * 16 + r;
      v[k] = make_uint4(0u, 0u, 0u, 0u);
      if (i < 16 * kChunks && R < rows_total && live) {
        const int t = R / p.g, g = R % p.g;
        const int64_t off = b * p.q_sb + t * p.q_st + (h * p.g + g) * p.q_sh + ch * 8;
        if (p.q_vec == KVR_KV_Q_VEC_KV) {
          v[k] = __ldg(reinterpret_cast<const uint4*>(static_cast<const KV*>(p.q) + off));
        } else {
          const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.q) + off);
          const float4 a = __ldg(src), c = __ldg(src + 1);
          union {
            KV h[8];
            uint4 u;
          } cv;
          cv.h[0] = from_float<KV>(a.x); cv.h[1] = from_float<KV>(a.y);
          cv.h[2] = from_float<KV>(a.z); cv.h[3] = from_float<KV>(a.w);
          cv.h[4] = from_float<KV>(c.x); cv.h[5] = from_float<KV>(c.y);
          cv.h[6] = from_float<KV>(c.z); cv.h[7] = from_float<KV>(c.w);
          v[k] = cv.u;
        }
      }
    }
  }
  __device__ __forceinline__ void store(KV* sq, int tid) const {
#pragma unroll
    for (int k = 0; k < kIt; ++k) {
      const int i = tid + k * kConsumerThreads;
      if (i < 16 * kChunks)
        *reinterpret_cast<uint4*>(sq + (i / kChunks) * kQStride + (i % kChunks) * 8) = v[k];
    }
  }
  static __device__ __forceinline__ void load_scalar(const DecodeParams& p, int y, int b, int h,
                                                     bool live, int tid, KV* sq) {
    const int rows_total = p.g * p.t;
    for (int i = tid; i < 16 * D; i += kConsumerThreads) {
      const int r = i / D, d = i % D;
      const int R = y * 16 + r;
      float x = 0.f;
      if (R < rows_total && live) {
        const int t = R / p.g, g = R % p.g;
        x = load_any(p.q, b * p.q_sb + t * p.q_st + (h * p.g + g) * p.q_sh + d, p.q_dtype);
      }
      sq[r * kQStride + d] = from_float<KV>(x);
    }
  }
};

// One consumer warp's share of a K/V tile in shared memory (its 16 tokens): S = Q K^T for the
// 16 query rows of the tile in `sq`, scale or softcap, mask (causal within the draft window,
// the sequence end, the sliding window), online softmax in base 2, acc += P V. `tile_tok` is
// the tile's first token; `t_of` the query token of the lane's two rows.
template <typename KV, int D>
__device__ __forceinline__ void attend_tile(const DecodeParams& p, const KV* sq, const KV* sk,
                                            const KV* sv, int warp, int lane, int tile_tok, int slot,
                                            int len, const int (&t_of)[2], float (&acc)[D / 8][4],
                                            float (&m_run)[2], float (&l_run)[2]) {
  using Sm = DecodeSmem<KV, D>;
  constexpr int kStride = Sm::kStride;
  constexpr int kQStride = Sm::kQStride;
  const int tok0 = tile_tok + warp * 16;
  if (slot < 0 || tok0 >= len) return;  // nothing visible in this warp's slice
  // S = Q K^T, Q fragments read from shared memory (saves 32+ registers), in two
  // independent accumulator chains (even / odd k-steps) for more MMAs in flight.
  float sc[2][4], sd[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    sd[j][0] = sd[j][1] = sd[j][2] = sd[j][3] = 0.f;
  }
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t qa[4], kb[4];
    const int qr = (lane & 7) + ((lane >> 3) & 1) * 8;
    ldmatrix_x4(qa, sq + qr * kQStride + kk * 16 + (lane >> 4) * 8);
    const int r = warp * 16 + (lane & 7) + (lane >> 4) * 8;
    const int c = kk * 2 + ((lane >> 3) & 1);
    ldmatrix_x4(kb, sk + r * kStride + Sm::chunk(r, c) * 8);
    if (kk & 1) {
      Mma<KV>::run(sd[0], qa, kb[0], kb[1]);
      Mma<KV>::run(sd[1], qa, kb[2], kb[3]);
    } else {
      Mma<KV>::run(sc[0], qa, kb[0], kb[1]);
      Mma<KV>::run(sc[1], qa, kb[2], kb[3]);
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[j][e] += sd[j][e];
  }
  // Scale (or softcap), then mask what a query may not see: keys past its own position
  // (causal within the draft window and the end of the sequence) or before its window.
  const int last_pos = len - p.t;  // position of query t is last_pos + t
  const bool full_vis = (tok0 + 15 <= last_pos) && (p.window <= 0 || tok0 >= len - p.window);
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
      if (!full_vis) {
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
    corr[r] = fast_exp2(m_run[r] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][2 * r] = fast_exp2(sc[j][2 * r] - m_use);
      sc[j][2 * r + 1] = fast_exp2(sc[j][2 * r + 1] - m_use);
      sum += sc[j][2 * r] + sc[j][2 * r + 1];
    }
    l_run[r] = l_run[r] * corr[r] + sum;
    m_run[r] = m_new;
  }
  // Rescale only when some row's max moved (rare once a row's max has settled).
  if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][0] *= corr[0];
      acc[n][1] *= corr[0];
      acc[n][2] *= corr[1];
      acc[n][3] *= corr[1];
    }
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
    const int c = jj * 2 + (lane >> 4);
    ldmatrix_x4_trans(vb, sv + r * kStride + Sm::chunk(r, c) * 8);
    Mma<KV>::run(acc[2 * jj], pa, vb[0], vb[1]);
    Mma<KV>::run(acc[2 * jj + 1], pa, vb[2], vb[3]);
  }
}

// attend_tile for query tiles of at most 8 rows, keys as the MMA M dimension: S^T = K Q^T
// (16 tokens x 8 query rows per MMA, half the MMAs of 16 query rows), the probabilities
// transposed in registers (movmatrix) into the B operand of O^T = V^T P^T (16 head dims x 8
// query rows per MMA). acc[n] (n < D / 16) holds O^T rows n 16 + lane / 4 (+ 8), columns
// (query rows) 2 (lane % 4) + {0, 1}; m_run / l_run are those two columns' (l_run partial
// over the lane's tokens: sum it over lanes xor 4, 8, 16 at the end).
template <typename KV, int D>
__device__ __forceinline__ void attend_tile_kt(const DecodeParams& p, const KV* sq, const KV* sk,
                                               const KV* sv, int warp, int lane, int tile_tok,
                                               int slot, int len, const int (&t_of)[2],
                                               float (&acc)[D / 8][4], float (&m_run)[2],
                                               float (&l_run)[2]) {
  using Sm = DecodeSmem<KV, D>;
  constexpr int kStride = Sm::kStride;
  constexpr int kQStride = Sm::kQStride;
  const int tok0 = tile_tok + warp * 16;
  if (slot < 0 || tok0 >= len) return;
  float sc[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
  const int kr = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;  // K / V row of this lane's address
#pragma unroll
  for (int kk = 0; kk < D / 16; kk += 2) {
    uint32_t qb[4];  // B fragments of k-steps kk and kk + 1: Q rows 0-7, 8 head dims each
    ldmatrix_x4(qb, sq + (lane & 7) * kQStride + kk * 16 + (lane >> 3) * 8);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (kk + h < D / 16) {
        uint32_t ka[4];
        const int c = (kk + h) * 2 + (lane >> 4);
        ldmatrix_x4(ka, sk + kr * kStride + Sm::chunk(kr, c) * 8);
        Mma<KV>::run(sc[h], ka, qb[2 * h], qb[2 * h + 1]);
      }
    }
  }
  float x[4];
  const int last_pos = len - p.t;
  const bool full_vis = (tok0 + 15 <= last_pos) && (p.window <= 0 || tok0 >= len - p.window);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float v = sc[0][e] + sc[1][e];
    if (p.softcap > 0.f) {
      v = p.softcap * tanhf(v * p.qk_scale / p.softcap) * kLog2e;
    } else {
      v *= p.scale_log2;
    }
    if (!full_vis) {
      const int kp = tok0 + (lane >> 2) + (e >> 1) * 8;
      const int qpos = last_pos + t_of[e & 1];
      const bool vis = kp <= qpos && (p.window <= 0 || kp > qpos - p.window);
      if (!vis) v = -INFINITY;
    }
    x[e] = v;
  }
  float corr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = fmaxf(x[i], x[2 + i]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    const float m_new = fmaxf(m_run[i], mx);
    const float m_use = (m_new == -INFINITY) ? 0.f : m_new;
    corr[i] = fast_exp2(m_run[i] - m_use);
    x[i] = fast_exp2(x[i] - m_use);
    x[2 + i] = fast_exp2(x[2 + i] - m_use);
    l_run[i] = l_run[i] * corr[i] + x[i] + x[2 + i];
    m_run[i] = m_new;
  }
  if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      acc[n][0] *= corr[0];
      acc[n][1] *= corr[1];
      acc[n][2] *= corr[0];
      acc[n][3] *= corr[1];
    }
  }
  // P^T as the B operand (k = token, n = query row): the transposes of the two 8x8 blocks.
  const uint32_t pb0 = movmatrix_trans(Mma<KV>::pack(x[0], x[1]));
  const uint32_t pb1 = movmatrix_trans(Mma<KV>::pack(x[2], x[3]));
  const int vr = warp * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    uint32_t va[4];  // V^T rows n 16 .. + 15 (head dims) x the warp's 16 tokens
    const int c = n * 2 + ((lane >> 3) & 1);
    ldmatrix_x4_trans(va, sv + vr * kStride + Sm::chunk(vr, c) * 8);
    Mma<KV>::run(acc[n], va, pb0, pb1);
  }
}

template <typename KV, int D> __device__ __forceinline__ void decode_body(const DecodeParams& p) {
  using Sm = DecodeSmem<KV, D>;
  constexpr int kStride = Sm::kStride;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr kvr_kv_decode_smem kLay = Sm::kLayout;
  const int S_ = p.stages;
  unsigned char* cursor_p = smem;
  KV* stages_base = reinterpret_cast<KV*>(cursor_p);
  cursor_p += S_ * kLay.stage_bytes;
  KV* sq = reinterpret_cast<KV*>(cursor_p);
  cursor_p += kLay.q_bytes;
  float* s_merge = reinterpret_cast<float*>(cursor_p);
  cursor_p += kLay.merge_bytes;
  long long* s_off = reinterpret_cast<long long*>(cursor_p);
  cursor_p += kLay.off_bytes;
  float* s_ml = reinterpret_cast<float*>(cursor_p);
  float* s_row = s_ml + 128;
  cursor_p += kLay.ml_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(cursor_p);
  uint64_t* empty = full + S_;
  cursor_p += S_ * kLay.bar_bytes;
  long long* s_scan = reinterpret_cast<long long*>(cursor_p);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool producer = warp >= 4;
  const int Y = gridDim.y, y = blockIdx.y;

  if (tid == 0) {
    for (int s = 0; s < S_; ++s) {
      mbar_init(&full[s], 64);  // the producer warps' 64 lanes, via cp.async arrivals
      mbar_init(&empty[s], kConsumerThreads);  // every consumer thread releases its reads
    }
  }

  // ---- Work partition, recomputed by every CTA from the device lengths. ----
  const int per = (p.b + kDecodeThreads - 1) / kDecodeThreads;
  const int b0 = min(p.b, tid * per), b1 = min(p.b, b0 + per);
  long long mine = 0;
  int my_max = 1;  // longest row (tiles) among this thread's
  for (int b = b0; b < b1; ++b) {
    int len, ft, nt;
    row_shape(p, batch_slot(p, b), &len, &ft, &nt);
    mine += nt;
    my_max = max(my_max, nt);
  }
  mine *= p.hkv;
  long long incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    long long n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  int* s_max = reinterpret_cast<int*>(s_ml);  // scratch: s_ml is first used at a row's end
  const int warp_max = __reduce_max_sync(0xffffffffu, my_max);
  if (lane == 31) s_scan[warp] = incl;
  if (lane == 0) s_max[warp] = warp_max;
  __syncthreads();
  long long warp_base = 0, W = 0;
  int n_max = 1;
  for (int w = 0; w < kWarpsTotal; ++w) {
    if (w < warp) warp_base += s_scan[w];
    W += s_scan[w];
    n_max = max(n_max, s_max[w]);
  }
  const long long excl = warp_base + incl - mine;
  // Ranges of k whole tiles (k >= min_tiles_per_cta, as few as fill the grid): uniform rows
  // whose length is a multiple of k split into equal, aligned parts.
  // k is rounded up to cut the longest row into equal parts (or to a multiple of it) when
  // that costs at most 1/8 more tiles per CTA, so that in a uniform batch no range ends
  // inside a row it did not start (no CTA merges a row in the middle of its range).
  const long long k0 = max(static_cast<long long>(max(1, p.min_tiles_per_cta)),
                           (W + gridDim.x - 1) / gridDim.x);
  long long k_per = k0;
  {
    long long kk;
    if (k0 < n_max) {
      const long long parts = n_max / k0;
      kk = (n_max + parts - 1) / parts;
    } else {
      kk = (k0 + n_max - 1) / n_max * n_max;
    }
    if (kk * 8 <= k0 * 9) k_per = kk;
  }
  const long long N = (W + k_per - 1) / k_per;
  const long long c = blockIdx.x;
  if (c >= N) return;
  const long long S = c * k_per, E = min(W, S + k_per);
  __syncthreads();
  if (S >= excl && S < excl + mine) {
    long long acc = excl;
    for (int b = b0; b < b1; ++b) {
      const int slot = batch_slot(p, b);
      int len, ft, nt;
      row_shape(p, slot, &len, &ft, &nt);
      const long long span = static_cast<long long>(nt) * p.hkv;
      if (S < acc + span) {
        const long long off = S - acc;
        s_scan[8] = b;
        s_scan[9] = off / nt;
        s_scan[10] = off % nt;
        s_scan[11] = acc + (off / nt) * nt;
        int* si = reinterpret_cast<int*>(s_scan + 13);
        si[0] = slot;
        si[1] = len;
        si[2] = ft;
        si[3] = nt;
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
  {
    const int* si = reinterpret_cast<const int*>(s_scan + 13);
    start.slot = si[0];
    start.len = si[1];
    start.first_tile = si[2];
    start.ntiles = si[3];
  }
  const int n_tiles = static_cast<int>(E - S);
  auto stage_k = [&](int s) { return stages_base + s * 2 * Sm::kTileElems; };
  auto stage_v = [&](int s) { return stages_base + s * 2 * Sm::kTileElems + Sm::kTileElems; };

  // ============ Producer warps (2): stream tiles into the ring, 32 rows each. ============
  if (producer) {
    const int pw = warp - 4;           // rows pw*32 .. pw*32+31; this lane's row: pw*32+lane
    const int my_row = pw * 32 + lane;
    // Page id of this lane's row, fetched two tiles ahead.
    auto page_id = [&](const RowCursor& rc) {
      const int tok = (rc.first_tile + rc.tile) * kTileN + my_row;
      if (rc.slot < 0 || tok >= rc.len) return -1;
      const int32_t* trow = p.table + static_cast<int64_t>(rc.slot) * p.table_stride;
      return __ldg(trow + fast_div(p.page, static_cast<uint32_t>(tok)));
    };
    RowCursor lc = start, pc = start;  // tile to issue, tile to prefetch ids for
    int id0 = -1, id1 = -1;
    if (n_tiles > 0) { id0 = page_id(pc); cursor_advance(p, pc); }
    if (n_tiles > 1) { id1 = page_id(pc); cursor_advance(p, pc); }
    long long* off = s_off + pw * 32 * 2;
    const uint64_t pol = l2_evict_first_policy();
    for (int i = 0; i < n_tiles; ++i) {
      int id2 = -1;
      if (i + 2 < n_tiles) { id2 = page_id(pc); cursor_advance(p, pc); }
      const int s = i % S_;
      if (i >= S_) mbar_wait(&empty[s], ((i / S_) - 1) & 1);
      const int tok = (lc.first_tile + lc.tile) * kTileN + my_row;
      long long ko = -1, vo = -1;
      if (id0 >= 0) {
        const uint32_t pi = fast_div(p.page, static_cast<uint32_t>(tok));
        const int64_t sl = tok - static_cast<int64_t>(pi) * p.page.d;
        ko = id0 * p.k_sp + lc.h * p.k_sh + sl * p.k_st;
        vo = id0 * p.v_sp + lc.h * p.v_sh + sl * p.v_st;
      }
      off[lane * 2] = ko;
      off[lane * 2 + 1] = vo;
      __syncwarp();
      KV* sk = stage_k(s) + pw * 32 * kStride;
      KV* sv = stage_v(s) + pw * 32 * kStride;
      const KV* kb = static_cast<const KV*>(p.k);
      const KV* vb = static_cast<const KV*>(p.v);
#pragma unroll 4
      for (int k = 0; k < kChunks; ++k) {
        const int j = lane + k * 32;  // chunk j of this warp's 32 rows
        const int row = j / kChunks, col = j % kChunks;
        const longlong2 o = *reinterpret_cast<const longlong2*>(off + row * 2);
        const bool valid = o.x >= 0;
        const int pc = Sm::chunk(row, col) * 8;
        cp_async_16_stream(sk + row * kStride + pc, valid ? kb + o.x + col * 8 : kb, valid ? 16 : 0, pol);
        cp_async_16_stream(sv + row * kStride + pc, valid ? vb + o.y + col * 8 : vb, valid ? 16 : 0, pol);
      }
      mbar_arrive_cp_async(&full[s]);
      __syncwarp();  // `off` is rewritten next tile
      id0 = id1;
      id1 = id2;
      cursor_advance(p, lc);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // =================== Consumer warps: attention over the ring. ===================
  const int rows_total = p.g * p.t;
  int t_of[2];
  lane_query_tokens(p, y, lane, t_of);
  float acc[D / 8][4];
  float m_run[2], l_run[2];

  auto begin_row = [&](const RowCursor& rc) {
    // Q rows of this tile: 16-byte loads into registers first (issued before the barrier
    // that frees the Q buffer, so their latency overlaps the previous row's tail).
    QTile<KV, D> qt;
    if (p.q_vec) qt.load(p, y, rc.b, rc.h, rc.slot >= 0, tid);
    consumer_sync();  // the Q buffer may still be read by the previous row's fragments load
    if (p.q_vec) {
      qt.store(sq, tid);
    } else {
      qt.load_scalar(p, y, rc.b, rc.h, rc.slot >= 0, tid, sq);
    }
    consumer_sync();
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };

  auto store_row = [&](const RowCursor& rc, int r, int d, float4 o, float lse2) {
    store_out(p, y, rc, r, d, o, lse2);
  };

  auto end_row = [&](const RowCursor& rc) {
    // Merge the 4 warps: shared max and sum per row, then the accumulators, rescaled to
    // the common max, summed warp by warp into the [16][D] merge buffer.
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
    consumer_sync();
    if (tid < 16) {
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_ml[w * 16 + tid]);
      float L = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < 4; ++w) L += s_ml[64 + w * 16 + tid] * exp2f(s_ml[w * 16 + tid] - M);
      }
      s_row[tid * 2] = M;
      s_row[tid * 2 + 1] = L;
    }
    float f[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rr = (lane >> 2) + r * 8;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) M = fmaxf(M, s_ml[w * 16 + rr]);
      f[r] = (M == -INFINITY) ? 0.f : exp2f(m_run[r] - M);
    }
    for (int w = 0; w < 4; ++w) {
      if (warp == w) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const int col = n * 8 + (lane & 3) * 2;
          const int r0 = lane >> 2;
          float2* a = reinterpret_cast<float2*>(s_merge + r0 * Sm::kMStride + col);
          float2* b = reinterpret_cast<float2*>(s_merge + (r0 + 8) * Sm::kMStride + col);
          float2 x = make_float2(acc[n][0] * f[0], acc[n][1] * f[0]);
          float2 z = make_float2(acc[n][2] * f[1], acc[n][3] * f[1]);
          if (w > 0) {
            x.x += a->x; x.y += a->y;
            z.x += b->x; z.y += b->y;
          }
          *a = x;
          *b = z;
        }
      }
      consumer_sync();
    }
    // Rows covered by this CTA alone are written directly; split rows go out as partials.
    const long long c_first = cta_of(rc.row_first, k_per);
    const long long c_last = cta_of(rc.row_first + rc.ntiles - 1, k_per);
    const bool split = c_first != c_last;
    const int pslot = (S >= rc.row_first) ? 0 : 1;
    const long long pidx = (static_cast<long long>(y) * gridDim.x + c) * 2 + pslot;
    const int rows_here = min(16, rows_total - y * 16);
    for (int i4 = tid; i4 < rows_here * D / 4; i4 += kConsumerThreads) {
      const int i = i4 * 4;
      const int r = i / D, d = i % D;
      const float L = s_row[r * 2 + 1];
      float4 o = *reinterpret_cast<const float4*>(s_merge + r * Sm::kMStride + d);
      const float inv = L > 0.f ? 1.f / L : 0.f;
      o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
      const float lse2 = L > 0.f ? s_row[r * 2] + __log2f(L) : -INFINITY;
      if (split) {
        *reinterpret_cast<float4*>(p.part_o + pidx * 16 * D + i) = o;
        if (d == 0) p.part_lse[pidx * 16 + r] = lse2;
      } else {
        store_row(rc, r, d, o, lse2);
      }
    }
    if (split) {
      // Publish the partial (barrier, then one release by thread 0, as a grid sync does).
      // The last CTA to finish the row merges the partials by log-sum-exp; a row of more
      // than kFlatParts parts merges in two levels: the last CTA of each group of 8
      // consecutive parts merges them into the group leader's slot, and the last group to
      // finish merges the groups (no CTA reads more than 8 partials of a large row).
      constexpr int kGroup = 8, kFlatParts = 16;
      const int n_parts = static_cast<int>(c_last - c_first + 1);
      // Only the first CTA's range can start before the row (its partial is in slot 1).
      const int first_slot = (c_first * k_per >= rc.row_first) ? 0 : 1;
      auto part_index = [&](long long cc) {
        return (static_cast<long long>(y) * gridDim.x + cc) * 2 + (cc == c_first ? first_slot : 0);
      };
      const bool tree = n_parts > kFlatParts;
      const int n_groups = (n_parts + kGroup - 1) / kGroup;
      const long long leader = c_first + ((c - c_first) / kGroup) * kGroup;
      int* s_flag = reinterpret_cast<int*>(s_scan + 12);
      // Thread 0 counts this CTA in; true for the last of `need`.
      auto arrive_last = [&](int32_t* counter, int need) {
        consumer_sync();
        if (tid == 0) *s_flag = count_in_last(counter, need);
        consumer_sync();
        return *s_flag != 0;
      };
      auto merge_parts = [&](long long first, int stride, int count, long long out_part) {
        merge_partials<D>(p, rc, y, rows_here, c_first, first_slot, first, stride, count, out_part,
                          s_row);
      };
      int32_t* row_counter = p.counters + (static_cast<int64_t>(rc.b) * p.hkv + rc.h) * Y + y;
      if (!tree) {
        if (arrive_last(row_counter, n_parts)) merge_parts(c_first, 1, n_parts, -1);
      } else {
        const long long lp = part_index(leader);
        const int gsize = static_cast<int>(min(static_cast<long long>(kGroup), c_last + 1 - leader));
        if (arrive_last(p.group_counters + lp, gsize)) {
          merge_parts(leader, 1, gsize, lp);
          if (arrive_last(row_counter, n_groups)) merge_parts(c_first, kGroup, n_groups, -1);
        }
      }
    }
    consumer_sync();  // merge buffer and s_row are reused by the next row
  };

  auto compute_tile = [&](const RowCursor& rc, int s) {
    attend_tile<KV, D>(p, sq, stage_k(s), stage_v(s), warp, lane, (rc.first_tile + rc.tile) * kTileN,
                       rc.slot, rc.len, t_of, acc, m_run, l_run);
  };

  RowCursor cur = start;
  RowCursor active = start;
  begin_row(cur);
  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % S_;
    if (i > 0 && cur.tile == 0) {
      end_row(active);
      active = cur;
      begin_row(cur);
    }
    mbar_wait(&full[s], (i / S_) & 1);
    compute_tile(cur, s);
    mbar_arrive(&empty[s]);
    cursor_advance(p, cur);
  }
  end_row(active);
}

// ---- Split decode for short batches (kvr_kv_sdecode_<kv>_d<D>) ----
//
// A batch of few (batch row, KV head) rows pays for the stream-K kernel's fixed costs (the
// partition scan over the batch, producer / consumer hand-offs, merges of ranges that cut
// rows anywhere). Here every CTA knows its work from its indices: grid (splits, b * hkv, Y),
// CTA (s, row, y) takes the tiles s, s + P, s + 2 P, ... of its row, P = min(splits,
// ceil(tiles / min_tiles_per_cta)) from the device length (a captured graph stays valid while
// sequences grow; CTAs s >= P leave at once). All 4 warps copy (cp.async ring of NS tiles, the
// page lookups of a tile one iteration ahead) and compute (attend_tile, as the stream-K
// kernel). The warps combine through shared memory in one step; a row of one part is written
// directly, else each CTA writes a partial and the row's last CTA (atomic counter) stages all
// partials in shared memory with cp.async and merges them by log-sum-exp. Launched as a
// programmatic dependent: it waits for the previous kernel before its first read.
template <typename KV, int D, int NS, bool kCluster, int kG>
__device__ __forceinline__ void sdecode_body(const DecodeParams& p) {
  using Sm = DecodeSmem<KV, D>;
  constexpr int kStride = Sm::kStride;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kCopyIt = (kTileN * kChunks + kConsumerThreads - 1) / kConsumerThreads;
  constexpr kvr_kv_decode_smem kLay = kvr_kv_decode_smem_layout(D, sizeof(KV), NS);
  constexpr int kThreads = kConsumerThreads * kG;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* cursor_p = smem;
  KV* stages_base = reinterpret_cast<KV*>(cursor_p);
  float* area = reinterpret_cast<float*>(cursor_p);  // after the tiles: combine / merge staging
  cursor_p += kG == 1 ? kLay.split_area : kLay.split2_area;
  KV* sq = reinterpret_cast<KV*>(cursor_p);
  cursor_p += kLay.q_bytes;
  long long* s_off = reinterpret_cast<long long*>(cursor_p);  // [kG][NS][64][2]
  cursor_p += kG * NS * kLay.off_bytes;
  float* s_ml = reinterpret_cast<float*>(cursor_p);  // [2][4 kG][16] warps' max / sum, [16][2] rows
  float* s_row = s_ml + 128 * kG;
  cursor_p += kLay.ml_bytes + (kG - 1) * 128 * 4;
  int* s_flag = reinterpret_cast<int*>(cursor_p);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // kG groups of 4 warps; group g streams the CTA's tiles g, g + kG, ... through its own
  // ring (its own barrier, bar.sync 1 + g), and all warps combine at the end.
  const int grp = tid / kConsumerThreads, gtid = tid % kConsumerThreads, gwarp = warp & 3;
  KV* g_stages = stages_base + grp * NS * 2 * Sm::kTileElems;
  long long* g_off = s_off + grp * NS * kTileN * 2;
  auto group_sync = [&]() {
    if (kG == 1) {
      __syncthreads();
    } else {
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + grp) : "memory");
    }
  };
  const int s = blockIdx.x, P_max = gridDim.x, row = blockIdx.y, y = blockIdx.z;
  const int b = row / p.hkv, h = row % p.hkv;
  const int rows_total = p.g * p.t;
  const int rows_here = min(16, rows_total - y * 16);

  pdl_wait();
  pdl_launch_dependents();
  RowCursor rc;
  rc.b = b;
  rc.h = h;
  rc.slot = batch_slot(p, b);
  const int32_t* trow = p.table + static_cast<int64_t>(rc.slot < 0 ? 0 : rc.slot) * p.table_stride;
  // Without a sliding window a row split P_max ways (P == P_max below: every row of more than
  // P_max * min_tiles tiles, and every cluster) gives this group tiles s + (grp + kG i) P_max
  // whatever the length: the page ids of its first kPro tiles are loaded beside the length
  // (their tokens are checked against it below). A paged row's ids are far apart in the
  // table; loaded after the length, they cost the prologue one more round trip.
  // In the loop a tile's page ids are loaded kAhead iterations before its offsets are needed
  // (with one, the table's L2 round trip was exposed: paged rows ran up to 7 % behind the
  // same kernel on a contiguous layout, BENCHMARKS.md, fifteenth session).
  constexpr int kAhead = 4;
  constexpr int kPro = NS + kAhead - 1;  // ids the prologue loads
  int spec_id[kPro];
  const int tok_cap = p.table_stride * static_cast<int>(p.page.d);
#pragma unroll
  for (int i = 0; i < kPro; ++i) {
    spec_id[i] = -1;
    const int tok = (s + (grp + i * kG) * P_max) * kTileN + gtid;
    if (gtid < kTileN && rc.slot >= 0 && p.window <= 0 && tok < tok_cap)
      spec_id[i] = __ldg(trow + fast_div(p.page, static_cast<uint32_t>(tok)));
  }
  row_shape(p, rc.slot, &rc.len, &rc.first_tile, &rc.ntiles);
  QTile<KV, D> qt;
  if (p.q_vec && tid < kConsumerThreads) qt.load(p, y, b, h, rc.slot >= 0, tid);
  const int min_tiles = max(1, p.min_tiles_per_cta);
  // A cluster's CTAs all take part in its merge (those with no tile bring an empty partial).
  const int P = kCluster ? P_max : min(P_max, (rc.ntiles + min_tiles - 1) / min_tiles);
  if (s >= P) return;
  const int n_my = max(0, (rc.ntiles - s + P - 1) / P);  // tiles s, s + P, ... of the row
  const int n_g = max(0, (n_my - grp + kG - 1) / kG);      // this group's: local g + kG i

  // Row offsets (K, V) of the group's tile i, by the group's thread of that row (gtid < 64):
  // -1 past the sequence (the copy writes zeros: no stale value reaches the P V product).
  auto tile_tok = [&](int i) { return (rc.first_tile + s + (grp + i * kG) * P) * kTileN; };
  auto page_of = [&](int i) {
    const int tok = tile_tok(i) + gtid;
    if (i >= n_g || rc.slot < 0 || tok >= rc.len) return -1;
    return __ldg(trow + fast_div(p.page, static_cast<uint32_t>(tok)));
  };
  auto put_offsets = [&](int i, int id) {
    long long ko = -1, vo = -1;
    if (id >= 0) {
      const int tok = tile_tok(i) + gtid;
      const uint32_t pi = fast_div(p.page, static_cast<uint32_t>(tok));
      const int64_t sl = tok - static_cast<int64_t>(pi) * p.page.d;
      ko = id * p.k_sp + h * p.k_sh + sl * p.k_st;
      vo = id * p.v_sp + h * p.v_sh + sl * p.v_st;
    }
    g_off[((i % NS) * kTileN + gtid) * 2] = ko;
    g_off[((i % NS) * kTileN + gtid) * 2 + 1] = vo;
  };
  const KV* kb = static_cast<const KV*>(p.k);
  const KV* vb = static_cast<const KV*>(p.v);
  const uint64_t pol = l2_evict_first_policy();
  auto issue = [&](int i) {
    const int st = i % NS;
    KV* sk = g_stages + st * 2 * Sm::kTileElems;
    KV* sv = sk + Sm::kTileElems;
    const long long* off = g_off + st * kTileN * 2;
#pragma unroll
    for (int k = 0; k < kCopyIt; ++k) {
      const int j = gtid + k * kConsumerThreads;
      if ((kTileN * kChunks) % kConsumerThreads == 0 || j < kTileN * kChunks) {
        const int r = j / kChunks, col = j % kChunks;
        const longlong2 o = *reinterpret_cast<const longlong2*>(off + r * 2);
        const bool valid = o.x >= 0;
        const int pc = Sm::chunk(r, col) * 8;
        cp_async_16_stream(sk + r * kStride + pc, valid ? kb + o.x + col * 8 : kb, valid ? 16 : 0, pol);
        cp_async_16_stream(sv + r * kStride + pc, valid ? vb + o.y + col * 8 : vb, valid ? 16 : 0, pol);
      }
    }
  };

  int id_q[kAhead - 1];  // ids of tiles i + NS, ..., i + NS + kAhead - 2, loaded already
#pragma unroll
  for (int j = 0; j + 1 < kAhead; ++j) id_q[j] = -1;
  if (gtid < kTileN) {
    const bool spec = p.window <= 0 && P == P_max;
    int ids[kPro];
#pragma unroll
    for (int i = 0; i < kPro; ++i) {
      const int tok = tile_tok(i) + gtid;
      ids[i] = !spec ? page_of(i) : i < n_g && rc.slot >= 0 && tok < rc.len ? spec_id[i] : -1;
    }
#pragma unroll
    for (int i = 0; i < NS; ++i) put_offsets(i, ids[i]);
#pragma unroll
    for (int j = 0; j + 1 < kAhead; ++j) id_q[j] = ids[NS + j];
  }
  if (tid < kConsumerThreads) {
    if (p.q_vec) {
      qt.store(sq, tid);
    } else {
      QTile<KV, D>::load_scalar(p, y, b, h, rc.slot >= 0, tid, sq);
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NS - 1; ++i) {
    if (i < n_g) issue(i);
    cp_async_commit();
  }

  // Query tiles of at most 8 rows take the transposed tile math (attend_tile_kt): its
  // columns are the query rows 2 (lane % 4) + {0, 1}.
  const bool kt = rows_total <= 8;
  int t_of[2];
  lane_query_tokens(p, y, lane, t_of);
  if (kt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) t_of[i] = min((lane & 3) * 2 + i, rows_total - 1) / p.g;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int i = 0; i < n_g; ++i) {
    cp_async_wait<NS - 2>();
    group_sync();  // tile i is in for every thread of the group; tile i - 1's stage is free
    if (i + NS - 1 < n_g) issue(i + NS - 1);
    cp_async_commit();
    int id = -1;
    if (gtid < kTileN) id = page_of(i + NS + kAhead - 1);
    const KV* sk = g_stages + (i % NS) * 2 * Sm::kTileElems;
    if (kt) {
      attend_tile_kt<KV, D>(p, sq, sk, sk + Sm::kTileElems, gwarp, lane, tile_tok(i), rc.slot,
                            rc.len, t_of, acc, m_run, l_run);
    } else {
      attend_tile<KV, D>(p, sq, sk, sk + Sm::kTileElems, gwarp, lane, tile_tok(i), rc.slot,
                         rc.len, t_of, acc, m_run, l_run);
    }
    if (gtid < kTileN) {  // tile i's slot: its copy was issued long ago
      put_offsets(i + NS, id_q[0]);
#pragma unroll
      for (int j = 0; j + 2 < kAhead; ++j) id_q[j] = id_q[j + 1];
      id_q[kAhead - 2] = id;
    }
  }
  cp_async_wait<0>();

  // Combine the 4 kG warps: each writes its accumulators and its rows' max / sum; every output
  // is then rescaled to the rows' common max in one pass.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (kt) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 4);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 8);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 16);
    } else {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
  }
  __syncthreads();  // every warp is done with the tiles: the stage area becomes the slots
  constexpr int kM = Sm::kMStride;
  if (kt) {
    if (lane < 4) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s_ml[warp * 16 + lane * 2 + i] = m_run[i];
        s_ml[64 * kG + warp * 16 + lane * 2 + i] = l_run[i];
      }
    }
    float* slot_w = area + warp * 16 * kM;
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = (lane & 3) * 2 + (e & 1);
        if (q < rows_here) slot_w[q * kM + n * 16 + (lane >> 2) + (e >> 1) * 8] = acc[n][e];
      }
    }
  } else {
    if ((lane & 3) == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s_ml[warp * 16 + (lane >> 2) + r * 8] = m_run[r];
        s_ml[64 * kG + warp * 16 + (lane >> 2) + r * 8] = l_run[r];
      }
    }
    float* slot_w = area + warp * 16 * kM;
    const int r0 = lane >> 2;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + (lane & 3) * 2;
      if (r0 < rows_here)
        *reinterpret_cast<float2*>(slot_w + r0 * kM + col) = make_float2(acc[n][0], acc[n][1]);
      if (r0 + 8 < rows_here)
        *reinterpret_cast<float2*>(slot_w + (r0 + 8) * kM + col) = make_float2(acc[n][2], acc[n][3]);
    }
  }
  __syncthreads();
  const bool split = P > 1;
  // Cluster mode: the CTA's partial (normalized output, base-2 log-sum-exp) stays in its
  // shared memory, after the 4 combine slots, for the cluster's merge.
  float* s_part = area + 4 * kG * 16 * kM;
  float* s_plse = s_row;  // [16] (s_row serves only the global merge)
  const long long part0 = (static_cast<long long>(y) * gridDim.y + row) * P_max;
  for (int i4 = tid; i4 < rows_here * D / 4; i4 += kThreads) {
    const int i = i4 * 4;
    const int r = i / D, d = i % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4 * kG; ++w) M = fmaxf(M, s_ml[w * 16 + r]);
    float L = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < 4 * kG; ++w) {
        const float f = exp2f(s_ml[w * 16 + r] - M);
        L += s_ml[64 * kG + w * 16 + r] * f;
        const float4 x = *reinterpret_cast<const float4*>(area + (w * 16 + r) * kM + d);
        o.x += f * x.x; o.y += f * x.y; o.z += f * x.z; o.w += f * x.w;
      }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    const float lse2 = L > 0.f ? M + __log2f(L) : -INFINITY;
    if (kCluster) {
      *reinterpret_cast<float4*>(s_part + r * D + d) = o;
      if (d == 0) s_plse[r] = lse2;
    } else if (split) {
      const long long pi = part0 + s;
      *reinterpret_cast<float4*>(p.part_o + pi * 16 * D + i) = o;
      if (d == 0) p.part_lse[pi * 16 + r] = lse2;
    } else {
      store_out(p, y, rc, r, d, o, lse2);
    }
  }
  if constexpr (kCluster) {
    // Every CTA of the cluster (the row's P parts) merges a slice of the row's outputs from
    // the P partials in the cluster's shared memory (DSMEM), then waits until the others
    // are done reading its own before it exits.
    cluster_sync_all();  // partials written (release) and visible (acquire)
    const int n4 = rows_here * D / 4;
    const int per = (n4 + P - 1) / P;
    const int i4 = s * per + tid;
    if (tid < per && i4 < n4) {
      const int i = i4 * 4;
      const int r = i / D, d = i % D;
      float M = -INFINITY, den = 0.f;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      fold_parts<16>(P, M, den, o, [&](int k, float& l, float4& x) {
        l = *cluster_map(s_plse + r, k);
        x = *reinterpret_cast<const float4*>(cluster_map(s_part + r * D + d, k));
      });
      const float inv = den > 0.f ? 1.f / den : 0.f;
      o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
      store_out(p, y, rc, r, d, o, den > 0.f ? M + __log2f(den) : -INFINITY);
    }
    cluster_sync_all();  // no CTA leaves while another may still read its partial
    return;
  }
  if (!split) return;

  // Publish the partial (barrier, one release by thread 0); the last of the row's P CTAs
  // merges.
  __syncthreads();
  if (tid == 0)
    *s_flag = count_in_last(p.counters + (static_cast<int64_t>(b) * p.hkv + h) * gridDim.z + y, P);
  __syncthreads();
  if (*s_flag == 0) return;

  // Merge: each thread folds the P partials of its outputs, 16 at a time (loads together).
  for (int i4 = tid; i4 < rows_here * D / 4; i4 += kThreads) {
    const int i = i4 * 4;
    const int r = i / D, d = i % D;
    float M = -INFINITY, den = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k0 = 0; k0 < P; k0 += 16) {
      fold_parts<16>(min(16, P - k0), M, den, o, [&](int j, float& l, float4& x) {
        const long long pi = part0 + k0 + j;
        l = __ldcg(p.part_lse + pi * 16 + r);
        x = __ldcg(reinterpret_cast<const float4*>(p.part_o + pi * 16 * D + i));
      });
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    store_out(p, y, rc, r, d, o, den > 0.f ? M + __log2f(den) : -INFINITY);
  }
}

}  // namespace kvr

// Two CTAs per SM (10 warps) up to head dim 128: the register cap that allows it matters
// more than a deeper ring with one CTA. Head dim 256 needs the registers.
#define KVR_DECODE_KERNEL(NAME, KV, D)                                                          \
  extern "C" __global__ void __launch_bounds__(kvr::kDecodeThreads, (D) <= 128 ? 2 : 1)          \
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

// The short-batch kernels: 3 stages per group of 4 warps, KVR_KV_SDECODE_GROUPS groups (two
// CTAs per SM with one group, one with two).
#define KVR_SDECODE_KERNEL(NAME, KV, D)                                                         \
  extern "C" __global__ void __launch_bounds__(                                                 \
      kvr::kConsumerThreads * KVR_KV_SDECODE_GROUPS(D), KVR_KV_SDECODE_GROUPS(D) == 1 && (D) <= 128 ? 2 : 1) \
      kvr_kv_sdecode_##NAME##_d##D(const __grid_constant__ kvr::DecodeParams p) {                \
    kvr::sdecode_body<KV, D, KVR_KV_SDECODE_STAGES, false, KVR_KV_SDECODE_GROUPS(D)>(p);         \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(                                                 \
      kvr::kConsumerThreads * KVR_KV_SDECODE_GROUPS(D), KVR_KV_SDECODE_GROUPS(D) == 1 && (D) <= 128 ? 2 : 1) \
      kvr_kv_cdecode_##NAME##_d##D(const __grid_constant__ kvr::DecodeParams p) {                \
    kvr::sdecode_body<KV, D, KVR_KV_SDECODE_STAGES, true, KVR_KV_SDECODE_GROUPS(D)>(p);          \
  }

// The batch kernel: the split kernel with one group of 4 warps per CTA (two CTAs per SM up
// to head dim 128, so one CTA's prologue and tail overlap another's stream), for batches of
// more rows than the split kernel's wave.
#define KVR_BDECODE_KERNEL(NAME, KV, D)                                                         \
  extern "C" __global__ void __launch_bounds__(kvr::kConsumerThreads, (D) <= 128 ? 2 : 1)     \
      kvr_kv_bdecode_##NAME##_d##D(const __grid_constant__ kvr::DecodeParams p) {                \
    kvr::sdecode_body<KV, D, KVR_KV_SDECODE_STAGES, false, 1>(p);                                \
  }

KVR_SDECODE_KERNEL(f16, __half, 64)
KVR_SDECODE_KERNEL(f16, __half, 80)
KVR_SDECODE_KERNEL(f16, __half, 96)
KVR_SDECODE_KERNEL(f16, __half, 128)
KVR_SDECODE_KERNEL(f16, __half, 256)
KVR_SDECODE_KERNEL(bf16, __nv_bfloat16, 64)
KVR_SDECODE_KERNEL(bf16, __nv_bfloat16, 80)
KVR_SDECODE_KERNEL(bf16, __nv_bfloat16, 96)
KVR_SDECODE_KERNEL(bf16, __nv_bfloat16, 128)
KVR_SDECODE_KERNEL(bf16, __nv_bfloat16, 256)

KVR_BDECODE_KERNEL(f16, __half, 64)
KVR_BDECODE_KERNEL(f16, __half, 80)
KVR_BDECODE_KERNEL(f16, __half, 96)
KVR_BDECODE_KERNEL(f16, __half, 128)
KVR_BDECODE_KERNEL(f16, __half, 256)
KVR_BDECODE_KERNEL(bf16, __nv_bfloat16, 64)
KVR_BDECODE_KERNEL(bf16, __nv_bfloat16, 80)
KVR_BDECODE_KERNEL(bf16, __nv_bfloat16, 96)
KVR_BDECODE_KERNEL(bf16, __nv_bfloat16, 128)
KVR_BDECODE_KERNEL(bf16, __nv_bfloat16, 256)
