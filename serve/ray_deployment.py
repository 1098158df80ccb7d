"""``prunus serve PATH --replicas N``: the one-process server's FastAPI app in N replicas on Ray Serve.

    url = deploy(path, load, server_options, RaySettings(replicas=2), port=8000)   # returns once it answers
    ...                                                                           # HTTP on url
    stop()

Two deployments make one Ray Serve application, on the proxy's address (``127.0.0.1`` unless told otherwise):

* ``PrunusReplica`` (N replicas, ``--replica-cpus`` each, autoscaling between ``--min-replicas`` and
  ``--max-replicas`` on the requests in progress): each loads its own :class:`prunus.serve.Engine` with the options
  of the one-process server, and builds that server's own app (:func:`prunus.serve.openai_app.build_app`, or the
  Open Inference Protocol's :func:`prunus.serve.oip_server.build_oip_app`) with its guards and its drain; it answers
  :meth:`PrunusReplica.forward` calls, an HTTP request at a time, by running the app on it in process. It pushes
  its metrics to the application's board (:mod:`prunus.serve.ray_metrics`). LoRA adapters (``--lora``) are loaded
  where requests name them, through Ray Serve's model multiplexing (``@serve.multiplexed``,
  ``serve.get_multiplexed_model_id``), at most ``--adapters-per-replica`` on a replica.
* ``PrunusIngress`` (``@serve.ingress``, one replica): the ASGI app the proxy calls
  (:mod:`prunus.serve.ray_ingress`), which hands each request to a replica through a deployment handle routed by
  the prefix-aware router (:mod:`prunus.serve.ray_router`) or Ray's own (``--router default``), and answers
  ``/metrics`` for all replicas.

Ray is imported by this module: the CLI imports it only on this path (:func:`prunus.serve.ray_settings.require_ray`
says which extra to install when it is missing). Every address Ray binds here is loopback unless ``--ray-address``
joins a cluster that says otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import socket
import sys
import threading
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from prunus.artifacts.errors import PrunusError

from .http_access import ServeAccess
from .ray_ingress import IngressApp, IngressSettings, Parcel
from .ray_metrics import NAMESPACE, PUSH_EVERY_S, MetricsBoard, board_name, replica_text
from .ray_settings import RaySettings

APP_NAME = "prunus"
_BOARDS: dict = {}  # app name -> its metrics board's handle
INGRESS_CPUS = 0.1
LOOPBACK = "127.0.0.1"
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Ray Serve's per-request lines off


class PrunusReplica:
    """One replica: an Engine and the one-process server's app over it (see the module docstring)."""

    def __init__(self, path: str, load: dict, server_options: dict, address: tuple, board: str, sys_path=(),
                 adapters: dict | None = None, adapters_per_replica: int = 2):
        from prunus.serve import Engine

        sys.path.extend(p for p in sys_path if p not in sys.path)  # a trusted factory's module (--trust-factory)
        self.engine = Engine.load(path, **load)
        self.server = replica_server(self.engine, server_options, address)
        self.app = self.server.build_app()
        from .shutdown import install

        install(self.app, self.server.drain, self.server.error_body)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.stopped = threading.Event()
        self.board = ray.get_actor(board, namespace=NAMESPACE)
        threading.Thread(target=self._push, args=(self.board,), daemon=True, name="prunus-metrics-push").start()
        self.adapters = dict(adapters or {})

        async def adapter(name: str) -> _Adapter:  # Ray Serve's model multiplexing: at most this many loaded here
            await asyncio.get_running_loop().run_in_executor(None, self.engine.load_adapter, name, self.adapters[name])
            return _Adapter(self.engine, name)
        self.adapter = serve.multiplexed(max_num_models_per_replica=adapters_per_replica)(adapter)

    def describe(self) -> dict:
        """What the ingress needs to know of the app: its error shape and body limit."""
        oip = bool(self.engine.backend.capabilities.predict)
        return {"oip": oip, **({"max_body_bytes": self.server.max_body_bytes} if oip else {})}

    def replica_name(self) -> str:
        return self.name

    def _push(self, board) -> None:
        while not self.stopped.wait(PUSH_EVERY_S):
            try:
                board.put.remote(self.name, replica_text(self.server))
            except Exception as e:  # the board went away (the application is stopping)
                print(f"prunus serve: replica {self.name}: metrics not pushed ({type(e).__name__})", file=sys.stderr)
                return

    async def forward(self, parcel: Parcel):
        """The app's ASGI messages answering ``parcel``; a cancelled call is the client leaving (a disconnect)."""
        queue: asyncio.Queue = asyncio.Queue()
        gone, given = asyncio.Event(), []

        async def receive():
            if not given:
                given.append(True)
                return {"type": "http.request", "body": parcel.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await queue.put(message)
        name = serve.get_multiplexed_model_id()
        if name in self.adapters:  # a LoRA adapter's request: loaded here first (the least used one unloaded)
            await self.adapter(name)
        scope = {**parcel.scope(), "server": tuple(self.server.server_address)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (message := await queue.get()) is not None:
                yield message
            task.result()
        finally:
            gone.set()  # the app sees the client leave: its engine rows are cancelled

    def __del__(self):
        if hasattr(self, "stopped"):
            self.stopped.set()
        board = getattr(self, "board", None)
        if board is not None:
            try:
                board.drop.remote(self.name)  # its counts leave /metrics with it
            except Exception:  # the board is gone too (the application is stopping)
                pass
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


class _Adapter:
    """A LoRA adapter loaded on a replica's engine; Ray Serve unloads it (``__del__``) when it evicts it."""

    def __init__(self, engine, name: str):
        self.engine, self.name = engine, name

    def __del__(self):
        if self.name in self.engine.adapter_names():
            self.engine.unload_adapter(self.name)  # requests running with it finish with it


def replica_server(engine, options: dict, address: tuple):
    """The one-process server over ``engine``, answering as if it listened on ``address`` (the proxy's): its
    Host check names that address. Its own socket (bound to a free loopback port on creation) is closed."""
    from .http_server import CompletionServer
    from .oip_server import OIPServer

    predicts = engine.backend.capabilities.predict
    kwargs = {k: v for k, v in options.items() if predicts or k != "max_body_bytes"}
    server = (OIPServer if predicts else CompletionServer)(engine, LOOPBACK, 0, **kwargs)
    server.socket.close()
    server.server_address = tuple(address)
    return server


class PrunusIngress:
    """The application's ingress (see the module docstring); its app is built once a replica has described it."""

    def __init__(self, replicas, settings: IngressSettings):
        self.replicas, self.settings = replicas, settings

    async def __serve_build_asgi_app__(self):
        settings = dataclasses.replace(self.settings, **await self.replicas.describe.remote())
        return IngressApp(self.replicas, settings, ray.get_actor(settings.board, namespace=NAMESPACE))


def application(path, load: dict, server_options: dict, settings: RaySettings, address: tuple,
                app_name: str = APP_NAME):
    """The bound Ray Serve application of the module docstring."""
    ongoing = int(load.get("max_batch", 8)) + int(load.get("max_queue") or 64)  # what an engine holds; more wait in Ray
    scaling = ({"autoscaling_config": {"min_replicas": settings.lowest, "max_replicas": settings.highest,
                                       "initial_replicas": settings.initial,
                                       "target_ongoing_requests": settings.target_ongoing}}
               if settings.autoscaling else {"num_replicas": settings.initial})
    router = ({"request_router_config": RequestRouterConfig(
        request_router_class="prunus.serve.ray_router.PrefixAffinityRouter",
        request_router_kwargs={"imbalanced_threshold": settings.imbalance})} if settings.router == "prefix" else {})
    grace = float(server_options.get("shutdown_grace", 5.0))
    replica = serve.deployment(PrunusReplica, name="PrunusReplica", max_ongoing_requests=ongoing,
                               ray_actor_options={"num_cpus": settings.replica_cpus},
                               graceful_shutdown_timeout_s=grace + 1, logging_config=QUIET, **scaling, **router)
    ingress = serve.deployment(serve.ingress()(PrunusIngress), name="PrunusIngress", num_replicas=1,
                               max_ongoing_requests=max(256, ongoing * settings.highest),
                               ray_actor_options={"num_cpus": INGRESS_CPUS}, logging_config=QUIET)
    board = board_name(app_name)
    load = dict(load)
    adapters = load.pop("lora", None) or {}  # loaded where requests ask for them (Ray Serve's multiplexing)
    if adapters:
        load["prepare"] = None  # LoRA needs the torch backend
    ingress_settings = IngressSettings(access=server_options.get("access") or ServeAccess(), address=tuple(address),
                                       board=board, adapters=tuple(adapters))
    sys_path = [os.getcwd()] if load.get("trust_factory") else []
    return ingress.bind(replica.bind(str(path), load, server_options, tuple(address), board, sys_path,
                                     {k: str(Path(v).resolve()) for k, v in adapters.items()},
                                     settings.adapters_per_replica), ingress_settings)


def start(settings: RaySettings, host: str = LOOPBACK, port: int = 8000) -> tuple[str, int]:
    """Ray (joined at ``--ray-address``, or a local cluster on loopback) and Serve's proxy on (host, port)."""
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    if not ray.is_initialized():
        if settings.ray_address is not None:
            _join(settings.ray_address)
        else:
            os.environ.setdefault("RAY_NODE_IP_ADDRESS", LOOPBACK)
            cpus = settings.ray_cpus or max(2, math.ceil(settings.highest * settings.replica_cpus + INGRESS_CPUS))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, _node_ip_address=LOOPBACK,
                     logging_level="WARNING")  # local: a new cluster, even beside a running `ray start`
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    return host, port


def _join(address: str) -> None:
    try:
        ray.init(address=address, logging_level="WARNING")
    except (ConnectionError, RuntimeError) as e:
        raise PrunusError(f"--ray-address {address}: cannot join that Ray cluster ({_last_line(str(e))[:200]}); start "
                          "one with `ray start --head`, and with token authentication (Ray's default) give its token "
                          "(RAY_AUTH_MODE=token, and ~/.ray/auth_token or RAY_AUTH_TOKEN)") from None


def deploy(path, load: dict, server_options: dict, settings: RaySettings, host: str = LOOPBACK, port: int = 8000,
           app_name: str = APP_NAME) -> str:
    """Start Ray and Serve (:func:`start`), run the application; its URL once every replica is up."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise PrunusError(f"{path}: no such model dir or export dir; give the dir prunus train, compress or export "
                          "wrote")
    host, port = start(settings, host, port)
    board = _BOARDS.get(app_name) or ray.remote(num_cpus=0)(MetricsBoard).options(
        name=board_name(app_name), namespace=NAMESPACE, get_if_exists=True).remote()
    ray.get(board.fresh.remote())  # up before the replicas look for it
    _BOARDS[app_name] = board  # the board lives as long as this process holds this handle (its first)
    try:
        serve.run(application(path, load, server_options, settings, (host, port), app_name), name=app_name,
                  route_prefix="/", blocking=False)
    except RuntimeError as e:  # a replica failed to start: the error it raised (a PrunusError's own line)
        raise PrunusError(f"the replicas of {path} did not start: "
                          f"{_replica_error(app_name) or _last_line(str(e))}") from None
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _replica_error(app_name: str) -> str | None:
    """The message of the last exception a replica's constructor raised, from Serve's status of the deployment."""
    import re

    try:
        deployment = serve.status().applications[app_name].deployments.get("PrunusReplica")
    except Exception:  # no status to read
        return None
    lines = [line.strip() for line in (deployment.message if deployment else "").splitlines()]
    errors = [line.split(": ", 1)[1] for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return errors[-1][:300] if errors else None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no reason given"


def stop(app_name: str = APP_NAME, *, shutdown_ray: bool = True) -> None:
    """Delete the application (its replicas drain) and its metrics board; stop Serve and Ray too when this process
    started them (``shutdown_ray``), never on a cluster it joined."""
    serve.delete(app_name)
    board = _BOARDS.pop(app_name, None)
    if board is not None:
        ray.kill(board)
    if shutdown_ray:
        serve.shutdown()
        ray.shutdown()


def run(path, load: dict, server_options: dict, settings: RaySettings, host: str = LOOPBACK, port: int = 8000, *,
        echo=print) -> None:
    """``prunus serve --replicas N``: deploy, say where in one line, serve until Ctrl-C / SIGTERM (the CLI makes
    SIGTERM a KeyboardInterrupt), then stop (the replicas drain for the shutdown grace)."""
    import signal
    import time

    started_here = not ray.is_initialized() and settings.ray_address is None
    try:
        url = deploy(path, load, server_options, settings, host, port)
    except BaseException:
        if ray.is_initialized():
            try:
                stop(shutdown_ray=started_here)
            except Exception as e:  # what failed to start may not stop cleanly; the first error is the one to say
                echo(f"prunus serve: stopping after a failed start: {type(e).__name__}")
        raise
    scaling = (f"{settings.lowest} to {settings.highest} replicas (autoscaling, {settings.initial} at the start)"
               if settings.autoscaling else f"{settings.initial} replica{'s' * (settings.initial > 1)}")
    if threading.current_thread() is threading.main_thread():  # ray.init put its own SIGTERM handler in
        signal.signal(signal.SIGTERM, _interrupt)
    echo(f"prunus serve: {path} in {scaling} on Ray Serve ({settings.replica_cpus:g} CPU each, {settings.router} "
         f"router) listening on {url}")
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        echo("prunus serve: shutting down the replicas")
    finally:
        stop(shutdown_ray=started_here)
