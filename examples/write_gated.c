/* Write-gated KV (WG-KV admission) as an engine drives it: a pool in write-gated mode for 2
 * attention layers, a gate MLP given as host arrays, one long synthetic sequence (a
 * prefill through kvr_wgkv_pool_append, then one token per step through
 * kvr_wgkv_pool_step within pages reserved by kvr_wgkv_pool_reserve: on CUDA the gate and
 * the ring update run on the device), and after every step a decode of both layers whose
 * every output is checked against dense attention over exactly the tokens kept: the last
 * W tokens of each (layer, KV head), plus the older ones the gate admitted (score > tau),
 * plus the sinks. The gate is evaluated by the library from the pre-RoPE keys; this
 * program evaluates the same formula in double precision and checks the library's scores
 * against it.
 * Prints the memory used against a full cache.
 *
 *   write_gated [cpu|cuda]     (default: CUDA when usable, else CPU)
 */
#include <math.h>

#include "example_mem.h"

enum { LAYERS = 2, HKV = 2, HQ = 8, D = 64, HID = 32, PAGE = 16, W = 64, SINKS = 4 };
enum { PREFILL = 1500, STEPS = 300, MAXLEN = PREFILL + STEPS, RESERVE = 32 };
static const float TAU = 0.1f;

/* Host copies of every token: [layer][token][head][dim], and its gate score. */
static float K[LAYERS][MAXLEN][HKV][D], KPRE[LAYERS][MAXLEN][HKV][D], V[LAYERS][MAXLEN][HKV][D];
static double SCORE[LAYERS][MAXLEN][HKV];
static int len = 0;

/* Gate weights per layer (see kvr_wgkv_gate_layer). */
static float norm_pre[LAYERS][D], norm_post[LAYERS][D], fc1_w[LAYERS][HKV][HID][2 * D],
    fc1_b[LAYERS][HKV][HID], fc2_w[LAYERS][HKV][HID], fc2_b[LAYERS][HKV];

/* The gate in double: sigmoid(fc2 . gelu(fc1 [rms(k_pre); rms(k)] + b1) + b2), >= 1e-3. */
static double gate(int l, int h, const float *pre, const float *post) {
    double x[2 * D], ms0 = 0, ms1 = 0;
    for (int d = 0; d < D; d++) ms0 += (double)pre[d] * pre[d], ms1 += (double)post[d] * post[d];
    ms0 = 1 / sqrt(ms0 / D + 1e-6), ms1 = 1 / sqrt(ms1 / D + 1e-6);
    for (int d = 0; d < D; d++) {
        x[d] = pre[d] * ms0 * norm_pre[l][d];
        x[D + d] = post[d] * ms1 * norm_post[l][d];
    }
    double z = fc2_b[l][h];
    for (int j = 0; j < HID; j++) {
        double a = fc1_b[l][h][j];
        for (int i = 0; i < 2 * D; i++) a += fc1_w[l][h][j][i] * x[i];
        z += 0.5 * a * (1 + erf(a / sqrt(2.0))) * fc2_w[l][h][j];
    }
    double g = 1 / (1 + exp(-z));
    return g < 1e-3 ? 1e-3 : g;
}

/* Appends n new tokens (all layers) with their pre-RoPE keys: the library runs the gate. */
static void append(kvr_wgkv_pool *pool, int seq, int n) {
    static float k[LAYERS][MAXLEN][HKV][D], kp[LAYERS][MAXLEN][HKV][D], v[LAYERS][MAXLEN][HKV][D];
    for (int l = 0; l < LAYERS; l++)
        for (int t = 0; t < n; t++)
            for (int h = 0; h < HKV; h++) {
                for (int d = 0; d < D; d++) {
                    /* A "RoPE" stand-in: the cached key is a rotated copy of the pre-RoPE one. */
                    float a = uniform(-1, 1), b = uniform(-1, 1), c = cosf(0.01f * (len + t)),
                          s = sinf(0.01f * (len + t));
                    kp[l][t][h][d] = KPRE[l][len + t][h][d] = a;
                    k[l][t][h][d] = K[l][len + t][h][d] = d % 2 ? a * c + b * s : a * c - b * s;
                    v[l][t][h][d] = V[l][len + t][h][d] = uniform(-1, 1);
                }
                SCORE[l][len + t][h] = gate(l, h, KPRE[l][len + t][h], K[l][len + t][h]);
            }
    const int64_t shape[4] = {LAYERS, n, HKV, D};
    kvr_tensor tk = tensor(k, KVR_DTYPE_F32, 4, shape, 1), tv = tensor(v, KVR_DTYPE_F32, 4, shape, 1),
               tp = tensor(kp, KVR_DTYPE_F32, 4, shape, 1);
    for (int i = 0; i < 4; i++) {
        const int64_t st[4] = {MAXLEN * HKV * D, HKV * D, D, 1};
        tk.strides[i] = tv.strides[i] = tp.strides[i] = st[i];
    }
    /* K/V and the pre-RoPE keys from host memory (also on CUDA: the pool copies K/V in on
     * the stream; the gate runs on the CPU from the host keys). */
    CHECK(kvr_wgkv_pool_append(pool, seq, KVR_LAYER_ALL, &tk, &tv, &tp, NULL, KVR_WGKV_COMMITTED,
                               NULL));
    len += n;
}

/* One decode step: per layer, one token through kvr_wgkv_pool_step (K/V and pre-RoPE keys
 * in the context's memory, the scores the library used read back). Returns the largest
 * score difference against the double-precision gate. */
static double step_token(kvr_wgkv_pool *pool, int32_t seq) {
    float k[HKV][D], kp[HKV][D], v[HKV][D], sc[HKV];
    void *dk = buf_new(sizeof k), *dkp = buf_new(sizeof kp), *dv = buf_new(sizeof v),
         *dsc = buf_new(sizeof sc);
    const int64_t shape[3] = {1, HKV, D}, sshape[2] = {1, HKV}, sid[1] = {1};
    kvr_tensor tk = tensor(dk, KVR_DTYPE_F32, 3, shape, 0), tv = tensor(dv, KVR_DTYPE_F32, 3, shape, 0),
               tp = tensor(dkp, KVR_DTYPE_F32, 3, shape, 0), ts = tensor(dsc, KVR_DTYPE_F32, 2, sshape, 0),
               tid = tensor(&seq, KVR_DTYPE_I32, 1, sid, 1);
    double worst = 0;
    for (int l = 0; l < LAYERS; l++) {
        for (int h = 0; h < HKV; h++)
            for (int d = 0; d < D; d++) {
                float a = uniform(-1, 1), b = uniform(-1, 1), c = cosf(0.01f * len), s = sinf(0.01f * len);
                kp[h][d] = KPRE[l][len][h][d] = a;
                k[h][d] = K[l][len][h][d] = d % 2 ? a * c + b * s : a * c - b * s;
                v[h][d] = V[l][len][h][d] = uniform(-1, 1);
            }
        buf_put(dk, k, sizeof k);
        buf_put(dkp, kp, sizeof kp);
        buf_put(dv, v, sizeof v);
        CHECK(kvr_wgkv_pool_step(pool, l, &tid, &tk, &tv, &tp, NULL, &ts, NULL));
        buf_get(sc, dsc, sizeof sc);
        for (int h = 0; h < HKV; h++) {
            double want = gate(l, h, KPRE[l][len][h], K[l][len][h]);
            worst = fmax(worst, fabs(sc[h] - want));
            SCORE[l][len][h] = sc[h]; /* what the library decided with */
        }
    }
    buf_free(dk);
    buf_free(dkp);
    buf_free(dv);
    buf_free(dsc);
    len += 1;
    return worst;
}

static int kept(int l, int h, int t) {
    return t >= len - W || t < SINKS || SCORE[l][t][h] > TAU;
}

/* Dense attention of query head qh over exactly the kept tokens of its KV head. */
static void reference(int l, const float *q, int qh, float *out) {
    int h = qh / (HQ / HKV);
    double m = -1e300, sum = 0, acc[D] = {0};
    static double s[MAXLEN];
    for (int t = 0; t < len; t++) {
        if (!kept(l, h, t)) continue;
        double dot = 0;
        for (int d = 0; d < D; d++) dot += (double)q[d] * K[l][t][h][d];
        s[t] = dot / sqrt((double)D);
        if (s[t] > m) m = s[t];
    }
    for (int t = 0; t < len; t++) {
        if (!kept(l, h, t)) continue;
        double p = exp(s[t] - m);
        sum += p;
        for (int d = 0; d < D; d++) acc[d] += p * V[l][t][h][d];
    }
    for (int d = 0; d < D; d++) out[d] = (float)(acc[d] / sum);
}

static double decode(kvr_wgkv_pool *pool, int32_t seq, int l) {
    float q[HQ * D], o[HQ * D], ref[D];
    for (int i = 0; i < HQ * D; i++) q[i] = uniform(-1, 1);
    void *dq = buf_new(sizeof q), *dout = buf_new(sizeof o);
    buf_put(dq, q, sizeof q);
    const int64_t sq[3] = {1, HQ, D}, sid[1] = {1};
    kvr_tensor tq = tensor(dq, KVR_DTYPE_F32, 3, sq, 0), to = tensor(dout, KVR_DTYPE_F32, 3, sq, 0);
    kvr_tensor tid = tensor(&seq, KVR_DTYPE_I32, 1, sid, 1);
    CHECK(kvr_wgkv_pool_decode(pool, l, &tid, &tq, &to, NULL, NULL, NULL));
    buf_get(o, dout, sizeof o);
    buf_free(dq);
    buf_free(dout);
    double worst = 0;
    for (int h = 0; h < HQ; h++) {
        reference(l, q + h * D, h, ref);
        for (int d = 0; d < D; d++) worst = fmax(worst, fabs(o[h * D + d] - ref[d]));
    }
    return worst;
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
    p.capacity_pages = LAYERS * HKV * ((MAXLEN + RESERVE) / PAGE + 2);
    p.max_seqs = 2;
    p.max_seq_len = MAXLEN;
    kvr_wgkv_params wg;
    CHECK(kvr_wgkv_params_default(&wg));
    wg.local_window = W;
    wg.tau = TAU;
    wg.sinks = SINKS;
    wg.gate_hidden = HID;
    kvr_wgkv_pool *pool = NULL;
    CHECK(kvr_wgkv_pool_new(ctx, &p, &wg, &pool));

    /* A random gate, its output bias set so that roughly a quarter of the tokens pass. */
    kvr_wgkv_gate_layer gl[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        for (int d = 0; d < D; d++) norm_pre[l][d] = uniform(0.5f, 1.5f), norm_post[l][d] = uniform(0.5f, 1.5f);
        for (int h = 0; h < HKV; h++) {
            for (int j = 0; j < HID; j++) {
                for (int i = 0; i < 2 * D; i++) fc1_w[l][h][j][i] = uniform(-0.15f, 0.15f);
                fc1_b[l][h][j] = uniform(-0.5f, 0.5f);
                fc2_w[l][h][j] = uniform(-1, 1);
            }
            fc2_b[l][h] = -3.5f - 0.5f * h;
        }
        gl[l] = (kvr_wgkv_gate_layer){norm_pre[l], norm_post[l], &fc1_w[l][0][0][0],
                                      &fc1_b[l][0][0], &fc2_w[l][0][0], fc2_b[l]};
    }
    CHECK(kvr_wgkv_pool_set_gate(pool, gl, HID));
    printf("write_gated on %s: %d layers, %d KV heads (%d query heads), head dim %d, page %d, "
           "ring %d, tau %.2f, %d sinks, gate hidden %d\n",
           on_cuda ? "CUDA" : "CPU", LAYERS, HKV, HQ, D, PAGE, W, TAU, SINKS, HID);

    int32_t seq;
    CHECK(kvr_wgkv_pool_seq_add(pool, NULL, &seq));
    append(pool, seq, PREFILL);
    double worst = 0, gate_err = 0;
    for (int l = 0; l < LAYERS; l++) worst = fmax(worst, decode(pool, seq, l));
    for (int step = 0; step < STEPS; step++) {
        /* Pages for the next RESERVE steps; then each step needs no host decision (on CUDA
         * it could be replayed from a captured graph). */
        if (step % RESERVE == 0) CHECK(kvr_wgkv_pool_reserve(pool, seq, RESERVE, NULL));
        gate_err = fmax(gate_err, step_token(pool, seq));
        for (int l = 0; l < LAYERS; l++) worst = fmax(worst, decode(pool, seq, l));
    }

    kvr_wgkv_row_stats rows[LAYERS * HKV];
    int64_t nrows = 0;
    CHECK(kvr_wgkv_pool_get_seq_rows(pool, seq, rows, LAYERS * HKV, &nrows));
    int mismatch = 0;
    for (int r = 0; r < nrows; r++) {
        int l = r / HKV, h = r % HKV, want = 0;
        for (int t = 0; t < len; t++) want += kept(l, h, t);
        printf("  layer %d head %d: %lld tokens, ring %lld + global %lld kept (%.1f %%)\n", l, h,
               (long long)rows[r].total, (long long)rows[r].ring, (long long)rows[r].global,
               100.0 * (rows[r].ring + rows[r].global) / rows[r].total);
        mismatch |= rows[r].ring + rows[r].global != want;
    }
    kvr_wgkv_pool_stats st;
    st.struct_size = sizeof st;
    CHECK(kvr_wgkv_pool_get_stats(pool, &st));
    printf("memory: %lld pages (%.2f MiB) against %lld pages (%.2f MiB) for a full cache: %.1f %%\n",
           (long long)st.pages_used, st.pages_used * st.page_bytes / 1048576.0,
           (long long)st.full_pages, st.full_pages * st.page_bytes / 1048576.0,
           100.0 * st.pages_used / st.full_pages);
    printf("%d decodes checked; max |error| vs dense attention over the kept tokens %.2e\n",
           LAYERS * (STEPS + 1), worst);
    printf("%d device-step gate scores; max |error| vs the gate in double %.2e\n", LAYERS * STEPS,
           gate_err);
    kvr_wgkv_pool_free(pool);
    kvr_context_free(ctx);
    if (worst > 2e-2 || gate_err > 1e-4 || mismatch || st.pages_used >= st.full_pages) {
        fprintf(stderr, "FAILED\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
