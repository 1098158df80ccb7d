"""OpenAI-compatible ``POST /v1/chat/completions``: a conversation in, the assistant's answers out.

The request's ``messages`` are rendered with the model's chat template (as transformers'
``apply_chat_template`` does, with the assistant's turn opened; in the bounded sandbox of
:mod:`prunus.models.template_sandbox`, off the event loop) and generated like any prompt, ending at the
model's end-of-turn / end-of-text tokens, ``stop`` strings, ``stop_token_ids`` or ``max_tokens`` /
``max_completion_tokens`` (default: the rest of the context). The fields are
:class:`prunus.serve.openai_schema.ChatCompletionRequest`'s.

* Not streamed: one ``chat.completion`` object, ``choices[i].message = {"role": "assistant", "content": ...}``,
  ``finish_reason`` "stop" or "length", ``logprobs`` when asked, and ``usage``, whose ``completion_tokens``
  counts every token made, the end-of-turn token included (as transformers' ``generate`` returns it).
* Streamed: server-sent ``chat.completion.chunk`` events whose ``choices[0].delta`` carries first the role,
  then pieces of content; the last names the ``finish_reason``; with ``stream_options.include_usage`` one more
  chunk holds ``usage`` and no choices; then ``data: [DONE]``.

Malformed messages, a role outside OpenAI's (system, developer, user, assistant, tool, function), no chat
template, or a template that fails to render: 400, one line. The fields OpenAI's clients may send by default
(``store``, ``metadata``, ``service_tier``, ...) are taken where their value asks for nothing prunus cannot do,
else one 400 naming the field (:data:`prunus.serve.openai_schema.SDK_FIELDS`).

``tools`` / ``tool_choice``: :mod:`prunus.serve.tool_calls` (not streamed: ``stream`` with tools is one 400).
Structured outputs (``response_format``, ``guided_json``, ``guided_regex``): :mod:`prunus.serve.structured_output`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from .http_guard import BadRequest
from .logprobs import chat_logprobs
from .openai_generate import Choice, sse_stream, cancel, check_context, check_model, collect, compile_grammar, \
    constraint, sampling_params, sse, submit, usage
from .openai_schema import OPENAI_ROLES, SDK_FIELDS, ChatCompletionRequest
from .tool_calls import call_schema, check_tools, parse_tool_calls, template_messages
from .request import StreamToken

CHAT_PATH = "/v1/chat/completions"
EVENT_STREAM = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _max_tokens(req: ChatCompletionRequest) -> int | None:
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise BadRequest(400, "give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
    return req.max_tokens if req.max_tokens is not None else req.max_completion_tokens


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise BadRequest(400, "'stream_options' needs 'stream': true", param="stream_options")
    return (req.top_logprobs or 0) if req.logprobs else None


def _sdk_fields(req: ChatCompletionRequest) -> None:
    """The OpenAI client's fields whose value prunus cannot honour: one 400 each, never accepted and ignored."""
    for name, (taken, what_to_do) in SDK_FIELDS.items():
        value = getattr(req, name)
        if value is not None and value not in taken:
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise BadRequest(400, f"'{name}': {shown} is not supported: {what_to_do}", param=name)


def _messages(req: ChatCompletionRequest) -> list:
    """The messages as the chat template reads them, each role one of OpenAI's."""
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if role not in OPENAI_ROLES:
            shown = repr(role if not isinstance(role, str) or len(role) <= 24 else role[:24] + "...")
            raise BadRequest(400, f"messages[{i}].role {shown} is not a role; give one of {', '.join(OPENAI_ROLES)}",
                             param="messages")
    return template_messages(req.messages)


def _tools(req: ChatCompletionRequest) -> tuple[list[dict], str, tuple | None]:
    """The tools, the choice, and the structured-output constraint (a forced call's, or the request's own)."""
    tools, choice = check_tools(req.tools, req.tool_choice)
    if tools and req.stream:
        raise BadRequest(400, "'tools' cannot be streamed yet; leave out 'stream' (the calls come parsed in one "
                              "answer)", param="tools")
    asked = constraint(req)
    if choice in ("none", "auto"):
        return tools, choice, asked
    if asked is not None:
        raise BadRequest(400, f"give {asked[2]!r} or a forcing 'tool_choice', not both", param="tool_choice")
    return tools, choice, ("tool_call", call_schema(tools, choice), "tool_choice")


def _prompt(engine, messages: list, tools: list[dict]) -> str:
    if not tools:
        return engine.chat_prompt(messages)
    from prunus.models.chat_template import reads_variable
    source = getattr(engine.tokenizer, "chat_template", None)
    if source is None or not reads_variable(source, "tools"):
        raise BadRequest(400, "this model's chat template does not take tools (it never reads 'tools'); leave out "
                              "'tools' or serve a model whose template supports them", param="tools")
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)


async def chat(server, req: ChatCompletionRequest, request: Request):
    engine = server.engine
    name = check_model(server, req.model)
    _sdk_fields(req)
    max_tokens, top = _max_tokens(req), _top_logprobs(req)
    tools, choice, asked = _tools(req)
    messages = _messages(req)
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(server.pool, lambda: engine.encode(_prompt(engine, messages, tools)))
    field = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    if max_tokens is None:
        max_tokens = engine.max_len - len(ids)
        if max_tokens < 1:
            check_context(engine, len(ids), 1, field)
    check_context(engine, len(ids), max_tokens, field)
    grammar = await compile_grammar(server, asked, request.receive)
    requests = submit(engine, [ids], sampling_params(req, server.defaults, max_tokens, top, grammar,
                                                     engine.backend.vocab_size, engine.adapter_names()), req.n)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(server, requests, base, include_usage, request.scope), headers=EVENT_STREAM,
                                 background=BackgroundTask(cancel, requests))
    choices = await collect(server, requests, request.receive)
    one_call = req.parallel_tool_calls is False
    out = [_choice(engine.tokenizer, c, top is not None, parse=choice != "none", one_call=one_call) for c in choices]
    return JSONResponse({**base, "object": "chat.completion", "choices": out,
                         "usage": usage(len(ids), sum(len(c.token_ids) for c in choices))})


def _choice(tokenizer, c: Choice, with_logprobs: bool, parse: bool, one_call: bool = False) -> dict:
    """One choice of a whole answer; ``one_call`` (``parallel_tool_calls: false``): its first tool call only."""
    message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
    calls = parse_tool_calls(c.text) if parse else None
    if calls is not None:
        message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1][:1] if one_call else calls[1]}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"index": c.index, "message": message,
            "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs) if with_logprobs else None,
            "finish_reason": finish_reason}


def _stream(server, requests, base: dict, include_usage: bool, scope):
    base = {**base, "object": "chat.completion.chunk"}
    tokenizer = server.engine.tokenizer

    def chunk(i: int, delta: dict, finish_reason=None, logprobs=None) -> bytes:
        return sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]})

    def token(i, event: StreamToken):
        logprobs = None if event.logprob is None else chat_logprobs(tokenizer, [event.id], [event.logprob])
        return chunk(i, {"content": event.text}, logprobs=logprobs) if event.text or logprobs else None

    def tail(made: int) -> bytes:
        return sse({**base, "choices": [], "usage": usage(len(requests[0].prompt_ids), made)})
    return sse_stream(server, requests, base, scope, head=[chunk(i, {"role": "assistant", "content": ""})
                                                          for i in range(len(requests))],
                      token_chunk=token, finish_chunk=lambda i, result: chunk(i, {}, result.finish_reason),
                      usage_chunk=tail if include_usage else None)
