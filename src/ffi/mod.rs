//! The C ABI. Every `extern "C"` item of the library lives in this module; the header
//! `include/kvreplay.h` is generated from it by cbindgen (scripts/gen-header.sh).
//!
//! Conventions (README, "C API conventions"): functions are `kvr_<object>_<verb>` with the
//! object's full name (`kvr_kv_pool_decode`, `kvr_gdn_pool_get_cursor`), the object first,
//! then inputs, then outputs; every fallible function returns a [`kvr_status`]; named values
//! are constants of their own typedef declared `N as kvr_<type>`; out-parameters are written
//! only on success; a failed call leaves every object as it was; no panic crosses the
//! boundary (each body runs in [`guard`]); handles are checked against a registry of live
//! objects, so a stale or foreign handle is an error, not a crash.
//!
//! Every exported function's doc comment (copied into the header) has the lines
//! `Returns:`, `Ownership:`, `Thread safety:` and `On failure:`; every type and field has a
//! doc comment. `scripts/check-header-docs.py` checks the header for both rules.

#![allow(non_camel_case_types)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]
// Named C values are declared `N as kvr_<type>`: cbindgen writes that cast into the header,
// so every value carries its type there (`#define KVR_LAYER_ALL ((kvr_layer_select)-1)`).
#![allow(clippy::unnecessary_cast)]

pub mod context;
pub mod gdn;
pub mod guard;
pub(crate) mod handles;
pub mod kv_pool;
pub mod mamba2;
pub mod model;
pub(crate) mod replay;
pub mod status;
pub mod tensor;
pub mod version;
pub mod wgkv;

pub use context::*;
pub use gdn::*;
pub use guard::kvr_error_last_message;
pub use kv_pool::*;
pub use mamba2::*;
pub use model::*;
pub use status::*;
pub use tensor::*;
pub use version::*;
pub use wgkv::*;
