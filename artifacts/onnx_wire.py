"""An ONNX file's initializers and nodes found in place: the protobuf wire format walked over a memory map.

``onnx.load`` copies every weight out of the file into the message and again out of the message into Python bytes,
many times the cost of one pass over the numbers (docs/defaults.md). Checking a graph's initializers at load needs
only where each one's bytes lie, so this walks the few
messages it needs (ModelProto.graph, GraphProto's nodes, initializers and sparse initializers, NodeProto's op type,
inputs and subgraph attributes, TensorProto's name, dims, type and data) and skips every other field by its length.
A tensor's inline data is a view of the map, never copied. Every length is checked against its enclosing message;
anything the format does not allow is :class:`WireError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# field numbers of onnx.proto
MODEL_GRAPH = 7
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_SPARSE = 1, 5, 15
NODE_INPUT, NODE_OP_TYPE, NODE_ATTRIBUTE = 1, 4, 5
ATTRIBUTE_GRAPH, ATTRIBUTE_GRAPHS = 6, 11
TENSOR_DIMS, TENSOR_TYPE, TENSOR_NAME, TENSOR_RAW, TENSOR_EXTERNAL, TENSOR_LOCATION = 1, 2, 8, 9, 13, 14
SPARSE_VALUES = 1
LEN, VARINT = 2, 0


class WireError(ValueError):
    """The bytes are not the protobuf encoding of an ONNX model."""


@dataclass
class Tensor:
    """One initializer: ``span`` the whole TensorProto message, ``raw`` its raw_data's byte range (None: absent),
    ``external`` its external_data entries (key -> value), ``location`` 1 when its data is external."""

    span: tuple[int, int]
    name: str = ""
    dims: list[int] = field(default_factory=list)
    data_type: int = 0
    raw: tuple[int, int] | None = None
    external: dict[str, str] = field(default_factory=dict)
    location: int = 0


@dataclass
class Graph:
    nodes: list[tuple[str, list[str]]] = field(default_factory=list)  # (op type, inputs)
    tensors: list[Tensor] = field(default_factory=list)


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise WireError(f"a varint runs past its message at byte {i}")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def fields(buf, start: int, end: int):
    """(field number, wire type, value) of the message in ``buf[start:end]``: an int for a varint, a (start, end)
    byte range for a length-delimited field; fixed-width fields are skipped."""
    i = start
    while i < end:
        key, i = _varint(buf, i, end)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, i = _varint(buf, i, end)
            yield number, wire, value
        elif wire == LEN:
            n, i = _varint(buf, i, end)
            if i + n > end:
                raise WireError(f"field {number} at byte {i} claims {n} bytes past its message's end")
            yield number, wire, (i, i + n)
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
            if i > end:
                raise WireError(f"a fixed-width field {number} runs past its message's end")
        else:
            raise WireError(f"field {number} has wire type {wire}, which ONNX does not use")


def _text(buf, span: tuple[int, int]) -> str:
    return bytes(buf[span[0]:span[1]]).decode("utf-8", "replace")


def _tensor(buf, span: tuple[int, int]) -> Tensor:
    t = Tensor(span)
    for number, wire, value in fields(buf, *span):
        if number == TENSOR_DIMS and wire == VARINT:
            t.dims.append(value)
        elif number == TENSOR_DIMS and wire == LEN:  # packed by some writers
            i, end = value
            while i < end:
                dim, i = _varint(buf, i, end)
                t.dims.append(dim)
        elif number == TENSOR_TYPE and wire == VARINT:
            t.data_type = value
        elif number == TENSOR_NAME and wire == LEN:
            t.name = _text(buf, value)
        elif number == TENSOR_RAW and wire == LEN:
            t.raw = value
        elif number == TENSOR_LOCATION and wire == VARINT:
            t.location = value
        elif number == TENSOR_EXTERNAL and wire == LEN:
            entry = {k: _text(buf, v) for k, w, v in fields(buf, *value) if w == LEN and k in (1, 2)}
            t.external[entry.get(1, "")] = entry.get(2, "")
    return t


def _node(buf, span: tuple[int, int], subgraphs: list) -> tuple[str, list[str]]:
    op, inputs = "", []
    for number, wire, value in fields(buf, *span):
        if wire != LEN:
            continue
        if number == NODE_INPUT:
            inputs.append(_text(buf, value))
        elif number == NODE_OP_TYPE:
            op = _text(buf, value)
        elif number == NODE_ATTRIBUTE:
            subgraphs += [v for n, w, v in fields(buf, *value) if w == LEN and n in (ATTRIBUTE_GRAPH, ATTRIBUTE_GRAPHS)]
    return op, inputs


def graphs(buf):
    """Each graph of the model in ``buf`` (a buffer of bytes: the main graph, then the subgraphs of its nodes'
    attributes, If / Loop / Scan bodies), without recursion."""
    stack = [v for n, w, v in fields(buf, 0, len(buf)) if n == MODEL_GRAPH and w == LEN]
    while stack:
        g, span = Graph(), stack.pop()
        for number, wire, value in fields(buf, *span):
            if wire != LEN:
                continue
            if number == GRAPH_NODE:
                g.nodes.append(_node(buf, value, stack))
            elif number == GRAPH_INITIALIZER:
                g.tensors.append(_tensor(buf, value))
            elif number == GRAPH_SPARSE:
                g.tensors += [_tensor(buf, v) for n, w, v in fields(buf, *value) if n == SPARSE_VALUES and w == LEN]
        yield g
