"""The Open Inference Protocol (KServe v2, Triton's REST API) over a non-generative Engine, on FastAPI.

* ``GET /v2/health/live``, ``GET /v2/health/ready``: ``{"live": true}`` / ``{"ready": true}``;
* ``GET /v2``: the server's metadata; ``GET /v2/models/{name}``: the model's (``inputs`` / ``outputs`` with
  name, datatype and shape, ``-1`` for the batch axis); ``GET /v2/models/{name}/ready``;
* ``POST /v2/models/{name}/infer``: typed tensors in (:mod:`prunus.serve.oip_tensors`), typed tensors out,
  ``{"model_name", "model_version", "id"?, "outputs": [{"name", "datatype", "shape", "data"}]}``; each
  request's rows join a pass shared with other clients (:mod:`prunus.serve.dynamic_batcher`); the binary tensor
  data extension both ways (:mod:`prunus.serve.oip_binary`), as tritonclient sends and reads it; an output asked
  for with ``"parameters": {"classification": k}`` comes back as its top-k ``"score:index:label"`` strings, labels
  from the dir's ``labels.json`` (:mod:`prunus.serve.oip_classification`), as Triton's classification extension;
* every ``/v2/models/{name}`` route also under ``/v2/models/{name}/versions/1`` (the one version the metadata
  lists; another is a 404);
* ``GET /health`` and ``GET /metrics`` as the completions server's, with the batching counters.

The completions server's guards (:mod:`prunus.serve.http_server`) hold: the door (API key, Host, Origin),
deadlines, the connection cap, a full queue → 429; an infer body is JSON or binary tensor data, sent as
``application/json``, ``application/octet-stream`` or without a Content-Type, of at most ``max_body_bytes``
(default 64 MiB: a 64-row batch of 3 × 224 × 224 FP32 images in binary; 413 over it). Errors are the protocol's
``{"error": "one line"}``: a malformed tensor, or a value its datatype does not hold, 400 naming it; an unknown
model or route 404; an output holding NaN or infinity (which JSON cannot carry) 500 naming it; any other failure
of the server 500, one line to the client and the traceback to stderr.
"""

from __future__ import annotations

import asyncio
import json
import traceback

import numpy as np

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from prunus.artifacts.errors import PrunusError
from prunus.models.module_dir import LABELS

from .asgi_guard import ClientGone, RequestGuard, log_client, replay
from .http_guard import BadRequest
from .http_server import CompletionServer
from .oip_binary import DEFAULT_MAX_BODY_BYTES, HEADER_LENGTH, binary_output, bytes_output, check_media, \
    encode_response, read_infer_body, split_body
from .oip_classification import classify, model_labels
from .oip_tensors import Requested, bytes_tensor, check_finite, output_tensor, parse_infer
from .scheduler import QueueFull

ROUTES = ("GET /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/1][/ready], /metrics or "
          "POST /v2/models/{name}[/versions/1]/infer")
VERSIONS = ["1"]
EXTENSIONS = ["binary_tensor_data", "classification"]


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

    def known(name: str, version: str | None = None) -> None:
        if name != server.model_name:
            raise BadRequest(404, f"unknown model {name[:80]!r}; this server serves {server.model_name!r}")
        if version is not None and version not in VERSIONS:
            raise BadRequest(404, f"model {name[:80]!r} has no version {version[:40]!r}; its versions are "
                                  f"{', '.join(VERSIONS)}")

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        return JSONResponse({"ready": not engine._closed}, 200 if not engine._closed else 503)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "prunus", "version": server.version, "extensions": EXTENSIONS}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, request: Request):
        known(name, request.path_params.get("version"))  # a path parameter only, never a query's
        return server.metadata()

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, request: Request):
        known(name, request.path_params.get("version"))
        return JSONResponse({"name": name, "ready": not engine._closed}, 200 if not engine._closed else 503)

    @app.get("/health")
    async def health():
        s = engine.scheduler
        return {"status": "ok", **engine.info, "queue_depth": s.queue_depth, "active": s.n_active}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), headers={"Content-Type": server.metrics_type})

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request):
        known(name, request.path_params.get("version"))
        body, headers = await _infer(server, name, await request.body(), request.headers.get(HEADER_LENGTH),
                                     request.receive)
        return Response(body, 200, headers=headers)

    app.add_middleware(OIPGuard, server=server)
    return app


def _is_infer(path: str) -> bool:
    return path.startswith("/v2/models/") and path.endswith("/infer")


class OIPGuard(RequestGuard):
    """The completions server's guard (the door, methods, deadlines), with the infer body read as the protocol
    sends it: JSON or binary tensor data, ``application/json``, ``application/octet-stream`` or no Content-Type,
    under the server's ``max_body_bytes`` (413)."""

    def __init__(self, app, server):
        super().__init__(app, server, takes_body=lambda path: False)  # the body is read below

    async def _admit(self, scope, headers, receive, send):
        receive = await super()._admit(scope, headers, receive, send)
        if receive is None or scope["method"] != "POST" or not _is_infer(scope["path"]):
            return receive
        check_media(headers)
        body = await read_infer_body(receive, headers, self.server.body_timeout, self.server.max_body_bytes)
        return replay(body, receive)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _parse(server: "OIPServer", body: bytes, header_length: str | None):
    backend = server.engine.backend
    req, tail = split_body(body, header_length)
    return parse_infer(req, backend.inputs, [o.name for o in backend.outputs], tail)


def _encode(server: "OIPServer", name: str, request_id, out: np.ndarray, spec, how: Requested) -> tuple[bytes, dict]:
    header = {"model_name": name, "model_version": VERSIONS[0], **({"id": request_id} if request_id is not None else {})}
    if how.classification:
        top = classify(check_finite(out, spec), how.classification, spec, server.labels)
        entry, raw = bytes_output(top, spec.name) if how.binary else (bytes_tensor(top, spec.name), None)
    elif how.binary:
        entry, raw = binary_output(out, spec.name, spec.datatype)
    else:
        entry, raw = output_tensor(out, spec), None
    return encode_response({**header, "outputs": [entry]}, [] if raw is None else [raw])


async def _infer(server: "OIPServer", name: str, body: bytes, header_length, receive) -> tuple[bytes, dict]:
    """(the response body, its headers): the body parsed off the event loop (a large JSON body takes seconds)."""
    engine, loop = server.engine, asyncio.get_running_loop()
    tensors, request_id, wanted = await loop.run_in_executor(server.pool, _parse, server, body, header_length)
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
    spec = engine.backend.outputs[0]
    return await loop.run_in_executor(server.pool, _encode, server, name, request_id, out, spec, wanted[spec.name])


class OIPServer(CompletionServer):
    """The Open Inference Protocol endpoint over an Engine whose backend predicts (see the module docstring)."""

    def __init__(self, engine, *args, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, **kwargs):
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1:
            raise PrunusError(f"max_body_bytes {max_body_bytes!r}: give a positive number of bytes")
        self.max_body_bytes = max_body_bytes
        if not engine.backend.capabilities.predict:
            raise PrunusError("the Open Inference Protocol server serves non-generative models (a generic model dir "
                              "or its export); serve this one with the completions server")
        from prunus import __version__

        self.version = __version__
        self.labels = model_labels(engine.info.get("path"), engine.backend.outputs[0])  # None: the index is the label
        super().__init__(engine, *args, **kwargs)

    def build_app(self):
        return build_oip_app(self)

    def sampling_defaults(self) -> dict:
        return {}

    def error_body(self, error) -> bytes:
        return json.dumps({"error": str(error)}).encode()

    def metadata(self) -> dict:
        """The model's metadata; with class names, ``parameters`` names their file and count (classification)."""
        backend = self.engine.backend
        meta = {"name": self.model_name, "versions": VERSIONS, "platform": self.engine.info.get("runtime", ""),
                "inputs": [s.metadata() for s in backend.inputs], "outputs": [s.metadata() for s in backend.outputs]}
        if self.labels is not None:
            meta["parameters"] = {"labels": LABELS, "classes": len(self.labels)}
        return meta
