"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``) for the paged executor.

Follows transformers' ``modeling_phi3.py``: Llama's pre-norm decoder and SwiGLU MLP, with

- projections fused in the checkpoint already (``self_attn.qkv_proj``, ``mlp.gate_up_proj``):
  each loads whole into pyxllm's fused layer, whose loader cuts it into q/k/v (gate/up) and
  splits each piece by tensor-parallel rank, so there is no ``packed_modules_mapping``;
- a partial rotary factor (``partial_rotary_factor``, Phi-4-mini's 0.75): RoPE turns only the
  first ``head_dim * factor`` channels of each head;
- the config's ``sliding_window`` on every layer (Phi-3-mini-4k's 2047; see
  ``sliding_window_of``);
- LongRoPE scaling (``rope_scaling`` type ``longrope``, formerly ``su``: Phi-3-*-128k, Phi-3.5,
  Phi-4-mini) with ``short_factor``, ``long_factor``, ``original_max_position_embeddings`` and
  the attention factor. One set of factors serves every position, chosen from the context the
  engine serves: ``long_factor`` when ``--max-model-len`` exceeds
  ``original_max_position_embeddings``, else ``short_factor`` (vLLM's rule; see
  ``rotary_embedding._longrope_inv_freq`` for why, and where transformers, which picks per
  forward call by its longest position, differs).
"""

from __future__ import annotations

import functools

from pyxllm.layers.rotary_embedding import RotaryEmbedding
from pyxllm.models.build_context import max_model_len_of
from pyxllm.models.config_utils import head_dim_of, rope_parameters
from pyxllm.models.llama import LlamaAttention, LlamaForCausalLM


def partial_rotary_factor_of(config) -> float:
    """The rotated fraction of each head: transformers 5 keeps it in ``rope_parameters``, older
    configs (and config.json files) at the top level; 1.0 when neither says."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(getattr(config, "partial_rotary_factor", None) or 1.0)


def phi3_rotary_embedding(config) -> RotaryEmbedding:
    """The RoPE every layer shares: over the first ``head_dim * partial_rotary_factor`` channels,
    with ``--max-model-len`` positions (which picks LongRoPE's factors, see the module
    docstring)."""
    head_dim = head_dim_of(config)
    base, scaling = rope_parameters(config)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = dict(scaling)
        original = scaling.setdefault(
            "original_max_position_embeddings", config.original_max_position_embeddings
        )
        if scaling.get("factor") is None:  # as transformers: the ratio the model was extended by
            scaling["factor"] = config.max_position_embeddings / original
    rotary_dim = int(head_dim * partial_rotary_factor_of(config))
    return RotaryEmbedding(head_dim, max_model_len_of(config), base, scaling, rotary_dim)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini causal LM (``Phi3ForCausalLM`` in config.json): Llama's attention over
    the fused ``qkv_proj``, with one RoPE module shared by every layer (its cos/sin cache spans
    ``--max-model-len``), and
    Llama's SwiGLU MLP over the fused ``gate_up_proj``; tied or untied LM head.

    Raises:
        ValueError: an activation other than SiLU, or LongRoPE factors whose length is not half
            the rotary width.
    """

    packed_modules_mapping: dict = {}  # qkv_proj and gate_up_proj come fused in the checkpoint

    def __init__(self, config) -> None:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"Phi-3 with hidden_act {config.hidden_act!r} is not supported; supported: silu"
            )
        rotary_emb = phi3_rotary_embedding(config)
        super().__init__(config, attention=functools.partial(LlamaAttention, rotary_emb=rotary_emb))
