"""Pure-PyTorch normalization, activation and rotary-embedding kernels.

The arithmetic order follows transformers' modeling_llama.py so that float32 results match it
bit for bit where the operations are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``weight * x / sqrt(mean(x**2) + eps)``.

    Args:
        x: ``[..., hidden]``, any float dtype; statistics are computed in float32.
        weight: ``[hidden]``.
    Returns:
        ``[..., hidden]`` in ``x.dtype``.
    """
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` then RMSNorm of it; returns ``(normed, residual)``, both ``[...,
    hidden]``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``[..., 2d]``; returns
    ``[..., d]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[num_tokens, 1, head_dim]`` in ``dtype``, for ``apply_rotary_emb``:
    the cache's ``head_dim // 2`` frequencies at ``positions``, repeated over both halves."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).to(dtype)
    cos = cos_sin[:, :half].repeat(1, 2).unsqueeze(1)
    sin = cos_sin[:, half:].repeat(1, 2).unsqueeze(1)
    return cos, sin


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for ``q`` and ``k`` (transformers'
    ``apply_rotary_pos_emb``).

    ``cos``/``sin`` from ``rotary_cos_sin`` (computed once per step and shared by every layer).
    """
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in the GPT-NeoX (rotate-half) layout used by Llama and Qwen.

    Args:
        positions: ``[num_tokens]`` int64 positions.
        q: ``[num_tokens, num_heads, head_dim]``; k: ``[num_tokens, num_kv_heads, head_dim]``.
        cos_sin_cache: ``[max_position, head_dim]`` float32, ``cos`` in the first half of the
            columns and ``sin`` in the second, each of ``head_dim // 2`` frequencies.
    Returns:
        The rotated ``(q, k)``, same shapes and dtypes. The same as ``apply_rotary_emb(q, k,
        *rotary_cos_sin(positions, cos_sin_cache, q.dtype))``.
    """
    return apply_rotary_emb(q, k, *rotary_cos_sin(positions, cos_sin_cache, q.dtype))
