/* Prints the kvreplay version, how its kernels were built, and which contexts it can make
 * on this machine (CPU always; CUDA when a driver, a GPU and the kernels are present). */
#include <stdio.h>
#include <string.h>

#include "kvreplay.h"

static void describe(kvr_context *ctx) {
    kvr_device_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (kvr_context_get_device_info(ctx, &info) != KVR_STATUS_OK) {
        printf("  (device info failed: %s)\n", kvr_error_last_message());
        return;
    }
    if (info.backend == KVR_BACKEND_CUDA) {
        printf("  CUDA device %d: %s, %d SMs, compute capability %d.%d, %.1f GiB (%.1f GiB free), "
               "L2 %llu MiB, driver CUDA %d.%d\n",
               info.device, info.name, info.multiprocessor_count, info.compute_capability_major,
               info.compute_capability_minor, (double)info.total_memory_bytes / (1 << 30),
               (double)info.free_memory_bytes / (1 << 30),
               (unsigned long long)(info.l2_cache_bytes >> 20), info.driver_version / 1000,
               (info.driver_version % 1000) / 10);
    } else {
        printf("  CPU: %s, %d threads, %.1f GiB memory\n", info.name, info.multiprocessor_count,
               (double)info.total_memory_bytes / (1 << 30));
    }
}

static int try_backend(kvr_backend backend, const char *name) {
    kvr_context_params p;
    kvr_context *ctx = NULL;
    if (kvr_context_params_default(&p) != KVR_STATUS_OK) return 1;
    p.backend = backend;
    kvr_status s = kvr_context_new(&p, &ctx);
    if (s != KVR_STATUS_OK) {
        printf("%-5s context: not available: %s (%s)\n", name, kvr_status_string(s),
               kvr_error_last_message());
        return 0;
    }
    printf("%-5s context: ok, backend %s\n", name,
           kvr_context_get_backend(ctx) == KVR_BACKEND_CUDA ? "CUDA" : "CPU");
    describe(ctx);
    kvr_context_free(ctx);
    return 0;
}

int main(void) {
    printf("kvreplay %s (header %d.%d.%d)\n", kvr_library_version(), KVR_VERSION_MAJOR, KVR_VERSION_MINOR,
           KVR_VERSION_PATCH);
    printf("kernels: %s\n", kvr_library_build_info());
    int32_t n = 0;
    kvr_status s = kvr_cuda_get_device_count(&n);
    if (s == KVR_STATUS_OK)
        printf("CUDA devices: %d\n", n);
    else
        printf("CUDA devices: none (%s)\n", kvr_error_last_message());
    int rc = 0;
    rc |= try_backend(KVR_BACKEND_CPU, "CPU");
    rc |= try_backend(KVR_BACKEND_CUDA, "CUDA");
    rc |= try_backend(KVR_BACKEND_AUTO, "AUTO");
    return rc;
}
