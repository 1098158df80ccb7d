"""The parallel layout as one validated value, and the one DeviceMesh it builds.

``dp_replicate x dp_shard x cp x tp x pp`` must equal the world size (``ep``
borrows ranks from ``dp_shard``, as in torchtitan: the mesh splits dp_shard into
``dp_shard_mod_ep x ep`` and names the whole ``dp_shard`` again). ``dp_shard=-1`` takes
whatever the other dims leave. Mesh dims of size 1 are left out; the two data
parallel dims are flattened into ``dp`` for batches. Context-parallel ranks see the
same batch but hold replicas of the same parameters: FSDP shards over
``dp_shard_cp`` (dp_shard x cp flattened, as in torchtitan) and losses and DDP's
gradients average over ``dp_cp`` (every data- and context-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from prunus.models.config import ModelConfig
from prunus.models.errors import PrunusError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "dp_replicate", "cp", "tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise PrunusError(f"parallel dims: {name}={getattr(self, name)} must be at least 1")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise PrunusError(
                    f"parallel dims: world size {self.world_size} is not divisible by dp_replicate*cp*tp*pp = {others}; "
                    "change --nproc or the parallel dims")
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if self.dp_shard < 1:
            raise PrunusError(f"parallel dims: dp_shard={self.dp_shard} must be at least 1 (or -1 for the rest)")
        product = others * self.dp_shard
        if product != self.world_size:
            raise PrunusError(
                f"parallel dims: dp_replicate*dp_shard*cp*tp*pp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp}*{self.pp} = {product} but the world size is {self.world_size}; make them equal")
        if self.ep > 1 and self.dp_shard % self.ep:
            raise PrunusError(f"parallel dims: --ep {self.ep} must divide dp_shard = {self.dp_shard} "
                              "(expert parallelism borrows data-parallel ranks); change --ep or --nproc")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The dims the mesh is built from: under expert parallelism dp_shard is (dp_shard_mod_ep, ep)."""
        if self.ep == 1:
            return self.shape
        shape = {}
        for name, size in self.shape.items():
            shape.update({"dp_shard_mod_ep": self.dp_shard // self.ep, "ep": self.ep} if name == "dp_shard" else {name: size})
        return shape

    def validate_model(self, cfg: ModelConfig) -> None:
        """Refuse a layout the model cannot be split into, with one line naming the dims."""
        if self.tp > 1:
            for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
                if getattr(cfg, name) % self.tp:
                    raise PrunusError(f"--tp {self.tp} does not divide the model's {name} ({getattr(cfg, name)}); choose a tp that does")
        if self.ep > 1 and not cfg.n_experts:
            raise PrunusError(f"--ep {self.ep} needs a mixture-of-experts model; set --n-experts")
        if self.ep > 1 and cfg.n_experts % self.ep:
            raise PrunusError(f"--ep {self.ep} does not divide the model's n_experts ({cfg.n_experts}); choose an ep that does")
        if cfg.n_experts and (self.tp > 1 or self.pp > 1):
            raise PrunusError("mixture-of-experts models train with data and expert parallelism; set --tp 1 --pp 1")
        if self.pp > cfg.n_layers:
            raise PrunusError(f"--pp {self.pp} is larger than the model's {cfg.n_layers} blocks; use at most {cfg.n_layers} stages")

    @cached_property
    def mesh(self):
        """The world mesh: dims of size > 1 in MESH_ORDER, plus a flattened ``dp`` when data parallel."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape
        names = [n for n in shape if shape[n] > 1] or ["dp_shard"]
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, tuple(shape[n] for n in names), mesh_dim_names=tuple(names))
        if self.ep > 1:  # dp_shard, for FSDP of the dense parameters and for batches, spans both parts
            mesh[tuple(n for n in ("dp_shard_mod_ep", "ep") if n in names)]._flatten("dp_shard")
        dp_names = tuple(n for n in ("dp_replicate", "dp_shard", "dp_shard_mod_ep", "ep") if n in names and shape[n] > 1)
        if len(dp_names) > 1:
            mesh[dp_names]._flatten("dp")
        if self.cp > 1:
            shard = ("dp_shard", "dp_shard_mod_ep", "ep")
            for flat, dims in (("dp_shard_cp", (*shard, "cp")), ("dp_cp", ("dp_replicate", *shard, "cp"))):
                dims = tuple(n for n in dims if n in names)
                if len(dims) > 1:
                    mesh[dims]._flatten(flat)
        return mesh

    def submesh(self, name: str):
        """The mesh over one dim (``dp`` works whether it is one dim or two); None when that dim is 1."""
        if name == "dp":
            if self.dp == 1:
                return None
            if self.dp_replicate > 1 and self.dp_shard > 1:
                return self.mesh["dp"]
            return self.mesh["dp_replicate" if self.dp_replicate > 1 else "dp_shard"]
        if name in ("dp_cp", "dp_shard_cp"):  # data x context parallel: ``dp`` / ``dp_shard`` when cp is 1
            if self.cp == 1:
                return self.submesh(name[:-3])
            return self.mesh[name] if (self.dp if name == "dp_cp" else self.dp_shard) > 1 else self.mesh["cp"]
        if name == "hsdp":  # HSDP's (replicate, shard) mesh
            shard = "dp_shard_cp" if self.cp > 1 and self.dp_shard > 1 else "cp" if self.cp > 1 else "dp_shard"
            return self.mesh["dp_replicate", shard]
        if name == "dp_shard_mod_ep":  # the ranks holding the same experts
            return self.mesh[name] if self.ep > 1 and self.dp_shard > self.ep else None
        return self.mesh[name] if {**self.shape, "ep": self.ep}.get(name, 1) > 1 else None
