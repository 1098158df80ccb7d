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
from prunus.export import EXPORT_GRAPHS, export_model, load_export
from prunus.export.backend_parity import export_graphs
from prunus.export import parity as parity_mod
from prunus.export.onnx_export import dequantized_copy, export_prefill
from prunus.export.graphs import graph_names
from prunus.export.quantize_onnx import apply_stored_quantization, quantize_fp32_graph
from prunus.models import generate, load_model, save_model
from prunus.models.model_dir import sha256_file
from prunus.models.quant_registry import quantized_modules
from prunus.runtime.ort_graphs import OrtRunner
from prunus.runtime.ort_session import ort_session

PARITY_FIELDS = {"precision", "max_abs_logits", "top1_agreement", "bpb_torch", "bpb_onnx", "bpb_increase",
                 "greedy_agreement", "decode_agreement", "greedy_tokens", "tolerances", "failed", "passed"}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="session")
def fp32_export(trained_run, tmp_path_factory):
    """The tiny trained model exported once at fp32, weights in external data files (read-only for tests)."""
    out = tmp_path_factory.mktemp("export") / "fp32"
    export_model(trained_run / "model", out, progress=False, external_data=True, graph="torch")
    return out


@pytest.fixture(scope="session")
def torch_model(trained_run):
    return load_model(trained_run / "model")


class GraphPair:
    """The export dir's two graphs called as the contract states them, in ONNX Runtime (the runtime's runner)."""

    def __init__(self, export_dir):
        cfg, _ = load_export(export_dir)
        graphs = cfg["export"]["graphs"]
        self.runner = OrtRunner({k: export_dir / graphs[k] for k in ("prefill", "decode")}, threads=1)
        self.outputs = graph_names(cfg["export"]["n_layers"])["outputs"]

    def _run(self, kind, feeds: dict):
        logits, *present = self.runner.run(kind, feeds, self.outputs)
        return logits.float(), present

    def prefill(self, ids, positions, mask):
        return self._run("prefill", {"input_ids": ids, "position_ids": positions, "attention_mask": mask})

    def decode(self, ids, positions, mask, past):
        feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask}
        for i in range(len(past) // 2):
            feeds[f"past.{i}.key"], feeds[f"past.{i}.value"] = past[2 * i], past[2 * i + 1]
        return self._run("decode", feeds)


@pytest.fixture(scope="session")
def ort_graphs(fp32_export):
    return GraphPair(fp32_export)


@pytest.fixture(scope="session")
def served(fp32_export):
    """The export dir as the runtime table's ONNX Runtime backend serves it, as the parity check drives it."""
    graphs = export_graphs(fp32_export, load_export(fp32_export)[0], threads=1)
    yield graphs
    graphs.close()


def test_export_dir_follows_the_contract(fp32_export, trained_run):
    config, tokenizer = load_export(fp32_export)
    exp = config["export"]
    assert exp["format"] == "onnx" and exp["precision"] == "fp32" and exp["graphs"] == EXPORT_GRAPHS
    model_cfg = json.loads((trained_run / "model" / "config.json").read_text())
    assert {k: config[k] for k in model_cfg} == model_cfg
    assert (exp["n_layers"], exp["n_kv_heads"], exp["head_dim"], exp["vocab_size"]) == (2, 2, 16, 320)
    assert tokenizer.decode(tokenizer.encode("def f():")) == "def f():"
    names = {"prefill": ["input_ids", "position_ids", "attention_mask"],
             "decode": ["input_ids", "position_ids", "attention_mask"]
             + [f"past.{i}.{t}" for i in range(2) for t in ("key", "value")]}
    outputs = ["logits"] + [f"present.{i}.{t}" for i in range(2) for t in ("key", "value")]
    assert exp["external_data"]
    for kind, file in EXPORT_GRAPHS.items():
        assert (fp32_export / f"{file}.data").stat().st_size > (fp32_export / file).stat().st_size
        onnx.checker.check_model(str(fp32_export / file))
        graph = onnx.load(str(fp32_export / file)).graph
        assert [i.name for i in graph.input] == names[kind]
        assert [o.name for o in graph.output] == outputs
    parity = json.loads((fp32_export / "parity.json").read_text())
    assert PARITY_FIELDS <= set(parity) and parity["passed"] and parity["greedy_agreement"] == 1.0
    assert parity["decode_agreement"] == 1.0
    assert parity["max_abs_logits"] <= 1e-3
    manifest = json.loads((fp32_export / "prunus.json").read_text())
    assert manifest["stage"] == "export" and manifest["parent"]["path"] == str((trained_run / "model").resolve())
    for name, digest in manifest["files"].items():
        assert sha256_file(fp32_export / name) == digest


def test_prefill_logits_equal_torch(ort_graphs, served, torch_model):
    torch.manual_seed(1)
    tokens = torch.randint(0, 257, (3, 17))
    with torch.no_grad():
        ref = torch_model(tokens)
    ones = torch.ones(3, 17, dtype=torch.long)
    assert (ort_graphs.prefill(tokens, torch.arange(17).expand(3, 17), ones)[0] - ref).abs().max().item() < 1e-4
    # the served backend's every-position logits (prefill of the first token, the rest verified in one pass)
    assert (served(tokens) - ref).abs().max().item() < 1e-4


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


def test_served_greedy_trims_padding_and_follows_each_row(served, torch_model):
    torch.manual_seed(3)
    short, long_ = torch.randint(0, 257, (5,)), torch.randint(0, 257, (11,))
    ids = torch.stack([torch.cat([torch.zeros(6, dtype=torch.long), short]), long_])
    mask = torch.stack([torch.cat([torch.zeros(6), torch.ones(5)]), torch.ones(11)]).long()
    got = served.greedy(ids, 16, attention_mask=mask)
    for row, prompt in enumerate((short, long_)):
        assert torch.equal(got[row], generate(torch_model, prompt[None], 16)[0, len(prompt):])


def test_greedy_64_tokens_identical_to_torch(served, torch_model):
    prompts = torch.tensor([list(b"def main(args):\n    "), list(b"import os\nimport sys\n\n")[:20]])
    want = generate(torch_model, prompts, 64)[:, prompts.shape[1]:]
    assert torch.equal(served.greedy(prompts, 64), want)


def test_teacher_forced_decode_returns_the_argmax_along_the_given_tokens(served, torch_model):
    """parity's decode_agreement: the decode path fed chosen tokens, not its own argmaxes."""
    prompts = torch.tensor([list(b"def main(args):\n    "), list(b"import os\nimport sys\n\n")[:20]])
    follow = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = torch_model(torch.cat([prompts, follow[:, :-1]], dim=1))
    want = logits[:, prompts.shape[1] - 1:].argmax(-1)
    assert torch.equal(served.greedy(prompts, 12, follow=follow), want)
    free = served.greedy(prompts, 12)
    assert torch.equal(served.greedy(prompts, 12, follow=free), free)


def test_int8_export_quantizes_every_matmul(trained_run, tmp_path):
    out = tmp_path / "int8"
    result = run("export", trained_run / "model", "--out", out, "--precision", "int8", "--no-verify", "--graph", "torch")
    assert result.exit_code == 0, result.output
    parity = json.loads((out / "parity.json").read_text())
    assert PARITY_FIELDS <= set(parity) and parity["precision"] == "int8"
    assert parity["bpb_increase"] < 0.05 and parity["top1_agreement"] > 0.8
    for file in EXPORT_GRAPHS.values():
        graph = onnx.load(str(out / file)).graph
        inits = {i.name for i in graph.initializer}
        assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]  # no float weight left
        assert sum(n.op_type == "MatMulNBits" for n in graph.node) == 2 * 7 + 1  # 7 per block and the head
    assert (out / "decode.onnx").stat().st_size < 0.5 * (trained_run / "model" / "model.safetensors").stat().st_size


def test_failed_parity_exits_1_and_writes_nothing(int8_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "int8"
    monkeypatch.setitem(parity_mod.TOLERANCES, "int8", {**parity_mod.TOLERANCES["int8"], "top1_agreement": 1.01})
    result = run("export", int8_model_dir, "--out", out)
    assert result.exit_code == 1, result.output
    assert "parity check failed:" in result.stderr and "top1_agreement" in result.stderr
    assert not list(tmp_path.iterdir())  # neither the dir nor its temporary sibling


def test_tied_head_is_untied_before_quantizing(tmp_path):
    emb = np.random.default_rng(0).standard_normal((50, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["h"]),
         helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "emb_t"], ["logits"])],
        "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 50])], [numpy_helper.from_array(emb, "emb")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), tmp_path / "tied.onnx")
    quantize_fp32_graph(tmp_path / "tied.onnx", tmp_path / "q.onnx")
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert not any(n.op_type == "MatMul" for n in q.graph.node)  # the head is quantized too
    (node,) = [n for n in q.graph.node if n.op_type == "MatMulNBits"]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in ("K", "N", "bits")} == \
        {"K": 32, "N": 50, "bits": 8}
    ids = np.arange(50)
    got = ort_session(tmp_path / "q.onnx").run(None, {"ids": ids})[0]
    assert np.array_equal(got.argmax(-1), ids)  # each row's own embedding scores highest, as in fp32


@pytest.fixture(scope="session")
def int8_model_dir(trained_run, tmp_path_factory):
    """The tiny trained model compressed to w8a8-dynamic int8, per channel, head included."""
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="w8a8-dynamic", exclude=())
    out = tmp_path_factory.mktemp("compressed") / "int8"
    save_model(model, out, stage="compress", parent=trained_run / "model", command="test")
    return out


@pytest.mark.parametrize("scheme,granularity,group_size,style", [
    ("w8a8-dynamic", "per_channel", None, "integer"),
    ("fp8-w8a8", "per_channel", None, "qdq"),
    ("int8-weight-only", "per_group", 16, "qdq"),
])
def test_quantized_graphs_hold_the_stored_weights(trained_run, scheme, granularity, group_size, style):
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme=scheme, granularity=granularity, group_size=group_size, exclude=())
    modules = quantized_modules(model)
    proto = export_prefill(dequantized_copy(model), opset=21)
    assert apply_stored_quantization(proto, modules, style=style) == len(modules) == 15
    onnx.checker.check_model(proto)
    inits = {i.name: i for i in proto.graph.initializer}
    for name, m in modules.items():  # the stored values and scales, unchanged
        w = inits[f"{name}.weight_q"]
        if scheme.startswith("fp8"):
            assert w.data_type == TensorProto.FLOAT8E4M3FN
            assert w.raw_data == m.weight.t().contiguous().view(torch.uint8).numpy().tobytes()
        else:
            assert np.array_equal(numpy_helper.to_array(w), m.weight.t().numpy())
        stored = m.weight_scale.t() if granularity == "per_group" else m.weight_scale.reshape(-1)
        assert np.array_equal(numpy_helper.to_array(inits[f"{name}.weight_scale"]), stored.numpy())
    op = "DynamicQuantizeMatMul" if style == "integer" else "DequantizeLinear"
    assert sum(n.op_type == op for n in proto.graph.node) == 15
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(4))
    feeds = {"input_ids": tokens.numpy(), "position_ids": torch.arange(24).expand(2, 24).numpy(),
             "attention_mask": np.ones((2, 24), dtype=np.int64)}
    with torch.no_grad():
        ref = model(tokens).numpy()
    got = ort_session_from_proto(proto).run(["logits"], feeds)[0]
    # a weight-only QDQ graph computes what the module computes; where activations are quantized a float
    # rounding difference may move one activation by a step
    if style == "qdq":
        assert np.abs(got - ref).max() < (1e-3 if scheme.endswith("weight-only") else 0.05 * np.abs(ref).max())
    else:  # ORT's kernel quantizes activations per tensor (uint8, asymmetric), the module per token (int8, symmetric)
        assert np.abs(got - ref).max() < 0.25 * np.abs(ref).max()
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


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
    (tmp_path / "plain").mkdir()
    assert_user_error(run("export", tmp_path / "plain", "--out", out), "prunus.json", "not a prunus model dir")
    assert_user_error(run("export", model, "--out", fp32_export), "already exists", "--overwrite")
    assert_user_error(run("export", model, "--out", out, "--format", "tensorrt", "--precision", "int8"), "int8", "compress")
    assert_user_error(run("export", int8_model_dir, "--out", out, "--precision", "fp32"), "int8")
    assert_user_error(run("export", model, "--out", out, "--opset", "12"), "--opset 12")
    assert_user_error(run("export", model, "--out", out, "--format", "tensorrt"), "tensorrt")
    assert_user_error(run("export", model, "--out", out, "--trust-factory"), "--trust-factory: not taken by a transformer")
    assert not out.exists() and not list(tmp_path.glob(".x*"))


def test_tensorrt_engine_build(trained_run, tmp_path):
    from prunus.export.tensorrt_build import check_tensorrt
    from prunus.artifacts.errors import PrunusError

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
