"""Equivalence of every parallel layout with one process: same losses, same validation loss.

Each spawn (torchrun, gloo, one thread per rank) serves many layouts in one process
group; the reference runs here, in this process, on the same global batches.
Tolerance: 1e-5 absolute on every step's loss and on the validation loss.

The model families (tests/family_variants.py) join the same spawns: every layout on the
plain tiny model, and per family the layouts its variants change (``FAMILY_TWO``), trained
against that family in one process; and one forward / backward of each dense family's model,
every weight random, under TP + SP against one process (loss and every gradient).
"""

import shutil
from pathlib import Path

import pytest

from family_variants import family_fields
from prunus.train_parallel import TrainConfig, resume_config, train

TOL = 1e-5
WORKER = Path(__file__).with_name("parallel_worker.py")
BASE = dict(preset="tiny", model={"n_layers": 4}, seq_len=32, batch_size=8, steps=3, warmup_steps=1, eval_every=3,
            eval_tokens=1024, ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120)




def family_model(family: str, **changes) -> dict:
    """BASE's model settings for ``family`` ("tiny": the plain preset)."""
    fields = {} if family == "tiny" else family_fields(family, BASE["model"]["n_layers"])
    return {"model": {**BASE["model"], **fields, **changes}}


def reference(tmp_path: Path, **changes) -> dict:
    r = train(TrainConfig(**{**BASE, **changes, "out": str(tmp_path / f"ref{len(list(tmp_path.iterdir()))}")}))
    return {"losses": r.losses, "val_loss": r.metrics["val_loss"]}


def assert_equivalent(results: dict, ref: dict, names) -> None:
    for name in names:
        got = results[name]
        assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
        assert len(got["losses"]) == len(ref["losses"]), name
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= TOL, f"{name} step {step + 1}: loss {a} vs {b} in one process"
        assert abs(got["val_loss"] - ref["val_loss"]) <= TOL, f"{name}: val loss {got['val_loss']} vs {ref['val_loss']}"


TWO = {
    "ddp": dict(zero=0),
    "zero1": dict(zero=1),
    "zero2": dict(zero=2),
    "zero3": dict(zero=3),
    "zero3_grad_accum": dict(zero=3, grad_accum=2),
    "ddp_grad_accum": dict(zero=0, grad_accum=2),
    "fsdp_full_ac": dict(zero=3, activation_checkpointing="full"),
    "tp_sp": dict(tp=2),
    "tp_every_other_ac": dict(tp=2, activation_checkpointing="every-other"),
    "pp_gpipe": dict(pp=2, pp_schedule="GPipe", microbatches=2),
    "pp_1f1b": dict(pp=2, pp_schedule="1F1B", microbatches=4),
    "pp_interleaved_1f1b": dict(pp=2, pp_schedule="Interleaved1F1B", microbatches=4),
    "pp_looped_bfs": dict(pp=2, pp_schedule="LoopedBFS", microbatches=4),
    "pp_interleaved_zero_bubble": dict(pp=2, pp_schedule="InterleavedZeroBubble", microbatches=4),
    "pp_zbv": dict(pp=2, pp_schedule="ZBVZeroBubble", microbatches=4),
    "pp_dualpipev": dict(pp=2, pp_schedule="DualPipeV", microbatches=4),
    "pp_full_ac": dict(pp=2, pp_schedule="1F1B", microbatches=2, activation_checkpointing="full"),
}
# Per family, the layouts its variants change, trained against the family in one process (a family's tiny
# config: tests/family_variants.py): TP + SP for q/k norms (qwen3) and Gemma 2 (post norms, (1 + w) norms,
# scaled embeddings, soft-caps, alternating windows, tied embeddings under a vocabulary-parallel embedding and
# loss_parallel); FSDP for Gemma 2 and a MoE (qwen3_moe: q/k norms, experts); pipeline stages for Gemma 2
# (untied: pipelines refuse tied embeddings), whose per-layer windows, embedding scale and final soft-cap live
# on different stages; FSDP x TP (4 ranks) for Gemma 2. Biases (llama: q/k/v and the row-parallel o bias;
# qwen2: q/k/v) and every dense family are checked by the TP step test below, weights random.
# Mixture-of-experts models refuse --tp and --pp (tests/test_moe.py checks their expert parallelism).
FAMILY_TWO = {
    "qwen3": {"tp_sp": dict(tp=2)},
    "gemma2": {"tp_sp": dict(tp=2), "zero3": dict(zero=3)},
    "gemma2_untied": {"pp_1f1b": dict(pp=2, pp_schedule="1F1B", microbatches=4)},
    "qwen3_moe": {"zero3": dict(zero=3)},
}
FAMILY_FOUR = {"gemma2": {"fsdp_x_tp": dict(dp_shard=2, tp=2, zero=3)}}
FAMILY_MODEL = {"gemma2_untied": ("gemma2", dict(tie_embeddings=False))}  # a family with changes
TP_MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2")  # dense: MoE refuses --tp


def family_settings(family: str) -> dict:
    base, changes = FAMILY_MODEL.get(family, (family, {}))
    return family_model(base, **changes)


RESUME_UNDER = {
    "resume_tp": dict(tp=2),
    "resume_pp": dict(pp=2, pp_schedule="1F1B", microbatches=2),
    "resume_zero1": dict(zero=1),
    "resume_ddp": dict(zero=0),
}
FOUR = {
    "fsdp_x_tp": dict(dp_shard=2, tp=2, zero=3),
    "pp_x_fsdp": dict(pp=2, dp_shard=2, zero=3, pp_schedule="1F1B", microbatches=2),
    "hsdp": dict(dp_replicate=2, dp_shard=2, zero=3),
    "pp_x_tp": dict(pp=2, tp=2, pp_schedule="Interleaved1F1B", microbatches=2),
}


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, spawn_jobs):
    """(results by layout, the dir they ran in)."""
    tmp = tmp_path_factory.mktemp("two")
    jobs = [{"name": n, "config": {**BASE, **c, "out": str(tmp / n)}} for n, c in TWO.items()]
    for fam, layouts in FAMILY_TWO.items():
        jobs += [{"name": f"{fam}/{n}", "config": {**BASE, **family_settings(fam), **c, "out": str(tmp / f"{fam}_{n}")}}
                 for n, c in layouts.items()]
    jobs += [{"name": f"tp_model/{fam}", "tp_model": {"family": fam}} for fam in TP_MODEL_FAMILIES]
    # a 4-step run checkpointed at step 2 under FSDP x 2, resumed under other layouts
    ckpt = {**BASE, "steps": 4, "eval_every": 4, "stop_at": 2, "zero": 3, "out": str(tmp / "ckpt_fsdp")}
    jobs.append({"name": "ckpt_fsdp", "config": ckpt})
    for n, c in RESUME_UNDER.items():
        jobs.append({"name": n, "copy_from": ckpt["out"], "resume": True, "config": {**c, "out": str(tmp / n)}})
    # the same with checkpoints written in the background at every step, resumed under TP x 2
    ckpt_async = {**ckpt, "async_checkpoint": True, "ckpt_every": 1, "out": str(tmp / "ckpt_async")}
    jobs.append({"name": "ckpt_async", "config": ckpt_async})
    jobs.append({"name": "resume_async", "copy_from": ckpt_async["out"], "resume": True,
                 "config": {"tp": 2, "async_checkpoint": True, "out": str(tmp / "resume_async")}})
    return spawn_jobs(WORKER, 2, jobs, tmp), tmp


@pytest.mark.parametrize("family", ["tiny", *FAMILY_TWO])
def test_two_rank_layouts_match_one_process(two_rank, tmp_path, family):
    if family == "tiny":
        assert_equivalent(two_rank[0], reference(tmp_path), list(TWO))
    else:
        assert_equivalent(two_rank[0], reference(tmp_path, **family_settings(family)),
                          [f"{family}/{n}" for n in FAMILY_TWO[family]])


@pytest.mark.parametrize("family", TP_MODEL_FAMILIES)
def test_tensor_parallel_step_matches_one_process(two_rank, family):
    """Loss and every parameter's gradient of one step under TP + SP over 2 ranks (loss_parallel), every weight of
    the family's model random: a bias, q/k norm or post norm sharded or reduced wrongly shows here at step one."""
    got = two_rank[0][f"tp_model/{family}"]
    assert "error" not in got, f"{family}: {got.get('error')}\n{got.get('trace')}"
    assert got["plain_params"] == [], f"{family}: parameters left out of the TP plan: {got['plain_params']}"
    assert got["loss_diff"] <= TOL, got
    assert got["grad_diff"] <= TOL and got["grad_diff"] <= 1e-4 * got["grad_scale"], got


def test_checkpoint_from_fsdp_resumes_under_other_layouts(two_rank, tmp_path):
    results, tmp = two_rank
    ref = reference(tmp_path, steps=4, eval_every=4)
    assert results["ckpt_fsdp"]["losses"] == pytest.approx(ref["losses"][:2], abs=TOL)
    assert results["ckpt_async"]["losses"] == pytest.approx(ref["losses"][:2], abs=TOL)
    tail = {"losses": ref["losses"][2:], "val_loss": ref["val_loss"]}
    assert_equivalent(results, tail, [*RESUME_UNDER, "resume_async"])
    assert sorted(p.name for p in (tmp / "ckpt_async" / "checkpoints").iterdir()) == ["step-1", "step-2"]
    # and in one process, from the same sharded checkpoint
    shutil.copytree(tmp / "ckpt_fsdp", tmp_path / "one")
    r = train(resume_config(tmp_path / "one"), resume=True)
    assert_equivalent({"one": {"losses": r.losses, "val_loss": r.metrics["val_loss"]}}, tail, ["one"])


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory, spawn_jobs):
    tmp = tmp_path_factory.mktemp("four")
    jobs = [{"name": n, "config": {**BASE, **c, "out": str(tmp / n)}} for n, c in FOUR.items()]
    for fam, layouts in FAMILY_FOUR.items():
        jobs += [{"name": f"{fam}/{n}", "config": {**BASE, **family_settings(fam), **c, "out": str(tmp / f"{fam}_{n}")}}
                 for n, c in layouts.items()]
    return spawn_jobs(WORKER, 4, jobs, tmp)


@pytest.mark.parametrize("family", ["tiny", *FAMILY_FOUR])
def test_four_rank_layouts_match_one_process(four_rank, tmp_path, family):
    if family == "tiny":
        assert_equivalent(four_rank, reference(tmp_path), list(FOUR))
    else:
        assert_equivalent(four_rank, reference(tmp_path, **family_settings(family)),
                          [f"{family}/{n}" for n in FAMILY_FOUR[family]])
