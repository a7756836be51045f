"""kvr_wgkv_pool_step in isolation (issue 11), for Nsight Compute:

    ncu --clock-control none -k regex:kvr_wgkv_step --metrics gpu__time_duration.sum \
        python3 profile_wgkv_step.py [B]

A 25 % write-gated pool at 4K tokens (Llama-3.1-8B layer shape, 4 layers) with a hidden-512
gate; after a reservation, one eager step per layer with given scores, then one per layer
with the gate (8 step kernels).
"""
import sys

import torch

import bench_wgkv as w

B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
L, layers = 4096, 4
data = w.Data(B, L)
pool, seqs = w.build_wgkv(data, w.admissions(B, L, 0.25, seed=5), layers, 1024)
w.lib.wgkv_set_gate(pool, [w.random_gate(512)] * layers, 512)
for s in seqs:
    w.lib.wgkv_reserve(pool, s, 16, w.cur_stream())
ids = torch.tensor(seqs, dtype=torch.int32)  # the descriptor points into it
ids_t = w.T(ids)
x = torch.randn(layers, 3, B, w.HKV, w.D, dtype=w.DT, device=w.DEV)
sc = torch.rand(layers, B, w.HKV, device=w.DEV)
keep = [(w.T(x[i, 0]), w.T(x[i, 1]), w.T(x[i, 2]), w.T(sc[i])) for i in range(layers)]
for gated in (False, True):
    for i, (kp, k, v, s) in enumerate(keep):
        r = (w.lib.wgkv_step(pool, i, ids_t, k, v, k_pre=kp, stream=w.cur_stream()) if gated else
             w.lib.wgkv_step(pool, i, ids_t, k, v, scores=s, stream=w.cur_stream()))
        w.lib.check(r, "kvr_wgkv_pool_step")
torch.cuda.synchronize()
print("rows after:", [r.total for r in w.lib.wgkv_rows(pool, seqs[0])][:: w.HKV], flush=True)
