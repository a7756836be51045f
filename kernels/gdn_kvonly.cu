// Gated DeltaNet decode of KV-only sequences:
//   kvr_gdn_kvonly_<state>_d<dk>   a CTA per (batch row, value head) runs kvonly_head
//                                  (kernels/gdn_kvonly.cuh) for the rows that stay KV-only
// (src/linear/replay/cuda.rs launches it before kvr_gdn_decode_* with `kv_split` 1.)
#include "gdn_kvonly.cuh"

// 1024 resident threads per SM (64 registers).
#define KVR_GDN_KVONLY(SD, SN, DK)                                                                \
  extern "C" __global__ void __launch_bounds__(KVR_GDN_KVONLY_THREADS, 1024 / KVR_GDN_KVONLY_THREADS) \
      kvr_gdn_kvonly_##SN##_d##DK(const __grid_constant__ kvr::gdn::StepParams p) {              \
    kvr::gdn::kvonly_body<SD, DK>(p);                                                             \
  }
#define KVR_GDN_KVONLY_DK(DK) KVR_GDN_KVONLY(float, f32, DK) KVR_GDN_KVONLY(__nv_bfloat16, bf16, DK)
KVR_GDN_KVONLY_DK(64)
KVR_GDN_KVONLY_DK(128)
KVR_GDN_KVONLY_DK(256)
#undef KVR_GDN_KVONLY_DK
#undef KVR_GDN_KVONLY
