"""Runs one decode configuration a few times, for Nsight Compute:

    ncu -k regex:kvr_kv_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 profile_kv.py B L [Hq Hkv page]
"""
import sys

import torch

import bench_kv_decode as b

B, L = int(sys.argv[1]), int(sys.argv[2])
Hq, Hkv, page = (int(x) for x in (sys.argv[3:6] if len(sys.argv) > 5 else (32, 8, 16)))
data = b.KvData(B, Hq, Hkv, 128, [L] * B, 1)
pool, seqs = b.make_pool(data, page)
fn, out = b.ours_fn(pool, data, seqs)
for _ in range(5):
    fn(0)
torch.cuda.synchronize()
print("ok", b.rel_err(out, b.reference(data)))
