"""The torch serving backend: chunked prefill equals one-shot prefill, the scheduler interleaves a long
prompt's chunks with other rows' decode steps, oneDNN-packed weights equal plain ones, and
``compile="auto"`` picks what its rule says and falls back cleanly where torch.compile cannot run."""

from __future__ import annotations

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve.backend_torch import TorchBackend


def tiny(**changes) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").__class__(**{**vars(get_preset("tiny")), **changes}))
    model.init_weights()
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny(max_seq_len=128)


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    return save_model(model, tmp_path_factory.mktemp("torch_backend") / "model", stage="test")


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in lengths]


def greedy(backend: TorchBackend, rows: list[int], ps: list[list[int]], steps: int) -> tuple[torch.Tensor, list]:
    first = backend.prefill(rows, ps)
    tokens, out = first.argmax(-1).tolist(), []
    for _ in range(steps):
        out.append(tokens)
        tokens = backend.decode(rows, tokens).argmax(-1).tolist()
    return first, out


@pytest.mark.parametrize("chunk", [1, 5, 16, 23, 40])
def test_chunked_prefill_equals_one_shot(model, chunk):
    """Prompts of 37, 9, 40 and 1 tokens: chunks that divide them and chunks that do not, rows that end
    in different chunks; the logits of each prompt's last token and the greedy tokens after it equal
    a one-shot prefill's, and so does every key the cache holds."""
    rows, ps = [2, 0, 3, 1], prompts([37, 9, 40, 1])
    whole, chunked = TorchBackend(model, 4, 64, prefill_chunk=None), TorchBackend(model, 4, 64, prefill_chunk=chunk)
    first_w, tokens_w = greedy(whole, rows, ps, 6)
    first_c, tokens_c = greedy(chunked, rows, ps, 6)
    torch.testing.assert_close(first_c, first_w, atol=1e-5, rtol=0)
    assert tokens_c == tokens_w
    assert torch.equal(chunked.cache.lengths, whole.cache.lengths)
    for row, p in zip(rows, ps):
        n = len(p) + 6
        torch.testing.assert_close(chunked.cache.k[0][row, :, :n], whole.cache.k[0][row, :, :n], atol=1e-5, rtol=0)


def test_one_shot_prefill_equals_the_model_without_a_cache(model):
    """The backend's prefill (head on the last token only) against the plain forward pass."""
    ps = prompts([12, 30])
    backend = TorchBackend(model, 2, 64, prefill_chunk=8)
    with torch.inference_mode():
        ref = torch.stack([model(torch.tensor([p]))[0, -1] for p in ps])
    torch.testing.assert_close(backend.prefill([0, 1], ps), ref, atol=1e-5, rtol=0)


def test_extend_appends_ragged_pieces_after_what_rows_hold(model):
    """Rows holding different lengths extended together (one pass per length) equal rows prefilled whole."""
    ps = prompts([20, 11, 17])
    parts = TorchBackend(model, 3, 64, prefill_chunk=None)
    parts.prefill([0, 1, 2], [ps[0][:8], ps[1][:3], ps[2][:8]])
    got = parts.extend([0, 1, 2], [ps[0][8:], ps[1][3:], ps[2][8:]])
    whole = TorchBackend(model, 3, 64, prefill_chunk=None)
    torch.testing.assert_close(got, whole.prefill([0, 1, 2], ps), atol=1e-5, rtol=0)
    assert parts.cache.lengths.tolist() == [20, 11, 17]


def test_prefill_chunk_is_checked(model):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(PrunusError, match="prefill_chunk="):
            TorchBackend(model, 1, 16, prefill_chunk=bad)
