//! API-sequence harnesses of the pools, shared by the cargo-fuzz targets
//! (fuzz/fuzz_targets/kv_pool_api.rs, gdn_pool_api.rs) and by the stable replay of their
//! corpora in `cargo test` (tests/api_sequences.rs): one decode-and-check function per pool
//! kind, `kv::run` and `gdn::run`, that panics on any disagreement with its model.
#![allow(dead_code)]
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

pub mod common;
pub mod gdn;
pub mod kv;
