"""The prompt twin of a quantized genai graph: which nodes it rewrites, that its logits are the PyTorch model's
(float activations), that long prompt passes go to it and short ones and decode steps stay in the graph, and
that serving through both keeps greedy tokens and continuous batching intact."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from prunus.artifacts.errors import PrunusError
from prunus.compress.quantize import quantize_pass
from prunus.export import export_model
from prunus.export.genai_graph import GENAI_GRAPH, build_genai_graph
from prunus.export.genai_layers import LAST_TOKEN_NODE
from prunus.runtime.genai_prompt_graph import MIN_TOKENS, prompt_graph
from prunus.runtime.genai_session import GenaiSession
from prunus.models import generate, load_model, save_model
from prunus.serve import Engine
from prunus.runtime.ort_genai import GenaiBackend

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [40, 41], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def _quantized_dir(trained_run, root, **options):
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", **options)
    save_model(model, root / "q", stage="compress")
    export_model(root / "q", root / "export", progress=False)
    return model.eval(), root / "export" / GENAI_GRAPH


@pytest.fixture(scope="module")
def mixed(trained_run, tmp_path_factory):
    """int4 (round to nearest, asymmetric, groups of 32) with the last block at int8, the head in float."""
    return _quantized_dir(trained_run, tmp_path_factory.mktemp("mixed"), algorithm="rtn", group_size=32,
                          symmetric=False, int8=["layers.-1"])


def _session(model, path, prompt_twin: bool = True) -> GenaiSession:
    cfg = model.config
    return GenaiSession(path, n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                        vocab_size=cfg.vocab_size, n_slots=len(PROMPTS), max_len=96, threads=1, prompt_twin=prompt_twin)


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_the_twin_rewrites_the_body_and_leaves_the_head(trained_run, tmp_path, mixed):
    _, path = mixed
    proto = onnx.load(str(path))
    twin, min_tokens = prompt_graph(proto)
    assert min_tokens == MIN_TOKENS[8]  # an int8 block: the int8 threshold
    nbits = [n for n in twin.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(_attrs(n)["bits"] == 4 and _attrs(n)["accuracy_level"] == 0 for n in nbits)
    before = {n.name: _attrs(n) for n in proto.graph.node if n.op_type == "MatMulNBits"}
    assert {a["accuracy_level"] for a in before.values()} == {4}
    int8 = [name for name, a in before.items() if a["bits"] == 8]
    assert len(int8) == 7  # the last block: q, k, v, o, gate, up, down (stored weights: one MatMul each)
    dq = [n for n in twin.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == len(int8) and all(_attrs(n)["block_size"] > 0 and _attrs(n)["axis"] == 1 for n in dq)
    # an int4 head reads the last-token gather: it keeps level 4 (one row per prompt, where level 4 wins)
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", algorithm="rtn", group_size=32, exclude=())
    save_model(model, tmp_path / "q", stage="compress")
    export_model(tmp_path / "q", tmp_path / "export", progress=False)
    twin, min_tokens = prompt_graph(onnx.load(str(tmp_path / "export" / GENAI_GRAPH)))
    gather = next(n for n in twin.graph.node if n.name == LAST_TOKEN_NODE).output[0]
    head = [n for n in twin.graph.node if n.op_type == "MatMulNBits" and n.input[0] == gather]
    assert len(head) == 1 and _attrs(head[0])["accuracy_level"] == 4 and min_tokens == MIN_TOKENS[4]
    assert prompt_graph(build_genai_graph(load_model(trained_run / "model"))) is None  # fp32: no twin


def test_the_twins_logits_are_the_pytorch_models(mixed):
    """Float activations: the twin gives the quantized PyTorch model's logits up to float rounding, closer than the
    graph, whose MatMulNBits quantize the activations to int8."""
    model, path = mixed
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([p]))[0, -1] for p in PROMPTS]).numpy()
    sess = _session(model, path)
    assert sess.prompt_session is not None
    sess.prompt_min_tokens = 1
    twin = sess.prefill(0, PROMPTS).copy()
    graph = _session(model, path, prompt_twin=False).prefill(0, PROMPTS).copy()
    scale = np.abs(want).max()
    assert np.abs(twin - want).max() < 1e-5 * scale
    assert np.abs(graph - want).max() > 10 * np.abs(twin - want).max()


class _Counting:
    """An ONNX Runtime session whose runs are counted."""

    def __init__(self, session):
        self.session, self.runs = session, 0

    def io_binding(self):
        return self.session.io_binding()

    def run_with_iobinding(self, binding):
        self.runs += 1
        return self.session.run_with_iobinding(binding)


def test_long_prompt_passes_go_to_the_twin_and_the_rest_stays_in_the_graph(mixed):
    model, path = mixed
    sess = _session(model, path)
    sess.session, sess.prompt_session = _Counting(sess.session), _Counting(sess.prompt_session)
    sess.prompt_min_tokens = 3 * 14  # rows x padded width
    sess.prefill(0, PROMPTS[1:])  # 2 x 11 tokens
    assert (sess.session.runs, sess.prompt_session.runs) == (1, 0)
    sess.prefill(0, PROMPTS)  # 3 x 14
    assert (sess.session.runs, sess.prompt_session.runs) == (1, 1)
    sess.decode(np.array([14, 2, 11]), np.array([1, 2, 3]))
    assert (sess.session.runs, sess.prompt_session.runs) == (2, 1)
    cfg = model.config  # no pass of a 1-row, 96-position buffer reaches the int8 threshold (256): refused, not unused
    with pytest.raises(PrunusError, match=r"--prompt-graph would never run: .* at least 256 tokens .* 1 rows x 96"):
        GenaiSession(path, n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     vocab_size=cfg.vocab_size, n_slots=1, max_len=96, threads=1, prompt_twin=True)


@pytest.mark.parametrize("min_tokens", [1, 10**6])
def test_serving_through_the_twin_keeps_greedy_tokens_and_joins(mixed, min_tokens):
    """Every prompt pass through the twin (1) or none (10**6): rows prefilled apart and together, then decoded in
    one block, give the quantized PyTorch model's greedy tokens."""
    model, path = mixed
    sess = _session(model, path)
    sess.prompt_min_tokens = min_tokens
    backend = GenaiBackend(sess, len(PROMPTS), 96)
    got = {0: [int(backend.prefill([0], PROMPTS[:1])[0].argmax())]}
    for _ in range(3):  # row 0 decodes alone, then rows 1 and 2 join in one pass
        got[0].append(int(backend.decode([0], [got[0][-1]])[0].argmax()))
    for r, t in zip([2, 1], backend.prefill([2, 1], [PROMPTS[2], PROMPTS[1]]).argmax(-1).tolist()):
        got[r] = [t]
    for _ in range(12):
        if len(got[0]) == 12:
            backend.release(0)  # row 0 leaves: the block's last row moves into its slot
        rows = [0, 1, 2] if len(got[0]) < 12 else [1, 2]
        logits = backend.decode(rows, [got[r][-1] for r in rows])
        for r, t in zip(rows, logits.argmax(-1).tolist()):
            got[r].append(t)
    for r, p in enumerate(PROMPTS):
        want = generate(model, torch.tensor([p]), len(got[r]))[0, len(p):].tolist()
        assert got[r] == want, r


def test_engine_loads_the_twin_on_request_and_refuses_it_elsewhere(mixed, trained_run):
    model, path = mixed
    prompt = list(range(3, 103))  # 100 tokens (the tiny model's context is 128)
    with Engine.load(path.parent, max_batch=2, max_len=128, threads=1, prompt_graph=True) as engine:
        assert engine.info["prompt_graph_min_tokens"] == MIN_TOKENS[8]
        sess = engine.backend.session
        sess.prompt_session, sess.prompt_min_tokens = _Counting(sess.prompt_session), 64
        got = engine.generate([prompt], max_new_tokens=6, ignore_eos=True)[0].token_ids
        assert sess.prompt_session.runs == 1
    assert got == generate(model, torch.tensor([prompt]), 6)[0, len(prompt):].tolist()
    with Engine.load(path.parent, max_batch=1, max_len=64, threads=1, native=False) as engine:  # off by default
        assert engine.backend.session.prompt_session is None
    with pytest.raises(PrunusError, match="prompt_graph asks for the prompt graph, which the torch backend does not serve") as e:
        Engine.load(trained_run / "model", prompt_graph=True)
    assert "\n" not in str(e.value)


def test_prompt_graph_on_a_float_export_is_refused(trained_run, tmp_path, assert_user_error):
    """An fp32 genai export has nothing for the twin to rewrite: --prompt-graph is one line, never silently unused."""
    from click.testing import CliRunner

    from prunus.cli.main import cli

    export_model(trained_run / "model", tmp_path / "fp32", graph="genai", progress=False)
    r = CliRunner().invoke(cli, ["generate", str(tmp_path / "fp32"), "--prompt", "def", "--max-new-tokens", "2",
                                 "--prompt-graph"])
    assert_user_error(r, f"{tmp_path / 'fp32' / GENAI_GRAPH}: --prompt-graph", "int8 / int4 weights", "drop --prompt-graph")
