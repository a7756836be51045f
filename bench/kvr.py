"""ctypes bindings for libkvreplay.so, used by the benchmark drivers.

This is also the test that the C ABI works with an engine's own memory and stream: tensors
are passed by address (torch's data_ptr(), numpy's ctypes.data) and CUDA work goes to
torch's current stream. The structs mirror include/kvreplay.h.
"""

import ctypes
import os

MAX_DIMS = 8

STATUS_OK = 0
BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA = 0, 1, 2
DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_I32 = 0, 1, 2, 3
DEVICE_HOST, DEVICE_CUDA = 0, 1
LAYER_ALL = -1  # kvr_layer_select
SEQ_NONE = -1  # kvr_seq_id: a new sequence (admit), an unused batch row
ADMIT_OK, ADMIT_LATER, ADMIT_NEVER = 0, 1, 2


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


class ContextParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("backend", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("n_threads", ctypes.c_int32),
    ]


class LayerLayout(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_stride_page", ctypes.c_int64),
        ("k_stride_head", ctypes.c_int64),
        ("k_stride_token", ctypes.c_int64),
        ("v_stride_page", ctypes.c_int64),
        ("v_stride_head", ctypes.c_int64),
        ("v_stride_token", ctypes.c_int64),
    ]


class KvPoolParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("n_layers", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("capacity_pages", ctypes.c_int64),
        ("capacity_bytes", ctypes.c_int64),
        ("max_seqs", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("max_seq_len", ctypes.c_int64),
        ("layers", ctypes.POINTER(LayerLayout)),
    ]


class KvPoolStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32)] + [
        (n, ctypes.c_int64)
        for n in (
            "pages_total",
            "pages_used",
            "pages_free",
            "pages_shared",
            "sequences",
            "tokens",
            "waste_slots",
            "page_bytes",
        )
    ]


class KvDecodeParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window", ctypes.c_int32),
        ("max_ctas", ctypes.c_int32),
    ]


class GdnStateStorage(ctypes.Structure):
    _fields_ = [("state", ctypes.c_void_p), ("seq_stride", ctypes.c_int64)]


class GdnPoolParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32)] + [
        (n, ctypes.c_int32)
        for n in (
            "n_layers",
            "n_k_heads",
            "n_v_heads",
            "dk",
            "dv",
            "ring_len",
            "kv_only_threshold",
            "max_drafts",
            "state_dtype",
            "entry_dtype",
            "layout",
            "max_seqs",
            "conv_dim",
            "conv_kernel",
            "conv_dtype",
        )
    ] + [("states", ctypes.POINTER(GdnStateStorage))]


class GdnPoolMemory(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32)] + [
        (n, ctypes.c_int64)
        for n in ("state_bytes", "ring_bytes", "conv_bytes", "snapshot_bytes", "total_bytes", "kv_only_threshold")
    ]


class GdnStepParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("scale", ctypes.c_float), ("l2norm_qk", ctypes.c_int32)]


class GdnCursor(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("mode", "ring_start", "buffered", "pending")]


class Mamba2PoolParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32)] + [
        (n, ctypes.c_int32)
        for n in (
            "n_layers",
            "n_heads",
            "head_dim",
            "n_groups",
            "d_state",
            "ring_len",
            "kv_only_threshold",
            "max_drafts",
            "state_dtype",
            "entry_dtype",
            "layout",
            "max_seqs",
            "conv_dim",
            "conv_kernel",
            "conv_dtype",
        )
    ] + [("states", ctypes.POINTER(GdnStateStorage))]


class Mamba2Tensors(ctypes.Structure):
    _fields_ = [(n, ctypes.POINTER(Tensor)) for n in ("seq_ids", "x", "dt", "a", "b", "c", "d", "z", "dt_bias", "conv_in", "out")]


class WgkvParams(ctypes.Structure):
    """kvr_wgkv_params (32 bytes: u32, i32, f32, i32, i32, i32, i64)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("local_window", ctypes.c_int32),
        ("tau", ctypes.c_float),
        ("sinks", ctypes.c_int32),
        ("gate_hidden", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("max_global_tokens", ctypes.c_int64),
    ]


class WgkvGateLayer(ctypes.Structure):
    """kvr_wgkv_gate_layer: host f32 arrays of one layer's gate."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("norm_pre", "norm_post", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")]


class WgkvPoolStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32)] + [
        (n, ctypes.c_int64)
        for n in (
            "pages_total",
            "pages_used",
            "pages_free",
            "pages_shared",
            "sequences",
            "kept_tokens",
            "full_tokens",
            "full_pages",
            "page_bytes",
        )
    ]


class WgkvRowStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("ring", "global", "drafts", "total")]


WGKV_COMMITTED, WGKV_DRAFT = 0, 1


STATE_K_MAJOR, STATE_V_MAJOR = 0, 1
GDN_MODE_KV_ONLY, GDN_MODE_REPLAY, GDN_MODE_RECURRENT = 0, 1, 2
GDN_THRESHOLD_DEFAULT, GDN_THRESHOLD_OFF = -1, 0  # the default is off, as OFF


def kv_only_threshold(dk, dv, state_size=4, entry_size=4):
    """min(dk, the KV-only entries one value head's state memory holds): the largest useful
    KV-only threshold (what GDN_THRESHOLD_DEFAULT picked before the default became off)."""
    return min(dk, dk * dv * state_size // ((dk + dv) * entry_size + 4))


class KvrError(RuntimeError):
    pass


def load(path=None):
    """Loads libkvreplay.so (from $KVR_LIB, the given path, or next to this bundle)."""
    path = path or os.environ.get("KVR_LIB")
    if path is None:
        here = os.path.dirname(os.path.abspath(__file__))
        for cand in (
            os.path.join(here, "..", "lib", "libkvreplay.so"),
            os.path.join(here, "..", "target", "release", "libkvreplay.so"),
        ):
            if os.path.exists(cand):
                path = cand
                break
    lib = ctypes.CDLL(path)
    lib.kvr_error_last_message.restype = ctypes.c_char_p
    lib.kvr_status_string.restype = ctypes.c_char_p
    lib.kvr_library_version.restype = ctypes.c_char_p
    lib.kvr_library_build_info.restype = ctypes.c_char_p
    return lib


class Lib:
    def __init__(self, path=None):
        self.lib = load(path)

    def check(self, status, what):
        if status != STATUS_OK:
            msg = self.lib.kvr_error_last_message().decode()
            raise KvrError(f"{what}: {self.lib.kvr_status_string(status).decode()} ({status}): {msg}")

    def context(self, backend=BACKEND_CUDA, stream=None, threads=0):
        p = ContextParams()
        self.check(self.lib.kvr_context_params_default(ctypes.byref(p)), "params")
        p.backend = backend
        p.stream = stream
        p.n_threads = threads
        ctx = ctypes.c_void_p()
        self.check(self.lib.kvr_context_new(ctypes.byref(p), ctypes.byref(ctx)), "kvr_context_new")
        return ctx

    def pool(self, ctx, layers, heads, dim, page, dtype, pages, max_seqs, max_len, layouts=None,
             capacity_bytes=0):
        p = KvPoolParams()
        self.check(self.lib.kvr_kv_pool_params_default(ctypes.byref(p)), "pool params")
        p.n_layers, p.n_kv_heads, p.head_dim, p.page_size, p.dtype = layers, heads, dim, page, dtype
        p.capacity_pages = pages
        p.capacity_bytes = capacity_bytes
        p.max_seqs = max_seqs
        p.max_seq_len = max_len
        if layouts is not None:
            arr = (LayerLayout * len(layouts))(*layouts)
            p.layers = ctypes.cast(arr, ctypes.POINTER(LayerLayout))
        pool = ctypes.c_void_p()
        self.check(self.lib.kvr_kv_pool_new(ctx, ctypes.byref(p), ctypes.byref(pool)), "kvr_kv_pool_new")
        return pool

    def seq_add(self, pool, stream=None):
        s = ctypes.c_int32()
        self.check(self.lib.kvr_kv_pool_seq_add(pool, ctypes.c_void_p(stream), ctypes.byref(s)), "seq_add")
        return s.value

    def extend(self, pool, seqs, counts, stream=None):
        n = len(seqs)
        sa = (ctypes.c_int32 * n)(*seqs)
        ca = (ctypes.c_int32 * n)(*counts)
        return self.lib.kvr_kv_pool_extend(pool, sa, ca, n, ctypes.c_void_p(stream))

    def write(self, pool, layer, seqs, counts, k, v, stream=None):
        n = len(seqs)
        sa = (ctypes.c_int32 * n)(*seqs)
        ca = (ctypes.c_int32 * n)(*counts)
        self.check(
            self.lib.kvr_kv_pool_write(pool, layer, sa, ca, n, ctypes.byref(k), ctypes.byref(v),
                                       ctypes.c_void_p(stream)),
            "kvr_kv_pool_write",
        )

    def admit(self, pool, seq, n):
        out = ctypes.c_int32()
        self.check(self.lib.kvr_kv_pool_admit(pool, seq, ctypes.c_int64(n), ctypes.byref(out)), "admit")
        return out.value

    def stats(self, pool):
        s = KvPoolStats()
        s.struct_size = ctypes.sizeof(KvPoolStats)
        self.check(self.lib.kvr_kv_pool_get_stats(pool, ctypes.byref(s)), "stats")
        return s

    def decode_params(self, scale=0.0, softcap=0.0, window=0, max_ctas=0):
        p = KvDecodeParams()
        self.check(self.lib.kvr_kv_decode_params_default(ctypes.byref(p)), "decode params")
        p.scale, p.softcap, p.window, p.max_ctas = scale, softcap, window, max_ctas
        return p

    def decode(self, pool, layer, ids, q, out, lse=None, params=None, stream=None):
        return self.lib.kvr_kv_pool_decode(
            pool,
            layer,
            ctypes.byref(ids),
            ctypes.byref(q),
            ctypes.byref(out),
            ctypes.byref(lse) if lse is not None else None,
            ctypes.byref(params) if params is not None else None,
            ctypes.c_void_p(stream),
        )


    # --- Write-gated KV pools (kvr_wgkv_pool_*) -----------------------------------------

    def wgkv_params(self, **kw):
        """kvr_wgkv_params from the defaults; checks that the library's struct_size is ours."""
        p = WgkvParams()
        self.check(self.lib.kvr_wgkv_params_default(ctypes.byref(p)), "kvr_wgkv_params_default")
        if p.struct_size != ctypes.sizeof(WgkvParams):
            raise KvrError(f"kvr_wgkv_params is {p.struct_size} bytes in the library, {ctypes.sizeof(WgkvParams)} here")
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    def wgkv_pool(self, ctx, layers, heads, dim, page, dtype, pages, max_seqs, max_len, capacity_bytes=0, **wg):
        """A write-gated pool (kvr_wgkv_pool_new); `wg` sets kvr_wgkv_params fields
        (local_window, tau, sinks, gate_hidden, max_global_tokens). A page holds `page`
        tokens of one (sequence, layer, KV head)."""
        p = KvPoolParams()
        self.check(self.lib.kvr_kv_pool_params_default(ctypes.byref(p)), "pool params")
        p.n_layers, p.n_kv_heads, p.head_dim, p.page_size, p.dtype = layers, heads, dim, page, dtype
        p.capacity_pages = pages
        p.capacity_bytes = capacity_bytes
        p.max_seqs = max_seqs
        p.max_seq_len = max_len
        w = self.wgkv_params(**wg)
        pool = ctypes.c_void_p()
        self.check(self.lib.kvr_wgkv_pool_new(ctx, ctypes.byref(p), ctypes.byref(w), ctypes.byref(pool)),
                   "kvr_wgkv_pool_new")
        return pool

    def wgkv_free(self, pool):
        self.lib.kvr_wgkv_pool_free(pool)

    def wgkv_seq_add(self, pool, stream=None):
        s = ctypes.c_int32()
        self.check(self.lib.kvr_wgkv_pool_seq_add(pool, ctypes.c_void_p(stream), ctypes.byref(s)), "wgkv seq_add")
        return s.value

    def wgkv_seq_free(self, pool, seq, stream=None):
        self.check(self.lib.kvr_wgkv_pool_seq_free(pool, ctypes.c_int32(seq), ctypes.c_void_p(stream)), "wgkv seq_free")

    def wgkv_set_gate(self, pool, layers, hidden):
        """layers: one dict per pool layer of host f32 arrays (numpy or CPU torch, contiguous)
        with keys norm_pre, norm_post, fc1_weight, fc1_bias, fc2_weight, fc2_bias."""
        names = [f[0] for f in WgkvGateLayer._fields_]
        arr = (WgkvGateLayer * len(layers))()
        for i, d in enumerate(layers):
            for n in names:
                x = d[n]
                ptr = x.ctypes.data if hasattr(x, "ctypes") else x.data_ptr()
                setattr(arr[i], n, ptr)
        self.check(self.lib.kvr_wgkv_pool_set_gate(pool, arr, ctypes.c_int32(hidden)), "kvr_wgkv_pool_set_gate")

    def wgkv_append(self, pool, seq, layer, k, v, scores=None, k_pre=None, flags=WGKV_COMMITTED, stream=None):
        """Raw status of kvr_wgkv_pool_append (k, v, scores, k_pre: kvr_tensor values; exactly
        one of scores (f32 host [n, Hkv] or [layers, n, Hkv]) and k_pre)."""
        return self.lib.kvr_wgkv_pool_append(
            pool,
            ctypes.c_int32(seq),
            ctypes.c_int32(layer),
            ctypes.byref(k),
            ctypes.byref(v),
            ctypes.byref(k_pre) if k_pre is not None else None,
            ctypes.byref(scores) if scores is not None else None,
            ctypes.c_uint32(flags),
            ctypes.c_void_p(stream),
        )

    def wgkv_reserve(self, pool, seq, steps, stream=None):
        """kvr_wgkv_pool_reserve: `steps` device steps for `seq` (raises on failure)."""
        self.check(self.lib.kvr_wgkv_pool_reserve(pool, ctypes.c_int32(seq), ctypes.c_int32(steps),
                                                  ctypes.c_void_p(stream)), "kvr_wgkv_pool_reserve")

    def wgkv_step(self, pool, layer, ids, k, v, k_pre=None, scores=None, scores_out=None, stream=None):
        """Raw status of kvr_wgkv_pool_step (ids: i32 host kvr_tensor [B]; k, v, k_pre, scores,
        scores_out: kvr_tensor values; exactly one of k_pre and scores)."""
        ref = lambda t: ctypes.byref(t) if t is not None else None  # noqa: E731
        return self.lib.kvr_wgkv_pool_step(
            pool, ctypes.c_int32(layer), ctypes.byref(ids), ctypes.byref(k), ctypes.byref(v),
            ref(k_pre), ref(scores), ref(scores_out), ctypes.c_void_p(stream))

    def wgkv_decode(self, pool, layer, ids, q, out, lse=None, params=None, stream=None):
        """Raw status of kvr_wgkv_pool_decode (ids: i32 host kvr_tensor [B])."""
        return self.lib.kvr_wgkv_pool_decode(
            pool,
            ctypes.c_int32(layer),
            ctypes.byref(ids),
            ctypes.byref(q),
            ctypes.byref(out),
            ctypes.byref(lse) if lse is not None else None,
            ctypes.byref(params) if params is not None else None,
            ctypes.c_void_p(stream),
        )

    def wgkv_stats(self, pool):
        s = WgkvPoolStats()
        s.struct_size = ctypes.sizeof(WgkvPoolStats)
        self.check(self.lib.kvr_wgkv_pool_get_stats(pool, ctypes.byref(s)), "kvr_wgkv_pool_get_stats")
        if s.struct_size != ctypes.sizeof(WgkvPoolStats):
            raise KvrError(f"kvr_wgkv_pool_stats is {s.struct_size} bytes in the library, {ctypes.sizeof(WgkvPoolStats)} here")
        return s

    def wgkv_rows(self, pool, seq):
        """Row counts of `seq`, layer-major (entry layer * n_kv_heads + head)."""
        n = ctypes.c_int64()
        st = self.lib.kvr_wgkv_pool_get_seq_rows(pool, ctypes.c_int32(seq), None, ctypes.c_int64(0), ctypes.byref(n))
        if st != STATUS_OK and n.value <= 0:
            self.check(st, "kvr_wgkv_pool_get_seq_rows")
        rows = (WgkvRowStats * max(1, n.value))()
        self.check(self.lib.kvr_wgkv_pool_get_seq_rows(pool, ctypes.c_int32(seq), rows, ctypes.c_int64(n.value),
                                                       ctypes.byref(n)), "kvr_wgkv_pool_get_seq_rows")
        return list(rows[: n.value])


    # --- Gated DeltaNet replay pools -------------------------------------------------

    def gdn_params(self, **kw):
        p = GdnPoolParams()
        self.check(self.lib.kvr_gdn_pool_params_default(ctypes.byref(p)), "gdn params")
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    def gdn_pool(self, ctx, **kw):
        p = self.gdn_params(**kw)
        pool = ctypes.c_void_p()
        self.check(self.lib.kvr_gdn_pool_new(ctx, ctypes.byref(p), ctypes.byref(pool)), "kvr_gdn_pool_new")
        return pool

    def gdn_params_memory(self, **kw):
        p = self.gdn_params(**kw)
        m = GdnPoolMemory()
        m.struct_size = ctypes.sizeof(GdnPoolMemory)
        self.check(self.lib.kvr_gdn_pool_params_memory(ctypes.byref(p), ctypes.byref(m)), "kvr_gdn_pool_params_memory")
        return m

    def gdn_seq_add(self, pool, stream=None):
        s = ctypes.c_int32()
        self.check(self.lib.kvr_gdn_pool_seq_add(pool, ctypes.c_void_p(stream), ctypes.byref(s)), "gdn seq_add")
        return s.value

    def gdn_step_params(self, scale=0.0, l2norm=True):
        p = GdnStepParams()
        self.check(self.lib.kvr_gdn_step_params_default(ctypes.byref(p)), "gdn step params")
        p.scale, p.l2norm_qk = scale, int(l2norm)
        return p

    def gdn_step(self, verify, pool, layer, ids, q, k, v, g, beta, conv, out, params, stream=None):
        f = self.lib.kvr_gdn_pool_verify if verify else self.lib.kvr_gdn_pool_decode
        return f(
            pool,
            layer,
            ctypes.byref(ids),
            ctypes.byref(q),
            ctypes.byref(k),
            ctypes.byref(v),
            ctypes.byref(g),
            ctypes.byref(beta),
            ctypes.byref(conv) if conv is not None else None,
            ctypes.byref(out),
            ctypes.byref(params) if params is not None else None,
            ctypes.c_void_p(stream),
        )

    def gdn_commit(self, pool, layer, ids, accepted, conv_state=None, stream=None):
        return self.lib.kvr_gdn_pool_commit(
            pool,
            layer,
            ctypes.byref(ids),
            ctypes.byref(accepted),
            ctypes.byref(conv_state) if conv_state is not None else None,
            ctypes.c_void_p(stream),
        )

    def gdn_import(self, pool, layer, seq, state, conv=None, stream=None):
        self.check(
            self.lib.kvr_gdn_pool_import_state(pool, layer, seq, ctypes.byref(state),
                                          ctypes.byref(conv) if conv is not None else None, ctypes.c_void_p(stream)),
            "kvr_gdn_pool_import_state",
        )

    def gdn_export(self, pool, layer, seq, out, conv_out=None, stream=None):
        self.check(
            self.lib.kvr_gdn_pool_export_state(pool, layer, seq, ctypes.byref(out),
                                          ctypes.byref(conv_out) if conv_out is not None else None,
                                          ctypes.c_void_p(stream)),
            "kvr_gdn_pool_export_state",
        )

    def gdn_cursor(self, pool, layer, seq):
        i = GdnCursor()
        self.check(self.lib.kvr_gdn_pool_get_cursor(pool, layer, seq, ctypes.byref(i)), "kvr_gdn_pool_get_cursor")
        return i


    # --- Mamba-2 replay pools --------------------------------------------------------

    def mamba2_pool(self, ctx, **kw):
        p = Mamba2PoolParams()
        self.check(self.lib.kvr_mamba2_pool_params_default(ctypes.byref(p)), "mamba2 params")
        for k, v in kw.items():
            setattr(p, k, v)
        pool = ctypes.c_void_p()
        self.check(self.lib.kvr_mamba2_pool_new(ctx, ctypes.byref(p), ctypes.byref(pool)), "kvr_mamba2_pool_new")
        return pool

    def mamba2_seq_add(self, pool, stream=None):
        s = ctypes.c_int32()
        self.check(self.lib.kvr_mamba2_pool_seq_add(pool, ctypes.c_void_p(stream), ctypes.byref(s)), "mamba2 seq_add")
        return s.value

    def mamba2_tensors(self, **kw):
        """kvr_mamba2_tensors from kvr_tensor values (absent: NULL); keeps them alive."""
        t = Mamba2Tensors()
        t._keep = dict(kw)
        for k, v in kw.items():
            if v is not None:
                setattr(t, k, ctypes.pointer(v))
        return t

    def mamba2_step(self, verify, pool, layer, tensors, stream=None):
        f = self.lib.kvr_mamba2_pool_verify if verify else self.lib.kvr_mamba2_pool_decode
        return f(pool, layer, ctypes.byref(tensors), None, ctypes.c_void_p(stream))

    def mamba2_commit(self, pool, layer, ids, accepted, stream=None):
        return self.lib.kvr_mamba2_pool_commit(pool, layer, ctypes.byref(ids), ctypes.byref(accepted), None,
                                               ctypes.c_void_p(stream))

    def mamba2_import(self, pool, layer, seq, state, stream=None):
        self.check(self.lib.kvr_mamba2_pool_import_state(pool, layer, seq, ctypes.byref(state), None,
                                                         ctypes.c_void_p(stream)), "kvr_mamba2_pool_import_state")

    def mamba2_export(self, pool, layer, seq, out, stream=None):
        self.check(self.lib.kvr_mamba2_pool_export_state(pool, layer, seq, ctypes.byref(out), None,
                                                         ctypes.c_void_p(stream)), "kvr_mamba2_pool_export_state")


def tensor(ptr, dtype, device, shape, strides=None):
    t = Tensor()
    t.data = ptr
    t.dtype = dtype
    t.device = device
    t.ndim = len(shape)
    if strides is None:
        strides = []
        acc = 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    for i, (n, s) in enumerate(zip(shape, strides)):
        t.shape[i] = n
        t.strides[i] = s
    return t


def torch_tensor(x):
    """A kvr_tensor over a torch tensor (device memory or host)."""
    import torch

    dt = {
        torch.float32: DTYPE_F32,
        torch.float16: DTYPE_F16,
        torch.bfloat16: DTYPE_BF16,
        torch.int32: DTYPE_I32,
    }[x.dtype]
    dev = DEVICE_CUDA if x.is_cuda else DEVICE_HOST
    return tensor(x.data_ptr(), dt, dev, list(x.shape), list(x.stride()))
