/* The pools from several threads (pthreads), on the CPU backend:
 *   1. threads with their own contexts and pools, all at once;
 *   2. one KV pool shared by every thread (the header: pool calls are thread-safe, they take
 *      the pool's lock), each thread adding, appending to, forking, truncating, decoding
 *      and freeing its own sequences while the others do the same and read the stats;
 *   3. one GDN pool shared the same way (decode, verify and commit of each thread's
 *      sequence);
 *   4. a pool freed by one thread while others call it: calls in flight finish, later ones
 *      get KVR_STATUS_INVALID_ARG; the context handle freed while its pools work.
 * Every output is checked against the references of pools_common.h. Built -Werror, run
 * plain, under ASan + UBSan and under valgrind (scripts/test.sh). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "pools_common.h"

enum { NT = 4 };

/* Thread-safe failure counting (check.h's counters are for the main thread). */
static atomic_int t_failures, t_checks;
#define TCHECK(cond)                                                                         \
    do {                                                                                     \
        atomic_fetch_add(&t_checks, 1);                                                      \
        if (!(cond)) {                                                                       \
            atomic_fetch_add(&t_failures, 1);                                                \
            fprintf(stderr, "%s:%d: CHECK failed in a thread: %s (last error: %s)\n", __FILE__, \
                    __LINE__, #cond, kvr_error_last_message());                              \
        }                                                                                    \
    } while (0)
#define TOK(expr) TCHECK((expr) == KVR_STATUS_OK)

/* ---- KV client: one thread's sequences and their host copy ---- */
enum { L = 2, HKV = 2, HQ = 4, D = 8, PAGE = 4, MAXLEN = 32, KV_SEQS = NT * 2 };

typedef struct {
    kvr_kv_pool *pool;
    int32_t seq[2]; /* own sequence and (at times) a fork of it, -1 when none */
    int64_t len[2];
    float k[2][L][MAXLEN][HKV][D], v[2][L][MAXLEN][HKV][D];
    rng_t r;
} kv_client;

static kvr_kv_pool *kv_pool_new(kvr_context *ctx, int max_seqs, int pages) {
    kvr_kv_pool_params p;
    kvr_kv_pool *pool = NULL;
    if (kvr_kv_pool_params_default(&p) != KVR_STATUS_OK) return NULL;
    p.n_layers = L;
    p.n_kv_heads = HKV;
    p.head_dim = D;
    p.page_size = PAGE;
    p.capacity_pages = pages;
    p.dtype = KVR_DTYPE_F32;
    p.max_seqs = max_seqs;
    p.max_seq_len = MAXLEN;
    if (kvr_kv_pool_new(ctx, &p, &pool) != KVR_STATUS_OK) return NULL;
    return pool;
}

static void kv_append(kv_client *c, int i, int n) {
    float k[L][MAXLEN][HKV][D], v[L][MAXLEN][HKV][D];
    rng_fill(&c->r, &k[0][0][0][0], (size_t)L * MAXLEN * HKV * D, -1, 1);
    rng_fill(&c->r, &v[0][0][0][0], (size_t)L * MAXLEN * HKV * D, -1, 1);
    kvr_tensor tk = t4(k, KVR_DTYPE_F32, L, n, HKV, D), tv = t4(v, KVR_DTYPE_F32, L, n, HKV, D);
    tk.strides[0] = tv.strides[0] = MAXLEN * HKV * D;
    TOK(kvr_kv_pool_append(c->pool, c->seq[i], &tk, &tv, NULL));
    for (int l = 0; l < L; l++)
        for (int t = 0; t < n; t++) {
            memcpy(c->k[i][l][c->len[i] + t], k[l][t], sizeof k[l][t]);
            memcpy(c->v[i][l][c->len[i] + t], v[l][t], sizeof v[l][t]);
        }
    c->len[i] += n;
}

/* Decodes T queries of sequence i (one layer) and checks them against naive attention. */
static void kv_decode(kv_client *c, int i, int T, int layer) {
    float q[8 * HQ * D], out[8 * HQ * D];
    double ref[D];
    rng_fill(&c->r, q, (size_t)T * HQ * D, -1, 1);
    int32_t id = c->seq[i];
    kvr_tensor tid = t1(&id, KVR_DTYPE_I32, 1), tq = t4(q, KVR_DTYPE_F32, 1, T, HQ, D),
               to = t4(out, KVR_DTYPE_F32, 1, T, HQ, D);
    TOK(kvr_kv_pool_decode(c->pool, layer, &tid, &tq, &to, NULL, NULL, NULL));
    double worst = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < HQ; h++) {
            int kh = h / (HQ / HKV), n = (int)c->len[i] - (T - 1 - t);
            attention_ref(q + (t * HQ + h) * D, &c->k[i][layer][0][kh][0], &c->v[i][layer][0][kh][0], HKV * D, 0,
                          n, D, 1.0 / sqrt((double)D), 0, ref);
            worst = fmax(worst, rel_err_f(out + (t * HQ + h) * D, ref, D));
        }
    TCHECK(worst < 1e-5);
}

/* A random mix of pool calls on the client's own sequences; `iters` operations. */
static void kv_work(kv_client *c, int iters) {
    TOK(kvr_kv_pool_seq_add(c->pool, NULL, &c->seq[0]));
    c->len[0] = 0;
    c->seq[1] = -1;
    kv_append(c, 0, 1 + rng_below(&c->r, 6));
    for (int it = 0; it < iters; it++) {
        int op = rng_below(&c->r, 6);
        int64_t n = -1;
        kvr_kv_pool_stats st;
        memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        switch (op) {
        case 0: /* append */
            if (c->len[0] + 3 <= MAXLEN) kv_append(c, 0, 1 + rng_below(&c->r, 3));
            break;
        case 1: /* truncate (speculative rollback) */
            if (c->len[0] > 2) {
                int64_t keep = 1 + rng_below(&c->r, (int)c->len[0] - 1);
                TOK(kvr_kv_pool_seq_truncate(c->pool, c->seq[0], keep, NULL));
                c->len[0] = keep;
            }
            break;
        case 2: /* fork, append to the child (copy-on-write), or free the child */
            if (c->seq[1] < 0) {
                TOK(kvr_kv_pool_seq_fork(c->pool, c->seq[0], NULL, &c->seq[1]));
                memcpy(c->k[1], c->k[0], sizeof c->k[0]);
                memcpy(c->v[1], c->v[0], sizeof c->v[0]);
                c->len[1] = c->len[0];
            } else if (c->len[1] + 2 <= MAXLEN && rng_below(&c->r, 2)) {
                kv_append(c, 1, 1 + rng_below(&c->r, 2));
                kv_decode(c, 1, 1, rng_below(&c->r, L));
            } else {
                TOK(kvr_kv_pool_seq_free(c->pool, c->seq[1], NULL));
                c->seq[1] = -1;
            }
            break;
        case 3: /* stats: a consistent snapshot */
            TOK(kvr_kv_pool_get_stats(c->pool, &st));
            TCHECK(st.pages_used + st.pages_free == st.pages_total && st.pages_shared <= st.pages_used);
            break;
        default:
            TOK(kvr_kv_pool_get_seq_len(c->pool, c->seq[0], &n));
            TCHECK(n == c->len[0]);
            kv_decode(c, 0, c->len[0] >= 2 && rng_below(&c->r, 2) ? 2 : 1, rng_below(&c->r, L));
        }
    }
    kv_decode(c, 0, 1, 0);
    if (c->seq[1] >= 0) {
        kv_decode(c, 1, 1, 1);
        TOK(kvr_kv_pool_seq_free(c->pool, c->seq[1], NULL));
    }
    TOK(kvr_kv_pool_seq_free(c->pool, c->seq[0], NULL));
}

/* ---- GDN client: one sequence of a replay pool and its f64 reference ---- */
enum { GHK = 2, GHV = 4, GD = 8, MAXT = 4, RING = 8 };
/* The KV-only threshold of the pools in KV-only mode (the default is off): min(dk, the
 * entries one head's state holds) = min(8, 256 / 68). */
enum { GKV = 3 };

typedef struct {
    kvr_gdn_pool *pool;
    int32_t seq;
    double S[GHV][GD * GD], snap[MAXT][GHV][GD * GD];
    rng_t r;
} gdn_client;

static kvr_gdn_pool *gdn_pool_new(kvr_context *ctx, int max_seqs, kvr_gdn_threshold threshold) {
    kvr_gdn_pool_params p;
    kvr_gdn_pool *pool = NULL;
    if (kvr_gdn_pool_params_default(&p) != KVR_STATUS_OK) return NULL;
    p.kv_only_threshold = threshold;
    p.n_layers = 1;
    p.n_k_heads = GHK;
    p.n_v_heads = GHV;
    p.dk = GD;
    p.dv = GD;
    p.ring_len = RING;
    p.max_drafts = MAXT;
    p.max_seqs = max_seqs;
    if (kvr_gdn_pool_new(ctx, &p, &pool) != KVR_STATUS_OK) return NULL;
    return pool;
}

/* One decode (T = 0) or a verify of T drafts committing a random prefix. */
static void gdn_step(gdn_client *c, int T) {
    int TT = T ? T : 1;
    float q[MAXT * GHK * GD], k[MAXT * GHK * GD], v[MAXT * GHV * GD], g[MAXT * GHV], beta[MAXT * GHV];
    float out[MAXT * GHV * GD];
    rng_fill(&c->r, q, sizeof q / 4, -1, 1);
    rng_fill(&c->r, k, sizeof k / 4, -1, 1);
    rng_fill(&c->r, v, sizeof v / 4, -1, 1);
    rng_fill(&c->r, g, sizeof g / 4, -0.4f, -0.01f);
    rng_fill(&c->r, beta, sizeof beta / 4, 0.1f, 0.9f);
    kvr_tensor tid = t1(&c->seq, KVR_DTYPE_I32, 1);
    kvr_gdn_step_params sp;
    TOK(kvr_gdn_step_params_default(&sp));
    sp.l2norm_qk = 1;
    if (T == 0) {
        kvr_tensor tq = t3(q, KVR_DTYPE_F32, 1, GHK, GD), tk = t3(k, KVR_DTYPE_F32, 1, GHK, GD),
                   tv = t3(v, KVR_DTYPE_F32, 1, GHV, GD), tg = t2(g, KVR_DTYPE_F32, 1, GHV),
                   tb = t2(beta, KVR_DTYPE_F32, 1, GHV), to = t3(out, KVR_DTYPE_F32, 1, GHV, GD);
        TOK(kvr_gdn_pool_decode(c->pool, 0, &tid, &tq, &tk, &tv, &tg, &tb, NULL, &to, &sp, NULL));
    } else {
        kvr_tensor tq = t4(q, KVR_DTYPE_F32, 1, T, GHK, GD), tk = t4(k, KVR_DTYPE_F32, 1, T, GHK, GD),
                   tv = t4(v, KVR_DTYPE_F32, 1, T, GHV, GD), tg = t3(g, KVR_DTYPE_F32, 1, T, GHV),
                   tb = t3(beta, KVR_DTYPE_F32, 1, T, GHV), to = t4(out, KVR_DTYPE_F32, 1, T, GHV, GD);
        TOK(kvr_gdn_pool_verify(c->pool, 0, &tid, &tq, &tk, &tv, &tg, &tb, NULL, &to, &sp, NULL));
    }
    double S[GHV][GD * GD], y[GD], worst = 0;
    memcpy(S, c->S, sizeof S);
    for (int t = 0; t < TT; t++) {
        for (int h = 0; h < GHV; h++) {
            int kh = h / (GHV / GHK);
            gdn_ref_step(S[h], GD, GD, q + (t * GHK + kh) * GD, k + (t * GHK + kh) * GD, v + (t * GHV + h) * GD,
                         g[t * GHV + h], beta[t * GHV + h], 1.0 / sqrt((double)GD), y);
            worst = fmax(worst, rel_err_f(out + (t * GHV + h) * GD, y, GD));
        }
        memcpy(c->snap[t], S, sizeof S);
    }
    TCHECK(worst < 1e-4);
    int32_t acc = T ? rng_below(&c->r, T + 1) : 1;
    if (T) {
        kvr_tensor ta = t1(&acc, KVR_DTYPE_I32, 1);
        TOK(kvr_gdn_pool_commit(c->pool, 0, &tid, &ta, NULL, NULL));
    }
    if (acc > 0) memcpy(c->S, c->snap[acc - 1], sizeof c->S);
}

static void gdn_check_state(gdn_client *c) {
    float st[GHV * GD * GD];
    double want[GHV * GD * GD];
    kvr_tensor ts = t3(st, KVR_DTYPE_F32, GHV, GD, GD);
    TOK(kvr_gdn_pool_export_state(c->pool, 0, c->seq, &ts, NULL, NULL));
    for (int h = 0; h < GHV; h++)
        for (int ik = 0; ik < GD; ik++)
            for (int iv = 0; iv < GD; iv++) want[(h * GD + ik) * GD + iv] = c->S[h][iv * GD + ik];
    TCHECK(rel_err_f(st, want, GHV * GD * GD) < 1e-4);
}

static void gdn_work(gdn_client *c, int iters) {
    TOK(kvr_gdn_pool_seq_add(c->pool, NULL, &c->seq));
    memset(c->S, 0, sizeof c->S);
    for (int it = 0; it < iters; it++) {
        int op = rng_below(&c->r, 4);
        if (op == 0) {
            kvr_gdn_cursor cur;
            TOK(kvr_gdn_pool_get_cursor(c->pool, 0, c->seq, &cur));
            TCHECK(cur.pending == 0 && cur.mode != KVR_GDN_MODE_RECURRENT);
            gdn_check_state(c);
        } else {
            gdn_step(c, op == 1 ? 0 : 1 + rng_below(&c->r, MAXT));
        }
    }
    gdn_check_state(c);
    TOK(kvr_gdn_pool_seq_free(c->pool, c->seq, NULL));
}

/* ---- 1. threads with their own contexts and pools ---- */
typedef struct {
    int index;
    kv_client kv;
    gdn_client gdn;
} own_arg;

static void *own_pools(void *p) {
    own_arg *a = p;
    kvr_context *ctx = cpu_context(1 + a->index % 2);
    TCHECK(ctx != NULL);
    if (!ctx) return NULL;
    a->kv.pool = kv_pool_new(ctx, 2, 16);
    /* Sequences in KV-only mode first on odd threads, in replay mode (the default) on even. */
    a->gdn.pool = gdn_pool_new(ctx, 1, a->index % 2 ? GKV : KVR_GDN_THRESHOLD_DEFAULT);
    TCHECK(a->kv.pool && a->gdn.pool);
    kvr_context_free(ctx); /* the pools keep it alive */
    if (a->kv.pool && a->gdn.pool) {
        kv_work(&a->kv, 40);
        gdn_work(&a->gdn, 30);
    }
    kvr_kv_pool_free(a->kv.pool);
    kvr_gdn_pool_free(a->gdn.pool);
    return NULL;
}

/* ---- 2, 3. shared pools ---- */
typedef struct {
    kv_client kv;
    gdn_client gdn;
    int iters;
} shared_arg;

static void *shared_kv(void *p) {
    shared_arg *a = p;
    kv_work(&a->kv, a->iters);
    return NULL;
}
static void *shared_gdn(void *p) {
    shared_arg *a = p;
    gdn_work(&a->gdn, a->iters);
    return NULL;
}

/* ---- 4. a pool freed while other threads call it ---- */
typedef struct {
    kvr_kv_pool *kv;
    kvr_gdn_pool *gdn;
    int32_t seq;
    atomic_int *calls;
    int after_free_ok; /* OK results seen after the pool was already freed */
} race_arg;
static atomic_int freed;

static void *race(void *p) {
    race_arg *a = p;
    for (;;) {
        int was_freed = atomic_load(&freed);
        kvr_kv_pool_stats st;
        memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        kvr_gdn_cursor cur;
        kvr_status s1 = kvr_kv_pool_get_stats(a->kv, &st);
        kvr_status s2 = kvr_gdn_pool_get_cursor(a->gdn, 0, a->seq, &cur);
        atomic_fetch_add(a->calls, 1);
        TCHECK(s1 == KVR_STATUS_OK || s1 == KVR_STATUS_INVALID_ARG);
        TCHECK(s2 == KVR_STATUS_OK || s2 == KVR_STATUS_INVALID_ARG);
        if (s1 == KVR_STATUS_OK) TCHECK(st.pages_total == 16);
        if (was_freed && (s1 == KVR_STATUS_OK || s2 == KVR_STATUS_OK)) a->after_free_ok++;
        if (s1 == KVR_STATUS_INVALID_ARG && s2 == KVR_STATUS_INVALID_ARG) break;
        sched_yield();
    }
    return NULL;
}

int main(void) {
    pthread_t th[NT];
    /* 1. */
    own_arg *own = calloc(NT, sizeof *own);
    CHECK(own != NULL);
    if (!own) return finish("test_threads");
    for (int i = 0; i < NT; i++) {
        own[i].index = i;
        own[i].kv.r = rng_new(100 + i);
        own[i].gdn.r = rng_new(200 + i);
        CHECK(pthread_create(&th[i], NULL, own_pools, &own[i]) == 0);
    }
    for (int i = 0; i < NT; i++) CHECK(pthread_join(th[i], NULL) == 0);
    free(own);

    /* 2, 3. One KV pool and one GDN pool, every thread at once. */
    kvr_context *ctx = cpu_context(2);
    CHECK(ctx != NULL);
    if (!ctx) return finish("test_threads");
    kvr_kv_pool *kv = kv_pool_new(ctx, KV_SEQS, KV_SEQS * (MAXLEN / PAGE));
    kvr_gdn_pool *gdn = gdn_pool_new(ctx, NT, GKV); /* KV-only transitions under the lock */
    CHECK(kv && gdn);
    shared_arg *sh = calloc(NT, sizeof *sh);
    CHECK(sh != NULL);
    if (!kv || !gdn || !sh) return finish("test_threads");
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < NT; i++) {
            sh[i].kv.pool = kv;
            sh[i].gdn.pool = gdn;
            sh[i].kv.r = rng_new(300 + 10 * round + i);
            sh[i].gdn.r = rng_new(400 + 10 * round + i);
            sh[i].iters = 40;
            CHECK(pthread_create(&th[i], NULL, round == 0 ? shared_kv : shared_gdn, &sh[i]) == 0);
        }
        for (int i = 0; i < NT; i++) CHECK(pthread_join(th[i], NULL) == 0);
    }
    /* Both at once, the KV side on odd threads. */
    for (int i = 0; i < NT; i++) {
        sh[i].iters = 25;
        CHECK(pthread_create(&th[i], NULL, i % 2 ? shared_kv : shared_gdn, &sh[i]) == 0);
    }
    for (int i = 0; i < NT; i++) CHECK(pthread_join(th[i], NULL) == 0);
    kvr_kv_pool_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_STATUS(kvr_kv_pool_get_stats(kv, &st), KVR_STATUS_OK);
    CHECK(st.sequences == 0 && st.pages_used == 0 && st.pages_free == st.pages_total && st.tokens == 0);
    int32_t s0 = -1;
    CHECK_STATUS(kvr_gdn_pool_seq_add(gdn, NULL, &s0), KVR_STATUS_OK);
    CHECK(s0 == 0); /* every slot came back */
    free(sh);
    kvr_kv_pool_free(kv);
    kvr_gdn_pool_free(gdn);

    /* 4. Threads call two pools while the main thread frees them (and the context). */
    kv = kv_pool_new(ctx, 2, 16);
    gdn = gdn_pool_new(ctx, 1, KVR_GDN_THRESHOLD_DEFAULT);
    CHECK(kv && gdn);
    int32_t seq = -1;
    CHECK_STATUS(kvr_gdn_pool_seq_add(gdn, NULL, &seq), KVR_STATUS_OK);
    kvr_context_free(ctx);
    atomic_int calls;
    atomic_init(&calls, 0);
    atomic_init(&freed, 0);
    race_arg ra[NT];
    for (int i = 0; i < NT; i++) {
        ra[i].kv = kv;
        ra[i].gdn = gdn;
        ra[i].seq = seq;
        ra[i].calls = &calls;
        ra[i].after_free_ok = 0;
        CHECK(pthread_create(&th[i], NULL, race, &ra[i]) == 0);
    }
    while (atomic_load(&calls) < 20 * NT) sched_yield();
    kvr_kv_pool_free(kv);
    kvr_gdn_pool_free(gdn);
    atomic_store(&freed, 1);
    for (int i = 0; i < NT; i++) CHECK(pthread_join(th[i], NULL) == 0);
    /* A call that began after the free finished cannot succeed. */
    for (int i = 0; i < NT; i++) CHECK(ra[i].after_free_ok == 0);

    int tf = atomic_load(&t_failures), tc = atomic_load(&t_checks);
    g_failures += tf;
    g_checks += tc;
    return finish("test_threads");
}
