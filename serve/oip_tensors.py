"""The typed tensors of an Open Inference Protocol infer request, checked against the model's input specs.

``{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype", "data", "parameters"?}], "outputs"?: [...]}``:
each input must name one of the model's inputs, once; its ``datatype`` must be the model's, its ``shape`` the
model's with one or more rows, and ``data`` (flat in row-major order, or nested) must hold exactly as many
elements of that type as the shape says, each one the datatype holds: an integer within its range, a finite number
that stays finite in FP16 / FP32 / FP64 (``1e39`` is no FP32 value: the cast would make it infinity; NaN and
infinity are refused for every datatype). An input may instead carry ``"parameters": {"binary_data_size": B}``
and its B bytes after the JSON header (:mod:`prunus.serve.oip_binary`). BYTES tensors are refused (this server's
models take numeric tensors). ``parameters`` other than ``binary_data_size`` (inputs), ``binary_data`` and
``classification`` (outputs: :mod:`prunus.serve.oip_classification`) and ``binary_data_output`` (the request) are
refused, not ignored. Anything else is a
:class:`~prunus.serve.http_guard.BadRequest` (400) whose one line names the tensor and the element.

:func:`output_tensor` writes a model's output as the protocol's JSON tensor (:func:`bytes_tensor` a BYTES one, the
classification extension's); an output holding NaN or infinity, which JSON numbers cannot carry (and which no class
ranking means), is a one-line BadRequest(500) naming the output: the inputs were finite and representable, so it is
the model's overflow, not the client's mistake.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from prunus.artifacts.finite_arrays import describe, first_nonfinite
from prunus.runtime.tensor_spec import DATATYPES, TensorSpec

from .http_guard import BadRequest
from .oip_binary import array_from_bytes, binary_inputs, binary_size
from .oip_classification import check_classification

REQUEST_FIELDS = {"id", "parameters", "inputs", "outputs"}
TENSOR_FIELDS = {"name", "shape", "datatype", "data", "parameters"}
OUTPUT_PARAMETERS = ("binary_data", "classification")


class Requested(NamedTuple):
    """How a requested output is returned: in binary or JSON; its top ``classification`` classes (0: the tensor)."""

    binary: bool
    classification: int = 0


def _flat(data, where: str) -> list:
    """The elements of a flat or nested list, row-major, without recursion."""
    if not isinstance(data, list):
        raise BadRequest(400, f"{where}: 'data' must be a list of numbers (row-major), not {type(data).__name__}")
    out, stack = [], [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def _is_value(v, spec: TensorSpec) -> bool:
    if spec.datatype == "BOOL":
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if spec.datatype.startswith(("INT", "UINT")):
        return isinstance(v, int)
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


def _values(flat: list, spec: TensorSpec, where: str) -> np.ndarray:
    for i, v in enumerate(flat):
        if not _is_value(v, spec):
            shown = str(v)[:40] if isinstance(v, (int, float, str)) else type(v).__name__
            finite = "finite " if isinstance(v, float) and not math.isfinite(v) else ""
            raise BadRequest(400, f"{where}: element {i} {shown!r} is not a {finite}{spec.datatype} value")
    if spec.datatype.startswith(("INT", "UINT")) and flat:
        info = np.iinfo(spec.dtype)
        if not info.min <= min(flat) <= max(flat) <= info.max:
            raise BadRequest(400, f"{where}: an element lies outside {spec.datatype}'s range [{info.min}, {info.max}]")
    with np.errstate(over="ignore"):  # a number beyond FP16 / FP32 becomes infinity in the cast: found below
        array = np.array(flat, dtype=spec.dtype)
    i = first_nonfinite(array)
    if i is not None:
        limit = float(np.finfo(spec.dtype).max)
        raise BadRequest(400, f"{where}: element {i} ({str(flat[i])[:40]}) lies outside {spec.datatype}'s range "
                              f"[{-limit:.6g}, {limit:.6g}]; send values the datatype holds")
    return array


def _check_datatype(entry: dict, spec: TensorSpec, where: str) -> None:
    datatype = entry.get("datatype")
    if datatype == spec.datatype:
        return
    if datatype == "BYTES":
        raise BadRequest(400, f"{where}: datatype BYTES is not served here (this model's tensors are numeric); "
                              f"send {spec.datatype}")
    known = "" if datatype in DATATYPES else " (not an Open Inference Protocol datatype this server knows)"
    raise BadRequest(400, f"{where}: datatype {str(datatype)[:20]!r}{known} where the model takes {spec.datatype}")


def _tensor(entry, specs: dict[str, TensorSpec], raw: dict[str, bytes]) -> tuple[str, np.ndarray]:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise BadRequest(400, "each entry of 'inputs' must be an object with a 'name'")
    name = entry["name"]
    where = f"input tensor {name[:80]!r}"
    if name not in specs:
        raise BadRequest(400, f"{where}: the model has no such input; it takes {', '.join(specs)}")
    unknown = sorted(set(entry) - TENSOR_FIELDS)
    if unknown:
        raise BadRequest(400, f"{where}: unknown field(s) {', '.join(unknown)[:120]}")
    spec = specs[name]
    _check_datatype(entry, spec, where)
    shape, want = entry.get("shape"), spec.metadata()["shape"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            and len(shape) == len(want) and shape and shape[0] >= 1 and tuple(shape[1:]) == spec.sample_shape):
        raise BadRequest(400, f"{where}: shape {str(shape)[:80]} where the model takes {want} (-1: one or more rows)")
    if binary_size(entry, where) is not None:
        if "data" in entry:
            raise BadRequest(400, f"{where}: give its data in 'data' or as binary_data_size bytes, not both")
        return name, array_from_bytes(raw[name], spec.dtype, spec.datatype, shape, where)
    flat = _flat(entry.get("data"), where)
    count = math.prod(shape)
    if len(flat) != count:
        raise BadRequest(400, f"{where}: 'data' holds {len(flat)} elements where shape {shape} needs {count}")
    return name, _values(flat, spec, where).reshape(shape)


def parse_infer(req, specs: list[TensorSpec], outputs: list[str],
                tail: bytes = b"") -> tuple[dict[str, np.ndarray], object, dict[str, Requested]]:
    """({input name: array}, the request's id, {output name: how it is returned}) of a parsed infer body,
    every tensor checked; ``outputs``: the model's output names; ``tail``: the binary data after the JSON header."""
    if not isinstance(req, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    unknown = sorted(set(req) - REQUEST_FIELDS)
    if unknown:
        raise BadRequest(400, f"unknown field(s): {', '.join(unknown)[:120]}")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest(400, "'inputs' must be a non-empty list of tensors")
    raw = binary_inputs(inputs, tail)
    by_name = {s.name: s for s in specs}
    tensors = dict(_tensor(entry, by_name, raw) for entry in inputs)
    if len(tensors) != len(inputs):
        raise BadRequest(400, "an input tensor is given twice; give each once")
    missing = [n for n in by_name if n not in tensors]
    if missing:
        raise BadRequest(400, f"input tensor {missing[0]!r} is missing; the model takes {', '.join(by_name)}")
    request_id = req.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(400, "'id' must be a string")
    return tensors, request_id, _requested(req, outputs)


def _flag(params, key: str, where: str) -> bool:
    """``params[key]`` (a bool, False when absent) of the request's ``parameters``; any other parameter is a 400."""
    if params is None:
        return False
    if not isinstance(params, dict) or set(params) - {key}:
        raise BadRequest(400, f"{where}: the only parameter supported is {key} (priority and the others are not)")
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(400, f"{where}: {key} must be true or false")
    return value


def _output(params, binary: bool, where: str) -> Requested:
    """A requested output's ``parameters`` (``binary_data``, ``classification``) over the request's default."""
    if params is None:
        return Requested(binary)
    if not isinstance(params, dict) or set(params) - set(OUTPUT_PARAMETERS):
        raise BadRequest(400, f"{where}: the parameters supported are {' and '.join(OUTPUT_PARAMETERS)}")
    own = params.get("binary_data", binary)
    if not isinstance(own, bool):
        raise BadRequest(400, f"{where}: binary_data must be true or false")
    k = params.get("classification")
    return Requested(own, 0 if k is None else check_classification(k, where))


def _requested(req: dict, outputs: list[str]) -> dict[str, Requested]:
    """{output name: how it is returned} of the outputs to return: those ``outputs`` names, else all the model's;
    binary per output's ``binary_data``, else the request's ``binary_data_output``."""
    binary = _flag(req.get("parameters"), "binary_data_output", "the request's 'parameters'")
    asked = req.get("outputs")
    if asked is None:
        return {name: Requested(binary) for name in outputs}
    if not isinstance(asked, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in asked):
        raise BadRequest(400, "'outputs' must be a list of objects with a 'name'")
    out = {}
    for o in asked:
        where = f"output tensor {o['name'][:80]!r}"
        if o["name"] not in outputs:
            raise BadRequest(400, f"{where}: the model has no such output; it gives {', '.join(outputs)}")
        if set(o) - {"name", "parameters"}:
            raise BadRequest(400, f"{where}: only 'name' and 'parameters' are supported")
        out[o["name"]] = _output(o.get("parameters"), binary, where)
    return out


def check_finite(out: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """``out``, or BadRequest(500) naming the output when it holds a NaN or an infinity (the model overflowed)."""
    i = first_nonfinite(out)
    if i is not None:
        raise BadRequest(500, f"output tensor {spec.name[:80]!r}: the model produced {describe(out.reshape(-1)[i])} at "
                              f"element {i} of {out.size} from finite inputs (an overflow in the model), which JSON "
                              "cannot carry; check the model's weights and the range of inputs it was trained on")
    return out


def output_tensor(out: np.ndarray, spec: TensorSpec) -> dict:
    """The protocol's JSON tensor of output ``spec`` holding ``out``; a NaN or an infinity in it is BadRequest(500)."""
    check_finite(out, spec)
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(out.shape), "data": out.reshape(-1).tolist()}


def bytes_tensor(out: np.ndarray, name: str) -> dict:
    """The protocol's JSON BYTES tensor of ``out`` (an object array of UTF-8 bytes): its elements as strings."""
    return {"name": name, "datatype": "BYTES", "shape": list(out.shape),
            "data": [b.decode() for b in out.reshape(-1)]}
