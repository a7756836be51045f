// Write-gated KV (src/kv/wgkv): row copies into the pool's pages.
//   kvr_wgkv_scatter   rows of a source (new tokens from the host's K/V, or the pool's own
//                      rows: ring -> global promotions, drafts -> scratch -> ring) to
//                      (page, slot) positions, with dtype conversion; one warp per row.
// Up to KVR_WGKV_MAX_PAIRS rows travel in the parameters; larger batches (a prefill) read
// their rows from a device array the host uploads on the stream.
#include "mma.cuh"

namespace kvr {

__device__ __forceinline__ float wg_load(const void* p, int64_t i, int dtype) {
  if (dtype == KVR_DT_F32) return static_cast<const float*>(p)[i];
  if (dtype == KVR_DT_F16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ void wg_store(void* p, int64_t i, int dtype, float x) {
  if (dtype == KVR_DT_F32) static_cast<float*>(p)[i] = x;
  else if (dtype == KVR_DT_F16) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
}

}  // namespace kvr

extern "C" __global__ void kvr_wgkv_scatter(const __grid_constant__ kvr_wgkv_scatter_args p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t n_rows = 2 * static_cast<int64_t>(p.n_pairs);
  for (int64_t r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < n_rows; r += warps) {
    const int64_t i = r >> 1;
    const bool is_v = r & 1;
    const void* src = is_v ? p.v_src : p.k_src;
    void* dst = is_v ? p.v_dst : p.k_dst;
    int64_t s0, pg, sl;
    if (p.rows) {
      const int64_t* e = p.rows + 3 * static_cast<int64_t>(i);
      s0 = is_v ? e[1] : e[0];
      pg = e[2] >> 32;
      sl = e[2] & 0xffffffff;
    } else {
      s0 = is_v ? p.v_off[i] : p.k_off[i];
      pg = p.page[i];
      sl = p.slot[i];
    }
    const int64_t sd = is_v ? p.v_src_ds : p.k_src_ds;
    const int64_t d0 = pg * (is_v ? p.v_sp : p.k_sp) + sl * (is_v ? p.v_st : p.k_st);
    for (int d = lane; d < p.d; d += 32)
      kvr::wg_store(dst, d0 + d, p.dst_dtype, kvr::wg_load(src, s0 + d * sd, p.src_dtype));
  }
}
