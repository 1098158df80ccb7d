"""A genai export's ``native_weights.safetensors`` (:mod:`prunus.artifacts.native_layout`) read into the native
decoder's packed weights.

The file holds the export's own numbers, as ``prunus export`` wrote them beside the graph from the model dir's
stored codes (:mod:`prunus.export.native_weights`): float weights, int8 / int4 codes with their scales (blocks a
multiple of 32) and integer zero points, biases, norms, the embedding (the tied head read from it) and the rotary
tables. Nothing here reads the graph. Everything is checked before a byte of data is read: the safetensors header
against the file (:func:`prunus.artifacts.safetensors_header.read_layout`), every tensor's dtype and shape against
the export's config and the file's metadata, no tensor left unread. Every float tensor is checked finite as it is
read (one vectorised pass, :mod:`prunus.artifacts.finite_arrays`), and every int8 / int4 block scale small enough
that its codes dequantize within float32, as the kernels compute ``(code - zero) * scale`` (``|scale|`` at most
float32's largest value over 255, or over 15 for int4; a block scale may be zero or negative: the kernels need no
sign). A damaged tensor is one line naming it and its first bad element. Linear layers are repacked four output rows at
a time (the layouts are in ``decode.c``); a block larger than 32 repeats its scale over its 32-wide pieces. An
export whose graph the kernels do not mirror records why in the file, and is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.finite_arrays import FLOAT32_MAX, check_finite
from prunus.artifacts.native_layout import ATTENTION, FEED_FORWARD, KINDS as STORED, NATIVE_FORMAT, NATIVE_WEIGHTS
from prunus.artifacts.safetensors_header import read_layout
from prunus.artifacts.validate import short

KINDS = {"f32": 0, "q4": 4, "q8": 8}
FIX = "re-export the model dir with this prunus version (prunus export)"
DAMAGED = "the export's weights are damaged; re-export it from a model dir whose weights are finite (prunus export)"
CODE_SPAN = {"q8": 255, "q4": 15}  # the largest |code - zero point| of a block: a scale's factor at most
MAX_HEADS = 1 << 16
NUMPY = {"F32": np.dtype("<f4"), "U8": np.dtype("u1")}


@dataclass
class PackedLinear:
    kind: str
    n: int
    k: int
    w: np.ndarray
    s: np.ndarray | None = None
    sz: np.ndarray | None = None
    bias: np.ndarray | None = None

    @property
    def tiles(self) -> int:
        return -(-self.n // 4)


def shape_key(lin: PackedLinear) -> str:
    """How a linear layer's shape is keyed (in a plan of row groupings): kind, inputs x outputs."""
    return f"{lin.kind}:{lin.k}x{lin.n}"


@dataclass
class PackedModel:
    dims: dict
    eps: float
    scale: float
    emb: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    norm: np.ndarray
    layers: list = field(default_factory=list)  # dicts: q k v o gate up down (PackedLinear | None), norms, window
    head: PackedLinear | None = None


def _tiled(a: np.ndarray, n: int) -> np.ndarray:
    """(n, ...) -> rows padded with zeros to a multiple of 4."""
    tiles = -(-n // 4)
    if tiles * 4 == n:
        return a
    pad = np.zeros((tiles * 4 - n, *a.shape[1:]), a.dtype)
    return np.concatenate([a, pad])


def pack_f32(w: np.ndarray, bias: np.ndarray | None = None) -> PackedLinear:
    """w (n, k) float32 -> (tiles, k / 8, 4, 8)."""
    n, k = w.shape
    t = _tiled(np.asarray(w, np.float32), n)
    packed = np.ascontiguousarray(t.reshape(-1, 4, k // 8, 8).transpose(0, 2, 1, 3))
    return PackedLinear("f32", n, k, packed, bias=bias)


def pack_blocks(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int,
                bias: np.ndarray | None = None) -> PackedLinear:
    """q (n, k) unsigned integers (0..255 or 0..15), scale / zero (n, k / 32) floats (zero None: 128 or 8, the
    storage's midpoint): w = (q - zero) * scale."""
    n, k = q.shape
    kb = k // 32
    mid = 128 if bits == 8 else 8
    zero = np.full((n, kb), mid, np.float32) if zero is None else zero.astype(np.float32)
    if bits == 8:
        blocks = (q.astype(np.int16) - 128).astype(np.int8).reshape(n, kb, 32)
        offset = zero - 128  # the stored integers are shifted by 128 to signed
    else:
        nib = q.astype(np.uint8).reshape(n, kb, 32)
        blocks = nib[..., :16] | (nib[..., 16:] << 4)
        offset = zero
    blocks = _tiled(blocks, n)
    packed = np.ascontiguousarray(blocks.reshape(-1, 4, kb, blocks.shape[-1]).transpose(0, 2, 1, 3))

    def per_tile(a):
        return np.ascontiguousarray(_tiled(a.astype(np.float32), n).reshape(-1, 4, kb).transpose(0, 2, 1))

    sz = per_tile(scale * offset) if np.any(offset) else None
    return PackedLinear("q8" if bits == 8 else "q4", n, k, packed, per_tile(scale), sz, bias)



def native_weights_file(export_dir: str | Path) -> Path:
    """The export dir's ``native_weights.safetensors`` (a regular file inside the dir), or one PrunusError line."""
    path = inside(export_dir, NATIVE_WEIGHTS, fix=FIX, required=False)
    if path is None:
        raise PrunusError(f"{export_dir}: has no {NATIVE_WEIGHTS}, the weights --native decodes with (an export of "
                          "an older prunus); re-export with this prunus version (prunus export)")
    return path


@dataclass
class _Spec:
    """One linear layer as the header describes it, checked: ``kind`` "f32" / "q8" / "q4" (None: absent)."""

    prefix: str
    kind: str | None
    n: int = 0
    k: int = 0
    block: int = 0
    zero: bool = False
    bias: bool = False


class WeightsFile:
    """A native weights file's checked header and metadata; :meth:`read` one tensor after the checks."""

    def __init__(self, path: Path, dims: dict, tensors: dict | None = None, meta: dict | None = None):
        """``tensors`` / ``meta``: the same tensors and metadata in memory (numpy arrays by name, float32 or uint8), as
        a model dir's weights give them (:mod:`prunus.runtime.native_tensors`); ``path`` then only names them."""
        self.path, self.dims = Path(path), dims
        for key in ("n_layers", "n_kv_heads", "head_dim", "vocab_size"):
            value = dims.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**31:
                raise PrunusError(f"{path}: the export's config.json gives {key} {short(value)}, not a size from 1 "
                                  "to 2**31 - 1; re-create the export dir")
        self.arrays = tensors
        if tensors is None:
            self.header, meta, self.data_start = read_layout(path, FIX)
        else:
            dtypes = {v: k for k, v in NUMPY.items()}
            self.header = {n: {"dtype": dtypes.get(a.dtype.newbyteorder("<"), str(a.dtype)), "shape": list(a.shape)}
                           for n, a in tensors.items()}
            self.data_start, meta = 0, dict(meta or {})
        self.used: set[str] = set()
        if meta.get("format") != NATIVE_FORMAT:
            self.bad(f"has format {short(meta.get('format'))}, not {NATIVE_FORMAT}")
        if "unsupported" in meta:
            self.refuse(meta["unsupported"])
        n_layers = dims["n_layers"]
        if not isinstance(n_layers, int) or not 1 <= n_layers <= len(self.header):  # a tensor or more per layer
            self.bad(f"holds {len(self.header)} tensors, too few for config.json's {n_layers} layers")
        self.n_heads = self._int(meta, "n_heads", 1, MAX_HEADS)
        self.eps, self.scale = self._positive(meta, "eps"), self._positive(meta, "scale")
        windows = meta.get("windows", "").split(",")
        if len(windows) != n_layers:
            self.bad(f"has {len(windows)} sliding windows in its metadata for {n_layers} layers")
        self.windows = [self._int({"window": w}, "window", -1, 2**31 - 1) for w in windows]
        if meta.get("tied_head") not in ("true", "false"):
            self.bad(f"has tied_head {short(meta.get('tied_head'))} in its metadata, not true or false")
        self.tied = meta["tied_head"] == "true"

    def bad(self, what: str):
        fix = FIX if self.arrays is None else "re-create the model dir (its weights disagree with its config.json)"
        raise PrunusError(f"{self.path}: {what}; {fix}")

    def refuse(self, what: str):
        what_dir = "export" if self.arrays is None else "model dir"
        raise PrunusError(f"{self.path}: the native decoder cannot run this {what_dir}: it {what}; serve it without "
                          "--native")

    def _int(self, meta: dict, key: str, lo: int, hi: int) -> int:
        text = meta.get(key)
        if not isinstance(text, str) or not re.fullmatch(r"-?[0-9]{1,12}", text) or not lo <= int(text) <= hi:
            self.bad(f"has {key} {short(text)} in its metadata, not an integer from {lo} to {hi}")
        return int(text)

    def _positive(self, meta: dict, key: str) -> float:
        try:
            value = float(meta.get(key, "")[:40])
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            self.bad(f"has {key} {short(meta.get(key))} in its metadata, not a positive number")
        return value

    def entry(self, name: str, dtype: str, shape: tuple | None = None, ndim: int | None = None) -> list[int]:
        """The shape of tensor ``name``, checked to be ``dtype`` and ``shape`` (or of ``ndim`` sizes)."""
        e = self.header.get(name)
        if e is None:
            self.bad(f"has no tensor {name}")
        got = list(e["shape"])
        if e["dtype"] != dtype or (shape is not None and tuple(got) != tuple(shape)) or (
                ndim is not None and len(got) != ndim):
            want = shape if shape is not None else f"{ndim} dimensions"
            self.bad(f"has {name} of {e['dtype']} {got}, not {dtype} {want}")
        self.used.add(name)
        return got

    def opened(self):
        """The handle :meth:`read` reads from (None for tensors in memory)."""
        return contextlib.nullcontext() if self.arrays is not None else open(self.path, "rb")

    def read(self, name: str, handle) -> np.ndarray:
        """Tensor ``name``'s data from the open file ``handle``: the byte count the header was checked for."""
        e = self.header[name]
        if self.arrays is not None:
            a = np.ascontiguousarray(self.arrays[name])
            check_finite(a.reshape(-1), f"{self.path}: tensor {short(name, 120)}", DAMAGED)
            return a
        count = math.prod(e["shape"])
        handle.seek(self.data_start + e["data_offsets"][0])
        a = np.fromfile(handle, NUMPY[e["dtype"]], count)
        if a.size != count:
            self.bad(f"ends inside {name} (the file changed while read)")
        check_finite(a, f"{self.path}: tensor {short(name, 120)}", DAMAGED)
        return a.reshape(e["shape"]).astype(NUMPY[e["dtype"]].newbyteorder("="), copy=False)

    def scales(self, prefix: str, kind: str, handle) -> np.ndarray:
        """Linear layer ``prefix``'s block scales, each one whose codes dequantize within float32."""
        scale = self.read(f"{prefix}.scale", handle)
        limit = FLOAT32_MAX / CODE_SPAN[kind]
        over = np.flatnonzero(np.abs(scale) > limit)
        if over.size:
            value, what = float(scale.reshape(-1)[over[0]]), "int8" if kind == "q8" else "int4"
            raise PrunusError(f"{self.path}: tensor {short(prefix + '.scale', 120)} holds {value:.4g} at element "
                              f"{int(over[0])}, beyond {limit:.4g}: its {what} codes would dequantize past float32's "
                              f"range; {DAMAGED}")
        return scale

    def linear(self, prefix: str) -> _Spec:
        """The header's linear layer ``prefix``, its tensors' dtypes and shapes consistent (not yet the config's)."""
        kinds = [k for k in STORED if f"{prefix}.{k}" in self.header]
        if not kinds:
            return _Spec(prefix, None)
        if len(kinds) > 1:
            self.bad(f"has both {prefix}.{kinds[0]} and {prefix}.{kinds[1]}")
        n, k = self.entry(f"{prefix}.{kinds[0]}", "F32" if kinds[0] == "weight" else "U8", ndim=2)
        if not (1 <= n < 2**31 and 1 <= k < 2**30):
            self.bad(f"has {prefix}.{kinds[0]} of shape {[n, k]}")
        spec = _Spec(prefix, {"weight": "f32", "q8": "q8", "q4": "q4"}[kinds[0]], n, k * 2 if kinds[0] == "q4" else k)
        if spec.kind == "f32" and spec.k % 8:
            self.refuse(f"has {prefix} over {spec.k} inputs; the float kernel takes multiples of 8")
        if spec.kind != "f32":
            nb = self.entry(f"{prefix}.scale", "F32", ndim=2)[1]
            self.entry(f"{prefix}.scale", "F32", (n, nb))
            if nb < 1 or spec.k % nb or (spec.k // nb) % 32:
                self.refuse(f"has {prefix} in {nb} blocks over {spec.k} inputs; the kernels take blocks of a "
                            "multiple of 32")
            spec.block = spec.k // nb
            spec.zero = f"{prefix}.zero" in self.header
            if spec.zero:
                self.entry(f"{prefix}.zero", "U8", (n, nb))
        spec.bias = f"{prefix}.bias" in self.header
        if spec.bias:
            self.entry(f"{prefix}.bias", "F32", (n,))
        return spec

    def unread(self) -> list[str]:
        return sorted(set(self.header) - self.used)


def _layer_specs(f: WeightsFile, i: int, dim: int, hidden: int) -> dict:
    """Layer ``i``'s linear layers by role (q k v o gate up down; k, v, up None where packed), each checked
    against the width the C side indexes it by (one wrong width would read or write out of bounds)."""
    d, heads = f.dims, f.n_heads
    hd, kv = d["head_dim"], d["n_kv_heads"]
    specs = {n: f.linear(f"layers.{i}.attention.{n}") for n in ATTENTION}
    specs.update({n: f.linear(f"layers.{i}.feed_forward.{n}") for n in FEED_FORWARD})
    roles = {"o": ("wo", (dim, heads * hd)), "down": ("w2", (dim, hidden))}
    for packed, parts, role, rows in (("wqkv", ("wq", "wk", "wv"), "q", (heads + 2 * kv) * hd),
                                      ("w13", ("w1", "w3"), "gate", 2 * hidden)):
        if specs[packed].kind is None:
            widths = (heads * hd, kv * hd, kv * hd) if role == "q" else (hidden, hidden)
            roles.update({r: (p, (w, dim)) for r, p, w in zip(("q", "k", "v") if role == "q" else ("gate", "up"),
                                                                  parts, widths)})
        elif any(specs[p].kind is not None for p in parts):
            f.bad(f"has layer {i}'s {packed} and its parts {', '.join(parts)} both")
        else:
            roles[role] = (packed, (rows, dim))
    out = {}
    for role, (name, (n, k)) in roles.items():
        spec = specs[name]
        if spec.kind is None:
            f.bad(f"lacks layer {i}'s projection {spec.prefix}")
        if (spec.n, spec.k) != (n, k):
            f.refuse(f"has a layer {i} {role} projection of {spec.k} -> {spec.n}, not {k} -> {n}")
        out[role] = spec
    for norm in ("attention_norm", "ffn_norm"):
        f.entry(f"layers.{i}.{norm}.weight", "F32", (dim,))
    return out


def _load_linear(f: WeightsFile, spec: _Spec | None, handle) -> PackedLinear | None:
    if spec is None:
        return None  # the packed q/k/v or gate/up projection holds these rows
    p = spec.prefix
    bias = f.read(f"{p}.bias", handle) if spec.bias else None
    if spec.kind == "f32":
        return pack_f32(f.read(f"{p}.weight", handle), bias)
    raw = f.read(f"{p}.{spec.kind}", handle)
    q = raw if spec.kind == "q8" else np.stack([raw & 15, raw >> 4], -1).reshape(spec.n, spec.k)
    per = spec.block // 32
    scale = np.repeat(f.scales(p, spec.kind, handle), per, axis=1)
    zero = np.repeat(f.read(f"{p}.zero", handle).astype(np.float32), per, axis=1) if spec.zero else None
    if zero is not None and spec.kind == "q4" and zero.max() > 15:
        f.bad(f"has int4 zero points above 15 in {p}.zero")
    return pack_blocks(q, scale, zero, 8 if spec.kind == "q8" else 4, bias)


def _check_dims(f: WeightsFile) -> tuple[int, int]:
    """(dim, rotary positions): the embedding, final norm and rotary tables against the config."""
    d = f.dims
    hd, kv = d["head_dim"], d["n_kv_heads"]
    vocab, dim = f.entry("tok_embeddings.weight", "F32", ndim=2)
    if vocab != d["vocab_size"] or not 1 <= dim < 2**30:
        f.refuse(f"has an embedding of {vocab} x {dim}, not config.json's vocabulary of {d['vocab_size']}")
    if hd % 2 or f.n_heads % kv:
        f.refuse(f"has {f.n_heads} query heads over {kv} key / value heads of width {hd}")
    positions, half = f.entry("rope.cos", "F32", ndim=2)
    f.entry("rope.sin", "F32", (positions, half))
    if half != hd // 2 or positions < 1:
        f.refuse(f"has rotary tables of {positions} x {half}, not of head_dim / 2 = {hd // 2} columns")
    f.entry("norm.weight", "F32", (dim,))
    return dim, positions


def read_native_weights(path: str | Path, dims: dict) -> PackedModel:
    """The packed weights of a native weights file (``dims``: n_layers, n_kv_heads, head_dim, vocab_size, from the
    export's config.json). Every tensor is checked before any is read."""
    return pack_weights(WeightsFile(path, dims))


def pack_tensors(where: str | Path, tensors: dict, meta: dict, dims: dict) -> PackedModel:
    """The packed weights of a native weights file's tensors and metadata held in memory (a model dir's, computed by
    :mod:`prunus.runtime.native_tensors`; ``where`` names them in errors), checked as a file's are."""
    return pack_weights(WeightsFile(Path(where), dims, tensors, meta))


def pack_weights(f: WeightsFile) -> PackedModel:
    """The packed weights of a checked :class:`WeightsFile` (every tensor checked before any is read)."""
    dims = f.dims
    dim, _ = _check_dims(f)
    hidden = f.linear(f"layers.0.feed_forward.w2").k
    layers = [_layer_specs(f, i, dim, hidden) for i in range(dims["n_layers"])]
    head = None
    if not f.tied:
        head = f.linear("output")
        if head.kind is None:
            f.bad("has no output head and its metadata says the head is not tied")
        if (head.n, head.k) != (dims["vocab_size"], dim):
            f.refuse(f"has a head of {head.k} -> {head.n}, not {dim} -> {dims['vocab_size']}")
    elif dim % 8:
        f.refuse(f"has a tied head over {dim} inputs; the float kernel takes multiples of 8")
    unread = f.unread()
    if unread:
        f.bad(f"holds tensor {short(unread[0])}, which no layer reads")
    with f.opened() as h:
        emb = f.read("tok_embeddings.weight", h)
        model = PackedModel(dict(dims, n_heads=f.n_heads, hidden=hidden), eps=f.eps, scale=f.scale, emb=emb,
                            cos=f.read("rope.cos", h), sin=f.read("rope.sin", h), norm=f.read("norm.weight", h))
        for i, specs in enumerate(layers):
            layer = {role: _load_linear(f, specs.get(role), h) for role in ("q", "k", "v", "o", "gate", "up", "down")}
            layer.update(attn_norm=f.read(f"layers.{i}.attention_norm.weight", h),
                         ffn_norm=f.read(f"layers.{i}.ffn_norm.weight", h), window=f.windows[i])
            model.layers.append(layer)
        model.head = pack_f32(emb) if head is None else _load_linear(f, head, h)
    return model
