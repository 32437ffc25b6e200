"""CUDA kernels: the pure-PyTorch ones, with a KV-cache write that CUDA graphs can capture.

Attention itself is the executor's backend (flash-attn's when installed, see
``pyxllm.attention.flash_attn``); kernels here stay importable without any CUDA package.
The capturable cache write is assigned after the star import, so that no import order can
replace it with the native one (which reads a value back to the host).
"""

from pyxllm.kernels.cuda import paged_cache as _paged_cache
from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401

reshape_and_cache = _paged_cache.reshape_and_cache
