"""What /v1/completions and /v1/chat/completions share: a request's fields as engine settings, its samples
submitted (``n`` per prompt, each an independent row), and their events gathered on the server's event loop.

* ``model`` must be one of the served names (404 ``model_not_found``);
* a prompt whose tokens plus ``max_tokens`` exceed the context is 400 ``context_length_exceeded``;
* sample ``j`` of a prompt with ``seed`` s draws with seed ``s + j``; without a seed each draws its own;
* a client that leaves before its answer cancels every row it holds (:func:`collect`), as one that leaves a
  stream does (the routes' ``finally``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prunus.artifacts.errors import PrunusError

from .asgi_guard import ClientGone, log_client
from .events import async_events
from .http_guard import BadRequest
from .integer_keys import token_id
from .logits_processors import MAX_LOGIT_BIAS, LogitsSettings, TokenLogprob
from .openai_schema import Sampling
from .request import GenerationResult, Request, SamplingParams, StreamToken


@dataclass
class Choice:
    """One sample's answer as its events come: every token made (a stop token included), text, log-probabilities."""

    index: int
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, event) -> None:
        if isinstance(event, StreamToken):
            self.token_ids.append(event.id)
            self.text += event.text
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
        elif isinstance(event, GenerationResult):
            self.text, self.finish_reason = event.text, event.finish_reason


def check_model(server, name: str | None) -> str:
    """The name the answer carries: the one asked for, or the first served name."""
    if name is None:
        return server.model_names[0]
    if name not in server.model_names and name not in server.engine.adapter_names():
        raise BadRequest(404, f"the model {name[:100]!r} does not exist; this server serves "
                              f"{', '.join(server.model_names)} (GET /v1/models)", "invalid_request_error",
                         param="model", code="model_not_found")
    return name


def check_context(engine, n_prompt: int, max_tokens: int, field_name: str) -> None:
    if n_prompt + max_tokens > engine.max_len:
        raise BadRequest(400, f"prompt ({n_prompt} tokens) + {field_name} ({max_tokens}) exceeds the context of "
                              f"{engine.max_len} tokens; shorten the prompt or lower {field_name}",
                         param=field_name, code="context_length_exceeded")


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: keys by :func:`prunus.serve.integer_keys.token_id`, biases
    from -100 to 100 (OpenAI's range)."""
    if bias and len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(400, f"'logit_bias' holds {len(bias)} tokens; give at most {MAX_LOGIT_BIAS}",
                         param="logit_bias")
    out = []
    for key, value in (bias or {}).items():
        token = token_id(key, "logit_bias", vocab_size)
        if not -100 <= value <= 100:
            raise BadRequest(400, f"'logit_bias' of token {token} is {value!r}; give a number from -100 to 100",
                             param="logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def constraint(req: Sampling) -> tuple[str, object, str] | None:
    """(kind, schema or regex, the field that asked) of the one structured-output field ``req`` sets, if any."""
    asked = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise BadRequest(400, "'response_format' of type 'json_schema' needs 'json_schema': {\"name\", "
                                  "\"schema\"}", param="response_format")
        schema = fmt.json_schema.schema_
        asked.append(("json_schema", schema, "response_format") if schema is not None
                     else ("json_object", None, "response_format"))
    elif fmt is not None and fmt.type == "json_object":
        asked.append(("json_object", None, "response_format"))
    if req.guided_json is not None:
        asked.append(("json_schema", req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        asked.append(("regex", req.guided_regex, "guided_regex"))
    if len(asked) > 1:
        raise BadRequest(400, f"give one of {', '.join(repr(a[2]) for a in asked)}, not several",
                         param=asked[1][2])
    if asked and req.min_tokens:  # the grammar may end before min_tokens, where no token would be left to sample
        raise BadRequest(400, f"'min_tokens' cannot be combined with {asked[0][2]!r}; leave one out",
                         param="min_tokens")
    return asked[0] if asked else None


async def compile_grammar(server, asked: tuple[str, object, str] | None, receive=None):
    """The compiled grammar of :func:`constraint`'s answer (bounded, in a worker process, cached; stopped when
    ``receive`` reports the client gone), or one line naming its field: 400, 429 when the compile queue is full."""
    if asked is None:
        return None
    from .structured_output import compile_request
    what, value, field_name = asked
    engine = server.engine
    try:
        return await compile_request(engine.tokenizer, engine.backend.vocab_size, what, value, field_name, receive)
    except PrunusError as e:
        status = getattr(e, "status", 400)
        kind = {429: "rate_limit_error", 503: "server_error"}.get(status, "invalid_request_error")
        raise BadRequest(status, str(e), kind, param=field_name, headers={"Retry-After": "1"} if status != 400 else None) from None


def sampling_params(req: Sampling, defaults: dict, max_tokens: int, logprobs: int | None, grammar=None,
                    vocab_size: int | None = None, adapters=()) -> SamplingParams:
    """The request's one parse: its sampling fields (those it leaves out take ``defaults``), ``max_tokens``,
    logprobs, grammar, extra stop tokens and, where ``model`` names one of ``adapters``, the LoRA adapter it runs
    with (``logit_bias`` keys below ``vocab_size``); :meth:`prunus.serve.engine.Engine.submit` checks the rest once (400 on a value out of range)."""
    def pick(name, fallback=None):
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)
    if req.min_tokens > max_tokens:
        raise BadRequest(400, f"'min_tokens' ({req.min_tokens}) exceeds the tokens asked for ({max_tokens}); lower "
                              "it", param="min_tokens")
    logits = LogitsSettings(presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                            repetition_penalty=pick("repetition_penalty", 1.0),
                            logit_bias=_logit_bias(req.logit_bias, vocab_size), min_tokens=req.min_tokens, logprobs=logprobs,
                            grammar=grammar)
    uses = logits.changes_logits or logprobs is not None
    top_k = pick("top_k")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    model = getattr(req, "model", None)
    return SamplingParams(max_tokens, pick("temperature", 1.0), 0 if top_k == -1 else top_k, pick("top_p"), req.seed,
                          stop, False, logits if uses else None, tuple(req.stop_token_ids or ()),
                          model if model is not None and model in adapters else None)


def submit(engine, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Request]:
    """``n`` rows per prompt, prompt-major (sample ``j`` seeded ``seed + j``); on any refusal (a full queue: 429)
    the rows already queued are cancelled."""
    requests = []
    try:
        for ids in prompts:
            for j in range(n):
                seed = params.seed
                if seed is not None and j:
                    seed = seed + j if seed + j < 2**64 else seed - j
                requests.append(engine.submit(ids, params=dataclasses.replace(params, seed=seed)))
    except BaseException:
        for r in requests:
            r.cancelled.set()
        raise
    return requests


async def merged(server, requests: list[Request]) -> AsyncIterator[tuple[int, object]]:
    """(row index, event) of every row as they come, until each has ended; an engine error is raised."""
    if len(requests) == 1:
        async for event in async_events(requests[0]):
            if isinstance(event, BaseException):
                raise event
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, r: Request) -> None:
        async for event in async_events(r):
            queue.put_nowait((i, event))
    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        left = len(requests)
        while left:
            i, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            yield i, event
            left -= isinstance(event, GenerationResult)
    finally:
        for t in tasks:
            t.cancel()


def cancel(requests: list[Request]) -> None:
    """Every row of an answer freed at the next step (no-op for finished ones): run after a stream, even one
    whose client left before its first chunk."""
    for r in requests:
        r.cancelled.set()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(server, requests: list[Request], receive) -> list[Choice]:
    """Every row's whole answer; ClientGone (its rows cancelled) if the client leaves first."""
    choices = [Choice(i, len(r.prompt_ids)) for i, r in enumerate(requests)]

    async def run() -> None:
        async for i, event in merged(server, requests):
            choices[i].add(event)
    work, gone = asyncio.ensure_future(run()), asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            work.result()
            return choices
        raise ClientGone
    finally:
        work.cancel()
        gone.cancel()
        for r in requests:
            r.cancelled.set()  # frees the rows of a client gone (no-op for finished ones)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def sse_stream(server, requests: list[Request], base: dict, scope, *, head=(), token_chunk, finish_chunk,
                     usage_chunk=None) -> AsyncIterator[bytes]:
    """The body of a streamed answer, completions and chat alike: the ``head`` chunks, then for each event of
    the merged requests ``token_chunk(i, token)`` (None: nothing to send) or ``finish_chunk(i, result)``, then
    ``usage_chunk(completion_tokens)`` where asked, then ``[DONE]``. An engine failure mid-stream is sent as an
    error chunk; whatever ends the stream cancels its rows, and a client that left is one log line."""
    made, finished = [0] * len(requests), False
    try:
        for c in head:
            yield c
        async for i, event in merged(server, requests):
            if isinstance(event, StreamToken):
                made[i] += 1
                c = token_chunk(i, event)
                if c is not None:
                    yield c
            elif isinstance(event, GenerationResult):
                yield finish_chunk(i, event)
        if usage_chunk is not None:
            yield usage_chunk(sum(made))
        finished = True
    except (PrunusError, RuntimeError) as e:  # an engine failure or a shutdown mid-stream: sent
        yield sse({**base, "error": {"message": str(e)[:300], "type": "server_error", "param": None,
                                   "code": getattr(e, "code", None)}})
        finished = True
    finally:
        for r in requests:
            r.cancelled.set()  # a client gone mid-stream frees its rows at the next step
        if not finished:
            log_client(scope)
    yield DONE
