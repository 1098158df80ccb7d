"""``--device`` is checked against what torch can use on this machine before anything is loaded: a device that
is not here (cuda without a GPU, cuda:N past the last GPU), an unknown type (tpu:9) or a malformed name is one
line naming --device and the devices to use instead, exit 2, on every command that takes the flag."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.models.device import check_device, usable_devices

NO_GPU = not torch.cuda.is_available()
PAST_THE_LAST = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"

REFUSED = [
    ("tpu:9", "not a valid device"),
    ("cpu,x", "not a valid device"),
    ("", "not a valid device"),
    ("cuda:-1", "not a valid device"),
    ("cpu:1", "the CPU is one device"),
    ("meta", "meta is not a device prunus runs on"),
    (PAST_THE_LAST, "not available on this machine (torch sees no GPU)" if NO_GPU else "this machine has"),
]
if NO_GPU:
    REFUSED += [("cuda", "cuda is not available on this machine (torch sees no GPU)"),
                ("cuda:0", "cuda is not available on this machine")]


@pytest.mark.parametrize("name, words", REFUSED, ids=[r[0] or "empty" for r in REFUSED])
def test_a_device_torch_cannot_use_here_is_one_line(name, words):
    with pytest.raises(PrunusError) as e:
        check_device(name)
    msg = str(e.value)
    assert msg.startswith(f"--device {name!r}: ") and words in msg and "\n" not in msg, msg
    assert msg.endswith(f"use {', '.join(usable_devices()[:-1])} or {usable_devices()[-1]}")


def test_the_devices_this_machine_has_are_taken():
    for name in usable_devices():
        assert check_device(name) == name
    assert {"auto", "cpu"} <= set(usable_devices())
    assert check_device("cpu:0") == "cpu:0"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


MISSING = "/nonexistent/prunus-model"  # a device error comes before any read of the model

COMMANDS = {
    "generate": ["generate", MISSING, "--prompt", "hi", "--max-new-tokens", "1"],
    "eval": ["eval", MISSING],
    "serve": ["serve", MISSING, "--port", "0"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("device", ["tpu:9", PAST_THE_LAST, "cpu:3"] + (["cuda"] if NO_GPU else []))
def test_every_command_with_device_refuses_it_before_loading(command, device, assert_user_error):
    r = run(*COMMANDS[command], "--device", device)
    assert_user_error(r, f"--device {device!r}: ", "; use auto")


@pytest.mark.parametrize("device", ["tpu:9", PAST_THE_LAST])
def test_train_refuses_the_device_before_any_run_dir(tmp_path, device, assert_user_error):
    out = tmp_path / "run"
    assert_user_error(run("train", "--preset", "tiny", "--steps", "1", "--out", out, "--device", device), "--device")
    assert not out.exists()
    module = ["train", "--model", "torch.nn:Linear", "--model-args", "in_features=4,out_features=2",
              "--data", "synthetic:regression?n=8&shape=4&outputs=2", "--out", out, "--device", device]
    assert_user_error(run(*module), f"--device {device!r}: ")
    assert not out.exists()


def test_a_job_printed_for_another_machine_keeps_its_device(tmp_path):
    r = run("train", "--preset", "tiny", "--out", tmp_path / "run", "--device", "cuda", "--print-slurm", "--nodes", "2")
    assert r.exit_code == 0, r.output
    assert "--device cuda" in r.output
