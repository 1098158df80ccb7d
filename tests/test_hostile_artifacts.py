"""Hostile Hugging Face dirs and prunus artifacts: every name read from inside one resolves inside it, no
FIFO hangs a reader, sizes are checked against the weights before anything is built, and every bad file
or value is one ``Error:`` line (exit 2) naming the file and entry, with nothing written.

The dirs are tiny random Llama checkpoints written by prunus itself (no transformers, no download).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from prunus.cli.main import cli
from prunus.models import Transformer, get_preset
from prunus.models import hf_weights
from prunus.models.hf_convert import from_hf
from prunus.models.hf_families import FAMILIES, config_to_hf
from prunus.models.hf_tensors import state_to_hf
from prunus.models.hf_weights import write_weights
from prunus.models.model_dir import state_dict_for_save
from tree_snapshot import snapshot

WORDS = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("the quick brown fox".split())}}


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "add_bos_token": True}))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")


def _hf_dir(path: Path, shard: str | None = None) -> Path:
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    fam = FAMILIES["llama"]
    path.mkdir(parents=True)
    hf = {**config_to_hf(fam, model.config), "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
    (path / "config.json").write_text(json.dumps(hf))
    write_weights(state_to_hf(fam, state_dict_for_save(model)), path, shard)
    _tokenizer(path)
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return {"single": _hf_dir(root / "single"), "sharded": _hf_dir(root / "sharded", shard="60KB")}


@pytest.fixture
def hf(tmp_path, bases):
    """A fresh copy of the single-file checkpoint dir (``hf.sharded()``: of the sharded one)."""
    def copy(kind="single"):
        dst = tmp_path / "hf"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(bases[kind], dst, symlinks=True)
        return dst
    return copy


def convert(tmp_path, hf_dir, assert_user_error, *needles, timeout=60):
    """``prunus convert --from-hf`` refused: exit 2, one line holding every needle, nothing written, the inputs
    unchanged. Run in a thread so a reader that blocks on a FIFO fails the test instead of hanging it."""
    before = snapshot(tmp_path)
    out = tmp_path / "m"
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        r=CliRunner().invoke(cli, ["convert", "--from-hf", str(hf_dir), "--out", str(out)])), daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():  # release a reader blocked on a FIFO, then fail
        for p in tmp_path.rglob("*"):
            try:  # a writer that opens and closes gives the blocked reader its end of file
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK)) if p.is_fifo() else None
            except OSError:
                pass
        thread.join(10)
        pytest.fail("convert --from-hf blocked (opened a FIFO?)")
    assert_user_error(result["r"], *needles)
    assert not out.exists()
    assert snapshot(tmp_path) == before
    return result["r"].stderr.strip()


def _config(hf_dir: Path, **changes) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(cfg))


def _index(hf_dir: Path, edit) -> None:
    path = hf_dir / hf_weights.INDEX
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


# ---- 1. names from inside an artifact stay inside it -------------------------------------------------------

@pytest.fixture
def victim(tmp_path, bases):
    """A sibling dir holding a whole checkpoint's weights in one file: a hostile index points at it."""
    d = tmp_path / "victim"
    d.mkdir()
    state = {}
    for f in sorted(bases["sharded"].glob("*.safetensors")):
        state.update(load_file(f))
    save_file(state, d / "model.safetensors")
    return d / "model.safetensors"


@pytest.fixture
def opened(monkeypatch):
    """Every safetensors path prunus.models.hf_weights reads, header or data."""
    seen = []
    real_header, real_load = hf_weights.read_header, hf_weights.load_file
    monkeypatch.setattr(hf_weights, "read_header", lambda p, *a, **k: seen.append(Path(p)) or real_header(p, *a, **k))
    monkeypatch.setattr(hf_weights, "load_file", lambda p, *a, **k: seen.append(Path(p)) or real_load(p, *a, **k))
    return seen


@pytest.mark.parametrize("target, words", [
    ("../victim/model.safetensors", "is not a plain name inside the dir"),
    ("ABSOLUTE", "is an absolute path"),
    ("/proc/self/environ", "is an absolute path"),
    ("/etc/passwd", "is an absolute path"),
    ("sub/../../victim/model.safetensors", "is not a plain name inside the dir"),
], ids=["dotdot", "absolute", "proc-environ", "etc-passwd", "nested-dotdot"])
def test_index_naming_a_file_outside_the_dir_is_refused_and_never_read(tmp_path, hf, victim, opened, target,
                                                                       words, assert_user_error):
    d = hf("sharded")
    target = str(victim) if target == "ABSOLUTE" else target
    _index(d, lambda wm: wm.update({name: target for name in wm}))  # every tensor, from the victim
    line = convert(tmp_path, d, assert_user_error, "model.safetensors.index.json: weight_map[", repr(target)[:40], words)
    assert "only files inside" in line
    assert not [p for p in opened if "victim" in str(p) or str(p).startswith(("/proc", "/etc"))]


def test_shard_symlinked_out_of_the_dir_is_refused_and_never_read(tmp_path, hf, victim, opened, assert_user_error):
    d = hf("sharded")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(victim)
    convert(tmp_path, d, assert_user_error, f"names '{shard.name}', which leads outside", "a symlink to")
    assert victim not in opened and shard not in opened
    (d / "model.safetensors").symlink_to(victim)  # the single-file name too
    convert(tmp_path, d, assert_user_error, "model.safetensors:", "leads outside")


@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja", "tokenizer_config.json", "config.json"])
def test_tokenizer_and_config_files_symlinked_out_are_refused(tmp_path, hf, name, assert_user_error):
    d = hf()
    secret = tmp_path / "secret.txt"
    secret.write_text('{"private": "key"}')
    (d / name).unlink()
    (d / name).symlink_to(secret)
    line = convert(tmp_path, d, assert_user_error, f"{name}:", "leads outside")
    assert "private" not in line


def test_hub_cache_snapshot_symlinks_into_its_blobs_convert(tmp_path, bases):
    """huggingface_hub's cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>, allowed."""
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in bases["sharded"].iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    out = from_hf(snap, tmp_path / "m")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_export_config_naming_a_graph_outside_is_refused(tmp_path):
    from prunus.runtime.artifact import export_graph_paths
    from prunus.artifacts.errors import PrunusError

    d = tmp_path / "exp"
    d.mkdir()
    (d / "prefill.onnx").write_bytes(b"x")
    for graph in ("../elsewhere.onnx", "/etc/passwd"):
        with pytest.raises(PrunusError, match=r"export.graphs\['decode'\] names .*(plain name|absolute path)") as e:
            export_graph_paths(d, {"graphs": {"prefill": "prefill.onnx", "decode": graph}})
        assert "\n" not in str(e.value)


def _rehash(d: Path) -> None:
    """Make a changed model dir's manifest vouch for its files again (a hostile dir comes with a consistent one)."""
    import hashlib

    manifest = json.loads((d / "prunus.json").read_text())
    manifest["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in manifest["files"]}
    (d / "prunus.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("spec, words", [
    ("ELSEWHERE", "config.json: tokenizer is"),
    ({"kind": "hf", "file": "../elsewhere/tokenizer.json"}, "config.json: tokenizer names the file"),
], ids=["path", "file-outside"])
def test_model_dir_tokenizer_spec_never_points_elsewhere(tmp_path, tiny_model, spec, words, assert_user_error):
    from prunus.models import save_model

    elsewhere = tmp_path / "elsewhere"
    _tokenizer(elsewhere.mkdir() or elsewhere)
    d = save_model(tiny_model, tmp_path / "m", stage="test")
    cfg = json.loads((d / "config.json").read_text())
    cfg["tokenizer"] = str(elsewhere) if spec == "ELSEWHERE" else spec
    (d / "config.json").write_text(json.dumps(cfg))
    _rehash(d)
    result = CliRunner().invoke(cli, ["convert", "--to-hf", str(d), "--out", str(tmp_path / "out")])
    assert_user_error(result, words)
    assert not (tmp_path / "out").exists()


# ---- 2. a FIFO or a directory where a file belongs ---------------------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja", "tokenizer_config.json",
                                  "generation_config.json", "config.json", "model.safetensors"])
@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_fifo_or_directory_in_place_of_a_file_is_named(tmp_path, hf, name, kind, assert_user_error):
    d = hf()
    if (d / name).exists():
        (d / name).unlink()
    os.mkfifo(d / name) if kind == "fifo" else (d / name).mkdir()
    convert(tmp_path, d, assert_user_error, f"{name}:", "a FIFO" if kind == "fifo" else "a directory",
            "not a regular file")


def test_fifo_shard_is_named(tmp_path, hf, assert_user_error):
    d = hf("sharded")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    os.mkfifo(shard)
    convert(tmp_path, d, assert_user_error, f"names '{shard.name}', which is a FIFO, not a regular file")


# ---- 3. sizes checked against the weights before anything is built ------------------------------------------

@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, which must be an integer from 1 to 4,096"),
    ({"num_hidden_layers": 1e9}, "num_hidden_layers is 1000000000.0, which must be an integer"),
    ({"num_hidden_layers": 1000}, "num_hidden_layers is 1,000 but the weights hold layers 2 (model.layers.0 to 1)"),
    ({"vocab_size": 1 << 23}, "vocab_size x hidden_size is 8388608 x 64 but model.embed_tokens.weight has shape"),
    ({"hidden_size": 1 << 30}, "hidden_size is 1073741824, which must be an integer from 1 to 1,048,576"),
], ids=["layers-1e9-int", "layers-1e9-float", "layers-1000", "vocab", "hidden"])
def test_sizes_are_bounded_and_checked_against_the_weights(tmp_path, hf, changes, words, assert_user_error):
    d = hf()
    _config(d, **changes)
    convert(tmp_path, d, assert_user_error, "config.json:", words, timeout=30)


# ---- 4. NaN / inf weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weight_is_named(tmp_path, hf, value, assert_user_error):
    d = hf()
    state = load_file(d / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(state, d / "model.safetensors")
    convert(tmp_path, d, assert_user_error, "model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' holds NaN")


# ---- 5. wrong types, bad encodings ---------------------------------------------------------------------

@pytest.mark.parametrize("changes, words", [
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings is 'no', which must be true or false"),
    ({"rope_scaling": "yarn"}, "rope_scaling is 'yarn', which must be an object"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}}, "rope_parameters.factor is '2', which must be a"),
    ({"model_type": ["llama"]}, "model_type is ['llama'], which must be a string"),
    ({"hidden_size": "64"}, "hidden_size is '64', which must be an integer"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps is '1e-5', which must be a finite number"),
    ({"eos_token_id": {"id": 2}}, "eos_token_id is {'id': 2}, which must be a token id or a list of token ids"),
    ({"architectures": "LlamaForCausalLM"}, "architectures is 'LlamaForCausalLM', which must be a list of strings"),
], ids=["tie-string", "rope-string", "rope-factor-string", "model-type-list", "hidden-string", "eps-string",
        "eos-dict", "architectures-string"])
def test_config_values_of_the_wrong_type_are_named(tmp_path, hf, changes, words, assert_user_error):
    d = hf()
    _config(d, **changes)
    convert(tmp_path, d, assert_user_error, "config.json:", words)


def test_index_values_that_are_not_file_names_are_named(tmp_path, hf, assert_user_error):
    d = hf("sharded")
    _index(d, lambda wm: wm.update({"model.norm.weight": 3}))
    convert(tmp_path, d, assert_user_error, "index.json: weight_map['model.norm.weight'] is 3, not a file name")
    (d / hf_weights.INDEX).write_text('{"weight_map": ["model-00001-of-00002.safetensors"]}')
    convert(tmp_path, d, assert_user_error, "index.json: weight_map is", "not an object")


@pytest.mark.parametrize("value, words", [
    (["</s>"], "eos_token is ['</s>'], which must be a token string or an AddedToken object"),
    ({"id": 2}, "eos_token is {'id': 2}, which must be a token string or an AddedToken object"),
    (7, "eos_token is 7, which must be a token string"),
    ("<nope>", "eos_token '<nope>' is not a token of"),
], ids=["list", "dict-without-content", "number", "unknown-token"])
def test_tokenizer_fields_of_the_wrong_type_are_named(tmp_path, hf, value, words, assert_user_error):
    d = hf()
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": value}))
    convert(tmp_path, d, assert_user_error, "tokenizer_config.json:", words)


def test_added_token_object_is_still_accepted(tmp_path, hf):
    d = hf()
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>", "special": True},
                                                         "add_eos_token": False}))
    assert from_hf(d, tmp_path / "m").is_dir()


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "chat_template.jinja", "config.json",
                                  "tokenizer_config.json", "tokenizer.json"])
def test_non_utf8_bytes_are_named(tmp_path, hf, name, assert_user_error):
    d = hf("sharded")
    path = d / name
    path.write_bytes(path.read_bytes()[:20] + b"\xff\xfe" + path.read_bytes()[20:])
    convert(tmp_path, d, assert_user_error, f"{name}:", "not UTF-8")


def test_non_utf8_manifest_is_named(tmp_path, tiny_model, assert_user_error):
    from prunus.models import save_model

    d = save_model(tiny_model, tmp_path / "m", stage="test")
    (d / "prunus.json").write_bytes(b'{"files": "\xff"}')
    result = CliRunner().invoke(cli, ["convert", "--to-hf", str(d), "--out", str(tmp_path / "out")])
    assert_user_error(result, "prunus.json: not UTF-8")
    assert not (tmp_path / "out").exists()


# ---- 6. tokenizer.json that the tokenizers library cannot use ------------------------------------------------

def _full(model: dict) -> dict:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None, "model": model}


def _bpe(vocab, merges: list, **model) -> dict:
    return _full({"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges, **model})


@pytest.mark.parametrize("tokenizer, words", [
    (_bpe({"a": 0, "b": 1}, ["a b"]), "model.merges[0] 'a b' makes 'ab', which is not in model.vocab"),
    (_bpe({"a": 0, "ab": 2}, ["a b"]), "model.merges[0] 'a b' makes 'b', which is not in model.vocab"),
    (_bpe({"a": 0, "b": 1, "ab": 2}, ["a b"], continuing_subword_prefix="##"), "makes no token"),
    (_bpe({"a": 0, "b": 1, "ab": 2}, ["a b c"]), "model.merges[0] is 'a b c', not a pair of tokens"),
    (_bpe({"<s>": 0, "</s>": 1, "a": 2}, [], unk_token="<unk>"), "cannot encode text"),
    (_full({"type": "WordLevel", "vocab": {"</s>": 0, "the": 1}, "unk_token": "<unk>"}), "cannot encode text"),
    (_bpe(["a", "b"], []), "a BPE model needs a 'vocab' object"),
    ({"version": "1.0"}, "has no 'model' object"),
], ids=["merge-result-missing", "merge-piece-missing", "merge-shorter-than-prefix", "merge-triple",
        "bpe-unk-missing", "wordlevel-unk-missing", "vocab-list", "no-model"])
def test_tokenizer_json_the_library_cannot_use_is_one_line(tmp_path, hf, tokenizer, words, assert_user_error,
                                                          capfd):
    d = hf()
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    convert(tmp_path, d, assert_user_error, "tokenizer.json:", words)
    assert "panicked" not in capfd.readouterr().err  # checked before the library could panic


def test_safetensors_header_cut_in_a_shard_is_named(tmp_path, hf, assert_user_error):
    d = hf("sharded")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    convert(tmp_path, d, assert_user_error, f"{shard.name}: truncated or not a safetensors file")


@pytest.mark.parametrize("location", ["../victim/w.data", "ABSOLUTE", "/proc/self/environ", "link.data", "w.data"])
def test_onnx_external_data_outside_the_export_dir_is_one_line(tmp_path, location):
    """ONNX Runtime refuses external-data locations outside the graph's dir (and symlinks); prunus reports it in
    one line naming the graph."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from prunus.artifacts.errors import PrunusError
    from prunus.runtime.ort_graphs import OrtRunner

    victim, exp = tmp_path / "victim", tmp_path / "exp"
    victim.mkdir(), exp.mkdir()
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save_model(model, str(victim / "g.onnx"), save_as_external_data=True, location="w.data", size_threshold=0)
    (exp / "link.data").symlink_to(victim / "w.data")
    proto = onnx.load(str(victim / "g.onnx"), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = str(victim / "w.data") if location == "ABSOLUTE" else location
    onnx.save_model(proto, str(exp / "prefill.onnx"))
    if location == "w.data":  # the control: a data file inside the dir loads
        shutil.copyfile(victim / "w.data", exp / "w.data")
        assert OrtRunner({"prefill": exp / "prefill.onnx"}, threads=1).sessions
        return
    with pytest.raises(PrunusError, match="prefill.onnx: ONNX Runtime cannot load it .*External data path") as e:
        OrtRunner({"prefill": exp / "prefill.onnx"}, threads=1)
    assert "\n" not in str(e.value)
