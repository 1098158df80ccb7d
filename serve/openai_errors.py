"""Every error the FastAPI app answers, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

* a request that does not fit the schema (:mod:`prunus.serve.openai_schema`): 400 naming the field, ``param``
  set to it; an unknown field is refused by name (``code: unknown_field``), never dropped;
* :class:`~prunus.serve.http_guard.BadRequest`: its own status, type, param and code;
* :class:`~prunus.serve.scheduler.QueueFull`: 429 ``rate_limit_error``;
* any other :class:`PrunusError` (the engine's one-line refusals of a request): 400, with the engine's argument
  names written as the request's fields (``max_new_tokens`` is ``max_tokens``);
* an unknown route 404, a method a route does not take 405;
* anything else is the server's fault: 500 ``server_error``, one line to the client, the traceback to stderr.
"""

from __future__ import annotations

import re
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from prunus.artifacts.errors import PrunusError

from .http_guard import BadRequest, error_json
from .scheduler import QueueFull

ROUTES = "GET /health, /metrics, /v1/models or POST /v1/completions, /v1/chat/completions"


def error_response(error: BadRequest) -> Response:
    return Response(error.body(), error.status, headers=error.headers, media_type="application/json")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(errors) -> BadRequest:
    """The first schema error as one line naming its field."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    field = str(loc[0]) if loc else None
    if e.get("type") == "extra_forbidden":
        name = ".".join(map(str, loc))
        return BadRequest(400, f"unknown field '{name}': prunus serve does not support it; leave it out",
                          param=field, code="unknown_field")
    if field is None:  # the body itself (a list, a string, ...)
        return BadRequest(400, "the request body must be a JSON object")
    if e.get("type") == "missing":
        need = "give one of the names GET /v1/models lists" if loc == ["model"] else "add it"
        return BadRequest(400, f"'{'.'.join(map(str, loc))}' is required; {need}", param=field)
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:] if not _is_type_name(p))
    return BadRequest(400, f"'{field}{where}': {e.get('msg', 'invalid value')} (got {field}{where}="
                           f"{_short(e.get('input'))})", param=field)


def _is_type_name(part) -> bool:  # a union branch pydantic names in the location, e.g. "list[str]"
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def field_named(message: str) -> str | None:
    """The request field an engine refusal starts with (``logit_bias names token 7; ...`` → ``logit_bias``), as
    OpenAI's ``param``; None when the message names no field of the completions or chat request."""
    from .openai_schema import ChatCompletionRequest, CompletionRequest

    m = re.match(r"([a-z_]+)\b", message)
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return m.group(1) if m and m.group(1) in fields else None


def install(app: FastAPI, routes: str = ROUTES) -> None:
    """The handlers of the module docstring on ``app``."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        return error_response(exc)

    @app.exception_handler(QueueFull)
    async def full(request: Request, exc: QueueFull):
        return error_response(BadRequest(429, str(exc), "rate_limit_error", headers={"Retry-After": "1"}))

    @app.exception_handler(PrunusError)
    async def refused(request: Request, exc: PrunusError):
        message = str(exc).replace("max_new_tokens", "max_tokens")
        return error_response(BadRequest(400, message, param=field_named(message)))

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path[:200]}"
        if exc.status_code == 404:
            return error_response(BadRequest(404, f"no route {where}; use {routes}", "not_found_error"))
        if exc.status_code == 405:
            return error_response(BadRequest(405, f"method {request.method} is not allowed on {request.url.path[:200]}"
                                                  f"; use {routes}", headers={"Allow": "GET, POST"}))
        return error_response(BadRequest(exc.status_code, str(exc.detail)[:200]))

    @app.exception_handler(Exception)
    async def ours(request: Request, exc: Exception):
        traceback.print_exception(exc)
        return Response(error_json(f"{type(exc).__name__}: {str(exc)[:200]}", "server_error"), 500,
                        media_type="application/json")
