"""Diagnostic (issue 15): paged decode against cuDNN at the >= 512 MiB points where they
differ by 1-3 %, inside one process, with graphs of several lengths and each decode kernel
forced. Usage: python3 kv_gap.py   (KVR_LIB as for bench_kv_decode.py)"""
import os
import sys

sys.argv.append("--quick")
import bench_kv_decode as kb  # noqa: E402
from benchutil import time_graph  # noqa: E402
import torch  # noqa: E402

CONFIGS = [("Llama-3-8B", 32, 8, 32, 4096), ("Llama-3-8B", 32, 8, 32, 16384),
           ("Qwen2.5-7B", 28, 4, 32, 16384), ("Llama-3-8B", 32, 8, 128, 4096)]
for name, hq, hkv, B, L in CONFIGS:
    data = kb.KvData(B, hq, hkv, 128, [L] * B, 1)
    fns = {}
    pools = []
    for k in ("auto", "batch", "split", "stream"):
        os.environ["KVR_KV_DECODE"] = k
        pool, seqs = kb.make_pool(data, 16)
        pools.append(pool)
        fn, _ = kb.ours_fn(pool, data, seqs)
        fns[k] = fn
    os.environ.pop("KVR_KV_DECODE")
    fns["cudnn"] = kb.sdpa_fn(data, kb.SDPBackend.CUDNN_ATTENTION)
    line = f"{name} B={B} L={L // 1024}K"
    for calls in (5, 40):
        res = {k: time_graph(f, 1, calls) for k, f in fns.items()}
        res2 = {k: time_graph(f, 1, calls) for k, f in reversed(list(fns.items()))}
        line += f" | calls {calls}: " + " ".join(
            f"{k} {min(res[k], res2[k]):.1f}" for k in fns) + f" (auto/cudnn {min(res['auto'], res2['auto']) / min(res['cudnn'], res2['cudnn']):.3f})"
    print(line, flush=True)
    for p in pools:
        kb.lib.lib.kvr_kv_pool_free(p)
    del data, fns
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
