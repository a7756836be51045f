// Gated DeltaNet (and additive-rule: Mamba-2, linear attention) speculative verify, streaming form:
//   kvr_gdn_sverify_<state>_<k|v>_d<dk>       T = 1..8 draft tokens per sequence in one launch,
//                                             in replay pools without KV-only mode, delta rule
//   kvr_gdn_sverify_<state>_<k|v>_d<dk>_add   the same for the additive rule, compiled apart
//                                             (src/linear/replay/cuda.rs picks one:
//                                             `verify_launch`)
//
// The structure of gdn_stream.cu's decode, for T tokens: a CTA owns one tile of R value rows
// of one (sequence, value head) and first issues the bulk copy of its state tile into shared
// memory; while it flies, the drafts' q and k are normalized (a warp per draft), their key
// products formed, the ring's u rows of the tile and decays loaded. The state is read once
// for all T drafts: no per-draft state, nothing written unless the ring must flush.
//
// Math, per value row v of the tile, with the history H(x) = e^G (S x)[v] + sum_j w_j (k_j . x)
// u_j[v] (checkpoint S, ring entries j < h, w_j the decays of the entries newer than j) and
// gam_s = g_0 + ... + g_s the drafts' cumulative log decays (math::verify_head):
//   u_s = beta_s (v_s - e^{gam_s} H(k_s)) - sum_{s' < s} beta_s e^{gam_s - gam_s'} (k_s . k_s') u_s'
//   y_s = e^{gam_s} H(q_s) + sum_{s' <= s} e^{gam_s - gam_s'} (k_s' . q_s) u_s'
// The additive rule (Mamba-2, linear attention) has u_s = beta_s v_s (beta: Mamba-2's dt) and
// needs no H(k_s): only S q is read out. Outputs pass the skip and gate epilogue.
// The u_s go into the ring after the committed entries; the metadata records T pending drafts
// (kvr_gdn_commit keeps the accepted prefix). When h + 2T > L the ring flushes first: the
// tile's state e^G S + sum_j w_j u_j k_j^T is written back, and the drafts start a new ring.
//
// The bookkeeping is done in the launch: the first tile of a head writes the drafts' keys and
// decays (outside a flush nobody reads those slots), and the last CTA of a sequence to arrive
// writes the metadata (in a flush also the keys and decays, which overwrite the oldest
// entries every CTA of the sequence reads).
#include "gdn_stream.cuh"

namespace kvr {
namespace gdn {

__device__ __forceinline__ int vprep_floats(int dk, int L, int Tm) {
  return kvr_gdn_vprep_record_layout(dk, L, Tm).floats;
}

// Per (batch row, key head) of a verify launch (grid B x Hk, kStreamThreads threads): the
// drafts' q and k normalized (k rounded to the entry dtype, as buffered), their products
// with each other and with the ring's keys. Every value head and tile of the group reads them.
template <int DK>
__device__ void vprep_body(const StepParams& p) {
  __shared__ float qs[kMaxT * DK], ks[kMaxT * DK];
  pdl_launch_dependents();
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int T = p.t, Tm = p.max_drafts;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int L = p.l, Lc = L > 0 ? L : 1;
  const int ee = p.entry_dtype == 0 ? 4 : 2;
  const int b = blockIdx.x / p.hk, kh = blockIdx.x % p.hk;
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  if (seq < 0) return;
  auto key = [&](int c) { return (c / VW) * (32 * VW) + lane * VW + c % VW; };
  float* sc = p.scratch + static_cast<int64_t>(b * p.hk + kh) * vprep_floats(DK, L, Tm);
  float* pr = sc + 2 * Tm * DK;  // entry products [2 Tm][Lc]
  float* cc = pr + 2 * Tm * Lc;  // draft products [2][Tm][Tm]
  const int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const int start = __ldcg(meta + kMetaStart), nbuf = __ldcg(meta + kMetaH);
  if (warp < T) {
    const int s = warp;
    const int64_t qo = b * p.q.s[0] + s * p.q.s[1] + kh * p.q.s[2];
    const int64_t ko = b * p.k.s[0] + s * p.k.s[1] + kh * p.k.s[2];
    float q[KL], k[KL];
#pragma unroll
    for (int c = 0; c < KL; ++c) {
      q[c] = ldx(p.q.p, p.q.dtype, qo + key(c) * p.q.s[3]);
      k[c] = ldx(p.k.p, p.k.dtype, ko + key(c) * p.k.s[3]);
    }
    normalize_qk<KL>(p, q, k, true);
#pragma unroll
    for (int c = 0; c < KL; ++c) {
      qs[s * DK + key(c)] = q[c];
      ks[s * DK + key(c)] = k[c];
      sc[s * DK + key(c)] = q[c];
      sc[(Tm + s) * DK + key(c)] = k[c];
    }
  }
  // The first entry keys, before the barrier.
  auto entry_k = [&](int j) -> const char* {
    return p.ring_k + ((static_cast<int64_t>(seq) * Lc + (start + j) % Lc) * p.hk + kh) * DK * ee;
  };
  float kn[KL];
  if (warp < nbuf) {
#pragma unroll
    for (int c = 0; c < KL; c += VW) ld_entry<VW>(entry_k(warp), p.entry_dtype, key(c), &kn[c]);
  }
  __syncthreads();
  // Draft pairs: k_s . k_s' (s' < s) and k_s' . q_s (s' <= s), a warp per pair.
  draft_pairs<DK>(qs, ks, T, warp, kStreamWarps, lane, cc, Tm);
  // Entry products: a warp per entry, the next entry's key loaded ahead, four sums per reduce4.
  for (int j = warp; j < nbuf; j += kStreamWarps) {
    float kj[KL];
#pragma unroll
    for (int c = 0; c < KL; ++c) kj[c] = kn[c];
    if (j + kStreamWarps < nbuf) {
#pragma unroll
      for (int c = 0; c < KL; c += VW) ld_entry<VW>(entry_k(j + kStreamWarps), p.entry_dtype, key(c), &kn[c]);
    }
    dots_2t<KL, VW, DK>(kj, qs, ks, T, lane, pr, pr + Tm * Lc, Lc, j);
  }
}

// ADD: the additive rule (Mamba-2, linear attention; the `_add` kernels), else the delta rule.
// Compiled apart so that each rule's kernel carries none of the other's code (the delta
// kernel with both rules behind runtime branches verified 3-10 % slower on the H200).
template <typename SD, bool VM, int DK, bool ADD>
__device__ void sverify_body(const StepParams& p) {
  extern __shared__ __align__(16) unsigned char sm[];
  constexpr int ES = sizeof(SD);
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int R = p.tv, T = p.t;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = p.hv / p.hk;
  const int dv = p.dv, L = p.l;
  const int per_seq = p.hv * p.tiles;
  const Tensor& out = p.out;
  constexpr bool delta = !ADD;
  const int ee = p.entry_dtype == 0 ? 4 : 2;
  const kvr_gdn_verify_smem lay = kvr_gdn_verify_smem_layout(VM, DK, R, ES, L, ee, T);
  unsigned char* st = sm;
  unsigned char* ut = sm + lay.ut;
  float* qs = reinterpret_cast<float*>(sm + lay.qs);
  float* ks = reinterpret_cast<float*>(sm + lay.ks);
  float* sq = reinterpret_cast<float*>(sm + lay.sq);
  float* sk = reinterpret_cast<float*>(sm + lay.sk);
  float* vt = reinterpret_cast<float*>(sm + lay.vt);
  float* aq = reinterpret_cast<float*>(sm + lay.aq);
  float* ak = reinterpret_cast<float*>(sm + lay.ak);
  float* wg = reinterpret_cast<float*>(sm + lay.wg);
  float* gs = reinterpret_cast<float*>(sm + lay.gs);
  float* cA = reinterpret_cast<float*>(sm + lay.co);  // [T][T]: beta_s e^{gam_s-gam_s'} k_s . k_s'
  float* cB = cA + T * T;                              // [T][T]: e^{gam_s-gam_s'} k_s' . q_s
  float* gam = cB + T * T;
  float* gt = gam + T;
  float* bt = gt + T;
  int* mi = reinterpret_cast<int*>(sm + lay.ints);
  const int Lc = L > 0 ? L : 1;
  // Tile rows padded by 16 bytes (V-major too: the tensor-core fragments of 8 rows then hit
  // different banks); q and k rows padded by 4 floats likewise.
  const int row_bytes = VM ? DK * ES + 16 : R * ES + 16;
  constexpr int QS = DK + 4;
  auto key = [&](int c) { return (c / VW) * (32 * VW) + lane * VW + c % VW; };

  const int it = blockIdx.x;
  const int tile = it % p.tiles;
  const int h = (it / p.tiles) % p.hv;
  const int b = it / p.tiles / p.hv;
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  const int kh = h / group;
  const int v0 = tile * R;
  if (seq < 0) {  // an unused row: zero outputs
    for (int i = tid; i < T * R; i += kStreamThreads) {
      const int s = i / R, r = i - s * R;
      stx(out.p, out.dtype, b * out.s[0] + s * out.s[1] + h * out.s[2] + (v0 + r) * out.s[3], 0.f);
    }
    return;
  }
  char* head = p.state + (static_cast<int64_t>(seq) * p.seq_stride + static_cast<int64_t>(h) * DK * dv) * ES;

  // 1. The state tile (bulk copy on sm_90, cp.async before), the metadata, the drafts' inputs.
  __shared__ uint64_t bar;
#if KVR_GDN_BULK
  if (tid == 0) {
    mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    if constexpr (VM) {
      if (lane == 0) mbar_expect_tx(&bar, R * DK * ES);
      __syncwarp();
      for (int r = lane; r < R; r += 32)
        bulk_copy(st + r * row_bytes, head + static_cast<int64_t>(v0 + r) * DK * ES, DK * ES, &bar);
    } else {
      if (lane == 0) mbar_expect_tx(&bar, DK * R * ES);
      __syncwarp();
      for (int k = lane; k < DK; k += 32)
        bulk_copy(st + k * row_bytes, head + (static_cast<int64_t>(k) * dv + v0) * ES, R * ES, &bar);
    }
  }
#else
  if constexpr (VM) {
    const char* src = head + static_cast<int64_t>(v0) * DK * ES;
    const int c16 = DK * ES / 16;
    for (int i = tid; i < R * c16; i += kStreamThreads) {
      const int r = i / c16, c = i - r * c16;
      cp_async_16(st + r * row_bytes + 16 * c, src + static_cast<int64_t>(r) * DK * ES + 16 * c, 16);
    }
  } else {
    const int c16 = R * ES / 16;
    for (int i = tid; i < DK * c16; i += kStreamThreads) {
      const int k = i / c16, c = i - k * c16;
      cp_async_16(st + k * row_bytes + 16 * c, head + (static_cast<int64_t>(k) * dv + v0) * ES + 16 * c, 16);
    }
  }
  cp_async_commit();
#endif
  const int32_t* meta_g = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  if (tid == 0) {
    const int4 m0 = __ldcg(reinterpret_cast<const int4*>(meta_g));
    mi[0] = m0.x;
    mi[1] = m0.y;
    mi[2] = m0.z;
    mi[3] = m0.w;
    mi[4] = __ldcg(meta_g + kMetaConvEnd);
  }
  if (tid < T) {
    const float2 gb = token_gb(p, b, tid, h);
    gt[tid] = gb.x;
    bt[tid] = gb.y;
  }
  // The gate's z of the tile's rows, with the additive rule (Mamba-2) in the space of the S k
  // readouts, which that rule does not use: a cold read per draft in the row phase was most of
  // a Mamba-2 verify CTA's life (H200, BENCHMARKS.md). The delta rule reads it there.
  const bool zpre = ADD && p.gate.p;
  float* zt = sk;
  // The readouts' tensor-core tiles: 16 rows x 8 of the columns q_0..q_{T-1} (and k_0..k_{T-1}:
  // the additive rule reads out S q only); with fewer tiles than half the warps, each tile's
  // key dimension in two halves on two warps, summed into zeroed slots.
  const int nx = delta ? 2 * T : T;
  const int mtiles = R / 16, ntiles = (nx + 7) / 8, tmn = mtiles * ntiles;
  const int ksplit = 2 * tmn <= kStreamWarps ? 2 : 1;
  for (int i = tid; i < T * R; i += kStreamThreads) {
    const int s = i / R, r = i - s * R;
    if (ksplit == 2) {
      sq[i] = 0.f;
      if (delta) sk[i] = 0.f;
    }
    vt[i] = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + s * p.v.s[1] + h * p.v.s[2] + (v0 + r) * p.v.s[3]);
    if (zpre)
      zt[i] = ldx(p.gate.p, p.gate.dtype, b * p.gate.s[0] + s * p.gate.s[1] + h * p.gate.s[2] + (v0 + r) * p.gate.s[3]);
  }
  const float skip = p.skip.p ? ldx(p.skip.p, p.skip.dtype, h * p.skip.s[0]) : 0.f;
  __syncthreads();  // (B1) metadata

  const int mode = mi[0], start = mi[1], hcnt = mi[2], pending = mi[3], conv_end = mi[4];
  const int nbuf = hcnt;
  const bool flush = hcnt + 2 * T > L;
  const int base = (start + hcnt) % Lc;
  auto slot = [&](int j) { return (start + j) % Lc; };
  auto entry_k = [&](int j) -> const char* {
    return p.ring_k + ((static_cast<int64_t>(seq) * Lc + slot(j)) * p.hk + kh) * DK * ee;
  };

  // 2. The ring's u rows of the tile and decays (asynchronous), the drafts' coefficients and
  //    the entries' key products.
  if (nbuf > 0) {
    const int c16 = R * ee / 16;
    for (int i = tid; i < nbuf * c16; i += kStreamThreads) {
      const int j = i / c16, c = i - j * c16;
      const char* src = p.ring_u + ((static_cast<int64_t>(seq) * Lc + slot(j)) * p.hv + h) * dv * ee +
                        static_cast<int64_t>(v0) * ee + 16 * c;
      cp_async_16(ut + j * R * ee + 16 * c, src, 16);
    }
    for (int j = tid; j < nbuf; j += kStreamThreads) gs[j] = p.ring_g[(static_cast<int64_t>(seq) * Lc + slot(j)) * p.hv + h];
  }
  cp_async_commit();
  if (tid < T) {
    float a = 0.f;
    for (int s = 0; s <= tid; ++s) a += gt[s];
    gam[tid] = a;
  }
  // The group's record from kvr_gdn_vprep: q and k, entry products, draft products (the
  // verify kernel is launched as the prep's programmatic dependent: the state tile, the
  // metadata and the inputs above are in flight while the prep ends).
  pdl_wait();
  {
    const int Tm = p.max_drafts;
    const float* sc = p.scratch + static_cast<int64_t>(b * p.hk + kh) * vprep_floats(DK, L, Tm);
    const float* pr = sc + 2 * Tm * DK;
    const float* cc = pr + 2 * Tm * Lc;
    for (int i = tid; i < T * DK / 4; i += kStreamThreads) {
      const int s = i / (DK / 4), c = i - s * (DK / 4);
      reinterpret_cast<float4*>(qs + s * QS)[c] = __ldcg(reinterpret_cast<const float4*>(sc + s * DK) + c);
      reinterpret_cast<float4*>(ks + s * QS)[c] = __ldcg(reinterpret_cast<const float4*>(sc + (Tm + s) * DK) + c);
    }
    for (int i = tid; i < T * nbuf; i += kStreamThreads) {
      const int s = i / nbuf, j = i - s * nbuf;
      aq[s * Lc + j] = __ldcg(pr + s * Lc + j);
      ak[s * Lc + j] = __ldcg(pr + (Tm + s) * Lc + j);
    }
    for (int i = tid; i < T * T; i += kStreamThreads) {
      const int s = i / T, s2 = i - s * T;
      cA[i] = s2 < s ? __ldcg(cc + s * Tm + s2) : 0.f;
      cB[i] = s2 <= s ? __ldcg(cc + Tm * Tm + s * Tm + s2) : 0.f;
    }
  }
#if KVR_GDN_BULK
  cp_async_wait<0>();
  mbar_wait(&bar, 0);
#else
  cp_async_wait<0>();
#endif
  __syncthreads();  // (B2) tile, ring rows, q and k, products, gam

  // 3. Warp 0: the entries' weights w_j (suffix scan over the decays) and e^G; the others:
  //    the drafts' coefficients. Every warp: (S q_s)[v], (S k_s)[v] over the tile.
  if (warp == 0) {
    const float eg = suffix_weights(gs, nbuf, lane, [&](int j, float w) {
      wg[j] = w;
      for (int s = 0; s < T; ++s) {
        aq[s * Lc + j] *= w;
        ak[s * Lc + j] *= w;
      }
    });
    if (lane == 0) mi[6] = __float_as_int(eg);
  } else if (tid - 32 < T * T) {
    const int s = (tid - 32) / T, s2 = (tid - 32) % T;
    const float e = expf(gam[s] - gam[s2]);
    if (s2 < s) cA[s * T + s2] *= bt[s] * e;
    if (s2 <= s) cB[s * T + s2] *= e;
  }
  {
    // [R x DK] tile times [DK x 2T] (q_0..q_{T-1}, k_0..k_{T-1}) on tensor cores: m16n8k8 TF32
    // with the operands split into high and low TF32 parts (f32 accuracy), a warp per 16 x 8
    // output tile. S[m][k] is row m of a V-major tile, column m of a K-major one.
    const int g = lane >> 2, t4 = lane & 3;
    auto S = [&](int m, int k) {
      return to_float(*reinterpret_cast<const SD*>(st + (VM ? m * row_bytes + k * ES : k * row_bytes + m * ES)));
    };
    for (int w = warp; w < tmn * ksplit; w += kStreamWarps) {
      const int tl = w % tmn, k0 = (w / tmn) * (DK / ksplit);
      const int m0 = (tl % mtiles) * 16, n0 = (tl / mtiles) * 8;
      const int n = n0 + g;
      const float* xr = n < T ? qs + n * QS : ks + (n < 2 * T ? n - T : 0) * QS;
      const float xm = n < nx ? 1.f : 0.f;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int kk = k0; kk < k0 + DK / ksplit; kk += 8) {
        const float av[4] = {S(m0 + g, kk + t4), S(m0 + g + 8, kk + t4), S(m0 + g, kk + t4 + 4),
                             S(m0 + g + 8, kk + t4 + 4)};
        const float bv[2] = {xm * xr[kk + t4], xm * xr[kk + t4 + 4]};
        mma_3xtf32(c, av, bv);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + g + (e >= 2 ? 8 : 0), col = n0 + 2 * t4 + (e & 1);
        float* dst = col < T ? sq + col * R + row : col < nx ? sk + (col - T) * R + row : nullptr;
        if (dst && ksplit == 1) *dst = c[e];
        if (dst && ksplit == 2) atomicAdd(dst, c[e]);  // two partial sums into 0: exact order
      }
    }
  }
  __syncthreads();  // (B3) weights, e^G, coefficients, (S q), (S k)

  // 4. History readouts H(q_s), H(k_s) of every row, spread over all threads: thread (row
  //    r = tid % R, group g = tid / R) sums the entries into drafts g, g + G, ... of row r (at
  //    most 4: G >= 2), in place in sq / sk.
  const float eG = __int_as_float(mi[6]);
  {
    const int G = kStreamThreads / R, r = tid % R, g = tid / R;
    float hq[4], hk[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int s = g + i * G;
      hq[i] = s < T ? eG * sq[s * R + r] : 0.f;
      hk[i] = s < T && delta ? eG * sk[s * R + r] : 0.f;
    }
    for (int j = 0; j < nbuf; ++j) {
      const float uj = ldx(ut, p.entry_dtype, j * R + r);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = g + i * G;
        if (s < T) {
          hq[i] += aq[s * Lc + j] * uj;
          hk[i] += ak[s * Lc + j] * uj;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int s = g + i * G;
      if (s < T) {
        sq[s * R + r] = hq[i];
        if (delta) sk[s * R + r] = hk[i];  // (additive: zt lives there)
      }
    }
  }
  __syncthreads();  // (B4) readouts

  // 5. Row phase: thread t < R owns value row v0 + t: the drafts' corrections by forward
  //    substitution, the outputs, the ring rows.
  if (tid < R) {
    float hq[kMaxT], hk[kMaxT];
#pragma unroll
    for (int s = 0; s < kMaxT; ++s) {
      hq[s] = s < T ? sq[s * R + tid] : 0.f;
      hk[s] = s < T && delta ? sk[s * R + tid] : 0.f;
    }
    float u[kMaxT];
#pragma unroll
    for (int s = 0; s < kMaxT; ++s) {
      if (s < T) {
        // Delta rule: forward substitution over the earlier drafts; additive: u_s = beta_s v_s.
        const float vs = vt[s * R + tid];
        float x = bt[s] * (delta ? vs - expf(gam[s]) * hk[s] : vs);
#pragma unroll
        for (int s2 = 0; s2 < s; ++s2) x -= delta ? cA[s * T + s2] * u[s2] : 0.f;
        u[s] = x;
        float y = expf(gam[s]) * hq[s];
#pragma unroll
        for (int s2 = 0; s2 <= s; ++s2) y += cB[s * T + s2] * u[s2];
        EpilogueIn e{skip, 0.f};
        if (p.gate.p) e.z = zpre ? zt[s * R + tid] : epilogue_in(p, b, s, h, v0 + tid).z;
        stx(out.p, out.dtype, b * out.s[0] + s * out.s[1] + h * out.s[2] + (v0 + tid) * out.s[3],
            epilogue(p, e, vs, y));
        char* dst = p.ring_u + ((static_cast<int64_t>(seq) * Lc + (base + s) % Lc) * p.hv + h) * dv * ee;
        stx(dst, p.entry_dtype, v0 + tid, u[s]);
      }
    }
  }

  // 6. A flush writes the tile's state e^G S + sum_j w_j u_j k_j^T back (the drafts' ring
  //    slots may be the oldest entries' slots: their u rows of this tile are in shared memory).
  if (flush) fold_tile<SD, VM, DK>(st, head, v0, R, dv, row_bytes, eG, nbuf, wg, ut, p.entry_dtype, entry_k);

  // 7. The drafts' keys and decays (outside a flush: nobody reads those slots this step), and
  //    this CTA's share of the drafts' conv inputs.
  if (!flush && tile == 0) {
    if (h % group == 0) {
      for (int i = tid; i < T * DK; i += kStreamThreads) {
        const int s = i / DK, c = i - s * DK;
        char* kd = p.ring_k + ((static_cast<int64_t>(seq) * Lc + (base + s) % Lc) * p.hk + kh) * DK * ee;
        stx(kd, p.entry_dtype, c, ks[s * QS + c]);
      }
    }
    if (tid < T) p.ring_g[(static_cast<int64_t>(seq) * Lc + (base + tid) % Lc) * p.hv + h] = gt[tid];
  }
  if (p.conv_dim > 0) {
    const int parts = p.hv * p.tiles, part = h * p.tiles + tile;
    const int lo = static_cast<int>(static_cast<int64_t>(part) * p.conv_dim / parts);
    const int hi = static_cast<int>(static_cast<int64_t>(part + 1) * p.conv_dim / parts);
    const int ce = p.conv_dtype == 0 ? 4 : 2;
    for (int s = 0; s < T; ++s) {
      char* cw = p.conv + (static_cast<int64_t>(seq) * p.conv_slots + (conv_end + s) % p.conv_slots) * p.conv_dim * ce;
      for (int c = lo + tid; c < hi; c += kStreamThreads)
        stx(cw, p.conv_dtype, c, ldx(p.conv_in.p, p.conv_in.dtype, b * p.conv_in.s[0] + s * p.conv_in.s[1] + c * p.conv_in.s[2]));
    }
  }

  // 8. Arrival: the last CTA of the sequence finishes the step (every other CTA has read the
  //    metadata and, in a flush, the entries' keys and decays it overwrites).
  __syncthreads();
  if (tid == 0) {
    const int arr = atomicAdd(p.meta + static_cast<int64_t>(seq) * kMetaInts + kMetaArrive, 1);
    mi[7] = arr == per_seq - 1;
  }
  __syncthreads();
  if (mi[7]) {
    __threadfence();
    Place pl;
    pl.flush = flush;
    pl.kv_store = false;
    pl.base = base;
    if (flush) ring_keys_and_decays(p, b, seq, base, warp, lane, tid, kStreamThreads);
    if (tid == 0) {
      int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
      finish_meta(p, meta, mode, start, hcnt, pending, conv_end, pl);
      meta[kMetaArrive] = 0;
    }
  }
}

}  // namespace gdn
}  // namespace kvr

// Delta rule: three resident CTAs per SM (80 registers): the shared memory of a 64-row tile
// at dk 128 allows three, and one CTA's dependent phases hide only behind the others'.
// Additive rule (`_add`): four (64 registers): Mamba-2's 64-row heads, verify T = 4 at B = 128
// on the H200 771 us with three, 657 us with four.
#define KVR_GDN_SVERIFY(SD, SN, VM, LN, DK)                                                  \
  extern "C" __global__ void __launch_bounds__(kvr::gdn::kStreamThreads, 3)                 \
      kvr_gdn_sverify_##SN##_##LN##_d##DK(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::sverify_body<SD, VM, DK, false>(p);                                            \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(kvr::gdn::kStreamThreads, 4)                 \
      kvr_gdn_sverify_##SN##_##LN##_d##DK##_add(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::sverify_body<SD, VM, DK, true>(p);                                             \
  }
#define KVR_GDN_SVERIFY_DK(DK)                         \
  KVR_GDN_SVERIFY(float, f32, false, k, DK)            \
  KVR_GDN_SVERIFY(float, f32, true, v, DK)             \
  KVR_GDN_SVERIFY(__nv_bfloat16, bf16, false, k, DK)   \
  KVR_GDN_SVERIFY(__nv_bfloat16, bf16, true, v, DK)
KVR_GDN_SVERIFY_DK(64)
KVR_GDN_SVERIFY_DK(128)
KVR_GDN_SVERIFY_DK(256)
#define KVR_GDN_VPREP(DK)                                                                 \
  extern "C" __global__ void __launch_bounds__(kvr::gdn::kStreamThreads)                  \
      kvr_gdn_vprep_d##DK(const __grid_constant__ kvr::gdn::StepParams p) {                \
    kvr::gdn::vprep_body<DK>(p);                                                           \
  }
KVR_GDN_VPREP(64)
KVR_GDN_VPREP(128)
KVR_GDN_VPREP(256)
#undef KVR_GDN_VPREP
#undef KVR_GDN_SVERIFY_DK
#undef KVR_GDN_SVERIFY
