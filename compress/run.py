"""``prunus compress``: read a model dir, run passes in order, write a model dir with its report.

The input model is scored first (row 0 of the report), then each pass runs on a
copy of it and is scored. With ``max_quality_drop`` a pass that raises bits per
byte by more than that fraction of the input's stops the run (QualityDropError)
and nothing is written. The output dir holds the model, ``recipe.yaml`` (the passes
that ran) and the report; the manifest's hashes cover them all.
"""

from __future__ import annotations

import copy
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models import save_model
from prunus.models.compression_state import carry_over, compression_state
from prunus.models.spec import TRANSFORMER, spec_of_dir
from prunus.artifacts.paths import check_output
from prunus.artifacts.validate import check_int_range

from prunus.data.evaluate import DEFAULT_EVAL_TOKENS

from .context import build_context
from .pass_arguments import Span
from .pass_label import pass_label
from .recipe import PASSES, check_pass, get_pass, recipe_yaml
from .report import greedy, prompts_from, report_files, report_header, report_row


class QualityDropError(Exception):
    """A pass lost more quality than allowed; the command exits 1 and writes nothing."""


def run_pass(fn, name: str, model: nn.Module, ctx, args: dict) -> nn.Module:
    """One pass, under the rule every pass follows: it returns the model it made (the same module
    when it changed it in place, a new one when it rebuilt it) and the run goes on with that one.
    A new module gets its input's CompressionState carried over when the pass did not set one."""
    out = fn(model, ctx, **args)
    if not isinstance(out, nn.Module):
        raise TypeError(f"compression pass {name!r} returned {type(out).__name__}, not the model it made")
    return carry_over(model, out)


def check_arguments(model_dir: Path, passes, out: Path, *, data, max_quality_drop, overwrite, seed, seq_len,
                    eval_tokens, max_corpus_bytes) -> None:
    """Everything about a compress call that can be refused before any model is loaded."""
    if not passes:
        raise PrunusError("compress: no pass given; pass --recipe, --quantize, --prune or --distill")
    for i, (name, args) in enumerate(passes, 1):
        check_pass(name, args, where=f"pass {i}")
        if name in ("prune_channels", "distill_module"):
            raise PrunusError(f"pass {i}: {name} applies to generic module dirs (kind module); for {model_dir} "
                              f"(a transformer) use {'prune_structured' if name == 'prune_channels' else 'distill'}")
    if max_quality_drop is not None and not Span(0, math.inf, open_hi=True)(max_quality_drop):
        raise PrunusError(f"--max-quality-drop {max_quality_drop}: must be a finite fraction >= 0 (e.g. 0.02 for +2% bits per byte)")
    if out.exists() and not overwrite:
        raise PrunusError(f"{out}: already exists; choose another output path or pass --overwrite")
    check_output(out, [("MODEL_DIR", model_dir), ("--data", data)])  # prunus.artifacts.paths: never over an input
    check_int_range(seed, "--seed", 0, 2**64 - 1)
    check_int_range(eval_tokens, "--eval-tokens", 1, 2**63 - 1)
    for name, value in (("--seq-len", seq_len), ("--max-corpus-bytes", max_corpus_bytes)):
        if value is not None:
            check_int_range(value, name, 1, 2**63 - 1)


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


def compress(model_dir: str | Path, passes: list[tuple[str, dict]], out: str | Path, *, data: str | None = None,
             max_quality_drop: float | None = None, overwrite: bool = False, seed: int = 0,
             seq_len: int | None = None, eval_tokens: int = DEFAULT_EVAL_TOKENS, max_corpus_bytes: int | None = 16 << 20,
             latency: bool = True, progress: bool = True, recipe_text: str | None = None,
             command: str | None = None, trust_factory=None) -> dict:
    """Run ``passes`` [(name, args)] on ``model_dir``, write the result to ``out``; return the report.

    ``seq_len``: the evaluation window (default: the model's context, at most 1,024 tokens);
    ``eval_tokens``: held-out tokens scored per row (the same slice as ``prunus eval``)."""
    model_dir, out = Path(model_dir), Path(out)
    spec = spec_of_dir(model_dir)
    if spec.name != TRANSFORMER:  # another kind's passes: its spec's runner (a generic nn.Module: module_compress)
        return spec.load("compress")(model_dir, passes, out, data=data, trust_factory=trust_factory,
                                     overwrite=overwrite, seed=seed, latency=latency, recipe_text=recipe_text,
                                     command=command)
    check_arguments(model_dir, passes, out, data=data, max_quality_drop=max_quality_drop, overwrite=overwrite,
                    seed=seed, seq_len=seq_len, eval_tokens=eval_tokens, max_corpus_bytes=max_corpus_bytes)
    start = time.perf_counter()
    ctx = build_context(model_dir, data=data, seq_len=seq_len, seed=seed, max_corpus_bytes=max_corpus_bytes,
                        eval_tokens=eval_tokens)
    teacher, prompts = ctx.teacher, prompts_from(ctx, ctx.teacher)
    reference = greedy(teacher, prompts)
    console = Console(stderr=True)
    rows, pass_seconds = [], []
    context_seconds = time.perf_counter() - start
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task("score the input model", total=2 * len(passes) + 1)
        rows.append(report_row("input", teacher, ctx, reference=reference, prompts=prompts, latency=latency))
        bar.advance(task)
        model = copy.deepcopy(teacher)  # the teacher's CompressionState comes along (a deep copy)
        for p in model.parameters():
            p.requires_grad_(True)
        torch.manual_seed(seed)
        for name, args in passes:
            label = pass_label(name, args)
            model, notes, seconds = _apply_pass(name, args, model, ctx, bar, console, progress)
            pass_seconds.append(seconds)
            bar.advance(task)
            bar.update(task, description=f"score {label}")
            row = report_row(label, model, ctx, reference=reference, prompts=prompts, base=rows[0], latency=latency,
                             notes=notes)
            rows.append(row)
            bar.advance(task)
            if max_quality_drop is not None and row["bpb_change"] > max_quality_drop:
                raise QualityDropError(
                    f"{label}: bits per byte rose {100 * row['bpb_change']:.2f}% over the input "
                    f"({rows[0]['val_bpb']:.4f} -> {row['val_bpb']:.4f}), above --max-quality-drop "
                    f"{100 * max_quality_drop:g}%; nothing was written")
    report = {**report_header(ctx), "out": str(out), "passes": [{"name": n, "args": a} for n, a in passes], "rows": rows}
    final = rows[-1]
    t0 = time.perf_counter()
    report["seconds"] = {"context": round(context_seconds, 2), "passes": pass_seconds,
                         "before_save": round(t0 - start, 2)}
    save_model(model, out, tokenizer=ctx.tokenizer, stage="compress", parent=model_dir, overwrite=overwrite,
               command=command if command is not None else shlex.join(sys.argv),
               metrics={"val_loss": final["val_loss"], "val_bpb": final["val_bpb"], "agreement": final["agreement"]},
               extra_files={"recipe.yaml": (recipe_text or recipe_yaml(passes)).encode(), **report_files(report)})
    report["seconds"].update(save=round(time.perf_counter() - t0, 2), total=round(time.perf_counter() - start, 2))
    return report
