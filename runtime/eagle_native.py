"""An EAGLE draft's linear layers in prunus's native int8 kernels, on the target's own thread pool.

Beside a target served by the native kernels (an int8 export reads about 160 MB of weights per token for
SmolLM2-135M), a float32 draft of one block and a 16k-row head reads 54 MB: on a CPU whose decode is bound by
memory bandwidth that is a third of the target's cost, and the draft's gain is gone. Stored as int8 in blocks of 32
(one float scale per block, symmetric) and run by ``prunus_linear`` (the decoder's own kernels, activations
quantized per block as the target's are) it reads a quarter of that. The draft only proposes: its rounding changes
what is drafted, never what is accepted (the target checks every token).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import nn

from prunus.native.decoder import _linear
from prunus.native.weights import pack_blocks


def int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (n, k), k a multiple of 32 -> (codes (n, k) uint8 stored as q + 128, scales (n, k / 32)): symmetric int8."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    scale = np.abs(blocks).max(-1) / 127
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(blocks / scale[..., None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8).reshape(n, k), scale.astype(np.float32)


class NativeLinear(nn.Module):
    """``linear``'s weights as int8 blocks, run by the native kernels on ``decoder``'s pool (float32 in and out)."""

    def __init__(self, linear: nn.Linear, decoder):
        super().__init__()
        w = linear.weight.detach().float().numpy()
        bias = None if linear.bias is None else linear.bias.detach().float().numpy().copy()
        self.n, self.k = w.shape
        self.packed = pack_blocks(*int8_blocks(w), None, 8, bias)
        self.c = _linear(self.packed)  # points into self.packed's arrays, which live as long as this module
        self.lib, self.decoder = decoder.lib, decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = np.ascontiguousarray(x.reshape(-1, self.k).float().numpy())
        y = np.empty((a.shape[0], self.n), np.float32)
        self.lib.prunus_linear(ctypes.byref(self.c), self.decoder.pool, a.shape[0], a.ctypes.data, y.ctypes.data)
        return torch.from_numpy(y).reshape(*lead, self.n)


def native_linears(draft: nn.Module, decoder) -> nn.Module:
    """``draft`` with every ``nn.Linear`` whose input width is a multiple of 32 replaced by a :class:`NativeLinear`."""
    for module in list(draft.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
                setattr(module, name, NativeLinear(child, decoder))
    return draft
