"""``prunus train --model package.module:callable``: train any ``nn.Module``.

The options the generic run shares with the transformer's (``--out``, ``--steps``, ``--batch-size``, ``--lr``,
``--nproc``, ``--zero``, ...) are ``prunus train``'s own; the generic run's own settings are one option per
field of :class:`~prunus.train_parallel.module_config.ModuleTrainConfig` that TrainConfig lacks, plus
``--model`` and ``--model-args`` (read by a literal parser, never evaluated). The spec and arguments are
checked before torch is imported; the current directory is importable, as under ``python -m``.
"""

from __future__ import annotations

import dataclasses

import click

from prunus.artifacts.errors import PrunusError
from prunus.train_parallel.config import TrainConfig
from prunus.train_parallel.module_config import ModuleTrainConfig

from .config_options import config_options

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


def module_config(given: dict, options: dict) -> ModuleTrainConfig:
    """The run's settings: ModuleTrainConfig's defaults < the flags given; transformer-only flags refused."""
    from prunus.models.module_factory import parse_model_args, parse_spec

    _refuse_transformer_flags(given)
    spec = options["module_spec"]
    parse_spec(spec, "--model")
    settings = {k: v for k, v in given.items() if k in _MODULE_FIELDS}
    cfg = ModuleTrainConfig(**{**settings, "model": spec, "model_args": parse_model_args(options["model_args_text"])})
    if cfg.data is None:
        raise PrunusError("--model needs --data: an ImageFolder directory, or e.g. "
                          "synthetic:classification?n=256&shape=3x32x32&classes=10")
    cfg.validate()
    return cfg


def resume_module_config(given: dict, options: dict) -> ModuleTrainConfig:
    """A resumed run's settings: those its run.json records < the flags given; a flag that changes a setting
    the run is defined by (not in MODULE_RESUMABLE) is one line naming it."""
    from prunus.models.module_factory import parse_model_args
    from prunus.train_parallel.run_dir import check_same_run, read_run_config, resume_config

    _refuse_transformer_flags(given)
    overrides = {k: v for k, v in given.items() if k in _MODULE_FIELDS}
    if "module_spec" in given:
        overrides["model"] = given["module_spec"]
    if "model_args_text" in given:
        overrides["model_args"] = parse_model_args(given["model_args_text"])
    cfg = resume_config(options["out"], ModuleTrainConfig, **overrides)
    check_same_run(cfg, read_run_config(options["out"]), options["out"])  # before the dry run too
    cfg.validate()
    return cfg


def print_module_plan(plan: dict) -> None:
    """The dry run's per-rank bytes and launch command, as a table."""
    from rich.console import Console
    from rich.table import Table

    columns = ("params", "gathered", "grads", "ddp_buckets", "optimizer", "buffers", "total_peak")
    table = Table(title=f"dry run: {plan['layout']}, {plan['world_size']} rank(s), {plan['params_total']:,} parameters "
                        f"({plan['param_bytes_total']:,} bytes); bytes per rank, activations not counted",
                  title_justify="left")
    for name in ("rank", *columns):
        table.add_column(name, justify="right")
    for row in plan["ranks"]:
        table.add_row(str(row["rank"]), *(f"{row[c]:,}" for c in columns))
    console = Console()
    console.print(table)
    console.print(f"would run: {plan['command']}", soft_wrap=True)


def module_run_config(given: dict, options: dict, *, resume: bool, refused: dict) -> ModuleTrainConfig:
    """A generic module's settings from the flags (``refused``: the transformer-only actions asked for)."""
    for flag, asked in refused.items():
        if asked:
            raise PrunusError(f"{flag} plans a transformer run; drop it with --model")
    return resume_module_config(given, options) if resume else module_config(given, options)


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
