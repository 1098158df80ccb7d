"""Corpora as token streams: the built-in one (this Python's standard library), text, or pre-tokenized binaries.

* ``"prose"``: English prose that ships with Python, the Language Reference as
  plain text (``data/prose.py``); what evaluation uses by default for a model with
  a pretrained (non-byte) tokenizer, see :func:`default_data`.
* ``None`` / ``"builtin"``: the standard library's ``.py`` sources. Files are
  ordered and split into train and validation by a hash of their relative
  path, so the split is the same on every machine with the same Python version;
  ``max_bytes`` caps the training split (files are taken in hash order).
* a text file: its last ``val_fraction`` of bytes is validation.
* a directory of text files: split by a hash of each file's relative path.
* a ``.bin`` file of uint16 token ids (memory-mapped): its last
  ``val_fraction`` of tokens is validation; or a directory holding ``train.bin``
  and ``val.bin`` (and optionally ``corpus.json``, ``{"name": ...}``: the corpus those
  tokens came from, shown instead of the directory's path).

Documents are joined with the tokenizer's end-of-text token when it has one. Text reaches the tokenizer
bounded: a line over 4 MiB (:data:`prunus.data.bounded_lines.MAX_LINE_BYTES`) is refused by file and line.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object

from .bounded_lines import check_line_lengths
from .prose import PROSE, prose_documents, tokenize_documents

BUILTIN = "builtin"
DEFAULT_MAX_BYTES = 16 << 20
VAL_FRACTION = 0.05


@dataclass
class Corpus:
    name: str
    train: np.ndarray  # 1-D token ids (uint16 / uint32; possibly a memmap)
    val: np.ndarray
    train_bytes: int | None = None  # text bytes behind the streams, when known
    val_bytes: int | None = None


def _path_hash(rel: str) -> float:
    """A deterministic number in [0, 1) from a relative path."""
    return int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big") / 2**64


def _split_files(root: Path, files: list[Path], max_bytes: int | None, val_fraction: float):
    """(train_paths, val_paths): a file is validation when its path hash is below ``val_fraction``.

    ``max_bytes`` caps the training split only (files taken in hash order), so
    every run on a corpus is scored on the same validation files."""
    keyed = sorted((_path_hash(f.relative_to(root).as_posix()), f) for f in files)
    train, val, size = [], [], 0
    for h, f in keyed:
        if h < val_fraction:
            val.append(f)
            continue
        n = f.stat().st_size
        if max_bytes is not None and size + n > max_bytes:
            continue
        size += n
        train.append(f)
    return train, val


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return root, files


def _tokenize_docs(paths: list[Path], tokenizer) -> tuple[np.ndarray, int]:
    parts, n_bytes = [], 0
    eos = getattr(tokenizer, "eos_id", None)
    sep = None if eos is None else np.asarray([eos], dtype=np.uint32)
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError as e:
            raise PrunusError(f"data path {p}: cannot be read ({e.strerror}); fix its permissions or remove it") from None
        n_bytes += len(data)
        check_line_lengths(data, f"data path {p}")
        parts.append(tokenizer.encode_array(data))
        if sep is not None:
            parts.append(sep)
    if not parts:
        return np.zeros(0, dtype=np.uint16), 0
    dtype = np.uint16 if tokenizer.n_vocab <= 65536 else np.uint32
    return np.concatenate(parts).astype(dtype), n_bytes


def regular_file(path: Path, what: str = "data path") -> os.stat_result:
    """``path``'s stat when it is (or links to) a regular file; else one PrunusError line naming it.
    A FIFO, socket or device would hang or never end a read; a dangling link or a link loop has nothing."""
    try:
        st = os.stat(path)
    except OSError as e:
        kind = "a symlink loop" if e.errno == errno.ELOOP else ("a dangling symlink" if path.is_symlink() else e.strerror)
        raise PrunusError(f"{what} {path}: {kind}; remove it or fix the link") from None
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise PrunusError(f"{what} {path}: {kind}, not a regular file; remove it from the data or give regular files")
    return st


def _text_files(root: Path) -> list[Path]:
    """The regular files under ``root`` (hidden ones skipped); anything else there is refused by name."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_walk_error):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith("."):
                path = Path(dirpath, f)
                if stat.S_ISDIR(regular_file(path).st_mode):  # a link to a directory: not followed
                    continue
                files.append(path)
    return files


def _walk_error(e: OSError) -> None:
    raise PrunusError(f"data path {e.filename}: cannot be read ({e.strerror}); fix its permissions or remove it")


def _memmap(path: Path, vocab_size: int | None) -> np.ndarray:
    size = regular_file(path).st_size
    if size == 0:
        raise PrunusError(f"{path}: holds no tokens (an empty file); write uint16 token ids into it")
    if size % 2:
        raise PrunusError(f"{path}: size is not a whole number of uint16 tokens; write token ids as uint16")
    arr = np.memmap(path, dtype=np.uint16, mode="r")
    if vocab_size is not None and arr.size and int(arr.max()) >= vocab_size:
        raise PrunusError(f"{path}: holds token id {int(arr.max())} >= the model's vocab_size {vocab_size}; use a matching tokenizer or model")
    return arr


def default_data(data: str | Path | None, tokenizer) -> str | Path | None:
    """The corpus evaluation and compression use when none is given: English prose for a model
    with a pretrained (non-byte) tokenizer, the built-in corpus (what the demo models train on) otherwise."""
    if data is not None:
        return data
    return PROSE if tokenizer.spec().get("kind") != "byte" else None


def _prose_corpus(tokenizer, max_bytes: int | None) -> Corpus:
    train_docs, val_docs = prose_documents()
    kept, size = [], 0
    for d in train_docs:
        if max_bytes is not None and size + len(d) > max_bytes:
            break
        kept.append(d)
        size += len(d)
    name = f"prose (Python {'.'.join(map(str, __import__('sys').version_info[:2]))} Language Reference, pydoc_data)"
    return Corpus(name, tokenize_documents(kept, tokenizer), tokenize_documents(val_docs, tokenizer),
                  size, sum(map(len, val_docs)))


def _token_dir_name(path: Path) -> str:
    """The name a token dir's ``corpus.json`` gives (written by whoever tokenized it), else its path."""
    if not (path / "corpus.json").is_file():
        return str(path)
    name = read_json_object(path / "corpus.json", fix="remove it or write {\"name\": ...}").get("name")
    return name if isinstance(name, str) and name else str(path)


def load_corpus(data: str | Path | None, tokenizer, *, max_bytes: int | None = DEFAULT_MAX_BYTES,
                val_fraction: float = VAL_FRACTION, vocab_size: int | None = None) -> Corpus:
    """Token streams for ``data`` (see the module docstring). Raises PrunusError on unusable input."""
    if data is None or str(data) == BUILTIN:
        root, files = stdlib_files()
        train_p, val_p = _split_files(root, files, max_bytes, val_fraction)
        train, nt = _tokenize_docs(train_p, tokenizer)
        val, nv = _tokenize_docs(val_p, tokenizer)
        corpus = Corpus(f"builtin (Python {'.'.join(map(str, __import__('sys').version_info[:2]))} stdlib)", train, val, nt, nv)
    elif str(data) == PROSE:
        corpus = _prose_corpus(tokenizer, max_bytes)
    else:
        path = Path(data)
        if not path.exists() and not path.is_symlink():
            raise PrunusError(f"data path {path}: does not exist; give a text file, a directory of text files or a .bin token file")
        regular_file(path)
        if not os.access(path, os.R_OK):
            raise PrunusError(f"data path {path}: not readable; fix its permissions")
        if path.is_dir() and (path / "train.bin").is_file():
            train = _memmap(path / "train.bin", vocab_size)
            if (path / "val.bin").is_file():
                val = _memmap(path / "val.bin", vocab_size)
            else:
                n_val = int(len(train) * val_fraction)
                train, val = train[: len(train) - n_val], train[len(train) - n_val :]
            corpus = Corpus(_token_dir_name(path), train, val)
        elif path.is_file() and path.suffix == ".bin":
            tokens = _memmap(path, vocab_size)
            n_val = int(len(tokens) * val_fraction)
            corpus = Corpus(str(path), tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :])
        elif path.is_file():
            try:
                data_bytes = path.read_bytes()
            except OSError as e:
                raise PrunusError(f"data path {path}: cannot be read ({e.strerror}); fix the path or its permissions") from None
            check_line_lengths(data_bytes, f"data path {path}")
            cut = len(data_bytes) - int(len(data_bytes) * val_fraction)
            train_bytes = data_bytes[: min(cut, max_bytes or cut)]
            corpus = Corpus(str(path), tokenizer.encode_array(train_bytes), tokenizer.encode_array(data_bytes[cut:]),
                            len(train_bytes), len(data_bytes) - cut)
        else:
            root = path
            train_p, val_p = _split_files(root, _text_files(root), max_bytes, val_fraction)
            if train_p and not val_p:  # too few files for the hash split: hold out the last one
                train_p, val_p = train_p[:-1], train_p[-1:]
            train, nt = _tokenize_docs(train_p, tokenizer)
            val, nv = _tokenize_docs(val_p, tokenizer)
            corpus = Corpus(str(path), train, val, nt, nv)
    if len(corpus.train) < 2 or len(corpus.val) < 2:
        raise PrunusError(f"data {corpus.name}: the corpus is empty (train {len(corpus.train)} tokens, validation {len(corpus.val)}); give a larger corpus")
    if vocab_size is not None and tokenizer.n_vocab > vocab_size:
        raise PrunusError(f"tokenizer has {tokenizer.n_vocab} tokens but the model's vocab_size is {vocab_size}; use a model with a larger vocabulary")
    return corpus
