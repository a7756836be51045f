/* The paged KV pool as an engine drives it: a pool for 2 attention layers, three sequences
 * prefilled by append, one decode step for the batch in one call, a fork that shares pages
 * (copy-on-write when the child appends into the shared partial page), a speculative round
 * (4 draft tokens verified with T = 4 queries, 2 rejected by truncate), pool stats, and a
 * checksum. Every decode output is checked against a naive attention over the same K/V.
 *
 *   paged_decode [cpu|cuda]     (default: CUDA when usable, else CPU)
 */
#include <math.h>

#include "example_mem.h"

enum { LAYERS = 2, HKV = 2, HQ = 8, D = 64, PAGE = 16, MAXLEN = 256, SEQS = 4 };

/* Host copies of every sequence's K and V: [seq][layer][token][head][dim]. */
static float K[SEQS][LAYERS][MAXLEN][HKV][D], V[SEQS][LAYERS][MAXLEN][HKV][D];
static int len[SEQS];

static void append(kvr_kv_pool *pool, int seq, int n) {
    static float k[LAYERS][MAXLEN][HKV][D], v[LAYERS][MAXLEN][HKV][D];
    for (int l = 0; l < LAYERS; l++)
        for (int t = 0; t < n; t++)
            for (int h = 0; h < HKV; h++)
                for (int d = 0; d < D; d++) {
                    k[l][t][h][d] = K[seq][l][len[seq] + t][h][d] = uniform(-1, 1);
                    v[l][t][h][d] = V[seq][l][len[seq] + t][h][d] = uniform(-1, 1);
                }
    /* K/V from host memory (also on CUDA: the pool copies them in on the stream). */
    const int64_t shape[4] = {LAYERS, n, HKV, D}, strides[4] = {MAXLEN * HKV * D, HKV * D, D, 1};
    kvr_tensor tk = tensor(k, KVR_DTYPE_F32, 4, shape, 1), tv = tensor(v, KVR_DTYPE_F32, 4, shape, 1);
    for (int i = 0; i < 4; i++) tk.strides[i] = tv.strides[i] = strides[i];
    CHECK(kvr_kv_pool_append(pool, seq, &tk, &tv, NULL));
    len[seq] += n;
}

/* Naive attention of one query head against `seq`'s first `n` tokens of `layer`. */
static void reference(int seq, int layer, int n, const float *q, int qh, float *out) {
    int kh = qh / (HQ / HKV);
    double m = -1e300, sum = 0, acc[D] = {0};
    double s[MAXLEN];
    for (int t = 0; t < n; t++) {
        double dot = 0;
        for (int d = 0; d < D; d++) dot += (double)q[d] * K[seq][layer][t][kh][d];
        s[t] = dot / sqrt((double)D);
        if (s[t] > m) m = s[t];
    }
    for (int t = 0; t < n; t++) {
        double p = exp(s[t] - m);
        sum += p;
        for (int d = 0; d < D; d++) acc[d] += p * V[seq][layer][t][kh][d];
    }
    for (int d = 0; d < D; d++) out[d] = (float)(acc[d] / sum);
}

/* Decodes T query tokens for each listed sequence in one call; returns the largest error
 * against the reference (the KV is stored as f16, so ~1e-3) and adds to the checksum. */
static double decode(kvr_kv_pool *pool, const int32_t *ids, int b, int T, int layer, double *checksum) {
    size_t n = (size_t)b * T * HQ * D;
    float *q = malloc(n * 4), *o = malloc(n * 4), *ref = malloc(D * 4);
    for (size_t i = 0; i < n; i++) q[i] = uniform(-1, 1);
    void *dq = buf_new(n * 4), *dout = buf_new(n * 4);
    buf_put(dq, q, n * 4);
    const int64_t sq[4] = {b, T, HQ, D}, sid[1] = {b};
    kvr_tensor tq = tensor(dq, KVR_DTYPE_F32, 4, sq, 0), to = tensor(dout, KVR_DTYPE_F32, 4, sq, 0);
    kvr_tensor tid = tensor((void *)ids, KVR_DTYPE_I32, 1, sid, 1);
    CHECK(kvr_kv_pool_decode(pool, layer, &tid, &tq, &to, NULL, NULL, NULL));
    buf_get(o, dout, n * 4);
    double worst = 0;
    for (int i = 0; i < b; i++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < HQ; h++) {
                /* Query t of T sees the sequence up to its own position (causal drafts). */
                const float *qq = q + (((size_t)i * T + t) * HQ + h) * D;
                reference(ids[i], layer, len[ids[i]] - (T - 1 - t), qq, h, ref);
                for (int d = 0; d < D; d++) {
                    float got = o[(((size_t)i * T + t) * HQ + h) * D + d];
                    double e = fabs(got - ref[d]);
                    if (e > worst) worst = e;
                    *checksum += got;
                }
            }
    buf_free(dq);
    buf_free(dout);
    free(q);
    free(o);
    free(ref);
    return worst;
}

static void stats(kvr_kv_pool *pool, const char *when) {
    kvr_kv_pool_stats st;
    st.struct_size = sizeof st;
    CHECK(kvr_kv_pool_get_stats(pool, &st));
    printf("  %-28s pages %lld used / %lld free / %lld shared, %lld sequences, %lld tokens, %lld "
           "empty slots\n",
           when, (long long)st.pages_used, (long long)st.pages_free, (long long)st.pages_shared,
           (long long)st.sequences, (long long)st.tokens, (long long)st.waste_slots);
}

int main(int argc, char **argv) {
    kvr_context *ctx = example_context(argc > 1 ? argv[1] : NULL);
    kvr_kv_pool_params p;
    CHECK(kvr_kv_pool_params_default(&p));
    p.n_layers = LAYERS;
    p.n_kv_heads = HKV;
    p.head_dim = D;
    p.page_size = PAGE;
    p.dtype = KVR_DTYPE_F16;
    p.capacity_pages = 64;
    p.max_seqs = SEQS;
    p.max_seq_len = MAXLEN;
    kvr_kv_pool *pool = NULL;
    CHECK(kvr_kv_pool_new(ctx, &p, &pool));
    printf("paged_decode on %s: %d layers, %d KV heads (%d query heads), head dim %d, page %d\n",
           on_cuda ? "CUDA" : "CPU", LAYERS, HKV, HQ, D, PAGE);

    int32_t ids[SEQS];
    const int prefill[3] = {37, 100, 5};
    for (int i = 0; i < 3; i++) {
        CHECK(kvr_kv_pool_seq_add(pool, NULL, &ids[i]));
        append(pool, ids[i], prefill[i]);
    }
    stats(pool, "after prefill:");
    double checksum = 0, worst = 0;
    /* One decode step for the whole batch: append the new token, then attend. */
    for (int i = 0; i < 3; i++) append(pool, ids[i], 1);
    worst = fmax(worst, decode(pool, ids, 3, 1, 1, &checksum));

    /* Fork sequence 1 (101 tokens: pages shared, the partial last page too), then grow the
     * child: its first append copies the shared partial page (copy-on-write). */
    CHECK(kvr_kv_pool_seq_fork(pool, ids[1], NULL, &ids[3]));
    memcpy(K[ids[3]], K[ids[1]], sizeof K[0]);
    memcpy(V[ids[3]], V[ids[1]], sizeof V[0]);
    len[ids[3]] = len[ids[1]];
    stats(pool, "after fork:");
    append(pool, ids[3], 3);
    stats(pool, "after the child appends:");
    worst = fmax(worst, decode(pool, ids, 4, 1, 0, &checksum));

    /* Speculative round on sequence 0: 4 drafts appended, verified with T = 4 causal
     * queries in one call; the sampler keeps 2, so truncate drops the other 2. */
    append(pool, ids[0], 4);
    worst = fmax(worst, decode(pool, ids, 1, 4, 1, &checksum));
    int64_t n0;
    CHECK(kvr_kv_pool_seq_truncate(pool, ids[0], len[ids[0]] - 2, NULL));
    len[ids[0]] -= 2;
    CHECK(kvr_kv_pool_get_seq_len(pool, ids[0], &n0));
    stats(pool, "after rejecting 2 drafts:");
    worst = fmax(worst, decode(pool, ids, 4, 1, 1, &checksum));
    CHECK(kvr_kv_pool_seq_free(pool, ids[1], NULL));
    stats(pool, "after freeing the parent:");

    printf("sequence lengths %d %d %d %d (pool says %lld for sequence 0); checksum %.6f; max "
           "|error| vs naive attention %.2e\n",
           len[ids[0]], len[ids[1]], len[ids[2]], len[ids[3]], (long long)n0, checksum, worst);
    kvr_kv_pool_free(pool);
    kvr_context_free(ctx);
    if (worst > 2e-2 || n0 != len[ids[0]]) {
        fprintf(stderr, "FAILED\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
