//! GGUF: plans of the generated tiny models (hand-checked), zero-copy views against known
//! bytes, sizing against a direct computation, and every malformation the loader must
//! refuse with a clear error (never a panic or a giant allocation).

mod common;

use common::gguf::*;
use common::Rng;
use kvreplay::gguf::{
    self, AttentionPlan, GdnPlan, GgufFile, LayerPlan, Mamba2Plan, Model, SizingParams,
};
use kvreplay::linear::replay::Layout;
use kvreplay::linear::{GdnPool, Mamba2Pool, ReplayConfig, StateLayout};
use kvreplay::{DType, Error};

fn tiny(arch: &str) -> String {
    format!("{}/tests/data/tiny-{arch}.gguf", env!("CARGO_MANIFEST_DIR"))
}

fn attn(heads: usize, kv: usize, hd: usize) -> LayerPlan {
    LayerPlan::Attention(AttentionPlan {
        heads,
        kv_heads: kv,
        head_dim_k: hd,
        head_dim_v: hd,
        sliding_window: 0,
    })
}

const GDN: LayerPlan = LayerPlan::Gdn(GdnPlan {
    k_heads: 2,
    v_heads: 4,
    dk: 16,
    dv: 16,
    conv_kernel: 4,
    conv_dim: 2 * 2 * 16 + 4 * 16,
});
const MAMBA: LayerPlan = LayerPlan::Mamba2(Mamba2Plan {
    heads: 8,
    head_dim: 16,
    groups: 2,
    state: 16,
    conv_kernel: 4,
    conv_dim: 128 + 2 * 2 * 16,
});

#[test]
fn plans_of_the_tiny_models() {
    let want: Vec<(&str, Vec<LayerPlan>)> = vec![
        ("llama", vec![attn(4, 2, 16); 2]),
        // The file states a sliding window; llama.cpp's qwen2 loader does not use one.
        ("qwen2", vec![attn(4, 2, 16); 2]),
        ("qwen3", vec![attn(4, 2, 32); 2]),
        // full_attention_interval 4: layers 0-2 GDN, 3 attention (key_length 32).
        ("qwen3next", vec![GDN, GDN, GDN, attn(4, 2, 32)]),
        // ... plus one NextN/MTP block, attention.
        (
            "qwen35",
            vec![GDN, GDN, GDN, attn(4, 2, 32), attn(4, 2, 32)],
        ),
        ("mamba2", vec![MAMBA; 2]),
        // head_count_kv [0, 2, 0, 0], feed_forward_length [0, 0, 128, 0].
        (
            "nemotron_h",
            vec![MAMBA, attn(4, 2, 16), LayerPlan::Mlp, MAMBA],
        ),
        // head_count_kv [0, 2, 0].
        ("granitehybrid", vec![MAMBA, attn(4, 2, 16), MAMBA]),
    ];
    for (arch, layers) in want {
        let m = Model::open(tiny(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(m.plan.arch, arch);
        assert_eq!(m.plan.layers, layers, "{arch}");
        assert_eq!(
            (m.plan.context_length, m.plan.embedding_length),
            (256, 64),
            "{arch}"
        );
    }
    assert_eq!(gguf::ARCHITECTURES.len(), 8);
}

#[test]
fn weight_views_are_the_bytes_in_the_file() {
    let b = llama_like();
    let bytes = b.build();
    let f = GgufFile::from_bytes(&bytes).unwrap();
    let data0 = f.data_offset() as usize;
    for t in &b.tensors {
        let info = f.tensor(&t.name).unwrap();
        assert_eq!(info.offset as usize, data0 + t.offset as usize);
        assert_eq!(
            f.tensor_bytes(&t.name).unwrap(),
            &bytes[info.offset as usize..(info.offset + info.size) as usize]
        );
    }
    // f32 [2][3] (GGUF extents 3, 2 innermost first).
    let v = f.view("a.f32").unwrap();
    assert_eq!((v.dtype(), v.shape()), (DType::F32, &[2usize, 3][..]));
    let got: Vec<f32> = (0..6)
        .map(|i| unsafe { (v.addr() as *const f32).add(i).read() })
        .collect();
    assert_eq!(
        got,
        (0..6).map(|i| i as f32 * 0.5 - 1.0).collect::<Vec<_>>()
    );
    let v = f.view("b.f16").unwrap();
    let got: Vec<f32> = (0..4)
        .map(|i| unsafe { (v.addr() as *const half::f16).add(i).read() }.to_f32())
        .collect();
    assert_eq!((v.dtype(), got), (DType::F16, vec![0.0, 1.0, 2.0, 3.0]));
    let v = f.view_shaped("c.bf16", &[2, 2, 2]).unwrap();
    let got: Vec<f32> = (0..8)
        .map(|i| unsafe { (v.addr() as *const half::bf16).add(i).read() }.to_f32())
        .collect();
    assert_eq!(
        (v.dtype(), got),
        (DType::BF16, (0..8).map(|i| -(i as f32)).collect::<Vec<_>>())
    );
    // Other types are reported, not misread; shapes are checked; names must exist.
    assert!(matches!(f.view("d.q8_0"), Err(Error::Unsupported(m)) if m.contains("Q8_0")));
    assert!(matches!(
        f.view_shaped("a.f32", &[3, 2]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(f.view("nope"), Err(Error::UnknownId(_))));
    // The weights kvreplay reads itself, from the tiny models.
    let m = Model::open(tiny("qwen3next")).unwrap();
    assert_eq!(
        m.file.view_shaped("blk.0.ssm_a", &[4]).unwrap().dtype(),
        DType::F32
    );
    assert_eq!(
        m.file
            .view_shaped("blk.1.ssm_dt.bias", &[4])
            .unwrap()
            .dtype(),
        DType::F32
    );
    assert_eq!(
        m.file
            .view_shaped("blk.2.ssm_conv1d.weight", &[128, 4])
            .unwrap()
            .dtype(),
        DType::BF16
    );
    assert_eq!(
        m.file.view("token_embd.weight").unwrap().dtype(),
        DType::F16
    );
    assert!(matches!(
        m.file.view("output.weight"),
        Err(Error::Unsupported(_))
    ));
    let m = Model::open(tiny("mamba2")).unwrap();
    for name in ["blk.1.ssm_a", "blk.1.ssm_d", "blk.1.ssm_dt.bias"] {
        assert_eq!(m.file.view_shaped(name, &[8]).unwrap().dtype(), DType::F32);
    }
    assert_eq!(
        m.file
            .view_shaped("blk.0.ssm_conv1d.bias", &[192])
            .unwrap()
            .dtype(),
        DType::F32
    );
}

#[test]
fn sizing_matches_a_direct_computation() {
    let m = Model::open(tiny("qwen3next")).unwrap();
    let p = SizingParams {
        budget_bytes: 64 << 20,
        seq_len: 100,
        spec_window: 4,
        ..Default::default()
    };
    let s = gguf::sizing(&m.plan, &p).unwrap();
    // One attention layer: 2 KV heads x (32 + 32) dims x 2 bytes (f16) per token.
    let kv_tok = 2 * (32 + 32) * 2;
    assert_eq!(s.kv_bytes_per_token, kv_tok);
    // 100 + 4 tokens in pages of 16: 7 pages.
    assert_eq!(s.pages_per_seq, 7);
    assert_eq!(s.paged_kv_bytes_per_seq, 7 * 16 * kv_tok);
    assert_eq!(s.contiguous_kv_bytes_per_seq, (256 + 4) * kv_tok);
    // Three GDN layers: Hv 4 x 16 x 16 f32 states; rings of 16 entries of
    // (4 x 16 + 2 x 16) f32 + 4 decays; conv windows of 3 + 4 inputs x 128 channels f32.
    let state = 3 * 4 * 16 * 16 * 4;
    let ring = 3 * 16 * ((4 * 16 + 2 * 16) * 4 + 4 * 4);
    let conv_ring = 3 * (3 + 4) * 128 * 4;
    assert_eq!(s.state_bytes_per_seq, state);
    assert_eq!(s.ring_bytes_per_seq, ring + conv_ring);
    // Snapshots: 4 more states per layer and 1 + 4 conv windows of 3 x 128.
    let snap = 4 * state + 3 * 5 * 3 * 128 * 4;
    assert_eq!(s.snapshot_bytes_per_seq, snap);
    let per = [
        7 * 16 * kv_tok + state + ring + conv_ring,
        7 * 16 * kv_tok + state + snap,
    ];
    assert_eq!(&s.per_seq[..2], &per);
    assert_eq!(s.max_seqs[0], (64 << 20) / per[0]);
    assert_eq!(s.max_seqs[1], (64 << 20) / per[1]);
    let kv = s.kv_pool.unwrap();
    assert_eq!(
        (kv.layers, kv.kv_heads, kv.head_dim, kv.page_size),
        (1, 2, 32, 16)
    );
    assert_eq!(kv.capacity_pages, 7 * s.max_seqs[0] as usize);
    let g = s.gdn_pool.unwrap();
    assert_eq!(
        (
            g.layers,
            g.k_heads,
            g.v_heads,
            g.dk,
            g.dv,
            g.ring_len,
            g.max_drafts
        ),
        (3, 2, 4, 16, 16, 16, 4)
    );
    assert_eq!(
        (g.conv_dim, g.conv_kernel, g.max_seqs),
        (128, 4, s.max_seqs[0] as usize)
    );
    assert!(s.mamba2_pool.is_none());
    assert_eq!(s.mamba2_bytes_per_seq, 0);
    // Two Mamba-2 layers as GDN's: 8 heads x 16 x 16 f32 states; rings of 16 entries of
    // (8 heads x 16 + 2 groups x 16) f32 + 8 decays; conv windows of 3 + 4 inputs x 192
    // channels; or 4 snapshots and 1 + 4 windows of 3 x 192.
    let m = Model::open(tiny("nemotron_h")).unwrap();
    let s = gguf::sizing(&m.plan, &p).unwrap();
    let kv_tok = 2 * (16 + 16) * 2;
    let mstate = 2 * 8 * 16 * 16 * 4;
    let mring = 2 * 16 * ((8 * 16 + 2 * 16) * 4 + 8 * 4) + 2 * (3 + 4) * 192 * 4;
    let msnap = 4 * mstate + 2 * 5 * 3 * 192 * 4;
    assert_eq!(s.state_bytes_per_seq, mstate);
    assert_eq!(s.ring_bytes_per_seq, mring);
    assert_eq!(s.snapshot_bytes_per_seq, msnap);
    assert_eq!(s.mamba2_bytes_per_seq, mstate + mring);
    assert_eq!(
        s.per_seq,
        [
            7 * 16 * kv_tok + mstate + mring,
            7 * 16 * kv_tok + mstate + msnap,
            (256 + 4) * kv_tok + mstate + mring,
            (256 + 4) * kv_tok + mstate + msnap,
        ]
    );
    assert!(s.max_seqs[0] > s.max_seqs[1], "{:?}", s.max_seqs);
    assert!(s.gdn_pool.is_none() && s.kv_pool.is_some());
    let mp = s.mamba2_pool.unwrap();
    assert_eq!(
        (
            mp.layers,
            mp.v_heads,
            mp.dv,
            mp.k_heads,
            mp.dk,
            mp.ring_len,
            mp.max_drafts
        ),
        (2, 8, 16, 2, 16, 16, 4)
    );
    assert_eq!(
        (mp.conv_dim, mp.conv_kernel, mp.layout, mp.max_seqs),
        (192, 4, StateLayout::VMajor, s.max_seqs[0] as usize)
    );
    // A state dim the pool cannot hold is refused, as for GDN layers.
    let mut big = m.plan.clone();
    for l in &mut big.layers {
        if let LayerPlan::Mamba2(mb) = l {
            mb.state = 512;
        }
    }
    assert!(matches!(
        gguf::sizing(&big, &p),
        Err(Error::Unsupported(e)) if e.contains("Mamba-2 pool")
    ));
    // Bad parameters.
    assert!(gguf::sizing(&m.plan, &SizingParams { page_size: 0, ..p }).is_err());
    assert!(matches!(
        gguf::sizing(
            &m.plan,
            &SizingParams {
                spec_window: 9,
                ..p
            }
        ),
        Err(Error::OutOfRange(_))
    ));
    assert!(matches!(
        gguf::sizing(
            &m.plan,
            &SizingParams {
                state_dtype: DType::F16,
                ..p
            }
        ),
        Err(Error::DTypeMismatch(_))
    ));
    // A budget too small for one sequence: nothing fits, no pool parameters.
    let s = gguf::sizing(
        &m.plan,
        &SizingParams {
            budget_bytes: 10,
            ..p
        },
    )
    .unwrap();
    assert_eq!(s.max_seqs, [0; 4]);
    assert!(s.kv_pool.is_none() && s.mamba2_pool.is_none());
}

/// Bytes one sequence slot takes in a pool's storage as created (states, snapshots, rings,
/// conv windows; not the metadata records, which the sizing leaves out).
fn allocated_per_seq(l: &Layout) -> u64 {
    let c = &l.cfg;
    let parts = [&l.snaps, &l.ring_u, &l.ring_k, &l.ring_g, &l.conv];
    for p in parts {
        assert_eq!(p.layer_bytes(), c.max_seqs * p.slot_bytes);
        assert_eq!(p.base == 0, p.slot_bytes == 0);
    }
    let states: usize = l
        .states
        .iter()
        .map(|s| s.seq_stride * c.state_dtype.size())
        .sum();
    (states + c.layers * parts.iter().map(|p| p.slot_bytes).sum::<usize>()) as u64
}

/// The ring layouts' state and ring bytes are what pools created with the returned
/// parameters allocate, for GDN and Mamba-2 models, across drafts, rings and dtypes.
#[test]
fn sizing_equals_what_the_pools_allocate() {
    let ctx = common::gdn::cpu_ctx();
    let dtypes = [
        (DType::F32, DType::F32, DType::F32),
        (DType::BF16, DType::F16, DType::BF16),
    ];
    for arch in [
        "qwen3next",
        "qwen35",
        "mamba2",
        "nemotron_h",
        "granitehybrid",
    ] {
        let m = Model::open(tiny(arch)).unwrap();
        for (spec, ring) in [(0, 16), (4, 2), (8, 32)] {
            for (state_dtype, entry_dtype, conv_dtype) in dtypes {
                let p = SizingParams {
                    budget_bytes: 4 << 20,
                    seq_len: 100,
                    ring_len: ring,
                    spec_window: spec,
                    state_dtype,
                    entry_dtype,
                    conv_dtype,
                    ..Default::default()
                };
                let s = gguf::sizing(&m.plan, &p).unwrap();
                let what = format!("{arch}, T {spec}, ring {ring}, {state_dtype}");
                assert!(s.max_seqs[0] > 0, "{what}");
                let mut allocated = 0;
                if let Some(c) = s.gdn_pool {
                    let pool = GdnPool::new(ctx.clone(), c, None).unwrap();
                    allocated += allocated_per_seq(pool.layout());
                }
                if let Some(c) = s.mamba2_pool {
                    let pool = Mamba2Pool::new(ctx.clone(), c, None).unwrap();
                    let a = allocated_per_seq(pool.layout());
                    assert_eq!(s.mamba2_bytes_per_seq, a, "{what}");
                    assert_eq!(pool.memory().total() as u64, a, "{what}");
                    allocated += a;
                }
                assert_eq!(
                    (s.gdn_pool.is_some(), s.mamba2_pool.is_some()),
                    (s.gdn_layers > 0, s.mamba2_layers > 0),
                    "{what}"
                );
                assert_eq!(
                    s.state_bytes_per_seq + s.ring_bytes_per_seq,
                    allocated,
                    "{what}"
                );
                // The snapshot layouts: T more states and 1 + T conv windows per layer.
                let t = spec as u64;
                let windows: u64 = [s.gdn_pool, s.mamba2_pool]
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        (c.layers * (c.conv_kernel - 1) * c.conv_dim * c.conv_dtype.size()) as u64
                    })
                    .sum();
                assert_eq!(
                    s.snapshot_bytes_per_seq,
                    t * s.state_bytes_per_seq + (1 + t) * windows,
                    "{what}"
                );
            }
        }
    }
}

fn refused(bytes: &[u8]) -> Error {
    match Model::from_bytes(bytes) {
        Ok(_) => panic!("a malformed file was accepted"),
        Err(e) => e,
    }
}

#[test]
fn every_truncation_is_refused() {
    let bytes = std::fs::read(tiny("mamba2")).unwrap();
    Model::from_bytes(&bytes).unwrap();
    for n in 0..bytes.len() {
        let e = refused(&bytes[..n]);
        assert!(matches!(e, Error::MalformedFile(_)), "prefix {n}: {e:?}");
    }
}

#[test]
fn hostile_headers_are_refused() {
    let base = llama_like();
    Model::from_bytes(&base.build()).unwrap();
    let malformed = |b: &Builder, what: &str, word: &str| {
        let e = refused(&b.build());
        match &e {
            Error::MalformedFile(m) => assert!(m.contains(word), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    };
    let unsupported = |bytes: &[u8], what: &str| {
        assert!(matches!(refused(bytes), Error::Unsupported(_)), "{what}");
    };
    // Magic and version.
    let mut b = base.clone();
    b.magic = 0x1234_5678;
    malformed(&b, "bad magic", "not a GGUF file");
    b.magic = 0x4747_5546;
    unsupported(&b.build(), "big-endian");
    let mut b = base.clone();
    b.version = 1;
    unsupported(&b.build(), "v1");
    b.version = 77;
    unsupported(&b.build(), "v77");
    assert!(matches!(refused(&[]), Error::MalformedFile(_)));
    // Counts that cannot fit.
    let mut b = base.clone();
    b.n_kv_override = Some(u64::MAX);
    malformed(&b, "huge key count", "metadata keys");
    let mut b = base.clone();
    b.n_tensors_override = Some(1 << 60);
    malformed(&b, "huge tensor count", "tensors cannot fit");
    // Huge strings and arrays.
    let mut b = Builder::new("llama");
    b.raw_kv("general.name", T_STRING, &(1u64 << 40).to_le_bytes());
    malformed(&b, "huge string", "truncated");
    let mut b = Builder::new("llama");
    let mut big = T_U32.to_le_bytes().to_vec();
    big.extend((1u64 << 40).to_le_bytes());
    b.raw_kv("llama.attention.head_count", T_ARRAY, &big);
    malformed(&b, "huge array", "array");
    let mut b = Builder::new("llama");
    b.arr_i32("llama.attention.head_count_kv", &vec![1; 100_000]);
    malformed(&b, "oversized configuration array", "configuration arrays");
    let mut b = Builder::new("llama");
    let mut nested = T_ARRAY.to_le_bytes().to_vec();
    nested.extend(1u64.to_le_bytes());
    b.raw_kv("x", T_ARRAY, &nested);
    malformed(&b, "nested array", "nests arrays");
    let mut b = Builder::new("llama");
    b.raw_kv("x", 99, &[0; 8]);
    malformed(&b, "unknown value type", "unknown value type");
    let mut b = Builder::new("llama");
    b.raw_kv("general.alignment", T_U32, &7u32.to_le_bytes());
    malformed(&b, "alignment 7", "general.alignment");
    let mut b = Builder::new("llama");
    b.raw_kv("general.alignment", T_U32, &0u32.to_le_bytes());
    malformed(&b, "alignment 0", "general.alignment");
    // Tensor infos.
    let mut b = base.clone();
    b.tensor_at("five", &[1, 1, 1, 1, 1], GGML_F32, 0);
    malformed(&b, "5 dims", "dimensions");
    let mut b = base.clone();
    b.tensor_at("big", &[1 << 40, 1 << 40], GGML_F32, 0);
    malformed(&b, "element overflow", "64 bits");
    let mut b = base.clone();
    b.tensor_at("t99", &[4], 99, 0);
    malformed(&b, "unknown ggml type", "unknown ggml type");
    let mut b = base.clone();
    b.tensor_at("t40", &[4], 40, 0);
    malformed(&b, "ggml type count", "unknown ggml type");
    let mut b = base.clone();
    b.tensor_at("past", &[16], GGML_F32, 4096);
    malformed(&b, "offset past the end", "past the end");
    let mut b = base.clone();
    b.tensor_at("wrap", &[16], GGML_F32, u64::MAX - 31);
    malformed(&b, "offset overflow", "overflows");
    let mut b = base.clone();
    b.tensor_at("odd", &[2], GGML_F32, 4);
    malformed(&b, "misaligned", "alignment");
    let mut b = base.clone();
    b.tensor_at("overlap", &[6], GGML_F32, 0);
    malformed(&b, "overlapping tensors", "overlap");
    let mut b = base.clone();
    b.tensor_at("a.f32", &[1], GGML_F32, 128);
    b.data.resize(256, 0);
    malformed(&b, "duplicate names", "twice");
    let mut b = base.clone();
    b.tensor_at("q8_row", &[16], GGML_Q8_0, 160);
    b.data.resize(256, 0);
    malformed(
        &b,
        "row not a whole number of blocks",
        "multiple of the 32-element blocks",
    );
    // Found by the fuzzer: a zero extent beside huge ones holds no bytes, but its view
    // must not overflow computing strides (tests/data/fuzz-regressions).
    let mut b = base.clone();
    b.tensor_at("empty", &[0, 1 << 40, 1 << 40], GGML_F32, 0);
    let f = GgufFile::from_bytes(&b.build()).unwrap();
    assert!(f.view("empty").is_err(), "refused, not a panic");
    assert!(kvreplay::gguf::exercise(&b.build()));
    let mut b = base.clone();
    b.tensor_at("empty2", &[1 << 40, 1 << 40, 0], GGML_F32, 0);
    malformed(&b, "extents overflow in file order", "64 bits");
}

#[test]
fn the_real_qwen3_next_80b_shape() {
    // The configuration of Qwen3-Next-80B-A3B as a metadata-only GGUF (scripts/make_tiny_models.py).
    let m = Model::open(tiny("qwen3next-80b-a3b-header").replace("tiny-", "")).unwrap();
    assert_eq!(m.plan.counts(), (12, 36, 0, 0));
    assert_eq!(
        m.plan.layers[3],
        LayerPlan::Attention(AttentionPlan {
            heads: 16,
            kv_heads: 2,
            head_dim_k: 256,
            head_dim_v: 256,
            sliding_window: 0
        })
    );
    assert_eq!(
        m.plan.layers[0],
        LayerPlan::Gdn(GdnPlan {
            k_heads: 16,
            v_heads: 32,
            dk: 128,
            dv: 128,
            conv_kernel: 4,
            conv_dim: 8192
        })
    );
    let p = SizingParams {
        budget_bytes: 40 << 30,
        seq_len: 8192,
        spec_window: 4,
        ..Default::default()
    };
    let s = gguf::sizing(&m.plan, &p).unwrap();
    // 12 layers x 2 KV heads x (256 + 256) x 2 bytes.
    assert_eq!(s.kv_bytes_per_token, 12 * 2 * 512 * 2);
    // 36 layers x 32 heads x 128 x 128 x 4 bytes = 72 MiB of state per sequence.
    assert_eq!(s.state_bytes_per_seq, 72 << 20);
    // Four snapshots are 4 x 72 MiB more; a ring of 16 is 16 x 36 x (32x128 + 16x128 + 32) x 4.
    assert_eq!(
        s.ring_bytes_per_seq,
        16 * 36 * (48 * 128 + 32) * 4 + 36 * 7 * 8192 * 4
    );
    assert!(
        s.max_seqs[0] as f64 >= 1.9 * s.max_seqs[1] as f64,
        "{:?}",
        s.max_seqs
    );
}

/// Nemotron-H-8B's Mamba-2 shape (head dim 64 and state dim 128 differ, so the mapping
/// onto the replay core's dv and dk shows): the sizing, the pool parameters, and what a
/// pool created with them allocates.
#[test]
fn the_nemotron_h_mamba2_shape() {
    let m = Model::from_bytes(&nemotron_h_like().build()).unwrap();
    assert_eq!(
        m.plan.layers[0],
        LayerPlan::Mamba2(Mamba2Plan {
            heads: 128,
            head_dim: 64,
            groups: 8,
            state: 128,
            conv_kernel: 4,
            conv_dim: 10240
        })
    );
    assert_eq!(m.plan.layers[2], LayerPlan::Mlp);
    let p = SizingParams {
        budget_bytes: 40 << 30,
        seq_len: 8192,
        spec_window: 4,
        state_dtype: DType::BF16,
        ..Default::default()
    };
    let s = gguf::sizing(&m.plan, &p).unwrap();
    // 2 layers x 128 heads x 64 x 128 bf16: 4 MiB of state per sequence.
    assert_eq!(s.state_bytes_per_seq, 4 << 20);
    // Rings of 16 entries of (128 x 64 + 8 x 128) f32 + 128 decays, conv windows of 3 + 4
    // inputs x 10240 f32; snapshots: 4 states and 1 + 4 windows of 3 x 10240.
    let ring = 2 * 16 * ((128 * 64 + 8 * 128) * 4 + 128 * 4) + 2 * 7 * 10240 * 4;
    assert_eq!(s.ring_bytes_per_seq, ring);
    assert_eq!(
        s.snapshot_bytes_per_seq,
        4 * (4 << 20) + 2 * 5 * 3 * 10240 * 4
    );
    assert_eq!(s.mamba2_bytes_per_seq, (4 << 20) + ring);
    let c = s.mamba2_pool.unwrap();
    assert_eq!(
        (c.layers, c.v_heads, c.dv, c.k_heads, c.dk, c.conv_dim),
        (2, 128, 64, 8, 128, 10240)
    );
    let pool = Mamba2Pool::new(
        common::gdn::cpu_ctx(),
        ReplayConfig { max_seqs: 1, ..c },
        None,
    )
    .unwrap();
    assert_eq!(allocated_per_seq(pool.layout()), s.mamba2_bytes_per_seq);
    // A state dim above the pool's 256 is refused by the sizing, as for GDN.
    let mut b = nemotron_h_like();
    b.u32("nemotron_h.ssm.state_size", 512);
    let m = Model::from_bytes(&b.build()).unwrap();
    assert!(matches!(
        gguf::sizing(&m.plan, &p),
        Err(Error::Unsupported(e)) if e.contains("Mamba-2") && e.contains("256")
    ));
}

#[test]
fn bad_metadata_is_refused_when_planning() {
    let plan = |b: &Builder| Model::from_bytes(&b.build());
    let mut b = Builder::new("");
    b.u32("llama.block_count", 2);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("general.architecture")));
    let b = Builder::new("gpt2");
    assert!(
        matches!(plan(&b), Err(Error::Unsupported(m)) if m.contains("gpt2") && m.contains("qwen3next"))
    );
    let mut b = Builder::new("llama");
    b.u32("llama.embedding_length", 64)
        .u32("llama.attention.head_count", 4);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("block_count")));
    let mut b = Builder::new("llama");
    b.u32("llama.block_count", 1 << 30)
        .u32("llama.embedding_length", 64);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("out of range")));
    let mut b = Builder::new("llama");
    b.u32("llama.block_count", 3)
        .u32("llama.embedding_length", 64)
        .arr_i32("llama.attention.head_count", &[4, 4]);
    assert!(
        matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("2 entries for 3 layers"))
    );
    let mut b = Builder::new("llama");
    b.u32("llama.block_count", 2)
        .u32("llama.embedding_length", 64)
        .arr_i32("llama.attention.head_count", &[4, -4]);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(_))));
    let mut b = Builder::new("llama");
    b.u32("llama.block_count", 2)
        .u32("llama.embedding_length", 64)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 3);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("multiple")));
    let ssm = |b: &mut Builder, arch: &str, inner: u32| {
        b.u32(&format!("{arch}.block_count"), 4)
            .u32(&format!("{arch}.embedding_length"), 64)
            .u32(&format!("{arch}.attention.head_count"), 4)
            .u32(&format!("{arch}.ssm.conv_kernel"), 4)
            .u32(&format!("{arch}.ssm.inner_size"), inner)
            .u32(&format!("{arch}.ssm.state_size"), 16)
            .u32(&format!("{arch}.ssm.time_step_rank"), 4)
            .u32(&format!("{arch}.ssm.group_count"), 2);
    };
    let mut b = Builder::new("qwen3next");
    ssm(&mut b, "qwen3next", 64);
    assert!(plan(&b).is_ok());
    let mut b = Builder::new("qwen3next");
    ssm(&mut b, "qwen3next", 66);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("inner_size")));
    let mut b = Builder::new("qwen3next");
    ssm(&mut b, "qwen3next", 64);
    b.u32("qwen3next.full_attention_interval", 0);
    assert!(
        matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("full_attention_interval"))
    );
    let mut b = Builder::new("qwen35");
    ssm(&mut b, "qwen35", 64);
    b.u32("qwen35.nextn_predict_layers", 4);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("nextn")));
    let mut b = Builder::new("mamba2");
    b.u32("mamba2.block_count", 2)
        .u32("mamba2.embedding_length", 64);
    assert!(matches!(plan(&b), Err(Error::MalformedFile(m)) if m.contains("ssm.conv_kernel")));
    let mut b = Builder::new("llama");
    b.string("llama.block_count", "two");
    assert!(matches!(plan(&b), Err(Error::MalformedFile(_))));
}

#[test]
fn recurrent_layers_flags_take_precedence_over_the_interval() {
    // llama.cpp's qwen3next / qwen35 loaders take `{arch}.attention.recurrent_layers` (a
    // bool array from gguf-py or llama.cpp's saver, u32 flags, or one scalar for all layers)
    // when present and only then fall back to full_attention_interval.
    let base = |arch: &str| {
        let mut b = Builder::new(arch);
        b.u32(&format!("{arch}.block_count"), 4)
            .u32(&format!("{arch}.embedding_length"), 64)
            .u32(&format!("{arch}.attention.head_count"), 4)
            .u32(&format!("{arch}.attention.head_count_kv"), 2)
            .u32(&format!("{arch}.attention.key_length"), 32)
            .u32(&format!("{arch}.attention.value_length"), 32)
            .u32(&format!("{arch}.ssm.conv_kernel"), 4)
            .u32(&format!("{arch}.ssm.inner_size"), 64)
            .u32(&format!("{arch}.ssm.state_size"), 16)
            .u32(&format!("{arch}.ssm.time_step_rank"), 4)
            .u32(&format!("{arch}.ssm.group_count"), 2);
        b
    };
    let layers = |b: &Builder| Model::from_bytes(&b.build()).unwrap().plan.layers;
    let a = attn(4, 2, 32);
    // Without the key: the interval (default 4).
    assert_eq!(layers(&base("qwen3next")), vec![GDN, GDN, GDN, a]);
    for arch in ["qwen3next", "qwen35"] {
        let key = format!("{arch}.attention.recurrent_layers");
        let mut b = base(arch);
        // An interval that would say otherwise is not read (even 0, which alone is refused).
        b.u32(&format!("{arch}.full_attention_interval"), 0)
            .arr_bool(&key, &[true, false, true, false]);
        assert_eq!(layers(&b), vec![GDN, a, GDN, a], "{arch}");
        let mut b = base(arch);
        b.arr_u32(&key, &[0, 1, 1, 0]);
        assert_eq!(layers(&b), vec![a, GDN, GDN, a], "{arch}");
        let mut b = base(arch);
        b.bool(&key, true);
        assert_eq!(layers(&b), vec![GDN; 4], "{arch}");
        let mut b = base(arch);
        b.u32(&key, 0);
        assert_eq!(layers(&b), vec![a; 4], "{arch}");
    }
    // The flags cover every block, MTP ones included (llama.cpp's n_layer_all).
    let mut b = base("qwen35");
    b.u32("qwen35.nextn_predict_layers", 1).arr_bool(
        "qwen35.attention.recurrent_layers",
        &[true, true, false, false],
    );
    assert_eq!(layers(&b), vec![GDN, GDN, a, a]);
    // A wrong length or a value that is not a flag is refused, as llama.cpp does.
    let refused = |b: &Builder, what: &str| {
        let e = Model::from_bytes(&b.build()).unwrap_err();
        assert!(
            matches!(&e, Error::MalformedFile(m) if m.contains("recurrent_layers") && m.contains(what)),
            "{e:?}"
        );
    };
    let mut b = base("qwen3next");
    b.arr_bool("qwen3next.attention.recurrent_layers", &[true; 3]);
    refused(&b, "3 entries for 4 layers");
    let mut b = base("qwen3next");
    b.arr_i32("qwen3next.attention.recurrent_layers", &[1, -1, 1, 0]);
    refused(&b, "non-negative integer");
    let mut b = base("qwen3next");
    b.string("qwen3next.attention.recurrent_layers", "yes");
    refused(&b, "non-negative integer");
}

#[test]
fn files_that_cannot_be_opened() {
    assert!(matches!(
        Model::open("/nonexistent/kvreplay.gguf"),
        Err(Error::Io(_))
    ));
    assert!(matches!(
        Model::open(env!("CARGO_MANIFEST_DIR")),
        Err(Error::Io(_))
    ));
    let dir = std::env::temp_dir().join(format!("kvr-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(Model::open(&empty), Err(Error::MalformedFile(_))));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Flips random bytes of the tiny models' headers (and sometimes the data): the loader
/// accepts or refuses, never panics. The same inputs feed the cargo-fuzz target.
#[test]
fn random_corruption_never_panics() {
    let mut rng = Rng::new(99);
    let (mut ok, mut bad) = (0, 0);
    for arch in ["mamba2", "granitehybrid", "qwen3next"] {
        let bytes = std::fs::read(tiny(arch)).unwrap();
        let header = GgufFile::from_bytes(&bytes).unwrap().data_offset() as usize;
        for _ in 0..400 {
            let mut b = bytes.clone();
            for _ in 0..1 + rng.below(4) {
                let at = if rng.below(8) == 0 {
                    rng.below(b.len())
                } else {
                    rng.below(header)
                };
                b[at] = rng.next_u64() as u8;
            }
            match Model::from_bytes(&b) {
                Ok(m) => {
                    ok += 1;
                    let _ = gguf::sizing(
                        &m.plan,
                        &SizingParams {
                            budget_bytes: 1 << 30,
                            ..Default::default()
                        },
                    );
                    for t in m.file.tensors() {
                        let _ = m.file.view(&t.name);
                    }
                }
                Err(_) => bad += 1,
            }
        }
    }
    println!("corrupted files: {ok} still valid, {bad} refused");
}
