/*
 * kvr_abi.h: the one definition of what the host (Rust) hands the kernels.
 *
 * Every kernel launch-parameter struct, the per-sequence GDN metadata record, the mode, op
 * and dtype codes, the limits both sides size arrays and launches by, and the shared-memory
 * layouts whose size the host must know. Plain C11 (a host C compiler compiles it for the
 * layout check) and CUDA C++ (every kernel source includes it through common.cuh).
 *
 * The Rust side is src/abi.rs: a #[repr(C)] mirror of every struct, every constant, and a
 * port of every *_smem formula. A CPU-only unit test (abi::tests, part of `cargo test`)
 * parses this file, compiles a C program that prints sizeof / offsetof of every field, every
 * constant and the formulas over a grid of configurations, and compares with src/abi.rs.
 *
 * Restricted syntax (the test's parser reads it):
 *   - shared structs: `typedef struct { <type> <name>[, <name>...]; ... } kvr_<name>;` with
 *     fields of int32_t, uint32_t, int64_t, float, KVR_PTR(<T>) (a device pointer: T* in
 *     CUDA, uint64_t in host C) or an earlier kvr_ struct; arrays as <name>[<constant>]. No
 *     implicit padding: explicit pad fields (the test checks that the fields fill the struct);
 *   - constants: `#define KVR_<NAME> <integer expression>` (any other KVR_ macro must be
 *     known to the parser);
 *   - shared-memory layouts: `struct kvr_<name>_smem { ... };` (no typedef: device-internal,
 *     not mirrored; the test compares the host's size formula with the `total` of the
 *     KVR_ABI_FN that fills it).
 */
#ifndef KVR_ABI_H
#define KVR_ABI_H

#include <stdint.h>

#if defined(__CUDACC__)
#define KVR_ABI_FN static constexpr __host__ __device__ inline
#define KVR_PTR(T) T*
#elif defined(__cplusplus)
#define KVR_ABI_FN static constexpr inline
#define KVR_PTR(T) uint64_t
#else
#define KVR_ABI_FN static inline
#define KVR_PTR(T) uint64_t
#endif

/* ---- Element types of kernel tensors, rings, states and windows ---- */

#define KVR_DT_F32 0
#define KVR_DT_F16 1
#define KVR_DT_BF16 2

/* ---- kernels/copy.cu: kvr_copy_<src>_<dst> ---- */

/* Most dimensions of a copy (MAX_DIMS of src/tensor.rs). */
#define KVR_COPY_MAX_DIMS 8
#define KVR_COPY_THREADS 256

typedef struct {
  KVR_PTR(const void) src;
  KVR_PTR(void) dst;
  int64_t n;          /* elements */
  int32_t ndim;       /* dimensions after coalescing (0..KVR_COPY_MAX_DIMS) */
  int32_t vectorized; /* 1: both contiguous and 16-byte aligned (8 elements a thread) */
  int64_t shape[KVR_COPY_MAX_DIMS];
  int64_t src_stride[KVR_COPY_MAX_DIMS]; /* elements */
  int64_t dst_stride[KVR_COPY_MAX_DIMS]; /* elements */
} kvr_copy_args;

/* ---- Shared by the KV kernels ---- */

/* n / d for 0 <= n < 2^31 and a runtime d >= 1 as (mulhi(n, mul) + n) >> shift, with
 * shift = ceil(log2 d), mul = floor(2^32 * (2^shift - d) / d) + 1 (FastDiv::new in
 * src/kv/cuda.rs; kvr::fast_div in mma.cuh). */
typedef struct {
  uint32_t d, mul, shift;
} kvr_fast_div;

/* One layer's K and V storage: element (page, head, slot, d) at
 * base + page * sp + head * sh + slot * st + d (elements). */
typedef struct {
  KVR_PTR(void) k;
  KVR_PTR(void) v;
  int64_t k_sp, k_sh, k_st;
  int64_t v_sp, v_sh, v_st;
} kvr_kv_layer_desc;

/* ---- kernels/kv_pool.cu ---- */

#define KVR_KV_MAX_PATCHES 480
#define KVR_KV_MAX_WRITE_GROUPS 120
#define KVR_KV_MAX_PAGE_COPIES 240
#define KVR_KV_WRITE_THREADS 256

/* kvr_kv_patch: dst[index[i]] = value[i] for i < count (int32 table / lengths). */
typedef struct {
  KVR_PTR(int32_t) dst;
  int32_t count;
  int32_t pad;
  uint32_t index[KVR_KV_MAX_PATCHES];
  int32_t value[KVR_KV_MAX_PATCHES];
} kvr_kv_patch_args;

/* Tokens [src_offset, src_offset + count) of the source go to positions
 * [start, start + count) of sequence `slot`. */
typedef struct {
  int32_t slot, start, count, src_offset;
} kvr_kv_write_group;

/* kvr_kv_write_<src>_<dst>: scatter new tokens' K and V rows into their pages. */
typedef struct {
  KVR_PTR(const kvr_kv_layer_desc) layers;
  KVR_PTR(const int32_t) table;
  KVR_PTR(const void) k_src;
  KVR_PTR(const void) v_src;
  int64_t ks[4]; /* source strides: layer, token, head, dim (elements) */
  int64_t vs[4];
  kvr_fast_div page;
  int32_t table_stride;
  int32_t layer0, n_layers, hkv, d, n_groups, n_tokens;
  kvr_kv_write_group groups[KVR_KV_MAX_WRITE_GROUPS]; /* sorted by src_offset */
} kvr_kv_write_args;

/* kvr_kv_copy_pages: whole pages src[i] -> dst[i], all layers, K and V (copy-on-write). */
typedef struct {
  KVR_PTR(const kvr_kv_layer_desc) layers;
  int32_t n_layers, hkv, d, page_size, elem_bytes, n_pairs;
  int32_t src[KVR_KV_MAX_PAGE_COPIES];
  int32_t dst[KVR_KV_MAX_PAGE_COPIES];
} kvr_kv_page_copy_args;

/* ---- kernels/wgkv.cu: kvr_wgkv_scatter (write-gated KV, src/kv/wgkv) ---- */

#define KVR_WGKV_MAX_PAIRS 160
#define KVR_WGKV_SCATTER_THREADS 256

/* Row i: K elements k_src + k_off[i] + d * k_src_ds (d < d; offsets in elements of
 * src_dtype) go to k_dst + page[i] * k_sp + slot[i] * k_st + d (contiguous, dst_dtype;
 * the head's offset is folded into k_dst); V likewise. No destination row is a source row
 * of the same launch. With `rows` set the pairs come from device memory instead, n_pairs
 * entries of {k_off, v_off, page << 32 | slot} (int64), and the inline arrays are unused. */
typedef struct {
  KVR_PTR(const int64_t) rows;
  KVR_PTR(const void) k_src;
  KVR_PTR(const void) v_src;
  KVR_PTR(void) k_dst;
  KVR_PTR(void) v_dst;
  int64_t k_src_ds, v_src_ds;
  int64_t k_sp, k_st, v_sp, v_st;
  int32_t d, n_pairs, src_dtype, dst_dtype;
  int64_t k_off[KVR_WGKV_MAX_PAIRS];
  int64_t v_off[KVR_WGKV_MAX_PAIRS];
  int32_t page[KVR_WGKV_MAX_PAIRS];
  int32_t slot[KVR_WGKV_MAX_PAIRS];
} kvr_wgkv_scatter_args;

/* ---- kernels/wgkv.cu: kvr_wgkv_step (one committed token per sequence, on the device) ----
 * Grid (1 + chunks, kv_heads, tiles): CTA (0, h, z) moves the rows of tokens [16 z, 16 z +
 * 16) of head h (promotion, new token, state; slots records each new token's ring slot);
 * CTA (c > 0, h, z) scores those tokens on gate hidden units [(c - 1) *
 * KVR_WGKV_GATE_CHUNK, ...) and adds its part of the fc2 dot product to zacc; the last CTA
 * of (h, z) (of the gate CTAs) finishes the scores and, once the mover has published each
 * token's slot, sets the new tokens' admission bits. With scores_in
 * set there is no gate (grid x = 1). Row state: KVR_WGKV_ROW_INTS ints per pool
 * row {fill, ptr, global, total, budget, dropped, queued, 0}; admission bits [rows][admit_words]
 * (bit s: ring slot s is promoted when evicted). A row with budget 0 is left as it is and
 * counts the token in `dropped`. */
#define KVR_WGKV_STEP_THREADS 256
#define KVR_WGKV_STEP_TILE 16       /* tokens per CTA */
#define KVR_WGKV_STEP_MAX_SEQS 128  /* sequences per launch (ids inline) */
#define KVR_WGKV_GATE_CHUNK 16      /* gate hidden units per CTA (two per warp) */
#define KVR_WGKV_GATE_MAX_IN 512    /* most gate inputs (2 * head_dim) */
#define KVR_WGKV_ROW_INTS 8
/* slots[t][h] between launches (the host's initial value, restored by the finishing CTA);
 * the mover publishes the new token's ring slot there, with these flags (-1: no slot). With
 * slot_copies G > 0 the slots are [KVR_WGKV_STEP_MAX_SEQS][H][G]: the mover publishes G
 * copies and gate CTA c reads copy c - 1 and restores it itself, so a launch in which no
 * row is due needs no counter and no finishing CTA. */
#define KVR_WGKV_SLOT_PENDING (-2147483647 - 1)
#define KVR_WGKV_SLOT_SINK (1 << 30)
#define KVR_WGKV_SLOT_EVICTED (1 << 29) /* the slot's previous token was promoted */
#define KVR_WGKV_SLOT_DUE (1 << 28)     /* the gate scores the row now: its queue, then the token */
#define KVR_WGKV_SLOT_NOCUR (1 << 27)   /* no new token (flush, or no budget) */
#define KVR_WGKV_SLOT_QSHIFT 20         /* queued tokens of a due row: bits 20..26 */
#define KVR_WGKV_SLOT_QMASK 127
#define KVR_WGKV_SLOT_MASK ((1 << 20) - 1) /* the ring slot */
/* Gate modes (kvr_wgkv_step_args.mode; scores_in set: given scores, any mode but FLUSH).
 * IMMEDIATE: every row's token is scored in its step (and its queue, if any). DEFERRED: a
 * row queues its tokens' gate inputs (queue, queue_codes; row state word 6 = queued) and is
 * scored when the queue is full: a token's bit is needed only when it leaves the ring,
 * window >= queue_len steps later. FLUSH: no new tokens; the rows' queues are scored. */
#define KVR_WGKV_MODE_IMMEDIATE 0
#define KVR_WGKV_MODE_DEFERRED 1
#define KVR_WGKV_MODE_FLUSH 2
#define KVR_WGKV_GATE_QUEUE 16 /* most queued tokens per row (<= KVR_WGKV_SLOT_QMASK) */

typedef struct {
  KVR_PTR(const void) k_pre;      /* [n, H, D] keys before RoPE (gate input), or 0 */
  KVR_PTR(const void) k;          /* [n, H, D] keys after RoPE (cached, gate input) */
  KVR_PTR(const void) v;          /* [n, H, D] */
  KVR_PTR(const float) scores_in; /* [n, H] given scores (no gate), or 0 */
  KVR_PTR(float) scores_out;      /* [n, H] contiguous, optional */
  KVR_PTR(const float) norm_pre;  /* this layer's gate, f32: [D] */
  KVR_PTR(const float) norm_post; /* [D] */
  KVR_PTR(const float) fc1_w;     /* [H][hidden][2 D] */
  KVR_PTR(const float) fc1_b;     /* [H][hidden] */
  KVR_PTR(const float) fc2_w;     /* [H][hidden] */
  KVR_PTR(const float) fc2_b;     /* [H] */
  KVR_PTR(int32_t) rows;          /* [pool rows][KVR_WGKV_ROW_INTS] */
  KVR_PTR(uint32_t) admit;        /* [pool rows][admit_words] */
  KVR_PTR(const int32_t) table;   /* the one-head pool's block table [rows][table_stride] */
  KVR_PTR(int32_t) lens;          /* its lengths [rows] */
  KVR_PTR(void) k_dst;            /* its K and V */
  KVR_PTR(void) v_dst;
  KVR_PTR(float) zacc;            /* [KVR_WGKV_STEP_MAX_SEQS][H], zero between launches */
  KVR_PTR(int32_t) counters;      /* [tiles][H], zero between launches */
  KVR_PTR(int32_t) slots;         /* [KVR_WGKV_STEP_MAX_SEQS][H]: each row's code (ring slot and flags; KVR_WGKV_SLOT_PENDING between launches) */
  KVR_PTR(float) queue;           /* [pool rows][queue_len][2 D] f32: queued gate inputs (k_pre, k), or 0 */
  KVR_PTR(int32_t) queue_codes;   /* [pool rows][queue_len]: their ring slots (| KVR_WGKV_SLOT_SINK) */
  int64_t kp_sb, kp_sh, kp_sd;    /* strides (elements): token, head, dim */
  int64_t k_sb, k_sh, k_sd;
  int64_t v_sb, v_sh, v_sd;
  int64_t s_sb, s_sh;             /* scores_in: token, head */
  int64_t k_sp, k_st, v_sp, v_st; /* pool page and slot strides */
  int32_t n, hkv, d, hidden;
  int32_t window, page_size, table_stride, admit_words;
  int32_t rows_per_seq, row0, sinks, kp_dtype;
  int32_t k_dtype, v_dtype, pool_dtype, queue_len;
  int32_t mode, slot_copies, pad3, pad4; /* slot_copies: see KVR_WGKV_SLOT_PENDING */
  float tau, norm_eps, gate_floor, pad1;
  int32_t seq[KVR_WGKV_STEP_MAX_SEQS];
} kvr_wgkv_step_args;

/* ---- kernels/kv_decode.cu: kvr_kv_decode_<kv>_d<head_dim> ---- */

#define KVR_KV_DECODE_THREADS 192 /* 4 consumer warps + 2 producer warps */
#define KVR_KV_DECODE_TILE 64     /* tokens per K/V tile (16 per consumer warp) */
#define KVR_KV_MAX_INLINE_BATCH 512
#define KVR_KV_SDECODE_STAGES 3   /* kvr_kv_sdecode_*, kvr_kv_cdecode_*: K/V stages per CTA */
#define KVR_KV_SDECODE_THREADS 128 /* per group of 4 warps */
/* Groups of 4 warps per CTA of the split / cluster kernels: two (streaming alternate tiles,
 * one CTA per SM) up to head dim 128, one beyond (the stages of two do not fit). */
#define KVR_KV_SDECODE_GROUPS(head_dim) ((head_dim) <= 128 ? 2 : 1)
/* q_vec: how q rows are loaded. */
#define KVR_KV_Q_SCALAR 0 /* element loads, any dtype and strides */
#define KVR_KV_Q_VEC_KV 1 /* 16-byte loads: q has the KV dtype, 16-byte aligned rows */
#define KVR_KV_Q_VEC_F32 2 /* 16-byte loads: q is f32, 16-byte aligned rows */

typedef struct {
  KVR_PTR(const void) q;
  KVR_PTR(void) out;
  KVR_PTR(float) lse;                /* optional [B, T, Hq] (natural log) */
  KVR_PTR(const void) k;             /* this layer's K and V (kvr_kv_layer_desc layout) */
  KVR_PTR(const void) v;
  KVR_PTR(const int32_t) table;      /* [max_seqs][table_stride] page ids */
  KVR_PTR(const int32_t) lens;       /* [max_seqs] */
  KVR_PTR(const int32_t) batch;      /* [b] sequence slots in device memory, or 0: batch_inline */
  KVR_PTR(float) part_o;             /* [ctas][2][16][D] normalized partial outputs */
  KVR_PTR(float) part_lse;           /* [ctas][2][16] base-2 log-sum-exp of each partial */
  KVR_PTR(int32_t) counters;         /* [b][hkv][Y], zero between launches */
  KVR_PTR(int32_t) group_counters;   /* [Y][ctas][2] (by partial slot), zero between launches */
  int64_t q_sb, q_st, q_sh;          /* q strides: batch row, token, head (elements) */
  int64_t o_sb, o_st, o_sh;          /* out strides */
  int64_t l_sb, l_st, l_sh;          /* lse strides */
  int64_t k_sp, k_sh, k_st;          /* K strides: page, head, slot */
  int64_t v_sp, v_sh, v_st;          /* V strides */
  kvr_fast_div page;                 /* division by the page size */
  int32_t table_stride;
  int32_t max_seqs;
  int32_t b, t, hq, hkv, g;          /* batch rows, query tokens, heads, GQA group hq / hkv */
  int32_t q_dtype, out_dtype;        /* KVR_DT_* */
  int32_t window;                    /* 0: no sliding window */
  int32_t min_tiles_per_cta;
  int32_t stages;                    /* cp.async pipeline stages (the shared memory holds them) */
  int32_t q_vec;                     /* KVR_KV_Q_* */
  float scale_log2;                  /* scale * log2(e), no softcap */
  float qk_scale;                    /* scale (softcap path) */
  float softcap;                     /* 0: off */
  int32_t batch_inline[KVR_KV_MAX_INLINE_BATCH];
  int32_t pad;                       /* to the struct's 8-byte alignment */
} kvr_kv_decode_args;

/* Dynamic shared memory of a decode CTA, in bytes, area by area in this order: `stages` K/V
 * stages, Q staging [16][D + 8] KV, merge buffer [16][D + 8] f32, producer row offsets
 * [64][2] i64, softmax state of 4 warps [2][4][16] + [16][2] f32, full and empty mbarriers
 * (`stages` each), scan scratch [16] i64. Head dims that are a multiple of 64 swizzle the
 * 16-byte chunks of a K/V row (no padding); others pad each row by 16 bytes. */
struct kvr_kv_decode_smem {
  int32_t swizzled;     /* 1: chunk c of row r is stored at c ^ (r % 8) */
  int32_t row_stride;   /* elements per K/V tile row */
  int32_t q_stride;     /* elements per Q staging row */
  int32_t merge_stride; /* floats per merge buffer row */
  int32_t stage_bytes;  /* one stage: the K and the V tile */
  int32_t q_bytes, merge_bytes, off_bytes, ml_bytes;
  int32_t bar_bytes;    /* per stage */
  int32_t scan_bytes;
  int32_t total;        /* all of it, for `stages` stages */
  /* The short-batch split kernel (kvr_kv_sdecode_*), in this order: the stage area (`stages`
   * K/V stages, at least the 4 warps' [16][merge_stride] f32 combine slots and a partial
   * of that size; it also stages the partials a row's last CTA merges), Q staging, row offsets [stages][64][2] i64,
   * softmax state (ml_bytes), a flag (16 bytes). */
  int32_t split_area;
  int32_t split_total;
  /* The same with two groups of 4 warps (kG = 2: twice the stages and offsets, 8 combine
   * slots, softmax state of 8 warps). */
  int32_t split2_area;
  int32_t split2_total;
};

KVR_ABI_FN struct kvr_kv_decode_smem kvr_kv_decode_smem_layout(int32_t head_dim, int32_t elem_bytes,
                                                               int32_t stages) {
  struct kvr_kv_decode_smem s = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  s.swizzled = head_dim % 64 == 0;
  s.row_stride = s.swizzled ? head_dim : head_dim + 8;
  s.q_stride = head_dim + 8;
  s.merge_stride = head_dim + 8; /* 4 warps' float2 read-modify-writes hit distinct banks */
  s.stage_bytes = 2 * KVR_KV_DECODE_TILE * s.row_stride * elem_bytes;
  s.q_bytes = 16 * s.q_stride * elem_bytes;
  s.merge_bytes = 16 * s.merge_stride * 4;
  s.off_bytes = KVR_KV_DECODE_TILE * 2 * 8;
  s.ml_bytes = (4 * 16 * 2 + 32) * 4;
  s.bar_bytes = 2 * 8;
  s.scan_bytes = 16 * 8;
  s.total = stages * (s.stage_bytes + s.bar_bytes) + s.q_bytes + s.merge_bytes + s.off_bytes +
            s.ml_bytes + s.scan_bytes;
  s.split_area = stages * s.stage_bytes;
  if (s.split_area < 5 * s.merge_bytes) s.split_area = 5 * s.merge_bytes;
  s.split_total = s.split_area + s.q_bytes + stages * s.off_bytes + s.ml_bytes + 16;
  s.split2_area = 2 * stages * s.stage_bytes;
  if (s.split2_area < 9 * s.merge_bytes) s.split2_area = 9 * s.merge_bytes;
  s.split2_total = s.split2_area + s.q_bytes + 2 * stages * s.off_bytes + s.ml_bytes + 128 * 4 + 16;
  return s;
}

/* ---- GDN kernels (gdn.cu, gdn_decode.cu, gdn_stream.cu) ---- */

#define KVR_GDN_THREADS 256        /* the step kernel (kvr_gdn_step_*) */
/* float4 state vectors one thread of a step kernel holds at most (tv * dk <= NV * 4 *
 * KVR_GDN_THREADS): kvr_gdn_step_*_nv8 (fewer registers, smaller tiles) and _nv16. */
#define KVR_GDN_NARROW_NV 8
#define KVR_GDN_MAX_NV 16
#define KVR_GDN_CHUNK 16           /* buffered entries per shared-memory chunk (step kernel) */
#define KVR_GDN_MAX_T 8            /* tokens per step (MAX_DRAFTS of src/linear/replay/config.rs) */
#define KVR_GDN_MAX_INLINE 512     /* sequence ids in kvr_gdn_step_args */
#define KVR_GDN_MAX_COMMIT_INLINE 256
#define KVR_GDN_FINISH_THREADS 128
#define KVR_GDN_COMMIT_THREADS 256
#define KVR_GDN_DECODE_ROWS_PER_WARP 8 /* kvr_gdn_decode_*: value rows per warp */
#define KVR_GDN_DECODE_MAX_WARPS 4     /* ... warps per CTA at most */
#define KVR_GDN_STREAM_THREADS 256     /* kvr_gdn_sdecode_*, kvr_gdn_sverify_*, kvr_gdn_vprep_* */
#define KVR_GDN_WDECODE_ROWS 8         /* kvr_gdn_wdecode_*: value rows per warp */
#define KVR_GDN_WDECODE_MAX_RING 32    /* ... ring lengths up to this */
#define KVR_GDN_WREC_ROWS 8            /* kvr_gdn_wrec_*: value rows per warp (4 warps a CTA) */
#define KVR_GDN_WREC_MINB 8            /* ... resident CTAs per SM the registers aim for (dk <= 128) */
#define KVR_GDN_WVERIFY_MAX_RING 64    /* kvr_gdn_wverify_*: ring lengths up to this (8 value rows a warp, 4 warps a CTA) */
#define KVR_GDN_WVERIFY_MINB4 6        /* ... resident CTAs per SM the registers aim for, up to 4 drafts (_t4) */
#define KVR_GDN_WVERIFY_MINB8 5        /* ... up to 8 drafts (_t8) */
#define KVR_GDN_KVERIFY_FLUSH_SLOTS 16 /* kvr_gdn_wverify_*_k_*: ring slots a CTA stages per step of a flush */
#define KVR_GDN_WVPREP_THREADS 256     /* kvr_gdn_wvprep_*: one CTA per (batch row, key head) */
#define KVR_GDN_WVPREP_W4_DRAFTS 4     /* kvr_gdn_wvprep_d128_r16_w4: drafts at most, and warps */
#define KVR_GDN_DPREP_THREADS 512      /* kvr_gdn_dprep_*: at most (one CTA per batch row; 64..512 per key head) */
#define KVR_GDN_KVONLY_THREADS 128     /* gdn_kvonly.cuh: one CTA per KV-only (batch row, value head) */
#define KVR_GDN_KVONLY_MAX 256         /* ... entries and value rows at most */
#define KVR_GDN_KVDEC_THREADS 128      /* gdn_kvdec.cu: kvr_gdn_kvdec_* (p.tiles CTAs a row and value head) */

/* The per-(layer, sequence) metadata record: KVR_GDN_META_INTS int32, these slots. */
#define KVR_GDN_META_MODE 0     /* KVR_GDN_KV_ONLY, KVR_GDN_REPLAY or KVR_GDN_RECURRENT */
#define KVR_GDN_META_START 1    /* ring position of the oldest buffered entry */
#define KVR_GDN_META_H 2        /* buffered entries */
#define KVR_GDN_META_PENDING 3  /* drafts of an uncommitted verify */
#define KVR_GDN_META_CONV_END 4 /* conv window: inputs written so far (ring end) */
#define KVR_GDN_META_ARRIVE 5   /* arrival counter of the CTAs of a launch (device only, 0 between) */
#define KVR_GDN_META_INTS 8

/* Sequence modes (the KVR_GDN_META_MODE slot). */
#define KVR_GDN_KV_ONLY 0   /* entries only, kept in the state memory */
#define KVR_GDN_REPLAY 1    /* checkpoint state plus ring */
#define KVR_GDN_RECURRENT 2 /* state read and written every step (ring_len 0) */

/* kvr_gdn_step_args.op */
#define KVR_GDN_OP_STEP 0
#define KVR_GDN_OP_FLUSH 1
#define KVR_GDN_OP_EXPORT 2

/* kvr_gdn_step_args.rule: how a token's entry is formed (src/linear/replay/plan.rs). */
#define KVR_GDN_RULE_DELTA 0    /* u = beta (v - S k) (Gated DeltaNet) */
#define KVR_GDN_RULE_ADDITIVE 1 /* u = beta v (linear attention, Mamba-2) */

/* kvr_gdn_step_args.dt_mode: where beta and g come from. */
#define KVR_GDN_DT_NONE 0     /* beta and g tensors (p 0: 1 and 0) */
#define KVR_GDN_DT_GATE 1     /* Mamba-2: dt' = clamp(dt + bias, min, max) from the beta tensor; */
#define KVR_GDN_DT_SOFTPLUS 2 /*   ... softplus before the clamp; beta = dt', g = A[h] dt' */

/* A strided tensor argument (up to 4 dims, strides in elements). */
typedef struct {
  KVR_PTR(void) p;
  int64_t s[4];
  int32_t dtype; /* KVR_DT_* */
  int32_t pad;
} kvr_gdn_tensor;

/* One layer's state (kvr_gdn_commit, exports of all layers). */
typedef struct {
  KVR_PTR(char) state;
  int64_t seq_stride;
} kvr_gdn_layer_state;

/* kvr_gdn_step_*, kvr_gdn_finish, kvr_gdn_decode_*, kvr_gdn_sdecode_*: one layer. */
typedef struct {
  KVR_PTR(char) state;          /* this layer's state of sequence slot 0 */
  KVR_PTR(char) snaps;          /* recurrent pools: this layer's per-draft snapshots */
  KVR_PTR(char) ring_u;         /* this layer's ring: u [seq][L][hv][dv] */
  KVR_PTR(char) ring_k;         /*                    k [seq][L][hk][dk] */
  KVR_PTR(float) ring_g;        /*                    g [seq][L][hv] */
  KVR_PTR(int32_t) meta;        /* this layer's metadata [seq][KVR_GDN_META_INTS] */
  KVR_PTR(char) conv;           /* this layer's conv windows [seq][conv_slots][conv_dim] */
  KVR_PTR(uint32_t) sync;       /* per-(seq, value head) arrival counters (all layers) */
  KVR_PTR(const int32_t) ids;   /* device sequence ids, or 0: ids_inline */
  KVR_PTR(float) scratch;       /* verify: per-(row, key head) records of kvr_gdn_vprep_* */
  KVR_PTR(const kvr_gdn_layer_state) layers; /* export of all layers (gridDim.y > 1) */
  int64_t seq_stride;           /* state elements between sequence slots */
  int64_t ring_u_lb, ring_k_lb, ring_g_lb, meta_lb; /* bytes between layers of each part */
  kvr_gdn_tensor q, k, v, g, beta, out, conv_in;
  kvr_gdn_tensor skip, gate;    /* y += skip[h] v (p 0: none); y *= silu(gate) (p 0: none) */
  kvr_gdn_tensor a, dt_bias;    /* KVR_GDN_DT_GATE*: A [hv], bias [hv] (p 0: 0) */
  int32_t op;                   /* KVR_GDN_OP_* */
  int32_t b, t, hk, hv, dk, dv; /* batch rows, tokens, key / value heads, head dims */
  int32_t l;                    /* ring length L (0: recurrent pool) */
  int32_t thr, kv_cap, max_drafts, conv_dim, conv_slots, entry_dtype, conv_dtype, tv;
  int32_t tiles, auto_commit, l2norm, hmax, export_seq;
  int32_t stages;               /* gdn_stream.cu: state tiles per CTA (2: persistent CTAs);
                                   gdn_wdecode.cu: prep CTAs per batch row (key-head shares);
                                   kvr_gdn_kvdec_*: 1 = fixed shares of the entries, copied
                                   before the metadata */
  float scale;
  int32_t rule;                 /* KVR_GDN_RULE_* */
  int32_t dt_mode;              /* KVR_GDN_DT_* */
  float dt_min, dt_max;
  int32_t export_prefix;        /* export: entries folded into the state (-1: all) */
  int32_t kv_split;             /* kvr_gdn_decode_*: KV-only rows that do not materialize are
                                   kvr_gdn_kvonly_*'s, launched before it (1), or computed by
                                   the head's first tile, of 128 threads (2); 0: per tile.
                                   kvr_gdn_fdecode_*, kvr_gdn_dprep_* and the state kernels
                                   of kvr_gdn_wdecode_* in pools with KV-only mode (after
                                   kvr_gdn_kvdec_*, which took the KV-only rows): 1 = some row
                                   may be KV-only, so read the row's metadata before the state
                                   (the prep kernel: before its loads) and skip such rows; 0 =
                                   state first (a KV-only row is still skipped) */
  int32_t vmajor;               /* 1: V-major states (kvr_gdn_kvdec_*; the other kernels are
                                   built per layout) */
  int32_t live_u;               /* kvr_gdn_wdecode_*_v_* after the prep kernel: 1 = load only
                                   the u values of the ring slots the metadata marks as
                                   buffered (read before the wait); 0 = every slot's */
  int32_t pad;                  /* to the inline ids' 8-byte alignment of the whole */
  int32_t ids_inline[KVR_GDN_MAX_INLINE];
} kvr_gdn_step_args;

/* kvr_gdn_fdecode_<state>_v_d128_r<16|32>_<spec> (the specialized one-launch decode): the
 * fields of kvr_gdn_step_args those builds read, the others being constants of the build or
 * unused (the kernel rebuilds a kvr_gdn_step_args from it in registers). Gated DeltaNet's fields
 * first, Mamba-2's after them: a GDN step's CTAs read 5 constant-cache lines of parameters at
 * entry instead of 9 (B = 1: 4.20 -> 3.94 us, BENCHMARKS.md). Tensor strides s[i] as <t>_s<i>. */
typedef struct {
  KVR_PTR(char) state;
  KVR_PTR(char) ring_u;
  KVR_PTR(char) ring_k;
  KVR_PTR(float) ring_g;
  KVR_PTR(int32_t) meta;
  KVR_PTR(const int32_t) ids;
  KVR_PTR(void) q;
  KVR_PTR(void) k;
  KVR_PTR(void) v;
  KVR_PTR(void) g;
  KVR_PTR(void) beta;
  KVR_PTR(void) out;
  int64_t seq_stride;
  int64_t q_s0;
  int64_t q_s2;
  int64_t k_s0;
  int64_t k_s1;
  int64_t k_s2;
  int64_t v_s0;
  int64_t v_s2;
  int64_t g_s0;
  int64_t g_s1;
  int64_t g_s2;
  int64_t beta_s0;
  int64_t beta_s1;
  int64_t beta_s2;
  int64_t out_s0;
  int64_t out_s2;
  int64_t out_s3;
  int32_t op;
  int32_t t;
  int32_t hk;
  int32_t hv;
  int32_t dk;
  int32_t dv;
  int32_t tv;
  int32_t tiles;
  int32_t auto_commit;
  int32_t l2norm;
  float scale;
  int32_t pad;
  KVR_PTR(void) skip;
  KVR_PTR(void) gate;
  KVR_PTR(void) a;
  KVR_PTR(void) dt_bias;
  int64_t skip_s0;
  int64_t gate_s0;
  int64_t gate_s2;
  int64_t gate_s3;
  int64_t a_s0;
  int64_t dt_bias_s0;
  float dt_min, dt_max;
  int32_t ids_inline[KVR_GDN_MAX_INLINE];
} kvr_gdn_fdecode_args;

/* kvr_gdn_commit: layers [layer0, layer0 + gridDim.z). */
typedef struct {
  KVR_PTR(const kvr_gdn_layer_state) layers;
  KVR_PTR(char) snaps;               /* all layers */
  KVR_PTR(int32_t) meta;             /* all layers */
  KVR_PTR(char) conv;                /* all layers */
  KVR_PTR(const int32_t) accepted;   /* device counts, or 0: acc_inline */
  kvr_gdn_tensor conv_out;           /* [B, conv_kernel - 1, conv_dim] (s[3]: between layers), p 0 when not wanted */
  int64_t snap_layer_bytes, state_bytes, conv_layer_bytes;
  int32_t layer0, max_seqs, max_drafts, recurrent, conv_dim, conv_slots, conv_k1, conv_dtype;
  int32_t chunks, acc_stride, state_es, pad;
  int32_t ids[KVR_GDN_MAX_COMMIT_INLINE];
  int32_t acc_inline[KVR_GDN_MAX_COMMIT_INLINE];
} kvr_gdn_commit_args;

KVR_ABI_FN int32_t kvr_align16(int32_t x) { return (x + 15) & ~15; }
KVR_ABI_FN int32_t kvr_round4(int32_t x) { return (x + 3) & ~3; }

/* Dynamic shared memory of the step kernel (gdn.cu), area by area in this order: sizes in
 * floats, then the double-buffered raw entry chunks (cp.async) in bytes, sized for f32
 * entries. `t` is the step's tokens (1 for a flush or export). */
struct kvr_gdn_step_smem {
  int32_t xs;     /* [2t][dk] q and k of each token */
  int32_t hist;   /* [2t][tv] state readouts */
  int32_t vrow;   /* [t][tv] */
  int32_t urow;   /* [t][tv] */
  int32_t coef_a; /* [KVR_GDN_MAX_T][KVR_GDN_MAX_T] */
  int32_t coef_b; /* [KVR_GDN_MAX_T][KVR_GDN_MAX_T] */
  int32_t egam;   /* egam [16] at 0, betas [16] at 16, gd [16] at 32 */
  int32_t kc;     /* [KVR_GDN_CHUNK][dk] */
  int32_t uc;     /* [KVR_GDN_CHUNK][tv] */
  int32_t cx;     /* [2t][KVR_GDN_CHUNK] */
  int32_t ga, gb; /* [round4(hmax)] each */
  int32_t red;    /* [8 warps][2][tv] */
  int32_t raw;    /* bytes: [2][KVR_GDN_CHUNK][dk + tv] f32 */
  int32_t total;  /* bytes */
};

KVR_ABI_FN struct kvr_gdn_step_smem kvr_gdn_step_smem_layout(int32_t dk, int32_t tv, int32_t t,
                                                             int32_t hmax) {
  struct kvr_gdn_step_smem s = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  s.xs = 2 * t * dk;
  s.hist = 2 * t * tv;
  s.vrow = t * tv;
  s.urow = t * tv;
  s.coef_a = KVR_GDN_MAX_T * KVR_GDN_MAX_T;
  s.coef_b = KVR_GDN_MAX_T * KVR_GDN_MAX_T;
  s.egam = 128;
  s.kc = KVR_GDN_CHUNK * dk;
  s.uc = KVR_GDN_CHUNK * tv;
  s.cx = 2 * t * KVR_GDN_CHUNK;
  s.ga = kvr_round4(hmax);
  s.gb = kvr_round4(hmax);
  s.red = (KVR_GDN_THREADS / 32) * 2 * tv;
  s.raw = 2 * KVR_GDN_CHUNK * (dk + tv) * 4;
  s.total = 4 * (s.xs + s.hist + s.vrow + s.urow + s.coef_a + s.coef_b + s.egam + s.kc + s.uc +
                 s.cx + s.ga + s.gb + s.red) +
            s.raw;
  return s;
}

/* Dynamic shared memory of kvr_gdn_decode_* (float offsets, then bytes): decays, and the
 * key dot products k_j . q and k_j . k of every buffered entry (hmax each). */
struct kvr_gdn_decode_smem {
  int32_t gs, cq, ck;
  int32_t total;
};

KVR_ABI_FN struct kvr_gdn_decode_smem kvr_gdn_decode_smem_layout(int32_t hmax) {
  struct kvr_gdn_decode_smem s = {0, 0, 0, 0};
  s.gs = 0;
  s.cq = hmax;
  s.ck = 2 * hmax;
  s.total = 4 * 3 * hmax;
  return s;
}

/* Dynamic shared memory of kvr_gdn_sdecode_* (bytes): `stages` state tiles (V-major: r rows
 * of dk elements; K-major: dk rows of r values, each padded by 16 bytes), the ring's u rows
 * of the tile [l][r] (entry dtype), then floats qs, ks [dk]; sq, sk, us [r]; aq, ak, wg, gs
 * [max(l, 1)]; then 32 int words. `es` / `ee`: state / entry element bytes. */
struct kvr_gdn_stream_smem {
  int32_t st0, st1; /* state tiles (st1 = st0 with one stage) */
  int32_t ut;       /* ring u rows */
  int32_t fl;       /* floats */
  int32_t ints;     /* int words */
  int32_t total;
};

KVR_ABI_FN struct kvr_gdn_stream_smem kvr_gdn_stream_smem_layout(int32_t vmajor, int32_t dk, int32_t r,
                                                                 int32_t es, int32_t l, int32_t ee,
                                                                 int32_t stages) {
  struct kvr_gdn_stream_smem s = {0, 0, 0, 0, 0, 0};
  const int32_t st_bytes = kvr_align16(vmajor ? r * dk * es : dk * (r * es + 16));
  const int32_t lc = l > 0 ? l : 1;
  s.st0 = 0;
  s.st1 = stages > 1 ? st_bytes : 0;
  s.ut = stages * st_bytes;
  s.fl = s.ut + kvr_align16(l * r * ee);
  s.ints = s.fl + 4 * (2 * dk + 3 * r + 4 * lc);
  s.total = s.ints + 4 * 32;
  return s;
}

/* Dynamic shared memory of the streaming verify kernel (gdn_sverify.cu), bytes: the state
 * tile (rows padded by 16 bytes in both layouts), the ring's u rows of the tile [l][r] (entry
 * dtype), then floats qs, ks [t][dk + 4]; sq, sk, vt [t][r]; aq, ak [t][max(l, 1)]; wg, gs [max(l, 1)]; the
 * drafts' coefficients [2][t][t] and gam, g, beta [t]; then 32 int words. */
struct kvr_gdn_verify_smem {
  int32_t ut, qs, ks, sq, sk, vt, aq, ak, wg, gs, co, ints, total;
};

KVR_ABI_FN struct kvr_gdn_verify_smem kvr_gdn_verify_smem_layout(int32_t vmajor, int32_t dk, int32_t r,
                                                                 int32_t es, int32_t l, int32_t ee,
                                                                 int32_t t) {
  struct kvr_gdn_verify_smem s = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const int32_t lc = l > 0 ? l : 1;
  s.ut = kvr_align16(vmajor ? r * (dk * es + 16) : dk * (r * es + 16));
  s.qs = s.ut + kvr_align16(l * r * ee);
  s.ks = s.qs + 4 * t * (dk + 4);
  s.sq = s.ks + 4 * t * (dk + 4);
  s.sk = s.sq + 4 * t * r;
  s.vt = s.sk + 4 * t * r;
  s.aq = s.vt + 4 * t * r;
  s.ak = s.aq + 4 * t * lc;
  s.wg = s.ak + 4 * t * lc;
  s.gs = s.wg + 4 * lc;
  s.co = s.gs + 4 * lc;
  s.ints = s.co + 4 * (2 * t * t + 3 * t);
  s.total = s.ints + 4 * 32;
  return s;
}

/* Floats of one (batch row, key head) record of the verify scratch (kvr_gdn_step_args.
 * scratch), written by kvr_gdn_vprep_* and read by the verify CTAs of the group: the drafts'
 * normalized q and k [tm][dk] each, the entries' key products k_j . q_s (rows 0..t) and
 * k_j . k_s (rows tm..tm+t) [2 tm][max(l, 1)], the drafts' products k_s . k_s' and k_s' . q_s
 * [2][tm][tm]; rounded up to 4 floats (tm: the pool's max_drafts). */
struct kvr_gdn_vprep_record {
  int32_t floats;
};

KVR_ABI_FN struct kvr_gdn_vprep_record kvr_gdn_vprep_record_layout(int32_t dk, int32_t l, int32_t tm) {
  struct kvr_gdn_vprep_record s = {0};
  const int32_t lc = l > 0 ? l : 1;
  s.floats = kvr_round4(2 * tm * (dk + lc + tm));
  return s;
}

/* The warp-streaming verify's scratch (gdn_wverify.cu, kvr_gdn_step_args.scratch), floats,
 * for `b` batch rows, written by kvr_gdn_wvprep_* and read by kvr_gdn_wverify_*: per (row, key
 * head) the drafts' q and k normalized [2][tm][dk] at qk and the ring keys a flush's drafts
 * displace [tm][dk] at moved; per (row, value head) a record of rec_floats at rec
 * (kvr_gdn_wvrec_layout; tm: the pool's max_drafts). */
struct kvr_gdn_wvscratch {
  int32_t qk, moved, rec, rec_floats, total;
};

/* One (row, value head) record of that scratch, float offsets: 4 int32 (start, buffered
 * entries, flush, base), e^G at eg, per draft e^{gam_s} at egam and beta at beta [tm], the
 * drafts' coefficients ca (beta_s e^{gam_s - gam_s'} k_s . k_s', s' < s) and cb
 * (e^{gam_s - gam_s'} k_s' . q_s, s' <= s) [tm][tm], the entries' coefficients by ring slot
 * a (w_j k_j . q_s) and b (w_j k_j . k_s) [tm][slots], slot p at (p % 4) * (slots / 4) + p / 4,
 * and the weights w_j by slot [slots] at w (0 where a slot holds no buffered entry). slots:
 * KVR_GDN_WVERIFY_MAX_RING (kvr_gdn_wvrec_layout, the scratch's record size), or 16 for the
 * `_r16` builds (rings of up to 16 entries: a smaller record in the same space). */
struct kvr_gdn_wvrec {
  int32_t eg, egam, beta, ca, cb, a, b, w, floats;
};

KVR_ABI_FN struct kvr_gdn_wvrec kvr_gdn_wvrec_layout_r(int32_t tm, int32_t slots) {
  struct kvr_gdn_wvrec s = {0, 0, 0, 0, 0, 0, 0, 0, 0};
  s.eg = 4;
  s.egam = 8;
  s.beta = s.egam + tm;
  s.ca = s.beta + tm;
  s.cb = s.ca + tm * tm;
  s.a = kvr_round4(s.cb + tm * tm);
  s.b = s.a + slots * tm;
  s.w = s.b + slots * tm;
  s.floats = s.w + slots;
  return s;
}

KVR_ABI_FN struct kvr_gdn_wvrec kvr_gdn_wvrec_layout(int32_t tm) {
  return kvr_gdn_wvrec_layout_r(tm, KVR_GDN_WVERIFY_MAX_RING);
}

KVR_ABI_FN struct kvr_gdn_wvscratch kvr_gdn_wvscratch_layout(int32_t b, int32_t hv, int32_t hk, int32_t dk,
                                                             int32_t tm) {
  struct kvr_gdn_wvscratch s = {0, 0, 0, 0, 0};
  s.qk = 0;
  s.moved = 2 * b * hk * tm * dk;
  s.rec = s.moved + b * hk * tm * dk;
  s.rec_floats = kvr_gdn_wvrec_layout(tm).floats;
  s.total = s.rec + b * hv * s.rec_floats;
  return s;
}

/* ---- kernels/gdn_recur.cu: kvr_gdn_recur_d<dk>_r<rows> (kvr_context_gdn_recurrent) ---- */

/* Threads of the stateless recurrent kernel: 4 warps, each owning `rows` (1, 2 or 4) value
 * rows of one (sequence, value head) with the whole key dimension in registers. */
#define KVR_GDN_RECUR_THREADS 128

/* A stateless recurrent step over the caller's tensors: q, k [B, T, Hq, dk]; v, out
 * [B, T, Hv, dv]; g, beta [B, T, Hv] (s[0..2]); f32 states [B, Hv, dv, dk] and snapshots
 * [slot, B, Hv, dv, dk] with the key dimension contiguous. Work item i = b * hv + h, for i
 * in [item0, item_end). Grid (ceil(groups / warps per CTA), hv, sequences from b0): CTA
 * (x, h, z) serves item (b0 + z) * hv + h, its warps the value rows of groups x * warps .. */
typedef struct {
  kvr_gdn_tensor q, k, v, g, beta, out;
  KVR_PTR(const float) state_in;
  KVR_PTR(float) state_out;  /* 0: not written */
  KVR_PTR(float) snaps;      /* 0: no snapshots */
  int64_t si[3];             /* state_in strides (b, h, value row), elements */
  int64_t so[3];             /* state_out strides */
  int64_t sn[4];             /* snapshot strides (slot, b, h, value row) */
  int64_t item0, item_end;
  int32_t t, hq, hv, dv;
  int32_t groups;            /* warps per item: ceil(dv / rows) */
  int32_t b0;                /* first sequence of the grid (item0 / hv) */
  int32_t kh_div;            /* value heads per key head (hv / hq) */
  int32_t tiled;             /* 1: value head h reads key head h % hq; 0: h / (hv / hq) */
  int32_t l2norm;            /* L2-normalize q and k: 1 x / sqrt(sum x^2 + eps), 2 x / max(|x|, eps) */
  int32_t n_snaps;           /* snapshot slots written: slot s = state after token t - 1 - s */
  float scale;               /* output scale */
  float l2norm_eps;          /* eps of the L2 norm */
} kvr_gdn_recur_args;

/* The one-token form of kvr_gdn_recur_args (kvr_gdn_recur1[n]_d<dk>_r<rows>): every tensor
 * f32, no snapshots, B whole sequences, each token tensor spanning fewer than 2^31 elements
 * (32-bit strides). A compact block: the kernel's parameter reads stay within a few
 * constant-cache lines, which a batch of one sequence waits on (bench/gdn_recur_ab.cu).
 * Grid (dv / (rows * 4), hv, B), KVR_GDN_RECUR_THREADS threads. */
typedef struct {
  KVR_PTR(const float) q;
  KVR_PTR(const float) k;
  KVR_PTR(const float) v;
  KVR_PTR(const float) g;
  KVR_PTR(const float) beta;
  KVR_PTR(const float) state_in;
  KVR_PTR(float) out;
  KVR_PTR(float) state_out;
  int64_t si[3];                /* state_in strides (b, h, value row), elements */
  int64_t so[3];                /* state_out strides */
  int32_t qs[2], ks[2];         /* q, k strides (b, key head) */
  int32_t vs[3], ys[3];         /* v, out strides (b, value head, value row) */
  int32_t gs[2], bs[2];         /* g, beta strides (b, value head) */
  int32_t hq, kh_div, tiled, l2norm;
  float scale, l2norm_eps;
} kvr_gdn_recur1_args;

/* The decode scratch of the warp-streaming decode (gdn_wdecode.cu, kvr_gdn_step_args.scratch),
 * floats, for `b` batch rows, written by kvr_gdn_dprep_* and read by kvr_gdn_wdecode_*: per row
 * a header of 4 int32 (start, buffered entries, flush, base) at hdr; per (row, value head) a
 * record of rec_floats at rec: e^G, e^g, beta, k . q, then coefficients A [lc], B [lc] and
 * weights W [lc] by ring slot (lc = max(l, 1)); per (row, key head) the ring key a flush step
 * displaces [dk] at keys, and q, k normalized [2][dk] at qk; per row v [hv][dv] at vv (in
 * v's dtype, dv * hv floats of room). */
struct kvr_gdn_dscratch {
  int32_t hdr, rec, rec_floats, keys, qk, vv, total;
};

KVR_ABI_FN struct kvr_gdn_dscratch kvr_gdn_dscratch_layout(int32_t b, int32_t hv, int32_t hk, int32_t dk,
                                                           int32_t dv, int32_t l) {
  struct kvr_gdn_dscratch s = {0, 0, 0, 0, 0, 0, 0};
  const int32_t lc = l > 0 ? l : 1;
  s.hdr = 0;
  s.rec = 4 * b;
  s.rec_floats = kvr_round4(4 + 3 * lc);
  s.keys = s.rec + b * hv * s.rec_floats;
  s.qk = s.keys + b * hk * dk;
  s.vv = s.qk + 2 * b * hk * dk;
  s.total = s.vv + b * hv * dv;
  return s;
}

#endif /* KVR_ABI_H */
