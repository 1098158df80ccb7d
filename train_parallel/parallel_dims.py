"""The parallel layout as one validated value, and the one DeviceMesh it builds.

``dp_replicate x dp_shard x cp x tp x pp`` must equal the world size (``ep``
borrows ranks from data parallelism, as in torchtitan). ``dp_shard=-1`` takes
whatever the other dims leave. Mesh dims of size 1 are left out; the two data
parallel dims are flattened into ``dp`` for batches and loss averaging.
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
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise PrunusError(f"parallel dims: ep={self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    def validate_model(self, cfg: ModelConfig) -> None:
        """Refuse a layout the model cannot be split into, with one line naming the dims."""
        if self.tp > 1:
            for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
                if getattr(cfg, name) % self.tp:
                    raise PrunusError(f"--tp {self.tp} does not divide the model's {name} ({getattr(cfg, name)}); choose a tp that does")
        if self.pp > cfg.n_layers:
            raise PrunusError(f"--pp {self.pp} is larger than the model's {cfg.n_layers} blocks; use at most {cfg.n_layers} stages")

    @cached_property
    def mesh(self):
        """The world mesh: dims of size > 1 in MESH_ORDER, plus a flattened ``dp`` when data parallel."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        names = [n for n in MESH_ORDER if self.shape[n] > 1] or ["dp_shard"]
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, tuple(self.shape[n] for n in names), mesh_dim_names=tuple(names))
        dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names and self.shape[n] > 1)
        if len(dp_names) > 1:
            mesh[dp_names]._flatten("dp")
        return mesh

    def submesh(self, name: str):
        """The mesh over one dim (``dp`` works whether it is one dim or two); None when that dim is 1."""
        if name == "dp":
            if self.dp == 1:
                return None
            if self.dp_replicate > 1 and self.dp_shard > 1:
                return self.mesh["dp"]
            return self.mesh["dp_replicate" if self.dp_replicate > 1 else "dp_shard"]
        return self.mesh[name] if self.shape.get(name, 1) > 1 else None
