"""``prunus eval`` of a generic module dir: the task's held-out figures on a dataset, scored as the trainer scores.

The module is rebuilt by its factory (imported only when trusted, :func:`prunus.models.module_dir.load_module`),
the data spec read as ``prunus train --data`` reads it (its held-out split), and the figures computed by
:func:`.module_trainer.score_module`: ``val_loss`` (cross-entropy for classification, mean squared error for
regression, the task's loss otherwise), ``val_accuracy`` (top-1) for classification, ``val_samples``; and by
:mod:`.task_report` a classifier's confusion matrix and per-class report (its PNG with ``plot``) or a
regressor's MSE / MAE / R². A table's labels are mapped to the classes the model dir's ``labels.json`` records.
``val_fraction`` 1.0 scores the whole of ``data`` (a separate test set). A generic module's ONNX export dir
(:mod:`prunus.export.module_export`) is scored alike: its files checked against its manifest, its graph run in
ONNX Runtime behind the ``nn.Module`` interface the scoring calls (:class:`OnnxModule`); nothing in it imported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

MAX_BATCH, MAX_SAMPLES = 65_536, 1 << 30
# ONNX Runtime's input type -> the numpy dtype a batch is fed as
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def is_module_export(path: str | Path) -> bool:
    """Whether ``path``'s config.json is a generic module's export (kind "module" with an ``export`` key)."""
    from prunus.models.model_dir import read_config_json

    try:
        config = read_config_json(path)
    except PrunusError:
        return False
    return config.get("kind") == "module" and isinstance(config.get("export"), dict)


def read_module_export(path: Path) -> tuple[dict, dict, Path]:
    """(config.json, the manifest, the graph's path inside the dir), every file checked against the manifest."""
    from prunus.runtime.artifact import export_graph_paths, read_artifact_config, verify_export_dir

    config = read_artifact_config(path)
    export = config.get("export")
    if config.get("kind") != "module" or not isinstance(export, dict) or export.get("graph") != "module":
        raise PrunusError(f"{path}: not a generic module's export dir (config.json kind module, export.graph module); "
                          "give one written by prunus export from a generic model dir")
    if export.get("format") != "onnx":
        raise PrunusError(f"{path}: a {export.get('format')!r} export; prunus eval scores ONNX export dirs")
    manifest = verify_export_dir(path, export)
    graph = export_graph_paths(path, export, names=("model",))["model"]
    return config, manifest, graph


class OnnxModule(torch.nn.Module):
    """The graph at ``graph`` in ONNX Runtime (CPU), called as the module it was exported from: a batch tensor in,
    the output tensor out. A batch the graph refuses raises ValueError (the trainer's misfit types)."""

    def __init__(self, graph: Path, threads: int | None = None):
        super().__init__()
        from prunus.runtime.ort_session import ort_session

        try:
            self.session = ort_session(graph, threads)
        except PrunusError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types for an unreadable graph
            first = (str(e).splitlines() or [""])[0][:200]
            raise PrunusError(f"{graph}: ONNX Runtime cannot load it ({type(e).__name__}: {first}); re-create the "
                              "export dir with prunus export") from None
        spec = self.session.get_inputs()[0]
        self.input, self.dtype = spec.name, _ORT_TYPES.get(spec.type, np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = np.ascontiguousarray(x.detach().cpu().numpy().astype(self.dtype, copy=False))
        try:
            out = self.session.run(None, {self.input: batch})[0]
        except Exception as e:  # noqa: BLE001 - onnxruntime's own types for a shape or type it does not take
            first = (str(e).splitlines() or [""])[0]
            raise ValueError(first[-200:]) from None
        return torch.from_numpy(np.asarray(out))


def _check_request(batch_size: int, max_samples: int, val_fraction: float) -> None:
    if not 1 <= batch_size <= MAX_BATCH:
        raise PrunusError(f"--batch-size {batch_size} must be from 1 to {MAX_BATCH:,}")
    if not 1 <= max_samples <= MAX_SAMPLES:
        raise PrunusError(f"--max-samples {max_samples} must be from 1 to {MAX_SAMPLES:,}")
    if not 0 < val_fraction <= 1:
        raise PrunusError(f"--val-fraction {val_fraction} must be above 0 and at most 1 (1: score all of --data)")


def _held_out(path: Path, data: str, task, val_fraction: float):
    """(the held-out split of ``data``, the labels the dir records)."""
    from prunus.data.global_batches import check_pair
    from prunus.data.module_datasets import module_datasets
    from prunus.data.tables import read_labels

    labels = read_labels(path) or {}
    _, val = module_datasets(data, val_fraction, task=task.name, classes=labels.get("classes"))
    if val is None or len(val) == 0:
        raise PrunusError(f"--data {data}: holds no held-out samples to score; give data with a held-out split")
    check_pair(val, "--data")
    return val, labels


def _score(model, path: Path, data: str, task, val, labels: dict, *, batch_size: int, max_samples: int, device,
           plot) -> tuple[dict, dict]:
    """(the scalar figures to record, all the figures) of ``model`` (a module, or an ONNX graph run as one)."""
    from prunus.data.module_fit import check_fits, data_classes

    from .task_report import class_names, confusion_png, module_report, per_class
    from .module_trainer import _call, score_module

    check_fits(model, val, task, _call, f"--data {data}")  # the classes the module scores, the input it takes
    try:
        figures = score_module(model, task, val, batch_size=batch_size, max_samples=max_samples, device=device)
        report = module_report(model, task.name, val, classes=data_classes(val), batch_size=batch_size,
                               max_samples=max_samples, device=device, call=_call)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # a shape the module does not take
        from prunus.models.module_factory import reason

        raise PrunusError(f"--data {data}: the module in {path} could not score it ({reason(e)}); give data of "
                          "the input and target the module was trained on") from None
    scalars = {**figures, **{k: v for k, v in report.items() if k != "confusion"}, "eval_data": data,
               "task": task.name}
    figures = dict(scalars)
    if "confusion" in report:
        names = class_names(report["confusion"], labels.get("classes"), getattr(val, "classes", None))
        figures.update(confusion=report["confusion"], classes=names, per_class=per_class(report["confusion"], names))
        if plot is not None:
            figures["plot"] = confusion_png(report["confusion"], names, plot, f"{path} on {data}")
    return scalars, figures


def evaluate_module_dir(path, data: str, *, trust_factory=False, batch_size: int = 64, max_samples: int = 4096,
                        val_fraction: float = 0.1, record: bool = True, device: str = "cpu",
                        plot: str | Path | None = None) -> dict:
    """The held-out figures of the generic module dir at ``path`` on ``data``'s held-out split (a data spec:
    an image folder, tar shards, a table or ``synthetic:...``); with ``record``, the scalar figures merged into
    its manifest; ``plot``: where a classifier's confusion matrix PNG goes (the figures' ``plot``)."""
    from prunus.models.model_dir import update_manifest_metrics, verify_model_dir
    from prunus.models.module_dir import load_module, read_module_config
    from prunus.models.tasks import get_task

    _check_request(batch_size, max_samples, val_fraction)
    path = Path(path)
    verify_model_dir(path)
    config = read_module_config(path)
    task = get_task(config.get("task") or "classification", trust=trust_factory, where=str(path))
    val, labels = _held_out(path, data, task, val_fraction)
    model = load_module(path, config, trust_factory=trust_factory, device=device)
    scalars, figures = _score(model, path, data, task, val, labels, batch_size=batch_size, max_samples=max_samples,
                              device=device, plot=plot)
    if record:
        update_manifest_metrics(path, scalars)
    return figures


def evaluate_module_export(path, data: str, *, batch_size: int = 64, max_samples: int = 4096,
                           val_fraction: float = 0.1, record: bool = True, plot: str | Path | None = None,
                           threads: int | None = None) -> dict:
    """The held-out figures of a generic module's ONNX export dir (:mod:`prunus.export.module_export`), its graph
    run in ONNX Runtime (:class:`OnnxModule`), scored as :func:`evaluate_module_dir` scores the
    model dir: the same figures, recorded in the export dir's manifest with ``record``. No factory is imported;
    a task that is a loss function (``package.module:fn``) is refused."""
    from prunus.artifacts.atomic import atomic_write_json
    from prunus.artifacts.manifest_schema import MANIFEST
    from prunus.models.tasks import get_task

    _check_request(batch_size, max_samples, val_fraction)
    path = Path(path)
    config, manifest, graph = read_module_export(path)
    task_name = config.get("task") or "classification"
    if ":" in str(task_name):
        raise PrunusError(f"{path}: its task is the loss {short(task_name)}; an export dir is scored without "
                          "importing code: evaluate its model dir (prunus eval MODEL_DIR --trust-factory)")
    task = get_task(task_name, trust=False, where=str(path))
    val, labels = _held_out(path, data, task, val_fraction)
    model = OnnxModule(graph, threads)
    scalars, figures = _score(model, path, data, task, val, labels, batch_size=batch_size, max_samples=max_samples,
                              device="cpu", plot=plot)
    if record:
        manifest.setdefault("metrics", {}).update(scalars)
        atomic_write_json(path / MANIFEST, manifest)
    return figures
