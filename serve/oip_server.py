"""The Open Inference Protocol (KServe v2, Triton's REST API) over a non-generative Engine.

* ``GET /v2/health/live``, ``GET /v2/health/ready``: ``{"live": true}`` / ``{"ready": true}``;
* ``GET /v2``: the server's metadata; ``GET /v2/models/{name}``: the model's (``inputs`` / ``outputs`` with
  name, datatype and shape, ``-1`` for the batch axis); ``GET /v2/models/{name}/ready``;
* ``POST /v2/models/{name}/infer``: typed tensors in (:mod:`prunus.serve.oip_tensors`), typed tensors out,
  ``{"model_name", "id"?, "outputs": [{"name", "datatype", "shape", "data"}]}``; each request's rows join a
  pass shared with other clients (:mod:`prunus.serve.dynamic_batcher`);
* ``GET /health`` and ``GET /metrics`` as the completions server's, with the batching counters.

The completions server's plumbing and guards (:mod:`prunus.serve.http_server`) hold: the door (API key,
Host, Origin), deadlines, size limits, the connection cap, a full queue → 429. Errors are the protocol's
``{"error": "one line"}``: a malformed tensor 400 naming it, an unknown model or route 404.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import TimeoutError as FutureTimeout

from prunus.artifacts.errors import PrunusError

from .http_access import is_json_content_type
from .http_guard import BadRequest, parse_json_body
from .http_server import CLIENT_CHECK_S, CompletionHandler, CompletionServer
from .oip_tensors import parse_infer
from .scheduler import QueueFull

ROUTES = "GET /v2/health/live, /v2/health/ready, /v2/models/{name}[/ready], /metrics or POST /v2/models/{name}/infer"


class OIPHandler(CompletionHandler):
    server: "OIPServer"

    def _error(self, status: int, message: str, kind: str = "", param=None, headers=None, code=None) -> None:
        self._send(status, json.dumps({"error": message}).encode(), headers=headers)

    def _model_route(self) -> tuple[str | None, str]:
        """(model name, the rest of the path) of /v2/models/{name}[/rest]; (None, "") for another path."""
        path = self.path.split("?", 1)[0]
        if not path.startswith("/v2/models/"):
            return None, ""
        name, _, rest = path[len("/v2/models/"):].partition("/")
        return name, rest

    def _known(self, name: str) -> bool:
        if name == self.server.model_name:
            return True
        self._error(404, f"unknown model {name[:80]!r}; this server serves {self.server.model_name!r}")
        return False

    def do_GET(self):
        engine, path = self.server.engine, self.path.split("?", 1)[0]
        name, rest = self._model_route()
        if path == "/v2/health/live":
            self._json(200, {"live": True})
        elif path == "/v2/health/ready":
            self._json(200 if not engine._closed else 503, {"ready": not engine._closed})
        elif path == "/v2":
            self._json(200, {"name": "prunus", "version": self.server.version, "extensions": []})
        elif name is not None and rest in ("", "ready"):
            if self._known(name):
                self._json(200, {"name": name, "ready": not engine._closed} if rest else self.server.metadata())
        elif path == "/metrics":
            self._send(200, self.server.render_metrics().encode(), "text/plain; version=0.0.4")
        elif path == "/health":
            super().do_GET()
        else:
            self._error(404, f"no route GET {self.path[:200]}; use {ROUTES}")

    def _not_allowed(self) -> None:
        self._drain()
        self._error(405, f"method {self.command} is not allowed; use {ROUTES}", headers={"Allow": "GET, POST"})

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_TRACE = do_CONNECT = _not_allowed

    def do_POST(self):
        name, rest = self._model_route()
        if name is None or rest != "infer":
            self._drain()
            self._error(404, f"no route POST {self.path[:200]}; use POST /v2/models/{{name}}/infer")
            return
        if not self._known(name) or not self._json_body():
            self._drain()
            return
        t0, status = time.perf_counter(), 500
        try:
            status = self._infer(name)
        except BadRequest as e:
            status = e.status
            self._error(e.status, str(e))
        except QueueFull as e:
            status = 429
            self._error(429, str(e))
        except PrunusError as e:
            status = 400
            self._error(400, str(e))
        except (ConnectionError, TimeoutError) as e:
            status, self.close_connection = 499, True
            self.server.log_client(self.client_address, e)
        except Exception as e:  # the server stays up; the client learns it was us
            if not self._answered:
                self._try_error(500, f"{type(e).__name__}: {str(e)[:200]}", "server_error")
            self.close_connection = True
        finally:
            self.server.metrics.observe(status, time.perf_counter() - t0 if status == 200 else None)

    def _json_body(self) -> bool:
        if is_json_content_type(self.headers.get("Content-Type")):
            return True
        self.server.metrics.observe(415, None)
        self._error(415, f"POST bodies must be JSON sent with 'Content-Type: application/json', not "
                         f"{(self.headers.get('Content-Type') or 'none')[:80]!r}")
        return False

    def _infer(self, name: str) -> int:
        engine = self.server.engine
        tensors, request_id = parse_infer(parse_json_body(self._body()), engine.backend.inputs,
                                          [o.name for o in engine.backend.outputs])
        future = engine.submit_predict(tensors[engine.backend.inputs[0].name])
        while True:
            try:
                out = future.result(CLIENT_CHECK_S)
                break
            except FutureTimeout:
                if self._client_gone():
                    future.cancel()  # not run if its pass has not begun
                    raise ConnectionResetError("the client went away") from None
        spec = engine.backend.outputs[0]
        answer = {"model_name": name, **({"id": request_id} if request_id is not None else {}),
                  "outputs": [{"name": spec.name, "datatype": spec.datatype, "shape": list(out.shape),
                               "data": out.reshape(-1).tolist()}]}
        self._json(200, answer)
        return 200


class OIPServer(CompletionServer):
    """The Open Inference Protocol endpoint over an Engine whose backend predicts (see the module docstring)."""

    handler_class = OIPHandler

    def __init__(self, engine, *args, **kwargs):
        if not engine.backend.capabilities.predict:
            raise PrunusError("the Open Inference Protocol server serves non-generative models (a generic model dir "
                              "or its export); serve this one with the completions server")
        super().__init__(engine, *args, **kwargs)
        from prunus import __version__

        self.version = __version__

    def metadata(self) -> dict:
        backend = self.engine.backend
        return {"name": self.model_name, "versions": ["1"], "platform": self.engine.info.get("runtime", ""),
                "inputs": [s.metadata() for s in backend.inputs], "outputs": [s.metadata() for s in backend.outputs]}

    def render_metrics(self) -> str:
        return self.metrics.render(self.engine.scheduler) + "\n".join(self.engine.scheduler.metrics_lines()) + "\n"
