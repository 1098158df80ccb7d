"""The nodes of one decoder written directly with ``onnx.helper``, as onnxruntime-genai's model builder writes them.

ONNX Runtime's fused CPU kernels do the work of a Llama block in five to seven nodes:

* ``SimplifiedLayerNormalization`` (RMSNorm) before the first block, then one
  ``com.microsoft.SkipSimplifiedLayerNormalization`` per residual add: it adds the branch output to
  the residual stream (output 3, the new stream) and normalises the sum (output 0) in one pass;
* the q/k/v projections as one packed ``MatMul`` (or three, see :class:`GraphWriter`), then
  ``com.microsoft.GroupQueryAttention``: rotary embedding inside the op (``do_rotary=1`` with
  cos/sin tables as initializers), grouped-query heads, and a KV cache whose ``past_*`` and
  ``present_*`` are one preallocated (batch, kv_heads, max_len, head_dim) buffer that the op appends
  to in place (past_present_share_buffer): no Concat of the cache per step. Each row's length comes
  from ``seqlens_k`` (its total length after this pass, minus one), so the op never reads a row's
  buffer beyond its own keys;
  A sliding window (every layer, or the layers ``layer_types`` names) is the op's ``local_window_size``;
* SwiGLU as Sigmoid(gate) * gate * up and the down projection.

Weights are (in, out) float32 initializers of plain ``MatMul`` nodes, so ONNX Runtime's
``MatMulNBitsQuantizer`` and prunus's stored-weight rewriting (:mod:`prunus.export.quantize_onnx`)
both find them.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from prunus.runtime.genai_prompt_graph import LAST_TOKEN_NODE  # the name the runtime finds the head's input by

MS_DOMAIN = "com.microsoft"


def _array(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().float().cpu().numpy()
    return np.ascontiguousarray(t)


class GraphWriter:
    """Collects nodes and initializers under unique names. ``packed_qkv`` / ``packed_gate_up``: one MatMul
    for q, k and v (and one for gate and up, split after) instead of one per projection."""

    def __init__(self, cfg, packed_qkv: bool = True, packed_gate_up: bool = False):
        self.cfg = cfg
        self.packed_qkv, self.packed_gate_up = packed_qkv, packed_gate_up
        self.nodes: list = []
        self.inits: list = []
        self._count = 0

    def init(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(_array(value), name))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, name: str | None = None, domain: str = "",
             outputs: list[str] | None = None, **attrs) -> list[str]:
        self._count += 1
        name = name or f"{op}_{self._count}"
        outputs = outputs or [f"{name}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def linear(self, x: str, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> str:
        """x @ weight.T (+ bias): a MatMul on an (in, out) initializer."""
        w = self.init(f"{name}.weight", weight.detach().float().t())
        (y,) = self.node("MatMul", [x, w], name=f"{name}/MatMul")
        if bias is not None:
            b = self.init(f"{name}.bias", bias)
            (y,) = self.node("Add", [y, b], name=f"{name}/Add")
        return y

    # --- norms ------------------------------------------------------------------------------------

    def norm(self, x: str, weight: torch.Tensor, name: str) -> str:
        w = self.init(f"{name}.weight", weight)
        return self.node("SimplifiedLayerNormalization", [x, w], name=name, axis=-1,
                         epsilon=float(self.cfg.norm_eps), stash_type=1)[0]

    def skip_norm(self, branch: str, residual: str, weight: torch.Tensor, name: str) -> tuple[str, str]:
        """(normalised residual + branch, residual + branch)."""
        w = self.init(f"{name}.weight", weight)
        outs = [f"{name}/out0", "", "", f"{name}/out3"]
        self.node("SkipSimplifiedLayerNormalization", [branch, residual, w], name=name, domain=MS_DOMAIN,
                  outputs=outs, epsilon=float(self.cfg.norm_eps))
        return outs[0], outs[3]

    # --- attention --------------------------------------------------------------------------------

    def attention(self, x: str, attn, layer: int, cache: dict) -> str:
        """One block's attention; ``cache``: the names of seqlens_k, total_sequence_length, cos, sin."""
        cfg, p = self.cfg, f"layers.{layer}.attention"
        if self.packed_qkv:
            w = torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight], 0)
            b = None if attn.wq.bias is None else torch.cat([attn.wq.bias, attn.wk.bias, attn.wv.bias], 0)
            qkv = [self.linear(x, w, b, f"{p}.wqkv"), "", ""]
        else:
            qkv = [self.linear(x, m.weight, m.bias, f"{p}.{n}") for n, m in
                   (("wq", attn.wq), ("wk", attn.wk), ("wv", attn.wv))]
        attrs = {"num_heads": cfg.n_heads, "kv_num_heads": cfg.n_kv_heads, "do_rotary": 1, "rotary_interleaved": 0}
        if cfg.query_pre_attn_scalar is not None:
            attrs["scale"] = float(cfg.attn_scale)
        window = cfg.layer_window(attn.layer_id)
        if window is not None:  # local_window_size keys, the query's own included, as prunus counts its window
            attrs["local_window_size"] = int(window)
        inputs = [*qkv, f"past.{layer}.key", f"past.{layer}.value", cache["seqlens_k"], cache["total"],
                  cache["cos"], cache["sin"]]
        outputs = [f"{p}/gqa", f"present.{layer}.key", f"present.{layer}.value"]
        self.node("GroupQueryAttention", inputs, name=f"{p}/GroupQueryAttention", domain=MS_DOMAIN,
                  outputs=outputs, **attrs)
        return self.linear(outputs[0], attn.wo.weight, attn.wo.bias, f"{p}.wo")

    # --- feed-forward -----------------------------------------------------------------------------

    def feed_forward(self, x: str, ff, layer: int) -> str:
        """w2(silu(w1 x) * w3 x), SiLU as gate * Sigmoid(gate) (ONNX Runtime fuses it)."""
        p = f"layers.{layer}.feed_forward"
        if self.packed_gate_up:
            both = self.linear(x, torch.cat([ff.w1.weight, ff.w3.weight], 0), None, f"{p}.w13")
            gate, up = self.node("Split", [both], n_out=2, name=f"{p}/Split", axis=-1, num_outputs=2)
        else:
            gate = self.linear(x, ff.w1.weight, None, f"{p}.w1")
            up = self.linear(x, ff.w3.weight, None, f"{p}.w3")
        (sig,) = self.node("Sigmoid", [gate], name=f"{p}/Sigmoid")
        (act,) = self.node("Mul", [gate, sig], name=f"{p}/SiLU")
        (h,) = self.node("Mul", [act, up], name=f"{p}/Mul")
        return self.linear(h, ff.w2.weight, None, f"{p}.w2")

    # --- the last real token of each row ----------------------------------------------------------

    def last_token(self, y: str, input_ids: str, seqlens_k: str) -> str:
        """(batch, seq, dim) -> (batch, dim) at index min(seqlens_k, seq - 1) of each row: a prompt's last real
        token under right padding (its length minus one), the one new token of a decode step (index 0)."""
        one = self.init("const.one", np.array([1], dtype=np.int64))
        (shape,) = self.node("Shape", [input_ids], name="last/Shape", start=1, end=2)
        (last,) = self.node("Sub", [shape, one], name="last/Sub")
        (lens,) = self.node("Cast", [seqlens_k], name="last/Cast", to=TensorProto.INT64)
        (idx,) = self.node("Min", [lens, last], name="last/Min")
        (idx2,) = self.node("Unsqueeze", [idx, one], name="last/Unsqueeze")
        return self.node("GatherND", [y, idx2], name=LAST_TOKEN_NODE, batch_dims=1)[0]


