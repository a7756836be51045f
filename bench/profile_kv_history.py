"""The 4-8 GiB paging tax (issue 15) inside bench_kv_decode.py's own allocation history:
runs the `--targets` configurations that precede one configuration (same order, same
allocations and frees), then times that configuration's paged and contiguous decodes
(graph replay) and runs each once more between cudaProfilerStart / Stop, for

    ncu --profile-from-start off --clock-control none --metrics ... \
        python3 profile_kv_history.py [Llama|Qwen] B L

(the metrics of interest: DRAM bytes read against the data, per-partition DRAM sectors
max / avg for channel imbalance, L2 hit rate).
"""
import os
import sys

sys.argv.append("--targets")  # bench_kv_decode reads its mode from argv
import torch  # noqa: E402

import bench_kv_decode as b  # noqa: E402

shape, B, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shapes = [("Llama-3-8B", 32, 8, 128), ("Qwen2.5-7B", 28, 4, 128)]
target = next(s for s in shapes if s[0].startswith(shape))
configs = [(sh, bb, ll) for sh in shapes for bb in (1, 8) for ll in (1024, 4096, 16384, 65536)]
ceiling = b.read_ceiling()  # as the benchmark's main does first
res = {"matrix": [], "skipped": []}
history = os.environ.get("KVR_HISTORY", "1") == "1"
for sh, bb, ll in configs:
    if (sh, bb, ll) == (target, B, L):
        break
    if history:
        b.run_config(sh[0], sh[1], sh[2], sh[3], bb, ll, ceiling, res)
name, Hq, Hkv, D = target
# The target as run_config does it: data, reference, paged then contiguous pool, the SDPA
# peers run once, every implementation timed (eager and graph) in the same order.
kv_bytes = 2 * B * L * Hkv * D * 2
n_sets = min(64, max(1, -(-b.ROTATE_BYTES // kv_bytes)))
data = b.KvData(B, Hq, Hkv, D, [L] * B, n_sets)
ref = b.reference(data)
fns = {}
for kind, page in (("paged16", 16), ("contig", L)):
    pool, seqs = b.make_pool(data, page)
    fn, out = b.ours_fn(pool, data, seqs)
    fn(0)
    torch.cuda.synchronize()
    print(f"{kind}: err {b.rel_err(out, ref):.1e}", flush=True)
    fns[kind] = (fn, out, pool)
impls = {k: v[0] for k, v in fns.items()}
for label, be in (("cudnn", b.SDPBackend.CUDNN_ATTENTION), ("flash", b.SDPBackend.FLASH_ATTENTION)):
    f = b.sdpa_fn(data, be)
    f(0)
    impls[label] = f
torch.cuda.synchronize()
t, te = {}, {}
for label, f in impls.items():
    eager, graph = b.timing(f, n_sets, kv_bytes)
    t[label] = graph if graph is not None else eager
    te[label] = eager
print("eager: " + "  ".join(f"{k} {v:.1f} us" for k, v in te.items()) +
      f"  paged/contig {te['paged16'] / te['contig']:.3f}", flush=True)
print("graph: " + "  ".join(f"{k} {v:.1f} us" for k, v in t.items()) +
      f"  paged/contig {t['paged16'] / t['contig']:.3f}  paged/cudnn {t['paged16'] / t['cudnn']:.3f}", flush=True)
# Hypothesis: the slow first graph is not the layout but what torch.cuda.graph's entry does
# (torch.cuda.empty_cache(): cached blocks go back to the driver, which then works on that
# memory in the background). Free 8 GiB through the cache, then time contiguous first.
import time  # noqa: E402

for order in (("contig", "paged16"), ("paged16", "contig")):
    junk = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    junk.fill_(1)
    del junk
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    g = {k: b.time_graph(impls[k], n_sets, 5) for k in order}
    print(f"after freeing 8 GiB, {order[0]} first: " + "  ".join(f"{k} {v:.1f} us" for k, v in g.items()),
          flush=True)
    time.sleep(2)
    g = {k: b.time_graph(impls[k], n_sets, 5) for k in order}
    print(f"  2 s later: " + "  ".join(f"{k} {v:.1f} us" for k, v in g.items()), flush=True)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for kind in ("paged16", "contig"):
    fns[kind][0](0)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print(f"profiled {name} B={B} L={L}: K+V {kv_bytes / (1 << 20):.0f} MiB, paged then contiguous", flush=True)
