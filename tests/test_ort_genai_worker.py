"""The benchmark's onnxruntime-genai worker (benchmarks/_ort_genai_worker.py) decodes a batch as og reads one: right
padding with the config's pad id, so each row's greedy tokens in a batch of 8 equal its tokens alone (fp32, a tiny
prunus genai export). Left padding, what the worker did before, gives other tokens on most rows."""

from __future__ import annotations

import importlib
import random

import numpy as np
import pytest
import torch

from prunus.export import export_model
from prunus.models import save_model
from prunus.models.config import ModelConfig
from prunus.models.llama import Transformer

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install onnxruntime-genai)")

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(_rng.randrange(1, 20))] for _ in range(8)]  # below the pad id
N = 12


@pytest.fixture(scope="module")
def worker(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("og-worker")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320,
                                    max_seq_len=128, tie_embeddings=True))
    model.init_weights(std=0.2)  # logits far apart: no greedy ties
    save_model(model.eval(), root / "model", stage="train")
    export_model(root / "model", root / "fp32", precision="fp32", progress=False, verify=False)
    module = importlib.import_module("benchmarks._ort_genai_worker")
    module.load(str(root / "fp32"), threads=1)
    return module


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parent.parent))
        yield mp


def test_og_batched_greedy_tokens_equal_its_batch_1_tokens(worker):
    assert worker.STATE["pad"] not in {t for p in PROMPTS for t in p}
    alone = [worker.generate([p], N)["tokens"][0] for p in PROMPTS]
    batched = worker.generate(PROMPTS, N)["tokens"]
    assert batched == alone
    assert worker.padded([[5, 6], [7]], 9).tolist() == [[5, 6], [7, 9]]  # right padding, the pad id after the prompt


def test_left_padding_is_what_og_does_not_read(worker, monkeypatch):
    """Pins why the worker pads right: the same batch left-padded decodes most rows differently."""
    monkeypatch.setattr(worker, "padded", lambda prompts, pad: np.array(
        [[pad] * (max(map(len, prompts)) - len(p)) + p for p in prompts], np.int32))
    alone = [worker.generate([p], N)["tokens"][0] for p in PROMPTS]
    batched = worker.generate(PROMPTS, N)["tokens"]
    assert sum(a == b for a, b in zip(alone, batched)) < len(PROMPTS) // 2


def test_a_batch_prompt_holding_the_pad_id_is_refused(worker):
    pad = worker.STATE["pad"]
    with pytest.raises(ValueError, match=f"pad token id {pad}"):
        worker.generate([[5, pad, 6], [7]], 2)
