//! The core error type. Its mapping to C status codes lives in `ffi::status`.

/// Every failure kvreplay reports. Each variant carries a message that says what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A required pointer was NULL.
    #[error("{0}")]
    NullArgument(String),
    /// An argument is malformed: bad enum value, inconsistent shape, bad stride, ...
    #[error("{0}")]
    InvalidArgument(String),
    /// A tensor has a dtype the operation does not accept.
    #[error("{0}")]
    DTypeMismatch(String),
    /// A size or index is outside what the object holds or supports.
    #[error("{0}")]
    OutOfRange(String),
    /// A sequence (or other object id) that does not exist.
    #[error("{0}")]
    UnknownId(String),
    /// A pool has no room: no free page or no free sequence slot.
    #[error("{0}")]
    PoolExhausted(String),
    /// Host or device memory could not be allocated.
    #[error("{0}")]
    OutOfMemory(String),
    /// The CUDA backend cannot be used here (no driver library, no device, bad ordinal).
    #[error("{0}")]
    CudaUnavailable(String),
    /// The library was built without CUDA kernels.
    #[error("{0}")]
    NotCompiled(String),
    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code}){detail}")]
    Cuda {
        call: &'static str,
        code: i32,
        name: String,
        detail: String,
    },
    /// The operation or combination is not supported (yet, or on this backend).
    #[error("{0}")]
    Unsupported(String),
    /// A file could not be opened, read or mapped.
    #[error("{0}")]
    Io(String),
    /// A file's contents are malformed: truncated, corrupted or inconsistent.
    #[error("{0}")]
    MalformedFile(String),
    /// A panic inside the library (a bug), caught at the C boundary.
    #[error("internal error (panic): {0}")]
    Panic(String),
}

/// Shorthand for results carrying [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
