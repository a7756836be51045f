//! Pool sizing from a model plan: what one sequence costs and how many fit in a budget,
//! paged vs contiguous KV and ring vs per-draft snapshots, plus ready-made parameters for
//! the KV pool, the GDN pool and the Mamba-2 pool (paged KV + ring, kvreplay's layout).
//!
//! Costs per sequence (all layers):
//! - KV: `kv_heads * (head_dim_k + head_dim_v) * sizeof(kv_dtype)` per token and attention
//!   layer. Paged: `ceil((seq_len + T) / page) * page` tokens. Contiguous: the model's
//!   context length (a per-sequence contiguous cache reserves its maximum).
//! - GDN and Mamba-2 (each family's layers as one replay pool, configured as the pool
//!   parameters below): the checkpoint states; the ring (`ring_len` entries) and the conv
//!   window ring (`conv_kernel - 1 + T` inputs), exactly what `GdnPool` / `Mamba2Pool`
//!   allocate (`ReplayConfig::memory`: the per-sequence parts of the pool's storage,
//!   without its metadata records); or, with per-draft snapshots, `T` more states and
//!   `1 + T` conv windows.

use super::plan::{LayerPlan, ModelPlan};
use crate::error::{Error, Result};
use crate::kv::KvPoolConfig;
use crate::linear::{GdnConfig, ReplayConfig, StateLayout};
use crate::tensor::DType;

/// What an engine plans for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizingParams {
    /// Bytes for caches and states (all layers, all sequences).
    pub budget_bytes: u64,
    /// Tokens per sequence (prompt + output); 0 = the model's context length.
    pub seq_len: usize,
    /// KV page size in tokens.
    pub page_size: usize,
    /// Ring length of the GDN and Mamba-2 pools (at least `spec_window`, and 1).
    pub ring_len: usize,
    /// Draft tokens per speculative round (0: no speculation).
    pub spec_window: usize,
    /// KV element type.
    pub kv_dtype: DType,
    /// Recurrent state element type.
    pub state_dtype: DType,
    /// Ring entry element type.
    pub entry_dtype: DType,
    /// Conv window element type.
    pub conv_dtype: DType,
}

impl Default for SizingParams {
    fn default() -> Self {
        SizingParams {
            budget_bytes: 0,
            seq_len: 0,
            page_size: 16,
            ring_len: 16,
            spec_window: 0,
            kv_dtype: DType::F16,
            state_dtype: DType::F32,
            entry_dtype: DType::F32,
            conv_dtype: DType::F32,
        }
    }
}

/// Layouts compared.
pub const VARIANTS: [&str; 4] = [
    "paged KV + ring",
    "paged KV + snapshots",
    "contiguous KV + ring",
    "contiguous KV + snapshots",
];

/// The numbers an engine needs to size its pools.
#[derive(Clone, Debug, PartialEq)]
pub struct Sizing {
    pub attention_layers: usize,
    pub gdn_layers: usize,
    pub mamba2_layers: usize,
    /// Tokens per sequence used (seq_len, or the context length).
    pub seq_len: usize,
    /// KV bytes per token (all attention layers).
    pub kv_bytes_per_token: u64,
    /// Pages one sequence needs (seq_len + T tokens).
    pub pages_per_seq: u64,
    pub paged_kv_bytes_per_seq: u64,
    pub contiguous_kv_bytes_per_seq: u64,
    /// Recurrent states (GDN + Mamba-2).
    pub state_bytes_per_seq: u64,
    /// Rings and conv window rings (GDN + Mamba-2): the ring variants.
    pub ring_bytes_per_seq: u64,
    /// Per-draft state and conv snapshots (GDN + Mamba-2): the snapshot variants.
    pub snapshot_bytes_per_seq: u64,
    /// The Mamba-2 layers' part of `state_bytes_per_seq + ring_bytes_per_seq`: what one
    /// sequence of a pool with [`Sizing::mamba2_pool`] takes (`ReplayMemory::total`).
    pub mamba2_bytes_per_seq: u64,
    /// Bytes per sequence for each of [`VARIANTS`].
    pub per_seq: [u64; 4],
    /// Sequences that fit in the budget for each of [`VARIANTS`].
    pub max_seqs: [u64; 4],
    /// KV pool parameters for paged KV + ring (None: no attention layers, or layers of
    /// different shapes, or K and V head dims that differ).
    pub kv_pool: Option<KvPoolConfig>,
    /// GDN pool parameters for paged KV + ring (None: no GDN layers).
    pub gdn_pool: Option<GdnConfig>,
    /// Mamba-2 pool parameters for paged KV + ring, in the replay core's terms (value heads
    /// = heads, dv = head dim, key heads = groups, dk = state dim; V-major state, as
    /// mamba_ssm and llama.cpp keep it). None: no Mamba-2 layers.
    pub mamba2_pool: Option<ReplayConfig>,
}

/// One family's replay pool: its checkpoint states, and what the ring variants (ring +
/// conv window ring) and the snapshot variants (`t` states and `1 + t` conv windows) add.
struct FamilyCost {
    state: u64,
    ring: u64,
    snap: u64,
}

impl FamilyCost {
    const NONE: FamilyCost = FamilyCost {
        state: 0,
        ring: 0,
        snap: 0,
    };

    /// Validates `c` (a pool the family cannot create is an error naming `family`) and
    /// takes the ring variant's bytes from the pool's own memory accounting.
    fn of(c: &ReplayConfig, family: &str, t: u64) -> Result<FamilyCost> {
        c.validate().map_err(|e| {
            Error::Unsupported(format!(
                "the model's {family} layers do not fit kvreplay's {family} pool: {e}"
            ))
        })?;
        let m = c.memory();
        let window = mul(&[
            c.layers as u64,
            c.conv_kernel.saturating_sub(1) as u64,
            c.conv_dim as u64,
            c.conv_dtype.size() as u64,
        ])?;
        Ok(FamilyCost {
            state: m.state_bytes as u64,
            ring: sum2(m.ring_bytes as u64, m.conv_bytes as u64)?,
            snap: sum2(mul(&[t, m.state_bytes as u64])?, mul(&[window, 1 + t])?)?,
        })
    }
}

fn sum2(a: u64, b: u64) -> Result<u64> {
    a.checked_add(b)
        .ok_or_else(|| Error::OutOfRange("sizing overflows 64 bits".into()))
}

fn mul(parts: &[u64]) -> Result<u64> {
    parts
        .iter()
        .try_fold(1u64, |a, &b| a.checked_mul(b))
        .ok_or_else(|| Error::OutOfRange("sizing overflows 64 bits".into()))
}

/// Sizes pools for `plan` under `p`.
pub fn sizing(plan: &ModelPlan, p: &SizingParams) -> Result<Sizing> {
    if p.page_size == 0 {
        return Err(Error::InvalidArgument(
            "page_size must be at least 1".into(),
        ));
    }
    if p.spec_window > crate::linear::MAX_DRAFTS {
        return Err(Error::OutOfRange(format!(
            "spec_window {} exceeds {}",
            p.spec_window,
            crate::linear::MAX_DRAFTS
        )));
    }
    for (name, d) in [
        ("kv_dtype", p.kv_dtype),
        ("entry_dtype", p.entry_dtype),
        ("conv_dtype", p.conv_dtype),
    ] {
        if !d.is_float() {
            return Err(Error::DTypeMismatch(format!(
                "{name} must be f32, f16 or bf16"
            )));
        }
    }
    if !matches!(p.state_dtype, DType::F32 | DType::BF16) {
        return Err(Error::DTypeMismatch(
            "state_dtype must be f32 or bf16".into(),
        ));
    }
    let t = p.spec_window as u64;
    let seq_len = if p.seq_len > 0 {
        p.seq_len
    } else {
        plan.context_length
    };
    if seq_len == 0 {
        return Err(Error::InvalidArgument(
            "seq_len is 0 and the model states no context length".into(),
        ));
    }
    let kvs = p.kv_dtype.size() as u64;
    let (mut kv_per_token, mut attn) = (0u64, Vec::new());
    let (mut gdn, mut gdn_layers) = (None, 0usize);
    let (mut mamba, mut mamba_layers) = (None, 0usize);
    for l in &plan.layers {
        match l {
            LayerPlan::Attention(a) => {
                kv_per_token = kv_per_token
                    .checked_add(mul(&[
                        a.kv_heads as u64,
                        (a.head_dim_k + a.head_dim_v) as u64,
                        kvs,
                    ])?)
                    .ok_or_else(|| Error::OutOfRange("sizing overflows".into()))?;
                attn.push(*a);
            }
            LayerPlan::Gdn(g) => {
                gdn = Some(*g);
                gdn_layers += 1;
            }
            LayerPlan::Mamba2(m) => {
                mamba = Some(*m);
                mamba_layers += 1;
            }
            LayerPlan::Mlp => {}
        }
    }
    let tokens = seq_len as u64 + t;
    let pages_per_seq = tokens.div_ceil(p.page_size as u64);
    let paged = mul(&[pages_per_seq, p.page_size as u64, kv_per_token])?;
    let contiguous = mul(&[plan.context_length.max(seq_len) as u64 + t, kv_per_token])?;

    let drafts = p.spec_window.max(1);
    // Both families' pools are the core's replay pool, shaped as their C parameters shape
    // it (kvr_model_get_gdn_pool_params / kvr_model_get_mamba2_pool_params).
    let base = ReplayConfig {
        layers: 0,
        k_heads: 0,
        v_heads: 0,
        dk: 0,
        dv: 0,
        ring_len: p.ring_len.max(drafts),
        kv_only_threshold: 0,
        max_drafts: drafts,
        state_dtype: p.state_dtype,
        entry_dtype: p.entry_dtype,
        layout: StateLayout::KMajor,
        max_seqs: 1,
        conv_dim: 0,
        conv_kernel: 0,
        conv_dtype: p.conv_dtype,
    };
    let gdn_cfg = gdn.map(|g| GdnConfig {
        layers: gdn_layers,
        k_heads: g.k_heads,
        v_heads: g.v_heads,
        dk: g.dk,
        dv: g.dv,
        conv_dim: g.conv_dim,
        conv_kernel: g.conv_kernel,
        ..base
    });
    // Mamba-2 in the core's terms (linear::mamba2): heads are value heads (dv = head
    // dim), groups key heads (dk = state dim); V-major, as mamba_ssm and llama.cpp keep
    // the state.
    let mamba_cfg = mamba.map(|m| ReplayConfig {
        layers: mamba_layers,
        k_heads: m.groups,
        v_heads: m.heads,
        dk: m.state,
        dv: m.head_dim,
        layout: StateLayout::VMajor,
        conv_dim: m.conv_dim,
        conv_kernel: m.conv_kernel,
        ..base
    });
    let cost = |c: &Option<ReplayConfig>, family| match c {
        Some(c) => FamilyCost::of(c, family, t),
        None => Ok(FamilyCost::NONE),
    };
    let g = cost(&gdn_cfg, "GDN")?;
    let mb = cost(&mamba_cfg, "Mamba-2")?;
    let sum = |parts: &[u64]| -> Result<u64> {
        parts
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .ok_or_else(|| Error::OutOfRange("sizing overflows 64 bits".into()))
    };
    let state = sum(&[g.state, mb.state])?;
    let ring = sum(&[g.ring, mb.ring])?;
    let snap = sum(&[g.snap, mb.snap])?;
    let per_seq = [
        sum(&[paged, state, ring])?,
        sum(&[paged, state, snap])?,
        sum(&[contiguous, state, ring])?,
        sum(&[contiguous, state, snap])?,
    ];
    let max_seqs = per_seq.map(|c| p.budget_bytes.checked_div(c).unwrap_or(0));
    let n = max_seqs[0].min(1 << 20) as usize;
    let kv_pool = match attn.first() {
        Some(a0)
            if attn.iter().all(|a| {
                a.kv_heads == a0.kv_heads
                    && a.head_dim_k == a0.head_dim_k
                    && a.head_dim_v == a0.head_dim_v
            }) && a0.head_dim_k == a0.head_dim_v
                && n > 0 =>
        {
            Some(KvPoolConfig {
                layers: attn.len(),
                kv_heads: a0.kv_heads,
                head_dim: a0.head_dim_k,
                page_size: p.page_size,
                dtype: p.kv_dtype,
                capacity_pages: (pages_per_seq as usize).saturating_mul(n),
                max_seqs: n,
                max_seq_len: tokens as usize,
            })
        }
        _ => None,
    };
    let with_seqs = |c: Option<ReplayConfig>| {
        c.filter(|_| n > 0).map(|mut c| {
            c.max_seqs = n;
            c
        })
    };
    Ok(Sizing {
        attention_layers: attn.len(),
        gdn_layers,
        mamba2_layers: mamba_layers,
        seq_len,
        kv_bytes_per_token: kv_per_token,
        pages_per_seq,
        paged_kv_bytes_per_seq: paged,
        contiguous_kv_bytes_per_seq: contiguous,
        state_bytes_per_seq: state,
        ring_bytes_per_seq: ring,
        snapshot_bytes_per_seq: snap,
        mamba2_bytes_per_seq: sum2(mb.state, mb.ring)?,
        per_seq,
        max_seqs,
        kv_pool,
        gdn_pool: with_seqs(gdn_cfg),
        mamba2_pool: with_seqs(mamba_cfg),
    })
}
