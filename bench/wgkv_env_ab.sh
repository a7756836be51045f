#!/usr/bin/env bash
# A/B of the write-gated step's kernel settings in one device call (each setting its own
# process: the library reads them once). Run from gpu-bundle/scripts after the GPU tests:
#   KVR_LIB=$PWD/../lib/libkvreplay.so bash wgkv_env_ab.sh [passes]   # $OUT/ab_*.txt
# Settings: KVR_WGKV_MOVE (0: the step kernel with the gate inlined; 1: kvr_wgkv_move, the
# gate CTAs' code out of line) and KVR_WGKV_SLOT_COPIES (0: one code slot per row and the
# finishing CTA's restore; 1: a copy per gate CTA, restored by that CTA).
set -u
o=${OUT:-/tmp}
passes=${1:-1}
settings=("0 0" "1 0" "1 1")
for pass in $(seq "$passes"); do
  for s in "${settings[@]}"; do
    read -r m c <<<"$s"
    f=$o/ab_m${m}c${c}.txt
    echo "=== pass $pass MOVE=$m SLOT_COPIES=$c" | tee -a "$f"
    KVR_WGKV_MOVE=$m KVR_WGKV_SLOT_COPIES=$c OUT=/tmp timeout 300 python3 bench_wgkv.py --step-only 2>&1 |
      grep -E "^append|summary|FAIL|Error" | tee -a "$f"
  done
done
for s in "${settings[@]}"; do
  read -r m c <<<"$s"
  echo "=== CUPTI MOVE=$m SLOT_COPIES=$c"
  KVR_WGKV_MOVE=$m KVR_WGKV_SLOT_COPIES=$c timeout 120 python3 profile_wgkv_layer.py 1 2>&1 | grep -E "^---|L41"
done
