#!/usr/bin/env python3
"""Where the write-gated device step's time goes inside a layer's decode step (device H200):
the layer graph of bench_wgkv.py (q/k/v GEMV, step, 25 % decode at 32K, o / MLP GEMVs; B = 1)
replayed under torch.profiler (CUPTI), every kernel of one layer in the middle of the graph
with its start and end relative to the layer's first kernel, for each step kind: none, given
scores (no gate CTAs), the gate in every step (scores_out), deferred, given scores after a
deferred step (gate CTAs that score queues).

  cd gpu-bundle/scripts && KVR_LIB=$PWD/../lib/libkvreplay.so python3 profile_wgkv_layer.py [B]
"""
import sys

import torch
import torch.nn.functional as F

sys.argv = [sys.argv[0], "--step-only"] + sys.argv[1:]
import bench_wgkv as bw  # noqa: E402

B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
L = 32768
lib, T, HKV, D, DT, DEV = bw.lib, bw.T, bw.HKV, bw.D, bw.DT, bw.DEV


def main():
    torch.manual_seed(0)
    data = bw.Data(B, L)
    adm = bw.admissions(B, L, 0.25, seed=7)
    n = 8
    pool, seqs = bw.build_wgkv(data, adm, n, bw.APPEND_TOKENS)
    fn, _ = bw.decode_fn("wgkv", pool, data, seqs)
    lib.wgkv_set_gate(pool, [bw.random_gate(512)] * n, 512)
    for s in seqs:
        lib.wgkv_reserve(pool, s, 2000, bw.cur_stream())
    ids = torch.tensor(seqs, dtype=torch.int32)  # the descriptors point into these
    ids_t = T(ids)
    out = torch.empty(B, HKV, dtype=torch.float32, device=DEV)
    out_t = T(out)
    scores = (torch.rand(B, HKV, device=DEV) < 0.25).to(torch.float32)
    sc = T(scores)
    hid, ffn = 4096, 14336
    ws = [torch.randn(m, hid, dtype=DT, device=DEV) for m in (hid + 2 * HKV * D, hid, 2 * ffn)]
    wd = torch.randn(hid, ffn, dtype=DT, device=DEV)
    xa = torch.randn(B, hid, dtype=DT, device=DEV)

    def layer_with(kind):
        def f(i):
            qkv = F.linear(xa, ws[0])
            kt = T(qkv[:, hid:hid + HKV * D].view(B, HKV, D))
            vt = T(qkv[:, hid + HKV * D:].view(B, HKV, D))
            if kind == "now":
                lib.check(lib.wgkv_step(pool, i, ids_t, kt, vt, k_pre=kt, scores_out=out_t,
                                        stream=bw.cur_stream()), "step")
            elif kind == "deferred":
                lib.check(lib.wgkv_step(pool, i, ids_t, kt, vt, k_pre=kt, stream=bw.cur_stream()), "step")
            elif kind is not None:
                lib.check(lib.wgkv_step(pool, i, ids_t, kt, vt, scores=sc, stream=bw.cur_stream()), "step")
            fn(i)
            o = F.linear(xa, ws[1])
            gu = F.linear(xa, ws[2])
            return F.linear(gu[:, :ffn] * gu[:, ffn:], wd) + o[:, :1] + qkv[:, :1]
        return f

    for kind in ("none", "given", "now", "deferred", "given_after", "deferred"):
        f = layer_with(None if kind == "none" else kind)
        for i in range(n):
            f(i)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(16):
                for i in range(n):
                    f(i)
        g.replay()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        ev.sort(key=lambda e: e.time_range.start)
        per = len(ev) // (16 * n)
        print(f"--- {kind}: {len(ev)} kernels, {per} a layer; graph {(ev[-1].time_range.end - ev[0].time_range.start) / (16 * n):.1f} us a layer")
        # Layers 40..43 (the steps of a queue cycle differ): name, start, end (us from the layer's first kernel)
        for li in range(40, 44):
            chunk = ev[li * per:(li + 1) * per]
            t0 = chunk[0].time_range.start
            row = "  ".join(f"{c.name[:18]}:{c.time_range.start - t0:.1f}-{c.time_range.end - t0:.1f}" for c in chunk)
            print(f"  L{li}: {row}  | next {ev[(li + 1) * per].time_range.start - t0:.1f}")
        del g


if __name__ == "__main__":
    main()
