"""Parity of an export against the PyTorch model it came from, on held-out text.

Three figures, each against a per-precision tolerance (:data:`TOLERANCES`):

* ``max_abs_logits``: max |logits_ort - logits_torch| over one batch of held-out tokens
  (and ``top1_agreement``, the share of those positions whose argmax agrees);
* bits per byte of both on the same held-out tokens (``prunus.data.evaluate``, the ONNX
  side through ``score=``), judged by ``bpb_increase`` = ort - torch;
* ``greedy_agreement``: share of identical tokens when both generate 64 greedy tokens
  from the same prompts, ONNX Runtime through the prefill + decode graphs with the KV
  cache, PyTorch through ``prunus.models.generate``.

fp32 must match tightly; int8 / fp8 graphs (ONNX Runtime's integer kernels quantize
activations their own way) are judged by the bits-per-byte increase and agreement.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from prunus.data.evaluate import evaluate
from prunus.models.generate import generate

# A limit of None is not checked; agreement limits are minimums, the others maximums.
TOLERANCES = {
    "fp32": {"max_abs_logits": 1e-3, "bpb_increase": 1e-4, "top1_agreement": 1.0, "greedy_agreement": 1.0},
    "fp16": {"max_abs_logits": None, "bpb_increase": 0.01, "top1_agreement": 0.97, "greedy_agreement": 0.75},
    "int8": {"max_abs_logits": None, "bpb_increase": 0.05, "top1_agreement": 0.9, "greedy_agreement": 0.5},
    "fp8": {"max_abs_logits": None, "bpb_increase": 0.05, "top1_agreement": 0.9, "greedy_agreement": 0.5},
}
MINIMUMS = ("top1_agreement", "greedy_agreement")


class ParityFailed(Exception):
    """The export does not match the PyTorch model within tolerance; ``report`` says where."""

    def __init__(self, report: dict):
        self.report = report
        bad = ", ".join(f"{k} {report[k]:.4g} (limit {report['tolerances'][k]})" for k in report["failed"])
        super().__init__(f"parity check failed: {bad}; nothing was written (pass --no-verify to keep the export anyway)")


def _nll_score(fn):
    def score(x: torch.Tensor, y: torch.Tensor) -> float:
        return F.cross_entropy(fn(x).float().flatten(0, 1), y.flatten(), reduction="sum").item()
    return score


def check_parity(model, graphs, val_tokens: np.ndarray, token_bytes: torch.Tensor, precision: str, *,
                 eval_tokens: int = 8192, new_tokens: int = 64, n_prompts: int = 4, prompt_len: int = 32) -> dict:
    """Compare ``graphs`` (an :class:`~prunus.export.ort_graphs.OrtGraphs`) with ``model``; a JSON-able report."""
    limit = model.config.max_seq_len
    seq_len = min(limit, 128, len(val_tokens) - 1)
    tol = TOLERANCES[precision]
    with torch.inference_mode():
        x = torch.from_numpy(np.asarray(val_tokens[: 4 * seq_len], dtype=np.int64)).reshape(4, seq_len)
        ref, got = model(x).float(), graphs(x)
        max_abs = (ref - got).abs().max().item()
        top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        torch_eval = evaluate(model, val_tokens, token_bytes, seq_len=seq_len, batch_size=4, max_tokens=eval_tokens)
        ort_eval = evaluate(None, val_tokens, token_bytes, seq_len=seq_len, batch_size=4, max_tokens=eval_tokens,
                            score=_nll_score(graphs))
        prompt_len = min(prompt_len, limit - new_tokens)
        starts = np.linspace(0, len(val_tokens) - prompt_len - 1, n_prompts).astype(np.int64)
        prompts = torch.stack([torch.from_numpy(np.asarray(val_tokens[s: s + prompt_len], dtype=np.int64)) for s in starts])
        want = generate(model, prompts, new_tokens)[:, prompt_len:]
        have = graphs.greedy(prompts, new_tokens)
    agree = (want == have).float().mean().item()
    report = {
        "precision": precision,
        "max_abs_logits": max_abs,
        "top1_agreement": top1,
        "bpb_torch": torch_eval["val_bpb"],
        "bpb_onnx": ort_eval["val_bpb"],
        "bpb_increase": ort_eval["val_bpb"] - torch_eval["val_bpb"],
        "greedy_agreement": agree,
        "greedy_tokens": int(want.numel()),
        "greedy_identical_rows": int((want == have).all(dim=1).sum()),
        "eval_tokens": torch_eval["val_tokens"],
        "seq_len": seq_len,
        "tolerances": tol,
    }
    failed = []
    for key, lim in tol.items():
        if lim is None:
            continue
        value = report[key]
        bad = value < lim if key in MINIMUMS else value > lim
        if bad or math.isnan(value):
            failed.append(key)
    report["failed"] = failed
    report["passed"] = not failed
    return report
