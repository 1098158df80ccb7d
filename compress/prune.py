"""Unstructured and 2:4 pruning: zero the least important weights of every Linear.

Scores, one per weight:

* ``magnitude``: ``|W_ij|``;
* ``wanda`` (Sun et al. 2023, "A Simple and Effective Pruning Approach for LLMs"):
  ``|W_ij| * ||X_j||_2``, the weight times the L2 norm of its input channel over
  the calibration tokens. The norms are collected once, on the unpruned model,
  by forward pre-hooks on the Linear inputs.

Which weights compete (``scope``):

* ``"layer"``: every pruned Linear ends at exactly the target sparsity. Wanda ranks
  within each output row, as in the paper; magnitude ranks across the whole matrix
  (the classic layer-wise baseline).
* ``"row"``: every output row of every pruned Linear at exactly the target, for both.
* ``"global"``: one ranking over all prunable weights, so layers end at different
  sparsities. Magnitude ranks ``|W_ij|``; Wanda ranks ``|W_ij| * ||X_j|| / mean_k ||X_k||``:
  each layer's input norms are scaled to mean 1, so a layer is not spared or
  emptied wholesale because its inputs are large or small (after an RMSNorm or
  inside the MLP). With equal input norms this is exactly global magnitude.

``"2:4"`` (Wanda scores) and ``"2:4-magnitude"`` keep the 2 highest-scoring weights
of every 4 consecutive input weights of a row: the semi-structured pattern that
sparse tensor cores run. It is 50% sparsity by construction.

Masks are applied for good: weights are multiplied by 0/1 in place, the Parameter
objects stay (tied weights and references keep working) and no reparametrization
is left behind. The model stays dense in shape; :func:`to_semi_structured` turns
2:4 weights into ``torch.sparse`` semi-structured tensors where CUDA runs them.
"""

from __future__ import annotations

import torch
from torch import nn

from prunus.models.compression_state import compression_state
from prunus.artifacts.errors import PrunusError

from .calibrate import observe_inputs
from .options import PRUNE_METHODS, PRUNE_SCOPES
from .select import float_linears, given_exclude

METHODS, SCOPES = PRUNE_METHODS, PRUNE_SCOPES  # prunus.compress.options


def prunable_linears(model: nn.Module, exclude=("output",)) -> dict[str, nn.Linear]:
    """Every float ``nn.Linear`` of ``model`` that ``exclude`` leaves (``select.py``: the rule quantize
    follows too; a mixture of experts' router is never pruned), by name."""
    return float_linears(model, exclude, where="prune")[0]


@torch.no_grad()
def input_norms(model: nn.Module, linears: dict[str, nn.Linear], batches) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` of every input channel of each Linear over all tokens of ``batches`` (float32)."""
    def sum_of_squares(x, prev):
        s = x.double().pow(2).sum(0)
        return s if prev is None else prev + s

    was_training = model.training
    model.eval()
    try:
        sums = observe_inputs(model, linears, batches, sum_of_squares)
    finally:
        model.train(was_training)
    return {name: s.sqrt().float() for name, s in sums.items()}


def weight_scores(linears: dict[str, nn.Linear], norms: dict[str, torch.Tensor] | None,
                  normalise: bool = False) -> dict[str, torch.Tensor]:
    """``|W|`` (no norms) or ``|W| * ||X_j||``; ``normalise`` scales each layer's norms to mean 1."""
    scores = {}
    for name, m in linears.items():
        s = m.weight.detach().abs().float()
        if norms is not None:
            n = norms[name]
            if normalise:
                n = n / n.mean().clamp_min(torch.finfo(n.dtype).tiny)
            s = s * n.to(s.device)
        scores[name] = s
    return scores


def _drop_lowest(scores: torch.Tensor, n_drop: int, dim: int | None) -> torch.Tensor:
    """A keep-mask with exactly ``n_drop`` lowest scores dropped (per ``dim`` slice, or over all)."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    if n_drop == 0:
        return keep
    if dim is None:
        keep.view(-1)[torch.topk(scores.view(-1), n_drop, largest=False).indices] = False
    else:
        keep.scatter_(dim, torch.topk(scores, n_drop, dim=dim, largest=False).indices, False)
    return keep


def unstructured_masks(scores: dict[str, torch.Tensor], sparsity: float, group: str) -> dict[str, torch.Tensor]:
    """Keep-masks dropping ``round(sparsity * n)`` lowest scores of each ``group``: "row", "matrix" or "all"."""
    if group == "all":
        flat = torch.cat([s.reshape(-1) for s in scores.values()])
        keep = _drop_lowest(flat, round(sparsity * flat.numel()), None)
        masks, start = {}, 0
        for name, s in scores.items():
            masks[name] = keep[start:start + s.numel()].view_as(s)
            start += s.numel()
        return masks
    if group == "row":
        return {name: _drop_lowest(s, round(sparsity * s.shape[1]), 1) for name, s in scores.items()}
    return {name: _drop_lowest(s, round(sparsity * s.numel()), None) for name, s in scores.items()}


def n_m_masks(scores: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """Keep-masks keeping the ``n`` highest scores of every ``m`` consecutive input weights."""
    masks = {}
    for name, s in scores.items():
        if s.shape[1] % m:
            raise PrunusError(f"prune {n}:{m}: {name} has {s.shape[1]} input features, not a multiple of {m}; "
                              f"exclude it or use unstructured pruning")
        groups = s.reshape(-1, m)
        masks[name] = _drop_lowest(groups, m - n, 1).view_as(s)
    return masks


@torch.no_grad()
def apply_masks(linears: dict[str, nn.Linear], masks: dict[str, torch.Tensor]) -> None:
    """Zero the dropped weights in place (the Parameter objects are kept)."""
    for name, m in linears.items():
        m.weight.mul_(masks[name].to(device=m.weight.device, dtype=m.weight.dtype))


def sparsity_of(linears: dict[str, nn.Linear]) -> tuple[float, dict[str, float]]:
    """Fraction of exact zeros over all of ``linears``, and per module."""
    zeros = {name: int((m.weight == 0).sum()) for name, m in linears.items()}
    total = sum(m.weight.numel() for m in linears.values())
    per_module = {name: zeros[name] / m.weight.numel() for name, m in linears.items()}
    return sum(zeros.values()) / max(total, 1), per_module


def _check_args(method, sparsity, scope, n_calib) -> None:
    if method not in METHODS:
        raise PrunusError(f"prune: method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    if scope not in SCOPES:
        raise PrunusError(f"prune: scope {scope!r} is unknown; choose one of {', '.join(SCOPES)}")
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise PrunusError(f"prune: sparsity {sparsity!r} must be a fraction in [0, 1), e.g. 0.5")
    if method.startswith("2:4") and sparsity != 0.5:
        raise PrunusError(f"prune: method {method} is 50% sparse by construction; drop sparsity={sparsity} or set it to 0.5")
    if method.startswith("2:4") and scope == "global":
        raise PrunusError(f"prune: method {method} prunes every group of 4 weights alike; drop scope=global")
    if isinstance(n_calib, bool) or not isinstance(n_calib, int) or n_calib < 1:
        raise PrunusError(f"prune: n_calib {n_calib!r} must be a positive number of calibration batches")


def prune_pass(model: nn.Module, ctx, *, method: str, sparsity: float = 0.5, scope: str = "layer", n_calib: int = 8,
               exclude: str | list | tuple | None = None) -> nn.Module:
    """Zero the least important weights of every Linear not in ``exclude`` (the embedding is
    never a Linear); record it in the model's CompressionState (``sparsity``). Returns ``model``, pruned in place."""
    _check_args(method, sparsity, scope, n_calib)
    exclude = given_exclude(model, exclude, "prune")  # default: the output head
    linears = prunable_linears(model, exclude)
    if not linears:
        raise PrunusError("prune: the model has no float Linear weights left to prune "
                          "(all excluded, or already quantized); prune before quantize or loosen exclude")
    wanda = method in ("wanda", "2:4")
    norms = input_norms(model, linears, ctx.calibration(n_calib)) if wanda else None
    scores = weight_scores(linears, norms, normalise=wanda and scope == "global")
    if method.startswith("2:4"):
        masks = n_m_masks(scores, 2, 4)
    else:
        group = {"global": "all", "row": "row", "layer": "row" if wanda else "matrix"}[scope]
        masks = unstructured_masks(scores, float(sparsity), group)
    apply_masks(linears, masks)

    achieved, per_module = sparsity_of(linears)
    excluded = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in linears)
    record = {"method": method, "scope": scope, "pattern": "2:4" if method.startswith("2:4") else None,
              "target": float(sparsity),
              "achieved": achieved, "per_module": per_module, "excluded": excluded,
              "calibration_batches": n_calib if wanda else 0}
    compression_state(model).set_sparsity(record)
    return model


def semi_structured_available() -> tuple[bool, str]:
    """Whether 2:4 sparse kernels can run here, and why not."""
    if not torch.cuda.is_available():
        return False, "2:4 sparse kernels need CUDA (torch.sparse semi-structured runs on GPUs of compute capability 8.0+)"
    if torch.cuda.get_device_capability() < (8, 0):
        return False, f"2:4 sparse kernels need compute capability 8.0+, this GPU has {torch.cuda.get_device_capability()}"
    return True, ""


@torch.no_grad()
def to_semi_structured(model: nn.Module, exclude=("output",)) -> list[str]:
    """Store every 2:4-pruned Linear weight as a ``torch.sparse`` semi-structured tensor (CUDA,
    fp16/bf16), so its matmuls run on sparse tensor cores. Returns the converted module names."""
    ok, why = semi_structured_available()
    if not ok:
        raise PrunusError(f"2:4 sparse weights: {why}; keep the dense pruned model here")
    from torch.sparse import to_sparse_semi_structured

    converted = []
    for name, m in prunable_linears(model, exclude).items():
        w = m.weight
        if w.device.type != "cuda" or w.dtype not in (torch.float16, torch.bfloat16):
            raise PrunusError(f"2:4 sparse weights: {name} is {w.dtype} on {w.device}; move the model to CUDA in fp16/bf16 first")
        if m.in_features % 4 or not bool((w.reshape(-1, 4) != 0).sum(1).le(2).all()):
            continue  # not 2:4: stays dense
        m.weight = nn.Parameter(to_sparse_semi_structured(w), requires_grad=False)
        converted.append(name)
    return converted
