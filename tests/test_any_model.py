"""Any nn.Module through prunus: factory specs and their trust rule, the generic model dir, tasks, training
through the API and the CLI (one process; DDP x 2 and FSDP2 x 2 against one process), data specs and
image folders, and ONNX export with its parity report.

The models are defined here (no torchvision): a two-Linear classifier and a small ResNet-style CNN with
BatchNorm. Equivalence tolerance: 1e-5 absolute on every step's loss and on the validation loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.data.image_folder import image_folder_datasets
from prunus.data.module_datasets import module_datasets
from prunus.data.synthetic import synthetic_datasets
from prunus.models.model_dir import load_model, read_config, write_manifest
from prunus.models.module_dir import load_module, save_module
from prunus.models.module_factory import build_module, check_args, parse_model_args
from prunus.models.tasks import get_task
from prunus.train_parallel.module_config import ModuleTrainConfig
from prunus.train_parallel.module_trainer import train_module

TOL = 1e-5
WORKER = Path(__file__).with_name("any_model_worker.py")
MLP_DATA = "synthetic:classification?n=64&shape=8&classes=3&val=32"
CNN_DATA = "synthetic:classification?n=64&shape=3x8x8&classes=4&val=16"
BASE = dict(steps=4, batch_size=8, warmup_steps=1, eval_every=2, ckpt_every=0, progress=False, timeout_s=120)


# --- the models (factories named "test_any_model:...") ---------------------------------------------------------

class TwoLinear(nn.Module):
    def __init__(self, d_in: int, hidden: int, classes: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def two_linear(d_in=8, hidden=16, classes=3):
    return TwoLinear(d_in, hidden, classes)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet(channels=3, width=8, classes=4):
    return nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         Block(width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


class NamedResNet(nn.Module):
    """torchvision's ResNet layout in small: named children, and a torch.flatten between avgpool and fc."""

    def __init__(self, width: int = 4, classes: int = 3):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        self.layer1, self.layer2, self.layer3 = Block(width), Block(width), Block(width)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(width, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def block(width=4):
    return Block(width)


def not_a_module():
    return 42


def broken(width=8):
    raise ValueError(f"width {width} is not supported")


def mse_loss(output, target):
    return ((output - target) ** 2).mean()


NOT_CALLABLE = 3


# --- factory specs and their arguments ------------------------------------------------------------------------

def test_model_args_are_literals_never_code():
    got = parse_model_args("num_classes=10,width=32,sizes=[8, 16],act=relu,scale=0.5,flag=true,none=null,"
                           "name='a,b',opts={'k': [1, 2]}")
    assert got == {"num_classes": 10, "width": 32, "sizes": [8, 16], "act": "relu", "scale": 0.5, "flag": True,
                   "none": None, "name": "a,b", "opts": {"k": [1, 2]}}
    assert parse_model_args("t=(1, 2)") == {"t": [1, 2]}  # a tuple becomes a JSON list
    for bad, needle in [("width=__import__('os').system('true')", "not a literal"), ("width", "not name=value"),
                        ("a=1,a=2", "given twice"), ("x=[1,2", "unclosed bracket"), ("x=1e999", "not a finite"),
                        ("x={1: 2}", "not a string"), ("x=b'1'", "bytes"), ("1x=2", "not name=value")]:
        with pytest.raises(PrunusError, match="--model-args") as e:
            parse_model_args(bad)
        assert needle in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))
    with pytest.raises(PrunusError, match="not an argument name"):
        check_args({"not valid": 1})


@pytest.mark.parametrize("spec, needle", [
    ("prunus_no_such_package_xyz:build", "importing prunus_no_such_package_xyz failed"),
    ("test_any_model:missing", "has no missing"),
    ("test_any_model:NOT_CALLABLE", "not callable"),
    ("test_any_model:broken", "building the model failed (ValueError: width 8 is not supported)"),
    ("test_any_model:not_a_module", "returned a int, not a torch.nn.Module"),
    ("no spec", "not a factory spec"),
    ("os:system;rm", "not a factory spec"),
])
def test_factory_failures_are_one_line_naming_the_spec(spec, needle):
    with pytest.raises(PrunusError) as e:
        build_module(spec, {"width": 8} if spec.endswith("broken") else {})
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert spec.split(";")[0] in str(e.value)


# --- the model dir ----------------------------------------------------------------------------------------------

def test_model_dir_round_trip_is_exact_buffers_included(tmp_path):
    torch.manual_seed(0)
    model = build_module("test_any_model:resnet", {"width": 8})
    model.train()
    for _ in range(3):  # running statistics away from their initial values
        model(torch.randn(4, 3, 8, 8))
    save_module(model, tmp_path / "m", stage="test", task="classification", input={"shape": [3, 8, 8], "dtype": "float32"})
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
        assert {"1.running_mean", "1.running_var", "1.num_batches_tracked", "3.bn2.running_var"} <= set(f.keys())
    back = load_model(tmp_path / "m", trust_factory="test_any_model:resnet")
    mine = model.state_dict()
    assert set(back.state_dict()) == set(mine)
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    x = torch.randn(5, 3, 8, 8)
    assert torch.equal(back(x), model.eval()(x))
    manifest = json.loads((tmp_path / "m" / "prunus.json").read_text())
    assert manifest["stage"] == "test" and manifest["metrics"]["params"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(PrunusError, match="holds a generic module .* not a transformer"):
        read_config(tmp_path / "m")  # a reader of transformer dirs says so in one line
    with pytest.raises(PrunusError, match="not a transformer"):
        load_model(tmp_path / "m")  # trust_factory left unset: the caller reads transformer dirs only


def test_weights_that_do_not_fit_the_factory_are_one_line(tmp_path):
    save_module(build_module("test_any_model:two_linear", {"hidden": 16}), tmp_path / "m", stage="test")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["args"]["hidden"] = 32
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    write_manifest(tmp_path / "m", stage="test", parent_info=None, command="test", metrics={})
    with pytest.raises(PrunusError, match=r"fc1.weight has shape \(16, 8\) but config.json builds \(32, 8\)"):
        load_model(tmp_path / "m", trust_factory=True)


def _planted(tmp_path: Path, marker: Path, key: str = "factory") -> Path:
    """A model dir whose config.json names os:system with a command that would create ``marker``; its
    manifest re-hashed (an attacker can do that too)."""
    save_module(build_module("test_any_model:two_linear"), tmp_path / "evil", stage="test")
    config = json.loads((tmp_path / "evil" / "config.json").read_text())
    if key == "factory":
        config.update(factory="os:system", args={"command": f"touch {marker}"})
    else:
        config["task"] = "os:system"
    (tmp_path / "evil" / "config.json").write_text(json.dumps(config))
    write_manifest(tmp_path / "evil", stage="test", parent_info=None, command="test", metrics={})
    return tmp_path / "evil"


def test_an_untrusted_factory_in_a_model_dir_never_runs(tmp_path, monkeypatch, assert_user_error):
    marker = tmp_path / "MARKER"
    evil = _planted(tmp_path, marker)
    monkeypatch.setenv("PRUNUS_TRUST_FACTORIES", "test_any_model:two_linear,os:system2")  # exact matches only
    for trust in (False, "test_any_model:two_linear", ["os.system"]):
        with pytest.raises(PrunusError) as e:
            load_model(evil, trust_factory=trust)
        assert str(e.value) == (f"{evil} names the factory os:system; loading runs that code: pass --trust-factory if "
                                "you trust it (trust_factory=True, or list it in PRUNUS_TRUST_FACTORIES)")
    result = CliRunner().invoke(cli, ["export", str(evil), "--out", str(tmp_path / "exp")])
    assert_user_error(result, "names the factory os:system; loading runs that code: pass --trust-factory")
    assert not marker.exists() and not (tmp_path / "exp").exists()
    # a user loss read back from an artifact follows the same rule
    config = json.loads((_planted(tmp_path / "t", marker, key="task") / "config.json").read_text())
    with pytest.raises(PrunusError, match="names the factory os:system; loading runs that code"):
        get_task(config["task"], trust=False, where=str(tmp_path / "t" / "evil"))
    assert not marker.exists()


# --- training through the Python API ----------------------------------------------------------------------------

def test_train_module_api_writes_a_run_dir_and_a_model_dir_that_scores_the_same(tmp_path):
    train, val = synthetic_datasets(MLP_DATA)
    cfg = ModuleTrainConfig(out=str(tmp_path / "run"), **{**BASE, "steps": 12, "eval_every": 6, "ckpt_every": 6,
                                                          "lr": 1e-2})
    r = train_module("test_any_model:two_linear", train, "classification", cfg, val_dataset=val)
    assert len(r.losses) == 12 and r.losses[-1] < r.losses[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == list(range(1, 13)) and "val_accuracy" in records[5]
    # the losses are settled in batches (every log_every steps, on eval and checkpoint steps): every step's kept
    assert [rec["loss"] for rec in records] == r.losses and r.metrics == {**records[-1], "loss": r.losses[-1]}
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["best", "step-12", "step-6"]
    manifest = json.loads((r.model_dir / "prunus.json").read_text())
    config = json.loads((r.model_dir / "config.json").read_text())
    assert config == {"format": "prunus-model/1", "kind": "module", "factory": "test_any_model:two_linear",
                      "args": {}, "task": "classification", "input": {"shape": [8], "dtype": "float32"}}
    model = load_model(r.model_dir, trust_factory="test_any_model:two_linear")
    xs = torch.stack([val[i][0] for i in range(len(val))])
    ys = torch.stack([val[i][1] for i in range(len(val))])
    assert float((model(xs).argmax(-1) == ys).float().mean()) == manifest["metrics"]["val_accuracy"]


def test_stop_and_resume_continue_the_same_run(tmp_path):
    train, val = synthetic_datasets(CNN_DATA)
    spec = "test_any_model:resnet"
    full = train_module(spec, train, "classification", ModuleTrainConfig(out=str(tmp_path / "full"), **BASE),
                        val_dataset=val)
    cfg = ModuleTrainConfig(out=str(tmp_path / "half"), **{**BASE, "stop_at": 2})
    first = train_module(spec, train, "classification", cfg, val_dataset=val)
    assert first.model_dir is None and first.losses == pytest.approx(full.losses[:2], abs=TOL)
    rest = train_module(spec, train, "classification", ModuleTrainConfig(out=str(tmp_path / "half"), **BASE),
                        val_dataset=val, resume=True)
    assert rest.losses == pytest.approx(full.losses[2:], abs=TOL)
    assert rest.metrics["val_loss"] == pytest.approx(full.metrics["val_loss"], abs=TOL)


def test_prefetched_steps_train_to_the_losses_of_steps_read_inline(tmp_path, monkeypatch):
    """The trainer reads the next batches on a thread (data.prefetch.Prefetcher); the losses are bit-identical to
    reading each step's batch in the step, as the trainer did before."""
    from prunus.train_parallel import trainer  # the one training loop

    train, val = synthetic_datasets(CNN_DATA)
    made = []

    class Inline:  # each step's batch read in the step itself, on this thread
        def __init__(self, make, keys, device="cpu", depth=2):
            self.make, self.keys = make, keys

        def __iter__(self):
            for k in self.keys:
                made.append(k)
                yield k, self.make(k)

        def close(self):
            pass

    prefetched = train_module("test_any_model:resnet", train, "classification",
                              ModuleTrainConfig(out=str(tmp_path / "a"), **BASE), val_dataset=val)
    monkeypatch.setattr(trainer, "Prefetcher", Inline)
    inline = train_module("test_any_model:resnet", train, "classification",
                          ModuleTrainConfig(out=str(tmp_path / "b"), **BASE), val_dataset=val)
    assert made == list(range(BASE["steps"]))
    assert prefetched.losses == inline.losses and prefetched.metrics["val_loss"] == inline.metrics["val_loss"]


def test_regression_and_a_user_loss(tmp_path):
    train, val = synthetic_datasets("synthetic:regression?n=64&shape=16&outputs=2&val=16")
    cfg = dict(**BASE, model_args={"d_in": 16, "classes": 2})
    mse = train_module("test_any_model:two_linear", train, "regression",
                       ModuleTrainConfig(out=str(tmp_path / "mse"), **cfg), val_dataset=val)
    user = train_module("test_any_model:two_linear", train, "test_any_model:mse_loss",
                        ModuleTrainConfig(out=str(tmp_path / "user"), **cfg), val_dataset=val)
    assert user.losses == pytest.approx(mse.losses, abs=TOL)  # the same loss, written by the user
    assert "val_accuracy" not in mse.metrics and mse.metrics["val_loss"] == pytest.approx(user.metrics["val_loss"], abs=TOL)
    config = json.loads((user.model_dir / "config.json").read_text())
    assert config["task"] == "test_any_model:mse_loss" and config["args"] == {"d_in": 16, "classes": 2}
    assert get_task(config["task"], trust=True, where=str(user.model_dir)).name == "test_any_model:mse_loss"


def test_api_refusals_are_one_line(tmp_path):
    train, _ = synthetic_datasets(MLP_DATA)
    out = dict(out=str(tmp_path / "r"), **BASE)
    cases = [
        (lambda: train_module(nn.Linear(8, 3), train, "classification", ModuleTrainConfig(**out)), "carries no factory"),
        (lambda: train_module("test_any_model:two_linear", [(1, 2, 3)], "classification", ModuleTrainConfig(**out)),
         "not an (input, target) pair"),
        (lambda: train_module("test_any_model:two_linear", train, "ranking", ModuleTrainConfig(**out)), "--task 'ranking'"),
        (lambda: train_module("test_any_model:two_linear", train, "classification",
                              ModuleTrainConfig(**{**out, "model_args": {"classes": 3.5j}})), "not a JSON value"),
    ]
    for call, needle in cases:
        with pytest.raises(PrunusError) as e:
            call()
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "r").exists()


# --- two processes against one ----------------------------------------------------------------------------------

LAYOUTS = {
    "mlp/ddp": ("test_any_model:two_linear", MLP_DATA, dict(zero=0), None),
    "mlp/zero1": ("test_any_model:two_linear", MLP_DATA, dict(zero=1), None),
    "mlp/fsdp": ("test_any_model:two_linear", MLP_DATA, dict(zero=3), None),
    "cnn/ddp_sync_bn": ("test_any_model:resnet", CNN_DATA, dict(zero=0, sync_batchnorm=True), None),
    "cnn/fsdp_sync_bn": ("test_any_model:resnet", CNN_DATA, dict(zero=2, sync_batchnorm=True), None),
    "cnn/ddp_plain_bn": ("test_any_model:resnet", CNN_DATA, dict(zero=0), "differs"),  # each rank's own statistics
}


# pipeline (user split points) and tensor parallel (user plan) layouts: each against one process running the
# same micro-batches with gradient accumulation (BatchNorm's statistics are per micro-batch in both)
PLAN = {"fc1": "colwise", "fc2": "rowwise"}
SPLIT_LAYOUTS = {
    "cnn/pp_1f1b": ("test_any_model:resnet", CNN_DATA, dict(pp_split="3", microbatches=4, pp_schedule="1F1B"), 4),
    "mlp/pp_gpipe": ("test_any_model:two_linear", MLP_DATA, dict(pp_split="fc2", microbatches=2, pp_schedule="GPipe"),
                     2),
    "mlp/tp_plan": ("test_any_model:two_linear", MLP_DATA, dict(tp=2), 1),
}


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, spawn_jobs):
    tmp = tmp_path_factory.mktemp("any2")
    (tmp / "plan.json").write_text(json.dumps(PLAN))
    jobs = [{"name": name, "model": spec, "data": data, "task": "classification",
             "config": {**BASE, **layout, "out": str(tmp / name.replace("/", "_"))}}
            for name, (spec, data, layout, _) in {**LAYOUTS, **SPLIT_LAYOUTS}.items()]
    jobs[-1]["config"]["tp_plan"] = str(tmp / "plan.json")
    # stopped at step 2 under the pipeline (each stage saves its own parameters), resumed in one process
    jobs.append({"name": "cnn/pp_stop", "model": "test_any_model:resnet", "data": CNN_DATA, "task": "classification",
                 "config": {**BASE, **SPLIT_LAYOUTS["cnn/pp_1f1b"][2], "stop_at": 2, "out": str(tmp / "pp_stop")}})
    # stopped at step 2 under FSDP (a sharded checkpoint), resumed under DDP
    ckpt = {**BASE, "zero": 3, "sync_batchnorm": True, "stop_at": 2, "out": str(tmp / "ckpt")}
    jobs.append({"name": "cnn/stop_fsdp", "model": "test_any_model:resnet", "data": CNN_DATA, "task": "classification",
                 "config": ckpt})
    jobs.append({"name": "cnn/resume_ddp", "model": "test_any_model:resnet", "data": CNN_DATA, "task": "classification",
                 "config": {**ckpt, "zero": 0, "stop_at": None}, "resume": True})
    return {**spawn_jobs(WORKER, 2, jobs, tmp), "_tmp": str(tmp)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """{spec: figures} of one process, and {(spec, k): figures} of one process accumulating k micro-batches."""
    tmp, refs = tmp_path_factory.mktemp("any1"), {}
    runs = {(s, d, 1) for s, d, _, _ in LAYOUTS.values()} | {(s, d, k) for s, d, _, k in SPLIT_LAYOUTS.values()}
    for spec, data, accum in runs:
        train, val = synthetic_datasets(data)
        cfg = ModuleTrainConfig(out=str(tmp / f"{spec.split(':')[1]}_{accum}"), grad_accum=accum, **BASE)
        r = train_module(spec, train, "classification", cfg, val_dataset=val)
        refs[(spec, accum)] = {"losses": r.losses, "val_loss": r.metrics["val_loss"], "model_dir": r.model_dir}
        if accum == 1:
            refs[spec] = refs[(spec, accum)]
    return refs


@pytest.mark.parametrize("name", LAYOUTS)
def test_two_ranks_train_to_the_losses_of_one_process(two_rank, one_process, name):
    spec, _, _, expect = LAYOUTS[name]
    got, ref = two_rank[name], one_process[spec]
    assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])] + [abs(got["val_loss"] - ref["val_loss"])]
    assert len(got["losses"]) == len(ref["losses"])
    if expect == "differs":  # plain BatchNorm normalises by each rank's half: the reason for --sync-batchnorm
        assert max(diffs) > 1e-4, diffs
    else:
        assert max(diffs) <= TOL, f"{name}: |loss - one process| per step {diffs}"


@pytest.mark.parametrize("name", SPLIT_LAYOUTS)
def test_pipeline_and_tensor_parallel_train_to_the_losses_of_one_process(two_rank, one_process, name):
    spec, _, _, accum = SPLIT_LAYOUTS[name]
    got, ref = two_rank[name], one_process[(spec, accum)]
    assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
    assert len(got["losses"]) == len(ref["losses"]) == BASE["steps"]
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])] + [abs(got["val_loss"] - ref["val_loss"])]
    assert max(diffs) <= TOL, f"{name}: |loss - one process| per step {diffs}"
    # the model dir holds every stage's (or shard's) weights under the whole module's names
    mine = load_model(got["model_dir"], trust_factory=True).state_dict()
    theirs = load_model(ref["model_dir"], trust_factory=True).state_dict()
    assert set(mine) == set(theirs) and all(torch.allclose(mine[k].float(), theirs[k].float(), atol=1e-5) for k in mine)


def test_a_pipeline_checkpoint_resumes_in_one_process(two_rank, one_process, tmp_path):
    ref, stopped = one_process[("test_any_model:resnet", 4)], two_rank["cnn/pp_stop"]
    assert "error" not in stopped, f"{stopped.get('error')}\n{stopped.get('trace')}"
    assert stopped["losses"] == pytest.approx(ref["losses"][:2], abs=TOL)
    run = Path(two_rank["_tmp"]) / "pp_stop"
    train, val = synthetic_datasets(CNN_DATA)
    rest = train_module("test_any_model:resnet", train, "classification",
                        ModuleTrainConfig(out=str(run), **{**BASE, "grad_accum": 4}), val_dataset=val, resume=True)
    assert rest.losses == pytest.approx(ref["losses"][2:], abs=TOL)
    assert rest.metrics["val_loss"] == pytest.approx(ref["val_loss"], abs=TOL)


def test_a_sharded_checkpoint_resumes_under_ddp(two_rank, one_process):
    ref = one_process["test_any_model:resnet"]
    stopped, resumed = two_rank["cnn/stop_fsdp"], two_rank["cnn/resume_ddp"]
    for got in (stopped, resumed):
        assert "error" not in got, f"{got.get('error')}\n{got.get('trace')}"
    assert stopped["losses"] == pytest.approx(ref["losses"][:2], abs=TOL)
    assert resumed["losses"] == pytest.approx(ref["losses"][2:], abs=TOL)
    assert resumed["val_loss"] == pytest.approx(ref["val_loss"], abs=TOL)


# --- the command line -------------------------------------------------------------------------------------------

def _npy_folder(root: Path, shape=(3, 8, 8), per_class=6) -> Path:
    gen = np.random.default_rng(0)
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            np.save(root / name / f"{i}.npy", (gen.random(shape) + c).astype(np.float32))
    (root / "dog" / ".hidden.npy").write_bytes(b"not read")
    (root / "cat" / "notes.txt").write_text("skipped")
    return root


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory):
    """(run dir, export dir, the train and export results) of one CLI run of the two-Linear model."""
    tmp = tmp_path_factory.mktemp("cli")
    runner, run = CliRunner(), tmp / "run"
    trained = runner.invoke(cli, [
        "train", "--model", "test_any_model:two_linear", "--model-args", "d_in=8,hidden=16", "--data", MLP_DATA,
        "--task", "classification", "--steps", "4", "--batch-size", "8", "--warmup-steps", "1", "--eval-every", "2",
        "--ckpt-every", "0", "--out", str(run), "--no-progress"])
    exported = runner.invoke(cli, ["export", str(run / "model"), "--format", "onnx", "--out", str(tmp / "exp"),
                                   "--trust-factory"]) if trained.exit_code == 0 else None
    return run, tmp / "exp", trained, exported


def test_cli_trains_and_exports_any_module(cli_export):
    run, exp, trained, exported = cli_export
    assert trained.exit_code == 0, trained.output
    assert f"model dir: {run / 'model'}" in trained.output
    assert exported.exit_code == 0, exported.output
    parity = json.loads((exp / "parity.json").read_text())
    assert parity["passed"] and parity["max_abs_outputs"] <= 1e-3 and parity["top1_agreement"] == 1.0
    assert parity["samples"] == 64  # another batch size than the one traced: the batch axis is dynamic
    config = json.loads((exp / "config.json").read_text())
    assert config["export"]["graphs"] == {"model": "model.onnx"} and config["factory"] == "test_any_model:two_linear"
    manifest = json.loads((exp / "prunus.json").read_text())
    assert manifest["stage"] == "export" and manifest["metrics"]["passed"] is True


def test_cli_trains_a_batchnorm_cnn_on_an_image_folder(tmp_path):
    folder = _npy_folder(tmp_path / "images")
    train, val = image_folder_datasets(folder, val_fraction=0.25)
    assert train.classes == ["cat", "dog"] and len(train) + len(val) == 12 and len(val) >= 1
    x, y = train[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    result = CliRunner().invoke(cli, [
        "train", "--model", "test_any_model:resnet", "--model-args", "width=4,classes=2", "--data", str(folder),
        "--val-fraction", "0.25", "--steps", "3", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "3",
        "--ckpt-every", "0", "--out", str(tmp_path / "run"), "--no-progress"])
    assert result.exit_code == 0, result.output
    model = load_model(tmp_path / "run" / "model", trust_factory="test_any_model:resnet")
    assert float(model[1].num_batches_tracked) == 3  # BatchNorm's running statistics trained and saved


def test_export_refuses_a_failed_parity_unless_told(cli_export, tmp_path, monkeypatch):
    """The whole export but the tracing (the graph the CLI test exported is reused), with a limit no graph meets."""
    import onnx

    from prunus.export import ParityFailed, export_model
    from prunus.export import module_export

    run, exp, trained, _ = cli_export
    assert trained.exit_code == 0, trained.output
    graph = onnx.load(str(exp / "model.onnx"))
    monkeypatch.setattr(module_export, "_export_graph", lambda module, example, opset: graph)
    monkeypatch.setitem(module_export.MODULE_TOLERANCES, "fp32", {"max_abs_outputs": -1.0, "top1_agreement": 1.0})
    with pytest.raises(ParityFailed, match="max_abs_outputs"):
        export_model(run / "model", tmp_path / "exp", trust_factory=True, progress=False)
    assert not (tmp_path / "exp").exists()
    result = export_model(run / "model", tmp_path / "exp", trust_factory=True, verify=False, progress=False)
    assert not result.parity["passed"] and result.parity["failed"] == ["max_abs_outputs"]
    assert json.loads((tmp_path / "exp" / "parity.json").read_text())["passed"] is False


@pytest.mark.parametrize("extra, needle", [
    (["--model", "prunus_no_such_package_xyz:build"], "--model prunus_no_such_package_xyz:build: importing"),
    (["--model", "test_any_model:not_a_module"], "returned a int, not a torch.nn.Module"),
    (["--model", "test_any_model:broken"], "building the model failed (ValueError"),
    (["--model", "test_any_model:two_linear", "--model-args", "d_in=__import__('os')"], "--model-args d_in"),
    (["--model", "test_any_model:two_linear", "--model-args", "hidden=-3"], "building the model failed"),
    (["--model", "not a spec"], "not a factory spec"),
    (["--model", "test_any_model:two_linear", "--tp", "2"], "--tp 2 needs --tp-plan FILE.json"),
    (["--model", "test_any_model:two_linear", "--pp", "2"], "--pp applies to the transformer"),
    (["--model", "test_any_model:two_linear", "--pp-split", "fc3", "--nproc", "2"],
     "--pp-split 'fc3': not a top-level child of TwoLinear; its children are fc1, fc2"),
    (["--model", "test_any_model:block", "--pp-split", "conv2", "--nproc", "2"],
     "Block's forward is not a plain sequence of its children (add uses x, not only the step before it); make"),
    (["--model", "test_any_model:two_linear", "--pp-split", "fc2", "--microbatches", "1", "--nproc", "2"],
     "--microbatches 1 is too few for 1F1B with 2 stages"),
    (["--model", "test_any_model:two_linear", "--pp-split", "fc2", "--nproc", "3"], "set --nproc 2"),
    (["--pp-split", "fc2"], "--pp-split applies to a generic module"),
    (["--model", "test_any_model:two_linear", "--pp-split", "fc2", "--zero", "3", "--nproc", "2"],
     "--zero 3 applies to data parallelism; a generic module's pipeline or tensor parallel layout"),
    (["--model", "test_any_model:two_linear", "--tp", "2", "--tp-plan", "p.json", "--sync-batchnorm"],
     "--sync-batchnorm applies to data parallelism"),
    (["--sync-batchnorm"], "--sync-batchnorm applies to a generic module"),
    (["--model", "test_any_model:two_linear", "--task", "ranking"], "--task 'ranking'"),
    (["--model", "test_any_model:two_linear", "--data", "synthetic:images"], "synthetic kind 'images'"),
    (["--model", "test_any_model:two_linear", "--data", "synthetic:classification?n=0"], "n='0' must be"),
    (["--model", "test_any_model:two_linear", "--data", "no/such/dir"], "does not exist"),
    (["--model", "test_any_model:two_linear", "--world-size", "4"], "--world-size plans a transformer run"),
    (["--model", "test_any_model:broken", "--nproc", "2"], "building the model failed"),  # before any rank starts
    (["--model", "test_any_model:two_linear", "--nproc", "3"], "--batch-size 4 is not divisible by the 3"),
])
def test_cli_bad_inputs_are_one_line_exit_2(tmp_path, assert_user_error, extra, needle):
    args = ["train", "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--no-progress"]
    if "--data" not in extra:
        args += ["--data", MLP_DATA]
    result = CliRunner().invoke(cli, [*args, *extra])
    assert_user_error(result, needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("plan, needle", [
    ({"fc3": "colwise"}, "entry 'fc3' is not a module of TwoLinear"),
    ({"fc1": "diagonal"}, "entry 'fc1' is 'diagonal', not colwise or rowwise"),
    ({"fc1": "colwise", "fc2": "rowwise", "": "rowwise"}, "entry '' is not a module"),
    ({"fc2": "colwise"}, "entry 'fc2' (colwise) has 3 outputs, not divisible by --tp 2"),
    ([["fc1", "colwise"]], "holds a JSON list, not an object"),
])
def test_a_tp_plan_that_does_not_fit_is_one_line_before_any_rank_starts(tmp_path, assert_user_error, plan, needle):
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = CliRunner().invoke(cli, ["train", "--model", "test_any_model:two_linear", "--data", MLP_DATA, "--tp", "2",
                                      "--tp-plan", str(tmp_path / "plan.json"), "--nproc", "2", "--steps", "2",
                                      "--batch-size", "4", "--out", str(tmp_path / "run"), "--no-progress"])
    assert_user_error(result, needle)
    assert str(tmp_path / "plan.json") in result.output and not (tmp_path / "run").exists()


def test_a_tp_plan_naming_a_convolution_is_refused(tmp_path, assert_user_error):
    (tmp_path / "plan.json").write_text(json.dumps({"0": "colwise"}))
    result = CliRunner().invoke(cli, ["train", "--model", "test_any_model:resnet", "--data", CNN_DATA, "--tp", "2",
                                      "--tp-plan", str(tmp_path / "plan.json"), "--nproc", "2", "--steps", "2",
                                      "--batch-size", "4", "--out", str(tmp_path / "run"), "--no-progress"])
    assert_user_error(result, "entry '0' is a Conv2d, not an nn.Linear; a plan shards Linear layers only")


def test_pipeline_stages_keep_the_whole_modules_names_and_outputs():
    from prunus.train_parallel.pipeline.split_pipeline import split_stages

    torch.manual_seed(0)
    model = resnet().eval()
    stages = split_stages(model, ["3", "6"])
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(stages[2](stages[1](stages[0](x))), model(x))
    assert [sorted(k for k, _ in s.named_parameters()) for s in stages] == [
        ["0.weight", "1.bias", "1.weight"], sorted(k for k, _ in model.named_parameters() if k.startswith("3.")),
        ["6.bias", "6.weight"]]
    with pytest.raises(PrunusError, match="--pp-split 6,3: name children after the first"):
        split_stages(model, ["6", "3"])
    named = NamedResNet().eval()  # seq1 = conv1 ... layer2, seq2 = layer3 ... fc (the flatten between included)
    first, second = split_stages(named, ["layer3"])
    assert torch.equal(second(first(x)), named(x))
    assert {k.split(".")[0] for k, _ in second.named_parameters()} == {"layer3", "fc"}


# --- data specs ---------------------------------------------------------------------------------------------------

def test_synthetic_data_is_deterministic_and_learnable_in_shape():
    train, val = synthetic_datasets("synthetic:classification?n=256&shape=3x32x32&classes=10")
    again, _ = synthetic_datasets("synthetic:classification?n=256&shape=3x32x32&classes=10")
    assert len(train) == 256 and len(val) == 64 and train[5][0].shape == (3, 32, 32)
    assert torch.equal(train[5][0], again[5][0]) and int(train[5][1]) == int(again[5][1])
    assert not torch.equal(val[0][0], train[0][0])  # the held-out samples follow the training ones
    assert len({int(train[i][1]) for i in range(256)}) > 5
    with pytest.raises(PrunusError, match="unknown parameter 'width'"):
        module_datasets("synthetic:classification?width=3")


def test_image_folder_checks_every_file_up_front(tmp_path, monkeypatch):
    folder = _npy_folder(tmp_path / "a")
    np.save(folder / "dog" / "big.npy", np.zeros((3, 9, 8), np.float32))
    with pytest.raises(PrunusError, match=r"big.npy: an image of \(3, 9, 8\) .* among images of \(3, 8, 8\)"):
        image_folder_datasets(folder)
    (folder / "dog" / "big.npy").unlink()
    np.save(folder / "dog" / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PrunusError, match="obj.npy: holds object"):
        image_folder_datasets(folder)
    (folder / "dog" / "obj.npy").unlink()
    (folder / "dog" / "photo.png").write_bytes(b"\x89PNG not really")
    from prunus.data import image_folder

    monkeypatch.setattr(image_folder, "has_pil", lambda: False)
    with pytest.raises(PrunusError, match="photo.png: Pillow is not installed, so only .npy images are read"):
        image_folder_datasets(folder)
