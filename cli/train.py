"""prunus train: train a model from a preset, in one process or many."""

from __future__ import annotations

import dataclasses
import os

import click
from click.core import ParameterSource

from prunus.train_parallel import TrainConfig, resume_config, train
from prunus.train_parallel.config_file import read_config_file, to_toml

D = TrainConfig()
# model flags: overrides of the preset's fields (TrainConfig.model), by option name
MODEL_FLAGS = {"n_experts": "n_experts", "top_k": "top_k", "capacity_factor": "capacity_factor",
               "moe_aux_coef": "moe_aux_loss_coef", "n_shared_experts": "n_shared_experts", "moe_ffn_dim": "moe_ffn_dim"}
SCHEDULES = "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"


def command_line(ctx: click.Context, given: dict, config_file, resume: bool, overwrite: bool) -> list[str]:
    """The flags this command was given, as arguments for the same command elsewhere (torchrun, srun)."""
    args = ["--config", config_file] if config_file else []
    for param in ctx.command.params:
        if param.name not in given or param.name in ("nproc", "dry_run", "world_size", "plan_rank"):
            continue
        value = given[param.name]
        if param.is_flag and param.secondary_opts:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            args += [param.opts[0]] if value else []
        else:
            args += [param.opts[0], str(value)]
    return args + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])


@click.command("train")
@click.option("--config", "config_file", type=click.Path(), default=None, help="TOML file of settings; flags override it.")
@click.option("--print-config", is_flag=True, help="Print the resolved settings as TOML and exit.")
@click.option("--out", "out", default=D.out, show_default=True, help="Run dir (checkpoints, metrics, model/).")
@click.option("--preset", default=D.preset, show_default=True, help="Model preset: tiny, small, base, llama-1b, llama-8b.")
@click.option("--data", default=None, help="Text file, dir of text files, or .bin tokens. Default: the built-in corpus.")
@click.option("--tokenizer", default=None, help="Dir holding a Hugging Face tokenizer.json. Default: bytes.")
@click.option("--max-corpus-bytes", type=int, default=D.max_corpus_bytes, show_default=True)
@click.option("--seq-len", type=int, default=None, help="Default: the model's max_seq_len.")
@click.option("--batch-size", type=int, default=D.batch_size, show_default=True,
              help="Sequences per optimizer step (global), split over data-parallel ranks and --grad-accum.")
@click.option("--grad-accum", type=int, default=D.grad_accum, show_default=True)
@click.option("--steps", type=int, default=D.steps, show_default=True)
@click.option("--stop-at", type=int, default=None, help="End this invocation after this step (checkpointed); continue with --resume.")
@click.option("--lr", type=float, default=D.lr, show_default=True)
@click.option("--min-lr", type=float, default=D.min_lr, show_default=True)
@click.option("--warmup-steps", type=int, default=D.warmup_steps, show_default=True)
@click.option("--weight-decay", type=float, default=D.weight_decay, show_default=True)
@click.option("--grad-clip", type=float, default=D.grad_clip, show_default=True, help="0 disables clipping.")
@click.option("--bf16/--no-bf16", default=D.bf16, show_default=True, help="bf16 autocast (FSDP: bf16 params, fp32 reductions).")
@click.option("--eval-every", type=int, default=D.eval_every, show_default=True)
@click.option("--eval-tokens", type=int, default=D.eval_tokens, show_default=True)
@click.option("--ckpt-every", type=int, default=D.ckpt_every, show_default=True, help="0: only when stopping early.")
@click.option("--keep-checkpoints", type=int, default=D.keep_checkpoints, show_default=True)
@click.option("--async-checkpoint/--sync-checkpoint", default=D.async_checkpoint, show_default=True,
              help="Write checkpoints in the background while training goes on (torch.distributed.checkpoint.async_save).")
@click.option("--log-every", type=int, default=D.log_every, show_default=True)
@click.option("--seed", type=int, default=D.seed, show_default=True)
@click.option("--device", default=D.device, show_default=True, help="auto, cpu or cuda.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--nproc", type=int, default=D.nproc, show_default=True, help="Processes on this host (starts torchrun).")
@click.option("--dp-replicate", type=int, default=D.dp_replicate, show_default=True)
@click.option("--dp-shard", type=int, default=D.dp_shard, show_default=True, help="-1: the ranks the other dims leave.")
@click.option("--tp", type=int, default=D.tp, show_default=True, help="Tensor (+ sequence) parallel degree.")
@click.option("--pp", type=int, default=D.pp, show_default=True, help="Pipeline stages (ranks).")
@click.option("--cp", type=int, default=D.cp, show_default=True,
              help="Context parallel degree: every sequence split over this many ranks (--seq-len a multiple of 2 x cp).")
@click.option("--cp-impl", default=D.cp_impl, show_default=True,
              help="ring: key/value blocks passed round the ranks; ulysses: all-to-all over heads (heads divisible by cp).")
@click.option("--ep", type=int, default=D.ep, show_default=True,
              help="Expert parallel degree: MoE experts split over this many of the --dp-shard ranks.")
@click.option("--n-experts", type=int, default=None, help="Mixture of experts: routed experts per block (0: dense).")
@click.option("--top-k", type=int, default=None, help="MoE: experts per token (default 2).")
@click.option("--capacity-factor", type=float, default=None,
              help="MoE: tokens per expert and sequence = ceil(factor * seq * top_k / experts); extra ones are dropped. Default: none dropped.")
@click.option("--moe-aux-coef", type=float, default=None, help="MoE: load-balancing loss coefficient (default 0.01).")
@click.option("--n-shared-experts", type=int, default=None, help="MoE: experts every token goes through (default 0).")
@click.option("--moe-ffn-dim", type=int, default=None, help="MoE: hidden size of each expert (default: the preset's ffn_dim).")
@click.option("--pp-schedule", default=D.pp_schedule, show_default=True, help=SCHEDULES)
@click.option("--microbatches", type=int, default=D.microbatches, show_default=True, help="Pipeline micro-batches per step.")
@click.option("--zero", type=click.IntRange(0, 3), default=None, help="0 DDP, 1 sharded optimizer, 2/3 FSDP. Default: 3 when --dp-shard x --cp > 1, else 0.")
@click.option("--activation-checkpointing", default=D.activation_checkpointing, show_default=True, help="none, selective or full.")
@click.option("--cpu-offload", is_flag=True, help="FSDP CPU offload of parameters and optimizer states (GPU only).")
@click.option("--timeout", "timeout_s", type=float, default=D.timeout_s, show_default=True, help="Collective timeout, seconds.")
@click.option("--peak-tflops", type=float, default=None, help="Peak TFLOP/s per rank for MFU (known for common GPUs).")
@click.option("--dry-run", is_flag=True, help="Plan per-rank memory of this layout on a fake process group; allocate nothing.")
@click.option("--world-size", type=int, default=None, help="With --dry-run: ranks to plan for (default --nproc).")
@click.option("--rank", "plan_rank", type=int, default=0, show_default=True, help="With --dry-run: the rank to plan.")
@click.option("--print-slurm", is_flag=True, help="Print an sbatch script running this command on --nodes x --gpus-per-node.")
@click.option("--nodes", type=int, default=1, show_default=True, help="With --print-slurm.")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="With --print-slurm.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint (under any layout).")
@click.option("--overwrite", is_flag=True, help="Replace whatever --out holds.")
@click.pass_context
def command(ctx: click.Context, config_file: str | None, print_config: bool, dry_run: bool, world_size: int | None,
            plan_rank: int, print_slurm: bool, nodes: int, gpus_per_node: int, resume: bool, overwrite: bool, **options):
    """Train a model; the final model dir is OUT/model."""
    given = {k: v for k, v in options.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    model_flags = {MODEL_FLAGS[k]: v for k, v in given.items() if k in MODEL_FLAGS}
    options = {k: v for k, v in options.items() if k not in MODEL_FLAGS}
    settings = {k: v for k, v in given.items() if k not in MODEL_FLAGS}
    if resume:
        cfg = resume_config(options["out"], **settings)
    else:
        base = read_config_file(config_file) if config_file else {}
        cfg = TrainConfig(**{**options, **base, **settings})
    if model_flags:
        cfg = dataclasses.replace(cfg, model={**cfg.model, **model_flags})
    if print_config:
        click.echo(to_toml(cfg), nl=False)
        return
    if dry_run:
        from rich.console import Console

        from prunus.train_parallel.dry_run import memory_plan, render_plan

        Console().print(render_plan(memory_plan(cfg, world_size or cfg.nproc, rank=plan_rank)))
        return
    if print_slurm:
        from prunus.train_parallel.launch import sbatch_script

        click.echo(sbatch_script(nodes, gpus_per_node, command_line(ctx, given, config_file, resume, overwrite)), nl=False)
        return
    launched = "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ
    if cfg.nproc > 1 and not launched:
        from prunus.train_parallel.trainer import preflight
        from prunus.train_parallel.launch import launch_local

        preflight(cfg, resume=resume, overwrite=overwrite)  # bad input: one line here, before any process starts
        ctx.exit(launch_local(cfg.nproc, ["train", *command_line(ctx, given, config_file, resume, overwrite)]))
    result = train(cfg, resume=resume, overwrite=overwrite)
    if result.model_dir is not None:
        click.echo(f"run dir:   {result.run_dir}\nmodel dir: {result.model_dir}\nloss plot: {result.run_dir / 'loss.png'}")
