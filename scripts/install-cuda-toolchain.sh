#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler (nvcc + nvvm + headers) from PyPI into
# .cuda-toolchain/ at the repository root (git-ignored). No GPU is needed.
# The set is pinned to the device machine's CUDA 13.0 (its driver runs 13.0 code): a newer
# nvvm emits PTX that this ptxas and the 580 driver reject.
# Prints the path of nvcc on its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${KVR_CUDA_TOOLCHAIN_DIR:-$root/.cuda-toolchain}"
nvcc="$dest/nvidia/cu13/bin/nvcc"
stamp="$dest/.kvr-pinned-set"
pins="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"

if [ -x "$nvcc" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ]; then
  echo "$nvcc"
  exit 0
fi
python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "install-cuda-toolchain: python3 not found" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
# shellcheck disable=SC2086
"$python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
  --target "$dest" $pins >&2
[ -x "$nvcc" ] || { echo "install-cuda-toolchain: nvcc missing after install ($nvcc)" >&2; exit 1; }
echo "$pins" >"$stamp"
echo "$nvcc"
