"""Training any ``nn.Module``: :func:`train_module` (the Python API) and ``prunus train --model``.

The module (or a factory spec that builds it, :mod:`prunus.models.module_factory`) trains on a map-style
``Dataset`` of (input, target) samples for a task (:mod:`prunus.models.tasks`: the loss and the held-out
figures) with the engine's data parallelism: one process (``grad_accum`` micro-steps a step), DDP (``zero``
0 / 1) or FSDP2 (``zero`` 2 / 3) over every rank torchrun or ``--nproc`` started, BatchNorm optionally
synchronised; or a pipeline split before user-named children (``pp_split``, :mod:`.pipeline.split_pipeline`),
or tensor parallelism by a user plan (``tp_plan``, :mod:`.tensor_parallel.plan_file`). Every layout sees the same
global batch per step (:class:`prunus.data.global_batches.GlobalBatches`), so it trains to the same losses
as one process. The run dir is the transformer's: ``run.json``, ``metrics.jsonl``, ``checkpoints/step-N``
(reloadable under any layout) and, at the end, ``model/``: a generic model dir that records the factory.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from prunus.artifacts.errors import PrunusError
from torch.utils.data import default_collate

from prunus.data.global_batches import check_pair, eval_batches, step_batches
from prunus.data.tables import model_dir_files
from prunus.data.module_fit import check_fits
from prunus.data.prefetch import to_device
from prunus.models.module_dir import input_spec
from prunus.models.module_factory import ModuleFactory, build_module, check_args
from prunus.models.module_reshape import apply_shapes, shape_changes
from prunus.models.spec import get_spec
from prunus.models.tasks import Task, get_task

from .checkpoint.best import best_figure, improves, load_best, read_best, save_best
from .checkpoint.checkpoint import Checkpointer
from .data_parallel.data_parallel import broadcast_from_first, unwrapped
from .data_parallel.modes import dp_mode
from .launch.launch import init_distributed, reports_collective_timeouts
from .metrics import MetricsLog
from .module_config import ModuleTrainConfig
from .parallel_dims import ParallelDims
from .pipeline.split_pipeline import ModulePipeline, parse_split, split_stages
from .tensor_parallel.plan_file import check_tp_plan, read_tp_plan
from .run_dir import check_run_dir, publish_run_dir, run_location
from .train_result import TrainResult
from .trainer import Trainer, build_optimizer


def _call(model, x):
    """The module on one batch's input: a tensor, or a tuple / dict of them (positional / keyword arguments)."""
    if isinstance(x, (list, tuple)):
        return model(*x)
    if isinstance(x, dict):
        return model(**x)
    return model(x)


def _split(obj, n: int) -> list:
    """``n`` micro-batches of a batch's input or target (a tensor, or a tuple / dict of them) along dim 0."""
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(n))
    if isinstance(obj, (list, tuple)):
        return [type(obj)(parts) for parts in zip(*(_split(o, n) for o in obj))]
    if isinstance(obj, dict):
        parts = {k: _split(v, n) for k, v in obj.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return [obj] * n


def check_layout(module: torch.nn.Module, cfg: ModuleTrainConfig) -> dict | None:
    """One line unless ``module`` splits at ``--pp-split`` and fits ``--tp-plan``; returns the plan (or None)."""
    if cfg.pp > 1:
        split_stages(module, parse_split(cfg.pp_split))
    if cfg.tp == 1:
        return None
    plan = read_tp_plan(cfg.tp_plan)
    check_tp_plan(module, plan, cfg.tp, cfg.tp_plan)
    return plan


def _resolve_model(module_or_spec, cfg: ModuleTrainConfig, factory: ModuleFactory | None):
    """(the module, its factory, cfg naming it): a spec is built here (seeded), a module taken as it is."""
    if isinstance(module_or_spec, str):
        cfg = replace(cfg, model=module_or_spec, model_args=check_args(cfg.model_args, "model_args"))
        torch.manual_seed(cfg.seed)
        module = build_module(cfg.model, cfg.model_args)
        return module, module.prunus_factory, cfg
    if not isinstance(module_or_spec, torch.nn.Module):
        raise PrunusError(f"train_module: {type(module_or_spec).__name__} is neither a torch.nn.Module nor a factory "
                          "spec package.module:callable")
    factory = factory or getattr(module_or_spec, "prunus_factory", None)
    if not isinstance(factory, ModuleFactory):
        raise PrunusError("train_module: the module carries no factory spec, so its model dir could not rebuild it; "
                          "pass the spec 'package.module:callable' instead, or factory=ModuleFactory(spec, args)")
    return module_or_spec, factory, replace(cfg, model=factory.spec, model_args=factory.args)


def _input_spec(dataset) -> dict | None:
    """config.json's ``input``: one sample's shape and dtype (integer inputs: the largest value seen + 1)."""
    x = dataset[0][0]
    if not isinstance(x, torch.Tensor):
        return None
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        return input_spec(x)
    seen = [dataset[i][0] for i in range(min(len(dataset), 64))]
    return input_spec(x, high=max(int(t.max()) for t in seen) + 1)


@torch.no_grad()
def score_module(model: torch.nn.Module, task: Task, dataset, *, batch_size: int, max_samples: int,
                 device: torch.device | str = "cpu", scorer=None) -> dict:
    """The task's held-out figures (``val_loss``, ``val_accuracy`` for classification) of ``model`` in eval mode on
    the first ``max_samples`` samples of ``dataset``; ``scorer(x, y) -> (loss sum, count, correct)`` replaces the
    plain forward (the pipeline's). What the trainer's evaluation and ``prunus eval`` of a module dir compute."""
    model.eval()
    loss_sum, count, correct = 0.0, 0, 0
    for x, y in eval_batches(dataset, batch_size, max_samples):
        x, y = to_device((x, y), device)
        s, n, c = scorer(x, y) if scorer is not None else task.sums(_call(model, x), y)
        loss_sum, count, correct = loss_sum + s, count + n, correct + (c or 0)
    return task.summary(loss_sum, count, correct)


class ModuleTrainer(Trainer):
    """One run (or its resumption) of a generic module on this rank; build it, then call :meth:`train`.

    The generic spec's :class:`~.trainer.Trainer`: it builds its own model, layout and batches (a factory's
    module on a Dataset's samples), and overrides the batch, forward-backward, evaluation, after-step and
    model-dir steps; the loop, the checkpoint load, the learning rate, the optimizer step, the run dir and failure
    clean-up are the Trainer's."""

    def __init__(self, module_or_spec, dataset, task: str, cfg: ModuleTrainConfig, *, val_dataset=None,
                 factory: ModuleFactory | None = None, resume: bool = False, overwrite: bool = False):
        cfg = replace(cfg, task=task)
        cfg.validate()
        self.spec = get_spec(cfg.KIND)  # the generic kind's entries (prunus.models.spec): layout, model dir
        check_pair(dataset, "dataset")
        if val_dataset is not None:
            check_pair(val_dataset, "val_dataset")
        self.task: Task = get_task(task)
        self.rank, self.world, launched = init_distributed(cfg.timeout_s)
        self.main = self.rank == 0
        if self.world != cfg.pp * cfg.tp and (cfg.pp > 1 or cfg.tp > 1):
            raise PrunusError(f"{'--pp-split' if cfg.pp > 1 else '--tp'} needs {cfg.pp * cfg.tp} ranks but {self.world} "
                              f"run; start them with --nproc {cfg.pp * cfg.tp} (or torchrun)")
        self.dims = ParallelDims(world_size=self.world, zero=cfg.zero_stage(), pp=cfg.pp, tp=cfg.tp)
        cfg = replace(cfg, zero=self.dims.zero)
        self.batches = step_batches(dataset, cfg.batch_size, seed=cfg.seed, rank=self.dims.submesh_rank("dp"),
                                    world=self.dims.dp, workers=cfg.data_workers)
        module, self.factory, cfg = _resolve_model(module_or_spec, cfg, factory)
        self.cfg, self.dataset, self.val_dataset = cfg, dataset, val_dataset
        self.device = launched if cfg.device == "auto" else torch.device(cfg.device)
        self._locate_run(resume, overwrite)
        module = module.to(self.device)
        check_fits(module, dataset, self.task, _call, "--data " + cfg.data if cfg.data else "dataset")
        self._barrier()  # every rank has checked the run dir and the data before rank 0 writes to it
        self.pipeline: ModulePipeline | None = None
        self.model = self._parallelize(module)
        self.forward_module = dp_mode(cfg).forward_module(self.model)  # dataparallel: nn.DataParallel's replicas
        self.optimizers = [build_optimizer(self.model, cfg, self.dims.zero1_mesh)]
        self.checkpointer = Checkpointer(self.run_dir, cfg.keep_checkpoints)
        self.start, self.train_state = self._load_checkpoint([self.model])
        self.train_state["samples"] = self.train_state["tokens"]  # a module's count of what was trained on
        self.best: dict | None = None  # the best checkpoint's record (checkpoints/best)
        if self.resume_from is not None:
            self._check_readers(self.train_state.get("data_readers"))
            self.best = read_best(self.run_dir)
            if self.best is not None and self.best["step"] > self.start:  # from steps this resumption runs again
                self.best = None
        if hasattr(self.batches, "readers"):  # a stream's position depends on its number of readers
            self.train_state["data_readers"] = self.batches.readers
        self.stop = cfg.stop_at or cfg.steps
        self.losses: list[float] = []
        self.record: dict = {}
        self.pending: list[dict] = []  # records whose losses are not yet averaged over the ranks (_settle)
        self.progress, self._loss_modules = contextlib.nullcontext(), contextlib.ExitStack()  # the Trainer's loop's
        self._init_run_dir({})

    def _parallelize(self, module: torch.nn.Module) -> torch.nn.Module:
        """What the step trains on this rank: the pipeline's stage, the module under the TP plan, or under data
        parallelism (the spec's ``parallelize``: :func:`.data_parallel.data_parallel.parallelize_any`). Every rank
        starts from the first rank's weights."""
        cfg, dims = self.cfg, self.dims
        plan = check_layout(module, cfg)
        if cfg.dp_mode == "dataparallel":  # one process: the forward replicated over every GPU, the module kept plain
            return module
        if dims.pp == 1 and dims.tp == 1:
            return self.spec.load("parallelize")(module, dims, sync_batchnorm=cfg.sync_batchnorm)
        broadcast_from_first(module, dist.group.WORLD)
        if dims.pp > 1:
            self.pipeline = ModulePipeline(module, parse_split(cfg.pp_split), dims.submesh_group("pp"),
                                           schedule=cfg.pp_schedule, microbatches=cfg.microbatches,
                                           loss_fn=self.task.loss, device=self.device, example=self._example(
                                               cfg.batch_size // cfg.microbatches))
            return self.pipeline.part
        example = self._example(1)
        return self.spec.load("tp_plan")(module, plan, dims.submesh("tp"), lambda m: _call(m, example))

    def _example(self, n: int):
        """The input of the dataset's first ``n`` samples, collated, on the device."""
        return to_device(default_collate([self.dataset[i] for i in range(min(n, len(self.dataset)))])[0], self.device)

    def step_batches(self, step: int):
        """The step's (input, target) on this rank: its share of the global batch (a pure function of the seed and
        the step, or the stream's next)."""
        return self.batches.batch(step)

    def forward_backward_step(self, x, y) -> torch.Tensor:
        """The step's loss (the mean over its micro-batches), gradients accumulated."""
        if self.pipeline is not None:
            return self.pipeline.step(x, y)
        n, total = self.cfg.grad_accum, torch.zeros((), device=self.device)
        for xm, ym in zip(_split(x, n), _split(y, n)):
            loss = self.task.loss(_call(self.forward_module, xm), ym)
            (loss / n).backward()
            total += loss.detach().float()
        return total / n

    def _check_readers(self, saved) -> None:
        mine = getattr(self.batches, "readers", None)
        if saved != mine and mine is not None:
            was = "did not stream tar shards" if saved is None else f"streamed its shards with {saved} readers"
            raise PrunusError(f"--resume: the run {was} (ranks x data workers), now {mine}; resume with the same "
                              "--data, --nproc and --data-workers to continue its exact stream")

    def _settle(self, records: list[dict], metrics: MetricsLog | None) -> None:
        """The pending ``records``' losses (this rank's, as tensors) replaced by their means over the data-parallel
        ranks, in one all-reduce for all of them; then each is logged. Called every ``log_every`` steps, on eval and
        checkpoint steps and at the end, so a step runs no collective beyond its gradients' (the values are the
        ones a per-step all-reduce gives, bit for bit)."""
        if not records:
            return
        losses = torch.stack([r["loss"] for r in records])
        if self.dims.dp > 1:
            dist.all_reduce(losses, group=self.dims.submesh_group("dp"))
            losses = losses / self.dims.dp
        for record, value in zip(records, losses.tolist()):
            record["loss"] = value
            self.losses.append(value)
            self._log(record, metrics)
        self.record = records[-1]
        records.clear()

    def train_step(self, step: int, batch=None) -> dict:
        """One optimizer step (0-based ``step``) on ``batch`` (the step's (input, target), already on the device;
        read here when None); returns its record for metrics.jsonl, whose ``loss`` is this rank's loss as a
        tensor until :meth:`_settle` averages it over the ranks."""
        cfg, t0 = self.cfg, time.perf_counter()
        lr = self._set_lr(step)
        x, y = to_device(self.step_batches(step), self.device) if batch is None else batch
        self.model.train()
        loss = self.forward_backward_step(x, y)
        grad_norm = self.optimizer_step([self.model])
        dt = time.perf_counter() - t0
        self.train_state["samples"] += cfg.batch_size
        self.train_state["tokens"] = self.train_state["samples"]  # the checkpoint's count of what was trained on
        self.train_state["elapsed_s"] += dt
        done = step + 1
        record = {"step": done, "loss": loss.detach().float(), "lr": lr, "grad_norm": grad_norm,
                  "samples_per_s": cfg.batch_size / dt, "elapsed_s": self.train_state["elapsed_s"],
                  "samples": self.train_state["samples"]}
        if self.val_dataset is not None and (done % cfg.eval_every == 0 or done == self.stop):
            record.update(self.evaluate())
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The task's held-out figures of the module as it is now (every rank scores the same samples)."""
        model = unwrapped(self.model)
        scorer = None if self.pipeline is None else (lambda x, y: self.pipeline.score(x, y, self.task.sums))
        figures = score_module(model, self.task, self.val_dataset, batch_size=self.cfg.batch_size,
                               max_samples=self.cfg.eval_samples, device=self.device, scorer=scorer)
        model.train()
        return figures

    def _log(self, record: dict, metrics: MetricsLog | None) -> None:
        if metrics is not None:
            metrics.write(record)
        step = record["step"]
        if self.main and self.cfg.progress and (step % self.cfg.log_every == 0 or step == self.stop or "val_loss" in record):
            val = "".join(f"  {k} {v:.4f}" for k, v in record.items() if k in ("val_loss", "val_accuracy"))
            print(f"step {step}/{self.cfg.steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}{val}", flush=True)

    def after_step(self, record: dict, metrics: MetricsLog | None) -> None:
        """The step's record kept until a log, evaluation or checkpoint step averages the pending losses over the
        ranks (:meth:`_settle`); then the best weights kept after an evaluation, a checkpoint when due."""
        done, save = record["step"], self.checkpoint_due(record["step"])
        self.pending.append(record)
        if save or done % self.cfg.log_every == 0 or done == self.stop or "val_loss" in record:
            self._settle(self.pending, metrics)
        if "val_loss" in record:
            self._keep_best(done, record)
        if save:
            self.checkpointer.save(done, [self.model], self.optimizers, self.train_state)

    def _announce(self) -> None:
        """A module's run prints its steps' lines only (:meth:`_log`)."""

    def _full_state(self) -> dict:
        """The module's full state dict, gathered on rank 0 (a collective every rank calls)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pipeline is not None:
            return self.pipeline.full_state()
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _keep_best(self, step: int, record: dict) -> None:
        """After an evaluation: the weights kept as checkpoints/best when its figure beats the best so far (every
        rank decides alike: each scored the same samples)."""
        figure = best_figure(record)
        if figure is None or not improves(figure, self.best):
            return
        state = self._full_state()
        figures = {k: v for k, v in record.items() if k.startswith("val_")}
        if self.main:
            self.best = save_best(self.run_dir, step, figure, state, figures)
        else:
            self.best = {"step": step, "metric": figure[0], "value": figure[1], "figures": figures}

    def save_model(self) -> Path | None:
        """The model dir at RUN_DIR/model, from the full state dict gathered on rank 0 (a collective), or from the
        best checkpoint (``model_from`` best), loaded into a module the factory builds afresh (so the dir is
        known to rebuild)."""
        from_best = self.cfg.model_from == "best" and self.best is not None
        state = None if from_best else self._full_state()
        if not self.main:
            return None
        if from_best:
            state = load_best(self.run_dir, self.best)
        fresh = self.factory.build(source="model dir factory")
        pruned = shape_changes(state, fresh.state_dict())  # a channel-pruned module: its cut shapes recorded
        apply_shapes(fresh, pruned, "model dir factory", "train the module the factory builds")
        fresh.load_state_dict(state, strict=True)
        metrics = {k: v for k, v in self.record.items() if k.startswith("val_")}
        if from_best:
            metrics = {**self.best.get("figures", {}), "best_step": self.best["step"]}
        metrics.update(train_steps=self.stop, train_samples=self.train_state["samples"], world_size=self.world,
                       task=self.task.name)
        path = self.spec.load("model_dir_writer")(fresh, self.run_dir / "model", stage="train", factory=self.factory, task=self.task.name,
                           input=_input_spec(self.dataset), metrics=metrics, overwrite=True, pruned_shapes=pruned,
                           extra_files=model_dir_files(self.dataset))  # a table's labels.json
        if self.cfg.progress:
            which = f" (the best step, {self.best['step']:,})" if from_best else ""
            print(f"model dir: {Path(self.cfg.out) / 'model'}{which}", flush=True)
        return path

    def _finish(self) -> TrainResult:
        model_dir = self.save_model() if self.stop == self.cfg.steps else None
        self._barrier()
        out = publish_run_dir(self.cfg, self.run_dir) if self.main else Path(self.cfg.out)
        model_from = "best" if self.cfg.model_from == "best" and self.best is not None else "last"
        return TrainResult(out, out / "model" if model_dir else None, self.stop, self.record, self.losses,
                           self.best, model_from)


def config_datasets(cfg: ModuleTrainConfig) -> tuple:
    """(train, held-out) datasets of the data ``cfg.data`` (and ``cfg.test_data``) names: the spec's batch source."""
    from prunus.data.module_datasets import train_test_datasets

    return train_test_datasets(cfg.data, cfg.test_data, cfg.val_fraction, cfg.shuffle_buffer, task=cfg.task)


def preflight_module(cfg: ModuleTrainConfig, train_dataset=None, *, resume: bool, overwrite: bool) -> None:
    """Every check the ranks of ``cfg.nproc`` would make first, here, before any starts: the run dir, the task,
    the data's batch split (``train_dataset``, else the data ``cfg.data`` names), the factory building its module,
    and the module fitting the data."""
    cfg.validate()
    task = get_task(cfg.task)
    train_dataset = config_datasets(cfg)[0] if train_dataset is None else train_dataset
    check_pair(train_dataset, "--data")
    step_batches(train_dataset, cfg.batch_size, seed=cfg.seed, world=max(1, cfg.nproc // (cfg.pp * cfg.tp)),
                 workers=cfg.data_workers)
    check_run_dir(cfg, resume=resume, overwrite=overwrite, run_dir=run_location(cfg, resume=resume, overwrite=overwrite)[0],
                  quiet=True)
    module = build_module(cfg.model, cfg.model_args)
    check_layout(module, cfg)
    check_fits(module, train_dataset, task, _call, f"--data {cfg.data}")


@reports_collective_timeouts  # a hung rank: one line naming the rank and the collective
def _train(cfg: ModuleTrainConfig, module_or_spec, dataset, task, **kwargs) -> TrainResult:
    return ModuleTrainer(module_or_spec, dataset, task, cfg, **kwargs).train()


def train_module(module_or_spec, dataset, task: str = "classification", cfg: ModuleTrainConfig | None = None, *,
                 val_dataset=None, factory: ModuleFactory | None = None, resume: bool = False,
                 overwrite: bool = False) -> TrainResult:
    """Train ``module_or_spec`` (an ``nn.Module`` built by a factory, or a spec ``"package.module:callable"``
    built with ``cfg.model_args``) on ``dataset`` for ``task``; score ``val_dataset`` when given. One process,
    or every rank torchrun started (DDP / FSDP2 by ``cfg.zero``); see the module docstring."""
    cfg = cfg or ModuleTrainConfig()
    return _train(cfg, module_or_spec, dataset, task, val_dataset=val_dataset, factory=factory, resume=resume,
                  overwrite=overwrite)


def train_from_config(cfg: ModuleTrainConfig, *, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """The run ``cfg`` describes on its own (``prunus train --model``): the module its factory builds, on the data
    ``cfg.data`` names (the spec's train entry, as :func:`~.trainer.train` is the transformer's)."""
    train, val = config_datasets(cfg)
    return train_module(cfg.model, train, cfg.task, cfg, val_dataset=val, resume=resume, overwrite=overwrite)
