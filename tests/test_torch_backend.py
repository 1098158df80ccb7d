"""The torch serving backend: chunked prefill equals one-shot prefill, the scheduler interleaves a long
prompt's chunks with other rows' decode steps, oneDNN-packed weights equal plain ones, and
``compile="auto"`` picks what its rule says and falls back cleanly where torch.compile cannot run."""

from __future__ import annotations

import os

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.runtime.torch import TorchBackend


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


def test_scheduler_interleaves_a_long_prompts_chunks_with_decode_steps(model_dir):
    """A 90-token prompt in chunks of 8 joins while a short request decodes: the short one gets a decode
    step between the long one's chunks, and both give the tokens they give alone."""
    short, long_ = prompts([3])[0], prompts([90], seed=2)[0]
    with Engine.load(model_dir, max_batch=2, prefill_chunk=8, compile=False, threads=1, backend="torch") as engine:
        alone = [engine.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in ((short, 30), (long_, 5))]
        backend, calls = engine.backend, []
        for name in ("extend", "decode"):  # prefill runs its chunks through extend
            def spy(rows, data, _run=getattr(backend, name), _name=name):
                calls.append((_name, list(rows)))
                return _run(rows, data)
            setattr(backend, name, spy)
        a = engine.submit(short, max_new_tokens=30, ignore_eos=True)
        b = engine.submit(long_, max_new_tokens=5, ignore_eos=True)
        together = [engine.wait(a).token_ids, engine.wait(b).token_ids]
    assert together == alone
    slot_b = b.slot
    chunks = [i for i, (name, rows) in enumerate(calls) if name == "extend" and slot_b in rows]
    assert len(chunks) == 12  # ceil(90 / 8)
    between = [name for name, rows in calls[chunks[0]:chunks[-1]] if name == "decode" and slot_b not in rows]
    assert len(between) >= 10, calls


# --- compiled decode: the auto rule, the fallback, the tokens --------------------------------------


def test_auto_compiles_by_the_rule_and_explicit_choices_stand(model, monkeypatch):
    from prunus.runtime import compiled_decode as cd

    monkeypatch.setattr(cd, "compile_unavailable", lambda device: None)
    assert cd.choose_compile(True, model) is True and cd.choose_compile(False, model) is False
    assert cd.AUTO_DEVICES == ("cuda",) and cd.choose_compile("auto", model) is False  # a CPU model stays eager
    monkeypatch.setattr(cd, "AUTO_DEVICES", ("cuda", "cpu"))
    assert cd.choose_compile("auto", model) is True


def test_no_compiler_means_eager_with_a_one_line_warning(model, model_dir, monkeypatch):
    from prunus.runtime import compiled_decode as cd

    monkeypatch.setattr(cd, "compile_unavailable", lambda device: "InvalidCxxCompiler: no working C++ compiler found")
    monkeypatch.setattr(cd, "AUTO_DEVICES", ("cpu",))  # auto would compile this model
    for choice in (True, "auto"):
        with pytest.warns(cd.CompileUnavailable, match=r"^torch.compile cannot run here \(InvalidCxxCompiler"):
            assert cd.choose_compile(choice, model) is False
    with pytest.warns(cd.CompileUnavailable) as caught:
        with Engine.load(model_dir, max_batch=1, compile=True, threads=1) as engine:
            assert engine.info["compile"] is False and engine.backend.compiled is None
            assert len(engine.generate("x = ", max_new_tokens=4, ignore_eos=True).token_ids) == 4
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with pytest.raises(PrunusError, match="compile='yes': choose True, False or 'auto'"):
        Engine.load(model_dir, compile="yes")


def test_a_compile_that_fails_at_load_leaves_decoding_eager(model_dir, monkeypatch):
    from prunus.runtime import compiled_decode as cd

    def broken(self, set_threads=None):
        raise RuntimeError("C++ compile failed\nwith a long log")

    monkeypatch.setattr(cd, "compile_unavailable", lambda device: None)
    monkeypatch.setattr(cd.CompiledDecode, "warm_up", broken)
    with pytest.warns(cd.CompileUnavailable, match=r"torch.compile failed \(RuntimeError: C\+\+ compile failed\); "):
        with Engine.load(model_dir, max_batch=2, compile=True, threads=1) as engine:
            assert engine.info["compile"] is False and engine.backend.compiled is None
            assert len(engine.generate(["a", "bc"], max_new_tokens=3, ignore_eos=True)[1].token_ids) == 3


def test_static_steps_read_keys_up_to_the_longest_row(model, monkeypatch):
    """The compiled path's Python side run eagerly, with key lengths rounded to 8 (so rows cross several):
    its logits equal the ragged eager cache's at every step."""
    from prunus.runtime import compiled_decode as cd

    monkeypatch.setattr(cd, "KEY_STEP", 8)
    ragged, static = TorchBackend(model, 3, 64), TorchBackend(model, 3, 64)
    fast = cd.CompiledDecode(model, static.cache)
    fast._fn = fast._step  # no compile: the same graph, eager
    assert [fast.key_len(n) for n in (1, 8, 9, 60, 64)] == [8, 8, 16, 64, 64]
    ps = prompts([5, 13, 2])
    for be in (ragged, static):
        be.prefill([0, 1, 2], ps)
    for step in range(20):
        rows = [0, 1, 2] if step % 3 else [1, 2]
        tokens = [(5 * step + r) % 300 for r in rows]
        torch.testing.assert_close(fast(rows, tokens), ragged.decode(rows, tokens), atol=1e-5, rtol=0)


@pytest.mark.skipif(not os.environ.get("PRUNUS_TEST_COMPILE"),
                    reason="compiles a graph for real (20-65 s on 2 CPU cores); PRUNUS_TEST_COMPILE=1 runs it "
                           "(tests/test_serve.py's compiled test runs every time)")
def test_compiled_decode_gives_the_eager_greedy_tokens(model, monkeypatch):
    """One bucket, compiled for real; key lengths of 8 so the one graph serves several lengths."""
    from prunus.runtime import compiled_decode as cd

    if (why := cd.compile_unavailable(torch.device("cpu"))) is not None:
        pytest.skip(f"torch.compile cannot run here: {why}")

    monkeypatch.setattr(cd, "KEY_STEP", 8)
    ps = prompts([6])
    eager, compiled = TorchBackend(model, 1, 48), TorchBackend(model, 1, 48, compile=True)
    compiled.warm_up()
    assert compiled.compiled is not None
    _, want = greedy(eager, [0], ps, 30)
    _, got = greedy(compiled, [0], ps, 30)
    assert got == want


def test_generate_flags_reach_the_engine(model_dir, monkeypatch):
    """--prefill-chunk and --no-compile go to Engine.load; chunks of 3 give the whole-prompt tokens."""
    from click.testing import CliRunner

    from prunus.cli.main import cli

    seen = []
    load = Engine.load.__func__

    def spy(cls, *args, **kwargs):
        seen.append({k: kwargs[k] for k in ("compile", "prefill_chunk")})
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(spy))
    base = ["generate", str(model_dir), "--prompt", "def main(argv):\n    return", "--max-new-tokens", "6",
            "--temperature", "0"]
    outs = [CliRunner().invoke(cli, base + extra) for extra in ([], ["--prefill-chunk", "3", "--no-compile"],
                                                              ["--prefill-chunk", "0"])]
    assert all(r.exit_code == 0 for r in outs), [r.output for r in outs]
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout
    assert seen == [{"compile": "auto", "prefill_chunk": "auto"}, {"compile": False, "prefill_chunk": 3},
                    {"compile": "auto", "prefill_chunk": None}]
