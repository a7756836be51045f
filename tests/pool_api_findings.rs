//! What the API-sequence harnesses of the pools (fuzz/api/, issue 12) found, one test each,
//! through the C API.

#[path = "../fuzz/api/common.rs"]
#[allow(dead_code)]
mod common;

use std::ptr::{null, null_mut};

use common::*;
use kvreplay::ffi::*;

fn gdn_params(layers: i32, hk: i32, hv: i32, dk: i32, dv: i32) -> kvr_gdn_pool_params {
    let mut p = std::mem::MaybeUninit::uninit();
    assert_eq!(kvr_gdn_pool_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
    // SAFETY: filled above.
    let mut p: kvr_gdn_pool_params = unsafe { p.assume_init() };
    (p.n_layers, p.n_k_heads, p.n_v_heads, p.dk, p.dv, p.max_seqs) = (layers, hk, hv, dk, dv, 2);
    p.ring_len = 4;
    p
}

fn gdn_pool(p: &kvr_gdn_pool_params) -> *mut kvr_gdn_pool {
    let mut pool = null_mut();
    assert_eq!(
        kvr_gdn_pool_new(context(), p, &mut pool),
        KVR_STATUS_OK,
        "{}",
        last_error()
    );
    pool
}

fn add_seq(pool: *mut kvr_gdn_pool) -> i32 {
    let mut seq = -1;
    assert_eq!(
        kvr_gdn_pool_seq_add(pool, null_mut(), &mut seq),
        KVR_STATUS_OK
    );
    seq
}

fn cursor(pool: *mut kvr_gdn_pool, layer: i32, seq: i32) -> (i32, i32, i32, i32) {
    let mut c = kvr_gdn_cursor {
        mode: -1,
        ring_start: -1,
        buffered: -1,
        pending: -1,
    };
    assert_eq!(
        kvr_gdn_pool_get_cursor(pool, layer, seq, &mut c),
        KVR_STATUS_OK
    );
    (c.mode, c.ring_start, c.buffered, c.pending)
}

/// Inputs of one sequence and `t` tokens (q, k, v, g, beta, conv_in, out), f32.
struct Step {
    t: [Tensor; 7],
}

impl Step {
    fn new(p: &kvr_gdn_pool_params, t: usize, seed: u64) -> Step {
        let (hk, hv, dk, dv) = (
            p.n_k_heads as usize,
            p.n_v_heads as usize,
            p.dk as usize,
            p.dv as usize,
        );
        let conv = (p.conv_dim as usize).max(1);
        let mut rng = Rng::new(seed);
        let f = KVR_DTYPE_F32;
        let c = Style::Contiguous;
        let mut ts = [
            Tensor::new(f, &[1, t, hk, dk], c),
            Tensor::new(f, &[1, t, hk, dk], c),
            Tensor::new(f, &[1, t, hv, dv], c),
            Tensor::new(f, &[1, t, hv], c),
            Tensor::new(f, &[1, t, hv], c),
            Tensor::new(f, &[1, t, conv], c),
            Tensor::new(f, &[1, t, hv, dv], c),
        ];
        let kc = 1.0 / (dk as f32).sqrt();
        ts[0].fill(|_| rng.uniform(-1.0, 1.0));
        ts[1].fill(|_| kc * rng.uniform(-1.0, 1.0));
        ts[2].fill(|_| rng.uniform(-1.0, 1.0));
        ts[3].fill(|_| rng.uniform(-0.4, -0.01));
        ts[4].fill(|_| rng.uniform(0.1, 0.9));
        ts[5].fill(|_| rng.uniform(-1.0, 1.0));
        Step { t: ts }
    }
    fn run(
        &self,
        pool: *mut kvr_gdn_pool,
        layer: i32,
        seq: i32,
        verify: bool,
        conv: bool,
    ) -> kvr_status {
        let ids = ids_tensor(&[seq], Style::Contiguous);
        let d: Vec<kvr_tensor> = self.t.iter().map(|t| t.desc()).collect();
        let c: *const kvr_tensor = if conv { &d[5] } else { null() };
        gdn_pool_call(
            pool,
            layer,
            &ids.desc(),
            verify,
            [&d[0], &d[1], &d[2], &d[3], &d[4], c, &d[6]],
            null(),
        )
    }
}

/// A `KVR_LAYER_ALL` commit checked the host counts against the first layer's drafts only:
/// with T = 3 verified in layer 0 and T = 1 in layer 1, `accepted = 2` passed and layer 1
/// silently committed 1. The header says host counts are checked (0..=T): every layer's T.
#[test]
fn commit_of_every_layer_checks_the_counts_against_each_layer() {
    let p = gdn_params(2, 1, 1, 4, 4);
    let pool = gdn_pool(&p);
    let seq = add_seq(pool);
    assert_eq!(
        Step::new(&p, 3, 1).run(pool, 0, seq, true, false),
        KVR_STATUS_OK
    );
    assert_eq!(
        Step::new(&p, 1, 2).run(pool, 1, seq, true, false),
        KVR_STATUS_OK
    );
    let before = (cursor(pool, 0, seq), cursor(pool, 1, seq));
    let ids = ids_tensor(&[seq], Style::Contiguous);
    let acc = ids_tensor(&[2], Style::Contiguous);
    let s = kvr_gdn_pool_commit(
        pool,
        KVR_LAYER_ALL,
        &ids.desc(),
        &acc.desc(),
        null(),
        null_mut(),
    );
    assert_eq!(s, KVR_STATUS_OUT_OF_RANGE, "{}", last_error());
    assert!(last_error().contains("layer 1"), "{}", last_error());
    assert_eq!(
        (cursor(pool, 0, seq), cursor(pool, 1, seq)),
        before,
        "a failed commit changed a cursor"
    );
    let acc = ids_tensor(&[1], Style::Contiguous);
    let s = kvr_gdn_pool_commit(
        pool,
        KVR_LAYER_ALL,
        &ids.desc(),
        &acc.desc(),
        null(),
        null_mut(),
    );
    assert_eq!(s, KVR_STATUS_OK, "{}", last_error());
    assert_eq!((cursor(pool, 0, seq).3, cursor(pool, 1, seq).3), (0, 0));
    kvr_gdn_pool_free(pool);
}

/// `conv_state` with `KVR_LAYER_ALL` was refused only for pools of more than one layer; the
/// header refuses it always (one layer's window per call).
#[test]
fn commit_refuses_conv_state_for_every_layer_even_with_one_layer() {
    let mut p = gdn_params(1, 1, 1, 4, 4);
    p.conv_dim = 3;
    let pool = gdn_pool(&p);
    let seq = add_seq(pool);
    assert_eq!(
        Step::new(&p, 2, 3).run(pool, 0, seq, true, true),
        KVR_STATUS_OK
    );
    let ids = ids_tensor(&[seq], Style::Contiguous);
    let acc = ids_tensor(&[1], Style::Contiguous);
    let mut cs = Tensor::new(KVR_DTYPE_F32, &[1, 3, 3], Style::Contiguous);
    cs.poison();
    let s = kvr_gdn_pool_commit(
        pool,
        KVR_LAYER_ALL,
        &ids.desc(),
        &acc.desc(),
        &cs.desc(),
        null_mut(),
    );
    assert_eq!(s, KVR_STATUS_INVALID_ARG, "{}", last_error());
    assert!(cs.untouched());
    assert_eq!(cursor(pool, 0, seq).3, 2, "the drafts stay pending");
    let s = kvr_gdn_pool_commit(pool, 0, &ids.desc(), &acc.desc(), &cs.desc(), null_mut());
    assert_eq!(s, KVR_STATUS_OK, "{}", last_error());
    kvr_gdn_pool_free(pool);
}

/// KV-only entries live inside a head's state memory: with a bf16 state and an odd dk * dv
/// (or an odd external `seq_stride`), value head 1's entries and their f32 log decays start
/// on a 2-byte boundary, which the CPU executor read and wrote with aligned f32 accesses
/// (undefined behaviour in Rust; now unaligned reads and writes). The outputs and the
/// exported state still follow the recurrence.
#[test]
fn kv_only_entries_on_two_byte_boundaries() {
    // (entry dtype, harness-owned states, dk, dv): one head's bf16 state holds one entry.
    for (entry, external, dk, dv) in [
        (KVR_DTYPE_BF16, false, 5, 3),
        (KVR_DTYPE_F32, false, 5, 5),
        (KVR_DTYPE_BF16, true, 5, 3),
    ] {
        let mut p = gdn_params(1, 1, 2, dk as i32, dv as i32);
        p.state_dtype = KVR_DTYPE_BF16;
        p.entry_dtype = entry;
        p.kv_only_threshold = 1;
        let stride = 2 * dk * dv + 1;
        let mut mem = Mem::new(2 * stride * 2);
        let states = [kvr_gdn_state_storage {
            state: mem.ptr(),
            seq_stride: stride as i64,
        }];
        if external {
            p.states = states.as_ptr();
        }
        let pool = gdn_pool(&p);
        // Slot 1 of the external memory starts at an odd element.
        add_seq(pool);
        let seq = add_seq(pool);
        let step = Step::new(&p, 1, 4);
        assert_eq!(
            step.run(pool, 0, seq, false, false),
            KVR_STATUS_OK,
            "{}",
            last_error()
        );
        assert_eq!(cursor(pool, 0, seq), (KVR_GDN_MODE_KV_ONLY, 0, 1, 0));
        // The state after one token from a zero state: S = beta v k^T (e^g S0 = 0).
        let out = Tensor::new(KVR_DTYPE_F32, &[2, dk, dv], Style::Contiguous);
        assert_eq!(
            kvr_gdn_pool_export_state(pool, 0, seq, &out.desc(), null(), null_mut()),
            KVR_STATUS_OK
        );
        let [_, k, v, _, beta, _, _] = &step.t;
        for h in 0..2 {
            for ik in 0..dk {
                for iv in 0..dv {
                    let want = beta.get(&[0, 0, h])
                        * v.get(&[0, 0, h, iv])
                        * round(entry, k.get(&[0, 0, 0, ik]));
                    let got = out.get(&[h, ik, iv]);
                    assert!(
                        close(got as f64, want as f64, 2e-2),
                        "head {h} [{ik}][{iv}]: {got} vs {want}"
                    );
                }
            }
        }
        kvr_gdn_pool_free(pool);
        drop(mem);
    }
}
