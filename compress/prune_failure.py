"""Which layer of a cut module fails, for ``prune_channels``' one-line refusal.

torch-pruning resizes a layer's tensors and the size attributes it knows of; a layer of the user's own that keeps
a size of its own (an attention module's ``head_dim``, a reshape to a fixed width) then fails in its forward. The
module is run once more with a hook on every submodule tracking the ones running: the innermost one running when
the exception is raised is the layer to name, with its type.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def _tracked(model: nn.Module, stack: list):
    def enter(mod, args):
        stack.append(mod)

    def leave(mod, args, out):  # returns None: the output stays the layer's own
        stack.pop()

    names = {m: n for n, m in model.named_modules()}
    hooks = []
    for mod in names:
        hooks += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    try:
        yield names
    finally:
        for h in hooks:
            h.remove()


def failing_layer(model: nn.Module, example: torch.Tensor) -> tuple[str, str, BaseException] | None:
    """(name, type name, exception) of the innermost layer whose forward raises on ``example``; None when the
    module runs."""
    stack: list = []
    with _tracked(model, stack) as names:
        try:
            with torch.no_grad():
                model(example)
        except Exception as e:  # noqa: BLE001 - the user's layer: any failure is named, not raised
            culprit = stack[-1] if stack else model
            return names.get(culprit) or "(the module)", type(culprit).__name__, e
    return None
