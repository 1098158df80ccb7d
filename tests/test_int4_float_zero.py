"""int4 with float zero points (``float_zero``): the grids, the algorithms, storage, the exported graphs
(integer zero points plus a per-group term) and GGUF Q4_1, against the dequantizing PyTorch path (tensor-parallel
slices: test_int4.py)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.compress.gptq import gptq_int4
from prunus.compress.hqq import hqq_int4
from prunus.compress.int4 import int4_pass
from prunus.compress.quantize import quantize_pass
from prunus.export.int4_qdq import int4_qdq_nodes
from prunus.export.quantize_onnx import _matmul_nbits
from prunus.models.int4 import dequantize_int4, rtn_int4, split_float_zero
from prunus.models.quantized_int4 import Int4Linear


def q4_1_weight(out: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Weights dequantized from a Q4_1 grid (d * code + m per group of 32), as SmolLM2's were: every group
    holds codes 0 and 15, so its min and max are on the grid."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, k // 32, 32), generator=g)
    codes[:, :, 0], codes[:, :, 1] = 0, 15
    d = torch.rand(out, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = torch.randn(out, k // 32, 1, generator=g) * 0.05
    return (codes * d + m).reshape(out, k)


def err(w, q, s, z, g):
    return float((dequantize_int4(q, s, z, g) - w).pow(2).sum())


def test_round_to_nearest_with_float_zeros_is_exact_on_a_q4_1_grid():
    w = q4_1_weight()
    q, s, z = rtn_int4(w, 32, symmetric=False, float_zero=True)
    assert z.dtype == torch.float32 and not torch.equal(z, z.round())  # zero points off the integers
    assert err(w, q, s, z, 32) < 1e-9 * float(w.pow(2).sum())
    assert err(w, *rtn_int4(w, 32, symmetric=False), 32) > 1e-4 * float(w.pow(2).sum())  # integer zeros are not


def test_a_constant_group_and_a_nearly_constant_one_are_exact_enough():
    w = torch.randn(4, 64) * 0.02
    w[0, :32] = 0.37  # constant: min == max
    w[1, :32] = -2.0 + torch.arange(32) * 1e-7  # a span far below the values' size
    w[2, :32] = 0.0
    q, s, z = rtn_int4(w, 32, symmetric=False, float_zero=True)
    back = dequantize_int4(q, s, z, 32)
    assert torch.isfinite(back).all() and torch.equal(back[0, :32], w[0, :32]) and torch.equal(back[2, :32], w[2, :32])
    assert (back[1, :32] - w[1, :32]).abs().max() < 1e-5


def test_hqq_and_gptq_with_float_zeros():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    w[torch.rand_like(w) < 0.01] *= 20
    e_rtn = err(w, *rtn_int4(w, 64, False, float_zero=True), 64)
    e_hqq = err(w, *hqq_int4(w, 64, False, float_zero=True), 64)
    e_hqq_int = err(w, *hqq_int4(w, 64, False), 64)
    assert e_hqq < e_rtn and e_hqq < e_hqq_int, (e_hqq, e_rtn, e_hqq_int)
    g = torch.Generator().manual_seed(1)  # correlated inputs, some channels much larger: where GPTQ pays
    mix = torch.randn(256, 256, generator=g) / 16 + torch.eye(256)
    x = (torch.randn(2048, 256, generator=g) @ mix) * torch.logspace(-1, 1, 256)[torch.randperm(256, generator=g)]
    H = 2 * x.t() @ x / x.shape[0]
    out = lambda q, s, z: float((x @ (dequantize_int4(q, s, z, 64) - w).t()).pow(2).mean())  # noqa: E731
    q, s, z = gptq_int4(w, H, 64, False, float_zero=True)
    assert z.dtype == torch.float32 and out(q, s, z) < 0.8 * out(*rtn_int4(w, 64, False, float_zero=True))


def test_split_float_zero_is_the_same_weight():
    w = q4_1_weight(seed=3)
    q, s, z = hqq_int4(w, 32, False, float_zero=True)
    z_int, term = split_float_zero(z, s)
    assert z_int.dtype == torch.uint8 and int(z_int.max()) <= 15
    split = dequantize_int4(q, s, z_int, 32) + term.repeat_interleave(32, dim=1)
    torch.testing.assert_close(split, dequantize_int4(q, s, z, 32), rtol=1e-6, atol=1e-7)


def _layer_session(module, write):
    """One Int4Linear as an ONNX graph (``write``: MatMulNBits or QDQ), computed in float (MatMulNBits at accuracy
    level 0), so it must give the module's own output."""
    import onnxruntime as ort

    nodes, inits = write("x", ["y"], "layer", module)
    for n in nodes:
        for a in n.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", module.in_features])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", module.out_features])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    onnx.checker.check_model(proto)
    opts = ort.SessionOptions()  # unoptimized: ONNX Runtime fuses DequantizeLinear -> MatMul into level-4 MatMulNBits
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("write", [_matmul_nbits, int4_qdq_nodes], ids=["matmulnbits", "qdq"])
def test_exported_layer_computes_the_float_zero_weight(write):
    torch.manual_seed(0)
    lin = nn.Linear(128, 48, bias=False)
    lin.weight.data = q4_1_weight(48, 128, seed=2)
    m = Int4Linear.from_quantized(lin, *hqq_int4(lin.weight, 32, False, float_zero=True), 32, False, "hqq", float_zero=True)
    x = torch.randn(2, 5, 128)
    with torch.no_grad():
        ref = F.linear(x, m.dequantize())
        torch.testing.assert_close(m(x), ref)
    got = _layer_session(m, write).run(["y"], {"x": x.numpy()})[0]
    assert np.abs(got - ref.numpy()).max() < 1e-5 * float(ref.abs().max()) + 1e-6


def test_float_zero_model_saves_loads_exports_and_writes_q4_1(tmp_path, trained_run):
    import gguf

    from prunus.export import export_model
    from prunus.export.backend_parity import export_graphs
    from prunus.models import load_model, save_model
    from prunus.models.gguf_read import from_gguf
    from prunus.models.gguf_write import to_gguf
    from safetensors.torch import load_file

    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", algorithm="hqq", group_size=32, symmetric=False,
                  float_zero=True)
    save_model(model, tmp_path / "m", stage="compress", parent=trained_run / "model", command="test")
    back = load_model(tmp_path / "m")
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(tokens)
        torch.testing.assert_close(back(tokens), ref, rtol=0, atol=0)
    wq = back.layers["0"].attention.wq
    assert wq.float_zero and wq.spec()["float_zero"] is True and wq.weight_zero.dtype == torch.float32
    assert load_file(tmp_path / "m" / "model.safetensors")["layers.0.attention.wq.weight_zero"].dtype == torch.float32
    result = export_model(tmp_path / "m", tmp_path / "onnx", progress=False, graph="torch")
    assert result.parity["passed"]
    nodes = onnx.load(str(tmp_path / "onnx" / "decode.onnx")).graph.node
    nbits = [n.name for n in nodes if n.op_type == "MatMulNBits"]
    terms = [n.name for n in nodes if n.op_type == "Add" and n.name.endswith(".add_zero_term")]
    assert len(nbits) == 7 * len(model.layers) and len(terms) == len(nbits)  # each int4 layer adds its group term
    got = export_graphs(tmp_path / "onnx", result.config)(tokens)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # float zero points are Q4_1's m = -z * s where d = s and m are fp16 values; else the layer stays F32 (exact)
    to_gguf(tmp_path / "m", tmp_path / "m.gguf", type="q4_1")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.attn_q.weight"] in ("Q4_1", "F32")
    read = load_model(from_gguf(tmp_path / "m.gguf", tmp_path / "from-gguf"))
    w, w_back = wq.dequantize(), read.layers["0"].attention.wq.weight.detach()
    assert torch.equal(w_back, w)  # the dir's weights, never quantized again


def test_float_zero_bad_requests(tiny_model):
    with pytest.raises(PrunusError, match="float_zero is for asymmetric int4"):
        int4_pass(copy.deepcopy(tiny_model), None, float_zero=True)
    with pytest.raises(PrunusError, match="float_zero must be true or false|must be true or false"):
        int4_pass(copy.deepcopy(tiny_model), None, symmetric=False, float_zero="yes")
    with pytest.raises(PrunusError, match="are for scheme int4-weight-only"):
        quantize_pass(copy.deepcopy(tiny_model), None, scheme="int8-weight-only", float_zero=True)
