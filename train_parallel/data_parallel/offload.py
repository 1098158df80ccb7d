"""ZeRO-Offload (``--offload``): the optimizer's states and its step on the CPU, parameters and gradients on
the GPU.

| --zero | what ``--offload`` does |
|---|---|
| 0 (DDP) | :class:`OffloadedAdamW`: fp32 master copies of the parameters, AdamW's two moments and the step on the host; after the step the updated values are copied back to the GPU parameters |
| 1 (ZeRO-1) | the same, inside ``ZeroRedundancyOptimizer``: each rank offloads only the shard it updates, then ZeRO broadcasts it |
| 2 / 3 (FSDP2) | ``torch.distributed.fsdp.CPUOffloadPolicy``: the parameter shards, their gradients and the optimizer live on the host; FSDP copies each block's shard to the GPU for compute |

Per step the GPU sends each gradient to the host once and receives each updated parameter once (DeepSpeed's
ZeRO-Offload pattern); the optimizer's 8 bytes per parameter (plus the 4-byte master) never occupy the
device. torch runs the host step with its foreach AdamW on the CPU. Needs a GPU: without one there is nothing
to offload from (checked before anything starts, :func:`check_offload`).
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError


def check_offload(cfg, device_type: str | None = None) -> None:
    """One line when ``--offload`` cannot run here (no CUDA device) or with this layout."""
    if not (cfg.offload or cfg.cpu_offload):
        return
    flag = "--offload" if cfg.offload else "--cpu-offload"
    if device_type == "cpu" or cfg.device == "cpu" or not torch.cuda.is_available():
        raise PrunusError(f"{flag} moves optimizer states from a GPU to the host, and this run has no GPU; drop {flag}")


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose states, fp32 master weights and step live on the CPU, over parameters on a GPU.

    ``param_groups`` are the device parameters (learning rate and weight decay are set on them as on any
    optimizer, ZeroRedundancyOptimizer's sharding sees them); ``state`` holds the host tensors, keyed by the
    device parameters, so ``state_dict`` / ``torch.distributed.checkpoint`` save and load them as AdamW's."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 pin_memory: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        host_groups = []
        for group in self.param_groups:
            masters = [self._master(p) for p in group["params"]]
            host_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self.host = torch.optim.AdamW(host_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
        m.copy_(p.detach())
        self.masters[p] = m
        return m

    def sync_from_params(self) -> None:
        """Masters := the device parameters (after the parameters were loaded or broadcast from elsewhere)."""
        with torch.no_grad():
            for p, m in self.masters.items():
                m.copy_(p.detach())

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group, host_group in zip(self.param_groups, self.host.param_groups):
            for k, v in group.items():  # the learning rate and friends, as set on this optimizer
                if k != "params":
                    host_group[k] = v
            for p, m in zip(group["params"], host_group["params"]):
                m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the gradients have arrived on the host
        self.host.step()
        for group in self.param_groups:
            for p in group["params"]:
                m = self.masters[p]
                if m.grad is not None:
                    p.copy_(m, non_blocking=self.pin)
                    m.grad = None
                if m in self.host.state:
                    self.state[p] = self.host.state[m]  # the same host tensors, keyed for state_dict
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # torch casts the states to the parameters' device: back to the host
        self.sync_from_params()
        for p, m in self.masters.items():
            if p in self.state:
                self.host.state[m] = {k: (v.to("cpu") if torch.is_tensor(v) else v) for k, v in self.state[p].items()}
                self.state[p] = self.host.state[m]

