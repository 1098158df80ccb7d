"""Embeddings: ``Engine.embed(texts, pooling=..., normalize=...)`` and ``POST /v1/embeddings`` (OpenAI's shape).

An input's embedding is the model's final hidden state (after the final norm, the output head's input) pooled over
its tokens: ``pooling="last"`` (the default: the last token's, which in a causal model has seen the whole input) or
``"mean"`` (the average over every token). ``normalize`` (default True, as OpenAI's embeddings are unit length)
divides it by its L2 norm. Inputs go through in batches of up to ``max_batch`` rows, right-padded (a causal model's
padding after a row's last token cannot change it), in one forward pass each, without the KV cache and on the
calling thread (the scheduler's requests go on). A pass stops at the output head: a hook on the head's input keeps
the hidden state and ends the pass, so no logits are computed. With ``adapter`` a loaded LoRA adapter applies.

Only the torch backend in one process holds the model in this process; other backends refuse in one line.

The HTTP route takes ``input`` (a string, a list of strings, token ids or a list of them), ``model`` (the served
name or an adapter's), ``encoding_format`` ``float`` (a list of numbers) or ``base64`` (the float32 little-endian
bytes), and answers ``data`` (one ``embedding`` per input, by ``index``) and ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import base64
import threading
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


class _Stop(Exception):
    """Raised by the capture hook once the hidden state is kept: the pass goes no further."""


class HiddenCapture:
    """A forward pre-hook on the model's output head that, on a thread that asks for it, keeps the head's input and
    ends the pass; other threads' passes (the scheduler's) are untouched."""

    def __init__(self, model):
        self._local = threading.local()
        self.handle = model.output.register_forward_pre_hook(self._keep) if model.output is not None else None

    def _keep(self, module, args):
        if getattr(self._local, "on", False):
            self._local.h = args[0]
            raise _Stop

    def run(self, model, tokens: torch.Tensor) -> torch.Tensor:
        if self.handle is None:  # a model without a head returns its final hidden state
            return model(tokens)
        self._local.on = True
        try:
            model(tokens)
        except _Stop:
            return self._local.h
        finally:
            self._local.on = False
            self._local.h = None
        raise RuntimeError("the model's output head did not run")


def _torch_backend(engine):
    from prunus.runtime.torch import TorchBackend

    backend = engine.backend
    if not isinstance(backend, TorchBackend):
        raise PrunusError(f"embeddings need the torch backend in one process; this engine runs on "
                          f"{runtime_words(engine.info)}; serve the model dir with --backend torch and no --tp")
    if getattr(backend, "_capture", None) is None:
        backend._capture = HiddenCapture(backend.model)
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
    backend = _torch_backend(engine)
    lora = engine.lora_adapter(adapter) if adapter is not None else None
    model, rows = backend.model, max(1, backend.n_slots)
    out = []
    for start in range(0, len(prompts), rows):
        batch = prompts[start:start + rows]
        lengths = torch.tensor([len(p) for p in batch])
        tokens = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
        for i, p in enumerate(batch):
            tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        if backend.lora is not None:
            backend.lora.use(lora, len(batch))
        h = backend._capture.run(model, tokens.to(backend.device)).float().cpu()
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
