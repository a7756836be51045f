#!/usr/bin/env bash
# integrations/llama.cpp/build.sh [cpu|cuda]: llama.cpp (the copy llama-cpp-python 0.3.36
# vendors, commit 0c1e570) patched so that GGML_OP_GATED_DELTA_NET runs through kvreplay
# (llama.cpp-kvreplay.patch), built with kvreplay's static library linked into its CPU (and,
# for `cuda`, CUDA) backend. Builds only what the checks need: libllama, test-llama-archs,
# test-backend-ops and kvr-llama-check (kvr-llama-check.cpp). Prints the build directory on
# its last line.
#
# Steps, each skipped when its result is already there (reruns are incremental):
#   1. the sdist: `pip download` (PyPI only), sha256 checked (sdist.sh); or KVR_LLAMA_TREE, an archive
#      of the trimmed tree (pack-for-device.sh makes one; the device has no network)
#   2. the trimmed tree (CMakeLists.txt, cmake, ggml, src, include, common, tests, vendor,
#      app, licenses) in $cache/src, and the patch (an earlier version is reversed first)
#   3. kvreplay: `cargo build --release --lib` of this repository, or KVR_LIB + KVR_INCLUDE
#      (a prebuilt libkvreplay.a and the directory of kvreplay.h; the device has no cargo)
#   4. cmake (Ninja, Release) and ninja; cmake and ninja come from PyPI into .tools/ when
#      missing
#
# Environment: KVR_LLAMA_CACHE (default <repo>/target/llama.cpp), KVR_LLAMA_TREE, KVR_LIB,
# KVR_INCLUDE, KVR_LLAMA_JOBS (ninja -j, default: all cores), KVR_CUDA_ARCHS (cuda: CMake's
# CUDA architectures, default 90a), CMAKE / NINJA (the tools to use).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
mode="${1:-cpu}"
case "$mode" in cpu | cuda) ;; *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;; esac

SDIST_VERSION=0.3.36
LLAMA_COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
TRIM="CMakeLists.txt LICENSE cmake ggml src include common tests vendor app licenses"

cache="${KVR_LLAMA_CACHE:-$root/target/llama.cpp}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
src="$cache/src"
build="$cache/build-$mode"
patch_file="$here/llama.cpp-kvreplay.patch"
jobs="${KVR_LLAMA_JOBS:-$(nproc)}"
t0=$(date +%s)
say() { printf '[build.sh %s %3ss] %s\n' "$mode" "$(($(date +%s) - t0))" "$*" >&2; }

# ---- tools ----
tools="$root/.tools"
cmake_bin="${CMAKE:-}"
if [ -z "$cmake_bin" ]; then
  if command -v cmake >/dev/null 2>&1; then
    cmake_bin=cmake
  else
    if [ ! -x "$tools/cmake-py/cmake/data/bin/cmake" ]; then
      say "installing cmake 4.1.2 from PyPI into $tools/cmake-py"
      python3 -m pip install --quiet --disable-pip-version-check --target "$tools/cmake-py" "cmake==4.1.2"
    fi
    cmake_bin="$tools/cmake-py/cmake/data/bin/cmake"
  fi
fi
ninja_bin="${NINJA:-}"
if [ -z "$ninja_bin" ]; then
  if command -v ninja >/dev/null 2>&1; then
    ninja_bin="$(command -v ninja)"
  else
    if [ ! -x "$tools/ninja-py/bin/ninja" ]; then
      say "installing ninja 1.13.0 from PyPI into $tools/ninja-py"
      python3 -m pip install --quiet --disable-pip-version-check --target "$tools/ninja-py" "ninja==1.13.0"
    fi
    ninja_bin="$tools/ninja-py/bin/ninja"
  fi
fi

# ---- 1, 2: the trimmed tree ----
if [ ! -f "$src/.kvr-tree" ]; then
  rm -rf "$src" "$src.tmp"
  mkdir -p "$src.tmp"
  if [ -n "${KVR_LLAMA_TREE:-}" ]; then
    say "extracting the trimmed tree from $KVR_LLAMA_TREE"
    tar xf "$KVR_LLAMA_TREE" -C "$src.tmp" 2>/dev/null ||
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$KVR_LLAMA_TREE" "$src.tmp"
  else
    sdist="$(bash "$here/sdist.sh" "$cache")"
    say "extracting vendor/llama.cpp ($TRIM) from $(basename "$sdist")"
    members=""
    for m in $TRIM; do members="$members llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp/$m"; done
    # shellcheck disable=SC2086
    tar xzf "$sdist" -C "$src.tmp" --strip-components=3 $members
  fi
  # No .git in the tree: cmake/git-vars.cmake then adds no dependency on a git index.
  rm -rf "$src.tmp/.git"
  echo "$LLAMA_COMMIT" >"$src.tmp/.kvr-tree"
  mv "$src.tmp" "$src"
fi
# apply_patch FILE [-R]: with patch(1), or git apply where patch is missing.
apply_patch() {
  if command -v patch >/dev/null 2>&1; then
    patch -s -d "$src" -p1 "${2:---forward}" <"$1"
  else
    (cd "$src" && git apply ${2:+-R} "$1")
  fi
}
if ! cmp -s "$patch_file" "$src/.kvr-applied.patch" 2>/dev/null; then
  if [ -f "$src/.kvr-applied.patch" ]; then
    say "reversing the previously applied patch"
    apply_patch "$src/.kvr-applied.patch" -R
  fi
  say "applying $(basename "$patch_file")"
  apply_patch "$patch_file"
  cp "$patch_file" "$src/.kvr-applied.patch"
fi

# ---- 3: kvreplay ----
kvr="$cache/kvreplay"
mkdir -p "$kvr/lib" "$kvr/include"
if [ -n "${KVR_LIB:-}" ]; then
  lib="$KVR_LIB"
  inc="${KVR_INCLUDE:?KVR_INCLUDE (the directory of kvreplay.h) must come with KVR_LIB}"
else
  say "cargo build --release --lib (kvreplay)"
  (cd "$root" && cargo build --quiet --release --lib)
  lib="$root/target/release/libkvreplay.a"
  inc="$root/include"
fi
# Copied only when changed, so that an unchanged library does not relink llama.cpp.
cmp -s "$lib" "$kvr/lib/libkvreplay.a" || cp "$lib" "$kvr/lib/libkvreplay.a"
cmp -s "$inc/kvreplay.h" "$kvr/include/kvreplay.h" || cp "$inc/kvreplay.h" "$kvr/include/kvreplay.h"

# ---- 4: configure and build ----
flags=(
  -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin" -DCMAKE_BUILD_TYPE=Release
  -DGGML_KVREPLAY=ON -DGGML_KVREPLAY_LIB="$kvr/lib/libkvreplay.a" -DGGML_KVREPLAY_INCLUDE="$kvr/include"
  -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF
)
if [ "$mode" = cuda ]; then
  flags+=(-DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES="${KVR_CUDA_ARCHS:-90a}")
fi
say "cmake configure ($build)"
"$cmake_bin" -S "$src" -B "$build" "${flags[@]}" >"$cache/configure-$mode.log" 2>&1 ||
  { tail -n 40 "$cache/configure-$mode.log" >&2; exit 1; }
say "ninja -j$jobs llama test-llama-archs test-backend-ops"
"$ninja_bin" -C "$build" -j "$jobs" llama test-llama-archs test-backend-ops >"$cache/ninja-$mode.log" 2>&1 ||
  { grep -E "error|FAILED" -A5 "$cache/ninja-$mode.log" | head -n 60 >&2; exit 1; }
bin="$build/bin"
say "kvr-llama-check"
cxx="${CXX:-c++}"
"$cxx" -O2 -std=c++17 "$here/kvr-llama-check.cpp" -o "$bin/kvr-llama-check.tmp" \
  -I"$src/include" -I"$src/ggml/include" -L"$bin" -lllama -lggml -lggml-cpu -lggml-base \
  -Wl,-rpath,"$bin"
mv "$bin/kvr-llama-check.tmp" "$bin/kvr-llama-check"
say "done"
echo "$build"
