//! The GDN pool through its C API: each input is a pool and a sequence of calls, checked
//! against a model with an f64 recurrent reference after every call (fuzz/api/gdn.rs).
//!
//!     KVR_NVCC=none cargo +nightly fuzz run gdn_pool_api -- -runs=10000000
//!
//! tests/api_sequences.rs replays the committed corpus on stable.
#![no_main]

#[path = "../api/mod.rs"]
mod api;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    api::gdn::run(data);
});
