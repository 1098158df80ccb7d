"""The ``prunus`` command. Each verb parses, calls the Python API and renders the result.

A user's mistake (PrunusError) prints one ``Error: ...`` line and exits 2, with
no traceback. Two checks hold for every verb, present and future: an argument that is
not UTF-8 is refused before anything runs, and a verb's ``--out`` never is, contains
or lies inside any path it reads (every path or text option or argument that names an
existing file or directory).
"""

from __future__ import annotations

import functools
import sys

import click

import prunus
from prunus.models.atomic import disk_error
from prunus.models.errors import PrunusError


class UserError(click.ClickException):
    exit_code = 2


class PrunusGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PrunusError as e:
            raise UserError(str(e)) from None
        except OSError as e:  # a full, read-only or over-quota disk, wherever it is written
            reason = disk_error(e)
            if reason is None:
                raise
            raise UserError(f"{e.filename or 'writing'}: {reason}; free space or choose another --out") from None
        except click.UsageError as e:  # a bad flag or value: one line too, not click's usage block
            where = e.ctx.command_path if e.ctx is not None else "prunus"
            raise UserError(f"{e.format_message()} (see {where} --help)") from None


@click.group(cls=PrunusGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(prunus.__version__, prog_name="prunus")
def cli():
    """prunus: train a model, make it small, ship it fast.

    Every stage reads one artifact directory and writes one.
    """


def _guard_output(command: click.Command) -> None:
    """Wrap ``command`` so that its ``--out`` is checked against every path it reads before it runs."""
    from prunus.models.paths import check_output

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


def _register() -> None:
    from . import compress, convert, eval, export, generate, info, serve, train  # noqa: A004

    for module in (train, eval, generate, convert, info, compress, export, serve):
        cli.add_command(module.command)
    for command in cli.commands.values():
        _guard_output(command)


_register()


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
