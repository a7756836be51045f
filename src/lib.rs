//! kvreplay: paged KV memory for softmax-attention layers and replay decoding for
//! linear-attention / SSM layers, for C/C++ inference engines.
//!
//! The Rust core (everything but [`ffi`]) knows nothing about C; the C ABI lives in
//! [`ffi`] and is described by `include/kvreplay.h`.

mod abi;
pub mod backend;
pub mod error;
pub mod ffi;
pub mod gguf;
pub mod kv;
pub mod linear;
pub mod pool;
pub mod tensor;

pub use backend::{BackendKind, BackendRequest, Context, ContextOptions, DeviceInfo, Stream};
pub use error::{Error, Result};
pub use tensor::{DType, MemoryKind, TensorView, MAX_DIMS};

/// The library version, as in Cargo.toml.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
