#!/usr/bin/env bash
# Builds (here, with cargo) everything the GPU machine runs: the GPU test binaries
# (tests/gpu_*.rs), the benchmark programs, the C GPU test and the examples, plus the
# shared library; strips them and writes gpu-bundle/ (git-ignored) with run-all.sh.
#
#   scripts/gpu-bundle.sh                      # then, on the device: bash gpu-bundle/run-all.sh
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
# The examples link the shared library here (lib/ is on LD_LIBRARY_PATH in run-all.sh):
# statically linked, each would carry its own copy of the kernels past the carry limit.
make -s -C examples SHARED=1 BUILD=build-bundle
for f in examples/*.c; do
  name=$(basename "$f" .c)
  cp "examples/build-bundle/$name" "$out/bin/example_$name"
done
strip --strip-debug "$out"/bin/* "$out"/lib/*.so

cat >"$out/run-all.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every GPU test in this bundle and prints a pass/fail table. GPU tests fail
# (instead of skipping) when no GPU is usable. Logs go to $OUT (if set) or ./logs.
cd "$(dirname "${BASH_SOURCE[0]}")"
export KVR_REQUIRE_GPU=1
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
logs="${OUT:-$PWD/logs}"
mkdir -p "$logs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
declare -a rows
fail=0
run() {
  local name="$1"; shift
  local start end status
  start=$(date +%s.%N)
  if "$@" >"$logs/$name.log" 2>&1; then status=PASS; else status=FAIL; fail=1; fi
  end=$(date +%s.%N)
  rows+=("$(printf '%-48s %-4s %7.1fs' "$name" "$status" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')")")
  if [ "$status" = FAIL ]; then tail -n 40 "$logs/$name.log"; fi
}
for t in bin/gpu_*; do
  [ -x "$t" ] || continue
  run "$(basename "$t")" "$t" --test-threads=1 --nocapture
done
# The GDN tests again with each decode kernel forced (the library picks one per layout,
# mode and batch size; every one must match the CPU backend).
for k in stream warp; do
  run "gpu_gdn-$k" env KVR_GDN_DECODE=$k bin/gpu_gdn --test-threads=1 --nocapture
done
run "gpu_gdn-stream-persistent" env KVR_GDN_DECODE=stream KVR_GDN_STREAM_PERSIST=1 bin/gpu_gdn --test-threads=1 --nocapture
# and with verify on the general kernel instead of gdn_sverify.cu.
run "gpu_gdn-verify-general" env KVR_GDN_VERIFY=general bin/gpu_gdn --test-threads=1 --nocapture
run test_cuda_stream bin/test_cuda_stream
for e in bin/example_*; do
  [ -x "$e" ] || continue
  case "$(basename "$e")" in
    example_gguf_plan) run example_gguf_plan "$e" data/tiny-qwen3next.gguf 1 128 4 ;;
    # The tiny model's head dims have no CUDA kernels (it runs on the CPU); the 80B
    # configuration runs on CUDA at full-scale shapes.
    example_demo)
      run example_demo "$e" data/tiny-qwen3next.gguf
      run example_demo-80b-cuda "$e" data/qwen3next-80b-a3b-header.gguf cuda ;;
    *) run "$(basename "$e")" "$e" ;;
  esac
done
echo
echo "GPU test results"
printf '%s\n' "${rows[@]}"
# Lines the tests print about accuracy (max relative error) and sizes.
grep -h -E "max relative error|checked|device " "$logs"/*.log 2>/dev/null | sed 's/^/  /' | head -n 60
exit $fail
RUN
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
