"""The ``prunus`` command. Each verb parses, calls the Python API and renders the result.

A user's mistake (PrunusError) prints one ``Error: ...`` line and exits 2, with
no traceback.
"""

from __future__ import annotations

import click

import prunus
from prunus.models.errors import PrunusError


class UserError(click.ClickException):
    exit_code = 2


class PrunusGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PrunusError as e:
            raise UserError(str(e)) from None


@click.group(cls=PrunusGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(prunus.__version__, prog_name="prunus")
def cli():
    """prunus: train a model, make it small, ship it fast.

    Every stage reads one artifact directory and writes one.
    """


def _register() -> None:
    from . import compress, convert, eval, export, generate, info, serve, train  # noqa: A004

    for module in (train, eval, generate, convert, info, compress, export, serve):
        cli.add_command(module.command)


_register()


def main() -> None:
    cli(prog_name="prunus")


if __name__ == "__main__":
    main()
