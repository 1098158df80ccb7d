"""The files of a Hugging Face tokenizer dir, read as every artifact is: each a regular file inside the dir
(:mod:`prunus.artifacts.contained`: a symlink out, a FIFO or a directory in its place is one line), bounded,
UTF-8, and checked before it is used.

* ``tokenizer.json``: JSON with a ``model`` object; a BPE model's merges are checked against its vocabulary
  (a merge whose pieces or result the vocabulary lacks makes the tokenizers library panic, printing a Rust
  backtrace, instead of raising).
* ``tokenizer_config.json`` / ``special_tokens_map.json``: the named special tokens (``bos_token``,
  ``eos_token``, ...) are strings or AddedToken objects (``{"content": ...}``); a list, a number or an object
  without a string ``content`` is one line naming the file and key.
* ``chat_template.jinja``: UTF-8 text, bounded like every small file.
"""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import parse_json, read_json_object, read_text, short

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MAX_TOKENIZER_BYTES = 1 << 28  # the largest published tokenizer.json files hold tens of MB
FIX = "fix or remove it"
FIX_TOKENIZER = "re-save it with tokenizers or transformers"
# the special tokens a template or a stop condition uses: a string, an AddedToken object or null, never a flag
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                 "eot_token")


def companion_json(directory: Path, name: str) -> dict:
    """An optional JSON file of the tokenizer dir: {} when absent, else one bounded, checked read."""
    path = inside(directory, name, fix=FIX, required=False)
    return {} if path is None else read_json_object(path, fix=FIX)


def read_tokenizer_json(directory: Path) -> tuple[Path, str] | None:
    """(path, text) of ``tokenizer.json``, checked; None when the dir has none."""
    path = inside(directory, TOKENIZER_FILE, fix=FIX_TOKENIZER, required=False)
    if path is None:
        return None
    text = read_text(path, fix=FIX_TOKENIZER, max_bytes=MAX_TOKENIZER_BYTES)
    data = parse_json(text, str(path), FIX_TOKENIZER)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise PrunusError(f"{path}: has no 'model' object; {FIX_TOKENIZER}")
    if model.get("type", "BPE" if "merges" in model else None) == "BPE":
        _check_bpe(model, path)
    return path, text


def _check_bpe(model: dict, path: Path) -> None:
    """Every merge of a BPE model joins two tokens of its vocabulary into a third, as the library assumes."""
    vocab, merges = model.get("vocab"), model.get("merges", [])
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise PrunusError(f"{path}: a BPE model needs a 'vocab' object and a 'merges' list; {FIX_TOKENIZER}")
    prefix = model.get("continuing_subword_prefix") or ""
    cut = len(prefix.encode()) if isinstance(prefix, str) else 0
    for i, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise PrunusError(f"{path}: model.merges[{i}] is {short(merge)}, not a pair of tokens; {FIX_TOKENIZER}")
        a, b = pair
        rest = b.encode()
        try:
            joined = a + rest[cut:].decode() if len(rest) >= cut else None
        except UnicodeDecodeError:
            joined = None
        for token in (a, b, joined):
            if token is None or token not in vocab:
                what = "no token" if token is None else f"{short(token)}, which is not in model.vocab"
                raise PrunusError(f"{path}: model.merges[{i}] {short(merge)} makes {what} (the vocabulary lacks tokens "
                                  f"the merges need); {FIX_TOKENIZER}")


def token_text(value, path: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it (a string or an AddedToken object), None for null
    (and for a flag such as ``add_bos_token``); anything else is one line naming the file and key."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
    elif value is None or isinstance(value, str):
        return value
    elif isinstance(value, bool) and key not in SPECIAL_NAMES:
        return None
    raise PrunusError(f"{path}: {key} is {short(value)}, which must be a token string or an AddedToken object with a "
                      f"string 'content'; {FIX}")


def read_special_tokens(directory: Path, config: dict) -> tuple[dict[str, str], dict[str, Path]]:
    """The named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ``image_token``, ...) that
    templates see, and the file each came from: tokenizer_config.json's ``*_token`` entries and its
    ``extra_special_tokens`` by name, then special_tokens_map.json's for the rest."""
    tokens: dict[str, str] = {}
    sources: dict[str, Path] = {}
    for name, source in ((TOKENIZER_CONFIG, config), (SPECIAL_TOKENS_MAP, companion_json(directory, SPECIAL_TOKENS_MAP))):
        path = directory / name
        extra = source.get("extra_special_tokens")
        if extra is not None and not isinstance(extra, (dict, list)):
            raise PrunusError(f"{path}: extra_special_tokens is {short(extra)}, which must be an object or a list; {FIX}")
        for key, value in [*source.items(), *(extra.items() if isinstance(extra, dict) else ())]:
            if isinstance(key, str) and key.endswith("_token"):
                text = token_text(value, path, key)
                if text is not None and key not in tokens:
                    tokens[key], sources[key] = text, path
    return tokens, sources


def read_chat_templates(directory: Path, config: dict) -> dict[str, str]:
    """Chat templates by name: chat_template.jinja as "default" (it wins, as in transformers), else
    tokenizer_config.json's ``chat_template`` (a string, or a list of ``{"name", "template"}``)."""
    jinja = inside(directory, CHAT_TEMPLATE_FILE, fix=FIX, required=False)
    if jinja is not None:
        return {"default": read_text(jinja, fix=FIX)}  # bounded, UTF-8: one line on any failure
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise PrunusError(f"{directory / TOKENIZER_CONFIG}: chat_template must be a string or a list of "
                      "{\"name\", \"template\"} objects")
