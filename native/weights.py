"""A genai export's graph (:mod:`prunus.export.genai_graph`) read into the native decoder's packed weights.

Every weight comes from the graph's own initializers, so the native decoder runs the export's numbers: fp32
``MatMul`` weights, ``MatMulNBits`` int8 / int4 (blocks a multiple of 32, integer zero points or the default),
biases as ``Add`` nodes after them, the tied head as the embedding read transposed. Linear layers are repacked
four output rows at a time (the layouts are in ``decode.c``); a block larger than 32 repeats its scale over its
32-wide pieces. A graph holding any other operator (a QDQ export, a float-zero-point term, ``DynamicQuantizeMatMul``)
is refused in one line naming it: those exports run in ONNX Runtime alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from prunus.artifacts.errors import PrunusError

KINDS = {"f32": 0, "q4": 4, "q8": 8}
RUNS = {"Gather", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "MatMul", "MatMulNBits", "Add",
        "GroupQueryAttention", "Split", "Sigmoid", "Mul", "Shape", "Sub", "Cast", "Min", "Unsqueeze", "GatherND",
        "Transpose"}
ATTENTION = ("wqkv", "wq", "wk", "wv", "wo")
FEED_FORWARD = ("w13", "w1", "w3", "w2")


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


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


class GraphReader:
    """The initializers and nodes of one genai graph, looked up by name."""

    def __init__(self, proto: onnx.ModelProto, where: str):
        self.where = where
        self.inits = {t.name: t for t in proto.graph.initializer}
        self.nodes = {n.name: n for n in proto.graph.node}
        self.consumers: dict[str, list] = {}
        for n in proto.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.by_output = {o: n for n in proto.graph.node for o in n.output}
        others = sorted({n.op_type for n in proto.graph.node} - RUNS)
        if others:
            self.refuse(f"holds {', '.join(others)} nodes")

    def refuse(self, what: str):
        raise PrunusError(f"{self.where}: the native decoder cannot run this graph: it {what}; serve it without --native")

    def array(self, name: str) -> np.ndarray:
        if name not in self.inits:
            self.refuse(f"has no initializer {name!r}")
        return numpy_helper.to_array(self.inits[name])

    def matmul(self, module: str):
        """The MatMul / MatMulNBits node of a module, or None."""
        for suffix in ("/MatMul", "/MatMul_Q8", "/MatMul_Q4", ".matmul"):
            node = self.nodes.get(module + suffix)
            if node is not None and node.op_type in ("MatMul", "MatMulNBits"):
                return node
        return None

    def bias(self, node) -> np.ndarray | None:
        users = self.consumers.get(node.output[0], [])
        adds = [u for u in users if u.op_type == "Add" and any(i in self.inits for i in u.input)]
        if not adds:
            return None
        name = next(i for i in adds[0].input if i in self.inits)
        return self.array(name).astype(np.float32)

    def linear(self, node) -> PackedLinear:
        bias = self.bias(node)
        if node.op_type == "MatMul":
            b = node.input[1]
            source = self.by_output.get(b)
            if b in self.inits:
                w = self.array(b).T
            elif source is not None and source.op_type == "Transpose" and source.input[0] in self.inits:
                w = self.array(source.input[0])  # the tied head: the embedding, (vocab, dim)
            else:
                self.refuse(f"has a MatMul ({node.name}) whose weight is not an initializer")
            if w.ndim != 2 or w.shape[1] % 8:
                self.refuse(f"has a MatMul ({node.name}) over {w.shape[-1]} inputs; the kernels take multiples of 8")
            return pack_f32(w.astype(np.float32), bias)
        return self._nbits(node, bias)

    def _nbits(self, node, bias) -> PackedLinear:
        a = _attrs(node)
        k, n, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        ins = list(node.input) + [""] * 6
        if bits not in (4, 8) or block % 32 or k % 32:
            self.refuse(f"has a {bits}-bit MatMulNBits of blocks of {block} over {k} inputs ({node.name}); "
                        "the kernels take 4 or 8 bits in blocks of a multiple of 32")
        zero_points = self.inits.get(ins[3]) if ins[3] else None
        if ins[4] or (ins[3] and (zero_points is None or zero_points.data_type != onnx.TensorProto.UINT8)):
            self.refuse(f"has a MatMulNBits with a g_idx or float zero points ({node.name})")
        raw = self.array(ins[1])
        n_blocks = raw.shape[1]
        if bits == 8:
            q = raw.reshape(n, n_blocks * block)
        else:
            q = np.stack([raw & 15, raw >> 4], -1).reshape(n, n_blocks * block)
        per = block // 32

        def expand(x):
            return np.repeat(x.reshape(n, n_blocks).astype(np.float32), per, axis=1)[:, :k // 32]

        scale = expand(self.array(ins[2]))
        zero = None
        if ins[3]:
            zp = self.array(ins[3]).reshape(n, -1)
            zero = expand(zp if bits == 8 else np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :n_blocks])
        b5 = self.array(ins[5]).astype(np.float32) if ins[5] else None
        return pack_blocks(q[:, :k], scale, zero, bits, bias if b5 is None else b5)


def read_genai_graph(proto: onnx.ModelProto, dims: dict, where: str) -> PackedModel:
    """The packed weights of a genai graph whose initializers are loaded (``onnx.load`` with external data)."""
    g = GraphReader(proto, where)
    gqa = g.nodes.get("layers.0.attention/GroupQueryAttention")
    norm0 = g.nodes.get("layers.0.attention_norm")
    if gqa is None or norm0 is None:
        g.refuse("is not a prunus genai graph (no layers.0 attention)")
    attrs = _attrs(gqa)
    if (attrs.get("do_rotary") != 1 or attrs.get("rotary_interleaved", 0) != 0 or attrs.get("softcap", 0.0)
            or attrs.get("smooth_softmax", 0)):
        g.refuse("has an attention without the rotary embedding prunus writes")
    hd = dims["head_dim"]
    model = PackedModel(dict(dims, n_heads=attrs["num_heads"]),
                        eps=float(_attrs(norm0)["epsilon"]),
                        scale=float(attrs.get("scale", 0.0)) or hd ** -0.5,
                        emb=g.array("tok_embeddings.weight").astype(np.float32),
                        cos=g.array(gqa.input[7]).astype(np.float32), sin=g.array(gqa.input[8]).astype(np.float32),
                        norm=g.array("norm.weight").astype(np.float32))
    used = set()
    for i in range(dims["n_layers"]):
        model.layers.append(_layer(g, i, used))
    head = g.by_output.get("logits")
    if head is None or head.op_type not in ("MatMul", "MatMulNBits"):
        g.refuse("has no head MatMul writing 'logits'")
    used.add(head.name)
    model.head = g.linear(head)
    extra = [n.name for n in proto.graph.node if n.op_type in ("MatMul", "MatMulNBits") and n.name not in used]
    if extra:
        g.refuse(f"has MatMul nodes outside the decoder's layers ({extra[0]})")
    model.dims["hidden"] = model.layers[0]["down"].k
    _check_shapes(g, model)
    return model


def _check_shapes(g: GraphReader, model: PackedModel) -> None:
    """Every projection's shape as the C side indexes it (one wrong width would read or write out of bounds)."""
    d = model.dims
    dim, hd, heads, kv, hidden = model.emb.shape[1], d["head_dim"], d["n_heads"], d["n_kv_heads"], d["hidden"]
    if model.cos.shape[1] != hd // 2 or model.sin.shape != model.cos.shape or model.emb.shape[0] != d["vocab_size"]:
        g.refuse("has rotary tables or an embedding of other shapes than its config's")
    if hd % 2 or heads % kv:
        g.refuse(f"has {heads} query heads over {kv} key / value heads of width {hd}")
    for i, x in enumerate(model.layers):
        want = {"o": (dim, heads * hd), "down": (dim, hidden)}
        if x["k"] is None:
            want["q"] = ((heads + 2 * kv) * hd, dim)
        else:
            want.update(q=(heads * hd, dim), k=(kv * hd, dim), v=(kv * hd, dim))
        if x["up"] is None:
            want["gate"] = (2 * hidden, dim)
        else:
            want.update(gate=(hidden, dim), up=(hidden, dim))
        for name, (n, k) in want.items():
            lin = x[name]
            if (lin.n, lin.k) != (n, k) or (lin.bias is not None and lin.bias.shape != (n,)):
                g.refuse(f"has a layer {i} {name} projection of {lin.k} -> {lin.n}, not {k} -> {n} (or a bias of "
                         "another width)")
        if x["attn_norm"].shape != (dim,) or x["ffn_norm"].shape != (dim,):
            g.refuse(f"has layer {i} norms of another width than {dim}")
    head = model.head
    if (head.n, head.k) != (d["vocab_size"], dim) or model.norm.shape != (dim,) or (
            head.bias is not None and head.bias.shape != (head.n,)):
        g.refuse("has a head or final norm of other shapes than its config's")


def _layer(g: GraphReader, i: int, used: set) -> dict:
    p = f"layers.{i}"
    mods = {}
    for name in ATTENTION:
        node = g.matmul(f"{p}.attention.{name}")
        if node is not None:
            used.add(node.name)
            mods[name] = g.linear(node)
    for name in FEED_FORWARD:
        node = g.matmul(f"{p}.feed_forward.{name}")
        if node is not None:
            used.add(node.name)
            mods[name] = g.linear(node)
    qkv = ("wqkv",) if "wqkv" in mods else ("wq", "wk", "wv")
    gate_up = ("w13",) if "w13" in mods else ("w1", "w3")
    if any(m not in mods for m in (*qkv, "wo", *gate_up, "w2")):
        g.refuse(f"lacks a projection of layer {i}")
    gqa = g.nodes.get(f"{p}.attention/GroupQueryAttention")
    if gqa is None:
        g.refuse(f"has no attention in layer {i}")
    attrs = _attrs(gqa)
    return {"q": mods[qkv[0]], "k": mods.get("wk") if len(qkv) == 3 else None,
            "v": mods.get("wv") if len(qkv) == 3 else None, "o": mods["wo"],
            "gate": mods[gate_up[0]], "up": mods.get("w3") if len(gate_up) == 2 else None, "down": mods["w2"],
            "attn_norm": g.array(f"{p}.attention_norm.weight").astype(np.float32),
            "ffn_norm": g.array(f"{p}.ffn_norm.weight").astype(np.float32),
            "window": int(attrs.get("local_window_size", -1))}
