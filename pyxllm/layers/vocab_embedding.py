"""Vocabulary-parallel token embedding and LM head (vLLM's names; Megatron-LM's vocab split).

Each rank holds a contiguous range of ``ceil(vocab / tp_size)`` rows; rows past the real vocabulary
are zero padding and their logits are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyxllm.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    """Token embedding, weight ``[ceil(vocab/tp), hidden]`` on this rank.

    ``forward(input_ids [num_tokens] int64) -> [num_tokens, hidden]``: ids outside this rank's
    range embed to zero, and one all-reduce sums the ranks' parts.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"vocab {self.num_embeddings} x hidden {param.shape[1]}"
            )
        rows = loaded[self.vocab_start : self.vocab_start + self.num_per_rank]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits; shares the embedding's layout and loader.

    ``compute_logits(hidden [num_sampled, hidden]) -> [num_sampled, vocab]`` float32, gathered
    from every rank. Call it only on the positions that are sampled.
    """

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s weight (tied word embeddings); the checkpoint then has no LM head."""
        self.weight = embedding.weight
