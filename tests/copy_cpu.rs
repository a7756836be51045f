//! kvr_tensor_copy on the CPU backend: every dtype pair, contiguous and strided layouts,
//! special values; every destination element checked (including the ones it must not
//! touch).

mod common;

use common::*;
use kvreplay::ffi::*;

fn run_cpu_case(ctx: *mut kvr_context, case: &CopyCase, rng: &mut Rng) {
    let mut src = case.make_source(rng);
    let mut dst = case.make_destination();
    let expected = case.expected(&src, &dst);
    let s = case.src_tensor(src.ptr(), KVR_DEVICE_HOST);
    let d = case.dst_tensor(dst.ptr(), KVR_DEVICE_HOST);
    ok(kvr_tensor_copy(ctx, &s, &d, std::ptr::null_mut()));
    assert_eq!(case.check(&expected, &dst), 0, "{case:?}");
}

#[test]
fn copy_every_dtype_pair_and_layout() {
    let mut rng = Rng::new(1);
    for threads in [1, 3] {
        let mut p = std::mem::MaybeUninit::uninit();
        ok(kvr_context_params_default(p.as_mut_ptr()));
        let mut p: kvr_context_params = unsafe { p.assume_init() };
        p.backend = KVR_BACKEND_CPU;
        p.n_threads = threads;
        let mut ctx = std::ptr::null_mut();
        ok(kvr_context_new(&p, &mut ctx));
        assert_eq!(kvr_context_get_backend(ctx), KVR_BACKEND_CPU);
        let mut cases = 0;
        for (sd, _, _) in DTYPES {
            for (dd, _, _) in DTYPES {
                for case in copy_cases(sd, dd) {
                    run_cpu_case(ctx, &case, &mut rng);
                    cases += 1;
                }
            }
        }
        assert!(cases >= 9 * 9);
        kvr_context_free(ctx);
    }
}

#[test]
fn special_values_round_to_nearest_even() {
    // Spot checks against hand-computed bits, independent of the `half` crate.
    let ctx = context(KVR_BACKEND_CPU, std::ptr::null_mut()).unwrap();
    let cases: &[(f32, kvr_dtype, u32)] = &[
        (1.0 + 1.0 / 1024.0, KVR_DTYPE_F16, 0x3c01), // exactly representable
        (1.0 + 1.0 / 2048.0, KVR_DTYPE_F16, 0x3c00), // tie -> even (down)
        (1.0 + 3.0 / 2048.0, KVR_DTYPE_F16, 0x3c02), // tie -> even (up)
        (65520.0, KVR_DTYPE_F16, 0x7c00),            // rounds to +inf
        (1.0 + 1.0 / 256.0, KVR_DTYPE_BF16, 0x3f80), // tie -> even (down)
        (1.0 + 3.0 / 256.0, KVR_DTYPE_BF16, 0x3f82), // tie -> even (up)
        (-0.0, KVR_DTYPE_BF16, 0x8000),
        (f32::INFINITY, KVR_DTYPE_BF16, 0x7f80),
    ];
    for &(v, dt, bits) in cases {
        let mut src = [v];
        let mut dst = [0u16; 1];
        let s = tensor(
            src.as_mut_ptr().cast(),
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            &[1],
            &[1],
        );
        let d = tensor(dst.as_mut_ptr().cast(), dt, KVR_DEVICE_HOST, &[1], &[1]);
        ok(kvr_tensor_copy(ctx, &s, &d, std::ptr::null_mut()));
        assert_eq!(dst[0] as u32, bits, "{v} -> dtype {dt}");
    }
    kvr_context_free(ctx);
}

#[test]
fn copy_onto_itself_is_a_no_op() {
    let ctx = context(KVR_BACKEND_CPU, std::ptr::null_mut()).unwrap();
    let mut buf: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let before = buf.clone();
    let t = tensor(
        buf.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[8, 8],
        &[8, 1],
    );
    ok(kvr_tensor_copy(ctx, &t, &t, std::ptr::null_mut()));
    assert_eq!(buf, before);
    kvr_context_free(ctx);
}

#[test]
fn tensor_init_builds_contiguous_descriptors() {
    let mut data = [0f32; 24];
    let mut t = std::mem::MaybeUninit::<kvr_tensor>::uninit();
    ok(kvr_tensor_init(
        t.as_mut_ptr(),
        data.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        3,
        [2i64, 3, 4].as_ptr(),
    ));
    let t = unsafe { t.assume_init() };
    assert_eq!(&t.shape[..3], &[2, 3, 4]);
    assert_eq!(&t.strides[..3], &[12, 4, 1]);
    let mut u = tensor(std::ptr::null_mut(), 0, 0, &[], &[]);
    let before = format!("{u:?}");
    assert_eq!(
        kvr_tensor_init(
            &mut u,
            data.as_mut_ptr().cast(),
            9,
            KVR_DEVICE_HOST,
            1,
            [2i64].as_ptr()
        ),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(format!("{u:?}"), before, "written on failure");
    assert_eq!(
        kvr_tensor_init(
            &mut u,
            std::ptr::null_mut(),
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            1,
            [2i64].as_ptr()
        ),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_tensor_init(
            &mut u,
            data.as_mut_ptr().cast(),
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            1,
            std::ptr::null()
        ),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_tensor_init(
            &mut u,
            data.as_mut_ptr().cast(),
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            9,
            [2i64; 9].as_ptr()
        ),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(
        kvr_tensor_init(
            std::ptr::null_mut(),
            data.as_mut_ptr().cast(),
            KVR_DTYPE_F32,
            KVR_DEVICE_HOST,
            0,
            std::ptr::null()
        ),
        KVR_STATUS_NULL_ARG
    );
}
