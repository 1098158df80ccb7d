"""The prompt's own log-probabilities (``echo`` with ``logprobs`` on /v1/completions), by a teacher-forced pass.

One forward pass of the whole prompt without a cache gives, at each position, the model's log-softmax over the
next token: the entry of prompt token ``i`` is row ``i - 1`` at that token (the first token has none, ``null``
as OpenAI writes it), with the ``top`` likeliest alternatives. These are the model's raw log-probabilities:
no bias or penalty applies to a prompt. It runs where the backend declares it computes a prompt's logits
(``capabilities.prompt_logits``: the torch backend in one process); the others (tensor-parallel workers, ONNX
Runtime, TensorRT, native) refuse it in one 400.
"""

from __future__ import annotations

import torch

from .http_guard import BadRequest
from .logits_processors import TokenLogprob
from .runtime_words import runtime_words


def prompt_logprobs(engine, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """One entry per prompt token (None for the first)."""
    backend = engine.backend
    if not backend.capabilities.prompt_logits:
        raise BadRequest(400, f"'echo' with 'logprobs' needs the prompt's log-probabilities, which "
                              f"{runtime_words(engine.info)} does not compute here; serve a model dir on the torch "
                              "backend without --tp, or leave out one of them", param="echo")
    with torch.inference_mode():
        logits = backend.prompt_logits(ids)[:-1].float()
    rows = torch.log_softmax(logits, dim=-1).cpu()
    out: list[TokenLogprob | None] = [None]
    chosen = rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    tops = torch.topk(rows, top, dim=-1) if top else None
    for i, value in enumerate(chosen):
        alternatives = tuple(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else ()
        out.append(TokenLogprob(value, alternatives))
    return out
