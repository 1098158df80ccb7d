"""The tensors of a non-generative model as the Open Inference Protocol names them: name, datatype
(``FP32``, ``INT64``, ...) and shape with ``-1`` for the batch axis; and the check of a batch against them.

Torch-free: the HTTP server and the backends share it; numpy arrays only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prunus.artifacts.errors import PrunusError

# Open Inference Protocol datatype <-> numpy dtype name (bfloat16 has no numpy dtype: served as FP32 outside)
DATATYPES = {"FP32": "float32", "FP16": "float16", "FP64": "float64", "INT64": "int64", "INT32": "int32",
             "INT16": "int16", "INT8": "int8", "UINT8": "uint8", "BOOL": "bool"}
NUMPY_TO_DATATYPE = {v: k for k, v in DATATYPES.items()}


def datatype_of(dtype) -> str:
    """The protocol's name for a numpy (or torch, by its name) dtype; one line for one it cannot carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in NUMPY_TO_DATATYPE:
        raise PrunusError(f"dtype {name} has no Open Inference Protocol datatype here; use one of "
                          f"{', '.join(DATATYPES.values())}")
    return NUMPY_TO_DATATYPE[name]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # a key of DATATYPES
    sample_shape: tuple[int, ...]  # one sample's, without the batch axis

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(DATATYPES[self.datatype])

    def metadata(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.sample_shape]}

    def check(self, batch: np.ndarray, where: str = "input") -> np.ndarray:
        """``batch`` (rows of this tensor's samples) as it is, or one line naming the tensor and what is wrong."""
        if not isinstance(batch, np.ndarray):
            raise PrunusError(f"{where} {self.name!r}: give a numpy array or a torch tensor, not {type(batch).__name__}")
        if batch.dtype != self.dtype:
            raise PrunusError(f"{where} {self.name!r}: datatype {batch.dtype} where the model takes {self.dtype} "
                              f"({self.datatype}); convert it (e.g. .astype('{self.dtype}'))")
        if batch.ndim != len(self.sample_shape) + 1 or tuple(batch.shape[1:]) != self.sample_shape or not batch.shape[0]:
            raise PrunusError(f"{where} {self.name!r}: shape {list(batch.shape)} where the model takes "
                              f"{self.metadata()['shape']} (-1: one or more rows)")
        return batch


def as_rows(batch, spec: TensorSpec) -> tuple[np.ndarray, bool]:
    """(``batch`` as a numpy array checked against ``spec``, whether it came as a torch tensor)."""
    as_torch = type(batch).__module__.split(".")[0] == "torch"
    if as_torch:
        batch = batch.detach().cpu()
        if str(batch.dtype) == "torch.bfloat16":
            raise PrunusError(f"input {spec.name!r}: datatype bfloat16 where the model takes {spec.dtype}; convert it")
        batch = batch.numpy()
    return spec.check(batch), as_torch
