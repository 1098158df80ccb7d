"""ZeRO-Offload (--offload): AdamW's states and step on the host, parameters and gradients on the GPU.

On the CPU: OffloadedAdamW steps exactly as AdamW and round-trips its state; the dry run counts host and
device memory apart for ZeRO-0/1 and FSDP; a run asking for offload without a GPU is one line. On a CUDA
machine: one process trains to the same losses with and without --offload, and FSDP2 with CPUOffloadPolicy
on a one-rank mesh matches the plain model.
"""

import copy

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.train_parallel import TrainConfig
from prunus.train_parallel.launch.dry_run import memory_plan
from prunus.train_parallel.data_parallel.offload import OffloadedAdamW
from prunus.train_parallel.parallelize import resolve_layout

CUDA = torch.cuda.is_available()
BASE = dict(preset="tiny", model={"n_layers": 2}, seq_len=32, batch_size=8, steps=4, warmup_steps=1, eval_every=4,
            eval_tokens=1024, ckpt_every=0, max_corpus_bytes=100_000, progress=False)


def _model_and_groups(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return model, [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _steps(model, opt, n, start=0):
    gen = torch.Generator().manual_seed(1)
    for step in range(start + n):
        x = torch.randn(5, 8, generator=gen)
        if step < start:
            continue
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_offloaded_adamw_steps_exactly_as_adamw():
    ref, ref_groups = _model_and_groups()
    off, off_groups = _model_and_groups()
    _steps(ref, torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.95)), 5)
    opt = OffloadedAdamW(off_groups, lr=1e-2, betas=(0.9, 0.95), pin_memory=False)
    _steps(off, opt, 5)
    for a, b in zip(ref.parameters(), off.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values()) and len(opt.state) == 6


def test_offloaded_adamw_state_round_trips():
    model, groups = _model_and_groups()
    opt = OffloadedAdamW(groups, lr=1e-2, pin_memory=False)
    _steps(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _steps(model, opt, 2, start=3)
    again, again_groups = _model_and_groups(seed=5)  # other weights: loading must replace them, masters too
    again.load_state_dict(saved_model)
    opt2 = OffloadedAdamW(again_groups, lr=1e-2, pin_memory=False)
    opt2.load_state_dict(saved_opt)
    _steps(again, opt2, 2, start=3)
    for a, b in zip(model.parameters(), again.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dry_run_counts_host_and_device_apart():
    small = dict(preset="tiny", seq_len=64, batch_size=8)
    for zero in (0, 1):
        plain = memory_plan(TrainConfig(**small, zero=zero), 2)["bytes"]
        plan = memory_plan(TrainConfig(**small, zero=zero, offload=True), 2)
        b = plan["bytes"]
        stepped = b["optimizer"] // 2  # AdamW: two fp32 moments (+ 4-byte steps) per stepped parameter byte
        assert plan["layout"]["offload"] and b["model_state"] == plain["model_state"]
        assert b["total_peak"] == plain["total_peak"] - b["optimizer"]  # the states left the device
        assert abs(b["host"] - (b["optimizer"] + 2 * stepped)) <= b["optimizer"] * 0.01  # + masters + host grads
    fsdp = memory_plan(TrainConfig(**small, zero=3, offload=True), 2)["bytes"]
    assert fsdp["host"] == fsdp["model_state"]
    # ZeRO-1 offloads this rank's optimizer shard only: half of ZeRO-0's at 2 ranks
    z0 = memory_plan(TrainConfig(**small, zero=0, offload=True), 2)["bytes"]
    z1 = memory_plan(TrainConfig(**small, zero=1, offload=True), 2)["bytes"]
    assert z1["host"] < z0["host"]


@pytest.mark.skipif(CUDA, reason="a CUDA device is present: offload can run")
def test_offload_without_gpu_is_one_line():
    with pytest.raises(PrunusError, match="no GPU") as e:
        resolve_layout(TrainConfig(**BASE, offload=True), 1)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not CUDA, reason="offload moves optimizer states off a CUDA device; this machine has none")
@pytest.mark.parametrize("zero", [0, 1])
def test_offload_trains_to_the_same_losses_on_cuda(tmp_path, zero):
    from prunus.train_parallel import train

    plain = train(TrainConfig(**BASE, out=str(tmp_path / "plain"), device="cuda", zero=zero))
    off = train(TrainConfig(**BASE, out=str(tmp_path / "off"), device="cuda", zero=zero, offload=True))
    print(f"zero {zero}: losses {plain.losses} vs offload {off.losses}")
    for a, b in zip(off.losses, plain.losses):
        assert abs(a - b) <= 1e-5
    assert abs(off.metrics["val_loss"] - plain.metrics["val_loss"]) <= 1e-5


@pytest.mark.skipif(not CUDA, reason="FSDP2's CPUOffloadPolicy needs a CUDA device; this machine has none")
def test_fsdp2_cpu_offload_policy_matches_on_cuda(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from prunus.models import Transformer, get_preset
    from prunus.train_parallel.data_parallel.data_parallel import apply_fsdp
    from prunus.train_parallel.parallelize import cross_entropy

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = get_preset("tiny").replace(n_layers=2)
        ref = Transformer(cfg)
        ref.init_weights()
        off = copy.deepcopy(ref)
        ref.cuda()
        apply_fsdp(off, init_device_mesh("cuda", (1,)), zero=3, cpu_offload=True)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, off)]
        gen = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(4):
            x, y = (torch.randint(0, cfg.vocab_size, (4, 32), generator=gen).cuda() for _ in range(2))
            step = []
            for model, opt in zip((ref, off), opts):
                loss = cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                step.append(float(loss))
            losses.append(step)
        print(f"FSDP2 CPUOffloadPolicy losses (plain, offloaded): {losses}")
        assert all(p.device.type == "cpu" for p in off.parameters())  # the shards live on the host
        for a, b in losses:
            assert abs(a - b) <= 1e-5
    finally:
        dist.destroy_process_group()


def test_zero1_shards_the_offloaded_optimizer(tmp_path):
    """ZeroRedundancyOptimizer over OffloadedAdamW (--zero 1 --offload) steps as AdamW (one gloo rank here)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ref, ref_groups = _model_and_groups()
        off, off_groups = _model_and_groups()
        _steps(ref, torch.optim.AdamW(ref_groups, lr=1e-2), 3)
        zero = ZeroRedundancyOptimizer(off_groups, optimizer_class=OffloadedAdamW, lr=1e-2, pin_memory=False)
        _steps(off, zero, 3)
        assert isinstance(zero.optim, OffloadedAdamW) and zero.optim.state
        for a, b in zip(ref.parameters(), off.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_training_builds_the_offloaded_optimizer_for_zero0_and_zero1():
    from prunus.models import Transformer
    from prunus.train_parallel.trainer import build_optimizer

    model = Transformer(TrainConfig(**BASE).model_config())
    for zero in (0, 1):
        assert isinstance(build_optimizer(model, TrainConfig(**BASE, zero=zero, offload=True)), OffloadedAdamW)
    assert type(build_optimizer(model, TrainConfig(**BASE, zero=0))) is torch.optim.AdamW
