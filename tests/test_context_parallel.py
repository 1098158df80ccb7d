"""Context parallelism (ring attention, Ulysses) is exact: against causal SDPA on the whole sequence, against the
model on the whole batch, and trained against one process; bad layouts fail before any process starts.

Two spawns (2 and 4 ranks, torchrun, gloo, one thread per rank) serve every multi-rank check through
tests/cp_worker.py. Tolerance: 1e-5 absolute on attention outputs and dq/dk/dv, on losses, validation
losses and gradients.

The families' attention variants join the same spawns: a sliding window (Mistral) and Gemma 2's window +
soft-cap + query_pre_attn_scalar scale at the attention level (2 and 4 ranks), the model check for the
dense families whose attention differs (gemma2, mistral, qwen3, qwen2; tests/family_variants.py, every
weight random), and Gemma 2 trained under ring and Ulysses against one process.
Mixture-of-experts models refuse --cp (one line, checked below).
"""

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from family_variants import family_fields
from prunus.cli.main import cli
from prunus.artifacts.errors import PrunusError
from prunus.train_parallel import TrainConfig, resume_config, train
from prunus.train_parallel.context_parallel.context_parallel import load_balanced_positions, validate_cp
from prunus.train_parallel.launch.dry_run import memory_plan

TOL = 1e-5
SEQ = 512
WORKER = Path(__file__).with_name("cp_worker.py")
# the tiny model with a 512-token context; two sequences of 512 per step
BASE = dict(preset="tiny", model={"max_seq_len": SEQ}, seq_len=SEQ, batch_size=2, steps=3, warmup_steps=1, eval_every=3,
            eval_tokens=2048, ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120)
ATTENTION = dict(kind="attention", batch=2, heads=4, seq=SEQ, head_dim=16)
# attention variants of the families: none (causal SDPA), Mistral's window, Gemma 2's window + soft-cap + scale
VARIANTS = {"causal": {}, "window": dict(window=6), "gemma2": dict(window=40, softcap=5.0, scale=24.0 ** -0.5)}
MODEL_FAMILIES = ("tiny", "gemma2", "mistral", "qwen3", "qwen2")  # "tiny": the plain preset
FAMILY_SEQ = 64  # the families' model check: chunks of 16 tokens on 2 ranks, more than one window
TRAIN_FAMILIES = {"gemma2": ("ring_fsdp", "ulysses_fsdp")}  # trained against the family in one process
DRY = dict(preset="tiny", seq_len=64, batch_size=8)  # the dry run's activation check, as in tests/test_dry_run.py

TWO_TRAIN = {
    "ring_fsdp": dict(cp=2, cp_impl="ring"),  # FSDP (ZeRO-3) over the 2 cp ranks: the default
    "ulysses_fsdp": dict(cp=2, cp_impl="ulysses"),
    "ring_ddp": dict(cp=2, cp_impl="ring", zero=0),  # DDP averages the cp ranks' gradients
    "ulysses_full_ac": dict(cp=2, cp_impl="ulysses", activation_checkpointing="full"),  # recomputed in backward
}
FOUR_TRAIN = {
    "ring_x_fsdp": dict(cp=2, dp_shard=2, cp_impl="ring"),  # FSDP over dp_shard x cp = 4
    "ulysses_x_tp": dict(cp=2, tp=2, cp_impl="ulysses"),  # each tp rank's 2 heads split over its 2 cp ranks
    "ring_hsdp": dict(cp=2, dp_replicate=2, cp_impl="ring"),  # replicate x (shard over cp)
    "ring_cp4": dict(cp=4, cp_impl="ring"),
}


def spawn(spawn_jobs, nproc: int, jobs: list[dict], tmp_path: Path) -> dict:
    results = spawn_jobs(WORKER, nproc, jobs, tmp_path)
    for name, got in results.items():
        assert "error" not in got, f"{name}: {got['error']}\n{got.get('trace')}"
    assert sorted(results) == sorted(j["name"] for j in jobs)
    return results


def train_jobs(layouts: dict, tmp: Path, family: str = "tiny") -> list[dict]:
    prefix, model = ("", {}) if family == "tiny" else (f"{family}/", family_base(family))
    return [{"name": prefix + n, "kind": "train", "config": {**BASE, **model, **c, "out": str(tmp / (prefix + n))}}
            for n, c in layouts.items()]


def family_base(family: str) -> dict:
    return {"model": {**BASE["model"], **family_fields(family)}}


def attention_jobs(cp: int) -> list[dict]:
    return [{"name": f"attn{'' if cp == 2 else cp}_{impl}" + ("" if v == "causal" else f"_{v}"), "impl": impl, "cp": cp,
             **ATTENTION, **VARIANTS[v]} for impl in ("ring", "ulysses") for v in VARIANTS]


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, spawn_jobs):
    tmp = tmp_path_factory.mktemp("cp2")
    jobs = attention_jobs(2)
    jobs += [{"name": f"model_{impl}", "kind": "model", "impl": impl, "cp": 2, "seq": SEQ, "batch": 2}
             for impl in ("ring", "ulysses")]
    jobs += [{"name": f"model_{impl}_{fam}", "kind": "model", "impl": impl, "cp": 2, "seq": FAMILY_SEQ, "batch": 2,
              "family": fam} for impl in ("ring", "ulysses") for fam in MODEL_FAMILIES[1:]]
    for fam, layouts in TRAIN_FAMILIES.items():
        jobs += train_jobs({n: TWO_TRAIN[n] for n in layouts}, tmp, fam)
    jobs += [{"name": f"saved_{impl}", "kind": "model", "impl": impl, "cp": 2, "seq": DRY["seq_len"],
              "batch": DRY["batch_size"]} for impl in ("ring", "ulysses")]
    # stopped (checkpointed) at step 2 of 3 under --cp 2, resumed in one process by the test below
    jobs.append({"name": "ckpt_ring", "kind": "train", "config": {**BASE, **TWO_TRAIN["ring_fsdp"], "stop_at": 2,
                                                                  "out": str(tmp / "ckpt_ring")}})
    return spawn(spawn_jobs, 2, jobs + train_jobs(TWO_TRAIN, tmp), tmp), tmp


def one_process(tmp: Path, family: str = "tiny") -> dict:
    """The training run in this one process."""
    model = {} if family == "tiny" else family_base(family)
    r = train(TrainConfig(**{**BASE, **model, "out": str(tmp / "run")}))
    return {"losses": r.losses, "val_loss": r.metrics["val_loss"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training run in this one process."""
    return one_process(tmp_path_factory.mktemp("ref"))


def assert_trains_like(results: dict, ref: dict, names) -> None:
    for name in names:
        got = results[name]
        assert len(got["losses"]) == len(ref["losses"]), name
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= TOL, f"{name} step {step + 1}: loss {a} vs {b} in one process"
        assert abs(got["val_loss"] - ref["val_loss"]) <= TOL, f"{name}: val loss {got['val_loss']} vs {ref['val_loss']}"


def assert_attention_exact(results: dict, names) -> None:
    for name in names:
        for what in ("out", "dq", "dk", "dv"):
            assert results[name][what] <= TOL, f"{name}: max |{what} - SDPA's| = {results[name][what]}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_matches_sdpa_forward_and_backward(two_rank, variant):
    suffix = "" if variant == "causal" else f"_{variant}"
    assert_attention_exact(two_rank[0], [f"attn_ring{suffix}", f"attn_ulysses{suffix}"])


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_model_loss_and_gradients_match_the_whole_batch(two_rank, family):
    for impl in ("ring", "ulysses"):
        got = two_rank[0][f"model_{impl}" + ("" if family == "tiny" else f"_{family}")]
        assert abs(got["loss"] - got["ref_loss"]) <= TOL, (impl, got)
        assert got["grad_diff"] <= TOL and got["grad_diff"] <= 1e-4 * got["grad_scale"], (impl, got)


@pytest.mark.parametrize("family", ["tiny", *TRAIN_FAMILIES])
def test_training_with_cp2_matches_one_process(two_rank, reference, family, tmp_path):
    if family == "tiny":
        assert_trains_like(two_rank[0], reference, list(TWO_TRAIN))
    else:
        assert_trains_like(two_rank[0], one_process(tmp_path, family), [f"{family}/{n}" for n in TRAIN_FAMILIES[family]])


def test_checkpoint_under_cp_resumes_in_one_process(two_rank, reference, tmp_path):
    results, tmp = two_rank
    assert results["ckpt_ring"]["losses"] == pytest.approx(reference["losses"][:2], abs=TOL)
    shutil.copytree(tmp / "ckpt_ring", tmp_path / "one")
    r = train(resume_config(tmp_path / "one", cp=1), resume=True)
    tail = {"losses": reference["losses"][2:], "val_loss": reference["val_loss"]}
    assert_trains_like({"one": {"losses": r.losses, "val_loss": r.metrics["val_loss"]}}, tail, ["one"])


def test_dry_run_activations_match_what_autograd_saves(two_rank):
    """Per rank, each implementation saves what the dry run plans for --cp 2: half of one process's tokens."""
    one = memory_plan(TrainConfig(**DRY), 1)["bytes"]["activations"]
    for impl in ("ring", "ulysses"):
        plan = memory_plan(TrainConfig(**DRY, cp=2, cp_impl=impl), 2)
        assert plan["layout"]["cp"] == 2 and plan["local_seq_len"] == 32 and plan["seq_len"] == 64
        planned, measured = plan["bytes"]["activations"], two_rank[0][f"saved_{impl}"]["saved_bytes"]
        assert abs(planned / measured - 1) < 0.01, (impl, planned, measured)
        assert 0.45 < planned / one < 0.55


def test_four_ranks_cp_with_fsdp_tp_hsdp_and_cp4(tmp_path, reference, spawn_jobs):
    jobs = attention_jobs(4)  # with a window: blocks it hides entirely
    results = spawn(spawn_jobs, 4, jobs + train_jobs(FOUR_TRAIN, tmp_path), tmp_path)
    assert_attention_exact(results, [j["name"] for j in jobs])
    assert_trains_like(results, reference, list(FOUR_TRAIN))


def test_load_balanced_layout():
    """Rank r holds chunks r and 2cp-1-r: together the ranks cover the sequence once, each with equal causal work."""
    cp, seq = 4, 64
    parts = [load_balanced_positions(seq, r, cp) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    assert parts[1].tolist() == [*range(8, 16), *range(48, 56)]
    assert len({int((p + 1).sum()) for p in parts}) == 1  # keys attended to, summed over each rank's queries


@pytest.mark.parametrize("args, needles", [
    (["--nproc", 2, "--cp", 2, "--seq-len", 30], ["--seq-len 30 is not divisible by 2 x --cp = 4"]),
    (["--nproc", 3, "--cp", 3, "--cp-impl", "ulysses", "--seq-len", 36], ["4 attention heads", "not divisible by --cp"]),
    (["--nproc", 4, "--cp", 2, "--pp", 2, "--seq-len", 32], ["--cp 2 with --pp 2"]),
    (["--nproc", 2, "--cp", 2, "--cp-impl", "stripes", "--seq-len", 32], ["--cp-impl stripes: choose ring or ulysses"]),
])
def test_bad_cp_input_fails_before_starting(tmp_path, args, needles, assert_user_error):
    out = tmp_path / "o"
    r = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--batch-size", "8", "--no-progress", *map(str, args),
                                 "--out", str(out)])
    assert_user_error(r, *needles)
    assert not out.exists()


def test_mixture_of_experts_refuses_cp():
    with pytest.raises(PrunusError, match="mixture-of-experts models .* train without context parallelism; set --cp 1"):
        validate_cp(2, "ring", 64, n_heads=4, moe=True)


def test_ulysses_heads_per_tensor_parallel_rank():
    validate_cp(2, "ulysses", 64, n_heads=8, tp=4)  # 2 heads per tp rank over 2 cp ranks
    with pytest.raises(PrunusError, match="the 2 attention heads per tensor-parallel rank are not divisible"):
        validate_cp(4, "ulysses", 64, n_heads=8, tp=4)
    validate_cp(4, "ring", 64, n_heads=8, tp=4)  # ring attention splits the sequence, not the heads


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA's memory-efficient attention kernel needs a GPU; none here"))]


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_merged_by_log_sum_exp_match_sdpa(device):
    """Ring attention's arithmetic in one process: the second half of the queries attends to the first half of the
    keys (a full block) and to the second (a causal block); outputs merged by log-sum-exp, each block's gradients
    computed from the merged output and log-sum-exp, and summed, equal causal SDPA's."""
    from prunus.train_parallel.context_parallel.ring_attention import block_attention, block_attention_backward, merge_block

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 128, 16, device=device) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    first, second = slice(0, 64), slice(64, 128)
    blocks = [(first, first, True), (second, first, False), (second, second, True)]  # (queries, keys, causal)
    out = torch.zeros(q.shape, device=device)
    lse = torch.full(q.shape[:3], float("-inf"), device=device)
    for qs, ks, causal in blocks:
        merge_block(out[:, :, qs], lse[:, :, qs], *block_attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal))
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for qs, ks, causal in blocks:
        dq, dk, dv = block_attention_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                              lse[:, :, qs], causal)
        grads[0][:, :, qs] += dq
        grads[1][:, :, ks] += dk
        grads[2][:, :, ks] += dv
    assert (out - ref.detach()).abs().max() <= TOL
    for mine, theirs in zip(grads, full):
        assert (mine - theirs.grad).abs().max() <= TOL
