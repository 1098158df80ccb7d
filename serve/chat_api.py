"""OpenAI-compatible ``POST /v1/chat/completions``: a conversation in, the assistant's answer out.

The request's ``messages`` are rendered with the model's chat template (as transformers'
``apply_chat_template`` does, with the assistant's turn opened) and generated like any
prompt, ending at the model's end-of-turn / end-of-text tokens, a ``stop`` string or
``max_tokens`` (default: the rest of the context). Fields: ``messages``, ``max_tokens``
(or ``max_completion_tokens``), ``temperature`` (1.0), ``top_p``, ``top_k`` (an extension),
``seed``, ``stop``, ``stream`` and ``stream_options.include_usage``.

* Not streamed: one ``chat.completion`` object, ``choices[0].message = {"role": "assistant",
  "content": ...}``, ``finish_reason`` "stop" or "length", and ``usage``.
* Streamed: server-sent ``chat.completion.chunk`` events whose ``choices[0].delta`` carries
  first the role, then pieces of content; the last names the ``finish_reason``; with
  ``include_usage`` one more chunk holds ``usage`` and no choices; then ``data: [DONE]``.

Bad input (malformed messages, no chat template, a template that fails to render, an
unsupported field) raises :class:`PrunusError`, which the HTTP server answers with 400
and ``{"error": {"message", "type": "invalid_request_error"}}``.
"""

from __future__ import annotations

import json
import time
import uuid

from prunus.artifacts.errors import PrunusError

from .events import events
from .http_guard import start_event_stream
from .request import GenerationResult

CHAT_PATH = "/v1/chat/completions"
CHAT_FIELDS = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stream", "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logprobs"}


def parse_chat(body: bytes) -> tuple[list, dict, bool, bool]:
    """(messages, engine keyword arguments, stream, include_usage) from a request body, or PrunusError."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PrunusError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(req, dict):
        raise PrunusError("the request body must be a JSON object")
    unknown = sorted(set(req) - CHAT_FIELDS)
    if unknown:
        raise PrunusError(f"unknown or unsupported field(s): {', '.join(unknown)}")
    if req.get("n", 1) != 1:
        raise PrunusError("'n' other than 1 is not supported; send the request again")
    for name in ("presence_penalty", "frequency_penalty"):
        if req.get(name) not in (None, 0, 0.0):
            raise PrunusError(f"'{name}' is not supported; leave it out or set it to 0")
    if req.get("logprobs") not in (None, False):
        raise PrunusError("'logprobs' is not supported")
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise PrunusError("'stream' must be true or false")
    options = req.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise PrunusError("'stream_options' must be an object like {\"include_usage\": true}")
    stop = req.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise PrunusError("'stop' must be a string or a list of strings")
    if req.get("max_tokens") is not None and req.get("max_completion_tokens") is not None:
        raise PrunusError("give 'max_tokens' or 'max_completion_tokens', not both")
    max_tokens = req.get("max_tokens", req.get("max_completion_tokens"))
    kwargs = {"max_new_tokens": max_tokens, "temperature": req.get("temperature", 1.0), "top_p": req.get("top_p"),
              "top_k": req.get("top_k"), "seed": req.get("seed"), "stop": stop}
    return req.get("messages"), kwargs, stream, bool(options.get("include_usage", False))


def submit_chat(engine, messages, kwargs: dict):
    """The conversation rendered, tokenised and queued on ``engine``; max_new_tokens defaults to the
    rest of the context."""
    ids = engine.encode(engine.chat_prompt(messages))
    if kwargs["max_new_tokens"] is None:
        kwargs = {**kwargs, "max_new_tokens": max(engine.max_len - len(ids), 1)}
    return engine.submit(ids, **kwargs)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def handle_chat(handler, body: bytes) -> int:
    """Answer one chat-completions request on ``handler`` (the HTTP server's request handler); the HTTP status."""
    messages, kwargs, stream, include_usage = parse_chat(body)
    request = submit_chat(handler.server.engine, messages, kwargs)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": handler.server.model_name}
    if stream:
        return _stream(handler, request, base, include_usage)
    try:
        result = handler._wait(request)  # notices a client that goes away
    except BaseException:
        request.cancelled.set()  # frees its batch row at the next step
        raise
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
              "finish_reason": result.finish_reason}
    handler._json(200, {**base, "object": "chat.completion", "choices": [choice],
                        "usage": usage(result.prompt_tokens, len(result.token_ids))})
    return 200


def _stream(handler, request, base: dict, include_usage: bool) -> int:
    base = {**base, "object": "chat.completion.chunk"}

    def send(obj) -> None:
        handler.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        handler.wfile.flush()

    def chunk(delta: dict, finish_reason=None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    try:
        start_event_stream(handler)
        send(chunk({"role": "assistant", "content": ""}))
        for event in events(request):
            if isinstance(event, BaseException):
                send({**base, "error": {"message": str(event), "type": "server_error"}})
            elif isinstance(event, GenerationResult):
                send(chunk({}, event.finish_reason))
                if include_usage:
                    send({**base, "choices": [], "usage": usage(event.prompt_tokens, len(event.token_ids))})
            elif event.text:
                send(chunk({"content": event.text}))
        handler.wfile.write(b"data: [DONE]\n\n")
        handler.wfile.flush()
    finally:
        request.cancelled.set()  # a client gone mid-stream frees its row at the next step
    return 200
