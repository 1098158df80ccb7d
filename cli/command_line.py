"""The flags a command was given, as arguments for the same command run elsewhere: ``prunus train`` under torchrun,
srun or the ranks a local launch starts; ``prunus serve`` in a Kubernetes pod."""

from __future__ import annotations

import click

# options that shape this invocation only; never passed on to the processes it starts
LOCAL_ONLY = ("nproc", "dry_run", "world_size", "plan_rank")


def command_line(ctx: click.Context, given: dict, config_file, resume: bool, overwrite: bool) -> list[str]:
    """The flags this command was given, as arguments for the same command elsewhere (torchrun, srun)."""
    args = ["--config", config_file] if config_file else []
    args += as_arguments(ctx, given, lambda name: name in LOCAL_ONLY)
    return args + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])


def as_arguments(ctx: click.Context, given: dict, skip) -> list[str]:
    """``given`` ({option name: value}) as command-line arguments in the command's option order, the options whose
    name ``skip(name)`` is true left out: a flag as its name (``--x`` / ``--no-x``), a repeated option once a value."""
    args = []
    for param in ctx.command.params:
        if param.name not in given or skip(param.name):
            continue
        value = given[param.name]
        if param.is_flag and param.secondary_opts:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            args += [param.opts[0]] if value else []
        else:
            args += [a for v in (value if getattr(param, "multiple", False) else [value]) for a in (param.opts[0], str(v))]
    return args
