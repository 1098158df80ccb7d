"""prunus eval: validation loss and bits per byte of a model dir, recorded in its manifest."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from prunus.data import evaluate_model_dir


@click.command("eval")
@click.argument("model_dir", type=click.Path())
@click.option("--data", default=None, help="Corpus to evaluate on. Default: the built-in corpus.")
@click.option("--seq-len", type=int, default=None, help="Default: the model's max_seq_len.")
@click.option("--max-tokens", type=int, default=262144, show_default=True, help="Validation tokens to score.")
@click.option("--no-record", is_flag=True, help="Do not write the figures into prunus.json.")
def command(model_dir: str, data: str | None, seq_len: int | None, max_tokens: int, no_record: bool):
    """Score MODEL_DIR on held-out text."""
    r = evaluate_model_dir(model_dir, data=data, seq_len=seq_len, max_tokens=max_tokens, record=not no_record)
    table = Table(title=f"prunus eval {model_dir}", show_header=False)
    table.add_row("corpus", r["eval_corpus"])
    table.add_row("tokens scored", f"{r['val_tokens']:,}")
    table.add_row("validation loss", f"{r['val_loss']:.4f} nats/token")
    table.add_row("bits per byte", f"{r['val_bpb']:.4f}")
    table.add_row("unigram baseline", f"{r['unigram_bpb']:.4f} bits/byte")
    Console().print(table)
