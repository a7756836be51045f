//! GPU: CUDA contexts (own stream, a caller's stream, a foreign context's stream), and
//! kvr_tensor_copy against the CPU result for every dtype pair and layout, on random data
//! with poisoned outputs and every element checked, also replayed from a CUDA Graph.
//! Skips itself (printing why) on a machine without a GPU.

mod common;

use std::ffi::CStr;
use std::ptr::null_mut;

use common::gpu::*;
use common::*;
use kvreplay::ffi::*;

#[test]
fn gpu_context_on_device_and_info() {
    let Some(_core) = gpu_or_skip("gpu_context_on_device_and_info") else {
        return;
    };
    let ctx = context(KVR_BACKEND_CUDA, null_mut()).expect("CUDA context");
    assert_eq!(kvr_context_get_backend(ctx), KVR_BACKEND_CUDA);
    let mut info: kvr_device_info = unsafe { std::mem::zeroed() };
    info.struct_size = size_of::<kvr_device_info>() as u32;
    ok(kvr_context_get_device_info(ctx, &mut info));
    let name = unsafe { CStr::from_ptr(info.name.as_ptr()) }.to_string_lossy();
    println!(
        "device {}: {name}, {} SMs, sm_{}{}, {:.1} GiB ({:.1} free), L2 {} MiB, driver {}",
        info.device,
        info.multiprocessor_count,
        info.compute_capability_major,
        info.compute_capability_minor,
        info.total_memory_bytes as f64 / (1u64 << 30) as f64,
        info.free_memory_bytes as f64 / (1u64 << 30) as f64,
        info.l2_cache_bytes >> 20,
        info.driver_version
    );
    assert_eq!(info.backend, KVR_BACKEND_CUDA);
    assert!(!name.is_empty());
    assert!(info.multiprocessor_count > 0);
    assert!(info.compute_capability_major >= 8);
    assert!(info.total_memory_bytes > 0 && info.free_memory_bytes <= info.total_memory_bytes);
    assert!(info.driver_version >= 13000);
    ok(kvr_context_load_kernels(ctx));
    ok(kvr_context_synchronize(ctx, null_mut()));
    // AUTO picks CUDA here.
    let mut auto = null_mut();
    ok(kvr_context_new(std::ptr::null(), &mut auto));
    assert_eq!(kvr_context_get_backend(auto), KVR_BACKEND_CUDA);
    kvr_context_free(auto);
    // A device ordinal past the last one.
    let mut n = 0;
    ok(kvr_cuda_get_device_count(&mut n));
    let mut p = std::mem::MaybeUninit::uninit();
    ok(kvr_context_params_default(p.as_mut_ptr()));
    let mut p: kvr_context_params = unsafe { p.assume_init() };
    p.backend = KVR_BACKEND_CUDA;
    p.device = n;
    let mut none = null_mut();
    assert_eq!(kvr_context_new(&p, &mut none), KVR_STATUS_CUDA_UNAVAILABLE);
    assert!(none.is_null());
    kvr_context_free(ctx);
}

/// Runs `case` on the GPU (through `ctx`, on `stream`) and on the CPU; checks both against
/// the reference bits. `offset` shifts both data pointers by that many elements.
fn run_gpu_case(
    core: &kvreplay::Context,
    ctx: *mut kvr_context,
    cpu: *mut kvr_context,
    case: &CopyCase,
    rng: &mut Rng,
    stream: *mut std::ffi::c_void,
    offset: usize,
) -> usize {
    let mut src = case.make_source(rng);
    let mut dst_cpu = case.make_destination();
    let expected = case.expected(&src, &dst_cpu);
    let ss = dtype_size(case.src_dtype);
    let ds = dtype_size(case.dst_dtype);
    let d_src = alloc(core, src.byte_len() + 16 * ss);
    let d_dst = alloc(core, dst_cpu.byte_len() + 16 * ds);
    let src_bytes = &src.bytes()[..src.byte_len()];
    let mut padded = vec![0u8; offset * ss];
    padded.extend_from_slice(src_bytes);
    d_src.upload(&padded).unwrap();
    let mut dst_padded = vec![0u8; offset * ds];
    dst_padded.extend_from_slice(&dst_cpu.bytes()[..dst_cpu.byte_len()]);
    d_dst.upload(&dst_padded).unwrap();
    let s = case.src_tensor((d_src.addr() + offset * ss) as *mut _, KVR_DEVICE_CUDA);
    let d = case.dst_tensor((d_dst.addr() + offset * ds) as *mut _, KVR_DEVICE_CUDA);
    ok(kvr_tensor_copy(ctx, &s, &d, stream));
    ok(kvr_context_synchronize(ctx, stream));
    let mut back = vec![0u8; dst_padded.len()];
    d_dst.download(&mut back).unwrap();
    let mut got = case.make_destination();
    got.bytes_mut()[..dst_cpu.byte_len()].copy_from_slice(&back[offset * ds..]);
    let bad_gpu = case.check(&expected, &got);
    // The CPU backend on the same input gives the same bits.
    let s = case.src_tensor(src.ptr(), KVR_DEVICE_HOST);
    let d = case.dst_tensor(dst_cpu.ptr(), KVR_DEVICE_HOST);
    ok(kvr_tensor_copy(cpu, &s, &d, null_mut()));
    let bad_cpu = case.check(&expected, &dst_cpu);
    bad_gpu + bad_cpu
}

#[test]
fn gpu_copy_matches_cpu_for_every_dtype_pair_and_layout() {
    let Some(core) = gpu_or_skip("gpu_copy_matches_cpu") else {
        return;
    };
    let ctx = context(KVR_BACKEND_CUDA, null_mut()).unwrap();
    let cpu = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let mut rng = Rng::new(2);
    let (mut cases, mut elements, mut bad) = (0, 0usize, 0);
    for (sd, sn, _) in DTYPES {
        for (dd, dn, _) in DTYPES {
            let mut pair_bad = 0;
            for case in copy_cases(sd, dd) {
                // aligned (vectorized path where contiguous) and shifted by one element
                for offset in [0, 1] {
                    pair_bad += run_gpu_case(&core, ctx, cpu, &case, &mut rng, null_mut(), offset);
                    cases += 1;
                    elements += span(&case.shape, &case.dst_strides);
                }
            }
            println!("copy {sn} -> {dn}: {} mismatching elements", pair_bad);
            bad += pair_bad;
        }
    }
    println!("{cases} cases, {elements} destination elements checked, max relative error 0 required (bit-exact)");
    assert_eq!(bad, 0);
    kvr_context_free(ctx);
    kvr_context_free(cpu);
}

#[test]
fn gpu_context_on_a_caller_created_stream() {
    let Some(core) = gpu_or_skip("gpu_context_on_a_caller_created_stream") else {
        return;
    };
    let stream = RawStream::new(&core);
    let other = RawStream::new(&core);
    let ctx = context(KVR_BACKEND_CUDA, stream.ptr()).expect("context on the caller's stream");
    let cpu = context(KVR_BACKEND_CPU, null_mut()).unwrap();
    let mut rng = Rng::new(3);
    let case = CopyCase::contiguous(&[1024, 513], KVR_DTYPE_F32, KVR_DTYPE_BF16);
    // NULL per-call stream: queued on the caller's stream given at creation.
    assert_eq!(
        run_gpu_case(&core, ctx, cpu, &case, &mut rng, null_mut(), 0),
        0
    );
    // An explicit per-call stream.
    assert_eq!(
        run_gpu_case(&core, ctx, cpu, &case, &mut rng, other.ptr(), 0),
        0
    );

    // The copy really runs on the caller's stream: capture it there into a graph and
    // replay the graph over new inputs.
    let n = 4096usize;
    let d_src = alloc(&core, n * 4);
    let d_dst = alloc(&core, n * 2);
    let s = tensor(
        d_src.addr() as *mut _,
        KVR_DTYPE_F32,
        KVR_DEVICE_CUDA,
        &[n as i64],
        &[1],
    );
    let d = tensor(
        d_dst.addr() as *mut _,
        KVR_DTYPE_F16,
        KVR_DEVICE_CUDA,
        &[n as i64],
        &[1],
    );
    ok(kvr_context_load_kernels(ctx));
    let graph = stream.capture(|| ok(kvr_tensor_copy(ctx, &s, &d, null_mut())));
    for round in 0..3 {
        let v = rng.vec(n, -100.0, 100.0);
        d_src.upload(&v).unwrap();
        d_dst
            .fill_async(
                core.cuda().unwrap(),
                0xff,
                kvreplay::Stream(stream.ptr() as usize),
            )
            .unwrap();
        graph.launch(&stream);
        stream.sync();
        let mut out = vec![0u16; n];
        d_dst.download(&mut out).unwrap();
        let bad = (0..n)
            .filter(|&i| out[i] != half::f16::from_f32(v[i]).to_bits())
            .count();
        assert_eq!(bad, 0, "graph replay {round}");
    }
    drop(graph);
    kvr_context_free(ctx);
    kvr_context_free(cpu);
}

#[test]
fn gpu_rejects_foreign_streams_and_host_memory() {
    use cudarc::driver::sys;
    let Some(core) = gpu_or_skip("gpu_rejects_foreign_streams_and_host_memory") else {
        return;
    };
    // A stream of a context that is not the primary one.
    unsafe {
        let mut dev = 0;
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), sys::CUresult::CUDA_SUCCESS);
        let mut own = null_mut();
        assert_eq!(
            sys::cuCtxCreate_v4(&mut own, null_mut(), 0, dev),
            sys::CUresult::CUDA_SUCCESS
        );
        let mut s = null_mut();
        assert_eq!(sys::cuStreamCreate(&mut s, 0), sys::CUresult::CUDA_SUCCESS);
        let r = context(KVR_BACKEND_CUDA, s as *mut _);
        let (status, msg) = r.expect_err("a foreign stream must be refused");
        assert_eq!(status, KVR_STATUS_INVALID_ARG);
        assert!(msg.contains("primary context"), "{msg}");
        sys::cuStreamDestroy_v2(s);
        let mut prev = null_mut();
        sys::cuCtxPopCurrent_v2(&mut prev);
        sys::cuCtxDestroy_v2(own);
    }
    // Host memory in a CUDA context.
    let ctx = context(KVR_BACKEND_CUDA, null_mut()).unwrap();
    let mut host = vec![0f32; 16];
    let d_dst = alloc(&core, 64);
    let s = tensor(
        host.as_mut_ptr().cast(),
        KVR_DTYPE_F32,
        KVR_DEVICE_HOST,
        &[16],
        &[1],
    );
    let d = tensor(
        d_dst.addr() as *mut _,
        KVR_DTYPE_F32,
        KVR_DEVICE_CUDA,
        &[16],
        &[1],
    );
    assert_eq!(
        kvr_tensor_copy(ctx, &s, &d, null_mut()),
        KVR_STATUS_INVALID_ARG
    );
    assert!(last_error().contains("host memory"), "{}", last_error());
    kvr_context_free(ctx);
}
