"""Qwen2 / Qwen2.5 for the paged executor: Llama with biases on the Q, K and V projections.

Follows transformers' ``modeling_qwen2.py``; the checkpoint's ``q/k/v_proj.bias`` load into the
fused ``qkv_proj.bias`` through the same shard loader as the weights.
"""

from __future__ import annotations

from pyxllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def check_full_attention(config) -> None:
    """Reject configs whose layers use sliding-window attention (not implemented yet).

    Raises:
        ValueError: some ``config.layer_types`` entry is ``"sliding_attention"``.
    """
    sliding = [
        i
        for i, kind in enumerate(getattr(config, "layer_types", None) or [])
        if kind == "sliding_attention"
    ]
    if sliding:
        raise ValueError(
            f"sliding-window attention (layers {sliding[:4]}{'…' if len(sliding) > 4 else ''}) is "
            "not supported; "
            "use a checkpoint with use_sliding_window false"
        )


class Qwen2Attention(LlamaAttention):
    """Llama attention with a bias on the fused QKV projection (none on ``o_proj``)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx, qkv_bias=True)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """Pre-norm decoder block with ``Qwen2Attention``."""

    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    """Embedding, Qwen2 decoder layers, final norm: ``(input_ids [T], positions [T]) -> [T,
    hidden]``."""

    decoder_layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (``Qwen2ForCausalLM`` in config.json); same interface as
    ``LlamaForCausalLM``.

    Raises:
        ValueError: a config with sliding-window layers.
    """

    model_cls = Qwen2Model

    def __init__(self, config) -> None:
        check_full_attention(config)
        super().__init__(config)
