"""The Open Inference Protocol's classification extension, as Triton serves it: an output asked for with
``"parameters": {"classification": k}`` comes back as a BYTES tensor of shape ``[rows, k]`` instead of its scores,
row i holding its k highest-scored classes, best first, each as the string ``"<score>:<index>:<label>"``.

* ``<score>``: the model's output at that index (the shortest text that reads back to the same value of the
  output's datatype); ties keep the lower index first;
* ``<label>``: the class name a table-trained classifier keeps in its model dir's ``labels.json`` (carried into
  its compressed and export dirs), or the index itself when the dir has no class names;
* ``k`` above the number of classes returns every class, ranked. Only an output of ``(rows, classes)`` is
  classified; a ``k`` that is not a positive integer, or an output of another rank, is a 400 naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prunus.artifacts.errors import PrunusError
from prunus.runtime.tensor_spec import TensorSpec

from .http_guard import BadRequest

MAX_CLASSIFICATION = 2**31 - 1  # the largest k a request may ask for (the answer holds at most the class count)


def model_labels(path, spec: TensorSpec) -> list[str] | None:
    """The class names of the model served from ``path`` for its output ``spec`` (from its ``labels.json``), or
    None when it keeps none (the class index is then the label); one PrunusError line when their count is not the
    output's number of classes."""
    if path is None or not Path(path).is_dir():
        return None
    from prunus.models.class_labels import read_labels  # the one reader of labels.json (format and class names checked)

    labels = read_labels(path)
    classes = None if labels is None else labels.get("classes")
    if classes is None:
        return None
    if spec.sample_shape != (len(classes),):
        raise PrunusError(f"{Path(path) / 'labels.json'}: {len(classes)} class names where output {spec.name!r} "
                          f"scores shape {list(spec.sample_shape)}; re-create the model dir")
    return [str(c) for c in classes]


def check_classification(value, where: str) -> int:
    """The ``classification`` parameter of a requested output: k, a positive integer; else a 400."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_CLASSIFICATION:
        raise BadRequest(400, f"{where}: classification must be the number of top classes to return, an integer "
                              f"from 1 to {MAX_CLASSIFICATION}, not {str(value)[:40]}")
    return value


def classify(out: np.ndarray, k: int, spec: TensorSpec, labels: list[str] | None) -> np.ndarray:
    """``out`` (rows, classes) as its top-k ``"score:index:label"`` strings (an object array of bytes, rows × k)."""
    if out.ndim != 2:
        raise BadRequest(400, f"output tensor {spec.name[:80]!r}: classification needs an output of (rows, classes); "
                              f"this one has shape {[-1, *spec.sample_shape]}; ask for the tensor itself")
    k = min(k, out.shape[1])
    order = np.argsort(-out.astype(np.float64), axis=1, kind="stable")[:, :k]
    top = np.empty(order.shape, dtype=object)
    for row, indices in enumerate(order):
        for j, index in enumerate(indices):
            index = int(index)
            label = labels[index] if labels is not None else str(index)
            top[row, j] = f"{out[row, index]}:{index}:{label}".encode()
    return top
