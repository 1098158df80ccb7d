"""Mixture of experts and expert parallelism.

One process: routing, the per-token reference computation, capacity dropping, the load-balancing loss
against a hand computation, parameter counts, the model-dir round trip, batch-split invariance.
Expert parallelism: one 4-rank spawn (ep=2 over dp_shard=4, with FSDP of the dense part; ep=4 with capacity
dropping, gradient accumulation and activation checkpointing) against one process: every step's loss and the
validation loss within 1e-5, the final weights within 1e-5, the same dropped-token counts.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from prunus.cli.main import cli
from prunus.models import ByteTokenizer, ModelConfig, PrunusError, Transformer, generate, get_preset, load_model, save_model
from prunus.models.llama import FeedForward
from prunus.models.moe import MoE, moe_aux_loss, moe_dropped
from prunus.train_parallel import TrainConfig, resume_config, train
from prunus.train_parallel.launch.dry_run import memory_plan
from prunus.train_parallel.parallel_dims import ParallelDims

TOL = 1e-5
MOE = dict(n_experts=4, top_k=2, n_shared_experts=1, moe_ffn_dim=64)


def moe_model(**changes) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(**{**MOE, **changes}))
    model.init_weights()
    return model


def reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its top-k experts of weight * SwiGLU_e(x), plus the shared experts."""
    out = torch.zeros_like(x)
    probs = layer.router(x).float().softmax(-1)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            w, e = probs[b, s].topk(layer.top_k)
            for weight, i in zip(w / w.sum(), e.tolist()):
                ex = layer.experts
                h = F.silu(x[b, s] @ ex.w1[i]) * (x[b, s] @ ex.w3[i])
                out[b, s] += weight * (h @ ex.w2[i])
    return out + (layer.shared(x) if layer.shared is not None else 0)


def test_forward_shapes_and_routing_match_a_per_token_reference():
    model = moe_model()
    layer = model.layers["0"].feed_forward
    assert isinstance(layer, MoE) and layer.experts.w1.shape == (4, 64, 64) and layer.experts.w2.shape == (4, 64, 64)
    tokens = torch.randint(0, 320, (2, 12))
    assert model(tokens).shape == (2, 12, 320)
    x = torch.randn(2, 12, 64)
    probs, weights, experts = layer.route(x)
    assert weights.shape == experts.shape == (2, 12, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 12))
    assert torch.equal(experts, probs.argsort(-1, descending=True)[..., :2])  # the two most probable experts
    layer.eval()
    torch.testing.assert_close(layer(x), reference_moe(layer, x), atol=TOL, rtol=0)
    layer.train()  # no capacity set: nothing dropped in training either
    torch.testing.assert_close(layer(x), reference_moe(layer, x), atol=TOL, rtol=0)
    assert layer.dropped == 0
    # a dense model keeps its SwiGLU
    assert isinstance(Transformer(get_preset("tiny")).layers["0"].feed_forward, FeedForward)


def test_capacity_drops_later_tokens_and_counts_them():
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=2, n_experts=4, top_k=1, capacity_factor=1.0, moe_ffn_dim=4)
    layer = MoE(cfg)
    torch.nn.init.normal_(layer.experts.w1), torch.nn.init.normal_(layer.experts.w2), torch.nn.init.normal_(layer.experts.w3)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0  # every token with x0 > 0 goes to expert 0
    x = torch.randn(2, 8, 8)
    x[..., 0] = x[..., 0].abs() + 1
    assert layer.capacity(8) == 2  # ceil(1.0 * 8 tokens * top_1 / 4 experts)
    out = layer.train()(x)
    assert layer.dropped == 2 * (8 - 2)  # per sequence: 2 kept, 6 dropped
    assert out[:, 2:].abs().max() == 0  # dropped tokens get nothing from the experts (the residual carries them)
    torch.testing.assert_close(out[:, :2], reference_moe(layer, x)[:, :2], atol=TOL, rtol=0)
    layer.eval()
    torch.testing.assert_close(layer(x), reference_moe(layer, x), atol=TOL, rtol=0)  # eval: nothing dropped
    assert layer.dropped == 0


def test_aux_loss_matches_a_hand_computation():
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=2, n_experts=2, top_k=1, moe_ffn_dim=4, moe_aux_loss_coef=0.1)
    layer = MoE(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # logits (x0, 0): x0 = ln 3 gives probabilities (3/4, 1/4)
    x = torch.zeros(2, 3, 8)
    x[0, :, 0] = torch.tensor([math.log(3), math.log(3), -math.log(3)])
    x[1, :, 0] = math.log(3)
    layer.train()(x)
    # sequence 0: picks (0, 0, 1): f = (2/3, 1/3), P = (1.75/3, 1.25/3); sequence 1: f = (1, 0), P = (3/4, 1/4)
    seq0 = 0.1 * 2 * (2 / 3 * 1.75 / 3 + 1 / 3 * 1.25 / 3)
    seq1 = 0.1 * 2 * (1 * 0.75)
    assert float(layer.aux_loss.detach()) == pytest.approx((seq0 + seq1) / 2, abs=1e-7)
    model = moe_model(n_layers=2)
    model.train()(torch.randint(0, 320, (2, 8)))
    layers = [model.layers[i].feed_forward for i in "01"]
    assert float(moe_aux_loss(model).detach()) == pytest.approx(float((layers[0].aux_loss + layers[1].aux_loss).detach()))
    assert moe_dropped(model) == 0
    model.eval()(torch.randint(0, 320, (2, 8)))
    assert moe_aux_loss(model) is None  # evaluation adds no loss


def test_loss_and_gradients_do_not_depend_on_how_the_batch_is_split():
    """Per-sequence capacity and balance loss: what makes expert/data parallelism equal one process."""
    model = moe_model(capacity_factor=0.5).train()
    x, y = torch.randint(0, 320, (4, 16)), torch.randint(0, 320, (4, 16))

    def loss_and_grads(parts):
        model.zero_grad()
        total, dropped = 0.0, 0
        for xs, ys in parts:
            loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()) + moe_aux_loss(model)
            (loss / len(parts)).backward()
            total, dropped = total + float(loss.detach()) / len(parts), dropped + moe_dropped(model)
        return total, dropped, [p.grad.clone() for p in model.parameters()]

    whole, halves = loss_and_grads([(x, y)]), loss_and_grads([(x[:2], y[:2]), (x[2:], y[2:])])
    assert whole[0] == pytest.approx(halves[0], abs=TOL) and whole[1] == halves[1] > 0
    for a, b in zip(whole[2], halves[2]):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_param_counts_and_model_dir_round_trip(tmp_path, assert_user_error):
    model = moe_model(capacity_factor=1.25)
    cfg = model.config
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    per_expert = 3 * 64 * 64
    assert cfg.num_params() - cfg.num_active_params() == cfg.n_layers * 2 * per_expert  # 2 of 4 experts idle
    save_model(model, tmp_path / "m", tokenizer=ByteTokenizer(), stage="test")
    loaded = load_model(tmp_path / "m")
    assert loaded.config == cfg
    tokens = torch.randint(0, 320, (2, 16))
    assert torch.equal(loaded.eval()(tokens), model.eval()(tokens))
    # greedy decoding with the KV cache gives the tokens of full forward passes (eval: nothing dropped)
    ids, full = generate(loaded, tokens[:, :5], max_new_tokens=6, temperature=0), tokens[:, :5]
    for _ in range(6):
        full = torch.cat([full, loaded(full)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ids, full)
    # no Hugging Face Llama holds experts: refused, nothing written
    assert_user_error(run_cli("convert", "--to-hf", tmp_path / "m", "--out", tmp_path / "hf"), "mixture-of-experts")
    assert not (tmp_path / "hf").exists()


def test_bad_moe_configs_and_layouts():
    with pytest.raises(PrunusError, match="top_k=3 must be between 1 and n_experts=2"):
        get_preset("tiny").replace(n_experts=2, top_k=3)
    with pytest.raises(PrunusError, match="--ep 2 does not divide the model's n_experts \\(3\\)"):
        ParallelDims(world_size=2, ep=2).validate_model(get_preset("tiny").replace(n_experts=3))
    with pytest.raises(PrunusError, match="--ep 4 must divide dp_shard = 2"):
        ParallelDims(world_size=4, dp_shard=2, tp=2, ep=4)
    with pytest.raises(PrunusError, match="needs a mixture-of-experts model"):
        ParallelDims(world_size=2, ep=2).validate_model(get_preset("tiny"))


def test_dry_run_counts_each_ranks_experts():
    cfg = TrainConfig(preset="small", model={"n_experts": 8}, batch_size=16)
    m = cfg.model_config()
    experts = m.n_layers * 8 * 3 * m.dim * m.moe_ffn_dim
    dense = m.num_params() - experts
    for ep in (1, 2, 8):
        plan = memory_plan(TrainConfig(**{**cfg.to_dict(), "ep": ep}), world_size=8)
        # ep > 1: experts split over ep (replicated over the other dp ranks), the rest FSDP over all 8
        assert plan["local_params"] == (experts // ep + dense // 8 if ep > 1 else m.num_params() // 8), ep
        assert plan["layout"]["ep"] == ep


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress"]


@pytest.mark.parametrize("args, needles", [
    (["--n-experts", 2, "--moe-top-k", 3], ["top_k=3 must be between 1 and n_experts=2"]),
    (["--n-experts", 3, "--nproc", 2, "--ep", 2], ["--ep 2 does not divide the model's n_experts (3)"]),
    (["--n-experts", 4, "--nproc", 2, "--ep", 4], ["--ep 4 must divide dp_shard = 2"]),
    (["--nproc", 2, "--ep", 2], ["--ep 2 needs a mixture-of-experts model"]),
    (["--n-experts", 4, "--nproc", 2, "--ep", 2, "--zero", 0], ["--ep 2 composes with FSDP"]),
])
def test_cli_bad_input(tmp_path, args, needles, assert_user_error):
    assert_user_error(run_cli("train", *TINY, *args, "--out", tmp_path / "o"), *needles)
    assert not (tmp_path / "o").exists()


def test_cli_dry_run_plans_expert_parallelism():
    result = run_cli("train", "--preset", "small", "--n-experts", 8, "--ep", 2, "--dry-run", "--world-size", 8)
    assert result.exit_code == 0, result.output
    assert "ep=2" in result.output


# -- expert parallelism against one process (one 4-rank spawn) ---------------------------------------------------

BASE = dict(preset="tiny", model={"n_layers": 2, **MOE}, seq_len=32, batch_size=8, steps=3, warmup_steps=1, eval_every=3,
            eval_tokens=1024, ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120)
CAPPED = dict(model={**BASE["model"], "capacity_factor": 0.5}, grad_accum=2, activation_checkpointing="full")
FOUR = {"ep2_x_fsdp4": dict(ep=2), "ep4_capacity_accum_ac": dict(ep=4, **CAPPED),
        "ckpt_ep2": dict(ep=2, steps=4, eval_every=4, stop_at=2)}  # checkpointed at step 2, resumed in one process


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_expert_parallel_matches_one_process(tmp_path, spawn_jobs):
    jobs = [{"name": n, "config": {**BASE, **c, "out": str(tmp_path / n)}} for n, c in FOUR.items()]
    results = spawn_jobs(Path(__file__).with_name("parallel_worker.py"), 4, jobs, tmp_path)
    refs = {"ep2_x_fsdp4": {}, "ep4_capacity_accum_ac": CAPPED}
    for name, changes in refs.items():
        got = results[name]
        assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
        ref = train(TrainConfig(**{**BASE, **changes, "out": str(tmp_path / f"ref_{name}")}))
        assert got["losses"] == pytest.approx(ref.losses, abs=TOL), name
        assert got["val_loss"] == pytest.approx(ref.metrics["val_loss"], abs=TOL), name
        a, b = load_file(tmp_path / name / "model" / "model.safetensors"), load_file(ref.model_dir / "model.safetensors")
        assert a.keys() == b.keys()
        for k in b:  # weights after the last step, experts consolidated from their ep shards
            torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=f"{name}: {k}")
        ours, theirs = metrics(tmp_path / name), metrics(tmp_path / f"ref_{name}")
        assert [m["moe_dropped"] for m in ours] == [m["moe_dropped"] for m in theirs], name
        assert [m["moe_aux_loss"] for m in ours] == pytest.approx([m["moe_aux_loss"] for m in theirs], abs=TOL)
    assert all(m["moe_dropped"] > 0 for m in metrics(tmp_path / "ep4_capacity_accum_ac"))
    # a checkpoint saved under ep=2 (experts as ep shards) resumes in one process with the uninterrupted losses
    ref = train(TrainConfig(**{**BASE, "steps": 4, "eval_every": 4, "out": str(tmp_path / "ref_4")}))
    assert results["ckpt_ep2"]["losses"] == pytest.approx(ref.losses[:2], abs=TOL)
    shutil.copytree(tmp_path / "ckpt_ep2", tmp_path / "one")
    resumed = train(resume_config(tmp_path / "one", ep=1), resume=True)
    assert resumed.losses == pytest.approx(ref.losses[2:], abs=TOL)
    assert resumed.metrics["val_loss"] == pytest.approx(ref.metrics["val_loss"], abs=TOL)
