#!/usr/bin/env python3
"""Tests scripts/wgkv_convert.py on a synthetic WG-KV checkpoint this test writes (no
downloads): tensor names, shapes and values, the grouped-Conv1d semantics of the
checkpoint against the per-head dense layers of the GGUF, refusals (missing part, wrong
shape, foreign pickle globals), and, when target/release/libkvreplay.so exists, loading
the result with kvr_wgkv_pool_load_gate through ctypes.

    python3 scripts/test_wgkv_convert.py

The checkpoint is written with torch.save when torch is installed (Parameters, as WG-KV's
train.py saves them); torch is too heavy for this machine, so otherwise the test writes
the same torch zip format itself (data.pkl + raw storages) and the converter reads it with
its built-in reader.
"""

import ctypes
import io
import os
import pickle
import sys
import tempfile
import types
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import wgkv_convert  # noqa: E402

try:
    wgkv_convert.ensure_gguf()
    import gguf  # noqa: E402
    import numpy as np  # noqa: E402
except Exception as e:  # offline and not installed: nothing to test with
    print(f"test_wgkv_convert: skipped (the gguf package is not available: {e})")
    sys.exit(0)

L, H, D, HID = 2, 2, 16, 8


def synthetic(rng):
    sd = {}
    for n in range(L):
        p = f"model.layers.{n}.self_attn.g_predictors."
        sd[p + "pre_key_norm.weight"] = rng.uniform(0.5, 1.5, D).astype(np.float32)
        sd[p + "post_key_norm.weight"] = rng.uniform(0.5, 1.5, D).astype(np.float32)
        sd[p + "conv1.weight"] = rng.uniform(-0.3, 0.3, (H * HID, 2 * D, 1)).astype(np.float32)
        sd[p + "conv1.bias"] = rng.uniform(-0.5, 0.5, H * HID).astype(np.float32)
        sd[p + "conv2.weight"] = rng.uniform(-1, 1, (H, HID, 1)).astype(np.float32)
        sd[p + "conv2.bias"] = rng.uniform(-1, 1, H).astype(np.float32)
    return sd


def save_checkpoint(sd, path):
    try:
        import torch
    except ImportError:
        return save_torch_zip(sd, path)
    torch.save({k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in sd.items()}, path)
    return "torch"


def save_torch_zip(sd, path):
    """torch.save's zip format, written without torch (fake torch globals for pickle)."""
    torch_mod = types.ModuleType("torch")
    utils_mod = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*a):
        raise AssertionError("never called")

    def _rebuild_parameter(*a):
        raise AssertionError("never called")

    class FloatStorage:
        pass

    for f, m in [(_rebuild_tensor_v2, utils_mod), (_rebuild_parameter, utils_mod)]:
        f.__module__ = m.__name__
        f.__qualname__ = f.__name__
        setattr(m, f.__name__, f)
    FloatStorage.__module__ = "torch"
    FloatStorage.__qualname__ = "FloatStorage"
    torch_mod.FloatStorage = FloatStorage
    torch_mod._utils = utils_mod
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = torch_mod, utils_mod

    class Storage:
        def __init__(self, key, n):
            self.key, self.n = key, n

    class Tensor:
        def __init__(self, storage, shape):
            self.storage, self.shape = storage, shape

        def __reduce__(self):
            stride = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
            t = (_rebuild_tensor_v2, (self.storage, 0, tuple(self.shape), stride, False,
                                      collections_ordered()))
            return (_rebuild_parameter, (TensorWrap(t), True, collections_ordered()))

    class TensorWrap:
        def __init__(self, r):
            self.r = r

        def __reduce__(self):
            return self.r

    def collections_ordered():
        import collections
        return collections.OrderedDict()

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                return ("storage", FloatStorage, obj.key, "cpu", obj.n)
            return None

    import collections
    objs = collections.OrderedDict()
    blobs = {}
    for i, (k, v) in enumerate(sd.items()):
        blobs[str(i)] = np.ascontiguousarray(v, dtype="<f4").tobytes()
        objs[k] = Tensor(Storage(str(i), v.size), v.shape)
    buf = io.BytesIO()
    try:
        P(buf, protocol=2).dump(objs)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
        for k, b in blobs.items():
            z.writestr(f"archive/data/{k}", b)
    return "built-in writer (no torch)"


def gelu(x):
    from math import erf, sqrt
    return 0.5 * x * (1 + np.vectorize(erf)(x / sqrt(2)))


def conv_gate(sd, n, pre, post):
    """The checkpoint's gate as WG-KV runs it: grouped 1x1 Conv1d over [H*2D] channels."""
    p = f"model.layers.{n}.self_attn.g_predictors."
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w  # noqa: E731
    x = np.concatenate([rms(pre, sd[p + "pre_key_norm.weight"]),
                        rms(post, sd[p + "post_key_norm.weight"])], -1)  # [H, 2D]
    chans = x.reshape(-1).astype(np.float64)  # channel h*2D + i
    w1, b1 = sd[p + "conv1.weight"][:, :, 0], sd[p + "conv1.bias"]
    hidden = np.zeros(H * HID)
    for o in range(H * HID):
        g = o // HID
        hidden[o] = w1[o] @ chans[g * 2 * D:(g + 1) * 2 * D] + b1[o]
    a = gelu(hidden)
    w2, b2 = sd[p + "conv2.weight"][:, :, 0], sd[p + "conv2.bias"]
    z = np.array([w2[h] @ a[h * HID:(h + 1) * HID] + b2[h] for h in range(H)])
    return np.maximum(1 / (1 + np.exp(-z)), 1e-3)


def dense_gate(t, n, pre, post):
    """The same from the GGUF tensors, as kvreplay reads them (per-head dense layers)."""
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w  # noqa: E731
    x = np.concatenate([rms(pre, t[f"blk.{n}.wg_gate.norm_pre.weight"]),
                        rms(post, t[f"blk.{n}.wg_gate.norm_post.weight"])], -1)
    fc1 = t[f"blk.{n}.wg_gate.fc1.weight"]
    a = gelu(np.einsum("hjk,hk->hj", fc1.astype(np.float64), x) + t[f"blk.{n}.wg_gate.fc1.bias"])
    z = (a * t[f"blk.{n}.wg_gate.fc2.weight"]).sum(-1) + t[f"blk.{n}.wg_gate.fc2.bias"]
    return np.maximum(1 / (1 + np.exp(-z)), 1e-3)


def read_gguf(path):
    r = gguf.GGUFReader(path)
    tensors = {t.name: np.array(t.data).reshape(tuple(int(x) for x in reversed(t.shape)))
               for t in r.tensors}
    meta = {f.name: f for f in r.fields.values()}
    return tensors, meta


def load_with_library(path):
    """kvr_wgkv_pool_load_gate on a CPU pool of the checkpoint's shape; returns the status."""
    so = os.path.join(ROOT, "target", "release", "libkvreplay.so")
    if not os.path.exists(so):
        return None
    lib = ctypes.CDLL(so)
    cp = ctypes.create_string_buffer(1024)
    assert lib.kvr_context_params_default(cp) == 0
    ctx = ctypes.c_void_p()
    assert lib.kvr_context_new(cp, ctypes.byref(ctx)) == 0, "kvr_context_new"

    class KvParams(ctypes.Structure):
        _fields_ = [("struct_size", ctypes.c_uint32), ("n_layers", ctypes.c_int32),
                    ("n_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                    ("page_size", ctypes.c_int32), ("dtype", ctypes.c_int32),
                    ("capacity_pages", ctypes.c_int64), ("capacity_bytes", ctypes.c_int64),
                    ("max_seqs", ctypes.c_int32), ("reserved", ctypes.c_int32),
                    ("max_seq_len", ctypes.c_int64), ("layers", ctypes.c_void_p)]

    kv = KvParams()
    assert lib.kvr_kv_pool_params_default(ctypes.byref(kv)) == 0
    kv.n_layers, kv.n_kv_heads, kv.head_dim, kv.capacity_pages = L, H, D, 64
    kv.max_seqs, kv.max_seq_len, kv.page_size = 2, 1024, 16
    pool = ctypes.c_void_p()
    assert lib.kvr_wgkv_pool_new(ctx, ctypes.byref(kv), None, ctypes.byref(pool)) == 0
    st = lib.kvr_wgkv_pool_load_gate(pool, path.encode(), None, 0)
    lib.kvr_error_last_message.restype = ctypes.c_char_p
    msg = lib.kvr_error_last_message().decode() if st else ""
    lib.kvr_wgkv_pool_free(pool)
    lib.kvr_context_free(ctx)
    return st, msg


def main():
    rng = np.random.default_rng(7)
    sd = synthetic(rng)
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "llama-3.1-8b-instruct-0.16.pt")
        how = save_checkpoint(sd, ck)
        out = os.path.join(tmp, "gate.gguf")
        assert wgkv_convert.convert(ck, out) == (L, H, D, HID)
        t, meta = read_gguf(out)
        assert len(t) == 6 * L, sorted(t)
        for n in range(L):
            p = f"model.layers.{n}.self_attn.g_predictors."
            assert np.array_equal(t[f"blk.{n}.wg_gate.fc1.weight"], sd[p + "conv1.weight"].reshape(H, HID, 2 * D))
            assert t[f"blk.{n}.wg_gate.fc2.weight"].shape == (H, HID)
            assert t[f"blk.{n}.wg_gate.fc2.bias"].shape == (H,)
            for _ in range(20):
                pre = rng.normal(size=(H, D))
                post = rng.normal(size=(H, D))
                a, b = conv_gate(sd, n, pre, post), dense_gate(t, n, pre, post)
                assert np.allclose(a, b, rtol=1e-5, atol=1e-7), (a, b)
        assert int(meta["wg_gate.hidden"].parts[-1][0]) == HID
        assert abs(float(meta["wg_gate.lambda"].parts[-1][0]) - 0.16) < 1e-6
        lib = load_with_library(out)
        # Refusals.
        bad = dict(sd)
        del bad["model.layers.1.self_attn.g_predictors.conv2.bias"]
        save_checkpoint(bad, ck)
        try:
            wgkv_convert.convert(ck, out)
            raise AssertionError("a missing part was accepted")
        except ValueError as e:
            assert "conv2.bias" in str(e), e
        bad = dict(sd)
        bad["model.layers.0.self_attn.g_predictors.conv1.bias"] = np.zeros(3, np.float32)
        save_checkpoint(bad, ck)
        try:
            wgkv_convert.convert(ck, out)
            raise AssertionError("a wrong shape was accepted")
        except ValueError as e:
            assert "conv1.bias" in str(e), e
        evil = os.path.join(tmp, "evil.pt")
        with zipfile.ZipFile(evil, "w") as z:
            z.writestr("archive/data.pkl", b"cos\nsystem\n(S'true'\ntR.")
        try:
            wgkv_convert.load_torch_zip(evil)
            raise AssertionError("a foreign global was accepted")
        except pickle.UnpicklingError as e:
            assert "refusing" in str(e), e
        # A GGUF with one tensor missing: the library refuses it.
        missing = os.path.join(tmp, "missing.gguf")
        w = gguf.GGUFWriter(missing, "wg_gate")
        for name, arr in t.items():
            if name != "blk.1.wg_gate.fc1.bias":
                w.add_tensor(name, np.ascontiguousarray(arr))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        lib_missing = load_with_library(missing)
    if lib is None:
        print("test_wgkv_convert: ok (checkpoint by %s; target/release/libkvreplay.so absent: "
              "library load skipped)" % how)
        return
    assert lib == (0, ""), lib
    assert lib_missing[0] == -11 and "blk.1.wg_gate.fc1.bias" in lib_missing[1], lib_missing
    print("test_wgkv_convert: ok (checkpoint by %s; loaded by kvr_wgkv_pool_load_gate)" % how)


if __name__ == "__main__":
    main()
