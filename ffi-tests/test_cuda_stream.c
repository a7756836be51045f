/* The C API as a CUDA engine uses it: the engine initializes the driver, creates its own
 * stream and device buffers, and hands both to kvreplay. Needs no CUDA headers: the few
 * driver entry points are loaded from libcuda.so.1 with dlopen. Without a driver or GPU
 * it prints SKIP and succeeds, unless KVR_REQUIRE_GPU=1. */
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "check.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

static CUresult (*p_cuInit)(unsigned);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuStreamCreate)(CUstream *, unsigned);
static CUresult (*p_cuStreamDestroy)(CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*p_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuCtxSynchronize)(void);

static int skip(const char *why) {
    const char *req = getenv("KVR_REQUIRE_GPU");
    if (req && strcmp(req, "1") == 0) {
        fprintf(stderr, "test_cuda_stream: KVR_REQUIRE_GPU=1 but %s\n", why);
        return 1;
    }
    printf("SKIP test_cuda_stream: %s\n", why);
    return 0;
}

#define LOAD(sym, name)                                                   \
    do {                                                                  \
        *(void **)(&sym) = dlsym(lib, name);                              \
        if (!sym) return skip("libcuda.so.1 lacks " name);                \
    } while (0)

int main(void) {
    if (!kvr_library_kernels_compiled()) return skip("library built without CUDA kernels");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return skip("no libcuda.so.1 (no NVIDIA driver)");
    LOAD(p_cuInit, "cuInit");
    LOAD(p_cuDeviceGet, "cuDeviceGet");
    LOAD(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    LOAD(p_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    LOAD(p_cuCtxSetCurrent, "cuCtxSetCurrent");
    LOAD(p_cuStreamCreate, "cuStreamCreate");
    LOAD(p_cuStreamDestroy, "cuStreamDestroy_v2");
    LOAD(p_cuStreamSynchronize, "cuStreamSynchronize");
    LOAD(p_cuMemAlloc, "cuMemAlloc_v2");
    LOAD(p_cuMemFree, "cuMemFree_v2");
    LOAD(p_cuMemcpyHtoD, "cuMemcpyHtoD_v2");
    LOAD(p_cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    LOAD(p_cuCtxSynchronize, "cuCtxSynchronize");
    if (p_cuInit(0) != 0) return skip("cuInit failed (no GPU?)");
    CUdevice dev;
    CUcontext pctx;
    if (p_cuDeviceGet(&dev, 0) != 0) return skip("no CUDA device 0");
    CHECK(p_cuDevicePrimaryCtxRetain(&pctx, dev) == 0);
    CHECK(p_cuCtxSetCurrent(pctx) == 0);
    CUstream stream;
    CHECK(p_cuStreamCreate(&stream, 1 /* non-blocking */) == 0);

    kvr_context_params p;
    CHECK_STATUS(kvr_context_params_default(&p), KVR_STATUS_OK);
    p.backend = KVR_BACKEND_CUDA;
    p.stream = stream;
    kvr_context *ctx = NULL;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_OK);
    CHECK(kvr_context_get_backend(ctx) == KVR_BACKEND_CUDA);

    enum { N = 100003 };
    static float host_src[N], host_back[N];
    for (int i = 0; i < N; ++i) host_src[i] = (float)(i % 2048) - 1024.0f; /* f16-exact */
    CUdeviceptr d_src, d_half, d_back;
    CHECK(p_cuMemAlloc(&d_src, N * 4) == 0);
    CHECK(p_cuMemAlloc(&d_half, N * 2) == 0);
    CHECK(p_cuMemAlloc(&d_back, N * 4) == 0);
    CHECK(p_cuMemcpyHtoD(d_src, host_src, N * 4) == 0);
    /* From pageable memory the copy may return before its DMA lands, and the legacy stream
     * does not order work on non-blocking streams: wait for it. */
    CHECK(p_cuCtxSynchronize() == 0);
    int64_t shape[1] = {N};
    kvr_tensor a, h, b;
    CHECK_STATUS(kvr_tensor_init(&a, (void *)(uintptr_t)d_src, KVR_DTYPE_F32, KVR_DEVICE_CUDA, 1, shape), KVR_STATUS_OK);
    CHECK_STATUS(kvr_tensor_init(&h, (void *)(uintptr_t)d_half, KVR_DTYPE_F16, KVR_DEVICE_CUDA, 1, shape), KVR_STATUS_OK);
    CHECK_STATUS(kvr_tensor_init(&b, (void *)(uintptr_t)d_back, KVR_DTYPE_F32, KVR_DEVICE_CUDA, 1, shape), KVR_STATUS_OK);
    /* Both copies queue on the engine's stream (NULL = the context's stream). */
    CHECK_STATUS(kvr_tensor_copy(ctx, &a, &h, NULL), KVR_STATUS_OK);
    CHECK_STATUS(kvr_tensor_copy(ctx, &h, &b, stream), KVR_STATUS_OK);
    CHECK(p_cuStreamSynchronize(stream) == 0);
    CHECK(p_cuMemcpyDtoH(host_back, d_back, N * 4) == 0);
    CHECK(memcmp(host_src, host_back, sizeof host_src) == 0);

    /* A host tensor in a CUDA context is refused. */
    kvr_tensor host;
    CHECK_STATUS(kvr_tensor_init(&host, host_src, KVR_DTYPE_F32, KVR_DEVICE_HOST, 1, shape), KVR_STATUS_OK);
    CHECK_STATUS(kvr_tensor_copy(ctx, &host, &b, NULL), KVR_STATUS_INVALID_ARG);

    kvr_context_free(ctx);
    p_cuMemFree(d_src);
    p_cuMemFree(d_half);
    p_cuMemFree(d_back);
    p_cuStreamDestroy(stream);
    p_cuDevicePrimaryCtxRelease(dev);
    return finish("test_cuda_stream");
}
