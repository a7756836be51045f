"""Per-kernel times of GDN replay decode steps or speculative verify rounds under CUDA Graph
replay (torch.profiler's CUPTI records each kernel of the replayed graph at the clocks the GPU
runs at), with the gaps between consecutive kernels (negative: the second began before the
first ended, as a programmatic dependent does).

    python3 profile_round.py decode B [ring] [--layout v]
    python3 profile_round.py verify B T [ring] [--layout v]     # + commit of T / 2

Qwen3-Next's GDN layer as in bench_gdn.py (f32 state and entries, bf16 inputs), one layer per
input set rotating over > 4x L2; the graph holds `ring` decode steps (or 8 rounds) per layer.
"""

import collections
import sys

import torch

import bench_gdn as bg
from benchutil import profile_graph

MODE = sys.argv[1]
B = int(sys.argv[2])
T = int(sys.argv[3]) if MODE == "verify" else 1
_ri = 4 if MODE == "verify" else 3
RING = int(sys.argv[_ri]) if len(sys.argv) > _ri and not sys.argv[_ri].startswith("-") else 16
ns = bg.n_sets_for(B)
inp = bg.Inputs(B, T, ns, seed=3)
p, seqs = bg.pool(B, RING, ns, drafts=8 if MODE == "verify" else 0)
o = bg.Ours(p, seqs, inp, verify=MODE == "verify")
c = bg.Commit(p, seqs, max(1, T // 2)) if MODE == "verify" else None


def one(i):
    o(i)
    if c is not None:
        c(i)


steps = RING if MODE == "decode" else 8
for _ in range(steps):
    for i in range(ns):
        one(i)
torch.cuda.synchronize()
ev, per = profile_graph(one, ns, steps)
tot, cnt, mx = collections.defaultdict(float), collections.Counter(), collections.defaultdict(float)
for e in ev:
    d = e.time_range.end - e.time_range.start
    tot[e.name] += d
    cnt[e.name] += 1
    mx[e.name] = max(mx[e.name], d)
span = (ev[-1].time_range.end - ev[0].time_range.start) / (steps * ns)
unit = "step" if MODE == "decode" else "round"
print(f"{MODE} B={B} T={T} ring {RING}: {per:.1f} us a {unit} (events), {span:.1f} (CUPTI span)")
for n, t in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"  {n[:64]:64s} n={cnt[n]:4d} mean {t / cnt[n]:7.1f} max {mx[n]:7.1f} us")
gaps = collections.defaultdict(list)
for x, y in zip(ev, ev[1:]):
    gaps[(x.name[:32], y.name[:32])].append(y.time_range.start - x.time_range.end)
for (x, y), v in gaps.items():
    print(f"  gap {x} -> {y}: mean {sum(v) / len(v):6.1f} us (n={len(v)})")
