"""A model dir served on a CPU by the fastest runtime (prunus.export.prepared): the native kernels reading the dir
itself where they run (no export written), else its prepared genai export in ONNX Runtime (``--no-native`` here):
the same greedy tokens as the torch Engine, the export made once and cached by what the dir holds, the torch Engine
kept where an option needs it or the export cannot be made, and ``prunus serve``'s default."""

from __future__ import annotations

import os
from pathlib import Path

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
FASTEST = "native" if unavailable() is None else "ort_genai"  # the runtime a model dir is served by by default
PREPARED = {"native": False}  # where the prepared export (ONNX Runtime) is what serves


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


@pytest.mark.skipif(unavailable() is not None, reason=f"native kernels unavailable: {unavailable()}")
def test_the_native_kernels_serve_the_dir_itself_with_no_export(model_dir, cache, monkeypatch):
    monkeypatch.setattr("prunus.export.export_dir.export_model", lambda *a, **k: pytest.fail("exported"))
    with Engine.load(model_dir, threads=1, backend="torch") as plain:
        want = _tokens(plain)
    with Engine.load(model_dir, threads=1, prepare=prepared_path) as engine:
        assert engine.info["runtime"] == "native" and engine.info["native"] == "on"
        assert "directly" in engine.info["prepared"]["skipped"] and _tokens(engine) == want
    assert not cache.exists()


def test_served_from_a_cached_export_with_the_torch_engines_tokens(model_dir, cache, monkeypatch):
    with Engine.load(model_dir, threads=1, backend="torch") as plain:
        want = _tokens(plain)
    with Engine.load(model_dir, threads=1, prepare=prepared_path, **PREPARED) as engine:
        info = engine.info
        assert info["runtime"] == "ort_genai" and info["path"] == str(model_dir)
        assert info["native"] == "off: native=False (--no-native)"
        assert info["prepared"]["cached"] is False and info["prepared"]["export"].startswith(str(cache))
        assert _tokens(engine) == want
    monkeypatch.setattr("prunus.export.export_dir.export_model", lambda *a, **k: pytest.fail("exported twice"))
    with Engine.load(model_dir, threads=1, prepare=prepared_path, **PREPARED) as engine:
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
                                            ({"draft": "ngram", "native": False}, "speculative decoding")])
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
    with Engine.load(model_dir, threads=1, prepare=prepared_path, **PREPARED) as engine:
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
    for extra in ([], ["--no-native"], ["--no-prepare", "--no-native"]):
        r = CliRunner().invoke(cli, ["serve", str(model_dir), "--port", "0", "--max-batch", "1", *extra])
        assert r.exit_code == 0, r.output
    assert seen == [(FASTEST, model_dir.name), ("ort_genai", model_dir.name), ("torch", model_dir.name)]


@pytest.mark.skipif(unavailable() is not None, reason=f"native kernels unavailable: {unavailable()}")
def test_native_flags_apply_to_the_prepared_export(model_dir, cache, monkeypatch):
    """--native on a model dir serves the dir itself in the kernels, --no-native its prepared export in ONNX Runtime
    (checked against that backend, not the torch one); --native with --backend torch is one line; --native where the
    kernels cannot serve the dir and its export cannot be made is one line, not a torch fallback."""
    with Engine.load(model_dir, threads=1, prepare=prepared_path, native=True) as engine:
        assert engine.info["runtime"] == "native" and "directly" in engine.info["prepared"]["skipped"]
        want = _tokens(engine)
    with Engine.load(model_dir, threads=1, prepare=prepared_path, native=False) as engine:
        assert engine.info["runtime"] == "ort_genai" and engine.info["native"] == "off: native=False (--no-native)"
        assert _tokens(engine) == want
    with pytest.raises(PrunusError, match="native=True decodes in prunus's kernels, and --backend torch was asked"):
        Engine.load(model_dir, threads=1, prepare=prepared_path, native=True, backend="torch")

    def refuse(*a, **k):
        raise PrunusError("the genai graph does not support this model")
    monkeypatch.setattr(prepared, "cache_key", lambda d: "other")  # not the cached export: it must be made
    monkeypatch.setattr("prunus.export.export_dir.export_model", refuse)
    from prunus.runtime.load_options import LoadOptions

    assert prepared_path(model_dir, None, LoadOptions(native=True), False)[0] == model_dir  # nothing exported
    monkeypatch.setattr(prepared, "native_direct", lambda path, config, options: False)  # e.g. weights the kernels lack
    r = CliRunner().invoke(cli, ["serve", str(model_dir), "--port", "0", "--native"])
    last = r.stderr.strip().splitlines()[-1]  # after the line saying the export is being made
    assert r.exit_code == 2 and last.startswith("Error: ") and "--native serves its genai export, which could not" in last


# --- what the cache holds is served only when it is this dir's export, whole, as prunus wrote it -------------------

@pytest.fixture(scope="module")
def good_entry(model_dir, tmp_path_factory):
    """A prepared export of ``model_dir``, made once (read-only: tests copy it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRUNUS_CACHE_DIR", str(tmp_path_factory.mktemp("good-cache")))
        out, _ = prepared.prepare(model_dir, progress=False)
    return out


@pytest.fixture()
def exports(good_entry, monkeypatch):
    """Re-preparing copies ``good_entry`` (an export of the same dir) instead of exporting: the calls are listed."""
    import shutil

    calls = []

    def export_model(model_dir, out, **kwargs):
        calls.append(Path(out))
        shutil.copytree(good_entry, out)
    monkeypatch.setattr("prunus.export.export_dir.export_model", export_model)
    return calls


def _entry(cache, model_dir):
    return cache / f"{model_dir.resolve().name}-{prepared.cache_key(model_dir)}"


def _parent_hash(model_dir):
    from prunus.models.model_dir import dir_hash, read_manifest

    return dir_hash(read_manifest(model_dir)["files"])


def _rehash(entry):
    """Record the entry's files' current hashes in its manifest, as a forger would."""
    import json

    from prunus.artifacts.manifest_schema import sha256_file

    manifest = json.loads((entry / "prunus.json").read_text())
    manifest["files"] = {name: sha256_file(entry / name) for name in manifest["files"]}
    (entry / "prunus.json").write_text(json.dumps(manifest))


def _plant(cache, model_dir, good_entry, how):
    import json
    import shutil

    entry = _entry(cache, model_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if how == "junk":
        entry.mkdir()
        (entry / "config.json").write_text('{"export": {"format": "onnx", "graphs": {"model": "model.onnx"}}}')
        (entry / "model.onnx").write_bytes(b"not a graph")
    else:
        shutil.copytree(good_entry, entry)
    if how == "another dir's export":
        manifest = json.loads((entry / "prunus.json").read_text())
        manifest["parent"]["hash"] = "0" * 64
        (entry / "prunus.json").write_text(json.dumps(manifest))
    return entry


@pytest.mark.parametrize("how", ["junk", "another dir's export"])
def test_a_planted_entry_is_prepared_again_not_served(model_dir, cache, good_entry, exports, how, capsys):
    entry = _plant(cache, model_dir, good_entry, how)
    assert prepared.entry_problem(entry, _parent_hash(model_dir)) is not None
    out, cached = prepared.prepare(model_dir)
    assert out == entry and cached is False and exports == [entry.with_name(f".{entry.name}.tmp-{os.getpid()}")]
    assert prepared.entry_problem(entry, _parent_hash(model_dir)) is None
    err = capsys.readouterr().err
    assert f"export, again: the one cached in {entry} is not used (" in err and "re-create" not in err


def test_a_symlinked_entry_is_replaced_never_followed(model_dir, cache, good_entry, exports, tmp_path):
    import shutil

    elsewhere = shutil.copytree(good_entry, tmp_path / "elsewhere")  # a whole, valid export: still not followed
    before = sorted(p.name for p in elsewhere.iterdir())
    entry = _entry(cache, model_dir)
    cache.mkdir(parents=True)
    entry.symlink_to(elsewhere, target_is_directory=True)
    out, cached = prepared.prepare(model_dir, progress=False)
    assert cached is False and len(exports) == 1
    assert out.is_dir() and not out.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_symlinked_cache_dir_is_refused_and_the_dir_served_by_torch(model_dir, cache, exports, tmp_path, capsys):
    from prunus.runtime.load_options import LoadOptions

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache.parent.mkdir(mode=0o700)
    cache.symlink_to(elsewhere, target_is_directory=True)
    path, info = prepared_path(model_dir, None, LoadOptions(native=False), False)
    assert path == model_dir and "is a symlink" in info["skipped"] and exports == []
    assert list(elsewhere.iterdir()) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"prunus: serving {model_dir} on the torch backend: {cache}: is a")
    assert "re-create" not in err[0]


def test_a_symlink_at_the_lock_path_is_refused_never_created_through(model_dir, cache, exports, tmp_path):
    target = tmp_path / "elsewhere" / "lock"
    target.parent.mkdir()
    cache.mkdir(parents=True, mode=0o700)
    lock = cache / f".{_entry(cache, model_dir).name}.lock"
    lock.symlink_to(target)
    with pytest.raises(PrunusError, match=f"^{lock}: is a symlink .*; remove it, or set PRUNUS_CACHE_DIR"):
        prepared.prepare(model_dir, progress=False)
    assert not target.exists() and lock.is_symlink() and exports == []


@pytest.mark.parametrize("name", ["native_weights.safetensors", "model.onnx"])
def test_a_rehashed_export_with_nan_weights_is_prepared_again(model_dir, cache, good_entry, exports, name):
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    entry = _plant(cache, model_dir, good_entry, "copy")
    f = entry / name
    if name.endswith(".safetensors"):
        with safe_open(f, "np") as st:
            metadata = st.metadata()
        tensors = load_file(f)
        key = next(k for k, v in tensors.items() if v.dtype == np.float32)
        tensors[key] = tensors[key].copy()
        tensors[key].flat[1] = np.nan
        save_file(tensors, f, metadata=metadata)
    else:
        graph = onnx.load(str(f))
        i, init = next((i, t) for i, t in enumerate(graph.graph.initializer) if t.data_type == onnx.TensorProto.FLOAT)
        values = numpy_helper.to_array(init).copy()
        values.flat[0] = np.inf
        graph.graph.initializer[i].CopyFrom(numpy_helper.from_array(values, init.name))
        onnx.save(graph, str(f))
    _rehash(entry)
    why = prepared.entry_problem(entry, _parent_hash(model_dir))
    assert why is not None and why.startswith(f"{name}: ") and " holds " in why and ("NaN" in why or "inf" in why)
    assert prepared.prepare(model_dir, progress=False)[1] is False and len(exports) == 1
    assert prepared.entry_problem(entry, _parent_hash(model_dir)) is None


@pytest.mark.parametrize("damage", ["truncated graph", "half-written (no manifest)", "a file removed"])
def test_a_damaged_entry_is_prepared_again_and_served(model_dir, cache, good_entry, exports, damage):
    entry = _plant(cache, model_dir, good_entry, "copy")
    if damage == "truncated graph":
        data = (entry / "model.onnx").read_bytes()
        (entry / "model.onnx").write_bytes(data[: len(data) // 2])
    else:
        (entry / ("prunus.json" if damage.startswith("half") else "native_weights.safetensors")).unlink()
    with Engine.load(model_dir, threads=1, prepare=prepared_path, **PREPARED) as engine:
        assert engine.info["runtime"] == "ort_genai" and engine.info["prepared"]["cached"] is False
        assert len(_tokens(engine)) == len(PROMPTS)
    assert len(exports) == 1 and prepared.entry_problem(entry, _parent_hash(model_dir)) is None


def test_a_model_dir_failing_its_manifest_is_refused_whatever_the_cache_holds(model_dir, cache, good_entry, exports,
                                                                              tmp_path, assert_user_error):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / model_dir.name)  # same name, sizes and times: the same key
    assert prepared.cache_key(copy) == prepared.cache_key(model_dir)
    entry = _plant(cache, copy, good_entry, "copy")
    weights = copy / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"  # a NaN in the last weight, size kept
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the time kept: the stale entry still has its name
    assert prepared.cache_key(copy) == prepared.cache_key(model_dir)
    with pytest.raises(PrunusError, match="model.safetensors: content hash does not match prunus.json"):
        Engine.load(copy, threads=1, prepare=prepared_path)
    r = CliRunner().invoke(cli, ["serve", str(copy), "--port", "0"])
    assert_user_error(r, "model.safetensors: content hash does not match prunus.json")
    assert exports == [] and (entry / "prunus.json").is_file()  # the entry neither served nor replaced


def test_the_cache_dirs_and_lock_files_are_private(model_dir, cache, exports):
    import stat

    prepared.prepare(model_dir, progress=False)
    entry = _entry(cache, model_dir)
    modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in (cache.parent, cache, entry, *entry.iterdir())}
    assert all(mode == (0o700 if p.is_dir() else 0o600) for p, mode in modes.items()), modes
    assert stat.S_IMODE(os.lstat(cache / f".{entry.name}.lock").st_mode) == 0o600
    os.chmod(cache, 0o755)  # a cache dir made by an older prunus: narrowed at the next use
    prepared.prepare(model_dir, progress=False)
    assert stat.S_IMODE(os.lstat(cache).st_mode) == 0o700 and len(exports) == 1
