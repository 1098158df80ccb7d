"""``prunus eval``: score a model dir on held-out text and record the figures in its manifest.

The scoring itself (windows, bits per byte, the default held-out slice) is
:mod:`prunus.data.evaluate`; this file reads the model dir and its tokenizer, loads the
corpus, and writes the result into ``prunus.json``.
"""

from __future__ import annotations

from prunus.artifacts.errors import PrunusError
from prunus.models import load_model, load_model_tokenizer, update_manifest_metrics

from .corpus import default_data, load_corpus
from .evaluate import DEFAULT_EVAL_TOKENS, default_seq_len, evaluate, unigram_bits_per_byte


def evaluate_model_dir(path, *, data=None, seq_len: int | None = None, max_tokens: int | None = DEFAULT_EVAL_TOKENS,
                       batch_size: int | None = None, max_corpus_bytes: int | None = 16 << 20, record: bool = True,
                       device: str = "cpu") -> dict:
    """Evaluate a model dir on a corpus (default: :func:`~prunus.data.corpus.default_data`) on ``device`` and,
    with ``record``, store the figures in its manifest."""
    model = load_model(path, device=device)
    tokenizer = load_model_tokenizer(path)
    limit = model.config.max_seq_len
    seq_len = default_seq_len(limit) if seq_len is None else seq_len
    if seq_len > limit:
        raise PrunusError(f"--seq-len {seq_len} is above the model's max_seq_len {limit}; lower it")
    if seq_len < 1:
        raise PrunusError(f"--seq-len {seq_len} must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        raise PrunusError(f"--max-tokens {max_tokens} must be at least 1")
    corpus = load_corpus(default_data(data, tokenizer), tokenizer, max_bytes=max_corpus_bytes,
                         vocab_size=model.config.vocab_size)
    token_bytes = tokenizer.token_bytes()
    result = evaluate(model, corpus.val, token_bytes, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens,
                      device=device)
    result["unigram_bpb"] = unigram_bits_per_byte(corpus.train, corpus.val, token_bytes)
    result["eval_corpus"] = corpus.name
    if record:
        update_manifest_metrics(path, result)
    return result
