"""Pure-PyTorch mixture-of-experts kernels: top-k routing and the grouped expert MLP.

Numerics follow transformers' ``modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter`` and
``Qwen3MoeExperts``): softmax over experts in float32, top-k, optional renormalisation, then per
expert ``down(silu(gate(x)) * up(x)) * weight`` summed into the output in increasing expert order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's ``top_k`` experts from the router's logits.

    Args:
        router_logits: ``[num_tokens, num_experts]``, any float dtype.
        top_k: experts per token (``num_experts_per_tok``).
        renormalize: divide the chosen probabilities by their sum (``norm_topk_prob``).
    Returns:
        ``(topk_weights [num_tokens, top_k] in router_logits.dtype, topk_ids [num_tokens, top_k]
        int64)``;
        probabilities come from a float32 softmax over all experts.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The weighted sum of each token's chosen experts' SwiGLU MLPs.

    The ``(token, expert)`` pairs are sorted by expert (stable), and each expert that received
    tokens runs one pair of matmuls over all of them; results are scaled by their routing weight
    and added into the output with ``index_add_``, in increasing expert order.

    Args:
        hidden_states: ``[num_tokens, hidden]``.
        w13: ``[num_experts, 2 * inter, hidden]``, each expert's gate rows then up rows
            (``inter`` is this rank's slice of ``moe_intermediate_size`` under TP).
        w2: ``[num_experts, hidden, inter]``, each expert's down projection.
        topk_weights: ``[num_tokens, top_k]`` routing weights, in ``hidden_states.dtype``.
        topk_ids: ``[num_tokens, top_k]`` int64 expert ids in ``[0, num_experts)``.
    Returns:
        ``[num_tokens, hidden]`` in ``hidden_states.dtype``; under TP a partial sum that the
        caller all-reduces.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_idx = order // top_k
    weights = topk_weights.reshape(-1)[order].unsqueeze(-1)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    tokens = hidden_states.index_select(0, token_idx)
    out = torch.zeros_like(hidden_states)
    inter = w2.shape[-1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(tokens[start:end], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token_idx[start:end], F.linear(act, w2[expert]) * weights[start:end])
        start = end
    return out
