"""A request's events (:class:`~prunus.serve.request.StreamToken` pieces, then its
:class:`~prunus.serve.request.GenerationResult`, or the error that ended it) as one result or as a stream.

Every reader of ``request.events`` goes through here: :meth:`prunus.serve.engine.Engine.generate` / ``stream``
in threads, and the HTTP server's completions and chat completions on its event loop (:func:`async_events`:
woken by the scheduler's thread, each wake taking every event that is ready at once). A server's shutdown
ends a request its grace could not wait for with :func:`interrupt`, and finds the requests an HTTP request reads
through :data:`watcher` (:mod:`prunus.serve.shutdown`).
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar

from .request import GenerationResult, Request, StreamToken

Event = StreamToken | GenerationResult | BaseException

# Who watches the requests an asyncio task reads (its ``add(request)`` / ``discard(request)``): set by the server
# for each HTTP request (prunus.serve.shutdown.Flight), inherited by the tasks it starts; None elsewhere.
watcher: ContextVar = ContextVar("prunus_request_watcher", default=None)


def interrupt(request: Request, error: BaseException) -> None:
    """End ``request`` for its reader with ``error``, its last event (after those already put: a result put first
    still ends it as it was); the scheduler frees its row at its next step, as for a client that left."""
    request.cancelled.set()
    request.events.put(error)
    notify = request.notify
    if notify is not None:
        notify()


def events(request: Request, check_every_s: float | None = None,
           check: Callable[[], None] | None = None) -> Iterator[Event]:
    """Each token as it comes, then the result or the error that ended the request, last.
    ``check``: called every ``check_every_s`` seconds while the request runs, events or not (it may raise: a
    client gone)."""
    checked = time.monotonic()
    while True:
        try:
            event = request.events.get(timeout=check_every_s)
        except queue.Empty:
            event = None
        if event is not None:
            yield event
            if isinstance(event, (GenerationResult, BaseException)):
                return
        if check is not None and time.monotonic() - checked >= check_every_s:
            checked = time.monotonic()
            check()


def tokens(request: Request) -> Iterator[StreamToken]:
    """Each token as it comes, ending with the request; the error that ended it is raised."""
    for event in events(request):
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, GenerationResult):
            return
        yield event


def result(request: Request, check_every_s: float | None = None,
           check: Callable[[], None] | None = None) -> GenerationResult:
    """The request's result once it ends (its tokens passed over); the error that ended it is raised."""
    for event in events(request, check_every_s, check):
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, GenerationResult):
            return event
    raise AssertionError("a request's events end with its result or its error")


def _ends(event) -> bool:
    return isinstance(event, (GenerationResult, BaseException))


def _drain(request: Request) -> list:
    """The events ready now, up to and including one that ends the request."""
    out = []
    while not out or not _ends(out[-1]):
        try:
            out.append(request.events.get_nowait())
        except queue.Empty:
            break
    return out


def _wake_on_put(request: Request, loop: asyncio.AbstractEventLoop, ready: asyncio.Event) -> None:
    def notify() -> None:
        try:
            loop.call_soon_threadsafe(ready.set)
        except RuntimeError:  # the loop has closed: nobody is reading any more
            pass
    request.notify = notify


async def async_events(request: Request) -> AsyncIterator[Event]:
    """:func:`events` for an asyncio task: the same events, in order, ending with the result or the error.
    The scheduler's thread wakes the loop itself after each event it puts (``request.notify``), so a token
    reaches the loop in one hop, with no thread of a pool waiting in between."""
    ready = asyncio.Event()
    _wake_on_put(request, asyncio.get_running_loop(), ready)
    watching = watcher.get()
    if watching is not None:
        watching.add(request)
    try:
        while True:
            ready.clear()  # before draining: an event put after the drain sets it again
            got = _drain(request)
            for event in got:
                yield event
                if _ends(event):
                    return
            if not got:
                await ready.wait()
    finally:
        request.notify = None
        if watching is not None:
            watching.discard(request)
