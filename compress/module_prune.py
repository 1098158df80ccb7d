"""Structured channel pruning of any ``nn.Module``, through torch-pruning's dependency graph.

torch-pruning traces the module on an example input and groups every tensor that must lose the same channels
together: a conv's output channels with the BatchNorm after it, the next conv's input channels, and every
branch a residual addition joins. Groups are ranked by weight magnitude (``magnitude``: the L2 norm of each
channel of the layer cut), by the group's norm (``group_norm``: every tensor losing the channel) or by the
group's first-order Taylor estimate of the task's loss without the channel (``taylor``: ``|weight * gradient|``
on samples of the training split, :mod:`.prune_taylor`), and the lowest channels cut, until the target:

* ``by: channels``: ``amount`` of every prunable layer's channels removed, in ``ROUNDS`` equal steps with the
  ranking redone after each;
* ``by: params`` / ``by: flops``: pruning goes on in small steps until the parameter count / the FLOPs of
  one forward fall to ``1 - amount`` of the input's (or pruning cannot go on).

Attention keeps its heads; every head loses the same share of its width, so each keeps its own channels:

* an ``nn.MultiheadAttention`` (alone or inside ``nn.TransformerEncoderLayer``) is cut through torch-pruning's
  attention pruner, which narrows the embedding width the layer shares with the residual stream (the rows of
  ``in_proj_weight``'s query, key and value blocks at the same indices, its columns, ``out_proj``). Its heads are
  given to torch-pruning as channel groups, so the same offsets are cut inside every head: a cut at arbitrary
  indices (torch-pruning's default) would leave the heads re-split over channels of other heads.
* a user attention module (an integer ``num_heads`` beside a fused ``qkv`` projection or separate ``q_proj`` /
  ``k_proj`` / ``v_proj``: :func:`prunus.models.module_reshape.attention_projections`) gets torch-pruning's
  ``num_heads``, which cuts the queries, keys and values of every head alike; its integer ``head_dim``, where
  ``head_dim * num_heads`` was the query width, follows.

Whole heads are not removed: ``nn.MultiheadAttention`` computes its heads over the width it shares with the residual
stream, so torch-pruning's ``prune_num_heads`` does not apply to it, and a model dir records only the cut shapes
(``pruned_shapes``), from which a changed head count could not be told apart from narrower heads on reload.
Recurrent layers (``nn.GRU``, ``nn.LSTM``, ``nn.RNN`` and their cells) are refused in one line: torch-pruning has no
GRU / RNN pruner (it leaves them whole) and its LSTM pruner (1.6) keeps ``weight_hh``'s rows of the first gate only and
cuts ``weight_ih`` along its inputs instead of its gates. A layer of the user's own that fails its forward after the cut is named in one line
(:mod:`.prune_failure`). A pass that cuts nothing is refused (nothing is written) unless ``allow_unchanged`` is set.

The layer(s) producing the module's output keep their outputs (a classifier keeps its classes). An optional
fine-tune (``finetune_steps``) then trains the pruned module with the generic trainer on the task's data.
The result is saved with its cut shapes recorded (:mod:`prunus.models.module_reshape`), never pickled.
"""

from __future__ import annotations

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError

PRUNE_BY = ("channels", "params", "flops")
IMPORTANCES = ("magnitude", "group_norm", "taylor")
EXTRA = "prune"
MAX_STEPS = 50  # the steps of a params / flops target
ROUNDS = 5  # the steps of a channels target (the ranking, and taylor's gradients, redone after each)


def torch_pruning():
    """The torch-pruning module, or one line naming the extra that installs it."""
    try:
        import torch_pruning as tp
    except ModuleNotFoundError:
        raise PrunusError(f"channel pruning needs torch-pruning: pip install 'prunus[{EXTRA}]'") from None
    return tp


def output_layers(model: nn.Module, example: torch.Tensor) -> list[nn.Module]:
    """The leaf layers whose output is the module's output (they keep their output channels); the last
    Linear / conv when none is found."""
    seen: dict[int, nn.Module] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.__setitem__(id(o), mod))
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            out = model(example)
    finally:
        for h in hooks:
            h.remove()
    outs = out if isinstance(out, (tuple, list)) else [out]
    found = [seen[id(o)] for o in outs if id(o) in seen]
    if found:
        return found
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
    return layers[-1:]


RECURRENT = (nn.RNNBase, nn.RNNCellBase)


def check_prunable(model: nn.Module) -> None:
    """One line for a layer torch-pruning cannot cut consistently (see the module docstring)."""
    for name, mod in model.named_modules():
        if isinstance(mod, RECURRENT):
            kind = type(mod).__name__
            raise PrunusError(f"prune_channels: layer {name or '(the module)'} is an nn.{kind}, whose hidden size "
                              f"torch-pruning cannot cut (no GRU / RNN pruner; its LSTM pruner breaks the gate "
                              f"weights); use distill_module into a smaller {kind}, or export the module unpruned")


def head_groups(model: nn.Module) -> dict:
    """Each ``nn.MultiheadAttention``'s heads as torch-pruning's channel groups: a width it cuts loses the same
    channels of every head, so each head keeps its own (a cut at arbitrary indices would re-split the rest into
    heads)."""
    return {m: m.num_heads for m in model.modules() if isinstance(m, nn.MultiheadAttention)}


def user_heads(model: nn.Module) -> dict:
    """torch-pruning's ``num_heads`` for each user attention module's query / key / value projections."""
    from prunus.models.module_reshape import attention_projections

    return {p: mod.num_heads for mod, projections in attention_projections(model).items() for p in projections}


def _importance(tp, name: str):
    """``magnitude``: the L2 norm of each channel of the layer being cut; ``group_norm``: the L2 norm over the
    whole group (every tensor that loses the channel), averaged; ``taylor``: ``|weight * gradient|`` of the task's
    loss over the whole group (:mod:`.prune_taylor`)."""
    if name == "magnitude":
        return tp.importance.MagnitudeImportance(p=2, group_reduction="first")
    if name == "taylor":
        return tp.importance.GroupTaylorImportance(group_reduction="mean")
    return tp.importance.GroupMagnitudeImportance(p=2, group_reduction="mean")


def _count(tp, model, example, by: str) -> float:
    flops, params = tp.utils.count_ops_and_params(model, example)
    return float(flops if by == "flops" else params)


def prune_channels(model: nn.Module, example: torch.Tensor, amount: float = 0.5, by: str = "channels",
                   importance: str = "magnitude", taylor=None, rounds: int = ROUNDS) -> dict:
    """Cut ``model``'s channels in place (see the module docstring); returns what it did (counts before/after).
    ``taylor``: the :class:`~.prune_taylor.TaylorBatches` whose gradients ``importance: taylor`` ranks by."""
    from prunus.models.module_reshape import sync_head_dims, tied_head_dims

    tp = torch_pruning()
    if (importance == "taylor") != (taylor is not None):
        raise PrunusError("prune_channels: importance taylor ranks by the gradients of TaylorBatches; pass taylor= "
                          "with it (and only with it)")
    check_prunable(model)
    model.eval()
    keep, tied = output_layers(model, example), tied_head_dims(model)
    before = {k: _count(tp, model, example, k) for k in ("params", "flops")}
    steps = rounds if by == "channels" else MAX_STEPS
    ratio = amount if by == "channels" else 0.95
    try:
        pruner = tp.pruner.MetaPruner(model, example, importance=_importance(tp, importance), pruning_ratio=ratio,
                                      iterative_steps=steps, ignored_layers=keep, global_pruning=False,
                                      out_channel_groups=head_groups(model), in_channel_groups=head_groups(model),
                                      num_heads=user_heads(model))
        for _ in range(steps):
            if taylor is not None:
                taylor.accumulate(model)
            pruner.step()
            sync_head_dims(model, tied)  # before the next round's gradients or count run the module
            if by != "channels" and _count(tp, model, example, by) <= (1 - amount) * before[by]:
                break
    except PrunusError:
        raise
    except Exception as e:  # noqa: BLE001 - a module torch-pruning cannot trace: one line with the reason
        from prunus.models.module_factory import reason

        check_cut_runs(model, example)  # a layer failing after an earlier round's cut is named
        raise PrunusError(f"prune_channels: torch-pruning could not prune the module ({reason(e)}); nothing was "
                          "written; use a module whose forward torch can trace, or another pass") from None
    finally:
        model.zero_grad(set_to_none=True)
    check_cut_runs(model, example)
    after = {k: _count(tp, model, example, k) for k in ("params", "flops")}
    return {"params_before": int(before["params"]), "params_after": int(after["params"]),
            "flops_before": int(before["flops"]), "flops_after": int(after["flops"])}


def check_cut_runs(model: nn.Module, example: torch.Tensor) -> None:
    """One line naming the layer (and its type) that fails its forward after the cut; a cut torch-pruning left
    inconsistent fails here, not in the report's scoring."""
    from prunus.models.module_factory import reason

    from .prune_failure import failing_layer

    failed = failing_layer(model, example)
    if failed is not None:
        name, kind, e = failed
        raise PrunusError(f"prune_channels: layer {name} ({kind}) fails after torch-pruning's cut ({reason(e)}); "
                          "nothing was written; a layer that keeps a size of its own (a head width, a fixed reshape) "
                          "cannot be cut: derive its sizes from its weights' shapes, or use distill_module") from None


def prune_channels_pass(model: nn.Module, ctx, amount: float = 0.5, by: str = "channels",
                        importance: str = "taylor", finetune_steps: int = 0, lr: float = 3e-3,
                        batch_size: int = 32, allow_unchanged: bool = False) -> nn.Module:
    """The ``prune_channels`` pass of a generic module's compress run (``ctx``: a ModuleContext); a module
    left whole is refused unless ``allow_unchanged``."""
    if by not in PRUNE_BY or importance not in IMPORTANCES:
        raise PrunusError(f"prune_channels: by {by!r} / importance {importance!r}; choose by from "
                          f"{', '.join(PRUNE_BY)} and importance from {', '.join(IMPORTANCES)}")
    taylor = None
    if importance == "taylor":
        from .prune_taylor import TaylorBatches

        taylor = TaylorBatches(ctx.train, ctx.task.loss)
    done = prune_channels(model, ctx.example(), amount, by, importance, taylor)
    if done["params_after"] == done["params_before"] and not allow_unchanged:
        raise PrunusError(f"prune_channels: torch-pruning found no channel of {ctx.source} it could cut at amount "
                          f"{amount:g} (params {done['params_before']:,} -> {done['params_after']:,}); nothing was "
                          "written; raise amount, or set allow_unchanged: true to write the module as it is")
    ctx.note(f"params {done['params_before']:,} -> {done['params_after']:,}, "
             f"FLOPs {done['flops_before']:,} -> {done['flops_after']:,}")
    if finetune_steps:
        model = ctx.finetune(model, steps=finetune_steps, lr=lr, batch_size=batch_size)
    return model
