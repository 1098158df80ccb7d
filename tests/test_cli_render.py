"""What the CLI prints: tables that fit an 80-column terminal without cutting a number, info that shows a run's
model and data (and no MoE fields for a dense model), a train summary that names the model dir once."""

from __future__ import annotations

import io
import re
import shutil

from click.testing import CliRunner
from rich.console import Console

from prunus.cli.compress import print_report
from prunus.cli.main import cli
from prunus.cli.tables import Column, console_for_tables, print_fitted

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "2",
        "--eval-tokens", "1024", "--max-corpus-bytes", "100000"]


def fake_report(latency: bool = True) -> dict:
    """A compression report as compress() returns it, with long figures."""
    rows = []
    for i, name in enumerate(["input", "distill keep-every:2 (steps 200)", "prune wanda 0.5", "quantize w8a8-dynamic"]):
        row = {"pass": name, "val_loss": 1.987654 + i, "val_bpb": 2.871634 + i / 1000, "bpb_change": 0.0123 * i,
               "agreement": 1 - 0.01 * i, "params": 134_515_008 - i * 1_000_000, "bytes": 538_060_032 // (i + 1),
               "val_tokens": 4096}
        if latency:
            row.update(prefill_ms=1234.56 + i, decode_ms=33.11 + i, prefill_tokens=128)
        rows.append(row)
    return {"out": "runs/demo/a-long-output-directory-name/int8", "corpus": "prose", "seq_len": 1024, "rows": rows}


def render(report: dict, width: int) -> str:
    buffer = io.StringIO()
    print_report(Console(file=buffer, width=width, force_terminal=False), report)
    return buffer.getvalue()


def test_compress_table_in_80_columns_never_cuts_a_number():
    report = fake_report()
    text = render(report, 80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for figure in ("2.8716", "2.8746", "+3.69%", "538.060", "134,515,008"):  # whole figures, however wrapped
        assert figure in text, figure
    footnote = [line for line in text.splitlines() if line.startswith("not shown at this width")]
    assert len(footnote) == 1 and "prefill 128 ms" in footnote[0] and "decode ms" in footnote[0]
    wide = render(report, 200)  # a wide terminal: every column, no footnote
    assert "prefill 128 ms" in wide and "not shown" not in wide and "…" not in wide


def test_every_fitted_table_keeps_whole_numbers_at_any_width():
    columns = [Column("name", justify="left", text=True), Column("a"), Column("b", priority=1), Column("c", priority=2)]
    rows = [["a long name that wraps over lines", "123,456,789.123", "0.000012345", "-98765.4321"]]
    for width in (40, 60, 80):
        buffer = io.StringIO()
        print_fitted(Console(file=buffer, width=width), columns, rows, title="t")
        text = buffer.getvalue()
        assert "…" not in text and "123,456,789.123" in text, text


def test_columns_env_sets_the_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert console_for_tables().width == 80
    monkeypatch.delenv("COLUMNS")
    assert console_for_tables().width >= 150  # a pipe or file keeps whole rows


def test_info_of_a_dense_model_and_of_a_run_dir(tmp_path, trained_run):
    r = CliRunner().invoke(cli, ["info", str(trained_run / "model")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "n_kv_heads" in r.output and not re.search(r"n_experts|moe_|capacity_factor|\btop_k\b", r.output)
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.rmtree(run / "model")  # a run still training: its model is described by run.json
    r = CliRunner().invoke(cli, ["info", str(run)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "model {}" not in r.output and not re.search(r"│ data\s+│ None", r.output)
    assert re.search(r"│ data\s+│ builtin", r.output) and re.search(r"│ n_kv_heads\s+│ 2", r.output)


def test_train_summary_names_the_model_dir_once(tmp_path):
    for progress in ("--progress", "--no-progress"):
        r = CliRunner().invoke(cli, ["train", *TINY, "--steps", "2", progress, "--out", str(tmp_path / progress)])
        assert r.exit_code == 0, r.output
        assert r.output.count("model dir:") == 1, r.output
