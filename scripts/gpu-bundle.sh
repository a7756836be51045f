#!/usr/bin/env bash
# Builds (here, with cargo) everything the GPU machine runs: the GPU test binaries
# (tests/gpu_*.rs), the benchmark programs, the C GPU test, the soak and the examples, plus the
# shared library; strips them and writes gpu-bundle/ (git-ignored) with run-all.sh.
#
#   scripts/gpu-bundle.sh                      # then, on the device: bash gpu-bundle/run-all.sh
#                                              # (--sanitize: under compute-sanitizer; --help)
#
# The bundle must stay under the device tool's 64 MiB carry limit; its size is printed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export KVR_REQUIRE_KERNELS=1
out="$root/gpu-bundle"
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/scripts" "$out/data"
cp tests/data/tiny-qwen3next.gguf tests/data/qwen3next-80b-a3b-header.gguf "$out/data/"

cargo build --release --lib
# GPU test binaries: each tests/gpu_*.rs, built in release mode.
tests=()
for f in tests/gpu_*.rs; do
  [ -e "$f" ] || continue
  tests+=(--test "$(basename "$f" .rs)")
done
if [ ${#tests[@]} -gt 0 ]; then
  cargo test --release --no-run --message-format=json "${tests[@]}" 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$out/bin/$name"; done
fi
# Benchmark programs (src/bin/bench_*.rs), if any.
if ls src/bin/bench_*.rs >/dev/null 2>&1; then
  cargo build --release --bins
  for f in src/bin/bench_*.rs; do
    name=$(basename "$f" .rs)
    cp "target/release/$name" "$out/bin/$name"
  done
fi
# Python peers / drivers for benchmarks, if any.
if ls bench/*.py >/dev/null 2>&1; then
  cp bench/*.py bench/*.sh "$out/scripts/"
  rm -f "$out/scripts/selftest_cpu.py"
fi
cp target/release/libkvreplay.so "$out/lib/"
# C programs: the engine-style CUDA stream test and every example.
make -s -C ffi-tests build/test_cuda_stream
cp ffi-tests/build/test_cuda_stream "$out/bin/"
# The soak (ffi-tests/soak.c: both pools on CUDA against a CPU mirror), linked against the
# shared library like the examples.
make -s -C ffi-tests build/soak_shared
cp ffi-tests/build/soak_shared "$out/bin/soak"
# The examples link the shared library here (lib/ is on LD_LIBRARY_PATH in run-all.sh):
# statically linked, each would carry its own copy of the kernels past the carry limit.
make -s -C examples SHARED=1 BUILD=build-bundle
for f in examples/*.c; do
  name=$(basename "$f" .c)
  cp "examples/build-bundle/$name" "$out/bin/example_$name"
done
strip --strip-debug "$out"/bin/* "$out"/lib/*.so

# run-all.sh: every job plainly, or under compute-sanitizer with --sanitize (see its --help).
cp scripts/gpu-run-all.sh "$out/run-all.sh"
chmod +x "$out/run-all.sh"

cat >"$out/run-bench.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the benchmark drivers (scripts/bench_*.py, or the ones named) against lib/.
# Usage: bash run-bench.sh [bench_kv_decode.py ...] [-- args]
cd "$(dirname "${BASH_SOURCE[0]}")"
export PYTHONUNBUFFERED=1 KVR_LIB="$PWD/lib/libkvreplay.so"
benches=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do benches+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#benches[@]} -gt 0 ] || benches=($(cd scripts && ls bench_*.py))
rc=0
for b in "${benches[@]}"; do
  echo "== $b"
  (cd scripts && python3 "$b" "$@") || rc=1
done
exit $rc
RUN
chmod +x "$out/run-bench.sh"
du -sh "$out"
size=$(du -sm "$out" | cut -f1)
if [ "$size" -ge 60 ]; then
  echo "gpu-bundle: $size MiB is too close to the 64 MiB carry limit" >&2
  exit 1
fi
