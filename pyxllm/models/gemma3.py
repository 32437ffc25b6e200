"""Gemma 3 (text) and Gemma 2 for the paged executor, on Llama's building blocks.

Follows transformers' ``modeling_gemma3.py`` and ``modeling_gemma2.py``:

- local and global layers interleave as ``config.layer_types`` says: a local layer attends over
  the last ``config.sliding_window`` tokens (``sliding_window_of``), and in Gemma 3 has its own
  RoPE (``rope_parameters["sliding_attention"]``, theta 10,000, while the global layers take
  ``rope_parameters["full_attention"]``, theta 1,000,000 and maybe a linear scaling);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``,
  and soft-capped where ``attn_logit_softcapping`` is set (Gemma 2: 50), see ``LlamaAttention``;
- Gemma 3 norms each head of q and k before RoPE (``Qwen3Attention``'s ``q_norm``/``k_norm``);
- four norms per layer: ``input_layernorm`` before attention, ``post_attention_layernorm`` on
  its output before the residual add, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` around the MLP (:class:`GemmaDecoderLayer`);
- the MLP is gated GELU-tanh (``hidden_activation``, ``gelu_pytorch_tanh``);
- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype, as transformers
  does; the LM head is tied to them; the final logits are soft-capped where
  ``final_logit_softcapping`` is set (Gemma 2: 30).

Gemma's RMSNorm scales by ``1 + w``. Every norm weight here is loaded as ``1 + w``, computed in
float32 from the checkpoint's ``w`` then stored in the model dtype (as llama.cpp's converter
stores it), so the norms are pyxllm's ``RMSNorm``. In float32 this equals transformers; in
bfloat16 ``1 + w`` is rounded once where transformers keeps it in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.layers.layernorm import RMSNorm
from pyxllm.layers.weight_utils import materialize
from pyxllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from pyxllm.models.qwen3 import Qwen3Attention
from pyxllm.models.weight_loading import default_weight_loader


def gemma_mlp(config, layer_idx: int) -> LlamaMLP:
    """Every layer's feed-forward block: ``down(gelu_tanh(gate(x)) * up(x))``."""
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    return LlamaMLP(config.hidden_size, config.intermediate_size, act)


class GemmaDecoderLayer(nn.Module):
    """Decoder block with a norm before and after both attention and MLP; the residual stream is
    carried beside the hidden states, as in ``LlamaDecoderLayer``."""

    def __init__(self, config, layer_idx: int, attention, mlp) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_idx)
        self.mlp = mlp(config, layer_idx)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class GemmaModel(LlamaModel):
    """``LlamaModel`` with :class:`GemmaDecoderLayer` s and embeddings scaled by
    ``sqrt(hidden_size)`` (``normalizer``, in the model dtype)."""

    def __init__(self, config, attention, mlp) -> None:
        super().__init__(config, attention, mlp, GemmaDecoderLayer)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer


def _one_plus_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Load a Gemma norm weight ``w`` as ``1 + w``, added in float32."""
    default_weight_loader(param, materialize(loaded).float() + 1)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text causal LM (``Gemma3ForCausalLM``, model_type ``gemma3_text``); see the module
    docstring. ``attention`` builds each layer's ``self_attn`` (Gemma 2 passes one without q/k
    norms).

    Raises:
        ValueError: a bidirectional config (``use_bidirectional_attention``, EmbeddingGemma) or
            attention layer types other than full and sliding-window.
    """

    def __init__(self, config, attention=Qwen3Attention) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "bidirectional Gemma attention (use_bidirectional_attention) is not supported"
            )
        super().__init__(config, attention, gemma_mlp, GemmaModel)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.weight_loader = _one_plus_loader
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if not cap else cap * torch.tanh(logits / cap)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 causal LM (``Gemma2ForCausalLM``): Gemma 3 without q/k norms, one RoPE for every
    layer, and soft-capped attention scores and final logits (50 and 30 in its configs)."""

    def __init__(self, config) -> None:
        super().__init__(config, attention=LlamaAttention)
