"""TOML training configs: ``prunus train --config run.toml``, flags override the file.

Keys are TrainConfig's field names; ``[model]`` holds overrides of the preset::

    preset = "small"
    steps = 2000
    tp = 2
    [model]
    n_layers = 8
"""

from __future__ import annotations

import sys
from pathlib import Path

from prunus.artifacts.errors import PrunusError

from prunus.artifacts.validate import check_known_fields, parse_document, read_text

from .config import SETTINGS_FIX, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise PrunusError(f"--config {path}: no such file; give a TOML file of training settings")
    text = read_text(path, fix="give a TOML file of training settings", max_bytes=1 << 20)
    data = parse_document(text, tomllib.loads, tomllib.TOMLDecodeError, f"--config {path}", "TOML")
    check_known_fields(data, TrainConfig, f"--config {path}", what="setting", fix=SETTINGS_FIX)
    return data


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: TrainConfig) -> str:
    """The resolved settings as TOML (settings that are None are left out: they mean 'the default')."""
    d = cfg.to_dict()
    model = d.pop("model")
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if v is not None]
    if model:
        lines += ["", "[model]"] + [f"{k} = {_toml_value(v)}" for k, v in model.items()]
    return "\n".join(lines) + "\n"
