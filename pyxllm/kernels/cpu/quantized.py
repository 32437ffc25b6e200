"""ATen's CPU weight-only kernels, in the formats of ``pyxllm.kernels.native.quantized``.

- int8: ``torch._weight_int8pack_mm(A [M, K], W int8 [N, K], scales [N])``.
- int4: ``torch._convert_weight_to_int4pack_for_cpu(q int32 [N, K], inner_k_tiles)`` packs two
  4-bit values per byte (``[N, K/2]`` uint8; ``N`` must be a multiple of 16), and
  ``torch._weight_int4pack_mm_for_cpu(A [M, K], packed, group_size, scales_and_zeros [K/G, N, 2])``
  computes ``A @ ((q - 8) * scale + zero).T`` (checked in tests/layers/test_quantization.py).

Both take 2-D activations in float32, bfloat16 or float16, with scales in the same dtype; on a
CPU with AVX-512 (bf16) they are several times faster than a bfloat16 ``F.linear`` at small
batches (see shared PERF_NOTES and docs/performance.md).
"""

from __future__ import annotations

import torch

from pyxllm.kernels.native.quantized import scale_pairs


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """See ``pyxllm.kernels.native.quantized.int8_linear``."""
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), qweight, scales)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def pack_int4_weight(
    q: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (``[N, K]``, values ``0..15``) packed for ``int4_linear`` (``[N, K/2]`` uint8), and
    ``scales_and_zeros`` as pairs in ``dtype``, the compute dtype (``scale_pairs``; ``None``: as
    given).

    Raises:
        ValueError: ``N`` is not a multiple of 16 (the kernel's tile).
    """
    if q.shape[0] % 16:
        raise ValueError(
            f"int4 weights need a multiple of 16 output features on CPU, got {q.shape[0]}"
        )
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    return packed, scale_pairs(scales_and_zeros, 8, dtype)


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """See ``pyxllm.kernels.native.quantized.int4_linear`` (ATen's kernel promises no batch
    invariance either)."""
    y = torch._weight_int4pack_mm_for_cpu(
        x.reshape(-1, x.shape[-1]), packed, group_size, scales_and_zeros
    )
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias
