"""Qwen2 / Qwen2.5 for the paged executor: Llama with biases on the Q, K and V projections.

Follows transformers' ``modeling_qwen2.py``; the checkpoint's ``q/k/v_proj.bias`` load into the
fused ``qkv_proj.bias`` through the same shard loader as the weights.
"""

from __future__ import annotations

import functools

from pyxllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM (``Qwen2ForCausalLM`` in config.json): Llama attention with a bias on the
    fused QKV projection (none on ``o_proj``); same interface as ``LlamaForCausalLM``.

    Raises:
        ValueError: a config with attention layer types other than full and sliding-window.
    """

    def __init__(self, config) -> None:
        super().__init__(config, attention=functools.partial(LlamaAttention, qkv_bias=True))
