"""The gated feed-forward of a transformer block (and of a mixture of experts' shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """A gated feed-forward: w2(act(w1 x) * w3 x), act SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""

    def __init__(self, dim: int, hidden: int, act: str = "silu"):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))
