/* The C API from C: version, contexts, error paths (NULL everywhere, bad enum values,
 * struct_size too small, freeing NULL and freeing twice), and a strided f32 -> bf16 copy
 * on the CPU backend checked element by element. Built against the static library, the
 * shared library, and with AddressSanitizer + UndefinedBehaviorSanitizer. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "check.h"

/* Named values are single constant expressions of their own typedef: usable in
 * _Static_assert, case labels and under sizeof without surprises. */
_Static_assert(KVR_LAYER_ALL == -1, "KVR_LAYER_ALL");
_Static_assert(KVR_GDN_THRESHOLD_DEFAULT == -1 && KVR_GDN_THRESHOLD_OFF == 0, "thresholds");
_Static_assert(sizeof KVR_STATUS_NULL_ARG == sizeof(kvr_status), "one expression");
_Static_assert(-KVR_LAYER_ALL == 1 && 2 - KVR_STATUS_NULL_ARG == 3, "negative values");
_Static_assert(KVR_MODEL_LAYOUT_CONTIGUOUS_SNAPSHOTS + 1 == KVR_MODEL_LAYOUT_COUNT, "layouts");

static const char *mode_name(kvr_gdn_mode m) {
    switch (m) {
    case KVR_GDN_MODE_KV_ONLY: return "kv-only";
    case KVR_GDN_MODE_REPLAY: return "replay";
    case KVR_GDN_MODE_RECURRENT: return "recurrent";
    default: return "?";
    }
}

static void test_version(void) {
    CHECK(strcmp(mode_name(KVR_GDN_MODE_REPLAY), "replay") == 0);
    char expected[64];
    snprintf(expected, sizeof expected, "%d.%d.%d", KVR_VERSION_MAJOR, KVR_VERSION_MINOR,
             KVR_VERSION_PATCH);
    CHECK(strcmp(kvr_library_version(), expected) == 0);
    CHECK(KVR_VERSION_NUMBER == KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 +
                                    KVR_VERSION_PATCH);
    CHECK(kvr_library_build_info() != NULL && strlen(kvr_library_build_info()) > 0);
}

static void test_status_strings(void) {
    kvr_status all[] = {KVR_STATUS_OK,          KVR_STATUS_NULL_ARG,
                        KVR_STATUS_INVALID_ARG, KVR_STATUS_OUT_OF_MEMORY,
                        KVR_STATUS_CUDA_UNAVAILABLE, KVR_STATUS_NOT_COMPILED,
                        KVR_STATUS_CUDA_ERROR,  KVR_STATUS_UNSUPPORTED,
                        KVR_STATUS_PANIC,       KVR_STATUS_DTYPE_MISMATCH,
                        KVR_STATUS_OUT_OF_RANGE, KVR_STATUS_UNKNOWN_ID,
                        KVR_STATUS_POOL_EXHAUSTED, KVR_STATUS_IO_ERROR,
                        KVR_STATUS_MALFORMED_FILE};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) {
        CHECK(kvr_status_string(all[i]) != NULL);
        CHECK(strcmp(kvr_status_string(all[i]), "unknown status") != 0);
    }
    CHECK(strcmp(kvr_status_string(12345), "unknown status") == 0);
    CHECK(strcmp(kvr_status_string(-12345), "unknown status") == 0);
}

static void test_context_errors(void) {
    kvr_context_params p;
    kvr_context *ctx = (kvr_context *)(uintptr_t)0x1111;

    CHECK_STATUS(kvr_context_params_default(NULL), KVR_STATUS_NULL_ARG);
    CHECK(strlen(kvr_error_last_message()) > 0);
    CHECK_STATUS(kvr_context_params_default(&p), KVR_STATUS_OK);
    CHECK(p.struct_size == sizeof p);
    CHECK(p.backend == KVR_BACKEND_AUTO);

    CHECK_STATUS(kvr_context_new(&p, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_context_new(NULL, NULL), KVR_STATUS_NULL_ARG);

    p.backend = 42; /* bad enum value */
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_INVALID_ARG);
    CHECK(ctx == (kvr_context *)(uintptr_t)0x1111); /* out untouched on failure */
    p.backend = -5;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_INVALID_ARG);
    p.backend = KVR_BACKEND_CPU;
    p.n_threads = -1;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_INVALID_ARG);
    p.n_threads = 0;
    p.device = -3;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_INVALID_ARG);
    p.device = 0;
    p.struct_size = 8; /* too small */
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_INVALID_ARG);
    CHECK(strstr(kvr_error_last_message(), "struct_size") != NULL);
    p.struct_size = 0;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_INVALID_ARG);
    CHECK(ctx == (kvr_context *)(uintptr_t)0x1111);

    /* Free of NULL is a no-op; freeing twice is detected, not a crash. */
    kvr_context_free(NULL);
    CHECK_STATUS(kvr_context_params_default(&p), KVR_STATUS_OK);
    p.backend = KVR_BACKEND_CPU;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_OK);
    CHECK(kvr_context_get_backend(ctx) == KVR_BACKEND_CPU);
    kvr_context_free(ctx);
    kvr_context_free(ctx);
    CHECK(strstr(kvr_error_last_message(), "freed twice") != NULL);
    CHECK(kvr_context_get_backend(ctx) == KVR_BACKEND_INVALID);
    CHECK(kvr_context_get_backend(NULL) == KVR_BACKEND_INVALID);
    CHECK_STATUS(kvr_context_load_kernels(NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_context_synchronize(NULL, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_cuda_get_device_count(NULL), KVR_STATUS_NULL_ARG);
}

static void test_auto_and_cuda(void) {
    int32_t n = -1;
    kvr_status s = kvr_cuda_get_device_count(&n);
    kvr_context_params p;
    kvr_context *ctx = NULL;
    CHECK_STATUS(kvr_context_params_default(&p), KVR_STATUS_OK);
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_OK); /* AUTO never fails here */
    kvr_backend b = kvr_context_get_backend(ctx);
    CHECK(b == KVR_BACKEND_CPU || b == KVR_BACKEND_CUDA);
    kvr_context_free(ctx);
    ctx = NULL;
    p.backend = KVR_BACKEND_CUDA;
    kvr_status c = kvr_context_new(&p, &ctx);
    if (!kvr_library_kernels_compiled()) {
        CHECK(c == KVR_STATUS_NOT_COMPILED);
    } else if (s != KVR_STATUS_OK || n == 0) {
        CHECK(c == KVR_STATUS_CUDA_UNAVAILABLE);
        CHECK(ctx == NULL);
        CHECK(b == KVR_BACKEND_CPU);
        printf("no CUDA here: %s\n", kvr_error_last_message());
    } else {
        CHECK(c == KVR_STATUS_OK);
        CHECK(kvr_context_get_backend(ctx) == KVR_BACKEND_CUDA);
        kvr_context_free(ctx);
    }
}

static uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void test_cpu_copy(void) {
    kvr_context_params p;
    kvr_context *ctx = NULL;
    CHECK_STATUS(kvr_context_params_default(&p), KVR_STATUS_OK);
    p.backend = KVR_BACKEND_CPU;
    p.n_threads = 2;
    CHECK_STATUS(kvr_context_new(&p, &ctx), KVR_STATUS_OK);

    kvr_device_info info;
    memset(&info, 0, sizeof info);
    CHECK_STATUS(kvr_context_get_device_info(ctx, &info), KVR_STATUS_INVALID_ARG);
    info.struct_size = sizeof info;
    CHECK_STATUS(kvr_context_get_device_info(ctx, &info), KVR_STATUS_OK);
    CHECK(info.backend == KVR_BACKEND_CPU && info.multiprocessor_count == 2);

    /* Transpose a 6 x 10 f32 matrix into a bf16 matrix with padded rows. */
    enum { R = 6, C = 10, LD = 12 };
    float src[R * C];
    uint16_t dst[C * LD];
    for (int i = 0; i < R * C; ++i) src[i] = sinf((float)i) * 3.0f;
    for (int i = 0; i < C * LD; ++i) dst[i] = 0xbeef;
    kvr_tensor s, d;
    int64_t shape[2] = {C, R};
    CHECK_STATUS(kvr_tensor_init(&s, src, KVR_DTYPE_F32, KVR_DEVICE_HOST, 2, shape), KVR_STATUS_OK);
    s.strides[0] = 1; /* column of the source */
    s.strides[1] = C;
    CHECK_STATUS(kvr_tensor_init(&d, dst, KVR_DTYPE_BF16, KVR_DEVICE_HOST, 2, shape), KVR_STATUS_OK);
    d.strides[0] = LD;
    CHECK_STATUS(kvr_tensor_copy(ctx, &s, &d, NULL), KVR_STATUS_OK);
    int bad = 0;
    for (int c = 0; c < C; ++c)
        for (int j = 0; j < LD; ++j) {
            uint16_t want = j < R ? bf16_rne(src[j * C + c]) : 0xbeef;
            if (dst[c * LD + j] != want) ++bad;
        }
    CHECK(bad == 0);

    /* Bad tensors: each a status, destination untouched. */
    kvr_tensor t = s;
    t.dtype = 99;
    CHECK_STATUS(kvr_tensor_copy(ctx, &t, &d, NULL), KVR_STATUS_INVALID_ARG);
    t = s;
    t.device = KVR_DEVICE_CUDA;
    CHECK_STATUS(kvr_tensor_copy(ctx, &t, &d, NULL), KVR_STATUS_INVALID_ARG);
    t = s;
    t.ndim = KVR_MAX_DIMS + 1;
    CHECK_STATUS(kvr_tensor_copy(ctx, &t, &d, NULL), KVR_STATUS_INVALID_ARG);
    t = s;
    t.data = NULL;
    CHECK_STATUS(kvr_tensor_copy(ctx, &t, &d, NULL), KVR_STATUS_NULL_ARG);
    t = d;
    t.strides[0] = 1; /* rows overlap */
    CHECK_STATUS(kvr_tensor_copy(ctx, &s, &t, NULL), KVR_STATUS_INVALID_ARG);
    t = d;
    t.shape[1] = R + 1;
    CHECK_STATUS(kvr_tensor_copy(ctx, &s, &t, NULL), KVR_STATUS_INVALID_ARG);
    CHECK_STATUS(kvr_tensor_copy(ctx, NULL, &d, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_tensor_copy(ctx, &s, NULL, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_tensor_copy(NULL, &s, &d, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_tensor_init(NULL, src, KVR_DTYPE_F32, KVR_DEVICE_HOST, 2, shape),
                 KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_tensor_init(&t, src, KVR_DTYPE_F32, 7, 2, shape), KVR_STATUS_INVALID_ARG);
    bad = 0;
    for (int c = 0; c < C; ++c)
        for (int j = 0; j < LD; ++j) {
            uint16_t want = j < R ? bf16_rne(src[j * C + c]) : 0xbeef;
            if (dst[c * LD + j] != want) ++bad;
        }
    CHECK(bad == 0);
    kvr_context_free(ctx);
    CHECK_STATUS(kvr_tensor_copy(ctx, &s, &d, NULL), KVR_STATUS_INVALID_ARG);
}

int main(void) {
    test_version();
    test_status_strings();
    test_context_errors();
    test_auto_and_cuda();
    test_cpu_copy();
    return finish("test_api");
}
