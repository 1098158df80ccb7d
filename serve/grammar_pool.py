"""The grammar compiles of one served model: bounded in number, in waiting, in time, and cancelled with their client.

:class:`GrammarPool` runs at most ``limits.workers`` compiles at once (default 1), each first in a worker process
(:mod:`prunus.serve.grammar_worker`), and lets at most ``limits.queue`` more wait for one; past that a compile is
refused at once (:class:`GrammarBusy`, answered 429). A compile past ``limits.timeout_s`` in its worker is stopped
(the process killed) and answered as :class:`GrammarTimeout`; one whose client leaves (``receive`` says
``http.disconnect``) is stopped the same way. One that compiled in time is compiled again in this process while
it keeps its worker (so compiles stay one at a time per worker). Waiting happens in the pool's own threads,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from prunus.artifacts.errors import PrunusError

from .asgi_guard import ClientGone
from .grammar_limits import GrammarLimits
from .grammar_worker import CompileWorker, Stopped

WAIT_S = 0.05  # how often a compile waiting for a worker looks at its cancel flag


class GrammarBusy(PrunusError):
    """Every worker is busy and the queue is full (HTTP 429)."""

    status = 429


class GrammarTimeout(PrunusError):
    """A compile ran past the deadline, or its worker stopped (HTTP 400: the constraint asked too much)."""


class GrammarUnavailable(PrunusError):
    """The compile worker did not start, or the pool closed (HTTP 503)."""

    status = 503


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class GrammarPool:
    """Compiles for one tokenizer (one served model): ``tokenizer_json()`` is its serialized TokenizerInfo (for
    the workers)."""

    def __init__(self, tokenizer_json, limits: GrammarLimits | None = None):
        self.limits = limits or GrammarLimits.from_env()
        self._tokenizer_json, self._json = tokenizer_json, None
        self._idle: list[CompileWorker] = []
        self._running: set[threading.Event] = set()  # the cancel flags of the compiles admitted
        self._workers = self._admitted = 0
        self._cond = threading.Condition()
        self._threads = ThreadPoolExecutor(self.limits.workers + self.limits.queue,
                                           thread_name_prefix="prunus-grammar")
        self.closed = False

    @property
    def busy(self) -> int:
        """Compiles running or waiting."""
        return self._admitted

    def admit(self) -> None:
        """Take a place among the running and waiting compiles, or GrammarBusy."""
        with self._cond:
            if self.closed:
                raise GrammarUnavailable("cannot be compiled: the server is shutting down; retry on another")
            if self._admitted >= self.limits.workers + self.limits.queue:
                raise GrammarBusy(f"cannot be compiled now: this server compiles {self.limits.workers} grammar(s) at "
                                  f"once and queues {self.limits.queue} more, all taken (PRUNUS_GRAMMAR_WORKERS, "
                                  "PRUNUS_GRAMMAR_QUEUE); retry shortly")
            self._admitted += 1

    def _take(self, cancelled: threading.Event) -> CompileWorker:
        with self._cond:
            while not self._idle and self._workers >= self.limits.workers:
                if cancelled.is_set() or self.closed:
                    raise Stopped("cancelled")
                self._cond.wait(WAIT_S)
            if self._idle:
                return self._idle.pop()
            self._workers += 1
        try:
            if self._json is None:
                self._json = self._tokenizer_json()
            return CompileWorker(self._json)
        except BaseException:
            with self._cond:
                self._workers -= 1
                self._cond.notify()
            raise

    def _give(self, worker: CompileWorker) -> None:
        with self._cond:
            if worker.alive and not self.closed:
                self._idle.append(worker)
            else:
                self._workers -= 1
                worker.kill()
            self._cond.notify()

    def run(self, what: str, text: str, cancelled: threading.Event, then):
        """``then()``'s answer once a worker compiled the grammar within the deadline (blocking; after
        :meth:`admit`, whose place it keeps until ``then`` returns, and gives back); Refused (from
        :mod:`prunus.serve.grammar_worker`) with xgrammar's message; GrammarTimeout."""
        with self._cond:
            self._running.add(cancelled)
            if self.closed:
                cancelled.set()
        try:
            worker = self._take(cancelled)
            try:
                worker.probe(what, text, self.limits.timeout_s, cancelled)
                return then()  # the same compile here (about as long), kept whether or not awaited; one at a time
            finally:
                self._give(worker)
        except Stopped as e:
            raise (GrammarUnavailable if e.reason in ("startup", "cancelled") else GrammarTimeout)(self._why(e)) \
                from None
        finally:
            with self._cond:
                self._admitted -= 1
                self._running.discard(cancelled)
                self._cond.notify()

    def _why(self, e: Stopped) -> str:
        if e.reason == "deadline":
            return (f"took longer than {self.limits.timeout_s:g} s to compile (PRUNUS_GRAMMAR_TIMEOUT_S); "
                    "simplify it")
        if e.reason == "cancelled":  # its client left (then nobody reads this) or the pool closed
            return "could not be compiled: the server is shutting down; retry on another"
        if e.reason == "startup":
            return f"could not be compiled: the grammar compiler did not start ({e.detail}); retry later"
        return f"stopped the grammar compiler ({e.detail}); simplify it"

    async def compile(self, what: str, text: str, then, receive=None):
        """:meth:`run` off the event loop; ClientGone (the compile stopped) when ``receive`` reports the client gone
        first. The compile is stopped too when the awaiting task is cancelled."""
        self.admit()
        cancelled = threading.Event()
        try:
            work = asyncio.get_running_loop().run_in_executor(self._threads, self.run, what, text, cancelled, then)
        except BaseException:
            with self._cond:
                self._admitted -= 1
            raise
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # a stopped compile's error is not news
        gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        try:
            if gone is None:
                return await work
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            raise ClientGone
        finally:
            if not work.done():
                cancelled.set()
            if gone is not None:
                gone.cancel()

    def close(self) -> None:
        """Stop every worker; compiles in progress end as cancelled."""
        with self._cond:
            self.closed = True
            idle, self._idle = self._idle, []
            for cancelled in self._running:
                cancelled.set()
            self._cond.notify_all()
        for worker in idle:
            worker.kill()
        self._threads.shutdown(wait=False)
