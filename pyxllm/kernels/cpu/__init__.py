"""CPU kernels: the pure-PyTorch implementations (ATen's CPU SDPA, BLAS matmuls), ATen's CPU
weight-only int8/int4 matmuls (``kernels.cpu.quantized``), and fused C++ kernels for the ops
that run in every layer of a decode step (``kernels.cpu.fused``, built on first use; the native
ones stay where the build is not possible).

A faster CPU kernel replaces its native counterpart here, under the same name and signature.
"""

from pyxllm.kernels.cpu import fused as _fused
from pyxllm.kernels.cpu.quantized import int4_linear, int8_linear, pack_int4_weight  # noqa: F401
from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401

if _fused.load() is not None:
    from pyxllm.kernels.cpu.fused import (  # noqa: F401
        apply_rotary_emb,
        fused_add_rms_norm,
        paged_attention_decode,
        reshape_and_cache,
        rms_norm,
        silu_and_mul,
        w8a8_linear,
    )
