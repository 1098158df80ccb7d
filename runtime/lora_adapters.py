"""Many LoRA adapters over one base model, applied per row of a batch (multi-LoRA serving, torch backend).

An adapter is a PEFT-format dir (``adapter_config.json`` + ``adapter_model.safetensors``, what
``prunus train --save-adapter`` writes). :func:`read_adapter` validates it against the base before any tensor is
read: the config's fields prunus can honour (``peft_type`` LORA, rank ``r``, ``lora_alpha``, ``use_rslora``; no DoRA,
no ``fan_in_fan_out``, no biases, no ``modules_to_save``, no per-module rank or alpha patterns), every tensor name
mapped to a base module (Hugging Face names through the family tables of :mod:`prunus.models.hf_families`) and every
shape checked against that module (``lora_A`` (r, in_features), ``lora_B`` (out_features, r)). A dir written for
another base is one PrunusError line naming the dir and the module that does not fit. Only safetensors is read,
and only files inside the dir (:func:`prunus.artifacts.contained.inside`).

Every ``lora_A`` / ``lora_B`` is checked finite as it is read, and every module's update ``scale * B @ A`` sound
(:func:`check_update`): for an input of entries in [-1, 1], entry ``k`` of the intermediate ``x @ A^T`` is at most
``sum_j |A[k, j]|``, and output ``i`` of the update at most ``scale * |B[i]| * sum_j |A[:, j]|`` (Cauchy-Schwarz
over the rank); both bounds must stay below :func:`update_limit` of the base's dtype: the square root of float32's
largest value (1.8e19: a hidden state past it squares to infinity in the next RMSNorm) or, under a float16 base,
float16's largest value (the update is computed in it). Trained adapters sit far below (rank 16, alpha 32, every
entry 0.1, 4096 inputs: 410 and 1,311); an adapter of 1e30 weights is refused in one line naming the module, as is
one whose weights, cast to the base's dtype, leave its range. The norms are the checks' one pass over each tensor.

:class:`LoraSet` installs itself on the model with hooks (``models/llama.py`` stays free of serving code): a forward
pre-hook on the model reads which cache rows a pass runs (the ``cache`` step's ``rows_cpu``) and looks up each row's
bound adapter; a forward hook on each targeted projection adds, for the rows of each adapter in the pass,
``scale * (x @ A^T) @ B^T`` to the base output. Rows of the base and of different adapters share one pass, and no
weights are merged. The pass's grouping is thread-local, so a pass without a cache on another thread (embeddings)
does not see the scheduler's rows.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.safetensors_header import read_header
from prunus.artifacts.validate import read_json_object, short

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FIX = "give a PEFT LoRA adapter dir trained on this base (prunus train --save-adapter writes one)"
KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


@dataclass
class Adapter:
    """One loaded adapter: its name, dir, and {prunus module name: (A (r, in), B (out, r) * scale)}."""

    name: str
    path: Path
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise PrunusError(f"adapter name {short(name)} must be 1-128 letters, digits or ._:/- starting with a letter "
                          "or digit; give NAME=ADAPTER_DIR")
    return name


def _hf_to_prunus(model) -> dict[str, str]:
    """A block module's Hugging Face name (``self_attn.q_proj``) -> prunus's (``attention.wq``), for the base's family."""
    from prunus.models.hf_convert import pick_family
    from prunus.models.hf_families import LAYER

    try:
        table = pick_family(model.config, None, getattr(model, "hf_origin", None), "--lora").layer
    except PrunusError:
        table = LAYER
    return {theirs.removesuffix(".weight"): ours.removesuffix(".weight")
            for theirs, ours in table.items() if theirs.endswith(".weight")}


def _read_config(path: Path) -> tuple[int, float]:
    """(rank, scale) of the adapter's config, or one line naming the field prunus cannot honour."""
    source = inside(path, ADAPTER_CONFIG, fix=FIX)
    config = read_json_object(source, fix=FIX)
    if config.get("peft_type", "LORA") != "LORA":
        raise PrunusError(f"{source}: peft_type {short(config.get('peft_type'))} is not LORA; {FIX}")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 65536:
        raise PrunusError(f"{source}: r={short(r)} must be an integer rank from 1 to 65536; {FIX}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1e6:
        raise PrunusError(f"{source}: lora_alpha={short(alpha)} must be a positive number; {FIX}")
    for key, fine in (("use_dora", (False, None)), ("fan_in_fan_out", (False, None)), ("bias", ("none", None)),
                      ("modules_to_save", (None, [])), ("rank_pattern", (None, {})), ("alpha_pattern", (None, {}))):
        if config.get(key) not in fine:
            raise PrunusError(f"{source}: {key}={short(config.get(key))} is not supported (only plain LoRA adapters "
                              f"serve); {FIX}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scale)


def _plan(model, path: Path, header: dict, rank: int) -> dict[str, dict[str, str]]:
    """{prunus module: {"A": key, "B": key}}, each key's shape checked against the module."""
    source = path / ADAPTER_WEIGHTS
    names, modules, plan = _hf_to_prunus(model), dict(model.named_modules()), {}
    for key, entry in header.items():
        m = KEY.fullmatch(key)
        ours = names.get(m.group(2)) if m else None
        module = modules.get(f"layers.{m.group(1)}.{ours}") if ours else None
        if module is None or not hasattr(module, "in_features"):
            raise PrunusError(f"{source}: {short(key, 120)} names no projection of the base; the adapter was "
                              f"trained for another base model, {FIX}")
        name = f"layers.{m.group(1)}.{ours}"
        want = (rank, module.in_features) if m.group(3) == "A" else (module.out_features, rank)
        if tuple(entry["shape"]) != want or entry["dtype"] not in ("F32", "F16", "BF16"):
            raise PrunusError(f"{source}: {short(key, 120)} is {entry['dtype']} {tuple(entry['shape'])} but the base's "
                              f"{name} takes a float {want} (rank {rank}); the adapter was trained for another base "
                              f"model, {FIX}")
        plan.setdefault(name, {})[m.group(3)] = key
    for name, pair in plan.items():
        if len(pair) != 2:
            raise PrunusError(f"{source}: {name} has lora_{'AB'[('A' in pair)]} missing; {FIX}")
    if not plan:
        raise PrunusError(f"{source}: holds no LoRA weights; {FIX}")
    return plan


def update_limit(dtype: torch.dtype) -> float:
    """The largest update bound :func:`check_update` accepts under a base of ``dtype``."""
    return min(math.sqrt(torch.finfo(torch.float32).max), torch.finfo(dtype).max)


def _check_finite(t: torch.Tensor, what: str, fix: str) -> None:
    bad = ~torch.isfinite(t.reshape(-1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise PrunusError(f"{what} holds {float(t.reshape(-1)[i])} at element {i} of {t.numel()}; {fix}")


def check_update(source: Path, module: str, keys: dict, A: torch.Tensor, B: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> None:
    """``A`` (r, in) and ``B`` (out, r) of ``module`` (float32), read from ``source`` under ``keys`` ({"A": key,
    "B": key}): finite, and the bounds of the module docstring within :func:`update_limit` of ``dtype``; else one
    line. The norms are the one pass: a NaN or an infinity in a tensor makes its norms so, and only then is the
    tensor searched for the element to name."""
    # squares summed rather than torch.linalg.vector_norm: the faster (docs/defaults.md)
    a_rows, a_cols = float(A.abs().sum(dim=1).max()), float((A * A).sum(dim=0).sqrt().sum())
    b_rows = math.sqrt(float((B * B).sum(dim=1).max()))
    if not math.isfinite(a_rows + a_cols + b_rows):
        damaged = f"the adapter is damaged; {FIX}"
        _check_finite(A, f"{source}: {short(keys['A'], 120)}", damaged)
        _check_finite(B, f"{source}: {short(keys['B'], 120)}", damaged)
    limit = update_limit(dtype)
    for what, bound in (("lora_A's", a_rows), (f"lora_B @ lora_A x {scale:g}", scale * b_rows * a_cols)):
        if not bound <= limit:
            raise PrunusError(f"{source}: the {what} output of {module} can reach {bound:.3g} on an input of entries "
                              f"in [-1, 1], beyond {limit:.3g} for a {str(dtype).removeprefix('torch.')} base (its "
                              f"hidden states would overflow); the adapter's weights are absurd, {FIX}")


def read_adapter(model, name: str, path: str | Path) -> Adapter:
    """The adapter at ``path``, validated against ``model`` (see the module docstring), on the base's devices and dtype."""
    from safetensors import safe_open

    check_name(name)
    path = Path(path)
    if not path.is_dir():
        raise PrunusError(f"--lora {name}={path}: not a directory; {FIX}")
    rank, scale = _read_config(path)
    weights_file = inside(path, ADAPTER_WEIGHTS, fix=FIX)
    plan = _plan(model, path, read_header(weights_file, fix=FIX), rank)
    modules, weights = dict(model.named_modules()), {}
    with safe_open(str(weights_file), framework="pt") as f:
        for module_name, pair in plan.items():
            module = modules[module_name]
            w = getattr(module, "weight", None)
            w = w if isinstance(w, torch.Tensor) else next(module.buffers())  # a packed quantized base
            dtype = w.dtype if w.is_floating_point() else torch.float32  # a quantized base: float adapters
            A, B = f.get_tensor(pair["A"]).float(), f.get_tensor(pair["B"]).float()
            check_update(weights_file, module_name, pair, A, B, scale, dtype)
            A, B = A.to(w.device, dtype), (B * scale).to(w.device, dtype)
            if torch.finfo(dtype).max < torch.finfo(torch.float32).max:  # float16: each weight within its range too
                for key, t in ((pair["A"], A), (pair["B"], B)):
                    _check_finite(t, f"{weights_file}: {short(key, 120)} (x {scale:g} for lora_B) as {dtype}",
                                  f"its weights do not fit the base's dtype; {FIX}")
            weights[module_name] = (A.contiguous(), B.contiguous())
    return Adapter(name, path, rank, weights)


class LoraSet:
    """The adapters loaded on one model and each cache row's adapter (None: the base)."""

    def __init__(self, model):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.bound: dict[int, Adapter] = {}
        self._local = threading.local()
        self._hooked: dict[str, object] = {}
        self._lock = threading.Lock()
        self._pre = model.register_forward_pre_hook(self._before, with_kwargs=True)
        self._post = model.register_forward_hook(self._after, always_call=True)

    # --- registry -------------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> Adapter:
        adapter = read_adapter(self.model, name, path)
        with self._lock:
            if name in self.adapters:
                raise PrunusError(f"an adapter named {name!r} is loaded already; unload it first or pick another name")
            modules = dict(self.model.named_modules())
            for module_name in adapter.weights:
                if module_name not in self._hooked:
                    self._hooked[module_name] = modules[module_name].register_forward_hook(self._hook(module_name))
            self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget ``name``; requests already holding it finish with it (their rows keep the weights)."""
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise PrunusError(f"no adapter named {short(name)} is loaded; loaded: {', '.join(self.adapters) or 'none'}")

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise PrunusError(f"no adapter named {short(name)} is loaded; loaded: {', '.join(self.adapters) or 'none'}")
        return adapter

    def bind(self, row: int, adapter: Adapter | None) -> None:
        if adapter is None:
            self.bound.pop(row, None)
        else:
            self.bound[row] = adapter

    # --- hooks ----------------------------------------------------------------------------

    def use(self, adapter: Adapter | None, batch: int) -> None:
        """The next cache-less pass on this thread runs ``batch`` rows of ``adapter`` (embeddings)."""
        self._local.forced = None if adapter is None else [(adapter, torch.arange(batch))]

    def _before(self, module, args, kwargs) -> None:
        step = kwargs.get("cache")
        rows = getattr(step, "rows_cpu", None)
        if rows is None:
            self._local.groups = getattr(self._local, "forced", None)
            self._local.forced = None
            return
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, row in enumerate(rows.tolist()):
            adapter = self.bound.get(row)
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(i)
        self._local.groups = [(a, torch.tensor(ix, dtype=torch.long)) for a, ix in groups.values()] or None

    def _after(self, module, args, output) -> None:
        self._local.groups = None

    def _hook(self, module_name: str):
        def add_lora(module, args, out):
            groups = getattr(self._local, "groups", None)
            if not groups:
                return None
            x = args[0]
            for adapter, ix in groups:
                pair = adapter.weights.get(module_name)
                if pair is None:
                    continue
                A, B = pair
                ix = ix.to(x.device)
                delta = (x.index_select(0, ix).to(A.dtype) @ A.T) @ B.T
                out = out.index_add(0, ix.to(out.device), delta.to(out.device, out.dtype))
            return out
        return add_lora

    def close(self) -> None:
        for handle in (self._pre, self._post, *self._hooked.values()):
            handle.remove()
        self._hooked.clear()
        self.adapters.clear()
        self.bound.clear()
