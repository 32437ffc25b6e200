"""The float linear layer's matmul: the reference every platform's ``linear`` must match."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]``, in ``x``'s dtype (``F.linear``,
    the layout of ``nn.Linear`` and of checkpoints). ``batch_invariant`` is taken for the
    platforms' signature: this reference promises nothing of the kind (BLAS may sum a row
    differently in batches of other sizes; see :func:`linear_is_row_invariant`)."""
    return F.linear(x, weight, bias)


def linear_is_row_invariant(weight: torch.Tensor) -> bool:
    """Whether ``linear(..., batch_invariant=True)`` over ``weight`` gives a row the same bits at
    any row count: never here (a platform with such a kernel says so for the weights it takes)."""
    return False
