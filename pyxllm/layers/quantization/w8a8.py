"""``--quantization w8a8``: int8 weights and int8 activations, for batched decode and prefill.

Weights are ``int8``'s format (symmetric, per output channel, ``weight_only.py``) with float32
scales; activations are quantized per token each time a layer runs (``scale = max |x| / 127``,
dynamic, no calibration), so the matmul runs on int8 x int8 -> int32 kernels. On a CPU with
AVX-512 VNNI these do about twice the multiply-adds per second of bfloat16 ``F.linear`` from
batch 16 up, which weight-only methods cannot give: they dequantize to the activations' dtype
and then cost what a bfloat16 matmul costs (docs/performance.md). The scheme is vLLM's dynamic
per-token W8A8 int8 (its ``compressed-tensors`` scheme), quantized here from float weights at
load time instead of read from a pre-quantized checkpoint, after the rotations of
``rotation.py`` (QuaRot), which keep the int8 activations accurate.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm import kernels
from pyxllm.layers.quantization.weight_only import (
    UnquantizedLinearMethod,
    quantize_int8_per_channel,
    replace_weight,
)


class W8A8LinearMethod(UnquantizedLinearMethod):
    """Buffers ``qweight [N, K]`` int8 and ``weight_scales [N]`` float32; ``apply`` is
    ``kernels.ops.w8a8_linear`` (formula in ``pyxllm.kernels.native.w8a8_linear``), with the
    layer's ``hadamard_block`` (set by ``rotation.py`` on down projections; else 0)."""

    name = "w8a8"
    hadamard_block = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scales = quantize_int8_per_channel(layer.weight.data)
        replace_weight(layer, qweight=q, weight_scales=scales)
        self.hadamard_block = getattr(layer, "hadamard_block", 0)
        layer.quant_method = self

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return kernels.ops.w8a8_linear(
            x, layer.qweight, layer.weight_scales, bias, self.hadamard_block
        )
