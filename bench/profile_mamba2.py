"""Eager Mamba-2 decode steps on one pool (Nemotron-H-8B layer), for Nsight Compute
(bench/profile_gdn.sh with KVR_NCU_SCRIPT=profile_mamba2.py).

    python3 profile_mamba2.py B L [layout, ignored: V-major] [steps] [T]

With T > 1 every step is a verify of T drafts and a commit of T / 2 (device-side count).
"""

import sys

import torch

import kvr
from benchutil import cur_stream

B, L = int(sys.argv[1]), int(sys.argv[2])
STEPS = int(sys.argv[4]) if len(sys.argv) > 4 else 40
T = int(sys.argv[5]) if len(sys.argv) > 5 else 1
H, P, G, N = 128, 64, 8, 128
DEV = torch.device("cuda")

lib = kvr.Lib()
ctx = lib.context(kvr.BACKEND_CUDA, stream=cur_stream())
p = lib.mamba2_pool(ctx, n_layers=1, n_heads=H, head_dim=P, n_groups=G, d_state=N, ring_len=L,
                    kv_only_threshold=0, max_drafts=T if T > 1 else 0, max_seqs=B, layout=kvr.STATE_V_MAJOR)
seqs = [lib.mamba2_seq_add(p, cur_stream()) for _ in range(B)]
ids_t = torch.tensor(seqs, dtype=torch.int32, device=DEV if T == 1 else "cpu")  # verify: host ids
ids = kvr.torch_tensor(ids_t)
acc = kvr.torch_tensor(torch.full((B,), T // 2, dtype=torch.int32, device=DEV))
g = torch.Generator(device=DEV)
g.manual_seed(0)


def r(*shape, lo=-1.0, hi=1.0, dt=torch.bfloat16):
    return (torch.rand(*shape, generator=g, device=DEV) * (hi - lo) + lo).to(dt)


x, z, bm, cm = r(B, T, H, P), r(B, T, H, P), r(B, T, G, N), r(B, T, G, N)
dt = r(B, T, H, lo=-3.0, hi=1.0, dt=torch.float32)
a, d, bias = -torch.rand(H, device=DEV) - 0.2, torch.rand(H, device=DEV), torch.rand(H, device=DEV) - 0.5
out = torch.empty(B, T, H, P, dtype=torch.bfloat16, device=DEV)
tv = {k: kvr.torch_tensor(v) for k, v in dict(x=x, dt=dt, a=a, b=bm, c=cm, d=d, z=z, dt_bias=bias, out=out).items()}
ts = lib.mamba2_tensors(seq_ids=ids, **tv)
for _ in range(STEPS):
    lib.check(lib.mamba2_step(T > 1, p, 0, ts, cur_stream()), "step")
    if T > 1:
        lib.check(lib.mamba2_commit(p, 0, ids, acc, cur_stream()), "commit")
torch.cuda.synchronize()
print("ok", float(out.float().abs().max()))
