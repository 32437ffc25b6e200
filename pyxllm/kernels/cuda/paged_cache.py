"""A KV-cache write that never syncs with the host, so CUDA graphs can capture it.

The native ``reshape_and_cache`` drops padded rows (negative slots) with a boolean mask, whose
size the host must read. Here every row writes, with nothing read back: a padded row is
redirected to the first real row's slot and carries that row's key and value, so the slot gets
the same bytes twice, whatever the order of the writes. When every row is padded, each one
writes slot 0's own content back to slot 0. Either way, no slot but the real rows' changes.
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``pyxllm.kernels.native.reshape_and_cache`` (same shapes; a negative slot, padding,
    writes nothing) with no host read, as the module docstring says."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    real = slot_mapping >= 0
    any_real = real.any()
    first_real = torch.argmax(real.to(torch.int32))  # 0 when no row is real
    rows = torch.where(real, torch.arange(real.shape[0], device=real.device), first_real)
    slots = torch.where(any_real, slot_mapping.index_select(0, rows), 0)
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        values = torch.where(any_real, src.index_select(0, rows).to(cache.dtype), flat[0])
        flat.index_copy_(0, slots, values)
