"""Checks bench/kvr.py's ctypes structs against the library on the CPU backend (numpy):
a pool built through the bindings, a decode, and an attention computed with numpy."""
import ctypes
import math
import sys

import numpy as np

import kvr

lib = kvr.Lib(sys.argv[1] if len(sys.argv) > 1 else None)
ctx = lib.context(kvr.BACKEND_CPU, threads=2)
L, H, D, P = 2, 2, 16, 4
pool = lib.pool(ctx, L, H, D, P, kvr.DTYPE_F32, 64, 8, 1024)
rng = np.random.default_rng(0)
lens = [5, 17, 1]
data = {}
for n in lens:
    s = lib.seq_add(pool)
    assert lib.extend(pool, [s], [n]) == 0
    k = rng.standard_normal((L, n, H, D), dtype=np.float32)
    v = rng.standard_normal((L, n, H, D), dtype=np.float32)
    kt = kvr.tensor(k.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(k.shape))
    vt = kvr.tensor(v.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(v.shape))
    lib.write(pool, kvr.LAYER_ALL, [s], [n], kt, vt)
    data[s] = (k, v)
st = lib.stats(pool)
assert st.sequences == 3 and st.tokens == sum(lens), (st.sequences, st.tokens)
assert st.pages_used == sum((n + P - 1) // P for n in lens)
ids = np.array(list(data.keys()), dtype=np.int32)
G = 3
q = rng.standard_normal((len(ids), H * G, D), dtype=np.float32)
out = np.zeros_like(q)
lse = np.zeros((len(ids), H * G), dtype=np.float32)
prm = lib.decode_params(softcap=0.0)
r = lib.decode(
    pool,
    1,
    kvr.tensor(ids.ctypes.data, kvr.DTYPE_I32, kvr.DEVICE_HOST, [len(ids)]),
    kvr.tensor(q.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(q.shape)),
    kvr.tensor(out.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(out.shape)),
    kvr.tensor(lse.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(lse.shape)),
    prm,
)
lib.check(r, "decode")
worst = 0.0
for b, s in enumerate(ids):
    k, v = data[s]
    for h in range(H * G):
        kh, vh = k[1, :, h // G, :].astype(np.float64), v[1, :, h // G, :].astype(np.float64)
        sc = kh @ q[b, h].astype(np.float64) / np.sqrt(D)
        m = sc.max()
        p = np.exp(sc - m)
        o = (p @ vh) / p.sum()
        worst = max(worst, float(np.abs(o - out[b, h]).max()))
        worst = max(worst, abs(float(m + np.log(p.sum())) - float(lse[b, h])))
assert worst < 1e-4, worst
print(f"bench/kvr.py bindings: ok (kvreplay {lib.lib.kvr_library_version().decode()}, max error {worst:.1e})")

# --- GDN bindings: a replay pool and a recurrent pool through ctypes, verify + commit, against
# a numpy recurrence.
Hk, Hv, Dk = 1, 2, 32
gp = lib.gdn_pool(ctx, n_layers=2, n_k_heads=Hk, n_v_heads=Hv, dk=Dk, dv=Dk, ring_len=8, max_seqs=4,
                  kv_only_threshold=0, max_drafts=4)
mem = lib.gdn_params_memory(n_layers=2, n_k_heads=Hk, n_v_heads=Hv, dk=Dk, dv=Dk, ring_len=8, max_drafts=4)
assert mem.state_bytes == 2 * Hv * Dk * Dk * 4 and mem.snapshot_bytes == 0, (mem.state_bytes, mem.snapshot_bytes)
sq = lib.gdn_seq_add(gp)
S = np.zeros((Hv, Dk, Dk))  # [h][v][k]


def ref_step(S, q, k, v, g, beta):
    y = np.zeros((Hv, Dk))
    for h in range(Hv):
        qq = q[h * Hk // Hv] / np.sqrt((q[h * Hk // Hv] ** 2).sum() + 1e-6) / np.sqrt(Dk)
        kk = k[h * Hk // Hv] / np.sqrt((k[h * Hk // Hv] ** 2).sum() + 1e-6)
        S[h] *= np.exp(g[h])
        u = beta[h] * (v[h] - S[h] @ kk)
        S[h] += np.outer(u, kk)
        y[h] = S[h] @ qq
    return y


gw = 0.0
ids = np.array([sq], dtype=np.int32)
it = kvr.tensor(ids.ctypes.data, kvr.DTYPE_I32, kvr.DEVICE_HOST, [1])
for rnd in range(6):
    T = 1 + rnd % 4
    q = rng.uniform(-1, 1, (1, T, Hk, Dk)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, T, Hk, Dk)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, T, Hv, Dk)).astype(np.float32)
    g = rng.uniform(-0.4, -0.01, (1, T, Hv)).astype(np.float32)
    be = rng.uniform(0.1, 0.9, (1, T, Hv)).astype(np.float32)
    o = np.zeros((1, T, Hv, Dk), dtype=np.float32)
    ts = [kvr.tensor(a.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(a.shape)) for a in (q, k, v, g, be, o)]
    lib.check(lib.gdn_step(True, gp, 1, it, *ts[:5], None, ts[5], lib.gdn_step_params()), "verify")
    acc = np.array([rnd % (T + 1)], dtype=np.int32)
    lib.check(lib.gdn_commit(gp, 1, it, kvr.tensor(acc.ctypes.data, kvr.DTYPE_I32, kvr.DEVICE_HOST, [1])), "commit")
    probe = S.copy()
    for t in range(T):
        y = ref_step(probe, q[0, t], k[0, t], v[0, t], g[0, t], be[0, t])
        gw = max(gw, float(np.abs(y - o[0, t]).max()))
        if t + 1 == acc[0]:
            S = probe.copy()
info = lib.gdn_cursor(gp, 1, sq)
assert info.mode == kvr.GDN_MODE_REPLAY and info.pending == 0, (info.mode, info.pending)
st = np.zeros((Hv, Dk, Dk), dtype=np.float32)  # K-major: [h][k][v]
lib.gdn_export(gp, 1, sq, kvr.tensor(st.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(st.shape)))
gw = max(gw, float(np.abs(st.transpose(0, 2, 1) - S).max()))
assert gw < 1e-4, gw
lib.lib.kvr_gdn_pool_free(gp)
print(f"bench/kvr.py GDN bindings: ok (max error {gw:.1e})")

# --- Write-gated KV bindings: a pool in write-gated mode, prefill + single-token appends with
# host scores (one sequence) and with the library's gate from pre-RoPE keys (another), decode,
# against numpy attention over exactly the kept tokens (ring + admitted), plus row / pool stats.
WL, WH, WD, WP, WW, TAU = 2, 2, 16, 4, 8, 0.1
WG = 3  # query heads per KV head
HID = 8
wp = lib.wgkv_pool(ctx, WL, WH, WD, WP, kvr.DTYPE_F32, 256, 4, 256, local_window=WW, tau=TAU)
gate = []
for _ in range(WL):
    gate.append({
        "norm_pre": rng.uniform(0.5, 1.5, WD).astype(np.float32),
        "norm_post": rng.uniform(0.5, 1.5, WD).astype(np.float32),
        "fc1_weight": rng.uniform(-0.5, 0.5, (WH, HID, 2 * WD)).astype(np.float32),
        "fc1_bias": rng.uniform(-0.5, 0.5, (WH, HID)).astype(np.float32),
        "fc2_weight": rng.uniform(-1, 1, (WH, HID)).astype(np.float32),
        "fc2_bias": np.array([-1.5, -2.5], dtype=np.float32)[:WH].copy(),
    })
lib.wgkv_set_gate(wp, gate, HID)


def np_gate(l, pre, post):
    """Scores [n, H] of the gate formula in float64."""
    g = gate[l]
    out = np.zeros(pre.shape[:2])
    for h in range(WH):
        a = pre[:, h].astype(np.float64)
        b = post[:, h].astype(np.float64)
        x = np.concatenate([a / np.sqrt((a * a).mean(1, keepdims=True) + 1e-6) * g["norm_pre"],
                            b / np.sqrt((b * b).mean(1, keepdims=True) + 1e-6) * g["norm_post"]], 1)
        z = x @ g["fc1_weight"][h].astype(np.float64).T + g["fc1_bias"][h]
        erf = np.vectorize(math.erf)
        z = 0.5 * z * (1 + erf(z / math.sqrt(2)))
        s = 1 / (1 + np.exp(-(z @ g["fc2_weight"][h] + g["fc2_bias"][h])))
        out[:, h] = np.maximum(s, 1e-3)
    return out


hist = {}  # seq -> per layer lists of (k [n,H,D], v, scores [n,H])


def wg_append(seq, layer, n, gated):
    k = rng.standard_normal((n, WH, WD), dtype=np.float32)
    v = rng.standard_normal((n, WH, WD), dtype=np.float32)
    T = lambda a: kvr.tensor(a.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(a.shape))  # noqa: E731
    if gated:
        kp = rng.standard_normal((n, WH, WD), dtype=np.float32)
        sc = np_gate(layer, kp, k)
        lib.check(lib.wgkv_append(wp, seq, layer, T(k), T(v), k_pre=T(kp)), "wgkv append (gate)")
    else:
        # 0/1 scores, some exactly tau (strict: dropped) and some just above.
        sc = (rng.uniform(0, 1, (n, WH)) < 0.4).astype(np.float32)
        sc[rng.uniform(0, 1, (n, WH)) < 0.1] = TAU
        sc[rng.uniform(0, 1, (n, WH)) < 0.05] = np.nextafter(np.float32(TAU), np.float32(1))
        sc = np.ascontiguousarray(sc, dtype=np.float32)
        lib.check(lib.wgkv_append(wp, seq, layer, T(k), T(v), scores=T(sc)), "wgkv append (scores)")
    hist.setdefault(seq, [[] for _ in range(WL)])[layer].append((k, v, sc))


def kept_mask(seq, layer):
    sc = np.concatenate([x[2] for x in hist[seq][layer]])
    n = sc.shape[0]
    keep = sc.astype(np.float32) > np.float32(TAU)
    keep[max(0, n - WW):] = True
    return keep


seq_a = lib.wgkv_seq_add(wp)
seq_b = lib.wgkv_seq_add(wp)
for layer in range(WL):
    wg_append(seq_a, layer, 37, False)
    wg_append(seq_b, layer, 29, True)
for step in range(5):
    for layer in range(WL):
        wg_append(seq_a, layer, 1, False)
        wg_append(seq_b, layer, 1 + step % 2, True)
# Gate scores near tau would make the float64 mirror and the library's f32 disagree.
for layer in range(WL):
    sc = np.concatenate([x[2] for x in hist[seq_b][layer]])
    assert np.abs(sc - TAU).min() > 1e-5, "a gate score too close to tau for this check"
    assert 0 < (sc[:-WW] > TAU).mean() < 1, "the gate should keep some tokens and drop others"
wids = np.array([seq_b, seq_a], dtype=np.int32)
wq = rng.standard_normal((2, WH * WG, WD), dtype=np.float32)
wout = np.zeros_like(wq)
wlse = np.zeros((2, WH * WG), dtype=np.float32)
ww = 0.0
n_kept = 0
for layer in range(WL):
    lib.check(lib.wgkv_decode(
        wp, layer,
        kvr.tensor(wids.ctypes.data, kvr.DTYPE_I32, kvr.DEVICE_HOST, [2]),
        kvr.tensor(wq.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(wq.shape)),
        kvr.tensor(wout.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(wout.shape)),
        kvr.tensor(wlse.ctypes.data, kvr.DTYPE_F32, kvr.DEVICE_HOST, list(wlse.shape)),
        lib.decode_params()), "wgkv decode")
    for b, s in enumerate(wids):
        rows = lib.wgkv_rows(wp, int(s))
        assert len(rows) == WL * WH, len(rows)
        K = np.concatenate([x[0] for x in hist[s][layer]])
        V = np.concatenate([x[1] for x in hist[s][layer]])
        keep = kept_mask(s, layer)
        for h in range(WH * WG):
            kh = h // WG
            r = rows[layer * WH + kh]
            m = keep[:, kh]
            assert r.total == K.shape[0] and r.ring == min(WW, K.shape[0]) and r.drafts == 0, (r.total, r.ring)
            assert r.ring + getattr(r, "global") == int(m.sum()), (layer, kh, r.ring, getattr(r, "global"), int(m.sum()))
            sc = K[m, kh].astype(np.float64) @ wq[b, h].astype(np.float64) / np.sqrt(WD)
            mx = sc.max()
            p = np.exp(sc - mx)
            o = (p @ V[m, kh].astype(np.float64)) / p.sum()
            ww = max(ww, float(np.abs(o - wout[b, h]).max()), abs(float(mx + np.log(p.sum())) - float(wlse[b, h])))
        n_kept += int(keep.sum())
assert ww < 1e-4, ww
wst = lib.wgkv_stats(wp)
assert wst.sequences == 2 and wst.kept_tokens == n_kept, (wst.sequences, wst.kept_tokens, n_kept)
full = sum(sum(x[0].shape[0] for x in hist[s][layer]) for s in hist for layer in range(WL)) * WH
assert wst.full_tokens == full and wst.page_bytes == 2 * WP * WD * 4, (wst.full_tokens, full, wst.page_bytes)
assert 0 < wst.pages_used and wst.pages_used + wst.pages_free == wst.pages_total
lib.wgkv_seq_free(wp, seq_a)
assert lib.wgkv_stats(wp).sequences == 1
lib.wgkv_free(wp)
print(f"bench/kvr.py write-gated KV bindings: ok ({n_kept} of {full} tokens kept, max error {ww:.1e})")
