"""Tokenizers: byte-level by default, or a Hugging Face ``tokenizer.json`` from a local directory.

Both expose ``encode``, ``decode``, ``eos_id``, ``n_vocab``, ``spec()`` (what
config.json records) and ``token_bytes()`` (UTF-8 bytes per token id, used to
turn a loss in nats per token into bits per byte).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from .errors import PrunusError

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """Raw UTF-8 bytes are the tokens 0..255; 256 is end-of-text."""

    eos_id = 256
    n_vocab = 257

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


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) loaded from a local directory."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise PrunusError(f"{directory}: no {TOKENIZER_FILE}; give a directory holding a Hugging Face fast tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise PrunusError("Hugging Face tokenizers need the 'hf' extra: pip install 'prunus[hf]'") from None
        self.path = path
        self._tok = Tokenizer.from_file(str(path))
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(directory)

    def _find_eos(self, directory: Path) -> int | None:
        names = []
        cfg = directory / "tokenizer_config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text()).get("eos_token")
            names.append(eos.get("content") if isinstance(eos, dict) else eos)
        names += ["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"]
        for name in names:
            if name and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        return None

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
        shutil.copyfile(self.path, Path(directory) / TOKENIZER_FILE)
        cfg = self.path.parent / "tokenizer_config.json"
        if cfg.is_file():
            shutil.copyfile(cfg, Path(directory) / "tokenizer_config.json")


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
