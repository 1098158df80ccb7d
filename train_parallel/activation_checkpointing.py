"""Activation checkpointing: recompute blocks' activations in backward instead of storing them.

``full`` wraps every block; ``every-other`` every other block (half the memory saving
for half the recomputation). ``selective``, this mode's earlier name, is still
accepted: run configs (``run.json``) written before the rename hold it, and
``--resume`` reads them.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

ALIASES = {"selective": "every-other"}  # earlier names, as saved run configs hold them


def apply_ac(model, mode: str) -> None:
    mode = ALIASES.get(mode, mode)
    if mode == "none":
        return
    for i, key in enumerate(list(model.layers.keys())):
        if mode == "full" or i % 2 == 0:
            model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)
