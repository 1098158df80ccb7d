"""Embeddings: ``Engine.embed(texts, pooling=..., normalize=...)`` and ``POST /v1/embeddings`` (OpenAI's shape).

An input's embedding is the model's final hidden state (after the final norm, the output head's input) pooled over
its tokens: ``pooling="last"`` (the default: the last token's, which in a causal model has seen the whole input) or
``"mean"`` (the average over every token). ``normalize`` (default True, as OpenAI's embeddings are unit length)
divides it by its L2 norm. Inputs go through in batches of up to ``max_batch`` rows, right-padded (a causal model's
padding after a row's last token cannot change it), in one forward pass each, without the KV cache and on the
calling thread (the scheduler's requests go on), through the backend's ``final_hidden`` (a pass that stops at the
output head, :mod:`prunus.runtime.hidden_capture`). With ``adapter`` a loaded LoRA adapter applies.

A backend declares it computes them (``capabilities.embeddings``: the torch backend in one process); the others are
refused in one line.

The HTTP route takes ``input`` (a string, a list of strings, token ids or a list of them), ``model`` (the served
name or an adapter's), ``encoding_format`` ``float`` (a list of numbers) or ``base64`` (the float32 little-endian
bytes), and answers ``data`` (one ``embedding`` per input, by ``index``) and ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import torch
from pydantic import Field

from prunus.artifacts.errors import PrunusError

from .http_guard import BadRequest
from .openai_schema import MAX_NAME, Strict
from .runtime_words import runtime_words

PATH = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit per request
POOLINGS = ("last", "mean")


def _backend(engine):
    backend = engine.backend
    if not backend.capabilities.embeddings:
        raise PrunusError(f"embeddings need a runtime that computes hidden states (the torch backend in one process); "
                          f"this engine runs on {runtime_words(engine.info)}; serve the model dir with --backend torch "
                          "and no --tp")
    return backend


def check_inputs(engine, inputs) -> list[list[int]]:
    """Token ids of each input (a string or token ids), or one line naming the input that does not fit."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs or len(inputs) > MAX_INPUTS:
        raise PrunusError(f"input must be a string, token ids, or a list of 1 to {MAX_INPUTS} of them")
    out = []
    for i, item in enumerate(inputs):
        ids = engine.encode(item)
        if len(ids) > engine.max_len:
            raise PrunusError(f"input {i} has {len(ids)} tokens, more than the context of {engine.max_len}; shorten it")
        out.append(ids)
    return out


@torch.inference_mode()
def embed_ids(engine, prompts: list[list[int]], pooling: str = "last", normalize: bool = True,
              adapter: str | None = None) -> torch.Tensor:
    """(len(prompts), dim) float32 embeddings on the CPU (see the module docstring)."""
    if pooling not in POOLINGS:
        raise PrunusError(f"pooling={str(pooling)[:40]!r} must be one of {', '.join(POOLINGS)}")
    backend = _backend(engine)
    lora = engine.lora_adapter(adapter) if adapter is not None else None
    rows = max(1, backend.n_slots)
    out = []
    for start in range(0, len(prompts), rows):
        batch = prompts[start:start + rows]
        lengths = torch.tensor([len(p) for p in batch])
        tokens = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
        for i, p in enumerate(batch):
            tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        h = backend.final_hidden(tokens, lora).float().cpu()
        if pooling == "last":
            pooled = h[torch.arange(len(batch)), lengths - 1]
        else:
            valid = (torch.arange(h.shape[1])[None, :] < lengths[:, None]).float()
            pooled = (h * valid[..., None]).sum(1) / lengths[:, None].float()
        out.append(torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled)
    return torch.cat(out)


# --- HTTP --------------------------------------------------------------------------------------


class EmbeddingRequest(Strict):
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, token ids, or a list of token id lists.")
    model: str = Field(min_length=1, max_length=MAX_NAME,
                       description="A served name or a LoRA adapter's (GET /v1/models); required, as OpenAI's is.")
    encoding_format: Literal["float", "base64"] = Field("float", description="float: numbers; base64: float32 bytes.")
    dimensions: int | None = Field(None, description="Not supported (the model's width is the embedding's).")
    user: str | None = None


def _encode(vector: torch.Tensor, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def install(app, server) -> None:
    from .lora_routes import adapter_for
    from .openai_generate import check_model

    @app.post(PATH)
    async def embeddings(body: EmbeddingRequest):
        name = check_model(server, body.model)
        if body.dimensions is not None:
            raise BadRequest(400, "'dimensions' is not supported; leave it out (embeddings have the model's width)",
                             param="dimensions")
        engine = server.engine

        def run():
            prompts = check_inputs(engine, body.input)
            return prompts, embed_ids(engine, prompts, adapter=adapter_for(server, body.model))

        prompts, vectors = await asyncio.get_running_loop().run_in_executor(server.pool, run)
        n = sum(len(p) for p in prompts)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": n, "total_tokens": n}}
