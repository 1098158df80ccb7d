"""The prefill and decode graphs through ``torch.onnx.export`` (the dynamo exporter).

The TorchScript exporter (``dynamo=False``) is not an option for this model: it has no
symbolic for ``aten::rms_norm`` ("Exporting the operator 'aten::rms_norm' to ONNX opset
version 17 is not supported"), and tracing would freeze the mask's shapes. The dynamo
exporter takes ``torch.export`` dynamic shapes: batch, seq / new and past (>= 1) are
symbolic, so one graph serves every batch size and length.

A model holding stored quantized modules (``QuantizedLinear``, ``Int4Linear``) is exported with
their dequantized weights in plain ``nn.Linear`` modules; :mod:`prunus.export.quantize_onnx` then
puts the stored int8 / float8 / int4 values and scales back into the graph.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn
from torch.export import Dim

from prunus.models.quant_registry import QuantizedModule, quantized_modules

from .graphs import DecodeGraph, PrefillGraph, exportable, graph_names
from .quiet_logs import quiet_loggers

# For ONNX Runtime, opset 23: RMSNormalization-23 and Attention-23 as single nodes (a faster decode step, measured
# in docs/defaults.md); TensorRT's ONNX parser gets opset 18, the exporter's oldest well-trodden one.
DEFAULT_OPSET = {"onnx": 23, "tensorrt": 18}
MIN_OPSET = 18


def dequantized_copy(model: nn.Module, modules: dict[str, QuantizedModule] | None = None) -> nn.Module:
    """``model`` with each stored quantized module (those in it, or ``modules`` by name) as an nn.Linear of its
    dequantized weight; ``model`` itself when there is none."""
    if modules is None:
        modules = quantized_modules(model)
    if not modules:
        return model
    plain = copy.deepcopy(model)
    for name, q in modules.items():
        lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        lin.weight = nn.Parameter(q.dequantize(), requires_grad=False)
        if q.bias is not None:
            lin.bias = nn.Parameter(q.bias.clone(), requires_grad=False)
        plain.set_submodule(name, lin)
    return plain


def _example(model: nn.Module, decode: bool):
    cfg = model.config
    dtype = next(model.parameters()).dtype
    b, s, past = 2, 3, 4
    ids = torch.zeros(b, s, dtype=torch.long)
    total = past + s if decode else s
    pos = torch.arange(total - s, total).expand(b, s).contiguous()
    mask = torch.ones(b, total, dtype=torch.long)
    if not decode:
        return ids, pos, mask
    kv = tuple(torch.zeros(b, cfg.n_kv_heads, past, cfg.head_dim, dtype=dtype) for _ in range(2 * len(model.layers)))
    return ids, pos, mask, kv


def _export(module: nn.Module, args, input_names, output_names, dynamic_shapes, opset: int) -> onnx.ModelProto:
    # the exporter and its passes log progress lines and warnings we do not act on
    with quiet_loggers(), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, None, input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes, dynamo=True, opset_version=opset,
                                    external_data=False, verbose=False)
    proto = program.model_proto
    for node in proto.graph.node:  # the exporter's per-node stack traces: debug text, often larger than the weights
        del node.metadata_props[:]
        node.doc_string = ""
    return proto


def export_prefill(model: nn.Module, opset: int = DEFAULT_OPSET["onnx"]) -> onnx.ModelProto:
    names = graph_names(len(model.layers))
    batch, seq = Dim("batch"), Dim("seq")
    shapes = ({0: batch, 1: seq},) * 3
    return _export(PrefillGraph(exportable(model)).eval(), _example(model, False), names["prefill_inputs"], names["outputs"],
                   shapes, opset)


def export_decode(model: nn.Module, opset: int = DEFAULT_OPSET["onnx"]) -> onnx.ModelProto:
    names = graph_names(len(model.layers))
    batch, new, past, total = Dim("batch"), Dim("new"), Dim("past", min=1), Dim("total")
    kv = tuple({0: batch, 2: past} for _ in range(2 * len(model.layers)))
    shapes = ({0: batch, 1: new}, {0: batch, 1: new}, {0: batch, 1: total}, kv)
    ids, pos, mask, past_kv = _example(model, True)
    return _export(DecodeGraph(exportable(model)).eval(), (ids, pos, mask, *past_kv), names["decode_inputs"], names["outputs"],
                   (*shapes[:3], kv), opset)


def save_graph(model: onnx.ModelProto, path: Path, external_data: bool) -> list[Path]:
    """Write the graph (and its external data file when asked); check it by path. Returns the files written."""
    path = Path(path)
    if external_data:
        data = path.name + ".data"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
        files = [path, path.with_name(data)]
    else:
        onnx.save_model(model, str(path))
        files = [path]
    onnx.checker.check_model(str(path))  # by path: works past protobuf's 2 GB limit
    return files
