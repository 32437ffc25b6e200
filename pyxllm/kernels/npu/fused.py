"""torch_npu's fused kernels behind pyxllm's kernel signatures (see ``pyxllm.kernels.native``).

Untested here (no NPU on the development machines).
"""

from __future__ import annotations

import torch
import torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` with ``weight [hidden]`` (``torch_npu.npu_rms_norm``)."""
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual``, then its RMSNorm; returns ``(normed, residual)``
    (``torch_npu.npu_add_rms_norm``, which returns ``(y, rstd, x + residual)``)."""
    normed, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
    return normed, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (``torch_npu.npu_swiglu``)."""
    return torch_npu.npu_swiglu(x, dim=-1)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value [T, kv_heads, head_dim]`` at ``slot_mapping [T]`` into the
    ``[num_blocks, block_size, kv_heads, head_dim]`` caches; negative slots write nothing
    (``torch_npu._npu_reshape_and_cache``, called positionally: its slot argument was renamed
    across CANN releases)."""
    torch_npu._npu_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.to(torch.int32))
