"""Pooling a step's hidden states into one vector per sequence (an embedding model's head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

POOLING_TYPES = ("MEAN", "CLS", "LAST")


class Pooler(nn.Module):
    """One vector per sequence from its tokens' hidden states.

    Args:
        pooling_type: ``"MEAN"``: the mean over the sequence's tokens (sentence-transformers'
            mean pooling with every token unmasked); ``"CLS"``: its first token; ``"LAST"``:
            its last token (decoder embedding models such as Qwen3-Embedding).
        normalize: L2-normalize each vector (per request, :meth:`finish` may override it).

    Raises:
        ValueError: an unknown ``pooling_type``.
    """

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        super().__init__()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling type {pooling_type!r} is not supported; supported: "
                f"{', '.join(POOLING_TYPES)}"
            )
        self.pooling_type, self.normalize = pooling_type, normalize

    def forward(self, hidden_states: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``hidden_states [T, hidden]`` of whole sequences laid end to end, ``query_lens``
        their lengths (summing to ``T``) -> ``float32 [len(query_lens), hidden]``, pooled but
        not normalized (see :meth:`finish`)."""
        hidden = hidden_states.float()
        ends = torch.tensor(query_lens, device=hidden.device).cumsum(0)
        if self.pooling_type == "CLS":
            return hidden[ends - ends.new_tensor(query_lens)]
        if self.pooling_type == "LAST":
            return hidden[ends - 1]
        return torch.stack([part.mean(0) for part in hidden.split(query_lens)])

    def finish(
        self, vector: torch.Tensor, dimensions: int | None, normalize: bool | None
    ) -> torch.Tensor:
        """One pooled ``float32 [hidden]`` vector as a request asks for it: its first
        ``dimensions`` values (all when ``None``), then L2-normalized when ``normalize`` (``None``:
        the model's :attr:`normalize`)."""
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.normalize if normalize is None else normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector
