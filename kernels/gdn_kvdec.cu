// Single-token decode of the KV-only rows of pools with KV-only mode (Gated DeltaNet's delta
// rule and the additive rule of Mamba-2 / linear attention):
//   kvr_gdn_kvdec_<state>_d<dk>_v<dv>   NS = p.tiles CTAs per (batch row, value head) (a
//                                       thread-block cluster along x on sm_90), each over a
//                                       contiguous share of the entries
// It runs first in such a pool's decode step (src/linear/replay/cuda.rs), and decides each
// row from the metadata, so that the launch sequence stays right whatever the rows' modes
// when a captured graph replays it:
//  - KV-only rows that stay KV-only: the step (below), metadata advanced;
//  - KV-only rows whose entries reach the threshold: their state from the entries, ring
//    empty, replay mode; the step itself is then the replay kernels'. The state takes over
//    the entries' memory, so the cluster first copies every entry into its shared memory
//    (each CTA its share) and each CTA computes dv / NS rows of the state from all of them
//    (distributed shared memory): NS >= dv dk / 8192 (8 x 8 outputs a thread at most);
//  - other rows (and unused ones): nothing.
// The replay kernels that follow (kvr_gdn_fdecode_*, kvr_gdn_dprep_* + kvr_gdn_wdecode_*)
// skip the rows in KV-only mode (`kv_split` 1: they read the record before anything else).
//
// A KV-only sequence of n entries (u_j [dv], k_j [dk], g_j; in the memory of its unused state,
// per value head: u [cap][dv], k [cap][dk], g [cap]) has, with w_j = e^{g_{j+1} + .. + g_{n-1}},
//   S_{t-1} x = sum_j w_j (k_j . x) u_j          for x in {q_t, k_t},
// u_t = beta (v_t - e^{g_t} S_{t-1} k_t) (delta rule; additive: beta v_t), and
// y_t = e^{g_t} S_{t-1} q_t + (k_t . q_t) u_t. Its bytes are the entries once, fewer than a
// state's below dk entries; the kernel's job is to have them all in flight at once:
//  (1) before the metadata: q, k, v, (g, beta), the gate inputs and every possible entry's
//      decay; then each CTA copies its share of the entries' u and k rows into shared memory
//      (cp.async, 16 bytes a thread and copy; at small batches a fixed share, whose first
//      `p.stages` entries of the row are copied before the metadata too);
//  (2) meanwhile q and k normalized and the decays' suffix sums (a block scan);
//  (3) the key products, an entry a team of dk / 16 lanes, the warps sharing the entries
//      evenly (kv_sums);
//  (4) the u rows weighted by both products, a warp per quarter of the entries, dv/32
//      contiguous columns a lane; sums over the warps in shared memory, then over the
//      cluster's CTAs through distributed shared memory, each CTA finishing dv / NS columns;
//  (5) the last CTA of a row (arrival counter in the record) writes the metadata.
#include "gdn_common.cuh"

namespace kvr {
namespace gdn {

constexpr int kKdThreads = KVR_GDN_KVDEC_THREADS;
constexpr int kKdWarps = kKdThreads / 32;
static_assert(kKdThreads == 128 && KVR_GDN_KVONLY_MAX <= 2 * kKdThreads, "two decays a thread");

// N contiguous entry elements (N * size a power of two up to 16 bytes, or 32 for 8 f32) of
// dtype dt at p (shared or distributed shared memory).
template <int N>
__device__ __forceinline__ void ld_ent(const char* p, int dt, float* d) {
  if (dt == KVR_DT_F32)
    ld_vec<float, N>(reinterpret_cast<const float*>(p), d);
  else if (dt == KVR_DT_F16)
    ld_vec<__half, N>(reinterpret_cast<const __half*>(p), d);
  else
    ld_vec<__nv_bfloat16, N>(reinterpret_cast<const __nv_bfloat16*>(p), d);
}

// Exclusive suffix sums of 2 * kKdThreads values, thread t holding x0 = element 2 t and x1 =
// element 2 t + 1: returns (sum of the elements after 2 t, after 2 t + 1). `tot`: shared
// scratch of kKdWarps floats; one CTA barrier.
__device__ __forceinline__ float2 block_suffix2(float x0, float x1, float* tot, int lane, int warp) {
  const float2 w = warp_suffix(x0 + x1, lane);  // (pairs after this one in the warp, warp total)
  if (lane == 0) tot[warp] = w.y;
  __syncthreads();
  float after = w.x;
#pragma unroll
  for (int i = 0; i < kKdWarps; ++i) after += i > warp ? tot[i] : 0.f;
  return make_float2(after + x1, after);
}

// Copies entries [j0, j1) of a head (u rows of `ub` bytes, k rows of `kb`) into the slots
// j - lo of a share in shared memory at `dst`: u rows first, k rows after `room` u rows;
// cp.async, one commit group.
__device__ __forceinline__ void kv_copy_share(char* dst, const char* eu, const char* ek, int lo, int j0, int j1,
                                              int room, int kb, int ub) {
  const int tid = threadIdx.x, cnt = j1 - j0;
  const char* gu = eu + static_cast<int64_t>(j0) * ub;
  const char* gk = ek + static_cast<int64_t>(j0) * kb;
  char* su = dst + (j0 - lo) * ub;
  char* sk = dst + room * ub + (j0 - lo) * kb;
  for (int i = tid * 16; i < cnt * ub; i += kKdThreads * 16) cp_async_16(su + i, gu + i, 16);
  for (int i = tid * 16; i < cnt * kb; i += kKdThreads * 16) cp_async_16(sk + i, gk + i, 16);
  cp_async_commit();
}

// Copies the same entries as kv_copy_share with plain loads and shared stores, each thread the
// bytes it copied there (a materialization's staging, which the cluster's other CTAs read
// through distributed shared memory: ordered by the cluster barrier alone, as a race checker
// sees it too; it runs once per sequence, layer and head).
__device__ __forceinline__ void kv_copy_share_plain(char* dst, const char* eu, const char* ek, int lo, int cnt,
                                                    int room, int kb, int ub) {
  const int tid = threadIdx.x;
  const char* gu = eu + static_cast<int64_t>(lo) * ub;
  const char* gk = ek + static_cast<int64_t>(lo) * kb;
  char* sk = dst + room * ub;
  for (int i = tid * 16; i < cnt * ub; i += kKdThreads * 16)
    *reinterpret_cast<uint4*>(dst + i) = __ldcg(reinterpret_cast<const uint4*>(gu + i));
  for (int i = tid * 16; i < cnt * kb; i += kKdThreads * 16)
    *reinterpret_cast<uint4*>(sk + i) = __ldcg(reinterpret_cast<const uint4*>(gk + i));
}

// Steps (3) and (4) of a CTA's cnt entries (E: their dtype), u rows at `su`, k rows at `sk`:
//  (3) k_j . q and k_j . k by teams of TS = DK / 16 lanes, an entry a team (32 / TS entries a
//      warp at a time, the warps' turns interleaved so that they share the entries evenly):
//      16 keys a lane, as the 16-byte chunks j, j + TS, .. of the row (lane j of the team;
//      conflict-free shared loads), the team's sums met by shuffles; weighted by w_j
//      (e^{suf[lo + j]}) into coef;
//  (4) after a CTA barrier, sum_j coef_j u_j, warp w taking entries w, w + 4, .., dv / 32
//      contiguous columns a lane, into red[warp] (q's sums, then k's).
template <typename E, int DK, int DV>
__device__ __forceinline__ void kv_sums(const char* su, const char* sk, const float* qn, const float* kn,
                                        const float* suf, int lo, int cnt, float2* coef, float (*red)[2][DV],
                                        int lane, int warp) {
  constexpr int TS = DK / 16, EW = 32 / TS;       // lanes a team, entries a warp's turn
  constexpr int V = 16 / sizeof(E), NC = 16 / V;  // elements a chunk, chunks a lane
  constexpr int CPL = DV / 32;
  static_assert(TS >= 1 && TS <= 32 && 32 % TS == 0, "16 keys a lane");
  {
    const int j = lane % TS, t = lane / TS;
    float q[16], k[16];
#pragma unroll
    for (int i = 0; i < NC; ++i)
#pragma unroll
      for (int v = 0; v < V; ++v) {
        q[i * V + v] = qn[(j + TS * i) * V + v];
        k[i * V + v] = kn[(j + TS * i) * V + v];
      }
    for (int e0 = warp * EW; e0 < cnt; e0 += kKdWarps * EW) {
      const int e = e0 + t;
      float pq = 0.f, pk = 0.f;
      if (e < cnt) {
        const E* row = reinterpret_cast<const E*>(sk) + static_cast<int64_t>(e) * DK;
#pragma unroll
        for (int i = 0; i < NC; ++i) {
          float x[V];
          ld_vec<E, V>(row + (j + TS * i) * V, x);
#pragma unroll
          for (int v = 0; v < V; ++v) {
            pq = fmaf(x[v], q[i * V + v], pq);
            pk = fmaf(x[v], k[i * V + v], pk);
          }
        }
      }
#pragma unroll
      for (int o = TS / 2; o > 0; o >>= 1) {
        pq += __shfl_xor_sync(0xffffffffu, pq, o);
        pk += __shfl_xor_sync(0xffffffffu, pk, o);
      }
      if (j == 0 && e < cnt) {
        const float w = expf(suf[lo + e]);
        coef[e] = make_float2(w * pq, w * pk);
      }
    }
  }
  __syncthreads();  // coef
  float aq[CPL], ak[CPL];
#pragma unroll
  for (int r = 0; r < CPL; ++r) aq[r] = ak[r] = 0.f;
  const E* ub = reinterpret_cast<const E*>(su) + lane * CPL;
  int e = warp;
  for (; e + 3 * kKdWarps < cnt; e += 4 * kKdWarps) {
    float x[4][CPL];
    float2 cf[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ld_vec<E, CPL>(ub + (e + i * kKdWarps) * DV, x[i]);
      cf[i] = coef[e + i * kKdWarps];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < CPL; ++r) {
        aq[r] = fmaf(cf[i].x, x[i][r], aq[r]);
        ak[r] = fmaf(cf[i].y, x[i][r], ak[r]);
      }
  }
  for (; e < cnt; e += kKdWarps) {
    float x[CPL];
    ld_vec<E, CPL>(ub + e * DV, x);
    const float2 cf = coef[e];
#pragma unroll
    for (int r = 0; r < CPL; ++r) {
      aq[r] = fmaf(cf.x, x[r], aq[r]);
      ak[r] = fmaf(cf.y, x[r], ak[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < CPL; ++r) {
    red[warp][0][lane * CPL + r] = aq[r];
    red[warp][1][lane * CPL + r] = ak[r];
  }
}

// This CTA's rows [s R, (s + 1) R) of the state S = sum_j w_j u_j k_j^T of a head whose n
// entries are in the shared memory of the cluster's NS CTAs (CTA o: entries [o per, (o + 1)
// per), u rows then k rows of `room` each, at the same offset `smem` in every CTA), w_j in
// `w`. R = DV / NS; each thread accumulates TR rows x 8 keys (R DK = 1024 TR), then stores
// them, rounded to the state dtype, in the pool's layout (p.vmajor). Call once every CTA's
// copy has landed (a cluster barrier); the caller's next cluster barrier ends the reads.
template <typename SD, int DK, int DV, int TR>
__device__ void kv_state_rows(const StepParams& p, char* head, int n, int per, int room, int s, int NS,
                              const char* smem, const float* w) {
  const int tid = threadIdx.x, dt = p.entry_dtype, ee = dt == KVR_DT_F32 ? 4 : 2;
  constexpr int KT = DK / 8;
  const int kt = tid % KT, r0 = s * (DV / NS) + (tid / KT) * TR;
  float acc[TR][8];
#pragma unroll
  for (int r = 0; r < TR; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
  for (int o = 0; o < NS; ++o) {
    const char* base = NS > 1 ? cluster_map(smem, o) : smem;
    const int j0 = o * per, j1 = min(n, j0 + per);
    for (int j = j0; j < j1; ++j) {
      float u[TR], k[8];
      ld_ent<TR>(base + ((j - j0) * DV + r0) * ee, dt, u);
      ld_ent<8>(base + (room * DV + (j - j0) * DK + kt * 8) * ee, dt, k);
      const float wj = w[j];
#pragma unroll
      for (int r = 0; r < TR; ++r) {
        const float wu = wj * u[r];
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(wu, k[c], acc[r][c]);
      }
    }
  }
  if (NS > 1) cluster_sync_all();  // every CTA's reads of the others' entries are done
  SD* hs = reinterpret_cast<SD*>(head);
  if (p.vmajor) {
#pragma unroll
    for (int r = 0; r < TR; ++r) st_vec<SD, 8>(hs + static_cast<int64_t>(r0 + r) * DK + kt * 8, acc[r]);
  } else {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      float col[TR];
#pragma unroll
      for (int r = 0; r < TR; ++r) col[r] = acc[r][c];
      st_vec<SD, TR>(hs + static_cast<int64_t>(kt * 8 + c) * DV + r0, col);
    }
  }
}

template <typename SD, int DK, int DV>
__device__ void kvdec_body(const StepParams& p) {
  constexpr int QPT = (DK + kKdThreads - 1) / kKdThreads, FPT = (DV + kKdThreads - 1) / kKdThreads;
  __shared__ float qn[DK], kn[DK];
  __shared__ float suf[2 * kKdThreads];
  __shared__ float part[4][kKdWarps];
  extern __shared__ __align__(16) char kd_dyn[];
  // Launched as a programmatic dependent of the stream's previous kernel: everything here may
  // be its output.
  pdl_wait();
  pdl_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int NS = p.tiles, s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int cw = DV / NS, c0 = s * cw;  // the columns this CTA finishes
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  const Tensor& out = p.out;
  if (seq < 0) return;  // (the replay kernels write the zeros of unused rows)
  const int dt = p.entry_dtype, ee = dt == KVR_DT_F32 ? 4 : 2;
  const int kh = h / (p.hv / p.hk);
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  char* head = p.state + (static_cast<int64_t>(seq) * p.seq_stride + static_cast<int64_t>(h) * DK * DV) *
                             static_cast<int64_t>(sizeof(SD));
  char* eu = head;                                             // u [cap][DV]
  char* ek = head + static_cast<int64_t>(p.kv_cap) * DV * ee;  // k [cap][DK]
  float* eg = reinterpret_cast<float*>(head + static_cast<int64_t>(p.kv_cap) * (DV + DK) * ee);

  // (1) Everything that does not depend on the metadata.
  const int4 m4 = __ldcg(reinterpret_cast<const int4*>(meta));
  const int conv_end = __ldcg(meta + kMetaConvEnd);
  float g0 = tid * 2 < p.thr ? eg[tid * 2] : 0.f, g1 = tid * 2 + 1 < p.thr ? eg[tid * 2 + 1] : 0.f;
  float qr[QPT], kr[QPT];
#pragma unroll
  for (int i = 0; i < QPT; ++i) {
    const int d = tid + i * kKdThreads;
    qr[i] = d < DK ? ldx(p.q.p, p.q.dtype, b * p.q.s[0] + kh * p.q.s[2] + d * p.q.s[3]) : 0.f;
    kr[i] = d < DK ? ldx(p.k.p, p.k.dtype, b * p.k.s[0] + kh * p.k.s[2] + d * p.k.s[3]) : 0.f;
  }
  float vr[FPT];
  EpilogueIn ei[FPT];
#pragma unroll
  for (int i = 0; i < FPT; ++i) {
    const int c = c0 + tid + i * kKdThreads;
    const bool in = tid + i * kKdThreads < cw;
    vr[i] = in ? ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + c * p.v.s[3]) : 0.f;
    ei[i] = in ? epilogue_in(p, b, 0, h, c) : EpilogueIn{0.f, 0.f};
  }
  const float2 gb = token_gb(p, b, 0, h);
  // Shares of the entries: at small batches, where the launch is a chain of latencies, fixed
  // ones of P = ceil(thr / NS), of which the first `p.stages` entries of the row (the host's
  // count, or all) are copied before the metadata arrives (entries past n are never read) and
  // the rest after it; otherwise (p.stages 0) ceil(n / NS), copied after the metadata. Room
  // for P either way.
  const int E = p.stages;
  const bool early = E > 0;
  const int P = (p.thr + NS - 1) / NS;
  if (early) {
    const int j1 = max(s * P, min(min(p.thr, E), s * P + P));
    kv_copy_share(kd_dyn, eu, ek, s * P, s * P, j1, P, DK * ee, DV * ee);
  }
  const int n = m4.z;
  const Place pl = placement(p, m4.x, m4.y, n);
  // Rows that are not KV-only are the replay kernels' (the same for every CTA of a cluster:
  // one row and head).
  if (m4.x != kModeKvOnly) {
    cp_async_wait<0>();  // (no copy may land after the CTA is gone)
    return;
  }
  const int per = early ? P : (n + NS - 1) / NS, lo = min(n, s * per), cnt = min(n, lo + per) - lo;
  // (a materialization copies its share below, by plain loads and stores)
  if (!pl.flush && (!early || lo + cnt > max(lo, E)))
    kv_copy_share(kd_dyn, eu, ek, lo, early ? max(lo, E) : lo, lo + cnt, P, DK * ee, DV * ee);
  char* su = kd_dyn;
  char* sk = kd_dyn + P * DV * ee;
  // The k rows' region also holds the warps' partial sums once the key products are done.
  const int kroom = max(P * DK * ee, kKdWarps * 2 * DV * 4);
  float2* coef = reinterpret_cast<float2*>(sk + kroom);
  float(*red)[2][DV] = reinterpret_cast<float(*)[2][DV]>(sk);

  // (2) Norms of q and k, and the decays' suffix sums, while the copies land.
  {
    float nq = 0.f, nk = 0.f;
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
      nq += qr[i] * qr[i];
      nk += kr[i] * kr[i];
    }
    nq = warp_sum(nq);
    nk = warp_sum(nk);
    if (lane == 0) {
      part[0][warp] = nq;
      part[1][warp] = nk;
    }
  }
  if (tid * 2 >= n) g0 = 0.f;
  if (tid * 2 + 1 >= n) g1 = 0.f;
  const float2 sf = block_suffix2(g0, g1, part[3], lane, warp);  // its barrier covers part[0..1]
  if (pl.flush) {
    // The entries reach the threshold: the state from them (every CTA of the cluster copied its
    // share of the n = thr entries), the ring empty, replay mode.
    suf[2 * tid] = expf(sf.x);
    suf[2 * tid + 1] = expf(sf.y);
    // The share again by plain loads and stores (the early copies landed first): the other
    // CTAs read it through distributed shared memory.
    cp_async_wait<0>();
    kv_copy_share_plain(kd_dyn, eu, ek, lo, cnt, P, DK * ee, DV * ee);
    __syncthreads();
    if (NS > 1) cluster_sync_all();  // every share in shared memory: the state may take the memory over
    // State rows a thread (8 keys each): 1..8 (the host's split keeps NS in
    // [kvdec_min_split, dv dk / 1024]).
    switch (DV * DK / (NS * 8 * kKdThreads)) {
      case 1:
        kv_state_rows<SD, DK, DV, 1>(p, head, n, per, P, s, NS, kd_dyn, suf);
        break;
      case 2:
        kv_state_rows<SD, DK, DV, 2>(p, head, n, per, P, s, NS, kd_dyn, suf);
        break;
      case 4:
        kv_state_rows<SD, DK, DV, 4>(p, head, n, per, P, s, NS, kd_dyn, suf);
        break;
      default:
        kv_state_rows<SD, DK, DV, 8>(p, head, n, per, P, s, NS, kd_dyn, suf);
        break;
    }
    __syncthreads();
    // The last CTA of the row (of hv * NS: all have read the record) marks it: replay mode,
    // empty ring. The replay kernels then decode it and end the step.
    if (tid == 0 && count_in_last(meta + kMetaArrive, p.hv * NS)) {
      meta[kMetaMode] = kModeReplay;
      meta[kMetaStart] = 0;
      meta[kMetaH] = 0;
    }
    return;
  }
  suf[2 * tid] = sf.x;
  suf[2 * tid + 1] = sf.y;
  {
    float nq = 0.f, nk = 0.f;
#pragma unroll
    for (int w = 0; w < kKdWarps; ++w) {
      nq += part[0][w];
      nk += part[1][w];
    }
    const float fq = (p.l2norm ? 1.f / sqrtf(nq + 1e-6f) : 1.f) * p.scale;
    const float fk = p.l2norm ? 1.f / sqrtf(nk + 1e-6f) : 1.f;
    float kq = 0.f;
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
      const int d = tid + i * kKdThreads;
      if (d < DK) {
        const float x = qr[i] * fq, y = roundx(dt, kr[i] * fk);  // k as it is buffered
        qn[d] = x;
        kn[d] = y;
        kq += x * y;
      }
    }
    kq = warp_sum(kq);
    if (lane == 0) part[2][warp] = kq;
  }
  cp_async_wait<0>();
  __syncthreads();  // entries, qn, kn, suf, part[2]

  // (3) and (4), the entries' dtype fixed.
  if (dt == KVR_DT_F32)
    kv_sums<float, DK, DV>(su, sk, qn, kn, suf, lo, cnt, coef, red, lane, warp);
  else if (dt == KVR_DT_F16)
    kv_sums<__half, DK, DV>(su, sk, qn, kn, suf, lo, cnt, coef, red, lane, warp);
  else
    kv_sums<__nv_bfloat16, DK, DV>(su, sk, qn, kn, suf, lo, cnt, coef, red, lane, warp);
  __syncthreads();
  // This CTA's sums over its entries: into red[0] (each column read and written by one thread).
#pragma unroll
  for (int i = 0; i < FPT; ++i) {
    const int c = tid + i * kKdThreads;
    if (c < DV) {
      float x = red[0][0][c], z = red[0][1][c];
#pragma unroll
      for (int w = 1; w < kKdWarps; ++w) {
        x += red[w][0][c];
        z += red[w][1][c];
      }
      red[0][0][c] = x;
      red[0][1][c] = z;
    }
  }
  if (NS > 1)
    cluster_sync_all();  // every CTA's sums written (release) and visible (acquire)
  else
    __syncthreads();

  // (5) The new entry and the outputs of columns [c0, c0 + cw).
  float kq = 0.f;
#pragma unroll
  for (int w = 0; w < kKdWarps; ++w) kq += part[2][w];
  const float a = expf(gb.x), beta = gb.y;
  const bool delta = p.rule == KVR_GDN_RULE_DELTA;
#pragma unroll
  for (int i = 0; i < FPT; ++i) {
    const int j = tid + i * kKdThreads, c = c0 + j;
    if (j < cw) {
      float hq = 0.f, hk = 0.f;
      if (NS == 1) {
        hq = red[0][0][c];
        hk = red[0][1][c];
      } else {
        // (every remote load issued before the sums: NS <= 8)
        float xq[8], xk[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          xq[r] = r < NS ? *cluster_map(&red[0][0][c], r) : 0.f;
          xk[r] = r < NS ? *cluster_map(&red[0][1][c], r) : 0.f;
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          hq += xq[r];
          hk += xk[r];
        }
      }
      const float u = delta ? beta * (vr[i] - a * hk) : beta * vr[i];
      const float y = a * hq + kq * u;
      stx(out.p, out.dtype, b * out.s[0] + h * out.s[2] + c * out.s[3], epilogue(p, ei[i], vr[i], y));
      stx(eu, dt, static_cast<int64_t>(n) * DV + c, u);
    }
  }
  if (s == 0) {
    for (int d = tid; d < DK; d += kKdThreads) stx(ek, dt, static_cast<int64_t>(n) * DK + d, kn[d]);
    if (tid == 0) eg[n] = gb.x;
  }
  if (p.conv_dim > 0) conv_window_share(p, b, seq, h, s, conv_end, tid, kKdThreads);
  if (NS > 1) cluster_sync_all();  // no CTA leaves while another may still read its sums
  __syncthreads();
  // The row's last CTA (of hv * NS; all have read the record by now) advances it; the
  // replay kernels that follow see the row in KV-only mode and skip it.
  if (tid == 0 && count_in_last(meta + kMetaArrive, p.hv * NS))
    finish_meta(p, meta, m4.x, m4.y, n, m4.w, conv_end, pl);
}

}  // namespace gdn
}  // namespace kvr

// Registers for 5 CTAs per SM (dk = dv = 128, bf16 entries, threshold 127, 2 CTAs a head: 33
// KiB of shared memory each, 6 by that).
#define KVR_GDN_KVDEC(SD, SN, DK, DV)                                                           \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_KVDEC_THREADS, 6)                        \
      kvr_gdn_kvdec_##SN##_d##DK##_v##DV(const __grid_constant__ kvr::gdn::StepParams p) {      \
    kvr::gdn::kvdec_body<SD, DK, DV>(p);                                                        \
  }
#define KVR_GDN_KVDEC_SHAPE(DK, DV) KVR_GDN_KVDEC(float, f32, DK, DV) KVR_GDN_KVDEC(__nv_bfloat16, bf16, DK, DV)
KVR_GDN_KVDEC_SHAPE(64, 64)
KVR_GDN_KVDEC_SHAPE(128, 128)
KVR_GDN_KVDEC_SHAPE(256, 256)
KVR_GDN_KVDEC_SHAPE(128, 64)
#undef KVR_GDN_KVDEC_SHAPE
#undef KVR_GDN_KVDEC

