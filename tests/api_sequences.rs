//! Replays the committed corpora of the API-sequence fuzz targets (fuzz/corpus/kv_pool_api,
//! fuzz/corpus/gdn_pool_api) and the inputs they found failing
//! (tests/data/api-regressions/<target>) through the same decode-and-check functions as the
//! cargo-fuzz targets (fuzz/api/), on stable Rust: every input must agree with the model.

#[path = "../fuzz/api/mod.rs"]
mod api;

use std::path::Path;

fn replay(dir: &Path, run: fn(&[u8])) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut entries: Vec<_> = rd
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    for path in &entries {
        let bytes = std::fs::read(path).unwrap();
        let r = std::panic::catch_unwind(|| run(&bytes));
        assert!(r.is_ok(), "{} fails", path.display());
    }
    entries.len()
}

fn corpus(target: &str, run: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let n = replay(&root.join("fuzz/corpus").join(target), run);
    let r = replay(&root.join("tests/data/api-regressions").join(target), run);
    println!("{target}: {n} corpus inputs, {r} regressions");
    n
}

/// Random inputs on top of the corpus (quick; the fuzzer does the long runs);
/// `KVR_API_RANDOM=n` runs n of them instead.
fn random(run: fn(&[u8]), n: usize) {
    let n = std::env::var("KVR_API_RANDOM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    let mut x = 0x1234_5678_9abc_def0u64;
    for len in 0..n {
        let bytes: Vec<u8> = (0..(len % 300))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        run(&bytes);
    }
}

#[test]
fn kv_pool_api_corpus_replays() {
    corpus("kv_pool_api", api::kv::run);
    random(api::kv::run, 300);
}

#[test]
fn gdn_pool_api_corpus_replays() {
    corpus("gdn_pool_api", api::gdn::run);
    random(api::gdn::run, 300);
}
