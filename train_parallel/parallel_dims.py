"""The parallel layout as one validated value, and the one DeviceMesh it builds.

``dp_replicate x dp_shard x cp x tp x pp`` must equal the world size (``ep``
borrows ranks from ``dp_shard``, as in torchtitan: the mesh splits dp_shard into
``dp_shard_mod_ep x ep`` and names the whole ``dp_shard`` again). ``dp_shard=-1`` takes
whatever the other dims leave. Mesh dims of size 1 are left out; the two data
parallel dims are flattened into ``dp`` for batches. Context-parallel ranks see the
same batch but hold replicas of the same parameters: FSDP shards over
``dp_shard_cp`` (dp_shard x cp flattened, as in torchtitan) and losses and DDP's
gradients average over ``dp_cp`` (every data- and context-parallel rank).

The value also carries the decisions that follow from the dims (the ZeRO stage
when none is given, whether FSDP, DDP, ZeRO-1, HSDP, loss parallelism are on), so
the trainer, the dry run and the launchers read them instead of working them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from prunus.models.config import ModelConfig
from prunus.artifacts.errors import PrunusError
from prunus.train_parallel.tensor_parallel.tp_nd.shape import GRID_DIMS, grid_shape

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
    zero: int | None = None  # None: 3 when sharding over dp_shard x cp > 1, else 0
    device_type: str | None = None  # the mesh's device type; None: cuda when available, else cpu
    tp_mode: str = "1d"  # 1d, or the grid (2d, 2.5d, 3d) tp ranks form: tp_nd/shape.py
    tp_depth: int = 1  # the 2.5d grid's depth

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
        if self.tp_mode != "1d":
            grid_shape(self.tp_mode, self.tp, self.tp_depth)  # one line when tp does not form the grid
        if self.zero is None:  # FSDP shards over dp_shard x cp
            object.__setattr__(self, "zero", 3 if self.dp_shard * self.cp > 1 else 0)

    @classmethod
    def from_config(cls, cfg, world_size: int, device_type: str | None = None) -> "ParallelDims":
        """The layout ``cfg`` (a TrainConfig) asks for on ``world_size`` ranks (not yet checked against the model)."""
        return cls(world_size=world_size, dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, tp=cfg.tp,
                   pp=cfg.pp, ep=cfg.ep, zero=cfg.zero, device_type=device_type,
                   tp_mode=getattr(cfg, "tp_mode", "1d"), tp_depth=getattr(cfg, "tp_depth", 1))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold replicas (or FSDP shards) of the same parameters: data x context parallel."""
        return self.dp * self.cp

    # whether each kind of parallelism is on (a dim above 1), as torchtitan's ParallelDims says it
    dp_enabled = property(lambda self: self.dp > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    pp_enabled = property(lambda self: self.pp > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    ep_enabled = property(lambda self: self.ep > 1)

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 (ZeRO-2/3) over the data- and context-parallel ranks."""
        return self.dp_cp > 1 and self.zero in (2, 3)

    @property
    def ddp_enabled(self) -> bool:
        """DDP (ZeRO-0/1): gradients all-reduced over the data- and context-parallel ranks."""
        return self.dp_cp > 1 and self.zero in (0, 1)

    @property
    def zero1_enabled(self) -> bool:
        """ZeroRedundancyOptimizer over the data- and context-parallel ranks."""
        return self.dp_cp > 1 and self.zero == 1

    @property
    def hsdp_enabled(self) -> bool:
        """FSDP replicating over dp_replicate and sharding over dp_shard x cp."""
        return self.zero in (2, 3) and self.dp_replicate > 1 and self.dp_shard * self.cp > 1

    @property
    def loss_parallel(self) -> bool:
        """Logits stay vocabulary-sharded under TP (the pipeline's last stage gathers them)."""
        return self.tp > 1 and self.pp == 1 and self.tp_mode == "1d"  # 2d/2.5d/3d: the grid's own loss

    def describe(self) -> str:
        """The layout in one line, for progress output."""
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} pp={self.pp} "
                f"zero={self.zero}" + (f" ep={self.ep}" if self.ep > 1 else "")
                + (f" tp_mode={self.tp_mode}" if self.tp_mode != "1d" else ""))

    @property
    def shape(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The dims the mesh is built from: under expert parallelism dp_shard is (dp_shard_mod_ep, ep)."""
        shape = {}
        for name, size in self.shape.items():
            if name == "dp_shard" and self.ep > 1:
                shape.update({"dp_shard_mod_ep": self.dp_shard // self.ep, "ep": self.ep})
            elif name == "tp" and self.tp_mode != "1d" and self.tp > 1:  # the grid's dims, flattened back into tp
                shape.update(grid_shape(self.tp_mode, self.tp, self.tp_depth))
            else:
                shape[name] = size
        return shape

    def validate_model(self, cfg: ModelConfig) -> None:
        """Refuse a layout the model cannot be split into, with one line naming the dims."""
        if self.tp > 1 and self.tp_mode == "1d":  # the grids check their own splits (tp_nd/apply.py)
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
        device_type = self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        mesh = init_device_mesh(device_type, tuple(shape[n] for n in names), mesh_dim_names=tuple(names))
        grid = tuple(n for n in GRID_DIMS.get(self.tp_mode, ()) if n in names)
        if len(grid) > 1:
            mesh[grid]._flatten("tp")
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

    def submesh_rank(self, name: str) -> int:
        """This rank's index along one dim (0 when that dim is 1)."""
        mesh = self.submesh(name)
        return mesh.get_local_rank() if mesh is not None else 0

    def submesh_group(self, name: str):
        """The process group of one dim; None when that dim is 1."""
        mesh = self.submesh(name)
        return mesh.get_group() if mesh is not None else None

    @property
    def data_parallel_mesh(self):
        """The mesh DDP / FSDP spans: dp x cp, or HSDP's (replicate, shard) mesh; None without data parallelism."""
        return self.submesh("hsdp") if self.hsdp_enabled else self.submesh("dp_cp")

    @property
    def zero1_mesh(self):
        """The mesh ZeRO-1's optimizer partitions its states over; None when ZeRO-1 is off."""
        return self.submesh("dp_cp") if self.zero1_enabled else None
