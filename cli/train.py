"""prunus train: train a model (the transformer from a preset, or with --model any nn.Module), in one process or many.

The options are made from the settings dataclasses' fields (:class:`~prunus.train_parallel.config.TrainConfig`,
and :class:`~prunus.train_parallel.module_config.ModuleTrainConfig`'s own): name, type (from the annotation),
default and help text (the field's ``metadata["help"]``). A new setting is one field there; only the options that
are not settings (launching, planning, MoE model flags, --model / --model-args) are written here. ``--model`` and
``--model-args`` are read by a literal parser, never evaluated, and checked before torch is imported; the current
directory is importable for the factory, as under ``python -m``. Every kind runs through its spec
(:mod:`prunus.models.spec`): its preflight, its train entry, its dry run.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import click
from click.core import ParameterSource

from prunus.artifacts.errors import PrunusError
from prunus.models.spec import get_spec
from prunus.train_parallel.config import TrainConfig
from prunus.train_parallel.module_config import ModuleTrainConfig

from .command_line import command_line
from .config_options import config_options

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


_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
_MODULE_FIELDS = {f.name for f in dataclasses.fields(ModuleTrainConfig)}



def module_options() -> list[click.Option]:
    """--model, --model-args and one option per ModuleTrainConfig field that TrainConfig has no option for."""
    own = [o for o in config_options(ModuleTrainConfig) if o.name not in _TRAIN_FIELDS]
    return [
        click.Option(["--model", "module_spec"], default=None, metavar="PACKAGE.MODULE:CALLABLE",
                     help="Train any torch.nn.Module this factory builds (with --data and --task), instead of the "
                          "transformer; --batch-size then counts samples."),
        click.Option(["--model-args", "model_args_text"], default=None, metavar="K=V,...",
                     help="With --model: the factory's keyword arguments, e.g. num_classes=10,width=32 (JSON values; "
                          "a bare word is a string)."),
        *own,
    ]


# the click parameters only a generic module's run takes
MODULE_ONLY = ("module_spec", "model_args_text", *sorted(_MODULE_FIELDS - _TRAIN_FIELDS - {"model", "model_args"}))


def transformer_options(given: dict, options: dict) -> dict:
    """The options of a transformer run: the generic module's own refused when given (one line), then dropped."""
    for name in MODULE_ONLY:
        if name in given and not (name == "task" and given[name] == "causal-lm"):
            flag = {"module_spec": "--model", "model_args_text": "--model-args"}.get(name, "--" + name.replace("_", "-"))
            raise PrunusError(f"{flag} applies to a generic module; add --model package.module:callable (without it, "
                              "prunus train trains the transformer)")
    return {k: v for k, v in options.items() if k not in MODULE_ONLY}


def is_module_resume(options: dict, resume: bool) -> bool:
    """Whether ``--resume`` continues a generic module's run in ``--out`` (its run.json says so)."""
    if not resume:
        return False
    from prunus.train_parallel.run_dir import run_kind

    return run_kind(options["out"]) == ModuleTrainConfig.KIND


def _refuse_transformer_flags(given: dict) -> None:
    extra = [k for k in given if k not in _MODULE_FIELDS and k not in MODULE_ONLY]
    if extra:
        flag = "--" + extra[0].replace("_", "-")
        raise PrunusError(f"{flag} applies to the transformer, not to a generic module (--model); drop it (a module "
                          "trains with --nproc, --zero, --sync-batchnorm, --grad-accum, --pp-split or --tp with --tp-plan)")


def module_run_config(given: dict, options: dict, *, resume: bool, refused: dict) -> ModuleTrainConfig:
    """A generic module's settings: ModuleTrainConfig's defaults (on --resume: those its run.json records) < the
    flags given. Transformer-only flags and planning actions (``refused``) are one line, and so is a flag that
    changes a setting the resumed run is defined by."""
    from prunus.models.module_factory import parse_model_args, parse_spec
    from prunus.train_parallel.run_dir import check_same_run, read_run_config, resume_config

    for flag, asked in refused.items():
        if asked:
            raise PrunusError(f"{flag} plans a transformer run; drop it with --model")
    _refuse_transformer_flags(given)
    settings = {k: v for k, v in given.items() if k in _MODULE_FIELDS}
    if not resume or "module_spec" in given:
        settings["model"] = options["module_spec"]
        parse_spec(settings["model"], "--model")
    if not resume or "model_args_text" in given:
        settings["model_args"] = parse_model_args(options["model_args_text"])
    if resume:
        cfg = resume_config(options["out"], ModuleTrainConfig, **settings)
        check_same_run(cfg, read_run_config(options["out"]), options["out"])  # before the dry run too
    else:
        cfg = ModuleTrainConfig(**settings)
    if cfg.data is None:
        raise PrunusError("--model needs --data: an ImageFolder directory, or e.g. "
                          "synthetic:classification?n=256&shape=3x32x32&classes=10")
    cfg.validate()
    return cfg


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
    given = {k: v for k, v in options.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if options.get("module_spec") is not None or is_module_resume(options, resume):  # any nn.Module (a factory's)
        refused = {"--config": config_file, "--print-config": print_config, "--print-slurm": print_slurm,
                   "--world-size": world_size is not None, "--rank": plan_rank != 0, "--nnodes": nnodes}
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())  # the factory's module may sit in the current directory (installed first)
        cfg = module_run_config(given, options, resume=resume, refused=refused)
        argv = command_line(ctx, given, None, resume, overwrite)
        if dry_run:
            from rich.console import Console

            from prunus.train_parallel.launch.dry_run_table import render_module_plan

            plan = get_spec(cfg.KIND).load("dry_run")(cfg, argv)
            Console().print(render_module_plan(plan))
            return Console().print(f"would run: {plan['command']}", soft_wrap=True)
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


def best_line(result) -> list[str]:
    """The run's last line: its best step, where its weights are kept, and which weights the model dir holds."""
    best = result.best
    if best is None:
        return []
    where = result.run_dir / "checkpoints" / "best"
    if result.model_dir is None:
        holds = "the model dir is written at the last step"
    elif result.model_from == "best":
        holds = "the model dir holds it"
    else:
        holds = "the model dir holds the last step's (--model-from best for this one)"
    return [f"best:      step {best['step']:,} ({best['metric']} {best['value']:.4f}) in {where}; {holds}"]


command = click.Command("train", callback=click.pass_context(train_command),
                        params=[*config_options(), *EXTRA_OPTIONS, *module_options()], help=train_command.__doc__)
