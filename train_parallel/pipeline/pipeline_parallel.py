"""Pipeline parallelism with torch.distributed.pipelining, on the unmodified model.

The blocks are split into ``pp * virtual`` contiguous stages by a cost-balanced
partition (the GPipe rule: minimise the most expensive stage, with the
embedding and the output head counted). Each stage is a copy of the model with the
other blocks deleted and, off the first/last stage, ``tok_embeddings`` /
``norm`` + ``output`` set to None, so parameter names stay those of the whole
model. Single-stage schedules (GPipe, 1F1B) give each rank one stage;
looped ones (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) give rank r
stages r, r+pp, ...; V-shaped ones (ZBVZeroBubble, DualPipeV) give rank r stages
r and 2pp-1-r.
"""

from __future__ import annotations

import copy

from torch.distributed.pipelining import PipelineStage
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from prunus.artifacts.errors import PrunusError

from ..config import PP_SCHEDULES

SCHEDULES = PP_SCHEDULES
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def stages_per_rank(schedule: str) -> int:
    return 1 if issubclass(get_schedule_class(schedule), PipelineScheduleSingle) else 2


def validate_schedule(schedule: str, pp: int, microbatches: int, n_layers: int) -> None:
    if schedule not in SCHEDULES:
        raise PrunusError(f"--pp-schedule {schedule}: unknown; choose one of {', '.join(SCHEDULES)}")
    n_stages = pp * stages_per_rank(schedule)
    if n_stages > n_layers:
        raise PrunusError(f"--pp {pp} with {schedule} needs {n_stages} stages but the model has {n_layers} blocks; lower --pp or use GPipe/1F1B")
    if schedule == "GPipe":
        ok, need = microbatches >= 1, "at least 1"
    elif schedule == "1F1B" or schedule in V_SHAPED:
        ok, need = microbatches >= n_stages, f"at least {n_stages} (the number of stages)"
    else:
        rounds = max(1, microbatches // pp)
        ok, need = microbatches % rounds == 0, f"a multiple of the {rounds} rounds of {pp}"
    if not ok:
        raise PrunusError(f"--microbatches {microbatches} is too few for {schedule} with --pp {pp}: it needs {need}")


def partition(costs: list[float], n_parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` into ``n_parts`` contiguous non-empty ranges minimising the largest sum: [start, end) pairs."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest-part cost splitting costs[:i] into k parts
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, n_parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(n_parts, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def stage_layers(cfg, n_stages: int) -> list[list[str]]:
    """Block keys of each stage, balancing parameters: each block's, plus the embedding on the
    first block and the output head on the last (a tied head counts again: it is a second matmul)."""
    block = (cfg.num_params(include_embedding=False) - cfg.dim - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)) / cfg.n_layers
    costs = [block] * cfg.n_layers
    costs[0] += cfg.vocab_size * cfg.dim
    costs[-1] += cfg.vocab_size * cfg.dim + cfg.dim
    return [[str(i) for i in range(a, b)] for a, b in partition(costs, n_stages)]


def stage_module(model, keys: list[str], first: bool, last: bool):
    part = copy.deepcopy(model)
    for k in list(part.layers.keys()):
        if k not in keys:
            del part.layers[k]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


def stage_ids(schedule: str, pp_rank: int, pp: int) -> list[int]:
    if stages_per_rank(schedule) == 1:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]


@torch.no_grad()
def pipeline_score(parts, ids: list[int], n_stages: int, schedule: str, pp_group, x, y, score_fn, **kwargs) -> float:
    """Forward one evaluation batch through the stages with plain sends and receives; every rank gets the score.

    torch's ``schedule.eval()`` replays the training action list with backward
    switched off, which fails for V-shaped and zero-bubble schedules; evaluation
    needs no schedule, only the stages in order.
    """
    pp = dist.get_world_size(pp_group)
    me = dist.get_rank(pp_group)
    owner = {sid: r for r in range(pp) for sid in stage_ids(schedule, r, pp)}
    mine = dict(zip(ids, parts))
    h, result = None, torch.zeros((), dtype=torch.float64)
    for sid in range(n_stages):
        if owner[sid] != me:
            continue
        if sid > 0 and owner[sid - 1] != me:
            meta = torch.zeros(3, dtype=torch.int64)
            dist.recv(meta, src=dist.get_global_rank(pp_group, owner[sid - 1]), group=pp_group)
            h = torch.empty(*meta.tolist(), device=x.device)
            dist.recv(h, src=dist.get_global_rank(pp_group, owner[sid - 1]), group=pp_group)
        h = mine[sid](x if sid == 0 else h, **kwargs)  # kwargs: packed documents' positions and doc_ids
        if sid == n_stages - 1:
            result += score_fn(h, y)
        elif owner[sid + 1] != me:
            dst = dist.get_global_rank(pp_group, owner[sid + 1])
            h = h.float().contiguous()
            dist.send(torch.tensor(h.shape, dtype=torch.int64), dst=dst, group=pp_group)
            dist.send(h, dst=dst, group=pp_group)
    dist.all_reduce(result, group=pp_group)
    return float(result)


def build_pipeline(model, pp_mesh, *, schedule: str, microbatches: int, loss_fn, device, parallelize_part=None):
    """Split ``model`` for this rank; return (model_parts, their stage ids, n_stages, schedule).

    ``parallelize_part`` (TP, FSDP, ...) is applied to each stage module before it is wrapped.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_stages = pp * stages_per_rank(schedule)
    layers = stage_layers(model.config, n_stages)
    parts, stages, ids = [], [], stage_ids(schedule, pp_rank, pp)
    for sid in ids:
        part = stage_module(model, layers[sid], sid == 0, sid == n_stages - 1)
        if parallelize_part is not None:
            part = parallelize_part(part)
        parts.append(part)
        stages.append(PipelineStage(part, sid, n_stages, device, group=pp_mesh.get_group()))
    cls = get_schedule_class(schedule)
    if stages_per_rank(schedule) == 1:
        sched = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    return parts, ids, n_stages, sched
