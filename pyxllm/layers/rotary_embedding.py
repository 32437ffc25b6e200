"""Rotary position embedding (Su et al. 2021, RoFormer) with the rope_scaling kinds we support.

Frequencies follow transformers' ``modeling_rope_utils``: ``inv_freq[i] = base ** (-2i / dim)``;
``linear`` divides them by ``factor``; ``llama3`` (Llama 3.1) divides the low frequencies by
``factor``, keeps the high ones and interpolates in between.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pyxllm import kernels
from pyxllm.layers.forward_context import current_forward_context

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``q [num_tokens, heads, head_dim]`` and ``k [num_tokens, kv_heads,
    head_dim]``.

    Holds ``cos_sin_cache`` ``[max_position, head_dim]`` float32, computed once.

    Raises:
        ValueError: a rope_scaling type other than ``default``, ``linear`` or ``llama3``.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        self.register_buffer(
            "cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False
        )
        # layers with the same rotary parameters share one cos/sin per step
        self._signature = (
            "rope",
            head_dim,
            max_position,
            base,
            repr(sorted((scaling or {}).items())),
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k``. Inside an eager forward pass, the step's ``cos``/``sin`` are
        computed by the first layer and shared by the others (``ForwardContext.step_cache``,
        keyed by the rotary parameters); a compiled forward fuses them instead."""
        ctx = None if torch.compiler.is_compiling() else current_forward_context()
        if ctx is None:
            return kernels.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
        key = (self._signature, q.dtype)
        cos_sin = ctx.step_cache.get(key)
        if cos_sin is None:
            cos_sin = ctx.step_cache[key] = kernels.ops.rotary_cos_sin(
                positions, self.cos_sin_cache, q.dtype
            )
        return kernels.ops.apply_rotary_emb(q, k, *cos_sin)
