"""CUDA kernels: the pure-PyTorch ones, with a KV-cache write that CUDA graphs can capture.

Attention itself is the executor's backend (flash-attn's when installed, see
``pyxllm.attention.flash_attn``); kernels here stay importable without any CUDA package.
"""

from pyxllm.kernels.cuda.paged_cache import reshape_and_cache  # noqa: F401
from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401
