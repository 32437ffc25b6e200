"""Cambricon MLU kernels: the pure-PyTorch ones, which torch_mlu runs on the card.

Fused MLU kernels (torch_mlu_ops' paged attention and cache writes) would override these here,
under the same names; none is bound yet because none has been checked on a card.
"""

from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401
