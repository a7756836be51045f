#!/usr/bin/env python3
"""What the small-batch GDN decode kernels would gain from being specialized (issue 14).

Builds bench/gdn_kernel_ab.cu (the kernel-level A/B, no Rust) against copies of kernels/ in
which the run-time fields of the step parameters that the warp-streaming decode reads
(kernels/gdn_common.cuh and kernels/gdn_wdecode.cu) are replaced by the values the A/B
program passes, in groups:

  shape   heads (32 value, 16 key), dv 128, ring length 16, and the one-launch kernel's
          tiles / rows per tile: index arithmetic and integer divisions become constants
  dtype   entry dtype f32, q / k / v / beta bf16, g / out f32: no run-time dtype dispatch
  flags   q/k L2 norm on, delta rule, no conv window, no dt discretization, unit key
          strides, no id tensor, no skip or gate
  all     the three together

and runs each beside the unchanged kernels (`base`), every variant checked by the A/B program
itself (outputs, states, ring and metadata against the streaming kernel). Nothing here is
used by the library: it measures what a specialized kernel could reach before one is built.

On the device (it has nvcc), from the repository root:
    python3 bench/gdn_specialize_probe.py [--batches 1,8] [--ring 16] [--work /tmp/gdn_probe]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPE = [(r"\bp\.hv\b", "32"), (r"\bp\.hk\b", "16"), (r"\bp\.dv\b", "128"), (r"\bp\.l\b", "RING")]
# The one-launch and state kernels' tiles (4 of 32 rows at dv 128); the streaming reference
# kernel uses other tiles, so these go into gdn_wdecode.cu only.
SHAPE_W = [(r"\bp\.tiles\b", "4"), (r"\bp\.tv\b", "32")]
DTYPE = [
    (r"\bp\.entry_dtype\b", "KVR_DT_F32"),
    (r"\bp\.q\.dtype\b", "KVR_DT_BF16"),
    (r"\bp\.k\.dtype\b", "KVR_DT_BF16"),
    (r"\bp\.v\.dtype\b", "KVR_DT_BF16"),
    (r"\bp\.out\.dtype\b", "KVR_DT_F32"),
    (r"\bp\.g\.dtype\b", "KVR_DT_F32"),
    (r"\bp\.beta\.dtype\b", "KVR_DT_BF16"),
]
FLAGS = [
    (r"\bp\.l2norm\b", "1"),
    (r"\bp\.rule\b", "KVR_GDN_RULE_DELTA"),
    (r"\bp\.conv_dim\b", "0"),
    (r"\bp\.dt_mode\b", "KVR_GDN_DT_NONE"),
    (r"\bp\.q\.s\[3\]", "1"),
    (r"\bp\.k\.s\[3\]", "1"),
    (r"\bp\.v\.s\[3\]", "1"),
    (r"\bp\.ids\b", "((const int*)nullptr)"),
    (r"\bp\.skip\.p\b", "((const void*)nullptr)"),
    (r"\bp\.gate\.p\b", "((const void*)nullptr)"),
]
VARIANTS = {
    "base": ([], []),
    "shape": (SHAPE, SHAPE_W),
    "dtype": (DTYPE, []),
    "flags": (FLAGS, []),
    "all": (SHAPE + DTYPE + FLAGS, SHAPE_W),
}


def make(work, name, ring):
    common, wonly = VARIANTS[name]
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "kernels"), d)
    for f, subs in (("gdn_common.cuh", common), ("gdn_wdecode.cu", common + wonly)):
        path = os.path.join(d, f)
        src = open(path).read()
        for pat, val in subs:
            src = re.sub(pat, val.replace("RING", str(ring)), src)
        open(path, "w").write(src)
    ab = open(os.path.join(ROOT, "bench", "gdn_kernel_ab.cu")).read()
    ab = ab.replace('"../kernels/', '"')
    open(os.path.join(d, "ab.cu"), "w").write(ab)
    cmd = ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", d, "ab.cu", "-o", "ab"]
    r = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: nvcc failed\n{r.stderr[-3000:]}")
    return os.path.join(d, "ab")


def run(exe, ring, b):
    r = subprocess.run([exe, str(ring), str(b)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{exe} {ring} {b} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    one = re.search(r"one launch \(fdecode\) ([\d.]+) us.*?err out / state / ring (\S+) / (\S+) / (\S+) (meta ok|META MISMATCH)", r.stdout)
    row = re.search(rf"^\s*{b} \|\s*([\d.]+) \|\s*([\d.]+) \|.*\| (\S+) / (\S+) / (\S+) (meta ok|META MISMATCH)", r.stdout, re.M)
    if not one or not row:
        sys.exit(f"{exe}: unexpected output\n{r.stdout[-2000:]}")
    ok = one.group(5) == "meta ok" and row.group(6) == "meta ok"
    err = max(float(x) for x in one.groups()[1:4] + row.groups()[2:5])
    return float(one.group(1)), float(row.group(2)), err, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ring", type=int, default=16, choices=(16, 32))
    ap.add_argument("--work", default="/tmp/gdn_probe")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    with ThreadPoolExecutor(len(VARIANTS)) as ex:
        exes = dict(zip(VARIANTS, ex.map(lambda n: make(a.work, n, a.ring), VARIANTS)))
    print(f"ring {a.ring}; us per replay step (graph of 16 steps, L2-resident), every variant checked by the A/B program")
    print("| B | variant | one launch | two launches | max rel err | checks |")
    print("|---:|---|---:|---:|---:|---|")
    bad = False
    for b in (int(x) for x in a.batches.split(",")):
        base = None
        for name, exe in exes.items():
            one, two, err, ok = run(exe, a.ring, b)
            base = base or (one, two)
            bad |= not ok or err > 1e-5
            print(f"| {b} | {name} | {one:.2f} ({base[0] / one:.2f}x) | {two:.2f} ({base[1] / two:.2f}x) | {err:.1e} | {'ok' if ok else 'MISMATCH'} |")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
