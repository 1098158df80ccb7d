"""Pipeline parallelism for any ``nn.Module`` (``--pp-split``): one stage per rank (:func:`split_stages`), run
by ``torch.distributed.pipelining``'s ScheduleGPipe or Schedule1F1B over ``--microbatches`` micro-batches.

The schedule averages the micro-batches' gradients (``scale_grads``), so a step equals one process running the
same micro-batches with gradient accumulation (``grad_accum``): the equivalence the tests check, BatchNorm
included (its statistics are per micro-batch in both). Evaluation sends each batch through the stages with
plain sends and receives; the model dir's full state is sent stage by stage to the first rank.

The split points (``--pp-split layer3``) are top-level children of the module, in their order; stage 0 runs the forward up to the first named
child, stage ``k`` from the ``k``-th named child up to the next. The forward is traced with torch.fx, every
top-level child a leaf, and must be a plain sequence: one input, and every step (a child, or an operation
between children such as ``torch.flatten``) taking the previous step's output and nothing else computed
before it, each child called once, in the order the children were registered. So exactly one tensor crosses
every split point, as ``torch.distributed.pipelining`` sends it. Anything else is one line saying what to do.

A stage is an ``fx.GraphModule`` over the same root: its parameters keep the whole module's names
(``layer3.0.conv1.weight``), so checkpoints and the model dir need no renaming.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

FIX = ("make the model's forward call its top-level children one after another (e.g. an nn.Sequential of the "
       "parts), or train it without --pp-split")


def _names(names: list[str]) -> str:
    text = ", ".join(names)
    return text if len(text) <= 200 else text[:200] + "..."


class _ChildrenAsLeaves(fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return "." not in qualname or super().is_leaf_module(m, qualname)


def parse_split(text: str | None) -> list[str]:
    """``"layer2,layer3"`` -> ``["layer2", "layer3"]`` (empty for None)."""
    if text is None:
        return []
    names = [n.strip() for n in text.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise PrunusError(f"--pp-split {short(text)}: give distinct child names joined by commas, e.g. layer3")
    return names


def check_split_names(module: torch.nn.Module, names: list[str]) -> list[str]:
    """One line unless every name is a top-level child of ``module``, given in the children's order."""
    children = [n for n, _ in module.named_children()]
    for name in names:
        if name not in children:
            raise PrunusError(f"--pp-split {short(name)}: not a top-level child of {type(module).__name__}; its "
                              f"children are {_names(children)}")
    order = [children.index(n) for n in names]
    if order != sorted(order) or order[0] == 0:
        raise PrunusError(f"--pp-split {','.join(names)}: name children after the first ({children[0]}), in the "
                          f"order they were registered: {_names(children)}")
    return children


def _trace(module: torch.nn.Module) -> fx.Graph:
    try:
        return _ChildrenAsLeaves().trace(module)
    except Exception as e:  # noqa: BLE001 - data-dependent control flow and the like: one line
        raise PrunusError(f"--pp-split: {type(module).__name__}'s forward cannot be traced as a sequence of its "
                          f"children ({type(e).__name__}: {short(str(e), 100)}); {FIX}") from None


def _check_chain(module: torch.nn.Module, graph: fx.Graph) -> list[fx.Node]:
    """The forward's steps (placeholder and output dropped), checked to be a plain sequence."""
    what = type(module).__name__
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise PrunusError(f"--pp-split: {what}'s forward takes {len(inputs)} inputs, not one; {FIX}")
    steps = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    prev, seen = inputs[0], []
    for node in steps:
        used = set(node.all_input_nodes)
        if node.op == "get_attr":
            raise PrunusError(f"--pp-split: {what}'s forward uses {node.target} directly, not through a child; {FIX}")
        if used != {prev}:
            late = sorted(n.name for n in used - {prev}) or ["nothing before it"]
            raise PrunusError(f"--pp-split: {what}'s forward is not a plain sequence of its children ({node.name} "
                              f"uses {', '.join(late)}, not only the step before it); {FIX}")
        if node.op == "call_module":
            top = str(node.target).split(".")[0]
            if seen and seen[-1] != top and top in seen:
                raise PrunusError(f"--pp-split: {what}'s forward calls the child {top} twice; {FIX}")
            if not seen or seen[-1] != top:
                seen.append(top)
        prev = node
    output = next(n for n in graph.nodes if n.op == "output")
    if output.args[0] is not prev:
        raise PrunusError(f"--pp-split: {what}'s forward does not return its last step's output alone; {FIX}")
    _check_order(module, seen)
    return steps


def _check_order(module: torch.nn.Module, called: list[str]) -> None:
    children = [n for n, c in module.named_children()]
    if called != [c for c in children if c in called]:
        raise PrunusError(f"--pp-split: {type(module).__name__}'s forward calls its children in the order "
                          f"{_names(called)}, not the order they were registered; {FIX}")
    holding = [n for n, c in module.named_children() if n not in called and any(True for _ in c.state_dict())]
    if holding:
        raise PrunusError(f"--pp-split: {type(module).__name__}'s child {holding[0]} holds weights but its forward "
                          f"never calls it; {FIX}")


def _stage_graph(steps: list[fx.Node]) -> fx.Graph:
    graph, env = fx.Graph(), {}
    env[steps[0].all_input_nodes[0]] = graph.placeholder("x")
    for node in steps:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[steps[-1]])
    return graph


def split_stages(module: torch.nn.Module, names: list[str]) -> list[fx.GraphModule]:
    """``len(names) + 1`` stage modules of ``module`` cut before each named child (see the module docstring)."""
    check_split_names(module, names)
    steps = _check_chain(module, _trace(module))
    cuts = []
    for name in names:
        at = next((i for i, n in enumerate(steps) if n.op == "call_module" and str(n.target).split(".")[0] == name), None)
        if at is None:
            raise PrunusError(f"--pp-split {name}: {type(module).__name__}'s forward never calls it; split at a "
                              "child the forward calls")
        cuts.append(at)
    bounds = list(zip([0, *cuts], [*cuts, len(steps)]))
    return [fx.GraphModule(module, _stage_graph(steps[a:b]), class_name=f"Stage{i}") for i, (a, b) in enumerate(bounds)]


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
