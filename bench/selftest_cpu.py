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
    lib.write(pool, kvr.ALL_LAYERS, [s], [n], kt, vt)
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
print(f"bench/kvr.py bindings: ok (kvreplay {lib.lib.kvr_version().decode()}, max error {worst:.1e})")
