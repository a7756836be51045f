"""Paged KV decode benchmark (issue 3), one process, one run, on the device GPU.

Compares, on the same data: kvreplay paged (page 16), kvreplay over a contiguous layout
(the same kernel, page = context), and torch SDPA with its cuDNN and flash backends
(contiguous bf16 [B, Hkv, L, D], enable_gqa=True). Layer shapes: Llama-3-8B (32 q heads,
8 KV heads, d 128) and Qwen2.5-7B (28/4/128); B in {1, 8, 32, 64, 128} x L in {1K, 4K, 16K,
64K} (configs over the memory cap are skipped and listed); a page-size sweep; a skewed
batch; and a capacity table. Bandwidth counts the K and V bytes each call must read, against
a read-only streaming ceiling measured in the same run (torch.sum over 2 GiB).

Method (BENCHMARKS.md): outputs checked against SDPA before timing; inputs rotate over
sets larger than 4x L2 (cold cache); warm-up, then the median of many calls; times are taken
both per call with CUDA events ("eager") and under CUDA Graph replay ("graph", the headline
number: no host launch overhead).

    python3 bench_kv_decode.py [--quick]      # writes $OUT/kv_bench.json if $OUT is set
    python3 bench_kv_decode.py --targets      # issue 15's set: B = 1, 8 at every context,
        # the >= 512 MiB points up to 8 GiB, the page sweep; also writes $OUT/h200-kv.json,
        # the flat summary (worst ratios against cuDNN and the contiguous layout)
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvr

QUICK = "--quick" in sys.argv
TARGETS = "--targets" in sys.argv
DEV = torch.device("cuda")
L2_BYTES = torch.cuda.get_device_properties(0).L2_cache_size
ROTATE_BYTES = 4 * L2_BYTES
KV_CAP = 8 << 30  # bytes of K+V per implementation

from benchutil import GIB, cur_stream, median, read_ceiling, time_eager, time_graph  # noqa: E402,F401

lib = kvr.Lib()
ctx = lib.context(kvr.BACKEND_CUDA, stream=cur_stream())


class KvData:
    """n_sets copies of random bf16 K/V [B, Hkv, L, D] plus queries [B, Hq, D]."""

    def __init__(self, B, Hq, Hkv, D, lens, n_sets):
        self.B, self.Hq, self.Hkv, self.D, self.lens, self.n_sets = B, Hq, Hkv, D, lens, n_sets
        Lmax = max(lens)
        self.K = [torch.randn(B, Hkv, Lmax, D, dtype=torch.bfloat16, device=DEV) for _ in range(n_sets)]
        self.V = [torch.randn(B, Hkv, Lmax, D, dtype=torch.bfloat16, device=DEV) for _ in range(n_sets)]
        self.q = [torch.randn(B, Hq, D, dtype=torch.bfloat16, device=DEV) for _ in range(n_sets)]


def fill_pool(pool, data, seqs, chunk):
    """Grows every sequence by `chunk` tokens per round (pages interleave across sequences)
    and writes each set into its own layer."""
    B = data.B
    Lmax = max(data.lens)
    for t0 in range(0, Lmax, chunk):
        grow = [max(0, min(chunk, n - t0)) for n in data.lens]
        live = [(s, g) for s, g in zip(seqs, grow) if g > 0]
        ss, gg = [s for s, _ in live], [g for _, g in live]
        lib.check(lib.extend(pool, ss, gg, cur_stream()), "extend")
        uniform = all(g == grow[0] for g in grow)
        for layer in range(data.n_sets):
            if uniform:
                c = grow[0]
                k = data.K[layer][:, :, t0:t0 + c, :].transpose(1, 2).reshape(B * c, data.Hkv, data.D)
                v = data.V[layer][:, :, t0:t0 + c, :].transpose(1, 2).reshape(B * c, data.Hkv, data.D)
            else:
                parts_k, parts_v = [], []
                for b in range(B):
                    if grow[b] > 0:
                        parts_k.append(data.K[layer][b, :, t0:t0 + grow[b], :].transpose(0, 1))
                        parts_v.append(data.V[layer][b, :, t0:t0 + grow[b], :].transpose(0, 1))
                k = torch.cat(parts_k).contiguous()
                v = torch.cat(parts_v).contiguous()
            lib.write(pool, layer, ss, gg, kvr.torch_tensor(k), kvr.torch_tensor(v), cur_stream())
            del k, v
    torch.cuda.synchronize()


def make_pool(data, page):
    Lmax = max(data.lens)
    pages = sum(math.ceil(n / page) for n in data.lens) if page < Lmax else data.B
    pool = lib.pool(ctx, data.n_sets, data.Hkv, data.D, page, kvr.DTYPE_BF16, pages, data.B, Lmax)
    seqs = [lib.seq_add(pool, cur_stream()) for _ in range(data.B)]
    fill_pool(pool, data, seqs, max(page, 256) if page < Lmax else Lmax)
    return pool, seqs


def ours_fn(pool, data, seqs):
    ids = torch.tensor(seqs, dtype=torch.int32)  # host: travels in the launch parameters
    ids_t = kvr.torch_tensor(ids)
    out = torch.empty(data.B, data.Hq, data.D, dtype=torch.bfloat16, device=DEV)
    q_t = [kvr.torch_tensor(q) for q in data.q]
    o_t = kvr.torch_tensor(out)

    def fn(i):
        r = lib.decode(pool, i, ids_t, q_t[i], o_t, None, None, cur_stream())
        if r != 0:
            lib.check(r, "decode")

    fn.keep = (ids, out)  # the descriptors point into these tensors
    return fn, out


def sdpa_fn(data, backend):
    qs = [q.unsqueeze(2) for q in data.q]

    def fn(i):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qs[i], data.K[i], data.V[i], enable_gqa=True)

    return fn


REF_ROWS = 4  # batch rows checked against the fp32 reference (all outputs of those rows)


def reference(data, i=0):
    r = min(REF_ROWS, data.B)
    q = data.q[i][:r].unsqueeze(2).float()
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, data.K[i][:r].float(), data.V[i][:r].float(), enable_gqa=True).squeeze(2)


def rel_err(out, ref):
    out = out[: ref.shape[0]]
    return float((out.float() - ref).abs().max() / ref.abs().max())


def timing(fn, n_sets, kv_bytes):
    iters = 30 if QUICK else 60
    eager = time_eager(fn, n_sets, iters)
    calls = max(n_sets, min(200, int(math.ceil(2000.0 / max(eager, 1.0)))))
    calls = int(math.ceil(calls / n_sets) * n_sets)
    graph = time_graph(fn, n_sets, calls)
    return eager, graph


def run_config(name, Hq, Hkv, D, B, L, ceiling, results):
    kv_bytes = 2 * B * L * Hkv * D * 2
    tag = f"{name} B={B} L={L // 1024}K"
    if kv_bytes > KV_CAP:
        results["skipped"].append(f"{tag}: {kv_bytes / GIB:.0f} GiB of K+V over the {KV_CAP // GIB} GiB cap")
        return
    n_sets = min(64, max(1, math.ceil(ROTATE_BYTES / kv_bytes)))
    data = KvData(B, Hq, Hkv, D, [L] * B, n_sets)
    ref = reference(data)
    row = {"config": tag, "B": B, "L": L, "kv_mib": kv_bytes / (1 << 20), "sets": n_sets,
           "floor_us": kv_bytes / (ceiling * 1e12) * 1e6}
    impls = {}
    # KVR_BENCH_CONTIG_FIRST=1 creates the contiguous pool before the paged one (the first
    # multi-GiB allocation after the data can get slower memory: BENCHMARKS.md, issue 15).
    contig_first = os.environ.get("KVR_BENCH_CONTIG_FIRST") == "1"
    for kind in ("contig", "paged16") if contig_first else ("paged16", "contig"):
        pool, seqs = make_pool(data, 16 if kind == "paged16" else L)
        fn, out = ours_fn(pool, data, seqs)
        fn(0)
        torch.cuda.synchronize()
        row["err_paged" if kind == "paged16" else "err_contig"] = rel_err(out, ref)
        impls[kind] = fn
        if kind == "paged16":
            pool_p = pool
        else:
            pool_c = pool
    impls = {k: impls[k] for k in ("paged16", "contig")}
    for label, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        f = sdpa_fn(data, be)
        try:
            o = f(0)
            torch.cuda.synchronize()
            row[f"err_{label}"] = rel_err(o.squeeze(2), ref)
            impls[label] = f
        except Exception as e:  # noqa: BLE001
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    for label, f in impls.items():
        eager, graph = timing(f, n_sets, kv_bytes)
        row[f"{label}_eager_us"] = eager
        row[f"{label}_graph_us"] = graph
        best = graph if graph is not None else eager
        row[f"{label}_us"] = best
        row[f"{label}_tbs"] = kv_bytes / (best * 1e-6) / 1e12
    lib.lib.kvr_kv_pool_free(pool_p)
    lib.lib.kvr_kv_pool_free(pool_c)
    del data, impls, fn, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    results["matrix"].append(row)
    print(
        f"{tag:26s} {row['kv_mib']:8.0f} MiB  paged {row['paged16_us']:8.1f} us "
        f"({row['paged16_tbs']:.2f} TB/s)  contig {row['contig_us']:8.1f}  "
        f"cudnn {row.get('cudnn_us', float('nan')):8.1f}  flash {row.get('flash_us', float('nan')):8.1f}  "
        f"err {row['err_paged']:.1e}",
        flush=True,
    )


def page_sweep(ceiling, results):
    Hq, Hkv, D, B, L = 32, 8, 128, 32, 8192
    kv_bytes = 2 * B * L * Hkv * D * 2
    n_sets = max(1, math.ceil(ROTATE_BYTES / kv_bytes))
    data = KvData(B, Hq, Hkv, D, [L] * B, n_sets)
    ref = reference(data)
    for page in [1, 2, 4, 8, 16, 32, 64, 128, L]:
        pool, seqs = make_pool(data, page)
        fn, out = ours_fn(pool, data, seqs)
        fn(0)
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        eager, graph = timing(fn, n_sets, kv_bytes)
        best = graph if graph is not None else eager
        results["page_sweep"].append({"page": page if page < L else "contiguous", "us": best,
                                      "tbs": kv_bytes / (best * 1e-6) / 1e12, "err": err})
        print(f"page {page if page < L else 'contig':>6}: {best:8.1f} us {kv_bytes / (best * 1e-6) / 1e12:.2f} TB/s err {err:.1e}", flush=True)
        lib.lib.kvr_kv_pool_free(pool)
        del fn, out
        torch.cuda.empty_cache()
    del data
    torch.cuda.empty_cache()


def skewed(ceiling, results):
    Hq, Hkv, D = 32, 8, 128
    for label, lens in (("skewed 1x64K + 63x1K", [65536] + [1024] * 63), ("uniform 64x2K", [2048] * 64)):
        B = len(lens)
        kv_bytes = 2 * sum(lens) * Hkv * D * 2
        n_sets = max(1, math.ceil(ROTATE_BYTES / kv_bytes))
        data = KvData(B, Hq, Hkv, D, lens, n_sets)
        pool, seqs = make_pool(data, 16)
        fn, out = ours_fn(pool, data, seqs)
        fn(0)
        torch.cuda.synchronize()
        # Reference per sequence (lengths differ).
        err = 0.0
        for b in range(B):
            n = lens[b]
            q = data.q[0][b:b + 1].unsqueeze(2).float()
            r = F.scaled_dot_product_attention(q, data.K[0][b:b + 1, :, :n].float(), data.V[0][b:b + 1, :, :n].float(), enable_gqa=True)
            err = max(err, rel_err(out[b:b + 1], r.squeeze(2)))
        eager, graph = timing(fn, n_sets, kv_bytes)
        best = graph if graph is not None else eager
        results["skewed"].append({"batch": label, "kv_mib": kv_bytes / (1 << 20), "us": best,
                                  "tbs": kv_bytes / (best * 1e-6) / 1e12, "err": err})
        print(f"{label:24s} {kv_bytes / (1 << 20):7.0f} MiB {best:8.1f} us {kv_bytes / (best * 1e-6) / 1e12:.2f} TB/s err {err:.1e}", flush=True)
        lib.lib.kvr_kv_pool_free(pool)
        del data, fn, out
        torch.cuda.empty_cache()


def capacity(results):
    """Sequences that fit a 4 GiB K/V budget: paged (page 16, admitted until the pool says
    LATER, lengths uniform in 1..4096 so the mean is 25 % of an 8K context) vs a contiguous
    reservation of 8K tokens each."""
    import random

    rnd = random.Random(7)
    for label, layers in (("Llama-3-8B, one layer", 1), ("Llama-3-8B, 32 layers", 32)):
        bpt = 2 * layers * 8 * 128 * 2
        budget = 4 * GIB
        contiguous = budget // (bpt * 8192)
        pool = lib.pool(ctx, layers, 8, 128, 16, kvr.DTYPE_BF16, 0, 4096, 8192, capacity_bytes=budget)
        n, tokens = 0, 0
        while True:
            want = rnd.randint(1, 4096)
            if lib.admit(pool, -1, want) != kvr.ADMIT_OK:
                break
            s = lib.seq_add(pool, cur_stream())
            lib.check(lib.extend(pool, [s], [want], cur_stream()), "extend")
            n, tokens = n + 1, tokens + want
        st = lib.stats(pool)
        results["capacity"].append({"budget": "4 GiB", "model": label, "contiguous_8k": contiguous,
                                    "paged": n, "ratio": n / max(1, contiguous),
                                    "mean_len": tokens / max(1, n), "waste_slots": st.waste_slots,
                                    "pages_used": st.pages_used, "pages_total": st.pages_total})
        print(f"capacity {label}: contiguous {contiguous}, paged {n} ({n / max(1, contiguous):.1f}x), mean length {tokens / max(1, n):.0f}", flush=True)
        lib.lib.kvr_kv_pool_free(pool)
        torch.cuda.synchronize()


def stage_sweep(ceiling):
    """Decode time per ring depth (KVR_DECODE_STAGES), for tuning."""
    for stages in (1, 2, 3, 4, 6):
        os.environ["KVR_DECODE_STAGES"] = str(stages)
        res = {"matrix": [], "skipped": []}
        for B, L in ((32, 16384), (32, 4096), (1, 16384)):
            run_config(f"stages={stages} Llama-3-8B", 32, 8, 128, B, L, ceiling, res)
    os.environ.pop("KVR_DECODE_STAGES", None)


def main():
    torch.manual_seed(0)
    if "--stages" in sys.argv:
        stage_sweep(read_ceiling())
        return
    props = torch.cuda.get_device_properties(0)
    results = {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": L2_BYTES,
               "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
               "kvreplay": lib.lib.kvr_library_version().decode(), "matrix": [], "skipped": [],
               "page_sweep": [], "skewed": [], "capacity": []}
    ceiling = read_ceiling()
    results["read_ceiling_tbs"] = ceiling
    print(f"{props.name}: read ceiling {ceiling:.3f} TB/s (torch.sum over 2 GiB)", flush=True)
    shapes = [("Llama-3-8B", 32, 8, 128), ("Qwen2.5-7B", 28, 4, 128)]
    Bs = [1, 8, 32, 64, 128]
    Ls = [1024, 4096, 16384, 65536]
    if QUICK:
        Bs, Ls = [1, 32], [4096, 16384]
    configs = [(sh, B, L) for sh in shapes for B in Bs for L in Ls]
    if TARGETS:
        large = {"Llama-3-8B": [(32, 4096), (32, 16384), (32, 65536), (128, 4096), (128, 16384)],
                 "Qwen2.5-7B": [(32, 16384), (32, 65536), (64, 65536), (128, 4096)]}
        configs = [(sh, B, L) for sh in shapes for B in (1, 8) for L in Ls]
        configs += [(sh, B, L) for sh in shapes for B, L in large[sh[0]]]
    out = os.environ.get("OUT")

    def save():
        if out:
            with open(os.path.join(out, "kv_bench.json"), "w") as f:
                json.dump(results, f, indent=1)

    t0 = time.time()
    for (name, Hq, Hkv, D), B, L in configs:
        run_config(name, Hq, Hkv, D, B, L, ceiling, results)
        save()
    page_sweep(ceiling, results)
    if not TARGETS:
        skewed(ceiling, results)
        capacity(results)
    results["seconds"] = time.time() - t0
    results["summary"] = summary(results)
    save()
    if out and TARGETS:
        with open(os.path.join(out, "h200-kv.json"), "w") as f:
            json.dump(results["summary"], f, indent=1)
    # Short table.
    print("\nconfig                      MiB   floor   paged  contig   cudnn   flash  paged/cudnn paged/contig  TB/s")
    for r in results["matrix"]:
        cud = r.get("cudnn_us")
        print(f"{r['config']:26s} {r['kv_mib']:6.0f} {r['floor_us']:7.1f} {r['paged16_us']:7.1f} {r['contig_us']:7.1f} "
              f"{cud if cud else float('nan'):7.1f} {r.get('flash_us', float('nan')):7.1f} "
              f"{(r['paged16_us'] / cud) if cud else float('nan'):11.3f} {r['paged16_us'] / r['contig_us']:12.3f} {r['paged16_tbs']:5.2f}")
    for s in results["skipped"]:
        print("skipped:", s)
    print("summary:", json.dumps(results["summary"]))


def summary(results):
    """The flat numbers of issue 15: worst paged / cuDNN at B <= 8 and at >= 512 MiB, worst
    paged / contiguous, page 1 as a fraction of contiguous, B=1 L=16K Llama-3-8B time."""
    m = [r for r in results["matrix"] if r.get("cudnn_us")]
    sm = {}
    small = [r["paged16_us"] / r["cudnn_us"] for r in m if r["B"] <= 8]
    large = [r["paged16_us"] / r["cudnn_us"] for r in m if r["kv_mib"] >= 512]
    if small:
        sm["kv_paged_vs_cudnn_max_b1_8"] = round(max(small), 3)
    if large:
        sm["kv_paged_vs_cudnn_max_ge512mib"] = round(max(large), 3)
    if results["matrix"]:
        sm["kv_paging_tax_max"] = round(max(r["paged16_us"] / r["contig_us"] for r in results["matrix"]), 3)
    ps = {p["page"]: p["us"] for p in results["page_sweep"]}
    if 1 in ps and "contiguous" in ps:
        sm["kv_page1_vs_contig"] = round(ps["contiguous"] / ps[1], 3)
    for r in results["matrix"]:
        if r["config"] == "Llama-3-8B B=1 L=16K":
            sm["kv_b1_l16k_llama_us"] = round(r["paged16_us"], 1)
    return sm


if __name__ == "__main__":
    main()
