"""The model spec registry (prunus.models.spec): every entry of every kind names an object prunus has, an
artifact's kind picks its row (none: the transformer), and a kind prunus does not know is one line."""

from __future__ import annotations

import json

import pytest

from prunus.artifacts.errors import PrunusError
from prunus.models.spec import ENTRIES, SPECS, TRANSFORMER, dir_kind, get_spec, spec_of_dir


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_entry_resolves(kind):
    spec = SPECS[kind]
    from prunus.compress.run import CompressKind

    for entry in ENTRIES:
        if getattr(spec, entry) is not None:
            target = spec.load(entry)
            assert isinstance(target, CompressKind) if entry == "compress" else callable(target), (kind, entry)
    assert spec.load("compress").name == kind  # the pass registry's kinds name it
    config = spec.load("config")
    assert config.KIND == kind and "steps" in config.RESUMABLE


def test_an_artifacts_kind_picks_its_spec(tmp_path):
    assert dir_kind(tmp_path) is None and spec_of_dir(tmp_path).name == TRANSFORMER
    (tmp_path / "config.json").write_text(json.dumps({"kind": "module"}))
    assert spec_of_dir(tmp_path).name == "module"
    (tmp_path / "config.json").write_text(json.dumps({"kind": "rnn"}))
    with pytest.raises(PrunusError, match="'rnn' is not one prunus knows"):
        spec_of_dir(tmp_path)
    assert get_spec(None) is SPECS[TRANSFORMER]
