"""prunus compress: run a recipe (or a shortcut) on a model dir, write the result and its report."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from prunus.compress import QualityDropError, compress, load_recipe, shortcut_passes
from prunus.data.evaluate import DEFAULT_EVAL_TOKENS
from prunus.models import PrunusError
from prunus.models.quantized import SCHEMES


def report_table(report: dict) -> Table:
    rows = report["rows"]
    table = Table(title=f"prunus compress -> {report['out']}", title_justify="left",
                  caption=f"bits per byte on {rows[0]['val_tokens']:,} held-out tokens of {report.get('corpus')}, "
                          f"windows of {report.get('seq_len')} tokens", caption_justify="left")
    for col in ("#", "pass", "val loss", "bits/byte", "Δ bpb", "agree", "params", "MB"):
        table.add_column(col, justify="left" if col == "pass" else "right")
    has_latency = "prefill_ms" in rows[0]
    if has_latency:
        table.add_column(f"prefill {rows[0]['prefill_tokens']} ms", justify="right")
        table.add_column("decode ms", justify="right")
    for i, r in enumerate(rows):
        cells = [str(i), r["pass"], f"{r['val_loss']:.4f}", f"{r['val_bpb']:.4f}", f"{100 * r['bpb_change']:+.2f}%",
                 f"{100 * r['agreement']:.1f}%", f"{r['params']:,}", f"{r['bytes'] / 1e6:.3f}"]
        if has_latency:
            cells += [f"{r['prefill_ms']:.2f}", f"{r['decode_ms']:.2f}"]
        table.add_row(*cells)
    return table


@click.command("compress")
@click.argument("model_dir", type=click.Path())
@click.option("--recipe", default=None, help="A recipe YAML file, or the name of a shipped one (e.g. w8a8-smoothquant).")
@click.option("--quantize", default=None, metavar="SCHEME", help=f"Quantize every Linear but the output head: {', '.join(SCHEMES)}.")
@click.option("--prune", default=None, metavar="METHOD[:AMOUNT]",
              help="magnitude[:S], wanda[:S], 2:4, 2:4-magnitude, heads:F, channels:F or blocks:N.")
@click.option("--distill", default=None, metavar="STUDENT", help="keep-every:K, width:F or a preset name.")
@click.option("--out", required=True, type=click.Path(), help="The model dir to write.")
@click.option("--data", default=None,
              help="Corpus for calibration and evaluation. Default: English prose shipped with Python ('prose') "
                   "for a model with a pretrained tokenizer, the built-in corpus for a byte-level one.")
@click.option("--max-quality-drop", type=float, default=None, metavar="X",
              help="Fail (exit 1, nothing written) when bits per byte rise by more than X (0.02 = 2%) over the input.")
@click.option("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS, show_default=True,
              help="Held-out tokens scored per report row (the same slice prunus eval scores).")
@click.option("--seq-len", type=int, default=None,
              help="Evaluation window in tokens. Default: the model's context, at most 1024.")
@click.option("--max-corpus-bytes", type=int, default=16 << 20, show_default=True,
              help="Read at most this many bytes of the corpus (calibration and evaluation draw from them).")
@click.option("--no-latency", is_flag=True, help="Skip the CPU latency columns.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--seed", type=int, default=0, show_default=True)
def command(model_dir, recipe, quantize, prune, distill, out, data, max_quality_drop, eval_tokens, seq_len,
            max_corpus_bytes, no_latency, overwrite, seed):
    """Compress MODEL_DIR into OUT with a recipe or shortcuts; prints the report."""
    shortcuts = {"--quantize": quantize, "--prune": prune, "--distill": distill}
    if recipe is not None and any(v is not None for v in shortcuts.values()):
        raise PrunusError("--recipe cannot be combined with --quantize, --prune or --distill; put every pass in the recipe")
    if recipe is None and all(v is None for v in shortcuts.values()):
        raise PrunusError("nothing to do: give --recipe R.yaml or at least one of --quantize, --prune, --distill")
    if eval_tokens < 1:
        raise PrunusError(f"--eval-tokens {eval_tokens} must be at least 1")
    if seq_len is not None and seq_len < 1:
        raise PrunusError(f"--seq-len {seq_len} must be at least 1")
    if max_corpus_bytes < 1:
        raise PrunusError(f"--max-corpus-bytes {max_corpus_bytes} must be at least 1")
    if recipe is not None:
        passes, text = load_recipe(recipe)
    else:
        passes, text = shortcut_passes(quantize=quantize, prune=prune, distill=distill), None
    try:
        report = compress(model_dir, passes, out, data=data, max_quality_drop=max_quality_drop, overwrite=overwrite,
                          seed=seed, eval_tokens=eval_tokens, seq_len=seq_len, max_corpus_bytes=max_corpus_bytes,
                          latency=not no_latency, recipe_text=text)
    except QualityDropError as e:
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(1) from None
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)
    console.print(report_table(report))
    for i, r in enumerate(report["rows"]):
        for line in r.get("notes", []):
            console.print(f"row {i} ({r['pass']}): {line}")
    sec = report["seconds"]
    rows_s = [r.get("seconds", {}) for r in report["rows"]]
    click.echo(f"{sec['total']:.1f} s: context {sec['context']:.1f} s, passes {sum(sec['passes']):.1f} s, report rows "
               f"{sum(sum(r.values()) for r in rows_s):.1f} s (evaluation {sum(r.get('eval', 0) for r in rows_s):.1f} s), "
               f"save {sec['save']:.1f} s")
    click.echo(f"wrote {out} (report.md, report.png)")
