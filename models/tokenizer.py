"""Tokenizers: byte-level by default, or a Hugging Face tokenizer from a local directory.

Both expose ``encode``, ``decode``, ``eos_id``, ``stop_ids`` (every token that ends a
generation), ``n_vocab``, ``spec()`` (what config.json records), ``token_bytes()`` (UTF-8
bytes per token id, used to turn a loss in nats per token into bits per byte),
``chat_template`` and ``apply_chat_template(messages)``.

A Hugging Face tokenizer is ``tokenizer.json`` (vocabulary, merges, added and special
tokens) with what transformers reads beside it: ``tokenizer_config.json`` (named special
tokens, the chat template as a string or a list of named templates), ``chat_template.jinja``
(where transformers 5 saves the template; it wins over the config's), ``special_tokens_map.json``
and ``generation_config.json`` (its ``eos_token_id``, one id or a list, adds stop tokens).
``save`` copies all of them, so a model dir carries everything a Hugging Face user loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from .chat_template import render_chat
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object
from .generation_settings import GENERATION_CONFIG, GenerationSettings

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# the files a Hugging Face tokenizer dir may hold, carried through every prunus stage
HF_TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE, GENERATION_CONFIG)
FALLBACK_EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


class ByteTokenizer:
    """Raw UTF-8 bytes are the tokens 0..255; 256 is end-of-text."""

    eos_id = 256
    stop_ids = (256,)
    n_vocab = 257
    chat_template = None

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    def encode_array(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> torch.Tensor:
        lengths = torch.zeros(self.n_vocab, dtype=torch.int64)
        lengths[:256] = 1
        return lengths

    def spec(self) -> dict:
        return {"kind": "byte"}

    def save(self, directory: Path) -> None:
        pass

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        raise PrunusError("the model has no chat template (it uses the byte tokenizer); use a model converted from "
                          "a chat checkpoint, or give a plain prompt")


def _read_json(path: Path) -> dict:
    """An optional tokenizer-side JSON file: {} when absent, else one bounded, checked read."""
    return read_json_object(path, fix="fix or remove it") if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def read_special_tokens(directory: Path, config: dict) -> dict[str, str]:
    """The named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ``image_token``, ...) that
    templates see: tokenizer_config.json's ``*_token`` entries and its ``extra_special_tokens`` by name,
    then special_tokens_map.json's for the rest."""
    tokens = {}
    for source in (config, _read_json(directory / SPECIAL_TOKENS_MAP)):
        extra = source.get("extra_special_tokens")
        for key, value in [*source.items(), *(extra.items() if isinstance(extra, dict) else ())]:
            if key.endswith("_token") and key not in tokens and _token_text(value) is not None:
                tokens[key] = _token_text(value)
    return tokens


def read_chat_templates(directory: Path, config: dict) -> dict[str, str]:
    """Chat templates by name: chat_template.jinja as "default" (it wins, as in transformers), else
    tokenizer_config.json's ``chat_template`` (a string, or a list of ``{"name", "template"}``)."""
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return {"default": jinja.read_text(encoding="utf-8")}
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


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json`` and its companion files) from a local directory."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise PrunusError(f"{directory}: no {TOKENIZER_FILE}; give a directory holding a Hugging Face fast tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise PrunusError("Hugging Face tokenizers need the 'hf' extra: pip install 'prunus[hf]'") from None
        self.directory, self.path = directory, path
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions on bad files
            raise PrunusError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]}); "
                              "re-save it with tokenizers or transformers") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.n_vocab = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        config = _read_json(directory / TOKENIZER_CONFIG)
        self.special_tokens = read_special_tokens(directory, config)
        self.chat_templates = read_chat_templates(directory, config)
        self.generation = GenerationSettings.read(directory)
        self.eos_id = self._find_eos()
        eot = self.token_id("eot_token")  # an end-of-turn token the config names (as GGUF metadata does)
        stops = [i for i in (self.eos_id, eot) if i is not None] + list(self.generation.eos_token_ids)
        self.stop_ids = tuple(dict.fromkeys(stops))
        if self.eos_id is None and self.stop_ids:
            self.eos_id = self.stop_ids[0]

    def _find_eos(self) -> int | None:
        for name in (self.special_tokens.get("eos_token"), *FALLBACK_EOS):
            if name and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        return None

    def token_id(self, name: str) -> int | None:
        """The id of a named special token (``"bos_token"``, ``"pad_token"``, ...), if the vocabulary has it."""
        text = self.special_tokens.get(name)
        return None if text is None else self._tok.token_to_id(text)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``, as transformers' ``apply_chat_template(..., tokenize=False)``."""
        if self.chat_template is None:
            names = sorted(self.chat_templates)
            raise PrunusError(
                f"the chat templates are named {names}, none 'default'; name one 'default' in {TOKENIZER_CONFIG}" if names
                else f"the model has no chat template (no {CHAT_TEMPLATE_FILE}, no chat_template in {TOKENIZER_CONFIG}); "
                     "use a model converted from a chat checkpoint, or give a plain prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, data: bytes) -> np.ndarray:
        ids = self.encode(data.decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=np.uint16 if self.n_vocab <= 65536 else np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> torch.Tensor:
        return torch.tensor(
            [len(self._tok.decode([i], skip_special_tokens=True).encode("utf-8")) for i in range(self.n_vocab)],
            dtype=torch.int64,
        )

    def spec(self) -> dict:
        return {"kind": "hf", "file": TOKENIZER_FILE}

    def save(self, directory: Path) -> None:
        """Copy tokenizer.json and every companion file present (config, template, special tokens, generation)."""
        for name in HF_TOKENIZER_FILES:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, Path(directory) / name)


def check_vocab(tokenizer, vocab_size: int, where: str | Path) -> None:
    """Refuse a tokenizer whose token ids reach past the model's embedding table."""
    if tokenizer.n_vocab > vocab_size:
        raise PrunusError(f"{where}: the tokenizer has {tokenizer.n_vocab} tokens but the model's vocab_size is "
                          f"{vocab_size}; give the tokenizer the model was trained with")


def load_tokenizer(spec: dict | str | Path | None = None, base_dir: str | Path | None = None):
    """A tokenizer from a spec recorded in config.json (relative to ``base_dir``),
    a directory holding ``tokenizer.json``, or ``None`` for bytes."""
    if spec is None or spec == "byte" or (isinstance(spec, dict) and spec.get("kind") == "byte"):
        return ByteTokenizer()
    if isinstance(spec, dict):
        if spec.get("kind") != "hf":
            raise PrunusError(f"tokenizer spec {spec}: unknown kind; expected 'byte' or 'hf'")
        return HFTokenizer(Path(base_dir or "."))
    path = Path(spec)
    if not path.exists():
        raise PrunusError(f"tokenizer {path}: no such directory; give a directory holding {TOKENIZER_FILE}")
    return HFTokenizer(path if path.is_dir() else path.parent)
