//! A minimal GGUF writer for tests: well-formed files with known contents, and hostile
//! ones (any count, length, type, offset or alignment) byte by byte.
#![allow(dead_code)]

pub const T_U32: u32 = 4;
pub const T_I32: u32 = 5;
pub const T_F32: u32 = 6;
pub const T_BOOL: u32 = 7;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;
pub const T_U64: u32 = 10;

pub const GGML_F32: u32 = 0;
pub const GGML_F16: u32 = 1;
pub const GGML_Q8_0: u32 = 8;
pub const GGML_BF16: u32 = 30;

/// A tensor entry: name, extents innermost first, ggml type, offset in the data section.
#[derive(Clone)]
pub struct TensorEntry {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub offset: u64,
}

#[derive(Clone)]
pub struct Builder {
    pub magic: u32,
    pub version: u32,
    pub kv: Vec<u8>,
    pub n_kv: u64,
    pub tensors: Vec<TensorEntry>,
    pub data: Vec<u8>,
    pub alignment: usize,
    /// Overrides of the counts written in the header.
    pub n_kv_override: Option<u64>,
    pub n_tensors_override: Option<u64>,
}

fn str_bytes(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

impl Builder {
    /// A file with `general.architecture` set (when `arch` is not empty).
    pub fn new(arch: &str) -> Builder {
        let mut b = Builder {
            magic: 0x4655_4747,
            version: 3,
            kv: Vec::new(),
            n_kv: 0,
            tensors: Vec::new(),
            data: Vec::new(),
            alignment: 32,
            n_kv_override: None,
            n_tensors_override: None,
        };
        if !arch.is_empty() {
            b.string("general.architecture", arch);
        }
        b
    }
    pub fn raw_kv(&mut self, key: &str, value_type: u32, value: &[u8]) -> &mut Self {
        self.kv.extend(str_bytes(key));
        self.kv.extend(value_type.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
        self
    }
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw_kv(key, T_U32, &v.to_le_bytes())
    }
    pub fn string(&mut self, key: &str, v: &str) -> &mut Self {
        self.raw_kv(key, T_STRING, &str_bytes(v))
    }
    pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.raw_kv(key, T_BOOL, &[v as u8])
    }
    pub fn arr_bool(&mut self, key: &str, v: &[bool]) -> &mut Self {
        let mut b = T_BOOL.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(v.iter().map(|&x| x as u8));
        self.raw_kv(key, T_ARRAY, &b)
    }
    pub fn arr_u32(&mut self, key: &str, v: &[u32]) -> &mut Self {
        let mut b = T_U32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        for x in v {
            b.extend(x.to_le_bytes());
        }
        self.raw_kv(key, T_ARRAY, &b)
    }
    pub fn arr_i32(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let mut b = T_I32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        for x in v {
            b.extend(x.to_le_bytes());
        }
        self.raw_kv(key, T_ARRAY, &b)
    }
    /// A tensor whose data is `bytes`, placed at the next aligned data offset.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ggml_type: u32, bytes: &[u8]) -> &mut Self {
        let off = self.data.len().div_ceil(self.alignment) * self.alignment;
        self.data.resize(off, 0);
        self.data.extend_from_slice(bytes);
        self.tensors.push(TensorEntry {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            offset: off as u64,
        });
        self
    }
    /// A tensor entry with any offset and no data added.
    pub fn tensor_at(
        &mut self,
        name: &str,
        dims: &[u64],
        ggml_type: u32,
        offset: u64,
    ) -> &mut Self {
        self.tensors.push(TensorEntry {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            offset,
        });
        self
    }
    /// The header (magic .. tensor infos), unpadded.
    pub fn header(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(self.magic.to_le_bytes());
        out.extend(self.version.to_le_bytes());
        out.extend(
            self.n_tensors_override
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        out.extend(self.n_kv_override.unwrap_or(self.n_kv).to_le_bytes());
        out.extend_from_slice(&self.kv);
        for t in &self.tensors {
            out.extend(str_bytes(&t.name));
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend(t.offset.to_le_bytes());
        }
        out
    }
    pub fn build(&self) -> Vec<u8> {
        let mut out = self.header();
        let pad = out.len().div_ceil(self.alignment) * self.alignment;
        out.resize(pad, 0);
        out.extend_from_slice(&self.data);
        out
    }
}

/// A small valid llama file: 2 layers, 4 heads (2 KV), head dim 16, three tensors of
/// known contents (f32, f16, bf16) and one Q8_0 tensor.
pub fn llama_like() -> Builder {
    let mut b = Builder::new("llama");
    b.u32("llama.block_count", 2)
        .u32("llama.context_length", 128)
        .u32("llama.embedding_length", 64)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 2);
    let f32s: Vec<u8> = (0..6)
        .flat_map(|i| (i as f32 * 0.5 - 1.0).to_le_bytes())
        .collect();
    let f16s: Vec<u8> = (0..4)
        .flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes())
        .collect();
    let bf16s: Vec<u8> = (0..8)
        .flat_map(|i| half::bf16::from_f32(-(i as f32)).to_le_bytes())
        .collect();
    b.tensor("a.f32", &[3, 2], GGML_F32, &f32s)
        .tensor("b.f16", &[4], GGML_F16, &f16s)
        .tensor("c.bf16", &[2, 2, 2], GGML_BF16, &bf16s)
        .tensor("d.q8_0", &[32], GGML_Q8_0, &[0u8; 34]);
    b
}

/// A metadata-only nemotron_h file with Nemotron-H-8B's Mamba-2 shape (128 heads of head
/// dim 64, 8 groups of state dim 128, conv kernel 4 over 8192 + 2 x 8 x 128 channels) and
/// its attention shape (32 heads, 8 KV, head dim 128), in 4 layers: Mamba-2, attention,
/// MLP only, Mamba-2.
pub fn nemotron_h_like() -> Builder {
    let mut b = Builder::new("nemotron_h");
    b.u32("nemotron_h.block_count", 4)
        .u32("nemotron_h.context_length", 8192)
        .u32("nemotron_h.embedding_length", 4096)
        .u32("nemotron_h.attention.head_count", 32)
        .arr_u32("nemotron_h.attention.head_count_kv", &[0, 8, 0, 0])
        .arr_u32("nemotron_h.feed_forward_length", &[0, 0, 21504, 0])
        .u32("nemotron_h.ssm.conv_kernel", 4)
        .u32("nemotron_h.ssm.inner_size", 8192)
        .u32("nemotron_h.ssm.state_size", 128)
        .u32("nemotron_h.ssm.time_step_rank", 128)
        .u32("nemotron_h.ssm.group_count", 8);
    b
}
