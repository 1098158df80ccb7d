"""The generic module's :class:`~prunus.compress.run.CompressKind`: passes written against ``nn.Module``.

The module (rebuilt by its trusted factory) is scored on the task's held-out data (row 0), then each pass that
applies to a generic module (``kinds`` in :data:`prunus.compress.recipe.PASSES`) runs on a copy in the one runner
(:mod:`.run`) and is scored: loss, top-1 accuracy (classification), parameters, bytes of the weights and CPU
latency of one batch. The output is a generic model dir (cut shapes recorded, see
:mod:`prunus.models.module_reshape`) with ``recipe.yaml`` and the report (``report.json`` / ``.md`` / ``.png``),
written only once it reloads and runs (:mod:`.module_verify`).
"""

from __future__ import annotations

import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from prunus.artifacts.errors import PrunusError

from .run import CompressKind, CompressOptions, CompressRun

LATENCY_RUNS, LATENCY_BATCH, CALIB_SAMPLES = 7, 8, 64


@dataclass
class ModuleContext:
    """What a generic pass gets: the source dir, its config, the task and the (train, held-out) datasets."""

    source: Path
    config: dict
    task: object
    train: object
    val: object
    seed: int = 0
    trust: object = None  # the caller's trust_factory (a student factory of a recipe needs it too)
    notes: list = field(default_factory=list)

    def note(self, line: str) -> None:
        self.notes.append(line)

    def take_notes(self) -> list[str]:
        out, self.notes = self.notes, []
        return out

    def batch(self, n: int, split: str = "val") -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        data = self.val if split == "val" else self.train
        return default_collate([data[i] for i in range(min(len(data), n))])

    def example(self) -> torch.Tensor:
        return self.batch(2)[0]

    def finetune(self, model: nn.Module, *, steps: int, lr: float, batch_size: int) -> nn.Module:
        """``steps`` of the generic trainer on the task's training split; the trained module."""
        from prunus.train_parallel.module_config import ModuleTrainConfig
        from prunus.train_parallel.module_trainer import train_module

        with tempfile.TemporaryDirectory(prefix="prunus-finetune-") as tmp:
            cfg = ModuleTrainConfig(out=str(Path(tmp) / "run"), task=self.task.name, batch_size=batch_size,
                                    steps=steps, lr=lr, min_lr=lr / 10, warmup_steps=0, eval_every=steps,
                                    ckpt_every=0, seed=self.seed, device="cpu", progress=False)
            train_module(model, self.train, self.task.name, cfg, val_dataset=self.val)
        self.note(f"fine-tuned {steps} steps (lr {lr:g}, batch {batch_size})")
        return model.eval()


def evaluate(model: nn.Module, ctx: ModuleContext, batch_size: int = 64) -> dict:
    """The held-out figures of ``model`` on every held-out sample (the task's: val_loss, val_accuracy for
    classification), as training's evaluation computes them."""
    from prunus.train_parallel.module_trainer import score_module

    return score_module(model, ctx.task, ctx.val, batch_size=batch_size, max_samples=len(ctx.val))


def latency_ms(model: nn.Module, x: torch.Tensor) -> float:
    """Median CPU milliseconds of one forward of the batch ``x``."""
    times = []
    with torch.inference_mode():
        model(x)
        for _ in range(LATENCY_RUNS):
            t0 = time.perf_counter()
            model(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def module_row(label: str, model: nn.Module, ctx: ModuleContext, *, base: dict | None = None,
               latency: bool = True, notes: list | None = None) -> dict:
    """One row of the report (see the module docstring)."""
    row = {"pass": label, **evaluate(model, ctx), "params": sum(p.numel() for p in model.parameters()),
           "bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}
    if latency:
        row["latency_ms"] = latency_ms(model, ctx.batch(LATENCY_BATCH)[0])
    if base is not None and "val_accuracy" in base:
        row["accuracy_change"] = row["val_accuracy"] - base["val_accuracy"]
    if notes:
        row["notes"] = notes
    return row


def _load(model_dir: Path, data: str | None, trust_factory, seed: int) -> tuple[nn.Module, ModuleContext]:
    from prunus.data.module_datasets import module_datasets
    from prunus.models.module_dir import load_module, read_module_config
    from prunus.models.tasks import get_task

    config = read_module_config(model_dir)
    if data is None:
        raise PrunusError(f"{model_dir}: a generic module is compressed on its task's data; pass --data (an "
                          "ImageFolder directory or synthetic:...)")
    if config.get("task") is None:
        raise PrunusError(f"{model_dir}/config.json: records no task; re-create the model dir with prunus train")
    task = get_task(config["task"], trust=trust_factory, where=str(model_dir / "config.json"))
    train, val = module_datasets(data)
    model = load_module(model_dir, config, trust_factory=trust_factory)
    return model, ModuleContext(model_dir, config, task, train, val, seed, trust_factory)


def start(model_dir: Path, options: CompressOptions) -> CompressRun:
    """A run of the runner (:mod:`.run`) on a generic module dir: rows scored on the task's held-out data, the output
    a generic model dir (cut shapes recorded) written only once it reloads and runs."""
    teacher, ctx = _load(model_dir, options.data, options.trust_factory, options.seed)

    def score(label, model, base, notes):
        return module_row(label, model, ctx, base=base, latency=options.latency, notes=notes)

    header = {"source": str(model_dir), "task": ctx.task.name, "data": options.data, "seed": options.seed,
              "kind": "module", "threads": torch.get_num_threads()}
    return CompressRun(teacher, ctx, score, header, lambda out, model, report: _write(out, model, report, ctx, options))


def _write(out: Path, model: nn.Module, report: dict, ctx: ModuleContext, options) -> None:
    from prunus.models.module_dir import carried_files, save_module
    from prunus.models.module_factory import build_module
    from prunus.models.module_reshape import shape_changes

    from .module_verify import write_checked
    from .recipe import recipe_yaml
    from .report import report_files

    factory = getattr(model, "prunus_factory", None)  # a distilled student's own, else the input's
    with torch.device("meta"):
        reference = build_module(factory.spec, factory.args).state_dict()
    final = report["rows"][-1]
    passes = [(p["name"], p["args"]) for p in report["passes"]]

    def write(path):
        save_module(model, path, stage="compress", factory=factory, task=ctx.task.name,
                    input=ctx.config.get("input"), parent=ctx.source,
                    command=options.command if options.command is not None else shlex.join(sys.argv),
                    metrics={k: final[k] for k in ("val_loss", "val_accuracy") if k in final},
                    pruned_shapes=shape_changes(model, reference),
                    extra_files={"recipe.yaml": (options.recipe_text or recipe_yaml(passes)).encode(),
                                 **report_files(report), **carried_files(ctx.source)})  # a table's labels.json

    write_checked(out, options.overwrite, write, model, ctx.batch(LATENCY_BATCH)[0], options.trust_factory)


KIND = CompressKind("module", frozenset({"trust_factory"}), start)
