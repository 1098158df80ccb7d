"""The training run's settings as one value; saved as ``run.json`` in the run dir."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from prunus.models.config import ModelConfig, get_preset
from prunus.models.errors import PrunusError
from prunus.models.validate import check_dataclass, short

MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective that waits a week is a hang

# Settings that may change when a run is resumed; every other one defines the run.
# The layout may change on resume too: checkpoints reload under any layout.
RESUMABLE = ("steps", "stop_at", "eval_every", "eval_tokens", "ckpt_every", "keep_checkpoints", "async_checkpoint", "log_every", "progress",
             "nproc", "dp_replicate", "dp_shard", "tp", "pp", "ep", "cp", "cp_impl", "pp_schedule", "microbatches", "zero",
             "activation_checkpointing", "cpu_offload", "timeout_s", "grad_accum", "device", "peak_tflops")


@dataclass
class TrainConfig:
    out: str = "runs/default"
    preset: str = "small"
    model: dict = field(default_factory=dict)  # overrides of the preset's fields
    data: str | None = None  # None: the built-in corpus
    tokenizer: str | None = None  # a directory holding tokenizer.json; None: bytes
    max_corpus_bytes: int = 16 << 20
    seq_len: int | None = None  # None: the model's max_seq_len
    batch_size: int = 16  # sequences per optimizer step (the global batch), split over data-parallel ranks
    grad_accum: int = 1  # micro-steps per optimizer step on each rank
    steps: int = 1000
    stop_at: int | None = None  # end this invocation after this step (checkpointed); resume later
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    bf16: bool = False
    eval_every: int = 100
    eval_tokens: int = 65536
    ckpt_every: int = 200
    keep_checkpoints: int = 2
    async_checkpoint: bool = False  # write checkpoints from a background thread (dcp.async_save)
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    # parallel layout (see ParallelDims); world size = nproc under --nproc, else torchrun's / Slurm's
    nproc: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks the other dims leave
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: every sequence split over this many ranks (they share the batch)
    cp_impl: str = "ring"  # ring attention (point-to-point, load-balanced) or ulysses (all-to-all over heads)
    ep: int = 1  # expert parallel: ranks the experts of each MoE layer are split over (borrowed from dp_shard)
    pp_schedule: str = "1F1B"
    microbatches: int = 4
    zero: int | None = None  # None: 3 when sharding over dp_shard x cp > 1, else 0
    activation_checkpointing: str = "none"
    cpu_offload: bool = False
    timeout_s: float = 600.0  # collective timeout: a hang ends with an error naming the rank
    peak_tflops: float | None = None  # per rank, for MFU; known for common GPUs

    def model_config(self) -> ModelConfig:
        base = get_preset(self.preset)
        if not self.model:
            return base
        unknown = sorted(set(self.model) - {f.name for f in dataclasses.fields(ModelConfig)})
        if unknown:
            raise PrunusError(f"model settings: unknown field(s) {', '.join(str(k)[:60] for k in unknown[:5])}; "
                              "see prunus info of a model dir for the known ones")
        return base.replace(**self.model)

    def resolved_seq_len(self) -> int:
        limit = self.model_config().max_seq_len
        seq_len = self.seq_len or limit
        if seq_len > limit:
            raise PrunusError(f"--seq-len {seq_len} is above the model's max_seq_len {limit}; lower it or choose a model with a longer context")
        return seq_len

    def validate(self) -> None:
        check_dataclass(self, "training settings")  # every field against its type: a new one too
        self._validate_values()
        self.model_config()
        self.resolved_seq_len()
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "log_every", "eval_tokens", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise PrunusError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.seq_len is not None and self.seq_len < 1:
            raise PrunusError(f"--seq-len {self.seq_len} must be at least 1")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise PrunusError(f"--stop-at {self.stop_at} must be between 1 and --steps {self.steps}")
        if self.warmup_steps < 0 or self.ckpt_every < 0:
            raise PrunusError("--warmup-steps and --ckpt-every must not be negative")
        if self.zero not in (None, 0, 1, 2, 3):
            raise PrunusError(f"--zero {self.zero}: choose 0 (DDP), 1 (sharded optimizer), 2 or 3 (FSDP)")
        if self.cp_impl not in ("ring", "ulysses"):
            raise PrunusError(f"--cp-impl {self.cp_impl}: choose ring or ulysses")
        if self.activation_checkpointing not in ("none", "selective", "full"):
            raise PrunusError(f"--activation-checkpointing {self.activation_checkpointing}: choose none, selective or full")
        if self.batch_size % self.grad_accum:
            raise PrunusError(f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}")

    def _validate_values(self) -> None:
        """Ranges of the numbers that have one (types are checked by check_dataclass)."""
        if not 0 <= self.seed < 2**64:
            raise PrunusError(f"--seed {short(self.seed)} must be an integer from 0 to 2**64 - 1")
        if self.max_corpus_bytes < 1:
            raise PrunusError(f"--max-corpus-bytes {self.max_corpus_bytes} must be at least 1")
        if not self.lr > 0 or self.min_lr < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise PrunusError(f"--lr {self.lr} must be positive and --min-lr {self.min_lr}, --weight-decay "
                              f"{self.weight_decay}, --grad-clip {self.grad_clip} not negative")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise PrunusError(f"beta1 {self.beta1} and beta2 {self.beta2} must be in [0, 1)")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise PrunusError(f"--timeout {self.timeout_s:g} must be above 0 and at most {MAX_TIMEOUT_S:,} seconds")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise PrunusError(f"--peak-tflops {self.peak_tflops} must be positive")
        for name in ("nproc", "microbatches"):
            if getattr(self, name) < 1:
                raise PrunusError(f"--{name} {getattr(self, name)} must be at least 1")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.resolved_seq_len()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "training config") -> "TrainConfig":
        """Settings read from a file (run.json): unknown names and wrong types are one line naming ``source``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PrunusError(f"{source}: unknown setting(s) {', '.join(str(k)[:60] for k in unknown[:5])}")
        cfg = cls(**d)
        check_dataclass(cfg, source)
        return cfg
