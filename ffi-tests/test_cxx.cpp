// The header from C++: included twice (include guard), extern "C" linkage, and
// [[nodiscard]] on status-returning functions.
#include "kvreplay.h"
#include "kvreplay.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace {

struct ContextDeleter {
    void operator()(kvr_context *c) const { kvr_context_free(c); }
};
using ContextPtr = std::unique_ptr<kvr_context, ContextDeleter>;

int failures = 0;

void check(bool ok, const char *what) {
    if (!ok) {
        std::fprintf(stderr, "test_cxx: %s failed (%s)\n", what, kvr_error_last_message());
        ++failures;
    }
}

}  // namespace

int main() {
    kvr_context_params p{};
    check(kvr_context_params_default(&p) == KVR_STATUS_OK, "params_default");
    p.backend = KVR_BACKEND_CPU;
    kvr_context *raw = nullptr;
    check(kvr_context_new(&p, &raw) == KVR_STATUS_OK, "context_new");
    ContextPtr ctx(raw);

    std::vector<float> src(256), back(256);
    std::vector<uint16_t> half(256);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.25f - 3.0f;
    int64_t shape[1] = {256};
    kvr_tensor a{}, h{}, b{};
    check(kvr_tensor_init(&a, src.data(), KVR_DTYPE_F32, KVR_DEVICE_HOST, 1, shape) == KVR_STATUS_OK, "init a");
    check(kvr_tensor_init(&h, half.data(), KVR_DTYPE_F16, KVR_DEVICE_HOST, 1, shape) == KVR_STATUS_OK, "init h");
    check(kvr_tensor_init(&b, back.data(), KVR_DTYPE_F32, KVR_DEVICE_HOST, 1, shape) == KVR_STATUS_OK, "init b");
    check(kvr_tensor_copy(ctx.get(), &a, &h, nullptr) == KVR_STATUS_OK, "copy f32->f16");
    check(kvr_tensor_copy(ctx.get(), &h, &b, nullptr) == KVR_STATUS_OK, "copy f16->f32");
    check(std::memcmp(src.data(), back.data(), src.size() * sizeof(float)) == 0,
          "round trip of f16-exact values");
    if (failures) return 1;
    std::printf("test_cxx: ok (kvreplay %s)\n", kvr_library_version());
    return 0;
}
