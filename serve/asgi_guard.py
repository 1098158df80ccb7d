"""The HTTP server's request-level guards, an ASGI middleware in front of the FastAPI app (:class:`RequestGuard`).

In order, before any route sees a request:

1. the door (:mod:`prunus.serve.http_access`): ``Host``, ``Origin`` and the API key (403 / 401); CORS headers on
   every answer to an allowed origin, and its ``OPTIONS`` preflight answered 204 (any other ``OPTIONS`` 405);
2. a method HTTP does not define: 501;
3. on a route that takes a body (``POST``): ``Content-Type: application/json`` (415), a ``Content-Length``
   (411) of at most :data:`MAX_BODY_BYTES` (413), the body within ``body_timeout`` seconds (408), and JSON that
   :func:`prunus.serve.http_guard.parse_json_body` accepts (400). The route then reads the same bytes.

A client that goes away while its body is read is one log line (``went away``), as it is when it leaves
before its answer is written (:func:`log_client`). Every POST's status is counted in the metrics, with its
latency (to the end of the answer, a stream included) when it is 200.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from starlette.datastructures import Headers

from .http_access import ServeAccess, is_json_content_type
from .http_guard import BadRequest, parse_json_body

MAX_BODY_BYTES = 1 << 20
HTTP_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"}


class ClientGone(Exception):
    """The client closed its connection before its answer was written."""


def log_client(scope, what: str = "went away") -> None:
    """One line for a client that reset, closed early or stopped reading: not the server's fault."""
    host, port = (scope.get("client") or ("?", ""))[:2]
    print(f"prunus serve: client {host}:{port} {what}", file=sys.stderr, flush=True)


async def answer(send, error: BadRequest, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive, headers: Headers, timeout: float, limit: int = MAX_BODY_BYTES,
                    too_big: str | None = None) -> bytes:
    """The request's body, at most ``limit`` bytes (413, ``too_big`` its message), within ``timeout`` seconds (408);
    BadRequest or ClientGone otherwise."""
    length = headers.get("content-length")
    if length is None and "chunked" not in headers.get("transfer-encoding", "").lower():
        raise BadRequest(411, "send the body with a valid Content-Length header", headers={"Connection": "close"})
    over = BadRequest(413, too_big or f"the request body is larger than {limit} bytes", headers={"Connection": "close"})
    if length is not None and not length.isdigit():
        raise BadRequest(400, f"Content-Length {length[:40]!r} is not a number", headers={"Connection": "close"})
    if length is not None and int(length) > limit:
        raise over
    try:
        return await asyncio.wait_for(_receive_body(receive, limit, over), timeout)  # asyncio.timeout: Python 3.11
    except asyncio.TimeoutError:
        raise BadRequest(408, f"the request body did not arrive within {timeout:g} s", "timeout_error",
                         headers={"Connection": "close"}) from None


async def _receive_body(receive, limit: int, over: BadRequest) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise over
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """A receive that gives ``body`` once, then the connection's own messages (its disconnect)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return receive_again


class RequestGuard:
    """The middleware of the module docstring. ``server`` has ``access``, ``server_address``, ``body_timeout``,
    ``metrics`` and ``error_body(error)``; ``takes_body(path)`` says which POST paths are routes."""

    def __init__(self, app, server, takes_body: Callable[[str], bool]):
        self.app, self.server, self.takes_body = app, server, takes_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, method = Headers(scope=scope), scope["method"]
        access: ServeAccess = self.server.access
        cors = access.cors_headers(headers.get("origin"))
        counted = method == "POST"
        t0, status = time.perf_counter(), {"code": 500}

        async def send_out(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": list(message.get("headers", [])) +
                           [(k.lower().encode(), v.encode()) for k, v in cors.items()]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and counted:
                ok = status["code"] == 200
                self.server.metrics.observe(status["code"], time.perf_counter() - t0 if ok else None)
        try:
            receive = await self._admit(scope, headers, receive, send_out)
        except BadRequest as e:
            counted = True
            await answer(send_out, e, self.server.error_body(e))
            return
        except ClientGone:
            self.server.metrics.observe(499)
            log_client(scope)
            return
        if receive is not None:
            await self.app(scope, receive, send_out)

    async def _admit(self, scope, headers: Headers, receive, send):
        """The receive the route reads its body from; None when the request was answered here (a preflight)."""
        method, path = scope["method"], scope["path"]
        refusal = self.server.access.refusal(method, path, headers, self.server.server_address)
        if refusal is not None:
            status, message, code = refusal
            raise BadRequest(status, message, code=code, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
        if method not in HTTP_METHODS:
            raise BadRequest(501, f"method {method[:20]!r} is not supported; use GET or POST")
        if method == "OPTIONS":
            return await self._preflight(headers, send)
        if method != "POST" or not self.takes_body(path):
            return receive
        if not is_json_content_type(headers.get("content-type")):
            raise BadRequest(415, f"POST bodies must be JSON sent with 'Content-Type: application/json', not "
                                  f"{(headers.get('content-type') or 'none')[:80]!r}", code="unsupported_media_type")
        body = await read_body(receive, headers, self.server.body_timeout)
        parse_json_body(body)  # what no route should see: deep nesting, lone surrogates, 65-bit integers, NaN
        return replay(body, receive)

    async def _preflight(self, headers: Headers, send):
        origin = headers.get("origin")
        if not (self.server.access.cors_headers(origin) and headers.get("access-control-request-method")):
            raise BadRequest(405, "method OPTIONS is not allowed; use GET or POST", headers={"Allow": "GET, POST"})
        extra = {k: v for k, v in self.server.access.preflight_headers(origin).items()
                 if k not in self.server.access.cors_headers(origin)}  # send adds those
        await send({"type": "http.response.start", "status": 204,
                    "headers": [(k.lower().encode(), v.encode()) for k, v in extra.items()]})
        await send({"type": "http.response.body", "body": b""})
        return None
