"""The model dir: ``config.json`` + ``model.safetensors`` + ``prunus.json`` (the manifest).

Every stage reads one and writes one. The manifest records which stage wrote
the dir, from which parent (path and content hash), the exact command, metrics
and versions, and the SHA-256 of every file it vouches for; ``load_model``
checks them, so a changed or truncated file is caught before it is used.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prunus.artifacts.atomic import atomic_dir, atomic_write_json
from prunus.artifacts.contained import inside
from .compression_state import CompressionState, compression_state, set_compression_state
from .config import ModelConfig
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.manifest_schema import sha256_file  # noqa: F401 (re-exported: readers of model dirs import it here)
from prunus.artifacts.safetensors_header import check_shapes, read_header
from .llama import Transformer
from .model_dir_fit import check_config_fits_header, check_dtype_kinds
from .spec import TRANSFORMER, get_spec
from .model_dir_manifest import (CONFIG, FORMAT, MANIFEST, WEIGHTS, dir_hash, parent_entry, read_config_json,  # noqa: F401
                                 read_manifest, verify_model_dir, versions, write_manifest)
from .quant_registry import count_params, quantized_layout
from .tokenizer import check_vocab, load_tokenizer


def state_dict_for_save(model: Transformer) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("output.weight", None)  # stored once, as tok_embeddings.weight
    return sd


def save_model(
    model: Transformer,
    path: str | Path,
    *,
    tokenizer=None,
    stage: str,
    parent: str | Path | None = None,
    metrics: dict | None = None,
    overwrite: bool = False,
    command: str | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write ``model`` as a model dir at ``path``, atomically.

    The model's CompressionState (quantized modules, sparsity, passes; ``compression_state.py``),
    when it holds anything, goes into config.json; ``extra_files`` (name -> bytes: a recipe, a report) are written
    alongside and covered by the manifest's hashes."""
    path = Path(path)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
    check_vocab(tokenizer, model.config.vocab_size, getattr(tokenizer, "path", path))
    parent_info = parent_entry(parent)
    with atomic_dir(path, overwrite=overwrite) as tmp:
        stored_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        model_cfg = model.config.replace(dtype=stored_dtype).to_dict()
        config = {"format": FORMAT, "architecture": "llama", "model": model_cfg, "tokenizer": tokenizer.spec()}
        compression = compression_state(model).to_json()
        if compression:
            config["compression"] = compression
        if getattr(model, "hf_origin", None):  # a Hugging Face family's model_type and token ids (hf_convert)
            config["hf"] = model.hf_origin
        atomic_write_json(tmp / CONFIG, config)
        save_file(state_dict_for_save(model), tmp / WEIGHTS, metadata={"format": "pt"})
        tokenizer.save(tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        write_manifest(tmp, stage=stage, parent_info=parent_info, command=command,
                       metrics={"params": count_params(model), **(metrics or {})})
    return path


def read_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """The transformer's ModelConfig and config.json; one line for a generic module dir (``"kind": "module"``)."""
    config = read_config_json(path)
    cpath = Path(path) / CONFIG
    if "kind" in config:
        from .module_dir import not_a_transformer

        raise not_a_transformer(path, config)
    if not isinstance(config.get("model"), dict):
        raise PrunusError(f"{cpath}: has no 'model' object; re-create the model dir")
    return ModelConfig.from_dict(config["model"], source=str(cpath)), config


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               verify: bool = True, placement=None, trust_factory=None) -> Transformer:
    """Rebuild the module from a model dir. ``verify`` checks file hashes against the manifest.

    ``placement`` (a device map, prunus.serve.device_map): ``name -> device`` for each stored tensor, read one by
    one from the memory-mapped file to that device; None leaves it on the meta device (streamed from the file
    at each forward). ``device`` then holds the buffers.

    Another kind's dir is read by its spec's loader (:mod:`.spec`): a generic module dir (config.json ``"kind":
    "module"``, :mod:`.module_dir`) is rebuilt by importing its
    factory, which runs code: only when ``trust_factory`` trusts it (True, the spec or a list of specs,
    :func:`~.module_factory.is_trusted`); None (the default) means the caller reads transformer dirs only.
    A config.json without ``kind`` is the transformer."""
    path = Path(path)
    if verify:
        verify_model_dir(path)
    spec = get_spec((config := read_config_json(path)).get("kind"))
    if spec.name != TRANSFORMER:  # another kind's loader (a generic module: module_dir.load_module)
        return spec.load("model_dir_loader")(path, config, trust_factory=trust_factory, device=device, dtype=dtype)
    cfg, config = read_config(path)
    compression = CompressionState.from_json(config.get("compression"), source=str(path / CONFIG))
    weights = inside(path, WEIGHTS, fix="re-create the model dir")  # inside the dir, a regular file
    header = read_header(weights)  # prunus.artifacts.safetensors_header
    check_config_fits_header(cfg, header, str(path / CONFIG))  # before any module is built (.model_dir_fit)
    with torch.device("meta"):
        model = Transformer(cfg)
        quantized_layout(model, compression.quantized_modules)
    expected = model.state_dict()
    check_shapes(weights, header, {k: tuple(v.shape) for k, v in expected.items()})
    check_dtype_kinds(weights, header, expected)
    state = load_file(weights, device=str(device)) if placement is None else _placed(weights, placement)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    streamed = set() if placement is None else set(expected) - set(state)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "output.weight") and k not in streamed]
    if missing or unexpected:
        raise PrunusError(f"{path / WEIGHTS}: weights do not match config.json (missing {missing[:3]}, unexpected {unexpected[:3]}); re-create the model dir")
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_buffers(device=torch.device(device))
    set_compression_state(model, compression)
    if config.get("hf"):
        model.hf_origin = config["hf"]
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _placed(weights: Path, placement) -> dict:
    """The stored tensors ``placement`` puts on a device, each read from the memory-mapped file to it."""
    from safetensors import safe_open

    state = {}
    with safe_open(weights, framework="pt") as f:
        for name in f.keys():
            device = placement(name)
            if device is not None:
                state[name] = f.get_tensor(name).to(device)
    return state


def load_model_tokenizer(path: str | Path):
    """The model dir's tokenizer, checked against the model's vocab_size."""
    cfg, config = read_config(path)
    tokenizer = load_tokenizer(config.get("tokenizer"), base_dir=path)
    check_vocab(tokenizer, cfg.vocab_size, path)
    return tokenizer


def update_manifest_metrics(path: str | Path, metrics: dict) -> dict:
    """Merge ``metrics`` into the manifest (prunus eval records its figures here)."""
    manifest = read_manifest(path)
    manifest.setdefault("metrics", {}).update(metrics)
    atomic_write_json(Path(path) / MANIFEST, manifest)
    return manifest
