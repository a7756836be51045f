// kvr-llama-check: the token and logit checks of integrations/llama.cpp (check.sh), one binary
// for kvreplay on and off (KVR_LLAMA=0 in the environment turns it off).
//
//   kvr-llama-check gen MODEL OUT [--seqs N] [--tokens N] [--ngl N] [--threads N] [--rs N]
//       greedy decoding: N sequences (default 1) with different prompts, prefilled in one
//       batch, then --tokens (default 64) steps of one token per sequence in one batch each.
//       --rs N: N recurrent-state snapshots per sequence (llama's speculative rollback; the
//       GDN op then keeps K = N + 1 snapshots) and every step verifies the greedy token plus
//       two made-up drafts in one batch, then rolls the drafts back (seq_rm).
//       Writes OUT.tokens (text) and OUT.logits (f32 of every step and sequence).
//   kvr-llama-check op OUT [--threads N]
//       GATED_DELTA_NET graphs of ggml alone on the CPU backend (decode, multi-token with
//       snapshots, broadcast key heads, strided q/k): writes OUT.logits (the op outputs).
//   kvr-llama-check cmp A B [--tol X]
//       A and B agree: identical tokens, every logit vector within X (default 1e-4) of the
//       other relative to its largest magnitude. Exit 0 when they do.
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

static int usage() {
    fprintf(stderr,
            "usage: kvr-llama-check gen MODEL OUT [--seqs N] [--tokens N] [--ngl N] [--threads N] [--rs N]\n"
            "       kvr-llama-check op OUT [--threads N]\n"
            "       kvr-llama-check cmp A B [--tol X]\n");
    return 2;
}

static void log_cb(ggml_log_level level, const char * text, void *) {
    // Errors, warnings and kvreplay's own lines (which backend ran the GDN op); everything
    // with KVR_LLAMA_CHECK_VERBOSE=1.
    static const bool all = getenv("KVR_LLAMA_CHECK_VERBOSE") && atoi(getenv("KVR_LLAMA_CHECK_VERBOSE"));
    if (all || level >= GGML_LOG_LEVEL_WARN || strstr(text, "kvreplay") != nullptr) {
        fputs(text, stderr);
    }
}

struct Out {
    std::ofstream tokens, logits;
    explicit Out(const std::string & p) : tokens(p + ".tokens"), logits(p + ".logits", std::ios::binary) {}
    void put(const float * x, size_t n) { logits.write((const char *) x, n * sizeof(float)); }
};

static int argmax(const float * x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (x[i] > x[best]) {
            best = i;
        }
    }
    return best;
}

static int gen(const std::string & model_path, const std::string & out_path, int n_seqs, int n_tokens, int ngl,
               int threads, int n_rs) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers       = ngl;
    llama_model * model   = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", model_path.c_str());
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_prompt = 8;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = 256 * n_seqs;
    cp.n_batch         = 256;
    cp.n_ubatch        = 256;
    cp.n_seq_max       = n_seqs;
    cp.n_threads       = threads;
    cp.n_threads_batch = threads;
    cp.n_rs_seq        = n_rs;
    cp.kv_unified      = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    if (n_rs > 0 && (int) llama_n_rs_seq(ctx) != n_rs) {
        fprintf(stderr, "this model keeps %u snapshots, not %d (no rollback support)\n", llama_n_rs_seq(ctx), n_rs);
        return 1;
    }
    Out out(out_path);
    out.tokens << "vocab " << n_vocab << "\n";
    llama_batch batch = llama_batch_init(256, 0, n_seqs);
    std::vector<int> pos(n_seqs, 0), last(n_seqs, 0);
    // Prefill: a different prompt per sequence, all in one batch.
    batch.n_tokens = 0;
    for (int s = 0; s < n_seqs; s++) {
        for (int i = 0; i < n_prompt; i++) {
            const int j = batch.n_tokens++;
            batch.token[j]     = (7 * i + 13 * s + 3) % n_vocab;
            batch.pos[j]       = pos[s]++;
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = s;
            batch.logits[j]    = i == n_prompt - 1;
        }
    }
    auto decode = [&]() {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed\n");
            exit(1);
        }
    };
    decode();
    double decode_s = 0;
    std::vector<int> out_row(n_seqs);
    for (int s = 0; s < n_seqs; s++) {
        out_row[s] = (s + 1) * n_prompt - 1;
    }
    for (int step = 0; step <= n_tokens; step++) {
        // Greedy token of every sequence from its last logits.
        for (int s = 0; s < n_seqs; s++) {
            const float * l = llama_get_logits_ith(ctx, out_row[s]);
            out.put(l, n_vocab);
            last[s] = argmax(l, n_vocab);
            out.tokens << last[s] << (s + 1 < n_seqs ? ' ' : '\n');
        }
        if (step == n_tokens) {
            break;
        }
        const int width = n_rs > 0 ? 3 : 1;  // the token, then two drafts verified with it
        batch.n_tokens = 0;
        for (int s = 0; s < n_seqs; s++) {
            for (int d = 0; d < width; d++) {
                const int j = batch.n_tokens++;
                batch.token[j]     = d == 0 ? last[s] : (last[s] + 31 * d + step) % n_vocab;
                batch.pos[j]       = pos[s] + d;
                batch.n_seq_id[j]  = 1;
                batch.seq_id[j][0] = s;
                batch.logits[j]    = true;
            }
            out_row[s] = s * width;
        }
        const auto t_start = std::chrono::steady_clock::now();
        decode();
        llama_synchronize(ctx);
        decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
        for (int s = 0; s < n_seqs; s++) {
            if (width > 1) {
                // The drafts' logits are part of the comparison; then they are rolled back.
                for (int d = 1; d < width; d++) {
                    out.put(llama_get_logits_ith(ctx, s * width + d), n_vocab);
                }
                if (!llama_memory_seq_rm(llama_get_memory(ctx), s, pos[s] + 1, -1)) {
                    fprintf(stderr, "seq_rm (rollback of the drafts) failed\n");
                    return 1;
                }
            }
            pos[s] += 1;
        }
    }
    printf("%s: %d sequence(s), %d decode steps of %d token(s) each: %.3f ms per step\n", model_path.c_str(),
           n_seqs, n_tokens, n_seqs * (n_rs > 0 ? 3 : 1), 1e3 * decode_s / std::max(n_tokens, 1));
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

// GATED_DELTA_NET graphs on the CPU backend: the op's outputs (attention and state tails).
static int op(const std::string & out_path, int threads) {
    struct Shape {
        int64_t hk, hv, d, t, b, k;
        bool    permuted;
    };
    const Shape shapes[] = {
        { 2, 2, 128, 1, 1, 1, false },   // decode
        { 16, 32, 128, 1, 3, 1, false }, // the Qwen3-Next layer, broadcast key heads
        { 2, 4, 64, 5, 2, 3, false },    // multi-token, 3 snapshots (fewer than tokens)
        { 2, 2, 32, 2, 2, 4, false },    // more snapshot slots than tokens
        { 4, 4, 64, 3, 2, 1, true },     // strided q/k
    };
    Out           out(out_path);
    std::mt19937  rng(42);
    auto          uni = [&](float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); };
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, threads);
    for (const Shape & s : shapes) {
        ggml_init_params ip = { 256 * 1024 * 1024, nullptr, false };
        ggml_context *   g  = ggml_init(ip);
        ggml_tensor *    q, *k;
        if (s.permuted) {
            q = ggml_permute(g, ggml_new_tensor_4d(g, GGML_TYPE_F32, s.d, s.t, s.hk, s.b), 0, 2, 1, 3);
            k = ggml_permute(g, ggml_new_tensor_4d(g, GGML_TYPE_F32, s.d, s.t, s.hk, s.b), 0, 2, 1, 3);
        } else {
            q = ggml_new_tensor_4d(g, GGML_TYPE_F32, s.d, s.hk, s.t, s.b);
            k = ggml_new_tensor_4d(g, GGML_TYPE_F32, s.d, s.hk, s.t, s.b);
        }
        ggml_tensor * v     = ggml_new_tensor_4d(g, GGML_TYPE_F32, s.d, s.hv, s.t, s.b);
        ggml_tensor * gt    = ggml_new_tensor_4d(g, GGML_TYPE_F32, 1, s.hv, s.t, s.b);
        ggml_tensor * beta  = ggml_new_tensor_4d(g, GGML_TYPE_F32, 1, s.hv, s.t, s.b);
        ggml_tensor * state = ggml_new_tensor_4d(g, GGML_TYPE_F32, s.d, s.d, s.hv, s.b);
        ggml_tensor * qn    = ggml_l2_norm(g, q, 1e-6f);
        ggml_tensor * kn    = ggml_l2_norm(g, k, 1e-6f);
        ggml_tensor * r     = ggml_gated_delta_net(g, qn, kn, v, gt, beta, state, s.k);
        ggml_cgraph * gf    = ggml_new_graph(g);
        ggml_build_forward_expand(gf, r);
        auto fill = [&](ggml_tensor * x, float lo, float hi) {
            ggml_tensor * base = x->view_src ? x->view_src : x;
            float *       p    = (float *) base->data;
            for (int64_t i = 0; i < ggml_nelements(base); i++) {
                p[i] = uni(lo, hi);
            }
        };
        fill(q, -1, 1);
        fill(k, -1, 1);
        fill(v, -1, 1);
        fill(gt, -2, -0.01f);
        fill(beta, 0.05f, 1);
        fill(state, -0.5f, 0.5f);
        // The snapshot slots the op leaves unwritten (K > T) hold zeros in both runs.
        memset(r->data, 0, ggml_nbytes(r));
        if (ggml_backend_graph_compute(cpu, gf) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "graph compute failed\n");
            return 1;
        }
        const int64_t n = ggml_nelements(r);
        out.put((const float *) r->data, n);
        out.tokens << "op " << s.hk << "," << s.hv << "," << s.d << "," << s.t << "," << s.b << "," << s.k << " " << n
                   << "\n";
        ggml_free(g);
    }
    ggml_backend_free(cpu);
    return 0;
}

static std::vector<float> read_floats(const std::string & p) {
    std::ifstream      f(p, std::ios::binary);
    std::vector<float> v;
    float              x;
    while (f.read((char *) &x, sizeof x)) {
        v.push_back(x);
    }
    return v;
}

static std::string read_text(const std::string & p) {
    std::ifstream     f(p);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
}

// Rows are compared one logit vector (or op output) at a time: "op" lines of .tokens name
// their lengths; gen files have rows of n_vocab logits (their "vocab" line).
static int cmp(const std::string & a, const std::string & b, double tol) {
    const std::string ta = read_text(a + ".tokens"), tb = read_text(b + ".tokens");
    if (ta.empty() || ta != tb) {
        fprintf(stderr, "FAIL: the token sequences differ (or are empty): %s vs %s\n", a.c_str(), b.c_str());
        return 1;
    }
    const std::vector<float> la = read_floats(a + ".logits"), lb = read_floats(b + ".logits");
    if (la.empty() || la.size() != lb.size()) {
        fprintf(stderr, "FAIL: %zu vs %zu logits\n", la.size(), lb.size());
        return 1;
    }
    std::vector<size_t> rows;
    std::istringstream  lines(ta);
    std::string         line;
    size_t              n_tok = 0, n_vocab = 0;
    while (std::getline(lines, line)) {
        if (line.rfind("op ", 0) == 0) {
            rows.push_back(std::stoull(line.substr(line.rfind(' ') + 1)));
        } else if (line.rfind("vocab ", 0) == 0) {
            n_vocab = std::stoull(line.substr(6));
        } else {
            std::istringstream w(line);
            std::string        t;
            while (w >> t) {
                n_tok++;
            }
        }
    }
    for (size_t i = 0; n_vocab && i < la.size() / n_vocab; i++) {
        rows.push_back(n_vocab);
    }
    double worst = 0;
    size_t at    = 0;
    for (size_t r = 0; r < rows.size(); r++) {
        double m = 1e-30, e = 0;
        for (size_t i = at; i < at + rows[r]; i++) {
            m = std::max(m, (double) std::fabs(lb[i]));
            e = std::max(e, (double) std::fabs(la[i] - lb[i]));
            if (!std::isfinite(la[i]) || !std::isfinite(lb[i])) {
                e = INFINITY;
            }
        }
        worst = std::max(worst, e / m);
        at += rows[r];
    }
    if (at != la.size()) {
        fprintf(stderr, "FAIL: rows cover %zu of %zu values\n", at, la.size());
        return 1;
    }
    printf("%s vs %s: %zu tokens identical, %zu vectors, max relative difference %.3g (tolerance %.0e)\n",
           a.c_str(), b.c_str(), n_tok, rows.size(), worst, tol);
    return worst <= tol ? 0 : 1;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        return usage();
    }
    const std::string mode = argv[1];
    std::vector<std::string> pos;
    int    seqs = 1, tokens = 64, ngl = 0, threads = 2, rs = 0;
    double tol  = 1e-4;
    for (int i = 2; i < argc; i++) {
        const std::string a = argv[i];
        auto next = [&]() -> const char * { return i + 1 < argc ? argv[++i] : "0"; };
        if (a == "--seqs") {
            seqs = atoi(next());
        } else if (a == "--tokens") {
            tokens = atoi(next());
        } else if (a == "--ngl") {
            ngl = atoi(next());
        } else if (a == "--threads") {
            threads = atoi(next());
        } else if (a == "--rs") {
            rs = atoi(next());
        } else if (a == "--tol") {
            tol = atof(next());
        } else {
            pos.push_back(a);
        }
    }
    llama_log_set(log_cb, nullptr);
    ggml_log_set(log_cb, nullptr);
    if (mode == "gen" && pos.size() == 2) {
        llama_backend_init();
        return gen(pos[0], pos[1], seqs, tokens, ngl, threads, rs);
    }
    if (mode == "op" && pos.size() == 1) {
        return op(pos[0], threads);
    }
    if (mode == "cmp" && pos.size() == 2) {
        return cmp(pos[0], pos[1], tol);
    }
    return usage();
}
