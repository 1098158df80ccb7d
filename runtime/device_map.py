"""Device-map inference for models larger than one device (Hugging Face Accelerate's ``device_map="auto"``).

``Engine.load(path, device_map="auto", max_memory={0: "10GiB", "cpu": "30GiB"})`` places the model's modules,
in order, on the GPUs (by id), then the CPU, then the disk, each within its budget;
``device_map={"layers.0": "cpu", ...}`` places them by hand. A module on the disk keeps its weights in the model
dir's ``model.safetensors``: they are read for each forward (:class:`DiskWeights`), on the main device (the first GPU,
else the CPU), and dropped after it, so a model larger than the memory given still generates the same tokens.
Activations (and the rotary tables, the KV-cache indices and mask) move to each module's device in a forward
pre-hook; each block's KV cache lives on its block's device; the logits come back to the input's device.

:func:`infer_device_map` is Accelerate's ``infer_auto_device_map`` algorithm (modules taken in order, split into
children when they do not fit unless their class is in ``no_split``, tied weights kept together, and room for
the largest remaining layer kept on the main devices), written for any ``nn.Module`` and checked against
Accelerate's own on the same model (tests/test_device_map.py). Not ported: ``fallback_allocation``, ``dtype``
and ``special_dtypes`` (prunus loads weights in their stored dtypes).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict, defaultdict
from pathlib import Path

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError

NO_SPLIT = ("TransformerBlock",)  # residual blocks stay whole
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}


def parse_size(value) -> int:
    """Bytes of ``value``: an int, or "10GiB" / "500MB" / "123" (Accelerate's units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise PrunusError(f"max_memory: {value!r} is not a size; write bytes or e.g. 10GiB, 500MB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def _device_key(key):
    """0 / "0" / "cuda:0" -> 0; "cpu", "disk" stay; anything else is one line."""
    if isinstance(key, int) and not isinstance(key, bool):
        index = key
    elif isinstance(key, str) and key in ("cpu", "disk"):
        return key
    elif isinstance(key, str) and re.fullmatch(r"(cuda:)?\d+", key):
        index = int(key.split(":")[-1])
    else:
        raise PrunusError(f"device {key!r} is not a device: use a CUDA index (0, 1, ...), cpu or disk")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= index < n:
        raise PrunusError(f"device {key!r} does not exist: this machine has {n} CUDA device(s); use cpu or disk")
    return index


def parse_max_memory(spec) -> dict:
    """``{0: "10GiB", "cpu": "30GiB"}`` or the CLI's "0=10GiB,cpu=30GiB" -> {device: bytes}, GPUs first (by
    id), then cpu, then disk (Accelerate's order)."""
    if isinstance(spec, str):
        pairs = [part.split("=", 1) for part in spec.split(",") if part.strip()]
        if any(len(p) != 2 for p in pairs) or not pairs:
            raise PrunusError(f"--max-memory {spec!r}: write DEVICE=SIZE pairs, e.g. 0=10GiB,cpu=30GiB")
        spec = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(spec, dict) or not spec:
        raise PrunusError("max_memory: give a dict {device: size}, e.g. {0: '10GiB', 'cpu': '30GiB'}")
    memory = {_device_key(k): parse_size(v) for k, v in spec.items()}
    order = sorted(k for k in memory if isinstance(k, int)) + [k for k in ("cpu", "disk") if k in memory]
    return OrderedDict((k, memory[k]) for k in order)


def module_sizes(model: nn.Module) -> dict[str, int]:
    """Bytes under every module name ("" the whole model): parameters (a tied one once) and buffers."""
    sizes: dict[str, int] = defaultdict(int)  # a module holding only a tied weight: 0
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        parts = name.split(".")
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            sizes[key] += t.numel() * t.element_size()
    return sizes


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied embeddings), each sorted."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


def _max_layer(modules, sizes, no_split) -> tuple[int, list[str]]:
    """The largest layer (a leaf module or a no-split one) among ``modules``, and the names of that size."""
    best, names, todo = 0, [], list(modules)
    while todo:
        name, module = todo.pop(0)
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split:
            if sizes[name] > best:
                best, names = sizes[name], [name]
            elif sizes[name] == best:
                names.append(name)
        else:
            todo = [(f"{name}.{n}", m) for n, m in children] + todo
    return best, names


def _children(name, module):
    if not isinstance(module, nn.Module):
        return []
    return [(f"{name}.{n}", v) for n, v in list(module.named_parameters(recurse=False)) + list(module.named_children())]


def _with_ties(name: str, size: int, ties: list[list[str]], sizes: dict, todo: list) -> tuple[int, list[str]]:
    """The size of module ``name`` with the modules holding the other ends of its tied weights."""
    tied = [p for group in ties if any(name + "." in k + "." for k in group) and not all(name + "." in k + "." for k in group)
            for p in group if name + "." not in p + "."]
    names = []
    for param in tied:
        owner = next(n for n, _ in todo if param.startswith(n + "."))
        names.append(owner)
        size += sizes[owner] - sizes[param]
    return size, names


def infer_device_map(model: nn.Module, max_memory: dict, no_split=NO_SPLIT) -> "OrderedDict[str, object]":
    """{module name: device} within ``max_memory`` (parsed: :func:`parse_max_memory`); see the module docstring."""
    devices = list(max_memory) + ([] if "disk" in max_memory else ["disk"])
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main = [gpus[0], "cpu"] if gpus else ["cpu"]
    sizes, ties = module_sizes(model), tied_parameters(model)
    todo = list(model.named_parameters(recurse=False)) + list(model.named_children()) + list(model.named_buffers(recurse=False))
    device_map, used, current = OrderedDict(), {d: 0 for d in devices}, 0
    reserve, reserve_names = _max_layer(todo, sizes, no_split)
    while todo:
        name, module = todo.pop(0)
        reserve_names = [n for n in reserve_names if n != name and not n.startswith(name + ".")]
        if not reserve_names:
            reserve, reserve_names = _max_layer([(n, m) for n, m in todo if isinstance(m, nn.Module)], sizes, no_split)
        device = devices[current]
        room = None if device == "disk" else max_memory[device] - (reserve if device in main else 0)
        held = reserve if device in main else 0
        size = sizes[name]
        total, tied_names = _with_ties(name, size, ties, sizes, todo)
        if room is None or used[device] + total <= room:
            used[device] += total
            device_map[name] = device
            for tied in tied_names:
                todo = [(n, m) for n, m in todo if n != tied]
                device_map[tied] = device
            continue
        if tied_names and used[device] + size <= room:  # split a tied module that can be split, else move on
            splittable = [(t, m) for t, m in todo if t in tied_names and _children(t, m) and type(m).__name__ not in no_split]
            if splittable:
                t, m = splittable[0]
                i = next(i for i, (n, _) in enumerate(todo) if n == t)
                todo = [(name, module)] + todo[:i] + _children(t, m) + todo[i + 1:]
                reserve, reserve_names = _max_layer([(n, x) for n, x in todo if isinstance(x, nn.Module)], sizes, no_split)
                continue
        if used[device] + size >= room and _children(name, module) and type(module).__name__ not in no_split:
            todo = _children(name, module) + todo
            reserve, reserve_names = _max_layer([(n, m) for n, m in todo if isinstance(m, nn.Module)], sizes, no_split)
            continue
        used[device] += held
        current += 1
        todo = [(name, module)] + todo
    return clean_device_map(device_map)


def clean_device_map(device_map: dict, module: str = "") -> "OrderedDict[str, object]":
    """Merge the entries under a module that all share one device into that module (Accelerate's cleaning)."""
    prefix = f"{module}." if module else ""
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module] = values[0]
    depth = len(module.split(".")) + 1 if module else 1
    for child in {".".join(k.split(".")[:depth]) for k in device_map if k.startswith(prefix) and len(k) > len(module)}:
        clean_device_map(device_map, child)
    return OrderedDict(device_map)


def placement_of(device_map: dict, name: str):
    """The device of the tensor or module ``name``: its longest prefix in ``device_map``."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    raise PrunusError(f"device_map places no module holding {name!r}; give every module a device (or use 'auto')")


def execution_device(placement) -> torch.device:
    """Where a module placed on ``placement`` computes: its GPU, or the CPU (for "cpu", and for "disk" when no
    GPU is in the map: :func:`main_device` handles that case)."""
    return torch.device("cuda", placement) if isinstance(placement, int) else torch.device("cpu")


def main_device(device_map: dict) -> torch.device:
    """The first GPU of the map, else the CPU: where inputs enter and disk-streamed modules compute."""
    gpus = sorted(d for d in set(device_map.values()) if isinstance(d, int))
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")


def resolve_device_map(model: nn.Module, device_map, max_memory) -> "OrderedDict[str, object]":
    """``device_map`` ("auto" with ``max_memory``, or {module: device}) checked against ``model`` (on meta)."""
    if device_map == "auto":
        if max_memory is None:
            raise PrunusError("device_map='auto' needs max_memory, e.g. {0: '10GiB', 'cpu': '30GiB'} "
                              "(--max-memory 0=10GiB,cpu=30GiB)")
        memory = parse_max_memory(max_memory)
        sizes = module_sizes(model)
        block = max(sizes[f"layers.{i}"] for i in range(len(model.layers)))
        first = next(iter(memory))
        if first != "disk" and memory[first] < block:
            raise PrunusError(f"max_memory for {first!r} is {memory[first]:,} bytes, below one block "
                              f"({block:,} bytes): raise it")
        return infer_device_map(model, memory)
    if not isinstance(device_map, dict) or not device_map:
        raise PrunusError(f"device_map {device_map!r}: give 'auto' (with max_memory) or {{module name: device}}")
    names = dict(model.named_modules())
    placed = OrderedDict()
    for name, device in device_map.items():
        if name not in names:
            raise PrunusError(f"device_map names {name!r}, which is no module of this model (e.g. 'layers.0', 'norm')")
        placed[name] = _device_key(device)
    for name, _ in list(model.named_parameters()) + list(model.named_buffers()):
        if "." in name:  # every module's tensor has a device (the model's own rotary tables: the main device)
            placement_of(placed, name)
    return placed


def _units(model: nn.Module, device_map: dict) -> list[tuple[str, nn.Module, object]]:
    """The called modules the map places, (name, module, placement): a container (the model, a ModuleDict of
    blocks) placed whole stands for its children."""
    modules, units = dict(model.named_modules()), []

    def add(name, module, placement):
        if module is model or isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            for child, sub in module.named_children():
                add(f"{name}.{child}" if name else child, sub, placement)
        else:
            units.append((name, module, placement))

    for name, placement in device_map.items():
        if name in modules:  # else a tensor of the model itself (the rotary tables: on the main device)
            add(name, modules[name], placement)
    return units


class _DeviceCache:
    """A KV-cache step seen from one block's device: the mask moves there (the step moves its indices)."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.device = inner, device
        self.seq_len = inner.seq_len

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        return self.inner.update(layer_id, k, v)

    def attn_mask(self, q_len: int, k_len: int):
        mask = self.inner.attn_mask(q_len, k_len)
        return None if mask is None else mask.to(self.device)

    def advance(self, n: int) -> None:
        self.inner.advance(n)


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if hasattr(value, "update") and hasattr(value, "attn_mask"):  # a KVCacheProtocol
        return _DeviceCache(value, device)
    return value


def _move_inputs(device: torch.device):
    def hook(module, args, kwargs):
        return tuple(_to(a, device) for a in args), {k: _to(v, device) for k, v in kwargs.items()}
    return hook


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class DiskWeights:
    """Tensors read from a safetensors file on demand with plain reads (``os.preadv``) into fresh buffers: unlike
    a memory map, pages read stay in the kernel's page cache, not in this process's resident memory, and each
    tensor's memory is freed when the module drops it."""

    def __init__(self, path: Path):
        from prunus.artifacts.safetensors_header import read_header

        self.header = read_header(path)
        self.file = open(path, "rb")
        self.data_start = 8 + int.from_bytes(self.file.read(8), "little")

    def keys(self):
        return self.header.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        start, end = entry["data_offsets"]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(end - start)
        os.preadv(self.file.fileno(), [buf], self.data_start + start)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class _Stream:
    """A disk-placed module: its weights read from the model dir's safetensors (DiskWeights) before each forward and
    dropped (back to the meta device) after it."""

    def __init__(self, name: str, module: nn.Module, weights, tied: dict, device: torch.device):
        self.module, self.weights, self.device = module, weights, device
        self.slots = []  # (owning module, attribute, stored key)
        stored = set(weights.keys())
        for full in [n for n, _ in module.named_parameters(remove_duplicate=False)] + [n for n, _ in module.named_buffers()]:
            owner_name, _, attr = full.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            key = tied.get(f"{name}.{full}", f"{name}.{full}")
            if key in stored:
                self.slots.append((owner, attr, key))

    def load(self, module, args):
        for owner, attr, key in self.slots:
            t = self.weights.get_tensor(key).to(self.device)
            if attr in owner._parameters:
                owner._parameters[attr] = nn.Parameter(t, requires_grad=False)
            else:
                owner._buffers[attr] = t

    def drop(self, module, args, output):
        for owner, attr, _ in self.slots:
            table = owner._parameters if attr in owner._parameters else owner._buffers
            t = table[attr]
            table[attr] = (nn.Parameter(t.to("meta"), requires_grad=False) if attr in owner._parameters else t.to("meta"))
        return output


def load_dispatched(path: str | Path, device_map, max_memory=None, dtype: torch.dtype | None = None):
    """The model dir at ``path`` placed by ``device_map`` (see the module docstring); returns (model, map)."""
    from prunus.models import load_model
    from prunus.models.model_dir import WEIGHTS

    path = Path(path)
    meta = load_model(path, device="meta", placement=lambda name: None)  # the structure, verified, no weights
    if dtype is not None:
        meta.to(dtype)
    placed = resolve_device_map(meta, device_map, max_memory)
    main = main_device(placed)
    cfg = meta.config

    def where(name):
        p = placement_of(placed, name)
        return None if p == "disk" else execution_device(p)

    model = load_model(path, device=main, dtype=dtype, verify=False, placement=where)
    tied = {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}
    weights = DiskWeights(path / WEIGHTS)  # open for the engine's lifetime
    for name, module, p in _units(model, placed):
        device = main if p == "disk" else execution_device(p)
        module.register_forward_pre_hook(_move_inputs(device), with_kwargs=True)
        if p == "disk":
            stream = _Stream(name, module, weights, tied, device)
            module.register_forward_pre_hook(stream.load)
            module.register_forward_hook(stream.drop)
    model.register_forward_pre_hook(_move_inputs(main), with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: output.to(main))
    model.input_device, model.device_map, model._streamed_weights = main, placed, weights
    return model, placed


def place_cache(cache, model) -> None:
    """Each block's KV cache on the device its block computes on (the cache's indices stay on the input's)."""
    placed, main = model.device_map, model.input_device
    for i in list(cache.k):
        p = placement_of(placed, f"layers.{i}")
        device = main if p == "disk" else execution_device(p)
        cache.k[i] = torch.zeros(cache.k[i].shape, dtype=cache.k[i].dtype, device=device)
        cache.v[i] = torch.zeros(cache.v[i].shape, dtype=cache.v[i].dtype, device=device)
    cache.device = main
