"""``native_weights.safetensors``: the native decoder's weights as export writes them beside a genai graph.

The file holds the graph's own numbers (float weights, and the int8 / int4 codes, scales and zero points of every
``MatMulNBits``: ONNX Runtime's quantization of a float model, or a compressed dir's stored codes), it is read with
every size checked against the file and the config before anything is allocated, a hostile or stale file is one
line, and ``native/`` reads no graph. None of this needs the kernels (no compiler, no AVX2)."""

from __future__ import annotations

import ast
import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from safetensors import safe_open
from safetensors.numpy import save_file

from family_variants import family_model
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.native_layout import NATIVE_WEIGHTS
from prunus.compress.quantize import quantize_pass
from prunus.export.genai_graph import genai_dims, quantized_genai_graph
from prunus.native.weights import native_weights_file, read_native_weights

ROOT = Path(__file__).resolve().parents[1]


def _stored(model) -> dict:
    return {n: m for n, m in model.named_modules() if hasattr(m, "weight_scale")}


def _export(model, out: Path, precision: str, style: str = "matmulnbits") -> Path:
    """The genai graph and the native weights, as prunus export writes them (no parity check)."""
    out.mkdir(parents=True, exist_ok=True)
    return quantized_genai_graph(model, _stored(model), precision, out, False, style, "matmulnbits")


def _graph_weights(path: Path) -> dict:
    """Graph node prefix -> the (out, in) float32 weight each MatMul / MatMulNBits computes with, dequantized
    from its own initializers ((code - zero point) * scale)."""
    proto = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    out = {}
    for node in proto.graph.node:
        prefix = node.name.split("/")[0].removesuffix(".matmul")
        if node.op_type == "MatMul" and node.input[1] in inits:
            out[prefix] = inits[node.input[1]].T
        elif node.op_type == "MatMul" and node.input[1] in producers:  # the tied head: Transpose(embedding)
            out[prefix] = inits[producers[node.input[1]].input[0]]
        elif node.op_type == "MatMulNBits":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            n, k, bits, block = a["N"], a["K"], a["bits"], a["block_size"]
            raw = inits[node.input[1]].reshape(n, -1)
            q = raw if bits == 8 else np.stack([raw & 15, raw >> 4], -1).reshape(n, -1)
            zero = np.full((n, k // block), 128 if bits == 8 else 8, np.float32)
            if len(node.input) > 3 and node.input[3]:
                zp = inits[node.input[3]].reshape(n, -1)
                zero = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :k // block].astype(np.float32)
            scale = inits[node.input[2]].reshape(n, k // block)
            out[prefix] = (q[:, :k].astype(np.float32) - np.repeat(zero, block, 1)) * np.repeat(scale, block, 1)
    return out


def _native_weights(path: Path) -> dict:
    """Prefix -> the (out, in) float32 weight the native file holds for each linear layer."""
    with safe_open(path, "np") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        tied = f.metadata()["tied_head"] == "true"
    out = {"output": t["tok_embeddings.weight"]} if tied else {}
    for name in t:
        prefix, _, kind = name.rpartition(".")
        if kind == "weight" and not prefix.endswith("norm") and prefix != "tok_embeddings":
            out[prefix] = t[name]
        elif kind in ("q8", "q4"):
            raw = t[name]
            q = raw if kind == "q8" else np.stack([raw & 15, raw >> 4], -1).reshape(raw.shape[0], -1)
            block = q.shape[1] // t[f"{prefix}.scale"].shape[1]
            zero = t.get(f"{prefix}.zero", np.full_like(t[f"{prefix}.scale"], 128 if kind == "q8" else 8))
            out[prefix] = ((q.astype(np.float32) - np.repeat(zero.astype(np.float32), block, 1))
                           * np.repeat(t[f"{prefix}.scale"], block, 1))
    return out


@pytest.mark.parametrize("case", ["fp32", "int8", "int4", "stored-int4-zero-points-int8-block", "stored-int8"])
def test_the_native_weights_are_the_graphs_numbers(tmp_path, case):
    """Every linear layer of the graph (ONNX Runtime's codes of a float model at int8 / int4, a compressed dir's
    stored int4 codes with zero points and int8 codes, float layers, the tied head) holds, in the native file,
    exactly the weight the graph computes with: bit for bit."""
    model = family_model("llama")
    precision = case if not case.startswith("stored") else ("int4" if "int4" in case else "int8")
    if case.startswith("stored-int4"):
        quantize_pass(model, None, scheme="int4-weight-only", algorithm="rtn", group_size=32, symmetric=False,
                      int8=["layers.-1"])
    elif case == "stored-int8":
        quantize_pass(model, None, scheme="int8-weight-only", granularity="per_channel")
    graph = _graph_weights(_export(model, tmp_path, precision))
    native = _native_weights(tmp_path / NATIVE_WEIGHTS)
    assert sorted(graph) == sorted(native)  # the same linear layers, packed (q/k/v, gate/up) where the graph packs
    for prefix, w in graph.items():
        assert w.shape == native[prefix].shape and np.array_equal(w, native[prefix]), prefix
    kinds = {k.rpartition(".")[2] for k in safe_open(tmp_path / NATIVE_WEIGHTS, "np").keys()}
    assert {"q4", "q8"} & kinds if precision != "fp32" else "weight" in kinds


def _fp32_file(tmp_path: Path):
    model = family_model("llama")
    _export(model, tmp_path, "fp32")
    path = tmp_path / NATIVE_WEIGHTS
    with safe_open(path, "np") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    return model, path, tensors, meta


def _one_line(match: str, fn, *args):
    with pytest.raises(PrunusError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_valid_file_reads_and_stale_or_hostile_ones_are_one_line(tmp_path):
    model, path, tensors, meta = _fp32_file(tmp_path)
    dims = genai_dims(model)
    packed = read_native_weights(path, dims)
    assert packed.dims["hidden"] == model.config.ffn_dim and len(packed.layers) == model.config.n_layers
    assert packed.head.n == model.config.vocab_size  # the tied head, read from the embedding
    bad = tmp_path / "bad.safetensors"

    def variant(match: str, tensors=tensors, **changes):
        save_file(tensors, str(bad), metadata={**meta, **changes})
        return _one_line(match, read_native_weights, bad, dims)

    variant("has format 'prunus-native/0', not prunus-native/1; re-export", format="prunus-native/0")
    variant("cannot run this export: it holds x as QDQ; serve it without --native", unsupported="holds x as QDQ")
    variant("has n_heads '4x' in its metadata, not an integer", n_heads="4x")
    variant("has 1 sliding windows in its metadata for 2 layers", windows="-1")
    variant("has eps 'nan' in its metadata, not a positive number", eps="nan")
    variant("holds tensor 'extra', which no layer reads", tensors={**tensors, "extra": np.zeros(3, np.float32)})
    variant(r"has norm.weight of F32 \[65\], not F32 \(64,\)",
            tensors={**tensors, "norm.weight": np.ones(65, np.float32)})
    wide = {**tensors, "layers.1.feed_forward.w2.weight": np.zeros((64, 96), np.float32)}
    variant(f"has a layer 1 down projection of 96 -> 64, not {model.config.ffn_dim} -> 64", tensors=wide)
    odd = {k: v for k, v in tensors.items() if not k.startswith("layers.0.feed_forward.w13")}
    rows = 2 * model.config.ffn_dim
    odd["layers.0.feed_forward.w13.q4"] = np.zeros((rows, 32), np.uint8)  # int4 codes over 64 inputs ...
    odd["layers.0.feed_forward.w13.scale"] = np.ones((rows, 4), np.float32)  # ... in blocks of 16
    variant("has layers.0.feed_forward.w13 in 4 blocks over 64 inputs; the kernels take blocks of a multiple of 32",
            tensors=odd)
    _one_line("config.json gives n_kv_heads 0, not a size", read_native_weights, path, {**dims, "n_kv_heads": 0})
    _one_line(r"has rotary tables of \d+ x 8, not of head_dim / 2 = 4 columns", read_native_weights, path,
              {**dims, "head_dim": 8})


def test_sizes_are_checked_before_anything_is_allocated(tmp_path):
    """A header claiming a tensor far larger than the file, or a truncated file: one line, from the header alone."""
    model, path, _, _ = _fp32_file(tmp_path)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["tok_embeddings.weight"]["shape"] = [1 << 40, 64]
    text = json.dumps(header).encode()
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    _one_line("do not hold a F32 tensor of shape", read_native_weights, tmp_path / "huge.safetensors",
              genai_dims(model))
    (tmp_path / "short.safetensors").write_bytes(raw[:-100])
    _one_line("truncated", read_native_weights, tmp_path / "short.safetensors", genai_dims(model))


def test_the_file_name_resolves_inside_the_export_dir(tmp_path):
    _fp32_file(tmp_path / "outside")
    export = tmp_path / "export"
    export.mkdir()
    _one_line("has no native_weights.safetensors.*re-export with this prunus version", native_weights_file, export)
    os.symlink(tmp_path / "outside" / NATIVE_WEIGHTS, export / NATIVE_WEIGHTS)
    _one_line("leads outside", native_weights_file, export)
    os.unlink(export / NATIVE_WEIGHTS)
    os.mkfifo(export / NATIVE_WEIGHTS)
    _one_line("is a FIFO", native_weights_file, export)


def test_an_export_the_kernels_do_not_mirror_says_why(tmp_path):
    """int8 as DynamicQuantizeMatMul or QDQ, int4 with float zero points: a file of no tensors saying why."""
    model = family_model("llama")
    quantize_pass(model, None, scheme="int4-weight-only", algorithm="rtn", group_size=32, symmetric=False,
                  float_zero=True)
    _export(model, tmp_path, "int4")
    _one_line(r"cannot run this export: it holds layers.0.attention.wq \(int4-weight-only\) as float zero points; "
              "serve it without --native", read_native_weights, tmp_path / NATIVE_WEIGHTS, genai_dims(model))
    model = family_model("llama")
    quantize_pass(model, None, scheme="int8-weight-only", granularity="per_tensor")
    _export(model, tmp_path / "qdq", "int8")
    _one_line(r"holds layers.0.attention.wq \(int8-weight-only\) as QDQ", read_native_weights,
              tmp_path / "qdq" / NATIVE_WEIGHTS, genai_dims(model))


def test_native_reads_no_graph_and_imports_only_artifacts():
    """native/ imports nothing of prunus but artifacts, and no ONNX, ONNX Runtime or torch."""
    for path in sorted((ROOT / "native").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")
                assert top[0] not in ("onnx", "onnxruntime", "torch"), (path.name, name)
                assert top[0] != "prunus" or top[1] == "artifacts", (path.name, name)


# --- NaN, infinity and overflowing scales -------------------------------------------------------------------------

def _file(tmp_path: Path, case: str):
    """(dims, tensors, metadata) of the native weights of a tiny llama export: "fp32", "int8" / "int4" (ONNX
    Runtime's codes of the float model), or "stored" (a compressed dir's int4 codes with zero points and int8 codes)."""
    model = family_model("llama")
    if case == "stored":
        quantize_pass(model, None, scheme="int4-weight-only", algorithm="rtn", group_size=32, symmetric=False,
                      int8=["layers.-1"])
    _export(model, tmp_path, "int4" if case == "stored" else case)
    with safe_open(tmp_path / NATIVE_WEIGHTS, "np") as f:
        return genai_dims(model), {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _changed(tensors: dict, name: str, index: int, value) -> dict:
    a = tensors[name].copy()
    a.reshape(-1)[index] = value
    return {**tensors, name: a}


def _all_finite(packed) -> bool:
    """Every float the kernels read from ``packed`` is finite, and every block's codes dequantize within float32."""
    arrays = [packed.emb, packed.cos, packed.sin, packed.norm]
    for lin in [packed.head, *(x for layer in packed.layers for x in layer.values())]:
        if isinstance(lin, np.ndarray):
            arrays.append(lin)
        elif lin is not None and not isinstance(lin, int):
            arrays += [a for a in (lin.s, lin.sz, lin.bias) if a is not None] + ([lin.w] if lin.kind == "f32" else [])
            if lin.s is not None and np.abs(lin.s).max() * (255 if lin.kind == "q8" else 15) > np.finfo(np.float32).max:
                return False
    return all(np.isfinite(a).all() for a in arrays)


@pytest.mark.parametrize("case", ["fp32", "int8", "int4"])
def test_nonfinite_weights_and_overflowing_scales_are_one_line_naming_the_tensor(tmp_path, case):
    """NaN or infinity in any float tensor (a weight, a bias, a norm, the embedding, a rotary table, a block scale),
    and an int8 / int4 scale whose codes would dequantize past float32 (|scale| over 3.4e38 / 255, or / 15 for
    int4): one line naming the tensor and the element. A zero or negative scale reads: the kernels need no sign."""
    dims, tensors, meta = _file(tmp_path, case)
    bad = tmp_path / "bad.safetensors"

    def read(changed: dict):
        save_file(changed, str(bad), metadata=meta)
        return read_native_weights(bad, dims)

    assert _all_finite(read(tensors))
    floats = ["tok_embeddings.weight", "norm.weight", "rope.cos", "layers.1.ffn_norm.weight",
              "layers.0.attention.wqkv.bias",
              "layers.1.feed_forward.w2.weight" if case == "fp32" else "layers.1.feed_forward.w2.scale"]
    for name, value, shown in zip(floats, [np.nan, np.inf, -np.inf, np.nan, np.inf, np.nan],
                                  ["nan", "inf", "-inf", "nan", "inf", "nan"]):
        _one_line(f"bad.safetensors: tensor '{name}' holds {shown} at element 3 of \\d+; the export's weights are "
                  "damaged; re-export", read, _changed(tensors, name, 3, value))
    if case == "fp32":
        return
    scale, span = "layers.0.feed_forward.w13.scale", 255 if case == "int8" else 15
    limit = float(np.finfo(np.float32).max) / span
    _one_line(f"tensor 'layers.0.feed_forward.w13.scale' holds .* at element 5, beyond .*: its {case} codes would "
              "dequantize past float32's range", read, _changed(tensors, scale, 5, np.float32(limit * 1.01)))
    for fine in (np.float32(limit * 0.99), 0.0, -0.5):  # at the limit, zero, negative: the kernels' sums stay finite
        assert _all_finite(read(_changed(tensors, scale, 5, fine)))


def test_fuzz_native_weights_reader(tmp_path):
    """Seeded, time-bounded: random NaN / inf / huge / tiny / zero / negative floats in any float tensor (scales
    included) and random bytes in the int8 / int4 codes and zero points of tiny fp32, int8 and stored int4-with-zero-
    points exports' native weights. Each read is a packed model whose every float is finite and every block within
    float32, or one PrunusError line; never anything else."""
    rng = np.random.default_rng(20240611)
    files = [_file(tmp_path / case, case) for case in ("fp32", "int8", "stored")]
    specials = np.array([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e37, 2.2e37, 1.3e36, 1e30, 65504.0, 1e-45, 0.0,
                         -1.0], np.float32)
    bad, deadline, outcomes = tmp_path / "fuzz.safetensors", time.monotonic() + 3.0, {"read": 0, "refused": 0}
    for case in range(400):
        if time.monotonic() > deadline:
            break
        dims, tensors, meta = files[case % len(files)]
        changed = dict(tensors)
        for _ in range(int(rng.integers(1, 4))):
            name = list(tensors)[int(rng.integers(len(tensors)))]
            a = changed[name].copy()
            at = rng.integers(a.size, size=int(rng.integers(1, 4)))
            a.reshape(-1)[at] = (rng.integers(0, 256, at.size) if a.dtype == np.uint8 else
                                 rng.choice(specials, at.size))
            changed[name] = a
        save_file(changed, str(bad), metadata=meta)
        try:
            packed = read_native_weights(bad, dims)
        except PrunusError as e:
            assert "\n" not in str(e) and str(bad) in str(e), str(e)
            outcomes["refused"] += 1
            continue
        assert _all_finite(packed), case
        outcomes["read"] += 1
    assert outcomes["read"] and outcomes["refused"], outcomes
