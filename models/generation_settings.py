"""A Hugging Face ``generation_config.json``: the token ids generation starts, pads and stops with.

``eos_token_id`` may be one id or a list: chat models list their end-of-turn token there
beside the end-of-text one (Llama 3 Instruct: ``[128001, 128008, 128009]``; Gemma: ``[1, 107]``),
and every one of them must stop generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object

GENERATION_CONFIG = "generation_config.json"


def _ids(value, where: str, key: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise PrunusError(f"{where}: {key} {value!r} must be a token id or a list of token ids")
    return tuple(values)


@dataclass(frozen=True)
class GenerationSettings:
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def read(cls, directory: str | Path) -> "GenerationSettings":
        """``directory/generation_config.json``, or empty settings when there is none."""
        path = inside(directory, GENERATION_CONFIG, fix="fix or remove it", required=False)  # a FIFO: one line
        if path is None:
            return cls()
        cfg = read_json_object(path, fix="fix or remove it")  # bounded, UTF-8, one line on any failure
        one = {k: _ids(cfg.get(k), str(path), k) for k in ("bos_token_id", "pad_token_id")}
        return cls(_ids(cfg.get("eos_token_id"), str(path), "eos_token_id"),
                   *(v[0] if v else None for v in one.values()))
