"""The sampling defaults a model ships in its ``generation_config.json``, for requests that leave them out.

Read once when the server starts, from the served dir: ``temperature``, ``top_p``, ``top_k`` and
``repetition_penalty``, each only where the file sets it (as vLLM does; transformers' own defaults such as
``top_k=50`` are not assumed). A field the request gives wins; a field neither gives takes OpenAI's default
(temperature 1, no top-p / top-k / penalty). A value of the wrong type is one line naming the file and key.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object

GENERATION_CONFIG = "generation_config.json"
KEYS = {"temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float}


def sampling_defaults(directory: str | Path | None) -> dict:
    """{field: value} of the keys above that ``directory/generation_config.json`` sets ({} without one)."""
    if directory is None or not Path(directory).is_dir():
        return {}
    path = inside(directory, GENERATION_CONFIG, fix="fix or remove it", required=False)
    if path is None:
        return {}
    cfg = read_json_object(path, fix="fix or remove it")
    out = {}
    for key, kind in KEYS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise PrunusError(f"{path}: {key} {str(value)[:40]!r} must be a {kind.__name__}; fix or remove it")
        out[key] = kind(value)
    if out.get("top_k") == 0:
        del out["top_k"]
    return out
