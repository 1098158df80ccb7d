"""prunus export: a model dir -> ONNX Runtime or TensorRT export dir, with a parity report."""

from __future__ import annotations

import os
import shlex
import sys

import click

from prunus.export.formats import FORMATS, GRAPHS, PRECISIONS

from .tables import Column, console_for_tables, print_fitted

PARITY_COLUMNS = [Column("check", justify="left", text=True), Column("value", justify="left"),
                  Column("limit", justify="left"), Column("", justify="left")]


MODULE_CHECKS = [("max |Δoutputs|", "max_abs_outputs", "{:.3g}"), ("top-1 agreement", "top1_agreement", "{:.4f}"),
                 ("output MSE / output variance", "output_rel_mse", "{:.3g}"),
                 ("MSE increase against targets", "mse_increase", "{:+.3f}")]
MODULE_FACTS = [("int8 method", "int8_method", "{}"), ("int8 share of parameters", "int8_param_share", "{:.1%}"),
                ("left float", "float_ops", "{}"), ("calibration", "calibration", "{}")]


def print_parity(console, title: str, report: dict) -> None:
    """The parity report as a table: each check's value beside its limit."""
    tol = report["tolerances"]
    if "max_abs_outputs" in report:  # a generic module's report (prunus.export.module_export)
        rows = [[label, fmt.format(report[key]), str(tol.get(key, "-")), "[red]FAIL" if key in report["failed"] else
                 "[green]ok"] for label, key, fmt in MODULE_CHECKS if key in report]
        rows += [[label, fmt.format(", ".join(report[key]) if isinstance(report[key], list) else report[key]), "", ""]
                 for label, key, fmt in MODULE_FACTS if report.get(key) not in (None, [], "")]
        rows.append(["inputs", report.get("inputs", str(report["samples"])), "", ""])
        print_fitted(console, PARITY_COLUMNS, rows, title=title)
        return
    checks = [("max |Δlogits|", "max_abs_logits", "{:.3g}"), ("top-1 agreement", "top1_agreement", "{:.4f}"),
              ("bits/byte increase", "bpb_increase", "{:+.5f}"), ("greedy agreement (64 tokens)", "greedy_agreement", "{:.4f}"),
              ("decode agreement (teacher-forced)", "decode_agreement", "{:.4f}")]
    rows = []
    for label, key, fmt in checks:
        limit = tol.get(key)
        ok = "[red]FAIL" if key in report["failed"] else ("[green]ok" if limit is not None else "")
        rows.append([label, fmt.format(report[key]), "-" if limit is None else str(limit), ok])
    rows.append(["bits/byte torch / onnx", f"{report['bpb_torch']:.4f} / {report['bpb_onnx']:.4f}", "", ""])
    print_fitted(console, PARITY_COLUMNS, rows, title=title)


@click.command("export")
@click.argument("model_dir", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="onnx", show_default=True,
              help="onnx: ONNX Runtime graphs; tensorrt: TensorRT engines built from them (needs a GPU).")
@click.option("--out", required=True, type=click.Path(), help="Export dir to write.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Default: the model's own (fp32, or int8 / fp8 for a compressed dir).")
@click.option("--opset", type=int, default=None, help="ONNX opset. Default: 23 for onnx, 18 for tensorrt, or what the quantization needs.")
@click.option("--no-verify", is_flag=True, help="Keep the export even if the parity check fails.")
@click.option("--data", default=None,
              help="Held-out text for the parity check. Default: the slice prunus eval scores (English prose "
                   "shipped with Python for a pretrained tokenizer, the built-in corpus for a byte-level one). "
                   "A generic module: an ImageFolder dir or synthetic:... spec (default: random inputs of its shape; "
                   "static int8 calibrates on its training split, on random inputs only with --data random).")
@click.option("--external-data", is_flag=True, help="Store weights in .data files (automatic above 1.5 GB).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--graph", type=click.Choice(GRAPHS), default=None,
              help="genai: one graph on ONNX Runtime's fused operators (GroupQueryAttention, shared KV buffer); "
                   "torch: prefill and decode graphs from torch.onnx.export. Default: genai where it supports the model.")
@click.option("--trust-factory", is_flag=True,
              help="A generic module's model dir: import the factory its config.json names (that runs its code). "
                   "Or list trusted specs in PRUNUS_TRUST_FACTORIES.")
def command(model_dir, fmt, out, precision, opset, no_verify, data, external_data, overwrite, graph, trust_factory):
    """Export MODEL_DIR to ONNX Runtime or TensorRT and check it against PyTorch."""
    from prunus.export import ParityFailed, export_model

    if trust_factory and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a trusted factory's module may sit in the current directory
    console = console_for_tables()
    try:
        result = export_model(model_dir, out, format=fmt, precision=precision, opset=opset, verify=not no_verify,
                              data=data, overwrite=overwrite, external_data=external_data or None, graph=graph,
                              command=shlex.join(["prunus", *sys.argv[1:]]), trust_factory=trust_factory)
    except ParityFailed as e:
        print_parity(console, f"parity {model_dir} ({e.report['precision']})", e.report)
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    exp = result.config["export"]
    print_parity(console, f"parity {out} ({exp['format']}, {exp['precision']})", result.parity)
    if len(result.parity.get("runtimes") or {}) > 1:  # each runtime that may serve it, the native kernels too
        from pathlib import Path

        from .info import parity_tables

        for table in parity_tables(Path(out)):
            console.print(table)
    if not result.parity["passed"]:
        console.print("[yellow]parity check failed; kept because of --no-verify")
    files = [v for v in exp["graphs"].values() if isinstance(v, str)]
    console.print(f"wrote {out}: {', '.join(files)}, parity.json")
