#!/usr/bin/env bash
# Nsight Compute over the decode kernel for a few configurations (clocks left alone).
# Usage (in gpu-bundle/scripts): bash profile_kv.sh "B L [Hq Hkv page]" ...
cd "$(dirname "${BASH_SOURCE[0]}")"
export PYTHONUNBUFFERED=1 KVR_LIB="${KVR_LIB:-$PWD/../lib/libkvreplay.so}"
for cfg in "$@"; do
  echo "== ncu decode $cfg"
  # shellcheck disable=SC2086
  ncu --clock-control none -k regex:kvr_kv_decode --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__inst_executed.sum \
    python3 profile_kv.py $cfg 2>&1 | grep -E "stalled|inst_executed|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Warp Cycles Per Issued|Stall|Issued Warp|No Eligible|Block Limit|Waves|Grid Size|Dynamic Shared|L2 Hit|Mem Busy|Max Bandwidth|Avg. Active|ok " | head -60
done
