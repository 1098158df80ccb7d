"""prunus eval: validation loss and bits per byte of a model dir, recorded in its manifest."""

from __future__ import annotations

import click

from .options import device_option, resolve_device


@click.command("eval")
@click.argument("model_dir", type=click.Path())
@click.option("--data", default=None,
              help="Corpus to evaluate on. Default: English prose shipped with Python ('prose') for a model with a "
                   "pretrained tokenizer, the built-in corpus (Python's standard library) for a byte-level one.")
@click.option("--seq-len", type=int, default=None, help="Window in tokens. Default: the model's max_seq_len, at most 1024.")
@click.option("--max-tokens", "--eval-tokens", "max_tokens", type=int, default=None,
              help="Held-out tokens to score. Default: the slice the compression report and export parity score.")
@click.option("--no-record", is_flag=True, help="Do not write the figures into prunus.json.")
@device_option
def command(model_dir: str, data: str | None, seq_len: int | None, max_tokens: int | None, no_record: bool, device: str):
    """Score MODEL_DIR on held-out text."""
    from rich.console import Console
    from rich.table import Table

    from prunus.data import evaluate_model_dir

    given = {"max_tokens": max_tokens} if max_tokens is not None else {}
    r = evaluate_model_dir(model_dir, data=data, seq_len=seq_len, record=not no_record, device=resolve_device(device),
                           **given)
    table = Table(title=f"prunus eval {model_dir}", show_header=False)
    table.add_row("corpus", r["eval_corpus"])
    table.add_row("tokens scored", f"{r['val_tokens']:,} (windows of {r['seq_len']:,})")
    table.add_row("validation loss", f"{r['val_loss']:.4f} nats/token")
    # the count is named: training's last line scores --eval-tokens (65,536 by default), a longer slice
    table.add_row("bits per byte", f"{r['val_bpb']:.4f} on {r['val_tokens']:,} held-out tokens (--max-tokens)")
    table.add_row("unigram baseline", f"{r['unigram_bpb']:.4f} bits/byte")
    Console().print(table)
