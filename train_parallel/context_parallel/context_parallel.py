"""Context parallelism: every sequence split over the ``cp`` ranks, attention computed across them.

* the batch: each cp rank of a data-parallel group gets the same sequences and keeps
  chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` equal chunks (causal load balance), with
  their absolute positions for the rotary embeddings (:func:`shard_batch`);
* the model: every block's attention core (the parameter-free ``CausalAttention``)
  is replaced by ring attention or Ulysses (:func:`apply_cp`); projections, norms,
  MLP and head are per-token and run on the local chunks unchanged;
* the loss: each rank's mean over its tokens; all ranks hold the same number, so the
  mean of those means over cp (and dp) is the global token mean. Parameters are
  replicated over cp like over data parallelism: FSDP shards (and DDP averages)
  gradients over data-parallel x cp ranks together (``dp_shard_cp`` / ``dp_cp`` in
  ``ParallelDims``), which averages the cp ranks' gradients into the global mean's.

Composes with FSDP/DDP/HSDP and tensor parallelism (each tp rank runs its own ring
over its heads); pipeline parallelism and mixture-of-experts models are refused (``validate_cp``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError

from .ring_attention import RingAttention
from .ulysses import UlyssesAttention

IMPLS = ("ring", "ulysses")


def validate_cp(cp: int, impl: str, seq_len: int, n_heads: int, tp: int = 1, pp: int = 1, moe: bool = False) -> None:
    """Refuse, in one line, a context-parallel layout the model or sequence cannot be split into."""
    if impl not in IMPLS:
        raise PrunusError(f"--cp-impl {impl}: choose ring or ulysses")
    if cp == 1:
        return
    if pp > 1:
        raise PrunusError(f"--cp {cp} with --pp {pp}: context parallelism does not compose with pipeline stages; "
                          "use --cp with data and tensor parallelism only")
    if moe:
        raise PrunusError(f"--cp {cp}: mixture-of-experts models (their routing statistics are per sequence) and --ep "
                          "train without context parallelism; set --cp 1")
    if seq_len % (2 * cp):
        raise PrunusError(f"--seq-len {seq_len} is not divisible by 2 x --cp = {2 * cp} (each rank holds two chunks "
                          "of every sequence); choose a multiple")
    if impl == "ulysses" and (n_heads // tp) % cp:
        raise PrunusError(f"--cp {cp} --cp-impl ulysses: the {n_heads // tp} attention heads per tensor-parallel rank "
                          "are not divisible by --cp; choose a --cp that divides them, or --cp-impl ring")


def apply_cp(model: torch.nn.Module, cp_mesh, impl: str) -> None:
    """Replace every block's ``attention.core`` with ring attention or Ulysses over ``cp_mesh``; each keeps its
    layer's sliding window, soft-cap and attention scale."""
    if impl not in IMPLS:
        raise PrunusError(f"--cp-impl {impl}: choose ring or ulysses")
    group = cp_mesh.get_group()
    for block in model.layers.values():
        core = block.attention.core
        block.attention.core = RingAttention(group, core) if impl == "ring" else UlyssesAttention(group, core)


def load_balanced_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions of rank ``rank``'s two chunks (``rank`` and ``2*cp-1-rank``) of a ``seq_len`` sequence."""
    chunk = seq_len // (2 * cp)
    second = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, cp_mesh) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, positions) of this cp rank: its chunks of (batch, seq); positions None without cp."""
    if cp_mesh is None:
        return inputs, targets, None
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    seq_len = inputs.shape[1]
    if seq_len % (2 * cp):
        raise PrunusError(f"context parallelism: sequence length {seq_len} is not divisible by 2 x --cp = {2 * cp}")
    positions = load_balanced_positions(seq_len, rank, cp, device=inputs.device)
    return inputs[:, positions], targets[:, positions], positions


def unshard(local: torch.Tensor, cp_mesh, dim: int = 1) -> torch.Tensor:
    """Gather every cp rank's chunks of ``local`` (sharded on ``dim``) back into sequence order (not differentiable)."""
    cp = cp_mesh.size()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=cp_mesh.get_group())
    seq_len = local.shape[dim] * cp
    order = torch.cat([load_balanced_positions(seq_len, r, cp, device=local.device) for r in range(cp)])
    out = torch.empty((*local.shape[:dim], seq_len, *local.shape[dim + 1:]), dtype=local.dtype, device=local.device)
    out.index_copy_(dim, order, torch.cat(parts, dim=dim))
    return out


def cp_sum(value: float, cp_mesh) -> float:
    """A float summed over the cp ranks (each rank's share of a total: a summed loss, say)."""
    if cp_mesh is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=cp_mesh.device_type)
    dist.all_reduce(t, group=cp_mesh.get_group())
    return float(t)
