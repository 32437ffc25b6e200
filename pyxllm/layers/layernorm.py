"""RMSNorm with an optional fused residual add, and LayerNorm (BERT's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (``hidden_size``): weight and bias ``[hidden_size]``
    (BERT's ``LayerNorm``); ``forward(x [..., hidden_size])`` -> the same shape and dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
