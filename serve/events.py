"""A request's events (:class:`~prunus.serve.request.StreamToken` pieces, then its
:class:`~prunus.serve.request.GenerationResult`, or the error that ended it) as one result or as a stream.

Every reader of ``request.events`` goes through here: :meth:`prunus.serve.engine.Engine.generate` / ``stream``
and the HTTP server's completions and chat completions.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from .request import GenerationResult, Request, StreamToken

Event = StreamToken | GenerationResult | BaseException


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
