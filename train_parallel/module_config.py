"""The settings of a generic module's training run (:mod:`.module_trainer`); saved in ``run.json``.

The settings every model kind shares are :class:`~.config.RunSettings`' (one definition, one set of ``prunus
train`` options); the module's own are its factory (``model``, ``model_args``), the task, the data split, its
layout (``pp_split``, ``tp_plan``, ``sync_batchnorm``) and which weights the model dir holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import check_dataclass, short

from .config import RunSettings, _doc

@dataclass
class ModuleTrainConfig(RunSettings):
    """A generic module's training run: the settings every kind shares (:class:`~.config.RunSettings`) and the
    module's own. ``prunus train --model`` makes one option of each field."""

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
    eval_samples: int = _doc(4096, "Held-out samples scored per evaluation (the first of the split).")
    sync_batchnorm: bool = _doc(False, "Data parallel: BatchNorm statistics over the global batch of every rank "
                                       "(as one process computes them), not each rank's share.")
    pp_split: str | None = _doc(None, "Pipeline parallelism: top-level children the stages start at, joined by commas "
                                      "(e.g. layer3: stage 0 runs up to layer3, stage 1 from it); one rank a stage.")
    tp: int = _doc(1, "Tensor parallel degree (with --tp-plan).")
    tp_plan: str | None = _doc(None, "Tensor parallelism: a JSON file of module name -> colwise / rowwise (nn.Linear "
                                     "modules), applied with parallelize_module over --tp ranks.")
    model_from: str = _doc("last", "Which weights RUN_DIR/model holds: last (the final step's) or best (the step "
                                   "with the best held-out val_accuracy, else val_loss: checkpoints/best, always kept).")

    KIND: ClassVar[str] = "module"
    RESUMABLE: ClassVar[tuple[str, ...]] = RunSettings.RESUMABLE + (
        "eval_samples", "pp_split", "tp_plan", "data_workers", "sync_batchnorm", "dp_mode", "model_from")
    SEED_BITS: ClassVar[int] = 63

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
        self.validate_run()
        if self.eval_samples < 1:
            raise PrunusError(f"--eval-samples {self.eval_samples} must be at least 1")
        if not 0 < self.val_fraction < 1:
            raise PrunusError(f"--val-fraction {self.val_fraction} must be between 0 and 1")
        if self.model_from not in ("last", "best"):
            raise PrunusError(f"--model-from {short(self.model_from)}: choose last or best")
        self._validate_layout()
        self._validate_dp_mode()
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise PrunusError(f"--device {short(self.device)}: choose auto, cpu or cuda")

    @property
    def pp(self) -> int:
        """Pipeline stages: one more than the split points."""
        from prunus.train_parallel.pipeline.split_pipeline import parse_split

        return len(parse_split(self.pp_split)) + 1 if self.pp_split is not None else 1

    def _validate_layout(self) -> None:
        if not 0 <= self.data_workers <= 64 or not 1 <= self.shuffle_buffer <= 1_000_000:
            raise PrunusError(f"--data-workers {self.data_workers} must be 0 to 64 and --shuffle-buffer "
                              f"{self.shuffle_buffer} 1 to 1,000,000")
        if self.tp > 1 and self.tp_plan is None:
            raise PrunusError(f"--tp {self.tp} needs --tp-plan FILE.json: which nn.Linear modules are colwise and "
                              "which rowwise (a generic module has no built-in plan)")
        if self.tp_plan is not None and self.tp == 1:
            raise PrunusError("--tp-plan needs --tp N (N ranks share each planned Linear)")
        if self.pp > 1:
            from prunus.train_parallel.pipeline.split_pipeline import check_module_schedule

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
