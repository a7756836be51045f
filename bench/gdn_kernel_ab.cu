// Kernel-level A/B of the GDN decode kernels without the Rust library: the warp-streaming
// decode (kernels/gdn_wdecode.cu, prep + state kernel under PDL) against the streaming kernel
// (kernels/gdn_stream.cu; for Mamba-2, whose rule it lacks, the one-launch kernel) on the same
// pool contents (f32 state V-major, f32 ring): outputs, states, ring and metadata compared
// after 40 steps; then µs per step under graph replay (16-step cycles, so one flush per
// sequence), the prep and state kernels alone, and the state kernel in recurrent mode; every
// step of two flush cycles timed on its own (eager, events between steps: the flush step
// stands out), then again with an event between the prep and the state kernel (prep | state,
// no overlap); the one-launch form (kvr_gdn_fdecode, small batches, and its specialized form)
// on a third and fourth copy of the pool, checked the same way; at ring 16, state kernels
// built from the library's body with other register bounds (full7, full8), also with the fold
// compiled out (kWPlain: plain steps only), timed alone, and with KVR_AB_MAIN=full7|full8 one
// of them in the "wdecode" column; KVR_AB_MAIN=spec6|spec7 the state kernel specialized for
// this program's dtypes (as the library's kvr_gdn_wdecode_*_xbf16 / _m2bf16, with an f32
// output) at 6 or 7 CTAs an SM, KVR_AB_PREP=spec the prep specialized the same way. The device has nvcc, so a kernel edit is measured in one
// call (about a minute) without a GPU bundle:
//   cd bench && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I ../kernels \
//     gdn_kernel_ab.cu -o ab && ./ab 16 [B] [m2]   # ring length, optional single batch size,
//                                                  # m2: Nemotron-H's Mamba-2 layer instead
#include "../kernels/gdn_stream.cu"
#include "../kernels/gdn_wdecode.cu"
#include <cstdio>
#define PREP prep_kernel(L)
#define MAIN main_kernel(L)
#define MAIN_SMEM 0
#define PREP_SMEM(NKH) (((2 * (L > 0 ? L : 1) + D + 1) * (NKH) + (NKH) * (HV / HK) * ((L > 0 ? L : 1) + DV + 2)) * 4 + 16)
#define FUSED (L > 16 ? kvr_gdn_fdecode_f32_v_d128_r32 : kvr_gdn_fdecode_f32_v_d128_r16)
#define MAIN_GRID(B) dim3(DV / 32, HV, B)  // the state kernels' grid (tiles, value heads, rows)
#define SPEC (M2 ? (L > 16 ? ab_fdecode_m2spec_r32 : ab_fdecode_m2spec_r16) : (L > 16 ? ab_fdecode_spec_r32 : ab_fdecode_spec_r16))
#include <algorithm>
#include <vector>
#include <cmath>
#include <cstdlib>
#include <cstring>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

// The layer: Qwen3-Next's GDN layer (16 key heads, 32 value heads, dk = dv = 128), or with
// "m2" as the third argument Nemotron-H's Mamba-2 layer (8 groups as key heads, 128 heads of
// dv = P = 64, dk = N = 128; the additive rule, dt softplus with dt_bias, A, D skip and z gate,
// bf16 x / B / C / z, f32 dt / A / dt_bias / D, as bench/bench_mamba2.py).
constexpr int D = 128;
static int HK = 16, HV = 32, DV = 128;
static bool M2 = false;
static bool M2_flag() { return M2; }
using kvr::gdn::StepParams;

// The one-launch kernel specialized as the library's kvr_gdn_fdecode_*_xbf16, with this
// program's f32 output.
struct AbFix {
  static __device__ __forceinline__ void apply(StepParams& c, int ring) {
    kvr::gdn::FdFix<KVR_DT_BF16, KVR_DT_F32>::apply(c, ring);
    c.out.dtype = KVR_DT_F32;
  }
};
// Mamba-2 as the library's kvr_gdn_fdecode_*_m2bf16, with this program's f32 output.
struct AbFixM2 {
  static __device__ __forceinline__ void apply(StepParams& c, int ring) {
    kvr::gdn::FdFixM2<KVR_DT_BF16>::apply(c, ring);
    c.out.dtype = KVR_DT_F32;
  }
};
#define AB_SPEC(LU, FIX, NAME)                                                                        \
  extern "C" __global__ void __launch_bounds__(128, KVR_FDECODE_MINB)                               \
      ab_fdecode_##NAME##_r##LU(const __grid_constant__ kvr_gdn_fdecode_args p) {                    \
    StepParams c = {};                                                                               \
    kvr::gdn::from_fdecode_args(c, p);                                                               \
    FIX::apply(c, LU);                                                                               \
    kvr::gdn::wdecode_body<float, 128, LU / 16, kvr::gdn::kWFused>(c, p.ids_inline);                 \
  }
AB_SPEC(16, AbFix, spec)
AB_SPEC(32, AbFix, spec)
AB_SPEC(16, AbFixM2, m2spec)
AB_SPEC(32, AbFixM2, m2spec)

// The specialized one-launch kernels' parameters (kvr_gdn_fdecode_args, as the library's
// fdecode_args in src/linear/replay/cuda.rs).
static kvr_gdn_fdecode_args fdecode_args_of(const StepParams& p) {
  kvr_gdn_fdecode_args c;
  memset(&c, 0, sizeof c);
  c.state = p.state; c.ring_u = p.ring_u; c.ring_k = p.ring_k; c.ring_g = p.ring_g; c.meta = p.meta;
  c.ids = p.ids;
  c.q = p.q.p; c.k = p.k.p; c.v = p.v.p; c.g = p.g.p; c.beta = p.beta.p; c.out = p.out.p;
  c.seq_stride = p.seq_stride;
  c.q_s0 = p.q.s[0]; c.q_s2 = p.q.s[2]; c.k_s0 = p.k.s[0]; c.k_s1 = p.k.s[1]; c.k_s2 = p.k.s[2];
  c.v_s0 = p.v.s[0]; c.v_s2 = p.v.s[2]; c.g_s0 = p.g.s[0]; c.g_s1 = p.g.s[1]; c.g_s2 = p.g.s[2];
  c.beta_s0 = p.beta.s[0]; c.beta_s1 = p.beta.s[1]; c.beta_s2 = p.beta.s[2];
  c.out_s0 = p.out.s[0]; c.out_s2 = p.out.s[2]; c.out_s3 = p.out.s[3];
  c.skip = p.skip.p; c.gate = p.gate.p; c.a = p.a.p; c.dt_bias = p.dt_bias.p;
  c.skip_s0 = p.skip.s[0]; c.gate_s0 = p.gate.s[0]; c.gate_s2 = p.gate.s[2]; c.gate_s3 = p.gate.s[3];
  c.a_s0 = p.a.s[0]; c.dt_bias_s0 = p.dt_bias.s[0];
  c.op = p.op; c.t = p.t; c.hk = p.hk; c.hv = p.hv; c.dk = p.dk; c.dv = p.dv; c.tv = p.tv;
  c.tiles = p.tiles; c.auto_commit = p.auto_commit; c.l2norm = p.l2norm; c.scale = p.scale;
  c.dt_min = p.dt_min; c.dt_max = p.dt_max;
  memcpy(c.ids_inline, p.ids_inline, sizeof c.ids_inline);
  return c;
}

// The library's state kernel body under other register bounds (resident CTAs an SM), and with
// the fold compiled out (kWPlain: wrong at a flush step, timed on plain steps alone).
#define AB_PLAIN(LU, KIND, MB, NAME)                                                                 \
  extern "C" __global__ void __launch_bounds__(128, MB) ab_wdecode_##NAME##_r##LU(const __grid_constant__ StepParams p) { \
    kvr::gdn::wdecode_body<float, 128, LU / 16, KIND>(p, p.ids_inline);                             \
  }
AB_PLAIN(16, kvr::gdn::kWPlain, 6, plain6)
AB_PLAIN(16, kvr::gdn::kWPlain, 8, plain8)
AB_PLAIN(16, kvr::gdn::kWPrep, 8, full8)
AB_PLAIN(16, kvr::gdn::kWPlain, 7, plain7)
AB_PLAIN(16, kvr::gdn::kWPrep, 7, full7)

// The two-launch step specialized as the one-launch builds (FIX applied to a copy of the
// parameters): the state kernel at 6 or 7 resident CTAs an SM, and the prep.
#define AB_WSPEC(FIX, NAME, MB)                                                                      \
  extern "C" __global__ void __launch_bounds__(128, MB) ab_wdecode_##NAME##_r16(const __grid_constant__ StepParams p) { \
    StepParams c = p;                                                                                \
    FIX::apply(c, 16);                                                                               \
    kvr::gdn::wdecode_body<float, 128, 1, kvr::gdn::kWPrep>(c, p.ids_inline);                        \
  }
#define AB_DSPEC(FIX, NAME)                                                                          \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_DPREP_THREADS, 2) ab_dprep_##NAME##_r16(const __grid_constant__ StepParams p) { \
    StepParams c = p;                                                                                \
    FIX::apply(c, 16);                                                                               \
    kvr::gdn::dprep_body<128, 16>(c, p.ids_inline);                                                  \
  }
AB_WSPEC(AbFix, spec6, 6)
AB_WSPEC(AbFix, spec7, 7)
AB_WSPEC(AbFixM2, m2spec6, 6)
AB_WSPEC(AbFixM2, m2spec7, 7)
AB_DSPEC(AbFix, spec)
AB_DSPEC(AbFixM2, m2spec)
// KVR_AB_PREP=spec: the specialized prep (ring 16).
static void (*prep_kernel(int L))(StepParams) {
  const char* e = getenv("KVR_AB_PREP");
  if (e && L == 16 && !strcmp(e, "spec")) return M2_flag() ? ab_dprep_m2spec_r16 : ab_dprep_spec_r16;
  return L > 16 ? kvr_gdn_dprep_d128_r32 : kvr_gdn_dprep_d128_r16;
}

// The state kernel of the "wdecode" column: the library's, or with KVR_AB_MAIN=<name> (ring 16)
// one of the variants above (full7: the library's body at 7 resident CTAs an SM).
static void (*main_kernel(int L))(StepParams) {
  const char* e = getenv("KVR_AB_MAIN");
  if (e && L == 16) {
    if (!strcmp(e, "full7")) return ab_wdecode_full7_r16;
    if (!strcmp(e, "full8")) return ab_wdecode_full8_r16;
    if (!strcmp(e, "spec6")) return M2_flag() ? ab_wdecode_m2spec6_r16 : ab_wdecode_spec6_r16;
    if (!strcmp(e, "spec7")) return M2_flag() ? ab_wdecode_m2spec7_r16 : ab_wdecode_spec7_r16;
  }
  return L > 16 ? kvr_gdn_wdecode_f32_v_d128_r32 : kvr_gdn_wdecode_f32_v_d128_r16;
}

struct Pool {
  float *state, *ru, *rk, *rg, *scr;
  int* meta;
  size_t n_state, n_ru, n_rk, n_rg;
};

static float frand(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return ((s >> 40) & 0xffffff) / 16777216.f;
}

static kvr_gdn_tensor tens(void* p, int dt, int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
  kvr_gdn_tensor t;
  memset(&t, 0, sizeof t);
  t.p = p;
  t.s[0] = s0; t.s[1] = s1; t.s[2] = s2; t.s[3] = s3;
  t.dtype = dt;
  return t;
}

// A pool's buffers (f32 V-major state, f32 ring) for B rows and ring L; the scratch zeroed.
static void alloc_pool(Pool& pl, int B, int L) {
  pl.n_state = (size_t)B * HV * D * DV;
  pl.n_ru = (size_t)B * L * HV * DV;
  pl.n_rk = (size_t)B * L * HK * D;
  pl.n_rg = (size_t)B * L * HV;
  CK(cudaMalloc(&pl.state, pl.n_state * 4));
  CK(cudaMalloc(&pl.ru, pl.n_ru * 4));
  CK(cudaMalloc(&pl.rk, pl.n_rk * 4));
  CK(cudaMalloc(&pl.rg, pl.n_rg * 4));
  CK(cudaMalloc(&pl.meta, (size_t)B * 8 * 4));
  const kvr_gdn_dscratch lay = kvr_gdn_dscratch_layout(B, HV, HK, D, DV, L);
  CK(cudaMalloc(&pl.scr, (size_t)lay.total * 4));
  CK(cudaMemset(pl.scr, 0, (size_t)lay.total * 4));
}

static void free_pool(Pool& pl) {
  cudaFree(pl.state); cudaFree(pl.ru); cudaFree(pl.rk); cudaFree(pl.rg); cudaFree(pl.meta); cudaFree(pl.scr);
}

// The same contents in every pool: a random state, an empty ring, every row in replay mode.
static void init_pools(std::vector<Pool>& P, int B) {
  uint64_t s = 1;
  std::vector<float> h(P[0].n_state);
  for (auto& x : h) x = (frand(s) - 0.5f) * 0.2f;
  std::vector<int> m((size_t)B * 8, 0);
  for (int b = 0; b < B; ++b) m[b * 8] = KVR_GDN_REPLAY;
  for (auto& pl : P) {
    CK(cudaMemcpy(pl.state, h.data(), pl.n_state * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(pl.ru, 0, pl.n_ru * 4));
    CK(cudaMemset(pl.rk, 0, pl.n_rk * 4));
    CK(cudaMemset(pl.rg, 0, pl.n_rg * 4));
    CK(cudaMemcpy(pl.meta, m.data(), m.size() * 4, cudaMemcpyHostToDevice));
  }
}

// `nsets` input sets of B rows: q, k [B][HK][D] bf16, v [B][HV][DV] bf16, g [B][HV] f32, beta
// [B][HV] bf16 (Mamba-2: beta is dt, f32; z [B][HV][DV] bf16; hw: A, dt_bias, D [3][HV] f32).
struct Inputs {
  __nv_bfloat16 *q, *k, *v, *beta, *z = nullptr;
  float *g, *hw = nullptr;
};

static Inputs alloc_inputs(int B, int nsets) {
  Inputs in;
  CK(cudaMalloc(&in.q, (size_t)nsets * B * HK * D * 2));
  CK(cudaMalloc(&in.k, (size_t)nsets * B * HK * D * 2));
  CK(cudaMalloc(&in.v, (size_t)nsets * B * HV * DV * 2));
  CK(cudaMalloc(&in.beta, (size_t)nsets * B * HV * 4));
  CK(cudaMalloc(&in.g, (size_t)nsets * B * HV * 4));
  if (M2) {
    CK(cudaMalloc(&in.z, (size_t)nsets * B * HV * DV * 2));
    CK(cudaMalloc(&in.hw, (size_t)3 * HV * 4));
  }
  uint64_t s = 7;
  auto fill = [&](__nv_bfloat16* d, size_t n, float lo, float hi) {
    std::vector<__nv_bfloat16> h(n);
    for (auto& x : h) x = __float2bfloat16(lo + (hi - lo) * frand(s));
    CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  };
  fill(in.q, (size_t)nsets * B * HK * D, -1, 1);
  fill(in.k, (size_t)nsets * B * HK * D, -1, 1);
  fill(in.v, (size_t)nsets * B * HV * DV, -1, 1);
  if (!M2) fill(in.beta, (size_t)nsets * B * HV, 0.1f, 0.9f);
  std::vector<float> hg((size_t)nsets * B * HV);
  for (auto& x : hg) x = -0.4f + 0.39f * frand(s);
  CK(cudaMemcpy(in.g, hg.data(), hg.size() * 4, cudaMemcpyHostToDevice));
  if (M2) {
    fill(in.z, (size_t)nsets * B * HV * DV, -2, 2);
    std::vector<float> dt((size_t)nsets * B * HV), w((size_t)3 * HV);
    for (auto& x : dt) x = -3.f + 2.5f * frand(s);  // softplus(dt + bias) ~ 0.02 .. 0.9
    for (int h = 0; h < HV; ++h) {
      w[h] = -(0.5f + 4.f * frand(s));  // A
      w[HV + h] = -1.f + frand(s);      // dt_bias
      w[2 * HV + h] = 0.5f + frand(s);  // D
    }
    CK(cudaMemcpy(in.beta, dt.data(), dt.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(in.hw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  }
  return in;
}

static void free_inputs(Inputs& in) {
  cudaFree(in.q); cudaFree(in.k); cudaFree(in.v); cudaFree(in.beta); cudaFree(in.g); cudaFree(in.z); cudaFree(in.hw);
}

// One step's parameters on pool pl with input set `set` and output o (f32 [B][HV][DV]).
static StepParams step_params(const Pool& pl, const Inputs& in, int B, int L, int set, float* o) {
  StepParams p;
  memset(&p, 0, sizeof p);
  p.state = (char*)pl.state;
  p.ring_u = (char*)pl.ru;
  p.ring_k = (char*)pl.rk;
  p.ring_g = pl.rg;
  p.meta = pl.meta;
  p.scratch = pl.scr;
  p.seq_stride = (int64_t)HV * D * DV;
  p.q = tens(in.q + (size_t)set * B * HK * D, KVR_DT_BF16, HK * D, HK * D, D, 1);
  p.k = tens(in.k + (size_t)set * B * HK * D, KVR_DT_BF16, HK * D, HK * D, D, 1);
  p.v = tens(in.v + (size_t)set * B * HV * DV, KVR_DT_BF16, HV * DV, HV * DV, DV, 1);
  p.g = tens(in.g + (size_t)set * B * HV, KVR_DT_F32, HV, HV, 1, 1);
  p.beta = tens(in.beta + (size_t)set * B * HV, KVR_DT_BF16, HV, HV, 1, 1);
  p.out = tens(o, KVR_DT_F32, HV * DV, HV * DV, DV, 1);
  p.op = KVR_GDN_OP_STEP;
  p.b = B; p.t = 1; p.hk = HK; p.hv = HV; p.dk = D; p.dv = DV; p.l = L;
  p.entry_dtype = KVR_DT_F32; p.conv_dtype = KVR_DT_F32;
  p.auto_commit = 1; p.l2norm = 1; p.hmax = L; p.stages = 1;
  p.scale = 1.f / sqrtf((float)D);
  p.rule = KVR_GDN_RULE_DELTA; p.dt_mode = KVR_GDN_DT_NONE; p.export_prefix = -1;
  p.dt_min = 0.f; p.dt_max = 1e30f;
  if (M2) {
    p.g = tens(nullptr, KVR_DT_F32, 0, 0, 0, 0);
    p.beta = tens((float*)in.beta + (size_t)set * B * HV, KVR_DT_F32, HV, HV, 1, 1);  // dt
    p.a = tens(in.hw, KVR_DT_F32, 1, 0, 0, 0);
    p.dt_bias = tens(in.hw + HV, KVR_DT_F32, 1, 0, 0, 0);
    p.skip = tens(in.hw + 2 * HV, KVR_DT_F32, 1, 0, 0, 0);
    p.gate = tens(in.z + (size_t)set * B * HV * DV, KVR_DT_BF16, HV * DV, HV * DV, DV, 1);
    p.rule = KVR_GDN_RULE_ADDITIVE;
    p.dt_mode = KVR_GDN_DT_SOFTPLUS;
    p.l2norm = 0;
    p.scale = 1.f;
  }
  for (int b = 0; b < B; ++b) p.ids_inline[b] = b;
  return p;
}

// µs per step of a graph of the n steps `step(i)` (i < n) launch, replayed `reps` times after 3.
template <typename F>
static double graph_us(cudaStream_t st, int n, int reps, F step) {
  cudaGraph_t gr;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) step(i);
  CK(cudaStreamEndCapture(st, &gr));
  CK(cudaGraphInstantiate(&ge, gr, 0));
  for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, st));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0, st);
  for (int w = 0; w < reps; ++w) cudaGraphLaunch(ge, st);
  cudaEventRecord(e1, st);
  CK(cudaEventSynchronize(e1));
  CK(cudaGetLastError());
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(gr);
  return ms * 1e3 / (reps * n);
}

// A launch as the programmatic dependent of the stream's previous kernel.
template <typename K>
static void launch_pdl(K kernel, dim3 grid, int threads, int smem, cudaStream_t st, const StepParams& p) {
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, kernel, p));
}

int main(int argc, char** argv) {
  const int L = argc > 1 ? atoi(argv[1]) : 16;
  if (argc > 3 && strcmp(argv[3], "m2") == 0) {
    M2 = true;
    HK = 8;
    HV = 128;
    DV = 64;
  }
  printf("%s layer: %d key heads, %d value heads, dk %d, dv %d%s\n", M2 ? "Mamba-2 (Nemotron-H)" : "GDN (Qwen3-Next)", HK, HV, D, DV,
         M2 ? " (the \"stream\" column and reference: the one-launch kernel)" : "");
  const int Bs[] = {1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 256};
  const int sdk = KVR_DT_F32;
  (void)sdk;
  int nsm;
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  CK(cudaFuncSetAttribute(kvr_gdn_sdecode_f32_v_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  int fper_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fper_sm, FUSED, 128, L * D * 4));
  printf("one-launch kernel: %d CTAs per SM\n", fper_sm);
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, MAIN, 128, MAIN_SMEM));
  printf("state kernel: %d CTAs per SM\n", per_sm);
  printf("L=%d  B | stream us | wdecode us | speedup | floor us (4.25 TB/s) | wdecode %% floor | max rel err out / state / ring\n", L);
  const int only = argc > 2 ? atoi(argv[2]) : 0;
  for (int B : Bs) {
    if (only && B != only) continue;
    const int NSETS = 8;
    std::vector<Pool> P(4);
    for (auto& pl : P) alloc_pool(pl, B, L);
    init_pools(P, B);
    // input sets: q, k [B][HK][D] bf16, v [B][HV][DV] bf16, g [B][HV] f32, beta [B][HV] bf16
    // (Mamba-2: beta is dt, f32; z [B][HV][DV] bf16; A, dt_bias, D [HV] f32)
    Inputs in = alloc_inputs(B, NSETS);
    float* out[2];
    CK(cudaMalloc(&out[0], (size_t)B * HV * DV * 4));
    CK(cudaMalloc(&out[1], (size_t)B * HV * DV * 4));
    auto params = [&](int which, int set, float* o) { return step_params(P[which], in, B, L, set, o); };
    const int R = std::min(DV, B >= 32 ? 128 : (B >= 8 ? 32 : 16));
    // the reference: the streaming kernel (delta rule only), or for Mamba-2 the one-launch
    // kernel (the library's GPU tests check it against the CPU backend)
    auto launch_stream = [&](int set, float* o) {
      StepParams p = params(0, set, o);
      if (M2) {
        p.tv = 32;
        p.tiles = DV / 32;
        FUSED<<<dim3(DV / 32, HV, B), 128, L * D * 4, st>>>(p);
        return;
      }
      p.tv = R;
      p.tiles = DV / R;
      const kvr_gdn_stream_smem lay = kvr_gdn_stream_smem_layout(1, D, R, 4, L, 4, 1);
      kvr_gdn_sdecode_f32_v_d128<<<B * HV * p.tiles, KVR_GDN_STREAM_THREADS, lay.total, st>>>(p);
    };
    // the prep kernel of one step: a CTA per (row, key head) below B = 128 (a warp per two
    // of its value heads, 2..16), else per row (as src/linear/replay/cuda.rs)
    const int prep_threads = 32 * std::min(std::max((HV / HK + 1) / 2, 2), KVR_GDN_DPREP_THREADS / 32);
    auto launch_prep = [&](StepParams& p) {
      p.stages = B < 128 ? HK : 1;
      if (B < 128)
        PREP<<<B * HK, prep_threads, PREP_SMEM(1), st>>>(p);
      else
        PREP<<<B, KVR_GDN_DPREP_THREADS, PREP_SMEM(HK), st>>>(p);
    };
    // a state kernel as the prep kernel's programmatic dependent
    auto launch_state = [&](void (*kernel)(StepParams), const StepParams& p) {
      launch_pdl(kernel, dim3(MAIN_GRID(B)), 128, MAIN_SMEM, st, p);
    };
    auto launch_w = [&](int set, float* o) {
      StepParams p = params(1, set, o);
      p.tv = 32;
      p.tiles = DV / 32;
      launch_prep(p);
      launch_state(MAIN, p);
    };
    auto launch_f = [&](int set, float* o) {
      StepParams p = params(2, set, o);
      p.tv = 32;
      p.tiles = DV / 32;
      FUSED<<<dim3(DV / 32, HV, B), 128, L * D * 4, st>>>(p);
    };
    auto launch_s = [&](int set, float* o) {
      StepParams p = params(3, set, o);
      p.tv = 32;
      p.tiles = DV / 32;
      SPEC<<<dim3(DV / 32, HV, B), 128, L * D * 4, st>>>(fdecode_args_of(p));
    };
    // correctness: 40 steps
    double e_out = 0, e_fout = 0, e_sout = 0;
    std::vector<float> o0((size_t)B * HV * DV), o1(o0.size());
    for (int step = 0; step < 40; ++step) {
      launch_stream(step % NSETS, out[0]);
      launch_w(step % NSETS, out[1]);
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaMemcpy(o0.data(), out[0], o0.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(o1.data(), out[1], o1.size() * 4, cudaMemcpyDeviceToHost));
      double mx = 0, md = 0;
      for (size_t i = 0; i < o0.size(); ++i) { mx = fmax(mx, fabs(o0[i])); md = fmax(md, fabs(o0[i] - o1[i])); }
      e_out = fmax(e_out, md / (mx + 1e-30));
      launch_f(step % NSETS, out[1]);
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaMemcpy(o1.data(), out[1], o1.size() * 4, cudaMemcpyDeviceToHost));
      md = 0;
      for (size_t i = 0; i < o0.size(); ++i) md = fmax(md, fabs(o0[i] - o1[i]));
      e_fout = fmax(e_fout, md / (mx + 1e-30));
      launch_s(step % NSETS, out[1]);
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaMemcpy(o1.data(), out[1], o1.size() * 4, cudaMemcpyDeviceToHost));
      md = 0;
      for (size_t i = 0; i < o0.size(); ++i) md = fmax(md, fabs(o0[i] - o1[i]));
      e_sout = fmax(e_sout, md / (mx + 1e-30));
    }
    auto cmp = [&](float* a, float* b, size_t n) {
      std::vector<float> x(n), y(n);
      CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost));
      double mx = 0, md = 0;
      for (size_t i = 0; i < n; ++i) { mx = fmax(mx, fabs(x[i])); md = fmax(md, fabs(x[i] - y[i])); }
      return md / (mx + 1e-30);
    };
    const double e_state = cmp(P[0].state, P[1].state, P[0].n_state);
    const double e_ring = fmax(fmax(cmp(P[0].ru, P[1].ru, P[0].n_ru), cmp(P[0].rk, P[1].rk, P[0].n_rk)),
                               cmp(P[0].rg, P[1].rg, P[0].n_rg));
    const double e_fstate = cmp(P[0].state, P[2].state, P[0].n_state);
    const double e_fring = fmax(fmax(cmp(P[0].ru, P[2].ru, P[0].n_ru), cmp(P[0].rk, P[2].rk, P[0].n_rk)),
                                cmp(P[0].rg, P[2].rg, P[0].n_rg));
    const double e_sstate = cmp(P[0].state, P[3].state, P[0].n_state);
    const double e_sring = fmax(fmax(cmp(P[0].ru, P[3].ru, P[0].n_ru), cmp(P[0].rk, P[3].rk, P[0].n_rk)),
                                cmp(P[0].rg, P[3].rg, P[0].n_rg));
    std::vector<int> m0((size_t)B * 8), m1(m0.size()), m2(m0.size()), m3(m0.size());
    CK(cudaMemcpy(m0.data(), P[0].meta, m0.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(m1.data(), P[1].meta, m1.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(m2.data(), P[2].meta, m2.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(m3.data(), P[3].meta, m3.size() * 4, cudaMemcpyDeviceToHost));
    bool meta_ok = true, fmeta_ok = true, smeta_ok = true;
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < 5; ++i) {
        meta_ok &= m0[b * 8 + i] == m1[b * 8 + i];
        fmeta_ok &= m0[b * 8 + i] == m2[b * 8 + i];
        smeta_ok &= m0[b * 8 + i] == m3[b * 8 + i];
      }
    // (the arrival counter, word 5, is back at 0 after every step)
    for (int b = 0; b < B; ++b) fmeta_ok &= m2[b * 8 + KVR_GDN_META_ARRIVE] == 0;
    for (int b = 0; b < B; ++b) smeta_ok &= m3[b * 8 + KVR_GDN_META_ARRIVE] == 0;
    // timing: graphs of 16 steps
    auto time = [&](auto launch) { return graph_us(st, 16, 20, [&](int i) { launch(i % NSETS, out[0]); }); };
    const double ts = time(launch_stream);
    const double tw = time(launch_w);
    const double tprep = time([&](int set, float* o) {
      StepParams p = params(1, set, o);
      p.tv = 32; p.tiles = DV / 32;
      launch_prep(p);
    });
    const double tmain = time([&](int set, float* o) {
      StepParams p = params(1, set, o);
      p.tv = 32; p.tiles = DV / 32; p.stages = B < 128 ? HK : 1;
      MAIN<<<MAIN_GRID(B), 128, MAIN_SMEM, st>>>(p);
    });
    if (L == 16) {
      auto alone = [&](auto k) {
        return time([&](int set, float* o) {
          StepParams p = params(1, set, o);
          p.tv = 32; p.tiles = DV / 32; p.stages = B < 128 ? HK : 1;
          k<<<MAIN_GRID(B), 128, MAIN_SMEM, st>>>(p);
        });
      };
      printf("      alone: plain-only 6/SM %.2f, 7/SM %.2f, 8/SM %.2f, library body at 7/SM %.2f, 8/SM %.2f, wdecode column's %.2f us\n",
             alone(ab_wdecode_plain6_r16), alone(ab_wdecode_plain7_r16), alone(ab_wdecode_plain8_r16),
             alone(ab_wdecode_full7_r16), alone(ab_wdecode_full8_r16), alone(MAIN));
    }
    StepParams prec = params(1, 0, out[0]);
    prec.l = 0; prec.tv = 32; prec.tiles = DV / 32;
    const double trec = time([&](int set, float* o) {
      kvr_gdn_wdecode_f32_v_d128_r0<<<MAIN_GRID(B), 128, 0, st>>>(prec);
    });
    printf("      prep alone %.2f us, main alone %.2f us, main recurrent (L=0) %.2f us\n", tprep, tmain, trec);
    {
      // per-step times over two flush cycles (eager, events between steps; the flush step is
      // the slow one), then the same with an event between prep and state kernel (no PDL
      // overlap): prep / state kernel per step
      const int NS = 2 * (L > 0 ? L : 1);
      std::vector<cudaEvent_t> ev(2 * NS + 1);
      for (size_t i = 0; i < ev.size(); ++i) CK(cudaEventCreate(&ev[i]));
      for (int i = 0; i < NS; ++i) launch_w(i % NSETS, out[1]);
      CK(cudaEventRecord(ev[0], st));
      for (int i = 0; i < NS; ++i) {
        launch_w(i % NSETS, out[1]);
        CK(cudaEventRecord(ev[i + 1], st));
      }
      CK(cudaStreamSynchronize(st));
      printf("      per step (PDL):");
      for (int i = 0; i < NS; ++i) {
        float ms;
        cudaEventElapsedTime(&ms, ev[i], ev[i + 1]);
        printf(" %.1f", ms * 1e3);
      }
      printf("\n      per step prep | state (no overlap):");
      CK(cudaEventRecord(ev[0], st));
      for (int i = 0; i < NS; ++i) {
        StepParams p = params(1, i % NSETS, out[1]);
        p.tv = 32; p.tiles = DV / 32;
        launch_prep(p);
        CK(cudaEventRecord(ev[2 * i + 1], st));
        MAIN<<<MAIN_GRID(B), 128, MAIN_SMEM, st>>>(p);
        CK(cudaEventRecord(ev[2 * i + 2], st));
      }
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      for (int i = 0; i < NS; ++i) {
        float a, b;
        cudaEventElapsedTime(&a, ev[2 * i], ev[2 * i + 1]);
        cudaEventElapsedTime(&b, ev[2 * i + 1], ev[2 * i + 2]);
        printf(" %.1f|%.1f", a * 1e3, b * 1e3);
      }
      printf("\n");
      for (auto& e : ev) cudaEventDestroy(e);
    }
    const double tf = time(launch_f);
    printf("      one launch (fdecode) %.2f us (%.2fx stream, %.2fx wdecode), err out / state / ring %.1e / %.1e / %.1e %s\n",
           tf, ts / tf, tw / tf, e_fout, e_fstate, e_fring, fmeta_ok ? "meta ok" : "META MISMATCH");
    const double tsp = time(launch_s);
    printf("      one launch specialized (FdFix) %.2f us (%.2fx fdecode), err out / state / ring %.1e / %.1e / %.1e %s\n",
           tsp, tf / tsp, e_sout, e_sstate, e_sring, smeta_ok ? "meta ok" : "META MISMATCH");
    // floor: state read once, (L-1)/2 ring u + k rows read on average, one entry written, the state written every L steps
    const double per_head = D * DV * 4.0 + (L - 1) / 2.0 * (DV * 4.0 + D * 4.0 * HK / HV) + DV * 4.0 + D * DV * 4.0 / L;
    const double floor_us = B * HV * per_head / 4.25e12 * 1e6;
    printf("%4d | %9.2f | %10.2f | %6.2fx | %8.2f | %5.1f %% | %.1e / %.1e / %.1e %s\n", B, ts, tw, ts / tw, floor_us,
           100 * floor_us / tw, e_out, e_state, e_ring, meta_ok ? "meta ok" : "META MISMATCH");
    for (auto& pl : P) free_pool(pl);
    free_inputs(in);
    cudaFree(out[0]); cudaFree(out[1]);
  }
  return 0;
}
