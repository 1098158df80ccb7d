"""Graph-level quantization of an exported ONNX graph.

Two sources of quantized weights:

* a compressed model dir (``QuantizedLinear`` modules): every MatMul whose weight is a
  module's dequantized weight gets that module's own int8 / float8 values and scales
  back, unchanged (:func:`apply_stored_quantization`). int8 becomes either ONNX Runtime's
  fused integer operator ``com.microsoft.DynamicQuantizeMatMul`` (``style="integer"``)
  or a QDQ graph, ``DequantizeLinear`` on the int8 weight with per-axis or per-block
  scales (``style="qdq"``, the form TensorRT consumes). float8 is always QDQ with
  FLOAT8E4M3FN weights. Activation quantization of w8a8 schemes is written out in the
  graph as the PyTorch module computes it (per-token absmax, or the calibrated scale).
* int4 modules (``Int4Linear``) become ONNX Runtime's ``com.microsoft.MatMulNBits``
  (``int4_style="matmulnbits"``: bits 4, block = the group size, accuracy level 4) holding the module's
  own packed bytes, scales and zero points (:func:`_matmul_nbits`), or, for TensorRT
  (``int4_style="qdq"``), a blocked INT4 ``DequantizeLinear`` feeding a ``MatMul``
  (:mod:`prunus.export.int4_qdq`): the same integers either way, no re-quantization. The int8-weight-only
  modules of such a model (a quantized output head, mixed-precision blocks) become ``MatMulNBits`` with bits 8
  on their own int8 values (:func:`_matmul_nbits8`), ONNX Runtime's weight-only kernel for them.
* an fp32 graph (``--precision int8`` / ``int4``): ONNX Runtime's ``MatMulNBitsQuantizer`` (8-bit
  or 4-bit symmetric weights in blocks of 32, ``MatMulNBits`` nodes), after :func:`untie_weights`
  gives a tied output head its own initializer (a weight reached through a Transpose of
  the embedding is not a MatMul initializer).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from prunus.artifacts.errors import PrunusError
from prunus.runtime.genai_prompt_graph import prune_unused

from .int4_float_zero import add_group_term, integer_zero, unique_by_name
from .int4_qdq import int4_qdq_nodes
from .quiet_logs import matmul_nbits_quantizer, quiet_loggers

MS_DOMAIN = "com.microsoft"
INT8_STYLES = ("integer", "qdq", "matmulnbits")  # matmulnbits: int8-weight-only modules as MatMulNBits bits 8, else qdq
INT4_STYLES = ("matmulnbits", "qdq")
ORT_BLOCK = 32  # the block of ONNX Runtime's MatMulNBits quantization of a float graph (--precision int8 / int4)


def _tensor(name: str, t: torch.Tensor) -> TensorProto:
    """A TensorProto holding ``t`` bit for bit (int8, float8_e4m3fn, float32, int64)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.float8_e4m3fn:
        proto = TensorProto()
        proto.name, proto.data_type = name, TensorProto.FLOAT8E4M3FN
        proto.dims.extend(t.shape)
        proto.raw_data = t.view(torch.uint8).numpy().tobytes()
        return proto
    return numpy_helper.from_array(t.numpy(), name)


def _weight_key(w: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(w, dtype=np.float32).tobytes()).hexdigest() + str(w.shape)


def untie_weights(model: onnx.ModelProto) -> int:
    """Give every MatMul weight reached as Transpose(initializer) its own transposed initializer.

    Returns how many were untied (a tied output head is one)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    count = 0
    for node in list(g.node):
        if node.op_type != "MatMul":
            continue
        tr = producers.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        w = numpy_helper.to_array(inits[tr.input[0]])
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), None)
        name = f"{tr.input[0]}.untied_t{count}"
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.transpose(perm)), name))
        node.input[1] = name
        count += 1
    prune_unused(g)
    return count


def _activation_nodes(a: str, prefix: str, module) -> tuple[list, list, str]:
    """Nodes that quantize-dequantize activation ``a`` as the module does; returns (nodes, initializers, output)."""
    scheme = module.scheme
    if scheme in ("int8-weight-only", "fp8-weight-only"):
        return [], [], a
    out = f"{prefix}.input_qdq"
    if scheme == "w8a8-static":
        scale = module.input_scale.reshape(()).float()
        inits = [_tensor(f"{prefix}.input_scale", scale),
                 _tensor(f"{prefix}.input_zero_point", torch.zeros((), dtype=torch.int8))]
        nodes = [
            helper.make_node("QuantizeLinear", [a, inits[0].name, inits[1].name], [f"{prefix}.input_q"]),
            helper.make_node("DequantizeLinear", [f"{prefix}.input_q", inits[0].name, inits[1].name], [out]),
        ]
        return nodes, inits, out
    # dynamic: one absmax scale per token, as QuantizedLinear computes it
    fp8 = scheme.startswith("fp8")
    qmax = 448.0 if fp8 else 127.0
    c = lambda n, v: _tensor(f"{prefix}.{n}", torch.tensor(v, dtype=torch.float32))  # noqa: E731
    inits = [c("qmax", qmax), c("neg_qmax", -qmax), c("eps", 1e-12), _tensor(f"{prefix}.last_axis", torch.tensor([-1]))]
    p = prefix
    nodes = [
        helper.make_node("Abs", [a], [f"{p}.abs"]),
        helper.make_node("ReduceMax", [f"{p}.abs", f"{p}.last_axis"], [f"{p}.amax"], keepdims=1),
        helper.make_node("Max", [f"{p}.amax", f"{p}.eps"], [f"{p}.amax_eps"]),
        helper.make_node("Div", [f"{p}.amax_eps", f"{p}.qmax"], [f"{p}.act_scale"]),
        helper.make_node("Div", [a, f"{p}.act_scale"], [f"{p}.scaled"]),
    ]
    if fp8:
        nodes += [
            helper.make_node("Clip", [f"{p}.scaled", f"{p}.neg_qmax", f"{p}.qmax"], [f"{p}.clipped"]),
            helper.make_node("Cast", [f"{p}.clipped"], [f"{p}.f8"], to=TensorProto.FLOAT8E4M3FN),
            helper.make_node("Cast", [f"{p}.f8"], [f"{p}.q"], to=TensorProto.FLOAT),
        ]
    else:
        nodes += [
            helper.make_node("Round", [f"{p}.scaled"], [f"{p}.rounded"]),
            helper.make_node("Clip", [f"{p}.rounded", f"{p}.neg_qmax", f"{p}.qmax"], [f"{p}.q"]),
        ]
    nodes.append(helper.make_node("Mul", [f"{p}.q", f"{p}.act_scale"], [out]))
    return nodes, inits, out


def _weight_dq(prefix: str, module) -> tuple[list, list, str]:
    """DequantizeLinear of the module's stored weight, transposed to MatMul's (in, out) layout."""
    wq = module.weight.t().contiguous()  # (in, out): the same values, laid out for MatMul
    scale = module.weight_scale.float()
    attrs = {}
    if module.granularity == "per_channel":
        s, attrs = scale.reshape(-1), {"axis": 1}
    elif module.granularity == "per_group":
        s, attrs = scale.t().contiguous(), {"axis": 0, "block_size": int(module.group_size)}
    else:
        s = scale.reshape(())
    inits = [_tensor(f"{prefix}.weight_q", wq), _tensor(f"{prefix}.weight_scale", s)]
    node = helper.make_node("DequantizeLinear", [inits[0].name, inits[1].name], [f"{prefix}.weight_dq"], **attrs)
    return [node], inits, node.output[0]


def _matmul_nbits(a: str, outputs: list[str], prefix: str, module) -> tuple[list, list]:
    """``MatMulNBits`` of activation ``a`` with an Int4Linear's stored weight: B is its packed bytes viewed as
    (out, n_blocks, group_size / 2) (prunus packs as MatMulNBits does: low nibble first, groups along the input
    features), scales (out * n_blocks,), and for asymmetric modules the zero points packed two per byte.
    ONNX Runtime dequantizes (q - zero_point) * scale with a default zero point of 8, which is prunus's
    symmetric grid, so a symmetric module writes none. Float zero points: see :mod:`.int4_float_zero`."""
    from prunus.models.int4 import pack_zero_points

    n, k, g = module.out_features, module.in_features, module.group_size
    zero, term = integer_zero(module)
    inits = [_tensor(f"{prefix}.weight_q4", module.weight.reshape(n, k // g, g // 2)),
             _tensor(f"{prefix}.weight_scale", module.weight_scale.float().reshape(-1))]
    if not module.symmetric:
        inits.append(_tensor(f"{prefix}.weight_zero_point", pack_zero_points(zero)))
    y = outputs if term is None else [f"{prefix}.matmul_int_zero"]
    node = helper.make_node("MatMulNBits", [a, *(i.name for i in inits)], y, domain=MS_DOMAIN,
                            name=f"{prefix}.matmul", K=k, N=n, bits=4, block_size=g, accuracy_level=4)
    if term is None:
        return [node], inits
    nodes, more = add_group_term(a, y[0], outputs, prefix, module, term)
    return [node, *nodes], inits + more


def nbits8_block(module) -> int | None:
    """The MatMulNBits block size that holds an int8-weight-only module's scales exactly, or None when none does.

    Per channel: the largest power of two from 16 to 256 dividing in_features (every block of a row repeats
    the row's scale); per group: the group size itself when it is such a power of two."""
    if module.scheme != "int8-weight-only":
        return None
    k = module.in_features
    if module.granularity == "per_channel":
        return next((b for b in (256, 128, 64, 32, 16) if k % b == 0), None)
    if module.granularity == "per_group" and module.group_size in (16, 32, 64, 128, 256):
        return int(module.group_size)
    return None


def _matmul_nbits8(a: str, outputs: list[str], prefix: str, module) -> tuple[list, list]:
    """``MatMulNBits`` (bits 8, accuracy level 4) of activation ``a`` with an int8-weight-only module's stored
    weight: the int8 values q in [-127, 127] stored as q + 128 (MatMulNBits's default 8-bit zero point is 128,
    so no zero points are written), B viewed as (out, n_blocks, block), and the module's scales repeated over
    the blocks of a row (per channel) or as they are (per group). The integers are the stored ones: ONNX
    Runtime computes (q + 128 - 128) * scale, what the module computes. Used for the int8 layers of an int4
    model (a quantized output head, mixed-precision blocks): as DequantizeLinear -> MatMul they ran in float."""
    n, k, block = module.out_features, module.in_features, nbits8_block(module)
    q = (module.weight.to(torch.int16) + 128).to(torch.uint8).reshape(n, k // block, block)
    scale = module.weight_scale.float()
    scale = scale.expand(n, k // block) if scale.shape[1] == 1 else scale
    inits = [_tensor(f"{prefix}.weight_q8", q), _tensor(f"{prefix}.weight_scale", scale.reshape(-1).contiguous())]
    node = helper.make_node("MatMulNBits", [a, *(i.name for i in inits)], outputs, domain=MS_DOMAIN,
                            name=f"{prefix}.matmul", K=k, N=n, bits=8, block_size=block, accuracy_level=4)
    return [node], inits


def required_opset(modules: dict) -> int:
    """The lowest opset the stored quantization needs: 21 for per-block scales, 19 for float8."""
    if any(m.granularity == "per_group" for m in modules.values()):
        return 21
    if any(m.scheme.startswith("fp8") for m in modules.values()):
        return 19
    return 18


def nbits8_applies(modules: dict, style: str, int4_style: str) -> bool:
    """Whether int8-weight-only modules become ``MatMulNBits`` bits 8: asked (``style`` "matmulnbits"), or the int8
    layers of an int4 model (its output head, int8 blocks) under int4 ``MatMulNBits``: ONNX Runtime's weight-only
    kernels; elsewhere int8 keeps ``style``."""
    return style == "matmulnbits" or (
        int4_style == "matmulnbits" and any(m.scheme == "int4-weight-only" for m in modules.values()))


def stored_form(module, style: str, int4_style: str, nbits8: bool) -> str:
    """How :func:`apply_stored_quantization` writes one stored module: "nbits4" (int4 ``MatMulNBits``), "qdq4"
    (blocked INT4 ``DequantizeLinear``), "nbits8" (``MatMulNBits`` bits 8), "integer" (``DynamicQuantizeMatMul``)
    or "qdq" (``DequantizeLinear``, with the activation's quantization where the scheme has one)."""
    if module.scheme == "int4-weight-only":
        return "qdq4" if int4_style == "qdq" else "nbits4"
    if nbits8 and nbits8_block(module) is not None:
        return "nbits8"
    if style == "integer" and not module.scheme.startswith("fp8") and module.granularity != "per_group" \
            and module.scheme != "w8a8-static":
        return "integer"
    return "qdq"


def _stored_matmul(node, prefix: str, m, form: str) -> tuple[list, list]:
    """The nodes and initializers that replace the float MatMul ``node`` by module ``m``'s stored values in ``form``
    (:func:`stored_form`)."""
    if form in ("nbits4", "qdq4", "nbits8"):
        write = {"nbits4": _matmul_nbits, "qdq4": int4_qdq_nodes, "nbits8": _matmul_nbits8}[form]
        return write(node.input[0], list(node.output), prefix, m)
    if form == "integer":
        s = m.weight_scale.float().reshape(-1)
        ins = [_tensor(f"{prefix}.weight_q", m.weight.t().contiguous()), _tensor(f"{prefix}.weight_scale", s),
               _tensor(f"{prefix}.weight_zero_point", torch.zeros(s.shape, dtype=torch.int8))]
        return [helper.make_node("DynamicQuantizeMatMul", [node.input[0], *(i.name for i in ins)], list(node.output),
                                 domain=MS_DOMAIN, name=f"{prefix}.matmul")], ins
    a_nodes, a_inits, a = _activation_nodes(node.input[0], prefix, m)
    w_nodes, w_inits, wf = _weight_dq(prefix, m)
    return (a_nodes + w_nodes + [helper.make_node("MatMul", [a, wf], list(node.output), name=f"{prefix}.matmul")],
            a_inits + w_inits)


def apply_stored_quantization(model: onnx.ModelProto, modules: dict, style: str = "integer",
                              int4_style: str = "matmulnbits") -> int:
    """Replace the float weights of ``modules`` (name -> QuantizedLinear) by their stored values and scales.

    ``style`` is the int8 form (:data:`INT8_STYLES`), ``int4_style`` the int4 one (:data:`INT4_STYLES`).

    MatMul weights are matched to modules by value (the exporter renames folded initializers).
    Returns the number of MatMuls rewritten; every module must be found."""
    if style not in INT8_STYLES:
        raise PrunusError(f"int8 style {style!r}: choose one of {', '.join(INT8_STYLES)}")
    if int4_style not in INT4_STYLES:
        raise PrunusError(f"int4 style {int4_style!r}: choose one of {', '.join(INT4_STYLES)}")
    untie_weights(model)
    g = model.graph
    nbits8 = nbits8_applies(modules, style, int4_style)
    by_key: dict[str, list[str]] = {}
    for name, m in modules.items():
        by_key.setdefault(_weight_key(m.dequantize().t().numpy()), []).append(name)
    inits = {i.name: i for i in g.initializer}
    found = set()
    new_nodes, new_inits = [], []
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        names = by_key.get(_weight_key(numpy_helper.to_array(w))) if w is not None and len(w.dims) == 2 else None
        if not names:
            new_nodes.append(node)
            continue
        name = names.pop(0) if len(names) > 1 else names[0]
        found.add(name)
        m, prefix = modules[name], name
        nodes, more = _stored_matmul(node, prefix, m, stored_form(m, style, int4_style, nbits8))
        new_nodes += nodes
        new_inits += more
    missing = sorted(set(modules) - found)
    if missing:
        raise PrunusError(f"export: quantized module(s) {', '.join(missing[:3])} not found in the exported graph; "
                          "re-create the compressed model dir")
    del g.node[:]
    g.node.extend(unique_by_name(new_nodes))  # float zero points: one group-sum node per input (int4_float_zero)
    g.initializer.extend(unique_by_name(new_inits))
    prune_unused(g)
    if any(n.domain == MS_DOMAIN for n in g.node):
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(found)


def quantize_fp32_graph(src: Path, dst: Path, external_data: bool = False, bits: int = 8) -> None:
    """Weight-only int8 (``bits`` 8) or int4 (``bits`` 4) quantization of an fp32 graph with ONNX Runtime's
    ``MatMulNBitsQuantizer`` (its default RTN): symmetric weights in blocks of 32 along the input features, as
    ``MatMulNBits`` nodes
    (accuracy level 4: activations quantized to int8 per block inside the kernel, the fast CPU path). A tied
    output head is untied first so it is quantized too. Not ``quantize_dynamic``: its ``DynamicQuantizeMatMul``
    quantizes activations per tensor and, without VNNI, saturates its int16 pair sums (docs/defaults.md has
    both measurements)."""
    model = onnx.load(str(src))
    untie_weights(model)
    with quiet_loggers():  # the quantizer logs every node it rewrites
        quantizer = matmul_nbits_quantizer()(model, bits=bits, block_size=ORT_BLOCK, is_symmetric=True,
                                             accuracy_level=4, op_types_to_quantize=("MatMul",))
        quantizer.process()
    _save(quantizer.model.model, dst, external_data)


def ort_block_codes(weight: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The codes and scales :func:`quantize_fp32_graph` writes for one (in, out) float32 MatMul weight, from the
    function ONNX Runtime's quantizer itself calls on it (so the same bytes): (out, blocks, block * bits / 8) uint8
    codes (zero point 128 or 8) and (out, blocks) float32 scales."""
    matmul_nbits_quantizer()  # imports the quantizer's module without its logging setup
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    config = DefaultWeightOnlyQuantConfig(block_size=ORT_BLOCK, is_symmetric=True, accuracy_level=4, bits=bits)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(weight, np.float32))
    return packed, scales


def _save(model: onnx.ModelProto, path: Path, external_data: bool) -> None:
    if external_data:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
