"""Ascend NPU kernels: torch_npu's fused ops where they exist, the pure-PyTorch ones elsewhere.

Untested here (no NPU on the development machines); ``pyxllm check-device --device npu`` checks
them against the CPU on a card. Imported only when the NPU platform is bound.
"""

from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401
from pyxllm.kernels.npu import fused as _fused

# assigned after the star import, so that no import order can put the native ones back
fused_add_rms_norm = _fused.fused_add_rms_norm
reshape_and_cache = _fused.reshape_and_cache
rms_norm = _fused.rms_norm
silu_and_mul = _fused.silu_and_mul
