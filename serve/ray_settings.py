"""How ``prunus serve --replicas N`` (or ``--ray-address ADDR``) runs on Ray Serve: one settings dataclass, one
``prunus serve`` option per field (``metadata["help"]``, ``metadata["type"]``), checked before Ray starts.

This module imports nothing of Ray: the CLI builds its options from it on every start, with or without the
``ray`` extra installed (:mod:`prunus.serve.ray_deployment` is where Ray is imported, on this path only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from prunus.artifacts.errors import PrunusError

MAX_REPLICAS = 64
ROUTERS = ("prefix", "default")
RAY_EXTRA = 'pip install "prunus[ray]" (or: pip install "ray[serve]==2.60.0")'


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass(frozen=True)
class RaySettings:
    """Replicas of the server on Ray Serve. None: not given (the default said in the help)."""

    replicas: int | None = field(default=None, metadata=_help(
        f"Serve PATH from N replicas on Ray Serve (1 to {MAX_REPLICAS}), each a whole prunus server and engine, "
        "behind one address; a local Ray cluster on 127.0.0.1 is started unless --ray-address is given.", type=int))
    ray_address: str | None = field(default=None, metadata=_help(
        "Join this Ray cluster (e.g. 127.0.0.1:6379, or auto) instead of starting one; implies --replicas 1 "
        "unless given.", type=str))
    replica_cpus: float = field(default=1.0, metadata=_help(
        "CPUs Ray reserves for each replica (fractions allowed, e.g. 0.5).", type=float))
    min_replicas: int | None = field(default=None, metadata=_help(
        "Autoscaling: the fewest replicas Ray Serve keeps. Default: --replicas (no autoscaling unless "
        "--max-replicas is larger).", type=int))
    max_replicas: int | None = field(default=None, metadata=_help(
        "Autoscaling: the most replicas Ray Serve starts, on the requests each replica has in progress. Default: "
        "--replicas.", type=int))
    target_ongoing: float = field(default=2.0, metadata=_help(
        "Autoscaling: requests in progress per replica that Ray Serve aims for (its target_ongoing_requests).",
        type=float))
    router: str = field(default="prefix", metadata=_help(
        "prefix: a request goes to the replica that saw the longest start of its prompt (its prefix cache may "
        "hold it), power of two choices when their loads differ; default: Ray Serve's own router.", type=ROUTERS))
    imbalance: int = field(default=2, metadata=_help(
        "With --router prefix: when the busiest replica has more than this many requests in progress above the "
        "idlest, the power of two choices decides instead of the prompt's prefix.", type=int))
    adapters_per_replica: int = field(default=2, metadata=_help(
        "With --lora: LoRA adapters a replica holds at once; a request for another loads it there, unloading the "
        "least recently used (Ray Serve's model multiplexing routes a request to a replica holding its adapter).",
        type=int))
    ray_cpus: int | None = field(default=None, metadata=_help(
        "CPUs of the local Ray cluster started here. Default: enough for the replicas and the ingress.", type=int))

    def __post_init__(self) -> None:
        for flag, value in (("--replicas", self.replicas), ("--min-replicas", self.min_replicas),
                            ("--max-replicas", self.max_replicas)):
            if value is not None and not (isinstance(value, int) and 1 <= value <= MAX_REPLICAS):
                raise PrunusError(f"{flag} {value!r} is out of range; give 1 to {MAX_REPLICAS}")
        if not 0 < self.replica_cpus <= 256:
            raise PrunusError(f"--replica-cpus {self.replica_cpus!r}: give a number of CPUs above 0 (e.g. 0.5 or 2)")
        if not 0 < self.target_ongoing <= 10_000:
            raise PrunusError(f"--target-ongoing {self.target_ongoing!r}: give a number of requests above 0")
        if self.router not in ROUTERS:
            raise PrunusError(f"--router {self.router!r}: give one of {', '.join(ROUTERS)}")
        if not 0 <= self.imbalance <= 100_000:
            raise PrunusError(f"--imbalance {self.imbalance!r}: give 0 or more requests")
        if not 1 <= self.adapters_per_replica <= 1024:
            raise PrunusError(f"--adapters-per-replica {self.adapters_per_replica!r}: give 1 to 1024")
        if self.ray_cpus is not None and not 1 <= self.ray_cpus <= 4096:
            raise PrunusError(f"--ray-cpus {self.ray_cpus!r}: give 1 or more CPUs")
        if self.ray_address is not None and self.ray_cpus is not None:
            raise PrunusError("--ray-cpus sizes the local Ray cluster prunus starts; --ray-address joins one of its "
                              "own size: drop --ray-cpus")
        if self.active and not self.lowest <= self.initial <= self.highest:
            raise PrunusError(f"--min-replicas {self.lowest}, --replicas {self.initial} and --max-replicas "
                              f"{self.highest} must rise in that order; change one")

    @property
    def active(self) -> bool:
        """Whether the server runs on Ray Serve (--replicas or --ray-address given)."""
        return self.replicas is not None or self.ray_address is not None

    @property
    def initial(self) -> int:
        return self.replicas if self.replicas is not None else (self.min_replicas or 1)

    @property
    def lowest(self) -> int:
        return self.initial if self.min_replicas is None else self.min_replicas

    @property
    def highest(self) -> int:
        return self.initial if self.max_replicas is None else self.max_replicas

    @property
    def autoscaling(self) -> bool:
        return self.lowest != self.highest

    @classmethod
    def from_options(cls, **options) -> "RaySettings":
        """From ``prunus serve``'s options of the same names (None: not given)."""
        given = {f.name: options.get(f.name) for f in fields(cls)}
        return cls(**{k: v for k, v in given.items() if v is not None})

    def check_load(self, load: dict, machine_cpus: int | None) -> None:
        """One line, before Ray starts, for what a replica cannot take (``tp`` worker processes, a device map:
        a replica is one process of fractional CPUs) or for more replica CPUs than a local cluster has."""
        if (load.get("tp") or 1) > 1:
            raise PrunusError("--tp runs worker processes beside one server; a replica on Ray Serve is one process: "
                              "drop --tp, or scale with --replicas")
        if load.get("device_map") is not None:
            raise PrunusError("--device-map places one model across devices in one process; replicas on Ray Serve "
                              "each hold the whole model: drop --device-map")
        if self.ray_address is not None:
            return  # a cluster of its own size: Ray Serve says when replicas cannot be placed
        need = self.highest * self.replica_cpus
        have = self.ray_cpus or machine_cpus
        if have is not None and need > have:
            raise PrunusError(f"{self.highest} replicas of {self.replica_cpus:g} CPUs need {need:g} CPUs and "
                              f"{'--ray-cpus gives' if self.ray_cpus else 'this machine has'} {have}; lower "
                              "--replicas / --max-replicas or --replica-cpus")

    def given_without_replicas(self) -> str | None:
        """The flag of an autoscaling / router option given without --replicas or --ray-address (else None)."""
        if self.active:
            return None
        defaults = cls_defaults()
        for f in fields(self):
            if getattr(self, f.name) != defaults[f.name]:
                return "--" + f.name.replace("_", "-")
        return None


def cls_defaults() -> dict:
    return {f.name: f.default for f in fields(RaySettings)}


def require_ray():
    """The ``ray.serve`` module, or one PrunusError line naming the extra to install."""
    try:
        from ray import serve
    except ImportError:
        raise PrunusError(f"--replicas / --ray-address serve on Ray Serve, which is not installed here; "
                          f"{RAY_EXTRA}") from None
    return serve
