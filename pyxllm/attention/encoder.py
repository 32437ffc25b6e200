"""Bidirectional attention for encoder models (BERT): each sequence of the step attends over
its own tokens, all of them, with no KV cache (an encoder computes a whole prompt in one step
and nothing follows it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A sequence is padded to the next multiple of this many tokens, and the sequences of one
# padded length attend in one call: a step of 64 sentences of 8-60 tokens makes 4 calls a
# layer instead of 64 (on 2 busy cores each call's thread hand-off cost more than its math).
PAD_MULTIPLE = 16


@dataclass(frozen=True, slots=True)
class _Group:
    """The sequences of one padded length ``padded_len``, as index tensors into the step's
    ``T`` token rows: ``gather [B * padded_len]`` (each padded slot's source row; padding reads
    row 0), ``mask [B, 1, 1, padded_len]`` (``True`` on a real key), ``rows [n]`` (the real
    tokens' rows) and ``slots [n]`` (where each sits in the padded layout)."""

    padded_len: int
    gather: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor


def _groups(query_lens: list[int], device: torch.device) -> list[_Group]:
    """The sequences of ``query_lens`` (laid end to end) grouped by padded length."""
    starts, start = [], 0
    for length in query_lens:
        starts.append(start)
        start += length
    by_len: dict[int, list[int]] = {}
    for i, length in enumerate(query_lens):
        by_len.setdefault(-(-length // PAD_MULTIPLE) * PAD_MULTIPLE, []).append(i)
    groups = []
    for padded_len, members in sorted(by_len.items()):
        gather = torch.zeros(len(members), padded_len, dtype=torch.int64)
        mask = torch.zeros(len(members), padded_len, dtype=torch.bool)
        for b, i in enumerate(members):
            gather[b, : query_lens[i]] = torch.arange(starts[i], starts[i] + query_lens[i])
            mask[b, : query_lens[i]] = True
        slots = mask.flatten().nonzero().squeeze(1)
        groups.append(
            _Group(
                padded_len,
                gather.flatten().to(device),
                mask[:, None, None, :].to(device),
                gather.flatten()[slots].to(device),
                slots.to(device),
            )
        )
    return groups


class EncoderAttentionStep:
    """One step's encoder attention (an ``AttentionStep`` whose caches are ``None``).

    Args:
        query_lens: the tokens of each sequence, laid end to end in the step's ``T`` tokens.
        device: where the step's tensors are.
    """

    def __init__(self, query_lens: list[int], device: torch.device | str = "cpu") -> None:
        self.query_lens = query_lens
        self.groups = _groups(query_lens, torch.device(device))

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
        sequence's softmax(q k^T * scale) v over its own tokens. A sequence is padded with
        masked keys to the next multiple of :data:`PAD_MULTIPLE` tokens, and the sequences of
        one padded length go through one ``scaled_dot_product_attention`` (each its own batch
        row), so a sequence's result depends on its own length only, not on its neighbours.
        ``k_cache``/``v_cache`` are unused (``None``).

        Raises:
            ValueError: ``sliding_window`` or ``logits_soft_cap`` given (an encoder has neither).
        """
        if sliding_window is not None or logits_soft_cap is not None:
            raise ValueError("encoder attention has no sliding window or logits soft cap")
        out = torch.empty_like(query)
        heads, head_dim = query.shape[1:]
        for group in self.groups:
            q, k, v = (
                t[group.gather].view(-1, group.padded_len, heads, head_dim).transpose(1, 2)
                for t in (query, key, value)
            )
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
            out[group.rows] = o.transpose(1, 2).reshape(-1, heads, head_dim)[group.slots]
        return out
