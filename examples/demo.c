/* kvreplay demo: the memory system of a hybrid model, driven the way an inference engine
 * drives it, checked, timed and sized.
 *
 *   demo [MODEL.gguf] [cpu|cuda|auto] [--batch B] [--steps N] [--rounds R] [--drafts T]
 *        [--prefill P] [--ctx TOKENS] [--budget GIB] [--seed S] [--help]
 *
 * 1. Opens a GGUF file (default tests/data/tiny-qwen3next.gguf; any file kvreplay plans,
 *    e.g. tests/data/qwen3next-80b-a3b-header.gguf, the Qwen3-Next-80B-A3B configuration
 *    without weights) and prints its layer plan.
 * 2. Sizes it for a memory budget (kvr_model_compute_sizing): memory per sequence and sequences that
 *    fit with kvreplay (paged KV + GDN replay ring) against per-draft state snapshots and
 *    contiguous KV, at the model's full scale.
 * 3. Builds the KV pool (attention layers) and the GDN replay pool (GDN layers) from the
 *    plan (kvr_model_get_kv_pool_params / kvr_model_get_gdn_pool_params, sized for this run), plus
 *    a recurrent GDN pool (ring_len 0: state read and written every step, one snapshot per
 *    draft, what engines do today) as the reference, on CUDA when a context can be made
 *    (inputs and outputs then live in device memory), else on the CPU.
 * 4. Runs B sequences: prefill (GDN states imported, K/V appended), N decode steps and R
 *    speculative rounds (T drafts verified in one call per layer, a random accepted prefix
 *    committed, the rejected drafts rolled back: GDN commit, KV truncate), layer by layer
 *    over every GDN and attention layer of the plan.
 * 5. Checks every output: GDN replay against the recurrent pool fed the same inputs
 *    (outputs, conv windows, final states), paged KV decode against a naive attention in C
 *    over the kept K/V. Prints the errors, PASS or FAIL, and the time per decode step and
 *    per speculative round of the replay pool against the recurrent one (wall clock, with a
 *    context synchronize).
 *
 * This is a demo of the memory system, not of a model: q, k, v, g, beta and the conv inputs
 * are random (seeded), not a transformer forward. When the file has weights, the GDN decay
 * gates use its ssm_a and ssm_dt.bias; a metadata-only file gives the plan and sizing at
 * full scale and random inputs for pools of the full-scale shapes.
 *
 * Exit status: 0 when every check passes, 1 on a failed check or an error, 2 on bad usage. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <time.h>
#include <unistd.h>

#include "example_mem.h"

#define DEFAULT_MODEL "tests/data/tiny-qwen3next.gguf"

typedef struct {
    const char *model, *backend;
    long long batch, steps, rounds, drafts, prefill, ctx, seed;
    double budget_gib;
} options;

static void usage(FILE *f, const char *argv0) {
    fprintf(f,
            "usage: %s [MODEL.gguf] [cpu|cuda|auto] [options]\n"
            "\n"
            "Opens a GGUF model, sizes kvreplay's pools for a memory budget, then runs batched\n"
            "decode with speculative rounds and rollback over every GDN and attention layer of\n"
            "its plan (random inputs: the memory system, not a transformer forward), checks\n"
            "the outputs against the reference and times them against the recurrent baseline.\n"
            "\n"
            "  MODEL.gguf       default " DEFAULT_MODEL " (from the repository root);\n"
            "                   tests/data/qwen3next-80b-a3b-header.gguf is Qwen3-Next-80B-A3B\n"
            "  cpu|cuda|auto    backend (default auto: CUDA when a context can be made)\n"
            "  --batch B        sequences decoded together (default 4)\n"
            "  --steps N        plain decode steps (default 32; 4 at full scale on the CPU)\n"
            "  --rounds R       speculative rounds (default 16; 2 at full scale on the CPU)\n"
            "  --drafts T       drafts per round, 1..8 (default 4)\n"
            "  --prefill P      prompt tokens per sequence (default 32)\n"
            "  --ctx TOKENS     tokens per sequence for the sizing (default min(8192, the\n"
            "                   model's context length))\n"
            "  --budget GIB     memory budget for the sizing (default 80)\n"
            "  --seed S         random seed (default 1)\n"
            "  --help           this text\n",
            argv0);
}

static int parse_ll(const char *s, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

static int parse_options(int argc, char **argv, options *o) {
    *o = (options){NULL, "auto", 4, -1, -1, 4, 32, 0, 1, 80.0};
    struct {
        const char *name;
        long long *dst, lo, hi;
    } ints[] = {{"batch", &o->batch, 1, 4096},       {"steps", &o->steps, 0, 1000000},
                {"rounds", &o->rounds, 0, 1000000},  {"drafts", &o->drafts, 1, 8},
                {"prefill", &o->prefill, 1, 1 << 20}, {"ctx", &o->ctx, 1, 1LL << 40},
                {"seed", &o->seed, 0, 1LL << 62}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout, argv[0]);
            exit(0);
        }
        if (!strcmp(a, "cpu") || !strcmp(a, "cuda") || !strcmp(a, "auto")) {
            o->backend = a;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            if (o->model) {
                fprintf(stderr, "demo: unexpected argument '%s' (the model is '%s')\n", a, o->model);
                return 0;
            }
            o->model = a;
            continue;
        }
        /* --name=value or --name value */
        const char *name = a + 2, *eq = strchr(name, '='), *val;
        size_t n = eq ? (size_t)(eq - name) : strlen(name);
        int known = n == 6 && !strncmp(name, "budget", 6);
        for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
            known |= strlen(ints[k].name) == n && !strncmp(name, ints[k].name, n);
        if (!known) {
            fprintf(stderr, "demo: unknown option '%.*s'\n", (int)(n + 2), a);
            return 0;
        }
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else {
            fprintf(stderr, "demo: %s needs a value\n", a);
            return 0;
        }
        for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
            if (strlen(ints[k].name) == n && !strncmp(name, ints[k].name, n)) {
                if (!parse_ll(val, ints[k].lo, ints[k].hi, ints[k].dst)) {
                    fprintf(stderr, "demo: --%s takes an integer in %lld..%lld, not '%s'\n",
                            ints[k].name, ints[k].lo, ints[k].hi, val);
                    return 0;
                }
            }
        if (n == 6 && !strncmp(name, "budget", 6)) {
            char *end;
            o->budget_gib = strtod(val, &end);
            if (end == val || *end || !(o->budget_gib > 0) || o->budget_gib > 1e9) {
                fprintf(stderr, "demo: --budget takes a positive number of GiB, not '%s'\n", val);
                return 0;
            }
        }
    }
    return 1;
}

static const char *layers(int n) { return n == 1 ? "layer" : "layers"; }

static const char *dtype_name(kvr_dtype d) {
    return d == KVR_DTYPE_F32 ? "f32" : d == KVR_DTYPE_F16 ? "f16" : d == KVR_DTYPE_BF16 ? "bf16" : "?";
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Bytes as B / KiB / MiB / GiB (a few rotating buffers, so one printf can use several). */
static const char *human(double b) {
    static char bufs[8][32];
    static int next;
    char *s = bufs[next++ % 8];
    if (b < 1024)
        snprintf(s, 32, "%.0f B", b);
    else if (b < 1024.0 * 1024)
        snprintf(s, 32, "%.1f KiB", b / 1024);
    else if (b < 1024.0 * 1024 * 1024)
        snprintf(s, 32, "%.2f MiB", b / (1024.0 * 1024));
    else
        snprintf(s, 32, "%.2f GiB", b / (1024.0 * 1024 * 1024));
    return s;
}

/* Every buffer the demo allocates, freed at the end. */
static void *owned[64];
static int n_owned, owned_host[64];
static void *alloc(size_t bytes, int host) {
    void *p = host ? calloc(1, bytes ? bytes : 4) : buf_new(bytes ? bytes : 4);
    if (!p || n_owned == 64) {
        fprintf(stderr, "demo: out of %s memory (%s)\n", host || !on_cuda ? "host" : "device",
                human((double)bytes));
        exit(1);
    }
    owned_host[n_owned] = host;
    owned[n_owned++] = p;
    return p;
}
static void free_all(void) {
    while (n_owned > 0) {
        n_owned--;
        if (owned_host[n_owned])
            free(owned[n_owned]);
        else
            buf_free(owned[n_owned]);
    }
}
static void *at(void *base, size_t byte_offset) { return (void *)((uintptr_t)base + byte_offset); }

/* A value on a 1/1024 grid in [-1, 1]: exact in f16, so the K/V the pool stores (f16) equal
 * the reference's and the check measures the decode alone. */
static float grid(void) { return (float)floor(uniform(-1024, 1024)) / 1024.0f; }

static double rel_err(const float *got, const float *ref, size_t n) {
    double num = 0, den = 1e-6;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (d > num) num = d;
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return num / den;
}

/* ---- the model ------------------------------------------------------------------------ */

typedef struct {
    kvr_model *m;
    kvr_model_info info;
    int n_attn, n_gdn;
    int *attn_layer, *gdn_layer; /* model layer index of each attention / GDN layer */
    kvr_layer_plan attn, gdn;    /* the first one of each kind */
    float *gate_a, *gate_dt;     /* [n_gdn][Hv] from ssm_a / ssm_dt.bias, or NULL */
} model;

static int open_model(const char *path, model *md) {
    memset(md, 0, sizeof *md);
    kvr_status s = kvr_model_open(path, &md->m);
    if (s != KVR_STATUS_OK) {
        fprintf(stderr, "demo: cannot open '%s': %s: %s\n", path, kvr_status_string(s),
                kvr_error_last_message());
        return 0;
    }
    md->info.struct_size = sizeof md->info;
    CHECK(kvr_model_get_info(md->m, &md->info));
    int n = md->info.n_layers;
    md->attn_layer = alloc(sizeof(int) * (size_t)n, 1);
    md->gdn_layer = alloc(sizeof(int) * (size_t)n, 1);
    char *order = alloc((size_t)n + 1, 1);
    for (int l = 0; l < n; l++) {
        kvr_layer_plan p;
        CHECK(kvr_model_get_layer(md->m, l, &p));
        order[l] = p.kind == KVR_LAYER_ATTENTION ? 'A'
                   : p.kind == KVR_LAYER_GDN     ? 'G'
                   : p.kind == KVR_LAYER_MAMBA2  ? 'M'
                                                 : '-';
        if (p.kind == KVR_LAYER_ATTENTION) {
            if (md->n_attn == 0) md->attn = p;
            md->attn_layer[md->n_attn++] = l;
        } else if (p.kind == KVR_LAYER_GDN) {
            if (md->n_gdn == 0) md->gdn = p;
            md->gdn_layer[md->n_gdn++] = l;
        }
    }
    printf("model    %s: %s, %d layers, context %lld, %lld tensors (%s)\n", path,
           kvr_model_get_arch(md->m), n, (long long)md->info.context_length,
           (long long)md->info.n_tensors, human((double)md->info.file_bytes));
    printf("plan     %s  (G Gated DeltaNet, A attention, M Mamba-2, - MLP only)\n", order);
    if (md->n_gdn)
        printf("         %d GDN %s: %d key / %d value heads, dk %d, dv %d, conv %d x %d\n",
               md->n_gdn, layers(md->n_gdn), md->gdn.k_heads, md->gdn.v_heads, md->gdn.dk, md->gdn.dv,
               md->gdn.conv_kernel, md->gdn.conv_dim);
    if (md->n_attn)
        printf("         %d attention %s: %d query / %d KV heads, head dim %d%s\n", md->n_attn,
               layers(md->n_attn),
               md->attn.heads, md->attn.kv_heads, md->attn.head_dim_k,
               md->attn.sliding_window ? ", sliding window" : "");
    if (md->info.n_mamba2_layers)
        printf("         %d Mamba-2 layers: sized with the Mamba-2 replay pool "
               "(kvr_model_get_mamba2_pool_params), not decoded here (spec_decode_mamba2.c)\n",
               md->info.n_mamba2_layers);

    /* The decay gates from the weights, when the file has them as f32 (as GGUF converters
     * store these 1-D tensors): g = A * softplus(x + dt_bias) with A = ssm_a = -exp(A_log). */
    if (md->n_gdn) {
        int hv = md->gdn.v_heads;
        float *a = alloc(sizeof(float) * (size_t)md->n_gdn * (size_t)hv, 1);
        float *dt = alloc(sizeof(float) * (size_t)md->n_gdn * (size_t)hv, 1);
        int ok = 1;
        for (int j = 0; j < md->n_gdn && ok; j++) {
            char name[64];
            const int64_t shape[1] = {hv};
            kvr_tensor ta, td;
            snprintf(name, sizeof name, "blk.%d.ssm_a", md->gdn_layer[j]);
            ok = kvr_model_get_tensor(md->m, name, 1, shape, &ta) == KVR_STATUS_OK &&
                 ta.dtype == KVR_DTYPE_F32;
            snprintf(name, sizeof name, "blk.%d.ssm_dt.bias", md->gdn_layer[j]);
            ok = ok && kvr_model_get_tensor(md->m, name, 1, shape, &td) == KVR_STATUS_OK &&
                 td.dtype == KVR_DTYPE_F32;
            if (ok) {
                memcpy(a + (size_t)j * hv, ta.data, sizeof(float) * (size_t)hv);
                memcpy(dt + (size_t)j * hv, td.data, sizeof(float) * (size_t)hv);
            }
        }
        if (ok) md->gate_a = a, md->gate_dt = dt;
    }
    return 1;
}

/* ---- sizing at full scale -------------------------------------------------------------- */

static void print_sizing(const model *md, const kvr_model_sizing *z, int drafts, int page, double budget_gib) {
    printf("\nmemory per sequence at %lld tokens, %d drafts per speculative round "
           "(kvr_model_compute_sizing)\n",
           (long long)z->seq_len, drafts);
    int n_rec = z->n_gdn_layers + z->n_mamba2_layers;
    if (n_rec) {
        double replay = (double)(z->state_bytes_per_seq + z->ring_bytes_per_seq),
               recur = (double)(z->state_bytes_per_seq + z->snapshot_bytes_per_seq);
        printf("  %s, %2d %-6s   replay:    state %s + ring and conv window %s = %s\n",
               z->n_gdn_layers ? "GDN" : "SSM", n_rec, layers(n_rec),
               human((double)z->state_bytes_per_seq), human((double)z->ring_bytes_per_seq),
               human(replay));
        printf("                   recurrent: state %s + %d per-draft snapshots %s = %s (%.1fx)\n",
               human((double)z->state_bytes_per_seq), drafts,
               human((double)z->snapshot_bytes_per_seq), human(recur), recur / replay);
    }
    if (z->n_attention_layers)
        printf("  KV, %2d %-6s    paged:      %s (%lld pages of %lld tokens)\n"
               "                   contiguous: %s (the %lld-token context reserved, %.1fx)\n",
               z->n_attention_layers, layers(z->n_attention_layers),
               human((double)z->paged_kv_bytes_per_seq),
               (long long)z->pages_per_seq, (long long)page,
               human((double)z->contiguous_kv_bytes_per_seq),
               (long long)(md->info.context_length > z->seq_len ? md->info.context_length
                                                                : z->seq_len),
               (double)z->contiguous_kv_bytes_per_seq /
                   (double)(z->paged_kv_bytes_per_seq ? z->paged_kv_bytes_per_seq : 1));
    if (z->n_gdn_layers && z->n_mamba2_layers)
        printf("  of which Mamba-2 (%d layers), replay: %s\n", z->n_mamba2_layers,
               human((double)z->mamba2_bytes_per_seq));
    static const char *names[4] = {"paged KV + replay ring (kvreplay)",
                                   "paged KV + per-draft snapshots",
                                   "contiguous KV + replay ring",
                                   "contiguous KV + per-draft snapshots"};
    printf("sequences that fit in %.1f GiB\n", budget_gib);
    for (int i = 0; i < 4; i++) {
        if (i > 0 && z->bytes_per_seq[i] == z->bytes_per_seq[i - 1]) continue;
        printf("  %-38s %12s/seq %10lld", names[i], human((double)z->bytes_per_seq[i]),
               (long long)z->max_seqs[i]);
        double r = i > 0 && z->max_seqs[i] > 0 ? (double)z->max_seqs[0] / (double)z->max_seqs[i] : 0;
        if (r >= 1.05)
            printf("   kvreplay fits %.1fx as many", r);
        else if (r > 0 && r < 0.95)
            printf("   kvreplay fits %.0f%% fewer", 100 * (1 - r));
        else if (r > 0)
            printf("   about the same");
        printf("\n");
    }
}

/* ---- backend --------------------------------------------------------------------------- */

/* Why the model's shapes have no CUDA kernels, or NULL. */
static const char *cuda_gap(const model *md) {
    static char why[160];
    const kvr_layer_plan *g = &md->gdn, *a = &md->attn;
    if (md->n_gdn) {
        int okk = g->dk == 32 || g->dk == 64 || g->dk == 128 || g->dk == 256;
        int okv = g->dv == 32 || g->dv == 64 || g->dv == 128 || g->dv == 256;
        if (!okk || !okv) {
            snprintf(why, sizeof why,
                     "the GDN kernels take dk and dv in {32, 64, 128, 256}, not %d and %d", g->dk,
                     g->dv);
            return why;
        }
    }
    if (md->n_attn) {
        int d = a->head_dim_k;
        if (d != 64 && d != 80 && d != 96 && d != 128 && d != 256) {
            snprintf(why, sizeof why,
                     "the KV decode kernels take head dims 64, 80, 96, 128 or 256, not %d", d);
            return why;
        }
        if (a->kv_heads > 0 && a->heads / a->kv_heads > 16) {
            snprintf(why, sizeof why, "the KV decode kernels take at most 16 query heads per KV head");
            return why;
        }
    }
    return NULL;
}

static kvr_context *pick_backend(const char *want, const model *md) {
    const char *gap = cuda_gap(md);
    if (!strcmp(want, "cpu")) return example_context("cpu");
    if (!strcmp(want, "cuda")) {
        if (gap) {
            fprintf(stderr, "demo: cannot run this model on CUDA: %s\n", gap);
            exit(1);
        }
        return example_context("cuda");
    }
    /* auto: CUDA when the kernels, the driver and a device are there and the shapes fit. */
    const char *why = NULL;
    if (!kvr_library_kernels_compiled())
        why = "the library was built without CUDA kernels";
    else if (!load_driver())
        why = "no usable CUDA driver or device";
    else if (gap)
        why = gap;
    if (!why) {
        kvr_context_params cp;
        CHECK(kvr_context_params_default(&cp));
        cp.backend = KVR_BACKEND_CUDA;
        kvr_context *ctx = NULL;
        if (kvr_context_new(&cp, &ctx) == KVR_STATUS_OK) {
            on_cuda = 1;
            return ctx;
        }
        why = kvr_error_last_message();
    }
    printf("backend  CPU (CUDA not used: %s)\n", why);
    return example_context("cpu");
}

/* ---- the run ---------------------------------------------------------------------------- */

typedef struct {
    double replay_decode, recur_decode, replay_round, recur_round, kv_decode, kv_round;
    int n_decode, n_round; /* timed iterations (the first of each kind is a warm-up) */
} timings;

int main(int argc, char **argv) {
    options o;
    if (!parse_options(argc, argv, &o)) {
        fprintf(stderr, "usage: %s [MODEL.gguf] [cpu|cuda|auto] [options]; see --help\n", argv[0]);
        return 2;
    }
    /* The default model, from the repository root or from examples/ or examples/build/. */
    const char *path = o.model;
    if (!path) {
        static const char *tries[] = {DEFAULT_MODEL, "../" DEFAULT_MODEL, "../../" DEFAULT_MODEL};
        path = DEFAULT_MODEL;
        for (size_t i = 0; i < 3; i++)
            if (access(tries[i], R_OK) == 0) {
                path = tries[i];
                break;
            }
    }
    rng = 0x9E3779B97F4A7C15ull ^ ((unsigned long long)o.seed * 0xD1B54A32D192ED03ull);
    if (!rng) rng = 1;

    printf("kvreplay %s demo: paged KV + GDN replay pools under batched, speculative decode\n",
           kvr_library_version());
    model md;
    if (!open_model(path, &md)) {
        if (!o.model)
            fprintf(stderr, "demo: run it from the repository root, or pass a GGUF path (--help)\n");
        free_all();
        return 1;
    }
    const int B = (int)o.batch, T = (int)o.drafts;
    long long ctx_len = o.ctx ? o.ctx
                              : (md.info.context_length > 0 && md.info.context_length < 8192
                                     ? md.info.context_length
                                     : 8192);

    /* Full-scale sizing. */
    kvr_model_sizing_params sp;
    CHECK(kvr_model_sizing_params_default(&sp));
    sp.budget_bytes = (int64_t)(o.budget_gib * 1073741824.0);
    sp.seq_len = ctx_len;
    sp.spec_window = T;
    kvr_model_sizing z;
    z.struct_size = sizeof z;
    kvr_status s = kvr_model_compute_sizing(md.m, &sp, &z);
    if (s != KVR_STATUS_OK) {
        fprintf(stderr, "demo: cannot size this model: %s: %s\n", kvr_status_string(s),
                kvr_error_last_message());
        kvr_model_free(md.m);
        free_all();
        return 1;
    }
    print_sizing(&md, &z, T, sp.page_size, o.budget_gib);

    if (md.n_gdn == 0 && md.n_attn == 0) {
        printf("\nnothing to decode: the plan has no attention or Gated DeltaNet layers\n");
        kvr_model_free(md.m);
        free_all();
        return 0;
    }

    /* Pools for this run, from the plan: sized for B sequences of the run's length. */
    printf("\n");
    kvr_context *ctx = pick_backend(o.backend, &md);
    if (on_cuda) {
        kvr_device_info di;
        memset(&di, 0, sizeof di);
        di.struct_size = sizeof di;
        CHECK(kvr_context_get_device_info(ctx, &di));
        printf("backend  CUDA: %s (inputs and outputs in device memory)\n", di.name);
        CHECK(kvr_context_load_kernels(ctx));
    } else if (strcmp(o.backend, "auto") != 0) {
        printf("backend  CPU\n");
    }
    /* Full-scale models on the CPU: a few steps show the same (a long run shows progress). */
    if (o.steps < 0 || o.rounds < 0) {
        int big = !on_cuda && (double)z.state_bytes_per_seq * B > 64.0 * 1024 * 1024;
        if (o.steps < 0) o.steps = big ? 4 : 32;
        if (o.rounds < 0) o.rounds = big ? 2 : 16;
        if (big)
            printf("         full scale on the CPU: %lld steps and %lld rounds unless --steps / "
                   "--rounds say otherwise\n",
                   o.steps, o.rounds);
    }
    const long long max_prefill = o.prefill + 3 * (B > 3 ? 3 : B - 1);
    kvr_model_sizing_params rp = sp;
    rp.seq_len = max_prefill + o.steps + o.rounds * T;
    rp.budget_bytes = 1;
    kvr_model_sizing rz;
    rz.struct_size = sizeof rz;
    CHECK(kvr_model_compute_sizing(md.m, &rp, &rz));
    rp.budget_bytes = rz.bytes_per_seq[0] * B;
    kvr_kv_pool_params kp;
    kvr_gdn_pool_params gp, gr;
    memset(&kp, 0, sizeof kp);
    memset(&gp, 0, sizeof gp);
    memset(&gr, 0, sizeof gr);
    int use_kv = 0, use_gdn = 0;
    if (md.n_attn) {
        CHECK(kvr_kv_pool_params_default(&kp));
        s = kvr_model_get_kv_pool_params(md.m, &rp, &kp);
        if (s == KVR_STATUS_OK)
            use_kv = 1;
        else
            printf("pools    no KV pool: %s\n", kvr_error_last_message());
    }
    if (md.n_gdn) {
        CHECK(kvr_gdn_pool_params_default(&gp));
        s = kvr_model_get_gdn_pool_params(md.m, &rp, &gp);
        if (s == KVR_STATUS_OK)
            use_gdn = 1;
        else
            printf("pools    no GDN pool: %s\n", kvr_error_last_message());
        gr = gp;
        gr.ring_len = 0; /* recurrent mode: the reference */
        gr.max_drafts = T;
    }
    if (!use_kv && !use_gdn) {
        kvr_context_free(ctx);
        kvr_model_free(md.m);
        free_all();
        fprintf(stderr, "demo: no pool can be built from this plan\n");
        return 1;
    }
    kvr_kv_pool *kv = NULL;
    kvr_gdn_pool *replay = NULL, *recur = NULL;
    kvr_gdn_pool_memory mem_replay, mem_recur;
    mem_replay.struct_size = mem_recur.struct_size = sizeof mem_replay;
    if (use_kv) {
        CHECK(kvr_kv_pool_new(ctx, &kp, &kv));
        printf("pools    KV: %d %s, %d heads x %d, %s, %lld pages of %d tokens (%s)\n",
               kp.n_layers, layers(kp.n_layers), kp.n_kv_heads, kp.head_dim, dtype_name(kp.dtype),
               (long long)kp.capacity_pages, kp.page_size,
               human((double)kp.capacity_pages * kp.page_size * (double)rz.kv_bytes_per_token));
    }
    if (use_gdn) {
        CHECK(kvr_gdn_pool_new(ctx, &gp, &replay));
        CHECK(kvr_gdn_pool_new(ctx, &gr, &recur));
        CHECK(kvr_gdn_pool_get_memory(replay, &mem_replay));
        CHECK(kvr_gdn_pool_get_memory(recur, &mem_recur));
        printf("         GDN replay: %d %s, ring %d, up to %d drafts, %s per sequence\n",
               gp.n_layers, layers(gp.n_layers), gp.ring_len, gp.max_drafts,
               human((double)mem_replay.total_bytes));
        printf("         GDN recurrent (the reference): ring 0, %d per-draft snapshots, %s per "
               "sequence\n",
               gr.max_drafts, human((double)mem_recur.total_bytes));
    }
    printf("inputs   random (seed %lld): this exercises the memory system, not a transformer "
           "forward%s\n",
           o.seed,
           md.info.n_tensors == 0 ? "; the file has no weights, so the pools have the full-scale "
                                    "shapes and every input is random"
           : md.gate_a            ? "; GDN decay gates from the file's ssm_a and ssm_dt.bias"
                                  : "");

    /* Shapes. */
    const int Lg = use_gdn ? gp.n_layers : 0, La = use_kv ? kp.n_layers : 0;
    const int HK = use_gdn ? gp.n_k_heads : 0, HV = use_gdn ? gp.n_v_heads : 0,
              DK = use_gdn ? gp.dk : 0, DV = use_gdn ? gp.dv : 0, C = use_gdn ? gp.conv_dim : 0,
              K1 = use_gdn ? gp.conv_kernel - 1 : 0;
    const int HKV = use_kv ? kp.n_kv_heads : 0, D = use_kv ? kp.head_dim : 0,
              HQ = use_kv ? md.attn.heads : 0;
    const long long maxlen = rp.seq_len + T;

    /* Sequences. */
    const size_t ib = sizeof(int32_t) * (size_t)B;
    int32_t *gids = alloc(ib, 1), *kids = alloc(ib, 1), *acc = alloc(ib, 1), *counts = alloc(ib, 1);
    long long *len = alloc(sizeof(long long) * (size_t)B, 1);
    for (int b = 0; b < B; b++) {
        if (use_gdn) {
            int32_t a, r;
            CHECK(kvr_gdn_pool_seq_add(replay, NULL, &a));
            CHECK(kvr_gdn_pool_seq_add(recur, NULL, &r));
            if (a != r) {
                fprintf(stderr, "demo: the two GDN pools gave different ids\n");
                return 1;
            }
            gids[b] = a;
        }
        if (use_kv) CHECK(kvr_kv_pool_seq_add(kv, NULL, &kids[b]));
    }
    const int64_t ids_shape[1] = {B};
    kvr_tensor t_gids = tensor(gids, KVR_DTYPE_I32, 1, ids_shape, 1),
               t_kids = tensor(kids, KVR_DTYPE_I32, 1, ids_shape, 1);

    /* Buffers: GDN inputs/outputs for every GDN layer [Lg][B][T][...], KV inputs/outputs for
     * every attention layer, host copies of everything, and the kept K/V for the reference. */
    const size_t nq = (size_t)B * T * HK * DK, nv = (size_t)B * T * HV * DV, ng = (size_t)B * T * HV,
                 nc = (size_t)B * T * C, nw = (size_t)B * K1 * C, ns = (size_t)HV * DK * DV;
    const size_t nkv = (size_t)B * T * HKV * D, nqa = (size_t)B * T * HQ * D;
    const size_t nkp = (size_t)B * (size_t)max_prefill * HKV * D;
    float *h_q = alloc(4 * nq * Lg, 1), *h_k = alloc(4 * nq * Lg, 1), *h_v = alloc(4 * nv * Lg, 1),
          *h_g = alloc(4 * ng * Lg, 1), *h_beta = alloc(4 * ng * Lg, 1), *h_c = alloc(4 * nc * Lg, 1),
          *h_o1 = alloc(4 * nv * Lg, 1), *h_o2 = alloc(4 * nv * Lg, 1), *h_w1 = alloc(4 * nw * Lg, 1),
          *h_w2 = alloc(4 * nw * Lg, 1), *h_s1 = alloc(4 * ns, 1), *h_s2 = alloc(4 * ns, 1);
    void *d_q = alloc(4 * nq * Lg, 0), *d_k = alloc(4 * nq * Lg, 0), *d_v = alloc(4 * nv * Lg, 0),
         *d_g = alloc(4 * ng * Lg, 0), *d_beta = alloc(4 * ng * Lg, 0), *d_c = alloc(4 * nc * Lg, 0),
         *d_o1 = alloc(4 * nv * Lg, 0), *d_o2 = alloc(4 * nv * Lg, 0), *d_w1 = alloc(4 * nw * Lg, 0),
         *d_w2 = alloc(4 * nw * Lg, 0), *d_s1 = alloc(4 * ns, 0), *d_s2 = alloc(4 * ns, 0),
         *d_acc = alloc(4 * (size_t)B, 0);
    const size_t nk_in = nkp > nkv ? nkp : nkv;
    float *h_kn = alloc(4 * nk_in * La, 1), *h_vn = alloc(4 * nk_in * La, 1),
          *h_qa = alloc(4 * nqa * La, 1), *h_oa = alloc(4 * nqa * La, 1),
          *kref = alloc(4 * (size_t)La * B * (size_t)maxlen * HKV * D, 1),
          *vref = alloc(4 * (size_t)La * B * (size_t)maxlen * HKV * D, 1);
    double *sc = alloc(sizeof(double) * (size_t)maxlen, 1),
           *o_ref = alloc(sizeof(double) * (size_t)(D ? D : 1), 1);
    void *d_kn = alloc(4 * nk_in * La, 0), *d_vn = alloc(4 * nk_in * La, 0),
         *d_qa = alloc(4 * nqa * La, 0), *d_oa = alloc(4 * nqa * La, 0);
#define KREF(a, b, t) (kref + ((((size_t)(a) * B + (b)) * (size_t)maxlen + (size_t)(t)) * HKV * D))
#define VREF(a, b, t) (vref + ((((size_t)(a) * B + (b)) * (size_t)maxlen + (size_t)(t)) * HKV * D))

    /* Prefill. GDN: the engine's prefill result (a state and a conv window per layer and
     * sequence) imported into both pools. KV: the prompt's K/V appended, layer by layer. */
    for (int j = 0; j < Lg; j++)
        for (int b = 0; b < B; b++) {
            for (size_t i = 0; i < ns; i++) h_s1[i] = uniform(-0.3f, 0.3f);
            for (size_t i = 0; i < (size_t)K1 * C; i++) h_w1[i] = uniform(-1, 1);
            buf_put(d_s1, h_s1, 4 * ns);
            buf_put(d_w1, h_w1, 4 * (size_t)K1 * C);
            const int64_t ss[3] = {HV, DK, DV}, sw[2] = {K1, C};
            kvr_tensor ts = tensor(d_s1, KVR_DTYPE_F32, 3, ss, 0),
                       tw = tensor(d_w1, KVR_DTYPE_F32, 2, sw, 0);
            CHECK(kvr_gdn_pool_import_state(replay, j, gids[b], &ts, C ? &tw : NULL, NULL));
            CHECK(kvr_gdn_pool_import_state(recur, j, gids[b], &ts, C ? &tw : NULL, NULL));
        }
    long long prefill_tokens = 0;
    for (int b = 0; b < B; b++) {
        len[b] = o.prefill + 3 * (b % 4); /* a few different lengths */
        counts[b] = (int32_t)len[b];
        prefill_tokens += len[b];
    }
    if (use_kv) {
        CHECK(kvr_kv_pool_extend(kv, kids, counts, B, NULL));
        for (int a = 0; a < La; a++) {
            float *kn = h_kn + nk_in * a, *vn = h_vn + nk_in * a;
            size_t row = 0;
            for (int b = 0; b < B; b++)
                for (long long t = 0; t < len[b]; t++, row++)
                    for (int i = 0; i < HKV * D; i++) {
                        kn[row * HKV * D + i] = KREF(a, b, t)[i] = grid();
                        vn[row * HKV * D + i] = VREF(a, b, t)[i] = grid();
                    }
        }
        for (int a = 0; a < La; a++) {
            const int64_t sk[3] = {prefill_tokens, HKV, D};
            buf_put(d_kn, h_kn + nk_in * a, 4 * (size_t)prefill_tokens * HKV * D);
            buf_put(d_vn, h_vn + nk_in * a, 4 * (size_t)prefill_tokens * HKV * D);
            kvr_tensor tk = tensor(d_kn, KVR_DTYPE_F32, 3, sk, 0),
                       tv = tensor(d_vn, KVR_DTYPE_F32, 3, sk, 0);
            CHECK(kvr_kv_pool_write(kv, a, kids, counts, B, &tk, &tv, NULL));
        }
    }
    printf("run      %d sequences, %lld-%lld prompt tokens, %lld decode steps and %lld speculative "
           "rounds of %d drafts, over %d GDN + %d attention layers\n",
           B, o.prefill, max_prefill, o.steps, o.rounds, T, Lg, La);

    kvr_gdn_step_params gsp;
    CHECK(kvr_gdn_step_params_default(&gsp));
    gsp.l2norm_qk = 1; /* Qwen3-Next normalizes q and k */
    kvr_kv_decode_params *dps = alloc(sizeof(kvr_kv_decode_params) * (size_t)(La ? La : 1), 1);
    for (int a = 0; a < La; a++) {
        CHECK(kvr_kv_decode_params_default(&dps[a]));
        kvr_layer_plan p;
        CHECK(kvr_model_get_layer(md.m, md.attn_layer[a], &p));
        dps[a].window = p.sliding_window;
    }

    timings tm;
    memset(&tm, 0, sizeof tm);
    double gdn_err = 0, kv_err = 0, kv_abs = 0, state_err = 0;
    int windows_equal = 1, seen_decode = 0, seen_round = 0;
    long long accepted = 0, drafted = 0;
    const long long total = o.steps + o.rounds;
    const int tty = isatty(2);
    double start = now(), last = 0;
    int progress = 0;
    for (long long it = 0; it < total; it++) {
        /* Speculative rounds spread evenly among the decode steps. */
        const int spec = (it + 1) * o.rounds / total > it * o.rounds / total;
        const int t_n = spec ? T : 1;
        const size_t q1 = (size_t)B * t_n * HK * DK, v1 = (size_t)B * t_n * HV * DV,
                     g1 = (size_t)B * t_n * HV, c1 = (size_t)B * t_n * C;
        const size_t k1 = (size_t)B * t_n * HKV * D, qa1 = (size_t)B * t_n * HQ * D;
        for (int b = 0; b < B; b++) {
            acc[b] = spec ? (int32_t)(uniform(0, 1) * (t_n + 1)) % (t_n + 1) : 1;
            counts[b] = t_n;
        }
        if (spec) {
            for (int b = 0; b < B; b++) accepted += acc[b];
            drafted += (long long)B * t_n;
        }

        /* GDN: inputs for every layer, uploaded before the clock starts. */
        if (use_gdn) {
            for (size_t i = 0; i < q1 * Lg; i++) h_q[i] = uniform(-1, 1), h_k[i] = uniform(-1, 1);
            for (size_t i = 0; i < v1 * Lg; i++) h_v[i] = uniform(-1, 1);
            for (int j = 0; j < Lg; j++)
                for (size_t i = 0; i < g1; i++) {
                    float x = uniform(-1, 1);
                    int h = (int)(i % (size_t)HV);
                    if (md.gate_a) {
                        float a = -fabsf(md.gate_a[(size_t)j * HV + h]);
                        float y = x + md.gate_dt[(size_t)j * HV + h];
                        h_g[g1 * j + i] = a * (y > 20 ? y : log1pf(expf(y)));
                    } else {
                        h_g[g1 * j + i] = -0.01f - 0.2f * (x + 1);
                    }
                    h_beta[g1 * j + i] = uniform(0.1f, 0.9f);
                }
            for (size_t i = 0; i < c1 * Lg; i++) h_c[i] = uniform(-1, 1);
            buf_put(d_q, h_q, 4 * q1 * Lg);
            buf_put(d_k, h_k, 4 * q1 * Lg);
            buf_put(d_v, h_v, 4 * v1 * Lg);
            buf_put(d_g, h_g, 4 * g1 * Lg);
            buf_put(d_beta, h_beta, 4 * g1 * Lg);
            if (C) buf_put(d_c, h_c, 4 * c1 * Lg);
            if (spec) buf_put(d_acc, acc, 4 * (size_t)B);
            const int64_t sq[4] = {B, t_n, HK, DK}, sv[4] = {B, t_n, HV, DV}, sg[3] = {B, t_n, HV},
                          scv[3] = {B, t_n, C}, sw[3] = {B, K1, C};
            /* Decode tensors drop the T dimension: [B, ...]. */
            const int nd = spec ? 1 : 0;
            const int64_t *pq = spec ? sq : (const int64_t[3]){B, HK, DK},
                          *pv = spec ? sv : (const int64_t[3]){B, HV, DV},
                          *pg = spec ? sg : (const int64_t[2]){B, HV},
                          *pc = spec ? scv : (const int64_t[2]){B, C};
            kvr_tensor t_acc = tensor(spec ? d_acc : acc, KVR_DTYPE_I32, 1, ids_shape, !spec);
            for (int pass = 0; pass < 2; pass++) {
                kvr_gdn_pool *pool = pass ? recur : replay;
                void *d_o = pass ? d_o2 : d_o1, *d_w = pass ? d_w2 : d_w1;
                double t0 = now();
                for (int j = 0; j < Lg; j++) {
                    kvr_tensor tq = tensor(at(d_q, 4 * q1 * j), KVR_DTYPE_F32, 3 + nd, pq, 0),
                               tk = tensor(at(d_k, 4 * q1 * j), KVR_DTYPE_F32, 3 + nd, pq, 0),
                               tv = tensor(at(d_v, 4 * v1 * j), KVR_DTYPE_F32, 3 + nd, pv, 0),
                               tg = tensor(at(d_g, 4 * g1 * j), KVR_DTYPE_F32, 2 + nd, pg, 0),
                               tb = tensor(at(d_beta, 4 * g1 * j), KVR_DTYPE_F32, 2 + nd, pg, 0),
                               tc = tensor(at(d_c, 4 * c1 * j), KVR_DTYPE_F32, 2 + nd, pc, 0),
                               to = tensor(at(d_o, 4 * v1 * j), KVR_DTYPE_F32, 3 + nd, pv, 0);
                    if (spec)
                        CHECK(kvr_gdn_pool_verify(pool, j, &t_gids, &tq, &tk, &tv, &tg, &tb, C ? &tc : NULL,
                                             &to, &gsp, NULL));
                    else
                        CHECK(kvr_gdn_pool_decode(pool, j, &t_gids, &tq, &tk, &tv, &tg, &tb, C ? &tc : NULL,
                                             &to, &gsp, NULL));
                }
                /* The sampler has decided: commit the accepted prefix of each sequence (counts
                 * in device memory on CUDA) and take back each layer's conv window. */
                if (spec)
                    for (int j = 0; j < Lg; j++) {
                        kvr_tensor tw = tensor(at(d_w, 4 * nw * j), KVR_DTYPE_F32, 3, sw, 0);
                        CHECK(kvr_gdn_pool_commit(pool, j, &t_gids, &t_acc, C ? &tw : NULL, NULL));
                    }
                CHECK(kvr_context_synchronize(ctx, NULL));
                double dt = now() - t0;
                int timed = spec ? (seen_round > 0 || o.rounds == 1) : (seen_decode > 0 || o.steps == 1);
                if (timed) {
                    if (spec)
                        *(pass ? &tm.recur_round : &tm.replay_round) += dt;
                    else
                        *(pass ? &tm.recur_decode : &tm.replay_decode) += dt;
                }
            }
            buf_get(h_o1, d_o1, 4 * v1 * Lg);
            buf_get(h_o2, d_o2, 4 * v1 * Lg);
            for (int j = 0; j < Lg; j++) {
                double e = rel_err(h_o1 + v1 * j, h_o2 + v1 * j, v1);
                if (e > gdn_err || e != e) gdn_err = e;
            }
            if (spec && C) {
                buf_get(h_w1, d_w1, 4 * nw * Lg);
                buf_get(h_w2, d_w2, 4 * nw * Lg);
                if (memcmp(h_w1, h_w2, 4 * nw * Lg) != 0) windows_equal = 0;
            }
        }

        /* Attention: each sequence grows by the new token(s); per layer the K/V is written and
         * the batch decoded in one call; rejected drafts are truncated away. */
        if (use_kv) {
            for (int a = 0; a < La; a++) {
                float *kn = h_kn + nk_in * a, *vn = h_vn + nk_in * a;
                for (int b = 0; b < B; b++)
                    for (int t = 0; t < t_n; t++)
                        for (int i = 0; i < HKV * D; i++) {
                            size_t r = ((size_t)b * t_n + t) * HKV * D + i;
                            kn[r] = KREF(a, b, len[b] + t)[i] = grid();
                            vn[r] = VREF(a, b, len[b] + t)[i] = grid();
                        }
                for (size_t i = 0; i < qa1; i++) h_qa[nqa * a + i] = uniform(-1, 1);
            }
            for (int a = 0; a < La; a++) {
                buf_put(at(d_kn, 4 * k1 * a), h_kn + nk_in * a, 4 * k1);
                buf_put(at(d_vn, 4 * k1 * a), h_vn + nk_in * a, 4 * k1);
                buf_put(at(d_qa, 4 * qa1 * a), h_qa + nqa * a, 4 * qa1);
            }
            const int64_t sk[3] = {(int64_t)B * t_n, HKV, D}, sq4[4] = {B, t_n, HQ, D},
                          sq3[3] = {B, HQ, D};
            const int64_t *sqa = spec ? sq4 : sq3; /* a decode step has no T dimension */
            const int nda = spec ? 4 : 3;
            double t0 = now();
            CHECK(kvr_kv_pool_extend(kv, kids, counts, B, NULL));
            for (int a = 0; a < La; a++) {
                kvr_tensor tk = tensor(at(d_kn, 4 * k1 * a), KVR_DTYPE_F32, 3, sk, 0),
                           tv = tensor(at(d_vn, 4 * k1 * a), KVR_DTYPE_F32, 3, sk, 0),
                           tq = tensor(at(d_qa, 4 * qa1 * a), KVR_DTYPE_F32, nda, sqa, 0),
                           to = tensor(at(d_oa, 4 * qa1 * a), KVR_DTYPE_F32, nda, sqa, 0);
                CHECK(kvr_kv_pool_write(kv, a, kids, counts, B, &tk, &tv, NULL));
                CHECK(kvr_kv_pool_decode(kv, a, &t_kids, &tq, &to, NULL, &dps[a], NULL));
            }
            if (spec)
                for (int b = 0; b < B; b++)
                    CHECK(kvr_kv_pool_seq_truncate(kv, kids[b], len[b] + acc[b], NULL));
            CHECK(kvr_context_synchronize(ctx, NULL));
            double dt = now() - t0;
            if (spec ? (seen_round > 0 || o.rounds == 1) : (seen_decode > 0 || o.steps == 1))
                *(spec ? &tm.kv_round : &tm.kv_decode) += dt;
            buf_get(h_oa, d_oa, 4 * qa1 * La);
            /* The reference: query t of T sees its sequence up to its own position. */
            const int group = HQ / HKV;
            for (int a = 0; a < La; a++)
                for (int b = 0; b < B; b++)
                    for (int t = 0; t < t_n; t++)
                        for (int h = 0; h < HQ; h++) {
                            const float *q = h_qa + nqa * a + (((size_t)b * t_n + t) * HQ + h) * D;
                            const float *got = h_oa + qa1 * a + (((size_t)b * t_n + t) * HQ + h) * D;
                            long long n = len[b] + t + 1, first = 0;
                            if (dps[a].window > 0 && n > dps[a].window) first = n - dps[a].window;
                            double mx = -1e300, sum = 0, ref_max = 1e-6, e = 0;
                            for (long long p = first; p < n; p++) {
                                const float *kk = KREF(a, b, p) + (h / group) * D;
                                double dot = 0;
                                for (int d = 0; d < D; d++) dot += (double)q[d] * kk[d];
                                sc[p] = dot / sqrt((double)D);
                                if (sc[p] > mx) mx = sc[p];
                            }
                            for (int d = 0; d < D; d++) o_ref[d] = 0;
                            for (long long p = first; p < n; p++) {
                                double w = exp(sc[p] - mx);
                                const float *vv = VREF(a, b, p) + (h / group) * D;
                                sum += w;
                                for (int d = 0; d < D; d++) o_ref[d] += w * vv[d];
                            }
                            for (int d = 0; d < D; d++) {
                                double r = o_ref[d] / sum, diff = fabs(got[d] - r);
                                if (fabs(r) > ref_max) ref_max = fabs(r);
                                if (diff > e || diff != diff) e = diff;
                            }
                            if (e > kv_abs || e != e) kv_abs = e;
                            if (e / ref_max > kv_err || e != e) kv_err = e / ref_max;
                        }
        }
        for (int b = 0; b < B; b++) len[b] += spec ? acc[b] : 1;
        if (spec)
            seen_round++;
        else
            seen_decode++;

        double t = now();
        if (tty && t - start > 1.0 && t - last > 0.2) {
            fprintf(stderr, "\r  %lld of %lld steps and rounds done, %.1f s ", it + 1, total,
                    t - start);
            last = t;
            progress = 1;
        }
    }
    if (progress) fprintf(stderr, "\r%60s\r", "");
    tm.n_decode = seen_decode > 1 ? seen_decode - 1 : seen_decode;
    tm.n_round = seen_round > 1 ? seen_round - 1 : seen_round;

    /* Final states: replay (materialized from its checkpoint and ring) against recurrent. */
    for (int j = 0; j < Lg; j++)
        for (int b = 0; b < B; b++) {
            const int64_t ss[3] = {HV, DK, DV};
            kvr_tensor t1 = tensor(d_s1, KVR_DTYPE_F32, 3, ss, 0),
                       t2 = tensor(d_s2, KVR_DTYPE_F32, 3, ss, 0);
            CHECK(kvr_gdn_pool_export_state(replay, j, gids[b], &t1, NULL, NULL));
            CHECK(kvr_gdn_pool_export_state(recur, j, gids[b], &t2, NULL, NULL));
            buf_get(h_s1, d_s1, 4 * ns);
            buf_get(h_s2, d_s2, 4 * ns);
            double e = rel_err(h_s1, h_s2, ns);
            if (e > state_err || e != e) state_err = e;
        }

    /* Checks. */
    const double gdn_tol = 1e-3, kv_tol = 2e-2;
    int gdn_ok = gdn_err <= gdn_tol && state_err <= gdn_tol && windows_equal;
    int kv_ok = kv_abs <= kv_tol;
    if (drafted)
        printf("         accepted %lld of %lld drafts; rejected ones rolled back (GDN commit, KV "
               "truncate)\n",
               accepted, drafted);
    printf("\ncheck\n");
    if (use_gdn)
        printf("  GDN replay vs recurrent reference   max rel error %.1e outputs, %.1e final "
               "states; conv windows %s   %s\n",
               gdn_err, state_err, windows_equal ? "identical" : "DIFFER", gdn_ok ? "PASS" : "FAIL");
    if (use_kv)
        printf("  paged KV decode vs naive attention  max abs error %.1e (rel %.1e)   %s\n", kv_abs,
               kv_err, kv_ok ? "PASS" : "FAIL");

    if (tm.n_decode || tm.n_round)
        printf("\ntime on %s, %d sequences (wall clock, context synchronized; the first step "
               "and round are warm-up)\n",
               on_cuda ? "CUDA" : "CPU", B);
    if (use_gdn && (tm.n_decode || tm.n_round)) {
        char label[64];
        snprintf(label, sizeof label, "%d GDN %s", Lg, layers(Lg));
        printf("  %-32s %12s %12s   replay speedup\n", label, "replay", "recurrent");
    }
    if (use_gdn && tm.n_decode)
        printf("    %-30s %9.3f ms %9.3f ms   %.2fx\n", "per decode step",
               1e3 * tm.replay_decode / tm.n_decode, 1e3 * tm.recur_decode / tm.n_decode,
               tm.recur_decode / (tm.replay_decode > 0 ? tm.replay_decode : 1e-12));
    if (use_gdn && tm.n_round) {
        char label[64];
        snprintf(label, sizeof label, "per round (verify %d + commit)", T);
        printf("    %-30s %9.3f ms %9.3f ms   %.2fx\n", label,
               1e3 * tm.replay_round / tm.n_round, 1e3 * tm.recur_round / tm.n_round,
               tm.recur_round / (tm.replay_round > 0 ? tm.replay_round : 1e-12));
    }
    if (use_kv && (tm.n_decode || tm.n_round))
        printf("  %d attention %s (append + paged decode): %.3f ms per step, %.3f ms per "
               "round (with truncate)\n",
               La, layers(La), tm.n_decode ? 1e3 * tm.kv_decode / tm.n_decode : 0.0,
               tm.n_round ? 1e3 * tm.kv_round / tm.n_round : 0.0);
    if (!on_cuda && (tm.n_decode || tm.n_round))
        printf("  (CPU timings are for reference: replay saves state traffic, which the GPU "
               "numbers in BENCHMARKS.md measure)\n");

    printf("\nmemory of this run's pools, per sequence\n");
    if (use_gdn)
        printf("  GDN replay %s (state %s + ring %s + conv %s); recurrent with %d snapshots %s\n",
               human((double)mem_replay.total_bytes), human((double)mem_replay.state_bytes),
               human((double)mem_replay.ring_bytes), human((double)mem_replay.conv_bytes), T,
               human((double)mem_recur.total_bytes));
    if (use_kv) {
        kvr_kv_pool_stats st;
        st.struct_size = sizeof st;
        CHECK(kvr_kv_pool_get_stats(kv, &st));
        long long ctx_tokens = md.info.context_length > 0 ? md.info.context_length : maxlen;
        printf("  KV paged %s (%lld pages for %lld tokens); contiguous for the %lld-token context %s\n",
               human((double)st.pages_used * (double)st.page_bytes / B), (long long)st.pages_used,
               (long long)st.tokens, ctx_tokens,
               human((double)ctx_tokens * (double)rz.kv_bytes_per_token));
    }

    int ok = (!use_gdn || gdn_ok) && (!use_kv || kv_ok);
    printf("\n%s\n", ok ? "PASS" : "FAIL");
    kvr_kv_pool_free(kv);
    kvr_gdn_pool_free(replay);
    kvr_gdn_pool_free(recur);
    kvr_context_free(ctx);
    kvr_model_free(md.m);
    free_all();
    return ok ? 0 : 1;
}
