"""What compression did to a model: one typed value that travels with it.

Every compression pass reads and updates a :class:`CompressionState`, reached through
:func:`compression_state` (the one accessor; it lives on the module as the attribute
``compression``, and nothing else reads that attribute). ``save_model`` writes it into
config.json under ``"compression"`` (:meth:`CompressionState.to_json`) and ``load_model``
rebuilds it (:meth:`CompressionState.from_json`), so a quantized layout, a sparsity record
or the list of passes survives a save and a load.

The records themselves are plain JSON values, written by the pass that owns them:

* ``passes``: ``{"name", "args", "notes"?}`` per pass run by ``prunus compress``, in order;
* ``distillation``: what ``distill`` trained (student, steps, losses, ...);
* ``sparsity``: what ``prune`` / ``prune_structured`` removed (an earlier record is kept
  under ``"previous"``);
* ``quantization``: ``{"modules": {name: {"scheme", "granularity", "group_size"}}, "excluded": [...]}``
  plus ``untied_output`` and ``calibration`` when they apply; ``modules`` is the layout
  ``load_model`` rebuilds before loading the weights.

``student_channels`` is not saved: which teacher channels a width-derived student's
residual stream holds, read by the distillation loss in the same process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import check_known_fields

ATTRIBUTE = "compression"
# config.json key order: the order passes usually run in (distill, prune, quantize)
SAVED_FIELDS = ("passes", "distillation", "sparsity", "quantization")


@dataclass
class CompressionState:
    passes: list[dict] = field(default_factory=list)
    distillation: dict | None = None
    sparsity: dict | None = None
    quantization: dict | None = None
    student_channels: torch.Tensor | None = field(default=None, compare=False)  # not saved (see module docstring)

    @property
    def quantized_modules(self) -> dict[str, dict]:
        """name -> {"scheme", "granularity", "group_size"} of every quantized module ({} when none)."""
        return (self.quantization or {}).get("modules", {})

    def record_pass(self, name: str, args: dict, notes: list[str] | None = None) -> None:
        """Append one entry to ``passes`` (what ``prunus compress`` ran, with the notes it printed)."""
        self.passes.append({"name": name, "args": args, **({"notes": notes} if notes else {})})

    def set_sparsity(self, record: dict) -> None:
        """Record a pruning pass; an earlier sparsity record is kept under ``"previous"``."""
        if self.sparsity:
            record["previous"] = self.sparsity
        self.sparsity = record

    def copy(self) -> "CompressionState":
        return copy.deepcopy(self)

    def to_json(self) -> dict:
        """The config.json value: the saved fields that are set, in ``SAVED_FIELDS`` order ({} when none)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in SAVED_FIELDS if getattr(self, name)}

    @classmethod
    def from_json(cls, value, source: str = "config.json") -> "CompressionState":
        """The state a config.json's ``"compression"`` value describes (keys in any order)."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise PrunusError(f"{source}: 'compression' must be an object; re-create the model dir")
        check_known_fields(value, SAVED_FIELDS, f"{source}: compression", what="record",
                           fix="re-create the model dir with this version of prunus")
        passes = value.get("passes") or []
        if not isinstance(passes, list) or not all(isinstance(p, dict) for p in passes):
            raise PrunusError(f"{source}: compression.passes must be a list of objects; re-create the model dir")
        records = {}
        for name in ("distillation", "sparsity", "quantization"):
            record = value.get(name)
            if record is not None and not isinstance(record, dict):
                raise PrunusError(f"{source}: compression.{name} must be an object; re-create the model dir")
            records[name] = copy.deepcopy(record) or None
        quantized = (records["quantization"] or {}).get("modules", {})
        if not isinstance(quantized, dict) or not all(isinstance(s, dict) for s in quantized.values()):
            raise PrunusError(f"{source}: compression.quantization.modules must map names to objects; re-create the model dir")
        return cls(passes=copy.deepcopy(passes), **records)


def compression_state(model: torch.nn.Module) -> CompressionState:
    """The state of ``model`` (attached, empty, on first use): read it, or update it in place."""
    state = getattr(model, ATTRIBUTE, None)
    if state is None:
        state = CompressionState()
        setattr(model, ATTRIBUTE, state)
    elif not isinstance(state, CompressionState):
        raise TypeError(f"model.{ATTRIBUTE} is a {type(state).__name__}; set it with set_compression_state")
    return state


def set_compression_state(model: torch.nn.Module, state: CompressionState) -> torch.nn.Module:
    """Attach ``state`` to ``model`` (a pass that builds a new model carries the old one's state over); returns ``model``."""
    if not isinstance(state, CompressionState):
        raise TypeError(f"expected a CompressionState, got {type(state).__name__}")
    setattr(model, ATTRIBUTE, state)
    return model


def carry_over(source: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """``target`` with ``source``'s state attached when it has none of its own (a pass that built a new
    module without carrying the state over); returns ``target``."""
    if getattr(target, ATTRIBUTE, None) is None:
        set_compression_state(target, compression_state(source))
    return target
