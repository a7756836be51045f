"""Per-kernel times of GDN decode steps on a pool with KV-only mode, under CUDA Graph replay
(torch.profiler's CUPTI records each kernel of the replayed graph at the clocks the GPU runs
at; Nsight Compute's single replays of tiny kernels run at idle clocks).

    python3 profile_kvonly.py B context [threshold] [--layout v]

The pool is Qwen3-Next's GDN layer (16 key heads, 32 value heads, dk = dv = 128, fp32
state, bf16 entries, ring 16), one layer per input set rotating over > 4x L2 as in
bench_gdn.py; the sequences decode `context` tokens eagerly, then a graph of 4 steps per
layer is timed (threshold 0: a pool without KV-only mode).
"""

import collections
import sys

import torch

import bench_gdn as bg
import kvr
from benchutil import cur_stream, profile_graph

B, CTX = int(sys.argv[1]), int(sys.argv[2])
THR = int(sys.argv[3]) if len(sys.argv) > 3 else kvr.kv_only_threshold(bg.D, bg.D, 4, 2)
lib = bg.lib
ns = bg.n_sets_for(B)
inp = bg.Inputs(B, 1, ns, seed=3)
p, seqs = bg.pool(B, 16, ns, thr=THR, entry=kvr.DTYPE_BF16)
o = bg.Ours(p, seqs, inp)
for _ in range(CTX):
    for i in range(ns):
        o(i)
torch.cuda.synchronize()
steps = 4
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
torch.cuda.synchronize()
events, per_step = profile_graph(o, ns, steps, warm=False)
tot = collections.defaultdict(float)
cnt = collections.Counter()
for e in events:
    tot[e.name] += e.device_time
    cnt[e.name] += 1
mode = lib.gdn_cursor(p, 0, seqs[0]).mode
print(f"B={B} context {CTX + 2 * steps} threshold {THR} mode {mode}: {per_step:.1f} us a step (graph, 4 steps)")
for name, t in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"  {name:48s} {t / cnt[name]:8.2f} us  x{cnt[name] // (steps * ns)} a step")
bg.free(p)
