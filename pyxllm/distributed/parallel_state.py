"""Tensor-parallel state of this process: its TP rank, the TP world size and the collectives.

With one process (the default) every collective is the identity, so layers call them
unconditionally and hold no "if distributed" branch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _TPState:
    rank: int = 0
    world_size: int = 1
    group: object | None = None


_TP = _TPState()


def get_tp_rank() -> int:
    """This process's tensor-parallel rank, 0-based."""
    return _TP.rank


def get_tp_size() -> int:
    """Number of tensor-parallel ranks (1 without tensor parallelism)."""
    return _TP.world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place and return it (identity on one rank)."""
    if _TP.world_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate ``x`` from every TP rank along ``dim`` (identity on one rank)."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
