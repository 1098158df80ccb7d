"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism: equivalence with one process, bytes counted against
the planner's, activations kept equal to the dry run's estimate, and bad layouts refused in one line before any
process starts.

One 8-rank spawn (gloo, one thread per rank; tests/tp_nd_worker.py) runs every case: a 2D grid of 4 ranks
(two replicas of it), 2.5D with q=2 and depth 2, 3D on a 2 x 2 x 2 cube, and variants with tied embeddings
and biases: one forward and backward of the tiny model with random weights against the same model in
this process (loss and every gradient within 1e-5), and a 3D training run against one process's losses, its
checkpoint resumed in one process.
"""

import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.models.config import get_preset
from prunus.train_parallel import TrainConfig, resume_config, train
from prunus.train_parallel.launch.dry_run import memory_plan
from prunus.train_parallel.parallelize import resolve_layout
from prunus.train_parallel.tensor_parallel.tp_nd.activation_plan import grid_activations
from prunus.train_parallel.tensor_parallel.tp_nd.comm_plan import tp_comm_plan

TOL = 1e-5
WORKER = Path(__file__).with_name("tp_nd_worker.py")
BATCH, SEQ = 4, 16  # the grid cases' batch: every grid splits it into 2 or 4 parts by sequences
GRIDS = {  # name: (mode, mesh dims, model changes, tp degree, depth)
    "2d": ("2d", ["dp", "tp_row", "tp_col"], {}, 4, 1),
    "2d_tied_bias": ("2d", ["dp", "tp_row", "tp_col"], {"tie_embeddings": True, "attn_qkv_bias": True,
                                                        "attn_out_bias": True}, 4, 1),
    "2.5d": ("2.5d", ["tp_dep", "tp_row", "tp_col"], {}, 8, 2),
    "3d": ("3d", ["tp_x", "tp_y", "tp_z"], {}, 8, 1),
    "3d_tied_bias": ("3d", ["tp_x", "tp_y", "tp_z"], {"tie_embeddings": True, "attn_qkv_bias": True,
                                                      "attn_out_bias": True}, 8, 1),
}
TRAIN = dict(preset="tiny", seq_len=32, batch_size=8, steps=3, warmup_steps=1, eval_every=3, eval_tokens=1024,
             ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120)


@pytest.fixture(scope="module")
def eight_rank(tmp_path_factory, spawn_jobs):
    tmp = tmp_path_factory.mktemp("tp_nd")
    jobs = [{"name": name, "grid": {"mode": mode, "dims": dims, "shape": [2, 2, 2], "model": model, "batch": BATCH,
                                    "seq": SEQ}}
            for name, (mode, dims, model, _, _) in GRIDS.items()]
    jobs.append({"name": "train_3d", "config": {**TRAIN, "tp": 8, "tp_mode": "3d", "stop_at": 2, "out": str(tmp / "run_3d")}})
    return spawn_jobs(WORKER, 8, jobs, tmp)


@pytest.mark.parametrize("name", list(GRIDS))
def test_grid_step_matches_one_process(eight_rank, name):
    got = eight_rank[name]
    assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
    assert got["loss_diff"] <= TOL and got["grad_diff"] <= TOL, got
    assert got["weight_diff"] == 0.0 and got["n_params"] == got["n_ref_params"]  # the shards reassemble the weights
    assert got["sum_diff"] <= 1e-4 * BATCH * SEQ  # an uneven evaluation batch, summed
    mode, _, model, tp, depth = GRIDS[name]
    cfg = get_preset("tiny").replace(**model)
    side = {"2d": 2, "2.5d": 2, "3d": 2}[mode]
    matrices = cfg.num_params() - sum(cfg.dim for _ in range(2 * cfg.n_layers + 1))  # all but the norms
    expected = matrices / (side ** 3 if mode == "3d" else side ** 2)  # 1/q^2 of every weight (1/q^3 in 3d)
    assert abs(got["local_params"] - expected) <= cfg.dim * (2 * cfg.n_layers + 1), (got["local_params"], expected)


@pytest.mark.parametrize("name", list(GRIDS))
def test_counted_bytes_match_the_plan(eight_rank, name):
    """Bytes each rank sent per layer (forward + backward), counted in the collectives, equal the planner's."""
    got = eight_rank[name]
    mode, _, model, tp, depth = GRIDS[name]
    plan = tp_comm_plan(get_preset("tiny").replace(**model), mode, tp, depth, BATCH * SEQ)
    assert set(got["sent"]) == set(plan)
    for layer, planned in plan.items():
        assert abs(got["sent"][layer] - planned) <= 1, (layer, got["sent"][layer], planned)


@pytest.mark.parametrize("name", list(GRIDS))
def test_saved_activations_match_the_plan(eight_rank, name):
    """What autograd kept on a rank equals the dry run's grid estimate plus the weights the linears gathered."""
    got = eight_rank[name]
    mode, _, model, tp, depth = GRIDS[name]
    cfg = get_preset("tiny").replace(**model)
    a = grid_activations(cfg, mode, tp, depth, BATCH * SEQ)
    planned = cfg.n_layers * a["block"] + a["head"] + a["embedding"] + got["gathered_weight_bytes"]
    assert got["saved_bytes"] == planned, (got["saved_bytes"], planned)


def test_3d_training_matches_one_process_and_resumes_in_one(eight_rank, tmp_path_factory, tmp_path):
    """Two steps under 3D (stopped, checkpointed), the third resumed in one process: the losses of one process."""
    got = eight_rank["train_3d"]
    assert "error" not in got, f"{got.get('error')}\n{got.get('trace')}"
    ref = train(TrainConfig(**TRAIN, out=str(tmp_path / "ref")))
    run = next(tmp_path_factory.getbasetemp().glob("tp_nd*/run_3d"))
    shutil.copytree(run, tmp_path / "run_3d")
    resumed = train(resume_config(str(tmp_path / "run_3d"), tp=1, tp_mode="1d"), resume=True)
    losses = got["losses"] + resumed.losses
    assert len(losses) == len(ref.losses)
    for a, b in zip(losses, ref.losses):
        assert abs(a - b) <= TOL, (losses, ref.losses)
    assert abs(resumed.metrics["val_loss"] - ref.metrics["val_loss"]) <= TOL


def test_dry_run_plans_memory_and_communication_per_mode():
    """At the same degree the grids hold less of the weights per rank than 1D, and the plan names every layer."""
    plans = {mode: memory_plan(TrainConfig(preset="small", tp=tp, tp_mode=mode, tp_depth=depth, batch_size=16,
                                           seq_len=64), tp)
             for mode, tp, depth in (("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1))}
    full = plans["1d"]["model_params"]
    assert plans["2d"]["local_params"] < full / 4 + 4096 and plans["3d"]["local_params"] < full / 8 + 4096
    assert plans["2.5d"]["local_params"] == plans["2d"]["local_params"]  # depth replicates the 2D grid's weights
    for plan in plans.values():
        assert set(plan["tp_comm"]) == {"tok_embeddings", "norm", "output", "loss", "layers.0", "layers.1", "layers.2",
                                        "layers.3"}
    # depth halves each grid's batch: less activation traffic per block than 2D at the same q
    assert plans["2.5d"]["tp_comm"]["layers.0"] < plans["2d"]["tp_comm"]["layers.0"]
    assert plans["3d"]["layout"]["tp_mode"] == "3d"


@pytest.mark.parametrize("changes, world, needles", [
    (dict(tp=6, tp_mode="2d"), 6, ["--tp 6 --tp-mode 2d", "a square"]),
    (dict(tp=8, tp_mode="2.5d", tp_depth=3), 8, ["--tp-depth 3", "must divide the degree"]),
    (dict(tp=8, tp_mode="2.5d", tp_depth=8), 8, ["--tp-depth 8", "a square of at least 4"]),
    (dict(tp=9, tp_mode="3d"), 9, ["--tp 9 --tp-mode 3d", "a cube"]),
    (dict(tp=4, tp_mode="2d", tp_depth=2), 4, ["--tp-depth 2 applies to --tp-mode 2.5d only"]),
    (dict(tp=4, tp_mode="2d", pp=2), 8, ["--tp-mode 2d does not compose with --pp or --cp"]),
    (dict(tp=4, tp_mode="2d", cp=2), 8, ["--tp-mode 2d does not compose with --pp or --cp"]),
    (dict(tp=4, tp_mode="2d"), 8, ["--tp-mode 2d trains with tensor parallelism alone"]),
    (dict(tp=27, tp_mode="3d"), 27, ["model's dim (64) is not divisible by 9"]),
    (dict(tp=8, tp_mode="3d", batch_size=6), 8, ["must be a multiple of 4"]),
    (dict(tp=4, tp_mode="4d"), 4, ["--tp-mode 4d: choose one of 1d, 2d, 2.5d, 3d"]),
    (dict(tp=4, tp_mode="2d", lora_rank=4), 4, ["--tp-mode 2d does not compose with --lora-rank"]),
    (dict(tp=8, tp_mode="3d", model={"qk_norm": True}), 8, ["without per-head q/k norms"]),
])
def test_bad_layouts_are_one_line(changes, world, needles):
    with pytest.raises(PrunusError) as e:
        resolve_layout(TrainConfig(**{**TRAIN, **changes}), world)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_cli_refuses_a_non_square_before_starting(tmp_path, assert_user_error):
    t0 = time.time()
    r = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--nproc", "6", "--tp", "6", "--tp-mode", "2d",
                                 "--out", str(tmp_path / "o")])
    assert_user_error(r, "--tp 6 --tp-mode 2d", "a square")
    assert not (tmp_path / "o").exists() and time.time() - t0 < 30
