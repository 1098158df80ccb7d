"""The ``prunus`` command. Each verb parses, calls the Python API and renders the result.

A user's mistake (PrunusError) prints one ``Error: ...`` line and exits 2, with
no traceback. Two checks hold for every verb, present and future: an argument that is
not UTF-8 is refused before anything runs, and a verb's ``--out`` never is, contains
or lies inside any path it reads (every path or text option or argument that names an
existing file or directory).

Verbs are loaded on first use (click's lazy subcommands) and import torch and the
pipeline stages inside their bodies, so ``prunus --help``, ``--version`` and a verb's
``--help`` start in a fraction of a second.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys

import click

import prunus
from prunus.artifacts.atomic import disk_error
from prunus.artifacts.errors import PrunusError

# verb -> the module whose ``command`` it is, in the order --help lists them
VERBS = {"train": "train", "eval": "eval", "generate": "generate", "convert": "convert", "info": "info",
         "compress": "compress", "export": "export", "serve": "serve"}


# library messages name the Python API's arguments; on the command line they are these flags
API_TO_FLAGS = {"resume=True": "--resume", "overwrite=True": "--overwrite", "another out dir": "another --out"}


class UserError(click.ClickException):
    exit_code = 2


def for_the_command_line(message: str) -> str:
    """A library error message with the API arguments it names (``overwrite=True``) spelled as flags."""
    for api, flag in API_TO_FLAGS.items():
        message = message.replace(api, flag)
    return message


class LazyGroup(click.Group):
    """click's documented lazy-subcommand group: a verb's module is imported when the verb is named (or --help lists it)."""

    def __init__(self, *args, lazy_subcommands: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(super().list_commands(ctx)) + [name for name in self.lazy_subcommands if name not in self.commands]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands and cmd_name not in self.commands:
            command = importlib.import_module(f"{__package__}.{self.lazy_subcommands[cmd_name]}").command
            _start_work(command)
            _guard_output(command)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


class PrunusGroup(LazyGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PrunusError as e:
            raise UserError(for_the_command_line(str(e))) from None
        except OSError as e:  # a full, read-only or over-quota disk, wherever it is written
            reason = disk_error(e)
            if reason is None:
                raise
            raise UserError(f"{e.filename or 'writing'}: {reason}; free space or choose another --out") from None
        except click.UsageError as e:  # a bad flag or value: one line too, not click's usage block
            where = e.ctx.command_path if e.ctx is not None else "prunus"
            raise UserError(f"{e.format_message()} (see {where} --help)") from None


@click.group(cls=PrunusGroup, lazy_subcommands=VERBS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(prunus.__version__, prog_name="prunus")
def cli():
    """prunus: train a model, make it small, ship it fast.

    Every stage reads one artifact directory and writes one.
    """


# third-party loggers whose import-time warnings say nothing to a prunus user, kept off the CLI's stderr (errors
# still show): torchao (which transformers and peft may import) logs every optional CUDA kernel library it cannot
# load on this machine, and torch's pytree logs a deprecation on torchao's behalf
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def prepare_process() -> None:
    """Settings a prunus command makes for its process before it starts work (imports torch).

    ``OMP_WAIT_POLICY=PASSIVE``: with OpenMP's default active waiting, two-thread torch on a
    2-core CPU was several times slower at times, its threads spinning while the other core has work
    (docs/defaults.md). OpenMP reads the variable when torch starts its thread
    pool, so it is set here, when a command begins, and never on ``import prunus`` (a
    library must not change its caller's process). A value the user set is kept.
    The loggers of :data:`QUIET_LOGGERS` are set to ERROR, here for the same reason.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _start_work(command: click.Command) -> None:
    """Wrap ``command`` so that :func:`prepare_process` runs when it starts (not for --help)."""
    callback = command.callback

    @functools.wraps(callback)
    def started(*args, **kwargs):
        prepare_process()
        return callback(*args, **kwargs)

    command.callback = started


def _guard_output(command: click.Command) -> None:
    """Wrap ``command`` so that its ``--out`` is checked against every path it reads before it runs."""
    from prunus.artifacts.paths import check_output

    # every option or argument that can name a path: declared click.Path, or free text (--data, --recipe)
    inputs = [p for p in command.params if p.name != "out" and isinstance(p.type, (click.Path, click.types.StringParamType))]
    if not inputs or not any(p.name == "out" for p in command.params):
        return
    callback = command.callback

    @functools.wraps(callback)
    def guarded(*args, **kwargs):
        out = kwargs.get("out")
        if out:
            named = []
            for p in inputs:
                value = kwargs.get(p.name)
                label = p.opts[0] if p.opts[0].startswith("-") else p.name.upper()
                named += [(label, v) for v in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(v, str)]
            check_output(out, named)
        return callback(*args, **kwargs)

    command.callback = guarded


def check_argv(argv: list[str]) -> None:
    """Refuse an argument that is not UTF-8 (Python holds its bytes as lone surrogates)."""
    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")[:60]
            raise UserError(f"argument {i} ({shown!r}) is not valid UTF-8; rename the file or pass UTF-8 text") from None


def main() -> None:
    try:
        check_argv(sys.argv[1:])
    except UserError as e:
        e.show()
        sys.exit(e.exit_code)
    cli(prog_name="prunus")


if __name__ == "__main__":
    main()
