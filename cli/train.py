"""prunus train: train a model from a preset, in one process or many.

The options are made from :class:`~prunus.train_parallel.config.TrainConfig`'s fields: name, type
(from the annotation), default and help text (the field's ``metadata["help"]``). A new setting is
one field there; only the options that are not settings (launching, planning, MoE model flags)
are written here.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import click
from click.core import ParameterSource

from prunus.train_parallel.config import TrainConfig

from .command_line import command_line
from .config_options import config_options
from .train_module import best_line

# model flags: overrides of the preset's fields (TrainConfig.model): option -> (ModelConfig field, type, help)
MODEL_OPTIONS = {
    "--n-experts": ("n_experts", int, "Mixture of experts: routed experts per block (0: dense)."),
    "--moe-top-k": ("top_k", int, "MoE: experts per token (default 2)."),
    "--capacity-factor": ("capacity_factor", float, "MoE: tokens per expert and sequence = ceil(factor * seq * "
                          "top_k / experts); extra ones are dropped. Default: none dropped."),
    "--moe-aux-coef": ("moe_aux_loss_coef", float, "MoE: load-balancing loss coefficient (default 0.01)."),
    "--n-shared-experts": ("n_shared_experts", int, "MoE: experts every token goes through (default 0)."),
    "--moe-ffn-dim": ("moe_ffn_dim", int, "MoE: hidden size of each expert (default: the preset's ffn_dim)."),
}
MODEL_PARAMS = {flag[2:].replace("-", "_"): spec[0] for flag, spec in MODEL_OPTIONS.items()}


def _renamed_top_k(ctx: click.Context, param: click.Parameter, value) -> None:
    if value is not None:
        raise click.UsageError("train's --top-k is now --moe-top-k (experts per token); --top-k is generate's "
                               "sampling option", ctx)


EXTRA_OPTIONS = [
    click.Option(["--config", "config_file"], type=click.Path(), default=None, help="TOML file of settings; flags override it."),
    click.Option(["--print-config"], is_flag=True, help="Print the resolved settings as TOML and exit."),
    *[click.Option([flag, flag[2:].replace("-", "_")], type=kind, default=None, help=text)
      for flag, (_, kind, text) in MODEL_OPTIONS.items()],
    click.Option(["--top-k", "old_top_k"], type=int, default=None, hidden=True, expose_value=False,
                 callback=_renamed_top_k),
    click.Option(["--dry-run"], is_flag=True, help="Plan per-rank memory of this layout on a fake process group; allocate nothing."),
    click.Option(["--world-size"], type=int, default=None, help="With --dry-run: ranks to plan for (default --nproc)."),
    click.Option(["--rank", "plan_rank"], type=int, default=0, show_default=True, help="With --dry-run: the rank to plan."),
    click.Option(["--print-slurm"], is_flag=True, help="Print an sbatch script running this command on --nodes x --gpus-per-node."),
    click.Option(["--nodes"], type=int, default=1, show_default=True, help="With --print-slurm: nodes of the job."),
    click.Option(["--gpus-per-node"], type=int, default=8, show_default=True, help="With --print-slurm: processes per node."),
    click.Option(["--nnodes"], default=None, metavar="MIN:MAX", help="Elastic training: run this host's torchrun agent "
                 "of a job on MIN to MAX hosts (--nproc processes each); a lost host restarts the job from its last "
                 "checkpoint on the hosts left."),
    click.Option(["--max-restarts"], type=int, default=3, show_default=True, help="With --nnodes: restarts of the job "
                 "before it fails."),
    click.Option(["--rdzv-endpoint"], default=None, metavar="HOST:PORT", help="With --nnodes: where the agents meet "
                 "(c10d rendezvous; with --print-slurm, default: the job's first node)."),
    click.Option(["--resume"], is_flag=True, help="Continue the run in --out from its last checkpoint (under any layout)."),
    click.Option(["--overwrite"], is_flag=True, help="Replace whatever --out holds."),
]


def resolve_config(given: dict, options: dict, config_file: str | None, resume: bool) -> TrainConfig:
    """The run's settings: defaults < the TOML file < flags given; on --resume the saved ones < flags given.

    A new run's settings are validated here, before torch and the checkpoint code are imported, so a mistake on
    the command line (an unknown preset, a bad layout) is one line within a second; a resumed run's are read
    from its run dir, which needs them."""
    model_flags = {MODEL_PARAMS[k]: v for k, v in given.items() if k in MODEL_PARAMS}
    options = {k: v for k, v in options.items() if k not in MODEL_PARAMS}
    settings = {k: v for k, v in given.items() if k not in MODEL_PARAMS}
    if resume:
        from prunus.train_parallel.run_dir import resume_config

        cfg = resume_config(options["out"], **settings)
    else:
        from prunus.train_parallel.config_file import read_config_file

        base = read_config_file(config_file) if config_file else {}
        cfg = TrainConfig(**{**options, **base, **settings})
    if model_flags:
        cfg = dataclasses.replace(cfg, model={**cfg.model, **model_flags})
    if not resume:
        cfg.validate()
    return cfg


def train_command(ctx: click.Context, config_file: str | None, print_config: bool, dry_run: bool, world_size: int | None,
                  plan_rank: int, print_slurm: bool, nodes: int, gpus_per_node: int, nnodes: str | None,
                  max_restarts: int, rdzv_endpoint: str | None, resume: bool, overwrite: bool, **options):
    """Train a model (the transformer, or with --model any torch.nn.Module); the final model dir is OUT/model."""
    from .train_module import is_module_resume, module_run_config, transformer_options

    given = {k: v for k, v in options.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if options.get("module_spec") is not None or is_module_resume(options, resume):  # any nn.Module (a factory's)
        refused = {"--config": config_file, "--print-config": print_config, "--print-slurm": print_slurm,
                   "--world-size": world_size is not None, "--rank": plan_rank != 0, "--nnodes": nnodes}
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())  # the factory's module may sit in the current directory (installed first)
        cfg = module_run_config(given, options, resume=resume, refused=refused)
        argv = command_line(ctx, given, None, resume, overwrite)
        if dry_run:
            from prunus.train_parallel.launch.module_dry_run import module_memory_plan

            from .train_module import print_module_plan

            return print_module_plan(module_memory_plan(cfg, argv))
    else:
        options = transformer_options(given, options)
        given = {k: v for k, v in given.items() if k in options}
        cfg = resolve_config(given, options, config_file, resume)
        argv = command_line(ctx, given, config_file, resume, overwrite)
        if _plan_only(cfg, argv, print_config=print_config, dry_run=dry_run, world_size=world_size, plan_rank=plan_rank,
                      print_slurm=print_slurm, nodes=nodes, gpus_per_node=gpus_per_node,
                      elastic=(nnodes, max_restarts, rdzv_endpoint)):
            return
    _run(ctx, cfg, argv, resume=resume, overwrite=overwrite, elastic=(nnodes, max_restarts, rdzv_endpoint))


def _plan_only(cfg, argv: list[str], *, print_config: bool, dry_run: bool, world_size: int | None, plan_rank: int,
               print_slurm: bool, nodes: int, gpus_per_node: int, elastic: tuple) -> bool:
    """The transformer's planning actions (--print-config, --dry-run, --print-slurm): done when one was asked."""
    nnodes, max_restarts, rdzv_endpoint = elastic
    if print_config:
        from prunus.train_parallel.config_file import to_toml

        click.echo(to_toml(cfg), nl=False)
    elif dry_run:
        from rich.console import Console

        from prunus.train_parallel.launch.dry_run import memory_plan
        from prunus.train_parallel.launch.dry_run_table import render_plan

        if nnodes:  # an elastic job: its layout must fit every world it may get
            from prunus.train_parallel.launch.elastic import check_elastic

            hosts = check_elastic(cfg, nnodes, max_restarts, rdzv_endpoint, need_endpoint=False)[1]
            world_size = world_size or hosts * cfg.nproc
        Console().print(render_plan(memory_plan(cfg, world_size or cfg.nproc, rank=plan_rank)))
    elif print_slurm:
        from prunus.train_parallel.launch.slurm import sbatch_script

        click.echo(sbatch_script(cfg, nodes, gpus_per_node, argv, elastic=elastic if nnodes else None), nl=False)
    return print_config or dry_run or print_slurm


def _run(ctx: click.Context, cfg, argv: list[str], *, resume: bool, overwrite: bool, elastic: tuple) -> None:
    """Run ``cfg``'s kind (its spec's train entry) here, or start its ranks: torchrun's agent over --nproc processes
    (the spec's preflight first: bad input is one line before any process starts) or an elastic job's."""
    from prunus.models.device import check_device
    from prunus.models.spec import get_spec

    check_device(cfg.device)  # one line for a device torch cannot use here (the plans above are for any machine)
    spec, launched = get_spec(cfg.KIND), "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ
    if elastic[0] and not launched:
        from prunus.train_parallel.launch.elastic import launch_elastic

        ctx.exit(launch_elastic(cfg, ["train", *argv], *elastic))
    if cfg.nproc > 1 and not launched:
        from prunus.train_parallel.launch.launch import launch_ranks

        spec.load("preflight")(cfg, resume=resume, overwrite=overwrite)
        ctx.exit(launch_ranks(cfg.nproc, ["train", *argv]))
    result = spec.load("train")(cfg, resume=resume, overwrite=overwrite)
    if result.model_dir is None and (int(os.environ.get("RANK", "0")) != 0 or spec.name == "transformer"):
        return  # another rank, or stopped early where the transformer's trainer said so
    stopped = f" (stopped at step {result.step}; continue with --resume)" if result.model_dir is None else ""
    plot = result.run_dir / "loss.png"
    click.echo("\n".join([f"run dir:   {result.run_dir}{stopped}",
                          *([f"model dir: {result.model_dir}"] if result.model_dir and not cfg.progress else []),
                          *([f"loss plot: {plot}"] if result.model_dir and plot.is_file() else []), *best_line(result)]))


def _module_options() -> list[click.Option]:
    from .train_module import module_options

    return module_options()


command = click.Command("train", callback=click.pass_context(train_command),
                        params=[*config_options(), *EXTRA_OPTIONS, *_module_options()], help=train_command.__doc__)
