"""Validation loss and bits per byte on a token stream.

Bits per byte = total negative log-likelihood in bits / UTF-8 bytes of the
predicted tokens, so models with different tokenizers compare fairly. The model
may be a module or any ``tokens -> logits`` callable (an ONNX Runtime session, say).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .batches import eval_batches


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, token_bytes: torch.Tensor, *, seq_len: int, batch_size: int = 8,
             max_tokens: int | None = None, device: str | torch.device = "cpu", score=None) -> dict:
    """{"val_loss": nats per token, "val_bpb": bits per byte, "val_tokens": tokens scored}.

    ``model`` is a module or a ``tokens -> logits`` callable. ``score``, when given,
    replaces it: ``(tokens, targets) -> summed nll`` (a pipeline, say)."""
    seq_len = min(seq_len, len(tokens) - 1)
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    nll, n_tok, n_bytes = 0.0, 0, 0
    for x, y in eval_batches(tokens, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens):
        if score is not None:
            nll += score(x.to(device), y.to(device))
        else:
            logits = model(x.to(device))
            nll += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        n_tok += y.numel()
        n_bytes += int(token_bytes[y].sum())
    if was_training:
        model.train()
    return {"val_loss": nll / n_tok, "val_bpb": nll / math.log(2) / max(n_bytes, 1), "val_tokens": n_tok}


def unigram_bits_per_byte(train: np.ndarray, val: np.ndarray, token_bytes: torch.Tensor) -> float:
    """The order-0 baseline: val scored by train's token frequencies (add-one smoothed), in bits per byte."""
    vocab = len(token_bytes)
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    val_ids = np.asarray(val, dtype=np.int64)
    bits = -logp[val_ids].sum()
    return float(bits / max(int(token_bytes[torch.from_numpy(val_ids)].sum()), 1))


def evaluate_model_dir(path, *, data=None, seq_len: int | None = None, max_tokens: int | None = 262144,
                       batch_size: int = 8, max_corpus_bytes: int | None = 16 << 20, record: bool = True) -> dict:
    """Evaluate a model dir on a corpus (default: the built-in one) and, with ``record``, store the figures in its manifest."""
    from prunus.models import PrunusError, load_model, load_model_tokenizer, update_manifest_metrics

    from .corpus import load_corpus

    model = load_model(path)
    tokenizer = load_model_tokenizer(path)
    limit = model.config.max_seq_len
    seq_len = seq_len or limit
    if seq_len > limit:
        raise PrunusError(f"--seq-len {seq_len} is above the model's max_seq_len {limit}; lower it")
    corpus = load_corpus(data, tokenizer, max_bytes=max_corpus_bytes, vocab_size=model.config.vocab_size)
    token_bytes = tokenizer.token_bytes()
    result = evaluate(model, corpus.val, token_bytes, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens)
    result["unigram_bpb"] = unigram_bits_per_byte(corpus.train, corpus.val, token_bytes)
    result["eval_corpus"] = corpus.name
    if record:
        update_manifest_metrics(path, result)
    return result
