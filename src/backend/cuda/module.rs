//! The embedded fatbin and the kernels in it.

use std::ffi::CString;

use cudarc::driver::sys;

use super::driver::check;
use crate::error::{Error, Result};
use crate::tensor::DType;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The fatbin built from `kernels/*.cu`, or `None` when the library was built without nvcc.
pub(crate) fn fatbin() -> Option<&'static [u8]> {
    embedded::FATBIN
}

/// How the kernels were built (nvcc version and targets), or why they were not.
pub fn build_info() -> &'static str {
    embedded::BUILD_INFO
}

/// True when the library carries CUDA kernels.
pub fn kernels_compiled() -> bool {
    embedded::FATBIN.is_some()
}

/// Index of a float dtype in kernel tables; i32 shares f32's slot (4-byte bit copies).
fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 | DType::I32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// (dk, dv) of the KV-only decode kernel of classified rows (`kvr_gdn_kvdec_*`).
pub const GDN_KVDEC_SHAPES: [(usize, usize); 4] = [(64, 64), (128, 128), (256, 256), (128, 64)];

/// Head dimensions the CUDA decode kernel is compiled for.
pub const DECODE_HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];

/// Every kernel the library launches. Each has a fixed slot in [`LoadedModule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `kvr_copy_<src>_<dst>` (kernels/copy.cu).
    Copy { src: DType, dst: DType },
    /// `kvr_kv_patch` (kernels/kv_pool.cu).
    KvPatch,
    /// `kvr_kv_copy_pages` (kernels/kv_pool.cu).
    KvCopyPages,
    /// `kvr_kv_write_<src>_<dst>` (kernels/kv_pool.cu).
    KvWrite { src: DType, dst: DType },
    /// `kvr_kv_decode_<kv>_d<head_dim>` (kernels/kv_decode.cu); kv is f16 or bf16.
    KvDecode { kv: DType, head_dim: usize },
    /// The split decode kernels (kernels/kv_decode.cu), `kvr_kv_<s|c|b>decode_<kv>_d<head_dim>`
    /// by [`SplitKind`].
    KvSplitDecode {
        kv: DType,
        head_dim: usize,
        kind: SplitKind,
    },
    /// `kvr_gdn_step_<state>_<k|v>_nv<8|16>` (kernels/gdn.cu); state is f32 or bf16,
    /// V-major or not; `wide` holds 16 float4 of state per thread instead of 8.
    GdnStep {
        state: DType,
        vmajor: bool,
        wide: bool,
    },
    /// `kvr_gdn_commit` (kernels/gdn.cu).
    GdnCommit,
    /// `kvr_gdn_finish` (kernels/gdn.cu): per-sequence bookkeeping after a step.
    GdnFinish,
    /// `kvr_gdn_decode_<state>_<k|v>_d<dk>` (kernels/gdn_decode.cu): single-token decode;
    /// dk is one of [`GDN_DECODE_DKS`].
    GdnDecode {
        state: DType,
        vmajor: bool,
        dk: usize,
    },
    /// `kvr_gdn_sdecode_<state>_<k|v>_d<dk>` (kernels/gdn_stream.cu): single-token decode
    /// with the state tile streamed into shared memory; dk is one of [`GDN_DECODE_DKS`].
    GdnStream {
        state: DType,
        vmajor: bool,
        dk: usize,
    },
    /// `kvr_gdn_sverify_<state>_<k|v>_d<dk>` (kernels/gdn_sverify.cu): speculative verify
    /// of T drafts with the state tile streamed into shared memory; dk is one of
    /// [`GDN_DECODE_DKS`].
    GdnVerify {
        state: DType,
        vmajor: bool,
        dk: usize,
        /// `_add`: the additive rule (Mamba-2, linear attention), else the delta rule.
        additive: bool,
    },
    /// `kvr_gdn_vprep_d<dk>` (kernels/gdn_sverify.cu): the drafts' q/k and key products of
    /// a verify, per (row, key head); dk is one of [`GDN_DECODE_DKS`].
    GdnVprep { dk: usize },
    /// `kvr_gdn_recur_d<dk>_r<rows>` (kernels/gdn_recur.cu): the stateless recurrent step
    /// over the caller's tensors; dk in [`GDN_RECUR_DKS`], rows per warp in [`GDN_RECUR_ROWS`].
    GdnRecur { dk: usize, rows: usize },
    /// `kvr_gdn_recur1[n]_d<dk>_r<rows>` (kernels/gdn_recur.cu): its one-token f32 form
    /// (`n`: q and k L2-normalized in the kernel); dk in [`GDN_RECUR_DKS`], rows per warp
    /// in [`GDN_RECUR_ROWS`].
    GdnRecur1 { dk: usize, rows: usize, norm: bool },
    /// `kvr_gdn_dprep_d<dk>_r<16|32>` (kernels/gdn_wdecode.cu): the per-sequence part of the
    /// warp-streaming decode (metadata, key products, weights, new key and decay); dk in
    /// [`GDN_DECODE_DKS`], rings of up to 16 or 32 entries.
    GdnDPrep { dk: usize, ring32: bool },
    /// `kvr_gdn_wdecode_<state>_v_d<dk>_r<ring>` (kernels/gdn_wdecode.cu): the
    /// warp-streaming decode of V-major states; `ring` is one of [`GDN_WDECODE_RINGS`]
    /// (0: recurrent pools; else rings of up to that many entries).
    GdnWDecode {
        state: DType,
        dk: usize,
        ring: usize,
    },
    /// `kvr_gdn_wdecode_<state>_k_d<dk>_r<ring>` (kernels/gdn_wdecode.cu): the same decode
    /// for K-major states (a warp per quarter of the keys, float4 rows of 4 value rows a
    /// lane); `ring` as for [`Kernel::GdnWDecode`].
    GdnKDecode {
        state: DType,
        dk: usize,
        ring: usize,
    },
    /// `kvr_wgkv_scatter` (kernels/wgkv.cu): row copies of the write-gated KV mode.
    WgKvScatter,
    /// `kvr_gdn_wrec_<state>_v_d<dk>` (kernels/gdn_wdecode.cu): the recurrent pools' state
    /// kernel where no prep kernel runs (ring 0, no conv window), `KVR_GDN_WREC_ROWS` value
    /// rows per warp; dk in [`GDN_DECODE_DKS`].
    GdnWRec { state: DType, dk: usize },
    /// `kvr_wgkv_step` (kernels/wgkv.cu): one decode step of write-gated rows on the device.
    WgKvStep,
    /// `kvr_wgkv_move` (kernels/wgkv.cu): the same step with the gate CTAs' code out of
    /// line, so the mover CTAs' code is compact (fetched cold in a layer's step);
    /// experimental, launched with `KVR_WGKV_MOVE=1`.
    WgKvMove,
    /// `kvr_gdn_fdecode_<state>_v_d<dk>_r<16|32>` (kernels/gdn_wdecode.cu): the warp-streaming
    /// decode of replay pools in one launch (small batches); dk in [`GDN_DECODE_DKS`], rings
    /// of up to 16 or 32 entries.
    GdnFDecode {
        state: DType,
        dk: usize,
        ring32: bool,
    },
    /// `kvr_gdn_kvonly_<state>_d<dk>` (kernels/gdn_kvonly.cu): single-token decode of the
    /// KV-only sequences of a batch (beside [`Kernel::GdnDecode`]); dk in [`GDN_DECODE_DKS`].
    GdnKvOnly { state: DType, dk: usize },
    /// `kvr_gdn_kvdec_<state>_d<dk>_v<dv>` (kernels/gdn_kvdec.cu): single-token decode of
    /// the KV-only rows (and the states of those that reach the threshold) before the
    /// warp-streaming decode, `tiles` CTAs (a cluster) per row and value head; (dk, dv) in
    /// [`GDN_KVDEC_SHAPES`].
    GdnKvDec { state: DType, dk: usize, dv: usize },
    /// `kvr_gdn_fdecode_<state>_v_d128_r<16|32>_<spec>` (kernels/gdn_wdecode.cu): the
    /// one-launch kernel specialized for dk 128, a ring of exactly 16 or 32, f32 entries, no
    /// conv window and the dtypes and rule of `spec`.
    GdnFDecodeX {
        state: DType,
        ring32: bool,
        spec: FdSpec,
    },
    /// `kvr_gdn_wvprep_d<dk>` (kernels/gdn_wverify.cu): the per-(row, key head) part of the
    /// warp-streaming verify; dk in [`GDN_WVERIFY_DKS`]. With `ring16` (dk 128 only),
    /// `kvr_gdn_wvprep_d128_r16`: the records of the `ring16` [`Kernel::GdnWVerifyX`] builds;
    /// with `w4` too, `kvr_gdn_wvprep_d128_r16_w4`: the same in CTAs of
    /// `KVR_GDN_WVPREP_W4_DRAFTS` warps, for rounds of at most as many drafts.
    GdnWVprep { dk: usize, ring16: bool, w4: bool },
    /// `kvr_gdn_wverify_<state>_v_d<dk>_t<4|8>[_add]` (kernels/gdn_wverify.cu): the
    /// warp-streaming verify of V-major states, up to 4 or 8 drafts (`t8`), the additive rule
    /// or the delta rule; dk in [`GDN_WVERIFY_DKS`].
    GdnWVerify {
        state: DType,
        dk: usize,
        t8: bool,
        additive: bool,
    },
    /// `kvr_gdn_wverify_<state>_v_d128_t<4|8>_<spec>` (kernels/gdn_wverify.cu): the
    /// warp-streaming verify specialized like [`Kernel::GdnFDecodeX`] (dk 128, f32 entries, no
    /// conv window, the dtypes and rule of `spec`; any ring length, or with `ring16` (name
    /// suffix `_r16`) rings of up to 16 entries, a quarter of the ring's per-lane work).
    GdnWVerifyX {
        state: DType,
        t8: bool,
        spec: FdSpec,
        ring16: bool,
    },
    /// `kvr_gdn_wdecode_<state>_v_d128_r<16|32>_<spec>` (kernels/gdn_wdecode.cu): the state
    /// kernel of the two-launch decode specialized like [`Kernel::GdnFDecodeX`].
    GdnWDecodeX {
        state: DType,
        ring32: bool,
        spec: FdSpec,
    },
    /// `kvr_gdn_dprep_d128_r<16|32>_<spec>` (kernels/gdn_wdecode.cu): its prep kernel,
    /// specialized the same way.
    GdnDPrepX { ring32: bool, spec: FdSpec },
    /// `kvr_gdn_wdecode_<state>_k_d128_r<16|32>_<spec>` (kernels/gdn_wdecode.cu):
    /// [`Kernel::GdnKDecode`] specialized like [`Kernel::GdnWDecodeX`].
    GdnKDecodeX {
        state: DType,
        ring32: bool,
        spec: FdSpec,
    },
    /// `kvr_gdn_wverify_<state>_k_d<dk>_t<4|8>[_add][_r16]` (kernels/gdn_wverify.cu): the
    /// warp-streaming verify of K-major states (a warp per quarter of the keys, float4 rows of
    /// 4 value rows a lane), after [`Kernel::GdnWVprep`] (not `ring16`: its records have 64
    /// slots); with `ring16`, rings of up to 16 entries (one slot per (warp, part) owner instead
    /// of 4). dk in [`GDN_WVERIFY_DKS`].
    GdnKVerify {
        state: DType,
        dk: usize,
        t8: bool,
        additive: bool,
        ring16: bool,
    },
}

/// What a specialized one-launch decode kernel ([`Kernel::GdnFDecodeX`]) fixes besides its
/// shape (kernels/gdn_wdecode.cu, `FdFix` / `FdFixM2`); q, k, v row-contiguous in each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FdSpec {
    /// The delta rule without dt gate, skip or gate; q, k, v, beta, g and the output F32.
    DeltaF32,
    /// The same with q, k, v, beta and the output BF16 (g F32).
    DeltaBf16,
    /// Mamba-2: the additive rule, dt through softplus; x, B, C, z and the output BF16, dt,
    /// A, dt_bias and D F32.
    Mamba2Bf16,
}

impl FdSpec {
    pub(crate) const ALL: [FdSpec; 3] = [FdSpec::DeltaF32, FdSpec::DeltaBf16, FdSpec::Mamba2Bf16];

    fn name(self) -> &'static str {
        match self {
            FdSpec::DeltaF32 => "xf32",
            FdSpec::DeltaBf16 => "xbf16",
            FdSpec::Mamba2Bf16 => "m2bf16",
        }
    }
}

/// Ring lengths the warp-streaming decode kernels are compiled for (0: recurrent pools).
pub const GDN_WDECODE_RINGS: [usize; 3] = [0, 16, 32];

/// Key dimensions the fast GDN decode kernel is compiled for.
pub const GDN_DECODE_DKS: [usize; 3] = [64, 128, 256];

/// Key dimensions and value rows per warp of the stateless recurrent kernel.
pub const GDN_RECUR_DKS: [usize; 4] = [32, 64, 128, 256];
pub const GDN_RECUR_ROWS: [usize; 3] = [1, 2, 4];

const COPY_BASE: usize = 0;
const KV_PATCH: usize = 9;
const KV_COPY_PAGES: usize = 10;
const KV_WRITE_BASE: usize = 11;
const KV_DECODE_BASE: usize = 20;
const GDN_STEP_BASE: usize = 30;
const GDN_COMMIT: usize = 38;
const GDN_FINISH: usize = 39;
const GDN_DECODE_BASE: usize = 40;
const GDN_STREAM_BASE: usize = 52;
const GDN_VERIFY_BASE: usize = 64;
const GDN_VPREP_BASE: usize = 76;
const GDN_RECUR_BASE: usize = 79;
const GDN_DPREP_BASE: usize = 91;
const GDN_WDECODE_BASE: usize = 97;
const WGKV_SCATTER: usize = 115;
const GDN_FDECODE_BASE: usize = 116;
const GDN_VERIFY_ADD_BASE: usize = 128;
const GDN_KVONLY_BASE: usize = 140;
const GDN_RECUR1_BASE: usize = 146;
const GDN_FDECODE_X_BASE: usize = 170;
const KV_SPLIT_DECODE_BASE: usize = 182;
const WGKV_STEP: usize = 212;
const GDN_WREC_BASE: usize = 213;
const GDN_WVPREP_BASE: usize = 219;
const GDN_WVERIFY_BASE: usize = 221;
const GDN_WVERIFY_X_BASE: usize = 237;
const GDN_WVPREP_R16: usize = 261;
const GDN_WDECODE_X_BASE: usize = 262;
const GDN_DPREP_X_BASE: usize = 274;
const GDN_KDECODE_BASE: usize = 280;
const GDN_KDECODE_X_BASE: usize = 298;
const GDN_KVERIFY_BASE: usize = 310;
const GDN_KVDEC_BASE: usize = 342;
const GDN_WVPREP_R16_W4: usize = 350;
const WGKV_MOVE: usize = 351;
const KERNEL_COUNT: usize = 352;

/// Key dims the warp-streaming verify is compiled for.
pub const GDN_WVERIFY_DKS: [usize; 2] = [64, 128];

/// The builds of the split decode body (kernels/kv_decode.cu `sdecode_body`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum SplitKind {
    /// `kvr_kv_sdecode_*`: short batches, two groups of 4 warps per CTA up to head dim 128.
    Split,
    /// `kvr_kv_cdecode_*`: the same with a row's parts merged in a thread-block cluster.
    Cluster,
    /// `kvr_kv_bdecode_*`: one group per CTA (two CTAs per SM up to head dim 128), for batches
    /// of more rows than the split kernel's wave.
    Batch,
}

impl SplitKind {
    pub(crate) const ALL: [SplitKind; 3] = [SplitKind::Split, SplitKind::Cluster, SplitKind::Batch];

    fn letter(self) -> char {
        match self {
            SplitKind::Split => 's',
            SplitKind::Cluster => 'c',
            SplitKind::Batch => 'b',
        }
    }
}

impl Kernel {
    /// Every kernel, in slot order.
    pub(crate) fn all() -> Vec<Kernel> {
        let mut v = Vec::with_capacity(KERNEL_COUNT);
        for src in DType::FLOATS {
            for dst in DType::FLOATS {
                v.push(Kernel::Copy { src, dst });
            }
        }
        v.push(Kernel::KvPatch);
        v.push(Kernel::KvCopyPages);
        for src in DType::FLOATS {
            for dst in DType::FLOATS {
                v.push(Kernel::KvWrite { src, dst });
            }
        }
        for kv in [DType::F16, DType::BF16] {
            for head_dim in DECODE_HEAD_DIMS {
                v.push(Kernel::KvDecode { kv, head_dim });
            }
        }
        for wide in [false, true] {
            for state in [DType::F32, DType::BF16] {
                for vmajor in [false, true] {
                    v.push(Kernel::GdnStep {
                        state,
                        vmajor,
                        wide,
                    });
                }
            }
        }
        v.push(Kernel::GdnCommit);
        v.push(Kernel::GdnFinish);
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                for vmajor in [false, true] {
                    v.push(Kernel::GdnDecode { state, vmajor, dk });
                }
            }
        }
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                for vmajor in [false, true] {
                    v.push(Kernel::GdnStream { state, vmajor, dk });
                }
            }
        }
        let verify = |v: &mut Vec<Kernel>, additive: bool| {
            for dk in GDN_DECODE_DKS {
                for state in [DType::F32, DType::BF16] {
                    for vmajor in [false, true] {
                        v.push(Kernel::GdnVerify {
                            state,
                            vmajor,
                            dk,
                            additive,
                        });
                    }
                }
            }
        };
        verify(&mut v, false);
        for dk in GDN_DECODE_DKS {
            v.push(Kernel::GdnVprep { dk });
        }
        for dk in GDN_RECUR_DKS {
            for rows in GDN_RECUR_ROWS {
                v.push(Kernel::GdnRecur { dk, rows });
            }
        }
        for dk in GDN_DECODE_DKS {
            for ring32 in [false, true] {
                v.push(Kernel::GdnDPrep { dk, ring32 });
            }
        }
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                for ring in GDN_WDECODE_RINGS {
                    v.push(Kernel::GdnWDecode { state, dk, ring });
                }
            }
        }
        v.push(Kernel::WgKvScatter);
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                for ring32 in [false, true] {
                    v.push(Kernel::GdnFDecode { state, dk, ring32 });
                }
            }
        }
        verify(&mut v, true);
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                v.push(Kernel::GdnKvOnly { state, dk });
            }
        }
        for dk in GDN_RECUR_DKS {
            for rows in GDN_RECUR_ROWS {
                for norm in [false, true] {
                    v.push(Kernel::GdnRecur1 { dk, rows, norm });
                }
            }
        }
        for state in [DType::F32, DType::BF16] {
            for ring32 in [false, true] {
                for spec in FdSpec::ALL {
                    v.push(Kernel::GdnFDecodeX {
                        state,
                        ring32,
                        spec,
                    });
                }
            }
        }
        for kind in SplitKind::ALL {
            for kv in [DType::F16, DType::BF16] {
                for head_dim in DECODE_HEAD_DIMS {
                    v.push(Kernel::KvSplitDecode { kv, head_dim, kind });
                }
            }
        }
        v.push(Kernel::WgKvStep);
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                v.push(Kernel::GdnWRec { state, dk });
            }
        }
        for dk in GDN_WVERIFY_DKS {
            v.push(Kernel::GdnWVprep {
                dk,
                ring16: false,
                w4: false,
            });
        }
        for dk in GDN_WVERIFY_DKS {
            for state in [DType::F32, DType::BF16] {
                for t8 in [false, true] {
                    for additive in [false, true] {
                        v.push(Kernel::GdnWVerify {
                            state,
                            dk,
                            t8,
                            additive,
                        });
                    }
                }
            }
        }
        for state in [DType::F32, DType::BF16] {
            for t8 in [false, true] {
                for spec in FdSpec::ALL {
                    for ring16 in [false, true] {
                        v.push(Kernel::GdnWVerifyX {
                            state,
                            t8,
                            spec,
                            ring16,
                        });
                    }
                }
            }
        }
        v.push(Kernel::GdnWVprep {
            dk: 128,
            ring16: true,
            w4: false,
        });
        for state in [DType::F32, DType::BF16] {
            for ring32 in [false, true] {
                for spec in FdSpec::ALL {
                    v.push(Kernel::GdnWDecodeX {
                        state,
                        ring32,
                        spec,
                    });
                }
            }
        }
        for ring32 in [false, true] {
            for spec in FdSpec::ALL {
                v.push(Kernel::GdnDPrepX { ring32, spec });
            }
        }
        for dk in GDN_DECODE_DKS {
            for state in [DType::F32, DType::BF16] {
                for ring in GDN_WDECODE_RINGS {
                    v.push(Kernel::GdnKDecode { state, dk, ring });
                }
            }
        }
        for state in [DType::F32, DType::BF16] {
            for ring32 in [false, true] {
                for spec in FdSpec::ALL {
                    v.push(Kernel::GdnKDecodeX {
                        state,
                        ring32,
                        spec,
                    });
                }
            }
        }
        for dk in GDN_WVERIFY_DKS {
            for state in [DType::F32, DType::BF16] {
                for t8 in [false, true] {
                    for additive in [false, true] {
                        for ring16 in [false, true] {
                            v.push(Kernel::GdnKVerify {
                                state,
                                dk,
                                t8,
                                additive,
                                ring16,
                            });
                        }
                    }
                }
            }
        }
        for (dk, dv) in GDN_KVDEC_SHAPES {
            for state in [DType::F32, DType::BF16] {
                v.push(Kernel::GdnKvDec { state, dk, dv });
            }
        }
        v.push(Kernel::GdnWVprep {
            dk: 128,
            ring16: true,
            w4: true,
        });
        v.push(Kernel::WgKvMove);
        debug_assert_eq!(v.len(), KERNEL_COUNT);
        v
    }

    /// The kernel's slot.
    pub(crate) fn index(self) -> usize {
        match self {
            Kernel::Copy { src, dst } => COPY_BASE + dtype_index(src) * 3 + dtype_index(dst),
            Kernel::KvPatch => KV_PATCH,
            Kernel::KvCopyPages => KV_COPY_PAGES,
            Kernel::KvWrite { src, dst } => KV_WRITE_BASE + dtype_index(src) * 3 + dtype_index(dst),
            Kernel::KvDecode { kv, head_dim } => {
                let d = DECODE_HEAD_DIMS
                    .iter()
                    .position(|&x| x == head_dim)
                    .expect("a compiled head dim");
                KV_DECODE_BASE + (dtype_index(kv) - 1) * DECODE_HEAD_DIMS.len() + d
            }
            Kernel::GdnStep {
                state,
                vmajor,
                wide,
            } => {
                GDN_STEP_BASE
                    + 4 * wide as usize
                    + if state == DType::BF16 { 2 } else { 0 }
                    + vmajor as usize
            }
            Kernel::GdnCommit => GDN_COMMIT,
            Kernel::GdnFinish => GDN_FINISH,
            Kernel::GdnDecode { state, vmajor, dk } => {
                GDN_DECODE_BASE + gdn_decode_slot(state, vmajor, dk)
            }
            Kernel::GdnStream { state, vmajor, dk } => {
                GDN_STREAM_BASE + gdn_decode_slot(state, vmajor, dk)
            }
            Kernel::GdnVerify {
                state,
                vmajor,
                dk,
                additive,
            } => {
                let base = if additive {
                    GDN_VERIFY_ADD_BASE
                } else {
                    GDN_VERIFY_BASE
                };
                base + gdn_decode_slot(state, vmajor, dk)
            }
            Kernel::GdnVprep { dk } => GDN_VPREP_BASE + dk_slot(dk),
            Kernel::GdnRecur { dk, rows } => {
                let d = GDN_RECUR_DKS.iter().position(|&x| x == dk);
                let r = GDN_RECUR_ROWS.iter().position(|&x| x == rows);
                GDN_RECUR_BASE
                    + d.expect("a compiled recurrent dk") * GDN_RECUR_ROWS.len()
                    + r.expect("compiled rows per warp")
            }
            Kernel::GdnRecur1 { dk, rows, norm } => {
                let d = GDN_RECUR_DKS.iter().position(|&x| x == dk);
                let r = GDN_RECUR_ROWS.iter().position(|&x| x == rows);
                GDN_RECUR1_BASE
                    + 2 * (d.expect("a compiled recurrent dk") * GDN_RECUR_ROWS.len()
                        + r.expect("compiled rows per warp"))
                    + norm as usize
            }
            Kernel::GdnDPrep { dk, ring32 } => GDN_DPREP_BASE + 2 * dk_slot(dk) + ring32 as usize,
            Kernel::GdnWDecode { state, dk, ring } => {
                let r = GDN_WDECODE_RINGS.iter().position(|&x| x == ring);
                GDN_WDECODE_BASE
                    + 6 * dk_slot(dk)
                    + if state == DType::BF16 { 3 } else { 0 }
                    + r.expect("a compiled ring length")
            }
            Kernel::WgKvScatter => WGKV_SCATTER,
            Kernel::WgKvStep => WGKV_STEP,
            Kernel::WgKvMove => WGKV_MOVE,
            Kernel::GdnWVprep {
                dk,
                ring16: true,
                w4,
            } => {
                debug_assert_eq!(dk, 128, "the r16 prep is built for dk 128");
                if w4 {
                    GDN_WVPREP_R16_W4
                } else {
                    GDN_WVPREP_R16
                }
            }
            Kernel::GdnWVprep { dk, .. } => GDN_WVPREP_BASE + wv_dk_slot(dk),
            Kernel::GdnWVerify {
                state,
                dk,
                t8,
                additive,
            } => {
                GDN_WVERIFY_BASE
                    + 8 * wv_dk_slot(dk)
                    + if state == DType::BF16 { 4 } else { 0 }
                    + 2 * t8 as usize
                    + additive as usize
            }
            Kernel::GdnWVerifyX {
                state,
                t8,
                spec,
                ring16,
            } => {
                let sp = FdSpec::ALL.iter().position(|&x| x == spec).expect("a spec");
                GDN_WVERIFY_X_BASE
                    + 12 * if state == DType::BF16 { 1 } else { 0 }
                    + 6 * t8 as usize
                    + 2 * sp
                    + ring16 as usize
            }
            Kernel::GdnWRec { state, dk } => {
                GDN_WREC_BASE + 2 * dk_slot(dk) + if state == DType::BF16 { 1 } else { 0 }
            }
            Kernel::GdnFDecode { state, dk, ring32 } => {
                GDN_FDECODE_BASE
                    + 4 * dk_slot(dk)
                    + if state == DType::BF16 { 2 } else { 0 }
                    + ring32 as usize
            }
            Kernel::GdnKvOnly { state, dk } => {
                GDN_KVONLY_BASE + 2 * dk_slot(dk) + if state == DType::BF16 { 1 } else { 0 }
            }
            Kernel::KvSplitDecode { kv, head_dim, kind } => {
                let n = 2 * DECODE_HEAD_DIMS.len();
                KV_SPLIT_DECODE_BASE
                    + n * SplitKind::ALL.iter().position(|&k| k == kind).unwrap_or(0)
                    + Kernel::KvDecode { kv, head_dim }.index()
                    - KV_DECODE_BASE
            }
            Kernel::GdnFDecodeX {
                state,
                ring32,
                spec,
            } => GDN_FDECODE_X_BASE + fd_x_slot(state, ring32, spec),
            Kernel::GdnWDecodeX {
                state,
                ring32,
                spec,
            } => GDN_WDECODE_X_BASE + fd_x_slot(state, ring32, spec),
            Kernel::GdnDPrepX { ring32, spec } => {
                GDN_DPREP_X_BASE + fd_x_slot(DType::F32, ring32, spec)
            }
            Kernel::GdnKDecode { state, dk, ring } => {
                let r = GDN_WDECODE_RINGS.iter().position(|&x| x == ring);
                GDN_KDECODE_BASE
                    + 6 * dk_slot(dk)
                    + if state == DType::BF16 { 3 } else { 0 }
                    + r.expect("a compiled ring length")
            }
            Kernel::GdnKDecodeX {
                state,
                ring32,
                spec,
            } => GDN_KDECODE_X_BASE + fd_x_slot(state, ring32, spec),
            Kernel::GdnKVerify {
                state,
                dk,
                t8,
                additive,
                ring16,
            } => {
                GDN_KVERIFY_BASE
                    + 16 * wv_dk_slot(dk)
                    + if state == DType::BF16 { 8 } else { 0 }
                    + 4 * t8 as usize
                    + 2 * additive as usize
                    + ring16 as usize
            }
            Kernel::GdnKvDec { state, dk, dv } => {
                GDN_KVDEC_BASE
                    + 2 * GDN_KVDEC_SHAPES
                        .iter()
                        .position(|&x| x == (dk, dv))
                        .expect("a compiled KV-only decode shape")
                    + if state == DType::BF16 { 1 } else { 0 }
            }
        }
    }

    /// The `extern "C"` symbol name in the fatbin.
    pub(crate) fn name(self) -> String {
        match self {
            Kernel::Copy { src, dst } => format!("kvr_copy_{}_{}", src.name(), dst.name()),
            Kernel::KvPatch => "kvr_kv_patch".into(),
            Kernel::KvCopyPages => "kvr_kv_copy_pages".into(),
            Kernel::KvWrite { src, dst } => format!("kvr_kv_write_{}_{}", src.name(), dst.name()),
            Kernel::KvDecode { kv, head_dim } => format!("kvr_kv_decode_{}_d{head_dim}", kv.name()),
            Kernel::KvSplitDecode { kv, head_dim, kind } => {
                format!("kvr_kv_{}decode_{}_d{head_dim}", kind.letter(), kv.name())
            }
            Kernel::GdnStep {
                state,
                vmajor,
                wide,
            } => format!(
                "kvr_gdn_step_{}_{}_nv{}",
                state.name(),
                if vmajor { "v" } else { "k" },
                if wide { 16 } else { 8 }
            ),
            Kernel::GdnCommit => "kvr_gdn_commit".into(),
            Kernel::GdnFinish => "kvr_gdn_finish".into(),
            Kernel::GdnDecode { state, vmajor, dk } => format!(
                "kvr_gdn_decode_{}_{}_d{dk}",
                state.name(),
                if vmajor { "v" } else { "k" }
            ),
            Kernel::GdnStream { state, vmajor, dk } => format!(
                "kvr_gdn_sdecode_{}_{}_d{dk}",
                state.name(),
                if vmajor { "v" } else { "k" }
            ),
            Kernel::GdnVerify {
                state,
                vmajor,
                dk,
                additive,
            } => format!(
                "kvr_gdn_sverify_{}_{}_d{dk}{}",
                state.name(),
                if vmajor { "v" } else { "k" },
                if additive { "_add" } else { "" }
            ),
            Kernel::GdnVprep { dk } => format!("kvr_gdn_vprep_d{dk}"),
            Kernel::GdnRecur { dk, rows } => format!("kvr_gdn_recur_d{dk}_r{rows}"),
            Kernel::GdnRecur1 { dk, rows, norm } => format!(
                "kvr_gdn_recur1{}_d{dk}_r{rows}",
                if norm { "n" } else { "" }
            ),
            Kernel::GdnDPrep { dk, ring32 } => {
                format!("kvr_gdn_dprep_d{dk}_r{}", if ring32 { 32 } else { 16 })
            }
            Kernel::GdnWDecode { state, dk, ring } => {
                format!("kvr_gdn_wdecode_{}_v_d{dk}_r{ring}", state.name())
            }
            Kernel::GdnKDecode { state, dk, ring } => {
                format!("kvr_gdn_wdecode_{}_k_d{dk}_r{ring}", state.name())
            }
            Kernel::WgKvScatter => "kvr_wgkv_scatter".into(),
            Kernel::GdnWRec { state, dk } => format!("kvr_gdn_wrec_{}_v_d{dk}", state.name()),
            Kernel::WgKvStep => "kvr_wgkv_step".into(),
            Kernel::WgKvMove => "kvr_wgkv_move".into(),
            Kernel::GdnFDecode { state, dk, ring32 } => format!(
                "kvr_gdn_fdecode_{}_v_d{dk}_r{}",
                state.name(),
                if ring32 { 32 } else { 16 }
            ),
            Kernel::GdnKvOnly { state, dk } => format!("kvr_gdn_kvonly_{}_d{dk}", state.name()),
            Kernel::GdnKvDec { state, dk, dv } => {
                format!("kvr_gdn_kvdec_{}_d{dk}_v{dv}", state.name())
            }
            Kernel::GdnWVprep { dk, ring16, w4 } => format!(
                "kvr_gdn_wvprep_d{dk}{}{}",
                if ring16 { "_r16" } else { "" },
                if w4 { "_w4" } else { "" }
            ),
            Kernel::GdnWVerify {
                state,
                dk,
                t8,
                additive,
            } => format!(
                "kvr_gdn_wverify_{}_v_d{dk}_t{}{}",
                state.name(),
                if t8 { 8 } else { 4 },
                if additive { "_add" } else { "" }
            ),
            Kernel::GdnWVerifyX {
                state,
                t8,
                spec,
                ring16,
            } => format!(
                "kvr_gdn_wverify_{}_v_d128_t{}_{}{}",
                state.name(),
                if t8 { 8 } else { 4 },
                spec.name(),
                if ring16 { "_r16" } else { "" }
            ),
            Kernel::GdnFDecodeX {
                state,
                ring32,
                spec,
            } => format!(
                "kvr_gdn_fdecode_{}_v_d128_r{}_{}",
                state.name(),
                if ring32 { 32 } else { 16 },
                spec.name()
            ),
            Kernel::GdnWDecodeX {
                state,
                ring32,
                spec,
            } => format!(
                "kvr_gdn_wdecode_{}_v_d128_r{}_{}",
                state.name(),
                if ring32 { 32 } else { 16 },
                spec.name()
            ),
            Kernel::GdnKDecodeX {
                state,
                ring32,
                spec,
            } => format!(
                "kvr_gdn_wdecode_{}_k_d128_r{}_{}",
                state.name(),
                if ring32 { 32 } else { 16 },
                spec.name()
            ),
            Kernel::GdnKVerify {
                state,
                dk,
                t8,
                additive,
                ring16,
            } => format!(
                "kvr_gdn_wverify_{}_k_d{dk}_t{}{}{}",
                state.name(),
                if t8 { 8 } else { 4 },
                if additive { "_add" } else { "" },
                if ring16 { "_r16" } else { "" }
            ),
            Kernel::GdnDPrepX { ring32, spec } => format!(
                "kvr_gdn_dprep_d128_r{}_{}",
                if ring32 { 32 } else { 16 },
                spec.name()
            ),
        }
    }
}

/// Offset of a specialized decode build inside its family (state, then ring, then spec).
fn fd_x_slot(state: DType, ring32: bool, spec: FdSpec) -> usize {
    let n = FdSpec::ALL.len();
    (if state == DType::BF16 { 2 * n } else { 0 })
        + n * ring32 as usize
        + FdSpec::ALL.iter().position(|&s| s == spec).unwrap_or(0)
}

/// Offset of a GDN decode variant inside its kernel family (dk, then state, then layout).
/// Position of `dk` in [`GDN_DECODE_DKS`].
fn dk_slot(dk: usize) -> usize {
    GDN_DECODE_DKS
        .iter()
        .position(|&x| x == dk)
        .expect("a compiled dk")
}

/// Position of `dk` in [`GDN_WVERIFY_DKS`].
fn wv_dk_slot(dk: usize) -> usize {
    GDN_WVERIFY_DKS
        .iter()
        .position(|&x| x == dk)
        .expect("a compiled warp-streaming verify dk")
}

fn gdn_decode_slot(state: DType, vmajor: bool, dk: usize) -> usize {
    4 * dk_slot(dk) + if state == DType::BF16 { 2 } else { 0 } + vmajor as usize
}

/// The fatbin loaded into a context, with every kernel resolved.
pub(crate) struct LoadedModule {
    pub(crate) handle: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread
// that has the owning context current.
unsafe impl Send for LoadedModule {}
unsafe impl Sync for LoadedModule {}

impl LoadedModule {
    /// Loads `image` into the current context and resolves every kernel.
    ///
    /// # Safety
    /// The owning context must be current on this thread.
    pub(crate) unsafe fn load(image: &[u8]) -> Result<LoadedModule> {
        // The driver wants the image 8-byte aligned; include_bytes! promises no alignment.
        let mut aligned = vec![0u64; image.len().div_ceil(8)];
        std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr() as *mut u8, image.len());
        let mut handle: sys::CUmodule = std::ptr::null_mut();
        let r = sys::cuModuleLoadData(&mut handle, aligned.as_ptr() as *const std::ffi::c_void);
        if r != sys::CUresult::CUDA_SUCCESS {
            let detail = match r {
                sys::CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
                | sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => format!(
                    " (kernels were built as: {}; this GPU or driver cannot run them)",
                    build_info()
                ),
                _ => String::new(),
            };
            return Err(super::driver::cuda_error("cuModuleLoadData", r, detail));
        }
        let mut module = LoadedModule {
            handle,
            functions: Vec::new(),
        };
        for kernel in Kernel::all() {
            debug_assert_eq!(kernel.index(), module.functions.len());
            let name = CString::new(kernel.name()).expect("kernel names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            let r = sys::cuModuleGetFunction(&mut f, handle, name.as_ptr());
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::NotCompiled(format!(
                    "kernel {} is missing from the embedded fatbin ({}); rebuild the library",
                    kernel.name(),
                    build_info()
                )));
            }
            module.functions.push(f);
        }
        Ok(module)
    }

    /// The function handle of `kernel`.
    pub(crate) fn function(&self, kernel: Kernel) -> sys::CUfunction {
        self.functions[kernel.index()]
    }
}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        // SAFETY: the owner makes its context current before dropping the module.
        let _ = check("cuModuleUnload", unsafe {
            sys::cuModuleUnload(self.handle)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_slots_are_dense_and_unique() {
        let all = Kernel::all();
        for (i, k) in all.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
        let mut names: Vec<String> = all.iter().map(|k| k.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }
}
