//! Helpers shared by the integration tests: a seeded RNG, element encodings, and C-API
//! context/tensor builders.
#![allow(dead_code)]

use std::ffi::{c_void, CStr};

use half::{bf16, f16};
use kvreplay::ffi::*;

pub mod gdn;
mod gdn_call;
#[allow(unused_imports)]
pub use gdn_call::gdn_pool_call;
pub mod gguf;
pub mod gpu;
pub mod kv;
pub mod recur;
pub mod ssm;
pub mod wgkv;

mod rng;
pub use rng::Rng;

pub const DTYPES: [(kvr_dtype, &str, usize); 3] = [
    (KVR_DTYPE_F32, "f32", 4),
    (KVR_DTYPE_F16, "f16", 2),
    (KVR_DTYPE_BF16, "bf16", 2),
];

/// Encodes f32 values as `dtype` elements (round to nearest even), as raw bits in u32s.
pub fn encode(dtype: kvr_dtype, v: f32) -> u32 {
    match dtype {
        KVR_DTYPE_F32 => v.to_bits(),
        KVR_DTYPE_F16 => f16::from_f32(v).to_bits() as u32,
        KVR_DTYPE_BF16 => bf16::from_f32(v).to_bits() as u32,
        _ => unreachable!(),
    }
}

/// Decodes element bits of `dtype` to f32.
pub fn decode(dtype: kvr_dtype, bits: u32) -> f32 {
    match dtype {
        KVR_DTYPE_F32 => f32::from_bits(bits),
        KVR_DTYPE_F16 => f16::from_bits(bits as u16).to_f32(),
        KVR_DTYPE_BF16 => bf16::from_bits(bits as u16).to_f32(),
        _ => unreachable!(),
    }
}

pub fn dtype_size(dtype: kvr_dtype) -> usize {
    DTYPES.iter().find(|d| d.0 == dtype).unwrap().2
}

/// min(dk, the KV-only entries one value head's state memory holds): the largest useful
/// KV-only threshold of a replay pool, which `KVR_GDN_THRESHOLD_DEFAULT` picked before the
/// default became off. Tests of KV-only mode through the C API set it explicitly.
pub fn kv_only_threshold(dk: i32, dv: i32, state_dtype: kvr_dtype, entry_dtype: kvr_dtype) -> i32 {
    let (dk, dv) = (dk as usize, dv as usize);
    let head = dk * dv * dtype_size(state_dtype);
    let capacity = head / ((dk + dv) * dtype_size(entry_dtype) + 4);
    dk.min(capacity) as i32
}

/// A host buffer of `n` elements of `dtype`, 16-byte aligned, filled with `bits`.
pub struct HostBuf {
    words: Vec<u128>,
    pub dtype: kvr_dtype,
    pub n: usize,
}

impl HostBuf {
    pub fn new(dtype: kvr_dtype, n: usize, fill_bits: u32) -> Self {
        let bytes = n * dtype_size(dtype);
        let mut b = HostBuf {
            words: vec![0u128; bytes.div_ceil(16).max(1)],
            dtype,
            n,
        };
        for i in 0..n {
            b.set_bits(i, fill_bits);
        }
        b
    }
    pub fn ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr() as *mut c_void
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: u128 storage viewed as bytes.
        unsafe {
            std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.words.len() * 16)
        }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: u128 storage viewed as bytes.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.words.as_mut_ptr() as *mut u8,
                self.words.len() * 16,
            )
        }
    }
    pub fn bits(&self, i: usize) -> u32 {
        let s = dtype_size(self.dtype);
        let b = &self.bytes()[i * s..(i + 1) * s];
        match s {
            4 => u32::from_le_bytes(b.try_into().unwrap()),
            _ => u16::from_le_bytes(b.try_into().unwrap()) as u32,
        }
    }
    pub fn set_bits(&mut self, i: usize, bits: u32) {
        let s = dtype_size(self.dtype);
        let b = &mut self.bytes_mut()[i * s..(i + 1) * s];
        match s {
            4 => b.copy_from_slice(&bits.to_le_bytes()),
            _ => b.copy_from_slice(&(bits as u16).to_le_bytes()),
        }
    }
    pub fn byte_len(&self) -> usize {
        self.n * dtype_size(self.dtype)
    }
}

/// A tensor descriptor.
pub fn tensor(
    data: *mut c_void,
    dtype: kvr_dtype,
    device: kvr_device_type,
    shape: &[i64],
    strides: &[i64],
) -> kvr_tensor {
    let mut t = kvr_tensor {
        data,
        dtype,
        device,
        ndim: shape.len() as i32,
        shape: [0; KVR_MAX_DIMS],
        strides: [0; KVR_MAX_DIMS],
    };
    t.shape[..shape.len()].copy_from_slice(shape);
    t.strides[..strides.len()].copy_from_slice(strides);
    t
}

pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        s[d] = acc;
        acc *= shape[d];
    }
    s
}

/// Number of elements a strided view spans (max offset + 1), 0 if empty.
pub fn span(shape: &[i64], strides: &[i64]) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    1 + shape
        .iter()
        .zip(strides)
        .map(|(&n, &s)| ((n - 1) * s) as usize)
        .sum::<usize>()
}

/// Element offsets of every index of `shape`, row-major.
pub fn offsets(shape: &[i64], strides: &[i64]) -> Vec<usize> {
    let n: i64 = shape.iter().product();
    (0..n)
        .map(|mut i| {
            let mut off = 0i64;
            for d in (0..shape.len()).rev() {
                off += (i % shape[d]) * strides[d];
                i /= shape[d];
            }
            off as usize
        })
        .collect()
}

pub fn last_error() -> String {
    // SAFETY: kvr_error_last_message never returns NULL.
    unsafe { CStr::from_ptr(kvr_error_last_message()) }
        .to_string_lossy()
        .into_owned()
}

pub fn status_name(s: kvr_status) -> String {
    // SAFETY: kvr_status_string never returns NULL.
    unsafe { CStr::from_ptr(kvr_status_string(s)) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts OK, printing the last error otherwise.
#[track_caller]
pub fn ok(s: kvr_status) {
    assert_eq!(
        s,
        KVR_STATUS_OK,
        "status {s} ({}): {}",
        status_name(s),
        last_error()
    );
}

/// Creates a context through the C API.
pub fn context(
    backend: kvr_backend,
    stream: *mut c_void,
) -> Result<*mut kvr_context, (kvr_status, String)> {
    let mut p = std::mem::MaybeUninit::<kvr_context_params>::uninit();
    ok(kvr_context_params_default(p.as_mut_ptr()));
    // SAFETY: filled above.
    let mut p = unsafe { p.assume_init() };
    p.backend = backend;
    p.stream = stream;
    let mut ctx = std::ptr::null_mut();
    match kvr_context_new(&p, &mut ctx) {
        KVR_STATUS_OK => Ok(ctx),
        s => Err((s, last_error())),
    }
}

/// Compares element bits; two NaNs are equal whatever their payloads.
pub fn same_value(dtype: kvr_dtype, a: u32, b: u32) -> bool {
    a == b || (decode(dtype, a).is_nan() && decode(dtype, b).is_nan())
}

/// The expected bits of converting `bits` of `src` to `dst` (bit copy for equal dtypes).
pub fn converted(src: kvr_dtype, dst: kvr_dtype, bits: u32) -> u32 {
    if src == dst {
        bits
    } else {
        encode(dst, decode(src, bits))
    }
}

/// Values that stress conversions: signed zeros, infinities, NaN, subnormals, ties,
/// overflow past the f16 range, and the extremes.
pub fn special_values() -> Vec<f32> {
    vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
        1e-40,
        -1e-42,
        65504.0,
        65520.0,
        1e6,
        -3.0e38,
        f32::MAX,
        f32::MIN,
        1.0 + 1.0 / 2048.0, // f16 tie
        1.0 + 3.0 / 2048.0, // f16 tie, rounds up
        1.0 + 1.0 / 256.0,  // bf16 tie
        1.0 + 3.0 / 256.0,  // bf16 tie, rounds up
        6.0e-8,
        3.0e-5,
        0.333_333_34,
    ]
}

/// One strided copy: shape, strides of both sides (elements), dtypes.
#[derive(Clone, Debug)]
pub struct CopyCase {
    pub shape: Vec<i64>,
    pub src_strides: Vec<i64>,
    pub dst_strides: Vec<i64>,
    pub src_dtype: kvr_dtype,
    pub dst_dtype: kvr_dtype,
}

/// Poison for destination elements the copy must not touch (or must overwrite).
pub const POISON: u32 = 0x7fc0_dead;

impl CopyCase {
    pub fn contiguous(shape: &[i64], src_dtype: kvr_dtype, dst_dtype: kvr_dtype) -> Self {
        CopyCase {
            shape: shape.to_vec(),
            src_strides: contiguous_strides(shape),
            dst_strides: contiguous_strides(shape),
            src_dtype,
            dst_dtype,
        }
    }

    /// Source buffer: random values in [-4, 4) mixed with special values.
    pub fn make_source(&self, rng: &mut Rng) -> HostBuf {
        let n = span(&self.shape, &self.src_strides);
        let mut b = HostBuf::new(self.src_dtype, n, 0);
        let specials = special_values();
        for i in 0..n {
            let v = if rng.below(8) == 0 {
                specials[rng.below(specials.len())]
            } else {
                rng.uniform(-4.0, 4.0)
            };
            b.set_bits(i, encode(self.src_dtype, v));
        }
        b
    }

    /// Destination buffer filled with poison.
    pub fn make_destination(&self) -> HostBuf {
        let n = span(&self.shape, &self.dst_strides);
        HostBuf::new(
            self.dst_dtype,
            n,
            POISON
                & if dtype_size(self.dst_dtype) == 2 {
                    0xffff
                } else {
                    !0
                },
        )
    }

    /// What the destination must hold after the copy.
    pub fn expected(&self, src: &HostBuf, dst_before: &HostBuf) -> Vec<u32> {
        let mut out: Vec<u32> = (0..dst_before.n).map(|i| dst_before.bits(i)).collect();
        let so = offsets(&self.shape, &self.src_strides);
        let dof = offsets(&self.shape, &self.dst_strides);
        for (s, d) in so.iter().zip(&dof) {
            out[*d] = converted(self.src_dtype, self.dst_dtype, src.bits(*s));
        }
        out
    }

    /// Checks every destination element (copied and untouched ones); returns mismatches.
    pub fn check(&self, expected: &[u32], got: &HostBuf) -> usize {
        let mut bad = 0;
        for (i, &e) in expected.iter().enumerate() {
            let g = got.bits(i);
            if !same_value(self.dst_dtype, e, g) {
                if bad < 5 {
                    eprintln!(
                        "{:?}: element {i}: expected {e:#x} ({}), got {g:#x} ({})",
                        self,
                        decode(self.dst_dtype, e),
                        decode(self.dst_dtype, g)
                    );
                }
                bad += 1;
            }
        }
        bad
    }

    pub fn src_tensor(&self, data: *mut c_void, device: kvr_device_type) -> kvr_tensor {
        tensor(data, self.src_dtype, device, &self.shape, &self.src_strides)
    }

    pub fn dst_tensor(&self, data: *mut c_void, device: kvr_device_type) -> kvr_tensor {
        tensor(data, self.dst_dtype, device, &self.shape, &self.dst_strides)
    }
}

/// The layouts every copy test covers, for one dtype pair.
pub fn copy_cases(src_dtype: kvr_dtype, dst_dtype: kvr_dtype) -> Vec<CopyCase> {
    let mut v = vec![
        // contiguous: vectorized path with a tail, and a large threaded one
        CopyCase::contiguous(&[37, 129], src_dtype, dst_dtype),
        CopyCase::contiguous(&[3, 1 << 17], src_dtype, dst_dtype),
        CopyCase::contiguous(&[7], src_dtype, dst_dtype),
        CopyCase::contiguous(&[], src_dtype, dst_dtype),
        CopyCase::contiguous(&[4, 0, 3], src_dtype, dst_dtype),
    ];
    // transposed source into padded destination rows
    v.push(CopyCase {
        shape: vec![5, 7, 3],
        src_strides: vec![1, 15, 5],
        dst_strides: vec![7 * 4 + 2, 4, 1],
        src_dtype,
        dst_dtype,
    });
    // every other column of a matrix into a strided destination, with size-1 dimensions
    v.push(CopyCase {
        shape: vec![64, 1, 48, 1],
        src_strides: vec![200, 9, 2, 3],
        dst_strides: vec![1, 5, 64 + 3, 11],
        src_dtype,
        dst_dtype,
    });
    // broadcast source (stride 0) into a contiguous destination
    v.push(CopyCase {
        shape: vec![33, 65],
        src_strides: vec![1, 0],
        dst_strides: vec![65, 1],
        src_dtype,
        dst_dtype,
    });
    // eight dimensions
    v.push(CopyCase {
        shape: vec![2, 3, 2, 2, 3, 2, 2, 5],
        src_strides: contiguous_strides(&[2, 3, 2, 2, 3, 2, 2, 5]),
        // destination rows padded from 5 to 6 elements
        dst_strides: contiguous_strides(&[2, 3, 2, 2, 3, 2, 2, 6]),
        src_dtype,
        dst_dtype,
    });
    v
}
