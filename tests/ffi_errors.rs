//! Bad input through the C API: every failure is a status with a message, out-parameters
//! stay untouched, and nothing crashes.

mod common;

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use common::*;
use kvreplay::ffi::*;

fn defaults() -> kvr_context_params {
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_context_params_default(p.as_mut_ptr()));
    unsafe { p.assume_init() }
}

fn cpu_context() -> *mut kvr_context {
    let mut p = defaults();
    p.backend = KVR_BACKEND_CPU;
    p.n_threads = 2;
    let mut ctx = null_mut();
    ok(kvr_context_new(&p, &mut ctx));
    ctx
}

#[test]
fn status_strings() {
    let all = [
        KVR_STATUS_OK,
        KVR_STATUS_NULL_ARG,
        KVR_STATUS_INVALID_ARG,
        KVR_STATUS_OUT_OF_MEMORY,
        KVR_STATUS_CUDA_UNAVAILABLE,
        KVR_STATUS_NOT_COMPILED,
        KVR_STATUS_CUDA_ERROR,
        KVR_STATUS_UNSUPPORTED,
        KVR_STATUS_PANIC,
        KVR_STATUS_DTYPE_MISMATCH,
        KVR_STATUS_OUT_OF_RANGE,
        KVR_STATUS_UNKNOWN_ID,
        KVR_STATUS_POOL_EXHAUSTED,
        KVR_STATUS_IO_ERROR,
        KVR_STATUS_MALFORMED_FILE,
    ];
    let mut seen = std::collections::HashSet::new();
    for s in all {
        let text = status_name(s);
        assert_ne!(text, "unknown status", "status {s}");
        assert!(seen.insert(text), "duplicate text for {s}");
        assert!(s <= 0);
    }
    assert_eq!(KVR_STATUS_OK, 0);
    for s in [1, -99, 1000, i32::MIN, i32::MAX] {
        assert_eq!(status_name(s), "unknown status");
    }
    // Every status in the table is listed above (so a new code gets a string).
    assert_eq!(STATUS_STRINGS.len(), all.len());
}

#[test]
fn params_default_and_struct_size() {
    assert_eq!(kvr_context_params_default(null_mut()), KVR_STATUS_NULL_ARG);
    assert!(last_error().contains("params"), "{}", last_error());
    let p = defaults();
    assert_eq!(p.struct_size as usize, size_of::<kvr_context_params>());
    assert_eq!(p.backend, KVR_BACKEND_AUTO);
    assert_eq!(p.device, 0);
    assert!(p.stream.is_null());
    assert_eq!(p.n_threads, 0);

    let sentinel = 0x1234usize as *mut kvr_context;
    for size in [0u32, 4, size_of::<kvr_context_params>() as u32 - 1] {
        let mut q = defaults();
        q.struct_size = size;
        let mut out = sentinel;
        assert_eq!(
            kvr_context_new(&q, &mut out),
            KVR_STATUS_INVALID_ARG,
            "size {size}"
        );
        assert_eq!(out, sentinel, "out written on failure");
        assert!(last_error().contains("struct_size"), "{}", last_error());
    }
    // A caller compiled against a newer, larger struct: the known prefix is read when the
    // fields this library does not know are zero, and the call is refused otherwise.
    #[repr(C)]
    struct Bigger {
        p: kvr_context_params,
        extra: [u64; 8],
    }
    let mut big = Bigger {
        p: defaults(),
        extra: [0; 8],
    };
    big.p.struct_size = size_of::<Bigger>() as u32;
    big.p.backend = KVR_BACKEND_CPU;
    let mut out = null_mut();
    ok(kvr_context_new(&big as *const Bigger as *const _, &mut out));
    assert_eq!(kvr_context_get_backend(out), KVR_BACKEND_CPU);
    kvr_context_free(out);
    big.extra[3] = 0xff;
    let mut out = sentinel;
    assert_eq!(
        kvr_context_new(&big as *const Bigger as *const _, &mut out),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(out, sentinel);
    assert!(last_error().contains("cannot honour"), "{}", last_error());
}

#[test]
fn context_new_rejects_bad_params() {
    let sentinel = 0x5678usize as *mut kvr_context;
    type Edit = Box<dyn Fn(&mut kvr_context_params)>;
    let cases: Vec<(Edit, kvr_status)> = vec![
        (Box::new(|p| p.backend = 3), KVR_STATUS_INVALID_ARG),
        (Box::new(|p| p.backend = -2), KVR_STATUS_INVALID_ARG),
        (
            Box::new(|p| p.backend = KVR_BACKEND_INVALID),
            KVR_STATUS_INVALID_ARG,
        ),
        (Box::new(|p| p.device = -1), KVR_STATUS_INVALID_ARG),
        (
            Box::new(|p| {
                p.backend = KVR_BACKEND_CPU;
                p.n_threads = -4
            }),
            KVR_STATUS_INVALID_ARG,
        ),
        (
            Box::new(|p| {
                p.backend = KVR_BACKEND_CPU;
                p.n_threads = 100_000
            }),
            KVR_STATUS_INVALID_ARG,
        ),
    ];
    for (i, (edit, want)) in cases.iter().enumerate() {
        let mut p = defaults();
        edit(&mut p);
        let mut out = sentinel;
        assert_eq!(
            kvr_context_new(&p, &mut out),
            *want,
            "case {i}: {}",
            last_error()
        );
        assert_eq!(out, sentinel, "case {i}: out written on failure");
        assert!(!last_error().is_empty());
    }
    assert_eq!(kvr_context_new(null(), null_mut()), KVR_STATUS_NULL_ARG);
}

#[test]
fn context_lifecycle_and_dead_handles() {
    // NULL params means the defaults (AUTO: CPU on a machine without CUDA).
    let mut ctx = null_mut();
    ok(kvr_context_new(null(), &mut ctx));
    let b = kvr_context_get_backend(ctx);
    assert!(b == KVR_BACKEND_CPU || b == KVR_BACKEND_CUDA);
    kvr_context_free(ctx);
    // Freed: every call reports it instead of touching freed memory.
    assert_eq!(kvr_context_get_backend(ctx), KVR_BACKEND_INVALID);
    assert!(
        last_error().contains("not a live kvr_context"),
        "{}",
        last_error()
    );
    assert_eq!(kvr_context_load_kernels(ctx), KVR_STATUS_INVALID_ARG);
    assert_eq!(
        kvr_context_synchronize(ctx, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    kvr_context_free(ctx); // double free: ignored, recorded
    assert!(last_error().contains("freed twice"), "{}", last_error());
    kvr_context_free(null_mut()); // no-op
    kvr_context_free(0xdead_beef_usize as *mut kvr_context); // a made-up handle: ignored
    assert_eq!(kvr_context_get_backend(null()), KVR_BACKEND_INVALID);
    assert_eq!(kvr_context_load_kernels(null()), KVR_STATUS_NULL_ARG);
    assert_eq!(
        kvr_context_synchronize(null(), null_mut()),
        KVR_STATUS_NULL_ARG
    );
}

#[test]
fn device_info_on_cpu() {
    let ctx = cpu_context();
    let mut info: kvr_device_info = unsafe { std::mem::zeroed() };
    assert_eq!(
        kvr_context_get_device_info(ctx, &mut info),
        KVR_STATUS_INVALID_ARG,
        "struct_size 0"
    );
    info.struct_size = size_of::<kvr_device_info>() as u32;
    ok(kvr_context_get_device_info(ctx, &mut info));
    assert_eq!(info.backend, KVR_BACKEND_CPU);
    assert_eq!(info.device, -1);
    assert_eq!(info.multiprocessor_count, 2);
    assert!(info.total_memory_bytes > 0);
    let name = unsafe { CStr::from_ptr(info.name.as_ptr()) };
    assert!(!name.to_bytes().is_empty());
    // One byte short of the first published layout: refused, nothing written.
    let mut short: kvr_device_info = unsafe { std::mem::zeroed() };
    short.struct_size = size_of::<kvr_device_info>() as u32 - 1;
    assert_eq!(
        kvr_context_get_device_info(ctx, &mut short),
        KVR_STATUS_INVALID_ARG
    );
    assert_eq!(short.backend, 0);
    // A caller compiled against a newer, larger struct: our fields are written, the rest
    // is left alone, and struct_size says how much was written.
    let mut big = [0xabu8; size_of::<kvr_device_info>() + 32];
    let big_len = big.len() as u32;
    big[..4].copy_from_slice(&big_len.to_le_bytes());
    ok(kvr_context_get_device_info(ctx, big.as_mut_ptr().cast()));
    let written = u32::from_le_bytes(big[..4].try_into().unwrap()) as usize;
    assert_eq!(written, size_of::<kvr_device_info>());
    assert!(
        big[written..].iter().all(|&b| b == 0xab),
        "wrote past our layout"
    );
    assert_eq!(
        kvr_context_get_device_info(ctx, null_mut()),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_context_get_device_info(null(), &mut info),
        KVR_STATUS_NULL_ARG
    );
    kvr_context_free(ctx);
}

#[test]
fn cuda_requests_without_cuda() {
    let mut count = -7;
    let s = kvr_cuda_get_device_count(&mut count);
    assert_eq!(kvr_cuda_get_device_count(null_mut()), KVR_STATUS_NULL_ARG);
    let mut p = defaults();
    p.backend = KVR_BACKEND_CUDA;
    let mut out = null_mut();
    let r = kvr_context_new(&p, &mut out);
    if !kvr_library_kernels_compiled() {
        assert_eq!(r, KVR_STATUS_NOT_COMPILED, "{}", last_error());
        assert!(
            last_error().contains("without CUDA kernels"),
            "{}",
            last_error()
        );
    } else if s == KVR_STATUS_CUDA_UNAVAILABLE || (s == KVR_STATUS_OK && count == 0) {
        assert_eq!(
            count,
            if s == KVR_STATUS_OK { 0 } else { -7 },
            "out written on failure"
        );
        assert_eq!(r, KVR_STATUS_CUDA_UNAVAILABLE, "{}", last_error());
        assert!(out.is_null());
        println!("no CUDA here, as expected: {}", last_error());
    } else {
        ok(r);
        assert_eq!(kvr_context_get_backend(out), KVR_BACKEND_CUDA);
        kvr_context_free(out);
        // An ordinal past the last device.
        p.device = count;
        let mut none = null_mut();
        assert_eq!(kvr_context_new(&p, &mut none), KVR_STATUS_CUDA_UNAVAILABLE);
        assert!(none.is_null());
        return;
    }
    // AUTO falls back to the CPU.
    p.backend = KVR_BACKEND_AUTO;
    let mut auto = null_mut();
    ok(kvr_context_new(&p, &mut auto));
    assert_eq!(kvr_context_get_backend(auto), KVR_BACKEND_CPU);
    kvr_context_free(auto);
}

#[test]
fn copy_rejects_bad_tensors() {
    let ctx = cpu_context();
    let mut src = vec![1.5f32; 64];
    let mut dst = vec![-2.0f32; 64];
    let sp = src.as_mut_ptr().cast();
    let dp = dst.as_mut_ptr().cast();
    let good_s = tensor(sp, KVR_DTYPE_F32, KVR_DEVICE_HOST, &[8, 8], &[8, 1]);
    let good_d = tensor(dp, KVR_DTYPE_F16, KVR_DEVICE_HOST, &[8, 8], &[8, 1]);
    let with = |base: &kvr_tensor, f: &dyn Fn(&mut kvr_tensor)| {
        let mut t = *base;
        f(&mut t);
        t
    };
    let bad: Vec<(kvr_tensor, kvr_tensor, kvr_status, &str)> = vec![
        (
            with(&good_s, &|t| t.dtype = 7),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "unknown dtype",
        ),
        (
            good_s,
            with(&good_d, &|t| t.dtype = -1),
            KVR_STATUS_INVALID_ARG,
            "unknown dtype",
        ),
        (
            with(&good_s, &|t| t.device = 5),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "unknown device",
        ),
        (
            with(&good_s, &|t| t.device = KVR_DEVICE_CUDA),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "cuda memory",
        ),
        (
            with(&good_s, &|t| t.ndim = 9),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "ndim",
        ),
        (
            with(&good_s, &|t| t.ndim = -1),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "ndim",
        ),
        (
            with(&good_s, &|t| t.shape[0] = -8),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "negative",
        ),
        (
            with(&good_s, &|t| t.strides[1] = -1),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "negative",
        ),
        (
            with(&good_s, &|t| t.shape[0] = 4),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "shapes differ",
        ),
        (
            with(&good_s, &|t| t.data = null_mut()),
            good_d,
            KVR_STATUS_NULL_ARG,
            "NULL",
        ),
        (
            good_s,
            with(&good_d, &|t| t.data = null_mut()),
            KVR_STATUS_NULL_ARG,
            "NULL",
        ),
        (
            with(&good_s, &|t| t.data = (sp as usize + 2) as *mut _),
            good_d,
            KVR_STATUS_INVALID_ARG,
            "aligned",
        ),
        (
            good_s,
            with(&good_d, &|t| t.strides = [1, 1, 0, 0, 0, 0, 0, 0]),
            KVR_STATUS_INVALID_ARG,
            "overlap",
        ),
        (
            good_s,
            with(&good_d, &|t| t.strides[0] = 0),
            KVR_STATUS_INVALID_ARG,
            "overlap",
        ),
        (
            with(&good_s, &|t| {
                t.shape[0] = i64::MAX;
                t.strides[0] = i64::MAX
            }),
            with(&good_d, &|t| t.shape[0] = i64::MAX),
            KVR_STATUS_INVALID_ARG,
            "overflow",
        ),
    ];
    for (i, (s, d, want, words)) in bad.iter().enumerate() {
        let r = kvr_tensor_copy(ctx, s, d, null_mut());
        assert_eq!(r, *want, "case {i}: {}", last_error());
        assert!(
            last_error().contains(words),
            "case {i}: {:?} lacks {words:?}",
            last_error()
        );
        assert!(
            dst.iter().all(|&x| x == -2.0),
            "case {i}: destination touched"
        );
    }
    assert_eq!(
        kvr_tensor_copy(ctx, null(), &good_d, null_mut()),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_tensor_copy(ctx, &good_s, null(), null_mut()),
        KVR_STATUS_NULL_ARG
    );
    assert_eq!(
        kvr_tensor_copy(null(), &good_s, &good_d, null_mut()),
        KVR_STATUS_NULL_ARG
    );
    // Empty tensors may have NULL data.
    let e = tensor(null_mut(), KVR_DTYPE_F32, KVR_DEVICE_HOST, &[0, 3], &[3, 1]);
    ok(kvr_tensor_copy(ctx, &e, &e, null_mut()));
    kvr_context_free(ctx);
    assert_eq!(
        kvr_tensor_copy(ctx, &good_s, &good_d, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert!(dst.iter().all(|&x| x == -2.0));
}

#[test]
fn last_error_is_per_thread() {
    assert_eq!(kvr_context_params_default(null_mut()), KVR_STATUS_NULL_ARG);
    let here = last_error();
    let there = std::thread::spawn(last_error).join().unwrap();
    assert!(!here.is_empty());
    assert_eq!(there, "");
}
