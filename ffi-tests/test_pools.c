/* The KV pool and the GDN pool from C, on the CPU backend: every exported pool function,
 * valid calls checked against small references in C (naive attention for KV decode; for
 * GDN a replay pool and a recurrent pool against an f64 recurrence), and every error path
 * (NULL, struct_size too small / larger with a non-zero tail, unknown ids, stale and
 * foreign handles, exhausted pools, wrong dtypes / shapes / strides / memory kinds / layers),
 * each checked to leave the pool as it was: stats, lengths, block tables, cursors, exported
 * states, untouched outputs, and the outputs of the next valid call. Built -Werror, run
 * plain, under ASan + UBSan and under valgrind (scripts/test.sh). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "pools_common.h"

#define SENTINEL_F (-12345.0f)
/* The address of a call's result (C takes the address of lvalues only). */
#define TREF(expr) (&(kvr_tensor[1]){expr}[0])
#define GREF(expr) (&(gdn_t[1]){expr}[0])
#define STALE_KV ((kvr_kv_pool *)(uintptr_t)0x5550)
#define STALE_GDN ((kvr_gdn_pool *)(uintptr_t)0x5560)

/* The message of the last expected failure (the snapshot after it makes calls of its own). */
static char g_msg[512];

static int all_equal(const float *x, size_t n, float v) {
    for (size_t i = 0; i < n; i++)
        if (x[i] != v && !(isnan(x[i]) && isnan(v))) return 0;
    return 1;
}
static void fill(float *x, size_t n, float v) {
    for (size_t i = 0; i < n; i++) x[i] = v;
}

/* A struct_size larger than the library's, with a zero or a non-zero tail: the caller's
 * struct copied into a bigger zeroed buffer. */
typedef struct {
    uint64_t words[64];
} bigger_t;
static void *newer_struct(bigger_t *b, const void *p, size_t size, int nonzero_tail) {
    memset(b, 0, sizeof *b);
    memcpy(b, p, size);
    uint32_t declared = (uint32_t)(size + 24);
    memcpy(b, &declared, sizeof declared);
    if (nonzero_tail) ((unsigned char *)b)[size + 17] = 1;
    return b;
}

/* =============================== KV pool =============================== */

enum { L = 2, HKV = 2, HQ = 4, D = 8, PAGE = 4, PAGES = 10, MAXS = 4, MAXLEN = 32 };

/* Host copy of every sequence's K and V: [seq][layer][token][head][dim]. */
static float RK[MAXS][L][MAXLEN][HKV][D], RV[MAXS][L][MAXLEN][HKV][D];
static int64_t RLEN[MAXS];

static kvr_kv_pool_params kv_params(void) {
    kvr_kv_pool_params p;
    memset(&p, 0, sizeof p);
    CHECK_STATUS(kvr_kv_pool_params_default(&p), KVR_STATUS_OK);
    p.n_layers = L;
    p.n_kv_heads = HKV;
    p.head_dim = D;
    p.page_size = PAGE;
    p.capacity_pages = PAGES;
    p.dtype = KVR_DTYPE_F32;
    p.max_seqs = MAXS;
    p.max_seq_len = MAXLEN;
    return p;
}

typedef struct {
    kvr_kv_pool_stats st;
    int64_t len[MAXS];
    int64_t count[MAXS];
    int32_t pages[MAXS][PAGES];
} kv_snap;

static void kv_snapshot(const kvr_kv_pool *pool, kv_snap *s) {
    memset(s, 0, sizeof *s);
    s->st.struct_size = sizeof s->st;
    if (kvr_kv_pool_get_stats(pool, &s->st) != KVR_STATUS_OK) s->st.pages_total = -1;
    for (int i = 0; i < MAXS; i++) {
        s->len[i] = -1;
        s->count[i] = -1;
        if (kvr_kv_pool_get_seq_len(pool, i, &s->len[i]) == KVR_STATUS_OK &&
            kvr_kv_pool_get_seq_pages(pool, i, s->pages[i], PAGES, &s->count[i]) != KVR_STATUS_OK)
            s->count[i] = -2;
    }
}

/* Expects `expr` to fail with `want` and leave the pool as in `snap`. */
#define KV_FAILS(pool, snap, expr, want)                                   \
    do {                                                                   \
        CHECK_STATUS(expr, want);                                          \
        snprintf(g_msg, sizeof g_msg, "%s", kvr_error_last_message());     \
        kv_snap now_;                                                      \
        kv_snapshot(pool, &now_);                                          \
        CHECK(memcmp(&now_, snap, sizeof now_) == 0);                      \
    } while (0)

/* Appends n random tokens to `seq` (all layers) and records them. */
static kvr_status kv_append(kvr_kv_pool *pool, int seq, int n, rng_t *r) {
    static float k[L][MAXLEN][HKV][D], v[L][MAXLEN][HKV][D];
    rng_fill(r, &k[0][0][0][0], sizeof k / 4, -1, 1);
    rng_fill(r, &v[0][0][0][0], sizeof v / 4, -1, 1);
    /* A strided source: [L][n][HKV][D] rows of the MAXLEN-long buffers. */
    kvr_tensor tk = t4(k, KVR_DTYPE_F32, L, n, HKV, D), tv = t4(v, KVR_DTYPE_F32, L, n, HKV, D);
    tk.strides[0] = tv.strides[0] = MAXLEN * HKV * D;
    kvr_status s = kvr_kv_pool_append(pool, seq, &tk, &tv, NULL);
    if (s == KVR_STATUS_OK) {
        for (int l = 0; l < L; l++)
            for (int t = 0; t < n; t++) {
                memcpy(RK[seq][l][RLEN[seq] + t], k[l][t], sizeof k[l][t]);
                memcpy(RV[seq][l][RLEN[seq] + t], v[l][t], sizeof v[l][t]);
            }
        RLEN[seq] += n;
    }
    return s;
}

/* Extends two sequences in one call, then writes layer 0 per layer and layer 1 through a
 * transposed (strided) source. */
static void kv_extend_write(kvr_kv_pool *pool, int a, int na, int b, int nb, rng_t *r) {
    int32_t seqs[2] = {a, b}, counts[2] = {na, nb};
    CHECK_STATUS(kvr_kv_pool_extend(pool, seqs, counts, 2, NULL), KVR_STATUS_OK);
    int n = na + nb;
    float k[MAXLEN][HKV][D], v[MAXLEN][HKV][D], kt[D][HKV][MAXLEN];
    for (int l = 0; l < L; l++) {
        rng_fill(r, &k[0][0][0], sizeof k / 4, -1, 1);
        rng_fill(r, &v[0][0][0], sizeof v / 4, -1, 1);
        kvr_tensor tk = t3(k, KVR_DTYPE_F32, n, HKV, D), tv = t3(v, KVR_DTYPE_F32, n, HKV, D);
        if (l == 1) { /* K given as [D][HKV][tokens] memory, described as [tokens][HKV][D] */
            for (int t = 0; t < n; t++)
                for (int h = 0; h < HKV; h++)
                    for (int d = 0; d < D; d++) kt[d][h][t] = k[t][h][d];
            tk.data = kt;
            tk.strides[0] = 1;
            tk.strides[1] = MAXLEN;
            tk.strides[2] = HKV * MAXLEN;
        }
        CHECK_STATUS(kvr_kv_pool_write(pool, l, seqs, counts, 2, &tk, &tv, NULL), KVR_STATUS_OK);
        for (int t = 0; t < n; t++) {
            int s = t < na ? a : b, pos = t < na ? (int)RLEN[a] + t : (int)RLEN[b] + t - na;
            memcpy(RK[s][l][pos], k[t], sizeof k[t]);
            memcpy(RV[s][l][pos], v[t], sizeof v[t]);
        }
    }
    RLEN[a] += na;
    RLEN[b] += nb;
}

/* Decodes T query tokens for the listed sequences (KVR_SEQ_NONE rows allowed) in `layer`
 * and returns the largest relative error against naive attention (outputs and lse). */
static double kv_decode_check(kvr_kv_pool *pool, const int32_t *ids, int b, int T, int layer,
                              float scale, float softcap, int window, rng_t *r) {
    enum { NMAX = MAXS * 8 * HQ * D };
    float q[NMAX], out[NMAX], lse[MAXS * 8 * HQ];
    int32_t idv[MAXS];
    memcpy(idv, ids, (size_t)b * 4);
    rng_fill(r, q, (size_t)b * T * HQ * D, -1, 1);
    fill(out, NMAX, SENTINEL_F);
    kvr_tensor tid = t1(idv, KVR_DTYPE_I32, b);
    kvr_tensor tq = T == 1 ? t3(q, KVR_DTYPE_F32, b, HQ, D) : t4(q, KVR_DTYPE_F32, b, T, HQ, D);
    kvr_tensor to = T == 1 ? t3(out, KVR_DTYPE_F32, b, HQ, D) : t4(out, KVR_DTYPE_F32, b, T, HQ, D);
    kvr_tensor tl = T == 1 ? t2(lse, KVR_DTYPE_F32, b, HQ) : t3(lse, KVR_DTYPE_F32, b, T, HQ);
    kvr_kv_decode_params dp;
    CHECK_STATUS(kvr_kv_decode_params_default(&dp), KVR_STATUS_OK);
    dp.scale = scale;
    dp.softcap = softcap;
    dp.window = window;
    int defaults = scale == 0 && softcap == 0 && window == 0;
    CHECK_STATUS(kvr_kv_pool_decode(pool, layer, &tid, &tq, &to, &tl, defaults ? NULL : &dp, NULL),
                 KVR_STATUS_OK);
    double worst = 0, ref[D];
    double sc = scale != 0 ? scale : 1.0 / sqrt((double)D);
    for (int i = 0; i < b; i++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < HQ; h++) {
                size_t o = (((size_t)i * T + t) * HQ + h);
                if (ids[i] < 0) {
                    for (int d = 0; d < D; d++) worst = fmax(worst, fabs(out[o * D + d]));
                    continue;
                }
                int s = ids[i], kh = h / (HQ / HKV);
                int n = (int)RLEN[s] - (T - 1 - t); /* causal among the T queries */
                int first = window > 0 && n - window > 0 ? n - window : 0;
                double l = attention_ref(q + o * D, &RK[s][layer][0][kh][0], &RV[s][layer][0][kh][0],
                                         HKV * D, first, n, D, sc, softcap, ref);
                worst = fmax(worst, rel_err_f(out + o * D, ref, D));
                worst = fmax(worst, fabs(lse[o] - l) / fmax(1.0, fabs(l)));
            }
    return worst;
}

static double kv_decode_all(kvr_kv_pool *pool, rng_t *r) {
    int32_t ids[MAXS];
    int b = 0;
    for (int i = 0; i < MAXS; i++) {
        int64_t n;
        if (kvr_kv_pool_get_seq_len(pool, i, &n) == KVR_STATUS_OK && n > 0) ids[b++] = i;
    }
    double e = 0;
    for (int layer = 0; layer < L; layer++) e = fmax(e, kv_decode_check(pool, ids, b, 1, layer, 0, 0, 0, r));
    return e;
}

static void test_kv_params_and_new(kvr_context *ctx) {
    kvr_kv_pool *pool = STALE_KV;
    kvr_kv_pool_params p = kv_params();
    CHECK_STATUS(kvr_kv_pool_params_default(NULL), KVR_STATUS_NULL_ARG);
    CHECK(p.struct_size == sizeof p);
    CHECK_STATUS(kvr_kv_pool_new(NULL, &p, &pool), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_kv_pool_new(ctx, NULL, &pool), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_kv_pool_new((kvr_context *)(uintptr_t)0x70, &p, &pool), KVR_STATUS_INVALID_ARG);
    struct {
        const char *what;
        kvr_kv_pool_params p;
        kvr_status want;
    } bad[16];
    int n = 0;
#define BAD(field, value, status)                                   \
    do {                                                            \
        bad[n].what = #field " = " #value;                          \
        bad[n].p = kv_params();                                     \
        bad[n].p.field = value;                                     \
        bad[n++].want = status;                                     \
    } while (0)
    BAD(struct_size, 8, KVR_STATUS_INVALID_ARG);
    BAD(struct_size, 0, KVR_STATUS_INVALID_ARG);
    BAD(n_layers, 0, KVR_STATUS_INVALID_ARG);
    BAD(n_kv_heads, -2, KVR_STATUS_INVALID_ARG);
    BAD(head_dim, 0, KVR_STATUS_INVALID_ARG);
    BAD(page_size, 0, KVR_STATUS_INVALID_ARG);
    BAD(dtype, 9, KVR_STATUS_INVALID_ARG);
    BAD(dtype, KVR_DTYPE_I32, KVR_STATUS_DTYPE_MISMATCH);
    BAD(capacity_pages, 0, KVR_STATUS_INVALID_ARG);      /* neither capacity */
    BAD(capacity_bytes, 4096, KVR_STATUS_INVALID_ARG);   /* both */
    BAD(max_seqs, 0, KVR_STATUS_INVALID_ARG);
    BAD(max_seq_len, -1, KVR_STATUS_INVALID_ARG);
#undef BAD
    for (int i = 0; i < n; i++) {
        kvr_status s = kvr_kv_pool_new(ctx, &bad[i].p, &pool);
        if (s != bad[i].want)
            fprintf(stderr, "kv_pool_new with %s: %d (%s)\n", bad[i].what, (int)s, kvr_error_last_message());
        CHECK(s == bad[i].want);
        CHECK(pool == STALE_KV);
    }
    /* A capacity in bytes smaller than one page. */
    p.capacity_pages = 0;
    p.capacity_bytes = 16;
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_OUT_OF_RANGE);
    /* struct_size of a newer header: a zero tail is accepted, a non-zero one refused. */
    bigger_t big;
    p = kv_params();
    CHECK_STATUS(kvr_kv_pool_new(ctx, newer_struct(&big, &p, sizeof p, 1), &pool), KVR_STATUS_INVALID_ARG);
    CHECK(strstr(kvr_error_last_message(), "struct_size") != NULL);
    CHECK(pool == STALE_KV);
    CHECK_STATUS(kvr_kv_pool_new(ctx, newer_struct(&big, &p, sizeof p, 0), &pool), KVR_STATUS_OK);
    kvr_kv_pool_free(pool);
    /* Caller-owned layouts: a NULL pointer, overlapping strides, then a working one. */
    static float kmem[PAGES][HKV][PAGE][D], vmem[PAGES][HKV][PAGE][D];
    kvr_kv_layer_layout lay[L];
    for (int l = 0; l < L; l++) {
        lay[l].k = kmem;
        lay[l].v = vmem;
        lay[l].k_stride_page = lay[l].v_stride_page = HKV * PAGE * D;
        lay[l].k_stride_head = lay[l].v_stride_head = PAGE * D;
        lay[l].k_stride_token = lay[l].v_stride_token = D;
    }
    p = kv_params();
    p.n_layers = 1;
    p.layers = lay;
    lay[0].v = NULL;
    pool = STALE_KV;
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_NULL_ARG);
    lay[0].v = vmem;
    lay[0].k_stride_head = D; /* heads overlap the tokens */
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_INVALID_ARG);
    lay[0].k_stride_head = -1;
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_INVALID_ARG);
    CHECK(pool == STALE_KV);
    lay[0].k_stride_head = PAGE * D;
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_OK);
    /* Appending writes into the caller's memory, at the page the block table names. */
    memset(kmem, 0, sizeof kmem);
    int32_t seq = -1;
    CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &seq), KVR_STATUS_OK);
    float k[1][1][HKV][D], v[1][1][HKV][D];
    for (int h = 0; h < HKV; h++)
        for (int d = 0; d < D; d++) k[0][0][h][d] = (float)(h * 10 + d), v[0][0][h][d] = -1;
    kvr_tensor tk = t4(k, KVR_DTYPE_F32, 1, 1, HKV, D), tv = t4(v, KVR_DTYPE_F32, 1, 1, HKV, D);
    CHECK_STATUS(kvr_kv_pool_append(pool, seq, &tk, &tv, NULL), KVR_STATUS_OK);
    int32_t pg = -1;
    int64_t cnt = 0;
    CHECK_STATUS(kvr_kv_pool_get_seq_pages(pool, seq, &pg, 1, &cnt), KVR_STATUS_OK);
    CHECK(cnt == 1 && pg >= 0 && pg < PAGES);
    if (pg >= 0 && pg < PAGES) CHECK(kmem[pg][1][0][3] == 13.0f && vmem[pg][0][0][0] == -1.0f);
    kvr_kv_pool_free(pool);
}

static void test_kv_pool(kvr_context *ctx) {
    rng_t r = rng_new(1);
    memset(RLEN, 0, sizeof RLEN);
    kvr_kv_pool_params p = kv_params();
    kvr_kv_pool *pool = NULL;
    CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_OK);
    kvr_kv_pool_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_STATUS(kvr_kv_pool_get_stats(pool, &st), KVR_STATUS_OK);
    CHECK(st.pages_total == PAGES && st.pages_free == PAGES && st.sequences == 0);
    CHECK(st.page_bytes == (int64_t)2 * L * HKV * PAGE * D * 4);

    /* a: 6 tokens by append; b = fork(a) (shares both pages); c by extend + write. */
    int32_t a = -1, b = -1, c = -1;
    CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &a), KVR_STATUS_OK);
    CHECK(a == 0);
    CHECK_STATUS(kv_append(pool, a, 6, &r), KVR_STATUS_OK);
    CHECK_STATUS(kvr_kv_pool_seq_fork(pool, a, NULL, &b), KVR_STATUS_OK);
    CHECK(b == 1);
    memcpy(RK[b], RK[a], sizeof RK[a]);
    memcpy(RV[b], RV[a], sizeof RV[a]);
    RLEN[b] = RLEN[a];
    CHECK_STATUS(kvr_kv_pool_get_stats(pool, &st), KVR_STATUS_OK);
    CHECK(st.pages_used == 2 && st.pages_shared == 2 && st.tokens == 12);
    CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &c), KVR_STATUS_OK);
    /* b appends into the shared partial page: copy-on-write. */
    CHECK_STATUS(kv_append(pool, b, 3, &r), KVR_STATUS_OK);
    CHECK_STATUS(kvr_kv_pool_get_stats(pool, &st), KVR_STATUS_OK);
    CHECK(st.pages_shared == 1 && st.pages_used == 4);
    kv_extend_write(pool, c, 5, a, 1, &r);
    CHECK(RLEN[a] == 7 && RLEN[b] == 9 && RLEN[c] == 5);

    /* Decodes against naive attention: one token, T = 3 causal drafts with an unused
     * row, a sliding window with softcap and a scale. */
    int32_t ids3[4] = {c, KVR_SEQ_NONE, a, b};
    CHECK(kv_decode_all(pool, &r) < 1e-5);
    CHECK(kv_decode_check(pool, ids3, 4, 3, 1, 0, 0, 0, &r) < 1e-5);
    CHECK(kv_decode_check(pool, ids3, 4, 2, 0, 0.3f, 2.0f, 3, &r) < 1e-5);

    /* Admission. */
    kvr_admission adm = -7;
    CHECK_STATUS(kvr_kv_pool_admit(pool, KVR_SEQ_NONE, 4, &adm), KVR_STATUS_OK);
    CHECK(adm == KVR_ADMIT_OK);
    CHECK_STATUS(kvr_kv_pool_admit(pool, a, MAXLEN, &adm), KVR_STATUS_OK);
    CHECK(adm == KVR_ADMIT_NEVER);
    CHECK_STATUS(kvr_kv_pool_admit(pool, KVR_SEQ_NONE, 28, &adm), KVR_STATUS_OK); /* 7 pages, 4 free */
    CHECK(adm == KVR_ADMIT_LATER);

    /* ---- error paths, each leaving the pool as it was ---- */
    kv_snap snap;
    kv_snapshot(pool, &snap);
    int32_t out_seq = 77;
    int64_t n64 = 77;
    bigger_t big;
    /* Handles: NULL, stale, foreign (a context, a GDN pool's value), freed. */
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_add(NULL, NULL, &out_seq), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_add(STALE_KV, NULL, &out_seq), KVR_STATUS_INVALID_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_add((kvr_kv_pool *)ctx, NULL, &out_seq), KVR_STATUS_INVALID_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_len((kvr_kv_pool *)ctx, a, &n64), KVR_STATUS_INVALID_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_add(pool, NULL, NULL), KVR_STATUS_NULL_ARG);
    CHECK(out_seq == 77 && n64 == 77);
    /* Unknown ids. */
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_free(pool, 3, NULL), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_free(pool, -1, NULL), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_free(pool, 1000, NULL), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_fork(pool, 3, NULL, &out_seq), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_fork(pool, a, NULL, NULL), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_truncate(pool, 3, 0, NULL), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_truncate(pool, a, -1, NULL), KVR_STATUS_OUT_OF_RANGE);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_truncate(pool, a, RLEN[a] + 1, NULL), KVR_STATUS_OUT_OF_RANGE);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_len(pool, 3, &n64), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_len(pool, a, NULL), KVR_STATUS_NULL_ARG);
    CHECK(out_seq == 77 && n64 == 77);
    /* Block tables: too small a buffer reports the count; NULL pages with room. */
    int32_t pages[PAGES];
    for (int i = 0; i < PAGES; i++) pages[i] = -9;
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_pages(pool, b, pages, 1, &n64), KVR_STATUS_OUT_OF_RANGE);
    CHECK(n64 == 3 && pages[0] == -9);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_pages(pool, b, NULL, 8, &n64), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_pages(pool, b, pages, 8, NULL), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_seq_pages(pool, 3, pages, 8, &n64), KVR_STATUS_UNKNOWN_ID);
    /* Extend: NULL arrays, negative n / count, a sequence twice, unknown, too long,
     * exhausted (all or nothing: a fits, b does not). */
    int32_t seqs2[2] = {a, b}, cnt2[2] = {1, 1};
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, NULL, cnt2, 2, NULL), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, NULL, 2, NULL), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, cnt2, -1, NULL), KVR_STATUS_INVALID_ARG);
    cnt2[1] = -1;
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, cnt2, 2, NULL), KVR_STATUS_INVALID_ARG);
    cnt2[1] = 1;
    seqs2[1] = a;
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, cnt2, 2, NULL), KVR_STATUS_INVALID_ARG);
    seqs2[1] = 3;
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, cnt2, 2, NULL), KVR_STATUS_UNKNOWN_ID);
    seqs2[1] = b;
    cnt2[1] = MAXLEN;
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, cnt2, 2, NULL), KVR_STATUS_OUT_OF_RANGE);
    seqs2[0] = c; /* each fits its length; together they need 5 + 3 pages, 4 are free */
    cnt2[0] = MAXLEN - (int)RLEN[c];
    cnt2[1] = MAXLEN - (int)RLEN[b];
    KV_FAILS(pool, &snap, kvr_kv_pool_extend(pool, seqs2, cnt2, 2, NULL), KVR_STATUS_POOL_EXHAUSTED);
    CHECK(strstr(g_msg, "free") != NULL);
    /* Write: shapes, dtypes, a shared page, counts past a length, layers, memory kind. */
    float kbuf[2][MAXLEN][HKV][D], vbuf[2][MAXLEN][HKV][D];
    fill(&kbuf[0][0][0][0], sizeof kbuf / 4, 0.5f);
    fill(&vbuf[0][0][0][0], sizeof vbuf / 4, 0.5f);
    int32_t one_seq = c, one = 1;
    kvr_tensor k1 = t3(kbuf, KVR_DTYPE_F32, 1, HKV, D), v1 = t3(vbuf, KVR_DTYPE_F32, 1, HKV, D);
    kvr_tensor kbad = t3(kbuf, KVR_DTYPE_F32, 1, HKV, D + 1);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, &kbad, &v1, NULL), KVR_STATUS_INVALID_ARG);
    kbad = t3(kbuf, KVR_DTYPE_F32, 2, HKV, D); /* 2 tokens for a count of 1 */
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, &kbad, &v1, NULL), KVR_STATUS_INVALID_ARG);
    kbad = t3(kbuf, KVR_DTYPE_I32, 1, HKV, D);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, &kbad, &v1, NULL), KVR_STATUS_DTYPE_MISMATCH);
    kbad = k1;
    kbad.device = KVR_DEVICE_CUDA;
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, &kbad, &v1, NULL), KVR_STATUS_INVALID_ARG);
    kbad = k1;
    kbad.strides[2] = -1;
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, &kbad, &v1, NULL), KVR_STATUS_INVALID_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, NULL, &v1, NULL), KVR_STATUS_NULL_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 2, &one_seq, &one, 1, &k1, &v1, NULL), KVR_STATUS_OUT_OF_RANGE);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, -2, &one_seq, &one, 1, &k1, &v1, NULL), KVR_STATUS_OUT_OF_RANGE);
    kvr_tensor kall = t3(kbuf, KVR_DTYPE_F32, 1, HKV, D); /* KVR_LAYER_ALL wants 4-D */
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, KVR_LAYER_ALL, &one_seq, &one, 1, &kall, &v1, NULL), KVR_STATUS_INVALID_ARG);
    int32_t many = (int32_t)RLEN[c] + 1;
    kvr_tensor kmany = t3(kbuf, KVR_DTYPE_F32, many, HKV, D), vmany = t3(vbuf, KVR_DTYPE_F32, many, HKV, D);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &many, 1, &kmany, &vmany, NULL), KVR_STATUS_OUT_OF_RANGE);
    one_seq = 3;
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &one_seq, &one, 1, &k1, &v1, NULL), KVR_STATUS_UNKNOWN_ID);
    /* a's first page is shared with b: writing a position there is refused. */
    int32_t sh_seq = a, sh_n = (int32_t)RLEN[a];
    kvr_tensor ksh = t3(kbuf, KVR_DTYPE_F32, sh_n, HKV, D), vsh = t3(vbuf, KVR_DTYPE_F32, sh_n, HKV, D);
    KV_FAILS(pool, &snap, kvr_kv_pool_write(pool, 0, &sh_seq, &sh_n, 1, &ksh, &vsh, NULL), KVR_STATUS_INVALID_ARG);
    CHECK(strstr(g_msg, "shared") != NULL);
    /* Append: shapes, dtypes, too long, exhausted. */
    kvr_tensor ka = t4(kbuf, KVR_DTYPE_F32, L, 1, HKV, D), va = t4(vbuf, KVR_DTYPE_F32, L, 1, HKV, D);
    kvr_tensor kab = t4(kbuf, KVR_DTYPE_F32, L + 1, 1, HKV, D);
    KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, a, &kab, &va, NULL), KVR_STATUS_INVALID_ARG);
    kab = t3(kbuf, KVR_DTYPE_F32, 1, HKV, D);
    KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, a, &kab, &va, NULL), KVR_STATUS_INVALID_ARG);
    kab = t4(kbuf, KVR_DTYPE_BF16, L, 1, HKV, D);
    kvr_tensor vab = t4(vbuf, KVR_DTYPE_I32, L, 1, HKV, D);
    KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, a, &kab, &vab, NULL), KVR_STATUS_DTYPE_MISMATCH);
    KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, 3, &ka, &va, NULL), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, a, &ka, NULL, NULL), KVR_STATUS_NULL_ARG);
    {
        int room = MAXLEN - (int)RLEN[b];
        static float kk[L][MAXLEN][HKV][D];
        kvr_tensor kl = t4(kk, KVR_DTYPE_F32, L, room + 1, HKV, D);
        KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, b, &kl, &kl, NULL), KVR_STATUS_OUT_OF_RANGE);
        kl = t4(kk, KVR_DTYPE_F32, L, room, HKV, D); /* fits the length, not the free pages */
        KV_FAILS(pool, &snap, kvr_kv_pool_append(pool, b, &kl, &kl, NULL), KVR_STATUS_POOL_EXHAUSTED);
    }
    /* Admission and stats. */
    kvr_admission adm0 = 99;
    KV_FAILS(pool, &snap, kvr_kv_pool_admit(pool, a, -1, &adm0), KVR_STATUS_INVALID_ARG);
    KV_FAILS(pool, &snap, kvr_kv_pool_admit(pool, 3, 1, &adm0), KVR_STATUS_UNKNOWN_ID);
    KV_FAILS(pool, &snap, kvr_kv_pool_admit(pool, a, 1, NULL), KVR_STATUS_NULL_ARG);
    CHECK(adm0 == 99);
    kvr_kv_pool_stats st2;
    memset(&st2, 0x5a, sizeof st2);
    st2.struct_size = 8;
    KV_FAILS(pool, &snap, kvr_kv_pool_get_stats(pool, &st2), KVR_STATUS_INVALID_ARG);
    CHECK(st2.pages_total == (int64_t)0x5a5a5a5a5a5a5a5aLL);
    KV_FAILS(pool, &snap, kvr_kv_pool_get_stats(pool, NULL), KVR_STATUS_NULL_ARG);

    /* Decode: ids, shapes, dtypes, strides, overlapping outputs, lse, T, group, windows,
     * params; `out` must stay untouched. */
    {
        float q[MAXS * 9 * 20 * D], out[MAXS * 9 * 20 * D], lse[MAXS * 9 * 20];
        int32_t ids[8] = {a, b, c, KVR_SEQ_NONE, KVR_SEQ_NONE, KVR_SEQ_NONE};
        rng_fill(&r, q, sizeof q / 4, -1, 1);
        fill(out, sizeof out / 4, SENTINEL_F);
        fill(lse, sizeof lse / 4, SENTINEL_F);
        kvr_tensor tid = t1(ids, KVR_DTYPE_I32, 3);
        kvr_tensor tq = t3(q, KVR_DTYPE_F32, 3, HQ, D), to = t3(out, KVR_DTYPE_F32, 3, HQ, D);
        kvr_tensor tl = t2(lse, KVR_DTYPE_F32, 3, HQ);
        kvr_tensor x;
#define DEC(ids_, q_, out_, lse_, params_, layer_, want) \
    KV_FAILS(pool, &snap, kvr_kv_pool_decode(pool, layer_, ids_, q_, out_, lse_, params_, NULL), want)
        DEC(NULL, &tq, &to, NULL, NULL, 0, KVR_STATUS_NULL_ARG);
        DEC(&tid, NULL, &to, NULL, NULL, 0, KVR_STATUS_NULL_ARG);
        DEC(&tid, &tq, NULL, NULL, NULL, 0, KVR_STATUS_NULL_ARG);
        x = t1(ids, KVR_DTYPE_F32, 3);
        DEC(&x, &tq, &to, NULL, NULL, 0, KVR_STATUS_DTYPE_MISMATCH);
        x = t2(ids, KVR_DTYPE_I32, 3, 1);
        DEC(&x, &tq, &to, NULL, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = t1(ids, KVR_DTYPE_I32, 5); /* 5 rows > max_seqs */
        kvr_tensor q5 = t3(q, KVR_DTYPE_F32, 5, HQ, D), o5 = t3(out, KVR_DTYPE_F32, 5, HQ, D);
        DEC(&x, &q5, &o5, NULL, NULL, 0, KVR_STATUS_OUT_OF_RANGE);
        ids[1] = 3;
        DEC(&tid, &tq, &to, NULL, NULL, 0, KVR_STATUS_UNKNOWN_ID);
        ids[1] = a;
        DEC(&tid, &tq, &to, NULL, NULL, 0, KVR_STATUS_INVALID_ARG); /* a twice */
        ids[1] = b;
        x = t3(q, KVR_DTYPE_F32, 2, HQ, D); /* rows differ from seq_ids */
        DEC(&tid, &x, &to, NULL, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = t3(q, KVR_DTYPE_F32, 3, HQ, D + 1);
        DEC(&tid, &x, &to, NULL, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = t3(q, KVR_DTYPE_F32, 3, 3, D); /* 3 query heads, 2 KV heads */
        DEC(&tid, &x, &to, NULL, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = t3(q, KVR_DTYPE_F32, 3, HKV * 17, D); /* group of 17 */
        kvr_tensor o17 = t3(out, KVR_DTYPE_F32, 3, HKV * 17, D);
        DEC(&tid, &x, &o17, NULL, NULL, 0, KVR_STATUS_OUT_OF_RANGE);
        x = t4(q, KVR_DTYPE_F32, 3, 9, HQ, D); /* T = 9 */
        kvr_tensor o9 = t4(out, KVR_DTYPE_F32, 3, 9, HQ, D);
        DEC(&tid, &x, &o9, NULL, NULL, 0, KVR_STATUS_OUT_OF_RANGE);
        x = t4(q, KVR_DTYPE_F32, 3, 8, HQ, D); /* T = 8 > c's 5 tokens */
        kvr_tensor o8 = t4(out, KVR_DTYPE_F32, 3, 8, HQ, D);
        DEC(&tid, &x, &o8, NULL, NULL, 0, KVR_STATUS_OUT_OF_RANGE);
        x = t3(q, KVR_DTYPE_I32, 3, HQ, D);
        DEC(&tid, &x, &to, NULL, NULL, 0, KVR_STATUS_DTYPE_MISMATCH);
        x = tq;
        x.device = KVR_DEVICE_CUDA;
        DEC(&tid, &x, &to, NULL, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = to;
        x.strides[1] = 0; /* heads share an address */
        DEC(&tid, &tq, &x, NULL, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = t2(lse, KVR_DTYPE_F16, 3, HQ);
        DEC(&tid, &tq, &to, &x, NULL, 0, KVR_STATUS_DTYPE_MISMATCH);
        x = t2(lse, KVR_DTYPE_F32, 3, HQ + 1);
        DEC(&tid, &tq, &to, &x, NULL, 0, KVR_STATUS_INVALID_ARG);
        x = tl;
        x.strides[0] = 0;
        DEC(&tid, &tq, &to, &x, NULL, 0, KVR_STATUS_INVALID_ARG);
        DEC(&tid, &tq, &to, &tl, NULL, 2, KVR_STATUS_OUT_OF_RANGE);
        DEC(&tid, &tq, &to, &tl, NULL, -1, KVR_STATUS_OUT_OF_RANGE);
        kvr_kv_decode_params dp, bad;
        CHECK_STATUS(kvr_kv_decode_params_default(&dp), KVR_STATUS_OK);
        CHECK_STATUS(kvr_kv_decode_params_default(NULL), KVR_STATUS_NULL_ARG);
        bad = dp;
        bad.window = -1;
        DEC(&tid, &tq, &to, &tl, &bad, 0, KVR_STATUS_INVALID_ARG);
        bad = dp;
        bad.max_ctas = -1;
        DEC(&tid, &tq, &to, &tl, &bad, 0, KVR_STATUS_INVALID_ARG);
        bad = dp;
        bad.scale = -1.0f;
        DEC(&tid, &tq, &to, &tl, &bad, 0, KVR_STATUS_INVALID_ARG);
        bad = dp;
        bad.softcap = (float)INFINITY;
        DEC(&tid, &tq, &to, &tl, &bad, 0, KVR_STATUS_INVALID_ARG);
        bad = dp;
        bad.struct_size = 4;
        DEC(&tid, &tq, &to, &tl, &bad, 0, KVR_STATUS_INVALID_ARG);
        DEC(&tid, &tq, &to, &tl, (const kvr_kv_decode_params *)newer_struct(&big, &dp, sizeof dp, 1), 0,
            KVR_STATUS_INVALID_ARG);
#undef DEC
        CHECK(all_equal(out, sizeof out / 4, SENTINEL_F) && all_equal(lse, sizeof lse / 4, SENTINEL_F));
        CHECK_STATUS(kvr_kv_pool_decode(pool, 0, &tid, &tq, &to, &tl,
                                        (const kvr_kv_decode_params *)newer_struct(&big, &dp, sizeof dp, 0), NULL),
                     KVR_STATUS_OK);
    }
    /* The next valid calls see the pool as it was. */
    CHECK(kv_decode_all(pool, &r) < 1e-5);

    /* Exhausted ids: two more sequences fill max_seqs; a fork has no id left. */
    int32_t d = -1, e = -1;
    CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &d), KVR_STATUS_OK);
    CHECK(d == 3);
    kv_snapshot(pool, &snap);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_add(pool, NULL, &e), KVR_STATUS_POOL_EXHAUSTED);
    KV_FAILS(pool, &snap, kvr_kv_pool_seq_fork(pool, a, NULL, &e), KVR_STATUS_POOL_EXHAUSTED);
    CHECK(e == -1);
    CHECK_STATUS(kvr_kv_pool_admit(pool, KVR_SEQ_NONE, 1, &adm), KVR_STATUS_OK);
    CHECK(adm == KVR_ADMIT_LATER);
    /* Truncate (speculative rollback) releases pages; free returns ids and pages. */
    CHECK_STATUS(kvr_kv_pool_seq_truncate(pool, b, 4, NULL), KVR_STATUS_OK);
    RLEN[b] = 4;
    CHECK_STATUS(kvr_kv_pool_seq_truncate(pool, d, 0, NULL), KVR_STATUS_OK);
    CHECK(kv_decode_all(pool, &r) < 1e-5);
    CHECK_STATUS(kvr_kv_pool_seq_free(pool, a, NULL), KVR_STATUS_OK);
    RLEN[a] = 0;
    CHECK_STATUS(kvr_kv_pool_seq_free(pool, a, NULL), KVR_STATUS_UNKNOWN_ID); /* twice */
    CHECK(kv_decode_all(pool, &r) < 1e-5); /* b keeps the page it shared with a */
    CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &e), KVR_STATUS_OK);
    CHECK(e == a); /* the lowest free id */
    for (int i = 0; i < MAXS; i++) CHECK_STATUS(kvr_kv_pool_seq_free(pool, i, NULL), KVR_STATUS_OK);
    CHECK_STATUS(kvr_kv_pool_get_stats(pool, &st), KVR_STATUS_OK);
    CHECK(st.pages_used == 0 && st.pages_free == PAGES && st.sequences == 0 && st.tokens == 0);
    /* A freed pool is a stale handle; freeing it again is recorded, not a crash. */
    kvr_kv_pool_free(pool);
    CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &e), KVR_STATUS_INVALID_ARG);
    CHECK_STATUS(kvr_kv_pool_get_stats(pool, &st), KVR_STATUS_INVALID_ARG);
    kvr_kv_pool_free(pool);
    CHECK(strstr(kvr_error_last_message(), "freed twice") != NULL);
    kvr_kv_pool_free(NULL);
}

/* Pool writes and decode outputs in f16 / bf16 round to nearest even: K written as
 * halfway values decodes (one key, so the output is V) to the rounded V. */
static uint16_t f16_rne(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xff, m = x & 0x7fffffu;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0));
    int ee = (int)e - 127 + 15;
    if (ee >= 0x1f) return (uint16_t)(sign | 0x7c00u);
    if (ee <= 0) { /* subnormal */
        if (ee < -10) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - ee), half = 1u << (shift - 1), rest = m & ((1u << shift) - 1);
        uint32_t h = m >> shift;
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)ee << 10) | (m >> 13), rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, x;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        return (h & 0x8000u) ? -f : f;
    }
    if (e == 0x1f) x = sign | 0x7f800000u | (m << 13);
    else x = sign | ((e - 15 + 127) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static void test_kv_rounding(kvr_context *ctx) {
    const float vals[D] = {1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256,
                           -(1.0f + 3.0f / 2048), 65519.0f, 1.0f + 1.0f / 4096, 0.1f};
    kvr_dtype dts[2] = {KVR_DTYPE_F16, KVR_DTYPE_BF16};
    for (int i = 0; i < 2; i++) {
        kvr_kv_pool_params p = kv_params();
        p.n_layers = 1;
        p.dtype = dts[i];
        kvr_kv_pool *pool = NULL;
        CHECK_STATUS(kvr_kv_pool_new(ctx, &p, &pool), KVR_STATUS_OK);
        int32_t s = -1;
        CHECK_STATUS(kvr_kv_pool_seq_add(pool, NULL, &s), KVR_STATUS_OK);
        float k[1][1][HKV][D], v[1][1][HKV][D];
        for (int h = 0; h < HKV; h++)
            for (int d = 0; d < D; d++) k[0][0][h][d] = 0.25f, v[0][0][h][d] = vals[d];
        kvr_tensor tk = t4(k, KVR_DTYPE_F32, 1, 1, HKV, D), tv = t4(v, KVR_DTYPE_F32, 1, 1, HKV, D);
        CHECK_STATUS(kvr_kv_pool_append(pool, s, &tk, &tv, NULL), KVR_STATUS_OK);
        float q[HQ * D], out[HQ * D];
        for (int j = 0; j < HQ * D; j++) q[j] = 0.5f;
        kvr_tensor tid = t1(&s, KVR_DTYPE_I32, 1), tq = t3(q, KVR_DTYPE_F32, 1, HQ, D),
                   to = t3(out, KVR_DTYPE_F32, 1, HQ, D);
        CHECK_STATUS(kvr_kv_pool_decode(pool, 0, &tid, &tq, &to, NULL, NULL, NULL), KVR_STATUS_OK);
        int bad = 0;
        for (int h = 0; h < HQ; h++)
            for (int d = 0; d < D; d++) {
                float want = dts[i] == KVR_DTYPE_F16 ? f16_to_f32(f16_rne(vals[d])) : bf16_round(vals[d]);
                if (out[h * D + d] != want) {
                    if (bad++ < 4)
                        fprintf(stderr, "%s: v %.9g stored as %.9g, want %.9g\n",
                                i ? "bf16" : "f16", vals[d], out[h * D + d], want);
                }
            }
        CHECK(bad == 0);
        kvr_kv_pool_free(pool);
    }
}

/* =============================== GDN pool =============================== */

enum { GL = 2, GHK = 2, GHV = 4, GD = 8, CONV = 4, K1 = 2, MAXT = 4, GS = 4, RING = 8 };
#define GSTATE (GHV * GD * GD)
/* The KV-only threshold of the runs in KV-only mode (the default is off): min(dk, the
 * entries one head's state holds) = min(8, 256 / 68). */
enum { GKV = 3 };

/* The reference: per (sequence, layer) states as [Hv][dv][dk] and the conv window; the
 * states after each pending draft and the pending drafts' conv inputs. */
static double GS_[GS][GL][GHV][GD * GD], GSNAP[GS][GL][MAXT][GHV][GD * GD];
static float GWIN[GS][GL][K1][CONV], GPCONV[GS][GL][MAXT][CONV];
static int GPEND[GS][GL];

static kvr_gdn_pool_params gdn_params(int ring) {
    kvr_gdn_pool_params p;
    memset(&p, 0, sizeof p);
    CHECK_STATUS(kvr_gdn_pool_params_default(&p), KVR_STATUS_OK);
    p.n_layers = GL;
    p.n_k_heads = GHK;
    p.n_v_heads = GHV;
    p.dk = GD;
    p.dv = GD;
    p.ring_len = ring;
    p.max_drafts = MAXT;
    p.max_seqs = GS;
    p.conv_dim = CONV;
    p.conv_kernel = K1 + 1;
    return p;
}

/* Inputs of one call, [B][T][...] (T = 1 for decode). */
typedef struct {
    float q[GS * (MAXT + 1) * GHK * GD], k[GS * (MAXT + 1) * GHK * GD], v[GS * (MAXT + 1) * GHV * GD];
    float g[GS * (MAXT + 1) * GHV], beta[GS * (MAXT + 1) * GHV], conv[GS * (MAXT + 1) * CONV];
    float out[GS * (MAXT + 1) * GHV * GD];
} gdn_io;

static void gdn_random(gdn_io *x, rng_t *r) {
    rng_fill(r, x->q, sizeof x->q / 4, -1, 1);
    rng_fill(r, x->k, sizeof x->k / 4, -1, 1);
    rng_fill(r, x->v, sizeof x->v / 4, -1, 1);
    rng_fill(r, x->g, sizeof x->g / 4, -0.4f, -0.01f);
    rng_fill(r, x->beta, sizeof x->beta / 4, 0.1f, 0.9f);
    rng_fill(r, x->conv, sizeof x->conv / 4, -1, 1);
    fill(x->out, sizeof x->out / 4, SENTINEL_F);
}

/* Descriptors of `x` for B rows and T drafts (T = 0: the 3-D / 2-D decode shapes). */
typedef struct {
    kvr_tensor q, k, v, g, beta, conv, out;
} gdn_t;
static gdn_t gdn_tensors(gdn_io *x, int b, int T) {
    gdn_t t;
    if (T == 0) {
        t.q = t3(x->q, KVR_DTYPE_F32, b, GHK, GD);
        t.k = t3(x->k, KVR_DTYPE_F32, b, GHK, GD);
        t.v = t3(x->v, KVR_DTYPE_F32, b, GHV, GD);
        t.out = t3(x->out, KVR_DTYPE_F32, b, GHV, GD);
        t.g = t2(x->g, KVR_DTYPE_F32, b, GHV);
        t.beta = t2(x->beta, KVR_DTYPE_F32, b, GHV);
        t.conv = t2(x->conv, KVR_DTYPE_F32, b, CONV);
    } else {
        t.q = t4(x->q, KVR_DTYPE_F32, b, T, GHK, GD);
        t.k = t4(x->k, KVR_DTYPE_F32, b, T, GHK, GD);
        t.v = t4(x->v, KVR_DTYPE_F32, b, T, GHV, GD);
        t.out = t4(x->out, KVR_DTYPE_F32, b, T, GHV, GD);
        t.g = t3(x->g, KVR_DTYPE_F32, b, T, GHV);
        t.beta = t3(x->beta, KVR_DTYPE_F32, b, T, GHV);
        t.conv = t3(x->conv, KVR_DTYPE_F32, b, T, CONV);
    }
    return t;
}

static kvr_gdn_step_params STEP; /* l2norm_qk = 1, default scale */

static kvr_status gdn_call(kvr_gdn_pool *pool, int layer, const kvr_tensor *ids, const gdn_t *t,
                           int verify, const kvr_gdn_step_params *params) {
    if (verify)
        return kvr_gdn_pool_verify(pool, layer, ids, &t->q, &t->k, &t->v, &t->g, &t->beta, &t->conv,
                                   &t->out, params, NULL);
    return kvr_gdn_pool_decode(pool, layer, ids, &t->q, &t->k, &t->v, &t->g, &t->beta, &t->conv, &t->out,
                               params, NULL);
}

/* Runs the reference for the call of `x` (B rows, T drafts; T = 0: a decode) and returns
 * the largest error of `got` (outputs) against it. Decodes commit at once; verifies stay
 * pending in the reference too. */
static double gdn_reference(gdn_io *x, const float *got, const float *got2, const int32_t *ids, int b, int T,
                            int layer) {
    int verify = T > 0, TT = verify ? T : 1;
    double worst = 0, y[GD];
    double scale = 1.0 / sqrt((double)GD);
    for (int i = 0; i < b; i++) {
        int s = ids[i];
        double S[GHV][GD * GD];
        if (s >= 0) memcpy(S, GS_[s][layer], sizeof S);
        for (int t = 0; t < TT; t++) {
            for (int h = 0; h < GHV; h++) {
                size_t o = ((size_t)i * TT + t) * GHV + h;
                if (s < 0) {
                    for (int d = 0; d < GD; d++) {
                        worst = fmax(worst, fabs(got[o * GD + d]));
                        if (got2) worst = fmax(worst, fabs(got2[o * GD + d]));
                    }
                    continue;
                }
                int kh = h / (GHV / GHK);
                size_t qo = (((size_t)i * TT + t) * GHK + kh) * GD;
                gdn_ref_step(S[h], GD, GD, x->q + qo, x->k + qo, x->v + o * GD, x->g[o], x->beta[o], scale, y);
                worst = fmax(worst, rel_err_f(got + o * GD, y, GD));
                if (got2) worst = fmax(worst, rel_err_f(got2 + o * GD, y, GD));
            }
            if (s < 0) continue;
            const float *cin = x->conv + ((size_t)i * TT + t) * CONV;
            if (verify) {
                memcpy(GSNAP[s][layer][t], S, sizeof S);
                memcpy(GPCONV[s][layer][t], cin, CONV * 4);
            } else {
                memcpy(GS_[s][layer], S, sizeof S);
                memmove(GWIN[s][layer][0], GWIN[s][layer][1], (K1 - 1) * CONV * 4);
                memcpy(GWIN[s][layer][K1 - 1], cin, CONV * 4);
            }
        }
        if (s >= 0 && verify) GPEND[s][layer] = T;
    }
    return worst;
}

/* Commits `acc[i]` drafts in the reference (layer or every layer). */
static void gdn_reference_commit(const int32_t *ids, const int32_t *acc, int b, int layer) {
    for (int l = 0; l < GL; l++) {
        if (layer != KVR_LAYER_ALL && l != layer) continue;
        for (int i = 0; i < b; i++) {
            int s = ids[i];
            if (s < 0) continue;
            if (acc[i] > 0) memcpy(GS_[s][l], GSNAP[s][l][acc[i] - 1], sizeof GS_[s][l]);
            for (int t = 0; t < acc[i]; t++) {
                memmove(GWIN[s][l][0], GWIN[s][l][1], (K1 - 1) * CONV * 4);
                memcpy(GWIN[s][l][K1 - 1], GPCONV[s][l][t], CONV * 4);
            }
            GPEND[s][l] = 0;
        }
    }
}

static void gdn_reference_reset(int s) {
    memset(GS_[s], 0, sizeof GS_[s]);
    memset(GWIN[s], 0, sizeof GWIN[s]);
    memset(GPEND[s], 0, sizeof GPEND[s]);
}

/* The state and conv window of (layer, s) exported from `pool`, against the reference. */
static double gdn_check_state(kvr_gdn_pool *pool, int layer, int s) {
    float st[GSTATE], win[K1 * CONV];
    fill(st, GSTATE, SENTINEL_F);
    kvr_tensor ts = t3(st, KVR_DTYPE_F32, GHV, GD, GD), tw = t2(win, KVR_DTYPE_F32, K1, CONV);
    CHECK_STATUS(kvr_gdn_pool_export_state(pool, layer, s, &ts, &tw, NULL), KVR_STATUS_OK);
    double worst = 0, want[GSTATE];
    for (int h = 0; h < GHV; h++) /* K-major: [h][ik][iv] = S[h][iv][ik] */
        for (int ik = 0; ik < GD; ik++)
            for (int iv = 0; iv < GD; iv++) want[(h * GD + ik) * GD + iv] = GS_[s][layer][h][iv * GD + ik];
    worst = rel_err_f(st, want, GSTATE);
    if (memcmp(win, GWIN[s][layer], sizeof win) != 0) worst = fmax(worst, 1.0);
    return worst;
}

typedef struct {
    kvr_gdn_cursor cur[GL][GS];
    float st[GL][GS][GSTATE];
    float win[GL][GS][K1 * CONV];
} gdn_snap;

static void gdn_snapshot(const kvr_gdn_pool *pool, gdn_snap *s) {
    memset(s, 0, sizeof *s);
    for (int l = 0; l < GL; l++)
        for (int i = 0; i < GS; i++) {
            if (kvr_gdn_pool_get_cursor(pool, l, i, &s->cur[l][i]) != KVR_STATUS_OK) {
                s->cur[l][i].mode = -1;
                continue;
            }
            if (s->cur[l][i].pending) continue;
            kvr_tensor ts = t3(s->st[l][i], KVR_DTYPE_F32, GHV, GD, GD), tw = t2(s->win[l][i], KVR_DTYPE_F32, K1, CONV);
            if (kvr_gdn_pool_export_state(pool, l, i, &ts, &tw, NULL) != KVR_STATUS_OK) s->cur[l][i].mode = -2;
        }
}

#define GDN_FAILS(pool, snap, expr, want)              \
    do {                                               \
        CHECK_STATUS(expr, want);                      \
        snprintf(g_msg, sizeof g_msg, "%s", kvr_error_last_message()); \
        static gdn_snap now_;                          \
        gdn_snapshot(pool, &now_);                     \
        CHECK(memcmp(&now_, snap, sizeof now_) == 0);  \
    } while (0)

static void test_gdn_params(kvr_context *ctx) {
    kvr_gdn_pool *pool = STALE_GDN;
    kvr_gdn_pool_params p = gdn_params(RING);
    CHECK_STATUS(kvr_gdn_pool_params_default(NULL), KVR_STATUS_NULL_ARG);
    CHECK(p.struct_size == sizeof p && p.kv_only_threshold == KVR_GDN_THRESHOLD_DEFAULT);
    CHECK_STATUS(kvr_gdn_pool_new(NULL, &p, &pool), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_gdn_pool_new(ctx, NULL, &pool), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_gdn_pool_new(ctx, &p, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_gdn_pool_new((kvr_context *)(uintptr_t)0x90, &p, &pool), KVR_STATUS_INVALID_ARG);
    struct {
        const char *what;
        kvr_gdn_pool_params p;
        kvr_status want;
    } bad[20];
    int n = 0;
#define BAD(ring, field, value, status)                  \
    do {                                                 \
        bad[n].what = #field " = " #value;               \
        bad[n].p = gdn_params(ring);                     \
        bad[n].p.field = value;                          \
        bad[n++].want = status;                          \
    } while (0)
    BAD(RING, struct_size, 3, KVR_STATUS_INVALID_ARG);
    BAD(RING, n_layers, 0, KVR_STATUS_INVALID_ARG);
    BAD(RING, dk, -4, KVR_STATUS_INVALID_ARG);
    BAD(RING, n_v_heads, 3, KVR_STATUS_INVALID_ARG); /* not a multiple of Hk */
    BAD(RING, max_drafts, 9, KVR_STATUS_OUT_OF_RANGE);
    BAD(RING, ring_len, 2, KVR_STATUS_INVALID_ARG); /* < max_drafts */
    BAD(RING, ring_len, -1, KVR_STATUS_INVALID_ARG);
    BAD(RING, layout, 7, KVR_STATUS_INVALID_ARG);
    BAD(RING, state_dtype, KVR_DTYPE_F16, KVR_STATUS_DTYPE_MISMATCH);
    BAD(RING, entry_dtype, 42, KVR_STATUS_INVALID_ARG);
    BAD(RING, conv_dtype, KVR_DTYPE_I32, KVR_STATUS_DTYPE_MISMATCH);
    BAD(RING, kv_only_threshold, 1000, KVR_STATUS_OUT_OF_RANGE);
    BAD(RING, kv_only_threshold, -5, KVR_STATUS_INVALID_ARG);
    BAD(0, kv_only_threshold, 2, KVR_STATUS_INVALID_ARG); /* recurrent pools have no KV-only mode */
    BAD(RING, conv_kernel, 1, KVR_STATUS_INVALID_ARG);
    BAD(RING, max_seqs, 0, KVR_STATUS_INVALID_ARG);
#undef BAD
    kvr_gdn_pool_memory m;
    for (int i = 0; i < n; i++) {
        kvr_status s = kvr_gdn_pool_new(ctx, &bad[i].p, &pool);
        memset(&m, 0, sizeof m);
        m.struct_size = sizeof m;
        kvr_status s2 = kvr_gdn_pool_params_memory(&bad[i].p, &m);
        if (s != bad[i].want || s2 != bad[i].want)
            fprintf(stderr, "gdn_pool_new with %s: %d, params_memory %d (%s)\n", bad[i].what, (int)s, (int)s2,
                    kvr_error_last_message());
        CHECK(s == bad[i].want && s2 == bad[i].want);
        CHECK(pool == STALE_GDN && m.total_bytes == 0);
    }
    bigger_t big;
    CHECK_STATUS(kvr_gdn_pool_new(ctx, newer_struct(&big, &p, sizeof p, 1), &pool), KVR_STATUS_INVALID_ARG);
    CHECK_STATUS(kvr_gdn_pool_params_memory(newer_struct(&big, &p, sizeof p, 1), &m), KVR_STATUS_INVALID_ARG);
    CHECK(pool == STALE_GDN);
    /* Sizing without a pool; the pool reports the same. */
    CHECK_STATUS(kvr_gdn_pool_params_memory(NULL, &m), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_gdn_pool_params_memory(&p, NULL), KVR_STATUS_NULL_ARG);
    m.struct_size = 4;
    CHECK_STATUS(kvr_gdn_pool_params_memory(&p, &m), KVR_STATUS_INVALID_ARG);
    m.struct_size = sizeof m;
    CHECK_STATUS(kvr_gdn_pool_params_memory(&p, &m), KVR_STATUS_OK);
    CHECK(m.state_bytes == (int64_t)GL * GSTATE * 4);
    CHECK(m.ring_bytes == (int64_t)GL * RING * ((GHV * GD + GHK * GD) * 4 + GHV * 4));
    CHECK(m.snapshot_bytes == 0 && m.total_bytes == m.state_bytes + m.ring_bytes + m.conv_bytes);
    /* The default threshold is off; KV-only mode on request, up to the entries one head's
     * state holds (GKV, in the same memory). */
    CHECK(m.kv_only_threshold == 0);
    {
        kvr_gdn_pool_params q = p;
        kvr_gdn_pool_memory mk;
        memset(&mk, 0, sizeof mk);
        mk.struct_size = sizeof mk;
        q.kv_only_threshold = GKV;
        CHECK_STATUS(kvr_gdn_pool_params_memory(&q, &mk), KVR_STATUS_OK);
        CHECK(mk.kv_only_threshold == GKV && mk.total_bytes == m.total_bytes);
        q.kv_only_threshold = GKV + 1;
        CHECK_STATUS(kvr_gdn_pool_params_memory(&q, &mk), KVR_STATUS_OUT_OF_RANGE);
    }
    CHECK_STATUS(kvr_gdn_pool_new(ctx, newer_struct(&big, &p, sizeof p, 0), &pool), KVR_STATUS_OK);
    kvr_gdn_pool_memory m2;
    memset(&m2, 0, sizeof m2);
    m2.struct_size = sizeof m2;
    CHECK_STATUS(kvr_gdn_pool_get_memory(pool, &m2), KVR_STATUS_OK);
    CHECK(memcmp(&m, &m2, sizeof m) == 0);
    m2.struct_size = 0;
    CHECK_STATUS(kvr_gdn_pool_get_memory(pool, &m2), KVR_STATUS_INVALID_ARG);
    CHECK_STATUS(kvr_gdn_pool_get_memory(pool, NULL), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_gdn_pool_get_memory(STALE_GDN, &m2), KVR_STATUS_INVALID_ARG);
    kvr_gdn_pool_free(pool);
    /* Recurrent: snapshots instead of a ring; the default threshold is off. */
    p = gdn_params(0);
    CHECK_STATUS(kvr_gdn_pool_params_memory(&p, &m), KVR_STATUS_OK);
    CHECK(m.ring_bytes == 0 && m.snapshot_bytes == (int64_t)GL * MAXT * GSTATE * 4 && m.kv_only_threshold == 0);
}

/* One round on both pools (the replay pool `rp` and the recurrent pool `cp`, same inputs):
 * a decode (T = 0) or a verify of T drafts committed with `acc` (conv windows back when
 * `conv_state`), in `layer` (KVR_LAYER_ALL: every layer, one commit). Returns the largest
 * error of either pool against the reference. */
static double gdn_round(kvr_gdn_pool *rp, kvr_gdn_pool *cp, const int32_t *ids, int b, int T, int layer,
                        const int32_t *acc, int conv_state, rng_t *r) {
    static gdn_io x, y;
    gdn_random(&x, r);
    int32_t idv[GS];
    memcpy(idv, ids, (size_t)b * 4);
    kvr_tensor tid = t1(idv, KVR_DTYPE_I32, b);
    int verify = T > 0;
    double worst = 0;
    for (int l = 0; l < GL; l++) {
        if (layer != KVR_LAYER_ALL && l != layer) continue;
        fill(x.out, sizeof x.out / 4, SENTINEL_F);
        y = x;
        gdn_t tx = gdn_tensors(&x, b, T), ty = gdn_tensors(&y, b, T);
        CHECK_STATUS(gdn_call(rp, l, &tid, &tx, verify, &STEP), KVR_STATUS_OK);
        CHECK_STATUS(gdn_call(cp, l, &tid, &ty, verify, &STEP), KVR_STATUS_OK);
        worst = fmax(worst, gdn_reference(&x, x.out, y.out, ids, b, T, l));
    }
    if (!verify) return worst;
    int32_t accv[GS];
    memcpy(accv, acc, (size_t)b * 4);
    kvr_tensor ta = t1(accv, KVR_DTYPE_I32, b);
    float cs[GS * K1 * CONV], cs2[GS * K1 * CONV];
    fill(cs, sizeof cs / 4, SENTINEL_F);
    fill(cs2, sizeof cs2 / 4, SENTINEL_F);
    kvr_tensor tcs = t3(cs, KVR_DTYPE_F32, b, K1, CONV), tcs2 = t3(cs2, KVR_DTYPE_F32, b, K1, CONV);
    CHECK_STATUS(kvr_gdn_pool_commit(rp, layer, &tid, &ta, conv_state ? &tcs : NULL, NULL), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_commit(cp, layer, &tid, &ta, conv_state ? &tcs2 : NULL, NULL), KVR_STATUS_OK);
    gdn_reference_commit(ids, acc, b, layer);
    if (conv_state)
        for (int i = 0; i < b; i++)
            if (ids[i] >= 0 && (memcmp(cs + (size_t)i * K1 * CONV, GWIN[ids[i]][layer], K1 * CONV * 4) != 0 ||
                                memcmp(cs2 + (size_t)i * K1 * CONV, GWIN[ids[i]][layer], K1 * CONV * 4) != 0))
                worst = fmax(worst, 1.0);
    return worst;
}

/* `threshold`: the replay pool's KV-only threshold (KVR_GDN_THRESHOLD_DEFAULT: off, its
 * sequences replay from the first token; GKV: they start KV-only). */
static void test_gdn_pool(kvr_context *ctx, kvr_gdn_threshold threshold) {
    const kvr_gdn_mode first = threshold > 0 ? KVR_GDN_MODE_KV_ONLY : KVR_GDN_MODE_REPLAY;
    rng_t r = rng_new(2);
    memset(GS_, 0, sizeof GS_);
    memset(GWIN, 0, sizeof GWIN);
    memset(GPEND, 0, sizeof GPEND);
    CHECK_STATUS(kvr_gdn_step_params_default(&STEP), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_step_params_default(NULL), KVR_STATUS_NULL_ARG);
    STEP.l2norm_qk = 1;
    kvr_gdn_pool_params p = gdn_params(RING);
    p.kv_only_threshold = threshold;
    kvr_gdn_pool *rp = NULL, *cp = NULL; /* replay pool, recurrent pool (a second client) */
    CHECK_STATUS(kvr_gdn_pool_new(ctx, &p, &rp), KVR_STATUS_OK);
    kvr_gdn_pool_params pc = gdn_params(0);
    pc.n_layers = GL;
    CHECK_STATUS(kvr_gdn_pool_new(ctx, &pc, &cp), KVR_STATUS_OK);
    int32_t a = -1, b = -1, c = -1, tmp = -1;
    CHECK_STATUS(kvr_gdn_pool_seq_add(rp, NULL, &a), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_seq_add(rp, NULL, &b), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_seq_add(rp, NULL, &c), KVR_STATUS_OK);
    for (int i = 0; i < 3; i++) CHECK_STATUS(kvr_gdn_pool_seq_add(cp, NULL, &tmp), KVR_STATUS_OK);
    CHECK(a == 0 && b == 1 && c == 2);
    kvr_gdn_cursor cur;
    CHECK_STATUS(kvr_gdn_pool_get_cursor(rp, 0, a, &cur), KVR_STATUS_OK);
    CHECK(cur.mode == first && cur.buffered == 0 && cur.pending == 0);
    CHECK_STATUS(kvr_gdn_pool_get_cursor(cp, 1, a, &cur), KVR_STATUS_OK);
    CHECK(cur.mode == KVR_GDN_MODE_RECURRENT);

    /* Rounds of decodes and verifies (random accepted prefixes, conv windows back), over
     * KV-only (with a threshold), ring flushes and a commit of every layer at once; c sits
     * out some rounds and an unused row rides along. */
    double worst = 0;
    int32_t ids3[3] = {a, b, c}, ids_gap[3] = {b, KVR_SEQ_NONE, a};
    for (int round = 0; round < 14; round++) {
        int layer = round % GL;
        const int32_t *ids = round % 3 == 2 ? ids_gap : ids3;
        int32_t acc[3];
        if (round % 4 == 3) {
            worst = fmax(worst, gdn_round(rp, cp, ids, 3, 0, layer, NULL, 0, &r));
            continue;
        }
        int T = 1 + rng_below(&r, MAXT);
        for (int i = 0; i < 3; i++) acc[i] = rng_below(&r, T + 1);
        int all = round % 5 == 4;
        worst = fmax(worst, gdn_round(rp, cp, ids, 3, T, all ? KVR_LAYER_ALL : layer, acc, !all && ids != ids_gap, &r));
    }
    CHECK_STATUS(kvr_gdn_pool_get_cursor(rp, 0, a, &cur), KVR_STATUS_OK);
    CHECK(cur.mode == KVR_GDN_MODE_REPLAY);
    for (int l = 0; l < GL; l++)
        for (int s = 0; s < 3; s++) worst = fmax(worst, gdn_check_state(rp, l, s));
    if (!(worst < 1e-4)) fprintf(stderr, "gdn: replay pool vs reference %.3e\n", worst);
    CHECK(worst < 1e-4);
    /* Import: the reference's states (f32, K-major) and conv windows into the recurrent
     * pool (the same values it holds, rounded to f32); both pools then decode alike. */
    for (int l = 0; l < GL; l++)
        for (int s = 0; s < 3; s++) {
            float st[GSTATE];
            for (int h = 0; h < GHV; h++)
                for (int ik = 0; ik < GD; ik++)
                    for (int iv = 0; iv < GD; iv++) st[(h * GD + ik) * GD + iv] = (float)GS_[s][l][h][iv * GD + ik];
            kvr_tensor ts = t3(st, KVR_DTYPE_F32, GHV, GD, GD), tw = t2(GWIN[s][l], KVR_DTYPE_F32, K1, CONV);
            CHECK_STATUS(kvr_gdn_pool_import_state(cp, l, s, &ts, &tw, NULL), KVR_STATUS_OK);
        }
    worst = gdn_round(rp, cp, ids3, 3, 0, 1, NULL, 0, &r);
    if (!(worst < 1e-4)) fprintf(stderr, "gdn: after import %.3e\n", worst);
    CHECK(worst < 1e-4);

    /* ---- error paths ---- (a verified and pending in layer 0; b and c clean) */
    static gdn_io x, x2;
    gdn_random(&x, &r);
    x2 = x;
    int32_t ida[1] = {a};
    kvr_tensor tida = t1(ida, KVR_DTYPE_I32, 1);
    gdn_t tv2 = gdn_tensors(&x, 1, 2), tv2c = gdn_tensors(&x2, 1, 2);
    CHECK_STATUS(gdn_call(rp, 0, &tida, &tv2, 1, &STEP), KVR_STATUS_OK);
    CHECK_STATUS(gdn_call(cp, 0, &tida, &tv2c, 1, &STEP), KVR_STATUS_OK);
    CHECK(gdn_reference(&x, x.out, x2.out, ida, 1, 2, 0) < 1e-4);
    static gdn_snap snap;
    gdn_snapshot(rp, &snap);
    CHECK(snap.cur[0][a].pending == 2);
    int32_t ids2[2] = {b, c}, out_seq = 77;
    kvr_tensor tid2 = t1(ids2, KVR_DTYPE_I32, 2);
    bigger_t big;
    /* Handles and ids. */
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_add(NULL, NULL, &out_seq), KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_add(STALE_GDN, NULL, &out_seq), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_add((kvr_gdn_pool *)ctx, NULL, &out_seq), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_add(rp, NULL, NULL), KVR_STATUS_NULL_ARG);
    CHECK(out_seq == 77);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_free(rp, 3, NULL), KVR_STATUS_UNKNOWN_ID);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_free(rp, -1, NULL), KVR_STATUS_UNKNOWN_ID);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_reset(rp, 3, NULL), KVR_STATUS_UNKNOWN_ID);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_reset(STALE_GDN, a, NULL), KVR_STATUS_INVALID_ARG);
    kvr_gdn_cursor c0 = {9, 9, 9, 9};
    GDN_FAILS(rp, &snap, kvr_gdn_pool_get_cursor(rp, 0, 3, &c0), KVR_STATUS_UNKNOWN_ID);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_get_cursor(rp, 2, a, &c0), KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_get_cursor(rp, -1, a, &c0), KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_get_cursor(rp, 0, a, NULL), KVR_STATUS_NULL_ARG);
    CHECK(c0.mode == 9 && c0.pending == 9);
    /* Import / export: shapes, dtypes, memory kinds, overlap, layers, pending drafts. */
    float st[GSTATE], win[K1 * CONV];
    fill(st, GSTATE, SENTINEL_F);
    fill(win, K1 * CONV, SENTINEL_F);
    kvr_tensor ts = t3(st, KVR_DTYPE_F32, GHV, GD, GD), tw = t2(win, KVR_DTYPE_F32, K1, CONV), bad;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, 0, a, &ts, NULL, NULL), KVR_STATUS_INVALID_ARG); /* pending */
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 0, a, &ts, NULL, NULL), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 1, b, NULL, NULL, NULL), KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, 1, b, NULL, NULL, NULL), KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 1, 3, &ts, NULL, NULL), KVR_STATUS_UNKNOWN_ID);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 2, b, &ts, NULL, NULL), KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, -1, b, &ts, NULL, NULL), KVR_STATUS_OUT_OF_RANGE);
    bad = t3(st, KVR_DTYPE_F32, GHV, GD, GD - 1);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 1, b, &bad, NULL, NULL), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, 1, b, &bad, NULL, NULL), KVR_STATUS_INVALID_ARG);
    bad = t3(st, KVR_DTYPE_I32, GHV, GD, GD);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 1, b, &bad, NULL, NULL), KVR_STATUS_DTYPE_MISMATCH);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, 1, b, &bad, NULL, NULL), KVR_STATUS_DTYPE_MISMATCH);
    bad = ts;
    bad.device = KVR_DEVICE_CUDA;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 1, b, &bad, NULL, NULL), KVR_STATUS_INVALID_ARG);
    bad = ts;
    bad.strides[0] = 0; /* every head at one address */
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, 1, b, &bad, NULL, NULL), KVR_STATUS_INVALID_ARG);
    bad = tw;
    bad.strides[0] = 1;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_export_state(rp, 1, b, &ts, &bad, NULL), KVR_STATUS_INVALID_ARG);
    bad = t2(win, KVR_DTYPE_F32, K1 + 1, CONV);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_import_state(rp, 1, b, &ts, &bad, NULL), KVR_STATUS_INVALID_ARG);
    CHECK(all_equal(st, GSTATE, SENTINEL_F) && all_equal(win, K1 * CONV, SENTINEL_F));
    /* Decode / verify. */
    gdn_random(&x, &r);
    gdn_t td = gdn_tensors(&x, 2, 0), tv = gdn_tensors(&x, 2, 3), t;
    kvr_tensor ib;
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tida, &tv2, 1, &STEP), KVR_STATUS_INVALID_ARG); /* second verify */
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tida, GREF(gdn_tensors(&x, 1, 0)), 0, &STEP), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_flush(rp, 0, &tida, NULL), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_flush(rp, KVR_LAYER_ALL, &tida, NULL), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, NULL, &td, 0, &STEP), KVR_STATUS_NULL_ARG);
    t = td;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_decode(rp, 0, &tid2, NULL, &t.k, &t.v, &t.g, &t.beta, &t.conv, &t.out, NULL, NULL),
              KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_decode(rp, 0, &tid2, &t.q, &t.k, &t.v, &t.g, &t.beta, NULL, &t.out, NULL, NULL),
              KVR_STATUS_NULL_ARG); /* the pool keeps conv windows */
    ib = t1(ids2, KVR_DTYPE_F32, 2);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &ib, &td, 0, &STEP), KVR_STATUS_DTYPE_MISMATCH);
    ib = t2(ids2, KVR_DTYPE_I32, 2, 1);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &ib, &td, 0, &STEP), KVR_STATUS_INVALID_ARG);
    ib = tid2;
    ib.device = KVR_DEVICE_CUDA;
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &ib, &td, 0, &STEP), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &ib, &tv, 1, &STEP), KVR_STATUS_UNSUPPORTED);
    ids2[1] = 3;
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &td, 0, &STEP), KVR_STATUS_UNKNOWN_ID);
    ids2[1] = b; /* b twice */
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &td, 0, &STEP), KVR_STATUS_INVALID_ARG);
    ids2[1] = c;
    {
        int32_t five[5] = {b, c, -1, -1, -1};
        kvr_tensor t5 = t1(five, KVR_DTYPE_I32, 5);
        GDN_FAILS(rp, &snap, gdn_call(rp, 0, &t5, &td, 0, &STEP), KVR_STATUS_OUT_OF_RANGE);
    }
    GDN_FAILS(rp, &snap, gdn_call(rp, 2, &tid2, &td, 0, &STEP), KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, gdn_call(rp, KVR_LAYER_ALL, &tid2, &td, 0, &STEP), KVR_STATUS_OUT_OF_RANGE);
    t = td;
    t.q = t3(x.q, KVR_DTYPE_F32, 2, GHK, GD + 1);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_INVALID_ARG);
    t = td;
    t.v = t3(x.v, KVR_DTYPE_F32, 2, GHV - 1, GD);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_INVALID_ARG);
    t = td;
    t.g = t2(x.g, KVR_DTYPE_I32, 2, GHV);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_DTYPE_MISMATCH);
    t = td;
    t.conv = t2(x.conv, KVR_DTYPE_F32, 2, CONV + 1);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_INVALID_ARG);
    t = td;
    t.out.strides[1] = 0;
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_INVALID_ARG);
    t = td;
    t.k.device = KVR_DEVICE_CUDA;
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_INVALID_ARG);
    t = gdn_tensors(&x, 2, 2); /* decode takes one token */
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 0, &STEP), KVR_STATUS_INVALID_ARG);
    t = gdn_tensors(&x, 2, MAXT + 1);
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 1, &STEP), KVR_STATUS_OUT_OF_RANGE);
    t = tv;
    t.k = t4(x.k, KVR_DTYPE_F32, 2, 2, GHK, GD); /* T differs from q's */
    GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &t, 1, &STEP), KVR_STATUS_INVALID_ARG);
    {
        kvr_gdn_step_params sp = STEP;
        sp.scale = (float)NAN;
        GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &td, 0, &sp), KVR_STATUS_INVALID_ARG);
        sp = STEP;
        sp.struct_size = 2;
        GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &td, 0, &sp), KVR_STATUS_INVALID_ARG);
        GDN_FAILS(rp, &snap, gdn_call(rp, 0, &tid2, &tv, 1, newer_struct(&big, &STEP, sizeof STEP, 1)),
                  KVR_STATUS_INVALID_ARG);
    }
    CHECK(all_equal(x.out, sizeof x.out / 4, SENTINEL_F));
    /* Commit / flush. */
    int32_t acc1[1] = {1}, acc2[2] = {1, 1}, big_acc[1] = {3}, neg[1] = {-1};
    float facc[1] = {1};
    float cs[2 * K1 * CONV];
    fill(cs, sizeof cs / 4, SENTINEL_F);
    kvr_tensor ta = t1(acc1, KVR_DTYPE_I32, 1), tcs = t3(cs, KVR_DTYPE_F32, 1, K1, CONV);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tid2, TREF(t1(acc2, KVR_DTYPE_I32, 2)), NULL, NULL),
              KVR_STATUS_INVALID_ARG); /* no verified drafts */
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 1, &tida, &ta, NULL, NULL), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, KVR_LAYER_ALL, &tida, &ta, NULL, NULL), KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, TREF(t1(big_acc, KVR_DTYPE_I32, 1)), NULL, NULL),
              KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, TREF(t1(neg, KVR_DTYPE_I32, 1)), NULL, NULL),
              KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, TREF(t1(acc2, KVR_DTYPE_I32, 2)), NULL, NULL),
              KVR_STATUS_INVALID_ARG); /* accepted [2] for one id: a shape */
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, TREF(t2(acc1, KVR_DTYPE_I32, 1, 1)), NULL, NULL),
              KVR_STATUS_INVALID_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, TREF(t1(facc, KVR_DTYPE_F32, 1)), NULL, NULL),
              KVR_STATUS_DTYPE_MISMATCH);
    bad = ta;
    bad.device = KVR_DEVICE_CUDA;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, &bad, NULL, NULL), KVR_STATUS_INVALID_ARG);
    bad = tida;
    bad.device = KVR_DEVICE_CUDA;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &bad, &ta, NULL, NULL), KVR_STATUS_UNSUPPORTED);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_flush(rp, 1, &bad, NULL), KVR_STATUS_UNSUPPORTED);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, NULL, NULL, NULL), KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, NULL, &ta, NULL, NULL), KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, -2, &tida, &ta, NULL, NULL), KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, KVR_LAYER_ALL, &tida, &ta, &tcs, NULL), KVR_STATUS_INVALID_ARG);
    bad = t3(cs, KVR_DTYPE_F32, 1, K1 + 1, CONV);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, &ta, &bad, NULL), KVR_STATUS_INVALID_ARG);
    bad = t3(cs, KVR_DTYPE_I32, 1, K1, CONV);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, &ta, &bad, NULL), KVR_STATUS_DTYPE_MISMATCH);
    bad = tcs;
    bad.strides[1] = 0;
    GDN_FAILS(rp, &snap, kvr_gdn_pool_commit(rp, 0, &tida, &ta, &bad, NULL), KVR_STATUS_INVALID_ARG);
    CHECK(all_equal(cs, sizeof cs / 4, SENTINEL_F));
    GDN_FAILS(rp, &snap, kvr_gdn_pool_flush(rp, 2, &tid2, NULL), KVR_STATUS_OUT_OF_RANGE);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_flush(rp, 1, NULL, NULL), KVR_STATUS_NULL_ARG);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_flush(rp, 1, TREF(t1(ids2, KVR_DTYPE_F32, 2)), NULL), KVR_STATUS_DTYPE_MISMATCH);
    /* The pool is as it was: commit a's drafts, check every state, decode all. */
    CHECK_STATUS(kvr_gdn_pool_commit(rp, 0, &tida, &ta, &tcs, NULL), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_commit(cp, 0, &tida, &ta, NULL, NULL), KVR_STATUS_OK);
    gdn_reference_commit(ida, acc1, 1, 0);
    CHECK(memcmp(cs, GWIN[a][0], K1 * CONV * 4) == 0);
    worst = 0;
    for (int l = 0; l < GL; l++)
        for (int s = 0; s < 3; s++) worst = fmax(worst, gdn_check_state(rp, l, s));
    worst = fmax(worst, gdn_round(rp, cp, ids3, 3, 0, 0, NULL, 0, &r));
    /* Flush writes checkpoints and changes no result; reset and free. */
    kvr_tensor tid3 = t1(ids3, KVR_DTYPE_I32, 3);
    CHECK_STATUS(kvr_gdn_pool_flush(rp, KVR_LAYER_ALL, &tid3, NULL), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_get_cursor(rp, 1, b, &cur), KVR_STATUS_OK);
    CHECK(cur.mode == KVR_GDN_MODE_REPLAY && cur.buffered == 0);
    worst = fmax(worst, gdn_round(rp, cp, ids3, 3, 2, 1, (const int32_t[]){2, 0, 1}, 1, &r));
    CHECK_STATUS(kvr_gdn_pool_seq_reset(rp, b, NULL), KVR_STATUS_OK);
    gdn_reference_reset(b);
    CHECK_STATUS(kvr_gdn_pool_get_cursor(rp, 0, b, &cur), KVR_STATUS_OK);
    CHECK(cur.mode == first && cur.buffered == 0);
    for (int l = 0; l < GL; l++)
        for (int s = 0; s < 3; s++) worst = fmax(worst, gdn_check_state(rp, l, s));
    if (!(worst < 1e-4)) fprintf(stderr, "gdn after the error paths: %.3e\n", worst);
    CHECK(worst < 1e-4);
    /* Exhausted slots; freed ids come back lowest first. */
    int32_t d = -1, e = -1;
    CHECK_STATUS(kvr_gdn_pool_seq_add(rp, NULL, &d), KVR_STATUS_OK);
    CHECK(d == 3);
    gdn_snapshot(rp, &snap);
    GDN_FAILS(rp, &snap, kvr_gdn_pool_seq_add(rp, NULL, &e), KVR_STATUS_POOL_EXHAUSTED);
    CHECK(e == -1);
    CHECK_STATUS(kvr_gdn_pool_seq_free(rp, b, NULL), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_seq_free(rp, b, NULL), KVR_STATUS_UNKNOWN_ID);
    CHECK_STATUS(kvr_gdn_pool_seq_add(rp, NULL, &e), KVR_STATUS_OK);
    CHECK(e == b);
    gdn_reference_reset(b);
    CHECK(gdn_check_state(rp, 0, b) == 0); /* a reused slot starts empty */
    /* Stale handles after free; a foreign handle (a KV pool's) is refused. */
    kvr_kv_pool_params kp = kv_params();
    kvr_kv_pool *kv = NULL;
    CHECK_STATUS(kvr_kv_pool_new(ctx, &kp, &kv), KVR_STATUS_OK);
    CHECK_STATUS(kvr_gdn_pool_seq_add((kvr_gdn_pool *)kv, NULL, &e), KVR_STATUS_INVALID_ARG);
    CHECK_STATUS(kvr_kv_pool_seq_add((kvr_kv_pool *)rp, NULL, &e), KVR_STATUS_INVALID_ARG);
    kvr_gdn_pool_free((kvr_gdn_pool *)kv); /* the wrong kind: ignored, recorded */
    CHECK(strstr(kvr_error_last_message(), "kvr_gdn_pool") != NULL);
    CHECK_STATUS(kvr_kv_pool_seq_add(kv, NULL, &e), KVR_STATUS_OK); /* still alive */
    kvr_kv_pool_free(kv);
    kvr_gdn_pool_free(rp);
    kvr_gdn_pool_free(cp);
    CHECK_STATUS(kvr_gdn_pool_get_cursor(rp, 0, a, &cur), KVR_STATUS_INVALID_ARG);
    CHECK_STATUS(kvr_gdn_pool_seq_add(rp, NULL, &e), KVR_STATUS_INVALID_ARG);
    kvr_gdn_pool_free(rp);
    kvr_gdn_pool_free(NULL);
}

/* A pool over caller-owned bf16 states: an f32 import rounds to nearest even. */
static void test_gdn_rounding(kvr_context *ctx) {
    kvr_gdn_pool_params p = gdn_params(RING);
    p.n_layers = 1;
    p.state_dtype = KVR_DTYPE_BF16;
    p.kv_only_threshold = KVR_GDN_THRESHOLD_OFF;
    static uint16_t mem[GS][GSTATE];
    kvr_gdn_state_storage storage = {mem, GSTATE};
    p.states = &storage;
    kvr_gdn_pool *pool = NULL;
    CHECK_STATUS(kvr_gdn_pool_new(ctx, &p, &pool), KVR_STATUS_OK);
    int32_t s = -1;
    CHECK_STATUS(kvr_gdn_pool_seq_add(pool, NULL, &s), KVR_STATUS_OK);
    float st[GSTATE];
    for (int i = 0; i < GSTATE; i++) st[i] = 1.0f + (float)(2 * (i % 64) + 1) / 256.0f; /* bf16 ties */
    kvr_tensor ts = t3(st, KVR_DTYPE_F32, GHV, GD, GD);
    CHECK_STATUS(kvr_gdn_pool_import_state(pool, 0, s, &ts, NULL, NULL), KVR_STATUS_OK);
    int bad = 0;
    for (int i = 0; i < GSTATE; i++) {
        float want = bf16_round(st[i]);
        uint32_t w;
        memcpy(&w, &want, 4);
        if (mem[s][i] != (uint16_t)(w >> 16)) bad++;
    }
    CHECK(bad == 0);
    kvr_gdn_pool_free(pool);
}

int main(void) {
    kvr_context *ctx = cpu_context(2);
    CHECK(ctx != NULL);
    if (!ctx) return finish("test_pools");
    test_kv_params_and_new(ctx);
    test_kv_pool(ctx);
    test_kv_rounding(ctx);
    test_gdn_params(ctx);
    test_gdn_pool(ctx, KVR_GDN_THRESHOLD_DEFAULT);
    test_gdn_pool(ctx, GKV);
    test_gdn_rounding(ctx);
    kvr_context_free(ctx);
    return finish("test_pools");
}
