"""Ascend NPU attention: torch_npu's paged-attention kernel for decode rows, the pure-PyTorch
kernels for prefill chunks.

Untested here (no NPU on the development machines); ``pyxllm check-device --device npu``
compares it with the CPU on a card. Imported only when the NPU platform is bound.

``torch_npu._npu_paged_attention`` reads the context lengths from a host tensor, so a captured
ACL graph cannot use it as is; the graph runner's decode steps use the inherited
``build_decode`` (pure-PyTorch attention over static buffers) instead.

Prefill chunks with key limits (an image attended bidirectionally, Gemma 3's) take them through
the inherited pure-PyTorch prefill; decode rows with key limits (only under
``--batch-invariant``) take the pure-PyTorch decode kernel, torch_npu's reading no such limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch_npu

from pyxllm.attention.torch_paged import (
    TorchPagedAttentionBackend,
    TorchPagedAttentionStep,
    decode_rows,
)


@dataclass(slots=True)
class NPUAttentionStep(TorchPagedAttentionStep):
    """A :class:`TorchPagedAttentionStep` whose decode rows go through torch_npu.

    Attributes:
        decode_seq_lens_host: ``[num_decodes]`` int32 on the host (what the kernel reads).
    """

    decode_seq_lens_host: torch.Tensor | None = None

    def decode(
        self,
        query,
        k_cache,
        v_cache,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """``query [num_decodes, heads, head_dim] -> [num_decodes, heads, head_dim]``; layers
        with a sliding window or soft-capping, and rows with key limits, take the pure-PyTorch
        kernel (torch_npu's has none of these options)."""
        if (
            sliding_window is not None
            or logits_soft_cap is not None
            or self.decode_key_lens is not None
        ):
            return TorchPagedAttentionStep.decode(
                self, query, k_cache, v_cache, scale, sliding_window, logits_soft_cap
            )
        query = query.contiguous()
        out = torch.empty_like(query)
        torch_npu._npu_paged_attention(
            query=query,
            key_cache=k_cache,
            value_cache=v_cache,
            num_kv_heads=k_cache.shape[2],
            num_heads=query.shape[1],
            scale_value=scale,
            block_table=self.decode_block_tables.to(torch.int32),
            context_lens=self.decode_seq_lens_host,
            out=out,
        )
        return out


class NPUAttentionBackend(TorchPagedAttentionBackend):
    """Builds an :class:`NPUAttentionStep` per step; ``build_decode`` (graphs) is inherited.

    No int8 KV cache: ``torch_npu``'s paged attention reads float K/V rows, not the
    int8-with-scale rows of ``--kv-cache-dtype int8`` (the flag is refused at start-up).
    """

    supports_int8_kv_cache = False

    def build(self, batch) -> NPUAttentionStep:
        """``batch``: an ``InputBatch``."""
        step = super().build(batch)
        host = torch.tensor(decode_rows(batch)[2], dtype=torch.int32)
        fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        return NPUAttentionStep(**fields, decode_seq_lens_host=host)
