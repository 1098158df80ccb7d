"""Fine-tuning's starting point: the weights of a prunus model dir (``prunus train --init-from DIR``).

The dir's ``config.json`` defines the architecture (:func:`init_model_config`); a ``--preset`` or
model flag that disagrees with it is refused in one line (:func:`check_architecture`). The model is
built on the meta device and the layout (TP / SP, PP stages, FSDP, EP) is applied to it before any
weight exists; then :func:`load_init_weights` allocates each part on the device and reads **only
this rank's slices** of ``model.safetensors``: torch.distributed.checkpoint's
``HuggingFaceStorageReader`` plans the load from each parameter's DTensor placements and reads every
slice with ``safe_open(...).get_slice`` (the same planner that reloads sharded checkpoints under any
layout, so FSDP's strided shards under TP are sliced correctly too). No rank holds the whole model
when it is sharded. Replicated layouts (one process, DDP) read the whole file, as they must.

The learning-rate schedule, the optimizer and the step start at 0; ``--resume`` of a fine-tuning run
loads its own checkpoint instead (the init dir is not read again).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from prunus.artifacts.errors import PrunusError
from prunus.models.config import ModelConfig, get_preset
from prunus.models.model_dir import WEIGHTS, read_config, read_manifest

from .checkpoint import _quiet

_PARTIAL = StateDictOptions(strict=False)


def init_model_config(init_from: str | Path) -> ModelConfig:
    """The architecture of the model dir ``init_from`` (its config.json); read once per version of the file
    (TrainConfig.model_config() is asked often: every step's token count goes through it)."""
    path = Path(init_from)
    try:
        stamp = (path / "config.json").stat().st_mtime_ns
    except OSError:
        stamp = None
    return copy.copy(_read_init_config(str(path), stamp))  # callers get their own value


@lru_cache(maxsize=8)
def _read_init_config(init_from: str, stamp: int | None) -> ModelConfig:
    path = Path(init_from)
    try:
        read_manifest(path)  # one line when this is no prunus model dir
    except PrunusError as e:
        raise PrunusError(f"--init-from {e}") from None
    if not (path / WEIGHTS).is_file():
        raise PrunusError(f"--init-from {path}: no {WEIGHTS}; give a model dir written by prunus train, compress or convert")
    _check_weights_file(path)
    return read_config(path)[0]


def init_is_quantized(init_from: str | Path) -> bool:
    """Whether the dir's weights are stored quantized (int8 / fp8 / int4: a QLoRA base, loaded whole by load_model)."""
    from prunus.models.compression_state import CompressionState

    config_path = Path(init_from) / "config.json"
    return bool(CompressionState.from_json(read_config(init_from)[1].get("compression"), source=str(config_path)).quantized_modules)


def init_hf_origin(init_from: str | Path) -> dict | None:
    """The Hugging Face family a converted dir came from (config.json's ``hf``), kept by the fine-tuned model dir."""
    return read_config(init_from)[1].get("hf")


def run_tokenizer(cfg, vocab_size: int):
    """The run's tokenizer: ``--tokenizer``, else the ``--init-from`` dir's, else bytes. With both, their
    vocabularies must agree (data tokenized for another model trains on the wrong ids): one line otherwise."""
    from prunus.models import load_tokenizer
    from prunus.models.model_dir import load_model_tokenizer
    from prunus.models.tokenizer import check_vocab

    if cfg.init_from is None:
        return load_tokenizer(cfg.tokenizer)
    own = load_model_tokenizer(cfg.init_from)
    if cfg.tokenizer is None:
        return own
    given = load_tokenizer(cfg.tokenizer)
    if given.n_vocab != own.n_vocab:
        raise PrunusError(f"--tokenizer {cfg.tokenizer} has {given.n_vocab} tokens but --init-from {cfg.init_from}'s "
                          f"tokenizer has {own.n_vocab}; drop --tokenizer to use the model's own")
    check_vocab(given, vocab_size, cfg.tokenizer)
    return given


class _WeightsReader(HuggingFaceStorageReader):
    """DCP's safetensors reader over the model dir's own ``model.safetensors`` only: the stock reader takes every
    ``*.safetensors`` it lists in the dir, a planted or symlinked one included."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        weights = str(path / WEIGHTS)
        ls = self.fs.ls
        self.fs.ls = lambda p: [f for f in ls(p) if f == weights]


def _check_weights_file(init_from: Path) -> None:
    """``model.safetensors`` is a regular file of the dir itself, not a link to another model's weights."""
    weights = init_from / WEIGHTS
    if weights.is_symlink() or not weights.resolve().is_relative_to(init_from.resolve()) or not weights.is_file():
        raise PrunusError(f"--init-from {init_from}: {WEIGHTS} is not a regular file inside the dir; "
                          "copy the weights into it")


def _differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [k for k in da if da[k] != db.get(k)]


def check_architecture(init_cfg: ModelConfig, init_from: str, preset: str | None, overrides: dict) -> None:
    """Refuse a ``--preset`` or model flags that describe another model than the ``--init-from`` dir's."""
    if preset is not None:
        diff = [k for k in _differences(get_preset(preset), init_cfg) if k != "max_seq_len"]
        if diff:
            shown = ", ".join(f"{k} {getattr(get_preset(preset), k)} vs {getattr(init_cfg, k)}" for k in diff[:3])
            raise PrunusError(f"--init-from {init_from}: its architecture differs from --preset {preset} ({shown}); "
                              "drop --preset: the model dir's config.json defines the model")
    bad = {k: v for k, v in (overrides or {}).items() if getattr(init_cfg, k, object()) != v}
    if bad:
        k, v = next(iter(bad.items()))
        raise PrunusError(f"--init-from {init_from}: model setting {k}={v!r} differs from its config.json "
                          f"({getattr(init_cfg, k, None)!r}); drop the model flags")


def _materialize(part: torch.nn.Module, device: torch.device) -> None:
    """Storage for a meta-built part on ``device`` (values undefined until loaded), its tied head re-tied."""
    if any(p.is_meta for p in part.parameters()) or any(b.is_meta for b in part.buffers()):
        part.to_empty(device=device)
    inner = getattr(part, "module", part)  # DDP's wrapped module
    tok, out = getattr(inner, "tok_embeddings", None), getattr(inner, "output", None)
    if inner.config.tie_embeddings and tok is not None and out is not None:
        out.weight = tok.weight
    inner.init_buffers(device=device)


def load_init_weights(parts: list[torch.nn.Module], init_from: str | Path, device: torch.device,
                      load: bool = True) -> list[str]:
    """Fill ``parts`` (this rank's model parts, parallelized, possibly on the meta device) from ``init_from``;
    returns the names of parameters the file does not hold (LoRA adapters: see :func:`reset_adapters`).

    One ``dcp.load`` per rank (a collective when distributed): every part's state in one dict; each
    key is a whole-model parameter name, so pipeline stages never collide. ``load=False`` only allocates
    (a resumed run's checkpoint fills the parts)."""
    from prunus.artifacts.safetensors_header import read_header

    for part in parts:
        _materialize(part, device)
    stored = set(read_header(Path(init_from) / WEIGHTS)) - {"__metadata__"}
    states = [get_model_state_dict(part) for part in parts]
    merged: dict = {}
    for part, state in zip(parts, states):
        inner = getattr(part, "module", part)
        if inner.config.tie_embeddings:
            state.pop("output.weight", None)  # stored once, as tok_embeddings.weight
        merged.update({k: v for k, v in state.items() if k in stored})
    missing = sorted(k for state in states for k in state if k not in stored)
    if not load:
        return missing
    try:
        with _quiet():
            dcp.load(merged, storage_reader=_WeightsReader(Path(init_from)),
                     no_dist=not (dist.is_available() and dist.is_initialized()))
    except Exception as e:  # DCP wraps every reader error in its own exception types
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise PrunusError(f"--init-from {init_from}: its {WEIGHTS} does not fit its config.json ({reason}); "
                          "re-create the model dir") from None
    for part, state in zip(parts, states):
        set_model_state_dict(part, {k: merged[k] for k in state if k in merged}, options=_PARTIAL)
        inner = getattr(part, "module", part)
        if inner.config.tie_embeddings and inner.output is not None and inner.tok_embeddings is not None:
            inner.output.weight = inner.tok_embeddings.weight
    return missing


def _plain_name(name: str) -> str:
    """A module's name in the unwrapped model (activation checkpointing and DDP add prefixes)."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


@torch.no_grad()
def reset_adapters(parts: list[torch.nn.Module], cfg) -> None:
    """Give LoRA adapters built on the meta device their initial values (A from the seed and the module's
    name, B zero: as ``lora.apply_lora`` draws them on a real device), sliced to each rank's placements."""
    if not getattr(cfg, "lora_rank", 0):
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ..lora import _initial_A

    for part in parts:
        for name, module in part.named_modules():
            adapter = getattr(module, "lora", None)
            if adapter is None or not hasattr(adapter, "A"):
                continue
            full_A = _initial_A(_plain_name(name), cfg.lora_rank, module.in_features, cfg.seed)
            for p, full in ((adapter.A, full_A), (adapter.B, torch.zeros(adapter.B.shape))):
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements).to_local())
                else:
                    p.copy_(full)
