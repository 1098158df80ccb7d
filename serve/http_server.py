"""The HTTP server: a FastAPI app (:mod:`prunus.serve.openai_app`, or the Open Inference Protocol's in
:mod:`prunus.serve.oip_server`) on uvicorn, behind prunus's guards.

    server = CompletionServer(engine, "127.0.0.1", 8000, access=ServeAccess(api_key="..."))
    server.serve_forever()          # until Ctrl-C / SIGTERM, or server.shutdown() from another thread
    server.server_close()

Ctrl-C / SIGTERM / ``shutdown()`` drain the server (:mod:`prunus.serve.shutdown`): new requests get 503 at once,
those in progress have ``shutdown_grace`` seconds to finish, the rest are cut (a stream with an error event and
``[DONE]``, a whole answer with 503), and one line says how many finished and were cut.

The socket is bound when the server is made (``server_address`` and ``url`` are known at once; port 0 picks a
free one) with a listen backlog of ``max_connections`` (default: twice the queue plus the batch, at least 64).
The guards: the connection cap (429), the header deadline (408) and malformed HTTP (JSON 400 / 431) per
connection (:mod:`prunus.serve.http_connection`); the door, methods, media type and the body's size and
deadline per request (:mod:`prunus.serve.asgi_guard`); a full wait queue is 429 and a client that leaves
cancels its rows (:mod:`prunus.serve.openai_generate`). Every engine wait runs in the server's thread pool,
never on the event loop.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from prunus.artifacts.errors import PrunusError

from .http_access import ServeAccess
from .http_connection import ConnectionLimits, guarded_protocol
from .metrics import CONTENT_TYPE, Metrics
from .sampling_defaults import sampling_defaults
from .shutdown import CUT_WAIT_S, SHUTDOWN_GRACE_S, Drain, install, log

HEADER_TIMEOUT_S = 10.0  # request line + headers (and an idle kept-alive connection)
BODY_TIMEOUT_S = 30.0  # the body, once the headers are in
WRITE_TIMEOUT_S = 60.0  # a client that reads nothing of a full write buffer


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise PrunusError(f"--port {port} is not a TCP port; choose one from 0 (any free port) to 65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except (OSError, OverflowError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise PrunusError(f"cannot listen on {host}:{port} ({reason}); choose another --host/--port") from None
    sock.setblocking(False)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose SIGINT / SIGTERM begin the drain (a second one cuts at once) and whose loop stops once
    the drain is over; the signal is handled here, not raised again after the server stops."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig, frame) -> None:
        self.drain.request()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.step():
            return True
        return await super().on_tick(counter)


class CompletionServer:
    """The OpenAI-compatible endpoint over a generative Engine (see the module docstring). ``served_model_names``:
    the names clients may give as ``model`` (default: the served dir's name). ``shutdown_grace``: seconds the
    requests in progress have to finish once the server is asked to stop."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 8000, *, max_connections: int | None = None,
                 header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = BODY_TIMEOUT_S,
                 write_timeout: float = WRITE_TIMEOUT_S, access: ServeAccess | None = None,
                 served_model_names: list[str] | tuple[str, ...] | None = None,
                 shutdown_grace: float = SHUTDOWN_GRACE_S):
        self.engine = engine
        self.drain = Drain(shutdown_grace)
        self.access = access or ServeAccess()
        self.metrics, self.metrics_type = Metrics(engine.scheduler), CONTENT_TYPE
        default_name = Path(engine.info.get("path", "prunus")).name or "prunus"
        self.model_names = list(dict.fromkeys(served_model_names or [])) or [default_name]
        self.model_name = self.model_names[0]
        self.started = int(time.time())
        queue_size = getattr(engine.scheduler, "max_queue", None) or 64
        self.max_connections = max_connections or max(64, 2 * (queue_size + int(engine.info.get("max_batch", 8))))
        self.request_queue_size = self.max_connections  # the listen backlog: a burst waits instead of being reset
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.defaults = self.sampling_defaults()
        self.socket = _listen(host, port, self.max_connections)
        self.server_address = self.socket.getsockname()[:2]
        self.pool = ThreadPoolExecutor(min(512, 2 * self.max_connections + 16), thread_name_prefix="prunus-http")
        limits = ConnectionLimits(self.max_connections, header_timeout, write_timeout, self.metrics.observe)
        app = self.build_app()
        install(app, self.drain, self.error_body)
        config = uvicorn.Config(app, http=guarded_protocol(limits), ws="none", lifespan="off",
                                loop="asyncio", log_config=None, log_level="error", access_log=False,
                                timeout_keep_alive=max(int(header_timeout), 1), backlog=self.max_connections,
                                timeout_graceful_shutdown=CUT_WAIT_S, server_header=False)
        self._uvicorn = DrainingServer(config, self.drain)
        self._stopped = threading.Event()
        self._stopped.set()  # not serving yet

    def error_body(self, error) -> bytes:
        """An error answer's body: OpenAI's shape (the Open Inference Protocol server writes its own)."""
        return error.body()

    def sampling_defaults(self) -> dict:
        return sampling_defaults(self.engine.info.get("path"))

    def build_app(self):
        from .openai_app import build_app

        return build_app(self)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until :meth:`shutdown` (another thread), Ctrl-C or SIGTERM (in the main thread), then say in one
        line how the requests in progress ended."""
        self._stopped.clear()
        try:
            self._uvicorn.run(sockets=[self.socket])
            if self.drain.draining:
                log(self.drain.summary())
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain and stop the server (see the module docstring); wait up to ``timeout`` seconds for it."""
        self.drain.request()
        self._stopped.wait(timeout)

    def server_close(self) -> None:
        self.socket.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
