"""int4 export: stored int4 weights as ONNX Runtime MatMulNBits (the same bytes), --precision int4, parity."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from prunus.compress.quantize import quantize_pass
from prunus.export import EXPORT_GRAPHS, export_model
from prunus.export.backend_parity import export_graphs
from prunus.export.onnx_export import dequantized_copy, export_prefill
from prunus.export.quantize_onnx import apply_stored_quantization
from prunus.artifacts.errors import PrunusError
from prunus.models import load_model, save_model
from prunus.models.int4 import pack_zero_points
from prunus.models.quant_registry import quantized_modules


def _session(proto, optimize: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feeds(tokens):
    b, s = tokens.shape
    return {"input_ids": tokens.numpy(), "position_ids": torch.arange(s).expand(b, s).numpy(),
            "attention_mask": np.ones((b, s), dtype=np.int64)}


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_graph_holds_the_stored_bytes(trained_run, symmetric):
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", algorithm="hqq", group_size=32, symmetric=symmetric,
                  exclude=())
    modules = quantized_modules(model)
    proto = export_prefill(dequantized_copy(model), opset=21)
    assert apply_stored_quantization(proto, modules, style="qdq") == len(modules) == 15
    onnx.checker.check_model(proto)
    inits = {i.name: i for i in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 15 and not [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    for name, m in modules.items():  # the module's own bytes, scales and zero points
        b = numpy_helper.to_array(inits[f"{name}.weight_q4"])
        assert b.shape == (m.out_features, m.in_features // 32, 16) and b.tobytes() == m.weight.numpy().tobytes()
        assert np.array_equal(numpy_helper.to_array(inits[f"{name}.weight_scale"]), m.weight_scale.reshape(-1).numpy())
        if symmetric:
            assert f"{name}.weight_zero_point" not in inits  # MatMulNBits's default zero point is 8
        else:
            assert np.array_equal(numpy_helper.to_array(inits[f"{name}.weight_zero_point"]),
                                  pack_zero_points(m.weight_zero).numpy())
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(tokens).numpy()
    for node in nodes:  # accuracy level 0 computes in float: the graph then says exactly what the module does
        next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    exact = _session(proto).run(["logits"], _feeds(tokens))[0]
    assert np.abs(exact - ref).max() < 1e-4 * np.abs(ref).max() + 1e-5
    for node in nodes:  # level 4 quantizes activations to int8 per block inside the kernel (the fast path)
        next(a for a in node.attribute if a.name == "accuracy_level").i = 4
    fast = _session(proto).run(["logits"], _feeds(tokens))[0]
    assert (fast.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.fixture(scope="module")
def int4_model_dir(trained_run, tmp_path_factory):
    """The tiny trained model at int4 (RTN, asymmetric, default groups), its last block at int8."""
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", symmetric=False, int8=["layers.-1"])
    out = tmp_path_factory.mktemp("compressed") / "int4"
    save_model(model, out, stage="compress", parent=trained_run / "model", command="test")
    return out


def test_int4_model_dir_exports_with_parity(int4_model_dir, tmp_path):
    out = tmp_path / "int4"
    result = export_model(int4_model_dir, out, progress=False, graph="torch")
    assert result.parity["passed"] and result.parity["precision"] == "int4" and result.config["export"]["precision"] == "int4"
    graph = onnx.load(str(out / EXPORT_GRAPHS["decode"])).graph
    ops = [n.op_type for n in graph.node]
    nbits = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in graph.node if n.op_type == "MatMulNBits"]
    # int4 block 0, int8 block 1: every Linear a MatMulNBits (bits 8 for the int8 ones), no float weight left
    assert sorted(a["bits"] for a in nbits) == [4] * 7 + [8] * 7 and "DequantizeLinear" not in ops
    model = load_model(int4_model_dir)
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(tokens)
    got = export_graphs(out, result.config)(tokens)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("head", ["int8", "int4"])
def test_quantized_output_head_exports_as_matmulnbits_holding_its_stored_integers(trained_run, head):
    """An int4 model with its output head quantized (untied from the embedding, which stays a float Gather):
    the head is a MatMulNBits of bits 8 (the int8 values + 128, per-channel scales repeated over the blocks) or
    4, and at accuracy level 0 (float compute) the graph computes what the PyTorch model does."""
    model = load_model(trained_run / "model")
    int8 = ["output"] if head == "int8" else []
    quantize_pass(model, None, scheme="int4-weight-only", group_size=32, symmetric=False, exclude=(), int8=int8)
    assert not model.config.tie_embeddings and model.tok_embeddings.weight.is_floating_point()
    modules = quantized_modules(model)
    proto = export_prefill(dequantized_copy(model), opset=21)
    assert apply_stored_quantization(proto, modules) == len(modules) == 15
    nodes = {n.name: n for n in proto.graph.node if n.op_type == "MatMulNBits"}
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes["output.matmul"].attribute}
    vocab, dim = model.output.out_features, model.output.in_features
    assert (attrs["N"], attrs["K"], attrs["bits"]) == (vocab, dim, 8 if head == "int8" else 4)
    assert "Gather" in [n.op_type for n in proto.graph.node]  # the embedding: a float table
    if head == "int8":
        inits = {i.name: i for i in proto.graph.initializer}
        b = numpy_helper.to_array(inits["output.weight_q8"])
        assert b.shape == (vocab, dim // attrs["block_size"], attrs["block_size"])
        assert np.array_equal(b.reshape(vocab, dim).astype(np.int16) - 128, model.output.weight.numpy())
        assert len(proto.graph.input) == 3 and not any(n.endswith("zero_point") for n in inits if n.startswith("output"))
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(tokens).numpy()
    for node in nodes.values():
        next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    exact = _session(proto).run(["logits"], _feeds(tokens))[0]
    assert np.abs(exact - ref).max() < 1e-4 * np.abs(ref).max() + 1e-5


def test_precision_int4_quantizes_a_float_model(trained_run, tmp_path):
    out = tmp_path / "q4"
    export_model(trained_run / "model", out, precision="int4", verify=False, progress=False, graph="torch")
    parity = json.loads((out / "parity.json").read_text())
    assert parity["precision"] == "int4" and parity["top1_agreement"] > 0.5
    graph = onnx.load(str(out / "decode.onnx")).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 15 and all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "bits")) == 4
                                    for n in nodes)


def test_bad_int4_export_requests(int4_model_dir, trained_run, tmp_path):
    with pytest.raises(PrunusError, match="holds int4 weights; export it at --precision int4"):
        export_model(int4_model_dir, tmp_path / "x", precision="int8", progress=False)
    with pytest.raises(PrunusError, match="--precision int4 takes the stored int4 weights"):
        export_model(trained_run / "model", tmp_path / "y", format="tensorrt", precision="int4", progress=False)
    assert not list(tmp_path.iterdir())
