"""Validation loss and bits per byte on a token stream, in bounded windows and bounded memory.

Bits per byte = total negative log-likelihood in bits / UTF-8 bytes of the
predicted tokens, so models with different tokenizers compare fairly. The model
may be a module or any ``tokens -> logits`` callable (an ONNX Runtime session, say).

Every scorer of prunus (``prunus eval``, the compression report, export parity) calls
:func:`evaluate` with the same defaults, so they score the same held-out slice: the
first ``DEFAULT_EVAL_TOKENS`` tokens of the validation split, in consecutive windows of
``default_seq_len(max_seq_len)`` tokens (at most ``MAX_WINDOW``).

Memory stays bounded whatever the context and vocabulary: a batch holds at most
``ROW_TOKENS`` tokens, and for a prunus Transformer the output head (and its final logit
soft-capping, when the family has one) runs on chunks of positions (``LOGITS_BYTES`` of float32 logits at a time) on the final hidden states, so
a window's logits are never all in memory. A callable (or a model whose logits are not
``model.output(hidden)``: checked once per call on a few positions) gets whole windows,
with the rows per batch cut so one batch's logits stay within ``CALLABLE_LOGITS_BYTES``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .batches import eval_batches

DEFAULT_EVAL_TOKENS = 4096  # held-out tokens scored by default (eval, compress report, export parity)
MAX_WINDOW = 1024  # default window: min(the model's max_seq_len, this)
ROW_TOKENS = 4096  # tokens per forward pass (rows x window)
LOGITS_BYTES = 64 << 20  # float32 logits computed at once from hidden states
CALLABLE_LOGITS_BYTES = 512 << 20  # a callable's whole-window logits per batch
_CHECK_POSITIONS = 8


def default_seq_len(max_seq_len: int) -> int:
    """The evaluation window for a model of context ``max_seq_len``."""
    return min(int(max_seq_len), MAX_WINDOW)


class _Hidden(Exception):
    """Carries the output head's input out of the forward pass (so the head never runs on all of it)."""

    def __init__(self, h: torch.Tensor):
        self.h = h


def final_hidden(model, x: torch.Tensor) -> torch.Tensor:
    """The input of ``model.output`` (the normed final hidden states) for tokens ``x``."""
    def stop(module, args):
        raise _Hidden(args[0])

    handle = model.output.register_forward_pre_hook(stop)
    try:
        model(x)
    except _Hidden as e:
        return e.h
    finally:
        handle.remove()
    raise RuntimeError("the model's forward pass did not reach its output head")


def chunked_nll(head, h: torch.Tensor, y: torch.Tensor, vocab: int) -> float:
    """Summed cross-entropy of ``head(h)`` against ``y``, over chunks of positions."""
    h, y = h.flatten(0, -2), y.flatten()
    step = max(1, LOGITS_BYTES // (4 * vocab))
    total = 0.0
    for i in range(0, h.shape[0], step):
        total += F.cross_entropy(head(h[i:i + step]).float(), y[i:i + step], reduction="sum").item()
    return total


def output_head(model):
    """``hidden -> logits``: the model's output head, with its final logit soft-capping when it has one."""
    cap = getattr(getattr(model, "config", None), "final_softcap", None)
    if cap is None:
        return model.output
    return lambda h: torch.tanh(model.output(h) / cap) * cap


def output_head_is_last(model, x: torch.Tensor) -> bool:
    """True when ``model`` is a module whose logits are ``output_head(model)(final hidden)`` (checked on a few positions)."""
    if not isinstance(model, torch.nn.Module) or not isinstance(getattr(model, "output", None), torch.nn.Module):
        return False
    probe = x[:1, :_CHECK_POSITIONS]
    try:
        via_head = output_head(model)(final_hidden(model, probe)).float()
    except RuntimeError:
        return False
    full = model(probe).float()
    return full.shape == via_head.shape and torch.allclose(full, via_head, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, token_bytes: torch.Tensor, *, seq_len: int, batch_size: int | None = None,
             max_tokens: int | None = DEFAULT_EVAL_TOKENS, device: str | torch.device = "cpu", score=None) -> dict:
    """{"val_loss": nats per token, "val_bpb": bits per byte, "val_tokens": tokens scored, "seq_len": window}.

    ``model`` is a module or a ``tokens -> logits`` callable. ``score``, when given,
    replaces it: ``(tokens, targets) -> summed nll`` (a pipeline, say). ``batch_size``
    (rows per forward) defaults to what keeps memory bounded (module docstring);
    ``max_tokens`` None scores the whole stream."""
    seq_len = min(seq_len, len(tokens) - 1)
    vocab = len(token_bytes)
    chunked = None  # decided on the first batch
    if batch_size is None:
        batch_size = max(1, ROW_TOKENS // seq_len)
    was_training = getattr(model, "training", False)
    if was_training:
        model.eval()
    nll, n_tok, n_bytes = 0.0, 0, 0
    try:
        for x, y in eval_batches(tokens, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens):
            x, y = x.to(device), y.to(device)
            if score is not None:
                nll += score(x, y)
            else:
                if chunked is None:
                    chunked = output_head_is_last(model, x)
                if chunked:
                    nll += chunked_nll(output_head(model), final_hidden(model, x), y, vocab)
                else:
                    rows = max(1, CALLABLE_LOGITS_BYTES // (4 * vocab * seq_len))
                    for i in range(0, x.shape[0], rows):
                        logits = model(x[i:i + rows])
                        nll += F.cross_entropy(logits.float().flatten(0, 1), y[i:i + rows].flatten(), reduction="sum").item()
                        del logits
            n_tok += y.numel()
            n_bytes += int(token_bytes[y.cpu()].sum())
    finally:
        if was_training:
            model.train()
    return {"val_loss": nll / n_tok, "val_bpb": nll / math.log(2) / max(n_bytes, 1), "val_tokens": n_tok,
            "seq_len": seq_len}


def unigram_bits_per_byte(train: np.ndarray, val: np.ndarray, token_bytes: torch.Tensor) -> float:
    """The order-0 baseline: val scored by train's token frequencies (add-one smoothed), in bits per byte."""
    vocab = len(token_bytes)
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    val_ids = np.asarray(val, dtype=np.int64)
    bits = -logp[val_ids].sum()
    return float(bits / max(int(token_bytes[torch.from_numpy(val_ids)].sum()), 1))
