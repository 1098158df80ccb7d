"""Parity of an export against the PyTorch model it came from, on held-out text.

Three figures, each against a per-precision tolerance (:data:`TOLERANCES`):

* ``max_abs_logits``: max |logits_ort - logits_torch| over a probe of 4 x 128 held-out
  tokens (and ``top1_agreement``, the share of those positions whose argmax agrees);
* bits per byte of both on the same held-out slice that ``prunus eval`` and the compression
  report score by default (``prunus.data.evaluate``: ``DEFAULT_EVAL_TOKENS`` tokens in windows
  of ``default_seq_len``; the ONNX side through ``score=``, a few rows at a time so its whole
  -window logits stay bounded), judged by ``bpb_increase`` = ort - torch;
* ``greedy_agreement``: share of identical tokens when both generate 64 greedy tokens
  from the same prompts, ONNX Runtime through its decode path with the KV cache, PyTorch
  through ``prunus.models.generate``;
* ``decode_agreement``: the same decode path teacher-forced along PyTorch's greedy tokens:
  the share of steps whose argmax is PyTorch's token.

fp32 must match tightly, greedy tokens included. Quantized graphs (ONNX Runtime's integer
kernels quantize activations their own way) are judged by the bits-per-byte increase and the
two per-step agreements; their free-running greedy agreement is reported, not judged: after
the first near-tie the two continuations differ, so on a few prompts it measures where that
tie falls more than how close the export is (SmolLM2-135M's 8-bit export: 0.45 on 4 prompts,
0.49 on 16, with top-1 0.965 and the same graph's torch-exported twin 0.59 / 0.61).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from prunus.data.evaluate import CALLABLE_LOGITS_BYTES, DEFAULT_EVAL_TOKENS, default_seq_len, evaluate
from prunus.models.generate import generate

# A limit of None is not checked; agreement limits are minimums, the others maximums.
TOLERANCES = {
    "fp32": {"max_abs_logits": 1e-3, "bpb_increase": 1e-4, "top1_agreement": 1.0, "greedy_agreement": 1.0,
             "decode_agreement": 1.0},
    "fp16": {"max_abs_logits": None, "bpb_increase": 0.01, "top1_agreement": 0.97, "greedy_agreement": None,
             "decode_agreement": 0.97},
    "int8": {"max_abs_logits": None, "bpb_increase": 0.05, "top1_agreement": 0.9, "greedy_agreement": None,
             "decode_agreement": 0.9},
    "fp8": {"max_abs_logits": None, "bpb_increase": 0.05, "top1_agreement": 0.9, "greedy_agreement": None,
            "decode_agreement": 0.9},
    # stored int4 weights are exported as they are (only MatMulNBits's int8 activations differ); --precision int4
    # of a float model is compared with that float model, so its limit holds the int4 rounding error too
    "int4": {"max_abs_logits": None, "bpb_increase": 0.10, "top1_agreement": 0.85, "greedy_agreement": None,
             "decode_agreement": 0.85},
}
MINIMUMS = ("top1_agreement", "greedy_agreement", "decode_agreement")
PROBE_ROWS, PROBE_LEN = 4, 128  # the logits compared position by position


class ParityFailed(Exception):
    """The export does not match the PyTorch model within tolerance; ``report`` says where."""

    def __init__(self, report: dict):
        self.report = report
        bad = ", ".join(f"{k} {report[k]:.4g} (limit {report['tolerances'][k]})" for k in report["failed"])
        super().__init__(f"parity check failed: {bad}; nothing was written (pass --no-verify to keep the export anyway)")


def _nll_score(fn, vocab: int | None = None):
    """``(x, y) -> summed nll`` of a ``tokens -> logits`` callable, a few rows at a time when ``vocab`` is given."""
    def score(x: torch.Tensor, y: torch.Tensor) -> float:
        rows = x.shape[0] if vocab is None else max(1, CALLABLE_LOGITS_BYTES // (4 * vocab * x.shape[1]))
        return sum(F.cross_entropy(fn(x[i:i + rows]).float().flatten(0, 1), y[i:i + rows].flatten(), reduction="sum").item()
                   for i in range(0, x.shape[0], rows))
    return score


def check_parity(model, graphs, val_tokens: np.ndarray, token_bytes: torch.Tensor, precision: str, *,
                 eval_tokens: int | None = None, seq_len: int | None = None, new_tokens: int = 64, n_prompts: int = 4,
                 prompt_len: int = 32) -> dict:
    """Compare ``graphs`` (a :class:`~prunus.export.backend_parity.BackendGraphs`: a serving backend as
    ``graphs(tokens)`` -> logits and ``graphs.greedy``) with
    ``model``; a JSON-able report.

    ``eval_tokens`` / ``seq_len``: default to the slice every scorer uses (``prunus.data.evaluate``)."""
    ref = torch_reference(model, val_tokens, token_bytes, eval_tokens=eval_tokens, seq_len=seq_len,
                          new_tokens=new_tokens, n_prompts=n_prompts, prompt_len=prompt_len)
    return compare(ref, graphs, val_tokens, token_bytes, precision)


def torch_reference(model, val_tokens: np.ndarray, token_bytes: torch.Tensor, *, eval_tokens: int | None = None,
                    seq_len: int | None = None, new_tokens: int = 64, n_prompts: int = 4, prompt_len: int = 32) -> dict:
    """What every runtime is compared with: the PyTorch model's probe logits, bits per byte and greedy tokens (made
    once, however many runtimes are checked against it)."""
    limit = model.config.max_seq_len
    eval_tokens = eval_tokens or DEFAULT_EVAL_TOKENS
    seq_len = min(seq_len or default_seq_len(limit), len(val_tokens) - 1)
    probe_len = min(PROBE_LEN, seq_len, (len(val_tokens) - 1) // PROBE_ROWS)
    with torch.inference_mode():
        x = torch.from_numpy(np.asarray(val_tokens[: PROBE_ROWS * probe_len], dtype=np.int64)).reshape(PROBE_ROWS, probe_len)
        logits = model(x).float()
        torch_eval = evaluate(model, val_tokens, token_bytes, seq_len=seq_len, max_tokens=eval_tokens)
        prompt_len = min(prompt_len, limit - new_tokens)
        starts = np.linspace(0, len(val_tokens) - prompt_len - 1, n_prompts).astype(np.int64)
        prompts = torch.stack([torch.from_numpy(np.asarray(val_tokens[s: s + prompt_len], dtype=np.int64)) for s in starts])
        want = generate(model, prompts, new_tokens)[:, prompt_len:]
    return {"probe": x, "logits": logits, "eval": torch_eval, "prompts": prompts, "greedy": want,
            "eval_tokens": eval_tokens, "seq_len": seq_len}


def compare(ref: dict, graphs, val_tokens: np.ndarray, token_bytes: torch.Tensor, precision: str) -> dict:
    """``graphs`` against :func:`torch_reference`'s ``ref``, judged by ``precision``'s limits: a JSON-able report.
    The backend the graphs drove is closed after."""
    tol = TOLERANCES[precision]
    want, new_tokens = ref["greedy"], ref["greedy"].shape[1]
    try:
        with torch.inference_mode():
            got = graphs(ref["probe"])
            max_abs = (ref["logits"] - got).abs().max().item()
            top1 = (ref["logits"].argmax(-1) == got.argmax(-1)).float().mean().item()
            del got
            ort_eval = evaluate(None, val_tokens, token_bytes, seq_len=ref["seq_len"], max_tokens=ref["eval_tokens"],
                                score=_nll_score(graphs, len(token_bytes)))
            have = graphs.greedy(ref["prompts"], new_tokens)
            # teacher-forced along PyTorch's tokens; where the free-running tokens already are those, the same run
            forced = have if torch.equal(want, have) else graphs.greedy(ref["prompts"], new_tokens, follow=want)
    finally:
        graphs.close()  # the backend it drove (made again if the graphs are called after)
    torch_eval = ref["eval"]
    report = {
        "precision": precision,
        "max_abs_logits": max_abs,
        "top1_agreement": top1,
        "bpb_torch": torch_eval["val_bpb"],
        "bpb_onnx": ort_eval["val_bpb"],
        "bpb_increase": ort_eval["val_bpb"] - torch_eval["val_bpb"],
        "greedy_agreement": (want == have).float().mean().item(),
        "decode_agreement": (want == forced).float().mean().item(),
        "greedy_tokens": int(want.numel()),
        "greedy_identical_rows": int((want == have).all(dim=1).sum()),
        "eval_tokens": torch_eval["val_tokens"],
        "seq_len": ref["seq_len"],
        "tolerances": tol,
    }
    report["failed"] = _failed(report, tol)
    report["passed"] = not report["failed"]
    return report


def _failed(report: dict, tol: dict) -> list[str]:
    """The figures of ``report`` outside their limits (a NaN is outside any limit)."""
    failed = []
    for key, lim in tol.items():
        if lim is None:
            continue
        value = report[key]
        bad = value < lim if key in MINIMUMS else value > lim
        if bad or math.isnan(value):
            failed.append(key)
    return failed
