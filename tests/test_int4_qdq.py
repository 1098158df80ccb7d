"""int4 for TensorRT: stored int4 weights as blocked INT4 / UINT4 DequantizeLinear (opset 21) -> MatMul."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import prunus.export.export_dir as export_dir
import prunus.export.tensorrt_build as tensorrt_build
from prunus.artifacts.errors import PrunusError
from prunus.compress.quantize import quantize_pass
from prunus.export import EXPORT_GRAPHS, export_model
from prunus.export.backend_parity import export_graphs
from prunus.export.int4_qdq import int4_qdq_nodes, int4_tensor
from prunus.export.onnx_export import dequantized_copy, export_prefill
from prunus.export.quantize_onnx import apply_stored_quantization
from prunus.models import load_model, save_model
from prunus.models.quant_registry import quantized_modules

FLOAT_MATMUL = {"session.qdq_matmulnbits_accuracy_level": "0"}  # DequantizeLinear -> MatMul computed in float


def _int4_model(trained_run, symmetric: bool):
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", algorithm="rtn", group_size=32, symmetric=symmetric,
                  int8=["layers.-1"])
    return model


def _session(proto):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    for key, value in FLOAT_MATMUL.items():
        opts.add_session_config_entry(key, value)
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("signed", [True, False])
def test_int4_tensor_packs_as_onnx_reads_it(signed):
    rng = np.random.default_rng(0)
    values = rng.integers(-8 if signed else 0, 8 if signed else 16, size=(3, 5))  # 15 values: a padded last byte
    proto = int4_tensor("w", values, signed)
    assert proto.data_type == (TensorProto.INT4 if signed else TensorProto.UINT4) and len(proto.raw_data) == 8
    assert np.array_equal(numpy_helper.to_array(proto).astype(np.int64), values)
    flat = values.reshape(-1) & 0x0F
    assert proto.raw_data[0] == flat[0] | (flat[1] << 4)  # low nibble first
    with pytest.raises(ValueError):
        int4_tensor("w", values + 16, signed)


@pytest.mark.parametrize("symmetric", [True, False])
def test_qdq_graph_holds_the_stored_integers_and_matches_pytorch(trained_run, symmetric):
    model = _int4_model(trained_run, symmetric)
    modules = quantized_modules(model)
    int4 = {n: m for n, m in modules.items() if m.scheme == "int4-weight-only"}
    proto = export_prefill(dequantized_copy(model), opset=21)
    # 7 int4 modules, 7 int8 (the last block); the output head stays float
    assert apply_stored_quantization(proto, modules, style="qdq", int4_style="qdq") == len(modules) == 14
    onnx.checker.check_model(proto, full_check=True)
    assert len(int4) == 7 and not [n for n in proto.graph.node if n.op_type == "MatMulNBits" or n.domain]
    inits = {i.name: i for i in proto.graph.initializer}
    dqs = {n.input[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    for name, m in int4.items():  # the module's own integers, laid out (K, N), blocked along K
        w = inits[f"{name}.weight_q4"]
        q = m.unpacked().t().numpy().astype(np.int64)
        assert list(w.dims) == [m.in_features, m.out_features]
        assert w.data_type == (TensorProto.INT4 if symmetric else TensorProto.UINT4)
        assert np.array_equal(numpy_helper.to_array(w).astype(np.int64), q - 8 if symmetric else q)
        assert np.array_equal(numpy_helper.to_array(inits[f"{name}.weight_scale"]), m.weight_scale.t().numpy())
        attrs = {a.name: helper.get_attribute_value(a) for a in dqs[w.name].attribute}
        assert attrs == {"axis": 0, "block_size": 32}
        if symmetric:
            assert len(dqs[w.name].input) == 2  # TensorRT takes no zero point
        else:
            z = inits[f"{name}.weight_zero_point"]
            assert z.data_type == TensorProto.UINT4
            assert np.array_equal(numpy_helper.to_array(z).astype(np.int64), m.weight_zero.t().numpy())
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(tokens).numpy()
    b, s = tokens.shape
    feeds = {"input_ids": tokens.numpy(), "position_ids": torch.arange(s).expand(b, s).numpy(),
             "attention_mask": np.ones((b, s), dtype=np.int64)}
    got = _session(proto).run(["logits"], feeds)[0]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("symmetric", [True, False])
def test_one_layer_dequantize_linear_semantics(trained_run, symmetric):
    """ONNX's reference evaluator reads the blocked DequantizeLinear as the module's dequantized weight."""
    m = next(m for m in _int4_model(trained_run, symmetric).modules() if m.__class__.__name__ == "Int4Linear")
    nodes, inits = int4_qdq_nodes("x", ["y"], "layer", m)
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, m.in_features])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, m.out_features])
    graph = helper.make_graph(nodes, "one_layer", [x_info], [y_info], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(proto, full_check=True)
    x = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(1))
    want = (x @ m.dequantize().t()).numpy()
    got = ReferenceEvaluator(proto).run(None, {"x": x.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.fixture(scope="module")
def int4_dirs(trained_run, tmp_path_factory):
    """Compressed tiny models at int4 (RTN, group 32, last block int8): symmetric and asymmetric."""
    dirs = {}
    for symmetric in (True, False):
        out = tmp_path_factory.mktemp("int4qdq") / ("sym" if symmetric else "asym")
        save_model(_int4_model(trained_run, symmetric), out, stage="compress", parent=trained_run / "model",
                   command="test")
        dirs[symmetric] = out
    return dirs


def test_tensorrt_export_writes_int4_qdq_graphs(int4_dirs, tmp_path, monkeypatch):
    """The export path of --format tensorrt up to the engine build (TensorRT itself is stubbed out here):
    graphs at opset 21 holding INT4 DequantizeLinear, and a parity report computed in float by ONNX Runtime."""
    monkeypatch.setattr(tensorrt_build, "check_tensorrt", lambda *a, **k: None)
    monkeypatch.setattr(export_dir, "_build_engines", lambda *a, **k: {})
    out = tmp_path / "trt"
    result = export_model(int4_dirs[True], out, format="tensorrt", progress=False, eval_tokens=512)
    export = result.config["export"]
    assert result.parity["passed"] and export["precision"] == "int4" and export["int4_style"] == "qdq"
    assert export["opset"] == 21
    for kind in ("prefill", "decode"):
        proto = onnx.load(str(out / EXPORT_GRAPHS[kind]))
        onnx.checker.check_model(proto)
        assert not [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
        int4 = [i for i in proto.graph.initializer if i.data_type == TensorProto.INT4]
        assert len(int4) == 7
    model = load_model(int4_dirs[True])
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(tokens)
    got = export_graphs(out, result.config)(tokens)  # a TensorRT dir's graphs: float semantics
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_tensorrt_refuses_asymmetric_int4(int4_dirs, tmp_path):
    with pytest.raises(PrunusError, match="asymmetric, and TensorRT's DequantizeLinear takes no zero points"):
        export_model(int4_dirs[False], tmp_path / "x", format="tensorrt", progress=False)
    with pytest.raises(PrunusError, match="int4 style 'nbits'"):
        apply_stored_quantization(onnx.ModelProto(), {}, int4_style="nbits")
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available(),
                    reason="building a TensorRT engine needs the tensorrt package and a CUDA GPU")
def test_tensorrt_engine_from_int4(int4_dirs, tmp_path):
    out = tmp_path / "trt"
    result = export_model(int4_dirs[True], out, format="tensorrt", progress=False, eval_tokens=512,
                          timing_cache=tmp_path / "timing")
    assert result.parity["passed"] and (out / "prefill.plan").stat().st_size and (out / "decode.plan").stat().st_size
    assert result.config["export"]["engines"]["decode"]["precision"] == "int4"
