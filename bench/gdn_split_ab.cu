// Prototype A/B of a "state first" replay decode step (issue 14, target 1) against the
// library's two launches (prep kernel, then the state kernel as its programmatic dependent).
//
// The library's state kernel waits for the prep kernel's records before it can combine its
// state rows with the ring, so the state CTAs that sit beside the prep hold their first tiles
// and DRAM idles for most of the prep's ~11 us. Here the order is turned around:
//   K1 (sp_state, grid (tiles, value heads, rows), 4 warps x 8 value rows): the state rows,
//      then (S q_raw)[v] and (S k_raw)[v] from the raw inputs into a scratch; nothing of the
//      step's other work is needed. A flush step (ring full) folds the buffered entries into
//      the rows first (decays from the ring's g, keys through shared memory, u values),
//      stores them, and takes the dots of the folded state: the step then runs on an empty
//      ring, which is what the library's flush step computes.
//   K2 (sp_post, a CTA per (key head, row), group x dv threads, programmatic dependent of K1):
//      before its wait, the key products of the buffered slots, the suffix weights and the
//      buffered u values of its value rows (all from earlier steps); after it, the dots,
//      then y, the new u, key, decay and (last CTA of the row) the metadata.
// Qwen3-Next shape (16 key heads, 32 value heads, dk = dv = 128), f32 state and entries, bf16
// q / k / v / beta, f32 g and output, ring 16, delta rule. Pools rotate (R copies each, 16
// steps each a graph: one flush per pool), so that the ring and metadata come from DRAM as in
// bench_gdn.py. Checked against the library's kernels over 40 steps (outputs every step,
// then states, ring and metadata).
//   cd bench && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I ../kernels \
//     gdn_split_ab.cu -o split && ./split [B ...]
// Measured slower than the library (B = 128: 106 against 89 us): BENCHMARKS.md, GDN H200,
// thirty-fifth session.
#define main kernel_ab_main
#include "gdn_kernel_ab.cu"
#undef main

using namespace kvr;
using namespace kvr::gdn;

namespace sp {
constexpr int DK = 128, LR = 16, KL = DK / 32, RL = 8;

// K1. p.scratch here: the (S q_raw, S k_raw) pairs [b][hv][dv].
template <bool PDL>
__global__ void __launch_bounds__(128, 6) sp_state(const __grid_constant__ StepParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int dv = p.dv;
  const int kh = h / (p.hv / p.hk);
  const int row0 = tile * p.tv + warp * RL, rr = lane & 7;
  const int seq = p.ids_inline[b];
  float* hs = reinterpret_cast<float*>(p.state) + seq * p.seq_stride + static_cast<int64_t>(h) * DK * dv +
              static_cast<int64_t>(row0) * DK;
  float s[RL][KL];
  load_rows<float, DK, RL>(hs, s, lane);
  if (PDL) pdl_wait();  // the previous step's post kernel: metadata, ring
  pdl_launch_dependents();
  const int4 m = __ldcg(reinterpret_cast<const int4*>(p.meta + static_cast<int64_t>(seq) * kMetaInts));
  float q[KL], k[KL];
  load_row<DK>(p.q, b * p.q.s[0] + kh * p.q.s[2], lane, q);
  load_row<DK>(p.k, b * p.k.s[0] + kh * p.k.s[2], lane, k);
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  const bool flush = m.x == kModeReplay && m.z + 1 > LR;
  if (flush) {
    // Every slot is buffered (start m.y): u values of the warp's rows, decays, keys.
    const int start = m.y;
    float u4[4];
    const float* ub = reinterpret_cast<const float*>(p.ring_u) + (static_cast<int64_t>(seq) * LR * p.hv + h) * dv;
    const int64_t ustride = static_cast<int64_t>(p.hv) * dv;
    ld_vec<float, 4>(ub + (lane >> 1) * ustride + row0 + 4 * (lane & 1), u4);
    const float gj = lane < LR ? __ldcg(p.ring_g + (static_cast<int64_t>(seq) * LR + (start + lane) % LR) * p.hv + h) : 0.f;
    __shared__ __align__(16) float fk[LR * DK];
    const float* kb = reinterpret_cast<const float*>(p.ring_k) + (static_cast<int64_t>(seq) * LR * p.hk + kh) * DK;
    const int64_t kstride = static_cast<int64_t>(p.hk) * DK;
    for (int i = threadIdx.x; i < LR * DK / 4; i += blockDim.x) {
      const int sl = i / (DK / 4), o = (i % (DK / 4)) * 4;
      *reinterpret_cast<float4*>(fk + sl * DK + o) = __ldcg(reinterpret_cast<const float4*>(kb + sl * kstride + o));
    }
    const float2 sc = warp_suffix(gj, lane);
    const float wj = lane < LR ? expf(sc.x) : 0.f;
    const float eG = expf(sc.y);
    const int js = (lane - start + LR) % LR;  // lane s < LR: slot s's position in the ring
    const float ws = __shfl_sync(0xffffffffu, wj, js);
    __syncthreads();
    scale_rows<RL, KL>(s, eG);
#pragma unroll 4
    for (int sl = 0; sl < LR; ++sl) {
      float kj[KL];
#pragma unroll
      for (int c = 0; c < KL; c += 4) ld_vec<float, 4>(fk + sl * DK + key(c), &kj[c]);
      const float w = __shfl_sync(0xffffffffu, ws, sl);
#pragma unroll
      for (int r = 0; r < RL; ++r) {
        const float wu = w * __shfl_sync(0xffffffffu, u4[r & 3], 2 * sl + (r >> 2));
#pragma unroll
        for (int c = 0; c < KL; ++c) s[r][c] += wu * kj[c];
      }
    }
    store_rows<float, DK, RL>(hs, s, lane);
  }
  const float2 d = rows8_dots<KL>(s, q, k, lane);
  if (lane < RL)
    reinterpret_cast<float2*>(p.scratch)[(static_cast<int64_t>(b) * p.hv + h) * dv + row0 + rr] = d;
}

// K2. A CTA per (key head, row): group * dv threads (thread: value head kh * group + t / dv,
// value row t % dv).
__global__ void __launch_bounds__(256) sp_post(const __grid_constant__ StepParams p) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kh = blockIdx.x, b = blockIdx.y;
  const int dv = p.dv, group = p.hv / p.hk;
  const int hh = tid / dv, v = tid - hh * dv, h = kh * group + hh;
  const int seq = p.ids_inline[b];
  int32_t* meta = p.meta + static_cast<int64_t>(seq) * kMetaInts;
  const int4 m = __ldcg(reinterpret_cast<const int4*>(meta));
  const int mode = m.x, start = m.y, hcnt = m.z;
  const Place pl = placement(p, mode, start, hcnt);
  const int nbuf = pl.flush ? 0 : hcnt;  // (the state kernel folded the ring)
  auto live = [&](int sl) { return sl - start + (sl < start ? LR : 0) < nbuf; };
  auto key = [&](int c) { return wkey<DK>(lane, c); };
  // q and k normalized (every warp), k . q
  float q[KL], k[KL];
  load_row<DK>(p.q, b * p.q.s[0] + kh * p.q.s[2], lane, q);
  load_row<DK>(p.k, b * p.k.s[0] + kh * p.k.s[2], lane, k);
  const float2 f = normalize_qk<KL>(p, q, k, false);  // (the dots of K1 are of the raw q and k)
  const float fq = f.x, fk = f.y;
  float kq = 0.f;
#pragma unroll
  for (int c = 0; c < KL; ++c) kq += k[c] * q[c];
  kq = warp_sum(kq);
  // key products of the buffered slots: warp w slots w, w + nw, ...
  __shared__ float cq[LR], ck[LR];
  const int nw = blockDim.x >> 5;
  const float* kb = reinterpret_cast<const float*>(p.ring_k) + (static_cast<int64_t>(seq) * LR * p.hk + kh) * DK;
  const int64_t kstride = static_cast<int64_t>(p.hk) * DK;
  for (int sl = warp; sl < LR; sl += nw) {
    float x = 0.f, z = 0.f;
    if (live(sl)) {
      float kj[KL];
#pragma unroll
      for (int c = 0; c < KL; c += 4) ld_vec<float, 4>(kb + sl * kstride + key(c), &kj[c]);
#pragma unroll
      for (int c = 0; c < KL; ++c) {
        x += kj[c] * q[c];
        z += kj[c] * k[c];
      }
      x = warp_sum(x);
      z = warp_sum(z);
    }
    if (lane == 0) {
      cq[sl] = x;
      ck[sl] = z;
    }
  }
  // suffix weights of this warp's value head (lane j: entry j), then by slot (lane s)
  const float gj = lane < nbuf ? __ldcg(p.ring_g + (static_cast<int64_t>(seq) * LR + (start + lane) % LR) * p.hv + h) : 0.f;
  const float2 sc = warp_suffix(gj, lane);
  const float wj = lane < nbuf ? expf(sc.x) : 0.f;
  const float eG = expf(sc.y);
  const float ws = __shfl_sync(0xffffffffu, wj, (lane - start + 32 * LR) % LR);
  // the buffered u values of this thread's row
  const float* ub = reinterpret_cast<const float*>(p.ring_u) + (static_cast<int64_t>(seq) * LR * p.hv + h) * dv + v;
  const int64_t ustride = static_cast<int64_t>(p.hv) * dv;
  float us[LR];
#pragma unroll
  for (int sl = 0; sl < LR; ++sl) us[sl] = live(sl) ? __ldcg(ub + sl * ustride) : 0.f;
  const float2 gb = token_gb(p, b, 0, h);
  const float vt = ldx(p.v.p, p.v.dtype, b * p.v.s[0] + h * p.v.s[2] + v * p.v.s[3]);
  __syncthreads();  // cq, ck
  float hq = 0.f, hk = 0.f;
#pragma unroll
  for (int sl = 0; sl < LR; ++sl) {
    const float w = __shfl_sync(0xffffffffu, ws, sl);
    hq += w * cq[sl] * us[sl];
    hk += w * ck[sl] * us[sl];
  }
  pdl_wait();  // K1: the dots, the folded state, the ring read
  const float2 d = __ldcg(reinterpret_cast<const float2*>(p.scratch) + (static_cast<int64_t>(b) * p.hv + h) * dv + v);
  pdl_launch_dependents();
  const float sq = d.x * fq, sk = d.y * fk;
  const float a = expf(gb.x), bt = gb.y;
  const float u = bt * (vt - a * (eG * sk + hk));
  const float y = a * (eG * sq + hq) + kq * u;
  stx(p.out.p, p.out.dtype, b * p.out.s[0] + h * p.out.s[2] + v * p.out.s[3], y);
  reinterpret_cast<float*>(p.ring_u)[((static_cast<int64_t>(seq) * LR + pl.base) * p.hv + h) * dv + v] = u;
  if (warp == 0) {
    float* kd = reinterpret_cast<float*>(p.ring_k) + ((static_cast<int64_t>(seq) * LR + pl.base) * p.hk + kh) * DK;
#pragma unroll
    for (int c = 0; c < KL; c += 4) st_vec<float, 4>(kd + key(c), &k[c]);
  }
  if (v == 0) p.ring_g[(static_cast<int64_t>(seq) * LR + pl.base) * p.hv + h] = gb.x;
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(meta + kMetaArrive, 1) == p.hk - 1) {
      meta[kMetaArrive] = 0;
      finish_meta(p, meta, mode, start, hcnt, m.w, __ldcg(meta + kMetaConvEnd), pl);
    }
  }
}
}  // namespace sp

int main(int argc, char** argv) {
  const int L = 16, R = 4, NSETS = 8;
  std::vector<int> Bs;
  for (int i = 1; i < argc; ++i) Bs.push_back(atoi(argv[i]));
  if (Bs.empty()) Bs = {32, 64, 128, 256};
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const double ceil_tbs = 4.25;
  printf("B | library us | split us | split (K1 plain launch) us | floor us | library %% | split %% | max rel err out / state / ring u\n");
  for (int B : Bs) {
    // pools: [0] reference (library), [1] split for the check; then R library, R split
    std::vector<Pool> P(2 + 2 * R);
    for (auto& pl : P) alloc_pool(pl, B, L);
    init_pools(P, B);
    float* sqk;
    CK(cudaMalloc(&sqk, (size_t)B * HV * DV * 8 * (1 + 2 * R)));
    Inputs in = alloc_inputs(B, NSETS);
    float* out[2];
    CK(cudaMalloc(&out[0], (size_t)B * HV * DV * 4));
    CK(cudaMalloc(&out[1], (size_t)B * HV * DV * 4));
    auto params = [&](int which, int set, float* o) {
      StepParams p = step_params(P[which], in, B, L, set, o);
      p.tv = 32;
      p.tiles = DV / 32;
      return p;
    };
    auto launch_pdl = [&](auto kernel, dim3 grid, int threads, int smem, const StepParams& p) {
      ::launch_pdl(kernel, grid, threads, smem, st, p);
    };
    const int prep_threads = 32 * std::min(std::max((HV / HK + 1) / 2, 2), KVR_GDN_DPREP_THREADS / 32);
    auto lib = [&](int which, int set, float* o) {
      StepParams p = params(which, set, o);
      p.stages = B < 128 ? HK : 1;
      if (B < 128)
        ab_dprep_spec_r16<<<B * HK, prep_threads, PREP_SMEM(1), st>>>(p);
      else
        ab_dprep_spec_r16<<<B, KVR_GDN_DPREP_THREADS, PREP_SMEM(HK), st>>>(p);
      launch_pdl(ab_wdecode_spec6_r16, dim3(DV / 32, HV, B), 128, 0, p);
    };
    auto split = [&](int which, int sq_i, int set, float* o, bool k1_pdl) {
      StepParams p = params(which, set, o);
      p.scratch = sqk + (size_t)sq_i * B * HV * DV * 2;
      if (k1_pdl)
        launch_pdl(sp::sp_state<true>, dim3(DV / 32, HV, B), 128, 0, p);
      else
        sp::sp_state<false><<<dim3(DV / 32, HV, B), 128, 0, st>>>(p);
      launch_pdl(sp::sp_post, dim3(HK, B), (HV / HK) * DV, 0, p);
    };
    // check: 40 steps
    std::vector<float> o0((size_t)B * HV * DV), o1(o0.size());
    double e_out = 0;
    for (int step = 0; step < 40; ++step) {
      lib(0, step % NSETS, out[0]);
      split(1, 0, step % NSETS, out[1], true);
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaMemcpy(o0.data(), out[0], o0.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(o1.data(), out[1], o1.size() * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < o0.size(); ++i)
        e_out = std::max(e_out, (double)fabsf(o0[i] - o1[i]) / std::max(1e-3f, fabsf(o0[i])));
    }
    auto maxrel = [&](const float* a, const float* bb, size_t n) {
      std::vector<float> x(n), y(n);
      CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(y.data(), bb, n * 4, cudaMemcpyDeviceToHost));
      double e = 0;
      for (size_t i = 0; i < n; ++i) e = std::max(e, (double)fabsf(x[i] - y[i]) / std::max(1e-3f, fabsf(x[i])));
      return e;
    };
    const double e_state = maxrel(P[0].state, P[1].state, P[0].n_state);
    const double e_ru = maxrel(P[0].ru, P[1].ru, P[0].n_ru);
    const double e_rk = maxrel(P[0].rk, P[1].rk, P[0].n_rk);
    std::vector<int> m0((size_t)B * 8), m1(m0.size());
    CK(cudaMemcpy(m0.data(), P[0].meta, m0.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(m1.data(), P[1].meta, m1.size() * 4, cudaMemcpyDeviceToHost));
    bool meta_ok = true;
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < 6; ++i) meta_ok &= m0[b * 8 + i] == m1[b * 8 + i];
    // timing: graphs of 16 R steps over R pools (one flush each)
    auto time = [&](auto step) {
      return graph_us(st, 16 * R, 10, [&](int i) { step(i % R, i % NSETS, out[0]); });
    };
    double tl = 1e30, ts = 1e30, tsp = 1e30;
    for (int pass = 0; pass < 2; ++pass) {
      tl = std::min(tl, time([&](int r, int set, float* o) { lib(2 + r, set, o); }));
      ts = std::min(ts, time([&](int r, int set, float* o) { split(2 + R + r, 1 + r, set, o, true); }));
      tsp = std::min(tsp, time([&](int r, int set, float* o) { split(2 + R + r, 1 + r, set, o, false); }));
    }
    // each kernel alone (K1 alone: the metadata never changes, so no flush; K2 alone: plain
    // steps on the rotated pools' dots scratch as K1 left it)
    double t1 = 1e30, t2 = 1e30, tp = 1e30, tw = 1e30;
    for (int pass = 0; pass < 2; ++pass) {
      t1 = std::min(t1, time([&](int r, int set, float* o) {
        StepParams p = params(2 + R + r, set, o);
        p.scratch = sqk + (size_t)(1 + r) * B * HV * DV * 2;
        launch_pdl(sp::sp_state<true>, dim3(DV / 32, HV, B), 128, 0, p);
      }));
      t2 = std::min(t2, time([&](int r, int set, float* o) {
        StepParams p = params(2 + R + r, set, o);
        p.scratch = sqk + (size_t)(1 + r) * B * HV * DV * 2;
        launch_pdl(sp::sp_post, dim3(HK, B), (HV / HK) * DV, 0, p);
      }));
      tp = std::min(tp, time([&](int r, int set, float* o) {
        StepParams p = params(2 + r, set, o);
        p.stages = B < 128 ? HK : 1;
        if (B < 128)
          ab_dprep_spec_r16<<<B * HK, prep_threads, PREP_SMEM(1), st>>>(p);
        else
          ab_dprep_spec_r16<<<B, KVR_GDN_DPREP_THREADS, PREP_SMEM(HK), st>>>(p);
      }));
      tw = std::min(tw, time([&](int r, int set, float* o) {
        StepParams p = params(2 + r, set, o);
        p.stages = B < 128 ? HK : 1;
        launch_pdl(ab_wdecode_spec6_r16, dim3(DV / 32, HV, B), 128, 0, p);
      }));
    }
    printf("    alone: K1 %.2f  K2 %.2f  | library prep %.2f  state kernel %.2f\n", t1, t2, tp, tw);
    const double entry = (HV * D + HK * D) * 4.0 + HV * 4.0, state = (double)HV * D * DV * 4;
    const double floor_us = B * (state * (1 + 1.0 / L) + entry * ((L + 1) / 2.0 + 1)) / (ceil_tbs * 1e6);
    printf("%3d | %7.2f | %7.2f | %7.2f | %7.2f | %5.1f | %5.1f | %.2e / %.2e / %.2e / k %.2e%s\n", B, tl, ts, tsp,
           floor_us, 100 * floor_us / tl, 100 * floor_us / ts, e_out, e_state, e_ru, e_rk, meta_ok ? "" : "  META MISMATCH");
    for (auto& pl : P) free_pool(pl);
    free_inputs(in);
    cudaFree(sqk); cudaFree(out[0]); cudaFree(out[1]);
  }
  return 0;
}
