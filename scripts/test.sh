#!/usr/bin/env bash
# The test command (README): everything that runs without a GPU.
#   0. the header's naming and documentation rules (scripts/check-header-docs.py; CI's
#      staleness check, scripts/gen-header.sh --check, makes sure the header is current)
#   1. cargo test (unit + integration tests; GPU tests skip themselves with a message)
#   2. the release static and shared libraries, and a check that the system libraries
#      documented for static linking still match what rustc prints; the WG-KV checkpoint
#      converter's test (scripts/test_wgkv_convert.py, loads its output with the library)
#   3. ffi-tests: C and C++ against the header and both libraries, the pools from C
#      (test_pools: every pool function and error path; test_threads: pools used from
#      several threads; test_wgkv: the write-gated pool), ASan+UBSan builds, and valgrind over
#      the static-library tests; the soak (soak.c, 10^4 random pool operations against a
#      mirror) on the CPU backend
#   4. examples: built with Make (static and shared) and with CMake; the demo (`make -C
#      examples run`: the tiny Qwen3-Next; also every tiny model, the 80B header file, and
#      a missing and a malformed file, which must fail), info, the paged KV, write-gated KV
#      and GDN speculative-decoding examples (CPU backend) and the GGUF planner run
#   5. llama.cpp with kvreplay (integrations/llama.cpp/check.sh cpu): the pinned llama.cpp,
#      patched, built (cached in target/llama.cpp; the first build takes minutes), tiny
#      qwen3next / qwen35 models decoded with kvreplay on and off: identical tokens and
#      logits. KVR_SKIP_LLAMA=1 skips it.
# Installs CMake into .tools/ (pip) when it is missing. Set KVR_REQUIRE_KERNELS=1 to fail
# when the CUDA kernels cannot be compiled (CI does).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
step() { printf '\n== %s\n' "$*"; }

step "header rules (scripts/check-header-docs.py)"
python3 scripts/check-header-docs.py

step "cargo test"
cargo test --all-targets

step "release libraries"
cargo build --release --lib
test -f target/release/libkvreplay.a && test -f target/release/libkvreplay.so

step "WG-KV checkpoint converter"
python3 scripts/test_wgkv_convert.py

step "native-static-libs"
documented="$(sed -n 's/^NATIVE_LIBS := //p' ffi-tests/Makefile)"
printed="$(cargo rustc --release --lib --crate-type staticlib --target-dir target/native-libs \
  -- --print native-static-libs 2>&1 | sed -n 's/.*native-static-libs: //p' | tail -n 1)"
norm() { tr ' ' '\n' | sort -u | tr '\n' ' '; }
if [ "$(echo "$documented" | norm)" != "$(echo "$printed" | norm)" ]; then
  echo "static link libraries changed: rustc prints '$printed', ffi-tests/Makefile," \
    "examples/Makefile, examples/CMakeLists.txt and README.md say '$documented'" >&2
  exit 1
fi
grep -qF -- "$documented" README.md || { echo "README.md lacks '$documented'" >&2; exit 1; }
echo "static link: $printed"

step "ffi-tests (static, shared, ASan+UBSan, C++; the pools from C and from threads)"
make -C ffi-tests check
for t in test_api test_pools test_threads; do
  if nm "ffi-tests/build/${t}_asan" | grep -c __asan_init >/dev/null; then
    echo "ffi-tests/build/${t}_asan is instrumented"
  else
    echo "ffi-tests/build/${t}_asan is not instrumented" >&2
    exit 1
  fi
done
if command -v valgrind >/dev/null 2>&1; then
  for t in test_api test_pools test_threads; do
    step "valgrind ffi-tests/build/${t}_static"
    valgrind --quiet --error-exitcode=9 --leak-check=full --errors-for-leak-kinds=definite \
      "ffi-tests/build/${t}_static"
  done
else
  echo "valgrind not installed: skipping the valgrind run"
fi

step "soak (ffi-tests/soak.c: a KV and a GDN pool, random operations, CPU backend on both sides)"
make -C ffi-tests soak SOAK_ARGS="10000 cpu"

step "examples (make, static and shared)"
make -C examples clean >/dev/null
make -C examples
make -C examples run
for f in tests/data/tiny-*.gguf; do
  ./examples/build/demo "$f" cpu --steps 4 --rounds 2 >/dev/null ||
    { echo "demo failed on $f" >&2; exit 1; }
done
./examples/build/demo tests/data/qwen3next-80b-a3b-header.gguf cpu --batch 2 --steps 2 --rounds 1 |
  tail -n 16
truncated="$(mktemp)"
head -c 300 tests/data/tiny-qwen3next.gguf >"$truncated"
for bad in tests/data/no-such-model.gguf "$truncated"; do
  if ./examples/build/demo "$bad" >/dev/null 2>&1; then
    echo "the demo accepted $bad" >&2
    exit 1
  fi
done
rm -f "$truncated"
./examples/build/info
./examples/build/paged_decode cpu
./examples/build/write_gated cpu
./examples/build/spec_decode_gdn cpu
./examples/build/gguf_plan tests/data/tiny-qwen3next.gguf 1 128 4
./examples/build/gguf_plan tests/data/qwen3next-80b-a3b-header.gguf 40 8192 4 | tail -n 8
make -C examples clean >/dev/null
make -C examples SHARED=1
./examples/build/demo cpu >/dev/null
./examples/build/info >/dev/null
./examples/build/spec_decode_gdn cpu >/dev/null
./examples/build/paged_decode cpu >/dev/null
./examples/build/gguf_plan tests/data/tiny-nemotron_h.gguf >/dev/null

step "examples (cmake)"
# The PyPI CMake's own binary, called by its path: PATH stays as it was, so the cargo build
# inside CMake matches the release build above and does not run build.rs again.
cmake_bin=cmake
if ! command -v cmake >/dev/null 2>&1; then
  cmake_bin="$root/.tools/cmake-py/cmake/data/bin/cmake"
  if [ ! -x "$cmake_bin" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target .tools/cmake-py "cmake==4.1.2"
  fi
fi
rm -rf target/cmake-examples
"$cmake_bin" -S examples -B target/cmake-examples -DCMAKE_BUILD_TYPE=Release >/dev/null
"$cmake_bin" --build target/cmake-examples -j 2 >/dev/null
target/cmake-examples/info >/dev/null
target/cmake-examples/demo cpu >/dev/null
target/cmake-examples/gguf_plan tests/data/tiny-mamba2.gguf >/dev/null
"$cmake_bin" -S examples -B target/cmake-examples-shared -DKVREPLAY_SHARED=ON >/dev/null
"$cmake_bin" --build target/cmake-examples-shared -j 2 >/dev/null
target/cmake-examples-shared/info >/dev/null
echo "cmake examples: ok"

if [ "${KVR_SKIP_LLAMA:-0}" = 1 ]; then
  step "llama.cpp with kvreplay: skipped (KVR_SKIP_LLAMA=1)"
else
  step "llama.cpp with kvreplay (integrations/llama.cpp/check.sh cpu)"
  bash integrations/llama.cpp/check.sh cpu
fi

printf '\nall tests passed\n'
