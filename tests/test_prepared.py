"""A model dir served from its prepared genai export (prunus.export.prepared), in the native kernels where they run
(else ONNX Runtime): the same greedy tokens as the torch Engine, made once and cached by what the dir holds, the torch Engine kept where an option needs it or
the export cannot be made, and ``prunus serve``'s default."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.models import Transformer, get_preset, save_model
from prunus.native.build import cpu_supported, unavailable
from prunus.export import prepared
from prunus.export.parity import ParityFailed
from prunus.export.prepared import prepared_path
from prunus.serve import Engine
from prunus.serve.http_server import CompletionServer

PROMPTS = ["The cat sat", "def f(x):"]
NATIVE_WHY = cpu_supported()
FASTEST = "native" if unavailable() is None else "ort_genai"  # the runtime a prepared export loads on by default


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNUS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prepared"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("prepared") / "model", stage="test")


def _tokens(engine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=12)]


def test_served_from_a_cached_export_with_the_torch_engines_tokens(model_dir, cache, monkeypatch):
    with Engine.load(model_dir, threads=1) as plain:
        want = _tokens(plain)
    with Engine.load(model_dir, threads=1, prepare=prepared_path) as engine:
        info = engine.info
        assert info["runtime"] == FASTEST and info["path"] == str(model_dir)
        assert info["native"] == ("on" if NATIVE_WHY is None else f"off: the native kernels need {NATIVE_WHY}")
        assert info["prepared"]["cached"] is False and info["prepared"]["export"].startswith(str(cache))
        assert _tokens(engine) == want
    monkeypatch.setattr("prunus.export.export_dir.export_model", lambda *a, **k: pytest.fail("exported twice"))
    with Engine.load(model_dir, threads=1, prepare=prepared_path) as engine:
        assert engine.info["prepared"]["cached"] is True and _tokens(engine) == want
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [
        os.path.basename(info["prepared"]["export"])]


def test_the_key_follows_what_the_dir_holds(model_dir, tmp_path):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "model", symlinks=False)
    key = prepared.cache_key(copy)
    assert prepared.cache_key(copy) == key
    weights = copy / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten weights
    assert prepared.cache_key(copy) != key
    key = prepared.cache_key(copy)
    (copy / "generation_config.json").write_text('{"temperature": 0.5}')
    assert prepared.cache_key(copy) != key


@pytest.mark.parametrize("kwargs, reason", [({"backend": "torch"}, "--backend torch"),
                                            ({"dtype": "bfloat16"}, "dtype=bfloat16"),
                                            ({"draft": "ngram"}, "speculative decoding")])
def test_options_that_need_torch_keep_it_and_say_why(model_dir, cache, kwargs, reason):
    with Engine.load(model_dir, threads=1, prepare=prepared_path, **kwargs) as engine:
        assert engine.info["runtime"] == "torch" and reason in engine.info["prepared"]["skipped"]
    assert not cache.exists()


@pytest.mark.parametrize("error, words", [
    (PrunusError("the genai graph does not support this model"), "does not support"),
    (ParityFailed({"failed": ["max_abs_logits"], "max_abs_logits": 0.5, "tolerances": {"max_abs_logits": 1e-3}}),
     "parity check failed")])
def test_an_export_that_cannot_be_made_falls_back_to_torch(model_dir, cache, monkeypatch, capsys, error, words):
    def refuse(*a, **k):
        raise error
    monkeypatch.setattr("prunus.export.export_dir.export_model", refuse)
    with Engine.load(model_dir, threads=1, prepare=prepared_path) as engine:
        assert engine.info["runtime"] == "torch"
        assert words in engine.info["prepared"]["skipped"]
    assert "serving" in capsys.readouterr().err  # one line says so


def test_a_bad_option_is_refused_before_any_export(model_dir, cache):
    with pytest.raises(PrunusError, match="max_batch"):
        Engine.load(model_dir, prepare=prepared_path, max_batch=0)
    assert not cache.exists()


def test_serve_prepares_by_default_and_no_prepare_keeps_torch(model_dir, cache, monkeypatch):
    seen = []

    def record(self, poll_interval=0.5):  # the engine the command built, then Ctrl-C
        seen.append((self.engine.info["runtime"], self.model_name))
        raise KeyboardInterrupt
    monkeypatch.setattr(CompletionServer, "serve_forever", record)
    for extra in ([], ["--no-prepare"]):
        r = CliRunner().invoke(cli, ["serve", str(model_dir), "--port", "0", "--max-batch", "1", *extra])
        assert r.exit_code == 0, r.output
    assert seen == [(FASTEST, model_dir.name), ("torch", model_dir.name)]


@pytest.mark.skipif(unavailable() is not None, reason=f"native kernels unavailable: {unavailable()}")
def test_native_flags_apply_to_the_prepared_export(model_dir, cache, monkeypatch):
    """--native / --no-native on a model dir choose the runtime of its prepared export (checked against that
    backend, not the torch one); --native where the export cannot be made is one line, not a torch fallback."""
    with Engine.load(model_dir, threads=1, prepare=prepared_path, native=True) as engine:
        assert engine.info["runtime"] == "native" and engine.backend.session.session is None
        want = _tokens(engine)
    with Engine.load(model_dir, threads=1, prepare=prepared_path, native=False) as engine:
        assert engine.info["runtime"] == "ort_genai" and engine.info["native"] == "off: native=False (--no-native)"
        assert _tokens(engine) == want
    with pytest.raises(PrunusError, match="native applies to an ONNX Runtime export dir"):
        Engine.load(model_dir, threads=1, prepare=prepared_path, native=True, backend="torch")

    def refuse(*a, **k):
        raise PrunusError("the genai graph does not support this model")
    monkeypatch.setattr(prepared, "cache_key", lambda d: "other")  # not the cached export: it must be made
    monkeypatch.setattr("prunus.export.export_dir.export_model", refuse)
    r = CliRunner().invoke(cli, ["serve", str(model_dir), "--port", "0", "--native"])
    last = r.stderr.strip().splitlines()[-1]  # after the line saying the export is being made
    assert r.exit_code == 2 and last.startswith("Error: ") and "--native serves its genai export, which could not" in last
