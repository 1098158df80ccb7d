"""The native decoder: ``decode.c`` over a genai export's packed weights and a :class:`GenaiSession`'s KV buffers.

:class:`NativeDecoder` mirrors the C structures with ctypes, keeps every array they point to alive, and runs a
pass with one call: rows of new tokens at their own positions (a decode step: one token per row at its length;
a prompt: its tokens from position 0), keys and values written into the same (n_slots, kv_heads, max_len,
head_dim) buffers that ONNX Runtime's GroupQueryAttention uses, rotated the same way, so the two can take turns
on one cache (:class:`prunus.runtime.genai_session.GenaiSession` with ``native=True``). Buffers of float16
(``kv_dtype="f16"``) are the native decoder's alone: keys and values rounded to the nearest half as they are
written (F16C) and widened back to floats as attention reads them, half the memory and the bandwidth of a long
context.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from prunus.artifacts.errors import PrunusError

from .build import library
from .weights import KINDS, PackedLinear, PackedModel, shape_key

P, I32 = ctypes.c_void_p, ctypes.c_int32


class LinearC(ctypes.Structure):
    _fields_ = [("kind", I32), ("n", I32), ("k", I32), ("tiles", I32), ("w", P), ("s", P), ("sz", P), ("bias", P),
                ("plan", P)]  # plan: prunus.native.plan's groupings by row count, or None: decode.c's fixed rules


class LayerC(ctypes.Structure):
    _fields_ = [(name, LinearC) for name in ("q", "k", "v", "o", "gate", "up", "down")] + [
        ("attn_norm", P), ("ffn_norm", P), ("window", I32)]


class ModelC(ctypes.Structure):
    _fields_ = [(name, I32) for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden", "vocab",
                                         "max_len", "n_slots", "rope_len")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("emb", P), ("cos", P), ("sin", P), ("norm", P),
        ("layers", P), ("head", LinearC), ("kc", P), ("vc", P), ("kv_f16", I32)]

KV_DTYPES = {"f32": np.float32, "f16": np.float16}  # the KV cache's element types, by the name load options use


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _linear(lin: PackedLinear | None) -> LinearC:
    if lin is None:
        return LinearC()  # n == 0: not run (the packed q/k/v or gate/up projection holds its rows)
    return LinearC(KINDS[lin.kind], lin.n, lin.k, lin.tiles, _address(lin.w), _address(lin.s), _address(lin.sz),
                   _address(lin.bias))


class NativeDecoder:
    def __init__(self, packed: PackedModel, k_buffers: list, v_buffers: list, n_slots: int, max_len: int,
                 threads: int | None = None, pool=None):
        """``pool``: another decoder's thread pool to run on (a draft beside its target: one pool, never two
        spinning at once), else one of ``threads`` of its own."""
        self.lib = library()
        self.packed, self.n_slots, self.max_len = packed, n_slots, max_len
        d = packed.dims
        self.vocab_size = d["vocab_size"]
        self._buffers = (list(k_buffers), list(v_buffers))
        if not len(k_buffers) == len(v_buffers) == len(packed.layers) == d["n_layers"]:
            raise ValueError(f"one key and one value buffer per layer: {d['n_layers']} layers")
        dtype = k_buffers[0].dtype if k_buffers else np.dtype(np.float32)
        for buf in (*k_buffers, *v_buffers):
            if (buf.dtype != dtype or dtype not in (np.float32, np.float16) or not buf.flags.c_contiguous
                    or buf.shape != (n_slots, d["n_kv_heads"], max_len, d["head_dim"])):
                raise ValueError("KV buffers must be C-contiguous float32 or float16, all one type, "
                                 "(n_slots, kv_heads, max_len, head_dim)")
        self.kv_dtype = "f16" if dtype == np.float16 else "f32"
        self._kc = (P * len(k_buffers))(*(b.ctypes.data for b in k_buffers))
        self._vc = (P * len(v_buffers))(*(b.ctypes.data for b in v_buffers))
        self._layers = (LayerC * len(packed.layers))(*(self._layer(x) for x in packed.layers))
        self.model = ModelC(d["n_layers"], packed.emb.shape[1], d["n_heads"], d["n_kv_heads"], d["head_dim"],
                            d["hidden"], d["vocab_size"], max_len, n_slots, packed.cos.shape[0], packed.eps,
                            packed.scale, _address(packed.emb), _address(packed.cos), _address(packed.sin),
                            _address(packed.norm), ctypes.addressof(self._layers), _linear(packed.head),
                            ctypes.addressof(self._kc), ctypes.addressof(self._vc), int(self.kv_dtype == "f16"))
        self.threads = threads or os.cpu_count() or 1
        self._own_pool = pool is None
        self.pool = self.lib.prunus_pool_new(self.threads) if pool is None else pool
        self._start = np.zeros(n_slots, np.int32)
        self._count = np.zeros(n_slots, np.int32)
        self._slots = np.zeros(n_slots, np.int32)
        self.plan, self._plan_arrays = None, {}

    def use_plan(self, plan) -> None:
        """Run each linear layer with ``plan``'s groupings for its shape (:class:`prunus.native.plan.Plan`; None, or
        a shape it lacks: decode.c's fixed rules). On a batch-invariant path the bits are the same either way."""
        arrays = plan.arrays() if plan is not None else {}
        structs = [(self._layers[i], layer) for i, layer in enumerate(self.packed.layers)]
        for c, layer in structs:
            for role in ("q", "k", "v", "o", "gate", "up", "down"):
                lin = layer[role]
                if lin is not None:
                    getattr(c, role).plan = _address(arrays.get(shape_key(lin)))
        if self.packed.head is not None:
            self.model.head.plan = _address(arrays.get(shape_key(self.packed.head)))
        self.plan, self._plan_arrays = plan, arrays  # the arrays live as long as the structures point at them

    @staticmethod
    def _layer(x: dict) -> LayerC:
        return LayerC(*(_linear(x[n]) for n in ("q", "k", "v", "o", "gate", "up", "down")),
                      _address(x["attn_norm"]), _address(x["ffn_norm"]), max(0, x["window"]))

    def forward(self, ids: np.ndarray, start, count, slot0: int, logits: np.ndarray,
                every_position: bool = False, hidden: np.ndarray | None = None) -> np.ndarray:
        """ids (b, seq) int64: row i's ``count[i]`` tokens at positions ``start[i]...``, in slot ``slot0 + i`` (or, with
        ``slot0`` a sequence of b distinct slots, in slot ``slot0[i]``: rows need not be consecutive slots); writes
        and returns ``logits[:b]``, each row's last-token logits (``every_position``: ``logits[:sum(count)]``, every
        token's, row after row). ``hidden``: a C-contiguous float32 (>= sum(count), dim) array that receives every
        token's final-norm output, row after row (what an EAGLE draft reads)."""
        if self.pool is None:
            raise ValueError("the native decoder is closed")
        b, seq = ids.shape
        ids = np.ascontiguousarray(ids, np.int64)
        self._start[:b] = start
        self._count[:b] = count
        rows = int(self._count[:b].sum()) if every_position else b
        if (logits.dtype != np.float32 or logits.shape[0] < rows or not logits[:rows].flags.c_contiguous
                or logits.shape[1] != self.vocab_size):
            raise ValueError(f"logits must be a C-contiguous float32 ({rows}, vocab) array")
        total = int(self._count[:b].sum())
        if hidden is not None and (hidden.dtype != np.float32 or hidden.shape[0] < total or hidden.ndim != 2
                                   or hidden.shape[1] != self.packed.emb.shape[1] or not hidden.flags.c_contiguous):
            raise ValueError(f"hidden must be a C-contiguous float32 ({total}, dim) array")
        out = None if hidden is None else hidden.ctypes.data
        if isinstance(slot0, (int, np.integer)):
            rc = self.lib.prunus_forward(ctypes.addressof(self.model), self.pool, b, seq, ids.ctypes.data,
                                         self._start.ctypes.data, self._count.ctypes.data, int(slot0),
                                         logits.ctypes.data, int(every_position), out)
        else:
            self._slots[:b] = slot0
            rc = self.lib.prunus_forward_at(ctypes.addressof(self.model), self.pool, b, seq, ids.ctypes.data,
                                            self._start.ctypes.data, self._count.ctypes.data, self._slots.ctypes.data,
                                            logits.ctypes.data, int(every_position), out)
        if rc == -2:
            raise MemoryError(f"native pass: no memory for the buffers of {rows} rows")
        if rc != 0:
            raise ValueError(f"native pass refused: a token id outside the vocabulary, a row past the buffer's "
                             f"{self.max_len} positions, slots past {self.n_slots} or a slot twice")
        return logits[:rows]

    def forward_x(self, x: np.ndarray, start: int, slot: int, logits: np.ndarray, hidden: np.ndarray) -> None:
        """One row of ``len(x)`` input vectors (n, dim) in place of token embeddings, at positions ``start...`` of
        buffer slot ``slot``: writes the last one's logits to ``logits`` (vocab,) and every one's final-norm output
        to ``hidden[:n]`` (what an EAGLE draft's block reads and returns)."""
        if self.pool is None:
            raise ValueError("the native decoder is closed")
        n, dim = x.shape
        if (x.dtype != np.float32 or not x.flags.c_contiguous or dim != self.packed.emb.shape[1]
                or logits.dtype != np.float32 or logits.shape != (self.vocab_size,) or hidden.dtype != np.float32
                or not hidden.flags.c_contiguous or hidden.shape[0] < n or hidden.shape[1:] != (dim,)):
            raise ValueError("forward_x takes C-contiguous float32 x (n, dim), logits (vocab,), hidden (>= n, dim)")
        self._start[0], self._count[0], self._slots[0] = start, n, slot
        rc = self.lib.prunus_forward_x(ctypes.addressof(self.model), self.pool, 1, x.ctypes.data,
                                       self._start.ctypes.data, self._count.ctypes.data, self._slots.ctypes.data,
                                       logits.ctypes.data, 0, hidden.ctypes.data)
        if rc == -2:
            raise MemoryError(f"native pass: no memory for the buffers of {n} rows")
        if rc != 0:
            raise ValueError(f"native pass refused: a row past the buffer's {self.max_len} positions or slot {slot} "
                             f"past {self.n_slots}")

    def close(self) -> None:
        if self.pool and self._own_pool:
            self.lib.prunus_pool_free(self.pool)
        self.pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def check_native(where: str) -> None:
    """Raise one PrunusError line when the native decoder cannot run here (CPU, compiler)."""
    try:
        library()
    except PrunusError as e:
        raise PrunusError(f"{where}: {e}") from None
