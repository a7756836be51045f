// Gated DeltaNet single-token decode, the hot path of replay decoding:
//   kvr_gdn_decode_<state>_<k|v>_d<dk>   one token per sequence (T = 1, auto-commit) for a
//                                        batch in replay, recurrent or KV-only mode (with
//                                        `kv_split`, KV-only rows that do not materialize take
//                                        kernels/gdn_kvonly.cuh's head-wide path)
// (src/linear/gdn/cuda.rs picks it for dk in {64, 128, 256}; kernels/gdn.cu handles every
// other step, and kvr_gdn_finish runs after this kernel as after the general one.)
//
// Decode is a stream over the checkpoint states, so the kernel is shaped for memory-level
// parallelism, like fla's fused recurrent kernel: one warp owns 8 value rows of one
// (sequence, value head) with the whole key dimension (8 x dk state elements in
// registers), and does everything with shuffles: no shared memory and no CTA barrier, so
// many warps per SM keep loads in flight while others compute. A CTA is `tv / 8` warps of
// the same head; the only CTA-level synchronization is the KV-only -> state transition,
// where the head's entries live in the memory its state is about to overwrite
// (head_barrier, as in kernels/gdn.cu).
//
// Per warp, with S the checkpoint slice and ring entries j < h (u_j, k_j, g_j):
//   S_{t-1} x = e^{G} S x + sum_j w_j (k_j . x) u_j,  w_j = e^{g_{j+1} + ... + g_{h-1}}
// for x in {q_t, k_t}; then u_t = beta (v_t - e^{g_t} S_{t-1} k_t) and
// y_t = e^{g_t} S_{t-1} q_t + (k_t . q_t) u_t. A flush (full ring, or a KV-only sequence
// reaching its threshold) first folds the ring into S and stores it; recurrent mode
// decays, reads and rewrites S every step. The arithmetic follows kernels/gdn.cu step for
// step, so both kernels agree with the CPU backend to rounding.
#include "gdn_common.cuh"
#include "gdn_kvonly.cuh"

namespace kvr {
namespace gdn {

constexpr int kRows = KVR_GDN_DECODE_ROWS_PER_WARP;        // value rows per warp
constexpr int kDecodeMaxWarps = KVR_GDN_DECODE_MAX_WARPS;  // warps per CTA (tv <= 32)
static_assert(kRows == 8, "LaneMap and the row phase assume 8 rows per warp");

// Which state elements a lane holds: s[r][c] = S[row0 + r][key(c)] for all 8 rows of the
// warp and KL = dk / 32 keys in runs of VW. V-major ([dv][dk]): a warp instruction reads
// 32 x 16 contiguous bytes of one row. K-major ([dk][dv]): each (key, 8 rows) is 32
// contiguous bytes, read as one or two vectors per lane. (Measured on the H100: giving the
// two halves of a key's 32 bytes to a lane pair, 16 keys per instruction, was 37 % slower.)
template <bool VM, int DK> struct LaneMap {
  static constexpr int RL = kRows;
  static constexpr int KL = DK / 32;
  static constexpr int VW = KL < 4 ? KL : 4;  // contiguous keys per load
  __device__ __forceinline__ static int key(int lane, int c) {
    return (c / VW) * (32 * VW) + lane * VW + c % VW;
  }
};

template <typename SD, bool VM, int DK>
__device__ void decode_body(const StepParams& p) {
  using M = LaneMap<VM, DK>;
  constexpr int RL = M::RL, KL = M::KL, VW = M::VW;
  constexpr int CH = 4;            // ring entries per chunk of key loads
  constexpr int CHF = 2;           // ... in a flush
  constexpr int S2 = 32 / (2 * CH);  // lanes per reduced chunk value
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int tile = blockIdx.x % p.tiles;
  const int hb = blockIdx.x / p.tiles;
  const int h = hb % p.hv, b = hb / p.hv;
  const int dv = p.dv;
  const int kh = h / (p.hv / p.hk);
  const int row0 = tile * p.tv + warp * kRows;
  // Row phase: lane l handles value row row0 + (l & 7); lanes 0..7 write.
  const int rr = lane & (kRows - 1);
  const bool writer = lane < kRows;
  const int seq = p.ids ? p.ids[b] : p.ids_inline[b];
  const Tensor& out = p.out;
  const int64_t out_at = b * out.s[0] + h * out.s[2] + (row0 + rr) * out.s[3];
  if (seq < 0) {  // an unused row: zero outputs
    if (writer) stx(out.p, out.dtype, out_at, 0.f);
    return;
  }
  auto key = [&](int c) { return M::key(lane, c); };

  char* head = p.state + (static_cast<int64_t>(seq) * p.seq_stride + static_cast<int64_t>(h) * DK * dv) *
                             static_cast<int64_t>(sizeof(SD));
  SD* hs = reinterpret_cast<SD*>(head);
  // The state slice (not read for a KV-only sequence; see `early`).
  float s[RL][KL];
  auto state_io = [&](bool store) {
    if constexpr (VM) {
#pragma unroll
      for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int c = 0; c < KL; c += VW) {
          SD* at = hs + static_cast<int64_t>(row0 + r) * DK + key(c);
          if (store)
            st_vec<SD, VW>(at, &s[r][c]);
          else
            ld_vec<SD, VW>(at, &s[r][c]);
        }
    } else {
#pragma unroll
      for (int c = 0; c < KL; ++c) {
        SD* at = hs + static_cast<int64_t>(key(c)) * dv + row0;
        float t[RL];
        if (store) {
#pragma unroll
          for (int r = 0; r < RL; ++r) t[r] = s[r][c];
          st_vec<SD, RL>(at, t);
        } else {
          ld_vec<SD, RL>(at, t);
#pragma unroll
          for (int r = 0; r < RL; ++r) s[r][c] = t[r];
        }
      }
    }
  };
  // Where no sequence can be KV-only (no threshold), the slice load goes out before the
  // metadata; otherwise after it, so that a KV-only sequence reads no state at all (its
  // point) at the cost of one more round trip for the others.
  const bool early = p.thr == 0;
  if (early) state_io(false);

  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const int4 m4 = __ldcg(reinterpret_cast<const int4*>(meta));
  const int mode = m4.x, start = m4.y, hcnt = m4.z;
  const bool recurrent = mode == kModeRecurrent, kvonly = mode == kModeKvOnly;
  // `kv_split`: a KV-only row that stays KV-only is computed by kvonly_head
  // (kernels/gdn_kvonly.cuh), in kvr_gdn_kvonly_* (1) or here by its first tile's CTA of
  // 128 threads (2); its other tiles have nothing to do.
  if (p.kv_split && kvonly && !placement(p, mode, start, hcnt).flush) {
    if (p.kv_split == 2 && tile == 0) kvonly_head<SD, DK>(p, b, h, seq, m4);
    return;
  }
  if (!early && !kvonly) state_io(false);

  float q[KL], k[KL];
  {
    const int64_t qo = b * p.q.s[0] + kh * p.q.s[2], ko = b * p.k.s[0] + kh * p.k.s[2];
#pragma unroll
    for (int c = 0; c < KL; ++c) {
      q[c] = ldx(p.q.p, p.q.dtype, qo + key(c) * p.q.s[3]);
      k[c] = ldx(p.k.p, p.k.dtype, ko + key(c) * p.k.s[3]);
    }
  }
  const float vt = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + (row0 + rr) * p.v.s[3]);
  const float gt = ldx(p.g.p, p.g.dtype, b * p.g.s[0] + h * p.g.s[2]);
  const float bt = ldx(p.beta.p, p.beta.dtype, b * p.beta.s[0] + h * p.beta.s[2]);

  const Place pl = placement(p, mode, start, hcnt);
  const int ee = p.entry_dtype == KVR_DT_F32 ? 4 : 2;
  const int L = p.l > 0 ? p.l : 1;
  auto entry_u = [&](int j) -> const char* {
    if (kvonly) return head + static_cast<int64_t>(j) * dv * ee;
    return p.ring_u + ((static_cast<int64_t>(seq) * L + (start + j) % L) * p.hv + h) * dv * ee;
  };
  auto entry_k = [&](int j) -> const char* {
    if (kvonly) return head + (static_cast<int64_t>(p.kv_cap) * dv + static_cast<int64_t>(j) * DK) * ee;
    return p.ring_k + ((static_cast<int64_t>(seq) * L + (start + j) % L) * p.hk + kh) * DK * ee;
  };
  auto entry_g = [&](int j) -> float {
    if (kvonly)
      return *reinterpret_cast<const float*>(head + static_cast<int64_t>(p.kv_cap) * (dv + DK) * ee + 4 * j);
    return p.ring_g[(static_cast<int64_t>(seq) * L + (start + j) % L) * p.hv + h];
  };
  auto load_keys = [&](const char* kp, float* dst) {
#pragma unroll
    for (int c = 0; c < KL; c += VW) ld_entry<VW>(kp, p.entry_dtype, key(c), dst + c);
  };

  const int nbuf = recurrent ? 0 : hcnt;
  const bool readout = !recurrent && !pl.flush;  // checkpoint + entries, no state write

  // Readout prefetch: this warp's first chunk of keys (chunks c0 = 4 (warp + i W)), this
  // thread's decay, and the u values of the last 32 entries (lane: row l & 7, entries
  // (l >> 3) + 4 i), all issued before anything waits.
  const int blk0 = nbuf > 0 ? ((nbuf - 1) / 32) * 32 : 0;
  float kj[CH][KL], uv[8];
  float gl = 0.f;
  if (readout && nbuf > 0) {
    const int c0 = warp * CH;
    if (c0 < nbuf) {
      const int n = min(CH, nbuf - c0);
#pragma unroll
      for (int j = 0; j < CH; ++j) load_keys(entry_k(c0 + min(j, n - 1)), kj[j]);
    }
    if (static_cast<int>(threadIdx.x) < nbuf) gl = entry_g(threadIdx.x);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      ld_entry<1>(entry_u(min(blk0 + (lane >> 3) + 4 * i, nbuf - 1)), p.entry_dtype, row0 + rr, &uv[i]);
  }

  // q normalized and scaled, k normalized (and rounded as buffered, except in recurrent
  // mode, which buffers nothing).
  normalize_qk<KL>(p, q, k, !recurrent);
  float kq = 0.f;
#pragma unroll
  for (int c = 0; c < KL; ++c) kq += k[c] * q[c];
  kq = warp_sum(kq);
  // q and k in the entries' map (the same registers for V-major).


  // (S q)[row0 + rr] and (S k)[row0 + rr] in every lane.
  auto state_dots = [&](float& sq, float& sk) {
    const float2 d = rows8_dots<KL>(s, q, k, lane);
    sq = d.x;
    sk = d.y;
  };
  auto scale_state = [&](float f) { scale_rows<RL, KL>(s, f); };
  auto round_state = [&]() {
    if constexpr (!IsSame<SD, float>::value) {
#pragma unroll
      for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int c = 0; c < KL; ++c) s[r][c] = roundx(KVR_DT_BF16, s[r][c]);
    }
  };

  const float a = expf(gt);
  float y, u;
  if (recurrent) {
    scale_state(a);
    float sq, sk;
    state_dots(sq, sk);
    u = bt * (vt - sk);
    y = sq + kq * u;
    // S += k u^T: u of row r lives in lane r.
#pragma unroll
    for (int r = 0; r < RL; ++r) {
      const float ur = __shfl_sync(0xffffffffu, u, r);
#pragma unroll
      for (int c = 0; c < KL; ++c) s[r][c] += ur * k[c];
    }
    round_state();
    state_io(true);
  } else if (pl.flush) {
    // Fold the entries into the checkpoint (a KV-only sequence starts from zero), store
    // it, and read the new token against it. Warp-local: every L steps only.
    if (kvonly) {
      // (never loaded for a KV-only sequence, or loaded early as entry bits: assign)
#pragma unroll
      for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int c = 0; c < KL; ++c) s[r][c] = 0.f;
    }
    float carry = 0.f;  // sum of the decays after the current chunk
    for (int c0 = nbuf > 0 ? ((nbuf - 1) / CHF) * CHF : -1; c0 >= 0; c0 -= CHF) {
      const int n = min(CHF, nbuf - c0);
      float gj[CHF], fkj[CHF][KL], fu[CHF][RL];
#pragma unroll
      for (int j = 0; j < CHF; ++j) {
        const int e = c0 + min(j, n - 1);
        gj[j] = j < n ? entry_g(e) : 0.f;
        load_keys(entry_k(e), fkj[j]);
        ld_entry<RL>(entry_u(e), p.entry_dtype, row0, fu[j]);
      }
      if (c0 + CHF >= nbuf && !kvonly) {
        // the last chunk comes first: scale the checkpoint by e^{G} before any entry
        float tot = 0.f;
        for (int j = nbuf - 1; j >= 0; --j) tot += entry_g(j);
        scale_state(expf(tot));
      }
      float acc = carry;
#pragma unroll
      for (int j = CHF - 1; j >= 0; --j) {
        const float w = j < n ? expf(acc) : 0.f;
        acc += gj[j];
#pragma unroll
        for (int r = 0; r < RL; ++r) {
          const float wu = w * fu[j][r];
#pragma unroll
          for (int c = 0; c < KL; ++c) s[r][c] += wu * fkj[j][c];
        }
      }
      carry = acc;
    }
    round_state();
    // Every warp of the head must have read the entries kept in the state memory.
    if (kvonly) head_barrier(p.sync + static_cast<int64_t>(seq) * p.hv + h, p.tiles);
    state_io(true);
    float sq, sk;
    state_dots(sq, sk);
    u = bt * (vt - a * sk);
    y = a * sq + kq * u;
  } else {
    float sq = 0.f, sk = 0.f;
    if (!kvonly) state_dots(sq, sk);
    float hq = 0.f, hk = 0.f;  // the entries' part of S_{t-1} q and S_{t-1} k, row rr
    float eG = 1.f;
    if (nbuf > 0) {
      // (a) the CTA's warps share the key dot products k_j . q and k_j . k, by chunks.
      extern __shared__ float dsm[];
      const kvr_gdn_decode_smem lay = kvr_gdn_decode_smem_layout(p.hmax);
      float* gs = dsm + lay.gs;
      float* cq = dsm + lay.cq;
      float* ck = dsm + lay.ck;
      if (static_cast<int>(threadIdx.x) < nbuf) gs[threadIdx.x] = gl;
      for (int j = threadIdx.x + blockDim.x; j < nbuf; j += blockDim.x) gs[j] = entry_g(j);
      for (int c0 = warp * CH; c0 < nbuf; c0 += nwarps * CH) {
        const int n = min(CH, nbuf - c0);
        if (c0 != warp * CH) {
#pragma unroll
          for (int j = 0; j < CH; ++j) load_keys(entry_k(c0 + min(j, n - 1)), kj[j]);
        }
        float P[2 * CH];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          float a2 = 0.f, c2 = 0.f;
#pragma unroll
          for (int c = 0; c < KL; ++c) {
            a2 += kj[j][c] * q[c];
            c2 += kj[j][c] * k[c];
          }
          P[j] = a2;
          P[CH + j] = c2;
        }
        const float red = reduce_scatter<2 * CH>(P, lane);
        const int idx = lane / S2, j = idx % CH;
        if (lane % S2 == 0 && j < n) (idx < CH ? cq : ck)[c0 + j] = red;
      }
      __syncthreads();
      // (b) per warp: weights w_j = e^{g_{j+1} + ... + g_{h-1}} by a suffix scan over blocks
      // of 32 entries (last block first), then row rr's share of the entries.
      float carry = 0.f;
      for (int blk = blk0; blk >= 0; blk -= 32) {
        const int jl = blk + lane;
        const float2 sc = warp_suffix(jl < nbuf ? gs[jl] : 0.f, lane);
        const float wj = jl < nbuf ? expf(carry + sc.x) : 0.f;
        const float cqw = jl < nbuf ? wj * cq[jl] : 0.f, ckw = jl < nbuf ? wj * ck[jl] : 0.f;
        carry += sc.y;
        if (blk != blk0) {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            ld_entry<1>(entry_u(min(blk + (lane >> 3) + 4 * i, nbuf - 1)), p.entry_dtype, row0 + rr, &uv[i]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int jj = (lane >> 3) + 4 * i;
          hq += __shfl_sync(0xffffffffu, cqw, jj) * uv[i];
          hk += __shfl_sync(0xffffffffu, ckw, jj) * uv[i];
        }
      }
      hq += __shfl_xor_sync(0xffffffffu, hq, 8);
      hq += __shfl_xor_sync(0xffffffffu, hq, 16);
      hk += __shfl_xor_sync(0xffffffffu, hk, 8);
      hk += __shfl_xor_sync(0xffffffffu, hk, 16);
      eG = expf(carry);
    }
    const float hist_q = eG * sq + hq, hist_k = eG * sk + hk;
    u = bt * (vt - a * hist_k);
    y = a * hist_q + kq * u;
  }

  if (writer) {
    stx(out.p, out.dtype, out_at, y);
    if (!recurrent) {
      char* dst = pl.kv_store ? head + static_cast<int64_t>(pl.base) * dv * ee
                              : p.ring_u + ((static_cast<int64_t>(seq) * L + pl.base % L) * p.hv + h) * dv * ee;
      stx(dst, p.entry_dtype, row0 + rr, u);
    }
  }
  if (pl.kv_store && tile == 0 && warp == 0) {
    // KV-only keys and decays live in the head's own memory: no other warp reads them.
    char* kd = head + (static_cast<int64_t>(p.kv_cap) * dv + static_cast<int64_t>(pl.base) * DK) * ee;
#pragma unroll
    for (int c = 0; c < KL; ++c) stx(kd, p.entry_dtype, key(c), k[c]);
    if (lane == 0)
      *reinterpret_cast<float*>(head + static_cast<int64_t>(p.kv_cap) * (dv + DK) * ee + 4 * pl.base) = gt;
  }
  if (p.conv_dim > 0)
    conv_window_share(p, b, seq, h, tile, __ldcg(meta + kMetaConvEnd), threadIdx.x, blockDim.x);
  // Metadata, ring keys and decays: kvr_gdn_finish, next on the stream.
}

}  // namespace gdn
}  // namespace kvr

// Resident CTAs per SM the register budget aims for. dk 128: 96 registers (20 warps per
// SM, a few spilled bytes) measured 10-14 % faster than 128 registers without spills.
#define KVR_GDN_DECODE(SD, SN, VM, LN, DK, MB)                                                  \
  extern "C" __global__ void __launch_bounds__(32 * kvr::gdn::kDecodeMaxWarps, MB)             \
      kvr_gdn_decode_##SN##_##LN##_d##DK(const __grid_constant__ kvr::gdn::StepParams p) {     \
    kvr::gdn::decode_body<SD, VM, DK>(p);                                                       \
  }
#define KVR_GDN_DECODE_DK(DK, MB)                         \
  KVR_GDN_DECODE(float, f32, false, k, DK, MB)            \
  KVR_GDN_DECODE(float, f32, true, v, DK, MB)             \
  KVR_GDN_DECODE(__nv_bfloat16, bf16, false, k, DK, MB)   \
  KVR_GDN_DECODE(__nv_bfloat16, bf16, true, v, DK, MB)
KVR_GDN_DECODE_DK(64, 5)
KVR_GDN_DECODE_DK(128, 5)
KVR_GDN_DECODE_DK(256, 2)
#undef KVR_GDN_DECODE_DK
#undef KVR_GDN_DECODE
