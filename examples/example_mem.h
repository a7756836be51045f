/* Shared by the examples: buffers in host memory (CPU backend) or device memory (CUDA
 * backend, through the driver API loaded with dlopen: the examples need no CUDA headers or
 * libraries), tensors over them, a status check, and a small random generator. */
#ifndef KVR_EXAMPLE_MEM_H
#define KVR_EXAMPLE_MEM_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvreplay.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static CUresult (*p_cuInit)(unsigned);
static CUresult (*p_cuDeviceGet)(int *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(void **, int);
static CUresult (*p_cuCtxSetCurrent)(void *);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*p_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuCtxSynchronize)(void);
static int on_cuda = 0;

static int load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
#define SYM(p, n) \
    if (!(*(void **)(&p) = dlsym(lib, n))) return 0
    SYM(p_cuInit, "cuInit");
    SYM(p_cuDeviceGet, "cuDeviceGet");
    SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    SYM(p_cuCtxSetCurrent, "cuCtxSetCurrent");
    SYM(p_cuMemAlloc, "cuMemAlloc_v2");
    SYM(p_cuMemFree, "cuMemFree_v2");
    SYM(p_cuMemcpyHtoD, "cuMemcpyHtoD_v2");
    SYM(p_cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    SYM(p_cuCtxSynchronize, "cuCtxSynchronize");
#undef SYM
    int dev;
    void *ctx;
    if (p_cuInit(0) || p_cuDeviceGet(&dev, 0) || p_cuDevicePrimaryCtxRetain(&ctx, dev) ||
        p_cuCtxSetCurrent(ctx))
        return 0;
    return 1;
}

static void *buf_new(size_t bytes) {
    if (!on_cuda) return calloc(1, bytes);
    CUdeviceptr p = 0;
    if (p_cuMemAlloc(&p, bytes)) return NULL;
    return (void *)(uintptr_t)p;
}
static void buf_free(void *p) {
    if (!on_cuda)
        free(p);
    else
        p_cuMemFree((CUdeviceptr)(uintptr_t)p);
}
/* kvreplay queues its work on its own (non-blocking) stream, and a plain cuMemcpyHtoD from
 * pageable memory may return before its DMA lands: an engine orders the two. This one
 * simply waits for the whole context around each host copy. */
static void buf_put(void *dst, const void *src, size_t bytes) {
    if (!on_cuda) {
        memcpy(dst, src, bytes);
        return;
    }
    p_cuCtxSynchronize(); /* queued kernels may still read the buffer */
    p_cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes);
    p_cuCtxSynchronize(); /* the DMA has landed before kvreplay's stream reads it */
}
static void buf_get(void *dst, const void *src, size_t bytes) {
    if (!on_cuda) {
        memcpy(dst, src, bytes);
        return;
    }
    p_cuCtxSynchronize(); /* kvreplay's queued work is done */
    p_cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes);
}

static kvr_tensor tensor(void *data, kvr_dtype dtype, int ndim, const int64_t *shape, int host) {
    kvr_tensor t;
    if (kvr_tensor_init(&t, data, dtype, host || !on_cuda ? KVR_DEVICE_HOST : KVR_DEVICE_CUDA, ndim,
                        shape) != KVR_STATUS_OK) {
        fprintf(stderr, "kvr_tensor_init: %s\n", kvr_error_last_message());
        exit(1);
    }
    return t;
}

#define CHECK(call)                                                                        \
    do {                                                                                   \
        kvr_status s_ = (call);                                                            \
        if (s_ != KVR_STATUS_OK) {                                                         \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,            \
                    kvr_status_string(s_), kvr_error_last_message());                         \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* Picks the backend: "cpu", "cuda", or (NULL) CUDA when usable; returns the context. */
static kvr_context *example_context(const char *want) {
    int want_cuda = want == NULL ? -1 : strcmp(want, "cuda") == 0;
    if (want_cuda != 0 && kvr_library_kernels_compiled() && load_driver()) on_cuda = 1;
    if (want_cuda == 1 && !on_cuda) {
        fprintf(stderr, "CUDA requested but not usable here\n");
        exit(1);
    }
    kvr_context_params cp;
    CHECK(kvr_context_params_default(&cp));
    cp.backend = on_cuda ? KVR_BACKEND_CUDA : KVR_BACKEND_CPU;
    kvr_context *ctx = NULL;
    CHECK(kvr_context_new(&cp, &ctx));
    return ctx;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float uniform(float lo, float hi) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return lo + (hi - lo) * (float)((rng >> 40) / 16777216.0);
}

#endif
