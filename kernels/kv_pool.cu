// Device-side bookkeeping of the paged KV pool (src/kv/cuda.rs):
//   kvr_kv_patch            apply (index, value) pairs to the int32 page table / lengths
//   kvr_kv_write_<s>_<d>    scatter new tokens' K and V rows into their pages (with dtype
//                           conversion), positions computed from the device page table
//   kvr_kv_copy_pages       copy whole pages (all layers, K and V) for copy-on-write
// Everything a launch needs travels in its parameters, so each is asynchronous, needs no
// staging memory and can be captured in a CUDA Graph.
#include "mma.cuh"

namespace kvr {

using PatchParams = kvr_kv_patch_args;
using LayerDesc = kvr_kv_layer_desc;
using WriteGroup = kvr_kv_write_group;
using WriteParams = kvr_kv_write_args;
using PageCopyParams = kvr_kv_page_copy_args;

template <typename S, typename Dt> __device__ __forceinline__ void write_body(const WriteParams& p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t rows = static_cast<int64_t>(p.n_layers) * p.n_tokens * p.hkv * 2;
  for (int64_t r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    int64_t x = r;
    const int kv = static_cast<int>(x % 2);
    x /= 2;
    const int h = static_cast<int>(x % p.hkv);
    x /= p.hkv;
    const int tok = static_cast<int>(x % p.n_tokens);
    const int l = static_cast<int>(x / p.n_tokens);
    // Group holding this token: groups are sorted by src_offset.
    int lo = 0, hi = p.n_groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (p.groups[mid].src_offset <= tok) lo = mid;
      else hi = mid - 1;
    }
    const WriteGroup g = p.groups[lo];
    const int pos = g.start + (tok - g.src_offset);
    const uint32_t pi = fast_div(p.page, static_cast<uint32_t>(pos));
    const int64_t page = p.table[static_cast<int64_t>(g.slot) * p.table_stride + pi];
    const int64_t sl = pos - static_cast<int64_t>(pi) * p.page.d;
    const LayerDesc ld = p.layers[p.layer0 + l];
    Dt* dst;
    const S* src;
    int64_t sd;
    if (kv == 0) {
      dst = static_cast<Dt*>(ld.k) + page * ld.k_sp + h * ld.k_sh + sl * ld.k_st;
      src = static_cast<const S*>(p.k_src) + l * p.ks[0] + tok * p.ks[1] + h * p.ks[2];
      sd = p.ks[3];
    } else {
      dst = static_cast<Dt*>(ld.v) + page * ld.v_sp + h * ld.v_sh + sl * ld.v_st;
      src = static_cast<const S*>(p.v_src) + l * p.vs[0] + tok * p.vs[1] + h * p.vs[2];
      sd = p.vs[3];
    }
    for (int d = lane; d < p.d; d += 32) dst[d] = convert<S, Dt>(src[d * sd]);
  }
}

}  // namespace kvr

extern "C" __global__ void kvr_kv_patch(const __grid_constant__ kvr::PatchParams p) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += gridDim.x * blockDim.x)
    p.dst[p.index[i]] = p.value[i];
}

extern "C" __global__ void kvr_kv_copy_pages(const __grid_constant__ kvr::PageCopyParams p) {
  // Rows: pair x layer x {K, V} x head x slot, each D elements.
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t rows = static_cast<int64_t>(p.n_pairs) * p.n_layers * 2 * p.hkv * p.page_size;
  for (int64_t r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    int64_t x = r;
    const int sl = static_cast<int>(x % p.page_size);
    x /= p.page_size;
    const int h = static_cast<int>(x % p.hkv);
    x /= p.hkv;
    const int kv = static_cast<int>(x % 2);
    x /= 2;
    const int l = static_cast<int>(x % p.n_layers);
    const int pair = static_cast<int>(x / p.n_layers);
    const kvr::LayerDesc ld = p.layers[l];
    const int64_t sp = kv ? ld.v_sp : ld.k_sp, sh = kv ? ld.v_sh : ld.k_sh, st = kv ? ld.v_st : ld.k_st;
    char* base = static_cast<char*>(kv ? ld.v : ld.k);
    const int64_t row = h * sh + sl * st;
    const char* src = base + (p.src[pair] * sp + row) * p.elem_bytes;
    char* dst = base + (p.dst[pair] * sp + row) * p.elem_bytes;
    if (p.elem_bytes == 4) {
      for (int d = lane; d < p.d; d += 32)
        reinterpret_cast<uint32_t*>(dst)[d] = reinterpret_cast<const uint32_t*>(src)[d];
    } else {
      for (int d = lane; d < p.d; d += 32)
        reinterpret_cast<uint16_t*>(dst)[d] = reinterpret_cast<const uint16_t*>(src)[d];
    }
  }
}

#define KVR_WRITE_KERNEL(SN, S, DN, Dt)                                                        \
  extern "C" __global__ void __launch_bounds__(KVR_KV_WRITE_THREADS)                                            \
      kvr_kv_write_##SN##_##DN(const __grid_constant__ kvr::WriteParams p) {                    \
    kvr::write_body<S, Dt>(p);                                                                   \
  }

KVR_WRITE_KERNEL(f32, float, f32, float)
KVR_WRITE_KERNEL(f32, float, f16, __half)
KVR_WRITE_KERNEL(f32, float, bf16, __nv_bfloat16)
KVR_WRITE_KERNEL(f16, __half, f32, float)
KVR_WRITE_KERNEL(f16, __half, f16, __half)
KVR_WRITE_KERNEL(f16, __half, bf16, __nv_bfloat16)
KVR_WRITE_KERNEL(bf16, __nv_bfloat16, f32, float)
KVR_WRITE_KERNEL(bf16, __nv_bfloat16, f16, __half)
KVR_WRITE_KERNEL(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
