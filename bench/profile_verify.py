"""Eager speculative rounds (verify T drafts + commit of T/2) on one replay pool, for Nsight
Compute: `ncu --clock-control none -k regex:verify -s 40 -c 1 python3 profile_verify.py B T [v|k] [ring]`
(ring length: default 64).
The pool starts from zero states (the kernel's cost does not depend on the values)."""

import sys

sys.argv += [] if "--layout" in sys.argv else ["--layout", sys.argv[3] if len(sys.argv) > 3 else "v"]
import torch  # noqa: E402

import bench_gdn as bg  # noqa: E402

B, T = int(sys.argv[1]), int(sys.argv[2])
inp = bg.Inputs(B, T, 1, seed=7)
p, seqs = bg.pool(B, int(sys.argv[4]) if len(sys.argv) > 4 else 64, 1, drafts=8)
v = bg.Ours(p, seqs, inp, verify=True)
c = bg.Commit(p, seqs, max(1, T // 2))
for _ in range(60):
    v(0)
    c(0)
torch.cuda.synchronize()
print("done")
