"""The dry run's memory plan: any world size on the meta device, checked against real tensors and exact shares."""

import io
import re
import resource

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset
from prunus.train_parallel import TrainConfig
from prunus.train_parallel.activation_checkpointing import apply_ac
from prunus.train_parallel.launch.dry_run import memory_plan
from prunus.train_parallel.launch.dry_run_table import render_plan
from prunus.train_parallel.parallelize import cross_entropy
from prunus.train_parallel.launch.saved_activations import SavedActivations
from prunus.train_parallel.trainer import build_optimizer

LLAMA_8B = dict(preset="llama-8b", tp=8, pp=4, dp_shard=32, zero=3, batch_size=128, microbatches=4)
SMALL = dict(seq_len=64, batch_size=8)


def _plan(world: int, rank: int = 0, **changes) -> dict:
    return memory_plan(TrainConfig(**{**SMALL, **changes}), world, rank)


def test_llama_8b_on_1024_ranks_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    plan = memory_plan(TrainConfig(**LLAMA_8B), 1024)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 1 << 20, f"the dry run grew the process by {grown} KiB"  # the real fp32 weights are 32 GB
    assert not dist.is_initialized()
    b = plan["bytes"]
    assert plan["world_size"] == 1024 and plan["stage_ids"] == [0] and plan["in_flight"] == 4
    assert plan["layout"] == {**plan["layout"], "dp_shard": 32, "tp": 8, "pp": 4, "zero": 3, "fsdp": True}
    share = plan["model_params"] * 4 / (8 * 4 * 32)  # fp32 weights split over every dim
    assert abs(b["params"] / share - 1) < 0.10
    assert b["grads"] == b["params"] and abs(b["optimizer"] / (2 * b["params"]) - 1) < 0.01
    assert b["params_peak"] > b["params"] and b["activations"] > 0 and b["ddp_buckets"] == 0
    assert b["total_peak"] == b["model_state"] + b["params_peak"] - b["params"] + b["buffers"] + b["activations"]
    last = memory_plan(TrainConfig(**LLAMA_8B), 1024, rank=1023)  # the last stage: the head, one micro-batch in flight
    assert last["stage_ids"] == [3] and last["in_flight"] == 1
    out = io.StringIO()
    Console(file=out, width=160).print(render_plan(plan))
    assert "1,024" in out.getvalue() and "optimizer state" in out.getvalue()


@pytest.mark.parametrize("world, changes, words", [
    (1000, LLAMA_8B, "world size is 1000"),  # tp*pp*dp_shard = 1024
    (1024, {**LLAMA_8B, "dp_shard": -1, "tp": 3, "pp": 1}, "not divisible"),
    (24, {**LLAMA_8B, "dp_shard": -1, "tp": 3, "pp": 1, "batch_size": 8}, "--tp 3 does not divide"),
    (4, dict(tp=2, zero=0), "--zero 0 (DDP) composes"),
    (2, dict(preset="tiny", pp=2, microbatches=3), "--microbatches"),
])
def test_invalid_layouts_raise_one_line(world, changes, words):
    with pytest.raises(PrunusError, match=re.escape(words)) as e:
        memory_plan(TrainConfig(**{**SMALL, **changes}), world)
    assert "\n" not in str(e.value)
    assert not dist.is_initialized()


def test_rank_outside_world_and_repeated_calls():
    with pytest.raises(PrunusError, match="rank 2 is outside"):
        _plan(2, rank=2, preset="tiny")
    assert _plan(2, preset="tiny", zero=3) == _plan(2, preset="tiny", zero=3)
    assert not dist.is_initialized()


def _measured_model_state(cfg: TrainConfig) -> int:
    """Bytes of parameters, gradients and AdamW state a real one-process run holds after one step."""
    torch.manual_seed(0)
    model = Transformer(cfg.model_config())
    model.init_weights()
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, cfg.model_config().vocab_size, (cfg.batch_size, cfg.resolved_seq_len()))
    cross_entropy(model(x), x).backward()
    opt.step()
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in params + [p.grad for p in params] + state)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_one_process_model_state_matches_a_real_step(preset):
    cfg = TrainConfig(preset=preset, **SMALL)
    measured = _measured_model_state(cfg)
    planned = memory_plan(cfg, 1)["bytes"]["model_state"]
    assert abs(planned / measured - 1) < 0.05, (planned, measured)


@pytest.mark.parametrize("ac", ["none", "full", "every-other", "selective"])  # selective: the old name of every-other
def test_one_process_activations_match_autograd(ac):
    """What autograd saves in one forward (plus the logits held for the loss), against the estimate;
    checkpointing adds one block's recomputation, which happens in backward."""
    cfg = TrainConfig(preset="tiny", activation_checkpointing=ac, **SMALL)
    plan = memory_plan(cfg, 1)
    model = Transformer(cfg.model_config()).train()
    apply_ac(model, ac)
    x = torch.randint(0, cfg.model_config().vocab_size, (cfg.batch_size, cfg.resolved_seq_len()))
    with SavedActivations(model) as saved:
        logits = model(x)
        cross_entropy(logits, x)
    saved.add(logits)
    measured = saved.bytes
    if ac != "none":
        s, b, c = cfg.resolved_seq_len(), cfg.batch_size, cfg.model_config()
        measured += s * b * (10 * c.dim + 4 * c.ffn_dim + 2 + c.n_heads) * 4  # one block recomputed in backward
    assert abs(plan["bytes"]["activations"] / measured - 1) < 0.05, (plan["bytes"]["activations"], measured)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_two_ranks_take_exact_shares(preset):
    one = _plan(1, preset=preset)["bytes"]
    n_tensors = len(list(Transformer(get_preset(preset)).parameters()))
    for zero in (2, 3):  # FSDP: each rank holds half of every tensor (all dims here are even: no padding)
        ranks = [_plan(2, r, preset=preset, zero=zero)["bytes"] for r in (0, 1)]
        for b in ranks:
            assert b["params"] * 2 == one["params"] and b["grads"] * 2 == one["grads"]
            assert b["optimizer"] == 2 * b["params"] + 4 * n_tensors
            assert b["activations"] * 2 == one["activations"]  # half the batch per rank
        if zero == 2:  # everything gathered again after forward
            assert ranks[0]["params_peak"] == ranks[0]["params"] + one["params"]
        else:
            # the root unit and the two largest blocks gathered: all of tiny's two blocks, less of small's four
            assert ranks[0]["params"] < ranks[0]["params_peak"] <= ranks[0]["params"] + one["params"]
    zero1 = [_plan(2, r, preset=preset, zero=1)["bytes"] for r in (0, 1)]  # whole tensors partitioned over the ranks
    assert zero1[0]["optimizer"] + zero1[1]["optimizer"] == one["optimizer"]
    assert all(0.3 < b["optimizer"] / one["optimizer"] < 0.7 and b["params"] == one["params"] for b in zero1)
    assert all(b["ddp_buckets"] == b["grads"] == one["grads"] for b in zero1)
    ddp = _plan(2, preset=preset, zero=0)["bytes"]
    assert ddp["ddp_buckets"] == ddp["grads"] and ddp["optimizer"] == one["optimizer"]
    stages = [_plan(2, r, preset=preset, pp=2, pp_schedule="GPipe", microbatches=2)["bytes"] for r in (0, 1)]
    assert stages[0]["params"] + stages[1]["params"] == one["params"]
    cfg = get_preset(preset)
    tp = _plan(2, preset=preset, tp=2)["bytes"]
    norms = (2 * cfg.n_layers + 1) * cfg.dim * 4  # RMSNorm weights are replicated over tp
    assert tp["params"] == (one["params"] - norms) // 2 + norms


def test_cpu_offload_moves_the_model_state_to_the_host():
    on_device = _plan(2, preset="tiny", zero=3)["bytes"]
    offloaded = _plan(2, preset="tiny", zero=3, cpu_offload=True)  # planned even where a run would need a GPU
    b = offloaded["bytes"]
    assert offloaded["layout"]["cpu_offload"] and b["host"] == b["model_state"] == on_device["model_state"]
    assert b["total_peak"] == on_device["total_peak"] - b["model_state"]
