"""Gated activations, and the one a config's ``hidden_act`` names."""

import torch
import torch.nn.functional as F
from torch import nn

from pyxllm import kernels


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): ``[..., 2d] -> [..., d]``, ``silu(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.ops.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """GeGLU gate (Shazeer 2020): ``[..., 2d] -> [..., d]``, ``gelu(gate) * up``; ``approximate``
    as ``torch.nn.functional.gelu`` (``"tanh"``: transformers' ``gelu_pytorch_tanh``, Gemma's)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


# transformers' ``hidden_act`` names -> the gated activation of ``gate_up`` it means
_ACT_AND_MUL = {
    "silu": SiluAndMul,
    "gelu": GeluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul_fn(hidden_act: str) -> nn.Module:
    """The gated activation ``[..., 2d] -> [..., d]`` for transformers' ``hidden_act`` name.

    Raises:
        ValueError: an activation other than ``silu``, ``gelu`` or ``gelu_pytorch_tanh``.
    """
    if hidden_act not in _ACT_AND_MUL:
        raise ValueError(
            f"activation {hidden_act!r} is not supported; supported: {', '.join(_ACT_AND_MUL)}"
        )
    return _ACT_AND_MUL[hidden_act]()
