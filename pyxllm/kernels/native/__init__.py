"""The pure-PyTorch kernels: the reference implementation and every platform's fallback."""
from pyxllm.kernels.native.elementwise import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul
from pyxllm.kernels.native.moe import fused_moe, fused_topk
from pyxllm.kernels.native.paged_attention import (
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)

__all__ = [
    "fused_add_rms_norm",
    "fused_moe",
    "fused_topk",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
