"""Activation checkpointing: recompute blocks' activations in backward instead of storing them.

``full`` wraps every block; ``selective`` every other block (half the memory saving
for half the recomputation).
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

MODES = ("none", "selective", "full")


def apply_ac(model, mode: str) -> None:
    if mode == "none":
        return
    for i, key in enumerate(list(model.layers.keys())):
        if mode == "full" or i % 2 == 0:
            model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)
