//! A GGUF file: memory-mapped (memmap2), its header checked against hostile input, then
//! decoded by gguf-rs, then every tensor's extent checked against the file.
//!
//! gguf-rs trusts the lengths in a file: a string length is allocated before it is read,
//! and arrays are materialized element by element (a byte of file becomes a
//! `serde_json::Value` of tens of bytes). So before gguf-rs sees the header, `walk_header`
//! bounds every length and count by the bytes that remain, caps configuration arrays
//! (tokenizer arrays are read but not kept: gguf-rs's `max_array_size` is 0), and checks
//! value and tensor types. After decoding, tensors must lie inside the data section,
//! aligned, with unique names and no overlap.
//!
//! Tensor byte sizes come from ggml's type traits (`ggml_type_traits`: block size and bytes
//! per block), not from gguf-rs 0.1.8, which sizes every type id >= 10 as a 256-element
//! block (so a bf16 tensor would appear 128 times smaller than it is).

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::tensor::{DType, MemoryKind, TensorView};

/// "GGUF" read as a little-endian u32.
const MAGIC_LE: u32 = 0x4655_4747;
/// The same four bytes written by a big-endian file.
const MAGIC_BE: u32 = 0x4747_5546;
/// Elements a non-tokenizer (configuration) array may hold.
const MAX_CONFIG_ARRAY: u64 = 1 << 16;
/// Configuration-array elements in one file.
const MAX_CONFIG_ELEMENTS: u64 = 1 << 20;
/// Bytes of a metadata key or tensor name.
const MAX_NAME: u64 = 1 << 16;
/// Dimensions of a tensor (GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;

/// ggml type ids of the element types kvreplay views (ggml.h `enum ggml_type`).
pub const GGML_TYPE_F32: u32 = 0;
pub const GGML_TYPE_F16: u32 = 1;
pub const GGML_TYPE_BF16: u32 = 30;

/// (elements per block, bytes per block) of a ggml type, as ggml's `type_traits` table has
/// them; None for the ids ggml removed (4, 5: Q4_2 and Q4_3; 31-33 and 36-38: repacked
/// layouts that never appear in files).
pub fn ggml_block(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        8 => (32, 34),    // Q8_0
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        15 => (256, 292), // Q8_K
        16 => (256, 66),  // IQ2_XXS
        17 => (256, 74),  // IQ2_XS
        18 => (256, 98),  // IQ3_XXS
        19 => (256, 50),  // IQ1_S
        20 => (32, 18),   // IQ4_NL
        21 => (256, 110), // IQ3_S
        22 => (256, 82),  // IQ2_S
        23 => (256, 136), // IQ4_XS
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        29 => (256, 56),  // IQ1_M
        30 => (1, 2),     // BF16
        34 => (256, 54),  // TQ1_0
        35 => (256, 66),  // TQ2_0
        39 => (32, 17),   // MXFP4
        _ => return None,
    })
}

fn malformed(msg: impl Into<String>) -> Error {
    Error::MalformedFile(msg.into())
}

/// The file's bytes: a read-only map, or owned bytes (tests, fuzzing), kept 8-byte aligned.
enum Backing {
    Map(memmap2::Mmap),
    Owned(Vec<u64>, usize),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            // SAFETY: `len` <= 8 * v.len() bytes of plain integers.
            Backing::Owned(v, len) => unsafe {
                std::slice::from_raw_parts(v.as_ptr() as *const u8, *len)
            },
        }
    }
}

/// A `Read` over the backing from a position (gguf-rs wants an owned reader).
struct SliceReader {
    data: Arc<Backing>,
    pos: usize,
}

impl Read for SliceReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let b = self.data.bytes();
        let n = buf.len().min(b.len().saturating_sub(self.pos));
        buf[..n].copy_from_slice(&b[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// One tensor of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name ("blk.3.ssm_a", ...).
    pub name: String,
    /// ggml type id.
    pub ggml_type: u32,
    /// Extents as GGUF lists them: innermost (contiguous) first.
    pub dims: Vec<u64>,
    /// Absolute file offset of the data.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    /// Extents outermost first (row-major order, as a `TensorView` has them).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// Name of a ggml type id (for messages).
pub fn ggml_type_name(t: u32) -> String {
    gguf_rs::GGMLType::try_from(t).map_or_else(|_| format!("ggml type {t}"), |g| g.to_string())
}

/// A validated, memory-mapped GGUF file.
pub struct GgufFile {
    data: Arc<Backing>,
    meta: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    version: u32,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("bytes", &self.len())
            .field("version", &self.version)
            .field("keys", &self.meta.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// What `walk_header` learned.
struct Header {
    version: u32,
    n_tensors: u64,
    alignment: u64,
    end: u64,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.b.len() - self.pos) as u64
    }
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(malformed(format!(
                "truncated file: {what} needs {n} bytes at offset {}, {} remain",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    /// A length-prefixed string, at most `max` bytes.
    fn string(&mut self, what: &str, max: u64) -> Result<&'a [u8]> {
        let n = self.u64(what)?;
        if n > max {
            return Err(malformed(format!(
                "{what} is {n} bytes long (at most {max})"
            )));
        }
        self.take(n, what)
    }
}

/// Bytes of a fixed-size metadata value type (None: string, array or unknown).
fn scalar_size(t: u32) -> Option<u64> {
    match t {
        0 | 1 | 7 => Some(1), // u8, i8, bool
        2 | 3 => Some(2),     // u16, i16
        4..=6 => Some(4),     // u32, i32, f32
        10..=12 => Some(8),   // u64, i64, f64
        _ => None,
    }
}

/// Checks the header's structure without allocating anything per the file's say-so.
fn walk_header(b: &[u8]) -> Result<Header> {
    let mut c = Cursor { b, pos: 0 };
    let magic = c.u32("the magic")?;
    if magic == MAGIC_BE {
        return Err(Error::Unsupported(
            "big-endian GGUF files are not supported".into(),
        ));
    }
    if magic != MAGIC_LE {
        return Err(malformed(format!("not a GGUF file (magic {magic:#010x})")));
    }
    let version = c.u32("the version")?;
    if version != 2 && version != 3 {
        return Err(Error::Unsupported(format!(
            "GGUF version {version} is not supported (2 and 3 are)"
        )));
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.u64("the key count")?;
    // Each key-value pair takes at least 8 + 4 + 1 bytes; each tensor info 8 + 4 + 4 + 8.
    if n_kv > c.remaining() / 13 {
        return Err(malformed(format!(
            "{n_kv} metadata keys cannot fit in the {} bytes left",
            c.remaining()
        )));
    }
    if n_tensors > c.remaining() / 24 {
        return Err(malformed(format!(
            "{n_tensors} tensors cannot fit in the {} bytes left",
            c.remaining()
        )));
    }
    let mut alignment = 32u64;
    let mut config_elems = 0u64;
    for i in 0..n_kv {
        let key = c.string("a metadata key", MAX_NAME)?;
        let key = String::from_utf8_lossy(key).into_owned();
        let t = c.u32("a value type")?;
        match t {
            8 => {
                c.string(&format!("string value of '{key}'"), u64::MAX)?;
            }
            9 => {
                let et = c.u32("an array element type")?;
                let n = c.u64("an array length")?;
                let tokenizer = key.starts_with("tokenizer.");
                if !tokenizer {
                    config_elems = config_elems.saturating_add(n);
                    if n > MAX_CONFIG_ARRAY || config_elems > MAX_CONFIG_ELEMENTS {
                        return Err(malformed(format!(
                            "array '{key}' has {n} elements (configuration arrays hold at most {MAX_CONFIG_ARRAY})"
                        )));
                    }
                }
                match (et, scalar_size(et)) {
                    (_, Some(sz)) => {
                        let bytes = n
                            .checked_mul(sz)
                            .ok_or_else(|| malformed(format!("array '{key}' overflows")))?;
                        c.take(bytes, &format!("array '{key}'"))?;
                    }
                    (8, None) => {
                        if n > c.remaining() / 8 {
                            return Err(malformed(format!(
                                "array '{key}' claims {n} strings; the file is shorter"
                            )));
                        }
                        for _ in 0..n {
                            c.string(&format!("a string of '{key}'"), u64::MAX)?;
                        }
                    }
                    (9, None) => return Err(malformed(format!("array '{key}' nests arrays"))),
                    _ => {
                        return Err(malformed(format!(
                            "array '{key}' has unknown element type {et}"
                        )))
                    }
                }
            }
            _ => match scalar_size(t) {
                Some(sz) => {
                    let v = c.take(sz, &format!("value of '{key}'"))?;
                    if key == "general.alignment" {
                        let a = match t {
                            4 | 5 => u32::from_le_bytes(v.try_into().expect("4 bytes")) as u64,
                            10 | 11 => u64::from_le_bytes(v.try_into().expect("8 bytes")),
                            _ => return Err(malformed("general.alignment is not an integer")),
                        };
                        if a == 0 || a % 8 != 0 || a > 1 << 20 {
                            return Err(malformed(format!(
                                "general.alignment = {a} (a multiple of 8, at most 1 MiB, is required)"
                            )));
                        }
                        alignment = a;
                    }
                }
                None => {
                    return Err(malformed(format!(
                        "metadata key {i} ('{key}') has unknown value type {t}"
                    )))
                }
            },
        }
    }
    for i in 0..n_tensors {
        let name = c.string("a tensor name", MAX_NAME)?;
        let name = String::from_utf8_lossy(name).into_owned();
        let nd = c.u32("a dimension count")?;
        if nd > MAX_DIMS {
            return Err(malformed(format!(
                "tensor {i} ('{name}') has {nd} dimensions (at most {MAX_DIMS})"
            )));
        }
        let mut numel = 1u64;
        for _ in 0..nd {
            let d = c.u64("a tensor extent")?;
            numel = numel.checked_mul(d).ok_or_else(|| {
                malformed(format!(
                    "tensor '{name}' has more elements than fit in 64 bits"
                ))
            })?;
        }
        let t = c.u32("a tensor type")?;
        if gguf_rs::GGMLType::try_from(t).is_err() || t >= 40 {
            return Err(malformed(format!(
                "tensor '{name}' has unknown ggml type {t}"
            )));
        }
        c.u64("a tensor offset")?;
    }
    Ok(Header {
        version,
        n_tensors,
        alignment,
        end: c.pos as u64,
    })
}

impl GgufFile {
    /// Maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path)
            .map_err(|e| Error::Io(format!("cannot open {}: {e}", path.display())))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::Io(format!("cannot stat {}: {e}", path.display())))?;
        if !meta.is_file() {
            return Err(Error::Io(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        if meta.len() == 0 {
            return Err(malformed(format!("{} is empty", path.display())));
        }
        // SAFETY: the map is read-only; like every mmap-based loader (llama.cpp too) we
        // rely on the file not being truncated underneath us while the model is open.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| Error::Io(format!("cannot map {}: {e}", path.display())))?;
        Self::from_backing(Backing::Map(map)).map_err(|e| match e {
            Error::MalformedFile(m) => Error::MalformedFile(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Validates a file held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: &[u8]) -> Result<GgufFile> {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `words` has room for `bytes.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                words.as_mut_ptr() as *mut u8,
                bytes.len(),
            )
        };
        Self::from_backing(Backing::Owned(words, bytes.len()))
    }

    fn from_backing(backing: Backing) -> Result<GgufFile> {
        let header = walk_header(backing.bytes())?;
        let len = backing.bytes().len() as u64;
        let data = Arc::new(backing);
        let reader = SliceReader {
            data: Arc::clone(&data),
            pos: 4,
        };
        // Tokenizer arrays are read past but not kept: kvreplay needs none of them.
        let mut container =
            gguf_rs::GGUFContainer::new(gguf_rs::ByteOrder::LE, Box::new(reader), 0);
        let model = container
            .decode()
            .map_err(|e| malformed(format!("GGUF decode failed: {e}")))?;
        let data_offset = header
            .end
            .checked_add(header.alignment - 1)
            .map(|x| x / header.alignment * header.alignment)
            .ok_or_else(|| malformed("data offset overflows"))?;
        if model.data_offset() != data_offset || model.alignment() != header.alignment {
            return Err(malformed(format!(
                "header layout disagreement (data at {} vs {data_offset}, alignment {} vs {})",
                model.data_offset(),
                model.alignment(),
                header.alignment
            )));
        }
        if model.tensors().len() as u64 != header.n_tensors {
            return Err(malformed("tensor count disagreement"));
        }
        if header.n_tensors > 0 && data_offset > len {
            return Err(malformed(format!(
                "the tensor data would start at {data_offset}, past the end ({len})"
            )));
        }
        let mut tensors = Vec::with_capacity(model.tensors().len());
        let mut by_name = HashMap::with_capacity(model.tensors().len());
        for t in model.tensors() {
            let (blck, bytes) = ggml_block(t.kind).ok_or_else(|| {
                Error::Unsupported(format!(
                    "tensor '{}' has {}, a type ggml removed",
                    t.name,
                    ggml_type_name(t.kind)
                ))
            })?;
            let ne0 = t.shape.first().copied().unwrap_or(1);
            if ne0 % blck != 0 {
                return Err(malformed(format!(
                    "tensor '{}': {} elements per row is not a multiple of the {}-element blocks of {}",
                    t.name,
                    ne0,
                    blck,
                    ggml_type_name(t.kind)
                )));
            }
            let numel = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let size = numel
                .and_then(|n| (n / blck).checked_mul(bytes))
                .ok_or_else(|| malformed(format!("tensor '{}' size overflows", t.name)))?;
            if t.offset % header.alignment != 0 {
                return Err(malformed(format!(
                    "tensor '{}' is at data offset {}, not a multiple of the alignment {}",
                    t.name, t.offset, header.alignment
                )));
            }
            let start = data_offset
                .checked_add(t.offset)
                .ok_or_else(|| malformed("tensor offset overflows"))?;
            let end = start
                .checked_add(size)
                .ok_or_else(|| malformed("tensor size overflows"))?;
            if end > len {
                return Err(malformed(format!(
                    "tensor '{}' ({size} bytes at offset {start}) runs past the end of the file ({len} bytes)",
                    t.name
                )));
            }
            if by_name.insert(t.name.clone(), tensors.len()).is_some() {
                return Err(malformed(format!("tensor name '{}' appears twice", t.name)));
            }
            tensors.push(TensorInfo {
                name: t.name.clone(),
                ggml_type: t.kind,
                dims: t.shape.clone(),
                offset: start,
                size,
            });
        }
        let mut spans: Vec<(u64, u64, usize)> = tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| t.size > 0)
            .map(|(i, t)| (t.offset, t.offset + t.size, i))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(malformed(format!(
                    "tensors '{}' and '{}' overlap",
                    tensors[w[0].2].name, tensors[w[1].2].name
                )));
            }
        }
        Ok(GgufFile {
            data,
            meta: model.metadata().clone(),
            tensors,
            by_name,
            version: header.version,
            alignment: header.alignment,
            data_offset,
        })
    }

    /// File size in bytes.
    pub fn len(&self) -> usize {
        self.data.bytes().len()
    }
    /// True for an empty file (never: such a file does not validate).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Tensor data alignment.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Where the tensor data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    /// Every metadata value (tokenizer arrays are empty: they are not kept).
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.meta
    }
    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }
    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::UnknownId(format!("the model has no tensor named '{name}'")))
    }

    /// A zero-copy, read-only host view of an f32, f16 or bf16 tensor (outermost dimension
    /// first), valid while this file is open. Other ggml types are `Unsupported`.
    pub fn view(&self, name: &str) -> Result<TensorView> {
        let t = self.tensor(name)?;
        let dtype = match t.ggml_type {
            GGML_TYPE_F32 => DType::F32,
            GGML_TYPE_F16 => DType::F16,
            GGML_TYPE_BF16 => DType::BF16,
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor '{name}' is {}; kvreplay views f32, f16 and bf16 tensors only",
                    ggml_type_name(other)
                )))
            }
        };
        let shape = t.shape();
        // Row-major strides, checked: a zero extent can hide huge others.
        let mut strides = vec![0isize; shape.len()];
        let mut acc = 1usize;
        for d in (0..shape.len()).rev() {
            strides[d] = isize::try_from(acc)
                .map_err(|_| malformed(format!("tensor '{name}' is too large to view")))?;
            acc = acc
                .checked_mul(shape[d])
                .ok_or_else(|| malformed(format!("tensor '{name}' is too large to view")))?;
        }
        if (acc as u64).checked_mul(dtype.size() as u64) != Some(t.size) {
            return Err(malformed(format!(
                "tensor '{name}' size {} does not match its shape {shape:?}",
                t.size
            )));
        }
        let addr = self.data.bytes().as_ptr() as usize + t.offset as usize;
        TensorView::new(addr, dtype, MemoryKind::Host, &shape, &strides)
    }

    /// `view` plus a check of the shape (outermost first).
    pub fn view_shaped(&self, name: &str, shape: &[usize]) -> Result<TensorView> {
        let v = self.view(name)?;
        if v.shape() != shape {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' has shape {:?}; expected {shape:?}",
                v.shape()
            )));
        }
        Ok(v)
    }

    /// The raw bytes of a tensor (any type).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        Ok(&self.data.bytes()[t.offset as usize..(t.offset + t.size) as usize])
    }
}
