"""prunus compress: run a recipe (or a shortcut) on a model dir, write the result and its report."""

from __future__ import annotations

import os
import sys

import click

from prunus.artifacts.errors import PrunusError
from prunus.models.schemes import SCHEMES

from .tables import Column, console_for_tables, print_fitted

# the report table: (header, priority: the lowest is dropped first when the terminal is narrow, 0 never)
REPORT_COLUMNS = [Column("#", priority=1), Column("pass", justify="left", text=True), Column("val loss", priority=3),
                  Column("bits/byte"), Column("Δ bpb"), Column("agree", priority=4), Column("params", priority=5),
                  Column("MB")]


def report_rows(report: dict) -> tuple[list[Column], list[list[str]]]:
    """The compression report's columns and formatted rows (latency columns when it was measured)."""
    rows = report["rows"]
    columns = list(REPORT_COLUMNS)
    has_latency = "prefill_ms" in rows[0]
    if has_latency:
        columns += [Column(f"prefill {rows[0]['prefill_tokens']} ms", priority=2), Column("decode ms", priority=2)]
    cells = []
    for i, r in enumerate(rows):
        row = [str(i), r["pass"], f"{r['val_loss']:.4f}", f"{r['val_bpb']:.4f}", f"{100 * r['bpb_change']:+.2f}%",
               f"{100 * r['agreement']:.1f}%", f"{r['params']:,}", f"{r['bytes'] / 1e6:.3f}"]
        if has_latency:  # "≈": the runs overlap the input row's, a difference within noise (report.md has the ranges)
            from prunus.compress.report import within_noise

            row += [("≈ " if i and within_noise(r, rows[0], k) else "") + f"{r[k]:.2f}" for k in ("prefill_ms", "decode_ms")]
        cells.append(row)
    return columns, cells


def print_report(console, report: dict) -> None:
    rows = report["rows"]
    columns, cells = report_rows(report)
    print_fitted(console, columns, cells, title=f"prunus compress -> {report['out']}", title_justify="left",
                 caption=f"bits per byte on {rows[0]['val_tokens']:,} held-out tokens of {report.get('corpus')}, "
                         f"windows of {report.get('seq_len')} tokens"
                         + ("; latency: median of the runs, ≈ within noise of row 0" if "prefill_ms" in rows[0] else ""),
                 caption_justify="left")
    for i, r in enumerate(rows):
        for line in r.get("notes", []):
            console.print(f"row {i} ({r['pass']}): {line}")


def print_module_report(console, report: dict) -> None:
    """A generic module's report: the task's quality, params, MB and latency per row."""
    from prunus.compress.report import quality

    rows = report["rows"]
    columns = [Column("#", priority=1), Column("pass", justify="left", text=True), Column("val loss", priority=3),
               Column(quality(rows[0])[0]), Column("params", priority=4), Column("MB")]
    if "latency_ms" in rows[0]:
        columns.append(Column("latency ms", priority=2))
    cells = [[str(i), r["pass"], f"{r['val_loss']:.4f}", f"{quality(r)[1]:.2f}", f"{r['params']:,}",
              f"{r['bytes'] / 1e6:.3f}", *([f"{r['latency_ms']:.2f}"] if "latency_ms" in r else [])]
             for i, r in enumerate(rows)]
    print_fitted(console, columns, cells, title=f"prunus compress -> {report['out']}", title_justify="left")
    for i, r in enumerate(rows):
        for line in r.get("notes", []):
            console.print(f"row {i} ({r['pass']}): {line}")


def passes_from(recipe, quantize, prune, distill, distill_args: dict) -> tuple[list, str | None]:
    """The passes the flags ask for: a recipe's, or the shortcuts' with the --distill-* arguments."""
    from prunus.compress import load_recipe, shortcut_passes
    from prunus.compress.recipe import check_pass

    shortcuts = {"--quantize": quantize, "--prune": prune, "--distill": distill}
    if recipe is not None and any(v is not None for v in shortcuts.values()):
        raise PrunusError("--recipe cannot be combined with --quantize, --prune or --distill; put every pass in the recipe")
    if recipe is None and all(v is None for v in shortcuts.values()):
        raise PrunusError("nothing to do: give --recipe R.yaml or at least one of --quantize, --prune, --distill")
    if distill_args and distill is None:
        raise PrunusError(f"{', '.join('--distill-' + k.replace('_', '-') for k in distill_args)} apply to --distill; "
                          "add --distill STUDENT (in a recipe, give them as the distill pass's arguments)")
    if recipe is not None:
        return load_recipe(recipe)
    passes = [(name, {**args, **distill_args} if name == "distill" else args)
              for name, args in shortcut_passes(quantize=quantize, prune=prune, distill=distill)]
    for name, args in passes:
        check_pass(name, args, where=f"--{name}")
    return passes, None


def shipped_recipes() -> list[str]:
    """The names of the recipes shipped in compress/recipes/, found without importing the compression code."""
    from importlib.util import find_spec
    from pathlib import Path

    return sorted(p.stem for d in find_spec("prunus.compress").submodule_search_locations
                  for p in (Path(d) / "recipes").glob("*.yaml"))


def eagle_command(model_dir, spec: str, distill_args: dict, other, **options) -> None:
    """``--distill eagle[:vocab=N][,passes=P][,nproc=R]``: train an EAGLE draft head for MODEL_DIR
    (prunus.compress.eagle_draft)."""
    from prunus.compress.eagle_draft import parse_eagle, train_eagle

    if other:
        raise PrunusError(f"--distill {spec} writes a draft head, not a compressed model; drop --recipe, --quantize and "
                          "--prune (run them in another prunus compress)")
    result = train_eagle(model_dir, **parse_eagle(spec), **distill_args, **options)
    if "seconds" not in result:  # a rank of a process group other than the first: the first reports
        return
    click.echo(f"{result['seconds']:.1f} s; draft head over {result['vocab']:,} tokens, {result['train_tokens']:,} "
               f"training tokens of {result['corpus']}; held-out first-token agreement with the target "
               f"{100 * result['heldout_first_token_agreement']:.1f}%")
    click.echo(f"wrote {result['out']} (serve with --speculative {result['out']})")


@click.command("compress")
@click.argument("model_dir", type=click.Path())
@click.option("--recipe", default=None,
              help="A recipe YAML file, or the name of a shipped one: " + ", ".join(shipped_recipes())
                   + " (int4: the int4-* ones; compress/recipes/NAME.yaml says what each does).")
@click.option("--quantize", default=None, metavar="SCHEME", help=f"Quantize every Linear but the output head: {', '.join(SCHEMES)}.")
@click.option("--prune", default=None, metavar="METHOD[:AMOUNT]",
              help="magnitude[:S], wanda[:S], 2:4, 2:4-magnitude, heads:F, channels:F or blocks:N.")
@click.option("--distill", default=None, metavar="STUDENT", help="keep-every:K, depth:N (N blocks spread from the first to the last), width:F or a preset name; "
              "or eagle[:vocab=N][,passes=P][,nproc=R]: an EAGLE draft head for speculative decoding (--out is then "
              "the draft dir; passes=P trains on each batch P times, its teacher pass made once; nproc=R on R local "
              "processes, each its share of every batch).")
@click.option("--distill-steps", type=int, default=None, help="With --distill: optimizer steps of the distillation. "
              "Default: the distill pass's.")
@click.option("--distill-batch-size", type=int, default=None, help="With --distill: sequences per step. Default: the distill pass's.")
@click.option("--distill-lr", type=float, default=None, help="With --distill: peak learning rate. Default: the distill pass's.")
@click.option("--out", required=True, type=click.Path(), help="The model dir to write.")
@click.option("--data", default=None,
              help="Corpus for calibration and evaluation. Default: English prose shipped with Python ('prose') "
                   "for a model with a pretrained tokenizer, the built-in corpus for a byte-level one.")
@click.option("--max-quality-drop", type=float, default=None, metavar="X",
              help="Fail (exit 1, nothing written) when bits per byte rise by more than X (0.02 = 2%) over the input.")
@click.option("--eval-tokens", type=int, default=None,
              help="Held-out tokens scored per report row. Default: the same slice prunus eval scores.")
@click.option("--seq-len", type=int, default=None,
              help="Evaluation window in tokens. Default: the model's context, at most 1024. With --distill eagle: the "
                   "training window (default 256).")
@click.option("--max-corpus-bytes", type=int, default=None,
              help="Read at most this many bytes of the corpus (calibration and evaluation draw from them). "
                   "Default: 16 MiB.")
@click.option("--no-latency", is_flag=True, help="Skip the CPU latency columns.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of calibration sampling and distillation.")
@click.option("--trust-factory", is_flag=True,
              help="A generic module's model dir: import the factory its config.json names (that runs its code). "
                   "Or list trusted specs in PRUNUS_TRUST_FACTORIES.")
def command(model_dir, recipe, quantize, prune, distill, distill_steps, distill_batch_size, distill_lr, out, data,
            max_quality_drop, eval_tokens, seq_len, max_corpus_bytes, no_latency, overwrite, seed, trust_factory):
    """Compress MODEL_DIR into OUT with a recipe or shortcuts; prints the report."""
    from prunus.compress import QualityDropError, compress

    if trust_factory and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a trusted factory's module may sit in the current directory
    distill_args = {k: v for k, v in (("steps", distill_steps), ("batch_size", distill_batch_size), ("lr", distill_lr))
                    if v is not None}
    if distill is not None and distill.split(":")[0] == "eagle":  # a draft head for the model, not a smaller model
        unused = [flag for flag, v in (("--max-quality-drop", max_quality_drop), ("--eval-tokens", eval_tokens),
                                       ("--no-latency", no_latency), ("--trust-factory", trust_factory)) if v]
        if unused:
            raise PrunusError(f"{', '.join(unused)} apply to compressing a model, not to --distill {distill}; drop them")
        corpus = {"max_corpus_bytes": max_corpus_bytes} if max_corpus_bytes is not None else {}
        return eagle_command(model_dir, distill, distill_args, recipe or quantize or prune, out=out, data=data,
                             seed=seed, overwrite=overwrite, seq_len=seq_len, **corpus)
    passes, text = passes_from(recipe, quantize, prune, distill, distill_args)
    try:
        report = compress(model_dir, passes, out, data=data, max_quality_drop=max_quality_drop, overwrite=overwrite,
                          seed=seed, seq_len=seq_len, max_corpus_bytes=max_corpus_bytes, latency=not no_latency,
                          recipe_text=text, trust_factory=trust_factory or None, eval_tokens=eval_tokens)
    except QualityDropError as e:
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(1) from None
    if report.get("kind") == "module":
        print_module_report(console_for_tables(), report)
        click.echo(f"{report['seconds']['total']:.1f} s; wrote {out} (report.md, report.png)")
        return
    print_report(console_for_tables(), report)
    sec = report["seconds"]
    rows_s = [r.get("seconds", {}) for r in report["rows"]]
    click.echo(f"{sec['total']:.1f} s: context {sec['context']:.1f} s, passes {sum(sec['passes']):.1f} s, report rows "
               f"{sum(sum(r.values()) for r in rows_s):.1f} s (evaluation {sum(r.get('eval', 0) for r in rows_s):.1f} s), "
               f"save {sec['save']:.1f} s")
    click.echo(f"wrote {out} (report.md, report.png)")
