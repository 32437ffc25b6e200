"""The CPU platform: ``pyxllm.kernels.cpu`` (fused C++ kernels where they build, pure PyTorch
elsewhere), gloo for collectives, and bfloat16 by default where the CPU computes it natively
(float32 elsewhere).

Why bfloat16: decoding is bound by reading the weights, and bf16 halves them; on this project's
2-core Zen 4 machine (avx512_bf16) bf16 matmuls run about 2x faster than float32, at batch 1
and batched (docs/performance.md). Without native bf16 (no ``avx512_bf16``/``amx_bf16``) bf16
matmuls are converted on the fly and may be slower than float32, so float32 stays the default.
``PYXLLM_CPU_DEFAULT_DTYPE=float32|bfloat16`` overrides the choice (the test suite pins float32
so its exact-parity checks against transformers' float32 hold on any machine). Both are read
when the platform is loaded (:func:`load`), not when this module is imported.
"""

import functools
import os

import torch

from pyxllm.kernels.cpu.features import cpu_flags
from pyxllm.platforms.interface import TORCH_DTYPES, Platform, TorchScriptTraces

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What ``pyxllm env`` reports for this platform (``pyxllm.platforms.environment``): the package
# that provides it and the name prefixes of its shared libraries (torch's CPU library, its
# OpenMP, BLAS and oneDNN, and the fused kernels' build), and the environment variables that
# tune it.
PACKAGE = "torch"
SHARED_LIBRARIES = (
    "libtorch_cpu",
    "libc10.",
    "libgomp",
    "libiomp",
    "libmkl",
    "libdnnl",
    "libopenblas",
    "pyxllm_cpu_kernels",
)
ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "ONEDNN_", "DNNL_")
# what the CPU computes in (its fused kernels take these two); float16 becomes bfloat16
_CPU_DTYPES = (torch.float32, torch.bfloat16)


def cpu_default_dtype(
    flags: frozenset[str] | None = None, override: str | None = None
) -> torch.dtype:
    """What ``--dtype auto`` means on this CPU when the checkpoint declares no dtype (GGUF).

    Args:
        flags: CPU feature flags (default: :func:`cpu_flags`).
        override: ``float32`` or ``bfloat16`` (default: ``$PYXLLM_CPU_DEFAULT_DTYPE``).
    Raises:
        ValueError: an override that is neither.
    """
    override = override if override is not None else os.environ.get("PYXLLM_CPU_DEFAULT_DTYPE")
    if override:
        dtype = TORCH_DTYPES.get(override)
        if dtype not in _CPU_DTYPES:
            names = " or ".join(str(d).removeprefix("torch.") for d in _CPU_DTYPES)
            raise ValueError(f"PYXLLM_CPU_DEFAULT_DTYPE must be {names}, got {override!r}")
        return dtype
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if any(f in flags for f in _BF16_FLAGS) else torch.float32


def is_available() -> bool:
    """The CPU is always there."""
    return True


@functools.cache
def load() -> Platform:
    """The CPU platform (never fails); its ``default_dtype`` is :func:`cpu_default_dtype`'s,
    decided on the first call."""
    return Platform(
        name="cpu",
        torch_device="cpu",
        kernels_module="pyxllm.kernels.cpu",
        runners=("eager", "compile", "graph"),
        dist_backend="gloo",
        default_dtype=cpu_default_dtype(),
        float16_dtype=torch.bfloat16,
        graph_capture=TorchScriptTraces(),
        # TorchScript replays of decode steps: batch-1 decode of the default model 81 -> 117
        # tok/s on an AVX2 EPYC (docs/defaults.md)
        default_runner="graph",
        adaptive_threads=True,
    )
