"""The parallel CLI: bad layouts fail before any process starts, launch with --nproc, Slurm, config files."""

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.train_parallel import read_metrics
from prunus.train_parallel.launch.launch import first_slurm_host

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--warmup-steps", "1", "--eval-tokens", "1024",
        "--max-corpus-bytes", "100000", "--no-progress"]


def run(*args, env=None):
    return CliRunner(env=env).invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("args, needles", [
    (["--nproc", 2, "--tp", 2, "--pp", 2], ["world size 2"]),
    (["--nproc", 4, "--dp-shard", 1, "--tp", 2], ["= 2 but the world size is 4"]),
    (["--nproc", 4, "--tp", 4], ["--tp 4 does not divide", "n_kv_heads"]),
    (["--nproc", 4, "--pp", 4], ["--pp 4 is larger than the model's 2 blocks"]),
    (["--nproc", 2, "--pp", 2, "--pp-schedule", "1F1B", "--microbatches", 1], ["--microbatches 1 is too few for 1F1B"]),
    (["--nproc", 2, "--pp", 2, "--pp-schedule", "Nope"], ["--pp-schedule Nope: unknown"]),
    (["--nproc", 4, "--tp", 2, "--zero", 0], ["--zero 0 (DDP) composes with data parallelism alone"]),
])
def test_bad_layouts_fail_before_starting(tmp_path, args, needles, assert_user_error):
    t0 = time.time()
    assert_user_error(run("train", *TINY, *args, "--out", tmp_path / "o"), *needles)
    assert not (tmp_path / "o").exists() and time.time() - t0 < 30


def test_slurm_environment_that_disagrees_with_the_flags(tmp_path, assert_user_error):
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[01-02]"}
    for k in ("WORLD_SIZE", "RANK"):
        os.environ.pop(k, None)
    assert_user_error(run("train", *TINY, "--nproc", 2, "--out", tmp_path / "o", env=env), "--nproc 2", "4 processes")
    assert_user_error(run("train", *TINY, "--tp", 3, "--out", tmp_path / "o", env=env), "world size 4")
    assert first_slurm_host("gpu[01-02,7],cpu3") == "gpu01" and first_slurm_host("node5") == "node5"


def test_resuming_from_a_checkpoint_of_another_model(tmp_path, assert_user_error):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("train", *TINY, "--steps", 4, "--stop-at", 2, "--out", a).exit_code == 0
    assert run("train", *TINY, "--seq-len", 16, "--preset", "small", "--steps", 4, "--stop-at", 2, "--out", b,
               "--batch-size", 2).exit_code == 0
    for d in (b / "checkpoints").iterdir():
        import shutil

        shutil.rmtree(d)
        shutil.copytree(a / "checkpoints" / "step-2", d)
    assert_user_error(run("train", "--resume", "--out", b), "does not fit this model")


def test_print_config_and_config_file(tmp_path, assert_user_error):
    r = run("train", *TINY, "--tp", 2, "--print-config")
    assert r.exit_code == 0 and 'preset = "tiny"' in r.stdout and "tp = 2" in r.stdout
    (tmp_path / "run.toml").write_text(r.stdout + "\n[model]\nn_layers = 3\n")
    r = run("train", "--config", tmp_path / "run.toml", "--steps", 7, "--print-config")
    assert "steps = 7" in r.stdout and "tp = 2" in r.stdout and "n_layers = 3" in r.stdout
    (tmp_path / "bad.toml").write_text("stepz = 3\n")
    assert_user_error(run("train", "--config", tmp_path / "bad.toml"), "unknown setting(s) stepz")


def test_print_slurm():
    r = run("train", "--preset", "small", "--tp", 4, "--pp", 4, "--print-slurm", "--nodes", 4, "--gpus-per-node", 8)
    assert r.exit_code == 0, r.output
    assert "#SBATCH --nodes=4" in r.stdout and "#SBATCH --ntasks-per-node=8" in r.stdout
    assert "srun prunus train --preset small --tp 4 --pp 4" in r.stdout and "--nodes" not in r.stdout.split("srun")[1]


@pytest.mark.parametrize("args, needles", [
    (["--tp", 8, "--pp", 4, "--nodes", 4, "--gpus-per-node", 8], ["--tp 8 does not divide", "n_kv_heads"]),
    (["--tp", 3, "--nodes", 1, "--gpus-per-node", 2], ["world size 2"]),
])
def test_print_slurm_refuses_a_layout_the_job_would_refuse(args, needles, assert_user_error):
    """The layout is checked against the model for nodes x gpus-per-node ranks, as --dry-run checks it."""
    r = run("train", "--print-slurm", *args)
    assert_user_error(r, *needles)
    assert "#SBATCH" not in r.stdout


def test_launchers_check_the_layout_first():
    """The library's launchers refuse a bad layout before writing or starting anything."""
    from prunus.artifacts.errors import PrunusError
    from prunus.train_parallel import TrainConfig
    from prunus.train_parallel.launch.launch import launch_local
    from prunus.train_parallel.launch.slurm import sbatch_script

    with pytest.raises(PrunusError, match="does not divide"):
        sbatch_script(TrainConfig(tp=8, pp=4), 4, 8, ["--tp", "8", "--pp", "4"])
    with pytest.raises(PrunusError, match="world size 2"):
        launch_local(TrainConfig(nproc=2, tp=3), ["train", "--nproc", "2", "--tp", "3"])


def test_nproc_launch_trains_like_one_process(tmp_path):
    """prunus train --nproc 2 starts torchrun itself; FSDP x 2 ends where one process ends."""
    common = [*TINY, "--steps", 4, "--eval-every", 4]
    ref = run("train", *common, "--out", tmp_path / "ref")
    assert ref.exit_code == 0, ref.output
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "prunus.cli.main", "train", *map(str, common), "--nproc", "2",
                           "--out", str(tmp_path / "job")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = read_metrics(tmp_path / "job"), read_metrics(tmp_path / "ref")
    assert [r["step"] for r in ours] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5
    assert abs(ours[-1]["val_loss"] - theirs[-1]["val_loss"]) <= 1e-5
    assert len(ours[-1]["peak_mem_bytes"]) == 2
    run_json = json.loads((tmp_path / "job" / "run.json").read_text())
    assert run_json["world_size"] == 2 and run_json["train"]["zero"] == 3
    assert (tmp_path / "job" / "model" / "prunus.json").is_file()
