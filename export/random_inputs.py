"""Seeded random inputs of the shape and dtype a generic module's model dir records (``config.json``'s ``input``):
the probe and calibration samples of an export without ``--data``."""

from __future__ import annotations

import torch


def random_inputs(spec: dict, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shape, dtype = (n, *spec["shape"]), getattr(torch, spec["dtype"])
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, spec.get("high", 2), shape, generator=gen).to(dtype)
