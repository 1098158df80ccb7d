"""A module whose parameters were cut (structured pruning) rebuilt from its factory without pickles.

Structured pruning leaves a module with fewer channels than its factory builds. The model dir records the
shapes that differ (config.json ``pruned_shapes``: ``{state dict name: shape}``, from :func:`shape_changes`);
:func:`apply_shapes` resizes the factory's fresh module to them (each named parameter / buffer replaced by an
empty tensor of the recorded shape, the layer's size attributes - ``out_channels``, ``num_features``,
``in_features``, ... - set to match) so the stored weights then load strictly. An ``nn.MultiheadAttention``
(alone or in an ``nn.TransformerEncoderLayer``) keeps its heads: ``embed_dim`` follows its output projection,
``head_dim`` is ``embed_dim / num_heads`` (a cut that leaves heads of unequal size is refused), ``kdim`` /
``vdim`` follow the key / value projections. A user attention module (an integer ``num_heads`` beside a fused
``qkv`` projection or separate ``q_proj`` / ``k_proj`` / ``v_proj``, :func:`attention_projections`) keeps its heads
too; an integer ``head_dim`` it holds, if ``head_dim * num_heads`` is the query width, follows that width
(:func:`sync_head_dims`).
"""

from __future__ import annotations

import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

MAX_DIMS = 8
# layer attribute -> (state dict entry, dimension) it mirrors
_SIZE_ATTRS = {
    torch.nn.modules.conv._ConvNd: (("out_channels", "weight", 0), ("in_channels", "weight", 1)),
    torch.nn.Linear: (("out_features", "weight", 0), ("in_features", "weight", 1)),
    torch.nn.modules.batchnorm._NormBase: (("num_features", "running_mean", 0), ("num_features", "weight", 0)),
    torch.nn.GroupNorm: (("num_channels", "weight", 0),),
    torch.nn.LayerNorm: (),
    torch.nn.Embedding: (("num_embeddings", "weight", 0), ("embedding_dim", "weight", 1)),
}


def shape_changes(state: torch.nn.Module | dict, reference: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """``{name: shape}`` of every entry of ``state`` (a module or its state dict) whose shape differs from
    ``reference``'s (the factory's)."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    return {k: list(v.shape) for k, v in state.items()
            if k in reference and tuple(v.shape) != tuple(reference[k].shape)}


def check_pruned_shapes(shapes, where: str, fix: str) -> dict:
    """config.json's ``pruned_shapes``: names to lists of sizes (checked, nothing allocated)."""
    if not isinstance(shapes, dict):
        raise PrunusError(f"{where}: pruned_shapes is {short(shapes)}, not an object of name: shape; {fix}")
    for name, shape in shapes.items():
        ok = isinstance(shape, list) and len(shape) <= MAX_DIMS and all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 2**31 for d in shape)
        if not ok:
            raise PrunusError(f"{where}: pruned_shapes[{short(name)}] {short(shape)} is not a list of at most "
                              f"{MAX_DIMS} sizes; {fix}")
    return shapes


def _owner(module: torch.nn.Module, name: str, where: str, fix: str):
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        owner = None
    if owner is None or not (leaf in owner._parameters or leaf in owner._buffers):
        raise PrunusError(f"{where}: pruned_shapes names {short(name)}, which the factory's module does not have; {fix}")
    return owner, leaf


def apply_shapes(module: torch.nn.Module, shapes: dict, where: str, fix: str) -> torch.nn.Module:
    """Resize the entries of ``module`` that ``shapes`` names (see the module docstring); returns it."""
    tied = tied_head_dims(module)
    for name, shape in shapes.items():
        owner, leaf = _owner(module, name, where, fix)
        old = owner._parameters.get(leaf, owner._buffers.get(leaf))
        if old is not None and old.ndim != len(shape):
            raise PrunusError(f"{where}: pruned_shapes[{short(name)}] has {len(shape)} dimensions where the "
                              f"factory's has {old.ndim}; {fix}")
        new = torch.empty(shape, dtype=old.dtype if old is not None else torch.float32)
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(new, requires_grad=old.requires_grad if old is not None else True)
        else:
            owner._buffers[leaf] = new
    for mod in module.modules():
        _sync_sizes(mod)
        if isinstance(mod, torch.nn.MultiheadAttention):
            _sync_attention(mod, where, fix)
    sync_head_dims(module, tied)
    return module


# a user attention module's projections: a fused one (its outputs: queries, keys, values) or one each
FUSED, SEPARATE = ("qkv", "in_proj", "c_attn"), (("q_proj", "k_proj", "v_proj"), ("q", "k", "v"),
                                                  ("query", "key", "value"))


def attention_projections(module: torch.nn.Module) -> dict[torch.nn.Module, list[torch.nn.Linear]]:
    """Every user attention module of ``module`` (not ``nn.MultiheadAttention``): one with an integer
    ``num_heads`` and a fused ``nn.Linear`` ``qkv`` (``in_proj``, ``c_attn``) or separate ``q_proj`` / ``k_proj`` /
    ``v_proj`` (``q`` / ``k`` / ``v``, ``query`` / ``key`` / ``value``), mapped to those projections."""
    found = {}
    for mod in module.modules():
        heads = getattr(mod, "num_heads", None)
        if isinstance(mod, torch.nn.MultiheadAttention) or not isinstance(heads, int) or isinstance(heads, bool):
            continue
        fused = [getattr(mod, n) for n in FUSED if isinstance(getattr(mod, n, None), torch.nn.Linear)]
        separate = [[getattr(mod, n, None) for n in names] for names in SEPARATE]
        separate = [p for p in separate if all(isinstance(x, torch.nn.Linear) for x in p)]
        if fused or separate:
            found[mod] = fused[:1] or separate[0]
    return found


def _query_width(projections: list[torch.nn.Linear]) -> int:
    return projections[0].out_features // (3 if len(projections) == 1 else 1)


def tied_head_dims(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The user attention modules whose integer ``head_dim`` times ``num_heads`` is their query width (``qkv``
    outputs / 3, or ``q_proj`` outputs): the ones :func:`sync_head_dims` keeps so after a cut."""
    return [mod for mod, projections in attention_projections(module).items()
            if isinstance(getattr(mod, "head_dim", None), int) and not isinstance(mod.head_dim, bool)
            and mod.head_dim * mod.num_heads == _query_width(projections)]


def sync_head_dims(module: torch.nn.Module, tied: list[torch.nn.Module]) -> None:
    """Each module of ``tied`` (:func:`tied_head_dims`, taken before the cut) keeps its heads; its ``head_dim``
    follows its (cut) query width."""
    projections = attention_projections(module)
    for mod in tied:
        width = _query_width(projections[mod])
        if width % mod.num_heads == 0:
            mod.head_dim = width // mod.num_heads


def _sync_attention(mha: torch.nn.MultiheadAttention, where: str, fix: str) -> None:
    """An attention layer's sizes from its (resized) projections (see the module docstring)."""
    embed = int(mha.out_proj.weight.shape[0])
    if embed % mha.num_heads:
        raise PrunusError(f"{where}: pruned_shapes give an attention layer embed_dim {embed}, which its "
                          f"{mha.num_heads} heads do not divide; {fix}")
    mha.embed_dim, mha.head_dim = embed, embed // mha.num_heads
    if mha._qkv_same_embed_dim:
        mha.kdim = mha.vdim = int(mha.in_proj_weight.shape[1])
    else:
        mha.kdim, mha.vdim = int(mha.k_proj_weight.shape[1]), int(mha.v_proj_weight.shape[1])


def _sync_sizes(mod: torch.nn.Module) -> None:
    """A layer's size attributes set from its (resized) tensors."""
    for kind, attrs in _SIZE_ATTRS.items():
        if not isinstance(mod, kind):
            continue
        for attr, entry, dim in attrs:
            if isinstance(mod, torch.nn.modules.conv._ConvNd) and mod.groups > 1 and mod.weight.shape[1] == 1 \
                    and not mod.transposed:  # depthwise: one group per channel, as many as remain
                mod.groups = mod.in_channels = mod.out_channels = int(mod.weight.shape[0])
                break
            t = getattr(mod, entry, None)
            if isinstance(t, torch.Tensor) and t.ndim > dim:
                size = t.shape[dim]
                if attr == "in_channels" and isinstance(mod, torch.nn.modules.conv._ConvNd):
                    size = t.shape[dim] * mod.groups if not mod.transposed else t.shape[0]
                if attr == "out_channels" and isinstance(mod, torch.nn.modules.conv._ConvNd) and mod.transposed:
                    size = t.shape[1] * mod.groups
                setattr(mod, attr, int(size))
        if isinstance(mod, torch.nn.LayerNorm) and mod.weight is not None:
            mod.normalized_shape = tuple(mod.weight.shape)
