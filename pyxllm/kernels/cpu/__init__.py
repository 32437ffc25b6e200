"""CPU kernels: the pure-PyTorch implementations (ATen's CPU SDPA, BLAS matmuls).

A faster CPU kernel replaces its native counterpart here, under the same name and signature.
"""
from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401
