"""CPU kernels: the pure-PyTorch implementations (ATen's CPU SDPA, BLAS matmuls), ATen's CPU
weight-only int8/int4 matmuls (``kernels.cpu.quantized``), and fused C++ kernels for the ops
that run in every layer of a decode step (``kernels.cpu.fused``).

Importing the package builds nothing: the fused kernels are built (or loaded from the build
cache) when the platform binds the package, by :func:`on_bind`; where the build is not possible
the native ones stay.

A faster CPU kernel replaces its native counterpart here, under the same name and signature
(assigned after the star import, so that no import order can undo it).
"""

from pyxllm.kernels.cpu import fused as _fused
from pyxllm.kernels.cpu import quantized as _quantized
from pyxllm.kernels.native import *  # noqa: F401,F403
from pyxllm.kernels.native import __all__  # noqa: F401

int4_linear = _quantized.int4_linear
int8_linear = _quantized.int8_linear
pack_int4_weight = _quantized.pack_int4_weight
# ATen's int4 layout has no row reader: a token embedding tied to such an LM head keeps its own
# copy of the rows (see pyxllm.layers.quantization.stored)
int4_rows = None


def on_bind() -> None:
    """Called by :func:`pyxllm.kernels.bind`: build and load the fused kernels (at most once per
    process, see ``fused.load``) and put them in place of the native ones, under the same names;
    where they do not load (or ``PYXLLM_CPU_KERNELS=native``) the native ones stay."""
    if _fused.load() is not None:
        globals().update({name: getattr(_fused, name) for name in _fused.KERNELS})
