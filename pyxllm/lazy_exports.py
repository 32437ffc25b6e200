"""Package attributes that load their module on first use (PEP 562), so importing a package
does not import what its names need (torch, above all) until one of them is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``exports`` (public name -> the module
    that defines it): the first use of a name imports its module and keeps the value in the
    package's namespace.

    Raises (from ``__getattr__``):
        AttributeError: a name not in ``exports``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this
        return value

    def __dir__() -> list[str]:
        return sorted({*exports, *vars(importlib.import_module(package))})

    return __getattr__, __dir__
