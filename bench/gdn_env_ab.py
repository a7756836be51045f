"""A/B of the library's benchmarking overrides (environment variables read when a pool is
created, src/linear/replay/cuda.rs) on GDN replay: decode steps (ring 16, whole flush cycles,
flush included) and verify + commit rounds (T drafts, T / 2 accepted on the device, whole
flush cycles) at the Qwen3-Next shape of bench_gdn.py. Each setting runs on a fresh pool in
one process, the settings interleaved over `--reps` passes (forward, then backward). A
setting is `NAME=value[;NAME=value...]` (`-`: none of the variables set). The first step's
(round's) outputs of every setting must equal the first setting's bit for bit (use it for
overrides that change no arithmetic); the script exits 1 if not.

    python3 gdn_env_ab.py [--layout v] [--batches 64,128,256] \
        --settings "-,KVR_GDN_PREP_SHARES=2,KVR_GDN_PREP_SHARES=4" [--verify-t 4,8] \
        [--verify-batches 32,128] [--reps 2]

Prints µs per step (round) per setting and its % of the floor (decode: the bytes bench_gdn.py
counts over the copy ceiling measured in the same run), the best pass of `--reps`; writes
$OUT/gdn_env_ab_<layout>.json.
"""

import json
import math
import os
import sys

import torch

import bench_gdn as bg
from benchutil import copy_ceiling, time_graph

RING = 16


def _arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def settings(s):
    out = []
    for x in s.split(","):
        env = () if x == "-" else tuple(tuple(a.split("=", 1)) for a in x.split(";"))
        out.append(env)
    return out


def name(s):
    return ";".join(f"{k}={v}" for k, v in s) or "-"


BATCHES = [int(x) for x in _arg("--batches", "64,128,256").split(",")]
SETTINGS = settings(_arg("--settings", "-"))
VARS = sorted({k for s in SETTINGS for k, _ in s})
VT = [int(x) for x in _arg("--verify-t", "").split(",") if x]
VBATCHES = [int(x) for x in _arg("--verify-batches", "32,128").split(",")]
REPS = int(_arg("--reps", "2"))


def apply(s):
    for k in VARS:
        os.environ.pop(k, None)
    for k, v in s:
        os.environ[k] = v


def passes():
    for r in range(REPS):
        yield SETTINGS if r % 2 == 0 else list(reversed(SETTINGS))


def timed(what, make, ns, calls, bad):
    """Best time (us a call) of each setting over the passes: `make()` builds a fresh pool and
    returns (fn(i), its output tensor, the pool); fn(0) runs once untimed, its output is
    compared with the first setting's, then `calls` calls (over `ns` input sets) a graph replay."""
    times, ref = {}, None
    for order in passes():
        for s in order:
            apply(s)
            fn, out_t, p = make()
            fn(0)
            torch.cuda.synchronize()
            out = out_t.clone()
            if ref is None:
                ref = out
            elif not torch.equal(out, ref):
                bad.append(f"{what} {name(s)}: outputs differ from {name(SETTINGS[0])}")
            times[s] = min(times.get(s, math.inf), time_graph(fn, ns, calls, replays=5, warm=False))
            bg.free(p)
    return times


def decode(B, ceil, bad):
    ns = bg.n_sets_for(B)
    inp = bg.Inputs(B, 1, ns, seed=B)
    S = torch.randn(B, bg.HV, bg.D, bg.D, device=bg.DEV) * 0.05
    floor_bytes = B * (bg.STATE * (1 + 1 / RING) + bg.ENTRY * ((RING + 1) / 2 + 1))

    def make():
        p, seqs = bg.pool(B, RING, ns)
        bg.import_states(p, seqs, 0, S)
        o = bg.Ours(p, seqs, inp)
        return o, o.out, p

    times = timed(f"decode B={B}", make, ns, ns * RING, bad)
    rows = []
    for s in SETTINGS:
        t = times[s]
        frac = floor_bytes / (ceil * 1e6) / t
        rows.append({"B": B, "setting": name(s), "us": t, "floor_frac": frac})
        print(f"decode B={B:3d} {name(s):40s} {t:7.1f} us ({100 * frac:4.1f} % of floor)", flush=True)
    return rows


def verify(B, T, bad):
    ns = bg.n_sets_for(B)
    inp = bg.Inputs(B, T, ns, seed=100 + T)
    acc = max(1, T // 2)
    c = bg.flush_cycle(RING, T, acc)

    def make():
        p, seqs = bg.pool(B, RING, ns, drafts=8)
        v = bg.Ours(p, seqs, inp, verify=True)
        cm = bg.Commit(p, seqs, acc)

        def rnd(i):
            v(i)
            cm(i)

        return rnd, v.out, p

    times = timed(f"verify B={B} T={T}", make, ns, ns * c * math.ceil(8 / c), bad)
    rows = []
    for s in SETTINGS:
        rows.append({"B": B, "T": T, "setting": name(s), "us": times[s]})
        print(f"verify B={B:3d} T={T} {name(s):36s} {times[s]:7.1f} us a round", flush=True)
    return rows


def main():
    ceil = copy_ceiling()
    print(f"layout {'V' if bg.LAYOUT else 'K'}-major, copy ceiling {ceil:.2f} TB/s, settings {[name(s) for s in SETTINGS]}", flush=True)
    bad = []
    res = {"copy_ceiling_tbs": ceil, "layout": "v" if bg.LAYOUT else "k", "decode": [], "verify": []}
    for B in BATCHES:
        res["decode"] += decode(B, ceil, bad)
        torch.cuda.empty_cache()
    for B in VBATCHES if VT else []:
        for T in VT:
            res["verify"] += verify(B, T, bad)
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"gdn_env_ab_{res['layout']}.json"), "w") as f:
            json.dump(res, f, indent=1)
    for b in bad:
        print("MISMATCH:", b)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
