/* Prints a GGUF model's layer plan and how to size kvreplay's pools for a memory budget.
 *
 *   gguf_plan MODEL.gguf [budget_GiB=8] [seq_len=4096] [spec_window=4]
 *
 * The file is memory-mapped and validated; nothing but the header is read. The pool
 * parameters printed are what kvr_kv_pool_new / kvr_gdn_pool_new / kvr_mamba2_pool_new would
 * be given. */
#include <stdio.h>
#include <stdlib.h>

#include "kvreplay.h"

static const char *kind_name(kvr_layer_kind k) {
    switch (k) {
        case KVR_LAYER_ATTENTION: return "attention";
        case KVR_LAYER_GDN: return "gated-deltanet";
        case KVR_LAYER_MAMBA2: return "mamba2";
        default: return "mlp";
    }
}

static double mib(int64_t b) { return (double)b / (1 << 20); }

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [budget_GiB=8] [seq_len=4096] [spec_window=4]\n", argv[0]);
        return 2;
    }
    double budget_gib = argc > 2 ? atof(argv[2]) : 8.0;
    long seq_len = argc > 3 ? atol(argv[3]) : 4096;
    int spec = argc > 4 ? atoi(argv[4]) : 4;
    kvr_model *m = NULL;
    kvr_status s = kvr_model_open(argv[1], &m);
    if (s != KVR_STATUS_OK) {
        fprintf(stderr, "cannot open %s: %s: %s\n", argv[1], kvr_status_string(s), kvr_error_last_message());
        return 1;
    }
    kvr_model_info info;
    info.struct_size = sizeof info;
    if (kvr_model_get_info(m, &info) != KVR_STATUS_OK) return 1;
    printf("%s: %s, %d layers (%d attention, %d gated-deltanet, %d mamba2, %d mlp-only), "
           "context %lld, embedding %lld, %lld tensors, %.1f MiB\n",
           argv[1], kvr_model_get_arch(m), info.n_layers, info.n_attention_layers, info.n_gdn_layers,
           info.n_mamba2_layers, info.n_mlp_layers, (long long)info.context_length,
           (long long)info.embedding_length, (long long)info.n_tensors, mib(info.file_bytes));
    for (int l = 0; l < info.n_layers; l++) {
        kvr_layer_plan p;
        if (kvr_model_get_layer(m, l, &p) != KVR_STATUS_OK) return 1;
        printf("  layer %2d %-14s", l, kind_name(p.kind));
        if (p.kind == KVR_LAYER_ATTENTION)
            printf(" heads %d, kv heads %d, head dim %d/%d%s\n", p.heads, p.kv_heads, p.head_dim_k,
                   p.head_dim_v, p.sliding_window ? " (sliding window)" : "");
        else if (p.kind == KVR_LAYER_GDN)
            printf(" key heads %d, value heads %d, dk %d, dv %d, conv %d x %d\n", p.k_heads, p.v_heads,
                   p.dk, p.dv, p.conv_kernel, p.conv_dim);
        else if (p.kind == KVR_LAYER_MAMBA2)
            printf(" heads %d x %d, groups %d, state %d, conv %d x %d\n", p.ssm_heads, p.ssm_head_dim,
                   p.ssm_groups, p.ssm_state, p.conv_kernel, p.conv_dim);
        else
            printf("\n");
    }
    kvr_model_sizing_params sp;
    if (kvr_model_sizing_params_default(&sp) != KVR_STATUS_OK) return 1;
    sp.budget_bytes = (int64_t)(budget_gib * (1 << 30));
    sp.seq_len = seq_len;
    sp.spec_window = spec;
    kvr_model_sizing z;
    z.struct_size = sizeof z;
    s = kvr_model_compute_sizing(m, &sp, &z);
    if (s != KVR_STATUS_OK) {
        fprintf(stderr, "sizing: %s: %s\n", kvr_status_string(s), kvr_error_last_message());
        return 1;
    }
    printf("\nsizing for %.1f GiB, %lld tokens per sequence, %d drafts per round:\n", budget_gib,
           (long long)z.seq_len, spec);
    printf("  KV %lld bytes/token; paged %.2f MiB/seq (%lld pages), contiguous %.2f MiB/seq\n",
           (long long)z.kv_bytes_per_token, mib(z.paged_kv_bytes_per_seq), (long long)z.pages_per_seq,
           mib(z.contiguous_kv_bytes_per_seq));
    printf("  recurrent states %.2f MiB/seq; ring %.2f MiB/seq; per-draft snapshots %.2f MiB/seq "
           "(of the states and ring, Mamba-2 %.2f MiB/seq)\n",
           mib(z.state_bytes_per_seq), mib(z.ring_bytes_per_seq), mib(z.snapshot_bytes_per_seq),
           mib(z.mamba2_bytes_per_seq));
    const char *names[KVR_MODEL_LAYOUT_COUNT];
    names[KVR_MODEL_LAYOUT_PAGED_RING] = "paged KV + ring";
    names[KVR_MODEL_LAYOUT_PAGED_SNAPSHOTS] = "paged KV + snapshots";
    names[KVR_MODEL_LAYOUT_CONTIGUOUS_RING] = "contiguous KV + ring";
    names[KVR_MODEL_LAYOUT_CONTIGUOUS_SNAPSHOTS] = "contiguous KV + snapshots";
    for (kvr_model_layout i = 0; i < KVR_MODEL_LAYOUT_COUNT; i++)
        printf("  %-26s %9.2f MiB/seq -> %lld sequences\n", names[i], mib(z.bytes_per_seq[i]),
               (long long)z.max_seqs[i]);
    kvr_kv_pool_params kp;
    if (kvr_model_get_kv_pool_params(m, &sp, &kp) == KVR_STATUS_OK)
        printf("\nkvr_kv_pool_params: n_layers %d, n_kv_heads %d, head_dim %d, page_size %d, "
               "capacity_pages %lld, max_seqs %d, max_seq_len %lld\n",
               kp.n_layers, kp.n_kv_heads, kp.head_dim, kp.page_size, (long long)kp.capacity_pages,
               kp.max_seqs, (long long)kp.max_seq_len);
    else
        printf("\nno KV pool: %s\n", kvr_error_last_message());
    kvr_gdn_pool_params gp;
    if (kvr_model_get_gdn_pool_params(m, &sp, &gp) == KVR_STATUS_OK)
        printf("kvr_gdn_pool_params: n_layers %d, heads %d/%d, dk %d, dv %d, ring_len %d, "
               "max_drafts %d, conv %d x %d, max_seqs %d\n",
               gp.n_layers, gp.n_k_heads, gp.n_v_heads, gp.dk, gp.dv, gp.ring_len, gp.max_drafts,
               gp.conv_kernel, gp.conv_dim, gp.max_seqs);
    else
        printf("no GDN pool: %s\n", kvr_error_last_message());
    kvr_mamba2_pool_params mp;
    if (kvr_model_get_mamba2_pool_params(m, &sp, &mp) == KVR_STATUS_OK)
        printf("kvr_mamba2_pool_params: n_layers %d, heads %d x %d, groups %d, d_state %d, "
               "ring_len %d, max_drafts %d, conv %d x %d, max_seqs %d\n",
               mp.n_layers, mp.n_heads, mp.head_dim, mp.n_groups, mp.d_state, mp.ring_len,
               mp.max_drafts, mp.conv_kernel, mp.conv_dim, mp.max_seqs);
    else
        printf("no Mamba-2 pool: %s\n", kvr_error_last_message());
    kvr_model_free(m);
    return 0;
}
