"""prunus train --model ... --dry-run: the per-rank memory plan of a generic module and the command the run would
start, counted exactly on the two-Linear toy (fc1 8 -> 16, fc2 16 -> 3: 195 fp32 parameters, 780 bytes)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.train_parallel.launch.dry_run import fsdp_shard_numel, module_memory_plan
from prunus.train_parallel.module_config import ModuleTrainConfig

SPEC = "test_any_model:two_linear"
DATA = "synthetic:classification?n=16&shape=8&classes=3&val=8"
P = 780  # (8*16 + 16 + 16*3 + 3) * 4 bytes
ADAM = 2 * P + 4 * 4  # exp_avg + exp_avg_sq of every element, a 4-byte step per parameter


def _plan(**kw):
    cfg = ModuleTrainConfig(model=SPEC, data=DATA, batch_size=4, **kw)
    cfg.validate()
    return module_memory_plan(cfg, ["--model", SPEC])


def _bytes(plan, key):
    return [r[key] for r in plan["ranks"]]


def test_one_process_and_ddp():
    one = _plan()
    assert one["params_total"] == 195 and one["param_bytes_total"] == P and one["layout"] == "one process"
    assert one["ranks"] == [{"rank": 0, "params": P, "gathered": 0, "grads": P, "ddp_buckets": 0, "optimizer": ADAM,
                             "buffers": 0, "total_peak": 2 * P + ADAM}]
    assert one["command"] == f"prunus train --model {SPEC}"
    ddp = _plan(nproc=2, zero=0)
    assert ddp["layout"] == "DDP" and _bytes(ddp, "ddp_buckets") == [P, P] and _bytes(ddp, "optimizer") == [ADAM, ADAM]
    assert ddp["command"].startswith("torchrun --standalone --nproc-per-node=2 -m prunus.cli.main train --model")
    default = _plan(nproc=2)  # --zero defaults to 0: DDP, the whole module being one FSDP2 unit otherwise
    assert default["zero"] == 0 and default["layout"] == "DDP" and default["ranks"] == ddp["ranks"]


def test_zero1_partitions_whole_tensors_largest_first():
    plan = _plan(nproc=2, zero=1)
    # decayed: fc1.weight (128) -> rank 0, fc2.weight (48) -> rank 1; then fc1.bias (16), fc2.bias (3) -> rank 1
    assert _bytes(plan, "optimizer") == [2 * 128 * 4 + 4, 2 * 67 * 4 + 3 * 4]
    assert _bytes(plan, "params") == [P, P] and _bytes(plan, "grads") == [P, P]


def test_fsdp_chunks_rows_as_torch_chunk_does():
    plan = _plan(nproc=2, zero=3)
    assert plan["zero"] == 3 and plan["layout"] == "FSDP2 (ZeRO-3)"
    # rank 0: 8 rows of fc1 (64 + 8), 2 rows of fc2 (32 + 2) = 106 elements; rank 1: 64 + 8 + 16 + 1 = 89
    assert _bytes(plan, "params") == [106 * 4, 89 * 4] == _bytes(plan, "grads")
    assert _bytes(plan, "gathered") == [P - 106 * 4, P - 89 * 4]
    assert _bytes(plan, "optimizer") == [2 * 106 * 4 + 16, 2 * 89 * 4 + 16]
    t = torch.empty(3, 5)
    for world in (1, 2, 3, 4, 5):
        chunks = t.chunk(world)
        assert [fsdp_shard_numel(t, r, world) for r in range(world)] == \
            [chunks[r].numel() if r < len(chunks) else 0 for r in range(world)]


def test_pipeline_stages_hold_their_own_parameters():
    plan = _plan(nproc=2, pp_split="fc2")
    assert _bytes(plan, "params") == [(128 + 16) * 4, (48 + 3) * 4] == _bytes(plan, "grads")
    assert _bytes(plan, "optimizer") == [2 * 144 * 4 + 8, 2 * 51 * 4 + 8]
    assert plan["layout"].startswith("pipeline, 2 stages")


def test_cli_dry_run_prints_the_plan_and_starts_nothing(tmp_path, monkeypatch, assert_user_error):
    from prunus.train_parallel.launch import launch

    monkeypatch.setattr(launch, "launch_ranks", lambda *a: pytest.fail("a process was started"))
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--model", SPEC, "--data", DATA, "--nproc", "2", "--zero", "1",
                                      "--batch-size", "4", "--out", str(out), "--dry-run"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "DDP + ZeRO-1" in result.output and "195 parameters" in result.output and f"{2 * 128 * 4 + 4:,}" in result.output
    assert "would run: torchrun --standalone --nproc-per-node=2 -m prunus.cli.main train" in result.output
    assert "--zero 1" in result.output and "--dry-run" not in result.output.split("would run:")[1]
    assert not out.exists()
    bad = CliRunner().invoke(cli, ["train", "--model", SPEC, "--data", DATA, "--nproc", "2", "--tp", "2",
                                   "--tp-plan", "p.json", "--batch-size", "4", "--out", str(out), "--dry-run"])
    assert_user_error(bad, "--dry-run with --tp")
    assert not out.exists()
