"""The settings of a generic module's training run (:mod:`.module_trainer`); saved in ``run.json``.

The fields the transformer's :class:`~.config.TrainConfig` also has mean the same and default the same (the
``prunus train`` options are one set); the module's own are its factory (``model``, ``model_args``), the task,
the data split and ``sync_batchnorm``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import check_dataclass, dataclass_from_dict, short

from .config import MAX_TIMEOUT_S, _doc

# settings that may change when a run is resumed (the layout among them: checkpoints reload under any)
MODULE_RESUMABLE = ("steps", "stop_at", "eval_every", "eval_samples", "ckpt_every", "keep_checkpoints", "log_every",
                    "pp_split", "pp_schedule", "microbatches", "tp", "tp_plan", "grad_accum", "data_workers", "progress", "nproc", "zero",
                    "sync_batchnorm", "timeout_s", "device", "dp_mode", "model_from")


@dataclass
class ModuleTrainConfig:
    """A generic module's training run. ``prunus train --model`` makes one option of each field (the ones it
    shares with TrainConfig are TrainConfig's options)."""

    out: str = _doc("runs/default", "Run dir (checkpoints, metrics, model/).")
    model: str | None = _doc(None, "Factory spec package.module:callable that builds the module.", cli=False)
    model_args: dict = _doc(dict, "Keyword arguments of the factory (JSON values).", cli=False)
    task: str = _doc("classification", "What the module is trained on: classification, regression, causal-lm, or a "
                                       "loss package.module:fn (fn(output, target) -> scalar).")
    data: str | None = _doc(None, "An ImageFolder directory, a directory of tar shards (shard-*.tar), a table "
                                  "FILE.csv|.parquet|.npy|.npz?target=COLUMN&features=A,B or synthetic:KIND?... (for "
                                  "the command line; the Python API takes any torch Dataset of (input, target)).")
    data_workers: int = _doc(0, "Tar shards: DataLoader worker processes reading them on each rank (0: the rank "
                                "itself).")
    shuffle_buffer: int = _doc(256, "Tar shards: samples each reader shuffles among as it streams its shards.")
    val_fraction: float = _doc(0.1, "Share of an image folder (by a hash of each path) or a table (by a seeded "
                                    "permutation of its rows) held out for evaluation.")
    test_data: str | None = _doc(None, "A separate held-out set, scored whole instead of a split of --data (a table "
                                       "then trains on all its rows); the same kinds of spec as --data.")
    batch_size: int = _doc(16, "Samples per optimizer step (the global batch), split over data-parallel ranks.")
    steps: int = _doc(1000, "Optimizer steps in the run.")
    stop_at: int | None = _doc(None, "End this invocation after this step (checkpointed); continue with --resume.")
    lr: float = _doc(2e-3, "Peak learning rate (AdamW), reached after warmup_steps, then cosine decay to min_lr.")
    min_lr: float = _doc(2e-4, "Learning rate at the last step.")
    warmup_steps: int = _doc(100, "Steps of linear warmup from 0 to lr.")
    weight_decay: float = _doc(0.1, "AdamW weight decay (on parameters of 2 or more dimensions).")
    beta1: float = _doc(0.9, "AdamW beta1.")
    beta2: float = _doc(0.95, "AdamW beta2.")
    grad_clip: float = _doc(1.0, "Clip the gradients' global norm to this; 0 disables clipping.")
    eval_every: int = _doc(100, "Score the held-out split every this many steps (and at the end).")
    eval_samples: int = _doc(4096, "Held-out samples scored per evaluation (the first of the split).")
    ckpt_every: int = _doc(200, "Checkpoint every this many steps; 0: only when stopping early.")
    keep_checkpoints: int = _doc(2, "Checkpoints kept in the run dir (the newest).")
    log_every: int = _doc(10, "Print the training loss every this many steps.")
    seed: int = _doc(0, "Random seed of the weights and the data order.")
    device: str = _doc("auto", "auto (cuda when available, else cpu), cpu or cuda.")
    progress: bool = _doc(True, "Print progress lines.")
    nproc: int = _doc(1, "Processes on this host (starts torchrun).")
    zero: int | None = _doc(None, "0 DDP, 1 sharded optimizer, 2/3 FSDP2 (the whole module one unit). Default: 0.")
    sync_batchnorm: bool = _doc(False, "Data parallel: BatchNorm statistics over the global batch of every rank "
                                       "(as one process computes them), not each rank's share.")
    grad_accum: int = _doc(1, "Micro-steps per optimizer step on each rank (gradient accumulation); divides --batch-size.")
    pp_split: str | None = _doc(None, "Pipeline parallelism: top-level children the stages start at, joined by commas "
                                      "(e.g. layer3: stage 0 runs up to layer3, stage 1 from it); one rank a stage.")
    pp_schedule: str = _doc("1F1B", "Pipeline schedule (torch.distributed.pipelining): GPipe or 1F1B.")
    microbatches: int = _doc(4, "Pipeline micro-batches per step.")
    tp: int = _doc(1, "Tensor parallel degree (with --tp-plan).")
    tp_plan: str | None = _doc(None, "Tensor parallelism: a JSON file of module name -> colwise / rowwise (nn.Linear "
                                     "modules), applied with parallelize_module over --tp ranks.")
    timeout_s: float = _doc(600.0, "Collective timeout in seconds.", flag="--timeout")
    model_from: str = _doc("last", "Which weights RUN_DIR/model holds: last (the final step's) or best (the step "
                                   "with the best held-out val_accuracy, else val_loss: checkpoints/best, always kept).")
    dp_mode: str = _doc("ddp", "Data parallelism: ddp (--nproc N processes: DDP / ZeRO / FSDP) or dataparallel "
                               "(nn.DataParallel in one process over every visible GPU; needs 2 or more).")

    KIND: ClassVar[str] = "module"
    RESUMABLE: ClassVar[tuple[str, ...]] = MODULE_RESUMABLE

    def inputs(self) -> list[tuple[str, str | None]]:
        return [("--data", self.data)]

    def zero_stage(self) -> int:
        """The ZeRO stage run: ``zero``, else 0. FSDP2 shards the whole module as one unit, so every step gathers
        all its parameters in forward and in backward and scatters its gradients (DTensors through the optimizer
        too); DDP's bucketed all-reduce overlaps backward. Sharding pays when the optimizer states do not fit."""
        return 0 if self.zero is None else self.zero

    def validate(self) -> None:
        from prunus.models.module_factory import check_args, parse_spec
        from prunus.models.tasks import check_task_name

        check_dataclass(self, "training settings")
        if self.model is not None:
            parse_spec(self.model, "--model")
        check_args(self.model_args, "--model-args")
        check_task_name(self.task)
        for name in ("steps", "batch_size", "eval_every", "eval_samples", "log_every", "keep_checkpoints", "nproc"):
            if getattr(self, name) < 1:
                raise PrunusError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise PrunusError(f"--stop-at {self.stop_at} must be between 1 and --steps {self.steps}")
        if self.warmup_steps < 0 or self.ckpt_every < 0:
            raise PrunusError("--warmup-steps and --ckpt-every must not be negative")
        if not 0 <= self.seed < 2**63:
            raise PrunusError(f"--seed {short(self.seed)} must be an integer from 0 to 2**63 - 1")
        if not self.lr > 0 or self.min_lr < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise PrunusError(f"--lr {self.lr} must be positive and --min-lr {self.min_lr}, --weight-decay "
                              f"{self.weight_decay}, --grad-clip {self.grad_clip} not negative")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise PrunusError(f"beta1 {self.beta1} and beta2 {self.beta2} must be in [0, 1)")
        if not 0 < self.val_fraction < 1:
            raise PrunusError(f"--val-fraction {self.val_fraction} must be between 0 and 1")
        if self.zero not in (None, 0, 1, 2, 3):
            raise PrunusError(f"--zero {self.zero}: choose 0 (DDP), 1 (sharded optimizer), 2 or 3 (FSDP)")
        if self.model_from not in ("last", "best"):
            raise PrunusError(f"--model-from {short(self.model_from)}: choose last or best")
        self._validate_layout()
        self._validate_dp_mode()
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise PrunusError(f"--timeout {self.timeout_s:g} must be above 0 and at most {MAX_TIMEOUT_S:,} seconds")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise PrunusError(f"--device {short(self.device)}: choose auto, cpu or cuda")

    @property
    def pp(self) -> int:
        """Pipeline stages: one more than the split points."""
        from prunus.train_parallel.pipeline.module_split import parse_split

        return len(parse_split(self.pp_split)) + 1 if self.pp_split is not None else 1

    def _validate_layout(self) -> None:
        if not 0 <= self.data_workers <= 64 or not 1 <= self.shuffle_buffer <= 1_000_000:
            raise PrunusError(f"--data-workers {self.data_workers} must be 0 to 64 and --shuffle-buffer "
                              f"{self.shuffle_buffer} 1 to 1,000,000")
        for name in ("grad_accum", "microbatches", "tp"):
            if getattr(self, name) < 1:
                raise PrunusError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.batch_size % self.grad_accum:
            raise PrunusError(f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}")
        if self.tp > 1 and self.tp_plan is None:
            raise PrunusError(f"--tp {self.tp} needs --tp-plan FILE.json: which nn.Linear modules are colwise and "
                              "which rowwise (a generic module has no built-in plan)")
        if self.tp_plan is not None and self.tp == 1:
            raise PrunusError("--tp-plan needs --tp N (N ranks share each planned Linear)")
        if self.pp > 1:
            from prunus.train_parallel.pipeline.module_pipeline import check_module_schedule

            check_module_schedule(self.pp_schedule, self.pp, self.microbatches, self.batch_size)
            if self.grad_accum > 1:
                raise PrunusError("--grad-accum with --pp-split: the pipeline's --microbatches already split the batch")
        if self.pp > 1 and self.tp > 1:
            raise PrunusError("--pp-split with --tp-plan: a generic module takes one of them at a time; drop one")
        if (self.pp > 1 or self.tp > 1) and (self.zero not in (None, 0) or self.sync_batchnorm):
            flag = "--sync-batchnorm" if self.sync_batchnorm else f"--zero {self.zero}"
            raise PrunusError(f"{flag} applies to data parallelism; a generic module's pipeline or tensor parallel "
                              "layout uses every rank without it: drop it")
        if (self.pp > 1 or self.tp > 1) and self.nproc not in (1, self.pp * self.tp):
            kind = "pipeline" if self.pp > 1 else "tensor parallel"
            raise PrunusError(f"--nproc {self.nproc}: a generic module's {kind} layout uses every rank (no data "
                              f"parallelism beside it); set --nproc {self.pp * self.tp}")

    def _validate_dp_mode(self) -> None:
        if self.dp_mode not in ("ddp", "dataparallel"):
            raise PrunusError(f"--dp-mode {short(self.dp_mode)}: a generic module trains with ddp (--nproc N) or "
                              "dataparallel (one process over every visible GPU)")
        if self.dp_mode == "ddp":
            return
        clash = [flag for flag, on in (("--nproc", self.nproc > 1), ("--pp-split", self.pp > 1), ("--tp", self.tp > 1),
                                       ("--zero", self.zero not in (None, 0)), ("--sync-batchnorm", self.sync_batchnorm),
                                       ("--device cpu", self.device == "cpu")) if on]
        if clash:
            raise PrunusError(f"--dp-mode dataparallel runs one process replicating the whole module over the GPUs: "
                              f"drop {clash[0]} (or use --nproc N for DDP)")
        from .data_parallel.data_parallel_single import cuda_devices

        n = cuda_devices()
        if n < 2:
            raise PrunusError(f"--dp-mode dataparallel needs 2 or more CUDA devices; this machine has {n}: use "
                              "--nproc N for DDP (one process per device), or drop --dp-mode for one process")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "training config") -> "ModuleTrainConfig":
        return dataclass_from_dict(cls, d, source, what="setting", fix="see prunus train --help")
