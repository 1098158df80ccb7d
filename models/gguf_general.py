"""The ``general.*`` names of a GGUF file: what the model is called, who made it, its license.

llama.cpp's converter writes them from the Hugging Face dir's model card and name. prunus
carries them both ways:

* ``--from-gguf`` keeps the source file's text ``general.*`` keys (name, basename, finetune,
  organization, size_label, license, languages, tags, ...) in the model dir's manifest
  (``prunus.json`` metrics ``gguf_general``); later stages copy the manifest's metrics forward.
* ``--to-gguf`` writes them back; keys the manifest lacks come from a model card ``README.md``
  in the model dir (its YAML front matter: ``license``, ``language``, ``tags``, ``base_model``,
  ``model_name``), then ``general.name`` from the dir's name and ``general.size_label`` from the
  parameter count, spelled as llama.cpp spells it (``135M``, ``1.7B``).
"""

from __future__ import annotations

import re
from pathlib import Path

# keys llama.cpp owns or derives from the weights: never copied from another file
_DERIVED = {"general.architecture", "general.type", "general.file_type", "general.quantization_version",
            "general.alignment"}
_CARD_KEYS = {"license": "general.license", "license_name": "general.license.name",
              "license_link": "general.license.link", "language": "general.languages", "tags": "general.tags",
              "model_name": "general.name"}
MAX_CARD_BYTES = 1 << 20
MAX_VALUE_CHARS = 4096


def gguf_general_of(meta: dict) -> dict:
    """The text ``general.*`` keys of a GGUF's metadata worth carrying into a model dir."""
    out = {}
    for key, value in meta.items():
        if not key.startswith("general.") or key in _DERIVED:
            continue
        if _is_text(value):
            out[key] = value
    return out


def _is_text(value) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_VALUE_CHARS
    return isinstance(value, list) and len(value) <= 256 and all(isinstance(v, str) and len(v) <= MAX_VALUE_CHARS
                                                                  for v in value)


def size_label(n_params: int) -> str:
    """A parameter count as llama.cpp names sizes: 134515008 -> '135M', 1711376384 -> '1.7B'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n_params >= scale:
            break
    scaled = n_params / scale
    digits = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    return f"{scaled:.{digits}f}{suffix}"


def model_card(directory: Path) -> dict:
    """``general.*`` keys from the YAML front matter of ``directory/README.md`` (simple keys and lists)."""
    card = directory / "README.md"
    if not card.is_file() or card.stat().st_size > MAX_CARD_BYTES:
        return {}
    lines = card.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    out, key = {}, None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        item = re.match(r"^\s*-\s+(.*)$", line)
        if item and key in _CARD_KEYS:
            value = out.setdefault(_CARD_KEYS[key], [])
            if isinstance(value, list):
                value.append(str(_unquote(item.group(1))))
            continue
        pair = re.match(r"^([A-Za-z_][\w-]*):\s*(.*)$", line)
        if pair:
            key, value = pair.group(1), _unquote(pair.group(2))
            if key in _CARD_KEYS and value:
                out[_CARD_KEYS[key]] = value
    return {k: v for k, v in out.items() if _is_text(v) and v}


def _unquote(text: str):
    text = text.strip()
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]":  # a flow list: [a, b]
        return [_unquote(t) for t in text[1:-1].split(",") if t.strip()]
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def general_metadata(directory: Path, manifest: dict, n_params: int) -> dict:
    """The ``general.*`` keys to write for the model dir ``directory`` (see the module docstring)."""
    carried = (manifest.get("metrics") or {}).get("gguf_general")
    out = {k: v for k, v in carried.items() if k.startswith("general.") and k not in _DERIVED and _is_text(v)} \
        if isinstance(carried, dict) else {}
    for key, value in model_card(directory).items():
        out.setdefault(key, [value] if key in ("general.languages", "general.tags")
                       and isinstance(value, str) else value)
    out.setdefault("general.name", directory.resolve().name)
    out.setdefault("general.size_label", size_label(n_params))
    return out


def add_general(writer, general: dict) -> None:
    """Write ``general`` (key -> text or list of text) with a ``gguf.GGUFWriter``."""
    for key, value in general.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
