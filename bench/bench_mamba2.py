"""Mamba-2 replay benchmark (issue 10), one process, one run, on the device GPU.

Nemotron-H-8B Mamba-2 layer: 128 heads of head_dim 64, 8 groups of d_state 128, fp32
state (4 MiB per sequence and layer), bf16 x, z, B, C, fp32 dt, dt_bias + softplus, D, z
gate. On the same inputs, under CUDA Graph replay with states rotating over sets larger than
4x L2 (each set is a layer of our pool and a separate state tensor for the peer):

  decode   mamba_ssm 2.3.2.post1 selective_state_update (Triton; the sdist travels in .whl/,
           only mamba_ssm/ops/triton/{selective_state_update,softplus}.py are imported),
           kvreplay recurrent mode (ring 0) and replay (ring 16; the graph holds 16 steps per
           layer, so every figure includes one flush per sequence), B in 1..256; the first
           step's outputs compared with the peer's on the same state.
  verify   T = 4 drafts + commit (device-side accepted count 2): replay vs recurrent with
           per-draft snapshots, B = 32, 128.
  linattn  plain linear attention (32 heads, d 128, fp32 state), replay vs recurrent at
           ring m in {8, 16, 23, 32, 64}, B = 128; against KVBuffer's Eq. 9 (verify of m = 2,
           4, 8 drafts, all accepted) and Eq. 10 (KV-only decode at contexts 8..120 against
           chunkwise decode with m = 16), B = 128.

    python3 bench_mamba2.py   # writes $OUT/mamba2_bench.json and $OUT/h200-mamba2.json (keys) when $OUT is set
    python3 bench_mamba2.py --decode-only [--batches 1,8]   # the decode sweep only (kernel A/B runs; no files)
    python3 bench_mamba2.py --verify-only                   # the verify sweep only (no files)
    python3 bench_mamba2.py --linattn-eqs                   # the Eq. 9 / Eq. 10 comparison only (no files)
"""

import json
import math
import os
import sys
import tarfile
import tempfile

import torch

import kvr
from benchutil import copy_ceiling, cur_stream, time_graph

DEV = torch.device("cuda")
H, P, G, N = 128, 64, 8, 128
STATE = H * P * N * 4
ENTRY = (H * P + G * N) * 4 + H * 4
L2 = torch.cuda.get_device_properties(0).L2_cache_size
DECODE_ONLY = "--decode-only" in sys.argv
BATCHES = ([int(x) for x in sys.argv[sys.argv.index("--batches") + 1].split(",")] if "--batches" in sys.argv
           else [1, 8, 32, 64, 128, 256])
lib = kvr.Lib()
ctx = lib.context(kvr.BACKEND_CUDA, stream=cur_stream())


def load_peer():
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.path.join(here, "..", ".whl"), os.path.join(here, "..", "..", ".whl")):
        path = os.path.join(root, "mamba_ssm-2.3.2.post1.tar.gz")
        if os.path.exists(path):
            d = tempfile.mkdtemp()
            with tarfile.open(path) as t:
                for m in t.getmembers():
                    if m.name.endswith(("ops/triton/selective_state_update.py", "ops/triton/softplus.py")):
                        t.extract(m, d)
            base = os.path.join(d, "mamba_ssm-2.3.2.post1")
            for sub in ("mamba_ssm", "mamba_ssm/ops", "mamba_ssm/ops/triton"):
                open(os.path.join(base, sub, "__init__.py"), "a").close()
            sys.path.insert(0, base)
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            return selective_state_update
    return None


try:
    ssu = load_peer()
except Exception as e:  # noqa: BLE001
    print(f"peer unavailable: {type(e).__name__}: {e}")
    ssu = None


def n_sets_for(b):
    return max(2, min(32, math.ceil(4 * L2 / (b * STATE))))


def r(*shape, lo=-1.0, hi=1.0, dt=torch.bfloat16, gen=None):
    return (torch.rand(*shape, generator=gen, device=DEV) * (hi - lo) + lo).to(dt)


class Inputs:
    def __init__(self, b, t, n, seed=0):
        gen = torch.Generator(device=DEV)
        gen.manual_seed(seed)
        self.x = [r(b, t, H, P, gen=gen) for _ in range(n)]
        self.z = [r(b, t, H, P, gen=gen) for _ in range(n)]
        self.bm = [r(b, t, G, N, gen=gen) for _ in range(n)]
        self.cm = [r(b, t, G, N, gen=gen) for _ in range(n)]
        self.dt = [r(b, t, H, lo=-3.0, hi=1.0, dt=torch.float32, gen=gen) for _ in range(n)]
        self.out = [torch.empty(b, t, H, P, device=DEV, dtype=torch.bfloat16) for _ in range(n)]


A = -torch.rand(H, device=DEV) * 1.8 - 0.2
D_SKIP = torch.rand(H, device=DEV) * 2 - 1
DT_BIAS = torch.rand(H, device=DEV) * 1.5 - 1.0
TA, TD, TBIAS = (kvr.torch_tensor(x) for x in (A, D_SKIP, DT_BIAS))


def kvr_pool(b, ring, layers, drafts=0):
    p = lib.mamba2_pool(ctx, n_layers=layers, n_heads=H, head_dim=P, n_groups=G, d_state=N, ring_len=ring,
                        kv_only_threshold=0, max_drafts=drafts, max_seqs=b, layout=kvr.STATE_V_MAJOR)
    seqs = [lib.mamba2_seq_add(p, cur_stream()) for _ in range(b)]
    return p, seqs


def tensors(ids, inp, i, t_dim=True):
    sel = (lambda x: x[i]) if t_dim else (lambda x: x[i][:, 0])
    keep = [kvr.torch_tensor(sel(getattr(inp, k))) for k in ("x", "dt", "bm", "cm", "z", "out")]
    x, dt, bm, cm, z, out = keep
    return lib.mamba2_tensors(seq_ids=ids, x=x, dt=dt, a=TA, b=bm, c=cm, d=TD, z=z, dt_bias=TBIAS, out=out)


def decode_sweep(ceiling):
    rows = []
    for b in BATCHES:
        n = n_sets_for(b)
        inp = Inputs(b, 1, n)
        row = {"B": b, "sets": n}
        ids_t = torch.arange(b, dtype=torch.int32, device=DEV)
        ids = kvr.torch_tensor(ids_t)
        if ssu is not None:
            states = [torch.randn(b, H, P, N, device=DEV) * 0.1 for _ in range(n)]
            a_e = A[:, None, None].expand(H, P, N)
            d_e = D_SKIP[:, None].expand(H, P)
            bias_e = DT_BIAS[:, None].expand(H, P)

            def peer(i):
                dt_e = inp.dt[i][:, 0, :, None].expand(b, H, P)
                inp.out[i][:, 0] = ssu(states[i], inp.x[i][:, 0], dt_e, a_e, inp.bm[i][:, 0], inp.cm[i][:, 0],
                                       D=d_e, z=inp.z[i][:, 0], dt_bias=bias_e, dt_softplus=True)

            row["peer_us"] = time_graph(peer, n, n * 4)
            # Correctness: one step from the same state through the replay pool.
            p, seqs = kvr_pool(b, 16, 1)
            for s in range(b):
                lib.mamba2_import(p, 0, seqs[s], kvr.torch_tensor(states[0][s]), cur_stream())
            ts = tensors(ids, inp, 0, t_dim=False)
            lib.check(lib.mamba2_step(False, p, 0, ts, cur_stream()), "decode")
            torch.cuda.synchronize()
            ours = inp.out[0].float().clone()
            peer(0)  # from the same state (the import copied it)
            torch.cuda.synchronize()
            theirs = inp.out[0].float()
            row["max_rel_err_vs_peer"] = float((ours - theirs).abs().max() / theirs.abs().max())
            lib.lib.kvr_mamba2_pool_free(p)
            del states
        for name, ring in (("recurrent_us", 0), ("replay_us", 16)):
            p, seqs = kvr_pool(b, ring, n)
            tss = [tensors(ids, inp, i, t_dim=False) for i in range(n)]

            def step(i):
                lib.mamba2_step(False, p, i, tss[i], cur_stream())

            # n * 16 calls: every layer decodes 16 tokens per replay (one flush at ring 16).
            row[name] = time_graph(step, n, n * 16)
            lib.lib.kvr_mamba2_pool_free(p)
        rec_bytes = 2 * STATE
        rep_bytes = STATE + STATE / 16 + 8.5 * ENTRY
        row["recurrent_floor_pct"] = 100 * b * rec_bytes / (row["recurrent_us"] * 1e-6) / (ceiling * 1e12)
        row["replay_floor_pct"] = 100 * b * rep_bytes / (row["replay_us"] * 1e-6) / (ceiling * 1e12)
        if "peer_us" in row:
            row["replay_vs_peer"] = row["peer_us"] / row["replay_us"]
            row["recurrent_vs_peer"] = row["peer_us"] / row["recurrent_us"]
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def verify_rounds(b, t, n, inp, ids, acc, calls):
    """µs per round of T drafts verified plus the commit of `acc`, on a ring-0 pool (the
    recurrent form with per-draft states: snapshots_us) and on a ring-16 pool (replay_us)."""
    row = {}
    for name, ring in (("snapshots_us", 0), ("replay_us", 16)):
        p, seqs = kvr_pool(b, ring, n, drafts=t)
        tss = [tensors(ids, inp, i) for i in range(n)]
        lib.check(lib.mamba2_step(True, p, 0, tss[0], cur_stream()), "verify")
        lib.check(lib.mamba2_commit(p, 0, ids, acc, cur_stream()), "commit")

        def rnd(i):
            lib.mamba2_step(True, p, i, tss[i], cur_stream())
            lib.mamba2_commit(p, i, ids, acc, cur_stream())

        row[name] = time_graph(rnd, n, calls)
        lib.lib.kvr_mamba2_pool_free(p)
    return row


def verify_sweep(t=4):
    rows = []
    for b in (32, 128):
        n = n_sets_for(b)
        inp = Inputs(b, t, n, seed=1)
        ids_h = torch.arange(b, dtype=torch.int32)  # verify takes host ids
        ids = kvr.torch_tensor(ids_h)
        acc = kvr.torch_tensor(torch.full((b,), t // 2, dtype=torch.int32, device=DEV))
        row = {"B": b, "T": t, **verify_rounds(b, t, n, inp, ids, acc, n * 8)}
        row["speedup"] = row["snapshots_us"] / row["replay_us"]
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def ring_sweep(b=128, rings=(8, 16, 23, 32, 64)):
    """Linear attention's chunkwise decode (KVBuffer 3.2): 32 heads, d = 128, fp32 state,
    recurrent vs replay with a flush every m tokens. Run through Mamba-2 pools with one
    group per head (heads 32, head_dim 128, groups 32, d_state 128): the same additive-rule
    kernels as kvr's linear-attention family, whose C API is not exported yet."""
    global H, P, G, N
    saved = (H, P, G, N)
    H, P, G, N = 32, 128, 32, 128
    state = H * P * N * 4
    n = max(2, min(32, math.ceil(4 * L2 / (b * state))))
    inp = Inputs(b, 1, n, seed=2)
    ids = kvr.torch_tensor(torch.arange(b, dtype=torch.int32, device=DEV))
    global TA, TD, TBIAS
    keep = (TA, TD, TBIAS)
    a, d, bias = -torch.full((H,), 0.05, device=DEV), torch.zeros(H, device=DEV), torch.zeros(H, device=DEV)
    TA, TD, TBIAS = (kvr.torch_tensor(x) for x in (a, d, bias))
    rows = {}
    for m in (0,) + tuple(rings):
        p, seqs = kvr_pool(b, m, n)
        tss = [tensors(ids, inp, i, t_dim=False) for i in range(n)]
        calls = n * max(m, 1) * (64 // max(m, 1) if m else 16)

        def step(i):
            lib.mamba2_step(False, p, i % n, tss[i % n], cur_stream())

        rows[m] = time_graph(step, n, min(calls, 4096))
        lib.lib.kvr_mamba2_pool_free(p)
    H, P, G, N = saved
    TA, TD, TBIAS = keep
    out = {f"m{m}_us": t for m, t in rows.items()}
    for m in rings:
        out[f"m{m}_speedup"] = rows[0] / rows[m]
    print(" ".join(f"{k}={v:.3g}" for k, v in out.items()), flush=True)
    return out


def linattn_eq9_eq10(b=128, ts=(2, 4, 8), ctxs=(8, 32, 64, 120)):
    """Linear attention (ring_sweep's shape and pools) against KVBuffer's Eq. 9 and Eq. 10:
    verify of m = T drafts, all accepted, plus the commit, on a ring-16 pool against the
    recurrent form with per-draft states (a ring-0 pool); KV-only decode (bf16 entries,
    threshold 127) at context L against chunkwise decode with m = 16 (f32 entries, as
    ring_sweep's). Eq. 9: ((m+1) d + 2m) / (3d + 4m); Eq. 10: (d + 2d/m + m/2 + 7/2) / (L + 2)."""
    global H, P, G, N, TA, TD, TBIAS
    saved, keep = (H, P, G, N), (TA, TD, TBIAS)
    H, P, G, N = 32, 128, 32, 128
    d = N
    n = max(2, min(32, math.ceil(4 * L2 / (b * H * P * N * 4))))
    a, dd, bias = -torch.full((H,), 0.05, device=DEV), torch.zeros(H, device=DEV), torch.zeros(H, device=DEV)
    TA, TD, TBIAS = (kvr.torch_tensor(x) for x in (a, dd, bias))
    out = {}
    ids_cpu = torch.arange(b, dtype=torch.int32)  # verify takes host ids (kept alive here)
    ids_h = kvr.torch_tensor(ids_cpu)
    for t in ts:
        inp = Inputs(b, t, n, seed=4)
        acc_dev = torch.full((b,), t, dtype=torch.int32, device=DEV)
        row = verify_rounds(b, t, n, inp, ids_h, kvr.torch_tensor(acc_dev), n * 16)
        out[f"verify_t{t}_speedup"] = row["snapshots_us"] / row["replay_us"]
        out[f"verify_t{t}_eq9"] = ((t + 1) * d + 2 * t) / (3 * d + 4 * t)
        out.update({f"verify_t{t}_{k}": v for k, v in row.items()})
    # KV-only at context L (every sequence at L after the warm-up; the timed graph's steps
    # run at L + 1 .. L + 4) against the m = 16 replay step.
    ids_dev = torch.arange(b, dtype=torch.int32, device=DEV)
    ids = kvr.torch_tensor(ids_dev)
    inp = Inputs(b, 1, n, seed=5)
    tss = [tensors(ids, inp, i, t_dim=False) for i in range(n)]
    p, _ = kvr_pool(b, 16, n)
    m16 = time_graph(lambda i: lib.mamba2_step(False, p, i, tss[i], cur_stream()), n, n * 16)
    lib.lib.kvr_mamba2_pool_free(p)
    thr = kvr.kv_only_threshold(d, P, 4, 2)
    kp = lib.mamba2_pool(ctx, n_layers=n, n_heads=H, head_dim=P, n_groups=G, d_state=N, ring_len=16,
                         kv_only_threshold=thr, max_drafts=0, max_seqs=b, layout=kvr.STATE_V_MAJOR,
                         entry_dtype=kvr.DTYPE_BF16)
    seqs = [lib.mamba2_seq_add(kp, cur_stream()) for _ in range(b)]
    out["m16_us"] = m16
    out["kvonly_threshold"] = thr
    for c in ctxs:
        for s in seqs:
            lib.check(lib.lib.kvr_mamba2_pool_seq_reset(kp, s, kvr.ctypes.c_void_p(cur_stream())), "reset")
        for _ in range(c - 1):
            for i in range(n):
                lib.mamba2_step(False, kp, i, tss[i], cur_stream())
        torch.cuda.synchronize()
        t_kv = time_graph(lambda i: lib.mamba2_step(False, kp, i, tss[i], cur_stream()), n, n * 4,
                          replays=1, warm=False)
        out[f"kvonly_ctx{c}_us"] = t_kv
        out[f"kvonly_ctx{c}_speedup"] = m16 / t_kv
        out[f"kvonly_ctx{c}_eq10"] = (d + 2 * d / 16 + 16 / 2 + 7 / 2) / (c + 2)
    lib.lib.kvr_mamba2_pool_free(kp)
    H, P, G, N = saved
    TA, TD, TBIAS = keep
    print(" ".join(f"{k}={v:.3g}" for k, v in out.items()), flush=True)
    return out


def summary(res):
    """The flat figures issue 10 lists (bench/results/h200.json)."""
    dec = {r["B"]: r for r in res["decode"]}
    ver = {r["B"]: r for r in res["verify"]}
    out = {f"mamba2_replay_vs_peer_b{b}": round(dec[b]["replay_vs_peer"], 3)
           for b in (1, 8, 128, 256) if "replay_vs_peer" in dec.get(b, {})}
    out.update({f"mamba2_recurrent_vs_peer_b{b}": round(dec[b]["recurrent_vs_peer"], 3)
                for b in (1, 8, 128, 256) if "recurrent_vs_peer" in dec.get(b, {})})
    if 128 in ver:
        out["mamba2_verify_speedup_t4_b128"] = round(ver[128]["speedup"], 3)
    if 32 in ver:
        out["mamba2_verify_speedup_t4_b32"] = round(ver[32]["speedup"], 3)
    out["linattn_replay_vs_recurrent_m16_b128"] = round(res["linattn_b128"]["m16_speedup"], 3)
    return out


def main():
    ceiling = copy_ceiling()
    print(f"copy ceiling {ceiling:.2f} TB/s; peer: {'mamba_ssm 2.3.2.post1' if ssu else 'none'}", flush=True)
    if DECODE_ONLY:
        decode_sweep(ceiling)
        return
    if "--verify-only" in sys.argv:
        verify_sweep()
        return
    if "--linattn-eqs" in sys.argv:
        linattn_eq9_eq10()
        return
    res = {"ceiling_tbs": ceiling, "decode": decode_sweep(ceiling), "verify": verify_sweep(),
           "linattn_b128": ring_sweep(), "linattn_eqs_b128": linattn_eq9_eq10()}
    print(json.dumps(summary(res), indent=1))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mamba2_bench.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out, "h200-mamba2.json"), "w") as f:
            json.dump(summary(res), f, indent=1)


if __name__ == "__main__":
    main()
