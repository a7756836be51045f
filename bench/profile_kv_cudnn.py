"""Our paged decode and torch SDPA's cuDNN decode on the same data, for Nsight Compute
(issue 15: where cuDNN's 1-3 % at B = 32 comes from). Only the timed calls are profiled:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section LaunchStats --section Occupancy python3 profile_kv_cudnn.py B L [Hq Hkv]
"""
import sys

import torch

import bench_kv_decode as b

B, L = int(sys.argv[1]), int(sys.argv[2])
Hq, Hkv = (int(x) for x in (sys.argv[3:5] if len(sys.argv) > 4 else (32, 8)))
data = b.KvData(B, Hq, Hkv, 128, [L] * B, 1)
pool, seqs = b.make_pool(data, 16)
ours, out = b.ours_fn(pool, data, seqs)
cudnn = b.sdpa_fn(data, b.SDPBackend.CUDNN_ATTENTION)
for _ in range(3):
    ours(0)
    cudnn(0)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for _ in range(2):
    ours(0)
for _ in range(2):
    cudnn(0)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("ok", b.rel_err(out, b.reference(data)))
