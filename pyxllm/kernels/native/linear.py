"""The float linear layer's matmul: the reference every platform's ``linear`` must match."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]``, in ``x``'s dtype (``F.linear``,
    the layout of ``nn.Linear`` and of checkpoints)."""
    return F.linear(x, weight, bias)
