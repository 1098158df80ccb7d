"""An OpenAI-compatible HTTP endpoint on the standard library's ThreadingHTTPServer.

* ``POST /v1/completions``: ``prompt`` (a string or a list of strings), ``max_tokens``
  (16), ``temperature`` (1.0), ``top_p``, ``top_k`` (an extension), ``seed``, ``stop``
  (a string or a list), ``stream`` (server-sent events: ``data: {...}`` chunks, then
  ``data: [DONE]``; one prompt per streamed request);
* ``POST /v1/chat/completions``: ``messages`` through the model's chat template (:mod:`prunus.serve.chat_api`);
* ``GET /health``: the engine's settings and load, JSON;
* ``GET /metrics``: Prometheus text (:mod:`prunus.serve.metrics`).

Every HTTP thread submits to the engine's one continuous-batching scheduler. A full
wait queue answers 429; a malformed request 400 with ``{"error": {"message", "type"}}``;
a client that goes away, streaming or waiting for a whole answer, cancels its requests,
which frees their batch slots at the next step.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prunus.models import PrunusError

from .chat_api import CHAT_PATH, handle_chat
from .engine import Engine
from .metrics import Metrics
from .request import GenerationResult
from .scheduler import QueueFull

MAX_BODY_BYTES = 1 << 20
CLIENT_CHECK_S = 0.1  # how often a handler waiting for a whole answer checks that its client is still there
COMPLETION_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "model", "n",
                     "user", "echo", "logprobs", "presence_penalty", "frequency_penalty", "best_of", "suffix"}


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def parse_completion(body: bytes) -> tuple[list, dict, bool]:
    """(prompts, engine keyword arguments, stream) from a request body, or BadRequest."""
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(400, f"the request body is not valid JSON ({e})") from None
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

    def log_message(self, format, *args):  # quiet: /metrics is the record
        pass

    # --- plumbing -------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str, kind: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind}})

    # --- routes ---------------------------------------------------------------------------

    def do_GET(self):
        engine = self.server.engine
        if self.path == "/health":
            s = engine.scheduler
            self._json(200, {"status": "ok", **engine.info, "queue_depth": s.queue_depth, "active": s.n_active})
        elif self.path == "/metrics":
            self._send(200, self.server.metrics.render(engine.scheduler).encode(), "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route GET {self.path}; try /health, /metrics or POST /v1/completions", "not_found")

    def do_POST(self):
        if self.path not in ("/v1/completions", CHAT_PATH):
            self._drain()
            self._error(404, f"no route POST {self.path}; use /v1/completions or {CHAT_PATH}", "not_found")
            return
        t0 = time.perf_counter()
        status = 500
        try:
            if self.path == CHAT_PATH:  # prunus.serve.chat_api
                status = handle_chat(self, self._body())
            else:
                prompts, kwargs, stream = parse_completion(self._body())
                status = self._stream(prompts[0], kwargs) if stream else self._complete(prompts, kwargs)
        except BadRequest as e:
            status = e.status
            self._error(e.status, str(e), e.kind)
        except QueueFull as e:
            status = 429
            self._error(429, str(e), "rate_limit_error")
        except PrunusError as e:
            status = 400
            self._error(400, str(e), "invalid_request_error")
        except (BrokenPipeError, ConnectionResetError):
            status = 499  # the client went away
        except Exception as e:  # the server stays up; the client learns it was us
            self._error(500, f"{type(e).__name__}: {e}", "server_error")
        finally:
            self.server.metrics.observe(status, time.perf_counter() - t0 if status == 200 else None)

    def _drain(self) -> None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = 0
        if 0 < n <= MAX_BODY_BYTES:
            self.rfile.read(n)

    def _body(self) -> bytes:
        try:
            n = int(self.headers.get("Content-Length"))
        except (TypeError, ValueError):
            self.close_connection = True
            raise BadRequest(411 if self.headers.get("Content-Length") is None else 400,
                             "send the JSON body with a valid Content-Length header") from None
        if not 0 <= n <= MAX_BODY_BYTES:
            self.close_connection = True
            raise BadRequest(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return self.rfile.read(n)

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
        checked = time.monotonic()
        while True:
            try:
                event = request.events.get(timeout=CLIENT_CHECK_S)
            except queue.Empty:
                event = None
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, GenerationResult):
                return event
            if time.monotonic() - checked >= CLIENT_CHECK_S:
                checked = time.monotonic()
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
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            while True:
                event = request.events.get()
                if isinstance(event, BaseException):
                    self._event({**base, "error": {"message": str(event), "type": "server_error"}})
                    break
                if isinstance(event, GenerationResult):
                    self._event({**base, "choices": [{"index": 0, "text": "", "finish_reason": event.finish_reason,
                                                      "logprobs": None}]})
                    break
                if event.text:
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
    daemon_threads = True

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 8000):
        self.engine = engine
        self.metrics = Metrics()
        self.model_name = Path(engine.info.get("path", "prunus")).name or "prunus"
        try:
            super().__init__((host, port), CompletionHandler)
        except OSError as e:
            raise PrunusError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --host/--port") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
