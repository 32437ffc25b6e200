"""The attention layer: reshapes heads and hands off to the executor's attention backend."""
from __future__ import annotations

import torch
from torch import nn

from pyxllm.layers.forward_context import get_forward_context


class Attention(nn.Module):
    """Multi-head (grouped-query) attention over the paged KV cache of layer ``layer_idx``.

    ``forward(q [T, heads*head_dim], k [T, kv_heads*head_dim], v [T, kv_heads*head_dim])``
    returns ``[T, heads*head_dim]``. The step's K/V are written to the cache by the backend.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.layer_idx = scale, layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.attn.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            k_cache,
            v_cache,
            self.scale,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
