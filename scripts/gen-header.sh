#!/usr/bin/env bash
# Regenerates include/kvreplay.h from src/ffi with the pinned cbindgen (a build
# dependency behind the `header` feature). `--check` regenerates into a temporary file
# and fails if the committed header differs (CI runs that).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mode=${1:-write}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
out="$tmp/kvreplay.h"
# KVR_NVCC=none: the header does not depend on the kernels; skip compiling them here.
# The `header` feature makes this a separate build unit, so the normal build is untouched.
env -u KVR_REQUIRE_KERNELS KVR_NVCC=none KVR_HEADER_OUT="$out" \
  cargo build --quiet --lib --features header >&2
[ -s "$out" ] || { echo "gen-header: cbindgen produced nothing" >&2; exit 1; }
case "$mode" in
  --check)
    if ! diff -u include/kvreplay.h "$out"; then
      echo "gen-header: include/kvreplay.h is stale; run scripts/gen-header.sh and commit it" >&2
      exit 1
    fi
    echo "gen-header: include/kvreplay.h is up to date"
    ;;
  write)
    mkdir -p include
    cp "$out" include/kvreplay.h
    echo "gen-header: wrote include/kvreplay.h"
    ;;
  *)
    echo "usage: scripts/gen-header.sh [--check]" >&2
    exit 2
    ;;
esac
