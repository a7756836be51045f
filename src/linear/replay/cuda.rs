//! The CUDA executor of every replay pool: device state and launches (kernels/gdn.cu,
//! gdn_decode.cu, gdn_stream.cu, gdn_sverify.cu; every rule of `plan.rs`).
//!
//! Everything a launch needs travels in its parameters (sequence ids and host accepted
//! counts inline, in chunks), so decode, verify, commit and flush are asynchronous, need
//! no staging memory and can be captured in a CUDA Graph; flush decisions and cursor
//! moves are made by the kernels from the device metadata.

use std::ffi::c_void;
use std::sync::Arc;

use crate::abi::{
    dtype_code as code, gdn_decode_smem_bytes, gdn_step_smem_bytes as smem_bytes,
    GdnCommitArgs as CommitParams, GdnFDecodeArgs as FDecodeArgs, GdnLayerState as LayerState,
    GdnStepArgs as StepParams, GdnTensor as DevTensor, KVR_GDN_COMMIT_THREADS,
    KVR_GDN_DECODE_MAX_WARPS, KVR_GDN_DECODE_ROWS_PER_WARP, KVR_GDN_DT_GATE, KVR_GDN_DT_NONE,
    KVR_GDN_DT_SOFTPLUS, KVR_GDN_FINISH_THREADS as FINISH_THREADS,
    KVR_GDN_MAX_COMMIT_INLINE as MAX_COMMIT_INLINE, KVR_GDN_MAX_INLINE as MAX_INLINE,
    KVR_GDN_MAX_NV as MAX_NV, KVR_GDN_NARROW_NV as NARROW_NV, KVR_GDN_OP_EXPORT as OP_EXPORT,
    KVR_GDN_OP_FLUSH as OP_FLUSH, KVR_GDN_OP_STEP as OP_STEP, KVR_GDN_RULE_ADDITIVE,
    KVR_GDN_RULE_DELTA, KVR_GDN_STREAM_THREADS as STREAM_THREADS, KVR_GDN_THREADS as THREADS,
};
use crate::abi::{
    gdn_dscratch_floats, gdn_wvrec_floats, gdn_wvscratch_floats,
    KVR_GDN_DPREP_THREADS as DPREP_THREADS, KVR_GDN_KVDEC_THREADS, KVR_GDN_KVERIFY_FLUSH_SLOTS,
    KVR_GDN_KVONLY_MAX, KVR_GDN_KVONLY_THREADS, KVR_GDN_WDECODE_MAX_RING, KVR_GDN_WDECODE_ROWS,
    KVR_GDN_WREC_ROWS, KVR_GDN_WVERIFY_MAX_RING, KVR_GDN_WVPREP_THREADS, KVR_GDN_WVPREP_W4_DRAFTS,
};
use crate::backend::cuda::memory::DeviceBuffer;
use crate::backend::cuda::module::{
    FdSpec, Kernel, GDN_DECODE_DKS, GDN_KVDEC_SHAPES, GDN_WVERIFY_DKS,
};
use crate::backend::cuda::patch::patch_i32;
use crate::backend::cuda::CudaBackend;
use crate::backend::Stream;
use crate::error::{Error, Result};
use crate::linear::math::StateLayout;
use crate::linear::replay::meta::{
    self, Meta, META_CONV_END, META_H, META_INTS, META_MODE, META_PENDING, META_START,
};
use crate::linear::replay::plan::{Rule, StepPlan};
use crate::linear::replay::{Commit, Executor, Layout, ReplayConfig, Step, MAX_DRAFTS};
use crate::pool::BatchIds;
use crate::tensor::{DType, MemoryKind, TensorView};

/// Value rows per CTA of the decode kernel at most.
const DECODE_MAX_ROWS: usize = KVR_GDN_DECODE_MAX_WARPS * KVR_GDN_DECODE_ROWS_PER_WARP;
/// Dynamic shared memory the step kernels may use (the largest valid configuration needs
/// about 100 KiB; see `smem_bytes`).
const STEP_SMEM_LIMIT: u32 = 112 * 1024;
/// Dynamic shared memory one CTA may have on sm_80 / sm_90 (227 KiB).
const STREAM_SMEM_LIMIT: usize = 227 * 1024;
/// Value rows per CTA the streaming decode kernel takes, widest first (V-major takes 16
/// too, K-major needs 32).
const STREAM_ROWS: [usize; 4] = [128, 64, 32, 16];

/// A view as a kernel tensor argument (strides padded to 4 dims), shifted by `row0` rows
/// of its first dimension.
fn dev_tensor(t: &TensorView, row0: usize) -> DevTensor {
    let mut s = [0i64; 4];
    for (i, &x) in t.strides().iter().enumerate().take(4) {
        s[i] = x as i64;
    }
    let shift = row0 as i64 * s[0] * t.dtype().size() as i64;
    DevTensor {
        p: (t.addr() as i64 + shift) as u64,
        s,
        dtype: code(t.dtype()),
        pad: 0,
    }
}

/// The plan's per-token scalars, skip, gate and rule, rows from `b0` on.
fn plan_args(p: &mut StepParams, plan: &StepPlan, b0: usize) {
    let opt = |t: &Option<TensorView>, shift: usize| {
        t.as_ref()
            .map_or(DevTensor::default(), |t| dev_tensor(t, shift))
    };
    p.g = opt(&plan.g, b0);
    p.beta = opt(&plan.beta, b0);
    p.gate = opt(&plan.gate, b0);
    p.skip = opt(&plan.skip, 0);
    p.rule = match plan.rule {
        Rule::Delta => KVR_GDN_RULE_DELTA,
        Rule::Additive => KVR_GDN_RULE_ADDITIVE,
    };
    if let Some(dt) = &plan.dt {
        p.dt_mode = if dt.softplus {
            KVR_GDN_DT_SOFTPLUS
        } else {
            KVR_GDN_DT_GATE
        };
        p.a = dev_tensor(&dt.a, 0);
        p.dt_bias = opt(&dt.bias, 0);
        p.dt_min = dt.min;
        p.dt_max = dt.max;
    }
}

/// A streaming kernel's shared memory for this pool: `formula` (one of kvr_abi.h's layouts,
/// ported in src/abi.rs) at `rows` value rows per CTA and its last argument `x`.
fn pool_smem(
    cfg: &ReplayConfig,
    rows: usize,
    x: usize,
    formula: fn(bool, usize, usize, usize, usize, usize, usize) -> usize,
) -> usize {
    formula(
        cfg.layout == StateLayout::VMajor,
        cfg.dk,
        rows,
        cfg.state_dtype.size(),
        cfg.ring_len,
        cfg.entry_dtype.size(),
        x,
    )
}

/// Shared memory of one streaming decode CTA (`kvr_gdn_stream_smem_layout`).
fn stream_smem_bytes(cfg: &ReplayConfig, rows: usize, stages: usize) -> usize {
    pool_smem(cfg, rows, stages, crate::abi::gdn_stream_smem_bytes)
}

/// The streaming verify kernel of a rule (the additive one is compiled apart, for four
/// resident CTAs per SM instead of three).
fn verify_kernel(cfg: &ReplayConfig, additive: bool) -> Kernel {
    Kernel::GdnVerify {
        state: cfg.state_dtype,
        vmajor: cfg.layout == StateLayout::VMajor,
        dk: cfg.dk,
        additive,
    }
}

/// Shared memory of one streaming verify CTA at `t` drafts (`kvr_gdn_verify_smem_layout`).
fn sverify_smem_bytes(cfg: &ReplayConfig, rows: usize, t: usize) -> usize {
    pool_smem(cfg, rows, t, crate::abi::gdn_verify_smem_bytes)
}

/// Scratch of the verify kernels: at most this many bytes, in launches of fewer rows.
const VERIFY_SCRATCH_MAX: usize = 64 << 20;

/// Value rows per CTA the kernels accept for these head dims: every thread holds 1..=8
/// float4 vectors and V-major rows have at most 32 threads.
fn tile_range(dk: usize, dv: usize) -> Option<(usize, usize)> {
    let lo = 8usize.max(1024 / dk);
    // At most 128 rows: K-major rows then have one partial per warp (kernels/gdn.cu).
    let hi = dv.min(MAX_NV * 4 * THREADS as usize / dk).min(128);
    (lo <= hi).then_some((lo, hi))
}

/// The CUDA executor of a replay pool.
pub(crate) struct ReplayCuda {
    cuda: Arc<CudaBackend>,
    lay: Layout,
    /// Per-(sequence, value head) arrival counters for the KV-only transition.
    sync: DeviceBuffer,
    /// Per-layer state address and stride (for the commit kernel).
    layers: DeviceBuffer,
    sm_count: u32,
    tiles: (usize, usize),
    forced_tile: Option<usize>,
    /// Value rows per CTA of the single-token decode kernel (kernels/gdn_decode.cu), or
    /// `None` where it does not apply (dk outside `GDN_DECODE_DKS`, or disabled).
    decode_rows: Option<usize>,
    /// (value rows per CTA, resident CTAs per SM) the streaming decode kernel
    /// (kernels/gdn_stream.cu) may use for this pool, widest first; empty where it does not
    /// apply (KV-only pools, other dk, states not 16-byte aligned, or disabled).
    stream_rows: Vec<StreamWidth>,
    /// KVR_GDN_STREAM_ROWS: forced rows per CTA of the streaming kernel (benchmarking).
    forced_stream_rows: Option<usize>,
    /// KVR_GDN_STREAM_PERSIST=1: persistent CTAs with two state tiles (benchmarking; one
    /// item per CTA measured faster on the H200, BENCHMARKS.md).
    stream_persistent: bool,
    /// Batch rows (per launch) for which the streaming kernel is used.
    stream_batches: std::ops::Range<usize>,
    /// (value rows per CTA, resident CTAs per SM at `max_drafts`) the streaming verify
    /// kernel (kernels/gdn_sverify.cu) may use, widest first; empty where it does not apply
    /// (recurrent or KV-only pools, other dk, unaligned states, KVR_GDN_VERIFY=general).
    verify_rows: [Vec<(usize, [usize; MAX_DRAFTS + 1])>; 2],
    /// The warp-streaming verify (kernels/gdn_wverify.cu), where it applies; else
    /// `verify_rows` picks the streaming verify.
    wverify: Option<WVerify>,
    /// The verify kernels' records (per (row, key head), and per (row, value head) for the
    /// warp-streaming verify), for `verify_chunk` rows a launch.
    scratch: Option<DeviceBuffer>,
    verify_chunk: usize,
    /// KVR_GDN_VERIFY_ROWS: forced rows per CTA of the verify kernel (benchmarking).
    forced_verify_rows: Option<usize>,
    /// The verify kernel as a programmatic dependent of its prep (KVR_GDN_VERIFY_PDL=0: not).
    verify_pdl: bool,
    /// The warp-streaming decode (kernels/gdn_wdecode.cu), where it applies.
    wdecode: Option<WDecode>,
    /// The KV-only path of a pool with KV-only mode (kernels/gdn_kvonly.cuh): this kernel
    /// before the single-token decode kernel, or inside it (`kvonly_inkernel_rows`);
    /// None: the decode kernel's per-tile readout (KVR_GDN_KVONLY=0, for benchmarking).
    kvonly: Option<Kernel>,
    /// Up to this many batch rows the decode kernel computes the KV-only rows itself (the
    /// CTA of a head's first tile, `kv_split` 2: one launch fewer), above it the KV-only
    /// kernel runs first (KVR_GDN_KVONLY_ROWS overrides, for benchmarking).
    kvonly_inkernel_rows: usize,
    /// The decode of the KV-only rows of pools with KV-only mode (kernels/gdn_kvdec.cu),
    /// where it applies.
    kvdec: Option<KvDec>,
}

/// The single-token decode of a pool with KV-only mode: `kvr_gdn_kvdec` first (the steps of
/// the rows in KV-only mode, the states of those that reach the threshold), then the
/// warp-streaming decode, which skips the rows still in KV-only mode (`kv_split` 1: the
/// host's bound says some row may be). Both decide from the metadata: a captured graph of
/// the two stays right whatever the rows' modes when it replays.
struct KvDec {
    kernel: Kernel,
    /// Dynamic shared memory of `kernel` at 1, 2, 4 and 8 CTAs per (row, value head);
    /// 0 where that many are not available (a materialization's state rows need enough of
    /// them, one 8-row tile a thread limits them, clusters need sm_90).
    smem: [u32; 4],
    /// KVR_GDN_KVDEC_SPLIT: forced CTAs per (row, value head) (benchmarking).
    forced_split: Option<usize>,
    /// Up to this many batch rows each CTA copies a fixed share of the entries before the
    /// metadata arrives (`p.stages` 1: the launch is a chain of latencies there, and the
    /// bytes past a sequence's entries cost less than a round trip);
    /// KVR_GDN_KVDEC_EARLY_ROWS overrides (benchmarking).
    early_rows: usize,
    /// Up to this many batch rows the CTAs copy, before the metadata arrives, the entries
    /// the host counts (the most of any row that may be KV-only; fewer than the rows hold
    /// when a captured graph replays later, and the rest follow the metadata);
    /// KVR_GDN_KVDEC_GUESS_ROWS overrides (benchmarking).
    guess_rows: usize,
}

impl KvDec {
    /// CTAs per (row, value head) for `rows` batch rows: the fewest available (a power of
    /// two up to 8) that give the launch two CTAs per SM, so that small batches have their
    /// entries in flight on every SM.
    fn split(&self, rows: usize, heads: usize, sm_count: u32) -> usize {
        let ok = |ns: usize| ns <= 8 && self.smem[ns.trailing_zeros() as usize] > 0;
        // (a `KvDec` has some split available)
        let mut ns = 1;
        while !ok(ns) && ns < 8 {
            ns *= 2;
        }
        // A forced split: the nearest available from it upwards.
        if let Some(f) = self.forced_split.filter(|&n| n.is_power_of_two() && n <= 8) {
            while ns < f && ok(2 * ns) {
                ns *= 2;
            }
            return ns;
        }
        let want = 2 * sm_count as usize;
        while rows * heads * ns < want && ok(2 * ns) {
            ns *= 2;
        }
        ns
    }
}

/// A non-negative integer from the environment variable `name` (this file's benchmarking
/// overrides); None where it is unset or not one.
fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
}

/// Batch rows up to which `kvr_gdn_kvdec` copies fixed shares of the entries before the
/// metadata (`KvDec::early_rows`).
const KVDEC_EARLY_ROWS: usize = 2;

/// Batch rows up to which `kvr_gdn_kvdec` copies the entries the host counts before the
/// metadata (`KvDec::guess_rows`): none. Measured on the H200 (BENCHMARKS.md, twenty-ninth
/// session), at up to 16 rows it saved the copy's round trip but its fixed shares left one
/// CTA of a head most of the entries, and B = 8 steps were slower below 124 tokens.
const KVDEC_GUESS_ROWS: usize = 0;

/// Warps per CTA of the warp-streaming decode kernel.
const WDECODE_WARPS: usize = 4;

/// K-major pools take the specialized state kernel below this many batch rows. With the
/// float4-row mapping neither build spills (f32 states); the specialized one measured faster
/// at B = 32 (29.6 against 30.7 us), level at 64 (51.3 / 51.6) and slower from 128 (95.5 /
/// 94.8, B = 256 186.9 / 181.6; H200, BENCHMARKS.md).
const KDECODE_SPEC_ROWS: usize = 64;

/// V-major replay pools: batch rows from which the state kernel loads only the buffered ring
/// slots' u values (`WDecode::live_u_rows`). It reads the metadata for that before the loads;
/// H200 (BENCHMARKS.md, thirty-fourth session): 4 % faster at B = 128 in a kernel A/B program
/// on one pool, but slower in the library's benchmark. Off until measured faster there.
const LIVE_U_ROWS: usize = usize::MAX;
/// Batches of fewer rows launch the decode's prep kernel as a programmatic dependent of the
/// stream's previous kernel (H200, this session's A/B in BENCHMARKS.md, thirty-fifth session:
/// 1-3 % faster steps at B = 8 and 32 in both layouts; at B = 128 0.1-0.8 % slower in
/// K-major, within noise in V-major).
const PREP_PDL_ROWS: usize = 64;

/// The compiled ring length of the warp-streaming decode kernel for a pool's ring.
fn wdecode_ring(ring_len: usize) -> usize {
    match ring_len {
        0 => 0,
        1..=16 => 16,
        _ => 32,
    }
}

/// The warp-streaming decode of a pool: no KV-only mode, rings of up to
/// `KVR_GDN_WDECODE_MAX_RING` entries (or none); V-major states, or K-major ones in two
/// launches.
struct WDecode {
    /// The kernels for rings of 17..=32 entries (else up to 16).
    ring32: bool,
    /// The prep kernel's records (replay pools), for `rows` batch rows a launch, one area
    /// of `scratch_bytes` per layer (calls on different layers may run on different streams).
    scratch: Option<DeviceBuffer>,
    scratch_bytes: usize,
    rows: usize,
    /// Dynamic shared memory of the prep kernel.
    prep_smem: u32,
    /// Batch rows from which it is used (below, the streaming kernel's single launch measured
    /// faster on the H200 for replay decode).
    min_rows: usize,
    /// Replay pools: batches of fewer rows than this take the one-launch kernel
    /// (`kvr_gdn_fdecode`, no prep kernel), with `fused_smem` bytes of shared memory.
    fused_rows: usize,
    fused_smem: u32,
    /// Batches of fewer rows than this take the specialized one-launch kernel where a call
    /// fits it (`fdecode_spec`); 0 where the pool's shape has none (or KVR_GDN_FDECODE_SPEC=0).
    fused_rows_x: usize,
    /// The one-launch kernels, and recurrent pools' state kernel where no prep kernel runs,
    /// as programmatic dependents of the stream's previous kernel (KVR_GDN_FDECODE_PDL=0: not).
    fused_pdl: bool,
    /// Replay pools: the state kernel as a programmatic dependent of the prep kernel, its
    /// CTAs resident beside the prep's with their first tiles loaded (KVR_GDN_STATE_PDL=0: a
    /// plain launch after the prep's end, for benchmarking).
    state_pdl: bool,
    /// Replay pools: batches of fewer rows than this launch the prep kernel as a programmatic
    /// dependent of the stream's previous kernel (it waits for it before its first read; its
    /// launch overlaps that kernel's end). KVR_GDN_PREP_PDL_ROWS overrides it (0: never).
    prep_pdl_rows: usize,
    /// V-major replay pools: batches of at least this many rows load only the u values of
    /// the ring slots the metadata marks as buffered (`p.live_u`, kernels/gdn_wdecode.cu);
    /// KVR_GDN_LIVE_U_ROWS overrides it, for benchmarking. Default: never (`LIVE_U_ROWS`).
    live_u_rows: usize,
    /// Shared memory of a prep CTA of one key head (batches below `prep_split_rows`).
    prep_smem_split: u32,
    /// Batches of fewer rows than this run the prep kernel as a CTA per (row, key head)
    /// (`PREP_SPLIT_ROWS`; KVR_GDN_PREP_SPLIT_ROWS overrides it, for benchmarking).
    prep_split_rows: usize,
    /// KVR_GDN_PREP_SHARES (benchmarking): the prep kernel's CTAs per batch row at every
    /// batch (a divisor of the key heads), instead of `prep_split_rows`' choice.
    prep_shares: Option<usize>,
    /// Recurrent pools without a conv window: the state kernel of `KVR_GDN_WREC_ROWS` rows a
    /// warp (`kvr_gdn_wrec`) instead of the recurrent kind of `kvr_gdn_wdecode`
    /// (KVR_GDN_WREC=0: the latter, for benchmarking).
    wrec: bool,
    /// The two launches take their specialized builds where a call fits one
    /// (`fdecode_spec`; dk 128, a ring of exactly 16 or 32, f32 entries;
    /// KVR_GDN_WDECODE_SPEC=0: never).
    two_x: bool,
    /// K-major states: the state kernel is `Kernel::GdnKDecode`.
    kmajor: bool,
    /// K-major pools take the specialized builds below this many batch rows
    /// (`KDECODE_SPEC_ROWS`; KVR_GDN_KDECODE_SPEC_ROWS overrides it, for benchmarking).
    kspec_rows: usize,
}

/// The state kernel of the warp-streaming decode (two launches) for a pool's layout.
fn wdecode_kernel(kmajor: bool, state: DType, dk: usize, ring_len: usize) -> Kernel {
    let ring = wdecode_ring(ring_len);
    if kmajor {
        Kernel::GdnKDecode { state, dk, ring }
    } else {
        Kernel::GdnWDecode { state, dk, ring }
    }
}

/// Its specialized build (`fdecode_spec`; dk 128, rings of 16 or 32 f32 entries).
fn wdecode_kernel_x(kmajor: bool, state: DType, ring32: bool, spec: FdSpec) -> Kernel {
    if kmajor {
        Kernel::GdnKDecodeX {
            state,
            ring32,
            spec,
        }
    } else {
        Kernel::GdnWDecodeX {
            state,
            ring32,
            spec,
        }
    }
}

/// The warp-streaming verify of a pool: no KV-only mode, dk in `GDN_WVERIFY_DKS`, rings of
/// 1..=`KVR_GDN_WVERIFY_MAX_RING` entries; V-major states or (`kmajor`) K-major ones, on a
/// state kernel of their own after the same prep kernel.
#[derive(Clone, Copy)]
struct WVerify {
    /// K-major states: [`Kernel::GdnKVerify`] (its `ring16` builds for rings of up to 16).
    kmajor: bool,
    /// Dynamic shared memory of the prep kernel (the group's ring decays and drafts' scalars).
    prep_smem: u32,
    /// Dynamic shared memory of the state kernel (a record and the drafts' q and k).
    smem: u32,
    /// The specialized state kernels apply where a call fits one (`fdecode_spec`): dk 128,
    /// f32 entries (KVR_GDN_WVERIFY_SPEC=0: never).
    spec: bool,
    /// Rounds of up to `KVR_GDN_WVPREP_W4_DRAFTS` drafts on the `ring16` state kernels take
    /// the prep in CTAs of that many warps (H200: BENCHMARKS.md; KVR_GDN_WVPREP_W4=0: never).
    w4: bool,
}

/// Batch rows below which the prep kernel runs a CTA per (row, key head) instead of per row
/// (H200, BENCHMARKS.md: its chain shrinks from 8-9 to 5 us at small batches; at 128 rows
/// and more, the 16x more CTAs cost more than they overlap: 94.1 against 94.6 us a step at
/// B = 128, 186.2 against 181.9 at B = 256 in the thirty-first session).
const PREP_SPLIT_ROWS: usize = 128;

/// Batch rows below which replay decode takes the one-launch warp-streaming kernel: those
/// whose grid (a CTA per 32 value rows of a head) fits in one wave of it. Within a wave the
/// prep launch's round trips and hand-off cost more than they save; beyond, the one-launch
/// CTAs wait for a second wave with all the per-row work in each. H200, same runs: GDN
/// (32 heads x 4 tiles) B = 2 / 3 / 4: 7.5 / 8.9 / 10.0 us in one launch against 8.3 / 10.3 /
/// 11.2 in two, B = 8: 16.9 against 14.8; Mamba-2 (128 heads x 2 tiles) B = 2: 9.9 against
/// 11.7, B = 4: 17.5 against 16.1 (BENCHMARKS.md). At least one row always (B = 1 measured
/// faster in one launch for both). KVR_GDN_FUSED_ROWS overrides it (benchmarking).
fn fused_rows_one_wave(ctas_per_row: usize, wave: usize) -> usize {
    (wave / ctas_per_row.max(1)).max(1) + 1
}

/// Waves of CTAs up to which the specialized one-launch kernels run (`fdecode_spec`): they
/// measured faster than the two launches up to two (H200, GDN, ring 16: kernel-level A/B
/// B = 8 11.5 us against 12.4, B = 12 15.9 against 14.2; bench_gdn.py ring 32 B = 8 15.8
/// against 17.2; BENCHMARKS.md).
const FDECODE_SPEC_WAVES: usize = 2;

/// The specialized one-launch kernel that a decode step's parameters fit (`FdFix` /
/// `FdFixM2` in kernels/gdn_wdecode.cu fix these fields; the pool's shape was checked when
/// the kernels were prepared): q, k, v row-contiguous, no conv window, and the dtypes and
/// rule of one [`FdSpec`]. Dtypes of absent optional tensors do not matter.
fn fdecode_spec(p: &StepParams) -> Option<FdSpec> {
    let (f32, bf16) = (code(DType::F32), code(DType::BF16));
    let x = p.q.dtype;
    let is = |t: &DevTensor, d: i32| t.dtype == d;
    let absent_or = |t: &DevTensor, d: i32| t.p == 0 || t.dtype == d;
    let unit = [p.q.s[3], p.k.s[3], p.v.s[3]].iter().all(|&s| s == 1);
    // (pools with KV-only mode: the builds' parameters carry no threshold)
    if !unit || p.conv_dim != 0 || p.thr != 0 || !is(&p.k, x) || !is(&p.v, x) || !is(&p.out, x) {
        return None;
    }
    if p.rule == KVR_GDN_RULE_DELTA && p.dt_mode == KVR_GDN_DT_NONE {
        let plain = p.skip.p == 0 && p.gate.p == 0 && is(&p.beta, x) && is(&p.g, f32);
        return match x {
            _ if !plain => None,
            _ if x == f32 => Some(FdSpec::DeltaF32),
            _ if x == bf16 => Some(FdSpec::DeltaBf16),
            _ => None,
        };
    }
    let mamba2 = p.rule == KVR_GDN_RULE_ADDITIVE
        && p.dt_mode == KVR_GDN_DT_SOFTPLUS
        && x == bf16
        && is(&p.beta, f32)
        && is(&p.a, f32)
        && absent_or(&p.dt_bias, f32)
        && absent_or(&p.skip, f32)
        && absent_or(&p.gate, bf16);
    mamba2.then_some(FdSpec::Mamba2Bf16)
}

/// The specialized one-launch kernel's parameters from the step's (the fields its builds read).
fn fdecode_args(p: &StepParams) -> FDecodeArgs {
    FDecodeArgs {
        state: p.state,
        ring_u: p.ring_u,
        ring_k: p.ring_k,
        ring_g: p.ring_g,
        meta: p.meta,
        ids: p.ids,
        q: p.q.p,
        k: p.k.p,
        v: p.v.p,
        g: p.g.p,
        beta: p.beta.p,
        out: p.out.p,
        skip: p.skip.p,
        gate: p.gate.p,
        a: p.a.p,
        dt_bias: p.dt_bias.p,
        seq_stride: p.seq_stride,
        q_s0: p.q.s[0],
        q_s2: p.q.s[2],
        k_s0: p.k.s[0],
        k_s1: p.k.s[1],
        k_s2: p.k.s[2],
        v_s0: p.v.s[0],
        v_s2: p.v.s[2],
        g_s0: p.g.s[0],
        g_s1: p.g.s[1],
        g_s2: p.g.s[2],
        beta_s0: p.beta.s[0],
        beta_s1: p.beta.s[1],
        beta_s2: p.beta.s[2],
        out_s0: p.out.s[0],
        out_s2: p.out.s[2],
        out_s3: p.out.s[3],
        skip_s0: p.skip.s[0],
        gate_s0: p.gate.s[0],
        gate_s2: p.gate.s[2],
        gate_s3: p.gate.s[3],
        a_s0: p.a.s[0],
        dt_bias_s0: p.dt_bias.s[0],
        op: p.op,
        t: p.t,
        hk: p.hk,
        hv: p.hv,
        dk: p.dk,
        dv: p.dv,
        tv: p.tv,
        tiles: p.tiles,
        auto_commit: p.auto_commit,
        l2norm: p.l2norm,
        scale: p.scale,
        dt_min: p.dt_min,
        dt_max: p.dt_max,
        pad: 0,
        ids_inline: p.ids_inline,
    }
}

/// One tile width of the streaming decode kernel and its resident CTAs per SM with one
/// state tile and with two (persistent; 0 where two do not fit).
#[derive(Clone, Copy, Debug)]
struct StreamWidth {
    rows: usize,
    per_sm: usize,
    per_sm_persistent: usize,
}

/// A launch of the streaming decode kernel: rows per CTA, CTAs, state tiles per CTA.
#[derive(Clone, Copy, Debug)]
struct StreamLaunch {
    rows: usize,
    grid: usize,
    stages: usize,
}

impl ReplayCuda {
    pub(crate) fn new(cuda_arc: Arc<CudaBackend>, lay: &Layout) -> Result<Self> {
        let cuda = &*cuda_arc;
        let cfg = &lay.cfg;
        let pow2 = |d: usize| d.is_power_of_two() && (32..=256).contains(&d);
        if !pow2(cfg.dk) || !pow2(cfg.dv) {
            return Err(Error::Unsupported(format!(
                "the CUDA GDN kernels take dk and dv in {{32, 64, 128, 256}}, not {} and {}",
                cfg.dk, cfg.dv
            )));
        }
        let tiles = tile_range(cfg.dk, cfg.dv).ok_or_else(|| {
            Error::Unsupported(format!(
                "no CUDA tiling for dk {} and dv {}",
                cfg.dk, cfg.dv
            ))
        })?;
        for wide in [false, true] {
            for state in [DType::F32, DType::BF16] {
                for vmajor in [false, true] {
                    let per_sm = cuda.prepare_kernel(
                        Kernel::GdnStep {
                            state,
                            vmajor,
                            wide,
                        },
                        STEP_SMEM_LIMIT,
                        THREADS,
                    )?;
                    if per_sm == 0 {
                        return Err(Error::Unsupported(
                            "this GPU cannot run the GDN step kernel".into(),
                        ));
                    }
                }
            }
        }
        // KVR_GDN_TILE forces the value rows per CTA (for benchmarking), read once here.
        let forced_tile = env_usize("KVR_GDN_TILE")
            .filter(|t| t.is_power_of_two() && (tiles.0..=tiles.1).contains(t));
        // The decode kernel: 8 value rows per warp, up to DECODE_MAX_ROWS per CTA.
        // KVR_GDN_DECODE=general routes decode through the general step kernel and
        // KVR_GDN_DECODE_ROWS sets the rows per CTA (both for benchmarking).
        // A recurrent-only K-major pool stays on the general kernel: there the decode
        // kernel's 16-byte-per-lane reads of 32-byte key rows measured 609 vs 878 us
        // (H100, B = 256, BENCHMARKS.md); everywhere else the decode kernel is faster.
        // (Where the warp-streaming decode below applies, it comes first, both layouts.)
        let recurrent_kmajor = cfg.ring_len == 0 && cfg.layout == StateLayout::KMajor;
        let which = std::env::var("KVR_GDN_DECODE").unwrap_or_default();
        let decode_rows =
            if GDN_DECODE_DKS.contains(&cfg.dk) && !recurrent_kmajor && which != "general" {
                let max = DECODE_MAX_ROWS.min(cfg.dv);
                let rows = env_usize("KVR_GDN_DECODE_ROWS")
                    .filter(|r| r.is_power_of_two() && (8..=max).contains(r))
                    .unwrap_or(max);
                Some(rows)
            } else {
                None
            };
        // The streaming decode kernel: every pool without KV-only mode whose states it can
        // copy in 16-byte pieces. KVR_GDN_DECODE=warp (or general) selects the older
        // kernels instead, KVR_GDN_STREAM_ROWS the rows per CTA (both for benchmarking).
        let es = cfg.state_dtype.size();
        let aligned = lay
            .states
            .iter()
            .all(|s| s.addr % 16 == 0 && (s.seq_stride * es) % 16 == 0);
        let min_rows = if cfg.layout == StateLayout::VMajor {
            16
        } else {
            32
        };
        let candidates: Vec<usize> = if GDN_DECODE_DKS.contains(&cfg.dk)
            && cfg.kv_only_threshold == 0
            && aligned
            && which != "general"
            && which != "warp"
        {
            STREAM_ROWS
                .into_iter()
                .filter(|&r| {
                    r >= min_rows
                        && r <= cfg.dv
                        && cfg.dv % r == 0
                        && stream_smem_bytes(cfg, r, 1) <= STREAM_SMEM_LIMIT
                })
                .collect()
        } else {
            Vec::new()
        };
        // Resident CTAs per SM of each (width, stages), in increasing shared memory, so that
        // the kernel's dynamic shared memory limit ends at the largest.
        let mut stream_rows = Vec::new();
        if !candidates.is_empty() {
            let kernel = Kernel::GdnStream {
                state: cfg.state_dtype,
                vmajor: cfg.layout == StateLayout::VMajor,
                dk: cfg.dk,
            };
            cuda.prefer_shared_memory(kernel)?;
            let mut combos: Vec<(usize, usize, usize)> = candidates
                .iter()
                .flat_map(|&r| [1usize, 2].map(|s| (stream_smem_bytes(cfg, r, s), r, s)))
                .filter(|&(bytes, _, _)| bytes <= STREAM_SMEM_LIMIT)
                .collect();
            combos.sort_unstable();
            let mut fit = Vec::new();
            for (bytes, r, stages) in combos {
                let per_sm = cuda.prepare_kernel(kernel, bytes as u32, STREAM_THREADS)?;
                fit.push((r, stages, per_sm as usize));
            }
            for r in candidates {
                let per_sm = |s: usize| {
                    fit.iter()
                        .find(|&&(x, st, _)| x == r && st == s)
                        .map_or(0, |&(_, _, n)| n)
                };
                if per_sm(1) > 0 {
                    stream_rows.push(StreamWidth {
                        rows: r,
                        per_sm: per_sm(1),
                        per_sm_persistent: per_sm(2),
                    });
                }
            }
        }
        let forced_stream_rows =
            env_usize("KVR_GDN_STREAM_ROWS").filter(|r| stream_rows.iter().any(|w| w.rows == *r));
        let stream_persistent = std::env::var("KVR_GDN_STREAM_PERSIST").as_deref() == Ok("1");
        // Batch sizes where the streaming kernel beat the older ones on the H200
        // (BENCHMARKS.md, same runs): replay decode on V-major states at every batch, on
        // K-major states below 128 rows (the warp kernel is as fast or faster above);
        // recurrent decode on K-major states from 32 rows (the general kernel is faster
        // below), on V-major states from 64 rows (the warp kernel is faster below).
        // KVR_GDN_DECODE=stream uses it at every batch (benchmarking).
        let recurrent = cfg.ring_len == 0;
        let vmajor = cfg.layout == StateLayout::VMajor;
        let stream_batches = if which == "stream" {
            0..usize::MAX
        } else {
            match (recurrent, vmajor) {
                (false, true) => 0..usize::MAX,
                (false, false) => 0..128,
                (true, false) => 32..usize::MAX,
                (true, true) => 64..usize::MAX,
            }
        };
        // The streaming verify kernel: replay pools without KV-only mode (recurrent pools
        // keep the per-draft snapshots of the general kernel: they are the baseline).
        let mut verify_rows: [Vec<(usize, [usize; MAX_DRAFTS + 1])>; 2] = [Vec::new(), Vec::new()];
        if GDN_DECODE_DKS.contains(&cfg.dk)
            && cfg.ring_len > 0
            && cfg.kv_only_threshold == 0
            && aligned
            && std::env::var("KVR_GDN_VERIFY").as_deref() != Ok("general")
        {
            // Resident CTAs per SM of every (rows, T), in increasing shared memory so that each
            // kernel's dynamic shared memory limit ends at the largest that fits.
            let mut fits: Vec<(usize, usize, usize)> = STREAM_ROWS
                .into_iter()
                .filter(|&r| r >= min_rows && r <= cfg.dv && cfg.dv % r == 0)
                .flat_map(|r| (1..=cfg.max_drafts).map(move |t| (r, t)))
                .map(|(r, t)| (sverify_smem_bytes(cfg, r, t), r, t))
                .filter(|&(bytes, _, _)| bytes <= STREAM_SMEM_LIMIT)
                .collect();
            fits.sort_unstable();
            // One table per rule (the pool learns its family's rule only from a step's plan).
            for (additive, table) in verify_rows.iter_mut().enumerate() {
                if fits.is_empty() {
                    break;
                }
                let kernel = verify_kernel(cfg, additive == 1);
                cuda.prefer_shared_memory(kernel)?;
                let mut per_sm = Vec::new();
                for &(bytes, r, t) in &fits {
                    let n = cuda.prepare_kernel(kernel, bytes as u32, STREAM_THREADS)? as usize;
                    per_sm.push((r, t, n));
                }
                for r in STREAM_ROWS {
                    let mut by_t = [0usize; MAX_DRAFTS + 1];
                    for &(_, t, n) in per_sm.iter().filter(|x| x.0 == r) {
                        by_t[t] = n;
                    }
                    if by_t[1..=cfg.max_drafts].iter().all(|&n| n > 0) {
                        table.push((r, by_t));
                    }
                }
            }
        }
        // The warp-streaming verify: replay pools without KV-only mode, rings of up to 64
        // entries, either layout (KVR_GDN_VERIFY=stream or general: the older kernels).
        let group = cfg.v_heads / cfg.k_heads.max(1);
        let kmajor = cfg.layout == StateLayout::KMajor;
        let wverify = if GDN_WVERIFY_DKS.contains(&cfg.dk)
            && (1..=KVR_GDN_WVERIFY_MAX_RING).contains(&cfg.ring_len)
            && cfg.kv_only_threshold == 0
            && cfg.v_heads % cfg.k_heads == 0
            && cfg.dv % (WDECODE_WARPS * KVR_GDN_WDECODE_ROWS) == 0
            && aligned
            && !matches!(
                std::env::var("KVR_GDN_VERIFY").as_deref(),
                Ok("general" | "stream")
            ) {
            let prep_smem = (group * (cfg.ring_len + 2 * cfg.max_drafts) * 4) as u32;
            // The state kernel: a record and the drafts' q and k, or in a flush, V-major: the u
            // values (4 warps x 64 slots x 8 rows); K-major: then each draft's two products by
            // warp (2 x 4 warps x 32 columns a draft), a flush's w_p u_p (32 columns of 16
            // slots in the `_r16` builds, else 64) and KVR_GDN_KVERIFY_FLUSH_SLOTS slots' keys
            // (kernels/gdn_wverify.cu kverify_body).
            let wu_slots = if cfg.ring_len <= 16 {
                16
            } else {
                KVR_GDN_WVERIFY_MAX_RING
            };
            let qk_floats = if kmajor {
                (2 * cfg.max_drafts + KVR_GDN_KVERIFY_FLUSH_SLOTS) * cfg.dk
                    + 2 * cfg.max_drafts * WDECODE_WARPS * 32
                    + wu_slots * 32
            } else {
                (2 * cfg.max_drafts * cfg.dk)
                    .max(WDECODE_WARPS * KVR_GDN_WDECODE_ROWS * KVR_GDN_WVERIFY_MAX_RING)
            };
            let smem = ((gdn_wvrec_floats(cfg.max_drafts) + qk_floats) * 4) as u32;
            let mut fits = cuda.prepare_kernel(
                Kernel::GdnWVprep {
                    dk: cfg.dk,
                    ring16: false,
                    w4: false,
                },
                prep_smem,
                KVR_GDN_WVPREP_THREADS,
            )? > 0;
            for (t8, additive) in [(false, false), (false, true), (true, false), (true, true)] {
                let k = if kmajor {
                    Kernel::GdnKVerify {
                        state: cfg.state_dtype,
                        dk: cfg.dk,
                        t8,
                        additive,
                        ring16: cfg.ring_len <= 16,
                    }
                } else {
                    Kernel::GdnWVerify {
                        state: cfg.state_dtype,
                        dk: cfg.dk,
                        t8,
                        additive,
                    }
                };
                fits &= cuda.prepare_kernel(k, smem, (32 * WDECODE_WARPS) as u32)? > 0;
            }
            // The specialized builds are V-major.
            let mut spec = !kmajor
                && cfg.dk == 128
                && cfg.entry_dtype == DType::F32
                && std::env::var("KVR_GDN_WVERIFY_SPEC").as_deref() != Ok("0");
            for t8 in [false, true] {
                for s in FdSpec::ALL {
                    let k = Kernel::GdnWVerifyX {
                        state: cfg.state_dtype,
                        t8,
                        spec: s,
                        ring16: cfg.ring_len <= 16,
                    };
                    spec = spec && cuda.prepare_kernel(k, smem, (32 * WDECODE_WARPS) as u32)? > 0;
                }
            }
            let mut w4 = false;
            if spec && cfg.ring_len <= 16 {
                let prep = Kernel::GdnWVprep {
                    dk: 128,
                    ring16: true,
                    w4: false,
                };
                spec = cuda.prepare_kernel(prep, prep_smem, KVR_GDN_WVPREP_THREADS)? > 0;
                let prep = Kernel::GdnWVprep {
                    dk: 128,
                    ring16: true,
                    w4: true,
                };
                w4 = spec
                    && std::env::var("KVR_GDN_WVPREP_W4").as_deref() != Ok("0")
                    && cuda.prepare_kernel(
                        prep,
                        prep_smem,
                        32 * KVR_GDN_WVPREP_W4_DRAFTS as u32,
                    )? > 0;
            }
            fits.then_some(WVerify {
                kmajor,
                prep_smem,
                smem,
                spec,
                w4,
            })
        } else {
            None
        };
        let row_bytes = if wverify.is_some() {
            gdn_wvscratch_floats(1, (cfg.v_heads, cfg.k_heads), cfg.dk, cfg.max_drafts) * 4
        } else {
            crate::abi::gdn_vprep_floats(cfg.dk, cfg.ring_len, cfg.max_drafts) * 4 * cfg.k_heads
        };
        let verify_chunk = (VERIFY_SCRATCH_MAX / row_bytes)
            .clamp(1, MAX_INLINE)
            .min(cfg.max_seqs);
        let scratch = if wverify.is_none() && verify_rows.iter().all(|t| t.is_empty()) {
            None
        } else {
            // Zeroed: the state kernels copy whole records, also the rows of drafts a launch
            // does not have.
            let buf = DeviceBuffer::new(cuda, verify_chunk * row_bytes)?;
            buf.fill_async(cuda, 0, Stream::DEFAULT)?;
            Some(buf)
        };
        // Pools with KV-only mode: kvr_gdn_kvdec for the KV-only rows, then the warp-streaming
        // decode for the others (shapes of GDN_KVDEC_SHAPES; every entry of a head in one
        // CTA's shared memory for its materialization; else the older kernels).
        let kvdec = if cfg.kv_only_threshold > 0
            && cfg.ring_len > 0
            && GDN_KVDEC_SHAPES.contains(&(cfg.dk, cfg.dv))
            && cfg.v_heads % cfg.k_heads == 0
            && aligned
            && cfg.ring_len <= KVR_GDN_WDECODE_MAX_RING
            && cfg.dv % (WDECODE_WARPS * KVR_GDN_WDECODE_ROWS) == 0
            && !matches!(which.as_str(), "general" | "warp" | "stream")
            && std::env::var("KVR_GDN_KVDEC").as_deref() != Ok("0")
        {
            let (ee, thr) = (cfg.entry_dtype.size(), cfg.kv_only_threshold);
            // A CTA's share of the entries, ceil(thr / split) of them (a materialization's
            // n = thr; a step's n < thr): u rows, then k rows (a region that later holds the
            // 4 warps' partial sums of 2 dv floats), then the coefficients.
            let smem_for = |ns: usize| {
                let per = thr.div_ceil(ns);
                let kroom = (per * cfg.dk * ee).max(4 * 2 * cfg.dv * 4);
                (per * cfg.dv * ee + kroom + per * 8 + 16) as u32
            };
            // Splits from the fewest CTAs whose state rows a materialization holds in
            // registers (8 x 8 values a thread: kernels/gdn_kvdec.cu) to one 8-row tile a
            // thread at most; more than one CTA needs clusters (sm_90).
            let elems = cfg.dk * cfg.dv;
            let (lo, hi) = (
                (elems / (64 * KVR_GDN_KVDEC_THREADS as usize)).max(1),
                (elems / 1024).clamp(1, 8),
            );
            let kernel = Kernel::GdnKvDec {
                state: cfg.state_dtype,
                dk: cfg.dk,
                dv: cfg.dv,
            };
            let mut smem = [0u32; 4];
            for (i, ns) in [1usize, 2, 4, 8].into_iter().enumerate() {
                let bytes = smem_for(ns);
                if (lo..=hi).contains(&ns)
                    && cfg.dv % ns == 0
                    && bytes as usize <= STREAM_SMEM_LIMIT
                {
                    let fits = if ns == 1 {
                        cuda.prepare_kernel(kernel, bytes, KVR_GDN_KVDEC_THREADS)? > 0
                    } else {
                        // (prepared at the largest shared memory first: the split of `lo`)
                        if smem.iter().all(|&b| b == 0) {
                            cuda.prepare_kernel(kernel, bytes, KVR_GDN_KVDEC_THREADS)?;
                        }
                        cuda.prepare_cluster(kernel, ns as u32, bytes, KVR_GDN_KVDEC_THREADS)? > 0
                    };
                    if fits {
                        smem[i] = bytes;
                    }
                }
            }
            if smem.iter().any(|&b| b > 0) {
                Some(KvDec {
                    kernel,
                    smem,
                    forced_split: env_usize("KVR_GDN_KVDEC_SPLIT"),
                    early_rows: env_usize("KVR_GDN_KVDEC_EARLY_ROWS").unwrap_or(KVDEC_EARLY_ROWS),
                    guess_rows: env_usize("KVR_GDN_KVDEC_GUESS_ROWS").unwrap_or(KVDEC_GUESS_ROWS),
                })
            } else {
                None
            }
        } else {
            None
        };
        // The warp-streaming decode: pools without KV-only mode (or with it where kvr_gdn_kvdec
        // takes the KV-only rows) whose states are 16-byte
        // aligned, V-major or K-major (a state kernel of its own). KVR_GDN_DECODE=stream (or
        // warp, general) selects the older kernels.
        let lc = cfg.ring_len.max(1);
        // The prep kernel's shared memory for a CTA of `nkh` key heads: key products,
        // normalized keys, k . q; the new token's (g, beta), ring decays and v of their
        // value heads.
        let prep_bytes =
            |nkh: usize| (2 * lc + cfg.dk + 1) * nkh * 4 + nkh * group * (lc + cfg.dv + 2) * 4 + 16;
        let prep_smem = prep_bytes(cfg.k_heads);
        // K-major pools take the same prep kernel and a state kernel of their own
        // (`Kernel::GdnKDecode`; its specialized builds below `KDECODE_SPEC_ROWS` rows), in
        // two launches at every batch (no one-launch kernel, no `kvr_gdn_wrec`).
        let kmajor = cfg.layout == StateLayout::KMajor;
        let wdecode = if (cfg.kv_only_threshold == 0 || kvdec.is_some())
            && GDN_DECODE_DKS.contains(&cfg.dk)
            && cfg.ring_len <= KVR_GDN_WDECODE_MAX_RING
            && cfg.dv % (WDECODE_WARPS * KVR_GDN_WDECODE_ROWS) == 0
            && cfg.v_heads % cfg.k_heads == 0
            && prep_smem <= STREAM_SMEM_LIMIT
            && aligned
            && !matches!(which.as_str(), "general" | "warp" | "stream")
        {
            let ring32 = cfg.ring_len > 16;
            let prep_smem = prep_smem as u32;
            let prep = cuda.prepare_kernel(
                Kernel::GdnDPrep { dk: cfg.dk, ring32 },
                prep_smem,
                DPREP_THREADS,
            )?;
            let main = cuda.prepare_kernel(
                wdecode_kernel(kmajor, cfg.state_dtype, cfg.dk, cfg.ring_len),
                0,
                (32 * WDECODE_WARPS) as u32,
            )?;
            let rows = cfg.max_seqs.min(MAX_INLINE);
            let heads = (cfg.v_heads, cfg.k_heads);
            let scratch_bytes =
                gdn_dscratch_floats(rows, heads, (cfg.dk, cfg.dv), cfg.ring_len).div_ceil(4) * 16;
            // Zeroed: in pools with KV-only mode the state kernel loads a skipped row's record
            // before it tests the header (kernels/gdn_wdecode.cu), which may never have been
            // written at that batch position.
            let scratch = if cfg.ring_len > 0 {
                let buf = DeviceBuffer::new(cuda, cfg.layers * scratch_bytes)?;
                buf.fill_async(cuda, 0, Stream::DEFAULT)?;
                Some(buf)
            } else {
                None
            };
            // The one-launch kernel for small batches of replay pools: every slot's key of
            // one key head in shared memory.
            let fused_smem = (cfg.ring_len * cfg.dk * cfg.entry_dtype.size()) as u32;
            let fused_occ = if cfg.ring_len > 0 && !kmajor {
                cuda.prepare_kernel(
                    Kernel::GdnFDecode {
                        state: cfg.state_dtype,
                        dk: cfg.dk,
                        ring32,
                    },
                    fused_smem,
                    (32 * WDECODE_WARPS) as u32,
                )?
            } else {
                0
            };
            let fused = fused_occ > 0;
            // The specialized one-launch kernels (dk 128, a ring of exactly 16 or 32, f32
            // entries), one per FdSpec.
            let spec_shape = fused
                && cfg.dk == 128
                && matches!(cfg.ring_len, 16 | 32)
                && cfg.entry_dtype == DType::F32
                && std::env::var("KVR_GDN_FDECODE_SPEC").as_deref() != Ok("0");
            // The specialized two launches (the same shapes, also where the one-launch
            // kernel does not fit).
            let mut two_x = cfg.dk == 128
                && matches!(cfg.ring_len, 16 | 32)
                && cfg.entry_dtype == DType::F32
                && std::env::var("KVR_GDN_WDECODE_SPEC").as_deref() != Ok("0");
            if two_x {
                for spec in FdSpec::ALL {
                    let prep = Kernel::GdnDPrepX { ring32, spec };
                    let main = wdecode_kernel_x(kmajor, cfg.state_dtype, ring32, spec);
                    two_x &= cuda.prepare_kernel(prep, prep_smem, DPREP_THREADS)? > 0
                        && cuda.prepare_kernel(main, 0, (32 * WDECODE_WARPS) as u32)? > 0;
                }
            }
            let mut x_occ = 0;
            if spec_shape {
                x_occ = u32::MAX;
                for spec in FdSpec::ALL {
                    let k = Kernel::GdnFDecodeX {
                        state: cfg.state_dtype,
                        ring32,
                        spec,
                    };
                    x_occ = x_occ.min(cuda.prepare_kernel(
                        k,
                        fused_smem,
                        (32 * WDECODE_WARPS) as u32,
                    )?);
                }
            }
            // Rows below which a one-launch kernel of `occ` CTAs per SM runs, up to `waves`
            // waves of them. KVR_GDN_DECODE=wdecode: the two launches at every batch;
            // =fused: one launch at every batch (tests, benchmarking).
            let row_ctas = cfg.v_heads * cfg.dv / (WDECODE_WARPS * KVR_GDN_WDECODE_ROWS);
            let rows_below = |occ: u32, waves: usize| match which.as_str() {
                _ if occ == 0 => 0,
                "wdecode" => 0,
                "fused" => usize::MAX,
                _ => env_usize("KVR_GDN_FUSED_ROWS").unwrap_or_else(|| {
                    let wave = occ as usize * cuda.sm_count().max(1) as usize;
                    fused_rows_one_wave(row_ctas, waves * wave)
                }),
            };
            let wrec = !kmajor
                && cfg.ring_len == 0
                && cfg.conv_dim == 0
                && std::env::var("KVR_GDN_WREC").as_deref() != Ok("0")
                && cuda.prepare_kernel(
                    Kernel::GdnWRec {
                        state: cfg.state_dtype,
                        dk: cfg.dk,
                    },
                    0,
                    (32 * WDECODE_WARPS) as u32,
                )? > 0;
            let fused_rows = rows_below(fused_occ, 1);
            let fused_rows_x = rows_below(x_occ, FDECODE_SPEC_WAVES);
            (prep > 0 && main > 0).then_some(WDecode {
                ring32,
                scratch,
                scratch_bytes,
                rows,
                prep_smem,
                prep_smem_split: prep_bytes(1) as u32,
                prep_split_rows: env_usize("KVR_GDN_PREP_SPLIT_ROWS").unwrap_or(PREP_SPLIT_ROWS),
                prep_shares: env_usize("KVR_GDN_PREP_SHARES")
                    .filter(|&s| s > 0 && cfg.k_heads % s == 0),
                // Without the one-launch kernel, V-major replay below 8 rows measured faster
                // on the streaming kernel; K-major replay is faster in the two launches at
                // every batch (H200, B = 1: 7.8 against 13.5 us, BENCHMARKS.md).
                min_rows: if cfg.ring_len > 0 && which != "wdecode" && !fused && !kmajor {
                    8
                } else {
                    1
                },
                fused_rows,
                fused_smem,
                fused_rows_x,
                fused_pdl: std::env::var("KVR_GDN_FDECODE_PDL").as_deref() != Ok("0"),
                state_pdl: std::env::var("KVR_GDN_STATE_PDL").as_deref() != Ok("0"),
                prep_pdl_rows: env_usize("KVR_GDN_PREP_PDL_ROWS").unwrap_or(PREP_PDL_ROWS),
                live_u_rows: env_usize("KVR_GDN_LIVE_U_ROWS").unwrap_or(LIVE_U_ROWS),
                wrec,
                two_x,
                kmajor,
                kspec_rows: env_usize("KVR_GDN_KDECODE_SPEC_ROWS").unwrap_or(KDECODE_SPEC_ROWS),
            })
        } else {
            None
        };
        let sync = DeviceBuffer::new(cuda, cfg.max_seqs * cfg.v_heads * 4)?;
        sync.upload(&vec![0u32; cfg.max_seqs * cfg.v_heads])?;
        let descs: Vec<LayerState> = lay
            .states
            .iter()
            .map(|s| LayerState {
                state: s.addr as u64,
                seq_stride: s.seq_stride as i64,
            })
            .collect();
        // KV-only rows of single-token decodes: a CTA per (row, value head) over at most
        // KVR_GDN_KVONLY_MAX entries and value rows, 8 value rows per lane.
        let kvonly = if decode_rows.is_some()
            && cfg.kv_only_threshold > 0
            && cfg.kv_only_threshold <= KVR_GDN_KVONLY_MAX
            && [32, 64, 128, 256].contains(&cfg.dv)
            && std::env::var("KVR_GDN_KVONLY").as_deref() != Ok("0")
        {
            let kernel = Kernel::GdnKvOnly {
                state: cfg.state_dtype,
                dk: cfg.dk,
            };
            cuda.prepare_kernel(kernel, 0, KVR_GDN_KVONLY_THREADS)?;
            Some(kernel)
        } else {
            None
        };
        // In-kernel while the KV-only (row, head) pairs are at most two per SM: on the H200
        // (Qwen3-Next shape, 32 value heads) that is 8 rows, where one launch measured
        // 8.8 / 11.0 us against 10.6 / 12.9 at 1 / 8 rows (context 8), and 36.4 against
        // 32.7 at 64 rows (BENCHMARKS.md).
        let kvonly_inkernel_rows = env_usize("KVR_GDN_KVONLY_ROWS")
            .unwrap_or((2 * cuda.sm_count() as usize / cfg.v_heads).max(1));
        let layers = DeviceBuffer::new(cuda, descs.len() * size_of::<LayerState>())?;
        layers.upload(&descs)?;
        Ok(ReplayCuda {
            cuda: cuda_arc.clone(),
            lay: lay.clone(),
            sync,
            layers,
            sm_count: cuda.sm_count(),
            tiles,
            forced_tile,
            decode_rows,
            stream_rows,
            forced_stream_rows,
            stream_persistent,
            stream_batches,
            verify_rows: verify_rows.clone(),
            wverify,
            scratch,
            verify_chunk,
            verify_pdl: std::env::var("KVR_GDN_VERIFY_PDL").as_deref() != Ok("0"),
            forced_verify_rows: env_usize("KVR_GDN_VERIFY_ROWS")
                .filter(|r| verify_rows.iter().flatten().any(|w| w.0 == *r)),
            wdecode,
            kvonly,
            kvonly_inkernel_rows,
            kvdec,
        })
    }

    /// Value rows per CTA of the streaming verify kernel for a batch of `rows` sequences:
    /// the widest tile whose CTAs still fill every SM, or the narrowest; `None` where the
    /// kernel does not apply.
    fn verify_launch(
        &self,
        cfg: &ReplayConfig,
        rows: usize,
        t: usize,
        additive: bool,
    ) -> Option<usize> {
        let table = &self.verify_rows[additive as usize];
        if let Some(r) = self
            .forced_verify_rows
            .filter(|r| table.iter().any(|w| w.0 == *r))
        {
            return Some(r);
        }
        let sms = self.sm_count as usize;
        let items = |r: usize| rows * cfg.v_heads * (cfg.dv / r);
        // Tiles with at least two resident CTAs per SM at this T: with one, nothing hides a
        // CTA's dependent phases (H200, B = 32..128: T = 8 at 128 rows ran 4-5x slower than
        // T = 4, which fits two; a tile of 64 rows then wins). Where none fits two, the
        // general kernel verifies.
        let two = || {
            table
                .iter()
                .map(move |&(r, by_t)| (r, by_t[t]))
                .filter(|&(_, n)| n >= 2)
        };
        two()
            .find(|&(r, n)| items(r) >= n * sms)
            .or_else(|| two().next_back())
            .map(|(r, _)| r)
    }

    /// One launch of a GDN kernel with `p` as its parameters: `grid` CTAs of `threads`.
    fn run(
        &self,
        kernel: Kernel,
        grid: usize,
        threads: u32,
        smem: u32,
        p: &mut StepParams,
        stream: Stream,
    ) -> Result<()> {
        self.run_ex(kernel, (grid, threads, smem), p, stream, false)
    }

    /// `run`, as a programmatic dependent of the previous kernel on the stream when `pdl`.
    fn run_ex(
        &self,
        kernel: Kernel,
        (grid, threads, smem): (usize, u32, u32),
        p: &mut StepParams,
        stream: Stream,
        pdl: bool,
    ) -> Result<()> {
        let mut args = [p as *mut StepParams as *mut c_void];
        self.cuda.launch_ex(
            kernel,
            (grid as u32, 1, 1),
            (threads, 1, 1),
            smem,
            stream,
            &mut args,
            pdl,
            0,
        )
    }

    /// `kvr_gdn_finish`: metadata, ring keys and decays, after every CTA of a step has read
    /// them.
    fn finish(&self, p: &mut StepParams, rows: usize, stream: Stream) -> Result<()> {
        self.run(Kernel::GdnFinish, rows, FINISH_THREADS, 0, p, stream)
    }

    /// The streaming verify kernels (`p.tv` value rows per CTA): the drafts' products per
    /// (row, key head), then the verify, which finishes the step itself.
    fn launch_verify(&self, p: &mut StepParams, rows: usize, stream: Stream) -> Result<()> {
        let cfg = &self.lay.cfg;
        p.scratch = self.scratch.as_ref().map_or(0, |s| s.addr() as u64);
        let vprep = Kernel::GdnVprep { dk: cfg.dk };
        self.run(vprep, rows * cfg.k_heads, STREAM_THREADS, 0, p, stream)?;
        let kernel = verify_kernel(cfg, p.rule == KVR_GDN_RULE_ADDITIVE);
        let smem = sverify_smem_bytes(cfg, p.tv as usize, p.t as usize) as u32;
        let grid = rows * cfg.v_heads * p.tiles as usize;
        // A programmatic dependent of the prep kernel (it waits for the prep's record only
        // after issuing its state tile); KVR_GDN_VERIFY_PDL=0 launches it after the prep ends.
        let shape = (grid, STREAM_THREADS, smem);
        self.run_ex(kernel, shape, p, stream, self.verify_pdl)
    }

    /// The warp-streaming verify: the prep kernel (a CTA per row and key head), then the
    /// state kernel on the grid (`p.tiles`, value heads, rows) as its programmatic dependent
    /// (KVR_GDN_VERIFY_PDL=0: after the prep ends).
    fn launch_wverify(
        &self,
        p: &mut StepParams,
        w: WVerify,
        rows: usize,
        stream: Stream,
    ) -> Result<()> {
        let cfg = &self.lay.cfg;
        p.scratch = self.scratch.as_ref().map_or(0, |s| s.addr() as u64);
        let t8 = p.t > 4;
        let additive = p.rule == KVR_GDN_RULE_ADDITIVE;
        let kernel = match fdecode_spec(p).filter(|_| w.spec) {
            _ if w.kmajor => Kernel::GdnKVerify {
                state: cfg.state_dtype,
                dk: cfg.dk,
                t8,
                additive,
                ring16: cfg.ring_len <= 16,
            },
            Some(spec) => Kernel::GdnWVerifyX {
                state: cfg.state_dtype,
                t8,
                spec,
                ring16: cfg.ring_len <= 16,
            },
            None => Kernel::GdnWVerify {
                state: cfg.state_dtype,
                dk: cfg.dk,
                t8,
                additive,
            },
        };
        // The `ring16` state kernels read records of 16 slots, written by their own prep.
        let ring16 = matches!(kernel, Kernel::GdnWVerifyX { ring16: true, .. });
        let w4 = ring16 && w.w4 && p.t as usize <= KVR_GDN_WVPREP_W4_DRAFTS;
        let prep = Kernel::GdnWVprep {
            dk: cfg.dk,
            ring16,
            w4,
        };
        let threads = if w4 {
            32 * KVR_GDN_WVPREP_W4_DRAFTS as u32
        } else {
            KVR_GDN_WVPREP_THREADS
        };
        self.run(prep, rows * cfg.k_heads, threads, w.prep_smem, p, stream)?;
        self.launch_rows_grid(kernel, p, rows, w.smem, self.verify_pdl, stream)
    }

    /// The streaming decode launch for a batch of `rows` sequences, or `None` where the
    /// kernel does not apply. By default one CTA per (row, head, tile) item: the widest tile
    /// whose items still give every SM its resident CTAs (wider tiles pay the per-item work
    /// once for more state bytes), or for a batch too small for any, the narrowest (the most
    /// CTAs to spread the state over). Persistent CTAs (KVR_GDN_STREAM_PERSIST=1) loop over
    /// items with the next tile in flight; the grid is then what fits on the GPU at once.
    fn stream_launch(&self, cfg: &ReplayConfig, rows: usize) -> Option<StreamLaunch> {
        if !self.stream_batches.contains(&rows) {
            return None;
        }
        let sms = self.sm_count as usize;
        let items = |r: usize| rows * cfg.v_heads * (cfg.dv / r);
        let widths = self.stream_rows.iter().copied();
        let w = match self.forced_stream_rows {
            Some(r) => widths.clone().find(|w| w.rows == r),
            None => widths
                .clone()
                .find(|w| items(w.rows) >= w.per_sm * sms)
                .or_else(|| self.stream_rows.last().copied()),
        }?;
        if self.stream_persistent && w.per_sm_persistent > 0 {
            Some(StreamLaunch {
                rows: w.rows,
                grid: items(w.rows).min(w.per_sm_persistent * sms),
                stages: 2,
            })
        } else {
            Some(StreamLaunch {
                rows: w.rows,
                grid: items(w.rows),
                stages: 1,
            })
        }
    }

    /// Value rows per CTA for a batch of `rows` sequences: the widest tile (least fixed
    /// work per byte) that still gives every SM a CTA. Each CTA pays a few microseconds of
    /// setup beside its state traffic, so fewer, wider CTAs win once the SMs are busy
    /// (H100: 128 rows beat 64 by 5-14 % at B = 8..256, BENCHMARKS.md).
    fn tile(&self, cfg: &ReplayConfig, rows: usize) -> usize {
        let (lo, hi) = self.tiles;
        if let Some(t) = self.forced_tile {
            return t;
        }
        let want = self.sm_count as usize;
        let mut tv = hi;
        while tv > lo && rows * cfg.v_heads * (cfg.dv / tv) < want {
            tv /= 2;
        }
        tv
    }

    fn base_params(&self, layer: usize, op: i32, t: usize, tv: usize) -> Box<StepParams> {
        let (cfg, lay) = (&self.lay.cfg, &self.lay);
        Box::new(StepParams {
            state: lay.states[layer].addr as u64,
            snaps: lay.snaps.at(layer, 0) as u64,
            ring_u: lay.ring_u.at(layer, 0) as u64,
            ring_k: lay.ring_k.at(layer, 0) as u64,
            ring_g: lay.ring_g.at(layer, 0) as u64,
            meta: lay.meta.at(layer, 0) as u64,
            conv: lay.conv.at(layer, 0) as u64,
            sync: self.sync.addr() as u64,
            ids: 0,
            scratch: 0,
            layers: 0,
            seq_stride: lay.states[layer].seq_stride as i64,
            ring_u_lb: lay.ring_u.layer_bytes() as i64,
            ring_k_lb: lay.ring_k.layer_bytes() as i64,
            ring_g_lb: lay.ring_g.layer_bytes() as i64,
            meta_lb: lay.meta.layer_bytes() as i64,
            q: DevTensor::default(),
            k: DevTensor::default(),
            v: DevTensor::default(),
            g: DevTensor::default(),
            beta: DevTensor::default(),
            out: DevTensor::default(),
            conv_in: DevTensor::default(),
            skip: DevTensor::default(),
            gate: DevTensor::default(),
            a: DevTensor::default(),
            dt_bias: DevTensor::default(),
            op,
            b: 0,
            t: t as i32,
            hk: cfg.k_heads as i32,
            hv: cfg.v_heads as i32,
            dk: cfg.dk as i32,
            dv: cfg.dv as i32,
            l: cfg.ring_len as i32,
            thr: cfg.kv_only_threshold as i32,
            kv_cap: cfg.kv_only_capacity() as i32,
            max_drafts: cfg.max_drafts as i32,
            conv_dim: cfg.conv_dim as i32,
            conv_slots: cfg.conv_slots() as i32,
            entry_dtype: code(cfg.entry_dtype),
            conv_dtype: code(cfg.conv_dtype),
            tv: tv as i32,
            tiles: (cfg.dv / tv) as i32,
            auto_commit: 0,
            l2norm: 0,
            hmax: cfg.ring_len.max(cfg.kv_only_threshold) as i32,
            export_seq: -1,
            stages: 1,
            scale: 1.0,
            rule: KVR_GDN_RULE_DELTA,
            dt_mode: KVR_GDN_DT_NONE,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
            export_prefix: -1,
            kv_split: 0,
            vmajor: (cfg.layout == StateLayout::VMajor) as i32,
            live_u: 0,
            pad: 0,
            ids_inline: [0; MAX_INLINE],
        })
    }

    /// The step kernel (gdn.cu) for `tv` value rows per CTA.
    fn step_kernel(&self, tv: usize) -> Kernel {
        let cfg = &self.lay.cfg;
        Kernel::GdnStep {
            state: cfg.state_dtype,
            vmajor: cfg.layout == StateLayout::VMajor,
            wide: tv * cfg.dk > NARROW_NV * 4 * THREADS as usize,
        }
    }

    fn launch_step(&self, p: &mut StepParams, rows: usize, stream: Stream) -> Result<()> {
        let cfg = &self.lay.cfg;
        let kernel = self.step_kernel(p.tv as usize);
        let t = if p.op == OP_STEP { p.t as usize } else { 1 };
        let smem = smem_bytes(cfg.dk, p.tv as usize, t, p.hmax as usize);
        debug_assert!(smem <= STEP_SMEM_LIMIT);
        let grid = rows * cfg.v_heads * p.tiles as usize;
        self.run(kernel, grid, THREADS, smem, p, stream)?;
        if p.op != OP_EXPORT {
            self.finish(p, rows, stream)?;
        }
        Ok(())
    }

    /// The streaming decode kernel (`p.tv` value rows per CTA); it finishes the step itself.
    fn launch_stream(
        &self,
        p: &mut StepParams,
        launch: StreamLaunch,
        stream: Stream,
    ) -> Result<()> {
        let cfg = &self.lay.cfg;
        p.stages = launch.stages as i32;
        let kernel = Kernel::GdnStream {
            state: cfg.state_dtype,
            vmajor: cfg.layout == StateLayout::VMajor,
            dk: cfg.dk,
        };
        let smem = stream_smem_bytes(cfg, launch.rows, launch.stages) as u32;
        self.run(kernel, launch.grid, STREAM_THREADS, smem, p, stream)
    }

    /// The warp-streaming decode: the prep kernel, then the state kernel as its programmatic
    /// dependent, or at small batches of replay pools the one-launch kernel (`p.tv` = 32
    /// value rows per CTA).
    fn launch_wdecode(
        &self,
        p: &mut StepParams,
        (w, layer): (&WDecode, usize),
        rows: usize,
        stream: Stream,
    ) -> Result<()> {
        let cfg = &self.lay.cfg;
        p.scratch = w
            .scratch
            .as_ref()
            .map_or(0, |s| (s.addr() + layer * w.scratch_bytes) as u64);
        let spec = if rows < w.fused_rows_x {
            fdecode_spec(p)
        } else {
            None
        };
        if cfg.ring_len > 0 && (rows < w.fused_rows || spec.is_some()) {
            let (smem, pdl) = (w.fused_smem, w.fused_pdl);
            return match spec {
                Some(spec) => {
                    // The specialized builds take the compact kvr_gdn_fdecode_args.
                    let kernel = Kernel::GdnFDecodeX {
                        state: cfg.state_dtype,
                        ring32: w.ring32,
                        spec,
                    };
                    let mut a = fdecode_args(p);
                    let args = &mut a as *mut FDecodeArgs as *mut c_void;
                    self.launch_grid(kernel, (p.tiles, rows), args, smem, pdl, stream)
                }
                None => {
                    let kernel = Kernel::GdnFDecode {
                        state: cfg.state_dtype,
                        dk: cfg.dk,
                        ring32: w.ring32,
                    };
                    self.launch_rows_grid(kernel, p, rows, smem, pdl, stream)
                }
            };
        }
        // Recurrent pools without a conv window need no prep: the state kernel counts the step.
        let prep = cfg.ring_len > 0 || cfg.conv_dim > 0;
        if w.wrec && !prep {
            // Grid (tiles of 4 warps x KVR_GDN_WREC_ROWS rows, value heads, rows), a
            // programmatic dependent of the stream's previous kernel.
            let tv = WDECODE_WARPS * KVR_GDN_WREC_ROWS;
            p.tv = tv as i32;
            p.tiles = (cfg.dv / tv) as i32;
            let kernel = Kernel::GdnWRec {
                state: cfg.state_dtype,
                dk: cfg.dk,
            };
            return self.launch_rows_grid(kernel, p, rows, 0, w.fused_pdl, stream);
        }
        // The specialized pair where the call fits one (replay pools: a prep runs).
        let spec = if w.two_x && cfg.ring_len > 0 && (!w.kmajor || rows < w.kspec_rows) {
            fdecode_spec(p)
        } else {
            None
        };
        if prep {
            let kernel = match spec {
                Some(spec) => Kernel::GdnDPrepX {
                    ring32: w.ring32,
                    spec,
                },
                None => Kernel::GdnDPrep {
                    dk: cfg.dk,
                    ring32: w.ring32,
                },
            };
            // p.stages: the prep CTAs per batch row, for both kernels (which of them writes
            // the metadata).
            // A CTA per key head: a warp per two of its value heads, 2..16 warps (Mamba-2's
            // groups of 16 heads: 8 warps; with 2 the prep took 13 us at B = 8 on the H200).
            let (shares, threads, smem) = if let Some(s) = w.prep_shares {
                // (the whole row's shared memory: enough for any share)
                let heads = cfg.v_heads / s;
                let warps = heads.div_ceil(2).clamp(2, DPREP_THREADS as usize / 32);
                (s, 32 * warps as u32, w.prep_smem)
            } else if rows < w.prep_split_rows {
                let group = cfg.v_heads / cfg.k_heads;
                let warps = group.div_ceil(2).clamp(2, DPREP_THREADS as usize / 32);
                (cfg.k_heads, 32 * warps as u32, w.prep_smem_split)
            } else {
                (1, DPREP_THREADS, w.prep_smem)
            };
            p.stages = shares as i32;
            // A programmatic dependent of the stream's previous kernel (`prep_pdl_rows`), and always
            // after kvr_gdn_kvdec (pools with KV-only mode: p.thr > 0): the prep waits at
            // entry, and its CTAs are resident when the previous kernel ends (after the
            // KV-only step a plain launch cost the step a launch gap).
            self.run_ex(
                kernel,
                (rows * shares, threads, smem),
                p,
                stream,
                rows < w.prep_pdl_rows || p.thr > 0,
            )?;
        }
        let kernel = match spec {
            Some(spec) => wdecode_kernel_x(w.kmajor, cfg.state_dtype, w.ring32, spec),
            None => wdecode_kernel(w.kmajor, cfg.state_dtype, cfg.dk, cfg.ring_len),
        };
        // Grid (tiles, value heads, rows). A dependent of the prep kernel, or (recurrent
        // pools without one: the kernel waits at entry) of the stream's previous kernel.
        p.live_u = (prep && !w.kmajor && rows >= w.live_u_rows) as i32;
        let pdl = if prep { w.state_pdl } else { w.fused_pdl };
        self.launch_rows_grid(kernel, p, rows, 0, pdl, stream)
    }

    /// A warp-streaming kernel of 4 warps a CTA on the grid (`p.tiles`, value heads, `rows`),
    /// as a programmatic dependent of the stream's previous kernel where `pdl` (the kernel
    /// waits for it before its first read).
    fn launch_rows_grid(
        &self,
        kernel: Kernel,
        p: &mut StepParams,
        rows: usize,
        smem: u32,
        pdl: bool,
        stream: Stream,
    ) -> Result<()> {
        let args = p as *mut StepParams as *mut c_void;
        self.launch_grid(kernel, (p.tiles, rows), args, smem, pdl, stream)
    }

    /// `launch_rows_grid` with the kernel's parameter block `args` (grid (tiles, value
    /// heads, rows)).
    fn launch_grid(
        &self,
        kernel: Kernel,
        (tiles, rows): (i32, usize),
        args: *mut c_void,
        smem: u32,
        pdl: bool,
        stream: Stream,
    ) -> Result<()> {
        let grid = (tiles as u32, self.lay.cfg.v_heads as u32, rows as u32);
        let mut args = [args];
        self.cuda.launch_ex(
            kernel,
            grid,
            ((32 * WDECODE_WARPS) as u32, 1, 1),
            smem,
            stream,
            &mut args,
            pdl,
            0,
        )
    }

    /// `kvr_gdn_kvdec` (grid split x value heads x rows, clusters of `split` CTAs): the rows
    /// in KV-only mode, a programmatic dependent of the stream's previous kernel.
    fn launch_kvdec(
        &self,
        k: &KvDec,
        p: &mut StepParams,
        (rows, entries): (usize, usize),
        stream: Stream,
    ) -> Result<()> {
        let cfg = &self.lay.cfg;
        let ns = k.split(rows, cfg.v_heads, self.sm_count);
        p.tiles = ns as i32;
        // The entries each row's CTAs copy before the metadata arrives (0: none; at most
        // the threshold).
        let thr = cfg.kv_only_threshold;
        p.stages = if rows <= k.early_rows {
            thr
        } else if rows <= k.guess_rows {
            entries.min(thr)
        } else {
            0
        } as i32;
        let mut args = [p as *mut StepParams as *mut c_void];
        self.cuda.launch_ex(
            k.kernel,
            (ns as u32, cfg.v_heads as u32, rows as u32),
            (KVR_GDN_KVDEC_THREADS, 1, 1),
            k.smem[ns.trailing_zeros() as usize],
            stream,
            &mut args,
            true,
            if ns > 1 { ns as u32 } else { 0 },
        )
    }

    /// The single-token decode kernel (`p.tv` value rows per CTA, 8 per warp), then the
    /// finish kernel.
    fn launch_decode(
        &self,
        p: &mut StepParams,
        rows: usize,
        kv_only_rows: bool,
        stream: Stream,
    ) -> Result<()> {
        let cfg = &self.lay.cfg;
        let threads = 4 * p.tv as u32;
        if let Some(kernel) = self.kvonly.filter(|_| kv_only_rows) {
            if rows <= self.kvonly_inkernel_rows && threads == KVR_GDN_KVONLY_THREADS {
                p.kv_split = 2;
            } else {
                // The KV-only rows first (they read the metadata as the decode kernel does
                // and write nothing another row's CTA reads); the decode kernel skips them.
                p.kv_split = 1;
                self.run(
                    kernel,
                    rows * cfg.v_heads,
                    KVR_GDN_KVONLY_THREADS,
                    0,
                    p,
                    stream,
                )?;
            }
        }
        let kernel = Kernel::GdnDecode {
            state: cfg.state_dtype,
            vmajor: cfg.layout == StateLayout::VMajor,
            dk: cfg.dk,
        };
        let grid = rows * cfg.v_heads * p.tiles as usize;
        let smem = gdn_decode_smem_bytes(p.hmax as usize);
        self.run(kernel, grid, threads, smem, p, stream)?;
        self.finish(p, rows, stream)
    }

    /// Commits layers `layers` for the listed sequences in one launch per 256 rows.
    fn commit_launch(
        &self,
        layers: std::ops::Range<usize>,
        ids: &[i32],
        host: Option<&[i32]>,
        acc: Option<&TensorView>,
        (conv, all_layers): (Option<&TensorView>, bool),
        stream: Stream,
    ) -> Result<()> {
        let (cfg, lay) = (&self.lay.cfg, &self.lay);
        let recurrent = cfg.ring_len == 0;
        // A materialize's windows are [layers, conv_kernel - 1, conv_dim]: the layer stride
        // goes last (the kernel's row stride is unused with one row).
        let conv_arg = |t: &TensorView, b0: usize| match all_layers {
            true => {
                let st = t.strides();
                DevTensor {
                    p: t.addr() as u64,
                    s: [0, st[1] as i64, st[2] as i64, st[0] as i64],
                    dtype: code(t.dtype()),
                    pad: 0,
                }
            }
            false => dev_tensor(t, b0),
        };
        let chunks = if recurrent {
            cfg.state_bytes().div_ceil(64 * 1024).clamp(1, 64)
        } else {
            1
        };
        let mut b0 = 0;
        while b0 < ids.len() {
            let rows = (ids.len() - b0).min(MAX_COMMIT_INLINE);
            let mut p = Box::new(CommitParams {
                layers: self.layers.addr() as u64,
                snaps: lay.snaps.base as u64,
                meta: lay.meta.base as u64,
                conv: lay.conv.base as u64,
                accepted: 0,
                conv_out: conv.map_or(DevTensor::default(), |t| conv_arg(t, b0)),
                snap_layer_bytes: lay.snaps.layer_bytes() as i64,
                state_bytes: cfg.state_bytes() as i64,
                conv_layer_bytes: lay.conv.layer_bytes() as i64,
                layer0: layers.start as i32,
                max_seqs: cfg.max_seqs as i32,
                max_drafts: cfg.max_drafts as i32,
                recurrent: recurrent as i32,
                conv_dim: cfg.conv_dim as i32,
                conv_slots: cfg.conv_slots() as i32,
                conv_k1: cfg.conv_kernel as i32 - 1,
                conv_dtype: code(cfg.conv_dtype),
                chunks: chunks as i32,
                acc_stride: 1,
                state_es: cfg.state_dtype.size() as i32,
                pad: 0,
                ids: [0; MAX_COMMIT_INLINE],
                acc_inline: [0; MAX_COMMIT_INLINE],
            });
            p.ids[..rows].copy_from_slice(&ids[b0..b0 + rows]);
            match (host, acc) {
                (Some(h), _) => p.acc_inline[..rows].copy_from_slice(&h[b0..b0 + rows]),
                (None, Some(t)) => {
                    p.accepted = (t.addr() + b0 * t.strides()[0] as usize * 4) as u64;
                    p.acc_stride = t.strides()[0] as i32;
                }
                (None, None) => unreachable!("commit always has counts"),
            }
            let mut args = [&mut *p as *mut CommitParams as *mut c_void];
            self.cuda.launch(
                Kernel::GdnCommit,
                (rows as u32, chunks as u32, layers.len() as u32),
                (KVR_GDN_COMMIT_THREADS, 1, 1),
                0,
                stream,
                &mut args,
            )?;
            b0 += rows;
        }
        Ok(())
    }
}

impl Executor for ReplayCuda {
    fn reset_slot(&self, s: usize, m: &Meta, stream: Stream) -> Result<()> {
        let (cfg, lay, c) = (&self.lay.cfg, &self.lay, &*self.cuda);
        let mut patches = Vec::with_capacity(cfg.layers * META_INTS);
        for layer in 0..cfg.layers {
            c.memset_async(lay.state(layer, s), 0, cfg.state_bytes(), stream)?;
            if lay.conv.slot_bytes > 0 {
                c.memset_async(lay.conv.at(layer, s), 0, lay.conv.slot_bytes, stream)?;
            }
            for (f, &v) in m.iter().enumerate() {
                patches.push((lay.meta_index(layer, s, f), v));
            }
        }
        patch_i32(c, lay.meta.base, &patches, stream)
    }

    fn import_state(
        &self,
        l: usize,
        s: usize,
        state: &TensorView,
        conv: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let (cfg, lay, c) = (&self.lay.cfg, &self.lay, &*self.cuda);
        let slot = TensorView::contiguous(
            lay.state(l, s),
            cfg.state_dtype,
            MemoryKind::Cuda,
            state.shape(),
        )?;
        c.copy(state, &slot, stream)?;
        let field = |f: usize| lay.meta_index(l, s, f);
        let mut patches = vec![
            (field(META_MODE), meta::imported_mode(cfg)),
            (field(META_START), 0),
            (field(META_H), 0),
            (field(META_PENDING), 0),
        ];
        if let Some(cw) = conv {
            let dst = TensorView::contiguous(
                lay.conv(l, s, 0),
                cfg.conv_dtype,
                MemoryKind::Cuda,
                cw.shape(),
            )?;
            c.copy(cw, &dst, stream)?;
            patches.push((field(META_CONV_END), (cfg.conv_kernel - 1) as i32));
        }
        patch_i32(c, lay.meta.base, &patches, stream)
    }

    fn export_state(
        &self,
        l: usize,
        s: usize,
        out: &TensorView,
        conv: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let tv = self.tile(&self.lay.cfg, 1);
        let mut p = self.base_params(l, OP_EXPORT, 0, tv);
        p.b = 1;
        p.export_seq = s as i32;
        p.out = dev_tensor(out, 0);
        self.launch_step(&mut p, 1, stream)?;
        if let Some(cw) = conv {
            // The commit kernel with nothing pending writes the window and changes nothing.
            let view = TensorView::new(
                cw.addr(),
                cw.dtype(),
                cw.memory(),
                &[1, cw.shape()[0], cw.shape()[1]],
                &[0, cw.strides()[0], cw.strides()[1]],
            )?;
            let zero = [0i32];
            self.commit_launch(
                l..l + 1,
                &[s as i32],
                Some(&zero),
                None,
                (Some(&view), false),
                stream,
            )?;
        }
        Ok(())
    }

    fn materialize(
        &self,
        s: usize,
        keep: usize,
        out: &TensorView,
        conv: Option<&TensorView>,
        stream: Stream,
    ) -> Result<()> {
        let cfg = &self.lay.cfg;
        let tv = self.tile(cfg, 1);
        let mut p = self.base_params(0, OP_EXPORT, 0, tv);
        p.b = 1;
        p.export_seq = s as i32;
        p.export_prefix = keep as i32;
        p.layers = self.layers.addr() as u64;
        // out: [layers, Hv, a, b] -> the kernel's [Hv, a, b] strides, the layer stride last.
        let st = out.strides();
        p.out = DevTensor {
            p: out.addr() as u64,
            s: [st[1] as i64, st[2] as i64, st[3] as i64, st[0] as i64],
            dtype: code(out.dtype()),
            pad: 0,
        };
        let kernel = self.step_kernel(p.tv as usize);
        let smem = smem_bytes(cfg.dk, p.tv as usize, 1, p.hmax as usize);
        let grid = cfg.v_heads * p.tiles as usize;
        let mut args = [&mut *p as *mut StepParams as *mut c_void];
        self.cuda.launch(
            kernel,
            (grid as u32, cfg.layers as u32, 1),
            (THREADS, 1, 1),
            smem,
            stream,
            &mut args,
        )?;
        if let Some(cw) = conv {
            let zero = [0i32];
            self.commit_launch(
                0..cfg.layers,
                &[s as i32],
                Some(&zero),
                None,
                (Some(cw), true),
                stream,
            )?;
        }
        Ok(())
    }

    fn step(&self, step: &Step<'_>, stream: Stream) -> Result<()> {
        let cfg = &self.lay.cfg;
        let plan = step.plan;
        if step.b == 0 {
            return Ok(());
        }
        // One token per sequence with auto-commit: a decode kernel where one applies. The
        // streaming and single-token decode kernels implement the delta rule only (the
        // additive rule decodes on the warp-streaming kernel or gdn.cu).
        let single = step.t == 1 && step.auto_commit && plan.rule == Rule::Delta;
        let decode = self.decode_rows.filter(|_| single);
        // Pools with KV-only mode (where the warp-streaming decode applies to them):
        // kvr_gdn_kvdec first, then the warp-streaming decode at every batch size.
        let kvdec = self
            .kvdec
            .as_ref()
            .filter(|_| step.t == 1 && step.auto_commit);
        // The warp-streaming decode takes both rules.
        let wd = self
            .wdecode
            .as_ref()
            .filter(|_| step.t == 1 && step.auto_commit);
        // The warp-streaming verify takes both rules and every T.
        let wverify = self.wverify.filter(|_| !step.auto_commit);
        // Launches of at most `verify_chunk` rows where a verify writes the scratch (host
        // ids also travel inline), in equal shares.
        let verify_scratch = !step.auto_commit && self.scratch.is_some();
        let chunk_rows = match step.ids {
            _ if verify_scratch => self.verify_chunk,
            BatchIds::Host(_) => MAX_INLINE,
            BatchIds::Device(_) => usize::MAX,
        }
        .min(wd.map_or(usize::MAX, |w| w.rows));
        let chunk_rows = step.b.div_ceil(step.b.div_ceil(chunk_rows));
        let mut b0 = 0;
        while b0 < step.b {
            let rows = (step.b - b0).min(chunk_rows);
            let wdecoded = wd.filter(|w| rows >= w.min_rows || kvdec.is_some());
            let streamed = if single && wdecoded.is_none() {
                self.stream_launch(cfg, rows)
            } else {
                None
            };
            // The streaming verify takes both rules.
            let verified = if step.auto_commit || wverify.is_some() {
                None
            } else {
                self.verify_launch(cfg, rows, step.t, plan.rule == Rule::Additive)
            };
            let tv = wdecoded
                .map(|_| WDECODE_WARPS * KVR_GDN_WDECODE_ROWS)
                .or(streamed.map(|s| s.rows))
                .or(wverify.map(|_| WDECODE_WARPS * KVR_GDN_WDECODE_ROWS))
                .or(verified)
                .or(decode)
                .unwrap_or_else(|| self.tile(cfg, rows));
            let mut p = self.base_params(step.layer, OP_STEP, step.t, tv);
            p.b = rows as i32;
            p.auto_commit = step.auto_commit as i32;
            p.l2norm = plan.l2norm as i32;
            p.scale = plan.scale;
            p.q = dev_tensor(&plan.q, b0);
            p.k = dev_tensor(&plan.k, b0);
            p.v = dev_tensor(&plan.v, b0);
            p.out = dev_tensor(&plan.out, b0);
            plan_args(&mut p, plan, b0);
            if let Some(ci) = &plan.conv_in {
                p.conv_in = dev_tensor(ci, b0);
            }
            match step.ids {
                BatchIds::Host(ids) => p.ids_inline[..rows].copy_from_slice(&ids[b0..b0 + rows]),
                BatchIds::Device(addr) => p.ids = (addr + b0 * 4) as u64,
            }
            if let Some(k) = kvdec {
                self.launch_kvdec(k, &mut p.clone(), (rows, step.kv_only_entries), stream)?;
                // The replay kernels skip the KV-only rows; where the host's bound says some
                // row may be one, they read its record before its state.
                p.kv_split = step.kv_only_rows as i32;
            }
            if let Some(w) = wdecoded {
                self.launch_wdecode(&mut p, (w, step.layer), rows, stream)?;
            } else if let Some(launch) = streamed {
                self.launch_stream(&mut p, launch, stream)?;
            } else if let Some(w) = wverify {
                self.launch_wverify(&mut p, w, rows, stream)?;
            } else if verified.is_some() {
                self.launch_verify(&mut p, rows, stream)?;
            } else if decode.is_some() {
                self.launch_decode(&mut p, rows, step.kv_only_rows, stream)?;
            } else {
                self.launch_step(&mut p, rows, stream)?;
            }
            b0 += rows;
        }
        Ok(())
    }

    fn commit(&self, c: &Commit<'_>, stream: Stream) -> Result<()> {
        self.commit_launch(
            c.layers.clone(),
            c.ids,
            c.host_accepted,
            Some(c.accepted),
            (c.conv_state, false),
            stream,
        )
    }

    fn flush(&self, l: usize, ids: &[i32], stream: Stream) -> Result<()> {
        let tv = self.tile(&self.lay.cfg, ids.len());
        for chunk in ids.chunks(MAX_INLINE) {
            let mut p = self.base_params(l, OP_FLUSH, 0, tv);
            p.b = chunk.len() as i32;
            p.ids_inline[..chunk.len()].copy_from_slice(chunk);
            self.launch_step(&mut p, chunk.len(), stream)?;
        }
        Ok(())
    }

    fn read_meta(&self, layer: usize, slot: usize) -> Result<Meta> {
        let mut bytes = [0u8; META_INTS * 4];
        self.cuda
            .read_device(self.lay.meta(layer, slot), &mut bytes, Stream::DEFAULT)?;
        let mut m = [0i32; META_INTS];
        for (i, v) in m.iter_mut().enumerate() {
            *v = i32::from_ne_bytes(bytes[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_fit_and_tiles_exist() {
        assert!(
            size_of::<StepParams>() <= 4096,
            "{}",
            size_of::<StepParams>()
        );
        assert!(size_of::<CommitParams>() <= 4096);
        for dk in [32, 64, 128, 256] {
            for dv in [32, 64, 128, 256] {
                let (lo, hi) = tile_range(dk, dv).expect("a tiling");
                assert!(lo <= hi && dv % hi == 0);
                assert!(smem_bytes(dk, hi, 8, 1024) <= STEP_SMEM_LIMIT);
                assert!(smem_bytes(dk, lo, 8, 1024) <= STEP_SMEM_LIMIT);
            }
        }
    }

    #[test]
    fn one_launch_rows_fill_one_wave() {
        // H200, 4 resident one-launch CTAs per SM: GDN (32 heads x 4 tiles) up to 4 rows,
        // Mamba-2 (128 heads x 2 tiles) up to 2, the measured crossovers.
        assert_eq!(fused_rows_one_wave(128, 132 * 4), 5);
        assert_eq!(fused_rows_one_wave(256, 132 * 4), 3);
        // A row that alone exceeds a wave still decodes in one launch; no division by zero.
        assert_eq!(fused_rows_one_wave(4096, 528), 2);
        assert_eq!(fused_rows_one_wave(0, 528), 529);
    }
}
