"""Packages whose public names are imported on first use, so that importing a light module is light.

``import prunus.train_parallel.config`` runs ``prunus/models/__init__.py`` and
``prunus/train_parallel/__init__.py`` first. If those imported every submodule,
reading a dataclass of settings (what ``prunus train --help`` needs) would cost the
two seconds that importing torch takes. :func:`lazy_package` makes a package import
the submodule that defines a public name when that name is first read
(``from prunus.models import load_model`` works as before).

It sets the package module's class to :class:`LazyPackage`, the way the Python
reference documents for customising a module's attribute access ("Customizing
module attribute access", ``sys.modules[__name__].__class__ = ...``), because a
module-level ``__getattr__`` (PEP 562) alone is not enough: when a submodule is
imported, the import system binds it on its package under its own name, and a public
name equal to its module's name (``prunus.models.generate`` the function, defined in
``prunus/models/generate.py``) would then read as the module. The class's
``__setattr__`` keeps the public name bound to what the package exports.

It lives in ``artifacts/``, the one package below ``models/``, because the packages that use it
(``models``, ``train_parallel``, ``export``, ``runtime``, ``serve``) start at ``models/``: it must be
importable without torch and without any of them.
"""

from __future__ import annotations

import importlib
import sys
import types


class LazyPackage(types.ModuleType):
    """A package module that imports ``_lazy_exports[name]`` when ``name`` is first read: a submodule's
    name, or an absolute module path (``prunus....``) for a name the package re-exports from elsewhere."""

    def __getattr__(self, name: str):
        exports = self.__dict__.get("_lazy_exports", {})
        if name not in exports:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        where = exports[name]
        value = getattr(importlib.import_module(where if where.startswith("prunus.") else f"{self.__name__}.{where}"), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # the import system binds a submodule on its package once it is loaded; where the
        # package exports a name of the same spelling from it, the export wins (as with eager imports)
        exports = self.__dict__.get("_lazy_exports", {})
        if (isinstance(value, types.ModuleType) and exports.get(name) == name
                and value.__name__ == f"{self.__name__}.{name}" and hasattr(value, name)):
            value = getattr(value, name)
        types.ModuleType.__setattr__(self, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_lazy_exports", {})))


def lazy_package(name: str, exports: dict[str, str]) -> None:
    """Make package ``name`` import each public name from its submodule (``exports``: name -> submodule) on first use."""
    module = sys.modules[name]
    module._lazy_exports = dict(exports)
    module.__class__ = LazyPackage
