/* Speculative decoding over a Mamba-2 layer (selective_state_update semantics: dt bias +
 * softplus, A, D skip, z gate) with kvreplay's replay pool, checked against the recurrent
 * mode (ring_len 0: one state snapshot per draft, as engines do today).
 *
 * Each round drafts T = 1..4 tokens for every sequence, verifies them in one call (no
 * per-draft state), accepts a random prefix and commits it on the device; the conv window
 * of the accepted prefix comes back for the host's causal conv over xBC. Every fifth round
 * is a plain decode step. At the end, `kvr_mamba2_pool_materialize` writes the state one
 * token back (a prefix inside the ring), which must equal the recurrent state saved then.
 *
 *   spec_decode_mamba2 [cpu|cuda]     (default: CUDA when usable, else CPU) */
#include <math.h>

#include "example_mem.h"

enum { B = 4, H = 8, P = 32, G = 2, N = 32, MAXT = 4, K1 = 3, ROUNDS = 60 };
enum { CONV = H * P + 2 * G * N, NS = H * P * N };

static kvr_mamba2_pool *make_pool(kvr_context *ctx, int ring_len) {
    kvr_mamba2_pool_params p;
    CHECK(kvr_mamba2_pool_params_default(&p));
    p.n_layers = 1;
    p.n_heads = H;
    p.head_dim = P;
    p.n_groups = G;
    p.d_state = N;
    p.ring_len = ring_len; /* 0: recurrent mode */
    p.max_drafts = MAXT;
    p.max_seqs = B;
    p.conv_dim = CONV;
    p.conv_kernel = K1 + 1;
    kvr_mamba2_pool *pool = NULL;
    CHECK(kvr_mamba2_pool_new(ctx, &p, &pool));
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
    printf("spec_decode_mamba2 on %s: B=%d, heads=%d, head_dim=%d, groups=%d, d_state=%d, "
           "drafts 1..%d, %d rounds\n",
           on_cuda ? "CUDA" : "CPU", B, H, P, G, N, MAXT, ROUNDS);
    kvr_mamba2_pool *replay = make_pool(ctx, 16), *recur = make_pool(ctx, 0);
    int32_t ids[B];
    for (int b = 0; b < B; b++) {
        int32_t a, r;
        CHECK(kvr_mamba2_pool_seq_add(replay, NULL, &a));
        CHECK(kvr_mamba2_pool_seq_add(recur, NULL, &r));
        if (a != r) return 1;
        ids[b] = a;
    }
    const size_t nx = B * MAXT * H * P, nb = B * MAXT * G * N, nd = B * MAXT * H,
                 nc = B * MAXT * CONV, nw = B * K1 * CONV;
    float *h_x = malloc(nx * 4), *h_z = malloc(nx * 4), *h_b = malloc(nb * 4), *h_c = malloc(nb * 4),
          *h_dt = malloc(nd * 4), *h_conv = malloc(nc * 4), *o1 = malloc(nx * 4), *o2 = malloc(nx * 4),
          *w1 = malloc(nw * 4), *w2 = malloc(nw * 4), h_a[H], h_d[H], h_bias[H];
    void *x = buf_new(nx * 4), *z = buf_new(nx * 4), *bm = buf_new(nb * 4), *cm = buf_new(nb * 4),
         *dt = buf_new(nd * 4), *conv = buf_new(nc * 4), *out1 = buf_new(nx * 4), *out2 = buf_new(nx * 4),
         *win1 = buf_new(nw * 4), *win2 = buf_new(nw * 4), *acc = buf_new(B * 4), *a = buf_new(H * 4),
         *d = buf_new(H * 4), *bias = buf_new(H * 4);
    if (!x || !z || !bm || !cm || !dt || !conv || !out1 || !out2 || !win1 || !win2 || !acc || !a ||
        !d || !bias) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int h = 0; h < H; h++) h_a[h] = -uniform(0.2f, 2.0f), h_d[h] = uniform(-1, 1), h_bias[h] = uniform(-1, 0.5f);
    buf_put(a, h_a, sizeof h_a);
    buf_put(d, h_d, sizeof h_d);
    buf_put(bias, h_bias, sizeof h_bias);
    const int64_t ids_shape[1] = {B}, sh[1] = {H};
    kvr_tensor t_ids = tensor(ids, KVR_DTYPE_I32, 1, ids_shape, 1);
    kvr_tensor ta = tensor(a, KVR_DTYPE_F32, 1, sh, 0), td = tensor(d, KVR_DTYPE_F32, 1, sh, 0),
               tbias = tensor(bias, KVR_DTYPE_F32, 1, sh, 0);
    double worst = 0;
    int accepted_total = 0, drafted_total = 0;
    for (int round = 0; round < ROUNDS; round++) {
        int verify = round % 5 != 4; /* every fifth round: a plain decode step */
        int T = verify ? 1 + (int)(uniform(0, 1) * MAXT) % MAXT : 1;
        for (size_t i = 0; i < (size_t)B * T * H * P; i++) h_x[i] = uniform(-1, 1), h_z[i] = uniform(-2, 2);
        for (size_t i = 0; i < (size_t)B * T * G * N; i++) h_b[i] = uniform(-1, 1), h_c[i] = uniform(-1, 1);
        for (size_t i = 0; i < (size_t)B * T * H; i++) h_dt[i] = uniform(-3, 1);
        for (size_t i = 0; i < (size_t)B * T * CONV; i++) h_conv[i] = uniform(-1, 1);
        buf_put(x, h_x, (size_t)B * T * H * P * 4);
        buf_put(z, h_z, (size_t)B * T * H * P * 4);
        buf_put(bm, h_b, (size_t)B * T * G * N * 4);
        buf_put(cm, h_c, (size_t)B * T * G * N * 4);
        buf_put(dt, h_dt, (size_t)B * T * H * 4);
        buf_put(conv, h_conv, (size_t)B * T * CONV * 4);
        /* Decode takes the same tensors with T = 1. */
        const int64_t sx[4] = {B, T, H, P}, sb[4] = {B, T, G, N}, sd[3] = {B, T, H}, sc[3] = {B, T, CONV};
        kvr_tensor tx = tensor(x, KVR_DTYPE_F32, 4, sx, 0), tz = tensor(z, KVR_DTYPE_F32, 4, sx, 0),
                   tb = tensor(bm, KVR_DTYPE_F32, 4, sb, 0), tc = tensor(cm, KVR_DTYPE_F32, 4, sb, 0),
                   tdt = tensor(dt, KVR_DTYPE_F32, 3, sd, 0), tconv = tensor(conv, KVR_DTYPE_F32, 3, sc, 0),
                   t1 = tensor(out1, KVR_DTYPE_F32, 4, sx, 0), t2 = tensor(out2, KVR_DTYPE_F32, 4, sx, 0);
        kvr_mamba2_tensors in = {&t_ids, &tx, &tdt, &ta, &tb, &tc, &td, &tz, &tbias, &tconv, &t1};
        kvr_mamba2_tensors in2 = in;
        in2.out = &t2;
        if (verify) {
            CHECK(kvr_mamba2_pool_verify(replay, 0, &in, NULL, NULL));
            CHECK(kvr_mamba2_pool_verify(recur, 0, &in2, NULL, NULL));
            int32_t acc_h[B];
            for (int b = 0; b < B; b++) acc_h[b] = (int32_t)(uniform(0, 1) * (T + 1)) % (T + 1);
            for (int b = 0; b < B; b++) accepted_total += acc_h[b];
            drafted_total += B * T;
            buf_put(acc, acc_h, sizeof acc_h);
            const int64_t sw[3] = {B, K1, CONV};
            kvr_tensor tacc = tensor(acc, KVR_DTYPE_I32, 1, ids_shape, 0);
            kvr_tensor tw1 = tensor(win1, KVR_DTYPE_F32, 3, sw, 0), tw2 = tensor(win2, KVR_DTYPE_F32, 3, sw, 0);
            CHECK(kvr_mamba2_pool_commit(replay, 0, &t_ids, &tacc, &tw1, NULL));
            CHECK(kvr_mamba2_pool_commit(recur, 0, &t_ids, &tacc, &tw2, NULL));
        } else {
            CHECK(kvr_mamba2_pool_decode(replay, 0, &in, NULL, NULL));
            CHECK(kvr_mamba2_pool_decode(recur, 0, &in2, NULL, NULL));
        }
        buf_get(o1, out1, (size_t)B * T * H * P * 4);
        buf_get(o2, out2, (size_t)B * T * H * P * 4);
        double e = rel_err(o1, o2, (size_t)B * T * H * P);
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
    /* States: the recurrent state now, one more decode step, then the replay pool
     * materializes the prefix one token back (inside its ring) and the current state. */
    float *s1 = malloc(NS * 4), *s2 = malloc(NS * 4), *prev = malloc((size_t)B * NS * 4);
    void *st1 = buf_new(NS * 4), *st2 = buf_new(NS * 4);
    const int64_t ss[3] = {H, P, N}, sm[4] = {1, H, P, N};
    kvr_tensor ts1 = tensor(st1, KVR_DTYPE_F32, 3, ss, 0), ts2 = tensor(st2, KVR_DTYPE_F32, 3, ss, 0),
               tm = tensor(st1, KVR_DTYPE_F32, 4, sm, 0);
    for (int b = 0; b < B; b++) {
        CHECK(kvr_mamba2_pool_export_state(recur, 0, ids[b], &ts2, NULL, NULL));
        buf_get(prev + (size_t)b * NS, st2, NS * 4);
    }
    {
        const int64_t sx[3] = {B, H, P}, sb[3] = {B, G, N}, sd[2] = {B, H}, sc[2] = {B, CONV};
        kvr_tensor tx = tensor(x, KVR_DTYPE_F32, 3, sx, 0), tz = tensor(z, KVR_DTYPE_F32, 3, sx, 0),
                   tb = tensor(bm, KVR_DTYPE_F32, 3, sb, 0), tc = tensor(cm, KVR_DTYPE_F32, 3, sb, 0),
                   tdt = tensor(dt, KVR_DTYPE_F32, 2, sd, 0), tconv = tensor(conv, KVR_DTYPE_F32, 2, sc, 0),
                   t1 = tensor(out1, KVR_DTYPE_F32, 3, sx, 0), t2 = tensor(out2, KVR_DTYPE_F32, 3, sx, 0);
        kvr_mamba2_tensors in = {&t_ids, &tx, &tdt, &ta, &tb, &tc, &td, &tz, &tbias, &tconv, &t1};
        kvr_mamba2_tensors in2 = in;
        in2.out = &t2;
        CHECK(kvr_mamba2_pool_decode(replay, 0, &in, NULL, NULL));
        CHECK(kvr_mamba2_pool_decode(recur, 0, &in2, NULL, NULL));
    }
    double state_err = 0, prefix_err = 0;
    for (int b = 0; b < B; b++) {
        kvr_gdn_cursor cur;
        CHECK(kvr_mamba2_pool_get_cursor(replay, 0, ids[b], &cur));
        /* One token back: the state before the last decode. */
        CHECK(kvr_mamba2_pool_materialize(replay, ids[b], cur.buffered - 1, &tm, NULL, NULL));
        buf_get(s1, st1, NS * 4);
        double e = rel_err(s1, prev + (size_t)b * NS, NS);
        if (e > prefix_err) prefix_err = e;
        CHECK(kvr_mamba2_pool_export_state(replay, 0, ids[b], &ts1, NULL, NULL));
        CHECK(kvr_mamba2_pool_export_state(recur, 0, ids[b], &ts2, NULL, NULL));
        buf_get(s1, st1, NS * 4);
        buf_get(s2, st2, NS * 4);
        e = rel_err(s1, s2, NS);
        if (e > state_err) state_err = e;
    }
    kvr_gdn_pool_memory m1, m2;
    m1.struct_size = m2.struct_size = sizeof m1;
    CHECK(kvr_mamba2_pool_get_memory(replay, &m1));
    CHECK(kvr_mamba2_pool_get_memory(recur, &m2));
    printf("accepted %d of %d drafts; replay vs recurrent: max relative error %.2e (outputs), "
           "%.2e (states), %.2e (state one token back, materialized); conv windows identical\n",
           accepted_total, drafted_total, worst, state_err, prefix_err);
    printf("memory per sequence: replay %lld bytes (state %lld + ring %lld + conv %lld), "
           "recurrent with %d snapshots %lld bytes\n",
           (long long)m1.total_bytes, (long long)m1.state_bytes, (long long)m1.ring_bytes,
           (long long)m1.conv_bytes, MAXT, (long long)m2.total_bytes);
    int ok = worst < 1e-3 && state_err < 1e-3 && prefix_err < 1e-3;
    free(h_x), free(h_z), free(h_b), free(h_c), free(h_dt), free(h_conv), free(o1), free(o2),
        free(w1), free(w2), free(s1), free(s2), free(prev);
    void *bufs[] = {x, z, bm, cm, dt, conv, out1, out2, win1, win2, acc, a, d, bias, st1, st2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) buf_free(bufs[i]);
    kvr_mamba2_pool_free(replay);
    kvr_mamba2_pool_free(recur);
    kvr_context_free(ctx);
    if (!ok) {
        fprintf(stderr, "FAILED: replay and recurrent disagree\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
