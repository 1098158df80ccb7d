"""A genai export as onnxruntime-genai's own runtime loads it: og.Model(export dir) reads genai_config.json and
genai_model.onnx (the same weights), and its greedy tokens are prunus's on the same export."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from prunus.export import export_model
from prunus.export.genai_compat import COMPAT_CONFIG, COMPAT_GRAPH
from prunus.models import save_model
from prunus.models.config import ModelConfig
from prunus.models.llama import Transformer
from prunus.serve import Engine

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install onnxruntime-genai)")

BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=128,
            tie_embeddings=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40]]
N = 8
PRECISIONS = ("fp32", "int8", "int4")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny random model dir exported once per precision (the genai graph; a random model quantized to int4
    fails the parity limits, which is not what these tests check)."""
    root = tmp_path_factory.mktemp("genai-compat")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**BASE))
    model.init_weights(std=0.2)  # logits far apart: no greedy ties
    save_model(model.eval(), root / "model", stage="train")
    for precision in PRECISIONS:
        export_model(root / "model", root / precision, precision=precision, progress=False, verify=False,
                     external_data=precision == "int8")  # int8: weights in model.onnx.data, shared by both graphs
    return root


def _og_greedy(path, prompt: list[int], n: int) -> list[int]:
    model = og.Model(str(path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    return list(gen.get_sequence(0))[len(prompt):]


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("precision", PRECISIONS)
def test_onnxruntime_genai_runs_the_export_with_prunus_greedy_tokens(exports, precision):
    out = exports / precision
    config = json.loads((out / COMPAT_CONFIG).read_text())
    assert config["model"]["decoder"]["filename"] == COMPAT_GRAPH
    assert config["search"]["past_present_share_buffer"] is True
    with Engine.load(out, max_batch=1, max_len=64, threads=1) as engine:
        want = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=N, ignore_eos=True)]
    eos = config["model"]["eos_token_id"]
    got = [_og_greedy(out, p, N) for p in PROMPTS]
    assert got == [_until_eos(w, eos) for w in want]
    assert sum(len(g) for g in got) >= N  # not all stopped at once


def test_compat_graph_has_the_builder_io_and_shares_the_weights(exports):
    out = exports / "int8"
    proto = onnx.load(str(out / COMPAT_GRAPH), load_external_data=False)
    inputs = [v.name for v in proto.graph.input]
    assert inputs[:2] == ["input_ids", "attention_mask"] and "past_key_values.0.key" in inputs
    assert "seqlens_k" not in inputs and "present.1.value" in [v.name for v in proto.graph.output]
    logits = next(v for v in proto.graph.output if v.name == "logits")
    assert len(logits.type.tensor_type.shape.dim) == 3
    assert (out / COMPAT_GRAPH).stat().st_size < 64 << 10 < (out / "model.onnx.data").stat().st_size
    assert not list(out.glob(f"{COMPAT_GRAPH}.data*"))
    manifest = json.loads((out / "prunus.json").read_text())
    assert {COMPAT_GRAPH, COMPAT_CONFIG} <= set(manifest["files"])
