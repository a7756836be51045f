// Pieces shared by the streaming GDN kernels (gdn_stream.cu: decode; gdn_sverify.cu:
// verify): CTA size, the bulk-copy + mbarrier primitives of sm_90, and a 4-value warp sum.
#pragma once
#include "gdn_common.cuh"

namespace kvr {
namespace gdn {

constexpr int kStreamThreads = KVR_GDN_STREAM_THREADS;
constexpr int kStreamWarps = kStreamThreads / 32;

__host__ __device__ constexpr int align16(int x) { return (x + 15) & ~15; }

// State tiles travel by the bulk copy engine on sm_90 (cp.async.bulk completing on an
// mbarrier: the bytes in flight are not bounded by the SM's load queues, which capped the
// per-thread cp.async version of this kernel at about 1.4-1.8 TB/s), by cp.async before.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVR_GDN_BULK 1
#else
#define KVR_GDN_BULK 0
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#if KVR_GDN_BULK
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16) from global `src` to shared `dst`, completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

// Sums P[0..4) over the warp; lane l ends with the total of P[l / 8]: exchange 1 splits on
// lane bit 3 into even / odd entries, exchange 2 on bit 4 into first / second of the pair,
// then a butterfly over the 8 lanes that share both bits (7 shuffles instead of 20).
__device__ __forceinline__ float reduce4(float (&P)[4], int lane) {
  // exchange 1: lanes with bit 8 keep the odd entries
  {
    const bool hi = lane & 8;
    const float k0 = hi ? P[1] : P[0], s0 = hi ? P[0] : P[1];
    const float k1 = hi ? P[3] : P[2], s1 = hi ? P[2] : P[3];
    P[0] = k0 + __shfl_xor_sync(0xffffffffu, s0, 8);
    P[1] = k1 + __shfl_xor_sync(0xffffffffu, s1, 8);
  }
  // exchange 2: lanes with bit 16 keep the second
  {
    const bool hi = lane & 16;
    const float k0 = hi ? P[1] : P[0], s0 = hi ? P[0] : P[1];
    P[0] = k0 + __shfl_xor_sync(0xffffffffu, s0, 16);
  }
  float x = P[0];
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

}  // namespace gdn
}  // namespace kvr
