"""The OpenAI-compatible FastAPI app over a generative Engine (built by :class:`prunus.serve.http_server.CompletionServer`).

* ``GET /health``: the engine's settings and load; ``GET /metrics``: Prometheus (:mod:`prunus.serve.metrics`);
* ``GET /v1/models``, ``GET /v1/models/{id}``: the served names (``--served-model-name``, several allowed);
* ``POST /v1/completions``: ``prompt`` (a string, a list of strings, token ids or lists of them), ``n`` samples
  each, streamed or not, ``echo``, ``logprobs`` (an integer: alternatives per token; with ``echo`` the
  prompt's own too, :mod:`prunus.serve.prompt_logprobs`);
* ``POST /v1/chat/completions``: :mod:`prunus.serve.chat_api`;
* ``GET /docs``: the OpenAPI page (``/openapi.json`` the schema).

Requests are pydantic models (:mod:`prunus.serve.openai_schema`); errors are OpenAI's shape
(:mod:`prunus.serve.openai_errors`); the guards in front are :mod:`prunus.serve.asgi_guard` and
:mod:`prunus.serve.http_connection`.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from . import chat_api, embeddings, lora_routes, openai_errors
from .asgi_guard import ClientGone, RequestGuard, log_client
from .http_guard import BadRequest
from .logprobs import completion_logprobs, joined
from .openai_generate import Choice, sse_stream, cancel, check_context, check_model, collect, compile_grammar, \
    constraint, sampling_params, sse, submit, usage
from .openai_schema import ChatCompletionRequest, CompletionRequest
from .prompt_logprobs import prompt_logprobs
from .request import StreamToken

DEFAULT_MAX_TOKENS = 16  # OpenAI's, for /v1/completions
EVENT_STREAM = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
POST_ROUTES = ("/v1/completions", chat_api.CHAT_PATH, *lora_routes.ROUTES, embeddings.PATH)


def build_app(server) -> FastAPI:
    from prunus import __version__

    app = FastAPI(title="prunus serve", version=__version__, docs_url="/docs", redoc_url=None,
                  description="OpenAI-compatible completions and chat completions over a prunus Engine.")
    openai_errors.install(app)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone):
        log_client(request.scope)
        return Response(status_code=499)

    @app.get("/health")
    async def health():
        s = server.engine.scheduler
        return {"status": "ok", **server.engine.info, "queue_depth": s.queue_depth, "active": s.n_active}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=None, headers={"Content-Type": server.metrics_type})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(server, name) for name in server.model_names]
                + lora_routes.adapter_cards(server)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        name = check_model(server, model_id)
        return next((c for c in lora_routes.adapter_cards(server) if c["id"] == name), None) or model_card(server, name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await complete(server, body, request)

    @app.post(chat_api.CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat_api.chat(server, body, request)

    lora_routes.install(app, server)
    embeddings.install(app, server)

    app.add_middleware(RequestGuard, server=server, takes_body=lambda path: path in POST_ROUTES)
    return app


def model_card(server, name: str) -> dict:
    return {"id": name, "object": "model", "created": server.started, "owned_by": "prunus",
            "root": server.model_names[0], "max_model_len": server.engine.max_len}


def _prompts(prompt) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise BadRequest(400, "'prompt' must be a string or a non-empty list of strings (or of token ids)",
                         param="prompt")
    return list(prompt)


def _refusals(req: CompletionRequest) -> None:
    """Fields whose other values prunus cannot honour: one 400 each, never accepted and ignored."""
    if req.suffix is not None:
        raise BadRequest(400, "'suffix' (insertion) is not supported; leave it out", param="suffix")
    if req.best_of not in (None, req.n):
        raise BadRequest(400, "'best_of' other than 'n' is not supported; ask for n samples instead", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise BadRequest(400, "'stream_options' needs 'stream': true", param="stream_options")


async def complete(server, req: CompletionRequest, request: Request):
    engine = server.engine
    name = check_model(server, req.model)
    _refusals(req)
    given = _prompts(req.prompt)
    loop = asyncio.get_running_loop()
    prompts = await loop.run_in_executor(server.pool, lambda: [engine.encode(p) for p in given])
    max_tokens = req.max_tokens or DEFAULT_MAX_TOKENS
    for ids in prompts:
        check_context(engine, len(ids), max_tokens, "max_tokens")
    grammar = await compile_grammar(server, constraint(req), request.receive)
    params = sampling_params(req, server.defaults, max_tokens, req.logprobs, grammar, engine.backend.vocab_size,
                             engine.adapter_names())
    echoed = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in given] if req.echo else None
    echo_logprobs = None
    if req.echo and req.logprobs is not None:  # the prompts' own, by a teacher-forced pass (off the event loop)
        echo_logprobs = await loop.run_in_executor(server.pool, lambda: [completion_logprobs(
            engine.tokenizer, ids, prompt_logprobs(engine, ids, req.logprobs)) for ids in prompts])
    requests = submit(engine, prompts, params, req.n)
    base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        echo = (echoed, echo_logprobs)
        return StreamingResponse(_stream(server, requests, base, req, echo, include_usage, request.scope),
                                 headers=EVENT_STREAM,
                                 background=BackgroundTask(cancel, requests))
    choices = await collect(server, requests, request.receive)
    out = [_choice(engine.tokenizer, c, req, echoed[c.index // req.n] if echoed else "",
                   echo_logprobs[c.index // req.n] if echo_logprobs else None) for c in choices]
    n_prompt = sum(len(p) for p in prompts)
    return JSONResponse({**base, "choices": out, "usage": usage(n_prompt, sum(len(c.token_ids) for c in choices))})


def _choice(tokenizer, c: Choice, req: CompletionRequest, prefix: str, prefix_logprobs: dict | None) -> dict:
    logprobs = None
    if req.logprobs is not None:
        logprobs = joined(prefix_logprobs, completion_logprobs(tokenizer, c.token_ids, c.logprobs))
    return {"index": c.index, "text": prefix + c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}


def _stream(server, requests, base, req: CompletionRequest, echo, include_usage: bool, scope):
    tokenizer, (echoed, echo_logprobs) = server.engine.tokenizer, echo

    def chunk(i, text, finish_reason=None, logprobs=None) -> bytes:
        return sse({**base, "choices": [{"index": i, "text": text, "finish_reason": finish_reason,
                                         "logprobs": logprobs}]})

    def token(i, event: StreamToken):
        logprobs = None if event.logprob is None else completion_logprobs(tokenizer, [event.id], [event.logprob])
        return chunk(i, event.text, logprobs=logprobs) if event.text or logprobs else None

    def tail(made: int) -> bytes:
        n_prompt = sum(len(r.prompt_ids) for r in requests[::req.n])
        return sse({**base, "choices": [], "usage": usage(n_prompt, made)})
    head = [chunk(i, echoed[i // req.n], logprobs=echo_logprobs[i // req.n] if echo_logprobs else None)
            for i in range(len(requests) if echoed else 0)]
    return sse_stream(server, requests, base, scope, head=head, token_chunk=token,
                      finish_chunk=lambda i, result: chunk(i, "", result.finish_reason),
                      usage_chunk=tail if include_usage else None)
