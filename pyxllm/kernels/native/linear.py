"""The float linear layer's matmul: the reference every platform's ``linear`` must match."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]``, in ``x``'s dtype (``F.linear``,
    the layout of ``nn.Linear`` and of checkpoints). ``batch_invariant`` is taken for the
    platforms' signature: this reference promises nothing of the kind (BLAS may sum a row
    differently in batches of other sizes; see :func:`linear_is_row_invariant`)."""
    return F.linear(x, weight, bias)


def linear_is_row_invariant(weight: torch.Tensor) -> bool:
    """Whether ``linear(..., batch_invariant=True)`` over ``weight`` gives a row the same bits at
    any row count: never here (a platform with such a kernel says so for the weights it takes)."""
    return False


def lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_adapter: torch.Tensor,
    offsets: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """The LoRA deltas of rows using different adapters (vLLM's BGMV shrink then expand): row
    ``m`` with adapter ``g = row_adapter[m] >= 0`` gets ``(x[m] a_g^T) b_g^T`` with ``a_g =
    a[offsets[g] : offsets[g] + lens[g]]`` and ``b_g = b[:, offsets[g] : offsets[g] +
    lens[g]]``; a row with ``g = -1`` gets zeros.

    Args:
        x: ``float32 [T, in]``; a: ``float32 [S, in]`` (the adapters' A stacked); b: ``float32
            [out, S]`` (their B side by side); row_adapter: ``int64 [T]``; offsets, lens:
            ``int64 [num adapters]``, each adapter's columns of ``a`` and ``b``.
    Returns:
        ``float32 [T, out]``.
    """
    out = x.new_zeros(x.shape[0], b.shape[0])
    for g, (offset, length) in enumerate(zip(offsets.tolist(), lens.tolist())):
        rows = (row_adapter == g).nonzero().flatten()
        if len(rows):
            xa = F.linear(x.index_select(0, rows), a[offset : offset + length])
            out.index_copy_(0, rows, F.linear(xa, b[:, offset : offset + length]))
    return out
