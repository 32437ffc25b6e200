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
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from pyxllm.layers.linear import load_rows
from pyxllm.layers.quantization.weight_only import UNQUANTIZED


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
        # not zeros: a weight kept in its stored format is never written (see weight_loader)
        self.weight = nn.Parameter(
            torch.empty(self.num_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # the rows looked up from the stored format (``quantization.stored``), if it is kept
        self.stored_lookup = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"vocab {self.num_embeddings} x hidden {param.shape[1]}"
            )
        count = max(0, min(self.num_per_rank, self.num_embeddings - self.vocab_start))
        param.data[count:].zero_()  # padding rows past the vocabulary
        load_rows(param, loaded.narrow(0, self.vocab_start, count), type(self).__name__, 0, count)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), hidden]``: rows ``ids`` (this rank's numbering) of the weight."""
        if self.stored_lookup is not None:
            return self.stored_lookup(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.embed(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        out = self.embed(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits; shares the embedding's layout and loader.

    ``compute_logits(hidden [num_sampled, hidden]) -> [num_sampled, vocab]`` float32, gathered
    to TP rank 0 (the rank that samples); ``None`` on the other ranks. Every rank must call it
    on the same positions (the gather is a collective); call it only on the sampled positions.
    The matmul is ``quant_method.apply`` (int8 under ``--quantization``, see
    ``pyxllm.layers.quantization``); the token embedding keeps the float weight.
    """

    quant_method = UNQUANTIZED
    quantizable = True

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = tensor_model_parallel_gather(self.quant_method.apply(self, hidden_states), dim=-1)
        return None if logits is None else logits[:, : self.num_embeddings].float()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s weight (tied word embeddings); the checkpoint then has no LM head."""
        self.weight = embedding.weight
