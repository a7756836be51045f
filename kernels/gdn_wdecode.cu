// Gated DeltaNet (and additive-rule) single-token decode, warp-streaming form, in two launches:
//   kvr_gdn_dprep_d<dk>              one CTA per (batch row, key head): the bookkeeping
//   kvr_gdn_wdecode_<state>_v_d<dk>  one warp per 8 value rows of a (row, value head): the
//                                    state stream and everything per value row
// for V-major states in pools without KV-only mode, ring length 0 (recurrent) or up to
// KVR_GDN_WDECODE_MAX_RING (src/linear/replay/cuda.rs picks it). Recurrent pools without a
// conv window (no prep kernel) take kvr_gdn_wrec_<state>_v_d<dk> instead: the state stream
// alone, in fewer registers (below). K-major pools take the same prep kernel and
//   kvr_gdn_wdecode_<state>_k_d<dk>  a warp per quarter of the keys, float4 rows of 4 value
//                                    rows a lane (kdecode_body, below)
// in two launches at every batch.
//
// What limits decode is keeping enough state bytes in flight: a plain read of the states
// through registers, 8 rows a warp, runs at the GPU's read ceiling from B = 32 on (H200:
// 4.5 TB/s), while kernels that also wait on the ring's metadata and entries inside each CTA
// (gdn_stream.cu, gdn_decode.cu) reach half of it. So the work that depends on the metadata is
// split off into a small kernel that runs first, and the state kernel never waits on a
// dependent global load before its state is in registers:
//
// kvr_gdn_dprep (per batch row and key head; it lets the state kernel launch at once,
// programmatic dependent launch): reads the metadata; q and k of its key head normalized (into the scratch) and
// the key products k_p . q and k_p . k of every ring slot p that holds a buffered entry (each
// warp reads the metadata with q and k, then only those slots' keys); per value head the suffix weights
// w_j = e^{g_{j+1} + ... + g_{h-1}} of the buffered entries' decays, e^G, e^g, beta, k . q and
// the coefficients A_p = w_p (k_p . q), B_p = w_p (k_p . k) by slot (0 where no entry is
// buffered) into the decode scratch (kvr_gdn_dscratch_layout); the group's v (copied whole:
// the state kernel's warps each need 8 values of a line, and scattered reads of the input
// cost the state stream a third of its speed); the new entry's key and decay into the ring (in
// a flush step the slot is the oldest entry, whose key the state kernel still folds: it is
// first copied to the scratch); its share of the conv window. The state kernel writes the new
// metadata (one thread, after its griddepcontrol.wait: every prep CTA has read it by then).
// Nothing else reads the metadata in the step, so there is no arrival counting.
//
// kvr_gdn_wdecode (per warp: 8 value rows, the whole key dimension in registers): issues its
// state rows first, then the u values of its rows in the ring slots the metadata (read behind
// the state rows: a superset of the buffered entries, whichever version it sees) marks as
// buffered (p.live_u; else every slot's: no metadata needed), then waits
// for the prep kernel (griddepcontrol.wait) and reads its records (L2 hits):
//   (S_{t-1} x)[v] = e^G (S x)[v] + sum_p A/B_p u_p[v]  for x in {q, k},
//   u = beta (v - e^{g} S_{t-1} k) (delta rule) or beta v (additive), y = e^{g} S_{t-1} q + (k . q) u,
// writes y (after skip and gate) and its rows of u into the ring; a flush step folds the ring
// into its rows (e^G S + sum_p w_p u_p k_p^T; every slot's key into shared memory first, one
// round trip for the CTA's warps) and stores them. Recurrent pools decay, read and
// rewrite the rows every step from the inputs; the prep kernel only keeps their conv window
// (without one it is not launched); the state kernel counts the step.
//
// kvr_gdn_fdecode_<state>_v_d<dk> (small batches, one launch): the same state warps, each CTA
// doing the prep kernel's work for its own (row, value head) instead of reading its record.
// At a few batch rows the step is a chain of latencies, not a stream, and the prep launch's
// round trips plus the dependent launch's hand-off were most of it. Everything a CTA needs is
// requested at once, before the metadata arrives: its state rows, every ring slot's u values
// of its rows, every slot's key of its key head (to shared memory) and decay, the metadata and
// the inputs; slots that hold no buffered entry are masked by selects afterwards (never by
// multiplying: a slot may be being rewritten while it is read). Each warp normalizes q and k
// and takes the key products of every slot itself (no exchange), then runs the row phase
// above. The new entry's key and decay go into their slot at once outside a flush (nobody
// reads that slot this step); the last CTA of the sequence to arrive (the metadata's arrival
// counter, as in gdn_stream.cu) writes the metadata and, in a flush step, the key and decay
// into the oldest entry's slot, which every CTA folds. Its grid is (tiles, value heads, batch
// rows), and it runs as a programmatic dependent of the stream's previous kernel (waiting for
// it before any read). Specialized builds (kvr_gdn_fdecode_<state>_v_d128_r<L>_<spec>) take
// a copy of the parameters with the dtypes, rule, dt mode, conv and ring length of the
// engines' calls made constants (FdFix, FdFixM2 below): a step that is a chain of latencies
// loses the run-time dispatch in front of its first arithmetic (H200: 1.2-1.5x at B <= 8,
// BENCHMARKS.md). The two launches have such builds too (kvr_gdn_dprep_d128_r<L>_<spec>,
// kvr_gdn_wdecode_<state>_v_d128_r<L>_<spec>): the state kernel's work behind its wait is
// what a step waits for at every batch size.
#pragma once
#include "gdn_common.cuh"


namespace kvr {
namespace gdn {

constexpr int kWRows = KVR_GDN_WDECODE_ROWS;
static_assert(kWRows == 8, "the row phase maps lanes to 8 rows");


template <int DK>
__device__ __forceinline__ int wkey(int lane, int c) {
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  return (c / VW) * (32 * VW) + lane * VW + c % VW;
}

// KL elements of a q or k row (element `o` of tensor t, key map of `lane`) as floats: runs of
// VW contiguous elements by one vector load where the row is contiguous and aligned for it,
// else element by element.
template <int DK>
__device__ __forceinline__ void load_row(const Tensor& t, int64_t o, int lane, float* d) {
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int es = t.dtype == KVR_DT_F32 ? 4 : 2;
  const char* base = static_cast<const char*>(t.p) + o * es;
  if (t.s[3] == 1 && (reinterpret_cast<uintptr_t>(base) & (VW * es - 1)) == 0) {
#pragma unroll
    for (int c = 0; c < KL; c += VW) ld_entry<VW>(base, t.dtype, wkey<DK>(lane, c), d + c);
  } else {
#pragma unroll
    for (int c = 0; c < KL; ++c) d[c] = ldx(t.p, t.dtype, o + wkey<DK>(lane, c) * t.s[3]);
  }
}

// State rows at p by evict-first loads (the states are read once a step; the ring, the scratch
// and the inputs stay in L2).
template <typename SD, int N>
__device__ __forceinline__ void ld_state(const SD* p, float* d) {
  if constexpr (sizeof(SD) == 4 && N == 4) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
    d[0] = a.x;
    d[1] = a.y;
    d[2] = a.z;
    d[3] = a.w;
  } else if constexpr (sizeof(SD) == 2 && N == 4) {
    const uint2 r = __ldcs(reinterpret_cast<const uint2*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
    const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
    d[0] = a.x;
    d[1] = a.y;
    d[2] = c.x;
    d[3] = c.y;
  } else {
    ld_vec<SD, N>(p, d);
  }
}

// A warp's RL state rows from hs, by the key map (evict-first loads).
template <typename SD, int DK, int RL>
__device__ __forceinline__ void load_rows(const SD* hs, float (&s)[RL][DK / 32], int lane) {
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
#pragma unroll
  for (int r = 0; r < RL; ++r)
#pragma unroll
    for (int c = 0; c < KL; c += VW) ld_state<SD, VW>(hs + r * DK + wkey<DK>(lane, c), &s[r][c]);
}

// N floats stored as state rows at p (rounded to SD), by evict-first stores where they are
// whole 16- or 8-byte vectors: a stored state is read again only at the layer's next step,
// after every other layer's state has streamed through L2.
template <typename SD, int N>
__device__ __forceinline__ void st_state(SD* p, const float* d) {
  if constexpr (sizeof(SD) == 4 && N == 4) {
    __stcs(reinterpret_cast<float4*>(p), make_float4(d[0], d[1], d[2], d[3]));
  } else if constexpr (sizeof(SD) == 2 && N == 4) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(d[0], d[1]), c = __floats2bfloat162_rn(d[2], d[3]);
    __stcs(reinterpret_cast<uint2*>(p),
           make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&c)));
  } else {
    st_vec<SD, N>(p, d);
  }
}

// A warp's RL state rows back to hs (rounded to the state dtype first), by the key map.
template <typename SD, int DK, int RL>
__device__ __forceinline__ void store_rows(SD* hs, float (&s)[RL][DK / 32], int lane) {
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
#pragma unroll
  for (int r = 0; r < RL; ++r) {
    if constexpr (!IsSame<SD, float>::value) {
#pragma unroll
      for (int c = 0; c < KL; ++c) s[r][c] = roundx(KVR_DT_BF16, s[r][c]);
    }
#pragma unroll
    for (int c = 0; c < KL; c += VW) st_state<SD, VW>(hs + r * DK + wkey<DK>(lane, c), &s[r][c]);
  }
}

// Ring entries are addressed by physical slot p < L here: the coefficients of slots that hold
// no buffered entry are 0 and their u values are masked, so that the state kernel can load
// every slot's u rows before it knows the metadata.
//
// A CTA per batch row and share of its key heads (gridDim.x / b shares: one per key head at
// small batches, where one CTA per row left a chain of 8-9 us exposed in front of the state
// kernel; one per row at large ones, where more CTAs cost more than they overlap; H200,
// BENCHMARKS.md): each warp one key head at a time (q and k normalized, the key products of
// every slot, the new key), then one value head of the share at a time (weights,
// coefficients, the new decay); the CTA copies the share's v and writes its share of the conv
// window. `p.stages` is the number of shares. With one, the CTA writes the row's new metadata
// at its end; with more, the state kernel does (one thread, once its griddepcontrol.wait has
// seen every prep CTA end: they all read it).
// (ids_inline: p.ids_inline of the kernel's parameters, so that a specialized build's copy of
// them, below, is never indexed at run time and stays in registers.)
template <int DK, int LU>
__device__ void dprep_body(const StepParams& p, const int32_t* ids_inline) {
  // A programmatic dependent of kvr_gdn_kvdec_* in pools with KV-only mode (elsewhere a plain
  // launch: the wait is a no-op): the records it writes first, and only then the state
  // kernel's launch, whose KV-only test reads them before its own wait.
  pdl_wait();
  pdl_launch_dependents();
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int shares = p.stages > 1 ? p.stages : 1, nkh = p.hk / shares;
  const int b = blockIdx.x / shares, share = blockIdx.x - b * shares, kh0 = share * nkh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const int seq = p.ids ? p.ids[b] : ids_inline[b];
  if (seq < 0) return;
  const int L = p.l;
  const int Lc = L > 0 ? L : 1;
  const int group = p.hv / p.hk, h0 = kh0 * group, nh = nkh * group;
  __shared__ int mi[5];
  extern __shared__ float dsm[];  // k_p . q, k_p . k [nkh][Lc], normalized k [nkh][DK], k . q [nkh], (g, beta) [2][nh], decays [nh][Lc], v
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  if (tid == 0) {
    const int4 m = __ldcg(reinterpret_cast<const int4*>(meta));
    mi[0] = m.x;
    mi[1] = m.y;
    mi[2] = m.z;
    mi[3] = m.w;
    mi[4] = __ldcg(meta + kMetaConvEnd);
  }
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  const bool ring = L > 0;
  const kvr_gdn_dscratch lay0 = kvr_gdn_dscratch_layout(p.b, p.hv, p.hk, DK, p.dv, L);
  if (p.kv_split) {
    // Pools with KV-only mode where some row may be KV-only: the record first, so that such a
    // row (kvr_gdn_kvdec_* ran its step) costs a round trip here, not this kernel's loads.
    __syncthreads();
    if (mi[0] == kModeKvOnly) {
      if (share == 0 && tid == 0) reinterpret_cast<int*>(p.scratch + lay0.hdr)[4 * b + 1] = -1;
      return;
    }
  }
  float* cq = dsm;
  float* ck = dsm + nkh * Lc;
  float* kn = ck + nkh * Lc;
  float* kqs = kn + nkh * DK;
  float* tgs = kqs + nkh;  // the new token's (g, beta) of the share's value heads [2][nh]
  float* gsm = tgs + 2 * nh;  // ring decays of the share's value heads [nh][Lc], by cp.async
  const kvr_gdn_dscratch lay = kvr_gdn_dscratch_layout(p.b, p.hv, p.hk, DK, p.dv, L);
  // v of the group's heads (raw), 16-byte aligned
  unsigned char* vsm = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(gsm + nh * Lc) + 15) & ~uintptr_t{15});
  const int ves = p.v.dtype == KVR_DT_F32 ? 4 : 2;
  const int vbytes = nh * p.dv * ves;
  const char* v0 = static_cast<const char*>(p.v.p) + (b * p.v.s[0] + h0 * p.v.s[2]) * ves;
  const bool vcopy = ring && p.v.s[3] == 1 && p.v.s[2] == p.dv && vbytes % 16 == 0 &&
                     (reinterpret_cast<uintptr_t>(v0) & 15) == 0;
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  if (ring) {
    for (int i = tid; i < L * nh; i += blockDim.x) {
      const int sl = i / nh, hh = i - sl * nh;
      const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(gsm + hh * Lc + sl));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sa),
                   "l"(p.ring_g + (static_cast<int64_t>(seq) * L + sl) * p.hv + h0 + hh)
                   : "memory");
    }
    cp_async_commit();
    // The share's v, for the state kernel (whose warps each need 8 values of a line: a copy
    // of whole lines costs less than their scattered reads), to shared memory now and to the
    // scratch after the barrier; element by element where it is not contiguous.
    if (vcopy) {
      for (int i = tid * 16; i < vbytes; i += blockDim.x * 16) cp_async_16(vsm + i, v0 + i, 16);
      cp_async_commit();
    }
    // The new token's (g, beta) of every value head of the share, by the last threads (the
    // first warps take the key heads): Mamba-2's dt gate reads three tensors, a round trip
    // the value-head loop below would otherwise pay once per head.
    for (int i = blockDim.x - 1 - tid; i < nh; i += blockDim.x) {
      const float2 gb = token_gb(p, b, 0, h0 + i);
      tgs[i] = gb.x;
      tgs[nh + i] = gb.y;
    }
    // Per key head: q and k normalized, and the key products of every slot that holds a
    // buffered entry, CH slots a round. Each warp reads the metadata itself (with q and k) and
    // loads only those slots' keys: the others' products are never used (their weights are
    // 0), and reading every slot's key cost the step a quarter of its overhead over the state
    // kernel (H200, B = 128: a prep without the key products took 84 against 91 us a step).
    for (int kk = warp; kk < nkh; kk += nw) {
      const int kh = kh0 + kk;
      constexpr int CH = DK > 128 ? 4 : (LU < 8 ? LU : 8);
      float q[KL], k[KL];
      load_row<DK>(p.q, b * p.q.s[0] + kh * p.q.s[2], lane, q);
      load_row<DK>(p.k, b * p.k.s[0] + kh * p.k.s[2], lane, k);
      const int4 mw = __ldcg(reinterpret_cast<const int4*>(meta));
      const int lstart = mw.y, lcnt = mw.x == kModeRecurrent ? 0 : mw.z;
      const char* kbase = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * DK * ee;
      const int64_t kstride = static_cast<int64_t>(p.hk) * DK * ee;
      float kj[CH][KL];
      // Rounds over ring positions (slot (start + j) % L), not slots: the buffered entries are
      // positions 0 .. lcnt - 1, so a round past them is skipped whole (one round trip fewer
      // in the chain whenever at most CH entries are buffered). The value-head loop reads
      // only the buffered positions' products.
      for (int p0 = 0; p0 < L && (p0 == 0 || p0 < lcnt); p0 += CH) {
#pragma unroll
        for (int e = 0; e < CH; ++e) {
          if (p0 + e < lcnt && p0 + e < L) {
            const int sl = (lstart + p0 + e) % L;
#pragma unroll
            for (int c = 0; c < KL; c += VW) ld_entry<VW>(kbase + sl * kstride, p.entry_dtype, key(c), &kj[e][c]);
          } else {
#pragma unroll
            for (int c = 0; c < KL; ++c) kj[e][c] = 0.f;
          }
        }
        if (p0 == 0) {
          normalize_qk<KL>(p, q, k, true);
          float* qk = p.scratch + lay.qk + (static_cast<int64_t>(b) * p.hk + kh) * 2 * DK;
          float kq = 0.f;
#pragma unroll
          for (int c = 0; c < KL; ++c) {
            kn[kk * DK + key(c)] = k[c];
            qk[key(c)] = q[c];
            qk[DK + key(c)] = k[c];
            kq += k[c] * q[c];
          }
          kq = warp_sum(kq);
          if (lane == 0) kqs[kk] = kq;
        }
        float P[2 * CH];
#pragma unroll
        for (int e = 0; e < CH; ++e) {
          float x = 0.f, z = 0.f;
#pragma unroll
          for (int c = 0; c < KL; ++c) {
            x += kj[e][c] * q[c];
            z += kj[e][c] * k[c];
          }
          P[e] = x;
          P[CH + e] = z;
        }
        const float r = reduce_scatter<2 * CH>(P, lane);  // P[lane / (32 / (2 CH))]
        const int idx = lane / (32 / (2 * CH)), e = idx % CH;
        if (lane % (32 / (2 * CH)) == 0 && p0 + e < L) (idx < CH ? cq : ck)[kk * Lc + (lstart + p0 + e) % L] = r;
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // metadata, key products, normalized key, ring decays, v
  const int mode = mi[0], start = mi[1], hcnt = mi[2], pending = mi[3], conv_end = mi[4];
  const bool recurrent = !ring || mode == kModeRecurrent;
  const Place pl = placement(p, mode, start, hcnt);
  if (mode == kModeKvOnly) {
    // Pools with KV-only mode: kvr_gdn_kvdec_* ran this row's step and advanced its record;
    // the state kernel skips it.
    if (share == 0 && tid == 0) reinterpret_cast<int*>(p.scratch + lay.hdr)[4 * b + 1] = -1;
    return;
  }
  if (ring) {
    char* vdst = reinterpret_cast<char*>(p.scratch + lay.vv) + static_cast<int64_t>(b) * p.hv * p.dv * 4 +
                 static_cast<int64_t>(h0) * p.dv * ves;
    if (vcopy) {
      for (int i = tid * 16; i < vbytes; i += blockDim.x * 16)
        *reinterpret_cast<int4*>(vdst + i) = *reinterpret_cast<const int4*>(vsm + i);
    } else {
      for (int i = tid; i < nh * p.dv; i += blockDim.x)
        stx(vdst, p.v.dtype, i, ldx(p.v.p, p.v.dtype, b * p.v.s[0] + (h0 + i / p.dv) * p.v.s[2] + (i % p.dv) * p.v.s[3]));
    }
  }
  if (!recurrent) {
    const int nbuf = hcnt;
    if (share == 0 && tid == 0) {
      int* hdr = reinterpret_cast<int*>(p.scratch + lay.hdr) + 4 * b;
      hdr[0] = start;
      hdr[1] = nbuf;
      hdr[2] = pl.flush;
      hdr[3] = pl.base;
    }
    // The new entry's key into its slot; in a flush step the slot's old key (the oldest entry,
    // which the state kernel still folds) goes to the scratch first.
    for (int kk = warp; kk < nkh; kk += nw) {
      const int kh = kh0 + kk;
      char* kd = p.ring_k + ((static_cast<int64_t>(seq) * L + pl.base) * p.hk + kh) * DK * ee;
      if (pl.flush) {
        float old[KL];
#pragma unroll
        for (int c = 0; c < KL; c += VW) ld_entry<VW>(kd, p.entry_dtype, key(c), &old[c]);
        float* dst = p.scratch + lay.keys + (static_cast<int64_t>(b) * p.hk + kh) * DK;
#pragma unroll
        for (int c = 0; c < KL; ++c) dst[key(c)] = old[c];
      }
      __syncwarp();
#pragma unroll
      for (int c = 0; c < KL; ++c) stx(kd, p.entry_dtype, key(c), kn[kk * DK + key(c)]);
    }
    // Per value head: weights w_j = e^{g_{j+1} + ... + g_{h-1}} over the buffered entries in
    // ring order (lane j: entry j, slot (start + j) % L), then the coefficients by slot.
    for (int hh = warp; hh < nh; hh += nw) {
      const int h = h0 + hh, kk = hh / group;
      const float2 tgb = make_float2(tgs[hh], tgs[nh + hh]);
      const int slot = (start + lane) % L;
      const bool live = lane < nbuf;
      const float x0 = lane < L ? gsm[hh * Lc + slot] : 0.f;
      const float2 sc = warp_suffix(live ? x0 : 0.f, lane);
      const float excl = sc.x, total = sc.y;
      float* rec = p.scratch + lay.rec + (static_cast<int64_t>(b) * p.hv + h) * lay.rec_floats;
      if (lane < L) {
        // (a position past the buffered ones may have no products: rounds past them are skipped)
        const float w = live ? expf(excl) : 0.f;
        rec[4 + slot] = live ? w * cq[kk * Lc + slot] : 0.f;
        rec[4 + Lc + slot] = live ? w * ck[kk * Lc + slot] : 0.f;
        rec[4 + 2 * Lc + slot] = w;
      }
      if (lane == 0) {
        rec[0] = expf(total);
        rec[1] = expf(tgb.x);
        rec[2] = tgb.y;
        rec[3] = kqs[kk];
        p.ring_g[(static_cast<int64_t>(seq) * L + pl.base) * p.hv + h] = tgb.x;
      }
    }
  }
  if (p.conv_dim > 0) {
    // This share of the conv channels into the window ring at slot conv_end.
    const int lo = static_cast<int>(static_cast<int64_t>(share) * p.conv_dim / shares);
    const int hi = static_cast<int>(static_cast<int64_t>(share + 1) * p.conv_dim / shares);
    const int ce = p.conv_dtype == KVR_DT_F32 ? 4 : 2;
    char* cw = p.conv + (static_cast<int64_t>(seq) * p.conv_slots + conv_end % p.conv_slots) * p.conv_dim * ce;
    for (int c = lo + tid; c < hi; c += blockDim.x)
      stx(cw, p.conv_dtype, c, ldx(p.conv_in.p, p.conv_in.dtype, b * p.conv_in.s[0] + c * p.conv_in.s[2]));
  }
  if (ring && shares == 1) {
    __syncthreads();
    if (tid == 0) finish_meta(p, meta, mode, start, hcnt, pending, conv_end, pl);
  }
}


// What a state kernel serves: replay pools after the prep kernel, recurrent pools (ring 0;
// kernels of their own so that the replay kernels carry none of their code), or replay pools
// in one launch (small batches).
// kWPlain: kWPrep with the fold compiled out, wrong at a flush step (a diagnostic for
// bench/gdn_kernel_ab.cu, which times it on plain steps alone; no library kernel).
enum WKind : int { kWPrep = 0, kWRec = 1, kWFused = 2, kWPlain = 3 };

// NU: ring slots per lane, 16 each (ring length <= 16 NU).
// `ids_inline`: the launch's inline sequence ids (p.ids_inline, or the kernel parameter's where
// p is a specialized copy of it). The one-launch kind runs on a 3-D grid (tile, value head,
// batch row): no divisions in front of its chain.
template <typename SD, int DK, int NU, int KIND>
__device__ void wdecode_body(const StepParams& p, const int32_t* ids_inline) {
  constexpr bool REC = KIND == kWRec, FUSED = KIND == kWFused;
  constexpr int RL = kWRows, KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (FUSED || (REC && p.conv_dim == 0)) {
    // The one-launch kernel, and recurrent pools' kernel where no prep kernel runs first:
    // launched as a programmatic dependent of whatever ran before it on the stream (the host
    // sets the attribute; without it both are no-ops). Everything it reads may be that
    // kernel's output, so it waits first, and lets the next step's launch begin at once (a
    // dependent waits for this grid's end in turn).
    pdl_wait();
    pdl_launch_dependents();
  }
  // Grid (tiles, value heads, batch rows) in every kind: no divisions in front of the state
  // loads (a 1-D grid's two divisions delayed every CTA's first load; H200, BENCHMARKS.md).
  const int tile = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int dv = p.dv, L = p.l;
  const int kh = h / (p.hv / p.hk);
  const int row0 = tile * p.tv + warp * RL;
  const int rr = lane & (RL - 1);
  const bool writer = lane < RL;
  const int seq = p.ids ? p.ids[b] : ids_inline[b];
  const Tensor& out = p.out;
  const int64_t out_at = b * out.s[0] + h * out.s[2] + (row0 + rr) * out.s[3];
  if (seq < 0) {
    if (writer) stx(out.p, out.dtype, out_at, 0.f);
    return;
  }
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  char* head = p.state + (static_cast<int64_t>(seq) * p.seq_stride + static_cast<int64_t>(h) * DK * dv) *
                             static_cast<int64_t>(sizeof(SD));
  SD* hs = reinterpret_cast<SD*>(head) + static_cast<int64_t>(row0) * DK;
  // Pools with KV-only mode (`kv_split` 1: some row may be KV-only, kvr_gdn_kvdec's): the
  // state once the record says the row has one (kvr_gdn_kvdec_* wrote it; it ended before
  // the prep kernel, this kernel's primary, began; the one-launch kind reads it below).
  const bool late = !REC && p.kv_split != 0;
  if (late && !FUSED && __ldcg(p.meta + static_cast<int64_t>(seq) * kMetaInts + kMetaMode) == kModeKvOnly)
    return;
  float s[RL][KL];
  if (!late || !FUSED) load_rows<SD, DK, RL>(hs, s, lane);
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  // Recurrent pools: the thread that counts the step reads the metadata now, so that its
  // round trip is not the launch's tail (a prep kernel, for the conv window, only reads it).
  const bool counter = REC && h == 0 && tile == 0 && threadIdx.x == 0;
  int4 m0 = make_int4(0, 0, 0, 0);
  int conv_end = 0;
  if (counter || FUSED) {
    m0 = __ldcg(reinterpret_cast<const int4*>(meta));
    conv_end = __ldcg(meta + kMetaConvEnd);
    if (FUSED && late && m0.x == kModeKvOnly) return;  // kvr_gdn_kvdec_*'s row (below)
  }
  // Fused: every slot's key of this key head into shared memory, and lane s's decay of slot s.
  extern __shared__ __align__(16) unsigned char fkeys[];
  const int kbytes = DK * ee;
  float gsl = 0.f;
  if constexpr (FUSED) {
    const char* kb = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * kbytes;
    const int per = kbytes / 16;
    for (int i = threadIdx.x; i < L * per; i += blockDim.x) {
      const int sl = i / per, o = (i - sl * per) * 16;
      cp_async_16(fkeys + sl * kbytes + o, kb + static_cast<int64_t>(sl) * p.hk * kbytes + o, 16);
    }
    cp_async_commit();
    if (lane < L) gsl = __ldcg(p.ring_g + (static_cast<int64_t>(seq) * L + lane) * p.hv + h);
  }
  // The skip and gate inputs of the writer's row: loaded first where the step is a chain of
  // latencies (one launch: a cold read at the end is the warp's last round trip), at the end
  // in the streaming kinds (first measured the same there at B >= 128 on the H200, and it
  // holds two registers across the whole tile).
  constexpr bool EPI_EARLY = FUSED;
  EpilogueIn epi{0.f, 0.f};
  if (EPI_EARLY && writer) epi = epilogue_in(p, b, 0, h, row0 + rr);
  // The two launches: the slots whose u values are loaded, from the metadata read now (an L2
  // hit behind the state rows' loads). The prep kernel (one CTA a row) or one of this
  // kernel's threads may rewrite it during the step, so the set is one that holds the
  // buffered entries of either version: after a step from h >= 1 buffered entries the new one
  // holds h + 1 from the same start, a superset; a version with fewer than 2 (or not in
  // replay mode, or full) may follow a flush of every slot, so then every slot. Reading only
  // these (half of the ring on average) is the host's choice (p.live_u; src/linear/replay/
  // cuda.rs, BENCHMARKS.md): the metadata's round trip comes before the u values' loads.
  uint32_t live_u = ~0u;
  if (!REC && !FUSED && p.live_u) {
    const int4 mm = __ldcg(reinterpret_cast<const int4*>(p.meta + static_cast<int64_t>(seq) * kMetaInts));
    if (mm.x == kModeReplay && mm.z >= 2 && mm.z < L && mm.y >= 0 && mm.y < L) {
      const uint64_t run = (uint64_t{1} << mm.z) - 1, r = run << mm.y;
      live_u = static_cast<uint32_t>(r | (r >> L));
    }
  }
  // Every slot's u values of the warp's rows, before the metadata: lane 2 s + x holds rows
  // row0 + 4 x .. + 3 of slot s (+ 16 i).
  float u4[NU][4];
  const char* ubase = p.ring_u + (static_cast<int64_t>(seq) * L * p.hv + h) * dv * ee;
  const int64_t ustride = static_cast<int64_t>(p.hv) * dv * ee;
#pragma unroll
  for (int i = 0; i < NU; ++i) {
    const int sl = (lane >> 1) + 16 * i;
#pragma unroll
    for (int x = 0; x < 4; ++x) u4[i][x] = 0.f;
    if (!REC && sl < L && ((live_u >> sl) & 1u)) ld_entry<4>(ubase + sl * ustride, p.entry_dtype, row0 + 4 * (lane & 1), u4[i]);
  }
  // Replay pools: q and k normalized, v, e^g, beta and k . q from the prep kernel's record
  // (one wait, then loads that hit L2); recurrent pools read and normalize the inputs.
  float q[KL], k[KL];
  float a, bt, kq;
  float vt;
  int4 hdr = make_int4(0, 0, 0, 0);
  float eG = 1.f, cA = 0.f, cB = 0.f, cW = 0.f, g_new = 0.f;
  const kvr_gdn_dscratch lay = kvr_gdn_dscratch_layout(p.b, p.hv, p.hk, DK, p.dv, L);
  const float* rec = p.scratch + lay.rec + (static_cast<int64_t>(b) * p.hv + h) * lay.rec_floats;
  bool step_here = true;  // the row's step is this kernel's (the prep kernel's header may say not)
  if constexpr (FUSED) {
    load_row<DK>(p.q, b * p.q.s[0] + kh * p.q.s[2], lane, q);
    load_row<DK>(p.k, b * p.k.s[0] + kh * p.k.s[2], lane, k);
    vt = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + (row0 + rr) * p.v.s[3]);
    const float2 gb = token_gb(p, b, 0, h);
    g_new = gb.x;
    a = expf(gb.x);
    bt = gb.y;
    normalize_qk<KL>(p, q, k, true);
    kq = 0.f;
#pragma unroll
    for (int c = 0; c < KL; ++c) kq += k[c] * q[c];
    kq = warp_sum(kq);
    cp_async_wait<0>();
    __syncthreads();  // every slot's key
    if (m0.x == kModeKvOnly) return;  // kvr_gdn_kvdec_*'s row, record advanced (KV-only pools)
    if (late) load_rows<SD, DK, RL>(hs, s, lane);
    float cq = 0.f, ck = 0.f;
    // Key products of every slot, CH slots a round, the rounds spread over the CTA's warps
    // (shared memory), then lane s takes slot s's (every warp taking all of them measured
    // 8 % slower at B = 1 on the H200).
    constexpr int CH = 4, N = 2 * CH, S = 32 / N;
    __shared__ float fprod[2][32];
    for (int p0 = warp * CH; p0 < L; p0 += 4 * CH) {
      float P[N];
#pragma unroll
      for (int e = 0; e < CH; ++e) {
        float kj[KL];
        const unsigned char* kp = fkeys + min(p0 + e, L - 1) * kbytes;
#pragma unroll
        for (int c = 0; c < KL; c += VW) ld_entry<VW>(reinterpret_cast<const char*>(kp), p.entry_dtype, key(c), &kj[c]);
        float x = 0.f, z = 0.f;
#pragma unroll
        for (int c = 0; c < KL; ++c) {
          x += kj[c] * q[c];
          z += kj[c] * k[c];
        }
        P[e] = x;
        P[CH + e] = z;
      }
      const float r = reduce_scatter<N>(P, lane);  // P[lane / S]
      const int idx = lane / S, e = idx % CH;
      if (lane % S == 0 && p0 + e < L) fprod[idx / CH][p0 + e] = r;
    }
    __syncthreads();
    if (lane < L) {
      cq = fprod[0][lane];
      ck = fprod[1][lane];
    }
    // Weights w_j = e^{g_{j+1} + ... + g_{h-1}} over the buffered entries in ring order (lane
    // j: entry j), then by slot (lane s: slot s).
    const int start = m0.y, hcnt = m0.z;
    const int slot_j = (start + lane) % L;
    const bool live_j = lane < hcnt;
    const float2 sc = warp_suffix(pick(live_j, __shfl_sync(0xffffffffu, gsl, slot_j), 0.f), lane);
    const float excl = sc.x, total = sc.y;
    const float w_j = live_j ? expf(excl) : 0.f;
    const int j_s = (lane - start + 32 * L) % L;
    const float w_s = __shfl_sync(0xffffffffu, w_j, j_s);
    const bool live_s = lane < L && j_s < hcnt;
    cA = pick(live_s, w_s * cq, 0.f);
    cB = pick(live_s, w_s * ck, 0.f);
    cW = pick(live_s, w_s, 0.f);
    eG = expf(total);
    hdr = make_int4(start, hcnt, hcnt + 1 > L, (start + hcnt) % L);
  } else if constexpr (!REC) {
    pdl_wait();
    // A prep kernel of several CTAs per row only read the metadata: one thread ends the step.
    if (p.stages > 1 && h == 0 && tile == 0 && threadIdx.x == 0) {
      const int4 m = __ldcg(reinterpret_cast<const int4*>(meta));
      if (m.x != kModeKvOnly)  // (kvr_gdn_kvdec_* advanced a KV-only row's record)
        finish_meta(p, meta, m.x, m.y, m.z, m.w, __ldcg(meta + kMetaConvEnd), placement(p, m.x, m.y, m.z));
    }
    // The header and the record's loads at once (the scratch is initialized, so a row whose
    // record is stale reads defined values), and no exit on the header's test: an exit there
    // let the compiler sink the record's loads behind the header's round trip (K-major decode
    // 10 % slower at B = 128, H200); a skipped row computes on and stores nothing.
    hdr = __ldcg(reinterpret_cast<const int4*>(p.scratch + lay.hdr) + b);
    const float4 r0 = __ldcg(reinterpret_cast<const float4*>(rec));
    eG = r0.x;
    a = r0.y;
    bt = r0.z;
    kq = r0.w;
    cA = lane < L ? __ldcg(rec + 4 + lane) : 0.f;
    cB = lane < L ? __ldcg(rec + 4 + L + lane) : 0.f;
    const char* vrow = reinterpret_cast<const char*>(p.scratch + lay.vv) + static_cast<int64_t>(b) * p.hv * dv * 4;
    vt = ldx(vrow, p.v.dtype, static_cast<int64_t>(h) * dv + row0 + rr);
    const float* qk = p.scratch + lay.qk + (static_cast<int64_t>(b) * p.hk + kh) * 2 * DK;
#pragma unroll
    for (int c = 0; c < KL; c += VW) {
      ld_vec<float, VW>(qk + key(c), &q[c]);
      ld_vec<float, VW>(qk + DK + key(c), &k[c]);
    }
    step_here = hdr.y >= 0;  // else kvr_gdn_kvdec's row (pools with KV-only mode): nothing is stored
  } else {
    load_row<DK>(p.q, b * p.q.s[0] + kh * p.q.s[2], lane, q);
    load_row<DK>(p.k, b * p.k.s[0] + kh * p.k.s[2], lane, k);
    vt = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + (row0 + rr) * p.v.s[3]);
    const float2 gb = token_gb(p, b, 0, h);
    normalize_qk<KL>(p, q, k, false);
    kq = 0.f;
#pragma unroll
    for (int c = 0; c < KL; ++c) kq += k[c] * q[c];
    kq = warp_sum(kq);
    a = expf(gb.x);
    bt = gb.y;
  }
  const bool delta = p.rule == KVR_GDN_RULE_DELTA;

  // (S q)[row0 + rr] and (S k)[row0 + rr] in every lane.
  auto state_dots = [&](float& sq, float& sk) {
    const float2 d = rows8_dots<KL>(s, q, k, lane);
    sq = d.x;
    sk = d.y;
  };
  auto scale_state = [&](float f) { scale_rows<RL, KL>(s, f); };
  auto store_state = [&]() { store_rows<SD, DK, RL>(hs, s, lane); };

  float y;
  if constexpr (REC) {
    scale_state(a);
    float sq, sk;
    state_dots(sq, sk);
    const float u = delta ? bt * (vt - sk) : bt * vt;
    y = sq + kq * u;
#pragma unroll
    for (int r = 0; r < RL; ++r) {
      const float ur = __shfl_sync(0xffffffffu, u, r);
#pragma unroll
      for (int c = 0; c < KL; ++c) s[r][c] += ur * k[c];
    }
    store_state();
    // The step count, by one thread per row; with a prep kernel (conv window), once it has
    // read the metadata.
    if (p.conv_dim > 0) pdl_wait();
    if (counter) finish_meta(p, meta, m0.x, m0.y, m0.z, m0.w, conv_end, placement(p, m0.x, m0.y, m0.z));
  } else {
    float sq, sk;
    state_dots(sq, sk);
    const int start = hdr.x, nbuf = hdr.y, base = hdr.w;
    const bool flush = hdr.z != 0 && step_here;
    // The entries' part of S_{t-1} q and S_{t-1} k: each lane's slots weighted by their
    // coefficients, summed over the 16 lanes of each half (8 values: 4 rows x {q, k}).
    float P[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) P[x] = 0.f;
#pragma unroll
    for (int i = 0; i < NU; ++i) {
      const int sl = (lane >> 1) + 16 * i;
      const int j = sl - start + (sl < start ? L : 0);  // position in the ring
      const bool live = sl < L && j < nbuf;
      const float ca = __shfl_sync(0xffffffffu, cA, sl & 31), cb = __shfl_sync(0xffffffffu, cB, sl & 31);
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        u4[i][x] = live ? u4[i][x] : 0.f;
        P[x] += ca * u4[i][x];
        P[4 + x] += cb * u4[i][x];
      }
    }
    // Halving exchanges on lane bits 4, 3, 2, then a sum over bit 1: lane l ends with the
    // total of value 4 bit4 + 2 bit3 + bit2, i.e. {q, k}[bit4] of row 4 bit0 + 2 bit3 + bit2.
    {
      const bool h4 = lane & 16, h3 = lane & 8, h2 = lane & 4;
#pragma unroll
      for (int x = 0; x < 4; ++x)
        P[x] = pick(h4, P[4 + x], P[x]) + __shfl_xor_sync(0xffffffffu, pick(h4, P[x], P[4 + x]), 16);
#pragma unroll
      for (int x = 0; x < 2; ++x)
        P[x] = pick(h3, P[2 + x], P[x]) + __shfl_xor_sync(0xffffffffu, pick(h3, P[x], P[2 + x]), 8);
      P[0] = pick(h2, P[1], P[0]) + __shfl_xor_sync(0xffffffffu, pick(h2, P[0], P[1]), 4);
      P[0] += __shfl_xor_sync(0xffffffffu, P[0], 2);
    }
    const int src = (rr >> 2) | ((rr & 1) << 2) | (((rr >> 1) & 1) << 3);
    const float hq = __shfl_sync(0xffffffffu, P[0], src), hk = __shfl_sync(0xffffffffu, P[0], src | 16);
    const float u = delta ? bt * (vt - a * (eG * sk + hk)) : bt * vt;
    y = a * (eG * sq + hq) + kq * u;
    if (writer && step_here) {
      char* dst = p.ring_u + ((static_cast<int64_t>(seq) * L + base) * p.hv + h) * dv * ee;
      stx(dst, p.entry_dtype, row0 + rr, u);
    }
    if (KIND != kWPlain && flush) {
      // Fold the ring (every slot is buffered) into this warp's rows: e^G S + sum_p w_p u_p k_p^T.
      // The base slot's key was displaced by the new entry's: the prep kernel left it in the scratch.
      if constexpr (!FUSED) cW = lane < L ? __ldcg(rec + 4 + 2 * L + lane) : 0.f;
      scale_state(eG);
      const float* moved = p.scratch + lay.keys + (static_cast<int64_t>(b) * p.hk + kh) * DK;
      const char* kbase = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * DK * ee;
      const int64_t kstride = static_cast<int64_t>(p.hk) * DK * ee;
      // The two launches: every slot's key into shared memory first (f32), four slots a warp
      // a round, so that the fold below waits for one round trip to L2, not one per four
      // slots (the warps of a CTA share the key head). (One launch: they are there already.)
      __shared__ __align__(16) float fold_k[FUSED || KIND == kWPlain ? 4 : NU * 16 * DK];
      if constexpr (!FUSED) {
        const int nw = static_cast<int>(blockDim.x >> 5);
        for (int s0 = 4 * warp; s0 < L; s0 += 4 * nw) {
          float kj[4][KL];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int sl = min(s0 + e, L - 1);
            const bool moved_here = sl == base;
            const char* kp = moved_here ? reinterpret_cast<const char*>(moved) : kbase + sl * kstride;
#pragma unroll
            for (int c = 0; c < KL; c += VW) ld_entry<VW>(kp, moved_here ? KVR_DT_F32 : p.entry_dtype, key(c), &kj[e][c]);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (s0 + e < L) {
#pragma unroll
              for (int c = 0; c < KL; c += VW) st_vec<float, VW>(fold_k + (s0 + e) * DK + key(c), &kj[e][c]);
            }
        }
        __syncthreads();  // (a flush step is one for every warp of the CTA: one batch row)
      }
      if constexpr (!FUSED) {
        // w_p u_p of the warp's 8 rows by slot into shared memory (lane 2 s + x holds rows
        // 4 x .. 4 x + 3 of slot s), then per slot two broadcast loads instead of a shuffle
        // per row: the fold is a large part of a flush step's instructions (H200, B = 128:
        // a step 0.5-0.8 % faster, the same results to the bit; BENCHMARKS.md).
        __shared__ __align__(16) float fold_wu[4][NU * 16 * 8];
#pragma unroll
        for (int i = 0; i < NU; ++i) {
          const int sl = (lane >> 1) + 16 * i;
          const float w = __shfl_sync(0xffffffffu, cW, sl & 31);
          *reinterpret_cast<float4*>(&fold_wu[warp][sl * 8 + 4 * (lane & 1)]) =
              make_float4(w * u4[i][0], w * u4[i][1], w * u4[i][2], w * u4[i][3]);
        }
        __syncwarp();
#pragma unroll 4
        for (int sl = 0; sl < NU * 16; ++sl) {
          if (sl < L) {
            const float4 wa = *reinterpret_cast<const float4*>(&fold_wu[warp][sl * 8]);
            const float4 wb = *reinterpret_cast<const float4*>(&fold_wu[warp][sl * 8 + 4]);
            const float wr[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
            float kj[KL];
#pragma unroll
            for (int c = 0; c < KL; c += VW) ld_vec<float, VW>(fold_k + sl * DK + key(c), &kj[c]);
#pragma unroll
            for (int r = 0; r < RL; ++r)
#pragma unroll
              for (int c = 0; c < KL; ++c) s[r][c] += wr[r] * kj[c];
          }
        }
      } else {
        // One launch: the keys in the entry dtype (fkeys), w u by shuffles.
#pragma unroll
        for (int i = 0; i < NU; ++i)
#pragma unroll
          for (int g0 = 0; g0 < 16; g0 += 4) {
            // Four slots' keys (shared memory), then their rank-one updates.
            float kj[4][KL];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int sl = min(g0 + e + 16 * i, L - 1);
#pragma unroll
              for (int c = 0; c < KL; c += VW)
                ld_entry<VW>(reinterpret_cast<const char*>(fkeys) + sl * kbytes, p.entry_dtype, key(c), &kj[e][c]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int sl = g0 + e + 16 * i;
              if (sl < L) {
                const float w = __shfl_sync(0xffffffffu, cW, sl);
#pragma unroll
                for (int r = 0; r < RL; ++r) {
                  const float wu = w * __shfl_sync(0xffffffffu, u4[i][r & 3], 2 * (g0 + e) + (r >> 2));
#pragma unroll
                  for (int c = 0; c < KL; ++c) s[r][c] += wu * kj[e][c];
                }
              }
            }
          }
      }
      store_state();
    }
  }
  if (writer && step_here) {
    if (!EPI_EARLY) epi = epilogue_in(p, b, 0, h, row0 + rr);
    stx(out.p, out.dtype, out_at, epilogue(p, epi, vt, y));
  }
  if constexpr (FUSED) {
    const int start = hdr.x, hcnt = hdr.y, base = hdr.w;
    const bool flush = hdr.z != 0;
    // Outside a flush the new entry's slot holds no buffered entry: its key (first tile of
    // the key head's first value head) and decay (first tile of the value head) go there now.
    if (!flush && tile == 0 && warp == 0) {
      if (h % (p.hv / p.hk) == 0) {
        char* kd = p.ring_k + ((static_cast<int64_t>(seq) * L + base) * p.hk + kh) * kbytes;
#pragma unroll
        for (int c = 0; c < KL; ++c) stx(kd, p.entry_dtype, key(c), k[c]);
      }
      if (lane == 0) p.ring_g[(static_cast<int64_t>(seq) * L + base) * p.hv + h] = g_new;
    }
    if (p.conv_dim > 0) conv_window_share(p, b, seq, h, tile, conv_end, threadIdx.x, blockDim.x);
    // The last CTA of the sequence to arrive ends its step (everything it writes, the others
    // have finished reading).
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(meta + kMetaArrive, 1) == p.hv * p.tiles - 1;
    __syncthreads();
    if (last) {
      const Place pl{flush, false, base};
      if (flush) ring_keys_and_decays(p, b, seq, base, warp, lane, threadIdx.x, blockDim.x);
      if (threadIdx.x == 0) {
        finish_meta(p, meta, m0.x, start, hcnt, m0.w, conv_end, pl);
        meta[kMetaArrive] = 0;
      }
    }
  }
}

// What every specialized one-launch kernel fixes: q, k, v and the output of dtype X, q, k, v
// row-contiguous, f32 ring entries, the ring exactly `ring` slots long, no conv window.
template <int X>
__device__ __forceinline__ void fd_fix_shared(StepParams& c, int ring) {
  c.q.dtype = X;
  c.k.dtype = X;
  c.v.dtype = X;
  c.out.dtype = X;
  c.q.s[3] = 1;
  c.k.s[3] = 1;
  c.v.s[3] = 1;
  c.entry_dtype = KVR_DT_F32;
  c.l = ring;
  c.conv_dim = 0;
  c.kv_split = 0;  // the state first (a KV-only row of a pool with KV-only mode is still skipped)
}

// The Gated DeltaNet decode as engines call it: the fields above, beta of dtype X, g of
// dtype G, the delta rule with no dt gate, no skip and no gate. The host's check is
// `fdecode_spec` in src/linear/replay/cuda.rs.
template <int X, int G>
struct FdFix {
  static __device__ __forceinline__ void apply(StepParams& c, int ring) {
    fd_fix_shared<X>(c, ring);
    c.beta.dtype = X;
    c.g.dtype = G;
    c.rule = KVR_GDN_RULE_DELTA;
    c.dt_mode = KVR_GDN_DT_NONE;
    c.skip.p = nullptr;
    c.gate.p = nullptr;
  }
};

// Mamba-2 as engines call it (the additive rule, dt through softplus and the clamp): the
// fields above for x, B, C (v, k, q), z (the gate) of dtype X; dt (beta), A, dt_bias and D
// (the skip) f32. Whether D, z and dt_bias are given stays run-time.
template <int X>
struct FdFixM2 {
  static __device__ __forceinline__ void apply(StepParams& c, int ring) {
    fd_fix_shared<X>(c, ring);
    c.gate.dtype = X;
    c.beta.dtype = KVR_DT_F32;
    c.a.dtype = KVR_DT_F32;
    c.dt_bias.dtype = KVR_DT_F32;
    c.skip.dtype = KVR_DT_F32;
    c.rule = KVR_GDN_RULE_ADDITIVE;
    c.dt_mode = KVR_GDN_DT_SOFTPLUS;
  }
};

// The specialized one-launch kernel's parameters (kvr_gdn_fdecode_args) as the kvr_gdn_step_args
// its body reads; the fields it does not carry are zero (FIX sets the ones the build fixes).
__device__ __forceinline__ void from_fdecode_args(StepParams& c, const kvr_gdn_fdecode_args& a) {
  c.state = a.state;
  c.ring_u = a.ring_u;
  c.ring_k = a.ring_k;
  c.ring_g = a.ring_g;
  c.meta = a.meta;
  c.ids = a.ids;
  c.q.p = a.q;
  c.k.p = a.k;
  c.v.p = a.v;
  c.g.p = a.g;
  c.beta.p = a.beta;
  c.out.p = a.out;
  c.skip.p = a.skip;
  c.gate.p = a.gate;
  c.a.p = a.a;
  c.dt_bias.p = a.dt_bias;
  c.seq_stride = a.seq_stride;
  c.q.s[0] = a.q_s0;
  c.q.s[2] = a.q_s2;
  c.k.s[0] = a.k_s0;
  c.k.s[1] = a.k_s1;
  c.k.s[2] = a.k_s2;
  c.v.s[0] = a.v_s0;
  c.v.s[2] = a.v_s2;
  c.g.s[0] = a.g_s0;
  c.g.s[1] = a.g_s1;
  c.g.s[2] = a.g_s2;
  c.beta.s[0] = a.beta_s0;
  c.beta.s[1] = a.beta_s1;
  c.beta.s[2] = a.beta_s2;
  c.out.s[0] = a.out_s0;
  c.out.s[2] = a.out_s2;
  c.out.s[3] = a.out_s3;
  c.skip.s[0] = a.skip_s0;
  c.gate.s[0] = a.gate_s0;
  c.gate.s[2] = a.gate_s2;
  c.gate.s[3] = a.gate_s3;
  c.a.s[0] = a.a_s0;
  c.dt_bias.s[0] = a.dt_bias_s0;
  c.op = a.op;
  c.t = a.t;
  c.hk = a.hk;
  c.hv = a.hv;
  c.dk = a.dk;
  c.dv = a.dv;
  c.tv = a.tv;
  c.tiles = a.tiles;
  c.auto_commit = a.auto_commit;
  c.l2norm = a.l2norm;
  c.scale = a.scale;
  c.dt_min = a.dt_min;
  c.dt_max = a.dt_max;
}

// The specializations built: Gated DeltaNet with bf16 inputs, f32 decays and a bf16 output
// (torch engines) or f32 throughout (ggml); Mamba-2 with bf16 x, B, C, z and output.
using FdBf16 = FdFix<KVR_DT_BF16, KVR_DT_F32>;
using FdF32 = FdFix<KVR_DT_F32, KVR_DT_F32>;
using FdM2Bf16 = FdFixM2<KVR_DT_BF16>;

// Recurrent pools without a prep kernel (ring 0, no conv window): kvr_gdn_wrec_<state>_v_d<dk>,
// KVR_GDN_WREC_ROWS (8) value rows per warp, 4 warps a CTA, grid (dv / (4 R), value heads,
// rows). A recurrent step only streams the state (read, update, write back), so what sets its
// speed is the state bytes in flight per SM. The recurrent kind of wdecode_body carries the
// replay kinds' structure (ring registers, 1-D grid) in 80 registers, 6 CTAs (24 warps) an SM;
// this body needs 64 at dk <= 128, so 8 CTAs (32 warps, a third more rows in flight) fit:
// GDN B = 128 141 against 159 us, Mamba-2 287 against 314 (H200, BENCHMARKS.md). 4 rows a
// warp in 48 registers (40 warps, less in flight) was slower (177 us). Same arithmetic as the
// recurrent kind: S <- e^g S, u = beta (v - S k) (delta rule) or beta v (additive),
// y = S q + (k . q) u, S <- S + u k^T, the skip and gate epilogue, and the step counted by one
// thread per row.
template <typename SD, int DK, int R>
__device__ __forceinline__ void wrec_body(const StepParams& p) {
  constexpr int KL = DK / 32;
  static_assert(R == 4 || R == 8, "rows per warp");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kh = h / (p.hv / p.hk);
  const int row0 = (tile * 4 + warp) * R;
  const int rr = lane & (R - 1);
  const bool writer = lane < R;
  pdl_wait();
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  const Tensor& out = p.out;
  const int64_t out_at = b * out.s[0] + h * out.s[2] + (row0 + rr) * out.s[3];
  if (seq < 0) {
    pdl_launch_dependents();
    if (writer) stx(out.p, out.dtype, out_at, 0.f);
    return;
  }
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  SD* hs = reinterpret_cast<SD*>(p.state + (static_cast<int64_t>(seq) * p.seq_stride +
                                            static_cast<int64_t>(h) * DK * p.dv) *
                                               static_cast<int64_t>(sizeof(SD))) +
           static_cast<int64_t>(row0) * DK;
  float s[R][KL];
  load_rows<SD, DK, R>(hs, s, lane);
  pdl_launch_dependents();
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const bool counter = h == 0 && tile == 0 && threadIdx.x == 0;
  int4 m0 = make_int4(0, 0, 0, 0);
  int conv_end = 0;
  if (counter) {
    m0 = __ldcg(reinterpret_cast<const int4*>(meta));
    conv_end = __ldcg(meta + kMetaConvEnd);
  }
  float q[KL], k[KL];
  load_row<DK>(p.q, b * p.q.s[0] + kh * p.q.s[2], lane, q);
  load_row<DK>(p.k, b * p.k.s[0] + kh * p.k.s[2], lane, k);
  const float vt = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + (row0 + rr) * p.v.s[3]);
  const float2 gb = token_gb(p, b, 0, h);
  EpilogueIn epi{0.f, 0.f};
  if (writer) epi = epilogue_in(p, b, 0, h, row0 + rr);
  normalize_qk<KL>(p, q, k, false);
  const float a = expf(gb.x), bt = gb.y;
  // (S q)_r, (S k)_r of the decayed rows and k . q in one reduce-scatter: lane l ends with
  // P[l / (32 / N)].
  constexpr int N = 4 * R;  // R rows x {q, k}, k . q, padding to a power of two
  float P[N];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float x = 0.f, z = 0.f;
#pragma unroll
    for (int c = 0; c < KL; ++c) {
      s[r][c] *= a;
      x += s[r][c] * q[c];
      z += s[r][c] * k[c];
    }
    P[r] = x;
    P[R + r] = z;
  }
  {
    float kq = 0.f;
#pragma unroll
    for (int c = 0; c < KL; ++c) kq += k[c] * q[c];
    P[2 * R] = kq;
#pragma unroll
    for (int i = 2 * R + 1; i < N; ++i) P[i] = 0.f;
  }
  const float own = reduce_scatter<N>(P, lane);
  constexpr int S = 32 / N;
  const float sq = __shfl_sync(0xffffffffu, own, rr * S);
  const float sk = __shfl_sync(0xffffffffu, own, (R + rr) * S);
  const float kq = __shfl_sync(0xffffffffu, own, 2 * R * S);
  const float u = p.rule == KVR_GDN_RULE_DELTA ? bt * (vt - sk) : bt * vt;
  const float y = sq + kq * u;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float ur = __shfl_sync(0xffffffffu, u, r);
#pragma unroll
    for (int c = 0; c < KL; ++c) s[r][c] += ur * k[c];
  }
  store_rows<SD, DK, R>(hs, s, lane);
  if (writer) stx(out.p, out.dtype, out_at, epilogue(p, epi, vt, y));
  if (counter) finish_meta(p, meta, m0.x, m0.y, m0.z, m0.w, conv_end, placement(p, m0.x, m0.y, m0.z));
}


// K-major states ([dk][dv] per head, fla's layout): kvr_gdn_wdecode_<state>_k_d<dk>_r<ring>,
// the replay kind after the prep kernel (same records) and the recurrent kind, on the same
// grid as the V-major kernels (a CTA per 32 value rows of a (row, value head): `p.tv` 32).
// A key row of a K-major head is dv contiguous values: the CTA's 32 value rows (columns) are
// 128 bytes of each key row. Warp w takes the keys w dk / 4 .. (w + 1) dk / 4 - 1; lane 8 p + g
// holds columns 4 g .. 4 g + 3 of KP = dk / 16 of them (p: a part of the warp's keys) as float4
// rows, so that each state load reads four whole 128-byte lines a warp (the V-major kernel's
// bytes per load instruction; a lane per column, one line a load, ran at 72-74 % of the floor
// at B >= 128 against 79-83 % V-major). The lane's state rows and the u values of its owner's
// ring slots (owner o = 4 w + p: slots o + 16 j) of its columns are loaded first, before the
// wait for the prep kernel; each lane's parts of (S q), (S k) and of the ring's terms are
// summed over the warp's parts by shuffles and meet in shared memory by warp, with a flush's
// w_p u_p and staged keys (one CTA barrier). Warp 0 (a column a lane) then writes the output
// and the new ring entry; a flush folds the ring into every lane's keys by rank-one updates
// from shared memory, e^G S + sum_p w_p k_p u_p^T, and stores them. In the recurrent kind
// every warp computes u of column `lane` from the same sums, and each lane takes its 4
// columns' by shuffles (S <- e^g S + u k^T).
// Same arithmetic as wdecode_body (replay) and its recurrent kind.
// The K-major state kernels' float4 rows (kdecode_body, kverify_body): the u values of ring
// slots owner + 16 j in a lane's 4 columns c4 .. c4 + 3 (0 where there is no slot, or `on`
// is false), and one slot's rank-one update of a lane's rows, s[i][c] += wu[c] k[i].
template <int NJ>
__device__ __forceinline__ void kload_slots(float (&u)[NJ][4], const char* ubase, int dt, int64_t ustride,
                                            int owner, int L, int c4, bool on) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int sl = owner + 16 * j;
#pragma unroll
    for (int c = 0; c < 4; ++c) u[j][c] = 0.f;
    if (on && sl < L) ld_entry<4>(ubase, dt, sl * ustride + c4, u[j]);
  }
}
template <int KP>
__device__ __forceinline__ void kfold_slot(float (&s)[KP][4], float4 wu, const float* k) {
#pragma unroll
  for (int i = 0; i < KP; i += 4) {
    const float4 k4 = *reinterpret_cast<const float4*>(k + i);
    const float kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[i + e][0] += wu.x * kv[e];
      s[i + e][1] += wu.y * kv[e];
      s[i + e][2] += wu.z * kv[e];
      s[i + e][3] += wu.w * kv[e];
    }
  }
}

template <typename SD, int DK, int LU, int KIND>
__device__ void kdecode_body(const StepParams& p, const int32_t* ids_inline) {
  constexpr bool REC = KIND == kWRec;
  static_assert(KIND == kWRec || KIND == kWPrep, "the K-major kinds");
  constexpr int KW = DK / 4;              // keys per warp
  constexpr int KP = DK / 16;             // keys per lane (a part of the warp's keys)
  constexpr int LC = LU > 0 ? LU : 1;     // ring slots (compiled)
  constexpr int NJ = (LC + 15) / 16;      // slots per owner
  static_assert(KP % 4 == 0, "float4 reads of a lane's keys");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane & 7, part = lane >> 3, owner = 4 * warp + part;
  if (REC && p.conv_dim == 0) {
    // No prep kernel: a programmatic dependent of the stream's previous kernel, which may
    // have written everything read here.
    pdl_wait();
    pdl_launch_dependents();
  }
  // Grid (tiles, value heads, batch rows), as wdecode_body's.
  const int tile = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int dv = p.dv, L = p.l;
  const int kh = h / (p.hv / p.hk);
  const int col0 = tile * p.tv, col = col0 + lane, c4 = col0 + 4 * g;
  const int kw0 = warp * KW, k0 = kw0 + part * KP;
  const int seq = p.ids ? p.ids[b] : ids_inline[b];
  const Tensor& out = p.out;
  const int64_t out_at = b * out.s[0] + h * out.s[2] + col * out.s[3];
  if (seq < 0) {
    if (warp == 0) stx(out.p, out.dtype, out_at, 0.f);
    return;
  }
  SD* hs = reinterpret_cast<SD*>(p.state + (static_cast<int64_t>(seq) * p.seq_stride +
                                            static_cast<int64_t>(h) * DK * dv) *
                                               static_cast<int64_t>(sizeof(SD))) +
           static_cast<int64_t>(k0) * dv + c4;
  // Pools with KV-only mode (`kv_split` 1): the state once the record says the row has one,
  // as wdecode_body.
  if (!REC && p.kv_split != 0 &&
      __ldcg(p.meta + static_cast<int64_t>(seq) * kMetaInts + kMetaMode) == kModeKvOnly)
    return;
  float s[KP][4];
#pragma unroll
  for (int i = 0; i < KP; ++i) ld_state<SD, 4>(hs + static_cast<int64_t>(i) * dv, s[i]);
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  // The owner's ring slots, the lane's columns, before the metadata.
  const char* ubase = p.ring_u + (static_cast<int64_t>(seq) * L * p.hv + h) * dv * ee;
  const int64_t ustride = static_cast<int64_t>(p.hv) * dv;
  float uo[NJ][4];
  kload_slots<NJ>(uo, ubase, p.entry_dtype, ustride, owner, L, c4, !REC);
  __shared__ __align__(16) float qks[4][2][KW];  // the warp's keys of q and k
  __shared__ __align__(16) float red[2][4][32];  // partial (S q), (S k) by warp and column
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const bool counter = REC && h == 0 && tile == 0 && threadIdx.x == 0;
  int4 m0 = make_int4(0, 0, 0, 0);
  int conv_end = 0;
  if (counter) {
    m0 = __ldcg(reinterpret_cast<const int4*>(meta));
    conv_end = __ldcg(meta + kMetaConvEnd);
  }
  float a, bt, kq, vt = 0.f, eG = 1.f;
  int4 hdr = make_int4(0, 0, 0, 0);
  float cA = 0.f, cB = 0.f;
  const kvr_gdn_dscratch lay = kvr_gdn_dscratch_layout(p.b, p.hv, p.hk, DK, p.dv, L);
  const float* rec = p.scratch + lay.rec + (static_cast<int64_t>(b) * p.hv + h) * lay.rec_floats;
  EpilogueIn epi{0.f, 0.f};
  // Recurrent: q and k of the warp's keys as given (the L2 norms are scalar factors: their
  // sums of squares meet in shared memory with the dot products, below).
  float nq = 0.f, nk = 0.f, nkq = 0.f;
  if constexpr (REC) {
    // v of column `lane` in every warp (each lane's u of its 4 columns comes by shuffles).
    vt = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + col * p.v.s[3]);
    const float2 gb = token_gb(p, b, 0, h);
    if (warp == 0) epi = epilogue_in(p, b, 0, h, col);
    for (int i = lane; i < KW; i += 32) {
      const float qv = ldx(p.q.p, p.q.dtype, b * p.q.s[0] + kh * p.q.s[2] + (kw0 + i) * p.q.s[3]);
      const float kv = ldx(p.k.p, p.k.dtype, b * p.k.s[0] + kh * p.k.s[2] + (kw0 + i) * p.k.s[3]);
      qks[warp][0][i] = qv;
      qks[warp][1][i] = kv;
      nq += qv * qv;
      nk += kv * kv;
      nkq += kv * qv;
    }
    a = expf(gb.x);
    bt = gb.y;
    kq = 0.f;
  } else {
    pdl_wait();
    // A prep kernel of several CTAs per row only read the metadata: one thread ends the step.
    if (p.stages > 1 && h == 0 && tile == 0 && threadIdx.x == 0) {
      const int4 m = __ldcg(reinterpret_cast<const int4*>(meta));
      if (m.x != kModeKvOnly)  // (kvr_gdn_kvdec_* advanced a KV-only row's record)
        finish_meta(p, meta, m.x, m.y, m.z, m.w, __ldcg(meta + kMetaConvEnd), placement(p, m.x, m.y, m.z));
    }
    // The header's test after the other loads: an exit right after the header's load put its
    // round trip in front of them (wdecode_body).
    hdr = __ldcg(reinterpret_cast<const int4*>(p.scratch + lay.hdr) + b);
    const float4 r0 = __ldcg(reinterpret_cast<const float4*>(rec));
    eG = r0.x;
    a = r0.y;
    bt = r0.z;
    kq = r0.w;
    cA = lane < L ? __ldcg(rec + 4 + lane) : 0.f;
    cB = lane < L ? __ldcg(rec + 4 + L + lane) : 0.f;
    const float* qk = p.scratch + lay.qk + (static_cast<int64_t>(b) * p.hk + kh) * 2 * DK;
    for (int i = lane; i < KW; i += 32) {
      qks[warp][0][i] = __ldcg(qk + kw0 + i);
      qks[warp][1][i] = __ldcg(qk + DK + kw0 + i);
    }
    if (warp == 0) {
      const char* vrow = reinterpret_cast<const char*>(p.scratch + lay.vv) + static_cast<int64_t>(b) * p.hv * dv * 4;
      vt = ldx(vrow, p.v.dtype, static_cast<int64_t>(h) * dv + col);
      epi = epilogue_in(p, b, 0, h, col);
    }
    if (hdr.y < 0) return;  // kvr_gdn_kvdec's row (pools with KV-only mode)
  }
  __syncwarp();
  // The lane's part of (S q) and (S k) of its 4 columns.
  const float* lq = &qks[warp][0][part * KP];
  const float* lk = &qks[warp][1][part * KP];
  float tq[4] = {0.f, 0.f, 0.f, 0.f}, tk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < KP; i += 4) {
    const float4 q4 = *reinterpret_cast<const float4*>(lq + i);
    const float4 k4 = *reinterpret_cast<const float4*>(lk + i);
    const float qv[4] = {q4.x, q4.y, q4.z, q4.w}, kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        tq[c] += s[i + e][c] * qv[e];
        tk[c] += s[i + e][c] * kv[e];
      }
  }
  const bool delta = p.rule == KVR_GDN_RULE_DELTA;
  const int start = hdr.x, nbuf = hdr.y, base = hdr.w;
  const bool flush = hdr.z != 0;
  if constexpr (!REC) {
    // e^G (S q) + the owner's slots' terms sum_p A/B_p u_p (slots holding no buffered entry
    // masked by selects: one may be being rewritten).
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      tq[c] *= eG;
      tk[c] *= eG;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int sl = owner + 16 * j;
      const int jj = sl - start + (sl < start ? L : 0);
      const bool live = sl < L && jj < nbuf;
      const float ca = __shfl_sync(0xffffffffu, cA, sl & 31), cb = __shfl_sync(0xffffffffu, cB, sl & 31);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        tq[c] += pick(live, ca * uo[j][c], 0.f);
        tk[c] += pick(live, cb * uo[j][c], 0.f);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    tq[c] += __shfl_xor_sync(0xffffffffu, tq[c], 8);
    tq[c] += __shfl_xor_sync(0xffffffffu, tq[c], 16);
    tk[c] += __shfl_xor_sync(0xffffffffu, tk[c], 8);
    tk[c] += __shfl_xor_sync(0xffffffffu, tk[c], 16);
  }
  if (part == 0) {
    *reinterpret_cast<float4*>(&red[0][warp][4 * g]) = make_float4(tq[0], tq[1], tq[2], tq[3]);
    *reinterpret_cast<float4*>(&red[1][warp][4 * g]) = make_float4(tk[0], tk[1], tk[2], tk[3]);
  }
  __shared__ float nrm[4][3];
  if constexpr (REC) {
    nq = warp_sum(nq);
    nk = warp_sum(nk);
    nkq = warp_sum(nkq);
    if (lane == 0) {
      nrm[warp][0] = nq;
      nrm[warp][1] = nk;
      nrm[warp][2] = nkq;
    }
  }
  // A flush: every slot is buffered. w_p u_p of the CTA's columns (each owner its slots) and
  // every slot's keys (the base slot's, displaced by the new entry's, from the scratch) to
  // shared memory before the barrier, the fold after it.
  __shared__ __align__(16) float fk[REC ? 1 : LC][DK];
  __shared__ __align__(16) float fwu[REC ? 1 : LC][32];
  if constexpr (!REC) {
    if (flush) {
      const float cW = lane < L ? __ldcg(rec + 4 + 2 * L + lane) : 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int sl = owner + 16 * j;
        const float w = __shfl_sync(0xffffffffu, cW, sl & 31);
        if (sl < L)
          *reinterpret_cast<float4*>(&fwu[sl][4 * g]) =
              make_float4(w * uo[j][0], w * uo[j][1], w * uo[j][2], w * uo[j][3]);
      }
      const char* kbase = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * DK * ee;
      const int64_t kstride = static_cast<int64_t>(p.hk) * DK;
      const float* moved = p.scratch + lay.keys + (static_cast<int64_t>(b) * p.hk + kh) * DK;
      // 4 keys a copy (cp.async for f32 entries: every copy in flight at once).
      for (int i = threadIdx.x; i < L * DK / 4; i += blockDim.x) {
        const int sl = i / (DK / 4), x = 4 * (i - sl * (DK / 4));
        if (sl == base) {
          cp_async_16(&fk[sl][x], moved + x, 16);
        } else if (p.entry_dtype == KVR_DT_F32) {
          cp_async_16(&fk[sl][x], reinterpret_cast<const float*>(kbase) + sl * kstride + x, 16);
        } else {
          float t[4];
          ld_entry<4>(kbase, p.entry_dtype, sl * kstride + x, t);
          *reinterpret_cast<float4*>(&fk[sl][x]) = make_float4(t[0], t[1], t[2], t[3]);
        }
      }
      cp_async_commit();
      cp_async_wait<0>();
    }
  }
  __syncthreads();
  // Column `lane`'s sums (warp 0 writes the outputs).
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    sq += red[0][w][lane];
    sk += red[1][w][lane];
  }
  if constexpr (REC) {
    // q = q / |q| (if asked) scaled, k = k / |k|; S <- e^g S + u k^T (every warp computes u
    // of column `lane`; each lane takes its 4 columns' by shuffles).
    float sqq = 0.f, skk = 0.f, skq = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      sqq += nrm[w][0];
      skk += nrm[w][1];
      skq += nrm[w][2];
    }
    const float fq = (p.l2norm ? 1.f / sqrtf(sqq + 1e-6f) : 1.f) * p.scale;
    const float fkn = p.l2norm ? 1.f / sqrtf(skk + 1e-6f) : 1.f;
    kq = fq * fkn * skq;
    const float tqc = sq * a * fq, tkc = sk * a * fkn;
    const float u = delta ? bt * (vt - tkc) : bt * vt;
    float uk[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) uk[c] = __shfl_sync(0xffffffffu, u * fkn, 4 * g + c);
#pragma unroll
    for (int i = 0; i < KP; ++i) {
      const float kv = lk[i];
#pragma unroll
      for (int c = 0; c < 4; ++c) s[i][c] = a * s[i][c] + uk[c] * kv;
    }
#pragma unroll
    for (int i = 0; i < KP; ++i) st_state<SD, 4>(hs + static_cast<int64_t>(i) * dv, s[i]);
    if (warp == 0) stx(out.p, out.dtype, out_at, epilogue(p, epi, vt, tqc + kq * u));
    if (p.conv_dim > 0) pdl_wait();
    if (counter) finish_meta(p, meta, m0.x, m0.y, m0.z, m0.w, conv_end, placement(p, m0.x, m0.y, m0.z));
  } else {
    if (warp == 0) {
      const float u = delta ? bt * (vt - a * sk) : bt * vt;
      const float y = a * sq + kq * u;
      char* dst = p.ring_u + ((static_cast<int64_t>(seq) * L + base) * p.hv + h) * dv * ee;
      stx(dst, p.entry_dtype, col, u);
      stx(out.p, out.dtype, out_at, epilogue(p, epi, vt, y));
    }
    if (flush) {
#pragma unroll
      for (int i = 0; i < KP; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[i][c] *= eG;
#pragma unroll
      for (int sl = 0; sl < LC; ++sl) {
        if (sl < L) kfold_slot<KP>(s, *reinterpret_cast<const float4*>(&fwu[sl][4 * g]), &fk[sl][k0]);
      }
#pragma unroll
      for (int i = 0; i < KP; ++i) st_state<SD, 4>(hs + static_cast<int64_t>(i) * dv, s[i]);
    }
  }
}

}  // namespace gdn
}  // namespace kvr

#define KVR_GDN_DPREP(DK, LU)                                                                 \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_DPREP_THREADS, 2)                    \
      kvr_gdn_dprep_d##DK##_r##LU(const __grid_constant__ kvr::gdn::StepParams p) {           \
    kvr::gdn::dprep_body<DK, LU>(p, p.ids_inline);                                            \
  }
// 4 warps a CTA (32 rows of one head); rings of up to LU slots. Resident CTAs per SM the
// registers aim for: at dk 128, 6 (80 registers) measured faster than 4 and 8 on the H200.
#define KVR_GDN_WDECODE(SD, SN, DK, LU, MB)                                                   \
  extern "C" __global__ void __launch_bounds__(128, MB)                                       \
      kvr_gdn_wdecode_##SN##_v_d##DK##_r##LU(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::wdecode_body<SD, DK, LU == 0 ? 1 : LU / 16, LU == 0 ? kvr::gdn::kWRec : kvr::gdn::kWPrep>(p, p.ids_inline); \
  }
// Small batches, one launch (rings of up to LU slots, 16 or 32), grid (tiles, hv, rows).
#ifndef KVR_FDECODE_MINB
#define KVR_FDECODE_MINB 4
#endif
#define KVR_GDN_FDECODE(SD, SN, DK, LU)                                                       \
  extern "C" __global__ void __launch_bounds__(128, (DK) > 128 ? 2 : KVR_FDECODE_MINB)       \
      kvr_gdn_fdecode_##SN##_v_d##DK##_r##LU(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::wdecode_body<SD, DK, LU / 16, kvr::gdn::kWFused>(p, p.ids_inline);              \
  }
// The one-launch kernel specialized (kvr_gdn_fdecode_<state>_v_d<dk>_r<LU>_<FN>): a copy of the
// parameters with the fields FIX fixes replaced by constants, so that the chain in front of
// the first arithmetic loses its run-time dtype dispatch, flags and ring-length arithmetic
// (the host launches it only where those fields hold these values:
// src/linear/replay/cuda.rs, FdSpec). Its parameters are the compact kvr_gdn_fdecode_args (the
// fields these builds read, in fewer constant-cache lines: at one sequence the parameter
// loads at entry were the largest stall); the compiler keeps the rebuilt copy in registers.
#define KVR_GDN_FDECODE_FIX(SD, SN, DK, LU, FIX, FN)                                          \
  extern "C" __global__ void __launch_bounds__(128, (DK) > 128 ? 2 : KVR_FDECODE_MINB)       \
      kvr_gdn_fdecode_##SN##_v_d##DK##_r##LU##_##FN(const __grid_constant__ kvr_gdn_fdecode_args p) { \
    kvr::gdn::StepParams c = {};                                                              \
    kvr::gdn::from_fdecode_args(c, p);                                                        \
    FIX::apply(c, LU);                                                                        \
    kvr::gdn::wdecode_body<SD, DK, LU / 16, kvr::gdn::kWFused>(c, p.ids_inline);              \
  }
// The two launches specialized the same way (kvr_gdn_dprep_d128_r<LU>_<FN>,
// kvr_gdn_wdecode_<state>_v_d128_r<LU>_<FN>; the host pairs them for the calls that
// `fdecode_spec` accepts). The state kernel's per-row work behind its wait is the chain a
// step waits for: without the run-time dtype dispatch and flags a step took 178 against 201 us
// (GDN, B = 256) and 185 against 202 (Mamba-2, B = 128) on the H200 (BENCHMARKS.md).
#define KVR_GDN_DPREP_FIX(LU, FIX, FN)                                                        \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_DPREP_THREADS, 2)                    \
      kvr_gdn_dprep_d128_r##LU##_##FN(const __grid_constant__ kvr::gdn::StepParams p) {      \
    kvr::gdn::StepParams c = p;                                                               \
    FIX::apply(c, LU);                                                                        \
    kvr::gdn::dprep_body<128, LU>(c, p.ids_inline);                                           \
  }
#define KVR_GDN_WDECODE_FIX(SD, SN, LU, FIX, FN)                                              \
  extern "C" __global__ void __launch_bounds__(128, 6)                                        \
      kvr_gdn_wdecode_##SN##_v_d128_r##LU##_##FN(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::StepParams c = p;                                                               \
    FIX::apply(c, LU);                                                                        \
    kvr::gdn::wdecode_body<SD, 128, LU / 16, kvr::gdn::kWPrep>(c, p.ids_inline);              \
  }
#define KVR_GDN_WDECODE_DK(DK, MB)                      \
  KVR_GDN_DPREP(DK, 16)                                 \
  KVR_GDN_DPREP(DK, 32)                                 \
  KVR_GDN_WDECODE(float, f32, DK, 0, MB)                \
  KVR_GDN_WDECODE(float, f32, DK, 16, MB)               \
  KVR_GDN_WDECODE(float, f32, DK, 32, MB)               \
  KVR_GDN_WDECODE(__nv_bfloat16, bf16, DK, 0, MB)       \
  KVR_GDN_WDECODE(__nv_bfloat16, bf16, DK, 16, MB)      \
  KVR_GDN_WDECODE(__nv_bfloat16, bf16, DK, 32, MB)      \
  KVR_GDN_FDECODE(float, f32, DK, 16)                   \
  KVR_GDN_FDECODE(float, f32, DK, 32)                   \
  KVR_GDN_FDECODE(__nv_bfloat16, bf16, DK, 16)          \
  KVR_GDN_FDECODE(__nv_bfloat16, bf16, DK, 32)
#define KVR_GDN_FDECODE_SPECS(SD, SN, LU)                                            \
  KVR_GDN_FDECODE_FIX(SD, SN, 128, LU, kvr::gdn::FdBf16, xbf16)                                \
  KVR_GDN_FDECODE_FIX(SD, SN, 128, LU, kvr::gdn::FdF32, xf32)                                  \
  KVR_GDN_FDECODE_FIX(SD, SN, 128, LU, kvr::gdn::FdM2Bf16, m2bf16)                             \
  KVR_GDN_WDECODE_FIX(SD, SN, LU, kvr::gdn::FdBf16, xbf16)                                     \
  KVR_GDN_WDECODE_FIX(SD, SN, LU, kvr::gdn::FdF32, xf32)                                       \
  KVR_GDN_WDECODE_FIX(SD, SN, LU, kvr::gdn::FdM2Bf16, m2bf16)
#define KVR_GDN_DPREP_SPECS(LU)                                                       \
  KVR_GDN_DPREP_FIX(LU, kvr::gdn::FdBf16, xbf16)                                               \
  KVR_GDN_DPREP_FIX(LU, kvr::gdn::FdF32, xf32)                                                 \
  KVR_GDN_DPREP_FIX(LU, kvr::gdn::FdM2Bf16, m2bf16)
KVR_GDN_WDECODE_DK(64, 8)
KVR_GDN_WDECODE_DK(128, 6)
KVR_GDN_WDECODE_DK(256, 2)
// Recurrent pools without a prep kernel (wrec_body): 8 CTAs per SM up to dk 128 (64 registers,
// no spills with nvcc 13.0 at sm_90a), 2 at dk 256.
#define KVR_GDN_WREC(SD, SN, DK)                                                              \
  extern "C" __global__ void __launch_bounds__(128, (DK) > 128 ? 2 : KVR_GDN_WREC_MINB)      \
      kvr_gdn_wrec_##SN##_v_d##DK(const __grid_constant__ kvr::gdn::StepParams p) {          \
    kvr::gdn::wrec_body<SD, DK, KVR_GDN_WREC_ROWS>(p);                                        \
  }
KVR_GDN_WREC(float, f32, 64)
KVR_GDN_WREC(float, f32, 128)
KVR_GDN_WREC(float, f32, 256)
KVR_GDN_WREC(__nv_bfloat16, bf16, 64)
KVR_GDN_WREC(__nv_bfloat16, bf16, 128)
KVR_GDN_WREC(__nv_bfloat16, bf16, 256)
#undef KVR_GDN_WREC
// K-major states (kdecode_body): the recurrent kind (ring 0) and the replay kind after the
// prep kernel (rings of up to 16 or 32), grid and prep records as kvr_gdn_wdecode_*_v_*.
#define KVR_GDN_KDECODE(SD, SN, DK, LU, MB)                                                   \
  extern "C" __global__ void __launch_bounds__(128, MB)                                       \
      kvr_gdn_wdecode_##SN##_k_d##DK##_r##LU(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::kdecode_body<SD, DK, LU, LU == 0 ? kvr::gdn::kWRec : kvr::gdn::kWPrep>(p, p.ids_inline); \
  }
// Specialized like KVR_GDN_WDECODE_FIX (kvr_gdn_wdecode_<state>_k_d128_r<LU>_<FN>, paired with
// kvr_gdn_dprep_d128_r<LU>_<FN>).
#define KVR_GDN_KDECODE_FIX(SD, SN, LU, FIX, FN)                                              \
  extern "C" __global__ void __launch_bounds__(128, 6)                                        \
      kvr_gdn_wdecode_##SN##_k_d128_r##LU##_##FN(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::StepParams c = p;                                                               \
    FIX::apply(c, LU);                                                                        \
    kvr::gdn::kdecode_body<SD, 128, LU, kvr::gdn::kWPrep>(c, p.ids_inline);                   \
  }
#define KVR_GDN_KDECODE_SPECS(SD, SN, LU)                              \
  KVR_GDN_KDECODE_FIX(SD, SN, LU, kvr::gdn::FdBf16, xbf16)            \
  KVR_GDN_KDECODE_FIX(SD, SN, LU, kvr::gdn::FdF32, xf32)              \
  KVR_GDN_KDECODE_FIX(SD, SN, LU, kvr::gdn::FdM2Bf16, m2bf16)
KVR_GDN_KDECODE_SPECS(float, f32, 16)
KVR_GDN_KDECODE_SPECS(float, f32, 32)
KVR_GDN_KDECODE_SPECS(__nv_bfloat16, bf16, 16)
KVR_GDN_KDECODE_SPECS(__nv_bfloat16, bf16, 32)
#undef KVR_GDN_KDECODE_SPECS
#undef KVR_GDN_KDECODE_FIX
#define KVR_GDN_KDECODE_DK(DK, MB)                \
  KVR_GDN_KDECODE(float, f32, DK, 0, (DK) > 128 ? MB : 8)     \
  KVR_GDN_KDECODE(float, f32, DK, 16, MB)         \
  KVR_GDN_KDECODE(float, f32, DK, 32, MB)         \
  KVR_GDN_KDECODE(__nv_bfloat16, bf16, DK, 0, (DK) > 128 ? MB : 8) \
  KVR_GDN_KDECODE(__nv_bfloat16, bf16, DK, 16, MB) \
  KVR_GDN_KDECODE(__nv_bfloat16, bf16, DK, 32, MB)
KVR_GDN_KDECODE_DK(64, 8)
KVR_GDN_KDECODE_DK(128, 6)
KVR_GDN_KDECODE_DK(256, 2)
#undef KVR_GDN_KDECODE_DK
#undef KVR_GDN_KDECODE
KVR_GDN_FDECODE_SPECS(float, f32, 16)
KVR_GDN_FDECODE_SPECS(float, f32, 32)
KVR_GDN_FDECODE_SPECS(__nv_bfloat16, bf16, 16)
KVR_GDN_FDECODE_SPECS(__nv_bfloat16, bf16, 32)
KVR_GDN_DPREP_SPECS(16)
KVR_GDN_DPREP_SPECS(32)
#undef KVR_GDN_DPREP_SPECS
#undef KVR_GDN_DPREP_FIX
#undef KVR_GDN_WDECODE_FIX
#undef KVR_GDN_FDECODE_SPECS
#undef KVR_GDN_FDECODE_FIX
#undef KVR_GDN_WDECODE_DK
#undef KVR_GDN_DPREP
#undef KVR_GDN_WDECODE
#undef KVR_GDN_FDECODE
