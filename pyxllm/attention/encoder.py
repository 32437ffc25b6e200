"""Bidirectional attention for encoder models (BERT): each sequence of the step attends over
its own tokens, all of them, with no KV cache (an encoder computes a whole prompt in one step
and nothing follows it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class EncoderAttentionStep:
    """One step's encoder attention (an ``AttentionStep`` whose caches are ``None``).

    Args:
        query_lens: the tokens of each sequence, laid end to end in the step's ``T`` tokens.
    """

    def __init__(self, query_lens: list[int]) -> None:
        self.query_lens = query_lens

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """``query``/``key``/``value [T, heads, head_dim]`` -> ``[T, heads, head_dim]``: each
        sequence's softmax(q k^T * scale) v over its own tokens, one
        ``scaled_dot_product_attention`` per sequence (so a sequence's result does not depend
        on its neighbours). ``k_cache``/``v_cache`` are unused (``None``).

        Raises:
            ValueError: ``sliding_window`` or ``logits_soft_cap`` given (an encoder has neither).
        """
        if sliding_window is not None or logits_soft_cap is not None:
            raise ValueError("encoder attention has no sliding window or logits soft cap")
        out = torch.empty_like(query)
        start = 0
        for length in self.query_lens:
            rows = slice(start, start + length)
            q, k, v = (t[rows].transpose(0, 1) for t in (query, key, value))
            out[rows] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
            start += length
        return out
