"""Synchronised batch normalisation: BatchNorm statistics over the global batch of every data-parallel rank.

With plain BatchNorm each rank normalises by its own share of the batch, so a data-parallel run is not the
one-process run of the same global batch. Converted (``--sync-batchnorm``), every BatchNorm layer computes the
mean and variance over all ranks' samples, and updates its running statistics with them, as one process would.

torch's ``nn.SyncBatchNorm`` runs on accelerators only; on the CPU (gloo) :class:`SyncBatchNorm` does the same
with collectives that autograd differentiates: the per-channel sums are all-reduced in the forward pass (the
mean, then the squared deviations from it: two passes, as ``batch_norm`` computes them) and their gradients
all-reduced in the backward pass. The converted modules keep their parameter and buffer names, so state
dicts, checkpoints and model dirs are those of the unconverted model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in the forward pass; the gradient summed over the group in the backward pass."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of ``process_group`` (any device; see the module docstring)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _synced(self) -> bool:
        return (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._synced():
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float32, device=x.device)
        total = _AllReduceSum.apply(torch.cat([x.sum(dims).float(), count]), self.process_group)
        n = total[-1]
        mean = (total[:-1] / n).to(x.dtype)
        centred = x - mean.reshape(shape)
        var = (_AllReduceSum.apply(centred.pow(2).sum(dims).float(), self.process_group) / n).to(x.dtype)
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), n.detach())
        y = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1).clamp(min=1)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def _converted(module: _BatchNorm, process_group) -> SyncBatchNorm:
    out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                        process_group)
    if module.affine:
        out.weight, out.bias = module.weight, module.bias
    out.running_mean, out.running_var = module.running_mean, module.running_var
    out.num_batches_tracked = module.num_batches_tracked
    out.train(module.training)
    return out


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """``module`` with every BatchNorm layer synchronised over ``process_group``: torch's ``nn.SyncBatchNorm``
    on CUDA, :class:`SyncBatchNorm` elsewhere. Parameters and buffers are the same tensors, under the same names."""
    device = next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        return _converted(module, process_group)
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, process_group)
        if new is not child:
            module.add_module(name, new)
    return module
