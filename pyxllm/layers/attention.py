"""The attention layer: reshapes heads and hands off to the executor's attention backend.

Under ``torch.compile`` the hand-off is the custom op ``pyxllm::attention``, opaque to the
compiler (as vLLM's unified attention op is): the backend's per-step Python (its loop over
prefill sequences, the cache write) runs eagerly inside it, and the layers around it compile
into one graph without graph breaks. Eager runs call the same function directly.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.layers.forward_context import get_forward_context


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Cache this step's K/V of layer ``layer_idx`` and attend, through the current forward context.

    ``query [T, heads, head_dim]``, ``key``/``value [T, kv_heads, head_dim]`` -> ``[T, heads,
    head_dim]``; ``sliding_window`` and ``logits_soft_cap`` as in ``AttentionStep.forward``.
    """
    ctx = get_forward_context()
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    return ctx.attn.forward(
        query, key, value, k_cache, v_cache, scale, sliding_window, logits_soft_cap
    )


@torch.library.custom_op("pyxllm::attention", mutates_args=())
def attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """:func:`_attention` as an op the compiler does not trace into (contiguous output, a new
    tensor)."""
    return _attention(
        query, key, value, layer_idx, scale, sliding_window, logits_soft_cap
    ).contiguous()


@attention_op.register_fake
def _(query, key, value, layer_idx, scale, sliding_window=None, logits_soft_cap=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of layer ``layer_idx`` over the paged KV cache, the step's K/V cached first:
    ``query [T, heads, head_dim]``, ``key``/``value [T, kv_heads, head_dim]`` -> ``[T, heads,
    head_dim]``. Under ``torch.compile`` it is the opaque op ``pyxllm::attention``."""
    attend = attention_op if torch.compiler.is_compiling() else _attention
    return attend(query, key, value, layer_idx, scale, sliding_window, logits_soft_cap)


class Attention(nn.Module):
    """Multi-head (grouped-query) attention over the paged KV cache of layer ``layer_idx``.

    ``forward(q [T, heads*head_dim], k [T, kv_heads*head_dim], v [T, kv_heads*head_dim])``
    returns ``[T, heads*head_dim]``. The step's K/V are written to the cache by the backend.
    ``sliding_window`` (tokens, None: full attention) and ``logits_soft_cap`` (None: off) are the
    layer's options, as vLLM's ``Attention`` takes them.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.layer_idx = scale, layer_idx
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = paged_attention(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.layer_idx,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
        )
        return out.reshape(-1, self.num_heads * self.head_dim)


class EncoderAttention(nn.Module):
    """Bidirectional multi-head attention of an encoder (BERT's): each token attends to every
    token of its own sequence in the step, which holds whole sequences; no KV cache.

    ``forward(q, k, v [T, heads*head_dim])`` returns ``[T, heads*head_dim]``, through the
    forward context's step (``pyxllm.attention.encoder.EncoderAttentionStep``), called with no
    caches.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (-1, self.num_heads, self.head_dim)
        out = get_forward_context().attn.forward(
            q.view(shape), k.view(shape), v.view(shape), None, None, self.scale
        )
        return out.reshape(-1, self.num_heads * self.head_dim)
