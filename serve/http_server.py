"""An OpenAI-compatible HTTP endpoint on the standard library's ThreadingHTTPServer.

* ``POST /v1/completions``: ``prompt`` (a string or a list of strings), ``max_tokens``
  (16), ``temperature`` (1.0), ``top_p``, ``top_k`` (an extension), ``seed``, ``stop``
  (a string or a list), ``stream`` (server-sent events: ``data: {...}`` chunks, then
  ``data: [DONE]``; one prompt per streamed request);
* ``POST /v1/chat/completions``: ``messages`` through the model's chat template (:mod:`prunus.serve.chat_api`);
* ``GET /health``: the engine's settings and load, JSON;
* ``GET /metrics``: Prometheus text (:mod:`prunus.serve.metrics`).

Every HTTP thread submits to the engine's one continuous-batching scheduler. A full
wait queue answers 429; a malformed request 400; every error is JSON in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with its status (401 / 403 refused at the door,
415 a body that is not JSON, 404 unknown route,
405 other methods, 408 a request that does not arrive in time, 411 / 413 bodies, 429 full).
A client that goes away, streaming or waiting for a whole answer, cancels its requests,
which frees their batch slots at the next step, and is one log line.

Who may use it (:mod:`prunus.serve.http_access`): every request must name this server in ``Host``
and come from no web page, or one listed in ``allowed_origins`` (403 otherwise; CORS headers only for
those); with an API key, every route but ``/health`` needs ``Authorization: Bearer KEY`` (401); POST
bodies must be ``application/json`` (415).

Load and slow clients (:mod:`prunus.serve.http_guard`): the listen backlog and a cap on
open connections are sized from the queue (``--max-queue``) and batch; a connection over
the cap gets 429 rather than a reset. The request line and headers must arrive within
``header_timeout`` seconds and the body within ``body_timeout`` (else 408); an idle
kept-alive connection is closed after ``header_timeout``.
"""

from __future__ import annotations

import io
import json
import select
import socket
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prunus.artifacts.errors import PrunusError

from .chat_api import CHAT_PATH, handle_chat
from .engine import Engine
from .events import events, result
from .http_access import ServeAccess, is_json_content_type
from .http_guard import BadRequest, DeadlineReader, error_json, parse_json_body, refuse_connection, \
    start_event_stream
from .metrics import Metrics
from .request import GenerationResult
from .scheduler import QueueFull

MAX_BODY_BYTES = 1 << 20
CLIENT_CHECK_S = 0.1  # how often a handler waiting for a whole answer checks that its client is still there
HEADER_TIMEOUT_S = 10.0  # request line + headers (and an idle kept-alive connection)
BODY_TIMEOUT_S = 30.0  # the body, once the headers are in
WRITE_TIMEOUT_S = 60.0  # one write to a client that does not read
COMPLETION_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "model", "n",
                     "user", "echo", "logprobs", "presence_penalty", "frequency_penalty", "best_of", "suffix"}


def parse_completion(body: bytes) -> tuple[list, dict, bool]:
    """(prompts, engine keyword arguments, stream) from a request body, or BadRequest."""
    req = parse_json_body(body)
    if not isinstance(req, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    unknown = sorted(set(req) - COMPLETION_FIELDS)
    if unknown:
        raise BadRequest(400, f"unknown field(s): {', '.join(unknown)}")
    prompt = req.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(400, "'prompt' must be a string or a non-empty list of strings")
    if req.get("n", 1) != 1 or req.get("best_of", 1) != 1:
        raise BadRequest(400, "'n' and 'best_of' other than 1 are not supported; send the prompt again")
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be true or false")
    if stream and len(prompts) != 1:
        raise BadRequest(400, "a streamed request takes one prompt")
    stop = req.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise BadRequest(400, "'stop' must be a string or a list of strings")
    kwargs = {"max_new_tokens": req.get("max_tokens", 16), "temperature": req.get("temperature", 1.0),
              "top_p": req.get("top_p"), "top_k": req.get("top_k"), "seed": req.get("seed"), "stop": stop}
    return prompts, kwargs, stream


class CompletionHandler(BaseHTTPRequestHandler):
    server: "CompletionServer"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.1"  # errors about a malformed request line get a status line and JSON too

    def log_message(self, format, *args):  # quiet: /metrics is the record
        pass

    # --- plumbing -------------------------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        self._reader = DeadlineReader(self.connection, self.server.write_timeout)
        self.rfile = io.BufferedReader(self._reader, 1 << 16)
        self.connection.settimeout(self.server.write_timeout)

    def handle_one_request(self) -> None:
        """BaseHTTPRequestHandler's, with deadlines (408), JSON errors and one log line for a client that resets."""
        self._answered, self._cors = False, {}
        self.command, self.requestline, self.request_version = None, "", self.default_request_version
        self._reader.start(self.server.header_timeout)
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(414, "the request line is longer than 65,536 bytes")
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # answered with send_error
                return
            self._reader.start(None)
            if not self._admitted():
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(501, f"method {self.command[:20]!r} is not supported; use GET or POST")
                return
            method()
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if self._reader.received and not self._answered:  # a request began and did not finish in time
                self._try_error(408, f"the request did not arrive within {self.server.header_timeout:g} s", "timeout_error")
        except ConnectionError as e:
            self.close_connection = True
            self.server.log_client(self.client_address, e)

    def _admitted(self) -> bool:
        """The door (:mod:`prunus.serve.http_access`): False once a refused request has been answered."""
        access = self.server.access
        self._cors = access.cors_headers(self.headers.get("Origin"))
        refusal = access.refusal(self.command, self.path, self.headers, self.server.server_address)
        if refusal is None:
            return True
        status, message, code = refusal
        self._drain()
        self.server.metrics.observe(status, None)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        self._error(status, message, "invalid_request_error", headers=headers, code=code)
        return False

    def send_response(self, code, message=None) -> None:
        self._answered = True
        super().send_response(code, message)

    def end_headers(self) -> None:
        for name, value in getattr(self, "_cors", {}).items():  # only for an allowed Origin
            self.send_header(name, value)
        super().end_headers()

    def send_error(self, code, message=None, explain=None) -> None:
        """Errors found by the standard library (bad request line, headers, methods): JSON too."""
        self.close_connection = True
        kind = "invalid_request_error" if code < 500 else "server_error"
        self._try_error(code, message or HTTPStatus(code).phrase, kind)

    def _try_error(self, status: int, message: str, kind: str) -> None:
        try:
            self._error(status, message, kind)
        except OSError:
            self.close_connection = True

    def _send(self, status: int, body: bytes, content_type: str = "application/json", headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str, kind: str, param: str | None = None,
               headers: dict | None = None, code: str | None = None) -> None:
        self._send(status, error_json(message, kind, param, code), headers=headers)

    # --- routes ---------------------------------------------------------------------------

    def do_GET(self):
        engine = self.server.engine
        if self.path == "/health":
            s = engine.scheduler
            self._json(200, {"status": "ok", **engine.info, "queue_depth": s.queue_depth, "active": s.n_active})
        elif self.path == "/metrics":
            self._send(200, self.server.metrics.render(engine.scheduler).encode(), "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route GET {self.path[:200]}; try /health, /metrics or POST /v1/completions",
                        "not_found_error")

    def _not_allowed(self) -> None:
        self._drain()
        self._error(405, f"method {self.command} is not allowed; use GET /health, GET /metrics or POST "
                         f"/v1/completions, {CHAT_PATH}", "invalid_request_error", headers={"Allow": "GET, POST"})

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_TRACE = do_CONNECT = _not_allowed

    def do_OPTIONS(self):
        """A CORS preflight from an allowed origin: 204 with what a page may send; anything else 405."""
        origin = self.headers.get("Origin")
        if not (self._cors and self.headers.get("Access-Control-Request-Method")):
            self._not_allowed()
            return
        self._drain()
        self.send_response(204)
        for name, value in self.server.access.preflight_headers(origin).items():
            if name not in self._cors:  # end_headers adds those
                self.send_header(name, value)
        self.end_headers()

    def do_POST(self):
        if self.path not in ("/v1/completions", CHAT_PATH):
            self._drain()
            self._error(404, f"no route POST {self.path[:200]}; use /v1/completions or {CHAT_PATH}", "not_found_error")
            return
        if not is_json_content_type(self.headers.get("Content-Type")):
            self._drain()
            self.server.metrics.observe(415, None)
            self._error(415, f"POST bodies must be JSON sent with 'Content-Type: application/json', not "
                             f"{(self.headers.get('Content-Type') or 'none')[:80]!r}", "invalid_request_error",
                        code="unsupported_media_type")
            return
        t0 = time.perf_counter()
        status = 500
        try:
            if self.path == CHAT_PATH:  # prunus.serve.chat_api
                body = self._body()
                parse_json_body(body)  # what no route should see: deep nesting, lone surrogates, 65-bit integers
                status = handle_chat(self, body)
            else:
                prompts, kwargs, stream = parse_completion(self._body())
                status = self._stream(prompts[0], kwargs) if stream else self._complete(prompts, kwargs)
        except BadRequest as e:
            status = e.status
            self._error(e.status, str(e), e.kind, e.param)
        except QueueFull as e:
            status = 429
            self._error(429, str(e), "rate_limit_error")
        except PrunusError as e:  # the Engine's argument max_new_tokens is the request's field max_tokens
            status = 400
            self._error(400, str(e).replace("max_new_tokens", "max_tokens"), "invalid_request_error")
        except (ConnectionError, TimeoutError) as e:
            status = 499  # the client went away (or stopped reading)
            self.close_connection = True
            self.server.log_client(self.client_address, e)
        except Exception as e:  # the server stays up; the client learns it was us
            if not self._answered:
                self._try_error(500, f"{type(e).__name__}: {str(e)[:200]}", "server_error")
            self.close_connection = True
        finally:
            self.server.metrics.observe(status, time.perf_counter() - t0 if status == 200 else None)

    def _drain(self) -> None:
        """Read off a body that will not be used, so the connection can serve the next request."""
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if 0 < n <= MAX_BODY_BYTES:
            try:
                self._reader.start(self.server.body_timeout)
                self.rfile.read(n)
            except (TimeoutError, ConnectionError):
                self.close_connection = True
            finally:
                self._reader.start(None)
        elif n:
            self.close_connection = True

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        try:
            n = int(length)
        except (TypeError, ValueError):
            self.close_connection = True
            raise BadRequest(411 if length is None else 400,
                             "send the JSON body with a valid Content-Length header") from None
        if n < 0:
            self.close_connection = True
            raise BadRequest(400, f"Content-Length {n} is negative; send the body's length in bytes")
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise BadRequest(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        self._reader.start(self.server.body_timeout)
        try:
            body = self.rfile.read(n)
        except TimeoutError:
            self.close_connection = True
            raise BadRequest(408, f"the request body did not arrive within {self.server.body_timeout:g} s",
                             "timeout_error") from None
        finally:
            self._reader.start(None)
        if len(body) < n:
            self.close_connection = True
            raise ConnectionResetError(f"the client closed the connection {len(body)} bytes into a {n}-byte body")
        return body

    def _base(self) -> dict:
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": self.server.model_name}

    def _client_gone(self) -> bool:
        """The client closed its end (readable, with nothing to read); a pipelined request is not that."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _wait(self, request) -> GenerationResult:
        return result(request, CLIENT_CHECK_S, self._check_client)

    def _check_client(self) -> None:
        if self._client_gone():
            raise ConnectionResetError("the client went away")

    def _complete(self, prompts: list[str], kwargs: dict) -> int:
        engine, requests = self.server.engine, []
        try:
            for p in prompts:
                requests.append(engine.submit(p, **kwargs))
            results = [self._wait(r) for r in requests]
        except BaseException:
            for r in requests:  # frees their rows at the next step
                r.cancelled.set()
            raise
        usage = {"prompt_tokens": sum(r.prompt_tokens for r in results),
                 "completion_tokens": sum(len(r.token_ids) for r in results)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
                   for i, r in enumerate(results)]
        self._json(200, {**self._base(), "choices": choices, "usage": usage})
        return 200

    def _stream(self, prompt: str, kwargs: dict) -> int:
        request = self.server.engine.submit(prompt, **kwargs)  # errors here are still a plain 4xx answer
        base = self._base()
        try:
            start_event_stream(self)
            for event in events(request):
                if isinstance(event, BaseException):
                    self._event({**base, "error": {"message": str(event), "type": "server_error"}})
                elif isinstance(event, GenerationResult):
                    self._event({**base, "choices": [{"index": 0, "text": "", "finish_reason": event.finish_reason,
                                                      "logprobs": None}]})
                elif event.text:
                    self._event({**base, "choices": [{"index": 0, "text": event.text, "finish_reason": None,
                                                      "logprobs": None}]})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            request.cancelled.set()  # a client gone mid-stream frees its slot at the next step
        return 200

    def _event(self, obj) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


class CompletionServer(ThreadingHTTPServer):
    """The endpoint. ``max_connections`` (default: twice the queue plus the batch, at least 64) caps open
    connections and sizes the listen backlog; the timeouts bound slow clients (see the module docstring);
    ``access`` says who may use it (default: no API key, requests addressed to this server only, no web page)."""

    daemon_threads = True
    handler_class = CompletionHandler  # the routes (prunus.serve.oip_server serves the Open Inference Protocol)

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 8000, *, max_connections: int | None = None,
                 header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = BODY_TIMEOUT_S,
                 write_timeout: float = WRITE_TIMEOUT_S, access: ServeAccess | None = None):
        self.engine = engine
        self.access = access or ServeAccess()
        self.metrics = Metrics()
        self.model_name = Path(engine.info.get("path", "prunus")).name or "prunus"
        queue_size = getattr(engine.scheduler, "max_queue", None) or 64
        self.max_connections = max_connections or max(64, 2 * (queue_size + int(engine.info.get("max_batch", 8))))
        self.request_queue_size = self.max_connections  # the listen backlog: a burst waits instead of being reset
        self.header_timeout, self.body_timeout, self.write_timeout = header_timeout, body_timeout, write_timeout
        self._open, self._open_lock = 0, threading.Lock()
        if not 0 <= port <= 65535:
            raise PrunusError(f"--port {port} is not a TCP port; choose one from 0 (any free port) to 65535")
        try:
            super().__init__((host, port), self.handler_class)
        except (OSError, OverflowError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise PrunusError(f"cannot listen on {host}:{port} ({reason}); choose another --host/--port") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
        if full:
            self.metrics.observe(429, None)
            refuse_connection(request, self, f"the server holds {self.max_connections} open connections; retry later")
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._open_lock:
                self._open -= 1
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1

    def log_client(self, client_address, error: BaseException) -> None:
        """One line for a client that reset, closed early or stopped reading: not the server's fault."""
        host, port = client_address[:2] if isinstance(client_address, tuple) else (client_address, "")
        print(f"prunus serve: client {host}:{port} went away ({type(error).__name__})", file=sys.stderr, flush=True)

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            self.log_client(client_address, error)
            return
        super().handle_error(request, client_address)  # a bug in the server: the whole traceback
