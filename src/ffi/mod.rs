//! The C ABI. Every `extern "C"` item of the library lives in this module; the header
//! `include/kvreplay.h` is generated from it by cbindgen (scripts/gen-header.sh).
//!
//! Conventions (README, "C API conventions"): functions are `kvr_<object>_<verb>`, the object
//! first, then inputs, then outputs; every fallible function returns a [`kvr_status`];
//! out-parameters are written only on success; a failed call leaves every object as it
//! was; no panic crosses the boundary (each body runs in [`guard`]); handles are checked
//! against a registry of live objects, so a stale or foreign handle is an error, not a crash.

#![allow(non_camel_case_types)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod context;
pub mod gdn;
pub mod guard;
pub(crate) mod handles;
pub mod kv_pool;
pub mod model;
pub mod status;
pub mod tensor;
pub mod version;

pub use context::*;
pub use gdn::*;
pub use guard::kvr_last_error_message;
pub use kv_pool::*;
pub use model::*;
pub use status::*;
pub use tensor::*;
pub use version::*;
