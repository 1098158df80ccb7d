"""Kubernetes manifests of a ``prunus serve`` (``prunus serve PATH --print-k8s``), and the Dockerfile of their image.

Printed, never applied: nothing here loads the model, starts a server or talks to a cluster. What is read of
PATH is its config.json (a generative model, or a generic module: ``"kind": "module"``) and its manifest
(``prunus.json``: which files the dir holds, summed for the memory and CPU the pod requests). The weights are
not hashed here; ``prunus serve`` checks them against the manifest when the pod starts.

* a generative model dir or export dir: a Deployment whose container runs
  ``prunus serve /models/NAME --host 0.0.0.0 --port 8000`` with the user's serve options, a Service, and a
  HorizontalPodAutoscaler (autoscaling/v2, on CPU utilisation);
* a generic module (model dir or ONNX export dir): a KServe ``InferenceService`` (serving.kserve.io/v1beta1)
  whose custom predictor container runs the same command and speaks the Open Inference Protocol (KServe reads
  ``PROTOCOL=v2`` from a custom container's environment).

The model is baked into the image by default (``--k8s-model-from image``: the Dockerfile copies the dir to
``/models/NAME``); ``--k8s-model-from pvc`` mounts a PersistentVolumeClaim at ``/models`` read-only instead (the
dir copied onto the claim as ``NAME/``). The container listens on 0.0.0.0, as a pod must, and accepts the
Service's in-cluster names as ``Host`` (``--allowed-hosts``); an API key comes from a Secret, never from the
manifest. This module is to Kubernetes what :mod:`prunus.train_parallel.launch.slurm` is to Slurm.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.manifest_schema import MANIFEST, check_manifest
from prunus.artifacts.validate import read_dir_json, short

PORT = 8000
MODELS = "/models"  # where the model dir lies in the container: /models/NAME
CACHE = "/cache"  # an emptyDir: prepared exports, compiled native kernels
MAX_REPLICAS = 1000
CPU_TARGET_PERCENT = 70  # the autoscaler's target: mean CPU use over requests
MAX_CPUS = 16
GIB, MIB = 1 << 30, 1 << 20
MAX_FILES = 100_000  # manifest entries summed for the weights' size
# a DNS-1123 label that starts with a letter: Service and InferenceService names need both (RFC 1035)
_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")
KSERVE_CONTAINER = "kserve-container"  # the name KServe gives a custom predictor's container


def _help(text: str, **more) -> dict:
    return {"help": "With --print-k8s: " + text, **more}


@dataclass(frozen=True)
class K8sSettings:
    """What the manifests name and how they scale; ``prunus serve`` makes one ``--k8s-*`` option of each field
    (``metadata["help"]``, ``metadata["type"]``). None: the default said in the help."""

    name: str | None = field(default=None, metadata=_help(
        "the objects' name, a DNS label (lower-case letters, digits and '-', starting with a letter, at most 63). "
        "Default: from the dir's name.", type=str))
    namespace: str = field(default="default", metadata=_help("the namespace, a DNS label.", type=str))
    image: str | None = field(default=None, metadata=_help(
        "the container image (built from --print-k8s dockerfile). Default: prunus-NAME:latest.", type=str))
    replicas: int = field(default=1, metadata=_help(f"pods at the start (1 to {MAX_REPLICAS}).", type=int))
    min_replicas: int | None = field(default=None, metadata=_help(
        "the fewest pods the autoscaler keeps. Default: --k8s-replicas.", type=int))
    max_replicas: int | None = field(default=None, metadata=_help(
        "the most pods the autoscaler starts. Default: 4, or --k8s-replicas if more.", type=int))
    model_from: str = field(default="image", metadata=_help(
        "image: the model is copied into the image (the Dockerfile's COPY); pvc: a PersistentVolumeClaim holding "
        "the dir as NAME/ is mounted at /models.", type=("image", "pvc")))
    pvc: str | None = field(default=None, metadata=_help(
        "with --k8s-model-from pvc: the claim's name. Default: NAME-model.", type=str))

    def __post_init__(self) -> None:
        if self.name is not None:
            check_label(self.name, "--k8s-name")
        check_label(self.namespace, "--k8s-namespace")
        if self.image is not None and not _IMAGE.match(self.image):
            raise PrunusError(f"--k8s-image {short(self.image)} is not an image reference; give one such as "
                              "registry.example.com/team/model:1.0")
        for flag, value in (("--k8s-replicas", self.replicas), ("--k8s-min-replicas", self.min_replicas),
                            ("--k8s-max-replicas", self.max_replicas)):
            if value is not None and not (isinstance(value, int) and 1 <= value <= MAX_REPLICAS):
                raise PrunusError(f"{flag} {short(value)} is out of range; give 1 to {MAX_REPLICAS}")
        if not self.lowest <= self.replicas <= self.highest:
            raise PrunusError(f"--k8s-min-replicas {self.lowest}, --k8s-replicas {self.replicas} and "
                              f"--k8s-max-replicas {self.highest} must rise in that order; change one")
        if self.model_from not in ("image", "pvc"):
            raise PrunusError(f"--k8s-model-from {short(self.model_from)}: give image or pvc")
        if self.pvc is not None:
            if self.model_from != "pvc":
                raise PrunusError("--k8s-pvc names a claim for --k8s-model-from pvc; add that, or drop --k8s-pvc")
            check_label(self.pvc, "--k8s-pvc")

    @property
    def lowest(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def highest(self) -> int:
        return max(4, self.replicas) if self.max_replicas is None else self.max_replicas

    @classmethod
    def from_options(cls, **options) -> "K8sSettings":
        """From ``prunus serve``'s ``k8s_*`` options (None: not given)."""
        given = {f.name: options.get("k8s_" + f.name) for f in fields(cls)}
        return cls(**{k: v for k, v in given.items() if v is not None})


# serve options the pod does not take as given: its own address and device, the key (from a Secret)
NOT_CARRIED = ("host", "port", "device", "api_key")


def check_carried(given: dict) -> None:
    """One PrunusError line for a serve option the pod could not run as given (``given``: option name -> value)."""
    if given.get("lora"):
        raise PrunusError("--lora names adapter dirs on this machine, which the pod does not have; drop --lora "
                          "(copy the adapters into the image and add --lora to the manifest's command by hand)")
    draft = given.get("draft")
    if draft is not None and draft not in ("ngram", "auto"):
        raise PrunusError(f"--speculative {short(draft)} names a draft dir on this machine, which the pod does not "
                          "have; give --speculative ngram or auto (a draft beside the model in the image), or drop it")
    if given.get("device") not in (None, "cpu", "auto"):
        raise PrunusError(f"--device {short(given['device'])}: --print-k8s writes manifests for CPU nodes; "
                          "drop --device")
    if given.get("backend") == "tensorrt":
        raise PrunusError("--backend tensorrt needs a GPU; --print-k8s writes manifests for CPU nodes, so drop it")


def check_label(value, flag: str) -> str:
    if not isinstance(value, str) or not _LABEL.match(value):
        raise PrunusError(f"{flag} {short(value)} is not a DNS label; give lower-case letters, digits and '-', "
                          "starting with a letter and ending with a letter or digit, at most 63 characters")
    return value


def label_from(dir_name: str) -> str:
    """A DNS label from a dir's name: lower-cased, other characters as '-', a letter first, at most 63."""
    text = re.sub(r"[^a-z0-9]+", "-", dir_name.lower()).strip("-")
    if not text[:1].isalpha():
        text = "model-" + text if text else "model"
    return text[:63].rstrip("-")


@dataclass(frozen=True)
class Served:
    """What the manifests need of the served dir: its name, whether a generic module, its files' bytes."""

    path: Path
    dir_name: str
    generic: bool
    export: bool
    weights_bytes: int


def inspect_dir(path: str | Path) -> Served:
    """The served dir read as much as the manifests need, or one PrunusError line for a PATH that is no model
    dir or export dir (or one a CPU pod cannot serve)."""
    path = Path(path)
    what = "give a model dir (prunus train/compress/convert) or an export dir (prunus export)"
    config = read_dir_json(path, "config.json", no_dir=f"no such directory; {what}", no_file=f"no config.json; {what}",
                           bad_json="re-create the dir")
    manifest = read_dir_json(path, MANIFEST, no_dir=f"no such directory; {what}",
                             no_file=f"no {MANIFEST}, so not a prunus model dir or export dir; {what}",
                             bad_json="re-create the dir")
    check_manifest(manifest, path)
    files = manifest["files"]
    export = config.get("export")
    if export is not None and not isinstance(export, dict):
        raise PrunusError(f"{path}/config.json: 'export' is not an object; re-create the export dir")
    fmt = (export or {}).get("format")
    if fmt == "tensorrt":
        raise PrunusError(f"{path}: a TensorRT export needs a GPU; --print-k8s writes manifests for CPU nodes, so "
                          "give the model dir or its ONNX export")
    if export is not None and fmt != "onnx":
        raise PrunusError(f"{path}/config.json: unknown export format {short(fmt)}; re-create the export dir")
    graph = any(name.endswith(".onnx") for name in files)
    if "config.json" not in files or not (graph if export is not None else "model.safetensors" in files):
        kind = "an ONNX graph" if export is not None else "model.safetensors"
        raise PrunusError(f"{path / MANIFEST}: does not list config.json and {kind}; {what}")
    if len(files) > MAX_FILES:
        raise PrunusError(f"{path / MANIFEST}: lists {len(files)} files, over {MAX_FILES}; re-create the dir")
    size = sum(inside(path, name, f"{path / MANIFEST}: files", fix="re-create the dir").stat().st_size
               for name in files)
    return Served(path, path.resolve().name, config.get("kind") == "module", export is not None, size)


def resources(weights_bytes: int) -> dict:
    """Requests and limits from the bytes of the dir: memory 2x the weights + 1 GiB (3x + 2 GiB at most: a model
    dir is exported once at the start on a CPU), one CPU per 512 MiB of weights (1 to 16), no CPU limit."""
    cpus = min(MAX_CPUS, max(1, math.ceil(weights_bytes / (512 * MIB))))
    request = math.ceil((2 * weights_bytes + GIB) / MIB)
    limit = math.ceil((3 * weights_bytes + 2 * GIB) / MIB)
    return {"requests": {"cpu": str(cpus), "memory": f"{request}Mi"}, "limits": {"memory": f"{limit}Mi"}}


def allowed_hosts(name: str, namespace: str, generic: bool) -> list[str]:
    """The in-cluster names of the Service (KServe's predictor and top-level ones for a generic module)."""
    services = [f"{name}-predictor", name] if generic else [name]
    return [f"{s}{suffix}" for s in services for suffix in ("", f".{namespace}", f".{namespace}.svc",
                                                            f".{namespace}.svc.cluster.local")]


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": PORT}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def probes(generic: bool) -> dict:
    """Readiness / liveness on the server's health routes; a startup probe allows 15 minutes for the load (a
    model dir on a CPU is exported once before it serves)."""
    live, ready = ("/v2/health/live", "/v2/health/ready") if generic else ("/health", "/health")
    return {"startupProbe": _probe(live, 10, 90), "readinessProbe": _probe(ready, 5, 3),
            "livenessProbe": _probe(live, 10, 6)}


@dataclass(frozen=True)
class Plan:
    """Everything the manifests say: the settings resolved against the served dir."""

    served: Served
    settings: K8sSettings
    name: str
    image: str
    serve_args: tuple[str, ...]
    api_key: bool
    grace_s: float

    @property
    def command(self) -> list[str]:
        hosts = [a for h in allowed_hosts(self.name, self.settings.namespace, self.served.generic)
                 for a in ("--allowed-hosts", h)]
        return ["prunus", "serve", f"{MODELS}/{self.served.dir_name}", "--host", "0.0.0.0", "--port", str(PORT),
                *self.serve_args, *hosts]


def plan(path, settings: K8sSettings, serve_args=(), *, api_key: bool = False, grace_s: float = 5.0) -> Plan:
    """The served dir checked and the names settled (one PrunusError line for bad input)."""
    served = inspect_dir(path)
    if not (str(path).isprintable() and served.dir_name.isprintable()):
        raise PrunusError(f"{short(str(path))}: the path holds a control character; rename the dir")
    name = settings.name or label_from(served.dir_name)
    if settings.model_from == "image" and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", served.dir_name):
        raise PrunusError(f"{path}: the dir's name {short(served.dir_name)} cannot be copied into an image as is; "
                          "rename the dir (letters, digits, '.', '_', '-') or use --k8s-model-from pvc")
    return Plan(served, settings, name, settings.image or f"prunus-{name}:latest", tuple(serve_args), api_key,
                grace_s)


def _labels(p: Plan) -> dict:
    return {"app.kubernetes.io/name": p.name, "app.kubernetes.io/part-of": "prunus"}


def _env(p: Plan, threads: str) -> list[dict]:
    env = [{"name": "PRUNUS_CACHE_DIR", "value": f"{CACHE}/prunus"}, {"name": "XDG_CACHE_HOME", "value": CACHE},
           {"name": "HOME", "value": "/tmp"}, {"name": "OMP_NUM_THREADS", "value": threads},
           {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"}]
    if p.api_key:  # the key lives in a Secret: kubectl create secret generic NAME-api-key --from-literal=api-key=KEY
        env.append({"name": "PRUNUS_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": f"{p.name}-api-key", "key": "api-key"}}})
    if p.served.generic:
        env.append({"name": "PROTOCOL", "value": "v2"})  # KServe: this custom predictor speaks the OIP (v2)
    return env


def container(p: Plan) -> dict:
    res = resources(p.served.weights_bytes)
    mounts = [{"name": "cache", "mountPath": CACHE}, {"name": "tmp", "mountPath": "/tmp"}]
    if p.settings.model_from == "pvc":
        mounts.append({"name": "model", "mountPath": MODELS, "readOnly": True})
    port = {"containerPort": PORT, "protocol": "TCP"}
    return {"name": KSERVE_CONTAINER if p.served.generic else "prunus", "image": p.image, "command": p.command,
            "ports": [port if p.served.generic else {"name": "http", **port}],
            "env": _env(p, res["requests"]["cpu"]), "resources": res, **probes(p.served.generic),
            "volumeMounts": mounts,
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}}}


def pod_parts(p: Plan) -> dict:
    """The pod spec's fields besides the container: volumes, the user, the grace after SIGTERM."""
    cache_limit = f"{math.ceil((2 * p.served.weights_bytes + GIB) / MIB)}Mi"  # a prepared export, the kernels
    volumes = [{"name": "cache", "emptyDir": {"sizeLimit": cache_limit}}, {"name": "tmp", "emptyDir": {}}]
    if p.settings.model_from == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": p.settings.pvc or f"{p.name}-model",
                                                                  "readOnly": True}})
    return {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
            "terminationGracePeriodSeconds": math.ceil(p.grace_s) + 15, "volumes": volumes}


def deployment(p: Plan) -> dict:
    meta = {"name": p.name, "namespace": p.settings.namespace, "labels": _labels(p)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": p.settings.replicas,
                     "selector": {"matchLabels": {"app.kubernetes.io/name": p.name}},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": {"metadata": {"labels": _labels(p)},
                                  "spec": {"containers": [container(p)], **pod_parts(p)}}}}


def service(p: Plan) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": p.name, "namespace": p.settings.namespace, "labels": _labels(p)},
            "spec": {"type": "ClusterIP", "selector": {"app.kubernetes.io/name": p.name},
                     "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}]}}


def autoscaler(p: Plan) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": p.name, "namespace": p.settings.namespace, "labels": _labels(p)},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": p.name},
                     "minReplicas": p.settings.lowest, "maxReplicas": p.settings.highest,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                         "type": "Utilization", "averageUtilization": CPU_TARGET_PERCENT}}}]}}


def inference_service(p: Plan) -> dict:
    predictor = {"minReplicas": p.settings.lowest, "maxReplicas": p.settings.highest, "scaleMetric": "cpu",
                 "scaleTarget": CPU_TARGET_PERCENT, "containers": [container(p)], **pod_parts(p)}
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": p.name, "namespace": p.settings.namespace, "labels": _labels(p)},
            "spec": {"predictor": predictor}}


def manifests(p: Plan) -> list[dict]:
    """The objects, in the order ``kubectl apply`` should see them."""
    return [inference_service(p)] if p.served.generic else [deployment(p), service(p), autoscaler(p)]


def _header(p: Plan) -> str:
    lines = [f"prunus serve {p.served.path} --print-k8s: {p.name} in namespace {p.settings.namespace}",
             f"image {p.image}: build it from `prunus serve {p.served.path} --print-k8s dockerfile`",
             "apply: kubectl apply -f THIS_FILE (or pipe it to kubectl apply -f -)"]
    if p.settings.model_from == "pvc":
        lines.append(f"the claim {p.settings.pvc or p.name + '-model'} holds the model dir as "
                     f"{p.served.dir_name}/ (mounted read-only at {MODELS})")
    if p.api_key:
        lines.append(f"API key: kubectl -n {p.settings.namespace} create secret generic {p.name}-api-key "
                     "--from-literal=api-key=KEY")
    if p.served.generic:
        lines.append("KServe InferenceService: the Open Inference Protocol (v2), POST /v2/models/MODEL/infer "
                     "(MODEL: the served model name)")
    if p.served.generic and not p.served.export:
        lines.append("the factory config.json names must be importable in the image (and --trust-factory given), "
                     "or serve the dir's ONNX export instead")
    return "".join(f"# {line}\n" for line in lines)


def render_manifests(p: Plan) -> str:
    """The manifests as YAML documents (``---`` between them), after a comment saying how to apply them."""
    import yaml

    docs = [yaml.safe_dump(m, sort_keys=False, default_flow_style=False) for m in manifests(p)]
    return _header(p) + "---\n" + "---\n".join(docs)


DOCKERFILE = """\
# The image of `prunus serve {path} --print-k8s` ({name}).
# Build context: a folder holding the prunus wheel and {copy_what}:
#   python -m build --wheel --outdir CTX   # in a prunus checkout: CTX/{wheel}
{copy_how}#   docker build -t {image} -f Dockerfile CTX && docker push {image}
FROM python:{python}-slim
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc: prunus's native CPU kernels are compiled on first use (without it, ONNX Runtime serves a genai export)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch's CPU build first: plain PyPI torch is the CUDA build, gigabytes of libraries a CPU node never uses
RUN pip install --index-url {torch_index} torch=={torch}
COPY {wheel} /tmp/
RUN pip install /tmp/{wheel} && rm /tmp/{wheel}
RUN useradd --uid 10001 --user-group --create-home prunus
{copy}USER 10001
ENV PRUNUS_CACHE_DIR={cache}/prunus XDG_CACHE_HOME={cache}
EXPOSE {port}
CMD {cmd}
"""
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # the Makefile's TORCH_INDEX


def _torch_version() -> str:
    """The torch this prunus runs on, without its local build tag (2.13.0+cpu -> 2.13.0)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").split("+")[0]
    except PackageNotFoundError:
        return "2.13.0"


def render_dockerfile(p: Plan) -> str:
    """The Dockerfile of the manifests' image: prunus's wheel over torch's CPU build, and the model dir copied to
    /models/NAME (with --k8s-model-from pvc the claim brings it, and nothing is copied)."""
    from prunus import __version__

    baked = p.settings.model_from == "image"
    dir_name = p.served.dir_name
    return DOCKERFILE.format(
        path=p.served.path, name=p.name, image=p.image, wheel=f"prunus-{__version__}-py3-none-any.whl",
        copy_what=f"the model dir as {dir_name}/" if baked else "nothing else (the model comes from a claim)",
        copy_how=f"#   cp -r {p.served.path} CTX/{dir_name}\n" if baked else "",
        copy=f"COPY --chown=10001:10001 {dir_name} {MODELS}/{dir_name}\n" if baked else "",
        python=f"{sys.version_info.major}.{sys.version_info.minor}", torch_index=TORCH_INDEX,
        torch=_torch_version(), cache=CACHE, port=PORT, cmd=json.dumps(p.command[:7]))

