#!/usr/bin/env bash
# integrations/llama.cpp/device-run.sh [PACK_DIR] [PHASES]: the CUDA part on the GPU machine
# (no network, no cargo), from the repository root, with PACK_DIR (default llama-device/)
# made by pack-for-device.sh (without one: the sdist from PyPI and kvreplay from cargo, for
# KVR_CUDA_ARCHS, default 90a). PHASES (default all) is a comma list of:
#   build   build.sh cuda from the packed tree and library (sm_90a)
#   ops     test-backend-ops -o GATED_DELTA_NET.* (CUDA against the CPU backend): once with
#           llama.cpp's own CPU op as the reference (KVR_LLAMA_CPU=0) and kvreplay on CUDA,
#           once with kvreplay off (the built-in CUDA kernel), for comparison
#   tokens  check.sh cuda: the tiny qwen3next / qwen35 models, kvreplay on vs off, identical
#           tokens and logits within 1e-4, CUDA graphs on (the default) and off
#   perf    test-backend-ops perf at the Qwen3-Next GDN shape (16 key heads over 32 value
#           heads, d 128, one token, q/k L2 norms in the graph) for 1..256 sequences: the
#           built-in kernel vs kvreplay (its pick of rows per warp, and each forced), and
#           decode steps of a 3-GDN-layer model at that shape (kvr-llama-check gen) at 1, 8
#           and 32 sequences
# Prints a table per phase; $OUT (or the cache) gets the logs, perf.txt and llamacpp_gdn.json
# (llamacpp_gdn_kvr_vs_builtin_b1 / _b8 / _b32 = built-in time / kvreplay time, for
# bench/results/h200.json). Environment: KVR_LLAMA_CACHE (default target/llama.cpp),
# KVR_LLAMA_JOBS (default: all cores).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
pack="${1:-$root/llama-device}"
phases="${2:-build,ops,tokens,perf}"
if [ -d "$pack" ]; then
  pack="$(cd "$pack" && pwd)"
  export KVR_LLAMA_TREE="$pack/llama.cpp-0c1e570.tar.xz"
  export KVR_LIB="$pack/libkvreplay.a"
  export KVR_INCLUDE="$pack"
else
  # No pack: build.sh downloads the sdist and builds kvreplay with cargo (network and Rust).
  echo "device-run.sh: no $pack; building from PyPI and this repository" >&2
  export KVR_CUDA_ARCHS="${KVR_CUDA_ARCHS:-90a}"
fi
# In the repository (git-ignored), so that separate runs of the phases share the build.
export KVR_LLAMA_CACHE="${KVR_LLAMA_CACHE:-$root/target/llama.cpp}"
export KVR_LLAMA_JOBS="${KVR_LLAMA_JOBS:-$(nproc)}"
out="${OUT:-$KVR_LLAMA_CACHE/out}"
mkdir -p "$out"
build="$KVR_LLAMA_CACHE/build-cuda"
bin="$build/bin"
t0=$(date +%s)
phase() { printf '\n==== %s (%ss)\n' "$*" "$(($(date +%s) - t0))"; }
has() { case ",$phases," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
status=0
nvidia-smi -L 2>/dev/null | head -n 2 || true
command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2 | head -n 1 || echo "nvcc not on PATH (set CUDACXX)"

if has build; then
  phase "build (build.sh cuda, sm_90a, -j$KVR_LLAMA_JOBS)"
  bash "$here/build.sh" cuda | tail -n 1
fi

if has ops; then
  phase "test-backend-ops -o GATED_DELTA_NET.* -b CUDA0"
  for cfg in "kvreplay:KVR_LLAMA_CPU=0" "builtin:KVR_LLAMA=0"; do
    name="${cfg%%:*}"
    env "${cfg#*:}" "$bin/test-backend-ops" test -o 'GATED_DELTA_NET.*' -b CUDA0 >"$out/ops-$name.txt" 2>&1 || true
    passed="$(grep -Eo '[0-9]+/[0-9]+ tests passed' "$out/ops-$name.txt" | tail -n 1 || true)"
    used="$(grep -c 'on CUDA runs on kvreplay' "$out/ops-$name.txt" || true)"
    notes="$(grep -Eo 'on CUDA: .* runs on the built-in kernel|falls back.*' "$out/ops-$name.txt" | sort -u | tr '\n' ' ' || true)"
    printf '%-9s %s (kvreplay ran: %s) %s\n' "$name" "${passed:-no result}" \
      "$([ "${used:-0}" -gt 0 ] && echo yes || echo no)" "$notes"
    grep -E 'FAIL' "$out/ops-$name.txt" | head -n 10 || true
    n_ok="${passed%%/*}"
    n_all="$(echo "$passed" | sed -E 's#^[0-9]+/([0-9]+).*#\1#')"
    if [ -z "$passed" ] || [ "$n_ok" != "$n_all" ]; then
      status=1
    fi
  done
fi

if has tokens; then
  phase "tiny models on CUDA (check.sh cuda)"
  KVR_LLAMA_BUILD="$build" bash "$here/check.sh" cuda || status=1
fi

if has perf; then
  phase "perf: test-backend-ops perf at the Qwen3-Next GDN shape"
  sel='GATED_DELTA_NET'
  params='head_count=16,head_size=128,n_seq_tokens=1,n_seqs=[0-9]+,v_repeat=2,'
  perf() { # NAME ENV...: us/run per n_seqs into $out/perf-NAME.txt
    local name="$1"
    shift
    env "$@" "$bin/test-backend-ops" perf -o "$sel" -p "$params" -b CUDA0 >"$out/perf-$name.txt" 2>&1 || true
  }
  perf builtin KVR_LLAMA=0
  perf kvreplay KVR_LLAMA=1
  perf fused KVR_LLAMA_FUSE_NORMS=1
  perf general KVR_GDN_RECUR1=0
  for r in 1 2 4; do perf "kvreplay-r$r" KVR_GDN_RECUR_ROWS=$r; done
  us() { # FILE N_SEQS -> us/run
    grep -E "n_seqs=$2,v_repeat=2" "$1" | grep -Eo '[0-9.]+ us/run' | head -n 1 | cut -d' ' -f1
  }
  {
    printf '%-6s %10s %10s %9s %8s %8s %8s %8s %9s %9s\n' "seqs" "built-in" "kvreplay" "fused" "general" "r1" \
      "r2" "r4" "ratio" "fused"
    for b in 1 8 32 128 256; do
      bi="$(us "$out/perf-builtin.txt" $b)"
      kv="$(us "$out/perf-kvreplay.txt" $b)"
      nf="$(us "$out/perf-fused.txt" $b)"
      printf '%-6s %10s %10s %9s %8s %8s %8s %8s %9s %9s\n' "$b" "${bi:-?}" "${kv:-?}" "${nf:-?}" \
        "$(us "$out/perf-general.txt" $b)" "$(us "$out/perf-kvreplay-r1.txt" $b)" "$(us "$out/perf-kvreplay-r2.txt" $b)" \
        "$(us "$out/perf-kvreplay-r4.txt" $b)" \
        "$(awk -v a="${bi:-0}" -v b="${kv:-0}" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "?" }')" \
        "$(awk -v a="${bi:-0}" -v b="${nf:-0}" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "?" }')"
    done
  } | tee "$out/perf.txt"
  echo "(us per run of the op: test-backend-ops evaluates the q/k L2 norms once and repeats the"
  echo " GATED_DELTA_NET node; ratio = built-in / kvreplay; fused: KVR_LLAMA_FUSE_NORMS=1, kvreplay"
  echo " normalizes q/k in its kernel and the norm nodes are skipped; r1/r2/r4: kvreplay with"
  echo " 1/2/4 value rows per warp forced; general: KVR_GDN_RECUR1=0, one-token calls on the general kernel)"
  {
    printf '{\n'
    sep=""
    for b in 1 8 32; do
      bi="$(us "$out/perf-builtin.txt" $b)"
      for v in kvreplay fused; do
        kv="$(us "$out/perf-$v.txt" $b)"
        key="llamacpp_gdn_kvr_vs_builtin_b$b"
        [ "$v" = fused ] && key="llamacpp_gdn_kvr_fused_vs_builtin_b$b"
        printf '%s  "%s": %s' "$sep" "$key" \
          "$(awk -v a="${bi:-0}" -v b="${kv:-0}" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "null" }')"
        sep=$',\n'
      done
    done
    printf '\n}\n'
  } >"$out/llamacpp_gdn.json"
  cat "$out/llamacpp_gdn.json"

  phase "perf: decode steps of a 3-GDN-layer model at the Qwen3-Next shape (kvr-llama-check gen)"
  models="$KVR_LLAMA_CACHE/models-qwen3next-shape"
  mkdir -p "$models"
  LLAMA_ARCHS_GDN="16,32,128,4" "$bin/test-llama-archs" -a '^qwen3next$' -o "$models" >"$out/models-shape.log" 2>&1
  printf '%-6s %14s %14s %8s  %s\n' "seqs" "built-in ms" "kvreplay ms" "ratio" "tokens"
  for b in 1 8 32; do
    for sw in on off; do
      envs=()
      [ "$sw" = off ] && envs=(KVR_LLAMA=0)
      env ${envs[@]+"${envs[@]}"} "$bin/kvr-llama-check" gen "$models/qwen3next-moe.gguf" "$out/shape-b$b-$sw" \
        --seqs "$b" --tokens 32 --ngl 99 >"$out/shape-b$b-$sw.txt" 2>"$out/shape-b$b-$sw.log" || status=1
    done
    on="$(grep -Eo '[0-9.]+ ms per step' "$out/shape-b$b-on.txt" | cut -d' ' -f1)"
    off="$(grep -Eo '[0-9.]+ ms per step' "$out/shape-b$b-off.txt" | cut -d' ' -f1)"
    same="$("$bin/kvr-llama-check" cmp "$out/shape-b$b-on" "$out/shape-b$b-off" >/dev/null 2>&1 && echo identical || echo DIFFER)"
    printf '%-6s %14s %14s %8s  %s\n' "$b" "${off:-?}" "${on:-?}" \
      "$(awk -v a="${off:-0}" -v b="${on:-0}" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "?" }')" "$same"
  done
  echo "(whole decode step of the model, CUDA graphs on; the GDN op is a part of it)"
fi

phase "done"
exit $status
