"""The per-step forward context: how layers reach attention metadata and the KV cache.

The executor sets it around each model forward (xLLM's ``ForwardContext`` in a ``ContextVar``),
so model ``forward`` signatures stay ``(input_ids, positions)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionStep(Protocol):
    """One step's attention state, as an attention backend builds it (for an ``InputBatch``, or
    over a graph runner's static buffers); what :class:`~pyxllm.layers.attention.Attention`
    calls. ``TorchPagedAttentionStep``, ``FlashAttnStep`` and ``NPUAttentionStep`` are ones
    (:mod:`pyxllm.attention`)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write the step's ``key``/``value [T, kv_heads, head_dim]`` at its slots of one
        layer's ``k_cache``/``v_cache [num_blocks, block_size, kv_heads, head_dim]``, then
        attend: ``query [T, heads, head_dim]`` (softmax scale ``scale``) -> ``[T, heads,
        head_dim]``, each token over its sequence's context up to and including itself (its
        last ``sliding_window`` tokens when set; scores soft-capped at ``logits_soft_cap`` when
        set, see :mod:`pyxllm.kernels.native.paged_attention`)."""
        ...


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """What attention layers need during one forward pass.

    Attributes:
        attn: the step's :class:`AttentionStep`.
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
            head_dim]``.
        step_cache: what layers compute once per step and share (e.g. the rotary ``cos``/``sin``
            of the step's positions), keyed by the producer; dropped with the context.
        lora: the step's LoRA adapters and their rows (``pyxllm.lora.manager.LoRAStep``), read
            by the layers' ``LoRALinearMethod``; ``None`` when no row uses an adapter.
        multimodal: the step's encoder outputs and the rows they replace
            (:class:`MultiModalEmbeddings`), read by a vision-language model's forward;
            ``None`` when no row is an image placeholder.
    """

    attn: AttentionStep
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    step_cache: dict = field(default_factory=dict)
    lora: object | None = None
    multimodal: MultiModalEmbeddings | None = None


@dataclass(frozen=True, slots=True)
class MultiModalEmbeddings:
    """Encoder outputs that replace token embeddings in one step.

    Attributes:
        indices: ``int64 [K]`` rows of the step's flattened tokens (placeholder positions).
        embeds: ``[K, hidden]`` the projected encoder features for those rows, in order.
    """

    indices: torch.Tensor
    embeds: torch.Tensor


_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("pyxllm_forward_context", default=None)


def current_forward_context() -> ForwardContext | None:
    """The context of the forward pass in progress, or ``None`` outside one."""
    return _CONTEXT.get()


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress.

    Raises:
        RuntimeError: called outside ``set_forward_context``.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(
            "attention called outside a forward context; run the model through the executor"
        )
    return ctx


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make ``ctx`` current for the duration of the ``with`` block."""
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)
