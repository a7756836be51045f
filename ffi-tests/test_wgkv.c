/* The write-gated pool from C: parameters, lifecycle, appends with scores and with a gate,
 * decode against a naive attention over the kept tokens, drafts (verify, roll back,
 * commit), a fork, stats, and bad input (a status and a message, the pool unchanged). */
#include <math.h>
#include <string.h>

#include "check.h"

enum { L = 2, H = 2, D = 16, HQ = 4, W = 8, PAGE = 4, HID = 6, MAXT = 64 };
static const float TAU = 0.3f;

static float K[L][MAXT][H][D], V[L][MAXT][H][D], S[L][MAXT][H];
static int len = 0;

static uint64_t rng = 12345;
static float uni(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / 16777216.0) * 2 - 1;
}

static kvr_tensor t32(void *p, int ndim, const int64_t *shape) {
    kvr_tensor t;
    if (kvr_tensor_init(&t, p, KVR_DTYPE_F32, KVR_DEVICE_HOST, ndim, shape) != KVR_STATUS_OK) abort();
    return t;
}

/* Appends n tokens (all layers) with explicit scores in [0, 1). */
static kvr_status append(kvr_wgkv_pool *pool, int seq, int n, uint32_t flags) {
    static float k[L][MAXT][H][D], v[L][MAXT][H][D], s[L][MAXT][H];
    for (int l = 0; l < L; l++)
        for (int t = 0; t < n; t++)
            for (int h = 0; h < H; h++) {
                for (int d = 0; d < D; d++) {
                    k[l][t][h][d] = K[l][len + t][h][d] = uni();
                    v[l][t][h][d] = V[l][len + t][h][d] = uni();
                }
                s[l][t][h] = S[l][len + t][h] = (uni() + 1) / 2;
            }
    const int64_t shape[4] = {L, n, H, D}, sshape[3] = {L, n, H};
    kvr_tensor tk = t32(k, 4, shape), tv = t32(v, 4, shape), ts = t32(s, 3, sshape);
    const int64_t st[4] = {MAXT * H * D, H * D, D, 1}, sst[3] = {MAXT * H, H, 1};
    for (int i = 0; i < 4; i++) tk.strides[i] = tv.strides[i] = st[i];
    for (int i = 0; i < 3; i++) ts.strides[i] = sst[i];
    kvr_status r = kvr_wgkv_pool_append(pool, seq, KVR_LAYER_ALL, &tk, &tv, NULL, &ts, flags, NULL);
    if (r == KVR_STATUS_OK && !(flags & KVR_WGKV_DRAFT)) len += n;
    return r;
}

static double naive_error(float q[HQ][D], float out[HQ][D], int l, int len);

/* Max |error| of a decode of layer l (committed tokens only) against naive attention. */
static double decode_error(kvr_wgkv_pool *pool, int32_t seq, int l) {
    float q[HQ][D], out[HQ][D];
    for (int h = 0; h < HQ; h++)
        for (int d = 0; d < D; d++) q[h][d] = uni();
    const int64_t sq[3] = {1, HQ, D}, sid[1] = {1};
    kvr_tensor tq = t32(q, 3, sq), to = t32(out, 3, sq), ti;
    CHECK(kvr_tensor_init(&ti, &seq, KVR_DTYPE_I32, KVR_DEVICE_HOST, 1, sid) == KVR_STATUS_OK);
    CHECK_STATUS(kvr_wgkv_pool_decode(pool, l, &ti, &tq, &to, NULL, NULL, NULL), KVR_STATUS_OK);
    return naive_error(q, out, l, len);
}

/* Max |error| of out against naive attention of q over layer l's first n tokens (kept:
 * the last W, and older ones scored > TAU). */
static double naive_error(float q[HQ][D], float out[HQ][D], int l, int len) {
    double worst = 0;
    for (int qh = 0; qh < HQ; qh++) {
        int h = qh / (HQ / H);
        double m = -1e300, sum = 0, acc[D] = {0}, s[MAXT];
        for (int t = 0; t < len; t++) {
            int kept = t >= len - W || S[l][t][h] > TAU;
            s[t] = -1e300;
            if (!kept) continue;
            double dot = 0;
            for (int d = 0; d < D; d++) dot += (double)q[qh][d] * K[l][t][h][d];
            s[t] = dot / sqrt((double)D);
            if (s[t] > m) m = s[t];
        }
        for (int t = 0; t < len; t++) {
            if (s[t] == -1e300) continue;
            double p = exp(s[t] - m);
            sum += p;
            for (int d = 0; d < D; d++) acc[d] += p * V[l][t][h][d];
        }
        for (int d = 0; d < D; d++) worst = fmax(worst, fabs(out[qh][d] - acc[d] / sum));
    }
    return worst;
}

static kvr_wgkv_pool_stats stats(const kvr_wgkv_pool *pool) {
    kvr_wgkv_pool_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_STATUS(kvr_wgkv_pool_get_stats(pool, &st), KVR_STATUS_OK);
    return st;
}

int main(void) {
    kvr_context_params cp;
    CHECK_STATUS(kvr_context_params_default(&cp), KVR_STATUS_OK);
    cp.backend = KVR_BACKEND_CPU;
    kvr_context *ctx = NULL;
    CHECK_STATUS(kvr_context_new(&cp, &ctx), KVR_STATUS_OK);

    kvr_kv_pool_params kv;
    CHECK_STATUS(kvr_kv_pool_params_default(&kv), KVR_STATUS_OK);
    kv.n_layers = L;
    kv.n_kv_heads = H;
    kv.head_dim = D;
    kv.page_size = PAGE;
    kv.dtype = KVR_DTYPE_F32;
    kv.capacity_pages = 200;
    kv.max_seqs = 3;
    kv.max_seq_len = MAXT;
    kvr_wgkv_params wg;
    CHECK_STATUS(kvr_wgkv_params_default(&wg), KVR_STATUS_OK);
    CHECK(wg.local_window == 256 && fabsf(wg.tau - 0.1f) < 1e-7f && wg.sinks == 0);
    CHECK_STATUS(kvr_wgkv_params_default(NULL), KVR_STATUS_NULL_ARG);
    wg.local_window = W;
    wg.tau = TAU;
    wg.gate_hidden = HID;
    kvr_wgkv_pool *pool = (kvr_wgkv_pool *)0x1;
    wg.local_window = 6; /* not a multiple of the page size */
    CHECK_STATUS(kvr_wgkv_pool_new(ctx, &kv, &wg, &pool), KVR_STATUS_INVALID_ARG);
    CHECK(pool == (kvr_wgkv_pool *)0x1);
    wg.local_window = W;
    CHECK_STATUS(kvr_wgkv_pool_new(NULL, &kv, &wg, &pool), KVR_STATUS_NULL_ARG);
    CHECK_STATUS(kvr_wgkv_pool_new(ctx, &kv, &wg, &pool), KVR_STATUS_OK);

    int32_t seq = -1;
    CHECK_STATUS(kvr_wgkv_pool_seq_add(pool, NULL, &seq), KVR_STATUS_OK);
    CHECK_STATUS(append(pool, seq, 30, KVR_WGKV_COMMITTED), KVR_STATUS_OK);
    double worst = 0;
    for (int l = 0; l < L; l++) worst = fmax(worst, decode_error(pool, seq, l));
    for (int i = 0; i < 6; i++) {
        CHECK_STATUS(append(pool, seq, 1, KVR_WGKV_COMMITTED), KVR_STATUS_OK);
        for (int l = 0; l < L; l++) worst = fmax(worst, decode_error(pool, seq, l));
    }
    CHECK(worst < 1e-5);

    /* Sizing: the one sequence's pages lie between the helper's at no and at full admission;
     * no capacity needed; bad input gets a status and writes nothing. */
    {
        kvr_kv_pool_params sz = kv;
        sz.capacity_pages = 0;
        int64_t lo = -1, hi = -1, bad = 0x55;
        CHECK_STATUS(kvr_wgkv_params_compute_pages_per_seq(&sz, &wg, len, 0.0, 0, &lo), KVR_STATUS_OK);
        CHECK_STATUS(kvr_wgkv_params_compute_pages_per_seq(&sz, &wg, len, 1.0, 0, &hi), KVR_STATUS_OK);
        const int64_t used = stats(pool).pages_used;
        CHECK(lo == L * H * (W / PAGE) && lo <= used && used <= hi);
        CHECK_STATUS(kvr_wgkv_params_compute_pages_per_seq(&sz, &wg, len, 2.0, 0, &bad), KVR_STATUS_INVALID_ARG);
        CHECK_STATUS(kvr_wgkv_params_compute_pages_per_seq(&sz, &wg, len, 0.5, 9, &bad), KVR_STATUS_OUT_OF_RANGE);
        CHECK_STATUS(kvr_wgkv_params_compute_pages_per_seq(NULL, &wg, len, 0.5, 0, &bad), KVR_STATUS_NULL_ARG);
        CHECK(bad == 0x55);
    }

    /* Bad input: a status, a message, nothing changed. */
    kvr_wgkv_pool_stats before = stats(pool);
    CHECK_STATUS(append(pool, 2, 1, 0), KVR_STATUS_UNKNOWN_ID);
    CHECK_STATUS(append(pool, seq, 1, 8), KVR_STATUS_INVALID_ARG);
    CHECK(strlen(kvr_error_last_message()) > 0);
    kvr_wgkv_pool_stats after;
    CHECK_STATUS(kvr_wgkv_pool_commit(pool, seq, 1, NULL), KVR_STATUS_OUT_OF_RANGE);
    CHECK_STATUS(kvr_wgkv_pool_seq_truncate(pool, seq, 3, NULL), KVR_STATUS_OUT_OF_RANGE);
    kvr_wgkv_row_stats rows[L * H];
    int64_t n = 0;
    CHECK_STATUS(kvr_wgkv_pool_get_seq_rows(pool, seq, rows, 1, &n), KVR_STATUS_OUT_OF_RANGE);
    CHECK(n == L * H);
    after = stats(pool);
    CHECK(memcmp(&before, &after, sizeof before) == 0);

    /* Drafts: 3 appended, verified with T = 3, 1 rolled back, 1 of 2 accepted. */
    CHECK_STATUS(append(pool, seq, 3, KVR_WGKV_DRAFT), KVR_STATUS_OK);
    CHECK_STATUS(kvr_wgkv_pool_get_seq_rows(pool, seq, rows, L * H, &n), KVR_STATUS_OK);
    CHECK(rows[0].drafts == 3 && rows[0].total == len);
    {
        float q[3][HQ][D], out[3][HQ][D];
        for (int i = 0; i < 3 * HQ * D; i++) (&q[0][0][0])[i] = uni();
        const int64_t sq[4] = {1, 3, HQ, D}, sid[1] = {1};
        kvr_tensor tq = t32(q, 4, sq), to = t32(out, 4, sq), ti;
        CHECK(kvr_tensor_init(&ti, &seq, KVR_DTYPE_I32, KVR_DEVICE_HOST, 1, sid) == KVR_STATUS_OK);
        CHECK_STATUS(kvr_wgkv_pool_decode(pool, 1, &ti, &tq, &to, NULL, NULL, NULL), KVR_STATUS_OK);
        CHECK(isfinite(out[2][3][D - 1]));
    }
    CHECK_STATUS(kvr_wgkv_pool_seq_truncate(pool, seq, len + 2, NULL), KVR_STATUS_OK);
    /* The accepted draft's K/V become committed: copy them into the host record. */
    CHECK_STATUS(kvr_wgkv_pool_commit(pool, seq, 1, NULL), KVR_STATUS_OK);
    len += 1;
    CHECK_STATUS(kvr_wgkv_pool_get_seq_rows(pool, seq, rows, L * H, &n), KVR_STATUS_OK);
    CHECK(rows[0].drafts == 0 && rows[0].total == len && rows[0].ring == W);
    worst = 0;
    for (int l = 0; l < L; l++) worst = fmax(worst, decode_error(pool, seq, l));
    CHECK(worst < 1e-5);

    /* Fused steps (kvr_wgkv_pool_step_decode: the step, then the decode with its token in)
     * with given scores, past a ring wrap; a refused call changes nothing. */
    CHECK_STATUS(kvr_wgkv_pool_reserve(pool, seq, W + 2, NULL), KVR_STATUS_OK);
    for (int it = 0; it < W + 2; it++) {
        for (int l = 0; l < L; l++) {
            float k1[H][D], v1[H][D], s1[H], q[HQ][D], out[HQ][D], q2[2][HQ][D];
            for (int h = 0; h < H; h++) {
                for (int d = 0; d < D; d++) {
                    k1[h][d] = K[l][len][h][d] = uni();
                    v1[h][d] = V[l][len][h][d] = uni();
                }
                s1[h] = S[l][len][h] = (uni() + 1) / 2;
            }
            for (int h = 0; h < HQ; h++)
                for (int d = 0; d < D; d++) q[h][d] = q2[0][h][d] = q2[1][h][d] = uni();
            const int64_t sk[3] = {1, H, D}, ss[2] = {1, H}, sq[3] = {1, HQ, D}, sq2[4] = {1, 2, HQ, D},
                          sid[1] = {1};
            kvr_tensor tk = t32(k1, 3, sk), tv = t32(v1, 3, sk), ts = t32(s1, 2, ss), tq = t32(q, 3, sq),
                       to = t32(out, 3, sq), tq2 = t32(q2, 4, sq2), ti;
            CHECK(kvr_tensor_init(&ti, &seq, KVR_DTYPE_I32, KVR_DEVICE_HOST, 1, sid) == KVR_STATUS_OK);
            if (it == 0 && l == 0) {
                kvr_wgkv_row_stats r0[L * H], r1[L * H];
                CHECK_STATUS(kvr_wgkv_pool_get_seq_rows(pool, seq, r0, L * H, &n), KVR_STATUS_OK);
                CHECK_STATUS(kvr_wgkv_pool_step_decode(pool, l, &ti, &tk, &tv, NULL, &ts, NULL, &tq2, &tq2,
                                                       NULL, NULL, NULL),
                             KVR_STATUS_INVALID_ARG); /* two query tokens */
                CHECK_STATUS(kvr_wgkv_pool_step_decode(pool, l, &ti, &tk, &tv, NULL, NULL, NULL, &tq, &to,
                                                       NULL, NULL, NULL),
                             KVR_STATUS_INVALID_ARG); /* neither scores nor k_pre */
                CHECK_STATUS(kvr_wgkv_pool_get_seq_rows(pool, seq, r1, L * H, &n), KVR_STATUS_OK);
                CHECK(memcmp(r0, r1, sizeof r0) == 0);
            }
            CHECK_STATUS(kvr_wgkv_pool_step_decode(pool, l, &ti, &tk, &tv, NULL, &ts, NULL, &tq, &to, NULL,
                                                   NULL, NULL),
                         KVR_STATUS_OK);
            CHECK(naive_error(q, out, l, len + 1) < 1e-5);
        }
        len += 1;
    }
    worst = 0;
    for (int l = 0; l < L; l++) worst = fmax(worst, decode_error(pool, seq, l));
    CHECK(worst < 1e-5);

    /* Fork, then free the parent: the child still decodes the same tokens. */
    int32_t child = -1;
    CHECK_STATUS(kvr_wgkv_pool_seq_fork(pool, seq, NULL, &child), KVR_STATUS_OK);
    CHECK(stats(pool).pages_shared == stats(pool).pages_used);
    CHECK_STATUS(kvr_wgkv_pool_seq_free(pool, seq, NULL), KVR_STATUS_OK);
    CHECK(decode_error(pool, child, 0) < 1e-5);
    CHECK_STATUS(kvr_wgkv_pool_seq_free(pool, child, NULL), KVR_STATUS_OK);
    CHECK(stats(pool).pages_used == 0);

    /* A gate from host arrays, then an append through it. */
    static float np[L][D], npo[L][D], w1[L][H][HID][2 * D], b1[L][H][HID], w2[L][H][HID], b2[L][H];
    kvr_wgkv_gate_layer gl[L];
    for (int l = 0; l < L; l++) {
        for (int d = 0; d < D; d++) np[l][d] = 1, npo[l][d] = 1;
        for (int h = 0; h < H; h++) {
            for (int j = 0; j < HID; j++) {
                for (int i = 0; i < 2 * D; i++) w1[l][h][j][i] = 0.2f * uni();
                b1[l][h][j] = 0.1f * uni();
                w2[l][h][j] = uni();
            }
            b2[l][h] = 0;
        }
        gl[l] = (kvr_wgkv_gate_layer){np[l], npo[l], &w1[l][0][0][0], &b1[l][0][0], &w2[l][0][0], b2[l]};
    }
    CHECK_STATUS(kvr_wgkv_pool_set_gate(pool, gl, HID + 1), KVR_STATUS_INVALID_ARG); /* not gate_hidden */
    CHECK_STATUS(kvr_wgkv_pool_set_gate(pool, gl, HID), KVR_STATUS_OK);
    CHECK_STATUS(kvr_wgkv_pool_seq_add(pool, NULL, &seq), KVR_STATUS_OK);
    {
        static float k[L][20][H][D], v[L][20][H][D];
        for (int i = 0; i < L * 20 * H * D; i++) (&k[0][0][0][0])[i] = uni(), (&v[0][0][0][0])[i] = uni();
        const int64_t shape[4] = {L, 20, H, D};
        kvr_tensor tk = t32(k, 4, shape), tv = t32(v, 4, shape);
        CHECK_STATUS(kvr_wgkv_pool_append(pool, seq, KVR_LAYER_ALL, &tk, &tv, &tk, &tk, 0, NULL),
                     KVR_STATUS_INVALID_ARG); /* both scores and k_pre */
        CHECK_STATUS(kvr_wgkv_pool_append(pool, seq, KVR_LAYER_ALL, &tk, &tv, &tk, NULL, 0, NULL),
                     KVR_STATUS_OK);
    }
    CHECK_STATUS(kvr_wgkv_pool_get_seq_rows(pool, seq, rows, L * H, &n), KVR_STATUS_OK);
    CHECK(rows[3].total == 20 && rows[3].ring == W && rows[3].global <= 12);
    CHECK_STATUS(kvr_wgkv_pool_load_gate(pool, "/nonexistent.gguf", NULL, 0), KVR_STATUS_IO_ERROR);

    kvr_wgkv_pool_free(pool);
    kvr_wgkv_pool_free(NULL);
    kvr_context_free(ctx);
    return finish("test_wgkv");
}
