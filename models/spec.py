"""The model kinds of prunus's one pipeline: one :class:`ModelSpec` a kind, found by the ``kind`` an artifact records.

As torchtitan's ``TrainSpec`` registry: a row names, for its kind, what each stage calls. ``prunus train``,
the run dir, the dry run, ``compress``, ``export`` and ``eval`` look the kind up here instead of testing names:

* ``config``: the run's settings dataclass (``prunus train``'s options, ``run.json``'s ``train``);
* ``train`` / ``preflight`` / ``dry_run``: the Python API's entry, the checks made before any rank starts,
  the per-rank memory plan;
* ``parallelize`` / ``pipeline_split`` / ``tp_plan``: the layout applied to the unmodified model;
* ``model_dir_writer`` / ``model_dir_loader``: the model dir's format; ``export``: its graph and parity
  check; ``compress``: its :class:`prunus.compress.run.CompressKind` (the one runner's hooks); ``evaluate``: ``prunus eval`` of the dir.

The transformer is the kind with the most parallelisms (its own TP plan, context and expert parallelism, a
Hugging Face state-dict adapter); ``module`` is any ``nn.Module`` a factory builds, trained for a task.
Every entry is a ``package.module:attribute`` of prunus itself, imported on first use, so reading a spec
imports no torch; nothing read from an artifact chooses code beyond the row its ``kind`` names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from pathlib import Path

from prunus.artifacts.errors import PrunusError

TRANSFORMER = "transformer"  # an artifact with no ``kind`` is the transformer's


@dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str  # how tables and messages name the kind
    config: str
    train: str
    preflight: str
    dry_run: str
    parallelize: str
    pipeline_split: str
    tp_plan: str
    state_dict_adapter: str | None
    model_dir_writer: str
    model_dir_loader: str
    export: str
    compress: str
    evaluate: str

    def load(self, entry: str):
        """The object ``entry`` (a field name) names, imported now."""
        target = getattr(self, entry)
        if target is None:
            raise PrunusError(f"a {self.title} has no {entry.replace('_', ' ')}")
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)


_TP, _MOD = "prunus.train_parallel.", "prunus.models."
SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec(TRANSFORMER, "transformer", _TP + "config:TrainConfig", _TP + "trainer:train", _TP + "trainer:preflight",
              _TP + "launch.dry_run:memory_plan", _TP + "parallelize:parallelize",
              _TP + "pipeline.pipeline_parallel:build_pipeline", _TP + "tensor_parallel.tensor_parallel:apply_tp",
              _MOD + "hf_convert:to_hf", _MOD + "model_dir:save_model", _MOD + "model_dir:load_model",
              "prunus.export.export_dir:export_model", "prunus.compress.transformer_compress:KIND",
              "prunus.data.evaluate_model_dir:evaluate_model_dir"),
    ModelSpec("module", "generic module", _TP + "module_config:ModuleTrainConfig",
              _TP + "module_trainer:train_from_config", _TP + "module_trainer:preflight_module", _TP + "launch.dry_run:module_memory_plan",
              _TP + "data_parallel.data_parallel:parallelize_any", _TP + "pipeline.split_pipeline:split_stages",
              _TP + "tensor_parallel.plan_file:apply_tp_plan", None, _MOD + "module_dir:save_module",
              _MOD + "module_dir:load_module", "prunus.export.module_export:export_module",
              "prunus.compress.module_compress:KIND", _TP + "held_out_eval:evaluate_module_dir"),
)}
ENTRIES = tuple(f.name for f in fields(ModelSpec) if f.name not in ("name", "title"))


def get_spec(kind: str | None) -> ModelSpec:
    """The spec of ``kind`` (None: the transformer); one line for a kind prunus does not know."""
    spec = SPECS.get(TRANSFORMER if kind is None else kind) if isinstance(kind, (str, type(None))) else None
    if spec is None:
        raise PrunusError(f"kind {str(kind)[:40]!r} is not one prunus knows ({', '.join(SPECS)}); re-create the "
                          "artifact with this prunus")
    return spec


def dir_kind(path: str | Path) -> str | None:
    """The ``kind`` a model dir's config.json records (None: none, or no readable config.json)."""
    from prunus.models.model_dir_manifest import read_config_json

    if not (Path(path) / "config.json").is_file():
        return None
    try:
        kind = read_config_json(path).get("kind")
    except PrunusError:
        return None
    return kind if isinstance(kind, str) else None


def spec_of_dir(path: str | Path) -> ModelSpec:
    """The spec of the model dir at ``path`` (the transformer when its config.json names no kind)."""
    return get_spec(dir_kind(path))
