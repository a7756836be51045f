// Gated DeltaNet single-token decode, streaming form:
//   kvr_gdn_sdecode_<state>_<k|v>_d<dk>   one token per sequence (T = 1, auto-commit) for a
//                                         batch in replay or recurrent mode, in pools without
//                                         KV-only mode (src/linear/gdn/cuda.rs picks it per
//                                         layout, mode and batch size: `stream_batches`)
//
// Decode is a stream over the checkpoint states, and what limits it is how many state bytes
// are in flight while each CTA waits on its small dependent loads (metadata, then the ring
// entries the metadata points at). So a CTA owns one tile of R value rows of one (sequence,
// value head) and, first thing, issues asynchronous copies (cp.async, 16 bytes each) of its
// whole state tile into shared memory (R x dk elements: 64 KiB for R = 128, dk = 128, f32),
// computed from the sequence id alone. The metadata, q, k, v, g, beta loads and then the
// ring entries (u rows of the tile also by cp.async, decays, keys) are issued while the
// tile streams in; the arithmetic reads the tile from shared memory. Each SM keeps two or
// three such tiles in flight, so the dependent round trips hide behind the state traffic.
//
// The per-sequence bookkeeping that kvr_gdn_finish does after the other decode kernels is
// done here: the new entry's ring key and decay are written by the first tile of its head
// (nobody reads that slot in this step), and the metadata by the last CTA of the sequence to
// arrive (an arrival counter in the metadata record). In a flush step the new entry's slot
// is the oldest entry, which every CTA of the sequence reads, so the last CTA writes the key
// and decay there too. One launch per step, no second kernel.
//
// Math, per value row v of the tile, with S the checkpoint and ring entries j < h:
//   (S_{t-1} x)[v] = e^{G} (S x)[v] + sum_j w_j (k_j . x) u_j[v],  w_j = e^{g_{j+1}+...+g_{h-1}}
// for x in {q_t, k_t}; u_t = beta (v_t - e^{g_t} S_{t-1} k_t); y_t = e^{g_t} S_{t-1} q_t +
// (k_t . q_t) u_t. A flush (full ring) stores e^{G} S + sum_j w_j u_j k_j^T as the new
// checkpoint; the output is the same expression read before the fold (it equals the readout
// against the folded state). Recurrent mode (ring 0) stores e^{g_t} S + u_t k_t^T.
//
// Shared memory: the state tile (V-major: R rows of dk; K-major: dk rows of R values, each row
// padded by 16 bytes so that the 8 lanes of a quarter warp, reading 8 consecutive key rows,
// hit different banks), the ring's u rows of the tile, then small float arrays:
// kvr_gdn_stream_smem_layout (kvr_abi.h), which the host sizes the launch by.
#include "gdn_stream.cuh"

namespace kvr {
namespace gdn {

// Words of the int area: the current item's metadata [0, 5), k . q [5], e^G [6], the deferred
// tail flag [7], and two tail records of kTailInts words from [8].
enum : int { kTailInts = 10, kTailAt = 8 };

// One work item: a tile of R value rows of one (batch row, value head).
struct Item {
  int b, h, tile, seq;
};

template <typename SD, bool VM, int DK>
__device__ void sdecode_body(const StepParams& p) {
  extern __shared__ __align__(16) unsigned char sm[];
  constexpr int ES = sizeof(SD);
  constexpr int KL = DK / 32;
  constexpr int VW = KL < 4 ? KL : 4;
  const int R = p.tv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = p.hv / p.hk;
  const int dv = p.dv;
  const int L = p.l;
  const int Ls = L > 0 ? L : 1;
  const int total = p.b * p.hv * p.tiles;
  const int per_seq = p.hv * p.tiles;
  const Tensor& out = p.out;
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  const kvr_gdn_stream_smem lay = kvr_gdn_stream_smem_layout(VM, DK, R, ES, L, ee, p.stages);
  unsigned char* ut = sm + lay.ut;
  float* qs = reinterpret_cast<float*>(sm + lay.fl);
  float* ks = qs + DK;
  float* sq = ks + DK;
  float* sk = sq + R;
  float* us = sk + R;
  const int Lc = L > 0 ? L : 1;
  float* aq = us + R;
  float* ak = aq + Lc;
  float* wg = ak + Lc;
  float* gs = wg + Lc;
  int* mi = reinterpret_cast<int*>(sm + lay.ints);
  const int row_bytes = VM ? DK * ES : R * ES + 16;
  auto key = [&](int c) { return (c / VW) * (32 * VW) + lane * VW + c % VW; };

  auto item_of = [&](int it) {
    Item x;
    x.tile = it % p.tiles;
    const int hb = it / p.tiles;
    x.h = hb % p.hv;
    x.b = hb / p.hv;
    x.seq = p.ids ? p.ids[x.b] : p.ids_inline[x.b];
    return x;
  };
  auto head_of = [&](const Item& x) {
    return p.state + (static_cast<int64_t>(x.seq) * p.seq_stride + static_cast<int64_t>(x.h) * DK * dv) * ES;
  };
  // The tile of item x into shared memory at `dst`: bulk copies completing on `bar` (sm_90;
  // an unused row just arrives, so that the barrier's phases stay one per use), or cp.async
  // (the caller commits).
  auto issue_tile = [&](const Item& x, unsigned char* dst, uint64_t* bar) {
    const int v0 = x.tile * R;
#if KVR_GDN_BULK
    if (warp != 0) return;
    if (x.seq < 0) {
      if (lane == 0) mbar_arrive(bar);
      return;
    }
    const char* hd = head_of(x);
    if constexpr (VM) {
      if (lane == 0) {
        const uint32_t bytes = R * DK * ES;
        mbar_expect_tx(bar, bytes);
        bulk_copy(dst, hd + static_cast<int64_t>(v0) * DK * ES, bytes, bar);
      }
    } else {
      if (lane == 0) mbar_expect_tx(bar, DK * R * ES);
      __syncwarp();
      for (int k = lane; k < DK; k += 32)
        bulk_copy(dst + k * row_bytes, hd + (static_cast<int64_t>(k) * dv + v0) * ES, R * ES, bar);
    }
#else
    (void)bar;
    if (x.seq < 0) return;
    const char* hd = head_of(x);
    if constexpr (VM) {
      const char* src = hd + static_cast<int64_t>(v0) * DK * ES;
      const int n16 = R * DK * ES / 16;
      for (int i = tid; i < n16; i += kStreamThreads) cp_async_16(dst + 16 * i, src + 16 * i, 16);
    } else {
      const int c16 = R * ES / 16;
      const int n16 = DK * c16;
      for (int i = tid; i < n16; i += kStreamThreads) {
        const int k = i / c16, c = i - k * c16;
        cp_async_16(dst + k * row_bytes + 16 * c, hd + (static_cast<int64_t>(k) * dv + v0) * ES + 16 * c, 16);
      }
    }
#endif
  };
  auto load_meta = [&](int seq, int* m) {
    const int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
    const int4 m0 = __ldcg(reinterpret_cast<const int4*>(meta));
    m[0] = m0.x;
    m[1] = m0.y;
    m[2] = m0.z;
    m[3] = m0.w;
    m[4] = __ldcg(meta + kMetaConvEnd);
  };
  // The step's end for a sequence whose last item this CTA finished: the new entry's key and
  // decay in a flush step, and the metadata. `t` is a tail record.
  auto run_tail = [&](const int* t) {
    Place pl;
    pl.flush = t[8] != 0;
    pl.kv_store = false;
    pl.base = t[9];
    if (pl.flush) ring_keys_and_decays(p, t[2], t[1], pl.base, warp, lane, tid, kStreamThreads);
    if (tid == 0) {
      int32_t* meta = p.meta + static_cast<int64_t>(t[1]) * kMetaInts;
      finish_meta(p, meta, t[3], t[4], t[5], t[6], t[7], pl);
      meta[kMetaArrive] = 0;
    }
  };

  int it = blockIdx.x;
  if (it >= total) return;
  __shared__ uint64_t bars[2];  // tile buffers 0 and 1 (bulk copies)
#if KVR_GDN_BULK
  if (tid == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
#endif
  // An item's inputs, loaded one phase ahead of their use (the first item's with its
  // metadata, a later one's while the previous item finishes): raw q and k (warp 0, in its
  // lanes' key map), g, and v and beta for the row phase.
  float q_in[KL], k_in[KL], g_in = 0.f, v_in = 0.f, b_in = 0.f;
  auto load_inputs = [&](const Item& x) {
    const int kx = x.h / group;
    g_in = ldx(p.g.p, p.g.dtype, x.b * p.g.s[0] + x.h * p.g.s[2]);
    if (tid < R) {
      v_in = ldx(p.v.p, p.v.dtype, x.b * p.v.s[0] + x.h * p.v.s[2] + (x.tile * R + tid) * p.v.s[3]);
      b_in = ldx(p.beta.p, p.beta.dtype, x.b * p.beta.s[0] + x.h * p.beta.s[2]);
    }
    if (warp == 0) {
      const int64_t qo = x.b * p.q.s[0] + kx * p.q.s[2], ko = x.b * p.k.s[0] + kx * p.k.s[2];
#pragma unroll
      for (int c = 0; c < KL; ++c) {
        q_in[c] = ldx(p.q.p, p.q.dtype, qo + key(c) * p.q.s[3]);
        k_in[c] = ldx(p.k.p, p.k.dtype, ko + key(c) * p.k.s[3]);
      }
    }
  };
  Item cur = item_of(it);
  issue_tile(cur, sm + lay.st0, &bars[0]);
  if (cur.seq >= 0) {
    load_inputs(cur);
    if (tid == 0) load_meta(cur.seq, mi);
  }
  cp_async_commit();
  __syncthreads();
  int prev_arr = -1;  // thread 0: arrival count returned for the previous item (-1: none)
  int iter = 0;
  for (;; ++iter) {
    unsigned char* st = sm + ((iter & 1) ? lay.st1 : lay.st0);
    unsigned char* st_next = sm + ((iter & 1) ? lay.st0 : lay.st1);
    const int nxt = p.stages > 1 ? it + static_cast<int>(gridDim.x) : total;  // 1 stage: one item
    Item next;
    next.seq = -1;
    if (nxt < total) next = item_of(nxt);
    const int h = cur.h, b = cur.b, tile = cur.tile, seq = cur.seq;
    const int kh = h / group;
    const int v0 = tile * R;
    int my_arr = -1;
    int mn[5] = {0, 0, 0, 0, 0};  // thread 0: the next item's metadata

    const int mode = mi[0], start = mi[1], hcnt = mi[2], pending = mi[3], conv_end = mi[4];
    const bool recurrent = mode == kModeRecurrent;
    const int nbuf = (seq < 0 || recurrent) ? 0 : hcnt;
    const bool flush = seq >= 0 && !recurrent && hcnt + 1 > L;
    const int base = recurrent ? 0 : (start + hcnt) % Ls;
    auto slot = [&](int j) { return (start + j) % Ls; };
    auto entry_k = [&](int j) -> const char* {
      return p.ring_k + ((static_cast<int64_t>(seq) * Ls + slot(j)) * p.hk + kh) * DK * ee;
    };

    // 1. This item's ring rows and decays, then the next item's tile and metadata: every
    //    load this CTA will wait on is out before it waits.
    if (nbuf > 0) {
      const int c16 = R * ee / 16;
      for (int i = tid; i < nbuf * c16; i += kStreamThreads) {
        const int j = i / c16, c = i - j * c16;
        const char* src = p.ring_u + ((static_cast<int64_t>(seq) * Ls + slot(j)) * p.hv + h) * dv * ee +
                          static_cast<int64_t>(v0) * ee + 16 * c;
        cp_async_16(ut + j * R * ee + 16 * c, src, 16);
      }
      for (int j = tid; j < nbuf; j += kStreamThreads)
        gs[j] = p.ring_g[(static_cast<int64_t>(seq) * Ls + slot(j)) * p.hv + h];
    }
    cp_async_commit();
    if (nxt < total) {
#if KVR_GDN_BULK
      // The buffer's last reader finished before (B6); order its generic-proxy reads
      // before the copy engine's writes.
      if (warp == 0) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
      issue_tile(next, st_next, &bars[(iter + 1) & 1]);
      if (next.seq >= 0 && tid == 0) load_meta(next.seq, mn);
    }
    cp_async_commit();

    if (seq < 0) {  // an unused row: zero outputs
      for (int t = tid; t < R; t += kStreamThreads)
        stx(out.p, out.dtype, b * out.s[0] + h * out.s[2] + (v0 + t) * out.s[3], 0.f);
      if (next.seq >= 0) load_inputs(next);
      __syncthreads();  // every thread has read the metadata words thread 0 rewrites below
    } else {
      // 2. This step's inputs: q normalized and scaled, k normalized (and rounded as
      //    buffered, in replay pools), k . q; g, v, beta.
      const float gt = g_in, vt = v_in, bt = b_in;
      // This warp's first pair of entry keys, before anything waits (their addresses need
      // only the metadata, which came with the previous item).
      float kj[2][KL];
      if (2 * warp < nbuf) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const char* kp = entry_k(min(2 * warp + e, nbuf - 1));
#pragma unroll
          for (int c = 0; c < KL; c += VW) ld_entry<VW>(kp, p.entry_dtype, key(c), &kj[e][c]);
        }
      }
      if (warp == 0) {
        float q[KL], k[KL];
#pragma unroll
        for (int c = 0; c < KL; ++c) {
          q[c] = q_in[c];
          k[c] = k_in[c];
        }
        normalize_qk<KL>(p, q, k, L > 0);
        float kq = 0.f;
#pragma unroll
        for (int c = 0; c < KL; ++c) {
          kq += k[c] * q[c];
          qs[key(c)] = q[c];
          ks[key(c)] = k[c];
        }
        kq = warp_sum(kq);
        if (lane == 0) mi[5] = __float_as_int(kq);
      }
      __syncthreads();  // (B1) q and k

      // 3. The entries' key dot products k_j . q and k_j . k (a warp per pair of entries).
      float qv[KL], kv[KL];
#pragma unroll
      for (int c = 0; c < KL; ++c) {
        qv[c] = qs[key(c)];
        kv[c] = ks[key(c)];
      }
      for (int j0 = 2 * warp; j0 < nbuf; j0 += 2 * kStreamWarps) {
        if (j0 != 2 * warp) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const char* kp = entry_k(min(j0 + e, nbuf - 1));
#pragma unroll
            for (int c = 0; c < KL; c += VW) ld_entry<VW>(kp, p.entry_dtype, key(c), &kj[e][c]);
          }
        }
        float P[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float a = 0.f, c2 = 0.f;
#pragma unroll
          for (int c = 0; c < KL; ++c) {
            a += kj[e][c] * qv[c];
            c2 += kj[e][c] * kv[c];
          }
          P[e] = a;
          P[2 + e] = c2;
        }
        const float r = reduce4(P, lane);
        const int idx = lane >> 3, e = idx & 1;
        if ((lane & 7) == 0 && j0 + e < nbuf) (idx < 2 ? aq : ak)[j0 + e] = r;
      }
#if KVR_GDN_BULK
      cp_async_wait<0>();  // this item's ring rows
      mbar_wait(&bars[iter & 1], (iter >> 1) & 1);  // and its tile (the next one may still fly)
#else
      cp_async_wait<1>();  // this item's tile and ring rows (the next tile may still fly)
#endif
      __syncthreads();  // (B2)

      // 4. Warp 0: weights w_j by a suffix scan over the decays, and the coefficients
      //    aq_j = w_j (k_j . q), ak_j = w_j (k_j . k); meanwhile every warp reads the tile.
      if (warp == 0) {
        const float eg = suffix_weights(gs, nbuf, lane, [&](int j, float w) {
          wg[j] = w;
          aq[j] *= w;
          ak[j] *= w;
        });
        if (lane == 0) mi[6] = __float_as_int(eg);
      }
      // (S q)[v] and (S k)[v] for the tile's rows.
      if constexpr (VM) {
        const int rpw = R / kStreamWarps;  // rows per warp (even)
        for (int r0 = 0; r0 < rpw; r0 += 2) {
          float P[4];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const SD* row = reinterpret_cast<const SD*>(st + (warp * rpw + r0 + e) * row_bytes);
            float s[KL];
#pragma unroll
            for (int c = 0; c < KL; c += VW) ld_vec<SD, VW>(row + key(c), &s[c]);
            float a = 0.f, c2 = 0.f;
#pragma unroll
            for (int c = 0; c < KL; ++c) {
              a += s[c] * qv[c];
              c2 += s[c] * kv[c];
            }
            P[e] = a;
            P[2 + e] = c2;
          }
          const float r = reduce4(P, lane);
          const int idx = lane >> 3, e = idx & 1;
          if ((lane & 7) == 0) (idx < 2 ? sq : sk)[warp * rpw + r0 + e] = r;
        }
      } else {
        // K-major: lane = (quad, ksub); a quad is 4 value columns, ksub steps over key rows.
        const int nq = R / 32, ns = 32 / nq;
        const int ql = lane / ns, ksub = lane - ql * ns;
        const int c0 = warp * (R / kStreamWarps) + 4 * ql;
        float aq4[4] = {0.f, 0.f, 0.f, 0.f}, ak4[4] = {0.f, 0.f, 0.f, 0.f};
        for (int k = ksub; k < DK; k += ns) {
          float s[4];
          ld_vec<SD, 4>(reinterpret_cast<const SD*>(st + k * row_bytes) + c0, s);
          const float xq = qs[k], xk = ks[k];
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            aq4[x] += s[x] * xq;
            ak4[x] += s[x] * xk;
          }
        }
        for (int m = 1; m < ns; m <<= 1) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            aq4[x] += __shfl_xor_sync(0xffffffffu, aq4[x], m);
            ak4[x] += __shfl_xor_sync(0xffffffffu, ak4[x], m);
          }
        }
        if (ksub == 0) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            sq[c0 + x] = aq4[x];
            sk[c0 + x] = ak4[x];
          }
        }
      }
      __syncthreads();  // (B3) coefficients, e^G, (S q), (S k)

      // 5. Row phase: thread t < R owns value row v0 + t.
      const float a = expf(gt);
      const float eG = __int_as_float(mi[6]);
      if (tid < R) {
        float hq = 0.f, hk = 0.f;
        for (int j = 0; j < nbuf; ++j) {
          const float uj = ldx(ut, p.entry_dtype, j * R + tid);
          hq += aq[j] * uj;
          hk += ak[j] * uj;
        }
        const float kq = __int_as_float(mi[5]);
        const float hist_q = eG * sq[tid] + hq, hist_k = eG * sk[tid] + hk;
        const float u = bt * (vt - a * hist_k);
        const float y = a * hist_q + kq * u;
        stx(out.p, out.dtype, b * out.s[0] + h * out.s[2] + (v0 + tid) * out.s[3], y);
        if (!recurrent) {
          char* dst = p.ring_u + ((static_cast<int64_t>(seq) * Ls + base) * p.hv + h) * dv * ee;
          stx(dst, p.entry_dtype, v0 + tid, u);
        }
        us[tid] = u;
      }

      // 6. State writes: recurrent mode every step, replay mode when the ring is full.
      char* head = head_of(cur);
      if (recurrent) {
        __syncthreads();  // (B4) us
        if constexpr (VM) {
          const int rpw = R / kStreamWarps;
          for (int r = 0; r < rpw; ++r) {
            const int row = warp * rpw + r;
            const float ur = us[row];
#pragma unroll
            for (int c = 0; c < KL; c += VW) {
              float s[VW];
              ld_vec<SD, VW>(reinterpret_cast<const SD*>(st + row * row_bytes) + key(c), s);
#pragma unroll
              for (int x = 0; x < VW; ++x) s[x] = a * s[x] + ur * kv[c + x];
              st_vec<SD, VW>(reinterpret_cast<SD*>(head) + static_cast<int64_t>(v0 + row) * DK + key(c), s);
            }
          }
        } else {
          const int nq = R / 32, ns = 32 / nq;
          const int ql = lane / ns, ksub = lane - ql * ns;
          const int c0 = warp * (R / kStreamWarps) + 4 * ql;
          float u4[4];
#pragma unroll
          for (int x = 0; x < 4; ++x) u4[x] = us[c0 + x];
          for (int k = ksub; k < DK; k += ns) {
            float s[4];
            ld_vec<SD, 4>(reinterpret_cast<const SD*>(st + k * row_bytes) + c0, s);
            const float xk = ks[k];
#pragma unroll
            for (int x = 0; x < 4; ++x) s[x] = a * s[x] + xk * u4[x];
            st_vec<SD, 4>(reinterpret_cast<SD*>(st + k * row_bytes) + c0, s);
          }
          __syncthreads();
          store_kmajor_tile<SD>(st, head, v0, R, dv, row_bytes, DK);
        }
      } else if (flush) {
        fold_tile<SD, VM, DK>(st, head, v0, R, dv, row_bytes, eG, nbuf, wg, ut, p.entry_dtype, entry_k);
      }

      // 7. The new entry's key and decay (outside a flush: nobody reads that slot this step).
      if (!recurrent && !flush && tile == 0) {
        if (h % group == 0) {
          char* kd = p.ring_k + ((static_cast<int64_t>(seq) * Ls + base) * p.hk + kh) * DK * ee;
          for (int i = tid; i < DK; i += kStreamThreads) stx(kd, p.entry_dtype, i, ks[i]);
        }
        if (tid == 0) p.ring_g[(static_cast<int64_t>(seq) * Ls + base) * p.hv + h] = gt;
      }
      if (p.conv_dim > 0) conv_window_share(p, b, seq, h, tile, conv_end, tid, kStreamThreads);
      __syncthreads();  // (B5) every thread is done with this item's shared memory
      if (next.seq >= 0) load_inputs(next);  // (persistent CTAs)
      // 8. Arrival. The last CTA of a sequence to arrive finishes its step, one item later
      //    (the count is read then, so the round trip hides behind the next item). No fence
      //    before the arrival: the finishing CTA writes only what the others have finished
      //    reading (the metadata, and in a flush the oldest entry's key and decay).
      if (tid == 0) {
        my_arr = atomicAdd(p.meta + static_cast<int64_t>(seq) * kMetaInts + kMetaArrive, 1);
        int* t = mi + kTailAt + (iter & 1) * kTailInts;
        t[1] = seq;
        t[2] = b;
        t[3] = mode;
        t[4] = start;
        t[5] = hcnt;
        t[6] = pending;
        t[7] = conv_end;
        t[8] = flush;
        t[9] = base;
      }
    }
    // The previous item's tail flag, and the next item's metadata (every thread has read the
    // current one).
    if (tid == 0) {
      mi[7] = prev_arr == per_seq - 1;
      prev_arr = my_arr;
      mi[0] = mn[0];
      mi[1] = mn[1];
      mi[2] = mn[2];
      mi[3] = mn[3];
      mi[4] = mn[4];
    }
    __syncthreads();  // (B6)
    if (mi[7]) run_tail(mi + kTailAt + ((iter + 1) & 1) * kTailInts);
    if (nxt >= total) break;
    it = nxt;
    cur = next;
  }
  // The last item's tail (after every thread has read the flag above: racecheck).
  __syncthreads();
  if (tid == 0) mi[7] = prev_arr == per_seq - 1;
  __syncthreads();
  if (mi[7]) run_tail(mi + kTailAt + (iter & 1) * kTailInts);
}

}  // namespace gdn
}  // namespace kvr

// Resident CTAs per SM the register budget aims for: V-major 3 (80 registers, as many CTAs as
// the one-tile shared memory allows at 128 rows, f32), K-major 2 (its padded tile allows 2 at
// 128 rows, and 128 registers spill nothing; measured faster than 3 on the H200).
#define KVR_GDN_SDECODE(SD, SN, VM, LN, DK, MINB)                                                  \
  extern "C" __global__ void __launch_bounds__(kvr::gdn::kStreamThreads, MINB)                   \
      kvr_gdn_sdecode_##SN##_##LN##_d##DK(const __grid_constant__ kvr::gdn::StepParams p) {      \
    kvr::gdn::sdecode_body<SD, VM, DK>(p);                                                        \
  }
#define KVR_GDN_SDECODE_DK(DK)                           \
  KVR_GDN_SDECODE(float, f32, false, k, DK, 2)           \
  KVR_GDN_SDECODE(float, f32, true, v, DK, 3)            \
  KVR_GDN_SDECODE(__nv_bfloat16, bf16, false, k, DK, 2)  \
  KVR_GDN_SDECODE(__nv_bfloat16, bf16, true, v, DK, 3)
KVR_GDN_SDECODE_DK(64)
KVR_GDN_SDECODE_DK(128)
KVR_GDN_SDECODE_DK(256)
#undef KVR_GDN_SDECODE_DK
#undef KVR_GDN_SDECODE
