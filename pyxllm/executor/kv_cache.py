"""Sizing and allocating the paged KV cache from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyxllm.kernels.native.paged_attention import INT8_KV_SCALE_BYTES
from pyxllm.layers.attention import Attention


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one layer's cache block and what a block costs across all layers.

    Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, row]`` of ``dtype``:
    ``row`` is ``head_dim``, or ``head_dim + 4`` for an int8 cache (each row's float32 scale
    after it, see ``pyxllm.kernels.native.paged_attention``).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: nn.Module, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        return cls(len(layers), block_size, layers[0].num_kv_heads, layers[0].head_dim, dtype)

    @property
    def row(self) -> int:
        """Elements of one token's K (or V) row of one head."""
        return self.head_dim + (INT8_KV_SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V for one block in every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row * elem

    def num_blocks_for(self, budget_bytes: float) -> int:
        """How many blocks fit in ``budget_bytes``.

        Raises:
            ValueError: not even one block fits (naming ``--kv-cache-memory`` and the block size in
                bytes).
        """
        num_blocks = int(budget_bytes // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"--kv-cache-memory: {budget_bytes / 2**30:.4g} GiB holds no KV block "
                f"(one block of {self.block_size} tokens needs {self.bytes_per_block} bytes)"
            )
        return num_blocks


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, platform, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed ``(k_cache, v_cache)`` per layer, each ``[num_blocks, block_size, num_kv_heads,
    spec.row]``, from ``platform.zeros`` (on the CPU resident only as blocks are first used)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.row)
    tensors = platform.zeros([shape] * (2 * spec.num_layers), spec.dtype, device)
    return list(zip(tensors[0::2], tensors[1::2], strict=True))
