"""Eager GDN decode steps on one pool, for Nsight Compute (bench/profile_gdn.sh).

    python3 profile_gdn.py B L [layout k|v] [steps] [kv_only_threshold]

With a KV-only threshold the ring entries are bf16 and the steps run in KV-only mode until
the threshold (kernels/gdn_kvonly.cu beside gdn_decode.cu).
"""

import sys

import torch

import kvr
from benchutil import cur_stream

B, L = int(sys.argv[1]), int(sys.argv[2])
LAYOUT = 1 if len(sys.argv) > 3 and sys.argv[3] == "v" else 0
STEPS = int(sys.argv[4]) if len(sys.argv) > 4 else 40
THR = int(sys.argv[5]) if len(sys.argv) > 5 else 0
HK, HV, D = 16, 32, 128
DEV = torch.device("cuda")

lib = kvr.Lib()
ctx = lib.context(kvr.BACKEND_CUDA, stream=cur_stream())
p = lib.gdn_pool(ctx, n_layers=1, n_k_heads=HK, n_v_heads=HV, dk=D, dv=D, ring_len=L, max_seqs=B,
                 kv_only_threshold=THR, entry_dtype=kvr.DTYPE_BF16 if THR else kvr.DTYPE_F32,
                 layout=LAYOUT)
seqs = [lib.gdn_seq_add(p, cur_stream()) for _ in range(B)]
ids_host = torch.tensor(seqs, dtype=torch.int32)  # kept alive: the view borrows it
ids = kvr.torch_tensor(ids_host)
g = torch.Generator(device=DEV)
g.manual_seed(0)


def r(*shape, lo=-1.0, hi=1.0, dt=torch.bfloat16):
    return (torch.rand(*shape, generator=g, device=DEV) * (hi - lo) + lo).to(dt)


q, k, v = r(B, 1, HK, D), r(B, 1, HK, D), r(B, 1, HV, D)
gg, beta = r(B, 1, HV, lo=-0.4, hi=-0.01, dt=torch.float32), r(B, 1, HV, lo=0.1, hi=0.9)
out = torch.empty(B, 1, HV, D, dtype=torch.bfloat16, device=DEV)
t = [kvr.torch_tensor(x) for x in (q, k, v, gg, beta, out)]
step = lib.gdn_step_params(scale=0.0, l2norm=True)
for _ in range(STEPS):
    lib.check(lib.gdn_step(False, p, 0, ids, t[0], t[1], t[2], t[3], t[4], None, t[5], step, cur_stream()), "step")
torch.cuda.synchronize()
print("ok", float(out.float().abs().max()))
