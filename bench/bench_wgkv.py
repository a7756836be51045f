"""Write-gated KV decode benchmark (issue 11), one process, one run, on the device GPU.

Llama-3.1-8B layer shape (32 q heads, 8 KV heads, d 128), bf16 K/V/q, page 16, ring W = 256
(the default), tau = 0.1. For each context (32K, 64K, 128K, 256K at B = 1; 32K and 128K at
B = 8) the same K/V go into:

- the full paged cache (`kvr_kv_pool`, page 16; the baseline, same run), and
- write-gated pools (`kvr_wgkv_pool`) at admission rates 100 / 50 / 25 / 10 %: precomputed
  host scores per (token, KV head), 1 with probability `rate` and 0 otherwise (tau 0.1 is
  strict, so 1 is kept and 0 dropped; 100 % keeps every token), prefilled through
  `kvr_wgkv_pool_append` in chunks of 32K tokens. Each head keeps the last W tokens (ring)
  plus about `rate` of the older ones.

Both decode the same queries (one token per sequence). Method as BENCHMARKS.md: every pool
is built, its row counts checked against the scores (`kvr_wgkv_pool_get_seq_rows`), one
output per config compared with an fp32 torch reference over exactly the kept tokens (fails
loudly above 2e-2 max relative error), then timed under CUDA Graph replay (median of 7
replays of many calls), inputs rotating over sets (pool layers) larger than 4x L2. Bytes
read = K + V of the tokens each call attends to (kept tokens incl. the ring for the
write-gated pool); TB/s on those bytes; bw % = write-gated TB/s / full-cache TB/s;
speedup = full / write-gated time; memory ratio = write-gated pages used / the pages a full
paged cache of the same page size holds (`kvr_wgkv_pool_get_stats`).

Gate + append at 32K (25 %): one decode step's append (1 new token per sequence, layer 0)
as a fraction of the 32K decode. The headline is the device step (`kvr_wgkv_pool_reserve`
then `kvr_wgkv_pool_step`: the gate MLP (hidden 512) on the device from k_pre and k, fused
with the ring update, one launch) under CUDA graph replay, checked afterwards to have run
every step; alone (a graph of steps over the layers), and inside a layer's decode step:
graphs of whole layers (Llama-3.1-8B's weight GEMVs in an engine's order, the step fed by
the q/k/v projection's output, the 25 % decode) with and without the step, passes
alternated, the step's cost = the difference of the medians. For comparison, host-planned
appends (`kvr_wgkv_pool_append`, CUDA events around each call: host planning + launches +
kernels) with precomputed host scores, the
library's CPU gate (host k_pre/K/V), and a torch gate on the device with the scores copied
to the host.

    python3 bench_wgkv.py [--quick | --step-only]   # writes $OUT/wgkv_bench.json and $OUT/h200-wgkv.json
                                        # (--step-only: the two 32K contexts, B = 1 and 8)
    python3 bench_wgkv.py --cpu         # smoke run of this script on the CPU backend (tiny
                                        # shapes, no timing worth reading; KVR_LIB=... to pick)
"""

import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import kvr
from benchutil import GIB, median, read_ceiling, time_eager, time_graph

CPU = "--cpu" in sys.argv
QUICK = "--quick" in sys.argv
TOL = 2e-2  # max relative error (bf16 K/V/q/out against fp32)

if CPU:
    DEV = torch.device("cpu")
    DT, KV_DT, ELEM = torch.float32, kvr.DTYPE_F32, 4
    HQ, HKV, D, PAGE, W, TAU = 8, 2, 64, 16, 32, 0.1
    CONFIGS = [(1, 300), (1, 1000), (2, 300), (2, 1000)]
    APPEND_AT = 300  # the context of the append measurement
    CHUNK = 128  # prefill tokens per append call
    FULL_ROUND = 64  # tokens per sequence per extend round of the full cache
    ROTATE_BYTES = 256 << 10
    GATE_HIDDEN = 16
    N_WARM, N_MEAS, N_CPU_GATE, N_TORCH_GATE = 2, 5, 3, 3
else:
    DEV = torch.device("cuda")
    DT, KV_DT, ELEM = torch.bfloat16, kvr.DTYPE_BF16, 2  # K/V/q/out
    HQ, HKV, D, PAGE, W, TAU = 32, 8, 128, 16, 256, 0.1
    K32, K64, K128, K256 = 32768, 65536, 131072, 262144
    # Headline configs first (a partial run still has the keys).
    CONFIGS = [(1, K32), (1, K128), (1, K64), (1, K256), (8, K32), (8, K128)]
    if QUICK:
        CONFIGS = [(1, K32), (1, K128)]
    if "--step-only" in sys.argv:  # the 32K contexts of the append / device-step measurement
        CONFIGS = [(1, K32), (8, K32)]
    APPEND_AT = K32
    CHUNK = 32768
    FULL_ROUND = 1024
    ROTATE_BYTES = 4 * torch.cuda.get_device_properties(0).L2_cache_size
    GATE_HIDDEN = 512  # Llama-3.1-8B's WG-KV gate
    N_WARM, N_MEAS, N_CPU_GATE, N_TORCH_GATE = 20, 200, 30, 100
G = HQ // HKV
RATES = [1.0, 0.5, 0.25, 0.1]
MAX_SETS = 64
MEM_CAP = 100 * GIB  # device bytes one context may use (data + full cache + largest pool)
APPEND_TOKENS = 4096  # room left in the 25 % pools for the append and device-step measurements

lib = kvr.Lib()
if CPU:
    ctx = lib.context(kvr.BACKEND_CPU, threads=2)

    def cur_stream():
        return None

    def sync():
        pass
else:
    from benchutil import cur_stream

    ctx = lib.context(kvr.BACKEND_CUDA, stream=cur_stream())

    def sync():
        torch.cuda.synchronize()


FAILURES = []


def fail(msg):
    print(f"!!! FAILED: {msg}", flush=True)
    FAILURES.append(msg)


def n_sets_for(nbytes):
    return int(min(MAX_SETS, max(1, math.ceil(ROTATE_BYTES / max(1, nbytes)))))


def T(x):
    return kvr.torch_tensor(x)


class Data:
    """Random K/V [B, L, HKV, D] and MAX_SETS query sets [B, HQ, D] (bf16, on DEV)."""

    def __init__(self, B, L):
        self.B, self.L = B, L
        self.K = torch.randn(B, L, HKV, D, dtype=DT, device=DEV)
        self.V = torch.randn(B, L, HKV, D, dtype=DT, device=DEV)
        self.qs = torch.randn(MAX_SETS, B, HQ, D, dtype=DT, device=DEV)


def attention_ref(q, k, v):
    """fp32 dense attention: q [G, D], k / v [n, D] -> [G, D]."""
    q, k, v = q.float(), k.float(), v.float()
    p = torch.softmax((q @ k.T) / math.sqrt(D), dim=-1)
    return p @ v


def check_output(out, keep, q, K, V):
    """Max relative error of `out` [B, HQ, D] against attention of q [B, HQ, D] over the kept
    tokens (keep: host bool [B, n, HKV], or None for every token) of K / V [B, n, HKV, D]."""
    worst, scale = 0.0, 0.0
    for b in range(K.shape[0]):
        for h in range(HKV):
            kh, vh = K[b, :, h], V[b, :, h]
            if keep is not None:
                m = keep[b, :, h].to(DEV)
                kh, vh = kh[m], vh[m]
            ref = attention_ref(q[b, h * G:(h + 1) * G], kh, vh)
            got = out[b, h * G:(h + 1) * G].float()
            worst = max(worst, float((got - ref).abs().max()))
            scale = max(scale, float(ref.abs().max()))
    err = worst / max(scale, 1e-30)
    return err if math.isfinite(err) else float("inf")


def decode_fn(kind, pool, data, seqs):
    """fn(i): one decode of set i (pool layer i, query set i) into `out`."""
    ids = torch.tensor(seqs, dtype=torch.int32)  # host: travels in the launch parameters
    ids_t = T(ids)
    out = torch.empty(data.B, HQ, D, dtype=DT, device=DEV)
    o_t = T(out)
    q_t = [T(data.qs[i]) for i in range(MAX_SETS)]
    call = lib.decode if kind == "full" else lib.wgkv_decode

    def fn(i):
        r = call(pool, i, ids_t, q_t[i], o_t, None, None, cur_stream())
        if r != 0:
            lib.check(r, f"{kind} decode")

    fn.keep = (ids, out, q_t)  # the descriptors point into these
    return fn, out


def timing(fn, n_sets):
    """(eager us, graph us or None)."""
    if CPU:
        ts = []
        for i in range(3):
            t0 = time.perf_counter()
            fn(i % n_sets)
            ts.append((time.perf_counter() - t0) * 1e6)
        return median(ts), None
    iters = 30 if QUICK else 60
    eager = time_eager(fn, n_sets, iters)
    calls = max(n_sets, min(200, int(math.ceil(2000.0 / max(eager, 1.0)))))
    calls = int(math.ceil(calls / n_sets) * n_sets)
    return eager, time_graph(fn, n_sets, calls)


def checked_time(kind, pool, data, seqs, keep, n_sets, what):
    """Checks one decode of `pool` against attention over `keep` (None: every token), then
    times it: (µs per call under graph replay when it captured, else eager; eager µs; max
    relative error; the decode function and its output)."""
    fn, out = decode_fn(kind, pool, data, seqs)
    fn(0)
    sync()
    err = check_output(out, keep, data.qs[0], data.K, data.V)
    if not err <= TOL:
        fail(f"{what}: max rel err {err:.2e} against attention over the kept tokens")
    eager, graph = timing(fn, n_sets)
    return (graph if graph is not None else eager), eager, err, fn, out


def build_full(data, n_sets):
    """The full paged cache: n_sets layers holding the same K/V, page 16, sequences grown
    FULL_ROUND tokens per round (pages interleaved across the batch)."""
    B, L = data.B, data.L
    pool = lib.pool(ctx, n_sets, HKV, D, PAGE, KV_DT, B * math.ceil(L / PAGE), B, L)
    seqs = [lib.seq_add(pool, cur_stream()) for _ in range(B)]
    for t0 in range(0, L, FULL_ROUND):
        c = min(FULL_ROUND, L - t0)
        lib.check(lib.extend(pool, seqs, [c] * B, cur_stream()), "kvr_kv_pool_extend")
        k = data.K[:, t0:t0 + c].reshape(B * c, HKV, D)  # sequence-major, as the write wants
        v = data.V[:, t0:t0 + c].reshape(B * c, HKV, D)
        kt, vt = T(k), T(v)
        for layer in range(n_sets):
            lib.write(pool, layer, seqs, [c] * B, kt, vt, cur_stream())
        del k, v
    sync()
    return pool, seqs


def admissions(B, L, rate, seed):
    """Host bool [B, L, HKV]: the gate's verdict per (token, KV head)."""
    if rate >= 1.0:
        return torch.ones(B, L, HKV, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, L, HKV, generator=g) < rate


def kept_mask(adm):
    keep = adm.clone()
    keep[:, max(0, adm.shape[1] - W):] = True
    return keep


def build_wgkv(data, adm, n_sets, extra_tokens):
    """A write-gated pool of n_sets layers (the same K/V and scores in each), prefilled in
    CHUNK-token appends with host scores (1.0 admitted, 0.0 dropped)."""
    B, L = data.B, data.L
    ring = min(W, L)
    glob = adm[:, :max(0, L - W)].sum(1)  # [B, HKV]: tokens each row's global cache gets
    pages_row = math.ceil(ring / PAGE) + (glob + PAGE - 1) // PAGE
    pages = n_sets * (int(pages_row.sum()) + B * HKV * (math.ceil(extra_tokens / PAGE) + 2)) + 16
    pool = lib.wgkv_pool(ctx, n_sets, HKV, D, PAGE, KV_DT, pages, B, L + extra_tokens,
                         local_window=W, tau=TAU)
    seqs = [lib.wgkv_seq_add(pool, cur_stream()) for _ in range(B)]
    scores = adm.to(torch.float32).contiguous()  # host f32 [B, L, HKV]
    for t0 in range(0, L, CHUNK):
        c = min(CHUNK, L - t0)
        for layer in range(n_sets):
            for b in range(B):
                r = lib.wgkv_append(pool, seqs[b], layer, T(data.K[b, t0:t0 + c]), T(data.V[b, t0:t0 + c]),
                                    scores=T(scores[b, t0:t0 + c]), stream=cur_stream())
                lib.check(r, f"kvr_wgkv_pool_append (prefill {t0}+{c}, layer {layer}, row {b})")
    sync()
    # Row counts against the scores, every layer.
    for b, s in enumerate(seqs):
        rows = lib.wgkv_rows(pool, s)
        if len(rows) != n_sets * HKV:
            raise RuntimeError(f"{len(rows)} row entries; expected {n_sets * HKV}")
        for layer in range(n_sets):
            for h in range(HKV):
                r = rows[layer * HKV + h]
                want = (ring, int(glob[b, h]), 0, L)
                got = (r.ring, getattr(r, "global"), r.drafts, r.total)
                if got != want:
                    raise RuntimeError(f"row (seq {s}, layer {layer}, head {h}): (ring, global, drafts, total) "
                                       f"= {got}, expected {want}")
    return pool, seqs


def random_gate(hidden):
    """Host f32 gate weights of one layer (set_gate layout), the sigmoid's bias at -1.1."""
    g = torch.Generator().manual_seed(11)

    def u(shape, a):
        return ((torch.rand(shape, generator=g) * 2 - 1) * a).contiguous()

    return {
        "norm_pre": (1 + u((D,), 0.5)).contiguous(),
        "norm_post": (1 + u((D,), 0.5)).contiguous(),
        "fc1_weight": u((HKV, hidden, 2 * D), 1 / math.sqrt(2 * D)),
        "fc1_bias": u((HKV, hidden), 0.1),
        "fc2_weight": u((HKV, hidden), 1 / math.sqrt(hidden)),
        "fc2_bias": torch.full((HKV,), -1.1, dtype=torch.float32),
    }


def torch_gate(w, k_pre, k):
    """The gate formula in torch on the device: [n, HKV, D] x2 -> scores [n, HKV] f32."""
    def rms(x, s):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * s

    x = torch.cat([rms(k_pre, w["norm_pre"]), rms(k, w["norm_post"])], -1)  # [n, H, 2D]
    h = F.gelu(torch.einsum("nhi,hji->nhj", x, w["fc1_weight"]) + w["fc1_bias"])
    return torch.sigmoid((h * w["fc2_weight"]).sum(-1) + w["fc2_bias"]).clamp_min(1e-3)


def measure_steps(step, j0, n_warm, n):
    """Median (events us, host us) of step(j) calls; returns them and the next j."""
    for j in range(n_warm):
        step(j0 + j)
    sync()
    host, dev = [], []
    for j in range(n):
        if CPU:
            t0 = time.perf_counter()
            step(j0 + n_warm + j)
            host.append((time.perf_counter() - t0) * 1e6)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        step(j0 + n_warm + j)
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        dev.append(a.elapsed_time(b) * 1000.0)
    h = median(host)
    return (median(dev) if dev else h), h, j0 + n_warm + n


def append_cost(pool, n_layers, seqs, data, adm, fn, rate, wg_us, full_us):
    """One decode step's append (1 token per sequence, layer 0) on the 25 % pool, three ways;
    then checks the pool (row counts, one decode) after the precomputed-score appends."""
    B, L = data.B, data.L
    n_total = N_WARM + N_MEAS
    gen = torch.Generator().manual_seed(1234 + B)
    new_k = torch.randn(n_total, B, 1, HKV, D, dtype=DT, device=DEV)
    new_v = torch.randn(n_total, B, 1, HKV, D, dtype=DT, device=DEV)
    new_adm = torch.rand(n_total, B, 1, HKV, generator=gen) < rate
    new_sc = new_adm.to(torch.float32).contiguous()
    descs = [[(T(new_k[j, b]), T(new_v[j, b]), T(new_sc[j, b])) for b in range(B)] for j in range(n_total)]

    def step_scores(j):
        for b in range(B):
            k, v, s = descs[j][b]
            r = lib.wgkv_append(pool, seqs[b], 0, k, v, scores=s, stream=cur_stream())
            if r != 0:
                lib.check(r, "kvr_wgkv_pool_append (1 token, scores)")

    res = {"B": B, "L": L, "rate": rate, "decode_wgkv_us": wg_us, "decode_full_us": full_us,
           "path": "precomputed host scores (f32 [1, 8]), device K/V; the CUDA path has no device gate"}
    ev, host, j = measure_steps(step_scores, 0, N_WARM, N_MEAS)
    res.update(scores_us=ev, scores_host_us=host, frac=ev / wg_us, frac_vs_full=ev / full_us)
    # The pool after the appends: counts and one decode over (prefill + appended) kept tokens.
    K = torch.cat([data.K, new_k[:j, :, 0].transpose(0, 1)], 1)
    V = torch.cat([data.V, new_v[:j, :, 0].transpose(0, 1)], 1)
    keep = kept_mask(torch.cat([adm, new_adm[:j, :, 0].transpose(0, 1)], 1))
    for b, s in enumerate(seqs):
        rows = lib.wgkv_rows(pool, s)
        for h in range(HKV):
            r = rows[h]
            if r.total != L + j or r.ring + getattr(r, "global") != int(keep[b, :, h].sum()):
                fail(f"after {j} appends, seq {s} head {h}: total {r.total}, kept "
                     f"{r.ring + getattr(r, 'global')}; expected {L + j}, {int(keep[b, :, h].sum())}")
    fn(0)
    sync()
    res["err_after_appends"] = check_output(fn.keep[1], keep, data.qs[0], K, V)
    if not res["err_after_appends"] <= TOL:
        fail(f"decode after {j} single-token appends (B={B}): max rel err {res['err_after_appends']:.2e}")
    del K, V, keep
    # The library's CPU gate (host k_pre / K / V) and a torch gate on the device + D2H scores.
    w = random_gate(GATE_HIDDEN)
    lib.wgkv_set_gate(pool, [w] * n_layers, GATE_HIDDEN)
    hk = torch.randn(N_CPU_GATE + 5, B, 1, HKV, D, dtype=DT)
    hd = [[(T(hk[i, b]), T(hk[i, b]), T(hk[i, b])) for b in range(B)] for i in range(hk.shape[0])]

    def step_cpu_gate(i):
        for b in range(B):
            kp, k, v = hd[i][b]
            r = lib.wgkv_append(pool, seqs[b], 0, k, v, k_pre=kp, stream=cur_stream())
            if r != 0:
                lib.check(r, "kvr_wgkv_pool_append (1 token, k_pre: CPU gate)")

    ev, host, _ = measure_steps(step_cpu_gate, 0, 5, N_CPU_GATE)
    res.update(cpu_gate_us=ev, cpu_gate_host_us=host, cpu_gate_frac=ev / wg_us)
    wd = {k: v.to(DEV) for k, v in w.items()}
    dk = torch.randn(N_TORCH_GATE + 10, B, 2, HKV, D, dtype=DT, device=DEV)
    dd = [[(T(dk[i, b, 1:2]), T(dk[i, b, 0:1])) for b in range(B)] for i in range(dk.shape[0])]

    def step_torch_gate(i):
        sc = torch_gate(wd, dk[i, :, 0], dk[i, :, 1]).cpu()  # [B, HKV]; the copy waits for the gate
        for b in range(B):
            k, v = dd[i][b]
            r = lib.wgkv_append(pool, seqs[b], 0, k, v, scores=T(sc[b:b + 1]), stream=cur_stream())
            if r != 0:
                lib.check(r, "kvr_wgkv_pool_append (1 token, torch gate scores)")

    ev, host, _ = measure_steps(step_torch_gate, 0, 10, N_TORCH_GATE)
    res.update(torch_gate_us=ev, torch_gate_host_us=host, torch_gate_frac=ev / wg_us)
    sync()
    if not CPU:
        res.update(device_step(pool, n_layers, seqs, B, wg_us, full_us, fn))
    return res


LAYER_PASSES = 5  # layer graphs with and without the step, each step kind


def device_step(pool, n_layers, seqs, B, wg_us, full_us, decode):
    """The device step (kvr_wgkv_pool_reserve, then kvr_wgkv_pool_step: the gate on the
    device from k_pre and k, or given device scores, fused with the ring update) under CUDA
    graph replay, rotating over the pool's layers (each with its own copy of the gate
    weights, 4 MiB f32 per layer at hidden 512); checks afterwards that every step ran (no
    row ran out of budget). Then the step inside a layer's decode step: graphs of whole
    layers (weight GEMVs, the step, the pool's decode of that layer, `decode(i)`), with and
    without the step, alternated: what the step adds to a layer.

    The gated step runs as an engine calls it, without scores_out: the gate is deferred (a
    row queues its tokens' gate inputs and is scored every KVR_WGKV_GATE_QUEUE = 16 steps),
    so every graph holds 16 steps of each layer (each replay one full queue cycle). For
    comparison: the gate scored in every step (scores_out asked for: `gated_now`), and in
    the layer a plain paged cache's append (kvr_kv_pool_write of the projection's k and v),
    which any engine's KV cache pays."""
    calls = 16 * n_layers
    lcalls = 16 * n_layers  # layer graphs: sixteen rounds over the layers
    # time_graph: one warm call per layer, one replay, 7 timed replays; three timings of the
    # step alone, LAYER_PASSES of the layer with each of the three step kinds.
    per_layer = 3 * (1 + 8 * (calls // n_layers)) + 3 * LAYER_PASSES * (1 + 8 * (lcalls // n_layers))
    for s in seqs:
        lib.wgkv_reserve(pool, s, per_layer, cur_stream())
    totals = lambda: [[r.total for r in lib.wgkv_rows(pool, s)] for s in seqs]  # noqa: E731
    before = totals()
    ids = torch.tensor(seqs, dtype=torch.int32)
    ids_t = T(ids)
    x = torch.randn(n_layers, 3, B, HKV, D, dtype=DT, device=DEV)
    sc = (torch.rand(n_layers, B, HKV, device=DEV) < 0.25).to(torch.float32)
    out = torch.empty(B, HKV, dtype=torch.float32, device=DEV)
    descs = [(T(x[i, 0]), T(x[i, 1]), T(x[i, 2]), T(sc[i])) for i in range(n_layers)]
    out_t = T(out)

    def gated(i):
        kp, k, v, _ = descs[i]
        r = lib.wgkv_step(pool, i, ids_t, k, v, k_pre=kp, stream=cur_stream())
        if r != 0:
            lib.check(r, "kvr_wgkv_pool_step (gate)")

    def gated_now(i):
        kp, k, v, _ = descs[i]
        r = lib.wgkv_step(pool, i, ids_t, k, v, k_pre=kp, scores_out=out_t, stream=cur_stream())
        if r != 0:
            lib.check(r, "kvr_wgkv_pool_step (gate, scores_out)")

    def given(i):
        _, k, v, s = descs[i]
        r = lib.wgkv_step(pool, i, ids_t, k, v, scores=s, stream=cur_stream())
        if r != 0:
            lib.check(r, "kvr_wgkv_pool_step (scores)")

    # Given scores and the gate in every step first: once a pool has deferred a gate, its
    # steps with given scores also carry gate CTAs (for rows that may still queue tokens).
    t_scores = time_graph(given, n_layers, calls)
    t_gate_now = time_graph(gated_now, n_layers, calls)
    # A plain paged cache of the same layers for the layer graphs' `full` kind: one token a
    # sequence, rewritten in place by every step (what an engine's KV append costs).
    fpool = lib.pool(ctx, n_layers, HKV, D, PAGE, KV_DT, 4 * B, B, 64)
    fseqs = [lib.seq_add(fpool, cur_stream()) for _ in range(B)]
    lib.check(lib.extend(fpool, fseqs, [1] * B, cur_stream()), "kvr_kv_pool_extend")
    # The rest of the layer's decode step, for scale: Llama-3.1-8B's per-layer weight GEMVs
    # (q, k, v, o, gate, up, down in bf16, 436 MiB, from DRAM) at this batch, same run.
    hid, ffn = 4096, 14336
    ws = [torch.randn(n, hid, dtype=DT, device=DEV) for n in (hid + 2 * HKV * D, hid, 2 * ffn)]
    wd = torch.randn(hid, ffn, dtype=DT, device=DEV)
    xa = torch.randn(B, hid, dtype=DT, device=DEV)

    def layer(i):
        h = xa
        for w in ws[:2]:
            h = F.linear(xa, w)
        gu = F.linear(xa, ws[2])
        return F.linear(gu[:, :ffn] * gu[:, ffn:], wd) + h[:, :1]

    t_layer = time_graph(layer, 1, 8)

    # The layer in the order of an engine's decode step: the q / k / v projection, the
    # step (the projection's k and v appended, k also the gate's k_pre: the engine's fresh
    # outputs), the attention decode of that layer over the 25 % pool, the output
    # projection, the MLP. The step's cost in a layer is the difference with and without it
    # (passes alternated; medians).
    def layer_with(kind):
        def f(i):
            qkv = F.linear(xa, ws[0])  # [B, q 4096 | k 1024 | v 1024]
            if kind is not None:
                kt = T(qkv[:, hid:hid + HKV * D].view(B, HKV, D))
                vt = T(qkv[:, hid + HKV * D:].view(B, HKV, D))
                if kind == "full":
                    lib.write(fpool, i, fseqs, [1] * B, kt, vt, cur_stream())
                    r = 0
                elif kind == "gated":
                    r = lib.wgkv_step(pool, i, ids_t, kt, vt, k_pre=kt, stream=cur_stream())
                elif kind == "gated_now":
                    r = lib.wgkv_step(pool, i, ids_t, kt, vt, k_pre=kt, scores_out=out_t, stream=cur_stream())
                else:
                    r = lib.wgkv_step(pool, i, ids_t, kt, vt, scores=descs[i][3], stream=cur_stream())
                if r != 0:
                    lib.check(r, f"kvr_wgkv_pool_step ({kind}, in a layer)")
            decode(i)
            o = F.linear(xa, ws[1])
            gu = F.linear(xa, ws[2])
            return F.linear(gu[:, :ffn] * gu[:, ffn:], wd) + o[:, :1] + qkv[:, :1]
        return f

    # Each kind timed between two layer graphs without a step; its cost is the difference
    # with their mean (the pool grows by every step, so the layer slows down over the run).
    lt = {k: [] for k in ("none", "gated", "gated_now", "given", "full")}
    diffs = {k: [] for k in ("gated", "gated_now", "given", "full")}
    for kinds in (("given", "gated_now", "full"), ("gated",)):
        if "gated" in kinds:
            t_gate = time_graph(gated, n_layers, calls)
        prev = time_graph(layer_with(None), n_layers, lcalls)
        lt["none"].append(prev)
        for _ in range(LAYER_PASSES):
            for kind in kinds:
                t = time_graph(layer_with(kind), n_layers, lcalls)
                nxt = time_graph(layer_with(None), n_layers, lcalls)
                lt[kind].append(t)
                lt["none"].append(nxt)
                if None not in (t, prev, nxt):
                    diffs[kind].append(t - (prev + nxt) / 2)
                prev = nxt
    del ws, wd
    sync()
    lib.lib.kvr_kv_pool_free(fpool)
    after = totals()  # raises if a step ran out of budget
    for b in range(B):
        ran = {a - p for a, p in zip(after[b], before[b])}
        if ran != {per_layer}:
            fail(f"device steps: seq {seqs[b]} rows advanced by {sorted(ran)}; expected {per_layer} each")
    res = {"step_gate_us": t_gate, "step_gate_now_us": t_gate_now, "step_scores_us": t_scores,
           "step_calls": calls, "step_layers": n_layers,
           "layer_weights_us": t_layer,
           "step_path": "kvr_wgkv_pool_step over the pool's layers in turn, device K/V (and k_pre or "
                        "scores), CUDA graph replay"}
    if t_gate is not None:
        res.update(step_gate_frac=t_gate / wg_us, step_gate_frac_vs_full=t_gate / full_us)
        if t_layer is not None:
            res.update(step_gate_frac_layer=t_gate / (t_layer + wg_us + t_gate))
    if t_scores is not None:
        res.update(step_scores_frac=t_scores / wg_us)
    if all(diffs.values()):
        base = median([t for t in lt["none"] if t is not None])
        dg, dn, dv, df = (median(diffs[k]) for k in ("gated", "gated_now", "given", "full"))
        res.update(layer_none_us=base, layer_passes=lt, layer_diffs=diffs,
                   step_gate_in_layer_us=dg, step_scores_in_layer_us=dv,
                   step_gate_frac_in_layer=dg / (base + dg),
                   step_gate_now_in_layer_us=dn, full_write_in_layer_us=df)
        print(f"device step B={B} inside a layer (weights, step, 25 % decode; medians of the differences "
              f"with the neighbouring layers without a step): {base:.1f} us without; the gated step "
              f"+{dg:.2f} us ({dg / (base + dg):.2%} of the layer); gated in every step +{dn:.2f} us; given "
              f"scores +{dv:.2f} us; a plain paged cache's append instead +{df:.2f} us", flush=True)
    print(f"device step B={B}: gate + append {t_gate:.2f} us ({t_gate / wg_us:.1%} of the write-gated "
          f"decode, {t_gate / full_us:.1%} of the full one; {res.get('step_gate_frac_layer', 0):.1%} of a "
          f"layer's step with its weights ({t_layer:.1f} us)); gated in every step {t_gate_now:.2f} us; "
          f"given scores {t_scores:.2f} us", flush=True)
    return res


def run_context(B, L, results, ceiling):
    tag = f"B={B} L={L // 1024}K" if L >= 1024 else f"B={B} L={L}"
    full_bytes = 2 * B * L * HKV * D * ELEM
    n_full = n_sets_for(full_bytes)
    est = full_bytes + 2 * max(ROTATE_BYTES, full_bytes) + B * HKV * 2 * APPEND_TOKENS * D * ELEM + GIB
    if est > MEM_CAP:
        results["skipped"].append(f"{tag}: ~{est / GIB:.0f} GiB over the {MEM_CAP // GIB} GiB cap")
        print(f"skipped {tag}", flush=True)
        return
    t0 = time.time()
    data = Data(B, L)
    full, fseqs = build_full(data, n_full)
    full_us, f_eager, err_full, _, _ = checked_time("full", full, data, fseqs, None, n_full, f"{tag} full cache")
    full_tbs = full_bytes / (full_us * 1e-6) / 1e12
    sync()
    lib.lib.kvr_kv_pool_free(full)
    print(f"{tag} full cache: {full_bytes / (1 << 20):.0f} MiB, {n_full} sets, {full_us:.1f} us "
          f"({full_tbs:.2f} TB/s), err {err_full:.1e}  [{time.time() - t0:.1f} s]", flush=True)
    for ri, rate in enumerate(RATES):
        t1 = time.time()
        adm = admissions(B, L, rate, seed=1000 * ri + B * 7 + L)
        keep = kept_mask(adm)
        kept = int(keep.sum())
        wg_bytes = kept * 2 * D * ELEM
        n_wg = n_sets_for(wg_bytes)
        with_append = L == APPEND_AT and rate == 0.25
        pool, seqs = build_wgkv(data, adm, n_wg, APPEND_TOKENS if with_append else 0)
        st = lib.wgkv_stats(pool)
        if st.kept_tokens != n_wg * kept or st.full_tokens != n_wg * B * L * HKV:
            fail(f"{tag} {rate:.0%}: stats kept {st.kept_tokens} / full {st.full_tokens}, expected "
                 f"{n_wg * kept} / {n_wg * B * L * HKV}")
        wg_us, eager, err, fn, out = checked_time("wgkv", pool, data, seqs, keep, n_wg, f"{tag} {rate:.0%}")
        wg_tbs = wg_bytes / (wg_us * 1e-6) / 1e12
        row = {
            "config": f"{tag} {int(rate * 100)}%", "B": B, "L": L, "rate": rate,
            "kept_frac": kept / (B * L * HKV), "full_mib": full_bytes / (1 << 20), "wgkv_mib": wg_bytes / (1 << 20),
            "sets_full": n_full, "sets_wgkv": n_wg,
            "full_us": full_us, "full_eager_us": f_eager, "full_tbs": full_tbs, "err_full": err_full,
            "wgkv_us": wg_us, "wgkv_eager_us": eager, "wgkv_tbs": wg_tbs, "err_wgkv": err,
            "speedup": full_us / wg_us, "ideal_speedup": full_bytes / wg_bytes, "bw_frac": wg_tbs / full_tbs,
            "memory_ratio": st.pages_used / st.full_pages,
            "wgkv_pool_mib_per_layer": st.pages_used * st.page_bytes / n_wg / (1 << 20),
            "pages_used": st.pages_used, "full_pages": st.full_pages,
            "floor_us": wg_bytes / (ceiling * 1e12) * 1e6 if ceiling else None,
        }
        results["rows"].append(row)
        print(f"{row['config']:18s} kept {row['kept_frac']:6.1%} {row['wgkv_mib']:7.1f} MiB {n_wg:2d} sets  "
              f"wgkv {wg_us:8.1f} us ({wg_tbs:.2f} TB/s, {row['bw_frac']:.0%} of full)  speedup "
              f"{row['speedup']:5.2f}x (ideal {row['ideal_speedup']:5.2f}x)  memory {row['memory_ratio']:.3f}  "
              f"err {err:.1e}  [{time.time() - t1:.1f} s]", flush=True)
        if with_append:
            try:
                a = append_cost(pool, n_wg, seqs, data, adm, fn, rate, wg_us, full_us)
                results["append"].append(a)
                print(f"append B={B} at {tag} 25%: scores {a['scores_us']:.1f} us (host {a['scores_host_us']:.1f}) = "
                      f"{a['frac']:.1%} of the write-gated decode, {a['frac_vs_full']:.1%} of the full one; "
                      f"CPU gate (k_pre) {a['cpu_gate_us']:.1f} us ({a['cpu_gate_frac']:.0%}); torch gate + D2H "
                      f"{a['torch_gate_us']:.1f} us ({a['torch_gate_frac']:.0%}); err after appends "
                      f"{a['err_after_appends']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - report, keep the decode numbers
                traceback.print_exc()
                fail(f"append measurement at {tag}: {type(e).__name__}: {e}")
        sync()
        lib.wgkv_free(pool)
        del fn, out, adm, keep
    del data
    if not CPU:
        torch.cuda.empty_cache()


def find(results, B, L, rate):
    for r in results["rows"]:
        if r["B"] == B and r["L"] == L and r["rate"] == rate:
            return r
    return None


def summary(results):
    """The flat keys (bench/results/h200.json)."""
    s = {}
    L128 = 131072 if not CPU else 1000
    for pct, rate in ((10, 0.1), (25, 0.25), (50, 0.5)):
        r = find(results, 1, L128, rate)
        if r:
            s[f"wgkv_speedup_{pct}pct_128k"] = round(r["speedup"], 3)
    r = find(results, 1, L128, 0.25)
    if r:
        s["wgkv_memory_ratio_25pct"] = round(r["memory_ratio"], 4)
        s["wgkv_bw_frac_25pct_128k"] = round(r["bw_frac"], 3)
        s["wgkv_decode_25pct_128k_us"] = round(r["wgkv_us"], 1)
        s["wgkv_full_128k_us"] = round(r["full_us"], 1)
    r = find(results, 1, 262144 if not CPU else -1, 0.25)
    if r:
        s["wgkv_speedup_25pct_256k"] = round(r["speedup"], 3)
    for a in results["append"]:
        sfx = "" if a["B"] == 1 else f"_b{a['B']}"
        # The headline: the device step (gate + ring update on the device, graph replay).
        if a.get("step_gate_frac") is not None:
            s["wgkv_gate_append_frac" + sfx] = round(a["step_gate_frac"], 4)
            s["wgkv_gate_append_frac_vs_full" + sfx] = round(a["step_gate_frac_vs_full"], 4)
            s["wgkv_gate_append_us" + sfx] = round(a["step_gate_us"], 2)
            if a.get("step_gate_frac_layer") is not None:
                s["wgkv_gate_append_frac_layer_step" + sfx] = round(a["step_gate_frac_layer"], 4)
                s["wgkv_layer_weights_us" + sfx] = round(a["layer_weights_us"], 1)
        if a.get("step_scores_us") is not None:
            s["wgkv_step_scores_us" + sfx] = round(a["step_scores_us"], 2)
        # The step inside a layer's decode step (weights, step, 25 % decode): what it adds.
        if a.get("step_gate_in_layer_us") is not None:
            s["wgkv_gate_append_in_layer_us" + sfx] = round(a["step_gate_in_layer_us"], 2)
            s["wgkv_gate_append_frac_in_layer" + sfx] = round(a["step_gate_frac_in_layer"], 4)
            s["wgkv_step_scores_in_layer_us" + sfx] = round(a["step_scores_in_layer_us"], 2)
            s["wgkv_layer_none_us" + sfx] = round(a["layer_none_us"], 1)
            s["wgkv_gate_now_in_layer_us" + sfx] = round(a["step_gate_now_in_layer_us"], 2)
            s["wgkv_full_write_in_layer_us" + sfx] = round(a["full_write_in_layer_us"], 2)
        if a.get("step_gate_now_us") is not None:
            s["wgkv_gate_now_us" + sfx] = round(a["step_gate_now_us"], 2)
        if a["B"] == 1:
            s["wgkv_host_append_frac"] = round(a["frac"], 4)
            s["wgkv_gate_cpu_append_frac"] = round(a["cpu_gate_frac"], 3)
            s["wgkv_gate_torch_append_frac"] = round(a["torch_gate_frac"], 3)
    if results["rows"]:
        s["wgkv_max_rel_err"] = float(f"{max(max(r['err_wgkv'], r['err_full']) for r in results['rows']):.2e}")
    return s


def print_table(results):
    print("\nconfig              kept   MiB read  full us  wgkv us  speedup  ideal  wgkv TB/s  full TB/s  bw %  memory  err")
    for r in sorted(results["rows"], key=lambda r: (r["B"], r["L"], -r["rate"])):
        print(f"{r['config']:18s} {r['kept_frac']:6.1%} {r['wgkv_mib']:9.1f} {r['full_us']:8.1f} {r['wgkv_us']:8.1f} "
              f"{r['speedup']:7.2f}x {r['ideal_speedup']:6.2f} {r['wgkv_tbs']:10.2f} {r['full_tbs']:10.2f} "
              f"{r['bw_frac'] * 100:5.0f} {r['memory_ratio']:7.3f} {r['err_wgkv']:.1e}")
    for a in results["append"]:
        print(f"append, 1 token/sequence, B={a['B']} L={a['L']}: scores {a['scores_us']:.1f} us "
              f"({a['frac']:.2%} of the 25 % decode {a['decode_wgkv_us']:.1f} us, {a['frac_vs_full']:.2%} of the full "
              f"{a['decode_full_us']:.1f} us); CPU gate {a['cpu_gate_us']:.1f} us; torch gate + D2H {a['torch_gate_us']:.1f} us"
              + (f"; device step: gate + append {a['step_gate_us']:.2f} us ({a['step_gate_frac']:.2%}), given scores "
                 f"{a['step_scores_us']:.2f} us" if a.get("step_gate_us") is not None else ""))
    for s in results["skipped"]:
        print("skipped:", s)


def main():
    torch.manual_seed(0)
    out_dir = os.environ.get("OUT")
    results = {"kvreplay": lib.lib.kvr_library_version().decode(),
               "build": lib.lib.kvr_library_build_info().decode(), "torch": torch.__version__,
               "shape": {"hq": HQ, "hkv": HKV, "d": D, "page": PAGE, "local_window": W, "tau": TAU},
               "rows": [], "append": [], "skipped": [], "failures": FAILURES}
    if CPU:
        results["device"] = "CPU backend (smoke run)"
        ceiling = None
    else:
        props = torch.cuda.get_device_properties(0)
        results.update(device=props.name, sms=props.multi_processor_count, l2_bytes=props.L2_cache_size)
        ceiling = read_ceiling()
        results["read_ceiling_tbs"] = ceiling
        print(f"{props.name}: read ceiling {ceiling:.3f} TB/s (torch.sum over 2 GiB)", flush=True)

    def save():
        results["summary"] = summary(results)
        if out_dir:
            with open(os.path.join(out_dir, "wgkv_bench.json"), "w") as f:
                json.dump(results, f, indent=1)
            with open(os.path.join(out_dir, "h200-wgkv.json"), "w") as f:
                json.dump(results["summary"], f, indent=1)

    t0 = time.time()
    for B, L in CONFIGS:
        try:
            run_context(B, L, results, ceiling)
        except Exception as e:  # noqa: BLE001 - record, go on with the other contexts
            traceback.print_exc()
            fail(f"B={B} L={L}: {type(e).__name__}: {e}")
        save()
        print(f"  ... {time.time() - t0:.0f} s", flush=True)
    results["seconds"] = time.time() - t0
    save()
    print_table(results)
    print("summary:", json.dumps(results["summary"]))
    if FAILURES:
        print(f"\n{len(FAILURES)} FAILURE(S):", *FAILURES, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
