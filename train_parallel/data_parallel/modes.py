"""The data-parallel modes (``--dp-mode``): one strategy per mode, chosen once from the run's settings.

| mode | processes | layout | forward | loop |
|---|---|---|---|---|
| ``ddp`` | any launcher | the mesh: DDP / ZeRO / FSDP2 (``data_parallel.py``) with TP, PP, CP, EP | the part | ``Trainer`` |
| ``dataparallel`` | one, every GPU | one rank (``data_parallel_single.py``) | ``nn.DataParallel`` | ``Trainer`` |
| ``ps`` | servers, workers | the workers are the data-parallel ranks (``parameter_server.py``) | its own | ``ps_worker.py`` |

:func:`dp_mode` returns the strategy of a config; :data:`DP_MODES` names them (``--dp-mode``'s choices). Nothing
heavy is imported at module level: :mod:`prunus.train_parallel.config` reads the names to build ``--help``.
"""

from __future__ import annotations

import dataclasses

from prunus.artifacts.errors import PrunusError


class DataParallelMode:
    """What differs between the modes; each method is called once per run by the code that needs it."""

    name = ""
    plans_memory = False  # whether the dry run (launch/dry_run.py) plans this mode's layouts
    own_loop = False  # whether it trains in its own loop (ps_worker.py), not the Trainer's (trainer.train)

    def check_config(self, cfg) -> None:
        """One line when ``cfg``'s settings alone cannot run in this mode (TrainConfig.validate calls it)."""

    def resolve(self, cfg, world_size: int, device_type: str | None, validate_layout) -> tuple:
        """``(cfg with the ZeRO stage resolved, ParallelDims)`` on ``world_size`` ranks, checked against the model;
        ``validate_layout``: the mesh's checks (:func:`~prunus.train_parallel.parallelize.validate_layout`)."""
        raise NotImplementedError

    def forward_module(self, part):
        """The module the trainer calls for forward: the parallelized model part itself."""
        return part


class TorchDistributed(DataParallelMode):
    """``ddp``: torch.distributed's DDP, ZeRO-1 and FSDP2 over the mesh, composed with every other parallelism."""

    name, plans_memory = "ddp", True

    def resolve(self, cfg, world_size: int, device_type: str | None, validate_layout) -> tuple:
        from ..parallel_dims import ParallelDims

        dims = ParallelDims.from_config(cfg, world_size, device_type)
        cfg = dataclasses.replace(cfg, zero=dims.zero)
        validate_layout(dims, cfg, cfg.model_config())
        return cfg, dims


class SingleProcess(DataParallelMode):
    """``dataparallel``: one process replicating the model over every visible GPU for each forward."""

    name = "dataparallel"

    def resolve(self, cfg, world_size: int, device_type: str | None, validate_layout) -> tuple:
        from .data_parallel_single import validate_dataparallel

        return _whole_model(cfg, validate_dataparallel(cfg, world_size, device_type))

    def forward_module(self, part):
        from .data_parallel_single import apply_dataparallel

        return apply_dataparallel(part)


class ParameterServer(DataParallelMode):
    """``ps``: the first ``--ps-servers`` ranks hold the parameters and the optimizer, the others train."""

    name, own_loop = "ps", True

    def check_config(self, cfg) -> None:
        if cfg.init_from or str(cfg.data or "").lower().endswith((".jsonl", ".parquet")):
            raise PrunusError("--dp-mode ps trains from random weights on text corpora; fine-tune (--init-from, "
                              "instruction rows) with --dp-mode ddp")

    def resolve(self, cfg, world_size: int, device_type: str | None, validate_layout) -> tuple:
        from ..parallel_dims import ParallelDims
        from .parameter_server import validate_ps

        return _whole_model(cfg, ParallelDims(world_size=validate_ps(cfg, world_size), zero=0, device_type=device_type))


def _whole_model(cfg, dims) -> tuple:
    """A mode whose ranks each hold the whole model: no ZeRO stage; the model checked against the layout."""
    cfg = dataclasses.replace(cfg, zero=0)
    dims.validate_model(cfg.model_config())
    return cfg, dims


_MODES = {mode.name: mode for mode in (TorchDistributed(), ParameterServer(), SingleProcess())}
DP_MODES = tuple(_MODES)  # --dp-mode's choices, the default first


def dp_mode(cfg) -> DataParallelMode:
    """The strategy of ``cfg.dp_mode``; one line naming the choices for an unknown one."""
    mode = _MODES.get(cfg.dp_mode)
    if mode is None:
        raise PrunusError(f"--dp-mode {cfg.dp_mode}: choose one of {', '.join(DP_MODES)}")
    return mode
