/* The long-run soak (issue 12 part 4): a KV pool and three GDN pools (a replay pool with
 * KV-only mode, one with the default threshold (off) and a recurrent pool: ring 0, one
 * snapshot per draft; each GDN operation picks one) driven through N random operations on
 * the backend under test, with a mirror of the pools on the CPU backend given the same
 * operations. Every output is compared with the mirror's as it is made; every K operations
 * a checkpoint compares the whole state (KV stats, lengths and a decode of every sequence
 * in every layer; GDN cursors, exported states, conv windows and a materialized prefix);
 * at the end every sequence is freed and the memory must be back where it was (device
 * memory from cuMemGetInfo on CUDA, the process's resident set, the pools' page
 * accounting).
 *
 * Operations: KV add / fork / free / truncate / append / extend + write (all layers at
 * once or layer by layer) / decode (T = 1..3 query tokens, sliding window, softcap, unused
 * rows) / a decode captured once in a CUDA Graph and replayed while its sequences grow;
 * GDN add / free / reset / decode / verify + commit (one layer with its conv window, or
 * every layer) / flush / import / a verify + commit + decode of every layer captured in a
 * CUDA Graph and replayed with the accepted counts in device memory (some outside 0..T:
 * the kernels clamp them), as an engine's spec-decode loop runs. On the CPU backend the
 * graph operations make the same calls directly.
 *
 *   soak [N [cpu|cuda|auto [SEED [K]]]]   N operations (default 1000000), checkpoints
 *                                          every K (default 1000), seed 1
 *
 * cpu: the CPU backend on both sides (runs anywhere); cuda: CUDA against the CPU, or SKIP
 * (exit 0) without a usable GPU unless KVR_REQUIRE_GPU=1; auto (default): CUDA when usable.
 * KVR_SOAK_NO_MEMCHECK=1: memory use is reported, not checked (run-all.sh --sanitize sets it).
 * Deterministic for a seed (a mismatch names the operation's index). Prints one summary
 * line; exits 1 on any mismatch. The driver API is loaded with dlopen: no CUDA headers. */
#include <dlfcn.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pools_common.h"

/* ---- shapes: small, so that the CPU mirror keeps up; CUDA head dims with kernels ---- */
enum {
    KV_LAYERS = 2, KV_HEADS = 2, KV_QHEADS = 4, KV_D = 64, KV_PAGE = 16, KV_PAGES = 96,
    KV_SEQS = 12, KV_MAXLEN = 320, KV_MAXT = 3,
    G_LAYERS = 2, G_HK = 2, G_HV = 4, G_D = 64, G_RING = 8, G_MAXT = 4, G_SEQS = 8,
    G_CONV = 32, G_CK = 4,
    /* GDN pools; pool 0's KV-only threshold: min(dk, the entries one head's state holds) =
     * min(64, 16384 / 516) (the default, which pool 2 takes, is off) */
    G_POOLS = 3, G_KV = 31,
    MAXB = 4
};
static const double KV_TOL = 1e-2, LSE_TOL = 2e-2, GDN_TOL = 2e-3;

/* ---- the CUDA driver, loaded with dlopen ---- */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(int *, int);
    CUresult (*ctx_retain)(void **, int);
    CUresult (*ctx_set)(void *);
    CUresult (*ctx_sync)(void);
    CUresult (*stream_create)(void **, unsigned);
    CUresult (*stream_destroy)(void *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*mem_info)(size_t *, size_t *);
    CUresult (*begin_capture)(void *, int);
    CUresult (*end_capture)(void *, void **);
    CUresult (*instantiate)(void **, void *, unsigned long long);
    CUresult (*launch)(void *, void *);
    CUresult (*exec_destroy)(void *);
    CUresult (*graph_destroy)(void *);
} cu;
static void *g_stream; /* the CUDA side's stream (also its context's default) */

static const char *load_cuda(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return "no libcuda.so.1 (no NVIDIA driver)";
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&cu.init, "cuInit"},
        {(void **)&cu.device_get, "cuDeviceGet"},
        {(void **)&cu.ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.ctx_set, "cuCtxSetCurrent"},
        {(void **)&cu.ctx_sync, "cuCtxSynchronize"},
        {(void **)&cu.stream_create, "cuStreamCreate"},
        {(void **)&cu.stream_destroy, "cuStreamDestroy_v2"},
        {(void **)&cu.mem_alloc, "cuMemAlloc_v2"},
        {(void **)&cu.mem_free, "cuMemFree_v2"},
        {(void **)&cu.htod, "cuMemcpyHtoD_v2"},
        {(void **)&cu.dtoh, "cuMemcpyDtoH_v2"},
        {(void **)&cu.mem_info, "cuMemGetInfo_v2"},
        {(void **)&cu.begin_capture, "cuStreamBeginCapture_v2"},
        {(void **)&cu.end_capture, "cuStreamEndCapture"},
        {(void **)&cu.instantiate, "cuGraphInstantiateWithFlags"},
        {(void **)&cu.launch, "cuGraphLaunch"},
        {(void **)&cu.exec_destroy, "cuGraphExecDestroy"},
        {(void **)&cu.graph_destroy, "cuGraphDestroy"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
        if (!(*syms[i].slot = dlsym(lib, syms[i].name))) return "libcuda.so.1 lacks a driver function";
    int dev;
    void *ctx;
    if (cu.init(0) || cu.device_get(&dev, 0)) return "cuInit failed or no CUDA device 0";
    if (cu.ctx_retain(&ctx, dev) || cu.ctx_set(ctx)) return "cannot make the primary context current";
    if (cu.stream_create(&g_stream, 1 /* non-blocking */)) return "cuStreamCreate failed";
    return NULL;
}

/* ---- failures ---- */
static long g_op = -1;            /* index of the operation running (-1: setup) */
static const char *g_what = "setup"; /* its name */

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "soak: at operation %ld (%s): ", g_op, g_what);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nsoak: FAILED (mismatch; last kvreplay error: %s)\n", kvr_error_last_message());
    exit(1);
}
#define CU_OK(call)                                                                         \
    do {                                                                                    \
        if ((call) != 0) die("%s failed", #call);                                           \
    } while (0)

/* ---- memory: an input arena and an output arena per operation ----
 * The side under test reads its inputs from `dev` (device memory on CUDA, the host arena
 * itself on the CPU) and writes its outputs to `dev` of the output arena (read back into
 * `back`); the mirror reads `host` and writes into `host` of the output arena. */
typedef struct {
    uint8_t *host, *dev, *back;
    size_t cap, used;
} arena_t;
static arena_t IN, OUT;
static int g_cuda;

static void arena_new(arena_t *a, size_t cap, int output) {
    a->cap = cap;
    a->used = 0;
    a->host = calloc(1, cap);
    if (g_cuda) {
        CUdeviceptr p;
        CU_OK(cu.mem_alloc(&p, cap));
        /* Zeroed once: the padding between regions (take) is copied back with the outputs
         * and would otherwise be uninitialized device memory (compute-sanitizer initcheck). */
        CU_OK(cu.htod(p, a->host, cap));
        a->dev = (uint8_t *)(uintptr_t)p;
        a->back = calloc(1, cap);
    } else {
        a->dev = output ? calloc(1, cap) : a->host;
        a->back = a->dev;
    }
    if (!a->host || !a->dev || !a->back) die("out of host memory");
}
static void arena_free(arena_t *a, int output) {
    if (g_cuda) {
        cu.mem_free((CUdeviceptr)(uintptr_t)a->dev);
        free(a->back);
    } else if (output) {
        free(a->dev);
    }
    free(a->host);
}
/* Room for `bytes` (256-byte aligned); returns its offset. */
static size_t take(arena_t *a, size_t bytes) {
    size_t off = a->used;
    a->used += (bytes + 255) & ~(size_t)255;
    if (a->used > a->cap) die("arena too small");
    return off;
}
static float *hostf(const arena_t *a, size_t off) { return (float *)(void *)(a->host + off); }
static float *backf(const arena_t *a, size_t off) { return (float *)(void *)(a->back + off); }

/* Inputs to the device (after the queued work that may still read them). */
static void push_inputs(void) {
    if (!g_cuda || IN.used == 0) return;
    CU_OK(cu.ctx_sync());
    CU_OK(cu.htod((CUdeviceptr)(uintptr_t)IN.dev, IN.host, IN.used));
    CU_OK(cu.ctx_sync());
}
/* The side under test's outputs back to the host (after its queued work). */
static void pull_outputs(void) {
    if (!g_cuda || OUT.used == 0) return;
    CU_OK(cu.ctx_sync());
    CU_OK(cu.dtoh(OUT.back, (CUdeviceptr)(uintptr_t)OUT.dev, OUT.used));
}

/* A tensor over an arena region for side s (0: under test, 1: mirror). */
static kvr_tensor ten(int s, const arena_t *a, size_t off, kvr_dtype dt, int nd, int64_t d0,
                      int64_t d1, int64_t d2, int64_t d3) {
    int64_t shape[4] = {d0, d1, d2, d3};
    kvr_tensor t;
    void *p = (s == 0 ? a->dev : a->host) + off;
    kvr_device_type dev = s == 0 && g_cuda ? KVR_DEVICE_CUDA : KVR_DEVICE_HOST;
    if (kvr_tensor_init(&t, p, dt, dev, nd, shape) != KVR_STATUS_OK) die("tensor_init");
    return t;
}
/* Host i32 ids (both sides read the same host array). */
static kvr_tensor ids_tensor(int32_t *ids, int n) { return t1(ids, KVR_DTYPE_I32, n); }
/* A tensor argument kept in slot `i` (for calls that take several). */
static kvr_tensor g_slots[4];
static const kvr_tensor *tp(int i, kvr_tensor t) {
    g_slots[i] = t;
    return &g_slots[i];
}

/* ---- comparisons ---- */
static double worst_kv, worst_lse, worst_gdn;

static void compare(const float *dut, const float *ref, size_t n, double tol, double *worst,
                    const char *what) {
    double num = 0, den = 1e-3;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)dut[i] - ref[i]);
        if (!(d <= num)) num = d; /* NaN sticks */
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    double e = num / den;
    if (!(e <= tol)) die("%s: relative error %.3e", what, e);
    if (e > *worst) *worst = e;
}
/* An output region of both sides, compared after pull_outputs. */
static void compare_out(size_t off, size_t n, double tol, double *worst, const char *what) {
    compare(backf(&OUT, off), hostf(&OUT, off), n, tol, worst, what);
}
static void lse_compare(size_t off, size_t n) {
    const float *a = backf(&OUT, off), *b = hostf(&OUT, off);
    for (size_t i = 0; i < n; i++) {
        double e = a[i] == b[i] ? 0 : fabs((double)a[i] - b[i]); /* -inf: no visible key */
        if (!(e <= LSE_TOL)) die("%s: absolute error %.3e", "kv lse", e);
        if (e > worst_lse) worst_lse = e;
    }
}

/* ---- the two sides ---- */
typedef struct {
    kvr_context *ctx;
    kvr_kv_pool *kv;
    /* replay pools (ring G_RING) with KV-only mode (0) and without (2), a recurrent one (1,
     * ring 0) */
    kvr_gdn_pool *gdns[G_POOLS];
    kvr_gdn_pool *gdn;     /* the one the current operation uses */
} side_t;
static side_t S[2];
static rng_t R;

/* Both sides' statuses must agree; returns the status. */
static kvr_status agree(const kvr_status st[2]) {
    if (st[0] != st[1]) {
        char msg[160];
        snprintf(msg, sizeof msg, "statuses differ: %s (under test) vs %s (mirror)",
                 kvr_status_string(st[0]), kvr_status_string(st[1]));
        die("%s", msg);
    }
    return st[0];
}
static void expect_ok(const kvr_status st[2]) {
    if (agree(st) != KVR_STATUS_OK) die("%s", kvr_status_string(st[0]));
}
/* A call of one side that must succeed. */
static void side_ok(int s, kvr_status st) {
    if (st != KVR_STATUS_OK) die("%s from the %s", kvr_status_string(st), s ? "mirror" : "side under test");
}
#define BOTH(call)                                                                          \
    do {                                                                                    \
        kvr_status st_[2];                                                                  \
        for (int s = 0; s < 2; s++) st_[s] = (call);                                        \
        expect_ok(st_);                                                                     \
    } while (0)

/* ---- the model: live ids and lengths ---- */
static int32_t kv_live[KV_SEQS], g_lives[G_POOLS][G_SEQS];
static int64_t kv_len[KV_SEQS];
static int n_kv, n_gs[G_POOLS], g_cur;
#define g_live (g_lives[g_cur])
#define n_g (n_gs[g_cur])
/* Makes GDN pool p (0: replay with KV-only mode, 1: recurrent, 2: replay) the current one
 * on both sides. */
static void use_gdn(int p) {
    g_cur = p;
    for (int s = 0; s < 2; s++) S[s].gdn = S[s].gdns[p];
}

static void list_remove(int32_t *list, int *n, int32_t id) {
    for (int i = 0; i < *n; i++)
        if (list[i] == id) {
            list[i] = list[--*n];
            return;
        }
}
/* Up to `want` distinct ids from `list` (shuffled prefix), those passing `ok`. */
static int pick(const int32_t *list, int n, int want, int32_t *out, int (*ok)(int32_t, int),
                int arg) {
    int32_t tmp[KV_SEQS > G_SEQS ? KV_SEQS : G_SEQS];
    int m = 0;
    for (int i = 0; i < n; i++)
        if (!ok || ok(list[i], arg)) tmp[m++] = list[i];
    int k = 0;
    for (; k < want && k < m; k++) {
        int j = k + rng_below(&R, m - k);
        int32_t t = tmp[k];
        tmp[k] = tmp[j];
        tmp[j] = t;
        out[k] = tmp[k];
    }
    return k;
}
static int kv_len_at_least(int32_t id, int t) { return kv_len[id] >= t; }

static void fill(float *x, size_t n, float lo, float hi) { rng_fill(&R, x, n, lo, hi); }

/* ---- statistics ---- */
static int g_verbose; /* KVR_SOAK_VERBOSE=1: the pools' occupancy at every checkpoint */
static long n_ops_kv, n_ops_gdn, n_graphs, n_replays, n_checkpoints, n_exhausted;

/* The outcome of an add or fork on both sides: 1 with one new id, 0 when both refuse for
 * want of a free id (which only a full pool may do). */
static int added(const kvr_status st[2], const int32_t id[2], int live, int max) {
    if (agree(st) != KVR_STATUS_OK) {
        if (st[0] != KVR_STATUS_POOL_EXHAUSTED || live < max) expect_ok(st);
        return 0;
    }
    if (id[0] != id[1]) die("ids differ: %d vs %d", id[0], id[1]);
    return 1;
}

/* ======================= KV pool operations ======================= */
static void kv_add(void) {
    kvr_status st[2];
    int32_t id[2] = {-1, -1};
    for (int s = 0; s < 2; s++) st[s] = kvr_kv_pool_seq_add(S[s].kv, NULL, &id[s]);
    if (!added(st, id, n_kv, KV_SEQS)) return;
    kv_live[n_kv++] = id[0];
    kv_len[id[0]] = 0;
}
static void kv_fork(void) {
    int32_t src, id[2] = {-1, -1};
    if (!pick(kv_live, n_kv, 1, &src, NULL, 0)) return;
    kvr_status st[2];
    for (int s = 0; s < 2; s++) st[s] = kvr_kv_pool_seq_fork(S[s].kv, src, NULL, &id[s]);
    if (!added(st, id, n_kv, KV_SEQS)) return;
    kv_live[n_kv++] = id[0];
    kv_len[id[0]] = kv_len[src];
}
static void kv_free(void) {
    int32_t id;
    if (!pick(kv_live, n_kv, 1, &id, NULL, 0)) return;
    BOTH(kvr_kv_pool_seq_free(S[s].kv, id, NULL));
    list_remove(kv_live, &n_kv, id);
}
static void kv_truncate(void) {
    int32_t id;
    if (!pick(kv_live, n_kv, 1, &id, NULL, 0)) return;
    /* Mostly a rejected speculative tail (1..8 tokens), sometimes anywhere down to 0. */
    int64_t len = kv_len[id] - 1 - rng_below(&R, 8);
    if (len < 0 || rng_below(&R, 8) == 0) len = rng_below(&R, (int)kv_len[id] + 1);
    BOTH(kvr_kv_pool_seq_truncate(S[s].kv, id, len, NULL));
    kv_len[id] = len;
}
/* A status that may legitimately refuse growth: the pool is full or the sequence long. */
static int growth_refused(const kvr_status st[2]) {
    kvr_status s = agree(st);
    if (s == KVR_STATUS_OK) return 0;
    if (s != KVR_STATUS_POOL_EXHAUSTED && s != KVR_STATUS_OUT_OF_RANGE) expect_ok(st);
    n_exhausted++;
    return 1;
}
/* Appends n tokens to `id` (k/v at `koff`/`voff` of the input arena, already pushed). */
static int kv_append_at(int32_t id, int n, size_t koff, size_t voff) {
    kvr_status st[2];
    for (int s = 0; s < 2; s++) {
        kvr_tensor k = ten(s, &IN, koff, KVR_DTYPE_F32, 4, KV_LAYERS, n, KV_HEADS, KV_D);
        kvr_tensor v = ten(s, &IN, voff, KVR_DTYPE_F32, 4, KV_LAYERS, n, KV_HEADS, KV_D);
        st[s] = kvr_kv_pool_append(S[s].kv, id, &k, &v, NULL);
    }
    if (growth_refused(st)) return 0;
    kv_len[id] += n;
    return 1;
}
static void kv_append(void) {
    int32_t id;
    if (!pick(kv_live, n_kv, 1, &id, NULL, 0)) return;
    int n = 1 + rng_below(&R, 16);
    size_t e = (size_t)KV_LAYERS * n * KV_HEADS * KV_D;
    size_t ko = take(&IN, e * 4), vo = take(&IN, e * 4);
    fill(hostf(&IN, ko), e, -1, 1);
    fill(hostf(&IN, vo), e, -1, 1);
    push_inputs();
    kv_append_at(id, n, ko, vo);
}
static void kv_extend_write(void) {
    int32_t ids[3];
    int32_t counts[3];
    int n = pick(kv_live, n_kv, 1 + rng_below(&R, 3), ids, NULL, 0), total = 0;
    if (!n) return;
    for (int i = 0; i < n; i++) total += counts[i] = rng_below(&R, 7);
    kvr_status st[2];
    for (int s = 0; s < 2; s++) st[s] = kvr_kv_pool_extend(S[s].kv, ids, counts, n, NULL);
    if (growth_refused(st)) return;
    for (int i = 0; i < n; i++) kv_len[ids[i]] += counts[i];
    /* Every layer's new positions are written (one call, or layer by layer). */
    size_t e = (size_t)KV_LAYERS * total * KV_HEADS * KV_D;
    size_t ko = take(&IN, e * 4 + 4), vo = take(&IN, e * 4 + 4);
    fill(hostf(&IN, ko), e, -1, 1);
    fill(hostf(&IN, vo), e, -1, 1);
    push_inputs();
    if (rng_below(&R, 2)) {
        BOTH(kvr_kv_pool_write(S[s].kv, KVR_LAYER_ALL, ids, counts, n,
                               tp(0, ten(s, &IN, ko, KVR_DTYPE_F32, 4, KV_LAYERS, total, KV_HEADS, KV_D)),
                               tp(1, ten(s, &IN, vo, KVR_DTYPE_F32, 4, KV_LAYERS, total, KV_HEADS, KV_D)),
                               NULL));
    } else {
        size_t per = (size_t)total * KV_HEADS * KV_D * 4;
        for (int l = 0; l < KV_LAYERS; l++)
            BOTH(kvr_kv_pool_write(S[s].kv, l, ids, counts, n,
                                   tp(0, ten(s, &IN, ko + l * per, KVR_DTYPE_F32, 3, total, KV_HEADS, KV_D, 0)),
                                   tp(1, ten(s, &IN, vo + l * per, KVR_DTYPE_F32, 3, total, KV_HEADS, KV_D, 0)),
                                   NULL));
    }
}

/* One decode on both sides over `ids` (KVR_SEQ_NONE rows allowed) with T query tokens;
 * q at `qo` (pushed); outputs at `oo`/`lo`. `graph`: side 0's call is a graph replay. */
typedef struct {
    int32_t ids[KV_SEQS];
    int b, t, layer, with_lse;
    kvr_kv_decode_params p;
    size_t qo, oo, lo;
} kv_decode_t;

static void kv_decode_call(const kv_decode_t *d, int s) {
    kvr_tensor id = ids_tensor((int32_t *)d->ids, d->b);
    kvr_tensor q = ten(s, &IN, d->qo, KVR_DTYPE_F32, 4, d->b, d->t, KV_QHEADS, KV_D);
    kvr_tensor o = ten(s, &OUT, d->oo, KVR_DTYPE_F32, 4, d->b, d->t, KV_QHEADS, KV_D);
    kvr_tensor l = ten(s, &OUT, d->lo, KVR_DTYPE_F32, 3, d->b, d->t, KV_QHEADS, 0);
    side_ok(s, kvr_kv_pool_decode(S[s].kv, d->layer, &id, &q, &o, d->with_lse ? &l : NULL, &d->p, NULL));
}
static void kv_decode_compare(const kv_decode_t *d) {
    pull_outputs();
    size_t n = (size_t)d->b * d->t * KV_QHEADS;
    compare_out(d->oo, n * KV_D, KV_TOL, &worst_kv, "kv decode output");
    if (d->with_lse) lse_compare(d->lo, n);
}
static void kv_decode_setup(kv_decode_t *d, int max_b, int t) {
    d->t = t;
    d->b = pick(kv_live, n_kv, max_b, d->ids, kv_len_at_least, t);
    if (d->b && d->b < KV_SEQS && rng_below(&R, 4) == 0) {
        int at = rng_below(&R, d->b + 1); /* an unused row */
        for (int i = d->b; i > at; i--) d->ids[i] = d->ids[i - 1];
        d->ids[at] = KVR_SEQ_NONE;
        d->b++;
    }
    d->layer = rng_below(&R, KV_LAYERS);
    d->with_lse = rng_below(&R, 2);
    if (kvr_kv_decode_params_default(&d->p) != KVR_STATUS_OK) die("params");
    int r = rng_below(&R, 6);
    if (r == 0) d->p.window = 1 + rng_below(&R, 40);
    if (r == 1) d->p.softcap = 20.0f;
    size_t n = (size_t)d->b * d->t * KV_QHEADS;
    d->qo = take(&IN, n * KV_D * 4);
    d->oo = take(&OUT, n * KV_D * 4);
    d->lo = take(&OUT, n * 4);
}
static void kv_decode(void) {
    kv_decode_t d;
    kv_decode_setup(&d, MAXB, 1 + rng_below(&R, KV_MAXT));
    if (!d.b) return;
    fill(hostf(&IN, d.qo), (size_t)d.b * d.t * KV_QHEADS * KV_D, -1, 1);
    push_inputs();
    for (int s = 0; s < 2; s++) kv_decode_call(&d, s);
    kv_decode_compare(&d);
}

/* A CUDA Graph: what `f(arg)` queues on the stream, captured and instantiated. */
typedef struct {
    void *graph, *exec;
} graph_t;
static graph_t capture(void (*f)(void *), void *arg) {
    graph_t g = {NULL, NULL};
    CU_OK(cu.ctx_sync());
    CU_OK(cu.begin_capture(g_stream, 1 /* CU_STREAM_CAPTURE_MODE_THREAD_LOCAL */));
    f(arg);
    CU_OK(cu.end_capture(g_stream, &g.graph));
    CU_OK(cu.instantiate(&g.exec, g.graph, 0));
    return g;
}
static void graph_free(graph_t *g) {
    CU_OK(cu.ctx_sync());
    CU_OK(cu.exec_destroy(g->exec));
    CU_OK(cu.graph_destroy(g->graph));
}

static void kv_decode_side0(void *d) { kv_decode_call(d, 0); }

/* A one-token decode captured once, replayed while its sequences grow (and sometimes
 * shrink): the split comes from the lengths on the device. */
static void kv_graph_decode(void) {
    kv_decode_t d;
    kv_decode_setup(&d, MAXB, 1);
    if (!d.b) return;
    size_t e = (size_t)KV_LAYERS * KV_HEADS * KV_D;
    size_t ko = take(&IN, e * 4), vo = take(&IN, e * 4);
    fill(hostf(&IN, d.qo), (size_t)d.b * KV_QHEADS * KV_D, -1, 1);
    push_inputs();
    graph_t g = {NULL, NULL};
    n_graphs++;
    if (g_cuda) g = capture(kv_decode_side0, &d); /* captured, not run */
    int rounds = 2 + rng_below(&R, 5);
    for (int r = 0; r < rounds; r++) {
        fill(hostf(&IN, d.qo), (size_t)d.b * KV_QHEADS * KV_D, -1, 1);
        fill(hostf(&IN, ko), e, -1, 1);
        fill(hostf(&IN, vo), e, -1, 1);
        push_inputs();
        int grown = 1;
        for (int i = 0; i < d.b && grown; i++) {
            if (d.ids[i] == KVR_SEQ_NONE) continue;
            if (rng_below(&R, 5) == 0 && kv_len[d.ids[i]] > 4) {
                int64_t len = kv_len[d.ids[i]] - 1 - rng_below(&R, 3); /* rejected drafts */
                BOTH(kvr_kv_pool_seq_truncate(S[s].kv, d.ids[i], len, NULL));
                kv_len[d.ids[i]] = len;
            } else {
                grown = kv_append_at(d.ids[i], 1, ko, vo);
            }
        }
        if (!grown) break;
        n_replays++;
        if (g_cuda) {
            CU_OK(cu.launch(g.exec, g_stream));
        } else {
            kv_decode_call(&d, 0);
        }
        kv_decode_call(&d, 1);
        kv_decode_compare(&d);
    }
    if (g_cuda) graph_free(&g);
}

/* ======================= GDN pool operations ======================= */
static kvr_gdn_step_params g_step;

static void g_add(void) {
    kvr_status st[2];
    int32_t id[2] = {-1, -1};
    for (int s = 0; s < 2; s++) st[s] = kvr_gdn_pool_seq_add(S[s].gdn, NULL, &id[s]);
    if (!added(st, id, n_g, G_SEQS)) return;
    g_live[n_g++] = id[0];
}
static void g_free(void) {
    int32_t id;
    if (!pick(g_live, n_g, 1, &id, NULL, 0)) return;
    BOTH(kvr_gdn_pool_seq_free(S[s].gdn, id, NULL));
    list_remove(g_live, &n_g, id);
}
static void g_reset(void) {
    int32_t id;
    if (!pick(g_live, n_g, 1, &id, NULL, 0)) return;
    BOTH(kvr_gdn_pool_seq_reset(S[s].gdn, id, NULL));
}

/* Inputs of one step: t tokens (0: a decode, no T dimension) for b rows. */
typedef struct {
    int b, t;
    size_t q, k, v, g, beta, conv, out;
} g_inputs_t;

static void g_inputs_take(g_inputs_t *x, int b, int t) {
    int tt = t ? t : 1;
    x->b = b;
    x->t = t;
    x->q = take(&IN, (size_t)b * tt * G_HK * G_D * 4);
    x->k = take(&IN, (size_t)b * tt * G_HK * G_D * 4);
    x->v = take(&IN, (size_t)b * tt * G_HV * G_D * 4);
    x->g = take(&IN, (size_t)b * tt * G_HV * 4);
    x->beta = take(&IN, (size_t)b * tt * G_HV * 4);
    x->conv = take(&IN, (size_t)b * tt * G_CONV * 4);
    x->out = take(&OUT, (size_t)b * tt * G_HV * G_D * 4);
}
static void g_inputs_fill(const g_inputs_t *x) {
    size_t bt = (size_t)x->b * (x->t ? x->t : 1);
    fill(hostf(&IN, x->q), bt * G_HK * G_D, -1, 1);
    fill(hostf(&IN, x->k), bt * G_HK * G_D, -1, 1);
    fill(hostf(&IN, x->v), bt * G_HV * G_D, -1, 1);
    fill(hostf(&IN, x->g), bt * G_HV, -0.5f, -0.01f);
    fill(hostf(&IN, x->beta), bt * G_HV, 0.05f, 0.95f);
    fill(hostf(&IN, x->conv), bt * G_CONV, -1, 1);
}
/* decode (x->t == 0) or verify of `layer` on side s. */
static kvr_status g_step_call(int s, int layer, int32_t *ids, const g_inputs_t *x) {
    kvr_tensor id = ids_tensor(ids, x->b);
    int b = x->b, t = x->t;
    if (t == 0) {
        kvr_tensor q = ten(s, &IN, x->q, KVR_DTYPE_F32, 3, b, G_HK, G_D, 0),
                   k = ten(s, &IN, x->k, KVR_DTYPE_F32, 3, b, G_HK, G_D, 0),
                   v = ten(s, &IN, x->v, KVR_DTYPE_F32, 3, b, G_HV, G_D, 0),
                   g = ten(s, &IN, x->g, KVR_DTYPE_F32, 2, b, G_HV, 0, 0),
                   be = ten(s, &IN, x->beta, KVR_DTYPE_F32, 2, b, G_HV, 0, 0),
                   c = ten(s, &IN, x->conv, KVR_DTYPE_F32, 2, b, G_CONV, 0, 0),
                   o = ten(s, &OUT, x->out, KVR_DTYPE_F32, 3, b, G_HV, G_D, 0);
        return kvr_gdn_pool_decode(S[s].gdn, layer, &id, &q, &k, &v, &g, &be, &c, &o, &g_step, NULL);
    }
    kvr_tensor q = ten(s, &IN, x->q, KVR_DTYPE_F32, 4, b, t, G_HK, G_D),
               k = ten(s, &IN, x->k, KVR_DTYPE_F32, 4, b, t, G_HK, G_D),
               v = ten(s, &IN, x->v, KVR_DTYPE_F32, 4, b, t, G_HV, G_D),
               g = ten(s, &IN, x->g, KVR_DTYPE_F32, 3, b, t, G_HV, 0),
               be = ten(s, &IN, x->beta, KVR_DTYPE_F32, 3, b, t, G_HV, 0),
               c = ten(s, &IN, x->conv, KVR_DTYPE_F32, 3, b, t, G_CONV, 0),
               o = ten(s, &OUT, x->out, KVR_DTYPE_F32, 4, b, t, G_HV, G_D);
    return kvr_gdn_pool_verify(S[s].gdn, layer, &id, &q, &k, &v, &g, &be, &c, &o, &g_step, NULL);
}
static void g_step_compare(const g_inputs_t *x, const char *what) {
    compare_out(x->out, (size_t)x->b * (x->t ? x->t : 1) * G_HV * G_D, GDN_TOL, &worst_gdn, what);
}
/* Rows for a step: live ids, sometimes with an unused row (decode only). */
static int g_rows(int32_t *ids, int unused_ok) {
    int b = pick(g_live, n_g, 1 + rng_below(&R, MAXB), ids, NULL, 0);
    if (b && unused_ok && b < G_SEQS && rng_below(&R, 4) == 0) ids[b++] = KVR_SEQ_NONE;
    return b;
}

static void g_decode(void) {
    int32_t ids[G_SEQS];
    int b = g_rows(ids, 1);
    if (!b) return;
    g_inputs_t x;
    g_inputs_take(&x, b, 0);
    g_inputs_fill(&x);
    push_inputs();
    int layer = rng_below(&R, G_LAYERS);
    BOTH(g_step_call(s, layer, ids, &x));
    pull_outputs();
    g_step_compare(&x, "gdn decode output");
}

/* Verify T drafts and commit host counts: one layer with its conv window, or every layer
 * (one verify each) committed at once. */
static void g_verify_commit(void) {
    int32_t ids[G_SEQS], acc[G_SEQS];
    int b = g_rows(ids, 0);
    if (!b) return;
    int t = 1 + rng_below(&R, G_MAXT), all = rng_below(&R, 2);
    int l0 = all ? 0 : rng_below(&R, G_LAYERS), l1 = all ? G_LAYERS : l0 + 1;
    g_inputs_t x[G_LAYERS];
    for (int l = l0; l < l1; l++) {
        g_inputs_take(&x[l], b, t);
        g_inputs_fill(&x[l]);
    }
    size_t wo = take(&OUT, (size_t)b * (G_CK - 1) * G_CONV * 4);
    for (int i = 0; i < b; i++) acc[i] = rng_below(&R, t + 1);
    push_inputs();
    for (int l = l0; l < l1; l++) BOTH(g_step_call(s, l, ids, &x[l]));
    kvr_tensor id = ids_tensor(ids, b), a = ids_tensor(acc, b);
    if (all) {
        BOTH(kvr_gdn_pool_commit(S[s].gdn, KVR_LAYER_ALL, &id, &a, NULL, NULL));
    } else {
        BOTH(kvr_gdn_pool_commit(S[s].gdn, l0, &id, &a,
                                 tp(0, ten(s, &OUT, wo, KVR_DTYPE_F32, 3, b, G_CK - 1, G_CONV, 0)),
                                 NULL));
    }
    pull_outputs();
    for (int l = l0; l < l1; l++) g_step_compare(&x[l], "gdn verify output");
    if (!all)
        compare_out(wo, (size_t)b * (G_CK - 1) * G_CONV, GDN_TOL, &worst_gdn, "gdn commit conv window");
}

/* The spec-decode loop of an engine: verify of every layer, commit with the accepted
 * counts in device memory, a decode of every layer; captured once, replayed. */
typedef struct {
    int32_t ids[G_SEQS];
    int b;
    g_inputs_t ver[G_LAYERS], dec[G_LAYERS];
    size_t acc; /* i32 [b] in the input arena */
} g_round_t;

static void g_round_calls(int s, g_round_t *r, const int32_t *host_acc) {
    for (int l = 0; l < G_LAYERS; l++) side_ok(s, g_step_call(s, l, r->ids, &r->ver[l]));
    kvr_tensor id = ids_tensor(r->ids, r->b);
    kvr_tensor a;
    if (host_acc) {
        a = ids_tensor((int32_t *)host_acc, r->b);
    } else {
        a = ten(s, &IN, r->acc, KVR_DTYPE_I32, 1, r->b, 0, 0, 0);
    }
    side_ok(s, kvr_gdn_pool_commit(S[s].gdn, KVR_LAYER_ALL, &id, &a, NULL, NULL));
    for (int l = 0; l < G_LAYERS; l++) side_ok(s, g_step_call(s, l, r->ids, &r->dec[l]));
}
static void g_round_side0_device(void *r) { g_round_calls(0, r, NULL); }

static void g_graph(void) {
    g_round_t r;
    r.b = g_rows(r.ids, 0);
    if (!r.b) return;
    int t = 1 + rng_below(&R, G_MAXT);
    for (int l = 0; l < G_LAYERS; l++) {
        g_inputs_take(&r.ver[l], r.b, t);
        g_inputs_take(&r.dec[l], r.b, 0);
    }
    r.acc = take(&IN, (size_t)r.b * 4);
    graph_t g = {NULL, NULL};
    n_graphs++;
    if (g_cuda) g = capture(g_round_side0_device, &r); /* captured, not run */
    int rounds = 1 + rng_below(&R, 6);
    for (int k = 0; k < rounds; k++) {
        for (int l = 0; l < G_LAYERS; l++) {
            g_inputs_fill(&r.ver[l]);
            g_inputs_fill(&r.dec[l]);
        }
        /* The sampler's counts, on the device; some outside 0..T (clamped there). */
        int32_t *dev_acc = (int32_t *)(void *)(IN.host + r.acc), clamped[G_SEQS];
        for (int i = 0; i < r.b; i++) {
            int a = rng_below(&R, t + 3) - 1;
            dev_acc[i] = a;
            clamped[i] = a < 0 ? 0 : a > t ? t : a;
        }
        push_inputs();
        n_replays++;
        if (g_cuda) {
            CU_OK(cu.launch(g.exec, g_stream));
        } else {
            g_round_calls(0, &r, clamped);
        }
        g_round_calls(1, &r, clamped);
        pull_outputs();
        for (int l = 0; l < G_LAYERS; l++) {
            g_step_compare(&r.ver[l], "gdn graph verify output");
            g_step_compare(&r.dec[l], "gdn graph decode output");
        }
    }
    if (g_cuda) graph_free(&g);
}

static void g_flush(void) {
    int32_t ids[G_SEQS];
    int b = g_rows(ids, 0);
    if (!b) return;
    int layer = rng_below(&R, 3) == 0 ? KVR_LAYER_ALL : rng_below(&R, G_LAYERS);
    kvr_tensor id = ids_tensor(ids, b);
    BOTH(kvr_gdn_pool_flush(S[s].gdn, layer, &id, NULL));
}
static void g_import(void) {
    int32_t id;
    if (!pick(g_live, n_g, 1, &id, NULL, 0)) return;
    int layer = rng_below(&R, G_LAYERS), with_conv = rng_below(&R, 2);
    size_t n = (size_t)G_HV * G_D * G_D, nc = (size_t)(G_CK - 1) * G_CONV;
    size_t so = take(&IN, n * 4), co = take(&IN, nc * 4);
    fill(hostf(&IN, so), n, -0.2f, 0.2f);
    fill(hostf(&IN, co), nc, -1, 1);
    push_inputs();
    BOTH(kvr_gdn_pool_import_state(S[s].gdn, layer, id,
                                   tp(0, ten(s, &IN, so, KVR_DTYPE_F32, 3, G_HV, G_D, G_D, 0)),
                                   with_conv ? tp(1, ten(s, &IN, co, KVR_DTYPE_F32, 2, G_CK - 1, G_CONV, 0, 0))
                                             : NULL,
                                   NULL));
}

/* ======================= checkpoints ======================= */
static void kv_checkpoint(void) {
    kvr_kv_pool_stats st[2];
    for (int s = 0; s < 2; s++) {
        memset(&st[s], 0, sizeof st[s]);
        st[s].struct_size = sizeof st[s];
        side_ok(s, kvr_kv_pool_get_stats(S[s].kv, &st[s]));
    }
    if (memcmp(&st[0], &st[1], sizeof st[0]) != 0) die("kv stats differ");
    if (st[0].sequences != n_kv || st[0].pages_used + st[0].pages_free != st[0].pages_total)
        die("kv stats disagree with the model");
    int64_t tokens = 0;
    for (int i = 0; i < n_kv; i++) {
        int32_t id = kv_live[i];
        tokens += kv_len[id];
        for (int s = 0; s < 2; s++) {
            int64_t len = -1;
            side_ok(s, kvr_kv_pool_get_seq_len(S[s].kv, id, &len));
            if (len != kv_len[id]) die("kv length differs from the model: %.0f", (double)len);
        }
    }
    if (st[0].tokens != tokens) die("kv token count differs from the model: %.0f", (double)st[0].tokens);
    if (g_verbose)
        printf("op %ld: kv %lld seqs, %lld tokens, pages %lld used (%lld shared) %lld free\n", g_op,
               (long long)st[0].sequences, (long long)st[0].tokens, (long long)st[0].pages_used,
               (long long)st[0].pages_shared, (long long)st[0].pages_free);
    /* A decode of every sequence with a token, in every layer. */
    for (int l = 0; l < KV_LAYERS; l++) {
        IN.used = OUT.used = 0;
        kv_decode_t d;
        d.b = 0;
        for (int i = 0; i < n_kv; i++)
            if (kv_len[kv_live[i]] > 0) d.ids[d.b++] = kv_live[i];
        if (!d.b) return;
        d.t = 1;
        d.layer = l;
        d.with_lse = 1;
        if (kvr_kv_decode_params_default(&d.p) != KVR_STATUS_OK) die("params");
        size_t n = (size_t)d.b * KV_QHEADS;
        d.qo = take(&IN, n * KV_D * 4);
        d.oo = take(&OUT, n * KV_D * 4);
        d.lo = take(&OUT, n * 4);
        fill(hostf(&IN, d.qo), n * KV_D, -1, 1);
        push_inputs();
        for (int s = 0; s < 2; s++) kv_decode_call(&d, s);
        kv_decode_compare(&d);
    }
}

static void g_checkpoint(void) {
    size_t n = (size_t)G_HV * G_D * G_D, nc = (size_t)(G_CK - 1) * G_CONV;
    for (int i = 0; i < n_g; i++) {
        int32_t id = g_live[i];
        int min_buf = 1 << 30, all_equal = 1, first = -1;
        for (int l = 0; l < G_LAYERS; l++) {
            kvr_gdn_cursor c[2];
            for (int s = 0; s < 2; s++) side_ok(s, kvr_gdn_pool_get_cursor(S[s].gdn, l, id, &c[s]));
            if (memcmp(&c[0], &c[1], sizeof c[0]) != 0) die("gdn pool %d: cursors differ in layer %d", g_cur, l);
            if (c[0].pending != 0) die("gdn drafts pending at a checkpoint");
            if (g_verbose)
                printf("  gdn pool %d seq %d layer %d: mode %d, ring start %d, buffered %d\n", g_cur, id, l,
                       c[0].mode, c[0].ring_start, c[0].buffered);
            if (c[0].buffered < min_buf) min_buf = c[0].buffered;
            if (first >= 0 && c[0].buffered != first) all_equal = 0;
            first = c[0].buffered;
            IN.used = OUT.used = 0;
            size_t so = take(&OUT, n * 4), co = take(&OUT, nc * 4);
            BOTH(kvr_gdn_pool_export_state(S[s].gdn, l, id,
                                           tp(0, ten(s, &OUT, so, KVR_DTYPE_F32, 3, G_HV, G_D, G_D, 0)),
                                           tp(1, ten(s, &OUT, co, KVR_DTYPE_F32, 2, G_CK - 1, G_CONV, 0, 0)),
                                           NULL));
            pull_outputs();
            compare_out(so, n, GDN_TOL, &worst_gdn, "gdn exported state");
            compare_out(co, nc, GDN_TOL, &worst_gdn, "gdn exported conv window");
        }
        /* Every layer's state at a prefix of what the rings hold (one sequence). */
        if (i == 0) {
            int keep = rng_below(&R, min_buf + 1), conv = all_equal && keep == min_buf;
            IN.used = OUT.used = 0;
            size_t mo = take(&OUT, G_LAYERS * n * 4), mc = take(&OUT, G_LAYERS * nc * 4);
            BOTH(kvr_gdn_pool_materialize(
                S[s].gdn, id, keep, tp(0, ten(s, &OUT, mo, KVR_DTYPE_F32, 4, G_LAYERS, G_HV, G_D, G_D)),
                conv ? tp(1, ten(s, &OUT, mc, KVR_DTYPE_F32, 3, G_LAYERS, G_CK - 1, G_CONV, 0)) : NULL,
                NULL));
            pull_outputs();
            compare_out(mo, G_LAYERS * n, GDN_TOL, &worst_gdn, "gdn materialized state");
            if (conv) compare_out(mc, G_LAYERS * nc, GDN_TOL, &worst_gdn, "gdn materialized conv window");
        }
    }
}

/* ---- memory ---- */
static double rss_mib(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, rss = 0;
    if (!f) return 0;
    if (fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
    fclose(f);
    return rss * 4096.0 / (1024.0 * 1024.0);
}
static double gpu_used_mib(void) {
    size_t free_b = 0, total_b = 0;
    if (!g_cuda) return 0;
    CU_OK(cu.ctx_sync());
    CU_OK(cu.mem_info(&free_b, &total_b));
    return (double)(total_b - free_b) / (1024.0 * 1024.0);
}

/* ---- setup ---- */
static kvr_context *context(int cuda) {
    kvr_context_params p;
    kvr_context *ctx = NULL;
    if (kvr_context_params_default(&p) != KVR_STATUS_OK) die("context params");
    p.backend = cuda ? KVR_BACKEND_CUDA : KVR_BACKEND_CPU;
    p.stream = cuda ? g_stream : NULL;
    p.n_threads = cuda ? 0 : 1;
    if (kvr_context_new(&p, &ctx) != KVR_STATUS_OK) die("kvr_context_new");
    if (cuda && kvr_context_load_kernels(ctx) != KVR_STATUS_OK) die("kvr_context_load_kernels");
    return ctx;
}
static void pools(side_t *s) {
    kvr_kv_pool_params kp;
    if (kvr_kv_pool_params_default(&kp) != KVR_STATUS_OK) die("kv params");
    kp.n_layers = KV_LAYERS;
    kp.n_kv_heads = KV_HEADS;
    kp.head_dim = KV_D;
    kp.page_size = KV_PAGE;
    kp.capacity_pages = KV_PAGES;
    kp.max_seqs = KV_SEQS;
    kp.max_seq_len = KV_MAXLEN;
    if (kvr_kv_pool_new(s->ctx, &kp, &s->kv) != KVR_STATUS_OK) die("kvr_kv_pool_new");
    kvr_gdn_pool_params gp;
    if (kvr_gdn_pool_params_default(&gp) != KVR_STATUS_OK) die("gdn params");
    gp.n_layers = G_LAYERS;
    gp.n_k_heads = G_HK;
    gp.n_v_heads = G_HV;
    gp.dk = G_D;
    gp.dv = G_D;
    gp.ring_len = G_RING;
    gp.max_drafts = G_MAXT;
    gp.max_seqs = G_SEQS;
    gp.conv_dim = G_CONV;
    gp.conv_kernel = G_CK;
    if (kvr_gdn_pool_new(s->ctx, &gp, &s->gdns[2]) != KVR_STATUS_OK) die("kvr_gdn_pool_new");
    gp.kv_only_threshold = G_KV;
    if (kvr_gdn_pool_new(s->ctx, &gp, &s->gdns[0]) != KVR_STATUS_OK) die("kvr_gdn_pool_new (KV-only)");
    gp.kv_only_threshold = KVR_GDN_THRESHOLD_DEFAULT;
    gp.ring_len = 0; /* recurrent: one state snapshot per draft */
    if (kvr_gdn_pool_new(s->ctx, &gp, &s->gdns[1]) != KVR_STATUS_OK) die("kvr_gdn_pool_new (recurrent)");
}

static double now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    long n_ops = argc > 1 ? atol(argv[1]) : 1000000;
    const char *want = argc > 2 ? argv[2] : "auto";
    uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
    long every = argc > 4 ? atol(argv[4]) : 1000;
    if (n_ops < 0 || every < 1 ||
        (strcmp(want, "cpu") != 0 && strcmp(want, "cuda") != 0 && strcmp(want, "auto") != 0)) {
        fprintf(stderr, "usage: soak [N [cpu|cuda|auto [SEED [K]]]]\n");
        return 2;
    }
    if (strcmp(want, "cpu") != 0) {
        const char *why = kvr_library_kernels_compiled() ? load_cuda() : "library built without CUDA kernels";
        if (why && strcmp(want, "cuda") == 0) {
            const char *req = getenv("KVR_REQUIRE_GPU");
            if (req && strcmp(req, "1") == 0) {
                fprintf(stderr, "soak: KVR_REQUIRE_GPU=1 but %s\n", why);
                return 1;
            }
            printf("SKIP soak (cuda): %s\n", why);
            return 0;
        }
        if (why) printf("soak: no usable GPU (%s): the CPU backend on both sides\n", why);
        g_cuda = why == NULL;
    }
    g_verbose = getenv("KVR_SOAK_VERBOSE") && strcmp(getenv("KVR_SOAK_VERBOSE"), "1") == 0;
    R = rng_new(seed);
    S[0].ctx = context(g_cuda);
    S[1].ctx = context(0);
    for (int s = 0; s < 2; s++) pools(&S[s]);
    if (kvr_gdn_step_params_default(&g_step) != KVR_STATUS_OK) die("step params");
    for (int p = 0; p < G_POOLS; p++) {
        kvr_gdn_pool_memory gm[2];
        for (int s = 0; s < 2; s++) {
            memset(&gm[s], 0, sizeof gm[s]);
            gm[s].struct_size = sizeof gm[s];
            side_ok(s, kvr_gdn_pool_get_memory(S[s].gdns[p], &gm[s]));
        }
        if (memcmp(&gm[0], &gm[1], sizeof gm[0]) != 0) die("gdn pool %d: memory differs", p);
        if (gm[0].kv_only_threshold != (p == 0 ? G_KV : 0)) die("gdn pool %d: KV-only threshold", p);
    }
    g_step.l2norm_qk = 1;
    arena_new(&IN, 1 << 20, 0);
    arena_new(&OUT, 1 << 20, 1);

    /* Operation weights (per 1000). */
    static const struct {
        void (*f)(void);
        const char *name;
        int weight, gdn;
    } ops[] = {
        {kv_add, "kv add", 30, 0},          {kv_fork, "kv fork", 30, 0},
        {kv_free, "kv free", 14, 0},        {kv_truncate, "kv truncate", 40, 0},
        {kv_append, "kv append", 110, 0},   {kv_extend_write, "kv extend+write", 80, 0},
        {kv_decode, "kv decode", 100, 0},   {kv_graph_decode, "kv graph decode", 25, 0},
        {g_add, "gdn add", 40, 1},          {g_free, "gdn free", 12, 1},
        {g_reset, "gdn reset", 12, 1},      {g_decode, "gdn decode", 140, 1},
        {g_verify_commit, "gdn verify+commit", 170, 1},
        {g_graph, "gdn graph round", 50, 1}, {g_flush, "gdn flush", 40, 1},
        {g_import, "gdn import", 46, 1},
    };
    int total_w = 0;
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) total_w += ops[i].weight;

    double t0 = now(), gpu0 = 0, rss0 = 0, gpu_peak = 0;
    for (g_op = 0; g_op < n_ops; g_op++) {
        int w = rng_below(&R, total_w);
        size_t i = 0;
        while (w >= ops[i].weight) w -= ops[i++].weight;
        g_what = ops[i].name;
        IN.used = OUT.used = 0;
        if (ops[i].gdn) { /* a quarter on the recurrent pool, the rest on the replay pools */
            int k = rng_below(&R, 8);
            use_gdn(k < 2 ? 1 : k < 5 ? 0 : 2);
        }
        ops[i].f();
        if (ops[i].gdn) n_ops_gdn++; else n_ops_kv++;
        if ((g_op + 1) % every == 0 || g_op + 1 == n_ops) {
            g_what = "checkpoint";
            kv_checkpoint();
            for (int p = 0; p < G_POOLS; p++) use_gdn(p), g_checkpoint();
            n_checkpoints++;
            double gpu = gpu_used_mib();
            if (n_checkpoints == 1) gpu0 = gpu, rss0 = rss_mib();
            if (gpu - gpu0 > gpu_peak) gpu_peak = gpu - gpu0;
        }
    }
    /* The end: every sequence freed, every page back, memory where it was. */
    g_what = "teardown";
    while (n_kv) {
        BOTH(kvr_kv_pool_seq_free(S[s].kv, kv_live[0], NULL));
        list_remove(kv_live, &n_kv, kv_live[0]);
    }
    for (int p = 0; p < G_POOLS; p++)
        for (use_gdn(p); n_g;) {
            BOTH(kvr_gdn_pool_seq_free(S[s].gdn, g_live[0], NULL));
            list_remove(g_live, &n_g, g_live[0]);
        }
    kv_checkpoint();
    kvr_kv_pool_stats end;
    memset(&end, 0, sizeof end);
    end.struct_size = sizeof end;
    if (kvr_kv_pool_get_stats(S[0].kv, &end) != KVR_STATUS_OK || end.pages_used != 0 || end.tokens != 0)
        die("pages still in use after every sequence was freed: %.0f", (double)end.pages_used);
    /* Against the first checkpoint (after the first graphs and launches warmed up). */
    double gpu_delta = n_checkpoints ? gpu_used_mib() - gpu0 : 0;
    double rss_delta = n_checkpoints ? rss_mib() - rss0 : 0;
    double secs = now() - t0;
    for (int s = 0; s < 2; s++) {
        kvr_kv_pool_free(S[s].kv);
        for (int p = 0; p < G_POOLS; p++) kvr_gdn_pool_free(S[s].gdns[p]);
        kvr_context_free(S[s].ctx);
    }
    arena_free(&IN, 0);
    arena_free(&OUT, 1);
    if (g_cuda) cu.stream_destroy(g_stream); /* after the contexts that used it */
    /* MiB: flat, give or take allocator slack. With KVR_SOAK_NO_MEMCHECK=1 the deltas are
     * printed but not checked: cuMemGetInfo counts every process on the device, and under
     * compute-sanitizer the tool's own host memory is in the resident set. */
    const char *nomem = getenv("KVR_SOAK_NO_MEMCHECK");
    int mem_checked = !(nomem && strcmp(nomem, "1") == 0);
    int ok = !mem_checked || (gpu_delta <= 64 && rss_delta <= 128);
    printf("soak %s vs cpu, seed %llu: %ld ops (%ld kv, %ld gdn; %ld graphs, %ld replays%s), %ld checkpoints, "
           "max rel err kv %.2e (lse abs %.2e) gdn %.2e, memory delta gpu %+.1f MiB (peak %+.1f) "
           "rss %+.1f MiB%s, %ld growths refused by a full pool, %.1f s: %s\n",
           g_cuda ? "cuda" : "cpu", (unsigned long long)seed, n_ops, n_ops_kv, n_ops_gdn, n_graphs,
           n_replays, g_cuda ? "" : " as direct calls", n_checkpoints, worst_kv, worst_lse, worst_gdn,
           gpu_delta, gpu_peak, rss_delta, mem_checked ? "" : " (not checked)", n_exhausted, secs,
           ok ? "PASS" : "FAILED (memory grew)");
    return ok ? 0 : 1;
}
