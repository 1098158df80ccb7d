"""``prunus compress``: one runner for every kind of model dir. It reads the dir, runs passes in order and writes
a model dir with its report.

A kind's spec row (:mod:`prunus.models.spec`, ``compress``) names its :class:`CompressKind`: the options it takes
beyond the common ones, and how it starts a run (:class:`CompressRun`: the input model, the passes' context, how a
row of the report is scored, how the output is written). Which passes apply to which kind is the pass registry's
(:data:`prunus.compress.recipe.PASSES`). The runner is the same for every kind: the input model is scored first
(row 0 of the report), then each pass runs on a copy of it in turn and is scored. With ``max_quality_drop`` (a kind
that measures one) a pass that loses more than that fraction of the input's quality stops the run
(QualityDropError) and nothing is written. An option a kind does not take is refused in one line, never ignored.
The output dir holds the model, ``recipe.yaml`` (the passes that ran) and the report; the manifest's hashes cover
them all.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.paths import check_output
from prunus.artifacts.validate import check_int_range
from prunus.models.compression_state import carry_over, compression_state
from prunus.models.spec import spec_of_dir

from .pass_arguments import Span
from .pass_label import pass_label
from .recipe import PASSES, check_pass, get_pass

# the options a kind may take beyond the common ones, with the flag that sets each
OPTION_FLAGS = {"max_quality_drop": "--max-quality-drop", "seq_len": "--seq-len", "eval_tokens": "--eval-tokens",
                "max_corpus_bytes": "--max-corpus-bytes", "trust_factory": "--trust-factory"}


class QualityDropError(Exception):
    """A pass lost more quality than allowed; the command exits 1 and writes nothing."""


@dataclass(frozen=True)
class CompressOptions:
    data: str | None = None
    max_quality_drop: float | None = None
    overwrite: bool = False
    seed: int = 0
    seq_len: int | None = None  # None: the kind's default
    eval_tokens: int | None = None
    max_corpus_bytes: int | None = None
    latency: bool = True
    progress: bool = True
    recipe_text: str | None = None
    command: str | None = None
    trust_factory: object = None


@dataclass
class CompressRun:
    """A run as its kind starts it."""

    teacher: nn.Module
    ctx: object  # what the passes get (``take_notes()`` after each)
    score: Callable  # (label, model, base row or None, notes) -> the report's row
    header: dict  # the report's fields before its rows
    write: Callable  # (out, model, report) -> None: the output dir, complete or not at all
    quality_drop: Callable | None = None  # row -> (the fraction of row 0's quality it lost, that in words)


@dataclass(frozen=True)
class CompressKind:
    name: str  # as the pass registry's ``kinds`` names it
    takes: frozenset  # the options of OPTION_FLAGS it takes
    start: Callable  # (model_dir, CompressOptions) -> CompressRun


def run_pass(fn, name: str, model: nn.Module, ctx, args: dict) -> nn.Module:
    """One pass, under the rule every pass follows: it returns the model it made (the same module
    when it changed it in place, a new one when it rebuilt it) and the run goes on with that one.
    A new module gets its input's CompressionState carried over when the pass did not set one."""
    out = fn(model, ctx, **args)
    if not isinstance(out, nn.Module):
        raise TypeError(f"compression pass {name!r} returned {type(out).__name__}, not the model it made")
    return carry_over(model, out)


def check_arguments(model_dir: Path, passes, out: Path, options: CompressOptions, kind: CompressKind,
                    title: str) -> None:
    """Everything about a compress call that can be refused before any model is loaded."""
    if not passes:
        raise PrunusError("compress: no pass given; pass --recipe, --quantize, --prune or --distill")
    for i, (name, args) in enumerate(passes, 1):
        check_pass(name, args, where=f"pass {i}")
        if kind.name not in PASSES[name].kinds:
            applies = ", ".join(n for n, entry in PASSES.items() if kind.name in entry.kinds)
            raise PrunusError(f"pass {i}: {name!r} does not apply to a {title} ({model_dir}); its passes: {applies}")
    given = [flag for key, flag in OPTION_FLAGS.items()
             if key not in kind.takes and getattr(options, key) is not None and getattr(options, key) is not False]
    if given:
        raise PrunusError(f"{', '.join(given)}: not taken by a {title} ({model_dir}); drop {given[0]}")
    drop = options.max_quality_drop
    if drop is not None and not Span(0, math.inf, open_hi=True)(drop):
        raise PrunusError(f"--max-quality-drop {drop}: must be a finite fraction >= 0 (e.g. 0.02 for +2% bits per byte)")
    if out.exists() and not options.overwrite:
        raise PrunusError(f"{out}: already exists; choose another output path or pass --overwrite")
    check_output(out, [("MODEL_DIR", model_dir), ("--data", options.data)])  # never over an input
    check_int_range(options.seed, "--seed", 0, 2**64 - 1)
    for flag, value in (("--eval-tokens", options.eval_tokens), ("--seq-len", options.seq_len),
                        ("--max-corpus-bytes", options.max_corpus_bytes)):
        if value is not None:
            check_int_range(value, flag, 1, 2**63 - 1)


def _apply_pass(name: str, args: dict, model, ctx, bar, console, progress: bool) -> tuple:
    """One pass on ``model``, the bar stopped while it runs (a pass may show its own progress: distillation trains);
    returns (the model it made, the notes it left, its seconds). The model's CompressionState records it."""
    extra = {"progress": False} if not progress and PASSES[name].shows_progress else {}
    bar.stop()
    if progress:
        console.print(f"[bold]pass {pass_label(name, args)}[/bold]")
    ctx.take_notes()
    t0 = time.perf_counter()
    model = run_pass(get_pass(name), name, model, ctx, {**args, **extra})
    seconds = round(time.perf_counter() - t0, 2)
    notes = ctx.take_notes()
    if progress:
        for line in notes:
            console.print(f"  {line}")
    bar.start()
    compression_state(model).record_pass(name, args, notes)
    return model, notes, seconds


def _run_passes(run: CompressRun, passes, options: CompressOptions) -> tuple[nn.Module, list, list]:
    """Row 0, then each pass on a copy of the input and its row; (the last model, the rows, each pass's seconds)."""
    console = Console(stderr=True)
    rows, seconds = [], []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, disable=not options.progress, transient=True) as bar:
        task = bar.add_task("score the input model", total=2 * len(passes) + 1)
        rows.append(run.score("input", run.teacher, None, []))
        bar.advance(task)
        model = copy.deepcopy(run.teacher)  # the teacher's CompressionState comes along (a deep copy)
        for p in model.parameters():
            p.requires_grad_(True)
        torch.manual_seed(options.seed)
        for name, args in passes:
            label = pass_label(name, args)
            model, notes, took = _apply_pass(name, args, model, run.ctx, bar, console, options.progress)
            seconds.append(took)
            bar.advance(task)
            bar.update(task, description=f"score {label}")
            rows.append(run.score(label, model, rows[0], notes))
            bar.advance(task)
            if options.max_quality_drop is not None:
                lost, words = run.quality_drop(rows[-1])
                if lost > options.max_quality_drop:
                    raise QualityDropError(f"{label}: {words}, above --max-quality-drop "
                                           f"{100 * options.max_quality_drop:g}%; nothing was written")
    return model, rows, seconds


def compress(model_dir: str | Path, passes: list[tuple[str, dict]], out: str | Path, **options) -> dict:
    """Run ``passes`` [(name, args)] on ``model_dir``, write the result to ``out``; return the report.

    ``options``: the fields of :class:`CompressOptions` (for a transformer: ``seq_len``, the evaluation window,
    default the model's context, at most 1,024 tokens; ``eval_tokens``, held-out tokens scored per row, the same
    slice as ``prunus eval``)."""
    model_dir, out, options = Path(model_dir), Path(out), CompressOptions(**options)
    spec = spec_of_dir(model_dir)
    kind = spec.load("compress")
    check_arguments(model_dir, passes, out, options, kind, spec.title)
    start = time.perf_counter()
    run = kind.start(model_dir, options)
    context_seconds = time.perf_counter() - start
    model, rows, pass_seconds = _run_passes(run, passes, options)
    report = {**run.header, "out": str(out), "passes": [{"name": n, "args": a} for n, a in passes], "rows": rows}
    t0 = time.perf_counter()
    report["seconds"] = {"context": round(context_seconds, 2), "passes": pass_seconds,
                         "before_save": round(t0 - start, 2)}
    run.write(out, model, report)
    report["seconds"].update(save=round(time.perf_counter() - t0, 2), total=round(time.perf_counter() - start, 2))
    return report
