#!/usr/bin/env bash
# integrations/llama.cpp/sdist.sh CACHE: downloads the llama-cpp-python 0.3.36 sdist (the one
# that vendors llama.cpp commit 0c1e570) from PyPI into CACHE/dl unless it is there, checks
# its sha256 and prints its path. Used by build.sh and pack-for-device.sh.
set -euo pipefail
cache="$1"
SDIST_VERSION=0.3.36
SDIST=llama_cpp_python-$SDIST_VERSION.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
mkdir -p "$cache/dl"
if [ ! -f "$cache/dl/$SDIST" ]; then
  echo "sdist.sh: downloading llama-cpp-python==$SDIST_VERSION (sdist) from PyPI" >&2
  rm -rf "$cache/dl.tmp"
  # --no-binary for this package only: with :all: pip also builds cmake from source.
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$SDIST_VERSION" -d "$cache/dl.tmp"
  mv "$cache/dl.tmp/$SDIST" "$cache/dl/$SDIST"
  rm -rf "$cache/dl.tmp"
fi
got="$(sha256sum "$cache/dl/$SDIST" | cut -d' ' -f1)"
if [ "$got" != "$SDIST_SHA256" ]; then
  echo "sdist.sh: $SDIST has sha256 $got, expected $SDIST_SHA256; removed it" >&2
  rm -f "$cache/dl/$SDIST"
  exit 1
fi
echo "$cache/dl/$SDIST"
