"""The final hidden state of a pass, without the output head: a hook on the head's input keeps it and ends the pass
(no logits are computed), on the thread that asks only (the scheduler's passes on its own thread are untouched)."""

from __future__ import annotations

import threading

import torch


class _Stop(Exception):
    """Raised by the capture hook once the hidden state is kept: the pass goes no further."""


class HiddenCapture:
    """A forward pre-hook on the model's output head that, on a thread that asks for it, keeps the head's input and
    ends the pass; other threads' passes (the scheduler's) are untouched."""

    def __init__(self, model):
        self._local = threading.local()
        self.handle = model.output.register_forward_pre_hook(self._keep) if model.output is not None else None

    def _keep(self, module, args):
        if getattr(self._local, "on", False):
            self._local.h = args[0]
            raise _Stop

    def run(self, model, tokens: torch.Tensor) -> torch.Tensor:
        if self.handle is None:  # a model without a head returns its final hidden state
            return model(tokens)
        self._local.on = True
        try:
            model(tokens)
        except _Stop:
            return self._local.h
        finally:
            self._local.on = False
            self._local.h = None
        raise RuntimeError("the model's output head did not run")
