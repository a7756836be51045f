// Kernel-level A/B of the stateless recurrent GDN step (kernels/gdn_recur.cu, what llama.cpp's
// GGML_OP_GATED_DELTA_NET runs through kvr_context_gdn_recurrent) against a restatement of
// llama.cpp's built-in kernel (ggml-cuda/gated_delta_net.cu at 0c1e570: one warp per value
// row, 4 warps per CTA, grid (value heads, sequences, rows / 4), lanes holding keys strided by
// 32, two warp reductions per token), timed the way `test-backend-ops perf` times the op: one
// CUDA graph of N launches of the same op on the same (L2-resident) buffers, each launched
// with programmatic dependent launch. Qwen3-Next shape: 16 key heads, 32 value heads, d 128,
// one token, f32 everywhere. Variants are timed interleaved, medians over rounds.
//   cd bench && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I ../kernels \
//     gdn_recur_ab.cu -o rab && ./rab [rounds]
#include "../kernels/gdn_recur.cu"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e));           \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

constexpr int HK = 16, HV = 32, D = 128;

// The built-in kernel, restated (non-KDA, no snapshots, S_v = 128, T = 1).
__global__ void __launch_bounds__(128, 2)
    builtin_gdn(const float* q, const float* k, const float* v, const float* g, const float* beta,
                const float* curr_state, float* dst, float* state, int H, int HKq, float scale) {
  const int h = blockIdx.x, seq = blockIdx.y, lane = threadIdx.x;
  const int col = blockIdx.z * blockDim.y + threadIdx.y;
  const int kh = h % HKq;
  const float* s_in = curr_state + ((int64_t)seq * H + h) * D * D + col * D;
  float* s_out = state + ((int64_t)seq * H + h) * D * D + col * D;
  constexpr int RPL = D / 32;
  float s[RPL];
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#pragma unroll
  for (int r = 0; r < RPL; ++r) s[r] = s_in[r * 32 + lane];
  const float* qt = q + ((int64_t)seq * HKq + kh) * D;
  const float* kt = k + ((int64_t)seq * HKq + kh) * D;
  float kr[RPL], qr[RPL];
#pragma unroll
  for (int r = 0; r < RPL; ++r) {
    kr[r] = kt[r * 32 + lane];
    qr[r] = qt[r * 32 + lane];
  }
  const float bv = beta[seq * H + h];
  const float gv = expf(g[seq * H + h]);
  float kv = 0.f;
#pragma unroll
  for (int r = 0; r < RPL; ++r) kv += s[r] * kr[r];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
  const float dc = (v[((int64_t)seq * H + h) * D + col] - gv * kv) * bv;
  float at = 0.f;
#pragma unroll
  for (int r = 0; r < RPL; ++r) {
    s[r] = gv * s[r] + kr[r] * dc;
    at += s[r] * qr[r];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) at += __shfl_xor_sync(0xffffffffu, at, o);
  if (lane == 0) dst[((int64_t)seq * H + h) * D + col] = at * scale;
#pragma unroll
  for (int r = 0; r < RPL; ++r) s_out[r * 32 + lane] = s[r];
}

static float frand(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return ((s >> 40) & 0xffffff) / 16777216.f - 0.5f;
}

static kvr_gdn_tensor tens(void* p, int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
  kvr_gdn_tensor t;
  memset(&t, 0, sizeof t);
  t.p = p;
  t.s[0] = s0;
  t.s[1] = s1;
  t.s[2] = s2;
  t.s[3] = s3;
  t.dtype = KVR_DT_F32;
  return t;
}

struct Bufs {
  float *q, *k, *v, *g, *beta, *s_in, *s_out, *y;
};

typedef void (*Launch)(const Bufs&, int B, cudaStream_t, bool pdl);

static void launch_ex(const void* fn, dim3 grid, dim3 block, void** args, cudaStream_t st, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelExC(&cfg, fn, args));
}

static void run_builtin(const Bufs& b, int B, cudaStream_t st, bool pdl) {
  float scale = 1.f / sqrtf((float)D);
  int H = HV, hk = HK;
  void* args[] = {(void*)&b.q, (void*)&b.k, (void*)&b.v, (void*)&b.g, (void*)&b.beta,
                  (void*)&b.s_in, (void*)&b.y, (void*)&b.s_out, &H, &hk, &scale};
  launch_ex((const void*)builtin_gdn, dim3(HV, B, D / 4), dim3(32, 4), args, st, pdl);
}

static kvr_gdn_recur_args recur_args(const Bufs& b, int B, int R) {
  kvr_gdn_recur_args a;
  memset(&a, 0, sizeof a);
  // llama.cpp's layouts: q, k [B][T][Hk][D]; v, y [B][T][Hv][D]; g, beta [B][T][Hv].
  a.q = tens(b.q, HK * D, HK * D, D, 1);
  a.k = tens(b.k, HK * D, HK * D, D, 1);
  a.v = tens(b.v, HV * D, HV * D, D, 1);
  a.g = tens(b.g, HV, HV, 1, 0);
  a.beta = tens(b.beta, HV, HV, 1, 0);
  a.out = tens(b.y, HV * D, HV * D, D, 1);
  a.state_in = b.s_in;
  a.state_out = b.s_out;
  a.si[0] = a.so[0] = (int64_t)HV * D * D;
  a.si[1] = a.so[1] = D * D;
  a.si[2] = a.so[2] = D;
  a.item0 = 0;
  a.item_end = (int64_t)B * HV;
  a.t = 1;
  a.hq = HK;
  a.hv = HV;
  a.dv = D;
  a.groups = D / R;
  a.kh_div = HV / HK;
  a.tiled = 1;
  a.scale = 1.f / sqrtf((float)D);
  return a;
}

template <int R>
static void run_kvr(const Bufs& b, int B, cudaStream_t st, bool pdl) {
  kvr_gdn_recur_args a = recur_args(b, B, R);
  void* args[] = {&a};
  const void* fn = R == 1 ? (const void*)kvr_gdn_recur_d128_r1
                          : R == 2 ? (const void*)kvr_gdn_recur_d128_r2 : (const void*)kvr_gdn_recur_d128_r4;
  const int per = KVR_GDN_RECUR_THREADS / 32;
  launch_ex(fn, dim3((D / R + per - 1) / per, HV, B), dim3(KVR_GDN_RECUR_THREADS), args, st, pdl);
}

// kvr_gdn_recur1[n]: NORM 1 normalizes q and k in the kernel (unit vectors here: same result).
template <int R, int NORM>
static void run_kvr1(const Bufs& b, int B, cudaStream_t st, bool pdl) {
  kvr_gdn_recur1_args a;
  memset(&a, 0, sizeof a);
  a.q = b.q; a.k = b.k; a.v = b.v; a.g = b.g; a.beta = b.beta; a.state_in = b.s_in; a.out = b.y; a.state_out = b.s_out;
  a.si[0] = a.so[0] = (int64_t)HV * D * D;
  a.si[1] = a.so[1] = D * D;
  a.si[2] = a.so[2] = D;
  a.qs[0] = a.ks[0] = HK * D; a.qs[1] = a.ks[1] = D;
  a.vs[0] = a.ys[0] = HV * D; a.vs[1] = a.ys[1] = D; a.vs[2] = a.ys[2] = 1;
  a.gs[0] = a.bs[0] = HV; a.gs[1] = a.bs[1] = 1;
  a.hq = HK; a.kh_div = HV / HK; a.tiled = 1; a.l2norm = NORM; a.l2norm_eps = 1e-6f;
  a.scale = 1.f / sqrtf((float)D);
  void* args[] = {&a};
  const void* fns[2][3] = {
      {(const void*)kvr_gdn_recur1_d128_r1, (const void*)kvr_gdn_recur1_d128_r2, (const void*)kvr_gdn_recur1_d128_r4},
      {(const void*)kvr_gdn_recur1n_d128_r1, (const void*)kvr_gdn_recur1n_d128_r2,
       (const void*)kvr_gdn_recur1n_d128_r4}};
  const void* fn = fns[NORM][R == 1 ? 0 : R == 2 ? 1 : 2];
  launch_ex(fn, dim3(D / R / 4, HV, B), dim3(KVR_GDN_RECUR_THREADS), args, st, pdl);
}


struct Variant {
  std::string name;
  Launch fn;
};

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 7;
  const int N = 200;  // launches per graph
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::vector<Variant> vs = {
      {"builtin", run_builtin},
      {"general r1", run_kvr<1>}, {"general r2", run_kvr<2>}, {"general r4", run_kvr<4>},
      {"recur1 r1", run_kvr1<1, 0>}, {"recur1 r2", run_kvr1<2, 0>}, {"recur1 r4", run_kvr1<4, 0>},
      {"recur1n r1", run_kvr1<1, 1>}, {"recur1n r2", run_kvr1<2, 1>}, {"recur1n r4", run_kvr1<4, 1>},
  };

  for (int B : {1, 2, 4, 8, 32, 128, 256}) {
    Bufs b;
    const size_t nq = (size_t)B * HK * D, nv = (size_t)B * HV * D, ns = (size_t)B * HV * D * D;
    CK(cudaMalloc(&b.q, nq * 4));
    CK(cudaMalloc(&b.k, nq * 4));
    CK(cudaMalloc(&b.v, nv * 4));
    CK(cudaMalloc(&b.y, nv * 4));
    CK(cudaMalloc(&b.g, B * HV * 4));
    CK(cudaMalloc(&b.beta, B * HV * 4));
    CK(cudaMalloc(&b.s_in, ns * 4));
    CK(cudaMalloc(&b.s_out, ns * 4));
    {
      uint64_t seed = 42 + B;
      std::vector<float> h(ns);
      for (auto& x : h) x = frand(seed) * 0.1f;
      CK(cudaMemcpy(b.s_in, h.data(), ns * 4, cudaMemcpyHostToDevice));
      std::vector<float> hq(nq);
      for (int which = 0; which < 2; ++which) {
        for (size_t i = 0; i < nq; i += D) {  // unit-norm q and k, as after ggml_l2_norm
          double n2 = 0;
          for (int c = 0; c < D; ++c) n2 += (hq[i + c] = frand(seed)) * hq[i + c];
          for (int c = 0; c < D; ++c) hq[i + c] /= sqrt(n2);
        }
        CK(cudaMemcpy(which ? b.k : b.q, hq.data(), nq * 4, cudaMemcpyHostToDevice));
      }
      std::vector<float> hv(nv);
      for (auto& x : hv) x = frand(seed);
      CK(cudaMemcpy(b.v, hv.data(), nv * 4, cudaMemcpyHostToDevice));
      std::vector<float> hg(B * HV), hb(B * HV);
      for (int i = 0; i < B * HV; ++i) {
        hg[i] = -0.5f * (frand(seed) + 0.5f);
        hb[i] = frand(seed) + 0.5f;
      }
      CK(cudaMemcpy(b.g, hg.data(), hg.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(b.beta, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
    }
    // Correctness: every variant against the built-in restatement.
    std::vector<float> ry(nv), rs(ns), y(nv), s(ns);
    run_builtin(b, B, st, false);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(ry.data(), b.y, nv * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(rs.data(), b.s_out, ns * 4, cudaMemcpyDeviceToHost));
    for (size_t vi = 1; vi < vs.size(); ++vi) {
      CK(cudaMemset(b.y, 0, nv * 4));
      CK(cudaMemset(b.s_out, 0, ns * 4));
      vs[vi].fn(b, B, st, false);
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(y.data(), b.y, nv * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(s.data(), b.s_out, ns * 4, cudaMemcpyDeviceToHost));
      double ey = 0, es = 0;
      for (size_t i = 0; i < nv; ++i) ey = std::max(ey, fabs(y[i] - ry[i]) / (fabs(ry[i]) + 1e-3));
      for (size_t i = 0; i < ns; ++i) es = std::max(es, fabs(s[i] - rs[i]) / (fabs(rs[i]) + 1e-3));
      if (ey > 1e-3 || es > 1e-3) {
        printf("B=%d %s: MISMATCH y %.2e state %.2e\n", B, vs[vi].name.c_str(), ey, es);
        return 1;
      }
    }
    // Timing: one graph of N PDL launches per variant, interleaved rounds.
    std::vector<cudaGraphExec_t> ex(vs.size());
    for (size_t vi = 0; vi < vs.size(); ++vi) {
      cudaGraph_t gr;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < N; ++i) vs[vi].fn(b, B, st, true);
      CK(cudaStreamEndCapture(st, &gr));
      CK(cudaGraphInstantiate(&ex[vi], gr, 0));
      CK(cudaGraphDestroy(gr));
      for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ex[vi], st));
    }
    CK(cudaStreamSynchronize(st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<std::vector<float>> t(vs.size());
    for (int r = 0; r < rounds; ++r)
      for (size_t vi = 0; vi < vs.size(); ++vi) {
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ex[vi], st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t[vi].push_back(ms * 1000.f / (5 * N));
      }
    float base = 0;
    for (size_t vi = 0; vi < vs.size(); ++vi) {
      std::sort(t[vi].begin(), t[vi].end());
      const float med = t[vi][t[vi].size() / 2];
      if (vi == 0) base = med;
      printf("B=%-4d %-16s %8.3f us (%.3f-%.3f)  builtin/this %.3f\n", B, vs[vi].name.c_str(), med,
             t[vi].front(), t[vi].back(), base / med);
    }
    for (auto& gx : ex) CK(cudaGraphExecDestroy(gx));
    for (float* p : {b.q, b.k, b.v, b.y, b.g, b.beta, b.s_in, b.s_out}) CK(cudaFree(p));
  }
  return 0;
}
