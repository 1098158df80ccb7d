"""--dp-mode dataparallel for a generic module: nn.DataParallel in one process over every visible GPU, refused in
one line on a machine with fewer than 2 CUDA devices; the two-Linear toy trains under it to one process's losses."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.data.synthetic import synthetic_datasets
from prunus.train_parallel.data_parallel.data_parallel_single import cuda_devices
from prunus.train_parallel.module_config import ModuleTrainConfig
from prunus.train_parallel.module_trainer import train_module

DATA = "synthetic:classification?n=64&shape=8&classes=3&val=16"
BASE = dict(steps=4, batch_size=8, warmup_steps=1, eval_every=2, ckpt_every=0, progress=False)


@pytest.mark.parametrize("extra, needle", [
    ([], "--dp-mode dataparallel needs 2 or more CUDA devices; this machine has 0: use --nproc N for DDP"),
    (["--nproc", "2"], "drop --nproc (or use --nproc N for DDP)"),
    (["--zero", "3"], "drop --zero"),
    (["--pp-split", "fc2"], "drop --pp-split"),
])
def test_dataparallel_refusals_are_one_line(tmp_path, assert_user_error, monkeypatch, extra, needle):
    from prunus.train_parallel.data_parallel import data_parallel_single

    monkeypatch.setattr(data_parallel_single, "cuda_devices", lambda: 0)  # whatever this machine holds
    result = CliRunner().invoke(cli, ["train", "--model", "test_any_model:two_linear", "--data", DATA, "--dp-mode",
                                      "dataparallel", "--steps", "2", "--batch-size", "4", "--out",
                                      str(tmp_path / "run"), "--no-progress", *extra])
    assert_user_error(result, needle)
    assert not (tmp_path / "run").exists()


def test_ps_mode_is_refused_for_a_generic_module(tmp_path, assert_user_error):
    result = CliRunner().invoke(cli, ["train", "--model", "test_any_model:two_linear", "--data", DATA, "--dp-mode", "ps",
                                      "--out", str(tmp_path / "run"), "--no-progress"])
    assert_user_error(result, "--dp-mode 'ps': a generic module trains with ddp")


@pytest.mark.skipif(cuda_devices() < 2, reason="nn.DataParallel needs 2 or more CUDA devices; this machine has "
                                               f"{cuda_devices()}")
def test_two_linear_trains_under_dataparallel_to_one_process_losses(tmp_path):
    train, val = synthetic_datasets(DATA)
    one = train_module("test_any_model:two_linear", train, "classification",
                       ModuleTrainConfig(out=str(tmp_path / "one"), device="cuda", **BASE), val_dataset=val)
    dp = train_module("test_any_model:two_linear", train, "classification",
                      ModuleTrainConfig(out=str(tmp_path / "dp"), dp_mode="dataparallel", **BASE), val_dataset=val)
    assert len(dp.losses) == BASE["steps"] and dp.model_dir is not None
    assert dp.losses == pytest.approx(one.losses, abs=1e-4)
    assert dp.metrics["val_loss"] == pytest.approx(one.metrics["val_loss"], abs=1e-4)
    torch.cuda.synchronize()
