//! The host side of the kernel ABI, as defined by `kernels/kvr_abi.h`: `#[repr(C)]` mirrors
//! of the launch-parameter structs, the constants (metadata record, modes, ops, dtype codes,
//! limits), and ports of the shared-memory size formulas the launches are sized by.
//!
//! The header is the definition; this module follows it, under the same names. The macros
//! below also record each struct's size, alignment and fields (name, type, offset, size) and
//! each constant's value, and the unit test at the end (CPU-only, part of `cargo test`)
//! compiles a C program against the header with the system C compiler (`cc`, or `$CC`) and
//! compares: the same structs, the same fields in the same order with the same types,
//! offsets and sizes, no implicit padding, the same constants, and the formulas over a grid
//! of configurations. A field moved on one side fails the test, not a GPU run.

use crate::tensor::DType;

/// A struct's layout as recorded by `abi_structs!`.
#[cfg(test)]
struct StructInfo {
    rust: &'static str,
    c: &'static str,
    size: usize,
    align: usize,
    fields: &'static [FieldInfo],
}

#[cfg(test)]
struct FieldInfo {
    name: &'static str,
    ty: &'static str,
    offset: usize,
    size: usize,
}

/// `#[repr(C)]` structs with `pub(crate)` fields, each named after its C typedef, and (in
/// tests) `STRUCTS`, their recorded layouts.
macro_rules! abi_structs {
    ($(
        $(#[$meta:meta])*
        struct $name:ident = $c:literal {
            $( $(#[$fmeta:meta])* $field:ident : $ty:ty ),* $(,)?
        }
    )*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            pub(crate) struct $name {
                $( $(#[$fmeta])* pub(crate) $field: $ty ),*
            }
        )*
        #[cfg(test)]
        const STRUCTS: &[StructInfo] = &[$(
            StructInfo {
                rust: stringify!($name),
                c: $c,
                size: size_of::<$name>(),
                align: align_of::<$name>(),
                fields: &[$(
                    FieldInfo {
                        name: stringify!($field),
                        ty: stringify!($ty),
                        offset: std::mem::offset_of!($name, $field),
                        size: size_of::<$ty>(),
                    }
                ),*],
            }
        ),*];
    };
}

/// Constants named as in the header, and (in tests) `CONSTS`, their values. Some are used
/// by the kernels only; they are here so that the test sees every one.
macro_rules! abi_consts {
    ($( $(#[$meta:meta])* $name:ident : $ty:ty = $val:expr; )*) => {
        $(
            $(#[$meta])*
            #[allow(dead_code)]
            pub(crate) const $name: $ty = $val;
        )*
        #[cfg(test)]
        const CONSTS: &[(&str, i64)] = &[$( (stringify!($name), $name as i64) ),*];
    };
}

abi_consts! {
    /// Element type codes of kernel tensors, rings, states and windows.
    KVR_DT_F32: i32 = 0;
    KVR_DT_F16: i32 = 1;
    KVR_DT_BF16: i32 = 2;

    /// Most dimensions of a copy (`MAX_DIMS`).
    KVR_COPY_MAX_DIMS: usize = 8;
    KVR_COPY_THREADS: u32 = 256;

    KVR_KV_MAX_PATCHES: usize = 480;
    KVR_KV_MAX_WRITE_GROUPS: usize = 120;
    KVR_KV_MAX_PAGE_COPIES: usize = 240;
    KVR_KV_WRITE_THREADS: u32 = 256;
    /// 4 consumer warps + 2 producer warps (kernels/kv_decode.cu).
    KVR_KV_DECODE_THREADS: u32 = 192;
    /// Tokens per K/V tile of the decode kernel.
    KVR_KV_DECODE_TILE: usize = 64;
    KVR_KV_MAX_INLINE_BATCH: usize = 512;
    /// The short-batch split decode (kvr_kv_sdecode / kvr_kv_cdecode): K/V tiles in flight
    /// per CTA, threads (4 warps).
    KVR_KV_SDECODE_STAGES: usize = 3;
    KVR_KV_SDECODE_THREADS: u32 = 128;
    /// Rows per write-gated scatter launch, and its threads (kernels/wgkv.cu).
    KVR_WGKV_MAX_PAIRS: usize = 160;
    KVR_WGKV_SCATTER_THREADS: u32 = 256;
    /// The write-gated device step (kernels/wgkv.cu `kvr_wgkv_step`): threads, tokens per
    /// CTA, sequences per launch, gate hidden units per CTA, most gate inputs, row-state ints.
    KVR_WGKV_STEP_THREADS: u32 = 256;
    KVR_WGKV_STEP_TILE: usize = 16;
    KVR_WGKV_STEP_MAX_SEQS: usize = 128;
    KVR_WGKV_GATE_CHUNK: usize = 16;
    KVR_WGKV_GATE_MAX_IN: usize = 512;
    KVR_WGKV_ROW_INTS: usize = 8;
    /// `slots` between device steps, and the flags of a published slot (a sink; the slot's
    /// previous token promoted).
    KVR_WGKV_SLOT_PENDING: i32 = i32::MIN;
    KVR_WGKV_SLOT_SINK: i32 = 1 << 30;
    KVR_WGKV_SLOT_EVICTED: i32 = 1 << 29;
    /// More flags of a published code (the row is scored now; no new token), the queued
    /// count's place in it, and the slot's mask.
    KVR_WGKV_SLOT_DUE: i32 = 1 << 28;
    KVR_WGKV_SLOT_NOCUR: i32 = 1 << 27;
    KVR_WGKV_SLOT_QSHIFT: i32 = 20;
    KVR_WGKV_SLOT_QMASK: i32 = 127;
    KVR_WGKV_SLOT_MASK: i32 = (1 << 20) - 1;
    /// `WgKvStepArgs::mode`: the gate scores each step's tokens at once; queues them and
    /// scores a row when its queue is full; scores the queues only (no new tokens).
    KVR_WGKV_MODE_IMMEDIATE: i32 = 0;
    KVR_WGKV_MODE_DEFERRED: i32 = 1;
    KVR_WGKV_MODE_FLUSH: i32 = 2;
    /// Most queued gate inputs per row (deferred gate).
    KVR_WGKV_GATE_QUEUE: usize = 16;
    /// `KvDecodeArgs::q_vec`: element loads; 16-byte loads of KV-typed q; of f32 q.
    KVR_KV_Q_SCALAR: i32 = 0;
    KVR_KV_Q_VEC_KV: i32 = 1;
    KVR_KV_Q_VEC_F32: i32 = 2;

    /// Threads of the GDN step kernel.
    KVR_GDN_THREADS: u32 = 256;
    /// float4 state vectors per thread of the narrow and the wide step kernels.
    KVR_GDN_NARROW_NV: usize = 8;
    KVR_GDN_MAX_NV: usize = 16;
    /// Buffered entries per shared-memory chunk of the step kernel.
    KVR_GDN_CHUNK: usize = 16;
    /// Tokens per step (`MAX_DRAFTS`).
    KVR_GDN_MAX_T: usize = 8;
    KVR_GDN_MAX_INLINE: usize = 512;
    KVR_GDN_MAX_COMMIT_INLINE: usize = 256;
    KVR_GDN_FINISH_THREADS: u32 = 128;
    KVR_GDN_COMMIT_THREADS: u32 = 256;
    /// Value rows per warp, and warps per CTA at most, of the single-token decode kernel.
    KVR_GDN_DECODE_ROWS_PER_WARP: usize = 8;
    KVR_GDN_DECODE_MAX_WARPS: usize = 4;
    KVR_GDN_STREAM_THREADS: u32 = 256;
    /// Value rows per warp and ring lengths of the warp-streaming decode (gdn_wdecode.cu),
    /// and the most threads of its prep kernel (a CTA per batch row, or per key head of it).
    KVR_GDN_WDECODE_ROWS: usize = 8;
    KVR_GDN_WDECODE_MAX_RING: usize = 32;
    /// Value rows per warp of the recurrent pools' state kernel without a prep kernel
    /// (`kvr_gdn_wrec_*`, 4 warps a CTA), and the CTAs per SM its registers aim for (dk <= 128).
    KVR_GDN_WREC_ROWS: usize = 8;
    KVR_GDN_WREC_MINB: usize = 8;
    /// Ring lengths of the warp-streaming verify (gdn_wverify.cu), the CTAs per SM its
    /// registers aim for up to 4 and 8 drafts, and the threads of its prep kernel.
    KVR_GDN_WVERIFY_MAX_RING: usize = 64;
    KVR_GDN_WVERIFY_MINB4: usize = 6;
    KVR_GDN_WVERIFY_MINB8: usize = 5;
    /// Ring slots a CTA of the K-major verify stages per step of a flush (the shared memory
    /// of its state kernel holds at least this many slots of keys).
    KVR_GDN_KVERIFY_FLUSH_SLOTS: usize = 16;
    KVR_GDN_WVPREP_THREADS: u32 = 256;
    /// Drafts at most of a verify round whose `_r16` prep runs in CTAs of this many warps
    /// (`kvr_gdn_wvprep_d128_r16_w4`).
    KVR_GDN_WVPREP_W4_DRAFTS: usize = 4;
    KVR_GDN_DPREP_THREADS: u32 = 512;
    /// Threads of the KV-only decode kernel (a CTA per batch row and value head), and the
    /// most entries and value rows it takes.
    KVR_GDN_KVONLY_THREADS: u32 = 128;
    KVR_GDN_KVONLY_MAX: usize = 256;
    /// Threads of a CTA of the KV-only rows' decode beside the warp-streaming decode
    /// (`kvr_gdn_kvdec_*`, `tiles` CTAs per row and value head).
    KVR_GDN_KVDEC_THREADS: u32 = 128;

    /// Slots of the per-(layer, sequence) metadata record of `KVR_GDN_META_INTS` i32.
    KVR_GDN_META_MODE: usize = 0;
    KVR_GDN_META_START: usize = 1;
    KVR_GDN_META_H: usize = 2;
    KVR_GDN_META_PENDING: usize = 3;
    KVR_GDN_META_CONV_END: usize = 4;
    /// Arrival counter of the CTAs of one launch (device only; 0 between launches).
    KVR_GDN_META_ARRIVE: usize = 5;
    KVR_GDN_META_INTS: usize = 8;

    /// Sequence modes (the `KVR_GDN_META_MODE` slot).
    KVR_GDN_KV_ONLY: i32 = 0;
    KVR_GDN_REPLAY: i32 = 1;
    KVR_GDN_RECURRENT: i32 = 2;

    /// `GdnStepArgs::op`.
    KVR_GDN_OP_STEP: i32 = 0;
    KVR_GDN_OP_FLUSH: i32 = 1;
    KVR_GDN_OP_EXPORT: i32 = 2;
    /// `GdnStepArgs::rule`.
    KVR_GDN_RULE_DELTA: i32 = 0;
    KVR_GDN_RULE_ADDITIVE: i32 = 1;
    /// `GdnStepArgs::dt_mode`.
    KVR_GDN_DT_NONE: i32 = 0;
    KVR_GDN_DT_GATE: i32 = 1;
    KVR_GDN_DT_SOFTPLUS: i32 = 2;

    /// Threads of the stateless recurrent kernel (kernels/gdn_recur.cu).
    KVR_GDN_RECUR_THREADS: u32 = 128;
}

const _: () = assert!(KVR_COPY_MAX_DIMS == crate::tensor::MAX_DIMS);

abi_structs! {
    /// `n / d` as `(mulhi(n, mul) + n) >> shift` for n < 2^31 (`FastDiv::new`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct FastDiv = "kvr_fast_div" {
        d: u32,
        mul: u32,
        shift: u32,
    }

    /// `kvr_copy_<src>_<dst>`.
    struct CopyArgs = "kvr_copy_args" {
        src: u64,
        dst: u64,
        n: i64,
        ndim: i32,
        vectorized: i32,
        shape: [i64; KVR_COPY_MAX_DIMS],
        src_stride: [i64; KVR_COPY_MAX_DIMS],
        dst_stride: [i64; KVR_COPY_MAX_DIMS],
    }

    /// One layer's K and V storage.
    #[derive(Clone, Copy)]
    struct KvLayerDesc = "kvr_kv_layer_desc" {
        k: u64,
        v: u64,
        k_sp: i64,
        k_sh: i64,
        k_st: i64,
        v_sp: i64,
        v_sh: i64,
        v_st: i64,
    }

    /// `kvr_kv_patch`.
    struct KvPatchArgs = "kvr_kv_patch_args" {
        dst: u64,
        count: i32,
        pad: i32,
        index: [u32; KVR_KV_MAX_PATCHES],
        value: [i32; KVR_KV_MAX_PATCHES],
    }

    #[derive(Clone, Copy, Default)]
    struct KvWriteGroup = "kvr_kv_write_group" {
        slot: i32,
        start: i32,
        count: i32,
        src_offset: i32,
    }

    /// `kvr_kv_write_<src>_<dst>`.
    struct KvWriteArgs = "kvr_kv_write_args" {
        layers: u64,
        table: u64,
        k_src: u64,
        v_src: u64,
        ks: [i64; 4],
        vs: [i64; 4],
        page: FastDiv,
        table_stride: i32,
        layer0: i32,
        n_layers: i32,
        hkv: i32,
        d: i32,
        n_groups: i32,
        n_tokens: i32,
        groups: [KvWriteGroup; KVR_KV_MAX_WRITE_GROUPS],
    }

    /// `kvr_kv_copy_pages`.
    struct KvPageCopyArgs = "kvr_kv_page_copy_args" {
        layers: u64,
        n_layers: i32,
        hkv: i32,
        d: i32,
        page_size: i32,
        elem_bytes: i32,
        n_pairs: i32,
        src: [i32; KVR_KV_MAX_PAGE_COPIES],
        dst: [i32; KVR_KV_MAX_PAGE_COPIES],
    }

    /// `kvr_wgkv_scatter`.
    struct WgKvScatterArgs = "kvr_wgkv_scatter_args" {
        rows: u64,
        k_src: u64,
        v_src: u64,
        k_dst: u64,
        v_dst: u64,
        k_src_ds: i64,
        v_src_ds: i64,
        k_sp: i64,
        k_st: i64,
        v_sp: i64,
        v_st: i64,
        d: i32,
        n_pairs: i32,
        src_dtype: i32,
        dst_dtype: i32,
        k_off: [i64; KVR_WGKV_MAX_PAIRS],
        v_off: [i64; KVR_WGKV_MAX_PAIRS],
        page: [i32; KVR_WGKV_MAX_PAIRS],
        slot: [i32; KVR_WGKV_MAX_PAIRS],
    }

    /// `kvr_wgkv_step`.
    struct WgKvStepArgs = "kvr_wgkv_step_args" {
        k_pre: u64,
        k: u64,
        v: u64,
        scores_in: u64,
        scores_out: u64,
        norm_pre: u64,
        norm_post: u64,
        fc1_w: u64,
        fc1_b: u64,
        fc2_w: u64,
        fc2_b: u64,
        rows: u64,
        admit: u64,
        table: u64,
        lens: u64,
        k_dst: u64,
        v_dst: u64,
        zacc: u64,
        counters: u64,
        slots: u64,
        queue: u64,
        queue_codes: u64,
        kp_sb: i64,
        kp_sh: i64,
        kp_sd: i64,
        k_sb: i64,
        k_sh: i64,
        k_sd: i64,
        v_sb: i64,
        v_sh: i64,
        v_sd: i64,
        s_sb: i64,
        s_sh: i64,
        k_sp: i64,
        k_st: i64,
        v_sp: i64,
        v_st: i64,
        n: i32,
        hkv: i32,
        d: i32,
        hidden: i32,
        window: i32,
        page_size: i32,
        table_stride: i32,
        admit_words: i32,
        rows_per_seq: i32,
        row0: i32,
        sinks: i32,
        kp_dtype: i32,
        k_dtype: i32,
        v_dtype: i32,
        pool_dtype: i32,
        queue_len: i32,
        mode: i32,
        slot_copies: i32,
        pad3: i32,
        pad4: i32,
        tau: f32,
        norm_eps: f32,
        gate_floor: f32,
        pad1: f32,
        seq: [i32; KVR_WGKV_STEP_MAX_SEQS],
    }

    /// `kvr_kv_decode_<kv>_d<head_dim>`.
    struct KvDecodeArgs = "kvr_kv_decode_args" {
        q: u64,
        out: u64,
        lse: u64,
        k: u64,
        v: u64,
        table: u64,
        lens: u64,
        batch: u64,
        part_o: u64,
        part_lse: u64,
        counters: u64,
        group_counters: u64,
        q_sb: i64,
        q_st: i64,
        q_sh: i64,
        o_sb: i64,
        o_st: i64,
        o_sh: i64,
        l_sb: i64,
        l_st: i64,
        l_sh: i64,
        k_sp: i64,
        k_sh: i64,
        k_st: i64,
        v_sp: i64,
        v_sh: i64,
        v_st: i64,
        page: FastDiv,
        table_stride: i32,
        max_seqs: i32,
        b: i32,
        t: i32,
        hq: i32,
        hkv: i32,
        g: i32,
        q_dtype: i32,
        out_dtype: i32,
        window: i32,
        min_tiles_per_cta: i32,
        stages: i32,
        q_vec: i32,
        scale_log2: f32,
        qk_scale: f32,
        softcap: f32,
        batch_inline: [i32; KVR_KV_MAX_INLINE_BATCH],
        pad: i32,
    }

    /// A strided tensor argument of the GDN kernels.
    #[derive(Clone, Copy, Default)]
    struct GdnTensor = "kvr_gdn_tensor" {
        p: u64,
        s: [i64; 4],
        dtype: i32,
        pad: i32,
    }

    /// `kvr_gdn_step_*`, `kvr_gdn_finish`, `kvr_gdn_decode_*`, `kvr_gdn_sdecode_*`.
    #[derive(Clone)]
    struct GdnStepArgs = "kvr_gdn_step_args" {
        state: u64,
        snaps: u64,
        ring_u: u64,
        ring_k: u64,
        ring_g: u64,
        meta: u64,
        conv: u64,
        sync: u64,
        ids: u64,
        scratch: u64,
        layers: u64,
        seq_stride: i64,
        ring_u_lb: i64,
        ring_k_lb: i64,
        ring_g_lb: i64,
        meta_lb: i64,
        q: GdnTensor,
        k: GdnTensor,
        v: GdnTensor,
        g: GdnTensor,
        beta: GdnTensor,
        out: GdnTensor,
        conv_in: GdnTensor,
        skip: GdnTensor,
        gate: GdnTensor,
        a: GdnTensor,
        dt_bias: GdnTensor,
        op: i32,
        b: i32,
        t: i32,
        hk: i32,
        hv: i32,
        dk: i32,
        dv: i32,
        l: i32,
        thr: i32,
        kv_cap: i32,
        max_drafts: i32,
        conv_dim: i32,
        conv_slots: i32,
        entry_dtype: i32,
        conv_dtype: i32,
        tv: i32,
        tiles: i32,
        auto_commit: i32,
        l2norm: i32,
        hmax: i32,
        export_seq: i32,
        /// State tiles in shared memory of the streaming decode kernel: 1 (one item per CTA)
        /// or 2 (persistent CTAs, the next item's tile in flight).
        stages: i32,
        scale: f32,
        rule: i32,
        dt_mode: i32,
        dt_min: f32,
        dt_max: f32,
        export_prefix: i32,
        /// Decode kernel: KV-only rows that do not materialize are the KV-only kernel's,
        /// launched before it (1), or computed by the head's first tile (2); 0: per tile.
        kv_split: i32,
        vmajor: i32,
        /// V-major two-launch decode: load only the buffered slots' u values (1).
        live_u: i32,
        pad: i32,
        ids_inline: [i32; KVR_GDN_MAX_INLINE],
    }

    #[derive(Clone, Copy)]
    struct GdnLayerState = "kvr_gdn_layer_state" {
        state: u64,
        seq_stride: i64,
    }

    /// `kvr_gdn_commit`.
    struct GdnCommitArgs = "kvr_gdn_commit_args" {
        layers: u64,
        snaps: u64,
        meta: u64,
        conv: u64,
        accepted: u64,
        conv_out: GdnTensor,
        snap_layer_bytes: i64,
        state_bytes: i64,
        conv_layer_bytes: i64,
        layer0: i32,
        max_seqs: i32,
        max_drafts: i32,
        recurrent: i32,
        conv_dim: i32,
        conv_slots: i32,
        conv_k1: i32,
        conv_dtype: i32,
        chunks: i32,
        acc_stride: i32,
        state_es: i32,
        pad: i32,
        ids: [i32; KVR_GDN_MAX_COMMIT_INLINE],
        acc_inline: [i32; KVR_GDN_MAX_COMMIT_INLINE],
    }

    /// `kvr_gdn_recur_d<dk>_r<rows>`: the stateless recurrent step (`kvr_context_gdn_recurrent`).
    struct GdnRecurArgs = "kvr_gdn_recur_args" {
        q: GdnTensor,
        k: GdnTensor,
        v: GdnTensor,
        g: GdnTensor,
        beta: GdnTensor,
        out: GdnTensor,
        state_in: u64,
        state_out: u64,
        snaps: u64,
        si: [i64; 3],
        so: [i64; 3],
        sn: [i64; 4],
        item0: i64,
        item_end: i64,
        t: i32,
        hq: i32,
        hv: i32,
        dv: i32,
        groups: i32,
        b0: i32,
        kh_div: i32,
        tiled: i32,
        l2norm: i32,
        n_snaps: i32,
        scale: f32,
        l2norm_eps: f32,
    }

    /// `kvr_gdn_fdecode_*_<spec>`: the specialized one-launch decode's parameters (the fields
    /// of `kvr_gdn_step_args` it reads; see the header).
    struct GdnFDecodeArgs = "kvr_gdn_fdecode_args" {
        state: u64,
        ring_u: u64,
        ring_k: u64,
        ring_g: u64,
        meta: u64,
        ids: u64,
        q: u64,
        k: u64,
        v: u64,
        g: u64,
        beta: u64,
        out: u64,
        seq_stride: i64,
        q_s0: i64,
        q_s2: i64,
        k_s0: i64,
        k_s1: i64,
        k_s2: i64,
        v_s0: i64,
        v_s2: i64,
        g_s0: i64,
        g_s1: i64,
        g_s2: i64,
        beta_s0: i64,
        beta_s1: i64,
        beta_s2: i64,
        out_s0: i64,
        out_s2: i64,
        out_s3: i64,
        op: i32,
        t: i32,
        hk: i32,
        hv: i32,
        dk: i32,
        dv: i32,
        tv: i32,
        tiles: i32,
        auto_commit: i32,
        l2norm: i32,
        scale: f32,
        pad: i32,
        skip: u64,
        gate: u64,
        a: u64,
        dt_bias: u64,
        skip_s0: i64,
        gate_s0: i64,
        gate_s2: i64,
        gate_s3: i64,
        a_s0: i64,
        dt_bias_s0: i64,
        dt_min: f32,
        dt_max: f32,
        ids_inline: [i32; KVR_GDN_MAX_INLINE],
    }

    /// `kvr_gdn_recur1[n]_d<dk>_r<rows>`: the one-token f32 form of the recurrent step.
    struct GdnRecur1Args = "kvr_gdn_recur1_args" {
        q: u64,
        k: u64,
        v: u64,
        g: u64,
        beta: u64,
        state_in: u64,
        out: u64,
        state_out: u64,
        si: [i64; 3],
        so: [i64; 3],
        qs: [i32; 2],
        ks: [i32; 2],
        vs: [i32; 3],
        ys: [i32; 3],
        gs: [i32; 2],
        bs: [i32; 2],
        hq: i32,
        kh_div: i32,
        tiled: i32,
        l2norm: i32,
        scale: f32,
        l2norm_eps: f32,
    }
}

/// The kernels' code for a dtype (`KVR_DT_*`); i32 travels as f32 (4-byte bit copies).
pub(crate) fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 | DType::I32 => KVR_DT_F32,
        DType::F16 => KVR_DT_F16,
        DType::BF16 => KVR_DT_BF16,
    }
}

/// `kvr_kv_decode_smem_layout(head_dim, elem, _).stage_bytes`: one decode pipeline stage,
/// the K and the V tile (rows swizzled when the head dim is a multiple of 64, else padded
/// by 16 bytes).
pub(crate) fn kv_decode_stage_bytes(head_dim: usize, elem: usize) -> usize {
    let row_stride = if head_dim % 64 == 0 {
        head_dim
    } else {
        head_dim + 8
    };
    2 * KVR_KV_DECODE_TILE * row_stride * elem
}

/// `kvr_kv_decode_smem_layout(head_dim, elem, stages).total`: dynamic shared memory of the
/// decode kernel.
pub(crate) fn kv_decode_smem_bytes(head_dim: usize, elem: usize, stages: usize) -> usize {
    let q = 16 * (head_dim + 8) * elem;
    let merge = 16 * (head_dim + 8) * 4; // rows padded by 8 floats
    let offsets = KVR_KV_DECODE_TILE * 2 * 8;
    let softmax_state = (4 * 16 * 2 + 32) * 4;
    let barriers = stages * 2 * 8;
    let scan = 16 * 8;
    stages * kv_decode_stage_bytes(head_dim, elem)
        + q
        + merge
        + offsets
        + softmax_state
        + barriers
        + scan
}

/// `KVR_KV_SDECODE_GROUPS(head_dim)`: groups of 4 warps per CTA of the short-batch kernels.
pub(crate) fn kv_split_decode_groups(head_dim: usize) -> usize {
    if head_dim <= 128 {
        2
    } else {
        1
    }
}

/// `kvr_kv_decode_smem_layout(head_dim, elem, stages).split_total` (`groups` 1) or
/// `.split2_total` (2): dynamic shared memory of the short-batch kernels: the stage area (each
/// group's K/V stages, at least 4 combine slots per group and a partial of 16 rows of
/// head_dim + 8 floats), Q staging, each group's row offsets of each stage, the softmax state
/// of the warps and a flag.
pub(crate) fn kv_split_decode_smem_bytes(
    head_dim: usize,
    elem: usize,
    stages: usize,
    groups: usize,
) -> usize {
    let merge = 16 * (head_dim + 8) * 4;
    let area =
        (groups * stages * kv_decode_stage_bytes(head_dim, elem)).max((4 * groups + 1) * merge);
    let q = 16 * (head_dim + 8) * elem;
    let offsets = groups * stages * KVR_KV_DECODE_TILE * 2 * 8;
    let softmax_state = (4 * groups * 16 * 2 + 32) * 4;
    area + q + offsets + softmax_state + 16
}

/// `kvr_gdn_step_smem_layout(dk, tv, t, hmax).total`: dynamic shared memory of one GDN step
/// launch (`t` tokens: 1 for a flush or export).
pub(crate) fn gdn_step_smem_bytes(dk: usize, tv: usize, t: usize, hmax: usize) -> u32 {
    let round4 = |x: usize| x.div_ceil(4) * 4;
    // xs, hist, vrow + urow, coefficients (A, B, then 128 for the decays and betas), kc, uc,
    // cx, ga + gb, red (8 warps x 2 x tv).
    let floats = 2 * t * dk
        + 2 * t * tv
        + 2 * t * tv
        + 2 * KVR_GDN_MAX_T * KVR_GDN_MAX_T
        + 128
        + KVR_GDN_CHUNK * dk
        + KVR_GDN_CHUNK * tv
        + 2 * t * KVR_GDN_CHUNK
        + 2 * round4(hmax)
        + (KVR_GDN_THREADS as usize / 32) * 2 * tv;
    // Plus the double-buffered raw entry chunks (f32 entries at most).
    let raw = 2 * KVR_GDN_CHUNK * (dk + tv) * 4;
    (floats * 4 + raw) as u32
}

/// `kvr_gdn_decode_smem_layout(hmax).total`: decays and the two key dot products of every
/// buffered entry (kernels/gdn_decode.cu).
pub(crate) fn gdn_decode_smem_bytes(hmax: usize) -> u32 {
    (4 * 3 * hmax) as u32
}

/// `kvr_gdn_stream_smem_layout(..).total`: dynamic shared memory of one streaming decode CTA
/// (kernels/gdn_stream.cu): `stages` state tiles (K-major key rows padded by 16 bytes), the
/// tile's ring rows, then qs, ks [dk]; sq, sk, us [rows]; aq, ak, wg, gs [max(L, 1)]; 32 words.
pub(crate) fn gdn_stream_smem_bytes(
    vmajor: bool,
    dk: usize,
    rows: usize,
    state_es: usize,
    ring_len: usize,
    entry_es: usize,
    stages: usize,
) -> usize {
    let align16 = |x: usize| x.div_ceil(16) * 16;
    let st = if vmajor {
        rows * dk * state_es
    } else {
        dk * (rows * state_es + 16)
    };
    let ut = align16(ring_len * rows * entry_es);
    stages * align16(st) + ut + 4 * (2 * dk + 3 * rows + 4 * ring_len.max(1)) + 4 * 32
}

/// Dynamic shared memory of one streaming verify CTA at `t` drafts
/// (`kvr_gdn_verify_smem_layout`, kernels/gdn_sverify.cu): the state tile (padded rows), the
/// tile's ring rows, then qs, ks [t][dk + 4]; sq, sk, vt [t][rows]; aq, ak [t][L]; wg, gs [L]; two [t][t]
/// coefficient blocks and 3 [t]; 32 words.
pub(crate) fn gdn_verify_smem_bytes(
    vmajor: bool,
    dk: usize,
    rows: usize,
    state_es: usize,
    ring_len: usize,
    entry_es: usize,
    t: usize,
) -> usize {
    let align16 = |x: usize| x.div_ceil(16) * 16;
    let st = if vmajor {
        rows * (dk * state_es + 16)
    } else {
        dk * (rows * state_es + 16)
    };
    let l = ring_len.max(1);
    align16(st)
        + align16(ring_len * rows * entry_es)
        + 4 * (2 * t * (dk + 4) + 3 * t * rows + 2 * t * l + 2 * l + 2 * t * t + 3 * t)
        + 4 * 32
}

/// Floats of one (row, key head) record of the verify scratch (`kvr_gdn_vprep_record_layout`).
pub(crate) fn gdn_vprep_floats(dk: usize, ring_len: usize, max_drafts: usize) -> usize {
    (2 * max_drafts * (dk + ring_len.max(1) + max_drafts)).div_ceil(4) * 4
}

/// `kvr_gdn_dscratch_layout(b, hv, hk, dk, dv, l).total`: floats of the warp-streaming
/// decode's scratch for `b` batch rows.
pub(crate) fn gdn_dscratch_floats(
    b: usize,
    (hv, hk): (usize, usize),
    (dk, dv): (usize, usize),
    l: usize,
) -> usize {
    let rec = (4 + 3 * l.max(1)).div_ceil(4) * 4;
    4 * b + b * hv * rec + 3 * b * hk * dk + b * hv * dv
}

/// `kvr_gdn_wvrec_layout(tm).floats`: floats of one (row, value head) record of the
/// warp-streaming verify's scratch.
pub(crate) fn gdn_wvrec_floats(max_drafts: usize) -> usize {
    let tm = max_drafts;
    (8 + 2 * tm + 2 * tm * tm).div_ceil(4) * 4 + (2 * tm + 1) * KVR_GDN_WVERIFY_MAX_RING
}

/// `kvr_gdn_wvscratch_layout(b, hv, hk, dk, tm).total`: floats of the warp-streaming verify's
/// scratch for `b` batch rows.
pub(crate) fn gdn_wvscratch_floats(
    b: usize,
    (hv, hk): (usize, usize),
    dk: usize,
    max_drafts: usize,
) -> usize {
    3 * b * hk * max_drafts * dk + b * hv * gdn_wvrec_floats(max_drafts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// What the test reads from kernels/kvr_abi.h.
    struct Header {
        /// (typedef name, fields (name, C type)), in order.
        structs: Vec<(String, Vec<(String, String)>)>,
        /// Constant names, in order.
        consts: Vec<String>,
    }

    fn strip_comments(src: &str) -> String {
        let mut out = String::with_capacity(src.len());
        let mut rest = src;
        loop {
            let block = rest.find("/*");
            let line = rest.find("//");
            match (block, line) {
                (Some(b), l) if l.is_none_or(|l| b < l) => {
                    out.push_str(&rest[..b]);
                    let end = rest[b..].find("*/").expect("unterminated /* comment") + b + 2;
                    // Keep line structure for the #define parser.
                    out.extend(rest[b..end].chars().filter(|&c| c == '\n'));
                    out.push(' ');
                    rest = &rest[end..];
                }
                (_, Some(l)) => {
                    out.push_str(&rest[..l]);
                    rest = &rest[l..];
                    rest = rest.find('\n').map_or("", |n| &rest[n..]);
                }
                (None, None) => {
                    out.push_str(rest);
                    return out;
                }
                (Some(_), None) => unreachable!(),
            }
        }
    }

    fn is_ident(s: &str) -> bool {
        !s.is_empty()
            && !s.starts_with(|c: char| c.is_ascii_digit())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    /// Parses the restricted syntax described at the top of kvr_abi.h; anything it does not
    /// understand is an error rather than something skipped.
    fn parse_header(text: &str) -> Header {
        let src = strip_comments(text);
        let mut structs = Vec::new();
        let mut rest = src.as_str();
        while let Some(at) = rest.find("typedef") {
            let after = rest[at + "typedef".len()..].trim_start();
            let body_start = after
                .strip_prefix("struct")
                .map(str::trim_start)
                .and_then(|s| s.strip_prefix('{'))
                .unwrap_or_else(|| {
                    panic!(
                        "kvr_abi.h: only `typedef struct {{ ... }} kvr_x;` is understood, near `{}`",
                        &after[..after.len().min(60)]
                    )
                });
            let close = body_start
                .find('}')
                .expect("kvr_abi.h: unterminated struct");
            let body = &body_start[..close];
            let semi = body_start[close..]
                .find(';')
                .expect("kvr_abi.h: struct without ;");
            let name = body_start[close + 1..close + semi].trim().to_string();
            assert!(
                name.starts_with("kvr_") && is_ident(&name),
                "kvr_abi.h: struct name `{name}`"
            );
            let mut fields = Vec::new();
            for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
                let (ty, declarators) = if let Some(inner) = decl.strip_prefix("KVR_PTR(") {
                    let close = inner.find(')').expect("KVR_PTR( without )");
                    (format!("KVR_PTR({})", &inner[..close]), &inner[close + 1..])
                } else {
                    let split = decl
                        .find(char::is_whitespace)
                        .unwrap_or_else(|| panic!("kvr_abi.h: field `{decl}` in {name}"));
                    (decl[..split].to_string(), &decl[split..])
                };
                for d in declarators.split(',').map(str::trim) {
                    let field = d.split('[').next().expect("a name").trim();
                    assert!(
                        is_ident(field),
                        "kvr_abi.h: cannot read field `{d}` of {name}"
                    );
                    fields.push((field.to_string(), ty.clone()));
                }
            }
            structs.push((name, fields));
            rest = &body_start[close + semi..];
        }
        let mut consts = Vec::new();
        for line in src.lines().map(str::trim) {
            let Some(def) = line.strip_prefix("#define") else {
                continue;
            };
            let mut parts = def.split_whitespace();
            let name = parts.next().expect("#define without a name");
            let value: Vec<&str> = parts.collect();
            if name.contains('(') || matches!(name, "KVR_ABI_H" | "KVR_ABI_FN") {
                continue; // KVR_PTR(T), the include guard, the function qualifiers
            }
            assert!(
                name.starts_with("KVR_") && is_ident(name) && !value.is_empty(),
                "kvr_abi.h: `#define {name}` is neither a KVR_ constant nor a known macro"
            );
            consts.push(name.to_string());
        }
        Header { structs, consts }
    }

    /// The Rust spelling of a C field type's element (arrays compare by size).
    fn rust_type_of(c_ty: &str) -> String {
        match c_ty {
            "int32_t" => "i32".into(),
            "uint32_t" => "u32".into(),
            "int64_t" => "i64".into(),
            "uint64_t" => "u64".into(),
            "float" => "f32".into(),
            t if t.starts_with("KVR_PTR(") => "u64".into(),
            t => STRUCTS
                .iter()
                .find(|s| s.c == t)
                .map_or_else(|| format!("<no Rust mirror of {t}>"), |s| s.rust.into()),
        }
    }

    /// `[T; N]` -> `T`, `T` -> `T`.
    fn element_type(rust_ty: &str) -> &str {
        rust_ty
            .strip_prefix('[')
            .and_then(|t| t.split(';').next())
            .unwrap_or(rust_ty)
            .trim()
    }

    /// A size formula of the header, its Rust port and the grid it is compared over.
    struct Formula {
        c_fn: &'static str,
        c_type: &'static str,
        c_fields: &'static [&'static str],
        grid: Vec<Vec<i64>>,
        rust: fn(&[i64]) -> Vec<i64>,
    }

    fn grid(axes: &[&[i64]]) -> Vec<Vec<i64>> {
        axes.iter().fold(vec![Vec::new()], |acc, axis| {
            acc.iter()
                .flat_map(|prefix| {
                    axis.iter().map(move |&x| {
                        let mut v = prefix.clone();
                        v.push(x);
                        v
                    })
                })
                .collect()
        })
    }

    fn u(x: i64) -> usize {
        x as usize
    }

    fn formulas() -> Vec<Formula> {
        vec![
            Formula {
                c_fn: "kvr_kv_decode_smem_layout",
                c_type: "kvr_kv_decode_smem",
                c_fields: &["stage_bytes", "total", "split_total", "split2_total"],
                grid: grid(&[
                    &[32, 64, 80, 96, 112, 128, 160, 192, 256],
                    &[2, 4],
                    &[1, 2, 3, 4, 5, 6, 7, 8],
                ]),
                rust: |a| {
                    vec![
                        kv_decode_stage_bytes(u(a[0]), u(a[1])) as i64,
                        kv_decode_smem_bytes(u(a[0]), u(a[1]), u(a[2])) as i64,
                        kv_split_decode_smem_bytes(u(a[0]), u(a[1]), u(a[2]), 1) as i64,
                        kv_split_decode_smem_bytes(u(a[0]), u(a[1]), u(a[2]), 2) as i64,
                    ]
                },
            },
            Formula {
                c_fn: "kvr_gdn_step_smem_layout",
                c_type: "kvr_gdn_step_smem",
                c_fields: &["total"],
                grid: grid(&[
                    &[32, 64, 128, 256],
                    &[8, 16, 32, 64, 128, 256],
                    &[1, 2, 3, 5, 8],
                    &[0, 1, 3, 4, 17, 64, 257, 1024],
                ]),
                rust: |a| vec![gdn_step_smem_bytes(u(a[0]), u(a[1]), u(a[2]), u(a[3])) as i64],
            },
            Formula {
                c_fn: "kvr_gdn_decode_smem_layout",
                c_type: "kvr_gdn_decode_smem",
                c_fields: &["total"],
                grid: grid(&[&[0, 1, 7, 64, 1000, 4096]]),
                rust: |a| vec![gdn_decode_smem_bytes(u(a[0])) as i64],
            },
            Formula {
                c_fn: "kvr_gdn_stream_smem_layout",
                c_type: "kvr_gdn_stream_smem",
                c_fields: &["total"],
                grid: grid(&[
                    &[0, 1],
                    &[32, 64, 128, 256],
                    &[16, 32, 64, 128],
                    &[2, 4],
                    &[0, 1, 5, 16, 64, 100],
                    &[2, 4],
                    &[1, 2],
                ]),
                rust: |a| {
                    let (vm, dk, rows, es, l, ee, st) =
                        (a[0] != 0, a[1], a[2], a[3], a[4], a[5], a[6]);
                    vec![
                        gdn_stream_smem_bytes(vm, u(dk), u(rows), u(es), u(l), u(ee), u(st)) as i64,
                    ]
                },
            },
            Formula {
                c_fn: "kvr_gdn_verify_smem_layout",
                c_type: "kvr_gdn_verify_smem",
                c_fields: &["total"],
                grid: grid(&[
                    &[0, 1],
                    &[32, 64, 128, 256],
                    &[16, 32, 64, 128],
                    &[2, 4],
                    &[1, 5, 16, 64, 100],
                    &[2, 4],
                    &[1, 2, 3, 5, 8],
                ]),
                rust: |a| {
                    let (vm, dk, rows, es, l, ee, t) =
                        (a[0] != 0, a[1], a[2], a[3], a[4], a[5], a[6]);
                    vec![gdn_verify_smem_bytes(vm, u(dk), u(rows), u(es), u(l), u(ee), u(t)) as i64]
                },
            },
            Formula {
                c_fn: "kvr_gdn_vprep_record_layout",
                c_type: "kvr_gdn_vprep_record",
                c_fields: &["floats"],
                grid: grid(&[
                    &[32, 64, 128, 256],
                    &[0, 1, 5, 16, 64, 1024],
                    &[1, 2, 3, 5, 8],
                ]),
                rust: |a| vec![gdn_vprep_floats(u(a[0]), u(a[1]), u(a[2])) as i64],
            },
            Formula {
                c_fn: "kvr_gdn_wvrec_layout",
                c_type: "kvr_gdn_wvrec",
                c_fields: &["floats"],
                grid: grid(&[&[1, 2, 3, 4, 5, 8]]),
                rust: |a| vec![gdn_wvrec_floats(u(a[0])) as i64],
            },
            Formula {
                c_fn: "kvr_gdn_wvscratch_layout",
                c_type: "kvr_gdn_wvscratch",
                c_fields: &["rec_floats", "total"],
                grid: grid(&[
                    &[1, 7, 128],
                    &[4, 32, 128],
                    &[1, 8, 16],
                    &[64, 128],
                    &[1, 4, 8],
                ]),
                rust: |a| {
                    let (heads, dk, tm) = ((u(a[1]), u(a[2])), u(a[3]), u(a[4]));
                    vec![
                        gdn_wvrec_floats(tm) as i64,
                        gdn_wvscratch_floats(u(a[0]), heads, dk, tm) as i64,
                    ]
                },
            },
            Formula {
                c_fn: "kvr_gdn_dscratch_layout",
                c_type: "kvr_gdn_dscratch",
                c_fields: &["total"],
                grid: grid(&[
                    &[1, 7, 512],
                    &[4, 32, 128],
                    &[1, 16],
                    &[64, 128, 256],
                    &[32, 64, 128],
                    &[0, 1, 16, 32],
                ]),
                rust: |a| {
                    let (heads, dims) = ((u(a[1]), u(a[2])), (u(a[3]), u(a[4])));
                    vec![gdn_dscratch_floats(u(a[0]), heads, dims, u(a[5])) as i64]
                },
            },
        ]
    }

    /// The C program: every struct's size and alignment, every field's offset and size,
    /// every constant, every formula over its grid.
    fn c_program(h: &Header, formulas: &[Formula]) -> String {
        let mut c = String::from(
            "#include <stddef.h>\n#include <stdio.h>\n#include \"kvr_abi.h\"\n\
             #define FIELD(T, f) printf(\"field %s %s %zu %zu\\n\", #T, #f, offsetof(T, f), sizeof(((T*)0)->f))\n\
             int main(void) {\n",
        );
        for (name, fields) in &h.structs {
            writeln!(
                c,
                "  printf(\"struct {name} %zu %zu\\n\", sizeof({name}), _Alignof({name}));"
            )
            .unwrap();
            for (f, _) in fields {
                writeln!(c, "  FIELD({name}, {f});").unwrap();
            }
        }
        for k in &h.consts {
            writeln!(c, "  printf(\"const {k} %lld\\n\", (long long)({k}));").unwrap();
        }
        for f in formulas {
            for args in &f.grid {
                let list = args.iter().map(i64::to_string).collect::<Vec<_>>();
                let fmt = vec!["%lld"; f.c_fields.len()].join(" ");
                let vals = f
                    .c_fields
                    .iter()
                    .map(|x| format!("(long long)r.{x}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                writeln!(
                    c,
                    "  {{ const struct {} r = {}({}); printf(\"formula {} {} = {fmt}\\n\", {vals}); }}",
                    f.c_type,
                    f.c_fn,
                    list.join(", "),
                    f.c_fn,
                    list.join(" ")
                )
                .unwrap();
            }
        }
        c.push_str("  return 0;\n}\n");
        c
    }

    /// Compiles and runs the program with the system C compiler (C11, warnings as errors).
    fn run_c(program: &str, include: &Path) -> String {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("kvr-abi-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = dir.join("abi_check.c");
        let exe = dir.join("abi_check");
        std::fs::write(&src, program).expect("write the C program");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I"])
            .arg(include)
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "the kernel ABI check compiles kernels/kvr_abi.h with the system C compiler, \
                     but `{cc}` cannot be run ({e}); install one or set CC"
                )
            });
        assert!(
            out.status.success(),
            "`{cc}` failed on kernels/kvr_abi.h (program kept in {}):\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let run = Command::new(&exe)
            .output()
            .expect("run the ABI check program");
        assert!(run.status.success(), "the ABI check program failed");
        std::fs::remove_dir_all(&dir).ok();
        String::from_utf8(run.stdout).expect("ASCII output")
    }

    /// Every difference between the header (as compiled by C) and this module's tables.
    fn compare(h: &Header, c_out: &str, formulas: &[Formula]) -> Vec<String> {
        let mut errs = Vec::new();
        let mut c_structs: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        let mut c_fields: BTreeMap<(&str, &str), (usize, usize)> = BTreeMap::new();
        let mut c_consts: BTreeMap<&str, i64> = BTreeMap::new();
        let mut c_formulas: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for line in c_out.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            let num = |s: &str| s.parse::<i64>().expect("a number");
            match w[0] {
                "struct" => {
                    c_structs.insert(w[1], (num(w[2]) as usize, num(w[3]) as usize));
                }
                "field" => {
                    c_fields.insert((w[1], w[2]), (num(w[3]) as usize, num(w[4]) as usize));
                }
                "const" => {
                    c_consts.insert(w[1], num(w[2]));
                }
                "formula" => {
                    let eq = line.find(" = ").expect("formula line");
                    let vals = line[eq + 3..].split_whitespace().map(num).collect();
                    c_formulas.insert(line[..eq].to_string(), vals);
                }
                _ => panic!("unexpected output line `{line}`"),
            }
        }

        // The same structs, in the same order.
        let c_names: Vec<&str> = h.structs.iter().map(|(n, _)| n.as_str()).collect();
        let r_names: Vec<&str> = STRUCTS.iter().map(|s| s.c).collect();
        for n in &c_names {
            if !r_names.contains(n) {
                errs.push(format!("struct {n}: in kvr_abi.h, no mirror in src/abi.rs"));
            }
        }
        for n in &r_names {
            if !c_names.contains(n) {
                errs.push(format!("struct {n}: in src/abi.rs, not in kvr_abi.h"));
            }
        }
        for s in STRUCTS {
            let Some((_, fields)) = h.structs.iter().find(|(n, _)| n == s.c) else {
                continue;
            };
            let (size, align) = c_structs[s.c];
            if (size, align) != (s.size, s.align) {
                errs.push(format!(
                    "struct {} ({}): C size {size} align {align}, Rust size {} align {}",
                    s.c, s.rust, s.size, s.align
                ));
            }
            let total: usize = s.fields.iter().map(|f| f.size).sum();
            if total != s.size {
                errs.push(format!(
                    "struct {}: fields cover {total} of {} bytes (implicit padding: add explicit pad fields)",
                    s.c, s.size
                ));
            }
            let c_order: Vec<&str> = fields.iter().map(|(f, _)| f.as_str()).collect();
            let r_order: Vec<&str> = s.fields.iter().map(|f| f.name).collect();
            if c_order != r_order {
                errs.push(format!(
                    "struct {}: fields differ\n    C:    {}\n    Rust: {}",
                    s.c,
                    c_order.join(", "),
                    r_order.join(", ")
                ));
            }
            for f in s.fields {
                let Some((_, c_ty)) = fields.iter().find(|(n, _)| n == f.name) else {
                    continue;
                };
                let (off, size) = c_fields[&(s.c, f.name)];
                if (off, size) != (f.offset, f.size) {
                    errs.push(format!(
                        "{}.{}: C offset {off} size {size}, Rust offset {} size {}",
                        s.c, f.name, f.offset, f.size
                    ));
                }
                let want = rust_type_of(c_ty);
                if element_type(f.ty) != want {
                    errs.push(format!(
                        "{}.{}: C type {c_ty} (Rust {want}), Rust type {}",
                        s.c, f.name, f.ty
                    ));
                }
            }
        }

        // The same constants, with the same values.
        for k in &h.consts {
            match CONSTS.iter().find(|(n, _)| n == k) {
                None => errs.push(format!("constant {k}: in kvr_abi.h, not in src/abi.rs")),
                Some(&(_, v)) if v != c_consts[k.as_str()] => errs.push(format!(
                    "constant {k}: C {}, Rust {v}",
                    c_consts[k.as_str()]
                )),
                _ => {}
            }
        }
        for (k, _) in CONSTS {
            if !h.consts.iter().any(|c| c == k) {
                errs.push(format!("constant {k}: in src/abi.rs, not in kvr_abi.h"));
            }
        }

        // The formulas, bit for bit.
        for f in formulas {
            let mut bad = 0;
            for args in &f.grid {
                let key = format!(
                    "formula {} {}",
                    f.c_fn,
                    args.iter()
                        .map(i64::to_string)
                        .collect::<Vec<_>>()
                        .join(" ")
                );
                let c = &c_formulas[&key];
                let r = (f.rust)(args);
                if *c != r {
                    bad += 1;
                    if bad <= 5 {
                        errs.push(format!(
                            "{}({args:?}) {:?}: C {c:?}, Rust {r:?}",
                            f.c_fn, f.c_fields
                        ));
                    }
                }
            }
            if bad > 5 {
                errs.push(format!("{}: {} more mismatches", f.c_fn, bad - 5));
            }
        }
        errs
    }

    #[test]
    fn rust_mirrors_match_kvr_abi_h() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let text = std::fs::read_to_string(dir.join("kvr_abi.h")).expect("read kernels/kvr_abi.h");
        let header = parse_header(&text);
        assert!(header.structs.len() >= 12 && header.consts.len() >= 40);
        let formulas = formulas();
        let out = run_c(&c_program(&header, &formulas), &dir);
        let errs = compare(&header, &out, &formulas);
        assert!(
            errs.is_empty(),
            "kernels/kvr_abi.h and src/abi.rs disagree:\n  {}",
            errs.join("\n  ")
        );
    }

    #[test]
    fn the_parser_reads_the_restricted_syntax() {
        let h = parse_header(
            "/* a */ #define KVR_A 3 // b\n#define KVR_ABI_FN static inline\n#define KVR_PTR(T) T*\n\
             typedef struct {\n  KVR_PTR(const int32_t) p; // c\n  int32_t a, b[KVR_A];\n  kvr_y y;\n} kvr_x;\n\
             struct kvr_z_smem { int32_t total; };\n",
        );
        assert_eq!(h.consts, ["KVR_A"]);
        assert_eq!(h.structs.len(), 1);
        let (name, fields) = &h.structs[0];
        assert_eq!(name, "kvr_x");
        let f: Vec<(&str, &str)> = fields
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(
            f,
            [
                ("p", "KVR_PTR(const int32_t)"),
                ("a", "int32_t"),
                ("b", "int32_t"),
                ("y", "kvr_y")
            ]
        );
    }

    #[test]
    fn launch_params_fit_the_launch_limit() {
        for s in STRUCTS {
            assert!(s.size <= 4096, "{}: {} bytes", s.c, s.size);
        }
    }
}
