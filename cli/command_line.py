"""The flags a ``prunus train`` invocation was given, as arguments for the same command run elsewhere (torchrun,
srun, the ranks a local launch starts)."""

from __future__ import annotations

import click

# options that shape this invocation only; never passed on to the processes it starts
LOCAL_ONLY = ("nproc", "dry_run", "world_size", "plan_rank")


def command_line(ctx: click.Context, given: dict, config_file, resume: bool, overwrite: bool) -> list[str]:
    """The flags this command was given, as arguments for the same command elsewhere (torchrun, srun)."""
    args = ["--config", config_file] if config_file else []
    for param in ctx.command.params:
        if param.name not in given or param.name in LOCAL_ONLY:
            continue
        value = given[param.name]
        if param.is_flag and param.secondary_opts:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            args += [param.opts[0]] if value else []
        else:
            args += [param.opts[0], str(value)]
    return args + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])
