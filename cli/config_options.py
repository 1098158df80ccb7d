"""One ``prunus train`` option per field of a settings dataclass: name, type (from the annotation), default and
help text (the field's ``metadata["help"]``)."""

from __future__ import annotations

import dataclasses
import types
import typing

import click

from prunus.train_parallel.config import TrainConfig


def _option_type(annotation) -> type:
    """``int``, ``float``, ``str`` or ``bool`` from a field's annotation (``int | None`` -> ``int``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def field_option(f: dataclasses.Field, annotation, default) -> click.Option:
    """The ``prunus train`` option of one TrainConfig field."""
    meta = f.metadata
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    help_text = meta["help"] + (f" One of: {', '.join(meta['choices'])}." if "choices" in meta else "")
    kind = _option_type(annotation)
    if kind is bool:
        off = meta.get("off_flag", "--no-" + flag[2:])
        return click.Option([f"{flag}/{off}", f.name], default=default, show_default=True, help=help_text)
    return click.Option([flag, f.name], type=kind, default=default, show_default=default is not None, help=help_text)


def config_options(settings: type = TrainConfig) -> list[click.Option]:
    """One option per field of the dataclass ``settings`` (those with ``cli=False`` in their metadata excepted)."""
    hints = typing.get_type_hints(settings)
    defaults = settings()
    return [field_option(f, hints[f.name], getattr(defaults, f.name)) for f in dataclasses.fields(settings)
            if f.metadata.get("cli", True)]
