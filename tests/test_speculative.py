"""Speculative decoding (prunus.runtime.speculative): greedy tokens identical to plain decoding with a draft model
dir and with prompt lookup, sampled tokens distributed as the target's (a chi-square test of the first two tokens
over many draws against the target's exact distribution, on a 3-token vocabulary with stand-in models), the cache rolled back to the
accepted tokens, acceptance counted in the engine's info, and a draft it cannot use refused in one line."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, sample_next, save_model
from prunus.runtime.drafter import Drafter, DraftSources, split_draft
from prunus.runtime.prompt_lookup import PromptLookup, lookup
from prunus.runtime.sampling import RowSampling, sampling_probs
from prunus.runtime.speculative import DraftModel, Speculator
from prunus.runtime.torch import TorchBackend
from prunus.serve import Engine

PROMPTS = ["def f(x):\n    return x\ndef f(x):\n", "abcabcabcab", "import os\n"]
N_NEW = 20


def _tiny(seed: int, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(replace(get_preset("tiny"), max_seq_len=256, **changes))
    model.init_weights()
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    return {"target": save_model(_tiny(0), root / "target", stage="test"),
            "draft": save_model(_tiny(1), root / "draft", stage="test")}


@pytest.fixture(scope="module")
def plain(dirs):
    with Engine.load(dirs["target"], max_batch=2, threads=1) as e:
        yield e


def _run(engine, **sampling):
    return [engine.generate(p, max_new_tokens=N_NEW, ignore_eos=True, **sampling).token_ids for p in PROMPTS]


@pytest.mark.parametrize("draft", ["target", "draft", "ngram"])
def test_greedy_tokens_are_plain_decodings(dirs, plain, draft):
    with Engine.load(dirs["target"], max_batch=2, threads=1, draft=dirs.get(draft, draft), draft_tokens=3) as e:
        assert _run(e) == _run(plain)
        stats = e.info["speculative"]
        assert stats["steps"] > 0 and stats["drafted"] > 0
        if draft == "target":  # the target drafting for itself: every draft accepted, but a drafted token costs
            # as much as a plain step, so no k beats plain decoding: the rows stop drafting
            assert stats["acceptance_rate"] > 0.9 and stats["tokens_per_step"] < 1.5
        if draft == "ngram":  # the repetitive prompts' drafts are taken
            assert stats["accepted"] > 0
        # two requests at once decode plainly together (one alone speculates again): the same tokens
        together = [r.token_ids for r in e.generate(PROMPTS[:2], max_new_tokens=N_NEW, ignore_eos=True)]
        assert together == _run(plain)[:2]


def test_sampled_run_is_seeded_and_stops_where_told(dirs):
    with Engine.load(dirs["target"], max_batch=1, threads=1, draft=dirs["target"], draft_tokens=4) as e:
        one = [e.generate(p, max_new_tokens=N_NEW, ignore_eos=True, temperature=0.8, seed=5).token_ids for p in PROMPTS]
        two = [e.generate(p, max_new_tokens=N_NEW, ignore_eos=True, temperature=0.8, seed=5).token_ids for p in PROMPTS]
        short = e.generate(PROMPTS[0], max_new_tokens=2, ignore_eos=True, temperature=0.8, seed=5)
    assert one == two and all(len(t) == N_NEW for t in one)
    assert short.token_ids == one[0][:2]


class Bigram:
    """A stand-in backend whose next-token logits depend on the row's last token only (a table), so the exact
    distribution of any tokens is known; it keeps each row's tokens to check what the speculator leaves there."""

    prefill_chunk = None
    max_len = 64

    def __init__(self, table: torch.Tensor):
        self.table, self.rows = table, {}

    def prefill(self, rows, prompts):
        self.rows[rows[0]] = list(prompts[0])
        return self.table[[prompts[0][-1]]]

    def extend(self, rows, pieces):
        self.rows[rows[0]] += pieces[0]
        return self.table[[pieces[0][-1]]]

    def decode(self, rows, tokens):
        return self.extend(rows, [tokens])

    def verify(self, row, tokens):
        self.rows[row] += tokens
        return self.table[tokens]

    def truncate(self, row, length):
        assert length <= len(self.rows[row])
        del self.rows[row][length:]

    def release(self, row):
        self.rows.pop(row, None)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


class _EveryOther(PromptLookup):
    """Prompt lookup that offers at every other step only."""

    calls = 0

    def offers(self, row, seq, k):
        self.calls += 1
        return super().offers(row, seq, k) if self.calls % 2 else []


@pytest.mark.parametrize("drafting", ["model", "ngram", "ngram+model"])
def test_sampled_tokens_follow_the_targets_distribution(drafting):
    """The first two tokens of 1,500 draws against their exact distribution, p(a) p(b | a); with prompt lookup and
    the model as two sources, lookup (point masses) offering at every other step, the model drafting the others."""
    vocab, n = 3, 1500
    g = torch.Generator().manual_seed(0)
    p_table, q_table = torch.randn(vocab, vocab, generator=g), torch.randn(vocab, vocab, generator=g)
    target = Bigram(p_table)
    prompt = [1, 2, 0, 1, 2]  # prompt lookup drafts [0, 1]
    target.prefill([0], [prompt[:-1]])
    p = p_table.softmax(-1)
    exact = p[prompt[-1]][:, None] * p
    drafters = {"model": [DraftModel(Bigram(q_table))], "ngram": [PromptLookup()],
                "ngram+model": [_EveryOther(), DraftModel(Bigram(q_table))]}[drafting]
    drafter = DraftSources(drafters)
    spec = Speculator(target, drafter, k=2)
    sampling = RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(1))
    counts = torch.zeros(vocab, vocab)
    for _ in range(n):
        out = spec.step(0, prompt, sampling, remaining=8)
        assert target.rows[0] == (prompt + out)[:-1]  # the target holds the accepted tokens, not the rejected
        if len(out) == 1:
            out += spec.step(0, prompt + out, sampling, remaining=7)
        counts[out[0], out[1]] += 1
        target.truncate(0, len(prompt) - 1)
        drafter.rollback(0, len(prompt) - 1)
    assert 0.05 < spec.stats["acceptance_rate"] < 0.95  # both acceptance and rejection were exercised
    assert _chi2(counts, exact) < 26.1  # 8 degrees of freedom, p = 0.001
    if drafting == "ngram+model":
        assert {"ngram2", "model"} <= set(spec.stats["sources"])  # both sources drafted
        return
    q = q_table.softmax(-1)
    wrong = (q[prompt[-1]][:, None] * q) if drafting == "model" else torch.full((vocab, vocab), 1 / vocab ** 2)
    assert _chi2(counts, wrong) > 200  # the test tells another distribution (the draft's own) from the target's


def test_sampling_probs_are_what_sample_next_draws_from():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)) * 3
    for t, k, p in ((1.0, None, None), (0.7, 10, None), (1.3, None, 0.8), (0.9, 5, 0.5)):
        probs = sampling_probs(logits, RowSampling(t, k, p))
        for seed in range(20):
            a = int(sample_next(logits, t, k, p, torch.Generator().manual_seed(seed))[0])
            b = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[0])
            assert a == b


def test_verify_then_truncate_rolls_the_row_back(tiny_model):
    backend = TorchBackend(tiny_model, n_slots=1, max_len=64)
    backend.prefill([0], [[5, 6, 7, 8]])
    reference = backend.decode([0], [9])
    backend.truncate(0, 4)
    logits = backend.verify(0, [9, 1, 2, 3])  # three drafts, then rejected
    assert torch.allclose(logits[0], reference[0], atol=1e-5)
    backend.truncate(0, 5)
    assert int(backend.cache.lengths[0]) == 5
    with pytest.raises(ValueError):
        backend.truncate(0, 6)


def test_prompt_lookup_copies_what_followed_the_tail():
    assert lookup([1, 2, 3, 9, 4, 1, 2], 2) == [3, 9]
    assert lookup([1, 2, 3, 2, 5, 7, 2], 3) == [5, 7, 2]  # the most recent earlier occurrence
    assert lookup([1, 2, 3], 4) == []
    drafter = PromptLookup()  # offers named by the matched tail's length: their acceptance is learned apart
    assert drafter.offers(0, [1, 2, 3, 9, 4, 1, 2], 4) == [("ngram2", 4)]
    assert drafter.offers(0, [5, 9, 4, 1, 9], 4) == [("ngram1", 3)] and drafter.offers(0, [1, 2, 3], 4) == []
    assert drafter.propose(0, [5, 9, 4, 1, 9], 2, None) == ([4, 1], None)
    import random

    from prunus.runtime.prompt_lookup import match

    rng = random.Random(0)  # a row's index, grown step by step, answers as the scan does; a new request starts afresh
    for vocab in (3, 20, 300):
        seq, drafter = [rng.randrange(vocab) for _ in range(3)], PromptLookup()
        for _ in range(80):
            k = rng.randrange(1, 7)
            assert drafter._match(0, seq, k) == match(seq, k)
            seq = seq + [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        other = [vocab + 1, vocab + 2, vocab + 1]
        assert drafter._match(0, other, 2) == match(other, 2) == (1, [vocab + 2, vocab + 1])
    assert split_draft("ngram") == (None, True) and split_draft("d+ngram") == ("d", True)
    assert split_draft("d") == ("d", False)


def test_drafts_it_cannot_use_are_refused_in_one_line(dirs, tmp_path):
    other = save_model(_tiny(2, vocab_size=512), tmp_path / "other-vocab", stage="test")
    with pytest.raises(PrunusError) as e:
        Engine.load(dirs["target"], draft=other)
    assert str(other) in str(e.value) and str(dirs["target"]) in str(e.value) and "tokenizer" in str(e.value)
    copy = tmp_path / "other-tokenizer"
    shutil.copytree(dirs["draft"], copy)
    (copy / "tokenizer.json").write_text("{}")
    with pytest.raises(PrunusError, match="tokenizer.json differs"):
        Engine.load(dirs["target"], draft=copy)
    for kw, needle in (({"draft": tmp_path / "absent"}, "not a model dir"), ({"draft": "ngram", "tp": 2}, "tp=2"),
                       ({"draft": "ngram", "draft_tokens": 0}, "draft_tokens=0")):
        with pytest.raises(PrunusError, match=needle) as e:
            Engine.load(dirs["target"], **kw)
        assert "\n" not in str(e.value)


def test_cli_generate_speculates_and_refuses_in_one_line(dirs, tmp_path, assert_user_error):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    args = ["generate", str(dirs["target"]), "--prompt", PROMPTS[1], "--temperature", "0", "--max-new-tokens", "12"]
    plain_run = CliRunner().invoke(cli, args)
    fast = CliRunner().invoke(cli, args + ["--speculative", "ngram", "--draft-tokens", "3", "--prefix-cache-mb", "1"])
    assert plain_run.exit_code == 0 and fast.exit_code == 0, fast.output
    assert fast.stdout == plain_run.stdout
    other = save_model(_tiny(2, vocab_size=512), tmp_path / "other-vocab", stage="test")
    assert_user_error(CliRunner().invoke(cli, args + ["--speculative", str(other)]), str(other), "tokenizer")
    assert_user_error(CliRunner().invoke(cli, args + ["--speculative", "ngram", "--draft-tokens", "99"]), "--draft-tokens")


class _ClockTarget:
    """A stand-in target whose verify pass of T tokens takes ``cost(T)`` seconds on a fake clock; its argmax is 1."""

    max_len = 10_000

    def __init__(self, clock: list, cost):
        self.clock, self.cost = clock, cost

    def verify(self, row, piece):
        return self.verify_rows([row], [piece])[0]

    def verify_rows(self, rows, pieces):
        self.clock[0] += self.cost(sum(map(len, pieces)))
        return [torch.nn.functional.one_hot(torch.ones(len(p), dtype=torch.long), 10).float() for p in pieces]

    def truncate(self, row, n):
        pass


class _ScriptedDrafter(Drafter):
    """Drafts k tokens, all right (1) where ``right(step)`` says so at the run's step, else all wrong (2)."""

    name = "test"

    def __init__(self, right):
        self.right, self.step = right, 0

    def propose(self, row, seq, k, sampling):
        return [1 if self.right(self.step) else 2] * k, None

    def rollback(self, row, n):
        pass


def _drafted_per_step(monkeypatch, cost, right, steps: int) -> list[int]:
    from types import SimpleNamespace

    import prunus.runtime.speculative as spec
    from prunus.runtime.sampling import RowSampling

    clock = [0.0]
    monkeypatch.setattr(spec, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    drafter = _ScriptedDrafter(right)
    s = spec.Speculator(_ClockTarget(clock, cost), drafter, k=3, adaptive=True)
    out = []
    for step in range(steps):
        drafter.step, before = step, s.stats["drafted"]
        s.step(0, [0] * 10, RowSampling(), 1000)
        out.append(s.stats["drafted"] - before)
    return out


def test_a_row_drafts_the_k_its_acceptance_and_the_pass_costs_make_fastest(monkeypatch):
    """The adaptive policy drafts the k of the highest expected rate: (1 + expected accepted tokens) over the row's
    plain cost, the verify pass's extra tokens and the drafting, from measured pass costs; none where no k beats plain
    decoding, with a try of one token now and then; and drafting again once the row's drafts are accepted."""
    from prunus.runtime.speculative_policy import EXPLORE_STEPS

    # checking up to 3 tokens costs a plain step, 4 cost two; every draft accepted: 3 tokens a step at k = 2 beat 4
    # tokens at twice the cost (k = 3)
    flat = _drafted_per_step(monkeypatch, lambda t: 0.010 if t <= 3 else 0.020, lambda step: True, 60)
    assert flat[1] == 0 and flat[-20:] == [2] * 20  # the row's 2nd step times the target alone
    # every checked token costs a plain step and no draft is accepted: plain decoding, one token tried now and then,
    # twice as rarely each time it still loses
    costly = _drafted_per_step(monkeypatch, lambda t: 0.010 * t, lambda step: False, 6 + 7 * EXPLORE_STEPS)
    tries = [i for i, d in enumerate(costly) if d and i > 6]
    assert sum(costly[6:]) == len(tries) == 3 and tries[0] < 6 + EXPLORE_STEPS
    assert [b - a for a, b in zip(tries, tries[1:])] == [2 * EXPLORE_STEPS, 4 * EXPLORE_STEPS]
    # drafts rejected for 40 steps, then accepted: the row stops drafting, and drafts the most again once its
    # acceptance, faded while it decoded plainly, is measured again
    later = _drafted_per_step(monkeypatch, lambda t: 0.010 + 0.002 * t, lambda step: step > 40, 4 * EXPLORE_STEPS)
    assert later[20:40].count(0) > 10 and later[-20:] == [3] * 20


def test_a_row_drafts_from_the_source_whose_drafts_pay(monkeypatch):
    """Two sources offering every step (an always wrong one first, an always right one second): a row learns each
    one's acceptance apart and drafts from the right one; where the right one stops offering, it decodes plainly."""
    from types import SimpleNamespace

    import prunus.runtime.speculative as spec
    from prunus.runtime.sampling import RowSampling

    clock = [0.0]
    monkeypatch.setattr(spec, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Source(Drafter):
        def __init__(self, name, right):
            self.name, self.right, self.offering = name, right, True

        def offers(self, row, seq, k):
            return [(self.name, k)] if self.offering else []

        def propose(self, row, seq, k, sampling):
            return [1 if self.right else 2] * k, None

    bad, good = Source("bad", False), Source("good", True)
    s = spec.Speculator(_ClockTarget(clock, lambda t: 0.010 + 0.002 * t), DraftSources([bad, good]), k=3,
                        adaptive=True)
    assert s.stats["draft"] == "bad+good"
    per_step = []
    for step in range(80):
        good.offering = step < 60
        before = {name: dict(c) for name, c in s.stats["sources"].items()}
        s.step(0, [0] * 10, RowSampling(), 1000)
        per_step.append({name: c["drafted"] - before.get(name, {"drafted": 0})["drafted"]
                         for name, c in s.stats["sources"].items()})
    assert all(d.get("good") == 3 and not d.get("bad") for d in per_step[40:60])
    assert sum(d.get("bad", 0) for d in per_step[65:]) <= 1  # at most one exploring token


def test_pass_costs_are_measured_per_count_and_predicted_only_one_count_ahead():
    """A pass's cost: as measured; between measured counts on the line through them; one count above the largest on
    the line through the last two (so it is tried, then measured); nothing further, nor from a single count."""
    from prunus.runtime.speculative_policy import POOLED_DECAY, Acceptance, PassCosts

    costs = PassCosts()
    costs.observe(8, 0.080)
    assert costs.at(8) == 0.080 and costs.at(9) is None  # one count: nothing predicted
    costs.observe(10, 0.100)
    costs.observe_draft("eagle", 2, 0.004)
    assert costs.at(9) == pytest.approx(0.090) and costs.at(11) == pytest.approx(0.110) and costs.at(12) is None
    assert costs.at(7) == pytest.approx(0.070) and costs.draft_s == {"eagle": pytest.approx(0.002)}
    steep = PassCosts()  # first timed at 9 and 16 tokens (a batch's rows with drafts): no cost, not 0 s, at 8
    steep.observe(9, 0.010)
    steep.observe(16, 0.100)
    assert steep.at(8) is None and steep.at(12) == pytest.approx(0.010 + 0.090 * 3 / 7)
    acc = Acceptance(3)
    for step in range(20):
        acc.record(3, 1, step)  # the first drafted token always accepted, the second never
    assert acc.rate(0) > 0.9 and acc.rate(1) < 0.1 and acc.judged[2] == 0 and acc.rate(2) == 0.5
    assert acc.expected(3) == pytest.approx(acc.rate(0) * (1 + acc.rate(1) * (1 + acc.rate(2))))
    row, pooled = Acceptance(3), Acceptance(3, POOLED_DECAY)  # a source right 90% of the time, then unused a while
    for step in range(40):
        row.record(1, int(step % 10 != 0), step)
        pooled.record(1, int(step % 10 != 0), step)
    row.record(0, 0, 200)  # 160 steps later: the row's own counts have faded, the prior has not
    assert row.judged[0] < 0.01 and pooled.rate(0) > 0.8
    assert row.rate(0, pooled) == pytest.approx(pooled.rate(0), abs=1e-3)


def test_at_batch_speculation_is_measured_against_plain_passes_of_as_many_rows(monkeypatch):
    """A pass's rows share its time. Adaptive, every CALIBRATE_EVERY-th pass drafts nothing and times the target
    alone at this many rows: where a verify pass costs per row checked (a compute-bound batch) and drafts are
    rejected, every row stops drafting; where it costs the same whatever it checks and drafts are accepted, rows
    keep the most."""
    from types import SimpleNamespace

    import prunus.runtime.speculative as spec
    from prunus.runtime.sampling import RowSampling

    clock = [0.0]
    monkeypatch.setattr(spec, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Target:
        max_len = 10_000

        def __init__(self, per_row: bool):
            self.per_row = per_row

        def verify_rows(self, rows, pieces):
            clock[0] += 0.01 * sum(map(len, pieces)) if self.per_row else 0.08
            return [torch.nn.functional.one_hot(torch.ones(len(p), dtype=torch.long), 10).float() for p in pieces]

        def truncate(self, row, n):
            pass

    class Scripted(Drafter):
        name = "test"

        def __init__(self, every: bool):
            self.every, self.calls = every, 0  # every draft right, or only the first of every other step

        def propose(self, row, seq, k, sampling):
            self.calls += 1
            right = k if self.every else self.calls % 2
            return ([1] * right + [2] * k)[:k], None

        def rollback(self, row, n):
            pass

    def run(per_row: bool, every: bool, passes: int = 40) -> list[int]:
        """Drafted tokens per pass; four rows for three passes, then eight (rows that started at other times)."""
        s = spec.Speculator(Target(per_row), Scripted(every), k=3, adaptive=True)
        drafted = []
        for i in range(passes):
            n = 4 if i < 3 else 8
            before = s.stats["drafted"]
            s.step_rows(list(range(n)), [[0] * 10] * n, [RowSampling()] * n, [1000] * n)
            drafted.append(s.stats["drafted"] - before)
        return drafted

    # 1.5 tokens a step for two rows' work at best (k=1): a loss at batch, though a row's plain step timed beside
    # drafting rows would have looked as costly as theirs
    losing = run(per_row=True, every=False, passes=60)
    assert losing[1] == 0 and losing[0] == 4  # the first rows' 2nd pass times the target alone; k = 1 first
    assert losing[-10:] == [0] * 10  # then every row decodes plainly
    winning = run(per_row=False, every=True)  # every draft accepted, a pass costs the same whatever it checks
    assert winning[1] == 0 and winning[4] == 0 and winning[-10:] == [8 * 3] * 10  # each row's 2nd: plain
