"""The one KV-cache contract: every cache the model is given satisfies ``KVCacheProtocol``, and the model run
through each gives the logits it gives on the whole sequences without a cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prunus.export.graphs import DecodeGraph, GraphCache, PrefillGraph
from prunus.models import KVCache, Transformer, get_preset
from prunus.models.kv_cache import KVCacheProtocol
from prunus.runtime.graph_backend import GraphBackend
from prunus.runtime.batch_cache import BatchKVCache, CacheStep
from prunus.runtime.compiled_decode import StaticStep

ROWS = [[5, 6, 7, 8, 9], [9, 4, 2], [3, 4, 5, 6, 7, 8, 1]]  # ragged prompts
NEXT = [11, 12, 13]  # one decode token per row


@pytest.fixture(scope="module", params=["full", "window"])
def model(request):
    """Tiny; the second with a sliding window of 4 so the rows' windows cut their prompts."""
    cfg = get_preset("tiny")
    if request.param == "window":
        cfg = dataclasses.replace(cfg, sliding_window=4)
    torch.manual_seed(0)
    m = Transformer(cfg)
    m.init_weights()
    return m.eval()


def whole(model, row: list[int]) -> torch.Tensor:
    """The last token's logits of ``row`` with no cache."""
    return model(torch.tensor([row]))[0, -1]


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_every_cache_satisfies_the_protocol(model):
    batch = BatchKVCache.for_model(model, n_slots=2, max_len=16)
    caches = [KVCache.for_model(model, 1, max_len=8), batch.step([0, 1], q_len=1),
              GraphCache(torch.ones(1, 3, dtype=torch.long)),
              StaticStep(batch, torch.tensor([0, 1]), torch.zeros(2, 1, dtype=torch.long))]
    assert [type(c).__name__ for c in caches] == ["KVCache", "CacheStep", "GraphCache", "StaticStep"]
    for c in caches:
        assert isinstance(c, KVCacheProtocol), type(c).__name__
    assert not isinstance(batch, KVCacheProtocol)  # the slots' storage: a pass takes its step() view
    assert isinstance(GraphBackend(None, n_layers=2, n_kv_heads=2, head_dim=16, vocab_size=320, n_slots=2,
                                   max_len=8).cache, BatchKVCache)


@torch.no_grad()
def test_model_runs_with_its_own_cache(model):
    row = ROWS[0]
    cache = KVCache.for_model(model, 1, max_len=len(row) + 1)
    close(model(torch.tensor([row]), cache=cache)[0, -1], whole(model, row))
    close(model(torch.tensor([[NEXT[0]]]), cache=cache)[0, -1], whole(model, row + [NEXT[0]]))
    assert cache.seq_len == len(row) + 1


@torch.no_grad()
def test_model_runs_with_the_serving_cache_steps(model):
    """CacheStep for a ragged prefill and a decode step, then StaticStep (the compiled path's, run eagerly)."""
    cache = BatchKVCache.for_model(model, n_slots=3, max_len=16)
    width = max(map(len, ROWS))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in ROWS])
    step = cache.step([0, 1, 2], new_lengths=[len(r) for r in ROWS], q_len=width)
    assert isinstance(step, CacheStep)
    logits = model(tokens, cache=step, positions=step.positions)
    for b, r in enumerate(ROWS):
        close(logits[b, len(r) - 1], whole(model, r))
    step = cache.step([0, 1, 2], q_len=1)
    logits = model(torch.tensor(NEXT)[:, None], cache=step, positions=step.positions)
    for b, r in enumerate(ROWS):
        close(logits[b, -1], whole(model, r + [NEXT[b]]))
    rows, pos = torch.tensor([2, 0]), cache.lengths[[2, 0]].view(-1, 1)
    logits = model(torch.tensor([[1], [2]]), cache=StaticStep(cache, rows, pos), positions=pos)
    close(logits[0, -1], whole(model, ROWS[2] + [NEXT[2], 1]))
    close(logits[1, -1], whole(model, ROWS[0] + [NEXT[0], 2]))


@torch.no_grad()
def test_model_runs_with_the_export_graph_cache(model):
    """GraphCache through the prefill and decode graphs, left-padded rows: present out, past back in."""
    width = max(map(len, ROWS))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in ROWS])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ROWS])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits, *present = PrefillGraph(model)(ids, pos, mask)
    for b, r in enumerate(ROWS):
        close(logits[b, -1], whole(model, r))
    new_pos = torch.tensor([[len(r)] for r in ROWS])
    mask = torch.cat([mask, torch.ones(len(ROWS), 1, dtype=torch.long)], 1)
    logits, *present = DecodeGraph(model)(torch.tensor(NEXT)[:, None], new_pos, mask, *present)
    assert present[0].shape[2] == width + 1
    for b, r in enumerate(ROWS):
        close(logits[b, -1], whole(model, r + [NEXT[b]]))


def test_a_cache_of_ragged_rows_needs_positions(model):
    cache = BatchKVCache.for_model(model, n_slots=2, max_len=16)
    with pytest.raises(ValueError, match="CacheStep holds rows of different lengths: pass positions"):
        model(torch.tensor([[1], [2]]), cache=cache.step([0, 1], q_len=1))
