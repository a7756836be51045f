//! Shared by the API-sequence harnesses: the input reader, a value RNG, host buffers sized
//! exactly to what their descriptors span (so AddressSanitizer sees any read or write past
//! them), element encodings, the shared CPU context and status checks.

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::OnceLock;

use half::{bf16, f16};
use kvreplay::ffi::*;

/// Reads the fuzz input as a stream of choices; past its end every read is 0.
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data, pos: 0 }
    }
    pub fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    /// A choice in `0..n` (n <= 256).
    pub fn below(&mut self, n: usize) -> usize {
        self.byte() as usize % n.max(1)
    }
    /// True with probability about `num / den` (den <= 256).
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }
    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// SplitMix64 for the values (the input chooses structure, not floats): the tests' RNG.
#[path = "../../tests/common/rng.rs"]
mod rng;
pub use rng::Rng;

#[path = "../../tests/common/gdn_call.rs"]
mod gdn_call;
#[allow(unused_imports)]
pub use gdn_call::gdn_pool_call;

pub fn dsize(dtype: kvr_dtype) -> usize {
    match dtype {
        KVR_DTYPE_F16 | KVR_DTYPE_BF16 => 2,
        _ => 4,
    }
}

/// `x` as stored in `dtype` (round to nearest even), back in f32.
pub fn round(dtype: kvr_dtype, x: f32) -> f32 {
    match dtype {
        KVR_DTYPE_F16 => f16::from_f32(x).to_f32(),
        KVR_DTYPE_BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

pub fn is_float(dtype: kvr_dtype) -> bool {
    matches!(dtype, KVR_DTYPE_F32 | KVR_DTYPE_F16 | KVR_DTYPE_BF16)
}

pub const FLOATS: [kvr_dtype; 3] = [KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_BF16];

/// Host memory of `bytes` bytes, 4-byte aligned, exactly as long as asked (rounded up to 4).
pub struct Mem {
    words: Vec<u32>,
}

impl Mem {
    pub fn new(bytes: usize) -> Self {
        Mem {
            words: vec![0; bytes.div_ceil(4)],
        }
    }
    pub fn addr(&self) -> usize {
        self.words.as_ptr() as usize
    }
    pub fn ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr() as *mut c_void
    }
    pub fn bytes(&self) -> usize {
        self.words.len() * 4
    }
    fn check(&self, byte: usize, n: usize) {
        assert!(
            byte + n <= self.bytes(),
            "harness bug: access past a buffer"
        );
    }
    /// Element bits of `dtype` at element index `i` (from the start).
    pub fn bits(&self, dtype: kvr_dtype, i: usize) -> u32 {
        let s = dsize(dtype);
        self.check(i * s, s);
        // SAFETY: in bounds (checked), aligned to the element size.
        unsafe {
            if s == 2 {
                (self.words.as_ptr() as *const u16).add(i).read() as u32
            } else {
                self.words.as_ptr().add(i).read()
            }
        }
    }
    pub fn set_bits(&mut self, dtype: kvr_dtype, i: usize, bits: u32) {
        let s = dsize(dtype);
        self.check(i * s, s);
        // SAFETY: as above.
        unsafe {
            if s == 2 {
                (self.words.as_mut_ptr() as *mut u16)
                    .add(i)
                    .write(bits as u16)
            } else {
                self.words.as_mut_ptr().add(i).write(bits)
            }
        }
    }
    pub fn get(&self, dtype: kvr_dtype, i: usize) -> f32 {
        decode(dtype, self.bits(dtype, i))
    }
    pub fn set(&mut self, dtype: kvr_dtype, i: usize, x: f32) {
        self.set_bits(dtype, i, encode(dtype, x))
    }
}

pub fn encode(dtype: kvr_dtype, x: f32) -> u32 {
    match dtype {
        KVR_DTYPE_F16 => f16::from_f32(x).to_bits() as u32,
        KVR_DTYPE_BF16 => bf16::from_f32(x).to_bits() as u32,
        KVR_DTYPE_I32 => x as i32 as u32,
        _ => x.to_bits(),
    }
}

pub fn decode(dtype: kvr_dtype, bits: u32) -> f32 {
    match dtype {
        KVR_DTYPE_F16 => f16::from_bits(bits as u16).to_f32(),
        KVR_DTYPE_BF16 => bf16::from_bits(bits as u16).to_f32(),
        KVR_DTYPE_I32 => bits as i32 as f32,
        _ => f32::from_bits(bits),
    }
}

/// A bit pattern no call writes: a NaN with a payload (f32) or an f16/bf16 NaN.
pub fn sentinel(dtype: kvr_dtype) -> u32 {
    match dtype {
        KVR_DTYPE_F16 => 0x7E5A,
        KVR_DTYPE_BF16 => 0x7FA5,
        _ => 0x7FC0_5A5A,
    }
}

/// How a valid tensor's strides are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Row-major, no gaps.
    Contiguous,
    /// Row-major with one element of padding after every row of every dimension.
    Padded,
    /// Column-major (the first dimension fastest).
    Reversed,
    /// Row-major with the outermost dimension of extent > 1 broadcast (stride 0): valid
    /// for inputs, an overlapping output.
    Broadcast,
}

pub const INPUT_STYLES: [Style; 4] = [
    Style::Contiguous,
    Style::Padded,
    Style::Reversed,
    Style::Broadcast,
];
pub const OUTPUT_STYLES: [Style; 3] = [Style::Contiguous, Style::Padded, Style::Reversed];

/// Whether a `Style::Broadcast` tensor of `shape` has two elements at one address.
pub fn broadcast_overlaps(shape: &[usize]) -> bool {
    shape.iter().all(|&n| n > 0) && shape.iter().any(|&n| n > 1)
}

pub fn strides_for(shape: &[usize], style: Style) -> Vec<usize> {
    let n = shape.len();
    let mut st = vec![0usize; n];
    match style {
        Style::Contiguous | Style::Broadcast => {
            let mut s = 1;
            for d in (0..n).rev() {
                st[d] = s;
                s *= shape[d].max(1);
            }
            if style == Style::Broadcast {
                if let Some(d) = (0..n).find(|&d| shape[d] > 1) {
                    st[d] = 0;
                }
            }
        }
        Style::Padded => {
            let mut s = 1;
            for d in (0..n).rev() {
                st[d] = s;
                s = s * shape[d].max(1) + 1;
            }
        }
        Style::Reversed => {
            let mut s = 1;
            for d in 0..n {
                st[d] = s;
                s *= shape[d].max(1);
            }
        }
    }
    st
}

/// A host tensor: its descriptor and memory that covers exactly what it spans.
pub struct Tensor {
    pub mem: Mem,
    pub dtype: kvr_dtype,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    /// Byte offset of element 0 in `mem` (1 for a misaligned descriptor).
    pub skew: usize,
    pub desc: kvr_tensor,
}

impl Tensor {
    /// A tensor of `shape` with `strides`; memory for exactly the elements it spans.
    pub fn with_strides(dtype: kvr_dtype, shape: &[usize], strides: &[usize]) -> Tensor {
        let numel: usize = shape.iter().product();
        let span = if numel == 0 {
            0
        } else {
            shape
                .iter()
                .zip(strides)
                .map(|(&n, &s)| (n - 1) * s)
                .sum::<usize>()
                + 1
        };
        let mem = Mem::new(span * dsize(dtype));
        let mut t = Tensor {
            mem,
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            skew: 0,
            desc: kvr_tensor {
                data: std::ptr::null_mut(),
                dtype,
                device: KVR_DEVICE_HOST,
                ndim: shape.len() as i32,
                shape: [0; 8],
                strides: [0; 8],
            },
        };
        for d in 0..shape.len() {
            t.desc.shape[d] = shape[d] as i64;
            t.desc.strides[d] = strides[d] as i64;
        }
        t.desc.data = if span == 0 {
            std::ptr::null_mut()
        } else {
            t.mem.ptr()
        };
        t
    }
    pub fn new(dtype: kvr_dtype, shape: &[usize], style: Style) -> Tensor {
        Tensor::with_strides(dtype, shape, &strides_for(shape, style))
    }
    /// Element index (from element 0) of `idx`.
    pub fn index(&self, idx: &[usize]) -> usize {
        debug_assert_eq!(idx.len(), self.shape.len());
        idx.iter().zip(&self.strides).map(|(&i, &s)| i * s).sum()
    }
    pub fn get(&self, idx: &[usize]) -> f32 {
        self.mem.get(self.dtype, self.index(idx))
    }
    /// Element `[b, t, rest..]`, or `[b, rest..]` for a tensor without its T dimension.
    pub fn get_bt(&self, four: bool, b: usize, t: usize, rest: &[usize]) -> f32 {
        let mut idx = [0usize; 8];
        idx[0] = b;
        let n = if four {
            idx[1] = t;
            2
        } else {
            1
        };
        idx[n..n + rest.len()].copy_from_slice(rest);
        self.get(&idx[..n + rest.len()])
    }
    pub fn set(&mut self, idx: &[usize], x: f32) {
        let i = self.index(idx);
        self.mem.set(self.dtype, i, x)
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Fills every element, row-major, from `f(index)` (stored rounded to the dtype).
    pub fn fill(&mut self, mut f: impl FnMut(&[usize]) -> f32) {
        let n = self.shape.len();
        if self.numel() == 0 {
            return;
        }
        let mut idx = [0usize; 8];
        loop {
            let x = f(&idx[..n]);
            let e: usize = idx[..n]
                .iter()
                .zip(&self.strides)
                .map(|(&i, &s)| i * s)
                .sum();
            self.mem.set(self.dtype, e, x);
            let mut d = n;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < self.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    /// Sets every byte the tensor spans to the dtype's sentinel.
    pub fn poison(&mut self) {
        let n = self.mem.bytes() / dsize(self.dtype);
        let s = sentinel(self.dtype);
        for i in 0..n {
            self.mem.set_bits(self.dtype, i, s);
        }
    }
    /// True when every element still holds the sentinel (a failed call wrote nothing).
    pub fn untouched(&self) -> bool {
        let n = self.mem.bytes() / dsize(self.dtype);
        let s = sentinel(self.dtype);
        (0..n).all(|i| self.mem.bits(self.dtype, i) == s)
    }
    pub fn desc(&self) -> kvr_tensor {
        self.desc
    }
}

/// One way to break a tensor descriptor, and the statuses the header gives for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Break {
    /// An unknown dtype value.
    UnknownDtype,
    /// An unknown device value.
    UnknownDevice,
    /// ndim outside 0..=8.
    BadNdim,
    /// A negative stride.
    NegativeStride,
    /// A negative extent.
    NegativeShape,
    /// NULL data with elements.
    NullData,
    /// A data pointer not aligned to the element size.
    Misaligned,
    /// CUDA memory given to a CPU pool.
    CudaMemory,
}

pub const BREAKS: [Break; 8] = [
    Break::UnknownDtype,
    Break::UnknownDevice,
    Break::BadNdim,
    Break::NegativeStride,
    Break::NegativeShape,
    Break::NullData,
    Break::Misaligned,
    Break::CudaMemory,
];

impl Break {
    /// Applies the break to `t` (which must hold at least one element of a 2-byte or wider
    /// dtype for `Misaligned`); returns the status the call must give.
    pub fn apply(self, t: &mut Tensor) -> kvr_status {
        match self {
            Break::UnknownDtype => {
                t.desc.dtype = 17;
                KVR_STATUS_INVALID_ARG
            }
            Break::UnknownDevice => {
                t.desc.device = 7;
                KVR_STATUS_INVALID_ARG
            }
            Break::BadNdim => {
                t.desc.ndim = if t.desc.ndim % 2 == 0 { 9 } else { -1 };
                KVR_STATUS_INVALID_ARG
            }
            Break::NegativeStride => {
                let d = (t.desc.ndim.max(1) - 1) as usize;
                if t.desc.ndim == 0 {
                    t.desc.ndim = 1;
                    t.desc.shape[0] = 1;
                }
                t.desc.strides[d] = -1;
                KVR_STATUS_INVALID_ARG
            }
            Break::NegativeShape => {
                if t.desc.ndim == 0 {
                    t.desc.ndim = 1;
                    t.desc.strides[0] = 1;
                }
                t.desc.shape[0] = -2;
                KVR_STATUS_INVALID_ARG
            }
            Break::NullData => {
                if t.numel() == 0 {
                    // No elements: NULL is allowed; make it non-empty-and-NULL instead.
                    t.desc.ndim = 1;
                    t.desc.shape[0] = 1;
                    t.desc.strides[0] = 1;
                }
                t.desc.data = std::ptr::null_mut();
                KVR_STATUS_NULL_ARG
            }
            Break::Misaligned => {
                // Re-home the tensor one byte into a buffer one element longer.
                let span = t.mem.bytes();
                let mem = Mem::new(span + 4);
                t.desc.data = (mem.addr() + 1) as *mut c_void;
                t.mem = mem;
                t.skew = 1;
                if t.numel() == 0 {
                    t.desc.ndim = 1;
                    t.desc.shape[0] = 1;
                    t.desc.strides[0] = 1;
                }
                KVR_STATUS_INVALID_ARG
            }
            Break::CudaMemory => {
                t.desc.device = KVR_DEVICE_CUDA;
                KVR_STATUS_INVALID_ARG
            }
        }
    }
}

static CONTEXT: OnceLock<usize> = OnceLock::new();

/// The CPU context every run shares (one thread: the caller's).
pub fn context() -> *mut kvr_context {
    *CONTEXT.get_or_init(|| {
        let mut p = std::mem::MaybeUninit::<kvr_context_params>::uninit();
        assert_eq!(kvr_context_params_default(p.as_mut_ptr()), KVR_STATUS_OK);
        // SAFETY: filled above.
        let mut p = unsafe { p.assume_init() };
        p.backend = KVR_BACKEND_CPU;
        p.n_threads = 1;
        let mut ctx = std::ptr::null_mut();
        assert_eq!(kvr_context_new(&p, &mut ctx), KVR_STATUS_OK);
        ctx as usize
    }) as *mut kvr_context
}

pub fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(kvr_error_last_message()) }
        .to_string_lossy()
        .into_owned()
}

/// The statuses a call may return (empty = it must succeed), each with where the harness
/// decided it (printed when the call disagrees).
#[derive(Clone, Debug, Default)]
pub struct Expect(pub Vec<(kvr_status, &'static std::panic::Location<'static>)>);

impl Expect {
    pub fn ok() -> Self {
        Expect(Vec::new())
    }
    #[track_caller]
    pub fn only(s: kvr_status) -> Self {
        Expect(vec![(s, std::panic::Location::caller())])
    }
    #[track_caller]
    pub fn add(&mut self, s: kvr_status) {
        self.0.push((s, std::panic::Location::caller()));
    }
    #[track_caller]
    pub fn add_if(&mut self, cond: bool, s: kvr_status) {
        if cond {
            self.0.push((s, std::panic::Location::caller()));
        }
    }
    pub fn is_ok(&self) -> bool {
        self.0.is_empty()
    }
    fn reasons(&self) -> String {
        self.0
            .iter()
            .map(|(s, l)| format!("{s} ({}:{})", l.file(), l.line()))
            .collect::<Vec<_>>()
            .join(", ")
    }
    /// Checks `got` against the expectation; returns true when the call succeeded.
    pub fn check(&self, got: kvr_status, what: &str) -> bool {
        assert_ne!(
            got,
            KVR_STATUS_PANIC,
            "{what}: the library panicked: {}",
            last_error()
        );
        if self.0.is_empty() {
            assert_eq!(
                got,
                KVR_STATUS_OK,
                "{what}: expected success, got {} ({})",
                got,
                last_error()
            );
        } else {
            assert!(
                self.0.iter().any(|x| x.0 == got),
                "{what}: expected one of [{}], got {} ({})",
                self.reasons(),
                got,
                if got == KVR_STATUS_OK {
                    String::from("success")
                } else {
                    last_error()
                }
            );
        }
        got == KVR_STATUS_OK
    }
}

/// Bytes of a parameter struct as a caller might pass it: `struct_size` equal to the
/// library's, smaller (refused), larger with a zero tail (accepted) or a non-zero tail
/// (refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StructSize {
    Exact,
    Smaller,
    LargerZero,
    LargerNonZero,
}

pub const STRUCT_SIZES: [StructSize; 4] = [
    StructSize::Exact,
    StructSize::Smaller,
    StructSize::LargerZero,
    StructSize::LargerNonZero,
];

impl StructSize {
    pub fn valid(self) -> bool {
        matches!(self, StructSize::Exact | StructSize::LargerZero)
    }
    /// A size the library accepts: larger with a zero tail about once in `den`, else exact.
    pub fn valid_one(inp: &mut Input, den: usize) -> Self {
        if inp.chance(1, den) {
            StructSize::LargerZero
        } else {
            StructSize::Exact
        }
    }
}

/// A parameter struct `T` (first field `uint32_t struct_size`) placed in a buffer with room
/// for a tail, its `struct_size` set per `size`.
pub struct Versioned<T> {
    words: Vec<u64>,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy> Versioned<T> {
    pub fn new(value: T, size: StructSize) -> Self {
        let n = size_of::<T>();
        let total = n + 24;
        let mut words = vec![0u64; total.div_ceil(8)];
        // SAFETY: the buffer holds `n` bytes (and more), 8-byte aligned.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &value as *const T as *const u8,
                words.as_mut_ptr() as *mut u8,
                n,
            );
        }
        let declared = match size {
            StructSize::Exact => n,
            StructSize::Smaller => n - 4,
            StructSize::LargerZero | StructSize::LargerNonZero => n + 16,
        };
        // SAFETY: in bounds.
        unsafe {
            (words.as_mut_ptr() as *mut u32).write(declared as u32);
            if size == StructSize::LargerNonZero {
                (words.as_mut_ptr() as *mut u8).add(n + 9).write(1);
            }
        }
        Versioned {
            words,
            _t: std::marker::PhantomData,
        }
    }
    pub fn ptr(&self) -> *const T {
        self.words.as_ptr() as *const T
    }
}

/// An output struct with `struct_size` first, filled by the library: `declared` bytes
/// announced inside a buffer of `room` bytes poisoned with 0xA5.
pub struct OutStruct {
    words: Vec<u64>,
    pub declared: usize,
}

impl OutStruct {
    pub fn new(declared: usize, room: usize) -> Self {
        let mut words = vec![0xA5A5_A5A5_A5A5_A5A5u64; room.div_ceil(8).max(1)];
        // SAFETY: at least 8 bytes.
        unsafe { (words.as_mut_ptr() as *mut u32).write(declared as u32) };
        OutStruct { words, declared }
    }
    pub fn ptr<T>(&mut self) -> *mut T {
        self.words.as_mut_ptr() as *mut T
    }
    pub fn byte(&self, i: usize) -> u8 {
        // SAFETY: callers stay inside the buffer.
        unsafe { (self.words.as_ptr() as *const u8).add(i).read() }
    }
    pub fn room(&self) -> usize {
        self.words.len() * 8
    }
    /// The struct as written (valid when the call succeeded and declared >= size_of::<T>).
    pub fn read<T: Copy>(&self) -> T {
        assert!(self.room() >= size_of::<T>());
        // SAFETY: in bounds, aligned.
        unsafe { (self.words.as_ptr() as *const T).read() }
    }
    /// True when no byte from `from` on was written.
    pub fn tail_untouched(&self, from: usize) -> bool {
        (from..self.room()).all(|i| self.byte(i) == 0xA5)
    }
}

/// Statuses of an i32 id tensor that is not i32 or not 1-D etc. are the caller's concern;
/// this builds a host i32 `[n]` tensor of `ids` (or with `style` strides).
pub fn ids_tensor(ids: &[i32], style: Style) -> Tensor {
    let mut t = Tensor::new(KVR_DTYPE_I32, &[ids.len()], style);
    if style == Style::Broadcast && ids.len() > 1 {
        // A broadcast id tensor repeats its first id: keep the rows consistent.
        t.mem.set_bits(KVR_DTYPE_I32, 0, ids[0] as u32);
    } else {
        for (i, &id) in ids.iter().enumerate() {
            let j = t.index(&[i]);
            t.mem.set_bits(KVR_DTYPE_I32, j, id as u32);
        }
    }
    t
}

/// What a broadcast id tensor really lists.
pub fn ids_seen(ids: &[i32], style: Style) -> Vec<i32> {
    if style == Style::Broadcast && !ids.is_empty() {
        vec![ids[0]; ids.len()]
    } else {
        ids.to_vec()
    }
}

/// The `seq_ids` tensor of a batch call for `rows`, broadcast or broken sometimes (with the
/// statuses that gives; `device_unsupported`: ids in device memory are UNSUPPORTED too);
/// returns (tensor, the ids the pool sees, passed as NULL?).
pub fn id_arg(
    inp: &mut Input,
    rows: &[i32],
    want: &mut Expect,
    device_unsupported: bool,
) -> (Tensor, Vec<i32>, bool) {
    let style = if inp.chance(1, 10) {
        Style::Broadcast
    } else {
        inp.pick(&OUTPUT_STYLES)
    };
    let seen = ids_seen(rows, style);
    let mut t = ids_tensor(rows, style);
    let mut null = false;
    match inp.below(16) {
        0 => {
            t.desc.dtype = KVR_DTYPE_F32;
            want.add(KVR_STATUS_DTYPE_MISMATCH);
        }
        1 => {
            t = Tensor::new(KVR_DTYPE_I32, &[rows.len(), 1], Style::Contiguous);
            for (i, &r) in rows.iter().enumerate() {
                t.mem.set_bits(KVR_DTYPE_I32, i, r as u32);
            }
            want.add(KVR_STATUS_INVALID_ARG);
        }
        2 => {
            let b = inp.pick(&BREAKS);
            want.add(b.apply(&mut t));
            if b == Break::CudaMemory && device_unsupported {
                want.add(KVR_STATUS_UNSUPPORTED);
            }
        }
        3 => {
            null = true;
            want.add(KVR_STATUS_NULL_ARG);
        }
        _ => {}
    }
    (t, seen, null)
}

/// Compares `got` with `want` within `tol * (1 + |want|)`.
pub fn close(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * (1.0 + want.abs())
}

/// A sequence id for a call on a pool whose live sequences are `seqs`: mostly live,
/// sometimes free, out of range or negative.
pub fn pick_id<V>(inp: &mut Input, seqs: &BTreeMap<i32, V>, max_seqs: usize) -> i32 {
    match inp.below(10) {
        0..=6 if !seqs.is_empty() => *seqs.keys().nth(inp.below(seqs.len())).unwrap(),
        0..=7 => inp.below(max_seqs + 1) as i32,
        _ => inp.pick(&[-1, -7, i32::MIN, i32::MAX, max_seqs as i32, 1000]),
    }
}

/// The C functions every pool kind has, for the calls both harnesses check alike.
pub struct PoolApi<P> {
    pub name: &'static str,
    pub seq_add: extern "C" fn(*mut P, *mut c_void, *mut i32) -> kvr_status,
    pub seq_free: extern "C" fn(*mut P, i32, *mut c_void) -> kvr_status,
    pub free: extern "C" fn(*mut P),
    /// A handle that was a live pool once (handles are never reused).
    pub dead: fn() -> *mut P,
    /// A live handle of another kind.
    pub foreign: fn() -> *mut P,
}

impl<P> PoolApi<P> {
    /// `seq_add` (`*out_seq` NULL sometimes) on a pool with `free_slot` or none: the new id.
    pub fn add(&self, pool: *mut P, inp: &mut Input, free_slot: bool) -> Option<i32> {
        let null_out = inp.chance(1, 8);
        let mut want = Expect::ok();
        want.add_if(null_out, KVR_STATUS_NULL_ARG);
        want.add_if(!free_slot, KVR_STATUS_POOL_EXHAUSTED);
        let mut id = -77;
        let out = if null_out { null_mut() } else { &mut id };
        let what = format!("{} seq_add", self.name);
        if want.check((self.seq_add)(pool, null_mut(), out), &what) {
            return Some(id);
        }
        assert_eq!(id, -77, "{}: a failed seq_add wrote *out_seq", self.name);
        None
    }

    /// `seq_free` of `id` (live or not); whether it succeeded.
    pub fn free_seq(&self, pool: *mut P, id: i32, live: bool) -> bool {
        let mut want = Expect::ok();
        want.add_if(!live, KVR_STATUS_UNKNOWN_ID);
        let what = format!("{} seq_free", self.name);
        want.check((self.seq_free)(pool, id, null_mut()), &what)
    }

    /// A NULL, dead or foreign handle and what every call through it must return.
    pub fn bad_handle(&self, inp: &mut Input) -> (*mut P, Expect) {
        let which = inp.below(3);
        let h = match which {
            0 => null_mut(),
            1 => (self.dead)(),
            _ => (self.foreign)(),
        };
        let mut want = Expect::only(KVR_STATUS_INVALID_ARG);
        want.add_if(which == 0, KVR_STATUS_NULL_ARG);
        (h, want)
    }

    /// After calls through a bad handle: freeing a NULL or dead one is ignored.
    pub fn free_bad(&self, h: *mut P) {
        if h.is_null() || h == (self.dead)() {
            (self.free)(h);
        }
    }

    /// Frees `old` and checks that its handle is dead (calls refused, a second free ignored).
    pub fn free_checked(&self, old: *mut P) {
        (self.free)(old);
        let mut id = -4;
        Expect::only(KVR_STATUS_INVALID_ARG).check(
            (self.seq_add)(old, null_mut(), &mut id),
            "seq_add on a freed pool",
        );
        assert_eq!(id, -4);
        (self.free)(old);
    }
}

/// A harness: a pool, its model, and the calls decoded from an input.
pub trait Harness: Sized {
    /// The pool configuration (and a first pool) from the input's first bytes.
    fn new(inp: &mut Input) -> Self;
    /// One call (or a few) decoded from the input, each checked as it returns.
    fn step(&mut self, inp: &mut Input);
    /// The whole pool against the model.
    fn check(&mut self);
    /// Frees the pool.
    fn close(self);
}

/// Decodes `data` into a pool and up to `max_ops` steps, checking the pool against the
/// model after every step. Panics (with the reason) on any disagreement.
pub fn drive<H: Harness>(data: &[u8], max_ops: usize) {
    let mut inp = Input::new(data);
    let mut h = H::new(&mut inp);
    let mut ops = 0;
    while !inp.exhausted() && ops < max_ops {
        h.step(&mut inp);
        h.check();
        ops += 1;
    }
    h.close();
}
