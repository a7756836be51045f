"""Checks bench/kvr.py's ctypes structs against the library on the CPU backend (numpy):
a pool built through the bindings, a decode, and an attention computed with numpy."""
import ctypes
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
