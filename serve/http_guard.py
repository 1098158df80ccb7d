"""What the HTTP server guards against: slow or silent clients, too many connections, malformed bodies.

* :class:`DeadlineReader`: the connection's reads, each bounded by the deadline of the phase it
  belongs to (the request line and headers, then the body), so a client that trickles one byte at
  a time cannot hold a thread longer than the phase allows; writes get their own timeout.
* :func:`refuse_connection`: over the connection cap, a 429 written straight onto the new socket
  (and its request read off, so the client sees the answer, not a reset), without a handler thread.
* :func:`parse_json_body`: a request body as JSON, refused with 400 when it is not UTF-8, not
  JSON, nested deeper than :data:`MAX_JSON_DEPTH`, holds a lone surrogate (which no tokenizer can
  encode), NaN, or an integer beyond 64 bits (``seed`` must fit torch's generator).
* :func:`error_json`: every error in OpenAI's shape,
  ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time

MAX_JSON_DEPTH = 32
INT_LIMIT = 1 << 64
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


class BadRequest(Exception):
    """An HTTP error answer: status, one-line message and OpenAI error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_json(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class DeadlineReader(io.RawIOBase):
    """A socket's reads under a deadline (:meth:`start`); ``received`` counts the bytes of the phase."""

    def __init__(self, sock: socket.socket, write_timeout: float | None):
        self.sock, self.write_timeout = sock, write_timeout
        self.deadline: float | None = None
        self.received = 0

    def readable(self) -> bool:
        return True

    def start(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.received = 0

    def readinto(self, buf) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the read deadline passed")
            self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buf)
        finally:
            self.sock.settimeout(self.write_timeout)
        self.received += n
        return n


def _drain_and_close(sock: socket.socket, server) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(1.0)
        end = time.monotonic() + 1.0
        while time.monotonic() < end and sock.recv(65536):
            pass
    except OSError:
        pass
    finally:
        server.shutdown_request(sock)


def refuse_connection(sock: socket.socket, server, message: str) -> None:
    """Answer 429 on a connection over the cap and close it gently (its request read off first)."""
    body = error_json(message, "rate_limit_error", code="too_many_connections")
    head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(head + body)
    except OSError:
        server.shutdown_request(sock)
        return
    threading.Thread(target=_drain_and_close, args=(sock, server), daemon=True).start()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _walk(obj) -> None:
    """Depth, strings and integers of a parsed body, without recursion."""
    stack = [(obj, 1, None)]
    while stack:
        value, depth, key = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_str(k, k)
                stack.append((v, depth + 1, k if depth == 1 else key))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, key) for v in value)
        elif isinstance(value, str):
            _check_str(value, key)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT:
            raise BadRequest(400, f"'{key}' holds an integer beyond 64 bits", param=key)


def _check_str(text: str, key) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(400, f"'{key}' holds a lone surrogate (\\u{ord(text[e.start]):04x}), which is not text; "
                         "send valid UTF-16 pairs", param=key if isinstance(key, str) else None) from None


def parse_json_body(body: bytes):
    """The parsed body, or BadRequest(400) for a body no route should see (see the module docstring)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"the request body is not UTF-8 (byte {e.start})") from None
    try:
        req = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise BadRequest(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # NaN / Infinity, or an integer of more digits than Python converts
        raise BadRequest(400, f"the request body is not valid JSON ({str(e).splitlines()[0][:80]})") from None
    _walk(req)
    if isinstance(req, dict):
        seed = req.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise BadRequest(400, "'seed' must be an integer from -2**63 to 2**64 - 1", param="seed")
    return req


def start_event_stream(handler) -> None:
    """Answer 200 with server-sent-event headers; the connection closes when the stream ends."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Cache-Control", "no-cache")
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.close_connection = True
