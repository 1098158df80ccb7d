"""prunus eval: validation loss and bits per byte of a model dir, recorded in its manifest."""

from __future__ import annotations

import click

from prunus.artifacts.errors import PrunusError

from .options import device_option, resolve_device


def _module_eval(model_dir: str, data: str | None, trust_factory: bool, options: dict, *, record: bool,
                 device: str, plot: str | None = None) -> None:
    """prunus eval of a generic module dir: the task's figures on --data's held-out split, as a table."""
    import os
    import sys

    from rich.console import Console
    from rich.table import Table

    from prunus.models.spec import spec_of_dir
    from prunus.train_parallel.held_out_eval import evaluate_module_export, is_module_export

    if data is None:
        raise PrunusError(f"{model_dir} holds a generic module (or its export): pass --data (an image folder, tar shards, a table "
                          "or synthetic:classification?...) of the samples it was trained on")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the factory's module may sit in the current directory, as for prunus train
    if plot is None and record:
        plot = os.path.join(model_dir, "confusion_matrix.png")
    if is_module_export(model_dir):  # its ONNX graph in ONNX Runtime; nothing imported
        if trust_factory:
            raise PrunusError(f"--trust-factory: {model_dir} is an export dir, scored without its factory; drop it")
        r = evaluate_module_export(model_dir, data, record=record, plot=plot, **options)
    else:
        r = spec_of_dir(model_dir).load("evaluate")(model_dir, data, trust_factory=trust_factory, record=record, device=device,
                                plot=plot, **options)
    whole = options.get("val_fraction") == 1.0
    table = Table(title=f"prunus eval {model_dir}", show_header=False)
    table.add_row("data", f"{r['eval_data']} ({'all of it' if whole else 'held-out split'})")
    table.add_row("task", r["task"])
    table.add_row("samples scored", f"{r['val_samples']:,}")
    label = "mean squared error" if r["task"] == "regression" else "loss"
    table.add_row(label, f"{r['val_loss']:.6g}")
    if "val_accuracy" in r:
        table.add_row("top-1 accuracy", f"{r['val_accuracy']:.4f}")
    for key, name in (("val_mae", "mean absolute error"), ("val_r2", "R²")):
        if key in r:
            table.add_row(name, f"{r[key]:.6g}")
    if r.get("plot"):
        table.add_row("confusion matrix", str(r["plot"]))
    console = Console()
    console.print(table)
    if "per_class" in r:
        print_class_report(console, r)


def print_class_report(console, r: dict) -> None:
    """A classifier's per-class precision / recall / F1 / support and its confusion matrix, as tables."""
    from rich.table import Table

    report = Table(title="per class", title_justify="left")
    for name in ("class", "precision", "recall", "f1", "support"):
        report.add_column(name, justify="left" if name == "class" else "right")
    for row in r["per_class"]:
        report.add_row(str(row["class"]), f"{row['precision']:.4f}", f"{row['recall']:.4f}", f"{row['f1']:.4f}",
                       f"{row['support']:,}")
    console.print(report)
    if len(r["confusion"]) > 30:
        return  # the PNG holds it; a wider table would not read
    matrix = Table(title="confusion matrix (rows true, columns predicted)", title_justify="left")
    matrix.add_column("")
    for name in r["classes"]:
        matrix.add_column(str(name), justify="right")
    for name, row in zip(r["classes"], r["confusion"]):
        matrix.add_row(str(name), *(f"{v:,}" for v in row))
    console.print(matrix)


@click.command("eval")
@click.argument("model_dir", type=click.Path())
@click.option("--data", default=None,
              help="Corpus to evaluate on. Default: English prose shipped with Python ('prose') for a model with a "
                   "pretrained tokenizer, the built-in corpus (Python's standard library) for a byte-level one.")
@click.option("--seq-len", type=int, default=None, help="Window in tokens. Default: the model's max_seq_len, at most 1024.")
@click.option("--max-tokens", "--eval-tokens", "max_tokens", type=int, default=None,
              help="Held-out tokens to score. Default: the slice the compression report and export parity score.")
@click.option("--no-record", is_flag=True, help="Do not write the figures into prunus.json.")
@click.option("--trust-factory", is_flag=True,
              help="A generic module dir (not its export dir): import the factory its config.json names (that runs its code).")
@click.option("--batch-size", type=int, default=None, help="A generic module dir: samples per batch (default 64).")
@click.option("--max-samples", type=int, default=None,
              help="A generic module dir: held-out samples scored, the first of the split (default 4096).")
@click.option("--val-fraction", type=float, default=None,
              help="A generic module dir on an image folder or a table: the share held out, as training held it out "
                   "(default 0.1); 1.0 scores all of --data (a separate test set).")
@click.option("--plot", default=None, metavar="PATH.png",
              help="A generic classifier: where its confusion matrix PNG goes (default MODEL_DIR/confusion_matrix.png; "
                   "none with --no-record).")
@device_option
def command(model_dir: str, data: str | None, seq_len: int | None, max_tokens: int | None, no_record: bool, device: str,
            trust_factory: bool, batch_size: int | None, max_samples: int | None, val_fraction: float | None,
            plot: str | None):
    """Score MODEL_DIR on held-out text (a generic module dir, or its ONNX export dir: on --data's held-out samples)."""
    from rich.console import Console
    from rich.table import Table

    from prunus.models.spec import TRANSFORMER, get_spec, spec_of_dir

    module_opts = {"batch_size": batch_size, "max_samples": max_samples, "val_fraction": val_fraction}
    if spec_of_dir(model_dir).name != TRANSFORMER:
        for flag, value in (("--seq-len", seq_len), ("--max-tokens", max_tokens)):
            if value is not None:
                raise PrunusError(f"{flag} applies to a transformer; {model_dir} holds a generic module: drop it "
                                  "(--max-samples bounds what is scored)")
        return _module_eval(model_dir, data, trust_factory, {k: v for k, v in module_opts.items() if v is not None},
                            record=not no_record, device=resolve_device(device), plot=plot)
    given_module = [k for k, v in {**module_opts, "plot": plot}.items() if v is not None] + (
        ["trust_factory"] if trust_factory else [])
    if given_module:
        raise PrunusError(f"--{given_module[0].replace('_', '-')} applies to a generic module dir (config.json kind "
                          f"module); {model_dir} is not one: drop it")

    given = {"max_tokens": max_tokens} if max_tokens is not None else {}
    r = get_spec(TRANSFORMER).load("evaluate")(model_dir, data=data, seq_len=seq_len, record=not no_record, device=resolve_device(device),
                           **given)
    table = Table(title=f"prunus eval {model_dir}", show_header=False)
    table.add_row("corpus", r["eval_corpus"])
    table.add_row("tokens scored", f"{r['val_tokens']:,} (windows of {r['seq_len']:,})")
    table.add_row("validation loss", f"{r['val_loss']:.4f} nats/token")
    # the count is named: training's last line scores --eval-tokens (65,536 by default), a longer slice
    table.add_row("bits per byte", f"{r['val_bpb']:.4f} on {r['val_tokens']:,} held-out tokens (--max-tokens)")
    table.add_row("unigram baseline", f"{r['unigram_bpb']:.4f} bits/byte")
    Console().print(table)
