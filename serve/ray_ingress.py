"""The ingress of ``prunus serve --replicas N``: the ASGI app Ray Serve's HTTP proxy calls, which hands each
request to a replica through a deployment handle (so the request router sees its prompt, which an HTTP request
streamed by the proxy does not carry) and relays the replica's answer.

* Every route but ``GET /metrics`` goes to a replica as a :class:`Parcel` (method, path, headers, body): the
  replica runs the one-process server's own FastAPI app on it (:mod:`prunus.serve.ray_deployment`), its guards
  included (Host, Origin, API key, sizes), and streams back the ASGI messages. A streamed answer
  (``text/event-stream``) is relayed as it comes; any other is relayed whole once complete.
* ``GET /metrics`` (behind the same door: Host, Origin, API key) is every replica's registry, each sample labelled
  ``replica`` (:mod:`prunus.serve.ray_metrics`).
* A replica that dies or fails under a request: an answer not begun is 503 with one line (``code: replica_failed``
  in OpenAI's shape, ``{"error": ...}`` on the Open Inference Protocol); a ``GET`` / ``HEAD`` (idempotent) is
  first retried once; a stream already begun ends with an error event and ``data: [DONE]``.
* A request whose ``model`` names a LoRA adapter (``--lora NAME=DIR``) goes through Ray Serve's model
  multiplexing: to a replica that has it loaded if one has, else one loads it first (at most
  ``--adapters-per-replica`` on a replica, the least recently used unloaded).
* A client that leaves cancels its request on the replica (Ray cancels the handle's call; the replica's app sees
  the disconnect and frees the engine's rows).
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field

from starlette.datastructures import Headers

from .asgi_guard import MAX_BODY_BYTES, ClientGone, read_body
from .http_guard import BadRequest
from .http_server import BODY_TIMEOUT_S
from .http_access import ServeAccess
from .metrics import CONTENT_TYPE

IDEMPOTENT = ("GET", "HEAD")
REPLICA_CALL = "forward"


@dataclass(frozen=True)
class Parcel:
    """One HTTP request as the ingress read it: what a replica needs to run its app on it."""

    method: str
    path: str
    query_string: bytes
    headers: list
    body: bytes
    client: tuple | None = None
    scheme: str = "http"
    http_version: str = "1.1"

    @classmethod
    def of(cls, scope, body: bytes) -> "Parcel":
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), list(scope.get("headers", [])),
                   body, tuple(scope["client"]) if scope.get("client") else None, scope.get("scheme", "http"),
                   scope.get("http_version", "1.1"))

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": self.http_version,
                "method": self.method, "scheme": self.scheme, "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": self.headers, "client": self.client,
                "server": None, "state": {}}


@dataclass(frozen=True)
class IngressSettings:
    """What the ingress needs: the door (for /metrics), the proxy's address, the error shape, the body limit."""

    access: ServeAccess = field(default_factory=ServeAccess)
    address: tuple = ("127.0.0.1", 8000)
    oip: bool = False  # the Open Inference Protocol's error shape
    max_body_bytes: int = MAX_BODY_BYTES
    board: str = ""  # the metrics board actor's name (prunus.serve.ray_metrics)
    adapters: tuple = ()  # LoRA adapter names: a request naming one goes where it is loaded (multiplexing)


class ReplicaFailed(Exception):
    """The replica serving a request stopped or failed before the answer was complete."""


def error_body(settings: IngressSettings, status: int, message: str, code: str) -> bytes:
    if settings.oip:
        return json.dumps({"error": message}).encode()
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


async def send_error(send, settings: IngressSettings, status: int, message: str, code: str, headers=()) -> None:
    body = error_body(settings, status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class IngressApp:
    """The ASGI app of the module docstring. ``replicas``: a handle to the replica deployment; ``board``: the
    metrics board's actor handle."""

    def __init__(self, replicas, settings: IngressSettings, board):
        self.replicas, self.settings, self.board = replicas, settings, board

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            return await self.metrics(scope, send)
        headers = Headers(scope=scope)
        try:  # the one server's body reader: Content-Length or chunked (411), its limit (413), its deadline (408)
            sends_body = scope["method"] == "POST" or "content-length" in headers or "transfer-encoding" in headers
            body = await read_body(receive, headers, BODY_TIMEOUT_S, self.settings.max_body_bytes) if sends_body else b""
        except ClientGone:
            return
        except BadRequest as e:
            return await send_error(send, self.settings, e.status, str(e), e.code or "bad_request",
                                    [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()])
        parcel = Parcel.of(scope, body)
        for attempt in range(2 if parcel.method in IDEMPOTENT else 1):
            try:
                return await self.relay(parcel, receive, send)
            except ReplicaFailed as e:
                failure = e
        print(f"prunus serve: {parcel.method} {parcel.path[:80]}: {failure}", file=sys.stderr, flush=True)
        await send_error(send, self.settings, 503, f"the replica serving this request stopped ({failure}); retry it",
                         "replica_failed", [(b"retry-after", b"1")])

    async def metrics(self, scope, send) -> None:
        from .ray_metrics import merge

        refusal = self.settings.access.refusal("GET", "/metrics", Headers(scope=scope), self.settings.address)
        if refusal is not None:
            status, message, code = refusal
            return await send_error(send, self.settings, status, message, code,
                                    [(b"www-authenticate", b"Bearer")] if status == 401 else [])
        body = merge(await self.board.fresh.remote())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def relay(self, parcel: Parcel, receive, send) -> None:
        """One try on a replica; ReplicaFailed when it fails before its answer began."""
        adapter = _named_model(parcel.body) if self.settings.adapters else None
        how = {"multiplexed_model_id": adapter} if adapter in self.settings.adapters else {}
        stream = self.replicas.options(stream=True, **how).forward.remote(parcel)
        watch = asyncio.ensure_future(_on_disconnect(receive, stream))
        try:
            messages = aiter(stream)
            start = await _next(messages)
            if start is None:
                raise ReplicaFailed("it sent no answer")
            if _streamed(start):
                return await _relay_stream(start, messages, send, watch)
            body = []
            while (m := await _next(messages)) is not None:
                body.append(m.get("body", b""))
                if not m.get("more_body"):
                    break
            await send(start)
            await send({"type": "http.response.body", "body": b"".join(body)})
        finally:
            watch.cancel()


async def _next(messages):
    """The replica's next ASGI message, None at the end; ReplicaFailed for any failure of the replica's side."""
    try:
        return await anext(messages)
    except StopAsyncIteration:
        return None
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the actor died, was unreachable, or its call failed
        raise ReplicaFailed(f"{type(e).__name__}: {' '.join(str(e).split())[:160]}") from None


def _named_model(body: bytes) -> str | None:
    """The ``model`` a JSON body names, if any."""
    try:
        model = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None


def _streamed(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))


async def _relay_stream(start: dict, messages, send, watch) -> None:
    """A streamed answer as it comes; a failure after it began ends it with an error event and ``[DONE]`` (unless
    the client left: ``watch`` is done)."""
    await send(start)
    try:
        while (m := await _next(messages)) is not None:
            await send(m)
            if not m.get("more_body"):
                return  # complete: the client may close now, which is no failure
    except ReplicaFailed as e:
        if watch.done():
            return
        print(f"prunus serve: a stream was cut: {e}", file=sys.stderr, flush=True)
        error = {"error": {"message": f"the replica serving this stream stopped ({e})", "type": "server_error",
                           "code": "replica_failed"}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode(),
                    "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _on_disconnect(receive, stream) -> None:
    """Cancel the replica's call when the client leaves."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.cancel()


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
