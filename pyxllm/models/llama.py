"""Llama (and SmolLM2, Mistral: Llama with a sliding window) for the paged executor, and the
decoder the Qwen models share.

Structure and weight names follow transformers' ``modeling_llama.py``; the checkpoint's separate
``q/k/v_proj`` and ``gate/up_proj`` load into fused parameters through ``packed_modules_mapping``.
A model that differs only in its attention or feed-forward block passes builders for them to
:class:`LlamaForCausalLM` (``attention=``, ``mlp=``), which keeps every weight name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pyxllm.layers.activation import get_act_and_mul_fn
from pyxllm.layers.attention import Attention
from pyxllm.layers.layernorm import RMSNorm
from pyxllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pyxllm.layers.rotary_embedding import RotaryEmbedding
from pyxllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pyxllm.models.build_context import max_model_len_of
from pyxllm.models.config_utils import (
    attention_scale_of,
    check_layer_types,
    head_dim_of,
    logits_soft_cap_of,
    rope_parameters,
    sliding_window_of,
)

# ``(config, layer index) -> module``: a decoder layer's ``self_attn`` or ``mlp``
ModuleBuilder = Callable[[Any, int], nn.Module]
# ``(config, layer index, attention, mlp) -> decoder layer``, e.g. ``LlamaDecoderLayer``
LayerBuilder = Callable[[Any, int, ModuleBuilder, ModuleBuilder], nn.Module]


class LlamaAttention(nn.Module):
    """Self-attention: fused QKV projection, RoPE, paged attention (over the layer's sliding
    window where the config gives one, see ``sliding_window_of``), output projection.

    The scale, soft cap and RoPE follow the config where it sets them (Gemma's
    ``query_pre_attn_scalar`` and ``attn_logit_softcapping``, a RoPE per layer type): see
    ``attention_scale_of``, ``logits_soft_cap_of`` and ``rope_parameters``; a model whose
    layers share one RoPE of its own passes it as ``rotary_emb`` (Phi-3's partial LongRoPE).
    """

    def __init__(
        self,
        config,
        layer_idx: int,
        qkv_bias: bool = False,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        if rotary_emb is None:
            base, scaling = rope_parameters(config, layer_idx)
            # positions run up to the engine's context length (--max-model-len), not the model's
            rotary_emb = RotaryEmbedding(self.head_dim, max_model_len_of(config), base, scaling)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            attention_scale_of(config),
            self.num_kv_heads,
            layer_idx,
            sliding_window=sliding_window_of(config, layer_idx),
            logits_soft_cap=logits_soft_cap_of(config),
        )

    def split_qkv(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``[T, hidden]`` to ``q [T, heads*head_dim]``, ``k`` and ``v [T,
        kv_heads*head_dim]``."""
        return self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        q, k = self.rotary_emb(
            positions,
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
        )
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` with gate and up fused; ``act`` is SiLU
    (SwiGLU) unless ``hidden_act`` names another (see ``get_act_and_mul_fn``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = get_act_and_mul_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def llama_mlp(config, layer_idx: int) -> LlamaMLP:
    """Every layer's feed-forward block: a SwiGLU MLP of ``config.intermediate_size``."""
    return LlamaMLP(config.hidden_size, config.intermediate_size)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; the residual stream is carried beside the hidden states.

    ``attention`` and ``mlp`` build the layer's ``self_attn`` and ``mlp`` from ``(config,
    layer_idx)``.
    """

    def __init__(
        self,
        config,
        layer_idx: int,
        attention: ModuleBuilder = LlamaAttention,
        mlp: ModuleBuilder = llama_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_idx)
        self.mlp = mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers (see :class:`LlamaDecoderLayer` for ``attention`` and ``mlp``;
    ``decoder_layer`` builds each layer) and final norm: ``(input_ids [T], positions [T]) -> [T,
    hidden]``. A decoder layer returns ``(hidden, residual)``, the final norm adds them."""

    def __init__(
        self,
        config,
        attention: ModuleBuilder = LlamaAttention,
        mlp: ModuleBuilder = llama_mlp,
        decoder_layer: LayerBuilder = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            decoder_layer(config, i, attention, mlp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]``: the token embeddings the first layer reads."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds [T, hidden]``, where given, replace the token embeddings of
        ``input_ids`` (a vision-language model's, with image features at its placeholders)."""
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM head over ``LlamaModel``; the LM head is tied to the embedding when the config says
    so.

    ``forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32, called on sampled positions only.
    ``attention`` and ``mlp`` build each decoder layer's blocks (see :class:`LlamaDecoderLayer`),
    ``model(config, attention, mlp)`` the ``LlamaModel`` (or a subclass) under the head.

    Raises:
        ValueError: a config with attention layer types other than full and sliding-window.
    """

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config,
        attention: ModuleBuilder = LlamaAttention,
        mlp: ModuleBuilder = llama_mlp,
        model: Callable[[Any, ModuleBuilder, ModuleBuilder], LlamaModel] = LlamaModel,
    ) -> None:
        check_layer_types(config)
        super().__init__()
        self.config = config
        self.model = model(config, attention, mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)
