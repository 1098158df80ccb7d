"""The HTTP server's connection-level guards, in uvicorn's h11 protocol (:class:`GuardedH11Protocol`).

* **Connection cap.** Over ``max_connections`` open connections, a new one is answered 429 (``code:
  too_many_connections``, ``Retry-After: 1``) straight away, its request read off and dropped, then closed:
  the client sees an answer, never a reset. The listen backlog is sized from the same cap, so a burst waits
  in the kernel instead of being refused.
* **Header deadline.** The request line and headers must arrive within ``header_timeout`` seconds of the
  connection opening (or of the previous answer on a kept-alive connection): a request begun and not
  finished in time gets 408 (``type: timeout_error``) and the connection closes; an idle connection is closed
  without an answer. A client that trickles a byte at a time cannot hold a connection longer.
* **Clients that stop reading.** Once an answer fills the connection's write buffer, the client has
  ``write_timeout`` seconds to read some of it; otherwise the connection is dropped, which cancels the
  request's rows like any client that leaves.
* **Too many headers.** More than :data:`MAX_HEADERS` header lines: 431, before h11 parses them.
* **Malformed HTTP.** What h11 cannot parse (a bad request line, a bad ``Content-Length``, headers too
  long) is a JSON error in OpenAI's shape with h11's status (400, 431), never uvicorn's plain text.

The body's deadline, size and the door are per request, in :mod:`prunus.serve.asgi_guard`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_guard import error_json

REFUSED_LINGER_S = 1.0  # how long a refused connection is read off before it is closed
MAX_HEADERS = 100
WRITE_BUFFER = 1 << 16  # bytes of answer buffered for a client before its write deadline starts
HEAD_BYTES = 1 << 16  # what h11 reads of a request line and headers, at most (h11_max_incomplete_event_size)


@dataclass
class ConnectionLimits:
    """Shared by every connection of one server (all on its event loop's thread)."""

    max_connections: int
    header_timeout: float
    write_timeout: float = 60.0
    observe: Callable[[int], None] = lambda status: None  # the metrics' count of answers by status
    open: int = 0


def raw_answer(status: int, body: bytes, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, written without h11 (whose state may be an error)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guards of the module docstring; ``limits`` is set by :func:`guarded_protocol`."""

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self._received = 0  # bytes of a request whose headers have not all come
        self._head = b""  # those bytes (up to HEAD_BYTES), to count its header lines
        self._refused = self._counted = False
        self._h11_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_recorded():
            try:
                return next_event()
            except h11.RemoteProtocolError as e:  # uvicorn drops it; send_400_response answers with it
                self._h11_error = e
                raise
        self.conn.next_event = next_event_recorded

    def connection_made(self, transport) -> None:
        limits = self.limits
        if limits.open >= limits.max_connections:
            self._refused, self.transport = True, transport
            limits.observe(429)
            body = error_json(f"the server holds {limits.max_connections} open connections; retry later",
                              "rate_limit_error", code="too_many_connections")
            transport.write(raw_answer(429, body, {"Retry-After": "1"}))
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(REFUSED_LINGER_S, transport.close)
            return
        limits.open += 1
        self._counted = True
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER)
        self._start_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        self.resume_writing_deadline()
        if self._refused:
            return
        if self._counted:
            self.limits.open -= 1
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read off and dropped
        if self.cycle is None or self.cycle.response_complete:
            self._received += len(data)
            if self._too_many_headers(data):
                return
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # the headers are in: the body has its own deadline
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # waiting for the next request
            self._start_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.limits.write_timeout, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.resume_writing_deadline()

    def resume_writing_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def send_400_response(self, msg: str) -> None:
        error = self._h11_error
        status = getattr(error, "error_status_hint", 400) or 400
        reason = str(error) if error is not None else msg
        if "Content-Length" in reason:
            message = "Bad request: bad Content-Length; send the JSON body with a valid Content-Length header " \
                      "(a non-negative byte count)"
        else:
            message = f"Bad request: {reason[:200]}; send a well-formed HTTP/1.1 request"
        self.limits.observe(status)
        self.transport.write(raw_answer(status, error_json(message, "invalid_request_error")))
        self.transport.close()

    def _too_many_headers(self, data: bytes) -> bool:
        if len(self._head) < HEAD_BYTES:
            self._head += data[:HEAD_BYTES - len(self._head)]
        end = self._head.find(b"\r\n\r\n")
        lines = (self._head if end < 0 else self._head[:end]).count(b"\n")  # the request line's ending included
        if lines <= MAX_HEADERS:
            return False
        self.limits.observe(431)
        body = error_json(f"Too many headers (more than {MAX_HEADERS}); send fewer", "invalid_request_error")
        self.transport.write(raw_answer(431, body))
        self.transport.close()
        self._cancel_deadline()
        return True

    def _start_deadline(self) -> None:
        self._cancel_deadline()
        self._received, self._head = 0, b""
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._late)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self._received:  # a request began and did not finish in time
            self.limits.observe(408)
            body = error_json(f"the request did not arrive within {self.limits.header_timeout:g} s", "timeout_error")
            self.transport.write(raw_answer(408, body))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class of one server (uvicorn builds one instance per connection)."""
    return type("ServerH11Protocol", (GuardedH11Protocol,), {"limits": limits})
