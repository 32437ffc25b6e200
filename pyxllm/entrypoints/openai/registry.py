"""A registry of classes by name, loaded when asked for: what ``--reasoning-parser`` and
``--tool-call-parser`` choose from (as vLLM's parser managers)."""

from __future__ import annotations

import importlib


class LazyRegistry:
    """Maps names to ``(module, class)`` strings, so that listing the names (for ``--help`` and
    flag checks) imports nothing; :meth:`get` imports the one asked for.

    Args:
        flag: the flag that chooses from it, named in errors (``"--tool-call-parser"``).
        entries: name -> (module path, class name).
    """

    def __init__(self, flag: str, entries: dict[str, tuple[str, str]]) -> None:
        self.flag, self.entries = flag, dict(entries)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self.entries)

    def get(self, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            ValueError: an unknown name; the message names the flag and lists the known ones.
        """
        try:
            module_name, class_name = self.entries[name]
        except KeyError:
            raise ValueError(
                f"{self.flag}: unknown parser {name!r}; known parsers: {', '.join(self.names())}"
            ) from None
        return getattr(importlib.import_module(module_name), class_name)
