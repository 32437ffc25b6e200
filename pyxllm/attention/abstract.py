"""What the executor asks of an attention backend (vLLM's ``AttentionBackend``, reduced to the
two builders pyxllm uses).

A backend is stateful and owned by the executor; per step it builds an
:class:`~pyxllm.layers.forward_context.AttentionStep`, which the model's attention layers call
through the forward context. Backends: ``torch_paged`` (every platform's fallback),
``flash_attn`` (CUDA), ``npu`` (Ascend); the platform picks one
(``Platform.select_attention_backend``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from pyxllm.layers.forward_context import AttentionStep


@runtime_checkable
class AttentionBackend(Protocol):
    """Builds each step's :class:`AttentionStep`."""

    def build(self, batch) -> AttentionStep:
        """The step of an ``InputBatch`` (:mod:`pyxllm.executor.input_batch`): any mix of
        decodes and prefill chunks."""
        ...

    def build_decode(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> AttentionStep:
        """A decode-only step over given tensors with no host-side reads, so that a graph can
        capture it (the graph runner's static buffers).

        Args:
            slot_mapping: ``[B]`` int64 (-1: padding); block_tables: ``[B, max_blocks]`` int64;
            seq_lens: ``[B]`` int64; max_seq_len: a fixed bound on ``seq_lens``, in tokens.
        """
        ...
