"""EAGLE draft heads (prunus.compress.eagle_draft, prunus.runtime.eagle_drafter): trained from the CLI on the built-in
corpus, resumed to the same weights, lineage in the manifest; greedy tokens identical to plain decoding on the
torch backend and on the native kernels; sampled tokens distributed as the target's (the first two tokens under
top-k 3 against their exact distribution from the runtime's own plain logits); verify's logits and hidden states
equal plain passes'; drafts that do not fit refused in one line before the target loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.models import read_manifest
from prunus.models.model_dir import dir_hash
from prunus.runtime.sampling import RowSampling, sampling_probs
from prunus.serve import Engine

PROMPTS = ["def f(x):\n    return x\n", "import os\nimport sys\n", "class A:\n    def __init__(self):\n"]
N_NEW = 16


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def dirs(trained_run, tmp_path_factory):
    from prunus.export import export_model

    root = tmp_path_factory.mktemp("eagle")
    target = trained_run / "model"
    r = _cli("compress", target, "--distill", "eagle:vocab=200", "--distill-steps", "12", "--distill-batch-size", "4",
             "--max-corpus-bytes", "300000", "--out", root / "draft")
    assert r.exit_code == 0, r.output
    export_model(target, root / "export", progress=False)
    return {"target": target, "draft": root / "draft", "export": root / "export", "root": root, "native": target}


def _extra(where: str) -> dict:
    """How each place loads: the model dir on torch, the model dir natively (its weights packed at load), the
    genai export natively."""
    return {"target": {"backend": "torch"}, "native": {"native": True}, "export": {"native": True}}[where]


def test_the_cli_writes_a_draft_with_its_lineage(dirs):
    config = json.loads((dirs["draft"] / "config.json").read_text())
    manifest = read_manifest(dirs["draft"])
    target_hash = dir_hash(read_manifest(dirs["target"])["files"])
    assert config["kind"] == "eagle_draft" and config["eagle"]["vocab"] == 200
    assert config["eagle"]["target_hash"] == manifest["parent"]["hash"] == target_hash
    assert manifest["stage"] == "eagle" and config["eagle"]["hidden"] == "final_norm_output"
    assert 0 <= manifest["metrics"]["heldout_first_token_agreement"] <= 1
    assert config["model"]["n_layers"] == 1
    from safetensors.torch import load_file

    ids = load_file(dirs["draft"] / "model.safetensors")["token_ids"]
    assert len(set(ids.tolist())) == 200  # distinct full-vocabulary ids, most frequent first


def test_a_stopped_run_resumes_to_the_same_draft(dirs, tmp_path):
    from prunus.compress.eagle_draft import train_eagle

    common = dict(vocab=50, steps=4, batch_size=2, seq_len=32, max_corpus_bytes=200_000, save_every=2)
    train_eagle(dirs["target"], tmp_path / "whole", log=None, **common)

    def stop(line):
        if line.startswith("step 3/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle(dirs["target"], tmp_path / "resumed", log=stop, **common)
    assert (tmp_path / "resumed.eagle-state" / "state.json").is_file() and not (tmp_path / "resumed").exists()
    lines = []
    train_eagle(dirs["target"], tmp_path / "resumed", log=lines.append, **common)
    assert lines[0].startswith("resuming from step 2")
    assert not (tmp_path / "resumed.eagle-state").exists()
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("whole", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(PrunusError, match="other settings"):
        (tmp_path / "again.eagle-state").mkdir()
        shutil.copy(tmp_path / "whole" / "config.json", tmp_path / "again.eagle-state" / "state.json")
        train_eagle(dirs["target"], tmp_path / "again", log=None, **common)


def test_two_processes_train_the_draft_one_process_trains(dirs, tmp_path):
    """nproc=2 (two local ranks, each half of every batch, gradients averaged) against one process: the same draft
    to rounding, the lineage and figures written once by rank 0."""
    from safetensors.torch import load_file

    from prunus.compress.eagle_draft import train_eagle

    common = dict(vocab=50, steps=3, batch_size=4, seq_len=32, max_corpus_bytes=200_000, log=None)
    one = train_eagle(dirs["target"], tmp_path / "one", **common)
    two = train_eagle(dirs["target"], tmp_path / "two", nproc=2, **common)
    assert two["processes"] == 2 and one["processes"] == 1 and two["train_tokens"] == one["train_tokens"]
    assert two["train_kl"] == pytest.approx(one["train_kl"], rel=1e-4)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-5  # 2.3e-7 measured
    assert read_manifest(tmp_path / "two")["parent"]["hash"] == dir_hash(read_manifest(dirs["target"])["files"])
    assert not (tmp_path / "two.eagle-state").exists()


def test_passes_train_on_each_batch_p_times_with_one_teacher_pass(dirs, tmp_path, monkeypatch):
    """passes=2 over 4 steps: batches 0, 1, 0, 1, the target run twice, the weights those of a run that recomputes
    the teacher each step (its states are the same)."""
    import importlib

    from prunus.compress import eagle_draft

    evaluate = importlib.import_module("prunus.data.evaluate")
    assert eagle_draft.parse_eagle("eagle:vocab=64,passes=3") == {"vocab": 64, "passes": 3, "nproc": None}
    assert eagle_draft.parse_eagle("eagle:nproc=2") == {"vocab": None, "passes": None, "nproc": 2}
    with pytest.raises(PrunusError, match="not divisible by the 3 processes"):  # before any process starts
        eagle_draft.train_eagle(dirs["target"], tmp_path / "three", nproc=3, batch_size=4, log=None)
    for bad in ("eagle:passes=0", "eagle:vocab=4,vocab=5", "eagle:passes=x"):
        with pytest.raises(PrunusError, match="positive whole numbers"):
            eagle_draft.parse_eagle(bad)
    with pytest.raises(PrunusError, match="GiB of teacher states"):
        eagle_draft.check_kept({"steps": 10**6, "passes": 2, "batch_size": 64, "seq_len": 2048}, 576)
    common = dict(vocab=50, steps=4, batch_size=2, seq_len=32, max_corpus_bytes=200_000)
    calls, real = [], evaluate.final_hidden
    monkeypatch.setattr(evaluate, "final_hidden", lambda model, x: calls.append(x) or real(model, x))
    kept = eagle_draft.train_eagle(dirs["target"], tmp_path / "kept", passes=2, log=None, **common)
    teacher_passes = len(calls) - 1  # the held-out agreement runs the target once more
    assert teacher_passes == 2 and not torch.equal(calls[0], calls[1])
    assert kept["passes"] == 2 and kept["train_tokens"] == 2 * 2 * 32
    monkeypatch.setattr(eagle_draft, "batches", lambda settings: 2)  # the same batches, the teacher rerun each step
    eagle_draft.train_eagle(dirs["target"], tmp_path / "rerun", log=None, **common)
    assert len(calls) - 1 - teacher_passes - 1 == 4
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("kept", "rerun"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _greedy(engine):
    return [engine.generate(p, max_new_tokens=N_NEW, ignore_eos=True).token_ids for p in PROMPTS]


@pytest.mark.parametrize("where, lookup", [("target", False), ("native", False), ("export", False), ("target", True),
                                           ("export", True)])
def test_greedy_tokens_are_plain_decodings(dirs, where, lookup):
    """Alone, and with prompt lookup as a second source (``DIR+ngram``: each step drafts from either)."""
    extra = _extra(where)
    with Engine.load(dirs[where], max_batch=2, threads=1, **extra) as plain:
        want = _greedy(plain)
    draft = f"{dirs['draft']}+ngram" if lookup else dirs["draft"]
    with Engine.load(dirs[where], max_batch=2, threads=1, draft=draft, draft_tokens=3, **extra) as e:
        assert e.info["runtime"] == ("torch" if where == "target" else "native")
        assert _greedy(e) == want
        stats = e.info["speculative"]
        assert stats["draft"] == ("eagle+ngram" if lookup else "eagle") and stats["steps"] > 0
        assert stats["drafted"] == sum(c["drafted"] for c in stats["sources"].values()) > 0
        together = [r.token_ids for r in e.generate(PROMPTS[:2], max_new_tokens=N_NEW, ignore_eos=True)]
        assert together == want[:2]  # two rows decode plainly (their hidden states still reach the drafter)
        assert _greedy(e) == want


def test_the_native_drafts_whole_pass_matches_its_torch_pass_over_the_same_int8_layers(dirs):
    """Beside the native kernels the draft's pass is native end to end (NativeDraft: fc, then the block, norm and head
    as a one-layer model over input vectors); its features and logits match the torch block over the same int8 linear
    layers, pass after pass of one row's cache (a prompt's states, then drafted tokens one at a time)."""
    from prunus.models.eagle_draft import load_eagle_draft
    from prunus.runtime.eagle_drafter import TorchDraft
    from prunus.runtime.eagle_native import NativeDraft, native_linears

    with Engine.load(dirs["export"], max_batch=2, threads=1, native=True, draft=dirs["draft"], draft_tokens=2) as e:
        runner, backend = e.speculator.drafter.drafters[0].runner, e.backend
        assert isinstance(runner, NativeDraft)
        twin = TorchDraft(native_linears(load_eagle_draft(dirs["draft"])[0], backend.decoder), 2, backend.max_len)
        torch.manual_seed(0)
        dim = backend.packed.emb.shape[1]
        hidden, embeds = torch.randn(6, dim), backend.embed_tokens(torch.tensor([5, 9, 11, 3, 7, 2]))
        steps = [(0, hidden[:4], embeds[:4]), (4, hidden[4:5], embeds[4:5]), (5, hidden[5:], embeds[5:])]
        for start, h, x in steps:
            (f_n, l_n), (f_t, l_t) = runner(1, start, h, x), twin(1, start, h, x)
            assert torch.allclose(f_n, f_t, atol=2e-4, rtol=1e-3) and torch.allclose(l_n, l_t, atol=2e-3, rtol=1e-3)


def test_a_draft_the_kernels_do_not_mirror_runs_its_linear_layers_natively_and_the_rest_in_torch(dirs, monkeypatch):
    """Where the native kernels cannot run the draft's block whole (q/k norms, post-norms, other gates), the backend
    keeps the torch block over native int8 linear layers: greedy tokens are still plain decoding's."""
    from prunus.runtime import eagle_native
    from prunus.runtime.eagle_drafter import TorchDraft

    def refuse(*args, **kwargs):
        raise PrunusError("the EAGLE draft: the native decoder cannot run this model dir: it has q/k norms")

    with Engine.load(dirs["export"], max_batch=2, threads=1, native=True) as plain:
        want = _greedy(plain)
    monkeypatch.setattr(eagle_native, "NativeDraft", refuse)
    with Engine.load(dirs["export"], max_batch=2, threads=1, native=True, draft=dirs["draft"], draft_tokens=3) as e:
        runner = e.speculator.drafter.drafters[0].runner
        assert isinstance(runner, TorchDraft) and isinstance(runner.draft.fc, eagle_native.NativeLinear)
        e.speculator.adaptive = False
        assert _greedy(e) == want and e.info["speculative"]["drafted"] > 0


@pytest.mark.parametrize("where", ["target", "export"])
def test_a_row_with_logits_processing_decodes_plainly_beside_speculative_rows(dirs, where):
    from prunus.serve.logits_processors import LogitsSettings

    extra = _extra(where)
    penalised = dict(max_new_tokens=N_NEW, ignore_eos=True, logits=LogitsSettings(repetition_penalty=1.3, logprobs=0))
    with Engine.load(dirs[where], max_batch=3, threads=1, **extra) as plain:
        want = [plain.generate(PROMPTS[0], **penalised).token_ids] + _greedy(plain)[1:]
    with Engine.load(dirs[where], max_batch=3, threads=1, draft=dirs["draft"], draft_tokens=3, **extra) as e:
        e.speculator.adaptive = False
        first = e.submit(PROMPTS[0], **penalised)
        rest = [e.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in PROMPTS[1:]]
        got = [e.wait(r).token_ids for r in [first, *rest]]
        assert got == want and e.info["speculative"]["drafted"] > 0


def test_a_capped_catch_up_still_gives_plain_tokens(dirs, monkeypatch):
    """Past MAX_CATCH_UP unread states (a long prompt) the draft reads the last ones only: drafts change, tokens not."""
    from prunus.runtime import eagle_drafter

    monkeypatch.setattr(eagle_drafter, "MAX_CATCH_UP", 3)
    with Engine.load(dirs["target"], max_batch=1, threads=1, backend="torch") as plain:
        want = _greedy(plain)
    with Engine.load(dirs["target"], max_batch=1, threads=1, draft=dirs["draft"], draft_tokens=3, backend="torch") as e:
        e.speculator.adaptive = False
        assert _greedy(e) == want and e.info["speculative"]["drafted"] > 0


def test_a_row_decoding_plainly_keeps_only_the_states_its_next_draft_reads(dirs):
    """States reported while a row does not draft (switched off, or a long prompt) are kept up to MAX_CATCH_UP: the
    memory and the copying stay bounded however long the row decodes plainly, and the next draft reads those."""
    from prunus.runtime.eagle_drafter import MAX_CATCH_UP

    with Engine.load(dirs["target"], max_batch=1, threads=1, draft=dirs["draft"], draft_tokens=2, backend="torch") as e:
        d, dim = e.speculator.drafter.drafters[0], e.backend.model.config.dim
        d.take_hidden(0, 0, torch.randn(40, dim))  # a prompt of 40
        for i in range(300):  # plain steps
            d.take_hidden(0, 40 + i, torch.randn(1, dim))
            assert len(d.pending[0]) <= MAX_CATCH_UP
        assert d._expected(0) == 340 and d.length[0] == 0
        drafts, _ = d.propose(0, [3 + i % 40 for i in range(341)], 2, None)
        assert len(drafts) == 2 and d.fed[0] == MAX_CATCH_UP and d.length[0] == MAX_CATCH_UP + 1


def _exact_three(engine, prompt_ids: list[int], sampling: RowSampling) -> dict:
    """p(a) p(b | a) p(c | a, b) of the first three tokens, from the engine's own plain prefill logits (the first is
    sampled after the prompt's pass, the next two come from one speculative step of one drafted token)."""
    backend = engine.backend

    def probs(ids):
        p = sampling_probs(backend.prefill([0], [ids]), sampling)[0]
        return {t: float(p[t]) for t in torch.nonzero(p).flatten().tolist()}

    exact = {}
    for a, pa in probs(prompt_ids).items():
        for b, pb in probs(prompt_ids + [a]).items():
            for c, pc in probs(prompt_ids + [a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    backend.release(0)
    return exact


@pytest.mark.parametrize("where", ["target", "export"])
def test_sampled_tokens_follow_the_targets_distribution(dirs, where):
    extra = _extra(where)
    n, prompt = 600, PROMPTS[0]
    with Engine.load(dirs[where], max_batch=1, threads=1, draft=dirs["draft"], draft_tokens=2, **extra) as e:
        ids = e.encode(prompt)
        exact = _exact_three(e, ids, RowSampling(1.0, 3, None))
        counts = dict.fromkeys(exact, 0)
        for seed in range(n):
            got = tuple(e.generate(ids, max_new_tokens=3, ignore_eos=True, temperature=1.0, top_k=3, seed=seed).token_ids)
            assert got in counts
            counts[got] += 1
        stats = e.info["speculative"]
    assert 0.05 < stats["acceptance_rate"] < 0.99 and stats["drafted"] == n  # accepted and rejected drafts
    chi2 = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert chi2 < 56.4  # 27 cells, 26 degrees of freedom: p = 0.0005


def test_verify_gives_plain_logits_and_hidden_states_natively(dirs):
    """One row's drafts checked natively give its plain decode steps' logits and hidden states bit for bit, and
    several rows checked in one pass each give what they give alone."""
    from prunus.runtime.native_backend import NativeBackend

    with Engine.load(dirs["export"], max_batch=1, threads=1, native=True) as e:
        backend: NativeBackend = e.backend
        seen = []
        backend.report_hidden(lambda row, start, h: seen.append((start, h.clone())))
        backend.prefill([0], [[5, 6, 7, 8]])
        plain = [backend.decode([0], [t])[0] for t in (9, 10, 11)]
        plain_hidden = torch.cat([h for _, h in seen[1:]])
        backend.truncate(0, 4)
        seen.clear()
        logits = backend.verify(0, [9, 10, 11])
        assert torch.equal(logits, torch.stack(plain))  # one reduction order at every row count: bit for bit
        assert seen[0][0] == 4 and torch.equal(seen[0][1], plain_hidden)
        backend.truncate(0, 5)
        assert torch.equal(backend.decode([0], [10])[0], plain[1])
        with pytest.raises(ValueError):
            backend.truncate(0, 9)
    with Engine.load(dirs["export"], max_batch=3, threads=1, native=True) as e:  # several rows in one pass
        backend = e.backend
        backend.prefill([0, 1, 2], [[5, 6, 7, 8], [9, 10], [3, 1, 4, 1, 5]])
        pieces = [[9, 10, 11], [12], [2, 6]]
        together = backend.verify_rows([2, 0, 1], [pieces[2], pieces[0], pieces[1]])
        for row, piece in ((0, pieces[0]), (1, pieces[1]), (2, pieces[2])):
            backend.truncate(row, int(backend.lengths[row]) - len(piece))
        alone = [backend.verify(row, piece) for row, piece in enumerate(pieces)]
        assert all(torch.equal(a, b) for a, b in zip(alone, [together[1], together[2], together[0]]))


def test_drafts_that_do_not_fit_are_refused_before_the_target_loads(dirs, tmp_path, assert_user_error, monkeypatch):
    from prunus.runtime import native_choice

    other = tmp_path / "other"
    shutil.copytree(dirs["draft"], other)
    config = json.loads((other / "config.json").read_text())
    config["eagle"]["target_hash"] = "0" * 64
    (other / "config.json").write_text(json.dumps(config))
    wide = tmp_path / "wide"
    shutil.copytree(dirs["draft"], wide)
    config = json.loads((wide / "config.json").read_text())
    config["model"]["dim"] *= 2
    (wide / "config.json").write_text(json.dumps(config))

    retok = tmp_path / "retok"
    shutil.copytree(dirs["draft"], retok)
    (retok / "tokenizer.json").write_text("{}")

    def never(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(native_choice, "load_chosen", never)
    for draft, needle in ((other, "trained for another model"), (wide, "dim"), (retok, "tokenizer"),
                          (f"{other}+ngram", "trained for another model")):
        with pytest.raises(PrunusError, match=needle) as e:
            Engine.load(dirs["target"], draft=draft)
        assert "\n" not in str(e.value)
    monkeypatch.undo()
    args = ["generate", dirs["target"], "--prompt", "x", "--max-new-tokens", "2"]
    assert_user_error(_cli(*args, "--speculative", other), "trained for another model")
    assert_user_error(_cli(*args, "--speculative", dirs["draft"], "--draft-tokens", "17"), "--draft-tokens")
    assert_user_error(_cli(*args, "--speculative", dirs["draft"], "--tp", "2"), "--speculative")
    on_ort = ["generate", dirs["export"], "--prompt", "x", "--max-new-tokens", "2", "--no-native"]
    assert_user_error(_cli(*on_ort, "--speculative", dirs["draft"]), "speculative decoding is not served",
                      "--speculative")


def test_auto_finds_the_draft_beside_the_target_and_metrics_count_it(dirs, tmp_path):
    from prunus.serve.metrics import Metrics

    shutil.copytree(dirs["target"], tmp_path / "model")  # the same files: the same content hash
    with Engine.load(tmp_path / "model", max_batch=1, threads=1, draft="auto") as e:
        assert e.info["draft"] == "ngram"  # nothing trained for it beside it: prompt lookup
    shutil.copytree(dirs["draft"], tmp_path / "model-eagle")
    with Engine.load(tmp_path / "model", max_batch=1, threads=1, draft="auto", draft_tokens=3) as e:
        assert e.info["draft"] == f"{tmp_path / 'model-eagle'}+ngram"  # the draft, prompt lookup beside it
        e.generate(PROMPTS[0], max_new_tokens=N_NEW, ignore_eos=True)
        text = Metrics(e.scheduler).render().decode()
        stats = e.info["speculative"]
    assert f"prunus_speculative_drafted_tokens_total {float(stats['drafted'])}" in text
    assert f"prunus_speculative_accepted_tokens_total {float(stats['accepted'])}" in text
    for source, counts in stats["sources"].items():  # the draft and prompt lookup, counted apart
        assert f'prunus_speculative_source_drafted_tokens_total{{source="{source}"}} {float(counts["drafted"])}' in text
    assert "eagle" in stats["sources"]
    assert stats["drafted"] > 0 and stats["adaptive"] is True


def test_compress_options_that_do_not_apply_to_a_draft_are_refused(dirs, tmp_path, assert_user_error):
    base = ["compress", dirs["target"], "--distill", "eagle", "--out", tmp_path / "d"]
    assert_user_error(_cli(*base, "--eval-tokens", "100"), "--eval-tokens", "--distill eagle")
    assert_user_error(_cli(*base, "--quantize", "int8"), "drop --recipe, --quantize and --prune")
    assert_user_error(_cli("compress", dirs["target"], "--distill", "eagle:size=3", "--out", tmp_path / "d"),
                      "eagle[:vocab=N][,passes=P]")
    assert not (tmp_path / "d").exists()


def test_a_model_dir_speculates_on_the_native_kernels_with_no_export(dirs, tmp_path, monkeypatch):
    """`prunus serve MODEL_DIR --speculative auto|EAGLE_DIR` on a CPU: the native kernels serve the dir's own weights
    (no export prepared) and verify the drafts (auto finds the draft beside the model dir), with plain decoding's
    greedy tokens; with a draft model dir as well."""
    from prunus.export import prepared_path
    from prunus.export.prepared import skipped
    from prunus.runtime.load_options import LoadOptions, ServingFeatures

    monkeypatch.setenv("PRUNUS_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(dirs["target"], tmp_path / "model")
    shutil.copytree(dirs["draft"], tmp_path / "model-eagle")
    with Engine.load(tmp_path / "model", max_batch=2, threads=1, prepare=prepared_path) as plain:
        want = _greedy(plain)
    with Engine.load(tmp_path / "model", max_batch=2, threads=1, prepare=prepared_path, draft="auto",
                     draft_tokens=3) as e:
        assert e.info["runtime"] == "native" and "directly" in e.info["prepared"]["skipped"]
        assert not (tmp_path / "cache" / "prepared").exists()
        assert e.info["draft"] == f"{tmp_path / 'model-eagle'}+ngram"  # the draft, prompt lookup beside it
        assert _greedy(e) == want
        assert e.info["speculative"]["drafted"] > 0
    model_draft = LoadOptions(features=ServingFeatures(draft=str(dirs["target"])))
    assert skipped(None, model_draft, False) is None  # the native target verifies a draft model dir's drafts too
    assert skipped(None, LoadOptions(native=False, features=ServingFeatures(draft="ngram")), False) is not None
