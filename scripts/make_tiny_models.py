#!/usr/bin/env python3
"""Writes small random-weight GGUF files with the real key and tensor names of each
architecture kvreplay plans for, using llama.cpp's own writer (the `gguf` package from
PyPI, pinned): tests/data/tiny-<arch>.gguf.

    python3 scripts/make_tiny_models.py [out_dir]    # default: tests/data

The files are committed (the tests and the fuzz corpus read them); this script reproduces
them bit for bit (fixed seeds). It installs gguf into .tools/gguf-py when missing.

Key names come from gguf.constants.Keys through GGUFWriter's add_* helpers (for example
add_ssm_state_size writes "{arch}.ssm.state_size"); tensor names from
gguf.constants.TENSOR_NAMES ("blk.{bid}.ssm_a", ...). Layer kinds follow llama.cpp's
loaders: qwen3next / qwen35 mark layer i recurrent when (i + 1) % full_attention_interval
!= 0; nemotron_h when head_count_kv(i) == 0 and feed_forward_length(i) == 0 (attention when
head_count_kv > 0, an MLP-only block otherwise); granitehybrid when head_count_kv(i) == 0.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, ".tools", "gguf-py")
GGUF_VERSION = "0.19.0"


def ensure_gguf():
    try:
        import gguf  # noqa: F401
        return
    except ImportError:
        pass
    if not os.path.isdir(os.path.join(TOOLS, "gguf")):
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--target", TOOLS, f"gguf=={GGUF_VERSION}"])
    sys.path.insert(0, TOOLS)


ensure_gguf()
import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES  # noqa: E402


def tname(t, bid=None, suffix="weight"):
    base = TENSOR_NAMES[t].format(bid=bid) if bid is not None else TENSOR_NAMES[t]
    return f"{base}.{suffix}" if suffix else base


class Tiny:
    def __init__(self, out_dir, arch, seed):
        self.path = os.path.join(out_dir, f"tiny-{arch}.gguf")
        self.w = gguf.GGUFWriter(self.path, arch)
        self.rng = np.random.default_rng(seed)
        self.w.add_name(f"kvreplay tiny {arch}")

    def tensor(self, name, shape, dtype=np.float32, quant=None):
        """shape is numpy order (outermost first); GGUF stores it innermost first."""
        data = self.rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)
        if quant == Q.BF16:
            raw = (data.view(np.uint32) + 0x7FFF + ((data.view(np.uint32) >> 16) & 1)) >> 16
            self.w.add_tensor(name, raw.astype(np.uint16), raw_dtype=Q.BF16)
        elif quant == Q.Q8_0:
            self.w.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            self.w.add_tensor(name, data.astype(dtype))

    def common(self, layers, embd=64, ctx=256, vocab=32):
        self.layers, self.embd, self.vocab = layers, embd, vocab
        self.w.add_block_count(layers)
        self.w.add_context_length(ctx)
        self.w.add_embedding_length(embd)
        self.w.add_vocab_size(vocab)
        self.w.add_layer_norm_rms_eps(1e-6)
        self.tensor(tname(MODEL_TENSOR.TOKEN_EMBD), (vocab, embd), np.float16)
        self.tensor(tname(MODEL_TENSOR.OUTPUT_NORM), (embd,))
        self.tensor(tname(MODEL_TENSOR.OUTPUT), (vocab, embd), quant=Q.Q8_0)

    def attention(self, bid, heads, kv_heads, hd_k, hd_v):
        self.tensor(tname(MODEL_TENSOR.ATTN_NORM, bid), (self.embd,))
        self.tensor(tname(MODEL_TENSOR.ATTN_Q, bid), (heads * hd_k, self.embd), np.float16)
        self.tensor(tname(MODEL_TENSOR.ATTN_K, bid), (kv_heads * hd_k, self.embd), np.float16)
        self.tensor(tname(MODEL_TENSOR.ATTN_V, bid), (kv_heads * hd_v, self.embd), quant=Q.BF16)
        self.tensor(tname(MODEL_TENSOR.ATTN_OUT, bid), (self.embd, heads * hd_v), np.float16)

    def mlp(self, bid, ff):
        self.tensor(tname(MODEL_TENSOR.FFN_UP, bid), (ff, self.embd), np.float16)
        self.tensor(tname(MODEL_TENSOR.FFN_DOWN, bid), (self.embd, ff), np.float16)

    def ssm(self, bid, heads, conv_kernel, conv_dim, mamba):
        """GDN (qwen3next) or Mamba-2 recurrent-layer tensors kvreplay reads itself."""
        self.tensor(tname(MODEL_TENSOR.ATTN_NORM, bid), (self.embd,))
        self.tensor(tname(MODEL_TENSOR.SSM_A, bid, None), (heads,))
        self.tensor(tname(MODEL_TENSOR.SSM_DT, bid, "bias"), (heads,))
        self.tensor(tname(MODEL_TENSOR.SSM_CONV1D, bid), (conv_dim, conv_kernel), quant=Q.BF16)
        if mamba:
            self.tensor(tname(MODEL_TENSOR.SSM_D, bid, None), (heads,))
            self.tensor(tname(MODEL_TENSOR.SSM_CONV1D, bid, "bias"), (conv_dim,))

    def close(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        print(f"wrote {os.path.relpath(self.path, ROOT)} ({os.path.getsize(self.path)} bytes)")


def dense(out, arch, seed, key_length=None):
    t = Tiny(out, arch, seed)
    t.common(layers=2)
    heads, kv, hd = 4, 2, key_length or 16
    t.w.add_head_count(heads)
    t.w.add_head_count_kv(kv)
    t.w.add_feed_forward_length(128)
    if key_length:
        t.w.add_key_length(key_length)
        t.w.add_value_length(key_length)
    if arch == "qwen2":
        t.w.add_sliding_window(128)
    for b in range(2):
        t.attention(b, heads, kv, hd, hd)
        t.mlp(b, 128)
    t.close()


def gdn_hybrid(out, arch, seed):
    """qwen3next / qwen35: 3 Gated DeltaNet layers then 1 attention layer (interval 4),
    plus 1 NextN/MTP block (qwen35) that is attention."""
    t = Tiny(out, arch, seed)
    nextn = 1 if arch == "qwen35" else 0
    layers = 4 + nextn
    t.common(layers=layers)
    hk, hv, dk, dv, kernel = 2, 4, 16, 16, 4
    t.w.add_full_attention_interval(4)
    if nextn:
        t.w.add_nextn_predict_layers(nextn)
    t.w.add_head_count(4)
    t.w.add_head_count_kv(2)
    t.w.add_key_length(32)
    t.w.add_value_length(32)
    t.w.add_feed_forward_length(96)
    t.w.add_ssm_conv_kernel(kernel)
    t.w.add_ssm_state_size(dk)  # head_k_dim
    t.w.add_ssm_group_count(hk)  # linear_num_key_heads
    t.w.add_ssm_time_step_rank(hv)  # linear_num_value_heads
    t.w.add_ssm_inner_size(hv * dv)  # linear_value_head_dim * linear_num_value_heads
    conv_dim = 2 * hk * dk + hv * dv
    for b in range(layers):
        if b < 4 and (b + 1) % 4 != 0:
            t.ssm(b, hv, kernel, conv_dim, mamba=False)
        else:
            t.attention(b, 4, 2, 32, 32)
        t.mlp(b, 96)
    t.close()


def mamba_family(out, arch, seed):
    """mamba2 (all recurrent), nemotron_h (Mamba-2 / attention / MLP blocks by the per-layer
    head_count_kv and feed_forward_length arrays), granitehybrid (Mamba-2 where
    head_count_kv is 0)."""
    t = Tiny(out, arch, seed)
    heads, head_dim, groups, state, kernel = 8, 16, 2, 16, 4
    inner = heads * head_dim
    if arch == "mamba2":
        kinds = ["M", "M"]
    elif arch == "nemotron_h":
        kinds = ["M", "A", "F", "M"]
    else:
        kinds = ["M", "A", "M"]
    t.common(layers=len(kinds))
    t.w.add_ssm_conv_kernel(kernel)
    t.w.add_ssm_inner_size(inner)
    t.w.add_ssm_state_size(state)
    t.w.add_ssm_time_step_rank(heads)
    t.w.add_ssm_group_count(groups)
    if arch != "mamba2":
        t.w.add_head_count([4 if k == "A" else 0 for k in kinds])
        t.w.add_head_count_kv([2 if k == "A" else 0 for k in kinds])
        t.w.add_key_length(16)
        t.w.add_value_length(16)
        if arch == "nemotron_h":
            t.w.add_feed_forward_length([128 if k == "F" else 0 for k in kinds])
        else:
            t.w.add_feed_forward_length(128)
    conv_dim = inner + 2 * groups * state
    for b, k in enumerate(kinds):
        if k == "M":
            t.ssm(b, heads, kernel, conv_dim, mamba=True)
        elif k == "A":
            t.attention(b, 4, 2, 16, 16)
        else:
            t.mlp(b, 128)
    t.close()


def header_only_qwen3next_80b(out):
    """Qwen3-Next-80B-A3B's configuration (Hugging Face config.json) with no tensors: a
    valid GGUF header for planning and sizing at the real shape."""
    path = os.path.join(out, "qwen3next-80b-a3b-header.gguf")
    w = gguf.GGUFWriter(path, "qwen3next")
    w.add_name("Qwen3-Next-80B-A3B (metadata only)")
    w.add_block_count(48)
    w.add_context_length(262144)
    w.add_embedding_length(2048)
    w.add_full_attention_interval(4)
    w.add_head_count(16)
    w.add_head_count_kv(2)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(128)
    w.add_ssm_group_count(16)
    w.add_ssm_time_step_rank(32)
    w.add_ssm_inner_size(32 * 128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data")
    os.makedirs(out, exist_ok=True)
    dense(out, "llama", 1)
    dense(out, "qwen2", 2)
    dense(out, "qwen3", 3, key_length=32)
    gdn_hybrid(out, "qwen3next", 4)
    gdn_hybrid(out, "qwen35", 5)
    mamba_family(out, "mamba2", 6)
    mamba_family(out, "nemotron_h", 7)
    mamba_family(out, "granitehybrid", 8)
    header_only_qwen3next_80b(out)


if __name__ == "__main__":
    main()
