"""Untie a model's output head from its embedding table before a quantize pass changes one of them."""

from __future__ import annotations

from torch import nn


def untie_output(model: nn.Module) -> None:
    """Give the output head its own copy of the embedding table."""
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())
    model.config = model.config.replace(tie_embeddings=False)
