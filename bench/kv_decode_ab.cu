// Kernel-level A/B of the paged decode kernels without the Rust library: the stream-K kernel
// (kvr_kv_decode) against the short-batch split kernel (kvr_kv_sdecode, several part caps;
// builds with one group of 4 warps per CTA and a 6-stage one-group build for comparison)
// and the cluster kernel (kvr_kv_cdecode, clusters of 16) on the same pool (bf16 K/V, head dim 128, page 16,
// pages of the batch's sequences interleaved 256 tokens at a time, as bench_kv_decode.py
// fills them; inputs rotate over >= 256 MiB). Every variant is checked against the stream-K
// kernel's output first; then µs per call under graph replay (medians of 7 replays of >= 200
// calls). The device has nvcc, so a kernel edit is measured in one call without a GPU bundle:
//   cd bench && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I ../kernels \
//     kv_decode_ab.cu -o kvab && ./kvab [max B (negative: only 1 and 8)] [max L] \
//     [variants, comma-separated] [Llama|Qwen]   # KVAB_PROFILE=1: one checked launch each, for ncu
// KVAB_LAYOUT=pg|ct|hm|hm1|rnd picks the pool layout (below), KVAB_B=n one batch size,
// KVAB_CAP_GIB=n the largest K+V per call (default 2). Variant "lib" is the library's split
// kernel rule (power-of-two parts), "g1*" the library's batch kernel build (one warp group).
#include "../kernels/kv_decode.cu"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

using KV = __nv_bfloat16;
constexpr int D = 128, PAGE = 16, OLD_STAGES = 3;
using Params = kvr::DecodeParams;

// The split kernel with a 6-tile ring, one CTA per SM (more bytes in flight per CTA).
__global__ void __launch_bounds__(128, 1) ab_split6(const __grid_constant__ Params p) {
  kvr::sdecode_body<__nv_bfloat16, 128, 6, false, 1>(p);
}
// One group of 4 warps per CTA (two CTAs per SM; the library's kernels have two groups at
// head dim 128).
__global__ void __launch_bounds__(128, 2) ab_split_g1(const __grid_constant__ Params p) {
  kvr::sdecode_body<__nv_bfloat16, 128, KVR_KV_SDECODE_STAGES, false, 1>(p);
}
__global__ void __launch_bounds__(128, 2) ab_cluster_g1(const __grid_constant__ Params p) {
  kvr::sdecode_body<__nv_bfloat16, 128, KVR_KV_SDECODE_STAGES, true, 1>(p);
}
// An empty kernel (launch cost under programmatic dependent launch).
__global__ void ab_empty(const __grid_constant__ Params p) {
  kvr::pdl_wait();
  kvr::pdl_launch_dependents();
}

__global__ void fill(KV* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    x[i] = __float2bfloat16((h & 0xffff) / 32768.f - 1.f);
  }
}

static kvr_fast_div fastdiv(uint32_t d) {
  kvr_fast_div f;
  uint32_t shift = 0;
  while ((1ull << shift) < d) ++shift;
  f.d = d;
  f.mul = (uint32_t)(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  f.shift = shift;
  return f;
}

struct Variant {
  const char* name;
  int splits_cap, min_tiles;
  bool pdl;
  int stop;     // 0: the library's kernel; 9: an empty kernel
  int cluster;  // > 0: kvr_kv_cdecode with clusters of this many CTAs (splits = cluster)
  bool deep;    // ab_split6 (6 stages, one CTA per SM) instead of the library's 3 stages
  bool g1;      // one group of 4 warps per CTA (ab_split_g1 / ab_cluster_g1)
  int forced;   // > 0: exactly this many parts per row
};

// Whether `name` is in the comma-separated list (null: every name).
static bool listed(const char* list, const char* name) {
  if (!list) return true;
  const std::string l = std::string(",") + list + ",";
  return l.find(std::string(",") + name + ",") != std::string::npos;
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int maxB = argc > 1 ? atoi(argv[1]) : 32;
  const int maxL = argc > 2 ? atoi(argv[2]) : 65536;
  // Optional: one variant and one shape (e.g. "s32m2 Qwen"), and KVAB_PROFILE=1: only the
  // checked launch of each (for ncu), no timing.
  const char* only_variant = argc > 3 ? argv[3] : nullptr;
  const char* only_shape = argc > 4 ? argv[4] : nullptr;
  const bool profile = getenv("KVAB_PROFILE") != nullptr;
  int nsm;
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const kvr_kv_decode_smem lay = kvr_kv_decode_smem_layout(D, 2, OLD_STAGES);
  const int old_smem = lay.total;
  const int new_threads = KVR_KV_SDECODE_THREADS * KVR_KV_SDECODE_GROUPS(D);
  const int new_smem = KVR_KV_SDECODE_GROUPS(D) == 2
                           ? kvr_kv_decode_smem_layout(D, 2, KVR_KV_SDECODE_STAGES).split2_total
                           : kvr_kv_decode_smem_layout(D, 2, KVR_KV_SDECODE_STAGES).split_total;
  const int deep_smem = kvr_kv_decode_smem_layout(D, 2, 6).split_total;
  const int g1_smem = kvr_kv_decode_smem_layout(D, 2, KVR_KV_SDECODE_STAGES).split_total;
  CK(cudaFuncSetAttribute(ab_split_g1, cudaFuncAttributeMaxDynamicSharedMemorySize, g1_smem));
  CK(cudaFuncSetAttribute(ab_cluster_g1, cudaFuncAttributeMaxDynamicSharedMemorySize, g1_smem));
  CK(cudaFuncSetAttribute(ab_cluster_g1, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int g1_per_sm;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g1_per_sm, ab_split_g1, 128, g1_smem));
  printf("one warp group: %d B smem, %d CTAs/SM\n", g1_smem, g1_per_sm);
  CK(cudaFuncSetAttribute(ab_split6, cudaFuncAttributeMaxDynamicSharedMemorySize, deep_smem));
  CK(cudaFuncSetAttribute(kvr_kv_decode_bf16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, old_smem));
  CK(cudaFuncSetAttribute(kvr_kv_sdecode_bf16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, new_smem));
  CK(cudaFuncSetAttribute(kvr_kv_cdecode_bf16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, new_smem));
  CK(cudaFuncSetAttribute(kvr_kv_cdecode_bf16_d128, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CK(cudaFuncSetAttribute(ab_empty, cudaFuncAttributeMaxDynamicSharedMemorySize, new_smem));
  int old_per_sm, new_per_sm;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&old_per_sm, kvr_kv_decode_bf16_d128, KVR_KV_DECODE_THREADS, old_smem));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&new_per_sm, kvr_kv_sdecode_bf16_d128, new_threads, new_smem));
  const int old_wave = old_per_sm * nsm, new_wave = new_per_sm * nsm;
  printf("SMs %d; stream-K: %d B smem, %d CTAs/SM; split: %d threads, %d B smem, %d CTAs/SM\n", nsm, old_smem,
         old_per_sm, new_threads, new_smem, new_per_sm);

  const int max_parts = 8192;
  float *part_o, *part_lse;
  int32_t* counters;
  CK(cudaMalloc(&part_o, (size_t)max_parts * 16 * D * 4));
  CK(cudaMalloc(&part_lse, (size_t)max_parts * 16 * 4));
  CK(cudaMalloc(&counters, 1 << 20));
  CK(cudaMemset(counters, 0, 1 << 20));

  const Variant variants[] = {
      {"lib", -64, 2, true, 0, 0, false, false},
      {"s16m2", 16, 2, true, 0, 0, false, false}, {"s32m2", 32, 2, true, 0, 0, false, false},
      {"s64m2", 64, 2, true, 0, 0, false, false}, {"c16", 16, 1, true, 0, 16, false, false},
      {"g1s32m2", 32, 2, true, 0, 0, false, true}, {"g1s64m2", 64, 2, true, 0, 0, false, true},
      {"g1c16", 16, 1, true, 0, 16, false, true},
      {"f2", 0, 2, true, 0, 0, false, false, 2}, {"f4", 0, 2, true, 0, 0, false, false, 4},
      {"d6f1", 0, 2, true, 0, 0, true, false, 1}, {"d6f2", 0, 2, true, 0, 0, true, false, 2},
  };
  const int NV = sizeof(variants) / sizeof(variants[0]);
  printf("%-22s %8s", "config", "stream");
  for (const Variant& v : variants) printf(" %11s", v.name);
  printf("   max rel err\n");

  struct Shape { const char* name; int hq, hkv; };
  const Shape shapes[] = {{"Llama", 32, 8}, {"Qwen", 28, 4}};
  for (const Shape& sh : shapes) {
    if (only_shape && strcmp(only_shape, sh.name) != 0) continue;
    for (int B : {1, 2, 4, 8, 16, 32, 64, 128}) {
      if (B != 1 && B != 8 && maxB < 0) continue;
      if (getenv("KVAB_B") && atoi(getenv("KVAB_B")) != B) continue;
      if (B > std::abs(maxB)) continue;
      for (int L : {1024, 4096, 16384, 65536}) {
        if (L > maxL) continue;
        const size_t kv_bytes = (size_t)2 * B * L * sh.hkv * D * 2;
        const size_t cap_gib = getenv("KVAB_CAP_GIB") ? atoi(getenv("KVAB_CAP_GIB")) : 2;
        if (kv_bytes > (cap_gib << 30)) continue;
        const int n_sets = (int)std::min<size_t>(64, std::max<size_t>(1, ((size_t)256 << 20) / kv_bytes + 1));
        const int pps = L / PAGE, pages = B * pps;
        const size_t per_array = (size_t)pages * sh.hkv * PAGE * D;  // elements of K (or V) of one layer
        KV* kvbuf;
        CK(cudaMalloc(&kvbuf, per_array * 2 * n_sets * sizeof(KV)));
        fill<<<1024, 256, 0, st>>>(kvbuf, per_array * 2 * n_sets, 1234u + B * 7 + L);
        // Table: 16 pages (256 tokens) per sequence per round, sequences interleaved.
        // KVAB_LAYOUT: pg (that, [page][head][slot][d]), ct (one page of L tokens per
        // sequence: the contiguous layout), hm (head-major [head][page][slot][d]), rnd (pages
        // in a random order).
        const char* lay_env = getenv("KVAB_LAYOUT");
        const std::string layout = lay_env ? lay_env : "pg";
        // (hm1 / pg1: each sequence's pages consecutive, hm1 is then the contiguous layout's
        // addresses read through a paged table.)
        const bool contig = layout == "ct", head_major = layout == "hm" || layout == "hm1";
        std::vector<int32_t> table((size_t)B * pps), lens(B, L);
        int next = 0;
        for (int r = 0; r < pps; r += 16)
          for (int b = 0; b < B; ++b)
            for (int j = r; j < std::min(pps, r + 16); ++j) table[(size_t)b * pps + j] = next++;
        if (layout == "hm1" || layout == "pg1")
          for (size_t i = 0; i < table.size(); ++i) table[i] = (int32_t)i;
        if (layout == "rnd") {
          uint32_t h = 12345u;
          for (size_t i = table.size() - 1; i > 0; --i) {
            h = h * 1664525u + 1013904223u;
            std::swap(table[i], table[(h >> 8) % (i + 1)]);
          }
        }
        if (contig) {
          table.assign(B, 0);
          for (int b = 0; b < B; ++b) table[b] = b;
        }
        int32_t *d_table, *d_lens;
        CK(cudaMalloc(&d_table, table.size() * 4));
        CK(cudaMalloc(&d_lens, B * 4));
        CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_lens, lens.data(), B * 4, cudaMemcpyHostToDevice));
        KV *q, *out_ref, *out;
        const size_t qn = (size_t)B * sh.hq * D;
        CK(cudaMalloc(&q, qn * n_sets * sizeof(KV)));
        CK(cudaMalloc(&out_ref, qn * sizeof(KV)));
        CK(cudaMalloc(&out, qn * sizeof(KV)));
        fill<<<256, 256, 0, st>>>(q, qn * n_sets, 99u + B);
        const int g = sh.hq / sh.hkv, Y = (g + 15) / 16;
        std::vector<Params> ps(n_sets);
        for (int i = 0; i < n_sets; ++i) {
          Params& p = ps[i];
          memset(&p, 0, sizeof p);
          p.q = q + qn * i;
          p.out = out;
          p.k = kvbuf + per_array * 2 * i;
          p.v = kvbuf + per_array * (2 * i + 1);
          p.table = d_table;
          p.lens = d_lens;
          p.part_o = part_o;
          p.part_lse = part_lse;
          p.counters = counters;
          p.group_counters = counters + 65536;
          p.q_sb = sh.hq * D; p.q_st = 0; p.q_sh = D;
          p.o_sb = sh.hq * D; p.o_st = 0; p.o_sh = D;
          p.k_sp = p.v_sp = (int64_t)sh.hkv * PAGE * D;
          p.k_sh = p.v_sh = PAGE * D;
          p.k_st = p.v_st = D;
          p.page = fastdiv(PAGE);
          p.table_stride = pps;
          if (contig) {
            p.k_sp = p.v_sp = (int64_t)sh.hkv * L * D;
            p.k_sh = p.v_sh = (int64_t)L * D;
            p.page = fastdiv(L);
            p.table_stride = 1;
          } else if (head_major) {
            p.k_sp = p.v_sp = PAGE * D;
            p.k_sh = p.v_sh = (int64_t)pages * PAGE * D;
          }
          p.max_seqs = B;
          p.b = B; p.t = 1; p.hq = sh.hq; p.hkv = sh.hkv; p.g = g;
          p.q_dtype = KVR_DT_BF16; p.out_dtype = KVR_DT_BF16;
          p.min_tiles_per_cta = 2;
          p.stages = OLD_STAGES;
          p.q_vec = KVR_KV_Q_VEC_KV;
          p.scale_log2 = 1.f / sqrtf((float)D) * 1.4426950408889634f;
          p.qk_scale = 1.f / sqrtf((float)D);
          for (int b = 0; b < B; ++b) p.batch_inline[b] = b;
        }
        auto launch_old = [&](const Params& p) {
          Params c = p;
          c.out = p.out;
          kvr_kv_decode_bf16_d128<<<dim3(old_wave / Y, Y), KVR_KV_DECODE_THREADS, old_smem, st>>>(c);
        };
        auto launch_new = [&](const Params& p, const Variant& v) {
          Params c = p;
          c.min_tiles_per_cta = v.min_tiles;
          const int R = B * sh.hkv;
          const int wave = v.deep ? nsm : v.g1 ? g1_per_sm * nsm : new_wave;
          int splits = v.cluster ? v.cluster : std::max(1, std::min(std::abs(v.splits_cap), wave / (R * Y)));
          if (v.forced > 0) splits = v.forced;
          if (v.splits_cap < 0) {  // the library's rule: the largest power of two
            int p2 = 1;
            while (p2 * 2 <= splits) p2 *= 2;
            splits = p2;
          }
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(splits, R, Y);
          cfg.blockDim = dim3(v.g1 || v.deep ? KVR_KV_SDECODE_THREADS : new_threads);
          cfg.dynamicSmemBytes = v.deep ? deep_smem : v.g1 ? g1_smem : new_smem;
          cfg.stream = st;
          cudaLaunchAttribute at[2];
          int na = 0;
          if (v.pdl) {
            at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[na++].val.programmaticStreamSerializationAllowed = 1;
          }
          if (v.cluster) {
            at[na].id = cudaLaunchAttributeClusterDimension;
            at[na].val.clusterDim.x = v.cluster;
            at[na].val.clusterDim.y = 1;
            at[na++].val.clusterDim.z = 1;
          }
          cfg.attrs = at;
          cfg.numAttrs = na;
          if (v.cluster) {
            if (v.g1) CK(cudaLaunchKernelEx(&cfg, ab_cluster_g1, c));
            else CK(cudaLaunchKernelEx(&cfg, kvr_kv_cdecode_bf16_d128, c));
            return;
          }
          if (v.g1) {
            CK(cudaLaunchKernelEx(&cfg, ab_split_g1, c));
            return;
          }
          switch (v.stop) {
            case 9: CK(cudaLaunchKernelEx(&cfg, ab_empty, c)); break;
            default:
              if (v.deep) CK(cudaLaunchKernelEx(&cfg, ab_split6, c));
              else CK(cudaLaunchKernelEx(&cfg, kvr_kv_sdecode_bf16_d128, c));
          }
        };
        // Check: every variant against the stream-K kernel on set 0.
        std::vector<__nv_bfloat16> ref(qn), got(qn);
        Params p0 = ps[0];
        p0.out = out_ref;
        launch_old(p0);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        CK(cudaMemcpy(ref.data(), out_ref, qn * 2, cudaMemcpyDeviceToHost));
        float refmax = 0.f;
        for (size_t i = 0; i < qn; ++i) refmax = std::max(refmax, fabsf(__bfloat162float(ref[i])));
        float worst = 0.f;
        for (const Variant& v : variants) {
          if (v.stop || !listed(only_variant, v.name)) continue;
          const int R = B * sh.hkv;
          if (v.cluster && (long)R * Y * v.cluster > 4096) continue;
          CK(cudaMemset(out, 0xff, qn * 2));
          launch_new(ps[0], v);
          CK(cudaStreamSynchronize(st));
          CK(cudaGetLastError());
          CK(cudaMemcpy(got.data(), out, qn * 2, cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < qn; ++i) {
            const float e = fabsf(__bfloat162float(got[i]) - __bfloat162float(ref[i])) / refmax;
            if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : std::max(worst, e);
          }
        }
        // Timing under graph replay.
        const int calls = std::max(n_sets, (200 + n_sets - 1) / n_sets * n_sets);
        auto time_graph = [&](auto&& one) {
          cudaGraph_t gr;
          cudaGraphExec_t ge;
          CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
          for (int i = 0; i < calls; ++i) one(ps[i % n_sets]);
          CK(cudaStreamEndCapture(st, &gr));
          CK(cudaGraphInstantiate(&ge, gr, 0));
          CK(cudaGraphLaunch(ge, st));
          CK(cudaStreamSynchronize(st));
          std::vector<float> ts;
          cudaEvent_t a, b;
          CK(cudaEventCreate(&a));
          CK(cudaEventCreate(&b));
          for (int r = 0; r < 7; ++r) {
            CK(cudaEventRecord(a, st));
            CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            ts.push_back(ms * 1000.f / calls);
          }
          cudaEventDestroy(a);
          cudaEventDestroy(b);
          cudaGraphExecDestroy(ge);
          cudaGraphDestroy(gr);
          return median(ts);
        };
        if (profile) {
          cudaFree(kvbuf); cudaFree(d_table); cudaFree(d_lens); cudaFree(q); cudaFree(out_ref); cudaFree(out);
          continue;
        }
        char tag[64];
        snprintf(tag, sizeof tag, "%s B=%d L=%dK", sh.name, B, L / 1024);
        float t_old = time_graph([&](const Params& p) { launch_old(p); });
        std::vector<float> t_new(NV);
        for (int v = 0; v < NV; ++v)
          t_new[v] = !listed(only_variant, variants[v].name)
                         ? NAN
                         : time_graph([&](const Params& p) { launch_new(p, variants[v]); });
        printf("%-22s %8.2f", tag, t_old);
        for (int v = 0; v < NV; ++v) printf(" %11.2f", t_new[v]);
        printf("   %.1e\n", worst);
        fflush(stdout);
        cudaFree(kvbuf); cudaFree(d_table); cudaFree(d_lens); cudaFree(q); cudaFree(out_ref); cudaFree(out);
      }
    }
  }
  return 0;
}
