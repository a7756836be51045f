#!/usr/bin/env bash
# integrations/llama.cpp/check.sh [cpu|cuda]: the patched llama.cpp gives the same tokens and
# logits with kvreplay on and off (KVR_LLAMA=0), in one binary (kvr-llama-check):
#   - tiny qwen3next and qwen35 models from llama.cpp's own generator (test-llama-archs -o,
#     random weights, Gated DeltaNet layers with 2 key heads broadcast over 4 value heads,
#     d 128: LLAMA_ARCHS_GDN="2,4,128,3", 2 GDN layers + 1 attention layer);
#   - per model: one sequence (prompt of 8 tokens, then 64 greedy tokens), 4 sequences in
#     one batch (64 greedy steps each), and for qwen35 (the architecture with llama.cpp's
#     snapshot rollback) 4 sequences verifying 2 drafts per step with 3 snapshots and
#     rolling them back;
#   - cpu: the op alone (ggml graphs: decode, multi-token with snapshots, broadcast heads,
#     strided q/k);
# and that the "on" runs did run kvreplay (its log line) and the "off" runs did not. Tokens
# must be identical and logits within 1e-4 of each other (relative to the largest logit).
# cuda: all layers offloaded, CUDA graphs on (llama.cpp's default), then once more without.
#
# Builds first (build.sh) unless KVR_LLAMA_BUILD names a build directory. Exit 0 on success.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
mode="${1:-cpu}"
case "$mode" in cpu | cuda) ;; *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;; esac
build="${KVR_LLAMA_BUILD:-}"
if [ -z "$build" ]; then
  build="$(bash "$here/build.sh" "$mode" | tail -n 1)"
fi
bin="$build/bin"
cache="${KVR_LLAMA_CACHE:-$root/target/llama.cpp}"
out="$cache/check-$mode"
rm -rf "$out"
mkdir -p "$out/models"
t0=$(date +%s)
fails=0
rows=()
ngl=0
threads="${KVR_LLAMA_THREADS:-2}"
[ "$mode" = cuda ] && ngl=99

LLAMA_ARCHS_GDN="2,4,128,3" "$bin/test-llama-archs" -a '^(qwen3next|qwen35)$' -o "$out/models" >"$out/models.log" 2>&1 ||
  { cat "$out/models.log" >&2; exit 1; }

# run NAME EXPECT_BACKEND ARGS...: kvr-llama-check with kvreplay on and off, then compare.
run() {
  local name="$1" backend="$2"
  shift 2
  local ok=1 note=""
  for sw in on off; do
    local envs=()
    [ "$sw" = off ] && envs=(KVR_LLAMA=0)
    if ! env ${envs[@]+"${envs[@]}"} "$bin/kvr-llama-check" "$@" "$out/$name-$sw" >"$out/$name-$sw.out" 2>"$out/$name-$sw.log"; then
      ok=0
      note="$sw run failed: $(tail -n 3 "$out/$name-$sw.log" | tr '\n' ' ')"
    fi
  done
  if [ $ok = 1 ]; then
    if ! grep -q "GATED_DELTA_NET on $backend runs on kvreplay" "$out/$name-on.log"; then
      ok=0
      note="kvreplay did not run on $backend"
    elif grep -q "runs on kvreplay" "$out/$name-off.log"; then
      ok=0
      note="kvreplay ran with KVR_LLAMA=0"
    elif grep -q "falls back" "$out/$name-on.log"; then
      ok=0
      note="$(grep "falls back" "$out/$name-on.log" | head -n 1)"
    fi
  fi
  if [ $ok = 1 ]; then
    if "$bin/kvr-llama-check" cmp "$out/$name-on" "$out/$name-off" >"$out/$name-cmp.txt" 2>&1; then
      note="$(sed -E 's/.*: ([0-9]+ tokens identical, [0-9]+ vectors, max relative difference [^ ]+).*/\1/' "$out/$name-cmp.txt")"
    else
      ok=0
      note="$(cat "$out/$name-cmp.txt" | tr '\n' ' ')"
    fi
  fi
  [ $ok = 1 ] || fails=$((fails + 1))
  rows+=("$(printf '%-34s %-4s %s' "$name" "$([ $ok = 1 ] && echo PASS || echo FAIL)" "$note")")
}

backend=CPU
[ "$mode" = cuda ] && backend=CUDA
suffixes=("")
[ "$mode" = cuda ] && suffixes=("" "-nographs")
for sfx in "${suffixes[@]}"; do
  [ "$sfx" = -nographs ] && export GGML_CUDA_DISABLE_GRAPHS=1
  for m in qwen3next-moe qwen35-dense; do
    model="$out/models/$m.gguf"
    common=(--ngl "$ngl" --threads "$threads")
    run "$m-1seq$sfx" "$backend" gen "$model" --seqs 1 --tokens 64 "${common[@]}"
    run "$m-4seq$sfx" "$backend" gen "$model" --seqs 4 --tokens 64 "${common[@]}"
    if [ "$m" = qwen35-dense ]; then
      run "$m-4seq-drafts$sfx" "$backend" gen "$model" --seqs 4 --tokens 24 --rs 3 "${common[@]}"
    fi
  done
  unset GGML_CUDA_DISABLE_GRAPHS
done
if [ "$mode" = cpu ]; then
  # 8 threads over as few as 2 work items: ggml then hands some threads empty chunks
  run "gated_delta_net-op" CPU op --threads 8
fi

printf '\nkvreplay in llama.cpp (%s), kvreplay on vs off (KVR_LLAMA=0), %ss:\n' "$mode" "$(($(date +%s) - t0))"
printf '%s\n' "${rows[@]}"
if [ $fails -gt 0 ]; then
  echo "check.sh $mode: $fails FAILED (logs in $out)" >&2
  exit 1
fi
echo "check.sh $mode: all passed"
