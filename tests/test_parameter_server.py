"""The parameter server (--dp-mode ps) and single-process DataParallel (--dp-mode dataparallel).

One 4-rank spawn serves every multi-process check: DDP over the 4 ranks (the reference: every layout trains to
one process's losses), the synchronous parameter server with 2 servers and 2 workers (DDP's losses within
1e-5), and the asynchronous one with staleness bound K = 1 and worker 1 slowed down (the bound holds, and the
fast worker does run ahead up to it).
"""

from pathlib import Path

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.train_parallel import TrainConfig
from prunus.train_parallel.parallelize import resolve_layout
from prunus.train_parallel.data_parallel.parameter_server import shard_plan

WORKER = Path(__file__).with_name("parameter_server_worker.py")
BASE = dict(preset="tiny", model={"n_layers": 2}, seq_len=32, batch_size=8, steps=3, warmup_steps=1, eval_every=3,
            eval_tokens=1024, ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory, spawn_jobs):
    tmp = tmp_path_factory.mktemp("ps")
    jobs = [
        {"name": "ddp", "config": {**BASE, "out": str(tmp / "ddp"), "zero": 0}},
        {"name": "ps_sync", "config": {**BASE, "out": str(tmp / "sync"), "dp_mode": "ps", "ps_servers": 2}},
        {"name": "ps_async", "config": {**BASE, "out": str(tmp / "async"), "dp_mode": "ps", "ps_servers": 2,
                                        "ps_staleness": 1, "steps": 6}, "slow_workers": {"1": 0.4}},
    ]
    return spawn_jobs(WORKER, 4, jobs, tmp)


def _ok(results, name):
    got = results[name]
    assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
    return got


def test_synchronous_parameter_server_matches_ddp(four_rank):
    ddp, ps = _ok(four_rank, "ddp"), _ok(four_rank, "ps_sync")
    assert len(ps["losses"]) == len(ddp["losses"]) == BASE["steps"]
    for step, (a, b) in enumerate(zip(ps["losses"], ddp["losses"])):
        assert abs(a - b) <= 1e-5, f"step {step + 1}: parameter server {a} vs DDP {b}"
    assert abs(ps["val_loss"] - ddp["val_loss"]) <= 1e-5
    assert ps["ps"]["max_lead"] == 0 and ps["ps"]["mode"] == "sync"


def test_asynchronous_parameter_server_holds_the_staleness_bound(four_rank):
    got = _ok(four_rank, "ps_async")
    stats = got["ps"]
    # the slow worker lags; the fast one runs ahead, but never more than K = 1 step beyond the slowest
    assert stats["max_lead"] == 1, stats
    assert 0 < stats["max_staleness_versions"] <= (1 + 1) * 2 - 1  # (K + 1) x workers - 1 optimizer steps
    assert len(got["losses"]) == 6 and all(loss == loss for loss in got["losses"])  # every step reported, no NaN
    assert got["losses"][-1] < got["losses"][0]  # and it trains


def test_shard_plan_balances_whole_tensors():
    params = [(f"p{i}", torch.empty(n)) for i, n in enumerate([100, 60, 50, 10, 5])]
    owner = shard_plan(params, 2)
    loads = [sum(p.numel() for (_, p), o in zip(params, owner) if o == s) for s in range(2)]
    assert owner == [0, 1, 1, 0, 0] and loads == [115, 110]


@pytest.mark.parametrize("changes, message", [
    (dict(tp=2), "does not compose with --tp 2"),
    (dict(ps_servers=4), "leaves no worker"),
    (dict(zero=1), "keeps the optimizer on the servers"),
    (dict(batch_size=9), "not divisible by ps workers"),
])
def test_parameter_server_bad_layouts_are_one_line(changes, message):
    cfg = TrainConfig(**{**BASE, "dp_mode": "ps", "ps_servers": 2, "nproc": 4, **changes})
    with pytest.raises(PrunusError, match=message) as e:
        resolve_layout(cfg, 4)
    assert "\n" not in str(e.value)


def test_dataparallel_refuses_several_processes():
    with pytest.raises(PrunusError, match="runs in one process"):
        resolve_layout(TrainConfig(**BASE, dp_mode="dataparallel", nproc=2), 2)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has several CUDA devices")
def test_dataparallel_needs_several_cuda_devices():
    with pytest.raises(PrunusError, match="needs more than one CUDA device"):
        resolve_layout(TrainConfig(**BASE, dp_mode="dataparallel"), 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="nn.DataParallel needs more than one CUDA device; this machine has "
                           f"{torch.cuda.device_count()}")
def test_dataparallel_matches_one_device(tmp_path):
    from prunus.train_parallel import train

    one = train(TrainConfig(**BASE, out=str(tmp_path / "one"), device="cuda"))
    dp = train(TrainConfig(**BASE, out=str(tmp_path / "dp"), device="cuda", dp_mode="dataparallel"))
    for a, b in zip(dp.losses, one.losses):
        assert abs(a - b) <= 1e-4


def test_each_dp_mode_is_one_strategy(tmp_path):
    """--dp-mode picks one strategy: its layout, its forward module, whether the dry run plans it, its loop."""
    from prunus.train_parallel import train
    from prunus.train_parallel.data_parallel.modes import DP_MODES, dp_mode
    from prunus.train_parallel.launch.dry_run import memory_plan

    assert DP_MODES == ("ddp", "ps", "dataparallel")
    assert [dp_mode(TrainConfig(**BASE, dp_mode=m)).name for m in DP_MODES] == list(DP_MODES)
    part = torch.nn.Linear(2, 2)
    assert dp_mode(TrainConfig(**BASE)).forward_module(part) is part
    wrapped = dp_mode(TrainConfig(**BASE, dp_mode="dataparallel")).forward_module(part)
    assert isinstance(wrapped, torch.nn.DataParallel) and wrapped.module is part
    with pytest.raises(PrunusError, match="--dp-mode sharded: choose one of ddp, ps, dataparallel"):
        TrainConfig(**BASE, dp_mode="sharded").validate()
    with pytest.raises(PrunusError, match="dry run: plans --dp-mode ddp layouts; --dp-mode ps"):
        memory_plan(TrainConfig(**BASE, dp_mode="ps", ps_servers=1), 2)
    with pytest.raises(PrunusError, match="--dp-mode ps trains a fresh model on cross-entropy"):
        train(TrainConfig(**BASE, out=str(tmp_path / "run"), dp_mode="ps"), objective=lambda logits, x, y: 0)
    assert not (tmp_path / "run").exists()
