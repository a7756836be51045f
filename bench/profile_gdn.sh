#!/usr/bin/env bash
# Nsight Compute over the GDN decode kernels (clocks left alone).
# Usage (in gpu-bundle/scripts): bash profile_gdn.sh "B L layout" ...   (e.g. "256 16 v")
# KVR_NCU_SKIP / KVR_NCU_COUNT choose the launches (default: skip 17, profile 1);
# KVR_NCU_SCRIPT=profile_mamba2.py profiles the Mamba-2 layer instead.
cd "$(dirname "${BASH_SOURCE[0]}")"
export PYTHONUNBUFFERED=1 KVR_LIB="${KVR_LIB:-$PWD/../lib/libkvreplay.so}"
for cfg in "$@"; do
  echo "== ncu gdn decode $cfg"
  # shellcheck disable=SC2086
  ncu --clock-control none -k regex:"${KVR_NCU_KERNEL:-sdecode}" --launch-skip "${KVR_NCU_SKIP:-17}" --launch-count "${KVR_NCU_COUNT:-1}" \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__inst_executed.sum \
    python3 "${KVR_NCU_SCRIPT:-profile_gdn.py}" $cfg 2>&1 | grep -E "kvr_gdn|stalled|inst_executed|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit|Waves|Grid Size|Dynamic Shared|ok " | head -40
done
