"""Gated DeltaNet replay benchmark (issue 4), one process, one run, on the device GPU.

Qwen3-Next layer shape (16 key heads, 32 value heads, dk = dv = 128), fp32 state, bf16
q/k/v/beta, fp32 g, L2-normalized q and k in the kernel. On the same inputs:

  decode   kvreplay recurrent mode (state read + written every step), kvreplay replay
           decode (checkpoint + ring, L in {8, 16, 32, 64}, averaged over whole flush
           cycles: the graph holds L steps per layer, so every replay crosses one flush
           per sequence; from B = 2 L also with the sequences' ring phases spread over the
           cycle, so that about B / L of them flush in each step, "staggered") and
           flash-linear-attention 0.6.0 fused_recurrent_gated_delta_rule,
           B in {1, 8, 32, 64, 128, 256}; outputs compared with fla (and a 20-step chained
           run compares outputs and final states).
  verify   speculative rounds (verify T drafts + commit with device-side accepted counts):
           replay (no per-draft state) vs the recurrent mode (one state snapshot per draft,
           commit copies the accepted one), T in {2, 4, 8}.
  kv-only  decode of short sequences (context 8..120) with no state vs the recurrent mode.
  memory   bytes per sequence and layer: T snapshots vs a ring.

Method (BENCHMARKS.md): every implementation runs under CUDA Graph replay (no host
launch overhead); states rotate over sets larger than 4x L2 (each set is a layer of our
pool and a separate state tensor for fla), as the other layers of a model would evict them.
Bandwidth counts the bytes each implementation must move (below), against a read+write
streaming ceiling (1 GiB copy) measured in the same run.

    python3 bench_gdn.py [--quick] [--tiles] [--srows] [--decode-only | --verify-only | --kvonly-only] [--layout k|v]
                         [--rings 8,16] [--batches 1,8,256]
                                        # writes $OUT/gdn_bench_<k|v>.json if $OUT is set
                                        # (a full V-major run also $OUT/h200-gdn.json, the
                                        # flat summary; --summarize V.json [K.json] prints it)
  --tiles        value rows per CTA of the warp decode kernel (KVR_GDN_DECODE_ROWS)
  --srows        value rows per CTA of the streaming decode kernel (KVR_GDN_STREAM_ROWS),
                 one CTA per item and persistent CTAs (KVR_GDN_STREAM_PERSIST=1)
  --decode-only  the decode sweep only
  --kvonly-only  the KV-only sweep only ($OUT/gdn_bench_kvonly.json)
  --kvonly-batches 1,8,64 batch sizes of the KV-only sweep (default 64; summary keys for B = 64, _b1, _b8)
  --kvonly-env "s4:KVR_GDN_KVDEC_SPLIT=4;e:KVR_GDN_KVDEC_EARLY_ROWS=8,KVR_GDN_KVDEC_SPLIT=8"
                 more KV-only pools beside the library's pick, each built under its environment
  --layout v     V-major pools (states imported transposed from fla's K-major)
  --rings, --batches   subsets of the ring lengths and batch sizes of the decode sweep
  --verify-rings 16,32,64   ring lengths of the verify sweep (default 16,64: the summary's verify
                 keys are ring 16, the decode figures' ring, and `_ring64`), --verify-batches
                 32,128 its batch sizes
  --verify-only  the verify sweep only ($OUT/gdn_bench_verify.json)

The decode sweep measures what the library picks (recurrent / replay columns) and, beside it
in the same run, each decode kernel forced: the streaming kernel (KVR_GDN_DECODE=stream,
kernels/gdn_stream.cu), the warp-per-rows kernel (KVR_GDN_DECODE=warp, kernels/gdn_decode.cu)
and the general step kernel (KVR_GDN_DECODE=general, kernels/gdn.cu).
"""

import json
import math
import os
import sys

import torch

import kvr
from benchutil import copy_ceiling, cur_stream, inplace_ceiling, read_ceiling, time_graph

QUICK = "--quick" in sys.argv
DEV = torch.device("cuda")
HK, HV, D = 16, 32, 128
STATE = HV * D * D * 4  # bytes of one sequence's fp32 state in one layer
ENTRY = (HV * D + HK * D) * 4 + HV * 4  # one f32 ring entry (u, k, g) of one sequence
L2_BYTES = torch.cuda.get_device_properties(0).L2_cache_size
ROTATE = 4 * L2_BYTES
def _arg_list(name, default):
    if name in sys.argv:
        return [int(x) for x in sys.argv[sys.argv.index(name) + 1].split(",")]
    return default


def _arg_str(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


BATCHES = _arg_list("--batches", [1, 8, 32, 64, 128, 256])
# --layout v: V-major pools ([dv][dk] states; imports transposed from fla's [dk][dv])
LAYOUT = 1 if "--layout" in sys.argv and sys.argv[sys.argv.index("--layout") + 1] == "v" else 0
RINGS = _arg_list("--rings", [8, 16, 32, 64])
# each decode kernel forced in turn (KVR_GDN_DECODE), beside what the library picks
KERNELS = (sys.argv[sys.argv.index("--kernels") + 1].split(",") if "--kernels" in sys.argv
           else ["wdecode", "fused", "stream", "warp", "general"])

lib = kvr.Lib()
ctx = lib.context(kvr.BACKEND_CUDA, stream=cur_stream())
STEP = lib.gdn_step_params(scale=0.0, l2norm=True)

try:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fr
    import fla

    FLA_VERSION = getattr(fla, "__version__", "?")
except Exception as e:  # noqa: BLE001
    fla_fr = None
    FLA_VERSION = f"unavailable ({type(e).__name__}: {e})"


def n_sets_for(B):
    return max(1, min(32, math.ceil(ROTATE / (B * STATE))))


class Inputs:
    """n_sets sets of inputs for B sequences x T tokens (q, k, v, beta bf16; g fp32)."""

    def __init__(self, B, T, n_sets, seed=0):
        g = torch.Generator(device=DEV)
        g.manual_seed(seed)
        self.B, self.T, self.n = B, T, n_sets

        def r(*shape, lo=-1.0, hi=1.0, dt=torch.bfloat16):
            return (torch.rand(*shape, generator=g, device=DEV) * (hi - lo) + lo).to(dt)

        self.q = [r(B, T, HK, D) for _ in range(n_sets)]
        self.k = [r(B, T, HK, D) for _ in range(n_sets)]
        self.v = [r(B, T, HV, D) for _ in range(n_sets)]
        self.g = [r(B, T, HV, lo=-0.4, hi=-0.01, dt=torch.float32) for _ in range(n_sets)]
        self.beta = [r(B, T, HV, lo=0.1, hi=0.9) for _ in range(n_sets)]
        self.t = [
            tuple(kvr.torch_tensor(x) for x in (self.q[i], self.k[i], self.v[i], self.g[i], self.beta[i]))
            for i in range(n_sets)
        ]


def pool(B, ring, layers, thr=kvr.GDN_THRESHOLD_OFF, entry=kvr.DTYPE_F32, drafts=0):
    p = lib.gdn_pool(ctx, n_layers=layers, n_k_heads=HK, n_v_heads=HV, dk=D, dv=D, ring_len=ring,
                     kv_only_threshold=thr, max_drafts=drafts, max_seqs=B, entry_dtype=entry, layout=LAYOUT)
    seqs = [lib.gdn_seq_add(p, cur_stream()) for _ in range(B)]
    return p, seqs


def free(p):
    lib.lib.kvr_gdn_pool_free(p)


def import_states(p, seqs, layer, S):
    """S: [B, HV, D, D] fp32 (K-major, as fla), transposed for a V-major pool."""
    for b, s in enumerate(seqs):
        x = S[b].transpose(-1, -2).contiguous() if LAYOUT else S[b]
        lib.gdn_import(p, layer, s, kvr.torch_tensor(x), None, cur_stream())
    torch.cuda.synchronize()


class Ours:
    """Decode (T = 1) or verify calls on a pool, rotating over its layers."""

    def __init__(self, p, seqs, inp, verify=False):
        self.ids = torch.tensor(seqs, dtype=torch.int32)  # host: travels in the launch parameters
        self.ids_t = kvr.torch_tensor(self.ids)
        self.out = torch.empty(inp.B, inp.T, HV, D, dtype=torch.bfloat16, device=DEV)
        self.out_t = kvr.torch_tensor(self.out)
        self.p, self.inp, self.verify = p, inp, verify

    def __call__(self, i):
        q, k, v, g, beta = self.inp.t[i]
        r = lib.gdn_step(self.verify, self.p, i, self.ids_t, q, k, v, g, beta, None, self.out_t, STEP, cur_stream())
        if r != 0:
            lib.check(r, "gdn step")


class Commit:
    def __init__(self, p, seqs, accepted):
        self.ids = torch.tensor(seqs, dtype=torch.int32)
        self.ids_t = kvr.torch_tensor(self.ids)
        self.acc = torch.full((len(seqs),), accepted, dtype=torch.int32, device=DEV)  # device counts
        self.acc_t = kvr.torch_tensor(self.acc)
        self.p = p

    def __call__(self, i):
        r = lib.gdn_commit(self.p, i, self.ids_t, self.acc_t, None, cur_stream())
        if r != 0:
            lib.check(r, "gdn commit")


def fla_fn(inp, states):
    def fn(i):
        return fla_fr(inp.q[i], inp.k[i], inp.v[i], g=inp.g[i], beta=inp.beta[i], scale=D ** -0.5,
                      initial_state=states[i], output_final_state=True, use_qk_l2norm_in_kernel=True)

    return fn


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def stagger(p, seqs, inp, L, n_layers):
    """Spread the sequences' ring phases over the cycle in every layer: the first B / L
    sequences get L - 1 steps, the next B / L get L - 2, ..., the last none (steps on
    prefixes of the batch), so that every later step of the whole batch flushes about B / L
    sequences instead of all of them at once."""
    B = len(seqs)
    for layer in range(n_layers):
        for k in range(1, L):
            n = ((L - k) * B) // L
            if n == 0:
                continue
            ids = torch.tensor(seqs[:n], dtype=torch.int32)
            out = torch.empty(n, 1, HV, D, dtype=torch.bfloat16, device=DEV)
            x = [kvr.torch_tensor(t[:n]) for t in (inp.q[layer], inp.k[layer], inp.v[layer], inp.g[layer], inp.beta[layer])]
            r = lib.gdn_step(False, p, layer, kvr.torch_tensor(ids), *x, None, kvr.torch_tensor(out), STEP, cur_stream())
            if r != 0:
                lib.check(r, "gdn step (stagger)")
    torch.cuda.synchronize()


def chained_check(results):
    """20 chained steps from the same random state: fla vs our replay (L = 16) and recurrent
    pools; outputs every step and the final states."""
    if fla_fr is None:
        return
    B = 8
    inp = Inputs(B, 1, 20, seed=7)
    S0 = torch.randn(B, HV, D, D, device=DEV) * 0.05
    report = {}
    for name, ring in (("replay16", 16), ("recurrent", 0)):
        p, seqs = pool(B, ring, 1)
        import_states(p, seqs, 0, S0)
        ours = Ours(p, seqs, Inputs(B, 1, 1))
        h = S0.clone()
        worst = 0.0
        for s in range(20):
            q, k, v, g, beta = (kvr.torch_tensor(x) for x in (inp.q[s], inp.k[s], inp.v[s], inp.g[s], inp.beta[s]))
            lib.check(lib.gdn_step(False, p, 0, ours.ids_t, q, k, v, g, beta, None, ours.out_t, STEP, cur_stream()), "step")
            o, h = fla_fr(inp.q[s], inp.k[s], inp.v[s], g=inp.g[s], beta=inp.beta[s], scale=D ** -0.5,
                          initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True)
            torch.cuda.synchronize()
            worst = max(worst, rel(ours.out, o))
        st = torch.empty(HV, D, D, device=DEV)
        state_err = 0.0
        for b, sq in enumerate(seqs):
            lib.gdn_export(p, 0, sq, kvr.torch_tensor(st), None, cur_stream())
            torch.cuda.synchronize()
            state_err = max(state_err, rel(st.transpose(-1, -2) if LAYOUT else st, h[b]))
        report[name] = {"max_out_rel_err": worst, "max_state_rel_err": state_err}
        free(p)
    results["chained_vs_fla"] = report
    print(f"20 chained steps vs fla (B=8): {report}", flush=True)


def decode_sweep(ceil_copy, results):
    print("\n== decode: us per step (graph), GB/s on the bytes each must move, % of floor", flush=True)
    rows = []
    for B in BATCHES:
        ns = n_sets_for(B)
        inp = Inputs(B, 1, ns, seed=B)
        row = {"B": B, "sets": ns}
        S = torch.randn(B, HV, D, D, device=DEV) * 0.05
        # fla
        if fla_fr is not None:
            states = [S] + [torch.randn(B, HV, D, D, device=DEV) * 0.05 for _ in range(ns - 1)]
            f = fla_fn(inp, states)
            ref, _ = f(0)
            torch.cuda.synchronize()
            t = time_graph(f, ns, ns * 16, replays=5)
            row["fla_us"] = t
            del states
        else:
            ref = None
        rec_bytes = 2 * B * STATE
        # ours: recurrent
        p, seqs = pool(B, 0, ns)
        import_states(p, seqs, 0, S)
        o = Ours(p, seqs, inp)
        o(0)
        torch.cuda.synchronize()
        if ref is not None:
            row["err_recurrent_vs_fla"] = rel(o.out, ref)
        row["recurrent_us"] = time_graph(o, ns, ns * 16, replays=5)
        free(p)
        # ours: replay, whole flush cycles
        for L in RINGS:
            p, seqs = pool(B, L, ns)
            import_states(p, seqs, 0, S)
            o = Ours(p, seqs, inp)
            o(0)
            torch.cuda.synchronize()
            if ref is not None:
                row[f"err_replay{L}_vs_fla"] = rel(o.out, ref)
            # Bring every layer's ring to a cycle boundary, then time L steps per layer.
            row[f"replay{L}_us"] = time_graph(o, ns, ns * L, replays=3 if QUICK else 5, warm=False)
            row[f"replay{L}_bytes"] = B * (STATE * (1 + 1 / L) + ENTRY * ((L + 1) / 2 + 1))
            free(p)
            if B >= 2 * L:
                # The same with the sequences' ring phases spread over the cycle (stagger):
                # about B / L of them flush in each step, as in a batch whose requests began
                # at different times, instead of all in one step of L. Same bytes a step.
                p, seqs = pool(B, L, ns)
                import_states(p, seqs, 0, S)
                stagger(p, seqs, inp, L, ns)
                o = Ours(p, seqs, inp)
                row[f"replay{L}_stag_us"] = time_graph(o, ns, ns * L, replays=3 if QUICK else 5, warm=False)
                free(p)
        # each decode kernel on the same work, for comparison (the default columns above are
        # what the library picks): the warp-streaming decode in two launches and in one
        # (kernels/gdn_wdecode.cu), the streaming kernel (kernels/gdn_stream.cu), the
        # warp-per-rows kernel (kernels/gdn_decode.cu) and the general step kernel (kernels/gdn.cu)
        for which in KERNELS:
            os.environ["KVR_GDN_DECODE"] = which
            for name, L in ((f"{which}_recurrent", 0), (f"{which}_replay16", 16)):
                p, seqs = pool(B, L, ns)
                import_states(p, seqs, 0, S)
                o = Ours(p, seqs, inp)
                o(0)
                torch.cuda.synchronize()
                if ref is not None:
                    row[f"err_{name}_vs_fla"] = rel(o.out, ref)
                row[f"{name}_us"] = time_graph(o, ns, ns * max(L, 16), replays=3 if QUICK else 5, warm=False)
                free(p)
        os.environ.pop("KVR_GDN_DECODE", None)
        row["recurrent_bytes"] = rec_bytes
        torch.cuda.empty_cache()
        rows.append(row)
        line = f"B={B:3d} sets={ns:2d}  "
        if "fla_us" in row:
            line += f"fla {row['fla_us']:8.1f} ({rec_bytes / row['fla_us'] / 1e3:5.0f} GB/s)  "
        line += f"recurrent {row['recurrent_us']:8.1f} ({rec_bytes / row['recurrent_us'] / 1e3:5.0f} GB/s, "
        line += f"{100 * rec_bytes / (ceil_copy * 1e6) / row['recurrent_us']:3.0f}% floor)  "
        for L in RINGS:
            t = row[f"replay{L}_us"]
            by = row[f"replay{L}_bytes"]
            line += f"L{L} {t:7.1f} ({100 * by / (ceil_copy * 1e6) / t:3.0f}%)  "
            if f"replay{L}_stag_us" in row:
                ts = row[f"replay{L}_stag_us"]
                line += f"staggered {ts:7.1f} ({100 * by / (ceil_copy * 1e6) / ts:3.0f}%)  "
        for which in KERNELS:
            line += f"{which}: rec {row[which + '_recurrent_us']:7.1f} L16 {row[which + '_replay16_us']:7.1f}  "
        if "fla_us" in row:
            line += "x fla: " + " ".join(f"{row['fla_us'] / row[f'replay{L}_us']:.2f}" for L in RINGS)
        print(line, flush=True)
    results["decode"] = rows


def flush_cycle(ring, T, acc):
    """Rounds from one flush to the next for verify rounds of T drafts with `acc` accepted
    each: a round flushes first when h + 2T > ring (src/linear/replay/meta.rs, needs_flush),
    and the ring holds `acc` entries after a flush round."""
    k = 1
    while k * acc + 2 * T <= ring:
        k += 1
    return k


def verify_sweep(results):
    print("\n== verify + commit rounds (device-side accepted counts): us per round", flush=True)
    rows = []
    rings = _arg_list("--verify-rings", [16, 64])
    for B in _arg_list("--verify-batches", [32] if QUICK else [32, 128]):
        ns = n_sets_for(B)
        # A replay decode step with each ring (whole flush cycles), for the rounds' cost in steps.
        dec = {}
        inp1 = Inputs(B, 1, ns, seed=B)
        for ring in rings:
            p, seqs = pool(B, ring, ns)
            dec[ring] = time_graph(Ours(p, seqs, inp1), ns, ns * ring, replays=5, warm=False)
            free(p)
        print(f"B={B:3d} replay decode step: " + "  ".join(f"L={r} {dec[r]:.1f}" for r in rings), flush=True)
        for T in (2, 4, 8):
            inp = Inputs(B, T, ns, seed=100 + T)
            acc = max(1, T // 2)
            row = {"B": B, "T": T, "accepted": acc, "sets": ns}
            row.update({f"decode{r}_us": dec[r] for r in rings})
            # Each graph holds whole flush cycles of every ring (and the same number of
            # recurrent rounds), so every timed replay pays the same share of flushes.
            cyc = {ring: flush_cycle(ring, T, acc) for ring in rings}
            for name, ring in [(f"replay{r}", r) for r in rings] + [("recurrent", 0)]:
                c = cyc.get(ring, 1)
                rounds = c * math.ceil(8 / c)
                p, seqs = pool(B, ring, ns, drafts=8)
                v = Ours(p, seqs, inp, verify=True)
                cm = Commit(p, seqs, acc)

                def rnd(i, v=v, cm=cm):
                    v(i)
                    cm(i)

                row[f"{name}_us"] = time_graph(rnd, ns, ns * rounds, replays=5, warm=False)
                if ring:
                    row[f"{name}_rounds_per_flush"] = c
                free(p)
            for r in rings:
                row[f"speedup{r}"] = row["recurrent_us"] / row[f"replay{r}_us"]
                row[f"over_decode{r}"] = row[f"replay{r}_us"] / dec[r]
            if 64 in rings:
                row["speedup"] = row["speedup64"]
            best = min(rings, key=lambda r: row[f"replay{r}_us"])
            row["best_ring"] = best
            rows.append(row)
            line = f"B={B:3d} T={T}  recurrent+snapshots {row['recurrent_us']:8.1f}"
            for r in rings:
                line += (f"  L={r} {row[f'replay{r}_us']:8.1f} ({row[f'speedup{r}']:.2f}x, "
                         f"{row[f'over_decode{r}']:.2f} steps, flush every {cyc[r]} rounds)")
            print(line, flush=True)
        torch.cuda.empty_cache()
    results["verify"] = rows


def kvonly_variants():
    """`--kvonly-env "s4:KVR_GDN_KVDEC_SPLIT=4;e8:KVR_GDN_KVDEC_EARLY_ROWS=8,KVR_GDN_KVDEC_SPLIT=8"`:
    more KV-only pools timed beside the library's pick, each built under its environment
    (a column `<name>_us` each)."""
    spec = _arg_str("--kvonly-env")
    out = []
    for item in filter(None, (spec or "").split(";")):
        name, _, envs = item.partition(":")
        out.append((name, dict(e.split("=", 1) for e in envs.split(",") if e)))
    return out


def kv_only_sweep(results):
    print("\n== KV-only (no state, bf16 entries) vs recurrent: us per decode step", flush=True)
    rows = []
    for B in _arg_list("--kvonly-batches", [64]):
        kv_only_rows(B, rows)
    results["kv_only"] = {"threshold": int(rows[0]["threshold"]), "rows": rows}


# Contexts of the KV-only sweep (after the steps of the timed graph: + 4); the last two are
# past the threshold (127), where the sequences have left KV-only mode.
KVONLY_CTXS = [4, 8, 16, 32, 64, 96, 120, 140, 196]


def kv_only_rows(B, rows):
    ns = n_sets_for(B)
    inp = Inputs(B, 1, ns, seed=3)
    p, seqs = pool(B, 0, ns)
    rec = time_graph(Ours(p, seqs, inp), ns, ns * 8, replays=5)
    free(p)
    # A replay pool without KV-only mode (ring 16): what the same sequences cost there.
    p, seqs = pool(B, 16, ns, entry=kvr.DTYPE_BF16)
    o = Ours(p, seqs, inp)
    for _ in range(20):
        for i in range(ns):
            o(i)
    torch.cuda.synchronize()
    off = time_graph(o, ns, ns * 16, replays=5, warm=False)
    free(p)
    # KV-only mode is opt-in (the default threshold is off): min(dk, what a head's f32 state
    # holds of bf16 entries) = 127, the largest useful threshold.
    cap = kvr.kv_only_threshold(D, D, 4, 2)
    assert lib.gdn_params_memory(n_layers=1, n_k_heads=HK, n_v_heads=HV, dk=D, dv=D, entry_dtype=kvr.DTYPE_BF16,
                                 kv_only_threshold=cap).kv_only_threshold == cap
    # The library's pick (kvr_gdn_kvdec for the KV-only rows, then the warp-streaming decode,
    # kernels/gdn_kvdec.cu) and, in the same run, the previous path: the KV-only kernel beside
    # the single-token decode kernel (KVR_GDN_KVDEC=0).
    pools = {}
    for name, env in [("kv_only", {}), ("previous", {"KVR_GDN_KVDEC": "0"})] + kvonly_variants():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        pools[name] = pool(B, 16, ns, thr=int(cap), entry=kvr.DTYPE_BF16)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    for c in KVONLY_CTXS:
        row = {"B": B, "context": c + 4, "recurrent_us": rec, "replay16_us": off, "threshold": int(cap)}
        for name, (p, seqs) in pools.items():
            o = Ours(p, seqs, inp)
            for s in seqs:
                lib.check(lib.lib.kvr_gdn_pool_seq_reset(p, s, kvr.ctypes.c_void_p(cur_stream())), "reset")
            for _ in range(c - 2):
                for i in range(ns):
                    o(i)
            torch.cuda.synchronize()
            # time_graph replays once untimed first: the timed steps run at context c + 2..c + 5.
            row[f"{name}_us"] = time_graph(o, ns, ns * 4, replays=1, warm=False)
            row[f"{name}_mode"] = lib.gdn_cursor(p, 0, seqs[0]).mode
        row["mode"] = row["kv_only_mode"]
        row["speedup"] = rec / row["kv_only_us"]
        row["speedup_previous"] = rec / row["previous_us"]
        row["vs_replay16"] = off / row["kv_only_us"]
        rows.append(row)
        extra = "".join(f"  {n} {row[n + '_us']:7.1f}" for n, _ in kvonly_variants())
        print(f"B={B:3d} context {c + 4:3d}  KV-only pool {row['kv_only_us']:7.1f}  (previous path "
              f"{row['previous_us']:7.1f})  recurrent {rec:7.1f}  replay L=16 {off:7.1f}  "
              f"x recurrent {row['speedup']:.2f} (was {row['speedup_previous']:.2f})  "
              f"x replay {row['vs_replay16']:.2f}  (mode {row['mode']}){extra}", flush=True)
    for p, _ in pools.values():
        free(p)


def memory_table(results):
    print("\n== memory per sequence and layer (Qwen3-Next GDN layer, fp32 state)", flush=True)
    rows = []
    for T in (2, 4, 8):
        snap = lib.gdn_params_memory(n_layers=1, n_k_heads=HK, n_v_heads=HV, dk=D, dv=D, ring_len=0, max_drafts=T)
        for L in RINGS:
            for ename, e in (("f32", kvr.DTYPE_F32), ("bf16", kvr.DTYPE_BF16)):
                if L < T:
                    continue
                m = lib.gdn_params_memory(n_layers=1, n_k_heads=HK, n_v_heads=HV, dk=D, dv=D, ring_len=L,
                                       max_drafts=T, entry_dtype=e)
                row = {"T": T, "L": L, "entries": ename, "snapshots_bytes": snap.total_bytes,
                       "replay_bytes": m.total_bytes, "seqs_ratio": snap.total_bytes / m.total_bytes}
                rows.append(row)
                print(f"T={T} L={L:2d} {ename:4s}: {snap.total_bytes / 2**20:6.2f} MiB with snapshots vs "
                      f"{m.total_bytes / 2**20:5.2f} MiB ring -> {row['seqs_ratio']:.2f}x sequences", flush=True)
    results["memory"] = rows


def tile_sweep(results):
    """Value rows per CTA of the decode kernel (KVR_GDN_DECODE_ROWS, read at pool creation)."""
    print("\n== decode rows per CTA: us per decode step (graph)", flush=True)
    rows = []
    for B in (1, 8, 64, 256):
        ns = n_sets_for(B)
        inp = Inputs(B, 1, ns, seed=11)
        for r in (8, 16, 32):
            os.environ["KVR_GDN_DECODE_ROWS"] = str(r)
            row = {"B": B, "rows": r}
            for name, ring in (("recurrent", 0), ("replay16", 16)):
                p, seqs = pool(B, ring, ns)
                row[name + "_us"] = time_graph(Ours(p, seqs, inp), ns, ns * 16, replays=3, warm=False)
                free(p)
            rows.append(row)
            print(f"B={B:3d} rows {r:3d}: recurrent {row['recurrent_us']:8.1f}  replay16 {row['replay16_us']:8.1f}",
                  flush=True)
        os.environ.pop("KVR_GDN_DECODE_ROWS", None)
    results["decode_rows"] = rows


def stream_rows_sweep(results):
    """Value rows per CTA of the streaming decode kernel (KVR_GDN_STREAM_ROWS, read at pool
    creation)."""
    print("\n== streaming decode rows per CTA: us per decode step (graph)", flush=True)
    rows = []
    for B in (1, 8, 64, 256):
        ns = n_sets_for(B)
        inp = Inputs(B, 1, ns, seed=12)
        for r in (16, 32, 64, 128):
            if LAYOUT == 0 and r < 32:
                continue
            os.environ["KVR_GDN_STREAM_ROWS"] = str(r)
            row = {"B": B, "rows": r}
            for persist in ("0", "1"):
                os.environ["KVR_GDN_STREAM_PERSIST"] = persist
                for name, ring in (("recurrent", 0), ("replay16", 16)):
                    p, seqs = pool(B, ring, ns)
                    key = name + ("_persistent" if persist == "1" else "") + "_us"
                    row[key] = time_graph(Ours(p, seqs, inp), ns, ns * 16, replays=3, warm=False)
                    free(p)
            rows.append(row)
            print(f"B={B:3d} rows {r:3d}: recurrent {row['recurrent_us']:8.1f}  replay16 {row['replay16_us']:8.1f}  "
                  f"persistent: recurrent {row['recurrent_persistent_us']:8.1f}  "
                  f"replay16 {row['replay16_persistent_us']:8.1f}", flush=True)
        os.environ.pop("KVR_GDN_STREAM_ROWS", None)
        os.environ.pop("KVR_GDN_STREAM_PERSIST", None)
    results["stream_rows"] = rows


def summary(v, k=None):
    """The flat figures issue 14 lists (bench/results/h200.json), from a V-major run's results
    (`v`, the full sweep) and optionally a K-major decode run's (`k`): fla / ours ratios,
    floor fractions and speedups; replay rows are the L = 16 column averaged over flush cycles."""
    out = {}
    dec = {r["B"]: r for r in v.get("decode", [])}
    ceil = v["copy_tbs"] * 1e6  # bytes per us

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    for B in (1, 8, 128, 256):
        if B in dec:
            r = dec[B]
            out[f"gdn_decode_replay16_vs_fla_b{B}"] = ratio(r.get("fla_us"), r["replay16_us"])
    for B in (1, 8):
        if B in dec:
            out[f"gdn_decode_replay16_b{B}_us"] = round(dec[B]["replay16_us"], 2)
    for B in (1, 128, 256):
        if B in dec:
            out[f"gdn_recurrent_b{B}_us"] = round(dec[B]["recurrent_us"], 2)
    for B in (128, 256):
        if B in dec:
            r = dec[B]
            out[f"gdn_decode_replay16_floor_frac_b{B}"] = round(r["replay16_bytes"] / ceil / r["replay16_us"], 3)
            if "replay16_stag_us" in r:  # ring phases spread over the batch (decode_sweep)
                out[f"gdn_decode_replay16_stag_floor_frac_b{B}"] = round(r["replay16_bytes"] / ceil / r["replay16_stag_us"], 3)
                out[f"gdn_decode_replay16_stag_vs_fla_b{B}"] = ratio(r.get("fla_us"), r["replay16_stag_us"])
    if 256 in dec:
        out["gdn_recurrent_vs_fla_b256"] = ratio(dec[256].get("fla_us"), dec[256]["recurrent_us"])
    # issue 14 target 2: recurrent mode at >= 80 % of the copy ceiling from B = 64
    for B in (64, 128):
        if B in dec:
            r = dec[B]
            out[f"gdn_recurrent_floor_frac_b{B}"] = round(r["recurrent_bytes"] / ceil / r["recurrent_us"], 3)
    # Verify: rounds over whole flush cycles, on pools with the decode figures' ring (16) and
    # with a ring of 64; the round's cost in replay decode steps of the same ring, same run.
    ver = {(r["B"], r["T"]): r for r in v.get("verify", [])}
    for B in (32, 128):
        for T in (4, 8):
            r = ver.get((B, T), {})
            for ring, suffix in ((16, ""), (64, "_ring64")):
                if f"speedup{ring}" in r:
                    out[f"gdn_verify_speedup_t{T}_b{B}{suffix}"] = round(r[f"speedup{ring}"], 3)
    for ring, suffix in ((16, ""), (64, "_ring64")):
        r = ver.get((128, 4), {})
        if f"over_decode{ring}" in r:
            out[f"gdn_verify_t4_over_decode_b128{suffix}"] = round(r[f"over_decode{ring}"], 3)
    kvr_rows = v.get("kv_only", {}).get("rows", [])
    for B, suffix in ((64, ""), (1, "_b1"), (8, "_b8")):
        kvo = [r for r in kvr_rows if r["B"] == B and r["mode"] == 0]
        for want in (8, 64, 124):
            if kvo:
                r = min(kvo, key=lambda x: abs(x["context"] - want))
                out[f"gdn_kvonly_vs_recurrent_ctx{want}{suffix}"] = round(r["speedup"], 3)
                out[f"gdn_kvonly_vs_replay16_ctx{want}{suffix}"] = round(r["vs_replay16"], 3)
                if not suffix:
                    out[f"gdn_kvonly_ctx{want}_measured_at"] = r["context"]
                    out[f"gdn_kvonly_vs_previous_ctx{want}"] = round(r["kv_only_us"] and
                                                                    r["previous_us"] / r["kv_only_us"], 3)
        if kvo:
            out[f"gdn_kvonly_min_vs_recurrent{suffix}"] = round(min(r["speedup"] for r in kvo), 3)
        # Past the threshold: the KV-only pool's replay steps against a pool without the mode
        # (the longest context: its 4 timed steps hold no flush; the pool without the mode is
        # timed over whole flush cycles).
        past = [r for r in kvr_rows if r["B"] == B and r["mode"] != 0]
        if past:
            r = max(past, key=lambda x: x["context"])
            out[f"gdn_kvonly_pool_past_threshold_vs_replay16{suffix}"] = round(r["vs_replay16"], 3)
    if k is not None:
        kd = {r["B"]: r for r in k.get("decode", [])}
        # K-major verify (a `--verify-only` run of the default layout): ring 16 and 64.
        kver = {(r["B"], r["T"]): r for r in k.get("verify", [])}
        for (B, T), r in sorted(kver.items()):
            for ring, suffix in ((16, ""), (64, "_ring64")):
                if B in (32, 128) and T in (4, 8) and f"speedup{ring}" in r:
                    out[f"gdn_verify_speedup_t{T}_b{B}{suffix}_kmajor"] = round(r[f"speedup{ring}"], 3)
                if (B, T) == (128, 4) and f"over_decode{ring}" in r:
                    out[f"gdn_verify_t4_over_decode_b128{suffix}_kmajor"] = round(r[f"over_decode{ring}"], 3)
        for B in (1, 8, 128, 256):
            if B in kd:
                out[f"gdn_decode_replay16_vs_fla_b{B}_kmajor"] = ratio(kd[B].get("fla_us"), kd[B]["replay16_us"])
                out[f"gdn_recurrent_vs_fla_b{B}_kmajor"] = ratio(kd[B].get("fla_us"), kd[B]["recurrent_us"])
        for B in (1, 8):
            if B in kd:
                out[f"gdn_decode_replay16_b{B}_us_kmajor"] = round(kd[B]["replay16_us"], 2)
                out[f"gdn_recurrent_b{B}_us_kmajor"] = round(kd[B]["recurrent_us"], 2)
        kceil = k["copy_tbs"] * 1e6
        for B in (64, 128, 256):
            if B in kd:
                r = kd[B]
                if B >= 128:
                    out[f"gdn_decode_replay16_floor_frac_b{B}_kmajor"] = round(r["replay16_bytes"] / kceil / r["replay16_us"], 3)
                    if "replay16_stag_us" in r:
                        out[f"gdn_decode_replay16_stag_floor_frac_b{B}_kmajor"] = round(
                            r["replay16_bytes"] / kceil / r["replay16_stag_us"], 3)
                out[f"gdn_recurrent_floor_frac_b{B}_kmajor"] = round(r["recurrent_bytes"] / kceil / r["recurrent_us"], 3)
    if dec:
        out["gdn_copy_ceiling_tbs"] = round(v["copy_tbs"], 3)
    return out


def main():
    if "--summarize" in sys.argv:  # bench_gdn.py --summarize gdn_bench_v.json [gdn_bench_k.json]
        i = sys.argv.index("--summarize")
        files = sys.argv[i + 1:]
        v = json.load(open(files[0]))
        k = json.load(open(files[1])) if len(files) > 1 else None
        print(json.dumps(summary(v, k), indent=1))
        return
    props = torch.cuda.get_device_properties(0)
    results = {"device": props.name, "fla": FLA_VERSION, "torch": torch.__version__,
               "kvreplay": lib.lib.kvr_library_version().decode()}
    results["read_tbs"] = read_ceiling()
    results["copy_tbs"] = copy_ceiling()
    results["inplace_tbs"] = inplace_ceiling()
    print(f"{props.name}: read {results['read_tbs']:.2f} TB/s, copy {results['copy_tbs']:.2f} TB/s, "
          f"in place {results['inplace_tbs']:.2f} TB/s "
          f"(both directions), fla {FLA_VERSION}", flush=True)
    chained_check(results)
    if "--tiles" in sys.argv:
        tile_sweep(results)
    if "--srows" in sys.argv:
        stream_rows_sweep(results)
    if "--verify-only" in sys.argv:
        verify_sweep(results)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "gdn_bench_verify.json"), "w") as f:
                json.dump(results, f, indent=1)
        return
    if "--kvonly-only" in sys.argv:
        kv_only_sweep(results)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "gdn_bench_kvonly.json"), "w") as f:
                json.dump(results, f, indent=1)
        return
    decode_sweep(results["copy_tbs"], results)
    if "--decode-only" not in sys.argv:
        verify_sweep(results)
        kv_only_sweep(results)
        memory_table(results)
    out = os.environ.get("OUT")
    if out:
        name = "gdn_bench_v.json" if LAYOUT else "gdn_bench_k.json"
        if LAYOUT and "--decode-only" not in sys.argv:
            with open(os.path.join(out, "h200-gdn.json"), "w") as f:
                json.dump(summary(results), f, indent=1)
        with open(os.path.join(out, name), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
