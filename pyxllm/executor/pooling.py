"""One embed step's vectors from its hidden states: what the two executors that pool share
(:class:`~pyxllm.executor.pooling_executor.PoolingExecutor` for encoders, the
``ModelExecutor`` for decoders)."""

from __future__ import annotations

import torch

from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.layers.pooler import Pooler


def pool_sequences(
    pooler: Pooler, plan: SchedulerOutput, hidden_states: torch.Tensor, query_lens: list[int]
) -> list[torch.Tensor]:
    """Each of ``plan``'s sequences' embedding, ``float32 [dimensions]`` on the CPU: its
    tokens' rows of ``hidden_states [T, hidden]`` (``query_lens`` each, end to end) pooled, then
    cut and normalized as its ``pooling_params`` ask.

    Raises:
        ValueError: a sequence that is not a whole prompt (a prefix-cache hit or a prefill
            chunk: the engine turns both off for the embed task).
    """
    for seq in plan.sequences:
        if seq.num_computed_tokens or not seq.sample:
            end = seq.num_computed_tokens + len(seq.token_ids)
            raise ValueError(
                f"request {seq.request_id}: pooling needs whole prompts, got tokens "
                f"{seq.num_computed_tokens}..{end} of {seq.num_prompt_tokens}"
            )
    vectors = pooler(hidden_states[: sum(query_lens)], query_lens).cpu()
    pooled = []
    for seq, vector in zip(plan.sequences, vectors):
        params = seq.pooling_params
        dimensions = None if params is None else params.dimensions
        normalize = None if params is None else params.normalize
        pooled.append(pooler.finish(vector, dimensions, normalize))
    return pooled


def token_type_ids(
    plan: SchedulerOutput, query_lens: list[int], num_tokens: int, device: torch.device
) -> torch.Tensor | None:
    """BERT's ``token_type_ids`` for ``plan``'s sequences laid end to end (``int64
    [num_tokens]``, rows past ``sum(query_lens)`` type 0): 1 from each sequence's
    ``pooling_params.token_type_start`` (a cross-encoder's text pair), else 0; ``None`` when no
    sequence has a second segment (the model then gives every token type 0)."""
    starts = [
        None if seq.pooling_params is None else seq.pooling_params.token_type_start
        for seq in plan.sequences
    ]
    if all(start is None for start in starts):
        return None
    types = torch.zeros(num_tokens, dtype=torch.int64)
    offset = 0
    for start, length in zip(starts, query_lens):
        if start is not None:
            types[offset + start : offset + length] = 1
        offset += length
    return types.to(device)
