"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from pyxllm import kernels


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (``hidden_size``), weight ``[hidden_size]``.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds the residual and
    returns ``(normed, x + residual)``, the pre-norm residual stream of Llama-style decoders.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels.ops.rms_norm(x, self.weight, self.eps)
        return kernels.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
