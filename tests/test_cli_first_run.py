"""What a first run on a fresh machine meets: a mistyped flag answers at once, the CLI's stderr holds prunus's
lines only, the help names what ships (int4 recipes, which offload flag does what), figures say what they
measured, and the Makefile installs torch's CPU build and says how to put prunus on PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from prunus.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]


def _prunus(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed ``prunus`` script, as a user runs it."""
    exe = Path(sys.executable).with_name("prunus")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_an_unknown_preset_fails_at_once_without_torch():
    """The command line is validated before torch and its checkpoint code are imported."""
    code = ("import sys, time\nt0 = time.perf_counter()\nsys.argv = ['prunus', 'train', '--preset', 'huge']\n"
            "from prunus.cli.main import main\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "print('RESULT', code, round(time.perf_counter() - t0, 2), 'torch' in sys.modules,"
            " 'torch.distributed.checkpoint' in sys.modules)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    assert r.stderr.strip() == "Error: unknown preset 'huge'; choose one of: tiny, small, base, llama-1b, llama-8b"
    _, code, _, torch_loaded, dcp_loaded = r.stdout.split()
    assert (code, torch_loaded, dcp_loaded) == ("2", "False", "False"), r.stdout
    if os.getloadavg()[0] < (os.cpu_count() or 1):  # on an overloaded machine only the import check means anything
        assert wall < 3, wall


def test_convert_from_hf_writes_prunus_lines_only(tmp_path, trained_run):
    """No third-party start-up noise (torchao's kernel libraries, torch's pytree deprecations) on stderr."""
    from prunus.models.hf_convert import to_hf

    to_hf(trained_run / "model", tmp_path / "hf")
    r = _prunus("convert", "--from-hf", "hf", "--out", "model", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "wrote model"
    assert r.stderr == "", r.stderr


def test_the_cli_keeps_third_party_start_up_warnings_quiet():
    """Should a library the command imports log them, the CLI's process does not show them; errors still show."""
    code = ("import logging\nfrom prunus.cli.main import QUIET_LOGGERS, prepare_process\nprepare_process()\n"
            "logging.getLogger('torchao').warning('Failed to load _C_mxfp8.so')\n"
            "logging.getLogger('torch.utils._pytree').warning('register_constant() on Enum subclasses is deprecated')\n"
            "logging.getLogger('torchao').error('a real error')\nprint(sorted(QUIET_LOGGERS))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "['torch.utils._pytree', 'torchao']"
    assert r.stderr.strip() == "a real error"


def test_compress_help_lists_every_shipped_recipe_int4_included():
    r = CliRunner().invoke(cli, ["compress", "--help"])
    assert r.exit_code == 0
    flat = re.sub(r"\s+", "", r.output)  # click wraps long names at their hyphens
    shipped = sorted(p.stem for p in (ROOT / "compress" / "recipes").glob("*.yaml"))
    assert any(name.startswith("int4-") for name in shipped)
    for name in shipped:
        assert name in flat, name


def test_train_help_tells_the_two_offload_flags_apart():
    from prunus.cli.train import command

    helps = {p.name: p.help for p in command.params if p.name in ("cpu_offload", "offload")}
    assert "FSDP only (--zero 2/3)" in helps["cpu_offload"] and "no effect under --zero 0/1" in helps["cpu_offload"]
    assert "any --zero" in helps["offload"] and "under 2/3 the same as --cpu-offload" in helps["offload"]


def test_info_shows_checkpoints_as_steps():
    from prunus.cli.info import checkpoint_steps

    assert checkpoint_steps([]) == "none"
    assert checkpoint_steps([20]) == "step 20"
    assert checkpoint_steps([10, 20, 1000]) == "steps 10, 20, 1,000"


def test_train_and_eval_name_the_tokens_behind_their_bits_per_byte(tmp_path, tiny_cfg, capsys, trained_run):
    """Training scores --eval-tokens, eval its own (shorter) slice: each figure says how many tokens it is over."""
    from prunus.models import read_manifest
    from prunus.train_parallel import train

    train(tiny_cfg(tmp_path / "run", steps=2, eval_every=2, eval_tokens=512, max_corpus_bytes=50_000, progress=True))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"bits/byte on 512 held-out tokens\)$", last), last
    assert read_manifest(tmp_path / "run" / "model")["metrics"]["val_tokens"] == 512
    model = tmp_path / "model"
    shutil.copytree(trained_run / "model", model)
    r = CliRunner().invoke(cli, ["eval", str(model), "--max-tokens", "256", "--no-record"])
    assert r.exit_code == 0, r.output
    assert re.search(r"bits per byte\s*│?\s*[\d.]+ on 256 held-out tokens", r.output), r.output


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_install_takes_torch_from_the_cpu_index_and_says_how_to_activate(tmp_path):
    def plan(*overrides: str) -> str:
        r = subprocess.run(["make", "-n", "-B", "install", f"VENV={tmp_path / 'venv'}", *overrides], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    default = plan()
    assert "index='https://download.pytorch.org/whl/cpu'" in default
    assert '--extra-index-url "$index"} torch==2.13.0' in default
    assert f"source {tmp_path / 'venv'}/bin/activate" in default
    assert "index=''" in plan("TORCH_INDEX=")
