"""The transformer's :class:`~prunus.compress.run.CompressKind`: the runner's row 0 and each pass's row are scored
on held-out text (bits per byte on the same slice as ``prunus eval``, agreement of greedy tokens with the input
model's, size, CPU latency), ``--max-quality-drop`` bounds the rise of bits per byte, and the output is a model dir
(:func:`prunus.models.save_model`) with ``recipe.yaml`` and the report."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from prunus.data.evaluate import DEFAULT_EVAL_TOKENS
from prunus.models import save_model

from .context import build_context
from .recipe import recipe_yaml
from .report import greedy, prompts_from, report_files, report_header, report_row
from .run import CompressKind, CompressOptions, CompressRun

DEFAULT_CORPUS_BYTES = 16 << 20  # of the corpus read for calibration and evaluation


def start(model_dir: Path, options: CompressOptions) -> CompressRun:
    ctx = build_context(model_dir, data=options.data, seq_len=options.seq_len, seed=options.seed,
                        max_corpus_bytes=options.max_corpus_bytes or DEFAULT_CORPUS_BYTES,
                        eval_tokens=options.eval_tokens or DEFAULT_EVAL_TOKENS)
    teacher, prompts = ctx.teacher, prompts_from(ctx, ctx.teacher)
    reference = greedy(teacher, prompts)

    def score(label, model, base, notes):
        return report_row(label, model, ctx, reference=reference, prompts=prompts, base=base,
                          latency=options.latency, notes=notes)

    def write(out: Path, model, report: dict) -> None:
        final = report["rows"][-1]
        save_model(model, out, tokenizer=ctx.tokenizer, stage="compress", parent=model_dir,
                   overwrite=options.overwrite,
                   command=options.command if options.command is not None else shlex.join(sys.argv),
                   metrics={"val_loss": final["val_loss"], "val_bpb": final["val_bpb"], "agreement": final["agreement"]},
                   extra_files={"recipe.yaml": (options.recipe_text or recipe_yaml(
                       [(p["name"], p["args"]) for p in report["passes"]])).encode(), **report_files(report)})

    def quality_drop(row: dict) -> tuple[float, str]:
        base = row["val_bpb"] / (1 + row["bpb_change"])  # row 0's
        return row["bpb_change"], (f"bits per byte rose {100 * row['bpb_change']:.2f}% over the input "
                                   f"({base:.4f} -> {row['val_bpb']:.4f})")

    return CompressRun(teacher, ctx, score, report_header(ctx), write, quality_drop)


KIND = CompressKind("transformer", frozenset({"max_quality_drop", "seq_len", "eval_tokens", "max_corpus_bytes"}), start)
