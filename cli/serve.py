"""prunus serve: an OpenAI-compatible HTTP endpoint over a model dir or an export dir; the Open Inference
Protocol (KServe v2) over a generic module's model dir or its ONNX export dir."""

from __future__ import annotations

import dataclasses
import signal

import click
from click.core import ParameterSource

from prunus.serve.k8s_manifests import K8sSettings
from prunus.serve.ray_settings import RaySettings
from prunus.serve.shutdown import SHUTDOWN_GRACE_S

from .command_line import as_arguments
from .options import access_options, backend_option, compile_option, device_option, kv_dtype_option, native_option, prefill_chunk_option, \
    prepare_option, prompt_graph_option, resolve_device, serving_feature_options


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _device_map(value: str | None):
    """--device-map: None, "auto", or a JSON object (one line when it is neither)."""
    if value is None or value == "auto":
        return value
    import json

    from prunus.artifacts.errors import PrunusError

    try:
        return json.loads(value)
    except ValueError:
        raise PrunusError(f"--device-map {value!r}: give auto or a JSON object such as '{{\"layers.0\": 0}}'") from None


def k8s_options(command):
    """--print-k8s [manifests|dockerfile] and one --k8s-* option per K8sSettings field (its metadata's help and
    type), passed to the command as ``k8s_<field>`` (None when not given)."""
    for f in reversed(dataclasses.fields(K8sSettings)):
        kind = f.metadata["type"]
        command = click.option("--k8s-" + f.name.replace("_", "-"), "k8s_" + f.name, default=None,
                               type=click.Choice(kind) if isinstance(kind, tuple) else kind,
                               help=f.metadata["help"])(command)
    return click.option("--print-k8s", type=click.Choice(["manifests", "dockerfile"]), is_flag=False,
                        flag_value="manifests", default=None,
                        help="Print Kubernetes manifests serving PATH with these options (a Deployment, Service and "
                             "HorizontalPodAutoscaler; a KServe InferenceService for a generic module), or with "
                             "'dockerfile' their image's Dockerfile, and exit; loads nothing. Give it after "
                             "PATH.")(command)


def ray_options(command):
    """--replicas, --ray-address and the rest: one option per RaySettings field (its metadata's help and type),
    passed to the command under the field's name (None when not given)."""
    for f in reversed(dataclasses.fields(RaySettings)):
        kind = f.metadata["type"]
        command = click.option("--" + f.name.replace("_", "-"), f.name, default=None,
                               type=click.Choice(kind) if isinstance(kind, tuple) else kind,
                               help=f.metadata["help"])(command)
    return command


@click.command("serve")
@click.argument("path", type=click.Path())
@backend_option
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel worker processes (torch backend).")
@device_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True, help="Sequences decoded together (cache rows).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Waiting requests before answering 429; also sizes the listen backlog and the connection cap.")
@click.option("--max-len", type=click.IntRange(min=1), default=None, help="Tokens per sequence (prompt + output). Default: the model's.")
@compile_option
@prefill_chunk_option
@prompt_graph_option
@native_option
@kv_dtype_option
@prepare_option
@click.option("--device-map", default=None,
              help="auto (with --max-memory), or a JSON object {module: device}: the model's blocks placed across "
                   "GPUs, the CPU and the disk (streamed from the memory-mapped weights).")
@click.option("--max-memory", default=None, help="Budgets for --device-map auto, e.g. 0=10GiB,cpu=30GiB,disk=100GiB.")
@click.option("--trust-factory", is_flag=True,
              help="A generic module's model dir: import the factory its config.json names (that runs its code). "
                   "Or list trusted specs in PRUNUS_TRUST_FACTORIES.")
@click.option("--max-delay-ms", type=click.FloatRange(min=0, max=10_000), default=2.0, show_default=True,
              help="A generic module: how long a request waits for others to share its forward pass (dynamic batching).")
@click.option("--max-body-mb", type=click.IntRange(min=1, max=4096), default=64, show_default=True,
              help="A generic module: the largest infer request body, in MiB (JSON or binary tensor data); 413 over it.")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="A name clients give as 'model' (repeat for aliases; GET /v1/models lists them). Default: the "
                   "served dir's name. Any other 'model' is answered 404 model_not_found.")
@click.option("--lora", "lora", multiple=True, metavar="NAME=ADAPTER_DIR",
              help="Serve a PEFT LoRA adapter dir over the base under NAME (repeat for more; a request's 'model' picks "
                   "one; torch backend in one process).")
@click.option("--shutdown-grace", type=click.FloatRange(min=0, max=3600), default=SHUTDOWN_GRACE_S, show_default=True,
              metavar="SECONDS",
              help="On SIGTERM or Ctrl-C: new requests get 503 at once, those in progress have this long to finish; "
                   "then streams still open end with an error event and [DONE], other answers with 503.")
@serving_feature_options
@access_options
@k8s_options
@ray_options
@click.pass_context
def command(ctx, path, backend, tp, device, host, port, max_batch, max_queue, max_len, compile_, prefill_chunk,
            device_map, max_memory, prompt_graph, native, kv_dtype, prepare, trust_factory, max_delay_ms, max_body_mb,
            served_model_names, shutdown_grace, prefix_cache_mb, draft, draft_tokens, lora=(), **access):
    """Serve PATH on POST /v1/completions, /v1/chat/completions, GET /v1/models, /health, /metrics and /docs
    (FastAPI on uvicorn) until Ctrl-C or SIGTERM (a drain of --shutdown-grace seconds);
    a generic module (model dir or ONNX export dir) on the Open Inference Protocol: POST /v2/models/NAME/infer."""
    import os
    import sys

    from prunus.serve.http_access import ServeAccess

    k8s = {name: access.pop(name) for name in [n for n in access if n.startswith("k8s_")]}
    print_k8s = access.pop("print_k8s")
    ray = _ray_settings(access, print_k8s is not None)
    if print_k8s is not None or any(value is not None for value in k8s.values()):
        return _print_k8s(ctx, path, print_k8s, k8s, api_key=access.get("api_key") is not None, grace=shutdown_grace)
    if trust_factory and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a trusted factory's module may sit in the current directory

    access = ServeAccess.from_options(**access)  # a bad key or list fails before the model loads
    adapters = _lora(lora)
    # SIGTERM while the model loads ends the command like Ctrl-C: the engine closes and its workers with it (the
    # caller's handler is put back after, for a caller that runs this command in its own process); once serving,
    # the server drains on either (prunus.serve.shutdown)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _serve(path, backend, tp, device, host, port, max_batch, max_queue, max_len, compile_, prefill_chunk,
               device_map, max_memory, prompt_graph, native, access,
               predict={"trust_factory": trust_factory or None, "max_delay_ms": max_delay_ms},
               served_model_names=[n.strip() for name in served_model_names for n in name.split(",") if n.strip()],
               features={"prefix_cache_mb": prefix_cache_mb, "draft": draft, "draft_tokens": draft_tokens,
                         **({"lora": adapters} if adapters else {})},
               kv_dtype=kv_dtype, prepare=prepare, shutdown_grace=shutdown_grace, max_body_mb=max_body_mb, ray=ray)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ray_settings(options: dict, print_k8s: bool) -> RaySettings:
    """The RaySettings of the command's options (popped from ``options``); one line for one given in vain."""
    from prunus.artifacts.errors import PrunusError

    ray = RaySettings.from_options(**{f.name: options.pop(f.name) for f in dataclasses.fields(RaySettings)})
    if ray.active and print_k8s:
        raise PrunusError("--replicas / --ray-address serve on Ray Serve; --print-k8s writes manifests (scale them "
                          "with --k8s-replicas): drop one")
    flag = ray.given_without_replicas()
    if flag is not None:
        raise PrunusError(f"{flag} applies to replicas on Ray Serve; add --replicas N (or --ray-address), or drop "
                          f"{flag}")
    return ray


def _print_k8s(ctx, path, what, k8s: dict, *, api_key: bool, grace: float) -> None:
    """--print-k8s: the manifests (or the Dockerfile) of this command run in a pod."""
    from prunus.artifacts.errors import PrunusError
    from prunus.serve.k8s_manifests import plan, render_dockerfile, render_manifests

    if what is None:
        flag = "--" + next(name for name, value in k8s.items() if value is not None).replace("_", "-")
        raise PrunusError(f"{flag} applies with --print-k8s; add --print-k8s, or drop {flag}")
    p = plan(path, K8sSettings.from_options(**k8s), _given_args(ctx), api_key=api_key, grace_s=grace)
    click.echo(render_dockerfile(p) if what == "dockerfile" else render_manifests(p), nl=False)


def _given_args(ctx) -> list[str]:
    """The options this command was given on the command line, as arguments for the pod's prunus serve (the
    address, the device and the API key apart: the pod listens on 0.0.0.0 on a CPU and reads the key from a
    Secret)."""
    from prunus.serve.k8s_manifests import NOT_CARRIED, check_carried

    given = {p.name: ctx.params[p.name] for p in ctx.command.params if isinstance(p, click.Option)
             and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE}
    check_carried(given)
    return as_arguments(ctx, given, lambda name: name in NOT_CARRIED or name.startswith(("k8s_", "print_k8s")))


def _prepare_step():
    from prunus.export import prepared_path

    return prepared_path


def _serve(path, backend, tp, device, host, port, max_batch, max_queue, max_len, compile_, prefill_chunk, device_map,
           max_memory, prompt_graph=False, native=None, access=None, predict=None, served_model_names=None,
           kv_dtype="f32", features=None, prepare=False, shutdown_grace=SHUTDOWN_GRACE_S, max_body_mb=64, ray=None):
    from prunus.serve import Engine
    from prunus.serve.http_server import CompletionServer
    from prunus.serve.oip_server import OIPServer

    load = dict(backend=backend, tp=tp, device=resolve_device(device), max_batch=max_batch, max_len=max_len,
                max_queue=max_queue, compile="auto" if compile_ is None else compile_,
                prefill_chunk="auto" if prefill_chunk is None else (prefill_chunk or None),
                device_map=_device_map(device_map), max_memory=max_memory, prompt_graph=prompt_graph,
                native="auto" if native is None else native, kv_dtype=kv_dtype,
                prepare=_prepare_step() if prepare else None, **(predict or {}), **(features or {}))
    if ray is not None and ray.active:
        return _serve_replicas(path, load, ray, host, port, access=access, shutdown_grace=shutdown_grace,
                               served_model_names=served_model_names or None, max_body_bytes=max_body_mb << 20)
    with Engine.load(path, **load) as engine:
        predicts = engine.backend.capabilities.predict  # a generic module: the Open Inference Protocol
        server = (OIPServer if predicts else CompletionServer)(engine, host, port, access=access,
                                                              served_model_names=served_model_names or None,
                                                              shutdown_grace=shutdown_grace,
                                                              **({"max_body_bytes": max_body_mb << 20} if predicts else {}))
        info = engine.info
        if access is None or access.api_key is None:
            if not _loopback(server.server_address[0]):
                click.echo(f"prunus serve: warning: no --api-key, and {host} is reachable from other machines; anyone "
                           "who can reach it may use it (set PRUNUS_API_KEY)", err=True)
        what = (f"max batch {info['max_batch']}, max delay {info['max_delay_ms']:g} ms, POST /v2/models/"
                f"{server.model_name}/infer" if predicts else
                f"tp={info['tp']}, max batch {info['max_batch']}, context {info['max_len']}")
        prepared = info.get("prepared") or {}
        how = (f", its export cached in {prepared['export']}" if "export" in prepared else
               f", not prepared: {prepared['skipped']}" if "skipped" in prepared else "")
        click.echo(f"prunus serve: {info['path']} on {_runtime_words(info)} ({what}{how}) listening on {server.url}",
                   err=True)
        try:
            server.serve_forever(poll_interval=0.2)  # SIGINT / SIGTERM drain it, and it says so in one line
        except KeyboardInterrupt:  # before the server took the signals over
            click.echo("prunus serve: shutting down", err=True)
        finally:
            server.server_close()


def _serve_replicas(path, load: dict, ray: RaySettings, host: str, port: int, **server_options) -> None:
    """--replicas / --ray-address: the same server in replicas on Ray Serve (prunus.serve.ray_deployment), until
    Ctrl-C or SIGTERM."""
    import os

    from prunus.serve.ray_settings import require_ray

    ray.check_load(load, os.cpu_count())
    require_ray()
    from prunus.serve.ray_deployment import run

    access = server_options.get("access")
    if (access is None or access.api_key is None) and not _loopback(host):
        click.echo(f"prunus serve: warning: no --api-key, and {host} is reachable from other machines; anyone "
                   "who can reach it may use it (set PRUNUS_API_KEY)", err=True)
    run(path, load, server_options, ray, host, port, echo=lambda line: click.echo(line, err=True))


def _runtime_words(info: dict) -> str:
    """What runs the model, for the startup line: the backend, or the native kernels' path; why not native."""
    if info.get("runtime") == "native":  # with what the export's check of them found (runtime.native_parity)
        parity = (info.get("native_parity") or "not checked").split(" (")[0]
        return f"prunus's native kernels ({info.get('native_isa')}; parity {parity})"
    native = info.get("native", "")
    return info["backend"] + (f" (native {native})" if native.startswith("off") else "")


def _lora(values) -> dict:
    """--lora NAME=ADAPTER_DIR (repeated) -> {name: dir}; one line for a malformed or repeated name."""
    from prunus.artifacts.errors import PrunusError

    out = {}
    for value in values:
        name, sep, where = value.partition("=")
        if not sep or not name.strip() or not where.strip():
            raise PrunusError(f"--lora {value[:80]!r}: give NAME=ADAPTER_DIR (a PEFT adapter dir)")
        if name.strip() in out:
            raise PrunusError(f"--lora {name.strip()[:60]!r} is given twice; give each adapter one name")
        out[name.strip()] = where.strip()
    return out


def _loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
