#!/usr/bin/env bash
# integrations/llama.cpp/pack-for-device.sh [DIR]: everything device-run.sh needs on a GPU
# machine without network or cargo, in DIR (default <repo>/llama-device, git-ignored; carry
# it with the working tree, which brings the scripts, the patch and include/kvreplay.h):
#   llama.cpp-0c1e570.tar.xz   the trimmed, unpatched llama.cpp tree (from the checked sdist)
#   libkvreplay.a              kvreplay built here for sm_90a (KVR_CUDA_ARCHS=90a,
#                              KVR_REQUIRE_KERNELS=1), debug sections stripped
#   kvreplay.h                 the header it was built with
# About 26 MiB in all (22 MiB of it the library). The build goes to target/device-90a so
# that the normal release build (all architectures) is left alone.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dir="${1:-$root/llama-device}"
mkdir -p "$dir"
cache="${KVR_LLAMA_CACHE:-$root/target/llama.cpp}"

# The trimmed tree: build.sh's extraction, without its patch.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
sdist="$(bash "$here/sdist.sh" "$cache")"
members=""
for m in CMakeLists.txt LICENSE cmake ggml src include common tests vendor app licenses; do
  members="$members llama_cpp_python-0.3.36/vendor/llama.cpp/$m"
done
# shellcheck disable=SC2086
tar xzf "$sdist" -C "$tmp" --strip-components=3 $members
tar cf - -C "$tmp" . | xz -T0 -6 >"$dir/llama.cpp-0c1e570.tar.xz"

# kvreplay for the H200 (sm_90a), built in its own target directory.
(cd "$root" && KVR_CUDA_ARCHS=90a KVR_REQUIRE_KERNELS=1 cargo build --quiet --release --lib \
  --target-dir "$root/target/device-90a")
cp "$root/target/device-90a/release/libkvreplay.a" "$dir/libkvreplay.a"
strip --strip-debug "$dir/libkvreplay.a" 2>/dev/null || true
cp "$root/include/kvreplay.h" "$dir/kvreplay.h"
du -sh "$dir"/* >&2
echo "$dir"
