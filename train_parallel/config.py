"""The training run's settings as one value; saved as ``run.json`` in the run dir."""

from __future__ import annotations

import dataclasses
import sysconfig
from dataclasses import dataclass, field
from typing import ClassVar

from prunus.models.config import PRESETS, ModelConfig, get_preset
from prunus.artifacts.errors import PrunusError
from prunus.train_parallel.tensor_parallel.tp_nd.shape import TP_MODES, grid_shape
from prunus.artifacts.validate import check_dataclass, check_known_fields, dataclass_from_dict, short
from prunus.train_parallel.data_parallel.modes import DP_MODES, dp_mode

MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective that waits a week is a hang
SETTINGS_FIX = "see prunus train --print-config"  # what an unknown setting's error suggests
# torch.distributed.pipelining schedules prunus drives (pipeline_parallel.py builds them)
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _doc(default, help: str, **cli):
    """A TrainConfig field with its documentation. ``help`` is what the field means (``prunus train
    --help`` shows it); ``cli`` says how the option is spelled where it differs from the field name:
    ``flag`` ("--timeout"), ``off_flag`` for a boolean ("--sync-checkpoint"; default "--no-<name>"),
    ``choices`` (the library's constant, listed in the help), ``cli=False`` for no option."""
    kind = {"default_factory": default} if callable(default) else {"default": default}
    return field(**kind, metadata={"help": help, **cli})


@dataclass
class RunSettings:
    """The settings every model kind's run has, meaning and defaulting the same for each: the run dir, the
    schedule, the optimizer, evaluation and checkpoint cadence, the launch. A kind's settings (:class:`TrainConfig`,
    :class:`~.module_config.ModuleTrainConfig`, named by its spec in :mod:`prunus.models.spec`) add its model
    and data section; ``prunus train`` makes one option of each field."""

    SEED_BITS: ClassVar[int] = 64
    # settings that may change when a run is resumed (the layout among them: checkpoints reload under any layout);
    # every other one defines the run. A kind adds its own (tp: each kind's own field).
    RESUMABLE: ClassVar[tuple[str, ...]] = (
        "steps", "stop_at", "eval_every", "ckpt_every", "keep_checkpoints", "log_every", "progress", "nproc", "tp",
        "pp_schedule", "microbatches", "zero", "timeout_s", "grad_accum", "device")

    out: str = _doc("runs/default", "Run dir (checkpoints, metrics, model/).")
    batch_size: int = _doc(16, "Sequences (a generic module: samples) per optimizer step (the global batch), split over data-parallel ranks "
                               "and --grad-accum.")
    grad_accum: int = _doc(1, "Micro-steps per optimizer step on each rank (gradient accumulation); divides --batch-size.")
    steps: int = _doc(1000, "Optimizer steps in the run.")
    stop_at: int | None = _doc(None, "End this invocation after this step (checkpointed); continue with --resume.")
    lr: float = _doc(2e-3, "Peak learning rate (AdamW), reached after --warmup-steps, then cosine decay to --min-lr.")
    min_lr: float = _doc(2e-4, "Learning rate at the last step.")
    warmup_steps: int = _doc(100, "Steps of linear warmup from 0 to --lr (keep it below --steps).")
    weight_decay: float = _doc(0.1, "AdamW weight decay (not applied to norms and embeddings).")
    beta1: float = _doc(0.9, "AdamW beta1.")
    beta2: float = _doc(0.95, "AdamW beta2.")
    grad_clip: float = _doc(1.0, "Clip the gradients' global norm to this; 0 disables clipping.")
    eval_every: int = _doc(100, "Score the held-out split every this many steps (and at the end).")
    ckpt_every: int = _doc(200, "Checkpoint every this many steps; 0: only when stopping early.")
    keep_checkpoints: int = _doc(2, "Checkpoints kept in the run dir (the newest).")
    log_every: int = _doc(10, "Print and record the training loss every this many steps.")
    seed: int = _doc(0, "Random seed of the weights and the data order.")
    device: str = _doc("auto", "auto (cuda when available, else cpu), cpu or cuda.")
    progress: bool = _doc(True, "Show a progress line.")
    nproc: int = _doc(1, "Processes on this host (starts torchrun).")
    pp_schedule: str = _doc("1F1B", "Pipeline schedule (torch.distributed.pipelining).", choices=PP_SCHEDULES)
    microbatches: int = _doc(4, "Pipeline micro-batches per step.")
    zero: int | None = _doc(None, "0 DDP, 1 sharded optimizer, 2/3 FSDP. Default: 3 when --dp-shard x --cp > 1, else 0 "
                                        "(--model: 0).")
    dp_mode: str = _doc("ddp", "Data parallelism: ddp (torch.distributed: DDP / ZeRO / FSDP), ps (a parameter server: the "
                               "first --ps-servers ranks hold the parameters, the others train) or dataparallel "
                               "(nn.DataParallel in one process over every visible GPU).", choices=DP_MODES)
    timeout_s: float = _doc(600.0, "Collective timeout in seconds: a hang ends with an error naming the rank.",
                            flag="--timeout")

    @classmethod
    def flag(cls, name: str) -> str:
        """How messages name setting ``name``: its command-line flag (the field's ``flag``, else --NAME)."""
        meta = next((f.metadata for f in dataclasses.fields(cls) if f.name == name), {})
        return meta.get("flag", "--" + name.replace("_", "-"))

    def validate_run(self) -> None:
        """Ranges of the settings every kind shares (types are checked by check_dataclass)."""
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "log_every", "keep_checkpoints", "nproc",
                     "microbatches", "tp"):  # tp: each kind's own field (its place among the kind's options)
            if getattr(self, name) < 1:
                raise PrunusError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise PrunusError(f"--stop-at {self.stop_at} must be between 1 and --steps {self.steps}")
        if self.warmup_steps < 0 or self.ckpt_every < 0:
            raise PrunusError("--warmup-steps and --ckpt-every must not be negative")
        if not 0 <= self.seed < 2**self.SEED_BITS:
            raise PrunusError(f"--seed {short(self.seed)} must be an integer from 0 to 2**{self.SEED_BITS} - 1")
        if not self.lr > 0 or self.min_lr < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise PrunusError(f"--lr {self.lr} must be positive and --min-lr {self.min_lr}, --weight-decay "
                              f"{self.weight_decay}, --grad-clip {self.grad_clip} not negative")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise PrunusError(f"beta1 {self.beta1} and beta2 {self.beta2} must be in [0, 1)")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise PrunusError(f"--timeout {self.timeout_s:g} must be above 0 and at most {MAX_TIMEOUT_S:,} seconds")
        if self.zero not in (None, 0, 1, 2, 3):
            raise PrunusError(f"--zero {self.zero}: choose 0 (DDP), 1 (sharded optimizer), 2 or 3 (FSDP)")
        if self.batch_size % self.grad_accum:
            raise PrunusError(f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "training config"):
        """Settings read from a file (run.json): unknown names and wrong types are one line naming ``source``."""
        return dataclass_from_dict(cls, d, source, what="setting", fix=SETTINGS_FIX)  # prunus.artifacts.validate


@dataclass
class TrainConfig(RunSettings):
    """The settings of a training run. Each field's ``metadata["help"]`` documents it, and ``prunus
    train`` makes one option of each field (``prunus.cli.train``): a new setting is one line here."""

    preset: str | None = _doc(None, "Model preset. Default: small, or with --init-from the model dir's own architecture.",
                              choices=tuple(PRESETS))
    init_from: str | None = _doc(None, "Fine-tune: start from this prunus model dir's weights (its config.json defines "
                                       "the model; schedule, optimizer and steps start at 0).")
    model: dict = _doc(dict, "Overrides of the preset's fields (ModelConfig names).", cli=False, flag="model")
    data: str | None = _doc(None, "Text file, dir of text files, or .bin tokens; or instruction rows: .jsonl / .parquet "
                                  "with {text}, {prompt, completion} or {messages} (packed, loss on completions). "
                                  "Default: the built-in corpus.")
    train_on_prompt: bool = _doc(False, "Instruction data: train on prompt and user tokens too, not only on "
                                        "completions and assistant turns.")
    tokenizer: str | None = _doc(None, "Dir holding a Hugging Face tokenizer.json. Default: the --init-from dir's, "
                                       "else bytes.")
    max_corpus_bytes: int = _doc(16 << 20, "Read at most this many bytes of the corpus.")
    seq_len: int | None = _doc(None, "Tokens per training sequence. Default: the model's max_seq_len.")
    bf16: bool = _doc(False, "bf16 autocast (FSDP: bf16 params, fp32 reductions).")
    eval_tokens: int = _doc(65536, "Held-out tokens scored per evaluation.")
    async_checkpoint: bool = _doc(False, "Write checkpoints in the background while training goes on "
                                         "(torch.distributed.checkpoint.async_save).", off_flag="--sync-checkpoint")
    # parallel layout (see ParallelDims); world size = nproc under --nproc, else torchrun's / Slurm's
    dp_replicate: int = _doc(1, "Data-parallel replicas (DDP, or the replicate dimension of HSDP).")
    dp_shard: int = _doc(-1, "Data-parallel ranks that shard parameters (FSDP); -1: the ranks the other dims leave.")
    tp: int = _doc(1, "Tensor (+ sequence) parallel degree.")
    tp_mode: str = _doc("1d", "Tensor parallelism over --tp ranks: 1d (Megatron + sequence parallel), 2d (SUMMA, a q x q "
                              "grid: --tp a square), 2.5d (Tesseract, q x q x --tp-depth) or 3d (a q x q x q cube).",
                        choices=TP_MODES)
    tp_depth: int = _doc(1, "Depth of the 2.5d grid (--tp = q * q * depth).")
    pp: int = _doc(1, "Pipeline stages (ranks).")
    cp: int = _doc(1, "Context parallel degree: every sequence split over this many ranks, which share the batch "
                      "(--seq-len a multiple of 2 x cp).")
    cp_impl: str = _doc("ring", "ring: key/value blocks passed round the ranks (load-balanced); ulysses: all-to-all "
                                "over heads (heads divisible by cp).")
    ep: int = _doc(1, "Expert parallel degree: MoE experts split over this many of the --dp-shard ranks.")
    activation_checkpointing: str = _doc("none", "Recompute activations in the backward pass: none, every-other "
                                                 "(blocks) or full.")
    cpu_offload: bool = _doc(False, "FSDP only (--zero 2/3): parameter shards, their gradients and the optimizer "
                                    "live in host memory (torch's CPUOffloadPolicy), copied to the GPU block by block "
                                    "for compute; no effect under --zero 0/1 (use --offload). Needs a GPU.")
    offload: bool = _doc(False, "ZeRO-Offload, any --zero: under 0/1 the optimizer step, its states and fp32 master "
                                "weights run on the CPU while parameters and gradients stay on the GPU; under 2/3 "
                                "the same as --cpu-offload. Needs a GPU.")
    ps_servers: int = _doc(1, "Parameter-server ranks under --dp-mode ps (ranks 0..N-1; the others are workers).")
    ps_staleness: int | None = _doc(None, "--dp-mode ps: unset, synchronous (the workers' gradients averaged each step, "
                                          "as DDP); K: asynchronous, each push applied at once, a worker never more "
                                          "than K steps ahead of the slowest.")
    peak_tflops: float | None = _doc(None, "Peak TFLOP/s per rank for MFU. Default: known for common GPUs.")
    # LoRA (train_parallel/lora.py): adapters on the frozen base instead of full fine-tuning
    lora_rank: int = _doc(0, "LoRA: train rank-R adapters on the frozen base (merged into model/ at the end); "
                             "0: train every weight.")
    lora_alpha: float = _doc(16.0, "LoRA scale numerator: each adapter adds alpha / rank * B A to its module.")
    lora_dropout: float = _doc(0.0, "LoRA: dropout on the adapters' input, in [0, 1).")
    lora_targets: str = _doc("wq,wk,wv,wo,w1,w2,w3", "LoRA: the modules that get adapters (comma-separated prunus names).")
    save_adapter: bool = _doc(False, "LoRA: also write the adapter in PEFT's format (adapter_config.json, "
                                     "adapter_model.safetensors) at RUN_DIR/adapter.")

    KIND: ClassVar[str] = "transformer"  # the model kind's spec (prunus.models.spec); run.json records any other
    RESUMABLE: ClassVar[tuple[str, ...]] = RunSettings.RESUMABLE + (
        "eval_tokens", "async_checkpoint", "dp_replicate", "dp_shard", "tp_mode", "tp_depth", "pp", "ep", "cp", "cp_impl",
        "activation_checkpointing", "cpu_offload", "offload", "peak_tflops", "save_adapter")

    def inputs(self) -> list[tuple[str, str | None]]:
        """What a run reads, labelled by flag: the run dir must stay clear of all of them."""
        data = self.data if self.data not in (None, "builtin") else sysconfig.get_paths()["stdlib"]
        return [("--data", data), ("--tokenizer", self.tokenizer), ("--init-from", self.init_from)]

    def model_config(self) -> ModelConfig:
        if self.init_from is not None:  # the model dir defines the architecture; flags may only agree with it
            from prunus.train_parallel.checkpoint.init_from import check_architecture, init_model_config

            base = init_model_config(self.init_from)
            check_architecture(base, self.init_from, self.preset, self.model)
            return base
        base = get_preset(self.preset or "small")
        if not self.model:
            return base
        check_known_fields(self.model, ModelConfig, "model settings", fix="see prunus info of a model dir for the known ones")
        return base.replace(**self.model)

    def resolved_seq_len(self) -> int:
        limit = self.model_config().max_seq_len
        seq_len = self.seq_len or limit
        if seq_len > limit:
            raise PrunusError(f"--seq-len {seq_len} is above the model's max_seq_len {limit}; lower it or choose a model with a longer context")
        return seq_len

    def validate(self) -> None:
        check_dataclass(self, "training settings")  # every field against its type: a new one too
        self.validate_run()
        self._validate_values()
        self.model_config()
        self.resolved_seq_len()
        for name, value in (("eval-tokens", self.eval_tokens), ("seq-len", self.seq_len)):
            if value is not None and value < 1:
                raise PrunusError(f"--{name} {value} must be at least 1")
        grid_shape(self.tp_mode, self.tp, self.tp_depth)  # a square, a square times the depth, a cube
        if self.cp_impl not in ("ring", "ulysses"):
            raise PrunusError(f"--cp-impl {self.cp_impl}: choose ring or ulysses")
        if self.activation_checkpointing not in ("none", "every-other", "full", "selective"):  # selective: the old name
            raise PrunusError(f"--activation-checkpointing {self.activation_checkpointing}: choose none, every-other or full")
        dp_mode(self).check_config(self)  # an unknown mode, or settings the mode cannot run
        if self.ps_servers < 1 or (self.ps_staleness is not None and self.ps_staleness < 0):
            raise PrunusError(f"--ps-servers {self.ps_servers} must be at least 1 and --ps-staleness {self.ps_staleness} "
                              "not negative")

    def _validate_values(self) -> None:
        """Ranges of the transformer's own numbers (types are checked by check_dataclass)."""
        if self.max_corpus_bytes < 1:
            raise PrunusError(f"--max-corpus-bytes {self.max_corpus_bytes} must be at least 1")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise PrunusError(f"--peak-tflops {self.peak_tflops} must be positive")
        if self.lora_rank < 0 or (self.save_adapter and self.lora_rank < 1):
            raise PrunusError(f"--lora-rank {self.lora_rank} must be at least 1 for LoRA (0: full fine-tuning, "
                              "without --save-adapter)")
        if not 0 <= self.lora_dropout < 1 or not self.lora_alpha > 0:
            raise PrunusError(f"--lora-dropout {self.lora_dropout} must be in [0, 1) and --lora-alpha {self.lora_alpha} positive")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.resolved_seq_len()
