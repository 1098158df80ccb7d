"""The genai graph (GroupQueryAttention over a shared KV buffer) against the PyTorch model: greedy tokens,
ragged prompts, continuous batching, the buffer never read past a row's length, quantized graphs, refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from family_variants import family_model
from prunus.artifacts.errors import PrunusError
from prunus.compress.quantize import quantize_pass
from prunus.export import export_model, load_export
from prunus.export.export_dir import _choose_graph
from prunus.export.genai_graph import GENAI_GRAPH, build_genai_graph, save_genai_graph
from prunus.export.backend_parity import export_graphs
from prunus.export.native_weights import write_native_weights
from prunus.runtime.genai_session import GenaiSession
from prunus.runtime.native import NativeSession
from prunus.models import generate, load_model, save_model
from prunus.models.config import ModelConfig
from prunus.models.llama import Transformer
from prunus.native.build import unavailable
from prunus.serve import Engine
from prunus.runtime.ort_genai import GenaiBackend

BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=128)
VARIANTS = {
    "tied": dict(tie_embeddings=True),
    "untied-bias-scale": dict(attn_qkv_bias=True, attn_out_bias=True, query_pre_attn_scalar=24.0, rope_theta=5e5),
    "llama3-rope": dict(rope_type="llama3", rope_factor=4.0, rope_original_max_len=16, tie_embeddings=True),
    "yarn-rope": dict(rope_type="yarn", rope_factor=2.0, rope_original_max_len=32, n_kv_heads=4),
}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40], [3, 1, 4, 1, 5, 9]]


def _model(**changes) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, **changes}))
    model.init_weights(std=0.2)  # large weights: logits far apart, so greedy ties do not decide anything
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model.eval()


def _session(model, tmp_path, n_slots: int, max_len: int = 48, native: bool = False) -> GenaiSession:
    path = tmp_path / GENAI_GRAPH
    save_genai_graph(build_genai_graph(model), path, external_data=False)
    if native:  # the native decoder's weights, as export writes them beside the graph
        write_native_weights(model, tmp_path)
    cfg = model.config
    return (NativeSession if native else GenaiSession)(
        path, n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        n_slots=n_slots, max_len=max_len, threads=1)


def _want(model, prompt: list[int], n: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), n)[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_greedy_equals_torch_for_prompts_of_different_lengths(tmp_path, variant):
    model = _model(**VARIANTS[variant])
    backend = GenaiBackend(_session(model, tmp_path, n_slots=len(PROMPTS)), len(PROMPTS), 48)
    rows = [2, 0, 3, 1]  # arbitrary scheduler rows
    logits = backend.prefill(rows, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p]))[0, -1] for p in PROMPTS])
    assert (logits - ref).abs().max() < 1e-4
    got = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(11):
        logits = backend.decode(rows, [g[-1] for g in got])
        for g, t in zip(got, logits.argmax(-1).tolist()):
            g.append(t)
    assert got == [_want(model, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_families_greedy_equals_torch(tmp_path, family):
    """The families' variants (llama3 / yarn / dynamic rope, biases, a sliding window of 6 over 30+ tokens)."""
    model = family_model(family)
    backend = GenaiBackend(_session(model, tmp_path, n_slots=len(PROMPTS), max_len=64), len(PROMPTS), 64)
    rows = list(range(len(PROMPTS)))
    got = [[t] for t in backend.prefill(rows, PROMPTS).argmax(-1).tolist()]
    for _ in range(29):
        for g, t in zip(got, backend.decode(rows, [g[-1] for g in got]).argmax(-1).tolist()):
            g.append(t)
    assert got == [_want(model, p, 30) for p in PROMPTS]


NATIVE_WHY = unavailable()


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    NATIVE_WHY is not None, reason=f"native kernels unavailable: {NATIVE_WHY}"))])
def test_the_buffer_is_never_read_beyond_a_rows_length(tmp_path, native):
    """Decode steps in ONNX Runtime's GroupQueryAttention, and in the native kernels (prunus.native) over the same
    buffers, give the same logits whatever lies past each row's length."""
    model = _model(tie_embeddings=True)

    def run(poison: float | None) -> list[np.ndarray]:
        sess = _session(model, tmp_path, n_slots=3, max_len=32, native=native)
        lengths = np.array([len(p) for p in PROMPTS[:3]])
        out = [sess.prefill(0, PROMPTS[:3]).copy()]
        for step in range(4):
            if poison is not None:  # every position past each row's keys, padding of the prompt pass included
                for buf in (*sess.k, *sess.v):
                    for r, n in enumerate(lengths):
                        buf[r, :, n:] = poison
            out.append(sess.decode(lengths, out[-1].argmax(-1)).copy())
            lengths += 1
        return out

    clean = run(None)
    for poison in (float("nan"), 1e30):
        for a, b in zip(clean, run(poison)):
            assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def genai_export(tmp_path_factory):
    """A tiny random model's model dir and its fp32 genai export."""
    root = tmp_path_factory.mktemp("genai")
    model = _model(tie_embeddings=True)
    save_model(model, root / "model", stage="train")
    export_model(root / "model", root / "export", progress=False)
    return root, model


def test_export_dir_records_the_genai_graph_and_engine_picks_it(genai_export):
    root, model = genai_export
    config, _ = load_export(root / "export")
    exp = config["export"]
    assert exp["graph"] == "genai" and exp["graphs"] == {"model": GENAI_GRAPH}
    proto = onnx.load(str(root / "export" / GENAI_GRAPH))
    ops = {n.op_type for n in proto.graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "GatherND"} <= ops and "Concat" not in ops
    with Engine.load(root / "export", max_batch=2, max_len=48, threads=1, native=False) as engine:
        assert isinstance(engine.backend, GenaiBackend)  # the graph itself (natively: tests/test_native_backend.py)
        results = engine.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)  # 4 prompts through 2 slots
    assert [r.token_ids for r in results] == [_want(model, p, 10) for p in PROMPTS]


def test_the_served_backend_verifies_rows_and_decodes_teacher_forced(genai_export):
    """The parity check's view through the runtime table's ONNX Runtime backend: every position's logits (a prompt's
    first token, the rest verified in one pass per row), and decode_agreement's teacher forcing through the shared
    buffer (the argmax of each step fed tokens is torch's); verify then truncate leaves the row as it was."""
    root, model = genai_export
    export = root / "export"
    graphs = export_graphs(export, json.loads((export / "config.json").read_text()), threads=1)
    tokens = torch.tensor([[9, 10, 11, 12, 13, 3, 1, 4, 1, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    with torch.no_grad():
        ref = model(tokens)
    assert (graphs(tokens) - ref).abs().max() < 1e-4
    prompts = torch.tensor([PROMPTS[1][:5], PROMPTS[3][:5]])
    follow = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(torch.cat([prompts, follow[:, :-1]], dim=1))[:, 4:].argmax(-1)
    assert torch.equal(graphs.greedy(prompts, 9, follow=follow), want)
    backend = graphs.held
    assert backend.capabilities.verify_rows and backend.capabilities.verify
    prompt = PROMPTS[1][:5]
    backend.prefill([0], [prompt])
    drafted = backend.verify(0, [7, 8, 9])
    backend.truncate(0, 6)  # the first drafted token kept
    with torch.no_grad():
        assert (drafted - model(torch.tensor([prompt + [7, 8, 9]]))[0, 5:]).abs().max() < 1e-4
        assert (backend.decode([0], [3])[0] - model(torch.tensor([prompt + [7, 3]]))[0, -1]).abs().max() < 1e-4
    graphs.close()


def test_a_request_joins_while_another_decodes(genai_export):
    root, model = genai_export
    long, short = PROMPTS[1], PROMPTS[3]
    with Engine.load(root / "export", max_batch=3, max_len=64, threads=1) as engine:
        first = engine.stream(long, max_new_tokens=40, ignore_eos=True)
        seen = [next(first).id for _ in range(5)]  # the long request is decoding
        joined = engine.submit(short, max_new_tokens=12, ignore_eos=True)
        seen += [t.id for t in first]
        second = engine.wait(joined)
    assert seen == _want(model, long, 40)
    assert second.token_ids == _want(model, short, 12)


def test_rows_leaving_and_joining_keep_every_request_exact(genai_export):
    """Requests of different lengths through 2 slots: each leave moves the block's last row, each join reuses a slot."""
    root, model = genai_export
    lengths = [3, 17, 6, 1, 9]
    with Engine.load(root / "export", max_batch=2, max_len=64, threads=1) as engine:
        reqs = [engine.submit(p, max_new_tokens=n, ignore_eos=True)
                for p, n in zip(PROMPTS + [PROMPTS[0]], lengths)]
        results = [engine.wait(r) for r in reqs]
    assert [r.token_ids for r in results] == [_want(model, p, n) for p, n in zip(PROMPTS + [PROMPTS[0]], lengths)]


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_graphs_pass_parity_and_quantize_the_head(trained_run, tmp_path, precision):
    result = export_model(trained_run / "model", tmp_path / precision, precision=precision, progress=False)
    assert result.config["export"]["graph"] == "genai" and result.parity["passed"]
    proto = onnx.load(str(tmp_path / precision / GENAI_GRAPH))
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    vocab = result.config["model"]["vocab_size"]
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert {a["bits"] for a in attrs} == {4 if precision == "int4" else 8} and any(a["N"] == vocab for a in attrs)
    assert not [n for n in proto.graph.node if n.op_type == "MatMul"]


@pytest.mark.parametrize("scheme,bits", [("int4-weight-only", 4), ("int8-weight-only", 8)])
def test_stored_weights_become_matmulnbits(trained_run, tmp_path, scheme, bits):
    model = load_model(trained_run / "model")
    extra = dict(algorithm="rtn", group_size=32) if bits == 4 else {}
    quantize_pass(model, None, scheme=scheme, exclude=(), **extra)
    save_model(model, tmp_path / "q", stage="compress")
    result = export_model(tmp_path / "q", tmp_path / "out", progress=False)
    assert result.config["export"]["graph"] == "genai" and result.parity["passed"]
    proto = onnx.load(str(tmp_path / "out" / GENAI_GRAPH))
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 15 and {helper.get_attribute_value(a) for n in nbits for a in n.attribute
                                 if a.name == "bits"} == {bits}


def test_an_unsupported_config_is_one_line_and_the_default_falls_back(tmp_path):
    model = _model(qk_norm=True, attn_softcap=5.0)
    save_model(model, tmp_path / "qk", stage="train")
    with pytest.raises(PrunusError) as e:
        export_model(tmp_path / "qk", tmp_path / "genai", graph="genai", progress=False)
    assert "q/k norms, attention soft-capping" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "genai").exists()
    with pytest.raises(PrunusError, match="build_genai_graph|q/k norms"):
        build_genai_graph(model)
    # the default picks the torch graphs for it (their export and serving are tested in test_export / test_serve)
    assert _choose_graph(None, "onnx", model.config, {}, "fp32") == "torch"
    assert _choose_graph(None, "onnx", _model().config, {}, "fp32") == "genai"
    assert _choose_graph(None, "onnx", _model().config, {}, "fp16") == "torch"
    assert _choose_graph(None, "tensorrt", _model().config, {}, "fp32") == "torch"


def test_a_process_that_leaves_engines_open_exits_cleanly(genai_export):
    """Two ONNX Runtime Engines left open at exit are closed by the atexit hook. Without it a process holding two
    SmolLM2 Engines (Hugging Face tokenizer) aborted at exit, "terminate called without an active exception", every
    time; this tiny model's process exits cleanly either way, so here the hook's exit path is what is checked."""
    import subprocess
    import sys

    root, _ = genai_export
    code = ("from prunus.serve import Engine\n"
            f"engines = [Engine.load({str(root / 'export')!r}, max_batch=1, max_len=32, threads=2) for _ in range(2)]\n"
            "print([len(e.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)[0].token_ids) for e in engines])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[3, 3]")
    hooked = subprocess.run([sys.executable, "-c", code + "import prunus.serve.engine as m\n"
                             "assert len(m._OPEN) == 2\nm._close_open_engines()\nassert len(m._OPEN) == 0\n"],
                            capture_output=True, text=True, timeout=300)
    assert hooked.returncode == 0, hooked.stderr[-2000:]
