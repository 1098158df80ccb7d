"""A prompt-pass twin of a quantized genai graph: the same stored weights, float activations in the matmuls.

A genai graph's ``MatMulNBits`` nodes run at accuracy level 4: each pass quantizes its activations to
int8 and multiplies in integers. That is the fast kernel for a decode step (a row or a few), and the
slow one for a long prompt on a CPU without VNNI, where at hundreds of rows an int8 layer at level 4 is
slower than the fp32 ``MatMul``, and the same layer dequantized block by block then multiplied in float,
or an int4 one at level 0 (dequantized tile by tile into an fp32 GEMM), is faster; at one row the order
flips.

So a session holding a quantized genai graph also holds this twin for long prompt passes:

* int4 ``MatMulNBits``: the same node at accuracy level 0;
* int8 ``MatMulNBits``: its bytes viewed as (out, in), dequantized per block (``DequantizeLinear``,
  zero point 128 as MatMulNBits's default), transposed into a ``MatMul``;
* the output head (the node reading the last-token gather) is left as it is: it sees one row per prompt.

The weights and integers are the stored ones; only the activations' path changes (float instead of
int8), so the twin's logits are the PyTorch model's up to float rounding, which is closer than the
decode graph's. A short pass is slower in the twin and a long one faster, the crossing lower for int4
than for int8: hence :data:`MIN_TOKENS`, below which a pass (rows x padded width) stays in the graph
itself. What the twin does to the first token of a 512-token prompt is in docs/results.md (Serving).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from prunus.artifacts.errors import PrunusError

# the node that gathers each row's last position before the head (written by prunus.export.genai_layers)
LAST_TOKEN_NODE = "last/GatherND"

# a prompt pass of at least this many tokens goes to the twin (see above), by the widest weight the twin rewrites
MIN_TOKENS = {4: 64, 8: 256}


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _dequantized_matmul(node, attrs: dict, inits: dict) -> tuple[list, list] | None:
    """DequantizeLinear -> Transpose -> MatMul nodes computing an 8-bit MatMulNBits node in float; None when its
    inputs are not (A, B, scales[, uint8 zero points])."""
    if not 3 <= len(node.input) <= 4 or attrs.get("bits") != 8:
        return None
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    if k % block:
        return None
    p = node.name or node.output[0]
    new = [numpy_helper.from_array(np.array([n, k], np.int64), f"{p}.prompt.shape"),
           numpy_helper.from_array(np.array([n, k // block], np.int64), f"{p}.prompt.scale_shape")]
    if len(node.input) == 4 and node.input[3]:
        zero = inits.get(node.input[3])
        if zero is None or zero.data_type != onnx.TensorProto.UINT8:
            return None
        zp = f"{p}.prompt.zero"
        nodes = [helper.make_node("Reshape", [node.input[3], new[1].name], [zp])]
    else:
        new.append(numpy_helper.from_array(np.full((n, k // block), 128, np.uint8), f"{p}.prompt.zero"))
        zp, nodes = new[-1].name, []
    nodes += [helper.make_node("Reshape", [node.input[1], new[0].name], [f"{p}.prompt.q"]),
              helper.make_node("Reshape", [node.input[2], new[1].name], [f"{p}.prompt.scale"]),
              helper.make_node("DequantizeLinear", [f"{p}.prompt.q", f"{p}.prompt.scale", zp], [f"{p}.prompt.w_t"],
                               axis=1, block_size=block),
              helper.make_node("Transpose", [f"{p}.prompt.w_t"], [f"{p}.prompt.w"], perm=[1, 0]),
              helper.make_node("MatMul", [node.input[0], f"{p}.prompt.w"], list(node.output), name=f"{p}.prompt")]
    return nodes, new


def prompt_graph(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int] | None:
    """The twin of a genai graph (initializers may stay external: only nodes and small constants are added) and
    the fewest tokens a pass must have to go to it; None when no node would change (an fp32 graph)."""
    head_input = next((n.output[0] for n in model.graph.node if n.name == LAST_TOKEN_NODE), None)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    nodes, bits = [], set()
    for node in g.node:
        attrs = _attrs(node) if node.op_type == "MatMulNBits" else {}
        if not attrs or node.input[0] == head_input:
            nodes.append(node)
        elif attrs.get("bits") == 4:
            for a in node.attribute:
                if a.name == "accuracy_level" and a.i != 0:
                    a.i = 0
                    bits.add(4)
            nodes.append(node)
        elif (rewritten := _dequantized_matmul(node, attrs, inits)) is not None:
            nodes += rewritten[0]
            g.initializer.extend(rewritten[1])
            bits.add(8)
        else:
            nodes.append(node)
    if not bits:
        return None
    del g.node[:]
    g.node.extend(nodes)
    return out, max(MIN_TOKENS[b] for b in bits)


def prune_unused(g: onnx.GraphProto) -> None:
    """Drop nodes and initializers whose outputs nothing reads (a Transpose left behind)."""
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {i for n in g.node for i in n.input}
    for init in [i for i in g.initializer if i.name not in used]:
        g.initializer.remove(init)


def all_positions_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a genai graph (any precision) whose ``logits`` are every position's (batch, seq, vocab): the
    last-token gather bypassed, the rest untouched. Drafts are verified, and parity scores whole windows, with it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    gather = next((n for n in g.node if n.name == LAST_TOKEN_NODE), None)
    if gather is None:
        raise PrunusError("this graph has no last-token gather; it is not a prunus genai graph")
    for n in g.node:
        for j, name in enumerate(n.input):
            if name == gather.output[0]:
                n.input[j] = gather.input[0]
    prune_unused(g)
    logits = next(o for o in g.output if o.name == "logits")
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    logits.CopyFrom(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]))
    return out
