"""A model dir holding any ``torch.nn.Module``: the general case; the transformer's is a specialisation.

* ``config.json``: ``{"format", "kind": "module", "factory": "package.module:callable", "args": {...},
  "task": ..., "input": {"shape": [...], "dtype": ...}}``: how to rebuild the module (its factory and JSON
  arguments, never a pickle), the task it was trained for (:mod:`.tasks`), and the shape of one input
  sample (what export traces and probes with);
* ``model.safetensors``: the state dict, persistent buffers included (BatchNorm's running statistics);
* ``prunus.json``: the manifest, written by the one writer every model dir uses (:func:`.model_dir_manifest.write_manifest`).

Loading imports the factory, which runs its module's code: :func:`load_module` does so only when the caller
trusts that factory (:func:`.module_factory.check_trusted`); before, the config is checked, and after building
(before any weight is read), every stored tensor's name, shape and dtype kind against the module's state dict.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prunus.artifacts.atomic import atomic_dir, atomic_write_json
from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.safetensors_header import check_shapes, read_header
from prunus.artifacts.validate import check_known_fields, short

from .class_labels import LABELS
from .model_dir_manifest import FORMAT, WEIGHTS, parent_entry, read_config_json, write_manifest
from .module_factory import ModuleFactory, build_module, check_args, check_trusted, parse_spec
from .tasks import check_task_name

KIND = "module"
FIX = "re-create the model dir"
INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")
MAX_INPUT_DIMS, MAX_INPUT_SIZE = 8, 2**24
_KEYS = ("format", "kind", "factory", "args", "task", "input", "pruned_shapes")


def carried_files(model_dir: str | Path) -> dict[str, bytes]:
    """The files of a generic model dir that every dir made from it carries along (name -> bytes): a table's
    ``labels.json``, so that eval and serve map classes as training did. Bounded reads; nothing else."""
    from prunus.artifacts.validate import read_text

    path = inside(model_dir, LABELS, fix=FIX, required=False)
    return {} if path is None else {LABELS: read_text(path, fix=FIX).encode()}


def input_spec(sample: torch.Tensor, high: int | None = None) -> dict:
    """config.json's ``input`` for one sample (no batch dimension); ``high`` bounds integer inputs (exclusive)."""
    spec = {"shape": list(sample.shape), "dtype": str(sample.dtype).removeprefix("torch.")}
    if high is not None:
        spec["high"] = int(high)
    return spec


def _check_input(spec, where: str) -> dict | None:
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise PrunusError(f"{where}: 'input' is {short(spec)}, not an object; {FIX}")
    check_known_fields(spec, ("shape", "dtype", "high"), f"{where}: input", fix=FIX)
    shape, dtype, high = spec.get("shape"), spec.get("dtype"), spec.get("high")
    ok = isinstance(shape, list) and len(shape) <= MAX_INPUT_DIMS and all(
        isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_INPUT_SIZE for d in shape)
    if not ok:
        raise PrunusError(f"{where}: input shape {short(shape)} must be a list of at most {MAX_INPUT_DIMS} sizes "
                          f"from 1 to {MAX_INPUT_SIZE}; {FIX}")
    if dtype not in INPUT_DTYPES:
        raise PrunusError(f"{where}: input dtype {short(dtype)} is not one of {', '.join(INPUT_DTYPES)}; {FIX}")
    if high is not None and not (isinstance(high, int) and not isinstance(high, bool) and 1 <= high <= 2**31):
        raise PrunusError(f"{where}: input high {short(high)} must be an integer from 1 to 2**31; {FIX}")
    return spec


def check_module_config(config: dict, path: str | Path) -> dict:
    """config.json of a generic module dir, every field checked (nothing imported); returns it."""
    where = str(Path(path) / "config.json")
    if config.get("kind") != KIND:
        raise PrunusError(f"{where}: kind {short(config.get('kind'))} is not one prunus writes ('module', or no kind "
                          f"for the transformer); {FIX}")
    check_known_fields(config, _KEYS, where, what="key", fix=FIX)
    parse_spec(config.get("factory"), f"{where}: factory")
    check_args(config.get("args", {}), f"{where}: args")
    if config.get("task") is not None:
        check_task_name(config["task"], f"{where}: task")
    _check_input(config.get("input"), where)
    if config.get("pruned_shapes") is not None:
        from .module_reshape import check_pruned_shapes

        check_pruned_shapes(config["pruned_shapes"], where, FIX)
    return config


def read_module_config(path: str | Path) -> dict:
    """The checked config.json of the generic module dir at ``path``."""
    return check_module_config(read_config_json(path), path)


def not_a_transformer(path: str | Path, config: dict) -> PrunusError:
    """What a reader of transformer dirs says of a generic module dir (or a config of an unknown kind)."""
    if config.get("kind") != KIND:
        check_module_config(config, path)  # raises: the kind line
    return PrunusError(f"{path}: holds a generic module (factory {short(config.get('factory'))}), not a transformer; "
                       "this reads transformer model dirs only (generic modules: prunus train --model, prunus export, "
                       "load_model(dir, trust_factory=...))")


def _stored_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as safetensors stores it: contiguous CPU tensors, a tensor shared by two names copied."""
    seen, out = set(), {}
    for name, value in module.state_dict().items():
        t = value.detach().cpu()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in seen or not t.is_contiguous() else t
        seen.add(storage)
    return out


def save_module(module: torch.nn.Module, path: str | Path, *, stage: str, factory: ModuleFactory | None = None,
                task: str | None = None, input: dict | None = None, parent: str | Path | None = None,
                metrics: dict | None = None, overwrite: bool = False, command: str | None = None,
                pruned_shapes: dict | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write ``module`` (plain, not wrapped by DDP / FSDP) as a generic model dir at ``path``, atomically.

    ``factory``: how to rebuild it; default the one :func:`~.module_factory.build_module` attached.
    ``pruned_shapes``: the entries whose shapes differ from the factory's (:mod:`.module_reshape`);
    ``extra_files``: more files of the dir (name -> bytes), covered by the manifest."""
    factory = factory or getattr(module, "prunus_factory", None)
    if not isinstance(factory, ModuleFactory):
        raise PrunusError(f"{path}: the module carries no factory spec, so a model dir could not rebuild it; build it "
                          "with prunus.models.module_factory.build_module or pass factory=ModuleFactory(spec, args)")
    config = check_module_config({"format": FORMAT, "kind": KIND, **factory.to_json(), "task": task,
                                  "input": input, **({"pruned_shapes": pruned_shapes} if pruned_shapes else {})}, path)
    parent_info = parent_entry(parent)
    state = _stored_state(module)
    n_params = sum(p.numel() for p in module.parameters())
    with atomic_dir(path, overwrite=overwrite) as tmp:
        atomic_write_json(tmp / "config.json", config)
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        write_manifest(tmp, stage=stage, parent_info=parent_info, command=command,
                       metrics={"params": n_params, **(metrics or {})})
    return Path(path)


def _check_weights(weights: Path, header: dict, expected: dict[str, torch.Tensor]) -> None:
    """Stored names exactly the module's state dict, each of its shape and dtype kind."""
    from .model_dir_fit import check_dtype_kinds

    missing = [k for k in expected if k not in header]
    unexpected = [k for k in header if k not in expected]
    if missing or unexpected:
        raise PrunusError(f"{weights}: the weights do not fit the module the factory builds (missing "
                          f"{short(missing[:3])}, unexpected {short(unexpected[:3])}); {FIX}")
    check_shapes(weights, header, {k: tuple(v.shape) for k, v in expected.items()})
    check_dtype_kinds(weights, header, expected)


def load_module(path: str | Path, config: dict | None = None, *, trust_factory=None,
                device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The module of the generic model dir at ``path`` (its manifest already verified), weights loaded
    strictly, in eval mode. The factory is imported only when ``trust_factory`` trusts it."""
    path = Path(path)
    config = check_module_config(config if config is not None else read_module_config(path), path)
    if trust_factory is None:
        raise not_a_transformer(path, config)
    check_trusted(config["factory"], trust_factory, str(path))
    weights = inside(path, WEIGHTS, fix=FIX)  # inside the dir, a regular file
    header = read_header(weights)  # bounded and validated before the factory runs
    module = build_module(config["factory"], config.get("args", {}), source=f"{path}: factory")
    if config.get("pruned_shapes"):
        from .module_reshape import apply_shapes

        apply_shapes(module, config["pruned_shapes"], str(path / "config.json"), FIX)
    _check_weights(weights, header, module.state_dict())
    module.load_state_dict(load_file(weights), strict=True)
    module.to(device)
    if dtype is not None:
        module.to(dtype)
    return module.eval()
