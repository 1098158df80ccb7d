"""Autoregressive generation with a KV cache: prefill the prompt once, then one token per step.

Sampling: temperature (0, or anything up to MIN_TEMPERATURE, is greedy), top-k and nucleus (top-p). The serving
engine and the compression and export reports (greedy-token agreement) build on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from prunus.artifacts.errors import PrunusError
from .kv_cache import KVCache


def greedy_next(logits: torch.Tensor) -> torch.Tensor:
    """logits (batch, vocab) -> the index of each row's largest logit (the first on a tie), (batch,).

    On a CPU float32 tensor numpy's argmax runs it, many times faster than torch's over a large vocabulary
    (docs/defaults.md).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(dim=-1)


# below this temperature sampling is greedy: logits / t would leave float32's range and the
# distribution is the argmax's to within rounding anyway
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (batch, vocab) -> next token ids (batch,).

    Any settings give a distribution: temperatures up to MIN_TEMPERATURE are greedy, larger ones are
    capped at MAX_TEMPERATURE, the logits are shifted so that the division stays finite, and top-p
    always keeps the most likely token (a top_p of 1e-300 is 0 in float32)."""
    if not temperature > MIN_TEMPERATURE:
        return greedy_next(logits)
    logits = logits.float()
    temperature = min(float(temperature), MAX_TEMPERATURE)  # beyond it: uniform, and -inf / inf would be NaN
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature  # <= 0, never NaN
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False  # and the most likely token, whatever top_p is
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def stream_tokens(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                  eos_id: int | Iterable[int] | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every sequence, (batch,), up to ``max_new_tokens`` times.

    ``prompt`` is (batch, prompt_len) token ids. ``eos_id``: one stop token or several (a
    tokenizer's ``stop_ids``: end of text and end of turn). Stops early when every sequence
    has produced one; a finished sequence repeats its stop token.
    """
    stops = None if eos_id is None else torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id)).view(-1)
    if stops is not None and stops.numel() == 0:
        stops = None
    if prompt.ndim == 1:
        prompt = prompt.unsqueeze(0)
    if prompt.shape[1] == 0:
        raise PrunusError("generate: the prompt is empty; give at least one token of prompt")
    total = prompt.shape[1] + max_new_tokens
    limit = model.config.max_seq_len
    if total > limit:
        raise PrunusError(
            f"generate: prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq_len {limit}; shorten the prompt or lower --max-new-tokens"
        )
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache.for_model(model, prompt.shape[0], max_len=total)
    logits = model(prompt.to(device), cache=cache)[:, -1]
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    last = None
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if stops is not None:
            nxt = nxt if last is None else torch.where(done, last, nxt)
            done |= torch.isin(nxt, stops.to(nxt.device))
            last = nxt
        yield nxt
        if i + 1 == max_new_tokens or (stops is not None and bool(done.all())):
            return
        logits = model(nxt[:, None], cache=cache)[:, -1]


def generate(model, prompt: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """(batch, prompt_len) -> (batch, prompt_len + generated) token ids."""
    if prompt.ndim == 1:
        prompt = prompt.unsqueeze(0)
    new = list(stream_tokens(model, prompt, max_new_tokens, **kwargs))
    if not new:
        return prompt
    return torch.cat([prompt.to(new[0].device), torch.stack(new, dim=1)], dim=1)
