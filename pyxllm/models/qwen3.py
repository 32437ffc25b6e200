"""Qwen3 (dense) for the paged executor: Llama-style attention with per-head RMSNorm on q and k.

Follows transformers' ``modeling_qwen3.py``: ``q_norm`` / ``k_norm`` (weight ``[head_dim]``) are
applied to each head of q and k after the projection and before RoPE; ``head_dim`` comes from the
config and may differ from ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

import torch

from pyxllm.layers.layernorm import RMSNorm
from pyxllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Self-attention with ``q_norm`` and ``k_norm`` over each head before RoPE.

    ``forward(positions [T] int64, hidden [T, hidden]) -> [T, hidden]``. The QKV projection has a
    bias only when ``config.attention_bias`` is set; ``rotary_emb``: a RoPE of the model's own
    (Qwen3-VL's mRoPE), else the config's.
    """

    def __init__(self, config, layer_idx: int, rotary_emb=None) -> None:
        super().__init__(
            config,
            layer_idx,
            qkv_bias=getattr(config, "attention_bias", False),
            rotary_emb=rotary_emb,
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM (``Qwen3ForCausalLM`` in config.json): ``Qwen3Attention`` and SwiGLU
    MLPs, tied or untied LM head.

    Raises:
        ValueError: a config with attention layer types other than full and sliding-window.
    """

    def __init__(self, config) -> None:
        super().__init__(config, attention=Qwen3Attention)
