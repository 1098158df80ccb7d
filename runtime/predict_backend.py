"""What the two non-generative runtimes share: a :class:`~prunus.runtime.backend.Backend` declaring
``Capabilities(predict=True)``, whose ``predict(batch)`` is one forward pass of numpy rows -> numpy rows.

Each runtime supplies ``_forward(array) -> array``; the input's spec comes from config.json's ``input`` (what
training recorded), the output's from one probe pass at load (which also warms the runtime up).
"""

from __future__ import annotations

import numpy as np

from prunus.artifacts.errors import PrunusError

from .backend import BackendBase, Capabilities
from .tensor_spec import TensorSpec, datatype_of

INPUT, OUTPUT = "input", "output"


def check_predict_options(path, options) -> None:
    """Refuse, in one line, a dtype (only a generative model's; it would be ignored here). Tensor parallelism, a
    device map, the native kernels, the prompt graph and compile are the runtime table's to refuse (its rows for a
    generic module accept none of them)."""
    if options.dtype is not None:
        raise PrunusError(f"{path}: a generic module is served in one process on one device, as saved; drop --dtype")


def input_spec(path, config: dict) -> TensorSpec:
    spec = config.get("input")
    if not isinstance(spec, dict):
        raise PrunusError(f"{path}/config.json: records no input shape, so requests cannot be checked; re-create the "
                          "model dir with prunus train --model (which records it) or save_module(..., input=...)")
    return TensorSpec(INPUT, datatype_of(spec["dtype"]), tuple(spec["shape"]))


class PredictBackend(BackendBase):
    """The generative parts of :class:`~prunus.runtime.backend.Backend` refuse: there is no cache to fill."""

    name = "predict"
    n_slots = 0
    max_len = 0
    vocab_size = 0

    def __init__(self, path, config: dict, max_batch: int):
        self._capabilities = Capabilities(max_batch=max_batch, predict=True)
        self.inputs = [input_spec(path, config)]
        probe = self._forward(np.zeros((1, *self.inputs[0].sample_shape), self.inputs[0].dtype))
        self.outputs = [TensorSpec(OUTPUT, datatype_of(probe.dtype), tuple(probe.shape[1:]))]

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def predict(self, batch: np.ndarray) -> np.ndarray:
        """The outputs of ``batch`` (checked against ``inputs[0]``), one row per row, in one pass."""
        out = self._forward(self.inputs[0].check(batch))
        if out.shape[0] != batch.shape[0]:
            raise PrunusError(f"the model returned {out.shape[0]} rows for {batch.shape[0]} inputs; its output must "
                              "keep the batch axis")
        return out

    def _generative(self, *args):
        raise NotImplementedError(f"the {self.name} backend of a non-generative model predicts "
                                  "(capabilities.predict); it has no prefill, extend or decode")

    prefill = extend = decode = _generative

    def release(self, row: int) -> None:
        pass

    def describe(self) -> dict:
        return {"inputs": [s.metadata() for s in self.inputs], "outputs": [s.metadata() for s in self.outputs]}

    def close(self) -> None:
        pass
