/* Speculative decoding over a Gated DeltaNet layer with kvreplay's replay pool, checked
 * against the recurrent mode (a pool with ring_len 0, which keeps one state snapshot per
 * draft, as engines do today).
 *
 * Each round drafts T = 1..4 tokens for every sequence, verifies them in one call (outputs
 * for every draft, no per-draft state), accepts a random prefix (0..T) and commits it; the
 * conv window of the accepted prefix comes back for the host's causal conv. Every few
 * rounds a plain decode step runs. The same inputs go through the recurrent pool; outputs,
 * conv windows and the final states must agree.
 *
 *   spec_decode_gdn [cpu|cuda]     (default: CUDA when usable, else CPU)
 *
 * On CUDA the example behaves like an engine: it loads the driver with dlopen, owns its
 * device buffers, and hands kvreplay device pointers (accepted counts stay on the device:
 * the host never waits for them). */
#include <math.h>

#include "example_mem.h"

enum { B = 4, HK = 2, HV = 4, D = 64, MAXT = 4, CONV = 48, K1 = 3, ROUNDS = 60 };

static kvr_gdn_pool *make_pool(kvr_context *ctx, int ring_len) {
    kvr_gdn_pool_params p;
    CHECK(kvr_gdn_pool_params_default(&p));
    p.n_layers = 1;
    p.n_k_heads = HK;
    p.n_v_heads = HV;
    p.dk = D;
    p.dv = D;
    p.ring_len = ring_len; /* 0: recurrent mode */
    p.max_drafts = MAXT;
    p.max_seqs = B;
    p.conv_dim = CONV;
    p.conv_kernel = K1 + 1;
    kvr_gdn_pool *pool = NULL;
    CHECK(kvr_gdn_pool_new(ctx, &p, &pool));
    return pool;
}

static double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 1e-6;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > num) num = d;
        if (fabs(b[i]) > den) den = fabs(b[i]);
    }
    return num / den;
}

int main(int argc, char **argv) {
    kvr_context *ctx = example_context(argc > 1 ? argv[1] : NULL);
    printf("spec_decode_gdn on %s: B=%d, Hk=%d, Hv=%d, d=%d, drafts 1..%d, %d rounds\n",
           on_cuda ? "CUDA" : "CPU", B, HK, HV, D, MAXT, ROUNDS);

    kvr_gdn_pool *replay = make_pool(ctx, 16), *recur = make_pool(ctx, 0);
    int32_t ids[B];
    for (int b = 0; b < B; b++) {
        int32_t a, r;
        CHECK(kvr_gdn_pool_seq_add(replay, NULL, &a));
        CHECK(kvr_gdn_pool_seq_add(recur, NULL, &r));
        if (a != r) return 1;
        ids[b] = a;
    }
    const size_t nq = B * MAXT * HK * D, nv = B * MAXT * HV * D, ng = B * MAXT * HV,
                 nc = B * MAXT * CONV, nw = B * K1 * CONV;
    float *h_q = malloc(nq * 4), *h_k = malloc(nq * 4), *h_v = malloc(nv * 4), *h_g = malloc(ng * 4),
          *h_beta = malloc(ng * 4), *h_conv = malloc(nc * 4), *o1 = malloc(nv * 4),
          *o2 = malloc(nv * 4), *w1 = malloc(nw * 4), *w2 = malloc(nw * 4);
    void *q = buf_new(nq * 4), *k = buf_new(nq * 4), *v = buf_new(nv * 4), *g = buf_new(ng * 4),
         *beta = buf_new(ng * 4), *conv = buf_new(nc * 4), *out1 = buf_new(nv * 4),
         *out2 = buf_new(nv * 4), *win1 = buf_new(nw * 4), *win2 = buf_new(nw * 4),
         *acc = buf_new(B * 4);
    if (!q || !k || !v || !g || !beta || !conv || !out1 || !out2 || !win1 || !win2 || !acc) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    const int64_t ids_shape[1] = {B};
    kvr_tensor t_ids = tensor(ids, KVR_DTYPE_I32, 1, ids_shape, 1);
    kvr_gdn_step_params sp;
    CHECK(kvr_gdn_step_params_default(&sp));
    sp.l2norm_qk = 1;
    double worst = 0;
    int accepted_total = 0, drafted_total = 0;
    for (int round = 0; round < ROUNDS; round++) {
        int verify = round % 5 != 4; /* every fifth round: a plain decode step */
        int T = verify ? 1 + (int)(uniform(0, 1) * MAXT) % MAXT : 1;
        for (size_t i = 0; i < (size_t)B * T * HK * D; i++) h_q[i] = uniform(-1, 1), h_k[i] = uniform(-1, 1);
        for (size_t i = 0; i < (size_t)B * T * HV * D; i++) h_v[i] = uniform(-1, 1);
        for (size_t i = 0; i < (size_t)B * T * HV; i++) h_g[i] = uniform(-0.4f, -0.01f), h_beta[i] = uniform(0.1f, 0.9f);
        for (size_t i = 0; i < (size_t)B * T * CONV; i++) h_conv[i] = uniform(-1, 1);
        buf_put(q, h_q, (size_t)B * T * HK * D * 4);
        buf_put(k, h_k, (size_t)B * T * HK * D * 4);
        buf_put(v, h_v, (size_t)B * T * HV * D * 4);
        buf_put(g, h_g, (size_t)B * T * HV * 4);
        buf_put(beta, h_beta, (size_t)B * T * HV * 4);
        buf_put(conv, h_conv, (size_t)B * T * CONV * 4);
        const int64_t sq[4] = {B, T, HK, D}, sv[4] = {B, T, HV, D}, sg[3] = {B, T, HV}, sc[3] = {B, T, CONV};
        kvr_tensor tq = tensor(q, KVR_DTYPE_F32, 4, sq, 0), tk = tensor(k, KVR_DTYPE_F32, 4, sq, 0),
                   tv = tensor(v, KVR_DTYPE_F32, 4, sv, 0), tg = tensor(g, KVR_DTYPE_F32, 3, sg, 0),
                   tb = tensor(beta, KVR_DTYPE_F32, 3, sg, 0), tc = tensor(conv, KVR_DTYPE_F32, 3, sc, 0),
                   t1 = tensor(out1, KVR_DTYPE_F32, 4, sv, 0), t2 = tensor(out2, KVR_DTYPE_F32, 4, sv, 0);
        if (verify) {
            CHECK(kvr_gdn_pool_verify(replay, 0, &t_ids, &tq, &tk, &tv, &tg, &tb, &tc, &t1, &sp, NULL));
            CHECK(kvr_gdn_pool_verify(recur, 0, &t_ids, &tq, &tk, &tv, &tg, &tb, &tc, &t2, &sp, NULL));
            /* The "sampler": accept a random prefix of each sequence's drafts. */
            int32_t a[B];
            for (int b = 0; b < B; b++) a[b] = (int32_t)(uniform(0, 1) * (T + 1)) % (T + 1);
            for (int b = 0; b < B; b++) accepted_total += a[b];
            drafted_total += B * T;
            buf_put(acc, a, sizeof a);
            const int64_t sw[3] = {B, K1, CONV};
            kvr_tensor ta = tensor(acc, KVR_DTYPE_I32, 1, ids_shape, 0);
            kvr_tensor tw1 = tensor(win1, KVR_DTYPE_F32, 3, sw, 0), tw2 = tensor(win2, KVR_DTYPE_F32, 3, sw, 0);
            CHECK(kvr_gdn_pool_commit(replay, 0, &t_ids, &ta, &tw1, NULL));
            CHECK(kvr_gdn_pool_commit(recur, 0, &t_ids, &ta, &tw2, NULL));
        } else {
            const int64_t dq[3] = {B, HK, D}, dv3[3] = {B, HV, D}, dg[2] = {B, HV}, dc[2] = {B, CONV};
            kvr_tensor dqt = tensor(q, KVR_DTYPE_F32, 3, dq, 0), dkt = tensor(k, KVR_DTYPE_F32, 3, dq, 0),
                       dvt = tensor(v, KVR_DTYPE_F32, 3, dv3, 0), dgt = tensor(g, KVR_DTYPE_F32, 2, dg, 0),
                       dbt = tensor(beta, KVR_DTYPE_F32, 2, dg, 0), dct = tensor(conv, KVR_DTYPE_F32, 2, dc, 0),
                       d1 = tensor(out1, KVR_DTYPE_F32, 3, dv3, 0), d2 = tensor(out2, KVR_DTYPE_F32, 3, dv3, 0);
            CHECK(kvr_gdn_pool_decode(replay, 0, &t_ids, &dqt, &dkt, &dvt, &dgt, &dbt, &dct, &d1, &sp, NULL));
            CHECK(kvr_gdn_pool_decode(recur, 0, &t_ids, &dqt, &dkt, &dvt, &dgt, &dbt, &dct, &d2, &sp, NULL));
        }
        buf_get(o1, out1, (size_t)B * T * HV * D * 4);
        buf_get(o2, out2, (size_t)B * T * HV * D * 4);
        double e = rel_err(o1, o2, (size_t)B * T * HV * D);
        if (e > worst) worst = e;
        if (verify) {
            buf_get(w1, win1, nw * 4);
            buf_get(w2, win2, nw * 4);
            if (memcmp(w1, w2, nw * 4) != 0) {
                fprintf(stderr, "round %d: conv windows differ\n", round);
                return 1;
            }
        }
    }
    /* Final states: replay (materialized from checkpoint + ring) vs recurrent. */
    float *s1 = malloc(HV * D * D * 4), *s2 = malloc(HV * D * D * 4);
    void *st1 = buf_new(HV * D * D * 4), *st2 = buf_new(HV * D * D * 4);
    const int64_t ss[3] = {HV, D, D};
    kvr_tensor ts1 = tensor(st1, KVR_DTYPE_F32, 3, ss, 0), ts2 = tensor(st2, KVR_DTYPE_F32, 3, ss, 0);
    double state_err = 0;
    for (int b = 0; b < B; b++) {
        CHECK(kvr_gdn_pool_export_state(replay, 0, ids[b], &ts1, NULL, NULL));
        CHECK(kvr_gdn_pool_export_state(recur, 0, ids[b], &ts2, NULL, NULL));
        buf_get(s1, st1, HV * D * D * 4);
        buf_get(s2, st2, HV * D * D * 4);
        double e = rel_err(s1, s2, HV * D * D);
        if (e > state_err) state_err = e;
    }
    kvr_gdn_pool_memory m1, m2;
    m1.struct_size = m2.struct_size = sizeof m1;
    CHECK(kvr_gdn_pool_get_memory(replay, &m1));
    CHECK(kvr_gdn_pool_get_memory(recur, &m2));
    printf("accepted %d of %d drafts; replay vs recurrent: max relative error %.2e (outputs), "
           "%.2e (states); conv windows identical\n",
           accepted_total, drafted_total, worst, state_err);
    printf("memory per sequence: replay %lld bytes (state %lld + ring %lld + conv %lld), "
           "recurrent with %d snapshots %lld bytes\n",
           (long long)m1.total_bytes, (long long)m1.state_bytes, (long long)m1.ring_bytes,
           (long long)m1.conv_bytes, MAXT, (long long)m2.total_bytes);
    int ok = worst < 1e-3 && state_err < 1e-3;
    free(h_q), free(h_k), free(h_v), free(h_g), free(h_beta), free(h_conv), free(o1), free(o2),
        free(w1), free(w2), free(s1), free(s2);
    void *bufs[] = {q, k, v, g, beta, conv, out1, out2, win1, win2, acc, st1, st2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) buf_free(bufs[i]);
    kvr_gdn_pool_free(replay);
    kvr_gdn_pool_free(recur);
    kvr_context_free(ctx);
    if (!ok) {
        fprintf(stderr, "FAILED: replay and recurrent disagree\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
