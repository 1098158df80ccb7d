"""Pipeline parallelism for any ``nn.Module`` (``--pp-split``): one stage per rank (:mod:`.module_split`), run
by ``torch.distributed.pipelining``'s ScheduleGPipe or Schedule1F1B over ``--microbatches`` micro-batches.

The schedule averages the micro-batches' gradients (``scale_grads``), so a step equals one process running the
same micro-batches with gradient accumulation (``grad_accum``): the equivalence the tests check, BatchNorm
included (its statistics are per micro-batch in both). Evaluation sends each batch through the stages with
plain sends and receives; the model dir's full state is sent stage by stage to the first rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from prunus.artifacts.errors import PrunusError

from .module_split import split_stages

MODULE_SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 8


def check_module_schedule(schedule: str, pp: int, microbatches: int, batch_size: int) -> None:
    """One line unless the schedule runs ``pp`` stages over ``microbatches`` equal micro-batches."""
    if schedule not in MODULE_SCHEDULES:
        raise PrunusError(f"--pp-schedule {schedule}: a generic module pipelines with {' or '.join(MODULE_SCHEDULES)}")
    if schedule == "1F1B" and microbatches < pp:
        raise PrunusError(f"--microbatches {microbatches} is too few for 1F1B with {pp} stages: it needs at least {pp}")
    if batch_size % microbatches:
        raise PrunusError(f"--batch-size {batch_size} is not divisible by --microbatches {microbatches}; choose a multiple")


@torch.no_grad()
def _stage_io(stages, rank: int, example: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of one micro-batch's input and output at stage ``rank``, from ``example`` (a micro-batch's
    input) run through the stages in eval mode: torch's own shape inference would run the stage in train mode
    on uninitialised tensors, and BatchNorm's running statistics would take them in."""
    h = example
    for stage in stages[:rank + 1]:
        was = stage.training
        h_in, h = h, stage.eval()(h)
        stage.train(was)
    h_in, h = h_in.to("meta"), h.to("meta")
    return h_in.requires_grad_(rank > 0 and h_in.is_floating_point()), h.requires_grad_(h.is_floating_point())


class ModulePipeline:
    """This rank's stage of ``module`` split before the children ``names``, and its schedule."""

    def __init__(self, module: torch.nn.Module, names: list[str], group, *, schedule: str, microbatches: int,
                 loss_fn, device: torch.device, example: torch.Tensor):
        stages = split_stages(module, names)
        self.group, self.pp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        if len(stages) != self.pp:
            raise PrunusError(f"--pp-split {','.join(names)} makes {len(stages)} stages but {self.pp} ranks run them; "
                              f"start {len(stages)} processes (--nproc {len(stages)})")
        # what the first rank receives from each stage when the model dir is written: (name, shape, dtype)
        self.layout = [[(k, v.shape, v.dtype) for k, v in s.state_dict().items()] for s in stages]
        self.part = stages[self.rank].to(device)
        self.first, self.last, self.device = self.rank == 0, self.rank == self.pp - 1, device
        h_in, h_out = _stage_io(stages, self.rank, example)
        stage = PipelineStage(self.part, self.rank, self.pp, device, input_args=h_in, output_args=h_out, group=group)
        self.schedule = MODULE_SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn)

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def step(self, x, y) -> torch.Tensor:
        """Forward and backward of one batch; the mean of the micro-batches' losses, on every rank."""
        if isinstance(x, (list, tuple, dict)):
            raise PrunusError("--pp-split: the pipeline takes one input tensor a sample; this data gives "
                              f"{type(x).__name__}s")
        losses: list = []
        self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None, losses=losses)
        loss = torch.zeros((), device=self.device)
        if self.last:
            loss = torch.stack([v.detach().float() for v in losses]).mean()
        dist.all_reduce(loss, group=self.group)  # only the last stage holds it (tensors on the device: NCCL too)
        return loss

    def _send(self, h: torch.Tensor) -> None:
        meta = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
        meta[0], meta[1] = h.ndim, _DTYPES.index(h.dtype)
        meta[2:2 + h.ndim] = torch.tensor(h.shape)
        meta = meta.to(self.device)
        dist.send(meta, dst=self._peer(self.rank + 1), group=self.group)
        dist.send(h.contiguous(), dst=self._peer(self.rank + 1), group=self.group)

    def _recv(self) -> torch.Tensor:
        meta = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        dist.recv(meta, src=self._peer(self.rank - 1), group=self.group)
        meta = meta.tolist()
        h = torch.empty(meta[2:2 + meta[0]], dtype=_DTYPES[meta[1]], device=self.device)
        dist.recv(h, src=self._peer(self.rank - 1), group=self.group)
        return h

    @torch.no_grad()
    def score(self, x, y, sums) -> tuple[float, int, int | None]:
        """``sums(output, target)`` (the task's loss sum, count, correct) of one batch, on every rank."""
        h = self.part(x if self.first else self._recv())
        if not self.last:
            if h.ndim > _MAX_DIMS or h.dtype not in _DTYPES:
                raise PrunusError(f"--pp-split: stage {self.rank} outputs a {h.dtype} tensor of {h.ndim} dims; the "
                                  f"pipeline sends up to {_MAX_DIMS} dims of {', '.join(map(str, _DTYPES))}")
            self._send(h)
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        if self.last:
            s, n, c = sums(h, y)
            totals = torch.tensor([s, n, c or 0, c is not None], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=self.group)
        s, n, c, has_c = totals.tolist()
        return s, int(n), int(c) if has_c else None

    def full_state(self) -> dict | None:
        """The whole module's state dict on the pipeline's first rank (None elsewhere); every rank calls it."""
        mine = self.part.state_dict()
        if not self.first:
            for name, _, _ in self.layout[self.rank]:
                dist.send(mine[name].detach().contiguous(), dst=self._peer(0), group=self.group)
            return None
        state = {k: v.detach().cpu() for k, v in mine.items()}
        for rank in range(1, self.pp):
            for name, shape, dtype in self.layout[rank]:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(t, src=self._peer(rank), group=self.group)
                state[name] = t.cpu()
        return state
