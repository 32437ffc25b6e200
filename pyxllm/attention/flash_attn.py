"""CUDA attention through flash-attn's paged-KV kernels (flash-attn >= 2.6).

Untested here (no GPU on the development machines); ``pyxllm check-device --device cuda``
compares it with the CPU on a card. Imported only when the CUDA platform picks it, i.e. when
flash-attn is installed and ``--block-size`` is a multiple of 256 (what its paged cache takes).

Caches keep pyxllm's layout, ``[num_blocks, block_size, num_kv_heads, head_dim]``, which is
flash-attn's paged layout. The step's K/V are written first (``kernels.ops.reshape_and_cache``),
then every row attends over its cached context: a decode-only step with
``flash_attn_with_kvcache``, any other step with one ``flash_attn_varlen_func`` call (causal
masks align each query chunk to the end of its context).

flash-attn's masks are causal or windowed, never a per-token key limit: a step with an image
attended bidirectionally (``InputBatch.key_limits``, Gemma 3's images) is built as a
:class:`~pyxllm.attention.torch_paged.TorchPagedAttentionStep` instead (the pure-PyTorch
kernels, on the same caches), the steps without one as below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from pyxllm import kernels
from pyxllm.attention.torch_paged import TorchPagedAttentionBackend, TorchPagedAttentionStep


@dataclass(slots=True)
class FlashAttnStep:
    """Metadata of one step (``B`` sequences), int32 where flash-attn wants it.

    Attributes:
        slot_mapping: ``[T]`` int64 (-1: padding); block_tables: ``[B, max_blocks]`` int32;
        seq_lens: ``[B]`` int32; cu_seqlens_q / cu_seqlens_k: ``[B + 1]`` int32 (``None`` for
        a decode-only step); max_query_len / max_seq_len: their maxima (host ints).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_query_len: int
    max_seq_len: int

    def forward(
        self,
        query,
        key,
        value,
        k_cache,
        v_cache,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Cache the step's K/V, then attend: ``query [T, heads, head_dim] -> [T, heads,
        head_dim]``. A sliding window ``W`` is flash-attn's ``window_size=(W - 1, 0)`` (the
        token itself and ``W - 1`` before it); soft-capping is its ``softcap``."""
        kernels.ops.reshape_and_cache(key, value, k_cache, v_cache, self.slot_mapping)
        options = dict(
            window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0),
            softcap=logits_soft_cap or 0.0,
        )
        if self.cu_seqlens_q is None:
            out = flash_attn_with_kvcache(
                query.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=self.seq_lens,
                block_table=self.block_tables,
                softmax_scale=scale,
                causal=True,
                **options,
            )
            return out.squeeze(1)
        return flash_attn_varlen_func(
            query,
            k_cache,
            v_cache,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_query_len,
            self.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=self.block_tables,
            **options,
        )


class FlashAttnBackend:
    """Builds a :class:`FlashAttnStep` per step, or over a graph runner's static buffers."""

    def build(self, batch) -> FlashAttnStep | TorchPagedAttentionStep:
        """``batch``: an ``InputBatch``; one with key limits: the pure-PyTorch step (see the
        module docstring)."""
        if batch.key_limits is not None:
            return TorchPagedAttentionBackend().build(batch)
        seq_lens = batch.seq_lens.to(torch.int32)
        decode_only = all(n == 1 for n in batch.query_lens)
        return FlashAttnStep(
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables.to(torch.int32),
            seq_lens=seq_lens,
            cu_seqlens_q=None if decode_only else batch.query_start_loc.to(torch.int32),
            cu_seqlens_k=None
            if decode_only
            else F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0)),
            max_query_len=max(batch.query_lens),
            max_seq_len=max(batch.seq_lens_list),
        )

    def build_decode(self, slot_mapping, block_tables, seq_lens, max_seq_len: int) -> FlashAttnStep:
        """A decode-only step over given tensors (the int32 copies are device ops a graph
        captures)."""
        return FlashAttnStep(
            slot_mapping,
            block_tables.to(torch.int32),
            seq_lens.to(torch.int32),
            None,
            None,
            1,
            max_seq_len,
        )
