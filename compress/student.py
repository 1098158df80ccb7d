"""Students for distillation, derived from a teacher.

``make_student(teacher, spec)``:

* ``"keep-every:K"``: blocks 0, K, 2K, ... of the teacher, renumbered 0, 1, 2, ...; every
  other weight (embedding, final norm, head) copied.
* ``"depth:N"``: N blocks of the teacher spread evenly from its first to its last (block
  ``round(i (L - 1) / (N - 1))`` for i = 0 .. N - 1), renumbered; every other weight copied. Unlike
  keep-every, the last block (the one that writes what the head reads) is always kept: depth:15 of a
  30-block model keeps 0, 2, 4, ..., 27, 29. The layer-dropping initialisation of DistilBERT.
* ``"width:F"``: dim, ffn_dim and the attention heads narrowed by F, weights taken from the
  teacher: the residual channels with the largest weight norms summed over every matrix that
  reads or writes them (embedding, q/k/v/w1/w3 columns, wo/w2 rows, head columns), whole
  key/value groups (with their query heads) ranked by the norms of their q/k/v rows and wo
  columns, and per block the SwiGLU units with the largest ``|w1_j| |w3_j| |w2_j|``. Head width
  is kept, so rotary embeddings are unchanged.
* several of the above joined by commas apply left to right: ``"keep-every:2,width:1.25"``.
* a preset name or a dict of ``ModelConfig`` fields (over the teacher's): a fresh student,
  initialised like a new model, then every tensor whose name and shape match the teacher's
  copied. The vocabulary is always the teacher's: the losses compare logits token for token.
"""

from __future__ import annotations

import dataclasses

import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset
from prunus.models.compression_state import compression_state
from prunus.models.config import ModelConfig
from prunus.artifacts.validate import check_known_fields

from .student_spec import parse_student


def _new(cfg: ModelConfig, seed: int, like: Transformer) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights()
    dtype = next(like.parameters()).dtype
    return model.to(device=like.tok_embeddings.weight.device, dtype=dtype)


def check_float(model: Transformer) -> None:
    if any(not p.is_floating_point() for p in model.state_dict().values() if p.ndim >= 2):
        raise PrunusError("distill: the model holds quantized weights; distill before quantizing "
                          "(put the distill pass ahead of quantize in the recipe)")


def keep_every(teacher: Transformer, k: int) -> Transformer:
    """Blocks 0, k, 2k, ... of ``teacher`` (renumbered), everything else copied."""
    n = teacher.config.n_layers
    if not 1 <= k <= n:
        raise PrunusError(f"distill: keep-every:{k} must be between 1 and the model's {n} blocks")
    return keep_blocks(teacher, list(range(n))[::k])


def spread_blocks(n_layers: int, n: int) -> list[int]:
    """``n`` block indices spread evenly over ``n_layers`` blocks, the first and the last included."""
    if not 1 <= n <= n_layers:
        raise PrunusError(f"distill: depth:{n} must be between 1 and the model's {n_layers} blocks")
    if n == 1:
        return [n_layers - 1]
    return sorted({round(i * (n_layers - 1) / (n - 1)) for i in range(n)})


def keep_blocks(teacher: Transformer, blocks: list[int]) -> Transformer:
    """The teacher's blocks at positions ``blocks`` (renumbered 0, 1, ...), everything else copied."""
    names = list(teacher.layers.keys())
    kept = [names[i] for i in blocks]
    student = _new(teacher.config.replace(n_layers=len(kept)), 0, teacher)
    src = teacher.state_dict()
    state = {}
    for name in student.state_dict():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            state[name] = src[f"layers.{kept[int(i)]}.{rest}"]
        else:
            state[name] = src[name]
    student.load_state_dict(state)
    return student


def _sq(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Squared norm of each row (dim=1 reduced) or column (dim=0 reduced)."""
    return w.float().pow(2).sum(dim)


def _width_config(cfg, factor: float):
    """The teacher's config ``cfg`` with dim, ffn_dim, n_heads and n_kv_heads divided by ``factor`` (one line where
    the factor cannot divide them)."""
    if getattr(cfg, "n_experts", 0):
        raise PrunusError("distill: width students of mixture-of-experts models are not supported; use keep-every:K or a config")
    if factor < 1:
        raise PrunusError(f"distill: width:{factor} must be at least 1 (it divides the width)")
    n_kv = round(cfg.n_kv_heads / factor)
    if n_kv < 1:
        raise PrunusError(f"distill: width:{factor} leaves no key/value head of {cfg.n_kv_heads}; use a factor up to {cfg.n_kv_heads}")
    rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    n_heads = n_kv * rep
    dim = round(cfg.dim / factor)
    ffn = max(1, round(cfg.ffn_dim / factor))
    changes = dict(dim=dim, n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=ffn)
    if "head_dim" in {f.name for f in dataclasses.fields(cfg)}:
        changes["head_dim"] = hd
    elif dim != n_heads * hd:
        raise PrunusError(f"distill: width:{factor} gives dim {dim} that is not {n_heads} heads x {hd}; choose a factor dividing n_kv_heads")
    return cfg.replace(**changes)


def width(teacher: Transformer, factor: float) -> Transformer:
    """dim, ffn_dim, n_heads and n_kv_heads divided by ``factor``, the most important channels kept."""
    cfg = teacher.config
    student = _new(_width_config(cfg, factor), 0, teacher)
    dim, ffn, n_kv = student.config.dim, student.config.ffn_dim, student.config.n_kv_heads
    rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim

    src = teacher.state_dict()
    blocks = list(teacher.layers.keys())
    # residual channels: everything that reads (columns) or writes (rows) the residual stream
    score = _sq(src["tok_embeddings.weight"], 0) + _sq(src["output.weight"], 0)
    for b in blocks:
        p = f"layers.{b}."
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            score = score + _sq(src[p + name + ".weight"], 0)
        for name in ("attention.wo", "feed_forward.w2"):
            score = score + _sq(src[p + name + ".weight"], 1)
    ch = score.topk(dim).indices.sort().values

    state = {"tok_embeddings.weight": src["tok_embeddings.weight"][:, ch], "norm.weight": src["norm.weight"][ch],
             "output.weight": src["output.weight"][:, ch]}
    for i, b in enumerate(blocks):
        p, q = f"layers.{b}.", f"layers.{i}."
        wq, wk, wv, wo = (src[p + f"attention.{n}.weight"] for n in ("wq", "wk", "wv", "wo"))
        # key/value groups: the group's k/v rows, its query heads' q rows and wo columns
        g_score = (_sq(wk, 1).view(cfg.n_kv_heads, hd).sum(1) + _sq(wv, 1).view(cfg.n_kv_heads, hd).sum(1)
                   + _sq(wq, 1).view(cfg.n_kv_heads, rep * hd).sum(1) + _sq(wo, 0).view(cfg.n_kv_heads, rep * hd).sum(1))
        groups = g_score.topk(n_kv).indices.sort().values
        kv_rows = (groups[:, None] * hd + torch.arange(hd)).flatten()
        q_rows = (groups[:, None] * rep * hd + torch.arange(rep * hd)).flatten()
        w1, w2, w3 = (src[p + f"feed_forward.{n}.weight"] for n in ("w1", "w2", "w3"))
        units = (_sq(w1, 1).sqrt() * _sq(w3, 1).sqrt() * _sq(w2, 0).sqrt()).topk(ffn).indices.sort().values
        state.update({
            q + "attention_norm.weight": src[p + "attention_norm.weight"][ch],
            q + "ffn_norm.weight": src[p + "ffn_norm.weight"][ch],
            q + "attention.wq.weight": wq[q_rows][:, ch],
            q + "attention.wk.weight": wk[kv_rows][:, ch],
            q + "attention.wv.weight": wv[kv_rows][:, ch],
            q + "attention.wo.weight": wo[ch][:, q_rows],
            q + "feed_forward.w1.weight": w1[units][:, ch],
            q + "feed_forward.w3.weight": w3[units][:, ch],
            q + "feed_forward.w2.weight": w2[ch][:, units],
        })
    if cfg.tie_embeddings:
        state.pop("output.weight")
    student.load_state_dict(state, strict=not cfg.tie_embeddings)
    compression_state(student).student_channels = ch  # which teacher channels its residual stream holds
    return student


def from_config(teacher: Transformer, cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A fresh ``cfg`` model; tensors whose name and shape match the teacher's are copied."""
    student = _new(cfg, seed, teacher)
    src = teacher.state_dict()
    state = student.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if name in src and src[name].shape == t.shape:
                t.copy_(src[name])
    return student


def depth(teacher: Transformer, n: int) -> Transformer:
    """``n`` of the teacher's blocks spread from its first to its last (see :func:`spread_blocks`)."""
    return keep_blocks(teacher, spread_blocks(teacher.config.n_layers, n))


DERIVE = {"keep-every": keep_every, "depth": depth, "width": width}  # student_spec.DERIVATIONS, made


def teacher_blocks(spec, n_layers: int) -> list[int] | None:
    """Which of the teacher's blocks a ``keep-every:K`` or ``depth:N`` student (made by
    :func:`make_student`, which has checked ``spec``) starts from; None for other students."""
    derived = parse_student(spec)
    if derived is None or len(derived) != 1:
        return None
    kind, value = derived[0]
    if kind == "keep-every":
        return list(range(n_layers))[::value]
    if kind == "depth":
        return spread_blocks(n_layers, value)
    return None


def make_student(teacher: Transformer, spec, seed: int = 0) -> Transformer:
    """The student ``spec`` describes (see the module docstring), in train mode."""
    check_float(teacher)
    try:
        derived = parse_student(spec)
    except ValueError as e:
        raise PrunusError(f"distill: student {spec!r}: {e}") from None
    if derived is not None:  # keep-every:K, depth:N, width:F, several left to right
        student = teacher
        for kind, value in derived:
            student = DERIVE[kind](student, value)
        return student.train()
    if isinstance(spec, str):
        try:
            cfg = get_preset(spec)
        except PrunusError:
            raise PrunusError(f"distill: unknown student {spec!r}; give keep-every:K, depth:N, width:F, a preset name or a dict "
                              "of model config fields") from None
        student = from_config(teacher, cfg.replace(vocab_size=teacher.config.vocab_size), seed)
    elif isinstance(spec, dict):
        if "vocab_size" in spec and spec["vocab_size"] != teacher.config.vocab_size:
            raise PrunusError(f"distill: student vocab_size {spec['vocab_size']} differs from the teacher's "
                              f"{teacher.config.vocab_size}; logits must share the vocabulary")
        check_known_fields(spec, ModelConfig, "distill: student config")
        student = from_config(teacher, teacher.config.replace(**spec), seed)
    else:
        raise PrunusError(f"distill: student {spec!r}: give keep-every:K, depth:N, width:F, a preset name or a dict of model config fields")
    return student.train()
