#!/usr/bin/env python3
"""Converts a WG-KV gate checkpoint into GGUF gate tensors for kvreplay's write-gated pool.

    python3 scripts/wgkv_convert.py CHECKPOINT.pt OUT.gguf [--dtype f32|f16]

CHECKPOINT.pt is a WG-KV release file (`{model}-{lambda}.pt`, e.g.
llama-3.1-8b-instruct-0.16.pt): a `torch.save` dict holding only the gate parameters, fp32,
per attention layer N under `model.layers.N.self_attn.g_predictors.`:

    pre_key_norm.weight   [D]                 RMSNorm of the pre-RoPE key (shared by heads)
    post_key_norm.weight  [D]                 RMSNorm of the post-RoPE key
    conv1.weight          [H*hidden, 2*D, 1]  grouped 1x1 Conv1d, groups = H (KV heads)
    conv1.bias            [H*hidden]
    conv2.weight          [H, hidden, 1]      grouped 1x1 Conv1d, groups = H
    conv2.bias            [H]

OUT.gguf gets, per layer N (row-major shapes; GGUF lists the extents innermost first):

    blk.N.wg_gate.norm_pre.weight   [D]
    blk.N.wg_gate.norm_post.weight  [D]
    blk.N.wg_gate.fc1.weight        [H, hidden, 2*D]   (conv1.weight reshaped: head h's
                                                        rows h*hidden .. (h+1)*hidden)
    blk.N.wg_gate.fc1.bias          [H, hidden]
    blk.N.wg_gate.fc2.weight        [H, hidden]
    blk.N.wg_gate.fc2.bias          [H]

plus metadata general.architecture = "wg_gate", wg_gate.layer_count, .kv_heads, .head_dim,
.hidden, .source (the checkpoint's file name) and, when the name ends in `-{lambda}.pt`,
wg_gate.lambda. Load it with `kvr_wgkv_pool_load_gate` (C) or `GateWeights::from_gguf`
(Rust): pool layer j reads `blk.{j}` unless a block list says otherwise.

Reading the checkpoint uses torch when it is installed; otherwise a small reader of the
torch zip format built into this script (pickle + raw storages; no code from the file is
run: only tensor-rebuilding globals are accepted). Writing uses the `gguf` package from
PyPI (pinned; installed into .tools/gguf-py when missing, as scripts/make_tiny_models.py
does).
"""

import argparse
import collections
import os
import pickle
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, ".tools", "gguf-py")
GGUF_VERSION = "0.19.0"
PREFIX_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.g_predictors\.(.+)$")
PARTS = ["pre_key_norm.weight", "post_key_norm.weight", "conv1.weight", "conv1.bias",
         "conv2.weight", "conv2.bias"]


def ensure_gguf():
    try:
        import gguf  # noqa: F401
        return
    except ImportError:
        pass
    if not os.path.isdir(os.path.join(TOOLS, "gguf")):
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet",
                               "--disable-pip-version-check", "--target", TOOLS,
                               f"gguf=={GGUF_VERSION}"])
    sys.path.insert(0, TOOLS)


def load_torch_zip(path):
    """Reads a torch.save zip archive into {name: numpy array} without torch."""
    import numpy as np

    storages = {"FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
                "BFloat16Storage": "bf16"}
    zf = zipfile.ZipFile(path)
    pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise ValueError(f"{path}: not a torch zip checkpoint (no single data.pkl)")
    base = pkl[0][: -len("data.pkl")]

    def storage_array(kind, key):
        raw = zf.read(f"{base}data/{key}")
        if kind == "bf16":
            return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, dtype=np.dtype(kind).newbyteorder("<")).astype(np.float32)

    def rebuild_tensor(storage, offset, size, stride, *_):
        itemsize = storage.itemsize
        if len(size) == 0:
            return storage[offset:offset + 1].reshape(())
        return np.lib.stride_tricks.as_strided(
            storage[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)).copy()

    def rebuild_parameter(data, *_):
        return data

    class StorageType:
        def __init__(self, name):
            self.name = name

    class Reader(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "collections" and name == "OrderedDict":
                return collections.OrderedDict
            if module == "torch._utils" and name == "_rebuild_tensor_v2":
                return rebuild_tensor
            if module == "torch._utils" and name == "_rebuild_parameter":
                return rebuild_parameter
            if module == "torch" and name in storages:
                return StorageType(name)
            raise pickle.UnpicklingError(f"{path}: refusing global {module}.{name}")

        def persistent_load(self, pid):
            if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
                raise pickle.UnpicklingError(f"{path}: unexpected persistent id {pid!r}")
            kind = pid[1]
            name = kind.name if isinstance(kind, StorageType) else str(kind)
            if name not in storages:
                raise pickle.UnpicklingError(f"{path}: unsupported storage {name}")
            return storage_array(storages[name], pid[2])

    return dict(Reader(zf.open(pkl[0])).load())


def load_checkpoint(path):
    try:
        import torch
    except ImportError:
        return load_torch_zip(path)
    sd = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v.detach().float().numpy() for k, v in sd.items()}


def gate_layers(sd):
    """{layer: {part: array}} from a state dict; checks every layer is complete."""
    layers = collections.defaultdict(dict)
    for key, value in sd.items():
        m = PREFIX_RE.search(key)
        if m and m.group(2) in PARTS:
            layers[int(m.group(1))][m.group(2)] = value
    if not layers:
        raise ValueError("no gate parameters (layers.N.self_attn.g_predictors.*) found")
    for n, parts in sorted(layers.items()):
        missing = [p for p in PARTS if p not in parts]
        if missing:
            raise ValueError(f"layer {n} lacks {', '.join(missing)}")
    return dict(sorted(layers.items()))


def convert(src, dst, dtype="f32"):
    ensure_gguf()
    import gguf
    import numpy as np

    layers = gate_layers(load_checkpoint(src))
    first = next(iter(layers.values()))
    d = first["pre_key_norm.weight"].shape[0]
    h, hidden = first["conv2.weight"].shape[:2]
    np_dtype = np.float32 if dtype == "f32" else np.float16
    w = gguf.GGUFWriter(dst, "wg_gate")
    w.add_uint32("wg_gate.layer_count", len(layers))
    w.add_uint32("wg_gate.kv_heads", h)
    w.add_uint32("wg_gate.head_dim", d)
    w.add_uint32("wg_gate.hidden", hidden)
    name = os.path.basename(src)
    w.add_string("wg_gate.source", name)
    m = re.search(r"-([0-9.]+)\.pt$", name)
    if m:
        w.add_float32("wg_gate.lambda", float(m.group(1).rstrip(".")))
    for n, p in layers.items():
        want = {
            "pre_key_norm.weight": (d,), "post_key_norm.weight": (d,),
            "conv1.weight": (h * hidden, 2 * d, 1), "conv1.bias": (h * hidden,),
            "conv2.weight": (h, hidden, 1), "conv2.bias": (h,),
        }
        for part, shape in want.items():
            if tuple(p[part].shape) != shape:
                raise ValueError(f"layer {n} {part} has shape {tuple(p[part].shape)}; expected {shape}")
        out = {
            "norm_pre.weight": p["pre_key_norm.weight"],
            "norm_post.weight": p["post_key_norm.weight"],
            "fc1.weight": p["conv1.weight"].reshape(h, hidden, 2 * d),
            "fc1.bias": p["conv1.bias"].reshape(h, hidden),
            "fc2.weight": p["conv2.weight"].reshape(h, hidden),
            "fc2.bias": p["conv2.bias"],
        }
        for part, arr in out.items():
            w.add_tensor(f"blk.{n}.wg_gate.{part}", np.ascontiguousarray(arr, dtype=np_dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(layers), h, d, hidden


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    a = ap.parse_args()
    n, h, d, hidden = convert(a.checkpoint, a.out, a.dtype)
    print(f"{a.out}: {n} layers x {h} KV heads, head dim {d}, gate hidden {hidden} ({a.dtype})")


if __name__ == "__main__":
    main()
