"""prunus export: ONNX graphs with a KV cache against PyTorch, int8 / fp8 graphs, parity reports, bad input."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from prunus.cli.main import cli
from prunus.compress.quantize import quantize_pass
from prunus.export import EXPORT_GRAPHS, OrtGraphs, export_model, load_export
from prunus.export import parity as parity_mod
from prunus.export.onnx_export import dequantized_copy, export_prefill
from prunus.export.ort_graphs import ort_session
from prunus.export.quantize_onnx import apply_stored_quantization, untie_weights
from prunus.models import generate, load_model, save_model
from prunus.models.model_dir import sha256_file
from prunus.models.quantized import QuantizedLinear

PARITY_FIELDS = {"precision", "max_abs_logits", "top1_agreement", "bpb_torch", "bpb_onnx", "bpb_increase",
                 "greedy_agreement", "greedy_tokens", "tolerances", "failed", "passed"}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="session")
def fp32_export(trained_run, tmp_path_factory):
    """The tiny trained model exported once at fp32 (read-only for tests)."""
    out = tmp_path_factory.mktemp("export") / "fp32"
    export_model(trained_run / "model", out, progress=False)
    return out


@pytest.fixture(scope="session")
def torch_model(trained_run):
    return load_model(trained_run / "model")


@pytest.fixture(scope="session")
def ort_graphs(fp32_export):
    cfg, _ = load_export(fp32_export)
    g = cfg["export"]["graphs"]
    return OrtGraphs(fp32_export / g["prefill"], fp32_export / g["decode"], cfg["export"]["n_layers"], threads=1)


def test_export_dir_follows_the_contract(fp32_export, trained_run):
    config, tokenizer = load_export(fp32_export)
    exp = config["export"]
    assert exp["format"] == "onnx" and exp["precision"] == "fp32" and exp["graphs"] == EXPORT_GRAPHS
    model_cfg = json.loads((trained_run / "model" / "config.json").read_text())
    assert {k: config[k] for k in model_cfg} == model_cfg
    assert (exp["n_layers"], exp["n_kv_heads"], exp["head_dim"], exp["vocab_size"]) == (2, 2, 16, 320)
    assert tokenizer.decode(tokenizer.encode("def f():")) == "def f():"
    names = {"prefill": ["input_ids", "position_ids", "attention_mask"],
             "decode": ["input_ids", "position_ids", "attention_mask"] + [f"past.{i}.{t}" for i in range(2) for t in ("key", "value")]}
    outputs = ["logits"] + [f"present.{i}.{t}" for i in range(2) for t in ("key", "value")]
    for kind, file in EXPORT_GRAPHS.items():
        onnx.checker.check_model(str(fp32_export / file))
        graph = onnx.load(str(fp32_export / file)).graph
        assert [i.name for i in graph.input] == names[kind]
        assert [o.name for o in graph.output] == outputs
    parity = json.loads((fp32_export / "parity.json").read_text())
    assert PARITY_FIELDS <= set(parity) and parity["passed"] and parity["greedy_agreement"] == 1.0
    assert parity["max_abs_logits"] <= 1e-3
    manifest = json.loads((fp32_export / "prunus.json").read_text())
    assert manifest["stage"] == "export" and manifest["parent"]["path"] == str((trained_run / "model").resolve())
    for name, digest in manifest["files"].items():
        assert sha256_file(fp32_export / name) == digest


def test_prefill_logits_equal_torch(ort_graphs, torch_model):
    torch.manual_seed(1)
    tokens = torch.randint(0, 257, (3, 17))
    with torch.no_grad():
        ref = torch_model(tokens)
    assert (ort_graphs(tokens) - ref).abs().max().item() < 1e-4


def test_decode_with_past_equals_torch(ort_graphs, torch_model):
    torch.manual_seed(2)
    tokens = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        ref = torch_model(tokens)
    ones = lambda n: torch.ones(2, n, dtype=torch.long)  # noqa: E731
    _, past = ort_graphs.prefill(tokens[:, :9], torch.arange(9).expand(2, 9), ones(9))
    logits, present = ort_graphs.decode(tokens[:, 9:], torch.arange(9, 12).expand(2, 3), ones(12), past)
    assert present[0].shape == (2, 2, 12, 16)
    assert (logits - ref[:, 9:]).abs().max().item() < 1e-4
    step, _ = ort_graphs.decode(tokens[:, 11:], torch.full((2, 1), 11), ones(12), [p[:, :, :11] for p in present])
    assert (step[:, 0] - ref[:, 11]).abs().max().item() < 1e-4


def test_left_padded_batch_gives_each_row_its_own_logits(ort_graphs, torch_model):
    torch.manual_seed(3)
    short, long_ = torch.randint(0, 257, (5,)), torch.randint(0, 257, (11,))
    ids = torch.stack([torch.cat([torch.zeros(6, dtype=torch.long), short]), long_])
    mask = torch.stack([torch.cat([torch.zeros(6), torch.ones(5)]), torch.ones(11)]).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits, past = ort_graphs.prefill(ids, positions, mask)
    nxt = torch.tensor([[7], [9]])
    step, _ = ort_graphs.decode(nxt, positions[:, -1:] + 1, torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), past)
    with torch.no_grad():
        for row, prompt in enumerate((short, long_)):
            ref = torch_model(torch.cat([prompt, nxt[row]])[None])[0]
            n = len(prompt)
            assert (logits[row, -n:] - ref[:n]).abs().max().item() < 1e-4
            assert (step[row, 0] - ref[n]).abs().max().item() < 1e-4
    # and greedy generation through the KV cache follows each row's own continuation
    got = ort_graphs.greedy(ids, 16, attention_mask=mask)
    for row, prompt in enumerate((short, long_)):
        assert torch.equal(got[row], generate(torch_model, prompt[None], 16)[0, len(prompt):])


def test_greedy_64_tokens_identical_to_torch(ort_graphs, torch_model):
    prompts = torch.tensor([list(b"def main(args):\n    "), list(b"import os\nimport sys\n\n")[:20]])
    want = generate(torch_model, prompts, 64)[:, prompts.shape[1]:]
    assert torch.equal(ort_graphs.greedy(prompts, 64), want)


def test_int8_export_quantizes_every_matmul_and_fails_parity_cleanly(trained_run, tmp_path, monkeypatch):
    out = tmp_path / "int8"
    monkeypatch.setitem(parity_mod.TOLERANCES, "int8", {**parity_mod.TOLERANCES["int8"], "top1_agreement": 1.01})
    failed = run("export", trained_run / "model", "--out", out, "--precision", "int8")
    assert failed.exit_code == 1, failed.output
    assert "parity check failed: top1_agreement" in failed.stderr and not out.exists()
    assert not list(tmp_path.iterdir())  # no temp dir left either
    monkeypatch.undo()
    ok = run("export", trained_run / "model", "--out", out, "--precision", "int8", "--no-verify")
    assert ok.exit_code == 0, ok.output
    parity = json.loads((out / "parity.json").read_text())
    assert PARITY_FIELDS <= set(parity) and parity["precision"] == "int8"
    assert parity["bpb_increase"] < 0.05 and parity["top1_agreement"] > 0.8
    for file in EXPORT_GRAPHS.values():
        graph = onnx.load(str(out / file)).graph
        inits = {i.name for i in graph.initializer}
        assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]  # no float weight left
        assert sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in graph.node) == 2 * 7 + 1
    assert (out / "decode.onnx").stat().st_size < 0.5 * (trained_run / "model" / "model.safetensors").stat().st_size


def test_tied_head_is_untied_before_quantizing(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    emb = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["h"]),
         helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "emb_t"], ["logits"])],
        "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], [numpy_helper.from_array(emb, "emb")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert untie_weights(model) == 1
    onnx.save(model, tmp_path / "untied.onnx")
    quantize_dynamic(tmp_path / "untied.onnx", tmp_path / "q.onnx", weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"])
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert not any(n.op_type == "MatMul" for n in q.graph.node)
    ids = np.array([1, 7])
    got = ort_session(tmp_path / "q.onnx").run(None, {"ids": ids})[0]
    assert np.abs(got - emb[ids] @ emb.T).max() < 0.05 * np.abs(emb[ids] @ emb.T).max()


@pytest.fixture(scope="session")
def int8_model_dir(trained_run, tmp_path_factory):
    """The tiny trained model compressed to w8a8-dynamic int8, per channel, head included."""
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="w8a8-dynamic", exclude=())
    out = tmp_path_factory.mktemp("compressed") / "int8"
    save_model(model, out, stage="compress", parent=trained_run / "model", command="test")
    return out


def test_compressed_int8_dir_exports_its_own_weights(int8_model_dir, tmp_path):
    out = tmp_path / "onnx"
    result = export_model(int8_model_dir, out, progress=False)
    assert result.config["export"]["precision"] == "int8" and result.parity["passed"]
    model = load_model(int8_model_dir)
    graph = onnx.load(str(out / "prefill.onnx")).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):  # the stored values and scales, unchanged
            assert np.array_equal(inits[f"{name}.weight_q"], m.weight.t().numpy())
            assert np.array_equal(inits[f"{name}.weight_scale"], m.weight_scale.reshape(-1).numpy())
    assert sum(n.op_type == "DynamicQuantizeMatMul" for n in graph.node) == 15


@pytest.mark.parametrize("scheme,granularity,group_size", [("fp8-w8a8", "per_channel", None),
                                                           ("int8-weight-only", "per_group", 16)])
def test_qdq_graphs_compute_what_the_module_computes(trained_run, scheme, granularity, group_size):
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme=scheme, granularity=granularity, group_size=group_size, exclude=())
    modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    proto = export_prefill(dequantized_copy(model), opset=21)
    assert apply_stored_quantization(proto, modules, style="qdq") == len(modules)
    dq = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    wtype = TensorProto.FLOAT8E4M3FN if scheme.startswith("fp8") else TensorProto.INT8
    inits = {i.name: i for i in proto.graph.initializer}
    assert len(dq) == len(modules) and all(inits[n.input[0]].data_type == wtype for n in dq)
    onnx.checker.check_model(proto)
    session = ort_session_from_proto(proto)
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(4))
    feeds = {"input_ids": tokens.numpy(), "position_ids": torch.arange(24).expand(2, 24).numpy(),
             "attention_mask": np.ones((2, 24), dtype=np.int64)}
    with torch.no_grad():
        ref = model(tokens)
    assert np.abs(session.run(["logits"], feeds)[0] - ref.numpy()).max() < 1e-3


def ort_session_from_proto(proto):
    """No graph rewrites: ONNX Runtime fuses blocked int8 DequantizeLinear + MatMul into a kernel that
    also quantizes activations, and this test checks what the graph itself says."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_bad_inputs_are_one_line_and_leave_nothing(trained_run, int8_model_dir, fp32_export, tmp_path, assert_user_error):
    model = trained_run / "model"
    out = tmp_path / "x"
    assert_user_error(run("export", tmp_path, "--out", out), "prunus.json", "not a prunus model dir")
    assert_user_error(run("export", model, "--out", fp32_export), "already exists", "--overwrite")
    assert_user_error(run("export", model, "--out", out, "--precision", "fp16"), "fp16", "tensorrt")
    assert_user_error(run("export", int8_model_dir, "--out", out, "--precision", "fp32"), "int8")
    assert_user_error(run("export", model, "--out", out, "--opset", "12"), "--opset 12")
    assert_user_error(run("export", model, "--out", out, "--format", "tensorrt"), "tensorrt")
    assert not out.exists() and not list(tmp_path.glob(".x*"))


def test_tensorrt_engine_build(trained_run, tmp_path):
    from prunus.export.tensorrt_build import check_tensorrt
    from prunus.models import PrunusError

    try:
        trt = check_tensorrt()
    except PrunusError as e:
        pytest.skip(str(e))
    out = tmp_path / "trt"  # pragma: no cover (needs tensorrt and a CUDA GPU)
    result = export_model(trained_run / "model", out, format="tensorrt", precision="fp16", progress=False,
                          timing_cache=tmp_path / "timing.cache")
    assert result.config["export"]["graphs"]["prefill"] == "prefill.plan" and (tmp_path / "timing.cache").is_file()
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    for plan in ("prefill.plan", "decode.plan"):
        engine = runtime.deserialize_cuda_engine((out / plan).read_bytes())
        assert engine is not None and engine.num_optimization_profiles == 1
