"""Structured pruning: remove attention heads, MLP channels or whole blocks.

The result is a genuinely smaller dense model: a new ``Transformer`` built from a
``ModelConfig`` that matches its shapes, so it saves and loads like any other.
Every block loses the same number of heads or channels, which keeps the config
uniform; *which* ones go is decided per block by importance measured on the
calibration batches of the unpruned model:

* ``heads``: the norm of each head's contribution to the residual stream,
  ``||o_h W_o[:, h]^T||`` over all calibration tokens. Under grouped-query
  attention the unit removed is a whole kv group (one key/value head and the
  query heads that share it; their contributions add up), so ``n_heads /
  n_kv_heads`` stays what it was. The heads left keep their width: the config
  gets an explicit ``head_dim``. ``amount`` is the fraction of heads removed.
* ``channels``: the norm of each SwiGLU channel's contribution,
  ``||silu(w1 x)_c * (w3 x)_c|| * ||w2[:, c]||``; a channel goes from the rows of
  w1 and w3 and the columns of w2. ``amount`` is the fraction of ``ffn_dim`` removed.
* ``blocks``: 1 - mean cosine similarity between a block's input and output hidden
  states (Men et al. 2024, "ShortGPT"); the least important blocks go and the rest
  are renumbered 0..n-1. ``amount`` is a count when an int, a fraction of
  ``n_layers`` when a float.

Counts are the nearest achievable (halves round up): with 3 kv groups of 3 heads,
``heads: 0.25`` removes one group, 3 of 9 heads (33%). What was actually removed is
recorded (``removed_fraction``, ``summary``) and noted in the compression report. An
amount that removes nothing (or everything) is refused, naming the achievable amounts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prunus.models.compression_state import compression_state, set_compression_state
from prunus.artifacts.errors import PrunusError
from prunus.models.llama import Transformer

from .options import STRUCTURED_TARGETS

TARGETS = STRUCTURED_TARGETS  # prunus.compress.options


def _run(model: Transformer, batches) -> None:
    device = next(model.parameters()).device
    for tokens in batches:
        model(tokens.to(device))


@torch.no_grad()
def _with_hooks(model: Transformer, batches, hooks: list[tuple[nn.Module, str, object]]) -> None:
    """Run ``batches`` through ``model`` in eval mode with (module, "pre"|"post", fn) hooks attached."""
    handles = [m.register_forward_pre_hook(fn) if kind == "pre" else m.register_forward_hook(fn) for m, kind, fn in hooks]
    was_training = model.training
    model.eval()
    try:
        _run(model, batches)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def head_group_importance(model: Transformer, batches) -> dict[str, torch.Tensor]:
    """Per block, one score per kv group: the norm of its query heads' contribution through wo."""
    cfg = model.config
    hd, n_rep = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    sums = {key: torch.zeros(cfg.n_heads, dtype=torch.float64) for key in model.layers}

    def hook(key, wo):
        def record(module, args):
            x = args[0].detach().float()
            x = x.reshape(-1, cfg.n_heads, hd)
            w = wo.weight.detach().float().view(-1, cfg.n_heads, hd)  # (dim, heads, hd)
            for chunk in x.split(1024):
                contrib = torch.einsum("nhd,ehd->nhe", chunk, w)
                sums[key] += contrib.pow(2).sum((0, 2)).double().cpu()
        return record

    _with_hooks(model, batches, [(layer.attention.wo, "pre", hook(key, layer.attention.wo)) for key, layer in model.layers.items()])
    return {key: s.view(cfg.n_kv_heads, n_rep).sum(1).sqrt() for key, s in sums.items()}


def channel_importance(model: Transformer, batches) -> dict[str, torch.Tensor]:
    """Per block, one score per MLP channel: ``||a_c|| * ||w2[:, c]||`` with ``a = silu(w1 x) * w3 x``."""
    sums = {key: torch.zeros(layer.feed_forward.w2.in_features, dtype=torch.float64) for key, layer in model.layers.items()}

    def hook(key):
        def record(module, args):
            a = args[0].detach()
            sums[key] += a.reshape(-1, a.shape[-1]).double().pow(2).sum(0).cpu()
        return record

    _with_hooks(model, batches, [(layer.feed_forward.w2, "pre", hook(key)) for key, layer in model.layers.items()])
    return {key: s.sqrt() * model.layers[key].feed_forward.w2.weight.detach().double().norm(dim=0).cpu()
            for key, s in sums.items()}


def block_importance(model: Transformer, batches) -> dict[str, float]:
    """ShortGPT's block influence: 1 - mean over tokens of cos(block input, block output)."""
    sums = {key: 0.0 for key in model.layers}
    counts = {key: 0 for key in model.layers}

    def hook(key):
        def record(module, args, out):
            cos = F.cosine_similarity(args[0].detach().float(), out.detach().float(), dim=-1)
            sums[key] += float(cos.sum())
            counts[key] += cos.numel()
        return record

    _with_hooks(model, batches, [(layer, "post", hook(key)) for key, layer in model.layers.items()])
    return {key: 1.0 - sums[key] / max(counts[key], 1) for key in model.layers}


def _count(amount, total: int, what: str, allow_int: bool) -> int:
    """How many of ``total`` units ``amount`` removes: the nearest whole number (halves up) to
    ``amount * total`` (a fraction), or the count itself (blocks, an int)."""
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise PrunusError(f"prune_structured: amount {amount!r} must be a number")
    if allow_int and isinstance(amount, int):
        n = amount
    elif not 0 <= amount < 1:
        hint = "an int count of blocks or a fraction in [0, 1)" if allow_int else "a fraction in [0, 1), e.g. 0.25"
        raise PrunusError(f"prune_structured: amount {amount!r} must be {hint}")
    else:
        n = int(amount * total + 0.5)
    achievable = ", ".join(f"{k / total:.3g}" for k in range(1, min(total, 6)))
    if amount > 0 and n == 0:
        raise PrunusError(f"prune_structured: amount {amount} removes none of the {total} {what}; "
                          f"achievable amounts: {achievable}{', ...' if total > 6 else ''}")
    if not 0 <= n < total:
        raise PrunusError(f"prune_structured: amount {amount} would remove {n} of the {total} {what}; at least one must stay")
    return n


def _lowest(scores: torch.Tensor, n: int) -> list[int]:
    return sorted(torch.topk(scores, n, largest=False).indices.tolist()) if n else []


def _rows(units: list[int], width: int) -> torch.Tensor:
    """Indices of the rows (or columns) of ``units``, each ``width`` wide."""
    return torch.tensor([u * width + i for u in units for i in range(width)], dtype=torch.long)


def _rebuild(model: Transformer, cfg, state: dict[str, torch.Tensor]) -> Transformer:
    """A new Transformer of ``cfg`` holding ``state``, on the device, dtype and mode of ``model``."""
    device = next(model.parameters()).device
    with torch.device("meta"):
        new = Transformer(cfg)
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("output.weight", None)
    missing, unexpected = new.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "output.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_embeddings:
        new.output.weight = new.tok_embeddings.weight
    new.init_buffers(device=device)
    new.train(model.training)
    for p_new, p_old in zip(new.parameters(), model.parameters()):
        p_new.requires_grad_(p_old.requires_grad)
    return set_compression_state(new, compression_state(model).copy())


def _take(state: dict, prefix: str, names, index: torch.Tensor, dim: int = 0) -> None:
    """Keep ``index`` along ``dim`` of ``prefix.name.weight`` (and of its bias along rows, when it has one)."""
    for name in names:
        state[f"{prefix}{name}.weight"] = state[f"{prefix}{name}.weight"].index_select(dim, index)
        if dim == 0 and f"{prefix}{name}.bias" in state:
            state[f"{prefix}{name}.bias"] = state[f"{prefix}{name}.bias"][index]


def _remove_heads(model: Transformer, amount, batches):
    cfg = model.config
    n_rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    n = _count(amount, cfg.n_kv_heads, f"kv head groups (of {n_rep} heads each)" if n_rep > 1 else "heads",
               allow_int=False)
    scores = head_group_importance(model, batches) if n else {}
    state, removed = dict(model.state_dict()), {}
    for key in model.layers:
        drop = _lowest(scores[key], n) if n else []
        keep = [g for g in range(cfg.n_kv_heads) if g not in drop]
        q_keep = [g * n_rep + r for g in keep for r in range(n_rep)]
        p = f"layers.{key}.attention."
        _take(state, p, ("wq",), _rows(q_keep, hd))
        _take(state, p, ("wk", "wv"), _rows(keep, hd))
        _take(state, p, ("wo",), _rows(q_keep, hd), dim=1)
        removed[f"layers.{key}.attention"] = {
            "removed_kv_heads": drop, "removed_heads": [g * n_rep + r for g in drop for r in range(n_rep)],
            "importance": [round(float(s), 6) for s in scores[key]] if n else None,
        }
    new_cfg = cfg.replace(n_heads=cfg.n_heads - n * n_rep, n_kv_heads=cfg.n_kv_heads - n, head_dim=hd)
    fraction = n / cfg.n_kv_heads
    note = f"removed {n * n_rep} of {cfg.n_heads} attention heads in every block ({100 * fraction:.1f}%)"
    if n_rep > 1:
        note += f": heads go in whole kv groups of {n_rep}, {n} of {cfg.n_kv_heads} groups"
    if abs(fraction - amount) > 1e-9:
        note += f"; {amount:g} was asked, {fraction:.3g} is the nearest achievable amount"
    return new_cfg, state, removed, fraction, note


def _remove_channels(model: Transformer, amount, batches):
    cfg = model.config
    n = _count(amount, cfg.ffn_dim, "MLP channels", allow_int=False)
    scores = channel_importance(model, batches) if n else {}
    state, removed = dict(model.state_dict()), {}
    for key in model.layers:
        drop = _lowest(scores[key], n) if n else []
        keep = torch.ones(cfg.ffn_dim, dtype=torch.bool)
        keep[drop] = False
        p = f"layers.{key}.feed_forward."
        index = keep.nonzero().flatten()
        _take(state, p, ("w1", "w3"), index)
        _take(state, p, ("w2",), index, dim=1)
        removed[f"layers.{key}.feed_forward"] = {"removed_channels": drop}
    fraction = n / cfg.ffn_dim
    note = f"removed {n} of {cfg.ffn_dim} MLP channels in every block ({100 * fraction:.2f}%)"
    if abs(fraction - amount) > 1e-9:
        note += f"; {amount:g} was asked, {fraction:.4g} is the nearest achievable amount"
    return cfg.replace(ffn_dim=cfg.ffn_dim - n), state, removed, fraction, note


def _remove_blocks(model: Transformer, amount, batches):
    cfg = model.config
    keys = list(model.layers)
    n = _count(amount, len(keys), "blocks", allow_int=True)
    scores = block_importance(model, batches) if n else {}
    drop = set(_lowest(torch.tensor([scores[k] for k in keys], dtype=torch.float64), n)) if n else set()
    kept = [k for i, k in enumerate(keys) if i not in drop]
    state = {}
    for name, value in model.state_dict().items():
        if not name.startswith("layers."):
            state[name] = value
            continue
        key, rest = name.split(".", 2)[1:]
        if key in kept:
            state[f"layers.{kept.index(key)}.{rest}"] = value
    removed = {f"layers.{k}": {"removed": i in drop, "importance": round(scores[k], 6) if n else None,
                               "new_index": kept.index(k) if k in kept else None}
               for i, k in enumerate(keys)}
    fraction = n / len(keys)
    note = f"removed {n} of {len(keys)} blocks ({100 * fraction:.1f}%): " + ", ".join(f"layers.{keys[i]}" for i in sorted(drop))
    if isinstance(amount, float) and abs(fraction - amount) > 1e-9:
        note += f"; {amount:g} was asked, {fraction:.3g} is the nearest achievable amount"
    # per-layer settings (sliding or full attention) follow their blocks
    return cfg.keep_layers([keys.index(k) for k in kept]), state, removed, fraction, note


def prune_structured_pass(model: Transformer, ctx, *, target: str, amount: float, n_calib: int = 8) -> Transformer:
    """Remove ``amount`` of ``target`` (heads, channels or blocks) from every block (from the
    model, for blocks). Returns a new, smaller Transformer whose config matches its shapes, with
    what was removed recorded in its CompressionState (``sparsity``)."""
    if target not in TARGETS:
        raise PrunusError(f"prune_structured: target {target!r} is unknown; choose one of {', '.join(TARGETS)}")
    if isinstance(n_calib, bool) or not isinstance(n_calib, int) or n_calib < 1:
        raise PrunusError(f"prune_structured: n_calib {n_calib!r} must be a positive number of calibration batches")
    if not isinstance(model, Transformer) or model.tok_embeddings is None or model.output is None:
        raise PrunusError("prune_structured: needs a whole prunus Transformer (not a pipeline stage)")
    if getattr(model.config, "n_experts", 0):
        raise PrunusError("prune_structured: mixture-of-experts blocks are not supported; "
                          "use unstructured pruning (prune) or distill into a dense student")
    for key, layer in model.layers.items():
        for part, names in (("attention", ("wq", "wk", "wv", "wo")), ("feed_forward", ("w1", "w2", "w3"))):
            for name in names:
                m = getattr(getattr(layer, part), name)
                if type(m) is not nn.Linear:
                    raise PrunusError(f"prune_structured: layers.{key}.{part}.{name} is a {type(m).__name__}, "
                                      "not a float Linear; prune before quantizing")
    remove = {"heads": _remove_heads, "channels": _remove_channels, "blocks": _remove_blocks}[target]
    params_before = sum(p.numel() for p in model.parameters())
    new_cfg, state, removed, fraction, note = remove(model, amount, ctx.calibration(n_calib))
    new = _rebuild(model, new_cfg, state)
    params_after = sum(p.numel() for p in new.parameters())
    note += f"; parameters {params_before:,} -> {params_after:,} ({100 * (1 - params_after / params_before):.1f}% fewer)"
    if hasattr(ctx, "note"):
        ctx.note(note)
    record = {"method": "structured", "target": target, "amount": amount, "removed_fraction": fraction, "summary": note,
              "achieved": 1 - params_after / params_before,
              "params_before": params_before, "params_after": params_after, "per_module": removed,
              "calibration_batches": n_calib}
    compression_state(new).set_sparsity(record)
    return new
