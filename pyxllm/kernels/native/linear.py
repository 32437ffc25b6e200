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
    y: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    segments: list[torch.Tensor],
    row_adapter: torch.Tensor,
) -> None:
    """Add the LoRA deltas of rows using different adapters to ``y`` in place (vLLM's punica
    shrink then expand): row ``m`` with adapter ``g = row_adapter[m] >= 0`` gets ``xa = x[m]
    a[g]``, then for each module ``(out_start, out_len, rank_start, rank_len, b_offset)`` of
    ``segments[g]``, ``y[m, out_start : out_start + out_len] += xa[rank_start : rank_start +
    rank_len] @ b[g][b_offset : b_offset + rank_len * out_len].view(rank_len, out_len)``, in
    float32, rounded once to ``y``'s dtype. Rows with ``g = -1``, or whose ``a[g]`` is empty
    (the adapter does not adapt this layer), are left as they are.

    Args:
        y: ``[T, out]``, the base layer's output (float32 or bfloat16), added to in place.
        x: ``[T, in]``, the layer's input, ``y``'s dtype.
        a: per adapter ``[in, R]`` (its A matrices transposed, side by side; ``R`` a multiple
            of 8), float32 or bfloat16, or an empty tensor.
        b: per adapter, 1-D: each module's ``B * scaling`` transposed (``[rank, out]``), one
            after the other, ``a``'s dtype.
        segments: per adapter ``int64 [M, 5]``, one row per adapted module.
        row_adapter: ``int64 [T]``, each row's adapter (-1: none).
    """
    for g, (a_g, b_g, seg) in enumerate(zip(a, b, segments)):
        rows = (row_adapter == g).nonzero().flatten()
        if not len(rows) or not a_g.numel():
            continue
        xa = x.index_select(0, rows).float() @ a_g.float()
        out = y.index_select(0, rows).float()
        for out_start, out_len, rank_start, rank_len, b_offset in seg.tolist():
            b_mod = b_g[b_offset : b_offset + rank_len * out_len].view(rank_len, out_len)
            out[:, out_start : out_start + out_len] += (
                xa[:, rank_start : rank_start + rank_len] @ b_mod.float()
            )
        y.index_copy_(0, rows, out.to(y.dtype))
