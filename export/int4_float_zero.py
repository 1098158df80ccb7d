"""Float int4 zero points in an exported graph: integer zero points plus a per-group term.

ONNX Runtime's ``MatMulNBits`` and ``DequantizeLinear`` take integer zero points only
(``MatMulNBits`` accepts float ones, but leaves its fast kernel: docs/results.md, Compression, says
how much slower). A module with float zero points z is exported with z_int = round(z) in the integer
kernel and the rest added after it
(:func:`prunus.models.int4.split_float_zero`)::

    y = x @ ((q - z) * s).T = x @ ((q - z_int) * s).T + group_sums(x) @ term.T

``group_sums(x)`` (..., in // group) is a MatMul by a 0/1 matrix, and ``term`` ((z_int - z) * s,
(out, in // group)) is small: in / group rows of out floats. A small MatMul and an Add per layer, and
one group-sum MatMul per distinct input.
"""

from __future__ import annotations

import torch
from onnx import helper, numpy_helper

from prunus.models.int4 import split_float_zero


def integer_zero(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(integer zero points uint8 (out, n_groups), the per-group term or None) of an Int4Linear."""
    if not getattr(module, "float_zero", False):
        return module.weight_zero, None
    return split_float_zero(module.weight_zero, module.weight_scale)


def add_group_term(a: str, y: str, outputs: list[str], prefix: str, module, term: torch.Tensor) -> tuple[list, list]:
    """Nodes writing ``outputs`` = ``y`` + group_sums(``a``) @ ``term``.T; returns (nodes, initializers).

    The group sums of one input (q, k and v read the same tensor; gate and up too) are one node and the
    0/1 matrix one initializer per width and group size, named for them: callers keep the first of each
    name (:func:`unique_by_name`)."""
    k, g = module.in_features, module.group_size
    groups = torch.zeros(k, k // g)
    groups[torch.arange(k), torch.arange(k) // g] = 1.0
    sums = f"{a}/group_sums_{g}"
    inits = [numpy_helper.from_array(groups.numpy(), f"group_sum_matrix.{k}.{g}"),
             numpy_helper.from_array(term.float().t().contiguous().numpy(), f"{prefix}.zero_term")]
    nodes = [helper.make_node("MatMul", [a, inits[0].name], [sums], name=sums),
             helper.make_node("MatMul", [sums, inits[1].name], [f"{prefix}.zero_correction"],
                              name=f"{prefix}.zero_correction"),
             helper.make_node("Add", [y, f"{prefix}.zero_correction"], list(outputs), name=f"{prefix}.add_zero_term")]
    return nodes, inits


def unique_by_name(items: list) -> list:
    """The first of each initializer name, or of each node's outputs (nodes may be unnamed; two nodes writing
    the same tensor are the same group sum), in order."""
    seen, out = set(), []
    for item in items:
        key = tuple(item.output) if hasattr(item, "op_type") else item.name
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out
