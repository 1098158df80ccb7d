"""The typed compression state, the pass rule, and validation written once.

* CompressionState: saved in config.json in a fixed key order, rebuilt by load_model (from dirs
  written before it too: any key order, no passes), unknown records refused with one line.
* Every pass returns the model it made; the runner keeps the state when a pass builds a new module.
* One exclude rule for quantize and prune; one list of prune scopes for the pass and the recipe;
  one calibration check; one unknown-field check behind every config reader.
"""

from __future__ import annotations

import json

import pytest
import torch

from prunus.compress.context import PassContext
from prunus.compress.distill import corpus_label
from prunus.compress.options import PRUNE_SCOPES
from prunus.compress.prune import prunable_linears
from prunus.compress.quantize import linear_names, quantize_pass
from prunus.compress.recipe import check_pass, parse_recipe
from prunus.compress.run import run_pass
from prunus.compress.student import make_student
from prunus.data.corpus import load_corpus
from prunus.models import ByteTokenizer, PrunusError, Transformer, get_preset, load_model, save_model
from prunus.models.compression_state import CompressionState, compression_state, set_compression_state
from prunus.models.config import ModelConfig
from prunus.models.quantized import QuantizedLinear
from prunus.train_parallel.config import TrainConfig
from prunus.train_parallel.config_file import read_config_file


class Calibration:
    """The part of a pass context quantize reads."""

    def calibration(self, n):
        return [torch.randint(0, 256, (2, 16)) for _ in range(n)]


def test_state_round_trip_in_a_fixed_key_order(tmp_path, tiny_model):
    state = compression_state(tiny_model)
    state.sparsity = {"method": "magnitude", "achieved": 0.5}
    state.record_pass("prune", {"method": "magnitude"}, ["zeroed half"])
    path = save_model(tiny_model, tmp_path / "m", stage="compress")
    saved = json.loads((path / "config.json").read_text())["compression"]
    assert list(saved) == ["passes", "sparsity"]
    assert saved["passes"] == [{"name": "prune", "args": {"method": "magnitude"}, "notes": ["zeroed half"]}]
    loaded = compression_state(load_model(path))
    assert loaded == state and loaded.quantization is None and loaded.quantized_modules == {}


def test_a_dir_written_before_the_typed_state_still_loads(tmp_path, tiny_model):
    """config.json as earlier versions wrote it (records in pass order, no passes list) rebuilds the quantized model."""
    model = quantize_pass(tiny_model, Calibration(), scheme="int8-weight-only")
    path = save_model(model, tmp_path / "old", stage="compress")
    config = json.loads((path / "config.json").read_text())
    record = config["compression"]["quantization"]
    config["compression"] = {"quantization": record, "sparsity": {"method": "wanda", "achieved": 0.5}}
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(path, verify=False)
    assert isinstance(loaded.layers["0"].attention.wq, QuantizedLinear)
    tokens = torch.randint(0, 256, (1, 12))
    assert torch.equal(model(tokens), loaded(tokens))
    assert compression_state(loaded).sparsity["method"] == "wanda"
    config["compression"]["pruning"] = {}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PrunusError, match="unknown record.s. pruning"):
        load_model(path, verify=False)


def test_state_is_typed_and_copies_are_independent(tiny_model):
    tiny_model.compression = {"sparsity": {}}  # a loose dict is no longer a state
    with pytest.raises(TypeError, match="set_compression_state"):
        compression_state(tiny_model)
    state = compression_state(set_compression_state(tiny_model, CompressionState(sparsity={"achieved": 0.1})))
    copy = state.copy()
    copy.sparsity["achieved"] = 0.9
    assert compression_state(tiny_model).sparsity["achieved"] == 0.1
    copy.set_sparsity({"achieved": 0.5})
    assert copy.sparsity["previous"]["achieved"] == 0.9


def test_a_pass_returns_the_model_it_made(tiny_model):
    compression_state(tiny_model).sparsity = {"achieved": 0.25}
    rebuilt = run_pass(lambda m, ctx: Transformer(m.config), "rebuild", tiny_model, None, {})
    assert rebuilt is not tiny_model and compression_state(rebuilt).sparsity == {"achieved": 0.25}
    with pytest.raises(TypeError, match="returned NoneType"):
        run_pass(lambda m, ctx: None, "forgetful", tiny_model, None, {})


def test_width_student_carries_its_channels_in_the_state(tiny_model):
    student = make_student(tiny_model, "width:2")
    channels = compression_state(student).student_channels
    assert channels is not None and len(channels) == student.config.dim
    assert "student_channels" not in compression_state(student).to_json()


@pytest.mark.parametrize("exclude", ["w2", "layers.-1", "layers.*.attention.wq", "layers.0"])
def test_quantize_and_prune_exclude_the_same_modules(tiny_model, exclude):
    quantized, skipped = linear_names(tiny_model, [exclude, "output"])
    pruned = prunable_linears(tiny_model, [exclude, "output"])
    assert quantized == list(pruned) and skipped and set(skipped).isdisjoint(pruned)


def test_recipe_and_pass_accept_the_same_prune_scopes():
    for scope in PRUNE_SCOPES:
        assert parse_recipe({"passes": [{"prune": {"method": "magnitude", "scope": scope}}]})
    with pytest.raises(PrunusError, match="prune.scope='block' is not valid; use one of layer, row, global"):
        check_pass("prune", {"method": "magnitude", "scope": "block"})


@pytest.mark.parametrize("args, needle", [({"calibration": "entropy"}, "quantize.calibration='entropy' is not valid"),
                                          ({"percentile": 0}, "quantize.percentile=0 is not valid")])
def test_recipe_calibration_check_is_the_pass_check(tiny_model, args, needle):
    with pytest.raises(PrunusError, match=needle):
        check_pass("quantize", {"scheme": "w8a8-static", **args})
    with pytest.raises(PrunusError, match="quantize: (unknown calibration|percentile)"):
        quantize_pass(tiny_model, Calibration(), scheme="w8a8-static", **args)


def test_every_config_reader_names_unknown_fields_the_same_way(tmp_path, tiny_model):
    with pytest.raises(PrunusError, match=r"^m.json: unknown model field\(s\) depht; known: "):
        ModelConfig.from_dict({**get_preset("tiny").to_dict(), "depht": 2}, source="m.json")
    with pytest.raises(PrunusError, match=r"^run.json: unknown setting\(s\) stepz; see prunus train --print-config"):
        TrainConfig.from_dict({"stepz": 1}, source="run.json")
    (tmp_path / "c.toml").write_text("stepz = 1\n")
    with pytest.raises(PrunusError, match=r"unknown setting\(s\) stepz; see prunus train --print-config"):
        read_config_file(tmp_path / "c.toml")
    with pytest.raises(PrunusError, match=r"^distill: student config: unknown field\(s\) depth; known: "):
        make_student(tiny_model, {"depth": 2})


def test_distill_progress_names_the_corpus_the_user_gave(tmp_path, tiny_model):
    """Distillation trains from a temporary token dir; its corpus.json carries the name the engine prints."""
    tok = ByteTokenizer()
    tokens = tok.encode_array(b"some text to distill on " * 20)
    ctx = PassContext(teacher=tiny_model, tokenizer=tok, train_tokens=tokens, val_tokens=tokens,
                      token_bytes=tok.token_bytes(), seq_len=16, corpus_name="books.txt")
    assert corpus_label(ctx) == "books.txt"
    ctx.corpus_name = ""
    assert corpus_label(ctx) == "built-in corpus"
    (tmp_path / "train.bin").write_bytes(tokens.astype("uint16").tobytes())
    (tmp_path / "val.bin").write_bytes(tokens.astype("uint16").tobytes())
    assert load_corpus(tmp_path, tok).name == str(tmp_path)
    (tmp_path / "corpus.json").write_text(json.dumps({"name": "books.txt"}))
    assert load_corpus(tmp_path, tok).name == "books.txt"
