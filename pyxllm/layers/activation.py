"""Gated activations."""

import torch
from torch import nn

from pyxllm import kernels


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): ``[..., 2d] -> [..., d]``, ``silu(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.ops.silu_and_mul(x)
