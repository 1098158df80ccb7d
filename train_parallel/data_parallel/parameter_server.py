"""Parameter server (``--dp-mode ps``): parameter shards live on server ranks, workers pull and push.

Ranks ``0 .. N-1`` (``--ps-servers N``) are servers, the rest are workers; all are started by the same
launcher (``--nproc``, torchrun, Slurm). Each server owns whole parameter tensors (assigned greedily by size,
:func:`shard_plan`), their AdamW states and the optimizer step. A worker holds a full copy of the model: each
step it **pulls** the current parameters from every server, computes the gradients of its share of the global
batch, and **pushes** each server its shard of them.

* **Synchronous** (``--ps-staleness`` unset): a server waits for every worker's push of step ``c``, averages
  them, clips by the global norm (one all-reduce among the servers), and steps once; a pull for step ``c`` is
  answered once step ``c - 1`` is applied. This is DDP's arithmetic: the same losses.
* **Asynchronous with bounded staleness K** (stale synchronous parallel): every push is applied at once, as its
  own optimizer step (clipped by the worker, at step ``c``'s learning rate). Each server knows every worker's
  clock (steps pushed); a worker's pull for step ``c`` is held until ``c - min(clocks) <= K``: no worker runs
  more than K steps ahead of the slowest, so the parameters it reads miss at most K steps of any worker.
  Counted in optimizer steps (one per push), a gradient is applied at most ``(K + 1) * workers - 1`` versions
  after the parameters it was computed on (``max_staleness_versions`` in the run's last record).

Messages are point-to-point ``torch.distributed`` send / recv on a gloo group (CPU tensors; gloo can receive
from any source, which a server needs): a 4-number header (op, step, loss, worker) with tag ``HEADER``, then a
flat payload with tag ``PAYLOAD``; replies carry tag ``REPLY``. The worker side is :mod:`.ps_worker`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError

from ..schedule import lr_at

PULL, PUSH, DONE = 1.0, 2.0, 3.0
HEADER, PAYLOAD, REPLY, GATHER = 11, 12, 13, 14


def validate_ps(cfg, world_size: int) -> int:
    """The number of workers of ``cfg``'s parameter-server layout on ``world_size`` ranks; one line otherwise."""
    if cfg.ps_servers >= world_size:
        raise PrunusError(f"--dp-mode ps: --ps-servers {cfg.ps_servers} leaves no worker among {world_size} ranks; "
                          f"use --nproc above {cfg.ps_servers}")
    others = {"--tp": cfg.tp, "--pp": cfg.pp, "--cp": cfg.cp, "--ep": cfg.ep, "--dp-replicate": cfg.dp_replicate}
    for flag, value in others.items():
        if value != 1:
            raise PrunusError(f"--dp-mode ps does not compose with {flag} {value}: the workers hold whole models; set {flag} 1")
    if cfg.zero not in (None, 0) or cfg.offload or cfg.cpu_offload:
        raise PrunusError("--dp-mode ps keeps the optimizer on the servers: drop --zero, --offload and --cpu-offload")
    workers = world_size - cfg.ps_servers
    if cfg.dp_shard not in (-1, workers):
        raise PrunusError(f"--dp-mode ps: the {workers} workers are the data-parallel ranks; leave --dp-shard unset")
    if cfg.batch_size % (workers * cfg.grad_accum):
        raise PrunusError(f"--batch-size {cfg.batch_size} is not divisible by ps workers x --grad-accum = "
                          f"{workers * cfg.grad_accum}; make it a multiple")
    return workers


def shard_plan(params: list[tuple[str, torch.Tensor]], n_servers: int) -> list[int]:
    """The server of each parameter: largest first, each to the server holding the fewest elements so far
    (ties: the lowest rank). Every rank computes the same plan from the model's shapes."""
    load = [0] * n_servers
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i][1].numel(), i)):
        s = min(range(n_servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += params[i][1].numel()
    return owner


def header(op: float, step: int = 0, loss: float = 0.0, worker: int = 0) -> torch.Tensor:
    return torch.tensor([op, step, loss, worker], dtype=torch.float64)


@dataclass
class ServerStats:
    """What a server saw: every pull it answered as (worker, step, the slowest worker's clock), and per push the
    parameter versions applied between the pushing worker's pull and its push (its staleness in updates)."""

    pulls: list = field(default_factory=list)
    staleness_versions: list = field(default_factory=list)
    round_losses: dict = field(default_factory=dict)  # step -> {worker: loss}
    wait_s: float = 0.0

    def max_lead(self) -> int:
        return max((step - slowest for _, step, slowest in self.pulls), default=0)


class ParameterServer:
    """One server rank: its parameter shard (CPU, fp32), AdamW over it, and the loop that answers the workers."""

    def __init__(self, cfg, named_params: list[tuple[str, torch.Tensor]], owner: list[int], server: int,
                 workers: list[int], group, server_group):
        self.cfg, self.server, self.workers, self.group, self.server_group = cfg, server, workers, group, server_group
        self.names = [n for (n, _), o in zip(named_params, owner) if o == server]
        self.params = [p.detach().cpu().float().clone().requires_grad_(True)
                       for (_, p), o in zip(named_params, owner) if o == server]
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        self.sync = cfg.ps_staleness is None
        self.clock = {w: 0 for w in workers}  # steps each worker has pushed
        self.pulled_at: dict[int, int] = {}  # worker -> the version it last pulled
        self.version = 0  # optimizer steps applied
        self.pending: list[tuple[int, int]] = []  # pulls held back by the staleness bound: (worker, step)
        self.round: dict[int, list] = {}  # synchronous: step -> [summed flat gradient, pushes]
        self.stats = ServerStats()

    # -- parameters as one flat tensor ---------------------------------------------------------------------------

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params else torch.zeros(0)

    def _set_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    # -- the loop ------------------------------------------------------------------------------------------------

    def _allowed(self, step: int) -> bool:
        slowest = min(self.clock.values())
        return slowest >= step if self.sync else step - slowest <= self.cfg.ps_staleness

    def _reply(self, worker: int, step: int) -> None:
        self.stats.pulls.append((worker, step, min(self.clock.values())))
        self.pulled_at[worker] = self.version
        dist.send(self.flat_params(), dst=worker, group=self.group, tag=REPLY)

    def _step(self, flat_grad: torch.Tensor, step: int, clip: bool) -> None:
        """One optimizer step with ``flat_grad`` at step ``step``'s learning rate (clipped by the global norm of
        all servers' shards when ``clip``: synchronous mode)."""
        cfg = self.cfg
        self._set_grads(flat_grad)
        if clip and cfg.grad_clip > 0:
            grads = [p.grad for p in self.params]
            sq = torch.nn.utils.get_total_norm(grads, foreach=True).pow(2) if grads else torch.zeros(())
            if self.server_group is not None:
                dist.all_reduce(sq, group=self.server_group)
            torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip, sq.sqrt(), foreach=True)
        lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1

    def _push(self, worker: int, step: int, loss: float) -> None:
        grad = torch.empty(sum(p.numel() for p in self.params))
        dist.recv(grad, src=worker, group=self.group, tag=PAYLOAD)
        self.clock[worker] = step + 1
        self.stats.round_losses.setdefault(step, {})[worker] = loss
        if self.sync:
            acc = self.round.setdefault(step, [torch.zeros_like(grad), 0])
            acc[0] += grad
            acc[1] += 1
            if acc[1] == len(self.workers):
                del self.round[step]
                self._step(acc[0] / len(self.workers), step, clip=True)
        else:
            self.stats.staleness_versions.append(self.version - self.pulled_at.get(worker, 0))
            self._step(grad, step, clip=False)  # the worker clipped its own gradient

    def serve(self) -> ServerStats:
        """Answer pulls and pushes until every worker says it is done."""
        done = 0
        hdr = torch.zeros(4, dtype=torch.float64)
        while done < len(self.workers):
            t0 = time.perf_counter()
            src = dist.recv(hdr, src=None, group=self.group, tag=HEADER)
            self.stats.wait_s += time.perf_counter() - t0
            op, step, loss = float(hdr[0]), int(hdr[1]), float(hdr[2])
            if op == PULL:
                if self._allowed(step):
                    self._reply(src, step)
                else:
                    self.pending.append((src, step))
            elif op == PUSH:
                self._push(src, step, loss)
                ready = [(w, s) for w, s in self.pending if self._allowed(s)]
                self.pending = [(w, s) for w, s in self.pending if not self._allowed(s)]
                for w, s in ready:
                    self._reply(w, s)
            elif op == DONE:
                done += 1
        return self.stats


def gather_to_rank0(server: ParameterServer, n_servers: int, owner: list[int], model: torch.nn.Module, group) -> None:
    """Every server's shard into ``model`` on rank 0 (server 0), for the model dir and the final evaluation."""
    if server.server != 0:
        dist.send(server.flat_params(), dst=0, group=group, tag=GATHER)
        return
    params = list(model.parameters())
    with torch.no_grad():
        for s in range(n_servers):
            mine = [p for p, o in zip(params, owner) if o == s]
            flat = server.flat_params() if s == 0 else torch.empty(sum(p.numel() for p in mine))
            if s != 0:
                dist.recv(flat, src=s, group=group, tag=GATHER)
            torch.nn.utils.vector_to_parameters(flat, mine) if mine else None
