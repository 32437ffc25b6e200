"""Qwen3-MoE for the paged executor: Qwen3 attention with sparse mixture-of-experts MLPs.

Follows transformers' ``modeling_qwen3_moe.py``. Layer ``i`` has a sparse MoE block when
``num_experts > 0``, ``(i + 1) % decoder_sparse_step == 0`` and ``i not in mlp_only_layers``,
else a dense SwiGLU MLP of ``intermediate_size``. The checkpoint's per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` load into the stacked ``w13_weight`` / ``w2_weight``
of ``FusedMoE`` through ``expert_params_mapping``.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.layers.fused_moe import FusedMoE, make_expert_params_mapping
from pyxllm.layers.linear import ReplicatedLinear
from pyxllm.models.llama import LlamaForCausalLM, llama_mlp
from pyxllm.models.qwen3 import Qwen3Attention


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router ``gate`` (hidden -> num_experts, no bias, replicated) and the ``experts``.

    ``forward(hidden [T, hidden]) -> [T, hidden]``: softmax over the router's logits in float32,
    top ``num_experts_per_tok`` experts, renormalised when ``norm_topk_prob``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a Qwen3-MoE config has a sparse MoE block (see the module
    docstring)."""
    return (
        config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
        and layer_idx not in (config.mlp_only_layers or [])
    )


def qwen3_moe_mlp(config, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward block: a :class:`Qwen3MoeSparseMoeBlock` where
    :func:`is_sparse_layer`, else a dense SwiGLU MLP."""
    if is_sparse_layer(config, layer_idx):
        return Qwen3MoeSparseMoeBlock(config)
    return llama_mlp(config, layer_idx)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE causal LM (``Qwen3MoeForCausalLM`` in config.json): Qwen3 attention and
    :func:`qwen3_moe_mlp` blocks; same interface as ``LlamaForCausalLM``.

    Raises:
        ValueError: a config with attention layer types other than full and sliding-window, or
            ``moe_intermediate_size`` not divisible by the TP size.
    """

    expert_params_mapping = make_expert_params_mapping()

    def __init__(self, config) -> None:
        super().__init__(config, attention=Qwen3Attention, mlp=qwen3_moe_mlp)
