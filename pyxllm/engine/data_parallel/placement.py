"""Where a data-parallel replica computes, as both launchers (processes here, Ray actors) give
it: a leaf, so that neither launcher imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica computes: its torch ``threads`` (``None``: torch's count), the
    ``cpus`` it is pinned to (empty: not pinned), and ``environ`` variables (the cards it
    sees)."""

    threads: int | None = None
    cpus: tuple[int, ...] = ()
    environ: tuple[tuple[str, str], ...] = ()
