"""English prose that ships with Python: the Language Reference as plain text.

``pydoc_data.topics`` is the text ``help("TOPIC")`` prints: the chapters of the
Python Language Reference (exceptions, the execution model, the data model, every
statement...) rendered from the documentation sources as plain English text, about
465 KB in Python 3.11. It is in every CPython install (pydoc needs it), so it needs
no download, and it holds the same bytes for a given Python version. Unlike the
standard library's ``.py`` sources (the built-in corpus, what the demo models train
on) it is prose, which is what a pretrained chat model reads and writes; a few
grammar productions and short code examples are part of it, as in any technical text.

Split: topics in the order of a hash of their name; held-out topics are taken from
the front until they hold at least ``VAL_SHARE`` of the bytes (about 116 KB, ~30k
tokens of a 49k-token BPE vocabulary), the rest is the training / calibration split.
"""

from __future__ import annotations

import hashlib

import numpy as np

PROSE = "prose"
VAL_SHARE = 0.25


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big")


def prose_documents() -> tuple[list[bytes], list[bytes]]:
    """(training documents, held-out documents) as UTF-8 bytes, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [topics[name].encode("utf-8") for name in sorted(topics, key=_hash)]
    total, held = sum(map(len, docs)), 0
    n_val = 0
    while n_val < len(docs) and held < VAL_SHARE * total:
        held += len(docs[n_val])
        n_val += 1
    return docs[n_val:], docs[:n_val]


def tokenize_documents(docs: list[bytes], tokenizer) -> np.ndarray:
    """Documents tokenized and joined with the tokenizer's end-of-text token when it has one."""
    eos = getattr(tokenizer, "eos_id", None)
    parts = []
    for d in docs:
        parts.append(np.asarray(tokenizer.encode_array(d), dtype=np.int64))
        if eos is not None:
            parts.append(np.asarray([eos], dtype=np.int64))
    dtype = np.uint16 if tokenizer.n_vocab <= 65536 else np.uint32
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
