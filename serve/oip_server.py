"""The Open Inference Protocol (KServe v2, Triton's REST API) over a non-generative Engine, on FastAPI.

* ``GET /v2/health/live``, ``GET /v2/health/ready``: ``{"live": true}`` / ``{"ready": true}``;
* ``GET /v2``: the server's metadata; ``GET /v2/models/{name}``: the model's (``inputs`` / ``outputs`` with
  name, datatype and shape, ``-1`` for the batch axis); ``GET /v2/models/{name}/ready``;
* ``POST /v2/models/{name}/infer``: typed tensors in (:mod:`prunus.serve.oip_tensors`), typed tensors out,
  ``{"model_name", "id"?, "outputs": [{"name", "datatype", "shape", "data"}]}``; each request's rows join a
  pass shared with other clients (:mod:`prunus.serve.dynamic_batcher`);
* ``GET /health`` and ``GET /metrics`` as the completions server's, with the batching counters.

The completions server's guards (:mod:`prunus.serve.http_server`) hold: the door (API key, Host, Origin),
deadlines, size limits, the connection cap, a full queue → 429. Errors are the protocol's
``{"error": "one line"}``: a malformed tensor, or a value its datatype does not hold, 400 naming it; an unknown
model or route 404; an output holding NaN or infinity (which JSON cannot carry) 500 naming it; any other failure
of the server 500, one line to the client and the traceback to stderr.
"""

from __future__ import annotations

import asyncio
import json
import traceback

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from prunus.artifacts.errors import PrunusError

from .asgi_guard import ClientGone, RequestGuard, log_client
from .http_guard import BadRequest, parse_json_body
from .http_server import CompletionServer
from .oip_tensors import output_tensor, parse_infer
from .scheduler import QueueFull

ROUTES = "GET /v2/health/live, /v2/health/ready, /v2/models/{name}[/ready], /metrics or POST /v2/models/{name}/infer"


def _error(status: int, message: str, headers: dict | None = None) -> Response:
    return Response(json.dumps({"error": message}), status, headers=headers, media_type="application/json")


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(BadRequest)
    async def bad(request, exc: BadRequest):
        return _error(exc.status, str(exc), exc.headers)

    @app.exception_handler(QueueFull)
    async def full(request, exc: QueueFull):
        return _error(429, str(exc), {"Retry-After": "1"})

    @app.exception_handler(PrunusError)
    async def refused(request, exc: PrunusError):
        return _error(400, str(exc))

    @app.exception_handler(ClientGone)
    async def gone(request, exc: ClientGone):
        log_client(request.scope)
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path[:200]}"
        if exc.status_code == 405:
            return _error(405, f"method {request.method} is not allowed; use {ROUTES}", {"Allow": "GET, POST"})
        return _error(exc.status_code, f"no route {where}; use {ROUTES}")

    @app.exception_handler(Exception)
    async def ours(request: Request, exc: Exception):
        traceback.print_exception(exc)
        return _error(500, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


def build_oip_app(server: "OIPServer") -> FastAPI:
    app = FastAPI(title="prunus serve (Open Inference Protocol)", docs_url="/docs", redoc_url=None)
    _install_errors(app)
    engine = server.engine

    def known(name: str) -> None:
        if name != server.model_name:
            raise BadRequest(404, f"unknown model {name[:80]!r}; this server serves {server.model_name!r}")

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        return JSONResponse({"ready": not engine._closed}, 200 if not engine._closed else 503)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "prunus", "version": server.version, "extensions": []}

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str):
        known(name)
        return server.metadata()

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        known(name)
        return {"name": name, "ready": not engine._closed}

    @app.get("/health")
    async def health():
        s = engine.scheduler
        return {"status": "ok", **engine.info, "queue_depth": s.queue_depth, "active": s.n_active}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), headers={"Content-Type": server.metrics_type})

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request):
        known(name)
        return await _infer(server, name, await request.body(), request.receive)

    app.add_middleware(RequestGuard, server=server, takes_body=_is_infer)
    return app


def _is_infer(path: str) -> bool:
    return path.startswith("/v2/models/") and path.endswith("/infer")


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _infer(server: "OIPServer", name: str, body: bytes, receive) -> dict:
    engine = server.engine
    tensors, request_id = parse_infer(parse_json_body(body), engine.backend.inputs,
                                      [o.name for o in engine.backend.outputs])
    future = engine.submit_predict(tensors[engine.backend.inputs[0].name])
    result, gone = asyncio.wrap_future(future), asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        if result not in done:
            future.cancel()  # not run if its pass has not begun
            raise ClientGone
        out = result.result()
    finally:
        gone.cancel()
    return {"model_name": name, **({"id": request_id} if request_id is not None else {}),
            "outputs": [output_tensor(out, engine.backend.outputs[0])]}


class OIPServer(CompletionServer):
    """The Open Inference Protocol endpoint over an Engine whose backend predicts (see the module docstring)."""

    def __init__(self, engine, *args, **kwargs):
        if not engine.backend.capabilities.predict:
            raise PrunusError("the Open Inference Protocol server serves non-generative models (a generic model dir "
                              "or its export); serve this one with the completions server")
        from prunus import __version__

        self.version = __version__
        super().__init__(engine, *args, **kwargs)

    def build_app(self):
        return build_oip_app(self)

    def sampling_defaults(self) -> dict:
        return {}

    def error_body(self, error) -> bytes:
        return json.dumps({"error": str(error)}).encode()

    def metadata(self) -> dict:
        backend = self.engine.backend
        return {"name": self.model_name, "versions": ["1"], "platform": self.engine.info.get("runtime", ""),
                "inputs": [s.metadata() for s in backend.inputs], "outputs": [s.metadata() for s in backend.outputs]}
