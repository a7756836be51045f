/* Shared by the pool tests (test_pools.c, test_threads.c): a random generator, tensor
 * descriptors over host memory, and small references in C: naive attention over a host
 * copy of a KV pool, and the Gated DeltaNet recurrence in double precision. */
#ifndef KVR_FFI_TESTS_POOLS_COMMON_H
#define KVR_FFI_TESTS_POOLS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvreplay.h"

/* ---- random numbers (xorshift64*, one state per user: thread-safe by construction) ---- */
typedef struct {
    uint64_t s;
} rng_t;

static inline rng_t rng_new(uint64_t seed) {
    rng_t r = {seed * 0x9e3779b97f4a7c15ull + 1};
    return r;
}
static inline uint64_t rng_u64(rng_t *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}
static inline float rng_uniform(rng_t *r, float lo, float hi) {
    return lo + (hi - lo) * (float)((rng_u64(r) >> 40) * (1.0 / 16777216.0));
}
static inline int rng_below(rng_t *r, int n) { return (int)(rng_u64(r) % (uint64_t)n); }
static inline void rng_fill(rng_t *r, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = rng_uniform(r, lo, hi);
}

/* ---- tensors ---- */
/* A contiguous host tensor; `data` may not be NULL. */
static inline kvr_tensor host_tensor(void *data, kvr_dtype dtype, int ndim, const int64_t *shape) {
    kvr_tensor t;
    memset(&t, 0, sizeof t);
    if (kvr_tensor_init(&t, data, dtype, KVR_DEVICE_HOST, ndim, shape) != KVR_STATUS_OK) {
        /* Callers pass valid shapes; a bad one shows up as a refused call later. */
        t.data = data;
        t.dtype = dtype;
        t.ndim = ndim;
    }
    return t;
}
static inline kvr_tensor t1(void *d, kvr_dtype dt, int64_t a) {
    int64_t s[1] = {a};
    return host_tensor(d, dt, 1, s);
}
static inline kvr_tensor t2(void *d, kvr_dtype dt, int64_t a, int64_t b) {
    int64_t s[2] = {a, b};
    return host_tensor(d, dt, 2, s);
}
static inline kvr_tensor t3(void *d, kvr_dtype dt, int64_t a, int64_t b, int64_t c) {
    int64_t s[3] = {a, b, c};
    return host_tensor(d, dt, 3, s);
}
static inline kvr_tensor t4(void *d, kvr_dtype dt, int64_t a, int64_t b, int64_t c, int64_t e) {
    int64_t s[4] = {a, b, c, e};
    return host_tensor(d, dt, 4, s);
}

static inline kvr_context *cpu_context(int threads) {
    kvr_context_params p;
    kvr_context *ctx = NULL;
    if (kvr_context_params_default(&p) != KVR_STATUS_OK) return NULL;
    p.backend = KVR_BACKEND_CPU;
    p.n_threads = threads;
    if (kvr_context_new(&p, &ctx) != KVR_STATUS_OK) return NULL;
    return ctx;
}

/* Largest |a - b| over n values, relative to the largest |b| (at least 1e-3). */
static inline double rel_err_f(const float *a, const double *b, size_t n) {
    double num = 0, den = 1e-3;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= num)) num = d; /* NaN sticks */
        if (fabs(b[i]) > den) den = fabs(b[i]);
    }
    return num / den;
}

/* ---- naive attention ----
 * One query head `q` (d values) against `n` keys/values of one KV head, rows `kv_stride`
 * floats apart, keys first..n-1 visible; scale, optional softcap; returns the output in
 * `out` and the log-sum-exp of the scaled (capped) scores. */
static inline double attention_ref(const float *q, const float *k, const float *v, size_t kv_stride,
                                   int first, int n, int d, double scale, double softcap,
                                   double *out) {
    double m = -INFINITY, sum = 0;
    for (int i = 0; i < d; i++) out[i] = 0;
    for (int t = first; t < n; t++) {
        double s = 0;
        for (int i = 0; i < d; i++) s += (double)q[i] * k[t * kv_stride + i];
        s *= scale;
        if (softcap > 0) s = softcap * tanh(s / softcap);
        if (s > m) m = s;
    }
    for (int t = first; t < n; t++) {
        double s = 0;
        for (int i = 0; i < d; i++) s += (double)q[i] * k[t * kv_stride + i];
        s *= scale;
        if (softcap > 0) s = softcap * tanh(s / softcap);
        double p = exp(s - m);
        sum += p;
        for (int i = 0; i < d; i++) out[i] += p * v[t * kv_stride + i];
    }
    for (int i = 0; i < d; i++) out[i] /= sum;
    return m + log(sum);
}

/* ---- Gated DeltaNet recurrence (f64) ----
 * One value head's state S as a dv x dk matrix, row-major [dv][dk]. One token: q and k
 * are L2-normalized (x / sqrt(sum x^2 + 1e-6), as flash-linear-attention), q scaled;
 * S <- e^g S; u = beta (v - S k); S <- S + u k^T; y = S q. */
static inline void gdn_ref_step(double *S, int dk, int dv, const float *q_in, const float *k_in,
                                const float *v, float g, float beta, double scale, double *y) {
    double q[256], k[256], nq = 1e-6, nk = 1e-6;
    for (int i = 0; i < dk; i++) nq += (double)q_in[i] * q_in[i], nk += (double)k_in[i] * k_in[i];
    for (int i = 0; i < dk; i++) q[i] = q_in[i] / sqrt(nq) * scale, k[i] = k_in[i] / sqrt(nk);
    double a = exp((double)g);
    for (int i = 0; i < dk * dv; i++) S[i] *= a;
    for (int r = 0; r < dv; r++) {
        double sk = 0;
        for (int c = 0; c < dk; c++) sk += S[r * dk + c] * k[c];
        double u = beta * (v[r] - sk);
        for (int c = 0; c < dk; c++) S[r * dk + c] += u * k[c];
    }
    for (int r = 0; r < dv; r++) {
        double acc = 0;
        for (int c = 0; c < dk; c++) acc += S[r * dk + c] * q[c];
        y[r] = acc;
    }
}

#endif
