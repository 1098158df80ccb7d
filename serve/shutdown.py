"""How ``prunus serve`` stops: a drain, then a cut, then one line.

SIGTERM or Ctrl-C (or :meth:`prunus.serve.http_server.CompletionServer.shutdown` from another thread):

1. at once, every new request is answered 503 (``code: shutdown``, ``Connection: close``); the listening
   socket stays open meanwhile, so a client meets an answer that says why, never a refused connection;
2. the requests in progress run on for the grace (``--shutdown-grace``, :data:`SHUTDOWN_GRACE_S` by default);
3. at its end the rest are cut: a stream ends with an error event in OpenAI's shape
   (``{"error": {"message": "server shutting down", "type": "server_error", "code": "shutdown"}}``) and then
   ``data: [DONE]``, an answer not yet begun is 503 (the Open Inference Protocol's ``{"error": ...}`` on its
   server); the engine's rows they held are cancelled and free at its next step;
4. one line says how many were in progress, finished and were cut; then the server stops, and the engine
   closes after it.

A second signal cuts at once. A stream is cut through its events (:func:`prunus.serve.events.interrupt`): the
request's reader ends with :class:`ShuttingDown`, as with any engine failure mid-stream, so the client gets an
error event where it would have got the next token. A request that reads no events when it is cut (its answer
not begun: a prompt being encoded, a pass of the Open Inference Protocol) is cancelled and answered 503 here.

The CLI imports this module for its default grace: the event loop's modules are imported where they are used.
"""

from __future__ import annotations

import sys
import threading
import time

from prunus.artifacts.errors import PrunusError

from .http_guard import BadRequest

SHUTDOWN_GRACE_S = 5.0  # how long requests in progress may run on after SIGTERM
CUT_WAIT_S = 2.0  # after the cut: for the cut answers' last bytes (then uvicorn's own shutdown, as long again)
MESSAGE = "server shutting down"


class ShuttingDown(PrunusError):
    """The server cut this request at the end of its shutdown grace."""

    code = "shutdown"

    def __init__(self, message: str = MESSAGE):
        super().__init__(message)


def refusal() -> BadRequest:
    """The 503 of a request the shutdown refuses or cuts before its answer began."""
    return BadRequest(503, f"{MESSAGE}; retry on another instance", "server_error", code=ShuttingDown.code,
                      headers={"Connection": "close"})


class Flight:
    """One request in progress: the engine requests it reads (``events.watcher``), whether its answer began."""

    def __init__(self):
        self.task = None  # the asyncio task that runs the app for it
        self.reading: dict = {}  # id -> engine request (a dataclass: compared by value, not hashable)
        self.started = False
        self.cut_off = False

    def add(self, request) -> None:
        self.reading[id(request)] = request
        if self.cut_off:  # began reading after the cut
            from .events import interrupt

            interrupt(request, ShuttingDown())

    def discard(self, request) -> None:
        self.reading.pop(id(request), None)

    def cut(self) -> None:
        from .events import interrupt

        self.cut_off = True
        for request in list(self.reading.values()):
            interrupt(request, ShuttingDown())
        if not self.reading and not self.started and self.task is not None:
            self.task.cancel()  # answered 503 by ShutdownGuard

    def watch(self, send):
        async def send_watched(message):
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)
        return send_watched


class Drain:
    """The shutdown's state, shared by the server's loop (:meth:`step`), its middleware and the thread or signal
    handler that asks for it (:meth:`request`)."""

    def __init__(self, grace: float = SHUTDOWN_GRACE_S):
        if not 0 <= grace <= 3600:
            raise PrunusError(f"shutdown_grace={grace!r} (--shutdown-grace) must be from 0 to 3600 seconds")
        self.grace = grace
        self.flights: set[Flight] = set()
        self._asked = threading.Event()  # set: new requests get 503
        self._hurry = False
        self.draining = False  # the drain began on the loop: ``in_progress`` counted, the grace running
        self.deadline = self.cut_at = None
        self.in_progress = self.finished = 0

    def request(self) -> None:
        """Begin the drain (from any thread or a signal handler); asked again, cut at once."""
        if self._asked.is_set():
            self._hurry = True
        self._asked.set()

    @property
    def refusing(self) -> bool:
        return self._asked.is_set()

    def step(self) -> bool:
        """On the server's event loop, every tick: True once the server may stop."""
        if not self._asked.is_set():
            return False
        now = time.monotonic()
        if not self.draining:
            self.draining, self.deadline, self.in_progress = True, now + self.grace, len(self.flights)
        if self.cut_at is None and self.flights and (self._hurry or now >= self.deadline):
            self.cut_at = now
            for flight in list(self.flights):
                flight.cut()
        if not self.flights:
            return True
        return self.cut_at is not None and now >= self.cut_at + CUT_WAIT_S

    def landed(self, flight: Flight) -> None:
        self.flights.discard(flight)
        if self.draining and not flight.cut_off:
            self.finished += 1

    def summary(self) -> str:
        """The shutdown's one line."""
        n = self.in_progress
        if not n:
            return "prunus serve: shut down (no request was in progress)"
        cut = n - self.finished
        when = "at a second signal" if self._hurry else f"after the {self.grace:g} s grace"
        return (f"prunus serve: shut down: of {n} request{'s' * (n != 1)} in progress, {self.finished} finished and "
                f"{cut} {'was' if cut == 1 else 'were'} cut {when}")


class ShutdownGuard:
    """The outermost ASGI middleware: a 503 for every request once the drain began; each other request runs as a
    :class:`Flight` the drain can cut. ``error_body(BadRequest)``: the server's error shape."""

    def __init__(self, app, drain: Drain, error_body):
        self.app, self.drain, self.error_body = app, drain, error_body

    async def __call__(self, scope, receive, send):
        import asyncio

        from .asgi_guard import answer
        from .events import watcher

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.refusing:
            error = refusal()
            return await answer(send, error, self.error_body(error))
        flight = Flight()
        token = watcher.set(flight)  # the request's task and those it starts read through it
        try:
            flight.task = asyncio.ensure_future(self.app(scope, receive, flight.watch(send)))
        finally:
            watcher.reset(token)
        self.drain.flights.add(flight)
        try:
            await asyncio.wait({flight.task})
        except asyncio.CancelledError:
            flight.task.cancel()
            raise
        finally:
            self.drain.landed(flight)
        if flight.task.cancelled():
            if not flight.started:
                error = refusal()
                await answer(send, error, self.error_body(error))
            return
        flight.task.result()  # the app's own failure, as uvicorn would have seen it


def install(app, drain: Drain, error_body) -> None:
    """On ``app``: a cut whole answer is 503 in the server's error shape, and :class:`ShutdownGuard` in front."""
    from fastapi.responses import Response

    async def cut(request, exc: ShuttingDown):
        error = refusal()
        return Response(error_body(error), 503, headers=error.headers, media_type="application/json")
    app.add_exception_handler(ShuttingDown, cut)
    app.add_middleware(ShutdownGuard, drain=drain, error_body=error_body)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
