// Strided copy with dtype conversion between f32, f16 and bf16 device buffers.
//
// One kernel per (source, destination) dtype pair: kvr_copy_<src>_<dst>. The host coalesces
// dimensions first (src/backend/cuda/copy.rs); when both sides are contiguous and 16-byte
// aligned it sets `vectorized` and each thread moves 8 elements with 16-byte accesses.
#include "common.cuh"

namespace kvr {

using CopyParams = kvr_copy_args;

template <typename S, typename D> __device__ __forceinline__ void copy_impl(const CopyParams& p) {
  const S* __restrict__ src = static_cast<const S*>(p.src);
  D* __restrict__ dst = static_cast<D*>(p.dst);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (p.vectorized) {
    const int64_t nvec = p.n / 8;
    const Pack8<S>* vsrc = reinterpret_cast<const Pack8<S>*>(src);
    Pack8<D>* vdst = reinterpret_cast<Pack8<D>*>(dst);
    for (int64_t v = tid; v < nvec; v += nthreads) {
      const Pack8<S> in = vsrc[v];
      Pack8<D> out;
#pragma unroll
      for (int j = 0; j < 8; ++j) out.v[j] = convert<S, D>(in.v[j]);
      vdst[v] = out;
    }
    for (int64_t i = nvec * 8 + tid; i < p.n; i += nthreads) dst[i] = convert<S, D>(src[i]);
    return;
  }
  for (int64_t i = tid; i < p.n; i += nthreads) {
    int64_t rem = i, so = 0, dof = 0;
    for (int d = p.ndim - 1; d >= 0; --d) {
      const int64_t extent = p.shape[d];
      const int64_t idx = rem % extent;
      rem /= extent;
      so += idx * p.src_stride[d];
      dof += idx * p.dst_stride[d];
    }
    dst[dof] = convert<S, D>(src[so]);
  }
}

}  // namespace kvr

#define KVR_COPY_KERNEL(SN, S, DN, D)                                                    \
  extern "C" __global__ void __launch_bounds__(KVR_COPY_THREADS) kvr_copy_##SN##_##DN(const kvr::CopyParams p) { \
    kvr::copy_impl<S, D>(p);                                                             \
  }

KVR_COPY_KERNEL(f32, float, f32, float)
KVR_COPY_KERNEL(f32, float, f16, __half)
KVR_COPY_KERNEL(f32, float, bf16, __nv_bfloat16)
KVR_COPY_KERNEL(f16, __half, f32, float)
KVR_COPY_KERNEL(f16, __half, f16, __half)
KVR_COPY_KERNEL(f16, __half, bf16, __nv_bfloat16)
KVR_COPY_KERNEL(bf16, __nv_bfloat16, f32, float)
KVR_COPY_KERNEL(bf16, __nv_bfloat16, f16, __half)
KVR_COPY_KERNEL(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
