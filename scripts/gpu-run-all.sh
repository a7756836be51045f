#!/usr/bin/env bash
# run-all.sh of the GPU bundle (scripts/gpu-bundle.sh copies this file into gpu-bundle/).
# Runs every GPU test in the bundle and prints a table. GPU tests fail (instead of skipping)
# when no GPU is usable. Logs go to $OUT (if set) or ./logs.
#
#   bash run-all.sh                  every job once: the GPU test binaries, gpu_gdn again with
#                                    each decode kernel forced and with the general verify
#                                    kernel, the C GPU test, the soak (KVR_SOAK_OPS
#                                    operations) and every example
#   bash run-all.sh --sanitize       every job under compute-sanitizer, once per tool
#                                    (memcheck, racecheck, synccheck, initcheck), with
#                                    --error-exitcode 1 --print-limit 20; the table gives
#                                    the error count of each (job, tool)
#   bash run-all.sh --list           the job names
#
# Options (sanitize mode; --only works in both modes):
#   --tools memcheck,racecheck   the tools to run (env KVR_SANITIZE_TOOLS, space or comma
#                                separated; default: memcheck racecheck synccheck initcheck)
#   --jobs N                     N (job, tool) pairs at once (env KVR_SANITIZE_JOBS; default
#                                1). They share the GPU, whose instrumented kernels are the
#                                bottleneck: a few at once help (short jobs beside long ones),
#                                many slow each other down (measured on an H200: gpu_gdn under
#                                initcheck 120 s alone, > 530 s beside 19 others)
#   --only REGEX                 only the jobs whose name matches (env KVR_RUN_ONLY), e.g.
#                                --only '^gpu_kv$' or --only 'gpu_gdn|test_cuda'
# Environment (sanitize mode):
#   KVR_SANITIZE=1               same as --sanitize
#   KVR_SANITIZE_TIMEOUT=900     seconds per (job, tool); a job past it is TIMEOUT, with the
#                                errors its log shows so far
#   KVR_SANITIZE_BUDGET=540      seconds for the whole run: (job, tool) pairs that would
#                                start later are listed as SKIPPED (budget) and the next run
#                                can pick them up with --only / --tools (default: no limit)
#   KVR_SANITIZE_SKIP_<TOOL>     libtest --skip filters (test-name substrings, space
#                                separated) for the GPU test binaries under that tool;
#                                default for racecheck: "large" (its largest cases take
#                                hours under racecheck); e.g. KVR_SANITIZE_SKIP_MEMCHECK=qwen3
#   KVR_SANITIZE_FILTER=name     a libtest filter for the GPU test binaries (only the tests
#                                whose name contains it)
#   KVR_SANITIZE_LEAKS=1         memcheck also reports device memory leaks (--leak-check full)
#   KVR_SANITIZER=/path          compute-sanitizer to use (default: on PATH, else
#                                /usr/local/cuda/bin, /usr/local/cuda-*/bin, $CUDA_HOME/bin)
# Exit status: 0 when every row passed (budget skips do not fail the run), 1 otherwise, 2 for
# bad arguments or no compute-sanitizer.
cd "$(dirname "${BASH_SOURCE[0]}")" || exit 2
export KVR_REQUIRE_GPU=1
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
logs="${OUT:-$PWD/logs}"
mkdir -p "$logs"

sanitize="${KVR_SANITIZE:-0}"
tools="${KVR_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
only="${KVR_RUN_ONLY:-}"
jobs="${KVR_SANITIZE_JOBS:-1}"
list=0
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --tools) tools="${2:-}"; shift ;;
    --tools=*) tools="${1#--tools=}" ;;
    --jobs) jobs="${2:-}"; shift ;;
    --jobs=*) jobs="${1#--jobs=}" ;;
    --only) only="${2:-}"; shift ;;
    --only=*) only="${1#--only=}" ;;
    --list) list=1 ;;
    -h | --help) sed -n '2,/^cd /p' "${BASH_SOURCE[0]}" | sed '$d'; exit 0 ;;
    *) echo "run-all.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
tools="${tools//,/ }"
case "$jobs" in '' | *[!0-9]*) echo "run-all.sh: --jobs takes a number" >&2; exit 2 ;; esac
# Under a sanitizer the soak reports its memory use without checking it (the tool's own host
# memory is in its resident set; parallel pairs share the device's, which cuMemGetInfo counts).
# The GPU tests' longest loops run a quarter of their rounds (tests/common/gpu.rs,
# sanitizer_scaled: every configuration still runs).
[ "$sanitize" = 1 ] && export KVR_SOAK_NO_MEMCHECK=1 KVR_UNDER_SANITIZER=1
[ "$sanitize" = 1 ] || [ "$sanitize" = 0 ] || sanitize=1

# ---- the jobs: name, kind (test: a libtest binary; prog: a program), environment, argv ----
names=() kinds=() envs=() argvs=()
job() { # name kind "VAR=value ..." argv...
  local name="$1" kind="$2" env="$3"
  shift 3
  names+=("$name")
  kinds+=("$kind")
  envs+=("$env")
  argvs+=("$(printf '%q ' "$@")")
}
for t in bin/gpu_*; do
  [ -x "$t" ] || continue
  job "$(basename "$t")" test "" "$t" --test-threads=1 --nocapture
done
# The GDN tests again with each decode kernel forced (the library picks one per layout,
# mode and batch size; every one must match the CPU backend) and with verify on the
# general kernel instead of gdn_sverify.cu.
if [ -x bin/gpu_gdn ]; then
  for k in stream warp wdecode fused; do
    job "gpu_gdn-$k" test "KVR_GDN_DECODE=$k" bin/gpu_gdn --test-threads=1 --nocapture
  done
  # The Mamba-2 / linear-attention pools with the warp-streaming decode at every batch, in
  # two launches and in one.
  for k in wdecode fused; do
    [ -x bin/gpu_ssm ] && job "gpu_ssm-$k" test "KVR_GDN_DECODE=$k" bin/gpu_ssm --test-threads=1 --nocapture
  done
  job gpu_gdn-stream-persistent test "KVR_GDN_DECODE=stream KVR_GDN_STREAM_PERSIST=1" \
    bin/gpu_gdn --test-threads=1 --nocapture
  job gpu_gdn-verify-general test "KVR_GDN_VERIFY=general" bin/gpu_gdn --test-threads=1 --nocapture
  # Verify on the streaming kernel (gdn_sverify.cu) where the warp-streaming one applies.
  job gpu_gdn-verify-stream test "KVR_GDN_VERIFY=stream" bin/gpu_gdn --test-threads=1 --nocapture
  [ -x bin/gpu_ssm ] && job gpu_ssm-verify-stream test "KVR_GDN_VERIFY=stream" bin/gpu_ssm --test-threads=1 --nocapture
  # ... and on its general build where a specialized one applies (kvr_gdn_wverify_*_<spec>).
  job gpu_gdn-wverify-generic test "KVR_GDN_WVERIFY_SPEC=0" bin/gpu_gdn --test-threads=1 --nocapture
  [ -x bin/gpu_ssm ] && job gpu_ssm-wverify-generic test "KVR_GDN_WVERIFY_SPEC=0" bin/gpu_ssm --test-threads=1 --nocapture
  # The two launches at every batch without their specialized builds (kvr_gdn_dprep_d128_*_x*,
  # kvr_gdn_wdecode_*_x*): the general pair.
  job gpu_gdn-wdecode-generic test "KVR_GDN_DECODE=wdecode KVR_GDN_WDECODE_SPEC=0" bin/gpu_gdn --test-threads=1 --nocapture
  [ -x bin/gpu_ssm ] && job gpu_ssm-wdecode-generic test "KVR_GDN_DECODE=wdecode KVR_GDN_WDECODE_SPEC=0" bin/gpu_ssm --test-threads=1 --nocapture
  # The two launches' V-major state kernel loading only the buffered slots' u values
  # (p.live_u; off by default) at every batch.
  job gpu_gdn-live-u test "KVR_GDN_DECODE=wdecode KVR_GDN_LIVE_U_ROWS=1" bin/gpu_gdn --test-threads=1 --nocapture
  [ -x bin/gpu_ssm ] && job gpu_ssm-live-u test "KVR_GDN_DECODE=wdecode KVR_GDN_LIVE_U_ROWS=1" bin/gpu_ssm --test-threads=1 --nocapture
  # The one-launch kernel at every batch without its specialized builds (kvr_gdn_fdecode_*_x*).
  job gpu_gdn-fused-generic test "KVR_GDN_DECODE=fused KVR_GDN_FDECODE_SPEC=0" bin/gpu_gdn --test-threads=1 --nocapture
  # The stateless recurrent step with one-token calls on the general kernel too.
  job gpu_gdn-recur-general test "KVR_GDN_RECUR1=0" bin/gpu_gdn recurrent --test-threads=1 --nocapture
  # Recurrent pools without a conv window on the recurrent kind of kvr_gdn_wdecode instead of
  # kvr_gdn_wrec (GDN, Mamba-2 and linear-attention pools).
  job gpu_gdn-wrec-off test "KVR_GDN_WREC=0" bin/gpu_gdn --test-threads=1 --nocapture
  [ -x bin/gpu_ssm ] && job gpu_ssm-wrec-off test "KVR_GDN_WREC=0" bin/gpu_ssm --test-threads=1 --nocapture
  # Pools with KV-only mode: kvr_gdn_kvdec at the fewest CTAs a head its shapes allow (1 or 2)
  # and at 4, copying fixed shares of the entries before the metadata at every batch; and on
  # the older kernels (kvr_gdn_kvonly + gdn_decode.cu).
  job gpu_gdn-kvdec-split1 test "KVR_GDN_KVDEC_SPLIT=1" bin/gpu_gdn kv_only across_flushes graph_replays \
    --test-threads=1 --nocapture
  job gpu_gdn-kvdec-split4-early test "KVR_GDN_KVDEC_SPLIT=4 KVR_GDN_KVDEC_EARLY_ROWS=100000" \
    bin/gpu_gdn kv_only across_flushes graph_replays --test-threads=1 --nocapture
  [ -x bin/gpu_ssm ] && job gpu_ssm-kvdec-split1-early test "KVR_GDN_KVDEC_SPLIT=1 KVR_GDN_KVDEC_EARLY_ROWS=100000" \
    bin/gpu_ssm --test-threads=1 --nocapture
  # The host's entry count copied before the metadata at every batch (off by default: fixed
  # shares, and the rest after the metadata where the count falls short, as in graphs
  # replayed later).
  job gpu_gdn-kvdec-guess-all test "KVR_GDN_KVDEC_GUESS_ROWS=100000" \
    bin/gpu_gdn kv_only across_flushes graph_replays --test-threads=1 --nocapture
  job gpu_gdn-kvdec-off test "KVR_GDN_KVDEC=0" bin/gpu_gdn --test-threads=1 --nocapture
fi
# The paged decode tests with each decode kernel forced (the library picks the cluster,
# split, batch or stream-K kernel by batch and context; every one must match the CPU backend),
# and the write-gated pools (their rows decode through the same kernels).
for k in stream split cluster batch; do
  [ -x bin/gpu_kv ] && job "gpu_kv-$k" test "KVR_KV_DECODE=$k" bin/gpu_kv --test-threads=1 --nocapture
  [ -x bin/gpu_wgkv ] && job "gpu_wgkv-$k" test "KVR_KV_DECODE=$k" bin/gpu_wgkv --test-threads=1 --nocapture
done
# The write-gated step's experimental settings (opt-in until measured): the step kernel with
# the gate CTAs' code out of line, and a code slot per gate CTA.
[ -x bin/gpu_wgkv ] && job gpu_wgkv-move test "KVR_WGKV_MOVE=1 KVR_WGKV_SLOT_COPIES=1" \
  bin/gpu_wgkv --test-threads=1 --nocapture
[ -x bin/test_cuda_stream ] && job test_cuda_stream prog "" bin/test_cuda_stream
# The soak: a KV and a GDN pool through random operations on CUDA (graph replays with
# device-side accept counts included) against a CPU mirror, checkpoints every 1000; fewer
# operations under compute-sanitizer. KVR_SOAK_OPS overrides the count (10^6: the full soak).
if [ -x bin/soak ]; then
  if [ "$sanitize" = 1 ]; then
    job soak prog "" bin/soak "${KVR_SOAK_OPS:-1000}" cuda 1 250
  else
    job soak prog "" bin/soak "${KVR_SOAK_OPS:-150000}" cuda
  fi
fi
for e in bin/example_*; do
  [ -x "$e" ] || continue
  case "$(basename "$e")" in
    example_gguf_plan) job example_gguf_plan prog "" "$e" data/tiny-qwen3next.gguf 1 128 4 ;;
    # The tiny model's head dims have no CUDA kernels (it runs on the CPU); the 80B
    # configuration runs on CUDA at full-scale shapes.
    example_demo)
      job example_demo prog "" "$e" data/tiny-qwen3next.gguf
      # Under a sanitizer, 4 steps and 2 rounds (the defaults of a full-scale CPU run).
      if [ "$sanitize" = 1 ]; then
        job example_demo-80b-cuda prog "" "$e" data/qwen3next-80b-a3b-header.gguf cuda --steps 4 --rounds 2
      else
        job example_demo-80b-cuda prog "" "$e" data/qwen3next-80b-a3b-header.gguf cuda
      fi ;;
    *) job "$(basename "$e")" prog "" "$e" ;;
  esac
done
selected=()
for i in "${!names[@]}"; do
  if [ -z "$only" ] || [[ "${names[$i]}" =~ $only ]]; then selected+=("$i"); fi
done
if [ "$list" = 1 ]; then
  for i in "${selected[@]}"; do printf '%-36s %s\n' "${names[$i]}" "${kinds[$i]}"; done
  exit 0
fi
if [ ${#selected[@]} -eq 0 ]; then
  echo "run-all.sh: no job matches '$only' (see --list)" >&2
  exit 2
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
declare -a rows
fail=0
secs() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

# ---- plain mode ----
if [ "$sanitize" = 0 ]; then
  for i in "${selected[@]}"; do
    name="${names[$i]}"
    eval "argv=(${argvs[$i]})"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086 # envs[] holds VAR=value words
    if env ${envs[$i]} "${argv[@]}" >"$logs/$name.log" 2>&1; then status=PASS; else status=FAIL; fail=1; fi
    rows+=("$(printf '%-48s %-4s %7ss' "$name" "$status" "$(secs "$start")")")
    if [ "$status" = FAIL ]; then tail -n 40 "$logs/$name.log"; fi
  done
  echo
  echo "GPU test results"
  printf '%s\n' "${rows[@]}"
  # Lines the tests print about accuracy (max relative error) and sizes.
  grep -h -E "max relative error|checked|device |^soak " "$logs"/*.log 2>/dev/null | sed 's/^/  /' | head -n 60
  exit $fail
fi

# ---- sanitize mode ----
find_sanitizer() {
  if [ -n "${KVR_SANITIZER:-}" ]; then
    [ -x "$KVR_SANITIZER" ] && { echo "$KVR_SANITIZER"; return 0; }
    return 1
  fi
  command -v compute-sanitizer 2>/dev/null && return 0
  local d
  # shellcheck disable=SC2012 # version-sorted directory names
  for d in /usr/local/cuda/bin $(ls -d /usr/local/cuda-*/bin 2>/dev/null | sort -rV) \
    ${CUDA_HOME:+"$CUDA_HOME/bin"} ${CUDA_PATH:+"$CUDA_PATH/bin"} /opt/cuda/bin; do
    [ -x "$d/compute-sanitizer" ] && { echo "$d/compute-sanitizer"; return 0; }
  done
  return 1
}
for tool in $tools; do
  case "$tool" in
    memcheck | racecheck | synccheck | initcheck) ;;
    *) echo "run-all.sh: unknown tool '$tool' (memcheck, racecheck, synccheck, initcheck)" >&2; exit 2 ;;
  esac
done
if ! sanitizer="$(find_sanitizer)"; then
  echo "run-all.sh --sanitize: no compute-sanitizer (not on PATH, not in /usr/local/cuda*/bin," \
    "\$CUDA_HOME/bin; set KVR_SANITIZER=/path/to/compute-sanitizer)" >&2
  exit 2
fi
echo "sanitizer: $sanitizer ($("$sanitizer" --version 2>/dev/null | grep -m1 -i version))"
echo "tools: $tools; jobs: ${#selected[@]}; timeout ${KVR_SANITIZE_TIMEOUT:-900}s per (job, tool)" \
  "${KVR_SANITIZE_BUDGET:+; budget ${KVR_SANITIZE_BUDGET}s}"
tsv="$logs/sanitize.tsv"
printf 'job\ttool\tstatus\terrors\tseconds\n' >"$tsv"
run_start=$(date +%s)
skipped=0

# Errors a compute-sanitizer log reports: its ERROR SUMMARY, or (a run cut short) the
# error records printed so far, marked with "+".
count_errors() {
  local n
  n=$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$1" | tail -n 1 | grep -Eo '[0-9]+')
  if [ -n "$n" ]; then echo "$n"; return; fi
  # racecheck: "RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)"
  n=$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazards displayed \([0-9]+ error' "$1" | tail -n 1 |
    grep -Eo '\([0-9]+' | tr -d '(')
  if [ -n "$n" ]; then echo "$n"; return; fi
  n=$(grep -cE '^========= +(Invalid|Uninitialized|Race|Barrier|Misaligned|Out-of-range|Program hit|Malloc|Free|Leaked|Unused|Warning|Error|.*[Hh]azard)' "$1")
  echo "${n}+"
}

# One (job, tool) pair: runs it and writes its row (job, tool, status, errors, seconds) to
# $rowdir/<k>, printing the log's error records when it did not pass.
run_pair() { # k tool job-index
  local k="$1" tool="$2" i="$3" name="${names[$3]}" limit skips skip_var note="" log rc errors status start
  skip_var="KVR_SANITIZE_SKIP_$(echo "$tool" | tr '[:lower:]' '[:upper:]')"
  if [ -n "${!skip_var+set}" ]; then skips="${!skip_var}"
  elif [ "$tool" = racecheck ]; then skips="large"
  else skips=""; fi
  limit="${KVR_SANITIZE_TIMEOUT:-900}"
  if [ -n "${KVR_SANITIZE_BUDGET:-}" ]; then
    left=$((KVR_SANITIZE_BUDGET - ($(date +%s) - run_start)))
    if [ "$left" -le 5 ]; then printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$tool" SKIPPED - 0.0 >"$rowdir/$k"; return; fi
    [ "$left" -lt "$limit" ] && limit="$left"
  fi
  eval "argv=(${argvs[$i]})"
  if [ "${kinds[$i]}" = test ]; then
    [ -n "${KVR_SANITIZE_FILTER:-}" ] && argv+=("$KVR_SANITIZE_FILTER")
    for s in $skips; do argv+=(--skip "$s"); done
    [ -n "$skips" ] && note=" (skipping tests named *${skips// /*, *}*)"
  fi
  # --require-cuda-init no: examples that never touch CUDA (gguf_plan) are not errors.
  pre=("$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 --require-cuda-init no)
  if [ "$tool" = memcheck ] && [ "${KVR_SANITIZE_LEAKS:-0}" = 1 ]; then pre+=(--leak-check full); fi
  log="$logs/$name.$tool.log"
  echo "== $name under $tool$note"
  start=$(date +%s.%N)
  # shellcheck disable=SC2086 # envs[] holds VAR=value words
  env ${envs[$i]} timeout --kill-after=30 "$limit" "${pre[@]}" "${argv[@]}" >"$log" 2>&1
  rc=$?
  errors=$(count_errors "$log")
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=TIMEOUT
  elif [ "${errors%+}" != 0 ]; then status=ERRORS
  elif [ "$rc" != 0 ]; then status=FAIL
  else status=PASS; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$tool" "$status" "$errors" "$(secs "$start")" >"$rowdir/$k"
  if [ "$status" != PASS ]; then
    { echo "== $name under $tool: $status"; grep -E '^=========' "$log" | head -n 30
      [ "$status" = FAIL ] && tail -n 20 "$log"; } || true
  fi
}

rowdir="$logs/.rows"
rm -rf "$rowdir"
mkdir -p "$rowdir"
k=0
for tool in $tools; do
  for i in "${selected[@]}"; do
    k=$((k + 1))
    if [ "$jobs" -le 1 ]; then
      run_pair "$k" "$tool" "$i"
    else
      # At most $jobs pairs at once; each pair's output is kept whole.
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
      run_pair "$k" "$tool" "$i" >"$rowdir/$k.out" 2>&1 &
    fi
  done
done
wait
for f in $(find "$rowdir" -maxdepth 1 -name '*.out' | sort -V); do cat "$f"; done
echo
echo "compute-sanitizer results (errors: the tool's ERROR SUMMARY; N+ = a run cut short)"
printf '%-36s %-10s %-8s %7s %9s\n' job tool status errors time
for f in $(find "$rowdir" -maxdepth 1 -type f ! -name '*.out' -printf '%f\n' | sort -n); do
  IFS=$'\t' read -r name tool status errors t <"$rowdir/$f"
  printf '%-36s %-10s %-8s %7s %8ss\n' "$name" "$tool" "$status" "$errors" "$t"
  cat "$rowdir/$f" >>"$tsv"
  case "$status" in
    PASS) ;;
    SKIPPED) skipped=$((skipped + 1)) ;;
    *) fail=1 ;;
  esac
done
echo "table: $tsv; logs: $logs/<job>.<tool>.log; $(($(date +%s) - run_start))s in all"
if [ "$skipped" -gt 0 ]; then
  echo "$skipped (job, tool) pairs skipped for the budget: run them with --only / --tools"
fi
exit $fail
