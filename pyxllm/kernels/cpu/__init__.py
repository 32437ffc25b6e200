"""CPU kernels: the pure-PyTorch implementations (ATen's CPU SDPA, BLAS matmuls), and ATen's
CPU weight-only int8/int4 matmuls (``kernels.cpu.quantized``).

A faster CPU kernel replaces its native counterpart here, under the same name and signature.
"""
from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401
from pyxllm.kernels.cpu.quantized import int4_linear, int8_linear, pack_int4_weight  # noqa: F401
