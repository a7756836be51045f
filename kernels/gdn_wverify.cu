// Gated DeltaNet (and additive-rule: Mamba-2, linear attention) speculative verify of T = 1..8
// drafts, warp-streaming form, in two launches:
//   kvr_gdn_wvprep_d<dk>                     one CTA per (batch row, key head): the bookkeeping
//   kvr_gdn_wverify_<state>_v_d<dk>_t<4|8>   one warp per 8 value rows of a (row, value head):
//   kvr_gdn_wverify_..._add                  the state stream and everything per value row
//   kvr_gdn_wverify_<state>_k_d<dk>_t<4|8>   K-major states (kverify_body, below)
// for pools without KV-only mode, rings of up to KVR_GDN_WVERIFY_MAX_RING entries
// (src/linear/replay/cuda.rs picks it; other pools verify on gdn_sverify.cu).
//
// gdn_sverify.cu's verify stages each state tile in shared memory and runs a chain of
// dependent phases per CTA behind barriers (metadata, records, tile, readouts, sums, rows):
// 2-3 CTAs per SM kept a fifth of the state bandwidth busy (H200, BENCHMARKS.md). This is
// the decode's split (gdn_wdecode.cu) for T drafts: everything that depends on the metadata
// is done by a small kernel first, and the state kernel, its programmatic dependent, issues
// its state rows and every ring slot's u values before it waits for anything.
//
// Math (math::verify_head; gdn_sverify.cu): per value row v, with the history
// H(x) = e^G (S x)[v] + sum_j w_j (k_j . x) u_j[v] (checkpoint S, ring entries j < h, w_j the
// decays of the entries newer than j) and gam_s = g_0 + ... + g_s,
//   u_s = beta_s (v_s - e^{gam_s} H(k_s)) - sum_{s' < s} beta_s e^{gam_s - gam_s'} (k_s . k_s') u_s'
//   y_s = e^{gam_s} H(q_s) + sum_{s' <= s} e^{gam_s - gam_s'} (k_s' . q_s) u_s'
// (additive rule: u_s = beta_s v_s, no H(k_s)). The u_s go into the ring after the committed
// entries and the metadata records T pending drafts (kvr_gdn_commit keeps the accepted
// prefix). When h + 2T > L the ring flushes first: e^G S + sum_j w_j u_j k_j^T is written back
// and the drafts start a new ring.
//
// kvr_gdn_wvprep (per row and key head; lets the state kernel launch at once; `_r16`: records of
// 16 slots for the `_r16` state kernels, rings of up to 16): the metadata;
// every ring slot's key (by physical slot: no wait for the metadata) and decays; the drafts'
// q and k normalized (into the scratch for the state kernel); their products with each other
// and with every slot's key; per value head of the group the weights w_j, e^G, e^{gam_s},
// beta_s and both coefficient sets (kvr_gdn_wvrec_layout, entries' by slot, 0 where a slot
// holds no buffered entry); then the drafts' keys and decays into their ring slots (in a
// flush, a slot that still holds an entry the state kernel folds has its key moved to the
// scratch first) and the drafts' conv inputs. The state kernel writes the new metadata (one
// thread per row, once its griddepcontrol.wait has seen every prep CTA end).
//
// kvr_gdn_wverify (per warp: 8 value rows with the whole key dimension in registers; lane
// 8 x + r serves row r and ring slots x, x + 4, ..): state rows, the u values of its slots and
// the drafts' v (and gate) first; then the wait, the record and the drafts' q, k copied to
// shared memory; per draft the two state dot products of every row (one reduce-scatter), the
// ring's part from the lane's slots (summed over the 4 lanes of a row), the row's forward
// substitution, its output and ring entry; a flush folds the ring into the rows and stores them.
#include "gdn_wdecode.cu"
#include "gdn_stream.cuh"

namespace kvr {
namespace gdn {

constexpr int kWvSlots = KVR_GDN_WVERIFY_MAX_RING;
constexpr int kWvPrepWarps = KVR_GDN_WVPREP_THREADS / 32;
static_assert(kWvSlots == 64, "lane x of a row holds ring slots x + 4 i, i < 16");

// A slot's position in a record's coefficient rows of NSL slots: a lane quarter's slots
// contiguous (kvr_gdn_wvrec_layout_r).
template <int NSL>
__device__ __forceinline__ int wv_slot_at(int p) {
  return (p & 3) * (NSL / 4) + (p >> 2);
}

// NSL: the record's ring slots (64, or 16 for the `_r16` state kernels: rings of up to 16);
// ENG: the engines' calls only (f32 entries, no conv window: the specialized state kernels');
// NW: the CTA's warps (blockDim.x / 32), each normalizing one draft: the host launches a build
// of fewer than kMaxT warps only for T <= NW drafts.
template <int DK, int NSL = kWvSlots, bool ENG = false, int NW = kWvPrepWarps>
__device__ void wvprep_body(const StepParams& p) {
  pdl_launch_dependents();
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  constexpr int SPW = NSL / NW;
  static_assert(NSL % NW == 0 && NSL <= kWvSlots && NW <= kWvPrepWarps, "slots over the warps");
  __shared__ float qs[kMaxT * DK], ks[kMaxT * DK];
  __shared__ float prq[kMaxT * NSL], prk[kMaxT * NSL];
  __shared__ float cc[2 * kMaxT * kMaxT];
  __shared__ int mi[4];
  extern __shared__ float wvdyn[];  // ring decays [group][L], the drafts' (g, beta) [group][2][T]
  const int T = p.t, Tm = p.max_drafts, L = p.l;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x / p.hk, kh = blockIdx.x - b * p.hk;
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  if (seq < 0) return;
  const int group = p.hv / p.hk, h0 = kh * group;
  const int edt = ENG ? KVR_DT_F32 : p.entry_dtype;
  const int ee = edt == KVR_DT_F32 ? 4 : 2;
  const kvr_gdn_wvscratch lay = kvr_gdn_wvscratch_layout(p.b, p.hv, p.hk, DK, Tm);
  const kvr_gdn_wvrec rl = kvr_gdn_wvrec_layout_r(Tm, NSL);
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  // Every slot's key of this key head (warp w: slots w + 8 e), before the metadata.
  const char* kbase = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * DK * ee;
  const int64_t kstride = static_cast<int64_t>(p.hk) * DK * ee;
  float kj[SPW][KL];
#pragma unroll
  for (int e = 0; e < SPW; ++e) {
    const int sl = warp + NW * e;
#pragma unroll
    for (int c = 0; c < KL; c += VW)
      if (sl < L) ld_entry<VW>(kbase + sl * kstride, edt, key(c), &kj[e][c]);
  }
  const int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  if (tid == 0) {
    const int4 m = __ldcg(reinterpret_cast<const int4*>(meta));
    mi[0] = m.y;
    mi[1] = m.z;
    mi[2] = __ldcg(meta + kMetaConvEnd);
  }
  float* gsm = wvdyn;
  float* tgb = wvdyn + group * L;
  for (int i = tid; i < group * L; i += blockDim.x) {  // one load each, all in flight
    const int hh = i / L, sl = i - hh * L;
    gsm[i] = __ldcg(p.ring_g + (static_cast<int64_t>(seq) * L + sl) * p.hv + h0 + hh);
  }
  for (int i = tid; i < group * T; i += blockDim.x) {
    const int hh = i / T, s = i - hh * T;
    const float2 gb = token_gb(p, b, s, h0 + hh);
    tgb[hh * 2 * T + s] = gb.x;
    tgb[hh * 2 * T + T + s] = gb.y;
  }
  // The drafts' q and k normalized (k rounded to the entry dtype, as buffered): warp s draft
  // s, whose k stays in registers for its products with the drafts.
  float* gqk = p.scratch + lay.qk + (static_cast<int64_t>(b) * p.hk + kh) * 2 * Tm * DK;
  float k[KL];
  if (warp < T) {
    const int s = warp;
    float q[KL];
    load_row<DK>(p.q, b * p.q.s[0] + s * p.q.s[1] + kh * p.q.s[2], lane, q);
    load_row<DK>(p.k, b * p.k.s[0] + s * p.k.s[1] + kh * p.k.s[2], lane, k);
    normalize_qk<KL>(p, q, k, true);
#pragma unroll
    for (int c = 0; c < KL; ++c) {
      qs[s * DK + key(c)] = q[c];
      ks[s * DK + key(c)] = k[c];
      gqk[s * DK + key(c)] = q[c];
      gqk[(Tm + s) * DK + key(c)] = k[c];
    }
  }
  __syncthreads();  // q, k, metadata, decays, (g, beta)
  const int start = mi[0], hcnt = mi[1], conv_end = mi[2];
  const bool flush = hcnt + 2 * T > L;
  const int base = (start + hcnt) % L;
  // Slot sl's position in ring order, (sl - start) mod L for sl < L (no division).
  auto ring_pos = [&](int sl) { return sl - start + (sl < start ? L : 0); };
  auto live = [&](int sl) { return sl < L && ring_pos(sl) < hcnt; };
  // The buffered entries' products with the drafts (k_p . q_s, k_p . k_s), and the drafts'
  // with each other from warp s' (k_s' . q_s for every s at cc[kMaxT^2 + s kMaxT + s'],
  // k_s' . k_s at cc[s kMaxT + s']: the readers take s' <= s and s' < s).
#pragma unroll
  for (int e = 0; e < SPW; ++e) {
    const int sl = warp + NW * e;
    if (live(sl)) dots_2t<KL, VW, DK>(kj[e], qs, ks, T, lane, prq, prk, NSL, sl);
  }
  if (warp < T) dots_2t<KL, VW, DK>(k, qs, ks, T, lane, cc + kMaxT * kMaxT, cc, kMaxT, warp);
  __syncthreads();  // products
  // Per value head: the weights of the buffered entries in ring order (lane j: entries j and
  // j + 32), then by slot (lane p: slots p and p + 32); the drafts' scalars and coefficients.
  for (int hh = warp; hh < group; hh += NW) {
    const int h = h0 + hh;
    float* rec = p.scratch + lay.rec + (static_cast<int64_t>(b) * p.hv + h) * lay.rec_floats;
    const float* gh = gsm + hh * L;
    const float2 s0 = warp_suffix(lane < hcnt ? gh[(start + lane) % L] : 0.f, lane);
    float w0 = expf(s0.x), w1 = 0.f, G = s0.y;
    if constexpr (NSL > 32) {
      const float2 s1 = warp_suffix(lane + 32 < hcnt ? gh[(start + lane + 32) % L] : 0.f, lane);
      w0 = expf(s0.x + s1.y);
      w1 = expf(s1.x);
      G += s1.y;
    }
#pragma unroll
    for (int half = 0; half < (NSL + 31) / 32; ++half) {
      const int sl = lane + 32 * half;
      const int j = ring_pos(sl);
      const float wa = __shfl_sync(0xffffffffu, w0, j & 31), wb = __shfl_sync(0xffffffffu, w1, j & 31);
      if (sl >= NSL) continue;
      const bool lv = live(sl);
      const float w = lv ? (j < 32 ? wa : wb) : 0.f;
      rec[rl.w + sl] = w;
      const int at = wv_slot_at<NSL>(sl);
      for (int s = 0; s < T; ++s) {
        rec[rl.a + s * NSL + at] = lv ? w * prq[s * NSL + sl] : 0.f;
        rec[rl.b + s * NSL + at] = lv ? w * prk[s * NSL + sl] : 0.f;
      }
    }
    // gam_s = g_0 + .. + g_s in lane s.
    const float* tg = tgb + hh * 2 * T;
    float gl = 0.f;
    for (int i = 0; i < T; ++i) gl += i <= lane ? tg[i] : 0.f;
    if (lane == 0) {
      int* hi = reinterpret_cast<int*>(rec);
      hi[0] = start;
      hi[1] = hcnt;
      hi[2] = flush;
      hi[3] = base;
      rec[rl.eg] = expf(G);
    }
    if (lane < T) {
      rec[rl.egam + lane] = expf(gl);
      rec[rl.beta + lane] = tg[T + lane];
    }
    for (int i0 = 0; i0 < T * T; i0 += 32) {
      const int i = i0 + lane, s = i / T, s2 = i - s * T;
      const float gs = __shfl_sync(0xffffffffu, gl, s & 31), gs2 = __shfl_sync(0xffffffffu, gl, s2);
      if (i >= T * T) continue;
      const float e = expf(gs - gs2);
      rec[rl.ca + s * Tm + s2] = s2 < s ? tg[T + s] * e * cc[s * kMaxT + s2] : 0.f;
      rec[rl.cb + s * Tm + s2] = s2 <= s ? e * cc[kMaxT * kMaxT + s * kMaxT + s2] : 0.f;
    }
    // The drafts' decays into their slots (the old ones were read above).
    if (lane < T) p.ring_g[(static_cast<int64_t>(seq) * L + (base + lane) % L) * p.hv + h] = tg[lane];
  }
  // The drafts' keys into their slots; in a flush, a slot that still holds an entry (the
  // oldest ones, h + s >= L) has its key moved to the scratch first: the state kernel folds it.
  for (int s = warp; s < T; s += NW) {
    char* kd = p.ring_k + ((static_cast<int64_t>(seq) * L + (base + s) % L) * p.hk + kh) * DK * ee;
    if (flush && hcnt + s >= L) {
      float old[KL];
#pragma unroll
      for (int c = 0; c < KL; c += VW) ld_entry<VW>(kd, edt, key(c), &old[c]);
      float* mv = p.scratch + lay.moved + ((static_cast<int64_t>(b) * p.hk + kh) * Tm + s) * DK;
#pragma unroll
      for (int c = 0; c < KL; ++c) mv[key(c)] = old[c];
    }
#pragma unroll
    for (int c = 0; c < KL; ++c) stx(kd, edt, key(c), ks[s * DK + key(c)]);
  }
  // This key head's share of the drafts' conv inputs.
  if (!ENG && p.conv_dim > 0) {
    const int lo = static_cast<int>(static_cast<int64_t>(kh) * p.conv_dim / p.hk);
    const int hi = static_cast<int>(static_cast<int64_t>(kh + 1) * p.conv_dim / p.hk);
    const int ce = p.conv_dtype == KVR_DT_F32 ? 4 : 2;
    for (int s = 0; s < T; ++s) {
      char* cw = p.conv + (static_cast<int64_t>(seq) * p.conv_slots + (conv_end + s) % p.conv_slots) * p.conv_dim * ce;
      for (int c = lo + tid; c < hi; c += blockDim.x)
        stx(cw, p.conv_dtype, c,
            ldx(p.conv_in.p, p.conv_in.dtype, b * p.conv_in.s[0] + s * p.conv_in.s[1] + c * p.conv_in.s[2]));
    }
  }
}

// The state kernels' start past their wait (wverify_body, kverify_body): the prep kernel's
// record of (row b, value head h) and the drafts' q, k of key head kh copied to shared memory
// (rec, sqk); one thread a row ends the step (every prep CTA has read the metadata). Returns
// the record's header.
struct WvHead {
  int start, nbuf, base;
  bool flush;
  float eG;
};
template <int DK>
__device__ __forceinline__ WvHead wv_stage(const StepParams& p, int b, int h, int kh, int tile, int seq,
                                           const kvr_gdn_wvscratch& lay, const kvr_gdn_wvrec& rl, float* rec,
                                           float* sqk) {
  const int T = p.t, Tm = p.max_drafts, L = p.l;
  const float* grec = p.scratch + lay.rec + (static_cast<int64_t>(b) * p.hv + h) * lay.rec_floats;
  const float* gqk = p.scratch + lay.qk + (static_cast<int64_t>(b) * p.hk + kh) * 2 * Tm * DK;
  for (int i = threadIdx.x; i < rl.floats / 4; i += blockDim.x) cp_async_16(rec + 4 * i, grec + 4 * i, 16);
  const int per = T * DK / 4;
  for (int i = threadIdx.x; i < 2 * per; i += blockDim.x) {
    const int x = i >= per, o = 4 * (i - x * per);
    cp_async_16(sqk + x * Tm * DK + o, gqk + x * Tm * DK + o, 16);
  }
  cp_async_commit();
  if (h == 0 && tile == 0 && threadIdx.x == 0) {
    int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
    const int4 m = __ldcg(reinterpret_cast<const int4*>(meta));
    const Place pl{m.z + 2 * T > L, false, (m.y + m.z) % L};
    finish_meta(p, meta, m.x, m.y, m.z, m.w, __ldcg(meta + kMetaConvEnd), pl);
  }
  cp_async_wait<0>();
  __syncthreads();
  const int* hdr = reinterpret_cast<const int*>(rec);
  return WvHead{hdr[0], hdr[1], hdr[3], hdr[2] != 0, rec[rl.eg]};
}

// (S x)[row lane & 7] in every lane, for a warp's 8 state rows (rows8_dots with one vector).
template <int KL>
__device__ __forceinline__ float rows8_dot(const float (&s)[8][KL], const float (&x)[KL], int lane) {
  float P[8];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    float a = 0.f;
#pragma unroll
    for (int c = 0; c < KL; ++c) a += s[r][c] * x[c];
    P[r] = a;
  }
  const float own = reduce_scatter<8>(P, lane);  // P[lane / 4]
  return __shfl_sync(0xffffffffu, own, 4 * (lane & 7));
}

// TM: drafts at most (registers); ADD: the additive rule; NS: ring slots per lane (16: rings
// of up to 64 entries; 4: up to 16, a quarter of the u loads and of the ring's part).
template <typename SD, int DK, int TM, bool ADD, int NS = kWvSlots / 4>
__device__ void wverify_body(const StepParams& p, const int32_t* ids_inline) {
  constexpr int RL = 8, KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  static_assert(NS == 4 || NS == kWvSlots / 4, "rings of up to 16 or 64 entries");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int T = p.t, Tm = p.max_drafts, L = p.l, dv = p.dv;
  const int kh = h / (p.hv / p.hk);
  const int row0 = tile * p.tv + warp * RL;
  const int rr = lane & 7, qtr = lane >> 3, row = row0 + rr;
  const bool writer = lane < RL;
  const int seq = p.ids ? p.ids[b] : ids_inline[b];
  const Tensor& out = p.out;
  const int64_t out0 = b * out.s[0] + h * out.s[2] + row * out.s[3];
  auto out_at = [&](int s) { return out0 + s * out.s[1]; };
  if (seq < 0) {
    if (writer)
      for (int s = 0; s < T; ++s) stx(out.p, out.dtype, out_at(s), 0.f);
    return;
  }
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  char* head = p.state + (static_cast<int64_t>(seq) * p.seq_stride + static_cast<int64_t>(h) * DK * dv) *
                             static_cast<int64_t>(sizeof(SD));
  SD* hs = reinterpret_cast<SD*>(head) + static_cast<int64_t>(row0) * DK;
  float s[RL][KL];
  load_rows<SD, DK, RL>(hs, s, lane);
  // The u values of this lane's slots (qtr + 4 i) in its row, the drafts' v and gate inputs.
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  char* const ubase = p.ring_u + (static_cast<int64_t>(seq) * L * p.hv + h) * dv * ee;
  const int64_t ustride = static_cast<int64_t>(p.hv) * dv * ee;
  float u[NS];
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int sl = qtr + 4 * i;
    u[i] = sl < L ? ldx(ubase + sl * ustride, p.entry_dtype, row) : 0.f;
  }
  float vt[TM], zt[TM];
#pragma unroll
  for (int x = 0; x < TM; ++x) {
    vt[x] = x < T ? ldx(p.v.p, p.v.dtype, b * p.v.s[0] + x * p.v.s[1] + h * p.v.s[2] + row * p.v.s[3]) : 0.f;
    zt[x] = x < T && writer ? epilogue_in(p, b, x, h, row).z : 0.f;
  }
  const float skip = p.skip.p ? ldx(p.skip.p, p.skip.dtype, h * p.skip.s[0]) : 0.f;
  pdl_wait();
  // The prep kernel's record of this (row, value head) and the drafts' q, k of the key head.
  extern __shared__ __align__(16) float wvsm[];
  const kvr_gdn_wvscratch lay = kvr_gdn_wvscratch_layout(p.b, p.hv, p.hk, DK, Tm);
  const kvr_gdn_wvrec rl = kvr_gdn_wvrec_layout_r(Tm, 4 * NS);
  float* rec = wvsm;
  float* sqk = wvsm + lay.rec_floats;
  const WvHead hd = wv_stage<DK>(p, b, h, kh, tile, seq, lay, rl, rec, sqk);
  const int start = hd.start, nbuf = hd.nbuf, base = hd.base;
  const bool flush = hd.flush;
  const float eG = hd.eG;
  // Slots that hold no buffered entry: 0 (a select: a stale value may be anything).
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int sl = qtr + 4 * i;
    const int j = sl - start + (sl < start ? L : 0);
    u[i] = pick(sl < L && j < nbuf, u[i], 0.f);
  }
  float ut[TM];
#pragma unroll
  for (int x = 0; x < TM; ++x) {
    ut[x] = 0.f;
    if (x >= T) continue;
    // (S q_x), (S k_x) of the row, then the ring's part from this lane's slots.
    float q[KL], k[KL];
#pragma unroll
    for (int c = 0; c < KL; c += VW) {
      ld_vec<float, VW>(sqk + x * DK + key(c), &q[c]);
      if constexpr (!ADD) ld_vec<float, VW>(sqk + (Tm + x) * DK + key(c), &k[c]);
    }
    float sq, sk = 0.f;
    if constexpr (ADD) {
      sq = rows8_dot<KL>(s, q, lane);
    } else {
      const float2 d = rows8_dots<KL>(s, q, k, lane);
      sq = d.x;
      sk = d.y;
    }
    float hq = 0.f, hk = 0.f;
    // Lane quarter qtr's slots qtr + 4 i sit at qtr * NS + i (wv_slot_at).
    const float* A = rec + rl.a + x * (4 * NS) + qtr * NS;
    const float* B = rec + rl.b + x * (4 * NS) + qtr * NS;
#pragma unroll
    for (int i = 0; i < NS; i += 4) {
      const float4 a = *reinterpret_cast<const float4*>(A + i);
      hq += a.x * u[i] + a.y * u[i + 1] + a.z * u[i + 2] + a.w * u[i + 3];
      if constexpr (!ADD) {
        const float4 c = *reinterpret_cast<const float4*>(B + i);
        hk += c.x * u[i] + c.y * u[i + 1] + c.z * u[i + 2] + c.w * u[i + 3];
      }
    }
    hq += __shfl_xor_sync(0xffffffffu, hq, 8);
    hq += __shfl_xor_sync(0xffffffffu, hq, 16);
    if constexpr (!ADD) {
      hk += __shfl_xor_sync(0xffffffffu, hk, 8);
      hk += __shfl_xor_sync(0xffffffffu, hk, 16);
    }
    // The row's forward substitution over the earlier drafts, its output and ring entry.
    const float eg = rec[rl.egam + x], bt = rec[rl.beta + x];
    float uu = ADD ? bt * vt[x] : bt * (vt[x] - eg * (eG * sk + hk));
    if constexpr (!ADD) {
#pragma unroll
      for (int y = 0; y < x; ++y) uu -= rec[rl.ca + x * Tm + y] * ut[y];
    }
    ut[x] = uu;
    float yv = eg * (eG * sq + hq);
#pragma unroll
    for (int y = 0; y <= x; ++y) yv += rec[rl.cb + x * Tm + y] * ut[y];
    if (writer) {
      stx(out.p, out.dtype, out_at(x), epilogue(p, EpilogueIn{skip, zt[x]}, vt[x], yv));
      const int sl = base + x < L ? base + x : base + x - L;  // (base + x) % L: base < L, x < T <= L
      stx(ubase + sl * ustride, p.entry_dtype, row, uu);
    }
  }
  if (flush) {
    // e^G S + sum_j w_j u_j k_j^T into the warp's rows; a slot a draft took holds its old key
    // in the scratch (the prep kernel moved it). The u values go through shared memory (the
    // drafts' q and k space, free once every warp is past its readouts), so that the loop
    // over the slots stays a loop (unrolled, it made the kernel 40,000 instructions long).
    __syncthreads();
    float* uf = sqk + warp * kWvSlots * RL;
#pragma unroll
    for (int i = 0; i < NS; ++i) uf[(qtr + 4 * i) * RL + rr] = u[i];
    __syncwarp();
    scale_rows<RL, KL>(s, eG);
    const float* W = rec + rl.w;
    const char* kbase = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * DK * ee;
    const int64_t kstride = static_cast<int64_t>(p.hk) * DK * ee;
    const float* moved = p.scratch + lay.moved + (static_cast<int64_t>(b) * p.hk + kh) * Tm * DK;
    // Rings of up to 16 walk the buffered entries only, in ring order; the 64-slot builds
    // every slot (the walk's indices would spill them).
    const int nwalk = NS == 4 ? nbuf : L, first = NS == 4 ? start : 0;
#pragma unroll 1
    for (int j = 0; j < nwalk; ++j) {
      const int sl = first + j < L ? first + j : first + j - L;
      const float w = W[sl];
      if (w == 0.f) continue;
      const int sd = sl - base + (sl < base ? L : 0);  // (sl - base) mod L
      float kv[KL];
#pragma unroll
      for (int c = 0; c < KL; c += VW) {
        if (sd < T)
          ld_vec<float, VW>(moved + sd * DK + key(c), &kv[c]);
        else
          ld_entry<VW>(kbase + sl * kstride, p.entry_dtype, key(c), &kv[c]);
      }
      float wu[RL];
      ld_vec<float, RL>(uf + sl * RL, wu);
#pragma unroll
      for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int c = 0; c < KL; ++c) s[r][c] += w * wu[r] * kv[c];
    }
    store_rows<SD, DK, RL>(hs, s, lane);
  }
}


// K-major states (kverify_body): the head's state is [dk][dv]; a CTA takes 32 value rows
// (columns: 128 bytes of each key row) and warp w the keys w dk / 4 .. (w + 1) dk / 4 - 1 of
// them. Lane 8 p + g holds columns 4 g .. 4 g + 3 of KP = dk / 16 keys (p: a part of the warp's
// keys) as float4 rows, so that each state load reads four whole 128-byte lines a warp (the
// V-major kernel's bytes per instruction). Ring slots are spread over the 16 (warp, part)
// owners: owner o = 4 w + p holds slots o + 16 j of its 4 columns. Per draft, each lane's
// parts of e^G (S q_x), e^G (S k_x) and of the ring's terms are summed over the warp's parts
// by shuffles and meet in shared memory by warp (one CTA barrier, which also publishes the
// flush's w_p u_p); warp 0 (a column a lane) then runs the forward substitution, writes the
// outputs and the drafts' ring entries. A flush stages KVR_GDN_KVERIFY_FLUSH_SLOTS slots' keys
// at a time in shared memory of their own (the first slots' requested before the drafts'
// products, by cp.async for f32 entries) and folds them, e^G S + sum_p w_p k_p u_p^T. Same
// prep kernel, record and arithmetic as wverify_body. NJ: slots per owner (1: rings of up to
// 16 entries; 4: up to 64); the records have 64 slots either way (the generic prep's).
template <typename SD, int DK, int TM, bool ADD, int NJ = kWvSlots / 16>
__device__ void kverify_body(const StepParams& p, const int32_t* ids_inline) {
  constexpr int KP = DK / 16, NSL = kWvSlots, CH = KVR_GDN_KVERIFY_FLUSH_SLOTS;
  static_assert(NJ == 1 || NJ == kWvSlots / 16, "rings of up to 16 or 64 entries");
  static_assert(KP % 4 == 0 && CH % 4 == 0, "float4 reads of a lane's keys");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane & 7, part = lane >> 3, owner = 4 * warp + part;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int T = p.t, Tm = p.max_drafts, L = p.l, dv = p.dv;
  const int kh = h / (p.hv / p.hk);
  const int col0 = tile * p.tv, k0 = warp * (DK / 4) + part * KP;
  const int seq = p.ids ? p.ids[b] : ids_inline[b];
  const Tensor& out = p.out;
  const int64_t out0 = b * out.s[0] + h * out.s[2] + (col0 + lane) * out.s[3];
  auto out_at = [&](int s) { return out0 + s * out.s[1]; };
  if (seq < 0) {
    if (warp == 0)
      for (int s = 0; s < T; ++s) stx(out.p, out.dtype, out_at(s), 0.f);
    return;
  }
  SD* hs = reinterpret_cast<SD*>(p.state + (static_cast<int64_t>(seq) * p.seq_stride +
                                            static_cast<int64_t>(h) * DK * dv) *
                                               static_cast<int64_t>(sizeof(SD))) +
           static_cast<int64_t>(k0) * dv + col0 + 4 * g;
  float s[KP][4];
#pragma unroll
  for (int i = 0; i < KP; ++i) ld_state<SD, 4>(hs + static_cast<int64_t>(i) * dv, s[i]);
  // The u values of the owner's slots in the lane's columns; the drafts' v (warp 0, which
  // writes the outputs: a column a lane).
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  char* const ubase = p.ring_u + (static_cast<int64_t>(seq) * L * p.hv + h) * dv * ee;
  const int64_t ustride = static_cast<int64_t>(p.hv) * dv;
  float u[NJ][4];
  kload_slots<NJ>(u, ubase, p.entry_dtype, ustride, owner, L, col0 + 4 * g, true);
  float vt[TM];
#pragma unroll
  for (int x = 0; x < TM; ++x) {
    const bool mine = warp == 0 && x < T;
    vt[x] = mine ? ldx(p.v.p, p.v.dtype, b * p.v.s[0] + x * p.v.s[1] + h * p.v.s[2] + (col0 + lane) * p.v.s[3])
                 : 0.f;
  }
  pdl_wait();
  // The prep kernel's record of this (row, value head) and the drafts' q, k of the key head.
  extern __shared__ __align__(16) float kvsm[];
  const kvr_gdn_wvscratch lay = kvr_gdn_wvscratch_layout(p.b, p.hv, p.hk, DK, Tm);
  const kvr_gdn_wvrec rl = kvr_gdn_wvrec_layout_r(Tm, NSL);
  float* rec = kvsm;
  float* sqk = kvsm + lay.rec_floats;  // the drafts' q, k
  float* red = sqk + 2 * Tm * DK;      // [draft][q, k][warp][column]
  float* fwu = red + 2 * Tm * 4 * 32;  // [slot][column]: w_p u_p (16 NJ slots)
  float* fks = fwu + 16 * NJ * 32;     // [CH][DK]: a flush's keys, CH slots at a time
  const WvHead hd = wv_stage<DK>(p, b, h, kh, tile, seq, lay, rl, rec, sqk);
  const int start = hd.start, nbuf = hd.nbuf, base = hd.base;
  const bool flush = hd.flush;
  const float eG = hd.eG;
  const float* W = rec + rl.w;
  // A flush's keys of slots c0 .. c0 + CH - 1 to shared memory (cp.async for f32 entries); a
  // slot a draft took holds its old key in the scratch (the prep kernel moved it). The first
  // CH slots' are requested now, behind the drafts' products.
  const char* kbase = p.ring_k + (static_cast<int64_t>(seq) * L * p.hk + kh) * DK * ee;
  const int64_t kstride = static_cast<int64_t>(p.hk) * DK;
  const float* moved = p.scratch + lay.moved + (static_cast<int64_t>(b) * p.hk + kh) * Tm * DK;
  auto stage_keys = [&](int c0) {
    for (int i = threadIdx.x; i < CH * DK / 4; i += blockDim.x) {
      const int j = i / (DK / 4), x = 4 * (i - j * (DK / 4)), sl = c0 + j;
      if (sl >= L || W[sl] == 0.f) continue;
      const int sd = sl - base + (sl < base ? L : 0);  // (sl - base) mod L
      float* d = fks + j * DK + x;
      if (sd < T) {
        cp_async_16(d, moved + sd * DK + x, 16);
      } else if (p.entry_dtype == KVR_DT_F32) {
        cp_async_16(d, reinterpret_cast<const float*>(kbase) + sl * kstride + x, 16);
      } else {
        float t[4];
        ld_entry<4>(kbase, p.entry_dtype, sl * kstride + x, t);
        *reinterpret_cast<float4*>(d) = make_float4(t[0], t[1], t[2], t[3]);
      }
    }
    cp_async_commit();
  };
  if (flush) stage_keys(0);
  // Slots that hold no buffered entry: 0 (a select: a stale value may be anything).
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int sl = owner + 16 * j;
    const int jj = sl - start + (sl < start ? L : 0);
    const bool live = sl < L && jj < nbuf;
#pragma unroll
    for (int c = 0; c < 4; ++c) u[j][c] = pick(live, u[j][c], 0.f);
  }
  // Per draft: e^G (S q_x) + sum_p A_xp u_p (and with k_x, B) of the lane's columns, over
  // its keys and slots, summed over the warp's parts, to shared memory.
#pragma unroll
  for (int x = 0; x < TM; ++x) {
    if (x >= T) continue;
    float tq[4] = {0.f, 0.f, 0.f, 0.f}, tk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < KP; i += 4) {
      const float4 q4 = *reinterpret_cast<const float4*>(sqk + x * DK + k0 + i);
      const float qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int c = 0; c < 4; ++c) tq[c] += s[i + e][c] * qv[e];
      if constexpr (!ADD) {
        const float4 k4 = *reinterpret_cast<const float4*>(sqk + (Tm + x) * DK + k0 + i);
        const float kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int c = 0; c < 4; ++c) tk[c] += s[i + e][c] * kv[e];
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      tq[c] *= eG;
      tk[c] *= eG;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int sl = owner + 16 * j;
      const int at = wv_slot_at<NSL>(sl);
      const float ca = rec[rl.a + x * NSL + at], cb = ADD ? 0.f : rec[rl.b + x * NSL + at];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        tq[c] += ca * u[j][c];
        if constexpr (!ADD) tk[c] += cb * u[j][c];
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      tq[c] += __shfl_xor_sync(0xffffffffu, tq[c], 8);
      tq[c] += __shfl_xor_sync(0xffffffffu, tq[c], 16);
      if constexpr (!ADD) {
        tk[c] += __shfl_xor_sync(0xffffffffu, tk[c], 8);
        tk[c] += __shfl_xor_sync(0xffffffffu, tk[c], 16);
      }
    }
    if (part == 0) {
      *reinterpret_cast<float4*>(red + ((2 * x) * 4 + warp) * 32 + 4 * g) = make_float4(tq[0], tq[1], tq[2], tq[3]);
      if constexpr (!ADD)
        *reinterpret_cast<float4*>(red + ((2 * x + 1) * 4 + warp) * 32 + 4 * g) = make_float4(tk[0], tk[1], tk[2], tk[3]);
    }
  }
  if (flush) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int sl = owner + 16 * j;
      if (sl < L) {
        const float w = W[sl];
        *reinterpret_cast<float4*>(fwu + sl * 32 + 4 * g) = make_float4(w * u[j][0], w * u[j][1], w * u[j][2], w * u[j][3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the parts, w_p u_p, the first keys of a flush
  if (warp == 0) {
    // Each column's forward substitution over the earlier drafts, its output and ring entry.
    float ut[TM];
#pragma unroll
    for (int x = 0; x < TM; ++x) {
      ut[x] = 0.f;
      if (x >= T) continue;
      float tq = 0.f, tk = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        tq += red[((2 * x) * 4 + w) * 32 + lane];
        if constexpr (!ADD) tk += red[((2 * x + 1) * 4 + w) * 32 + lane];
      }
      const float eg = rec[rl.egam + x], bt = rec[rl.beta + x];
      float uu = ADD ? bt * vt[x] : bt * (vt[x] - eg * tk);
      if constexpr (!ADD) {
#pragma unroll
        for (int y = 0; y < x; ++y) uu -= rec[rl.ca + x * Tm + y] * ut[y];
      }
      ut[x] = uu;
      float yv = eg * tq;
#pragma unroll
      for (int y = 0; y <= x; ++y) yv += rec[rl.cb + x * Tm + y] * ut[y];
      stx(out.p, out.dtype, out_at(x), epilogue(p, epilogue_in(p, b, x, h, col0 + lane), vt[x], yv));
      const int sl = base + x < L ? base + x : base + x - L;  // (base + x) % L: base < L, x < T <= L
      stx(ubase, p.entry_dtype, sl * ustride + col0 + lane, uu);
    }
  }
  if (flush) {
    // e^G S + sum_p w_p k_p u_p^T into the lane's keys, CH slots at a time.
#pragma unroll
    for (int i = 0; i < KP; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[i][c] *= eG;
#pragma unroll 1
    for (int c0 = 0; c0 < L; c0 += CH) {
      if (c0 > 0) {
        __syncthreads();  // the previous chunk's fold
        stage_keys(c0);
        cp_async_wait<0>();
        __syncthreads();
      }
#pragma unroll 4
      for (int j = 0; j < CH; ++j) {
        const int sl = c0 + j;
        if (sl >= L || W[sl] == 0.f) continue;
        kfold_slot<KP>(s, *reinterpret_cast<const float4*>(fwu + sl * 32 + 4 * g), fks + j * DK + k0);
      }
    }
#pragma unroll
    for (int i = 0; i < KP; ++i) st_state<SD, 4>(hs + static_cast<int64_t>(i) * dv, s[i]);
  }
}

}  // namespace gdn
}  // namespace kvr

#define KVR_GDN_WVERIFY(SD, SN, DK, TM, MB)                                                      \
  extern "C" __global__ void __launch_bounds__(128, MB)                                          \
      kvr_gdn_wverify_##SN##_v_d##DK##_t##TM(const __grid_constant__ kvr::gdn::StepParams p) {   \
    kvr::gdn::wverify_body<SD, DK, TM, false>(p, p.ids_inline);                                                \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, MB)                                          \
      kvr_gdn_wverify_##SN##_v_d##DK##_t##TM##_add(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::wverify_body<SD, DK, TM, true>(p, p.ids_inline);                                                 \
  }
// The prep in the registers of 4 CTAs an SM (dk 128: 64 registers and an 8-word spill instead
// of 73 and 3 CTAs; its 2,048 CTAs at B = 128 in 3.9 waves instead of 5.2: K-major rounds of
// ring 16 2-7 % faster on the H200, BENCHMARKS.md).
#define KVR_GDN_WVERIFY_DK(DK)                                        \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_WVPREP_THREADS, 4) \
      kvr_gdn_wvprep_d##DK(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::wvprep_body<DK>(p);                                     \
  }                                                                   \
  KVR_GDN_WVERIFY(float, f32, DK, 4, KVR_GDN_WVERIFY_MINB4)           \
  KVR_GDN_WVERIFY(float, f32, DK, 8, KVR_GDN_WVERIFY_MINB8)           \
  KVR_GDN_WVERIFY(__nv_bfloat16, bf16, DK, 4, KVR_GDN_WVERIFY_MINB4)  \
  KVR_GDN_WVERIFY(__nv_bfloat16, bf16, DK, 8, KVR_GDN_WVERIFY_MINB8)
KVR_GDN_WVERIFY_DK(64)
KVR_GDN_WVERIFY_DK(128)
// K-major states (kverify_body): kvr_gdn_wverify_<state>_k_d<dk>_t<4|8>[_add][_r16], after the
// same prep kernel; the `_r16` builds (rings of up to 16) in the registers of one more CTA an SM.
#define KVR_GDN_KVERIFY(SD, SN, DK, TM, MB, MB16)                                                    \
  extern "C" __global__ void __launch_bounds__(128, MB)                                          \
      kvr_gdn_wverify_##SN##_k_d##DK##_t##TM(const __grid_constant__ kvr::gdn::StepParams p) {   \
    kvr::gdn::kverify_body<SD, DK, TM, false>(p, p.ids_inline);                                  \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, MB)                                          \
      kvr_gdn_wverify_##SN##_k_d##DK##_t##TM##_add(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::kverify_body<SD, DK, TM, true>(p, p.ids_inline);                                   \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, MB16)                                        \
      kvr_gdn_wverify_##SN##_k_d##DK##_t##TM##_r16(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::kverify_body<SD, DK, TM, false, 1>(p, p.ids_inline);                               \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, MB16)                                        \
      kvr_gdn_wverify_##SN##_k_d##DK##_t##TM##_add_r16(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::kverify_body<SD, DK, TM, true, 1>(p, p.ids_inline);                                \
  }
#define KVR_GDN_KVERIFY_DK(DK)                                       \
  KVR_GDN_KVERIFY(float, f32, DK, 4, 5, 7)                            \
  KVR_GDN_KVERIFY(float, f32, DK, 8, 4, 6)                            \
  KVR_GDN_KVERIFY(__nv_bfloat16, bf16, DK, 4, 5, 7)                  \
  KVR_GDN_KVERIFY(__nv_bfloat16, bf16, DK, 8, 4, 6)
KVR_GDN_KVERIFY_DK(64)
KVR_GDN_KVERIFY_DK(128)
#undef KVR_GDN_KVERIFY_DK
#undef KVR_GDN_KVERIFY
// The prep of the `_r16` state kernels: records of 16 slots, the registers of 4 CTAs an SM.
// The host pairs it with those only (engine dtypes: f32 entries, no conv window).
extern "C" __global__ void __launch_bounds__(KVR_GDN_WVPREP_THREADS, 4)
    kvr_gdn_wvprep_d128_r16(const __grid_constant__ kvr::gdn::StepParams p) {
  kvr::gdn::wvprep_body<128, 16, true>(p);
}
// The same for rounds of up to KVR_GDN_WVPREP_W4_DRAFTS drafts in CTAs of as many warps (the
// other warps of the 8-warp CTA had no draft to normalize and only added instructions; the
// prep's time is its instructions at about half an issue a cycle per scheduler, H200).
extern "C" __global__ void __launch_bounds__(32 * KVR_GDN_WVPREP_W4_DRAFTS, 8)
    kvr_gdn_wvprep_d128_r16_w4(const __grid_constant__ kvr::gdn::StepParams p) {
  kvr::gdn::wvprep_body<128, 16, true, KVR_GDN_WVPREP_W4_DRAFTS>(p);
}
// Specialized builds (kvr_gdn_wverify_<state>_v_d128_t<TM>_<FN>): a copy of the parameters with
// the fields of the engines' calls made constants (gdn_wdecode.cu FdFix, FdFixM2; the host
// checks a call against them: src/linear/replay/cuda.rs fdecode_spec), so that the per-row
// work loses its run-time dtype dispatch. The ring length stays a run-time value; the `_r16`
// builds serve rings of up to 16 entries with 4 slots a lane instead of 16, in the registers
// of one more resident CTA per SM (but the additive rule's 4-draft build, which would spill).
#define KVR_GDN_WVERIFY_FIX(SD, SN, TM, MB, FIX, ADD, FN)                                        \
  extern "C" __global__ void __launch_bounds__(128, MB)                                          \
      kvr_gdn_wverify_##SN##_v_d128_t##TM##_##FN(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::StepParams c = p;                                                                  \
    FIX::apply(c, p.l);                                                                          \
    kvr::gdn::wverify_body<SD, 128, TM, ADD>(c, p.ids_inline);                                   \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, (MB) + 1 - ((ADD) && (TM) == 4))                                    \
      kvr_gdn_wverify_##SN##_v_d128_t##TM##_##FN##_r16(const __grid_constant__ kvr::gdn::StepParams p) { \
    kvr::gdn::StepParams c = p;                                                                  \
    FIX::apply(c, p.l);                                                                          \
    kvr::gdn::wverify_body<SD, 128, TM, ADD, 4>(c, p.ids_inline);                                \
  }
#define KVR_GDN_WVERIFY_SPECS(SD, SN, TM, MB)                                      \
  KVR_GDN_WVERIFY_FIX(SD, SN, TM, MB, kvr::gdn::FdBf16, false, xbf16)              \
  KVR_GDN_WVERIFY_FIX(SD, SN, TM, MB, kvr::gdn::FdF32, false, xf32)                \
  KVR_GDN_WVERIFY_FIX(SD, SN, TM, MB, kvr::gdn::FdM2Bf16, true, m2bf16)
KVR_GDN_WVERIFY_SPECS(float, f32, 4, KVR_GDN_WVERIFY_MINB4)
KVR_GDN_WVERIFY_SPECS(float, f32, 8, KVR_GDN_WVERIFY_MINB8)
KVR_GDN_WVERIFY_SPECS(__nv_bfloat16, bf16, 4, KVR_GDN_WVERIFY_MINB4)
KVR_GDN_WVERIFY_SPECS(__nv_bfloat16, bf16, 8, KVR_GDN_WVERIFY_MINB8)
#undef KVR_GDN_WVERIFY_SPECS
#undef KVR_GDN_WVERIFY_FIX
#undef KVR_GDN_WVERIFY_DK
#undef KVR_GDN_WVERIFY
