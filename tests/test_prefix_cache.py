"""Automatic prefix caching (prunus.runtime.prefix_cache): the same tokens with and without the cache (greedy and
seeded sampling) for prompts sharing a prefix, for the next turn of a conversation and under a budget of two
blocks; the engine's info counts the reuse; options it cannot serve are refused in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, save_model
from prunus.runtime.batch_cache import BatchKVCache
from prunus.runtime.prefix_cache import BLOCK, PrefixCache
from prunus.serve import Engine

SYSTEM = "You are a helpful assistant. Answer in Python code only, please.\n"  # 66 byte tokens: 4 full blocks
QUESTIONS = ["def add(a, b):", "import os\n", "class A:\n    def f(self", "x"]
SAMPLING = ({}, {"temperature": 0.9, "top_k": 20, "seed": 7})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(replace(get_preset("tiny"), max_seq_len=256))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("prefix") / "model", stage="test")


@pytest.fixture(scope="module")
def plain(model_dir):
    with Engine.load(model_dir, max_batch=2, threads=1) as e:
        yield e


def _cached(model_dir, mb=4.0, **kw):
    return Engine.load(model_dir, max_batch=2, threads=1, prefix_cache_mb=mb, **kw)


def _one_by_one(engine, prompts, **sampling):
    return [engine.generate(p, max_new_tokens=12, ignore_eos=True, **sampling).token_ids for p in prompts]


def test_shared_prefix_same_tokens_and_counted(model_dir, plain):
    prompts = [SYSTEM + q for q in QUESTIONS]
    with _cached(model_dir) as e:
        for sampling in SAMPLING:
            assert _one_by_one(e, prompts, **sampling) == _one_by_one(plain, prompts, **sampling)
        # together: rows prefilled in one pass, some from the cache, some afresh
        together = [r.token_ids for r in e.generate(prompts, max_new_tokens=12, ignore_eos=True)]
        assert together == _one_by_one(plain, prompts)
        stats = dict(e.info["prefix_cache"])
    assert stats["block_tokens"] == BLOCK
    assert stats["hits"] >= 2 * len(prompts) - 1  # every prompt after the first found the system prompt's blocks
    assert stats["reused_tokens"] >= stats["hits"] * 4 * BLOCK
    assert stats["evicted_blocks"] == 0


@pytest.mark.parametrize("chunk", [32, None])
def test_a_burst_with_one_system_prompt_computes_it_once(model_dir, chunk):
    """Requests arriving together wait for the first one's blocks instead of each prefilling the shared prompt."""
    system = SYSTEM * 2  # 132 tokens: the questions are under half of each prompt
    prompts = [system + q for q in QUESTIONS]
    with Engine.load(model_dir, max_batch=4, threads=1, prefix_cache_mb=4, prefill_chunk=chunk) as e:
        got = [r.token_ids for r in e.generate(prompts, max_new_tokens=8, ignore_eos=True, temperature=0.7, seed=1)]
        stats = e.info["prefix_cache"]
        assert stats["lookups"] == len(prompts) and stats["hits"] == len(prompts) - 1
        assert stats["reused_tokens"] == 3 * (len(system) // BLOCK) * BLOCK
        assert not e.scheduler.deferred and e.scheduler.n_active == 0
    with Engine.load(model_dir, max_batch=4, threads=1, prefill_chunk=chunk) as e:  # the plain engine, same chunks
        assert got == [r.token_ids for r in e.generate(prompts, max_new_tokens=8, ignore_eos=True, temperature=0.7,
                                                          seed=1)]


def test_next_turn_reuses_prompt_and_answer(model_dir, plain):
    with _cached(model_dir) as e:
        first = e.encode(SYSTEM + QUESTIONS[0])
        answer = e.generate(first, max_new_tokens=40, ignore_eos=True).token_ids
        before = e.info["prefix_cache"]["reused_tokens"]
        second = first + answer + e.encode("\n# and now subtract\n")
        for sampling in SAMPLING:
            got = e.generate(second, max_new_tokens=12, ignore_eos=True, **sampling).token_ids
            assert got == plain.generate(second, max_new_tokens=12, ignore_eos=True, **sampling).token_ids
        reused = e.info["prefix_cache"]["reused_tokens"] - before
    # the second turn found the first turn's prompt and the answer's decoded tokens (all but the last)
    assert reused >= 2 * ((len(first) + len(answer) - 1) // BLOCK) * BLOCK


def test_tiny_budget_evicts_and_stays_exact(model_dir, plain):
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers, k and v, kv heads, tokens, head dim, float32
    prompts = [q * 12 for q in ("ab", "cd", "ef")] + ["ab" * 12]
    with _cached(model_dir, mb=2 * block_bytes / 2**20) as e:
        assert _one_by_one(e, prompts) == _one_by_one(plain, prompts)
        stats = e.info["prefix_cache"]
    assert stats["capacity_blocks"] == 2 and stats["blocks"] <= 2
    assert stats["evicted_blocks"] > 0
    assert stats["hits"] == 0  # "abab..." was evicted by the two prompts after it


def test_lru_keeps_parents_over_children():
    cache = BatchKVCache([0], n_slots=1, n_kv_heads=1, head_dim=2, max_len=64)
    cache.k[0].normal_()
    cache.v[0].normal_()
    prefix = PrefixCache(cache, budget_mb=3 * (2 * BLOCK * 2 * 4) / 2**20)  # three blocks
    ids = list(range(3 * BLOCK + 1))
    cache.lengths[0] = len(ids)
    prefix.store(0, ids)
    saved = cache.k[0][0, :, :3 * BLOCK].clone()
    cache.lengths[0] = BLOCK
    prefix.store(0, [99] * BLOCK)  # a fourth block: the deepest child goes, not the root
    assert prefix.stats["evicted_blocks"] == 1
    cache.k[0].zero_()
    assert prefix.restore(0, ids) == 2 * BLOCK
    assert torch.equal(cache.k[0][0, :, :2 * BLOCK], saved[:, :2 * BLOCK])
    assert int(cache.lengths[0]) == 2 * BLOCK
    other = [7] + ids[1:]  # the same later tokens after a different first one: nothing matches
    assert prefix.restore(0, other) == 0


@pytest.mark.parametrize("kw, needle", [({"prefix_cache_mb": -1}, "prefix_cache_mb=-1"),
                                        ({"prefix_cache_mb": 4, "tp": 2}, "tp=2"),
                                        ({"prefix_cache_mb": 4, "device_map": "auto"}, "device_map")])
def test_options_it_cannot_serve_are_refused(model_dir, kw, needle):
    with pytest.raises(PrunusError, match=needle) as e:
        Engine.load(model_dir, **kw)
    assert "\n" not in str(e.value)


def test_restored_row_gives_the_logits_of_a_full_prefill(tiny_model):
    from prunus.runtime.torch import TorchBackend

    backend = TorchBackend(tiny_model, n_slots=2, max_len=128, prefill_chunk=32, prefix_cache_mb=1)
    ids = [(7 * i) % 250 + 1 for i in range(60)]
    backend.prefill([0], [ids])
    backend.store_prefix(0, ids)
    other = ids[:50] + [3, 4, 5]
    reference = backend.prefill([1], [other])
    held = backend.restore_prefix(1, other)
    assert held == 3 * BLOCK and int(backend.cache.lengths[1]) == held
    assert torch.allclose(backend.extend([1], [other[held:]]), reference, atol=1e-5)
