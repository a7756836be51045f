//! Replays the committed fuzz corpus (fuzz/corpus/gguf_loader) and the inputs the fuzzer
//! found crashing (tests/data/fuzz-regressions) through the same entry point as the
//! cargo-fuzz target, on stable Rust: every input is accepted or refused, none panics.

use std::path::Path;

fn replay(dir: &Path) -> (usize, usize) {
    let (mut accepted, mut refused) = (0, 0);
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let bytes = std::fs::read(&path).unwrap();
        if kvreplay::gguf::exercise(&bytes) {
            accepted += 1;
        } else {
            refused += 1;
        }
    }
    (accepted, refused)
}

#[test]
fn fuzz_corpus_and_regressions_replay_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (a, r) = replay(&root.join("fuzz/corpus/gguf_loader"));
    assert!(a + r >= 3, "the corpus is missing");
    let (a2, r2) = replay(&root.join("tests/data/fuzz-regressions"));
    assert!(a2 + r2 >= 1);
    println!("corpus: {a} accepted, {r} refused; regressions: {a2} accepted, {r2} refused");
}
