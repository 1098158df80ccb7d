import json

import pytest
import torch
from safetensors.torch import load_file

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, read_manifest, save_model
from prunus.artifacts.atomic import atomic_dir


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_is_exact(tmp_path, tiny_model, tie):
    model = tiny_model
    if tie:
        model = Transformer(get_preset("tiny").replace(tie_embeddings=True))
        model.init_weights()
    path = save_model(model, tmp_path / "m", stage="test")
    loaded = load_model(path)
    _assert_same(model, loaded)
    if tie:
        assert loaded.output.weight is loaded.tok_embeddings.weight
        assert "output.weight" not in load_file(path / "model.safetensors")
    tokens = torch.randint(0, 256, (1, 9))
    assert torch.equal(model(tokens), loaded(tokens))


def test_bf16_weights_keep_their_dtype(tmp_path, tiny_model):
    path = save_model(tiny_model.to(torch.bfloat16), tmp_path / "m", stage="test")
    loaded = load_model(path)
    assert loaded.tok_embeddings.weight.dtype == torch.bfloat16
    assert json.loads((path / "config.json").read_text())["model"]["dtype"] == "bfloat16"
    _assert_same(tiny_model, loaded)


def test_manifest_records_hashes_parent_and_metrics(tmp_path, tiny_model):
    first = save_model(tiny_model, tmp_path / "a", stage="train", metrics={"val_bpb": 2.0})
    second = save_model(tiny_model, tmp_path / "b", stage="compress", parent=first)
    m1, m2 = read_manifest(first), read_manifest(second)
    assert set(m1["files"]) == {"config.json", "model.safetensors"}
    assert m1["metrics"]["val_bpb"] == 2.0 and m1["metrics"]["params"] == get_preset("tiny").num_params()
    assert m1["metrics"]["bytes_on_disk"] > 0 and m1["versions"]["torch"] == torch.__version__
    assert m2["parent"]["path"] == str(first.resolve()) and len(m2["parent"]["hash"]) == 64


def test_hash_mismatch_and_missing_file_are_refused(tmp_path, tiny_model):
    path = save_model(tiny_model, tmp_path / "m", stage="test")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(PrunusError, match="model.safetensors: content hash does not match prunus.json"):
        load_model(path)
    weights.unlink()
    with pytest.raises(PrunusError, match="model.safetensors: missing"):
        load_model(path)
    with pytest.raises(PrunusError, match="no such model dir"):
        load_model(tmp_path / "nowhere")


def test_existing_output_is_refused_and_overwrite_replaces(tmp_path, tiny_model):
    path = save_model(tiny_model, tmp_path / "m", stage="test")
    with pytest.raises(PrunusError, match="already exists"):
        save_model(tiny_model, path, stage="test")
    save_model(tiny_model, path, stage="again", overwrite=True)
    assert read_manifest(path)["stage"] == "again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or old dirs left


def test_a_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
