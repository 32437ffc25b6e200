"""The pure-PyTorch kernels: the reference implementation and every platform's fallback."""

from pyxllm.kernels.native.elementwise import (
    apply_rotary_emb,
    fused_add_rms_norm,
    rms_norm,
    rotary_cos_sin,
    rotary_embedding,
    silu_and_mul,
)
from pyxllm.kernels.native.linear import linear, linear_is_row_invariant, lora_delta
from pyxllm.kernels.native.moe import fused_moe, fused_topk
from pyxllm.kernels.native.paged_attention import (
    decode_attention_mask,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)
from pyxllm.kernels.native.quantized import (
    int4_linear,
    int4_rows,
    int8_group_linear,
    int8_group_rows,
    int8_linear,
    pack_int4_weight,
    pack_int8_group_weight,
    w8a8_linear,
)

__all__ = [
    "apply_rotary_emb",
    "decode_attention_mask",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_topk",
    "int4_linear",
    "int4_rows",
    "int8_group_linear",
    "int8_group_rows",
    "int8_linear",
    "linear",
    "linear_is_row_invariant",
    "lora_delta",
    "pack_int4_weight",
    "pack_int8_group_weight",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reshape_and_cache",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_embedding",
    "silu_and_mul",
    "w8a8_linear",
]
