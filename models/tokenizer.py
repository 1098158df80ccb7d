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
from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short
from .generation_settings import GENERATION_CONFIG, GenerationSettings
from .tokenizer_files import (CHAT_TEMPLATE_FILE, FIX_TOKENIZER, MAX_TOKENIZER_BYTES, SPECIAL_TOKENS_MAP,  # noqa: F401
                              TOKENIZER_CONFIG, TOKENIZER_FILE, companion_json, read_chat_templates,
                              read_special_tokens, read_tokenizer_json)

# the files a Hugging Face tokenizer dir may hold, carried through every prunus stage
HF_TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE, GENERATION_CONFIG)
FALLBACK_EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
PROBE = "prunus checks its tokenizer: caf\u00e9 \u2603 42 qzxv"  # encoded once at load: a tokenizer that cannot fails here


def _tokenizers_call(path: Path, what: str, fn):
    """``fn()``, with the tokenizers library's failures as one PrunusError line naming ``path``: it raises plain
    Exceptions on bad files, and a PanicException (a BaseException) where its Rust code panics."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # noqa: BLE001 (PanicException derives from BaseException)
        msg = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise PrunusError(f"{path}: {what} ({msg}); {FIX_TOKENIZER}") from None


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

    def token_text(self, token_id: int) -> str:
        """One token's own text, special ones included (``decode`` drops end-of-text)."""
        return "<|endoftext|>" if int(token_id) == self.eos_id else self.decode([token_id])

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


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json`` and its companion files) from a local directory."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        found = read_tokenizer_json(directory)  # inside the dir, a regular file, bounded, UTF-8, merges checked
        if found is None:
            raise PrunusError(f"{directory}: no {TOKENIZER_FILE}; give a directory holding a Hugging Face fast tokenizer")
        from tokenizers import Tokenizer  # a dependency of prunus; imported here, where a tokenizer.json is read
        self.directory, (self.path, text) = directory, found
        self._tok = _tokenizers_call(self.path, "not a readable tokenizer.json", lambda: Tokenizer.from_str(text))
        _tokenizers_call(self.path, "cannot encode text (its vocabulary lacks a token it needs, such as the unk "
                         "token)", lambda: self._tok.decode(self._tok.encode(PROBE, add_special_tokens=False).ids))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.n_vocab = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        config = companion_json(directory, TOKENIZER_CONFIG)
        self.special_tokens, self._special_sources = read_special_tokens(directory, config)
        self.chat_templates = read_chat_templates(directory, config)
        self.generation = GenerationSettings.read(directory)
        self.eos_id = self._find_eos()
        eot = self.token_id("eot_token")  # an end-of-turn token the config names (as GGUF metadata does)
        stops = [i for i in (self.eos_id, eot) if i is not None] + list(self.generation.eos_token_ids)
        self.stop_ids = tuple(dict.fromkeys(stops))
        if self.eos_id is None and self.stop_ids:
            self.eos_id = self.stop_ids[0]

    def _find_eos(self) -> int | None:
        """The id of the eos_token the config names (one line when the vocabulary lacks it), else of a usual name."""
        named = self.special_tokens.get("eos_token")
        if named is not None and self._tok.token_to_id(named) is None:
            raise PrunusError(f"{self._special_sources['eos_token']}: eos_token {named!r} is not a token of "
                              f"{self.path}; fix eos_token or give the tokenizer the model was trained with")
        for name in (named, *FALLBACK_EOS):
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

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``), as transformers'
        ``apply_chat_template(..., tokenize=False)``."""
        if self.chat_template is None:
            names = sorted(self.chat_templates)
            raise PrunusError(
                f"the chat templates are named {names}, none 'default'; name one 'default' in {TOKENIZER_CONFIG}" if names
                else f"the model has no chat template (no {CHAT_TEMPLATE_FILE}, no chat_template in {TOKENIZER_CONFIG}); "
                     "use a model converted from a chat checkpoint, or give a plain prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, tools=tools)

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except Exception as e:  # a vocabulary without the unk token this text needs
            raise PrunusError(f"{self.path}: cannot encode this text ({str(e).splitlines()[0][:200]}); "
                              f"{FIX_TOKENIZER}") from None

    def encode_array(self, data: bytes) -> np.ndarray:
        ids = self.encode(data.decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=np.uint16 if self.n_vocab <= 65536 else np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special ones included (``decode`` drops them: an end-of-turn token would read as
        an empty string in log-probabilities)."""
        text = self._tok.decode([int(token_id)], skip_special_tokens=False)
        return text or (self._tok.id_to_token(int(token_id)) or "")

    def token_bytes(self) -> torch.Tensor:
        return torch.tensor(
            [len(self._tok.decode([i], skip_special_tokens=True).encode("utf-8")) for i in range(self.n_vocab)],
            dtype=torch.int64,
        )

    def spec(self) -> dict:
        return {"kind": "hf", "file": TOKENIZER_FILE}

    def save(self, directory: Path) -> None:
        """Copy tokenizer.json and every companion file present (config, template, special tokens, generation),
        each a regular file inside the tokenizer's dir (never a symlink's target elsewhere)."""
        for name in HF_TOKENIZER_FILES:
            source = inside(self.directory, name, fix="fix or remove it", required=False)
            if source is not None:
                shutil.copyfile(source, Path(directory) / name)


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
    where = f"{Path(base_dir) / 'config.json'}: tokenizer" if base_dir is not None else "tokenizer spec"
    if isinstance(spec, dict):
        if spec.get("kind") != "hf":
            raise PrunusError(f"{where} {short(spec)}: unknown kind; expected 'byte' or 'hf'")
        if spec.get("file", TOKENIZER_FILE) != TOKENIZER_FILE:  # a dir's tokenizer is its own tokenizer.json, nothing else
            raise PrunusError(f"{where} names the file {short(spec.get('file'))}, not {TOKENIZER_FILE}; re-create the dir")
        return HFTokenizer(Path(base_dir or "."))
    if base_dir is not None:  # a spec read from an artifact never points at a path elsewhere
        raise PrunusError(f"{where} is {short(spec)}, which must be {{\"kind\": \"byte\"}} or {{\"kind\": \"hf\"}}; "
                          "re-create the dir")
    path = Path(spec)
    if not path.exists():
        raise PrunusError(f"tokenizer {path}: no such directory; give a directory holding {TOKENIZER_FILE}")
    return HFTokenizer(path if path.is_dir() else path.parent)
