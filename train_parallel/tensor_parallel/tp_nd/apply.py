"""Apply 2D / 2.5D / 3D tensor parallelism to the unmodified model, and check a layout against the model.

Every ``nn.Linear`` of the blocks and the head, the embedding and every norm is swapped for its grid
layer (:mod:`.layers`) holding its shard of the weight; names and shapes of the parameters (as
DTensors) stay those of the model. The model's own forward runs unchanged on the local activations: the
attention core sees this rank's whole sequences and its heads. The loss is the grid's
vocabulary-parallel cross-entropy (``Parallelized.loss_fn``).
"""

from __future__ import annotations

from prunus.artifacts.errors import PrunusError

from .shape import GRID_DIMS, grid_side, row_split

# linears whose input is in the cube's second layout (the outputs of wq/wk/wv/w1/w3): wo and w2
_FLIPPED = ("wo", "w2")


def make_grid(mode: str, mesh):
    from .cube_3d import Cube3D
    from .summa_2d import Summa2D
    from .tesseract_2p5d import Tesseract2p5D

    return {"2d": Summa2D, "2.5d": Tesseract2p5D, "3d": Cube3D}[mode](mesh)


def grid_mesh(world_mesh, mode: str):
    """The grid's mesh: the dims of ``mode`` the world mesh holds (a 2.5d depth of 1 is left out)."""
    names = tuple(n for n in GRID_DIMS[mode] if n in (world_mesh.mesh_dim_names or ()))
    return world_mesh[names]


def apply_tp_nd(model, mode: str, mesh):
    """Swap ``model``'s linears, embedding and norms for ``mode``'s grid layers on ``mesh``; returns the grid."""
    from torch import nn

    from .layers import GridEmbedding, GridLinear, GridRMSNorm

    grid = make_grid(mode, mesh)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            label = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear):
                new = GridLinear(child, grid, flip=child_name in _FLIPPED, label=label)
            elif isinstance(child, nn.Embedding):
                new = GridEmbedding(child, grid, label=label)
            elif child_name.endswith("norm") and hasattr(child, "weight") and hasattr(child, "eps"):
                new = GridRMSNorm(child, grid, label=label)
            else:
                continue
            setattr(module, child_name, new)
    if model.config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # both split as the head's weight
    return grid


def validate_tp_nd(mode: str, tp: int, depth: int, dims, cfg, model_cfg) -> None:
    """Refuse, in one line, what the grid cannot split or does not compose with (before any process starts)."""
    if mode == "1d" or tp == 1:
        return
    flag = f"--tp-mode {mode}"
    if dims.pp > 1 or dims.cp > 1:
        raise PrunusError(f"{flag} does not compose with --pp or --cp; use --tp-mode 1d for those layouts")
    if dims.dp > 1:
        raise PrunusError(f"{flag} trains with tensor parallelism alone: make --tp equal the world size "
                          f"({dims.world_size}), or use --tp-mode 1d with data parallelism")
    if getattr(cfg, "lora_rank", 0):
        raise PrunusError(f"{flag} does not compose with --lora-rank; use --tp-mode 1d for LoRA fine-tuning")
    from prunus.data.instruct import is_instruct_path

    if is_instruct_path(getattr(cfg, "data", None)):
        raise PrunusError(f"{flag} trains on plain token streams; use --tp-mode 1d for packed instruction data "
                          f"({cfg.data})")
    if model_cfg.n_experts or model_cfg.qk_norm:
        raise PrunusError(f"{flag} splits dense models without per-head q/k norms; use --tp-mode 1d for this model")
    q = grid_side(mode, tp, depth)
    out_parts = q * q if mode == "3d" else q  # 3d splits the output features of a weight over two faces
    for name in ("dim", "ffn_dim", "vocab_size"):
        if getattr(model_cfg, name) % out_parts:
            raise PrunusError(f"{flag} --tp {tp}: the model's {name} ({getattr(model_cfg, name)}) is not divisible by "
                              f"{out_parts}; choose another degree or mode")
    for name in ("n_heads", "n_kv_heads"):
        if getattr(model_cfg, name) % q:
            raise PrunusError(f"{flag} --tp {tp}: the model's {name} ({getattr(model_cfg, name)}) is not divisible by "
                              f"the grid side {q}; choose another degree or mode")
    if mode == "3d" and (model_cfg.n_kv_heads * model_cfg.head_dim) % out_parts:
        raise PrunusError(f"{flag} --tp {tp}: the model's key/value width (n_kv_heads x head_dim = "
                          f"{model_cfg.n_kv_heads * model_cfg.head_dim}) is not divisible by {out_parts}; "
                          "choose another degree or mode")
    parts, per_step = row_split(mode, tp, depth), cfg.batch_size // cfg.grad_accum
    if per_step % parts:
        raise PrunusError(f"{flag} --tp {tp} splits every micro-batch into {parts} parts by sequences: --batch-size / "
                          f"--grad-accum ({per_step}) must be a multiple of {parts}")
