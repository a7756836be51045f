// Shared device helpers for every kvreplay kernel, and the host/device ABI (kvr_abi.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kvr_abi.h"

namespace kvr {

// Element conversions: f32 <-> f16 / bf16, round-to-nearest-even (the CPU backend's `half`
// crate rounds the same way, so conversions match the CPU bit for bit).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename S, typename D> struct IsSame { static constexpr bool value = false; };
template <typename T> struct IsSame<T, T> { static constexpr bool value = true; };

// Converts one element; a same-type copy moves the bits unchanged (NaN payloads included).
template <typename S, typename D> __device__ __forceinline__ D convert(S x) {
  if constexpr (IsSame<S, D>::value) {
    return x;
  } else {
    return from_float<D>(to_float(x));
  }
}

// Eight elements moved as one aligned unit: 16 bytes for 2-byte types, 32 for f32.
template <typename T> struct alignas(16) Pack8 {
  T v[8];
};

// Programmatic dependent launch (sm_90+; no-ops before, and when the launch did not ask for
// it): let the next kernel on the stream start, and wait for the previous one to complete.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Thread block clusters (sm_90+): a barrier over all threads of the cluster (release /
// acquire: shared-memory writes before it are visible to the cluster's CTAs after it), and
// the address of the same shared-memory variable in the cluster's CTA `rank` (DSMEM).
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
template <typename T> __device__ __forceinline__ const T* cluster_map(const T* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
  return reinterpret_cast<const T*>(out);
#else
  return p;
#endif
}

// Thread 0 of a CTA counts the CTA in on a device counter after a CTA barrier; true for the
// last of `need`, which resets the counter for the next launch. acq_rel: the CTA's earlier
// global writes (its partial, ordered before this by the barrier) are released to the last
// CTA, which acquires everyone's (its threads read them after the next barrier). Cheaper than
// a sequentially consistent __threadfence (MEMBAR.SC plus an L1 invalidation) on each side.
__device__ __forceinline__ bool count_in_last(int32_t* counter, int need) {
  int prev;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(prev) : "l"(counter) : "memory");
  const bool last = prev == need - 1;
  if (last) *counter = 0;  // the next launch starts after this grid completes
  return last;
}

}  // namespace kvr
