// Gated DeltaNet replay decoding (src/linear/gdn/cuda.rs; the math is src/linear/math.rs):
//   kvr_gdn_step_<state>_<k|v>_nv<8|16>   verify (T = 1..8) for a batch, an explicit flush, a
//                                         state export, and decode (T = 1, auto-commit) where
//                                         neither gdn_stream.cu nor gdn_decode.cu applies
//   kvr_gdn_finish                        per-sequence metadata, ring keys and decays after a
//                                         step or flush launch (and after gdn_decode.cu)
//   kvr_gdn_commit                        per-sequence accepted counts (host or device) ->
//                                         cursors, conv window of the accepted prefix,
//                                         recurrent snapshots
//
// One CTA owns (sequence, value head, tile of `tv` value rows). Its slice of the checkpoint
// state (tv x dk) is loaded into registers once; every other input is small and goes
// through shared memory. All the math is row-local (outputs, corrected values, forward
// substitution and the flush's rank-h update touch only the CTA's own value rows), so the
// tiles of a head never exchange data, with two exceptions handled below:
//   - per-sequence metadata, ring keys and decays are shared by the CTAs of a sequence:
//     kvr_gdn_finish, launched right after on the same stream, writes them once every CTA
//     has read the old values;
//   - a KV-only sequence keeps its entries inside its state memory, so the step that
//     materializes its state waits until every tile of the head has read them (a per-head
//     arrival counter; sibling tiles are adjacent in launch order).
#include "gdn_common.cuh"

namespace kvr {
namespace gdn {

// Which state elements a thread holds: `nv` float4 vectors at element offsets
// base + i * step of the head's state.
//   K-major ([dk][dv]): a vector is 4 value rows at one key index; the thread's vectors
//     share the rows (c) and step over key indices.
//   V-major ([dv][dk]): a vector is 4 key indices of one value row; the thread's vectors
//     all belong to one row and are G vectors apart (G = threads per row).
struct Geo {
  int nv;
  int64_t base, step;
  int vl, c, line0, lstep;  // K-major
  int G, gi, row;           // V-major
};

template <bool VM>
__device__ __forceinline__ Geo make_geo(int dk, int dv, int tv, int v0, int tid) {
  Geo g;
  g.nv = tv * dk / (4 * kThreads);
  if (!VM) {
    g.vl = tv / 4;
    g.c = tid % g.vl;
    g.line0 = tid / g.vl;
    g.lstep = kThreads / g.vl;
    g.base = static_cast<int64_t>(g.line0) * dv + v0 + 4 * g.c;
    g.step = static_cast<int64_t>(g.lstep) * dv;
    g.G = g.gi = g.row = 0;
  } else {
    g.G = kThreads / tv;
    g.gi = tid % g.G;
    g.row = tid / g.G;
    g.base = static_cast<int64_t>(v0 + g.row) * dk + 4 * g.gi;
    g.step = 4 * g.G;
    g.vl = g.c = g.line0 = g.lstep = 0;
  }
  return g;
}

// hist[x][r] = factor * sum_k S[v0 + r][k] xs[x][k] for x in [x0, x0 + nx), nx <= XG (K-major
// 2, V-major 4). V-major rows are reduced within a warp; K-major partial sums go through
// `red` (kWarps x XG x tv floats; shared float atomics would be CAS loops) and a barrier.
template <bool VM> struct DotGroup {
  static constexpr int value = VM ? 4 : 2;
};

template <bool VM, int NV>
__device__ __forceinline__ void state_dot(const float4 (&sv)[NV], const Geo& g, const float* xs,
                                          int dk, int x0, int nx, float* hist, int tv, float factor,
                                          float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (!VM) {
    constexpr int XG = DotGroup<false>::value;
    float part[XG][4];
#pragma unroll
    for (int a = 0; a < XG; ++a)
#pragma unroll
      for (int r = 0; r < 4; ++r) part[a][r] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (i < g.nv) {
        const int ik = g.line0 + i * g.lstep;
#pragma unroll
        for (int a = 0; a < XG; ++a) {
          if (a < nx) {
            const float x = xs[(x0 + a) * dk + ik];
            part[a][0] += sv[i].x * x;
            part[a][1] += sv[i].y * x;
            part[a][2] += sv[i].z * x;
            part[a][3] += sv[i].w * x;
          }
        }
      }
    }
    for (int o = g.vl; o < 32; o <<= 1) {
#pragma unroll
      for (int a = 0; a < XG; ++a)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[a][r] += __shfl_xor_sync(0xffffffffu, part[a][r], o);
    }
    // tv <= 128: vl <= 32, so every warp holds one partial per row.
    if (lane < g.vl) {
#pragma unroll
      for (int a = 0; a < XG; ++a)
        *reinterpret_cast<float4*>(red + (warp * XG + a) * tv + 4 * g.c) =
            make_float4(part[a][0], part[a][1], part[a][2], part[a][3]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nx * tv; i += kThreads) {
      const int a = i / tv, j = i % tv;
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) acc += red[(w * XG + a) * tv + j];
      hist[(x0 + a) * tv + j] = factor * acc;
    }
    __syncthreads();
  } else {
    float part[4] = {0.f, 0.f, 0.f, 0.f};
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (i < g.nv) {
        const int c4 = g.gi + g.G * i;
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          if (a < nx) {
            const float4 x = xs4[(x0 + a) * (dk / 4) + c4];
            part[a] += sv[i].x * x.x + sv[i].y * x.y + sv[i].z * x.z + sv[i].w * x.w;
          }
        }
      }
    }
    for (int o = 1; o < g.G; o <<= 1) {
#pragma unroll
      for (int a = 0; a < 4; ++a) part[a] += __shfl_xor_sync(0xffffffffu, part[a], o);
    }
    if (g.gi == 0) {
#pragma unroll
      for (int a = 0; a < 4; ++a)
        if (a < nx) hist[(x0 + a) * tv + g.row] = factor * part[a];
    }
  }
}

// hist[x][r] = factor * (S x)[r] for every x < nx; ends with a barrier.
template <bool VM, int NV>
__device__ void state_dots(const float4 (&sv)[NV], const Geo& g, const float* xs, int dk, int nx,
                           float* hist, int tv, float factor, float* red) {
  constexpr int XG = DotGroup<VM>::value;
  for (int x0 = 0; x0 < nx; x0 += XG)
    state_dot<VM, NV>(sv, g, xs, dk, x0, min(XG, nx - x0), hist, tv, factor, red);
  __syncthreads();
}

// S += sum_j uc[j][row] kc[j][k] for the thread's vectors (uc already weighted).
template <bool VM, int NV>
__device__ __forceinline__ void rank_update(float4 (&sv)[NV], const Geo& g, const float* kc,
                                            const float* uc, int n, int dk, int tv) {
  for (int j = 0; j < n; ++j) {
    if (!VM) {
      const float4 u = *reinterpret_cast<const float4*>(uc + j * tv + 4 * g.c);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (i < g.nv) {
          const float kk = kc[j * dk + g.line0 + i * g.lstep];
          sv[i].x += u.x * kk;
          sv[i].y += u.y * kk;
          sv[i].z += u.z * kk;
          sv[i].w += u.w * kk;
        }
      }
    } else {
      const float u = uc[j * tv + g.row];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (i < g.nv) {
          const float4 kk = *reinterpret_cast<const float4*>(kc + j * dk + 4 * (g.gi + g.G * i));
          sv[i].x += u * kk.x;
          sv[i].y += u * kk.y;
          sv[i].z += u * kk.z;
          sv[i].w += u * kk.w;
        }
      }
    }
  }
}

// Shared memory carve-up, area by area as kvr_gdn_step_smem_layout (kvr_abi.h) sizes them
// (the host sizes the launch by its total).
struct Smem {
  float *xs, *hist, *vrow, *urow, *coefA, *coefB, *egam, *betas, *gd, *kc, *uc, *cx, *ga, *gb, *red;
  char* raw;  // 2 x kChunk x (dk + tv) entry elements (cp.async)
};

__device__ __forceinline__ Smem carve(float* base, int dk, int tv, int T, int hmax) {
  const kvr_gdn_step_smem l = kvr_gdn_step_smem_layout(dk, tv, T, hmax);
  Smem s;
  float* p = base;
  s.xs = p;
  p += l.xs;
  s.hist = p;
  p += l.hist;
  s.vrow = p;
  p += l.vrow;
  s.urow = p;
  p += l.urow;
  s.coefA = p;
  p += l.coef_a;
  s.coefB = p;
  p += l.coef_b;
  s.egam = p;
  s.betas = p + 16;
  s.gd = p + 32;
  p += l.egam;
  s.kc = p;
  p += l.kc;
  s.uc = p;
  p += l.uc;
  s.cx = p;
  p += l.cx;
  s.ga = p;
  p += l.ga;
  s.gb = p;
  p += l.gb;
  s.red = p;
  p += l.red;
  s.raw = reinterpret_cast<char*>(p);
  return s;
}

template <typename SD, bool VM, int NV>
__device__ void step_body(const StepParams& p) {
  extern __shared__ float4 smem4[];
  using IO = StateIO<SD>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.x % p.tiles;
  const int hb = blockIdx.x / p.tiles;
  const int h = hb % p.hv, b = hb / p.hv;
  const int T = p.t, tv = p.tv, dk = p.dk, dv = p.dv, v0 = tile * tv;
  const int kh = h / (p.hv / p.hk);
  const int seq = p.op == kOpExport ? p.export_seq : (p.ids ? p.ids[b] : p.ids_inline[b]);
  const Tensor& out = p.out;
  if (seq < 0) {  // an unused row: zero outputs
    if (p.op == kOpStep)
      for (int i = tid; i < T * tv; i += kThreads) {
        const int s = i / tv, r = i % tv;
        stx(out.p, out.dtype, b * out.s[0] + s * out.s[1] + h * out.s[2] + (v0 + r) * out.s[3], 0.f);
      }
    return;
  }
  const int es = sizeof(SD);
  // An export of all layers has one grid row per layer (p.layers; p's parts are layer 0's).
  const int layer = blockIdx.y;
  char* const state = p.layers ? p.layers[layer].state : p.state;
  const int64_t seq_stride = p.layers ? p.layers[layer].seq_stride : p.seq_stride;
  char* const ring_u = p.ring_u + layer * p.ring_u_lb;
  const char* const ring_k = p.ring_k + layer * p.ring_k_lb;
  const float* const ring_g = reinterpret_cast<const float*>(reinterpret_cast<const char*>(p.ring_g) + layer * p.ring_g_lb);
  int32_t* const meta_l = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(p.meta) + layer * p.meta_lb);
  char* head = state + (static_cast<int64_t>(seq) * seq_stride + static_cast<int64_t>(h) * dk * dv) * es;
  const Geo geo = make_geo<VM>(dk, dv, tv, v0, tid);
  int32_t* meta = meta_l + static_cast<int64_t>(seq) * kMetaInts;
  const int mode = __ldcg(meta + kMetaMode), start = __ldcg(meta + kMetaStart);
  const int conv_end = __ldcg(meta + kMetaConvEnd);
  // An export folds the first export_prefix entries (all when negative).
  const int hcnt_all = __ldcg(meta + kMetaH);
  const int hcnt = p.op == kOpExport && p.export_prefix >= 0 ? min(hcnt_all, p.export_prefix) : hcnt_all;
  const bool recurrent = mode == kModeRecurrent, kvonly = mode == kModeKvOnly;
  const Place pl = placement(p, mode, start, hcnt_all);
  const bool flush = pl.flush, kv_store = pl.kv_store;
  const bool additive = p.rule == KVR_GDN_RULE_ADDITIVE;
  const int base = pl.base;
  if (p.op == kOpFlush && !flush) return;  // nothing to write
  const bool materialize = !recurrent && (flush || p.op == kOpExport);
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  const int L = p.l > 0 ? p.l : 1;
  auto ring_pos = [&](int j) { return (start + j) % L; };
  auto entry_u = [&](int j) -> const char* {
    if (kvonly) return head + static_cast<int64_t>(j) * dv * ee;
    return ring_u + ((static_cast<int64_t>(seq) * L + ring_pos(j)) * p.hv + h) * dv * ee;
  };
  auto entry_k = [&](int j) -> const char* {
    if (kvonly) return head + (static_cast<int64_t>(p.kv_cap) * dv + static_cast<int64_t>(j) * dk) * ee;
    return ring_k + ((static_cast<int64_t>(seq) * L + ring_pos(j)) * p.hk + kh) * dk * ee;
  };
  auto entry_g = [&](int j) -> float {
    if (kvonly)
      return *reinterpret_cast<const float*>(head + static_cast<int64_t>(p.kv_cap) * (dv + dk) * ee + 4 * j);
    return ring_g[(static_cast<int64_t>(seq) * L + ring_pos(j)) * p.hv + h];
  };

  Smem sm = carve(reinterpret_cast<float*>(smem4), dk, tv, p.op == kOpStep ? T : 1, p.hmax);

  // Buffered entries travel in chunks of kChunk through a double-buffered cp.async ring
  // (raw entry bytes), converted to f32 (u weighted by w) before use.
  const int kbytes = dk * ee, ubytes = tv * ee;
  const int raw_stride = kChunk * (kbytes + ubytes);
  const int nchunks = recurrent ? 0 : (hcnt + kChunk - 1) / kChunk;
  auto issue_chunk = [&](int c) {
    const int c0 = c * kChunk, n = min(kChunk, hcnt - c0);
    char* dst = sm.raw + (c & 1) * raw_stride;
    const int kv = kbytes / 16, uv = ubytes / 16;
    for (int i = tid; i < n * (kv + uv); i += kThreads) {
      const int j = i / (kv + uv), r = i % (kv + uv);
      if (r < kv)
        cp_async_16(dst + j * kbytes + r * 16, entry_k(c0 + j) + r * 16, 16);
      else
        cp_async_16(dst + kChunk * kbytes + j * ubytes + (r - kv) * 16,
                    entry_u(c0 + j) + static_cast<int64_t>(v0) * ee + (r - kv) * 16, 16);
    }
    cp_async_commit();
  };
  if (nchunks > 0) issue_chunk(0);

  // The state slice, loaded now so the loads are in flight during the setup below (a
  // KV-only sequence has none).
  float4 sv[NV];
  const bool has_s0 = recurrent || mode == kModeReplay;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (i < geo.nv && has_s0)
      sv[i] = IO::load(head, geo.base + i * geo.step);
    else
      sv[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (p.op == kOpStep) {
    // Drafts: xs[2s] = q_s, xs[2s + 1] = k_s (normalized; q scaled; k as buffered).
    for (int x = warp; x < 2 * T; x += kWarps) {
      const int s = x >> 1;
      const bool isk = x & 1;
      const Tensor& t = isk ? p.k : p.q;
      const int64_t o = b * t.s[0] + s * t.s[1] + kh * t.s[2];
      float ss = 0.f;
      for (int i = lane; i < dk; i += 32) {
        const float v = ldx(t.p, t.dtype, o + i * t.s[3]);
        sm.xs[x * dk + i] = v;
        ss += v * v;
      }
      ss = warp_sum(ss);
      const float f = p.l2norm ? 1.f / sqrtf(ss + 1e-6f) : 1.f;
      for (int i = lane; i < dk; i += 32) {
        float v = sm.xs[x * dk + i] * f;
        if (!isk)
          v *= p.scale;
        else if (!recurrent)
          v = roundx(p.entry_dtype, v);
        sm.xs[x * dk + i] = v;
      }
    }
    for (int i = tid; i < T * tv; i += kThreads) {
      const int s = i / tv, r = i % tv;
      sm.vrow[i] = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + s * p.v.s[1] + h * p.v.s[2] + (v0 + r) * p.v.s[3]);
    }
    if (tid < T) {
      const float2 gb = token_gb(p, b, tid, h);
      sm.gd[tid] = gb.x;
      sm.betas[tid] = gb.y;
    }
    __syncthreads();
    if (tid == 0) {
      float acc = 0.f;
      for (int s = 0; s < T; ++s) {
        acc += sm.gd[s];
        sm.egam[s] = acc;  // draft-local prefix sums, exponentiated below
      }
    }
    __syncthreads();
    // A[s][s'] = beta_s e^{Gam_s - Gam_s'} (k_s . k_s'), B[s][s'] = e^{Gam_s - Gam_s'} (k_s' . q_s).
    for (int pr = warp; pr < 2 * T * T; pr += kWarps) {  // one warp per pair
      const int which = pr / (T * T), s = (pr % (T * T)) / T, s2 = pr % T;
      if (s2 > s || (which == 0 && (s2 == s || additive))) continue;
      const float* a = sm.xs + (2 * s + (which == 0 ? 1 : 0)) * dk;  // k_s (A) or q_s (B)
      const float* c = sm.xs + (2 * s2 + 1) * dk;                     // k_s'
      float d = 0.f;
      for (int i = lane; i < dk; i += 32) d += a[i] * c[i];
      d = warp_sum(d);
      if (lane == 0) {
        const float e = expf(sm.egam[s] - sm.egam[s2]);
        if (which == 0)
          sm.coefA[s * kMaxT + s2] = sm.betas[s] * e * d;
        else
          sm.coefB[s * kMaxT + s2] = e * d;
      }
    }
    __syncthreads();
    if (tid < T) sm.egam[tid] = expf(sm.egam[tid]);
    __syncthreads();
  }

  // Weights of the buffered entries: w_j = e^{g_{j+1} + ... + g_{h-1}}, and e^{G_h}.
  float eG = 1.f;
  const float* w = sm.ga;
  if (!recurrent && hcnt > 0) {
    for (int j = tid; j < hcnt; j += kThreads) sm.ga[j] = entry_g(j);
    __syncthreads();
    float* a = sm.ga;
    float* c = sm.gb;
    for (int off = 1; off < hcnt; off <<= 1) {  // inclusive suffix sums
      for (int j = tid; j < hcnt; j += kThreads) c[j] = a[j] + (j + off < hcnt ? a[j + off] : 0.f);
      __syncthreads();
      float* t = a;
      a = c;
      c = t;
    }
    eG = expf(a[0]);
    for (int j = tid; j < hcnt; j += kThreads) c[j] = expf(j + 1 < hcnt ? a[j + 1] : 0.f);
    __syncthreads();
    w = c;
  }

  // Runs body(n) for every chunk once kc (keys) and uc (weighted u rows) hold it.
  auto run_chunks = [&](auto&& body) {
    for (int c = 0; c < nchunks; ++c) {
      const int c0 = c * kChunk, n = min(kChunk, hcnt - c0);
      if (c + 1 < nchunks) {
        issue_chunk(c + 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const char* src = sm.raw + (c & 1) * raw_stride;
      for (int i = tid; i < n * dk; i += kThreads) sm.kc[i] = ldx(src, p.entry_dtype, i);
      for (int i = tid; i < n * tv; i += kThreads)
        sm.uc[i] = w[c0 + i / tv] * ldx(src + kChunk * kbytes, p.entry_dtype, i);
      __syncthreads();
      body(n);
      __syncthreads();
    }
  };
  auto store_state = [&](char* dst) {
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (i < geo.nv) IO::store(dst, geo.base + i * geo.step, sv[i]);
  };
  auto round_state = [&]() {
#pragma unroll
    for (int i = 0; i < NV; ++i) sv[i] = IO::round(sv[i]);
  };
  auto out_index = [&](int s, int r) {
    return b * out.s[0] + s * out.s[1] + h * out.s[2] + (v0 + r) * out.s[3];
  };

  if (recurrent && p.op == kOpStep) {
    const int64_t state_elems = static_cast<int64_t>(p.hv) * dk * dv;
    for (int s = 0; s < T; ++s) {
      const float a = expf(sm.gd[s]);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        sv[i].x *= a;
        sv[i].y *= a;
        sv[i].z *= a;
        sv[i].w *= a;
      }
      state_dot<VM, NV>(sv, geo, sm.xs + 2 * s * dk, dk, 0, 2, sm.hist, tv, 1.f, sm.red);
      __syncthreads();
      if (tid < tv) {
        const float x = sm.vrow[s * tv + tid];
        const float u = sm.betas[s] * (additive ? x : x - sm.hist[tv + tid]);
        const float y = sm.hist[tid] + sm.coefB[s * kMaxT + s] * u;
        stx(out.p, out.dtype, out_index(s, tid), epilogue(p, b, s, h, v0 + tid, x, y));
        sm.urow[tid] = u;
      }
      __syncthreads();
      rank_update<VM, NV>(sv, geo, sm.xs + (2 * s + 1) * dk, sm.urow, 1, dk, tv);
      round_state();
      if (!p.auto_commit) {
        char* snap = p.snaps + ((static_cast<int64_t>(seq) * p.max_drafts + s) * state_elems +
                                static_cast<int64_t>(h) * dk * dv) * es;
        store_state(snap);
      }
      __syncthreads();
    }
    if (p.auto_commit) store_state(head);
  } else if (p.op == kOpExport && recurrent) {
    // fall through to the export write below
  } else if (materialize) {
    if (mode == kModeReplay && hcnt > 0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        sv[i].x *= eG;
        sv[i].y *= eG;
        sv[i].z *= eG;
        sv[i].w *= eG;
      }
    }
    run_chunks([&](int n) { rank_update<VM, NV>(sv, geo, sm.kc, sm.uc, n, dk, tv); });
    round_state();
    if (p.op != kOpExport) {
      // Every tile of a KV-only head must have read the entries stored in the state.
      if (kvonly) head_barrier(p.sync + static_cast<int64_t>(seq) * p.hv + h, p.tiles);
      store_state(head);
      if (p.op == kOpStep) state_dots<VM, NV>(sv, geo, sm.xs, dk, 2 * T, sm.hist, tv, 1.f, sm.red);
    }
  } else {
    // Checkpoint readout plus the buffered entries, no state write (KV-only: entries only).
    const int nx = 2 * T;
    if (kvonly) {
      for (int i = tid; i < nx * tv; i += kThreads) sm.hist[i] = 0.f;
      __syncthreads();
    } else {
      state_dots<VM, NV>(sv, geo, sm.xs, dk, nx, sm.hist, tv, eG, sm.red);
    }
    run_chunks([&](int n) {
      // cx[x][j] = k_j . xs[x]: 8 lanes per pair; the loop bound is warp-uniform.
      for (int p0 = warp * 4; p0 < nx * n; p0 += kThreads >> 3) {
        const int pr = p0 + ((tid >> 3) & 3);
        float d = 0.f;
        if (pr < nx * n) {
          const int x = pr / n, j = pr % n;
          for (int i = tid & 7; i < dk; i += 8) d += sm.kc[j * dk + i] * sm.xs[x * dk + i];
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        d += __shfl_xor_sync(0xffffffffu, d, 4);
        if ((tid & 7) == 0 && pr < nx * n) sm.cx[(pr / n) * kChunk + pr % n] = d;
      }
      __syncthreads();
      for (int i = tid; i < nx * tv; i += kThreads) {
        const int x = i / tv, r = i % tv;
        float acc = 0.f;
        for (int j = 0; j < n; ++j) acc += sm.cx[x * kChunk + j] * sm.uc[j * tv + r];
        sm.hist[i] += acc;
      }
    });
  }

  if (p.op == kOpExport) {
    // out: [Hv][dk][dv] (K-major) or [Hv][dv][dk] (V-major), any float dtype.
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (i < geo.nv) {
        const float vals[4] = {sv[i].x, sv[i].y, sv[i].z, sv[i].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int64_t o;
          if (!VM)
            o = layer * out.s[3] + h * out.s[0] + (geo.line0 + i * geo.lstep) * out.s[1] + (v0 + 4 * geo.c + e) * out.s[2];
          else
            o = layer * out.s[3] + h * out.s[0] + (v0 + geo.row) * out.s[1] + (4 * (geo.gi + geo.G * i) + e) * out.s[2];
          stx(out.p, out.dtype, o, vals[e]);
        }
      }
    }
    return;
  }

  if (p.op == kOpStep && !recurrent) {
    // Row phase: corrected values by forward substitution, outputs, new entries.
    if (tid < tv) {
      const int r = tid;
      for (int s = 0; s < T; ++s) {
        if (additive) {
          sm.urow[s * tv + r] = sm.betas[s] * sm.vrow[s * tv + r];
          continue;
        }
        float R = sm.betas[s] * (sm.vrow[s * tv + r] - sm.egam[s] * sm.hist[(2 * s + 1) * tv + r]);
        for (int s2 = 0; s2 < s; ++s2) R -= sm.coefA[s * kMaxT + s2] * sm.urow[s2 * tv + r];
        sm.urow[s * tv + r] = R;
      }
      for (int s = 0; s < T; ++s) {
        float y = sm.egam[s] * sm.hist[2 * s * tv + r];
        for (int s2 = 0; s2 <= s; ++s2) y += sm.coefB[s * kMaxT + s2] * sm.urow[s2 * tv + r];
        stx(out.p, out.dtype, out_index(s, r), epilogue(p, b, s, h, v0 + r, sm.vrow[s * tv + r], y));
        const float u = sm.urow[s * tv + r];
        if (kv_store) {
          stx(head + static_cast<int64_t>(base + s) * dv * ee, p.entry_dtype, v0 + r, u);
        } else {
          const int pos = (base + s) % L;
          stx(ring_u + ((static_cast<int64_t>(seq) * L + pos) * p.hv + h) * dv * ee, p.entry_dtype, v0 + r, u);
        }
      }
    }
    if (kv_store && tile == 0) {
      // KV-only keys and decays live in the head's own memory: no sibling reads them.
      for (int i = tid; i < T * dk; i += kThreads) {
        const int s = i / dk, e = i % dk;
        stx(head + (static_cast<int64_t>(p.kv_cap) * dv + static_cast<int64_t>(base + s) * dk) * ee,
            p.entry_dtype, e, sm.xs[(2 * s + 1) * dk + e]);
      }
      if (tid < T)
        *reinterpret_cast<float*>(head + static_cast<int64_t>(p.kv_cap) * (dv + dk) * ee + 4 * (base + tid)) =
            sm.gd[tid];
    }
  }

  if (p.op == kOpStep && p.conv_dim > 0) {
    // This CTA's share of the conv inputs goes into the window ring.
    const int R = p.hv * p.tiles, rr = h * p.tiles + tile;
    const int lo = static_cast<int>(static_cast<int64_t>(rr) * p.conv_dim / R);
    const int hi = static_cast<int>(static_cast<int64_t>(rr + 1) * p.conv_dim / R);
    const int wdt = hi - lo;
    const int ce = p.conv_dtype == KVR_DT_F32 ? 4 : 2;
    for (int i = tid; i < T * wdt; i += kThreads) {
      const int s = i / wdt, c = lo + i % wdt;
      const int slot = (conv_end + s) % p.conv_slots;
      const float x = ldx(p.conv_in.p, p.conv_in.dtype, b * p.conv_in.s[0] + s * p.conv_in.s[1] + c * p.conv_in.s[2]);
      stx(p.conv + ((static_cast<int64_t>(seq) * p.conv_slots + slot) * p.conv_dim) * ce, p.conv_dtype, c, x);
    }
  }

  // Metadata, ring keys and decays are shared by the sequence's CTAs: kvr_gdn_finish,
  // launched next on the stream, writes them once every CTA has read the old ones.
}

// After a step or flush launch: per sequence, the ring keys and decays of the new entries
// (keys normalized as the step kernel did), the metadata, and the transition counters.
// One CTA of kFinishThreads per batch row.
constexpr int kFinishThreads = KVR_GDN_FINISH_THREADS;

__device__ void finish_body(const StepParams& p) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x;
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  if (seq < 0) return;
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const int mode = __ldcg(meta + kMetaMode), start = __ldcg(meta + kMetaStart);
  const int hcnt = __ldcg(meta + kMetaH), conv_end = __ldcg(meta + kMetaConvEnd);
  const int pending = __ldcg(meta + kMetaPending);
  const Place pl = placement(p, mode, start, hcnt);
  if (p.op == kOpFlush && !pl.flush) return;
  const bool recurrent = mode == kModeRecurrent;
  if (p.op == kOpStep && !recurrent && !pl.kv_store) ring_keys_and_decays(p, b, seq, pl.base, warp, lane, tid, kFinishThreads);
  for (int i = tid; i < p.hv; i += kFinishThreads) p.sync[static_cast<int64_t>(seq) * p.hv + i] = 0u;
  __syncthreads();  // every thread has read the old metadata
  if (tid == 0) finish_meta(p, meta, mode, start, hcnt, pending, conv_end, pl);
}

__device__ void commit_body(const CommitParams& p) {
  __shared__ int s_last;
  const int tid = threadIdx.x;
  const int b = blockIdx.x, chunk = blockIdx.y, l = p.layer0 + blockIdx.z;
  const int seq = p.ids[b];
  if (seq < 0) return;
  int32_t* meta = p.meta + (static_cast<int64_t>(l) * p.max_seqs + seq) * kMetaInts;
  const int mode = __ldcg(meta + kMetaMode), pending = __ldcg(meta + kMetaPending);
  const int hcnt = __ldcg(meta + kMetaH), conv_end = __ldcg(meta + kMetaConvEnd);
  const int acc = p.accepted ? p.accepted[static_cast<int64_t>(b) * p.acc_stride] : p.acc_inline[b];
  const int a = max(0, min(acc, pending));
  if (p.recurrent && a > 0) {
    // Adopt the snapshot taken after the last accepted draft (this CTA's share of it).
    const LayerState ls = p.layers[l];
    const int4* src = reinterpret_cast<const int4*>(
        p.snaps + l * p.snap_layer_bytes + (static_cast<int64_t>(seq) * p.max_drafts + (a - 1)) * p.state_bytes);
    int4* dst = reinterpret_cast<int4*>(ls.state + static_cast<int64_t>(seq) * ls.seq_stride * p.state_es);
    const int64_t n16 = p.state_bytes / 16;
    const int64_t lo = n16 * chunk / p.chunks, hi = n16 * (chunk + 1) / p.chunks;
    for (int64_t i = lo + tid; i < hi; i += blockDim.x) dst[i] = src[i];
  }
  if (chunk == 0 && p.conv_out.p != nullptr) {
    // The conv window of the accepted prefix: the conv_k1 inputs before the new end.
    const int ce = p.conv_dtype == KVR_DT_F32 ? 4 : 2;
    const char* cw = p.conv + l * p.conv_layer_bytes + static_cast<int64_t>(seq) * p.conv_slots * p.conv_dim * ce;
    const Tensor& o = p.conv_out;
    for (int i = tid; i < p.conv_k1 * p.conv_dim; i += blockDim.x) {
      const int ii = i / p.conv_dim, c = i % p.conv_dim;
      const int slot = (conv_end + a - p.conv_k1 + ii) % p.conv_slots;
      stx(o.p, o.dtype, (l - p.layer0) * o.s[3] + b * o.s[0] + ii * o.s[1] + c * o.s[2],
          ldx(cw + static_cast<int64_t>(slot) * p.conv_dim * ce, p.conv_dtype, c));
    }
  }
  __syncthreads();
  if (tid == 0) {
    bool last = true;
    if (p.chunks > 1) {
      __threadfence();
      last = atomicAdd(meta + kMetaArrive, 1) == p.chunks - 1;
    }
    s_last = last;
  }
  __syncthreads();
  if (!s_last || tid != 0) return;
  __threadfence();
  if (mode != kModeRecurrent) meta[kMetaH] = hcnt + a;
  meta[kMetaConvEnd] = conv_end + a;
  meta[kMetaPending] = 0;
  meta[kMetaArrive] = 0;
}

}  // namespace gdn
}  // namespace kvr

#define KVR_GDN_STEP(SD, SN, VM, LN, NV)                                                        \
  extern "C" __global__ void __launch_bounds__(kvr::gdn::kThreads, 2)                           \
      kvr_gdn_step_##SN##_##LN##_nv##NV(const __grid_constant__ kvr::gdn::StepParams p) {       \
    kvr::gdn::step_body<SD, VM, NV>(p);                                                         \
  }
KVR_GDN_STEP(float, f32, false, k, 8)
KVR_GDN_STEP(float, f32, true, v, 8)
KVR_GDN_STEP(__nv_bfloat16, bf16, false, k, 8)
KVR_GDN_STEP(__nv_bfloat16, bf16, true, v, 8)
KVR_GDN_STEP(float, f32, false, k, 16)
KVR_GDN_STEP(float, f32, true, v, 16)
KVR_GDN_STEP(__nv_bfloat16, bf16, false, k, 16)
KVR_GDN_STEP(__nv_bfloat16, bf16, true, v, 16)
#undef KVR_GDN_STEP
static_assert(KVR_GDN_NARROW_NV == 8 && KVR_GDN_MAX_NV == 16, "the _nv8 and _nv16 kernels above");

extern "C" __global__ void __launch_bounds__(kvr::gdn::kFinishThreads)
    kvr_gdn_finish(const __grid_constant__ kvr::gdn::StepParams p) {
  kvr::gdn::finish_body(p);
}

extern "C" __global__ void __launch_bounds__(KVR_GDN_COMMIT_THREADS) kvr_gdn_commit(const __grid_constant__ kvr::gdn::CommitParams p) {
  kvr::gdn::commit_body(p);
}
