"""Decode A/B (issue 15): this build of the library against a second one loaded in the same
process (KVR_LIB_BASE, e.g. the previous kernel), with torch SDPA cuDNN on the same data, under
CUDA Graph replay; B = 1..8 shapes where the fixed cost shows.

    python3 kv_diag.py            # small-batch points
    python3 kv_diag.py --tlb      # also: an 8 GiB pool, paged vs contiguous in both allocation
                                  # orders, and paged pools filled in runs of 256 / 4096 tokens

Stage-skip variants (return after the partition, no tile math, no cross-CTA merge) were
measured with a diagnostic build that read them from the launch parameters; see BENCHMARKS.md.
"""

import math
import os
import sys

import torch
from torch.nn.attention import SDPBackend

import bench_kv_decode as b
import kvr
from benchutil import cur_stream

rows = []


def use(lib, ctx):
    b.lib, b.ctx = lib, ctx


def ours_params(lib, pool, data, seqs, max_ctas):
    ids = torch.tensor(seqs, dtype=torch.int32)
    ids_t = kvr.torch_tensor(ids)
    out = torch.empty(data.B, data.Hq, data.D, dtype=torch.bfloat16, device=b.DEV)
    q_t = [kvr.torch_tensor(q) for q in data.q]
    o_t = kvr.torch_tensor(out)
    prm = lib.decode_params(max_ctas=max_ctas)

    def fn(i):
        lib.check(lib.decode(pool, i, ids_t, q_t[i], o_t, None, prm, cur_stream()), "decode")

    fn.keep = (ids, out, prm)
    return fn


def t_graph(fn, n_sets):
    eager, graph = b.timing(fn, n_sets, 0)
    return graph if graph is not None else eager


def run(name, Hq, Hkv, B, L, libs):
    kv_bytes = 2 * B * L * Hkv * 128 * 2
    n_sets = min(64, max(1, math.ceil(b.ROTATE_BYTES / kv_bytes)))
    data = b.KvData(B, Hq, Hkv, 128, [L] * B, n_sets)
    ref = b.reference(data)
    tag = f"{name} B={B} L={L // 1024}K"
    cud = t_graph(b.sdpa_fn(data, SDPBackend.CUDNN_ATTENTION), n_sets)
    rows.append((tag, "cudnn", "", cud))
    for lname, lib, ctx in libs:
        use(lib, ctx)
        pool, seqs = b.make_pool(data, 16)
        fn, out = b.ours_fn(pool, data, seqs)
        fn(0)
        torch.cuda.synchronize()
        err = b.rel_err(out, ref)
        rows.append((tag, lname, f"err {err:.1e}", t_graph(fn, n_sets)))
        lib.lib.kvr_kv_pool_free(pool)
        del fn, out
        torch.cuda.synchronize()
    print("\n".join(f"{r[0]:24s} {r[1]:6s} {r[2]:28s} {r[3]:8.1f}" for r in rows[-3:]), flush=True)
    del data
    torch.cuda.empty_cache()


def tlb(lib, ctx):
    use(lib, ctx)
    Hq, Hkv, B, L = 32, 8, 128, 16384
    data = b.KvData(B, Hq, Hkv, 128, [L] * B, 1)
    tag = "Llama B=128 L=16K"
    rows.append((tag, "cudnn", "", t_graph(b.sdpa_fn(data, SDPBackend.CUDNN_ATTENTION), 1)))
    # Both pools alive, as in bench_kv_decode.py, in both allocation orders.
    for order in (("paged", "contig"), ("contig", "paged")):
        made = []
        for kind in order:
            page = 16 if kind == "paged" else L
            pool = lib.pool(ctx, 1, Hkv, 128, page, kvr.DTYPE_BF16, B * L // page, B, L)
            seqs = [lib.seq_add(pool, cur_stream()) for _ in range(B)]
            b.fill_pool(pool, data, seqs, 256 if kind == "paged" else L)
            made.append((kind, pool, seqs))
        for kind, pool, seqs in made:
            fn, out = b.ours_fn(pool, data, seqs)
            rows.append((tag, "new", f"{kind} (order {order[0]} first)", t_graph(fn, 1)))
            del fn, out
        for _, pool, _ in made:
            lib.lib.kvr_kv_pool_free(pool)
        torch.cuda.synchronize()
    for chunk in (256, 4096, L):
        page = 16 if chunk < L else L
        pages = B * L // page
        pool = lib.pool(ctx, 1, Hkv, 128, page, kvr.DTYPE_BF16, pages, B, L)
        seqs = [lib.seq_add(pool, cur_stream()) for _ in range(B)]
        b.fill_pool(pool, data, seqs, chunk)
        fn, out = b.ours_fn(pool, data, seqs)
        rows.append((tag, "new", f"page {page} fill chunk {chunk}", t_graph(fn, 1)))
        lib.lib.kvr_kv_pool_free(pool)
        del fn, out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print("\n".join(f"{r[0]:24s} {r[1]:6s} {r[2]:28s} {r[3]:8.1f}" for r in rows[-8:]), flush=True)


def main():
    torch.manual_seed(0)
    libs = [("new", b.lib, b.ctx)]
    base = os.environ.get("KVR_LIB_BASE")
    if base:
        lb = kvr.Lib(base)
        libs.append(("base", lb, lb.context(kvr.BACKEND_CUDA, stream=cur_stream())))
    run("Llama", 32, 8, 1, 1024, libs)
    run("Qwen", 28, 4, 1, 1024, libs)
    run("Llama", 32, 8, 1, 16384, libs)
    run("Qwen", 28, 4, 8, 4096, libs)
    run("Qwen", 28, 4, 1, 65536, libs)
    run("Llama", 32, 8, 8, 16384, libs)
    run("Llama", 32, 8, 1, 65536, libs)
    run("Qwen", 28, 4, 8, 1024, libs)
    if "--tlb" in sys.argv:
        tlb(b.lib, b.ctx)
    print("\nconfig                   impl   variant                      us")
    print("\n".join(f"{r[0]:24s} {r[1]:6s} {r[2]:28s} {r[3]:8.1f}" for r in rows))


if __name__ == "__main__":
    main()
