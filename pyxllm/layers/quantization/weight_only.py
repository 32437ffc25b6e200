"""Weight-only int8 and int4 quantization of linear layers (vLLM's ``quant_method`` idea).

A layer holds a ``quant_method`` whose ``apply(layer, x, bias)`` computes its matmul. Weights
load in float as usual; ``process_weights_after_loading(layer)`` then replaces ``layer.weight``
by quantized buffers, and the matmul goes through ``kernels.ops`` (ATen's CPU kernels on CPU,
the dequantizing reference elsewhere), so layers hold no device branch.

- int8: symmetric, per output channel: ``scale[n] = max_k |W[n, k]| / 127``,
  ``q = round(W / scale)`` in ``-127..127``.
- int4: asymmetric, per group of 32 input features, the min/max rule of llama.cpp's Q4_1
  (``quantize_row_q4_1_ref``): ``d = (max - min) / 15``, ``q = floor((W - min) / d + 0.5)`` in
  ``0..15``, so ``W ~= d * q + min``. The kernel's form is ``(q - 8) * scale + zero``, hence
  ``scale = d`` and ``zero = min + 8 d``. Weights dequantized from a GGUF Q4_1 file have exactly
  one ``q = 0`` and one ``q = 15`` per block (unless the block is constant), so this recovers the
  file's ``q``, ``d`` and ``m`` without loss (checked in tests/layers/test_quantization.py); only
  the scale and zero are stored in the compute dtype (bfloat16 rounds them to 8 significant bits).
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm import kernels

INT4_GROUP_SIZE = 32


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] int8, scales [N] float32)`` with ``weight ~= q * scales[:, None]``."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(w * inv.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] uint8 in 0..15, scales_and_zeros [K/G, N, 2] float32)``, see the module
    docstring.

    Raises:
        ValueError: ``K`` is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 needs input features in multiples of {group_size}, got {k}")
    w = weight.float().view(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    d = (high - low) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor((w - low.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).clamp_(0, 15).to(torch.uint8)
    scales_and_zeros = torch.stack((d, low + 8.0 * d), dim=-1).transpose(0, 1).contiguous()
    return q.view(n, k), scales_and_zeros


class UnquantizedLinearMethod:
    """``kernels.ops.linear`` (``F.linear``, or the platform's own) on the float
    ``layer.weight``; with ``batch_invariant`` (:data:`UNQUANTIZED_ROW_INVARIANT`, given by
    :func:`make_row_invariant` to the layers whose weights the platform's kernel takes so), a
    row gets the same bits at any row count."""

    name = None

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return kernels.ops.linear(x, layer.weight, bias, self.batch_invariant)


def replace_weight(layer: nn.Module, **buffers: torch.Tensor) -> None:
    """Drop ``layer.weight`` (a tied embedding keeps its own reference) and add ``buffers``."""
    del layer.weight
    for name, tensor in buffers.items():
        layer.register_buffer(name, tensor, persistent=False)


class Int8LinearMethod(UnquantizedLinearMethod):
    """Weight-only int8, per output channel: buffers ``qweight [N, K]`` int8, ``weight_scales
    [N]``."""

    name = "int8"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        q, scales = quantize_int8_per_channel(weight)
        replace_weight(layer, qweight=q, weight_scales=scales.to(weight.dtype))
        layer.quant_method = self

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return kernels.ops.int8_linear(x, layer.qweight, layer.weight_scales, bias)


class Int4LinearMethod(UnquantizedLinearMethod):
    """Weight-only int4 in groups of 32: buffers ``qweight`` and ``scales_and_zeros``, the
    platform kernel's layout of ``quantize_int4_groups``' output (``ops.pack_int4_weight``)."""

    name = "int4"
    group_size = INT4_GROUP_SIZE
    batch_invariant = False  # the kernel's row-invariant path at any row count

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        q, scales_and_zeros = quantize_int4_groups(weight, self.group_size)
        packed, scales_and_zeros = kernels.ops.pack_int4_weight(
            q, scales_and_zeros.to(weight.dtype)
        )
        replace_weight(layer, qweight=packed, scales_and_zeros=scales_and_zeros)
        layer.quant_method = self

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return kernels.ops.int4_linear(
            x, layer.qweight, layer.scales_and_zeros, self.group_size, bias, self.batch_invariant
        )


UNQUANTIZED = UnquantizedLinearMethod()
UNQUANTIZED_ROW_INVARIANT = UnquantizedLinearMethod(batch_invariant=True)


def make_row_invariant(model: nn.Module) -> int:
    """``--batch-invariant`` for the float layers: every quantizable layer still on
    :data:`UNQUANTIZED` whose weight the platform's ``linear`` sums row by row in a fixed order
    (``kernels.ops.linear_is_row_invariant``: float32 and bfloat16 on the CPU) takes
    :data:`UNQUANTIZED_ROW_INVARIANT`; returns how many did. Others (float16, an accelerator's
    BLAS) stay, and the executor's start-up log names them as not covered."""
    count = 0
    for module in model.modules():
        if (
            getattr(module, "quantizable", False)
            and module.quant_method is UNQUANTIZED
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and kernels.ops.linear_is_row_invariant(module.weight)
        ):
            module.quant_method = UNQUANTIZED_ROW_INVARIANT
            count += 1
    return count
