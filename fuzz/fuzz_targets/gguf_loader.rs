//! The GGUF loader on arbitrary bytes: validate, plan, size, view every tensor.
//!
//!     KVR_NVCC=none cargo +nightly fuzz run gguf_loader -- -max_total_time=600
//!
//! Inputs that are refused must be refused with an error; none may panic, hang or
//! allocate without bound. tests/gguf_corpus.rs replays the committed corpus on stable.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvreplay::gguf::exercise(data);
});
